//! The statsd sink, for pipelines built on envoyproxy/ratelimit's statsd
//! stats (statsd_exporter, DogStatsD, Telegraf): counters and timers under
//! their stat names, added to in memory on the request path (one atomic add
//! for a counter, one short lock for a timer sample) and sent over UDP by a
//! task every flush interval, never from a request.
//!
//! Gauges and running totals kept elsewhere (connections open, cache
//! entries) are read at each flush instead ([`read_when_sent`]): they cost
//! the request path nothing.
//!
//! Lines are plain statsd, `name:delta|c`, `name:ms|ms` and `name:value|g`,
//! newline-separated,
//! as many as fit one datagram. Extra tags are appended to the name the way
//! envoyproxy/ratelimit's client (gostats) writes them, `name.__key=value`
//! (keys sorted; `.`, `:` and `|` in values become `_`), which
//! statsd_exporter takes as part of the name; with `USE_DOG_STATSD` they
//! are DogStatsD tags instead, `name:delta|c|#key:value,…`, after the
//! name went through the [`Mogrifiers`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::container_id;
use crate::dogstatsd::Mogrifiers;
use crate::log_pace::{Paced, OUTAGE_PERIOD_S};
use crate::{Error, Result};

/// Where and how often the stats are sent.
#[derive(Debug, Clone)]
pub struct StatsdSettings {
    /// `host:port` of the statsd server, resolved at every flush.
    pub addr: String,
    pub flush_interval: Duration,
    /// `EXTRA_TAGS`: `key:value` pairs, comma-separated.
    pub extra_tags: String,
    /// `USE_DOG_STATSD`: DogStatsD tags, names through these mogrifiers.
    pub dog: Option<Mogrifiers>,
}

/// A statsd counter: the hits since the last flush.
pub type Counter = Arc<AtomicU64>;

/// A statsd timer: the samples since the last flush.
pub type Timer = Arc<Samples>;

/// A timer's samples, at most 1024 per flush (`KEPT`: some 60 KB of lines,
/// which a receiver's default socket buffer holds; 4096 sent at once lost
/// a fifth of them there): past that, every
/// other one kept is dropped and from then on one call in twice as many is
/// kept (one in `step`, a power of two), and the lines carry the sample
/// rate `1/step` (`|@0.25`). statsd_exporter counts each such line as
/// `int(1/rate)` calls, exactly `step` here, so the count it makes is the
/// calls' within `step` (a rate such as 0.68 counted each line once), and a
/// burst of calls cannot grow memory or the datagrams sent.
#[derive(Debug)]
pub struct Samples {
    kept: Mutex<Kept>,
}

#[derive(Debug)]
struct Kept {
    samples: Vec<f64>,
    /// Calls since the last flush.
    seen: u64,
    /// One call in `step` is kept.
    step: u64,
}

impl Default for Samples {
    fn default() -> Self {
        Samples {
            kept: Mutex::new(Kept {
                samples: Vec::new(),
                seen: 0,
                step: 1,
            }),
        }
    }
}

impl Samples {
    const KEPT: usize = 1024;

    /// One call that took `elapsed`.
    pub fn record(&self, elapsed: Duration) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.seen += 1;
        if (kept.seen - 1) % kept.step != 0 {
            return;
        }
        kept.samples.push(elapsed.as_secs_f64() * 1000.0);
        if kept.samples.len() >= Self::KEPT {
            let mut position = 0;
            kept.samples.retain(|_| {
                position += 1;
                position % 2 == 1
            });
            kept.step *= 2;
        }
    }

    /// The kept samples (milliseconds) and the share of calls they stand for.
    fn take(&self) -> (Vec<f64>, f64) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let rate = 1.0 / kept.step as f64;
        kept.seen = 0;
        kept.step = 1;
        (std::mem::take(&mut kept.samples), rate)
    }
}

/// Reads a stat kept elsewhere, when it is sent.
pub type Reader = Arc<dyn Fn() -> u64 + Send + Sync>;

/// What a read stat's value is, so how it is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// A value now: `name:value|g`, every flush (as gostats sends gauges).
    Gauge,
    /// A running total: what it grew by since the last flush,
    /// `name:delta|c`, as a counter.
    Total,
}

/// A stat read at each flush, and (a total) what the last flush read.
struct ReadStat {
    reading: Reading,
    read: Reader,
    last: u64,
}

impl std::fmt::Debug for ReadStat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadStat")
            .field("reading", &self.reading)
            .field("last", &self.last)
            .finish_non_exhaustive()
    }
}

/// The installed sink's stats by name (`None` until [`install`]).
static REGISTRY: OnceLock<Registry> = OnceLock::new();

#[derive(Debug, Default)]
struct Registry {
    counters: Mutex<BTreeMap<String, Counter>>,
    timers: Mutex<BTreeMap<String, Timer>>,
    read: Mutex<BTreeMap<String, ReadStat>>,
}

/// The counter named `name`, if statsd is on. Look it up once and keep it:
/// the lookup takes a lock.
pub fn counter(name: &str) -> Option<Counter> {
    let registry = REGISTRY.get()?;
    let mut counters = registry.counters.lock().unwrap_or_else(|p| p.into_inner());
    Some(counters.entry(name.to_owned()).or_default().clone())
}

/// The timer named `name`, if statsd is on (look it up once, as counters).
pub fn timer(name: &str) -> Option<Timer> {
    let registry = REGISTRY.get()?;
    let mut timers = registry.timers.lock().unwrap_or_else(|p| p.into_inner());
    Some(timers.entry(name.to_owned()).or_default().clone())
}

/// Sends `read`'s value under `name` at every flush, if statsd is on; a
/// later call for the same name replaces it. A total counts from 0.
pub fn read_when_sent(name: &str, reading: Reading, read: Reader) {
    let Some(registry) = REGISTRY.get() else {
        return;
    };
    let mut stats = registry.read.lock().unwrap_or_else(|p| p.into_inner());
    let stat = ReadStat {
        reading,
        read,
        last: 0,
    };
    stats.insert(name.to_owned(), stat);
}

/// Turns the sink on and starts the task that flushes it, for good.
pub async fn install(settings: StatsdSettings) -> Result<()> {
    let format = Format::new(&settings)?;
    if REGISTRY.set(Registry::default()).is_err() {
        return Err(Error::Startup("statsd: installed twice".into()));
    }
    // Resolved at every flush (a sidecar's name may resolve later, or
    // move): a name that does not resolve now is said once, not fatal.
    if let Err(error) = tokio::net::lookup_host(&settings.addr).await {
        tracing::warn!(%error, addr = %settings.addr, "statsd: the address does not resolve (yet); stats are sent once it does");
    }
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(settings.flush_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut sender = Sender::default();
        loop {
            tick.tick().await;
            let datagrams = datagrams(&take_lines(&format));
            if !datagrams.is_empty() {
                sender.send(&settings.addr, &datagrams).await;
            }
        }
    });
    Ok(())
}

/// Sends datagrams to the first address a `host:port` resolves to (as
/// their clients' UDP dial does), from a socket of that address's family:
/// `localhost` resolves to `::1` first where IPv6 is on, as in most
/// containers.
#[derive(Default)]
struct Sender {
    v4: Option<tokio::net::UdpSocket>,
    v6: Option<tokio::net::UdpSocket>,
}

impl Sender {
    async fn send(&mut self, addr: &str, datagrams: &[String]) {
        // Failures cost no more than a warning every few flushes.
        static FAILED: Paced = Paced::every(OUTAGE_PERIOD_S * 6);
        if let Err(error) = self.try_send(addr, datagrams).await {
            if let Some(left_out) = FAILED.admit() {
                tracing::warn!(%error, addr, left_out, "statsd: stats not sent");
            }
        }
    }

    async fn try_send(&mut self, addr: &str, datagrams: &[String]) -> std::io::Result<()> {
        let to = tokio::net::lookup_host(addr)
            .await?
            .next()
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no address"))?;
        let (slot, any) = match to {
            std::net::SocketAddr::V4(_) => (&mut self.v4, "0.0.0.0:0"),
            std::net::SocketAddr::V6(_) => (&mut self.v6, "[::]:0"),
        };
        let socket = match slot {
            Some(socket) => socket,
            None => slot.insert(tokio::net::UdpSocket::bind(any).await?),
        };
        for datagram in datagrams {
            socket.send_to(datagram.as_bytes(), to).await?;
        }
        Ok(())
    }
}

/// One line per counter counted and per timer sample since the last flush,
/// resetting them.
fn take_lines(format: &Format) -> Vec<String> {
    let Some(registry) = REGISTRY.get() else {
        return Vec::new();
    };
    let mut lines = Vec::new();
    let counters = registry.counters.lock().unwrap_or_else(|p| p.into_inner());
    for (name, counter) in counters.iter() {
        let delta = counter.swap(0, Ordering::Relaxed);
        if delta > 0 {
            let (head, tail) = format.parts(name);
            lines.push(format!("{head}:{delta}|c{tail}"));
        }
    }
    drop(counters);
    let mut read = registry.read.lock().unwrap_or_else(|p| p.into_inner());
    lines.extend(
        read.iter_mut()
            .filter_map(|(name, stat)| stat.line(format, name)),
    );
    drop(read);
    let timers = registry.timers.lock().unwrap_or_else(|p| p.into_inner());
    for (name, timer) in timers.iter() {
        let (samples, rate) = timer.take();
        if !samples.is_empty() {
            lines.extend(timer_lines(format, name, &samples, rate));
        }
    }
    lines
}

impl ReadStat {
    /// This flush's line: a gauge's value, or a total's growth if any.
    fn line(&mut self, format: &Format, name: &str) -> Option<String> {
        let now = (self.read)();
        let (head, tail) = format.parts(name);
        match self.reading {
            Reading::Gauge => Some(format!("{head}:{now}|g{tail}")),
            Reading::Total => {
                // A total read lower (its source was replaced) starts over.
                let delta = now.saturating_sub(self.last);
                self.last = now;
                (delta > 0).then(|| format!("{head}:{delta}|c{tail}"))
            }
        }
    }
}

/// A timer's `name:ms|ms` lines, with the sample rate when below 1.
fn timer_lines(format: &Format, name: &str, samples: &[f64], rate: f64) -> Vec<String> {
    // In full (1/2^n is exact in decimal): the server's 1/rate must be
    // the whole number of calls each line stands for.
    let rate = match rate {
        1.0 => String::new(),
        rate => format!("|@{rate}"),
    };
    let (head, tail) = format.parts(name);
    let line = |ms: &f64| format!("{head}:{ms:.3}|ms{rate}{tail}");
    samples.iter().map(line).collect()
}

/// How a stat's line is written: gostats' tags in the name, or DogStatsD's.
#[derive(Debug)]
enum Format {
    /// `EXTRA_TAGS` serialized as gostats appends them to names.
    Gostats(String),
    Dog {
        extra_tags: Vec<String>,
        mogrifiers: Mogrifiers,
        /// `|c:<id>` ([`crate::container_id`]), or empty.
        container: String,
    },
}

impl Format {
    fn new(settings: &StatsdSettings) -> Result<Format> {
        let tags = extra_tags(&settings.extra_tags)?;
        Ok(match &settings.dog {
            None => Format::Gostats(tags.iter().map(|(k, v)| format!(".__{k}={v}")).collect()),
            Some(mogrifiers) => Format::Dog {
                extra_tags: datadog_env_tags(|name| std::env::var(name).ok())
                    .into_iter()
                    .chain(tags.iter().map(|(k, v)| format!("{k}:{v}")))
                    .collect(),
                mogrifiers: mogrifiers.clone(),
                container: container_field(container_id::detect(
                    |name| std::env::var(name).ok(),
                    &container_id::LINUX,
                )),
            },
        })
    }

    /// A stat's line without its value and type: the part before them
    /// (the name) and after them (DogStatsD's tags), worked out once per
    /// stat and flush.
    fn parts(&self, name: &str) -> (String, String) {
        match self {
            Format::Gostats(tags) => (format!("{name}{tags}"), String::new()),
            Format::Dog {
                extra_tags,
                mogrifiers,
                container,
            } => {
                let (name, tags) = mogrifiers.mogrify(name);
                let tags = [extra_tags.as_slice(), &tags].concat();
                match tags.is_empty() {
                    true => (name, container.clone()),
                    false => (name, format!("|#{}{container}", tags.join(","))),
                }
            }
        }
    }

    /// `name:value|kind`, tagged.
    #[cfg(test)]
    fn line(&self, name: &str, value: &str, kind: &str) -> String {
        let (head, tail) = self.parts(name);
        format!("{head}:{value}|{kind}{tail}")
    }
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

/// The `|c:` field of a detected container id, said once at start.
fn container_field(id: Option<String>) -> String {
    match id {
        Some(id) => {
            tracing::info!(container = %id, "DogStatsD origin detection: lines carry the container");
            format!("|c:{id}")
        }
        None => String::new(),
    }
}

/// `EXTRA_TAGS` (`k:v,k:v`), sorted by key and cleaned as gostats cleans
/// them (`.`, `:` and `|` become `_`; empty keys or values are dropped).
/// The tags their DogStatsD client (datadog-go) puts first on every line
/// from Datadog's unified service tagging variables, in its order (set by
/// Datadog's admission controller; monitors filter on `service:`, `env:`).
fn datadog_env_tags(var: impl Fn(&str) -> Option<String>) -> Vec<String> {
    const TAGS: [(&str, &str); 4] = [
        ("DD_ENTITY_ID", "dd.internal.entity_id"),
        ("DD_ENV", "env"),
        ("DD_SERVICE", "service"),
        ("DD_VERSION", "version"),
    ];
    TAGS.iter()
        .filter_map(|(name, tag)| {
            let value = var(name).filter(|v| !v.is_empty())?;
            Some(format!("{tag}:{value}"))
        })
        .collect()
}

fn extra_tags(extra: &str) -> Result<Vec<(String, String)>> {
    let mut tags = BTreeMap::new();
    for pair in extra.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((key, value)) = pair.split_once(':') else {
            return Err(Error::Startup(format!(
                "EXTRA_TAGS: {pair:?} is not key:value"
            )));
        };
        // Values as gostats' `ReplaceChars` makes them; keys as given (a
        // `.` kept: `k8s.cluster`), but for the `|` that would end the line.
        let value = value.trim().replace(['.', ':', '|'], "_");
        tags.insert(key.trim().replace('|', "_"), value);
    }
    tags.retain(|k, v| !k.is_empty() && !v.is_empty());
    Ok(tags.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_sorted_and_cleaned() {
        let settings = |dog: Option<Mogrifiers>| StatsdSettings {
            addr: String::new(),
            flush_interval: Duration::from_secs(1),
            extra_tags: "zone:eu.west, app:rk".into(),
            dog,
        };
        let gostats = Format::new(&settings(None)).unwrap();
        assert_eq!(
            gostats.line("a.b", "1", "c"),
            "a.b.__app=rk.__zone=eu_west:1|c"
        );
        let dog = Format::new(&settings(Some(Mogrifiers::default()))).unwrap();
        assert_eq!(
            dog.line("a.b", "2.5", "ms"),
            "a.b:2.5|ms|#app:rk,zone:eu_west"
        );
        assert!(extra_tags("").unwrap().is_empty());
        assert!(extra_tags("nocolon").is_err());
        // A key keeps its dots, as gostats' tags do; the value does not.
        let tags = extra_tags("k8s.cluster:c1.x").unwrap();
        assert_eq!(tags, [("k8s.cluster".to_string(), "c1_x".to_string())]);
    }

    #[test]
    fn datadog_unified_service_tags_come_first_as_their_client_puts_them() {
        let env = |name: &str| match name {
            "DD_ENV" => Some("prod".to_string()),
            "DD_SERVICE" => Some("ratelimit".to_string()),
            "DD_VERSION" => Some("1.2".to_string()),
            "DD_ENTITY_ID" => Some(String::new()),
            _ => None,
        };
        assert_eq!(
            datadog_env_tags(env),
            ["env:prod", "service:ratelimit", "version:1.2"]
        );
        assert!(datadog_env_tags(|_| None).is_empty());
    }

    /// Past the kept samples, the lines stand for a whole number of calls
    /// each (what statsd_exporter counts: `int(1/rate)`), so the count it
    /// makes is within a line's worth of the calls (6,000 calls were
    /// counted as 4,096 with a rate of 0.6827).
    #[test]
    fn timers_past_the_kept_samples_carry_a_rate_of_whole_calls() {
        let samples = Samples::default();
        for calls in [1u64, 1023, 1024, 1500, 6000, 20_001] {
            for i in 0..calls {
                samples.record(Duration::from_micros(1000 + i));
            }
            let (kept, rate) = samples.take();
            let per_line = (1.0 / rate) as u64;
            assert!(kept.len() <= Samples::KEPT, "{calls}");
            let counted = kept.len() as u64 * per_line;
            assert!(
                (calls..calls + per_line).contains(&counted),
                "{calls} calls counted as {counted}"
            );
            // Every kept sample is a call one `step` apart from the last.
            assert_eq!(kept[0], 1.0, "{calls}");
            if kept.len() > 1 {
                assert_eq!(kept[1], 1.0 + per_line as f64 / 1000.0, "{calls}");
            }
        }
        assert_eq!(samples.take(), (Vec::new(), 1.0));
        let dog = Format::Dog {
            extra_tags: vec!["app:rk".into()],
            mogrifiers: Mogrifiers::default(),
            container: String::new(),
        };
        assert_eq!(
            timer_lines(&dog, "t", &[1.5, 0.25], 0.5),
            ["t:1.500|ms|@0.5|#app:rk", "t:0.250|ms|@0.5|#app:rk"]
        );
        // The container field last, as datadog-go writes it.
        let contained = Format::Dog {
            extra_tags: vec!["app:rk".into()],
            mogrifiers: Mogrifiers::default(),
            container: "|c:in-42".into(),
        };
        assert_eq!(
            timer_lines(&contained, "t", &[1.5], 0.5),
            ["t:1.500|ms|@0.5|#app:rk|c:in-42"]
        );
        let untagged = Format::Dog {
            extra_tags: Vec::new(),
            mogrifiers: Mogrifiers::default(),
            container: "|c:in-42".into(),
        };
        assert_eq!(untagged.line("n", "1", "c"), "n:1|c|c:in-42");
        assert_eq!(
            timer_lines(&dog, "t", &[1.5], 1.0 / 4096.0),
            ["t:1.500|ms|@0.000244140625|#app:rk"]
        );
        let plain = Format::Gostats(String::new());
        assert_eq!(timer_lines(&plain, "t", &[2.0], 1.0), ["t:2.000|ms"]);
    }

    #[test]
    fn read_stats_send_gauges_every_flush_and_totals_as_they_grow() {
        let value = Arc::new(AtomicU64::new(3));
        let source = value.clone();
        let read: Reader = Arc::new(move || source.load(Ordering::Relaxed));
        let stat = |reading| ReadStat {
            reading,
            read: read.clone(),
            last: 0,
        };
        let (mut gauge, mut total) = (stat(Reading::Gauge), stat(Reading::Total));
        let format = Format::Gostats(".__app=rk".into());
        assert_eq!(gauge.line(&format, "g").as_deref(), Some("g.__app=rk:3|g"));
        assert_eq!(total.line(&format, "t").as_deref(), Some("t.__app=rk:3|c"));
        assert_eq!(gauge.line(&format, "g").as_deref(), Some("g.__app=rk:3|g"));
        assert_eq!(total.line(&format, "t"), None, "no growth, no line");
        value.store(5, Ordering::Relaxed);
        assert_eq!(total.line(&format, "t").as_deref(), Some("t.__app=rk:2|c"));
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
