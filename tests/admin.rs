//! The admin API: inspect and reset a descriptor's counters on every store
//! (memory, Redis, Redis Cluster), leases listed and revoked, the config
//! dump, the guard (token, loopback), and the `ratekeeper admin` CLI as a
//! child process.

mod common;

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::certs::Certs;
use common::{descriptor, http_call, request, Backend, Ratekeeper, RedisServer, TestServer};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use ratekeeper::clock::SystemClock;
use ratekeeper::pb::v1::concurrency_service_client::ConcurrencyServiceClient;
use ratekeeper::pb::v1::{
    hold_event, AcquireRequest, Descriptor, Entry, HeartbeatRequest, ReleaseRequest,
};
use serde_json::Value;

/// One rule with a limit of every algorithm; a concurrency rule.
const LIMITS: &str = r#"
domain: web
descriptors:
  - key: user
    rate_limits:
      - {unit: minute, requests_per_unit: 3}
      - {unit: hour, requests_per_unit: 10, algorithm: sliding_window}
      - {unit: hour, requests_per_unit: 10, algorithm: sliding_log}
      - {unit: hour, requests_per_unit: 10, algorithm: token_bucket, burst: 5}
      - {unit: hour, requests_per_unit: 10, algorithm: leaky_bucket, burst: 5}
  - key: free
    rate_limit: {unlimited: true}
  - key: solo
    rate_limit: {unit: minute, requests_per_unit: 1}
concurrency:
  - key: ws_user
    max_connections: 2
    lease_ttl: 6s
"#;

/// An admin call: status and JSON body (off the runtime: the call blocks).
async fn admin(addr: SocketAddr, method: &'static str, path: String) -> (u16, Value) {
    let answer =
        tokio::task::spawn_blocking(move || http_call(&addr.to_string(), method, &path, ""))
            .await
            .expect("admin call");
    let body = serde_json::from_str(&answer.body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", answer.body));
    (answer.status, body)
}

fn remaining(state: &Value) -> Vec<u64> {
    state["limits"]
        .as_array()
        .expect("limits")
        .iter()
        .map(|l| l["remaining"].as_u64().expect("remaining"))
        .collect()
}

async fn decide(server: &TestServer, user: &str) -> Code {
    decide_on(server, "user", user).await
}

async fn decide_on(server: &TestServer, key: &str, value: &str) -> Code {
    let mut client = server.client().await;
    let response = client
        .should_rate_limit(request("web", vec![descriptor(&[(key, value)])]))
        .await
        .expect("decision")
        .into_inner();
    Code::try_from(response.overall_code).expect("code")
}

const ALICE: &str = "/v1/descriptor?domain=web&entry=user%3Dalice";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_reads_without_consuming_and_reset_restores_every_limit() {
    for backend in Backend::all_with_cluster() {
        let name = backend.name();
        let server = TestServer::start(&[LIMITS], backend.store(Arc::new(SystemClock))).await;
        server.serving().await;
        let (status, fresh) = admin(server.admin, "GET", ALICE.into()).await;
        assert_eq!(status, 200, "{name}: {fresh}");
        assert_eq!(fresh["rule"], "user", "{name}");
        assert_eq!(remaining(&fresh), [3, 10, 10, 5, 5], "{name}");
        let algorithms: Vec<&str> = fresh["limits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["algorithm"].as_str().unwrap())
            .collect();
        assert_eq!(
            algorithms,
            [
                "fixed_window",
                "sliding_window",
                "sliding_log",
                "token_bucket",
                "leaky_bucket"
            ],
            "{name}"
        );

        for _ in 0..3 {
            assert_eq!(decide(&server, "alice").await, Code::Ok, "{name}");
        }
        // Full now: the refusal also teaches the over-limit cache.
        assert_eq!(decide(&server, "alice").await, Code::OverLimit, "{name}");
        for _ in 0..3 {
            let (status, state) = admin(server.admin, "GET", ALICE.into()).await;
            assert_eq!(status, 200, "{name}");
            assert_eq!(
                remaining(&state),
                [0, 7, 7, 2, 2],
                "{name}: reads consume nothing"
            );
            assert_eq!(state["limits"][0]["over"], true, "{name}");
            let reset = state["limits"][0]["reset_ms"].as_u64().unwrap();
            assert!(reset > 0 && reset <= 60_000, "{name}: {reset}");
        }

        let (status, reset) = admin(server.admin, "DELETE", ALICE.into()).await;
        assert_eq!(status, 200, "{name}: {reset}");
        assert_eq!(reset["reset"].as_array().unwrap().len(), 5, "{name}");
        let (_, after) = admin(server.admin, "GET", ALICE.into()).await;
        assert_eq!(remaining(&after), [3, 10, 10, 5, 5], "{name}");
        assert_eq!(
            decide(&server, "alice").await,
            Code::Ok,
            "{name}: neither the store nor the over-limit cache refuses"
        );

        // A lone fixed window at its limit is answered from this replica's
        // over-limit cache, which a reset clears.
        let solo = "/v1/descriptor?domain=web&entry=solo%3Dx";
        assert_eq!(decide_on(&server, "solo", "x").await, Code::Ok, "{name}");
        assert_eq!(
            decide_on(&server, "solo", "x").await,
            Code::OverLimit,
            "{name}"
        );
        assert_eq!(admin(server.admin, "DELETE", solo.into()).await.0, 200);
        assert_eq!(decide_on(&server, "solo", "x").await, Code::Ok, "{name}");

        // Another descriptor's counters are untouched; resetting a
        // descriptor never seen is a no-op.
        decide(&server, "bob").await;
        let bob = "/v1/descriptor?domain=web&entry=user%3Dbob";
        let nobody = "/v1/descriptor?domain=web&entry=user%3Dnobody";
        assert_eq!(admin(server.admin, "DELETE", nobody.into()).await.0, 200);
        let (_, state) = admin(server.admin, "GET", bob.into()).await;
        assert_eq!(remaining(&state), [2, 9, 9, 4, 4], "{name}");
        server.stop().await;
    }
}

/// A counter reset elsewhere (another replica, or `redis-cli DEL`) is still
/// refused here, from this replica's over-limit cache, until its window
/// ends: inspect says so, rather than what the store holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_a_refusal_from_the_over_limit_cache() {
    let redis = RedisServer::start();
    let server = TestServer::start(&[LIMITS], redis.store(None)).await;
    server.serving().await;
    let solo = "/v1/descriptor?domain=web&entry=solo%3Dx";
    let mut conn = redis.client().get_connection().expect("redis connection");
    // The cache may be dropped when the store's generation moves (a slow
    // start on a loaded machine): fill it again then.
    let mut limit = Value::Null;
    for _ in 0..3 {
        assert_eq!(decide_on(&server, "solo", "x").await, Code::Ok);
        assert_eq!(decide_on(&server, "solo", "x").await, Code::OverLimit);
        let (_, state) = admin(server.admin, "GET", solo.into()).await;
        let key = state["limits"][0]["key"].as_str().expect("key").to_owned();
        let _: () = redis::cmd("DEL").arg(&key).query(&mut conn).expect("DEL");
        let (_, state) = admin(server.admin, "GET", solo.into()).await;
        limit = state["limits"][0].clone();
        if limit.get("over_limit_cache").is_some() {
            break;
        }
    }
    assert_eq!(
        (
            &limit["over"],
            &limit["remaining"],
            &limit["over_limit_cache"]
        ),
        (&Value::Bool(true), &Value::from(0), &Value::Bool(true)),
        "{limit}"
    );
    assert_eq!(decide_on(&server, "solo", "x").await, Code::OverLimit);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_deletes_the_redis_keys_of_every_algorithm() {
    let redis = RedisServer::start();
    let server = TestServer::start(&[LIMITS], redis.store(None)).await;
    server.serving().await;
    decide(&server, "carol").await;
    let mut conn = redis.client().get_connection().unwrap();
    let (_, state) = admin(
        server.admin,
        "GET",
        "/v1/descriptor?domain=web&entry=user%3Dcarol".into(),
    )
    .await;
    let keys: Vec<String> = state["limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["key"].as_str().unwrap().to_owned())
        .collect();
    let exists = |conn: &mut redis::Connection| -> u64 {
        redis::cmd("EXISTS").arg(&keys).query(conn).unwrap()
    };
    // Reading writes nothing: no write command ran, scripts' own included.
    let writes = |conn: &mut redis::Connection| -> u64 {
        [
            "hset",
            "set",
            "zadd",
            "pexpire",
            "zremrangebyrank",
            "zremrangebyscore",
            "del",
        ]
        .iter()
        .map(|c| common::command_calls(conn, c))
        .sum()
    };
    let before = writes(&mut conn);
    for _ in 0..3 {
        let path = "/v1/descriptor?domain=web&entry=user%3Dcarol".to_owned();
        assert_eq!(admin(server.admin, "GET", path).await.0, 200);
    }
    assert_eq!(writes(&mut conn), before, "a GET wrote to Redis");
    assert_eq!(exists(&mut conn), 5, "one key per limit: {keys:?}");
    let (status, _) = admin(
        server.admin,
        "DELETE",
        "/v1/descriptor?domain=web&entry=user%3Dcarol".into(),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(exists(&mut conn), 0, "every algorithm's key is gone");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_400_and_an_unknown_domain_404() {
    let server = TestServer::start(&[LIMITS], Backend::Memory.store(Arc::new(SystemClock))).await;
    let cases = [
        ("GET", "/v1/descriptor?entry=user%3Da", 400, "domain"),
        ("GET", "/v1/descriptor?domain=web", 400, "entry"),
        (
            "GET",
            "/v1/descriptor?domain=web&entry=user",
            400,
            "key=value",
        ),
        (
            "DELETE",
            "/v1/descriptor?domain=nope&entry=user%3Da",
            404,
            "unknown domain",
        ),
        (
            "GET",
            "/v1/leases?domain=web&entry=user%3Da",
            400,
            "no concurrency rule",
        ),
        (
            "DELETE",
            "/v1/leases?domain=web&entry=ws_user%3Da&lease=x",
            400,
            "not a lease id",
        ),
        ("GET", "/v1/nothing", 404, "no such endpoint"),
        ("GET", "/v1/config?domain=web", 400, "no parameter"),
        (
            "GET",
            "/v1/descriptor?domain=web&entry=user%3Da&lease=x",
            400,
            "DELETE /v1/leases only",
        ),
        ("POST", "/v1/config", 405, "method not allowed"),
    ];
    for (method, path, code, reason) in cases {
        let (status, body) = admin(server.admin, method, path.into()).await;
        assert_eq!(status, code, "{method} {path}: {body}");
        let error = body["error"].as_str().unwrap_or_default();
        assert!(error.contains(reason), "{method} {path}: {error}");
    }
    // No rule, or an unlimited one: nothing to count.
    let (_, none) = admin(
        server.admin,
        "GET",
        "/v1/descriptor?domain=web&entry=x%3Dy".into(),
    )
    .await;
    assert_eq!(
        (none["rule"].clone(), remaining(&none).len()),
        (Value::Null, 0)
    );
    let (_, free) = admin(
        server.admin,
        "GET",
        "/v1/descriptor?domain=web&entry=free%3Dy".into(),
    )
    .await;
    assert_eq!(free["unlimited"], true);
    assert_eq!(free["rule"], "free", "the rule that makes it unlimited");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_config_dump_lists_rules_with_their_paths_and_limits() {
    let server = TestServer::start(&[LIMITS], Backend::Memory.store(Arc::new(SystemClock))).await;
    let (status, config) = admin(server.admin, "GET", "/v1/config".into()).await;
    assert_eq!(status, 200);
    assert_eq!(config["xds_version"], Value::Null, "limits from files");
    let web = &config["domains"][0];
    assert_eq!(web["domain"], "web");
    assert_eq!(web["source"], "test0.yaml");
    assert_eq!(web["rules"][0]["path"], "user");
    assert_eq!(web["rules"][0]["limits"][3]["algorithm"], "token_bucket");
    assert_eq!(web["rules"][0]["limits"][3]["burst"], 5);
    assert_eq!(web["rules"][1]["unlimited"], true);
    assert_eq!(web["concurrency"][0]["max_connections"], 2);
    server.stop().await;
}

fn acquire_request(user: &str) -> AcquireRequest {
    held_by(user, "")
}

fn held_by(user: &str, holder: &str) -> AcquireRequest {
    AcquireRequest {
        holder: holder.into(),
        domain: "web".into(),
        descriptors: vec![Descriptor {
            entries: vec![Entry {
                key: "ws_user".into(),
                value: user.into(),
            }],
        }],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_listed_with_their_holders_and_a_revoked_hold_is_lost() {
    for backend in Backend::all_with_cluster() {
        let name = backend.name();
        let server = TestServer::start(&[LIMITS], backend.store(Arc::new(SystemClock))).await;
        server.serving().await;
        let channel = server.channel().await;
        let mut client = ConcurrencyServiceClient::new(channel);
        let mut held = client
            .hold(held_by("dan", "pod-a/conn 7"))
            .await
            .unwrap()
            .into_inner();
        let Some(hold_event::Event::Acquired(acquired)) =
            held.message().await.unwrap().unwrap().event
        else {
            panic!("{name}: no acquired event")
        };
        assert!(acquired.granted, "{name}");
        let other = client
            .acquire_connection(acquire_request("dan"))
            .await
            .unwrap()
            .into_inner();

        let path = "/v1/leases?domain=web&entry=ws_user%3Ddan";
        let (status, listed) = admin(server.admin, "GET", path.into()).await;
        assert_eq!(status, 200, "{name}: {listed}");
        assert_eq!(listed["max_connections"], 2, "{name}");
        let ids: Vec<&str> = listed["leases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["id"].as_str().unwrap())
            .collect();
        let member = |id: &str| id.split('.').next().unwrap().to_owned();
        assert_eq!(ids.len(), 2, "{name}: {listed}");
        assert!(ids.contains(&member(&acquired.lease_id).as_str()), "{name}");
        assert!(ids.contains(&member(&other.lease_id).as_str()), "{name}");
        assert!(listed["leases"][0]["expires_at_ms"].as_u64().unwrap() > 0);
        let holder_of = |id: &str| {
            listed["leases"]
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["id"] == member(id).as_str())
                .map(|l| l["holder"].clone())
        };
        assert_eq!(
            holder_of(&acquired.lease_id),
            Some(Value::from("pod-a/conn 7")),
            "{name}: {listed}"
        );
        assert_eq!(
            holder_of(&other.lease_id),
            Some(Value::from("")),
            "{name}: none named"
        );

        let revoke = format!("{path}&lease={}", acquired.lease_id);
        let (status, revoked) = admin(server.admin, "DELETE", revoke.clone()).await;
        assert_eq!(
            (status, revoked["revoked"].clone()),
            (200, Value::Bool(true)),
            "{name}"
        );
        let event = tokio::time::timeout(Duration::from_secs(5), held.message())
            .await
            .expect("no lost event")
            .unwrap()
            .unwrap();
        assert!(
            matches!(event.event, Some(hold_event::Event::Lost(ref id)) if *id == acquired.lease_id),
            "{name}: {event:?}"
        );
        let (_, listed) = admin(server.admin, "GET", path.into()).await;
        assert_eq!(listed["leases"].as_array().unwrap().len(), 1, "{name}");
        let (_, again) = admin(server.admin, "DELETE", revoke).await;
        assert_eq!(again["revoked"], false, "{name}: already gone");
        server.stop().await;
    }
}

/// Runs `ratekeeper admin ARGS`: exit code, stdout, stderr.
fn cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
        .arg("admin")
        .args(args)
        .env_remove("ADMIN_ADDR")
        .env_remove("ADMIN_TOKEN_FILE")
        .env("USER", "oncall")
        .output()
        .expect("run ratekeeper admin");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_cli_inspects_and_resets_with_the_token_against_redis() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let token = token.display().to_string();
    let server = Ratekeeper::start(
        LIMITS,
        dir.path(),
        &[
            "--redis-url",
            &redis.url(),
            "--admin-addr",
            "127.0.0.1:0",
            "--admin-token-file",
            &token,
            // The shared CPU of a test run, not what is tested here.
            "--redis-timeout-ms",
            "1000",
        ],
    );
    let mut client = server.client().await;
    for _ in 0..3 {
        client
            .should_rate_limit(request("web", vec![descriptor(&[("user", "eve")])]))
            .await
            .unwrap();
    }
    let addr = server.admin.as_str();

    let (code, _, stderr) = cli(&["--addr", addr, "get", "web", "user=eve"]);
    assert_eq!(code, 1, "no token: refused");
    assert!(stderr.contains("401"), "{stderr}");
    // The 401 names the scheme it wants (RFC 6750).
    let path = "/v1/descriptor?domain=web&entry=user%3Deve";
    let refused = common::try_http_exchange_with(addr, "GET", path, &[], "").unwrap();
    assert!(refused.starts_with("HTTP/1.1 401"), "{refused}");
    assert!(
        refused
            .to_ascii_lowercase()
            .contains("www-authenticate: bearer"),
        "{refused}"
    );

    let with = ["--addr", addr, "--token-file", token.as_str()];
    let (code, stdout, stderr) = cli(&[&with[..], &["get", "web", "user=eve"]].concat());
    assert_eq!(code, 0, "{stderr}");
    let state: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(remaining(&state), [0, 7, 7, 2, 2], "{stdout}");

    let (code, stdout, stderr) = cli(&[&with[..], &["reset", "web", "user=eve"]].concat());
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("\"rule\": \"user\""), "{stdout}");
    let (_, stdout, _) = cli(&[&with[..], &["get", "web", "user=eve"]].concat());
    let state: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(remaining(&state), [3, 10, 10, 5, 5], "{stdout}");

    let (code, _, stderr) = cli(&[&with[..], &["get", "nope", "user=eve"]].concat());
    assert_eq!(code, 1);
    assert!(
        stderr.contains("404") && stderr.contains("unknown domain"),
        "{stderr}"
    );
    let (code, stdout, _) = cli(&[&with[..], &["config"]].concat());
    assert_eq!(code, 0);
    assert!(stdout.contains("\"path\": \"user\""), "{stdout}");

    // A reader that stops early (`| head`): the answer is cut, no panic.
    let mut cut = Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
        .arg("admin")
        .args([&with[..], &["config"]].concat())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run ratekeeper admin");
    drop(cut.stdout.take());
    let out = cut.wait_with_output().expect("ratekeeper admin ends");
    let stderr = common::fatal_message(&String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stderr.is_empty(), "{stderr}");

    let lease = ConcurrencyServiceClient::new(server.channel().await)
        .acquire_connection(held_by("eve", "pod-b/conn 12"))
        .await
        .unwrap()
        .into_inner();
    assert!(lease.granted, "{lease:?}");
    let (code, stdout, stderr) = cli(&[&with[..], &["leases", "web", "ws_user=eve"]].concat());
    assert_eq!(code, 0, "{stderr}");
    let listed: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(listed["leases"][0]["holder"], "pod-b/conn 12", "{stdout}");
    assert!(lease
        .lease_id
        .starts_with(listed["leases"][0]["id"].as_str().unwrap()));
    // A lease id carrying a line of its own is logged quoted, on one line.
    let forged = format!("{}.x\nINFO forged audit line", &lease.lease_id[..32]);
    let revoke = [&with[..], &["revoke", "web", &forged, "ws_user=eve"]].concat();
    let (code, stdout, stderr) = cli(&revoke);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("\"revoked\": true"), "{stdout}");

    // Audited: who, what.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !server.logs().contains("counters reset") && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let logs = server.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("counters reset"))
        .unwrap_or_else(|| panic!("no reset logged: {logs}"));
    assert!(line.contains("oncall") && line.contains("eve"), "{line}");
    let forged: Vec<&str> = logs.lines().filter(|l| l.contains("forged")).collect();
    assert!(
        forged.len() == 1 && forged[0].contains("lease revoked"),
        "{forged:?}"
    );
    let metrics = server.metrics();
    assert!(
        metrics.contains("ratekeeper_admin_operations{operation=\"reset\"} 1"),
        "{metrics}"
    );
    assert!(
        // The CLI's call without the token, and the one above.
        metrics.contains("ratekeeper_admin_unauthorized 2"),
        "{metrics}"
    );
}

/// A listener that takes the connection and never answers (the wrong port,
/// a stalled pod) ends the CLI with an error, not a hang.
#[test]
fn the_cli_gives_up_on_a_silent_admin_api() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
    let addr = silent.local_addr().expect("address").to_string();
    let started = std::time::Instant::now();
    let (code, _, stderr) = cli(&["--addr", &addr, "config"]);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("no answer within 10s"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(20));
}

/// Go's host-less `:PORT` is every interface too, as their listeners read
/// it (it failed to resolve).
#[test]
fn a_public_admin_address_without_a_token_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    for public in ["0.0.0.0:0", ":0"] {
        let stderr = common::refused_start_of(
            Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
                .arg("--config-dir")
                .arg(dir.path())
                .args(["--grpc-addr", "127.0.0.1:0", "--metrics-addr", "off"])
                .args(["--http-addr", "off", "--debug-addr", "off"])
                .args(["--admin-addr", public])
                .env_remove("ADMIN_TOKEN_FILE"),
        );
        assert!(
            stderr.contains("needs --admin-token-file"),
            "{public}: {stderr}"
        );
    }
}

#[tokio::test]
async fn mutual_tls_guards_a_public_admin_address() {
    let certs = Certs::ca("ratekeeper-admin");
    certs.leaf("server", "ratekeeper", "DNS:localhost,IP:127.0.0.1");
    certs.leaf("oncall", "oncall", "DNS:oncall.example");
    let path = |name: &str| certs.path(name).display().to_string();
    let dir = tempfile::tempdir().unwrap();
    let (crt, key, ca) = (path("server.crt"), path("server.key"), path("ca.crt"));
    // Every interface, no token: mutual TLS is the guard.
    let server = Ratekeeper::start(
        LIMITS,
        dir.path(),
        &[
            "--admin-addr",
            "0.0.0.0:0",
            "--admin-tls-cert",
            &crt,
            "--admin-tls-key",
            &key,
            "--admin-tls-client-ca",
            &ca,
        ],
    );
    let port = server.admin.rsplit_once(':').unwrap().1;
    let addr = format!("127.0.0.1:{port}");
    let (oncall_crt, oncall_key) = (path("oncall.crt"), path("oncall.key"));
    let (code, stdout, stderr) = cli(&[
        "--addr",
        &addr,
        "--ca",
        &ca,
        "--cert",
        &oncall_crt,
        "--key",
        &oncall_key,
        "get",
        "web",
        "user=frank",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let state: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(remaining(&state), [3, 10, 10, 5, 5], "{stdout}");

    let (code, _, stderr) = cli(&["--addr", &addr, "--ca", &ca, "get", "web", "user=frank"]);
    assert_eq!(code, 1, "no client certificate: refused");
    assert!(!stderr.is_empty());
    let (code, _, _) = cli(&["--addr", &addr, "get", "web", "user=frank"]);
    assert_eq!(code, 1, "plain HTTP: refused");
}

/// The holders' hash of every lease set on `redis`: (fields, PTTL ms) per key.
fn holder_hashes(redis: &RedisServer) -> Vec<(u64, i64)> {
    let mut conn = redis.client().get_connection().expect("redis");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*:holders")
        .query(&mut conn)
        .unwrap();
    keys.iter()
        .map(|key| {
            let fields: u64 = redis::cmd("HLEN").arg(key).query(&mut conn).unwrap();
            let ttl: i64 = redis::cmd("PTTL").arg(key).query(&mut conn).unwrap();
            (fields, ttl)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holders_leave_with_their_leases_so_their_hash_never_outgrows_the_set() {
    let redis = RedisServer::start();
    let server = TestServer::start(&[LIMITS], redis.store(Some(Arc::new(SystemClock)))).await;
    server.serving().await;
    let channel = server.channel().await;
    let mut client = ConcurrencyServiceClient::new(channel);
    let too_long = client
        .acquire_connection(held_by("fay", &"x".repeat(257)))
        .await
        .expect_err("a 257-byte holder");
    assert_eq!(too_long.code(), tonic::Code::InvalidArgument, "{too_long}");
    assert!(too_long.message().contains("at most 256"), "{too_long}");

    let short = |holder: &str| {
        let mut request = held_by("fay", holder);
        request.lease_ttl = Some(prost_types::Duration {
            seconds: 1,
            nanos: 0,
        });
        request
    };
    let acquire = |request: AcquireRequest| {
        let mut client = client.clone();
        async move {
            let answer = client
                .acquire_connection(request)
                .await
                .unwrap()
                .into_inner();
            assert!(answer.granted, "{answer:?}");
            answer.lease_id
        }
    };
    let mut client = client.clone();
    let released = acquire(short("released")).await;
    let expiring = acquire(short("expiring")).await;
    let hashes = holder_hashes(&redis);
    assert_eq!(hashes.len(), 1, "{hashes:?}");
    assert_eq!(hashes[0].0, 2, "{hashes:?}");
    assert!(
        (1..=1_000).contains(&hashes[0].1),
        "expires with the leases: {hashes:?}"
    );

    client
        .release(ReleaseRequest {
            lease_ids: vec![released],
        })
        .await
        .unwrap();
    assert_eq!(
        holder_hashes(&redis)[0].0,
        1,
        "released: its holder is gone"
    );

    // The other lease lapses; the next acquire drops its holder too.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let (_, listed) = admin(
        server.admin,
        "GET",
        "/v1/leases?domain=web&entry=ws_user%3Dfay".into(),
    )
    .await;
    assert_eq!(
        listed["leases"],
        Value::Array(vec![]),
        "expired: not listed"
    );
    let lost = acquire(short("lost")).await;
    let kept = acquire(held_by("fay", "kept")).await;
    assert_eq!(
        holder_hashes(&redis)[0].0,
        2,
        "lost + kept; expiring dropped"
    );

    // A heartbeat that finds its lease lapsed drops its holder.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let beat = client
        .heartbeat(HeartbeatRequest {
            lease_ids: vec![lost, expiring],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(beat.lost.len(), 2, "{beat:?}");
    let hashes = holder_hashes(&redis);
    assert_eq!(hashes[0].0, 1, "only kept's holder: {hashes:?}");
    assert!(hashes[0].1 > 4_000, "kept's TTL (6 s) keeps it: {hashes:?}");

    client
        .release(ReleaseRequest {
            lease_ids: vec![kept],
        })
        .await
        .unwrap();
    assert_eq!(holder_hashes(&redis), vec![], "no lease, no hash");
    server.stop().await;
}
