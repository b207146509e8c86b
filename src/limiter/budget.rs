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
//! every stretch behind it forward; so a later settle, finding its hits in
//! the queue, first subtracts all that was given back on the key since its
//! reservation ([`GivenBack`]). It may find them further forward than they
//! are (a give-back behind it counts too), never further back: a settle
//! never gives back hits that drained and were spent by others.

use std::collections::HashMap;

use super::batch::{run, Table};
use super::{dispatch, Charges, Check, Outcome, Policy, State};

/// How long a bucket's [`GivenBack`] total outlives the last reservation
/// that read it or settle that added to it: past any reservation's TTL (at
/// most an hour) and a Cluster's grace for its later slots. Twin:
/// `GIVEN_BACK_KEEP_MS` in `lua/gcra.lua`.
pub const GIVEN_BACK_KEEP_MS: u64 = 2 * 3_600_000;

/// Per bucket key, the microseconds of TAT its settles have given back, a
/// total that only grows while it lives; the in-memory twin of the Redis
/// key `<counter key>:given` (`lua/gcra.lua`). A reservation's mark adds
/// the total as it found it, and a settle subtracts the total as it finds
/// it: what is left is where the reservation's hits end now, at the latest.
#[derive(Debug, Default)]
pub struct GivenBack(HashMap<String, (u64, u64)>);

impl GivenBack {
    /// The total on `key` (0 when none), kept [`GIVEN_BACK_KEEP_MS`] more
    /// when there is one: a reservation that read it must find it again.
    fn read_and_keep(&mut self, key: &str, now_ms: u64) -> u64 {
        match self.0.get_mut(key) {
            Some((total, expiry)) if *expiry > now_ms => {
                *expiry = now_ms + GIVEN_BACK_KEEP_MS;
                *total
            }
            _ => 0,
        }
    }

    fn read(&self, key: &str, now_ms: u64) -> u64 {
        self.0
            .get(key)
            .filter(|(_, expiry)| *expiry > now_ms)
            .map_or(0, |(total, _)| *total)
    }

    fn add(&mut self, key: &str, us: u64, now_ms: u64) {
        let total = self.read(key, now_ms).saturating_add(us);
        self.0
            .insert(key.to_owned(), (total, now_ms + GIVEN_BACK_KEEP_MS));
    }

    /// Forgets the totals that have expired.
    pub fn sweep(&mut self, now_ms: u64) {
        self.0.retain(|_, (_, expiry)| *expiry > now_ms);
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

/// Reserves `checks`' hits all or nothing (their `charges` are ignored).
/// Returns each check's outcome and, when granted, each check's [`Mark`].
pub fn reserve(
    table: &mut impl Table,
    given_back: &mut GivenBack,
    checks: &[Check],
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
    let granted = !outcomes
        .iter()
        .zip(checks)
        .any(|(o, c)| o.over && c.enforce);
    if granted {
        for (check, mark) in checks.iter().zip(&mut marks) {
            if let (Some(mark), true) = (mark.as_mut(), check.algorithm.has_burst()) {
                *mark = mark.saturating_add(given_back.read_and_keep(&check.key, now_ms));
            }
        }
    }
    (outcomes, granted.then_some(marks))
}

/// Settles a reservation of `checks` (their `hits` the estimate) made at
/// `reserved_at_ms` with `marks` at `actual`; returns each check's
/// [`standing`] after it. The caller makes sure it runs once.
pub fn settle(
    table: &mut impl Table,
    given_back: &mut GivenBack,
    checks: &[Check],
    marks: &[Mark],
    reserved_at_ms: u64,
    actual: u64,
    now_ms: u64,
) -> Vec<Outcome> {
    for (check, &mark) in checks.iter().zip(marks) {
        let Some(mark) = mark else { continue };
        if actual == check.hits {
            continue;
        }
        let mut state = State::load(table.read(&check.key, now_ms), check, now_ms);
        if actual < check.hits {
            let unused = check.hits - actual;
            let before = tat_us(&state);
            let mark = match before {
                Some(_) => mark.saturating_sub(given_back.read(&check.key, now_ms)),
                None => mark,
            };
            dispatch!(&mut state, s => s.refund(check, unused, reserved_at_ms, mark, now_ms));
            if let (Some(before), Some(after)) = (before, tat_us(&state)) {
                if after < before {
                    given_back.add(&check.key, before - after, now_ms);
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
            let state = State::load(table.read(&check.key, now_ms), &probe, now_ms);
            let over = dispatch!(&state, s => s.is_over(&probe, now_ms));
            let (remaining, reset_ms) =
                dispatch!(&state, s => s.report(&probe, over, false, now_ms));
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
    fn a_given_back_total_lives_while_reservations_read_it() {
        let mut given = GivenBack::default();
        assert_eq!(given.read_and_keep("k", 0), 0, "none yet");
        given.add("k", 5, 0);
        given.add("k", 7, 10);
        assert_eq!(given.read("k", 10), 12);
        // A reservation that reads it keeps it past its first expiry.
        assert_eq!(given.read_and_keep("k", GIVEN_BACK_KEEP_MS), 12);
        assert_eq!(given.read("k", GIVEN_BACK_KEEP_MS + 20), 12);
        given.sweep(2 * GIVEN_BACK_KEEP_MS + 1);
        assert!(given.0.is_empty());
        assert_eq!(given.read("k", 0), 0);
    }
}
