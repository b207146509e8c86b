//! The store's generation: a number that changes whenever Redis may have
//! lost what it held (restarted, or replaced by another server in a
//! failover), so that what was learnt from it before — the over-limit
//! cache's full counters — is dropped instead of outliving the data.
//!
//! Bumped by the Redis store when the limiter had to be loaded again (Redis
//! lost its functions or scripts: a restart without persistence, a new
//! server) and when replaced connections reach a server with another
//! `run_id` (any restart, a failover). Reading it is one atomic load.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A shared handle on the generation; clones see the same number.
#[derive(Debug, Clone, Default)]
pub struct Generation(Arc<AtomicU64>);

impl Generation {
    /// The number now; only whether it changed means anything.
    pub fn current(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// Records that Redis may have lost its data (the caller logs why).
    pub fn bump(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
}
