//! `ShouldRateLimit` over gRPC against the server in-process, on every store
//! (memory and a real redis-server), with the clock pinned.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{descriptor, request, Backend, TestServer};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::google::protobuf::UInt64Value;
use ratekeeper::clock::ManualClock;
use tonic::Code as GrpcCode;

// `charges: drop`: a refused request consumes nothing (all-or-nothing), as
// the tests here expect; a fixed window otherwise records hits over its
// limit, as envoyproxy/ratelimit's does (tests/charges.rs).
const LIMITS: &str = r#"
domain: api
charges: drop
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3, name: per_user}
  - key: ip
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: plan
    value: free
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 2, name: free_user}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: open
    rate_limit: {unlimited: true}
  - key: old
    rate_limit: {unit: second, requests_per_unit: 1, name: old}
  - key: new
    rate_limit: {unit: second, requests_per_unit: 5, name: new, replaces: [{name: old}]}
"#;

/// A minute boundary, so every window starts with the test.
const START_MS: u64 = 1_800_000_000_000;

fn code(status: &DescriptorStatus) -> Code {
    Code::try_from(status.code).unwrap_or(Code::Unknown)
}

fn overall(response: &RateLimitResponse) -> Code {
    Code::try_from(response.overall_code).unwrap_or(Code::Unknown)
}

fn reset_ms(status: &DescriptorStatus) -> u64 {
    let d = status.duration_until_reset.expect("duration_until_reset");
    d.seconds as u64 * 1000 + d.nanos as u64 / 1_000_000
}

/// Runs `body` once per store, each with a fresh server and pinned clock.
async fn on_every_store<F, Fut>(body: F)
where
    F: Fn(TestServer, Arc<ManualClock>, &'static str) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    common::on_every_store(&[LIMITS], START_MS, body).await;
}

#[tokio::test]
async fn counts_down_then_over_limit_and_resets() {
    on_every_store(|server, clock, store| async move {
        let mut client = server.client().await;
        let req = request("api", vec![descriptor(&[("user", "alice")])]);
        for (i, remaining) in [2u32, 1, 0].into_iter().enumerate() {
            clock.set(START_MS + i as u64 * 10_000);
            let r = client
                .should_rate_limit(req.clone())
                .await
                .unwrap()
                .into_inner();
            assert_eq!(overall(&r), Code::Ok, "{store}");
            let s = &r.statuses[0];
            assert_eq!(code(s), Code::Ok);
            assert_eq!(s.limit_remaining, remaining, "{store}");
            let limit = s.current_limit.as_ref().unwrap();
            assert_eq!(
                (limit.name.as_str(), limit.requests_per_unit, limit.unit),
                ("per_user", 3, 2)
            );
            // duration_until_reset shrinks as the window passes.
            assert_eq!(reset_ms(s), 60_000 - i as u64 * 10_000, "{store}");
        }
        // In whole seconds, rounded up, as theirs: Envoy's
        // X-RateLimit-Reset takes the seconds alone (29.5 s left would
        // read 29; theirs says 30).
        clock.set(START_MS + 30_500);
        let r = client
            .should_rate_limit(request("api", vec![descriptor(&[("user", "carol")])]))
            .await
            .unwrap()
            .into_inner();
        let left = r.statuses[0].duration_until_reset.unwrap();
        assert_eq!((left.seconds, left.nanos), (30, 0), "{store}");
        clock.set(START_MS + 2 * 10_000);
        let r = client
            .should_rate_limit(req.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(overall(&r), Code::OverLimit, "{store}");
        assert_eq!(
            (code(&r.statuses[0]), r.statuses[0].limit_remaining),
            (Code::OverLimit, 0)
        );
        // Another user has their own counter.
        let other = request("api", vec![descriptor(&[("user", "bob")])]);
        let r = client.should_rate_limit(other).await.unwrap().into_inner();
        assert_eq!(r.statuses[0].limit_remaining, 2, "{store}");
        clock.set(START_MS + 60_000);
        let r = client.should_rate_limit(req).await.unwrap().into_inner();
        assert_eq!(
            (overall(&r), r.statuses[0].limit_remaining),
            (Code::Ok, 2),
            "{store}: new window"
        );
        server.stop().await;
    })
    .await;
}

#[tokio::test]
async fn two_descriptors_with_different_limits_all_or_nothing() {
    on_every_store(|server, _clock, store| async move {
        let mut client = server.client().await;
        let both = request(
            "api",
            vec![
                descriptor(&[("ip", "10.0.0.1")]),
                descriptor(&[("plan", "free"), ("user", "u")]),
            ],
        );
        for expected in [(9, 1), (8, 0)] {
            let r = client
                .should_rate_limit(both.clone())
                .await
                .unwrap()
                .into_inner();
            assert_eq!(overall(&r), Code::Ok, "{store}");
            assert_eq!(
                (r.statuses[0].limit_remaining, r.statuses[1].limit_remaining),
                expected
            );
            assert_eq!(
                r.statuses[0].current_limit.as_ref().unwrap().unit,
                1,
                "second"
            );
            assert_eq!(
                r.statuses[1].current_limit.as_ref().unwrap().name,
                "free_user"
            );
        }
        let r = client.should_rate_limit(both).await.unwrap().into_inner();
        assert_eq!(overall(&r), Code::OverLimit, "{store}");
        assert_eq!(code(&r.statuses[0]), Code::Ok);
        assert_eq!(code(&r.statuses[1]), Code::OverLimit);
        // The refused request did not consume from the ip limit.
        assert_eq!(r.statuses[0].limit_remaining, 8, "{store}: all-or-nothing");
        server.stop().await;
    })
    .await;
}

#[tokio::test]
async fn hits_addend_request_and_descriptor_level() {
    on_every_store(|server, _clock, store| async move {
        let mut client = server.client().await;
        let mut req = request("api", vec![descriptor(&[("ip", "h")])]);
        req.hits_addend = 4;
        let r = client
            .should_rate_limit(req.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.statuses[0].limit_remaining, 6, "{store}");
        // The descriptor's own hits_addend wins; 0 checks without counting.
        req.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
        let r = client
            .should_rate_limit(req.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (overall(&r), r.statuses[0].limit_remaining),
            (Code::Ok, 6),
            "{store}"
        );
        req.descriptors[0].hits_addend = Some(UInt64Value { value: 6 });
        let r = client
            .should_rate_limit(req.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (overall(&r), r.statuses[0].limit_remaining),
            (Code::Ok, 0),
            "{store}"
        );
        // Absurd hits: refused, nothing consumed, no overflow.
        let mut huge = request("api", vec![descriptor(&[("ip", "huge")])]);
        huge.hits_addend = u32::MAX;
        let r = client
            .should_rate_limit(huge.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (overall(&r), r.statuses[0].limit_remaining),
            (Code::OverLimit, 10),
            "{store}"
        );
        huge.descriptors[0].hits_addend = Some(UInt64Value { value: u64::MAX });
        let r = client
            .should_rate_limit(huge.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (overall(&r), r.statuses[0].limit_remaining),
            (Code::OverLimit, 10),
            "{store}"
        );
        huge.hits_addend = 0;
        huge.descriptors[0].hits_addend = None;
        let r = client.should_rate_limit(huge).await.unwrap().into_inner();
        assert_eq!(
            (overall(&r), r.statuses[0].limit_remaining),
            (Code::Ok, 9),
            "{store}: counter intact"
        );
        server.stop().await;
    })
    .await;
}

#[tokio::test]
async fn no_rule_unknown_domain_unlimited_shadow_and_replaces() {
    on_every_store(|server, _clock, store| async move {
        let mut client = server.client().await;
        // Unknown domain: OK, no limit.
        let r = client
            .should_rate_limit(request("nope", vec![descriptor(&[("user", "a")])]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(overall(&r), Code::Ok);
        assert!(r.statuses[0].current_limit.is_none(), "{store}");
        // No matching rule; no parent fallback for a deeper descriptor.
        let r = client
            .should_rate_limit(request(
                "api",
                vec![
                    descriptor(&[("nomatch", "x")]),
                    descriptor(&[("user", "a"), ("extra", "b")]),
                ],
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.statuses.len(), 2);
        assert!(r
            .statuses
            .iter()
            .all(|s| code(s) == Code::Ok && s.current_limit.is_none()));
        // Unlimited.
        let r = client
            .should_rate_limit(request("api", vec![descriptor(&[("open", "x")])]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (code(&r.statuses[0]), r.statuses[0].limit_remaining),
            (Code::Ok, u32::MAX)
        );
        // Shadow mode: over the limit but reported OK.
        let shadow = request("api", vec![descriptor(&[("shadow", "s")])]);
        for _ in 0..3 {
            let r = client
                .should_rate_limit(shadow.clone())
                .await
                .unwrap()
                .into_inner();
            assert_eq!(overall(&r), Code::Ok, "{store}: shadow mode never refuses");
        }
        // `new` replaces `old`: only new's limit applies.
        let both = request(
            "api",
            vec![descriptor(&[("old", "x")]), descriptor(&[("new", "x")])],
        );
        for _ in 0..3 {
            let r = client
                .should_rate_limit(both.clone())
                .await
                .unwrap()
                .into_inner();
            assert_eq!(overall(&r), Code::Ok, "{store}");
            assert!(r.statuses[0].current_limit.is_none(), "old was replaced");
            assert_eq!(r.statuses[1].current_limit.as_ref().unwrap().name, "new");
        }
        // Alone, `old` still applies.
        let old = request("api", vec![descriptor(&[("old", "y")])]);
        client.should_rate_limit(old.clone()).await.unwrap();
        let r = client.should_rate_limit(old).await.unwrap().into_inner();
        assert_eq!(overall(&r), Code::OverLimit, "{store}");
        server.stop().await;
    })
    .await;
}

#[tokio::test]
async fn limit_override_is_honoured() {
    on_every_store(|server, _clock, store| async move {
        let mut client = server.client().await;
        let mut d = descriptor(&[("anything", "x")]);
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 1,
            unit: 3, // HOUR
        });
        let req = request("api", vec![d.clone()]);
        let r = client
            .should_rate_limit(req.clone())
            .await
            .unwrap()
            .into_inner();
        let limit = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit), (1, 3), "{store}");
        assert_eq!(reset_ms(&r.statuses[0]), 3_600_000 - START_MS % 3_600_000);
        let r = client.should_rate_limit(req).await.unwrap().into_inner();
        assert_eq!(overall(&r), Code::OverLimit, "{store}");
        // An override of a value the rule has not counted starts afresh (it
        // shares the rule's counter: tests/envoy_parity.rs).
        let mut user = descriptor(&[("user", "override")]);
        user.limit = Some(RateLimitOverride {
            requests_per_unit: 100,
            unit: 2,
        });
        let r = client
            .should_rate_limit(request("api", vec![user]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.statuses[0].limit_remaining, 99);
        // UNKNOWN unit: INVALID_ARGUMENT with a message, never a panic.
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 1,
            unit: 0,
        });
        let e = client
            .should_rate_limit(request("api", vec![d.clone()]))
            .await
            .unwrap_err();
        assert_eq!(e.code(), GrpcCode::InvalidArgument);
        assert!(
            e.message().contains("descriptors[0].limit"),
            "{}",
            e.message()
        );
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 1,
            unit: 99,
        });
        let e = client
            .should_rate_limit(request("api", vec![d]))
            .await
            .unwrap_err();
        assert_eq!(e.code(), GrpcCode::InvalidArgument);
        server.stop().await;
    })
    .await;
}

#[tokio::test]
async fn keys_are_injective_over_the_wire() {
    on_every_store(|server, _clock, store| async move {
        let mut client = server.client().await;
        // Exhaust ("user", "a:b") and check its look-alikes are untouched.
        let req = request("api", vec![descriptor(&[("user", "a_b")])]);
        for _ in 0..3 {
            client.should_rate_limit(req.clone()).await.unwrap();
        }
        for value in ["a", "a_", "a:b", "a|b", "a_b ", "{a_b}"] {
            let r = client
                .should_rate_limit(request("api", vec![descriptor(&[("user", value)])]))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(
                r.statuses[0].limit_remaining, 2,
                "{store}: {value:?} shares a counter"
            );
        }
        server.stop().await;
    })
    .await;
}

/// A value of any length is counted, never refused (a refused request
/// passes Envoy's filter unlimited): a long one (a token in a header) keys
/// its counter by its digest, each value its own.
#[tokio::test]
async fn long_values_are_counted_each_on_its_own_counter() {
    on_every_store(|server, _clock, store| async move {
        let mut client = server.client().await;
        let token = "t".repeat(60 * 1024);
        let req = request("api", vec![descriptor(&[("user", &token)])]);
        for remaining in [2, 1, 0] {
            let r = client
                .should_rate_limit(req.clone())
                .await
                .unwrap()
                .into_inner();
            assert_eq!(overall(&r), Code::Ok, "{store}");
            assert_eq!(r.statuses[0].limit_remaining, remaining, "{store}");
        }
        let r = client.should_rate_limit(req).await.unwrap().into_inner();
        assert_eq!(overall(&r), Code::OverLimit, "{store}");
        let other = format!("{token}u");
        let r = client
            .should_rate_limit(request("api", vec![descriptor(&[("user", &other)])]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.statuses[0].limit_remaining, 2, "{store}: another token");
        server.stop().await;
    })
    .await;
}

#[tokio::test]
async fn bad_input_gets_clear_errors() {
    let server = TestServer::start(
        &[LIMITS],
        Backend::Memory.store(Arc::new(ManualClock::new(START_MS))),
    )
    .await;
    let mut client = server.client().await;
    let cases = [
        (
            request("", vec![descriptor(&[("user", "a")])]),
            "domain must not be empty",
        ),
        (request("api", vec![]), "descriptor list must not be empty"),
        (
            request("api", vec![descriptor(&[("", "a")])]),
            "descriptors[0].entries[0]: the key must not be empty",
        ),
        (
            request("api", vec![descriptor(&[("user", "a")]); 10_000]),
            "at most 1024",
        ),
        (
            request("api", vec![descriptor(&[("k", "v"); 2049])]),
            "at most 2048",
        ),
        (
            request(&"d".repeat(1025), vec![descriptor(&[("k", "v")])]),
            "longer than 1024 bytes",
        ),
    ];
    for (req, message) in cases {
        let e = client.should_rate_limit(req).await.unwrap_err();
        assert_eq!(e.code(), GrpcCode::InvalidArgument, "{}", e.message());
        assert!(
            e.message().contains(message),
            "{:?} should contain {message:?}",
            e.message()
        );
    }
    // A message over gRPC's 4 MiB is refused before decoding.
    let e = client
        .should_rate_limit(request(
            "api",
            vec![descriptor(&[("user", &"v".repeat(5 << 20))])],
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), GrpcCode::OutOfRange, "{e:?}");
    assert!(
        e.message().contains("message length too large"),
        "{}",
        e.message()
    );
    // Negative hits are refused rather than silently counted up.
    let mut negative = descriptor(&[("user", "a")]);
    negative.is_negative_hits = true;
    let e = client
        .should_rate_limit(request("api", vec![negative]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), GrpcCode::InvalidArgument);
    // The server is still fine.
    let r = client
        .should_rate_limit(request("api", vec![descriptor(&[("user", "a")])]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 2);
    server.stop().await;
}

/// A `RateLimitRequest` whose domain is raw bytes, to send invalid UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct RawRequest {
    #[prost(bytes = "vec", tag = "1")]
    domain: Vec<u8>,
}

#[tokio::test]
async fn malformed_utf8_is_refused() {
    let server = TestServer::start(
        &[LIMITS],
        Backend::Memory.store(Arc::new(ManualClock::new(START_MS))),
    )
    .await;
    let channel = server.channel().await;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
    );
    let codec = tonic_prost::ProstCodec::<RawRequest, RateLimitResponse>::default();
    let raw = RawRequest {
        domain: vec![b'a', 0xff, 0xfe],
    };
    let e = grpc
        .unary(tonic::Request::new(raw), path, codec)
        .await
        .unwrap_err();
    assert!(e.message().contains("UTF-8"), "{e:?}");
    server.stop().await;
}

#[tokio::test]
async fn reload_adds_and_removes_domains_and_keeps_running_config_on_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("api.yaml"), LIMITS).unwrap();
    let config = ratekeeper::config::Config::load_dir(dir.path()).unwrap();
    let clock = Arc::new(ManualClock::new(START_MS));
    let server = TestServer::start_with(
        config,
        Some(dir.path().to_owned()),
        Backend::Memory.store(clock),
    )
    .await;
    let mut client = server.client().await;
    let other = request("other", vec![descriptor(&[("k", "v")])]);
    let limited = |r: &RateLimitResponse| r.statuses[0].current_limit.is_some();

    let r = client
        .should_rate_limit(other.clone())
        .await
        .unwrap()
        .into_inner();
    assert!(!limited(&r), "no such domain yet");

    let other_yaml = "domain: other\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 7}\n";
    std::fs::write(dir.path().join("other.yaml"), other_yaml).unwrap();
    let mut tries = 0;
    loop {
        let r = client
            .should_rate_limit(other.clone())
            .await
            .unwrap()
            .into_inner();
        if limited(&r) {
            assert_eq!(
                r.statuses[0]
                    .current_limit
                    .as_ref()
                    .unwrap()
                    .requests_per_unit,
                7
            );
            break;
        }
        tries += 1;
        assert!(tries < 200, "the new domain was never loaded");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }

    // A broken file: the running config (with both domains) stays.
    std::fs::write(
        dir.path().join("broken.yaml"),
        "domain: broken\nnonsense: [\n",
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = client
        .should_rate_limit(other.clone())
        .await
        .unwrap()
        .into_inner();
    assert!(
        limited(&r),
        "a failed reload must not drop the running config"
    );
    std::fs::remove_file(dir.path().join("broken.yaml")).unwrap();

    std::fs::remove_file(dir.path().join("other.yaml")).unwrap();
    let mut tries = 0;
    loop {
        let r = client
            .should_rate_limit(other.clone())
            .await
            .unwrap()
            .into_inner();
        if !limited(&r) {
            break;
        }
        tries += 1;
        assert!(tries < 200, "the removed domain was never dropped");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(server.config.current().domain("api").is_some());
    server.stop().await;
}

#[tokio::test]
async fn reload_follows_a_configmap_symlink_swap() {
    // Kubernetes mounts a ConfigMap as `name -> ..data/name`, `..data -> ..<timestamp>`,
    // and updates it by atomically re-pointing `..data`.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let write_version = |name: &str, rpu: u32| {
        let version = root.join(name);
        std::fs::create_dir(&version).unwrap();
        std::fs::write(
            version.join("limits.yaml"),
            format!("domain: cm\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: {rpu}}}\n"),
        )
        .unwrap();
    };
    write_version("..v1", 1);
    std::os::unix::fs::symlink("..v1", root.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/limits.yaml", root.join("limits.yaml")).unwrap();
    let config = ratekeeper::config::Config::load_dir(root).unwrap();
    let server = TestServer::start_with(
        config,
        Some(root.to_owned()),
        Backend::Memory.store(Arc::new(ManualClock::new(START_MS))),
    )
    .await;
    let mut client = server.client().await;
    let req = request("cm", vec![descriptor(&[("k", "v")])]);
    let rpu = |r: &RateLimitResponse| {
        r.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit)
    };
    assert_eq!(
        rpu(&client
            .should_rate_limit(req.clone())
            .await
            .unwrap()
            .into_inner()),
        Some(1)
    );

    write_version("..v2", 2);
    std::os::unix::fs::symlink("..v2", root.join("..data_tmp")).unwrap();
    std::fs::rename(root.join("..data_tmp"), root.join("..data")).unwrap();
    let mut tries = 0;
    while rpu(&client
        .should_rate_limit(req.clone())
        .await
        .unwrap()
        .into_inner())
        != Some(2)
    {
        tries += 1;
        assert!(tries < 200, "the swapped ConfigMap was never loaded");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    server.stop().await;
}

#[tokio::test]
async fn reflection_v1_and_v1alpha_list_the_envoy_service() {
    use tokio_stream::StreamExt;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient as V1;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest as V1Request;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse as V1Response;
    use tonic_reflection::pb::v1::ServerReflectionRequest as V1Req;
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient as V1Alpha;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest as AlphaRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse as AlphaResponse;
    use tonic_reflection::pb::v1alpha::ServerReflectionRequest as AlphaReq;

    let server = TestServer::start(
        &[LIMITS],
        Backend::Memory.store(Arc::new(ManualClock::new(START_MS))),
    )
    .await;
    let channel = server.channel().await;

    let ask = V1Req {
        host: String::new(),
        message_request: Some(V1Request::ListServices(String::new())),
    };
    let mut answers = V1::new(channel.clone())
        .server_reflection_info(tokio_stream::iter([ask]))
        .await
        .unwrap()
        .into_inner();
    let Some(Ok(answer)) = answers.next().await else {
        panic!("no v1 answer")
    };
    let Some(V1Response::ListServicesResponse(list)) = answer.message_response else {
        panic!("{answer:?}")
    };
    let v1: Vec<String> = list.service.into_iter().map(|s| s.name).collect();

    let ask = AlphaReq {
        host: String::new(),
        message_request: Some(AlphaRequest::ListServices(String::new())),
    };
    let mut answers = V1Alpha::new(channel)
        .server_reflection_info(tokio_stream::iter([ask]))
        .await
        .unwrap()
        .into_inner();
    let Some(Ok(answer)) = answers.next().await else {
        panic!("no v1alpha answer")
    };
    let Some(AlphaResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("{answer:?}")
    };
    let v1alpha: Vec<String> = list.service.into_iter().map(|s| s.name).collect();

    for services in [&v1, &v1alpha] {
        assert!(
            services
                .iter()
                .any(|s| s == "envoy.service.ratelimit.v3.RateLimitService"),
            "{services:?}"
        );
        assert!(
            services.iter().any(|s| s == "grpc.health.v1.Health"),
            "{services:?}"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn a_full_fixed_window_is_answered_without_redis_until_it_resets() {
    let redis = common::RedisServer::start();
    let clock = Arc::new(ManualClock::new(START_MS));
    let server = TestServer::start(&[LIMITS], redis.store(Some(clock.clone()))).await;
    let mut client = server.client().await;
    let req = request("api", vec![descriptor(&[("user", "hot")])]);
    for _ in 0..4 {
        client.should_rate_limit(req.clone()).await.unwrap();
    }
    let mut conn = redis.client().get_connection().unwrap();
    let before = common::keyed_limiter_calls(&mut conn);
    clock.advance(10_000);
    for _ in 0..10 {
        let r = client
            .should_rate_limit(req.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(overall(&r), Code::OverLimit);
        assert_eq!(
            reset_ms(&r.statuses[0]),
            50_000,
            "the reset keeps counting down"
        );
    }
    assert_eq!(
        common::keyed_limiter_calls(&mut conn),
        before,
        "the hot key cost Redis nothing"
    );
    // At the window's end the cache lets go and Redis decides again.
    clock.set(START_MS + 60_000);
    let r = client.should_rate_limit(req).await.unwrap().into_inner();
    assert_eq!((overall(&r), r.statuses[0].limit_remaining), (Code::Ok, 2));
    assert_eq!(common::keyed_limiter_calls(&mut conn), before + 1);
    server.stop().await;
}

/// Redis's `CLIENT LIST`: one line per connection, with its last command.
fn client_list(conn: &mut redis::Connection) -> String {
    redis::cmd("CLIENT").arg("LIST").query(conn).unwrap()
}

/// The connections in `list` whose last command called the limiter.
fn limiter_connections(list: &str) -> usize {
    list.lines().filter(|l| l.contains(" cmd=fcall ")).count()
}

#[tokio::test]
async fn each_serving_lane_calls_redis_on_its_own_connection() {
    // Two lanes in the test server and in the store, one Redis connection
    // each.
    let redis = common::RedisServer::start();
    let clock = Arc::new(ManualClock::new(START_MS));
    let server = TestServer::start(&[LIMITS], redis.store(Some(clock))).await;
    // Warmed up (every lane's connection has loaded the scripts). The
    // health check's connection went to lane 0; open or closed by now, the
    // next two go to lanes 1 and 0.
    server.serving().await;
    let mut clients = [server.client().await, server.client().await];
    for (i, client) in clients.iter_mut().enumerate() {
        let user = format!("u{i}");
        let req = request("api", vec![descriptor(&[("user", &user)])]);
        client.should_rate_limit(req).await.unwrap();
    }
    let list = client_list(&mut redis.client().get_connection().unwrap());
    assert_eq!(
        limiter_connections(&list),
        2,
        "both lanes' connections ran the limiter:\n{list}"
    );
    server.stop().await;
}

/// The server's own ends of its TCP connections on `port` that it has not
/// closed yet (ESTABLISHED, or CLOSE_WAIT: the client has gone), from
/// `/proc/net/tcp`.
fn open_connections(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let local = format!(":{port:04X} ");
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            Some((*fields.get(1)?, *fields.get(3)?))
        })
        .filter(|(address, state)| {
            format!("{address} ").ends_with(&local) && matches!(*state, "01" | "08")
        })
        .count()
}

/// Waits up to 5 s for [`open_connections`] on `port` to reach `count`
/// (the caller asserts it).
async fn settle_open_connections(port: u16, count: usize) {
    for _ in 0..500 {
        if open_connections(port) == count {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_new_connection_goes_to_the_lane_with_the_fewest_open() {
    let redis = common::RedisServer::start();
    let clock = Arc::new(ManualClock::new(START_MS));
    let server = TestServer::start(&[LIMITS], redis.store(Some(clock))).await;
    let mut conn = redis.client().get_connection().unwrap();
    // Both lanes warmed up (their last step loads the lease script), with no
    // gRPC connection made yet.
    for _ in 0..500 {
        if client_list(&mut conn).matches(" cmd=script|load ").count() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut first = server.client().await; // lane 0
    let second = server.client().await; // lane 1

    // A connection attempt that failed under load (the client retries) is
    // closed by the server within its handshake timeout: wait for it.
    settle_open_connections(server.addr.port(), 2).await;
    assert_eq!(open_connections(server.addr.port()), 2);
    drop(second);
    // Until the server has closed its end (and so uncounted it).
    settle_open_connections(server.addr.port(), 1).await;
    // Lane 1 has no connection open now, lane 0 one: the third goes to lane
    // 1 (dealt in turn, it would go to lane 0).
    let mut third = server.client().await;
    for (user, client) in [("a", &mut first), ("b", &mut third)] {
        let req = request("api", vec![descriptor(&[("user", user)])]);
        client.should_rate_limit(req).await.unwrap();
    }
    let list = client_list(&mut conn);
    assert_eq!(
        limiter_connections(&list),
        2,
        "the two clients were served by two lanes:\n{list}"
    );
    server.stop().await;
}
