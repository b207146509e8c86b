//! The `ratekeeper` binary as a user runs it: flags, the stdout readiness
//! line, health, `/metrics`, SIGTERM, bad config; and several replicas
//! sharing one real Redis.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{descriptor, request, Ratekeeper, RedisServer};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

fn limits_dir(yaml: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("limits.yaml"), yaml).unwrap();
    dir
}

const LIMITS: &str = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 50}\n";

#[tokio::test]
async fn serves_health_metrics_and_stops_on_sigterm() {
    let dir = limits_dir(LIMITS);
    let server = Ratekeeper::spawn(dir.path(), &[]);
    let channel = server.channel().await;
    let mut health = HealthClient::new(channel);
    for service in ["", "envoy.service.ratelimit.v3.RateLimitService"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "{service:?}");
    }

    let mut client = server.client().await;
    for _ in 0..3 {
        client
            .should_rate_limit(request("web", vec![descriptor(&[("user", "a")])]))
            .await
            .unwrap();
    }
    client
        .should_rate_limit(request("unknown", vec![descriptor(&[("user", "a")])]))
        .await
        .unwrap();
    let json = r#"{"domain":"web","descriptors":[{"entries":[{"key":"user","value":"j"}]}]}"#;
    let answer = common::http_call(&server.http, "POST", "/json", json);
    assert_eq!(answer.status, 200, "{answer:?}");
    let text = server.metrics();
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    // Label values are UTF-8 (a request's descriptor values): say so.
    assert!(
        text.contains("content-type: text/plain; version=0.0.4; charset=utf-8"),
        "{text}"
    );
    for expected in [
        "ratekeeper_rate_limit_total_hits{domain=\"web\",rule=\"user\"} 4",
        "ratekeeper_rate_limit_within_limit{domain=\"web\",rule=\"user\"} 4",
        "ratekeeper_domain_not_found 1",
        "ratekeeper_config_load_success 1",
        "ratekeeper_config_load_failing 0",
        "ratekeeper_request_duration_seconds_bucket",
        // Every decision: four over gRPC, one over `/json`.
        "ratekeeper_request_duration_seconds_count 5",
    ] {
        assert!(
            text.contains(expected),
            "/metrics lacks {expected:?}:\n{text}"
        );
    }
    let status = server.terminate();
    assert!(status.success(), "exit status {status:?}");
}

/// SIGHUP stops the server as SIGTERM does (as theirs); a health `Watch`
/// hears NOT_SERVING and ends, so that it does not hold the drain for the
/// whole grace.
#[tokio::test]
async fn sighup_turns_health_not_serving_and_ends_watch_streams() {
    let dir = limits_dir(LIMITS);
    let server = Ratekeeper::spawn(dir.path(), &["--shutdown-grace-ms", "30000"]);
    let mut health = HealthClient::new(server.channel().await);
    let ratelimit = HealthCheckRequest {
        service: "ratelimit".into(),
    };
    let mut watch = health.watch(ratelimit).await.unwrap().into_inner();
    let serving = ServingStatus::Serving as i32;
    while watch.message().await.unwrap().unwrap().status != serving {}

    let started = Instant::now();
    let stopping = tokio::task::spawn_blocking(move || server.stop_with("HUP"));
    let mut heard = Vec::new();
    while let Ok(Some(message)) = watch.message().await {
        heard.push(message.status);
    }
    let status = stopping.await.unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(
        heard.last(),
        Some(&(ServingStatus::NotServing as i32)),
        "{heard:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "exited {:?} after SIGHUP: the drain waited for the Watch",
        started.elapsed()
    );
}

#[test]
fn bad_config_exits_with_the_file_and_line() {
    let dir = limits_dir("domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n");
    let stderr = common::refused_start_of(
        Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
            .arg("--config-dir")
            .arg(dir.path())
            .args(["--grpc-addr", "127.0.0.1:0", "--metrics-addr", "off"]),
    );
    assert!(stderr.contains("limits.yaml:4: "), "{stderr}");
    assert!(stderr.contains("unknown unit \"fortnight\""), "{stderr}");
}

#[tokio::test]
async fn replicas_sharing_redis_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    let dir = limits_dir(LIMITS);
    let url = redis.url();
    let replicas: Vec<Ratekeeper> = (0..3)
        .map(|_| {
            Ratekeeper::spawn(
                dir.path(),
                &["--redis-url", &url, "--redis-timeout-ms", "2000"],
            )
        })
        .collect();
    let hour = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            / 3600
    };
    let started_in = hour();
    let mut tasks = Vec::new();
    for replica in &replicas {
        for _ in 0..4 {
            let mut client = replica.client().await;
            tasks.push(tokio::spawn(async move {
                let mut admitted = 0;
                for _ in 0..25 {
                    let r = client
                        .should_rate_limit(request("web", vec![descriptor(&[("user", "shared")])]))
                        .await
                        .expect("answer")
                        .into_inner();
                    if r.overall_code == Code::Ok as i32 {
                        admitted += 1;
                    }
                }
                admitted
            }));
        }
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    // 3 replicas x 4 clients x 25 requests = 300 requests for a limit of 50
    // per hour window; a run straddling an hour's edge sees two windows.
    if hour() == started_in {
        assert_eq!(admitted, 50);
    } else {
        assert!(
            (50..=100).contains(&admitted),
            "{admitted} admitted across two windows"
        );
    }
    for replica in replicas {
        assert!(replica.terminate().success());
    }
}

/// `--redis-scripts-only`, or `REDIS_SCRIPTS_ONLY` with any of Go's true
/// values (as envoyproxy/ratelimit reads its switches): the limiter goes to
/// Redis by `EVALSHA`, never as a function.
#[tokio::test]
async fn scripts_only_flag_calls_the_limiter_by_evalsha() {
    let dir = limits_dir(LIMITS);
    for (flag, env) in [
        (Some("--redis-scripts-only"), None),
        (None, Some("1")),
        (None, Some("TRUE")),
    ] {
        let redis = RedisServer::start();
        let url = redis.url();
        let mut args = vec!["--redis-url", url.as_str()];
        args.extend(flag);
        let env: Vec<(&str, &str)> = env.map(|v| ("REDIS_SCRIPTS_ONLY", v)).into_iter().collect();
        let server = Ratekeeper::spawn_with_env(dir.path(), &args, &env);
        let mut client = server.client().await;
        for left in [49, 48] {
            let r = client
                .should_rate_limit(request("web", vec![descriptor(&[("user", "s")])]))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.statuses[0].limit_remaining, left);
        }
        let mut conn = redis.client().get_connection().unwrap();
        assert_eq!(
            common::command_calls(&mut conn, "fcall"),
            0,
            "{flag:?} {env:?}"
        );
        assert!(common::command_calls(&mut conn, "evalsha") >= 2);
    }
}

/// A switch set to something that is not a yes or a no is a start-up error
/// naming the variable's flag, not a silent default.
#[test]
fn a_switch_with_a_non_boolean_value_is_refused() {
    let output = Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
        .env("LIMIT_RESPONSE_HEADERS_ENABLED", "sometimes")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = common::fatal_message(&String::from_utf8_lossy(&output.stderr));
    assert!(stderr.contains("--response-headers"), "{stderr}");
}

#[tokio::test]
async fn health_waits_for_redis_then_stays_serving_through_an_outage() {
    let dir = limits_dir(LIMITS);
    // Redis is not there yet: a port nobody listens on.
    let port = common::free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let server = Ratekeeper::spawn(dir.path(), &["--redis-url", &url]);
    let channel = server.channel().await;
    let mut health = HealthClient::new(channel);
    for (service, expected) in [
        ("liveness", ServingStatus::Serving),
        ("", ServingStatus::NotServing),
    ] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(
            status, expected as i32,
            "{service:?} before the store ever answered"
        );
    }
    // Requests get UNAVAILABLE meanwhile (the default failure mode: Envoy's
    // failure_mode_deny decides, as with envoyproxy/ratelimit's error).
    let mut client = server.client().await;
    let e = client
        .should_rate_limit(request("web", vec![descriptor(&[("user", "a")])]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    drop(server);

    // With Redis up: SERVING, and still SERVING once it is gone, whatever
    // the failure mode (as there, unless REDIS_HEALTH_CHECK_ACTIVE_CONNECTION).
    let redis = RedisServer::start();
    // Two serving threads: the pool of 4 is then 2 connections each, on any
    // machine (more threads than 4 would each hold one).
    let server = Ratekeeper::spawn(
        dir.path(),
        &[
            "--redis-url",
            &redis.url(),
            "--serving-threads",
            "2",
            "--failure-mode",
            "open",
        ],
    );
    let channel = server.channel().await;
    let mut health = HealthClient::new(channel);
    common::until_serving(&mut health).await;
    // Ready means warmed up: all 4 pooled connections open, the limiter
    // loaded as a function library (its two functions: the limiter's and
    // the budget reservations') and the lease script as a script, before
    // any request has been sent.
    let mut admin = redis
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let info: String = redis::cmd("INFO")
        .arg("everything")
        .query_async(&mut admin)
        .await
        .unwrap();
    let field = |name: &str| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in INFO"))
    };
    assert_eq!(field("number_of_functions"), 2, "the limiter library");
    assert_eq!(field("number_of_libraries"), 1, "the limiter library");
    assert_eq!(field("number_of_cached_scripts"), 1, "the lease script");
    assert_eq!(field("connected_clients"), 4 + 1, "the pool and this test");
    drop(redis);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let s = health
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(
        s,
        ServingStatus::Serving as i32,
        "an outage keeps the replica in service"
    );
    let mut client = server.client().await;
    let r = client
        .should_rate_limit(request("web", vec![descriptor(&[("user", "a")])]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32, "fail open");
    assert!(
        server.metrics().contains("ratekeeper_store_errors"),
        "the failure is counted"
    );
}

#[tokio::test]
async fn detailed_metrics_are_capped_with_an_overflow_label() {
    let dir = limits_dir("domain: web\ndescriptors:\n  - key: user\n    detailed_metric: true\n    rate_limit: {unit: hour, requests_per_unit: 50}\n");
    let server = Ratekeeper::spawn(dir.path(), &["--max-detailed-metric-series", "5"]);
    let mut client = server.client().await;
    for i in 0..40 {
        client
            .should_rate_limit(request(
                "web",
                vec![descriptor(&[("user", &format!("attacker-{i}"))])],
            ))
            .await
            .unwrap();
    }
    let text = server.metrics();
    let detailed: Vec<&str> = text
        .lines()
        .filter(|l| {
            l.starts_with("ratekeeper_rate_limit_total_hits{") && l.contains("rule=\"user_")
        })
        .collect();
    assert_eq!(detailed.len(), 5, "{detailed:#?}");
    assert!(
        text.contains("ratekeeper_rate_limit_total_hits{domain=\"web\",rule=\"overflow\"} 35"),
        "{text}"
    );
    assert!(text.contains("ratekeeper_rate_limit_total_hits{domain=\"web\",rule=\"user\"} 40"));
}

#[tokio::test]
async fn hashed_values_keep_raw_values_out_of_redis_and_metrics() {
    let redis = RedisServer::start();
    let dir = limits_dir("domain: web\ndescriptors:\n  - key: email\n    detailed_metric: true\n    rate_limit: {unit: hour, requests_per_unit: 50}\n");
    let url = redis.url();
    let server = Ratekeeper::spawn(
        dir.path(),
        &[
            "--redis-url",
            &url,
            "--hash-descriptor-values",
            "--redis-timeout-ms",
            "2000",
        ],
    );
    let mut client = server.client().await;
    for remaining in [49, 48] {
        let r = client
            .should_rate_limit(request(
                "web",
                vec![descriptor(&[("email", "alice@example.com")])],
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.statuses[0].limit_remaining, remaining,
            "counting still works"
        );
    }
    let mut conn = redis.client().get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    assert_eq!(
        keys,
        vec!["rk:{web|email=h%3Aff8d9819fc0e12bf0d24892e45987e24}:fw.3600".to_string()]
    );
    let metrics = server.metrics();
    assert!(!metrics.contains("alice"), "{metrics}");
    assert!(
        metrics.contains("rule=\"email_h:ff8d9819fc0e12bf0d24892e45987e24\""),
        "{metrics}"
    );
}

/// Asks once, on a connection of its own, and checks the answer.
async fn answers(server: &Ratekeeper) {
    let r = server
        .client()
        .await
        .should_rate_limit(request("web", vec![descriptor(&[("user", "a")])]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
}

/// How many of the process's threads are serving lanes (by name, in
/// `/proc/PID/task/*/comm`).
fn lane_threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.unwrap().path().join("comm")).ok())
        .filter(|name| name.starts_with("rk-lane-"))
        .count()
}

#[tokio::test]
async fn serving_threads_follow_the_flag_and_the_environment() {
    let dir = limits_dir(LIMITS);
    for (args, env, expected) in [
        (&["--serving-threads", "3"][..], &[][..], 3),
        (&[][..], &[("SERVING_THREADS", "1")][..], 1),
    ] {
        let server = Ratekeeper::spawn_with_env(dir.path(), args, env);
        answers(&server).await;
        assert_eq!(lane_threads(server.pid()), expected, "{args:?} {env:?}");
        drop(server);
    }
    // Without either: one per core.
    let server = Ratekeeper::spawn(dir.path(), &[]);
    answers(&server).await;
    let cores = std::thread::available_parallelism().unwrap().get();
    assert_eq!(lane_threads(server.pid()), cores);

    let output = Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
        .args(["--serving-threads", "0"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = common::fatal_message(&String::from_utf8_lossy(&output.stderr));
    assert!(stderr.contains("--serving-threads"), "{stderr}");
}

#[tokio::test]
async fn force_start_without_initial_config_serves_until_the_limits_directory_appears() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("data/ratelimit/config");
    let server = Ratekeeper::spawn_in(
        root.path(),
        &["--reload-interval-ms", "50"],
        &[
            (
                "RUNTIME_ROOT",
                &root.path().join("data").display().to_string(),
            ),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
        ],
    );
    let mut client = server.client().await;
    let ask = || request("web", vec![descriptor(&[("user", "a")])]);
    // No directory yet: no limits, as theirs (its runtime loads an empty
    // snapshot), so every request is allowed.
    let answer = client.should_rate_limit(ask()).await.unwrap().into_inner();
    assert_eq!(answer.overall_code, Code::Ok as i32);
    assert!(answer.statuses[0].current_limit.is_none(), "{answer:?}");

    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("limits.yaml"), LIMITS).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let answer = client.should_rate_limit(ask()).await;
        if answer.is_ok_and(|a| a.into_inner().statuses[0].current_limit.is_some()) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the limits never loaded"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The watcher starts from the files as they were loaded: one written
/// while the server starts (here: as soon as it listens) is reloaded.
#[tokio::test]
async fn a_limits_file_changed_as_the_server_starts_is_reloaded() {
    let dir = limits_dir(LIMITS);
    let server = Ratekeeper::spawn(dir.path(), &["--reload-interval-ms", "50"]);
    let changed = LIMITS.replace("requests_per_unit: 50", "requests_per_unit: 7");
    std::fs::write(dir.path().join("limits.yaml"), changed).unwrap();
    let mut client = server.client().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let answer = client
            .should_rate_limit(request("web", vec![descriptor(&[("user", "a")])]))
            .await
            .unwrap()
            .into_inner();
        let limit = answer.statuses[0].current_limit.as_ref().unwrap();
        if limit.requests_per_unit == 7 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the change was never loaded"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A ConfigMap mounted as the limits directory, updated as the kubelet
/// does: a key dropped from it leaves its link dangling between the swap
/// of `..data` and the link's removal. A look falling in that window is
/// not reported (it failed on one swap in five before); a link left
/// dangling past the next look is.
#[test]
fn a_configmap_key_removed_is_not_a_reload_error_but_a_dangling_link_is() {
    const INTERVAL_MS: u64 = 250;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let version = |n: u32, keys: &[&str]| {
        let name = format!("..v{n}");
        std::fs::create_dir(root.join(&name)).unwrap();
        for key in keys {
            let yaml = format!("domain: {key}\ndescriptors:\n  - key: k\n");
            std::fs::write(root.join(&name).join(format!("{key}.yaml")), yaml).unwrap();
        }
        std::os::unix::fs::symlink(&name, root.join("..data_tmp")).unwrap();
        std::fs::rename(root.join("..data_tmp"), root.join("..data")).unwrap();
    };
    let link = |key: &str| {
        let target = format!("..data/{key}.yaml");
        std::os::unix::fs::symlink(target, root.join(format!("{key}.yaml"))).unwrap();
    };
    version(0, &["a", "b"]);
    link("a");
    link("b");
    let interval = INTERVAL_MS.to_string();
    let server = Ratekeeper::spawn(root, &["--reload-interval-ms", &interval]);
    let failed = || server.logs().matches("limits reload failed").count();
    for n in 1..=5 {
        version(2 * n - 1, &["a"]);
        // Under one interval: at most one look falls in it.
        std::thread::sleep(Duration::from_millis(INTERVAL_MS * 4 / 5));
        std::fs::remove_file(root.join("b.yaml")).unwrap();
        std::thread::sleep(Duration::from_millis(INTERVAL_MS * 2));
        version(2 * n, &["a", "b"]);
        link("b");
        std::thread::sleep(Duration::from_millis(INTERVAL_MS * 2));
    }
    assert_eq!(failed(), 0, "{}", server.logs());
    assert!(
        server.logs().matches("limits reloaded").count() >= 5,
        "{}",
        server.logs()
    );

    version(11, &["a"]);
    std::thread::sleep(Duration::from_millis(INTERVAL_MS * 4));
    assert_eq!(failed(), 1, "{}", server.logs());
    assert!(
        server
            .logs()
            .contains("b.yaml: cannot read the limits file"),
        "{}",
        server.logs()
    );
}

/// A listener on `0.0.0.0` (the default hosts) takes IPv6 clients too, as
/// envoyproxy/ratelimit's Go listeners do: an IPv6-only cluster's probes
/// and Envoy reach it. (IPv4 alone on a host without IPv6.)
#[test]
fn a_listener_on_every_ipv4_address_takes_ipv6_too() {
    let dir = limits_dir(LIMITS);
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
        .arg("--config-dir")
        .arg(dir.path())
        .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "0.0.0.0:0"])
        .args([
            "--metrics-addr",
            "off",
            "--debug-addr",
            "off",
            "--admin-addr",
            "off",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let line = common::readiness_line(&mut child);
    let port = line
        .split_whitespace()
        .find_map(|f| f.strip_prefix("http="))
        .and_then(|addr| addr.rsplit(':').next())
        .unwrap_or_else(|| panic!("no http= in {line:?}"))
        .to_owned();
    let has_ipv6 = std::net::TcpListener::bind("[::1]:0").is_ok();
    let mut hosts = vec!["127.0.0.1".to_owned()];
    if has_ipv6 {
        hosts.push("[::1]".to_owned());
    }
    for host in hosts {
        let answer = common::http_call(&format!("{host}:{port}"), "GET", "/healthcheck", "");
        assert_eq!(answer.status, 200, "{host}: {answer:?}");
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn a_missing_limits_directory_stops_the_start_up_without_force_start() {
    let root = tempfile::tempdir().unwrap();
    // Not even RUNTIME_ROOT's parent, which theirs would watch (with it,
    // the start goes on without limits: tests/envoy_settings.rs).
    let stderr = common::refused_start_of(
        Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
            .env("RUNTIME_ROOT", root.path().join("missing/data"))
            .env("RUNTIME_SUBDIRECTORY", "ratelimit")
            .env_remove("FORCE_START_WITHOUT_INITIAL_CONFIG")
            .args(["--grpc-addr", "127.0.0.1:0", "--metrics-addr", "off"]),
    );
    assert!(
        stderr.contains("cannot read the limits directory"),
        "{stderr}"
    );

    let stderr = common::refused_start_of(
        Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
            .env("CONFIG_TYPE", "GRPC_XDS_DELTA")
            .args(["--grpc-addr", "127.0.0.1:0", "--metrics-addr", "off"]),
    );
    assert!(
        stderr.contains("CONFIG_TYPE \"GRPC_XDS_DELTA\" is not supported"),
        "{stderr}"
    );
}
