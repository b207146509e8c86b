//! The Redis store: a request's checks go to Redis as one `EVALSHA` of the
//! limiter script (reloaded on `NOSCRIPT`), so the decision is atomic across
//! replicas and timed by the Redis server's clock. On Redis Cluster the checks
//! are grouped by hash slot: one script call per slot, the slots in parallel,
//! each slot all-or-nothing on its own.
//!
//! Every call has a deadline and goes through a circuit breaker.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use redis::Script;

use super::breaker::Breaker;
use super::connection::{Connections, RedisSettings, Topology};
use super::lease::{Acquired, LeaseRef, LeaseSlot};
use crate::clock::Clock;
use crate::keys::cluster_slot;
use crate::limiter::{Check, Outcome};
use crate::{Error, Result};

/// The one limiter script: helpers, every algorithm, then the batch driver
/// (see `lua/README.md`).
const LIMITER_SCRIPT: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    include_str!("../../lua/fixed_window.lua"),
    include_str!("../../lua/sliding_window.lua"),
    include_str!("../../lua/sliding_log.lua"),
    include_str!("../../lua/gcra.lua"),
    include_str!("../../lua/batch.lua"),
);

/// Counters and leases kept in Redis.
pub struct RedisStore {
    connections: Arc<Connections>,
    topology: Topology,
    /// None on a cluster: one failing master must not stop the others' slots.
    breaker: Option<Breaker>,
    limiter: Script,
    leases: Script,
    call_timeout: Duration,
    /// Tests pin time here; production leaves it `None` and the scripts read
    /// the server's `TIME`.
    clock: Option<Arc<dyn Clock>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The settings may carry a password: never print them.
        f.debug_struct("RedisStore")
            .field("topology", &self.topology)
            .finish_non_exhaustive()
    }
}

/// Consecutive failures that open the circuit, and how long it stays open.
const BREAKER_THRESHOLD: u32 = 5;
const BREAKER_COOLDOWN: Duration = Duration::from_millis(250);

impl RedisStore {
    /// Creates the store without waiting for Redis: connections are made on
    /// first use and re-made after failures, so ratekeeper starts (and can
    /// fail open) while Redis is down.
    pub fn new(settings: &RedisSettings, clock: Option<Arc<dyn Clock>>) -> Result<Self> {
        Ok(RedisStore {
            connections: Connections::new(settings.clone())?,
            topology: settings.topology,
            breaker: (settings.topology != Topology::Cluster)
                .then(|| Breaker::new(BREAKER_THRESHOLD, BREAKER_COOLDOWN)),
            limiter: Script::new(LIMITER_SCRIPT),
            leases: Script::new(include_str!("../../lua/leases.lua")),
            call_timeout: settings.call_timeout,
            clock,
        })
    }

    /// The pinned clock, or the system's.
    pub fn now_ms(&self) -> u64 {
        use crate::clock::SystemClock;
        self.clock
            .as_ref()
            .map_or_else(|| SystemClock.now_ms(), |c| c.now_ms())
    }

    fn now_arg(&self) -> String {
        self.clock
            .as_ref()
            .map(|c| c.now_ms().to_string())
            .unwrap_or_default()
    }

    /// Runs one script call under the breaker and the deadline.
    async fn invoke<T: redis::FromRedisValue>(
        &self,
        invocation: redis::ScriptInvocation<'_>,
    ) -> Result<T> {
        let Some(breaker) = &self.breaker else {
            return self.call(invocation).await;
        };
        if !breaker.allow() {
            return Err(Error::Store("circuit open: Redis is failing".into()));
        }
        let result = self.call(invocation).await;
        match &result {
            Ok(_) => breaker.success(),
            Err(_) => breaker.failure(),
        }
        result
    }

    async fn call<T: redis::FromRedisValue>(
        &self,
        invocation: redis::ScriptInvocation<'_>,
    ) -> Result<T> {
        let mut conn = self.connections.get(self.call_timeout).await?;
        match tokio::time::timeout(self.call_timeout, invocation.invoke_async(&mut conn)).await {
            Err(_) => {
                self.connections.failed(None);
                Err(Error::Store(format!(
                    "no answer within {:?}",
                    self.call_timeout
                )))
            }
            Ok(Err(error)) => {
                self.connections.failed(Some(&error));
                Err(error.into())
            }
            Ok(Ok(value)) => {
                self.connections.succeeded();
                Ok(value)
            }
        }
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

    /// Applies one request's checks: one script call per slot.
    pub async fn apply(&self, checks: &[Check], all_or_nothing: bool) -> Result<Vec<Outcome>> {
        let groups = self.groups(checks.iter().map(|c| c.key.as_str()));
        let answers = join_all(
            groups
                .iter()
                .map(|group| self.apply_group(checks, group, all_or_nothing)),
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

    async fn apply_group(
        &self,
        checks: &[Check],
        group: &[usize],
        all_or_nothing: bool,
    ) -> Result<Vec<Outcome>> {
        let mut invocation = self.limiter.prepare_invoke();
        invocation
            .arg(self.now_arg())
            .arg(if all_or_nothing { "1" } else { "0" });
        for &i in group {
            let check = &checks[i];
            invocation
                .key(&check.key)
                .arg(check.algorithm.key_tag())
                .arg(check.limit)
                .arg(check.period_ms)
                .arg(check.burst)
                .arg(check.hits)
                .arg(if check.enforce { "1" } else { "0" });
        }
        let reply: Vec<i64> = self.invoke(invocation).await?;
        if reply.len() != group.len() * 3 {
            return Err(Error::Store(format!(
                "script returned {} values for {} checks",
                reply.len(),
                group.len()
            )));
        }
        Ok(reply
            .chunks_exact(3)
            .map(|v| Outcome {
                over: v[0] != 0,
                remaining: v[1].max(0) as u64,
                reset_ms: v[2].max(0) as u64,
            })
            .collect())
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
            let reply: Vec<i64> = match self.invoke(invocation).await {
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
            let reply: Vec<i64> = self.invoke(invocation).await?;
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
            let _: Vec<i64> = self.invoke(invocation).await?;
        }
        Ok(())
    }

    /// Connects every pooled connection and loads both scripts, so that the
    /// first requests neither connect nor meet `NOSCRIPT` inside their few
    /// milliseconds of deadline. Run before the service reports SERVING.
    pub async fn warm_up(&self) -> Result<()> {
        self.ping().await?;
        let limit = self.call_timeout.max(Duration::from_millis(500));
        for mut conn in self.connections.all() {
            for script in [&self.limiter, &self.leases] {
                tokio::time::timeout(limit, script.load_async(&mut conn))
                    .await
                    .map_err(|_| Error::Store("SCRIPT LOAD timed out".into()))??;
            }
        }
        Ok(())
    }

    /// Round trip to Redis, for the health probe. It bypasses the breaker,
    /// and closes it when Redis answers.
    pub async fn ping(&self) -> Result<()> {
        let result = async {
            let mut conn = self.connections.get(self.call_timeout).await?;
            let cmd = redis::cmd("PING");
            match tokio::time::timeout(
                self.call_timeout.max(Duration::from_millis(500)),
                cmd.query_async::<String>(&mut conn),
            )
            .await
            {
                Err(_) => Err(Error::Store("PING timed out".into())),
                Ok(Err(error)) => {
                    self.connections.failed(Some(&error));
                    Err(error.into())
                }
                Ok(Ok(pong)) if pong == "PONG" => Ok(()),
                Ok(Ok(other)) => Err(Error::Store(format!("unexpected PING reply {other:?}"))),
            }
        }
        .await;
        if let (Ok(()), Some(breaker)) = (&result, &self.breaker) {
            breaker.success();
        }
        result
    }
}
