//! Reserve and settle (issue #23's cost budgets) as steps on a table of
//! states, for the in-memory store; the Lua twin is `lua/budget.lua`.
//!
//! A reservation takes its estimate from every check or from none, like one
//! all-or-nothing request whose checks take no charges: admission, where a
//! refusal consumes nothing. Its settlement makes each check's charge the
//! actual cost: the unused part of the estimate goes back through
//! [`Policy::refund`], an excess is charged after the fact (within
//! [`super::recordable`]'s bound, like every charge).

use super::batch::{run, Table};
use super::{dispatch, Charges, Check, Outcome, Policy, State};

/// What a granted reservation took from one check: the mark of its hits
/// (see [`Policy::reserve`]), or `None` when it took nothing (a limit in
/// shadow mode it was over), and then a settlement leaves that check alone.
pub type Mark = Option<u64>;

/// Reserves `checks`' hits all or nothing (their `charges` are ignored).
/// Returns each check's outcome and, when granted, each check's [`Mark`].
pub fn reserve(
    table: &mut impl Table,
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
    (outcomes, granted.then_some(marks))
}

/// Settles a reservation of `checks` (their `hits` the estimate) made at
/// `reserved_at_ms` with `marks` at `actual`; returns each check's
/// [`standing`] after it. The caller makes sure it runs once.
pub fn settle(
    table: &mut impl Table,
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
            dispatch!(&mut state, s => s.refund(check, unused, reserved_at_ms, mark, now_ms));
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
