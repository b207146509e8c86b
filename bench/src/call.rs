//! One operation of a run, as `--mode` says: a ShouldRateLimit call
//! (`rls`), or a BudgetService Reserve of `--estimate` then a Settle of that
//! reservation at `--actual` on the same descriptors (`budget`), the pair
//! timed and counted as one operation (a refused Reserve is the operation's
//! OVER_LIMIT, with no Settle).

use std::time::Duration;

use clap::ValueEnum;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tonic::transport::Channel;
use tonic::Status;

use crate::args::Args;
use crate::budget_api::{BudgetClient, ReserveRequest};
use crate::tally::CallResult;
use crate::v1_wire::{Descriptor, Entry};

/// What one operation is (`--mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// One ShouldRateLimit call.
    Rls,
    /// One Reserve, then one Settle of what it reserved.
    Budget,
}

impl Mode {
    /// The name the JSON line carries.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Rls => "rls",
            Mode::Budget => "budget",
        }
    }
}

/// A task's client for its operations.
pub enum Caller {
    Rls(RateLimitServiceClient<Channel>),
    Budget {
        client: BudgetClient,
        estimate: u64,
        actual: u64,
    },
}

impl Caller {
    pub fn new(args: &Args, channel: Channel) -> Self {
        match args.mode {
            Mode::Rls => Caller::Rls(RateLimitServiceClient::new(channel)),
            Mode::Budget => Caller::Budget {
                client: BudgetClient::new(channel),
                estimate: args.estimate,
                actual: args.actual,
            },
        }
    }

    /// One operation on `request`'s domain and descriptors, within `timeout`.
    pub async fn call(&mut self, request: RateLimitRequest, timeout: Duration) -> CallResult {
        let answer = match self {
            Caller::Rls(client) => {
                // Sent as `grpc-timeout`, as Envoy sends its filter's
                // timeout (the server keeps a timer per call for it).
                let mut request = tonic::Request::new(request);
                request.set_timeout(timeout);
                let call = client.should_rate_limit(request);
                match tokio::time::timeout(timeout, call).await {
                    Ok(answer) => answer.map(|r| r.into_inner().overall_code),
                    Err(_) => return Err(format!("no answer within {timeout:?}")),
                }
            }
            Caller::Budget {
                client,
                estimate,
                actual,
            } => {
                let pair = reserve_then_settle(client, request, *estimate, *actual, timeout);
                match tokio::time::timeout(timeout, pair).await {
                    Ok(answer) => answer,
                    Err(_) => return Err(format!("no answer within {timeout:?}")),
                }
            }
        };
        answer.map_err(|status| format!("{:?}: {}", status.code(), status.message()))
    }
}

/// Reserves `estimate` on the request's descriptors and settles it at
/// `actual`, each call under `timeout`; answers OK, or OVER_LIMIT when the
/// Reserve was refused.
async fn reserve_then_settle(
    client: &mut BudgetClient,
    request: RateLimitRequest,
    estimate: u64,
    actual: u64,
    timeout: Duration,
) -> Result<i32, Status> {
    let descriptors = request
        .descriptors
        .into_iter()
        .map(|d| Descriptor {
            entries: d
                .entries
                .into_iter()
                .map(|e| Entry {
                    key: e.key,
                    value: e.value,
                })
                .collect(),
        })
        .collect();
    let reserve = ReserveRequest {
        domain: request.domain,
        descriptors,
        estimate,
        ttl: None,
    };
    let reserved = client.reserve(reserve, timeout).await?;
    if !reserved.granted {
        return Ok(Code::OverLimit as i32);
    }
    // Empty when no rule limits the descriptors: nothing to settle.
    if !reserved.reservation_id.is_empty() {
        client
            .settle(reserved.reservation_id, actual, timeout)
            .await?;
    }
    Ok(Code::Ok as i32)
}
