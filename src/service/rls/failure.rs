//! Step 3 of a decision, only when the store failed (error, deadline, or
//! open circuit): the domain's failure mode answers. `open` allows and
//! `closed` refuses every limited descriptor, `unavailable` answers gRPC
//! UNAVAILABLE, and `local` decides from this replica's own counters, each
//! limit divided by the replicas expected to share it. Answers given without
//! the store are marked in `dynamic_metadata` ([`degraded`]).
//!
//! With a per-second store, one of the two may fail alone: then only the
//! failed store's checks get the failure mode's outcome (`open`: within the
//! limit, `closed`: over it, `local`: this replica's counters), and the
//! answer is made from those and the other store's, as from the store's.

use std::sync::Arc;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use tonic::Status;

use super::outcomes::Failed;
use super::plan::{Applied, Plan};
use super::respond::{allow_all, current_limit, status};
use crate::limiter::{Check, Outcome};
use crate::log_pace::Paced;
use crate::store::{MemoryStore, Store};
use crate::vocab::FailureMode;

/// Most counters `failure_mode: local` keeps unless told
/// (`LOCAL_FALLBACK_MAX_KEYS`): about 145 MB of fixed windows
/// (BENCHMARKS.md's resident size per in-memory counter; a sliding log
/// holds its entries on top), a bound a pod's memory limit can plan for;
/// an outage meeting tens of thousands of new keys a second fills it in
/// under a minute, and the keys it met first keep their counters.
pub const DEFAULT_LOCAL_FALLBACK_KEYS: usize = 1_000_000;

/// What the failure mode makes of a request.
#[derive(Debug)]
pub enum Fallback {
    /// The whole answer (`open`, `closed`).
    Answer(RateLimitResponse),
    /// The gRPC error to answer with (`unavailable`).
    Refuse(Status),
    /// Outcomes to answer from as from the store's: this replica's
    /// counters (`local`), or for a request only one of two stores failed,
    /// the other's outcomes with the failure mode's for the rest.
    Outcomes(Vec<Outcome>),
}

/// This replica's counters for `failure_mode: local`, on the store's
/// clock, at most `max_keys` of them ([`MemoryStore::with_max_keys`]).
#[derive(Debug)]
pub struct LocalFallback {
    store: Arc<MemoryStore>,
    /// Replicas expected to share each limit (at least 1).
    replicas: u64,
    max_keys: usize,
    /// `ratekeeper_local_fallback_untracked`, registered once: a lookup by
    /// name on every request would cost a registry lookup each.
    untracked: metrics::Counter,
}

impl LocalFallback {
    pub fn new(store: &Store, expected_replicas: u32, max_keys: usize) -> Self {
        LocalFallback {
            store: MemoryStore::with_max_keys(store.clock(), max_keys),
            replicas: u64::from(expected_replicas.max(1)),
            max_keys,
            untracked: metrics::counter!("ratekeeper_local_fallback_untracked"),
        }
    }

    /// This replica's counters' outcomes for `shares`; a key the store
    /// had no room for is counted and logged (paced).
    fn apply(&self, shares: &[Check], all_or_nothing: bool) -> Vec<Outcome> {
        static FULL: Paced = Paced::new();
        let before = self.store.untracked();
        let outcomes = self.store.apply(shares, all_or_nothing);
        let untracked = self.store.untracked();
        if untracked > before {
            // Absolute, not an increment of the difference: concurrent
            // requests would each add the others' too.
            self.untracked.absolute(untracked);
            if let Some(skipped) = FULL.admit() {
                tracing::warn!(
                    max_keys = self.max_keys,
                    untracked,
                    skipped,
                    "failure_mode local holds LOCAL_FALLBACK_MAX_KEYS counters: new keys are \
                     decided as new every time (admitted up to their limit) until counters expire"
                );
            }
        }
        outcomes
    }

    /// Applies `mode` to a request whose store call `failed`.
    pub fn fall_back(
        &self,
        mode: FailureMode,
        failed: Failed,
        plan: &Plan<'_>,
        all_or_nothing: bool,
    ) -> Fallback {
        let store = failed.store.name();
        metrics::counter!("ratekeeper_store_errors", "store" => store).increment(1);
        metrics::counter!(format!("ratekeeper_store_error_fail_{mode}"), "store" => store)
            .increment(1);
        let partly = failed.answered.iter().any(Option::is_some);
        match mode {
            FailureMode::Unavailable => Fallback::Refuse(Status::unavailable(format!(
                "the rate limit store failed: {}",
                failed.error
            ))),
            _ if partly => {
                Fallback::Outcomes(self.stand_in(mode, failed.answered, plan, all_or_nothing))
            }
            FailureMode::Open => {
                Fallback::Answer(degraded(allow_all(&plan.applied, plan.applied.len()), mode))
            }
            FailureMode::Closed => Fallback::Answer(degraded(refuse_all(&plan.applied), mode)),
            FailureMode::Local => {
                let shares: Vec<Check> = plan.checks.iter().map(|c| self.share(c)).collect();
                Fallback::Outcomes(self.apply(&shares, all_or_nothing))
            }
        }
    }

    /// The `answered` outcomes, with `mode`'s standing in for the checks
    /// whose store failed (`None`).
    fn stand_in(
        &self,
        mode: FailureMode,
        answered: Vec<Option<Outcome>>,
        plan: &Plan<'_>,
        all_or_nothing: bool,
    ) -> Vec<Outcome> {
        let failed: Vec<usize> = (0..answered.len())
            .filter(|&i| answered[i].is_none())
            .collect();
        let open = |check: &Check| Outcome {
            over: false,
            remaining: check.limit,
            reset_ms: 0,
            remaining_before: None,
        };
        let mut local = match mode {
            FailureMode::Local => {
                let shares: Vec<Check> = failed
                    .iter()
                    .map(|&i| self.share(&plan.checks[i]))
                    .collect();
                self.apply(&shares, all_or_nothing)
            }
            _ => Vec::new(),
        }
        .into_iter();
        answered
            .into_iter()
            .zip(&plan.checks)
            .map(|(outcome, check)| {
                outcome.unwrap_or_else(|| match mode {
                    FailureMode::Closed => Outcome {
                        over: true,
                        remaining: 0,
                        reset_ms: check.period_ms,
                        remaining_before: None,
                    },
                    // The local store answers every share it is given.
                    FailureMode::Local => local.next().unwrap_or_else(|| open(check)),
                    _ => open(check),
                })
            })
            .collect()
    }

    /// `check` with this replica's share of its limit and burst.
    fn share(&self, check: &Check) -> Check {
        Check {
            limit: check.limit.div_ceil(self.replicas),
            burst: check.burst.div_ceil(self.replicas),
            ..check.clone()
        }
    }
}

/// Refuses every limited descriptor (`failure_mode: closed`).
fn refuse_all(applied: &[Applied<'_>]) -> RateLimitResponse {
    let statuses: Vec<DescriptorStatus> = applied
        .iter()
        .map(|a| match a {
            Applied::Counted { rates, .. } => {
                status(Code::OverLimit, rates.first().map(current_limit), 0, None)
            }
            Applied::Unlimited(_) => status(Code::Ok, None, u32::MAX, None),
            Applied::None => status(Code::Ok, None, 0, None),
        })
        .collect();
    let over = statuses.iter().any(|s| s.code == Code::OverLimit as i32);
    RateLimitResponse {
        overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
        statuses,
        ..Default::default()
    }
}

/// Marks an answer given without the store: `dynamic_metadata` carries
/// `ratekeeper.store_error` = the failure mode, for Envoy's logs.
pub fn degraded(mut response: RateLimitResponse, mode: FailureMode) -> RateLimitResponse {
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
    let mut metadata = Struct::default();
    metadata.fields.insert(
        "ratekeeper.store_error".into(),
        Value {
            kind: Some(Kind::StringValue(mode.name().into())),
        },
    );
    response.dynamic_metadata = Some(metadata);
    response
}

#[cfg(test)]
mod tests {
    use super::super::plan::tests::{config, descriptor, request};
    use super::super::LimiterSettings;
    use super::*;
    use crate::clock::ManualClock;
    use crate::store::Role;
    use crate::Error;

    /// Every one of `checks` checks' store failed.
    fn failed(checks: usize) -> Failed {
        Failed {
            error: Error::Store("down".into()),
            store: Role::Main,
            answered: vec![None; checks],
        }
    }

    fn marked(response: &RateLimitResponse) -> Option<String> {
        use envoy_types::pb::google::protobuf::value::Kind;
        let value = response
            .dynamic_metadata
            .as_ref()?
            .fields
            .get("ratekeeper.store_error")?;
        match &value.kind {
            Some(Kind::StringValue(mode)) => Some(mode.clone()),
            _ => None,
        }
    }

    #[test]
    fn each_mode_answers_as_documented() {
        let config = config();
        let rules = &config.domain("d").expect("domain").rules;
        let request = request(vec![
            descriptor(&[("user", "a")]),
            descriptor(&[("free", "x")]),
        ]);
        let plan = Plan::new(&request, rules, &LimiterSettings::default()).expect("plan");
        let clock = Arc::new(ManualClock::new(60_000));
        let local = LocalFallback::new(
            &Store::Memory(MemoryStore::new(clock)),
            3,
            DEFAULT_LOCAL_FALLBACK_KEYS,
        );
        let answer = |mode| match local.fall_back(mode, failed(plan.checks.len()), &plan, true) {
            Fallback::Answer(response) => response,
            other => panic!("{mode}: {other:?}"),
        };

        let open = answer(FailureMode::Open);
        assert_eq!(open.overall_code, Code::Ok as i32);
        assert_eq!(
            open.statuses[0]
                .current_limit
                .as_ref()
                .map(|l| l.requests_per_unit),
            Some(3)
        );
        assert_eq!(marked(&open).as_deref(), Some("open"));

        let closed = answer(FailureMode::Closed);
        assert_eq!(closed.overall_code, Code::OverLimit as i32);
        assert_eq!(
            closed.statuses[1].code,
            Code::Ok as i32,
            "unlimited stays OK"
        );
        assert_eq!(marked(&closed).as_deref(), Some("closed"));

        match local.fall_back(
            FailureMode::Unavailable,
            failed(plan.checks.len()),
            &plan,
            true,
        ) {
            Fallback::Refuse(status) => {
                assert_eq!(status.code(), tonic::Code::Unavailable);
                assert!(status.message().contains("down"), "{}", status.message());
            }
            other => panic!("{other:?}"),
        }

        // 3 per minute over 3 replicas: 1 each.
        let mut admitted = Vec::new();
        for _ in 0..2 {
            match local.fall_back(FailureMode::Local, failed(plan.checks.len()), &plan, true) {
                Fallback::Outcomes(outcomes) => admitted.push(!outcomes[0].over),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(admitted, [true, false]);
    }

    /// Only the per-second store failed: its check (org's per-second limit)
    /// gets the mode's outcome, the others keep the store's.
    #[test]
    fn a_failed_stores_checks_alone_get_the_mode() {
        let config = config();
        let rules = &config.domain("d").expect("domain").rules;
        let request = request(vec![
            descriptor(&[("user", "a")]),
            descriptor(&[("org", "acme")]),
        ]);
        let plan = Plan::new(&request, rules, &LimiterSettings::default()).expect("plan");
        assert_eq!(plan.checks[1].period_ms, 1_000, "org's first limit");
        let stored = |remaining| Outcome {
            over: false,
            remaining,
            reset_ms: 7,
            remaining_before: None,
        };
        let answered = vec![Some(stored(2)), None, Some(stored(99))];
        let clock = Arc::new(ManualClock::new(60_000));
        let local = LocalFallback::new(
            &Store::Memory(MemoryStore::new(clock)),
            3,
            DEFAULT_LOCAL_FALLBACK_KEYS,
        );
        let with = |mode| {
            let failed = Failed {
                error: Error::Store("down".into()),
                store: Role::PerSecond,
                answered: answered.clone(),
            };
            match local.fall_back(mode, failed, &plan, true) {
                Fallback::Outcomes(outcomes) => outcomes,
                other => panic!("{mode}: {other:?}"),
            }
        };
        let each = |outcomes: Vec<Outcome>| -> Vec<(bool, u64)> {
            outcomes.iter().map(|o| (o.over, o.remaining)).collect()
        };
        assert_eq!(
            each(with(FailureMode::Open)),
            [(false, 2), (false, 10), (false, 99)]
        );
        assert_eq!(
            each(with(FailureMode::Closed)),
            [(false, 2), (true, 0), (false, 99)]
        );
        // 10 a second over 3 replicas: 4 here, one taken by this request.
        assert_eq!(
            each(with(FailureMode::Local)),
            [(false, 2), (false, 3), (false, 99)]
        );
        match local.fall_back(
            FailureMode::Unavailable,
            Failed {
                error: Error::Store("down".into()),
                store: Role::PerSecond,
                answered,
            },
            &plan,
            true,
        ) {
            Fallback::Refuse(status) => assert_eq!(status.code(), tonic::Code::Unavailable),
            other => panic!("{other:?}"),
        }
    }
}
