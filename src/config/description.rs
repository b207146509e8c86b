//! The source-neutral description of one domain's limits: what a limits file
//! ([`super::file`]) or an xDS `RateLimitConfig` ([`super::xds`]) says, before
//! any check. [`super::compile`] turns it into the model, so both sources get
//! the same validation and the same error messages.
//!
//! Sources only translate: a value their syntax cannot express is left empty
//! here (`None`, `""`, an empty list) and the compiler decides what it means.
//! Every node carries its path in the source (`descriptors[2].rate_limit`):
//! the compiler names it in an error, and the source turns it into a file
//! and line (YAML) or prefixes the domain (xDS).

use std::time::Duration;

use crate::limiter::{Algorithm, Unit};
use crate::vocab::FailureMode;

/// One domain as a source describes it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DomainDescription {
    pub domain: String,
    pub descriptors: Vec<Descriptor>,
    /// ratekeeper: concurrent-connection limits, a descriptor tree of their own.
    pub concurrency: Vec<ConcurrencyDescriptor>,
    /// ratekeeper: `false` keeps Envoy's count-everything behaviour.
    pub all_or_nothing: Option<bool>,
    /// ratekeeper: RateLimit-* response headers for this domain (overrides the flag).
    pub response_headers: Option<bool>,
    /// ratekeeper: the answer while the store fails (overrides the flag).
    pub failure_mode: Option<FailureMode>,
    /// ratekeeper: `charges:` for the domain's limits that set none.
    pub charges: Option<bool>,
}

/// A descriptor tree node: a key, maybe a value, children, and what the node
/// carries (`P`: rate limits, or a concurrency limit).
#[derive(Debug, Clone, PartialEq)]
pub struct Node<P> {
    /// The node's path in its source, for errors.
    pub at: String,
    /// Empty when the source gave none (refused by the compiler).
    pub key: String,
    /// `None` is the value-less (default) node; sources map `""` to `None`.
    pub value: Option<String>,
    pub payload: P,
    pub children: Vec<Node<P>>,
}

/// A rate limit descriptor node.
pub type Descriptor = Node<Limits>;

/// A `concurrency:` node.
pub type ConcurrencyDescriptor = Node<Concurrency>;

/// What a rate limit descriptor node carries.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Limits {
    /// `rate_limit` (one) or ratekeeper's stacked `rate_limits`; empty when
    /// the node has no limit of its own.
    pub limits: Vec<Limit>,
    pub shadow_mode: bool,
    pub detailed_metric: bool,
    pub quota_mode: bool,
    pub share_threshold: bool,
    /// envoyproxy/ratelimit's key ratekeeper parses but does not act on yet.
    pub value_to_metric: bool,
    /// `metadata:`, as the response's dynamic metadata carries it.
    pub metadata: Option<prost_types::Struct>,
}

/// One `rate_limit` policy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Limit {
    /// The limit's path in its source, for errors.
    pub at: String,
    pub unit: Option<Unit>,
    pub requests_per_unit: Option<u32>,
    pub unlimited: bool,
    /// `None` when absent or empty.
    pub name: Option<String>,
    /// The names of the `replaces` entries, as given (empty ones included).
    pub replaces: Vec<String>,
    /// ratekeeper: how the limit counts (default `fixed_window`).
    pub algorithm: Option<Algorithm>,
    /// ratekeeper: bucket size / queue depth of the GCRA algorithms.
    pub burst: Option<u32>,
    /// ratekeeper: `charges: record` (true) or `drop` (false).
    pub charges: Option<bool>,
}

/// What a `concurrency:` node carries.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Concurrency {
    pub max_connections: Option<u32>,
    pub lease_ttl: Option<Duration>,
    pub name: Option<String>,
}
