//! Limits over xDS: a real ADS server (tonic, serving `RateLimitConfig`
//! snapshots over `StreamAggregatedResources`, mutual TLS 1.3 only, from
//! throwaway RSA PKCS#1 certificates without extended key usage, as Envoy
//! Gateway makes them) feeding ratekeeper's xDS client; in process, then the
//! binary under Envoy Gateway's environment with a real Redis.

mod common;

use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use common::certs::Certs;
use common::{descriptor, request, Ratekeeper, RedisServer, RlsClient, TestServer};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use ratekeeper::clock::SystemClock;
use ratekeeper::config::watch::SharedConfig;
use ratekeeper::config::xds_client::{self, Backoff, ClientTls, XdsSettings, TYPE_URL};
use ratekeeper::config::Config;
use ratekeeper::pb::rls_conf::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use ratekeeper::store::{MemoryStore, Store};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataMap;
use tonic::transport::server::Connected;
use tonic::{Request, Response, Status, Streaming};

// ---- certificates ------------------------------------------------------

/// Envoy Gateway's certificates, as its certgen makes them (see
/// [`Certs`]): its xDS server, the rate limit service (its client
/// certificate and its gRPC server's), Envoy (the RLS client), and a
/// stranger.
impl Certs {
    fn make() -> Certs {
        let certs = Certs::ca("envoy-gateway");
        certs.leaf("xds", "envoy-gateway", "DNS:envoy-gateway,DNS:localhost");
        certs.leaf(
            "tls",
            "envoy",
            "DNS:*.envoy-gateway-system,DNS:envoy-ratelimit.envoy-gateway-system",
        );
        certs.leaf(
            "envoy",
            "envoy",
            "DNS:*.envoy-gateway-system,DNS:envoy.envoy-gateway-system",
        );
        certs.leaf("stranger", "stranger", "DNS:stranger.example");
        let key = std::fs::read_to_string(certs.path("tls.key")).expect("key");
        assert!(
            key.starts_with("-----BEGIN RSA PRIVATE KEY-----"),
            "not PKCS#1: {key}"
        );
        certs
    }

    /// A client TLS setup trusting the CA, as `name` (its .crt and .key),
    /// checking the server's certificate for `server_name`.
    fn client(&self, name: Option<&str>, server_name: &str) -> ClientTls {
        let (crt, key) = name.map_or((None, None), |n| {
            (
                Some(self.path(&format!("{n}.crt"))),
                Some(self.path(&format!("{n}.key"))),
            )
        });
        let identity = crt.as_deref().zip(key.as_deref());
        let config = ratekeeper::tls::client_config(Some(&self.path("ca.crt")), identity)
            .expect("client TLS");
        ClientTls {
            config: Arc::new(config),
            server_name: ServerName::try_from(server_name.to_owned()).expect("name"),
        }
    }

    /// Envoy Gateway's xDS server side: TLS 1.3 only, client certificates
    /// required (signed by the CA), ALPN h2.
    fn xds_server(&self) -> Arc<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(self.path("ca.crt")).expect("ca") {
                roots.add(cert.expect("ca cert")).expect("root");
            }
            Arc::new(roots)
        };
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .expect("verifier");
        let certs = CertificateDer::pem_file_iter(self.path("xds.crt"))
            .expect("crt")
            .collect::<Result<Vec<_>, _>>()
            .expect("certs");
        let key = PrivateKeyDer::from_pem_file(self.path("xds.key")).expect("key");
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("TLS 1.3")
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .expect("server config");
        config.alpn_protocols = vec![b"h2".to_vec()];
        Arc::new(config)
    }
}

// ---- the ADS server -----------------------------------------------------

/// A snapshot: a version and every `RateLimitConfig` (none yet if the
/// version is empty).
#[derive(Clone, Default)]
struct Snapshot {
    version: String,
    configs: Vec<RateLimitConfig>,
}

/// What the ADS server serves and what it has heard; shared by the server
/// and its restarts.
#[derive(Clone)]
struct Ads {
    snapshot: Arc<watch::Sender<Snapshot>>,
    requests: Arc<Mutex<Vec<DiscoveryRequest>>>,
    headers: Arc<Mutex<Vec<MetadataMap>>>,
    nonces: Arc<Mutex<u64>>,
    /// Sends the snapshot again on every NACK, as go-control-plane does.
    resends_on_nack: Arc<AtomicBool>,
}

impl Ads {
    fn new() -> Ads {
        Ads {
            snapshot: Arc::new(watch::channel(Snapshot::default()).0),
            requests: Arc::default(),
            headers: Arc::default(),
            nonces: Arc::default(),
            resends_on_nack: Arc::default(),
        }
    }

    fn publish(&self, version: &str, configs: Vec<RateLimitConfig>) {
        self.snapshot.send_replace(Snapshot {
            version: version.into(),
            configs,
        });
    }

    fn response(&self, snapshot: &Snapshot) -> DiscoveryResponse {
        let nonce = {
            let mut n = self.nonces.lock().expect("nonces");
            *n += 1;
            n.to_string()
        };
        DiscoveryResponse {
            version_info: snapshot.version.clone(),
            resources: snapshot
                .configs
                .iter()
                .map(|c| Any {
                    type_url: TYPE_URL.into(),
                    value: c.encode_to_vec(),
                })
                .collect(),
            type_url: TYPE_URL.into(),
            nonce,
            ..DiscoveryResponse::default()
        }
    }

    /// Waits for a request matching `matches` (10 s at most) and returns it.
    async fn heard(
        &self,
        what: &str,
        matches: impl Fn(&DiscoveryRequest) -> bool,
    ) -> DiscoveryRequest {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let found = self
                .requests
                .lock()
                .expect("requests")
                .iter()
                .find(|r| matches(r))
                .cloned();
            if let Some(found) = found {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "the ADS server never heard {what}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits for the ACK of `version`.
    async fn acked(&self, version: &str) -> DiscoveryRequest {
        self.heard(&format!("an ACK of {version:?}"), |r| {
            r.version_info == version && r.error_detail.is_none() && !r.response_nonce.is_empty()
        })
        .await
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = ReceiverStream<Result<DiscoveryResponse, Status>>;
    type DeltaAggregatedResourcesStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    /// State of the world: the current snapshot after the first request,
    /// then each new one; every request is recorded.
    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        self.headers
            .lock()
            .expect("headers")
            .push(request.metadata().clone());
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let ads = self.clone();
        let mut snapshots = self.snapshot.subscribe();
        tokio::spawn(async move {
            let mut subscribed = false;
            loop {
                let send = tokio::select! {
                    message = inbound.message() => {
                        let Ok(Some(message)) = message else { return };
                        let again = message.error_detail.is_some()
                            && ads.resends_on_nack.load(Ordering::SeqCst);
                        ads.requests.lock().expect("requests").push(message);
                        !std::mem::replace(&mut subscribed, true) || again
                    }
                    changed = snapshots.changed() => changed.is_ok() && subscribed,
                };
                let snapshot = snapshots.borrow_and_update().clone();
                if send
                    && !snapshot.version.is_empty()
                    && tx.send(Ok(ads.response(&snapshot))).await.is_err()
                {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delta_aggregated_resources(
        &self,
        _: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented("state of the world only"))
    }
}

/// A TLS connection accepted by the ADS server.
struct TlsConn(tokio_rustls::server::TlsStream<tokio::net::TcpStream>);

impl Connected for TlsConn {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

impl AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, data)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// The ADS server on its own runtime: stopping it drops every connection
/// at once, as a killed process would.
struct AdsServer {
    port: u16,
    runtime: Option<tokio::runtime::Runtime>,
}

impl AdsServer {
    fn start(ads: &Ads, tls: Arc<rustls::ServerConfig>, port: u16) -> AdsServer {
        // A restart takes the same port, once the old listener has closed.
        let deadline = Instant::now() + Duration::from_secs(10);
        let listener = loop {
            match std::net::TcpListener::bind(("127.0.0.1", port)) {
                Ok(listener) => break listener,
                Err(e) if Instant::now() > deadline => panic!("ADS port {port}: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            // Room for the deepest snapshots' messages, which clone and
            // encode once a level.
            .thread_stack_size(64 << 20)
            .enable_all()
            .build()
            .expect("runtime");
        let ads = ads.clone();
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            let acceptor = tokio_rustls::TlsAcceptor::from(tls);
            let (tx, rx) = mpsc::channel(16);
            tokio::spawn(async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    let (acceptor, tx) = (acceptor.clone(), tx.clone());
                    tokio::spawn(async move {
                        if let Ok(tls) = acceptor.accept(tcp).await {
                            let _ = tx.send(Ok::<_, std::io::Error>(TlsConn(tls))).await;
                        }
                    });
                }
            });
            tonic::transport::Server::builder()
                .add_service(
                    AggregatedDiscoveryServiceServer::new(ads).max_decoding_message_size(64 << 20),
                )
                .serve_with_incoming(ReceiverStream::new(rx))
                .await
        });
        AdsServer {
            port,
            runtime: Some(runtime),
        }
    }

    fn stop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for AdsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---- helpers --------------------------------------------------------------

/// One domain with one rule: `key` (any value), `per_minute` requests a
/// minute.
fn domain(name: &str, key: &str, per_minute: u32) -> RateLimitConfig {
    RateLimitConfig {
        name: name.into(),
        domain: name.into(),
        descriptors: vec![RateLimitDescriptor {
            key: key.into(),
            rate_limit: Some(RateLimitPolicy {
                unit: RateLimitUnit::Minute as i32,
                requests_per_unit: per_minute,
                ..RateLimitPolicy::default()
            }),
            ..RateLimitDescriptor::default()
        }],
    }
}

fn settings(certs: &Certs, server: &AdsServer) -> XdsSettings {
    let mut headers = MetadataMap::new();
    headers.insert("x-tenant", "blue".parse().expect("header"));
    XdsSettings {
        server: format!("127.0.0.1:{}", server.port),
        node_id: "envoy-ratelimit".into(),
        node_metadata: vec![("zone".into(), "a".into())],
        headers,
        max_message_bytes: Some(64 << 20),
        backoff: Backoff {
            initial: Duration::from_millis(50),
            max: Duration::from_millis(200),
            factor: 2.0,
            jitter: true,
        },
        // Dialled by address: the certificate is checked for the name
        // CONFIG_GRPC_XDS_SERVER_TLS_SAN gives.
        tls: Some(certs.client(Some("tls"), "envoy-gateway")),
        load_options: Default::default(),
    }
}

/// An in-process ratekeeper with no limits yet, and its xDS client started.
async fn subscribed(certs: &Certs, ads_server: &AdsServer) -> TestServer {
    let server = TestServer::start_with(
        Config::default(),
        None,
        Store::Memory(MemoryStore::new(Arc::new(SystemClock))),
    )
    .await;
    xds_client::spawn(settings(certs, ads_server), server.config.clone());
    server
}

/// The codes of `times` requests for `key=value` in `domain`.
async fn codes(client: &mut RlsClient, domain: &str, key: &str, times: usize) -> Vec<Code> {
    let mut codes = Vec::new();
    for _ in 0..times {
        let answer = client
            .should_rate_limit(request(domain, vec![descriptor(&[(key, "v")])]))
            .await
            .expect("answer")
            .into_inner();
        codes.push(answer.overall_code());
    }
    codes
}

// ---- in process -----------------------------------------------------------

#[tokio::test]
async fn the_first_snapshot_is_applied_acked_and_answers() {
    let certs = Certs::make();
    let ads = Ads::new();
    ads.publish("1", vec![domain("first-listener", "route", 2)]);
    let ads_server = AdsServer::start(&ads, certs.xds_server(), 0);
    let server = subscribed(&certs, &ads_server).await;

    let subscribe = ads
        .heard("a subscription", |r| r.response_nonce.is_empty())
        .await;
    assert_eq!(subscribe.type_url, TYPE_URL);
    assert_eq!(subscribe.version_info, "");
    assert!(subscribe.resource_names.is_empty(), "wildcard");
    let node = subscribe.node.expect("node");
    assert_eq!(node.id, "envoy-ratelimit");
    assert!(node.metadata.expect("metadata").fields.contains_key("zone"));
    let ack = ads.acked("1").await;
    assert_eq!(ack.response_nonce, "1");
    assert_eq!(
        ads.headers.lock().expect("headers")[0]
            .get("x-tenant")
            .map(|v| v.to_str().ok()),
        Some(Some("blue"))
    );

    let mut client = server.client().await;
    assert_eq!(
        codes(&mut client, "first-listener", "route", 3).await,
        [Code::Ok, Code::Ok, Code::OverLimit]
    );
    // What the admin API's /v1/config reports as the limits' version.
    assert_eq!(server.config.current().version(), Some("1"));
}

#[tokio::test]
async fn an_update_is_applied_without_dropping_requests() {
    let certs = Certs::make();
    let ads = Ads::new();
    ads.publish("1", vec![domain("d", "user", 1_000_000)]);
    let ads_server = AdsServer::start(&ads, certs.xds_server(), 0);
    let server = subscribed(&certs, &ads_server).await;
    ads.acked("1").await;

    // Requests run all along the update; each must find the rule in force.
    let (stop, stopped) = watch::channel(false);
    let mut hammers = Vec::new();
    for _ in 0..4 {
        let (mut client, stopped) = (server.client().await, stopped.clone());
        hammers.push(tokio::spawn(async move {
            let mut answered = 0;
            while !*stopped.borrow() {
                let answer = client
                    .should_rate_limit(request("d", vec![descriptor(&[("user", "a")])]))
                    .await
                    .expect("answer")
                    .into_inner();
                assert_eq!(answer.overall_code(), Code::Ok);
                let limit = answer.statuses[0]
                    .current_limit
                    .as_ref()
                    .expect("the rule answered");
                assert_eq!(limit.requests_per_unit, 1_000_000);
                answered += 1;
            }
            answered
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    ads.publish(
        "2",
        vec![domain("d", "user", 1_000_000), domain("e", "k", 1)],
    );
    ads.acked("2").await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.send_replace(true);
    let mut answered = 0;
    for hammer in hammers {
        answered += hammer.await.expect("no request failed");
    }
    assert!(answered > 20, "only {answered} requests ran");

    let mut client = server.client().await;
    assert_eq!(
        codes(&mut client, "e", "k", 2).await,
        [Code::Ok, Code::OverLimit]
    );
}

#[tokio::test]
async fn a_bad_snapshot_is_nacked_and_the_running_limits_stay() {
    let certs = Certs::make();
    let ads = Ads::new();
    ads.publish("1", vec![domain("d", "user", 2)]);
    let ads_server = AdsServer::start(&ads, certs.xds_server(), 0);
    let server = subscribed(&certs, &ads_server).await;
    ads.acked("1").await;

    // Version 2: a good domain and one whose limit has no unit.
    let mut bad = domain("broken", "user", 5);
    bad.descriptors[0].rate_limit.as_mut().expect("limit").unit = RateLimitUnit::Unknown as i32;
    ads.publish("2", vec![domain("d", "user", 100), bad]);
    let nack = ads.heard("a NACK", |r| r.error_detail.is_some()).await;
    // A NACK repeats the version in force and names what it refuses.
    assert_eq!(nack.version_info, "1");
    assert_eq!(nack.response_nonce, "2");
    let detail = nack.error_detail.expect("detail");
    assert_eq!(detail.code, 3, "INVALID_ARGUMENT");
    assert!(
        detail.message.contains("domain \"broken\"")
            && detail.message.contains("descriptors[0].rate_limit"),
        "{}",
        detail.message
    );

    // Version 1 answers, whole: d's limit is still 2, and `broken` unknown.
    let mut client = server.client().await;
    assert_eq!(
        codes(&mut client, "d", "user", 3).await,
        [Code::Ok, Code::Ok, Code::OverLimit]
    );
    let unknown = client
        .should_rate_limit(request("broken", vec![descriptor(&[("user", "v")])]))
        .await
        .expect("answer")
        .into_inner();
    assert!(unknown.statuses[0].current_limit.is_none());

    // The next good snapshot is taken.
    ads.publish("3", vec![domain("d", "user", 100)]);
    ads.acked("3").await;
    assert_eq!(codes(&mut client, "d", "user", 1).await, [Code::Ok]);
}

/// Envoy Gateway nests one descriptor a match of a rule: its deepest rule
/// (8 client selectors of 128 headers and 16 query parameters, a method,
/// a path and a source CIDR) is some 1,160 levels. prost's decoder stops at
/// 100, and such a rule made the whole snapshot refused, every domain's
/// limits with it. Now taken, and a request of as many entries answered;
/// past 2048 levels the snapshot is refused with a reason.
#[test]
fn a_rule_as_deep_as_envoy_gateways_deepest_is_taken() {
    // Building, encoding and dropping the messages here recurse once a
    // level (ratekeeper compiles them on a thread of its own).
    std::thread::Builder::new()
        .stack_size(64 << 20)
        .spawn(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_stack_size(64 << 20)
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(deep_rule())
        })
        .expect("thread")
        .join()
        .expect("the test");
}

/// A chain of `depth` descriptors as Envoy Gateway's translator writes a
/// rule's header matches (key and value its match's name), the deepest
/// with a limit of 2 a minute; and a request's entries reaching it.
fn chain(depth: usize) -> (RateLimitDescriptor, Vec<(String, String)>) {
    let name = |i: usize| format!("rule-0-match-{i}");
    let mut node = RateLimitDescriptor {
        key: name(depth - 1),
        value: name(depth - 1),
        ..domain("x", "x", 2).descriptors.remove(0)
    };
    for i in (0..depth - 1).rev() {
        node = RateLimitDescriptor {
            key: name(i),
            value: name(i),
            descriptors: vec![node],
            ..RateLimitDescriptor::default()
        };
    }
    (node, (0..depth).map(|i| (name(i), name(i))).collect())
}

async fn deep_rule() {
    const DEEPEST: usize = 1_160;
    let certs = Certs::make();
    let ads = Ads::new();
    let (deep, entries) = chain(DEEPEST);
    let mut gateway = domain("default/eg/http", "unused", 1);
    gateway.descriptors = vec![deep];
    ads.publish("1", vec![domain("d", "user", 2), gateway]);
    let ads_server = AdsServer::start(&ads, certs.xds_server(), 0);
    let server = subscribed(&certs, &ads_server).await;
    ads.acked("1").await;

    let mut client = server.client().await;
    let entries: Vec<(&str, &str)> = entries
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let mut deep_codes = Vec::new();
    for _ in 0..3 {
        let ask = request("default/eg/http", vec![descriptor(&entries)]);
        let answer = client
            .should_rate_limit(ask)
            .await
            .expect("answer")
            .into_inner();
        deep_codes.push(answer.overall_code());
    }
    assert_eq!(deep_codes, [Code::Ok, Code::Ok, Code::OverLimit]);
    assert_eq!(
        codes(&mut client, "d", "user", 3).await,
        [Code::Ok, Code::Ok, Code::OverLimit]
    );

    let mut too_deep = domain("default/eg/http", "unused", 1);
    too_deep.descriptors = vec![chain(2_049).0];
    ads.publish("2", vec![domain("d", "user", 100), too_deep]);
    let nack = ads.heard("a NACK", |r| r.error_detail.is_some()).await;
    let detail = nack.error_detail.expect("detail").message;
    assert!(
        detail.contains(
            "resources[1]: not a RateLimitConfig: descriptors nest deeper than 2048 levels"
        ),
        "{detail}"
    );
}

/// go-control-plane answers a NACK with the same snapshot at once (the
/// NACK names an older version than its snapshot's): refused again without
/// compiling, after a pause, the two do not loop flat out; a good snapshot
/// still gets through.
#[tokio::test]
async fn a_refused_snapshot_sent_again_is_refused_at_a_walk() {
    let certs = Certs::make();
    let ads = Ads::new();
    ads.publish("1", vec![domain("d", "user", 2)]);
    let ads_server = AdsServer::start(&ads, certs.xds_server(), 0);
    let _server = subscribed(&certs, &ads_server).await;
    ads.acked("1").await;

    ads.resends_on_nack.store(true, Ordering::SeqCst);
    let mut bad = domain("broken", "user", 5);
    bad.descriptors[0].rate_limit.as_mut().expect("limit").unit = RateLimitUnit::Unknown as i32;
    ads.publish("2", vec![bad]);
    ads.heard("a NACK", |r| r.error_detail.is_some()).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let nacks = |ads: &Ads| {
        let requests = ads.requests.lock().expect("requests");
        requests.iter().filter(|r| r.error_detail.is_some()).count()
    };
    let in_three_seconds = nacks(&ads);
    assert!(
        (2..=5).contains(&in_three_seconds),
        "{in_three_seconds} NACKs in 3 s"
    );
    let last = ads.requests.lock().expect("requests").last().cloned();
    let detail = last
        .and_then(|r| r.error_detail)
        .expect("the last request a NACK");
    assert!(detail.message.contains("broken"), "{}", detail.message);

    ads.publish("3", vec![domain("d", "user", 100)]);
    ads.acked("3").await;
}

#[tokio::test]
async fn the_client_redials_a_restarted_server_and_resyncs() {
    let certs = Certs::make();
    let ads = Ads::new();
    ads.publish("1", vec![domain("d", "user", 1)]);
    let mut ads_server = AdsServer::start(&ads, certs.xds_server(), 0);
    let port = ads_server.port;
    let server = subscribed(&certs, &ads_server).await;
    ads.acked("1").await;
    let mut client = server.client().await;
    assert_eq!(
        codes(&mut client, "d", "user", 2).await,
        [Code::Ok, Code::OverLimit]
    );

    // The server goes away: the limits in force keep answering.
    ads_server.stop();
    assert_eq!(codes(&mut client, "d", "user", 1).await, [Code::OverLimit]);

    // It comes back with its version counter restarted ("1" again) but
    // other limits: the client asks for everything again and takes them.
    ads.requests.lock().expect("requests").clear();
    ads.publish("1", vec![domain("d", "other", 1)]);
    let _restarted = AdsServer::start(&ads, certs.xds_server(), port);
    let resubscribe = ads
        .heard("a new subscription", |r| r.response_nonce.is_empty())
        .await;
    assert_eq!(
        resubscribe.version_info, "",
        "a new stream asks for everything"
    );
    ads.acked("1").await;
    assert_eq!(
        codes(&mut client, "d", "user", 1).await,
        [Code::Ok],
        "the old rule is gone"
    );
    assert_eq!(
        codes(&mut client, "d", "other", 2).await,
        [Code::Ok, Code::OverLimit]
    );
}

/// A server down when the client starts is reached a second or two after
/// it comes up (grpc-go's connection back-off, as theirs' blocking dial
/// waits), not a stream back-off later (10 s by default).
#[tokio::test]
async fn a_server_down_at_start_is_reached_soon_after_it_comes_up() {
    let certs = Certs::make();
    let ads = Ads::new();
    ads.publish("1", vec![domain("d", "user", 1)]);
    let port = common::free_port();
    let down = AdsServer {
        port,
        runtime: None,
    };
    let mut settings = settings(&certs, &down);
    settings.backoff = Backoff::default();
    let _loaded = xds_client::spawn(settings, SharedConfig::awaiting_first());
    // Its dials at 0 s and 1 s find nobody.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let up = Instant::now();
    let _server = AdsServer::start(&ads, certs.xds_server(), port);
    ads.acked("1").await;
    let after = up.elapsed();
    assert!(
        after < Duration::from_secs(4),
        "reached {after:?} after the server came up"
    );
}

#[tokio::test]
async fn a_server_that_never_speaks_http2_is_dropped_and_dialled_again() {
    // Takes connections, reads what comes, and answers nothing (a wrong
    // port, a stuck proxy): without a deadline on its preface, the stream
    // would wait for the first keepalive ping, 5.5 minutes on.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("address").port();
    let (accepted, mut dials) = mpsc::unbounded_channel();
    let silent = tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let _ = accepted.send(Instant::now());
            tokio::spawn(async move {
                let mut sink = tokio::io::sink();
                let _ = tokio::io::copy(&mut socket, &mut sink).await;
            });
        }
    });
    let unused = AdsServer {
        port,
        runtime: None,
    };
    let mut settings = settings(&Certs::make(), &unused);
    settings.tls = None;
    let _loaded = xds_client::spawn(settings, SharedConfig::awaiting_first());
    let first = tokio::time::timeout(Duration::from_secs(5), dials.recv())
        .await
        .expect("the client dials")
        .expect("a first connection");
    let second = tokio::time::timeout(Duration::from_secs(20), dials.recv())
        .await
        .expect("dialled again within the preface deadline and a back-off")
        .expect("a second connection");
    let waited = second - first;
    assert!(
        waited >= Duration::from_secs(9) && waited < Duration::from_secs(12),
        "dropped after 10 s without a preface: {waited:?}"
    );
    silent.abort();
}

#[tokio::test]
async fn a_snapshot_of_1000_domains_and_50000_descriptors_applies_within_a_second() {
    let certs = Certs::make();
    let ads = Ads::new();
    ads.publish("1", vec![domain("warm-up", "k", 1)]);
    let ads_server = AdsServer::start(&ads, certs.xds_server(), 0);
    let server = subscribed(&certs, &ads_server).await;
    ads.acked("1").await;

    let configs: Vec<RateLimitConfig> = (0..1_000)
        .map(|d| RateLimitConfig {
            name: format!("domain-{d}"),
            domain: format!("domain-{d}"),
            descriptors: (0..50)
                .map(|k| RateLimitDescriptor {
                    key: "route".into(),
                    value: format!("route-{k}"),
                    rate_limit: Some(RateLimitPolicy {
                        unit: RateLimitUnit::Second as i32,
                        requests_per_unit: 10 + k,
                        ..RateLimitPolicy::default()
                    }),
                    ..RateLimitDescriptor::default()
                })
                .collect(),
        })
        .collect();
    // The compiler's share, measured apart.
    let compiling = Instant::now();
    ratekeeper::config::xds::load(&configs).expect("compiles");
    let compile = compiling.elapsed();
    let started = Instant::now();
    ads.publish("2", configs);
    ads.acked("2").await;
    let took = started.elapsed();
    eprintln!("1,000 domains / 50,000 descriptors: published to ACKed in {took:?} (compiling alone: {compile:?})");
    // 1 s is the goal for an optimised build; an unoptimised one
    // (measured 0.5-0.9 s here, two cores shared) gets three times that:
    // still far below what a quadratic step would take.
    let bound = if cfg!(debug_assertions) { 3 } else { 1 };
    assert!(took < Duration::from_secs(bound), "took {took:?}");

    let mut client = server.client().await;
    let answer = client
        .should_rate_limit(request(
            "domain-999",
            vec![descriptor(&[("route", "route-49")])],
        ))
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(
        answer.statuses[0]
            .current_limit
            .as_ref()
            .expect("rule")
            .requests_per_unit,
        59
    );
}

// ---- the binary under Envoy Gateway's environment -------------------------

/// A gRPC client of ratekeeper's RLS port over TLS (as Envoy, with a
/// client certificate when `identity` is set).
async fn tls_client(
    addr: &str,
    certs: &Certs,
    identity: Option<&str>,
) -> Result<RlsClient, String> {
    // Envoy Gateway's Envoy sets no SNI; the certificate's SAN is
    // `*.envoy-gateway-system`.
    let tls = certs.client(identity, "envoy-ratelimit.envoy-gateway-system");
    let channel = xds_client::channel(addr, Some(tls)).await?;
    Ok(RateLimitServiceClient::new(channel))
}

/// Envoy Gateway's rate limit Deployment environment
/// (`internal/infrastructure/kubernetes/ratelimit/resource.go`), its paths
/// pointed at the test's files and ports.
fn envoy_gateway_env(
    certs: &Certs,
    root: &Path,
    xds_port: u16,
    redis: &RedisServer,
) -> Vec<(String, String)> {
    let cert = |name: &str| certs.path(name).display().to_string();
    // The mapping Envoy Gateway mounts there (ConfigMap
    // `statsd-exporter-config`): envoyproxy/ratelimit's default without the
    // response time's `scale: 0.001`.
    let mapper = root.join("statsd-exporter/conf.yaml");
    let default = include_str!("../src/default_mapper.yaml");
    std::fs::create_dir_all(root.join("statsd-exporter")).expect("mapper dir");
    std::fs::write(&mapper, default.replacen("    scale: 0.001\n", "", 1)).expect("mapper");
    [
        ("RUNTIME_ROOT", root.join("data").display().to_string()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".into()),
        ("RUNTIME_IGNOREDOTFILES", "true".into()),
        ("RUNTIME_WATCH_ROOT", "false".into()),
        ("LOG_LEVEL", "info".into()),
        ("USE_STATSD", "false".into()),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW".into()),
        (
            "CONFIG_GRPC_XDS_SERVER_URL",
            format!("localhost:{xds_port}"),
        ),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit".into()),
        ("GRPC_SERVER_USE_TLS", "true".into()),
        ("GRPC_SERVER_TLS_CERT", cert("tls.crt")),
        ("GRPC_SERVER_TLS_KEY", cert("tls.key")),
        ("GRPC_SERVER_TLS_CA_CERT", cert("ca.crt")),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true".into()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", cert("tls.crt")),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", cert("tls.key")),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", cert("ca.crt")),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true".into()),
        ("REDIS_SOCKET_TYPE", "tcp".into()),
        ("REDIS_URL", format!("127.0.0.1:{}", redis.port)),
        ("USE_PROMETHEUS", "true".into()),
        ("PROMETHEUS_ADDR", format!(":{}", common::free_port())),
        ("PROMETHEUS_MAPPER_YAML", mapper.display().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

#[tokio::test]
async fn the_binary_under_envoy_gateways_environment_answers_over_tls_from_xds_limits_in_redis() {
    let certs = Certs::make();
    let redis = RedisServer::start();
    let root = tempfile::tempdir().expect("root");
    let ads = Ads::new();
    let ads_server = AdsServer::start(&ads, certs.xds_server(), 0);
    let env = envoy_gateway_env(&certs, root.path(), ads_server.port, &redis);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    // Starts although nothing exists under RUNTIME_ROOT and the xDS server
    // has no snapshot yet (FORCE_START_WITHOUT_INITIAL_CONFIG).
    let ratekeeper = Ratekeeper::spawn_in(root.path(), &[], &env);

    let mut envoy = tls_client(&ratekeeper.grpc, &certs, Some("envoy"))
        .await
        .expect("TLS as Envoy");
    // Before any limits: an error, as there, so Envoy's failure_mode_deny
    // (Envoy Gateway's failClosed) decides.
    let before = envoy
        .should_rate_limit(request(
            "default/eg/http",
            vec![descriptor(&[("default/eg/route", "default/eg/route")])],
        ))
        .await
        .expect_err("no limits yet");
    assert_eq!(before.code(), tonic::Code::Unavailable, "{before:?}");
    assert_eq!(before.message(), "no rate limit configuration loaded");

    // Envoy Gateway's shape: the route's descriptor, its rule's under it.
    let rule = RateLimitConfig {
        name: "default/eg/http".into(),
        domain: "default/eg/http".into(),
        descriptors: vec![RateLimitDescriptor {
            key: "httproute/default/backend/rule/0/match/0/www_example_com".into(),
            value: "httproute/default/backend/rule/0/match/0/www_example_com".into(),
            descriptors: vec![RateLimitDescriptor {
                key: "rule-0-match-0".into(),
                value: "rule-0-match-0".into(),
                rate_limit: Some(RateLimitPolicy {
                    unit: RateLimitUnit::Hour as i32,
                    requests_per_unit: 3,
                    ..RateLimitPolicy::default()
                }),
                ..RateLimitDescriptor::default()
            }],
            ..RateLimitDescriptor::default()
        }],
    };
    ads.publish("1", vec![rule]);
    ads.acked("1").await;
    let route = "httproute/default/backend/rule/0/match/0/www_example_com";
    let ask = || {
        request(
            "default/eg/http",
            vec![descriptor(&[
                (route, route),
                ("rule-0-match-0", "rule-0-match-0"),
            ])],
        )
    };
    let mut answers = Vec::new();
    for _ in 0..4 {
        answers.push(
            envoy
                .should_rate_limit(ask())
                .await
                .expect("answer")
                .into_inner()
                .overall_code(),
        );
    }
    assert_eq!(answers, [Code::Ok, Code::Ok, Code::Ok, Code::OverLimit]);
    // The counter lives in Redis.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query(&mut redis.client().get_connection().expect("redis"))
        .expect("KEYS");
    assert!(
        keys.iter().any(|k| k.contains("default/eg/http")),
        "{keys:?}"
    );

    // GRPC_SERVER_TLS_CA_CERT checks the certificates clients present, and
    // requires none (envoyproxy/ratelimit ignores the name entirely).
    let mut anonymous = tls_client(&ratekeeper.grpc, &certs, None)
        .await
        .expect("TLS without a certificate");
    assert_eq!(
        anonymous
            .should_rate_limit(ask())
            .await
            .expect("answer")
            .into_inner()
            .overall_code(),
        Code::OverLimit
    );
    let foreign = Certs::make();
    let refused = match tls_client(&ratekeeper.grpc, &foreign, Some("stranger")).await {
        Err(e) => e,
        Ok(mut client) => match client.should_rate_limit(ask()).await {
            Err(status) => status.to_string(),
            Ok(_) => panic!("a certificate from another CA was accepted"),
        },
    };
    assert!(!refused.is_empty());

    // Loads are counted as the file watcher counts them: one good snapshot,
    // then a refused one (NACKed, the limits stay).
    ads.publish("2", vec![domain("default/eg/http", "", 1)]);
    ads.heard("a NACK", |r| r.error_detail.is_some()).await;
    let metrics = ratekeeper.metrics();
    // And under envoyproxy/ratelimit's names, with the labels Envoy
    // Gateway's dashboard and e2e tests query (4 asks as Envoy, 1 anonymous).
    let key1 = format!("{route}_{route}");
    let series = format!(
        "{{domain=\"default/eg/http\",key1=\"{key1}\",key2=\"rule-0-match-0_rule-0-match-0\"}}"
    );
    for expected in [
        "ratekeeper_config_load_success 1".to_owned(),
        "ratekeeper_config_load_error 1".to_owned(),
        "ratekeeper_config_load_failing 1".to_owned(),
        "ratelimit_service_config_load_success 1".to_owned(),
        "ratelimit_service_config_load_error 1".to_owned(),
        format!("ratelimit_service_rate_limit_total_hits{series} 5"),
        format!("ratelimit_service_rate_limit_within_limit{series} 3"),
        format!("ratelimit_service_rate_limit_near_limit{series} 1"),
        format!("ratelimit_service_rate_limit_over_limit{series} 2"),
    ] {
        assert!(metrics.contains(&expected), "{expected} in {metrics}");
    }
    // Envoy Gateway's startup, readiness and liveness probes.
    let health = common::http_call(&ratekeeper.http, "GET", "/healthcheck", "");
    assert_eq!((health.status, health.body.trim()), (200, "OK"));
    assert_eq!(
        envoy
            .should_rate_limit(ask())
            .await
            .expect("answer")
            .into_inner()
            .overall_code(),
        Code::OverLimit
    );
}

#[tokio::test]
async fn grpc_client_tls_cacert_and_san_require_a_matching_client_certificate() {
    let certs = Certs::make();
    let dir = tempfile::tempdir().expect("dir");
    std::fs::write(dir.path().join("limits.yaml"), "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 5}\n").expect("limits");
    let cert = |name: &str| certs.path(name).display().to_string();
    let env = |san: &str| {
        vec![
            ("GRPC_SERVER_USE_TLS", "true".to_owned()),
            ("GRPC_SERVER_TLS_CERT", cert("tls.crt")),
            ("GRPC_SERVER_TLS_KEY", cert("tls.key")),
            ("GRPC_CLIENT_TLS_CACERT", cert("ca.crt")),
            ("GRPC_CLIENT_TLS_SAN", san.to_owned()),
        ]
    };
    let ask = || request("d", vec![descriptor(&[("k", "v")])]);
    let answer = |client: Result<RlsClient, String>| async move {
        match client {
            Err(e) => Err(e),
            Ok(mut client) => client
                .should_rate_limit(ask())
                .await
                .map(|_| ())
                .map_err(|s| s.to_string()),
        }
    };

    let matching = env("envoy.envoy-gateway-system");
    let matching: Vec<(&str, &str)> = matching.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let server = Ratekeeper::spawn_with_env(dir.path(), &[], &matching);
    answer(tls_client(&server.grpc, &certs, Some("envoy")).await)
        .await
        .expect("a matching certificate");
    assert!(
        answer(tls_client(&server.grpc, &certs, None).await)
            .await
            .is_err(),
        "no certificate"
    );
    drop(server);

    let other = env("other.example");
    let other: Vec<(&str, &str)> = other.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let server = Ratekeeper::spawn_with_env(dir.path(), &[], &other);
    assert!(
        answer(tls_client(&server.grpc, &certs, Some("envoy")).await)
            .await
            .is_err(),
        "a certificate for another name"
    );
}

/// The xDS client's environment, mutual TLS to `ads_server`.
fn xds_env(certs: &Certs, ads_server: &AdsServer) -> Vec<(&'static str, String)> {
    let cert = |name: &str| certs.path(name).display().to_string();
    vec![
        ("CONFIG_TYPE", "GRPC_XDS_SOTW".to_owned()),
        (
            "CONFIG_GRPC_XDS_SERVER_URL",
            format!("localhost:{}", ads_server.port),
        ),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit".into()),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true".into()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", cert("tls.crt")),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", cert("tls.key")),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", cert("ca.crt")),
    ]
}

#[tokio::test]
async fn without_force_start_the_binary_serves_once_the_first_snapshot_is_in() {
    let certs = Certs::make();
    let root = tempfile::tempdir().expect("root");
    let ads = Ads::new();
    ads.publish("7", vec![domain("d", "user", 5)]);
    let ads_server = AdsServer::start(&ads, certs.xds_server(), 0);
    let env = xds_env(&certs, &ads_server);
    let mut env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    // Limits files mounted too (a chart's): xDS counts, and it says so.
    env.push(("CONFIG_DIR", "/nowhere/limits"));
    // Returns once the binary says it listens: after the first snapshot.
    let ratekeeper = Ratekeeper::spawn_in(root.path(), &[], &env);
    assert!(
        ratekeeper.logs().contains("CONFIG_DIR is not read"),
        "{}",
        ratekeeper.logs()
    );
    let answer = ratekeeper
        .client()
        .await
        .should_rate_limit(request("d", vec![descriptor(&[("user", "a")])]))
        .await
        .expect("answer")
        .into_inner();
    let limit = answer.statuses[0]
        .current_limit
        .as_ref()
        .expect("the snapshot's rule");
    assert_eq!(limit.requests_per_unit, 5);
}

#[tokio::test]
async fn health_waits_for_a_domain_with_healthy_with_at_least_one_config_loaded() {
    let certs = Certs::make();
    let root = tempfile::tempdir().expect("root");
    let ads = Ads::new();
    let ads_server = AdsServer::start(&ads, certs.xds_server(), 0);
    let mut env = xds_env(&certs, &ads_server);
    env.push(("FORCE_START_WITHOUT_INITIAL_CONFIG", "true".into()));
    env.push(("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", "true".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let ratekeeper = Ratekeeper::spawn_in(root.path(), &[], &env);
    let mut health = tonic_health::pb::health_client::HealthClient::new(ratekeeper.channel().await);
    let status =
        |health: &mut tonic_health::pb::health_client::HealthClient<tonic::transport::Channel>| {
            let mut health = health.clone();
            async move {
                health
                    .check(tonic_health::pb::HealthCheckRequest::default())
                    .await
                    .expect("health")
                    .into_inner()
                    .status
            }
        };
    // The in-memory store is up at once: only the missing domain keeps it
    // NOT_SERVING.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
    assert_eq!(status(&mut health).await, not_serving);

    ads.publish("1", vec![domain("d", "user", 5)]);
    ads.acked("1").await;
    common::until_serving(&mut health).await;

    // An empty snapshot: no domain again.
    ads.publish("2", Vec::new());
    ads.acked("2").await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while status(&mut health).await != not_serving {
        assert!(Instant::now() < deadline, "still SERVING without a domain");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn the_image_runs_bin_ratelimit_as_65534_and_sets_no_environment() {
    let dockerfile = std::fs::read_to_string("Dockerfile").expect("Dockerfile");
    let runtime = dockerfile
        .rsplit_once("\nFROM ")
        .map(|(_, last)| last)
        .expect("a runtime stage");
    let instructions: Vec<&str> = runtime
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert!(
        !instructions.iter().any(|l| l.starts_with("ENV ") || l.starts_with("ARG ")),
        "the image must not set environment (it would shadow RUNTIME_ROOT, GRPC_PORT, ...): {instructions:?}"
    );
    assert!(
        instructions.contains(&"USER 65534:65534"),
        "{instructions:?}"
    );
    assert!(
        instructions.contains(&"ENTRYPOINT [\"/bin/ratelimit\"]"),
        "{instructions:?}"
    );
    assert!(
        instructions
            .iter()
            .any(|l| l.starts_with("COPY --from=build") && l.ends_with(" /bin/ratelimit")),
        "{instructions:?}"
    );
}
