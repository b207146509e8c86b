//! `EXPIRATION_JITTER_MAX_SECONDS`: the Redis keys a call creates live up
//! to that much longer than their window, a random amount per call, and
//! no decision changes. Against real redis-servers, comparing a server
//! with the jitter to one without it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{descriptor, request, RedisServer, TestServer};
use ratekeeper::clock::{Clock, ManualClock};
use ratekeeper::store::{RedisSettings, RedisStore, Store};

/// A limit of every algorithm, each per minute.
const LIMITS: &str = r#"
domain: web
descriptors:
  - key: user
    rate_limits:
      - {unit: minute, requests_per_unit: 3}
      - {unit: minute, requests_per_unit: 10, algorithm: sliding_window}
      - {unit: minute, requests_per_unit: 10, algorithm: sliding_log}
      - {unit: minute, requests_per_unit: 10, algorithm: token_bucket, burst: 5}
      - {unit: minute, requests_per_unit: 10, algorithm: leaky_bucket, burst: 5}
"#;

/// A minute boundary: the fixed window's key lives exactly a minute.
const START_MS: u64 = 1_800_000_000_000;
const JITTER: Duration = Duration::from_secs(5);
/// Real time passing between the calls and reading the TTLs.
const SLACK_MS: i64 = 1_000;
const USERS: usize = 25;

fn store(redis: &RedisServer, jitter: Duration, clock: Option<Arc<dyn Clock>>) -> Store {
    let settings = RedisSettings {
        expiry_jitter: jitter,
        ..redis.settings(true)
    };
    Store::Redis(Arc::new(RedisStore::new(&settings, clock).expect("store")))
}

/// Every key of the server, with its TTL in ms.
fn ttls(redis: &RedisServer) -> Vec<(String, i64)> {
    let mut conn = redis.client().get_connection().expect("connect");
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("rk:*").query(&mut conn).unwrap();
    keys.sort();
    keys.into_iter()
        .map(|key| {
            let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut conn).unwrap();
            (key, ttl)
        })
        .collect()
}

#[tokio::test]
async fn keys_live_up_to_the_jitter_longer_and_decisions_do_not_change() {
    let (plain_redis, jittered_redis) = (RedisServer::start(), RedisServer::start());
    let clock = Arc::new(ManualClock::new(START_MS));
    let pinned = || Some(clock.clone() as Arc<dyn Clock>);
    let plain = TestServer::start(&[LIMITS], store(&plain_redis, Duration::ZERO, pinned())).await;
    let jittered = TestServer::start(&[LIMITS], store(&jittered_redis, JITTER, pinned())).await;
    let (mut plain_client, mut jittered_client) = (plain.client().await, jittered.client().await);
    for round in 0..4u64 {
        clock.set(START_MS + round * 1_000);
        for user in 0..USERS {
            let req = request("web", vec![descriptor(&[("user", &format!("u{user}"))])]);
            let expected = plain_client.should_rate_limit(req.clone()).await.unwrap();
            let got = jittered_client.should_rate_limit(req).await.unwrap();
            assert_eq!(
                got.into_inner(),
                expected.into_inner(),
                "round {round}, user {user}"
            );
        }
    }

    let (without, with) = (ttls(&plain_redis), ttls(&jittered_redis));
    assert_eq!(without.len(), USERS * 5, "a key per user and limit");
    assert_eq!(
        with.iter().map(|(k, _)| k).collect::<Vec<_>>(),
        without.iter().map(|(k, _)| k).collect::<Vec<_>>()
    );
    let most = JITTER.as_millis() as i64;
    let mut longest = 0;
    for ((key, base), (_, ttl)) in without.iter().zip(&with) {
        let added = ttl - base;
        assert!(
            (-SLACK_MS..=most + SLACK_MS).contains(&added),
            "{key}: TTL {ttl} ms against {base} ms without jitter"
        );
        longest = longest.max(added);
        if key.contains(":fw.") {
            // The fixed window began at a minute boundary: it ends a minute
            // after the first call.
            assert!(
                (60_000 - SLACK_MS..=60_000 + most).contains(ttl),
                "{key}: TTL {ttl}"
            );
        }
    }
    assert!(
        longest > SLACK_MS,
        "no key lived longer than without jitter (at most {longest} ms)"
    );
    plain.stop().await;
    jittered.stop().await;
}

/// With the server's own clock (the time argument empty but for the
/// jitter), keys outlive what their algorithm gives them by up to the
/// jitter.
#[tokio::test]
async fn the_jitter_applies_on_the_redis_servers_clock_too() {
    let redis = RedisServer::start();
    let server = TestServer::start(&[LIMITS], store(&redis, JITTER, None)).await;
    let mut client = server.client().await;
    for user in 0..USERS {
        let req = request("web", vec![descriptor(&[("user", &format!("u{user}"))])]);
        let answer = client.should_rate_limit(req).await.unwrap().into_inner();
        assert_eq!(answer.overall_code, 1, "OK");
    }
    let ttls = ttls(&redis);
    assert_eq!(ttls.len(), USERS * 5);
    let jitter = JITTER.as_millis() as i64;
    let fixed = ttls.iter().filter(|(key, _)| key.contains(":fw."));
    assert!(
        fixed
            .clone()
            .all(|(_, ttl)| (1..=60_000 + jitter).contains(ttl)),
        "{ttls:?}"
    );
    // A sliding log's key lives one period after its newest entry, and
    // longer only by its jitter: with 25 random jitters of up to 5 s, some
    // show.
    let logs = ttls.iter().filter(|(key, _)| key.contains(":slw."));
    assert!(
        logs.clone().all(|(_, ttl)| *ttl <= 60_000 + jitter),
        "{ttls:?}"
    );
    assert!(
        logs.clone().any(|(_, ttl)| *ttl > 60_000 + SLACK_MS),
        "{ttls:?}"
    );
    server.stop().await;
}

/// A time argument that is neither `<ms>`, `""`, nor either followed by
/// `j<ms>` is refused like any malformed argument, and saves nothing.
#[test]
fn a_malformed_time_argument_is_refused() {
    let redis = RedisServer::start();
    let mut conn = redis.client().get_connection().unwrap();
    let function = common::load_limiter_library(&mut conn);
    let key = "rk:{bad|a}:fw.1000";
    let mut call = |now: &str| -> redis::RedisResult<Vec<i64>> {
        redis::cmd("FCALL")
            .arg(&function)
            .arg(1)
            .arg(key)
            .arg(now)
            .arg("1 0")
            .arg("fw 5 1000 0 1 1 0")
            .query::<ratekeeper::store::packed::Packed>(&mut conn)
            .map(|p| p.0)
    };
    for now in [
        "j",
        "1800000000000j",
        "jj5",
        "1800000000000j-5",
        "x",
        "5j5j5",
    ] {
        let error = call(now).expect_err(now);
        assert_eq!(
            error.detail(),
            Some("malformed limiter arguments"),
            "{now:?}"
        );
    }
    let mut check = redis.client().get_connection().unwrap();
    let exists: u64 = redis::cmd("EXISTS").arg(key).query(&mut check).unwrap();
    assert_eq!(exists, 0, "a refused call saved a counter");
    assert_eq!(call("1800000000000j250").unwrap(), [0, 4, 1000]);
    let ttl: i64 = redis::cmd("PTTL").arg(key).query(&mut check).unwrap();
    assert!((1_000..=1_250).contains(&ttl), "TTL {ttl}");
}
