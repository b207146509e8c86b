//! The admin API's two operations on one descriptor's counters: inspect
//! (the matched rule and each limit's state, read without consuming) and
//! reset (every counter of the rule deleted). Both find the rule and the
//! keys exactly as a decision does ([`Plan`]), so they see the counters a
//! request of the same descriptor would use.
//!
//! Inspecting is a check of 0 hits: every algorithm (Rust and Lua) reports
//! its state and saves nothing when a check adds no hit (the sliding log's
//! load may still trim entries already aged out, which changes no count).

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use serde::Serialize;

use super::plan::{self, Applied, Plan};
use super::RateLimiter;

/// Why an admin operation could not be done.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The descriptor cannot be evaluated (HTTP 400).
    #[error("{0}")]
    BadInput(String),
    /// No limits file or xDS resource defines the domain (HTTP 404).
    #[error("unknown domain {0:?}")]
    UnknownDomain(String),
    /// The store did not answer (HTTP 503); the store's error says so.
    #[error("{0}")]
    Store(String),
}

/// A descriptor's rule and the state of its counters.
#[derive(Debug, Serialize)]
pub struct DescriptorState {
    /// The matched rule's path (`domain`-relative, as in metrics), or
    /// `None` when no rule matches (the descriptor is never limited).
    pub rule: Option<String>,
    pub unlimited: bool,
    pub shadow_mode: bool,
    pub limits: Vec<LimitState>,
}

/// One limit of a rule, now.
#[derive(Debug, Serialize)]
pub struct LimitState {
    pub algorithm: &'static str,
    pub unit: &'static str,
    pub requests_per_unit: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Hits it would still admit now.
    pub remaining: u64,
    /// Milliseconds ShouldRateLimit's `duration_until_reset` gives a
    /// request of one hit (per algorithm: README's table; a bucket that is
    /// over, until one hit fits).
    pub reset_ms: u64,
    /// Whether a request of one hit would be refused now.
    pub over: bool,
    /// Refused by this replica's over-limit cache until its window ends,
    /// whatever the store holds (the counter was reset on another replica):
    /// then `remaining`, `reset_ms` and `over` are the cache's answer.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub over_limit_cache: bool,
    /// The counter's key in the store (for `redis-cli`).
    pub key: String,
}

impl RateLimiter {
    /// The rule `entries` match in `domain`, and each of its limits' state,
    /// from the same store and clock as decisions; consumes nothing.
    pub async fn inspect(
        &self,
        domain: &str,
        entries: &[(String, String)],
    ) -> Result<DescriptorState, AdminError> {
        let request = peek_request(domain, entries);
        let config = self.config.current();
        let plan = self.admin_plan(&config, &request)?;
        let outcomes = self
            .stores
            .apply(&plan.checks, false)
            .await
            .map_err(|e| AdminError::Store(e.to_string()))?;
        let mut state = rule_of(&plan);
        if let Applied::Counted { rates, checks, .. } = &plan.applied[0] {
            let pairs = rates.iter().zip(&plan.checks[checks.clone()]);
            let now_ms = self.stores.main().now_ms();
            state.limits = pairs
                .zip(&outcomes[checks.clone()])
                .map(|((rate, check), outcome)| {
                    // What the next request meets here: the cache first.
                    let cached = self
                        .over
                        .iter()
                        .find_map(|(_, over)| over.peek(check, now_ms));
                    let outcome = cached.as_ref().unwrap_or(outcome);
                    LimitState {
                        algorithm: rate.algorithm.name(),
                        unit: rate.unit.name(),
                        requests_per_unit: rate.requests_per_unit,
                        name: rate.name.clone(),
                        remaining: outcome.remaining,
                        reset_ms: outcome.reset_ms,
                        over: outcome.remaining == 0,
                        over_limit_cache: cached.is_some(),
                        key: check.key.clone(),
                    }
                })
                .collect();
        }
        Ok(state)
    }

    /// Deletes every counter of the rule `entries` match in `domain` (each
    /// key atomically; missing keys are a no-op) and forgets them in this
    /// replica's over-limit cache. Returns the rule and the keys deleted.
    pub async fn reset(
        &self,
        domain: &str,
        entries: &[(String, String)],
    ) -> Result<(Option<String>, Vec<String>), AdminError> {
        let request = peek_request(domain, entries);
        let config = self.config.current();
        let plan = self.admin_plan(&config, &request)?;
        let keys: Vec<String> = plan.checks.iter().map(|c| c.key.clone()).collect();
        self.stores
            .delete(&plan.checks)
            .await
            .map_err(|e| AdminError::Store(e.to_string()))?;
        for (_, over) in self.over.iter() {
            over.forget(&keys);
        }
        Ok((rule_of(&plan).rule, keys))
    }

    fn admin_plan<'c>(
        &self,
        config: &'c crate::config::Config,
        request: &RateLimitRequest,
    ) -> Result<Plan<'c>, AdminError> {
        if request.descriptors[0].entries.is_empty() {
            return Err(AdminError::BadInput(
                "a descriptor needs at least one entry".into(),
            ));
        }
        plan::validate(request).map_err(|s| AdminError::BadInput(s.message().to_owned()))?;
        let domain = config
            .domain(&request.domain)
            .ok_or_else(|| AdminError::UnknownDomain(request.domain.clone()))?;
        Plan::new(request, &domain.rules, &self.settings)
            .map_err(|s| AdminError::BadInput(s.message().to_owned()))
    }
}

/// A request of one descriptor of 0 hits.
fn peek_request(domain: &str, entries: &[(String, String)]) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(key, value)| Entry {
                    key: key.clone(),
                    value: value.clone(),
                })
                .collect(),
            hits_addend: Some(UInt64Value { value: 0 }),
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

/// The plan's one descriptor's rule, without its limits' states.
fn rule_of(plan: &Plan<'_>) -> DescriptorState {
    let (rule, unlimited, shadow_mode) = match &plan.applied[0] {
        Applied::None => (None, false, false),
        Applied::Unlimited(rule) => (Some(rule.path.clone()), true, false),
        Applied::Counted { rule, .. } => (
            rule.map(|r| r.path.clone()),
            false,
            rule.is_some_and(|r| r.shadow_mode),
        ),
    };
    DescriptorState {
        rule,
        unlimited,
        shadow_mode,
        limits: Vec::new(),
    }
}
