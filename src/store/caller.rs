//! One Redis call under the deadline and the circuit breaker: the only way
//! the Redis store reaches Redis for decisions and leases.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::{Cmd, FromRedisValue, RedisResult};
use tokio::time::Instant;

use super::breaker::Breaker;
use super::connection::{Conn, Connections};
use super::limiter_script::LimiterScript;
use crate::{Error, Result};

/// Consecutive failures that open the circuit, and how long it stays open.
const BREAKER_THRESHOLD: u32 = 5;
const BREAKER_COOLDOWN: Duration = Duration::from_millis(250);

/// Makes calls on the pooled connections.
pub struct Caller {
    pub connections: Arc<Connections>,
    /// None on a cluster: one failing master must not stop the others' slots.
    /// Shared by the lanes' callers: they all reach the same Redis.
    breaker: Option<Arc<Breaker>>,
    pub call_timeout: Duration,
    /// `ratekeeper_store_call_duration_seconds`: one sample per call (a
    /// batched call decides many requests), registered once.
    duration: metrics::Histogram,
}

impl Caller {
    pub fn new(
        connections: Arc<Connections>,
        breaker: Option<Arc<Breaker>>,
        call_timeout: Duration,
    ) -> Self {
        Caller {
            connections,
            breaker,
            call_timeout,
            duration: metrics::histogram!("ratekeeper_store_call_duration_seconds"),
        }
    }

    /// A circuit breaker with the thresholds calls are made under.
    pub fn breaker() -> Arc<Breaker> {
        Arc::new(Breaker::new(BREAKER_THRESHOLD, BREAKER_COOLDOWN))
    }

    /// Runs a prepared script invocation.
    pub async fn invoke<T: FromRedisValue>(
        &self,
        invocation: redis::ScriptInvocation<'_>,
    ) -> Result<T> {
        let invocation = &invocation;
        self.guarded(Instant::now() + self.call_timeout, |mut conn| async move {
            invocation.invoke_async(&mut conn).await
        })
        .await
    }

    /// Runs a plain command (the admin API's `DEL`, `ZRANGE`).
    pub async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T> {
        self.guarded(Instant::now() + self.call_timeout, |mut conn| async move {
            cmd.query_async(&mut conn).await
        })
        .await
    }

    /// Runs `cmd`, a call of the limiter (which reloads itself when Redis
    /// lost it), for its reply's integers.
    pub async fn eval(&self, limiter: &LimiterScript, cmd: &Cmd) -> Result<Vec<i64>> {
        self.eval_by(limiter, cmd, Instant::now() + self.call_timeout)
            .await
    }

    /// [`Caller::eval`] answered by `deadline`, which may be sooner than the
    /// call deadline from now (a batched call answers by its requests'
    /// deadlines).
    pub async fn eval_by(
        &self,
        limiter: &LimiterScript,
        cmd: &Cmd,
        deadline: Instant,
    ) -> Result<Vec<i64>> {
        self.guarded(deadline, |mut conn| async move {
            limiter.call(&mut conn, cmd).await
        })
        .await
    }

    /// Tells the breaker that Redis answered (the health probe's ping).
    pub fn answered(&self) {
        if let Some(breaker) = &self.breaker {
            breaker.success();
        }
    }

    async fn guarded<T, F, Fut>(&self, deadline: Instant, call: F) -> Result<T>
    where
        F: Fn(Conn) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        if !self.breaker.as_deref().map_or(true, Breaker::allow) {
            return Err(Error::StoreNotCalled(
                "circuit open: Redis is failing".into(),
            ));
        }
        let started = Instant::now();
        let (result, answered) = self.by(deadline, call).await;
        self.duration.record(started.elapsed().as_secs_f64());
        if let Some(breaker) = &self.breaker {
            match answered {
                true => breaker.success(),
                false => breaker.failure(),
            }
        }
        result
    }

    /// Makes the call, connecting first if need be, all by `deadline`;
    /// with whether Redis answered it as a working Redis does (a reply, or
    /// an error reply about the call's own keys or arguments). A call that
    /// finds its connection gone ([`went_away`]) is made once more, by the
    /// same deadline, on a new one.
    async fn by<T, F, Fut>(&self, deadline: Instant, call: F) -> (Result<T>, bool)
    where
        F: Fn(Conn) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let wait = deadline.saturating_duration_since(Instant::now());
        let (mut conn, mut connects) = match self.connections.get(wait).await {
            Ok(taken) => taken,
            Err(error) => return (Err(error), false),
        };
        // Whether the call may be made once more; the connections count
        // whose failure was reported (a call made again on the same
        // connection that fails again is one failure of it).
        let (mut again, mut reported) = (true, None);
        loop {
            let outcome = tokio::time::timeout_at(deadline, call(conn.clone())).await;
            let first_failure = reported != Some(connects);
            reported = Some(connects);
            match outcome {
                Err(_) => {
                    if first_failure {
                        self.connections.failed(connects, None);
                    }
                    let error = format!("no answer within {:?}", self.call_timeout);
                    return (Err(Error::Store(error)), false);
                }
                Ok(Err(error)) => {
                    if first_failure {
                        self.connections.failed(connects, Some(&error));
                    }
                    if std::mem::take(&mut again) && went_away(&error) {
                        if let Some(taken) = self.connections.again_after(conn, connects) {
                            (conn, connects) = taken;
                            continue;
                        }
                    }
                    let answered = is_about_the_call(&error);
                    return (Err(error.into()), answered);
                }
                Ok(Ok(value)) => {
                    self.connections.succeeded();
                    return (Ok(value), true);
                }
            }
        }
    }
}

/// Whether `error` says the call found no connection: the one it was
/// given was closed by the server (a restart, a failover's `CLIENT KILL`,
/// its `timeout` on an idle connection) or by something between (a
/// proxy's or a load balancer's idle timer), or its reconnection was
/// refused (that refusal may be older than the call: redis-rs keeps a
/// failed reconnection's error for the next call, which starts another).
/// redis-rs answers a call on a connection it already saw closed as it
/// answers one cut off in flight, so either may be the case. The first,
/// what a quiet replica meets after a Redis restart, never left and is
/// safe to make again. The second Redis may have run: made again, a
/// decision's hits count twice (each request's of the call), and so does
/// a Reserve's estimate (nothing of a reservation is recorded before its
/// settle: lua/budget.lua), while a lease acquire finds its lease
/// (lua/leases.lua) and takes nothing more; a settle answers that it was
/// settled already (charging nothing more), and a heartbeat, a release or
/// a reset is the same made twice.
fn went_away(error: &redis::RedisError) -> bool {
    error.is_connection_dropped()
}

/// An error reply about the call itself from a Redis that works: a key
/// of another type (`WRONGTYPE`: someone else's key where ours would be,
/// which a forged lease id can name) or an error a script raised (`ERR`).
/// It fails that call alone: the breaker, shared by every request, must
/// not open on it.
fn is_about_the_call(error: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    matches!(
        error.kind(),
        ErrorKind::Server(ServerErrorKind::ResponseError)
    ) || error.code() == Some("WRONGTYPE")
}
