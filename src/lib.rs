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
//!   concurrency and budget services, gRPC health, reflection, and the config watcher;
//!   [`incoming`] accepts connections (over [`tls`] when configured), guards
//!   them ([`preface`]: the HTTP/2 preface in time; [`authority`] makes
//!   every caller's `:authority` one h2 takes; [`grpc_only`] answers
//!   what is not a gRPC call as grpc-go does; [`repeated_cap`] counts a
//!   request's descriptors or lease ids before they are decoded)
//!   and deals them to the [`lanes`], one single-threaded runtime per
//!   core, each serving its connections start to finish with its own copy
//!   of the services, bound to its own store connections.
//! - [`service`] holds the gRPC services. [`service::rls`] decides a
//!   `ShouldRateLimit` in four steps, one module each: plan the checks
//!   (validate against [`service::caps`], match the rules, apply overrides
//!   and `replaces`), get their outcomes — from the over-limit cache
//!   ([`service::over_cache`]: fixed-window keys known to be full until
//!   their window ends cost no store call), else from the store — apply
//!   the domain's failure mode if the store failed, and build the response.
//!   [`service::concurrency`] leases places for concurrent connections;
//!   [`service::budget`] reserves an estimate and settles the actual cost
//!   on the same rules and counters.
//! - [`config`] loads the limits: its sources (the YAML directory, reloaded
//!   on change; xDS `RateLimitConfig` messages, pushed by an ADS server to
//!   [`config::xds_client`]) translate into one
//!   description that one compiler checks and builds; [`rules`] is the
//!   compiled descriptor matcher.
//! - [`headers`] writes the `RateLimit-*` response headers for the
//!   request's tightest limit.
//! - [`keys`] turns a descriptor into its counter key (injective, with a
//!   Redis Cluster hash tag).
//! - [`limiter`] is the policy: units, algorithms, the check/outcome types.
//! - [`store`] applies a request's checks atomically: [`store::memory`] in
//!   process, [`store::redis`] through one call of the Lua limiter (`lua/`,
//!   [`store::limiter_script`]: a function on Redis 7, else a script) that
//!   [`store::batcher`] shares among the requests in flight, each call made
//!   by [`store::caller`] under a deadline and a circuit breaker;
//!   [`store::stores`] sends each check to its store (the per-second Redis
//!   of `REDIS_PERSECOND`, or the main one); [`store::budget`] reserves
//!   cost budgets, then settles them at the actual cost (the policy side:
//!   [`limiter::budget`]).
//! - [`http`] serves the HTTP listeners on one axum server:
//!   `/healthcheck` and `/json` (ShouldRateLimit as protojson), `/rlconfig`,
//!   and `/metrics`; [`health`] is the readiness gRPC health and
//!   `/healthcheck` both report.
//! - [`telemetry`] sets up logs (as envoyproxy/ratelimit writes them, JSON
//!   or logfmt: [`logrus`]; a line a failure repeats per request paced by
//!   [`log_pace`]) and the Prometheus recorder, whose series
//!   [`metric_help`] describes;
//!   [`their_stats`] counts envoyproxy/ratelimit's stats (names from
//!   [`stat_key`]) in [`statsd`] (plain, or DogStatsD through
//!   [`dogstatsd`]'s mogrifiers, marked with the container
//!   [`container_id`] finds) and in the Prometheus series
//!   [`stat_mapper`]'s statsd_exporter mapping names, and [`read_stats`]
//!   reads their Redis pool and local cache stats when sent; [`clock`] is the
//!   time source tests can pin; [`duration`] reads durations written as
//!   text, [`query`] URL query text; [`vocab`] holds the words several layers share (failure mode,
//!   Redis topology); [`error`] the error type; [`pb`] ratekeeper's own
//!   protos, envoyproxy/ratelimit's `RateLimitConfig` and OTLP's traces.
//! - [`otel`] traces sampled decisions as OpenTelemetry spans (a child of
//!   the caller's `traceparent`) and exports them over OTLP.
//!
//! No module imports one that imports it back, directly or around a loop
//! (`tests/module_graph.rs` checks).
//!
//! The binary (`src/bin/ratekeeper/`: `main.rs`, its flags and settings
//! modules) only parses flags and the environment and calls into these.

pub mod authority;
pub mod cert_validity;
pub mod clock;
pub mod config;
pub mod container_id;
pub mod dogstatsd;
pub mod duration;
pub mod error;
pub mod fingerprint;
pub mod grpc_only;
pub mod headers;
pub mod health;
pub mod http;
pub mod incoming;
pub mod keys;
pub mod lanes;
pub mod limiter;
pub mod log_pace;
pub mod logrus;
pub mod metric_help;
pub mod otel;
pub mod pb;
pub mod preface;
pub mod query;
pub mod random;
pub mod read_stats;
pub mod repeated_cap;
pub mod rules;
pub mod server;
pub mod service;
pub mod stat_key;
pub mod stat_mapper;
pub mod statsd;
pub mod store;
pub mod telemetry;
pub mod their_stats;
pub mod tls;
pub mod vocab;

pub use error::{ConfigError, Error, Result};
