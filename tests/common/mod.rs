//! Test harness: real `redis-server` processes on free loopback ports, the
//! ratekeeper server in-process on port 0, and gRPC clients.
#![allow(dead_code)]

pub mod certs;

use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use ratekeeper::clock::{Clock, ManualClock};
use ratekeeper::config::watch::SharedConfig;
use ratekeeper::config::Config;
use ratekeeper::headers::{HeaderNames, HeaderSettings};
use ratekeeper::server::{ConnectionLimits, Server};
use ratekeeper::service::rls::LimiterSettings;
use ratekeeper::store::{MemoryStore, RedisSettings, RedisStore, Store, Topology};
use tokio::sync::oneshot;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};

/// The Envoy rate limit client.
pub type RlsClient = RateLimitServiceClient<Channel>;

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port")
}

/// A free port whose cluster bus port (port + 10000, where a cluster node
/// also listens) is free too: a node whose bus port is taken exits at start.
pub fn free_cluster_port() -> u16 {
    loop {
        let port = free_port();
        let bus_free = port
            .checked_add(10_000)
            .is_some_and(|bus| StdListener::bind(("127.0.0.1", bus)).is_ok());
        if bus_free {
            return port;
        }
    }
}

/// A `redis-server` child process, stopped by PID when dropped.
pub struct RedisServer {
    child: Child,
    pub port: u16,
    /// Its working directory: a replica's synced RDB goes there, not into
    /// the repository, and not where another test's replica renames its own.
    _dir: tempfile::TempDir,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        RedisServer::spawn_free(&[])
    }

    fn start_on(port: u16) -> RedisServer {
        RedisServer::spawn(port, &[])
    }

    /// Starts `redis-server` with extra arguments on a free port, and waits
    /// until it answers. A port found free can be taken before the server
    /// binds it (by a parallel test, or as an outgoing connection's
    /// ephemeral port): then the server exits, and another port is tried.
    pub fn spawn_free(extra: &[&str]) -> RedisServer {
        RedisServer::spawn_retrying(free_port, |_| extra.iter().map(|a| a.to_string()).collect())
    }

    /// Starts `redis-server` on a port `pick` chooses, with the arguments
    /// `extra` gives for that port, trying other ports while the server
    /// exits at start (see [`Self::spawn_free`]).
    pub fn spawn_retrying(
        mut pick: impl FnMut() -> u16,
        extra: impl Fn(u16) -> Vec<String>,
    ) -> RedisServer {
        on_another_port_if_taken("redis-server", || {
            let port = pick();
            let args = extra(port);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            RedisServer::try_spawn(port, &args)
        })
    }

    /// Starts `redis-server` on `port` with extra arguments, and waits until
    /// it answers.
    pub fn spawn(port: u16, extra: &[&str]) -> RedisServer {
        RedisServer::try_spawn(port, extra)
            .unwrap_or_else(|| panic!("redis-server on port {port} exited at start"))
    }

    /// [`Self::spawn`], or `None` when the server exits before it answers
    /// (its port was taken).
    pub fn try_spawn(port: u16, extra: &[&str]) -> Option<RedisServer> {
        let dir = tempfile::tempdir().expect("tempdir");
        let child = Command::new("redis-server")
            .args([
                "--dir",
                &dir.path().display().to_string(),
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (make test installs it)");
        let mut server = RedisServer {
            child,
            port,
            _dir: dir,
        };
        wait_ready(&mut server.child, port).then_some(server)
    }

    /// Stops the server without a word (SIGSTOP), as [`Sentinel::pause`];
    /// dropping it still kills it.
    pub fn pause(&self) {
        pause(&self.child);
    }

    /// Stops the server with SIGKILL.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops the server and starts a fresh, empty one on the same port.
    pub fn restart(&mut self) {
        self.kill();
        *self = RedisServer::start_on(self.port);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).expect("redis url")
    }

    /// A Redis store on this server; `clock` pins the scripts' time.
    pub fn store(&self, clock: Option<Arc<dyn Clock>>) -> Store {
        self.store_with(clock, true)
    }

    /// A Redis store on this server, calling the limiter as a function
    /// where Redis has them (`functions`) or always as a script.
    pub fn store_with(&self, clock: Option<Arc<dyn Clock>>, functions: bool) -> Store {
        Store::Redis(Arc::new(
            RedisStore::new(&self.settings(functions), clock).expect("redis store"),
        ))
    }

    /// The settings of [`Self::store_with`].
    pub fn settings(&self, functions: bool) -> RedisSettings {
        RedisSettings {
            topology: Topology::Single,
            url: self.url(),
            store: "main",
            auth: None,
            tls: None,
            connections: 2,
            // Two lanes, as on a two-core server: requests from the test
            // server's two serving threads use two sets of connections.
            lanes: 2,
            connect_timeout: Duration::from_secs(2),
            call_timeout: Duration::from_secs(2),
            functions,
            expiry_jitter: Duration::ZERO,
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `start`'s server, started again (on another free port) while it exits
/// at start: a port found free can be taken before the server binds it.
fn on_another_port_if_taken<T>(what: &str, mut start: impl FnMut() -> Option<T>) -> T {
    const TRIES: usize = 5;
    for _ in 0..TRIES {
        if let Some(server) = start() {
            return server;
        }
    }
    panic!("{what} exited at start on {TRIES} ports in a row");
}

/// Waits until `child` answers on `port` (NOAUTH counts: it answers);
/// false if it exited first. The answer must name the child's PID: another
/// test's server that took the port answers too.
fn wait_ready(child: &mut Child, port: u16) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("redis url");
    loop {
        // Bounded: what holds the port may accept and never answer.
        let answer = client
            .get_connection_with_timeout(Duration::from_millis(500))
            .and_then(|mut c| {
                c.set_read_timeout(Some(Duration::from_millis(500)))?;
                redis::cmd("INFO").arg("server").query::<String>(&mut c)
            });
        let exited = matches!(child.try_wait(), Ok(Some(_)));
        match answer {
            Ok(info) => return info.contains(&format!("process_id:{}\r\n", child.id())),
            Err(e)
                if e.to_string().contains("NOAUTH")
                    || e.kind() == redis::ErrorKind::AuthenticationFailed =>
            {
                return !exited
            }
            Err(_) if exited => return false,
            Err(_) => {}
        }
        assert!(
            Instant::now() < deadline,
            "redis-server on port {port} did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Loads the limiter's function library (`LimiterScript::library`, with
/// its budget function) into the Redis of `conn`; returns its name, the
/// limiter function's, which `<name>_budget` follows.
pub fn load_limiter_library(conn: &mut redis::Connection) -> String {
    redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(ratekeeper::store::limiter_script::LimiterScript::new(true).library())
        .query(conn)
        .expect("FUNCTION LOAD")
}

/// How many times Redis ran `command` (lower case) since its stats were
/// reset, scripts' own calls included (`INFO commandstats`).
pub fn command_calls(conn: &mut redis::Connection, command: &str) -> u64 {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(conn)
        .expect("INFO commandstats");
    let prefix = format!("cmdstat_{command}:calls=");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Limiter calls Redis ran: `FCALL`s, plus `EVALSHA`s where it runs the
/// limiter as a script.
pub fn limiter_calls(conn: &mut redis::Connection) -> u64 {
    command_calls(conn, "fcall") + command_calls(conn, "evalsha")
}

/// Limiter calls that carried checks (at least one key), counted from
/// Redis's slow log, which this first call sets to log every command: the
/// health probe's own limiter call (no keys) is not counted. Compare two
/// readings; the first is where counting starts.
pub fn keyed_limiter_calls(conn: &mut redis::Connection) -> u64 {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(0)
        .arg("slowlog-max-len")
        .arg(100_000)
        .query(conn)
        .expect("CONFIG SET slowlog");
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query(conn)
        .expect("SLOWLOG GET");
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(bytes) => String::from_utf8_lossy(bytes).to_lowercase(),
        _ => String::new(),
    };
    entries
        .iter()
        .filter(|entry| {
            let redis::Value::Array(fields) = entry else {
                return false;
            };
            let Some(redis::Value::Array(args)) = fields.get(3) else {
                return false;
            };
            let command = args.first().map(text).unwrap_or_default();
            let keys = args.get(2).map(text).unwrap_or_default();
            (command == "fcall" || command == "evalsha") && keys != "0"
        })
        .count() as u64
}

/// `PROPTEST_CASES` (as `make fuzz` sets it), else `default`.
pub fn proptest_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
}

/// The stores under test, for tables run against each.
pub enum Backend {
    Memory,
    Redis(RedisServer),
    Cluster(RedisCluster),
}

impl Backend {
    /// The in-memory store and a standalone Redis.
    pub fn all() -> Vec<Backend> {
        vec![Backend::Memory, Backend::Redis(RedisServer::start())]
    }

    /// Also a 3-master Redis Cluster.
    pub fn all_with_cluster() -> Vec<Backend> {
        let mut all = Backend::all();
        all.push(Backend::Cluster(RedisCluster::start(3, 0)));
        all
    }

    pub fn name(&self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Redis(_) => "redis",
            Backend::Cluster(_) => "cluster",
        }
    }

    pub fn store(&self, clock: Arc<dyn Clock>) -> Store {
        match self {
            Backend::Memory => Store::Memory(MemoryStore::new(clock)),
            Backend::Redis(redis) => redis.store(Some(clock)),
            Backend::Cluster(cluster) => cluster.store(Some(clock)),
        }
    }
}

/// A ratekeeper server running in this process.
pub struct TestServer {
    pub addr: SocketAddr,
    /// The HTTP listener (`/healthcheck`, `/json`).
    pub http: SocketAddr,
    /// The debug HTTP listener (`/rlconfig`).
    pub debug: SocketAddr,
    /// The admin API (no token: loopback).
    pub admin: SocketAddr,
    pub config: SharedConfig,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<ratekeeper::Result<()>>>,
}

impl TestServer {
    pub async fn start(config_yaml: &[&str], store: Store) -> TestServer {
        let files: Vec<(PathBuf, &str)> = config_yaml
            .iter()
            .enumerate()
            .map(|(i, text)| (PathBuf::from(format!("test{i}.yaml")), *text))
            .collect();
        let config =
            Config::from_files(files.iter().map(|(p, t)| (p.as_path(), *t))).expect("test config");
        Self::start_with(config, None, store).await
    }

    pub async fn start_with(
        config: Config,
        config_dir: Option<PathBuf>,
        store: Store,
    ) -> TestServer {
        Self::start_with_limiter(config, config_dir, store, Self::limiter_settings()).await
    }

    /// The limiter settings of [`TestServer::start`]: the default key prefix
    /// and the `RateLimit-*` headers on.
    pub fn limiter_settings() -> LimiterSettings {
        LimiterSettings {
            key_prefix: ratekeeper::keys::DEFAULT_PREFIX.into(),
            headers: HeaderSettings {
                enabled: true,
                names: HeaderNames::default(),
            },
            ..LimiterSettings::default()
        }
    }

    pub async fn start_with_limiter(
        config: Config,
        config_dir: Option<PathBuf>,
        store: impl Into<ratekeeper::store::Stores>,
        limiter: LimiterSettings,
    ) -> TestServer {
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = grpc.local_addr().expect("addr");
        let http = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let debug = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let admin = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let (http_addr, debug_addr, admin_addr) = (
            http.local_addr().expect("addr"),
            debug.local_addr().expect("addr"),
            admin.local_addr().expect("addr"),
        );
        let config = SharedConfig::new(config);
        let (tx, rx) = oneshot::channel();
        let server = Server {
            grpc: grpc.into(),
            config_dir: config_dir.map(|dir| ratekeeper::config::watch::Watched {
                dir: ratekeeper::config::LimitsDir::Flat(dir),
                loaded: None,
            }),
            load_options: Default::default(),
            config: config.clone(),
            health_needs_domains: false,
            health_needs_store: false,
            store: store.into(),
            limiter,
            reload_interval: Duration::from_millis(50),
            shutdown_grace: Duration::from_secs(5),
            limits: ConnectionLimits {
                handshake_timeout: Duration::from_millis(500),
                ..ConnectionLimits::default()
            },
            lanes: 2,
            http: ratekeeper::http::Listeners {
                api: Some(http),
                debug: Some(debug),
                admin: Some(ratekeeper::http::admin::AdminListener {
                    listener: admin,
                    token_file: None,
                    tls: None,
                }),
            },
        };
        let task = tokio::spawn(server.run(async {
            let _ = rx.await;
        }));
        TestServer {
            addr,
            http: http_addr,
            debug: debug_addr,
            admin: admin_addr,
            config,
            shutdown: Some(tx),
            task: Some(task),
        }
    }

    /// A gRPC channel to the server, for the services' other clients.
    pub async fn channel(&self) -> Channel {
        tonic::transport::Endpoint::from_shared(format!("http://{}", self.addr))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect")
    }

    pub async fn client(&self) -> RateLimitServiceClient<Channel> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match RateLimitServiceClient::connect(format!("http://{}", self.addr)).await {
                Ok(client) => return client,
                Err(e) if Instant::now() > deadline => panic!("cannot connect: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// Waits until the server's health says SERVING (the store warmed up).
    pub async fn serving(&self) {
        let channel = Channel::from_shared(format!("http://{}", self.addr))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect");
        until_serving(&mut HealthClient::new(channel)).await;
    }

    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.expect("server task").expect("server result");
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// Waits until `health` says the server as a whole (service `""`) is
/// SERVING; fails after 10 s.
pub async fn until_serving(health: &mut HealthClient<Channel>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = health
            .check(HealthCheckRequest::default())
            .await
            .expect("health")
            .into_inner()
            .status;
        if status == ServingStatus::Serving as i32 {
            return;
        }
        assert!(Instant::now() < deadline, "not SERVING after 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A descriptor from `(key, value)` pairs.
pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..Default::default()
    }
}

/// A request for `domain` with the given descriptors.
pub fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

/// Runs `body` once per store (memory, then a real Redis), each with a fresh
/// in-process server on `limits` and a clock pinned at `start_ms`.
pub async fn on_every_store<F, Fut>(limits: &[&str], start_ms: u64, body: F)
where
    F: Fn(TestServer, Arc<ManualClock>, &'static str) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for backend in Backend::all() {
        let clock = Arc::new(ManualClock::new(start_ms));
        let server = TestServer::start(limits, backend.store(clock.clone())).await;
        body(server, clock, backend.name()).await;
    }
}

/// A Redis Cluster of real `redis-server` processes (masters, each with
/// `replicas` replicas), stopped by PID when dropped.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    _dir: tempfile::TempDir,
}

impl RedisCluster {
    pub fn start(masters: usize, replicas: usize) -> RedisCluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let node_args = |port: u16| {
            vec![
                "--cluster-enabled".to_string(),
                "yes".to_string(),
                "--cluster-config-file".to_string(),
                format!("nodes-{port}.conf"),
                "--cluster-node-timeout".to_string(),
                "1000".to_string(),
                "--dir".to_string(),
                dir.path().display().to_string(),
            ]
        };
        let nodes: Vec<RedisServer> = (0..masters * (1 + replicas))
            .map(|_| RedisServer::spawn_retrying(free_cluster_port, node_args))
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let status = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli must be installed (make test installs it)");
        assert!(status.success(), "redis-cli --cluster create failed");
        let cluster = RedisCluster { nodes, _dir: dir };
        cluster.wait_ok();
        cluster
    }

    /// Waits until every node reports `cluster_state:ok` and every replica
    /// has synced with its master (a replica that has not cannot take over).
    pub fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let query = |node: &RedisServer, cmd: &str, arg: &str| -> String {
            node.client()
                .get_connection()
                .and_then(|mut c| redis::cmd(cmd).arg(arg).query(&mut c))
                .unwrap_or_default()
        };
        for node in &self.nodes {
            loop {
                let state = query(node, "CLUSTER", "INFO");
                let replication = query(node, "INFO", "replication");
                let synced = replication.contains("role:master")
                    || replication.contains("master_link_status:up");
                if state.contains("cluster_state:ok") && synced {
                    break;
                }
                assert!(Instant::now() < deadline, "cluster never became ok");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// The seed list ratekeeper takes: `host:port,host:port,...`.
    pub fn seeds(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn store(&self, clock: Option<Arc<dyn Clock>>) -> Store {
        let settings = RedisSettings {
            topology: Topology::Cluster,
            url: self.seeds(),
            store: "main",
            auth: None,
            tls: None,
            connections: 1,
            lanes: 2,
            connect_timeout: Duration::from_secs(2),
            call_timeout: Duration::from_secs(2),
            functions: true,
            expiry_jitter: Duration::ZERO,
        };
        Store::Redis(Arc::new(
            RedisStore::new(&settings, clock).expect("cluster store"),
        ))
    }
}

/// A `ratekeeper` process started from the test binary's build, stopped
/// (SIGKILL) by PID when dropped. Its stderr goes to `log` for inspection.
pub struct Ratekeeper {
    child: Child,
    pub grpc: String,
    pub metrics: String,
    /// The HTTP and debug HTTP listeners (`off` when off).
    pub http: String,
    /// The admin API's address (`off` when off).
    pub admin: String,
    pub debug: String,
    pub log: PathBuf,
}

impl Ratekeeper {
    /// Writes `limits_yaml` into `dir/limits/` and serves that directory.
    pub fn start(limits_yaml: &str, dir: &std::path::Path, args: &[&str]) -> Ratekeeper {
        let limits = dir.join("limits");
        std::fs::create_dir_all(&limits).expect("limits dir");
        std::fs::write(limits.join("limits.yaml"), limits_yaml).expect("limits file");
        Ratekeeper::spawn(&limits, args)
    }

    /// Serves `config_dir` on ports it picks itself, with extra `args`.
    pub fn spawn(config_dir: &std::path::Path, args: &[&str]) -> Ratekeeper {
        Ratekeeper::spawn_with_env(config_dir, args, &[])
    }

    /// As [`Ratekeeper::spawn`], with environment variables set.
    pub fn spawn_with_env(
        config_dir: &std::path::Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Ratekeeper {
        Ratekeeper::spawn_command(config_dir, args, env, |_| {})
    }

    /// As [`Ratekeeper::spawn_with_env`], with `setup` applied to the
    /// command last (e.g. resource limits).
    pub fn spawn_command(
        config_dir: &std::path::Path,
        args: &[&str],
        env: &[(&str, &str)],
        setup: impl FnOnce(&mut Command),
    ) -> Ratekeeper {
        let dir = config_dir.display().to_string();
        let args: Vec<&str> = ["--config-dir", dir.as_str()]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        // Not a .yaml file: the limits loader skips it.
        Ratekeeper::launch(config_dir, &args, env, setup)
    }

    /// Starts the binary with only `args` and `env` (no limits directory
    /// given), its log in `log_dir`.
    pub fn spawn_in(log_dir: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Ratekeeper {
        Ratekeeper::launch(log_dir, args, env, |_| {})
    }

    fn launch(
        log_dir: &std::path::Path,
        args: &[&str],
        env: &[(&str, &str)],
        setup: impl FnOnce(&mut Command),
    ) -> Ratekeeper {
        let log = log_dir.join(format!("ratekeeper-{}.log", free_port()));
        let mut command = Command::new(env!("CARGO_BIN_EXE_ratekeeper"));
        command
            .args([
                "--grpc-addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "127.0.0.1:0",
                "--http-addr",
                "127.0.0.1:0",
                "--debug-addr",
                "127.0.0.1:0",
            ])
            .args(args)
            .env_remove("REDIS_URL")
            // Not the default shared port; a test's own `--admin-addr` wins.
            .env("ADMIN_ADDR", "127.0.0.1:0")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("log file"));
        setup(&mut command);
        let mut child = command.spawn().expect("spawn ratekeeper");
        let line = readiness_line(&mut child);
        // With LOG_FORMAT=json, a JSON log line.
        let json: Option<serde_json::Value> = serde_json::from_str(&line).ok();
        let field = |name: &str| match &json {
            Some(json) => json[name]
                .as_str()
                .unwrap_or_else(|| panic!("no {name} in {line:?}"))
                .to_owned(),
            None => line
                .split_whitespace()
                .find_map(|f| f.strip_prefix(&format!("{name}=")))
                .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
                .to_owned(),
        };
        Ratekeeper {
            grpc: field("grpc"),
            metrics: field("metrics"),
            http: field("http"),
            debug: field("debug"),
            admin: field("admin"),
            child,
            log,
        }
    }

    pub async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connect")
    }

    /// A channel to the gRPC port, for other services' clients.
    pub async fn channel(&self) -> Channel {
        tonic::transport::Endpoint::from_shared(format!("http://{}", self.grpc))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect")
    }

    /// The body of `GET /metrics`, with the status line.
    pub fn metrics(&self) -> String {
        http_exchange(&self.metrics, "GET", "/metrics", "")
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM and returns the exit status.
    pub fn terminate(self) -> std::process::ExitStatus {
        self.stop_with("TERM")
    }

    /// Sends the signal named `signal` (`TERM`, `HUP`, ...) and waits for
    /// the exit.
    pub fn stop_with(mut self, signal: &str) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .expect("kill");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "no exit within 10 s of SIG{signal}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the process with SIGKILL (no goodbye to anyone).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Ratekeeper {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One HTTP/1.1 request to `addr` on a connection of its own; the whole
/// response (status line, headers, body) as text.
pub fn http_exchange(addr: &str, method: &str, path: &str, body: &str) -> String {
    try_http_exchange(addr, method, path, body)
        .unwrap_or_else(|e| panic!("{method} {path} on {addr}: {e}"))
}

/// Runs `command`, a start expected to be refused, to its end: it exits
/// with 1, and its stderr is returned as [`fatal_message`] reads it.
pub fn refused_start_of(command: &mut Command) -> String {
    let out = command.output().expect("run ratekeeper");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    fatal_message(&String::from_utf8_lossy(&out.stderr))
}

/// A refused start's stderr as a person reads it: its logfmt `level=fatal`
/// line (Go's `%q` quoting) replaced by the message itself.
pub fn fatal_message(stderr: &str) -> String {
    let unquote = |quoted: &str| {
        let mut text = String::new();
        let mut chars = quoted.trim_end().trim_end_matches('"').chars();
        while let Some(c) = chars.next() {
            match (c, c == '\\') {
                (_, true) => match chars.next() {
                    Some('n') => text.push('\n'),
                    Some('t') => text.push('\t'),
                    Some('r') => text.push('\r'),
                    Some('x') => {
                        let hex: String = chars.by_ref().take(2).collect();
                        text.push(char::from(u8::from_str_radix(&hex, 16).unwrap_or(b'?')));
                    }
                    Some(other) => text.push(other),
                    None => {}
                },
                (c, false) => text.push(c),
            }
        }
        text
    };
    stderr
        .lines()
        .map(|line| match line.split_once(" level=fatal msg=\"") {
            Some((_, quoted)) => unquote(quoted),
            None => line.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The readiness line of the binary `command` starts (its stdout piped
/// here, its stderr dropped), stopped once it is read.
pub fn readiness_of(command: &mut Command) -> String {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn ratekeeper");
    let line = readiness_line(&mut child);
    let _ = child.kill();
    let _ = child.wait();
    line
}

/// The first line a started binary prints on its piped stdout, its
/// readiness line (`listening grpc=… http=…`); empty when it exited first.
pub fn readiness_line(child: &mut std::process::Child) -> String {
    use std::io::BufRead;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout piped"))
        .read_line(&mut line)
        .expect("readiness line");
    line
}

/// As [`http_exchange`], failing with the I/O error.
pub fn try_http_exchange(
    addr: &str,
    method: &str,
    path: &str,
    body: &str,
) -> std::io::Result<String> {
    try_http_exchange_with(addr, method, path, &[], body)
}

/// As [`try_http_exchange`], with more request headers.
pub fn try_http_exchange_with(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{extra}content-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}

/// An HTTP answer: its status code and body.
#[derive(Debug)]
pub struct HttpAnswer {
    pub status: u16,
    pub body: String,
}

/// As [`http_exchange`], split into status code and body.
pub fn http_call(addr: &str, method: &str, path: &str, body: &str) -> HttpAnswer {
    let response = http_exchange(addr, method, path, body);
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {response:?}"));
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    HttpAnswer { status, body }
}

/// Stops `child` with SIGSTOP: its connections stay open and it answers
/// nothing, as a paused or partitioned process (SIGKILL still ends it).
fn pause(child: &Child) {
    let status = std::process::Command::new("kill")
        .args(["-STOP", &child.id().to_string()])
        .status()
        .expect("kill -STOP");
    assert!(status.success(), "kill -STOP");
}

/// A `redis-server --sentinel` watching the master at `master_port` (named
/// `mymaster`, quorum 1, down after 500 ms), stopped by PID when dropped.
pub struct Sentinel {
    child: std::process::Child,
    pub port: u16,
}

impl Sentinel {
    pub fn start(master_port: u16, dir: &std::path::Path) -> Sentinel {
        Sentinel::start_with(master_port, dir, "")
    }

    /// As [`Sentinel::start`], with `extra` lines in its configuration
    /// (e.g. `requirepass`).
    pub fn start_with(master_port: u16, dir: &std::path::Path, extra: &str) -> Sentinel {
        let sentinel = on_another_port_if_taken("redis-server --sentinel", || {
            Sentinel::try_start(master_port, dir, extra)
        });
        // Let the sentinel find the master and its replica.
        std::thread::sleep(Duration::from_millis(1_500));
        sentinel
    }

    /// A sentinel on a free port, or `None` when it exits before it
    /// answers (the port was taken: see [`RedisServer::spawn_free`]).
    fn try_start(master_port: u16, dir: &std::path::Path, extra: &str) -> Option<Sentinel> {
        // Written afresh: a sentinel rewrites its configuration file.
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "sentinel monitor mymaster 127.0.0.1 {master_port} 1\nsentinel down-after-milliseconds mymaster 500\nsentinel failover-timeout mymaster 2000\n{extra}"
            ),
        )
        .unwrap();
        let port = free_port();
        let child = std::process::Command::new("redis-server")
            .arg(&conf)
            .args([
                "--sentinel",
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server --sentinel");
        let mut sentinel = Sentinel { child, port };
        wait_ready(&mut sentinel.child, port).then_some(sentinel)
    }
}

impl Sentinel {
    /// Stops the sentinel without a word (SIGSTOP): its connections stay
    /// open and it answers nothing, as a paused or partitioned process.
    pub fn pause(&self) {
        pause(&self.child);
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Throwaway CA, server and client certificates made with the openssl CLI,
/// in `dir`: `ca.crt`, `server.crt`/`.key`, `client.crt`/`.key`, each valid
/// for `san` (`subjectAltName` syntax, e.g. `IP:127.0.0.1,DNS:localhost`).
pub fn make_certs(dir: &std::path::Path, san: &str) {
    let run = |args: &[&str]| {
        let status = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .expect("openssl must be installed");
        assert!(status.success(), "openssl {args:?}");
    };
    std::fs::write(dir.join("ext.cnf"), format!("subjectAltName={san}\n")).unwrap();
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=rk-test-ca",
    ]);
    for name in ["server", "client"] {
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={name}"),
        ]);
        run(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &format!("{name}.crt"),
            "-days",
            "1",
            "-extfile",
            "ext.cnf",
        ]);
    }
}

/// The reservations a test made on a store, by the test's name for each:
/// what their settles name (in the service, the signed reservation id
/// carries it). Each gets a random nonce, as the service gives it, so names
/// may repeat from one store or table to the next.
#[derive(Debug, Default)]
pub struct Ledger(std::sync::Mutex<std::collections::HashMap<String, Reserved>>);

/// A granted reservation as a [`Ledger`] keeps it.
#[derive(Debug, Clone)]
pub struct Reserved {
    pub nonce: String,
    pub checks: Vec<ratekeeper::limiter::Check>,
    pub taken: Vec<ratekeeper::store::Taken>,
    pub ttl_ms: u64,
}

impl Ledger {
    /// Reserves `checks` on `store` as `name`, kept when granted.
    pub async fn reserve(
        &self,
        store: &Store,
        checks: &[ratekeeper::limiter::Check],
        name: &str,
        ttl_ms: u64,
    ) -> ratekeeper::Result<ratekeeper::store::Reserved> {
        let nonce = ratekeeper::service::reservation_id::ReservationId::new_nonce();
        let reserved = store.reserve(checks, &nonce, ttl_ms).await?;
        if reserved.granted {
            let kept = Reserved {
                nonce,
                checks: checks.to_vec(),
                taken: reserved.taken.clone(),
                ttl_ms,
            };
            let mut ledger = self.0.lock().unwrap_or_else(|e| e.into_inner());
            ledger.insert(name.to_owned(), kept);
        }
        Ok(reserved)
    }

    /// Settles the reservation `name` on `store`; Unknown when none was
    /// granted under it.
    pub async fn settle(
        &self,
        store: &Store,
        name: &str,
        actual: u64,
    ) -> ratekeeper::Result<ratekeeper::store::Settled> {
        let kept = {
            let ledger = self.0.lock().unwrap_or_else(|e| e.into_inner());
            ledger.get(name).cloned()
        };
        let Some(kept) = kept else {
            return Ok(ratekeeper::store::Settled::Unknown);
        };
        let reservation = ratekeeper::store::Reservation {
            nonce: &kept.nonce,
            checks: &kept.checks,
            taken: &kept.taken,
            ttl_ms: kept.ttl_ms,
        };
        store.settle(&reservation, actual).await
    }
}
