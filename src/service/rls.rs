//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
//!
//! For each descriptor: find its rule (or the request's `limit` override),
//! apply `replaces`, then send every limited descriptor of the request to the
//! store as one atomic batch and answer with one status per descriptor.
//! Semantics follow envoyproxy/ratelimit, except that a refused request
//! consumes nothing (all-or-nothing; see the README).

use std::borrow::Cow;
use std::collections::HashSet;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

use super::caps;
use super::failure::FailureMode;
use super::over_cache::OverCache;
use crate::clock::SystemClock;
use crate::config::watch::SharedConfig;
use crate::headers::{self, HeaderSettings, LimitState};
use crate::keys::{counter_key, Values};
use crate::limiter::{Check, Unit, MAX_HITS};
use crate::rules::{Rate, Rule, RuleMetrics};
use crate::store::{MemoryStore, Store};

/// Share of a limit above which admitted hits count as `near_limit`.
const NEAR_LIMIT_RATIO: f64 = 0.8;

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
}

/// The `ShouldRateLimit` implementation.
#[derive(Debug, Clone)]
pub struct RateLimiter {
    config: SharedConfig,
    store: Store,
    settings: LimiterSettings,
    /// Counters for `failure_mode: local` while the store fails.
    local: Arc<MemoryStore>,
    detailed: Arc<DetailedSeries>,
    /// Keys known to be full until their window ends (no store call).
    over: Arc<OverCache>,
    /// Registered once: looking a metric up by name costs a registry
    /// lookup on every request.
    duration: metrics::Histogram,
}

/// The limits that apply to one descriptor of a request.
enum Applied<'c> {
    /// No rule matched (or it was replaced): OK, no `current_limit`.
    None,
    /// An `unlimited` rule: OK, remaining `u32::MAX`.
    Unlimited,
    /// Counted limits: a configured rule's (maybe stacked) or the
    /// descriptor's override; `checks` are their checks, in the same order.
    Counted {
        rule: Option<&'c Rule>,
        rates: Cow<'c, [Rate]>,
        checks: Range<usize>,
    },
}

impl RateLimiter {
    pub fn new(config: SharedConfig, store: Store, settings: LimiterSettings) -> Self {
        RateLimiter {
            config,
            over: Arc::new(OverCache::new(store.generation())),
            store,
            local: MemoryStore::new(Arc::new(SystemClock)),
            detailed: Arc::new(DetailedSeries::new(settings.max_detailed_series)),
            duration: metrics::histogram!("ratekeeper_request_duration_seconds"),
            settings,
        }
    }

    /// Decides one request. `Err` only for a request that cannot be evaluated.
    pub async fn decide(&self, request: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        validate(request)?;
        let config = self.config.current();
        let Some(domain) = config.domain(&request.domain) else {
            metrics::counter!("ratekeeper_domain_not_found").increment(1);
            tracing::debug!(domain = %request.domain, "unknown domain");
            return Ok(allow_all(&[], request.descriptors.len()));
        };

        let mut matched: Vec<Option<&Rule>> = Vec::with_capacity(request.descriptors.len());
        let mut overrides: Vec<Option<Rate>> = Vec::with_capacity(request.descriptors.len());
        for (i, descriptor) in request.descriptors.iter().enumerate() {
            match &descriptor.limit {
                Some(limit) => {
                    let unit = Unit::from_envoy(limit.unit).ok_or_else(|| {
                        Status::invalid_argument(format!(
                            "descriptors[{i}].limit: unit {} is not a known rate limit unit",
                            limit.unit
                        ))
                    })?;
                    overrides.push(Some(Rate::fixed(limit.requests_per_unit, unit)));
                    matched.push(None);
                }
                None => {
                    overrides.push(None);
                    matched.push(domain.rules.find(entries(descriptor)));
                }
            }
        }
        drop_replaced(&mut matched);

        let mut checks = Vec::new();
        let applied: Vec<Applied<'_>> = request
            .descriptors
            .iter()
            .zip(matched.into_iter().zip(overrides))
            .map(|(descriptor, (rule, override_rate))| {
                let (rule, rates) = match (override_rate, rule) {
                    (Some(rate), _) => (None, Cow::Owned(vec![rate])),
                    (None, None) => return Applied::None,
                    (None, Some(rule)) if rule.is_unlimited() => return Applied::Unlimited,
                    (None, Some(rule)) => (Some(rule), Cow::Borrowed(rule.rates.as_slice())),
                };
                let first = checks.len();
                for rate in rates.iter() {
                    let mut counter_id = rate.counter_id();
                    if rule.is_none() {
                        // Overrides count apart from configured rules and from
                        // each other, like envoyproxy/ratelimit's override keys.
                        counter_id.push_str(&format!(".o{}", rate.requests_per_unit));
                    }
                    checks.push(Check {
                        key: counter_key(
                            &self.settings.key_prefix,
                            &request.domain,
                            entries(descriptor),
                            self.settings.values,
                            &counter_id,
                        ),
                        algorithm: rate.algorithm,
                        limit: u64::from(rate.requests_per_unit),
                        period_ms: rate.unit.seconds() * 1_000,
                        burst: rate.effective_burst(),
                        hits: hits(request, descriptor),
                        enforce: !rule.is_some_and(|r| r.shadow_mode),
                    });
                }
                Applied::Counted {
                    rule,
                    rates,
                    checks: first..checks.len(),
                }
            })
            .collect();

        let all_or_nothing = domain.options.all_or_nothing;
        let mut answered_locally = false;
        let now_ms = self.store.now_ms();
        let stored = match self.over.answer(&checks, now_ms) {
            Some(known) => {
                metrics::counter!("ratekeeper_over_limit_cache_hits").increment(1);
                Ok(known)
            }
            None => self
                .store
                .apply(&checks, all_or_nothing)
                .await
                .inspect(|outcomes| self.over.learn(&checks, outcomes, now_ms)),
        };
        let outcomes = match stored {
            Ok(outcomes) => outcomes,
            Err(error) => {
                let mode = domain
                    .options
                    .failure_mode
                    .unwrap_or(self.settings.failure_mode);
                metrics::counter!("ratekeeper_store_errors").increment(1);
                metrics::counter!(format!("ratekeeper_store_error_fail_{mode}")).increment(1);
                tracing::warn!(%error, store = self.store.kind(), %mode, "store failed");
                match mode {
                    FailureMode::Open => {
                        return Ok(degraded(
                            allow_all(&applied, request.descriptors.len()),
                            mode,
                        ))
                    }
                    FailureMode::Closed => return Ok(degraded(refuse_all(&applied), mode)),
                    FailureMode::Unavailable => {
                        return Err(Status::unavailable(format!(
                            "the rate limit store failed: {error}"
                        )))
                    }
                    FailureMode::Local => {
                        let replicas = u64::from(self.settings.expected_replicas.max(1));
                        let local: Vec<Check> = checks
                            .iter()
                            .map(|c| Check {
                                limit: c.limit.div_ceil(replicas),
                                burst: c.burst.div_ceil(replicas),
                                ..c.clone()
                            })
                            .collect();
                        answered_locally = true;
                        self.local.apply(&local, all_or_nothing)
                    }
                }
            }
        };

        let mut tightest: Vec<LimitState> = Vec::new();
        let statuses = applied
            .iter()
            .zip(&request.descriptors)
            .map(|(applied, descriptor)| match applied {
                Applied::None => status(Code::Ok, None, 0, None),
                Applied::Unlimited => status(Code::Ok, None, u32::MAX, None),
                Applied::Counted {
                    rule,
                    rates,
                    checks: range,
                } => {
                    let states = rates
                        .iter()
                        .zip(&outcomes[range.clone()])
                        .zip(&checks[range.clone()])
                        .map(|((rate, outcome), check)| LimitState {
                            limit: rate.capacity(),
                            remaining: outcome.remaining,
                            reset_ms: outcome.reset_ms,
                            over: outcome.over && check.enforce,
                        });
                    let Some((at, state)) = LimitState::tightest(states) else {
                        return status(Code::Ok, None, 0, None);
                    };
                    if let Some(rule) = rule {
                        let any_over = outcomes[range.clone()].iter().any(|o| o.over);
                        self.record(
                            &request.domain,
                            rule,
                            descriptor,
                            &state,
                            any_over,
                            checks[range.start].hits,
                        );
                    }
                    tightest.push(state);
                    status(
                        if state.over {
                            Code::OverLimit
                        } else {
                            Code::Ok
                        },
                        Some(current_limit(&rates[at])),
                        u32::try_from(state.remaining).unwrap_or(u32::MAX),
                        Some(state.reset_ms),
                    )
                }
            })
            .collect::<Vec<_>>();

        let over = statuses.iter().any(|s| s.code == Code::OverLimit as i32);
        let headers_on = domain
            .options
            .response_headers
            .unwrap_or(self.settings.headers.enabled);
        let response_headers_to_add = match LimitState::tightest(tightest) {
            Some((_, state)) if headers_on => {
                headers::response_headers(&self.settings.headers.names, &state)
            }
            _ => Vec::new(),
        };
        let response = RateLimitResponse {
            overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
            statuses,
            response_headers_to_add,
            ..Default::default()
        };
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
        let result = self.decide(request.get_ref()).await;
        self.duration.record(started.elapsed().as_secs_f64());
        if let Err(status) = &result {
            tracing::debug!(code = ?status.code(), message = status.message(), "request refused");
        }
        result.map(Response::new)
    }
}

/// Checks the request against the caps and Envoy's own rules.
fn validate(request: &RateLimitRequest) -> Result<(), Status> {
    let invalid = |m: String| Err(Status::invalid_argument(m));
    if request.domain.is_empty() {
        return invalid("the rate limit domain must not be empty".into());
    }
    if request.domain.len() > caps::MAX_DOMAIN_BYTES {
        return invalid(format!(
            "the domain is longer than {} bytes",
            caps::MAX_DOMAIN_BYTES
        ));
    }
    if request.descriptors.is_empty() {
        return invalid("the rate limit descriptor list must not be empty".into());
    }
    if request.descriptors.len() > caps::MAX_DESCRIPTORS {
        return invalid(format!(
            "{} descriptors: at most {} are accepted per request",
            request.descriptors.len(),
            caps::MAX_DESCRIPTORS
        ));
    }
    for (i, descriptor) in request.descriptors.iter().enumerate() {
        if descriptor.entries.len() > caps::MAX_ENTRIES {
            return invalid(format!(
                "descriptors[{i}] has {} entries: at most {} are accepted",
                descriptor.entries.len(),
                caps::MAX_ENTRIES
            ));
        }
        if descriptor.is_negative_hits {
            return invalid(format!(
                "descriptors[{i}]: is_negative_hits is not supported"
            ));
        }
        for (j, entry) in descriptor.entries.iter().enumerate() {
            if entry.key.is_empty() {
                return invalid(format!(
                    "descriptors[{i}].entries[{j}]: the key must not be empty"
                ));
            }
            if entry.key.len() > caps::MAX_KEY_BYTES {
                return invalid(format!(
                    "descriptors[{i}].entries[{j}]: the key is longer than {} bytes",
                    caps::MAX_KEY_BYTES
                ));
            }
            if entry.value.len() > caps::MAX_VALUE_BYTES {
                return invalid(format!(
                    "descriptors[{i}].entries[{j}]: the value is longer than {} bytes",
                    caps::MAX_VALUE_BYTES
                ));
            }
        }
    }
    Ok(())
}

fn entries(descriptor: &RateLimitDescriptor) -> impl ExactSizeIterator<Item = (&str, &str)> {
    descriptor
        .entries
        .iter()
        .map(|e| (e.key.as_str(), e.value.as_str()))
}

/// Hits to consume for one descriptor: its own `hits_addend` when set (0
/// allowed: check only), else the request's, where 0 means 1.
fn hits(request: &RateLimitRequest, descriptor: &RateLimitDescriptor) -> u64 {
    let hits = match &descriptor.hits_addend {
        Some(own) => own.value,
        None => u64::from(request.hits_addend.max(1)),
    };
    hits.min(MAX_HITS)
}

/// A matched rule named in another matched rule's `replaces` does not apply.
fn drop_replaced(matched: &mut [Option<&Rule>]) {
    let replaced: Vec<&str> = matched
        .iter()
        .flatten()
        .flat_map(|rule| rule.replaces.iter().map(String::as_str))
        .collect();
    if replaced.is_empty() {
        return;
    }
    for slot in matched.iter_mut() {
        if slot.is_some_and(|rule| replaced.iter().any(|name| rule.is_named(name))) {
            *slot = None;
        }
    }
}

fn current_limit(rate: &Rate) -> RateLimit {
    RateLimit {
        name: rate.name.clone().unwrap_or_default(),
        requests_per_unit: rate.requests_per_unit,
        unit: rate.unit.to_envoy(),
    }
}

fn status(
    code: Code,
    limit: Option<RateLimit>,
    remaining: u32,
    reset_ms: Option<u64>,
) -> DescriptorStatus {
    DescriptorStatus {
        code: code as i32,
        current_limit: limit,
        limit_remaining: remaining,
        duration_until_reset: reset_ms.map(|ms| envoy_types::pb::google::protobuf::Duration {
            seconds: (ms / 1_000) as i64,
            nanos: ((ms % 1_000) * 1_000_000) as i32,
        }),
        quota: None,
    }
}

/// All-OK answer: for an unknown domain (`applied` empty) or when the store
/// failed and the request is let through (its limits still reported).
fn allow_all(applied: &[Applied<'_>], descriptors: usize) -> RateLimitResponse {
    let statuses = (0..descriptors)
        .map(|i| match applied.get(i) {
            Some(Applied::Counted { rates, .. }) => {
                status(Code::Ok, rates.first().map(current_limit), 0, None)
            }
            Some(Applied::Unlimited) => status(Code::Ok, None, u32::MAX, None),
            _ => status(Code::Ok, None, 0, None),
        })
        .collect();
    RateLimitResponse {
        overall_code: Code::Ok as i32,
        statuses,
        ..Default::default()
    }
}

/// Refuses every limited descriptor (`failure_mode: closed`).
fn refuse_all(applied: &[Applied<'_>]) -> RateLimitResponse {
    let statuses: Vec<DescriptorStatus> = applied
        .iter()
        .map(|a| match a {
            Applied::Counted { rates, .. } => {
                status(Code::OverLimit, rates.first().map(current_limit), 0, None)
            }
            Applied::Unlimited => status(Code::Ok, None, u32::MAX, None),
            Applied::None => status(Code::Ok, None, 0, None),
        })
        .collect();
    let over = statuses.iter().any(|s| s.code == Code::OverLimit as i32);
    RateLimitResponse {
        overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
        statuses,
        ..Default::default()
    }
}

/// Marks an answer given without the store: `dynamic_metadata` carries
/// `ratekeeper.store_error` = the failure mode, for Envoy's logs.
fn degraded(mut response: RateLimitResponse, mode: FailureMode) -> RateLimitResponse {
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
    let mut metadata = Struct::default();
    metadata.fields.insert(
        "ratekeeper.store_error".into(),
        Value {
            kind: Some(Kind::StringValue(mode.name().into())),
        },
    );
    response.dynamic_metadata = Some(metadata);
    response
}

/// The `detailed_metric` label values seen so far, capped: a flood of random
/// user ids must not grow `/metrics` (and memory) without bound. Past the cap,
/// new values are counted under the label `overflow`.
#[derive(Debug, Default)]
pub struct DetailedSeries {
    cap: usize,
    seen: Mutex<HashSet<String>>,
}

/// The label detailed counters past the cap share.
pub const OVERFLOW_LABEL: &str = "overflow";

impl DetailedSeries {
    pub fn new(cap: usize) -> Self {
        DetailedSeries {
            cap,
            seen: Mutex::new(HashSet::new()),
        }
    }

    fn label(&self, value: String) -> String {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.contains(&value) || seen.len() < self.cap && seen.insert(value.clone()) {
            value
        } else {
            OVERFLOW_LABEL.to_owned()
        }
    }
}

impl RateLimiter {
    /// Per-rule hit counters, as envoyproxy/ratelimit keeps them; with
    /// `detailed_metric` also per descriptor value. `state` is the
    /// descriptor's tightest limit; `any_over` includes shadow-mode limits.
    fn record(
        &self,
        domain: &str,
        rule: &Rule,
        descriptor: &RateLimitDescriptor,
        state: &LimitState,
        any_over: bool,
        hits: u64,
    ) {
        let used = state.limit.saturating_sub(state.remaining);
        let near = used as f64 > (state.limit as f64 * NEAR_LIMIT_RATIO).floor();
        let count = |m: &RuleMetrics| {
            m.total_hits.increment(hits);
            if any_over {
                m.over_limit.increment(hits);
                if rule.shadow_mode {
                    m.shadow_mode.increment(hits);
                }
            } else if near {
                m.near_limit.increment(hits);
            } else {
                m.within_limit.increment(hits);
            }
        };
        count(&rule.metrics);
        if rule.detailed_metric {
            let detailed: Vec<String> = descriptor
                .entries
                .iter()
                .map(|e| format!("{}_{}", e.key, self.settings.values.encode(&e.value)))
                .collect();
            count(&RuleMetrics::register(
                domain,
                &self.detailed.label(detailed.join(".")),
            ));
        }
    }
}
