//! What the gRPC port answers an HTTP/2 request that is not a gRPC call,
//! as grpc-go (envoyproxy/ratelimit's server) answers it: a content type
//! other than `application/grpc` (alone, or followed by `+subtype` or
//! `;parameters`, case as written) gets HTTP 415, then a method other than
//! POST HTTP 405, each with the gRPC status and message grpc-go sends.
//! Without it tonic took such a request for a call: a JSON POST failed
//! decoding as INTERNAL, a GET got UNIMPLEMENTED under HTTP 200 (an HTTP/2
//! client took that for success), and both counted as the service's own
//! errors. (HTTP/1 never reaches here: the port speaks HTTP/2 only.)

use std::future::{ready, Ready};
use std::task::{Context, Poll};

use futures_util::future::Either;
use tonic::body::Body;
use tonic::codegen::http::{header, HeaderValue, Method, Request, Response, StatusCode};
use tonic::codegen::Service;
use tonic::Code;

/// The layer for [`tonic::transport::Server::layer`].
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcOnlyLayer;

impl<S> tower_layer::Layer<S> for GrpcOnlyLayer {
    type Service = GrpcOnly<S>;

    fn layer(&self, inner: S) -> GrpcOnly<S> {
        GrpcOnly { inner }
    }
}

/// Passes gRPC calls to `inner`, answers anything else itself.
#[derive(Debug, Clone)]
pub struct GrpcOnly<S> {
    inner: S,
}

impl<S, B> Service<Request<B>> for GrpcOnly<S>
where
    S: Service<Request<B>, Response = Response<Body>>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Either<Ready<Result<Response<Body>, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        match refusal(
            request.method(),
            request.headers().get(header::CONTENT_TYPE),
        ) {
            Some(response) => Either::Left(ready(Ok(response))),
            None => Either::Right(self.inner.call(request)),
        }
    }
}

/// The answer to a request that is not a gRPC call; `None` for a call.
fn refusal(method: &Method, content_type: Option<&HeaderValue>) -> Option<Response<Body>> {
    let bytes = content_type.map_or(&b""[..], HeaderValue::as_bytes);
    if !is_grpc(bytes) {
        let text = String::from_utf8_lossy(bytes);
        return Some(answer(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Code::InvalidArgument,
            &format!("invalid gRPC request content-type {text:?}"),
        ));
    }
    if method != Method::POST {
        let method = method.as_str();
        return Some(answer(
            StatusCode::METHOD_NOT_ALLOWED,
            Code::Internal,
            &format!("Received a HEADERS frame with :method {method:?} which should be POST"),
        ));
    }
    None
}

/// `application/grpc`, alone or followed by `+subtype` or `;parameters`,
/// as written (grpc-go's `grpcutil.ContentSubtype`).
fn is_grpc(content_type: &[u8]) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    content_type.starts_with(GRPC)
        && matches!(content_type.get(GRPC.len()), None | Some(b'+' | b';'))
}

/// A trailers-only gRPC error under HTTP `status`, as grpc-go writes one.
fn answer(status: StatusCode, code: Code, message: &str) -> Response<Body> {
    let mut response = tonic::Status::new(code, message).into_http::<Body>();
    *response.status_mut() = status;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_content_types_are_told_from_others() {
        for grpc in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc;charset=utf-8",
        ] {
            assert!(is_grpc(grpc.as_bytes()), "{grpc}");
        }
        for other in [
            "",
            "application/json",
            "application/grpcx",
            "application/grp",
            "Application/GRPC",
            "é",
        ] {
            assert!(!is_grpc(other.as_bytes()), "{other}");
        }
    }

    #[test]
    fn a_get_is_405_and_a_json_post_415_with_grpc_statuses() {
        let json = HeaderValue::from_static("application/json");
        let grpc = HeaderValue::from_static("application/grpc");
        let get = refusal(&Method::GET, Some(&grpc)).expect("refused");
        assert_eq!(get.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(get.headers()["grpc-status"], "13");
        // The content type is judged first, as grpc-go judges it.
        let bare_get = refusal(&Method::GET, None).expect("refused");
        assert_eq!(bare_get.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
        let post = refusal(&Method::POST, Some(&json)).expect("refused");
        assert_eq!(post.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(post.headers()["grpc-status"], "3");
        assert_eq!(post.headers()[header::CONTENT_TYPE], "application/grpc");
        assert!(refusal(&Method::POST, Some(&grpc)).is_none());
    }
}
