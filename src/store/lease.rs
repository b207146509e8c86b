//! The store-side types of concurrency leases (see `lua/leases.lua` and the
//! in-memory twin in `memory.rs`).

/// One limited set a lease must fit into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseSlot {
    /// The sorted set of this entity's leases.
    pub key: String,
    /// `max_connections`.
    pub limit: u64,
}

/// The answer to an acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquired {
    pub granted: bool,
    /// Leases active in each slot, including the new one when granted.
    pub active: Vec<u64>,
    /// Leases found expired (and dropped) while acquiring.
    pub expired: u64,
    /// When refused: until the soonest lease of a full slot expires.
    pub retry_after_ms: u64,
}

/// A lease as the store sees it: its member id, TTL and sets.
#[derive(Debug, Clone, Copy)]
pub struct LeaseRef<'a> {
    pub member: &'a str,
    pub ttl_ms: u64,
    pub keys: &'a [String],
}

/// A live lease as the admin API lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveLease {
    /// The random first part of its lease id.
    pub member: String,
    /// Unix ms, the store's clock.
    pub expires_at_ms: u64,
    /// What its caller named as holder at acquire; empty if nothing.
    pub holder: String,
}
