//! What a run reports: a human summary, then, as the last line, one JSON
//! object for scripts (`bench/run.sh`, `bench/ab.sh`, `bench/report.py`
//! read its fields by name).

use hdrhistogram::Histogram;
use serde::{Serialize, Serializer};

use crate::args::Args;
use crate::run::Summary;

/// A run's results: the JSON line's fields, in its order.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub label: String,
    /// `closed` or `open`.
    pub mode: &'static str,
    /// What one operation is (`--mode`): `rls` or `budget` (a Reserve and
    /// a Settle, counted as one request).
    pub call: &'static str,
    /// Open loop: requests per second (0 for a closed loop).
    pub rate: f64,
    pub concurrency: usize,
    pub connections: usize,
    pub keys: String,
    pub descriptors: usize,
    pub domain: String,
    /// Measured seconds.
    #[serde(serialize_with = "decimals::<3, _>")]
    pub seconds: f64,
    /// Measured requests: answered, or failed.
    pub requests: u64,
    #[serde(serialize_with = "decimals::<1, _>")]
    pub rps: f64,
    pub ok: u64,
    pub over_limit: u64,
    /// Answers whose overall code is neither OK nor OVER_LIMIT.
    pub unknown: u64,
    pub errors: u64,
    /// Open loop: requests still unsent when the run was cut off.
    pub unsent: u64,
    /// Latency of answered calls (open loop: from the intended send time).
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
    /// Open loop: how late sends were against their due times.
    pub send_lag_p99_us: u64,
    /// Open loop: latency from the actual send.
    pub sent_p50_us: u64,
    pub sent_p99_us: u64,
    /// Calls made, warm-up included.
    pub calls: u64,
    /// The generator's own CPU per call, where `/proc` tells.
    #[serde(serialize_with = "decimals_or_null::<2, _>")]
    pub client_cpu_us_per_req: Option<f64>,
    /// Not in the JSON line: the summary's warm-up seconds, and the first
    /// error's text (for stderr).
    #[serde(skip)]
    pub warmup: f64,
    #[serde(skip)]
    pub first_error: Option<String>,
}

impl Report {
    /// The report of a run of `args` that measured `summary`.
    pub fn new(args: &Args, summary: &Summary) -> Self {
        let t = &summary.tally;
        let seconds = summary.measured.as_secs_f64().max(1e-9);
        let requests = t.requests();
        Report {
            label: args.label.clone(),
            mode: if args.rate.is_some() {
                "open"
            } else {
                "closed"
            },
            call: args.mode.name(),
            rate: args.rate.unwrap_or(0.0),
            concurrency: args.concurrency,
            connections: args.connections,
            keys: args.keys.clone(),
            descriptors: args.descriptors,
            domain: args.domain.clone(),
            seconds,
            requests,
            rps: requests as f64 / seconds,
            ok: t.ok,
            over_limit: t.over_limit,
            unknown: t.unknown,
            errors: t.errors,
            unsent: t.unsent,
            p50_us: quantile(&t.latency, 0.5),
            p90_us: quantile(&t.latency, 0.9),
            p99_us: quantile(&t.latency, 0.99),
            p999_us: quantile(&t.latency, 0.999),
            max_us: t.latency.max(),
            send_lag_p99_us: quantile(&t.send_lag, 0.99),
            sent_p50_us: quantile(&t.from_send, 0.5),
            sent_p99_us: quantile(&t.from_send, 0.99),
            calls: t.calls,
            client_cpu_us_per_req: summary
                .cpu
                .map(|cpu| cpu.as_secs_f64() * 1e6 / (t.calls.max(1) as f64)),
            warmup: args.warmup,
            first_error: t.first_error.clone(),
        }
    }

    /// The JSON line.
    pub fn json(&self) -> serde_json::Result<String> {
        serde_json::to_string(self)
    }

    /// The human summary, line by line.
    pub fn summary(&self) -> Vec<String> {
        let open = self.mode == "open";
        let mode = if open {
            format!(
                "open loop at {} req/s, up to {} in flight",
                self.rate, self.concurrency
            )
        } else {
            format!("closed loop, {} in flight", self.concurrency)
        };
        let unsent = if self.unsent > 0 {
            format!("  unsent {}", self.unsent)
        } else {
            String::new()
        };
        let mut lines = vec![
            format!(
                "ratekeeper-bench: {mode} over {} connection(s); keys {}, {} descriptor(s), domain {}; {:.1} s measured after {:.1} s warm-up{}",
                self.connections, self.keys, self.descriptors, self.domain, self.seconds, self.warmup,
                if self.call == "budget" { "; a request is a Reserve and a Settle" } else { "" }
            ),
            format!(
                "requests {} ({:.0} req/s)  ok {}  over_limit {}  unknown {}  errors {}{unsent}",
                self.requests, self.rps, self.ok, self.over_limit, self.unknown, self.errors
            ),
            format!(
                "latency us{}: p50 {}  p90 {}  p99 {}  p99.9 {}  max {}",
                if open { " (from intended send time)" } else { "" },
                self.p50_us,
                self.p90_us,
                self.p99_us,
                self.p999_us,
                self.max_us
            ),
        ];
        if open {
            lines.push(format!(
                "generator send lag us: p99 {}; latency from the actual send us: p50 {}  p99 {}",
                self.send_lag_p99_us, self.sent_p50_us, self.sent_p99_us
            ));
        }
        if let Some(cpu) = self.client_cpu_us_per_req {
            lines.push(format!("generator cpu: {cpu:.1} us/request"));
        }
        lines
    }
}

/// `h`'s value at quantile `p`, 0 when it is empty.
fn quantile(h: &Histogram<u64>, p: f64) -> u64 {
    if h.is_empty() {
        0
    } else {
        h.value_at_quantile(p)
    }
}

/// Writes `x` rounded to `D` decimals: the line stays short to read.
fn decimals<const D: i32, S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
    let scale = 10f64.powi(D);
    s.serialize_f64((x * scale).round() / scale)
}

fn decimals_or_null<const D: i32, S: Serializer>(x: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match x {
        Some(x) => decimals::<D, S>(x, s),
        None => s.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::Parser;

    use super::*;
    use crate::tally::Tally;

    fn report(flags: &[&str], cpu: Option<Duration>) -> Report {
        let args = Args::parse_from(std::iter::once("bench").chain(flags.iter().copied()));
        let mut tally = Tally::new();
        tally.ok = 3;
        tally.over_limit = 1;
        tally.calls = 4;
        let _ = tally.latency.record(250);
        let summary = Summary {
            tally,
            measured: Duration::from_millis(2_000),
            cpu,
        };
        Report::new(&args, &summary)
    }

    #[test]
    fn the_json_line_has_the_fields_scripts_read_in_order() {
        let line = report(&["--label", "a \"b\"\n"], Some(Duration::from_millis(10)))
            .json()
            .unwrap();
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        let keys: Vec<&str> = value
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        // What the hand-written line had, in its order (serde_json keeps a
        // map's keys sorted, so compare as sets and check the order in text).
        let expected = [
            "label",
            "mode",
            "call",
            "rate",
            "concurrency",
            "connections",
            "keys",
            "descriptors",
            "domain",
            "seconds",
            "requests",
            "rps",
            "ok",
            "over_limit",
            "unknown",
            "errors",
            "unsent",
            "p50_us",
            "p90_us",
            "p99_us",
            "p999_us",
            "max_us",
            "send_lag_p99_us",
            "sent_p50_us",
            "sent_p99_us",
            "calls",
            "client_cpu_us_per_req",
        ];
        let mut sorted = expected.to_vec();
        sorted.sort();
        assert_eq!(keys, sorted);
        let positions: Vec<usize> = expected
            .iter()
            .map(|k| line.find(&format!("\"{k}\":")).unwrap())
            .collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{line}");
        assert_eq!(value["label"], "a \"b\"\n");
        assert_eq!(value["mode"], "closed");
        assert_eq!(value["requests"], 4);
        assert_eq!(value["rps"], 2.0);
        assert_eq!(value["p50_us"], 250);
        assert_eq!(value["client_cpu_us_per_req"], 2500.0);
    }

    #[test]
    fn without_cpu_figures_the_cpu_field_is_null() {
        let line = report(&["--rate", "100"], None).json().unwrap();
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["mode"], "open");
        assert_eq!(value["rate"], 100.0);
        assert!(value["client_cpu_us_per_req"].is_null());
    }
}
