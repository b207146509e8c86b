//! HTTP/1 connections that go silent are closed: a client that connects
//! and sends nothing (or stops half-way) would otherwise hold a socket and
//! a task for good, and enough of them exhaust the file descriptors. The
//! clock restarts with every byte read or written, and does not run out
//! while a request is being answered ([`InFlight`]: its body in, its
//! response not yet made): the silence is then the server's, as when
//! `/json` waits on a Redis slower than the idle timeout. Between requests
//! (a response written, nothing of the next read yet) a kept-alive
//! connection waits [`KEEP_ALIVE_IDLE`] instead: clients and load
//! balancers pool connections for longer than a handshake's timeout, and
//! one closed under them fails the request they send on it.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

/// How long a kept-alive HTTP/1 connection may wait between requests:
/// longer than load balancers' idle timeouts (AWS's 60 s, Google Cloud's
/// 600 s), so that they close it first, as they expect of a backend.
/// envoyproxy/ratelimit's server never closes one.
pub const KEEP_ALIVE_IDLE: Duration = Duration::from_secs(3600);

/// An accepted connection that fails its pending read once it has been
/// idle for `timeout` with no request of it being answered
/// ([`KEEP_ALIVE_IDLE`] between requests).
pub struct Idle {
    inner: TcpStream,
    timeout: Duration,
    deadline: Pin<Box<Sleep>>,
    in_flight: InFlight,
}

impl Idle {
    pub fn new(inner: TcpStream, timeout: Duration) -> Self {
        Idle {
            inner,
            timeout,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            in_flight: InFlight::default(),
        }
    }

    /// The count of this connection's requests being answered.
    pub fn in_flight(&self) -> InFlight {
        self.in_flight.clone()
    }

    fn active(&mut self, wait: Duration) {
        let next = Instant::now() + wait;
        self.deadline.as_mut().reset(next);
    }
}

impl AsyncRead for Idle {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            // Answering: the response, once written, restarts the clock.
            Poll::Pending if this.in_flight.any() => Poll::Pending,
            Poll::Pending if this.deadline.as_mut().poll(cx).is_ready() => Poll::Ready(Err(
                io::Error::new(io::ErrorKind::TimedOut, "HTTP connection idle"),
            )),
            Poll::Pending => Poll::Pending,
            ready => {
                this.in_flight.client_spoke();
                this.active(this.timeout);
                ready
            }
        }
    }
}

impl AsyncWrite for Idle {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write(cx, data);
        if written.is_ready() {
            // A response (or its part) is out: once one is answered and
            // until the client sends again, it is between requests.
            let wait = match self.in_flight.between_requests() {
                true => KEEP_ALIVE_IDLE,
                false => self.timeout,
            };
            self.active(wait);
        }
        written
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// How many of a connection's requests are being answered (their bodies
/// in, their responses not yet made), and whether one was answered since
/// the client last sent a byte; shared by its [`Idle`] and the connection's
/// service (`super::answering`, through [`super::Peer`]).
#[derive(Debug, Clone, Default)]
pub struct InFlight(Arc<(AtomicUsize, AtomicBool)>);

impl InFlight {
    /// One more request being answered.
    pub fn add(&self) {
        self.0 .0.fetch_add(1, Ordering::AcqRel);
    }

    /// One fewer (after an [`Self::add`]): its response is made.
    pub fn sub(&self) {
        self.0 .1.store(true, Ordering::Release);
        self.0 .0.fetch_sub(1, Ordering::AcqRel);
    }

    fn any(&self) -> bool {
        self.0 .0.load(Ordering::Acquire) > 0
    }

    /// Whether the connection is between requests: none being answered,
    /// and one answered since the client last sent (not an interim
    /// `100 Continue` before a body that never comes).
    fn between_requests(&self) -> bool {
        !self.any() && self.0 .1.load(Ordering::Acquire)
    }

    /// The client sent a byte (of a next request, or of this one's body).
    fn client_spoke(&self) {
        self.0 .1.store(false, Ordering::Release);
    }
}
