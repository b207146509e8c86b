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

/// Share of a limit above which admitted hits count as `near_limit`.
const NEAR_LIMIT_RATIO: f64 = 0.8;

/// The label detailed counters past the cap share.
pub const OVERFLOW_LABEL: &str = "overflow";

/// Counts each decided request's hits against its rules.
#[derive(Debug)]
pub struct RuleCounters {
    detailed: DetailedSeries,
    /// How descriptor values appear in labels.
    values: Values,
}

impl RuleCounters {
    pub fn new(max_detailed_series: usize, values: Values) -> Self {
        RuleCounters {
            detailed: DetailedSeries::new(max_detailed_series),
            values,
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
        let near = used as f64 > (state.limit as f64 * NEAR_LIMIT_RATIO).floor();
        let count = |m: &RuleMetrics| {
            m.total_hits.increment(hits);
            if any_over {
                m.over_limit.increment(hits);
                if rule.shadow_mode {
                    m.shadow_mode.increment(hits);
                }
            } else if near {
                m.near_limit.increment(hits);
            } else {
                m.within_limit.increment(hits);
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
