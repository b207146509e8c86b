//! Fixed window: one counter per window aligned to the Unix epoch, the
//! algorithm of envoyproxy/ratelimit. Twin: `lua/fixed_window.lua`.
//!
//! Simple and O(1), but a client can spend the limit at the end of one window
//! and again at the start of the next: up to 2x the limit within one window's
//! length.

use super::{recordable, Check, Policy, State};

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
        self.count += recordable(check, self.count);
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

    fn into_state(self) -> State {
        State::Window(self)
    }
}
