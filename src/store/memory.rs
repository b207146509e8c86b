//! The embedded in-memory store: the default when no Redis is configured,
//! for one replica (or tests). Sharded maps behind mutexes; a request's
//! batch locks every shard it touches (in shard order, so batches never
//! deadlock) and is therefore atomic like a Lua script on Redis. Expired
//! counters are swept in the background, a slice of the shards per tick.
//!
//! A counter is filed under a 128-bit digest of its key ([`KeyId`]), not
//! the key itself: a key is some 50 to 100 bytes in a heap allocation of
//! its own, the digest 16 bytes inline, which roughly halves the memory a
//! live counter costs. The digest is SipHash-1-3 under a key drawn at random
//! for each store, computed twice (domain-separated) for 128 bits: two of a
//! million live keys share a counter with probability about 2^-89, and a
//! client cannot steer towards a collision without the secret.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use super::budget::{Reservation, Reserved, Settled, Taken};
use super::lease::{Acquired, LeaseRef, LeaseSlot, LiveLease};
use crate::clock::Clock;
use crate::limiter::{batch, budget, Check, Outcome, State};

const SHARDS: usize = 64;

#[derive(Debug, Clone)]
struct Slot {
    state: State,
    expires_at_ms: u64,
}

// A million live keys is the sizing case (BENCHMARKS.md): every byte of a
// table entry counts once per key and again for the table's empty buckets.
const _: () = assert!(std::mem::size_of::<(KeyId, Slot)>() <= 56);

/// A counter key's 128-bit keyed digest (see the module doc). The first
/// word picks the shard, the second is the hash inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KeyId([u64; 2]);

impl Hash for KeyId {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.0[1]);
    }
}

/// The shards' hasher: a [`KeyId`] is already a uniform hash, so it passes
/// its second word through rather than hashing it again.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write_u64(&mut self, word: u64) {
        self.0 = word;
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `KeyId`s are hashed here, by `write_u64`; anything else
        // still gets a (weak) hash rather than none.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
}

type Shard = HashMap<KeyId, Slot, BuildHasherDefault<PassThrough>>;

/// Lease sets: set key -> lease member -> its expiry and holder.
type LeaseSets = HashMap<String, HashMap<String, Held>>;

/// One lease in a set.
#[derive(Debug)]
struct Held {
    /// Unix ms.
    expiry: u64,
    holder: Box<str>,
}

/// Settlements: nonce -> the actual a reservation was settled at, and the
/// reservation's expiry (ms). One per settled reservation (there are no
/// hash slots here, so no record key per slot). Locked after the
/// counters' shards, never before.
type Settlements = HashMap<String, (u64, u64)>;

/// Counters, leases and settlements kept in this process.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Vec<Mutex<Shard>>,
    /// The secret SipHash key of this store's [`KeyId`]s.
    digest: RandomState,
    leases: Mutex<LeaseSets>,
    settlements: Mutex<Settlements>,
    /// [`Self::shared_value`]'s values.
    shared: Mutex<HashMap<String, String>>,
    /// What buckets' settles gave back ([`budget::GivenBack`]); locked
    /// after the settlements, never before.
    given_back: Mutex<budget::GivenBack>,
    /// When the admin API last reset a counter, per key, and until when
    /// that is remembered ([`budget::RESET_KEEP_MS`]); locked after the
    /// counters' shards and the settlements, never before, and never with
    /// `given_back`. A reservation made in the millisecond of a reset,
    /// after it, counts as made before it (gives nothing back: never more
    /// than it should), as in Redis.
    resets: Mutex<HashMap<String, (u64, u64)>>,
    clock: Arc<dyn Clock>,
    /// Most counters a shard holds (`usize::MAX`: no cap; see
    /// [`Self::with_max_keys`]).
    shard_capacity: usize,
    /// New counters not written for the cap, in all.
    untracked: AtomicU64,
}

impl MemoryStore {
    /// A store reading time from `clock`, with a background sweeper (when
    /// called inside a Tokio runtime) that stops when the store is dropped.
    pub fn new(clock: Arc<dyn Clock>) -> Arc<Self> {
        Self::with_shard_capacity(clock, usize::MAX)
    }

    /// [`Self::new`], holding at most `max_keys` live counters rounded up to
    /// a multiple of the shards (each shard its share, at least one). Past
    /// that a new key's counter is not written: the key is decided as a new
    /// one every time, so its requests are admitted up to the limit each,
    /// while every counter already held keeps counting. Counters leave as
    /// the sweeper drops them (a full pass over the shards every 4 s) or as
    /// they are deleted. For `failure_mode: local`, whose keys an outage
    /// alone decides.
    pub fn with_max_keys(clock: Arc<dyn Clock>, max_keys: usize) -> Arc<Self> {
        Self::with_shard_capacity(clock, max_keys.div_ceil(SHARDS).max(1))
    }

    fn with_shard_capacity(clock: Arc<dyn Clock>, shard_capacity: usize) -> Arc<Self> {
        let store = Arc::new(MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            digest: RandomState::new(),
            leases: Mutex::new(HashMap::new()),
            settlements: Mutex::new(HashMap::new()),
            shared: Mutex::new(HashMap::new()),
            given_back: Mutex::default(),
            resets: Mutex::default(),
            clock,
            shard_capacity,
            untracked: AtomicU64::new(0),
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(sweep_forever(Arc::downgrade(&store)));
        }
        store
    }

    fn id(&self, key: &str) -> KeyId {
        let half = |domain: u8| {
            let mut h = self.digest.build_hasher();
            h.write_u8(domain);
            h.write(key.as_bytes());
            h.finish()
        };
        KeyId([half(0), half(1)])
    }

    fn shard_of(id: KeyId) -> usize {
        (id.0[0] % SHARDS as u64) as usize
    }

    fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
        // A panic while holding the lock cannot leave an entry half-written
        // (entries are replaced whole), so a poisoned map is still consistent.
        mutex
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Takes a lease in every slot, or in none (twin of `lua/leases.lua`).
    pub fn acquire(
        &self,
        slots: &[LeaseSlot],
        member: &str,
        holder: &str,
        ttl_ms: u64,
    ) -> Acquired {
        let now = self.clock.now_ms();
        let mut sets = Self::lock(&self.leases);
        let mut acquired = Acquired {
            granted: true,
            active: Vec::with_capacity(slots.len()),
            expired: 0,
            retry_after_ms: 0,
        };
        for slot in slots {
            let set = sets.entry(slot.key.clone()).or_default();
            let before = set.len();
            set.retain(|_, held| held.expiry > now);
            acquired.expired += (before - set.len()) as u64;
            acquired.active.push(set.len() as u64);
            if set.len() as u64 >= slot.limit {
                acquired.granted = false;
                if let Some(first) = set.values().map(|held| held.expiry).min() {
                    acquired.retry_after_ms =
                        acquired.retry_after_ms.max(first.saturating_sub(now));
                }
            }
        }
        if acquired.granted {
            for (slot, active) in slots.iter().zip(&mut acquired.active) {
                if let Some(set) = sets.get_mut(&slot.key) {
                    let held = Held {
                        expiry: now.saturating_add(ttl_ms),
                        holder: holder.into(),
                    };
                    set.insert(member.to_owned(), held);
                    *active += 1;
                }
            }
        }
        acquired
    }

    /// Extends each lease present and unexpired in all its sets; a lost lease
    /// is removed from all of them. Returns which are alive.
    pub fn heartbeat(&self, leases: &[LeaseRef<'_>]) -> Vec<bool> {
        let now = self.clock.now_ms();
        let mut sets = Self::lock(&self.leases);
        leases
            .iter()
            .map(|lease| {
                let alive = lease.keys.iter().all(|key| {
                    sets.get(key)
                        .and_then(|set| set.get(lease.member))
                        .is_some_and(|held| held.expiry > now)
                });
                for key in lease.keys {
                    if let Some(set) = sets.get_mut(key) {
                        if alive {
                            if let Some(held) = set.get_mut(lease.member) {
                                held.expiry = now.saturating_add(lease.ttl_ms);
                            }
                        } else {
                            set.remove(lease.member);
                        }
                    }
                }
                alive
            })
            .collect()
    }

    /// Removes leases; unknown ones are ignored.
    pub fn release(&self, leases: &[LeaseRef<'_>]) {
        let mut sets = Self::lock(&self.leases);
        for lease in leases {
            for key in lease.keys {
                if let Some(set) = sets.get_mut(key) {
                    set.remove(lease.member);
                }
            }
        }
    }

    /// Applies one request's checks atomically (see [`batch::evaluate`]).
    pub fn apply(&self, checks: &[Check], all_or_nothing: bool) -> Vec<Outcome> {
        let now = self.clock.now_ms();
        let mut table = self.lock_keys(checks.iter().map(|c| c.key.as_str()));
        let outcomes = batch::evaluate(&mut table, checks, all_or_nothing, now);
        if table.untracked > 0 {
            self.untracked.fetch_add(table.untracked, Ordering::Relaxed);
        }
        outcomes
    }

    /// New counters not written because the store held its most (see
    /// [`Self::with_max_keys`]), since it was made.
    pub fn untracked(&self) -> u64 {
        self.untracked.load(Ordering::Relaxed)
    }

    /// The shards of `keys`, locked in shard order (so that two callers
    /// never deadlock).
    fn lock_keys<'a>(&'a self, keys: impl Iterator<Item = &'a str>) -> LockedShards<'a> {
        // Sorted, so each read and write finds its key by bisection: a
        // request at the caps has thousands.
        let mut ids: Vec<(&str, KeyId)> = keys.map(|key| (key, self.id(key))).collect();
        ids.sort_unstable_by(|a, b| a.0.cmp(b.0));
        ids.dedup_by(|a, b| a.0 == b.0);
        let mut indices: Vec<usize> = ids.iter().map(|&(_, id)| Self::shard_of(id)).collect();
        indices.sort_unstable();
        indices.dedup();
        LockedShards {
            guards: indices
                .iter()
                .map(|&i| (i, Self::lock(&self.shards[i])))
                .collect(),
            ids,
            capacity: self.shard_capacity,
            taken: Vec::new(),
            untracked: 0,
        }
    }

    /// Reserves `checks`' hits all or nothing (see
    /// [`crate::store::budget`]); atomic like [`Self::apply`].
    pub fn reserve(&self, checks: &[Check], ttl_ms: u64) -> Reserved {
        let now = self.clock.now_ms();
        let mut table = self.lock_keys(checks.iter().map(|c| c.key.as_str()));
        let (outcomes, marks) = budget::reserve(
            &mut table,
            &mut Self::lock(&self.given_back),
            checks,
            ttl_ms,
            now,
        );
        Reserved {
            granted: marks.is_some(),
            outcomes,
            taken: marks
                .unwrap_or_default()
                .into_iter()
                .map(|mark| Taken { at_ms: now, mark })
                .collect(),
        }
    }

    /// Settles `reservation` at `actual` unless its TTL has passed, once;
    /// atomic like [`Self::apply`].
    pub fn settle(&self, reservation: &Reservation<'_>, actual: u64) -> Settled {
        let Some(taken) = reservation.taken.first() else {
            return Settled::Unknown;
        };
        let now = self.clock.now_ms();
        let expiry = taken.at_ms.saturating_add(reservation.ttl_ms);
        let checks = reservation.checks;
        let mut table = self.lock_keys(checks.iter().map(|c| c.key.as_str()));
        let mut settlements = Self::lock(&self.settlements);
        let nonce = reservation.nonce;
        if let Some(&(earlier, _)) = settlements.get(nonce).filter(|(_, e)| *e > now) {
            return Settled::Already {
                actual: earlier,
                outcomes: budget::standing(&mut table, checks, now),
            };
        }
        if now >= expiry {
            return Settled::Unknown;
        }
        settlements.insert(nonce.to_owned(), (actual, expiry));
        let erased = self.erased(reservation, now);
        let given_back = &mut Self::lock(&self.given_back);
        let of = budget::Reservation {
            checks,
            taken: reservation.taken,
        };
        Settled::Settled {
            outcomes: budget::settle(&mut table, given_back, of, &erased, actual, now),
        }
    }

    /// The value under `name`, set to `candidate` first if it had none.
    pub fn shared_value(&self, name: &str, candidate: &str) -> String {
        Self::lock(&self.shared)
            .entry(name.to_owned())
            .or_insert_with(|| candidate.to_owned())
            .clone()
    }

    /// Per check of `reservation`, whether its counter was reset when or
    /// after the reservation took from it.
    fn erased(&self, reservation: &Reservation<'_>, now_ms: u64) -> Vec<bool> {
        let resets = Self::lock(&self.resets);
        reservation
            .checks
            .iter()
            .zip(reservation.taken)
            .map(|(check, taken)| {
                resets
                    .get(&check.key)
                    .is_some_and(|&(reset, until)| until > now_ms && reset >= taken.at_ms)
            })
            .collect()
    }

    /// Deletes counters, missing keys ignored, and remembers when (see
    /// [`budget::RESET_KEEP_MS`]).
    pub fn delete(&self, keys: &[String]) {
        let now = self.clock.now_ms();
        let until = now.saturating_add(budget::RESET_KEEP_MS);
        for key in keys {
            let id = self.id(key);
            let mut shard = Self::lock(&self.shards[Self::shard_of(id)]);
            let removed = shard.remove(&id);
            // Recorded with the counter's removal, under its shard's lock:
            // a reservation on it is either before both or after both.
            Self::lock(&self.resets).insert(key.clone(), (now, until));
            drop(shard);
            // A bucket's queue counts as given back, ahead of every
            // reservation (twin of lua/reset.lua).
            if let Some(Slot {
                state: State::Gcra(bucket),
                ..
            }) = removed
            {
                Self::lock(&self.given_back).reset(key, bucket.tat_us, now);
            }
        }
    }

    /// The unexpired leases of a lease set, soonest expiry first.
    pub fn leases(&self, key: &str) -> Vec<LiveLease> {
        let now = self.clock.now_ms();
        let sets = Self::lock(&self.leases);
        let mut members: Vec<LiveLease> = sets
            .get(key)
            .into_iter()
            .flatten()
            .filter(|(_, held)| held.expiry > now)
            .map(|(member, held)| LiveLease {
                member: member.clone(),
                expires_at_ms: held.expiry,
                holder: held.holder.to_string(),
            })
            .collect();
        members.sort_by_key(|lease| lease.expires_at_ms);
        members
    }

    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// The clock this store decides by.
    pub fn clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.clock)
    }

    /// Number of live (unexpired or not yet swept) counters.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| Self::lock(s).len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops expired counters from shards `[from, from + count)`, and (on
    /// the pass that starts at shard 0) expired leases, empty lease sets,
    /// expired settlements and buckets' expired give-backs.
    fn sweep(&self, from: usize, count: usize) {
        let now = self.clock.now_ms();
        for shard in self.shards.iter().skip(from).take(count) {
            Self::lock(shard).retain(|_, slot| slot.expires_at_ms > now);
        }
        if from == 0 {
            Self::lock(&self.leases).retain(|_, set| {
                set.retain(|_, held| held.expiry > now);
                !set.is_empty()
            });
            Self::lock(&self.settlements).retain(|_, (_, expiry)| *expiry > now);
            Self::lock(&self.given_back).sweep(now);
            Self::lock(&self.resets).retain(|_, (_, until)| *until > now);
        }
    }
}

async fn sweep_forever(store: Weak<MemoryStore>) {
    const PER_TICK: usize = 4;
    let mut next = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        let Some(store) = store.upgrade() else { return };
        store.sweep(next, PER_TICK);
        next = (next + PER_TICK) % SHARDS;
    }
}

/// The shards a request's checks fall in, locked, and its keys' digests
/// (worked out once per request, not at every read and write).
struct LockedShards<'a> {
    guards: Vec<(usize, MutexGuard<'a, Shard>)>,
    ids: Vec<(&'a str, KeyId)>,
    /// The store's `shard_capacity`.
    capacity: usize,
    /// With a capacity: the counters taken out and not yet written back,
    /// whose places in their shards are theirs (kept only under a cap).
    taken: Vec<KeyId>,
    /// New counters this request did not write for it.
    untracked: u64,
}

impl LockedShards<'_> {
    fn id_of(&self, key: &str) -> Option<KeyId> {
        let at = self.ids.binary_search_by(|(k, _)| (*k).cmp(key)).ok()?;
        Some(self.ids[at].1)
    }

    fn shard(&mut self, key: &str) -> Option<(&mut Shard, KeyId)> {
        let id = self.id_of(key)?;
        let index = MemoryStore::shard_of(id);
        let (_, guard) = self.guards.iter_mut().find(|(i, _)| *i == index)?;
        Some((guard, id))
    }

    /// Under a cap, whether `id`'s counter may be written: one taken out
    /// goes back whatever its shard holds now (its place was kept for
    /// it), one still there is replaced, and a new one fits only beside
    /// the places kept for the others taken from its shard.
    fn room_for(&mut self, id: KeyId) -> bool {
        if let Some(at) = self.taken.iter().position(|t| *t == id) {
            self.taken.swap_remove(at);
            return true;
        }
        let index = MemoryStore::shard_of(id);
        let kept = self
            .taken
            .iter()
            .filter(|t| MemoryStore::shard_of(**t) == index)
            .count();
        self.guards
            .iter()
            .find(|(i, _)| *i == index)
            .is_some_and(|(_, shard)| shard.contains_key(&id) || shard.len() + kept < self.capacity)
    }
}

impl batch::Table for LockedShards<'_> {
    fn take(&mut self, key: &str, now_ms: u64) -> Option<(State, u64)> {
        let capped = self.capacity != usize::MAX;
        let (shard, id) = self.shard(key)?;
        let slot = shard.remove(&id)?;
        if capped {
            self.taken.push(id);
        }
        (slot.expires_at_ms > now_ms).then_some((slot.state, slot.expires_at_ms))
    }

    fn write(&mut self, key: &str, state: State, expires_at_ms: u64) {
        let capped = self.capacity != usize::MAX;
        if capped && !self.id_of(key).is_some_and(|id| self.room_for(id)) {
            self.untracked += 1;
            return;
        }
        // Only the request's own keys are written, and their shards are
        // locked: a miss here would be a bug in `evaluate`, not input.
        let Some((shard, id)) = self.shard(key) else {
            debug_assert!(false, "write to a key outside the request");
            return;
        };
        shard.insert(
            id,
            Slot {
                state,
                expires_at_ms,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::limiter::Algorithm;

    fn check(key: &str, limit: u64, hits: u64) -> Check {
        Check::for_test(key, Algorithm::FixedWindow, limit, 1_000, hits)
    }

    #[test]
    fn a_key_has_one_digest_per_store_and_a_secret_one() {
        let clock = Arc::new(ManualClock::new(10_000));
        let (a, b) = (MemoryStore::new(clock.clone()), MemoryStore::new(clock));
        let key = "rk:{d|user_id=alice}:fw.60";
        assert_eq!(a.id(key), a.id(key));
        assert_ne!(a.id(key), a.id("rk:{d|user_id=alicf}:fw.60"));
        // The two halves are not one hash twice, and another store (another
        // process) files the same key elsewhere.
        assert_ne!(a.id(key).0[0], a.id(key).0[1]);
        assert_ne!(a.id(key), b.id(key));
    }

    #[test]
    fn counters_of_different_keys_stay_apart() {
        let store = MemoryStore::new(Arc::new(ManualClock::new(10_000)));
        for i in 0..10_000 {
            let outcome = &store.apply(&[check(&format!("k{i}"), 1, 1)], true)[0];
            assert!(!outcome.over, "k{i} was counted against another key");
        }
        assert_eq!(store.len(), 10_000);
        let again = &store.apply(&[check("k42", 1, 1)], true)[0];
        assert!(again.over);
    }

    /// At its most keys a shard writes no new counter (the key is decided
    /// afresh each time, and counted), keeps counting those it holds, and
    /// takes new ones again once the sweeper drops expired counters.
    #[test]
    fn a_full_store_decides_new_keys_afresh_until_counters_expire() {
        let clock = Arc::new(ManualClock::new(10_000));
        let store = MemoryStore::with_max_keys(clock.clone(), SHARDS);
        let shard = |key: &str| MemoryStore::shard_of(store.id(key));
        let newcomer = (0..)
            .map(|i| format!("k{i}"))
            .find(|k| shard(k) == shard("held"))
            .unwrap();
        let over = |key: &str| store.apply(&[check(key, 1, 1)], true)[0].over;
        assert!(!over("held") && over("held") && over("held"));
        assert!(!over(&newcomer) && !over(&newcomer));
        assert_eq!((store.untracked(), store.len()), (2, 1));
        clock.advance(1_000);
        store.sweep(0, SHARDS);
        assert!(!over(&newcomer) && over(&newcomer));
        assert_eq!(store.untracked(), 2);
    }

    /// A request's counters already held go back to a full shard whatever
    /// order its checks write in: a new key of the same request, written
    /// first, does not take their places (it found room only beside them).
    #[test]
    fn a_full_shard_keeps_the_counters_a_request_took_from_it() {
        let clock = Arc::new(ManualClock::new(10_000));
        let store = MemoryStore::with_max_keys(clock.clone(), 2 * SHARDS);
        let shard = |key: &str| MemoryStore::shard_of(store.id(key));
        let mut same = (0..)
            .map(|i| format!("k{i}"))
            .filter(|k| shard(k) == shard("held"));
        let (other, newcomer) = (same.next().unwrap(), same.next().unwrap());
        // Two a shard: "held" and `other` fill it.
        store.apply(&[check("held", 1, 1)], true);
        store.apply(&[check(&other, 1, 1)], true);
        for all_or_nothing in [false, true] {
            let outcomes = store.apply(
                &[
                    check(&newcomer, 1, 1),
                    check("held", 1, 1),
                    check(&other, 5, 0),
                ],
                all_or_nothing,
            );
            assert!(!outcomes[0].over && outcomes[1].over, "{outcomes:?}");
            assert!(store.apply(&[check("held", 1, 1)], true)[0].over);
            assert!(store.apply(&[check(&other, 1, 1)], true)[0].over);
        }
        assert_eq!(store.len(), 2);
        // The newcomer's, once: refused all or nothing, it wrote nothing.
        assert_eq!(store.untracked(), 1);
    }

    /// The evaluator takes each state out of its shard: one it did not
    /// consume from (over the limit, or a probe of 0 hits) is put back as
    /// it was, expiry included.
    #[test]
    fn a_state_taken_and_not_consumed_is_put_back() {
        let clock = Arc::new(ManualClock::new(10_000));
        let store = MemoryStore::new(clock.clone());
        assert!(!store.apply(&[check("k", 1, 1)], true)[0].over);
        for hits in [1, 0, 1] {
            let out = &store.apply(&[check("k", 1, hits)], true)[0];
            assert!(out.over, "hits {hits}: the count was lost");
            assert_eq!(out.reset_ms, 1_000, "hits {hits}");
        }
        // Two checks, the second over: nothing consumed, both put back.
        let out = store.apply(&[check("j", 5, 1), check("k", 1, 1)], true);
        assert!(!out[0].over && out[1].over);
        assert_eq!(store.apply(&[check("j", 5, 0)], true)[0].remaining, 5);
        assert_eq!(store.len(), 1, "the refused request left no state for j");
        clock.advance(1_000);
        assert!(
            !store.apply(&[check("k", 1, 1)], true)[0].over,
            "k expired with its window"
        );
    }

    /// A request of many checks (past the size where keys are found
    /// through a map, and over many shards) sees each key's earlier hits in
    /// the request, as a short one does, and is refused whole.
    #[test]
    fn a_long_request_counts_each_key_once_per_check() {
        let store = MemoryStore::new(Arc::new(ManualClock::new(10_000)));
        // 60 keys, each twice, limit 2: every check fits.
        let twice: Vec<Check> = (0..120)
            .map(|i| check(&format!("k{}", i % 60), 2, 1))
            .collect();
        let out = store.apply(&twice, true);
        assert!(out.iter().all(|o| !o.over));
        assert_eq!(out[0].remaining, 1, "k0 after its first check");
        assert_eq!(out[60].remaining, 0, "k0 after its second");
        // Once more: the first check on each key is over, nothing counts.
        let out = store.apply(&twice, true);
        assert!(out[..60].iter().all(|o| o.over));
        assert_eq!(store.len(), 60);
        let fresh: Vec<Check> = (60..80).map(|i| check(&format!("k{i}"), 2, 1)).collect();
        let mixed: Vec<Check> = fresh.iter().chain(&twice[..1]).cloned().collect();
        let out = store.apply(&mixed, true);
        assert!(out[20].over && out[..20].iter().all(|o| !o.over));
        let after = store.apply(&fresh, true);
        assert!(
            after.iter().all(|o| o.remaining == 1),
            "the refused request took nothing"
        );
    }

    #[test]
    fn a_reservation_settles_once() {
        let clock = Arc::new(ManualClock::new(10_000));
        let store = MemoryStore::new(clock.clone());
        let (a, b) = (check("{a}", 10, 6), check("{b}", 100, 6));
        let checks = [a.clone(), b.clone()];
        let reserved = store.reserve(&checks, 5_000);
        assert!(reserved.granted);
        assert_eq!(reserved.outcomes[0].remaining, 4);
        let taken = Taken {
            at_ms: 10_000,
            mark: Some(0),
        };
        assert_eq!(reserved.taken, [taken, taken]);
        // Another reservation of 6 does not fit into a's 4 left, and takes
        // nothing from b either.
        let refused = store.reserve(&checks, 5_000);
        assert!(!refused.granted && refused.taken.is_empty());
        assert_eq!(refused.outcomes[1].remaining, 94);
        let of = Reservation {
            nonce: "n1",
            checks: &checks,
            taken: &reserved.taken,
            ttl_ms: 5_000,
        };
        let Settled::Settled { outcomes } = store.settle(&of, 2) else {
            panic!("not settled");
        };
        assert_eq!((outcomes[0].remaining, outcomes[1].remaining), (8, 98));
        // A retry charges nothing more and says what the first settled at.
        let Settled::Already { actual, outcomes } = store.settle(&of, 9) else {
            panic!("not already settled");
        };
        assert_eq!((actual, outcomes[0].remaining), (2, 8));
    }

    #[test]
    fn an_expired_reservation_stays_charged_at_its_estimate() {
        let clock = Arc::new(ManualClock::new(0));
        let store = MemoryStore::new(clock.clone());
        let c = Check {
            period_ms: 60_000,
            ..check("{a}", 10, 6)
        };
        let checks = std::slice::from_ref(&c);
        let reserved = store.reserve(checks, 1_000);
        assert!(reserved.granted);
        let of = Reservation {
            nonce: "n1",
            checks,
            taken: &reserved.taken,
            ttl_ms: 1_000,
        };
        clock.advance(999);
        assert!(matches!(store.settle(&of, 6), Settled::Settled { .. }));
        assert!(!MemoryStore::lock(&store.settlements).is_empty());
        clock.advance(1);
        assert_eq!(store.settle(&of, 0), Settled::Unknown, "its TTL passed");
        let probe = Check {
            hits: 0,
            ..c.clone()
        };
        assert_eq!(store.apply(&[probe], true)[0].remaining, 4);
        store.sweep(0, SHARDS);
        assert!(MemoryStore::lock(&store.settlements).is_empty());
    }

    #[test]
    fn concurrent_reservations_never_commit_more_than_the_budget() {
        let store = MemoryStore::new(Arc::new(ManualClock::new(10_000)));
        let c = check("{a}", 10, 1);
        let granted: usize = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..64)
                .map(|_| {
                    let (store, c) = (&store, &c);
                    scope.spawn(move || store.reserve(std::slice::from_ref(c), 5_000))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().map_or(0, |r| usize::from(r.granted)))
                .sum()
        });
        assert_eq!(granted, 10);
    }

    #[tokio::test]
    async fn expired_counters_are_swept() {
        let clock = Arc::new(ManualClock::new(10_000));
        let store = MemoryStore::new(clock.clone());
        for i in 0..1_000 {
            store.apply(&[check(&format!("k{i}"), 5, 1)], true);
        }
        assert_eq!(store.len(), 1_000);
        clock.advance(1_000);
        store.sweep(0, SHARDS);
        assert!(store.is_empty());
    }
}
