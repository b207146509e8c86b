//! The protobuf JSON mapping (as Go's `protojson` does it) of the two
//! messages `POST /json` carries: `RateLimitRequest` in, `RateLimitResponse`
//! out. envoy-types' prost messages have no serde, so the mapping is written
//! out here, for these messages only.
//!
//! In: field names in lowerCamelCase or as in the proto, integers as JSON
//! numbers or strings, enums by name or number, `null` for "not set";
//! unknown fields are refused, as protojson does. Out: lowerCamelCase,
//! enums by name, durations as `"1.500s"`, default values left out.
//! `raw_body` and `quota`, which ratekeeper never sets, are not mapped.

use std::fmt;
use std::marker::PhantomData;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::{value::Kind, Duration, Struct, UInt64Value};
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::service::caps;

/// Reads a `RateLimitRequest`; `Err` says what is wrong with the body.
/// Lists past the caps (`service::caps`) are refused as they are read, so
/// a body's parse costs memory in proportion to what may be evaluated, not
/// to what it holds (16 MiB of `{}` were 5.6 million descriptors, 0.9 GB).
pub fn parse_request(body: &[u8]) -> Result<RateLimitRequest, String> {
    ENTRIES_IN_REQUEST.set(0);
    let Object(raw): Object<JsonRequest> =
        serde_json::from_slice(body).map_err(|e| format!("bad RateLimitRequest JSON: {e}"))?;
    raw.into_request()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRequest {
    domain: Option<String>,
    #[serde(default, deserialize_with = "descriptors")]
    descriptors: Option<Vec<Object<JsonDescriptor>>>,
    #[serde(rename = "hitsAddend", alias = "hits_addend")]
    hits_addend: Option<Integer>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonDescriptor {
    #[serde(default, deserialize_with = "entries")]
    entries: Option<Vec<Object<JsonEntry>>>,
    limit: Option<Object<JsonOverride>>,
    /// A `google.protobuf.UInt64Value`: its JSON is the bare number.
    #[serde(rename = "hitsAddend", alias = "hits_addend")]
    hits_addend: Option<Integer>,
    #[serde(rename = "isNegativeHits", alias = "is_negative_hits")]
    is_negative_hits: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonEntry {
    key: Option<String>,
    value: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonOverride {
    #[serde(rename = "requestsPerUnit", alias = "requests_per_unit")]
    requests_per_unit: Option<Integer>,
    unit: Option<EnumValue>,
}

/// A message, read from a JSON object only (serde's derive takes an array
/// of the fields in order too; protojson does not).
struct Object<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<T>(PhantomData<T>);

        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
            type Value = T;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map))
            }
        }

        deserializer
            .deserialize_map(ObjectVisitor(PhantomData))
            .map(Object)
    }
}

/// A request's descriptors: at most [`caps::MAX_DESCRIPTORS`].
fn descriptors<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<Object<JsonDescriptor>>>, D::Error> {
    deserializer.deserialize_option(Capped::new(
        caps::MAX_DESCRIPTORS,
        caps::past_max_descriptors,
    ))
}

thread_local! {
    /// The entries of the request being parsed, all descriptors together
    /// (a parse runs on one thread, from [`parse_request`]'s start).
    static ENTRIES_IN_REQUEST: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// A descriptor's entries: at most [`caps::MAX_ENTRIES`], and at most
/// [`caps::MAX_REQUEST_ENTRIES`] in the request.
fn entries<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<Object<JsonEntry>>>, D::Error> {
    let capped = Capped::new(caps::MAX_ENTRIES, || {
        let max = caps::MAX_ENTRIES;
        format!("a descriptor has more than {max} entries: at most {max} are accepted")
    });
    deserializer.deserialize_option(Capped {
        each: Some(|| {
            let in_all = ENTRIES_IN_REQUEST.get() + 1;
            ENTRIES_IN_REQUEST.set(in_all);
            match in_all > caps::MAX_REQUEST_ENTRIES {
                true => Err(caps::past_max_entries(None)),
                false => Ok(()),
            }
        }),
        ..capped
    })
}

/// A JSON array (or `null`) of at most `max` elements: refused at the
/// element past them, as `too_long` says, or when `each` (called per
/// element) refuses one.
struct Capped<T> {
    max: usize,
    too_long: fn() -> String,
    each: Option<fn() -> Result<(), String>>,
    element: PhantomData<T>,
}

impl<T> Capped<T> {
    fn new(max: usize, too_long: fn() -> String) -> Self {
        Capped {
            max,
            too_long,
            each: None,
            element: PhantomData,
        }
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for Capped<T> {
    type Value = Option<Vec<T>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON array")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_seq(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            if items.len() == self.max {
                return Err(de::Error::custom((self.too_long)()));
            }
            if let Some(each) = self.each {
                each().map_err(de::Error::custom)?;
            }
            items.push(item);
        }
        Ok(Some(items))
    }
}

impl JsonRequest {
    fn into_request(self) -> Result<RateLimitRequest, String> {
        let descriptors = self.descriptors.unwrap_or_default();
        let descriptors = descriptors
            .into_iter()
            .enumerate()
            .map(|(i, Object(d))| d.into_descriptor(&format!("descriptors[{i}]")))
            .collect::<Result<_, _>>()?;
        Ok(RateLimitRequest {
            domain: self.domain.unwrap_or_default(),
            descriptors,
            hits_addend: uint32(self.hits_addend, "hitsAddend")?,
        })
    }
}

impl JsonDescriptor {
    fn into_descriptor(self, at: &str) -> Result<RateLimitDescriptor, String> {
        let limit = match self.limit {
            None => None,
            Some(Object(limit)) => Some(RateLimitOverride {
                requests_per_unit: uint32(
                    limit.requests_per_unit,
                    &format!("{at}.limit.requestsPerUnit"),
                )?,
                unit: match limit.unit {
                    None => 0,
                    Some(EnumValue::Number(n)) => n,
                    Some(EnumValue::Name(name)) => Unit::from_str_name(&name)
                        .ok_or_else(|| format!("{at}.limit.unit: no rate limit unit {name:?}"))?
                        as i32,
                },
            }),
        };
        Ok(RateLimitDescriptor {
            entries: (self.entries.unwrap_or_default().into_iter())
                .map(|Object(e)| Entry {
                    key: e.key.unwrap_or_default(),
                    value: e.value.unwrap_or_default(),
                })
                .collect(),
            limit,
            hits_addend: self.hits_addend.map(|n| UInt64Value { value: n.0 }),
            is_negative_hits: self.is_negative_hits.unwrap_or_default(),
        })
    }
}

fn uint32(value: Option<Integer>, field: &str) -> Result<u32, String> {
    let value = value.map_or(0, |n| n.0);
    u32::try_from(value).map_err(|_| format!("{field}: {value} does not fit in a uint32"))
}

/// An unsigned integer, as protojson reads one: a JSON number (`3`, `3.0`,
/// `3e0`), or a string holding one.
struct Integer(u64);

impl<'de> Deserialize<'de> for Integer {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(IntegerVisitor)
    }
}

struct IntegerVisitor;

impl Visitor<'_> for IntegerVisitor {
    type Value = Integer;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an unsigned integer (a number, or a string holding one)")
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Integer, E> {
        Ok(Integer(n))
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<Integer, E> {
        u64::try_from(n)
            .map(Integer)
            .map_err(|_| E::custom(format!("{n} is negative")))
    }

    fn visit_f64<E: de::Error>(self, n: f64) -> Result<Integer, E> {
        // Exactly representable integers only: 2^64 itself rounds into range.
        if n.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&n) {
            Ok(Integer(n as u64))
        } else {
            Err(E::custom(format!("{n} is not an unsigned integer")))
        }
    }

    /// As protojson: the string holds a JSON number and nothing around it
    /// (`"3"`, `"3.0"`, `"3e0"`; not `"+3"` nor `" 3"`), read as one.
    fn visit_str<E: de::Error>(self, text: &str) -> Result<Integer, E> {
        let number = (text.trim() == text)
            .then(|| serde_json::from_str::<serde_json::Number>(text).ok())
            .flatten()
            .ok_or_else(|| E::custom(format!("{text:?} is not an unsigned integer")))?;
        match (number.as_u64(), number.as_i64(), number.as_f64()) {
            (Some(n), _, _) => self.visit_u64(n),
            (None, Some(n), _) => self.visit_i64(n),
            (None, None, Some(n)) => self.visit_f64(n),
            _ => Err(E::custom(format!("{text:?} is not an unsigned integer"))),
        }
    }
}

/// An enum value: its name or its number.
enum EnumValue {
    Name(String),
    Number(i32),
}

impl<'de> Deserialize<'de> for EnumValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(EnumVisitor)
    }
}

struct EnumVisitor;

impl Visitor<'_> for EnumVisitor {
    type Value = EnumValue;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an enum name or number")
    }

    fn visit_str<E: de::Error>(self, name: &str) -> Result<EnumValue, E> {
        Ok(EnumValue::Name(name.to_owned()))
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<EnumValue, E> {
        i32::try_from(n)
            .map(EnumValue::Number)
            .map_err(|_| E::custom(format!("{n} is out of range for an enum")))
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<EnumValue, E> {
        i32::try_from(n)
            .map(EnumValue::Number)
            .map_err(|_| E::custom(format!("{n} is out of range for an enum")))
    }
}

/// Writes a `RateLimitResponse` as protojson does (compact).
pub fn response_json(response: &RateLimitResponse) -> Value {
    let mut out = Map::new();
    if response.overall_code != 0 {
        out.insert("overallCode".into(), code(response.overall_code));
    }
    if !response.statuses.is_empty() {
        let statuses = response.statuses.iter().map(status).collect();
        out.insert("statuses".into(), Value::Array(statuses));
    }
    for (name, headers) in [
        ("responseHeadersToAdd", &response.response_headers_to_add),
        ("requestHeadersToAdd", &response.request_headers_to_add),
    ] {
        if !headers.is_empty() {
            let headers = headers
                .iter()
                .map(|h| {
                    let mut header = Map::new();
                    put_string(&mut header, "key", &h.key);
                    put_string(&mut header, "value", &h.value);
                    Value::Object(header)
                })
                .collect();
            out.insert(name.into(), Value::Array(headers));
        }
    }
    if let Some(metadata) = &response.dynamic_metadata {
        out.insert("dynamicMetadata".into(), struct_json(metadata));
    }
    Value::Object(out)
}

fn status(status: &DescriptorStatus) -> Value {
    let mut out = Map::new();
    if status.code != 0 {
        out.insert("code".into(), code(status.code));
    }
    if let Some(limit) = &status.current_limit {
        out.insert("currentLimit".into(), rate_limit(limit));
    }
    if status.limit_remaining != 0 {
        out.insert("limitRemaining".into(), json!(status.limit_remaining));
    }
    if let Some(duration) = &status.duration_until_reset {
        out.insert("durationUntilReset".into(), duration_json(duration));
    }
    Value::Object(out)
}

fn rate_limit(limit: &RateLimit) -> Value {
    let mut out = Map::new();
    put_string(&mut out, "name", &limit.name);
    if limit.requests_per_unit != 0 {
        out.insert("requestsPerUnit".into(), json!(limit.requests_per_unit));
    }
    if limit.unit != 0 {
        let unit = Unit::try_from(limit.unit).map_or(json!(limit.unit), |u| json!(u.as_str_name()));
        out.insert("unit".into(), unit);
    }
    Value::Object(out)
}

fn code(code: i32) -> Value {
    Code::try_from(code).map_or(json!(code), |c| json!(c.as_str_name()))
}

fn put_string(out: &mut Map<String, Value>, name: &str, value: &str) {
    if !value.is_empty() {
        out.insert(name.into(), json!(value));
    }
}

/// `1.5 s` -> `"1.500s"`: 0, 3, 6 or 9 fractional digits, as protojson.
pub fn duration_json(duration: &Duration) -> Value {
    let negative = duration.seconds < 0 || duration.nanos < 0;
    let (seconds, nanos) = (
        duration.seconds.unsigned_abs(),
        duration.nanos.unsigned_abs(),
    );
    let mut text = format!("{}{seconds}.{nanos:09}", if negative { "-" } else { "" });
    for _ in 0..2 {
        if text.ends_with("000") {
            text.truncate(text.len() - 3);
        }
    }
    if let Some(whole) = text.strip_suffix(".000") {
        text.truncate(whole.len());
    }
    json!(format!("{text}s"))
}

/// A `google.protobuf.Struct` is its JSON object.
fn struct_json(value: &Struct) -> Value {
    let fields = value
        .fields
        .iter()
        .map(|(name, value)| (name.clone(), value_json(value.kind.as_ref())))
        .collect();
    Value::Object(fields)
}

/// A double as Go's protojson writes it: a whole one without a fraction
/// (`1`, where serde writes `1.0`), up to 2^63 in magnitude (every whole
/// double there is an exact i64); -0 is written as 0.
fn number_json(n: f64) -> Value {
    const I64_RANGE: f64 = 9_223_372_036_854_775_808.0;
    if n.fract() == 0.0 && n.abs() < I64_RANGE {
        return json!(n as i64);
    }
    json!(n)
}

fn value_json(kind: Option<&Kind>) -> Value {
    match kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::NumberValue(n)) if n.is_finite() => number_json(*n),
        // JSON has no NaN or infinities: protojson writes them as strings.
        Some(Kind::NumberValue(n)) if n.is_nan() => json!("NaN"),
        Some(Kind::NumberValue(n)) => json!(if *n > 0.0 { "Infinity" } else { "-Infinity" }),
        Some(Kind::StringValue(s)) => json!(s),
        Some(Kind::BoolValue(b)) => json!(b),
        Some(Kind::StructValue(s)) => struct_json(s),
        Some(Kind::ListValue(list)) => Value::Array(
            list.values
                .iter()
                .map(|v| value_json(v.kind.as_ref()))
                .collect(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_are_written_as_gos_protojson_writes_them() {
        let written = |n: f64| value_json(Some(&Kind::NumberValue(n))).to_string();
        for (n, text) in [
            (1.0, "1"),
            (-3.0, "-3"),
            (0.0, "0"),
            (1.5, "1.5"),
            (0.1, "0.1"),
            (9_007_199_254_740_991.0, "9007199254740991"),
            (1e16, "10000000000000000"),
            (-0.0, "0"),
        ] {
            assert_eq!(written(n), text, "{n}");
        }
        assert_eq!(written(f64::NAN), "\"NaN\"");
    }

    #[test]
    fn requests_read_both_field_spellings_and_both_integer_forms() {
        let camel = br#"{"domain": "web", "hitsAddend": "3", "descriptors": [
            {"entries": [{"key": "user", "value": "a"}, {"key": "path"}],
             "hitsAddend": 7, "limit": {"requestsPerUnit": 10, "unit": "MINUTE"}}]}"#;
        let proto = br#"{"domain": "web", "hits_addend": 3, "descriptors": [
            {"entries": [{"key": "user", "value": "a"}, {"key": "path", "value": null}],
             "hits_addend": "7e0", "limit": {"requests_per_unit": 10.0, "unit": 2}}]}"#;
        for body in [&camel[..], &proto[..]] {
            let request = parse_request(body).unwrap();
            assert_eq!(request.domain, "web");
            assert_eq!(request.hits_addend, 3);
            let descriptor = &request.descriptors[0];
            assert_eq!(descriptor.entries[0].key, "user");
            assert_eq!(descriptor.entries[1].value, "");
            assert_eq!(descriptor.hits_addend, Some(UInt64Value { value: 7 }));
            let limit = descriptor.limit.as_ref().unwrap();
            assert_eq!(
                (limit.requests_per_unit, limit.unit),
                (10, Unit::Minute as i32)
            );
        }
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let cases: [(&[u8], &str); 11] = [
            (b"{", "EOF"),
            (
                br#"{"hitsAddend": "+3"}"#,
                "\"+3\" is not an unsigned integer",
            ),
            (
                br#"{"hitsAddend": " 3"}"#,
                "\" 3\" is not an unsigned integer",
            ),
            (br#"{"hitsAddend": "-1"}"#, "-1 is negative"),
            (
                br#"{"hitsAddend": "1.5"}"#,
                "1.5 is not an unsigned integer",
            ),
            (br#"{"domian": "web"}"#, "unknown field `domian`"),
            (br#"{"hitsAddend": -1}"#, "-1 is negative"),
            (br#"{"hitsAddend": 4294967296}"#, "does not fit in a uint32"),
            (br#"{"hitsAddend": 1.5}"#, "1.5 is not an unsigned integer"),
            (
                br#"{"descriptors": [{"limit": {"unit": "FORTNIGHT"}}]}"#,
                "descriptors[0].limit.unit: no rate limit unit \"FORTNIGHT\"",
            ),
            (br#"{"descriptors": {}}"#, "invalid type: map"),
        ];
        for (body, expected) in cases {
            let error = parse_request(body).unwrap_err();
            assert!(error.contains(expected), "{error:?} lacks {expected:?}");
        }
    }

    /// Messages are JSON objects only: serde's derive would take their
    /// fields as an array, in order.
    #[test]
    fn arrays_in_place_of_messages_are_refused() {
        for body in [
            r#"["d", [], 1]"#,
            r#"{"domain": "d", "descriptors": [[[["k", "v"]]]]}"#,
            r#"{"domain": "d", "descriptors": [{"entries": [["k", "v"]]}]}"#,
            r#"{"domain": "d", "descriptors": [{"limit": [5, "SECOND"]}]}"#,
        ] {
            let error = parse_request(body.as_bytes()).unwrap_err();
            assert!(error.contains("expected a JSON object"), "{body}: {error}");
        }
    }

    /// Lists past the caps are refused as they are read, not once a body
    /// of millions has been held.
    #[test]
    fn lists_past_the_caps_are_refused_while_read() {
        let list = |n: usize, item: &str| vec![item; n].join(",");
        let descriptors = |n| format!(r#"{{"domain": "d", "descriptors": [{}]}}"#, list(n, "{}"));
        let request = parse_request(descriptors(1024).as_bytes()).expect("1024 descriptors");
        assert_eq!(request.descriptors.len(), 1024);
        let error = parse_request(descriptors(5_000_000).as_bytes()).unwrap_err();
        assert!(
            error.contains("more than 1024 descriptors: at most 1024 are accepted per request"),
            "{error}"
        );
        let entries = |n| {
            let entry = r#"{"key": "k", "value": "v"}"#;
            format!(
                r#"{{"domain": "d", "descriptors": [{{"entries": [{}]}}]}}"#,
                list(n, entry)
            )
        };
        assert!(parse_request(entries(caps::MAX_ENTRIES).as_bytes()).is_ok());
        let error = parse_request(entries(caps::MAX_ENTRIES + 1).as_bytes()).unwrap_err();
        assert!(
            error.contains("a descriptor has more than 2048 entries: at most 2048 are accepted"),
            "{error}"
        );
        assert!(parse_request(br#"{"descriptors": null}"#).is_ok());
        // All descriptors' entries together, counted as read too (and
        // afresh for each request).
        let wide = |descriptors: usize, entries: usize| {
            let descriptor = format!(r#"{{"entries": [{}]}}"#, list(entries, "{}"));
            format!(
                r#"{{"domain": "d", "descriptors": [{}]}}"#,
                list(descriptors, &descriptor)
            )
        };
        let full = wide(32, caps::MAX_REQUEST_ENTRIES / 32);
        assert!(parse_request(full.as_bytes()).is_ok());
        assert!(parse_request(full.as_bytes()).is_ok(), "counted afresh");
        let error = parse_request(wide(40, 2000).as_bytes()).unwrap_err();
        assert!(
            error.contains("more than 65536 entries in all: at most 65536 are accepted"),
            "{error}"
        );
    }

    #[test]
    fn durations_keep_0_3_6_or_9_decimals() {
        let cases = [
            ((1, 500_000_000), "1.500s"),
            ((3, 0), "3s"),
            ((0, 1_000), "0.000001s"),
            ((0, 1), "0.000000001s"),
            ((-1, -500_000_000), "-1.500s"),
        ];
        for ((seconds, nanos), expected) in cases {
            assert_eq!(duration_json(&Duration { seconds, nanos }), json!(expected));
        }
    }

    #[test]
    fn responses_leave_default_fields_out_and_name_enums() {
        let response = RateLimitResponse {
            overall_code: Code::OverLimit as i32,
            statuses: vec![
                DescriptorStatus {
                    code: Code::OverLimit as i32,
                    current_limit: Some(RateLimit {
                        name: String::new(),
                        requests_per_unit: 2,
                        unit: Unit::Minute as i32,
                    }),
                    limit_remaining: 0,
                    duration_until_reset: Some(Duration {
                        seconds: 59,
                        nanos: 250_000_000,
                    }),
                    quota: None,
                },
                DescriptorStatus::default(),
            ],
            ..Default::default()
        };
        assert_eq!(
            response_json(&response),
            json!({
                "overallCode": "OVER_LIMIT",
                "statuses": [
                    {"code": "OVER_LIMIT",
                     "currentLimit": {"requestsPerUnit": 2, "unit": "MINUTE"},
                     "durationUntilReset": "59.250s"},
                    {}
                ]
            })
        );
    }
}
