//! The service each HTTP connection is served by: the router, with the
//! connection's [`Peer`] as `ConnectInfo<Peer>`, and each request counted
//! as being answered on the connection ([`super::idle::InFlight`]) from
//! when its body is in until its response is made, so that a handler
//! slower than the idle timeout is not cut off, while a client that stops
//! sending a body half-way still is. Made per connection, as axum's
//! `into_make_service_with_connect_info` is: a request pays one shared
//! count and, with a body, its wrapper (a `/json` request 1.1% more
//! instructions; counting from the call, a router layer cost it 4.9%, an
//! axum middleware 10%).

use std::convert::Infallible;
use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, Request};
use axum::response::Response;
use axum::serve::{IncomingStream, Listener};
use axum::Router;
use futures_util::ready as ready_poll;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::codegen::{Bytes, Service};

use super::idle::InFlight;
use super::Peer;

/// Makes each connection's [`Connection`], for `axum::serve`.
#[derive(Debug, Clone)]
pub struct Connections {
    router: Router,
}

impl Connections {
    pub fn new(router: Router) -> Connections {
        Connections { router }
    }
}

impl<'a, L> Service<IncomingStream<'a, L>> for Connections
where
    L: Listener,
    Peer: Connected<IncomingStream<'a, L>>,
{
    type Response = Connection;
    type Error = Infallible;
    type Future = Ready<Result<Connection, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, stream: IncomingStream<'a, L>) -> Self::Future {
        ready(Ok(Connection {
            router: self.router.clone(),
            peer: Peer::connect_info(stream),
        }))
    }
}

/// The router as one connection's requests meet it.
#[derive(Debug, Clone)]
pub struct Connection {
    router: Router,
    peer: Peer,
}

impl Service<Request> for Connection {
    type Response = Response;
    type Error = Infallible;
    type Future = Answer<<Router as Service<Request>>::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Service::<Request>::poll_ready(&mut self.router, cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let turn = Turn::new(self.peer.in_flight.clone());
        let mut request = request.map(|body| match body.is_end_stream() {
            true => {
                turn.take();
                body
            }
            false => Body::new(Received {
                inner: body,
                turn: turn.clone(),
            }),
        });
        request
            .extensions_mut()
            .insert(ConnectInfo(self.peer.clone()));
        Answer {
            inner: self.router.call(request),
            _turn: TurnHeld(turn),
        }
    }
}

/// A request's place in its connection's count of requests being
/// answered: taken when its body is in, given up when its answer is made
/// (or dropped); never taken once given up.
#[derive(Debug)]
struct TurnState {
    in_flight: InFlight,
    /// `WAITING`, `TAKEN` or `DONE`.
    state: AtomicU8,
}

const WAITING: u8 = 0;
const TAKEN: u8 = 1;
const DONE: u8 = 2;

#[derive(Debug, Clone)]
struct Turn(Arc<TurnState>);

impl Turn {
    fn new(in_flight: InFlight) -> Turn {
        Turn(Arc::new(TurnState {
            in_flight,
            state: AtomicU8::new(WAITING),
        }))
    }

    /// The request's body is in: it counts as being answered.
    fn take(&self) {
        // Counted before it is marked, so a give-up racing it never
        // subtracts what was not added.
        self.0.in_flight.add();
        let taken =
            self.0
                .state
                .compare_exchange(WAITING, TAKEN, Ordering::AcqRel, Ordering::Acquire);
        if taken.is_err() {
            self.0.in_flight.sub();
        }
    }
}

/// Gives the turn up when the answer is made or dropped.
struct TurnHeld(Turn);

impl Drop for TurnHeld {
    fn drop(&mut self) {
        if self.0 .0.state.swap(DONE, Ordering::AcqRel) == TAKEN {
            self.0 .0.in_flight.sub();
        }
    }
}

/// A request body that takes its request's turn once it has all come.
struct Received {
    inner: Body,
    turn: Turn,
}

impl HttpBody for Received {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let frame = ready_poll!(Pin::new(&mut self.inner).poll_frame(cx));
        if frame.is_none() || self.inner.is_end_stream() {
            self.turn.take();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project_lite::pin_project! {
    /// A response being made; its request stops counting when it is
    /// ready (or dropped).
    pub struct Answer<F> {
        #[pin]
        inner: F,
        _turn: TurnHeld,
    }
}

impl<F: Future> Future for Answer<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.project().inner.poll(cx)
    }
}
