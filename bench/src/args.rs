//! The command line: every option of a run, and the checks that turn it
//! into one (`--keys` parsed, the numbers in range).

use std::path::PathBuf;

use clap::Parser;

use crate::call::Mode;
use crate::keys::KeyDist;

/// Command-line options.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "ratekeeper-bench",
    about = "Load generator for Envoy rate limit service v3 servers"
)]
pub struct Args {
    /// Server address (`http://host:port` or `host:port`).
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    pub addr: String,
    /// Requests in flight (closed loop), or sending tasks, i.e. the most
    /// requests in flight (open loop).
    #[arg(long, default_value_t = 256)]
    pub concurrency: usize,
    /// Open loop: requests per second, measured from intended send times.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Measured seconds (after the warm-up).
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Seconds of load before measuring.
    #[arg(long, default_value_t = 1.0)]
    pub warmup: f64,
    /// Stop after this many requests in all (closed loop; warm-up included).
    #[arg(long)]
    pub requests: Option<u64>,
    /// HTTP/2 connections the requests are spread over.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Descriptor values: `distinct` (a new one per request), `uniform:K`,
    /// `hot` (one value), `zipf:K:S` (K values, exponent S).
    #[arg(long, default_value = "distinct")]
    pub keys: String,
    /// Descriptors per request (descriptor i > 0 gets the value suffix `.i`).
    #[arg(long, default_value_t = 1)]
    pub descriptors: usize,
    /// The request's domain.
    #[arg(long, default_value = "bench")]
    pub domain: String,
    /// The key of each descriptor's one entry.
    #[arg(long, default_value = "user_id")]
    pub key: String,
    /// Generator threads, each with its own runtime, connections and share
    /// of the tasks and of the rate (no more than `--connections`).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Open loop: each thread's pacer wakes at most once per this many µs and
    /// releases every request due by then (fewer wake-ups, at most this much
    /// lag).
    #[arg(long, default_value_t = 100)]
    pub pace_us: u64,
    /// Per-call deadline in milliseconds (a call past it counts as an error).
    #[arg(long, default_value_t = 5_000)]
    pub timeout_ms: u64,
    /// What one operation is: `rls` (a ShouldRateLimit call) or `budget` (a
    /// BudgetService Reserve of --estimate, then a Settle of it at --actual,
    /// on the same descriptors; the pair counts as one operation).
    #[arg(long, value_enum, default_value_t = Mode::Rls)]
    pub mode: Mode,
    /// `--mode budget`: hits each Reserve asks for (> 0).
    #[arg(long, default_value_t = 100)]
    pub estimate: u64,
    /// `--mode budget`: hits each Settle says were used.
    #[arg(long, default_value_t = 60)]
    pub actual: u64,
    /// Free text copied into the JSON line.
    #[arg(long, default_value = "")]
    pub label: String,
    /// Write the first request, gRPC-framed, to this file and exit.
    #[arg(long)]
    pub write_request: Option<PathBuf>,
}

impl Args {
    /// Checks the options a run needs in range and parses `--keys`.
    pub fn validate(&self) -> Result<KeyDist, String> {
        let dist = KeyDist::parse(&self.keys)?;
        if self.rate.is_some_and(|r| !(r.is_finite() && r > 0.0))
            || !(self.duration.is_finite() && self.duration > 0.0)
            || !(self.warmup.is_finite() && self.warmup >= 0.0)
        {
            return Err("--rate and --duration must be > 0, --warmup >= 0".to_owned());
        }
        if self.estimate == 0 {
            return Err("--estimate must be > 0".to_owned());
        }
        Ok(dist)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_durations_and_key_distributions_are_checked() {
        let parse = |flags: &[&str]| {
            Args::parse_from(std::iter::once("bench").chain(flags.iter().copied())).validate()
        };
        assert_eq!(parse(&["--keys", "hot"]), Ok(KeyDist::Hot));
        assert!(parse(&["--keys", "random"]).is_err());
        assert!(parse(&["--rate", "0"]).is_err());
        assert!(parse(&["--rate", "NaN"]).is_err());
        assert!(parse(&["--duration", "0"]).is_err());
        assert!(parse(&["--warmup=-1"]).is_err());
        assert!(parse(&["--warmup", "0", "--rate", "10"]).is_ok());
        assert!(parse(&["--mode", "budget", "--estimate", "0"]).is_err());
        assert!(parse(&["--mode", "budget", "--estimate", "5", "--actual", "9"]).is_ok());
    }
}
