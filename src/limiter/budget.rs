//! Reserve and settle (issue #23's cost budgets) as steps on a table of
//! states, for the in-memory store; the Lua twin is `lua/budget.lua`.
//!
//! A reservation takes its estimate from every check or from none, like one
//! all-or-nothing request whose checks take no charges: admission, where a
//! refusal consumes nothing. Its settlement makes each check's charge the
//! actual cost: the unused part of the estimate goes back through
//! [`Policy::refund`], an excess is charged after the fact (within
//! [`super::recordable`]'s bound, like every charge).
//!
//! A bucket's reservation is a stretch of its queue (the TAT), and its mark
//! is where that stretch ended. A give-back moves the TAT back, which moves
//! every stretch behind the one giving back forward, and none ahead of it.
//! So marks are kept in a coordinate that give-backs do not move (the TAT
//! plus all given back on the key so far), and a settle finds its hits in
//! the queue from its mark, the total given back since and the give-backs
//! behind it ([`GivenBack`]): it never gives back hits that drained and
//! were spent by others, and loses nothing to others' give-backs (but
//! those past the latest [`GIVEN_BACK_LOG`], see there). Each check of a
//! reservation on one bucket key has its own mark, where its own hits end
//! ([`Policy::join`]).

use std::collections::HashMap;

use super::batch::{run, Table};
use super::{dispatch, Charges, Check, Outcome, Policy, State};

/// How long a bucket's [`GivenBack`] outlives the TTL of a reservation on
/// it: each reservation keeps the give-backs (made, at 0, if none) as long
/// as it may settle and this much more, never shortening them. (A fixed
/// two hours past every reservation kept them long after their bucket.)
/// Twin: `GIVEN_BACK_GRACE_MS` in `lua/gcra.lua`.
pub const GIVEN_BACK_GRACE_MS: u64 = 60_000;

/// How long give-backs made by a settle that found none live: a
/// reservation made before they were kept with it (its TTL is at most an
/// hour). Twin: `GIVEN_BACK_KEEP_MS` in `lua/gcra.lua`.
pub const GIVEN_BACK_KEEP_MS: u64 = 2 * 3_600_000;

/// How long the admin API's reset of a counter is remembered: the longest
/// reservation TTL and a minute. A reservation made before the reset that
/// settles after it gives nothing back on that counter (what it took went
/// with the reset; hits spent since are others'). Twin: `keep` in
/// `lua/reset.lua`.
pub const RESET_KEEP_MS: u64 = 3_660_000;

/// How many give-backs a bucket keeps by position: those with the latest
/// marks. A settle with more than this many give-backs behind it since its
/// reservation counts the oldest of them as ahead of it, and gives back
/// less than it could (never more). Twin: `GIVEN_BACK_LOG` in `lua/gcra.lua`.
pub const GIVEN_BACK_LOG: usize = 64;

/// One bucket's give-backs: their total (µs of TAT), and the latest ones by
/// mark, `(mark, µs)`, in order of mark.
#[derive(Debug, Default)]
struct Given {
    total: u64,
    expiry_ms: u64,
    log: Vec<(u64, u64)>,
}

/// Per bucket key, what its settles have given back; the in-memory twin of
/// the Redis keys `<counter key>:given` (the total) and `:given.log` (a
/// sorted set by mark) of `lua/gcra.lua`.
#[derive(Debug, Default)]
pub struct GivenBack(HashMap<String, Given>);

impl GivenBack {
    fn live(&self, key: &str, now_ms: u64) -> Option<&Given> {
        self.0.get(key).filter(|g| g.expiry_ms > now_ms)
    }

    /// The total on `key` (0 when none, then made), kept at least `keep_ms`
    /// more: a reservation that read it must find it again while it may
    /// settle.
    fn read_and_keep(&mut self, key: &str, keep_ms: u64, now_ms: u64) -> u64 {
        let given = self.0.entry(key.to_owned()).or_default();
        if given.expiry_ms <= now_ms {
            *given = Given::default();
        }
        given.expiry_ms = given.expiry_ms.max(now_ms.saturating_add(keep_ms));
        given.total
    }

    /// Where the hits of a reservation marked `mark` on `key` end now, in
    /// TAT: the mark less all given back, but for the give-backs behind it
    /// (a later mark), which moved nothing of its.
    fn ends(&self, key: &str, mark: u64, now_ms: u64) -> u64 {
        let Some(given) = self.live(key, now_ms) else {
            return mark;
        };
        let behind: u64 = given
            .log
            .iter()
            .filter(|(m, _)| *m > mark)
            .map(|(_, us)| us)
            .sum();
        mark.saturating_add(behind).saturating_sub(given.total)
    }

    /// Records that the reservation marked `mark` gave `us` back on `key`
    /// (kept as long as its reservations keep it).
    fn add(&mut self, key: &str, mark: u64, us: u64, now_ms: u64) {
        let given = self.0.entry(key.to_owned()).or_default();
        if given.expiry_ms <= now_ms {
            *given = Given {
                expiry_ms: now_ms + GIVEN_BACK_KEEP_MS,
                ..Given::default()
            };
        }
        given.total = given.total.saturating_add(us);
        let at = given.log.partition_point(|(m, _)| *m <= mark);
        given.log.insert(at, (mark, us));
        if given.log.len() > GIVEN_BACK_LOG {
            given.log.remove(0);
        }
    }

    /// A reset of the bucket `key` whose TAT was `tat_us`: what it had
    /// queued counts as given back ahead of every reservation (no log
    /// entry), so those made before find their hits drained.
    pub fn reset(&mut self, key: &str, tat_us: u64, now_ms: u64) {
        let now_us = now_ms.saturating_mul(1000);
        if let Some(given) = self.0.get_mut(key).filter(|g| g.expiry_ms > now_ms) {
            given.total = given.total.saturating_add(tat_us.saturating_sub(now_us));
        }
    }

    /// Forgets the buckets whose give-backs have expired.
    pub fn sweep(&mut self, now_ms: u64) {
        self.0.retain(|_, given| given.expiry_ms > now_ms);
    }
}

/// A bucket's TAT, the position give-backs move (none for the others).
fn tat_us(state: &State) -> Option<u64> {
    match state {
        State::Gcra(g) => Some(g.tat_us),
        _ => None,
    }
}

/// What a granted reservation took from one check: the mark of its hits
/// (see [`Policy::reserve`]), or `None` when it took nothing (a limit in
/// shadow mode it was over), and then a settlement leaves that check alone.
pub type Mark = Option<u64>;

/// Reserves `checks`' hits all or nothing (their `charges` are ignored),
/// for a reservation that may settle for `ttl_ms`. Returns each check's
/// outcome and, when granted, each check's [`Mark`].
pub fn reserve(
    table: &mut impl Table,
    given_back: &mut GivenBack,
    checks: &[Check],
    ttl_ms: u64,
    now_ms: u64,
) -> (Vec<Outcome>, Option<Vec<Mark>>) {
    let admission: Vec<Check> = checks
        .iter()
        .map(|c| Check {
            charges: Charges::Drop,
            ..c.clone()
        })
        .collect();
    let mut marks = vec![None; checks.len()];
    let outcomes = run(table, &admission, true, Some(&mut marks), now_ms);
    let granted = !outcomes.iter().zip(checks).any(|(o, c)| c.refused_by(o));
    if granted {
        for (check, mark) in checks.iter().zip(&mut marks) {
            if let (Some(mark), true) = (mark.as_mut(), check.algorithm.has_burst()) {
                let keep = ttl_ms.saturating_add(GIVEN_BACK_GRACE_MS);
                *mark = mark.saturating_add(given_back.read_and_keep(&check.key, keep, now_ms));
            }
        }
    }
    (outcomes, granted.then_some(marks))
}

/// What a granted reservation took from one check, as its settle needs
/// it: when (on the store's clock, ms) and its [`Mark`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    pub at_ms: u64,
    pub mark: Mark,
}

/// A reservation as its settle needs it.
#[derive(Debug, Clone, Copy)]
pub struct Reservation<'a> {
    /// Its checks, their `hits` the estimate.
    pub checks: &'a [Check],
    /// What it took from each, and when.
    pub taken: &'a [Taken],
}

/// Settles `reservation` at `actual`, `erased` saying per check whether
/// its counter was reset since; returns each check's [`standing`] after
/// it. The caller makes sure it runs once.
pub fn settle(
    table: &mut impl Table,
    given_back: &mut GivenBack,
    reservation: Reservation<'_>,
    erased: &[bool],
    actual: u64,
    now_ms: u64,
) -> Vec<Outcome> {
    let Reservation { checks, taken } = reservation;
    for ((check, taken), &erased) in checks.iter().zip(taken).zip(erased) {
        let Some(mark) = taken.mark else { continue };
        let reserved_at_ms = taken.at_ms;
        // A counter reset since the reservation lost what it took: nothing
        // to give back (an excess is still charged). See RESET_KEEP_MS.
        if actual == check.hits || (erased && actual < check.hits) {
            continue;
        }
        let stored = table.take(&check.key, now_ms).map(|(state, _)| state);
        let mut state = State::load(stored, check, now_ms);
        if actual < check.hits {
            let unused = check.hits - actual;
            let before = tat_us(&state);
            let ends = match before {
                Some(_) => given_back.ends(&check.key, mark, now_ms),
                None => mark,
            };
            dispatch!(&mut state, s => s.refund(check, unused, reserved_at_ms, ends, now_ms));
            if let (Some(before), Some(after)) = (before, tat_us(&state)) {
                if after < before {
                    given_back.add(&check.key, mark, before - after, now_ms);
                }
            }
        } else {
            let excess = Check {
                hits: actual - check.hits,
                charges: Charges::Record,
                ..check.clone()
            };
            dispatch!(&mut state, s => s.apply(&excess, now_ms));
        }
        let ttl = dispatch!(&state, s => s.ttl_ms(check, now_ms));
        table.write(&check.key, state, now_ms + ttl.max(1));
    }
    standing(table, checks, now_ms)
}

/// Each check's standing, consuming nothing: whether one more hit would be
/// over its limit, the hits it would still admit, and its reset.
pub fn standing(table: &mut impl Table, checks: &[Check], now_ms: u64) -> Vec<Outcome> {
    checks
        .iter()
        .map(|check| {
            let probe = Check {
                hits: 0,
                ..check.clone()
            };
            // Moved out and back with its expiry, not copied: a sliding
            // log may hold thousands of entries.
            let taken = table.take(&check.key, now_ms);
            let expiry = taken.as_ref().map(|&(_, expiry)| expiry);
            let state = State::load(taken.map(|(state, _)| state), &probe, now_ms);
            let over = dispatch!(&state, s => s.is_over(&probe, now_ms));
            let (remaining, reset_ms) =
                dispatch!(&state, s => s.report(&probe, over, false, now_ms));
            if let Some(expiry) = expiry {
                table.write(&check.key, state, expiry);
            }
            Outcome {
                over,
                remaining,
                reset_ms,
                remaining_before: None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_settle_finds_its_hits_moved_only_by_give_backs_ahead_of_them() {
        let mut given = GivenBack::default();
        // A reservation that may settle for 1,000 ms makes the total, 0.
        assert_eq!(given.read_and_keep("k", 1_000, 0), 0, "none yet");
        assert_eq!(given.ends("k", 500, 0), 500);
        // Marks 100 (ahead) and 300 (behind) of a reservation marked 200
        // give back 10 and 20.
        given.add("k", 100, 10, 0);
        given.add("k", 300, 20, 10);
        assert_eq!(given.ends("k", 200, 10), 190, "moved by the 10 ahead only");
        assert_eq!(given.ends("k", 300, 10), 270, "its own give-back counts");
        // A reservation that reads the total keeps it as long as it may
        // settle; a shorter one shortens nothing.
        assert_eq!(given.read_and_keep("k", 5_000, 500), 30);
        assert_eq!(given.read_and_keep("k", 10, 600), 30);
        assert_eq!(given.ends("k", 200, 5_499), 190);
        given.sweep(5_500);
        assert!(given.0.is_empty(), "gone once no reservation may settle");
        assert_eq!(given.ends("k", 200, 5_500), 200);
        // Give-backs of a reservation made before any were kept (an
        // earlier version's) live GIVEN_BACK_KEEP_MS.
        given.add("k", 100, 10, 6_000);
        given.sweep(6_000 + GIVEN_BACK_KEEP_MS - 1);
        assert_eq!(given.ends("k", 150, 6_000 + GIVEN_BACK_KEEP_MS - 1), 140);
    }

    #[test]
    fn past_the_log_a_give_back_behind_counts_as_ahead() {
        let mut given = GivenBack::default();
        for i in 0..=GIVEN_BACK_LOG as u64 {
            given.add("k", 1_000 + i, 1, 0);
        }
        // All 65 are behind mark 10, but only the latest 64 are known.
        assert_eq!(given.ends("k", 10, 0), 10 + 64 - 65);
    }
}
