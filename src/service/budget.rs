//! `ratekeeper.v1.BudgetService`: cost budgets spent in two steps, for work
//! whose cost is bounded before it starts and known when it ends (an LLM
//! call: at most `max_tokens`, then the usage the response reports).
//!
//! `Reserve` plans the request exactly as `ShouldRateLimit` does (same
//! rules, counters and algorithms; `rls::Plan` with the estimate as hits)
//! and asks the store to take the estimate from every limit or from none;
//! a refusal consumes nothing. The id it answers carries what the
//! reservation took, signed (`reservation_id`, `id_key`). `Settle` takes
//! that id only: checked, it says what to give back or charge, and the
//! store records the settlement, or says an earlier Settle already did.
//!
//! A settle that gives hits back breaks what the over-limit cache relies
//! on (a fixed window's count only grows within its window), so it forgets
//! the keys in this replica's cache, as the admin API's reset does.
//!
//! There is no failure mode here: a budget call that cannot reach the store
//! answers UNAVAILABLE. Granting a reservation nobody recorded would let the
//! work blow the budget, and refusing one silently would look like a spent
//! budget; the caller decides what its work does without a budget.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use metrics::Counter;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use tonic::{Request, Response, Status};

use super::caps;
use super::id_key::{IdKey, MAC_BYTES};
use super::id_parts::returnable;
use super::over_cache::OverCache;
use super::reservation_id::{
    ReservationId, ReservedKey, DEFAULT_TTL, MAX_RESERVATION_ID_BYTES, TTL_RANGE,
};
use super::rls::{tightest, Applied, LimiterSettings, Plan};
use super::wire::{duration, requested_ttl, Entries};

use crate::config::watch::SharedConfig;
use crate::config::Config;
use crate::headers::LimitState;
use crate::limiter::{Algorithm, Charges, Check, Outcome, MAX_HITS};
use crate::pb::v1::budget_service_server::BudgetService;
use crate::pb::v1::{BudgetStatus, ReserveRequest, ReserveResponse, SettleRequest, SettleResponse};
use crate::store::{Reservation, Role, Settled, Stores, Taken};

/// The budget service.
#[derive(Debug, Clone)]
pub struct Budget {
    config: SharedConfig,
    /// Budgets live in the main store; the per-second one (if any) only
    /// says which limits it keeps, and so cannot be budgeted.
    stores: Stores,
    /// The rate limit service's settings: the same keys and values.
    settings: LimiterSettings,
    /// `ShouldRateLimit`'s over-limit cache on this replica.
    over: Arc<OverCache>,
    /// This lane's counters.
    counters: Arc<Counters>,
    /// The key reservation ids are signed with, shared by the lanes.
    id_key: Arc<IdKey>,
}

impl Budget {
    pub fn new(
        config: SharedConfig,
        stores: Stores,
        settings: LimiterSettings,
        over: Arc<OverCache>,
    ) -> Self {
        let id_key = Arc::new(IdKey::new(format!("{}budget.key", settings.key_prefix)));
        Budget {
            config,
            stores,
            settings,
            over,
            counters: Arc::default(),
            id_key,
        }
    }

    /// The same service, using serving lane `lane`'s store connections.
    pub fn for_lane(&self, lane: usize) -> Self {
        Budget {
            stores: self.stores.for_lane(lane),
            counters: Arc::default(),
            ..self.clone()
        }
    }

    async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveResponse, Status> {
        validate(request)?;
        let ttl = requested_ttl(request.ttl.as_ref(), TTL_RANGE, "ttl")?.unwrap_or(DEFAULT_TTL);
        let ttl_ms = ttl.as_millis() as u64;
        let config = self.config.current();
        let plan = self.plan(&config, request)?;
        let mut reservation = ReservationId {
            nonce: ReservationId::new_nonce(),
            ttl_ms,
            descriptors: request.descriptors.len(),
            keys: slots(&plan),
        };
        if reservation.keys.is_empty() {
            // Nothing limits these descriptors: nothing to take or settle.
            self.counters.reserve(&request.domain, Reserve::Unlimited);
            return Ok(ReserveResponse {
                granted: true,
                statuses: vec![BudgetStatus::default(); request.descriptors.len()],
                ttl: Some(duration(ttl_ms)),
                ..Default::default()
            });
        }
        // The longest the id can be (every time and mark at its widest),
        // refused before anything is taken.
        returnable(
            ReservationId::signed(&reservation.payload(), &[0; MAC_BYTES]),
            MAX_RESERVATION_ID_BYTES,
            "reservation id",
            "counter keys",
        )?;
        let store = self.stores.main();
        self.id_key.ready(store).await.map_err(store_failed)?;
        let reserved = store
            .reserve(&plan.checks, &reservation.nonce, ttl_ms)
            .await
            .map_err(store_failed)?;
        let granted = reserved.granted;
        let mut id = String::new();
        if granted {
            for (key, &taken) in reservation.keys.iter_mut().zip(&reserved.taken) {
                key.taken = taken;
            }
            let payload = reservation.payload();
            let mac = self
                .id_key
                .sign(payload.as_bytes())
                .ok_or_else(|| Status::internal("no key to sign the reservation id with"))?;
            id = ReservationId::signed(&payload, &mac);
        }
        let result = if granted {
            Reserve::Granted
        } else {
            Reserve::Refused
        };
        self.counters.reserve(&request.domain, result);
        tracing::debug!(domain = %request.domain, estimate = request.estimate, granted, "reserve");
        let outcomes = enforced(&plan, &reserved.outcomes);
        Ok(ReserveResponse {
            granted,
            reservation_id: id,
            statuses: statuses(&reservation, &outcomes),
            retry_after: if granted {
                None
            } else {
                retry_after_ms(&plan.checks, &outcomes).map(duration)
            },
            ttl: Some(duration(ttl_ms)),
            wait: if granted {
                leaky_wait_ms(&plan.checks, &outcomes).map(duration)
            } else {
                None
            },
        })
    }

    /// The checks of `request`, planned on its domain's rules as
    /// `ShouldRateLimit` plans them, with the estimate as hits.
    fn plan<'c>(&self, config: &'c Config, request: &ReserveRequest) -> Result<Plan<'c>, Status> {
        let domain = config.domain(&request.domain).ok_or_else(|| {
            Status::invalid_argument(format!(
                "unknown domain {:?}: no loaded limits file defines it",
                request.domain
            ))
        })?;
        let mut plan = Plan::new(
            &as_rate_limit_request(request),
            &domain.rules,
            &self.settings,
        )?;
        // Admission: a refused reservation takes nothing, whatever the
        // limit does with charges after the fact.
        for check in &mut plan.checks {
            check.charges = Charges::Drop;
        }
        // A quota descriptor over its limit takes nothing, and
        // `ShouldRateLimit` refuses only when every quota descriptor is
        // over; a reservation let through on that rule would commit past
        // the quota. So a quota limit refuses a reservation as a plain one
        // does (shadow mode still never refuses).
        for applied in &plan.applied {
            if let Applied::Counted {
                rule,
                checks,
                quota: true,
                ..
            } = applied
            {
                let enforce = !self.settings.shadows(*rule);
                for check in &mut plan.checks[checks.clone()] {
                    check.enforce = enforce;
                }
            }
        }
        if plan
            .checks
            .iter()
            .any(|check| self.stores.role_of(check) == Role::PerSecond)
        {
            // Their counters live in the per-second Redis, and a
            // reservation is taken and settled in one atomic call per hash
            // slot of one store.
            return Err(Status::failed_precondition(
                "a per-second limit matches these descriptors, and with REDIS_PERSECOND its \
                 counters live in the per-second Redis, where budgets are not kept: budget \
                 per minute or longer",
            ));
        }
        Ok(plan)
    }

    async fn settle(&self, request: &SettleRequest) -> Result<SettleResponse, Status> {
        let signed = ReservationId::decode(&request.reservation_id, &self.settings.key_prefix)
            .map_err(|e| Status::invalid_argument(format!("reservation_id: {e}")))?;
        if request.actual > MAX_HITS {
            return Err(Status::invalid_argument(format!(
                "actual is {}: at most {MAX_HITS} hits are accepted",
                request.actual
            )));
        }
        let store = self.stores.main();
        let genuine = self
            .id_key
            .verify(store, signed.payload.as_bytes(), &signed.mac)
            .await
            .map_err(store_failed)?;
        let reservation = signed.reservation;
        let (checks, taken) = (reservation.checks(), reservation.taken());
        let settled = if genuine {
            let of = Reservation {
                nonce: &reservation.nonce,
                checks: &checks,
                taken: &taken,
                ttl_ms: reservation.ttl_ms,
            };
            store
                .settle(&of, request.actual)
                .await
                .map_err(store_failed)?
        } else {
            Settled::Unknown
        };
        let keys = reservation.counter_keys();
        let (settled, already, outcomes) = match settled {
            Settled::Settled { outcomes } => (request.actual, false, outcomes),
            Settled::Already { actual, outcomes } => (actual, true, outcomes),
            Settled::Unknown => {
                self.counters.settle(Settle::Unknown);
                return Err(Status::not_found(
                    "reservation not found: it expired (its estimate stays charged), was never \
                     granted, or the id was altered",
                ));
            }
        };
        // Hits given back (by a retry too: it may complete a Cluster settle
        // cut short between hash slots).
        self.over.forget(&keys);
        self.counters.settle(if already {
            Settle::Already
        } else {
            Settle::Settled
        });
        Ok(SettleResponse {
            settled,
            already_settled: already,
            statuses: statuses(&reservation, &outcomes),
        })
    }
}

/// What the service refuses before any store work.
fn validate(request: &ReserveRequest) -> Result<(), Status> {
    caps::validate(&request.domain, &request.descriptors)?;
    if request.estimate == 0 {
        return Err(Status::invalid_argument(
            "estimate must be more than 0: the most the work can cost",
        ));
    }
    if request.estimate > MAX_HITS {
        return Err(Status::invalid_argument(format!(
            "estimate is {}: at most {MAX_HITS} hits are accepted",
            request.estimate
        )));
    }
    Ok(())
}

/// The Reserve as the `ShouldRateLimit` request it is planned as: each
/// descriptor with the estimate as its own hits.
fn as_rate_limit_request(request: &ReserveRequest) -> RateLimitRequest {
    let descriptors = request
        .descriptors
        .iter()
        .map(|descriptor| RateLimitDescriptor {
            entries: descriptor
                .entries()
                .map(|(key, value)| Entry {
                    key: key.to_owned(),
                    value: value.to_owned(),
                })
                .collect(),
            hits_addend: Some(UInt64Value {
                value: request.estimate,
            }),
            ..Default::default()
        })
        .collect();
    RateLimitRequest {
        domain: request.domain.clone(),
        descriptors,
        hits_addend: 0,
    }
}

/// Each check with its descriptor, in the checks' order; what it takes is
/// known once reserved (until then the widest there can be: the id's
/// longest length).
fn slots(plan: &Plan<'_>) -> Vec<ReservedKey> {
    let mut slots = Vec::with_capacity(plan.checks.len());
    for (descriptor, applied) in plan.applied.iter().enumerate() {
        if let Applied::Counted { checks, .. } = applied {
            slots.extend(plan.checks[checks.clone()].iter().map(|check| ReservedKey {
                descriptor,
                check: check.clone(),
                taken: Taken {
                    at_ms: u64::MAX,
                    mark: Some(u64::MAX),
                },
            }));
        }
    }
    slots
}

/// The store's outcomes, over only where the limit is enforced (a limit in
/// shadow mode never refuses).
fn enforced(plan: &Plan<'_>, outcomes: &[Outcome]) -> Vec<Outcome> {
    plan.checks
        .iter()
        .zip(outcomes)
        .map(|(check, outcome)| Outcome {
            over: check.refused_by(outcome),
            ..*outcome
        })
        .collect()
}

/// One status per descriptor of the Reserve: its tightest limit among the
/// reservation's keys (as `ShouldRateLimit` answers), zero when none.
fn statuses(reservation: &ReservationId, outcomes: &[Outcome]) -> Vec<BudgetStatus> {
    (0..reservation.descriptors)
        .map(|descriptor| {
            let states = reservation
                .keys
                .iter()
                .zip(outcomes)
                .filter(|(slot, _)| slot.descriptor == descriptor)
                .map(|(slot, outcome)| LimitState {
                    // What it admits at once, as `RateLimit-Limit` reports
                    // it: a bucket's burst (its remaining can reach that).
                    limit: slot.check.capacity(),
                    remaining: outcome.remaining,
                    reset_ms: outcome.reset_ms,
                    over: outcome.over,
                });
            tightest(states).map_or_else(BudgetStatus::default, |(_, state)| BudgetStatus {
                remaining: state.remaining,
                limit: state.limit,
                over: state.over,
            })
        })
        .collect()
}

/// How long until the estimate would fit: the longest wait of a refusing
/// limit (every one must admit it). None when a refusing limit never
/// admits that much at once (the estimate is over its capacity): waiting
/// would not help, and a caller told to retry would retry forever. What a
/// counter must admit at once is every check's estimate on its key: a
/// descriptor given twice takes the estimate twice from one counter.
fn retry_after_ms(checks: &[Check], outcomes: &[Outcome]) -> Option<u64> {
    let refusing = || checks.iter().zip(outcomes).filter(|(_, o)| o.over);
    let mut on_key: HashMap<&str, u64> = HashMap::new();
    for check in checks {
        let sum = on_key.entry(&check.key).or_default();
        *sum = sum.saturating_add(check.hits);
    }
    if refusing().any(|(check, _)| on_key[check.key.as_str()] > check.capacity()) {
        return None;
    }
    Some(refusing().map(|(_, o)| o.reset_ms).max().unwrap_or(0))
}

/// The wait before a granted reservation's turn: the longest a leaky
/// bucket that took its estimate reports (for an admitted hit, its
/// `reset_ms` is the queue ahead of it, as `ShouldRateLimit` answers it);
/// None when no leaky bucket took it.
fn leaky_wait_ms(checks: &[Check], outcomes: &[Outcome]) -> Option<u64> {
    checks
        .iter()
        .zip(outcomes)
        .filter(|(check, _)| check.algorithm == Algorithm::LeakyBucket && check.enforce)
        .map(|(_, outcome)| outcome.reset_ms)
        .max()
}

fn store_failed(error: crate::Error) -> Status {
    super::wire::store_failed("budget", error)
}

/// What a Reserve answered: `ratekeeper_budget_reserves`'s `result`.
#[derive(Debug, Clone, Copy)]
enum Reserve {
    Granted,
    Refused,
    Unlimited,
}

impl Reserve {
    fn label(self) -> &'static str {
        match self {
            Reserve::Granted => "granted",
            Reserve::Refused => "refused",
            Reserve::Unlimited => "unlimited",
        }
    }
}

/// What a Settle answered: `ratekeeper_budget_settles`'s `result`.
#[derive(Debug, Clone, Copy)]
enum Settle {
    Settled,
    Already,
    Unknown,
}

impl Settle {
    fn label(self) -> &'static str {
        match self {
            Settle::Settled => "settled",
            Settle::Already => "already",
            Settle::Unknown => "unknown",
        }
    }
}

/// Domains whose reserve counters a lane keeps at most; past it the lane
/// starts afresh (a reloaded config can drop domains).
const MAX_COUNTED_DOMAINS: usize = 1024;

/// The budget's counters on one serving lane, registered on first use and
/// kept: asking the registry for a labelled counter on every call (its
/// labels built, hashed and compared) made one in twenty of the
/// allocations of a reserve+settle pair (`perf` on a uprobe of mimalloc's
/// allocation, under `ratekeeper-bench --mode budget`).
#[derive(Default)]
struct Counters {
    reserves: Mutex<HashMap<String, [Option<Counter>; 3]>>,
    settles: [OnceLock<Counter>; 3],
}

impl Counters {
    fn reserve(&self, domain: &str, result: Reserve) {
        let mut domains = self.reserves.lock().unwrap_or_else(PoisonError::into_inner);
        if !domains.contains_key(domain) {
            if domains.len() >= MAX_COUNTED_DOMAINS {
                domains.clear();
            }
            domains.insert(domain.to_owned(), Default::default());
        }
        let Some(counters) = domains.get_mut(domain) else {
            return;
        };
        counters[result as usize]
            .get_or_insert_with(|| {
                metrics::counter!("ratekeeper_budget_reserves", "domain" => domain.to_owned(), "result" => result.label())
            })
            .increment(1);
    }

    fn settle(&self, result: Settle) {
        self.settles[result as usize]
            .get_or_init(
                || metrics::counter!("ratekeeper_budget_settles", "result" => result.label()),
            )
            .increment(1);
    }
}

impl fmt::Debug for Counters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Counters").finish_non_exhaustive()
    }
}

#[tonic::async_trait]
impl BudgetService for Budget {
    async fn reserve(
        &self,
        request: Request<ReserveRequest>,
    ) -> Result<Response<ReserveResponse>, Status> {
        Budget::reserve(self, request.get_ref())
            .await
            .map(Response::new)
    }

    async fn settle(
        &self,
        request: Request<SettleRequest>,
    ) -> Result<Response<SettleResponse>, Status> {
        Budget::settle(self, request.get_ref())
            .await
            .map(Response::new)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::Config;
    use crate::limiter::Algorithm;
    use crate::pb::v1::{Descriptor, Entry as V1Entry};

    const LIMITS: &str = "
domain: llm
descriptors:
  - key: user
    rate_limits:
      - {unit: minute, requests_per_unit: 1000}
      - {unit: day, requests_per_unit: 5000}
  - key: free
    rate_limit: {unlimited: true}
";

    fn descriptor(key: &str, value: &str) -> Descriptor {
        Descriptor {
            entries: vec![V1Entry {
                key: key.into(),
                value: value.into(),
            }],
        }
    }

    fn reserve(descriptors: Vec<Descriptor>, estimate: u64) -> ReserveRequest {
        ReserveRequest {
            domain: "llm".into(),
            descriptors,
            estimate,
            ttl: None,
        }
    }

    fn outcome(remaining: u64, reset_ms: u64, over: bool) -> Outcome {
        Outcome {
            over,
            remaining,
            reset_ms,
            remaining_before: None,
        }
    }

    #[test]
    fn plans_as_should_rate_limit_with_the_estimate_as_hits() {
        let config = Config::from_files([(Path::new("llm.yaml"), LIMITS)]).expect("limits");
        let request = reserve(
            vec![
                descriptor("free", "x"),
                descriptor("user", "a"),
                descriptor("nobody", "x"),
            ],
            300,
        );
        let as_envoy = as_rate_limit_request(&request);
        let rules = &config.domain("llm").expect("domain").rules;
        let plan = Plan::new(&as_envoy, rules, &LimiterSettings::default()).expect("plan");
        assert!(plan.checks.iter().all(|c| c.hits == 300));
        let slots = slots(&plan);
        let per_slot: Vec<(usize, u64)> = slots
            .iter()
            .map(|s| (s.descriptor, s.check.capacity()))
            .collect();
        assert_eq!(per_slot, [(1, 1000), (1, 5000)], "the user's two limits");
        assert_eq!(slots[0].check, plan.checks[0]);

        let reservation = ReservationId {
            nonce: ReservationId::new_nonce(),
            ttl_ms: 60_000,
            descriptors: 3,
            keys: slots,
        };
        let statuses = statuses(
            &reservation,
            &[
                outcome(700, 60_000, false),
                outcome(4_700, 86_400_000, false),
            ],
        );
        let answer: Vec<(u64, u64, bool)> = statuses
            .iter()
            .map(|s| (s.remaining, s.limit, s.over))
            .collect();
        assert_eq!(
            answer,
            [(0, 0, false), (700, 1000, false), (0, 0, false)],
            "the tightest limit; nothing for unlimited or unmatched descriptors"
        );
    }

    #[test]
    fn a_refusal_waits_for_its_slowest_refusing_limit() {
        let checks = [
            Check::for_test("a", Algorithm::FixedWindow, 100, 60_000, 80),
            Check::for_test("b", Algorithm::FixedWindow, 100, 60_000, 80),
            Check::for_test("c", Algorithm::TokenBucket, 100, 60_000, 80),
        ];
        let outcomes = [
            outcome(0, 9_000, true),
            outcome(50, 90_000, false),
            outcome(0, 30_000, true),
        ];
        assert_eq!(retry_after_ms(&checks, &outcomes), Some(30_000));
        assert_eq!(retry_after_ms(&checks[1..2], &outcomes[1..2]), Some(0));
    }

    #[test]
    fn an_estimate_no_refusing_limit_can_hold_gets_no_retry_after() {
        let over = outcome(0, 9_000, true);
        let window = |hits| Check::for_test("w", Algorithm::FixedWindow, 100, 60_000, hits);
        assert_eq!(retry_after_ms(&[window(100)], &[over]), Some(9_000));
        assert_eq!(retry_after_ms(&[window(101)], &[over]), None);
        // A bucket holds its burst, whatever its rate.
        let mut bucket = Check::for_test("b", Algorithm::LeakyBucket, 100, 60_000, 20);
        bucket.burst = 10;
        assert_eq!(retry_after_ms(&[bucket], &[over]), None);
        // Only refusing limits count: one that admitted it has no say.
        let fine = outcome(0, 9_000, false);
        let other = Check::for_test("v", Algorithm::FixedWindow, 100, 60_000, 5);
        assert_eq!(
            retry_after_ms(&[window(101), other], &[fine, over]),
            Some(9_000)
        );
        // A limit of 0 admits nothing.
        let mut closed = window(1);
        closed.limit = 0;
        assert_eq!(retry_after_ms(&[closed], &[over]), None);
        // One counter twice (a descriptor given twice): 60 + 60 never fit
        // in 100, though each would.
        assert_eq!(
            retry_after_ms(&[window(60), window(60)], &[over, over]),
            None
        );
        assert_eq!(
            retry_after_ms(&[window(50), window(50)], &[over, over]),
            Some(9_000)
        );
    }

    #[test]
    fn refuses_bad_estimates_and_descriptors_with_a_reason() {
        let cases = [
            (
                reserve(vec![descriptor("user", "a")], 0),
                "estimate must be more than 0",
            ),
            (
                reserve(vec![descriptor("user", "a")], MAX_HITS + 1),
                "at most 4294967296",
            ),
            (reserve(vec![], 5), "descriptor list must not be empty"),
            (
                reserve(vec![descriptor("", "a")], 5),
                "the key must not be empty",
            ),
        ];
        for (request, reason) in cases {
            let e = validate(&request).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().contains(reason), "{}", e.message());
        }
        assert!(validate(&reserve(vec![descriptor("user", "a")], MAX_HITS)).is_ok());
    }
}
