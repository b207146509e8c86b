//! A YAML document read as envoyproxy/ratelimit's loader (yaml.v2) reads
//! one with a key twice in a mapping: the last one counts, except that a
//! repeated `rate_limit` or `metadata` mapping adds to the first (yaml.v2
//! decodes a struct pointer or map field into the value already there, and
//! those are their format's only such fields; a list or a scalar is made
//! anew). serde_yaml refuses such a mapping, and a file their service
//! starts with must start ours too; the loader warns, as a repeated key is
//! most often a mistake.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess};
use serde_yaml::value::{Tag, TaggedValue};
use serde_yaml::{Mapping, Value};

/// A document's value, each mapping holding the last of a repeated key.
pub struct LastWins(pub Value);

impl<'de> Deserialize<'de> for LastWins {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValueVisitor).map(LastWins)
    }
}

struct ValueVisitor;

impl<'de> de::Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }

    fn visit_f64<E>(self, n: f64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }

    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_owned()))
    }

    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        LastWins::deserialize(d).map(|v| v.0)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(LastWins(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Sequence(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut mapping = Mapping::new();
        while let Some((LastWins(key), LastWins(item))) = map.next_entry()? {
            match (mapping.get_mut(&key), item) {
                (Some(Value::Mapping(first)), Value::Mapping(later)) if adds_up(&key) => {
                    first.extend(later);
                }
                // Replaces a repeated key's item, where the key first stood.
                (_, item) => {
                    mapping.insert(key, item);
                }
            }
        }
        Ok(Value::Mapping(mapping))
    }

    /// A tagged value (`!tag value`), which serde_yaml hands over as an enum.
    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Value, A::Error> {
        let (tag, variant): (String, _) = data.variant()?;
        let LastWins(value) = variant.newtype_variant()?;
        Ok(Value::Tagged(Box::new(TaggedValue {
            tag: Tag::new(tag),
            value,
        })))
    }
}

/// Whether a repeated `key`'s mapping adds to the first one's.
fn adds_up(key: &Value) -> bool {
    matches!(key.as_str(), Some("rate_limit" | "metadata"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_key_keeps_the_last_item_where_the_first_stood() {
        let text = "a: 1\nb: {x: 1, x: 2}\na: [3, {y: z}]\nc: !t v\n";
        let doc = serde_yaml::Deserializer::from_str(text).next().unwrap();
        let LastWins(value) = LastWins::deserialize(doc).unwrap();
        let expected: Value = serde_yaml::from_str("a: [3, {y: z}]\nb: {x: 2}\nc: !t v\n").unwrap();
        assert_eq!(value, expected);
        assert_eq!(
            value.as_mapping().unwrap().keys().collect::<Vec<_>>(),
            ["a", "b", "c"]
        );
    }

    #[test]
    fn a_repeated_rate_limit_or_metadata_mapping_adds_to_the_first() {
        let text = "rate_limit: {unit: minute, requests_per_unit: 2}\n\
                    metadata: {a: {x: 1}, a: {y: 2}, b: 1}\n\
                    rate_limit: {requests_per_unit: 7}\n\
                    metadata: {c: 3}\n\
                    other: {p: 1}\n\
                    other: {q: 2}\n\
                    rate_limit: none\n";
        let doc = serde_yaml::Deserializer::from_str(text).next().unwrap();
        let LastWins(value) = LastWins::deserialize(doc).unwrap();
        let expected: Value = serde_yaml::from_str(
            "rate_limit: none\nmetadata: {a: {y: 2}, b: 1, c: 3}\nother: {q: 2}\n",
        )
        .unwrap();
        assert_eq!(value, expected);
    }
}
