//! # ratekeeper
//!
//! A distributed rate-limit decision service. Callers — an Envoy proxy's
//! external rate limit filter or any gRPC client — ask
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` whether a
//! request may go ahead; ratekeeper answers from counters kept in Redis (or,
//! for a single replica, in memory), so any number of replicas enforce one
//! limit together.
//!
//! A tour of the modules, in the order a request meets them:
//!
//! - [`server`] binds the gRPC server: the rate limit service, the
//!   concurrency service, gRPC health, reflection, and the config watcher;
//!   [`incoming`] accepts connections, guards them and deals them to the
//!   [`lanes`], one single-threaded runtime per core, each serving its
//!   connections start to finish.
//! - [`service`] holds the gRPC services: [`service::rls`] validates a
//!   request against [`service::caps`], matches its descriptors and answers.
//! - [`config`] loads the limits: its sources (the YAML directory, reloaded
//!   on change; xDS `RateLimitConfig` messages, pushed by an ADS server to
//!   [`config::xds_client`]) translate into one
//!   description that one compiler checks and builds; [`rules`] is the
//!   compiled descriptor matcher.
//! - [`headers`] computes the `RateLimit-*` response headers from the
//!   request's tightest limit.
//! - [`keys`] turns a descriptor into its counter key (injective, with a
//!   Redis Cluster hash tag).
//! - [`limiter`] is the policy: units, algorithms, the check/outcome types.
//! - [`store`] applies a request's checks atomically: [`store::memory`] in
//!   process, [`store::redis`] through one call of the Lua limiter (`lua/`,
//!   [`store::limiter_script`]: a function on Redis 7, else a script) that
//!   [`store::batcher`] shares among the requests in flight, each call made
//!   by [`store::caller`] under a deadline and a circuit breaker.
//! - [`telemetry`] sets up logs and the Prometheus endpoint; [`clock`] is the
//!   time source tests can pin; [`duration`] reads durations written as text.
//!
//! `main.rs` only parses flags and calls into these.

pub mod clock;
pub mod config;
pub mod duration;
pub mod error;
pub mod headers;
pub mod incoming;
pub mod keys;
pub mod lanes;
pub mod limiter;
pub mod pb;
pub mod rules;
pub mod server;
pub mod service;
pub mod store;
pub mod telemetry;
pub mod tls;

pub use error::{ConfigError, Error, Result};
