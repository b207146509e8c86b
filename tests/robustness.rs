//! Hostile input never panics: random limits files, random well-formed
//! requests, random bytes on the gRPC port. `make test` runs a bounded number
//! of cases; `make fuzz` runs many more (PROPTEST_CASES).

mod common;

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{descriptor, request, Backend, TestServer};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use proptest::prelude::*;
use ratekeeper::clock::ManualClock;
use ratekeeper::config::watch::SharedConfig;
use ratekeeper::config::Config;
use ratekeeper::service::rls::{LimiterSettings, RateLimiter};
use ratekeeper::store::{MemoryStore, Store};

const LIMITS: &str = r#"
domain: d
descriptors:
  - key: a
    rate_limit: {unit: second, requests_per_unit: 5}
    descriptors:
      - key: b
        rate_limits:
          - {unit: minute, requests_per_unit: 3, algorithm: token_bucket, burst: 2}
          - {unit: hour, requests_per_unit: 9, algorithm: sliding_log}
  - key: w
    value: "x*y"
    rate_limit: {unit: day, requests_per_unit: 1, algorithm: sliding_window, name: n, replaces: [{name: m}]}
  - key: m
    rate_limit: {unit: second, requests_per_unit: 0, name: m}
  - key: u
    rate_limit: {unlimited: true}
"#;

fn yaml_fragments() -> impl Strategy<Value = String> {
    let token = prop::sample::select(vec![
        "domain: d\n",
        "domain:",
        "descriptors:\n",
        "  - key: a\n",
        "- key:",
        "    value: v\n",
        "value: *\n",
        "rate_limit:",
        " {unit: second, requests_per_unit: 5}\n",
        "rate_limits: [",
        "]",
        "{",
        "}",
        "unit: fortnight",
        "requests_per_unit: -1",
        "requests_per_unit: 4294967296",
        "algorithm: token_bucket",
        "burst: 0",
        "unlimited: true",
        "replaces: [{name: a}]",
        "name: a",
        "shadow_mode: yes",
        "concurrency:\n",
        "  - key: u\n    max_connections: 2\n",
        "lease_ttl: 1ms",
        "lease_ttl: 99999999999h",
        "\t",
        "  ",
        "\n",
        ":",
        "- ",
        "&a ",
        "*a ",
        "!!binary x",
        "\"",
        "'",
        "é",
        "\u{0}",
        "all_or_nothing: maybe",
        "failure_mode: local",
        "---\n",
    ]);
    prop::collection::vec(token, 0..40).prop_map(|t| t.concat())
}

fn entry() -> impl Strategy<Value = Entry> {
    let text = prop_oneof![
        prop::sample::select(vec!["a", "b", "w", "m", "u", "x_y", "xzzy", "", "{", "}:|"])
            .prop_map(String::from),
        ".{0,40}",
        Just("v".repeat(2_000)),
    ];
    (text.clone(), text).prop_map(|(key, value)| Entry { key, value })
}

fn rl_descriptor() -> impl Strategy<Value = RateLimitDescriptor> {
    (
        prop::collection::vec(entry(), 0..4),
        prop::option::of((any::<u32>(), -2i32..10)),
        prop::option::of(any::<u64>()),
        any::<bool>(),
    )
        .prop_map(|(entries, limit, hits, negative)| RateLimitDescriptor {
            entries,
            limit: limit.map(|(requests_per_unit, unit)| RateLimitOverride {
                requests_per_unit,
                unit,
            }),
            hits_addend: hits.map(|value| UInt64Value { value }),
            is_negative_hits: negative,
        })
}

fn rl_request() -> impl Strategy<Value = RateLimitRequest> {
    (
        prop::sample::select(vec!["d", "", "unknown", "d\u{0}"]).prop_map(String::from),
        prop::collection::vec(rl_descriptor(), 0..6),
        any::<u32>(),
    )
        .prop_map(|(domain, descriptors, hits_addend)| RateLimitRequest {
            domain,
            descriptors,
            hits_addend,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, cases: common::proptest_cases(1_000), ..ProptestConfig::default() })]

    #[test]
    fn the_limits_parser_never_panics(text in yaml_fragments()) {
        let _ = Config::from_files([(Path::new("fuzz.yaml"), text.as_str())]);
    }

    #[test]
    fn the_request_path_never_panics(requests in prop::collection::vec(rl_request(), 1..8), step in 0u64..5_000) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let config = Config::from_files([(Path::new("limits.yaml"), LIMITS)]).unwrap();
            let clock = Arc::new(ManualClock::new(1_800_000_000_000));
            let limiter = RateLimiter::new(
                SharedConfig::new(config),
                Store::Memory(MemoryStore::new(clock.clone())),
                LimiterSettings { key_prefix: "rk:".into(), ..LimiterSettings::default() },
            );
            for request in &requests {
                clock.advance(step);
                if let Ok(response) = limiter.decide(request).await {
                    assert_eq!(response.statuses.len(), request.descriptors.len());
                }
            }
        });
    }
}

/// A server on the memory store, its clock pinned.
async fn memory_server() -> TestServer {
    TestServer::start(
        &[LIMITS],
        Backend::Memory.store(Arc::new(ManualClock::new(1_800_000_000_000))),
    )
    .await
}

/// The server still serves, and counts: one more request on its key of 5
/// a window leaves `remaining`.
async fn assert_still_counting(server: &TestServer, remaining: u32) {
    let mut client = server.client().await;
    let r = client
        .should_rate_limit(request("d", vec![descriptor(&[("a", "1")])]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        r.statuses[0].limit_remaining, remaining,
        "still serving, and counting"
    );
}

#[tokio::test]
async fn random_bytes_on_the_grpc_port_leave_the_server_serving() {
    let server = memory_server().await;
    let addr = server.addr;
    // A fixed xorshift sequence of garbage, some of it after a valid preface.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let cases = u64::from(common::proptest_cases(200));
    tokio::task::spawn_blocking(move || {
        for i in 0..cases {
            let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
                continue;
            };
            let len = (next() % 4096) as usize;
            let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if i % 2 == 0 {
                let mut framed = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
                framed.append(&mut bytes);
                bytes = framed;
            }
            let _ = stream.write_all(&bytes);
        }
    })
    .await
    .unwrap();
    assert_still_counting(&server, 4).await;
    server.stop().await;
}

/// A request of two million empty descriptors (4 MB on the wire, some
/// 240 MB decoded) is refused as its bytes arrive, before it is decoded;
/// one at the cap is served.
#[tokio::test]
async fn descriptors_past_the_cap_are_refused_before_decoding() {
    let server = memory_server().await;
    let mut client = server.client().await;
    let many = request("d", vec![RateLimitDescriptor::default(); 2_000_000]);
    let e = client.should_rate_limit(many).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert_eq!(
        e.message(),
        "more than 1024 descriptors: at most 1024 are accepted per request"
    );
    let at_cap = request("d", vec![descriptor(&[("a", "1")]); 1024]);
    let answer = client.should_rate_limit(at_cap).await.unwrap().into_inner();
    assert_eq!(answer.statuses.len(), 1024);
    server.stop().await;
}

/// Lease ids are counted the same way: a `Heartbeat` or `Release` of two
/// million empty ids (4 MB, some 48 MB of strings decoded) is refused as it
/// arrives; at the cap the ids are decoded and each judged.
#[tokio::test]
async fn lease_ids_past_the_cap_are_refused_before_decoding() {
    use ratekeeper::pb::v1::concurrency_service_client::ConcurrencyServiceClient;
    use ratekeeper::pb::v1::{HeartbeatRequest, ReleaseRequest};

    let server = memory_server().await;
    let channel = server.channel().await;
    let mut client = ConcurrencyServiceClient::new(channel);
    let ids = |n| vec![String::new(); n];
    let past = "more than 1000 lease ids: at most 1000 per call";
    let e = client
        .heartbeat(HeartbeatRequest {
            lease_ids: ids(2_000_000),
        })
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (tonic::Code::InvalidArgument, past)
    );
    let e = client
        .release(ReleaseRequest {
            lease_ids: ids(1_001),
        })
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (tonic::Code::InvalidArgument, past)
    );
    let e = client
        .release(ReleaseRequest {
            lease_ids: ids(1_000),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().starts_with("lease_ids[0]: "), "{e:?}");
    server.stop().await;
}

/// What is not a gRPC call gets grpc-go's answer on the gRPC port: a GET
/// HTTP 405 and a JSON POST HTTP 415, each with a gRPC status, before any
/// service sees it (an HTTP probe aimed at the port fails, as there).
#[tokio::test]
async fn requests_that_are_not_grpc_get_405_and_415() {
    use tonic::codegen::http::{header, Method, Request, StatusCode};
    use tonic::codegen::Service;

    let server = memory_server().await;
    let channel = server.channel().await;
    let path = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
    let cases = [
        (
            Method::GET,
            "application/grpc",
            StatusCode::METHOD_NOT_ALLOWED,
            "13",
        ),
        (
            Method::POST,
            "application/json",
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "3",
        ),
        (Method::POST, "", StatusCode::UNSUPPORTED_MEDIA_TYPE, "3"),
    ];
    for (method, content_type, status, grpc_status) in cases {
        let mut request = Request::builder()
            .method(method.clone())
            .uri(format!("http://{}{path}", server.addr));
        if !content_type.is_empty() {
            request = request.header(header::CONTENT_TYPE, content_type);
        }
        let request = request.body(tonic::body::Body::empty()).unwrap();
        let mut channel = channel.clone();
        std::future::poll_fn(|cx| channel.poll_ready(cx))
            .await
            .unwrap();
        let response = channel.call(request).await.unwrap();
        let at = format!("{method} {content_type:?}");
        assert_eq!(response.status(), status, "{at}");
        assert_eq!(response.headers()["grpc-status"], grpc_status, "{at}");
    }
    assert_still_counting(&server, 4).await;
    server.stop().await;
}

#[tokio::test]
async fn slowloris_connections_are_cut_and_others_served() {
    use std::io::Read;
    // The test server gives 500 ms for the HTTP/2 preface.
    let server = memory_server().await;
    let addr = server.addr;
    let stalled = tokio::task::spawn_blocking(move || {
        let mut sockets = Vec::new();
        for i in 0..50 {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            // Half of them dribble part of the preface, then stall.
            if i % 2 == 0 {
                s.write_all(b"PRI * HTTP").unwrap();
            }
            sockets.push(s);
        }
        sockets
    })
    .await
    .unwrap();
    // Meanwhile a real client is served.
    assert_still_counting(&server, 4).await;
    // Every stalled socket is closed by the server within the deadline.
    let closed = tokio::task::spawn_blocking(move || {
        let started = std::time::Instant::now();
        stalled
            .into_iter()
            .map(|mut s| {
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut buf = [0u8; 64];
                // The server may answer with a GOAWAY before closing: read to the end.
                loop {
                    match s.read(&mut buf) {
                        Ok(0) => return Some(started.elapsed()),
                        Ok(_) => continue,
                        Err(e)
                            if e.kind() == std::io::ErrorKind::WouldBlock
                                || e.kind() == std::io::ErrorKind::TimedOut =>
                        {
                            return None
                        }
                        Err(_) => return Some(started.elapsed()),
                    }
                }
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    assert!(
        closed.iter().all(Option::is_some),
        "some stalled connections were never closed"
    );
    // The normal client still works after all that.
    assert_still_counting(&server, 3).await;
    server.stop().await;
}
