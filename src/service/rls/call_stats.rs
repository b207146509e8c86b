//! envoyproxy/ratelimit's per-call stats of `ShouldRateLimit`, under their
//! statsd names and the Prometheus series their mapping makes of them:
//! calls (`ratelimit_server.<method>.total_requests`), response time
//! (`ratelimit_server.<method>.response_time`, a timer), and calls that
//! failed on the store (`ratelimit.service.call.should_rate_limit.redis_error`)
//! or on the request (`…service_error`). Made once: the request path only
//! adds.

use std::time::Duration;

use crate::their_stats::{self, TheirCounter, TheirTimer};

/// Why a call counts as failed, in their words.
#[derive(Debug, Clone, Copy)]
pub enum CallError {
    /// The store failed (whatever the failure mode then answered).
    Redis,
    /// The request could not be evaluated.
    Service,
}

/// The stats of one gRPC method.
#[derive(Debug, Clone)]
pub struct CallStats {
    total: TheirCounter,
    response_time: TheirTimer,
    redis_error: TheirCounter,
    service_error: TheirCounter,
}

impl CallStats {
    pub fn new(method: &'static str) -> Self {
        let error = |err_type: &str| {
            TheirCounter::new(&format!(
                "ratelimit.service.call.should_rate_limit.{err_type}"
            ))
        };
        CallStats {
            total: TheirCounter::new(&format!("ratelimit_server.{method}.total_requests")),
            response_time: TheirTimer::new(&their_stats::response_time(method)),
            redis_error: error("redis_error"),
            service_error: error("service_error"),
        }
    }

    /// One call answered (or refused) after `elapsed`.
    pub fn call(&self, elapsed: Duration) {
        self.total.add(1);
        self.response_time.record(elapsed);
    }

    pub fn error(&self, error: CallError) {
        match error {
            CallError::Redis => self.redis_error.add(1),
            CallError::Service => self.service_error.add(1),
        }
    }
}
