//! Finds the line of a node in a YAML text by its path
//! (`descriptors[2].rate_limit`), so a compile error, which knows only the
//! path, can name the line. serde_yaml keeps no positions in parsed values;
//! its errors carry one. So this walks the document again and fails on
//! purpose at the node: the error's position is the node's line. Runs only
//! when a config is refused, but for [`repeated_key`], which reads each
//! document with merge keys once more (those are read whole, and their
//! repeated keys have no error to name them).

use std::cell::{Cell, RefCell};
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// The line of the node at `at` in document `doc` (from 0) of `text`,
/// counted from the start of the text; `None` for an empty path or a path
/// not in the document.
pub fn line_of(text: &str, doc: usize, at: &str) -> Option<usize> {
    if at.is_empty() {
        return None;
    }
    let mut steps = Vec::new();
    for part in at.split('.') {
        match part.split_once('[') {
            Some((field, index)) => {
                steps.push(Step::Field(field));
                steps.push(Step::Index(index.strip_suffix(']')?.parse().ok()?));
            }
            None => steps.push(Step::Field(part)),
        }
    }
    let document = serde_yaml::Deserializer::from_str(text).nth(doc)?;
    match (Seek { steps: &steps }).deserialize(document) {
        Err(e) if e.to_string().contains(FOUND) => e.location().map(|l| l.line()),
        _ => None,
    }
}

/// The line where mapping key `key` is written in document `doc` of
/// `text`: where an error that names a key but has no position of its own
/// (a document read whole, then merged) points to. `None` when no mapping
/// has it, and when it is written on more than one line (which one the
/// error means is not known; an alias repeats its anchor's keys at the
/// anchor's line).
pub fn line_of_key(text: &str, doc: usize, key: &str) -> Option<usize> {
    const LOOKS: usize = 16;
    let nth = |n: usize| {
        let seen = Cell::new(0);
        let walk = Walk::Key {
            key,
            seen: &seen,
            stop_at: n,
        };
        found_at(text, doc, walk)
    };
    let first = nth(0)?;
    (1..LOOKS)
        .map(nth)
        .take_while(Option::is_some)
        .all(|line| line == Some(first))
        .then_some(first)
}

/// The first key written twice in one mapping of document `doc` of `text`
/// (in document order), and the line of its second value: the warning a
/// document read whole (one with merge keys) gives for it, as the typed
/// reading's error gives it for the others.
pub fn repeated_key(text: &str, doc: usize) -> Option<(usize, String)> {
    let repeated = RefCell::new(None);
    let line = found_at(
        text,
        doc,
        Walk::Repeat {
            repeated: &repeated,
        },
    )?;
    repeated.into_inner().map(|key| (line, key))
}

/// The line where `walk` found what it looks for in document `doc`.
fn found_at(text: &str, doc: usize, walk: Walk<'_>) -> Option<usize> {
    let document = serde_yaml::Deserializer::from_str(text).nth(doc)?;
    match walk.deserialize(document) {
        Err(e) if e.to_string().contains(FOUND) => e.location().map(|l| l.line()),
        _ => None,
    }
}

const FOUND: &str = "(node found)";

enum Step<'a> {
    Field(&'a str),
    Index(usize),
}

/// Walks `steps` into a document and fails with [`FOUND`] at the node.
struct Seek<'s, 'a> {
    steps: &'s [Step<'a>],
}

impl Seek<'_, '_> {
    fn scalar<E: de::Error>(&self) -> Result<(), E> {
        match self.steps {
            [] => Err(E::custom(FOUND)),
            _ => Ok(()),
        }
    }
}

impl<'de> DeserializeSeed<'de> for Seek<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Seek<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a node on the path")
    }
    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<(), M::Error> {
        let Some((Step::Field(field), rest)) = self.steps.split_first() else {
            return Err(de::Error::custom(FOUND));
        };
        while let Some(key) = map.next_key::<String>()? {
            if key == *field {
                return map.next_value_seed(Seek { steps: rest });
            }
            map.next_value::<IgnoredAny>()?;
        }
        Ok(())
    }
    // A scalar is the node when the path ends at it (`domain`), else the
    // path goes on past a leaf: not in the document.
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        self.scalar()
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.scalar()
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.scalar()
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.scalar()
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.scalar()
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.scalar()
    }
    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<(), S::Error> {
        let Some((Step::Index(index), rest)) = self.steps.split_first() else {
            return Err(de::Error::custom(FOUND));
        };
        for _ in 0..*index {
            if seq.next_element::<IgnoredAny>()?.is_none() {
                return Ok(());
            }
        }
        seq.next_element_seed(Seek { steps: rest }).map(|_| ())
    }
}

/// Walks a whole document and fails with [`FOUND`] at the value of the
/// mapping key it looks for.
#[derive(Clone, Copy)]
enum Walk<'w> {
    /// Key `key`, once `stop_at` of them were met (`seen`).
    Key {
        key: &'w str,
        seen: &'w Cell<usize>,
        stop_at: usize,
    },
    /// The first key repeated in its mapping, kept in `repeated`.
    Repeat {
        repeated: &'w RefCell<Option<String>>,
    },
}

impl Walk<'_> {
    /// Whether `key`, after `keys` in its mapping, is the one looked for.
    fn is_it(&self, key: &serde_yaml::Value, keys: &[serde_yaml::Value]) -> bool {
        match self {
            Walk::Key {
                key: name,
                seen,
                stop_at,
            } => {
                if key.as_str() != Some(name) {
                    return false;
                }
                seen.set(seen.get() + 1);
                seen.get() > *stop_at
            }
            Walk::Repeat { repeated } => {
                let again = keys.contains(key);
                if again {
                    let name = key
                        .as_str()
                        .map_or_else(|| format!("{key:?}"), str::to_owned);
                    *repeated.borrow_mut() = Some(name);
                }
                again
            }
        }
    }
}

impl<'de> DeserializeSeed<'de> for Walk<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }
    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<(), M::Error> {
        let mut keys = Vec::new();
        while let Some(key) = map.next_key::<serde_yaml::Value>()? {
            if self.is_it(&key, &keys) {
                return map.next_value_seed(Seek { steps: &[] });
            }
            keys.push(key);
            map.next_value_seed(self)?;
        }
        Ok(())
    }
    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<(), S::Error> {
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
}
