//! The load generator, `ratekeeper-bench` (the crate in bench/), against an
//! in-process server: whatever the split over threads, connections and
//! tasks, every request it counts was sent once and answered once, closed
//! loop and open loop. It runs here, through the generator's library, because
//! the server is the witness and its test harness is in this package.

mod common;

use std::sync::Arc;

use clap::Parser;
use common::TestServer;
use ratekeeper::clock::SystemClock;
use ratekeeper::store::memory::MemoryStore;
use ratekeeper::store::Store;
use ratekeeper_bench::{Args, Report};

// `hot` admits a burst of 100 and then one request per 864 s: a token
// bucket has no window boundary for a run to straddle.
const LIMITS: &str = "domain: gen\ndescriptors:\n  - key: user_id\n    value: hot\n    rate_limit: {unit: day, requests_per_unit: 100, algorithm: token_bucket}\n  - key: user_id\n    rate_limit: {unit: hour, requests_per_unit: 1000000000}\n";

/// Runs the generator against `server` as its command line would; its report.
async fn generate(server: &TestServer, flags: &[&str]) -> Report {
    let mut command_line = vec![
        "ratekeeper-bench".to_owned(),
        "--addr".to_owned(),
        server.addr.to_string(),
        "--domain".to_owned(),
        "gen".to_owned(),
        "--warmup".to_owned(),
        "0".to_owned(),
    ];
    command_line.extend(flags.iter().map(|f| f.to_string()));
    let args = Args::parse_from(command_line);
    // The generator runs its own threads and runtimes: off this runtime.
    tokio::task::spawn_blocking(move || {
        let dist = args.validate().expect("valid flags");
        let summary = ratekeeper_bench::run(&args, dist).expect("ratekeeper-bench run");
        Report::new(&args, &summary)
    })
    .await
    .expect("generator thread")
}

async fn server() -> TestServer {
    let store = Store::Memory(MemoryStore::new(Arc::new(SystemClock)));
    let server = TestServer::start(&[LIMITS], store).await;
    server.serving().await;
    server
}

#[tokio::test]
async fn closed_loop_sends_its_budget_exactly_once_over_threads() {
    let server = server().await;
    // One key limited to 100: the server's answers show how many requests
    // reached it, however they were dealt to threads and connections.
    let report = generate(
        &server,
        &[
            "--keys",
            "hot",
            "--requests",
            "150",
            "--threads",
            "2",
            "--connections",
            "3",
            "--concurrency",
            "5",
        ],
    )
    .await;
    assert_eq!(report.calls, 150, "{report:?}");
    assert_eq!(report.ok, 100, "{report:?}");
    assert_eq!(report.over_limit, 50, "{report:?}");
    assert_eq!(report.errors, 0, "{report:?}");
    server.stop().await;
}

#[tokio::test]
async fn budget_mode_reserves_then_settles_each_operation() {
    let server = server().await;
    // `hot` holds 100. Reserving 10 and settling at 1 costs 1 an operation:
    // all 15 fit, and only because each Settle gave 9 back.
    let cheap = ["--mode", "budget", "--estimate", "10", "--actual", "1"];
    let flags = [
        &cheap[..],
        &["--keys", "hot", "--requests", "15", "--concurrency", "3"],
    ]
    .concat();
    let report = generate(&server, &flags).await;
    assert_eq!(
        (report.ok, report.over_limit, report.errors),
        (15, 0, 0),
        "{report:?}"
    );
    assert_eq!(report.call, "budget");
    // 85 left; settled at the estimate, 8 reservations of 10 fit, 7 are refused.
    let full = ["--mode", "budget", "--estimate", "10", "--actual", "10"];
    let flags = [
        &full[..],
        &["--keys", "hot", "--requests", "15", "--concurrency", "3"],
    ]
    .concat();
    let report = generate(&server, &flags).await;
    assert_eq!(
        (report.ok, report.over_limit, report.errors),
        (8, 7, 0),
        "{report:?}"
    );
    server.stop().await;
}

#[tokio::test]
async fn open_loop_threads_share_the_schedule() {
    let server = server().await;
    // 2,000 requests/s for 0.5 s: 1,000 due, half on each thread's schedule.
    let report = generate(
        &server,
        &[
            "--keys",
            "distinct",
            "--rate",
            "2000",
            "--duration",
            "0.5",
            "--threads",
            "2",
            "--connections",
            "2",
            "--concurrency",
            "16",
        ],
    )
    .await;
    // Every due request sent, none lost at the end of a thread's schedule.
    assert_eq!(report.calls, 1000, "{report:?}");
    assert_eq!(report.ok, 1000, "{report:?}");
    assert_eq!(report.unsent, 0, "{report:?}");
    assert_eq!(report.errors, 0, "{report:?}");
    server.stop().await;
}

// The soak load's domains: audit values admit 3 a minute; one lease user
// holds at most 1 lease.
const SOAK_LIMITS: [&str; 3] = [
    "domain: soak\ndescriptors:\n  - key: user_id\n    value: hot\n    rate_limit: {unit: second, requests_per_unit: 5}\n  - key: user_id\n    rate_limit: {unit: hour, requests_per_unit: 1000000}\n",
    "domain: soak_audit\ndescriptors:\n  - key: user_id\n    rate_limit: {unit: minute, requests_per_unit: 3}\n",
    "domain: soak_lease\nconcurrency:\n  - key: user_id\n    max_connections: 1\n    lease_ttl: 3s\n",
];

#[tokio::test]
async fn soak_load_counts_each_call_once_and_audits_admissions_per_window() {
    use ratekeeper_bench::soak::{self, SoakArgs};

    let store = Store::Memory(MemoryStore::new(Arc::new(SystemClock)));
    let server = TestServer::start(&SOAK_LIMITS, store).await;
    server.serving().await;
    let addr = server.addr.to_string();
    let args = SoakArgs::parse_from([
        "ratekeeper-soak",
        "--addr",
        &addr,
        "--addr",
        &addr,
        "--duration",
        "2",
        "--distinct-rate",
        "50",
        "--hot-rate",
        "50",
        "--audit-rate",
        "20",
        "--audit-keys",
        "2",
        "--lease-clients",
        "4",
        "--lease-users",
        "1",
        "--heartbeat-ms",
        "100",
        "--deadline-ms",
        "1000",
    ]);
    args.validate().expect("valid flags");
    let record = tokio::task::spawn_blocking(move || soak::run(&args))
        .await
        .expect("soak thread")
        .expect("soak run");
    let total = record.timeline.total();
    assert_eq!(total.errors + total.lease_errors, 0, "{:?}", record.errors);
    // Every due call sent and counted once: 100 + 100 + 40 ticks in 2 s (the
    // last one may fall just past the end).
    let calls = total.store_ok + total.store_over + total.skipped;
    assert!((237..=240).contains(&calls), "{total:?}");
    assert_eq!(total.without_store, 0, "the in-memory store always answers");
    // The one lease user is contended by four clients.
    assert!(
        total.lease_granted > 0 && total.lease_refused > 0,
        "{total:?}"
    );
    // Audit admissions: all decided by the store, each naming its window,
    // at most the limit per value and window, and the limit reached.
    let mut per_window = std::collections::BTreeMap::new();
    for a in &record.admissions {
        assert!(a.from_store, "{a:?}");
        let end = a.window_end_ms.expect("an admission names its window");
        let window = (end + 30_000) / 60_000;
        *per_window.entry((a.value.clone(), window)).or_insert(0) += 1;
    }
    assert!(per_window.values().all(|&n| n <= 3), "{per_window:?}");
    for value in ["a0", "a1"] {
        let admitted: u32 = per_window
            .iter()
            .filter(|((v, _), _)| v == value)
            .map(|(_, n)| n)
            .sum();
        assert!(admitted >= 3, "{value}: {per_window:?}");
    }
    server.stop().await;
}
