//! The admin listener (`--admin-addr`): JSON for the person on call.
//!
//! - `GET /v1/descriptor?domain=D&entry=K=V&entry=K2=V2`: the rule the
//!   descriptor matches and each limit's state, read without consuming;
//! - `DELETE /v1/descriptor?…` (same query): reset its counters;
//! - `GET /v1/leases?domain=D&entry=K=V`: the live leases of a
//!   concurrency entity; `DELETE /v1/leases?…&lease=MEMBER`: revoke one;
//! - `GET /v1/config`: the limits in force, each domain with its file (or
//!   xDS resource), and the xDS snapshot's version.
//!
//! Entries come in the query, in order, each `key=value` (split at its
//! first `=`), so domains with `/` and any value pass. Every request needs
//! `Authorization: Bearer <token>` when a token file is set; the file is
//! read at each request, so a rotated Secret takes effect without a restart.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use axum::extract::{ConnectInfo, FromRequestParts, RawQuery, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::header::CONTENT_TYPE;
use axum::http::header::WWW_AUTHENTICATE;
use axum::http::request::Parts;
use axum::http::HeaderValue;
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};

use super::Peer;
use crate::config::watch::SharedConfig;
use crate::query::decode;
use crate::rules::Rule;
use crate::service::admin_leases::AdminLeases;
use crate::service::rls::AdminError;
use crate::service::RateLimiter;
use crate::tls::ReloadingTls;
use crate::{Error, Result};

/// The admin listener's default address: this host only.
pub const DEFAULT_ADDR: &str = "127.0.0.1:6071";

/// Header a client may send to name who acts, for the audit log (the CLI
/// sends `$USER`); the peer address is logged too.
pub const ACTOR_HEADER: &str = "x-ratekeeper-actor";

/// The admin listener and how it is guarded.
#[derive(Debug)]
pub struct AdminListener {
    pub listener: tokio::net::TcpListener,
    /// The bearer token's file.
    pub token_file: Option<PathBuf>,
    /// TLS (mutual when its files name a client CA).
    pub tls: Option<ReloadingTls>,
}

/// What the admin routes share.
#[derive(Clone)]
struct Admin {
    limiter: RateLimiter,
    leases: AdminLeases,
    config: SharedConfig,
    /// Where the limits come from: the directory, or `xds`.
    source: String,
    token_file: Option<PathBuf>,
}

/// Refuses a non-loopback admin address guarded by neither a token nor
/// mutual TLS: counters could be reset by anyone who reaches the port.
pub fn check_guard(addr: SocketAddr, token_file: Option<&Path>, mutual_tls: bool) -> Result<()> {
    if token_file.is_none() && !mutual_tls && !addr.ip().is_loopback() {
        return Err(Error::Startup(format!(
            "the admin API on {addr} (not loopback) needs --admin-token-file or mutual TLS (--admin-tls-client-ca)"
        )));
    }
    Ok(())
}

/// The admin routes.
pub fn router(
    limiter: RateLimiter,
    leases: AdminLeases,
    config: SharedConfig,
    source: String,
    token_file: Option<PathBuf>,
) -> Router {
    let admin = Admin {
        limiter,
        leases,
        config,
        source,
        token_file,
    };
    Router::new()
        .route("/v1/descriptor", get(inspect).delete(reset))
        .route("/v1/leases", get(list_leases).delete(revoke))
        .route("/v1/config", get(loaded_config))
        // Errors are JSON with a reason everywhere, as the CLI reads them.
        .fallback(|| async {
            failure(
                StatusCode::NOT_FOUND,
                "no such endpoint: /v1/descriptor, /v1/leases or /v1/config",
            )
        })
        .method_not_allowed_fallback(|| async {
            failure(StatusCode::METHOD_NOT_ALLOWED, "method not allowed here")
        })
        .layer(middleware::from_fn_with_state(admin.clone(), authorize))
        .with_state(admin)
}

/// 401 unless the bearer token matches the token file's (trimmed) text.
async fn authorize(State(admin): State<Admin>, request: Request, next: Next) -> Response {
    let Some(file) = &admin.token_file else {
        return next.run(request).await;
    };
    let expected = match tokio::fs::read_to_string(file).await {
        Ok(text) => text.trim().to_owned(),
        Err(error) => {
            tracing::error!(file = %file.display(), %error, "cannot read the admin token");
            return failure(StatusCode::SERVICE_UNAVAILABLE, "admin token unreadable");
        }
    };
    let given = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .unwrap_or("");
    if expected.is_empty() || !same(given.as_bytes(), expected.as_bytes()) {
        metrics::counter!("ratekeeper_admin_unauthorized").increment(1);
        let mut refused = failure(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
        // What RFC 6750 has a 401 say: the scheme it wants.
        refused
            .headers_mut()
            .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return refused;
    }
    next.run(request).await
}

/// Compares in time independent of where the bytes differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |d, (x, y)| d | (x ^ y)) == 0
}

async fn inspect(
    State(admin): State<Admin>,
    DescriptorQuery { domain, entries }: DescriptorQuery,
) -> Response {
    match admin.limiter.inspect(&domain, &entries).await {
        Ok(state) => {
            let mut body = json!({ "domain": domain, "entries": entries_json(&entries) });
            if let (Value::Object(body), Ok(Value::Object(state))) =
                (&mut body, serde_json::to_value(state))
            {
                body.extend(state);
            }
            reply(StatusCode::OK, &body)
        }
        Err(error) => admin_failure(&error),
    }
}

async fn reset(
    State(admin): State<Admin>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
    DescriptorQuery { domain, entries }: DescriptorQuery,
) -> Response {
    match admin.limiter.reset(&domain, &entries).await {
        Ok((rule, keys)) => {
            tracing::info!(
                who = %actor(&headers), peer = %peer.addr, domain = %domain.escape_debug(),
                entries = %audited(&entries), ?rule, keys = keys.len(), "admin: counters reset"
            );
            metrics::counter!("ratekeeper_admin_operations", "operation" => "reset").increment(1);
            let body = json!({
                "domain": domain,
                "entries": entries_json(&entries),
                "rule": rule,
                "reset": keys,
            });
            reply(StatusCode::OK, &body)
        }
        Err(error) => admin_failure(&error),
    }
}

async fn list_leases(
    State(admin): State<Admin>,
    DescriptorQuery { domain, entries }: DescriptorQuery,
) -> Response {
    match admin.leases.list(&domain, &entries).await {
        Ok(listed) => {
            let body = json!({
                "domain": domain,
                "entries": entries_json(&entries),
                "rule": listed.rule,
                "max_connections": listed.max_connections,
                "leases": listed.leases,
            });
            reply(StatusCode::OK, &body)
        }
        Err(error) => admin_failure(&error),
    }
}

async fn revoke(
    State(admin): State<Admin>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
    DescriptorQuery { domain, entries }: DescriptorQuery,
    RawQuery(query): RawQuery,
) -> Response {
    let Some(lease) = param(query.as_deref(), "lease") else {
        return failure(StatusCode::BAD_REQUEST, "missing lease=<id>");
    };
    match admin.leases.revoke(&domain, &entries, &lease).await {
        Ok(found) => {
            tracing::info!(
                // Escaped: a caller's text must not write lines of its own
                // into the audit log.
                who = %actor(&headers), peer = %peer.addr, domain = %domain.escape_debug(),
                entries = %audited(&entries), lease = %lease.escape_debug(), found, "admin: lease revoked"
            );
            metrics::counter!("ratekeeper_admin_operations", "operation" => "revoke").increment(1);
            let body = json!({ "domain": domain, "lease": lease, "revoked": found });
            reply(StatusCode::OK, &body)
        }
        Err(error) => admin_failure(&error),
    }
}

/// The limits in force: per domain its rules (path, limits, flags).
async fn loaded_config(State(admin): State<Admin>, RawQuery(query): RawQuery) -> Response {
    if query.is_some_and(|q| !q.is_empty()) {
        return failure(StatusCode::BAD_REQUEST, "/v1/config takes no parameter");
    }
    let config = admin.config.current();
    let domains: Vec<Value> = config
        .domain_names()
        .into_iter()
        .filter_map(|name| config.domain(name))
        .map(|domain| {
            json!({
                "domain": domain.name,
                "source": config.source(&domain.name).map(|p| p.display().to_string()),
                "rules": domain.rules.rules.iter().map(rule_json).collect::<Vec<_>>(),
                "concurrency": domain.concurrency.rules.iter().map(|rule| json!({
                    "path": rule.path,
                    "max_connections": rule.max_connections,
                    "lease_ttl_ms": rule.lease_ttl.as_millis() as u64,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let body = json!({
        "source": admin.source,
        "xds_version": config.version(),
        "domains": domains,
    });
    reply(StatusCode::OK, &body)
}

/// One rule of `/v1/config`: its path, flags and limits.
fn rule_json(rule: &Rule) -> Value {
    let limits: Vec<Value> = rule
        .rates
        .iter()
        .map(|rate| {
            json!({
                "algorithm": rate.algorithm.name(),
                "unit": rate.unit.name(),
                "requests_per_unit": rate.requests_per_unit,
                "burst": rate.burst,
                "name": rate.name,
            })
        })
        .collect();
    json!({
        "path": rule.path,
        "unlimited": rule.is_unlimited(),
        "shadow_mode": rule.shadow_mode,
        "replaces": rule.replaces,
        "limits": limits,
    })
}

/// A handler's descriptor, from the query (see [`descriptor`]): a bad one
/// is answered 400 with its reason before the handler runs.
struct DescriptorQuery {
    domain: String,
    entries: Vec<(String, String)>,
}

impl<S: Send + Sync> FromRequestParts<S> for DescriptorQuery {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> std::result::Result<Self, Response> {
        // Only a revoke names a lease; elsewhere `lease=` would be ignored.
        let revoke = parts.method == axum::http::Method::DELETE && parts.uri.path() == "/v1/leases";
        descriptor(parts.uri.query(), revoke)
            .map(|(domain, entries)| DescriptorQuery { domain, entries })
            .map_err(|reason| failure(StatusCode::BAD_REQUEST, &reason))
    }
}

/// The query's `domain` and its `entry=key=value` pairs, in order; `lease`
/// (read by the handler) is allowed when `with_lease`.
fn descriptor(
    query: Option<&str>,
    with_lease: bool,
) -> std::result::Result<(String, Vec<(String, String)>), String> {
    let mut domain = None;
    let mut entries = Vec::new();
    let mut lease = false;
    for (name, value) in pairs(query.unwrap_or(""))? {
        match name.as_str() {
            // Twice is refused: which one a reset or revoke acts on must
            // not be a guess.
            "domain" if domain.is_some() => return Err("domain given twice: one per call".into()),
            "domain" => domain = Some(value),
            "entry" => match value.split_once('=') {
                Some((k, v)) if !k.is_empty() => entries.push((k.to_owned(), v.to_owned())),
                _ => return Err(format!("entry {value:?} is not key=value")),
            },
            "lease" if !with_lease => return Err("lease= is for DELETE /v1/leases only".into()),
            "lease" if lease => return Err("lease given twice: one per call".into()),
            "lease" => lease = true,
            other => return Err(format!("unknown parameter {other:?}")),
        }
    }
    let domain = domain
        .filter(|d| !d.is_empty())
        .ok_or("missing domain=<name>")?;
    if entries.is_empty() {
        return Err("missing entry=<key>=<value> (at least one)".into());
    }
    Ok((domain, entries))
}

/// One query parameter's value (`descriptor` has refused a query that
/// does not decode).
fn param(query: Option<&str>, wanted: &str) -> Option<String> {
    pairs(query.unwrap_or(""))
        .ok()?
        .into_iter()
        .find(|(name, _)| name == wanted)
        .map(|(_, value)| value)
}

/// The query's `name=value` pairs, percent- and `+`-decoded.
fn pairs(query: &str) -> std::result::Result<Vec<(String, String)>, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (name, value) = p.split_once('=').unwrap_or((p, ""));
            Ok((decode(name)?, decode(value)?))
        })
        .collect()
}

fn entries_json(entries: &[(String, String)]) -> Value {
    entries
        .iter()
        .map(|(key, value)| json!({ "key": key, "value": value }))
        .collect()
}

/// The entries as the audit log shows them, quoted (a caller's text must
/// not write lines of its own) and each key and value cut at 256
/// characters: a value may be 64 KiB, and a reset's line is one line.
fn audited(entries: &[(String, String)]) -> String {
    const SHOWN: usize = 256;
    let cut = |text: &str| {
        let shown: String = text.chars().take(SHOWN).collect();
        match shown.len() < text.len() {
            true => format!("{shown:?}… ({} bytes)", text.len()),
            false => format!("{shown:?}"),
        }
    };
    let shown: Vec<String> = entries
        .iter()
        .map(|(key, value)| format!("{}={}", cut(key), cut(value)))
        .collect();
    shown.join(",")
}

fn actor(headers: &HeaderMap) -> String {
    headers
        .get(ACTOR_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("unknown")
        .chars()
        .take(100)
        .collect()
}

fn admin_failure(error: &AdminError) -> Response {
    let code = match error {
        AdminError::BadInput(_) => StatusCode::BAD_REQUEST,
        AdminError::UnknownDomain(_) => StatusCode::NOT_FOUND,
        AdminError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    failure(code, &error.to_string())
}

/// The token of an `Authorization: Bearer <token>` value; the scheme's
/// name is case-insensitive (RFC 9110).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start())
}

fn failure(code: StatusCode, reason: &str) -> Response {
    reply(code, &json!({ "error": reason }))
}

fn reply(code: StatusCode, body: &Value) -> Response {
    let text = format!("{body}\n");
    (code, [(CONTENT_TYPE, "application/json")], text).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audited_entries_are_quoted_and_cut() {
        let long = "v".repeat(70_000);
        let entries = [
            ("user".to_owned(), "eve\nINFO forged".to_owned()),
            ("blob".to_owned(), long),
        ];
        let shown = audited(&entries);
        assert!(
            shown.starts_with(r#""user"="eve\nINFO forged","blob"="vvv"#),
            "{shown}"
        );
        assert!(shown.ends_with("v\"… (70000 bytes)"), "{shown}");
        assert!(shown.len() < 400, "{}", shown.len());
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer_token("Bearer s3cret"), Some("s3cret"));
        assert_eq!(bearer_token("bearer s3cret"), Some("s3cret"));
        assert_eq!(bearer_token("BEARER  s3cret"), Some("s3cret"));
        assert_eq!(bearer_token("Basic s3cret"), None);
        assert_eq!(bearer_token("Bearer"), None);
    }

    #[test]
    fn entries_keep_their_order_and_decode() {
        let (domain, entries) = descriptor(
            Some("domain=a%2Fb&entry=user=al+ice&entry=path=%2Flogin%3Dx"),
            false,
        )
        .unwrap();
        assert_eq!(domain, "a/b");
        assert_eq!(
            entries,
            vec![
                ("user".to_owned(), "al ice".to_owned()),
                ("path".to_owned(), "/login=x".to_owned())
            ]
        );
    }

    #[test]
    fn bad_queries_say_why() {
        assert!(descriptor(None, true).unwrap_err().contains("domain"));
        assert!(descriptor(Some("domain=d"), true)
            .unwrap_err()
            .contains("entry"));
        assert!(descriptor(Some("domain=d&entry=novalue"), true)
            .unwrap_err()
            .contains("key=value"));
        assert!(descriptor(Some("domain=d&entry=a=b&x=1"), true)
            .unwrap_err()
            .contains("unknown parameter"));
        for (twice, name) in [
            ("domain=a&domain=b&entry=k=v", "domain"),
            ("domain=a&entry=k=v&lease=x&lease=y", "lease"),
        ] {
            assert_eq!(
                descriptor(Some(twice), true).unwrap_err(),
                format!("{name} given twice: one per call")
            );
        }
        assert!(descriptor(Some("domain=d&entry=k=v&lease=x"), false)
            .unwrap_err()
            .contains("DELETE /v1/leases only"));
        assert_eq!(decode("%zz%4").unwrap(), "%zz%4");
        // Only two hex digits make an escape (`from_str_radix` takes a sign).
        assert_eq!(decode("%+1").unwrap(), "% 1");
        assert!(descriptor(Some("domain=d&entry=k=%C3"), true)
            .unwrap_err()
            .contains("UTF-8"));
    }

    #[test]
    fn a_public_address_needs_a_token() {
        let public: SocketAddr = "0.0.0.0:6071".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:6071".parse().unwrap();
        assert!(check_guard(public, None, false).is_err());
        assert!(check_guard(public, Some(Path::new("t")), false).is_ok());
        assert!(check_guard(public, None, true).is_ok());
        assert!(check_guard(local, None, false).is_ok());
    }
}
