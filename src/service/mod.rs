//! The gRPC surface: request validation and the services built on the
//! limiter and the store.

pub mod admin_leases;
pub mod budget;
pub mod caps;
pub mod concurrency;
pub mod holds;
pub mod id_key;
pub mod id_parts;
pub mod lease_id;
pub mod over_cache;
pub mod reservation_id;
pub mod rls;
pub mod wire;

pub use self::budget::Budget;
pub use self::concurrency::Concurrency;
pub use self::rls::RateLimiter;
