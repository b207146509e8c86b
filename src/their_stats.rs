//! envoyproxy/ratelimit's stats, each known by its statsd name (for example
//! `ratelimit.service.config_load_success`) and sent everywhere theirs can
//! send it: to the statsd sink when it is on, and to the Prometheus series
//! the statsd_exporter mapping in use ([`stat_mapper`]) makes of it. Both
//! are resolved once, when the stat is made: keep it, the request path then
//! only adds. Their gauges, and totals kept elsewhere, are read when sent
//! instead ([`read_when_sent`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::stat_mapper::{self, Series, StatKind};
use crate::statsd::{self, Reader, Reading};

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

/// The Prometheus side of a stat read when sent.
enum Scraped {
    Gauge(metrics::Gauge),
    Total(metrics::Counter),
}

/// The stats read when sent that have a series, by stat name.
static SCRAPED: OnceLock<Mutex<HashMap<String, (Scraped, Reader)>>> = OnceLock::new();

/// One of their stats read when sent rather than counted (a gauge, or a
/// running total kept elsewhere): at each statsd flush, and into its
/// Prometheus series at each scrape ([`refresh`]). A later stat of the
/// same name replaces it.
pub fn read_when_sent(name: &str, reading: Reading, read: Reader) {
    statsd::read_when_sent(name, reading, read.clone());
    let kind = match reading {
        Reading::Gauge => StatKind::Gauge,
        Reading::Total => StatKind::Counter,
    };
    let Some(series) = stat_mapper::installed().map(name, kind) else {
        return;
    };
    let scraped = match reading {
        Reading::Gauge => Scraped::Gauge(metrics::gauge!(series.name, labels(series.labels))),
        Reading::Total => Scraped::Total(metrics::counter!(series.name, labels(series.labels))),
    };
    let mut all = SCRAPED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    all.insert(name.to_owned(), (scraped, read));
}

/// Reads the stats read when sent into their Prometheus series: called
/// before each scrape's rendering.
pub fn refresh() {
    let Some(all) = SCRAPED.get() else {
        return;
    };
    let all = all.lock().unwrap_or_else(|p| p.into_inner());
    for (scraped, read) in all.values() {
        match scraped {
            Scraped::Gauge(gauge) => gauge.set(read() as f64),
            Scraped::Total(counter) => counter.absolute(read()),
        }
    }
}

fn labels(pairs: Vec<(String, String)>) -> Vec<metrics::Label> {
    let pairs = pairs.into_iter();
    pairs.map(|(k, v)| metrics::Label::new(k, v)).collect()
}

/// Counts a request `SHADOW_MODE` let through although over a limit
/// (`ratelimit.service.global_shadow_mode`).
pub fn global_shadow_mode() {
    static COUNTER: OnceLock<TheirCounter> = OnceLock::new();
    COUNTER
        .get_or_init(|| TheirCounter::new("ratelimit.service.global_shadow_mode"))
        .add(1);
}
