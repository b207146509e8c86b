//! Where counters live. The service talks to [`Store`] only; nothing outside
//! this module knows Redis.

pub mod batcher;
pub mod breaker;
pub mod budget;
pub mod caller;
pub mod connection;
pub mod generation;
pub mod lease;
pub mod limiter_script;
pub mod memory;
pub mod packed;
pub mod placed;
pub mod redis;
pub mod stores;

use std::sync::Arc;

use crate::clock::Clock;
use crate::limiter::{Check, Outcome};
use crate::Result;

pub use self::budget::{Reservation, Reserved, Settled, Taken};
pub use self::connection::{PoolCounts, PoolReader, RedisSettings, RedisTls};
pub use self::generation::Generation;
pub use self::lease::{Acquired, LeaseRef, LeaseSlot, LiveLease};
pub use self::memory::MemoryStore;
pub use self::redis::RedisStore;
pub use self::stores::{Role, Stores};
pub use crate::vocab::Topology;

/// A counter store. An enum rather than a trait object: there are two, and
/// static dispatch keeps the hot path free of boxing.
#[derive(Debug, Clone)]
pub enum Store {
    Memory(Arc<MemoryStore>),
    Redis(Arc<RedisStore>),
}

impl Store {
    /// Applies one request's checks in one atomic step. With
    /// `all_or_nothing`, a request refused by any enforced check consumes
    /// nothing; otherwise every check that fits is consumed.
    pub async fn apply(&self, checks: &[Check], all_or_nothing: bool) -> Result<Vec<Outcome>> {
        if checks.is_empty() {
            return Ok(Vec::new());
        }
        match self {
            Store::Memory(store) => Ok(store.apply(checks, all_or_nothing)),
            Store::Redis(store) => store.apply(checks, all_or_nothing).await,
        }
    }

    /// Takes a lease in every slot, or in none, atomically; `holder` (may
    /// be empty) is kept with it for [`Store::leases`].
    pub async fn acquire(
        &self,
        slots: &[LeaseSlot],
        member: &str,
        holder: &str,
        ttl_ms: u64,
    ) -> Result<Acquired> {
        match self {
            Store::Memory(store) => Ok(store.acquire(slots, member, holder, ttl_ms)),
            Store::Redis(store) => store.acquire(slots, member, holder, ttl_ms).await,
        }
    }

    /// Extends the leases still present in all their sets; returns which are alive.
    pub async fn heartbeat(&self, leases: &[LeaseRef<'_>]) -> Result<Vec<bool>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        match self {
            Store::Memory(store) => Ok(store.heartbeat(leases)),
            Store::Redis(store) => store.heartbeat(leases).await,
        }
    }

    /// Releases a lease a second and ten seconds from now, after its
    /// release failed (Redis; the in-memory store's never does).
    pub fn release_later(&self, member: &str, keys: Vec<String>) {
        if let Store::Redis(store) = self {
            store.release_later(member, keys);
        }
    }

    /// Removes leases; unknown ones are ignored.
    pub async fn release(&self, leases: &[LeaseRef<'_>]) -> Result<()> {
        if leases.is_empty() {
            return Ok(());
        }
        match self {
            Store::Memory(store) => {
                store.release(leases);
                Ok(())
            }
            Store::Redis(store) => store.release(leases).await,
        }
    }

    /// Deletes counters (the admin API's reset), each key atomically;
    /// missing keys are ignored.
    pub async fn delete(&self, keys: &[String]) -> Result<()> {
        match self {
            Store::Memory(store) => {
                store.delete(keys);
                Ok(())
            }
            Store::Redis(store) => store.delete(keys).await,
        }
    }

    /// The live leases of one lease set, soonest expiry first.
    pub async fn leases(&self, key: &str) -> Result<Vec<LiveLease>> {
        match self {
            Store::Memory(store) => Ok(store.leases(key)),
            Store::Redis(store) => store.leases(key).await,
        }
    }

    /// The value under `name`, set to `candidate` first if it had none:
    /// one value every replica of the store reads (the reservation ids'
    /// key, `service::id_key`). Kept without expiry.
    pub async fn shared_value(&self, name: &str, candidate: &str) -> Result<String> {
        match self {
            Store::Memory(store) => Ok(store.shared_value(name, candidate)),
            Store::Redis(store) => store.shared_value(name, candidate).await,
        }
    }

    /// Readies the store for traffic (see [`RedisStore::warm_up`]).
    pub async fn warm_up(&self) -> Result<()> {
        match self {
            Store::Memory(_) => Ok(()),
            Store::Redis(store) => store.warm_up().await,
        }
    }

    /// Whether the store answers.
    pub async fn ping(&self) -> Result<()> {
        match self {
            Store::Memory(_) => Ok(()),
            Store::Redis(store) => store.ping().await,
        }
    }

    /// The local reading of the clock the store's decisions follow, in ms
    /// (tests pin it; production reads the system clock). Only differences
    /// of it are meaningful next to Redis's own clock.
    pub fn now_ms(&self) -> u64 {
        match self {
            Store::Memory(store) => store.now_ms(),
            Store::Redis(store) => store.now_ms(),
        }
    }

    /// The same store as used by serving lane `lane` (see [`crate::lanes`]):
    /// its Redis calls go on that lane's connections, whose readers run on
    /// that lane's thread. The in-memory store has no lanes.
    pub fn for_lane(&self, lane: usize) -> Store {
        match self {
            Store::Memory(store) => Store::Memory(Arc::clone(store)),
            Store::Redis(store) => Store::Redis(Arc::new(store.for_lane(lane))),
        }
    }

    /// The clock the store's decisions follow, for counters kept beside it
    /// (a Redis store without a pinned clock follows the Redis server's;
    /// the system clock stands in for it here).
    pub fn clock(&self) -> Arc<dyn Clock> {
        match self {
            Store::Memory(store) => store.clock(),
            Store::Redis(store) => store.clock(),
        }
    }

    /// Changes whenever the store may have lost its data (see
    /// [`Generation`]); the in-memory store never does.
    pub fn generation(&self) -> Generation {
        match self {
            Store::Memory(_) => Generation::default(),
            Store::Redis(store) => store.generation(),
        }
    }

    /// Reads the Redis connection pool's stats (`None`: in memory).
    pub fn pool(&self) -> Option<PoolReader> {
        match self {
            Store::Memory(_) => None,
            Store::Redis(store) => Some(store.pool()),
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Store::Memory(_) => "memory",
            Store::Redis(_) => "redis",
        }
    }
}
