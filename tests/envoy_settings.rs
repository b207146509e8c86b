//! envoyproxy/ratelimit's environment read by the `ratekeeper` binary as
//! theirs reads it: Go durations, the runtime directory layout, the backend
//! choice, log settings, `GRPC_HOST`, and the one warning naming the
//! variables that have no effect here.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{descriptor, free_port, request, Ratekeeper, RedisServer, Sentinel};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;

const LIMITS: &str =
    "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// The binary run to completion (it is expected to refuse to start): its
/// stderr, the fatal line's message unquoted.
fn refused(env: &[(&str, &str)]) -> String {
    let output: Output = Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
        .args(["--grpc-addr", "127.0.0.1:0", "--metrics-addr", "off"])
        .args(["--http-addr", "off", "--debug-addr", "off"])
        .env_remove("REDIS_URL")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(!output.status.success(), "{output:?}");
    common::fatal_message(&String::from_utf8_lossy(&output.stderr))
}

/// Whether the second request for one user is refused (the limit is 1 an
/// hour): the limits file was loaded.
/// Asks `web` for `user` every 100 ms until an answer comes, for `within`
/// at most (else fails, saying `what` and the server's log).
async fn until_answered(server: &Ratekeeper, user: &str, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    let mut client = server.client().await;
    let ask = || request("web", vec![descriptor(&[("user", user)])]);
    while client.should_rate_limit(ask()).await.is_err() {
        assert!(Instant::now() < deadline, "{what}:\n{}", server.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn limited(server: &Ratekeeper) -> bool {
    let mut client = server.client().await;
    let ask = || request("web", vec![descriptor(&[("user", "a")])]);
    client.should_rate_limit(ask()).await.unwrap();
    let answer = client.should_rate_limit(ask()).await.unwrap().into_inner();
    answer.overall_code == Code::OverLimit as i32
}

#[tokio::test]
async fn go_durations_and_logrus_log_settings_are_read() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let server = Ratekeeper::spawn_with_env(
        &dir.path().join("limits"),
        &[],
        &[
            ("GRPC_MAX_CONNECTION_AGE", "1h30m"),
            ("GRPC_MAX_CONNECTION_AGE_GRACE", "1.5s"),
            ("REDIS_TIMEOUT", "250ms"),
            ("LOG_LEVEL", "WARNING"),
            ("LOG_FORMAT", "JSON"),
        ],
    );
    assert!(limited(&server).await);
    drop(server);
    let stderr = refused(&[("GRPC_MAX_CONNECTION_AGE", "90x")]);
    assert!(stderr.contains("bad duration \"90x\""), "{stderr}");
}

/// Their certificate variables without `GRPC_SERVER_USE_TLS` serve
/// plaintext, as theirs does (the switch defaults to false there): the
/// files are not even read.
#[tokio::test]
async fn their_certificate_without_their_switch_serves_plaintext() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let missing = dir.path().join("no-such.pem").display().to_string();
    let server = Ratekeeper::spawn_with_env(
        &dir.path().join("limits"),
        &[],
        &[
            ("GRPC_SERVER_TLS_CERT", &missing),
            ("GRPC_SERVER_TLS_KEY", &missing),
        ],
    );
    assert!(limited(&server).await);
    drop(server);
    let limits = dir.path().join("limits").display().to_string();
    let stderr = refused(&[
        ("CONFIG_DIR", &limits),
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", &missing),
        ("GRPC_SERVER_TLS_KEY", &missing),
    ]);
    assert!(stderr.contains("no-such.pem"), "{stderr}");
}

/// TLS files that could never work stop the start, naming the file and
/// why: a key that is missing (not "not a PEM private key"), and a Redis
/// client certificate whose key is another's (not a connection refused
/// for ever after).
#[test]
fn tls_files_that_cannot_work_are_named_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    common::make_certs(dir.path(), "IP:127.0.0.1");
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let file = |name: &str| dir.path().join(name).display().to_string();
    let limits = file("limits");
    let stderr = refused(&[
        ("CONFIG_DIR", &limits),
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", &file("server.crt")),
        ("GRPC_SERVER_TLS_KEY", &file("nope.key")),
    ]);
    let missing = format!("TLS: {}: No such file or directory", file("nope.key"));
    assert!(stderr.contains(&missing), "{stderr}");
    let stderr = refused(&[
        ("CONFIG_DIR", &limits),
        ("REDIS_URL", "127.0.0.1:1"),
        ("REDIS_TLS", "true"),
        ("REDIS_TLS_CLIENT_CERT", &file("client.crt")),
        ("REDIS_TLS_CLIENT_KEY", &file("server.key")),
    ]);
    assert!(
        stderr.contains(&format!("TLS: {}: ", file("client.crt"))),
        "{stderr}"
    );
}

/// A value no deployment means is refused before anything starts: a
/// misspelt level (it would silence every log, errors included), and
/// connection or thread counts that would exhaust the machine.
#[test]
fn settings_past_reason_stop_the_start_with_a_reason() {
    for (setting, says) in [
        (("LOG_LEVEL", "warnn"), "LOG_LEVEL \"warnn\" is not a level"),
        (("LOG_LEVEL", "warn "), "LOG_LEVEL \"warn \" is not a level"),
        (("LOG_LEVEL", "info."), "LOG_LEVEL \"info.\" is not a level"),
        (
            ("LOG_LEVEL", "h2=loud"),
            "LOG_LEVEL \"h2=loud\" is not a level",
        ),
        (
            ("REDIS_POOL_SIZE", "100000000"),
            "100000000 is more than 1024",
        ),
        (
            ("REDIS_PERSECOND_POOL_SIZE", "2000"),
            "2000 is more than 1024",
        ),
        (("SERVING_THREADS", "100000"), "100000 is more than 1024"),
        (("SERVING_THREADS", "0"), "at least one thread serves"),
    ] {
        let stderr = refused(&[setting]);
        assert!(stderr.contains(says), "{setting:?}: {stderr}");
    }
    let root = tempfile::tempdir().unwrap();
    write(&root.path().join("ratelimit/config/l.yaml"), LIMITS);
    let runtime_root = root.path().display().to_string();
    // A Redis CA file with no certificate in it is named at start-up, not
    // met as a failed handshake on every connection.
    let ca = root.path().join("ca.pem");
    write(&ca, "not a certificate\n");
    let ca = ca.display().to_string();
    let stderr = refused(&[
        ("RUNTIME_ROOT", &runtime_root),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("REDIS_URL", "127.0.0.1:1"),
        ("REDIS_TLS", "true"),
        ("REDIS_TLS_CACERT", &ca),
    ]);
    assert!(
        stderr.contains(&format!("TLS: {ca}: no PEM certificate")),
        "{stderr}"
    );
}

/// GRPC_MAX_CONNECTION_AGE=0 and its grace 0 are "never", as grpc-go reads
/// them: calls on one connection keep being answered.
#[tokio::test]
async fn a_connection_age_of_zero_is_never() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let server = Ratekeeper::spawn_with_env(
        &dir.path().join("limits"),
        &[],
        &[
            ("GRPC_MAX_CONNECTION_AGE", "0"),
            ("GRPC_MAX_CONNECTION_AGE_GRACE", "0"),
        ],
    );
    let mut client = server.client().await;
    for user in 0..10 {
        let user = format!("u{user}");
        let ask = request("web", vec![descriptor(&[("user", &user)])]);
        client.should_rate_limit(ask).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// LOG_FORMAT=json writes their lines (logrus' JSON with their field map):
/// `@timestamp` (RFC 3339, UTC), `@message`, a lowercase `level`, and the
/// event's fields beside them.
#[tokio::test]
async fn json_logs_have_their_field_names() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let server = Ratekeeper::spawn_with_env(
        &dir.path().join("limits"),
        &[],
        &[("LOG_LEVEL", "info"), ("LOG_FORMAT", "json")],
    );
    assert!(limited(&server).await);
    let logs = server.logs();
    drop(server);
    // The readiness line on stdout is one too.
    let ready = common::readiness_of(
        Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
            .args([
                "--config-dir",
                &dir.path().join("limits").display().to_string(),
            ])
            .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
            .args([
                "--metrics-addr",
                "off",
                "--debug-addr",
                "off",
                "--admin-addr",
                "off",
            ])
            .env("LOG_FORMAT", "json"),
    );
    let ready: serde_json::Value = serde_json::from_str(&ready).expect("a JSON line");
    assert_eq!(ready["@message"], "listening", "{ready}");
    assert!(
        ready["grpc"]
            .as_str()
            .is_some_and(|a| a.starts_with("127.0.0.1:")),
        "{ready}"
    );
    assert_eq!(ready["metrics"], "off", "{ready}");
    let lines: Vec<serde_json::Value> = logs
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect();
    assert!(!lines.is_empty(), "no log line");
    for line in &lines {
        let time = line["@timestamp"].as_str().expect("@timestamp");
        assert!(
            time.len() >= 20 && time.ends_with('Z') && &time[10..11] == "T",
            "{line}"
        );
        assert!(line["@message"].is_string(), "{line}");
        assert!(
            ["info", "warning", "error"].contains(&line["level"].as_str().unwrap()),
            "{line}"
        );
        assert!(
            line.get("message").is_none() && line.get("timestamp").is_none(),
            "{line}"
        );
    }
    assert!(
        lines
            .iter()
            .any(|l| l["@message"] == "serving gRPC" && l["lanes"].is_u64()),
        "{logs}"
    );
}

#[tokio::test]
async fn the_runtime_layout_loads_every_file_under_the_app_directory() {
    let root = tempfile::tempdir().unwrap();
    let config = root.path().join("srv/rl/config");
    // Any name, any depth; a file beside the app directory is not read.
    write(&config.join("nested/deeper/web.conf"), LIMITS);
    write(
        &root.path().join("srv/rl/other.yaml"),
        "not: [a limits file",
    );
    let root_env = root.path().join("srv").display().to_string();
    for watch_root in ["true", "false"] {
        let env = [
            ("RUNTIME_ROOT", root_env.as_str()),
            ("RUNTIME_SUBDIRECTORY", "rl"),
            ("RUNTIME_WATCH_ROOT", watch_root),
        ];
        let server = Ratekeeper::spawn_in(root.path(), &[], &env);
        assert!(limited(&server).await, "RUNTIME_WATCH_ROOT={watch_root}");
    }

    // Dot files are read unless RUNTIME_IGNOREDOTFILES (a broken one here).
    write(&config.join(".hidden/broken"), "domain: [");
    let env = [
        ("RUNTIME_ROOT", root_env.as_str()),
        ("RUNTIME_SUBDIRECTORY", "rl"),
    ];
    let stderr = refused(&env);
    assert!(stderr.contains(".hidden/broken"), "{stderr}");
    let mut with_ignore = env.to_vec();
    with_ignore.push(("RUNTIME_IGNOREDOTFILES", "true"));
    let server = Ratekeeper::spawn_in(root.path(), &[], &with_ignore);
    assert!(limited(&server).await);

    // RUNTIME_APPDIRECTORY names the directory.
    std::fs::rename(&config, root.path().join("srv/rl/limits")).unwrap();
    with_ignore.push(("RUNTIME_APPDIRECTORY", "limits"));
    let server = Ratekeeper::spawn_in(root.path(), &[], &with_ignore);
    assert!(limited(&server).await);
}

/// A runtime directory not there yet starts the service with no limits,
/// as envoyproxy/ratelimit starts (its runtime watches RUNTIME_ROOT's
/// parent), and its limits apply once a symlink swap makes it. Without
/// RUNTIME_WATCH_ROOT (the directory itself is watched there), or with no
/// parent to watch, the start stops, as theirs does.
#[tokio::test]
async fn a_runtime_root_made_after_the_start_is_loaded_then() {
    let root = tempfile::tempdir().unwrap();
    write(&root.path().join("v1/rl/config/l.yaml"), LIMITS);
    let current = root.path().join("current");
    let current_env = current.display().to_string();
    let env = [
        ("RUNTIME_ROOT", current_env.as_str()),
        ("RUNTIME_SUBDIRECTORY", "rl"),
    ];
    let server = Ratekeeper::spawn_in(root.path(), &[], &env);
    assert!(!limited(&server).await, "no limits before the directory");
    std::os::unix::fs::symlink(root.path().join("v1"), &current).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while !limited(&server).await {
        assert!(Instant::now() < deadline, "{}", server.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        server
            .logs()
            .contains("the limits directory does not exist yet"),
        "{}",
        server.logs()
    );

    let missing = root.path().join("later").display().to_string();
    let orphan = root.path().join("no/parent/current").display().to_string();
    for env in [
        [
            ("RUNTIME_ROOT", missing.as_str()),
            ("RUNTIME_SUBDIRECTORY", "rl"),
            ("RUNTIME_WATCH_ROOT", "false"),
        ],
        [
            ("RUNTIME_ROOT", orphan.as_str()),
            ("RUNTIME_SUBDIRECTORY", "rl"),
            ("RUNTIME_WATCH_ROOT", "true"),
        ],
    ] {
        let stderr = refused(&env);
        assert!(
            stderr.contains("cannot read the limits directory"),
            "{env:?}: {stderr}"
        );
    }
}

/// With LOG_FORMAT=json the error that stops the start is a JSON line too,
/// at logrus' `fatal` level, as their `logger.Fatalf` writes it.
#[test]
fn a_start_up_error_is_a_fatal_json_line_with_json_logs() {
    let stderr = refused(&[("BACKEND_TYPE", "memcache"), ("LOG_FORMAT", "json")]);
    for line in stderr.lines() {
        let line: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        assert!(line["@timestamp"].is_string(), "{line}");
    }
    let last: serde_json::Value =
        serde_json::from_str(stderr.lines().last().expect("a line")).expect("JSON");
    assert_eq!(last["level"], "fatal", "{last}");
    let message = last["@message"].as_str().expect("@message");
    assert!(
        message.contains("BACKEND_TYPE=memcache is not supported"),
        "{message}"
    );
}

/// LOG_LEVEL=debug says, for each descriptor of a request, what it matched
/// and decided, as theirs says at debug: the way to find why a request was
/// limited.
#[tokio::test]
async fn debug_logs_say_what_each_descriptor_matched_and_decided() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let server =
        Ratekeeper::spawn_with_env(&dir.path().join("limits"), &[], &[("LOG_LEVEL", "debug")]);
    assert!(limited(&server).await);
    let mut client = server.client().await;
    let other = request("web", vec![descriptor(&[("path", "/x")])]);
    client.should_rate_limit(other).await.unwrap();
    let logs = server.logs();
    let decided: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("msg=\"descriptor decided\""))
        .collect();
    assert_eq!(decided.len(), 3, "{logs}");
    for (line, code) in decided[..2].iter().zip(["OK", "OVER_LIMIT"]) {
        for part in [
            " level=debug ",
            " domain=web ",
            " entries=\"user=a\" ",
            " rule=user",
            &format!(" code={code} "),
        ] {
            assert!(line.contains(part), "{part:?} in {line}");
        }
        assert!(
            line.contains(" limits=\"") && line.contains(" hits=1 remaining=0 over="),
            "{line}"
        );
    }
    assert!(
        decided[2].contains(" rule=\"(none)\"") && decided[2].contains(" code=OK "),
        "{}",
        decided[2]
    );
    // Only its own lines, as theirs: not the HTTP/2 library's frames.
    assert!(!logs.contains("frame="), "{logs}");
}

/// Off a terminal, text logs are logrus' logfmt, and so is the error that
/// stops the start: `time="…" level=fatal msg="…"`.
#[test]
fn text_logs_and_a_start_up_error_are_logrus_logfmt() {
    let output = Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
        .args(["--grpc-addr", "127.0.0.1:0", "--metrics-addr", "off"])
        .args(["--http-addr", "off", "--debug-addr", "off"])
        .env_remove("REDIS_URL")
        .env("BACKEND_TYPE", "memcache")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(!lines.is_empty(), "{stderr}");
    for line in &lines {
        assert!(
            line.starts_with("time=\"") && line.contains("Z\" level="),
            "{line}"
        );
    }
    let last = lines[lines.len() - 1];
    assert!(
        last.contains(" level=fatal msg=\"BACKEND_TYPE=memcache is not supported"),
        "{last}"
    );
}

#[test]
fn memcache_is_refused_at_start() {
    let stderr = refused(&[("BACKEND_TYPE", "memcache")]);
    assert!(
        stderr.contains("BACKEND_TYPE=memcache is not supported"),
        "{stderr}"
    );
}

#[tokio::test]
async fn their_settings_without_effect_are_named_in_one_warning() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let server = Ratekeeper::spawn_with_env(
        &dir.path().join("limits"),
        &[],
        &[
            ("REDIS_PIPELINE_WINDOW", "1ms"),
            ("DISABLE_STATS", "true"),
            ("MEMCACHE_SRV", "_memcache._tcp"),
            ("BACKEND_TYPE", "redis"),
        ],
    );
    assert!(limited(&server).await);
    let logs = server.logs();
    let warnings: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("envoyproxy/ratelimit settings set but ignored"))
        .collect();
    assert_eq!(warnings.len(), 1, "{logs}");
    for name in [
        "REDIS_PIPELINE_WINDOW (",
        "DISABLE_STATS (use `METRICS_ADDR=off`)",
        "MEMCACHE_SRV (",
    ] {
        assert!(warnings[0].contains(name), "{name}: {logs}");
    }
    assert!(!warnings[0].contains("BACKEND_TYPE ("), "{logs}");
}

#[test]
fn grpc_host_and_port_name_the_grpc_listener() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("l.yaml"), LIMITS);
    let port = free_port();
    let mut command = Command::new(env!("CARGO_BIN_EXE_ratekeeper"));
    command
        .args(["--config-dir", &dir.path().display().to_string()])
        .args([
            "--metrics-addr",
            "off",
            "--http-addr",
            "off",
            "--debug-addr",
            "off",
        ])
        .env_remove("GRPC_ADDR")
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", port.to_string());
    let line = common::readiness_of(&mut command);
    assert!(line.contains(&format!("grpc=127.0.0.1:{port} ")), "{line}");
}

/// Their hosts set to nothing listen on every interface (Go's `:PORT`);
/// the debug listener's port taken is written and the start goes on, the
/// HTTP listener's (`/healthcheck`) stops it, as theirs.
#[test]
fn empty_hosts_listen_everywhere_and_taken_ports_are_met_as_theirs() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("l.yaml"), LIMITS);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port().to_string();
    let (grpc, http) = (free_port().to_string(), free_port().to_string());
    let mut command = Command::new(env!("CARGO_BIN_EXE_ratekeeper"));
    command
        .args(["--config-dir", &dir.path().display().to_string()])
        .args(["--metrics-addr", "off", "--admin-addr", "off"])
        .env_remove("GRPC_ADDR")
        .envs([
            ("GRPC_HOST", ""),
            ("GRPC_PORT", &grpc),
            ("HOST", ""),
            ("PORT", &http),
        ])
        .envs([("DEBUG_HOST", "127.0.0.1"), ("DEBUG_PORT", &taken_port)]);
    let line = common::readiness_of(&mut command);
    for expected in [
        format!("grpc=[::]:{grpc} "),
        format!("http=[::]:{http} "),
        "debug=off".into(),
    ] {
        assert!(line.contains(&expected), "{expected}: {line}");
    }
    let output = command
        .envs([
            ("HOST", "127.0.0.1"),
            ("PORT", &taken_port),
            ("DEBUG_PORT", "0"),
        ])
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(!output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let says = format!("cannot listen for HTTP on 127.0.0.1:{taken_port}");
    assert!(stderr.contains(&says), "{stderr}");
}

#[tokio::test]
async fn redis_socket_type_unix_counts_in_redis_through_its_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("redis.sock").display().to_string();
    let redis = RedisServer::spawn_free(&["--unixsocket", &socket]);
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let server = Ratekeeper::spawn_with_env(
        &dir.path().join("limits"),
        &[],
        &[("REDIS_URL", &socket), ("REDIS_SOCKET_TYPE", "unix")],
    );
    assert!(limited(&server).await);
    let mut redis_conn = redis.client().get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("rk:*")
        .query(&mut redis_conn)
        .unwrap();
    assert_eq!(keys.len(), 1, "the counter is in that Redis: {keys:?}");
    assert!(
        server.logs().contains("level=info msg=\"serving gRPC\"")
            && server.logs().contains(" store=redis"),
        "{}",
        server.logs()
    );
}

/// Limiter calls Redis sees for 5 requests of one user over a limit of 1,
/// with `env` set.
async fn redis_calls_for_five_requests(env: &[(&str, &str)]) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let redis = RedisServer::start();
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let url = redis.url();
    let mut env = env.to_vec();
    env.push(("REDIS_URL", &url));
    let server = Ratekeeper::spawn_with_env(&dir.path().join("limits"), &[], &env);
    let mut client = server.client().await;
    let mut conn = redis.client().get_connection().unwrap();
    // Calls made before (the lanes' start-up, the store probe's) are not
    // the requests'.
    let before = common::limiter_calls(&mut conn);
    for _ in 0..5 {
        let ask = request("web", vec![descriptor(&[("user", "a")])]);
        client.should_rate_limit(ask).await.unwrap();
    }
    common::limiter_calls(&mut conn) - before
}

#[tokio::test]
async fn local_cache_size_zero_turns_the_over_limit_cache_off() {
    // Requests 3 to 5 are refused: from the cache when it is on, 3 calls
    // fewer. A probe of the store may fall among them (one more call in
    // one run: hence 2, not 3).
    let off = redis_calls_for_five_requests(&[("LOCAL_CACHE_SIZE_IN_BYTES", "0")]).await;
    let on = redis_calls_for_five_requests(&[("LOCAL_CACHE_SIZE_IN_BYTES", "1000000")]).await;
    assert!(off >= on + 2, "off {off}, on {on}");
}

/// A TCP port relaying each connection to the Unix socket at `path` (so
/// the usual gRPC client can reach a server listening only there).
async fn relay_to(path: std::path::PathBuf) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            let mut unix = tokio::net::UnixStream::connect(&path).await.unwrap();
            tokio::spawn(async move {
                let _ = tokio::io::copy_bidirectional(&mut tcp, &mut unix).await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn grpc_uds_serves_should_rate_limit_on_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let socket = dir.path().join("grpc.sock");
    // A stale socket file of an earlier run is replaced.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let mut server = Ratekeeper::spawn_with_env(
        &dir.path().join("limits"),
        &[],
        &[("GRPC_UDS", &socket.display().to_string())],
    );
    assert_eq!(server.grpc, format!("unix:{}", socket.display()));
    server.grpc = relay_to(socket.clone()).await;
    assert!(limited(&server).await);
    // Gone once the server is, as a Go listener removes its socket.
    assert!(server.terminate().success());
    assert!(!socket.exists(), "the socket file outlived the server");
}

/// REDIS_SENTINEL_AUTH is the sentinels' password, or `user:password` (an
/// ACL user), split at the first `:` as theirs splits it.
#[tokio::test]
async fn redis_sentinel_auth_is_the_sentinels_password_or_user() {
    let dir = tempfile::tempdir().unwrap();
    let master = RedisServer::start();
    let sentinel = Sentinel::start_with(
        master.port,
        dir.path(),
        "requirepass s3cret\nuser sentuser on >su:pw +@all\n",
    );
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let url = format!("mymaster,127.0.0.1:{}", sentinel.port);
    for (round, auth) in ["s3cret", "sentuser:su:pw"].into_iter().enumerate() {
        let env = [
            ("REDIS_URL", url.as_str()),
            ("REDIS_TYPE", "sentinel"),
            ("REDIS_SENTINEL_AUTH", auth),
            ("FAILURE_MODE", "unavailable"),
        ];
        let server = Ratekeeper::spawn_with_env(&dir.path().join("limits"), &[], &env);
        // Through the sentinels to the master: the counter is there.
        let user = format!("u{round}");
        until_answered(&server, &user, Duration::from_secs(10), auth).await;
        let mut redis_conn = master.client().get_connection().unwrap();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("rk:*")
            .query(&mut redis_conn)
            .unwrap();
        assert_eq!(keys.len(), round + 1, "{auth}: {keys:?}");
    }
}

/// Values theirs starts with, read as theirs reads them: a REDIS_URL's
/// `password` and `db` query parameters (radix reads them), REDIS_TIMEOUT
/// 0 (no deadline there: the defaults here), a lone REDIS_TLS_CLIENT_CERT
/// (ignored), a negative EXPIRATION_JITTER_MAX_SECONDS (none) and
/// LOCAL_CACHE_SIZE_IN_BYTES (on), REDIS_SOCKET_TYPE tcp4.
#[tokio::test]
async fn redis_settings_theirs_starts_with_start_here() {
    let dir = tempfile::tempdir().unwrap();
    let redis = RedisServer::spawn_free(&["--requirepass", "s3:cret"]);
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let url = format!("redis://127.0.0.1:{}?password=s3%3Acret&db=3", redis.port);
    let env = [
        ("REDIS_URL", url.as_str()),
        ("REDIS_TIMEOUT", "0"),
        ("REDIS_TLS_CLIENT_CERT", "/nowhere/client.crt"),
        ("EXPIRATION_JITTER_MAX_SECONDS", "-5"),
        ("LOCAL_CACHE_SIZE_IN_BYTES", "-1"),
        ("REDIS_SOCKET_TYPE", "tcp4"),
    ];
    let server = Ratekeeper::spawn_with_env(&dir.path().join("limits"), &[], &env);
    assert!(limited(&server).await, "{}", server.logs());
    let mut conn = redis::Client::open(format!("redis://:s3%3Acret@127.0.0.1:{}/3", redis.port))
        .unwrap()
        .get_connection()
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg("rk:*").query(&mut conn).unwrap();
    assert_eq!(keys.len(), 1, "the counter is in db 3: {keys:?}");
    assert!(
        server.logs().contains("REDIS_TLS_CLIENT_KEY go together"),
        "{}",
        server.logs()
    );
}

/// A TLS-only `redis-server` (or sentinel) with `dir`'s `server.crt`,
/// trusting `dir/ca.crt`; killed when dropped.
struct TlsRedis {
    child: std::process::Child,
    port: u16,
}

impl TlsRedis {
    /// `redis-server` with `args` before the TLS ones (a sentinel's
    /// configuration file, `--sentinel`, `--tls-auth-clients`).
    fn spawn(dir: &Path, args: &[&str]) -> TlsRedis {
        let file = |name: &str| dir.join(name).display().to_string();
        let port = free_port();
        let child = Command::new("redis-server")
            .args(args)
            .args(["--port", "0", "--tls-port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", ""])
            .args(["--tls-cert-file", &file("server.crt")])
            .args(["--tls-key-file", &file("server.key")])
            .args(["--tls-ca-cert-file", &file("ca.crt")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "TLS redis-server did not start"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        TlsRedis { child, port }
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TLS-only `redis-server` whose certificate names `redis.example` (not
/// 127.0.0.1), signed by `dir/ca.crt`.
fn misnamed_tls_redis(dir: &Path) -> TlsRedis {
    common::make_certs(dir, "DNS:redis.example");
    TlsRedis::spawn(dir, &["--tls-auth-clients", "no"])
}

/// Sentinel over TLS as envoyproxy/ratelimit dials it: the sentinels with
/// the master's TLS settings (its CA and client certificate), here a
/// TLS-only sentinel and a TLS-only master that both require client
/// certificates.
#[tokio::test]
async fn sentinel_over_tls_takes_the_masters_ca_and_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    common::make_certs(dir.path(), "IP:127.0.0.1");
    let master = TlsRedis::spawn(dir.path(), &["--tls-auth-clients", "yes"]);
    let file = |name: &str| dir.path().join(name).display().to_string();
    let conf = dir.path().join("sentinel.conf");
    std::fs::write(
        &conf,
        format!(
            "sentinel monitor mymaster 127.0.0.1 {} 1\ntls-replication yes\n\
             tls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\n",
            master.port,
            file("client.crt"),
            file("client.key"),
            file("ca.crt"),
        ),
    )
    .unwrap();
    let conf = conf.display().to_string();
    let sentinel = TlsRedis::spawn(dir.path(), &[&conf, "--sentinel"]);
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let url = format!("mymaster,127.0.0.1:{}", sentinel.port);
    let env = [
        ("REDIS_TYPE", "sentinel"),
        ("REDIS_URL", url.as_str()),
        ("REDIS_TLS", "true"),
        ("REDIS_TLS_CACERT", &file("ca.crt")),
        ("REDIS_TLS_CLIENT_CERT", &file("client.crt")),
        ("REDIS_TLS_CLIENT_KEY", &file("client.key")),
        ("FAILURE_MODE", "unavailable"),
        // A loaded machine (CI) can take more than the default 20 ms.
        ("REDIS_TIMEOUT_MS", "2000"),
    ];
    let server = Ratekeeper::spawn_with_env(&dir.path().join("limits"), &[], &env);
    let what = "never answered through the TLS sentinel";
    until_answered(&server, "a", Duration::from_secs(5), what).await;
    let mut client = server.client().await;
    let ask = || request("web", vec![descriptor(&[("user", "a")])]);
    let answer = client.should_rate_limit(ask()).await.unwrap().into_inner();
    assert_eq!(
        answer.overall_code,
        Code::OverLimit as i32,
        "counted in Redis"
    );
}

#[tokio::test]
async fn redis_tls_skip_hostname_verification_checks_the_chain_only() {
    let dir = tempfile::tempdir().unwrap();
    let redis = misnamed_tls_redis(dir.path());
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let url = format!("rediss://127.0.0.1:{}", redis.port);
    let ca = dir.path().join("ca.crt").display().to_string();
    let with = |skip: &'static str| {
        [
            ("REDIS_URL", url.clone()),
            ("REDIS_TLS_CACERT", ca.clone()),
            ("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", skip.to_owned()),
            ("FAILURE_MODE", "unavailable".to_owned()),
        ]
    };
    let answers = |skip: &'static str| {
        let env = with(skip);
        let dir = dir.path().join("limits");
        async move {
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let server = Ratekeeper::spawn_with_env(&dir, &[], &env);
            let mut client = server.client().await;
            // Redis is connected in the background: allow it 3 s.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
            loop {
                let ask = request("web", vec![descriptor(&[("user", "a")])]);
                if client.should_rate_limit(ask).await.is_ok() {
                    return true;
                }
                if std::time::Instant::now() > deadline {
                    eprintln!("{}", server.logs());
                    return false;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    };
    assert!(!answers("false").await, "the name is checked by default");
    assert!(answers("true").await, "only the chain is checked");
}

/// `REDIS_TLS_CACERT` adds a CA to the system's roots, as theirs adds it to
/// the system pool: a Redis signed by a CA the system trusts (here through
/// `SSL_CERT_FILE`) is still reached when the file names another CA. It
/// was refused (UnknownIssuer): the file replaced the system's roots.
#[tokio::test]
async fn redis_tls_cacert_adds_to_the_system_roots() {
    let dir = tempfile::tempdir().unwrap();
    common::make_certs(dir.path(), "IP:127.0.0.1");
    let redis = TlsRedis::spawn(dir.path(), &["--tls-auth-clients", "no"]);
    let other = tempfile::tempdir().unwrap();
    common::make_certs(other.path(), "IP:127.0.0.1");
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let url = format!("rediss://127.0.0.1:{}", redis.port);
    let system = dir.path().join("ca.crt").display().to_string();
    let file = other.path().join("ca.crt").display().to_string();
    let env = [
        ("REDIS_URL", url.as_str()),
        ("SSL_CERT_FILE", &system),
        ("REDIS_TLS_CACERT", &file),
        ("FAILURE_MODE", "unavailable"),
        ("REDIS_TIMEOUT_MS", "2000"),
    ];
    let server = Ratekeeper::spawn_with_env(&dir.path().join("limits"), &[], &env);
    let mut client = server.client().await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let ask = || request("web", vec![descriptor(&[("user", "a")])]);
    while let Err(e) = client.should_rate_limit(ask()).await {
        assert!(
            std::time::Instant::now() < deadline,
            "never answered: {e:?}\n{}",
            server.logs()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// One HTTP/2 frame: type, flags, stream and payload.
type Frame = (u8, u8, u32, Vec<u8>);

/// HTTP/2 frame types and flags (RFC 9113).
const HEADERS: u8 = 1;
const RST_STREAM: u8 = 3;
const SETTINGS: u8 = 4;
const PING: u8 = 6;
const GOAWAY: u8 = 7;
const ACK: u8 = 1;
const END_HEADERS: u8 = 4;

fn write_frame(conn: &mut TcpStream, (kind, flags, stream, payload): Frame) {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut frame = vec![len[1], len[2], len[3], kind, flags];
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(&payload);
    conn.write_all(&frame).unwrap();
}

/// The next frame, or `None` once the server has closed the connection (or
/// reset it).
fn read_frame(conn: &mut TcpStream) -> Option<Frame> {
    let mut head = [0u8; 9];
    match conn.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => {
            panic!("the connection is still open: {e}")
        }
        Err(_) => return None,
    }
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    let mut payload = vec![0; len];
    conn.read_exact(&mut payload).ok()?;
    Some((head[3], head[4], stream, payload))
}

/// An HTTP/2 header block of literal fields (HPACK, no table, no Huffman).
fn header_block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in fields {
        block.push(0);
        for text in [name, value] {
            block.push(u8::try_from(text.len()).unwrap());
            block.extend_from_slice(text.as_bytes());
        }
    }
    block
}

/// GRPC_MAX_CONNECTION_AGE sends the GOAWAY at the age, and
/// GRPC_MAX_CONNECTION_AGE_GRACE closes a connection whose client ignores
/// it, a call still open, when the grace is over (as grpc-go does for
/// envoyproxy/ratelimit). A raw HTTP/2 client, to see every frame.
#[test]
fn a_connection_gets_goaway_at_its_max_age_and_is_closed_after_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("limits/l.yaml"), LIMITS);
    let (age, grace) = (Duration::from_secs(1), Duration::from_secs(3));
    let server = Ratekeeper::spawn_with_env(
        &dir.path().join("limits"),
        &[],
        &[
            ("GRPC_MAX_CONNECTION_AGE", "1s"),
            ("GRPC_MAX_CONNECTION_AGE_GRACE", "3s"),
        ],
    );
    // Before the connection: the server's clocks start later.
    let start = Instant::now();
    let mut conn = TcpStream::connect(&server.grpc).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    conn.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    write_frame(&mut conn, (SETTINGS, 0, 0, Vec::new()));
    // A call that never ends: its request stream stays open.
    let headers = header_block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (
            ":path",
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        ),
        (":authority", "ratekeeper"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]);
    write_frame(&mut conn, (HEADERS, END_HEADERS, 1, headers));
    let mut goaway = None;
    while let Some((kind, flags, stream, payload)) = read_frame(&mut conn) {
        match kind {
            // Acknowledged, as a live client does; the GOAWAY is not obeyed.
            SETTINGS if flags & ACK == 0 => write_frame(&mut conn, (SETTINGS, ACK, 0, Vec::new())),
            PING if flags & ACK == 0 => write_frame(&mut conn, (PING, ACK, 0, payload)),
            RST_STREAM if stream == 1 => panic!("the open call was reset"),
            GOAWAY if goaway.is_none() => goaway = Some(start.elapsed()),
            _ => {}
        }
    }
    let closed = start.elapsed();
    let goaway = goaway.unwrap_or_else(|| panic!("closed after {closed:?} with no GOAWAY"));
    // Generous margins: the machine may be loaded.
    assert!(
        // The age is jittered by ±10% per serving thread, as grpc-go's.
        goaway >= age.mul_f64(0.9) && goaway < age + grace - Duration::from_secs(1),
        "GOAWAY after {goaway:?}"
    );
    assert!(
        closed >= age.mul_f64(0.9) + grace && closed < age + grace + Duration::from_secs(5),
        "closed after {closed:?}"
    );
}
