//! The HTTP surface, as envoyproxy/ratelimit's clients and probes use it:
//! `/healthcheck`, `POST /json` (ShouldRateLimit as protojson) on the
//! in-memory store and a real Redis, `/rlconfig`, metrics at
//! `PROMETHEUS_ADDR`/`PROMETHEUS_PATH`, gRPC health for `ratelimit`, and
//! accept errors (out of file descriptors) that back off instead of spinning.
//!
//! The HTTP client is blocking: tests of an in-process server run on two
//! workers, so that the server serves on one while the other waits.

mod common;

use std::time::{Duration, Instant};

use common::{http_call, on_every_store, HttpAnswer, Ratekeeper, RedisServer, TestServer};
use serde_json::{json, Value};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const LIMITS: &str = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";

/// A request for `user=<user>` in domain `web`, in protojson.
fn user_request(user: &str) -> String {
    json!({"domain": "web", "descriptors": [{"entries": [{"key": "user", "value": user}]}]})
        .to_string()
}

fn post_json(server: &TestServer, body: &str) -> HttpAnswer {
    http_call(&server.http.to_string(), "POST", "/json", body)
}

fn parsed(answer: &HttpAnswer) -> Value {
    serde_json::from_str(&answer.body).unwrap_or_else(|e| panic!("{e}: {answer:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_answers_200_then_429_with_the_decision_as_protojson() {
    // 30.5 s into a minute window: 29.5 s until it resets, on either store,
    // told in whole seconds rounded up as theirs (`30s`).
    let start_ms = 1_700_000_010_500;
    on_every_store(&[LIMITS], start_ms, |server, _clock, store| async move {
        server.serving().await;
        let first = post_json(&server, &user_request("alice"));
        assert_eq!(first.status, 200, "{store}: {first:?}");
        let first = parsed(&first);
        assert_eq!(first["overallCode"], "OK", "{store}");
        let status = &first["statuses"][0];
        assert_eq!(status["code"], "OK", "{store}");
        assert_eq!(
            status["currentLimit"],
            json!({"requestsPerUnit": 2, "unit": "MINUTE"}),
            "{store}"
        );
        assert_eq!(status["limitRemaining"], 1, "{store}");
        assert_eq!(status["durationUntilReset"], "30s", "{store}");
        let headers = first["responseHeadersToAdd"].as_array().expect("headers");
        assert!(
            headers.contains(&json!({"key": "RateLimit-Remaining", "value": "1"})),
            "{store}: {headers:?}"
        );

        // proto field names work too; the last allowed hit leaves 0, which
        // protojson leaves out.
        let second = post_json(
            &server,
            r#"{"domain": "web", "hits_addend": 1, "descriptors": [{"entries": [{"key": "user", "value": "alice"}]}]}"#,
        );
        assert_eq!(second.status, 200, "{store}: {second:?}");
        assert!(parsed(&second)["statuses"][0]
            .get("limitRemaining")
            .is_none());

        let third = post_json(&server, &user_request("alice"));
        assert_eq!(third.status, 429, "{store}: {third:?}");
        let third = parsed(&third);
        assert_eq!(third["overallCode"], "OVER_LIMIT", "{store}");
        assert_eq!(third["statuses"][0]["code"], "OVER_LIMIT", "{store}");

        // The HTTP and gRPC paths share one limiter: gRPC sees the count too.
        let mut client = server.client().await;
        let grpc = client
            .should_rate_limit(common::request(
                "web",
                vec![common::descriptor(&[("user", "alice")])],
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(grpc.overall_code, 2, "{store}: OVER_LIMIT over gRPC too");
        server.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_refuses_bad_bodies_with_400_and_the_reason() {
    let server = TestServer::start(&[LIMITS], common::Backend::Memory.store(clock())).await;
    let cases = [
        ("{", "bad RateLimitRequest JSON"),
        (r#"{"domian": "web"}"#, "unknown field `domian`"),
        (
            r#"{"domain": "web", "descriptors": [{"entries": [{"key": "user"}], "hitsAddend": -2}]}"#,
            "-2 is negative",
        ),
        (
            r#"{"domain": "", "descriptors": [{"entries": [{"key": "user"}]}]}"#,
            "the rate limit domain must not be empty",
        ),
        (
            r#"{"domain": "web", "descriptors": []}"#,
            "descriptor list must not be empty",
        ),
    ];
    for (body, reason) in cases {
        let answer = post_json(&server, body);
        assert_eq!(answer.status, 400, "{body}: {answer:?}");
        assert!(answer.body.contains(reason), "{body}: {answer:?}");
    }
    // Any method, as there: a GET has no body to read.
    let get = http_call(&server.http.to_string(), "GET", "/json", "");
    assert_eq!(get.status, 400, "{get:?}");
    // A large body (parsed off the listener's runtime) answers alike, bad
    // or good.
    let padded = format!("{}{}", user_request("alice"), " ".repeat(1 << 20));
    assert_eq!(post_json(&server, &padded).status, 200);
    let broken = format!("{{{}", " ".repeat(1 << 20));
    let answer = post_json(&server, &broken);
    assert_eq!(answer.status, 400, "{answer:?}");
    assert!(
        answer.body.contains("bad RateLimitRequest JSON"),
        "{answer:?}"
    );
    // Over the 16 MiB cap (a valid request padded with spaces).
    let big = format!("{}{}", user_request("alice"), " ".repeat(16 << 20));
    let answer = post_json(&server, &big);
    assert_eq!(answer.status, 413, "{:?}", answer.status);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_answers_500_when_the_store_fails_and_the_domain_says_unavailable() {
    let mut redis = RedisServer::start();
    let limits = format!("{LIMITS}failure_mode: unavailable\n");
    let server = TestServer::start(&[&limits], redis.store(None)).await;
    server.serving().await;
    assert_eq!(post_json(&server, &user_request("bob")).status, 200);
    redis.kill();
    let answer = post_json(&server, &user_request("bob"));
    assert_eq!(answer.status, 500, "{answer:?}");
    assert!(
        answer.body.contains("the rate limit store failed"),
        "{answer:?}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rlconfig_prints_the_rules_in_force() {
    let limits = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n    descriptors:\n      - key: path\n        value: /login\n        shadow_mode: true\n        rate_limit: {unit: second, requests_per_unit: 1}\n";
    let api = "domain: api\ndescriptors:\n  - key: token\n    rate_limit: {unlimited: true}\n  - key: key\n    rate_limit: {unlimited: true, requests_per_unit: 7}\n";
    let server = TestServer::start(&[limits, api], common::Backend::Memory.store(clock())).await;
    let answer = http_call(&server.debug.to_string(), "GET", "/rlconfig", "");
    assert_eq!(answer.status, 200, "{answer:?}");
    // Any method, as theirs.
    let posted = http_call(&server.debug.to_string(), "POST", "/rlconfig", "");
    assert_eq!(posted.body, answer.body, "{posted:?}");
    assert_eq!(
        answer.body,
        "api.token: unit=UNKNOWN requests_per_unit=0, shadow_mode: false, quota_mode: false\n\
         api.key: unit=UNKNOWN requests_per_unit=7, shadow_mode: false, quota_mode: false\n\
         web.user: unit=MINUTE requests_per_unit=2, shadow_mode: false, quota_mode: false\n\
         web.user.path_/login: unit=SECOND requests_per_unit=1, shadow_mode: true, quota_mode: false\n"
    );
    server.stop().await;
}

fn clock() -> std::sync::Arc<dyn ratekeeper::clock::Clock> {
    std::sync::Arc::new(ratekeeper::clock::SystemClock)
}

/// `/healthcheck`'s status code, once it is `expected` (fails after 15 s).
async fn until_healthcheck(server: &Ratekeeper, expected: u16, when: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let answer = http_call(&server.http, "GET", "/healthcheck", "");
        if answer.status == expected {
            if expected == 200 {
                assert_eq!(answer.body, "OK");
            }
            return;
        }
        assert!(Instant::now() < deadline, "{when}: still {answer:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn grpc_health(server: &Ratekeeper, service: &str) -> i32 {
    HealthClient::new(server.channel().await)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
}

#[tokio::test]
async fn healthcheck_and_grpc_health_for_ratelimit_follow_the_store() {
    let dir = tempfile::tempdir().unwrap();
    // Redis is not there yet: a port nobody listens on.
    let port = common::free_port();
    let url = format!("redis://127.0.0.1:{port}");
    // As envoyproxy/ratelimit with REDIS_HEALTH_CHECK_ACTIVE_CONNECTION:
    // unhealthy while Redis is unreachable.
    let server = Ratekeeper::start(
        LIMITS,
        dir.path(),
        &[
            "--redis-url",
            &url,
            "--redis-health-check-active-connection",
        ],
    );
    let answer = http_call(&server.http, "GET", "/healthcheck", "");
    assert_eq!(answer.status, 500, "before Redis answered: {answer:?}");
    assert_eq!(
        grpc_health(&server, "ratelimit").await,
        ServingStatus::NotServing as i32
    );

    let mut redis = RedisServer::spawn(port, &[]);
    until_healthcheck(&server, 200, "Redis up").await;
    for service in [
        "ratelimit",
        "",
        "envoy.service.ratelimit.v3.RateLimitService",
    ] {
        assert_eq!(
            grpc_health(&server, service).await,
            ServingStatus::Serving as i32,
            "{service:?}"
        );
    }

    redis.kill();
    until_healthcheck(&server, 500, "Redis gone").await;
    assert_eq!(
        grpc_health(&server, "ratelimit").await,
        ServingStatus::NotServing as i32
    );
}

#[tokio::test]
async fn metrics_listen_on_prometheus_addr_at_prometheus_path() {
    let dir = tempfile::tempdir().unwrap();
    let server = Ratekeeper::spawn_with_env(
        dir.path(),
        &[],
        &[
            ("USE_PROMETHEUS", "true"),
            // Host-less, as Envoy Gateway sets it (`:19001`): every interface.
            ("PROMETHEUS_ADDR", ":0"),
            ("PROMETHEUS_PATH", "/stats/prometheus"),
        ],
    );
    // Every interface: IPv6 too (`[::]`), unless the host has none.
    let port = ["[::]:", "0.0.0.0:"]
        .iter()
        .find_map(|any| server.metrics.strip_prefix(any))
        .unwrap_or_else(|| panic!("not on every interface: {}", server.metrics));
    let addr = format!("127.0.0.1:{port}");
    let answer = http_call(&addr, "GET", "/stats/prometheus", "");
    assert_eq!(answer.status, 200, "{answer:?}");
    assert!(
        answer.body.contains("ratekeeper_config_load_success 1"),
        "{answer:?}"
    );
    // Envoy Gateway's rate limit dashboard charts these (client_golang's
    // process collector there).
    for series in [
        "process_resident_memory_bytes ",
        "process_virtual_memory_bytes ",
    ] {
        assert!(answer.body.contains(series), "{series}: {answer:?}");
    }
    assert_eq!(http_call(&addr, "GET", "/metrics", "").status, 404);
}

#[test]
fn a_metrics_path_the_router_cannot_take_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let stderr = common::refused_start_of(
        std::process::Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
            .arg("--config-dir")
            .arg(dir.path())
            .args([
                "--grpc-addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .args(["--http-addr", "off", "--debug-addr", "off"])
            .env("PROMETHEUS_PATH", "metrics"),
    );
    assert!(stderr.contains("metrics path \"metrics\""), "{stderr}");
}

/// CPU time (user + system) the process has used so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th of the whole line.
    let after = stat.rsplit_once(')').unwrap().1;
    let fields: Vec<u64> = after
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|f| f.parse().unwrap())
        .collect();
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Duration::from_millis((fields[0] + fields[1]) * 1_000 / ticks)
}

#[tokio::test]
async fn out_of_file_descriptors_the_listeners_back_off_and_recover() {
    let dir = tempfile::tempdir().unwrap();
    const NOFILE: u64 = 64;
    let server =
        Ratekeeper::spawn_command(dir.path(), &["--serving-threads", "1"], &[], |command| {
            use std::os::unix::process::CommandExt;
            let limit = libc::rlimit {
                rlim_cur: NOFILE,
                rlim_max: NOFILE,
            };
            // SAFETY: setrlimit is async-signal-safe and touches no memory
            // of the parent.
            unsafe {
                command.pre_exec(move || {
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                });
            }
        });
    // Connections that send nothing stay open: each holds a descriptor of
    // the server's until it runs out; the rest wait in the listen backlog.
    let held: Vec<std::net::TcpStream> = (0..2 * NOFILE)
        .map(|_| std::net::TcpStream::connect(&server.metrics).unwrap())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server.logs().contains("Too many open files") {
        assert!(
            Instant::now() < deadline,
            "never ran out:\n{}",
            server.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let before = cpu_time(server.pid());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let used = cpu_time(server.pid()) - before;
    eprintln!("CPU while out of descriptors: {used:?} in 1 s");
    // Spinning on accept() burns most of the second (630 ms measured).
    assert!(
        used < Duration::from_millis(200),
        "{used:?} of CPU in 1 s while out of descriptors"
    );

    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = common::try_http_exchange(&server.metrics, "GET", "/metrics", "");
        if metrics
            .as_ref()
            .is_ok_and(|m| m.starts_with("HTTP/1.1 200"))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "metrics not served again: {metrics:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let health = http_call(&server.http, "GET", "/healthcheck", "");
    assert_eq!(health.status, 200, "{health:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_http_connections_are_closed() {
    use std::io::{Read, Write};
    // The test server gives connections 500 ms (`--handshake-timeout-ms`).
    let server = TestServer::start(&[LIMITS], common::Backend::Memory.store(clock())).await;
    for (addr, sent) in [
        (server.http, &b""[..]),
        (server.debug, &b"GET /rlconfig HT"[..]),
        // A body that stops half-way is the client's silence too.
        (
            server.http,
            &b"POST /json HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"dom"[..],
        ),
        // And one that never comes after the server's `100 Continue`: that
        // interim answer does not make the connection one between requests.
        (
            server.http,
            &b"POST /json HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\nexpect: 100-continue\r\n\r\n"[..],
        ),
    ] {
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream.write_all(sent).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let started = Instant::now();
        let mut rest = Vec::new();
        // Closed: end of stream (or a reset), not the 5 s read timeout.
        let closed = match stream.read_to_end(&mut rest) {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        };
        assert!(closed, "{addr} after {sent:?}: still open");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{addr}: closed only after {:?}",
            started.elapsed()
        );
    }
    // A connection that is used is not cut.
    assert_eq!(
        http_call(&server.http.to_string(), "GET", "/healthcheck", "").status,
        200
    );
    server.stop().await;
}

/// Between requests a kept-alive connection waits far longer than the
/// handshake timeout (500 ms here): a pooling client (a load balancer with
/// a 60 s idle timeout, lua-resty-http's keepalive pool) sends its next
/// request on it seconds later, as theirs takes it. Before, it was closed
/// after the handshake timeout and that request failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_connection_waits_between_requests() {
    use std::io::{BufRead, BufReader, Read, Write};
    let server = TestServer::start(&[LIMITS], common::Backend::Memory.store(clock())).await;
    server.serving().await;
    let mut stream = std::net::TcpStream::connect(server.http).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    for round in 0..2 {
        if round == 1 {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
        }
        stream
            .write_all(b"GET /healthcheck HTTP/1.1\r\nhost: x\r\n\r\n")
            .unwrap();
        let mut status = String::new();
        reader.read_line(&mut status).unwrap();
        assert!(
            status.starts_with("HTTP/1.1 200"),
            "round {round}: {status:?}"
        );
        let mut length = 0;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap();
            }
            if line == "\r\n" {
                break;
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
    }
    server.stop().await;
}

/// The idle timer is the client's: a request the server takes longer to
/// answer than `--handshake-timeout-ms` (here `/json` on a Redis that
/// stopped answering, until the store's deadline) gets its answer, where
/// the connection was cut with nothing sent.
#[test]
fn a_slow_answer_is_not_cut_by_the_idle_timer() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let url = redis.url();
    let rk = Ratekeeper::start(
        LIMITS,
        dir.path(),
        &[
            "--redis-url",
            &url,
            "--handshake-timeout-ms",
            "200",
            "--redis-timeout-ms",
            "1500",
        ],
    );
    let body = user_request("slow");
    assert_eq!(http_call(&rk.http, "POST", "/json", &body).status, 200);
    redis.pause();
    let started = Instant::now();
    let answer = common::try_http_exchange(&rk.http, "POST", "/json", &body);
    let answer = answer.unwrap_or_else(|e| panic!("after {:?}: {e}", started.elapsed()));
    // The store's failure (the default failure mode), later than the idle
    // timeout: at the store's deadline ("timed out"), or when the batch
    // the check was in failed ("a check got no answer").
    let elapsed = started.elapsed();
    assert!(answer.starts_with("HTTP/1.1 500"), "{answer}");
    assert!(
        answer.contains("the rate limit store failed: store: "),
        "{answer}"
    );
    assert!(
        elapsed >= Duration::from_millis(400),
        "{elapsed:?}: {answer}"
    );
}

/// A child process stopped (SIGKILL, by PID) when dropped.
struct Started(std::process::Child);

impl Drop for Started {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the binary with `env` (and no HTTP flags); its readiness line,
/// or its stderr if it exited.
fn start_with_env(dir: &std::path::Path, env: &[(&str, &str)]) -> (Started, String) {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
        .arg("--config-dir")
        .arg(dir)
        .args(["--grpc-addr", "127.0.0.1:0", "--metrics-addr", "off"])
        .env_remove("REDIS_URL")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = common::readiness_line(&mut child);
    if line.is_empty() {
        child.wait().unwrap();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut line)
            .unwrap();
    }
    (Started(child), line)
}

#[test]
fn host_port_and_debug_host_port_place_the_listeners() {
    let dir = tempfile::tempdir().unwrap();
    let (port, debug_port) = (common::free_port(), common::free_port());
    let (port, debug_port) = (port.to_string(), debug_port.to_string());
    let env = [
        ("HOST", "127.0.0.1"),
        ("PORT", port.as_str()),
        ("DEBUG_HOST", "127.0.0.1"),
        ("DEBUG_PORT", debug_port.as_str()),
    ];
    let (_first, line) = start_with_env(dir.path(), &env);
    assert!(
        line.contains(&format!(
            "http=127.0.0.1:{port} debug=127.0.0.1:{debug_port}"
        )),
        "{line}"
    );
    let health = http_call(&format!("127.0.0.1:{port}"), "GET", "/healthcheck", "");
    assert_eq!(health.status, 200, "{health:?}");

    // An address asked for that cannot be bound stops the start.
    let (mut second, stderr) = start_with_env(dir.path(), &env);
    assert!(
        stderr.contains(&format!("cannot listen for HTTP on 127.0.0.1:{port}")),
        "{stderr}"
    );
    assert_eq!(second.0.wait().unwrap().code(), Some(1));
}

/// The metrics port is ours by default (theirs opens it only with
/// USE_PROMETHEUS=true), so another process holding it must not stop the
/// start: a warning, and no metrics listener.
#[test]
fn a_taken_default_metrics_port_does_not_stop_the_start() {
    use std::process::{Command, Stdio};
    // Held here, unless something else already holds it: taken either way.
    let _held = std::net::TcpListener::bind("0.0.0.0:9090");
    let dir = tempfile::tempdir().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
        .arg("--config-dir")
        .arg(dir.path())
        .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .args(["--debug-addr", "off", "--admin-addr", "off"])
        .env_remove("REDIS_URL")
        .env_remove("METRICS_ADDR")
        .env_remove("USE_PROMETHEUS")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = Started(child);
    let line = common::readiness_line(&mut child.0);
    assert!(line.contains(" metrics=off "), "{line:?}");
}
