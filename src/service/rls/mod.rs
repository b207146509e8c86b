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

mod admin;
mod call_stats;
mod failure;
mod metadata;
mod outcomes;
mod plan;
mod respond;
mod rule_metrics;

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

pub use self::admin::{AdminError, DescriptorState, LimitState};
use self::call_stats::{CallError, CallStats};
use self::failure::{degraded, Fallback, LocalFallback};
pub(crate) use self::plan::{Applied, Plan};
use self::respond::allow_all;
pub(crate) use self::respond::tightest;
use self::rule_metrics::RuleCounters;
pub use self::rule_metrics::{DetailedSeries, NearLimitRatio, OVERFLOW_LABEL};
use super::over_cache::OverCache;
use crate::config::watch::SharedConfig;
use crate::headers::HeaderSettings;
use crate::keys::Values;
use crate::limiter::Algorithm;
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
    /// Where the `near_limit` counters start.
    pub near_limit_ratio: NearLimitRatio,
    pub modes: GlobalModes,
    /// Most keys the over-limit cache remembers (0: off); `None`:
    /// [`super::over_cache::DEFAULT_CAPACITY`].
    pub over_cache_keys: Option<usize>,
    /// envoyproxy/ratelimit's `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`:
    /// fixed windows drop hits over the limit unless a limit says otherwise.
    pub stop_increment_when_over_limit: bool,
    /// OpenTelemetry spans of decisions (off by default).
    pub tracer: Tracer,
}

impl LimiterSettings {
    /// Whether a limit of `algorithm` that sets no `charges:` records hits
    /// over the limit: envoyproxy/ratelimit's fixed window does (its
    /// counters pass the limit), so files in its format and xDS configs get
    /// its outcome; ratekeeper's own algorithms do not.
    pub fn charges(&self, algorithm: Algorithm) -> bool {
        algorithm == Algorithm::FixedWindow && !self.stop_increment_when_over_limit
    }
}

/// envoyproxy/ratelimit's global answer switches. All off by default, and
/// then no step does any work for them.
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalModes {
    /// `SHADOW_MODE`: count everything, never answer OVER_LIMIT.
    pub shadow: bool,
    /// `QUOTA_MODE`: every descriptor is a quota descriptor.
    pub quota: bool,
    /// `RESPONSE_DYNAMIC_METADATA`: describe the request (and the matched
    /// rules' `metadata`) in the response's `dynamic_metadata`.
    pub dynamic_metadata: bool,
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
    /// envoyproxy/ratelimit's per-call stats.
    calls: CallStats,
}

impl RateLimiter {
    pub fn new(config: SharedConfig, store: Store, settings: LimiterSettings) -> Self {
        RateLimiter {
            config,
            local: Arc::new(LocalFallback::new(&store, settings.expected_replicas)),
            over: Arc::new(match settings.over_cache_keys {
                Some(keys) => OverCache::with_capacity(store.generation(), keys),
                None => OverCache::new(store.generation()),
            }),
            store,
            counters: Arc::new(RuleCounters::new(
                settings.max_detailed_series,
                settings.values,
                settings.near_limit_ratio,
            )),
            duration: metrics::histogram!("ratekeeper_request_duration_seconds"),
            calls: CallStats::new("ShouldRateLimit"),
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

    /// This replica's over-limit cache, for a service that gives hits back
    /// to counters it may remember full (the budget service's settle).
    pub fn over_cache(&self) -> Arc<OverCache> {
        self.over.clone()
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
        plan::validate(request).inspect_err(|_| self.calls.error(CallError::Service))?;
        let config = self.config.current();
        let Some(domain) = config.domain(&request.domain) else {
            metrics::counter!("ratekeeper_domain_not_found").increment(1);
            tracing::debug!(domain = %request.domain, "unknown domain");
            if let Some(span) = span {
                span.answered_by("unknown_domain");
            }
            let mut response = allow_all(&[], request.descriptors.len());
            self.add_metadata(request, &[], &mut response);
            return Ok(response);
        };
        let plan = Plan::new(request, &domain.rules, &self.settings)
            .inspect_err(|_| self.calls.error(CallError::Service))?;

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
                self.calls.error(CallError::Redis);
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
        let mut response = respond::response(&plan, &verdicts, headers, self.settings.modes);
        self.add_metadata(request, &plan.applied, &mut response);
        Ok(if answered_locally {
            degraded(response, FailureMode::Local)
        } else {
            response
        })
    }

    /// With `RESPONSE_DYNAMIC_METADATA`, the response's `dynamic_metadata`.
    fn add_metadata(
        &self,
        request: &RateLimitRequest,
        applied: &[plan::Applied<'_>],
        response: &mut RateLimitResponse,
    ) {
        if self.settings.modes.dynamic_metadata {
            let metadata = metadata::dynamic_metadata(request, applied, &response.statuses);
            response.dynamic_metadata = Some(metadata);
        }
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
        let elapsed = started.elapsed();
        self.duration.record(elapsed.as_secs_f64());
        self.calls.call(elapsed);
        if let Err(status) = &result {
            tracing::debug!(code = ?status.code(), message = status.message(), "request refused");
        }
        result.map(Response::new)
    }
}
