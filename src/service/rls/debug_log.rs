//! The lines `LOG_LEVEL=debug` writes for each `ShouldRateLimit`, as theirs
//! says at debug what it looked up and decided: the way to answer "why was
//! this request limited?". One line a descriptor: its entries, the rule it
//! matched (its stats path) or none, its answer, and per limit the counter
//! key, the hits asked, what is left and whether it was over. Written only
//! when debug is on for this module: the request path pays one check.

use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

use super::plan::{Applied, Plan};
use crate::limiter::Outcome;

/// Writes the request's lines when debug is on.
pub fn decision(
    request: &RateLimitRequest,
    plan: &Plan<'_>,
    outcomes: &[Outcome],
    response: &RateLimitResponse,
) {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return;
    }
    let overall = response.overall_code().as_str_name();
    for (i, descriptor) in request.descriptors.iter().enumerate() {
        let entries = descriptor
            .entries
            .iter()
            .map(|e| format!("{}={}", e.key, e.value))
            .collect::<Vec<_>>()
            .join(",");
        let code = response
            .statuses
            .get(i)
            .map_or("OK", |s| s.code().as_str_name());
        let (rule, limits) = match plan.applied.get(i) {
            Some(Applied::Counted { rule, checks, .. }) => {
                let rule = rule.map_or("(override)", |r| r.path.as_str());
                (
                    rule,
                    limits(&plan.checks[checks.clone()], outcomes.get(checks.clone())),
                )
            }
            Some(Applied::Unlimited(_)) => ("(unlimited)", String::new()),
            _ => ("(none)", String::new()),
        };
        tracing::debug!(
            domain = %request.domain,
            descriptor = i,
            %entries,
            rule,
            code,
            limits,
            overall,
            "descriptor decided"
        );
    }
}

/// Per limit: `key hits=… remaining=… over=…`, `;`-separated.
fn limits(checks: &[crate::limiter::Check], outcomes: Option<&[Outcome]>) -> String {
    checks
        .iter()
        .enumerate()
        .map(|(j, check)| match outcomes.and_then(|o| o.get(j)) {
            Some(o) => format!(
                "{} hits={} remaining={} over={} reset_ms={}",
                check.key, check.hits, o.remaining, o.over, o.reset_ms
            ),
            None => format!("{} hits={}", check.key, check.hits),
        })
        .collect::<Vec<_>>()
        .join("; ")
}
