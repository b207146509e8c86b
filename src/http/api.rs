//! The main HTTP listener (`HOST:PORT`): `GET /healthcheck` and
//! `POST /json`, envoyproxy/ratelimit's HTTP API.

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::Router;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;

use super::protojson;
use crate::health::Readiness;
use crate::service::{caps, RateLimiter};

/// Largest `/json` body parsed on the listener's runtime; a larger one is
/// parsed on the blocking pool.
const INLINE_PARSE_BYTES: usize = 64 * 1024;

/// What the handlers share.
#[derive(Clone)]
struct Api {
    limiter: RateLimiter,
    readiness: Readiness,
}

/// The routes of the main listener.
pub fn router(limiter: RateLimiter, readiness: Readiness) -> Router {
    Router::new()
        // Any method, as envoyproxy/ratelimit's routes take.
        .route("/healthcheck", any(healthcheck))
        .route("/json", any(json))
        // JSON spells a message out at a few times its protobuf size.
        .layer(DefaultBodyLimit::max(4 * caps::MAX_MESSAGE_BYTES))
        .with_state(Api { limiter, readiness })
}

/// 200 `OK` while ready (the same readiness as gRPC health), else 500.
async fn healthcheck(State(api): State<Api>) -> Response {
    if api.readiness.is_ready() {
        "OK".into_response()
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, "not ready\n").into_response()
    }
}

/// `ShouldRateLimit` with protojson in and out: 200 for OK, 429 for
/// OVER_LIMIT; 400 with the reason for a request that cannot be evaluated;
/// 500 when the service cannot answer (`failure_mode: unavailable`).
async fn json(State(api): State<Api>, headers: HeaderMap, body: Bytes) -> Response {
    let parsed = if body.len() <= INLINE_PARSE_BYTES {
        protojson::parse_request(&body)
    } else {
        // A large body takes long to parse (16 MiB: about a second): off
        // the runtime that also serves health, metrics and gRPC's accepts.
        tokio::task::spawn_blocking(move || protojson::parse_request(&body))
            .await
            .unwrap_or_else(|e| Err(format!("parsing stopped: {e}")))
    };
    let request = match parsed {
        Ok(request) => request,
        Err(reason) => return (StatusCode::BAD_REQUEST, reason).into_response(),
    };
    let headers = tonic::metadata::MetadataMap::from_headers(headers);
    let response = match api.limiter.decide_observed(&request, &headers).await {
        Ok(response) => response,
        Err(status) => {
            tracing::debug!(code = ?status.code(), message = status.message(), "JSON request refused");
            let code = match status.code() {
                tonic::Code::InvalidArgument => StatusCode::BAD_REQUEST,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            };
            return (code, status.message().to_owned()).into_response();
        }
    };
    let code = match Code::try_from(response.overall_code) {
        Ok(Code::Ok) => StatusCode::OK,
        Ok(Code::OverLimit) => StatusCode::TOO_MANY_REQUESTS,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let body = protojson::response_json(&response).to_string();
    (code, [(CONTENT_TYPE, "application/json")], body).into_response()
}
