//! The binary's flags: every setting as a flag and its environment
//! variable (envoyproxy/ratelimit's names where they have one; the other
//! settings modules hold their groups), and the parsers clap uses for them.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::{Parser, Subcommand, ValueEnum};
use ratekeeper::telemetry::LogFormat;
use ratekeeper::vocab::FailureMode;
use ratekeeper::{keys, Error, Result};

use crate::admin_cli;
use crate::envoy_settings::{EnvoyModes, EnvoySettings};
use crate::otel_settings::TracingArgs;
use crate::redis_settings::{self, PerSecondArgs, TopologyArg};
use crate::stats_settings::StatsSettings;

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
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    /// Directory of limits files (envoyproxy/ratelimit YAML, one domain each):
    /// its `*.yaml` / `*.yml`. Default: with any RUNTIME_* set,
    /// envoyproxy/ratelimit's runtime layout (see RUNTIME_ROOT), else `config`.
    #[arg(long, env = "CONFIG_DIR")]
    pub(crate) config_dir: Option<PathBuf>,
    /// gRPC listen address. Default `$GRPC_HOST:$GRPC_PORT`
    /// (envoyproxy/ratelimit's names), i.e. `0.0.0.0:8081`.
    #[arg(long, env = "GRPC_ADDR")]
    pub(crate) grpc_addr: Option<SocketAddr>,
    /// Prometheus metrics listen address, or `off`. Default `0.0.0.0:9090`;
    /// with USE_PROMETHEUS=true, PROMETHEUS_ADDR replaces it.
    #[arg(long, env = "METRICS_ADDR")]
    pub(crate) metrics_addr: Option<String>,
    /// envoyproxy/ratelimit's switch: take the metrics address from
    /// PROMETHEUS_ADDR. (Metrics are on without it; METRICS_ADDR=off stops them.)
    #[arg(long, env = "USE_PROMETHEUS", value_parser = BoolishValueParser::new())]
    pub(crate) use_prometheus: bool,
    /// The metrics address when USE_PROMETHEUS=true (default `:9090`); a
    /// host-less `:PORT` listens on every interface.
    #[arg(long, env = "PROMETHEUS_ADDR")]
    pub(crate) prometheus_addr: Option<String>,
    /// The path metrics are served at.
    #[arg(long, env = "PROMETHEUS_PATH", default_value = "/metrics")]
    pub(crate) metrics_path: String,
    /// HTTP listen address for `/healthcheck` and `/json`, or `off`. Default
    /// `$HOST:$PORT` (envoyproxy/ratelimit's names), each defaulting to
    /// `0.0.0.0` and `8080`.
    #[arg(long, env = "HTTP_ADDR")]
    pub(crate) http_addr: Option<String>,
    /// Debug HTTP listen address for `/rlconfig`, or `off`. Default
    /// `$DEBUG_HOST:$DEBUG_PORT`, each defaulting to `0.0.0.0` and `6070`.
    #[arg(long, env = "DEBUG_ADDR")]
    pub(crate) debug_addr: Option<String>,
    /// The admin API's listener and guard.
    #[command(flatten)]
    pub(crate) admin: AdminFlags,
    /// Redis: single `redis://[user:pass@]host:port[/db]` or `host:port`;
    /// cluster `host:port,host:port,...`; sentinel `mastername,host:port,...`.
    /// Absent: counters are kept in memory (one replica only).
    #[arg(long, env = "REDIS_URL")]
    pub(crate) redis_url: Option<String>,
    /// Redis topology.
    #[arg(long, env = "REDIS_TYPE", value_enum, ignore_case = true, default_value_t = TopologyArg::Single)]
    pub(crate) redis_type: TopologyArg,
    /// Redis password, or `user:password` for an ACL user. Never logged.
    #[arg(long, env = "REDIS_AUTH", hide_env_values = true)]
    pub(crate) redis_auth: Option<String>,
    /// File holding the Redis password (or `user:password`).
    #[arg(long, env = "REDIS_AUTH_FILE")]
    pub(crate) redis_auth_file: Option<PathBuf>,
    // On/off switches read their environment variables as envoyproxy/ratelimit
    // does (Go's ParseBool): 1/0, t/f, true/false in any case (and yes/no).
    /// TLS to Redis (also implied by a `rediss://` URL).
    #[arg(long, env = "REDIS_TLS", value_parser = BoolishValueParser::new())]
    pub(crate) redis_tls: bool,
    /// PEM CA certificate to trust for Redis TLS (default: the system's roots).
    #[arg(long, env = "REDIS_TLS_CACERT")]
    pub(crate) redis_tls_ca: Option<PathBuf>,
    /// PEM client certificate for Redis mutual TLS.
    /// Used with REDIS_TLS_CLIENT_KEY only: one alone is ignored, as theirs.
    #[arg(long, env = "REDIS_TLS_CLIENT_CERT")]
    pub(crate) redis_tls_client_cert: Option<PathBuf>,
    /// PEM client key for Redis mutual TLS.
    #[arg(long, env = "REDIS_TLS_CLIENT_KEY")]
    pub(crate) redis_tls_client_key: Option<PathBuf>,
    /// The answer while Redis fails: unavailable (gRPC UNAVAILABLE, so that
    /// Envoy's failure_mode_deny decides, as with envoyproxy/ratelimit),
    /// open (allow), closed (OVER_LIMIT), local (limit / --expected-replicas
    /// in memory). Domains can override with `failure_mode:`.
    #[arg(long, env = "FAILURE_MODE", value_enum, default_value_t = FailureModeArg::Unavailable)]
    pub(crate) failure_mode: FailureModeArg,
    /// Most distinct `detailed_metric` label values kept in /metrics; past
    /// it new values are counted under `overflow`.
    #[arg(long, env = "MAX_DETAILED_METRIC_SERIES", default_value_t = 10_000)]
    pub(crate) max_detailed_metric_series: usize,
    /// Put the SHA-256 of descriptor values (not the values) in Redis keys
    /// and metrics labels, so raw tokens or emails never appear there.
    /// Changing it starts every counter afresh.
    #[arg(long, env = "HASH_DESCRIPTOR_VALUES", value_parser = BoolishValueParser::new())]
    pub(crate) hash_descriptor_values: bool,
    /// Replicas sharing the limits, for `failure_mode: local`.
    #[arg(long, env = "EXPECTED_REPLICAS", default_value_t = 1)]
    pub(crate) expected_replicas: u32,
    /// Most counters `failure_mode: local` keeps (a count of keys, rounded
    /// up to a multiple of 64; a fixed window's takes about 145 bytes); past
    /// it new keys are decided as new every time.
    #[arg(
        long,
        env = "LOCAL_FALLBACK_MAX_KEYS",
        default_value_t = ratekeeper::service::rls::DEFAULT_LOCAL_FALLBACK_KEYS,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    pub(crate) local_fallback_max_keys: usize,
    /// Multiplexed connections to Redis, in all: spread over the serving
    /// threads, at least one each.
    #[arg(long, env = "REDIS_POOL_SIZE", default_value_t = 4, value_parser = redis_settings::at_most_1024)]
    pub(crate) redis_pool_size: usize,
    /// Threads serving gRPC, each with its own connections, Redis
    /// connections and batches. Default: one per core available (cgroup
    /// CPU limits included).
    #[arg(long, env = "SERVING_THREADS", value_parser = serving_threads)]
    pub(crate) serving_threads: Option<NonZeroUsize>,
    /// Deadline of one Redis call, in milliseconds. Default 20, or
    /// REDIS_TIMEOUT when that is set.
    #[arg(long, env = "REDIS_TIMEOUT_MS")]
    pub(crate) redis_timeout_ms: Option<u64>,
    /// Call the limiter by `EVALSHA` only, never as a Redis function
    /// (`FCALL`): for proxies or managed Redis that pass scripts but not
    /// functions. (Without it, Redis before 7.0 is detected and gets scripts.)
    #[arg(long, env = "REDIS_SCRIPTS_ONLY", value_parser = BoolishValueParser::new())]
    pub(crate) redis_scripts_only: bool,
    /// Deadline for connecting to Redis, in milliseconds. Default 1000, or
    /// REDIS_TIMEOUT when that is set.
    #[arg(long, env = "REDIS_CONNECT_TIMEOUT_MS")]
    pub(crate) redis_connect_timeout_ms: Option<u64>,
    /// Prefix of every counter key.
    #[arg(long, env = "CACHE_KEY_PREFIX", default_value = keys::DEFAULT_PREFIX)]
    pub(crate) key_prefix: String,
    /// Add RateLimit-* / Retry-After response headers (domains can override
    /// with `response_headers:` in their limits file).
    #[arg(long, env = "LIMIT_RESPONSE_HEADERS_ENABLED", value_parser = BoolishValueParser::new())]
    pub(crate) response_headers: bool,
    /// Name of the limit header.
    #[arg(long, env = "LIMIT_LIMIT_HEADER", default_value = "RateLimit-Limit")]
    pub(crate) header_limit: String,
    /// Name of the remaining header.
    #[arg(
        long,
        env = "LIMIT_REMAINING_HEADER",
        default_value = "RateLimit-Remaining"
    )]
    pub(crate) header_remaining: String,
    /// Name of the reset header (seconds).
    #[arg(long, env = "LIMIT_RESET_HEADER", default_value = "RateLimit-Reset")]
    pub(crate) header_reset: String,
    /// Name of the retry header, sent when over the limit (seconds).
    #[arg(long, env = "LIMIT_RETRY_AFTER_HEADER", default_value = "Retry-After")]
    pub(crate) header_retry_after: String,
    /// How often the limits directory is checked for changes, in milliseconds.
    #[arg(long, env = "RELOAD_INTERVAL_MS", default_value_t = 1_000)]
    pub(crate) reload_interval_ms: u64,
    /// On SIGTERM, how long open connections may drain, in milliseconds.
    #[arg(long, env = "SHUTDOWN_GRACE_MS", default_value_t = 5_000)]
    pub(crate) shutdown_grace_ms: u64,
    /// PEM certificate chain for gRPC over TLS (reloaded when it changes).
    /// Also read from GRPC_SERVER_TLS_CERT (with GRPC_SERVER_USE_TLS=true).
    #[arg(long, env = "GRPC_TLS_CERT")]
    pub(crate) grpc_tls_cert: Option<PathBuf>,
    /// PEM private key for gRPC over TLS. Never logged. Also read from
    /// GRPC_SERVER_TLS_KEY.
    #[arg(long, env = "GRPC_TLS_KEY")]
    pub(crate) grpc_tls_key: Option<PathBuf>,
    /// PEM CA: require client certificates signed by it (mutual TLS). Also
    /// read from GRPC_CLIENT_TLS_CACERT.
    #[arg(long, env = "GRPC_TLS_CLIENT_CA")]
    pub(crate) grpc_tls_client_ca: Option<PathBuf>,
    /// Time a client has to send the HTTP/2 preface after connecting, in ms;
    /// also how long an HTTP/1 connection (/healthcheck, /json, /metrics)
    /// may stay silent.
    #[arg(long, env = "HANDSHAKE_TIMEOUT_MS", default_value_t = 10_000)]
    pub(crate) handshake_timeout_ms: u64,
    /// Send client connections this old an HTTP/2 GOAWAY (Go syntax, e.g.
    /// `1h30m`), so clients rebalance across replicas (envoyproxy/ratelimit's
    /// default); 0: never, as grpc-go reads it.
    #[arg(long, env = "GRPC_MAX_CONNECTION_AGE", value_parser = crate::parse::duration, default_value = "24h")]
    pub(crate) max_connection_age: Duration,
    /// Time a connection past its maximum age gets to finish its calls;
    /// then it is closed. 0: never closed, as grpc-go reads it.
    #[arg(long, env = "GRPC_MAX_CONNECTION_AGE_GRACE", value_parser = crate::parse::duration, default_value = "1h")]
    pub(crate) max_connection_age_grace: Duration,
    /// Log filter: `error`, `warn` (or `warning`), `info`, `debug`,
    /// `trace` in any case (`fatal`, `panic`: `error`), or a directive.
    #[arg(long, env = "LOG_LEVEL", default_value = "info")]
    pub(crate) log_level: String,
    /// Log format: `json` (any case), else text.
    #[arg(long, env = "LOG_FORMAT", default_value = "text")]
    pub(crate) log_format: String,
    /// envoyproxy/ratelimit's settings: limits over xDS, gRPC TLS names,
    /// GRPC_HOST/PORT/UDS, RUNTIME_*, BACKEND_TYPE, Redis extras.
    #[command(flatten)]
    pub(crate) envoy: EnvoySettings,
    #[command(flatten)]
    pub(crate) per_second: PerSecondArgs,
    #[command(flatten)]
    pub(crate) stats: StatsSettings,
    #[command(flatten)]
    pub(crate) envoy_modes: EnvoyModes,
    #[command(flatten)]
    pub(crate) tracing: TracingArgs,
    // Hidden, not settings of the server: the bench/ scripts that time or
    // count the limiter alone in Redis (redis-benchmark, callgrind) take it
    // from here, as this build loads it.
    /// Write the limiter's Redis function library (`FUNCTION LOAD` text; its
    /// function has the library's name, on the first line) and exit.
    #[arg(long, hide = true)]
    pub(crate) write_limiter_library: Option<PathBuf>,
    /// Write the limiter as the script sent by `EVALSHA` (`SCRIPT LOAD`
    /// text) and exit.
    #[arg(long, hide = true)]
    pub(crate) write_limiter_script: Option<PathBuf>,
}

/// The admin API's flags (see README "Operations").
#[derive(Debug, clap::Args)]
pub(crate) struct AdminFlags {
    /// Admin API listen address (inspect and reset counters, leases, the
    /// config: see README "Operations"), or `off`. Default: this host only.
    /// A non-loopback address needs --admin-token-file or
    /// --admin-tls-client-ca.
    #[arg(long = "admin-addr", env = "ADMIN_ADDR")]
    pub(crate) addr: Option<String>,
    /// File holding the admin API's bearer token (a mounted Secret; read at
    /// each request, so rotating it needs no restart).
    #[arg(long = "admin-token-file", env = "ADMIN_TOKEN_FILE")]
    pub(crate) token_file: Option<PathBuf>,
    /// PEM certificate chain: serve the admin API over TLS (re-read when it
    /// changes).
    #[arg(long = "admin-tls-cert", env = "ADMIN_TLS_CERT", requires = "tls_key")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// PEM private key for the admin API's TLS. Never logged.
    #[arg(long = "admin-tls-key", env = "ADMIN_TLS_KEY", requires = "tls_cert")]
    pub(crate) tls_key: Option<PathBuf>,
    /// PEM CA: the admin API requires client certificates signed by it
    /// (mutual TLS, which guards it as a token does).
    #[arg(
        long = "admin-tls-client-ca",
        env = "ADMIN_TLS_CLIENT_CA",
        requires = "tls_cert"
    )]
    pub(crate) tls_client_ca: Option<PathBuf>,
}

/// What to do instead of serving.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
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
pub(crate) enum FailureModeArg {
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
pub(crate) fn log_filter(level: &str) -> Result<String> {
    if let Some(level) = tracing_level(level) {
        // Theirs logs only its own lines at debug; h2's and hyper's would
        // be a dozen a call (frames, window updates), so the libraries
        // stay at info unless a directive names them.
        return Ok(match level {
            "debug" | "trace" => format!("info,ratekeeper={level}"),
            _ => level.into(),
        });
    }
    // tracing's directives: a default level and `target=level`s, any
    // order (`warn,ratekeeper=debug`), their levels named as above.
    let directive = |d: &str| match d.split_once('=') {
        Some((target, level)) => {
            let target_ok = !target.is_empty()
                && target
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_:".contains(c));
            tracing_level(level)
                .filter(|_| target_ok)
                .map(|level| format!("{target}={level}"))
        }
        None => tracing_level(d).map(str::to_owned),
    };
    match level.split(',').map(directive).collect::<Option<Vec<_>>>() {
        Some(directives) => Ok(directives.join(",")),
        None => Err(Error::Startup(format!(
            "LOG_LEVEL {level:?} is not a level: expected error, warn, info, debug or trace \
             (or tracing directives such as warn,ratekeeper=debug)"
        ))),
    }
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
pub(crate) fn log_format(format: &str) -> LogFormat {
    if format.eq_ignore_ascii_case("json") {
        LogFormat::Json
    } else {
        LogFormat::Text
    }
}

/// SERVING_THREADS for clap: 1 to 1024.
pub(crate) fn serving_threads(text: &str) -> std::result::Result<NonZeroUsize, String> {
    let n = redis_settings::at_most_1024(text)?;
    NonZeroUsize::new(n).ok_or_else(|| "0: at least one thread serves (1 to 1024)".to_owned())
}

#[cfg(test)]
mod tests {
    use super::log_filter;

    /// A logrus level, or tracing's directives: a default level and
    /// `target=level`s in any order, each level named as logrus or tracing
    /// names it.
    #[test]
    fn log_level_takes_a_level_or_tracing_directives() {
        for (given, filter) in [
            ("WARNING", "warn"),
            ("debug", "info,ratekeeper=debug"),
            ("warn,ratekeeper=debug", "warn,ratekeeper=debug"),
            ("ratekeeper=debug,warning", "ratekeeper=debug,warn"),
            ("info,h2=warn", "info,h2=warn"),
            ("h2=Warning", "h2=warn"),
        ] {
            assert_eq!(log_filter(given).ok().as_deref(), Some(filter), "{given}");
        }
        for bad in ["warnn", "warn ", "h2=loud", "=warn", "info,", "a.b=warn"] {
            assert!(log_filter(bad).is_err(), "{bad}");
        }
    }
}
