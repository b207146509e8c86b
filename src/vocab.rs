//! Shared vocabulary: small value types that the config, the store and the
//! services all speak, kept below all of them so that none has to import
//! another for a word (the time [`crate::limiter::Unit`] and
//! [`crate::limiter::Algorithm`] live in `limiter`, which is below them too).
//! Command-line parsing of these is the binary's business
//! (`src/bin/ratekeeper/cli.rs`).

use std::fmt;

/// What `ShouldRateLimit` answers when the store fails (error, deadline, or
/// open circuit), set per domain (`failure_mode:` in its limits file) with a
/// server-wide default (`--failure-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailureMode {
    /// Allow the request (counted in `ratekeeper_store_error_fail_open`).
    Open,
    /// Refuse: OVER_LIMIT for every limited descriptor.
    Closed,
    /// Answer gRPC UNAVAILABLE (Envoy then applies its own
    /// `failure_mode_deny`, as with envoyproxy/ratelimit, which answers an
    /// error): the default, so that the proxy's choice stands.
    #[default]
    Unavailable,
    /// Enforce each limit divided by `--expected-replicas` in this replica's
    /// memory until the store is back.
    Local,
}

impl FailureMode {
    pub fn parse(name: &str) -> Option<FailureMode> {
        Some(match name {
            "open" => FailureMode::Open,
            "closed" => FailureMode::Closed,
            "unavailable" => FailureMode::Unavailable,
            "local" => FailureMode::Local,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            FailureMode::Open => "open",
            FailureMode::Closed => "closed",
            FailureMode::Unavailable => "unavailable",
            FailureMode::Local => "local",
        }
    }
}

impl fmt::Display for FailureMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which Redis deployment to talk to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    Single,
    Cluster,
    Sentinel,
}
