//! Input caps, enforced before any store work so a hostile request costs
//! little and can never create huge keys. Documented in the README.

/// Largest accepted gRPC message, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;
/// Most descriptors in one `ShouldRateLimit` request.
pub const MAX_DESCRIPTORS: usize = 64;
/// Most entries in one descriptor.
pub const MAX_ENTRIES: usize = 16;
/// Longest domain, in bytes.
pub const MAX_DOMAIN_BYTES: usize = 256;
/// Longest descriptor entry key, in bytes.
pub const MAX_KEY_BYTES: usize = 256;
/// Longest descriptor entry value, in bytes.
pub const MAX_VALUE_BYTES: usize = 1024;
