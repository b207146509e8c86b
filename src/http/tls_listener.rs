//! An HTTP listener behind TLS (the admin API's mutual TLS): connections are
//! accepted as by [`super::serve`], and each handshake runs in a task of its
//! own within the idle timeout, so a client that stalls its handshake holds
//! up no one else. Each handshake uses the certificate current at that
//! moment ([`ReloadingTls`]).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;

use super::answering::Connections;
use super::idle::Idle;
use super::Peer;
use crate::incoming;
use crate::tls::ReloadingTls;

/// Serves `router` over TLS on `listener` until `shutdown` resolves.
pub async fn serve_tls(
    listener: TcpListener,
    idle: Duration,
    tls: ReloadingTls,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let local = listener.local_addr();
    let (tx, handshaken) = mpsc::channel(64);
    let accepting = tokio::spawn(accept_forever(listener, idle, tls, tx));
    let listener = TlsListener { handshaken, local };
    let served = axum::serve(listener, Connections::new(router))
        .with_graceful_shutdown(shutdown)
        .await;
    accepting.abort();
    if let Err(error) = served {
        tracing::error!(%error, "HTTPS server stopped");
    }
}

async fn accept_forever(
    listener: TcpListener,
    idle: Duration,
    tls: ReloadingTls,
    tx: mpsc::Sender<(TlsStream<Idle>, SocketAddr)>,
) {
    loop {
        let (stream, peer) = incoming::accept(&listener).await;
        let (tx, acceptor) = (tx.clone(), tls.acceptor());
        tokio::spawn(async move {
            let handshake = acceptor.accept(Idle::new(stream, idle));
            match tokio::time::timeout(idle, handshake).await {
                Ok(Ok(stream)) => {
                    let _ = tx.send((stream, peer)).await;
                }
                Ok(Err(error)) => crate::tls::handshake_failed(&error, Some(peer)),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            }
        });
    }
}

/// The handshaken connections, as axum takes them.
struct TlsListener {
    handshaken: mpsc::Receiver<(TlsStream<Idle>, SocketAddr)>,
    local: io::Result<SocketAddr>,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<Idle>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, SocketAddr) {
        match self.handshaken.recv().await {
            Some(accepted) => accepted,
            // The accept loop only ends when the server does.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        match &self.local {
            Ok(addr) => Ok(*addr),
            Err(error) => Err(io::Error::new(error.kind(), error.to_string())),
        }
    }
}

impl Connected<IncomingStream<'_, TlsListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, TlsListener>) -> Self {
        Peer::of(*stream.remote_addr(), stream.io().get_ref().0)
    }
}
