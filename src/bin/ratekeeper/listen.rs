//! The listeners: gRPC (TCP or a Unix socket, with its TLS), the HTTP ones
//! (API, debug, admin, metrics) at the addresses envoyproxy/ratelimit's
//! variables give, bound as Go binds them, and the readiness line that
//! names them.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use ratekeeper::http;
use ratekeeper::incoming::Listener;
use ratekeeper::tls::{ReloadingTls, TlsFiles};
use ratekeeper::{Error, Result};
use tokio::net::TcpListener;

use crate::cli::{AdminFlags, Cli};
use crate::{envoy_settings, read_file};

/// The gRPC listener: a Unix socket (`GRPC_UDS`) or TCP.
pub(crate) async fn bind_grpc(cli: &Cli) -> Result<Listener> {
    Ok(match &cli.envoy.grpc_uds {
        Some(path) => Listener::Unix(bind_unix(path)?),
        None => bind(&cli.envoy.grpc_addr(cli.grpc_addr), "gRPC")
            .await?
            .into(),
    })
}

/// gRPC's TLS files, reloaded when they change; `None`: plaintext.
pub(crate) fn grpc_tls(cli: &Cli, reload_interval: Duration) -> Result<Option<ReloadingTls>> {
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
pub(crate) fn serve_metrics(
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
pub(crate) async fn http_listeners(
    cli: &Cli,
    reload_interval: Duration,
) -> Result<http::Listeners> {
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
pub(crate) fn announce(
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

/// The metrics listener's address: METRICS_ADDR, or with USE_PROMETHEUS=true
/// PROMETHEUS_ADDR (envoyproxy/ratelimit's setting wins when asked for: it
/// is what their deployments scrape). There is one metrics listener.
pub(crate) fn metrics_addr(
    use_prometheus: bool,
    metrics: Option<&str>,
    prometheus: Option<&str>,
) -> String {
    if !use_prometheus {
        if let Some(ignored) = prometheus {
            tracing::warn!(%ignored, "PROMETHEUS_ADDR is only used with USE_PROMETHEUS=true");
        }
        return metrics.unwrap_or("0.0.0.0:9090").to_owned();
    }
    let addr = every_interface(prometheus.unwrap_or(":9090")).into_owned();
    if let Some(ignored) = metrics.filter(|m| *m != addr) {
        tracing::warn!(%ignored, used = %addr, "USE_PROMETHEUS=true: metrics listen on PROMETHEUS_ADDR, not METRICS_ADDR");
    }
    addr
}

/// A listener's address: `flag`, else `$host_var:$port_var` (defaults
/// `0.0.0.0` and `default_port`).
pub(crate) fn listen_addr(
    flag: Option<&str>,
    host_var: &str,
    port_var: &str,
    default_port: u16,
) -> String {
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
pub(crate) async fn bind_http(addr: &str, what: &str, fatal: bool) -> Result<Option<TcpListener>> {
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
pub(crate) async fn bind_admin(
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

/// Go's host-less `:PORT` (their settings' habit) as every interface's
/// address; any other address as it is.
fn every_interface(addr: &str) -> std::borrow::Cow<'_, str> {
    match addr.strip_prefix(':') {
        Some(port) => format!("0.0.0.0:{port}").into(),
        None => addr.into(),
    }
}

/// Listens on `addr` (a host-less `:PORT` on every interface). The
/// unspecified IPv4 address (the default hosts' `0.0.0.0`) listens on IPv6
/// too, as Go's `net.Listen("tcp", …)` does for envoyproxy/ratelimit, so an
/// IPv6-only or IPv6-first cluster reaches the pod: one dual-stack socket
/// on `[::]`, or IPv4 alone where the host has no IPv6.
pub(crate) async fn bind(addr: &str, what: &str) -> Result<TcpListener> {
    let addr = &*every_interface(addr);
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
pub(crate) fn dual_stack(port: u16) -> std::io::Result<TcpListener> {
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
pub(crate) fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener> {
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

pub(crate) fn local_addr(listener: &TcpListener) -> Result<SocketAddr> {
    listener.local_addr().map_err(|source| Error::Io {
        context: "listener address".into(),
        source,
    })
}
