//! A store call shared by several decisions (the Redis batcher joins
//! concurrent requests into one script call): the call is one span, in the
//! trace of the first sampled decision it carried; every other sampled
//! decision it carried links to it instead of repeating it.
//!
//! The decision's side sets [`STORE_CALL`] around its store call (only
//! when sampled); the batcher reads it, and writes back the call it made.
//! A task-local keeps the store's signatures unchanged: an unsampled
//! request costs the batcher one failed lookup.

use std::cell::Cell;

tokio::task_local! {
    /// The sampled decision whose store call runs in this task.
    pub static STORE_CALL: StoreCallTrace;
}

/// A span by its ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanRef {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
}

/// The decision's store span, and the shared call that carried it.
#[derive(Debug)]
pub struct StoreCallTrace {
    pub store_span: SpanRef,
    pub shared: Cell<Option<SharedCall>>,
}

/// One store call made for several requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedCall {
    /// The call's span: in the trace of `owner`.
    pub span: SpanRef,
    /// The store span of the decision whose trace holds the call.
    pub owner: SpanRef,
    pub start_ns: u64,
    pub end_ns: u64,
    /// Requests and checks the call carried.
    pub requests: usize,
    pub checks: usize,
}

/// The sampled decision whose store call runs in this task, if any.
pub fn current() -> Option<SpanRef> {
    STORE_CALL.try_with(|t| t.store_span).ok()
}

/// Tells the running decision which shared call carried it.
pub fn carried_by(call: SharedCall) {
    let _ = STORE_CALL.try_with(|t| t.shared.set(Some(call)));
}
