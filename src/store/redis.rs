//! The Redis store: a request's checks go to Redis as one call of the
//! limiter ([`LimiterScript`]: a function by `FCALL` on Redis 7, else a
//! script by `EVALSHA`; reloaded when Redis lost it), so the decision is
//! atomic across replicas and timed by the Redis server's clock; requests
//! in flight together share a call ([`Batcher`]). On Redis Cluster the checks are
//! grouped by hash slot: one script call per slot, the slots in parallel,
//! each slot all-or-nothing on its own.
//!
//! Every call has a deadline and goes through a circuit breaker ([`Caller`]).

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use redis::Script;

use super::batcher::Batcher;
use super::caller::Caller;
use super::connection::{Connections, RedisSettings};
use super::lease::{Acquired, LeaseRef, LeaseSlot};
use super::limiter_script::{self, script_now, LimiterScript};
use crate::clock::Clock;
use crate::keys::cluster_slot;
use crate::limiter::{Check, Outcome};
use crate::vocab::Topology;
use crate::{Error, Result};

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
    /// Tests pin time here; production leaves it `None` and the scripts read
    /// the server's `TIME`.
    clock: Option<Arc<dyn Clock>>,
}

/// A serving lane's own connections, and its batcher.
struct Lane {
    caller: Arc<Caller>,
    /// Joins concurrent requests into one call; None on a cluster, where
    /// each call must stay within one hash slot.
    batcher: Option<Arc<Batcher>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The settings may carry a password: never print them.
        f.debug_struct("RedisStore")
            .field("topology", &self.topology)
            .finish_non_exhaustive()
    }
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
        let limiter = Arc::new(LimiterScript::new(settings.functions));
        let count = settings.lanes.max(1);
        let per_lane = settings.connections.div_ceil(count).max(1);
        let lanes = (0..count)
            .map(|_| {
                let caller = Arc::new(Caller::new(
                    Connections::new(RedisSettings {
                        connections: per_lane,
                        ..settings.clone()
                    })?,
                    breaker.clone(),
                    settings.call_timeout,
                ));
                let batcher = (!clustered).then(|| {
                    Arc::new(Batcher::new(
                        Arc::clone(&caller),
                        Arc::clone(&limiter),
                        clock.clone(),
                        per_lane,
                    ))
                });
                Ok(Lane { caller, batcher })
            })
            .collect::<Result<Arc<[_]>>>()?;
        Ok(RedisStore {
            lanes,
            lane: 0,
            topology: settings.topology,
            limiter,
            leases: Script::new(include_str!("../../lua/leases.lua")),
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
            clock: self.clock.clone(),
        }
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
            return batcher.apply(checks, all_or_nothing).await;
        }
        let groups = self.groups(checks.iter().map(|c| c.key.as_str()));
        let answers = join_all(
            groups
                .iter()
                .map(|group| self.apply_slot(checks, group, all_or_nothing)),
        )
        .await;
        let mut outcomes = vec![None; checks.len()];
        for (group, answer) in groups.iter().zip(answers) {
            for (&i, outcome) in group.iter().zip(answer?) {
                outcomes[i] = Some(outcome);
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.ok_or_else(|| Error::Store("a check got no answer".into())))
            .collect()
    }

    async fn apply_slot(
        &self,
        checks: &[Check],
        group: &[usize],
        all_or_nothing: bool,
    ) -> Result<Vec<Outcome>> {
        let slot_checks = group.iter().map(|&i| &checks[i]);
        let cmd = self.limiter.command(
            &self.now_arg(),
            std::iter::once((all_or_nothing, slot_checks)),
        );
        let reply: Vec<i64> = self.caller().eval(&self.limiter, &cmd).await?;
        limiter_script::outcomes(&reply, group.len())
    }

    /// Takes a lease in every slot, or in none. On a cluster the sets of
    /// different hash slots are acquired one slot after another, and the
    /// places already taken are given back if a later slot refuses.
    pub async fn acquire(
        &self,
        slots: &[LeaseSlot],
        member: &str,
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
            let reply: Vec<i64> = match self.caller().invoke(invocation).await {
                Ok(reply) => reply,
                Err(error) => {
                    self.give_back(member, &taken).await;
                    return Err(error);
                }
            };
            let [granted, expired, retry, active @ ..] = reply.as_slice() else {
                return Err(Error::Store(format!("lease script returned {reply:?}")));
            };
            if active.len() != group.len() {
                return Err(Error::Store(format!("lease script returned {reply:?}")));
            }
            for (&i, &n) in group.iter().zip(active) {
                total.active[i] = n.max(0) as u64;
            }
            total.expired += (*expired).max(0) as u64;
            if *granted != 1 {
                total.granted = false;
                total.retry_after_ms = (*retry).max(0) as u64;
                self.give_back(member, &taken).await;
                return Ok(total);
            }
            taken.extend(group.iter().map(|&i| slots[i].key.clone()));
        }
        Ok(total)
    }

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

    /// Connects every pooled connection of the calling thread's lane and
    /// loads the limiter and the lease script, so that the first requests
    /// neither connect nor meet a missing script inside their few
    /// milliseconds of deadline. Run on every lane before the service
    /// reports SERVING.
    pub async fn warm_up(&self) -> Result<()> {
        self.ping().await?;
        let loading = |what: &'static str| move |_| Error::Store(format!("{what} timed out"));
        for mut conn in self.caller().connections.all() {
            tokio::time::timeout(self.probe_timeout(), self.limiter.load(&mut conn))
                .await
                .map_err(loading("loading the limiter"))??;
            tokio::time::timeout(self.probe_timeout(), self.leases.load_async(&mut conn))
                .await
                .map_err(loading("SCRIPT LOAD"))??;
        }
        Ok(())
    }

    /// Round trip to Redis, for the health probe. It bypasses the breaker,
    /// and closes it when Redis answers.
    pub async fn ping(&self) -> Result<()> {
        let result = async {
            let caller = self.caller();
            let mut conn = caller.connections.get(caller.call_timeout).await?;
            let cmd = redis::cmd("PING");
            match tokio::time::timeout(self.probe_timeout(), cmd.query_async::<String>(&mut conn))
                .await
            {
                Err(_) => Err(Error::Store("PING timed out".into())),
                Ok(Err(error)) => {
                    self.caller().connections.failed(Some(&error));
                    Err(error.into())
                }
                Ok(Ok(pong)) if pong == "PONG" => Ok(()),
                Ok(Ok(other)) => Err(Error::Store(format!("unexpected PING reply {other:?}"))),
            }
        }
        .await;
        if result.is_ok() {
            self.caller().answered();
        }
        result
    }
}
