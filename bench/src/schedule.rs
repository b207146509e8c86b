//! The open loop's schedule on one thread: when each of its requests is
//! due, handed to the sending tasks as permits the [`crate::pacer`] adds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

/// One thread's open-loop schedule: its `k`-th request is due at
/// `first + k * interval`, for the `total` requests due before the run's
/// end (thread `t` of `T` takes requests `t, t + T, ...` of the whole run's
/// schedule). The pacer adds a permit to `due` as each request falls due;
/// the task that takes a permit claims the next request.
#[derive(Debug)]
pub struct Schedule {
    first: Instant,
    interval: Duration,
    pub total: u64,
    due: Semaphore,
    claimed: AtomicU64,
}

impl Schedule {
    /// Thread `thread` of `threads` sharing `rate` requests per second from
    /// `start` until `end`.
    pub fn new(start: Instant, end: Instant, rate: f64, thread: usize, threads: usize) -> Self {
        let threads = threads.max(1);
        let mut schedule = Schedule {
            first: start + Duration::from_secs_f64(thread as f64 / rate),
            interval: Duration::from_secs_f64(threads as f64 / rate),
            total: 0,
            due: Semaphore::new(0),
            claimed: AtomicU64::new(0),
        };
        let span = end.saturating_duration_since(schedule.first);
        let mut total = (span.as_secs_f64() / schedule.interval.as_secs_f64()) as u64;
        // The estimate may be off by one either way where the division
        // rounds: settle it on the due times themselves.
        while schedule.due_at(total) < end {
            total += 1;
        }
        while total > 0 && schedule.due_at(total - 1) >= end {
            total -= 1;
        }
        schedule.total = total;
        schedule
    }

    /// When this thread's request `k` is due.
    pub fn due_at(&self, k: u64) -> Instant {
        self.first + self.interval.mul_f64(k as f64)
    }

    /// Lets `n` more tasks claim a request.
    pub fn release(&self, n: usize) {
        self.due.add_permits(n);
    }

    /// Wakes every waiting task with `None`: for a pacer that failed, so no
    /// task hangs on it.
    pub fn abandon(&self) {
        self.due.close();
    }

    /// Waits for a due request; returns its intended send time, or `None`
    /// once the schedule is over.
    pub async fn next(&self) -> Option<Instant> {
        let permit = self.due.acquire().await.ok()?;
        permit.forget();
        let k = self.claimed.fetch_add(1, Ordering::Relaxed);
        (k < self.total).then(|| self.due_at(k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_schedules_interleave_into_the_whole_schedule() {
        let start = Instant::now();
        let end = start + Duration::from_millis(10);
        let rate = 1_000.0;
        let mut due: Vec<Duration> = (0..3)
            .flat_map(|thread| {
                let schedule = Schedule::new(start, end, rate, thread, 3);
                let total = schedule.total;
                (0..total).map(move |k| schedule.due_at(k) - start)
            })
            .collect();
        due.sort();
        let whole: Vec<Duration> = (0..10).map(Duration::from_millis).collect();
        assert_eq!(due.len(), whole.len());
        for (got, want) in due.iter().zip(&whole) {
            let off = got.abs_diff(*want);
            assert!(off < Duration::from_micros(1), "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn tasks_claim_each_due_request_once_then_stop() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let start = Instant::now();
            let schedule = Schedule::new(start, start + Duration::from_millis(5), 1_000.0, 0, 1);
            assert_eq!(schedule.total, 5);
            // What the pacer hands out: every request, then one per task.
            schedule.release(5 + 2);
            let mut claimed = Vec::new();
            while let Some(at) = schedule.next().await {
                claimed.push(at - start);
            }
            assert_eq!(claimed.len(), 5);
            assert_eq!(schedule.next().await, None, "the second task stops too");
        });
    }
}
