//! Logs (tracing) and metrics (Prometheus text on `GET /metrics`).
//!
//! The exporter's own HTTP listener cannot report the port it bound, so the
//! tiny HTTP/1.1 responder below serves the rendered text from a listener we
//! bind ourselves (port 0 works, which the tests rely on).

use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::{Error, Result};

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Installs the global tracing subscriber. `level` is an `EnvFilter`
/// directive such as `info` or `ratekeeper=debug`.
pub fn init_logging(level: &str, format: LogFormat) -> Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .map_err(|e| Error::Startup(format!("bad log level {level:?}: {e}")))?;
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    installed.map_err(|e| Error::Startup(format!("cannot install the logger: {e}")))
}

/// Installs the global Prometheus recorder. Call before the config is loaded:
/// rules register their counters against the recorder in place.
pub fn install_recorder() -> Result<PrometheusHandle> {
    const LATENCY_BUCKETS: &[f64] = &[
        0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
        1.0,
    ];
    PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("ratekeeper_request_duration_seconds".into()),
            LATENCY_BUCKETS,
        )
        .and_then(|b| b.install_recorder())
        .map_err(|e| Error::Startup(format!("cannot install the metrics recorder: {e}")))
}

/// Serves `GET /metrics` on `listener` until the task is dropped.
pub async fn serve_metrics(listener: TcpListener, handle: PrometheusHandle) {
    // Let the exporter drop stale histogram samples now and then.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(5), answer(stream, &handle)).await;
        });
    }
}

async fn answer(mut stream: TcpStream, handle: &PrometheusHandle) -> std::io::Result<()> {
    let mut request = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 16 * 1024 {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        request.extend_from_slice(&buf[..n]);
    }
    let line = request.split(|&b| b == b'\r').next().unwrap_or_default();
    let (status, body) = if line.starts_with(b"GET /metrics ") || line.starts_with(b"GET /metrics?")
    {
        ("200 OK", handle.render())
    } else {
        ("404 Not Found", "not found: try GET /metrics\n".to_owned())
    };
    let head = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}
