//! What a sampled decision records (its span and the store call's child
//! span), and their OTLP form. The request path only fills plain fields;
//! the exporter task builds the protobuf.

use std::time::{SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

use super::shared::{SharedCall, SpanRef};
use crate::pb::otlp::common::v1::{any_value, AnyValue, KeyValue};
use crate::pb::otlp::trace::v1::span::{Link, SpanKind};
use crate::pb::otlp::trace::v1::{status, Span, Status};

/// Nanoseconds since the Unix epoch, as OTLP stamps spans.
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// One sampled `ShouldRateLimit` decision.
#[derive(Debug)]
pub struct DecisionSpan {
    pub(super) trace_id: [u8; 16],
    pub(super) span_id: [u8; 8],
    /// The caller's span (Envoy's), when the call carried a `traceparent`.
    pub(super) parent: Option<[u8; 8]>,
    /// The caller's `tracestate`, given to every span of the decision.
    pub(super) trace_state: String,
    pub(super) start_ns: u64,
    pub(super) end_ns: u64,
    pub(super) domain: String,
    pub(super) descriptors: usize,
    /// `OK`, `OVER_LIMIT` or `ERROR` (the call failed).
    pub(super) outcome: &'static str,
    /// `memory`, `redis`, `cluster`, … (the store's kind).
    pub(super) store: &'static str,
    /// `store`, `cache` (the over-limit cache), or the failure mode that
    /// answered while the store failed.
    pub(super) answered_by: &'static str,
    pub(super) error: Option<String>,
    /// The call's gRPC status code (0: OK).
    pub(super) grpc_code: i32,
    pub(super) store_call: Option<StoreCall>,
}

/// The store call of a decision, a child span of it.
#[derive(Debug)]
pub struct StoreCall {
    span_id: [u8; 8],
    start_ns: u64,
    end_ns: u64,
    checks: usize,
    error: Option<String>,
    shared: Option<SharedCall>,
}

impl DecisionSpan {
    pub(super) fn new(trace_id: [u8; 16], parent: Option<[u8; 8]>) -> DecisionSpan {
        DecisionSpan {
            trace_id,
            span_id: super::context::new_span_id(),
            parent,
            trace_state: String::new(),
            start_ns: now_ns(),
            end_ns: 0,
            domain: String::new(),
            descriptors: 0,
            outcome: "",
            store: "",
            answered_by: "store",
            error: None,
            grpc_code: 0,
            store_call: None,
        }
    }

    /// Starts the store call's child span: its ids, for the store to link
    /// a shared call to.
    pub fn begin_store_call(&mut self) -> SpanRef {
        let call = StoreCall {
            span_id: super::context::new_span_id(),
            start_ns: now_ns(),
            end_ns: 0,
            checks: 0,
            error: None,
            shared: None,
        };
        let ids = SpanRef {
            trace_id: self.trace_id,
            span_id: call.span_id,
        };
        self.store_call = Some(call);
        ids
    }

    /// Ends the store call begun last: the store `kind` was asked `checks`
    /// checks; `error` when it failed; `shared` when a call made for
    /// several requests carried them.
    pub fn end_store_call(
        &mut self,
        kind: &'static str,
        checks: usize,
        error: Option<String>,
        shared: Option<SharedCall>,
    ) {
        self.store = kind;
        if let Some(call) = &mut self.store_call {
            call.end_ns = now_ns();
            call.checks = checks;
            call.error = error;
            call.shared = shared;
        }
    }

    /// The call's domain, its descriptor count and its answer.
    pub fn decided(
        &mut self,
        request: &RateLimitRequest,
        result: &Result<RateLimitResponse, tonic::Status>,
    ) {
        self.domain.clone_from(&request.domain);
        self.descriptors = request.descriptors.len();
        self.outcome = match result {
            Ok(response) if response.overall_code == Code::OverLimit as i32 => "OVER_LIMIT",
            Ok(_) => "OK",
            Err(status) => {
                self.error = Some(format!("{:?}: {}", status.code(), status.message()));
                self.grpc_code = status.code() as i32;
                "ERROR"
            }
        };
    }

    /// Who gave the outcomes when the store did not: `cache`, or the
    /// failure mode's name.
    pub fn answered_by(&mut self, who: &'static str) {
        self.answered_by = who;
    }

    /// The OTLP spans, named as envoyproxy/ratelimit's: the call's
    /// (otelgrpc's name and `rpc.*` attributes), its `ShouldRateLimit
    /// Execution` child (with `domain`), and under that the store call.
    pub(super) fn into_otlp(self, out: &mut Vec<Span>) {
        let mut attributes = vec![
            text("rpc.system", "grpc".into()),
            text("rpc.service", RLS_SERVICE.into()),
            text("rpc.method", "ShouldRateLimit".into()),
            int("rpc.grpc.status_code", i64::from(self.grpc_code)),
            text("ratelimit.domain", self.domain.clone()),
            int("ratelimit.descriptors", self.descriptors as i64),
            text("ratelimit.outcome", self.outcome.into()),
            text("ratelimit.answered_by", self.answered_by.into()),
        ];
        if !self.store.is_empty() {
            attributes.push(text("ratelimit.store", self.store.into()));
        }
        let status = status_of(self.error);
        out.push(Span {
            trace_id: self.trace_id.to_vec(),
            span_id: self.span_id.to_vec(),
            parent_span_id: self.parent.map(|p| p.to_vec()).unwrap_or_default(),
            flags: 1,
            trace_state: self.trace_state.clone(),
            name: format!("{RLS_SERVICE}/ShouldRateLimit"),
            kind: SpanKind::Server as i32,
            start_time_unix_nano: self.start_ns,
            end_time_unix_nano: self.end_ns,
            attributes,
            status: status.clone(),
            ..Span::default()
        });
        // Its id made from the call's, here, so that the request path
        // draws no more random ids than before.
        let execution_id = execution_span_id(self.span_id);
        out.push(Span {
            trace_id: self.trace_id.to_vec(),
            span_id: execution_id.to_vec(),
            parent_span_id: self.span_id.to_vec(),
            flags: 1,
            trace_state: self.trace_state.clone(),
            name: "ShouldRateLimit Execution".into(),
            kind: SpanKind::Internal as i32,
            start_time_unix_nano: self.start_ns,
            end_time_unix_nano: self.end_ns,
            attributes: vec![text("domain", self.domain)],
            status,
            ..Span::default()
        });
        if let Some(call) = self.store_call {
            let ids = (self.trace_id, execution_id);
            call.into_otlp(ids, &self.trace_state, self.store, out);
        }
    }
}

/// The service whose method the call span names, as otelgrpc names it.
const RLS_SERVICE: &str = "envoy.service.ratelimit.v3.RateLimitService";

/// The `ShouldRateLimit Execution` span's id: the call span's, its top
/// bit flipped (distinct from it, and from any other id but by a 2^-63
/// chance).
fn execution_span_id(call: [u8; 8]) -> [u8; 8] {
    let mut id = call;
    id[0] ^= 0x80;
    if id == [0; 8] {
        id[7] = 1;
    }
    id
}

impl StoreCall {
    /// The store call's span, named as theirs on Redis (`Redis Pipeline
    /// Execution`); when a shared call carried it, that call's span too
    /// if this decision owns it, else a link to it.
    fn into_otlp(
        self,
        (trace_id, parent): ([u8; 16], [u8; 8]),
        trace_state: &str,
        store: &str,
        out: &mut Vec<Span>,
    ) {
        let mut attributes = vec![
            text("ratelimit.store", store.into()),
            int("ratelimit.checks", self.checks as i64),
        ];
        let mut links = Vec::new();
        if let Some(shared) = self.shared {
            attributes.push(int(
                "ratelimit.shared_call.requests",
                shared.requests as i64,
            ));
            if shared.owner.span_id == self.span_id {
                out.push(shared_call_span(&shared));
            } else {
                links.push(Link {
                    trace_id: shared.span.trace_id.to_vec(),
                    span_id: shared.span.span_id.to_vec(),
                    flags: 1,
                    ..Link::default()
                });
            }
        }
        let name = match store {
            "memory" => "Memory Store Execution",
            _ => "Redis Pipeline Execution",
        };
        out.push(Span {
            trace_id: trace_id.to_vec(),
            span_id: self.span_id.to_vec(),
            trace_state: trace_state.to_owned(),
            parent_span_id: parent.to_vec(),
            flags: 1,
            name: name.into(),
            kind: SpanKind::Client as i32,
            start_time_unix_nano: self.start_ns,
            end_time_unix_nano: self.end_ns,
            attributes,
            links,
            status: status_of(self.error),
            ..Span::default()
        });
    }
}

/// The one span of a call made for several requests, a child of its
/// owner's store span.
fn shared_call_span(shared: &SharedCall) -> Span {
    Span {
        trace_id: shared.span.trace_id.to_vec(),
        span_id: shared.span.span_id.to_vec(),
        parent_span_id: shared.owner.span_id.to_vec(),
        flags: 1,
        name: "redis.shared_call".into(),
        kind: SpanKind::Client as i32,
        start_time_unix_nano: shared.start_ns,
        end_time_unix_nano: shared.end_ns,
        attributes: vec![
            int("ratelimit.shared_call.requests", shared.requests as i64),
            int("ratelimit.checks", shared.checks as i64),
        ],
        ..Span::default()
    }
}

fn status_of(error: Option<String>) -> Option<Status> {
    error.map(|message| Status {
        message,
        code: status::StatusCode::Error as i32,
    })
}

/// A string attribute.
pub(super) fn text(key: &str, value: String) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(value)),
        }),
    }
}

fn int(key: &str, value: i64) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue {
            value: Some(any_value::Value::IntValue(value)),
        }),
    }
}
