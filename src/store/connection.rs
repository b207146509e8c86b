//! Connections to Redis in its three topologies, behind one handle.
//!
//! - **single**: redis-rs `ConnectionManager`s (multiplexed), used
//!   round-robin.
//! - **cluster**: one `ClusterConnection`, which routes each command by its
//!   first key's slot and follows MOVED/ASK and topology changes.
//! - **sentinel**: the master named by the sentinels, through
//!   `ConnectionManager`s, replaced as soon as a sentinel announces another
//!   (`+switch-master`).
//!
//! Single and sentinel share one rule for a connection gone stale: a reply
//! that says the server behind it is no longer a usable primary
//! (`READONLY`: demoted by a failover; `MASTERDOWN`; `LOADING`), a
//! connection lost, on any call, or no answer at all for
//! [`SILENCE_BEFORE_REPLACING`] (a peer gone without a word), replaces the
//! lane's connections in the background with new ones (sentinel: to the
//! master the sentinels name now). Behind one address that moved (a cloud
//! primary endpoint, a Kubernetes Service, a proxy) only new connections
//! reach the new primary, while the open ones stay with the demoted server
//! and would answer `READONLY` for ever.
//!
//! Every topology connects on first use (the warm-up, see `server`), in the
//! background, so ratekeeper starts (and fails open) while Redis is
//! unreachable; and from the serving lane that will use the connections, so
//! their readers run on its thread (`crate::lanes`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::{Duration, Instant};

use futures_util::future::try_join_all;
use futures_util::StreamExt;
use tokio::sync::watch;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{
    ClientTlsConfig, Cmd, ErrorKind, IntoConnectionInfo, RedisError, RedisFuture, TlsCertificates,
    TlsMode, Value,
};

use super::generation::Generation;
use crate::log_pace::{Paced, OUTAGE_PERIOD_S};
use crate::vocab::Topology;
use crate::{Error, Result};

/// "cannot connect" or "timed out", either failure of a reconnect, paced
/// as an outage's connection lines (stale, connected) are each.
/// An outage's connection lines of one store, paced for all its lanes
/// together (each lane reconnects on its own, a few times a second) and
/// apart from the other store's, whose outage they must not hide.
#[derive(Debug)]
pub struct OutageLines {
    stale: Paced,
    connected: Paced,
    cannot_connect: Paced,
}

impl OutageLines {
    pub fn new() -> Arc<Self> {
        Arc::new(OutageLines {
            stale: Paced::every(OUTAGE_PERIOD_S),
            connected: Paced::every(OUTAGE_PERIOD_S),
            cannot_connect: Paced::every(OUTAGE_PERIOD_S),
        })
    }
}

/// Where and how to connect.
#[derive(Clone)]
pub struct RedisSettings {
    pub topology: Topology,
    /// single: `redis://[user:pass@]host:port[/db]` or `host:port`;
    /// cluster: seed nodes `host:port,host:port,...`;
    /// sentinel: `mastername,host:port,host:port,...` (the sentinels).
    pub url: String,
    /// The store it holds (`main`, `per_second`: [`super::Role::name`]),
    /// named in its connection lines.
    pub store: &'static str,
    /// `password` or `user:password` (envoyproxy/ratelimit's `REDIS_AUTH`).
    pub auth: Option<String>,
    /// Multiplexed connections (single and sentinel), in all: spread over
    /// the lanes, at least one each.
    pub connections: usize,
    /// Serving lanes (see [`crate::lanes`]); each has its own connections
    /// (on a cluster, its own cluster connection).
    pub lanes: usize,
    /// Time allowed for establishing a connection.
    pub connect_timeout: Duration,
    /// Time allowed for one call, connection included.
    pub call_timeout: Duration,
    /// TLS to every node (`rediss://` in a single URL turns it on too).
    pub tls: Option<RedisTls>,
    /// Call the limiter as a Redis function (`FCALL`) where Redis has
    /// functions; `false`: always as a script (`EVALSHA`).
    pub functions: bool,
    /// The most time a limiter call adds to the TTL of the keys it saves,
    /// a random amount each call (zero: none; see
    /// [`super::limiter_script::LimiterScript::with_expiry_jitter`]).
    pub expiry_jitter: Duration,
}

/// TLS settings: PEM bytes, read from files at start-up.
#[derive(Clone, Default)]
pub struct RedisTls {
    /// The roots to trust (PEM) when not the system's alone: the system's
    /// and a CA file ([`crate::tls::pem_with_system_roots`]).
    pub ca: Option<Vec<u8>>,
    /// Client certificate and key, for mutual TLS.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
    /// Check the certificate chain but not that it names the host
    /// (envoyproxy/ratelimit's `REDIS_TLS_SKIP_HOSTNAME_VERIFICATION`).
    pub skip_hostname_verification: bool,
}

impl RedisTls {
    fn certificates(&self) -> TlsCertificates {
        TlsCertificates {
            client_tls: self.client.as_ref().map(|(cert, key)| ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
            root_cert: self.ca.clone(),
        }
    }
}

impl std::fmt::Debug for RedisSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL and auth may carry secrets: never print them.
        f.debug_struct("RedisSettings")
            .field("topology", &self.topology)
            .field("store", &self.store)
            .field("connections", &self.connections)
            .field("lanes", &self.lanes)
            .field("connect_timeout", &self.connect_timeout)
            .field("call_timeout", &self.call_timeout)
            .field("tls", &self.tls.is_some())
            .field("expiry_jitter", &self.expiry_jitter)
            .finish_non_exhaustive()
    }
}

impl RedisSettings {
    fn credentials(&self) -> (Option<String>, Option<String>) {
        match self.auth.as_deref() {
            None | Some("") => (None, None),
            Some(auth) => match auth.split_once(':') {
                Some((user, password)) => (Some(user.to_owned()), Some(password.to_owned())),
                None => (None, Some(auth.to_owned())),
            },
        }
    }

    /// Connection info for one node address, with the credentials applied.
    fn node(&self, address: &str) -> Result<redis::ConnectionInfo> {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        let url = match address.split_once("://") {
            Some((_, rest)) if self.tls.is_some() => format!("rediss://{rest}"),
            Some(_) => address.to_owned(),
            None => format!("{scheme}://{address}"),
        };
        let info = url
            .as_str()
            .into_connection_info()
            .map_err(|e| Error::Startup(format!("invalid Redis address ({:?})", e.kind())))?;
        let (user, password) = self.credentials();
        let mut redis = info.redis_settings().clone();
        if let Some(user) = user {
            redis = redis.set_username(user);
        }
        if let Some(password) = password {
            redis = redis.set_password(password);
        }
        Ok(info.set_redis_settings(redis))
    }

    fn manager_config(&self) -> ConnectionManagerConfig {
        // Calls are bounded by their own deadlines (`caller`); the
        // connection waits longer for a reply, so that a budget call can
        // outlast its caller and give back what it reserved late
        // ([`LATE_ANSWER`]).
        ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.call_timeout + LATE_ANSWER))
            .set_number_of_retries(1)
            .set_min_delay(RECONNECT_PAUSE)
            .set_max_delay(Duration::from_secs(1))
    }
}

/// One usable connection.
#[derive(Clone)]
pub enum Conn {
    Managed(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Managed(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Managed(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Managed(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// The connections of one store, whatever the topology.
pub struct Connections {
    settings: RedisSettings,
    current: RwLock<Vec<Conn>>,
    next: AtomicUsize,
    connecting: AtomicBool,
    /// Whether a task follows the sentinels' announcements (sentinel only).
    following: AtomicBool,
    /// `host:port` of the master the connections reach (sentinel only).
    master: Mutex<Option<String>>,
    /// The sentinels each listed one last said it knows of (`SENTINEL
    /// SENTINELS`), as addresses alike the first listed: asked and followed
    /// as those are, so that a list of one sentinel survives its loss.
    /// Replaced at each answer, so a sentinel gone (a pod's old address)
    /// is forgotten once a listed one stops naming it.
    learned_sentinels: Mutex<HashMap<String, Vec<String>>>,
    /// A sentinel named a new master that no reconnect begun since has
    /// reached yet: reconnecting goes on until one does.
    switch_pending: AtomicBool,
    /// The runtime of the lane these connections serve, where their
    /// replacements are made (a connection's reader runs where it was
    /// opened), whoever noticed they were stale (the health probe runs
    /// elsewhere). Set by the lane's warm-up ([`Self::belong_here`]).
    runtime: OnceLock<tokio::runtime::Handle>,
    /// Bumped after every successful (re)connect.
    connected: watch::Sender<u64>,
    /// Failed calls in a row (cluster: a dead master's slots).
    failures: AtomicUsize,
    /// Replacements for silence since an answer (see
    /// [`MAX_SILENCE_DOUBLINGS`]).
    silent_replacements: AtomicU32,
    /// A cluster's last rebuild (ms since `epoch`; 0: none yet) and the
    /// rebuilds of this outage (see [`CLUSTER_REBUILD_SPACING`]).
    last_rebuild_ms: AtomicU64,
    outage_rebuilds: AtomicU32,
    /// When the failures in a row began (or the connections were last
    /// replaced, if later), in ms since `epoch`.
    failing_since_ms: AtomicU64,
    epoch: Instant,
    /// Bumped when replaced connections reach another server than before.
    generation: Generation,
    /// The `run_id` of the server the connections reached last (single and
    /// sentinel; `None` until a replacement has asked).
    run_id: Mutex<Option<String>>,
    /// Connections put in use, and taken out of use by a replacement or
    /// found broken, in all: see [`PoolCounts`].
    opened: AtomicU64,
    closed: AtomicU64,
    /// This store's connection lines, shared by its lanes.
    lines: Arc<OutageLines>,
    /// The connections in use were found broken (single and sentinel: as
    /// many calls in a row as there are connections failed stale or
    /// silent) and neither answered since nor were replaced: they count as
    /// closed, as their radix pool closes each connection a call failed
    /// on, so `cx_active` falls during an outage.
    broken: AtomicBool,
}

/// What envoyproxy/ratelimit's pool stats (`cx_active`, `cx_total`,
/// `cx_local_close`) say, counted in the connections this handle keeps: a
/// multiplexed connection (single, sentinel) or a cluster connection is
/// one. Single's connections count from start-up (they connect on first
/// use, the warm-up); connections found broken (single and sentinel) are
/// closed (and opened again if a call answers on them before they are
/// replaced); a replacement closes the old ones (unless already closed as
/// broken) and opens new ones. A connection the redis crate re-makes by
/// itself inside a connection manager after a drop is not seen here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCounts {
    /// In use now.
    pub active: u64,
    /// Put in use, in all.
    pub opened: u64,
    /// Closed by us (replaced), in all.
    pub closed: u64,
}

/// Reads the [`PoolCounts`] of a store's connections (every lane's,
/// summed) without keeping them alive: a store dropped reads as empty.
#[derive(Debug, Clone, Default)]
pub struct PoolReader(Vec<Weak<Connections>>);

impl PoolReader {
    pub fn new<'a>(connections: impl IntoIterator<Item = &'a Arc<Connections>>) -> Self {
        PoolReader(connections.into_iter().map(Arc::downgrade).collect())
    }

    pub fn counts(&self) -> PoolCounts {
        let live = self.0.iter().filter_map(Weak::upgrade);
        live.map(|c| c.counts())
            .fold(PoolCounts::default(), |a, b| a + b)
    }
}

impl std::ops::Add for PoolCounts {
    type Output = PoolCounts;

    fn add(self, other: PoolCounts) -> PoolCounts {
        PoolCounts {
            active: self.active + other.active,
            opened: self.opened + other.opened,
            closed: self.closed + other.closed,
        }
    }
}

/// How long a connection manager waits after a refused reconnect before
/// its one more attempt (redis-rs adds up to as much again as jitter),
/// while the calls made on it wait for the outcome: with redis-rs's
/// default, 100 ms, a probe that met Redis down a moment before it came
/// back held them 100 to 200 ms, five to ten of the default 20 ms call
/// deadlines; 10 to 20 ms fits in one.
const RECONNECT_PAUSE: Duration = Duration::from_millis(10);

/// Failed calls in a row after which a cluster connection is rebuilt from
/// the seeds: the client keeps reconnecting to a dead master's address and
/// only a fresh topology shows the promoted replica.
const CLUSTER_REBUILD_AFTER: usize = 3;

/// The least time between two cluster rebuilds while calls keep failing,
/// doubled by each (1, 2, 4, then 8 s): a master down with no replica to
/// take its slots fails a call in three, and rebuilding after every few
/// made each replica open a new connection to every node some four times
/// a second, to no avail. The first rebuild of an outage is at once: a
/// failover's new map is what it is for.
const CLUSTER_REBUILD_SPACING: Duration = Duration::from_secs(1);

/// A listed sentinel is asked again which others it knows of after this
/// many 5 s spells without a message on its subscription (a minute).
const RELEARN_EVERY_QUIET_SPELLS: u32 = 12;

/// Quiet after which the next cluster rebuild counts as an outage's first.
const CLUSTER_OUTAGE_OVER: Duration = Duration::from_secs(30);

/// Rebuilds after which [`CLUSTER_REBUILD_SPACING`] stops doubling (1, 2,
/// 4, then 8 s).
const MAX_CLUSTER_REBUILD_DOUBLINGS: u32 = 3;

/// How many times a cluster call is sent again after a redirect, a
/// TRYAGAIN or a lost connection: enough for a stale slot map, a slot
/// being moved and its keys split between two nodes, one after another.
const CLUSTER_RETRIES: u32 = 3;

/// How long a budget call waits for Redis past its callers' deadline
/// (`batcher`), and a connection for a reply past the call deadline: a
/// Reserve granted that late is given back (no caller holds its id).
pub const LATE_ANSWER: Duration = Duration::from_secs(10);

/// How long calls may keep failing, none answered, the last on a timeout,
/// before single's and sentinel's connections are replaced. A peer gone
/// without a word (a dead host, a partition, a proxy that swallows the
/// traffic of a primary it no longer reaches) leaves a TCP connection open
/// for many minutes, or for ever, while a new one may reach a server that
/// answers. A Redis that
/// is only slow meets new connections no worse off: they replace the old
/// ones once connected, and until then the old ones serve.
const SILENCE_BEFORE_REPLACING: Duration = Duration::from_secs(1);

/// Replacements for silence in a row, none answered between, after which
/// the silence waited for stops doubling (1 s, 2 s, 4 s, then 8 s): a Redis
/// stalled for long (a `CLIENT PAUSE`, a slow disk at a save) would
/// otherwise get a new pool a second from every replica, each connection
/// adding to its backlog when it wakes.
const MAX_SILENCE_DOUBLINGS: u32 = 3;

impl Connections {
    /// Prepares the connections; they are made on first use. Never waits
    /// for Redis. `generation` is bumped when a replacement reaches a server
    /// restarted or replaced since; `lines` paces the store's connection
    /// lines.
    pub fn new(
        mut settings: RedisSettings,
        generation: Generation,
        lines: Arc<OutageLines>,
    ) -> Result<Arc<Self>> {
        if settings.url.starts_with("rediss://") && settings.tls.is_none() {
            settings.tls = Some(RedisTls::default());
        }
        if settings.tls.is_some() {
            // rustls needs one crypto provider for the process; ring is the
            // one compiled in. Already installed is fine.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let initial = match settings.topology {
            Topology::Single => {
                let client = settings.client(settings.node(&settings.url)?)?;
                let config = settings.manager_config();
                (0..settings.connections.max(1))
                    .map(|_| {
                        ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
                            .map(Conn::Managed)
                    })
                    .collect::<redis::RedisResult<Vec<_>>>()?
            }
            Topology::Cluster | Topology::Sentinel => {
                // Fail early on a malformed address list.
                settings.addresses()?;
                Vec::new()
            }
        };
        let opened = AtomicU64::new(initial.len() as u64);
        let connections = Arc::new(Connections {
            settings,
            current: RwLock::new(initial),
            next: AtomicUsize::new(0),
            connecting: AtomicBool::new(false),
            following: AtomicBool::new(false),
            master: Mutex::new(None),
            learned_sentinels: Mutex::new(HashMap::new()),
            switch_pending: AtomicBool::new(false),
            runtime: OnceLock::new(),
            connected: watch::Sender::new(0),
            failures: AtomicUsize::new(0),
            silent_replacements: AtomicU32::new(0),
            last_rebuild_ms: AtomicU64::new(0),
            outage_rebuilds: AtomicU32::new(0),
            broken: AtomicBool::new(false),
            lines,
            failing_since_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            generation,
            run_id: Mutex::new(None),
            opened,
            closed: AtomicU64::new(0),
        });
        Ok(connections)
    }

    /// A connection to use now (round-robin), with the [`Self::connects`]
    /// count it belongs to (for [`Self::failed`]). Before the first
    /// connection is made it waits for it, up to `wait`.
    pub async fn get(self: &Arc<Self>, wait: Duration) -> Result<(Conn, u64)> {
        if let Some(conn) = self.pick() {
            return Ok(conn);
        }
        let mut connected = self.connected.subscribe();
        self.reconnect();
        let _ = tokio::time::timeout(wait, connected.changed()).await;
        self.pick()
            .ok_or_else(|| Error::StoreNotCalled("not connected to Redis yet".into()))
    }

    /// Where to make a call once more whose connection `conn`, taken with
    /// `connects`, went away: a connection of a pool that replaced it
    /// since, else `conn` again (redis-rs's manager reconnects at once on
    /// such an error, and the call waits for that, by its deadline). None
    /// on a cluster, whose connection sends again on its own
    /// (`CLUSTER_RETRIES`).
    pub fn again_after(&self, conn: Conn, connects: u64) -> Option<(Conn, u64)> {
        match self.settings.topology {
            Topology::Cluster => None,
            _ if self.connects() == connects => Some((conn, connects)),
            _ => self.pick(),
        }
    }

    /// Makes this runtime (the lane's, at its warm-up) the one replacements
    /// are made on, unless one already is.
    pub fn belong_here(&self) {
        self.runtime.get_or_init(tokio::runtime::Handle::current);
    }

    /// Every connection, the first made if none is yet (waiting up to
    /// `wait` for it), with the [`Self::connects`] count they belong to.
    pub async fn every(self: &Arc<Self>, wait: Duration) -> Result<(Vec<Conn>, u64)> {
        self.get(wait).await?;
        let current = self.current.read().unwrap_or_else(|p| p.into_inner());
        Ok((current.clone(), self.connects()))
    }

    /// The pool stats' counts, read when stats are sent.
    pub fn counts(&self) -> PoolCounts {
        let active = match self.broken.load(Ordering::Relaxed) {
            true => 0,
            false => self.in_use(),
        };
        PoolCounts {
            active: active as u64,
            opened: self.opened.load(Ordering::Relaxed),
            closed: self.closed.load(Ordering::Relaxed),
        }
    }

    /// A connection and its count, read under the lock a replacement
    /// bumps the count in: a connection replaced since never passes for one
    /// of the new pool (whose failures its own would then replace).
    fn pick(&self) -> Option<(Conn, u64)> {
        let current = self.current.read().unwrap_or_else(|p| p.into_inner());
        if current.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % current.len();
        Some((current[i].clone(), self.connects()))
    }

    fn in_use(&self) -> usize {
        self.current.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// How many times connections were made so far: a call takes the count
    /// with its connection ([`Self::get`]), for [`Self::failed`].
    fn connects(&self) -> u64 {
        *self.connected.borrow()
    }

    /// Records a successful call.
    pub fn succeeded(&self) {
        self.failures.store(0, Ordering::Relaxed);
        self.silent_replacements.store(0, Ordering::Relaxed);
        // Answering again before a replacement: open again.
        if self.broken.load(Ordering::Relaxed) && self.broken.swap(false, Ordering::AcqRel) {
            self.opened
                .fetch_add(self.in_use() as u64, Ordering::Relaxed);
        }
    }

    /// The connections in use are broken: closed, for the pool stats.
    fn found_broken(&self) {
        if !self.broken.swap(true, Ordering::AcqRel) {
            self.closed
                .fetch_add(self.in_use() as u64, Ordering::Relaxed);
        }
    }

    /// Starts the clock of [`Self::failing_for`] now.
    fn failing_from_now(&self) {
        let now = self.epoch.elapsed().as_millis() as u64;
        self.failing_since_ms.store(now, Ordering::Relaxed);
    }

    /// How long calls have been failing with none answered (since the
    /// connections were replaced, if later).
    fn failing_for(&self) -> Duration {
        let since = Duration::from_millis(self.failing_since_ms.load(Ordering::Relaxed));
        self.epoch.elapsed().saturating_sub(since)
    }

    /// Reacts to a failed call (`error` is `None` for our deadline; the
    /// client's own response timeout is a timeout too): single and sentinel
    /// replace their connections when the error shows them stale
    /// ([`is_stale`]), or when calls have failed, none answered, for
    /// [`SILENCE_BEFORE_REPLACING`], the last on a timeout; a cluster is
    /// rebuilt from the seeds after failures in a row.
    ///
    /// `since`: the [`Self::connects`] count the failed call's connection was taken
    /// in. A call made on connections replaced since failed on those, not
    /// on the ones in use: its failure changes nothing (a call in flight
    /// when Redis restarted would otherwise replace the new pool too).
    pub fn failed(self: &Arc<Self>, since: u64, error: Option<&RedisError>) {
        if since != self.connects() {
            return;
        }
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures == 1 {
            self.failing_from_now();
        }
        match self.settings.topology {
            Topology::Single | Topology::Sentinel => {
                let why = match error {
                    Some(error) if is_stale(error) => error.to_string(),
                    Some(error) if !error.is_timeout() => return,
                    _ if self.failing_for() >= self.silence_before_replacing() => {
                        format!("no answer for {:?}", self.failing_for())
                    }
                    _ => return,
                };
                let silent = !error.is_some_and(is_stale);
                // As many calls failed as there are connections, none
                // answered between: not one connection a peer dropped.
                if failures >= self.in_use() {
                    self.found_broken();
                }
                if self.reconnect() {
                    // Counted once per replacement, not per call that
                    // timed out meanwhile.
                    if silent {
                        self.silent_replacements.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(left_out) = self.lines.stale.admit() {
                        let store = self.settings.store;
                        tracing::info!(%why, store, left_out, "Redis connections stale: replacing them");
                    }
                }
            }
            Topology::Cluster => {
                if failures >= CLUSTER_REBUILD_AFTER && self.rebuild_due() {
                    self.failures.store(0, Ordering::Relaxed);
                    self.reconnect();
                }
            }
        }
    }

    /// Whether a cluster rebuild may start now (and then it counts as
    /// made): see [`CLUSTER_REBUILD_SPACING`].
    fn rebuild_due(&self) -> bool {
        let now = self.epoch.elapsed().as_millis() as u64;
        let last = self.last_rebuild_ms.load(Ordering::Relaxed);
        let since = Duration::from_millis(now.saturating_sub(last));
        let made = match last == 0 || since >= CLUSTER_OUTAGE_OVER {
            true => 0,
            false => self.outage_rebuilds.load(Ordering::Relaxed),
        };
        let spacing = match made {
            0 => Duration::ZERO,
            n => CLUSTER_REBUILD_SPACING * (1 << (n - 1).min(MAX_CLUSTER_REBUILD_DOUBLINGS)),
        };
        // The one call that moves the last rebuild's time makes it, and
        // counts it: a concurrent loser changes nothing.
        let due = since >= spacing
            && self
                .last_rebuild_ms
                .compare_exchange(last, now.max(1), Ordering::AcqRel, Ordering::Relaxed)
                .is_ok();
        if due {
            self.outage_rebuilds.store(made + 1, Ordering::Relaxed);
        }
        due
    }

    /// The silence that replaces the connections now: doubled by each
    /// replacement for silence since the last answer, up to
    /// [`MAX_SILENCE_DOUBLINGS`] times.
    fn silence_before_replacing(&self) -> Duration {
        let doublings = self.silent_replacements.load(Ordering::Relaxed);
        SILENCE_BEFORE_REPLACING * (1 << doublings.min(MAX_SILENCE_DOUBLINGS))
    }

    /// Reconnects because a sentinel named a new master: now, or once the
    /// reconnect under way ends; and again until one succeeds.
    fn switch_master(self: &Arc<Self>) {
        self.switch_pending.store(true, Ordering::Release);
        self.reconnect();
    }

    /// (Re)connects in the background, once at a time, on the lane's
    /// runtime (this one's, if none was named by [`Self::belong_here`]);
    /// returns whether this call started it.
    fn reconnect(self: &Arc<Self>) -> bool {
        if self.connecting.swap(true, Ordering::AcqRel) {
            return false;
        }
        let this = self.clone();
        let runtime = self
            .runtime
            .get_or_init(tokio::runtime::Handle::current)
            .clone();
        runtime.spawn(async move {
            let switching = this.switch_pending.swap(false, Ordering::AcqRel);
            match tokio::time::timeout(this.settings.connect_timeout * 2, this.connect()).await {
                Ok(Ok(conns)) => {
                    this.opened.fetch_add(conns.len() as u64, Ordering::Relaxed);
                    let mut current = this.current.write().unwrap_or_else(|p| p.into_inner());
                    let replaced = std::mem::replace(&mut *current, conns);
                    // Those found broken were counted closed then.
                    let broken = this.broken.swap(false, Ordering::AcqRel);
                    // New connections get their own time to answer.
                    this.failing_from_now();
                    // Under the lock: see `pick`.
                    this.connected.send_modify(|n| *n += 1);
                    drop(current);
                    if !broken {
                        this.closed
                            .fetch_add(replaced.len() as u64, Ordering::Relaxed);
                    }
                    if let Some(left_out) = this.lines.connected.admit() {
                        let (topology, store) = (this.settings.topology, this.settings.store);
                        tracing::info!(?topology, store, left_out, "connected to Redis");
                    }
                    if this.settings.topology == Topology::Sentinel
                        && !this.following.swap(true, Ordering::AcqRel)
                    {
                        tokio::spawn(follow_switches(Arc::downgrade(&this)));
                    }
                }
                Ok(Err(error)) => {
                    this.switch_pending.fetch_or(switching, Ordering::AcqRel);
                    if let Some(left_out) = this.lines.cannot_connect.admit() {
                        let store = this.settings.store;
                        tracing::warn!(%error, store, left_out, "cannot connect to Redis; will retry");
                    }
                }
                Err(_) => {
                    this.switch_pending.fetch_or(switching, Ordering::AcqRel);
                    if let Some(left_out) = this.lines.cannot_connect.admit() {
                        let store = this.settings.store;
                        tracing::warn!(store, left_out, "connecting to Redis timed out; will retry");
                    }
                }
            }
            // Pace retries: at most one attempt per 200 ms.
            tokio::time::sleep(Duration::from_millis(200)).await;
            this.connecting.store(false, Ordering::Release);
            if this.switch_pending.load(Ordering::Acquire) {
                this.reconnect();
            }
        });
        true
    }

    async fn connect(&self) -> Result<Vec<Conn>> {
        let s = &self.settings;
        match s.topology {
            Topology::Single => {
                let mut conns = self.managers(s.client(s.node(&s.url)?)?).await?;
                if let Some(first) = conns.first_mut() {
                    // Unanswered, the next replacement asks again.
                    let _ = self.note_server(first).await;
                }
                Ok(conns)
            }
            Topology::Cluster => {
                let nodes = s
                    .addresses()?
                    .iter()
                    .map(|a| s.node(a))
                    .collect::<Result<Vec<_>>>()?;
                let mut builder = ClusterClientBuilder::new(nodes);
                if let Some(tls) = &s.tls {
                    builder = builder
                        .tls(TlsMode::Secure)
                        .certs(tls.certificates())
                        .danger_accept_invalid_hostnames(tls.skip_hostname_verification);
                }
                let client = builder
                    .connection_timeout(s.connect_timeout)
                    .response_timeout(s.call_timeout)
                    // A redirect means the script did not run: during
                    // resharding a call can meet a stale slot map (MOVED),
                    // a slot being moved (ASK) and keys split between the
                    // two nodes (TRYAGAIN) in a row. The response timeout
                    // bounds the call with its retries (redis-rs's overall
                    // timeout), so more tries never outlast the deadline;
                    // the waits before a TRYAGAIN's retry (5 to 50 ms) fit
                    // in it, where the crate's own (1.28 s at least) would
                    // not.
                    .retries(CLUSTER_RETRIES)
                    .min_retry_wait(5)
                    .max_retry_wait(50)
                    .build()?;
                Ok(vec![Conn::Cluster(client.get_async_connection().await?)])
            }
            Topology::Sentinel => {
                let (name, sentinels) = self.sentinels()?;
                let wait = s.connect_timeout;
                let asks = sentinels
                    .into_iter()
                    .map(|(_, sentinel)| Box::pin(named_master(sentinel, &name, wait)));
                let (master, _) = futures_util::future::select_ok(asks).await.map_err(|_| {
                    Error::Store(format!("no sentinel named a master for {name:?}"))
                })?;
                let mut conns = self.managers(s.client(s.node(&master)?)?).await?;
                if let Some(first) = conns.first_mut() {
                    // One sentinel's word (the first to answer) is checked
                    // with the server: a sentinel behind the others may name
                    // a demoted master. (A server that denies ROLE is taken
                    // at the sentinel's word.)
                    if role(first).await.is_some_and(|role| role != "master") {
                        return Err(Error::Store(format!(
                            "{master}, named master by a sentinel, is not one (yet)"
                        )));
                    }
                    // Unanswered, the next replacement asks again.
                    let _ = self.note_server(first).await;
                }
                *self.master.lock().unwrap_or_else(|p| p.into_inner()) = Some(master);
                Ok(conns)
            }
        }
    }

    /// Sentinel's master name and each sentinel, listed or learned, with
    /// its address (a learned one whose address does not parse is left
    /// out).
    fn sentinels(&self) -> Result<(String, Vec<(String, redis::Client)>)> {
        let (name, addresses) = self.settings.sentinel_addresses()?;
        let mut sentinels = addresses
            .into_iter()
            .map(|a| Ok((a.clone(), self.settings.sentinel_client(&a)?)))
            .collect::<Result<Vec<_>>>()?;
        for address in self.learned() {
            match self.settings.sentinel_client(&address) {
                Ok(client) => sentinels.push((address, client)),
                Err(error) => {
                    tracing::warn!(%error, sentinel = %address, "a learned sentinel's address is not one: left out")
                }
            }
        }
        Ok((name, sentinels))
    }

    /// The learned sentinels that are not listed, each once.
    fn learned(&self) -> Vec<String> {
        let Ok((_, listed)) = self.settings.sentinel_addresses() else {
            return Vec::new();
        };
        let learned = self
            .learned_sentinels
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut found: Vec<String> = Vec::new();
        for address in learned.values().flatten() {
            let known = listed
                .iter()
                .chain(found.iter())
                .any(|a| at(a) == at(address));
            if !known {
                found.push(address.clone());
            }
        }
        found
    }

    /// Whether `address` is a sentinel listed or learned now.
    fn knows_sentinel(&self, address: &str) -> bool {
        let listed = self
            .settings
            .sentinel_addresses()
            .is_ok_and(|(_, listed)| listed.iter().any(|a| a == address));
        listed || self.learned().iter().any(|a| a == address)
    }

    /// Records the sentinels the listed sentinel at `address` knows of for
    /// `master`, in place of what it said before; a learned one is not
    /// asked (the list stays anchored on the configured sentinels).
    async fn learn_sentinels(&self, sentinel: &redis::Client, address: &str, master: &str) {
        let Ok((_, listed)) = self.settings.sentinel_addresses() else {
            return;
        };
        if !listed.iter().any(|a| a == address) {
            return;
        }
        let wait = self.settings.connect_timeout;
        let ask = async {
            let mut conn = sentinel.get_multiplexed_async_connection().await?;
            redis::cmd("SENTINEL")
                .arg("SENTINELS")
                .arg(master)
                .query_async::<Vec<Vec<String>>>(&mut conn)
                .await
        };
        let Ok(Ok(known)) = tokio::time::timeout(wait, ask).await else {
            return;
        };
        let answer: Vec<String> = known
            .iter()
            .filter_map(|fields| {
                let field = |name: &str| {
                    fields
                        .chunks(2)
                        .find(|pair| pair[0] == name)
                        .and_then(|pair| pair.get(1))
                };
                Some(alike(&listed[0], &host_port(field("ip")?, field("port")?)))
            })
            .collect();
        let before = self.learned();
        self.learned_sentinels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(address.to_owned(), answer);
        for learned in self.learned() {
            if !before.contains(&learned) {
                tracing::info!(sentinel = %at(&learned), "learned a sentinel from another");
            }
        }
    }

    /// Learns which server single's connections reach (its `run_id`),
    /// unless known: they are made lazily, without [`Self::note_server`],
    /// so that the first replacement, back on the same server, would take
    /// it for another. Sentinel's connections learn it when made.
    pub async fn learn_server(&self) -> Result<()> {
        let known = self
            .run_id
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some();
        if known || self.settings.topology != Topology::Single {
            return Ok(());
        }
        if let Some((mut conn, _)) = self.pick() {
            self.note_server(&mut conn).await?;
        }
        Ok(())
    }

    /// Asks the server that replacement connections reached for its
    /// `run_id`, and bumps the generation when it is not the one the
    /// connections reached before (or that is unknown): a restart or
    /// another server, which may not hold the data this one learnt from.
    /// A server that denies `INFO` leaves the generation alone.
    /// `Err` when `INFO` got no answer (a timeout, a broken connection);
    /// a server's refusal (an ACL) is `Ok`: there is nothing to learn.
    async fn note_server(&self, conn: &mut Conn) -> std::result::Result<(), RedisError> {
        let info = match redis::cmd("INFO")
            .arg("server")
            .query_async::<String>(conn)
            .await
        {
            Ok(info) => info,
            Err(error) if matches!(error.kind(), ErrorKind::Server(_)) => return Ok(()),
            Err(error) => return Err(error),
        };
        let Some(run_id) = info.lines().find_map(|l| l.strip_prefix("run_id:")) else {
            return Ok(());
        };
        let run_id = run_id.trim();
        let mut last = self.run_id.lock().unwrap_or_else(|p| p.into_inner());
        if last.as_deref() == Some(run_id) {
            return Ok(());
        }
        if last.is_some() {
            tracing::info!("Redis restarted or replaced (another run_id)");
        }
        self.generation.bump();
        *last = Some(run_id.to_owned());
        Ok(())
    }

    /// The pool's connections to the server `client` leads to, connected
    /// before they are handed out: a replacement never swaps connections
    /// for ones that cannot connect.
    async fn managers(&self, client: redis::Client) -> Result<Vec<Conn>> {
        let config = self.settings.manager_config();
        let connecting = (0..self.settings.connections.max(1))
            .map(|_| ConnectionManager::new_with_config(client.clone(), config.clone()));
        Ok(try_join_all(connecting)
            .await?
            .into_iter()
            .map(Conn::Managed)
            .collect())
    }
}

/// Replaces the connections of a sentinel topology as soon as a sentinel
/// announces another master for its name (`+switch-master`). A failover
/// the sentinels make names the new master while the old one can stay a
/// writable master for seconds, until they reconfigure it (10 s measured);
/// what it counts meanwhile is lost when it syncs from the new one, and
/// nothing it answers says it is stale. Listens to every sentinel at once,
/// so that one silent (paused, cut off) hides nothing the others announce;
/// ends when the connections are dropped.
async fn follow_switches(connections: Weak<Connections>) {
    let mut followed = std::collections::HashSet::new();
    loop {
        let Some(this) = connections.upgrade() else {
            return;
        };
        let Ok((master, sentinels)) = this.sentinels() else {
            return;
        };
        let wait = this.settings.connect_timeout;
        drop(this);
        // A follower whose sentinel was forgotten ends on its own.
        followed.retain(|a| sentinels.iter().any(|(address, _)| address == a));
        for (address, sentinel) in sentinels {
            if followed.insert(address.clone()) {
                let (master, connections) = (master.clone(), connections.clone());
                tokio::spawn(async move {
                    follow_one(&sentinel, &address, &master, wait, &connections).await;
                });
            }
        }
        // Learned ones join the followed at the next look.
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}

/// Follows one sentinel's announcements, subscribing again a second after
/// it goes away or falls silent, until the connections are dropped.
async fn follow_one(
    sentinel: &redis::Client,
    address: &str,
    master: &str,
    wait: Duration,
    connections: &Weak<Connections>,
) {
    let known = || {
        connections
            .upgrade()
            .is_some_and(|this| this.knows_sentinel(address))
    };
    while known() {
        if let Some(pubsub) = subscribe(sentinel, address, master, wait, connections).await {
            if !listen(pubsub, address, master, wait, connections).await {
                return;
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Subscribes to `sentinel`'s `+switch-master`, then asks it for the
/// master: a switch announced before (while this sentinel was away or
/// this subscription down) is caught up with here.
async fn subscribe(
    sentinel: &redis::Client,
    address: &str,
    master: &str,
    wait: Duration,
    connections: &Weak<Connections>,
) -> Option<redis::aio::PubSub> {
    let subscribed = tokio::time::timeout(wait, async {
        let mut pubsub = sentinel.get_async_pubsub().await?;
        pubsub.subscribe("+switch-master").await?;
        redis::RedisResult::Ok(pubsub)
    });
    let pubsub = subscribed.await.ok()?.ok()?;
    let named = named_master(sentinel.clone(), master, wait).await;
    let this = connections.upgrade()?;
    this.learn_sentinels(sentinel, address, master).await;
    let reached = this
        .master
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    if let (Ok(named), Some(reached)) = (named, reached) {
        if named != reached {
            tracing::info!(%named, %reached, "a sentinel names another master: reconnecting");
            this.switch_master();
        }
    }
    Some(pubsub)
}

/// Follows one sentinel's announcements until it goes away or falls silent
/// (pinged after 5 s without a message); false once the connections are
/// dropped.
async fn listen(
    pubsub: redis::aio::PubSub,
    address: &str,
    master: &str,
    wait: Duration,
    connections: &Weak<Connections>,
) -> bool {
    let (mut sink, mut messages) = pubsub.split();
    let mut quiet_spells = 0u32;
    loop {
        let message = tokio::time::timeout(Duration::from_secs(5), messages.next()).await;
        let Some(this) = connections.upgrade() else {
            return false;
        };
        match message {
            Ok(Some(message)) => {
                let payload: String = message.get_payload().unwrap_or_default();
                let Some(named) = switched_to(&payload, master) else {
                    continue;
                };
                // Every sentinel announces the switch: once the
                // connections reach the new master, the others' repeats
                // change nothing.
                let reached = this
                    .master
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                if reached.as_deref() != Some(named.as_str()) {
                    tracing::info!(%payload, "the sentinels named a new master: reconnecting");
                    this.switch_master();
                }
            }
            Ok(None) => return true,
            // Forgotten (no listed sentinel names it any more): its
            // follower ends, as another server may take its address.
            Err(_) if !this.knows_sentinel(address) => return false,
            Err(_) => {
                let pong = tokio::time::timeout(wait, sink.ping::<redis::Value>()).await;
                if !matches!(pong, Ok(Ok(_))) {
                    return true;
                }
                // About once a minute, the other sentinels it knows of
                // again (a pod restarted elsewhere, a sentinel added).
                quiet_spells += 1;
                if quiet_spells % RELEARN_EVERY_QUIET_SPELLS == 0 {
                    if let Ok(sentinel) = this.settings.sentinel_client(address) {
                        this.learn_sentinels(&sentinel, address, master).await;
                    }
                }
            }
        }
    }
}

/// `host:port`, or `[host]:port` for an IPv6 host: how a master's address
/// is written, to compare what the sentinels name with what was reached.
fn host_port(host: &str, port: impl std::fmt::Display) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The `host:port` of a sentinel's address as listed (`host:port`, or a
/// URL with credentials, a path or a query: `redis://user:pass@host:port/0`).
fn at(address: &str) -> &str {
    let rest = address.split_once("://").map_or(address, |(_, rest)| rest);
    let rest = rest.split(['/', '?']).next().unwrap_or(rest);
    rest.rsplit_once('@').map_or(rest, |(_, host)| host)
}

/// `host_port` written as `listed` is (its scheme, credentials, path and
/// query): a learned sentinel takes the listed ones' password and TLS.
fn alike(listed: &str, host_port: &str) -> String {
    let host = at(listed);
    match listed.split_once(host) {
        Some((prefix, suffix)) => format!("{prefix}{host_port}{suffix}"),
        None => host_port.to_owned(),
    }
}

/// The new master a `+switch-master` message names for `master` ("<name>
/// <old ip> <old port> <new ip> <new port>"); None for another name.
fn switched_to(payload: &str, master: &str) -> Option<String> {
    let fields: Vec<&str> = payload.split(' ').collect();
    match fields[..] {
        [name, _, _, host, port] if name == master => Some(host_port(host, port)),
        _ => None,
    }
}

/// `host:port` of the master `sentinel` names for `name`, asked within
/// `wait` (a sentinel silent or gone fails, it does not hold the others up).
async fn named_master(sentinel: redis::Client, name: &str, wait: Duration) -> Result<String> {
    let ask = async {
        let mut conn = sentinel.get_multiplexed_async_connection().await?;
        redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(name)
            .query_async::<Option<(String, u16)>>(&mut conn)
            .await
    };
    match tokio::time::timeout(wait, ask).await {
        Ok(Ok(Some((host, port)))) => Ok(host_port(&host, port)),
        Ok(Ok(None)) => Err(Error::Store(format!(
            "the sentinel knows no master {name:?}"
        ))),
        Ok(Err(error)) => Err(error.into()),
        Err(_) => Err(Error::Store("the sentinel did not answer in time".into())),
    }
}

/// What the server behind `conn` says it is (`ROLE`: `master`, `slave`,
/// `sentinel`); `None` when it does not answer that (a proxy or an ACL
/// that denies `ROLE`).
pub async fn role(conn: &mut impl ConnectionLike) -> Option<String> {
    let role = redis::cmd("ROLE")
        .query_async::<Vec<Value>>(conn)
        .await
        .ok()?;
    role.first()
        .and_then(|r| redis::from_redis_value::<String>(r.clone()).ok())
}

/// Whether `error` shows that the connection it came on leads nowhere
/// useful any more, so that it must be replaced: the server was demoted to
/// a replica (`READONLY`), lost its master (`MASTERDOWN`), is loading its
/// data after a restart (`LOADING`), the connection broke, or its
/// reconnection was refused its login (a password rotated: the redis
/// crate's connection manager keeps that failure for good, so only new
/// connections, made once the password is right again, end it). (The
/// three replies come before a script runs: nothing was counted.) One
/// timeout is not one: the server may just be slow, and new connections
/// would only add to its load; [`SILENCE_BEFORE_REPLACING`] of them is.
fn is_stale(error: &RedisError) -> bool {
    use redis::ServerErrorKind::{BusyLoading, MasterDown, ReadOnly};
    matches!(
        error.kind(),
        ErrorKind::Server(ReadOnly | MasterDown | BusyLoading) | ErrorKind::AuthenticationFailed
    ) || (error.is_io_error() && !error.is_timeout())
        || error.is_connection_dropped()
}

impl RedisSettings {
    /// A client for one node, with TLS certificates when configured.
    fn client(&self, info: redis::ConnectionInfo) -> Result<redis::Client> {
        let invalid =
            |e: RedisError| Error::Startup(format!("invalid Redis settings ({:?})", e.kind()));
        let Some(tls) = &self.tls else {
            return redis::Client::open(info).map_err(invalid);
        };
        let client = redis::Client::build_with_tls(info, tls.certificates()).map_err(invalid)?;
        if !tls.skip_hostname_verification {
            return Ok(client);
        }
        // The certificates are in the address's TLS parameters only once
        // built; the flag goes there too.
        let info = client.get_connection_info().clone();
        let mut addr = info.addr().clone();
        addr.set_danger_accept_invalid_hostnames(true);
        redis::Client::open(info.set_addr(addr)).map_err(invalid)
    }

    /// The comma-separated parts of `url` (cluster and sentinel).
    fn addresses(&self) -> Result<Vec<String>> {
        let parts: Vec<String> = self
            .url
            .split(',')
            .map(|p| p.trim().to_owned())
            .filter(|p| !p.is_empty())
            .collect();
        let needed = if self.topology == Topology::Sentinel {
            2
        } else {
            1
        };
        if parts.len() < needed {
            return Err(Error::Startup(match self.topology {
                Topology::Sentinel => {
                    "sentinel: --redis-url must be mastername,host:port[,host:port...]".into()
                }
                _ => "cluster: --redis-url must be host:port[,host:port...]".into(),
            }));
        }
        Ok(parts)
    }

    /// Sentinel's master name and the sentinels' addresses, as listed.
    fn sentinel_addresses(&self) -> Result<(String, Vec<String>)> {
        let mut addresses = self.addresses()?;
        if addresses.len() < 2 {
            return Err(Error::Startup(
                "sentinel: expected mastername,host:port,...".into(),
            ));
        }
        let name = addresses.remove(0);
        Ok((name, addresses))
    }

    /// A client of the sentinel at `address` (with the master's TLS, as
    /// envoyproxy/ratelimit dials both alike).
    fn sentinel_client(&self, address: &str) -> Result<redis::Client> {
        self.client(self.node_without_auth(address)?)
    }

    /// A sentinel's address: sentinels here take no password; TLS (a
    /// `rediss://` address) as the master's.
    fn node_without_auth(&self, address: &str) -> Result<redis::ConnectionInfo> {
        let url = match (address.split_once("://"), self.tls.is_some()) {
            (Some((_, rest)), true) => format!("rediss://{rest}"),
            (Some(_), false) => address.to_owned(),
            (None, true) => format!("rediss://{address}"),
            (None, false) => format!("redis://{address}"),
        };
        url.as_str()
            .into_connection_info()
            .map_err(|e| Error::Startup(format!("invalid sentinel address ({:?})", e.kind())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_never_shows_secrets() {
        let settings = RedisSettings {
            topology: Topology::Single,
            url: "redis://user:url-secret@127.0.0.1:6379".into(),
            store: "main",
            auth: Some("user:auth-secret".into()),
            connections: 1,
            lanes: 1,
            connect_timeout: Duration::from_secs(1),
            call_timeout: Duration::from_secs(1),
            functions: true,
            expiry_jitter: Duration::ZERO,
            tls: Some(RedisTls {
                ca: None,
                client: Some((b"cert".to_vec(), b"key-secret".to_vec())),
                skip_hostname_verification: false,
            }),
        };
        let debug = format!("{settings:?}");
        for secret in ["url-secret", "auth-secret", "key-secret"] {
            assert!(!debug.contains(secret), "{debug}");
        }
    }

    /// A learned sentinel is written as the first listed one is: its
    /// scheme and credentials, the learned host and port.
    #[test]
    fn a_learned_sentinel_takes_the_listed_ones_credentials() {
        assert_eq!(at("redis://u:p@10.0.0.1:26379"), "10.0.0.1:26379");
        assert_eq!(at("10.0.0.1:26379"), "10.0.0.1:26379");
        assert_eq!(
            alike("rediss://:p%40w@s1:26379", "10.0.0.2:26380"),
            "rediss://:p%40w@10.0.0.2:26380"
        );
        assert_eq!(alike("s1:26379", "[::1]:26380"), "[::1]:26380");
        assert_eq!(at("redis://:p@s1:26379/0?x=1"), "s1:26379");
        assert_eq!(
            alike("redis://:p@s1:26379/0", "10.0.0.2:26380"),
            "redis://:p@10.0.0.2:26380/0"
        );
    }

    #[test]
    fn a_switch_names_the_new_master_as_a_sentinel_would() {
        let switched = |payload| switched_to(payload, "mymaster");
        assert_eq!(
            switched("mymaster 10.0.0.1 6379 10.0.0.2 6380").as_deref(),
            Some("10.0.0.2:6380")
        );
        assert_eq!(
            switched("mymaster ::1 6379 fd00::2 6379").as_deref(),
            Some("[fd00::2]:6379")
        );
        assert_eq!(switched("other 10.0.0.1 6379 10.0.0.2 6380"), None);
        assert_eq!(switched("mymaster 10.0.0.2 6380"), None);
    }
}
