//! Logs (tracing) and the metrics recorder (Prometheus). The rendered text
//! is served by [`crate::http::metrics`] from a listener we bind ourselves
//! (the exporter's own cannot report the port it bound; tests use port 0).

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::their_stats;
use crate::{Error, Result};

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Installs the global tracing subscriber. `level` is an `EnvFilter`
/// directive such as `info` or `ratekeeper=debug`.
pub fn init_logging(level: &str, format: LogFormat) -> Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .map_err(|e| Error::Startup(format!("bad log level {level:?}: {e}")))?;
    use std::io::IsTerminal;
    let terminal = std::io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(terminal)
        .with_writer(std::io::stderr);
    // Text on a terminal is for a person (logrus colours it there too);
    // elsewhere, logrus' logfmt, which log pipelines parse.
    let installed = match format {
        LogFormat::Text if terminal => builder.try_init(),
        LogFormat::Text => builder.event_format(crate::logrus::Their::Text).try_init(),
        LogFormat::Json => builder.event_format(crate::logrus::Their::Json).try_init(),
    };
    installed.map_err(|e| Error::Startup(format!("cannot install the logger: {e}")))
}

/// Installs the global Prometheus recorder, after the stat mapping (whose
/// response-time series gets latency buckets in its unit).
pub fn install_recorder() -> Result<PrometheusHandle> {
    const LATENCY_BUCKETS: &[f64] = &[
        0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
        1.0,
    ];
    // statsd_exporter's buckets for a histogram its mapping gives none
    // (Prometheus' DefBuckets), which envoyproxy/ratelimit's series have.
    const THEIR_BUCKETS: &[f64] = &[
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ];
    let response_time = their_stats::response_time(their_stats::SHOULD_RATE_LIMIT);
    let (response_time, buckets) = match their_stats::timer_series(&response_time) {
        Some(series) => {
            // Theirs, so every `le` a dashboard or alert of theirs names is
            // there, and ours in the mapping's unit (it scales milliseconds:
            // seconds × 1000 × scale) for the sub-millisecond latencies.
            let scaled = LATENCY_BUCKETS.iter().map(|s| s * 1000.0 * series.scale);
            let buckets = series
                .buckets
                .unwrap_or_else(|| union(THEIR_BUCKETS.iter().copied().chain(scaled)));
            (series.name, buckets)
        }
        None => (String::new(), LATENCY_BUCKETS.to_vec()),
    };
    PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("ratekeeper_request_duration_seconds".into()),
            LATENCY_BUCKETS,
        )
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(response_time), &buckets))
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("ratekeeper_store_call_duration_seconds".into()),
                LATENCY_BUCKETS,
            )
        })
        .and_then(|b| b.install_recorder())
        .inspect(|_| crate::metric_help::describe())
        .map_err(|e| Error::Startup(format!("cannot install the metrics recorder: {e}")))
}

/// Bucket bounds in order, each once (bounds that differ by rounding alone,
/// as 0.1 scaled from 0.0001 s to ms, count as one).
fn union(bounds: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut all: Vec<f64> = bounds.collect();
    all.sort_by(f64::total_cmp);
    all.dedup_by(|b, a| (*b - *a).abs() <= a.abs() * 1e-9);
    all
}

#[cfg(test)]
mod tests {
    use super::union;

    #[test]
    fn bucket_bounds_merge_in_order_each_once() {
        let merged = union([0.5, 0.005, 10.0, 0.005_000_000_000_1, 0.000_05].into_iter());
        assert_eq!(merged, vec![0.000_05, 0.005, 0.5, 10.0]);
    }
}
