//! Step 1 of a decision: from a request to the checks the store must apply.
//!
//! Each descriptor gets its limits — its `limit` override, else its matched
//! rule's (maybe stacked) rates, minus rules another matched rule
//! `replaces` — and each limit one [`Check`] on its counter key.

use std::borrow::Cow;
use std::ops::Range;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tonic::Status;

use super::LimiterSettings;
use crate::keys::counter_key;
use crate::limiter::{Charges, Check, Unit, MAX_HITS};
use crate::rules::{Rate, Rule, RuleTree};
use crate::service::caps;
use crate::service::wire::Entries;

/// Checks the request against the caps, and what this service refuses on
/// top of them.
pub fn validate(request: &RateLimitRequest) -> Result<(), Status> {
    caps::validate(&request.domain, &request.descriptors)?;
    match request.descriptors.iter().position(|d| d.is_negative_hits) {
        Some(i) => Err(Status::invalid_argument(format!(
            "descriptors[{i}]: is_negative_hits is not supported"
        ))),
        None => Ok(()),
    }
}

/// The limits that apply to one descriptor of a request.
#[derive(Debug)]
pub enum Applied<'c> {
    /// No rule matched (or it was replaced): OK, no `current_limit`.
    None,
    /// An `unlimited` rule (this one): OK, remaining `u32::MAX`.
    Unlimited(&'c Rule),
    /// Counted limits: a configured rule's (maybe stacked) or the
    /// descriptor's override; `checks` are their checks, in the same order.
    /// `quota`: a quota descriptor (its rule's `quota_mode`, or `QUOTA_MODE`).
    Counted {
        rule: Option<&'c Rule>,
        rates: Cow<'c, [Rate]>,
        checks: Range<usize>,
        quota: bool,
    },
}

/// What a request asks the store: per descriptor its limits, and all the
/// checks in one list (the store applies them as one atomic step).
#[derive(Debug)]
pub struct Plan<'c> {
    pub applied: Vec<Applied<'c>>,
    pub checks: Vec<Check>,
}

/// A descriptor's limits before `replaces` is applied.
enum Found<'c> {
    Rule(Option<&'c Rule>, Shared<'c>),
    Override(Rate),
}

/// The entries matched by a `share_threshold` wildcard, by position, with
/// the pattern that stands for their value in the counter key (empty, so
/// not allocated, for every other descriptor).
type Shared<'c> = Vec<(usize, &'c str)>;

impl<'c> Plan<'c> {
    /// Plans `request` (already validated) against a domain's `rules`.
    pub fn new(
        request: &RateLimitRequest,
        rules: &'c RuleTree,
        settings: &LimiterSettings,
    ) -> Result<Plan<'c>, Status> {
        let mut found = find(request, rules)?;
        drop_replaced(&mut found);
        let mut checks = Vec::new();
        let applied = found
            .into_iter()
            .zip(&request.descriptors)
            .map(|(found, descriptor)| {
                let (rule, rates, shared) = match found {
                    Found::Override(rate) => (None, Cow::Owned(vec![rate]), Vec::new()),
                    Found::Rule(None, _) => return Applied::None,
                    Found::Rule(Some(rule), _) if rule.is_unlimited() => {
                        return Applied::Unlimited(rule)
                    }
                    Found::Rule(Some(rule), shared) => {
                        (Some(rule), Cow::Borrowed(rule.rates.as_slice()), shared)
                    }
                };
                let quota = settings.modes.quota || rule.is_some_and(|r| r.quota_mode);
                // Only an enforced check refuses the request's other checks
                // (all-or-nothing): a quota or shadow one may be over while
                // the request is admitted, and then the others count.
                let enforce = !(quota || settings.shadows(rule));
                let first = checks.len();
                for rate in rates.iter() {
                    checks.push(check(request, descriptor, &shared, rate, enforce, settings));
                }
                Applied::Counted {
                    rule,
                    rates,
                    checks: first..checks.len(),
                    quota,
                }
            })
            .collect();
        Ok(Plan { applied, checks })
    }
}

/// Each descriptor's override or matched rule.
fn find<'c>(request: &RateLimitRequest, rules: &'c RuleTree) -> Result<Vec<Found<'c>>, Status> {
    let found = request
        .descriptors
        .iter()
        .enumerate()
        .map(|(i, descriptor)| {
            let Some(limit) = &descriptor.limit else {
                let mut shared = Vec::new();
                let rule = rules.find_sharing(descriptor.entries(), |i, pattern| {
                    shared.push((i, pattern));
                });
                return Ok(Found::Rule(rule, shared));
            };
            let unit = Unit::from_envoy(limit.unit).ok_or_else(|| {
                Status::invalid_argument(format!(
                    "descriptors[{i}].limit: unit {} is not a known rate limit unit",
                    limit.unit
                ))
            })?;
            Ok(Found::Override(Rate::fixed(limit.requests_per_unit, unit)))
        });
    found.collect()
}

/// A matched rule named in another matched rule's `replaces` does not apply.
fn drop_replaced<'c>(found: &mut [Found<'c>]) {
    fn rule<'c>(found: &Found<'c>) -> Option<&'c Rule> {
        match found {
            Found::Rule(rule, _) => *rule,
            Found::Override(_) => None,
        }
    }
    let replaced: Vec<&str> = found
        .iter()
        .filter_map(rule)
        .flat_map(|rule| rule.replaces.iter().map(String::as_str))
        .collect();
    if replaced.is_empty() {
        return;
    }
    for slot in found.iter_mut() {
        if rule(slot).is_some_and(|rule| replaced.iter().any(|name| rule.is_named(name))) {
            *slot = Found::Rule(None, Vec::new());
        }
    }
}

/// The check of one limit of one descriptor.
fn check(
    request: &RateLimitRequest,
    descriptor: &RateLimitDescriptor,
    shared: &Shared<'_>,
    rate: &Rate,
    enforce: bool,
    settings: &LimiterSettings,
) -> Check {
    // A shared entry's pattern replaces its value, by position (as their
    // cache key does), so every value the wildcard matches counts together.
    let entries = descriptor.entries().enumerate().map(|(i, (key, value))| {
        let pattern = shared.iter().find(|(at, _)| *at == i);
        (key, pattern.map_or(value, |(_, pattern)| *pattern))
    });
    // An override's counter is the configured fixed window's of the same
    // unit: envoyproxy/ratelimit's cache key has the descriptor and the
    // window, not `requests_per_unit`, so Envoy's override and the file's
    // rule (and overrides of different sizes) count together.
    Check {
        key: counter_key(
            &settings.key_prefix,
            &request.domain,
            entries,
            settings.values,
            &rate.counter_id(),
        ),
        algorithm: rate.algorithm,
        limit: u64::from(rate.requests_per_unit),
        period_ms: rate.unit.seconds() * 1_000,
        burst: rate.effective_burst(),
        hits: hits(request, descriptor),
        enforce,
        charges: rate
            .charges
            .map_or_else(|| settings.charges(rate.algorithm), Charges::recorded),
    }
}

/// Hits to consume for one descriptor: its own `hits_addend` when set (0
/// allowed: check only), else the request's, where 0 means 1.
fn hits(request: &RateLimitRequest, descriptor: &RateLimitDescriptor) -> u64 {
    let hits = match &descriptor.hits_addend {
        Some(own) => own.value,
        None => u64::from(request.hits_addend.max(1)),
    };
    hits.min(MAX_HITS)
}

#[cfg(test)]
pub(super) mod tests {
    use std::path::Path;

    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
        Entry, RateLimitOverride,
    };

    use super::*;
    use crate::config::Config;
    use crate::limiter::Algorithm;

    /// A domain `d` with a plain rule, a stacked one, a shadow one, an
    /// unlimited one and one that replaces another.
    pub const LIMITS: &str = "
domain: d
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: org
    rate_limits:
      - {unit: second, requests_per_unit: 10}
      - {unit: hour, requests_per_unit: 100, algorithm: token_bucket, burst: 20}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: free
    rate_limit: {unlimited: true}
  - key: vip
    rate_limit: {unit: minute, requests_per_unit: 1000, name: vip}
  - key: boss
    rate_limit: {unit: minute, requests_per_unit: 5, replaces: [{name: vip}]}
";

    pub fn config() -> Config {
        Config::from_files([(Path::new("d.yaml"), LIMITS)]).expect("limits")
    }

    pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: (*k).into(),
                    value: (*v).into(),
                })
                .collect(),
            ..Default::default()
        }
    }

    pub fn request(descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
        RateLimitRequest {
            domain: "d".into(),
            descriptors,
            hits_addend: 0,
        }
    }

    fn plan<'c>(config: &'c Config, request: &RateLimitRequest) -> Plan<'c> {
        let rules = &config.domain("d").expect("domain d").rules;
        Plan::new(request, rules, &LimiterSettings::default()).expect("plan")
    }

    #[test]
    fn one_check_per_limit_of_each_matched_rule() {
        let config = config();
        let request = request(vec![
            descriptor(&[("nobody", "x")]),
            descriptor(&[("org", "acme")]),
            descriptor(&[("free", "x")]),
            descriptor(&[("shadow", "x")]),
        ]);
        let plan = plan(&config, &request);
        assert!(matches!(plan.applied[0], Applied::None));
        assert!(matches!(&plan.applied[1], Applied::Counted { checks, .. } if *checks == (0..2)));
        assert!(matches!(plan.applied[2], Applied::Unlimited(_)));
        assert!(matches!(&plan.applied[3], Applied::Counted { checks, .. } if *checks == (2..3)));
        let c = &plan.checks;
        assert_eq!(c.len(), 3);
        assert_eq!((c[0].limit, c[0].period_ms, c[0].hits), (10, 1_000, 1));
        assert_eq!((c[1].algorithm, c[1].burst), (Algorithm::TokenBucket, 20));
        assert_ne!(c[0].key, c[1].key, "stacked limits count apart");
        assert!(c[0].enforce && !c[2].enforce, "shadow mode never refuses");
    }

    #[test]
    fn replaced_rules_and_overrides() {
        let config = config();
        let mut overridden = descriptor(&[("user", "a")]);
        overridden.limit = Some(RateLimitOverride {
            requests_per_unit: 7,
            unit: Unit::Hour.to_envoy(),
        });
        let request = request(vec![
            descriptor(&[("vip", "a")]),
            descriptor(&[("boss", "a")]),
            overridden,
            descriptor(&[("user", "a")]),
        ]);
        let plan = plan(&config, &request);
        assert!(matches!(plan.applied[0], Applied::None), "vip is replaced");
        assert!(matches!(
            &plan.applied[2],
            Applied::Counted { rule: None, .. }
        ));
        let (boss, over, user) = (&plan.checks[0], &plan.checks[1], &plan.checks[2]);
        assert_eq!(boss.limit, 5);
        assert_eq!((over.limit, over.period_ms), (7, 3_600_000));
        assert_ne!(over.key, user.key, "another unit is another window");
    }

    #[test]
    fn hits_come_from_the_descriptor_then_the_request() {
        let mut request = request(vec![descriptor(&[("user", "a")]); 2]);
        request.descriptors[1].hits_addend =
            Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 });
        request.hits_addend = 4;
        let config = config();
        let plan = plan(&config, &request);
        assert_eq!((plan.checks[0].hits, plan.checks[1].hits), (4, 0));
    }

    #[test]
    fn refuses_unknown_override_units_and_negative_hits() {
        let config = config();
        let mut bad = descriptor(&[("user", "a")]);
        bad.limit = Some(RateLimitOverride {
            requests_per_unit: 1,
            unit: 99,
        });
        let rules = &config.domain("d").expect("domain").rules;
        let e = Plan::new(&request(vec![bad]), rules, &LimiterSettings::default()).unwrap_err();
        assert!(
            e.message().contains("descriptors[0].limit: unit 99"),
            "{}",
            e.message()
        );
        let mut negative = descriptor(&[("user", "a")]);
        negative.is_negative_hits = true;
        let e = validate(&request(vec![descriptor(&[("k", "v")]), negative])).unwrap_err();
        assert!(
            e.message().contains("descriptors[1]: is_negative_hits"),
            "{}",
            e.message()
        );
    }
}
