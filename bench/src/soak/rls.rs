//! The soak run's ShouldRateLimit load: three open-loop streams (values
//! never used before, the one value `hot`, and the audit values), each call
//! to a replica picked at random, each answer classified (decided by the
//! store or by the failure mode, OK or over, late or not).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tokio::time::MissedTickBehavior;

use crate::keys::Rng;
use crate::soak::audit::Admission;
use crate::soak::Soak;

/// The key ratekeeper's answers carry in `dynamic_metadata` when the store
/// did not decide them (the value is the failure mode that did).
pub const STORE_ERROR: &str = "ratekeeper.store_error";

/// Which values a stream asks about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Distinct,
    Hot,
    Audit,
}

/// Sends `rate` calls a second of `stream` until the run ends, each due at
/// its tick (open loop: a slow answer does not delay the next call).
pub async fn run_stream(soak: Arc<Soak>, stream: Stream, rate: f64, seed: u64) {
    if rate <= 0.0 {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    // Ticks missed while the machine was busy are sent at once, so the
    // offered load stays `rate` on average.
    tick.set_missed_tick_behavior(MissedTickBehavior::Burst);
    let mut rng = Rng(seed);
    let mut sent: u64 = 0;
    loop {
        if tick.tick().await.into_std() >= soak.end {
            break;
        }
        let replica = rng.below(soak.rls.len() as u64) as usize;
        if soak.in_flight.fetch_add(1, Ordering::Relaxed) >= soak.args.max_in_flight {
            soak.in_flight.fetch_sub(1, Ordering::Relaxed);
            soak.recorder
                .count(SystemTime::now(), replica, |c| c.skipped += 1);
            continue;
        }
        let value = match stream {
            Stream::Distinct => {
                let mut value = String::new();
                soak.keys.pick(&mut rng, &mut value);
                value
            }
            Stream::Hot => "hot".to_owned(),
            Stream::Audit => format!("a{}", sent % soak.args.audit_keys),
        };
        sent += 1;
        tokio::spawn(call(soak.clone(), stream, replica, value));
    }
}

/// One call, its answer recorded.
async fn call(soak: Arc<Soak>, stream: Stream, replica: usize, value: String) {
    let args = &soak.args;
    let domain = if stream == Stream::Audit {
        &args.audit_domain
    } else {
        &args.domain
    };
    let deadline = Duration::from_millis(args.deadline_ms);
    let mut request = tonic::Request::new(RateLimitRequest {
        domain: domain.clone(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: args.key.clone(),
                value: value.clone(),
            }],
            ..Default::default()
        }],
        hits_addend: 0,
    });
    // What Envoy does: the server learns the caller's deadline.
    request.set_timeout(deadline);
    let mut client = soak.rls[replica].clone();
    let sent = SystemTime::now();
    let started = Instant::now();
    let timeout = Duration::from_millis(args.timeout_ms);
    let result = tokio::time::timeout(timeout, client.should_rate_limit(request)).await;
    let late = started.elapsed() > deadline;
    let answered = SystemTime::now();
    let response = match result {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(format!(
            "ShouldRateLimit: {:?}: {}",
            status.code(),
            status.message()
        )),
        Err(_) => Err(format!("ShouldRateLimit: no answer within {timeout:?}")),
    };
    let outcome = Outcome::of(&response);
    soak.recorder.count(sent, replica, |c| {
        c.late += u64::from(late);
        match outcome {
            Outcome::StoreOk => c.store_ok += 1,
            Outcome::StoreOver => c.store_over += 1,
            Outcome::WithoutStore { .. } => c.without_store += 1,
            Outcome::Error => c.errors += 1,
        }
    });
    match response {
        Ok(response) if stream == Stream::Audit && outcome.admitted() => {
            let from_store = outcome == Outcome::StoreOk;
            soak.recorder.admit(Admission::new(
                &value, replica, sent, answered, &response, from_store,
            ));
        }
        Ok(response) if outcome == Outcome::Error => soak.recorder.error(format!(
            "ShouldRateLimit: overall code {}",
            response.overall_code
        )),
        Ok(_) => {}
        Err(message) => soak.recorder.error(message),
    }
    soak.in_flight.fetch_sub(1, Ordering::Relaxed);
}

/// How an answer counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    StoreOk,
    StoreOver,
    /// The failure mode decided; `ok`: it admitted.
    WithoutStore {
        ok: bool,
    },
    /// A gRPC error, no answer, or an answer with neither code.
    Error,
}

impl Outcome {
    pub fn of<E>(response: &Result<RateLimitResponse, E>) -> Self {
        let Ok(response) = response else {
            return Outcome::Error;
        };
        let without_store = response
            .dynamic_metadata
            .as_ref()
            .is_some_and(|m| m.fields.contains_key(STORE_ERROR));
        let code = Code::try_from(response.overall_code);
        match (without_store, code) {
            (true, Ok(code)) => Outcome::WithoutStore {
                ok: code == Code::Ok,
            },
            (false, Ok(Code::Ok)) => Outcome::StoreOk,
            (false, Ok(Code::OverLimit)) => Outcome::StoreOver,
            _ => Outcome::Error,
        }
    }

    /// The request was let through.
    pub fn admitted(self) -> bool {
        matches!(self, Outcome::StoreOk | Outcome::WithoutStore { ok: true })
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::google::protobuf::{value, Struct, Value};

    use super::*;

    fn answer(code: Code, store_error: bool) -> Result<RateLimitResponse, ()> {
        let mut response = RateLimitResponse {
            overall_code: code as i32,
            ..Default::default()
        };
        if store_error {
            let mut metadata = Struct::default();
            metadata.fields.insert(
                STORE_ERROR.to_owned(),
                Value {
                    kind: Some(value::Kind::StringValue("open".to_owned())),
                },
            );
            response.dynamic_metadata = Some(metadata);
        }
        Ok(response)
    }

    #[test]
    fn answers_without_the_store_are_told_apart_by_their_metadata() {
        assert_eq!(Outcome::of(&answer(Code::Ok, false)), Outcome::StoreOk);
        assert_eq!(
            Outcome::of(&answer(Code::OverLimit, false)),
            Outcome::StoreOver
        );
        let open = Outcome::of(&answer(Code::Ok, true));
        assert_eq!(open, Outcome::WithoutStore { ok: true });
        assert!(open.admitted());
        let closed = Outcome::of(&answer(Code::OverLimit, true));
        assert!(!closed.admitted());
        assert_eq!(Outcome::of(&answer(Code::Unknown, false)), Outcome::Error);
        assert_eq!(
            Outcome::of(&Err::<RateLimitResponse, ()>(())),
            Outcome::Error
        );
    }
}
