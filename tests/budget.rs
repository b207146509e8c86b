//! Budgets over gRPC (`ratekeeper.v1.BudgetService`): reserve, then settle,
//! in-process on memory, Redis and a Redis Cluster for every algorithm, and
//! with real replica processes sharing one Redis (or Cluster): a reservation
//! settled on another replica, and one whose replica was SIGKILLed.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{descriptor, request, Backend, Ratekeeper, RedisCluster, RedisServer, TestServer};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use ratekeeper::clock::ManualClock;
use ratekeeper::pb::v1::budget_service_client::BudgetServiceClient;
use ratekeeper::pb::v1::{
    BudgetStatus, Descriptor, Entry, ReserveRequest, ReserveResponse, SettleRequest, SettleResponse,
};
use tonic::transport::Channel;
use tonic::{Code, Response, Status};

/// One rule per algorithm, 1,000 hits a minute each (the buckets' burst
/// defaults to that), smaller ones, a rule that limits nothing and a quota.
const LIMITS: &str = r#"
domain: llm
descriptors:
  - key: fixed_window
    rate_limit: {unit: minute, requests_per_unit: 1000}
  - key: sliding_window
    rate_limit: {unit: minute, requests_per_unit: 1000, algorithm: sliding_window}
  - key: sliding_log
    rate_limit: {unit: minute, requests_per_unit: 1000, algorithm: sliding_log}
  - key: token_bucket
    rate_limit: {unit: minute, requests_per_unit: 1000, algorithm: token_bucket}
  - key: leaky_bucket
    rate_limit: {unit: minute, requests_per_unit: 1000, algorithm: leaky_bucket}
  - key: small
    rate_limit: {unit: minute, requests_per_unit: 20, algorithm: token_bucket}
  - key: bursty
    rate_limit: {unit: minute, requests_per_unit: 100, algorithm: token_bucket, burst: 10}
  - key: small_window
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: daily
    rate_limit: {unit: day, requests_per_unit: 1000, algorithm: token_bucket}
  - key: free
    rate_limit: {unlimited: true}
  - key: quota
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 20}
"#;

const ALGORITHMS: [&str; 5] = [
    "fixed_window",
    "sliding_window",
    "sliding_log",
    "token_bucket",
    "leaky_bucket",
];

/// Minute-aligned, so no window ends while the clock stands still.
const START_MS: u64 = 1_800_000_000_000;

type Client = BudgetServiceClient<Channel>;

/// A server on the memory store, its clock standing at `START_MS`.
async fn memory_server() -> TestServer {
    server_on(&Backend::Memory).await
}

/// A server on `backend`'s store, its clock standing at `START_MS`.
async fn server_on(backend: &Backend) -> TestServer {
    clocked_server_on(backend).await.0
}

/// A server on `backend`'s store, and its clock (standing at `START_MS`).
async fn clocked_server_on(backend: &Backend) -> (TestServer, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(START_MS));
    let server = TestServer::start(&[LIMITS], backend.store(clock.clone())).await;
    (server, clock)
}

async fn connect(addr: &str) -> Client {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match BudgetServiceClient::connect(format!("http://{addr}")).await {
            Ok(client) => return client,
            Err(e) if Instant::now() > deadline => panic!("cannot connect to {addr}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

fn entries(key: &str, user: &str) -> Descriptor {
    Descriptor {
        entries: vec![Entry {
            key: key.into(),
            value: user.into(),
        }],
    }
}

fn reserve_request(key: &str, user: &str, estimate: u64, ttl: Option<Duration>) -> ReserveRequest {
    ReserveRequest {
        domain: "llm".into(),
        descriptors: vec![entries(key, user)],
        estimate,
        ttl: ttl.map(|d| prost_types::Duration {
            seconds: d.as_secs() as i64,
            nanos: d.subsec_nanos() as i32,
        }),
    }
}

async fn reserve(client: &mut Client, key: &str, user: &str, estimate: u64) -> ReserveResponse {
    client
        .reserve(reserve_request(key, user, estimate, None))
        .await
        .expect("reserve")
        .into_inner()
}

async fn settle(client: &mut Client, id: &str, actual: u64) -> SettleResponse {
    try_settle(client, id, actual).await.expect("settle")
}

async fn try_settle(client: &mut Client, id: &str, actual: u64) -> Result<SettleResponse, Status> {
    let request = SettleRequest {
        reservation_id: id.into(),
        actual,
    };
    client.settle(request).await.map(Response::into_inner)
}

/// `ShouldRateLimit`'s view of the budget: a check of 0 hits.
fn check_only(key: &str, user: &str) -> RateLimitRequest {
    spend(key, user, 0)
}

/// A `ShouldRateLimit` of `hits` on one descriptor (another caller's).
fn spend(key: &str, user: &str, hits: u64) -> RateLimitRequest {
    let mut d = descriptor(&[(key, user)]);
    d.hits_addend = Some(UInt64Value { value: hits });
    request("llm", vec![d])
}

fn remaining(statuses: &[BudgetStatus]) -> Vec<u64> {
    statuses.iter().map(|s| s.remaining).collect()
}

#[tokio::test]
async fn reserve_then_settle_per_algorithm_on_every_store() {
    for backend in Backend::all_with_cluster() {
        let name = backend.name();
        let server = server_on(&backend).await;
        let mut client = connect(&server.addr.to_string()).await;
        let mut rls = server.client().await;
        for algorithm in ALGORITHMS {
            let at = format!("{name}/{algorithm}");
            let r = reserve(&mut client, algorithm, "u", 100).await;
            assert!(
                r.granted && r.reservation_id.starts_with("r3."),
                "{at}: {r:?}"
            );
            assert_eq!(r.statuses.len(), 1, "{at}");
            let s = &r.statuses[0];
            assert_eq!((s.remaining, s.limit, s.over), (900, 1000, false), "{at}");
            assert_eq!(r.ttl.map(|t| t.seconds), Some(300), "{at}: the default TTL");
            assert!(r.retry_after.is_none(), "{at}");

            let settled = settle(&mut client, &r.reservation_id, 40).await;
            assert_eq!(
                (settled.settled, settled.already_settled),
                (40, false),
                "{at}"
            );
            assert_eq!(remaining(&settled.statuses), [960], "{at}: 40 used");
            let seen = rls.should_rate_limit(check_only(algorithm, "u")).await;
            let seen = seen.expect("check").into_inner().statuses[0].limit_remaining;
            assert_eq!(seen, 960, "{at}: ShouldRateLimit sees the same budget");

            // An actual over the estimate is charged on top.
            let r = reserve(&mut client, algorithm, "u", 100).await;
            assert_eq!(remaining(&r.statuses), [860], "{at}");
            let settled = settle(&mut client, &r.reservation_id, 150).await;
            assert_eq!(remaining(&settled.statuses), [810], "{at}: 40 + 150 used");
        }
        server.stop().await;
    }
}

/// The admin API's reset takes what a reservation had taken with it: a
/// settle after it gives nothing back, so hits others spent since stay
/// spent (the windows gave the reservation's unused part back from them:
/// 600 reserved, reset, 500 spent, settled at 0 left 1000), while an
/// actual over the estimate is still charged.
#[tokio::test]
async fn a_settle_after_a_reset_gives_back_nothing_of_what_others_spent() {
    for backend in Backend::all_with_cluster() {
        let name = backend.name();
        let server = server_on(&backend).await;
        let mut client = connect(&server.addr.to_string()).await;
        let mut rls = server.client().await;
        for algorithm in ALGORITHMS {
            let at = format!("{name}/{algorithm}");
            let reset = |user: &str| {
                let (addr, path) = (
                    server.admin.to_string(),
                    format!("/v1/descriptor?domain=llm&entry={algorithm}%3D{user}"),
                );
                tokio::task::spawn_blocking(move || common::http_call(&addr, "DELETE", &path, ""))
            };
            let r = reserve(&mut client, algorithm, "reset", 600).await;
            assert_eq!(reset("reset").await.unwrap().status, 200, "{at}");
            let spent = rls.should_rate_limit(spend(algorithm, "reset", 500)).await;
            let spent = spent.expect("spend").into_inner().statuses[0].limit_remaining;
            assert_eq!(spent, 500, "{at}: counted from the reset");
            let settled = settle(&mut client, &r.reservation_id, 0).await;
            assert_eq!(
                remaining(&settled.statuses),
                [500],
                "{at}: nothing given back"
            );

            let r = reserve(&mut client, algorithm, "over", 100).await;
            assert_eq!(reset("over").await.unwrap().status, 200, "{at}");
            let settled = settle(&mut client, &r.reservation_id, 150).await;
            assert_eq!(
                remaining(&settled.statuses),
                [950],
                "{at}: the excess charged"
            );
        }
        server.stop().await;
    }
}

#[tokio::test]
async fn concurrent_reserves_never_commit_more_than_the_budget() {
    for backend in Backend::all_with_cluster() {
        let name = backend.name();
        let server = server_on(&backend).await;
        let client = connect(&server.addr.to_string()).await;
        // A budget of 20 and estimates of 2: room for 10.
        for key in ["small", "small_window"] {
            let at = format!("{name}/{key}");
            let granted = reserve_at_once(&client, key, 64).await;
            assert_eq!(granted.len(), 10, "{at}: exactly 10 of 64");
            let mut one = client.clone();
            for id in &granted {
                assert_eq!(settle(&mut one, id, 1).await.settled, 1, "{at}");
            }
            // Settled at half the estimate: 10 of the 20 are back, room
            // for 5 more estimates of 2.
            let again = reserve_at_once(&client, key, 64).await;
            assert_eq!(again.len(), 5, "{at}: the freed budget, no more");
            let refused = reserve(&mut one, key, "u", 2).await;
            assert!(
                !refused.granted && refused.reservation_id.is_empty(),
                "{at}"
            );
            assert!(refused.statuses[0].over, "{at}");
            let wait = refused.retry_after.expect("retry_after when refused");
            assert!(wait.seconds > 0 || wait.nanos > 0, "{at}: {wait:?}");
        }
        server.stop().await;
    }
}

/// A bucket's give-back moves the reservations queued behind it forward: a
/// later settle must not take its hits for still queued once they have
/// drained, and give back hits another caller spent since.
#[tokio::test]
async fn a_bucket_settle_never_gives_back_hits_spent_by_others() {
    for backend in Backend::all() {
        let name = backend.name();
        let (server, clock) = clocked_server_on(&backend).await;
        let mut client = connect(&server.addr.to_string()).await;
        let mut rls = server.client().await;
        for algorithm in ["token_bucket", "leaky_bucket"] {
            let at = format!("{name}/{algorithm}");
            let a = reserve(&mut client, algorithm, "u", 100).await;
            let b = reserve(&mut client, algorithm, "u", 100).await;
            assert!(a.granted && b.granted, "{at}");
            let s = settle(&mut client, &a.reservation_id, 0).await;
            assert_eq!(remaining(&s.statuses), [900], "{at}: only B's 100 held");
            // 6 s: B's 100 (60 ms each), first in the queue now, drained.
            clock.advance(6_000);
            let spent = rls.should_rate_limit(spend(algorithm, "u", 100)).await;
            let spent = spent.expect("spend").into_inner().statuses[0].limit_remaining;
            assert_eq!(spent, 900, "{at}: another caller's 100");
            let s = settle(&mut client, &b.reservation_id, 0).await;
            assert_eq!(
                remaining(&s.statuses),
                [900],
                "{at}: nothing of B's left to give"
            );
            // And a give-back that is due still comes: C's 100, undrained.
            let c = reserve(&mut client, algorithm, "u", 100).await;
            assert_eq!(remaining(&c.statuses), [800], "{at}");
            let s = settle(&mut client, &c.reservation_id, 40).await;
            assert_eq!(remaining(&s.statuses), [860], "{at}: C's 60 unused");
            clock.advance(60_000);
        }
        server.stop().await;
    }
}

/// The queue drains in order: what drained while a reservation stood first
/// counts as its own, so settling it below its estimate gives back less
/// than if it had taken only the actual, when others wait behind it (the
/// limit README's bucket row states). A fixed window has no such order.
#[tokio::test]
async fn a_bucket_settle_counts_what_drained_ahead_of_the_queue_as_its_own() {
    for backend in Backend::all() {
        let (server, clock) = clocked_server_on(&backend).await;
        let mut client = connect(&server.addr.to_string()).await;
        let cases = [
            ("token_bucket", 600, 700),
            ("leaky_bucket", 600, 700),
            ("fixed_window", 600, 600),
        ];
        for (algorithm, left, alone_left) in cases {
            let at = format!("{}/{algorithm}", backend.name());
            let a = reserve(&mut client, algorithm, "drain", 600).await;
            let b = reserve(&mut client, algorithm, "drain", 400).await;
            assert!(a.granted && b.granted, "{at}");
            // 6 s: 100 hits' worth drained, all of them A's.
            clock.advance(6_000);
            settle(&mut client, &a.reservation_id, 0).await;
            let s = settle(&mut client, &b.reservation_id, 400).await;
            assert_eq!(remaining(&s.statuses), [left], "{at}");
            // B alone, the same 6 s later: what drained was B's.
            let alone = reserve(&mut client, algorithm, "alone", 400).await;
            clock.advance(6_000);
            let s = settle(&mut client, &alone.reservation_id, 400).await;
            assert_eq!(remaining(&s.statuses), [alone_left], "{at}: B alone");
            clock.advance(60_000);
        }
        server.stop().await;
    }
}

/// A reservation granted on a leaky bucket queues as a request does, and
/// says how long until its turn, as `ShouldRateLimit` tells an admitted
/// request there; other algorithms have no queue and answer no wait.
#[tokio::test]
async fn a_leaky_bucket_reservation_says_how_long_until_its_turn() {
    let millis = |d: Option<prost_types::Duration>| {
        d.map(|d| d.seconds * 1_000 + i64::from(d.nanos / 1_000_000))
    };
    for backend in Backend::all() {
        let name = backend.name();
        let server = server_on(&backend).await;
        let mut client = connect(&server.addr.to_string()).await;
        // 1,000 a minute: 60 ms a hit.
        let first = reserve(&mut client, "leaky_bucket", "q", 100).await;
        let second = reserve(&mut client, "leaky_bucket", "q", 100).await;
        assert_eq!(millis(first.wait), Some(0), "{name}: nothing ahead");
        assert_eq!(millis(second.wait), Some(6_000), "{name}: 100 hits ahead");
        let mut rls = server.client().await;
        let third = rls.should_rate_limit(spend("leaky_bucket", "q", 100)).await;
        let third = third.expect("spend").into_inner().statuses[0].duration_until_reset;
        assert_eq!(third.map(|d| d.seconds), Some(12), "{name}: 200 hits ahead");
        for other in ["fixed_window", "token_bucket"] {
            let r = reserve(&mut client, other, "q", 100).await;
            assert!(r.granted && r.wait.is_none(), "{name}/{other}: {r:?}");
        }
        server.stop().await;
    }
}

/// A bucket's give-backs (`<key>:given` and `:given.log` in Redis) live as
/// long as a reservation on it may settle, and a minute more: made by a
/// granted reservation, kept by each as long as its TTL, never shortened
/// (a refused one makes nothing). (They
/// lived two hours past every reservation and settle, long after their
/// bucket: a soak's Redis held 16,000 of them and nothing else.)
#[tokio::test]
async fn bucket_give_backs_live_as_long_as_a_reservation_may_settle() {
    let redis = RedisServer::start();
    let server = TestServer::start(&[LIMITS], redis.store(None)).await;
    let mut client = connect(&server.addr.to_string()).await;
    let mut conn = redis.client().get_connection().unwrap();
    let pttl = |conn: &mut redis::Connection, suffix: &str| -> i64 {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("*{suffix}"))
            .query(conn)
            .unwrap();
        assert_eq!(keys.len(), 1, "{suffix}: {keys:?}");
        redis::cmd("PTTL").arg(&keys[0]).query(conn).unwrap()
    };
    // A refused reservation keeps nothing, not even on the bucket it fitted.
    let mut refused = reserve_request("token_bucket", "g", 30, Some(Duration::from_secs(3_600)));
    refused.descriptors.push(entries("small", "g"));
    assert!(!client.reserve(refused).await.unwrap().into_inner().granted);
    let kept: Vec<String> = redis::cmd("KEYS").arg("*:given*").query(&mut conn).unwrap();
    assert!(kept.is_empty(), "{kept:?}");
    let ten_seconds = reserve_request("token_bucket", "g", 100, Some(Duration::from_secs(10)));
    let a = client.reserve(ten_seconds).await.unwrap().into_inner();
    assert!(a.granted);
    let made = pttl(&mut conn, ":given");
    assert!((60_000..=70_000).contains(&made), "{made} ms");
    let s = settle(&mut client, &a.reservation_id, 40).await;
    assert_eq!(remaining(&s.statuses), [960]);
    for suffix in [":given", ":given.log"] {
        let left = pttl(&mut conn, suffix);
        assert!((55_000..=70_000).contains(&left), "{suffix}: {left} ms");
    }
    let an_hour = reserve_request("token_bucket", "g", 100, Some(Duration::from_secs(3_600)));
    assert!(client.reserve(an_hour).await.unwrap().into_inner().granted);
    for suffix in [":given", ":given.log"] {
        let kept = pttl(&mut conn, suffix);
        assert!(kept > 3_600_000, "{suffix}: {kept} ms");
    }
    server.stop().await;
}

/// Settles in any order give back all that is unused and still queued: a
/// give-back behind a reservation moved nothing of its (the front one, which
/// settles last here, still finds its 90 unused).
#[tokio::test]
async fn bucket_settles_in_any_order_give_back_all_that_is_unused() {
    for backend in Backend::all() {
        let name = backend.name();
        let server = server_on(&backend).await;
        let mut client = connect(&server.addr.to_string()).await;
        for algorithm in ["token_bucket", "leaky_bucket"] {
            let at = format!("{name}/{algorithm}");
            let mut ids = Vec::new();
            for _ in 0..4 {
                let r = reserve(&mut client, algorithm, "any-order", 100).await;
                assert!(r.granted, "{at}");
                ids.push(r.reservation_id);
            }
            let mut left = 600;
            for i in [2, 3, 1, 0] {
                let s = settle(&mut client, &ids[i], 10).await;
                left += 90;
                assert_eq!(remaining(&s.statuses), [left], "{at}: settled #{i}");
            }
        }
        server.stop().await;
    }
}

/// Two descriptors on one bucket key make one stretch of its queue, each
/// check's hits ending at its own mark: settled at 0, all 200 come back;
/// with 50 of them drained and another caller's 100 spent since, exactly
/// the 150 still queued come back, and the other caller's 100 stay.
#[tokio::test]
async fn a_bucket_reservation_with_two_checks_on_one_key_gives_back_all_unused() {
    for backend in Backend::all() {
        let name = backend.name();
        let (server, clock) = clocked_server_on(&backend).await;
        let mut client = connect(&server.addr.to_string()).await;
        let mut rls = server.client().await;
        for (algorithm, drained_ms, spent, left) in [
            ("token_bucket", 0, 0, 1000),
            ("leaky_bucket", 0, 0, 1000),
            // 3 s: 50 of the first check's 100 (60 ms each) drained.
            ("token_bucket", 3_000, 100, 900),
            ("leaky_bucket", 3_000, 100, 900),
        ] {
            let at = format!("{name}/{algorithm}/{drained_ms}");
            let user = format!("dup-{drained_ms}");
            let mut two = reserve_request(algorithm, &user, 100, None);
            two.descriptors.push(entries(algorithm, &user));
            let r = client.reserve(two).await.expect("reserve").into_inner();
            assert!(r.granted, "{at}");
            assert_eq!(remaining(&r.statuses), [900, 800], "{at}: 200 taken");
            clock.advance(drained_ms);
            if spent > 0 {
                let answer = rls.should_rate_limit(spend(algorithm, &user, spent)).await;
                assert_eq!(answer.expect("spend").into_inner().overall_code, 1, "{at}");
            }
            let s = settle(&mut client, &r.reservation_id, 0).await;
            assert_eq!(remaining(&s.statuses), [left, left], "{at}");
        }
        server.stop().await;
    }
}

/// A quota descriptor (`quota_mode`) over its limit refuses a reservation
/// as a plain one does. `ShouldRateLimit` lets a request through unless
/// every quota descriptor is over, and a quota descriptor over its limit
/// takes nothing: a reservation let through so would commit past it.
#[tokio::test]
async fn a_quota_limit_refuses_a_reservation_it_cannot_hold() {
    for backend in Backend::all() {
        let name = backend.name();
        let server = server_on(&backend).await;
        let mut client = connect(&server.addr.to_string()).await;
        let first = reserve(&mut client, "quota", "q", 15).await;
        assert!(first.granted, "{name}");
        assert_eq!(remaining(&first.statuses), [5], "{name}");
        for _ in 0..3 {
            let refused = reserve(&mut client, "quota", "q", 15).await;
            assert!(
                !refused.granted && refused.reservation_id.is_empty(),
                "{name}: {refused:?}"
            );
            assert!(
                refused.statuses[0].over && refused.retry_after.is_some(),
                "{name}"
            );
        }
        let rest = reserve(&mut client, "quota", "q", 5).await;
        assert!(rest.granted, "{name}: the 5 left fit");
        assert_eq!(remaining(&rest.statuses), [0], "{name}");
        server.stop().await;
    }
}

/// An estimate no limit could ever hold (over a window's limit, over a
/// bucket's burst) is refused without a `retry_after`: a caller told to
/// wait would wait and retry forever. The whole limit at once still fits.
#[tokio::test]
async fn an_estimate_over_what_a_limit_ever_admits_gets_no_retry_after() {
    for backend in Backend::all() {
        let name = backend.name();
        let server = server_on(&backend).await;
        let mut client = connect(&server.addr.to_string()).await;
        for key in ALGORITHMS {
            let at = format!("{name}/{key}");
            let never = reserve(&mut client, key, "big", 1_001).await;
            assert!(!never.granted && never.statuses[0].over, "{at}");
            assert_eq!(never.retry_after, None, "{at}: waiting would not help");
            let whole = reserve(&mut client, key, "big", 1_000).await;
            assert!(whole.granted, "{at}: the whole limit at once");
            let later = reserve(&mut client, key, "big", 1).await;
            assert!(later.retry_after.is_some(), "{at}: this one fits later");
        }
        server.stop().await;
    }
}

/// A status's `limit` is what the limit admits at once, as
/// `RateLimit-Limit` says: a bucket's burst, which its `remaining` never
/// passes (it said `requests_per_unit`, 100 over a remaining of 10, and a
/// gateway told its caller so).
#[tokio::test]
async fn a_bucket_status_reports_its_burst_as_the_limit() {
    for backend in Backend::all() {
        let name = backend.name();
        let server = server_on(&backend).await;
        let mut client = connect(&server.addr.to_string()).await;
        let never = reserve(&mut client, "bursty", "b", 11).await;
        let status = &never.statuses[0];
        assert!(!never.granted && never.retry_after.is_none(), "{name}");
        assert_eq!((status.remaining, status.limit), (10, 10), "{name}");
        let granted = reserve(&mut client, "bursty", "b", 4).await;
        let status = &granted.statuses[0];
        assert_eq!((status.remaining, status.limit), (6, 10), "{name}");
        let settled = settle(&mut client, &granted.reservation_id, 1).await;
        assert_eq!(settled.statuses[0].limit, 10, "{name}");
        server.stop().await;
    }
}

/// Sends `n` reserves of 2 for user `u` at once; the granted ids.
async fn reserve_at_once(client: &Client, key: &str, n: usize) -> Vec<String> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let mut client = client.clone();
            let key = key.to_owned();
            tokio::spawn(async move { reserve(&mut client, &key, "u", 2).await })
        })
        .collect();
    let mut granted = Vec::new();
    for task in tasks {
        let r = task.await.expect("task");
        if r.granted {
            granted.push(r.reservation_id);
        }
    }
    granted
}

#[tokio::test]
async fn several_descriptors_take_all_or_nothing_on_every_store() {
    for backend in Backend::all_with_cluster() {
        let name = backend.name();
        let server = server_on(&backend).await;
        let mut client = connect(&server.addr.to_string()).await;
        // Two users on two nodes of the 3-master Cluster (its first and last
        // third of the slots): the reservation takes two calls there.
        let slot = ratekeeper::keys::cluster_slot;
        assert!(slot("{llm|fixed_window=ann}") < 5_461);
        assert!(slot("{llm|small_window=bob}") > 10_922);
        let two = |estimate| ReserveRequest {
            descriptors: vec![
                entries("fixed_window", "ann"),
                entries("small_window", "bob"),
            ],
            ..reserve_request("fixed_window", "ann", estimate, None)
        };
        let refused = client.reserve(two(25)).await.expect("reserve").into_inner();
        assert!(!refused.granted, "{name}: 25 does not fit bob's 20");
        let over: Vec<bool> = refused.statuses.iter().map(|s| s.over).collect();
        assert_eq!(over, [false, true], "{name}: bob's limit refused");
        let granted = client.reserve(two(15)).await.expect("reserve").into_inner();
        assert!(granted.granted, "{name}");
        assert_eq!(
            remaining(&granted.statuses),
            [985, 5],
            "{name}: the refusal took nothing from ann"
        );
        let settled = settle(&mut client, &granted.reservation_id, 10).await;
        assert_eq!(remaining(&settled.statuses), [990, 10], "{name}");
        server.stop().await;
    }
}

#[tokio::test]
async fn a_retried_settle_answers_the_same_and_charges_once() {
    for backend in Backend::all_with_cluster() {
        let name = backend.name();
        let server = server_on(&backend).await;
        let mut client = connect(&server.addr.to_string()).await;
        for algorithm in ALGORITHMS {
            let at = format!("{name}/{algorithm}");
            let r = reserve(&mut client, algorithm, "retry", 100).await;
            let first = settle(&mut client, &r.reservation_id, 40).await;
            assert!(!first.already_settled, "{at}");
            // The retries, the last with another actual: still the first's.
            for actual in [40, 40, 70] {
                let retry = settle(&mut client, &r.reservation_id, actual).await;
                assert!(retry.already_settled, "{at}");
                assert_eq!(retry.settled, 40, "{at}");
                assert_eq!(remaining(&retry.statuses), [960], "{at}: charged once");
            }
        }
        server.stop().await;
    }
}

#[tokio::test]
async fn an_unsettled_reservation_stays_charged_after_its_ttl() {
    for backend in Backend::all_with_cluster() {
        let name = backend.name();
        let (server, clock) = clocked_server_on(&backend).await;
        let mut client = connect(&server.addr.to_string()).await;
        let mut rls = server.client().await;
        let ttl = Duration::from_secs(1);
        let r = client
            .reserve(reserve_request("fixed_window", "late", 100, Some(ttl)))
            .await
            .expect("reserve")
            .into_inner();
        assert_eq!(r.ttl.map(|t| t.seconds), Some(1), "{name}");
        // Past the TTL on the store's clock and on Redis's own.
        clock.advance(1_100);
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let late = try_settle(&mut client, &r.reservation_id, 10)
            .await
            .expect_err("a settle after the TTL");
        assert_eq!(late.code(), Code::NotFound, "{name}: {late:?}");
        assert!(late.message().contains("expired"), "{}", late.message());
        let seen = rls
            .should_rate_limit(check_only("fixed_window", "late"))
            .await
            .expect("check")
            .into_inner();
        assert_eq!(
            seen.statuses[0].limit_remaining, 900,
            "{name}: the estimate stays spent"
        );
        server.stop().await;
    }
}

#[tokio::test]
async fn nothing_to_settle_when_no_rule_limits_the_descriptors() {
    let server = memory_server().await;
    let mut client = connect(&server.addr.to_string()).await;
    for key in ["free", "nobody"] {
        let r = reserve(&mut client, key, "u", 1_000_000).await;
        assert!(r.granted && r.reservation_id.is_empty(), "{key}: {r:?}");
        assert_eq!(r.statuses, [BudgetStatus::default()], "{key}");
    }
    // Several descriptors: one status each, in order.
    let mut two = reserve_request("free", "u", 5, None);
    two.descriptors.push(entries("fixed_window", "multi"));
    let r = client.reserve(two).await.expect("reserve").into_inner();
    assert_eq!(remaining(&r.statuses), [0, 995]);
    assert_eq!(r.statuses[1].limit, 1000);
    let s = settle(&mut client, &r.reservation_id, 5).await;
    assert_eq!(remaining(&s.statuses), [0, 995]);
    server.stop().await;
}

#[tokio::test]
async fn a_settle_that_gives_back_clears_the_over_limit_cache() {
    let server = memory_server().await;
    let mut client = connect(&server.addr.to_string()).await;
    let mut rls = server.client().await;
    let r = reserve(&mut client, "small_window", "cached", 20).await;
    assert_eq!(remaining(&r.statuses), [0], "the whole budget");
    // ShouldRateLimit finds the fixed window full, and remembers it.
    for _ in 0..2 {
        let full = rls.should_rate_limit(check_only("small_window", "cached"));
        let full = full.await.expect("check").into_inner();
        assert_eq!(full.overall_code, 2, "OVER_LIMIT: {full:?}");
    }
    settle(&mut client, &r.reservation_id, 5).await;
    let freed = rls.should_rate_limit(check_only("small_window", "cached"));
    let freed = freed.await.expect("check").into_inner();
    assert_eq!(
        (freed.overall_code, freed.statuses[0].limit_remaining),
        (1, 15),
        "OK: the 15 given back, not the cached OVER_LIMIT"
    );
    server.stop().await;
}

#[tokio::test]
async fn bad_input_gets_a_status_with_a_reason() {
    let server = memory_server().await;
    let mut client = connect(&server.addr.to_string()).await;
    let granted = reserve(&mut client, "fixed_window", "bad", 10).await;
    // Another nonce, or another estimate (10 becoming 1000, to be given
    // back 990 that were never taken): well formed, but its MAC does not
    // match.
    let id = &granted.reservation_id;
    let flipped = if &id[3..4] == "0" { "1" } else { "0" };
    let other_nonce = format!("r3.{flipped}{}", &id[4..]);
    let (fields, estimate) = ("_60000_0_10_", "_60000_0_1000_");
    assert!(id.contains(fields), "{id}");
    let other_estimate = id.replace(fields, estimate);
    let settles = [
        (String::new(), Code::InvalidArgument, "empty"),
        (
            "garbage".to_owned(),
            Code::InvalidArgument,
            "not a reservation id",
        ),
        (
            format!("r1.{}", "a".repeat(32)),
            Code::InvalidArgument,
            "not a reservation id of this version",
        ),
        (
            format!("r2.{}", &id[3..]),
            Code::InvalidArgument,
            "not a reservation id of this version",
        ),
        (
            format!("r3.{}", "a".repeat(32)),
            Code::InvalidArgument,
            "malformed",
        ),
        (other_nonce, Code::NotFound, "reservation not found"),
        (other_estimate, Code::NotFound, "reservation not found"),
    ];
    for (id, code, reason) in settles {
        let e = try_settle(&mut client, &id, 1).await.expect_err(&id);
        assert_eq!(e.code(), code, "{id:?}: {e:?}");
        assert!(e.message().contains(reason), "{id:?}: {}", e.message());
    }
    let mut unknown = reserve_request("fixed_window", "bad", 10, None);
    unknown.domain = "nope".into();
    let mut no_descriptors = reserve_request("fixed_window", "bad", 10, None);
    no_descriptors.descriptors.clear();
    let reserves = [
        (
            reserve_request("fixed_window", "bad", 0, None),
            "estimate must be more than 0",
        ),
        (unknown, "unknown domain \"nope\""),
        (no_descriptors, "descriptor list must not be empty"),
        (
            reserve_request("fixed_window", "bad", 1, Some(Duration::from_millis(500))),
            "ttl must be between 1s and 3600s",
        ),
        (
            reserve_request("fixed_window", "bad", 1, Some(Duration::from_secs(3601))),
            "ttl must be between",
        ),
    ];
    for (request, reason) in reserves {
        let e = client.reserve(request).await.expect_err(reason);
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(reason), "{}", e.message());
    }
    // None of it took anything.
    let s = settle(&mut client, &granted.reservation_id, 10).await;
    assert_eq!(remaining(&s.statuses), [990]);
    server.stop().await;
}

#[tokio::test]
async fn reflection_lists_the_budget_service() {
    use tokio_stream::StreamExt;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;

    let server = memory_server().await;
    let ask = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = ServerReflectionClient::new(server.channel().await)
        .server_reflection_info(tokio_stream::iter([ask]))
        .await
        .expect("reflection")
        .into_inner();
    let Some(Ok(answer)) = answers.next().await else {
        panic!("no answer")
    };
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("{answer:?}")
    };
    let services: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        services.iter().any(|s| s == "ratekeeper.v1.BudgetService"),
        "{services:?}"
    );
    server.stop().await;
}

fn limits_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("llm.yaml"), LIMITS).expect("limits file");
    dir
}

fn replica(config_dir: &Path, store_args: &[&str]) -> Ratekeeper {
    let mut args = store_args.to_vec();
    args.extend(["--redis-timeout-ms", "2000"]);
    Ratekeeper::spawn(config_dir, &args)
}

/// Two replicas on one Redis (or Cluster): a reservation made on one is
/// settled on the other; one whose replica is SIGKILLed before it settles
/// stays charged at its estimate, until and after its TTL.
async fn replicas_share_reservations(store_args: &[&str], name: &str) {
    let dir = limits_dir();
    let mut doomed = replica(dir.path(), store_args);
    let survivor = replica(dir.path(), store_args);
    let mut on_doomed = connect(&doomed.grpc).await;
    let mut on_survivor = connect(&survivor.grpc).await;
    // A day's budget refilling one token in 86 s: no refill within the test.
    let r = reserve(&mut on_doomed, "daily", "roaming", 100).await;
    let s = settle(&mut on_survivor, &r.reservation_id, 30).await;
    assert_eq!(
        (s.settled, remaining(&s.statuses)),
        (30, vec![970]),
        "{name}"
    );
    let retry = settle(&mut on_doomed, &r.reservation_id, 30).await;
    assert!(retry.already_settled, "{name}: either replica knows");

    let r = on_doomed
        .reserve(reserve_request(
            "daily",
            "roaming",
            200,
            Some(Duration::from_secs(1)),
        ))
        .await
        .expect("reserve")
        .into_inner();
    assert_eq!(remaining(&r.statuses), [770], "{name}");
    let metrics = doomed.metrics();
    assert_eq!(
        counter(&metrics, "ratekeeper_budget_reserves", "granted"),
        2,
        "{name}"
    );
    assert_eq!(counter(&metrics, "ratekeeper_budget_settles", "already"), 1);
    doomed.kill();
    let mut rls = survivor.client().await;
    let seen = rls
        .should_rate_limit(check_only("daily", "roaming"))
        .await
        .expect("check")
        .into_inner();
    assert_eq!(
        seen.statuses[0].limit_remaining, 770,
        "{name}: charged at the estimate"
    );
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let e = try_settle(&mut on_survivor, &r.reservation_id, 0)
        .await
        .expect_err("settled after its TTL");
    assert_eq!(e.code(), Code::NotFound, "{name}: {e:?}");
    let seen = rls
        .should_rate_limit(check_only("daily", "roaming"))
        .await
        .expect("check")
        .into_inner();
    assert_eq!(
        seen.statuses[0].limit_remaining, 770,
        "{name}: still spent after the TTL"
    );
    let metrics = survivor.metrics();
    for (result, count) in [("settled", 1), ("unknown", 1), ("already", 0)] {
        let seen = counter(&metrics, "ratekeeper_budget_settles", result);
        assert_eq!(seen, count, "{name}: {result}");
    }
}

/// The value of `name`'s series with `result="<result>"` in a `/metrics`
/// body (0 when absent).
fn counter(metrics: &str, name: &str, result: &str) -> u64 {
    let label = format!("result=\"{result}\"");
    metrics
        .lines()
        .filter(|line| line.starts_with(&format!("{name}{{")) && line.contains(&label))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test]
async fn any_replica_settles_and_a_killed_one_leaves_its_estimate_charged() {
    let redis = RedisServer::start();
    replicas_share_reservations(&["--redis-url", &redis.url()], "redis").await;
    let cluster = RedisCluster::start(3, 0);
    replicas_share_reservations(
        &["--redis-type", "cluster", "--redis-url", &cluster.seeds()],
        "cluster",
    )
    .await;
}

/// Reservation ids are signed with a key the replicas share through Redis.
/// Lost there (a flush) while replicas hold it, and published anew by a
/// replica started since, it is read again by the others as soon as an id
/// fails their check: they agree again, and ids signed before still
/// settle where the old key is held.
#[tokio::test]
async fn replicas_agree_on_the_ids_key_again_after_redis_lost_it() {
    let redis = RedisServer::start();
    let clock = Arc::new(ManualClock::new(START_MS));
    let a = TestServer::start(&[LIMITS], redis.store(Some(clock.clone()))).await;
    let mut on_a = connect(&a.addr.to_string()).await;
    let before = reserve(&mut on_a, "fixed_window", "kim", 10).await;
    let mut conn = redis.client().get_connection().expect("redis");
    let _: () = redis::cmd("FLUSHALL").query(&mut conn).expect("FLUSHALL");
    let c = TestServer::start(&[LIMITS], redis.store(Some(clock.clone()))).await;
    let mut on_c = connect(&c.addr.to_string()).await;
    let by_c = reserve(&mut on_c, "fixed_window", "kim", 10).await;
    let settled = settle(&mut on_a, &by_c.reservation_id, 0).await;
    assert!(!settled.already_settled, "a read c's new key: {settled:?}");
    let old = settle(&mut on_a, &before.reservation_id, 10).await;
    assert_eq!(old.settled, 10, "a still checks ids signed before");
    let by_a = reserve(&mut on_a, "fixed_window", "kim", 10).await;
    let settled = settle(&mut on_c, &by_a.reservation_id, 0).await;
    assert!(!settled.already_settled, "a signs with c's key now");
    a.stop().await;
    c.stop().await;
}

/// A two-slot reservation on a 3-master Cluster (ann's slot on its first
/// node, reserved first; bob's on its last), with its server and client.
struct TwoSlots {
    server: TestServer,
    client: Client,
    id: String,
    /// The hashes its settlement is recorded in: ann's slot's, bob's
    /// slot's.
    records: [String; 2],
    /// Its settlement's field in them.
    nonce: String,
    /// The clock the store's decisions follow.
    clock: Arc<ManualClock>,
}

async fn two_slot_reservation(cluster: &RedisCluster, ttl: Option<Duration>) -> TwoSlots {
    use ratekeeper::service::reservation_id::ReservationId;
    use ratekeeper::store::budget::record_bucket;
    let clock = Arc::new(ManualClock::new(START_MS));
    let server = TestServer::start(&[LIMITS], cluster.store(Some(clock.clone()))).await;
    let mut client = connect(&server.addr.to_string()).await;
    let r = client
        .reserve(ReserveRequest {
            descriptors: vec![
                entries("fixed_window", "ann"),
                entries("small_window", "bob"),
            ],
            ..reserve_request("fixed_window", "ann", 15, ttl)
        })
        .await
        .expect("reserve")
        .into_inner();
    assert!(r.granted, "{r:?}");
    let prefix = ratekeeper::keys::DEFAULT_PREFIX;
    let read = ReservationId::decode(&r.reservation_id, prefix).expect("an id");
    let reservation = &read.reservation;
    let keys = reservation.counter_keys();
    let ttl_ends = |i: usize| reservation.keys[i].taken.at_ms + reservation.ttl_ms;
    let nonce = &reservation.nonce;
    TwoSlots {
        records: [
            record_bucket(&keys[0], nonce, ttl_ends(0), true),
            record_bucket(&keys[1], nonce, ttl_ends(1), true),
        ],
        nonce: nonce.clone(),
        clock,
        id: r.reservation_id,
        server,
        client,
    }
}

/// `cmd` on the Cluster node that holds its key (the others answer MOVED).
fn on_owner<T: redis::FromRedisValue>(cluster: &RedisCluster, cmd: &redis::Cmd) -> T {
    cluster
        .nodes
        .iter()
        .find_map(|node| cmd.query(&mut node.client().get_connection().ok()?).ok())
        .expect("a node holds the key")
}

/// `ShouldRateLimit`'s remaining for bob's small window (20 a minute).
async fn bob_remaining(server: &TestServer) -> u32 {
    let mut rls = server.client().await;
    let seen = rls
        .should_rate_limit(check_only("small_window", "bob"))
        .await
        .expect("check")
        .into_inner();
    seen.statuses[0].limit_remaining
}

/// The first slot decides: past the reservation's TTL there, nothing is
/// settled in any slot, though the later slot would still take a settle.
#[tokio::test]
async fn a_multi_slot_settle_after_the_ttl_touches_nothing() {
    let cluster = RedisCluster::start(3, 0);
    let TwoSlots {
        server,
        mut client,
        id,
        records: [ann, bob],
        nonce,
        clock,
    } = two_slot_reservation(&cluster, Some(Duration::from_secs(1))).await;
    clock.advance(1_000);
    let late = try_settle(&mut client, &id, 5)
        .await
        .expect_err("the reservation's TTL has passed");
    assert_eq!(late.code(), Code::NotFound, "{late:?}");
    assert_eq!(
        bob_remaining(&server).await,
        5,
        "bob's slot keeps the estimate: nothing settled"
    );
    for record in [ann, bob] {
        let exists: u64 = on_owner(&cluster, redis::cmd("HEXISTS").arg(&record).arg(&nonce));
        assert_eq!(exists, 0, "{record}: nothing recorded");
    }
    server.stop().await;
}

#[tokio::test]
async fn a_retry_completes_a_multi_slot_settle_at_the_actual_it_began_with() {
    let cluster = RedisCluster::start(3, 0);
    let TwoSlots {
        server,
        mut client,
        id,
        records: [ann, _],
        nonce,
        ..
    } = two_slot_reservation(&cluster, None).await;
    // A settle at 10 that reached only the first slot before its call was
    // cut short: its settlement recorded there, bob's slot untouched.
    let _: u64 = on_owner(&cluster, redis::cmd("HSET").arg(&ann).arg(&nonce).arg("10"));
    let retry = settle(&mut client, &id, 12).await;
    assert!(retry.already_settled, "{retry:?}");
    assert_eq!(retry.settled, 10);
    assert_eq!(
        bob_remaining(&server).await,
        10,
        "bob's slot settled at the first settle's 10, not the retry's 12"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_settle_cut_short_between_slots_is_completed_by_a_retry_after_the_ttl() {
    let cluster = RedisCluster::start(3, 0);
    let TwoSlots {
        server,
        mut client,
        id,
        records: [ann, bob],
        nonce,
        clock,
    } = two_slot_reservation(&cluster, Some(Duration::from_secs(1))).await;
    // Bob's slot made to fail its settle (its record bucket a string, not
    // a hash): the settle records ann's and fails on bob's.
    let _: () = on_owner(&cluster, redis::cmd("SET").arg(&bob).arg("in the way"));
    let cut = try_settle(&mut client, &id, 5)
        .await
        .expect_err("bob's slot's settle fails");
    assert_eq!(cut.code(), Code::Unavailable, "{cut:?}");
    assert_eq!(
        bob_remaining(&server).await,
        5,
        "bob's part not settled yet"
    );
    // Settled, ann's record lives on past the reservation's 1 s TTL.
    let recorded: u64 = on_owner(&cluster, redis::cmd("HEXISTS").arg(&ann).arg(&nonce));
    assert_eq!(recorded, 1, "{ann}");
    let kept: i64 = on_owner(&cluster, redis::cmd("PTTL").arg(&ann));
    assert!(kept > 60_000, "{kept}");
    let _: u64 = on_owner(&cluster, redis::cmd("DEL").arg(&bob));
    clock.advance(1_100);
    let retry = settle(&mut client, &id, 12).await;
    assert!(retry.already_settled, "{retry:?}");
    assert_eq!(retry.settled, 5);
    assert_eq!(remaining(&retry.statuses), [995, 15], "both at 5");
    assert_eq!(bob_remaining(&server).await, 15);
    server.stop().await;
}

/// A Reserve answered UNAVAILABLE because Redis was too slow for the call
/// deadline is made when Redis wakes; its caller holds no id to settle it
/// with, so the replica gives it back itself, from Redis's answer (a
/// settle at 0; the call waits for it past the deadline).
#[tokio::test]
async fn a_reserve_made_after_its_deadline_is_given_back() {
    a_lost_reserve_is_given_back("100", None, Code::Unavailable).await;
}

/// So is one whose caller gave up first (its `grpc-timeout` passed while
/// Redis slept, well within the store's deadline; tonic's client then
/// cancels the call): the server drops the call's handler, while the call
/// carrying the reserve goes on.
#[tokio::test]
async fn a_reserve_whose_caller_gave_up_is_given_back() {
    let gave_up = Some(Duration::from_millis(100));
    a_lost_reserve_is_given_back("5000", gave_up, Code::Cancelled).await;
}

/// A Reserve of 100 sent while Redis sleeps half a second, with
/// `--redis-timeout-ms redis_timeout_ms` and the caller's `timeout`, fails
/// with `code`; Redis makes it when it wakes, and the replica gives it
/// back (the test waits 15 s at most).
async fn a_lost_reserve_is_given_back(
    redis_timeout_ms: &str,
    timeout: Option<Duration>,
    code: Code,
) {
    let redis = RedisServer::spawn_free(&["--enable-debug-command", "yes"]);
    let dir = limits_dir();
    let url = redis.url();
    let server = Ratekeeper::spawn(
        dir.path(),
        &["--redis-url", &url, "--redis-timeout-ms", redis_timeout_ms],
    );
    let mut client = connect(&server.grpc).await;
    assert_eq!(
        reserve(&mut client, "daily", "late", 1).await.statuses[0].remaining,
        999
    );

    let slow = redis.client();
    let sleeper = std::thread::spawn(move || {
        let slept: redis::RedisResult<()> = redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg("0.5")
            .query(&mut slow.get_connection().expect("redis connection"));
        slept.expect("DEBUG SLEEP");
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut lost = tonic::Request::new(reserve_request("daily", "late", 100, None));
    if let Some(timeout) = timeout {
        lost.set_timeout(timeout);
    }
    let lost = client.reserve(lost).await.expect_err("no answer in time");
    assert_eq!(lost.code(), code, "{lost:?}");
    sleeper.join().expect("DEBUG SLEEP");

    // Made when Redis woke (999 - 100 left), then given back: 999 again
    // (998 with each probe's 1, settled at 0 after).
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut left = 0;
    while Instant::now() < deadline {
        let probe = client
            .reserve(reserve_request("daily", "late", 1, None))
            .await
            .map(Response::into_inner);
        if let Ok(r) = probe {
            left = r.statuses[0].remaining;
            let id = r.reservation_id;
            settle(&mut client, &id, 0).await;
            if left == 998 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        left,
        998,
        "the lost reserve's 100 was not given back: {}",
        server.logs()
    );
    // Made, not merely never sent: the give-back found it.
    let logs = server.logs();
    assert!(
        logs.contains("gave back a reservation made after its caller had stopped waiting"),
        "{logs}"
    );
}
