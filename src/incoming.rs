//! Accepted gRPC connections, each with a deadline for the HTTP/2 preface:
//! a client that connects and then sends nothing (or dribbles bytes, the
//! slowloris attack) is cut after `handshake_timeout` instead of holding a
//! socket and a task forever. Once the preface is in, HTTP/2 keepalive pings
//! (see `server`) take over the detection of stuck peers.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Bytes of the HTTP/2 client preface (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`).
const PREFACE_BYTES: usize = 24;

/// A connection that must deliver its first bytes in time.
pub struct Deadlined {
    inner: TcpStream,
    /// Running until the preface has arrived.
    deadline: Option<Pin<Box<Sleep>>>,
    received: usize,
}

impl Deadlined {
    fn new(inner: TcpStream, timeout: Duration) -> Self {
        Deadlined {
            inner,
            deadline: Some(Box::pin(tokio::time::sleep(timeout))),
            received: 0,
        }
    }
}

impl AsyncRead for Deadlined {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        let read = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Some(deadline) = &mut this.deadline {
            if let Poll::Ready(Ok(())) = read {
                this.received += buf.filled().len() - before;
                if this.received >= PREFACE_BYTES {
                    this.deadline = None;
                    return read;
                }
            }
            if deadline.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no HTTP/2 preface in time",
                )));
            }
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
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Connected for Deadlined {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.inner.connect_info()
    }
}

/// The listener's connections, each wrapped in a preface deadline.
pub fn incoming(
    listener: TcpListener,
    handshake_timeout: Duration,
) -> impl Stream<Item = io::Result<Deadlined>> {
    futures_util::stream::unfold(listener, move |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| {
            let _ = stream.set_nodelay(true);
            Deadlined::new(stream, handshake_timeout)
        });
        Some((accepted, listener))
    })
}
