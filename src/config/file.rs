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
use super::flow_depth;
use super::yaml_last_wins::LastWins;
use super::yaml_lines::{line_of, line_of_key, repeated_key};
use super::DomainConfig;
use crate::duration::parse_duration;
use crate::error::ConfigError;
use crate::limiter::{Algorithm, Unit};
use crate::vocab::FailureMode;

// src/service/ reads the lease TTL bounds from here.
pub use super::compile::{DEFAULT_LEASE_TTL, LEASE_TTL_RANGE};

#[derive(Debug, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a limits file: a mapping with domain and descriptors"
)]
struct RawFile {
    /// envoyproxy/ratelimit's `RateLimitConfig.name` (Envoy Gateway writes
    /// it); not used.
    #[allow(dead_code)]
    name: Option<Scalar>,
    domain: Option<Scalar>,
    descriptors: Option<Vec<RawDescriptor>>,
    /// ratekeeper: `false` keeps Envoy's count-everything behaviour.
    all_or_nothing: Option<Flag>,
    /// ratekeeper: RateLimit-* response headers for this domain (overrides the flag).
    response_headers: Option<Flag>,
    /// ratekeeper: concurrent-connection limits, a descriptor tree of their own.
    concurrency: Option<Vec<RawConcurrency>>,
    /// ratekeeper: the answer while the store fails (overrides the flag).
    failure_mode: Option<FailureModeName>,
    /// ratekeeper: `charges:` for the limits that set none.
    charges: Option<ChargesName>,
}

#[derive(Debug, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a descriptor: a mapping with key, and value, rate_limit or descriptors"
)]
struct RawDescriptor {
    key: Option<Scalar>,
    value: Option<Scalar>,
    rate_limit: Option<RawRateLimit>,
    /// ratekeeper: several limits on one descriptor, all checked.
    rate_limits: Option<Vec<RawRateLimit>>,
    descriptors: Option<Vec<RawDescriptor>>,
    shadow_mode: Option<Flag>,
    detailed_metric: Option<Flag>,
    quota_mode: Option<Flag>,
    share_threshold: Option<Flag>,
    value_to_metric: Option<Flag>,
    metadata: Option<serde_yaml::Mapping>,
}

#[derive(Debug, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a rate limit: a mapping with unit and requests_per_unit, or unlimited"
)]
struct RawRateLimit {
    unit: Option<UnitName>,
    requests_per_unit: Option<Count>,
    unlimited: Option<Flag>,
    name: Option<Scalar>,
    replaces: Option<Vec<RawReplace>>,
    /// ratekeeper: how the limit counts (default `fixed_window`).
    algorithm: Option<AlgorithmName>,
    /// ratekeeper: bucket size / queue depth of the GCRA algorithms.
    burst: Option<Count>,
    /// ratekeeper: `record` hits over the limit, or `drop` them.
    charges: Option<ChargesName>,
}

#[derive(Debug, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a replaces entry: a mapping with name"
)]
struct RawReplace {
    name: Option<Scalar>,
}

#[derive(Debug, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a concurrency descriptor: a mapping with key, and value, max_connections or descriptors"
)]
struct RawConcurrency {
    key: Option<Scalar>,
    value: Option<Scalar>,
    max_connections: Option<Count>,
    lease_ttl: Option<DurationText>,
    name: Option<Scalar>,
    descriptors: Option<Vec<RawConcurrency>>,
}

/// Parses and compiles one limits file's text: one domain per YAML
/// document. `file` is only used in errors.
pub fn parse(file: &Path, text: &str) -> Result<Vec<DomainConfig>, ConfigError> {
    // A byte-order mark, which their loader's libyaml reads as one.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let (mut domains, mut warnings) = (Vec::new(), Vec::new());
    for (doc, raw) in documents(file, text)? {
        let description = describe(raw).map_err(|e| located(file, text, doc, e))?;
        let (domain, found) = compile(description).map_err(|e| located(file, text, doc, e))?;
        warnings.extend(found.into_iter().map(|w| located(file, text, doc, w)));
        domains.push(domain);
    }
    // Said once the whole file compiles: a file refused has only its error.
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    Ok(domains)
}

/// The file's YAML documents, with their places in the file. Empty ones (a
/// trailing `---`) are skipped; a file without any is one empty document.
fn documents(file: &Path, text: &str) -> Result<Vec<(usize, RawFile)>, ConfigError> {
    let syntax = |e: serde_yaml::Error| ConfigError {
        file: file.to_owned(),
        line: e.location().map(|l| l.line()),
        reason: explained(strip_location(&e.to_string())),
    };
    if let Some(line) = flow_depth::too_deep(text) {
        return Err(ConfigError {
            file: file.to_owned(),
            line: Some(line),
            reason: format!(
                "flow collections ([...], {{...}}) nested more than {} deep",
                flow_depth::MAX_FLOW_DEPTH
            ),
        });
    }
    // The documents that hold merge keys, read whole (only when the text
    // could hold one: the typed reading below is the fast path).
    let mut merging = Vec::new();
    if text.contains("<<") {
        for doc in serde_yaml::Deserializer::from_str(text) {
            let LastWins(value) = LastWins::deserialize(doc).map_err(syntax)?;
            merging.push(has_merge_key(&value).then_some(value));
        }
    }
    let mut merging = merging.into_iter();
    let mut docs = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let raw = match merging.next().flatten() {
            Some(value) => {
                let raw = merged(value).map_err(|e| ConfigError {
                    line: unknown_key_line(text, i, &e),
                    ..syntax(e)
                })?;
                warn_repeated_merging(file, text, i);
                raw
            }
            None => Option::<RawFile>::deserialize(doc)
                .or_else(|error| with_repeated_keys(file, text, i, error))
                .map_err(syntax)?,
        };
        if let Some(raw) = raw {
            docs.push((i, raw));
        }
    }
    if docs.is_empty() {
        docs.push((0, serde_yaml::from_str("{}").map_err(syntax)?));
    }
    Ok(docs)
}

/// Document `doc` of `text` read again, as their loader reads it, when
/// the typed reading refused it for a key repeated in a mapping (see
/// [`LastWins`]), with a warning naming the first repeat. Any other error
/// stands.
fn with_repeated_keys(
    file: &Path,
    text: &str,
    doc: usize,
    error: serde_yaml::Error,
) -> Result<Option<RawFile>, serde_yaml::Error> {
    let message = strip_location(&error.to_string());
    // "duplicate field `x`", after the path of its mapping when nested.
    let repeated = |m: &str| m.starts_with("duplicate field ") || m.starts_with("duplicate entry ");
    let is_repeat = repeated(&message)
        || message
            .split_once(": ")
            .is_some_and(|(path, rest)| !path.contains(' ') && repeated(rest));
    let Some(document) = is_repeat
        .then(|| serde_yaml::Deserializer::from_str(text).nth(doc))
        .flatten()
    else {
        return Err(error);
    };
    let LastWins(value) = LastWins::deserialize(document)?;
    // The line serde_yaml gives is the mapping's, which the path names.
    let at = match error.location() {
        Some(l) => format!("{}:{}", file.display(), l.line()),
        None => file.display().to_string(),
    };
    warn_repeated(&at, &message);
    merged(value)
}

/// The warning for the first key repeated in a mapping of document `doc`,
/// one with merge keys (read whole, so no error names it). Two merge keys
/// in one mapping are read otherwise than there, and said so.
fn warn_repeated_merging(file: &Path, text: &str, doc: usize) {
    let Some((line, key)) = repeated_key(text, doc) else {
        return;
    };
    let at = format!("{}:{line}", file.display());
    if key == "<<" {
        tracing::warn!(
            "{at}: two merge keys (<<) in one mapping: the last one counts \
             (envoyproxy/ratelimit applies both)"
        );
    } else {
        warn_repeated(&at, &format!("duplicate field `{key}`"));
    }
}

/// The warning for a key repeated in a mapping, at `at` (the file and a
/// line), which `message` names.
fn warn_repeated(at: &str, message: &str) {
    tracing::warn!(
        "{at}: {message}: read as envoyproxy/ratelimit reads the file (a repeated `rate_limit` \
         or `metadata` adds to the first, any other key's last value counts)"
    );
}

/// A compile error in document `doc` of `text`, with the line of the node it names.
fn located(file: &Path, text: &str, doc: usize, error: CompileError) -> ConfigError {
    ConfigError {
        file: file.to_owned(),
        line: line_of(text, doc, &error.at),
        reason: error.to_string(),
    }
}

/// Whether a mapping anywhere in `value` has a merge key (`<<`).
fn has_merge_key(value: &serde_yaml::Value) -> bool {
    use serde_yaml::Value as Y;
    match value {
        Y::Mapping(map) => map
            .iter()
            .any(|(key, item)| key.as_str() == Some("<<") || has_merge_key(item)),
        Y::Sequence(items) => items.iter().any(has_merge_key),
        Y::Tagged(tagged) => has_merge_key(&tagged.value),
        _ => false,
    }
}

/// A document with merge keys (`<<: *anchor`), which their loader applies
/// and serde_yaml's typed reading does not: merged as there, then read as
/// the file. Its scalars were parsed on the way (in such a document
/// `value: 0x1F` is "31"), and a parse error has no line (a compile error
/// still has its node's, and an unknown key the line it is written on:
/// [`unknown_key_line`]).
fn merged(mut value: serde_yaml::Value) -> Result<Option<RawFile>, serde_yaml::Error> {
    merge_in_order(&mut value)?;
    scalars_as_text(&mut value);
    Option::<RawFile>::deserialize(value)
}

/// For an error of a merged document (which has no position) naming an
/// unknown key, the line where that key is first written in document `doc`.
fn unknown_key_line(text: &str, doc: usize, error: &serde_yaml::Error) -> Option<usize> {
    let message = error.to_string();
    let key = message.strip_prefix("unknown field `")?.split('`').next()?;
    line_of_key(text, doc, key)
}

/// Applies merge keys as their loader (yaml.v2) does, where each stands
/// in its mapping: a key after a `<<` overrides what it merged, a `<<`
/// after a key overrides that key, and of a list of merged mappings the
/// first wins.
fn merge_in_order(value: &mut serde_yaml::Value) -> Result<(), serde_yaml::Error> {
    use serde_yaml::Value as Y;
    match value {
        Y::Mapping(map) => {
            for (key, mut item) in std::mem::take(map) {
                merge_in_order(&mut item)?;
                if key.as_str() != Some("<<") {
                    map.insert(key, item);
                    continue;
                }
                let sources = match item {
                    Y::Sequence(items) => items.into_iter().rev().collect(),
                    one => vec![one],
                };
                for source in sources {
                    let Y::Mapping(source) = source else {
                        return Err(de::Error::custom(
                            "a merge key (<<) takes a mapping or a list of mappings",
                        ));
                    };
                    for (key, item) in source {
                        map.insert(key, item);
                    }
                }
            }
        }
        Y::Sequence(items) => {
            for item in items {
                merge_in_order(item)?;
            }
        }
        Y::Tagged(tagged) => merge_in_order(&mut tagged.value)?,
        Y::Null | Y::Bool(_) | Y::Number(_) | Y::String(_) => {}
    }
    Ok(())
}

/// Makes every number and boolean of a parsed document text again, as the
/// file's fields read them ([`Scalar`], [`Flag`], [`Count`]); `metadata:`
/// keeps its types, which its `Struct` carries.
fn scalars_as_text(value: &mut serde_yaml::Value) {
    use serde_yaml::Value as Y;
    match value {
        Y::Number(_) | Y::Bool(_) => {
            if let Some(text) = parsed_text(value) {
                *value = Y::String(text);
            }
        }
        Y::Sequence(items) => items.iter_mut().for_each(scalars_as_text),
        Y::Mapping(map) => {
            for (key, item) in map.iter_mut() {
                if key.as_str() != Some("metadata") {
                    scalars_as_text(item);
                }
            }
        }
        Y::Tagged(tagged) => scalars_as_text(&mut tagged.value),
        Y::Null | Y::String(_) => {}
    }
}

/// A parsed scalar's text (a number's or boolean's as written back: what
/// the file said is gone once parsed); `None` for anything else.
fn parsed_text(value: &serde_yaml::Value) -> Option<String> {
    use serde_yaml::Value as Y;
    match value {
        Y::String(s) => Some(s.clone()),
        Y::Number(n) => Some(n.to_string()),
        Y::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// A YAML reader's message, with what it means here where it says too
/// little.
fn explained(message: String) -> String {
    if message == "recursion limit exceeded" {
        // serde_yaml's depth limit: each descriptor level is a sequence
        // and a mapping.
        return "nested too deeply (the YAML reader's limit: about 60 levels of descriptors), or \
                an anchor whose value holds an alias of itself"
            .into();
    }
    message
}

/// serde_yaml writes " at line L column C" into its messages (a syntax
/// error's in the middle, before what it was parsing); the line goes in its
/// own field, so every such location is cut.
fn strip_location(message: &str) -> String {
    const AT: &str = " at line ";
    let mut stripped = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find(AT) {
        stripped.push_str(&rest[..at]);
        let after = &rest[at + AT.len()..];
        match after_line_column(after) {
            Some(tail) => rest = tail,
            None => {
                stripped.push_str(AT);
                rest = after;
            }
        }
    }
    stripped.push_str(rest);
    stripped
}

/// What follows "L column C" at the start of `text`, if it starts so.
fn after_line_column(text: &str) -> Option<&str> {
    let column = after_digits(text)?.strip_prefix(" column ")?;
    after_digits(column)
}

/// What follows the digits `text` starts with; `None` without any.
fn after_digits(text: &str) -> Option<&str> {
    let tail = text.trim_start_matches(|c: char| c.is_ascii_digit());
    (tail.len() < text.len()).then_some(tail)
}

/// Translates one document into the source-neutral description.
fn describe(raw: RawFile) -> Result<DomainDescription, CompileError> {
    let descriptors = raw.descriptors.unwrap_or_default();
    let concurrency = raw.concurrency.unwrap_or_default();
    Ok(DomainDescription {
        domain: text(raw.domain).unwrap_or_default(),
        descriptors: nodes(descriptors, "descriptors", describe_descriptor)?,
        concurrency: nodes(concurrency, "concurrency", describe_concurrency)?,
        all_or_nothing: flag(raw.all_or_nothing),
        response_headers: flag(raw.response_headers),
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
        (Some(one), None) => vec![describe_limit(one, format!("{at}.rate_limit"))?],
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
            .collect::<Result<_, _>>()?,
        (None, None) => Vec::new(),
    };
    let payload = desc::Limits {
        limits,
        shadow_mode: flag(raw.shadow_mode).unwrap_or(false),
        detailed_metric: flag(raw.detailed_metric).unwrap_or(false),
        quota_mode: flag(raw.quota_mode).unwrap_or(false),
        share_threshold: flag(raw.share_threshold).unwrap_or(false),
        value_to_metric: flag(raw.value_to_metric).unwrap_or(false),
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

fn describe_limit(raw: RawRateLimit, at: String) -> Result<desc::Limit, CompileError> {
    let unlimited = flag(raw.unlimited).unwrap_or(false);
    let unit = match raw.unit {
        Some(UnitName(Ok(unit))) => Some(unit),
        Some(UnitName(Err(_))) if unlimited => None,
        Some(UnitName(Err(why))) => return Err(CompileError::new(&format!("{at}.unit"), why)),
        None => None,
    };
    Ok(desc::Limit {
        unit,
        requests_per_unit: count(raw.requests_per_unit),
        unlimited,
        name: text(raw.name),
        replaces: raw
            .replaces
            .unwrap_or_default()
            .into_iter()
            .map(|r| r.name.map(|Scalar(n)| n).unwrap_or_default())
            .collect(),
        algorithm: raw.algorithm.map(|AlgorithmName(a)| a),
        burst: count(raw.burst),
        charges: raw.charges.map(|ChargesName(c)| c),
        at,
    })
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
            max_connections: count(raw.max_connections),
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
        let Some(key) = parsed_text(&key) else {
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

/// A scalar's text made a `T` by `parse`, inside the deserializer's visit
/// of it, so that an error names the scalar's own line and path.
struct ScalarAs<T> {
    expecting: &'static str,
    parse: fn(&str) -> Result<T, String>,
}

impl<T> Visitor<'_> for ScalarAs<T> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        (self.parse)(v).map_err(E::custom)
    }
}

/// Reads one scalar as its text, as written, through `parse`.
fn scalar<'de, D: Deserializer<'de>, T>(
    d: D,
    expecting: &'static str,
    parse: fn(&str) -> Result<T, String>,
) -> Result<T, D::Error> {
    d.deserialize_str(ScalarAs { expecting, parse })
}

/// A YAML scalar read as its text, as their loader (yaml.v2) reads one into
/// a string: `value: 0x1F` is "0x1F" and `value: 1.50` is "1.50", never a
/// number written back.
#[derive(Debug)]
struct Scalar(String);

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        scalar(d, "a string, number or boolean", |text| {
            Ok(Scalar(text.to_owned()))
        })
    }
}

/// A boolean as YAML 1.1, their loader's YAML, spells one: `true`/`false`,
/// `yes`/`no`, `on`/`off` and `y`/`n`, each in lower case, capitalised or
/// upper case.
#[derive(Debug)]
struct Flag(bool);

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        scalar(d, "a boolean", |text| match text {
            "true" | "True" | "TRUE" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" | "y" | "Y" => {
                Ok(Flag(true))
            }
            "false" | "False" | "FALSE" | "no" | "No" | "NO" | "off" | "Off" | "OFF" | "n"
            | "N" => Ok(Flag(false)),
            _ => Err(format!(
                "{text:?} is not a boolean: expected true or false (or yes/no, on/off)"
            )),
        })
    }
}

fn flag(flag: Option<Flag>) -> Option<bool> {
    flag.map(|Flag(b)| b)
}

/// A count (`requests_per_unit`, `burst`, `max_connections`) as their
/// loader reads an integer: `_` ignored, `0x`, `0o`, `0b` and a leading `0`
/// (octal) as in Go, or a float with no fraction (`1e3`).
#[derive(Debug)]
struct Count(u32);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        scalar(d, "a count", |text| {
            parse_count(text).map(Count).ok_or_else(|| {
                format!(
                    "{text:?} is not a count: expected a whole number from 0 to {}",
                    u32::MAX
                )
            })
        })
    }
}

fn count(count: Option<Count>) -> Option<u32> {
    count.map(|Count(n)| n)
}

/// `text` as a count, read as yaml.v2 reads an integer (Go's
/// `strconv.ParseInt(text, 0, 64)` with `_` removed), else as a float
/// without a fraction; `None` when it is neither, negative or too large.
/// yaml.v2 reads a number only from a scalar that starts with a digit, a
/// sign or a point: `_1` is text there.
fn parse_count(text: &str) -> Option<u32> {
    if !text.starts_with(|c: char| c.is_ascii_digit() || matches!(c, '+' | '-' | '.')) {
        return None;
    }
    let plain = text.replace('_', "");
    let digits = plain.strip_prefix('+').unwrap_or(&plain);
    let lower = digits.to_ascii_lowercase();
    let integer = if let Some(hex) = lower.strip_prefix("0x") {
        u64::from_str_radix(hex, 16).ok()
    } else if let Some(octal) = lower.strip_prefix("0o") {
        u64::from_str_radix(octal, 8).ok()
    } else if let Some(binary) = lower.strip_prefix("0b") {
        u64::from_str_radix(binary, 2).ok()
    } else if lower.len() > 1 && lower.starts_with('0') {
        u64::from_str_radix(&lower[1..], 8).ok()
    } else {
        lower.parse::<u64>().ok()
    };
    let whole = || {
        let f: f64 = plain.parse().ok()?;
        (f.is_finite() && f.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(&f))
            .then_some(f as u64)
    };
    // A sign or digit after a base prefix's is not Go's syntax (`0x+1`).
    let clean = |s: &str| s.bytes().all(|b| b.is_ascii_alphanumeric());
    let n = match integer {
        Some(n) if clean(&lower) => Some(n),
        _ => whole(),
    }?;
    u32::try_from(n).ok()
}

/// A unit name, or why it is none: refused where the limit is read (an
/// unlimited limit ignores a unit that is not one, as their loader does;
/// only a real unit on it is refused).
#[derive(Debug)]
struct UnitName(Result<Unit, String>);

impl<'de> Deserialize<'de> for UnitName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        scalar(d, "a unit", |name| {
            Ok(UnitName(Unit::parse(name).ok_or_else(|| {
                format!(
                    "unknown unit {name:?}: expected second, minute, hour, day, week, month or year"
                )
            })))
        })
    }
}

/// An algorithm name, checked while parsing so a bad one is reported with its line.
#[derive(Debug)]
struct AlgorithmName(Algorithm);

impl<'de> Deserialize<'de> for AlgorithmName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        scalar(d, "an algorithm", |name| {
            Algorithm::parse(name).map(AlgorithmName).ok_or_else(|| {
                let known: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
                format!(
                    "unknown algorithm {name:?}: expected one of {}",
                    known.join(", ")
                )
            })
        })
    }
}

/// A failure mode name, checked while parsing.
#[derive(Debug)]
struct FailureModeName(FailureMode);

impl<'de> Deserialize<'de> for FailureModeName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        scalar(d, "a failure mode", |name| {
            FailureMode::parse(name)
                .map(FailureModeName)
                .ok_or_else(|| {
                    format!(
                    "unknown failure_mode {name:?}: expected open, closed, unavailable or local"
                )
                })
        })
    }
}

/// `charges: record` (true: hits over the limit are recorded) or `drop`
/// (false: a refused request consumes nothing), checked while parsing.
#[derive(Debug)]
struct ChargesName(bool);

impl<'de> Deserialize<'de> for ChargesName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        scalar(d, "record or drop", |name| match name {
            "record" => Ok(ChargesName(true)),
            "drop" => Ok(ChargesName(false)),
            _ => Err(format!("unknown charges {name:?}: expected record or drop")),
        })
    }
}

/// A duration such as `30s`, `500ms`, `2m`, `1h` (or a number of seconds),
/// checked while parsing.
#[derive(Debug)]
struct DurationText(std::time::Duration);

impl<'de> Deserialize<'de> for DurationText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        scalar(d, "a duration", |text| {
            parse_duration(text)
                .map(DurationText)
                .ok_or_else(|| format!("bad duration {text:?}: expected e.g. 500ms, 30s, 2m or 1h"))
        })
    }
}
