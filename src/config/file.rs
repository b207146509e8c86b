//! The file source: one limits file in envoyproxy/ratelimit's YAML format
//! (plus ratekeeper's additions), read into [`DomainDescription`]s and
//! compiled by [`compile`]. Unknown keys are refused; what their loader
//! accepts loads (a top-level `name`, `null` blocks, `value: ""`, empty
//! `replaces` and `name`). A file may hold several YAML documents, one
//! domain each.

use std::fmt;
use std::path::Path;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use super::compile::{compile, CompileError};
use super::description::{self as desc, DomainDescription};
use super::yaml_lines::line_of;
use super::DomainConfig;
use crate::duration::parse_duration;
use crate::error::ConfigError;
use crate::limiter::{Algorithm, Unit};
use crate::vocab::FailureMode;

// src/service/ reads the lease TTL bounds from here.
pub use super::compile::{DEFAULT_LEASE_TTL, LEASE_TTL_RANGE};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    /// envoyproxy/ratelimit's `RateLimitConfig.name` (Envoy Gateway writes
    /// it); not used.
    #[allow(dead_code)]
    name: Option<Scalar>,
    domain: Option<Scalar>,
    descriptors: Option<Vec<RawDescriptor>>,
    /// ratekeeper: `false` keeps Envoy's count-everything behaviour.
    all_or_nothing: Option<bool>,
    /// ratekeeper: RateLimit-* response headers for this domain (overrides the flag).
    response_headers: Option<bool>,
    /// ratekeeper: concurrent-connection limits, a descriptor tree of their own.
    concurrency: Option<Vec<RawConcurrency>>,
    /// ratekeeper: the answer while the store fails (overrides the flag).
    failure_mode: Option<FailureModeName>,
    /// ratekeeper: `charges:` for the limits that set none.
    charges: Option<ChargesName>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescriptor {
    key: Option<Scalar>,
    value: Option<Scalar>,
    rate_limit: Option<RawRateLimit>,
    /// ratekeeper: several limits on one descriptor, all checked.
    rate_limits: Option<Vec<RawRateLimit>>,
    descriptors: Option<Vec<RawDescriptor>>,
    shadow_mode: Option<bool>,
    detailed_metric: Option<bool>,
    quota_mode: Option<bool>,
    share_threshold: Option<bool>,
    value_to_metric: Option<bool>,
    metadata: Option<serde_yaml::Mapping>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRateLimit {
    unit: Option<UnitName>,
    requests_per_unit: Option<u32>,
    unlimited: Option<bool>,
    name: Option<Scalar>,
    replaces: Option<Vec<RawReplace>>,
    /// ratekeeper: how the limit counts (default `fixed_window`).
    algorithm: Option<AlgorithmName>,
    /// ratekeeper: bucket size / queue depth of the GCRA algorithms.
    burst: Option<u32>,
    /// ratekeeper: `record` hits over the limit, or `drop` them.
    charges: Option<ChargesName>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReplace {
    name: Option<Scalar>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConcurrency {
    key: Option<Scalar>,
    value: Option<Scalar>,
    max_connections: Option<u32>,
    lease_ttl: Option<DurationText>,
    name: Option<Scalar>,
    descriptors: Option<Vec<RawConcurrency>>,
}

/// Parses and compiles one limits file's text: one domain per YAML
/// document. `file` is only used in errors.
pub fn parse(file: &Path, text: &str) -> Result<Vec<DomainConfig>, ConfigError> {
    let mut domains = Vec::new();
    for (doc, raw) in documents(file, text)? {
        let description = describe(raw).map_err(|e| located(file, text, doc, e))?;
        domains.push(compile(description).map_err(|e| located(file, text, doc, e))?);
    }
    Ok(domains)
}

/// The file's YAML documents, with their places in the file. Empty ones (a
/// trailing `---`) are skipped; a file without any is one empty document.
fn documents(file: &Path, text: &str) -> Result<Vec<(usize, RawFile)>, ConfigError> {
    let syntax = |e: serde_yaml::Error| ConfigError {
        file: file.to_owned(),
        line: e.location().map(|l| l.line()),
        reason: strip_location(&e.to_string()),
    };
    let mut docs = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        if let Some(raw) = Option::<RawFile>::deserialize(doc).map_err(syntax)? {
            docs.push((i, raw));
        }
    }
    if docs.is_empty() {
        docs.push((0, serde_yaml::from_str("{}").map_err(syntax)?));
    }
    Ok(docs)
}

/// A compile error in document `doc` of `text`, with the line of the node it names.
fn located(file: &Path, text: &str, doc: usize, error: CompileError) -> ConfigError {
    ConfigError {
        file: file.to_owned(),
        line: line_of(text, doc, &error.at),
        reason: error.to_string(),
    }
}

/// serde_yaml appends " at line L column C"; the line goes in its own field.
fn strip_location(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(at) => message[..at].to_owned(),
        None => message.to_owned(),
    }
}

/// Translates one document into the source-neutral description.
fn describe(raw: RawFile) -> Result<DomainDescription, CompileError> {
    let descriptors = raw.descriptors.unwrap_or_default();
    let concurrency = raw.concurrency.unwrap_or_default();
    Ok(DomainDescription {
        domain: text(raw.domain).unwrap_or_default(),
        descriptors: nodes(descriptors, "descriptors", describe_descriptor)?,
        concurrency: nodes(concurrency, "concurrency", describe_concurrency)?,
        all_or_nothing: raw.all_or_nothing,
        response_headers: raw.response_headers,
        failure_mode: raw.failure_mode.map(|FailureModeName(m)| m),
        charges: raw.charges.map(|ChargesName(c)| c),
    })
}

/// The nodes of one YAML list at path `at`.
fn nodes<R, P>(
    raw: Vec<R>,
    at: &str,
    node: fn(R, String) -> Result<desc::Node<P>, CompileError>,
) -> Result<Vec<desc::Node<P>>, CompileError> {
    raw.into_iter()
        .enumerate()
        .map(|(i, r)| node(r, format!("{at}[{i}]")))
        .collect()
}

fn describe_descriptor(raw: RawDescriptor, at: String) -> Result<desc::Descriptor, CompileError> {
    let limits = match (raw.rate_limit, raw.rate_limits) {
        (Some(_), Some(_)) => {
            return Err(CompileError::new(
                &at,
                "use rate_limit or rate_limits, not both",
            ))
        }
        (Some(one), None) => vec![describe_limit(one, format!("{at}.rate_limit"))],
        (None, Some(list)) if list.is_empty() => {
            return Err(CompileError::new(
                &format!("{at}.rate_limits"),
                "the list must not be empty",
            ))
        }
        (None, Some(list)) => list
            .into_iter()
            .enumerate()
            .map(|(i, l)| describe_limit(l, format!("{at}.rate_limits[{i}]")))
            .collect(),
        (None, None) => Vec::new(),
    };
    let payload = desc::Limits {
        limits,
        shadow_mode: raw.shadow_mode.unwrap_or(false),
        detailed_metric: raw.detailed_metric.unwrap_or(false),
        quota_mode: raw.quota_mode.unwrap_or(false),
        share_threshold: raw.share_threshold.unwrap_or(false),
        value_to_metric: raw.value_to_metric.unwrap_or(false),
        metadata: match raw.metadata {
            Some(map) if !map.is_empty() => {
                Some(metadata(map).map_err(|e| CompileError::new(&format!("{at}.metadata"), e))?)
            }
            _ => None,
        },
    };
    let children = raw.descriptors.unwrap_or_default();
    Ok(desc::Node {
        children: nodes(children, &format!("{at}.descriptors"), describe_descriptor)?,
        key: text(raw.key).unwrap_or_default(),
        value: text(raw.value),
        payload,
        at,
    })
}

fn describe_limit(raw: RawRateLimit, at: String) -> desc::Limit {
    desc::Limit {
        unit: raw.unit.map(|UnitName(u)| u),
        requests_per_unit: raw.requests_per_unit,
        unlimited: raw.unlimited.unwrap_or(false),
        name: text(raw.name),
        replaces: raw
            .replaces
            .unwrap_or_default()
            .into_iter()
            .map(|r| r.name.map(|Scalar(n)| n).unwrap_or_default())
            .collect(),
        algorithm: raw.algorithm.map(|AlgorithmName(a)| a),
        burst: raw.burst,
        charges: raw.charges.map(|ChargesName(c)| c),
        at,
    }
}

fn describe_concurrency(
    raw: RawConcurrency,
    at: String,
) -> Result<desc::ConcurrencyDescriptor, CompileError> {
    let children = raw.descriptors.unwrap_or_default();
    Ok(desc::Node {
        children: nodes(children, &format!("{at}.descriptors"), describe_concurrency)?,
        key: text(raw.key).unwrap_or_default(),
        value: text(raw.value),
        payload: desc::Concurrency {
            max_connections: raw.max_connections,
            lease_ttl: raw.lease_ttl.map(|DurationText(d)| d),
            name: text(raw.name),
        },
        at,
    })
}

/// A scalar's text; absent and empty are both `None`, as in envoyproxy/ratelimit.
fn text(scalar: Option<Scalar>) -> Option<String> {
    scalar.map(|Scalar(s)| s).filter(|s| !s.is_empty())
}

/// A `metadata:` map as the protobuf `Struct` a response would carry.
fn metadata(map: serde_yaml::Mapping) -> Result<prost_types::Struct, String> {
    let mut fields = std::collections::BTreeMap::new();
    for (key, value) in map {
        let Ok(Scalar(key)) = Scalar::deserialize(key) else {
            return Err("metadata keys must be strings".into());
        };
        fields.insert(key, metadata_value(value)?);
    }
    Ok(prost_types::Struct { fields })
}

fn metadata_value(value: serde_yaml::Value) -> Result<prost_types::Value, String> {
    use prost_types::value::Kind;
    use serde_yaml::Value as Y;
    let kind = match value {
        Y::Null => Kind::NullValue(0),
        Y::Bool(b) => Kind::BoolValue(b),
        Y::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(f64::NAN)),
        Y::String(s) => Kind::StringValue(s),
        Y::Sequence(items) => Kind::ListValue(prost_types::ListValue {
            values: items
                .into_iter()
                .map(metadata_value)
                .collect::<Result<_, _>>()?,
        }),
        Y::Mapping(map) => Kind::StructValue(metadata(map)?),
        Y::Tagged(_) => return Err("metadata must not use YAML tags".into()),
    };
    Ok(prost_types::Value { kind: Some(kind) })
}

/// A YAML scalar read as text, as the Go loader does (`value: 200` is "200").
#[derive(Debug)]
struct Scalar(String);

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ScalarVisitor;
        impl Visitor<'_> for ScalarVisitor {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, number or boolean")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar(v.to_owned()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
        }
        d.deserialize_any(ScalarVisitor)
    }
}

/// A unit name, checked while parsing so a bad one is reported with its line.
#[derive(Debug)]
struct UnitName(Unit);

impl<'de> Deserialize<'de> for UnitName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let Scalar(name) = Scalar::deserialize(d)?;
        Unit::parse(&name).map(UnitName).ok_or_else(|| {
            de::Error::custom(format!(
                "unknown unit {name:?}: expected second, minute, hour, day, week, month or year"
            ))
        })
    }
}

/// An algorithm name, checked while parsing so a bad one is reported with its line.
#[derive(Debug)]
struct AlgorithmName(Algorithm);

impl<'de> Deserialize<'de> for AlgorithmName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let Scalar(name) = Scalar::deserialize(d)?;
        Algorithm::parse(&name).map(AlgorithmName).ok_or_else(|| {
            let known: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
            de::Error::custom(format!(
                "unknown algorithm {name:?}: expected one of {}",
                known.join(", ")
            ))
        })
    }
}

/// A failure mode name, checked while parsing.
#[derive(Debug)]
struct FailureModeName(FailureMode);

impl<'de> Deserialize<'de> for FailureModeName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let Scalar(name) = Scalar::deserialize(d)?;
        FailureMode::parse(&name)
            .map(FailureModeName)
            .ok_or_else(|| {
                de::Error::custom(format!(
                    "unknown failure_mode {name:?}: expected open, closed, unavailable or local"
                ))
            })
    }
}

/// `charges: record` (true: hits over the limit are recorded) or `drop`
/// (false: a refused request consumes nothing), checked while parsing.
#[derive(Debug)]
struct ChargesName(bool);

impl<'de> Deserialize<'de> for ChargesName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let Scalar(name) = Scalar::deserialize(d)?;
        match name.as_str() {
            "record" => Ok(ChargesName(true)),
            "drop" => Ok(ChargesName(false)),
            _ => Err(de::Error::custom(format!(
                "unknown charges {name:?}: expected record or drop"
            ))),
        }
    }
}

/// A duration such as `30s`, `500ms`, `2m`, `1h` (or a number of seconds),
/// checked while parsing.
#[derive(Debug)]
struct DurationText(std::time::Duration);

impl<'de> Deserialize<'de> for DurationText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let Scalar(text) = Scalar::deserialize(d)?;
        parse_duration(&text).map(DurationText).ok_or_else(|| {
            de::Error::custom(format!(
                "bad duration {text:?}: expected e.g. 500ms, 30s, 2m or 1h"
            ))
        })
    }
}
