//! The soak run (`ratekeeper-soak`, driven by `bench/soak.sh` and `make
//! soak`): long, mixed load on several ratekeeper replicas sharing one
//! store, recorded so that what the harness does to Redis meanwhile (kill,
//! restart, failover) can be read off afterwards.
//!
//! - [`args`]: the command line.
//! - [`rls`]: ShouldRateLimit streams on distinct, hot and audit values.
//! - [`leases`]: lease acquire/heartbeat/release churn, over [`lease_api`].
//! - [`recorder`]: where the tasks put what they saw: the [`timeline`]
//!   (per second and replica) and the [`audit`] admissions.
//!
//! It reports counts, not verdicts: `bench/soak_report.py` holds them against
//! the harness's event times.

pub mod args;
pub mod audit;
pub mod lease_api;
pub mod leases;
pub mod recorder;
pub mod rls;
pub mod timeline;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

use crate::keys::{KeyDist, KeySpace};
use crate::run::connect;
pub use args::SoakArgs;
use audit::Admission;
use lease_api::ConcurrencyClient;
use recorder::Recorder;
use rls::Stream;
use timeline::Timeline;

/// What every task of a run shares.
pub struct Soak {
    pub args: SoakArgs,
    /// One client per replica, in `--addr` order (both over one channel).
    pub rls: Vec<RateLimitServiceClient<Channel>>,
    pub leases: Vec<ConcurrencyClient>,
    /// Values never used before, for the distinct stream.
    pub keys: KeySpace,
    /// ShouldRateLimit calls sent and not yet recorded.
    pub in_flight: AtomicUsize,
    /// No call is started after this.
    pub end: Instant,
    pub recorder: Recorder,
}

/// What a run recorded.
pub struct SoakRecord {
    pub timeline: Timeline,
    pub admissions: Vec<Admission>,
    /// The first few distinct error texts.
    pub errors: Vec<String>,
}

/// Runs the soak load described by `args` to its end.
pub fn run(args: &SoakArgs) -> Result<SoakRecord, String> {
    // Two workers: an answer is read when it arrives even while another
    // task is busy, so latencies are the server's, not the generator's.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    runtime.block_on(soak(args))
}

async fn soak(args: &SoakArgs) -> Result<SoakRecord, String> {
    let mut rls = Vec::new();
    let mut leases = Vec::new();
    for addr in &args.addrs {
        let channels = connect(addr, 1).await?;
        let channel = channels
            .into_iter()
            .next()
            .ok_or_else(|| format!("no channel to {addr}"))?;
        rls.push(RateLimitServiceClient::new(channel.clone()));
        leases.push(ConcurrencyClient::new(channel));
    }
    let soak = Arc::new(Soak {
        args: args.clone(),
        rls,
        leases,
        keys: KeySpace::new(KeyDist::Distinct),
        in_flight: AtomicUsize::new(0),
        end: Instant::now() + Duration::from_secs_f64(args.duration),
        recorder: Recorder::default(),
    });
    let streams = [
        (Stream::Distinct, args.distinct_rate),
        (Stream::Hot, args.hot_rate),
        (Stream::Audit, args.audit_rate),
    ];
    let mut tasks = Vec::new();
    for (i, (stream, rate)) in streams.into_iter().enumerate() {
        let seed = 0x50A4 ^ ((i as u64) << 32);
        tasks.push(tokio::spawn(rls::run_stream(
            soak.clone(),
            stream,
            rate,
            seed,
        )));
    }
    for index in 0..args.lease_clients {
        let seed = 0x1EA5E ^ ((index as u64) << 24);
        tasks.push(tokio::spawn(leases::run_client(soak.clone(), index, seed)));
    }
    for task in tasks {
        task.await.map_err(|e| format!("a load task failed: {e}"))?;
    }
    // Calls still in flight end by their timeout at the latest; each holds
    // a reference to the run until it has recorded its answer.
    let drained = Instant::now() + Duration::from_millis(args.timeout_ms + 1_000);
    while (soak.in_flight.load(Ordering::Relaxed) > 0 || Arc::strong_count(&soak) > 1)
        && Instant::now() < drained
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let soak = Arc::try_unwrap(soak)
        .map_err(|_| "calls still unanswered after their timeout".to_owned())?;
    let (timeline, admissions, errors) = soak.recorder.finish();
    Ok(SoakRecord {
        timeline,
        admissions,
        errors,
    })
}
