//! ratekeeper as an xDS client: limits delivered by an ADS server (Envoy
//! Gateway's, or any go-control-plane server) over
//! `AggregatedDiscoveryService/StreamAggregatedResources`, state of the
//! world, subscribed to envoyproxy/ratelimit's `RateLimitConfig`, as
//! envoyproxy/ratelimit's `CONFIG_TYPE=GRPC_XDS_SOTW` client is.
//!
//! Each response is every domain at once: compiled by [`super::xds::load`]
//! (the files' compiler) and swapped into the [`SharedConfig`] whole, then
//! ACKed (its version and nonce). One that does not compile is NACKed with
//! the reason in `error_detail`, and the running limits stay. A broken
//! stream is dialled again after a jittered exponential back-off (theirs'
//! `XDS_CLIENT_BACKOFF_*`), a failed dial again after grpc-go's connection
//! back-off (1 s growing to 120 s), and the
//! new stream asks for everything again (an empty version: the server's
//! versions may have restarted with it). A server that takes the
//! connection and sends no HTTP/2 preface within 10 s counts as broken
//! (`crate::preface`), as grpc-go counts it, rather than a stream that
//! waits for its first keepalive ping, 5.5 minutes on.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::{value::Kind, Any, Struct, Value};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tonic::codegen::http::Uri;
use tonic::metadata::MetadataMap;
use tonic::transport::Channel;

use super::watch::{record_load, SharedConfig};
use super::xds_decode::decode_config;
use super::{Config, LoadOptions};
use crate::pb::rls_conf::RateLimitConfig;
use crate::preface::Prefaced;

/// The resource type asked for.
pub const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// `google.rpc.Code.INVALID_ARGUMENT`, the code of a NACK's `error_detail`.
const INVALID_ARGUMENT: i32 = 3;

/// Where and how to subscribe.
#[derive(Debug, Clone)]
pub struct XdsSettings {
    /// The server, `host:port` (`CONFIG_GRPC_XDS_SERVER_URL`).
    pub server: String,
    /// `Node.id`: the server keys its snapshots by it.
    pub node_id: String,
    /// `Node.metadata`, string fields.
    pub node_metadata: Vec<(String, String)>,
    /// gRPC metadata sent with the stream.
    pub headers: MetadataMap,
    /// Largest response accepted (gRPC's default, 4 MiB, when `None`).
    pub max_message_bytes: Option<usize>,
    pub backoff: Backoff,
    /// TLS (mutual when the config presents a certificate); plain if `None`.
    pub tls: Option<ClientTls>,
    /// How a snapshot's messages make domains (`MERGE_DOMAIN_CONFIG`).
    pub load_options: LoadOptions,
}

/// The xDS client's TLS: the configuration and the name the server's
/// certificate must be valid for.
#[derive(Clone)]
pub struct ClientTls {
    pub config: Arc<rustls::ClientConfig>,
    pub server_name: ServerName<'static>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClientTls({:?})", self.server_name)
    }
}

/// The wait between two dials, as envoyproxy/ratelimit's (jpillora/backoff):
/// `initial · factor^attempt`, capped at `max`; with `jitter`, a random
/// point between `initial` and that. Their `XDS_CLIENT_BACKOFF_RANDOM_FACTOR`
/// is this `factor`: with its default 0.5 every wait is `initial`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    pub factor: f64,
    pub jitter: bool,
}

impl Default for Backoff {
    /// envoyproxy/ratelimit's defaults.
    fn default() -> Self {
        Backoff {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(60),
            factor: 0.5,
            jitter: true,
        }
    }
}

impl Backoff {
    /// The wait before dial number `attempt + 1`; `random` is in [0, 1).
    /// Zero (or negative) settings take jpillora/backoff's stand-ins: an
    /// initial wait of 100 ms, a max of 10 s, a factor of 2.
    pub fn delay(&self, attempt: u32, random: f64) -> Duration {
        let or = |value: Duration, zero: Duration| if value.is_zero() { zero } else { value };
        let max = or(self.max, Duration::from_secs(10));
        let initial = or(self.initial, Duration::from_millis(100)).as_secs_f64();
        let factor = if self.factor > 0.0 { self.factor } else { 2.0 };
        let mut wait = initial * factor.powi(attempt.min(1_000) as i32);
        if self.jitter {
            wait = random * (wait - initial) + initial;
        }
        if !wait.is_finite() || wait > max.as_secs_f64() {
            return max;
        }
        Duration::try_from_secs_f64(wait.max(initial)).unwrap_or(max)
    }
}

/// Starts the client on the current runtime. The receiver turns `true`
/// when the first snapshot has been applied.
pub fn spawn(settings: XdsSettings, shared: SharedConfig) -> watch::Receiver<bool> {
    let (loaded, receiver) = watch::channel(false);
    tokio::spawn(run(settings, shared, loaded));
    receiver
}

/// Subscribes forever: one stream at a time, re-dialled after a back-off.
pub async fn run(settings: XdsSettings, shared: SharedConfig, loaded: watch::Sender<bool>) {
    let mut attempt = 0;
    loop {
        let channel = dial(&settings).await;
        tracing::info!(server = %settings.server, node = %settings.node_id, "xDS: subscribing");
        let subscribed = subscribe(channel, &settings, &shared, &loaded).await;
        let Failure { error, answered } = match subscribed {
            Ok(never) => match never {},
            Err(failure) => failure,
        };
        if answered {
            attempt = 0;
        }
        tracing::warn!(server = %settings.server, %error, "xDS: stream ended");
        let wait = settings.backoff.delay(attempt, crate::random::unit());
        attempt = attempt.saturating_add(1);
        tracing::info!(?wait, "xDS: dialling again after a pause");
        tokio::time::sleep(wait).await;
    }
}

/// A connection to the server, dialled until one is made, as theirs dials
/// (grpc-go's blocking dial): a failed dial is tried again after
/// [`dial_delay`], so a server that comes up is reached within a second
/// or two, not after the stream back-off (10 s by default).
async fn dial(settings: &XdsSettings) -> Channel {
    let mut retries = 0;
    loop {
        match channel(&settings.server, settings.tls.clone()).await {
            Ok(channel) => return channel,
            Err(error) => {
                let wait = dial_delay(retries, crate::random::unit());
                tracing::warn!(server = %settings.server, %error, ?wait, "xDS: cannot connect; dialling again after a pause");
                retries = retries.saturating_add(1);
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// The wait after failed dial number `retries + 1`: grpc-go's connection
/// back-off with its defaults (`backoff.DefaultConfig`: 1 s, times 1.6 a
/// retry up to 120 s, then ±20%; the first wait is 1 s flat). `random` is
/// in [0, 1).
fn dial_delay(retries: u32, random: f64) -> Duration {
    const BASE_S: f64 = 1.0;
    const MAX_S: f64 = 120.0;
    if retries == 0 {
        return Duration::from_secs_f64(BASE_S);
    }
    let mut wait = BASE_S;
    for _ in 0..retries {
        if wait >= MAX_S {
            break;
        }
        wait *= 1.6;
    }
    let jittered = wait.min(MAX_S) * (1.0 + 0.2 * (2.0 * random - 1.0));
    Duration::from_secs_f64(jittered.max(0.0))
}

/// Why a stream ended, and whether it had answered before (then the
/// back-off starts over: the server was up).
struct Failure {
    error: String,
    answered: bool,
}

impl Failure {
    fn new(error: impl std::fmt::Display) -> Self {
        Failure {
            error: error.to_string(),
            answered: false,
        }
    }
}

/// One stream: subscribe, then apply and answer every response, until the
/// stream ends.
async fn subscribe(
    channel: Channel,
    settings: &XdsSettings,
    shared: &SharedConfig,
    loaded: &watch::Sender<bool>,
) -> Result<Infallible, Failure> {
    let mut client = AggregatedDiscoveryServiceClient::new(channel);
    if let Some(bytes) = settings.max_message_bytes {
        client = client.max_decoding_message_size(bytes);
    }
    let (requests, outgoing) = mpsc::channel(4);
    let _ = requests.try_send(request(settings, String::new(), String::new(), None));
    let mut call = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(outgoing));
    *call.metadata_mut() = settings.headers.clone();
    let mut responses = client
        .stream_aggregated_resources(call)
        .await
        .map_err(|e| Failure::new(format!("subscribe: {e}")))?
        .into_inner();
    let mut answers = Answers::default();
    let mut answered = false;
    let fail = |error: String, answered| Err(Failure { error, answered });
    loop {
        let response = match responses.message().await {
            Ok(Some(response)) => response,
            Ok(None) => return fail("the server ended the stream".into(), answered),
            Err(status) => return fail(format!("{status}"), answered),
        };
        answered = true;
        if response.type_url != TYPE_URL {
            tracing::warn!(type_url = %response.type_url, "xDS: ignoring a response of another type");
            continue;
        }
        let reason = answers
            .answer(&response, settings.load_options, shared)
            .await;
        if reason.is_none() {
            loaded.send_replace(true);
        }
        let reply = request(settings, answers.accepted.clone(), response.nonce, reason);
        if requests.send(reply).await.is_err() {
            return fail("the request stream closed".into(), answered);
        }
    }
}

/// How long a snapshot refused and sent again unchanged waits for its NACK.
const REFUSED_AGAIN_AFTER: Duration = Duration::from_secs(1);

/// What one stream made of its responses.
#[derive(Default)]
struct Answers {
    /// The version of the snapshot in force from this stream (a NACK
    /// repeats it).
    accepted: String,
    /// The last snapshot refused, to know it when it comes again.
    refused: Option<Refusal>,
}

struct Refusal {
    version: String,
    /// A hash of its resources.
    resources: u64,
    /// The NACK's reason.
    reason: String,
}

impl Answers {
    /// Applies `response`; `None` to ACK it, else the NACK's reason.
    async fn answer(
        &mut self,
        response: &DiscoveryResponse,
        options: LoadOptions,
        shared: &SharedConfig,
    ) -> Option<String> {
        if let Some(refusal) = &self.refused {
            if refusal.version == response.version_info
                && refusal.resources == resources_hash(response)
            {
                // Sent again at once after its NACK (go-control-plane does:
                // the NACK names an older version than its snapshot's).
                // Refused again without compiling or logging it, after a
                // pause, so that the two do not loop flat out.
                tokio::time::sleep(REFUSED_AGAIN_AFTER).await;
                return Some(refusal.reason.clone());
            }
        }
        match apply(response, options, shared).await {
            Ok(()) => {
                self.accepted.clone_from(&response.version_info);
                self.refused = None;
                None
            }
            Err(reason) => {
                self.refused = Some(Refusal {
                    version: response.version_info.clone(),
                    resources: resources_hash(response),
                    reason: reason.clone(),
                });
                Some(reason)
            }
        }
    }
}

/// A hash of a response's resources.
fn resources_hash(response: &DiscoveryResponse) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for any in &response.resources {
        (&any.type_url, &any.value).hash(&mut hasher);
    }
    hasher.finish()
}

/// Compiles one response and swaps it in; `Err` is the NACK's reason.
async fn apply(
    response: &DiscoveryResponse,
    options: LoadOptions,
    shared: &SharedConfig,
) -> Result<(), String> {
    let version = response.version_info.clone();
    let compiled = compile(response, options).await;
    record_load(compiled.is_ok());
    match compiled {
        Ok(config) => {
            tracing::info!(%version, domains = config.domain_names().len(), "xDS: limits applied");
            shared.replace(config.with_version(version));
            Ok(())
        }
        Err(error) => {
            let running = if shared.is_loaded() {
                "keeping the running ones"
            } else {
                "none in force yet"
            };
            tracing::error!(%version, %error, "xDS: limits refused (NACK); {running}");
            Err(error)
        }
    }
}

/// The stack of the thread compiling a snapshot: descriptors nest up to
/// [`super::xds_decode::MAX_DESCRIPTOR_DEPTH`] deep, and decoding and
/// compiling go down one call a level (a debug build takes some 16 MiB at
/// the deepest). Reserved, not used: only what a snapshot reaches is ever
/// touched.
const COMPILE_STACK_BYTES: usize = 64 << 20;

/// The response's resources compiled, off the runtime (a large snapshot
/// takes a while) on a thread of its own; `Err` is why not.
async fn compile(response: &DiscoveryResponse, options: LoadOptions) -> Result<Config, String> {
    let resources = response.resources.clone();
    let (done, compiled) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("xds-compile".into())
        .stack_size(COMPILE_STACK_BYTES)
        .spawn(move || {
            let config = decode(&resources).and_then(|messages| {
                super::xds::load_with(&messages, options).map_err(|e| e.to_string())
            });
            let _ = done.send(config);
        })
        .map_err(|e| format!("cannot start compiling: {e}"))?;
    compiled.await.map_err(|_| "compiling stopped".to_owned())?
}

/// The resources as `RateLimitConfig` messages.
fn decode(resources: &[Any]) -> Result<Vec<RateLimitConfig>, String> {
    resources
        .iter()
        .enumerate()
        .map(|(i, any)| {
            if any.type_url != TYPE_URL {
                return Err(format!(
                    "resources[{i}]: type {:?}, expected {TYPE_URL}",
                    any.type_url
                ));
            }
            decode_config(any.value.as_slice())
                .map_err(|e| format!("resources[{i}]: not a RateLimitConfig: {e}"))
        })
        .collect()
}

/// A subscription request: the first one, an ACK, or (with `error`) a NACK.
fn request(
    settings: &XdsSettings,
    version_info: String,
    response_nonce: String,
    error: Option<String>,
) -> DiscoveryRequest {
    let fields = settings
        .node_metadata
        .iter()
        .map(|(k, v)| {
            let value = Value {
                kind: Some(Kind::StringValue(v.clone())),
            };
            (k.clone(), value)
        })
        .collect();
    DiscoveryRequest {
        version_info,
        node: Some(Node {
            id: settings.node_id.clone(),
            metadata: Some(Struct { fields }),
            ..Node::default()
        }),
        type_url: TYPE_URL.into(),
        response_nonce,
        error_detail: error.map(|message| RpcStatus {
            code: INVALID_ARGUMENT,
            message,
            details: Vec::new(),
        }),
        ..DiscoveryRequest::default()
    }
}

/// A gRPC channel to `server` (`host:port`, or as grpc-go's target
/// `dns:///host:port`), over TLS when `tls` is set.
pub async fn channel(server: &str, tls: Option<ClientTls>) -> Result<Channel, String> {
    tonic::transport::Endpoint::from_shared(format!("http://{}", address(server)))
        .map_err(|e| format!("bad server address {server:?}: {e}"))?
        .connect_timeout(SERVER_PREFACE_TIMEOUT)
        // An xDS stream can stay silent for days: pings find a dead peer.
        // grpc-go servers (Envoy Gateway's) refuse pings more often than
        // every 5 minutes by default.
        .http2_keep_alive_interval(Duration::from_secs(330))
        .keep_alive_timeout(Duration::from_secs(20))
        .tcp_keepalive(Some(Duration::from_secs(60)))
        .connect_with_connector(Connector { tls })
        .await
        .map_err(|e| format!("cannot connect to {server}: {}", error_chain(&e)))
}

/// `host:port` of a server given as that or as a grpc-go target.
fn address(server: &str) -> &str {
    ["dns:///", "passthrough:///"]
        .iter()
        .find_map(|scheme| server.strip_prefix(scheme))
        .unwrap_or(server)
}

/// A transport error with its causes (tonic's own says only "transport error").
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Any connection the channel can speak HTTP/2 over.
trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// Dials the server: TCP, then TLS when configured.
#[derive(Clone)]
struct Connector {
    tls: Option<ClientTls>,
}

/// How long the server has, once connected, to send its HTTP/2 preface
/// (a SETTINGS frame: at least a frame header's 9 bytes); as the connect
/// timeout, which grpc-go's wait for it shares.
const SERVER_PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection to the server, that fails if it sends no preface in time.
type Connection = TokioIo<Prefaced<Box<dyn Io>>>;

type Connecting = Pin<Box<dyn Future<Output = std::io::Result<Connection>> + Send>>;

impl tonic::codegen::Service<Uri> for Connector {
    type Response = Connection;
    type Error = std::io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Connecting {
        let tls = self.tls.clone();
        Box::pin(async move {
            let authority = uri.authority().map(|a| a.to_string()).unwrap_or_default();
            let tcp = TcpStream::connect(authority.as_str()).await?;
            let _ = tcp.set_nodelay(true);
            let stream: Box<dyn Io> = match tls {
                None => Box::new(tcp),
                Some(tls) => {
                    let connector = tokio_rustls::TlsConnector::from(tls.config);
                    Box::new(connector.connect(tls.server_name, tcp).await?)
                }
            };
            Ok(TokioIo::new(Prefaced::new(
                stream,
                SERVER_PREFACE_TIMEOUT,
                9,
                "the server sent no HTTP/2 preface within 10 s of connecting: is it an xDS \
                 server, and does it speak TLS where CONFIG_GRPC_XDS_SERVER_USE_TLS is set?",
            )))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{address, dial_delay, Backoff};
    use std::time::Duration;

    #[test]
    fn a_grpc_go_target_names_its_host_and_port() {
        assert_eq!(address("dns:///xds.example:18000"), "xds.example:18000");
        assert_eq!(address("passthrough:///10.0.0.1:18000"), "10.0.0.1:18000");
        assert_eq!(address("xds.example:18000"), "xds.example:18000");
    }

    #[test]
    fn the_back_off_grows_by_its_factor_up_to_its_cap_with_jitter_above_the_initial_wait() {
        let growing = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(1),
            factor: 2.0,
            jitter: false,
        };
        let waits: Vec<u128> = (0..6).map(|n| growing.delay(n, 0.5).as_millis()).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1000, 1000]);
        let jittered = Backoff {
            jitter: true,
            ..growing
        };
        assert_eq!(jittered.delay(2, 0.0), Duration::from_millis(100));
        assert_eq!(jittered.delay(2, 0.5), Duration::from_millis(250));
        assert_eq!(jittered.delay(u32::MAX, 0.99), Duration::from_secs(1));
        // envoyproxy/ratelimit's defaults: a factor below 1 keeps every wait
        // at the initial one (10 s).
        for n in 0..5 {
            assert_eq!(Backoff::default().delay(n, 0.7), Duration::from_secs(10));
        }
    }

    /// grpc-go's connection back-off: 1 s, then 1.6 times more a retry up
    /// to 120 s, each but the first within 20% either way.
    #[test]
    fn a_failed_dial_waits_as_grpc_gos_does() {
        let middle: Vec<u128> = (0..14).map(|n| dial_delay(n, 0.5).as_millis()).collect();
        assert_eq!(
            middle,
            [
                1000, 1600, 2560, 4096, 6553, 10485, 16777, 26843, 42949, 68719, 109951, 120000,
                120000, 120000
            ]
        );
        assert_eq!(
            dial_delay(0, 0.0),
            Duration::from_secs(1),
            "no jitter at first"
        );
        assert_eq!(dial_delay(2, 0.0).as_millis(), 2048);
        assert_eq!(dial_delay(u32::MAX, 0.999_999).as_millis(), 143_999);
    }

    /// Zero settings would dial flat out: they take jpillora/backoff's
    /// stand-ins (100 ms, 10 s, a factor of 2), as theirs.
    #[test]
    fn a_zero_back_off_setting_takes_the_stand_in() {
        let zero = Backoff {
            initial: Duration::ZERO,
            max: Duration::ZERO,
            factor: 0.0,
            jitter: false,
        };
        let waits: Vec<u128> = (0..9).map(|n| zero.delay(n, 0.5).as_millis()).collect();
        assert_eq!(
            waits,
            [100, 200, 400, 800, 1600, 3200, 6400, 10_000, 10_000]
        );
    }
}
