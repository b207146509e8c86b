//! The Redis store: a request's checks go to Redis as one call of the
//! limiter ([`LimiterScript`]: a function by `FCALL` on Redis 7, else a
//! script by `EVALSHA`; reloaded when Redis lost it), so the decision is
//! atomic across replicas and timed by the Redis server's clock; requests
//! in flight together share a call ([`Batcher`]), and so do budget
//! reserves and settles. On Redis Cluster the checks are
//! grouped by hash slot: one script call per slot, the slots in parallel,
//! each slot all-or-nothing on its own.
//!
//! Every call has a deadline and goes through a circuit breaker ([`Caller`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use redis::Script;

use super::batcher::{log_give_back, Batcher, BudgetOps, Checks};
use super::budget::{Reservation, Reserved, Settled, Taken};
use super::caller::Caller;
use super::connection::{role, Conn, Connections, OutageLines, PoolReader, RedisSettings};
use super::generation::Generation;
use super::lease::{Acquired, LeaseRef, LeaseSlot, LiveLease};
use super::limiter_script::{self, script_now, BudgetOp, LimiterScript, Pass, SlotSettle};
use super::placed::{every_answer, place};
use crate::clock::Clock;
use crate::keys::cluster_slot;
use crate::limiter::{Check, Outcome};
use crate::vocab::Topology;
use crate::{Error, Result};

/// When a lease acquire whose call failed is given back, in case Redis
/// made it late, after its deadline (`release_later`): soon after, and
/// once more for a Redis that stalled longer. (A reserve is given back
/// from its late answer: `batcher::Batched::unclaimed`.)
const LATE_GIVE_BACK: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(10)];

/// Give-backs waiting at once, at most: a Redis slow for long makes one per
/// failed call, each living [`LATE_GIVE_BACK`]'s 11 s. Past this many, a
/// failed call's is not started (what it may have taken lapses with its
/// TTL) and is counted in `ratekeeper_store_give_backs_dropped`.
const MAX_WAITING_GIVE_BACKS: usize = 10_000;
static WAITING_GIVE_BACKS: AtomicUsize = AtomicUsize::new(0);

/// Runs its give-back when dropped, unless [`done`](Self::done): an
/// acquire whose future is dropped before it returns (its caller
/// cancelled, or the call's `grpc-timeout` passed: tonic then drops the
/// handler) may still be made by Redis, and no caller gets its id to
/// release it with. A call that returns gives back on its own paths
/// what a failure or a refusal leaves.
struct UnlessReturned<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> UnlessReturned<F> {
    fn done(mut self) {
        self.0 = None;
    }
}

impl<F: FnOnce()> Drop for UnlessReturned<F> {
    fn drop(&mut self) {
        if let Some(give_back) = self.0.take() {
            give_back();
        }
    }
}

/// On a cluster, how long a multi-slot reservation's first record lives at
/// least once settled, so that a retry of a settle cut short after it
/// finds it: a minute for the retry and ten seconds for the settle's call
/// (bounded by the Redis call timeout, milliseconds in practice). The
/// later slots take a settle twice this past the TTL, which covers what
/// the nodes' clocks may differ by too. A constant, not derived from this
/// replica's call timeout: replicas set otherwise would disagree on how
/// long a later slot takes a settle, and one that allowed longer could
/// settle a later slot again once its record was gone.
const SETTLE_GRACE_MS: u64 = 70_000;

/// Runs `give_back` in the background, unless too many wait already (or
/// there is no runtime to run it on: a call dropped as its runtime stops).
fn spawn_give_back(give_back: impl std::future::Future<Output = ()> + Send + 'static) {
    /// Counts a give-back waiting until it ends (or its task is dropped).
    struct Waiting;
    impl Drop for Waiting {
        fn drop(&mut self) {
            WAITING_GIVE_BACKS.fetch_sub(1, Ordering::Relaxed);
        }
    }
    if WAITING_GIVE_BACKS.fetch_add(1, Ordering::Relaxed) >= MAX_WAITING_GIVE_BACKS {
        WAITING_GIVE_BACKS.fetch_sub(1, Ordering::Relaxed);
        metrics::counter!("ratekeeper_store_give_backs_dropped").increment(1);
        return;
    }
    let waiting = Waiting;
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        metrics::counter!("ratekeeper_store_give_backs_dropped").increment(1);
        return;
    };
    runtime.spawn(async move {
        let _waiting = waiting;
        give_back.await;
    });
}

/// Counters and leases kept in Redis, as seen from one serving lane.
pub struct RedisStore {
    /// One per serving lane (see [`crate::lanes`]), so that a request's
    /// Redis call is batched, sent and answered on its own thread; shared
    /// by the lanes' views ([`RedisStore::for_lane`]).
    lanes: Arc<[Lane]>,
    /// The lane whose connections this view uses: lane 0 unless made by
    /// [`RedisStore::for_lane`].
    lane: usize,
    topology: Topology,
    limiter: Arc<LimiterScript>,
    leases: Script,
    /// The admin API's reset (`lua/reset.lua`).
    reset: Script,
    /// Tests pin time here; production leaves it `None` and the scripts read
    /// the server's `TIME`.
    clock: Option<Arc<dyn Clock>>,
}

/// A serving lane's own connections, and its batchers.
struct Lane {
    caller: Arc<Caller>,
    /// Joins concurrent requests into one call; None on a cluster, where
    /// each call must stay within one hash slot.
    batcher: Option<Arc<Batcher<Checks>>>,
    /// The same for budget operations.
    budget: Option<Arc<Batcher<BudgetOps>>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The settings may carry a password: never print them.
        f.debug_struct("RedisStore")
            .field("topology", &self.topology)
            .finish_non_exhaustive()
    }
}

/// The budget script's answer to a settle in one hash slot:
/// `[status, actual, (over, remaining, reset_ms) per check...]`.
#[derive(Debug, PartialEq, Eq)]
enum SlotSettled {
    Unknown,
    Settled(Vec<Outcome>),
    Already(u64, Vec<Outcome>),
}

impl SlotSettled {
    /// Reads the reply for a slot of `keys` keys; any other shape is an error.
    fn read(reply: &[i64], keys: usize) -> Result<SlotSettled> {
        match reply {
            [0, _] => Ok(SlotSettled::Unknown),
            [1, _, rest @ ..] => Ok(SlotSettled::Settled(limiter_script::outcomes(rest, keys)?)),
            [2, actual, rest @ ..] => Ok(SlotSettled::Already(
                (*actual).max(0) as u64,
                limiter_script::outcomes(rest, keys)?,
            )),
            _ => Err(Error::Store(format!("budget script returned {reply:?}"))),
        }
    }
}

/// The lease script's answer to an acquire in one hash slot:
/// `[granted, expired, retry_after_ms, active per key...]`.
#[derive(Debug, PartialEq, Eq)]
struct SlotAcquired {
    granted: bool,
    expired: u64,
    retry_after_ms: u64,
    active: Vec<u64>,
}

impl SlotAcquired {
    /// Reads the reply for a slot of `keys` keys; any other shape is an error.
    fn read(reply: &[i64], keys: usize) -> Result<SlotAcquired> {
        match reply {
            [granted, expired, retry, active @ ..] if active.len() == keys => Ok(SlotAcquired {
                granted: *granted == 1,
                expired: (*expired).max(0) as u64,
                retry_after_ms: (*retry).max(0) as u64,
                active: active.iter().map(|&n| n.max(0) as u64).collect(),
            }),
            _ => Err(Error::Store(format!("lease script returned {reply:?}"))),
        }
    }
}

/// Reads the lease script's `list` answer: member, expiry, holder, ...
fn read_listed(reply: &[String]) -> Result<Vec<LiveLease>> {
    let bad = || Error::Store(format!("lease script listed {reply:?}"));
    if reply.len() % 3 != 0 {
        return Err(bad());
    }
    reply
        .chunks_exact(3)
        .map(|lease| {
            // A score is a double; an expiry in ms is exact in one.
            let expiry: f64 = lease[1].parse().map_err(|_| bad())?;
            Ok(LiveLease {
                member: lease[0].clone(),
                expires_at_ms: expiry.max(0.0) as u64,
                holder: lease[2].clone(),
            })
        })
        .collect()
}

/// `connections` spread over `lanes` lanes (at least one), each lane at
/// least one: the first `connections % lanes` lanes take one more, so the
/// pool is the size asked for (`ratelimit.redis_pool.cx_active` reads
/// `REDIS_POOL_SIZE`, as theirs) unless it is smaller than the lanes.
fn lane_shares(connections: usize, lanes: usize) -> impl Iterator<Item = usize> {
    let lanes = lanes.max(1);
    (0..lanes)
        .map(move |lane| (connections / lanes + usize::from(lane < connections % lanes)).max(1))
}

impl RedisStore {
    /// Creates the store without waiting for Redis: connections are made on
    /// first use and re-made after failures, so ratekeeper starts (and can
    /// fail open) while Redis is down.
    ///
    /// `settings.connections` are spread over `settings.lanes` lanes, at
    /// least one each; the circuit breaker is shared, as all lanes reach
    /// the same Redis.
    pub fn new(settings: &RedisSettings, clock: Option<Arc<dyn Clock>>) -> Result<Self> {
        let clustered = settings.topology == Topology::Cluster;
        let breaker = (!clustered).then(Caller::breaker);
        let jitter_ms = u64::try_from(settings.expiry_jitter.as_millis()).unwrap_or(u64::MAX);
        let limiter = Arc::new(
            LimiterScript::new(settings.functions)
                .with_expiry_jitter(jitter_ms)
                .on_cluster(clustered),
        );
        let lines = OutageLines::new();
        let lanes = lane_shares(settings.connections, settings.lanes)
            .map(|connections| {
                let caller = Arc::new(Caller::new(
                    Connections::new(
                        RedisSettings {
                            connections,
                            ..settings.clone()
                        },
                        limiter.generation().clone(),
                        Arc::clone(&lines),
                    )?,
                    breaker.clone(),
                    settings.call_timeout,
                ));
                let batcher = (!clustered).then(|| {
                    Arc::new(Batcher::new(
                        Arc::clone(&caller),
                        Checks(Arc::clone(&limiter)),
                        clock.clone(),
                        connections,
                    ))
                });
                let budget = (!clustered).then(|| {
                    Arc::new(Batcher::new(
                        Arc::clone(&caller),
                        BudgetOps(Arc::clone(&limiter)),
                        clock.clone(),
                        connections,
                    ))
                });
                Ok(Lane {
                    caller,
                    batcher,
                    budget,
                })
            })
            .collect::<Result<Arc<[_]>>>()?;
        Ok(RedisStore {
            lanes,
            lane: 0,
            topology: settings.topology,
            limiter,
            leases: Script::new(include_str!("../../lua/leases.lua")),
            reset: Script::new(include_str!("../../lua/reset.lua")),
            clock,
        })
    }

    /// The same store, using serving lane `lane`'s connections and batcher:
    /// for the services that lane runs, made once when it starts.
    pub fn for_lane(&self, lane: usize) -> RedisStore {
        RedisStore {
            lanes: Arc::clone(&self.lanes),
            lane: lane % self.lanes.len(),
            topology: self.topology,
            limiter: Arc::clone(&self.limiter),
            leases: self.leases.clone(),
            reset: self.reset.clone(),
            clock: self.clock.clone(),
        }
    }

    /// Changes whenever Redis may have lost its data (see [`Generation`]).
    pub fn generation(&self) -> Generation {
        self.limiter.generation().clone()
    }

    /// Reads every lane's pool stats (see [`PoolCounts`]).
    ///
    /// [`PoolCounts`]: super::connection::PoolCounts
    pub fn pool(&self) -> PoolReader {
        PoolReader::new(self.lanes.iter().map(|lane| &lane.caller.connections))
    }

    fn lane(&self) -> &Lane {
        &self.lanes[self.lane]
    }

    fn caller(&self) -> &Caller {
        &self.lane().caller
    }

    /// The pinned clock, or the system's.
    pub fn clock(&self) -> Arc<dyn Clock> {
        self.clock
            .clone()
            .unwrap_or_else(|| Arc::new(crate::clock::SystemClock))
    }

    /// The pinned clock, or the system's.
    pub fn now_ms(&self) -> u64 {
        use crate::clock::SystemClock;
        self.clock
            .as_ref()
            .map_or_else(|| SystemClock.now_ms(), |c| c.now_ms())
    }

    /// Time allowed for a `PING` or `SCRIPT LOAD`: not on a request's path,
    /// so the call deadline but at least 500 ms.
    fn probe_timeout(&self) -> Duration {
        self.caller().call_timeout.max(Duration::from_millis(500))
    }

    fn now_arg(&self) -> String {
        script_now(self.clock.as_ref())
    }

    /// Splits item indices by Redis Cluster slot (one group unless clustered).
    fn groups<'k>(&self, keys: impl Iterator<Item = &'k str>) -> Vec<Vec<usize>> {
        if self.topology != Topology::Cluster {
            return vec![keys.enumerate().map(|(i, _)| i).collect()];
        }
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, key) in keys.enumerate() {
            let slot = cluster_slot(key);
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, group)) => group.push(i),
                None => groups.push((slot, vec![i])),
            }
        }
        groups.into_iter().map(|(_, g)| g).collect()
    }

    /// Applies one request's checks: one script call (shared with other
    /// requests in flight), or on a cluster one call per slot.
    pub async fn apply(&self, checks: &[Check], all_or_nothing: bool) -> Result<Vec<Outcome>> {
        if let Some(batcher) = &self.lane().batcher {
            return batcher.apply((checks.to_vec(), all_or_nothing)).await;
        }
        let groups = self.groups(checks.iter().map(|c| c.key.as_str()));
        let pass = if groups.len() > 1 && checks.iter().any(Check::spares_fitted) {
            self.refused_in_any_slot(checks, &groups, all_or_nothing)
                .await?
        } else {
            Pass::Decide
        };
        self.apply_groups(checks, &groups, all_or_nothing, pass)
            .await
    }

    /// Applies `checks` in `pass`, one call per group of a slot.
    async fn apply_groups(
        &self,
        checks: &[Check],
        groups: &[Vec<usize>],
        all_or_nothing: bool,
        pass: Pass,
    ) -> Result<Vec<Outcome>> {
        let answers = join_all(
            groups
                .iter()
                .map(|group| self.apply_slot(checks, group, all_or_nothing, pass)),
        )
        .await;
        let mut outcomes = vec![None; checks.len()];
        for (group, answer) in groups.iter().zip(answers) {
            place(&mut outcomes, group, answer?);
        }
        every_answer(outcomes)
    }

    /// Applies one request's checks in `pass` ([`Pass::DryRun`]: which
    /// would be over, saving nothing; [`Pass::Refused`]: as refused by
    /// checks in another store), a call per slot, unbatched: for a request
    /// whose checks span this store and the per-second one.
    pub async fn apply_in_pass(
        &self,
        checks: &[Check],
        all_or_nothing: bool,
        pass: Pass,
    ) -> Result<Vec<Outcome>> {
        let groups = self.groups(checks.iter().map(|c| c.key.as_str()));
        self.apply_groups(checks, &groups, all_or_nothing, pass)
            .await
    }

    /// Under `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT` a `when_over` check
    /// spares what it fitted when its request is refused, which one slot
    /// cannot see another refuse. So a request whose such checks span
    /// slots is first decided in every slot without saving anything (as
    /// theirs reads every key before it counts): [`Pass::Refused`] when
    /// an enforced check of any slot is over, for the pass that counts.
    async fn refused_in_any_slot(
        &self,
        checks: &[Check],
        groups: &[Vec<usize>],
        all_or_nothing: bool,
    ) -> Result<Pass> {
        let dry = self
            .apply_groups(checks, groups, all_or_nothing, Pass::DryRun)
            .await?;
        let refused = checks.iter().zip(&dry).any(|(c, o)| c.refused_by(o));
        Ok(if refused { Pass::Refused } else { Pass::Decide })
    }

    /// One slot's checks (`group` indexes `checks`) decided in `pass`, in
    /// one call of the limiter.
    async fn apply_slot(
        &self,
        checks: &[Check],
        group: &[usize],
        all_or_nothing: bool,
        pass: Pass,
    ) -> Result<Vec<Outcome>> {
        let slot_checks = group.iter().map(|&i| &checks[i]);
        let cmd = self
            .limiter
            .slot_command(&self.now_arg(), all_or_nothing, pass, slot_checks);
        let reply: Vec<i64> = self.caller().eval(&self.limiter, &cmd).await?;
        limiter_script::outcomes(&reply, group.len())
    }

    /// Reserves `checks`' hits all or nothing (see [`super::budget`]). On a
    /// cluster the slots are reserved one after another; when one refuses
    /// (or fails), those already reserved are settled at 0, the give-back
    /// path, and the slots not reached are only checked, for their outcomes.
    /// The later slots keep a bucket's give-backs twice [`SETTLE_GRACE_MS`]
    /// longer than the first, as they may settle that much later (see
    /// `settle`).
    pub async fn reserve(&self, checks: &[Check], nonce: &str, ttl_ms: u64) -> Result<Reserved> {
        if self.lane().budget.is_some() {
            // The batcher gives back what its caller stopped waiting for.
            return self.reserve_slots(checks, nonce, ttl_ms).await;
        }
        // On a cluster, a task of its own, so that a reservation made
        // after its caller went away is given back: no caller holds its id.
        // (One Redis answers past the deadline in vain: the cluster client
        // bounds each call, with its retries, by the call deadline.)
        let slots = self.groups(checks.iter().map(|c| c.key.as_str())).len();
        let wait = self.caller().call_timeout * u32::try_from(slots).unwrap_or(u32::MAX);
        let (answer, answered) = tokio::sync::oneshot::channel();
        let store = self.for_lane(self.lane);
        let (checks, nonce) = (checks.to_vec(), nonce.to_owned());
        tokio::spawn(async move {
            let reserved = store.reserve_slots(&checks, &nonce, ttl_ms).await;
            if let Err(Ok(reserved)) = answer.send(reserved) {
                store
                    .give_back_unclaimed(&checks, &nonce, ttl_ms, reserved)
                    .await;
            }
        });
        match tokio::time::timeout(wait, answered).await {
            Ok(Ok(reserved)) => reserved,
            Ok(Err(_)) => Err(Error::Store("the reserve's task was lost".into())),
            Err(_) => Err(Error::Store(format!("no answer within {wait:?}"))),
        }
    }

    /// Gives back `reserved`, granted after its caller stopped waiting.
    async fn give_back_unclaimed(
        &self,
        checks: &[Check],
        nonce: &str,
        ttl_ms: u64,
        reserved: Reserved,
    ) {
        if !reserved.granted {
            return;
        }
        let reservation = Reservation {
            nonce,
            checks,
            taken: &reserved.taken,
            ttl_ms,
        };
        let settled = self.settle(&reservation, 0).await;
        log_give_back(settled.map(|s| !matches!(s, Settled::Unknown)));
    }

    /// [`Self::reserve`]'s work, slot by slot.
    async fn reserve_slots(&self, checks: &[Check], nonce: &str, ttl_ms: u64) -> Result<Reserved> {
        let mut outcomes = vec![None; checks.len()];
        let mut taken = vec![None; checks.len()];
        let mut reserved: Vec<Vec<usize>> = Vec::new();
        let mut granted = true;
        let later_ttl_ms = ttl_ms.saturating_add(2 * SETTLE_GRACE_MS);
        for (n, group) in self
            .groups(checks.iter().map(|c| c.key.as_str()))
            .into_iter()
            .enumerate()
        {
            let op = if granted { "reserve" } else { "check" };
            let slot_ttl_ms = if n == 0 { ttl_ms } else { later_ttl_ms };
            let answer = self
                .reserve_slot(op, checks, &group, nonce, slot_ttl_ms)
                .await;
            let (slot_outcomes, slot_taken) = match answer {
                Ok(answer) => answer,
                Err(error) => {
                    self.give_back_reserved(checks, &reserved, &taken, nonce, &mut outcomes)
                        .await;
                    return Err(error);
                }
            };
            place(&mut outcomes, &group, slot_outcomes);
            match slot_taken {
                Some(slot_taken) => {
                    place(&mut taken, &group, slot_taken);
                    reserved.push(group);
                }
                None if granted => {
                    granted = false;
                    self.give_back_reserved(checks, &reserved, &taken, nonce, &mut outcomes)
                        .await;
                }
                None => {}
            }
        }
        let outcomes = every_answer(outcomes)?;
        let taken = if granted {
            every_answer(taken)?
        } else {
            Vec::new()
        };
        Ok(Reserved {
            granted,
            outcomes,
            taken,
        })
    }

    /// One slot's `reserve` (or `check`): its outcomes, and what it took
    /// when granted.
    async fn reserve_slot(
        &self,
        op: &'static str,
        checks: &[Check],
        group: &[usize],
        nonce: &str,
        ttl_ms: u64,
    ) -> Result<(Vec<Outcome>, Option<Vec<Taken>>)> {
        let op = BudgetOp {
            op,
            nonce: nonce.to_owned(),
            amount: ttl_ms,
            checks: group.iter().map(|&i| checks[i].clone()).collect(),
            settle: None,
        };
        let reply = self.budget_call(op).await?;
        limiter_script::reserved(&reply, group.len())
    }

    /// Settles the slots of a refused reservation that were reserved at 0,
    /// and reports their checks as the give-back left them.
    async fn give_back_reserved(
        &self,
        checks: &[Check],
        reserved: &[Vec<usize>],
        taken: &[Option<Taken>],
        nonce: &str,
        outcomes: &mut [Option<Outcome>],
    ) {
        for group in reserved {
            let slot_taken: Option<Vec<Taken>> = group.iter().map(|&i| taken[i]).collect();
            let Some(slot_taken) = slot_taken else {
                continue;
            };
            let settle = SlotSettle {
                // Made just now: the grace is ample.
                ttl_ms: SETTLE_GRACE_MS,
                extra_ms: 0,
                keep_ms: 0,
                taken: slot_taken,
            };
            match self.settle_slot(checks, group, nonce, 0, settle).await {
                Ok(SlotSettled::Settled(slot_outcomes)) => place(outcomes, group, slot_outcomes),
                Ok(_) => tracing::warn!("a partial reservation was gone before it was given back"),
                Err(error) => tracing::warn!(
                    %error,
                    "could not give back a partial reservation; it stays charged until its window passes"
                ),
            }
        }
    }

    /// Settles `reservation` at `actual`. On a cluster its first slot (the
    /// first reserved, and the first to expire) decides: expired there,
    /// nothing is touched; settled there now or before, the other slots
    /// (in parallel) settle at the actual it holds, so a retry of a settle
    /// cut short completes it as it began. The first slot's record, once
    /// settled, lives the grace at least, and the later slots may settle
    /// twice the grace longer (see `reserve`); one found expired all the
    /// same is an error.
    pub async fn settle(&self, reservation: &Reservation<'_>, actual: u64) -> Result<Settled> {
        let checks = reservation.checks;
        let groups = self.groups(checks.iter().map(|c| c.key.as_str()));
        let Some((first, later)) = groups.split_first() else {
            return Ok(Settled::Unknown);
        };
        let mut outcomes = vec![None; checks.len()];
        let mut fill = |group: &[usize], slot_outcomes: Vec<Outcome>| {
            place(&mut outcomes, group, slot_outcomes);
        };
        let slot = |group: &[usize], extra_ms: u64, keep_ms: u64| SlotSettle {
            ttl_ms: reservation.ttl_ms,
            extra_ms,
            keep_ms,
            taken: group.iter().map(|&i| reservation.taken[i]).collect(),
        };
        let keep_ms = if later.is_empty() { 0 } else { SETTLE_GRACE_MS };
        let before = match self
            .settle_slot(
                checks,
                first,
                reservation.nonce,
                actual,
                slot(first, 0, keep_ms),
            )
            .await?
        {
            SlotSettled::Unknown => return Ok(Settled::Unknown),
            SlotSettled::Settled(o) => {
                fill(first, o);
                None
            }
            SlotSettled::Already(earlier, o) => {
                fill(first, o);
                Some(earlier)
            }
        };
        let settled_at = before.unwrap_or(actual);
        let answers = join_all(later.iter().map(|group| {
            let settle = slot(group, 2 * SETTLE_GRACE_MS, 0);
            self.settle_slot(checks, group, reservation.nonce, settled_at, settle)
        }))
        .await;
        for (group, answer) in later.iter().zip(answers) {
            match answer? {
                SlotSettled::Settled(o) => fill(group, o),
                SlotSettled::Already(earlier, o) => {
                    if earlier != settled_at {
                        // A failover lost the first slot's settlement.
                        tracing::warn!(
                            earlier,
                            settled_at,
                            "a reservation's hash slots were settled at different actuals"
                        );
                    }
                    fill(group, o)
                }
                SlotSettled::Unknown => {
                    return Err(Error::Store(
                        "the reservation expired in another hash slot before it was settled \
                         there (its clock runs ahead): that part stays charged at the estimate"
                            .into(),
                    ))
                }
            }
        }
        let outcomes = every_answer(outcomes)?;
        Ok(match before {
            Some(actual) => Settled::Already { actual, outcomes },
            None => Settled::Settled { outcomes },
        })
    }

    /// One slot's settle: `group` indexes `checks`, the reservation's.
    async fn settle_slot(
        &self,
        checks: &[Check],
        group: &[usize],
        nonce: &str,
        actual: u64,
        settle: SlotSettle,
    ) -> Result<SlotSettled> {
        let op = BudgetOp {
            op: "settle",
            nonce: nonce.to_owned(),
            amount: actual,
            checks: group.iter().map(|&i| checks[i].clone()).collect(),
            settle: Some(settle),
        };
        let reply = self.budget_call(op).await?;
        SlotSettled::read(&reply, group.len())
    }

    /// One budget operation's reply: shared with others in flight, or on a
    /// cluster a call of its own.
    async fn budget_call(&self, op: BudgetOp) -> Result<Vec<i64>> {
        if let Some(batcher) = &self.lane().budget {
            return batcher.apply(op).await?;
        }
        let cmd = self
            .limiter
            .budget_command(&self.now_arg(), std::iter::once(&op));
        let reply: Vec<i64> = self.caller().eval(&self.limiter, &cmd).await?;
        let mut answers = limiter_script::budget_answers(&reply, 1)?;
        answers
            .pop()
            .unwrap_or_else(|| Err(Error::Store("no budget answer".into())))
    }

    /// Takes a lease in every slot, or in none. On a cluster the sets of
    /// different hash slots are acquired one slot after another, and the
    /// places already taken are given back if a later slot refuses.
    pub async fn acquire(
        &self,
        slots: &[LeaseSlot],
        member: &str,
        holder: &str,
        ttl_ms: u64,
    ) -> Result<Acquired> {
        let dropped = UnlessReturned(Some(|| {
            self.release_later(member, slots.iter().map(|s| s.key.clone()).collect());
        }));
        let acquired = self.acquire_slots(slots, member, holder, ttl_ms).await;
        dropped.done();
        acquired
    }

    async fn acquire_slots(
        &self,
        slots: &[LeaseSlot],
        member: &str,
        holder: &str,
        ttl_ms: u64,
    ) -> Result<Acquired> {
        let mut total = Acquired {
            granted: true,
            active: vec![0; slots.len()],
            expired: 0,
            retry_after_ms: 0,
        };
        let mut taken: Vec<String> = Vec::new();
        for group in self.groups(slots.iter().map(|s| s.key.as_str())) {
            let mut invocation = self.leases.prepare_invoke();
            invocation
                .arg("acquire")
                .arg(self.now_arg())
                .arg(member)
                .arg(ttl_ms);
            for &i in &group {
                invocation.key(&slots[i].key).arg(slots[i].limit);
            }
            if !holder.is_empty() {
                invocation.arg(holder);
            }
            // A reply that cannot be read fails like a call that failed:
            // the places taken in earlier slots are given back either way.
            let reply = self.caller().invoke::<Vec<i64>>(invocation).await;
            let reply = match reply.and_then(|r| SlotAcquired::read(&r, group.len())) {
                Ok(reply) => reply,
                Err(error) => {
                    self.give_back(member, &taken).await;
                    if !matches!(error, Error::StoreNotCalled(_)) {
                        let keys = group.iter().map(|&i| slots[i].key.clone()).collect();
                        self.release_later(member, keys);
                    }
                    return Err(error);
                }
            };
            for (&i, &n) in group.iter().zip(&reply.active) {
                total.active[i] = n;
            }
            total.expired = total.expired.saturating_add(reply.expired);
            if !reply.granted {
                total.granted = false;
                total.retry_after_ms = reply.retry_after_ms;
                self.give_back(member, &taken).await;
                return Ok(total);
            }
            taken.extend(group.iter().map(|&i| slots[i].key.clone()));
        }
        Ok(total)
    }

    /// Releases `member` from `keys` a while later, in the background:
    /// after its acquire's call failed (Redis may still have made it after
    /// the deadline, and no caller has its id to release it) or its release
    /// failed; else the place stays taken for its whole TTL. Releasing a
    /// member never made touches nothing.
    pub fn release_later(&self, member: &str, keys: Vec<String>) {
        let store = self.for_lane(self.lane);
        let member = member.to_owned();
        spawn_give_back(async move {
            for delay in LATE_GIVE_BACK {
                tokio::time::sleep(delay).await;
                let lease = LeaseRef {
                    member: &member,
                    ttl_ms: 0,
                    keys: &keys,
                };
                let _ = store.release(&[lease]).await;
            }
        });
    }

    /// Gives `member`'s places in `keys` back (a partial acquire).
    async fn give_back(&self, member: &str, keys: &[String]) {
        if keys.is_empty() {
            return;
        }
        let lease = LeaseRef {
            member,
            ttl_ms: 0,
            keys,
        };
        if let Err(error) = self.release(&[lease]).await {
            tracing::warn!(%error, "could not give back a partial lease; it expires with its TTL");
        }
    }

    /// Extends leases still present; returns which are alive. A lease lost in
    /// any of its sets is lost, and removed from all of them.
    pub async fn heartbeat(&self, leases: &[LeaseRef<'_>]) -> Result<Vec<bool>> {
        let pairs: Vec<(usize, &String)> = leases
            .iter()
            .enumerate()
            .flat_map(|(i, l)| l.keys.iter().map(move |k| (i, k)))
            .collect();
        let mut alive = vec![true; leases.len()];
        for group in self.groups(pairs.iter().map(|(_, k)| k.as_str())) {
            let mut invocation = self.leases.prepare_invoke();
            invocation.arg("heartbeat").arg(self.now_arg());
            for &p in &group {
                let (i, key) = pairs[p];
                invocation
                    .arg(leases[i].member)
                    .arg(leases[i].ttl_ms)
                    .arg(1)
                    .key(key);
            }
            let reply: Vec<i64> = self.caller().invoke(invocation).await?;
            if reply.len() != group.len() {
                return Err(Error::Store(format!("lease script returned {reply:?}")));
            }
            for (&p, ok) in group.iter().zip(reply) {
                alive[pairs[p].0] &= ok == 1;
            }
        }
        // Lost somewhere: make sure it is gone everywhere.
        let lost: Vec<LeaseRef<'_>> = leases
            .iter()
            .zip(&alive)
            .filter(|(_, &a)| !a)
            .map(|(l, _)| *l)
            .collect();
        if !lost.is_empty() && leases.iter().any(|l| l.keys.len() > 1) {
            self.release(&lost).await?;
        }
        Ok(alive)
    }

    /// Removes leases; unknown ones are ignored.
    pub async fn release(&self, leases: &[LeaseRef<'_>]) -> Result<()> {
        let pairs: Vec<(&str, &String)> = leases
            .iter()
            .flat_map(|l| l.keys.iter().map(move |k| (l.member, k)))
            .collect();
        for group in self.groups(pairs.iter().map(|(_, k)| k.as_str())) {
            let mut invocation = self.leases.prepare_invoke();
            invocation.arg("release").arg(self.now_arg());
            for &p in &group {
                invocation.arg(pairs[p].0).arg(1).key(pairs[p].1);
            }
            let _: Vec<i64> = self.caller().invoke(invocation).await?;
        }
        Ok(())
    }

    /// Deletes counter keys, one call per cluster slot (each key goes
    /// whole or not at all; a bucket's give-backs first take what it had
    /// queued: `lua/reset.lua`); missing keys are ignored.
    pub async fn delete(&self, keys: &[String]) -> Result<()> {
        for group in self.groups(keys.iter().map(String::as_str)) {
            let mut invocation = self.reset.prepare_invoke();
            invocation.arg(self.now_arg());
            for &i in &group {
                invocation.key(&keys[i]);
            }
            let _: i64 = self.caller().invoke(invocation).await?;
        }
        Ok(())
    }

    /// The value under `name`, set to `candidate` first if it had none
    /// (see [`super::Store::shared_value`]).
    pub async fn shared_value(&self, name: &str, candidate: &str) -> Result<String> {
        let mut set = redis::cmd("SET");
        set.arg(name).arg(candidate).arg("NX");
        let _: Option<String> = self.caller().query(&set).await?;
        let mut get = redis::cmd("GET");
        get.arg(name);
        let value: Option<String> = self.caller().query(&get).await?;
        value.ok_or_else(|| Error::Store(format!("{name} was deleted as it was set")))
    }

    /// The unexpired leases of a lease set, soonest expiry first.
    pub async fn leases(&self, key: &str) -> Result<Vec<LiveLease>> {
        let mut invocation = self.leases.prepare_invoke();
        invocation.arg("list").arg(self.now_arg()).key(key);
        let reply: Vec<String> = self.caller().invoke(invocation).await?;
        read_listed(&reply)
    }

    /// Connects every pooled connection of the calling thread's lane and
    /// loads the limiter and the lease script, so that the first requests
    /// neither connect nor meet a missing script inside their few
    /// milliseconds of deadline. Run on every lane before the service
    /// reports SERVING.
    pub async fn warm_up(&self) -> Result<()> {
        let caller = self.caller();
        caller.connections.belong_here();
        // Cluster and sentinel make their connections on first use.
        let (conns, connects) = caller.connections.every(caller.call_timeout).await?;
        for mut conn in conns {
            let load = self.limiter.load(&mut conn);
            self.probe("loading the limiter", connects, load).await?;
            let load = self.leases.load_async(&mut conn);
            self.probe("SCRIPT LOAD", connects, load).await?;
        }
        // Unanswered, the warm-up is tried again: left unknown, the first
        // replacement would take the server for another.
        tokio::time::timeout(self.probe_timeout(), caller.connections.learn_server())
            .await
            .map_err(|_| Error::Store("INFO server timed out".into()))??;
        self.ping().await
    }

    /// Runs a call of the warm-up or the health probe under the probe
    /// timeout; an error that shows the connection stale (say `READONLY` on
    /// loading the limiter into a demoted primary), or a timeout after a
    /// silence, replaces it, as on the request path.
    /// `connects`: the count the connection was taken with
    /// (`Connections::get`).
    async fn probe<T>(
        &self,
        what: &str,
        connects: u64,
        call: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.probe_timeout(), call).await {
            Err(_) => {
                // While the breaker keeps requests away, the probe's
                // silence is what replaces connections to a peer gone.
                self.caller().connections.failed(connects, None);
                Err(Error::Store(format!("{what} timed out")))
            }
            Ok(Err(error)) => {
                self.caller().connections.failed(connects, Some(&error));
                Err(error.into())
            }
            Ok(Ok(value)) => {
                self.caller().connections.succeeded();
                Ok(value)
            }
        }
    }

    /// Round trip to Redis on each of this lane's connections, for the
    /// health probe (run on every lane): the limiter called with no checks
    /// (it touches no key). Unlike a `PING`, it meets what requests would:
    /// a server that no longer takes writes (a demoted primary refuses a
    /// function call with `READONLY`; with scripts only, `ROLE` says so;
    /// the connections are replaced), or a limiter gone (loaded again). So
    /// a replica whose requests are all answered by the over-limit cache
    /// still notices a failover. Every connection, every probe: one idle
    /// for long is closed by Redis's `timeout` or a load balancer's idle
    /// timer, and the request that found it so would wait for a
    /// reconnection (`caller`; theirs fails, and pings its pool's
    /// connections as often). It bypasses the breaker, and
    /// closes it when Redis answers.
    pub async fn ping(&self) -> Result<()> {
        let caller = self.caller();
        let (mut conns, connects) = caller.connections.every(caller.call_timeout).await?;
        // Together: a probe takes one call's time, not one per connection.
        let pings = conns.iter_mut().map(|conn| self.ping_on(conn, connects));
        for pinged in futures_util::future::join_all(pings).await {
            pinged?;
        }
        self.caller().answered();
        Ok(())
    }

    /// [`Self::ping`] on one connection, taken with `connects`.
    async fn ping_on(&self, conn: &mut Conn, connects: u64) -> Result<()> {
        // On a cluster, a slot drawn at random: a primary at random.
        let slot_key = (self.topology == Topology::Cluster)
            .then(|| format!("rk:probe:{{{}}}", (crate::random::unit() * 16384.0) as u32));
        let cmd = self
            .limiter
            .probe_command(&self.now_arg(), slot_key.as_deref());
        let reply: Vec<i64> = self
            .probe("the health probe", connects, self.limiter.call(conn, &cmd))
            .await?;
        if !reply.is_empty() {
            return Err(Error::Store(format!(
                "the limiter without checks returned {reply:?}"
            )));
        }
        // A script that writes nothing runs on a replica too: with
        // scripts only, ROLE says whether the server still takes writes.
        // (Not on a cluster, where a keyless command reaches any node
        // and a failover moves slots: MOVED says where.)
        if !self.limiter.uses_functions() && self.topology != Topology::Cluster {
            let primary = async {
                match role(conn).await.as_deref() {
                    Some("slave") => Err(redis::RedisError::from((
                        redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
                        "the server is a replica (ROLE)",
                    ))),
                    _ => Ok(()),
                }
            };
            self.probe("the health probe's ROLE", connects, primary)
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pool is as large as asked, spread as evenly as it goes, and no
    /// lane goes without a connection.
    #[test]
    fn lanes_share_the_pool_size_asked_for() {
        let shares = |connections, lanes| lane_shares(connections, lanes).collect::<Vec<_>>();
        assert_eq!(shares(3, 2), [2, 1]);
        assert_eq!(shares(4, 2), [2, 2]);
        assert_eq!(shares(10, 4), [3, 3, 2, 2]);
        assert_eq!(shares(1, 2), [1, 1], "at least one a lane");
        assert_eq!(shares(0, 0), [1]);
    }

    /// Give-backs wait in a bounded number: past it one is not started,
    /// and one that ends makes room again.
    #[tokio::test]
    async fn give_backs_past_the_bound_are_not_started() {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        spawn_give_back(async {
            let _ = rx.await;
        });
        let waiting = WAITING_GIVE_BACKS.load(Ordering::Relaxed);
        assert!(waiting >= 1);
        let room = MAX_WAITING_GIVE_BACKS - waiting;
        WAITING_GIVE_BACKS.fetch_add(room, Ordering::Relaxed);
        let (ran_tx, ran_rx) = tokio::sync::oneshot::channel::<()>();
        spawn_give_back(async {
            let _ = ran_tx.send(());
        });
        assert!(ran_rx.await.is_err(), "started past the bound");
        assert_eq!(
            WAITING_GIVE_BACKS.load(Ordering::Relaxed),
            MAX_WAITING_GIVE_BACKS
        );
        WAITING_GIVE_BACKS.fetch_sub(room, Ordering::Relaxed);
        let _ = tx.send(());
        for _ in 0..100 {
            if WAITING_GIVE_BACKS.load(Ordering::Relaxed) < waiting {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("an ended give-back still counts as waiting");
    }

    #[test]
    fn an_acquire_reply_of_another_shape_is_an_error() {
        assert_eq!(
            SlotAcquired::read(&[1, 2, 0, 3, 4], 2).ok(),
            Some(SlotAcquired {
                granted: true,
                expired: 2,
                retry_after_ms: 0,
                active: vec![3, 4],
            })
        );
        for reply in [&[][..], &[1, 0], &[1, 0, 0, 3], &[1, 0, 0, 3, 4, 5]] {
            assert!(SlotAcquired::read(reply, 2).is_err(), "{reply:?}");
        }
    }

    #[test]
    fn a_list_reply_of_another_shape_is_an_error() {
        let reply = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            read_listed(&reply(&[
                "a",
                "1800000000000",
                "pod-1",
                "b",
                "1800000000500",
                ""
            ]))
            .ok(),
            Some(vec![
                LiveLease {
                    member: "a".into(),
                    expires_at_ms: 1_800_000_000_000,
                    holder: "pod-1".into(),
                },
                LiveLease {
                    member: "b".into(),
                    expires_at_ms: 1_800_000_000_500,
                    holder: String::new(),
                },
            ])
        );
        for bad in [&["a", "1"][..], &["a", "soon", ""]] {
            assert!(read_listed(&reply(bad)).is_err(), "{bad:?}");
        }
    }
}
