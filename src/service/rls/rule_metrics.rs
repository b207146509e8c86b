//! Per-rule hit counters, as envoyproxy/ratelimit keeps them (total, over,
//! near and within the limit, shadow mode), and with `detailed_metric` per
//! descriptor value too, under a cap on distinct values.

use std::collections::HashSet;
use std::sync::Mutex;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

use super::plan::{Applied, Plan};
use super::respond::Verdict;
use crate::headers::LimitState;
use crate::keys::Values;
use crate::limiter::Outcome;
use crate::rules::{Rule, RuleMetrics};

/// `NEAR_LIMIT_RATIO`: the share of a limit past which hits count as
/// `near_limit` too (envoyproxy/ratelimit's default, 0.8).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NearLimitRatio(pub f32);

impl Default for NearLimitRatio {
    fn default() -> Self {
        NearLimitRatio(0.8)
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
    /// admitted) or before them (when refused: a refusal consumes nothing).
    /// `near_at` is `floor(limit × ratio)`.
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

/// The label detailed counters past the cap share.
pub const OVERFLOW_LABEL: &str = "overflow";

/// Counts each decided request's hits against its rules.
#[derive(Debug)]
pub struct RuleCounters {
    detailed: DetailedSeries,
    /// How descriptor values appear in labels.
    values: Values,
    near_limit_ratio: NearLimitRatio,
}

impl RuleCounters {
    pub fn new(max_detailed_series: usize, values: Values, ratio: NearLimitRatio) -> Self {
        RuleCounters {
            detailed: DetailedSeries::new(max_detailed_series),
            values,
            near_limit_ratio: ratio,
        }
    }

    /// Counts the hits of every descriptor a configured rule counted.
    pub fn record(
        &self,
        request: &RateLimitRequest,
        plan: &Plan<'_>,
        outcomes: &[Outcome],
        verdicts: &[Option<Verdict>],
    ) {
        let decided = plan.applied.iter().zip(verdicts).zip(&request.descriptors);
        for ((applied, verdict), descriptor) in decided {
            let (
                Applied::Counted {
                    rule: Some(rule),
                    checks,
                    ..
                },
                Some(verdict),
            ) = (applied, verdict)
            else {
                continue;
            };
            // Shadow-mode limits count as over here, though they refuse nothing.
            let any_over = outcomes[checks.clone()].iter().any(|o| o.over);
            let hits = plan.checks[checks.start].hits;
            self.count(
                &request.domain,
                rule,
                descriptor,
                &verdict.state,
                any_over,
                hits,
            );
        }
    }

    /// One descriptor's hits; `state` is its tightest limit.
    fn count(
        &self,
        domain: &str,
        rule: &Rule,
        descriptor: &RateLimitDescriptor,
        state: &LimitState,
        any_over: bool,
        hits: u64,
    ) {
        let used = state.limit.saturating_sub(state.remaining);
        // In f32, as theirs: the same threshold for the same ratio.
        let near_at = (state.limit as f32 * self.near_limit_ratio.0).floor() as u64;
        let split = Split::of(hits, state.limit, used, near_at, any_over);
        let count = |m: &RuleMetrics| {
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
            if rule.shadow_mode && split.over > 0 {
                m.shadow_mode.increment(split.over);
            }
        };
        count(&rule.metrics);
        if rule.detailed_metric {
            let detailed: Vec<String> = descriptor
                .entries
                .iter()
                .map(|e| format!("{}_{}", e.key, self.values.encode(&e.value)))
                .collect();
            count(&RuleMetrics::register(
                domain,
                &self.detailed.label(detailed.join(".")),
            ));
        }
    }
}

/// The `detailed_metric` label values seen so far, capped: a flood of random
/// user ids must not grow `/metrics` (and memory) without bound. Past the cap,
/// new values are counted under the label `overflow`.
#[derive(Debug, Default)]
pub struct DetailedSeries {
    cap: usize,
    seen: Mutex<HashSet<String>>,
}

impl DetailedSeries {
    pub fn new(cap: usize) -> Self {
        DetailedSeries {
            cap,
            seen: Mutex::new(HashSet::new()),
        }
    }

    fn label(&self, value: String) -> String {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.contains(&value) || seen.len() < self.cap && seen.insert(value.clone()) {
            value
        } else {
            OVERFLOW_LABEL.to_owned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn detailed_labels_past_the_cap_overflow() {
        let series = DetailedSeries::new(2);
        assert_eq!(series.label("a".into()), "a");
        assert_eq!(series.label("b".into()), "b");
        assert_eq!(series.label("c".into()), OVERFLOW_LABEL);
        assert_eq!(
            series.label("a".into()),
            "a",
            "a value already seen keeps its label"
        );
    }
}
