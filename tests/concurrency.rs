//! Concurrency leases over gRPC: the unary calls and `Hold` in-process on
//! every store, and the failure tests with real processes: several replicas
//! racing, dead callers, a SIGKILLed replica, a SIGTERMed one, a dropped
//! stream, and a Redis restart.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Backend, Ratekeeper, RedisServer, TestServer};
use ratekeeper::clock::SystemClock;
use ratekeeper::pb::v1::concurrency_service_client::ConcurrencyServiceClient;
use ratekeeper::pb::v1::{
    hold_event, AcquireRequest, AcquireResponse, Descriptor, Entry, HeartbeatRequest,
    ReleaseRequest,
};
use tonic::transport::Channel;

const LIMITS: &str = r#"
domain: ws
concurrency:
  - key: user_id
    max_connections: 2
    lease_ttl: 1s
  - key: plan
    value: pro
    descriptors:
      - key: user_id
        max_connections: 5
        lease_ttl: 30s
"#;

type Client = ConcurrencyServiceClient<Channel>;

async fn connect(addr: &str) -> Client {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match ConcurrencyServiceClient::connect(format!("http://{addr}")).await {
            Ok(client) => return client,
            Err(e) if Instant::now() > deadline => panic!("cannot connect to {addr}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

fn acquire_request(entries: &[(&str, &str)], ttl: Option<Duration>) -> AcquireRequest {
    AcquireRequest {
        domain: "ws".into(),
        descriptors: vec![Descriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: (*k).into(),
                    value: (*v).into(),
                })
                .collect(),
        }],
        lease_ttl: ttl.map(|d| prost_types::Duration {
            seconds: d.as_secs() as i64,
            nanos: d.subsec_nanos() as i32,
        }),
        holder: "test".into(),
    }
}

async fn acquire(client: &mut Client, user: &str, ttl: Option<Duration>) -> AcquireResponse {
    client
        .acquire_connection(acquire_request(&[("user_id", user)], ttl))
        .await
        .expect("acquire")
        .into_inner()
}

async fn release(client: &mut Client, ids: Vec<String>) {
    client
        .release(ReleaseRequest { lease_ids: ids })
        .await
        .expect("release");
}

/// Polls `acquire` for up to `within`, returning how long it took to be granted.
async fn granted_within(client: &mut Client, user: &str, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < within {
        let r = acquire(client, user, Some(Duration::from_secs(30))).await;
        if r.granted {
            release(client, vec![r.lease_id]).await;
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    None
}

/// An acquire whose lease id would be too long to come back in a
/// Heartbeat or Release is refused before it takes a place (it would hold
/// them until the TTL).
#[tokio::test]
async fn an_acquire_whose_lease_id_would_be_too_long_takes_nothing() {
    let server = TestServer::start(&[LIMITS], Backend::Memory.store(Arc::new(SystemClock))).await;
    let mut client = connect(&server.addr.to_string()).await;
    let mut request = acquire_request(&[("user_id", "u0")], None);
    request.descriptors = (0..300)
        .map(|i| Descriptor {
            entries: vec![Entry {
                key: "user_id".into(),
                value: format!("u{i}"),
            }],
        })
        .collect();
    let e = client.acquire_connection(request).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("lease id of"), "{}", e.message());
    // Nothing was taken: u0 still has both its places.
    let a = acquire(&mut client, "u0", None).await;
    assert_eq!((a.granted, a.active), (true, 1));
}

/// The ids of one Heartbeat or Release may name many lease sets in all: the
/// replica splits them into store calls of at most 4,096 sets, so that no
/// call stalls Redis (100 ids of 50 sets each: two calls).
#[tokio::test]
async fn many_lease_sets_are_split_into_store_calls() {
    let redis = RedisServer::start();
    let dir = limits_dir();
    let server = replica(dir.path(), &redis.url());
    let mut client = connect(&server.grpc).await;
    let hex = |s: String| s.bytes().map(|b| format!("{b:02x}")).collect::<String>();
    let id = |n: usize| {
        let sets: Vec<String> = (0..50)
            .map(|i| hex(format!("rk:{{ws|user_id=u{n}-{i}}}:conn")))
            .collect();
        format!("{:032x}.30000.{}", n, sets.join("."))
    };
    let before = script_calls(&redis);
    let answer = client
        .heartbeat(HeartbeatRequest {
            lease_ids: (0..100).map(id).collect(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.lost.len(), 100, "unknown, so lost");
    // 4,050 sets, then 950; each call's lost leases (of several sets) are
    // then removed from all their sets, one call more each.
    assert_eq!(script_calls(&redis) - before, 4);
}

/// A forged id may name a key someone else wrote in our namespace, of
/// another type: Redis refuses that call (`WRONGTYPE`), and that call
/// alone. Before, each counted against the circuit breaker every call
/// shares, and five opened it: acquires and decisions failed with it.
#[tokio::test]
async fn forged_ids_naming_a_foreign_key_fail_alone() {
    let redis = RedisServer::start();
    let _: () = redis::cmd("SET")
        .arg("rk:{ext}:conn")
        .arg("x")
        .query(&mut redis.client().get_connection().unwrap())
        .unwrap();
    let dir = limits_dir();
    let server = replica(dir.path(), &redis.url());
    let mut client = connect(&server.grpc).await;
    let hex: String = "rk:{ext}:conn"
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect();
    let forged = format!("{}.30000.{hex}", "ab".repeat(16));
    for _ in 0..8 {
        let heartbeat = HeartbeatRequest {
            lease_ids: vec![forged.clone()],
        };
        let refused = client.heartbeat(heartbeat).await.unwrap_err();
        assert!(refused.message().contains("WRONGTYPE"), "{refused:?}");
    }
    let granted = acquire(&mut client, "u", None).await;
    assert!(granted.granted, "{granted:?}");
    // Ids are minted in lowercase hex: another spelling is not one.
    let upper = format!("{}.30000.{hex}", "AB".repeat(16));
    let heartbeat = HeartbeatRequest {
        lease_ids: vec![upper],
    };
    let refused = client.heartbeat(heartbeat).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
}

#[tokio::test]
async fn acquire_heartbeat_release_and_hold_on_every_store() {
    for backend in Backend::all() {
        let name = backend.name();
        let server = TestServer::start(&[LIMITS], backend.store(Arc::new(SystemClock))).await;
        let mut client = connect(&server.addr.to_string()).await;

        let a = acquire(&mut client, "u", None).await;
        assert!(a.granted && !a.lease_id.is_empty(), "{name}");
        assert_eq!((a.active, a.limit), (1, 2));
        assert_eq!(a.lease_ttl.unwrap().seconds, 1, "the rule's lease_ttl");
        let b = acquire(&mut client, "u", None).await;
        assert_eq!((b.granted, b.active), (true, 2), "{name}");
        let c = acquire(&mut client, "u", None).await;
        assert!(
            !c.granted && c.lease_id.is_empty(),
            "{name}: the third of 2"
        );
        assert_eq!((c.active, c.limit), (2, 2));
        assert!(c.retry_after.unwrap().nanos > 0 || c.retry_after.unwrap().seconds > 0);
        // Another user, and a more specific rule, count apart.
        assert!(acquire(&mut client, "v", None).await.granted);
        let pro = client
            .acquire_connection(acquire_request(&[("plan", "pro"), ("user_id", "u")], None))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (pro.granted, pro.limit, pro.lease_ttl.unwrap().seconds),
            (true, 5, 30),
            "{name}"
        );
        // Nothing limits an unknown domain or descriptor.
        let mut free = acquire_request(&[("nothing", "x")], None);
        let r = client
            .acquire_connection(free.clone())
            .await
            .unwrap()
            .into_inner();
        assert!(r.granted && r.lease_id.is_empty() && r.limit == 0, "{name}");
        free.domain = "unknown".into();
        assert!(
            client
                .acquire_connection(free)
                .await
                .unwrap()
                .into_inner()
                .granted
        );

        // Heartbeat: extended, then lost after release.
        let hb = client
            .heartbeat(HeartbeatRequest {
                lease_ids: vec![a.lease_id.clone(), b.lease_id.clone()],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            hb.extended,
            vec![a.lease_id.clone(), b.lease_id.clone()],
            "{name}"
        );
        release(&mut client, vec![a.lease_id.clone()]).await;
        release(&mut client, vec![a.lease_id.clone()]).await; // idempotent
        let hb = client
            .heartbeat(HeartbeatRequest {
                lease_ids: vec![a.lease_id.clone()],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(hb.lost, vec![a.lease_id.clone()], "{name}");
        assert!(
            acquire(&mut client, "u", None).await.granted,
            "{name}: a's place is free again"
        );

        // Malformed ids and requests: INVALID_ARGUMENT with a message.
        let e = client
            .heartbeat(HeartbeatRequest {
                lease_ids: vec!["nonsense".into()],
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("lease_ids[0]"), "{}", e.message());
        // A real id with its TTL rewritten to pin the slot for years.
        let real = acquire(&mut client, "forge", None).await.lease_id;
        let (member, rest) = real.split_once('.').unwrap();
        let (_, keys) = rest.split_once('.').unwrap();
        let e = client
            .heartbeat(HeartbeatRequest {
                lease_ids: vec![format!("{member}.{}.{keys}", u64::MAX)],
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{name}");
        assert!(e.message().contains("TTL"), "{}", e.message());
        let mut bad = acquire_request(&[("user_id", "u")], Some(Duration::from_millis(10)));
        assert_eq!(
            client
                .acquire_connection(bad.clone())
                .await
                .unwrap_err()
                .code(),
            tonic::Code::InvalidArgument
        );
        bad.lease_ttl = None;
        bad.domain.clear();
        assert_eq!(
            client.acquire_connection(bad).await.unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        server.stop().await;
    }
}

#[tokio::test]
async fn hold_keeps_the_lease_alive_and_releases_it_when_dropped() {
    for backend in Backend::all() {
        let name = backend.name();
        let server = TestServer::start(&[LIMITS], backend.store(Arc::new(SystemClock))).await;
        let mut client = connect(&server.addr.to_string()).await;
        let mut streams = Vec::new();
        for _ in 0..2 {
            let mut stream = client
                .hold(acquire_request(&[("user_id", "h")], None))
                .await
                .unwrap()
                .into_inner();
            let first = stream.message().await.unwrap().unwrap();
            let Some(hold_event::Event::Acquired(r)) = first.event else {
                panic!("{first:?}")
            };
            assert!(r.granted, "{name}");
            streams.push(stream);
        }
        // Refused: one message, then the stream ends.
        let mut refused = client
            .hold(acquire_request(&[("user_id", "h")], None))
            .await
            .unwrap()
            .into_inner();
        let Some(hold_event::Event::Acquired(r)) = refused.message().await.unwrap().unwrap().event
        else {
            panic!("no first message")
        };
        assert!(!r.granted, "{name}");
        assert!(
            refused.message().await.unwrap().is_none(),
            "{name}: a refused stream ends"
        );

        // The replica refreshes the 1 s leases: after 2.5 s both still hold.
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        assert!(
            !acquire(&mut client, "h", None).await.granted,
            "{name}: held leases outlive their TTL"
        );

        // Dropping a stream releases its lease at once.
        drop(streams.pop());
        let took = granted_within(&mut client, "h", Duration::from_millis(900)).await;
        assert!(
            took.is_some(),
            "{name}: the dropped stream's place was not freed before the TTL"
        );
        drop(streams);
        server.stop().await;
    }
}

fn replica(config_dir: &Path, redis_url: &str) -> Ratekeeper {
    Ratekeeper::spawn(
        config_dir,
        &["--redis-url", redis_url, "--redis-timeout-ms", "2000"],
    )
}

fn limits_dir() -> tempfile::TempDir {
    limits_dir_of(5, "2s")
}

/// A limits directory of one rule: `max` connections per `user_id`, leases
/// of `ttl`.
fn limits_dir_of(max: u32, ttl: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let rule = format!(
        "domain: ws\nconcurrency:\n  - key: user_id\n    max_connections: {max}\n    lease_ttl: {ttl}\n"
    );
    std::fs::write(dir.path().join("ws.yaml"), rule).unwrap();
    dir
}

#[tokio::test]
async fn replicas_racing_never_over_admit_and_reuse_freed_places() {
    let redis = RedisServer::start();
    let dir = limits_dir();
    let replicas: Vec<Ratekeeper> = (0..3).map(|_| replica(dir.path(), &redis.url())).collect();
    let mut tasks = Vec::new();
    for replica in &replicas {
        for _ in 0..4 {
            let mut client = connect(&replica.grpc).await;
            tasks.push(tokio::spawn(async move {
                let mut leases = Vec::new();
                for _ in 0..5 {
                    let r = acquire(&mut client, "racer", Some(Duration::from_secs(60))).await;
                    if r.granted {
                        leases.push(r.lease_id);
                    }
                }
                leases
            }));
        }
    }
    let mut granted = Vec::new();
    for task in tasks {
        granted.extend(task.await.unwrap());
    }
    // 3 replicas x 4 callers x 5 attempts = 60 for a limit of 5.
    assert_eq!(granted.len(), 5, "exactly the limit, never more");
    let mut client = connect(&replicas[2].grpc).await;
    assert!(!acquire(&mut client, "racer", None).await.granted);
    release(&mut client, granted.drain(..2).collect()).await;
    let again: Vec<bool> = {
        let mut out = Vec::new();
        for replica in &replicas {
            let mut c = connect(&replica.grpc).await;
            out.push(
                acquire(&mut c, "racer", Some(Duration::from_secs(60)))
                    .await
                    .granted,
            );
        }
        out
    };
    assert_eq!(
        again,
        vec![true, true, false],
        "the 2 freed places are granted again, and no more"
    );
}

#[tokio::test]
async fn dead_callers_and_a_killed_replica_free_their_places_within_the_ttl() {
    let redis = RedisServer::start();
    let dir = limits_dir();
    let mut doomed = replica(dir.path(), &redis.url());
    let survivor = replica(dir.path(), &redis.url());
    let mut client = connect(&survivor.grpc).await;

    // A caller that stops heartbeating: its lease (2 s) lapses.
    let lapsing = acquire(&mut client, "quiet", None).await;
    assert!(lapsing.granted);
    for _ in 0..4 {
        assert!(
            acquire(&mut client, "quiet", Some(Duration::from_secs(60)))
                .await
                .granted
        );
    }
    assert!(!acquire(&mut client, "quiet", None).await.granted);
    let took = granted_within(&mut client, "quiet", Duration::from_secs(4))
        .await
        .expect("never freed");
    assert!(
        took <= Duration::from_millis(2_600),
        "freed after {took:?}, TTL 2 s"
    );

    // A replica holding streams is SIGKILLed: no release is sent, the
    // refreshes stop, and the leases lapse after their TTL.
    let mut doomed_client = connect(&doomed.grpc).await;
    let mut streams = Vec::new();
    for _ in 0..5 {
        let mut s = doomed_client
            .hold(acquire_request(&[("user_id", "held")], None))
            .await
            .unwrap()
            .into_inner();
        let Some(hold_event::Event::Acquired(r)) = s.message().await.unwrap().unwrap().event else {
            panic!()
        };
        assert!(r.granted);
        streams.push(s);
    }
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert!(
        !acquire(&mut client, "held", None).await.granted,
        "refreshed past their TTL while alive"
    );
    doomed.kill();
    let took = granted_within(&mut client, "held", Duration::from_secs(5))
        .await
        .expect("never freed");
    assert!(
        took <= Duration::from_millis(2_800),
        "freed {took:?} after the kill, TTL 2 s + a tick"
    );
    drop(streams);
}

/// Lua calls Redis has run (the lease script's acquires and heartbeats).
fn script_calls(redis: &RedisServer) -> u64 {
    let mut conn = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut conn)
        .unwrap();
    let calls = |line: &str| line.split_once("calls=")?.1.split(',').next()?.parse().ok();
    stats
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:"))
        .find_map(calls)
        .unwrap_or(0)
}

/// The held leases are refreshed together once per tick (a third of their
/// 30 s TTL), however many `Hold` streams open meanwhile: each opening
/// refreshed every lease held, one store call per stream opened.
#[tokio::test]
async fn opening_holds_refreshes_no_lease_before_its_tick() {
    let redis = RedisServer::start();
    let dir = limits_dir_of(5, "30s");
    let server = replica(dir.path(), &redis.url());
    let client = connect(&server.grpc).await;
    let mut streams = Vec::new();
    let hold = |user: String| {
        let request = acquire_request(&[("user_id", &user)], None);
        let mut client = client.clone();
        async move {
            let mut stream = client.hold(request).await.unwrap().into_inner();
            let first = stream.message().await.unwrap().unwrap();
            assert!(matches!(first.event, Some(hold_event::Event::Acquired(r)) if r.granted));
            stream
        }
    };
    streams.push(hold("first".into()).await);
    let before = script_calls(&redis);
    for i in 0..20 {
        streams.push(hold(format!("u{i}")).await);
    }
    let calls = script_calls(&redis) - before;
    assert!(
        calls <= 22,
        "{calls} Lua calls for 20 acquires: held leases refreshed at each Hold opened"
    );
    drop(client);
}

/// Keeps `redis` busy for 500 ms with a script, from another thread;
/// returns once it is under way (100 ms in).
async fn stall_redis(redis: &RedisServer) -> std::thread::JoinHandle<()> {
    let busy = redis.client();
    let stall = std::thread::spawn(move || {
        let script = "local t = redis.call('TIME') local e = t[1] * 1000000 + t[2] + 500000 \
                      while true do local n = redis.call('TIME') \
                      if n[1] * 1000000 + n[2] > e then return 1 end end";
        let done: redis::RedisResult<i64> = redis::cmd("EVAL")
            .arg(script)
            .arg(0)
            .query(&mut busy.get_connection().expect("redis connection"));
        done.expect("the busy script");
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    stall
}

/// Acquires answered UNAVAILABLE because Redis stalled past the deadline
/// may still be made when Redis gets to them; nobody has their ids, so the
/// replica releases them a second later (and ten seconds later) instead of
/// leaving the places taken for the whole TTL (30 s here).
#[tokio::test]
async fn acquires_made_after_their_deadline_are_given_back() {
    lost_acquires_are_given_back(&[], None, tonic::Code::Unavailable).await;
}

/// So are acquires whose callers gave up first (a 100 ms `grpc-timeout`,
/// well within the store's deadline): the server drops their handlers,
/// and with them the acquires under way.
#[tokio::test]
async fn acquires_whose_callers_gave_up_are_given_back() {
    let gave_up = Some(Duration::from_millis(100));
    let args = ["--redis-timeout-ms", "5000"];
    lost_acquires_are_given_back(&args, gave_up, tonic::Code::Cancelled).await;
}

/// Ten acquires sent while Redis is busy for 500 ms, with `server_args`
/// and the callers' `timeout`: some fail with `code`, and whatever Redis
/// made of them is released within 15 s.
async fn lost_acquires_are_given_back(
    server_args: &[&str],
    timeout: Option<Duration>,
    code: tonic::Code,
) {
    let redis = RedisServer::start();
    let dir = limits_dir_of(10, "30s");
    let url = redis.url();
    let args = [&["--redis-url", url.as_str()], server_args].concat();
    let server = Ratekeeper::spawn(dir.path(), &args);
    let mut client = connect(&server.grpc).await;
    assert!(acquire(&mut client, "warm", None).await.granted);

    // Redis busy for 500 ms, the acquires sent meanwhile.
    let stall = stall_redis(&redis).await;
    let acquires = (0..10).map(|_| {
        let mut client = client.clone();
        async move {
            let mut request = tonic::Request::new(acquire_request(&[("user_id", "late")], None));
            if let Some(timeout) = timeout {
                request.set_timeout(timeout);
            }
            let answer = client.acquire_connection(request).await;
            answer.map(|r| r.into_inner().granted).map_err(|e| e.code())
        }
    });
    let answers = futures_util::future::join_all(acquires).await;
    stall.join().expect("the busy script");
    // Granted ones (a slow start of the stall) keep their places.
    let granted = answers.iter().filter(|a| *a == &Ok(true)).count() as u64;
    assert!(answers.contains(&Err(code)), "{answers:?}");

    let key = "rk:{ws|user_id=late}:conn";
    let mut conn = redis.client().get_connection().expect("redis connection");
    let mut taken = || -> u64 { redis::cmd("ZCARD").arg(key).query(&mut conn).unwrap() };
    let made = taken() - granted;
    assert!(
        made > 0,
        "none of the lost acquires was made: nothing tested"
    );
    // A second, or eleven when the circuit breaker (opened by the failures)
    // refused the first give-back.
    let deadline = Instant::now() + Duration::from_secs(15);
    while taken() > granted && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        taken() - granted,
        0,
        "{made} places taken by failed acquires were kept"
    );
    println!("{made} failed acquires were made, and given back");
}

#[tokio::test]
async fn sigterm_ends_hold_streams_at_once_and_gives_their_places_back() {
    let redis = RedisServer::start();
    let dir = limits_dir();
    // A long grace and long leases: only an explicit release can free the
    // places quickly, and only ending the streams can end the drain early.
    let draining = Ratekeeper::spawn(
        dir.path(),
        &[
            "--redis-url",
            &redis.url(),
            "--redis-timeout-ms",
            "2000",
            "--shutdown-grace-ms",
            "30000",
        ],
    );
    let survivor = replica(dir.path(), &redis.url());
    let mut held = connect(&draining.grpc).await;
    let mut streams = Vec::new();
    for _ in 0..5 {
        let mut request =
            acquire_request(&[("user_id", "drained")], Some(Duration::from_secs(600)));
        request.holder = "sigterm".into();
        let mut s = held.hold(request).await.unwrap().into_inner();
        let Some(hold_event::Event::Acquired(r)) = s.message().await.unwrap().unwrap().event else {
            panic!("no first message")
        };
        assert!(r.granted);
        streams.push(s);
    }
    let mut client = connect(&survivor.grpc).await;
    assert!(!acquire(&mut client, "drained", None).await.granted);

    let started = Instant::now();
    let status = tokio::task::spawn_blocking(move || draining.terminate())
        .await
        .unwrap();
    assert!(status.success(), "{status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "exited {:?} after SIGTERM: the drain waited for the streams",
        started.elapsed()
    );
    for mut s in streams {
        let end = s
            .message()
            .await
            .expect_err("the stream ends with a status");
        assert_eq!(end.code(), tonic::Code::Unavailable, "{end:?}");
    }
    for _ in 0..5 {
        assert!(
            acquire(&mut client, "drained", Some(Duration::from_secs(60)))
                .await
                .granted,
            "the drained replica's places are free at once"
        );
    }
}

#[tokio::test]
async fn a_redis_restart_loses_leases_and_the_service_recovers() {
    let mut redis = RedisServer::start();
    let dir = limits_dir();
    let replica = replica(dir.path(), &redis.url());
    let mut client = connect(&replica.grpc).await;
    let mut held = client
        .hold(acquire_request(&[("user_id", "r")], None))
        .await
        .unwrap()
        .into_inner();
    let Some(hold_event::Event::Acquired(r)) = held.message().await.unwrap().unwrap().event else {
        panic!()
    };
    assert!(r.granted);

    redis.restart();
    // The restarted Redis is empty (no persistence): the stream's next
    // refresh finds its lease gone and says so.
    let event = tokio::time::timeout(Duration::from_secs(10), held.message())
        .await
        .expect("no lost message")
        .unwrap()
        .unwrap();
    assert!(
        matches!(event.event, Some(hold_event::Event::Lost(ref id)) if *id == r.lease_id),
        "{event:?}"
    );
    assert!(
        held.message().await.unwrap().is_none(),
        "the stream ends after lost"
    );
    // New acquires work without restarting ratekeeper.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match client
            .acquire_connection(acquire_request(&[("user_id", "r")], None))
            .await
        {
            Ok(r) if r.get_ref().granted => break,
            _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            other => panic!("no recovery: {other:?}"),
        }
    }
}

/// On a cluster a lease over two hash slots is taken slot by slot. When the
/// later slot's call fails (its set is a string: `WRONGTYPE`), the place
/// already taken in the earlier slot is given back. A reply of the wrong
/// shape takes the same path (`SlotAcquired::read` in `src/store/redis.rs`);
/// a real Redis cannot be made to send one.
#[tokio::test]
async fn a_lease_whose_later_slot_fails_gives_back_the_earlier_slot() {
    use ratekeeper::store::LeaseSlot;
    let cluster = common::RedisCluster::start(3, 0);
    let (first, second) = ("rk:{lease-a}:c", "rk:{lease-b}:c");
    assert_ne!(
        ratekeeper::keys::cluster_slot(first),
        ratekeeper::keys::cluster_slot(second)
    );
    // Each key is written on its owner: the node that does not answer MOVED.
    let on_owner = |cmd: &redis::Cmd| -> i64 {
        cluster
            .nodes
            .iter()
            .find_map(|node| {
                let mut conn = node.client().get_connection().ok()?;
                cmd.query::<redis::Value>(&mut conn).ok().map(|v| match v {
                    redis::Value::Int(n) => n,
                    _ => 0,
                })
            })
            .expect("a node owns the key")
    };
    on_owner(redis::cmd("SET").arg(second).arg("not a lease set"));
    let store = cluster.store(None);
    let slots = [
        LeaseSlot {
            key: first.into(),
            limit: 5,
        },
        LeaseSlot {
            key: second.into(),
            limit: 5,
        },
    ];
    let error = store
        .acquire(&slots, "m1", "", 60_000)
        .await
        .expect_err("the second slot's set is a string");
    assert!(error.to_string().contains("WRONGTYPE"), "{error}");
    assert_eq!(
        on_owner(redis::cmd("ZCARD").arg(first)),
        0,
        "the place taken in the first slot was given back"
    );
}
