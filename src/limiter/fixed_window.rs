//! Fixed window: one counter per window aligned to the Unix epoch, the
//! algorithm of envoyproxy/ratelimit. This is the in-memory implementation;
//! `lua/fixed_window.lua` is its Redis twin, line for line.
//!
//! A request's limits are evaluated as one batch, all-or-nothing: if any
//! enforced limit would be exceeded, nothing is consumed anywhere. A check with
//! `hits == 0` consumes nothing and is over when the next hit would be.

use super::{Check, Outcome};

/// What a table of counters must offer the batch evaluator.
pub trait Counters {
    /// The stored `(window, count)` of `key`, if any and not expired.
    fn read(&mut self, key: &str, now_ms: u64) -> Option<(u64, u64)>;
    /// Stores `(window, count)` under `key`, expiring at `expires_at_ms`.
    fn write(&mut self, key: &str, window: u64, count: u64, expires_at_ms: u64);
}

/// Evaluates a request's checks against `table` at `now_ms`.
pub fn evaluate(table: &mut impl Counters, checks: &[Check], now_ms: u64) -> Vec<Outcome> {
    // Per key: the stored count and the running count including earlier
    // checks of this batch (a request may repeat a descriptor).
    let mut keys: Vec<(&str, u64, u64)> = Vec::new();
    let mut seen = Vec::with_capacity(checks.len());
    let mut blocked = false;
    for check in checks {
        let window = now_ms / check.period_ms;
        let at = match keys.iter().position(|(k, _, _)| *k == check.key) {
            Some(at) => at,
            None => {
                let stored = match table.read(&check.key, now_ms) {
                    Some((w, count)) if w == window => count,
                    _ => 0,
                };
                keys.push((&check.key, stored, stored));
                keys.len() - 1
            }
        };
        let running = keys[at].2;
        let over = running + check.hits.max(1) > check.limit;
        blocked |= over && check.enforce;
        keys[at].2 = running + check.hits;
        seen.push((at, running, over));
    }
    checks
        .iter()
        .zip(seen)
        .map(|(check, (at, running, over))| {
            let window = now_ms / check.period_ms;
            let reset_ms = (window + 1) * check.period_ms - now_ms;
            // A refused request consumed nothing: report the stored count.
            let count = if blocked {
                keys[at].1
            } else {
                if check.hits > 0 {
                    table.write(&check.key, window, running + check.hits, now_ms + reset_ms);
                }
                running + check.hits
            };
            Outcome {
                over,
                remaining: check.limit.saturating_sub(count),
                reset_ms,
            }
        })
        .collect()
}
