//! The generic cell rate algorithm behind `token_bucket` and `leaky_bucket`:
//! one stored time per key, the theoretical arrival time (TAT). Twin:
//! `lua/gcra.lua`.
//!
//! Hits are emitted every `T = period / limit` (rounded up to a whole
//! microsecond, so the rate is never above the configured one); a hit is
//! admitted when `TAT - now + T <= burst * T`. All arithmetic is in integer
//! microseconds, exact in Lua's doubles (config validation keeps
//! `burst * T` under 2^52 µs).
//!
//! The two algorithms differ only in what they report as the reset:
//! `token_bucket` the time until the bucket is full again, `leaky_bucket` the
//! time the caller would wait in the queue before its hits are served.

use super::{Algorithm, Check, Policy, State};

/// Largest `burst * T`, in microseconds, that config validation accepts.
pub const MAX_BURST_SPAN_US: u64 = 1 << 52;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gcra {
    /// Theoretical arrival time in microseconds; never before now once loaded.
    pub tat_us: u64,
}

/// Microseconds between two hits at the limit's rate (rounded up).
pub fn emission_us(check: &Check) -> u64 {
    emission_interval_us(check.period_ms, check.limit)
}

/// Microseconds between two hits at `limit` per `period_ms` (rounded up).
pub fn emission_interval_us(period_ms: u64, limit: u64) -> u64 {
    (period_ms * 1_000).div_ceil(limit.max(1))
}

impl Gcra {
    fn capacity_us(check: &Check) -> u64 {
        check.burst.saturating_mul(emission_us(check))
    }

    /// The most backlog a charge may leave: a full bucket plus a debt of one
    /// limit (the bound of [`super::recordable`], in time: one period).
    fn max_backlog_us(check: &Check) -> u64 {
        check
            .burst
            .saturating_add(check.limit)
            .saturating_mul(emission_us(check))
    }
}

impl Policy for Gcra {
    fn load(stored: Option<State>, _check: &Check, now_ms: u64) -> Self {
        let now_us = now_ms * 1_000;
        match stored {
            Some(State::Gcra(g)) if g.tat_us > now_us => g,
            _ => Gcra { tat_us: now_us },
        }
    }

    fn is_over(&self, check: &Check, now_ms: u64) -> bool {
        let backlog = self.tat_us - now_ms * 1_000;
        check.limit == 0
            || backlog.saturating_add(check.need().saturating_mul(emission_us(check)))
                > Self::capacity_us(check)
    }

    fn apply(&mut self, check: &Check, now_ms: u64) {
        // Admitted hits always fit under the bound; a charge is cut to it.
        // Hits are capped before multiplying, so nothing overflows.
        let room = (now_ms * 1_000 + Self::max_backlog_us(check)).saturating_sub(self.tat_us);
        let hits = check.hits.min(check.burst.saturating_add(check.limit));
        self.tat_us += hits.saturating_mul(emission_us(check)).min(room);
    }

    fn report(&self, check: &Check, over: bool, applied: bool, now_ms: u64) -> (u64, u64) {
        let t = emission_us(check);
        let capacity = Self::capacity_us(check);
        let backlog = self.tat_us - now_ms * 1_000;
        let remaining = capacity.saturating_sub(backlog) / t;
        let wait_us = if over {
            // Until the refused hits fit (a recorded charge: until one more
            // hit does); if they never can, until empty.
            let need = if applied { 1 } else { check.need() };
            match need.checked_mul(t) {
                Some(need) if need <= capacity => (backlog + need).saturating_sub(capacity),
                _ => backlog,
            }
        } else if check.algorithm == Algorithm::LeakyBucket && applied {
            // The queue ahead of this request's hits.
            backlog - check.hits * t
        } else {
            backlog
        };
        (remaining, wait_us.div_ceil(1_000))
    }

    fn ttl_ms(&self, _check: &Check, now_ms: u64) -> u64 {
        (self.tat_us - now_ms * 1_000).div_ceil(1_000)
    }

    /// The mark is the TAT the reservation left: hits are served in order,
    /// so its own are drained by then.
    fn reserve(&mut self, check: &Check, now_ms: u64) -> u64 {
        self.apply(check, now_ms);
        self.tat_us
    }

    /// Where this check's own hits end (see [`Policy::join`]).
    fn join(&mut self, check: &Check, now_ms: u64, _mark: u64) -> u64 {
        self.reserve(check, now_ms)
    }

    /// The TAT moves back by the hits' emission, but only by what of the
    /// reservation has not drained yet (what has drained was spent: giving
    /// it back would hand out later requests' hits), and not before now.
    fn refund(&mut self, check: &Check, hits: u64, _reserved_at_ms: u64, mark: u64, now: u64) {
        let now_us = now * 1_000;
        let undrained = mark.saturating_sub(now_us);
        let back = hits.saturating_mul(emission_us(check)).min(undrained);
        self.tat_us = self.tat_us.saturating_sub(back).max(now_us);
    }

    fn into_state(self) -> State {
        State::Gcra(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(hits: u64) -> Check {
        Check::for_test("k", Algorithm::TokenBucket, 10, 1_000, hits)
    }

    #[test]
    fn a_refund_moves_the_tat_back_but_not_before_now() {
        // 100 ms per hit: 8 hits take the TAT to 800 ms ahead.
        let mut g = Gcra::load(None, &check(8), 1_000);
        let mark = g.reserve(&check(8), 1_000);
        assert_eq!(g.tat_us, 1_800_000);
        g.refund(&check(8), 3, 1_000, mark, 1_000);
        assert_eq!(g.tat_us, 1_500_000);
        // 400 ms later, 4 of the 5 left have drained: only 1 can come back.
        let mut g = Gcra::load(Some(g.into_state()), &check(8), 1_400);
        g.refund(&check(8), 5, 1_000, mark, 1_400);
        assert_eq!(g.tat_us, 1_400_000);
        // Drained altogether: a later request's hits are not given back.
        let mut g = Gcra::load(None, &check(2), 0);
        let mark = g.reserve(&check(2), 0);
        let mut g = Gcra::load(Some(g.into_state()), &check(2), 500);
        g.apply(&check(2), 500);
        g.refund(&check(2), 2, 0, mark, 500);
        assert_eq!(g.tat_us, 700_000);
    }
}
