//! The Redis store: every request's checks go to Redis as one `EVALSHA` of
//! the algorithm's Lua script (reloaded on `NOSCRIPT`), so the decision is
//! atomic across all replicas and timed by the Redis server's clock.
//!
//! Connections are redis-rs `ConnectionManager`s: each multiplexes (pipelines)
//! every caller's commands over one socket and reconnects by itself after a
//! Redis restart. A few of them are used round-robin to spread the load over
//! more than one socket and driver task.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;

use super::lease::{Acquired, LeaseRef, LeaseSlot};
use crate::clock::Clock;
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

/// Settings of the Redis store.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    /// `redis://[user:password@]host:port[/db]`.
    pub url: String,
    /// Number of multiplexed connections.
    pub connections: usize,
    /// Time allowed for establishing a connection.
    pub connect_timeout: Duration,
    /// Time allowed for one call, connection included.
    pub call_timeout: Duration,
}

/// Counters kept in a Redis server.
pub struct RedisStore {
    connections: Vec<ConnectionManager>,
    next: AtomicUsize,
    limiter: Script,
    leases: Script,
    call_timeout: Duration,
    /// Tests pin time here; production leaves it `None` and the scripts read
    /// the server's `TIME`.
    clock: Option<Arc<dyn Clock>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may carry a password: never print it.
        f.debug_struct("RedisStore")
            .field("connections", &self.connections.len())
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Creates the store without waiting for Redis: connections are made on
    /// first use and re-made after failures, so ratekeeper starts (and can
    /// fail open) while Redis is down.
    pub fn new(settings: &RedisSettings, clock: Option<Arc<dyn Clock>>) -> Result<Self> {
        let client = redis::Client::open(settings.url.as_str())
            .map_err(|e| Error::Store(format!("invalid Redis URL ({:?})", e.kind())))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(settings.connect_timeout))
            .set_response_timeout(Some(settings.call_timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        let connections = (0..settings.connections.max(1))
            .map(|_| ConnectionManager::new_lazy_with_config(client.clone(), config.clone()))
            .collect::<redis::RedisResult<Vec<_>>>()?;
        Ok(RedisStore {
            connections,
            next: AtomicUsize::new(0),
            limiter: Script::new(LIMITER_SCRIPT),
            leases: Script::new(include_str!("../../lua/leases.lua")),
            call_timeout: settings.call_timeout,
            clock,
        })
    }

    fn connection(&self) -> ConnectionManager {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.connections.len();
        self.connections[i].clone()
    }

    /// Applies one request's checks in one script call.
    pub async fn apply(&self, checks: &[Check], all_or_nothing: bool) -> Result<Vec<Outcome>> {
        let mut invocation = self.limiter.prepare_invoke();
        match &self.clock {
            Some(clock) => invocation.arg(clock.now_ms()),
            None => invocation.arg(""),
        };
        invocation.arg(if all_or_nothing { "1" } else { "0" });
        for check in checks {
            invocation
                .key(&check.key)
                .arg(check.algorithm.key_tag())
                .arg(check.limit)
                .arg(check.period_ms)
                .arg(check.burst)
                .arg(check.hits)
                .arg(if check.enforce { "1" } else { "0" });
        }
        let mut conn = self.connection();
        let reply: Vec<i64> =
            tokio::time::timeout(self.call_timeout, invocation.invoke_async(&mut conn))
                .await
                .map_err(|_| Error::Store(format!("no answer within {:?}", self.call_timeout)))??;
        if reply.len() != checks.len() * 3 {
            return Err(Error::Store(format!(
                "script returned {} values for {} checks",
                reply.len(),
                checks.len()
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

    fn now_arg(&self) -> String {
        self.clock
            .as_ref()
            .map(|c| c.now_ms().to_string())
            .unwrap_or_default()
    }

    async fn invoke<T: redis::FromRedisValue>(
        &self,
        invocation: redis::ScriptInvocation<'_>,
    ) -> Result<T> {
        let mut conn = self.connection();
        tokio::time::timeout(self.call_timeout, invocation.invoke_async(&mut conn))
            .await
            .map_err(|_| Error::Store(format!("no answer within {:?}", self.call_timeout)))?
            .map_err(Error::from)
    }

    /// Takes a lease in every slot, or in none.
    pub async fn acquire(
        &self,
        slots: &[LeaseSlot],
        member: &str,
        ttl_ms: u64,
    ) -> Result<Acquired> {
        let mut invocation = self.leases.prepare_invoke();
        invocation
            .arg("acquire")
            .arg(self.now_arg())
            .arg(member)
            .arg(ttl_ms);
        for slot in slots {
            invocation.key(&slot.key).arg(slot.limit);
        }
        let reply: Vec<i64> = self.invoke(invocation).await?;
        match reply.as_slice() {
            [granted, expired, retry, active @ ..] if active.len() == slots.len() => Ok(Acquired {
                granted: *granted == 1,
                active: active.iter().map(|&n| n.max(0) as u64).collect(),
                expired: (*expired).max(0) as u64,
                retry_after_ms: (*retry).max(0) as u64,
            }),
            _ => Err(Error::Store(format!("lease script returned {reply:?}"))),
        }
    }

    /// Extends leases still present; returns which are alive.
    pub async fn heartbeat(&self, leases: &[LeaseRef<'_>]) -> Result<Vec<bool>> {
        let mut invocation = self.leases.prepare_invoke();
        invocation.arg("heartbeat").arg(self.now_arg());
        for lease in leases {
            invocation
                .arg(lease.member)
                .arg(lease.ttl_ms)
                .arg(lease.keys.len());
            for key in lease.keys {
                invocation.key(key);
            }
        }
        let reply: Vec<i64> = self.invoke(invocation).await?;
        if reply.len() != leases.len() {
            return Err(Error::Store(format!(
                "lease script returned {} answers for {} leases",
                reply.len(),
                leases.len()
            )));
        }
        Ok(reply.into_iter().map(|alive| alive == 1).collect())
    }

    /// Removes leases; unknown ones are ignored.
    pub async fn release(&self, leases: &[LeaseRef<'_>]) -> Result<()> {
        let mut invocation = self.leases.prepare_invoke();
        invocation.arg("release").arg(self.now_arg());
        for lease in leases {
            invocation.arg(lease.member).arg(lease.keys.len());
            for key in lease.keys {
                invocation.key(key);
            }
        }
        let _: Vec<i64> = self.invoke(invocation).await?;
        Ok(())
    }

    /// Round trip to Redis, for health checks.
    pub async fn ping(&self) -> Result<()> {
        let mut conn = self.connection();
        let pong: String = tokio::time::timeout(
            self.call_timeout.max(Duration::from_millis(500)),
            redis::cmd("PING").query_async(&mut conn),
        )
        .await
        .map_err(|_| Error::Store("PING timed out".into()))??;
        if pong == "PONG" {
            Ok(())
        } else {
            Err(Error::Store(format!("unexpected PING reply {pong:?}")))
        }
    }
}
