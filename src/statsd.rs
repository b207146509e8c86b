//! The statsd sink, for pipelines built on envoyproxy/ratelimit's statsd
//! stats (statsd_exporter, DogStatsD, Telegraf): counters under their stat
//! names, added to in memory on the request path (one atomic add) and sent
//! over UDP by a task every flush interval, never from a request.
//!
//! Lines are plain statsd, `name:delta|c`, newline-separated, as many as
//! fit one datagram. Extra tags are appended to the name the way
//! envoyproxy/ratelimit's client (gostats) writes them, `name.__key=value`
//! (keys sorted; `.`, `:` and `|` in values become `_`), which
//! statsd_exporter and DogStatsD both take as part of the name.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::{Error, Result};

/// Where and how often the counters are sent.
#[derive(Debug, Clone)]
pub struct StatsdSettings {
    /// `host:port` of the statsd server, resolved at every flush.
    pub addr: String,
    pub flush_interval: Duration,
    /// `EXTRA_TAGS`: `key:value` pairs, comma-separated.
    pub extra_tags: String,
}

/// A statsd counter: the hits since the last flush.
pub type Counter = Arc<AtomicU64>;

/// The installed sink's counters by name (`None` until [`install`]).
static COUNTERS: OnceLock<Registry> = OnceLock::new();

#[derive(Debug, Default)]
struct Registry {
    counters: Mutex<BTreeMap<String, Counter>>,
}

/// The counter named `name`, if statsd is on. Look it up once and keep it:
/// the lookup takes a lock.
pub fn counter(name: &str) -> Option<Counter> {
    let registry = COUNTERS.get()?;
    let mut counters = registry.counters.lock().unwrap_or_else(|p| p.into_inner());
    Some(counters.entry(name.to_owned()).or_default().clone())
}

/// Adds `n` to the counter `name` (a lookup: for rare events only).
pub fn add(name: &str, n: u64) {
    if let Some(counter) = counter(name) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// Turns the sink on and starts the task that flushes it, for good.
pub async fn install(settings: StatsdSettings) -> Result<()> {
    let tags = serialize_tags(&settings.extra_tags)?;
    let socket = tokio::net::UdpSocket::bind("0.0.0.0:0")
        .await
        .map_err(|e| Error::Startup(format!("statsd: cannot open a UDP socket: {e}")))?;
    if COUNTERS.set(Registry::default()).is_err() {
        return Err(Error::Startup("statsd: installed twice".into()));
    }
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(settings.flush_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for datagram in datagrams(&take_lines(&tags)) {
                if let Err(error) = socket.send_to(datagram.as_bytes(), &settings.addr).await {
                    tracing::debug!(%error, addr = %settings.addr, "statsd: send failed");
                }
            }
        }
    });
    Ok(())
}

/// One `name:delta|c` line per counter counted since the last flush,
/// resetting them.
fn take_lines(tags: &str) -> Vec<String> {
    let Some(registry) = COUNTERS.get() else {
        return Vec::new();
    };
    let counters = registry.counters.lock().unwrap_or_else(|p| p.into_inner());
    counters
        .iter()
        .filter_map(|(name, counter)| match counter.swap(0, Ordering::Relaxed) {
            0 => None,
            delta => Some(format!("{name}{tags}:{delta}|c")),
        })
        .collect()
}

/// Lines packed into datagrams that fit a 1500-byte Ethernet frame.
fn datagrams(lines: &[String]) -> Vec<String> {
    const MAX: usize = 1432;
    let mut out: Vec<String> = Vec::new();
    for line in lines {
        match out.last_mut() {
            Some(last) if last.len() + 1 + line.len() <= MAX => {
                last.push('\n');
                last.push_str(line);
            }
            _ => out.push(line.clone()),
        }
    }
    out
}

/// `EXTRA_TAGS` (`k:v,k:v`) as gostats appends them to a name.
fn serialize_tags(extra: &str) -> Result<String> {
    let mut tags = BTreeMap::new();
    for pair in extra.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((key, value)) = pair.split_once(':') else {
            return Err(Error::Startup(format!(
                "EXTRA_TAGS: {pair:?} is not key:value"
            )));
        };
        let clean = |s: &str| s.trim().replace(['.', ':', '|'], "_");
        tags.insert(clean(key), clean(value));
    }
    Ok(tags
        .iter()
        .filter(|(k, v)| !k.is_empty() && !v.is_empty())
        .map(|(k, v)| format!(".__{k}={v}"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_sorted_and_cleaned() {
        assert_eq!(
            serialize_tags("zone:eu.west, app:rk").unwrap(),
            ".__app=rk.__zone=eu_west"
        );
        assert_eq!(serialize_tags("").unwrap(), "");
        assert!(serialize_tags("nocolon").is_err());
    }

    #[test]
    fn lines_pack_into_datagrams() {
        let lines: Vec<String> = (0..100)
            .map(|i| format!("ratelimit.service.rate_limit.web.user_{i:03}.total_hits:1|c"))
            .collect();
        let packed = datagrams(&lines);
        assert!(packed.len() > 1);
        assert!(packed.iter().all(|d| d.len() <= 1432));
        assert_eq!(packed.join("\n").split('\n').count(), 100);
    }
}
