//! Rewrites the `:authority` values hyper's HTTP/2 server would refuse,
//! in the bytes a client sends, before the server reads them.
//!
//! h2 (the HTTP/2 implementation under hyper and tonic) resets a request's
//! stream with `PROTOCOL_ERROR` when its `:authority` pseudo-header is not
//! a valid URI authority (`http::uri::Authority::from_maybe_shared`);
//! grpc-go accepts any. An Envoy calling an `envoy_grpc` service without
//! an `authority` set sends the cluster's name there, and cluster names are
//! often not authorities: Istio's look like
//! `outbound|8081||ratelimit.default.svc.cluster.local`, Contour's like
//! `extension/projectcontour/ratelimit`. Every rate limit call from such
//! an Envoy would fail. h2 cannot be told otherwise, and ratekeeper never
//! looks at the authority, so [`AuthorityFixed`] rewrites the client's
//! byte stream instead: each `:authority` value h2 would refuse becomes a
//! valid one (the bytes that are not ASCII letters, digits, `.` or `-`
//! become `-`).
//!
//! Header blocks are HPACK-compressed against a dynamic table both ends
//! keep in step, so a rewrite must leave the server's table the same shape
//! as the client's: a rewritten field keeps its representation (indexed or
//! not) and its decoded length, so every table entry keeps its size and
//! position. A later indexed reference to a rewritten entry then yields
//! the fixed value too. Whatever the rewriter does not understand (not
//! HTTP/2, a malformed frame sequence, a HPACK error) turns it into a
//! plain pipe for the rest of the connection, and h2 judges the bytes
//! itself: since nothing was changed in a way that could desynchronise
//! the table, giving up is always safe.

use std::cell::RefCell;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use rewriter::Rewriter;

mod hpack;
mod huffman;
mod rewriter;
#[cfg(test)]
mod tests;

/// A header block h2 would refuse, or one the rewriter cannot follow: the
/// rewriter gives up and leaves the judgement to h2.
#[derive(Debug, PartialEq, Eq)]
struct Malformed;

/// How much is read from the connection at a time.
const READ_CHUNK: usize = 16 * 1024;

/// A server-side connection whose incoming `:authority` values are
/// rewritten where h2 would refuse them (see the module's documentation).
///
/// Writes (server to client) go straight to the inner connection; reads
/// (client to server) pass through a [`Rewriter`].
pub struct AuthorityFixed<T> {
    inner: T,
    rewriter: Rewriter,
    /// Rewritten bytes the reader's buffer could not take yet (rare: a
    /// read takes at most what that buffer has room for, but a header
    /// block released at once, or rewritten longer, may not fit).
    output: Vec<u8>,
    /// How much of `output` has been handed out.
    taken: usize,
}

thread_local! {
    /// The buffers every connection's reads on this thread go through (a
    /// read never yields while it uses them), so that a connection holds
    /// none between reads: tens of thousands of connections would
    /// otherwise keep 16 KiB or more each.
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch {
        input: vec![0; READ_CHUNK].into_boxed_slice(),
        output: Vec::new(),
    });
}

/// A read's input and its rewritten output.
struct Scratch {
    input: Box<[u8]>,
    output: Vec<u8>,
}

impl<T> AuthorityFixed<T> {
    /// Wraps the server's side of a freshly accepted connection, before
    /// any byte of it has been read.
    pub fn new(inner: T) -> Self {
        AuthorityFixed {
            inner,
            rewriter: Rewriter::new(),
            output: Vec::new(),
            taken: 0,
        }
    }

    /// The wrapped connection (for its addresses, its TLS session).
    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// Hands out as much pending output as `buf` takes.
    fn give(&mut self, buf: &mut ReadBuf<'_>) {
        let n = buf.remaining().min(self.output.len() - self.taken);
        buf.put_slice(&self.output[self.taken..self.taken + n]);
        self.taken += n;
        if self.taken == self.output.len() {
            self.output = Vec::new();
            self.taken = 0;
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for AuthorityFixed<T> {
    /// Reads at most what `buf` has room for from the connection, rewrites
    /// it, and hands the result out, keeping what does not fit for the
    /// next read. Once the rewriter has given up and its output is
    /// drained, reads go straight into `buf`.
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.taken < this.output.len() {
                this.give(buf);
                return Poll::Ready(Ok(()));
            }
            if this.rewriter.is_passthrough() {
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            if buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            let handed = SCRATCH.with(|scratch| {
                let Scratch { input, output } = &mut *scratch.borrow_mut();
                let room = buf.remaining().min(input.len());
                let mut chunk = ReadBuf::new(&mut input[..room]);
                ready!(Pin::new(&mut this.inner).poll_read(cx, &mut chunk))?;
                let n = chunk.filled().len();
                output.clear();
                if n == 0 {
                    // EOF: what was held back goes out as it came, then EOF.
                    this.rewriter.finish(output);
                } else {
                    // The rewriter may hold everything back (a header block
                    // still arriving): then read on.
                    this.rewriter.feed(&input[..n], output);
                }
                let fits = buf.remaining().min(output.len());
                buf.put_slice(&output[..fits]);
                this.output.extend_from_slice(&output[fits..]);
                Poll::Ready(Ok::<_, io::Error>(n == 0 || fits > 0))
            });
            if ready!(handed)? {
                return Poll::Ready(Ok(()));
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for AuthorityFixed<T> {
    /// Server to client: not rewritten.
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    /// Server to client: not rewritten.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    /// As the inner connection, so h2 keeps writing vectored if it can.
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    /// Server to client: not rewritten.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    /// Server to client: not rewritten.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
