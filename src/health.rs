//! Readiness, told the same way to every prober: gRPC health (for the
//! server as a whole, the rate limit service, and `ratelimit`, the name
//! envoyproxy/ratelimit registers) and HTTP `GET /healthcheck`. gRPC
//! health's `Check` is counted in their per-method stats ([`CountedHealth`]).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use futures_util::{Stream, StreamExt};
use tokio::sync::watch;

use tonic::{Request, Response, Status};
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_health::server::{HealthReporter, HealthService};
use tonic_health::ServingStatus;

use crate::their_stats::{self, TheirCounter, TheirTimer};

/// The gRPC name of Envoy's rate limit service.
pub const RLS_SERVICE: &str = "envoy.service.ratelimit.v3.RateLimitService";

/// The gRPC health name envoyproxy/ratelimit registers its readiness under.
pub const COMPAT_SERVICE: &str = "ratelimit";

/// The gRPC health names that follow readiness.
const READINESS_SERVICES: [&str; 3] = ["", RLS_SERVICE, COMPAT_SERVICE];

/// Whether this replica should get traffic. Starts not ready; cheap to clone.
#[derive(Clone)]
pub struct Readiness {
    reporter: HealthReporter,
    ready: Arc<AtomicBool>,
}

impl Readiness {
    pub fn new(reporter: HealthReporter) -> Self {
        Readiness {
            reporter,
            ready: Arc::default(),
        }
    }

    /// Tells every prober.
    pub async fn set(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
        let status = if ready {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for service in READINESS_SERVICES {
            self.reporter.set_service_status(service, status).await;
        }
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// The gRPC reporter, for names that do not follow readiness.
    pub fn reporter(&self) -> &HealthReporter {
        &self.reporter
    }
}

/// gRPC health, whose `Check` counts as envoyproxy/ratelimit's interceptor
/// counts every unary method it serves: `ratelimit_server.Check.total_requests`
/// and `ratelimit_server.Check.response_time` (`Watch`, a stream, is not
/// counted, as there). Its `Watch` streams end with `NOT_SERVING` once the
/// server stops: left open, each would hold the drain for its whole grace.
pub struct CountedHealth {
    inner: HealthService,
    total: TheirCounter,
    response_time: TheirTimer,
    stopping: watch::Receiver<bool>,
}

/// The reporter that sets the statuses, and the gRPC service serving them;
/// `stopping` turns true when the server stops.
pub fn health_reporter(
    stopping: watch::Receiver<bool>,
) -> (HealthReporter, HealthServer<CountedHealth>) {
    const METHOD: &str = "Check";
    let reporter = HealthReporter::new();
    let counted = CountedHealth {
        inner: HealthService::from_health_reporter(reporter.clone()),
        total: TheirCounter::new(&format!("ratelimit_server.{METHOD}.total_requests")),
        response_time: TheirTimer::new(&their_stats::response_time(METHOD)),
        stopping,
    };
    (reporter, HealthServer::new(counted))
}

#[tonic::async_trait]
impl Health for CountedHealth {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let start = Instant::now();
        self.total.add(1);
        let answer = self.inner.check(request).await;
        self.response_time.record(start.elapsed());
        answer
    }

    type WatchStream =
        Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send + 'static>>;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let statuses = self.inner.watch(request).await?.into_inner();
        let mut stopping = self.stopping.clone();
        // A sender dropped is a server gone too.
        let stopped = async move { drop(stopping.wait_for(|stopped| *stopped).await) };
        let last = HealthCheckResponse {
            status: ServingStatus::NotServing as i32,
        };
        let watched = statuses
            .take_until(stopped)
            .chain(futures_util::stream::iter([Ok(last)]));
        Ok(Response::new(Box::pin(watched)))
    }
}
