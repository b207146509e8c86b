//! Per-rule hit counters, as envoyproxy/ratelimit keeps them (total, over,
//! near and within the limit, shadow mode, split as its base limiter splits
//! them), and under a request-dependent path too for `detailed_metric` and
//! `value_to_metric` rules and for a descriptor's `limit` override, under a
//! cap on distinct paths; and their count of requests for unknown domains,
//! under the same cap on distinct domains.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

use super::plan::{Applied, Plan};
use super::respond::{self, Verdict};
use crate::keys::Values;
use crate::limiter::Outcome;
use crate::rules::{MetricLevel, Rule, RuleMetrics};
use crate::stat_key::{one_segment, sanitize};
use crate::their_stats::TheirCounter;

/// `NEAR_LIMIT_RATIO`: the share of a limit past which hits count as
/// `near_limit` too (envoyproxy/ratelimit's default, 0.8).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NearLimitRatio(pub f32);

impl Default for NearLimitRatio {
    fn default() -> Self {
        NearLimitRatio(0.8)
    }
}

impl NearLimitRatio {
    /// Where `near_limit` starts on a limit of `limit`: `floor(limit ×
    /// ratio)`, in f32 as theirs (the same threshold for the same ratio),
    /// but never past the limit. f32 rounds limits above 2²⁴, up as often
    /// as down (16,777,219 is 16,777,220), so with a ratio of 1 theirs can
    /// sit past the limit, and a request crossing it then counts about 2⁶⁴
    /// near-limit hits there; here it counts none.
    fn threshold(self, limit: u64) -> u64 {
        let near_at = (limit as f32 * self.0).floor() as u64;
        near_at.min(limit)
    }
}

/// How many of a descriptor's hits fell in each range, counted as
/// envoyproxy/ratelimit's base limiter does (`within` includes `near`).
#[derive(Debug, Default, PartialEq, Eq)]
struct Split {
    within: u64,
    near: u64,
    over: u64,
}

impl Split {
    /// `hits` against a limit of `limit` with `used` spent after them (when
    /// admitted) or before them (when over: a refusal consumes nothing, and
    /// a charge recorded over the limit is split from where it started).
    /// `near_at` is [`NearLimitRatio::threshold`], so at most `limit`.
    fn of(hits: u64, limit: u64, used: u64, near_at: u64, over: bool) -> Split {
        if over {
            let (before, after) = (used, used.saturating_add(hits));
            // Refused by another of the rule's limits: all over.
            if before >= limit || after <= limit {
                return Split {
                    over: hits,
                    ..Split::default()
                };
            }
            return Split {
                over: after - limit,
                near: limit - near_at.max(before),
                within: 0,
            };
        }
        let (before, after) = (used.saturating_sub(hits), used);
        let near = match after > near_at {
            false => 0,
            true if before >= near_at => hits,
            true => after - near_at,
        };
        Split {
            within: hits,
            near,
            over: 0,
        }
    }
}

/// The label detailed counters (and unknown domains) past the cap share.
pub const OVERFLOW_LABEL: &str = "overflow";

/// Counts each decided request's hits against its rules, and the requests
/// for unknown domains.
#[derive(Debug)]
pub struct RuleCounters {
    detailed: DetailedSeries,
    /// Their `domain_not_found` counter of each unknown domain seen, by
    /// stat key (a cap of its own: a flood of random domains must not push
    /// the rules' detailed series into `overflow`).
    unknown_domains: Capped<String, TheirCounter>,
    /// How descriptor values appear in labels.
    values: Values,
    near_limit_ratio: NearLimitRatio,
    /// Whether `over_limit_with_local_cache` counts under their names too:
    /// only with `LOCAL_CACHE_SIZE_IN_BYTES` set, as theirs counts it only
    /// with its local cache on (ratekeeper's is on by default). Their
    /// default mapping also adds the stat, for rules two or more levels
    /// deep, to
    /// `ratelimit_service_rate_limit_over_limit` (its regexes are not
    /// anchored at the end); a cache on by default would inflate that.
    their_local_cache: bool,
}

impl RuleCounters {
    pub fn new(
        max_detailed_series: usize,
        values: Values,
        ratio: NearLimitRatio,
        their_local_cache: bool,
    ) -> Self {
        RuleCounters {
            detailed: DetailedSeries::new(max_detailed_series),
            unknown_domains: Capped::new(max_detailed_series),
            values,
            near_limit_ratio: ratio,
            their_local_cache,
        }
    }

    /// Counts the hits of every descriptor a configured rule or a `limit`
    /// override counted, each answered by its `verdicts`; `cached`: the
    /// outcomes are the over-limit cache's.
    pub fn record(
        &self,
        request: &RateLimitRequest,
        plan: &Plan<'_>,
        outcomes: &[Outcome],
        verdicts: &[Option<Verdict>],
        cached: bool,
    ) {
        let decided = plan.applied.iter().zip(verdicts).zip(&request.descriptors);
        for ((applied, verdict), descriptor) in decided {
            let (
                Applied::Counted {
                    rule,
                    rates,
                    checks,
                    ..
                },
                Some(verdict),
            ) = (applied, verdict)
            else {
                continue;
            };
            let outcomes = &outcomes[checks.clone()];
            // A shadow-mode rule's stats are those it would have if
            // enforced; its verdict, which never refuses, may name another
            // limit.
            let judged = if rule.is_some_and(|r| r.shadow_mode) {
                respond::tightest_limit(rates, outcomes, true)
            } else {
                Some(*verdict)
            };
            let Some(judged) = judged else {
                continue;
            };
            let hits = plan.checks[checks.start].hits;
            let split = self.split(hits, &judged, outcomes);
            self.count(&request.domain, *rule, descriptor, hits, &split, cached);
        }
    }

    /// Counts only `total_hits`, for a request the store failed to decide
    /// and the failure mode answered: theirs counts a request's hits before
    /// it asks Redis, so a rule's traffic does not drop to nothing while
    /// Redis is down.
    pub fn record_hits(&self, request: &RateLimitRequest, plan: &Plan<'_>) {
        let counted = plan.applied.iter().zip(&request.descriptors);
        for (applied, descriptor) in counted {
            if let Applied::Counted { rule, checks, .. } = applied {
                let hits = plan.checks[checks.start].hits;
                self.each_metrics(&request.domain, *rule, descriptor, |m| {
                    m.total_hits.increment(hits)
                });
            }
        }
    }

    /// Counts a request of `descriptors` descriptors for a domain no config
    /// has: theirs counts
    /// `ratelimit.service.rate_limit.<domain>.domain_not_found` once per
    /// descriptor (each looks its limit up). The domain is the caller's, so
    /// it is one segment of the name ([`one_segment`]), and distinct ones
    /// past the cap share the name `overflow`.
    pub fn domain_not_found(&self, domain: &str, descriptors: usize) {
        let key = sanitize(&one_segment(domain));
        let counter = self.unknown_domains.get(
            key,
            |_| OVERFLOW_LABEL.to_owned(),
            |key| {
                TheirCounter::new(&format!(
                    "ratelimit.service.rate_limit.{key}.domain_not_found"
                ))
            },
        );
        counter.add(descriptors as u64);
    }

    /// How a descriptor's `hits` split against its tightest limit, `judged`
    /// with over counting (its `outcomes` as the store gave them).
    fn split(&self, hits: u64, judged: &Verdict, outcomes: &[Outcome]) -> Split {
        let Verdict { state, at } = *judged;
        // A charge recorded over the limit splits from where it started, as
        // theirs splits from its counter before the increment.
        let remaining = outcomes[at].remaining_before.unwrap_or(state.remaining);
        let near_at = self.near_limit_ratio.threshold(state.limit);
        let used = state.limit.saturating_sub(remaining);
        Split::of(hits, state.limit, used, near_at, state.over)
    }

    /// One descriptor's `hits`, split as `split`, against its `rule` (`None`:
    /// its `limit` override); `cached`: the over-limit cache decided them.
    fn count(
        &self,
        domain: &str,
        rule: Option<&Rule>,
        descriptor: &RateLimitDescriptor,
        hits: u64,
        split: &Split,
        cached: bool,
    ) {
        let shadow_mode = rule.is_some_and(|r| r.shadow_mode);
        self.each_metrics(domain, rule, descriptor, |m| {
            m.total_hits.increment(hits);
            for (counter, n) in [
                (&m.within_limit, split.within),
                (&m.near_limit, split.near),
                (&m.over_limit, split.over),
            ] {
                if n > 0 {
                    counter.increment(n);
                }
            }
            if shadow_mode && split.over > 0 {
                m.shadow_mode.increment(split.over);
            }
            match (cached && split.over > 0, self.their_local_cache) {
                (false, _) => {}
                (true, true) => m.over_limit_with_local_cache.increment(split.over),
                (true, false) => m.over_limit_with_local_cache.increment_ours(split.over),
            }
        });
    }

    /// Applies `count` to the counters of a descriptor's limit: its rule's,
    /// and those of its path when the path takes the request's values.
    fn each_metrics(
        &self,
        domain: &str,
        rule: Option<&Rule>,
        descriptor: &RateLimitDescriptor,
        count: impl Fn(&RuleMetrics),
    ) {
        if let Some(rule) = rule {
            count(&rule.metrics);
        }
        if let Some(label) = self.dynamic_label(rule, descriptor) {
            count(&self.detailed.metrics(domain, label));
        }
    }

    /// The stat path of counted limits whose path takes the request's
    /// values: a `limit` override's (theirs gives it every entry's
    /// `key_value`, `key` for an empty value), a rule's levels where it has
    /// them (`value_to_metric`, or `detailed_metric` under a
    /// `share_threshold` wildcard), else a `detailed_metric` rule's (every
    /// entry's `key_value`). `None` for a rule with a fixed path.
    fn dynamic_label(
        &self,
        rule: Option<&Rule>,
        descriptor: &RateLimitDescriptor,
    ) -> Option<String> {
        let entries = descriptor.entries.iter();
        let levels: Vec<String> = match (rule, rule.and_then(|r| r.metric_levels.as_deref())) {
            (None, _) => entries.map(|e| self.level(e, false)).collect(),
            (Some(_), Some(levels)) => levels
                .iter()
                .zip(entries)
                .map(|(level, e)| match level {
                    MetricLevel::Config(label) => label.clone(),
                    MetricLevel::Request => self.level(e, false),
                })
                .collect(),
            (Some(rule), None) if rule.detailed_metric => {
                entries.map(|e| self.level(e, true)).collect()
            }
            (Some(_), None) => return None,
        };
        // Many long entries (an override takes them all) as one digest: a
        // series must not cost more than a few kilobytes.
        Some(crate::keys::bounded_label(levels.join(".")))
    }

    /// A request entry as one level of a stat path: `key_value`, or `key`
    /// for an empty value unless `always_value`. Both parts are the
    /// caller's (the key too, in an override), each kept one segment
    /// ([`one_segment`]): a value must not read as more levels, or count
    /// under another rule's path.
    fn level(&self, e: &Entry, always_value: bool) -> String {
        // A key of any length may come in an override: a long one goes in
        // as its digest, as a long value does.
        let key = Values::Raw.encode(&e.key);
        let key = one_segment(&key);
        match e.value.is_empty() && !always_value {
            true => key.into_owned(),
            false => format!("{key}_{}", one_segment(&self.values.encode(&e.value))),
        }
    }
}

/// What is made per key a caller chose (a stat path, an unknown domain),
/// for at most `cap` keys: a flood of random user ids or domains must not
/// grow `/metrics` (and memory) without bound. Past the cap, new keys get
/// their overflow key's. Kept here, a lookup is one lock and one hash, not
/// a metrics registry search per request.
#[derive(Debug)]
struct Capped<K, V> {
    cap: usize,
    seen: Mutex<HashMap<K, V>>,
}

impl<K: Hash + Eq, V: Clone> Capped<K, V> {
    fn new(cap: usize) -> Self {
        Capped {
            cap,
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// What `key` has, made by `make` when new; past the cap, what the key
    /// `overflow` makes of it has.
    fn get(&self, key: K, overflow: impl FnOnce(K) -> K, make: impl FnOnce(&K) -> V) -> V {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let key = match !seen.contains_key(&key) && seen.len() >= self.cap {
            true => overflow(key),
            false => key,
        };
        seen.entry(key).or_insert_with_key(make).clone()
    }
}

/// The counters of the request-dependent stat paths seen so far
/// (`detailed_metric`, `value_to_metric`, overrides), capped: past the
/// cap, new paths are counted under the label `overflow`.
#[derive(Debug)]
pub struct DetailedSeries(Capped<(String, String), Arc<RuleMetrics>>);

impl DetailedSeries {
    pub fn new(cap: usize) -> Self {
        DetailedSeries(Capped::new(cap))
    }

    /// The counters of path `label` in `domain`, or of `overflow`.
    fn metrics(&self, domain: &str, label: String) -> Arc<RuleMetrics> {
        self.0.get(
            (domain.to_owned(), label),
            |(domain, _)| (domain, OVERFLOW_LABEL.to_owned()),
            |(domain, label)| Arc::new(RuleMetrics::register(domain, label)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Unit;
    use crate::rules::Rate;

    #[test]
    fn hits_split_as_envoyproxy_ratelimit_counts_them() {
        let split = |within, near, over| Split { within, near, over };
        // Limit 10, near from 8 on (ratio 0.8).
        assert_eq!(Split::of(1, 10, 3, 8, false), split(1, 0, 0));
        assert_eq!(Split::of(1, 10, 9, 8, false), split(1, 1, 0));
        assert_eq!(
            Split::of(4, 10, 10, 8, false),
            split(4, 2, 0),
            "6..10: 9 and 10 near"
        );
        assert_eq!(
            Split::of(5, 10, 7, 8, true),
            split(0, 2, 2),
            "7 used, 8..12: 9, 10 near"
        );
        assert_eq!(Split::of(3, 10, 10, 8, true), split(0, 0, 3));
        assert_eq!(
            Split::of(2, 10, 3, 8, true),
            split(0, 0, 2),
            "over another limit"
        );
    }

    /// A descriptor's split is taken against its tightest limit judged as
    /// if enforced (as `record` judges a shadow-mode rule), from where a
    /// charge recorded over it started.
    #[test]
    fn a_charge_splits_against_the_limit_it_took_over() {
        let counters = RuleCounters::new(10, Values::Raw, NearLimitRatio::default(), false);
        // 10 a minute at 8 and 100 an hour at 94, then a charge of 6: the
        // minute is taken over from 8 (2 near, 4 over); the hour is at its
        // limit, not over, and resets later.
        let rates = [Rate::fixed(10, Unit::Minute), Rate::fixed(100, Unit::Hour)];
        let outcomes = [
            Outcome {
                over: true,
                remaining: 0,
                reset_ms: 30_000,
                remaining_before: Some(2),
            },
            Outcome {
                over: false,
                remaining: 0,
                reset_ms: 1_800_000,
                remaining_before: None,
            },
        ];
        let split = Split {
            within: 0,
            near: 2,
            over: 4,
        };
        let judged = respond::tightest_limit(&rates, &outcomes, true).unwrap();
        assert_eq!(counters.split(6, &judged, &outcomes), split);
    }

    /// f32 rounds 16,777,219 up: with a ratio of 1 the threshold would
    /// be past the limit, and a request taking the limit over would
    /// subtract past zero (a panic in debug builds, about 2⁶⁴ near-limit
    /// hits in release).
    #[test]
    fn the_near_limit_threshold_never_passes_the_limit() {
        let limit = 16_777_219;
        assert_eq!(limit as f32, 16_777_220.0, "the rounding this is about");
        assert_eq!(NearLimitRatio(1.0).threshold(limit), limit);
        assert_eq!(NearLimitRatio(0.8).threshold(10), 8, "theirs elsewhere");
        assert_eq!(NearLimitRatio(0.0).threshold(limit), 0);
        let counters = RuleCounters::new(10, Values::Raw, NearLimitRatio(1.0), false);
        let outcomes = [Outcome {
            over: true,
            remaining: 0,
            reset_ms: 1_000,
            remaining_before: Some(limit),
        }];
        let rates = [Rate::fixed(limit as u32, Unit::Second)];
        let judged = respond::tightest_limit(&rates, &outcomes, true).unwrap();
        let split = Split {
            within: 0,
            near: 0,
            over: 1,
        };
        assert_eq!(counters.split(limit + 1, &judged, &outcomes), split);
    }

    fn entry(key: &str, value: &str) -> Entry {
        Entry {
            key: key.into(),
            value: value.into(),
        }
    }

    /// A request entry is one level of a stat path, with no control
    /// character.
    #[test]
    fn a_request_entry_is_one_level() {
        let counters = RuleCounters::new(10, Values::Raw, NearLimitRatio::default(), false);
        let level = |key, value, always| counters.level(&entry(key, value), always);
        assert_eq!(level("tier", "", false), "tier");
        assert_eq!(
            level("tier", "", true),
            "tier_",
            "detailed_metric's, as theirs"
        );
        assert_eq!(
            level("fw", "c.d\nratelimit.x:1|c", true),
            "fw_c_d_ratelimit_x:1|c",
            "`:` and `|` are left to the stat name's sanitizing"
        );
        assert_eq!(level("ip", "10.0.0.1", true), "ip_10_0_0_1");
        let hashed = RuleCounters::new(10, Values::Sha256, NearLimitRatio::default(), false);
        assert_eq!(
            hashed.level(&entry("user", "alice"), true),
            format!("user_{}", Values::Sha256.encode("alice"))
        );
    }

    /// An override's path is theirs (every entry's `key_value`, `key` for
    /// an empty value), its keys one level each too: they are the caller's.
    #[test]
    fn an_overrides_path_is_its_entries() {
        let counters = RuleCounters::new(10, Values::Raw, NearLimitRatio::default(), false);
        let path = |entries| {
            let descriptor = RateLimitDescriptor {
                entries,
                ..Default::default()
            };
            counters.dynamic_label(None, &descriptor)
        };
        let plain = vec![entry("tenant", "t1"), entry("tier", "")];
        assert_eq!(path(plain).as_deref(), Some("tenant_t1.tier"));
        let dotted = vec![entry("a.b", "c"), entry("ip", "10.0.0.1")];
        assert_eq!(path(dotted).as_deref(), Some("a_b_c.ip_10_0_0_1"));
        // A key or value too long for a name goes in as its digest.
        let long = "k".repeat(crate::keys::MAX_RAW_VALUE_BYTES + 1);
        let label = path(vec![entry(&long, &long)]).unwrap();
        assert_eq!(label.len(), 2 * "h_".len() + 2 * 32 + 1, "{label}");
    }

    /// Unknown domains are one segment each (`a.b` and `a_b` are one
    /// name), and past the cap share `overflow`.
    #[test]
    fn unknown_domains_are_one_segment_and_capped() {
        let counters = RuleCounters::new(2, Values::Raw, NearLimitRatio::default(), false);
        for domain in ["a.b", "a_b", "c\nd", "e", "f", "a.b"] {
            counters.domain_not_found(domain, 1);
        }
        let seen = counters.unknown_domains.seen.lock().unwrap();
        let mut keys: Vec<&str> = seen.keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(keys, ["a_b", "c_d", OVERFLOW_LABEL]);
    }

    #[test]
    fn detailed_labels_past_the_cap_overflow() {
        let series = DetailedSeries::new(2);
        let label = |l: &str| series.metrics("d", l.into()).total_hits.rule().to_owned();
        assert_eq!(label("a"), "a");
        assert_eq!(label("b"), "b");
        assert_eq!(label("c"), OVERFLOW_LABEL);
        assert_eq!(label("a"), "a", "a value already seen keeps its label");
    }
}
