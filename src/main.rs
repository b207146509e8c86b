//! The `ratekeeper` binary: flags and environment in, a running server out.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::{Parser, Subcommand, ValueEnum};
use ratekeeper::clock::SystemClock;
use ratekeeper::config::watch::{fingerprint, record_load, SharedConfig, Watched};
use ratekeeper::config::xds_client::XdsSettings;
use ratekeeper::config::{Config, LimitsDir, LoadOptions};
use ratekeeper::headers::{HeaderNames, HeaderSettings};
use ratekeeper::http;
use ratekeeper::incoming::Listener;
use ratekeeper::keys::Values;
use ratekeeper::server::{ConnectionLimits, Server};
use ratekeeper::service::rls::LimiterSettings;
use ratekeeper::store::{MemoryStore, Role, Store, Stores};
use ratekeeper::telemetry::{self, LogFormat};
use ratekeeper::tls::{ReloadingTls, TlsFiles};
use ratekeeper::vocab::FailureMode;
use ratekeeper::{keys, Error, Result};
use tokio::net::TcpListener;

mod admin_cli;
mod envoy_settings;
mod settings_compat;
use envoy_settings::{ConfigType, EnvoyModes, EnvoySettings};
mod stats_settings;
use stats_settings::StatsSettings;
mod otel_settings;
use otel_settings::TracingArgs;
mod redis_settings;
use redis_settings::{PerSecondArgs, Redis, TopologyArg};

// Every request allocates (HTTP/2 frames, protobuf, keys): see BENCHMARKS.md.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `--version`: the crate's version and the commit it was built from
/// (build.rs; "unknown" when the build had neither git nor the variable).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("RATEKEEPER_COMMIT"),
    ")"
);

/// A distributed rate-limit decision service (Envoy rate limit API v3).
/// Without a command it serves, configured by the flags below.
#[derive(Debug, Parser)]
#[command(version = VERSION, about, disable_help_subcommand = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Directory of limits files (envoyproxy/ratelimit YAML, one domain each):
    /// its `*.yaml` / `*.yml`. Default: with any RUNTIME_* set,
    /// envoyproxy/ratelimit's runtime layout (see RUNTIME_ROOT), else `config`.
    #[arg(long, env = "CONFIG_DIR")]
    config_dir: Option<PathBuf>,
    /// gRPC listen address. Default `$GRPC_HOST:$GRPC_PORT`
    /// (envoyproxy/ratelimit's names), i.e. `0.0.0.0:8081`.
    #[arg(long, env = "GRPC_ADDR")]
    grpc_addr: Option<SocketAddr>,
    /// Prometheus metrics listen address, or `off`. Default `0.0.0.0:9090`;
    /// with USE_PROMETHEUS=true, PROMETHEUS_ADDR replaces it.
    #[arg(long, env = "METRICS_ADDR")]
    metrics_addr: Option<String>,
    /// envoyproxy/ratelimit's switch: take the metrics address from
    /// PROMETHEUS_ADDR. (Metrics are on without it; METRICS_ADDR=off stops them.)
    #[arg(long, env = "USE_PROMETHEUS", value_parser = BoolishValueParser::new())]
    use_prometheus: bool,
    /// The metrics address when USE_PROMETHEUS=true (default `:9090`); a
    /// host-less `:PORT` listens on every interface.
    #[arg(long, env = "PROMETHEUS_ADDR")]
    prometheus_addr: Option<String>,
    /// The path metrics are served at.
    #[arg(long, env = "PROMETHEUS_PATH", default_value = "/metrics")]
    metrics_path: String,
    /// HTTP listen address for `/healthcheck` and `/json`, or `off`. Default
    /// `$HOST:$PORT` (envoyproxy/ratelimit's names), each defaulting to
    /// `0.0.0.0` and `8080`.
    #[arg(long, env = "HTTP_ADDR")]
    http_addr: Option<String>,
    /// Debug HTTP listen address for `/rlconfig`, or `off`. Default
    /// `$DEBUG_HOST:$DEBUG_PORT`, each defaulting to `0.0.0.0` and `6070`.
    #[arg(long, env = "DEBUG_ADDR")]
    debug_addr: Option<String>,
    /// The admin API's listener and guard.
    #[command(flatten)]
    admin: AdminFlags,
    /// Redis: single `redis://[user:pass@]host:port[/db]` or `host:port`;
    /// cluster `host:port,host:port,...`; sentinel `mastername,host:port,...`.
    /// Absent: counters are kept in memory (one replica only).
    #[arg(long, env = "REDIS_URL")]
    redis_url: Option<String>,
    /// Redis topology.
    #[arg(long, env = "REDIS_TYPE", value_enum, ignore_case = true, default_value_t = TopologyArg::Single)]
    redis_type: TopologyArg,
    /// Redis password, or `user:password` for an ACL user. Never logged.
    #[arg(long, env = "REDIS_AUTH", hide_env_values = true)]
    redis_auth: Option<String>,
    /// File holding the Redis password (or `user:password`).
    #[arg(long, env = "REDIS_AUTH_FILE")]
    redis_auth_file: Option<PathBuf>,
    // On/off switches read their environment variables as envoyproxy/ratelimit
    // does (Go's ParseBool): 1/0, t/f, true/false in any case (and yes/no).
    /// TLS to Redis (also implied by a `rediss://` URL).
    #[arg(long, env = "REDIS_TLS", value_parser = BoolishValueParser::new())]
    redis_tls: bool,
    /// PEM CA certificate to trust for Redis TLS (default: the system's roots).
    #[arg(long, env = "REDIS_TLS_CACERT")]
    redis_tls_ca: Option<PathBuf>,
    /// PEM client certificate for Redis mutual TLS.
    #[arg(long, env = "REDIS_TLS_CLIENT_CERT", requires = "redis_tls_client_key")]
    redis_tls_client_cert: Option<PathBuf>,
    /// PEM client key for Redis mutual TLS.
    #[arg(long, env = "REDIS_TLS_CLIENT_KEY", requires = "redis_tls_client_cert")]
    redis_tls_client_key: Option<PathBuf>,
    /// The answer while Redis fails: unavailable (gRPC UNAVAILABLE, so that
    /// Envoy's failure_mode_deny decides, as with envoyproxy/ratelimit),
    /// open (allow), closed (OVER_LIMIT), local (limit / --expected-replicas
    /// in memory). Domains can override with `failure_mode:`.
    #[arg(long, env = "FAILURE_MODE", value_enum, default_value_t = FailureModeArg::Unavailable)]
    failure_mode: FailureModeArg,
    /// Most distinct `detailed_metric` label values kept in /metrics; past
    /// it new values are counted under `overflow`.
    #[arg(long, env = "MAX_DETAILED_METRIC_SERIES", default_value_t = 10_000)]
    max_detailed_metric_series: usize,
    /// Put the SHA-256 of descriptor values (not the values) in Redis keys
    /// and metrics labels, so raw tokens or emails never appear there.
    /// Changing it starts every counter afresh.
    #[arg(long, env = "HASH_DESCRIPTOR_VALUES", value_parser = BoolishValueParser::new())]
    hash_descriptor_values: bool,
    /// Replicas sharing the limits, for `failure_mode: local`.
    #[arg(long, env = "EXPECTED_REPLICAS", default_value_t = 1)]
    expected_replicas: u32,
    /// Most counters `failure_mode: local` keeps (a count of keys, rounded
    /// up to a multiple of 64; a fixed window's takes about 145 bytes); past
    /// it new keys are decided as new every time.
    #[arg(
        long,
        env = "LOCAL_FALLBACK_MAX_KEYS",
        default_value_t = ratekeeper::service::rls::DEFAULT_LOCAL_FALLBACK_KEYS,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    local_fallback_max_keys: usize,
    /// Multiplexed connections to Redis, in all: spread over the serving
    /// threads, at least one each.
    #[arg(long, env = "REDIS_POOL_SIZE", default_value_t = 4, value_parser = redis_settings::at_most_1024)]
    redis_pool_size: usize,
    /// Threads serving gRPC, each with its own connections, Redis
    /// connections and batches. Default: one per core available (cgroup
    /// CPU limits included).
    #[arg(long, env = "SERVING_THREADS", value_parser = serving_threads)]
    serving_threads: Option<NonZeroUsize>,
    /// Deadline of one Redis call, in milliseconds. Default 20, or
    /// REDIS_TIMEOUT when that is set.
    #[arg(long, env = "REDIS_TIMEOUT_MS")]
    redis_timeout_ms: Option<u64>,
    /// Call the limiter by `EVALSHA` only, never as a Redis function
    /// (`FCALL`): for proxies or managed Redis that pass scripts but not
    /// functions. (Without it, Redis before 7.0 is detected and gets scripts.)
    #[arg(long, env = "REDIS_SCRIPTS_ONLY", value_parser = BoolishValueParser::new())]
    redis_scripts_only: bool,
    /// Deadline for connecting to Redis, in milliseconds. Default 1000, or
    /// REDIS_TIMEOUT when that is set.
    #[arg(long, env = "REDIS_CONNECT_TIMEOUT_MS")]
    redis_connect_timeout_ms: Option<u64>,
    /// Prefix of every counter key.
    #[arg(long, env = "CACHE_KEY_PREFIX", default_value = keys::DEFAULT_PREFIX)]
    key_prefix: String,
    /// Add RateLimit-* / Retry-After response headers (domains can override
    /// with `response_headers:` in their limits file).
    #[arg(long, env = "LIMIT_RESPONSE_HEADERS_ENABLED", value_parser = BoolishValueParser::new())]
    response_headers: bool,
    /// Name of the limit header.
    #[arg(long, env = "LIMIT_LIMIT_HEADER", default_value = "RateLimit-Limit")]
    header_limit: String,
    /// Name of the remaining header.
    #[arg(
        long,
        env = "LIMIT_REMAINING_HEADER",
        default_value = "RateLimit-Remaining"
    )]
    header_remaining: String,
    /// Name of the reset header (seconds).
    #[arg(long, env = "LIMIT_RESET_HEADER", default_value = "RateLimit-Reset")]
    header_reset: String,
    /// Name of the retry header, sent when over the limit (seconds).
    #[arg(long, env = "LIMIT_RETRY_AFTER_HEADER", default_value = "Retry-After")]
    header_retry_after: String,
    /// How often the limits directory is checked for changes, in milliseconds.
    #[arg(long, env = "RELOAD_INTERVAL_MS", default_value_t = 1_000)]
    reload_interval_ms: u64,
    /// On SIGTERM, how long open connections may drain, in milliseconds.
    #[arg(long, env = "SHUTDOWN_GRACE_MS", default_value_t = 5_000)]
    shutdown_grace_ms: u64,
    /// PEM certificate chain for gRPC over TLS (reloaded when it changes).
    /// Also read from GRPC_SERVER_TLS_CERT (with GRPC_SERVER_USE_TLS=true).
    #[arg(long, env = "GRPC_TLS_CERT")]
    grpc_tls_cert: Option<PathBuf>,
    /// PEM private key for gRPC over TLS. Never logged. Also read from
    /// GRPC_SERVER_TLS_KEY.
    #[arg(long, env = "GRPC_TLS_KEY")]
    grpc_tls_key: Option<PathBuf>,
    /// PEM CA: require client certificates signed by it (mutual TLS). Also
    /// read from GRPC_CLIENT_TLS_CACERT.
    #[arg(long, env = "GRPC_TLS_CLIENT_CA")]
    grpc_tls_client_ca: Option<PathBuf>,
    /// Time a client has to send the HTTP/2 preface after connecting, in ms;
    /// also how long an HTTP/1 connection (/healthcheck, /json, /metrics)
    /// may stay silent.
    #[arg(long, env = "HANDSHAKE_TIMEOUT_MS", default_value_t = 10_000)]
    handshake_timeout_ms: u64,
    /// Send client connections this old an HTTP/2 GOAWAY (Go syntax, e.g.
    /// `1h30m`), so clients rebalance across replicas (envoyproxy/ratelimit's
    /// default); 0: never, as grpc-go reads it.
    #[arg(long, env = "GRPC_MAX_CONNECTION_AGE", value_parser = duration, default_value = "24h")]
    max_connection_age: Duration,
    /// Time a connection past its maximum age gets to finish its calls;
    /// then it is closed. 0: never closed, as grpc-go reads it.
    #[arg(long, env = "GRPC_MAX_CONNECTION_AGE_GRACE", value_parser = duration, default_value = "1h")]
    max_connection_age_grace: Duration,
    /// Log filter: `error`, `warn` (or `warning`), `info`, `debug`,
    /// `trace` in any case (`fatal`, `panic`: `error`), or a directive.
    #[arg(long, env = "LOG_LEVEL", default_value = "info")]
    log_level: String,
    /// Log format: `json` (any case), else text.
    #[arg(long, env = "LOG_FORMAT", default_value = "text")]
    log_format: String,
    /// envoyproxy/ratelimit's settings: limits over xDS, gRPC TLS names,
    /// GRPC_HOST/PORT/UDS, RUNTIME_*, BACKEND_TYPE, Redis extras.
    #[command(flatten)]
    envoy: EnvoySettings,
    #[command(flatten)]
    per_second: PerSecondArgs,
    #[command(flatten)]
    stats: StatsSettings,
    #[command(flatten)]
    envoy_modes: EnvoyModes,
    #[command(flatten)]
    tracing: TracingArgs,
    // Hidden, not settings of the server: the bench/ scripts that time or
    // count the limiter alone in Redis (redis-benchmark, callgrind) take it
    // from here, as this build loads it.
    /// Write the limiter's Redis function library (`FUNCTION LOAD` text; its
    /// function has the library's name, on the first line) and exit.
    #[arg(long, hide = true)]
    write_limiter_library: Option<PathBuf>,
    /// Write the limiter as the script sent by `EVALSHA` (`SCRIPT LOAD`
    /// text) and exit.
    #[arg(long, hide = true)]
    write_limiter_script: Option<PathBuf>,
}

/// The admin API's flags (see README "Operations").
#[derive(Debug, clap::Args)]
struct AdminFlags {
    /// Admin API listen address (inspect and reset counters, leases, the
    /// config: see README "Operations"), or `off`. Default: this host only.
    /// A non-loopback address needs --admin-token-file or
    /// --admin-tls-client-ca.
    #[arg(long = "admin-addr", env = "ADMIN_ADDR")]
    addr: Option<String>,
    /// File holding the admin API's bearer token (a mounted Secret; read at
    /// each request, so rotating it needs no restart).
    #[arg(long = "admin-token-file", env = "ADMIN_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// PEM certificate chain: serve the admin API over TLS (re-read when it
    /// changes).
    #[arg(long = "admin-tls-cert", env = "ADMIN_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key for the admin API's TLS. Never logged.
    #[arg(long = "admin-tls-key", env = "ADMIN_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// PEM CA: the admin API requires client certificates signed by it
    /// (mutual TLS, which guards it as a token does).
    #[arg(
        long = "admin-tls-client-ca",
        env = "ADMIN_TLS_CLIENT_CA",
        requires = "tls_cert"
    )]
    tls_client_ca: Option<PathBuf>,
}

/// What to do instead of serving.
#[derive(Debug, Subcommand)]
enum Command {
    /// Check a limits directory as the server would load it, without
    /// serving: exit 0 with a one-line summary, or 1 with every error as
    /// `file:line: reason` (for CI pipelines and pre-commit hooks).
    Validate {
        /// The directory to check. Default: `--config-dir` / CONFIG_DIR,
        /// else as for serving.
        #[arg(long)]
        config_dir: Option<PathBuf>,
    },
    /// Talk to a running server's admin API: inspect or reset a
    /// descriptor's counters, list or revoke leases, show the config.
    Admin(admin_cli::AdminArgs),
}

// The library's value types know nothing of clap: these mirror them for the
// flags, and map onto them.

/// `--failure-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FailureModeArg {
    /// Allow the request (counted in `ratekeeper_store_error_fail_open`).
    Open,
    /// Refuse: OVER_LIMIT for every limited descriptor.
    Closed,
    /// Answer gRPC UNAVAILABLE (Envoy then applies its own `failure_mode_deny`).
    Unavailable,
    /// Enforce each limit divided by `--expected-replicas` in this replica's
    /// memory until the store is back.
    Local,
}

impl From<FailureModeArg> for FailureMode {
    fn from(arg: FailureModeArg) -> Self {
        match arg {
            FailureModeArg::Open => FailureMode::Open,
            FailureModeArg::Closed => FailureMode::Closed,
            FailureModeArg::Unavailable => FailureMode::Unavailable,
            FailureModeArg::Local => FailureMode::Local,
        }
    }
}

/// The tracing filter for LOG_LEVEL: logrus's level names (any case,
/// `warning`, `fatal`, `panic`) as tracing's, or directives
/// (`ratekeeper=debug,h2=warn`). Anything else is refused, as there:
/// tracing would take a stray word (or a trailing space) for a target and
/// log nothing else, errors included.
fn log_filter(level: &str) -> Result<String> {
    if let Some(level) = tracing_level(level) {
        return Ok(level.into());
    }
    let directive = |d: &str| match d.split_once('=') {
        Some((target, level)) => {
            !target.is_empty()
                && target
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_:".contains(c))
                && tracing_level(level).is_some()
        }
        None => false,
    };
    if level.split(',').all(directive) {
        return Ok(level.to_owned());
    }
    Err(Error::Startup(format!(
        "LOG_LEVEL {level:?} is not a level: expected error, warn, info, debug or trace \
         (or tracing directives such as ratekeeper=debug)"
    )))
}

/// A logrus level name (any case) as tracing's; `None` when not one.
fn tracing_level(level: &str) -> Option<&'static str> {
    Some(match level.to_ascii_lowercase().as_str() {
        "warning" | "warn" => "warn",
        "fatal" | "panic" | "error" => "error",
        "off" => "off",
        "info" => "info",
        "debug" => "debug",
        "trace" => "trace",
        _ => return None,
    })
}

/// LOG_FORMAT as envoyproxy/ratelimit reads it: `json` in any case, else
/// text.
fn log_format(format: &str) -> LogFormat {
    if format.eq_ignore_ascii_case("json") {
        LogFormat::Json
    } else {
        LogFormat::Text
    }
}

// The serving lanes run their own runtimes (see `ratekeeper::lanes`); this
// one only accepts connections and runs the background tasks.
#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli = Cli::parse();
    // The server's last word is written as its logs are (a subcommand's
    // as a command's).
    let mut log_format_used = None;
    let result = if let Some(Command::Validate { config_dir: dir }) = &cli.command {
        let dir = cli
            .envoy
            .limits_dir(dir.clone().or_else(|| cli.config_dir.clone()));
        validate(&dir, cli.envoy_modes.load_options())
    } else if let Some(Command::Admin(args)) = &cli.command {
        admin_cli::run(args).await
    } else if cli.write_limiter_library.is_some() || cli.write_limiter_script.is_some() {
        write_limiter(&cli)
    } else {
        let format = log_format(&cli.log_format);
        log_format_used = Some(format);
        run(cli, format).await
    };
    if let Err(error) = result {
        use std::io::IsTerminal;
        let message = error.to_string();
        match log_format_used {
            Some(LogFormat::Json) => eprintln!("{}", ratekeeper::logrus::fatal_json(&message)),
            Some(LogFormat::Text) if !std::io::stderr().is_terminal() => {
                eprintln!("{}", ratekeeper::logrus::fatal_text(&message));
            }
            _ => eprintln!("ratekeeper: {error}"),
        }
        std::process::exit(1);
    }
}

async fn run(cli: Cli, log_format: LogFormat) -> Result<()> {
    telemetry::init_logging(&log_filter(&cli.log_level)?, log_format)?;
    settings_compat::warn_ignored();
    settings_compat::warn_redis_without_url(cli.redis_url.is_some());
    cli.envoy.check_backend()?;
    if cli.key_prefix.contains(['{', '}']) {
        return Err(Error::Startup(
            "the key prefix must not contain '{' or '}'".into(),
        ));
    }
    // Before any stat is made: series keep the name first given.
    ratekeeper::stat_mapper::install(cli.stats.prometheus_mapper()?)?;
    let addr = metrics_addr(
        cli.use_prometheus,
        cli.metrics_addr.as_deref(),
        cli.prometheus_addr.as_deref(),
    );
    // Their metrics port is opened only when asked for (USE_PROMETHEUS):
    // ours by default, so another process on it must not stop the start.
    let asked = cli.use_prometheus || cli.metrics_addr.is_some();
    let metrics = match bind_http(&addr, "metrics", asked).await? {
        Some(listener) => Some((listener, telemetry::install_recorder()?)),
        None => None,
    };
    metrics::gauge!(
        "ratekeeper_build_info",
        "version" => env!("CARGO_PKG_VERSION"),
        "commit" => env!("RATEKEEPER_COMMIT")
    )
    .set(1.0);

    // Before the limits load: their load is counted.
    let statsd = cli.stats.statsd()?;
    settings_compat::warn_statsd_while_off(statsd.is_some());
    if let Some(statsd) = statsd {
        ratekeeper::statsd::install(statsd).await?;
    }
    let limiter = limiter_settings(&cli)?;
    let (config, config_dir) = first_limits(&cli).await?;

    let lanes = cli
        .serving_threads
        .map_or_else(ratekeeper::lanes::default_count, NonZeroUsize::get);
    let store = stores(&cli, lanes)?;
    let reload_interval = Duration::from_millis(cli.reload_interval_ms.max(50));
    let tls = grpc_tls(&cli, reload_interval)?;
    let grpc = bind_grpc(&cli).await?;
    let metrics_addr = serve_metrics(&cli, metrics)?;
    let http = http_listeners(&cli, reload_interval).await?;
    announce(&grpc, &metrics_addr, &http, log_format == LogFormat::Json)?;

    Server {
        grpc,
        config_dir,
        load_options: cli.envoy_modes.load_options(),
        config,
        health_needs_domains: cli.envoy.healthy_with_at_least_one_config_loaded,
        health_needs_store: cli.envoy.redis_health_check_active_connection,
        store,
        limiter,
        reload_interval,
        shutdown_grace: Duration::from_millis(cli.shutdown_grace_ms),
        limits: ConnectionLimits {
            tls,
            handshake_timeout: Duration::from_millis(cli.handshake_timeout_ms),
            // 0 is never, for both, as grpc-go reads them.
            max_connection_age: Some(cli.max_connection_age).filter(|age| !age.is_zero()),
            max_connection_age_grace: match cli.max_connection_age_grace {
                Duration::ZERO => Duration::MAX,
                grace => grace,
            },
            ..ConnectionLimits::default()
        },
        lanes,
        http,
    }
    .run(shutdown_signal())
    .await
}

/// The limits to start with, from the files (with the directory to watch)
/// or the first xDS snapshot.
async fn first_limits(cli: &Cli) -> Result<(SharedConfig, Option<Watched>)> {
    let load_options = cli.envoy_modes.load_options();
    match cli.envoy.config_type()? {
        ConfigType::File => {
            let dir = cli.envoy.limits_dir(cli.config_dir.clone());
            // Taken before the load: a file written meanwhile is reloaded
            // (a directory made meanwhile too).
            let loaded = Some(fingerprint(&dir));
            let config = load_files(&dir, load_options, &cli.envoy)?;
            Ok((config, Some(Watched { dir, loaded })))
        }
        ConfigType::GrpcXdsSotw => Ok((subscribe_xds(&cli.envoy, load_options).await?, None)),
    }
}

/// How the rate limit service decides and answers, from the flags.
fn limiter_settings(cli: &Cli) -> Result<LimiterSettings> {
    let headers = HeaderSettings {
        enabled: cli.response_headers,
        names: HeaderNames {
            limit: cli.header_limit.clone(),
            remaining: cli.header_remaining.clone(),
            reset: cli.header_reset.clone(),
            retry_after: cli.header_retry_after.clone(),
        },
    };
    headers.names.validate()?;
    Ok(LimiterSettings {
        key_prefix: cli.key_prefix.clone(),
        headers,
        failure_mode: cli.failure_mode.into(),
        expected_replicas: cli.expected_replicas,
        local_fallback_max_keys: Some(cli.local_fallback_max_keys),
        max_detailed_series: cli.max_detailed_metric_series,
        stop_increment_when_over_limit: cli.envoy.stop_cache_key_increment_when_overlimit,
        values: if cli.hash_descriptor_values {
            Values::Sha256
        } else {
            Values::Raw
        },
        near_limit_ratio: cli.stats.near_limit_ratio()?,
        modes: cli.envoy_modes.modes(),
        over_cache_bytes: cli.envoy.over_cache_bytes(),
        tracer: cli.tracing.tracer()?,
    })
}

/// The gRPC listener: a Unix socket (`GRPC_UDS`) or TCP.
async fn bind_grpc(cli: &Cli) -> Result<Listener> {
    Ok(match &cli.envoy.grpc_uds {
        Some(path) => Listener::Unix(bind_unix(path)?),
        None => bind(&cli.envoy.grpc_addr(cli.grpc_addr), "gRPC")
            .await?
            .into(),
    })
}

/// gRPC's TLS files, reloaded when they change; `None`: plaintext.
fn grpc_tls(cli: &Cli, reload_interval: Duration) -> Result<Option<ReloadingTls>> {
    let files = cli.envoy.grpc_tls(
        cli.grpc_tls_cert.as_deref(),
        cli.grpc_tls_key.as_deref(),
        cli.grpc_tls_client_ca.as_deref(),
    )?;
    files
        .map(|files| ReloadingTls::start(files, reload_interval))
        .transpose()
}

/// Serves `/metrics` on its own listener, if there is one; its address, or "off".
fn serve_metrics(
    cli: &Cli,
    metrics: Option<(TcpListener, metrics_exporter_prometheus::PrometheusHandle)>,
) -> Result<String> {
    let Some((listener, handle)) = metrics else {
        return Ok("off".into());
    };
    let addr = local_addr(&listener)?;
    let router = http::metrics::router(&cli.metrics_path, handle)?;
    let idle = Duration::from_millis(cli.handshake_timeout_ms);
    tokio::spawn(http::serve(listener, idle, router, std::future::pending()));
    Ok(addr.to_string())
}

/// The HTTP listeners: the API (`/healthcheck`, `/json`), debug, admin.
async fn http_listeners(cli: &Cli, reload_interval: Duration) -> Result<http::Listeners> {
    // As theirs: without its listener (`/healthcheck`) a replica would
    // never be ready, so a failure stops the start; the debug listener's
    // is written and the start goes on.
    let api_addr = listen_addr(cli.http_addr.as_deref(), "HOST", "PORT", 8080);
    let api = bind_http(&api_addr, "HTTP", true).await?;
    let debug_addr = listen_addr(cli.debug_addr.as_deref(), "DEBUG_HOST", "DEBUG_PORT", 6070);
    let debug = bind_http(&debug_addr, "debug HTTP", false).await?;
    let admin = bind_admin(&cli.admin, reload_interval).await?;
    Ok(http::Listeners { api, debug, admin })
}

/// One plain line on stdout for scripts and tests that start us on port 0
/// (with JSON logs, a JSON log line: a container's log holds both streams).
fn announce(
    grpc: &Listener,
    metrics_addr: &str,
    http: &http::Listeners,
    json_logs: bool,
) -> Result<()> {
    let grpc_addr = grpc.describe().map_err(|source| Error::Io {
        context: "gRPC listener address".into(),
        source,
    })?;
    let shown = |listener: &Option<TcpListener>| match listener {
        Some(listener) => local_addr(listener).map(|a| a.to_string()),
        None => Ok("off".to_owned()),
    };
    let admin = match &http.admin {
        Some(admin) => local_addr(&admin.listener)?.to_string(),
        None => "off".to_owned(),
    };
    let (api, debug) = (shown(&http.api)?, shown(&http.debug)?);
    if json_logs {
        let fields = [
            ("grpc", grpc_addr.as_str()),
            ("metrics", metrics_addr),
            ("http", &api),
            ("debug", &debug),
            ("admin", &admin),
        ];
        println!("{}", ratekeeper::logrus::json_info("listening", &fields));
    } else {
        println!(
            "listening grpc={grpc_addr} metrics={metrics_addr} http={api} debug={debug} admin={admin}"
        );
    }
    Ok(())
}

/// The counter stores: in memory without REDIS_URL; else the main Redis,
/// and with REDIS_PERSECOND the per-second one.
fn stores(cli: &Cli, lanes: usize) -> Result<Stores> {
    let main = match &cli.redis_url {
        None => None,
        Some(url) => Some(main_redis(cli, url)?),
    };
    let per_second = cli.per_second.redis(main.as_ref())?;
    let Some(main) = main else {
        return Ok(Store::Memory(MemoryStore::new(Arc::new(SystemClock))).into());
    };
    let (cert, key) = (&cli.redis_tls_client_cert, &cli.redis_tls_client_key);
    let shared = redis_settings::Shared {
        tls_ca: cli.redis_tls_ca.as_deref(),
        tls_client: cert.as_deref().zip(key.as_deref()),
        skip_hostname_verification: cli.envoy.redis_tls_skip_hostname_verification,
        lanes,
        functions: !cli.redis_scripts_only,
        expiry_jitter: cli.envoy.expiry_jitter()?,
    };
    let per_second = match per_second {
        Some(redis) => Some(redis_settings::store(redis, &shared)?),
        None => None,
    };
    Ok(Stores::new(
        redis_settings::store(main, &shared)?,
        per_second,
    ))
}

/// The main Redis, from REDIS_*.
fn main_redis<'a>(cli: &'a Cli, url: &'a str) -> Result<Redis<'a>> {
    let auth = match &cli.redis_auth_file {
        Some(file) => Some(String::from_utf8_lossy(&read_file(file)?).trim().to_owned()),
        None => cli.redis_auth.clone(),
    };
    let (socket_type, sentinel_auth) = cli.envoy.redis_extras();
    Ok(Redis {
        var: "REDIS",
        role: Role::Main,
        url,
        topology: cli.redis_type.into(),
        auth,
        tls: cli.redis_tls,
        connections: cli.redis_pool_size,
        socket_type,
        sentinel_auth,
        connect_timeout: redis_timeout(cli.redis_connect_timeout_ms, 1_000, &cli.envoy),
        call_timeout: redis_timeout(cli.redis_timeout_ms, 20, &cli.envoy),
    })
}

/// The limits directory's limits. A runtime directory not there yet (see
/// [`LimitsDir::not_there_yet`]) starts the server with no limits, as
/// envoyproxy/ratelimit starts; with FORCE_START_WITHOUT_INITIAL_CONFIG
/// any directory that cannot be loaded yet (missing, or a bad file) starts
/// it awaiting its first limits. Either way the watcher loads the limits
/// once they can be.
fn load_files(
    dir: &LimitsDir,
    load_options: LoadOptions,
    envoy: &EnvoySettings,
) -> Result<SharedConfig> {
    if dir.not_there_yet() {
        tracing::warn!(%dir, "the limits directory does not exist yet: no limits until it does");
        record_load(true);
        return Ok(SharedConfig::new(Config::default()));
    }
    let config = Config::load(dir, load_options);
    record_load(config.is_ok());
    match config {
        Ok(config) => {
            tracing::info!(%dir, domains = ?config.domain_names(), "limits loaded");
            Ok(SharedConfig::new(config))
        }
        Err(error) if envoy.force_start_without_initial_config => {
            tracing::warn!(%error, "starting without limits (FORCE_START_WITHOUT_INITIAL_CONFIG)");
            Ok(SharedConfig::awaiting_first())
        }
        Err(error) => Err(error.into()),
    }
}

/// Starts the xDS client; unless FORCE_START_WITHOUT_INITIAL_CONFIG, waits
/// for its first snapshot (as envoyproxy/ratelimit does, before serving).
async fn subscribe_xds(envoy: &EnvoySettings, load_options: LoadOptions) -> Result<SharedConfig> {
    let shared = SharedConfig::awaiting_first();
    let settings = XdsSettings {
        load_options,
        ..envoy.xds()?
    };
    let mut loaded = ratekeeper::config::xds_client::spawn(settings, shared.clone());
    if !envoy.force_start_without_initial_config {
        tracing::info!("waiting for the first limits from the xDS server");
        loaded
            .wait_for(|loaded| *loaded)
            .await
            .map_err(|_| Error::Startup("the xDS client stopped".into()))?;
    }
    Ok(shared)
}

/// A Redis deadline: the flag in milliseconds, else REDIS_TIMEOUT, else
/// `default_ms`.
fn redis_timeout(flag_ms: Option<u64>, default_ms: u64, envoy: &EnvoySettings) -> Duration {
    match (flag_ms, envoy.redis_timeout) {
        (Some(ms), _) => Duration::from_millis(ms),
        (None, Some(timeout)) => timeout,
        (None, None) => Duration::from_millis(default_ms),
    }
}

/// `ratekeeper validate`: the directory loaded as the server loads it, but
/// with every file's error reported (one `file:line: reason` line each, on
/// stderr) rather than the first.
fn validate(dir: &LimitsDir, options: LoadOptions) -> Result<()> {
    // The loader's warnings (a key repeated in a mapping), on stderr with
    // the errors; nothing else logs here.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .without_time()
        .with_target(false)
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .try_init();
    let config = match Config::check(dir, options) {
        Ok(config) => config,
        Err(errors) => {
            for error in &errors {
                eprintln!("{error}");
            }
            let n = errors.len();
            let s = if n == 1 { "" } else { "s" };
            return Err(Error::Startup(format!("{dir}: {n} error{s}")));
        }
    };
    let files = dir.files()?.len();
    let domains = config.domain_names();
    if domains.is_empty() {
        // Valid (the server starts, allowing everything), but in a CI job
        // more likely a wrong path.
        eprintln!("warning: {dir}: no domains: every request would be allowed");
    }
    println!(
        "{dir}: ok, {files} limits file{}, {} domain{} ({})",
        if files == 1 { "" } else { "s" },
        domains.len(),
        if domains.len() == 1 { "" } else { "s" },
        domains.join(", ")
    );
    Ok(())
}

/// SERVING_THREADS for clap: 1 to 1024.
fn serving_threads(text: &str) -> std::result::Result<NonZeroUsize, String> {
    let n = redis_settings::at_most_1024(text)?;
    NonZeroUsize::new(n).ok_or_else(|| "0: at least one thread serves (1 to 1024)".to_owned())
}

/// Parses a Go duration (`500ms`, `1h30m`, `1.5h`; or seconds) for clap.
fn duration(text: &str) -> std::result::Result<Duration, String> {
    ratekeeper::duration::parse_duration(text)
        .ok_or_else(|| format!("bad duration {text:?}: e.g. 500ms, 30s, 1h30m, 1.5h"))
}

/// The metrics listener's address: METRICS_ADDR, or with USE_PROMETHEUS=true
/// PROMETHEUS_ADDR (envoyproxy/ratelimit's setting wins when asked for: it
/// is what their deployments scrape). There is one metrics listener.
fn metrics_addr(use_prometheus: bool, metrics: Option<&str>, prometheus: Option<&str>) -> String {
    if !use_prometheus {
        if let Some(ignored) = prometheus {
            tracing::warn!(%ignored, "PROMETHEUS_ADDR is only used with USE_PROMETHEUS=true");
        }
        return metrics.unwrap_or("0.0.0.0:9090").to_owned();
    }
    let addr = prometheus.unwrap_or(":9090");
    // Go's host-less `:PORT` listens on every interface.
    let addr = match addr.strip_prefix(':') {
        Some(port) => format!("0.0.0.0:{port}"),
        None => addr.to_owned(),
    };
    if let Some(ignored) = metrics.filter(|m| *m != addr) {
        tracing::warn!(%ignored, used = %addr, "USE_PROMETHEUS=true: metrics listen on PROMETHEUS_ADDR, not METRICS_ADDR");
    }
    addr
}

/// A listener's address: `flag`, else `$host_var:$port_var` (defaults
/// `0.0.0.0` and `default_port`).
fn listen_addr(flag: Option<&str>, host_var: &str, port_var: &str, default_port: u16) -> String {
    if let Some(addr) = flag {
        return addr.to_owned();
    }
    let host = std::env::var(host_var).unwrap_or_else(|_| "0.0.0.0".into());
    let port = std::env::var(port_var).unwrap_or_else(|_| default_port.to_string());
    envoy_settings::join_host_port(&host, port)
}

/// Binds an HTTP listener unless `off`. A failure stops the start when
/// `fatal`; else it is a warning and the start goes on without the
/// listener (the debug listener's, as theirs; the metrics and admin
/// listeners' default addresses, so that replicas sharing a host start
/// without naming every port).
async fn bind_http(addr: &str, what: &str, fatal: bool) -> Result<Option<TcpListener>> {
    if addr == "off" || addr.is_empty() {
        return Ok(None);
    }
    match bind(addr, what).await {
        Ok(listener) => Ok(Some(listener)),
        Err(error) if !fatal => {
            tracing::warn!(%error, "serving without it");
            Ok(None)
        }
        Err(error) => Err(error),
    }
}

/// Binds the admin listener unless `off`, refusing a non-loopback address
/// guarded by neither a token file nor mutual TLS. Its default address
/// (loopback) taken is only a warning, as for the other HTTP listeners.
async fn bind_admin(
    flags: &AdminFlags,
    reload: Duration,
) -> Result<Option<http::admin::AdminListener>> {
    let addr = flags.addr.as_deref().unwrap_or(http::admin::DEFAULT_ADDR);
    let asked = flags.addr.is_some();
    let Some(listener) = bind_http(addr, "the admin API", asked).await? else {
        return Ok(None);
    };
    let token_file = flags.token_file.clone();
    let mutual_tls = flags.tls_client_ca.is_some();
    http::admin::check_guard(local_addr(&listener)?, token_file.as_deref(), mutual_tls)?;
    if let Some(file) = &token_file {
        read_file(file)?;
    }
    let tls = match (&flags.tls_cert, &flags.tls_key) {
        (Some(cert), Some(key)) => Some(ReloadingTls::start(
            TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: flags.tls_client_ca.clone(),
                client_cert_required: true,
                client_san: None,
            },
            reload,
        )?),
        _ => None,
    };
    Ok(Some(http::admin::AdminListener {
        listener,
        token_file,
        tls,
    }))
}

fn read_file(path: &std::path::Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| Error::Io {
        context: format!("cannot read {}", path.display()),
        source,
    })
}

/// `--write-limiter-library`, `--write-limiter-script`: the limiter's text
/// in either form, to the files given.
fn write_limiter(cli: &Cli) -> Result<()> {
    use ratekeeper::store::limiter_script::{LimiterScript, TEXT};
    let limiter = LimiterScript::new(true);
    let files = [
        (&cli.write_limiter_library, limiter.library()),
        (&cli.write_limiter_script, TEXT),
    ];
    for (path, text) in files {
        if let Some(path) = path {
            std::fs::write(path, text).map_err(|source| Error::Io {
                context: format!("cannot write {}", path.display()),
                source,
            })?;
        }
    }
    Ok(())
}

/// Listens on `addr`. The unspecified IPv4 address (the default hosts'
/// `0.0.0.0`) listens on IPv6 too, as Go's `net.Listen("tcp", …)` does for
/// envoyproxy/ratelimit, so an IPv6-only or IPv6-first cluster reaches
/// the pod: one dual-stack socket on `[::]`, or IPv4 alone where the host
/// has no IPv6.
async fn bind(addr: &str, what: &str) -> Result<TcpListener> {
    let mut no_ipv6 = None;
    if let Ok(SocketAddr::V4(v4)) = addr.parse::<SocketAddr>() {
        if v4.ip().is_unspecified() {
            match dual_stack(v4.port()) {
                Ok(listener) => return Ok(listener),
                Err(error) => no_ipv6 = Some(error),
            }
        }
    }
    let listener = TcpListener::bind(addr).await.map_err(|source| Error::Io {
        context: format!("cannot listen for {what} on {addr}"),
        source,
    })?;
    if let Some(error) = no_ipv6 {
        tracing::warn!(%error, %addr, "{what}: listening on IPv4 only");
    }
    Ok(listener)
}

/// A listener on `[::]:port` taking IPv4 clients as well (IPV6_V6ONLY off,
/// whatever the host's default), set up as tokio's own.
fn dual_stack(port: u16) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV6, Type::STREAM, None)?;
    socket.set_only_v6(false)?;
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    let any = SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port));
    socket.bind(&any.into())?;
    socket.listen(1024)?;
    TcpListener::from_std(socket.into())
}

/// Listens on the Unix socket `path`, replacing a socket file an earlier
/// run left (any other file there is an error).
fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    let context = || {
        format!(
            "cannot listen for gRPC on the Unix socket {}",
            path.display()
        )
    };
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        std::fs::remove_file(path).map_err(|source| Error::Io {
            context: context(),
            source,
        })?;
    }
    tokio::net::UnixListener::bind(path).map_err(|source| Error::Io {
        context: context(),
        source,
    })
}

fn local_addr(listener: &TcpListener) -> Result<SocketAddr> {
    listener.local_addr().map_err(|source| Error::Io {
        context: "listener address".into(),
        source,
    })
}

/// Resolves on SIGINT, SIGTERM or SIGHUP.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        // SIGHUP too, as theirs (it does not mean "reload" there either).
        use tokio::signal::unix::{signal, Signal, SignalKind};
        // Each watched on its own: one that cannot be is logged, the
        // others still stop the server.
        let watch = |kind: SignalKind, name: &str| {
            signal(kind)
                .inspect_err(|error| tracing::warn!(%error, "cannot watch {name}"))
                .ok()
        };
        let received = |signal: Option<Signal>| async move {
            match signal {
                Some(mut signal) => drop(signal.recv().await),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = interrupt => {}
            () = received(watch(SignalKind::terminate(), "SIGTERM")) => {}
            () = received(watch(SignalKind::hangup(), "SIGHUP")) => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
    tracing::info!("shutting down");
}
