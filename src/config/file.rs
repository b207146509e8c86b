//! One limits file: envoyproxy/ratelimit's YAML format, parsed strictly and
//! compiled into a [`RuleTree`].

use std::collections::HashSet;
use std::fmt;
use std::path::Path;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use crate::error::ConfigError;
use crate::limiter::{Algorithm, Unit};
use crate::rules::{KeyNodes, Level, Node, Rate, Rule, RuleMetrics, RuleTree, Wildcard};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    domain: Option<Scalar>,
    descriptors: Option<Vec<RawDescriptor>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescriptor {
    key: Option<Scalar>,
    value: Option<Scalar>,
    rate_limit: Option<RawRateLimit>,
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

/// One domain, as loaded from one file.
#[derive(Debug)]
pub struct DomainConfig {
    pub name: String,
    pub rules: RuleTree,
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
            let rule = match d.rate_limit {
                Some(rl) => Some(self.rule(rl, &here, &path, d.shadow_mode, d.detailed_metric)?),
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
        raw: RawRateLimit,
        at: &str,
        path: &str,
        shadow_mode: bool,
        detailed_metric: bool,
    ) -> Result<usize, String> {
        let rate = match (raw.unlimited, raw.unit, raw.requests_per_unit) {
            (true, Some(_), _) => {
                return Err(format!(
                    "{at}.rate_limit: an unlimited rate limit must not have a unit"
                ))
            }
            (true, None, _) => None,
            (false, None, _) => return Err(format!("{at}.rate_limit: the unit is missing")),
            (false, Some(_), None) => {
                return Err(format!("{at}.rate_limit: requests_per_unit is missing"))
            }
            (false, Some(UnitName(unit)), Some(requests_per_unit)) => Some(Rate {
                requests_per_unit,
                unit,
                algorithm: Algorithm::FixedWindow,
            }),
        };
        let name = match raw.name {
            Some(Scalar(n)) if n.is_empty() => {
                return Err(format!("{at}.rate_limit: the name must not be empty"))
            }
            other => other.map(|Scalar(n)| n),
        };
        let replaces = match raw.replaces {
            None => Vec::new(),
            Some(list) if list.is_empty() => {
                return Err(format!(
                    "{at}.rate_limit: replaces must not be an empty list"
                ))
            }
            Some(list) => list
                .into_iter()
                .map(|r| match r.name {
                    Some(Scalar(n)) if !n.is_empty() => Ok(n),
                    _ => Err(format!(
                        "{at}.rate_limit.replaces: every entry needs a name"
                    )),
                })
                .collect::<Result<_, _>>()?,
        };
        self.rules.push(Rule {
            name,
            rate,
            shadow_mode,
            detailed_metric,
            replaces,
            path: path.to_owned(),
            metrics: RuleMetrics::register(self.domain, path),
        });
        Ok(self.rules.len() - 1)
    }
}

fn check_replaces(rules: &[Rule]) -> Result<(), String> {
    for rule in rules {
        if let Some(name) = &rule.name {
            if rule.replaces.contains(name) {
                return Err(format!("rule {:?} ({name:?}) replaces itself", rule.path));
            }
        }
    }
    Ok(())
}
