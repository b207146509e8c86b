//! Charges after the fact (issue #23): a cost known only when the response
//! ends is sent with `hits_addend` = the cost, after a check with
//! `hits_addend` 0. On a limit that takes charges the cost is recorded even
//! past the limit, so the next check is refused until the overrun is repaid.
//! Over gRPC against the server in-process, on every store; the
//! `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT` setting against the binary.

mod common;

use common::{descriptor, on_every_store, request, Ratekeeper};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use ratekeeper::config::Config;
use tonic::transport::Channel;

/// A minute boundary.
const START_MS: u64 = 1_800_000_000_000;

/// The issue's budget, 1,000 tokens a minute, once per algorithm: the fixed
/// window as envoyproxy/ratelimit's format writes it (it takes charges with
/// no setting), ratekeeper's own algorithms with `charges: record`.
const BUDGETS: &str = r#"
domain: llm
descriptors:
  - key: fixed_window
    rate_limit: {unit: minute, requests_per_unit: 1000}
  - key: sliding_window
    rate_limit: {unit: minute, requests_per_unit: 1000, algorithm: sliding_window, charges: record}
  - key: sliding_log
    rate_limit: {unit: minute, requests_per_unit: 1000, algorithm: sliding_log, charges: record}
  - key: token_bucket
    rate_limit: {unit: minute, requests_per_unit: 1000, algorithm: token_bucket, charges: record}
  - key: leaky_bucket
    rate_limit: {unit: minute, requests_per_unit: 1000, algorithm: leaky_bucket, charges: record}
  - key: tokens
    rate_limits:
      - {unit: minute, requests_per_unit: 1000, name: per_minute}
      - {unit: day, requests_per_unit: 2000, name: per_day}
"#;

/// The same budget where a refused request consumes nothing: per domain, per
/// limit against its domain's setting, and by default for ratekeeper's own
/// algorithms (`plain`); a domain's `record` applies to them too.
const DROPPED: &str = r#"
domain: drop_domain
charges: drop
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 1000}
---
domain: drop_limit
charges: record
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 1000, charges: drop}
  - key: own
    rate_limit: {unit: minute, requests_per_unit: 1000, algorithm: token_bucket}
---
domain: plain
descriptors:
  - key: own
    rate_limit: {unit: minute, requests_per_unit: 1000, algorithm: token_bucket}
"#;

/// A request on `domain` for `key=value`, of `hits` (0: a check).
fn charge(domain: &str, key: &str, value: &str, hits: u64) -> RateLimitRequest {
    let mut d = descriptor(&[(key, value)]);
    d.hits_addend = Some(UInt64Value { value: hits });
    request(domain, vec![d])
}

fn code(r: &RateLimitResponse) -> Code {
    Code::try_from(r.overall_code).unwrap_or(Code::Unknown)
}

type Client = RateLimitServiceClient<Channel>;

/// The answer to [`charge`]`(domain, key, value, hits)`.
async fn ask(
    client: &mut Client,
    domain: &str,
    key: &str,
    value: &str,
    hits: u64,
) -> RateLimitResponse {
    client
        .should_rate_limit(charge(domain, key, value, hits))
        .await
        .unwrap()
        .into_inner()
}

const ALGORITHMS: [&str; 5] = [
    "fixed_window",
    "sliding_window",
    "sliding_log",
    "token_bucket",
    "leaky_bucket",
];

#[tokio::test]
async fn the_issues_flow_on_every_algorithm_and_store() {
    on_every_store(&[BUDGETS], START_MS, |server, _clock, store| async move {
        let mut client = server.client().await;
        for algorithm in ALGORITHMS {
            let mut ask =
                async |value, hits| code(&ask(&mut client, "llm", algorithm, value, hits).await);
            let at = format!("{store} {algorithm}");
            assert_eq!(ask("a", 0).await, Code::Ok, "{at}: check");
            assert_eq!(ask("a", 1_500).await, Code::OverLimit, "{at}: charge 1,500");
            assert_eq!(
                ask("a", 0).await,
                Code::OverLimit,
                "{at}: the charge was recorded"
            );
            for (i, expected) in [Code::Ok, Code::Ok, Code::OverLimit]
                .into_iter()
                .enumerate()
            {
                assert_eq!(ask("b", 400).await, expected, "{at}: 400 #{i}");
            }
            assert_eq!(
                ask("b", 0).await,
                Code::OverLimit,
                "{at}: three charges of 400 spent the budget"
            );
        }
        server.stop().await;
    })
    .await;
}

#[tokio::test]
async fn the_budget_is_back_once_the_overrun_is_repaid_and_debt_is_bounded() {
    on_every_store(&[BUDGETS], START_MS, |server, clock, store| async move {
        let mut client = server.client().await;
        let mut ask = async |hits| code(&ask(&mut client, "llm", "token_bucket", "u", hits).await);
        // 1,500 tokens from a full bucket of 1,000 refilling 1,000 a minute
        // (60 ms each): a debt of 500, repaid in 30 s; the next token fits
        // 60 ms later.
        assert_eq!(ask(1_500).await, Code::OverLimit, "{store}");
        clock.advance(30_000);
        assert_eq!(ask(0).await, Code::OverLimit, "{store}: not yet repaid");
        clock.advance(60);
        assert_eq!(ask(0).await, Code::Ok, "{store}: repaid");
        // A charge of a billion is recorded as a debt of one limit: the
        // bucket is back after a minute plus a token, not two years.
        assert_eq!(ask(1_000_000_000).await, Code::OverLimit, "{store}");
        clock.advance(60_000);
        assert_eq!(ask(0).await, Code::OverLimit, "{store}: a minute of debt");
        clock.advance(60);
        assert_eq!(ask(0).await, Code::Ok, "{store}: the debt is bounded");
        server.stop().await;
    })
    .await;
}

/// All-or-nothing and charges: a refused request still records its charges
/// on every limit that takes them. The LLM case: 1,500 tokens spent refuse
/// the minute (1,000) and count against the day (2,000) too.
#[tokio::test]
async fn a_charge_refused_by_one_limit_is_recorded_on_every_limit() {
    on_every_store(&[BUDGETS], START_MS, |server, clock, store| async move {
        let mut client = server.client().await;
        let r = ask(&mut client, "llm", "tokens", "u", 1_500).await;
        assert_eq!(code(&r), Code::OverLimit, "{store}");
        clock.advance(60_000);
        // A new minute; the day has 500 left: the tightest limit now.
        let r = ask(&mut client, "llm", "tokens", "u", 0).await;
        let limit = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!(
            (code(&r), limit.name.as_str(), r.statuses[0].limit_remaining),
            (Code::Ok, "per_day", 500),
            "{store}"
        );
        let r = ask(&mut client, "llm", "tokens", "u", 600).await;
        assert_eq!(code(&r), Code::OverLimit, "{store}: the day is spent");
        server.stop().await;
    })
    .await;
}

/// A fixed window counts every charge in full, as envoyproxy/ratelimit's
/// counters do: a request whose `limit` override (100 a minute) shares the
/// counter of the file's 1,000 a minute, at 250, records all 300 of its
/// charge, and the file's limit then has 450 left (with a debt bound of
/// twice the override's limit it would have recorded none, leaving 750).
#[tokio::test]
async fn a_fixed_window_shared_through_a_limit_override_counts_every_charge() {
    on_every_store(&[BUDGETS], START_MS, |server, _clock, store| async move {
        let mut client = server.client().await;
        let r = ask(&mut client, "llm", "fixed_window", "o", 250).await;
        assert_eq!(code(&r), Code::Ok, "{store}");
        let mut overridden = descriptor(&[("fixed_window", "o")]);
        overridden.hits_addend = Some(UInt64Value { value: 300 });
        overridden.limit = Some(RateLimitOverride {
            requests_per_unit: 100,
            unit: 2, // MINUTE
        });
        let r = client
            .should_rate_limit(request("llm", vec![overridden]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(code(&r), Code::OverLimit, "{store}");
        let r = ask(&mut client, "llm", "fixed_window", "o", 0).await;
        assert_eq!(
            (code(&r), r.statuses[0].limit_remaining),
            (Code::Ok, 450),
            "{store}"
        );
        server.stop().await;
    })
    .await;
}

#[tokio::test]
async fn charges_drop_and_ratekeepers_own_algorithms_consume_nothing_when_refused() {
    on_every_store(&[DROPPED], START_MS, |server, _clock, store| async move {
        let mut client = server.client().await;
        for (domain, key, then) in [
            ("drop_domain", "user", Code::Ok),
            ("drop_limit", "user", Code::Ok),
            ("drop_limit", "own", Code::OverLimit),
            ("plain", "own", Code::Ok),
        ] {
            let mut ask = async |hits| code(&ask(&mut client, domain, key, "a", hits).await);
            let at = format!("{store} {domain} {key}");
            assert_eq!(ask(0).await, Code::Ok, "{at}");
            assert_eq!(ask(1_500).await, Code::OverLimit, "{at}");
            assert_eq!(ask(0).await, then, "{at}: Ok if nothing was consumed");
        }
        server.stop().await;
    })
    .await;
}

#[test]
fn an_unknown_charges_value_is_refused_with_its_line() {
    let text = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1, charges: always}\n";
    let error = Config::from_files([(std::path::Path::new("l.yaml"), text)]).unwrap_err();
    assert_eq!(error.line, Some(4), "{error}");
    assert!(
        error
            .reason
            .contains("unknown charges \"always\": expected record or drop"),
        "{error}"
    );
}

/// envoyproxy/ratelimit's `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true`
/// (their `src/redis/fixed_cache_impl.go`, and their test of it): a refused
/// request increments only the counters it takes over their limit, and
/// spares the ones it fitted; without it every counter is incremented. A
/// charge over the limit is recorded either way.
#[tokio::test]
async fn stop_cache_key_increment_when_overlimit_spares_what_fitted() {
    let dir = tempfile::tempdir().unwrap();
    let limits = "domain: llm\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1000}\n  - key: team\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
    std::fs::write(dir.path().join("limits.yaml"), limits).unwrap();
    for (env, user_left) in [(None, 992), (Some("true"), 1000), (Some("false"), 992)] {
        let env: Vec<(&str, &str)> = env
            .map(|v| ("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", v))
            .into_iter()
            .collect();
        let server = Ratekeeper::spawn_with_env(dir.path(), &[], &env);
        let mut client = server.client().await;
        assert_eq!(
            code(&ask(&mut client, "llm", "user", "a", 1_500).await),
            Code::OverLimit,
            "{env:?}"
        );
        let after = ask(&mut client, "llm", "user", "a", 0).await;
        assert_eq!(
            code(&after),
            Code::OverLimit,
            "{env:?}: the charge is recorded"
        );

        // 8 hits on both: the team (5) refuses; the user (1,000) fits.
        let both = |hits| {
            let mut user = descriptor(&[("user", "b")]);
            let mut team = descriptor(&[("team", "t")]);
            user.hits_addend = Some(UInt64Value { value: hits });
            team.hits_addend = Some(UInt64Value { value: hits });
            request("llm", vec![user, team])
        };
        let refused = client
            .should_rate_limit(both(8))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(code(&refused), Code::OverLimit, "{env:?}");
        let now = client
            .should_rate_limit(both(0))
            .await
            .unwrap()
            .into_inner();
        let left: Vec<u32> = now.statuses.iter().map(|s| s.limit_remaining).collect();
        assert_eq!(left, [user_left, 0], "{env:?}: the user's counter");
        server.terminate();
    }
}

/// A charge that takes a counter over its limit is split into near and over
/// limit from where the counter stood before it, as envoyproxy/ratelimit's
/// base limiter splits it (from the counter before the increment): their
/// dashboards read the same numbers. On memory and Redis, in Prometheus.
#[tokio::test]
async fn a_charge_over_the_limit_splits_into_near_and_over_as_theirs() {
    let redis = common::RedisServer::start();
    let url = redis.url();
    let limits = "domain: llm\ndescriptors:\n  - key: user\n    rate_limit: {unit: day, requests_per_unit: 1000}\n";
    // A deadline a loaded machine's debug build never meets by accident:
    // this test counts, it does not time.
    let on_redis = ["--redis-url", &url, "--redis-timeout-ms", "2000"];
    for args in [&[][..], &on_redis[..]] {
        let dir = tempfile::tempdir().unwrap();
        let server = Ratekeeper::start(limits, dir.path(), args);
        let mut client = server.client().await;
        // Near from 800 on (NEAR_LIMIT_RATIO 0.8). 900: within, 100 near.
        // 900 + 200: 100 near, 100 over. 0: nothing. 1,500 on a new
        // counter: 200 near, 500 over.
        for (value, hits, expected) in [
            ("a", 900, Code::Ok),
            ("a", 200, Code::OverLimit),
            ("a", 0, Code::OverLimit),
            ("b", 1_500, Code::OverLimit),
        ] {
            let answer = ask(&mut client, "llm", "user", value, hits).await;
            assert_eq!(code(&answer), expected, "{args:?}: {value} {hits}");
        }
        let text = server.metrics();
        for (stat, n) in [
            ("total_hits", 2_600),
            ("within_limit", 900),
            ("near_limit", 400),
            ("over_limit", 600),
        ] {
            let line =
                format!(r#"ratelimit_service_rate_limit_{stat}{{domain="llm",key1="user"}} {n}"#);
            assert!(
                text.lines().any(|l| l == line),
                "{args:?}: /metrics lacks {line:?}:\n{text}"
            );
        }
        server.terminate();
    }
}
