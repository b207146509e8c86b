//! OpenTelemetry tracing of decisions: one span per sampled
//! `ShouldRateLimit` call, a child of the caller's span when the call
//! carries a W3C `traceparent` (Envoy propagates it), so ratekeeper's time
//! shows inside Envoy's trace; a child span for the store call. Spans are
//! exported over OTLP (HTTP protobuf or gRPC) by a background task
//! (`export`); settings under envoyproxy/ratelimit's names (`TRACING_*`,
//! `OTEL_EXPORTER_OTLP_ENDPOINT`).
//!
//! Cost: with tracing off, a request pays one branch ([`Tracer::begin`] on
//! `None`); an unsampled request pays the header parse or one random number
//! and allocates nothing.

mod context;
mod export;
pub mod shared;
mod span;

use std::sync::Arc;

use tokio::sync::{mpsc, Notify};
use tonic::metadata::MetadataMap;

pub use self::context::{new_span_id, parse_traceparent, random_u64, Parent, Ratio};
pub use self::span::{now_ns, DecisionSpan};
use crate::pb::otlp::resource::v1::Resource;
use crate::Result;

/// Finished decisions waiting for the exporter; more are dropped (counted
/// in `ratekeeper_trace_decisions_dropped`).
const QUEUE: usize = 4096;

/// How spans travel to the receiver (`TRACING_EXPORTER_PROTOCOL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// OTLP/HTTP with protobuf bodies (POST `…/v1/traces`).
    Http,
    /// OTLP/gRPC (`TraceService/Export`).
    Grpc,
}

/// Tracing settings.
#[derive(Debug, Clone)]
pub struct TraceSettings {
    pub service_name: String,
    /// Left out of the resource when empty.
    pub service_namespace: String,
    /// A random one when empty, as envoyproxy/ratelimit does.
    pub service_instance_id: String,
    /// Share of root traces sampled (0 to 1); a call with a parent follows
    /// the parent's sampled flag.
    pub sampling_rate: f64,
    /// The full URL spans are sent to (for HTTP, with `/v1/traces`).
    pub endpoint: String,
    pub protocol: Protocol,
}

/// Starts decision spans and hands finished ones to the exporter. Cheap to
/// clone; [`Tracer::default`] is off.
#[derive(Clone, Default)]
pub struct Tracer(Option<Arc<Inner>>);

struct Inner {
    ratio: Ratio,
    spans: mpsc::Sender<DecisionSpan>,
    /// Wakes the exporter when a batch is full.
    batch_ready: Arc<Notify>,
    dropped: metrics::Counter,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Tracer(on)"
        } else {
            "Tracer(off)"
        })
    }
}

impl Tracer {
    /// Starts the exporter task (on the current Tokio runtime).
    pub fn start(settings: &TraceSettings) -> Result<Tracer> {
        let (sender, receiver) = mpsc::channel(QUEUE);
        let exporter = export::Exporter::new(settings, resource(settings), receiver)?;
        let batch_ready = Arc::new(Notify::new());
        tokio::spawn(exporter.run(Arc::clone(&batch_ready)));
        tracing::info!(
            endpoint = %settings.endpoint,
            protocol = ?settings.protocol,
            sampling_rate = settings.sampling_rate,
            "tracing on"
        );
        Ok(Tracer(Some(Arc::new(Inner {
            ratio: Ratio::new(settings.sampling_rate),
            spans: sender,
            batch_ready,
            dropped: metrics::counter!("ratekeeper_trace_decisions_dropped"),
        }))))
    }

    /// A span for a call with these headers, when tracing is on and the
    /// call is sampled.
    #[inline]
    pub fn begin(&self, headers: &MetadataMap) -> Option<DecisionSpan> {
        self.0.as_ref()?.begin(headers)
    }

    /// Hands a finished span to the exporter, or drops it (counted) when
    /// the exporter is behind.
    pub fn finish(&self, mut span: DecisionSpan) {
        if let Some(inner) = &self.0 {
            span.end_ns = now_ns();
            if inner.spans.try_send(span).is_err() {
                inner.dropped.increment(1);
            } else if inner.spans.max_capacity() - inner.spans.capacity() >= export::MAX_BATCH {
                inner.batch_ready.notify_one();
            }
        }
    }
}

impl Inner {
    fn begin(&self, headers: &MetadataMap) -> Option<DecisionSpan> {
        let parent = headers
            .get("traceparent")
            .and_then(|value| parse_traceparent(value.as_bytes()));
        match parent {
            // Parent-based: the caller decided for the whole trace.
            Some(parent) => parent.sampled.then(|| {
                let mut span = DecisionSpan::new(parent.trace_id, Some(parent.span_id));
                span.trace_state = trace_state(headers);
                span
            }),
            None => {
                // The random half the sampler reads first: an unsampled
                // call draws one number.
                let low = context::random_u64();
                self.ratio
                    .samples_low(low)
                    .then(|| DecisionSpan::new(context::trace_id_with_low(low), None))
            }
        }
    }
}

/// The caller's `tracestate` (W3C), carried into its trace's spans: at
/// most 512 bytes of text, as the specification bounds it; else none.
fn trace_state(headers: &MetadataMap) -> String {
    let state = headers.get("tracestate").and_then(|v| v.to_str().ok());
    state
        .filter(|state| state.len() <= 512)
        .unwrap_or_default()
        .to_owned()
}

/// The resource every span is reported under.
fn resource(settings: &TraceSettings) -> Resource {
    let instance = if settings.service_instance_id.is_empty() {
        let random = context::new_trace_id();
        random.iter().map(|b| format!("{b:02x}")).collect()
    } else {
        settings.service_instance_id.clone()
    };
    let mut attributes = vec![
        span::text("service.name", settings.service_name.clone()),
        span::text("service.instance.id", instance),
    ];
    if !settings.service_namespace.is_empty() {
        attributes.push(span::text(
            "service.namespace",
            settings.service_namespace.clone(),
        ));
    }
    Resource {
        attributes,
        dropped_attributes_count: 0,
    }
}
