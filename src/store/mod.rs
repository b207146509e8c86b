//! Where counters live. The service talks to [`Store`] only; nothing outside
//! this module knows Redis.

pub mod memory;
pub mod redis;

use std::sync::Arc;

use crate::limiter::{Check, Outcome};
use crate::Result;

pub use self::memory::MemoryStore;
pub use self::redis::{RedisSettings, RedisStore};

/// A counter store. An enum rather than a trait object: there are two, and
/// static dispatch keeps the hot path free of boxing.
#[derive(Debug, Clone)]
pub enum Store {
    Memory(Arc<MemoryStore>),
    Redis(Arc<RedisStore>),
}

impl Store {
    /// Applies one request's checks atomically, all-or-nothing.
    pub async fn apply(&self, checks: &[Check]) -> Result<Vec<Outcome>> {
        if checks.is_empty() {
            return Ok(Vec::new());
        }
        match self {
            Store::Memory(store) => Ok(store.apply(checks)),
            Store::Redis(store) => store.apply(checks).await,
        }
    }

    /// Whether the store answers.
    pub async fn ping(&self) -> Result<()> {
        match self {
            Store::Memory(_) => Ok(()),
            Store::Redis(store) => store.ping().await,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Store::Memory(_) => "memory",
            Store::Redis(_) => "redis",
        }
    }
}
