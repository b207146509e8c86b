//! Readiness, told the same way to every prober: gRPC health (for the
//! server as a whole, the rate limit service, and `ratelimit`, the name
//! envoyproxy/ratelimit registers) and HTTP `GET /healthcheck`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

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
