//! Evaluates one request's checks as one step, for the in-memory store; the
//! Lua twin is `lua/batch.lua`.
//!
//! Each key's state is loaded once; checks are tried in order, each seeing
//! the hits earlier checks of the request consumed from the same key. A check
//! that is over its limit consumes nothing, unless its limit takes charges
//! (then its hits are recorded anyway: see [`super::recordable`]). With
//! `all_or_nothing`, a request refused by any enforced check consumes nothing
//! but its charges: the states are put back as they were before it and the
//! hits of its checks that take charges are recorded on them, in order;
//! each outcome is reported from its key's state as of its check (its own
//! hits in, the later checks' not). Otherwise (Envoy's
//! behaviour) the checks that fit are consumed even when another refuses the
//! request, but for a fixed window under `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`
//! (`Charges::WhenOver`), which spares what it fitted either way.

use std::collections::HashMap;

use super::{dispatch, Charges, Check, Outcome, Policy, State};

/// Requests of more checks than this find their keys through a map.
const INDEX_PAST: usize = 16;

/// What a table of states must offer the evaluator.
pub trait Table {
    /// The state stored under `key`, if any and not expired at `now_ms`.
    fn read(&mut self, key: &str, now_ms: u64) -> Option<State>;
    /// As [`Table::read`], moved out of the table with its expiry: the
    /// evaluator writes back every state it takes. (A copy per request
    /// cost a sliding log of many entries more than its decision.)
    fn take(&mut self, key: &str, now_ms: u64) -> Option<(State, u64)>;
    /// Stores `state` under `key`, expiring at `expires_at_ms`.
    fn write(&mut self, key: &str, state: State, expires_at_ms: u64);
}

struct KeyState<'a> {
    key: &'a str,
    /// The state as loaded, kept when the request may have to be undone
    /// (more than one check, or a reservation).
    stored: Option<State>,
    /// The expiry of the state taken from the table, if there was one.
    expires_at_ms: Option<u64>,
    live: State,
    /// The last check that consumed from this key (for the TTL), if any.
    consumed_by: Option<usize>,
    /// When reserving: the mark of the reservation's hits on this key.
    mark: Option<u64>,
}

/// Evaluates `checks` against `table` at `now_ms`.
pub fn evaluate(
    table: &mut impl Table,
    checks: &[Check],
    all_or_nothing: bool,
    now_ms: u64,
) -> Vec<Outcome> {
    run(table, checks, all_or_nothing, None, now_ms)
}

/// [`evaluate`]; with `marks` (one per check, `None` each), the hits are
/// a reservation's ([`super::Policy::reserve`]) and each check that
/// consumed gets its mark (a key's checks after the first share it: the
/// reservation's hits on a key are one entry).
pub(super) fn run(
    table: &mut impl Table,
    checks: &[Check],
    all_or_nothing: bool,
    mut marks: Option<&mut [Option<u64>]>,
    now_ms: u64,
) -> Vec<Outcome> {
    let mut keys: Vec<KeyState<'_>> = Vec::new();
    // Where each key is in `keys`: found by a scan for the few checks of
    // most requests, in a map past that (a request at the caps has
    // thousands, and the scans made it quadratic).
    let mut index: HashMap<&str, usize> = HashMap::new();
    let indexed = checks.len() > INDEX_PAST;
    // A lone check has nothing to undo: over its limit it consumed nothing
    // or a charge, which a refusal keeps.
    let undoable = checks.len() > 1 || marks.is_some();
    let mut tried = Vec::with_capacity(checks.len());
    let mut blocked = false;
    for (i, check) in checks.iter().enumerate() {
        let known = if indexed {
            index.get(check.key.as_str()).copied()
        } else {
            keys.iter().position(|k| k.key == check.key)
        };
        let at = match known {
            Some(at) => at,
            None => {
                if indexed {
                    index.insert(&check.key, keys.len());
                }
                let (taken, expires_at_ms) = match table.take(&check.key, now_ms) {
                    Some((state, expiry)) => (Some(state), Some(expiry)),
                    None => (None, None),
                };
                let live = State::load(taken, check, now_ms);
                keys.push(KeyState {
                    key: &check.key,
                    stored: undoable.then(|| live.clone()),
                    expires_at_ms,
                    live,
                    consumed_by: None,
                    mark: None,
                });
                keys.len() - 1
            }
        };
        let live = &mut keys[at].live;
        let over = dispatch!(&*live, s => s.is_over(check, now_ms));
        blocked |= over && check.enforce;
        let applied = check.hits > 0 && (!over || check.charges != Charges::Drop);
        let remaining_before = (over && applied).then(|| remaining(&keys[at].live, check, now_ms));
        if applied {
            let k = &mut keys[at];
            match (&mut marks, k.mark) {
                (Some(marks), None) => {
                    let mark = dispatch!(&mut k.live, s => s.reserve(check, now_ms));
                    k.mark = Some(mark);
                    marks[i] = Some(mark);
                }
                (Some(marks), Some(mark)) => {
                    let mark = dispatch!(&mut k.live, s => s.join(check, now_ms, mark));
                    k.mark = Some(mark);
                    marks[i] = Some(mark);
                }
                (None, _) => dispatch!(&mut k.live, s => s.apply(check, now_ms)),
            }
            k.consumed_by = Some(i);
        }
        let report = dispatch!(&keys[at].live, s => s.report(check, over, applied, now_ms));
        tried.push(Tried {
            at,
            over,
            report,
            remaining_before,
        });
    }
    // A WhenOver check that admitted hits it fitted takes them back when the
    // request is refused, all or nothing or not.
    let spares_fitted = || {
        checks
            .iter()
            .zip(&tried)
            .any(|(check, t)| check.charges == Charges::WhenOver && check.hits > 0 && !t.over)
    };
    let redo = blocked && undoable && (all_or_nothing || spares_fitted());
    if redo {
        refused_only(&mut keys, checks, &mut tried, all_or_nothing, now_ms);
    }
    let outcomes = tried
        .into_iter()
        .map(|t| Outcome {
            over: t.over,
            remaining: t.report.0,
            reset_ms: t.report.1,
            remaining_before: t.remaining_before,
        })
        .collect();
    for k in keys {
        match k.consumed_by {
            Some(i) => {
                let ttl = dispatch!(&k.live, s => s.ttl_ms(&checks[i], now_ms));
                table.write(k.key, k.live, now_ms + ttl.max(1));
            }
            // Taken and not consumed from: put back as it was loaded.
            None => {
                if let Some(expiry) = k.expires_at_ms {
                    table.write(k.key, k.live, expiry);
                }
            }
        }
    }
    outcomes
}

/// One check as first tried: its key's index, whether it was over, its
/// report, and [`Outcome::remaining_before`].
struct Tried {
    at: usize,
    over: bool,
    report: (u64, u64),
    remaining_before: Option<u64>,
}

/// The hits `check` would still admit from `state`, consuming nothing.
fn remaining(state: &State, check: &Check, now_ms: u64) -> u64 {
    dispatch!(state, s => s.report(check, true, false, now_ms)).0
}

/// Undoes a refused request but for what [`Charges::records_refused`]
/// keeps: each key back to its stored state, then those hits recorded on it
/// in order (a charge over its limit then took over from what the ones
/// before it left).
fn refused_only(
    keys: &mut [KeyState<'_>],
    checks: &[Check],
    tried: &mut [Tried],
    all_or_nothing: bool,
    now_ms: u64,
) {
    for k in keys.iter_mut() {
        if let Some(stored) = &k.stored {
            k.live = stored.clone();
        }
        k.consumed_by = None;
    }
    for (i, (check, t)) in checks.iter().zip(tried).enumerate() {
        let recorded = check
            .charges
            .records_refused(check.hits, t.over, all_or_nothing);
        let live = &mut keys[t.at].live;
        if recorded {
            if t.over {
                t.remaining_before = Some(remaining(live, check, now_ms));
            }
            dispatch!(live, s => s.apply(check, now_ms));
            keys[t.at].consumed_by = Some(i);
        }
        // As the request left the key at this check (theirs reports each
        // descriptor from its own INCRBY).
        t.report = dispatch!(&*live, s => s.report(check, t.over, recorded, now_ms));
    }
}
