//! Paces a log line that a failure repeats for every request (the store
//! down while thousands of requests a second meet it): the first of each
//! second is written, saying how many were left out before it.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::clock::{Clock, SystemClock};

/// One paced line: a `static` beside the line it paces.
#[derive(Debug, Default)]
pub struct Paced {
    /// The second the last line was written in (since the epoch, plus one:
    /// 0 is never).
    second: AtomicU64,
    /// Lines left out since.
    skipped: AtomicU64,
}

impl Paced {
    pub const fn new() -> Self {
        Paced {
            second: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
        }
    }

    /// `Some(lines left out since the last one written)` when this one is
    /// to be written now; `None` (counted as left out) when not.
    pub fn admit(&self) -> Option<u64> {
        self.admit_in(SystemClock.now_ms() / 1000 + 1)
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

#[cfg(test)]
mod tests {
    use super::Paced;

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
