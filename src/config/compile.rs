//! The one compiler: checks a [`DomainDescription`], from whichever source,
//! and builds the model ([`DomainConfig`]: the rules tree with its rates, and
//! the concurrency rules). Every rule about what a config may say lives here,
//! so a limits file and an xDS snapshot are refused for the same reasons in
//! the same words.

use std::collections::HashSet;
use std::fmt;
use std::time::Duration;

use super::description::{Concurrency, DomainDescription, Limit, Limits, Node as RawNode};
use super::value_metric;
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

/// Longest domain, in bytes, a limits file or snapshot may define and a
/// request may name: above Envoy Gateway's longest (a listener's
/// `<namespace>/<gateway>/<listener>`, up to 63 + 253 + 253 bytes).
pub const MAX_DOMAIN_BYTES: usize = 1024;

/// Checks and compiles one domain; with it, what does not stop it but its
/// author should hear (each where and why, for the caller to locate and log).
pub fn compile(description: DomainDescription) -> Compiled<(DomainConfig, Vec<CompileError>)> {
    let domain = description.domain;
    let charges = description.charges;
    if domain.is_empty() {
        return Err(CompileError::new("domain", "the domain must not be empty"));
    }
    if domain.len() > MAX_DOMAIN_BYTES {
        // Requests naming it would be refused: its limits would never apply.
        return Err(CompileError::new(
            "domain",
            format!(
                "the domain is {} bytes, longer than the {MAX_DOMAIN_BYTES} a request may name",
                domain.len()
            ),
        ));
    }
    let mut rules = Vec::new();
    let (mut warnings, mut rate_warnings) = (Vec::new(), Vec::new());
    let metric_levels = value_metric::levels(&description.descriptors);
    let rule_of = &mut |limits: Limits, at: &str, path: &str| {
        let share = limits.share_threshold;
        let index = rate_rule(limits, path, &domain, &mut rules, &mut rate_warnings)?;
        if let (Some(i), Some(levels)) = (index, metric_levels.get(at)) {
            let rule: &mut Rule = &mut rules[i];
            rule.metrics = RuleMetrics::ours_only(&domain, path);
            rule.metric_levels = Some(levels.clone());
        }
        Ok((index, share))
    };
    let root = build_level(description.descriptors, "", rule_of, &mut warnings)?;
    warnings.append(&mut rate_warnings);
    for rate in rules.iter_mut().flat_map(|rule| rule.rates.iter_mut()) {
        rate.charges = rate.charges.or(charges);
    }
    let mut concurrency_rules = Vec::new();
    let concurrency_root = build_level(
        description.concurrency,
        "",
        &mut |c, at, path| {
            Ok((
                concurrency_rule(c, at, path, &mut concurrency_rules)?,
                false,
            ))
        },
        &mut warnings,
    )?;
    let config = DomainConfig {
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
    };
    Ok((config, warnings))
}

/// What a node's payload compiles to: its rule's index (or none), and
/// whether its wildcard value shares one counter (`share_threshold`).
type NodeRule = (Option<usize>, bool);

/// Compiles the nodes under one level. `parent` is the metrics path of the
/// enclosing node; `rule` turns a node's payload into its [`NodeRule`].
fn build_level<P>(
    nodes: Vec<RawNode<P>>,
    parent: &str,
    rule: &mut impl FnMut(P, &str, &str) -> Compiled<NodeRule>,
    warnings: &mut Vec<CompileError>,
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
        // Envoy Gateway's routes without a hostname are named `…/*`, and
        // each is a `generic_key` whose value is its name: a request sends
        // that same pair, which both match alike. Said for any other.
        if key.contains('*') && value.as_deref() != Some(key.as_str()) {
            warnings.push(CompileError::new(
                &at,
                format!(
                    "descriptor key {key:?} holds '*', matched here as it is: only values are \
                     patterns (envoyproxy/ratelimit matches such a key as a pattern over \
                     `key_value`, so other keys reach it there)"
                ),
            ));
        }
        let label = value_metric::label(&key, value.as_deref());
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
            label.clone()
        } else {
            format!("{parent}.{label}")
        };
        let (rule_index, share) = rule(payload, &at, &path)?;
        let wildcard = value.as_ref().filter(|v| v.contains('*'));
        // Theirs asks for a '*' in `key_value`: one in the key (matched
        // here as it is, said above) loads too, and shares nothing.
        if share && wildcard.is_none() && !key.contains('*') {
            return Err(CompileError::new(
                &at,
                format!("share_threshold can only be used with wildcard values (containing '*'), but found {label:?}"),
            ));
        }
        let compiled = Node {
            rule: rule_index,
            shared: wildcard.filter(|_| share).cloned(),
            children: build_level(children, &path, rule, warnings)?,
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
    path: &str,
    domain: &str,
    rules: &mut Vec<Rule>,
    warnings: &mut Vec<CompileError>,
) -> Compiled<Option<usize>> {
    if node.limits.is_empty() {
        return Ok(None);
    }
    let stacked = node.limits.len() > 1;
    let mut rates: Vec<Rate> = Vec::with_capacity(node.limits.len());
    let mut replaces = Vec::new();
    // Where each `replaces` list stands, for the error of one naming its own rule.
    let mut replaces_at = Vec::new();
    let mut unlimited_requests_per_unit = 0;
    // An unlimited limit counts nothing, but its name is the rule's too.
    let mut unlimited_name = None;
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
            replaces_at.push(format!("{at}.replaces"));
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
            unlimited_requests_per_unit = limit.requests_per_unit.unwrap_or(0);
            unlimited_name = limit.name;
            continue;
        }
        let rate = rate(&limit, warnings)?;
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
    let named = |name: &str| {
        unlimited_name.as_deref() == Some(name) || rates.iter().any(|r| r.is_named(name))
    };
    if let Some(i) = replaces.iter().position(|name| named(name)) {
        return Err(CompileError::new(
            &replaces_at[i],
            format!("rule {path:?} ({:?}) replaces itself", replaces[i]),
        ));
    }
    rules.push(Rule {
        rates,
        unlimited_requests_per_unit,
        shadow_mode: node.shadow_mode,
        quota_mode: node.quota_mode,
        metadata: node.metadata.as_ref().map(response_metadata),
        detailed_metric: node.detailed_metric,
        replaces,
        path: path.to_owned(),
        // A detailed rule's stat key (theirs) is the request's values.
        metrics: match node.detailed_metric {
            true => RuleMetrics::ours_only(domain, path),
            false => RuleMetrics::register(domain, path),
        },
        metric_levels: None,
    });
    Ok(Some(rules.len() - 1))
}

/// A `metadata:` of the limits file (or xDS) as the response's type.
fn response_metadata(config: &prost_types::Struct) -> envoy_types::pb::google::protobuf::Struct {
    envoy_types::pb::google::protobuf::Struct {
        fields: config
            .fields
            .iter()
            .map(|(k, v)| (k.clone(), config_value(v)))
            .collect(),
    }
}

fn config_value(v: &prost_types::Value) -> envoy_types::pb::google::protobuf::Value {
    use envoy_types::pb::google::protobuf::value::Kind;
    use envoy_types::pb::google::protobuf::ListValue;
    use prost_types::value::Kind as K;
    let kind = v.kind.as_ref().map(|kind| match kind {
        K::NullValue(n) => Kind::NullValue(*n),
        K::NumberValue(n) => Kind::NumberValue(*n),
        K::StringValue(s) => Kind::StringValue(s.clone()),
        K::BoolValue(b) => Kind::BoolValue(*b),
        K::StructValue(s) => Kind::StructValue(response_metadata(s)),
        K::ListValue(l) => Kind::ListValue(ListValue {
            values: l.values.iter().map(config_value).collect(),
        }),
    });
    envoy_types::pb::google::protobuf::Value { kind }
}

/// The rate of one limited (not `unlimited`) policy.
fn rate(limit: &Limit, warnings: &mut Vec<CompileError>) -> Compiled<Rate> {
    let at = limit.at.as_str();
    let Some(unit) = limit.unit else {
        return Err(CompileError::new(at, "the unit is missing"));
    };
    // Missing is 0 (refuse everything), as envoyproxy/ratelimit's loader
    // reads it: a file that loads there answers the same here.
    let requests_per_unit = limit.requests_per_unit.unwrap_or(0);
    let rate = Rate {
        requests_per_unit,
        unit,
        algorithm: limit.algorithm.unwrap_or(Algorithm::FixedWindow),
        burst: limit.burst,
        name: limit.name.clone(),
        charges: limit.charges,
    };
    check_rate(&rate).map_err(|reason| CompileError::new(at, reason))?;
    if let Some(loss) = bucket_rounding_loss(&rate) {
        warnings.push(CompileError::new(at, loss));
    }
    Ok(rate)
}

/// What a token or leaky bucket's rate loses to whole microseconds, when
/// it is more than 1%: its hits are spaced by the interval rounded up
/// (never faster than configured), which at high rates admits less.
fn bucket_rounding_loss(rate: &Rate) -> Option<String> {
    if !rate.algorithm.has_burst() {
        return None;
    }
    let (period_ms, limit) = (
        rate.unit.seconds() * 1_000,
        u64::from(rate.requests_per_unit),
    );
    let rounded = gcra::emission_interval_us(period_ms, limit);
    let period_us = period_ms * 1_000;
    let admitted = period_us / rounded;
    if admitted.saturating_mul(100) >= limit.saturating_mul(99) {
        return None;
    }
    Some(format!(
        "{} of {limit} per {}: a hit every {:.3} µs, rounded up to {rounded} µs (buckets keep \
         whole microseconds), admits at most {admitted} per {}; fixed_window or \
         sliding_window count such rates exactly",
        rate.algorithm,
        rate.unit,
        period_us as f64 / limit as f64,
        rate.unit
    ))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Unit;

    fn loss(algorithm: Algorithm, requests_per_unit: u32, unit: Unit) -> Option<String> {
        bucket_rounding_loss(&Rate {
            requests_per_unit,
            unit,
            algorithm,
            burst: None,
            name: None,
            charges: None,
        })
    }

    #[test]
    fn a_bucket_rate_rounded_down_by_more_than_a_percent_is_named() {
        // 0.6 µs a hit rounds to 1 µs: 60M a minute, not 100M.
        let warned = loss(Algorithm::TokenBucket, 100_000_000, Unit::Minute).unwrap();
        assert!(
            warned.contains("admits at most 60000000 per minute"),
            "{warned}"
        );
        // 2.4 µs rounds to 3: 20M of 25M.
        let warned = loss(Algorithm::LeakyBucket, 25_000_000, Unit::Minute).unwrap();
        assert!(warned.contains("at most 20000000"), "{warned}");
        // Whole microseconds, or within 1%: nothing to say.
        assert_eq!(loss(Algorithm::TokenBucket, 20_000_000, Unit::Minute), None);
        assert_eq!(loss(Algorithm::TokenBucket, 999_000, Unit::Hour), None);
        // Counters count exactly.
        assert_eq!(
            loss(Algorithm::FixedWindow, 100_000_000, Unit::Minute),
            None
        );
    }
}
