//! What a task counted: answers by code, errors, and latency histograms;
//! merged across tasks and threads at the end of a run.

use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use hdrhistogram::Histogram;

/// The overall code of an answer, or the error's text.
pub type CallResult = Result<i32, String>;

/// Counts and latencies gathered by one task, merged at the end.
pub struct Tally {
    /// Latency of answered calls, µs.
    pub latency: Histogram<u64>,
    /// Open loop: how late each send was against its intended time, µs.
    pub send_lag: Histogram<u64>,
    /// Open loop: latency from the actual send (what the server and the
    /// network took, without the generator's own lag), µs.
    pub from_send: Histogram<u64>,
    pub ok: u64,
    pub over_limit: u64,
    /// Answers whose overall code is neither OK nor OVER_LIMIT.
    pub unknown: u64,
    pub errors: u64,
    /// Open loop: requests still unsent when the run was cut off.
    pub unsent: u64,
    /// Calls made, warm-up included (for CPU per call).
    pub calls: u64,
    pub first_error: Option<String>,
}

impl Tally {
    pub fn new() -> Self {
        let histogram = || {
            // Bounds are constants that hdrhistogram accepts.
            Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
        };
        Tally {
            latency: histogram(),
            send_lag: histogram(),
            from_send: histogram(),
            ok: 0,
            over_limit: 0,
            unknown: 0,
            errors: 0,
            unsent: 0,
            calls: 0,
            first_error: None,
        }
    }

    /// Records one call's outcome and latency.
    pub fn record(&mut self, result: &CallResult, latency: Duration) {
        match result {
            Ok(code) => {
                self.latency.saturating_record(micros(latency));
                match Code::try_from(*code) {
                    Ok(Code::Ok) => self.ok += 1,
                    Ok(Code::OverLimit) => self.over_limit += 1,
                    _ => self.unknown += 1,
                }
            }
            Err(message) => {
                self.errors += 1;
                if self.first_error.is_none() {
                    self.first_error = Some(message.clone());
                }
            }
        }
    }

    pub fn merge(&mut self, other: Tally) {
        // Same bounds on both sides: adding cannot fail.
        let _ = self.latency.add(&other.latency);
        let _ = self.send_lag.add(&other.send_lag);
        let _ = self.from_send.add(&other.from_send);
        self.ok += other.ok;
        self.over_limit += other.over_limit;
        self.unknown += other.unknown;
        self.errors += other.errors;
        self.unsent += other.unsent;
        self.calls += other.calls;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }

    /// Measured requests: answered, or failed.
    pub fn requests(&self) -> u64 {
        self.ok + self.over_limit + self.unknown + self.errors
    }
}

impl Default for Tally {
    fn default() -> Self {
        Tally::new()
    }
}

/// A duration in whole µs, at least 1 (the histograms' lowest value).
pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}
