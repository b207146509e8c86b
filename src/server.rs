//! Assembles the server: gRPC (the rate limit service, health, reflection),
//! the HTTP listeners ([`crate::http`]), config hot reload and the store
//! health probe, with graceful shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use futures_util::future::join_all;
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::ServingStatus;

use crate::config::watch::{self, SharedConfig};
use crate::config::LoadOptions;
use crate::grpc_only::GrpcOnlyLayer;
use crate::health::Readiness;
use crate::http;
use crate::incoming::{deal, incoming, Dealt, Listener};
use crate::lanes::Lanes;
use crate::log_pace::{Paced, OUTAGE_PERIOD_S};
use crate::pb::v1::budget_service_server::BudgetServiceServer;
use crate::pb::v1::concurrency_service_server::ConcurrencyServiceServer;
use crate::repeated_cap::RepeatedCapLayer;
use crate::service::admin_leases::AdminLeases;
use crate::service::holds::Holds;
use crate::service::rls::LimiterSettings;
use crate::service::{caps, Budget, Concurrency, RateLimiter};
use crate::store::{Role, Store, Stores};
use crate::tls::ReloadingTls;
use crate::{Error, Result};

/// Descriptor set of Envoy's rate limit service, for reflection (build.rs).
pub const ENVOY_RLS_DESCRIPTOR: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/envoy_rls_descriptor.bin"));

/// The health service name that only says the process is up (for a
/// liveness probe): always SERVING.
pub const LIVENESS_SERVICE: &str = "liveness";

/// Everything a running server needs.
#[derive(Debug)]
pub struct Server {
    /// Where gRPC is served (already bound, so port 0 works).
    pub grpc: Listener,
    /// The limits directory, watched for changes when set.
    pub config_dir: Option<watch::Watched>,
    /// How the directory's files make domains on a reload.
    pub load_options: LoadOptions,
    /// The config to start with.
    pub config: SharedConfig,
    /// Health is NOT_SERVING while the config in force has no domain
    /// (envoyproxy/ratelimit's `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`).
    pub health_needs_domains: bool,
    /// Health is NOT_SERVING while a store is unreachable, once it has
    /// answered (envoyproxy/ratelimit's `REDIS_HEALTH_CHECK_ACTIVE_CONNECTION`);
    /// otherwise a replica stays ready through an outage, as there.
    pub health_needs_store: bool,
    /// The counter stores: the main one (also the concurrency leases'), and
    /// the per-second one when set (`REDIS_PERSECOND`).
    pub store: Stores,
    pub limiter: LimiterSettings,
    /// How often the limits directory is checked for changes.
    pub reload_interval: Duration,
    /// After shutdown is asked, how long in-flight calls and open connections
    /// may drain before they are cut (Envoy keeps its connection open).
    pub shutdown_grace: Duration,
    pub limits: ConnectionLimits,
    /// Serving threads (at least one), each with its own runtime (see
    /// [`crate::lanes`]; `lanes::default_count()` is one per core).
    pub lanes: usize,
    /// The HTTP listeners besides gRPC (`/healthcheck`, `/json`, `/rlconfig`).
    pub http: http::Listeners,
}

/// What one client connection may hold, so slow or stuck clients cannot
/// hold resources forever.
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    /// Time to send the HTTP/2 preface after connecting.
    pub handshake_timeout: Duration,
    /// Calls served at once per connection (more wait).
    pub concurrency_per_connection: usize,
    /// HTTP/2 streams open at once per connection.
    pub max_streams: u32,
    /// HTTP/2 ping interval; a peer that does not answer within
    /// `keepalive_timeout` is dropped.
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    /// Send connections this old a GOAWAY, so clients move to a new one and
    /// rebalance across replicas (envoyproxy/ratelimit's
    /// `GRPC_MAX_CONNECTION_AGE`)...
    pub max_connection_age: Option<Duration>,
    /// ...and close them this long after that, calls in flight or not
    /// (`GRPC_MAX_CONNECTION_AGE_GRACE`; `Duration::MAX`: never).
    pub max_connection_age_grace: Duration,
    /// gRPC over TLS (mutual when the files name a client CA).
    pub tls: Option<ReloadingTls>,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            handshake_timeout: Duration::from_secs(10),
            // Envoy multiplexes all its calls over a few connections: high.
            concurrency_per_connection: 4_096,
            max_streams: 4_096,
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
            max_connection_age: None,
            max_connection_age_grace: Duration::from_secs(30),
            tls: None,
        }
    }
}

impl Server {
    /// The services every lane serves, on one store, config and over-limit
    /// cache; `holds` keeps the `Hold` streams' leases.
    fn services(&self, holds: &Arc<Holds>) -> (RateLimiter, Concurrency, Budget) {
        let concurrency = Concurrency::new(
            self.config.clone(),
            self.store.main().clone(),
            self.limiter.key_prefix.clone(),
            self.limiter.values,
            holds.clone(),
        );
        let limiter = RateLimiter::new(
            self.config.clone(),
            self.store.clone(),
            self.limiter.clone(),
        );
        let local_cache = self.limiter.over_cache_bytes.is_some_and(|bytes| bytes > 0);
        crate::read_stats::register(&self.store, limiter.over_caches(), local_cache);
        // The same over-limit cache: a settle's give-back clears its keys.
        let budget = Budget::new(
            self.config.clone(),
            self.store.clone(),
            self.limiter.clone(),
            limiter.over_cache(),
        );
        (limiter, concurrency, budget)
    }

    /// Serves until `shutdown` resolves, then drains in-flight calls.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let addr = self.grpc.describe().map_err(|source| Error::Io {
            context: "gRPC listener".into(),
            source,
        })?;
        let holds = Holds::new(self.store.main().clone());
        let refresher = tokio::spawn(holds.clone().refresh_forever());
        let (limiter, concurrency, budget) = self.services(&holds);
        let admin_api = self.admin_api();
        let watcher = self.spawn_watcher();

        let (stop, stopping) = tokio::sync::watch::channel(false);
        let (reporter, health) = crate::health::health_reporter(stopping.clone());
        let readiness = not_ready_yet(reporter).await;

        let lanes = Lanes::start(self.lanes)?;
        let per_second = self.store.iter().nth(1).map(|(_, store)| store.kind());
        tracing::info!(%addr, store = self.store.main().kind(), per_second, lanes = lanes.len(), "serving gRPC");
        let limits = &self.limits;
        let builder = grpc_builder(limits);
        let mut http_servers = spawn_http(
            self.http,
            &limiter,
            &readiness,
            &self.config,
            admin_api,
            limits.handshake_timeout,
            &stopping,
        );
        let services = LaneServices {
            limiter: &limiter,
            concurrency: &concurrency,
            budget: &budget,
            health,
        };
        let (dealt, mut serving) = serve_on_lanes(&lanes, builder, services, limits, &stopping)?;
        let mut probe = tokio::spawn(probe_store(
            self.store.clone(),
            lanes.handles().to_vec(),
            readiness.clone(),
            self.health_needs_store,
            self.health_needs_domains.then(|| self.config.clone()),
        ));
        let dealer = tokio::spawn(deal(self.grpc, dealt));

        let asked = async {
            shutdown.await;
            // Not ready from now on, as theirs on SIGTERM: probers that
            // still reach this replica (a health Watch) stop sending.
            // (Awaited: a probe running on another thread could still be
            // setting the statuses to SERVING.)
            probe.abort();
            let _ = (&mut probe).await;
            readiness.set(false).await;
            // Hold streams never end on their own: end them, or the drain
            // would always last the whole grace.
            holds.close();
            dealer.abort();
            let _ = stop.send(true);
        };
        let drained = async {
            let served = join_all(serving.iter_mut()).await;
            // The HTTP servers stop with gRPC (also after a lane failed) and
            // finish their requests in flight within the same grace.
            let _ = stop.send(true);
            join_all(http_servers.iter_mut()).await;
            served
        };
        let grace = self.shutdown_grace;
        let served = tokio::select! {
            served = drained => Some(served),
            () = async { asked.await; tokio::time::sleep(grace).await } => None,
        };
        let served = served.unwrap_or_else(|| {
            tracing::warn!(
                ?grace,
                "connections still open after the shutdown grace; closing them"
            );
            serving.iter().for_each(JoinHandle::abort);
            http_servers.iter().for_each(JoinHandle::abort);
            Vec::new()
        });
        probe.abort();
        refresher.abort();
        // Streams still open when the grace ran out: give their leases back.
        holds.release_all().await;
        if let Some(watcher) = watcher {
            watcher.abort();
        }
        tracing::info!("gRPC server stopped");
        for lane in served {
            lane.map_err(|e| Error::Startup(format!("gRPC serving thread: {e}")))?
                .map_err(|e| Error::Startup(format!("gRPC server: {e}")))?;
        }
        Ok(())
    }

    /// What the admin API needs beside the limiter: its view of leases, and
    /// what its `/v1/config` says the limits come from.
    fn admin_api(&self) -> (AdminLeases, String) {
        let leases = AdminLeases {
            config: self.config.clone(),
            store: self.store.main().clone(),
            key_prefix: self.limiter.key_prefix.clone(),
            values: self.limiter.values,
        };
        let source = match &self.config_dir {
            Some(watched) => watched.dir.to_string(),
            None => "xds".to_owned(),
        };
        (leases, source)
    }

    /// Watches the limits directory, when limits come from one.
    fn spawn_watcher(&self) -> Option<JoinHandle<()>> {
        let watched = self.config_dir.clone()?;
        Some(tokio::spawn(watch::watch(
            (watched, self.load_options),
            self.config.clone(),
            self.reload_interval,
        )))
    }
}

/// The services every lane serves its own copy of.
struct LaneServices<'a, H> {
    limiter: &'a RateLimiter,
    concurrency: &'a Concurrency,
    budget: &'a Budget,
    health: HealthServer<H>,
}

type LaneServing = JoinHandle<std::result::Result<(), tonic::transport::Error>>;

/// The gRPC server builder, with the answer to requests that are not gRPC
/// and the caps on descriptors and lease ids before decoding.
type GrpcServer = tonic::transport::Server<
    tower_layer::Stack<RepeatedCapLayer, tower_layer::Stack<GrpcOnlyLayer, tower_layer::Identity>>,
>;

/// Starts gRPC on every lane: each serves its own copy of the services,
/// bound to its own Redis connections (see `lanes`), on the connections
/// dealt to it through the returned senders.
fn serve_on_lanes<H: Health>(
    lanes: &Lanes,
    builder: GrpcServer,
    services: LaneServices<'_, H>,
    limits: &ConnectionLimits,
    stopping: &tokio::sync::watch::Receiver<bool>,
) -> Result<(Vec<mpsc::Sender<Dealt>>, Vec<LaneServing>)> {
    // grpcurl 1.8 asks for v1alpha, newer clients for v1: offer both.
    let reflection_v1 = reflection()
        .build_v1()
        .map_err(|e| Error::Startup(format!("reflection: {e}")))?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| Error::Startup(format!("reflection: {e}")))?;
    let mut dealt = Vec::new();
    let mut serving = Vec::new();
    for (index, lane) in lanes.handles().iter().enumerate() {
        let (deal_to, connections) = mpsc::channel(64);
        dealt.push(deal_to);
        let rls = RateLimitServiceServer::new(services.limiter.for_lane(index))
            .max_decoding_message_size(caps::MAX_MESSAGE_BYTES);
        let concurrency = ConcurrencyServiceServer::new(services.concurrency.for_lane(index))
            .max_decoding_message_size(caps::MAX_MESSAGE_BYTES);
        let budget = BudgetServiceServer::new(services.budget.for_lane(index))
            .max_decoding_message_size(caps::MAX_MESSAGE_BYTES);
        // Each lane its own age, ±10% as grpc-go's: connections opened
        // together but dealt to different lanes move at different times.
        let age = limits
            .max_connection_age
            .map(|age| jittered(age, crate::random::unit()));
        let mut lane_builder = match age {
            Some(age) => builder.clone().max_connection_age(age),
            None => builder.clone(),
        };
        // The grace's end is ours to enforce (see `grpc_builder`); an
        // endless grace (`Duration::MAX`) never closes the connection.
        let lifetime = age.and_then(|age| age.checked_add(limits.max_connection_age_grace));
        let router = lane_builder
            .add_service(services.health.clone())
            .add_service(reflection_v1.clone())
            .add_service(reflection_v1alpha.clone())
            .add_service(rls)
            .add_service(concurrency)
            .add_service(budget);
        let stopping = stopped(stopping.clone());
        let (handshake_timeout, tls) = (limits.handshake_timeout, limits.tls.clone());
        serving.push(lane.spawn(async move {
            router
                .serve_with_incoming_shutdown(
                    incoming(connections, handshake_timeout, lifetime, tls),
                    stopping,
                )
                .await
        }));
    }
    Ok((dealt, serving))
}

/// The gRPC server's settings for every lane's connections. The maximum age
/// is each lane's (`serve_on_lanes`), and only the age goes to tonic, which
/// then sends the GOAWAY at that age: given `max_connection_age_grace` as
/// well, tonic 0.14 sends no GOAWAY at all and drops the connection at age
/// + grace. That drop is `incoming`'s instead.
fn grpc_builder(limits: &ConnectionLimits) -> GrpcServer {
    tonic::transport::Server::builder()
        .layer(GrpcOnlyLayer)
        .layer(RepeatedCapLayer)
        .concurrency_limit_per_connection(limits.concurrency_per_connection)
        .max_concurrent_streams(limits.max_streams)
        .http2_keepalive_interval(Some(limits.keepalive_interval))
        .http2_keepalive_timeout(Some(limits.keepalive_timeout))
        .tcp_keepalive(Some(Duration::from_secs(60)))
}

/// `age` within ±10% of itself, as grpc-go jitters its maximum connection
/// age; `random` is in [0, 1).
fn jittered(age: Duration, random: f64) -> Duration {
    Duration::try_from_secs_f64(age.as_secs_f64() * (0.9 + 0.2 * random)).unwrap_or(age)
}

/// Resolves once the server is asked to stop.
async fn stopped(mut stopping: tokio::sync::watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

/// Starts the HTTP listeners that are configured: `/healthcheck` and
/// `/json`, the debug listener, and the admin API (`admin_api`: its lease
/// view and what the limits come from), each stopping with gRPC.
fn spawn_http(
    listeners: http::Listeners,
    limiter: &RateLimiter,
    readiness: &Readiness,
    config: &SharedConfig,
    admin_api: (AdminLeases, String),
    idle: Duration,
    stopping: &tokio::sync::watch::Receiver<bool>,
) -> Vec<JoinHandle<()>> {
    let mut servers = Vec::new();
    if let Some(listener) = listeners.api {
        let router = http::api::router(limiter.clone(), readiness.clone());
        servers.push(tokio::spawn(http::serve(
            listener,
            idle,
            router,
            stopped(stopping.clone()),
        )));
    }
    if let Some(listener) = listeners.debug {
        let router = http::debug_router(config.clone());
        servers.push(tokio::spawn(http::serve(
            listener,
            idle,
            router,
            stopped(stopping.clone()),
        )));
    }
    if let Some(admin) = listeners.admin {
        let (leases, config_source) = admin_api;
        let router = http::admin::router(
            limiter.clone(),
            leases,
            config.clone(),
            config_source,
            admin.token_file,
        );
        let stopping = stopped(stopping.clone());
        servers.push(match admin.tls {
            Some(tls) => tokio::spawn(http::tls_listener::serve_tls(
                admin.listener,
                idle,
                tls,
                router,
                stopping,
            )),
            None => tokio::spawn(http::serve(admin.listener, idle, router, stopping)),
        });
    }
    servers
}

fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ENVOY_RLS_DESCRIPTOR)
        .register_encoded_file_descriptor_set(crate::pb::RATEKEEPER_DESCRIPTOR)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

/// Readiness as it must stand before any connection is dealt: alive, not
/// ready (tonic-health starts the server, service "", SERVING, which a
/// prober must not see before the store is warmed up).
async fn not_ready_yet(reporter: tonic_health::server::HealthReporter) -> Readiness {
    let readiness = Readiness::new(reporter);
    readiness
        .reporter()
        .set_service_status(LIVENESS_SERVICE, ServingStatus::Serving)
        .await;
    readiness.set(false).await;
    readiness
}

/// Keeps readiness ([`Readiness`]: gRPC health, HTTP `/healthcheck`) in
/// step with the stores: ready once every store has answered. After that it
/// stays ready through an outage, whatever the failure mode, as
/// envoyproxy/ratelimit does (a probe must not pull every replica at once,
/// and Envoy Gateway probes liveness on the same `/healthcheck`;
/// `ratekeeper_store_up{store}` and the logs show the outage), unless
/// `needs_store`: then not ready while a store is unreachable. With
/// `needs_domains`, it is also not ready while that config has no domain.
async fn probe_store(
    stores: Stores,
    lanes: Vec<Handle>,
    readiness: Readiness,
    needs_store: bool,
    needs_domains: Option<SharedConfig>,
) {
    // Not ready until the stores answer (set so before serving began).
    let mut shown = false;
    let count = stores.iter().count();
    let (mut ever_up, mut was_up) = (vec![false; count], vec![None; count]);
    loop {
        let (mut all_up, mut all_ever_up) = (true, true);
        for (i, (role, store)) in stores.iter().enumerate() {
            let up = probe_once(store, &lanes, ever_up[i], role).await;
            ever_up[i] |= up;
            let value = if up { 1.0 } else { 0.0 };
            metrics::gauge!("ratekeeper_store_up", "store" => role.name()).set(value);
            if was_up[i].is_some_and(|was| was != up) {
                tracing::info!(up, store = role.name(), "store reachability changed");
            }
            was_up[i] = Some(up);
            all_up &= up;
            all_ever_up &= ever_up[i];
        }
        let has_domains = needs_domains
            .as_ref()
            .map_or(true, |config| !config.current().is_empty());
        let ready = (all_up || (all_ever_up && !needs_store)) && has_domains;
        if ready != shown {
            readiness.set(ready).await;
            shown = ready;
        }
        // Every 5 s while all is well; every second when readiness hangs on
        // the store (their REDIS_HEALTH_CHECK_ACTIVE_CONNECTION fails health
        // as soon as the connections close); at once when the limits change.
        let pause = match (all_up && ready, needs_store) {
            (true, false) => 5_000,
            (true, true) => 1_000,
            (false, _) => 500,
        };
        let config_changed = async {
            match &needs_domains {
                Some(config) => config.changed().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(pause)) => {}
            () = config_changed => {}
        }
    }
}

/// Whether `store` answers on every lane's connections. Until it has
/// answered once (`ever_up`), it is warmed up instead of pinged: readiness
/// then means every connection is open and scripts loaded.
async fn probe_once(store: &Store, lanes: &[Handle], ever_up: bool, role: Role) -> bool {
    let probe = on_every_lane(store, lanes, !ever_up).await;
    match probe {
        Ok(()) => true,
        Err(error) => {
            // Paced per store (an outage's connection lines are paced
            // for the process, all lanes and stores together).
            static LOG: [Paced; 2] = [Paced::every(OUTAGE_PERIOD_S), Paced::every(OUTAGE_PERIOD_S)];
            if let Some(left_out) = LOG[role.index()].admit() {
                tracing::warn!(%error, store = role.name(), left_out, "store health probe failed");
            }
            false
        }
    }
}

/// Warms the store up (`warm`) or pings it on every lane, on that lane's
/// thread: each lane has its own Redis connections, a connection's reader
/// runs where it was opened, and a lane's connections left idle while
/// another's serve would be closed by an idle timeout unseen.
async fn on_every_lane(store: &Store, lanes: &[Handle], warm: bool) -> Result<()> {
    // The in-memory store is ready as it is: no need to wait for the lanes.
    if let Store::Memory(_) = store {
        return Ok(());
    }
    let probing = lanes.iter().enumerate().map(|(index, lane)| {
        let store = store.for_lane(index);
        lane.spawn(async move {
            match warm {
                true => store.warm_up().await,
                false => store.ping().await,
            }
        })
    });
    // A lane whose thread is stuck must not stop the probe loop (and with
    // it readiness and the config's domains check).
    let probed = tokio::time::timeout(LANE_PROBE_LIMIT, join_all(probing))
        .await
        .map_err(|_| Error::Store("a serving thread did not answer the store probe".into()))?;
    for probed in probed {
        probed.map_err(|e| Error::Store(format!("store probe stopped: {e}")))??;
    }
    Ok(())
}

/// How long [`on_every_lane`] waits for the lanes: the warm-up's steps,
/// each under the probe timeout, and then some.
const LANE_PROBE_LIMIT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::jittered;
    use std::time::Duration;

    #[test]
    fn ages_are_jittered_within_ten_percent() {
        let day = Duration::from_secs(86_400);
        assert_eq!(jittered(day, 0.0), Duration::from_secs(77_760));
        assert_eq!(jittered(day, 0.5), day);
        assert!(jittered(day, 0.999_999) < Duration::from_secs(95_041));
        assert_eq!(jittered(Duration::MAX, 0.9), Duration::MAX, "no overflow");
    }
}
