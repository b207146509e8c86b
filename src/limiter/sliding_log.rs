//! Sliding log: the admitted requests of the last period, each with its
//! time and its hits, so any window of the period's length holds at most the
//! limit, exactly. A request is one entry whatever its `hits_addend`, so
//! the work and memory of a key grow with the requests it admitted in the
//! period, never with their hits. Twin: `lua/sliding_log.lua` (a sorted set
//! whose members carry the same running totals).

use std::collections::VecDeque;

use super::{recordable, Check, Policy, State};

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Log {
    /// Admitted requests still in the period, oldest first, as (time in ms,
    /// running total of hits through this entry). Times never decrease (an
    /// entry is stamped no earlier than the newest, should the clock step
    /// back), so the oldest entries are the first to age out; requests
    /// admitted in the same millisecond share an entry. Running totals,
    /// rather than each entry's hits, let the time when enough hits have
    /// aged out be found by bisection. They wrap around (only differences
    /// are ever used), so they cannot overflow.
    entries: VecDeque<(u64, u64)>,
    /// The running total before the oldest entry.
    base: u64,
}

/// Where a log ended: its length, newest entry and base (see
/// [`super::UndoPoint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct End {
    len: usize,
    newest: Option<(u64, u64)>,
    base: u64,
}

impl Log {
    /// Where the log ends now.
    pub fn end(&self) -> End {
        End {
            len: self.entries.len(),
            newest: self.entries.back().copied(),
            base: self.base,
        }
    }

    /// Back to `end`, dropping the entries appended since and restoring the
    /// newest entry then (which a request in its millisecond adds to).
    pub fn back_to(&mut self, end: &End) {
        self.entries.truncate(end.len);
        if let (Some(newest), Some(then)) = (self.entries.back_mut(), end.newest) {
            *newest = then;
        }
        self.base = end.base;
    }

    /// The running total through the newest entry.
    fn top(&self) -> u64 {
        self.entries.back().map_or(self.base, |&(_, total)| total)
    }

    /// Hits admitted in the period.
    fn count(&self) -> u64 {
        self.top().wrapping_sub(self.base)
    }
}

impl Policy for Log {
    fn load(stored: Option<State>, check: &Check, now_ms: u64) -> Self {
        let mut log = match stored {
            Some(State::Log(log)) => *log,
            _ => Log::default(),
        };
        while let Some(&(t, total)) = log.entries.front() {
            if t + check.period_ms > now_ms {
                break;
            }
            log.base = total;
            log.entries.pop_front();
        }
        log
    }

    fn is_over(&self, check: &Check, _now_ms: u64) -> bool {
        self.count() + check.need() > check.limit
    }

    fn apply(&mut self, check: &Check, now_ms: u64) {
        let hits = recordable(check, self.count());
        if hits == 0 {
            // A charge past the debt's bound: nothing to record (an entry
            // holds at least one hit).
            return;
        }
        let total = self.top().wrapping_add(hits);
        match self.entries.back_mut() {
            Some(newest) if newest.0 >= now_ms => newest.1 = total,
            _ => self.entries.push_back((now_ms, total)),
        }
    }

    fn report(&self, check: &Check, over: bool, applied: bool, now_ms: u64) -> (u64, u64) {
        let count = self.count();
        let remaining = check.limit.saturating_sub(count);
        let expiry = |t: u64| t + check.period_ms - now_ms;
        // A recorded charge waits for the next hit; a refused request for its own.
        let need = if applied { 1 } else { check.need() };
        let reset = if over && need <= check.limit {
            // The refused hits fit once `excess` of the oldest have aged
            // out (or now, when reporting a stored state they fit into):
            // at the expiry of the oldest entry through which that many
            // were admitted.
            match (count + need).checked_sub(check.limit) {
                Some(excess) if excess >= 1 => {
                    let i = self
                        .entries
                        .partition_point(|&(_, total)| total.wrapping_sub(self.base) < excess);
                    self.entries.get(i).map_or(0, |&(t, _)| expiry(t))
                }
                _ => 0,
            }
        } else {
            self.entries.back().map_or(0, |&(t, _)| expiry(t))
        };
        (remaining, reset)
    }

    /// A period from the newest entry, which may be stamped after now (a
    /// reservation's, or after the clock stepped back).
    fn ttl_ms(&self, check: &Check, now_ms: u64) -> u64 {
        let newest = self.entries.back().map_or(now_ms, |&(t, _)| t);
        (newest + check.period_ms)
            .saturating_sub(now_ms)
            .max(check.period_ms)
    }

    /// A reservation's entry is its own, stamped later than every entry
    /// before it (a millisecond after the newest, should that be now or
    /// later), so that its time alone finds it again, whatever refunds or
    /// rebases do to the totals; requests after it in the same millisecond
    /// may join it. The mark is that time.
    fn reserve(&mut self, check: &Check, now_ms: u64) -> u64 {
        let stamp = match self.entries.back() {
            Some(&(newest, _)) if newest >= now_ms => newest + 1,
            _ => now_ms,
        };
        let hits = recordable(check, self.count());
        if hits > 0 {
            self.entries
                .push_back((stamp, self.top().wrapping_add(hits)));
        }
        stamp
    }

    /// Takes `hits` off the reservation's entry and off the running totals
    /// of every later one: the work grows with the entries admitted since
    /// the reservation, never with hits. An entry that aged out (or is not
    /// found) gives nothing back: the reservation stays charged, the safe
    /// side. An entry left with no hits is dropped.
    fn refund(&mut self, _check: &Check, hits: u64, _reserved_at: u64, mark: u64, _now: u64) {
        let i = self.entries.partition_point(|&(t, _)| t < mark);
        let Some(&(t, total)) = self.entries.get(i) else {
            return;
        };
        if t != mark {
            return;
        }
        let before = i.checked_sub(1).map_or(self.base, |j| self.entries[j].1);
        let held = total.wrapping_sub(before);
        let take = hits.min(held);
        for entry in self.entries.iter_mut().skip(i) {
            entry.1 = entry.1.wrapping_sub(take);
        }
        if take == held {
            self.entries.remove(i);
        }
    }

    fn into_state(self) -> State {
        State::Log(Box::new(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm;

    fn check(hits: u64) -> Check {
        Check::for_test("k", Algorithm::SlidingLog, 1_000_000, 3_600_000, hits)
    }

    /// What a request does to a log (hits added to the newest entry in its
    /// millisecond, entries appended, a reservation's) is undone from where
    /// the log ended, without a copy of it.
    #[test]
    fn back_to_its_end_undoes_a_requests_hits() {
        let mut log = Log::default();
        for now in [0u64, 5, 10] {
            log.apply(&check(3), now);
        }
        let before = log.clone();
        let end = log.end();
        log.apply(&check(4), 10);
        log.apply(&check(2), 11);
        log.reserve(&check(7), 11);
        assert_ne!(log, before);
        log.back_to(&end);
        assert_eq!(log, before);
        let mut empty = Log::default();
        let end = empty.end();
        empty.apply(&check(1), 3);
        empty.back_to(&end);
        assert_eq!(empty, Log::default());
    }

    #[test]
    fn a_request_is_one_entry_whatever_its_hits() {
        let mut log = Log::default();
        for (i, now) in [0u64, 10, 20].into_iter().enumerate() {
            let c = check(300_000);
            assert!(!log.is_over(&c, now));
            log.apply(&c, now);
            assert_eq!(
                (log.entries.len(), log.count()),
                (i + 1, 300_000 * (i as u64 + 1))
            );
        }
        // Over: 200,000 fit once the first entry's 300,000 have aged out.
        let c = check(200_000);
        assert!(log.is_over(&c, 30));
        assert_eq!(log.report(&c, true, false, 30), (100_000, 3_600_000 - 30));
        // Requests in one millisecond share an entry.
        log.apply(&check(50_000), 30);
        log.apply(&check(50_000), 30);
        assert_eq!((log.entries.len(), log.count()), (4, 1_000_000));
    }

    #[test]
    fn a_refund_takes_hits_off_the_reservations_entry_and_the_later_totals() {
        let c = |hits| Check {
            limit: 100,
            period_ms: 1_000,
            ..check(hits)
        };
        let mut log = Log::default();
        log.apply(&c(5), 10);
        // Stamped a millisecond after the newest entry when that is now.
        let mark = log.reserve(&c(20), 10);
        assert_eq!(mark, 11);
        log.apply(&c(7), 11); // joins the reservation's entry
        log.apply(&c(1), 12);
        log.refund(&c(20), 15, 10, mark, 12);
        assert_eq!(log.entries, [(10, 5), (11, 17), (12, 18)]);
        assert_eq!(log.count(), 18);
        // Never more than the entry holds; an emptied entry goes.
        let mut log = Log::default();
        let mark = log.reserve(&c(20), 10);
        log.apply(&c(1), 12);
        log.refund(&c(20), 50, 10, mark, 12);
        assert_eq!((log.entries.len(), log.count()), (1, 1));
        // Aged out: nothing to give back.
        let mut log = Log::default();
        let mark = log.reserve(&c(20), 10);
        let mut log = Log::load(Some(log.into_state()), &c(0), 1_010);
        log.apply(&c(3), 1_010);
        log.refund(&c(20), 20, 10, mark, 1_010);
        assert_eq!(log.count(), 3);
    }

    #[test]
    fn running_totals_wrap_without_changing_a_decision() {
        let mut log = Log {
            entries: VecDeque::from([(0, u64::MAX - 1)]),
            base: u64::MAX - 3,
        };
        let c = Check {
            limit: 10,
            ..check(5)
        };
        log.apply(&c, 1);
        assert_eq!(log.count(), 7);
        assert!(log.is_over(&c, 2));
        // The first entry's 2 age out at 3,600,000: 5 fit from then on.
        assert_eq!(log.report(&c, true, false, 2).1, 3_600_000 - 2);
    }
}
