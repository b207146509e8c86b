//! The soak run's command line (`ratekeeper-soak`): the replicas, how long,
//! the rate of each kind of load, the deadline, and where the per-second
//! timeline and the audit answers are written.

use std::path::PathBuf;

use clap::Parser;

/// Command-line options of a soak run.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "ratekeeper-soak",
    about = "Mixed, long-running load on ratekeeper replicas: ShouldRateLimit on distinct, \
             hot and audit keys, and lease acquire/heartbeat/release churn"
)]
pub struct SoakArgs {
    /// A replica's gRPC address (`host:port`); repeat for each replica. Each
    /// call goes to a replica picked at random.
    #[arg(long = "addr", required = true)]
    pub addrs: Vec<String>,
    /// Seconds of load.
    #[arg(long, default_value_t = 600.0)]
    pub duration: f64,
    /// ShouldRateLimit per second on values never used before (domain
    /// `--domain`, one counter each).
    #[arg(long, default_value_t = 200.0)]
    pub distinct_rate: f64,
    /// ShouldRateLimit per second on the one value `hot` (domain `--domain`).
    #[arg(long, default_value_t = 100.0)]
    pub hot_rate: f64,
    /// ShouldRateLimit per second on the audit values `a0`..`a{K-1}` (domain
    /// `--audit-domain`), whose admitted answers are written out one by one.
    #[arg(long, default_value_t = 20.0)]
    pub audit_rate: f64,
    /// K, the number of audit values.
    #[arg(long, default_value_t = 4)]
    pub audit_keys: u64,
    /// Lease clients, each looping acquire → heartbeats → release.
    #[arg(long, default_value_t = 8)]
    pub lease_clients: usize,
    /// Lease users `u0`..`u{U-1}` (domain `--lease-domain`) the clients pick from.
    #[arg(long, default_value_t = 4)]
    pub lease_users: u64,
    /// Milliseconds between a held lease's heartbeats.
    #[arg(long, default_value_t = 500)]
    pub heartbeat_ms: u64,
    /// An answer later than this many ms after its send is counted late (and
    /// the server is told the deadline as `grpc-timeout`).
    #[arg(long, default_value_t = 100)]
    pub deadline_ms: u64,
    /// A call unanswered this many ms after its send is given up (an error,
    /// and late).
    #[arg(long, default_value_t = 2_000)]
    pub timeout_ms: u64,
    /// ShouldRateLimit calls in flight at most; a due call beyond that is
    /// skipped and counted.
    #[arg(long, default_value_t = 512)]
    pub max_in_flight: usize,
    /// Domain of the distinct and hot values.
    #[arg(long, default_value = "soak")]
    pub domain: String,
    #[arg(long, default_value = "soak_audit")]
    pub audit_domain: String,
    #[arg(long, default_value = "soak_lease")]
    pub lease_domain: String,
    /// The one descriptor entry's key, in every domain.
    #[arg(long, default_value = "user_id")]
    pub key: String,
    /// Writes one JSON object per second and replica (counts by outcome).
    #[arg(long)]
    pub timeline_out: Option<PathBuf>,
    /// Writes every admitted audit answer, one JSON object per line.
    #[arg(long)]
    pub audit_out: Option<PathBuf>,
}

impl SoakArgs {
    /// Checks the numbers a run needs in range.
    pub fn validate(&self) -> Result<(), String> {
        let rates = [self.distinct_rate, self.hot_rate, self.audit_rate];
        if !(self.duration.is_finite() && self.duration > 0.0) {
            return Err("--duration must be > 0".to_owned());
        }
        if rates.iter().any(|r| !(r.is_finite() && *r >= 0.0)) {
            return Err("--distinct-rate, --hot-rate and --audit-rate must be >= 0".to_owned());
        }
        if self.audit_keys == 0 || self.lease_users == 0 {
            return Err("--audit-keys and --lease-users must be > 0".to_owned());
        }
        if self.deadline_ms == 0 || self.timeout_ms < self.deadline_ms || self.heartbeat_ms == 0 {
            return Err(
                "--deadline-ms and --heartbeat-ms must be > 0, --timeout-ms >= --deadline-ms"
                    .to_owned(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_counts_and_deadlines_are_checked() {
        let parse = |flags: &[&str]| {
            SoakArgs::parse_from(["soak", "--addr", "x:1"].iter().chain(flags)).validate()
        };
        assert!(parse(&[]).is_ok());
        assert!(parse(&["--duration", "0"]).is_err());
        assert!(parse(&["--hot-rate", "NaN"]).is_err());
        assert!(parse(&["--audit-keys", "0"]).is_err());
        assert!(parse(&["--deadline-ms", "300", "--timeout-ms", "200"]).is_err());
        assert!(
            SoakArgs::try_parse_from(["soak"]).is_err(),
            "--addr is required"
        );
    }
}
