//! What a sampled decision records (its span and the store call's child
//! span), and their OTLP form. The request path only fills plain fields;
//! the exporter task builds the protobuf.

use std::time::{SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

use crate::pb::otlp::common::v1::{any_value, AnyValue, KeyValue};
use crate::pb::otlp::trace::v1::span::SpanKind;
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
}

impl DecisionSpan {
    pub(super) fn new(trace_id: [u8; 16], parent: Option<[u8; 8]>) -> DecisionSpan {
        DecisionSpan {
            trace_id,
            span_id: super::context::new_span_id(),
            parent,
            start_ns: now_ns(),
            end_ns: 0,
            domain: String::new(),
            descriptors: 0,
            outcome: "",
            store: "",
            answered_by: "store",
            error: None,
            store_call: None,
        }
    }

    /// The store `kind` was asked `checks` checks from `start_ns` until
    /// now; `error` when it failed.
    pub fn store_call(
        &mut self,
        kind: &'static str,
        checks: usize,
        start_ns: u64,
        error: Option<String>,
    ) {
        self.store = kind;
        self.store_call = Some(StoreCall {
            span_id: super::context::new_span_id(),
            start_ns,
            end_ns: now_ns(),
            checks,
            error,
        });
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
                "ERROR"
            }
        };
    }

    /// Who gave the outcomes when the store did not: `cache`, or the
    /// failure mode's name.
    pub fn answered_by(&mut self, who: &'static str) {
        self.answered_by = who;
    }

    /// The OTLP spans: the decision, then its store call.
    pub(super) fn into_otlp(self, out: &mut Vec<Span>) {
        let mut attributes = vec![
            text("ratelimit.domain", self.domain),
            int("ratelimit.descriptors", self.descriptors as i64),
            text("ratelimit.outcome", self.outcome.into()),
            text("ratelimit.answered_by", self.answered_by.into()),
        ];
        if !self.store.is_empty() {
            attributes.push(text("ratelimit.store", self.store.into()));
        }
        out.push(Span {
            trace_id: self.trace_id.to_vec(),
            span_id: self.span_id.to_vec(),
            parent_span_id: self.parent.map(|p| p.to_vec()).unwrap_or_default(),
            flags: 1,
            name: "ShouldRateLimit".into(),
            kind: SpanKind::Server as i32,
            start_time_unix_nano: self.start_ns,
            end_time_unix_nano: self.end_ns,
            attributes,
            status: status_of(self.error),
            ..Span::default()
        });
        if let Some(call) = self.store_call {
            out.push(Span {
                trace_id: self.trace_id.to_vec(),
                span_id: call.span_id.to_vec(),
                parent_span_id: self.span_id.to_vec(),
                flags: 1,
                name: "store.apply".into(),
                kind: SpanKind::Client as i32,
                start_time_unix_nano: call.start_ns,
                end_time_unix_nano: call.end_ns,
                attributes: vec![
                    text("ratelimit.store", self.store.into()),
                    int("ratelimit.checks", call.checks as i64),
                ],
                status: status_of(call.error),
                ..Span::default()
            });
        }
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
