//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
//!
//! A decision reads top to bottom in [`RateLimiter::decide`], one step per
//! module:
//!
//! 1. `plan`: validate the request, find each descriptor's rule (or its
//!    `limit` override), apply `replaces`, and build the checks the store
//!    must apply;
//! 2. `outcomes`: the checks' outcomes, from the over-limit cache when it
//!    already knows them all, else from the store in one atomic call;
//! 3. `failure`: only when the store failed, the domain's failure mode
//!    answers, refuses, or decides from this replica's own counters;
//! 4. `respond`: one status per descriptor from its tightest limit, the
//!    overall code and the `RateLimit-*` headers; `rule_metrics` counts
//!    the hits per rule on the way.
//!
//! Semantics follow envoyproxy/ratelimit, except that a refused request
//! consumes nothing (all-or-nothing; see the README).

mod failure;
mod outcomes;
mod plan;
mod respond;
mod rule_metrics;

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

use self::failure::{degraded, Fallback, LocalFallback};
use self::plan::Plan;
use self::respond::allow_all;
use self::rule_metrics::RuleCounters;
pub use self::rule_metrics::{DetailedSeries, OVERFLOW_LABEL};
use super::over_cache::OverCache;
use crate::config::watch::SharedConfig;
use crate::headers::HeaderSettings;
use crate::keys::Values;
use crate::otel::{DecisionSpan, Tracer};
use crate::store::Store;
use crate::vocab::FailureMode;

/// Settings of the rate limit service beyond the config and the store.
#[derive(Debug, Clone, Default)]
pub struct LimiterSettings {
    /// Prefix of every counter key.
    pub key_prefix: String,
    pub headers: HeaderSettings,
    /// The answer while the store fails, for domains that do not set one.
    pub failure_mode: FailureMode,
    /// Replicas sharing the limits: `failure_mode: local` enforces each limit
    /// divided by this.
    pub expected_replicas: u32,
    /// Most distinct `detailed_metric` label values (then `overflow`).
    pub max_detailed_series: usize,
    /// Raw or hashed descriptor values in keys and labels.
    pub values: Values,
    /// OpenTelemetry spans of decisions (off by default).
    pub tracer: Tracer,
}

/// The `ShouldRateLimit` implementation.
#[derive(Debug, Clone)]
pub struct RateLimiter {
    config: SharedConfig,
    store: Store,
    settings: LimiterSettings,
    /// Counters for `failure_mode: local` while the store fails.
    local: Arc<LocalFallback>,
    counters: Arc<RuleCounters>,
    /// Keys known to be full until their window ends (no store call).
    over: Arc<OverCache>,
    /// Registered once: looking a metric up by name costs a registry
    /// lookup on every request.
    duration: metrics::Histogram,
}

impl RateLimiter {
    pub fn new(config: SharedConfig, store: Store, settings: LimiterSettings) -> Self {
        RateLimiter {
            config,
            local: Arc::new(LocalFallback::new(&store, settings.expected_replicas)),
            over: Arc::new(OverCache::new(store.generation())),
            store,
            counters: Arc::new(RuleCounters::new(
                settings.max_detailed_series,
                settings.values,
            )),
            duration: metrics::histogram!("ratekeeper_request_duration_seconds"),
            settings,
        }
    }

    /// The same service (sharing its caches and counters), using serving
    /// lane `lane`'s store connections.
    pub fn for_lane(&self, lane: usize) -> Self {
        RateLimiter {
            store: self.store.for_lane(lane),
            ..self.clone()
        }
    }

    /// Decides one request. `Err` only for a request that cannot be
    /// evaluated, or with `failure_mode: unavailable` while the store fails.
    pub async fn decide(&self, request: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        self.decide_traced(request, None).await
    }

    /// [`RateLimiter::decide`], telling a sampled call's `span` how the
    /// outcomes were found.
    async fn decide_traced(
        &self,
        request: &RateLimitRequest,
        mut span: Option<&mut DecisionSpan>,
    ) -> Result<RateLimitResponse, Status> {
        plan::validate(request)?;
        let config = self.config.current();
        let Some(domain) = config.domain(&request.domain) else {
            metrics::counter!("ratekeeper_domain_not_found").increment(1);
            tracing::debug!(domain = %request.domain, "unknown domain");
            if let Some(span) = span {
                span.answered_by("unknown_domain");
            }
            return Ok(allow_all(&[], request.descriptors.len()));
        };
        let plan = Plan::new(request, &domain.rules, &self.settings)?;

        let all_or_nothing = domain.options.all_or_nothing;
        let stored = outcomes::from_cache_or_store(
            &self.store,
            &self.over,
            &plan.checks,
            all_or_nothing,
            span.as_deref_mut(),
        )
        .await;
        let (outcomes, answered_locally) = match stored {
            Ok(outcomes) => (outcomes, false),
            Err(error) => {
                let mode = domain
                    .options
                    .failure_mode
                    .unwrap_or(self.settings.failure_mode);
                tracing::warn!(%error, store = self.store.kind(), %mode, "store failed");
                if let Some(span) = span {
                    span.answered_by(mode.name());
                }
                match self.local.fall_back(mode, &error, &plan, all_or_nothing) {
                    Fallback::Answer(response) => return Ok(response),
                    Fallback::Refuse(status) => return Err(status),
                    Fallback::Local(outcomes) => (outcomes, true),
                }
            }
        };

        let verdicts = respond::verdicts(&plan, &outcomes);
        self.counters.record(request, &plan, &outcomes, &verdicts);
        let headers = domain
            .options
            .response_headers
            .unwrap_or(self.settings.headers.enabled)
            .then_some(&self.settings.headers.names);
        let response = respond::response(&plan, &verdicts, headers);
        Ok(if answered_locally {
            degraded(response, FailureMode::Local)
        } else {
            response
        })
    }
}

#[tonic::async_trait]
impl RateLimitService for RateLimiter {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let started = Instant::now();
        let result = match self.settings.tracer.begin(request.metadata()) {
            None => self.decide(request.get_ref()).await,
            Some(mut span) => {
                let result = self.decide_traced(request.get_ref(), Some(&mut span)).await;
                span.decided(request.get_ref(), &result);
                self.settings.tracer.finish(span);
                result
            }
        };
        self.duration.record(started.elapsed().as_secs_f64());
        if let Err(status) = &result {
            tracing::debug!(code = ?status.code(), message = status.message(), "request refused");
        }
        result.map(Response::new)
    }
}
