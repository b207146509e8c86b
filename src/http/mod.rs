//! The HTTP surface, on one HTTP/1.1 server (axum): the main listener
//! (`/healthcheck`, `/json`: [`api`]), the debug listener (`/rlconfig`:
//! [`rlconfig`]), the metrics listener ([`metrics`], with the process's
//! series: [`process`]) and the admin
//! listener ([`admin`], maybe over TLS: [`tls_listener`]). gRPC is served
//! elsewhere ([`crate::server`]).

pub mod admin;
pub mod answering;
pub mod api;
pub mod idle;
pub mod metrics;
pub mod process;
pub mod protojson;
pub mod rlconfig;
pub mod tls_listener;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::routing::any;
use axum::serve::IncomingStream;
use axum::Router;
use tokio::net::TcpListener;

use self::answering::Connections;
use self::idle::{Idle, InFlight};
use crate::config::watch::SharedConfig;
use crate::incoming;

/// The HTTP listeners a [`crate::server::Server`] serves besides gRPC
/// (bound by the caller, so port 0 works); `None` serves nothing there.
#[derive(Debug, Default)]
pub struct Listeners {
    /// `/healthcheck` and `/json` (envoyproxy/ratelimit's `HOST:PORT`).
    pub api: Option<TcpListener>,
    /// `/rlconfig` (their `DEBUG_HOST:DEBUG_PORT`).
    pub debug: Option<TcpListener>,
    /// The admin API ([`admin`]).
    pub admin: Option<admin::AdminListener>,
}

/// What handlers know of their HTTP connection (`ConnectInfo<Peer>`): who
/// called, for the ones that log it, and its requests being answered,
/// which hold its idle timer ([`answering`]).
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    in_flight: InFlight,
}

impl Peer {
    fn of(addr: SocketAddr, io: &Idle) -> Peer {
        Peer {
            addr,
            in_flight: io.in_flight(),
        }
    }
}

impl Connected<IncomingStream<'_, BackingOff>> for Peer {
    fn connect_info(stream: IncomingStream<'_, BackingOff>) -> Self {
        Peer::of(*stream.remote_addr(), stream.io())
    }
}

/// The routes of the debug listener.
pub fn debug_router(config: SharedConfig) -> Router {
    let dump = move || async move { rlconfig::dump(&config.current()) };
    // Any method, as theirs (a Go ServeMux handler) answers.
    Router::new().route("/rlconfig", any(dump))
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets the
/// requests in flight finish. A connection idle for `idle` is closed.
pub async fn serve(
    listener: TcpListener,
    idle: Duration,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let addr = listener.local_addr().ok();
    let served = axum::serve(BackingOff { listener, idle }, Connections::new(router))
        .with_graceful_shutdown(shutdown)
        .await;
    if let Err(error) = served {
        tracing::error!(?addr, %error, "HTTP server stopped");
    }
}

/// A listener whose failed accepts pause as gRPC's do
/// ([`incoming::accept`]), rather than axum's silent second, and whose
/// connections close when idle.
struct BackingOff {
    listener: TcpListener,
    idle: Duration,
}

impl axum::serve::Listener for BackingOff {
    type Io = Idle;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Idle, SocketAddr) {
        let (stream, peer) = incoming::accept(&self.listener).await;
        (Idle::new(stream, self.idle), peer)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}
