//! Test harness: real `redis-server` processes on free loopback ports, the
//! ratekeeper server in-process on port 0, and gRPC clients.
#![allow(dead_code)]

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
use ratekeeper::server::Server;
use ratekeeper::service::rls::LimiterSettings;
use ratekeeper::store::{MemoryStore, RedisSettings, RedisStore, Store, Topology};
use tokio::sync::oneshot;
use tonic::transport::Channel;

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port")
}

/// A `redis-server` child process, stopped by PID when dropped.
pub struct RedisServer {
    child: Child,
    pub port: u16,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        RedisServer::start_on(free_port())
    }

    fn start_on(port: u16) -> RedisServer {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (make test installs it)");
        let server = RedisServer { child, port };
        let client = server.client();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut conn) = client.get_connection() {
                if redis::cmd("PING").query::<String>(&mut conn).is_ok() {
                    return server;
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {port} did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server and starts a fresh, empty one on the same port.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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
        let settings = RedisSettings {
            topology: Topology::Single,
            url: self.url(),
            auth: None,
            connections: 2,
            connect_timeout: Duration::from_secs(2),
            call_timeout: Duration::from_secs(2),
        };
        Store::Redis(Arc::new(
            RedisStore::new(&settings, clock).expect("redis store"),
        ))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The two stores under test, for tables run against both.
pub enum Backend {
    Memory,
    Redis(RedisServer),
}

impl Backend {
    pub fn all() -> Vec<Backend> {
        vec![Backend::Memory, Backend::Redis(RedisServer::start())]
    }

    pub fn name(&self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Redis(_) => "redis",
        }
    }

    pub fn store(&self, clock: Arc<dyn Clock>) -> Store {
        match self {
            Backend::Memory => Store::Memory(MemoryStore::new(clock)),
            Backend::Redis(redis) => redis.store(Some(clock)),
        }
    }
}

/// A ratekeeper server running in this process.
pub struct TestServer {
    pub addr: SocketAddr,
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
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = grpc.local_addr().expect("addr");
        let config = SharedConfig::new(config);
        let (tx, rx) = oneshot::channel();
        let server = Server {
            grpc,
            config_dir,
            config: config.clone(),
            store,
            limiter: LimiterSettings {
                key_prefix: ratekeeper::keys::DEFAULT_PREFIX.into(),
                headers: HeaderSettings {
                    enabled: true,
                    names: HeaderNames::default(),
                },
                ..LimiterSettings::default()
            },
            reload_interval: Duration::from_millis(50),
            shutdown_grace: Duration::from_secs(5),
        };
        let task = tokio::spawn(server.run(async {
            let _ = rx.await;
        }));
        TestServer {
            addr,
            config,
            shutdown: Some(tx),
            task: Some(task),
        }
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
