//! Prometheus text at one path (`/metrics` unless `PROMETHEUS_PATH` says
//! otherwise) on the metrics listener: the recorder's series, then the
//! process's ([`super::process`]).

use std::time::Duration;

use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::{Error, Result};

/// The metrics route at `path` (refused unless a plain absolute path).
/// Also starts the task, running for good, that lets the exporter drop
/// stale histogram samples now and then.
pub fn router(path: &str, handle: PrometheusHandle) -> Result<Router> {
    // The router would read `{name}`, `*` and `:` as captures (or panic).
    if !path.starts_with('/') || path.contains(['{', '}', '*', ':']) {
        return Err(Error::Startup(format!(
            "metrics path {path:?}: must start with '/' and hold none of {{ }} * :"
        )));
    }
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    let render = move || async move {
        crate::their_stats::refresh();
        let mut text = handle.render();
        text.push_str(&super::process::render());
        (
            [(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
            text,
        )
    };
    Ok(Router::new().route(path, get(render)))
}
