//! Fixed window: one counter per window aligned to the Unix epoch, the
//! algorithm of envoyproxy/ratelimit. Twin: `lua/fixed_window.lua`.
//!
//! Simple and O(1), but a client can spend the limit at the end of one window
//! and again at the start of the next: up to 2x the limit within one window's
//! length.

use super::{Check, Policy, State};

/// The most a window counts. Charges pass the limit with no bound on the
/// debt (unlike the other algorithms' [`super::recordable`]): the window's
/// end clears any count, so a bound would decide nothing, except on a
/// counter shared with a higher limit through a `limit` override, which
/// counts every hit as envoyproxy/ratelimit's does. This cap only keeps
/// the count exact in Lua's doubles (2^52 plus any one request's hits).
pub const MAX_COUNT: u64 = 1 << 52;

/// The counter of the current window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    pub window: u64,
    pub count: u64,
}

impl Policy for Window {
    fn load(stored: Option<State>, check: &Check, now_ms: u64) -> Self {
        let window = now_ms / check.period_ms;
        match stored {
            Some(State::Window(w)) if w.window == window => w,
            _ => Window { window, count: 0 },
        }
    }

    fn is_over(&self, check: &Check, _now_ms: u64) -> bool {
        self.count + check.need() > check.limit
    }

    fn apply(&mut self, check: &Check, _now_ms: u64) {
        self.count = self.count.saturating_add(check.hits).min(MAX_COUNT);
    }

    fn report(&self, check: &Check, _over: bool, _applied: bool, now_ms: u64) -> (u64, u64) {
        (
            check.limit.saturating_sub(self.count),
            self.ttl_ms(check, now_ms),
        )
    }

    fn ttl_ms(&self, check: &Check, now_ms: u64) -> u64 {
        (self.window + 1) * check.period_ms - now_ms
    }

    /// A window that has passed gives nothing back: its count no longer
    /// matters.
    fn refund(&mut self, check: &Check, hits: u64, reserved_at_ms: u64, _mark: u64, _now: u64) {
        if reserved_at_ms / check.period_ms == self.window {
            self.count -= hits.min(self.count);
        }
    }

    fn into_state(self) -> State {
        State::Window(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm;

    fn check(hits: u64) -> Check {
        Check::for_test("k", Algorithm::FixedWindow, 10, 1_000, hits)
    }

    #[test]
    fn a_refund_gives_back_only_in_the_reservations_window() {
        let mut w = Window::load(None, &check(6), 1_200);
        let mark = w.reserve(&check(6), 1_200);
        w.refund(&check(6), 4, 1_200, mark, 1_900);
        assert_eq!(w.count, 2);
        // Never below zero, whatever the caller says.
        w.refund(&check(6), 9, 1_200, mark, 1_900);
        assert_eq!(w.count, 0);
        // The next window's count is not the reservation's.
        let mut next = Window::load(Some(w.into_state()), &check(6), 2_100);
        next.apply(&check(3), 2_100);
        next.refund(&check(6), 6, 1_200, mark, 2_100);
        assert_eq!(next.count, 3);
    }
}
