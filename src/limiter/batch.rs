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

use super::{dispatch, Charges, Check, Outcome, Policy, State, UndoPoint};

/// Requests of more checks than this find their keys through a map.
const INDEX_PAST: usize = 16;

/// What a table of states must offer the evaluator.
pub trait Table {
    /// The state stored under `key`, if any and not expired at `now_ms`,
    /// moved out of the table with its expiry: whoever takes a state writes
    /// it back. (A copy per request cost a sliding log of many entries more
    /// than its decision.)
    fn take(&mut self, key: &str, now_ms: u64) -> Option<(State, u64)>;
    /// Stores `state` under `key`, expiring at `expires_at_ms`.
    fn write(&mut self, key: &str, state: State, expires_at_ms: u64);
}

struct KeyState<'a> {
    key: &'a str,
    /// Where the state stood as loaded, kept when the request may have to be
    /// undone (more than one check, or a reservation).
    stored: Option<UndoPoint>,
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
    // A lone check has nothing to undo: over its limit it consumed nothing
    // or a charge, which a refusal keeps.
    let undoable = checks.len() > 1 || marks.is_some();
    let mut keys = Keys::new(checks.len(), undoable);
    let mut tried = Vec::with_capacity(checks.len());
    let mut blocked = false;
    for (i, check) in checks.iter().enumerate() {
        let at = keys.position(table, check, now_ms);
        let k = &mut keys.states[at];
        let over = dispatch!(&k.live, s => s.is_over(check, now_ms));
        blocked |= over && check.enforce;
        let applied = check.hits > 0 && (!over || check.charges != Charges::Drop);
        let remaining_before = (over && applied).then(|| remaining(&k.live, check, now_ms));
        if applied {
            consume(k, check, marks.as_deref_mut().map(|m| &mut m[i]), now_ms);
            k.consumed_by = Some(i);
        }
        let report = dispatch!(&k.live, s => s.report(check, over, applied, now_ms));
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
            .any(|(check, t)| check.spares_fitted() && !t.over)
    };
    if blocked && undoable && (all_or_nothing || spares_fitted()) {
        refused_only(&mut keys.states, checks, &mut tried, all_or_nothing, now_ms);
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
    keys.put_back(table, checks, now_ms);
    outcomes
}

/// Consumes `check`'s hits from its key: a reservation's (`mark`, the
/// check's slot of the marks) as its key's one entry, the key's first
/// check making it and the others joining it.
fn consume(k: &mut KeyState<'_>, check: &Check, mark: Option<&mut Option<u64>>, now_ms: u64) {
    let Some(mark) = mark else {
        dispatch!(&mut k.live, s => s.apply(check, now_ms));
        return;
    };
    let made = match k.mark {
        None => dispatch!(&mut k.live, s => s.reserve(check, now_ms)),
        Some(joined) => dispatch!(&mut k.live, s => s.join(check, now_ms, joined)),
    };
    k.mark = Some(made);
    *mark = Some(made);
}

/// A request's keys, each state taken from the table once, in the order
/// first met.
struct Keys<'a> {
    states: Vec<KeyState<'a>>,
    /// Where each key is in `states`, past [`INDEX_PAST`] checks: found by
    /// a scan for the few checks of most requests, here for a request at
    /// the caps (thousands; the scans made it quadratic).
    index: Option<HashMap<&'a str, usize>>,
    /// Whether each state as loaded is kept, to undo a refused request.
    undoable: bool,
}

impl<'a> Keys<'a> {
    fn new(checks: usize, undoable: bool) -> Self {
        Keys {
            states: Vec::new(),
            index: (checks > INDEX_PAST).then(HashMap::new),
            undoable,
        }
    }

    /// The position of `check`'s key, its state taken from `table` (and
    /// loaded for `check`) the first time.
    fn position(&mut self, table: &mut impl Table, check: &'a Check, now_ms: u64) -> usize {
        let known = match &self.index {
            Some(index) => index.get(check.key.as_str()).copied(),
            None => self.states.iter().position(|k| k.key == check.key),
        };
        if let Some(at) = known {
            return at;
        }
        let at = self.states.len();
        if let Some(index) = &mut self.index {
            index.insert(&check.key, at);
        }
        let (taken, expires_at_ms) = match table.take(&check.key, now_ms) {
            Some((state, expiry)) => (Some(state), Some(expiry)),
            None => (None, None),
        };
        let live = State::load(taken, check, now_ms);
        self.states.push(KeyState {
            key: &check.key,
            stored: self.undoable.then(|| live.undo_point()),
            expires_at_ms,
            live,
            consumed_by: None,
            mark: None,
        });
        at
    }

    /// Writes back every state taken: one consumed from with the TTL its
    /// last check gives it, the others as they were loaded.
    fn put_back(self, table: &mut impl Table, checks: &[Check], now_ms: u64) {
        for k in self.states {
            match (k.consumed_by, k.expires_at_ms) {
                (Some(i), _) => {
                    let ttl = dispatch!(&k.live, s => s.ttl_ms(&checks[i], now_ms));
                    table.write(k.key, k.live, now_ms + ttl.max(1));
                }
                (None, Some(expiry)) => table.write(k.key, k.live, expiry),
                (None, None) => {}
            }
        }
    }
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
            k.live.undo_to(stored);
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
