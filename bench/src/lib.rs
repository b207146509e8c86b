//! `ratekeeper-bench`: a load generator for any server speaking Envoy's rate
//! limit API v3 (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`).
//!
//! Two modes:
//! - **closed loop** (default): `--concurrency N` tasks, each with one request
//!   in flight at a time; latency is measured from the send.
//! - **open loop** (`--rate R`): request `i` is due at `start + i / R`. A
//!   pacer releases send permits as requests fall due; `--concurrency N`
//!   tasks take them, send, and measure latency from the request's
//!   *intended* send time, so a server (or generator) that falls behind shows
//!   up as latency instead of silently lowering the rate (no coordinated
//!   omission). How late sends were against their due times is reported too.
//!
//! The generator shares the machine with the server it measures, so it is
//! built to wake as little as it can: each of `--threads` threads runs its
//! own single-threaded runtime with its share of the `--connections` HTTP/2
//! channels, the tasks and (open loop) the schedule, every `--threads`-th
//! request, paced by a `timerfd` in that runtime (Tokio's own timer has 1 ms
//! granularity). A request never crosses threads, and no thread wakes
//! another. Each task keeps one request and rewrites only its descriptor
//! values. It prints a human summary and, as the last line, one JSON object
//! for scripts (`bench/run.sh`).
//!
//! The modules, in the order a run meets them:
//!
//! - [`args`]: the command line, and its checks.
//! - [`keys`]: how descriptor values are picked (`--keys`).
//! - [`request`]: a task's reusable request, and the gRPC framing
//!   `--write-request` writes for other HTTP/2 load tools.
//! - [`call`]: what one operation is (`--mode`): a ShouldRateLimit call, or
//!   a Reserve then a Settle over [`budget_api`] (messages in [`v1_wire`]).
//! - [`run`]: the run's threads, each with its runtime, connections and
//!   share of the tasks; they start together and their tallies are merged.
//! - [`tasks`]: the sending tasks, closed loop and open loop.
//! - [`schedule`]: the open loop's due times, handed out as permits.
//! - [`pacer`]: releases the permits as requests fall due, on a `timerfd`.
//! - [`tally`]: what each task counted (answers, latency histograms).
//! - [`report`]: the human summary and the JSON line.
//!
//! `main.rs` parses the flags and calls into these.
//!
//! [`soak`] is a second workload, for the `ratekeeper-soak` binary: long,
//! mixed load (ShouldRateLimit and lease churn) on several replicas.

pub mod args;
pub mod budget_api;
pub mod call;
pub mod keys;
pub mod pacer;
pub mod report;
pub mod request;
pub mod run;
pub mod schedule;
pub mod soak;
pub mod tally;
pub mod tasks;
pub mod v1_wire;

pub use args::Args;
pub use keys::KeyDist;
pub use report::Report;
pub use run::{run, Summary};
