//! Reservation ids (`BudgetService`): opaque to callers, self-describing to
//! every replica.
//!
//! `r1.<nonce>.<ttl ms>.<descriptors>.<descriptor>:<limit>:<hex key>[. ...]`
//!
//! `r1.` is the format's version (a later format gets another prefix, so a
//! replica never misreads an id minted by a newer one). The nonce is 128
//! random bits, the part nobody can guess. Then one part per counter key the
//! reservation took its estimate from, in the order of its checks: the
//! index of the Reserve's descriptor the key belongs to (so Settle answers
//! one status per descriptor with the descriptor count), the limit it
//! reports, and the key in hex. Any replica settles any reservation from
//! the id alone: nothing to look up.
//!
//! The id is not trusted: what a settle gives back or charges is what the
//! store's marker for the nonce recorded (the estimate, each limit's
//! fields), and only if the marker names exactly the id's keys. A forged or
//! altered id therefore touches nothing (the store answers Unknown); at
//! worst an altered limit misreports the `limit` of its own answer.

use std::fmt::Write;
use std::time::Duration;

use super::caps::MAX_DESCRIPTORS;
use super::id_parts::{count, from_hex, is_nonce, push_hex, quote_start, random_nonce};

/// The version prefix of every reservation id this format mints.
pub const PREFIX: &str = "r1.";

/// Longest reservation id accepted (and minted: a Reserve whose keys would
/// not fit is refused before it takes anything).
pub const MAX_RESERVATION_ID_BYTES: usize = 64 * 1024;

/// A Reserve's TTL when it asks for none.
pub const DEFAULT_TTL: Duration = Duration::from_secs(5 * 60);

/// The TTLs a Reserve may ask for: long enough for a slow call, short
/// enough that a forgotten reservation gives its budget back the same hour.
pub const TTL_RANGE: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(3600));

/// One counter key a reservation took its estimate from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservedKey {
    pub key: String,
    /// Index of the Reserve's descriptor this key's limit belongs to.
    pub descriptor: usize,
    /// What the limit admits at once (its `requests_per_unit`; a bucket's
    /// `burst`), for the answers.
    pub limit: u64,
}

/// A decoded reservation id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationId {
    pub nonce: String,
    pub ttl_ms: u64,
    /// How many descriptors the Reserve had.
    pub descriptors: usize,
    pub keys: Vec<ReservedKey>,
}

impl ReservationId {
    /// A new reservation with a fresh random nonce.
    pub fn new(ttl_ms: u64, descriptors: usize, keys: Vec<ReservedKey>) -> Self {
        ReservationId {
            nonce: random_nonce(),
            ttl_ms,
            descriptors,
            keys,
        }
    }

    /// The counter keys, in the order of the reservation's checks.
    pub fn counter_keys(&self) -> Vec<String> {
        self.keys.iter().map(|k| k.key.clone()).collect()
    }

    pub fn encode(&self) -> String {
        let hex: usize = self.keys.iter().map(|k| 2 * k.key.len() + 32).sum();
        let mut id = String::with_capacity(PREFIX.len() + self.nonce.len() + 32 + hex);
        // Writing to a String cannot fail.
        let _ = write!(
            id,
            "{PREFIX}{}.{}.{}",
            self.nonce, self.ttl_ms, self.descriptors
        );
        for key in &self.keys {
            let _ = write!(id, ".{}:{}:", key.descriptor, key.limit);
            push_hex(&mut id, &key.key);
        }
        id
    }

    /// Decodes `id`, accepting only counter keys under `key_prefix`.
    pub fn decode(id: &str, key_prefix: &str) -> Result<ReservationId, String> {
        if id.is_empty() {
            return Err("the reservation id is empty".into());
        }
        if id.len() > MAX_RESERVATION_ID_BYTES {
            return Err(format!(
                "reservation id longer than {MAX_RESERVATION_ID_BYTES} bytes"
            ));
        }
        let Some(rest) = id.strip_prefix(PREFIX) else {
            return Err(format!(
                "{} is not a reservation id of this version (they start with {PREFIX:?})",
                quote_start(id)
            ));
        };
        let bad = |what: &str| format!("malformed reservation id {}: {what}", quote_start(id));
        let mut parts = rest.split('.');
        let Some(nonce) = parts.next().filter(|n| is_nonce(n)) else {
            return Err(bad("its nonce is not 32 hex digits"));
        };
        let Some(ttl_ms) = parts.next().and_then(count) else {
            return Err(bad("its TTL is not a whole number of milliseconds"));
        };
        let Some(descriptors) = parts
            .next()
            .and_then(count)
            .and_then(|d| usize::try_from(d).ok())
        else {
            return Err(bad("its descriptor count is not a whole number"));
        };
        // Only the service mints ids, always with a TTL in range: a TTL
        // outside it is a forgery (the store's marker keeps its own expiry).
        let (min, max) = TTL_RANGE;
        if !(min.as_millis()..=max.as_millis()).contains(&u128::from(ttl_ms)) {
            return Err(bad(&format!("a TTL outside {min:?}..={max:?}")));
        }
        if !(1..=MAX_DESCRIPTORS).contains(&descriptors) {
            return Err(bad(&format!(
                "a descriptor count outside 1..={MAX_DESCRIPTORS}"
            )));
        }
        let keys = parts
            .map(|part| reserved_key(part, descriptors, key_prefix))
            .collect::<Option<Vec<ReservedKey>>>()
            .filter(|keys| !keys.is_empty())
            .ok_or_else(|| bad("its keys are not counter keys of this service"))?;
        Ok(ReservationId {
            nonce: nonce.to_owned(),
            ttl_ms,
            descriptors,
            keys,
        })
    }
}

/// One `<descriptor>:<limit>:<hex key>` part, if well formed.
fn reserved_key(part: &str, descriptors: usize, key_prefix: &str) -> Option<ReservedKey> {
    let mut fields = part.splitn(3, ':');
    let descriptor = usize::try_from(count(fields.next()?)?).ok()?;
    let limit = count(fields.next()?)?;
    let key = from_hex(fields.next()?)?;
    (descriptor < descriptors && is_counter_key(&key, key_prefix)).then_some(ReservedKey {
        key,
        descriptor,
        limit,
    })
}

/// Whether `key` has the shape `keys::counter_key` gives: the prefix, a
/// `{...}` hash tag, and a rule id without braces. No control byte (a
/// counter key escapes them): a marker joins a slot's keys with newlines,
/// so one key holding a newline must not pass for two.
fn is_counter_key(key: &str, key_prefix: &str) -> bool {
    let Some(rest) = key.strip_prefix(key_prefix) else {
        return false;
    };
    if rest.contains(|c: char| c.is_ascii_control()) {
        return false;
    }
    match rest.rfind("}:") {
        Some(end) => {
            let rule = &rest[end + 2..];
            rest.starts_with('{') && !rule.is_empty() && !rule.contains(['{', '}'])
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reservation() -> ReservationId {
        ReservationId::new(
            300_000,
            3,
            vec![
                ReservedKey {
                    key: "rk:{d|user=a.b}:fw.60".into(),
                    descriptor: 0,
                    limit: 1000,
                },
                ReservedKey {
                    key: "rk:{d|org=x}:tb.3600".into(),
                    descriptor: 2,
                    limit: 100_000,
                },
            ],
        )
    }

    #[test]
    fn round_trips() {
        let r = reservation();
        let id = r.encode();
        assert!(id.starts_with("r1."), "{id}");
        assert_eq!(ReservationId::decode(&id, "rk:"), Ok(r.clone()));
        assert_eq!(r.counter_keys()[1], "rk:{d|org=x}:tb.3600");
        assert_ne!(reservation().nonce, r.nonce);
    }

    #[test]
    fn refuses_malformed_ids_with_a_reason() {
        let r = reservation();
        let hex = |s: &str| {
            let mut out = String::new();
            push_hex(&mut out, s);
            out
        };
        let key = hex("rk:{d}:fw.60");
        let n = &r.nonce;
        let cases = [
            (String::new(), "empty"),
            ("x".into(), "not a reservation id"),
            (format!("r2.{n}.300000.1.0:5:{key}"), "not a reservation id"),
            (format!("{n}.300000.1.0:5:{key}"), "not a reservation id"),
            (format!("r1.{n}.300000.1"), "keys"),
            (format!("r1.short.300000.1.0:5:{key}"), "nonce"),
            (
                format!("r1.{n}.ttl.1.0:5:{key}"),
                "its TTL is not a whole number",
            ),
            (
                format!("r1.{n}.-5.1.0:5:{key}"),
                "its TTL is not a whole number",
            ),
            (
                format!("r1.{n}.+300000.1.0:5:{key}"),
                "its TTL is not a whole number",
            ),
            (format!("r1.{n}.300000.1.+0:5:{key}"), "keys"),
            (
                format!("r1.{n}.300000.x.0:5:{key}"),
                "descriptor count is not",
            ),
            (format!("r1.{n}.999.1.0:5:{key}"), "TTL outside"),
            (format!("r1.{n}.3600001.1.0:5:{key}"), "TTL outside"),
            (format!("r1.{n}.{}.1.0:5:{key}", u64::MAX), "TTL outside"),
            (format!("r1.{n}.300000.0.0:5:{key}"), "descriptor count"),
            (
                format!("r1.{n}.300000.{}.0:5:{key}", MAX_DESCRIPTORS + 1),
                "descriptor count",
            ),
            (format!("r1.{n}.300000.1.1:5:{key}"), "keys"),
            (format!("r1.{n}.300000.1.0:x:{key}"), "keys"),
            (format!("r1.{n}.300000.1.0:5:zz"), "keys"),
            (format!("r1.{n}.300000.1.0:5"), "keys"),
            (
                format!("r1.{n}.300000.1.0:5:{}", hex("other:{d}:fw.60")),
                "keys",
            ),
            (format!("r1.{n}.300000.1.0:5:{}", hex("rk:{d}:")), "keys"),
            (format!("r1.{n}.300000.1.0:5:{}", hex("rk:d:fw")), "keys"),
            // Two keys joined as a marker joins them, passed off as one.
            (
                format!("r1.{n}.300000.1.0:5:{}", hex("rk:{d}:fw.60\nrk:{d}:sw.60")),
                "keys",
            ),
            (
                "r1.".to_owned() + &"a".repeat(MAX_RESERVATION_ID_BYTES),
                "longer than",
            ),
        ];
        for (bad, reason) in cases {
            let error = ReservationId::decode(&bad, "rk:").unwrap_err();
            assert!(error.contains(reason), "{bad:?}: {error}");
        }
        assert!(ReservationId::decode(&r.encode(), "other:").is_err());
    }
}
