//! One limits file: envoyproxy/ratelimit's YAML format, parsed strictly and
//! compiled into a [`RuleTree`].

use std::collections::HashSet;
use std::fmt;
use std::path::Path;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use crate::error::ConfigError;
use crate::limiter::{gcra, Algorithm, Unit};
use crate::rules::{KeyNodes, Level, Node, Rate, Rule, RuleMetrics, RuleTree, Wildcard};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    domain: Option<Scalar>,
    descriptors: Option<Vec<RawDescriptor>>,
    /// ratekeeper: `false` keeps Envoy's count-everything behaviour.
    all_or_nothing: Option<bool>,
    /// ratekeeper: RateLimit-* response headers for this domain (overrides the flag).
    response_headers: Option<bool>,
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
}

/// One domain, as loaded from one file.
#[derive(Debug)]
pub struct DomainConfig {
    pub name: String,
    pub rules: RuleTree,
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
    let root = builder
        .level(raw.descriptors.unwrap_or_default(), "descriptors", "")
        .map_err(fail)?;
    let rules = builder.rules;
    check_replaces(&rules).map_err(fail)?;
    Ok(DomainConfig {
        name: domain,
        rules: RuleTree { root, rules },
        options: DomainOptions {
            all_or_nothing: raw.all_or_nothing.unwrap_or(true),
            response_headers: raw.response_headers,
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

struct TreeBuilder<'a> {
    domain: &'a str,
    rules: Vec<Rule>,
}

impl TreeBuilder<'_> {
    /// Compiles the descriptors under one node. `at` is the YAML path for
    /// errors, `parent` the metrics path of the enclosing node.
    fn level(&mut self, raw: Vec<RawDescriptor>, at: &str, parent: &str) -> Result<Level, String> {
        let mut level = Level::default();
        let mut seen = HashSet::new();
        for (i, d) in raw.into_iter().enumerate() {
            let here = format!("{at}[{i}]");
            let key = match d.key {
                Some(Scalar(k)) if !k.is_empty() => k,
                _ => return Err(format!("{here}: the descriptor key must not be empty")),
            };
            let value = d.value.map(|Scalar(v)| v);
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
            let limits = match (d.rate_limit, d.rate_limits) {
                (Some(_), Some(_)) => {
                    return Err(format!("{here}: use rate_limit or rate_limits, not both"))
                }
                (Some(one), None) => Some(vec![one]),
                (None, Some(list)) if list.is_empty() => {
                    return Err(format!("{here}.rate_limits: the list must not be empty"))
                }
                (None, many) => many,
            };
            let rule = match limits {
                Some(limits) => {
                    Some(self.rule(limits, &here, &path, d.shadow_mode, d.detailed_metric)?)
                }
                None => None,
            };
            let children = self.level(
                d.descriptors.unwrap_or_default(),
                &format!("{here}.descriptors"),
                &path,
            )?;
            let node = Node { rule, children };
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
        let emission_us =
            (rate.unit.seconds() * 1_000_000).div_ceil(u64::from(rate.requests_per_unit));
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
