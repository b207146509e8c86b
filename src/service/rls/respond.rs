//! Step 4 of a decision: the answer. Each counted descriptor is answered by
//! its tightest limit (its code, `current_limit`, remaining and reset); the
//! request is OVER_LIMIT if any descriptor is, except that quota descriptors
//! fail it only all together, and `SHADOW_MODE` never fails it (as
//! envoyproxy/ratelimit's `shouldRateLimitWorker`); the `RateLimit-*`
//! headers describe the tightest limit of the whole request.

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;

use super::plan::{Applied, Plan};
use super::GlobalModes;
use crate::headers::{self, HeaderNames, LimitState};
use crate::limiter::Outcome;
use crate::rules::Rate;
use crate::service::wire::envoy_duration;

/// A counted descriptor's tightest limit: its state, and which of the
/// descriptor's rates it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub state: LimitState,
    pub at: usize,
}

/// Each descriptor's verdict (`None` when nothing counted it).
pub fn verdicts(plan: &Plan<'_>, outcomes: &[Outcome]) -> Vec<Option<Verdict>> {
    let verdict = |applied: &Applied<'_>| {
        let Applied::Counted {
            rule,
            rates,
            checks,
            ..
        } = applied
        else {
            return None;
        };
        // A shadow-mode rule is never over; a quota one is (the request
        // decides in `response`).
        let shadow = rule.is_some_and(|r| r.shadow_mode);
        tightest_limit(rates, &outcomes[checks.clone()], !shadow)
    };
    plan.applied.iter().map(verdict).collect()
}

/// The tightest of a descriptor's limits, `rates` decided as `outcomes`;
/// an outcome's `over` counts only when `over_counts`.
pub fn tightest_limit(rates: &[Rate], outcomes: &[Outcome], over_counts: bool) -> Option<Verdict> {
    let states = rates
        .iter()
        .zip(outcomes)
        .map(|(rate, outcome)| LimitState {
            limit: rate.capacity(),
            remaining: outcome.remaining,
            reset_ms: outcome.reset_ms,
            over: outcome.over && over_counts,
        });
    tightest(states).map(|(at, state)| Verdict { state, at })
}

/// The response: statuses, overall code, and the headers when `headers`.
pub fn response(
    plan: &Plan<'_>,
    verdicts: &[Option<Verdict>],
    headers: Option<&HeaderNames>,
    modes: GlobalModes,
) -> RateLimitResponse {
    let statuses: Vec<DescriptorStatus> = plan
        .applied
        .iter()
        .zip(verdicts)
        .map(|(applied, verdict)| match (applied, verdict) {
            (Applied::Unlimited(_), _) => status(Code::Ok, None, u32::MAX, None),
            (Applied::Counted { rates, .. }, Some(Verdict { state, at })) => status(
                if state.over {
                    Code::OverLimit
                } else {
                    Code::Ok
                },
                Some(current_limit(&rates[*at])),
                u32::try_from(state.remaining).unwrap_or(u32::MAX),
                Some(state.reset_ms),
            ),
            _ => status(Code::Ok, None, 0, None),
        })
        .collect();
    let mut over = is_over(plan, &statuses, modes.quota);
    if over && modes.shadow {
        metrics::counter!("ratekeeper_global_shadow_mode").increment(1);
        crate::their_stats::global_shadow_mode();
        over = false;
    }
    let tightest = tightest(verdicts.iter().flatten().map(|v| v.state));
    let response_headers_to_add = match (headers, tightest) {
        (Some(names), Some((_, state))) => headers::response_headers(names, &state, over),
        _ => Vec::new(),
    };
    RateLimitResponse {
        overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
        statuses,
        response_headers_to_add,
        ..Default::default()
    }
}

/// envoyproxy/ratelimit's overall code: OVER_LIMIT when a descriptor that
/// is not a quota descriptor is over, or every quota descriptor is. With
/// `QUOTA_MODE` every descriptor but an unlimited one is a quota descriptor,
/// one matching no rule included (never over).
fn is_over(plan: &Plan<'_>, statuses: &[DescriptorStatus], global_quota: bool) -> bool {
    let (mut quota, mut quota_over) = (0, 0);
    for (applied, status) in plan.applied.iter().zip(statuses) {
        let is_quota = match applied {
            Applied::Counted { quota, .. } => *quota,
            Applied::None => global_quota,
            Applied::Unlimited(_) => continue,
        };
        let over = status.code == Code::OverLimit as i32;
        match (is_quota, over) {
            (false, true) => return true,
            (true, _) => {
                quota += 1;
                quota_over += usize::from(over);
            }
            (false, false) => {}
        }
    }
    quota > 0 && quota == quota_over
}

/// Over beats not over; among over, the longest wait; otherwise the
/// fewest remaining, then the longest reset.
fn is_tighter(a: &LimitState, b: &LimitState) -> bool {
    match (a.over, b.over) {
        (true, false) => true,
        (false, true) => false,
        (true, true) => a.reset_ms > b.reset_ms,
        (false, false) => {
            a.remaining < b.remaining || (a.remaining == b.remaining && a.reset_ms > b.reset_ms)
        }
    }
}

/// The tightest of `states`, with its index (the first among equals).
pub fn tightest(states: impl IntoIterator<Item = LimitState>) -> Option<(usize, LimitState)> {
    states
        .into_iter()
        .enumerate()
        .fold(None, |best, (i, s)| match best {
            Some((_, b)) if !is_tighter(&s, &b) => best,
            _ => Some((i, s)),
        })
}

/// All-OK answer: for an unknown domain (`applied` empty) or when the store
/// failed and the request is let through (its limits still reported).
pub fn allow_all(applied: &[Applied<'_>], descriptors: usize) -> RateLimitResponse {
    let statuses = (0..descriptors)
        .map(|i| match applied.get(i) {
            Some(Applied::Counted { rates, .. }) => {
                status(Code::Ok, rates.first().map(current_limit), 0, None)
            }
            Some(Applied::Unlimited(_)) => status(Code::Ok, None, u32::MAX, None),
            _ => status(Code::Ok, None, 0, None),
        })
        .collect();
    RateLimitResponse {
        overall_code: Code::Ok as i32,
        statuses,
        ..Default::default()
    }
}

pub fn current_limit(rate: &Rate) -> RateLimit {
    RateLimit {
        name: rate.name.clone().unwrap_or_default(),
        requests_per_unit: rate.requests_per_unit,
        unit: rate.unit.to_envoy(),
    }
}

pub fn status(
    code: Code,
    limit: Option<RateLimit>,
    remaining: u32,
    reset_ms: Option<u64>,
) -> DescriptorStatus {
    DescriptorStatus {
        code: code as i32,
        current_limit: limit,
        limit_remaining: remaining,
        // Whole seconds, rounded up, as theirs (`unit - now % unit` in
        // seconds): Envoy writes `X-RateLimit-Reset` from the seconds alone,
        // so 0.5 s left would tell clients 0, too early.
        duration_until_reset: reset_ms.map(|ms| envoy_duration(ms.div_ceil(1_000) * 1_000)),
        quota: None,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::plan::tests::{config, descriptor, request};
    use super::super::LimiterSettings;
    use super::*;
    use crate::clock::ManualClock;
    use crate::store::MemoryStore;

    fn s(remaining: u64, reset_ms: u64, over: bool) -> LimitState {
        LimitState {
            limit: 10,
            remaining,
            reset_ms,
            over,
        }
    }

    #[test]
    fn tightest_prefers_over_then_longest_wait_then_fewest_remaining() {
        assert_eq!(tightest([s(5, 100, false), s(2, 50, false)]).unwrap().0, 1);
        assert_eq!(tightest([s(2, 50, false), s(2, 70, false)]).unwrap().0, 1);
        assert_eq!(tightest([s(0, 10, false), s(9, 5, true)]).unwrap().0, 1);
        assert_eq!(tightest([s(0, 900, true), s(0, 100, true)]).unwrap().0, 0);
        assert!(tightest([]).is_none());
    }

    #[test]
    fn each_descriptor_answers_with_its_tightest_limit() {
        let config = config();
        let rules = &config.domain("d").expect("domain").rules;
        let request = request(vec![
            descriptor(&[("org", "acme")]),
            descriptor(&[("free", "x")]),
            descriptor(&[("shadow", "x")]),
        ]);
        let plan = Plan::new(&request, rules, &LimiterSettings::default()).expect("plan");
        let store = MemoryStore::new(Arc::new(ManualClock::new(60_000)));
        store.apply(&plan.checks, true);
        let outcomes = store.apply(&plan.checks, true);
        let verdicts = verdicts(&plan, &outcomes);
        // org: 10 per second (8 left) is tighter than a bucket of 20 (18 left).
        assert_eq!(verdicts[0].map(|v| (v.at, v.state.remaining)), Some((0, 8)));
        assert_eq!(verdicts[1], None);
        assert!(
            verdicts[2].is_some_and(|v| !v.state.over),
            "shadow mode is never over"
        );

        let names = HeaderNames::default();
        let response = response(&plan, &verdicts, Some(&names), GlobalModes::default());
        assert_eq!(response.overall_code, Code::Ok as i32);
        let limit = response.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit);
        assert_eq!(limit, Some(10));
        assert_eq!(response.statuses[1].limit_remaining, u32::MAX);
        // The request's tightest: shadow (1 per minute, 0 left, not enforced).
        let remaining = response
            .response_headers_to_add
            .iter()
            .find(|h| h.key == names.remaining)
            .map(|h| h.value.as_str());
        assert_eq!(remaining, Some("0"));
        assert!(
            super::response(&plan, &verdicts, None, GlobalModes::default())
                .response_headers_to_add
                .is_empty()
        );
    }
}
