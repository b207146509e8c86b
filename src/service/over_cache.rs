//! Keys known to be over their limit, remembered until their window ends, so
//! a caller who is already refused (the hot key of an abusive client) costs
//! no store round trip.
//!
//! Only fixed-window counters qualify: within a window their count only
//! grows, so a counter at its limit refuses every request until the window
//! ends, on every replica. Each entry remembers the limit it was seen with;
//! a reload that changes the limit stops the entry from matching.
//!
//! Charges (a limit that records hits over its limit, `Check::charges`)
//! keep this true: the count only grows faster. A charge answered from here
//! is not recorded, which changes no decision while the limit stands: the
//! counter is already at its limit until the window ends, when its count,
//! however high, is dropped. A limit raised within the window finds the
//! count lower than with every charge recorded (theirs, cache off by
//! default), so it admits those uncounted hits more (README: Differences).
//!
//! Two callers lower a count on purpose, and then [`OverCache::forget`] its
//! keys on this replica: the admin API's reset and a budget's settle that
//! gives back an unused estimate (other replicas keep refusing until the
//! window ends, as documented in the README). A decision whose store call
//! was under way meanwhile may have read the count from before: it learns
//! none of the keys forgotten since it asked ([`Ticket`]), or a reset
//! answered 200 would be undone by it until the window ends.
//!
//! Unless Redis lost the counter: after a restart or a failover to a server
//! without the data, other replicas admit again while this one would keep
//! refusing until the window ends. So the whole cache is dropped whenever
//! the store's [`Generation`] changes (the next request that asks it after
//! the change finds it empty).

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock};

use crate::limiter::{Algorithm, Check, Outcome};
use crate::store::Generation;

/// Most bytes the cache takes by default (some 100,000 keys of a usual
/// length); past it, expired entries are dropped first and new ones not
/// added until there is room.
pub const DEFAULT_CAPACITY_BYTES: usize = 100_000 * 128;

/// Fewest milliseconds between two sweeps of a full cache for expired
/// entries (each one looks at every entry).
const SWEEP_EVERY_MS: u64 = 100;

/// What one remembered key costs beside the key's own bytes, about (its
/// string, its two numbers, the map's share, the allocator's), so that the
/// cache holds `LOCAL_CACHE_SIZE_IN_BYTES` as envoyproxy/ratelimit's
/// freecache does, whatever its keys' lengths: counted as 128 bytes each,
/// 100,000 keys of 4 KiB took 468 MB.
const ENTRY_OVERHEAD_BYTES: usize = 72;

/// Keys forgotten lately that a decision under way may still learn:
/// past this many forgets since it asked, it learns nothing. Every settle
/// forgets its keys: 1,024 covers some 50,000 settles a second during a
/// 20 ms store call (16 KiB a cache; the scan runs only for a decision
/// that saw forgets and found a counter full).
const RECENTLY_FORGOTTEN: usize = 1024;

/// The forgets made so far when a decision asked the store: what it may
/// learn afterwards ([`OverCache::learn`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(u64);

/// The keys forgotten lately, as hashes, each with the count of forgets
/// it was forgotten at.
#[derive(Debug)]
struct Forgotten {
    /// Forgets so far (changed under `recent`'s lock).
    count: AtomicU64,
    recent: Mutex<Vec<(u64, u64)>>,
    hasher: std::collections::hash_map::RandomState,
}

impl Default for Forgotten {
    fn default() -> Self {
        Forgotten {
            count: AtomicU64::new(0),
            recent: Mutex::new(vec![(0, 0); RECENTLY_FORGOTTEN]),
            hasher: Default::default(),
        }
    }
}

impl Forgotten {
    fn record(&self, keys: &[String]) {
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let mut count = self.count.load(Ordering::Relaxed);
        for key in keys {
            count += 1;
            recent[count as usize % RECENTLY_FORGOTTEN] = (count, self.hasher.hash_one(key));
        }
        // SeqCst, with `learn`'s: see there.
        self.count.store(count, Ordering::SeqCst);
    }

    /// Whether `key` may be learnt by a decision that asked at `ticket`:
    /// not forgotten since (or too many forgets since to tell).
    fn learnable(&self, recent: &[(u64, u64)], count: u64, ticket: Ticket, key: &str) -> bool {
        if count - ticket.0 > RECENTLY_FORGOTTEN as u64 {
            return false;
        }
        let hash = self.hasher.hash_one(key);
        !recent.iter().any(|&(at, h)| at > ticket.0 && h == hash)
    }
}

/// What remembering `key` costs.
fn entry_bytes(key: &str) -> usize {
    key.len() + ENTRY_OVERHEAD_BYTES
}

/// Every request asks the cache, so asking takes no exclusive lock: readers
/// share a read lock, and while nothing is remembered (a service whose
/// callers all stay under their limits) no lock at all.
#[derive(Debug)]
pub struct OverCache {
    /// Key -> (until, in the store's clock's milliseconds; the limit).
    entries: RwLock<HashMap<String, (u64, u64)>>,
    /// Whether `entries` may hold anything (set before the first insert).
    any: AtomicBool,
    /// The store's generation, and the one `entries` were learnt in.
    generation: Generation,
    learnt_in: AtomicU64,
    /// Most bytes taken ([`entry_bytes`] of each key; 0: the cache is
    /// off), and taken now (changed under the write lock).
    capacity_bytes: usize,
    bytes: AtomicUsize,
    /// The earliest expiry of the entries (ms, the store's clock; at most:
    /// `u64::MAX` when empty), and when the last sweep for expired entries
    /// was. A full cache sweeps only once the earliest has passed and
    /// [`SWEEP_EVERY_MS`] after the last sweep; until then a new key is not
    /// remembered, without looking: a full cache of unexpired keys (more
    /// callers over an hourly limit than it holds) scanned all of them for
    /// every newly refused caller, under the lock every request takes.
    earliest_until_ms: AtomicU64,
    swept_at_ms: AtomicU64,
    /// For envoyproxy/ratelimit's `localcache` stats ([`CacheStats`]).
    hits: AtomicU64,
    expired: AtomicU64,
    overwrites: AtomicU64,
    forgotten: Forgotten,
}

/// What envoyproxy/ratelimit's local cache stats (freecache's counts) say
/// where the meaning carries over to this cache, read when stats are sent.
/// Counting costs the requests answered from the cache one atomic add and
/// the others nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Keys remembered now (`entryCount`; expired ones count until dropped).
    pub entries: u64,
    /// Keys answered from the cache, in all (`hitCount`): a request is
    /// answered from here when every one of its keys is remembered.
    pub hits: u64,
    /// Expired keys dropped to make room, in all (`expiredCount`).
    pub expired: u64,
    /// Keys remembered again over an entry still held, in all
    /// (`overwriteCount`).
    pub overwrites: u64,
}

impl Default for OverCache {
    fn default() -> Self {
        OverCache::new(Generation::default())
    }
}

/// Whether `outcome` shows `check`'s counter full: at its limit, refusing
/// even one more hit, and a fixed window. Shadow-mode and quota-mode
/// limits too, as theirs caches every key over its limit: their requests
/// are answered as the store would (over, not refused), and counted as
/// theirs counts them (`over_limit_with_local_cache`).
fn full(check: &Check, outcome: &Outcome) -> bool {
    check.algorithm == Algorithm::FixedWindow && outcome.over && outcome.remaining == 0
}

/// The outcome of `check` if `entries` remember its counter full now.
fn remembered(entries: &HashMap<String, (u64, u64)>, check: &Check, now: u64) -> Option<Outcome> {
    let &(until, limit) = entries.get(&check.key)?;
    (check.algorithm == Algorithm::FixedWindow && limit == check.limit && until > now).then(|| {
        Outcome {
            over: true,
            remaining: 0,
            reset_ms: until - now,
            remaining_before: None,
        }
    })
}

impl OverCache {
    /// An empty cache of [`DEFAULT_CAPACITY_BYTES`], dropped whenever
    /// `generation` changes.
    pub fn new(generation: Generation) -> Self {
        OverCache::with_capacity(generation, DEFAULT_CAPACITY_BYTES)
    }

    /// As [`OverCache::new`], taking at most `capacity_bytes` (0: none,
    /// every request asks the store).
    pub fn with_capacity(generation: Generation, capacity_bytes: usize) -> Self {
        OverCache {
            entries: RwLock::default(),
            any: AtomicBool::new(false),
            learnt_in: AtomicU64::new(generation.current()),
            generation,
            capacity_bytes,
            bytes: AtomicUsize::new(0),
            earliest_until_ms: AtomicU64::new(u64::MAX),
            swept_at_ms: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            overwrites: AtomicU64::new(0),
            forgotten: Forgotten::default(),
        }
    }

    /// Taken by a decision before it asks the store, for [`Self::learn`].
    pub fn ticket(&self) -> Ticket {
        Ticket(self.forgotten.count.load(Ordering::Acquire))
    }

    /// The counts behind the `localcache` stats.
    pub fn stats(&self) -> CacheStats {
        let entries = self.entries.read().unwrap_or_else(|p| p.into_inner()).len();
        CacheStats {
            entries: entries as u64,
            hits: self.hits.load(Ordering::Relaxed),
            expired: self.expired.load(Ordering::Relaxed),
            overwrites: self.overwrites.load(Ordering::Relaxed),
        }
    }

    /// Empties the cache if the store's generation moved since its entries
    /// were learnt; returns whether it did.
    fn drop_if_stale(&self) -> bool {
        let now = self.generation.current();
        if self.learnt_in.load(Ordering::Acquire) == now {
            return false;
        }
        let mut entries = self.entries.write().unwrap_or_else(|p| p.into_inner());
        if !entries.is_empty() {
            tracing::info!(
                keys = entries.len(),
                "over-limit cache dropped: Redis may have lost its data"
            );
        }
        entries.clear();
        self.bytes.store(0, Ordering::Relaxed);
        self.earliest_until_ms.store(u64::MAX, Ordering::Relaxed);
        // Under the write lock: `learn` sets it again only after this.
        self.any.store(false, Ordering::Release);
        self.learnt_in.store(now, Ordering::Release);
        true
    }

    /// Remembers the checks the store found full (at the limit, refusing
    /// even one more hit), but for keys forgotten since the decision asked
    /// the store (`ticket`): it may have read their counts from before.
    /// `now_ms` is the store's clock (tests pin it).
    pub fn learn(&self, ticket: Ticket, checks: &[Check], outcomes: &[Outcome], now_ms: u64) {
        if self.capacity_bytes == 0 || !checks.iter().zip(outcomes).any(|(c, o)| full(c, o)) {
            return;
        }
        self.drop_if_stale();
        let now = now_ms;
        let mut entries = self.entries.write().unwrap_or_else(|p| p.into_inner());
        // `any` set, then the forgets counted; `forget` counts, then reads
        // `any` (all SeqCst): a forget this does not see sees `any`, and
        // removes what this learns once it has the entries' lock.
        self.any.store(true, Ordering::SeqCst);
        let recent = (self.forgotten.count.load(Ordering::SeqCst) != ticket.0).then(|| {
            self.forgotten
                .recent
                .lock()
                .unwrap_or_else(|p| p.into_inner())
        });
        // Read again under the ring's lock, which every forget holds while
        // it counts: the ring and the count agree.
        let count = self.forgotten.count.load(Ordering::SeqCst);
        for (check, outcome) in checks.iter().zip(outcomes) {
            if !full(check, outcome) {
                continue;
            }
            if let Some(recent) = &recent {
                if !self.forgotten.learnable(recent, count, ticket, &check.key) {
                    continue;
                }
            }
            // A key already held is updated in place, whatever the room.
            let room = |bytes: usize| bytes + entry_bytes(&check.key) <= self.capacity_bytes;
            if !room(self.bytes.load(Ordering::Relaxed)) && !entries.contains_key(&check.key) {
                let swept_at = self.swept_at_ms.load(Ordering::Relaxed);
                if now < self.earliest_until_ms.load(Ordering::Relaxed)
                    || now < swept_at.saturating_add(SWEEP_EVERY_MS)
                {
                    continue;
                }
                let (mut earliest, mut dropped, mut freed) = (u64::MAX, 0, 0);
                entries.retain(|key, (until, _)| {
                    let kept = *until > now;
                    if kept {
                        earliest = earliest.min(*until);
                    } else {
                        (dropped, freed) = (dropped + 1, freed + entry_bytes(key));
                    }
                    kept
                });
                self.bytes.fetch_sub(freed, Ordering::Relaxed);
                self.expired.fetch_add(dropped, Ordering::Relaxed);
                self.earliest_until_ms.store(earliest, Ordering::Relaxed);
                self.swept_at_ms.store(now, Ordering::Relaxed);
                if !room(self.bytes.load(Ordering::Relaxed)) {
                    continue;
                }
            }
            let until = now + outcome.reset_ms;
            self.earliest_until_ms.fetch_min(until, Ordering::Relaxed);
            if entries
                .insert(check.key.clone(), (until, check.limit))
                .is_some()
            {
                self.overwrites.fetch_add(1, Ordering::Relaxed);
            } else {
                self.bytes
                    .fetch_add(entry_bytes(&check.key), Ordering::Relaxed);
            }
        }
    }

    /// If every check is a remembered full counter, the outcomes the store
    /// would give (over, nothing remaining, the time left); else `None`.
    pub fn answer(&self, checks: &[Check], now_ms: u64) -> Option<Vec<Outcome>> {
        if checks.is_empty() || !self.any.load(Ordering::Acquire) || self.drop_if_stale() {
            return None;
        }
        let entries = self.entries.read().unwrap_or_else(|p| p.into_inner());
        let known: Option<Vec<Outcome>> = checks
            .iter()
            .map(|check| remembered(&entries, check, now_ms))
            .collect();
        if known.is_some() {
            self.hits.fetch_add(checks.len() as u64, Ordering::Relaxed);
        }
        known
    }

    /// Counts `checks` answered from what [`Self::peek`] showed, as
    /// [`Self::answer`] counts its own.
    pub fn count_answered(&self, checks: usize) {
        self.hits.fetch_add(checks as u64, Ordering::Relaxed);
    }

    /// The outcome this cache would answer `check` with, if it remembers
    /// its counter full; counted nowhere (the admin API's inspect).
    pub fn peek(&self, check: &Check, now_ms: u64) -> Option<Outcome> {
        if !self.any.load(Ordering::Acquire) || self.drop_if_stale() {
            return None;
        }
        let entries = self.entries.read().unwrap_or_else(|p| p.into_inner());
        remembered(&entries, check, now_ms)
    }

    /// Forgets `keys` (their counters were reset), so the next request on
    /// them asks the store again, and a decision under way learns none of
    /// them.
    pub fn forget(&self, keys: &[String]) {
        if self.capacity_bytes == 0 {
            return;
        }
        self.forgotten.record(keys);
        if !self.any.load(Ordering::SeqCst) {
            return;
        }
        let mut entries = self.entries.write().unwrap_or_else(|p| p.into_inner());
        for key in keys {
            if entries.remove(key).is_some() {
                self.bytes.fetch_sub(entry_bytes(key), Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full counter's outcome, 50 ms before its window ends.
    const FULL: Outcome = Outcome {
        over: true,
        remaining: 0,
        reset_ms: 50,
        remaining_before: None,
    };

    fn check(key: &str, algorithm: Algorithm, limit: u64) -> Check {
        Check::for_test(key, algorithm, limit, 60_000, 1)
    }

    #[test]
    fn remembers_only_full_fixed_windows_until_reset_and_for_the_same_limit() {
        let cache = OverCache::default();
        let full = FULL;
        let fw = check("a", Algorithm::FixedWindow, 3);
        let tb = check("b", Algorithm::TokenBucket, 3);
        let partial = Outcome {
            remaining: 2,
            ..full
        };
        cache.learn(
            cache.ticket(),
            &[
                fw.clone(),
                tb.clone(),
                check("c", Algorithm::FixedWindow, 3),
            ],
            &[full, full, partial],
            1_000,
        );
        assert_eq!(
            cache
                .answer(std::slice::from_ref(&fw), 1_020)
                .map(|o| o[0].reset_ms),
            Some(30)
        );
        assert!(
            cache.answer(&[tb], 1_000).is_none(),
            "token buckets refill: never cached"
        );
        assert!(
            cache
                .answer(&[check("c", Algorithm::FixedWindow, 3)], 1_000)
                .is_none(),
            "over only for a big request"
        );
        assert!(
            cache
                .answer(&[fw.clone(), check("d", Algorithm::FixedWindow, 3)], 1_000)
                .is_none(),
            "all checks or none"
        );
        assert!(
            cache
                .answer(&[check("a", Algorithm::FixedWindow, 10)], 1_000)
                .is_none(),
            "the limit changed"
        );
        assert!(cache.answer(&[fw], 1_050).is_none(), "the window ended");
    }

    /// A shadow-mode (or quota-mode) limit's full window is remembered as
    /// an enforced one's: theirs caches every key over its limit, and the
    /// answer still says over, for the service to let through and count.
    #[test]
    fn remembers_full_windows_of_limits_that_do_not_refuse() {
        let cache = OverCache::default();
        let shadow = Check {
            enforce: false,
            ..check("s", Algorithm::FixedWindow, 3)
        };
        let full = FULL;
        cache.learn(
            cache.ticket(),
            std::slice::from_ref(&shadow),
            &[full],
            1_000,
        );
        let answer = cache.answer(&[shadow], 1_010);
        assert_eq!(answer.map(|o| (o[0].over, o[0].reset_ms)), Some((true, 40)));
    }

    #[test]
    fn forgets_reset_keys() {
        let cache = OverCache::default();
        let fw = [check("a", Algorithm::FixedWindow, 3)];
        let full = FULL;
        cache.learn(cache.ticket(), &fw, &[full], 1_000);
        assert!(cache.answer(&fw, 1_010).is_some());
        cache.forget(&["a".to_owned()]);
        assert!(cache.answer(&fw, 1_010).is_none(), "the counter was reset");
    }

    #[test]
    fn remembers_at_most_its_capacity_and_nothing_at_zero() {
        let full = FULL;
        let off = OverCache::with_capacity(Generation::default(), 0);
        let a = [check("a", Algorithm::FixedWindow, 3)];
        off.learn(off.ticket(), &a, &[full], 1_000);
        assert!(off.answer(&a, 1_010).is_none(), "capacity 0: off");
        let one = OverCache::with_capacity(Generation::default(), entry_bytes("a"));
        let b = [check("b", Algorithm::FixedWindow, 3)];
        one.learn(one.ticket(), &a, &[full], 1_000);
        one.learn(one.ticket(), &b, &[full], 1_000);
        assert!(one.answer(&a, 1_010).is_some());
        assert!(one.answer(&b, 1_010).is_none(), "no room for a second key");
        // Full, it still learns a later end of the window it holds.
        one.learn(
            one.ticket(),
            &a,
            &[Outcome {
                reset_ms: 100,
                ..full
            }],
            1_020,
        );
        let later = one.answer(&a, 1_060).map(|o| o[0].reset_ms);
        assert_eq!(later, Some(60), "the key it holds, learnt again");
        // Sized in bytes: a long key takes the room of many short ones.
        let long = "k".repeat(4_096);
        let sized =
            OverCache::with_capacity(Generation::default(), entry_bytes(&long) + entry_bytes("a"));
        let long = [check(&long, Algorithm::FixedWindow, 3)];
        for learnt in [&long, &a, &b] {
            sized.learn(sized.ticket(), learnt, &[full], 1_000);
        }
        assert!(sized.answer(&long, 1_010).is_some() && sized.answer(&a, 1_010).is_some());
        assert!(sized.answer(&b, 1_010).is_none(), "no room left");
        sized.forget(&[long[0].key.clone()]);
        sized.learn(sized.ticket(), &b, &[full], 1_020);
        assert!(
            sized.answer(&b, 1_030).is_some(),
            "the room a forgotten key freed"
        );
    }

    #[test]
    fn counts_what_the_localcache_stats_say() {
        let full = FULL;
        let cache = OverCache::with_capacity(Generation::default(), 2 * entry_bytes("a"));
        let [a, b, c] = ["a", "b", "c"].map(|k| [check(k, Algorithm::FixedWindow, 3)]);
        cache.learn(cache.ticket(), &a, &[full], 1_000);
        cache.learn(cache.ticket(), &a, &[full], 1_001);
        assert!(cache.answer(&a, 1_010).is_some());
        assert!(cache.answer(&[a[0].clone(), b[0].clone()], 1_010).is_none());
        let stats = cache.stats();
        assert_eq!((stats.entries, stats.hits, stats.overwrites), (1, 1, 1));
        // Past a's window, with the cache full, c takes its room: a is
        // dropped as expired.
        cache.learn(cache.ticket(), &b, &[full], 1_060);
        cache.learn(cache.ticket(), &c, &[full], 1_100);
        assert!(cache.answer(&c, 1_105).is_some());
        let stats = cache.stats();
        assert_eq!((stats.entries, stats.hits, stats.expired), (2, 2, 1));
    }

    /// A full cache looks for expired entries only once its earliest has
    /// passed, and not twice within SWEEP_EVERY_MS: until then a new key
    /// is not remembered, and nothing is scanned (the `expired` count
    /// shows each sweep that freed room).
    #[test]
    fn a_full_cache_sweeps_only_once_an_entry_can_have_expired() {
        let full = |reset_ms| Outcome {
            over: true,
            remaining: 0,
            reset_ms,
            remaining_before: None,
        };
        let cache = OverCache::with_capacity(Generation::default(), 2 * entry_bytes("a"));
        let [a, b, c, d, e] =
            ["a", "b", "c", "d", "e"].map(|k| [check(k, Algorithm::FixedWindow, 3)]);
        cache.learn(cache.ticket(), &a, &[full(1_000)], 0); // until 1,000
        cache.learn(cache.ticket(), &b, &[full(1_010)], 0); // until 1,010
        cache.learn(cache.ticket(), &c, &[full(5_000)], 999);
        assert!(cache.answer(&c, 999).is_none(), "full, nothing expired yet");
        assert_eq!(cache.stats().expired, 0);
        cache.learn(cache.ticket(), &c, &[full(5_000)], 1_000); // a expires: c takes its room
        assert!(cache.answer(&c, 1_000).is_some());
        assert_eq!(cache.stats().expired, 1);
        // b has expired too, but the last sweep was 20 ms ago.
        cache.learn(cache.ticket(), &d, &[full(5_000)], 1_020);
        assert!(cache.answer(&d, 1_020).is_none());
        assert_eq!(cache.stats().expired, 1);
        cache.learn(cache.ticket(), &d, &[full(5_000)], 1_100);
        assert!(cache.answer(&d, 1_100).is_some());
        assert_eq!(cache.stats().expired, 2);
        // Full of entries that live until 6,000 and more: no sweep before.
        cache.learn(cache.ticket(), &e, &[full(1_000)], 5_000);
        assert!(cache.answer(&e, 5_000).is_none());
        assert_eq!(cache.stats().expired, 2);
    }

    #[test]
    fn forgets_everything_when_the_store_generation_changes() {
        let generation = Generation::default();
        let cache = OverCache::new(generation.clone());
        let fw = [check("a", Algorithm::FixedWindow, 3)];
        let full = FULL;
        cache.learn(cache.ticket(), &fw, &[full], 1_000);
        assert!(cache.answer(&fw, 1_010).is_some());
        generation.bump();
        assert!(cache.answer(&fw, 1_010).is_none(), "Redis lost the counter");
        cache.learn(cache.ticket(), &fw, &[full], 1_020);
        assert!(
            cache.answer(&fw, 1_030).is_some(),
            "learns again afterwards"
        );
    }

    /// A decision that asked the store before a key was forgotten (its
    /// counter reset meanwhile) learns nothing of that key, but learns the
    /// others; past RECENTLY_FORGOTTEN forgets since, nothing at all.
    #[test]
    fn a_decision_under_way_learns_no_key_forgotten_since_it_asked() {
        let cache = OverCache::default();
        let full = FULL;
        let (a, b) = (
            check("a", Algorithm::FixedWindow, 3),
            check("b", Algorithm::FixedWindow, 3),
        );
        let asked = cache.ticket();
        cache.forget(&["a".to_owned()]);
        cache.learn(asked, &[a.clone(), b.clone()], &[full, full], 1_000);
        assert!(cache.answer(std::slice::from_ref(&a), 1_000).is_none());
        assert!(cache.answer(std::slice::from_ref(&b), 1_000).is_some());
        // Asked after the forget: learnt.
        cache.learn(cache.ticket(), std::slice::from_ref(&a), &[full], 1_000);
        assert!(cache.answer(std::slice::from_ref(&a), 1_000).is_some());

        let c = check("c", Algorithm::FixedWindow, 3);
        let asked = cache.ticket();
        let others: Vec<String> = (0..RECENTLY_FORGOTTEN).map(|i| format!("x{i}")).collect();
        cache.forget(&others);
        cache.learn(asked, std::slice::from_ref(&c), &[full], 1_000);
        assert!(
            cache.answer(std::slice::from_ref(&c), 1_000).is_some(),
            "RECENTLY_FORGOTTEN since: told apart"
        );
        let asked = cache.ticket();
        cache.forget(&others);
        cache.forget(&["y".to_owned()]);
        let d = check("d", Algorithm::FixedWindow, 3);
        cache.learn(asked, std::slice::from_ref(&d), &[full], 1_000);
        assert!(cache.answer(&[d], 1_000).is_none(), "one more: cannot tell");
    }
}
