//! The exporter: a background task that drains finished spans from a
//! bounded channel, batches them, and sends each batch to the OTLP
//! receiver (OTLP/HTTP protobuf POST, or OTLP/gRPC `TraceService/Export`).
//! A failed batch is dropped and counted: tracing never slows decisions.

use std::time::Duration;

use hyper::header::{CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use prost::Message;
use std::sync::Arc;

use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, Notify};
use tonic::transport::{Channel, Endpoint};

use super::span::DecisionSpan;
use super::{Protocol, TraceSettings};
use crate::pb::otlp::collector::trace::v1::trace_service_client::TraceServiceClient;
use crate::pb::otlp::collector::trace::v1::ExportTraceServiceRequest;
use crate::pb::otlp::common::v1::InstrumentationScope;
use crate::pb::otlp::resource::v1::Resource;
use crate::pb::otlp::trace::v1::{ResourceSpans, ScopeSpans};
use crate::{Error, Result};

/// Most decisions in one export; a queue this long wakes the exporter.
pub(super) const MAX_BATCH: usize = 512;
/// How long spans wait in the queue at most (short of a full batch).
const FLUSH_AFTER: Duration = Duration::from_secs(1);
/// An export that takes longer is abandoned (the OTLP default).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where batches go.
enum Target {
    Http {
        uri: hyper::Uri,
        /// The `Host` header.
        authority: String,
        /// host:port to connect to (port 80 when the URL names none).
        address: String,
    },
    Grpc(TraceServiceClient<Channel>),
}

pub(super) struct Exporter {
    resource: Resource,
    target: Target,
    spans: mpsc::Receiver<DecisionSpan>,
}

impl Exporter {
    /// Checks the endpoint; connects lazily (the receiver may start later).
    pub(super) fn new(
        settings: &TraceSettings,
        resource: Resource,
        spans: mpsc::Receiver<DecisionSpan>,
    ) -> Result<Exporter> {
        let bad =
            |why: String| Error::Startup(format!("OTLP endpoint {:?}: {why}", settings.endpoint));
        let uri: hyper::Uri = settings
            .endpoint
            .parse()
            .map_err(|e| bad(format!("not a URL: {e}")))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad(
                "only http:// is supported (no TLS to the receiver: use a local collector)".into(),
            ));
        }
        let authority = uri
            .authority()
            .map(|a| a.to_string())
            .ok_or_else(|| bad("no host".into()))?;
        let target = match settings.protocol {
            Protocol::Http => Target::Http {
                address: match uri.port() {
                    Some(_) => authority.clone(),
                    None => format!("{authority}:80"),
                },
                uri,
                authority,
            },
            Protocol::Grpc => {
                let endpoint = Endpoint::from_shared(settings.endpoint.clone())
                    .map_err(|e| bad(e.to_string()))?
                    .connect_timeout(EXPORT_TIMEOUT);
                Target::Grpc(TraceServiceClient::new(endpoint.connect_lazy()))
            }
        };
        Ok(Exporter {
            resource,
            target,
            spans,
        })
    }

    /// Runs until every sender is gone.
    ///
    /// Sleeps between batches rather than waiting on the queue: a waiting
    /// receiver would make every finished span wake this task (a syscall
    /// on the deciding thread); a full batch wakes it early (`batch_ready`).
    pub(super) async fn run(mut self, batch_ready: Arc<Notify>) {
        let mut failing = false;
        loop {
            tokio::select! {
                () = tokio::time::sleep(FLUSH_AFTER) => {}
                () = batch_ready.notified() => {}
            }
            loop {
                let mut batch = Vec::new();
                let closed = loop {
                    match self.spans.try_recv() {
                        Ok(span) => batch.push(span),
                        Err(TryRecvError::Empty) => break false,
                        Err(TryRecvError::Disconnected) => break true,
                    }
                    if batch.len() == MAX_BATCH {
                        break false;
                    }
                };
                if !batch.is_empty() {
                    self.export(batch, &mut failing).await;
                }
                if closed {
                    return;
                }
                if self.spans.is_empty() {
                    break;
                }
            }
        }
    }

    async fn export(&mut self, batch: Vec<DecisionSpan>, failing: &mut bool) {
        let decisions = batch.len() as u64;
        let request = self.request(batch);
        let sent = tokio::time::timeout(EXPORT_TIMEOUT, self.send(request))
            .await
            .unwrap_or_else(|_| Err("timed out".into()));
        match sent {
            Ok(()) => {
                if *failing {
                    tracing::info!("trace export recovered");
                }
                *failing = false;
                metrics::counter!("ratekeeper_trace_decisions_exported").increment(decisions);
            }
            Err(error) => {
                // Once per outage, not once per batch.
                if !*failing {
                    tracing::warn!(%error, "trace export failed; spans are dropped until it works");
                }
                *failing = true;
                metrics::counter!("ratekeeper_trace_export_failures").increment(1);
            }
        }
    }

    fn request(&self, batch: Vec<DecisionSpan>) -> ExportTraceServiceRequest {
        let mut spans = Vec::with_capacity(batch.len() * 2);
        for decision in batch {
            decision.into_otlp(&mut spans);
        }
        ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(self.resource.clone()),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "ratekeeper".into(),
                        version: env!("CARGO_PKG_VERSION").into(),
                        ..InstrumentationScope::default()
                    }),
                    spans,
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            }],
        }
    }

    async fn send(
        &mut self,
        request: ExportTraceServiceRequest,
    ) -> std::result::Result<(), String> {
        match &mut self.target {
            Target::Http {
                uri,
                authority,
                address,
            } => post(uri, authority, address, request.encode_to_vec()).await,
            Target::Grpc(client) => client
                .export(request)
                .await
                .map(|_| ())
                .map_err(|status| format!("{:?}: {}", status.code(), status.message())),
        }
    }
}

/// One OTLP/HTTP POST on a fresh connection: a batch a second at most, so
/// keeping a connection alive buys little.
async fn post(
    uri: &hyper::Uri,
    authority: &str,
    address: &str,
    body: Vec<u8>,
) -> std::result::Result<(), String> {
    let stream = tokio::net::TcpStream::connect(address)
        .await
        .map_err(|e| format!("connect {address}: {e}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let request = hyper::Request::post(path)
        .header(HOST, authority)
        .header(CONTENT_TYPE, "application/x-protobuf")
        .body(axum::body::Body::from(body))
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    if response.status().is_success() {
        Ok(())
    } else {
        Err(format!("receiver answered {}", response.status()))
    }
}
