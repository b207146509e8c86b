//! Accepted gRPC connections, each with a deadline for the HTTP/2 preface
//! (`preface`): a client that connects and then sends nothing (or dribbles
//! bytes, the slowloris attack) is cut after `handshake_timeout` instead of
//! holding a socket and a task forever. Once the preface is in, HTTP/2
//! keepalive pings (see `server`) take over the detection of stuck peers.
//! With TLS the handshake happens here too, off the accept loop. One task accepts and
//! deals the connections to the serving lanes (see `lanes`); its
//! [`accept`], which pauses after a failed accept, serves the HTTP
//! listeners too (`http`). gRPC may also listen on a Unix socket
//! (envoyproxy/ratelimit's `GRPC_UDS`): its connections take the same path.
//!
//! The end of `GRPC_MAX_CONNECTION_AGE_GRACE` is enforced here too: tonic
//! sends the GOAWAY at the maximum age, but given a grace as well it sends
//! none and only drops the connection at age + grace (tonic 0.14's
//! `connection_timeout_future`). So tonic gets the age alone, and each
//! connection's reads and writes fail once age + grace has passed, which
//! closes it (see [`Deadlined::close_after`]).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::time::Sleep;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::authority::AuthorityFixed;
use crate::preface::Prefaced;
use crate::tls::ReloadingTls;

/// Bytes of the HTTP/2 client preface (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`).
const PREFACE_BYTES: usize = 24;

/// Where gRPC listens: TCP, or a Unix socket.
#[derive(Debug)]
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl From<TcpListener> for Listener {
    fn from(listener: TcpListener) -> Self {
        Listener::Tcp(listener)
    }
}

impl Listener {
    /// The address, for logs: `host:port`, or `unix:PATH`.
    pub fn describe(&self) -> io::Result<String> {
        match self {
            Listener::Tcp(listener) => Ok(listener.local_addr()?.to_string()),
            Listener::Unix(listener) => {
                let addr = listener.local_addr()?;
                let path = addr.as_pathname().map(|p| p.display().to_string());
                Ok(format!("unix:{}", path.unwrap_or_default()))
            }
        }
    }

    /// The next connection, as a std socket (see [`deal`]), with Nagle off
    /// on TCP.
    async fn accept_std(&self) -> io::Result<StdSocket> {
        match self {
            Listener::Tcp(listener) => {
                let (stream, _) = accept(listener).await;
                let _ = stream.set_nodelay(true);
                stream.into_std().map(StdSocket::Tcp)
            }
            Listener::Unix(listener) => loop {
                match listener.accept().await {
                    Ok((stream, _)) => return stream.into_std().map(StdSocket::Unix),
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(ACCEPT_BACK_OFF).await;
                    }
                }
            },
        }
    }
}

/// An accepted socket between the accepting task and its lane.
enum StdSocket {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

/// An accepted socket, registered with its lane's runtime.
enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    fn from_std(socket: StdSocket) -> io::Result<Socket> {
        match socket {
            StdSocket::Tcp(stream) => TcpStream::from_std(stream).map(Socket::Tcp),
            StdSocket::Unix(stream) => UnixStream::from_std(stream).map(Socket::Unix),
        }
    }

    /// The client's address, for the logs (none on a Unix socket).
    fn peer(&self) -> Option<std::net::SocketAddr> {
        match self {
            Socket::Tcp(stream) => stream.peer_addr().ok(),
            Socket::Unix(_) => None,
        }
    }
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Socket::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_write(cx, data),
            Socket::Unix(s) => Pin::new(s).poll_write(cx, data),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_flush(cx),
            Socket::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Socket::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// A connection that must deliver its first bytes in time, and that is
/// closed once past its maximum age and grace.
pub struct Deadlined {
    inner: Prefaced<Socket>,
    /// When reads and writes start failing (see [`Deadlined::close_after`]).
    closing: Option<Pin<Box<Sleep>>>,
    /// Counts the connection in its lane's load while it is open.
    _load: Load,
}

impl Deadlined {
    fn new(inner: Socket, timeout: Duration, load: Load) -> Self {
        Deadlined {
            inner: Prefaced::new(inner, timeout, PREFACE_BYTES, "no HTTP/2 preface in time"),
            closing: None,
            _load: load,
        }
    }

    /// Fails every read and write from `after` on (`None`: never), so that
    /// the server drops the connection, in-flight calls and all: the end of
    /// the grace after the maximum age, whose GOAWAY tonic sends. Set when
    /// the connection is handed to tonic, where its age starts.
    fn close_after(&mut self, after: Option<Duration>) {
        self.closing = after.map(|after| Box::pin(tokio::time::sleep(after)));
    }

    /// Whether the connection is past its end (a flag the timer sets: no
    /// waker, no cooperative budget spent on the request path).
    fn past_end(&self) -> bool {
        self.closing.as_ref().is_some_and(|end| end.is_elapsed())
    }

    /// [`Deadlined::past_end`], and if not, the caller's task is woken at
    /// the end, so a connection that waits for nothing ends too. Called
    /// when a read waits: once per wait, not once per read.
    fn past_end_or_wake(&mut self, cx: &mut Context<'_>) -> bool {
        self.closing
            .as_mut()
            .is_some_and(|end| end.as_mut().poll(cx).is_ready())
    }
}

/// The error reads and writes fail with once a connection is past its end.
fn past_end() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "connection past its maximum age and grace",
    )
}

/// One open connection in a lane's count of them; uncounted when dropped
/// (when the connection closes, however it ends).
pub struct Load(Arc<AtomicUsize>);

impl Load {
    fn new(count: &Arc<AtomicUsize>) -> Load {
        count.fetch_add(1, Ordering::Relaxed);
        Load(Arc::clone(count))
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An accepted socket on its way to a lane, already counted there.
pub struct Dealt {
    stream: StdSocket,
    load: Load,
}

impl AsyncRead for Deadlined {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.past_end() {
            return Poll::Ready(Err(past_end()));
        }
        let read = Pin::new(&mut this.inner).poll_read(cx, buf);
        if read.is_pending() && this.past_end_or_wake(cx) {
            return Poll::Ready(Err(past_end()));
        }
        read
    }
}

impl AsyncWrite for Deadlined {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.past_end() {
            return Poll::Ready(Err(past_end()));
        }
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.past_end() {
            return Poll::Ready(Err(past_end()));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Connected for Deadlined {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match self.inner.get_ref() {
            Socket::Tcp(stream) => stream.connect_info(),
            // No IP addresses on a Unix socket.
            Socket::Unix(_) => TcpConnectInfo {
                local_addr: None,
                remote_addr: None,
            },
        }
    }
}

/// An accepted connection as the gRPC server reads it: its `:authority`
/// values made acceptable to h2 ([`crate::authority`]: Istio's and
/// Contour's cluster names are not), over TLS or not.
pub type Accepted = AuthorityFixed<Transport>;

impl Connected for Accepted {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.get_ref().connect_info()
    }
}

/// An accepted connection, plain or TLS.
pub enum Transport {
    Plain(Deadlined),
    Tls(Box<tokio_rustls::server::TlsStream<Deadlined>>),
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_write(cx, data),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, data),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_flush(cx),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

impl Connected for Transport {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match self {
            Transport::Plain(s) => s.connect_info(),
            Transport::Tls(s) => s.get_ref().0.connect_info(),
        }
    }
}

/// Accepts connections and deals each to the lane with the fewest open
/// connections (`lanes[i]` feeds lane `i`; ties in turn), until every lane
/// has stopped taking them. Counting open connections rather than dealing
/// in turn keeps the lanes even when clients come and go: connections that
/// close free their lane's share for the next ones. They travel as std
/// sockets: a Tokio socket belongs to the runtime that registered it, and
/// each lane must register its own so that its reads wake its own thread.
pub async fn deal(listener: Listener, lanes: Vec<mpsc::Sender<Dealt>>) {
    let loads: Vec<Arc<AtomicUsize>> = lanes.iter().map(|_| Arc::default()).collect();
    let mut next = 0;
    loop {
        let stream = match listener.accept_std().await {
            Ok(stream) => stream,
            Err(error) => {
                tracing::warn!(%error, "cannot hand an accepted connection over");
                continue;
            }
        };
        let open: Vec<Option<usize>> = lanes
            .iter()
            .zip(&loads)
            .map(|(lane, load)| (!lane.is_closed()).then(|| load.load(Ordering::Relaxed)))
            .collect();
        let Some(lane) = least_loaded(&open, next) else {
            return; // every lane has stopped
        };
        next = lane + 1;
        let dealt = Dealt {
            stream,
            load: Load::new(&loads[lane]),
        };
        // A lane that stops meanwhile drops this connection, as a stopping
        // server does.
        let _ = lanes[lane].send(dealt).await;
    }
}

/// The next connection on `listener`. A failed accept (out of file
/// descriptors, EMFILE, most often) pauses before the next try: retrying at
/// once would spin a core while nothing frees one.
pub async fn accept(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(error) => {
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(ACCEPT_BACK_OFF).await;
            }
        }
    }
}

/// The pause after a failed accept.
const ACCEPT_BACK_OFF: Duration = Duration::from_millis(50);

/// The lane with the fewest open connections among those still serving
/// (`None`: stopped), the first such from `start` on (so ties go in turn).
fn least_loaded(open: &[Option<usize>], start: usize) -> Option<usize> {
    (0..open.len())
        .map(|i| (start + i) % open.len())
        .filter_map(|lane| open[lane].map(|load| (load, lane)))
        .min_by_key(|&(load, _)| load)
        .map(|(_, lane)| lane)
}

/// One lane's connections (dealt by [`deal`]), each with a preface
/// deadline; with `tls`, after a TLS handshake (done off the accept path,
/// within the same deadline, with the certificate current at that moment).
/// Each is closed `lifetime` after it is handed over (`None`: never; see
/// [`Deadlined::close_after`]). Call it on the lane's runtime: the sockets
/// are registered with it.
pub fn incoming(
    mut dealt: mpsc::Receiver<Dealt>,
    handshake_timeout: Duration,
    lifetime: Option<Duration>,
    tls: Option<ReloadingTls>,
) -> impl Stream<Item = io::Result<Accepted>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        while let Some(Dealt { stream, load }) = dealt.recv().await {
            let (mut stream, peer) = match Socket::from_std(stream) {
                Ok(stream) => {
                    let peer = stream.peer();
                    (Deadlined::new(stream, handshake_timeout, load), peer)
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot take an accepted connection");
                    continue;
                }
            };
            let Some(tls) = &tls else {
                stream.close_after(lifetime);
                if tx
                    .send(Ok(Accepted::new(Transport::Plain(stream))))
                    .await
                    .is_err()
                {
                    return;
                }
                continue;
            };
            let (tx, acceptor) = (tx.clone(), tls.acceptor());
            tokio::spawn(async move {
                match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                    Ok(Ok(mut stream)) => {
                        stream.get_mut().0.close_after(lifetime);
                        let _ = tx
                            .send(Ok(Accepted::new(Transport::Tls(Box::new(stream)))))
                            .await;
                    }
                    Ok(Err(error)) => crate::tls::handshake_failed(&error, peer),
                    Err(_) => tracing::debug!("TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::least_loaded;

    #[test]
    fn the_least_loaded_serving_lane_wins_and_ties_go_in_turn() {
        assert_eq!(least_loaded(&[Some(2), Some(1), Some(3)], 0), Some(1));
        // Ties: the first from `start` on.
        assert_eq!(least_loaded(&[Some(1), Some(1), Some(1)], 0), Some(0));
        assert_eq!(least_loaded(&[Some(1), Some(1), Some(1)], 2), Some(2));
        assert_eq!(least_loaded(&[Some(1), Some(1), Some(1)], 4), Some(1));
        // Stopped lanes are skipped, however idle.
        assert_eq!(least_loaded(&[None, Some(5), None], 0), Some(1));
        assert_eq!(least_loaded(&[None, None], 1), None);
        assert_eq!(least_loaded(&[], 0), None);
    }
}
