//! A call's `grpc-timeout` answered as grpc-go (envoyproxy/ratelimit's
//! server) answers it: `DEADLINE_EXCEEDED`. tonic's own timeout answers
//! `CANCELLED` ("Timeout expired"), which clients take for a call they
//! cancelled themselves: the Python client failed open on
//! `DEADLINE_EXCEEDED` but raised on that, and did not retry a settle.
//! This layer runs inside tonic's and ends the call a little sooner, so
//! that its answer is the one sent.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::body::Body;
use tonic::codegen::http::{HeaderMap, Request, Response};
use tonic::codegen::Service;

/// How much sooner than tonic's timer this layer's fires: within one
/// tick of tokio's timer wheel, tonic's (started first) could win.
const AHEAD: Duration = Duration::from_millis(2);

/// The layer for [`tonic::transport::Server::layer`].
#[derive(Debug, Clone, Copy, Default)]
pub struct DeadlineLayer;

impl<S> tower_layer::Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Deadline<S> {
        Deadline { inner }
    }
}

/// Ends a call whose `grpc-timeout` passes before its response starts
/// with `DEADLINE_EXCEEDED`.
#[derive(Debug, Clone)]
pub struct Deadline<S> {
    inner: S,
}

impl<S, B> Service<Request<B>> for Deadline<S>
where
    S: Service<Request<B>, Response = Response<Body>>,
    S::Future: Send + 'static,
    S::Error: 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let timeout = grpc_timeout(request.headers());
        let call = self.inner.call(request);
        Box::pin(async move {
            let Some(timeout) = timeout else {
                return call.await;
            };
            match tokio::time::timeout(timeout.saturating_sub(AHEAD), call).await {
                Ok(answered) => answered,
                Err(_) => Ok(
                    tonic::Status::deadline_exceeded("context deadline exceeded")
                        .into_http::<Body>(),
                ),
            }
        })
    }
}

/// A request's `grpc-timeout`: up to eight digits and a unit (`H`, `M`,
/// `S`, `m`, `u`, `n`); `None` when absent or malformed (tonic's timer,
/// which reads it too, then judges alone).
fn grpc_timeout(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_are_read_in_their_units() {
        let read = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert("grpc-timeout", value.parse().expect("header value"));
            grpc_timeout(&headers)
        };
        assert_eq!(read("200m"), Some(Duration::from_millis(200)));
        assert_eq!(
            read("99999999H"),
            Some(Duration::from_secs(99_999_999 * 3600))
        );
        assert_eq!(read("3S"), Some(Duration::from_secs(3)));
        assert_eq!(read("7u"), Some(Duration::from_micros(7)));
        for bad in ["", "m", "100", "123456789m", "1x", "-1m", "1.5S"] {
            assert_eq!(read(bad), None, "{bad:?}");
        }
        assert_eq!(grpc_timeout(&HeaderMap::new()), None);
    }
}
