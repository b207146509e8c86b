//! A WebSocket echo server that caps **open connections per user** with
//! ratekeeper's `ratekeeper.v1.ConcurrencyService/Hold`.
//!
//! Each incoming connection names its user, with `?user=ID` in the URL or an
//! `x-user-id` header (a request with neither is refused with HTTP 400).
//! After the WebSocket handshake the server opens `Hold(domain, [user_id=ID])`
//! and reads the first event:
//!
//! - **refused**: the connection is closed at once with close code 1008
//!   (policy violation) and the reason `too many open connections for user
//!   ID (limit N)`;
//! - **granted**: every text or binary message is echoed until either side
//!   closes. The Hold stream stays open meanwhile: ratekeeper refreshes the
//!   lease, and when the connection ends the stream is dropped, which gives
//!   the lease back at once. If ratekeeper reports the lease `lost` (it
//!   expired while its store was unreachable, or was released elsewhere) the
//!   connection is closed with 1008 `connection lease lost`. If the Hold
//!   stream ends with UNAVAILABLE (the ratekeeper replica holding it
//!   stopped, as in a rolling update: it released the lease first), the gate holds the
//!   place again on whichever replica answers, retried for 5 s
//!   (`--hold-timeout-secs`), and the
//!   connection stays open; when it cannot, the connection is closed with
//!   1011 and the same reason (1008 if the places were taken meanwhile).
//!
//! If ratekeeper cannot be asked, connections are closed with 1011 (this
//! example fails closed). Nothing here counts connections itself: any number
//! of these servers, in front of any number of ratekeeper replicas sharing a
//! Redis, enforce one limit per user together.
//!
//! With a limits file such as
//!
//! ```yaml
//! domain: ws
//! concurrency:
//!   - key: user_id
//!     max_connections: 2
//!     lease_ttl: 30s
//! ```
//!
//! run
//!
//! ```sh
//! ratekeeper --config-dir LIMITS_DIR &
//! cargo run --example ws_gate -- --listen 127.0.0.1:8090 --ratekeeper http://127.0.0.1:8081
//! ```
//!
//! and connect to `ws://127.0.0.1:8090/?user=alice` three times: the third
//! is closed with 1008. Once listening it prints `listening ws=ADDR` on
//! stdout (`--listen 127.0.0.1:0` picks a free port); logs go to stderr.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use futures_util::{SinkExt, StreamExt};
use ratekeeper::pb::v1::concurrency_service_client::ConcurrencyServiceClient;
use ratekeeper::pb::v1::{hold_event, AcquireRequest, AcquireResponse, Descriptor, Entry};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request};
use tokio_tungstenite::tungstenite::http::StatusCode;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;
use tonic::transport::{Channel, Endpoint};
use tonic::Streaming;

type Client = ConcurrencyServiceClient<Channel>;
type Ws = WebSocketStream<TcpStream>;

/// Longest user id accepted (a gate's own bound: ratekeeper counts a value
/// of any length, a long one by its digest).
const MAX_USER_BYTES: usize = 256;
/// A close frame's reason must fit in 123 bytes.
const MAX_REASON_BYTES: usize = 123;
/// The pause between two tries of holding a place again.
const HOLD_RETRY: Duration = Duration::from_millis(200);
/// How long a peer gets to answer our close frame.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Parser)]
#[command(about = "WebSocket echo server gated by ratekeeper's ConcurrencyService/Hold")]
struct Args {
    /// Address to serve WebSockets on (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: SocketAddr,
    /// ratekeeper's gRPC endpoint.
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    ratekeeper: String,
    /// The limits domain asked.
    #[arg(long, default_value = "ws")]
    domain: String,
    /// The descriptor key the user id is sent as.
    #[arg(long, default_value = "user_id")]
    key: String,
    /// Seconds ratekeeper gets to answer a Hold (its first event); and,
    /// when a replica stops under a Hold, to hold the place again.
    #[arg(long, default_value_t = 5)]
    hold_timeout_secs: u64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    // Lazy: the gate starts (and refuses with 1011) while ratekeeper is down.
    let channel = Endpoint::from_shared(args.ratekeeper.clone())?
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy();
    let client = ConcurrencyServiceClient::new(channel);
    let listener = TcpListener::bind(args.listen).await?;
    let local = listener.local_addr()?;
    println!("listening ws={local}");
    std::io::stdout().flush()?;

    let gate = std::sync::Arc::new(Gate {
        client,
        domain: args.domain,
        key: args.key,
        holder: format!("ws_gate {local}"),
        hold_timeout: Duration::from_secs(args.hold_timeout_secs),
    });
    loop {
        let (socket, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                eprintln!("accept failed: {error}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let gate = gate.clone();
        tokio::spawn(async move {
            if let Err(error) = gate.serve(socket, peer).await {
                eprintln!("{peer}: {error}");
            }
        });
    }
}

struct Gate {
    client: Client,
    domain: String,
    key: String,
    holder: String,
    hold_timeout: Duration,
}

impl Gate {
    /// One connection: handshake, Hold, then echo or close.
    // The handshake callback's error type (an HTTP response) is tungstenite's.
    #[allow(clippy::result_large_err)]
    async fn serve(
        &self,
        socket: TcpStream,
        peer: SocketAddr,
    ) -> Result<(), tokio_tungstenite::tungstenite::Error> {
        let mut user = None;
        let mut ws =
            tokio_tungstenite::accept_hdr_async(
                socket,
                |request: &Request, response| match user_of(request) {
                    Ok(id) => {
                        user = Some(id);
                        Ok(response)
                    }
                    Err(message) => Err(bad_request(message)),
                },
            )
            .await?;
        let user = user.unwrap_or_default();

        let held = tokio::time::timeout(self.hold_timeout, self.hold(&user, peer)).await;
        let (first, events) = match held {
            Ok(Ok(held)) => held,
            Ok(Err(status)) => {
                eprintln!("{peer}: Hold for user {user:?} failed: {status}");
                return close(&mut ws, CloseCode::Error, "connection gate unavailable").await;
            }
            Err(_) => {
                eprintln!(
                    "{peer}: Hold for user {user:?}: no answer within {:?}",
                    self.hold_timeout
                );
                return close(&mut ws, CloseCode::Error, "connection gate unavailable").await;
            }
        };
        if !first.granted {
            // (retry_after is not shown: it is when an unrenewed lease would
            // expire, and the open connections renew theirs.)
            let reason = format!(
                "too many open connections for user {} (limit {})",
                shorten(&user, 64),
                first.limit
            );
            eprintln!("{peer}: refused user {user:?}: {reason}");
            return close(&mut ws, CloseCode::Policy, &reason).await;
        }
        eprintln!(
            "{peer}: user {user:?} connected ({} of {})",
            first.active, first.limit
        );
        // Nothing limits this user (no rule matched): no lease to watch.
        let mut events = (!first.lease_id.is_empty()).then_some(events);
        let result = self.echo(&mut ws, &mut events, &user, peer).await;
        // Dropping the Hold stream here (the caller going away) releases the lease.
        drop(events);
        eprintln!("{peer}: user {user:?} disconnected");
        result
    }

    /// Echoes until the peer closes, or closes if the lease is lost.
    async fn echo(
        &self,
        ws: &mut Ws,
        events: &mut Option<Streaming<ratekeeper::pb::v1::HoldEvent>>,
        user: &str,
        peer: SocketAddr,
    ) -> Result<(), tokio_tungstenite::tungstenite::Error> {
        loop {
            let lease_event = async {
                match events.as_mut() {
                    Some(stream) => stream.message().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                message = ws.next() => match message {
                    Some(Ok(message @ (Message::Text(_) | Message::Binary(_)))) => ws.send(message).await?,
                    // Pings are answered by tungstenite; a close is answered and ends the stream.
                    Some(Ok(_)) => {}
                    Some(Err(error)) => return Err(error),
                    None => return Ok(()),
                },
                event = lease_event => {
                    let code = match event {
                        Ok(Some(ratekeeper::pb::v1::HoldEvent { event: Some(hold_event::Event::Lost(_)) })) => {
                            CloseCode::Policy
                        }
                        // Any other event is not expected after the first; ignore it.
                        Ok(Some(_)) => continue,
                        // UNAVAILABLE: the replica holding it stopped (a rolling
                        // update), releasing the lease first; hold it again.
                        Err(status) if status.code() == tonic::Code::Unavailable => {
                            match self.hold_again(user, peer).await {
                                Ok(held) => {
                                    *events = held;
                                    continue;
                                }
                                Err(code) => code,
                            }
                        }
                        // Ended or failed otherwise: the lease is not known to be held.
                        Ok(None) | Err(_) => CloseCode::Error,
                    };
                    return close(ws, code, "connection lease lost").await;
                }
            }
        }
    }

    /// Holds `user`'s place again on whichever replica the address leads to
    /// now, retried within the hold timeout: the new stream (`None` when no
    /// rule limits the user any more), or the close code when not held
    /// (1008: the places were taken meanwhile; 1011: no replica answered).
    async fn hold_again(
        &self,
        user: &str,
        peer: SocketAddr,
    ) -> Result<Option<Streaming<ratekeeper::pb::v1::HoldEvent>>, CloseCode> {
        let deadline = tokio::time::Instant::now() + self.hold_timeout;
        loop {
            match tokio::time::timeout_at(deadline, self.hold(user, peer)).await {
                Ok(Ok((first, events))) if first.granted => {
                    return Ok((!first.lease_id.is_empty()).then_some(events))
                }
                Ok(Ok(_)) => return Err(CloseCode::Policy),
                Ok(Err(status)) => eprintln!("{peer}: holding user {user:?} again: {status}"),
                Err(_) => return Err(CloseCode::Error),
            }
            tokio::time::sleep(HOLD_RETRY).await;
            if tokio::time::Instant::now() >= deadline {
                return Err(CloseCode::Error);
            }
        }
    }

    /// Opens `Hold` for `user`: the first event and the rest of the stream.
    async fn hold(
        &self,
        user: &str,
        peer: SocketAddr,
    ) -> Result<(AcquireResponse, Streaming<ratekeeper::pb::v1::HoldEvent>), tonic::Status> {
        let request = AcquireRequest {
            domain: self.domain.clone(),
            descriptors: vec![Descriptor {
                entries: vec![Entry {
                    key: self.key.clone(),
                    value: user.to_owned(),
                }],
            }],
            lease_ttl: None,
            holder: format!("{} {peer}", self.holder),
        };
        let mut client = self.client.clone();
        let mut events = client.hold(request).await?.into_inner();
        match events.message().await? {
            Some(ratekeeper::pb::v1::HoldEvent {
                event: Some(hold_event::Event::Acquired(first)),
            }) => Ok((first, events)),
            other => Err(tonic::Status::internal(format!(
                "unexpected first Hold event: {other:?}"
            ))),
        }
    }
}

/// Sends a close frame and waits (bounded) for the peer's reply.
async fn close(
    ws: &mut Ws,
    code: CloseCode,
    reason: &str,
) -> Result<(), tokio_tungstenite::tungstenite::Error> {
    let frame = CloseFrame {
        code,
        reason: shorten(reason, MAX_REASON_BYTES).into(),
    };
    ws.close(Some(frame)).await?;
    let drain = async { while let Some(Ok(_)) = ws.next().await {} };
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, drain).await;
    Ok(())
}

/// The user id: `?user=ID` (percent-decoded), else the `x-user-id` header.
fn user_of(request: &Request) -> Result<String, &'static str> {
    let from_query = request.uri().query().and_then(|query| {
        query.split('&').find_map(|pair| {
            let (name, value) = pair.split_once('=')?;
            (name == "user").then(|| percent_decode(value))
        })
    });
    let user = match from_query {
        Some(user) => user,
        None => match request.headers().get("x-user-id") {
            Some(value) => value
                .to_str()
                .map_err(|_| "x-user-id must be visible ASCII")?
                .trim()
                .to_owned(),
            None => String::new(),
        },
    };
    if user.is_empty() {
        return Err("missing user id: send ?user=ID or an x-user-id header");
    }
    if user.len() > MAX_USER_BYTES {
        return Err("user id too long");
    }
    Ok(user)
}

fn bad_request(message: &str) -> ErrorResponse {
    let mut response = ErrorResponse::new(Some(message.to_owned()));
    *response.status_mut() = StatusCode::BAD_REQUEST;
    response
}

/// Decodes `%XX` escapes and `+` (a form-encoded space); invalid UTF-8 is replaced.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = text
                    .get(i + 1..i + 3)
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(byte) => {
                        out.push(byte);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            byte => out.push(byte),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `text` cut to at most `max` bytes on a character boundary ("…" marks a cut).
fn shorten(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max - '…'.len_utf8();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}
