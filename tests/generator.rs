//! The load generator, `ratekeeper-bench`, against an in-process server:
//! whatever the split over threads, connections and tasks, every request it
//! counts was sent once and answered once, closed loop and open loop.

mod common;

use std::process::Command;
use std::sync::Arc;

use common::TestServer;
use ratekeeper::clock::SystemClock;
use ratekeeper::store::memory::MemoryStore;
use ratekeeper::store::Store;

// `hot` admits a burst of 100 and then one request per 864 s: a token
// bucket has no window boundary for a run to straddle.
const LIMITS: &str = "domain: gen\ndescriptors:\n  - key: user_id\n    value: hot\n    rate_limit: {unit: day, requests_per_unit: 100, algorithm: token_bucket}\n  - key: user_id\n    rate_limit: {unit: hour, requests_per_unit: 1000000000}\n";

/// Runs the generator against `server` and returns its JSON line.
async fn generate(server: &TestServer, flags: &[&str]) -> String {
    let mut args = vec![
        "--addr".to_owned(),
        server.addr.to_string(),
        "--domain".to_owned(),
        "gen".to_owned(),
        "--warmup".to_owned(),
        "0".to_owned(),
    ];
    args.extend(flags.iter().map(|f| f.to_string()));
    let output = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_ratekeeper-bench"))
            .args(&args)
            .output()
            .expect("run ratekeeper-bench")
    })
    .await
    .expect("generator thread");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "ratekeeper-bench failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout.lines().last().expect("a JSON line").to_owned()
}

/// A number field of the generator's JSON line.
fn field(json: &str, name: &str) -> u64 {
    let key = format!("\"{name}\":");
    let start = json
        .find(&key)
        .unwrap_or_else(|| panic!("{name} in {json}"))
        + key.len();
    let digits: String = json[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("{name} in {json}"))
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
    let line = generate(
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
    assert_eq!(field(&line, "calls"), 150, "{line}");
    assert_eq!(field(&line, "ok"), 100, "{line}");
    assert_eq!(field(&line, "over_limit"), 50, "{line}");
    assert_eq!(field(&line, "errors"), 0, "{line}");
    server.stop().await;
}

#[tokio::test]
async fn open_loop_threads_share_the_schedule() {
    let server = server().await;
    // 2,000 requests/s for 0.5 s: 1,000 due, half on each thread's schedule.
    let line = generate(
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
    assert_eq!(field(&line, "calls"), 1000, "{line}");
    assert_eq!(field(&line, "ok"), 1000, "{line}");
    assert_eq!(field(&line, "unsent"), 0, "{line}");
    assert_eq!(field(&line, "errors"), 0, "{line}");
    server.stop().await;
}
