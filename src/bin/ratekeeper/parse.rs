//! Setting values for clap that several settings modules read: Go
//! durations, and the Redis deadlines built on them. A leaf: it imports
//! none of the binary's modules.

use std::time::Duration;

/// Parses a Go duration (`500ms`, `1h30m`, `1.5h`; or seconds) for clap.
pub(crate) fn duration(text: &str) -> std::result::Result<Duration, String> {
    ratekeeper::duration::parse_duration(text)
        .ok_or_else(|| format!("bad duration {text:?}: e.g. 500ms, 30s, 1h30m, 1.5h"))
}

/// REDIS_TIMEOUT and REDIS_PERSECOND_TIMEOUT for clap: a Go duration, where
/// a negative one reads as zero. Theirs sets no dial deadline for either;
/// here zero leaves ratekeeper's default deadlines ([`or_default`]).
pub(crate) fn redis_timeout(text: &str) -> std::result::Result<Duration, String> {
    match text.trim().strip_prefix('-') {
        Some(negative) => duration(negative).map(|_| Duration::ZERO),
        None => duration(text),
    }
}

/// A Redis deadline setting, `None` when unset or zero (see [`redis_timeout`]).
pub(crate) fn or_default(timeout: Option<Duration>) -> Option<Duration> {
    timeout.filter(|t| !t.is_zero())
}
