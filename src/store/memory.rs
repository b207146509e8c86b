//! The embedded in-memory store: the default when no Redis is configured,
//! for one replica (or tests). Sharded maps behind mutexes; a request's
//! batch locks every shard it touches (in shard order, so batches never
//! deadlock) and is therefore atomic like a Lua script on Redis. Expired
//! counters are swept in the background, a slice of the shards per tick.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use super::lease::{Acquired, LeaseRef, LeaseSlot};
use crate::clock::Clock;
use crate::limiter::{batch, Check, Outcome, State};

const SHARDS: usize = 64;

#[derive(Debug, Clone)]
struct Slot {
    state: State,
    expires_at_ms: u64,
}

// A million live keys is the sizing case (BENCHMARKS.md): every byte of a
// slot counts once per key and again for the table's empty buckets.
const _: () = assert!(std::mem::size_of::<Slot>() <= 40);

/// Keys as `Box<str>`: a `String`'s capacity word, per key, buys nothing here.
type Shard = HashMap<Box<str>, Slot>;

/// Lease sets: set key -> lease member -> expiry (ms).
type LeaseSets = HashMap<String, HashMap<String, u64>>;

/// Counters and leases kept in this process.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Vec<Mutex<Shard>>,
    leases: Mutex<LeaseSets>,
    clock: Arc<dyn Clock>,
}

impl MemoryStore {
    /// A store reading time from `clock`, with a background sweeper (when
    /// called inside a Tokio runtime) that stops when the store is dropped.
    pub fn new(clock: Arc<dyn Clock>) -> Arc<Self> {
        let store = Arc::new(MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            leases: Mutex::new(HashMap::new()),
            clock,
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(sweep_forever(Arc::downgrade(&store)));
        }
        store
    }

    fn shard_of(key: &str) -> usize {
        let mut h = DefaultHasher::new();
        key.hash(&mut h);
        (h.finish() as usize) % SHARDS
    }

    fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
        // A panic while holding the lock cannot leave an entry half-written
        // (entries are replaced whole), so a poisoned map is still consistent.
        mutex
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Takes a lease in every slot, or in none (twin of `lua/leases.lua`).
    pub fn acquire(&self, slots: &[LeaseSlot], member: &str, ttl_ms: u64) -> Acquired {
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
            set.retain(|_, expiry| *expiry > now);
            acquired.expired += (before - set.len()) as u64;
            acquired.active.push(set.len() as u64);
            if set.len() as u64 >= slot.limit {
                acquired.granted = false;
                if let Some(first) = set.values().min() {
                    acquired.retry_after_ms =
                        acquired.retry_after_ms.max(first.saturating_sub(now));
                }
            }
        }
        if acquired.granted {
            for (slot, active) in slots.iter().zip(&mut acquired.active) {
                if let Some(set) = sets.get_mut(&slot.key) {
                    set.insert(member.to_owned(), now.saturating_add(ttl_ms));
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
                        .is_some_and(|&expiry| expiry > now)
                });
                for key in lease.keys {
                    if let Some(set) = sets.get_mut(key) {
                        if alive {
                            set.insert(lease.member.to_owned(), now.saturating_add(lease.ttl_ms));
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
        let mut indices: Vec<usize> = checks.iter().map(|c| Self::shard_of(&c.key)).collect();
        indices.sort_unstable();
        indices.dedup();
        let mut table = LockedShards {
            guards: indices
                .iter()
                .map(|&i| (i, Self::lock(&self.shards[i])))
                .collect(),
        };
        batch::evaluate(&mut table, checks, all_or_nothing, now)
    }

    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Number of live (unexpired or not yet swept) counters.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| Self::lock(s).len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops expired counters from shards `[from, from + count)`, and (on
    /// the pass that starts at shard 0) expired leases and empty lease sets.
    fn sweep(&self, from: usize, count: usize) {
        let now = self.clock.now_ms();
        for shard in self.shards.iter().skip(from).take(count) {
            Self::lock(shard).retain(|_, slot| slot.expires_at_ms > now);
        }
        if from == 0 {
            Self::lock(&self.leases).retain(|_, set| {
                set.retain(|_, expiry| *expiry > now);
                !set.is_empty()
            });
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

struct LockedShards<'a> {
    guards: Vec<(usize, MutexGuard<'a, Shard>)>,
}

impl LockedShards<'_> {
    fn shard(&mut self, key: &str) -> &mut Shard {
        let index = MemoryStore::shard_of(key);
        let pos = self
            .guards
            .iter()
            .position(|(i, _)| *i == index)
            .unwrap_or(0);
        &mut self.guards[pos].1
    }
}

impl batch::Table for LockedShards<'_> {
    fn read(&mut self, key: &str, now_ms: u64) -> Option<State> {
        self.shard(key)
            .get(key)
            .filter(|slot| slot.expires_at_ms > now_ms)
            .map(|slot| slot.state.clone())
    }

    fn write(&mut self, key: &str, state: State, expires_at_ms: u64) {
        let slot = Slot {
            state,
            expires_at_ms,
        };
        let shard = self.shard(key);
        match shard.get_mut(key) {
            Some(existing) => *existing = slot,
            None => {
                shard.insert(key.into(), slot);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::limiter::Algorithm;

    fn check(key: &str, limit: u64, hits: u64) -> Check {
        Check {
            key: key.into(),
            algorithm: Algorithm::FixedWindow,
            limit,
            period_ms: 1_000,
            burst: 0,
            hits,
            enforce: true,
        }
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
