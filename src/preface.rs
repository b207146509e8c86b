//! A deadline for the first bytes of an HTTP/2 connection: the peer's
//! preface must arrive in time, or reads fail and the connection closes.
//!
//! Both ends of ratekeeper's connections need it. The gRPC server
//! (`incoming`) cuts a client that connects and then sends nothing, or
//! dribbles bytes (the slowloris attack). The xDS client
//! (`config::xds_client`) drops a server that accepts the connection and
//! never speaks HTTP/2 (a wrong port, a stuck proxy): hyper's client
//! handshake does not wait for the server's preface, so the subscription
//! would wait for its first keepalive ping, minutes later, where grpc-go
//! gives up on a server without a preface within its connect deadline.
//! Once the preface is in, HTTP/2 keepalive pings watch the peer.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// A connection whose first `needed` bytes must arrive within a timeout.
pub struct Prefaced<T> {
    inner: T,
    /// Running until the preface has arrived.
    deadline: Option<Pin<Box<Sleep>>>,
    received: usize,
    needed: usize,
    /// The error's message when the deadline passes first.
    missing: &'static str,
}

impl<T> Prefaced<T> {
    /// `inner`, whose first `needed` bytes must be read within `timeout`
    /// from now; else reads fail with `TimedOut` and `missing`.
    pub fn new(inner: T, timeout: Duration, needed: usize, missing: &'static str) -> Self {
        Prefaced {
            inner,
            deadline: Some(Box::pin(tokio::time::sleep(timeout))),
            received: 0,
            needed,
            missing,
        }
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Prefaced<T> {
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
                if this.received >= this.needed {
                    this.deadline = None;
                    return read;
                }
            }
            if deadline.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, this.missing)));
            }
        }
        read
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Prefaced<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn reads_fail_when_the_preface_is_late_and_not_once_it_is_in() {
        let (near, mut far) = tokio::io::duplex(64);
        let mut late = Prefaced::new(near, Duration::from_millis(100), 9, "no preface");
        far.write_all(b"12345678").await.expect("write");
        let mut buf = [0u8; 64];
        assert_eq!(late.read(&mut buf).await.expect("8 bytes"), 8);
        let error = late.read(&mut buf).await.expect_err("late");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert_eq!(error.to_string(), "no preface");

        let (near, mut far) = tokio::io::duplex(64);
        let mut prompt = Prefaced::new(near, Duration::from_millis(100), 9, "no preface");
        far.write_all(b"123456789").await.expect("write");
        assert_eq!(prompt.read(&mut buf).await.expect("9 bytes"), 9);
        tokio::time::sleep(Duration::from_millis(200)).await;
        far.write_all(b"later").await.expect("write");
        assert_eq!(prompt.read(&mut buf).await.expect("past the deadline"), 5);
    }
}
