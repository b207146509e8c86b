//! The service each HTTP connection is served by: the router, with the
//! connection's [`Peer`] as `ConnectInfo<Peer>`, and each request counted
//! as being answered on the connection ([`super::idle::InFlight`]) until
//! its response is made, so that a handler slower than the idle timeout is
//! not cut off. Made per connection, as axum's `into_make_service_with_connect_info`
//! is: a request costs two atomic adds more, nothing boxed (a router layer
//! cost a `/json` request 4.9% more instructions, an axum middleware 10%).

use std::convert::Infallible;
use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, Request};
use axum::response::Response;
use axum::serve::{IncomingStream, Listener};
use axum::Router;
use tonic::codegen::Service;

use super::idle::Answering;
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

    fn call(&mut self, mut request: Request) -> Self::Future {
        let answering = self.peer.in_flight.answering();
        request
            .extensions_mut()
            .insert(ConnectInfo(self.peer.clone()));
        Answer {
            inner: self.router.call(request),
            _answering: answering,
        }
    }
}

pin_project_lite::pin_project! {
    /// A response being made; its request stops counting when it is
    /// ready (or dropped).
    pub struct Answer<F> {
        #[pin]
        inner: F,
        _answering: Answering,
    }
}

impl<F: Future> Future for Answer<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.project().inner.poll(cx)
    }
}
