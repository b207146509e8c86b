//! Sliding log: the exact timestamps of admitted hits within the last
//! period, so any window of the period's length holds at most the limit.
//! Memory grows with the limit. Twin: `lua/sliding_log.lua` (a sorted set).

use std::collections::VecDeque;

use super::{Check, Policy, State};

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Log {
    /// Timestamps in milliseconds, oldest first.
    pub stamps: VecDeque<u64>,
}

impl Policy for Log {
    fn load(stored: Option<State>, check: &Check, now_ms: u64) -> Self {
        let mut log = match stored {
            Some(State::Log(log)) => *log,
            _ => Log::default(),
        };
        while log
            .stamps
            .front()
            .is_some_and(|&t| t + check.period_ms <= now_ms)
        {
            log.stamps.pop_front();
        }
        log
    }

    fn is_over(&self, check: &Check, _now_ms: u64) -> bool {
        self.stamps.len() as u64 + check.need() > check.limit
    }

    fn apply(&mut self, check: &Check, now_ms: u64) {
        // Only hits that fit are applied, so this never exceeds the limit.
        for _ in 0..check.hits.min(check.limit) {
            self.stamps.push_back(now_ms);
        }
    }

    fn report(&self, check: &Check, over: bool, _applied: bool, now_ms: u64) -> (u64, u64) {
        let count = self.stamps.len() as u64;
        let remaining = check.limit.saturating_sub(count);
        let expiry = |t: u64| t + check.period_ms - now_ms;
        let reset = if over && check.need() <= check.limit {
            // The refused hits fit once `k` of the oldest have expired (or
            // now, when reporting a stored state they fit into).
            match (count + check.need()).checked_sub(check.limit) {
                Some(k) if k >= 1 => expiry(self.stamps[(k - 1) as usize]),
                _ => 0,
            }
        } else {
            self.stamps.back().map_or(0, |&t| expiry(t))
        };
        (remaining, reset)
    }

    fn ttl_ms(&self, check: &Check, _now_ms: u64) -> u64 {
        check.period_ms
    }

    fn into_state(self) -> State {
        State::Log(Box::new(self))
    }
}
