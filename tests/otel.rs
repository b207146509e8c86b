//! OpenTelemetry tracing end to end: the ratekeeper binary, started with
//! `TRACING_*` / `OTEL_EXPORTER_OTLP_ENDPOINT`, sends its spans to a real
//! OTLP receiver the test serves (OTLP/HTTP protobuf and OTLP/gRPC, decoded
//! with the OTLP protos), and the spans join the caller's trace.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use common::{descriptor, free_port, request, try_http_exchange_with, Ratekeeper, RedisServer};
use prost::Message;
use ratekeeper::pb::otlp::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use ratekeeper::pb::otlp::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use ratekeeper::pb::otlp::common::v1::any_value::Value;
use ratekeeper::pb::otlp::trace::v1::Span;
use tokio::sync::mpsc;
use tonic_health::pb::health_client::HealthClient;

const LIMITS: &str =
    "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

type Exports = mpsc::UnboundedReceiver<ExportTraceServiceRequest>;

/// An OTLP/HTTP receiver: `POST /v1/traces` with a protobuf body.
async fn http_receiver() -> (SocketAddr, Exports) {
    let (tx, rx) = mpsc::unbounded_channel();
    let router = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let tx = tx.clone();
            async move {
                match ExportTraceServiceRequest::decode(body) {
                    Ok(export) => {
                        let _ = tx.send(export);
                        (
                            StatusCode::OK,
                            ExportTraceServiceResponse::default().encode_to_vec(),
                        )
                    }
                    Err(_) => (StatusCode::BAD_REQUEST, Vec::new()),
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    (addr, rx)
}

/// An OTLP/gRPC receiver: `TraceService/Export`.
struct GrpcReceiver(mpsc::UnboundedSender<ExportTraceServiceRequest>);

#[tonic::async_trait]
impl TraceService for GrpcReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let _ = self.0.send(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

async fn grpc_receiver() -> (SocketAddr, Exports) {
    let (tx, rx) = mpsc::unbounded_channel();
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(GrpcReceiver(tx)))
            .serve(addr),
    );
    (addr, rx)
}

/// Calls ShouldRateLimit with `traceparent` (when given) and returns the
/// overall code.
async fn call(server: &Ratekeeper, traceparent: Option<String>) -> i32 {
    let mut client = server.client().await;
    let mut req = tonic::Request::new(request("d", vec![descriptor(&[("k", "v")])]));
    if let Some(value) = traceparent {
        req.metadata_mut()
            .insert("traceparent", value.parse().unwrap());
    }
    client
        .should_rate_limit(req)
        .await
        .unwrap()
        .into_inner()
        .overall_code
}

/// The spans' names, envoyproxy/ratelimit's: the call's (otelgrpc's), its
/// execution's and, on Redis, the store call's.
const CALL: &str = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
const EXECUTION: &str = "ShouldRateLimit Execution";
const REDIS_STORE: &str = "Redis Pipeline Execution";
const MEMORY_STORE: &str = "Memory Store Execution";

/// Spans received until `count` arrived (or 10 s passed), with the
/// resource's attributes of the last export.
async fn spans(exports: &mut Exports, count: usize) -> (Vec<Span>, Vec<(String, String)>) {
    let mut spans = Vec::new();
    let mut resource = Vec::new();
    while spans.len() < count {
        let export = tokio::time::timeout(Duration::from_secs(10), exports.recv())
            .await
            .unwrap_or_else(|_| panic!("{} spans of {count} arrived", spans.len()))
            .expect("receiver open");
        for rs in export.resource_spans {
            resource = rs
                .resource
                .map(|r| {
                    r.attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), text(kv)))
                        .collect()
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                spans.extend(ss.spans);
            }
        }
    }
    (spans, resource)
}

fn text(kv: &ratekeeper::pb::otlp::common::v1::KeyValue) -> String {
    match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        other => format!("{other:?}"),
    }
}

fn attr(span: &Span, key: &str) -> String {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .map(text)
        .unwrap_or_else(|| panic!("no {key} on {}", span.name))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn decisions_join_the_callers_trace_over_otlp_http_with_a_redis_store_call() {
    let redis = RedisServer::start();
    let (addr, mut exports) = http_receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("http://{addr}");
    let limits = dir.path().join("limits");
    std::fs::create_dir_all(&limits).unwrap();
    std::fs::write(limits.join("limits.yaml"), LIMITS).unwrap();
    let server = Ratekeeper::spawn_with_env(
        &limits,
        &["--redis-url", &redis.url()],
        &[
            ("TRACING_ENABLED", "true"),
            ("TRACING_SERVICE_NAME", "rk-test"),
            ("TRACING_SERVICE_NAMESPACE", "edge"),
            ("TRACING_SERVICE_INSTANCE_ID", "pod-1"),
            // Only the caller's sampled flag decides here.
            ("TRACING_SAMPLING_RATE", "0"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
        ],
    );
    // Warmed up first: a serving thread's warm-up learns which Redis it
    // reached, which empties the over-limit cache this test reads.
    let mut health = HealthClient::new(server.channel().await);
    common::until_serving(&mut health).await;
    // Not sampled by the caller, and no root sampling: no span.
    let unsampled = format!("00-{}-{PARENT}-00", "1".repeat(32));
    assert_eq!(call(&server, Some(unsampled)).await, 1);
    assert_eq!(call(&server, None).await, 1);
    let sampled = format!("00-{TRACE}-{PARENT}-01");
    assert_eq!(call(&server, Some(sampled)).await, 2, "over the limit of 2");
    // Now the over-limit cache knows the key: no store call.
    let cached_trace = "2".repeat(32);
    let cached = format!("00-{cached_trace}-{PARENT}-01");
    assert_eq!(call(&server, Some(cached)).await, 2);

    let (spans, resource) = spans(&mut exports, 5).await;
    assert_eq!(
        spans.len(),
        5,
        "two decisions of two spans, one store call: {spans:?}"
    );
    let of_trace = |trace: &str, name: &str| {
        spans
            .iter()
            .find(|s| hex(&s.trace_id) == trace && s.name == name)
            .unwrap_or_else(|| panic!("no {name} in trace {trace}: {spans:?}"))
    };
    let decision = of_trace(TRACE, CALL);
    let execution = of_trace(TRACE, EXECUTION);
    let store = of_trace(TRACE, REDIS_STORE);
    assert_eq!(
        hex(&decision.parent_span_id),
        PARENT,
        "the caller's span is the parent"
    );
    assert_eq!(attr(decision, "ratelimit.domain"), "d");
    assert_eq!(attr(decision, "ratelimit.descriptors"), "1");
    assert_eq!(attr(decision, "ratelimit.outcome"), "OVER_LIMIT");
    assert_eq!(attr(decision, "ratelimit.store"), "redis");
    assert_eq!(attr(decision, "ratelimit.answered_by"), "store");
    // As otelgrpc and their service name and mark them.
    assert_eq!(attr(decision, "rpc.system"), "grpc");
    assert_eq!(
        attr(decision, "rpc.service"),
        "envoy.service.ratelimit.v3.RateLimitService"
    );
    assert_eq!(attr(decision, "rpc.method"), "ShouldRateLimit");
    assert_eq!(attr(decision, "rpc.grpc.status_code"), "0");
    assert_eq!(execution.parent_span_id, decision.span_id);
    assert_ne!(execution.span_id, decision.span_id);
    assert_eq!(attr(execution, "domain"), "d");
    assert_eq!(
        store.parent_span_id, execution.span_id,
        "a child of the execution"
    );
    assert_eq!(attr(store, "ratelimit.checks"), "1");
    assert!(decision.start_time_unix_nano <= store.start_time_unix_nano);
    assert!(store.end_time_unix_nano <= decision.end_time_unix_nano);
    let from_cache = of_trace(&cached_trace, CALL);
    assert_eq!(attr(from_cache, "ratelimit.answered_by"), "cache");
    assert_eq!(attr(from_cache, "ratelimit.outcome"), "OVER_LIMIT");

    // `/json` is ShouldRateLimit too, traced alike (as theirs).
    let json_trace = "3".repeat(32);
    let traceparent = format!("00-{json_trace}-{PARENT}-01");
    let body = r#"{"domain":"d","descriptors":[{"entries":[{"key":"k","value":"json"}]}]}"#;
    let answer = try_http_exchange_with(
        &server.http,
        "POST",
        "/json",
        &[
            ("traceparent", &traceparent),
            ("tracestate", "vendor=abc,other=x"),
        ],
        body,
    )
    .expect("/json");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let (json_spans, _) = crate::spans(&mut exports, 3).await;
    let from_json = json_spans
        .iter()
        .find(|s| hex(&s.trace_id) == json_trace && s.name == CALL)
        .unwrap_or_else(|| panic!("no /json decision: {json_spans:?}"));
    assert_eq!(hex(&from_json.parent_span_id), PARENT);
    // The caller's tracestate goes on with its trace, in every span.
    let of_json = json_spans.iter().filter(|s| hex(&s.trace_id) == json_trace);
    assert!(
        of_json.clone().count() == 3
            && of_json
                .clone()
                .all(|s| s.trace_state == "vendor=abc,other=x"),
        "{json_spans:?}"
    );
    assert_eq!(attr(from_json, "ratelimit.outcome"), "OK");
    for (key, value) in [
        ("service.name", "rk-test"),
        ("service.namespace", "edge"),
        ("service.instance.id", "pod-1"),
    ] {
        assert!(
            resource.contains(&(key.to_owned(), value.to_owned())),
            "{key}={value} in {resource:?}"
        );
    }
}

#[tokio::test]
async fn root_decisions_are_sampled_by_rate_and_exported_over_otlp_grpc() {
    let (addr, mut exports) = grpc_receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let limits = dir.path().join("limits");
    std::fs::create_dir_all(&limits).unwrap();
    std::fs::write(limits.join("limits.yaml"), LIMITS).unwrap();
    let endpoint = format!("http://{addr}");
    let server = Ratekeeper::spawn_with_env(
        &limits,
        &[],
        &[
            ("TRACING_ENABLED", "true"),
            ("TRACING_EXPORTER_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
        ],
    );
    // No traceparent: a root trace, sampled at the default rate of 1.
    assert_eq!(call(&server, None).await, 1);
    let (spans, resource) = spans(&mut exports, 3).await;
    let decision = spans.iter().find(|s| s.name == CALL).unwrap();
    assert!(spans.iter().any(|s| s.name == MEMORY_STORE), "{spans:?}");
    assert!(decision.parent_span_id.is_empty(), "a root span");
    assert_eq!(decision.trace_id.len(), 16);
    assert_eq!(attr(decision, "ratelimit.outcome"), "OK");
    assert_eq!(attr(decision, "ratelimit.store"), "memory");
    assert!(resource.contains(&("service.name".into(), "RateLimit".into())));
}

#[test]
fn a_bad_sampling_rate_or_endpoint_stops_the_start_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    for (env, reason) in [
        (("TRACING_SAMPLING_RATE", "1.5"), "must be between 0 and 1"),
        (
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector:4318"),
            "only http://",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
            .args(["--config-dir", &dir.path().display().to_string()])
            .args([
                "--grpc-addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .args(["--http-addr", "127.0.0.1:0", "--debug-addr", "127.0.0.1:0"])
            .env("TRACING_ENABLED", "true")
            .env(env.0, env.1)
            .output()
            .unwrap();
        let stderr = common::fatal_message(&String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "{env:?} must stop the start");
        assert!(stderr.contains(reason), "{env:?}: {stderr}");
    }
}

#[tokio::test]
async fn a_redis_call_shared_by_sampled_decisions_is_one_span_the_others_link_to() {
    let redis = RedisServer::start();
    let (addr, mut exports) = http_receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let limits = dir.path().join("limits");
    std::fs::create_dir_all(&limits).unwrap();
    std::fs::write(limits.join("limits.yaml"), LIMITS).unwrap();
    let endpoint = format!("http://{addr}");
    // One lane with one call in flight: concurrent requests queue and go
    // together in the next call.
    let server = Ratekeeper::spawn_with_env(
        &limits,
        &[
            "--redis-url",
            &redis.url(),
            "--redis-pool-size",
            "1",
            "--serving-threads",
            "1",
            "--redis-timeout-ms",
            "2000",
        ],
        &[
            ("TRACING_ENABLED", "true"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
        ],
    );
    const CALLS: usize = 64;
    let client = server.client().await;
    let calls = (0..CALLS).map(|i| {
        let mut client = client.clone();
        async move {
            let value = format!("v{i}");
            let req = request("d", vec![descriptor(&[("k", &value)])]);
            client
                .should_rate_limit(req)
                .await
                .unwrap()
                .into_inner()
                .overall_code
        }
    });
    let codes = futures_util::future::join_all(calls).await;
    assert!(codes.iter().all(|&c| c == 1), "{codes:?}");

    // Every decision and its store span, plus one span per shared call.
    let (spans, _) = spans(&mut exports, 3 * CALLS).await;
    let stores: Vec<&Span> = spans.iter().filter(|s| s.name == REDIS_STORE).collect();
    let calls: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "redis.shared_call")
        .collect();
    assert_eq!(stores.len(), CALLS, "one store span per decision");
    let linked: Vec<&Span> = stores
        .iter()
        .copied()
        .filter(|s| !s.links.is_empty())
        .collect();
    assert!(
        !linked.is_empty(),
        "some decisions shared a call: {calls:?}"
    );
    let sharing = stores
        .iter()
        .filter(|s| {
            s.attributes
                .iter()
                .any(|kv| kv.key == "ratelimit.shared_call.requests")
        })
        .count();
    assert_eq!(
        calls.len() + linked.len(),
        sharing,
        "each decision in a shared call owns its span or links to it, never both"
    );
    for store in &linked {
        let link = &store.links[0];
        let call = calls
            .iter()
            .find(|c| c.span_id == link.span_id && c.trace_id == link.trace_id)
            .expect("the linked call is exported once, in its owner's trace");
        assert_ne!(call.trace_id, store.trace_id, "in another decision's trace");
        assert!(
            attr(call, "ratelimit.shared_call.requests")
                .parse::<usize>()
                .unwrap()
                > 1
        );
    }
    for call in &calls {
        let owner = stores
            .iter()
            .find(|s| s.span_id == call.parent_span_id)
            .expect("a call is the child of its owner's store span");
        assert!(owner.links.is_empty());
        assert_eq!(owner.trace_id, call.trace_id);
    }
}

#[tokio::test]
async fn a_failed_store_call_is_an_error_span_and_the_failure_mode_answers() {
    let mut redis = RedisServer::start();
    let (addr, mut exports) = http_receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let limits = dir.path().join("limits");
    std::fs::create_dir_all(&limits).unwrap();
    std::fs::write(limits.join("limits.yaml"), LIMITS).unwrap();
    let endpoint = format!("http://{addr}");
    let server = Ratekeeper::spawn_with_env(
        &limits,
        &[
            "--redis-url",
            &redis.url(),
            "--redis-timeout-ms",
            "200",
            "--failure-mode",
            "open",
        ],
        &[
            ("TRACING_ENABLED", "true"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
        ],
    );
    redis.kill();
    let sampled = format!("00-{TRACE}-{PARENT}-01");
    assert_eq!(call(&server, Some(sampled)).await, 1, "failure mode open");
    let (spans, _) = spans(&mut exports, 3).await;
    let decision = spans.iter().find(|s| s.name == CALL).unwrap();
    let store = spans.iter().find(|s| s.name == REDIS_STORE).unwrap();
    assert_eq!(attr(decision, "ratelimit.answered_by"), "open");
    assert_eq!(attr(decision, "ratelimit.outcome"), "OK");
    let status = store.status.as_ref().expect("the store call failed");
    assert_eq!(status.code, 2, "STATUS_CODE_ERROR");
    assert!(!status.message.is_empty());
}

/// A request spanning two Redis (`REDIS_PERSECOND`) refused across them
/// under `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT` (the per-second limit
/// refuses, the main Redis's minute is decided as refused) has its store
/// span, as any decision: the main Redis's call, as on the usual path.
#[tokio::test]
async fn a_decision_refused_across_two_redis_has_its_store_span() {
    let (main, per_second) = (RedisServer::start(), RedisServer::start());
    let (addr, mut exports) = http_receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let limits = dir.path().join("limits");
    std::fs::create_dir_all(&limits).unwrap();
    std::fs::write(
        limits.join("limits.yaml"),
        "domain: d\ndescriptors:\n  - key: ip\n    rate_limit: {unit: second, requests_per_unit: 0}\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 5}\n",
    )
    .unwrap();
    let (main_url, per_second_url) = (main.url(), per_second.url());
    let endpoint = format!("http://{addr}");
    let server = Ratekeeper::spawn_with_env(
        &limits,
        &[],
        &[
            ("REDIS_URL", main_url.as_str()),
            ("REDIS_PERSECOND", "true"),
            ("REDIS_PERSECOND_URL", per_second_url.as_str()),
            ("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "true"),
            ("TRACING_ENABLED", "true"),
            ("TRACING_SAMPLING_RATE", "1"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
        ],
    );
    let mut health = HealthClient::new(server.channel().await);
    common::until_serving(&mut health).await;
    let both = vec![
        descriptor(&[("ip", "10.0.0.1")]),
        descriptor(&[("user", "alice")]),
    ];
    let answer = server
        .client()
        .await
        .should_rate_limit(request("d", both))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.overall_code, 2, "the per-second limit of 0 refuses");

    let (spans, _) = spans(&mut exports, 3).await;
    let named = |name: &str| {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name}: {spans:?}"))
    };
    let (decision, execution) = (named(CALL), named(EXECUTION));
    assert_eq!(attr(decision, "ratelimit.outcome"), "OVER_LIMIT");
    assert_eq!(attr(decision, "ratelimit.store"), "redis");
    assert_eq!(attr(decision, "ratelimit.answered_by"), "store");
    let store = named(REDIS_STORE);
    assert_eq!(store.parent_span_id, execution.span_id);
    assert_eq!(attr(store, "ratelimit.checks"), "1", "the main Redis's one");
}
