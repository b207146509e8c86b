//! Stats parity with envoyproxy/ratelimit, on the running binary: the
//! Prometheus series Envoy Gateway's dashboard and alerts query (their
//! names and labels, as their statsd mapping makes them), and their statsd
//! stats received by a UDP listener.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{descriptor, request, Ratekeeper, RedisServer};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;

/// A rule one level deep, and one two levels deep whose value holds an
/// IPv4 address (their stat names turn its dots into `_`).
const LIMITS: &str = "domain: web
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: route
    value: r1
    descriptors:
      - key: remote_address
        value: 10.0.0.1
        rate_limit: {unit: hour, requests_per_unit: 100}
";

/// Sends the traffic both tests count: 6 hits on `user` (limit 5: the
/// sixth refused), 2 on the nested rule, 1 invalid request (no domain).
async fn traffic(server: &Ratekeeper) {
    let mut client = server.client().await;
    for _ in 0..6 {
        client
            .should_rate_limit(request("web", vec![descriptor(&[("user", "a")])]))
            .await
            .unwrap();
    }
    let nested = descriptor(&[("route", "r1"), ("remote_address", "10.0.0.1")]);
    for _ in 0..2 {
        client
            .should_rate_limit(request("web", vec![nested.clone()]))
            .await
            .unwrap();
    }
    let invalid = client
        .should_rate_limit(request("", vec![descriptor(&[("user", "a")])]))
        .await;
    assert!(invalid.is_err(), "an empty domain is refused");
}

#[tokio::test]
async fn prometheus_has_envoyproxy_ratelimit_series() {
    let dir = tempfile::tempdir().unwrap();
    let server = Ratekeeper::start(LIMITS, dir.path(), &["--near-limit-ratio", "0.5"]);
    traffic(&server).await;
    let text = server.metrics();
    // Limit 5, near from floor(5 × 0.5) = 2 on: hits 3, 4 and 5 are near,
    // the sixth is over (and, refused, consumed nothing).
    for expected in [
        r#"ratelimit_service_rate_limit_total_hits{domain="web",key1="user"} 6"#,
        r#"ratelimit_service_rate_limit_within_limit{domain="web",key1="user"} 5"#,
        r#"ratelimit_service_rate_limit_near_limit{domain="web",key1="user"} 3"#,
        r#"ratelimit_service_rate_limit_over_limit{domain="web",key1="user"} 1"#,
        r#"ratelimit_service_rate_limit_total_hits{domain="web",key1="route_r1",key2="remote_address_10_0_0_1"} 2"#,
        r#"ratelimit_service_rate_limit_within_limit{domain="web",key1="route_r1",key2="remote_address_10_0_0_1"} 2"#,
        r#"ratekeeper_rate_limit_near_limit{domain="web",rule="user"} 3"#,
        "ratelimit_service_config_load_success 1",
        r#"ratelimit_service_total_requests{grpc_method="ShouldRateLimit"} 9"#,
        r#"ratelimit_service_should_rate_limit_error{err_type="service_error"} 1"#,
        r#"ratelimit_service_response_time_seconds_count{grpc_method="ShouldRateLimit"} 9"#,
        // Their buckets (statsd_exporter's defaults) as well as finer ones.
        r#"ratelimit_service_response_time_seconds_bucket{grpc_method="ShouldRateLimit",le="0.5"} 9"#,
        r#"ratelimit_service_response_time_seconds_bucket{grpc_method="ShouldRateLimit",le="10"} 9"#,
        r#"ratelimit_service_response_time_seconds_bucket{grpc_method="ShouldRateLimit",le="0.00005"} "#,
        r#"ratekeeper_build_info{version=""#,
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(expected)),
            "/metrics lacks {expected:?}:\n{text}"
        );
    }
    assert!(
        !text.contains("ratelimit_service_rate_limit_over_limit{domain=\"web\",key1=\"route_r1\""),
        "a counter never counted is not shown"
    );
}

/// What a statsd listener received until `done` holds or `wait` passes:
/// for each counter line `name:n|c` the sum of its `n` under `name`, for
/// each timer line `name:ms|ms` one more under `name|ms`, for a gauge
/// `name:v|g` the last `v` under `name|g`; DogStatsD tags (`|#k:v,…`) stay
/// on the name as `name#k:v,…`.
fn receive(
    socket: &std::net::UdpSocket,
    wait: Duration,
    done: impl Fn(&BTreeMap<String, u64>) -> bool,
) -> BTreeMap<String, u64> {
    let mut sums = BTreeMap::new();
    let deadline = Instant::now() + wait;
    let mut buf = [0u8; 2048];
    while !done(&sums) && Instant::now() < deadline {
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let Ok(n) = socket.recv(&mut buf) else {
            continue;
        };
        assert!(n <= 1432, "a datagram of {n} bytes");
        for line in std::str::from_utf8(&buf[..n]).unwrap().lines() {
            let (name, n) = parse_line(line);
            match name.ends_with("|g") {
                true => sums.insert(name, n).map_or((), drop),
                false => *sums.entry(name).or_default() += n,
            }
        }
    }
    sums
}

/// A statsd line's key in [`receive`]'s sums and what it adds.
fn parse_line(line: &str) -> (String, u64) {
    let (name, rest) = line.split_once(':').expect("name:value|type");
    let mut fields = rest.split('|');
    let value = fields.next().unwrap();
    let kind = fields.next().expect("a type");
    let rest: Vec<&str> = fields.collect();
    let tags = rest.iter().find_map(|f| f.strip_prefix('#'));
    let mut name = match tags {
        Some(tags) => format!("{name}#{tags}"),
        None => name.to_owned(),
    };
    // DogStatsD's container field (origin detection), kept in the key.
    if let Some(container) = rest.iter().find(|f| f.starts_with("c:")) {
        name = format!("{name}|{container}");
    }
    match kind {
        "c" => (name, value.parse().expect("a whole count")),
        "ms" => {
            let ms: f64 = value.parse().expect("milliseconds");
            assert!((0.0..10_000.0).contains(&ms), "{line}");
            (format!("{name}|ms"), 1)
        }
        "g" => (format!("{name}|g"), value.parse().expect("a whole gauge")),
        other => panic!("type {other} in {line:?}"),
    }
}

#[tokio::test]
async fn statsd_receives_their_stat_names_when_a_host_is_given() {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    // STATSD_HOST alone turns statsd on.
    let (_dir, server) = with_statsd(&socket, LIMITS, &[("EXTRA_TAGS", "zone:eu.west,app:rk")]);
    traffic(&server).await;
    let tags = ".__app=rk.__zone=eu_west";
    let expected: Vec<(String, u64)> = [
        ("ratelimit.service.rate_limit.web.user.total_hits", 6),
        ("ratelimit.service.rate_limit.web.user.within_limit", 5),
        ("ratelimit.service.rate_limit.web.user.near_limit", 1),
        ("ratelimit.service.rate_limit.web.user.over_limit", 1),
        (
            "ratelimit.service.rate_limit.web.route_r1.remote_address_10_0_0_1.total_hits",
            2,
        ),
        ("ratelimit.service.config_load_success", 1),
        ("ratelimit_server.ShouldRateLimit.total_requests", 9),
        ("ratelimit.service.call.should_rate_limit.service_error", 1),
        // Every call timed, a sample each.
        ("ratelimit_server.ShouldRateLimit.response_time", 9),
    ]
    .into_iter()
    .map(|(name, n)| match name.ends_with("response_time") {
        true => (format!("{name}{tags}|ms"), n),
        false => (format!("{name}{tags}"), n),
    })
    .collect();
    let sums = receive(&socket, Duration::from_secs(10), |sums| {
        expected.iter().all(|(name, n)| sums.get(name) == Some(n))
    });
    for (name, n) in &expected {
        assert_eq!(sums.get(name), Some(n), "{name} in {sums:#?}");
    }
    assert!(
        !sums.keys().any(|k| k.contains("shadow_mode")),
        "nothing counted, nothing sent: {sums:#?}"
    );
}

#[tokio::test]
async fn statsd_stays_off_when_use_statsd_is_false() {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = socket.local_addr().unwrap().port().to_string();
    let dir = tempfile::tempdir().unwrap();
    let limits = dir.path().join("limits");
    std::fs::create_dir_all(&limits).unwrap();
    std::fs::write(limits.join("limits.yaml"), LIMITS).unwrap();
    let server = Ratekeeper::spawn_with_env(
        &limits,
        &[],
        &[
            ("USE_STATSD", "false"),
            ("STATSD_HOST", "127.0.0.1"),
            ("STATSD_PORT", &port),
            ("STATS_FLUSH_INTERVAL", "50ms"),
        ],
    );
    traffic(&server).await;
    let sums = receive(&socket, Duration::from_secs(1), |sums| !sums.is_empty());
    assert!(sums.is_empty(), "{sums:#?}");
}

/// Their `total_hits` series in `/metrics` text, sorted.
fn their_total_hits(text: &str) -> Vec<&str> {
    let mut theirs: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("ratelimit_service_rate_limit_total_hits{"))
        .collect();
    theirs.sort();
    theirs
}

/// `value_to_metric` puts the request's value in their stat key where the
/// config gives none (a value-less node, a wildcard), level by level; the
/// distinct keys are capped like `detailed_metric`'s.
#[tokio::test]
async fn value_to_metric_puts_request_values_in_their_stat_key() {
    let limits = "domain: web
descriptors:
  - key: route
    value: r*
    value_to_metric: true
    descriptors:
      - key: user
        value_to_metric: true
        rate_limit: {unit: hour, requests_per_unit: 100}
  - key: plain
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 100}
";
    let dir = tempfile::tempdir().unwrap();
    let server = Ratekeeper::start(limits, dir.path(), &["--max-detailed-metric-series", "2"]);
    let mut client = server.client().await;
    for (route, user) in [
        ("r1", "alice"),
        ("r1", "alice"),
        ("r2", "bob"),
        ("r3", "carol"),
    ] {
        client
            .should_rate_limit(request(
                "web",
                vec![descriptor(&[("route", route), ("user", user)])],
            ))
            .await
            .unwrap();
    }
    client
        .should_rate_limit(request(
            "web",
            vec![descriptor(&[("plain", "p"), ("user", "dave")])],
        ))
        .await
        .unwrap();
    let text = server.metrics();
    assert_eq!(
        their_total_hits(&text),
        [
            r#"ratelimit_service_rate_limit_total_hits{domain="web",key1="overflow"} 1"#,
            r#"ratelimit_service_rate_limit_total_hits{domain="web",key1="plain",key2="user"} 1"#,
            r#"ratelimit_service_rate_limit_total_hits{domain="web",key1="route_r1",key2="user_alice"} 2"#,
            r#"ratelimit_service_rate_limit_total_hits{domain="web",key1="route_r2",key2="user_bob"} 1"#,
        ],
        "{text}"
    );
    assert!(
        text.contains(r#"ratekeeper_rate_limit_total_hits{domain="web",rule="route_r*.user"} 4"#),
        "ratekeeper's own series keep the rule's path:\n{text}"
    );
}

/// A `share_threshold` wildcard's level keeps its pattern in their stat
/// key: over `value_to_metric`, and under a `detailed_metric` rule, whose
/// other levels keep the request's values (their share_threshold.yaml).
#[tokio::test]
async fn share_threshold_levels_keep_their_pattern_in_their_stat_key() {
    let limits = "domain: d
descriptors:
  - key: route
    value: api/*
    share_threshold: true
    value_to_metric: true
    descriptors:
      - key: method
        rate_limit: {unit: minute, requests_per_unit: 60}
  - key: service
    value: svc/*
    share_threshold: true
    descriptors:
      - key: endpoint
        detailed_metric: true
        rate_limit: {unit: minute, requests_per_unit: 80}
  - key: midroute
    value: /api*v2
    share_threshold: true
    value_to_metric: true
    rate_limit: {unit: minute, requests_per_unit: 80}
";
    let dir = tempfile::tempdir().unwrap();
    let server = Ratekeeper::start(limits, dir.path(), &[]);
    let mut client = server.client().await;
    for entries in [
        vec![("route", "api/v1"), ("method", "GET")],
        vec![("route", "api/v2"), ("method", "GET")],
        vec![("service", "svc/user"), ("endpoint", "get")],
        vec![("midroute", "/api/v2")],
    ] {
        client
            .should_rate_limit(request("d", vec![descriptor(&entries)]))
            .await
            .unwrap();
    }
    let text = server.metrics();
    assert_eq!(
        their_total_hits(&text),
        [
            r#"ratelimit_service_rate_limit_total_hits{domain="d",key1="midroute_/api*v2"} 1"#,
            r#"ratelimit_service_rate_limit_total_hits{domain="d",key1="route_api/*",key2="method"} 2"#,
            r#"ratelimit_service_rate_limit_total_hits{domain="d",key1="service_svc/*",key2="endpoint_get"} 1"#,
        ],
        "{text}"
    );
}

/// One store call is one sample of `ratekeeper_store_call_duration_seconds`:
/// one per decision here (sequential requests, one descriptor each), never
/// more than the limiter calls Redis ran (a first call on a connection may
/// load the library and call again) and a few probes.
#[tokio::test]
async fn store_calls_are_timed_once_each() {
    let redis = common::RedisServer::start();
    let url = redis.url();
    let dir = tempfile::tempdir().unwrap();
    let server = Ratekeeper::start(LIMITS, dir.path(), &["--redis-url", &url]);
    let mut conn = redis.client().get_connection().unwrap();
    traffic(&server).await;
    let limiter_calls = common::limiter_calls(&mut conn);
    assert!(
        limiter_calls >= 8,
        "one limiter call per valid request at least"
    );
    let text = server.metrics();
    let count: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("ratekeeper_store_call_duration_seconds_count "))
        .unwrap_or_else(|| panic!("no store call histogram:\n{text}"))
        .parse()
        .unwrap();
    assert!(
        (8..=limiter_calls + 5).contains(&count),
        "{count} samples for {limiter_calls} limiter calls (and a few probes):\n{text}"
    );
}

/// A decision the store failed is their `redis_error`, whatever the failure
/// mode then answered (here `open`: OK), and its hits still count in
/// `total_hits` (theirs counts them before it asks Redis), in ours too.
#[tokio::test]
async fn a_store_failure_counts_as_their_redis_error() {
    let dir = tempfile::tempdir().unwrap();
    let nobody = format!("redis://127.0.0.1:{}", common::free_port());
    let server = Ratekeeper::start(
        LIMITS,
        dir.path(),
        &["--redis-url", &nobody, "--failure-mode", "open"],
    );
    let mut client = server.client().await;
    let answer = client
        .should_rate_limit(request("web", vec![descriptor(&[("user", "a")])]))
        .await
        .expect("failure mode open answers");
    assert_eq!(answer.into_inner().overall_code, 1, "OK");
    let text = server.metrics();
    assert!(
        text.contains(r#"ratelimit_service_should_rate_limit_error{err_type="redis_error"} 1"#),
        "{text}"
    );
    for series in [
        r#"ratelimit_service_rate_limit_total_hits{domain="web",key1="user"} 1"#,
        r#"ratekeeper_rate_limit_total_hits{domain="web",rule="user"} 1"#,
    ] {
        assert!(text.contains(series), "{series}:\n{text}");
    }
}

/// A limits directory holding `yaml` (kept alive by the returned guard).
fn limits_dir(yaml: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let limits = dir.path().join("limits");
    std::fs::create_dir_all(&limits).unwrap();
    std::fs::write(limits.join("limits.yaml"), yaml).unwrap();
    (dir, limits)
}

/// USE_DOG_STATSD: the same stats, tags DogStatsD's way, names through
/// the mogrifiers of their README's example.
#[tokio::test]
async fn dogstatsd_gets_tags_and_mogrified_names() {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = socket.local_addr().unwrap().port().to_string();
    let (_dir, limits) = limits_dir(LIMITS);
    let server = Ratekeeper::spawn_with_env(
        &limits,
        &[],
        &[
            ("USE_DOG_STATSD", "true"),
            ("STATSD_PORT", &port),
            ("STATSD_HOST", "127.0.0.1"),
            ("STATS_FLUSH_INTERVAL", "100ms"),
            ("EXTRA_TAGS", "zone:eu.west,app:rk"),
            ("USE_DOG_STATSD_MOGRIFIERS", "HITS"),
            (
                "DOG_STATSD_MOGRIFIER_HITS_PATTERN",
                r"^ratelimit\.service\.rate_limit\.([^.]+)\.(.*)\.([^.]+)$",
            ),
            (
                "DOG_STATSD_MOGRIFIER_HITS_NAME",
                "ratelimit.service.rate_limit.$3",
            ),
            ("DOG_STATSD_MOGRIFIER_HITS_TAGS", "domain:$1,descriptor:$2"),
        ],
    );
    traffic(&server).await;
    // The server runs where this test does: the container it finds is
    // this one's (none on most test machines; `container_id`'s own tests
    // read made-up cgroups).
    let env = |name: &str| std::env::var(name).ok();
    let container = ratekeeper::container_id::detect(env, &ratekeeper::container_id::LINUX)
        .map(|id| format!("|c:{id}"))
        .unwrap_or_default();
    let tags = "#app:rk,zone:eu_west";
    let expected: Vec<(String, u64)> = [
        (
            "ratelimit.service.rate_limit.total_hits",
            ",domain:web,descriptor:user",
            6,
        ),
        (
            "ratelimit.service.rate_limit.over_limit",
            ",domain:web,descriptor:user",
            1,
        ),
        (
            "ratelimit.service.rate_limit.total_hits",
            ",domain:web,descriptor:route_r1.remote_address_10_0_0_1",
            2,
        ),
        ("ratelimit_server.ShouldRateLimit.total_requests", "", 9),
        ("ratelimit_server.ShouldRateLimit.response_time", "|ms", 9),
    ]
    .into_iter()
    .map(|(name, more, n)| match more.strip_prefix('|') {
        Some(kind) => (format!("{name}{tags}{container}|{kind}"), n),
        None => (format!("{name}{tags}{more}{container}"), n),
    })
    .collect();
    let sums = receive(&socket, Duration::from_secs(10), |sums| {
        expected.iter().all(|(name, n)| sums.get(name) == Some(n))
    });
    for (name, n) in &expected {
        assert_eq!(sums.get(name), Some(n), "{name} in {sums:#?}");
    }
    assert!(
        !sums.keys().any(|k| k.contains(".__")),
        "no gostats tags in names: {sums:#?}"
    );
}

/// The start-up error of the binary run with `env` (it must refuse).
fn refused_start(env: &[(&str, &str)]) -> String {
    let (_dir, limits) = limits_dir(LIMITS);
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_ratekeeper"));
    command
        .arg("--config-dir")
        .arg(&limits)
        .args([
            "--grpc-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .args(["--http-addr", "127.0.0.1:0", "--debug-addr", "127.0.0.1:0"])
        .env("ADMIN_ADDR", "127.0.0.1:0")
        .envs(env.iter().copied());
    common::refused_start_of(&mut command)
}

#[test]
fn dogstatsd_and_statsd_together_are_refused_as_theirs_are() {
    let stderr = refused_start(&[("USE_DOG_STATSD", "true"), ("USE_STATSD", "true")]);
    assert!(stderr.contains("more than one stats sink"), "{stderr}");
    let stderr = refused_start(&[
        ("USE_DOG_STATSD", "true"),
        ("USE_DOG_STATSD_MOGRIFIERS", "X"),
    ]);
    assert!(
        stderr.contains("mogrifier X: no PATTERN specified"),
        "{stderr}"
    );
}

/// A mapping as a user who renamed their series would write it: globs for
/// the rule counters and the timer, a regex for the calls, a drop.
const MAPPER: &str = r#"mappings:
  - match: "ratelimit.service.rate_limit.*.*.*"
    name: "rl_hits_$3"
    labels:
      ns: "$1"
      descriptor: "$2"
  - match: "ratelimit_server\\.(\\w+)\\.total_requests"
    match_type: regex
    match_metric_type: counter
    name: "rl_calls"
    labels:
      method: "$1"
  - match: "ratelimit_server.*.response_time"
    name: "rl_latency_ms"
    timer_type: histogram
    buckets: [1, 5, 50]
  - match: "ratelimit.service.*"
    action: drop
"#;

#[tokio::test]
async fn a_mapper_file_names_their_series() {
    let (dir, limits) = limits_dir(LIMITS);
    let mapper = dir.path().join("mapper.yaml");
    std::fs::write(&mapper, MAPPER).unwrap();
    let mapper = mapper.display().to_string();
    let server = Ratekeeper::spawn_with_env(&limits, &[], &[("PROMETHEUS_MAPPER_YAML", &mapper)]);
    traffic(&server).await;
    let text = server.metrics();
    for expected in [
        // Labels in name order, as Prometheus' Go client writes them.
        r#"rl_hits_total_hits{descriptor="user",ns="web"} 6"#,
        r#"rl_hits_over_limit{descriptor="user",ns="web"} 1"#,
        r#"rl_calls{method="ShouldRateLimit"} 9"#,
        r#"rl_latency_ms_bucket{le="50"} 9"#,
        // Three parts past `rate_limit`: the glob does not take it; the
        // name stays, escaped, as statsd_exporter leaves it.
        "ratelimit_service_rate_limit_web_route_r1_remote_address_10_0_0_1_total_hits 2",
        // Not in the mapping: escaped as well.
        "ratelimit_service_call_should_rate_limit_service_error 1",
        r#"ratekeeper_rate_limit_total_hits{domain="web",rule="user"} 6"#,
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(expected)),
            "/metrics lacks {expected:?}:\n{text}"
        );
    }
    for gone in [
        "ratelimit_service_rate_limit_total_hits{",
        "ratelimit_service_config_load_success",
        "ratelimit_config_load_success",
    ] {
        assert!(
            !text.contains(gone),
            "{gone}: the default mapping is replaced, dropped stats are not shown:\n{text}"
        );
    }
}

#[test]
fn a_mapper_file_with_unsupported_features_stops_the_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let mapper = dir.path().join("mapper.yaml");
    let text = "mappings:\n  - match: \"a.*\"\n    name: a\n  - match: \"b.*\"\n    match_type: fsm\n    name: b\n";
    std::fs::write(&mapper, text).unwrap();
    let mapper = mapper.display().to_string();
    let stderr = refused_start(&[("PROMETHEUS_MAPPER_YAML", &mapper)]);
    assert!(stderr.contains(&format!("{mapper}:5:")), "{stderr}");
    assert!(stderr.contains("fsm"), "{stderr}");
    // A file that cannot be read too (theirs maps nothing then).
    let missing = dir.path().join("missing.yaml").display().to_string();
    let stderr = refused_start(&[("PROMETHEUS_MAPPER_YAML", &missing)]);
    assert!(
        stderr.contains(&format!("{missing}: cannot read")),
        "{stderr}"
    );
}

/// A server with a limit of 1 per hour on `user`, sending statsd to
/// `socket` every 100 ms, with `env` set too.
fn one_per_hour(
    socket: &std::net::UdpSocket,
    env: &[(&str, &str)],
) -> (tempfile::TempDir, Ratekeeper) {
    with_statsd(
        socket,
        "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1}\n",
        env,
    )
}

/// A server on the limits `yaml` sending statsd to `socket` every 100 ms,
/// with `env` besides.
fn with_statsd(
    socket: &std::net::UdpSocket,
    yaml: &str,
    env: &[(&str, &str)],
) -> (tempfile::TempDir, Ratekeeper) {
    let port = socket.local_addr().unwrap().port().to_string();
    let (dir, limits) = limits_dir(yaml);
    let mut all = vec![
        ("STATSD_HOST", "127.0.0.1"),
        ("STATSD_PORT", port.as_str()),
        ("STATS_FLUSH_INTERVAL", "100ms"),
    ];
    all.extend_from_slice(env);
    (dir, Ratekeeper::spawn_with_env(&limits, &[], &all))
}

/// `n` requests on `user` (the answers' overall codes), then one for the
/// unknown domain `nope`.
async fn hits(server: &Ratekeeper, n: usize) -> Vec<i32> {
    let mut client = server.client().await;
    let mut codes = Vec::new();
    for _ in 0..n {
        let answer = client
            .should_rate_limit(request("web", vec![descriptor(&[("user", "a")])]))
            .await
            .unwrap();
        codes.push(answer.into_inner().overall_code);
    }
    // An unknown domain counts once per descriptor, as theirs looks each
    // one's limit up.
    let two = vec![descriptor(&[("user", "a")]), descriptor(&[("user", "b")])];
    client
        .should_rate_limit(request("nope", two))
        .await
        .unwrap();
    codes
}

/// Asserts that statsd sent `expected` (sums) and /metrics has the lines
/// starting with `series`.
fn assert_stats(
    socket: &std::net::UdpSocket,
    server: &Ratekeeper,
    expected: &[(&str, u64)],
    series: &[&str],
) {
    let sums = receive(socket, Duration::from_secs(10), |sums| {
        expected.iter().all(|(name, n)| sums.get(*name) == Some(n))
    });
    for (name, n) in expected {
        assert_eq!(sums.get(*name), Some(n), "{name} in {sums:#?}");
    }
    let text = server.metrics();
    for expected in series {
        assert!(
            text.lines().any(|l| l.starts_with(expected)),
            "/metrics lacks {expected:?}:\n{text}"
        );
    }
}

/// Stats theirs counts that ratekeeper did not: the over-limit cache's
/// answers per rule (theirs only with its cache on: LOCAL_CACHE_SIZE_IN_BYTES)
/// and unknown domains; in statsd and, their mapping leaving the names as
/// they are, escaped in Prometheus.
#[tokio::test]
async fn over_limit_cache_and_unknown_domain_stats_are_theirs() {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let (_dir, server) = one_per_hour(&socket, &[("LOCAL_CACHE_SIZE_IN_BYTES", "1048576")]);
    // 1 admitted, 1 over (the store says so), 2 over (the cache knows).
    assert_eq!(hits(&server, 4).await, [1, 2, 2, 2]);
    assert_stats(
        &socket,
        &server,
        &[
            ("ratelimit.service.rate_limit.web.user.over_limit", 3),
            (
                "ratelimit.service.rate_limit.web.user.over_limit_with_local_cache",
                2,
            ),
            ("ratelimit.service.rate_limit.nope.domain_not_found", 2),
        ],
        &[
            r#"ratelimit_service_rate_limit_over_limit{domain="web",key1="user"} 3"#,
            "ratelimit_service_rate_limit_web_user_over_limit_with_local_cache 2",
            "ratelimit_service_rate_limit_nope_domain_not_found 2",
            r#"ratekeeper_rate_limit_over_limit_with_local_cache{domain="web",rule="user"} 2"#,
        ],
    );
}

/// SHADOW_MODE: each over-limit request let through is their
/// `global_shadow_mode`.
#[tokio::test]
async fn global_shadow_mode_is_counted_as_theirs() {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let (_dir, server) = one_per_hour(&socket, &[("SHADOW_MODE", "true")]);
    assert_eq!(hits(&server, 3).await, [1, 1, 1]);
    assert_stats(
        &socket,
        &server,
        &[("ratelimit.service.global_shadow_mode", 2)],
        &["ratelimit_service_global_shadow_mode 2"],
    );
}

/// PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS: their default mapping without
/// the timer's scale: the same series, in milliseconds (buckets too).
#[tokio::test]
async fn response_time_in_milliseconds_when_asked() {
    let (_dir, limits) = limits_dir(LIMITS);
    let server = Ratekeeper::spawn_with_env(
        &limits,
        &[],
        &[("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS", "true")],
    );
    traffic(&server).await;
    let text = server.metrics();
    let bucket = r#"ratelimit_service_response_time_seconds_bucket{grpc_method="ShouldRateLimit",le="1000"} 9"#;
    assert!(text.contains(bucket), "{text}");
    // Their buckets, in the series' unit as there, are among them.
    for le in ["0.005", "0.5", "10"] {
        let bucket = format!(
            r#"ratelimit_service_response_time_seconds_bucket{{grpc_method="ShouldRateLimit",le="{le}"}} "#
        );
        assert!(text.contains(&bucket), "{bucket}: {text}");
    }
}

/// Stats reach a statsd on IPv6 (`::1`, or the `localhost` of most
/// containers, which resolves to it first): sent from a socket of the
/// address's family.
#[tokio::test]
async fn statsd_on_ipv6_receives_the_stats() {
    let Ok(socket) = std::net::UdpSocket::bind("[::1]:0") else {
        panic!("this machine has no IPv6 loopback (::1)");
    };
    let (_dir, server) = one_per_hour(&socket, &[("STATSD_HOST", "::1")]);
    assert_eq!(hits(&server, 1).await, [1]);
    assert_stats(
        &socket,
        &server,
        &[
            ("ratelimit.service.config_load_success", 1),
            ("ratelimit_server.ShouldRateLimit.total_requests", 2),
        ],
        &[],
    );
}

/// Their Redis pool stats of both Redis (`cx_active`, a gauge; `cx_total`
/// and `cx_local_close`, counters) and their local cache gauges, read when
/// sent: in statsd and, their mapping leaving the names as they are,
/// escaped in Prometheus. A restart of the main Redis has its connections
/// replaced: closed by us, opened anew.
#[tokio::test]
async fn redis_pool_and_local_cache_stats_are_theirs() {
    let (mut main, per_second) = (RedisServer::start(), RedisServer::start());
    let (main_url, per_second_url) = (main.url(), per_second.url());
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let (_dir, server) = one_per_hour(
        &socket,
        &[
            ("REDIS_URL", &main_url),
            ("REDIS_POOL_SIZE", "2"),
            ("REDIS_PERSECOND", "true"),
            ("REDIS_PERSECOND_URL", &per_second_url),
            ("REDIS_PERSECOND_POOL_SIZE", "1"),
            ("SERVING_THREADS", "1"),
            ("LOCAL_CACHE_SIZE_IN_BYTES", "1048576"),
            // Answers keep coming while the pool replaces its connections.
            ("FAILURE_MODE", "open"),
        ],
    );
    let mut health = tonic_health::pb::health_client::HealthClient::new(server.channel().await);
    common::until_serving(&mut health).await;
    // 1 admitted, 1 over (the store says so, the cache learns), 2 answered
    // by the cache.
    assert_eq!(hits(&server, 4).await, [1, 2, 2, 2]);
    assert_stats(
        &socket,
        &server,
        &[
            ("ratelimit.redis_pool.cx_active|g", 2),
            ("ratelimit.redis_pool.cx_total", 2),
            ("ratelimit.redis_per_second_pool.cx_active|g", 1),
            ("ratelimit.redis_per_second_pool.cx_total", 1),
            ("ratelimit.localcache.entryCount|g", 1),
            ("ratelimit.localcache.hitCount|g", 2),
            ("ratelimit.localcache.overwriteCount|g", 0),
        ],
        &[
            "ratelimit_redis_pool_cx_active 2",
            "ratelimit_redis_pool_cx_total 2",
            "ratelimit_redis_per_second_pool_cx_active 1",
            "ratelimit_redis_per_second_pool_cx_total 1",
            "ratelimit_localcache_entryCount 1",
            "ratelimit_localcache_hitCount 2",
        ],
    );

    // The next call on the old connections fails (connection lost): both
    // count as closed while Redis is down, as their pool closes a
    // connection a call failed on (an alert on `cx_active == 0` fires),
    // then the pool replaces them on the restarted server (whose data is
    // gone, so the cache is dropped too, by the next request that asks it).
    main.kill();
    let mut client = server.client().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let down = [
        "ratelimit_redis_pool_cx_local_close 2",
        "ratelimit_redis_pool_cx_active 0",
    ];
    while !down.iter().all(|series| server.metrics().contains(series)) {
        assert!(Instant::now() < deadline, "{}", server.metrics());
        let one = request("web", vec![descriptor(&[("user", "b")])]);
        client.should_rate_limit(one).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    main.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server
        .metrics()
        .contains("ratelimit_redis_pool_cx_active 2")
    {
        assert!(Instant::now() < deadline, "{}", server.metrics());
        let one = request("web", vec![descriptor(&[("user", "b")])]);
        client.should_rate_limit(one).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A request after the replacement finds the cache dropped.
    let one = request("web", vec![descriptor(&[("user", "c")])]);
    client.should_rate_limit(one).await.unwrap();
    // How many pools the restart took depends on which lands first: our
    // replacement, or the crate's own reconnect inside the old connections
    // (which answer again: open again), after which one of them failing
    // once more replaces them too. Either way, once settled, every
    // connection opened is closed or in use, the two found broken were
    // closed, and statsd was sent what /metrics shows (counters: what was
    // added since the first flushes).
    let settled = |sums: &BTreeMap<String, u64>| {
        let Some((active, opened, closed)) = main_pool(&server.metrics()) else {
            return false;
        };
        let sent = |name: &str| sums.get(&format!("ratelimit.{name}")).copied();
        active == 2
            && opened.checked_sub(closed) == Some(active)
            && closed >= 2
            && sent("redis_pool.cx_local_close") == Some(closed)
            && sent("redis_pool.cx_total") == Some(opened - 2)
            && sent("redis_pool.cx_active|g") == Some(2)
            && sent("localcache.entryCount|g") == Some(0)
    };
    let sums = receive(&socket, Duration::from_secs(10), settled);
    assert!(settled(&sums), "{sums:#?}\n{}", server.metrics());
    let text = server.metrics();
    assert!(
        text.contains("ratelimit_redis_per_second_pool_cx_total 1\n"),
        "{text}"
    );
}

/// The main Redis pool's `cx_active`, `cx_total` and `cx_local_close` in
/// /metrics text.
fn main_pool(text: &str) -> Option<(u64, u64, u64)> {
    let value = |name: &str| {
        let prefix = format!("ratelimit_redis_pool_{name} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix)?.parse::<u64>().ok())
    };
    Some((
        value("cx_active")?,
        value("cx_total")?,
        value("cx_local_close")?,
    ))
}

/// gRPC health's `Check` is counted as their interceptor counts every
/// unary method: `ratelimit_server.Check.total_requests` and its
/// response time, beside ShouldRateLimit's.
#[tokio::test]
async fn health_checks_are_counted_as_their_unary_methods() {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let (_dir, server) = one_per_hour(&socket, &[]);
    let mut health = HealthClient::new(server.channel().await);
    for service in ["", "ratelimit", "no.such.Service"] {
        let check = HealthCheckRequest {
            service: service.into(),
        };
        let _ = health.check(check).await;
    }
    assert_stats(
        &socket,
        &server,
        &[
            ("ratelimit_server.Check.total_requests", 3),
            ("ratelimit_server.Check.response_time|ms", 3),
        ],
        &[
            r#"ratelimit_service_total_requests{grpc_method="Check"} 3"#,
            r#"ratelimit_service_response_time_seconds_count{grpc_method="Check"} 3"#,
        ],
    );
}

/// `web` with a `detailed_metric` rule, `fw`, besides [`LIMITS`]' rules.
fn with_detailed_rule() -> String {
    format!("{LIMITS}  - key: fw\n    detailed_metric: true\n    rate_limit: {{unit: hour, requests_per_unit: 100}}\n")
}

/// Sends one request for `domain` with `descriptor`, of `hits`.
async fn send(
    server: &Ratekeeper,
    domain: &str,
    descriptor: RateLimitDescriptor,
    hits: u32,
) -> i32 {
    let mut client = server.client().await;
    let mut asked = request(domain, vec![descriptor]);
    asked.hits_addend = hits;
    let answer = client.should_rate_limit(asked).await.unwrap();
    answer.into_inner().overall_code
}

/// What a caller chooses (an unknown domain, a `detailed_metric` value) is
/// one segment of a stat name: an unknown domain shaped like another
/// rule's stat, or a value with dots, cannot count under another rule's
/// series; unknown domains are capped as detailed series are.
#[tokio::test]
async fn callers_text_cannot_reach_another_rules_series() {
    let dir = tempfile::tempdir().unwrap();
    let server = Ratekeeper::start(
        &with_detailed_rule(),
        dir.path(),
        &["--max-detailed-metric-series", "3"],
    );
    let forged = "web.route_r1.remote_address_10_0_0_1.total_hits";
    for domain in [forged, forged, "other1", "other2", "other3", "other4"] {
        send(&server, domain, descriptor(&[("user", "a")]), 1).await;
    }
    send(&server, "web", descriptor(&[("fw", "a.b")]), 1).await;
    send(&server, "web", descriptor(&[("fw", "x\ny")]), 1).await;
    let text = server.metrics();
    for expected in [
        "ratelimit_service_rate_limit_web_route_r1_remote_address_10_0_0_1_total_hits_domain_not_found 2",
        "ratelimit_service_rate_limit_other1_domain_not_found 1",
        "ratelimit_service_rate_limit_other2_domain_not_found 1",
        "ratelimit_service_rate_limit_overflow_domain_not_found 2",
        r#"ratelimit_service_rate_limit_total_hits{domain="web",key1="fw_a_b"} 1"#,
        r#"ratelimit_service_rate_limit_total_hits{domain="web",key1="fw_x_y"} 1"#,
        r#"ratekeeper_rate_limit_total_hits{domain="web",rule="fw_a_b"} 1"#,
        r#"ratekeeper_rate_limit_total_hits{domain="web",rule="fw_x_y"} 1"#,
    ] {
        assert!(
            text.lines().any(|l| l == expected),
            "/metrics lacks {expected:?}:\n{text}"
        );
    }
    for absent in [
        r#"ratelimit_service_rate_limit_total_hits{domain="web",key1="route_r1""#,
        r#"ratelimit_service_rate_limit_total_hits{domain="web",key1="fw_a","#,
        "other3",
    ] {
        assert!(!text.contains(absent), "{absent:?} in /metrics:\n{text}");
    }
}

/// A control character in a `detailed_metric` value or an unknown domain
/// never reaches a statsd line: a newline would end it and send the rest as
/// a line of the caller's making.
#[tokio::test]
async fn control_characters_cannot_forge_statsd_lines() {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let (_dir, server) = with_statsd(&socket, &with_detailed_rule(), &[]);
    let forged = "x\nratelimit.service.rate_limit.web.fw";
    send(&server, "web", descriptor(&[("fw", forged)]), 3).await;
    let unknown = "nope\nratelimit.service.rate_limit.web.user.over_limit";
    send(&server, unknown, descriptor(&[("user", "a")]), 1).await;
    let expected = [
        (
            "ratelimit.service.rate_limit.web.fw_x_ratelimit_service_rate_limit_web_fw.total_hits",
            3,
        ),
        (
            "ratelimit.service.rate_limit.nope_ratelimit_service_rate_limit_web_user_over_limit.domain_not_found",
            1,
        ),
    ];
    let sums = receive(&socket, Duration::from_secs(10), |sums| {
        expected.iter().all(|(name, n)| sums.get(*name) == Some(n))
    });
    for (name, n) in expected {
        assert_eq!(sums.get(name), Some(&n), "{name} in {sums:#?}");
    }
    for forged in [
        "ratelimit.service.rate_limit.web.fw.total_hits",
        "ratelimit.service.rate_limit.web.user.over_limit",
    ] {
        assert!(!sums.contains_key(forged), "{forged} in {sums:#?}");
    }
}

/// A descriptor's `limit` override counts as theirs does, under the
/// request's entries (`ratelimit.service.rate_limit.web.tenant_t1.*`),
/// capped as detailed series are.
#[tokio::test]
async fn a_limit_override_counts_under_its_descriptor() {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let (_dir, server) = one_per_hour(&socket, &[("MAX_DETAILED_METRIC_SERIES", "1")]);
    let overridden = |tenant: &str| {
        let mut d = descriptor(&[("tenant", tenant)]);
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 2,
            unit: 3, // HOUR
        });
        d
    };
    let mut codes = Vec::new();
    for tenant in ["t1", "t1", "t1", "t2"] {
        codes.push(send(&server, "web", overridden(tenant), 1).await);
    }
    assert_eq!(codes, [1, 1, 2, 1]);
    // Limit 2, near from floor(2 × 0.8) = 1 on: the second hit is near.
    assert_stats(
        &socket,
        &server,
        &[
            ("ratelimit.service.rate_limit.web.tenant_t1.total_hits", 3),
            ("ratelimit.service.rate_limit.web.tenant_t1.within_limit", 2),
            ("ratelimit.service.rate_limit.web.tenant_t1.near_limit", 1),
            ("ratelimit.service.rate_limit.web.tenant_t1.over_limit", 1),
            ("ratelimit.service.rate_limit.web.overflow.total_hits", 1),
        ],
        &[
            r#"ratelimit_service_rate_limit_total_hits{domain="web",key1="tenant_t1"} 3"#,
            r#"ratelimit_service_rate_limit_over_limit{domain="web",key1="tenant_t1"} 1"#,
            r#"ratelimit_service_rate_limit_total_hits{domain="web",key1="overflow"} 1"#,
            r#"ratekeeper_rate_limit_total_hits{domain="web",rule="tenant_t1"} 3"#,
        ],
    );
}
