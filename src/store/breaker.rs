//! A circuit breaker in front of Redis: after `threshold` failures in a row
//! the store is not tried for a cool-down, so an outage costs each request
//! microseconds (the domain's failure mode) instead of a deadline. When the
//! cool-down ends one request goes through as a probe; the background health
//! probe also closes the breaker as soon as Redis answers.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Breaker {
    failures: AtomicU32,
    /// Milliseconds since `epoch` until which calls are refused.
    open_until: AtomicU64,
    threshold: u32,
    cooldown: Duration,
    epoch: Instant,
}

impl Breaker {
    pub fn new(threshold: u32, cooldown: Duration) -> Self {
        Breaker {
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            threshold: threshold.max(1),
            cooldown,
            epoch: Instant::now(),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Whether a call may go to the store now.
    pub fn allow(&self) -> bool {
        if self.failures.load(Ordering::Acquire) < self.threshold {
            return true;
        }
        let until = self.open_until.load(Ordering::Acquire);
        let now = self.now();
        // After the cool-down exactly one caller wins the probe.
        now >= until
            && self
                .open_until
                .compare_exchange(
                    until,
                    now + self.cooldown.as_millis() as u64,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    pub fn success(&self) {
        if self.failures.swap(0, Ordering::AcqRel) >= self.threshold {
            tracing::info!("Redis answers again: circuit closed");
        }
    }

    pub fn failure(&self) {
        let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if failures == self.threshold {
            self.open_until.store(
                self.now() + self.cooldown.as_millis() as u64,
                Ordering::Release,
            );
            tracing::warn!(failures, cooldown = ?self.cooldown, "Redis keeps failing: circuit open");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_probes_once_and_closes_on_success() {
        let b = Breaker::new(3, Duration::from_millis(30));
        for _ in 0..2 {
            b.failure();
            assert!(b.allow());
        }
        b.failure();
        assert!(!b.allow(), "open after 3 failures");
        std::thread::sleep(Duration::from_millis(40));
        assert!(b.allow(), "one probe after the cool-down");
        assert!(!b.allow(), "only one");
        b.success();
        assert!(b.allow() && b.allow(), "closed: every call may go");
    }
}
