//! Paces a log line that a failure repeats for every request (the store
//! down while thousands of requests a second meet it), or for every retry
//! of an outage (reconnects, health probes): the first of each second (or
//! of each period of [`Paced::every`]) is written, saying how many were
//! left out before it.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::clock::{Clock, SystemClock};

/// The period of an outage's repeated lines (reconnects and their
/// failures, health probes), in seconds: their retries, a few a second on
/// every lane, would write some 860,000 lines a day of a long outage.
pub const OUTAGE_PERIOD_S: u64 = 10;

/// One paced line: a `static` beside the line it paces.
#[derive(Debug)]
pub struct Paced {
    /// The period the last line was written in (since the epoch, plus one:
    /// 0 is never).
    second: AtomicU64,
    /// Lines left out since.
    skipped: AtomicU64,
    /// The period, in seconds.
    period_s: u64,
}

impl Paced {
    /// A line a second.
    pub const fn new() -> Self {
        Self::every(1)
    }

    /// A line every `period_s` seconds (at least 1).
    pub const fn every(period_s: u64) -> Self {
        Paced {
            second: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            period_s: if period_s == 0 { 1 } else { period_s },
        }
    }

    /// `Some(lines left out since the last one written)` when this one is
    /// to be written now; `None` (counted as left out) when not.
    pub fn admit(&self) -> Option<u64> {
        self.admit_in(self.period_at(SystemClock.now_ms()))
    }

    /// The period `now_ms` falls in (plus one).
    fn period_at(&self, now_ms: u64) -> u64 {
        now_ms / 1000 / self.period_s + 1
    }

    fn admit_in(&self, second: u64) -> Option<u64> {
        let last = self.second.load(Ordering::Relaxed);
        let first_this_second = last != second
            && self
                .second
                .compare_exchange(last, second, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok();
        if first_this_second {
            return Some(self.skipped.swap(0, Ordering::AcqRel));
        }
        self.skipped.fetch_add(1, Ordering::Relaxed);
        None
    }
}

impl Default for Paced {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::Paced;

    #[test]
    fn a_longer_period_takes_its_seconds_together() {
        let every_10 = Paced::every(10);
        assert_eq!(every_10.period_at(19_999), every_10.period_at(10_000));
        assert_ne!(every_10.period_at(20_000), every_10.period_at(19_999));
        let second = Paced::new();
        assert_ne!(second.period_at(11_000), second.period_at(10_999));
        assert_eq!(Paced::every(0).period_at(5_000), second.period_at(5_000));
    }

    #[test]
    fn the_first_line_of_each_second_is_written_with_the_count_left_out() {
        let paced = Paced::new();
        assert_eq!(paced.admit_in(5), Some(0));
        for _ in 0..3 {
            assert_eq!(paced.admit_in(5), None);
        }
        assert_eq!(paced.admit_in(6), Some(3));
        assert_eq!(paced.admit_in(9), Some(0));
    }
}
