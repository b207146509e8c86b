//! envoyproxy/ratelimit's per-call stats of `ShouldRateLimit`, under their
//! Prometheus names (as their statsd mapping gives them) and their statsd
//! names: calls, response time, and calls that failed on the store
//! (`redis_error`) or on the request (`service_error`). Registered once:
//! the request path only adds.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::statsd;

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
    total: metrics::Counter,
    response_time: metrics::Histogram,
    redis_error: metrics::Counter,
    service_error: metrics::Counter,
    statsd: Option<[statsd::Counter; 3]>,
}

impl CallStats {
    pub fn new(method: &'static str) -> Self {
        let error = |err_type: &'static str| metrics::counter!("ratelimit_service_should_rate_limit_error", "err_type" => err_type);
        let statsd = (|| {
            Some([
                statsd::counter(&format!("ratelimit_server.{method}.total_requests"))?,
                statsd::counter("ratelimit.service.call.should_rate_limit.redis_error")?,
                statsd::counter("ratelimit.service.call.should_rate_limit.service_error")?,
            ])
        })();
        CallStats {
            total: metrics::counter!("ratelimit_service_total_requests", "grpc_method" => method),
            response_time: metrics::histogram!(
                "ratelimit_service_response_time_seconds",
                "grpc_method" => method
            ),
            redis_error: error("redis_error"),
            service_error: error("service_error"),
            statsd,
        }
    }

    /// One call answered (or refused) after `elapsed`.
    pub fn call(&self, elapsed: Duration) {
        self.total.increment(1);
        self.response_time.record(elapsed.as_secs_f64());
        if let Some([total, ..]) = &self.statsd {
            total.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn error(&self, error: CallError) {
        let (counter, index) = match error {
            CallError::Redis => (&self.redis_error, 1),
            CallError::Service => (&self.service_error, 2),
        };
        counter.increment(1);
        if let Some(statsd) = &self.statsd {
            statsd[index].fetch_add(1, Ordering::Relaxed);
        }
    }
}
