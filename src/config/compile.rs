//! The one compiler: checks a [`DomainDescription`], from whichever source,
//! and builds the model ([`DomainConfig`]: the rules tree with its rates, and
//! the concurrency rules). Every rule about what a config may say lives here,
//! so a limits file and an xDS snapshot are refused for the same reasons in
//! the same words.

use std::collections::HashSet;
use std::fmt;
use std::time::Duration;

use super::description::{Concurrency, DomainDescription, Limit, Limits, Node as RawNode};
use super::{DomainConfig, DomainOptions};
use crate::limiter::{gcra, Algorithm};
use crate::rules::{
    ConcurrencyRule, KeyNodes, Level, Node, Rate, Rule, RuleMetrics, RuleTree, Wildcard,
};

/// The default lease TTL of a concurrency rule.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);
/// Lease TTLs accepted in files and requests.
pub const LEASE_TTL_RANGE: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(3600));

/// Why a description does not compile, and where in its source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileError {
    /// The offending node's path in its source (`descriptors[0].rate_limit`);
    /// empty for the domain itself.
    pub at: String,
    pub reason: String,
}

impl CompileError {
    pub fn new(at: &str, reason: impl Into<String>) -> Self {
        CompileError {
            at: at.to_owned(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for CompileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.at.is_empty() {
            f.write_str(&self.reason)
        } else {
            write!(f, "{}: {}", self.at, self.reason)
        }
    }
}

type Compiled<T> = Result<T, CompileError>;

/// Checks and compiles one domain.
pub fn compile(description: DomainDescription) -> Compiled<DomainConfig> {
    let domain = description.domain;
    let charges = description.charges;
    if domain.is_empty() {
        return Err(CompileError::new("", "the domain must not be empty"));
    }
    let mut rules = Vec::new();
    let root = build_level(description.descriptors, "", &mut |limits, at, path| {
        rate_rule(limits, at, path, &domain, &mut rules)
    })?;
    check_replaces(&rules)?;
    for rate in rules.iter_mut().flat_map(|rule| rule.rates.iter_mut()) {
        rate.charges = rate.charges.or(charges);
    }
    let mut concurrency_rules = Vec::new();
    let concurrency_root = build_level(description.concurrency, "", &mut |c, at, path| {
        concurrency_rule(c, at, path, &mut concurrency_rules)
    })?;
    Ok(DomainConfig {
        name: domain,
        rules: RuleTree { root, rules },
        concurrency: RuleTree {
            root: concurrency_root,
            rules: concurrency_rules,
        },
        options: DomainOptions {
            all_or_nothing: description.all_or_nothing.unwrap_or(true),
            response_headers: description.response_headers,
            failure_mode: description.failure_mode,
        },
    })
}

/// Compiles the nodes under one level. `parent` is the metrics path of the
/// enclosing node; `rule` turns a node's payload into a rule index (or none).
fn build_level<P>(
    nodes: Vec<RawNode<P>>,
    parent: &str,
    rule: &mut impl FnMut(P, &str, &str) -> Compiled<Option<usize>>,
) -> Compiled<Level> {
    let mut level = Level::default();
    let mut seen = HashSet::new();
    for node in nodes {
        let RawNode {
            at,
            key,
            value,
            payload,
            children,
        } = node;
        if key.is_empty() {
            return Err(CompileError::new(
                &at,
                "the descriptor key must not be empty",
            ));
        }
        let label = match &value {
            Some(v) => format!("{key}_{v}"),
            None => key.clone(),
        };
        if !seen.insert((key.clone(), value.clone())) {
            let value_part = value
                .as_ref()
                .map(|v| format!(", value {v:?}"))
                .unwrap_or_default();
            return Err(CompileError::new(
                &at,
                format!("duplicate descriptor {label:?} at this level (key {key:?}{value_part})"),
            ));
        }
        let path = if parent.is_empty() {
            label
        } else {
            format!("{parent}.{label}")
        };
        let compiled = Node {
            rule: rule(payload, &at, &path)?,
            children: build_level(children, &path, rule)?,
        };
        let nodes: &mut KeyNodes = level.keys.entry(key).or_default();
        match value {
            None => nodes.default = Some(compiled),
            Some(v) if v.contains('*') => nodes.wildcards.push((Wildcard::new(&v), compiled)),
            Some(v) => {
                nodes.exact.insert(v, compiled);
            }
        }
    }
    Ok(level)
}

/// The rule of one rate limit node, if it has limits.
fn rate_rule(
    node: Limits,
    at: &str,
    path: &str,
    domain: &str,
    rules: &mut Vec<Rule>,
) -> Compiled<Option<usize>> {
    refuse_unsupported(&node, at)?;
    if node.limits.is_empty() {
        return Ok(None);
    }
    let stacked = node.limits.len() > 1;
    let mut rates: Vec<Rate> = Vec::with_capacity(node.limits.len());
    let mut replaces = Vec::new();
    for limit in node.limits {
        let at = limit.at.as_str();
        for name in &limit.replaces {
            if name.is_empty() {
                return Err(CompileError::new(
                    &format!("{at}.replaces"),
                    "every entry needs a name",
                ));
            }
            replaces.push(name.clone());
        }
        if limit.unlimited {
            if limit.unit.is_some() {
                return Err(CompileError::new(
                    at,
                    "an unlimited rate limit must not have a unit",
                ));
            }
            if stacked {
                return Err(CompileError::new(
                    at,
                    "an unlimited rate limit cannot be stacked",
                ));
            }
            continue;
        }
        let rate = rate(&limit)?;
        if let Some(twin) = rates.iter().find(|r| r.counter_id() == rate.counter_id()) {
            return Err(CompileError::new(
                at,
                format!(
                    "a second {} limit per {} (the first allows {}); stacked limits need different units or algorithms",
                    rate.algorithm, rate.unit, twin.requests_per_unit
                ),
            ));
        }
        rates.push(rate);
    }
    rules.push(Rule {
        rates,
        shadow_mode: node.shadow_mode,
        detailed_metric: node.detailed_metric,
        replaces,
        path: path.to_owned(),
        metrics: RuleMetrics::register(domain, path),
    });
    Ok(Some(rules.len() - 1))
}

/// envoyproxy/ratelimit's descriptor options whose behaviour ratekeeper does
/// not have yet: refused rather than silently ignored.
fn refuse_unsupported(node: &Limits, at: &str) -> Compiled<()> {
    let unsupported = [
        ("quota_mode", node.quota_mode),
        ("share_threshold", node.share_threshold),
        ("value_to_metric", node.value_to_metric),
        ("metadata", node.metadata.is_some()),
    ];
    match unsupported.iter().find(|(_, set)| *set) {
        Some((name, _)) => Err(CompileError::new(
            at,
            format!("{name} is not supported yet"),
        )),
        None => Ok(()),
    }
}

/// The rate of one limited (not `unlimited`) policy.
fn rate(limit: &Limit) -> Compiled<Rate> {
    let at = limit.at.as_str();
    let Some(unit) = limit.unit else {
        return Err(CompileError::new(at, "the unit is missing"));
    };
    let Some(requests_per_unit) = limit.requests_per_unit else {
        return Err(CompileError::new(at, "requests_per_unit is missing"));
    };
    let rate = Rate {
        requests_per_unit,
        unit,
        algorithm: limit.algorithm.unwrap_or(Algorithm::FixedWindow),
        burst: limit.burst,
        name: limit.name.clone(),
        charges: limit.charges,
    };
    check_rate(&rate).map_err(|reason| CompileError::new(at, reason))?;
    Ok(rate)
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

fn check_replaces(rules: &[Rule]) -> Compiled<()> {
    for rule in rules {
        if let Some(name) = rule.replaces.iter().find(|n| rule.is_named(n)) {
            return Err(CompileError::new(
                "",
                format!("rule {:?} ({name:?}) replaces itself", rule.path),
            ));
        }
    }
    Ok(())
}

/// The rule of one `concurrency:` node, if it sets `max_connections`.
fn concurrency_rule(
    node: Concurrency,
    at: &str,
    path: &str,
    rules: &mut Vec<ConcurrencyRule>,
) -> Compiled<Option<usize>> {
    let Some(max_connections) = node.max_connections else {
        if node.lease_ttl.is_some() || node.name.is_some() {
            return Err(CompileError::new(
                at,
                "lease_ttl and name need max_connections",
            ));
        }
        return Ok(None);
    };
    if max_connections == 0 {
        return Err(CompileError::new(at, "max_connections must be positive"));
    }
    let lease_ttl = node.lease_ttl.unwrap_or(DEFAULT_LEASE_TTL);
    let (min, max) = LEASE_TTL_RANGE;
    if lease_ttl < min || lease_ttl > max {
        return Err(CompileError::new(
            at,
            format!("lease_ttl must be between {min:?} and {max:?}"),
        ));
    }
    rules.push(ConcurrencyRule {
        max_connections,
        lease_ttl,
        name: node.name,
        path: path.to_owned(),
    });
    Ok(Some(rules.len() - 1))
}
