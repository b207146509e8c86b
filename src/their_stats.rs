//! envoyproxy/ratelimit's stats, each known by its statsd name (for example
//! `ratelimit.service.config_load_success`) and sent everywhere theirs can
//! send it: to the statsd sink when it is on, and to the Prometheus series
//! the statsd_exporter mapping in use ([`stat_mapper`]) makes of it. Both
//! are resolved once, when the stat is made: keep it, the request path then
//! only adds.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::stat_mapper::{self, Series, StatKind};
use crate::statsd;

/// The method name in their per-call stats' names.
pub const SHOULD_RATE_LIMIT: &str = "ShouldRateLimit";

/// The name of a gRPC method's response-time timer.
pub fn response_time(method: &str) -> String {
    format!("ratelimit_server.{method}.response_time")
}

/// The series a timer stat maps to (`None`: dropped by the mapping).
pub fn timer_series(name: &str) -> Option<Series> {
    stat_mapper::installed().map(name, StatKind::Observer)
}

/// One of their counters.
#[derive(Debug, Clone)]
pub struct TheirCounter {
    prometheus: Option<metrics::Counter>,
    statsd: Option<statsd::Counter>,
}

impl TheirCounter {
    pub fn new(name: &str) -> Self {
        let series = stat_mapper::installed().map(name, StatKind::Counter);
        TheirCounter {
            prometheus: series.map(|s| metrics::counter!(s.name, labels(s.labels))),
            statsd: statsd::counter(name),
        }
    }

    pub fn add(&self, n: u64) {
        if let Some(counter) = &self.prometheus {
            counter.increment(n);
        }
        if let Some(counter) = &self.statsd {
            counter.fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// One of their timers (milliseconds in statsd; in Prometheus, times the
/// mapping's `scale`).
#[derive(Debug, Clone)]
pub struct TheirTimer {
    prometheus: Option<(metrics::Histogram, f64)>,
    statsd: Option<statsd::Timer>,
}

impl TheirTimer {
    pub fn new(name: &str) -> Self {
        let histogram =
            timer_series(name).map(|s| (metrics::histogram!(s.name, labels(s.labels)), s.scale));
        TheirTimer {
            prometheus: histogram,
            statsd: statsd::timer(name),
        }
    }

    pub fn record(&self, elapsed: Duration) {
        if let Some((histogram, scale)) = &self.prometheus {
            histogram.record(elapsed.as_secs_f64() * 1000.0 * scale);
        }
        if let Some(timer) = &self.statsd {
            timer.record(elapsed);
        }
    }
}

fn labels(pairs: Vec<(String, String)>) -> Vec<metrics::Label> {
    let pairs = pairs.into_iter();
    pairs.map(|(k, v)| metrics::Label::new(k, v)).collect()
}

/// Counts a request for a domain no config has: theirs counts
/// `ratelimit.service.rate_limit.<domain>.domain_not_found`. The domain is
/// the caller's, so distinct ones past a cap share the name `overflow`:
/// random domains must not grow the stats without bound.
pub fn domain_not_found(domain: &str) {
    const CAP: usize = 100;
    static SEEN: OnceLock<Mutex<HashMap<String, TheirCounter>>> = OnceLock::new();
    let mut seen = SEEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(counter) = seen.get(domain) {
        return counter.add(1);
    }
    let domain = match seen.len() < CAP {
        true => domain,
        false => "overflow",
    };
    let counter = seen.entry(domain.to_owned()).or_insert_with(|| {
        let key = crate::stat_key::sanitize(domain);
        TheirCounter::new(&format!(
            "ratelimit.service.rate_limit.{key}.domain_not_found"
        ))
    });
    counter.add(1);
}

/// Counts a request `SHADOW_MODE` let through although over a limit
/// (`ratelimit.service.global_shadow_mode`).
pub fn global_shadow_mode() {
    static COUNTER: OnceLock<TheirCounter> = OnceLock::new();
    COUNTER
        .get_or_init(|| TheirCounter::new("ratelimit.service.global_shadow_mode"))
        .add(1);
}
