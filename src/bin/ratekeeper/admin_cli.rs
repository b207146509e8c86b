//! `ratekeeper admin …`: a client of the admin API ([`ratekeeper::http::admin`]),
//! for `kubectl exec` and scripts. Prints the server's JSON answer on
//! stdout; a refusal (4xx, 5xx) is an error with the server's reason.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use clap::{Args, Subcommand};
use hyper::client::conn::http1::SendRequest;
use hyper::Request;
use hyper_util::rt::TokioIo;
use ratekeeper::http::admin::{ACTOR_HEADER, DEFAULT_ADDR};
use ratekeeper::{Error, Result};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// Largest answer read (a config dump of many domains fits).
const MAX_ANSWER_BYTES: usize = 64 << 20;
/// How long the admin API gets to connect and send its answer's head: a
/// listener that never answers (the wrong port, a stalled pod) must not
/// hang a script. The body then takes what it takes (a large config).
const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// `ratekeeper admin`.
#[derive(Debug, Args)]
pub struct AdminArgs {
    /// The admin listener (the server's --admin-addr / ADMIN_ADDR).
    #[arg(long, env = "ADMIN_ADDR", default_value = DEFAULT_ADDR)]
    addr: String,
    /// File holding the bearer token (the server's ADMIN_TOKEN_FILE).
    #[arg(long, env = "ADMIN_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// PEM CA to trust: speak TLS to the admin API (its --admin-tls-cert).
    #[arg(long)]
    ca: Option<PathBuf>,
    /// PEM client certificate, for mutual TLS.
    #[arg(long, requires = "key", requires = "ca")]
    cert: Option<PathBuf>,
    /// PEM client key, for mutual TLS.
    #[arg(long, requires = "cert")]
    key: Option<PathBuf>,
    #[command(subcommand)]
    action: Action,
}

/// What to ask. A descriptor is its domain and its entries in order, each
/// `KEY=VALUE`, as in a rate limit request.
#[derive(Debug, Subcommand)]
enum Action {
    /// The descriptor's rule and each limit's remaining hits and reset,
    /// without consuming.
    Get {
        domain: String,
        #[arg(required = true)]
        entries: Vec<String>,
    },
    /// Reset the descriptor's counters (every limit of its rule).
    Reset {
        domain: String,
        #[arg(required = true)]
        entries: Vec<String>,
    },
    /// The live leases of a concurrency entity.
    Leases {
        domain: String,
        #[arg(required = true)]
        entries: Vec<String>,
    },
    /// Revoke one lease of a concurrency entity (its holder loses it).
    Revoke {
        domain: String,
        lease: String,
        #[arg(required = true)]
        entries: Vec<String>,
    },
    /// The limits in force.
    Config,
}

/// Runs one admin command against the server.
pub async fn run(args: &AdminArgs) -> Result<()> {
    let (method, path) = match &args.action {
        Action::Get { domain, entries } => ("GET", descriptor_path(domain, entries)),
        Action::Reset { domain, entries } => ("DELETE", descriptor_path(domain, entries)),
        Action::Leases { domain, entries } => ("GET", leases_path(domain, entries, None)),
        Action::Revoke {
            domain,
            lease,
            entries,
        } => ("DELETE", leases_path(domain, entries, Some(lease))),
        Action::Config => ("GET", "/v1/config".to_owned()),
    };
    let token = match &args.token_file {
        Some(file) => Some(
            std::fs::read_to_string(file)
                .map_err(|source| Error::Io {
                    context: format!("cannot read {}", file.display()),
                    source,
                })?
                .trim()
                .to_owned(),
        ),
        None => None,
    };
    let tls = match &args.ca {
        Some(ca) => {
            let identity = args.cert.as_deref().zip(args.key.as_deref());
            let mut config = ratekeeper::tls::client_config(Some(ca), identity)?;
            // HTTP/1: no ALPN (the shared client setup offers h2 only).
            config.alpn_protocols.clear();
            Some(TlsConnector::from(Arc::new(config)))
        }
        None => None,
    };
    let (status, body) = exchange(&args.addr, tls, method, &path, token.as_deref()).await?;
    let text = String::from_utf8_lossy(&body);
    if !(200..300).contains(&status) {
        let reason = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_owned))
            .unwrap_or_else(|| text.trim().to_owned());
        return Err(Error::Startup(format!("{status}: {reason}")));
    }
    let out = match serde_json::from_slice::<serde_json::Value>(&body) {
        Ok(json) => format!("{json:#}\n"),
        Err(_) => text.into_owned(),
    };
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
    {
        // A reader that stopped early (`| head`) took what it wanted.
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Error::Io {
            context: "writing the answer to stdout".into(),
            source: e,
        }),
        _ => Ok(()),
    }
}

fn descriptor_path(domain: &str, entries: &[String]) -> String {
    format!("/v1/descriptor?{}", query(domain, entries))
}

fn leases_path(domain: &str, entries: &[String], lease: Option<&str>) -> String {
    let mut path = format!("/v1/leases?{}", query(domain, entries));
    if let Some(lease) = lease {
        path.push_str(&format!("&lease={}", encode(lease)));
    }
    path
}

fn query(domain: &str, entries: &[String]) -> String {
    let mut query = format!("domain={}", encode(domain));
    for entry in entries {
        query.push_str(&format!("&entry={}", encode(entry)));
    }
    query
}

/// Percent-encodes all but RFC 3986's unreserved characters.
fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// One HTTP/1.1 request on a connection of its own: status and body.
async fn exchange(
    addr: &str,
    tls: Option<TlsConnector>,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> Result<(u16, Vec<u8>)> {
    let io = |source| Error::Io {
        context: format!("admin API at {addr}"),
        source,
    };
    let failed = |e: &dyn std::fmt::Display| Error::Startup(format!("admin API at {addr}: {e}"));
    let answered = async {
        let stream = TcpStream::connect(addr).await.map_err(io)?;
        let mut sender = match tls {
            None => handshake(stream).await,
            Some(tls) => {
                let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
                let host = host.trim_start_matches('[').trim_end_matches(']');
                let name = ServerName::try_from(host.to_owned()).map_err(|e| failed(&e))?;
                handshake(tls.connect(name, stream).await.map_err(io)?).await
            }
        }
        .map_err(|e| failed(&e))?;
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr)
            .header(ACTOR_HEADER, actor());
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        let request = request.body(Body::empty()).map_err(|e| failed(&e))?;
        sender.send_request(request).await.map_err(|e| failed(&e))
    };
    let response = tokio::time::timeout(ANSWER_TIMEOUT, answered)
        .await
        .map_err(|_| failed(&format!("no answer within {ANSWER_TIMEOUT:?}")))??;
    let status = response.status().as_u16();
    let body = axum::body::to_bytes(Body::new(response.into_body()), MAX_ANSWER_BYTES)
        .await
        .map_err(|e| failed(&e))?;
    Ok((status, body.to_vec()))
}

/// An HTTP/1 connection over `io`, driven in the background.
async fn handshake<T>(io: T) -> hyper::Result<SendRequest<Body>>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(connection);
    Ok(sender)
}

/// Who acts, for the server's audit log: `$USER@$HOSTNAME` as far as known.
fn actor() -> String {
    let user = std::env::var("USER").unwrap_or_else(|_| "unknown".into());
    match std::env::var("HOSTNAME") {
        Ok(host) => format!("{user}@{host}"),
        Err(_) => user,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_encoded_in_order() {
        let entries = ["user=al ice".to_owned(), "path=/a&b".to_owned()];
        assert_eq!(
            query("gw/ns", &entries),
            "domain=gw%2Fns&entry=user%3Dal%20ice&entry=path%3D%2Fa%26b"
        );
    }
}
