//! The audit answers: every OK answer on an audit value, with when it was
//! sent and answered, which fixed window the server counted it in, and
//! whether the store decided it. From these and the harness's record of
//! when Redis lost its data, the report checks that the OK answers decided
//! by the store never exceed the limit per value and window
//! (`bench/soak_report.py` defines the check).

use std::time::SystemTime;

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use serde::Serialize;

use crate::soak::timeline::unix_millis;

/// One admitted audit answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Admission {
    /// The descriptor value (`a0`, `a1`, …).
    pub value: String,
    pub replica: usize,
    /// Unix ms the call was sent and answered.
    pub sent_ms: u64,
    pub answered_ms: u64,
    /// Unix ms the server's window ends (answer time + the status's
    /// `duration_until_reset`); absent when the answer gives none.
    pub window_end_ms: Option<u64>,
    /// Decided by the store (false: the failure mode admitted it).
    pub from_store: bool,
}

impl Admission {
    /// The record of `response`, an OK answer on `value`.
    pub fn new(
        value: &str,
        replica: usize,
        sent: SystemTime,
        answered: SystemTime,
        response: &RateLimitResponse,
        from_store: bool,
    ) -> Self {
        let answered_ms = unix_millis(answered);
        let window_end_ms = response
            .statuses
            .first()
            .and_then(|s| s.duration_until_reset.as_ref())
            .and_then(|d| {
                let ms = d.seconds.checked_mul(1000)? + i64::from(d.nanos / 1_000_000);
                answered_ms.checked_add_signed(ms)
            });
        Admission {
            value: value.to_owned(),
            replica,
            sent_ms: unix_millis(sent),
            answered_ms,
            window_end_ms,
            from_store,
        }
    }
}

/// The admissions as JSON lines.
pub fn json_lines(admissions: &[Admission]) -> serde_json::Result<String> {
    let mut out = String::new();
    for a in admissions {
        out.push_str(&serde_json::to_string(a)?);
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::DescriptorStatus;
    use envoy_types::pb::google::protobuf;

    use super::*;

    #[test]
    fn the_window_end_is_the_answer_time_plus_the_time_until_reset() {
        let response = RateLimitResponse {
            statuses: vec![DescriptorStatus {
                duration_until_reset: Some(protobuf::Duration {
                    seconds: 41,
                    nanos: 250_000_000,
                }),
                ..Default::default()
            }],
            ..Default::default()
        };
        let sent = UNIX_EPOCH + Duration::from_millis(1_000);
        let answered = sent + Duration::from_millis(5);
        let a = Admission::new("a1", 1, sent, answered, &response, true);
        assert_eq!((a.sent_ms, a.answered_ms), (1_000, 1_005));
        assert_eq!(a.window_end_ms, Some(42_255));
        let none = Admission::new("a1", 0, sent, answered, &Default::default(), false);
        assert_eq!(none.window_end_ms, None);
        let line = json_lines(&[a]).unwrap();
        assert!(
            line.starts_with("{\"value\":\"a1\",\"replica\":1,"),
            "{line}"
        );
    }
}
