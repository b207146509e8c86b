//! Sliding-window counter: the current window's count plus the previous
//! window's, weighted by the share of the previous window still inside the
//! sliding window (rounded down). O(1) memory per key. Twin:
//! `lua/sliding_window.lua`.
//!
//! It assumes the previous window's hits were spread evenly. When they were
//! not, a rolling window can hold more than the limit: at most by the
//! previous window's hits that fall inside it but were discounted. The
//! `sliding_window_error_vs_exact_log` test measures this on random traffic.

use super::{recordable, Check, Policy, State};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sliding {
    pub window: u64,
    pub current: u64,
    pub previous: u64,
}

impl Sliding {
    /// The estimated hits in the sliding window ending now. The float
    /// arithmetic is the same, operation for operation, as the Lua twin's, so
    /// both round identically.
    fn estimate(&self, check: &Check, now_ms: u64) -> u64 {
        let period = check.period_ms;
        let elapsed = now_ms - self.window * period;
        let weighted = (self.previous as f64 * (period - elapsed) as f64 / period as f64).floor();
        weighted as u64 + self.current
    }

    /// Milliseconds until `need` more hits fit, if no others come: later in
    /// this window, as the previous window's weight falls; else in the next,
    /// as this one's does; else once both have passed.
    fn until_fits(&self, check: &Check, need: u64, now_ms: u64) -> u64 {
        let period = check.period_ms;
        let start = self.window * period;
        if need <= check.limit {
            let room = check.limit - need;
            if self.current <= room {
                let at = first_fit(self.previous, room - self.current, period).max(now_ms - start);
                if at < period {
                    return start + at - now_ms;
                }
            }
            let at = first_fit(self.current, room, period);
            if at < period {
                return start + period + at - now_ms;
            }
        }
        start + 2 * period - now_ms
    }
}

/// The first millisecond of a window at which `count` hits of the window
/// before it, weighed as [`Sliding::estimate`] weighs them, are at most `k`:
/// the first `e` with `count × (period − e) / period < k + 1`. The float
/// operations are the Lua twin's, in the same order.
fn first_fit(count: u64, k: u64, period: u64) -> u64 {
    if count <= k {
        return 0;
    }
    // At most period − 1/count, which a float may round up to the period.
    let weighed_out = ((k + 1) as f64 * period as f64 - 1.0) / count as f64;
    period.saturating_sub(weighed_out.floor() as u64)
}

impl Policy for Sliding {
    fn load(stored: Option<State>, check: &Check, now_ms: u64) -> Self {
        let window = now_ms / check.period_ms;
        match stored {
            Some(State::Sliding(s)) if s.window == window => s,
            Some(State::Sliding(s)) if s.window + 1 == window => Sliding {
                window,
                current: 0,
                previous: s.current,
            },
            _ => Sliding {
                window,
                current: 0,
                previous: 0,
            },
        }
    }

    fn is_over(&self, check: &Check, now_ms: u64) -> bool {
        self.estimate(check, now_ms) + check.need() > check.limit
    }

    fn apply(&mut self, check: &Check, now_ms: u64) {
        self.current += recordable(check, self.estimate(check, now_ms));
    }

    /// The reset: the current window's end; when over, until the refused
    /// hits fit (a recorded charge: one more hit), which is later than the
    /// window's end whenever the previous window still weighs enough.
    fn report(&self, check: &Check, over: bool, applied: bool, now_ms: u64) -> (u64, u64) {
        let remaining = check.limit.saturating_sub(self.estimate(check, now_ms));
        let reset = if !over {
            (self.window + 1) * check.period_ms - now_ms
        } else if applied {
            self.until_fits(check, 1, now_ms)
        } else {
            self.until_fits(check, check.need(), now_ms)
        };
        (remaining, reset)
    }

    fn ttl_ms(&self, check: &Check, now_ms: u64) -> u64 {
        // The current count is still needed as the next window's previous.
        (self.window + 2) * check.period_ms - now_ms
    }

    /// From the window the reservation counted in: the current one, or the
    /// previous one (still weighed); one older gives nothing back.
    fn refund(&mut self, check: &Check, hits: u64, reserved_at_ms: u64, _mark: u64, _now: u64) {
        let window = reserved_at_ms / check.period_ms;
        let count = if window == self.window {
            &mut self.current
        } else if window + 1 == self.window {
            &mut self.previous
        } else {
            return;
        };
        *count -= hits.min(*count);
    }

    fn into_state(self) -> State {
        State::Sliding(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm;

    fn check(hits: u64) -> Check {
        Check::for_test("k", Algorithm::SlidingWindow, 10, 1_000, hits)
    }

    #[test]
    fn a_refund_gives_back_from_the_window_the_reservation_counted_in() {
        let mut s = Sliding::load(None, &check(8), 1_500);
        let mark = s.reserve(&check(8), 1_500);
        s.refund(&check(8), 3, 1_500, mark, 1_600);
        assert_eq!((s.current, s.previous), (5, 0));
        // A window later the reservation's hits are the previous window's.
        let mut s = Sliding::load(Some(s.into_state()), &check(8), 2_500);
        s.apply(&check(1), 2_500);
        s.refund(&check(8), 9, 1_500, mark, 2_500);
        assert_eq!((s.current, s.previous), (1, 0));
        // Two windows later they weigh nothing: nothing to give back.
        let mut s = Sliding::load(Some(s.into_state()), &check(8), 3_000);
        s.refund(&check(8), 1, 1_500, mark, 3_000);
        assert_eq!((s.current, s.previous), (0, 1));
    }
}
