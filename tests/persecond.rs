//! envoyproxy/ratelimit's `REDIS_PERSECOND`: the counters of limits whose
//! unit is the second live in a second Redis, all others in the main one.
//! Against two real redis-servers: where counters land, answers to
//! requests spanning both, the per-second Redis down (the failure mode for
//! its checks only), the admin API, and the binary's settings.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{descriptor, http_call, request, Ratekeeper, RedisServer, TestServer};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use ratekeeper::clock::{Clock, ManualClock};
use ratekeeper::config::Config;
use ratekeeper::service::rls::LimiterSettings;
use ratekeeper::store::Stores;
use ratekeeper::vocab::FailureMode;

/// A per-second limit (`ip`) and a per-minute one (`user`).
const LIMITS: &str = r#"
domain: api
descriptors:
  - key: ip
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: watch
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
"#;

/// A minute boundary.
const START_MS: u64 = 1_800_000_000_000;

/// Two Redis, and a server keeping per-second counters in the second.
struct Pair {
    main: RedisServer,
    per_second: RedisServer,
    server: TestServer,
}

async fn start(failure_mode: FailureMode) -> Pair {
    let limiter = LimiterSettings {
        failure_mode,
        ..TestServer::limiter_settings()
    };
    start_with(limiter).await
}

/// [`start`] with `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`.
async fn stopping_increments() -> Pair {
    let limiter = LimiterSettings {
        stop_increment_when_over_limit: true,
        ..TestServer::limiter_settings()
    };
    start_with(limiter).await
}

async fn start_with(limiter: LimiterSettings) -> Pair {
    let (main, per_second) = (RedisServer::start(), RedisServer::start());
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(START_MS));
    let stores = Stores::new(
        main.store(Some(clock.clone())),
        Some(per_second.store(Some(clock))),
    );
    let config = Config::from_files([(Path::new("api.yaml"), LIMITS)]).expect("limits");
    let server = TestServer::start_with_limiter(config, None, stores, limiter).await;
    server.serving().await;
    Pair {
        main,
        per_second,
        server,
    }
}

/// The counter keys of `redis`, sorted.
fn keys(redis: &RedisServer) -> Vec<String> {
    keys_as(redis, None)
}

/// [`keys`] of a Redis that asks for `password`.
fn keys_as(redis: &RedisServer, password: Option<&str>) -> Vec<String> {
    let mut conn = redis.client().get_connection().expect("connect");
    if let Some(password) = password {
        let _: () = redis::cmd("AUTH").arg(password).query(&mut conn).unwrap();
    }
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("rk:*").query(&mut conn).unwrap();
    keys.sort();
    keys
}

/// The fixed window's count in `key` (0 when absent).
fn count(redis: &RedisServer, key: &str) -> u64 {
    let mut conn = redis.client().get_connection().expect("connect");
    let count: Option<u64> = redis::cmd("HGET")
        .arg(key)
        .arg("c")
        .query(&mut conn)
        .unwrap();
    count.unwrap_or(0)
}

/// The main Redis's limit only.
fn user_only() -> RateLimitRequest {
    request("api", vec![descriptor(&[("user", "alice")])])
}

fn both() -> RateLimitRequest {
    request(
        "api",
        vec![
            descriptor(&[("ip", "10.0.0.1")]),
            descriptor(&[("user", "alice")]),
        ],
    )
}

/// Overall code, then per descriptor (code, remaining).
fn summary(answer: &RateLimitResponse) -> (i32, Vec<(i32, u32)>) {
    let statuses = answer.statuses.iter();
    let each = statuses.map(|s| (s.code, s.limit_remaining)).collect();
    (answer.overall_code, each)
}

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;
const IP_KEY: &str = "rk:{api|ip=10.0.0.1}:fw.1";
const USER_KEY: &str = "rk:{api|user=alice}:fw.60";

#[tokio::test]
async fn per_second_counters_live_in_the_per_second_redis_and_answers_join() {
    let pair = start(FailureMode::Open).await;
    let mut client = pair.server.client().await;
    let first = client.should_rate_limit(both()).await.unwrap().into_inner();
    assert_eq!(summary(&first), (OK, vec![(OK, 1), (OK, 4)]));
    assert_eq!(keys(&pair.per_second), [IP_KEY]);
    assert_eq!(keys(&pair.main), [USER_KEY]);

    let second = client.should_rate_limit(both()).await.unwrap().into_inner();
    assert_eq!(summary(&second), (OK, vec![(OK, 0), (OK, 3)]));
    // The per-second limit is full: refused. Each Redis decides its own
    // checks, so the minute counter, in the other, still counts this one
    // (all-or-nothing holds per store, as per Cluster slot).
    let third = client.should_rate_limit(both()).await.unwrap().into_inner();
    assert_eq!(summary(&third), (OVER, vec![(OVER, 0), (OK, 2)]));
    assert_eq!(count(&pair.main, USER_KEY), 3);
    assert_eq!(
        count(&pair.per_second, IP_KEY),
        3,
        "fixed windows take charges"
    );

    let answer = client
        .should_rate_limit(user_only())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(summary(&answer), (OK, vec![(OK, 1)]));
    pair.server.stop().await;
}

/// With `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`, a request the
/// per-second limit refuses leaves the minute's counter, in the other
/// Redis, as it was: both are asked first without counting, as theirs
/// reads every key of both Redis before it counts. (Each decided on its
/// own, and a caller hammering its per-second limit drained its minute.)
#[tokio::test]
async fn a_refusal_in_either_redis_spares_the_other_when_told_to() {
    let pair = stopping_increments().await;
    let mut client = pair.server.client().await;
    for (ip, user) in [(1, 4), (0, 3)] {
        let answer = client.should_rate_limit(both()).await.unwrap().into_inner();
        assert_eq!(summary(&answer), (OK, vec![(OK, ip), (OK, user)]));
    }
    for _ in 0..3 {
        let refused = client.should_rate_limit(both()).await.unwrap().into_inner();
        assert_eq!(summary(&refused), (OVER, vec![(OVER, 0), (OK, 3)]));
    }
    assert_eq!(count(&pair.main, USER_KEY), 2, "spared");
    // The counter it takes over counts, as theirs; full, it is then known
    // to the over-limit cache, which answers the next two.
    assert_eq!(count(&pair.per_second, IP_KEY), 3);
    pair.server.stop().await;
}

/// A shadow limit the over-limit cache knows full refuses nothing: the
/// per-second limit beside it still counts and refuses (it once sent both
/// Redis a refused pass, and every request went through uncounted).
#[tokio::test]
async fn a_cached_shadow_limit_refuses_nothing_across_the_two() {
    let pair = stopping_increments().await;
    let mut client = pair.server.client().await;
    let watched = |with_ip: bool| {
        let mut descriptors = vec![descriptor(&[("watch", "w")])];
        if with_ip {
            descriptors.insert(0, descriptor(&[("ip", "10.0.0.9")]));
        }
        request("api", descriptors)
    };
    for _ in 0..2 {
        let shadowed = client.should_rate_limit(watched(false)).await.unwrap();
        assert_eq!(shadowed.into_inner().overall_code, OK);
    }
    let mut codes = Vec::new();
    for _ in 0..3 {
        let answer = client.should_rate_limit(watched(true)).await.unwrap();
        codes.push(answer.into_inner().overall_code);
    }
    assert_eq!(codes, [OK, OK, OVER], "the per-second limit of 2 counts");
    pair.server.stop().await;
}

#[tokio::test]
async fn the_per_second_redis_down_gives_the_failure_mode_to_its_checks_only() {
    for (mode, ip) in [
        (FailureMode::Closed, (OVER, 0)),
        (FailureMode::Open, (OK, 2)),
    ] {
        let mut pair = start(mode).await;
        let mut client = pair.server.client().await;
        pair.per_second.kill();
        let answer = client.should_rate_limit(both()).await.unwrap().into_inner();
        let overall = if ip.0 == OVER { OVER } else { OK };
        assert_eq!(summary(&answer), (overall, vec![ip, (OK, 4)]), "{mode}");
        let metadata = answer.dynamic_metadata.expect("marked as degraded");
        assert!(
            metadata.fields.contains_key("ratekeeper.store_error"),
            "{mode}: {metadata:?}"
        );
        assert_eq!(
            count(&pair.main, USER_KEY),
            1,
            "{mode}: the main Redis counted"
        );

        // A request of the main Redis's limits only is answered as ever.
        let answer = client
            .should_rate_limit(user_only())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(summary(&answer), (OK, vec![(OK, 3)]), "{mode}");
        assert!(answer.dynamic_metadata.is_none(), "{mode}");
        pair.server.stop().await;
    }
}

/// An admin API call on `entry` of domain `api`: status and body.
async fn admin(server: &TestServer, method: &'static str, entry: &str) -> (u16, String) {
    let (addr, path) = (
        server.admin.to_string(),
        format!("/v1/descriptor?domain=api&entry={entry}"),
    );
    let answer = tokio::task::spawn_blocking(move || http_call(&addr, method, &path, ""))
        .await
        .expect("admin call");
    (answer.status, answer.body)
}

/// The remaining hits of the first limit of `entry`'s rule, by the admin API.
async fn remaining(server: &TestServer, entry: &str) -> u64 {
    let (status, body) = admin(server, "GET", entry).await;
    assert_eq!(status, 200, "{body}");
    let state: serde_json::Value = serde_json::from_str(&body).unwrap();
    state["limits"][0]["remaining"].as_u64().expect("remaining")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_reads_and_resets_each_counter_in_its_redis() {
    let pair = start(FailureMode::Open).await;
    let mut client = pair.server.client().await;
    client.should_rate_limit(both()).await.unwrap();
    let (ip, user) = ("ip%3D10.0.0.1", "user%3Dalice");
    assert_eq!(remaining(&pair.server, ip).await, 1);
    assert_eq!(remaining(&pair.server, user).await, 4);

    let (status, body) = admin(&pair.server, "DELETE", ip).await;
    assert_eq!(status, 200, "{body}");
    // The counter gone, its reset recorded beside it (for settles).
    assert_eq!(
        keys(&pair.per_second),
        [format!("{IP_KEY}:reset")],
        "reset in the per-second Redis"
    );
    assert_eq!(keys(&pair.main), [USER_KEY], "the main Redis untouched");
    assert_eq!(remaining(&pair.server, ip).await, 2);
    pair.server.stop().await;
}

/// The binary, configured by their variables: a per-second limit counts
/// in REDIS_PERSECOND_URL's Redis, here a Unix socket with a password
/// (the main Redis's settings code: any topology the main one takes).
#[tokio::test]
async fn their_variables_configure_the_per_second_redis() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("per-second.sock").display().to_string();
    let main = RedisServer::start();
    let per_second = RedisServer::spawn_free(&["--unixsocket", &socket, "--requirepass", "s3cret"]);
    let main_url = main.url();
    let limits = dir.path().join("limits");
    std::fs::create_dir_all(&limits).unwrap();
    std::fs::write(limits.join("api.yaml"), LIMITS).unwrap();
    let server = Ratekeeper::spawn_with_env(
        &limits,
        &[],
        &[
            ("REDIS_URL", main_url.as_str()),
            ("REDIS_PERSECOND", "true"),
            ("REDIS_PERSECOND_URL", socket.as_str()),
            ("REDIS_PERSECOND_SOCKET_TYPE", "unix"),
            ("REDIS_PERSECOND_AUTH", "s3cret"),
            ("REDIS_PERSECOND_POOL_SIZE", "2"),
            ("REDIS_PERSECOND_TIMEOUT", "2s"),
        ],
    );
    // Serving once both Redis are warmed up (the first call's deadline
    // is the default 20 ms).
    let mut health = tonic_health::pb::health_client::HealthClient::new(server.channel().await);
    common::until_serving(&mut health).await;
    let mut client = server.client().await;
    let answer = client.should_rate_limit(both()).await.unwrap().into_inner();
    assert_eq!(summary(&answer), (OK, vec![(OK, 1), (OK, 4)]));
    assert_eq!(keys_as(&per_second, Some("s3cret")), [IP_KEY]);
    assert_eq!(keys(&main), [USER_KEY]);
    // Each Redis has its own health: `ratekeeper_store_up{store}`.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    for store in ["main", "per_second"] {
        let up = format!("ratekeeper_store_up{{store=\"{store}\"}} 1");
        while !server.metrics().contains(&up) {
            assert!(
                std::time::Instant::now() < deadline,
                "{up} in {}",
                server.metrics()
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
}

/// Start-up errors about the per-second Redis name its variables.
#[test]
fn a_bad_per_second_redis_stops_the_start_naming_the_variable() {
    let main = RedisServer::start();
    let main_url = main.url();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("api.yaml"), LIMITS).unwrap();
    let cases: [(&[(&str, &str)], &str); 4] = [
        (&[("REDIS_PERSECOND", "true")], "REDIS_PERSECOND_URL"),
        (
            &[
                ("REDIS_PERSECOND", "true"),
                ("REDIS_PERSECOND_URL", "redis://[::1"),
            ],
            "REDIS_PERSECOND_URL",
        ),
        (
            &[
                ("REDIS_PERSECOND", "1"),
                ("REDIS_PERSECOND_URL", "/tmp/rk.sock"),
                ("REDIS_PERSECOND_SOCKET_TYPE", "pipe"),
            ],
            "REDIS_PERSECOND_SOCKET_TYPE",
        ),
        (
            &[
                ("REDIS_PERSECOND", "true"),
                ("REDIS_PERSECOND_TIMEOUT", "soon"),
            ],
            "REDIS_PERSECOND_TIMEOUT",
        ),
    ];
    for (env, named) in cases {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
            .args(["--grpc-addr", "127.0.0.1:0", "--metrics-addr", "off"])
            .args(["--http-addr", "off", "--debug-addr", "off"])
            .arg("--config-dir")
            .arg(dir.path())
            .env("REDIS_URL", &main_url)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let stderr = common::fatal_message(&String::from_utf8_lossy(&output.stderr));
        assert!(!output.status.success(), "{env:?} started");
        assert!(stderr.contains(named), "{env:?}: {stderr}");
    }
}

/// `ratekeeper.v1.BudgetService` with a per-second store: budgets live in
/// the main Redis, beside their settlements' records, so a reservation a per-second
/// limit matches is refused before any store work; one on a per-minute
/// limit is reserved and settled in the main Redis.
#[tokio::test]
async fn budgets_live_in_the_main_redis_and_refuse_per_second_limits() {
    use ratekeeper::pb::v1::budget_service_client::BudgetServiceClient;
    use ratekeeper::pb::v1::{Descriptor, Entry, ReserveRequest, SettleRequest};
    use ratekeeper::service::reservation_id::ReservationId;

    let pair = start(FailureMode::Open).await;
    let url = format!("http://{}", pair.server.addr);
    let mut budget = BudgetServiceClient::connect(url).await.expect("connect");
    let of = |pairs: &[(&str, &str)], estimate| ReserveRequest {
        domain: "api".into(),
        descriptors: pairs
            .iter()
            .map(|(key, value)| Descriptor {
                entries: vec![Entry {
                    key: (*key).into(),
                    value: (*value).into(),
                }],
            })
            .collect(),
        estimate,
        ttl: None,
    };

    // Per-second alone, and beside a per-minute limit: refused, nothing taken.
    for pairs in [
        &[("ip", "10.0.0.1")][..],
        &[("user", "alice"), ("ip", "10.0.0.1")][..],
    ] {
        let refused = budget.reserve(of(pairs, 1)).await.expect_err("refused");
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{pairs:?}");
        assert!(
            refused
                .message()
                .contains("with REDIS_PERSECOND its counters live"),
            "{pairs:?}: {}",
            refused.message()
        );
    }
    assert!(keys(&pair.main).is_empty(), "{:?}", keys(&pair.main));
    assert!(keys(&pair.per_second).is_empty());

    // Per-minute: the counter (and the ids' key) in the main Redis.
    let reserved = budget
        .reserve(of(&[("user", "alice")], 3))
        .await
        .expect("reserve")
        .into_inner();
    assert!(reserved.granted, "{reserved:?}");
    let prefix = ratekeeper::keys::DEFAULT_PREFIX;
    let id = ReservationId::decode(&reserved.reservation_id, prefix).expect("a reservation id");
    let mut expected = vec![USER_KEY.to_string(), format!("{prefix}budget.key")];
    expected.sort();
    assert_eq!(keys(&pair.main), expected);
    assert!(keys(&pair.per_second).is_empty());
    assert_eq!(count(&pair.main, USER_KEY), 3);

    let settled = budget
        .settle(SettleRequest {
            reservation_id: reserved.reservation_id.clone(),
            actual: 1,
        })
        .await
        .expect("settle")
        .into_inner();
    assert_eq!((settled.settled, settled.already_settled), (1, false));
    assert_eq!(count(&pair.main, USER_KEY), 1, "2 of the 3 given back");
    let buckets: Vec<String> = keys(&pair.main)
        .into_iter()
        .filter(|key| !expected.contains(key))
        .collect();
    assert_eq!(buckets.len(), 1, "and the settlement's record: {buckets:?}");
    assert!(
        buckets[0].starts_with(&format!("{prefix}rsvb.")),
        "{buckets:?}"
    );
    let mut conn = pair.main.client().get_connection().expect("connect");
    let recorded: Option<u64> = redis::cmd("HGET")
        .arg(&buckets[0])
        .arg(&id.reservation.nonce)
        .query(&mut conn)
        .expect("HGET");
    assert_eq!(recorded, Some(1), "settled at 1");
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&buckets[0])
        .query(&mut conn)
        .expect("PTTL");
    let most = (id.reservation.ttl_ms + 1_000) as i64;
    assert!(0 < ttl && ttl <= most, "{ttl} ms: to its second's end");
    assert!(keys(&pair.per_second).is_empty());
    pair.server.stop().await;
}
