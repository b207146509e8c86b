//! One limits file: envoyproxy/ratelimit's YAML format, parsed strictly and
//! compiled into a [`RuleTree`].

use std::collections::HashSet;
use std::fmt;
use std::path::Path;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use crate::error::ConfigError;
use crate::limiter::{gcra, Algorithm, Unit};
use crate::rules::{
    ConcurrencyRule, KeyNodes, Level, Node, Rate, Rule, RuleMetrics, RuleTree, Wildcard,
};
use crate::vocab::FailureMode;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
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

impl RawNode for RawConcurrency {
    type Payload = (Option<u32>, Option<DurationText>, Option<Scalar>);
    fn split(self) -> (Option<Scalar>, Option<Scalar>, Vec<Self>, Self::Payload) {
        let payload = (self.max_connections, self.lease_ttl, self.name);
        (
            self.key,
            self.value,
            self.descriptors.unwrap_or_default(),
            payload,
        )
    }
}

/// The default lease TTL of a concurrency rule.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);
/// Lease TTLs accepted in files and requests.
pub const LEASE_TTL_RANGE: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(3600));

/// A duration such as `30s`, `500ms`, `2m`, `1h` (or a number of seconds),
/// checked while parsing.
#[derive(Debug)]
struct DurationText(Duration);

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

/// Parses `500ms`, `30s`, `2m`, `1h`, or plain seconds.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().ok()?;
    let ms = match unit.trim() {
        "ms" => n,
        "" | "s" => n.checked_mul(1_000)?,
        "m" => n.checked_mul(60_000)?,
        "h" => n.checked_mul(3_600_000)?,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
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
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRateLimit {
    unit: Option<UnitName>,
    requests_per_unit: Option<u32>,
    #[serde(default)]
    unlimited: bool,
    name: Option<Scalar>,
    replaces: Option<Vec<RawReplace>>,
    /// ratekeeper: how the limit counts (default `fixed_window`).
    algorithm: Option<AlgorithmName>,
    /// ratekeeper: bucket size / queue depth of the GCRA algorithms.
    burst: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReplace {
    name: Option<Scalar>,
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

/// Per-domain settings (ratekeeper's additions to the format).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainOptions {
    /// A refused request consumes nothing (default); `false` is Envoy's
    /// behaviour, where the descriptors that fit are consumed anyway.
    pub all_or_nothing: bool,
    /// Whether to add RateLimit-* headers; `None` follows the server flag.
    pub response_headers: Option<bool>,
    /// The answer while the store fails; `None` follows the server flag.
    pub failure_mode: Option<FailureMode>,
}

/// One domain, as loaded from one file.
#[derive(Debug)]
pub struct DomainConfig {
    pub name: String,
    pub rules: RuleTree,
    /// The `concurrency:` rules.
    pub concurrency: RuleTree<ConcurrencyRule>,
    pub options: DomainOptions,
}

/// Parses and validates one limits file's text. `file` is only used in errors.
pub fn parse(file: &Path, text: &str) -> Result<DomainConfig, ConfigError> {
    let raw: RawFile = serde_yaml::from_str(text).map_err(|e| ConfigError {
        file: file.to_owned(),
        line: e.location().map(|l| l.line()),
        reason: strip_location(&e.to_string()),
    })?;
    let fail = |reason: String| ConfigError::new(file, reason);
    let domain = match raw.domain {
        Some(Scalar(d)) if !d.is_empty() => d,
        _ => return Err(fail("the domain must not be empty".into())),
    };
    let mut builder = TreeBuilder {
        domain: &domain,
        rules: Vec::new(),
    };
    let root = build_level(
        raw.descriptors.unwrap_or_default(),
        "descriptors",
        "",
        &mut |payload, here, path| builder.node_rule(payload, here, path),
    )
    .map_err(fail)?;
    let rules = builder.rules;
    check_replaces(&rules).map_err(fail)?;
    let mut concurrency_rules = Vec::new();
    let concurrency_root = build_level(
        raw.concurrency.unwrap_or_default(),
        "concurrency",
        "",
        &mut |payload, here, path| concurrency_rule(payload, here, path, &mut concurrency_rules),
    )
    .map_err(fail)?;
    Ok(DomainConfig {
        name: domain,
        rules: RuleTree { root, rules },
        concurrency: RuleTree {
            root: concurrency_root,
            rules: concurrency_rules,
        },
        options: DomainOptions {
            all_or_nothing: raw.all_or_nothing.unwrap_or(true),
            response_headers: raw.response_headers,
            failure_mode: raw.failure_mode.map(|FailureModeName(m)| m),
        },
    })
}

/// serde_yaml appends " at line L column C"; the line goes in its own field.
fn strip_location(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(at) => message[..at].to_owned(),
        None => message.to_owned(),
    }
}

/// A YAML descriptor node: a key, maybe a value, children, and what the
/// node carries (rate limits or a concurrency limit).
trait RawNode: Sized {
    type Payload;
    fn split(self) -> (Option<Scalar>, Option<Scalar>, Vec<Self>, Self::Payload);
}

impl RawNode for RawDescriptor {
    type Payload = RawLimits;
    fn split(self) -> (Option<Scalar>, Option<Scalar>, Vec<Self>, RawLimits) {
        let limits = RawLimits {
            rate_limit: self.rate_limit,
            rate_limits: self.rate_limits,
            shadow_mode: self.shadow_mode,
            detailed_metric: self.detailed_metric,
        };
        (
            self.key,
            self.value,
            self.descriptors.unwrap_or_default(),
            limits,
        )
    }
}

/// What a rate limit descriptor node carries.
struct RawLimits {
    rate_limit: Option<RawRateLimit>,
    rate_limits: Option<Vec<RawRateLimit>>,
    shadow_mode: bool,
    detailed_metric: bool,
}

/// Compiles the nodes under one level. `at` is the YAML path for errors,
/// `parent` the metrics path of the enclosing node; `rule` turns a node's
/// payload into a rule index (or none).
fn build_level<N: RawNode>(
    raw: Vec<N>,
    at: &str,
    parent: &str,
    rule: &mut impl FnMut(N::Payload, &str, &str) -> Result<Option<usize>, String>,
) -> Result<Level, String> {
    let mut level = Level::default();
    let mut seen = HashSet::new();
    for (i, node) in raw.into_iter().enumerate() {
        let here = format!("{at}[{i}]");
        let (key, value, children, payload) = node.split();
        let key = match key {
            Some(Scalar(k)) if !k.is_empty() => k,
            _ => return Err(format!("{here}: the descriptor key must not be empty")),
        };
        let value = value.map(|Scalar(v)| v);
        let label = match &value {
            Some(v) => format!("{key}_{v}"),
            None => key.clone(),
        };
        if !seen.insert((key.clone(), value.clone())) {
            return Err(format!(
                "{here}: duplicate descriptor {label:?} at this level (key {key:?}{})",
                value
                    .as_ref()
                    .map(|v| format!(", value {v:?}"))
                    .unwrap_or_default()
            ));
        }
        let path = if parent.is_empty() {
            label
        } else {
            format!("{parent}.{label}")
        };
        let node = Node {
            rule: rule(payload, &here, &path)?,
            children: build_level(children, &format!("{here}.descriptors"), &path, rule)?,
        };
        let nodes: &mut KeyNodes = level.keys.entry(key).or_default();
        match value {
            None => nodes.default = Some(node),
            Some(v) if v.contains('*') => nodes.wildcards.push((Wildcard::new(&v), node)),
            Some(v) => {
                nodes.exact.insert(v, node);
            }
        }
    }
    Ok(level)
}

struct TreeBuilder<'a> {
    domain: &'a str,
    rules: Vec<Rule>,
}

impl TreeBuilder<'_> {
    /// The rule of one rate limit node, if it has limits.
    fn node_rule(
        &mut self,
        raw: RawLimits,
        here: &str,
        path: &str,
    ) -> Result<Option<usize>, String> {
        let limits = match (raw.rate_limit, raw.rate_limits) {
            (Some(_), Some(_)) => {
                return Err(format!("{here}: use rate_limit or rate_limits, not both"))
            }
            (Some(one), None) => vec![one],
            (None, Some(list)) if list.is_empty() => {
                return Err(format!("{here}.rate_limits: the list must not be empty"))
            }
            (None, Some(list)) => list,
            (None, None) => return Ok(None),
        };
        self.rule(limits, here, path, raw.shadow_mode, raw.detailed_metric)
            .map(Some)
    }

    fn rule(
        &mut self,
        limits: Vec<RawRateLimit>,
        at: &str,
        path: &str,
        shadow_mode: bool,
        detailed_metric: bool,
    ) -> Result<usize, String> {
        let stacked = limits.len() > 1;
        let mut rates: Vec<Rate> = Vec::with_capacity(limits.len());
        let mut replaces = Vec::new();
        for (i, raw) in limits.into_iter().enumerate() {
            let at = if stacked {
                format!("{at}.rate_limits[{i}]")
            } else {
                format!("{at}.rate_limit")
            };
            if let Some(list) = raw.replaces {
                if list.is_empty() {
                    return Err(format!("{at}: replaces must not be an empty list"));
                }
                for r in list {
                    match r.name {
                        Some(Scalar(n)) if !n.is_empty() => replaces.push(n),
                        _ => return Err(format!("{at}.replaces: every entry needs a name")),
                    }
                }
            }
            let name = match raw.name {
                Some(Scalar(n)) if n.is_empty() => {
                    return Err(format!("{at}: the name must not be empty"))
                }
                other => other.map(|Scalar(n)| n),
            };
            if raw.unlimited {
                if raw.unit.is_some() {
                    return Err(format!(
                        "{at}: an unlimited rate limit must not have a unit"
                    ));
                }
                if stacked {
                    return Err(format!("{at}: an unlimited rate limit cannot be stacked"));
                }
                continue;
            }
            let Some(UnitName(unit)) = raw.unit else {
                return Err(format!("{at}: the unit is missing"));
            };
            let Some(requests_per_unit) = raw.requests_per_unit else {
                return Err(format!("{at}: requests_per_unit is missing"));
            };
            let algorithm = raw
                .algorithm
                .map_or(Algorithm::FixedWindow, |AlgorithmName(a)| a);
            let rate = Rate {
                requests_per_unit,
                unit,
                algorithm,
                burst: raw.burst,
                name,
            };
            check_rate(&rate).map_err(|e| format!("{at}: {e}"))?;
            if let Some(twin) = rates.iter().find(|r| r.counter_id() == rate.counter_id()) {
                return Err(format!(
                    "{at}: a second {algorithm} limit per {unit} (the first allows {}); stacked limits need different units or algorithms",
                    twin.requests_per_unit
                ));
            }
            rates.push(rate);
        }
        self.rules.push(Rule {
            rates,
            shadow_mode,
            detailed_metric,
            replaces,
            path: path.to_owned(),
            metrics: RuleMetrics::register(self.domain, path),
        });
        Ok(self.rules.len() - 1)
    }
}

/// The rule of one `concurrency:` node, if it sets `max_connections`.
fn concurrency_rule(
    (max_connections, lease_ttl, name): (Option<u32>, Option<DurationText>, Option<Scalar>),
    here: &str,
    path: &str,
    rules: &mut Vec<ConcurrencyRule>,
) -> Result<Option<usize>, String> {
    let Some(max_connections) = max_connections else {
        if lease_ttl.is_some() || name.is_some() {
            return Err(format!("{here}: lease_ttl and name need max_connections"));
        }
        return Ok(None);
    };
    if max_connections == 0 {
        return Err(format!("{here}: max_connections must be positive"));
    }
    let lease_ttl = lease_ttl.map_or(DEFAULT_LEASE_TTL, |DurationText(d)| d);
    let (min, max) = LEASE_TTL_RANGE;
    if lease_ttl < min || lease_ttl > max {
        return Err(format!(
            "{here}: lease_ttl must be between {min:?} and {max:?}"
        ));
    }
    rules.push(ConcurrencyRule {
        max_connections,
        lease_ttl,
        name: name.map(|Scalar(n)| n),
        path: path.to_owned(),
    });
    Ok(Some(rules.len() - 1))
}

/// Checks a rate's numbers against its algorithm.
fn check_rate(rate: &Rate) -> Result<(), String> {
    let algorithm = rate.algorithm;
    if rate.burst.is_some() && !algorithm.has_burst() {
        return Err(format!(
            "burst applies only to token_bucket and leaky_bucket, not {algorithm}"
        ));
    }
    // A zero fixed window refuses everything, as in envoyproxy/ratelimit; the
    // other algorithms are rates and need one.
    if rate.requests_per_unit == 0 && algorithm != Algorithm::FixedWindow {
        return Err(format!(
            "requests_per_unit must be positive for {algorithm}"
        ));
    }
    if rate.burst == Some(0) {
        return Err("burst must be positive".into());
    }
    if algorithm.has_burst() {
        let emission_us = gcra::emission_interval_us(
            rate.unit.seconds() * 1_000,
            u64::from(rate.requests_per_unit),
        );
        if rate.effective_burst().saturating_mul(emission_us) > gcra::MAX_BURST_SPAN_US {
            return Err(format!(
                "burst {} at {} per {} spans more than 2^52 microseconds",
                rate.effective_burst(),
                rate.requests_per_unit,
                rate.unit
            ));
        }
    }
    Ok(())
}

fn check_replaces(rules: &[Rule]) -> Result<(), String> {
    for rule in rules {
        if let Some(name) = rule.replaces.iter().find(|n| rule.is_named(n)) {
            return Err(format!("rule {:?} ({name:?}) replaces itself", rule.path));
        }
    }
    Ok(())
}
