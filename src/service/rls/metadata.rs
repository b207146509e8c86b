//! envoyproxy/ratelimit's `RESPONSE_DYNAMIC_METADATA`: the request, and the
//! `metadata` of the rules it passed, as the response's `dynamic_metadata`.
//! Field by field their `ratelimitToMetadata` (`src/service/ratelimit.go`):
//!
//! - `domain`: the request's domain;
//! - `descriptors`: one struct per descriptor: `entries` (`"key=value"`
//!   strings), `limit` (the override in protobuf text form, when set) and
//!   `hitsAddend` (when the descriptor sets one, 0 included);
//! - `hitsAddend`: the request's, when not 0;
//! - `metadata`: the `metadata` of each matched rule whose descriptor was not
//!   OVER_LIMIT, merged in request order (structs merge key by key, the first
//!   value of any other kind stays); absent when empty.

use std::collections::HashMap;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};

use super::plan::Applied;

/// The response's `dynamic_metadata` for `request`, whose descriptors got
/// `applied` (empty for an unknown domain) and were answered `statuses`.
pub fn dynamic_metadata(
    request: &RateLimitRequest,
    applied: &[Applied<'_>],
    statuses: &[DescriptorStatus],
) -> Struct {
    let mut fields = HashMap::new();
    fields.insert("domain".into(), string(request.domain.clone()));
    let descriptors = request.descriptors.iter().map(descriptor).collect();
    fields.insert("descriptors".into(), list(descriptors));
    if request.hits_addend != 0 {
        fields.insert("hitsAddend".into(), number(request.hits_addend as f64));
    }
    let mut passed = Struct::default();
    for (applied, status) in applied.iter().zip(statuses) {
        let Applied::Counted {
            rule: Some(rule), ..
        } = applied
        else {
            continue;
        };
        if let (Some(metadata), false) = (&rule.metadata, status.code == Code::OverLimit as i32) {
            merge(&mut passed, metadata);
        }
    }
    if !passed.fields.is_empty() {
        fields.insert("metadata".into(), value(Kind::StructValue(passed)));
    }
    Struct { fields }
}

fn descriptor(descriptor: &RateLimitDescriptor) -> Value {
    let mut fields = HashMap::new();
    let entries = descriptor
        .entries
        .iter()
        .map(|e| string(format!("{}={}", e.key, e.value)))
        .collect();
    fields.insert("entries".into(), list(entries));
    if let Some(limit) = &descriptor.limit {
        fields.insert("limit".into(), string(override_text(limit)));
    }
    if let Some(hits) = &descriptor.hits_addend {
        fields.insert("hitsAddend".into(), number(hits.value as f64));
    }
    value(Kind::StructValue(Struct { fields }))
}

/// An override as Go's `String()` of the message prints it: protobuf text,
/// fields at their zero value left out.
fn override_text(limit: &RateLimitOverride) -> String {
    let mut parts = Vec::new();
    if limit.requests_per_unit != 0 {
        parts.push(format!("requests_per_unit:{}", limit.requests_per_unit));
    }
    if limit.unit != 0 {
        match Unit::try_from(limit.unit) {
            Ok(unit) => parts.push(format!("unit:{}", unit.as_str_name())),
            Err(_) => parts.push(format!("unit:{}", limit.unit)),
        }
    }
    parts.join(" ")
}

/// Their `mergeMetadata`: a key already present keeps its value, unless
/// both are structs, which merge.
fn merge(into: &mut Struct, from: &Struct) {
    for (key, new) in &from.fields {
        match into.fields.get_mut(key) {
            None => {
                into.fields.insert(key.clone(), new.clone());
            }
            Some(Value {
                kind: Some(Kind::StructValue(old)),
            }) => {
                if let Some(Kind::StructValue(new)) = &new.kind {
                    merge(old, new);
                }
            }
            Some(_) => {}
        }
    }
}

fn value(kind: Kind) -> Value {
    Value { kind: Some(kind) }
}

fn string(s: String) -> Value {
    value(Kind::StringValue(s))
}

fn number(n: f64) -> Value {
    value(Kind::NumberValue(n))
}

fn list(values: Vec<Value>) -> Value {
    value(Kind::ListValue(ListValue { values }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structs_merge_and_other_values_keep_the_first() {
        let s = |pairs: Vec<(&str, Value)>| Struct {
            fields: pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
        };
        let mut into = s(vec![
            ("a", string("first".into())),
            ("n", value(Kind::StructValue(s(vec![("x", number(1.0))])))),
        ]);
        let from = s(vec![
            ("a", string("second".into())),
            ("b", number(2.0)),
            (
                "n",
                value(Kind::StructValue(s(vec![
                    ("x", number(9.0)),
                    ("y", number(3.0)),
                ]))),
            ),
        ]);
        merge(&mut into, &from);
        let expected = s(vec![
            ("a", string("first".into())),
            ("b", number(2.0)),
            (
                "n",
                value(Kind::StructValue(s(vec![
                    ("x", number(1.0)),
                    ("y", number(3.0)),
                ]))),
            ),
        ]);
        assert_eq!(into, expected);
    }

    #[test]
    fn an_override_prints_as_protobuf_text() {
        let limit = |requests_per_unit, unit| RateLimitOverride {
            requests_per_unit,
            unit,
        };
        assert_eq!(
            override_text(&limit(42, 3)),
            "requests_per_unit:42 unit:HOUR"
        );
        assert_eq!(override_text(&limit(0, 1)), "unit:SECOND");
        assert_eq!(override_text(&limit(5, 0)), "requests_per_unit:5");
        assert_eq!(override_text(&limit(5, 99)), "requests_per_unit:5 unit:99");
    }
}
