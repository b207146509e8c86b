//! The sending tasks: closed loop (one call in flight each, as fast as the
//! answers come) and open loop (a call per due request of the schedule,
//! latency measured from its intended send time).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::call::Caller;
use crate::request::RequestTemplate;
use crate::schedule::Schedule;
use crate::tally::{micros, Tally};

/// Times shared by every task of a run.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    /// Calls started (closed) or intended (open) from here on are measured.
    pub measure_from: Instant,
    /// No call is started after this.
    pub end: Instant,
}

/// Closed loop: one call in flight at a time until the window ends or the
/// request budget is spent.
pub async fn closed_loop_task(
    mut caller: Caller,
    mut template: RequestTemplate,
    window: Window,
    budget: Option<Arc<AtomicU64>>,
    timeout: Duration,
) -> Tally {
    let mut tally = Tally::new();
    loop {
        if let Some(left) = &budget {
            let taken =
                left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
            if taken.is_err() {
                break;
            }
        }
        let started = Instant::now();
        if started >= window.end {
            break;
        }
        let result = caller.call(template.next_request(), timeout).await;
        tally.calls += 1;
        if started >= window.measure_from {
            tally.record(&result, started.elapsed());
        }
    }
    tally
}

/// Open loop: takes the next due request, sends it, and measures from its
/// intended time. Requests still unsent at `hard_stop` are counted as unsent.
pub async fn open_loop_task(
    mut caller: Caller,
    mut template: RequestTemplate,
    schedule: Arc<Schedule>,
    window: Window,
    hard_stop: Instant,
    timeout: Duration,
) -> Tally {
    let mut tally = Tally::new();
    while let Some(intended) = schedule.next().await {
        let now = Instant::now();
        if now >= hard_stop {
            tally.unsent += 1;
            continue;
        }
        let result = caller.call(template.next_request(), timeout).await;
        tally.calls += 1;
        if intended >= window.measure_from {
            tally
                .send_lag
                .saturating_record(micros(now.saturating_duration_since(intended)));
            if result.is_ok() {
                tally.from_send.saturating_record(micros(now.elapsed()));
            }
            tally.record(&result, intended.elapsed());
        }
    }
    tally
}
