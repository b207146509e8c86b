//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
//!
//! A decision reads top to bottom in [`RateLimiter::decide`], one step per
//! module:
//!
//! 1. `plan`: validate the request, find each descriptor's rule (or its
//!    `limit` override), apply `replaces`, and build the checks the store
//!    must apply;
//! 2. `outcomes`: the checks' outcomes, from the over-limit cache when it
//!    already knows them all, else from the store in one atomic call (each
//!    of the two stores its own checks, with a per-second store);
//! 3. `failure`: only when a store failed, the domain's failure mode
//!    answers, refuses, or decides from this replica's own counters;
//! 4. `respond`: one status per descriptor from its tightest limit, the
//!    overall code and the `RateLimit-*` headers; `rule_metrics` counts
//!    the hits per rule on the way.
//!
//! Semantics follow envoyproxy/ratelimit, except that a refused request
//! consumes nothing (all-or-nothing; see the README).

mod admin;
mod call_stats;
mod debug_log;
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
pub use self::failure::DEFAULT_LOCAL_FALLBACK_KEYS;
use self::failure::{degraded, Fallback, LocalFallback};
use self::outcomes::Source;
pub(crate) use self::plan::{Applied, Plan};
use self::respond::allow_all;
pub(crate) use self::respond::tightest;
use self::rule_metrics::RuleCounters;
pub use self::rule_metrics::{DetailedSeries, NearLimitRatio, OVERFLOW_LABEL};
use super::over_cache::OverCache;
use crate::config::watch::SharedConfig;
use crate::headers::HeaderSettings;
use crate::keys::Values;
use crate::limiter::{Algorithm, Charges};
use crate::log_pace::Paced;
use crate::otel::{DecisionSpan, Tracer};
use crate::store::Stores;
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
    /// Most counters `failure_mode: local` keeps (`None`:
    /// [`DEFAULT_LOCAL_FALLBACK_KEYS`]).
    pub local_fallback_max_keys: Option<usize>,
    /// Most distinct `detailed_metric` label values (then `overflow`).
    pub max_detailed_series: usize,
    /// Raw or hashed descriptor values in keys and labels.
    pub values: Values,
    /// Where the `near_limit` counters start.
    pub near_limit_ratio: NearLimitRatio,
    pub modes: GlobalModes,
    /// Most bytes the over-limit cache takes (0: off); `None`:
    /// [`super::over_cache::DEFAULT_CAPACITY_BYTES`].
    pub over_cache_bytes: Option<usize>,
    /// envoyproxy/ratelimit's `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`: a
    /// refused request leaves the fixed windows it fitted untouched (the one
    /// it took over its limit still counts it), unless a limit says otherwise.
    pub stop_increment_when_over_limit: bool,
    /// OpenTelemetry spans of decisions (off by default).
    pub tracer: Tracer,
}

impl LimiterSettings {
    /// What a limit of `algorithm` that sets no `charges:` records:
    /// envoyproxy/ratelimit's fixed window records hits over the limit (its
    /// counters pass the limit), on every descriptor of a refused request
    /// or, with `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`, only on those the
    /// request takes over their limit; so files in its format and xDS
    /// configs get its outcome. ratekeeper's own algorithms record nothing
    /// over the limit.
    pub fn charges(&self, algorithm: Algorithm) -> Charges {
        match algorithm {
            Algorithm::FixedWindow if self.stop_increment_when_over_limit => Charges::WhenOver,
            Algorithm::FixedWindow => Charges::Record,
            _ => Charges::Drop,
        }
    }

    /// Whether the checks of `rule` (of an override, with none) are in
    /// shadow mode, by the rule or by `SHADOW_MODE`: over, they refuse
    /// nothing.
    pub fn shadows(&self, rule: Option<&crate::rules::Rule>) -> bool {
        self.modes.shadow || rule.is_some_and(|r| r.shadow_mode)
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
    stores: Stores,
    settings: LimiterSettings,
    /// Counters for `failure_mode: local` while the store fails.
    local: Arc<LocalFallback>,
    counters: Arc<RuleCounters>,
    /// Keys known to be full until their window ends (no store call), one
    /// cache per store: each forgets when its own store lost its data.
    over: Stores<Arc<OverCache>>,
    /// Registered once: looking a metric up by name costs a registry
    /// lookup on every request.
    duration: metrics::Histogram,
    /// envoyproxy/ratelimit's per-call stats.
    calls: CallStats,
}

impl RateLimiter {
    pub fn new(config: SharedConfig, stores: impl Into<Stores>, settings: LimiterSettings) -> Self {
        let stores = stores.into();
        RateLimiter {
            config,
            local: Arc::new(LocalFallback::new(
                stores.main(),
                settings.expected_replicas,
                settings
                    .local_fallback_max_keys
                    .unwrap_or(DEFAULT_LOCAL_FALLBACK_KEYS),
            )),
            over: stores.map(|store| {
                Arc::new(match settings.over_cache_bytes {
                    Some(bytes) => OverCache::with_capacity(store.generation(), bytes),
                    None => OverCache::new(store.generation()),
                })
            }),
            stores,
            counters: Arc::new(RuleCounters::new(
                settings.max_detailed_series,
                settings.values,
                settings.near_limit_ratio,
                settings.over_cache_bytes.is_some(),
            )),
            duration: metrics::histogram!("ratekeeper_request_duration_seconds"),
            calls: CallStats::new(crate::their_stats::SHOULD_RATE_LIMIT),
            settings,
        }
    }

    /// The same service (sharing its caches and counters), using serving
    /// lane `lane`'s store connections.
    pub fn for_lane(&self, lane: usize) -> Self {
        RateLimiter {
            stores: self.stores.for_lane(lane),
            ..self.clone()
        }
    }

    /// This replica's over-limit cache of the main store, for a service
    /// that gives hits back to counters it may remember full (the budget
    /// service's settle; budgets live in the main store).
    pub fn over_cache(&self) -> Arc<OverCache> {
        self.over.main().clone()
    }

    /// This replica's over-limit caches, one per store (their
    /// `localcache` stats read them).
    pub fn over_caches(&self) -> &Stores<Arc<OverCache>> {
        &self.over
    }

    /// Decides one request. `Err` only for a request that cannot be
    /// evaluated, or with `failure_mode: unavailable` while the store fails.
    pub async fn decide(&self, request: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        self.decide_traced(request, None).await
    }

    /// [`RateLimiter::decide`], timed (`ratekeeper_request_duration_seconds`)
    /// and in a span when tracing samples the call (`headers` may carry the
    /// caller's `traceparent`): every ShouldRateLimit, `/json`'s too.
    pub async fn decide_observed(
        &self,
        request: &RateLimitRequest,
        headers: &tonic::metadata::MetadataMap,
    ) -> Result<RateLimitResponse, Status> {
        let started = Instant::now();
        let result = match self.settings.tracer.begin(headers) {
            None => self.decide(request).await,
            Some(mut span) => {
                let result = self.decide_traced(request, Some(&mut span)).await;
                span.decided(request, &result);
                self.settings.tracer.finish(span);
                result
            }
        };
        self.duration.record(started.elapsed().as_secs_f64());
        result
    }

    /// [`RateLimiter::decide`], telling a sampled call's `span` how the
    /// outcomes were found.
    async fn decide_traced(
        &self,
        request: &RateLimitRequest,
        mut span: Option<&mut DecisionSpan>,
    ) -> Result<RateLimitResponse, Status> {
        plan::validate(request).inspect_err(|_| self.calls.error(CallError::Service))?;
        if !self.config.is_loaded() {
            // As envoyproxy/ratelimit before its first limits load: an error
            // (theirs UNKNOWN; Envoy treats both alike), so that Envoy's
            // failure_mode_deny decides.
            self.calls.error(CallError::Service);
            return Err(Status::unavailable("no rate limit configuration loaded"));
        }
        let config = self.config.current();
        let Some(domain) = config.domain(&request.domain) else {
            metrics::counter!("ratekeeper_domain_not_found").increment(1);
            self.counters
                .domain_not_found(&request.domain, request.descriptors.len());
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
        let stored = outcomes::from_cache_or_stores(
            &self.stores,
            &self.over,
            &plan.checks,
            all_or_nothing,
            span.as_deref_mut(),
        )
        .await;
        let (outcomes, degraded_by, cached) = match stored {
            Ok((outcomes, source)) => (outcomes, None, source == Source::Cache),
            Err(failed) => {
                self.calls.error(CallError::Redis);
                let mode = domain
                    .options
                    .failure_mode
                    .unwrap_or(self.settings.failure_mode);
                let (error, store) = (&failed.error, failed.store.name());
                // Paced per store: one failing often hides none of the other's.
                static LOG: [Paced; 2] = [Paced::new(), Paced::new()];
                let log = &LOG[failed.store.index()];
                if let Some(left_out) = log.admit() {
                    tracing::warn!(%error, store, %mode, left_out, "store failed");
                }
                if let Some(span) = span {
                    span.answered_by(mode.name());
                }
                let fallback = self.local.fall_back(mode, failed, &plan, all_or_nothing);
                if !matches!(fallback, Fallback::Outcomes(_)) {
                    // Decided without outcomes: only its hits are counted
                    // (outcomes are counted in full below).
                    self.counters.record_hits(request, &plan);
                }
                match fallback {
                    Fallback::Answer(response) => return Ok(response),
                    Fallback::Refuse(status) => return Err(status),
                    Fallback::Outcomes(outcomes) => (outcomes, Some(mode), false),
                }
            }
        };

        let verdicts = respond::verdicts(&plan, &outcomes);
        self.counters
            .record(request, &plan, &outcomes, &verdicts, cached);
        let headers = domain
            .options
            .response_headers
            .unwrap_or(self.settings.headers.enabled)
            .then_some(&self.settings.headers.names);
        let mut response = respond::response(&plan, &verdicts, headers, self.settings.modes);
        debug_log::decision(request, &plan, &outcomes, &response);
        self.add_metadata(request, &plan.applied, &mut response);
        Ok(match degraded_by {
            Some(mode) => degraded(response, mode),
            None => response,
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
        let result = self
            .decide_observed(request.get_ref(), request.metadata())
            .await;
        self.calls.call(started.elapsed());
        if let Err(status) = &result {
            tracing::debug!(code = ?status.code(), message = status.message(), "request refused");
        }
        result.map(Response::new)
    }
}
