//! The `ratekeeper` binary: flags and environment in, a running server out.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use ratekeeper::clock::SystemClock;
use ratekeeper::config::watch::{fingerprint, record_load, SharedConfig, Watched};
use ratekeeper::config::xds_client::XdsSettings;
use ratekeeper::config::{Config, LimitsDir, LoadOptions};
use ratekeeper::headers::{HeaderNames, HeaderSettings};
use ratekeeper::keys::Values;
use ratekeeper::server::{ConnectionLimits, Server};
use ratekeeper::service::rls::LimiterSettings;
use ratekeeper::store::{MemoryStore, Role, Store, Stores};
use ratekeeper::telemetry::{self, LogFormat};
use ratekeeper::{Error, Result};

mod admin_cli;
mod cli;
mod envoy_settings;
mod listen;
mod otel_settings;
mod parse;
mod redis_settings;
mod settings_compat;
mod stats_settings;

use cli::{log_filter, log_format, Cli, Command};
use envoy_settings::{ConfigType, EnvoySettings};
use listen::{
    announce, bind_grpc, bind_http, grpc_tls, http_listeners, metrics_addr, serve_metrics,
};
use redis_settings::Redis;

// Every request allocates (HTTP/2 frames, protobuf, keys): see BENCHMARKS.md.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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

/// The shortest time between two looks at the limits and TLS files: each
/// reads every file.
const MIN_RELOAD_INTERVAL_MS: u64 = 50;

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
    if cli.reload_interval_ms < MIN_RELOAD_INTERVAL_MS {
        tracing::warn!(
            asked = cli.reload_interval_ms,
            "RELOAD_INTERVAL_MS below {MIN_RELOAD_INTERVAL_MS}: files are looked at every {MIN_RELOAD_INTERVAL_MS} ms"
        );
    }
    let reload_interval = Duration::from_millis(cli.reload_interval_ms.max(MIN_RELOAD_INTERVAL_MS));
    let tls = grpc_tls(&cli, reload_interval)?;
    let grpc = bind_grpc(&cli).await?;
    let metrics_addr = serve_metrics(&cli, metrics)?;
    let http = http_listeners(&cli, reload_interval).await?;
    announce(&grpc, &metrics_addr, &http, log_format == LogFormat::Json)?;

    let served = Server {
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
    .await;
    // As Go's listener does on close (theirs): a sidecar that waits for
    // the socket to go sees the server gone.
    if let Some(path) = &cli.envoy.grpc_uds {
        let _ = std::fs::remove_file(path);
    }
    served
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
        ConfigType::GrpcXdsSotw => {
            if let Some(dir) = &cli.config_dir {
                // A chart or manifest that mounts limits files and sets
                // CONFIG_TYPE too: say which one counts.
                tracing::warn!(dir = %dir.display(), "CONFIG_TYPE=GRPC_XDS_SOTW: the limits come over xDS; CONFIG_DIR is not read");
            }
            Ok((subscribe_xds(&cli.envoy, load_options).await?, None))
        }
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
    if cert.is_some() != key.is_some() {
        tracing::warn!("REDIS_TLS_CLIENT_CERT and REDIS_TLS_CLIENT_KEY go together: one alone is ignored (as envoyproxy/ratelimit)");
    }
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
    match (flag_ms, parse::or_default(envoy.redis_timeout)) {
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
