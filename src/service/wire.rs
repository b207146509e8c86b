//! The wire types both services share a way of reading or writing: the two
//! descriptor messages (Envoy's `RateLimitDescriptor` and
//! `ratekeeper.v1.Descriptor`) as `(key, value)` entries, durations, and
//! ratekeeper's own services' answer when their store fails.

use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;

use tonic::Status;

use crate::log_pace::Paced;
use crate::pb::v1;

/// `UNAVAILABLE` for a call of ratekeeper's own services (`what`: the
/// lease or the budget store) whose store failed, logged at most once a
/// second: no failure mode applies there, so the caller decides.
pub fn store_failed(what: &str, error: crate::Error) -> Status {
    static LOG: Paced = Paced::new();
    if let Some(left_out) = LOG.admit() {
        tracing::warn!(%error, left_out, "{what} store call failed");
    }
    Status::unavailable(format!("the {what} store failed: {error}"))
}

/// A descriptor message, read as its `(key, value)` entries.
pub trait Entries {
    fn entries(&self) -> impl ExactSizeIterator<Item = (&str, &str)> + Clone;
}

impl Entries for RateLimitDescriptor {
    fn entries(&self) -> impl ExactSizeIterator<Item = (&str, &str)> + Clone {
        self.entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()))
    }
}

impl Entries for v1::Descriptor {
    fn entries(&self) -> impl ExactSizeIterator<Item = (&str, &str)> + Clone {
        self.entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()))
    }
}

/// Milliseconds as a protobuf `Duration`.
pub fn duration(ms: u64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: (ms / 1_000) as i64,
        nanos: ((ms % 1_000) * 1_000_000) as i32,
    }
}

/// The TTL a caller asked for in `field` (`None`: none asked), checked
/// against the allowed `range`; `INVALID_ARGUMENT` naming the field otherwise.
pub fn requested_ttl(
    asked: Option<&prost_types::Duration>,
    (min, max): (Duration, Duration),
    field: &str,
) -> Result<Option<Duration>, Status> {
    let Some(asked) = asked else {
        return Ok(None);
    };
    // Refused before converting: prost-types negates a negative `seconds`,
    // which overflows on i64::MIN.
    let negative = || Status::invalid_argument(format!("{field} must not be negative"));
    if asked.seconds < 0 || (asked.seconds == 0 && asked.nanos < 0) {
        return Err(negative());
    }
    // A Duration's nanos are 0 to 10^9 - 1 when its seconds are positive
    // (the conversion would carry others into the seconds).
    if !(0..1_000_000_000).contains(&asked.nanos) {
        return Err(Status::invalid_argument(format!(
            "{field}.nanos must be 0 to 999999999, not {}",
            asked.nanos
        )));
    }
    let ttl = Duration::try_from(*asked).map_err(|_| negative())?;
    if ttl < min || ttl > max {
        return Err(Status::invalid_argument(format!(
            "{field} must be between {min:?} and {max:?}"
        )));
    }
    Ok(Some(ttl))
}

/// [`duration`] as Envoy's copy of the `Duration` message.
pub fn envoy_duration(ms: u64) -> envoy_types::pb::google::protobuf::Duration {
    let prost_types::Duration { seconds, nanos } = duration(ms);
    envoy_types::pb::google::protobuf::Duration { seconds, nanos }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_keep_milliseconds() {
        let d = envoy_duration(61_250);
        assert_eq!((d.seconds, d.nanos), (61, 250_000_000));
        assert_eq!(
            duration(999),
            prost_types::Duration {
                seconds: 0,
                nanos: 999_000_000
            }
        );
    }

    #[test]
    fn ttls_outside_the_range_name_the_field() {
        let range = (Duration::from_secs(1), Duration::from_secs(60));
        let ask = |seconds| prost_types::Duration { seconds, nanos: 0 };
        assert_eq!(requested_ttl(None, range, "ttl").ok(), Some(None));
        assert_eq!(
            requested_ttl(Some(&ask(5)), range, "ttl").ok(),
            Some(Some(Duration::from_secs(5)))
        );
        for bad in [i64::MIN, -1, 0, 61] {
            let e = requested_ttl(Some(&ask(bad)), range, "lease_ttl").unwrap_err();
            assert!(e.message().starts_with("lease_ttl must"), "{}", e.message());
        }
        let unnormalized = prost_types::Duration {
            seconds: 0,
            nanos: i32::MAX,
        };
        let e = requested_ttl(Some(&unnormalized), range, "ttl").unwrap_err();
        assert_eq!(
            e.message(),
            "ttl.nanos must be 0 to 999999999, not 2147483647"
        );
        // One second less 5 ns is not negative, but not a Duration either.
        let mixed = prost_types::Duration {
            seconds: 1,
            nanos: -5,
        };
        let e = requested_ttl(Some(&mixed), range, "ttl").unwrap_err();
        assert_eq!(e.message(), "ttl.nanos must be 0 to 999999999, not -5");
        let negative = prost_types::Duration {
            seconds: 0,
            nanos: -5,
        };
        let e = requested_ttl(Some(&negative), range, "ttl").unwrap_err();
        assert_eq!(e.message(), "ttl must not be negative");
    }
}
