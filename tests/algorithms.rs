//! Every algorithm, stacked limits, response headers, count-everything
//! domains and subscription tiers, over gRPC on every store.

mod common;

use std::sync::Arc;

use common::{descriptor, on_every_store, request, Backend, RedisServer, TestServer};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use ratekeeper::clock::ManualClock;

/// A minute boundary.
const START_MS: u64 = 1_800_000_000_000;

const LIMITS: &str = r#"
domain: algo
descriptors:
  - key: fw
    rate_limit: {unit: minute, requests_per_unit: 3, algorithm: fixed_window}
  - key: sw
    rate_limit: {unit: minute, requests_per_unit: 3, algorithm: sliding_window}
  - key: sl
    rate_limit: {unit: minute, requests_per_unit: 3, algorithm: sliding_log}
  - key: tb
    rate_limit: {unit: minute, requests_per_unit: 3, algorithm: token_bucket}
  - key: lb
    rate_limit: {unit: minute, requests_per_unit: 3, algorithm: leaky_bucket}
  - key: user
    rate_limits:
      - {unit: second, requests_per_unit: 1, algorithm: token_bucket, burst: 2, name: burst}
      - {unit: day, requests_per_unit: 3, name: daily, charges: drop}
  - key: quiet
    rate_limit: {unit: minute, requests_per_unit: 1}
"#;

const COUNT_EVERYTHING: &str = r#"
domain: envoy_style
all_or_nothing: false
response_headers: false
descriptors:
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: b
    rate_limit: {unit: minute, requests_per_unit: 1}
"#;

fn code(r: &RateLimitResponse) -> Code {
    Code::try_from(r.overall_code).unwrap_or(Code::Unknown)
}

fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key == name)
        .map(|h| h.value.as_str())
}

#[tokio::test]
async fn every_algorithm_admits_its_limit_over_grpc() {
    on_every_store(&[LIMITS], START_MS, |server, _clock, store| async move {
        let mut client = server.client().await;
        for key in ["fw", "sw", "sl", "tb", "lb"] {
            let req = request("algo", vec![descriptor(&[(key, "x")])]);
            for remaining in [2, 1, 0] {
                let r = client
                    .should_rate_limit(req.clone())
                    .await
                    .unwrap()
                    .into_inner();
                assert_eq!(code(&r), Code::Ok, "{store} {key}");
                assert_eq!(r.statuses[0].limit_remaining, remaining, "{store} {key}");
            }
            let r = client.should_rate_limit(req).await.unwrap().into_inner();
            assert_eq!(code(&r), Code::OverLimit, "{store} {key}: the 4th of 3");
            // Whole seconds, rounded up: a sliding window's wait is just
            // over the minute.
            let wait = r.statuses[0].duration_until_reset.unwrap();
            assert!(
                wait.seconds > 0 && wait.seconds <= 61 && wait.nanos == 0,
                "{store} {key}: {wait:?}"
            );
            let retry_after = wait.seconds + i64::from(wait.nanos > 0);
            assert_eq!(
                header(&r, "Retry-After"),
                Some(retry_after.to_string().as_str()),
                "{store} {key}"
            );
        }
        server.stop().await;
    })
    .await;
}

#[tokio::test]
async fn token_bucket_refills_and_leaky_bucket_reports_the_wait() {
    on_every_store(&[LIMITS], START_MS, |server, clock, store| async move {
        let mut client = server.client().await;
        let tb = request("algo", vec![descriptor(&[("tb", "refill")])]);
        for _ in 0..3 {
            client.should_rate_limit(tb.clone()).await.unwrap();
        }
        // 3 per minute: one token every 20 s.
        clock.advance(19_999);
        let r = client
            .should_rate_limit(tb.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(code(&r), Code::OverLimit, "{store}");
        let wait = r.statuses[0].duration_until_reset.unwrap();
        assert_eq!(
            (wait.seconds, wait.nanos),
            (1, 0),
            "{store}: 1 ms left, told as a second (Envoy reads whole seconds)"
        );
        clock.advance(1);
        let r = client.should_rate_limit(tb).await.unwrap().into_inner();
        assert_eq!(code(&r), Code::Ok, "{store}: refilled");

        // leaky bucket: the second request waits 20 s behind the first.
        let lb = request("algo", vec![descriptor(&[("lb", "wait")])]);
        let first = client
            .should_rate_limit(lb.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            first.statuses[0].duration_until_reset.unwrap().seconds,
            0,
            "{store}"
        );
        let second = client.should_rate_limit(lb).await.unwrap().into_inner();
        assert_eq!(code(&second), Code::Ok);
        assert_eq!(
            second.statuses[0].duration_until_reset.unwrap().seconds,
            20,
            "{store}"
        );
        server.stop().await;
    })
    .await;
}

#[tokio::test]
async fn stacked_limits_report_the_tightest_and_consume_all_or_nothing() {
    on_every_store(&[LIMITS], START_MS, |server, clock, store| async move {
        let mut client = server.client().await;
        let req = request("algo", vec![descriptor(&[("user", "u")])]);
        let name =
            |r: &RateLimitResponse| r.statuses[0].current_limit.as_ref().unwrap().name.clone();

        // burst 2 of the token bucket vs 3 a day: the bucket is tighter.
        let r = client
            .should_rate_limit(req.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (name(&r), r.statuses[0].limit_remaining),
            ("burst".into(), 1),
            "{store}"
        );
        let r = client
            .should_rate_limit(req.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (code(&r), r.statuses[0].limit_remaining),
            (Code::Ok, 0),
            "{store}"
        );
        // The bucket refuses the third: the daily limit (`charges: drop`) is
        // not consumed.
        let r = client
            .should_rate_limit(req.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (code(&r), name(&r)),
            (Code::OverLimit, "burst".into()),
            "{store}"
        );
        clock.advance(1_000);
        // The bucket has a token again; the daily limit has 1 left: tighter now.
        let r = client
            .should_rate_limit(req.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (code(&r), name(&r), r.statuses[0].limit_remaining),
            (Code::Ok, "daily".into(), 0),
            "{store}"
        );
        clock.advance(5_000);
        let r = client.should_rate_limit(req).await.unwrap().into_inner();
        assert_eq!(
            (code(&r), name(&r)),
            (Code::OverLimit, "daily".into()),
            "{store}: 3 a day"
        );
        assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().unit, 4, "DAY");
        server.stop().await;
    })
    .await;
}

/// An admitted request whose tightest descriptor is over (a quota
/// descriptor while another quota of the request still has room) gets the
/// RateLimit-* headers but no Retry-After: a client honouring it would
/// back off from a request that was let through.
#[tokio::test]
async fn an_admitted_request_gets_no_retry_after() {
    const QUOTAS: &str = "
domain: q
descriptors:
  - key: service
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
";
    on_every_store(&[QUOTAS], START_MS, |server, _clock, store| async move {
        let mut client = server.client().await;
        let one = request("q", vec![descriptor(&[("service", "s1")])]);
        client.should_rate_limit(one).await.unwrap();
        let both = request(
            "q",
            vec![
                descriptor(&[("service", "s1")]),
                descriptor(&[("service", "s2")]),
            ],
        );
        let r = client.should_rate_limit(both).await.unwrap().into_inner();
        assert_eq!(code(&r), Code::Ok, "{store}: s2 has room");
        assert_eq!(r.statuses[0].code, Code::OverLimit as i32, "{store}");
        assert_eq!(header(&r, "RateLimit-Remaining"), Some("0"), "{store}");
        assert_eq!(header(&r, "Retry-After"), None, "{store}");
        server.stop().await;
    })
    .await;
}

#[tokio::test]
async fn headers_come_from_the_tightest_descriptor() {
    on_every_store(
        &[LIMITS, COUNT_EVERYTHING],
        START_MS + 15_000,
        |server, _clock, store| async move {
            let mut client = server.client().await;
            let req = request(
                "algo",
                vec![descriptor(&[("fw", "h")]), descriptor(&[("quiet", "h")])],
            );
            let r = client
                .should_rate_limit(req.clone())
                .await
                .unwrap()
                .into_inner();
            // quiet (1 per minute) is tighter than fw (3 per minute).
            assert_eq!(header(&r, "RateLimit-Limit"), Some("1"), "{store}");
            assert_eq!(header(&r, "RateLimit-Remaining"), Some("0"));
            assert_eq!(header(&r, "RateLimit-Reset"), Some("45"));
            assert_eq!(header(&r, "Retry-After"), None);
            let r = client.should_rate_limit(req).await.unwrap().into_inner();
            assert_eq!(code(&r), Code::OverLimit, "{store}");
            assert_eq!(header(&r, "Retry-After"), Some("45"), "{store}");
            // The token bucket reports its capacity and the time until full.
            let r = client
                .should_rate_limit(request("algo", vec![descriptor(&[("tb", "h")])]))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(header(&r, "RateLimit-Limit"), Some("3"));
            assert_eq!(header(&r, "RateLimit-Remaining"), Some("2"));
            assert_eq!(header(&r, "RateLimit-Reset"), Some("20"));
            // A domain can turn them off.
            let r = client
                .should_rate_limit(request("envoy_style", vec![descriptor(&[("a", "h")])]))
                .await
                .unwrap()
                .into_inner();
            assert!(r.response_headers_to_add.is_empty(), "{store}");
            server.stop().await;
        },
    )
    .await;
}

#[tokio::test]
async fn count_everything_domain_consumes_what_fits() {
    on_every_store(
        &[LIMITS, COUNT_EVERYTHING],
        START_MS,
        |server, _clock, store| async move {
            let mut client = server.client().await;
            let both = request(
                "envoy_style",
                vec![descriptor(&[("a", "x")]), descriptor(&[("b", "x")])],
            );
            client.should_rate_limit(both.clone()).await.unwrap();
            let r = client.should_rate_limit(both).await.unwrap().into_inner();
            assert_eq!(code(&r), Code::OverLimit, "{store}");
            assert_eq!(
                r.statuses[0].limit_remaining, 3,
                "{store}: a consumed though b refused"
            );
            server.stop().await;
        },
    )
    .await;
}

#[tokio::test]
async fn subscription_tiers_in_the_example_config() {
    let config =
        ratekeeper::config::Config::load_dir(std::path::Path::new("examples/config")).unwrap();
    let clock = Arc::new(ManualClock::new(START_MS));
    let server = TestServer::start_with(config, None, Backend::Memory.store(clock)).await;
    let mut client = server.client().await;
    let call = |plan: &'static str, user: &'static str| {
        request(
            "api",
            vec![descriptor(&[("plan", plan), ("user_id", user)])],
        )
    };
    for i in 0..100 {
        let free = client
            .should_rate_limit(call("free", "f"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(code(&free), Code::Ok, "free request {i}");
        let starter = client
            .should_rate_limit(call("starter", "s"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(code(&starter), Code::Ok, "starter request {i}");
    }
    let free = client
        .should_rate_limit(call("free", "f"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        code(&free),
        Code::OverLimit,
        "the free tier stops at 100 a minute"
    );
    // A sliding window: at 60.000 s the minute's 100 hits still weigh 100;
    // at 60.001 s floor(99.998) = 99, and one more fits.
    assert_eq!(header(&free, "Retry-After"), Some("61"));
    let starter = client
        .should_rate_limit(call("starter", "s"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(code(&starter), Code::Ok, "the starter tier goes on");
    let other_free = client
        .should_rate_limit(call("free", "g"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(code(&other_free), Code::Ok, "limits are per user");
    server.stop().await;
}

#[tokio::test]
async fn concurrent_callers_on_redis_admit_exactly_the_limit() {
    const RACE: &str = r#"
domain: race
descriptors:
  - key: sl
    rate_limit: {unit: hour, requests_per_unit: 50, algorithm: sliding_log}
  - key: tb
    rate_limit: {unit: hour, requests_per_unit: 50, algorithm: token_bucket}
  - key: sw
    rate_limit: {unit: hour, requests_per_unit: 50, algorithm: sliding_window}
"#;
    let redis = RedisServer::start();
    // The Redis server's own clock: no pinning.
    let server = TestServer::start(&[RACE], redis.store(None)).await;
    for key in ["sl", "tb", "sw"] {
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let mut client = server.client().await;
            tasks.push(tokio::spawn(async move {
                let mut admitted = 0;
                for _ in 0..25 {
                    let r = client
                        .should_rate_limit(request("race", vec![descriptor(&[(key, "shared")])]))
                        .await
                        .unwrap()
                        .into_inner();
                    admitted += u32::from(r.overall_code == Code::Ok as i32);
                }
                admitted
            }));
        }
        let mut admitted = 0;
        for task in tasks {
            admitted += task.await.unwrap();
        }
        // 200 requests from 8 concurrent callers for 50 an hour. The token
        // bucket refills one token per 72 s and the sliding window only
        // discounts the previous hour, so neither admits more within the test.
        assert_eq!(admitted, 50, "{key}");
    }
    server.stop().await;
}

/// The sliding log's weighted entries live under keys of their own
/// (`…:slw.<seconds>`), so that the per-hit log an older version keeps
/// under `…:sl.<seconds>` (side by side during a rolling upgrade, or left
/// from before it) is never read as weighted entries: its members do not
/// parse as such, and the limiter would fail the whole call.
#[tokio::test]
async fn a_sliding_log_leaves_the_older_per_hit_log_alone() {
    const UPGRADE: &str = r#"
domain: upgrade
descriptors:
  - key: sl
    rate_limit: {unit: hour, requests_per_unit: 5, algorithm: sliding_log}
"#;
    let redis = RedisServer::start();
    let mut conn = redis.client().get_connection().unwrap();
    let (seconds, _): (u64, u64) = redis::cmd("TIME").query(&mut conn).unwrap();
    let old_key = "rk:{upgrade|sl=x}:sl.3600";
    let now_ms = seconds * 1_000;
    let _: u64 = redis::cmd("ZADD")
        .arg(old_key)
        .arg(now_ms)
        .arg(format!("{now_ms}.1"))
        .arg(now_ms)
        .arg(format!("{now_ms}.2"))
        .query(&mut conn)
        .unwrap();
    let server = TestServer::start(&[UPGRADE], redis.store(None)).await;
    let mut client = server.client().await;
    let r = client
        .should_rate_limit(request("upgrade", vec![descriptor(&[("sl", "x")])]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(
        r.statuses[0].limit_remaining, 4,
        "counted apart from the old log"
    );
    let members: Vec<String> = redis::cmd("ZRANGE")
        .arg("rk:{upgrade|sl=x}:slw.3600")
        .arg(0)
        .arg(-1)
        .query(&mut conn)
        .unwrap();
    assert_eq!(members, ["0000000000000001:1"]);
    let old: u64 = redis::cmd("ZCARD").arg(old_key).query(&mut conn).unwrap();
    assert_eq!(old, 2, "the old log is left to expire");
    server.stop().await;
}
