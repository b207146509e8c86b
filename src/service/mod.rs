//! The gRPC surface: request validation and the services built on the
//! limiter and the store.

pub mod caps;
pub mod rls;

pub use self::rls::RateLimiter;
