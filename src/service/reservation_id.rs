//! Reservation ids (`BudgetService`): opaque to callers, self-describing to
//! every replica, and signed.
//!
//! `r3.<nonce>.<ttl ms>.<descriptors>.<part>[.<part> ...].<mac>`, each
//! part `<descriptor>:<fields>:<at ms>:<mark>:<hex key>`
//!
//! `r3.` is the format's version (a later format gets another prefix, so a
//! replica never misreads an id minted by a newer one). Earlier ones are
//! not read: `r1.` reservations were recorded in the store at reserve, and
//! `r2.` ones settled under a key of their own, where a replica of this
//! version would not look, and so would settle a retried one again. The
//! nonce is 128 random bits: it names the record of the reservation's
//! settlement.
//! Then one part per counter key the reservation took its estimate from, in
//! the order of its checks: the index of the Reserve's descriptor the key
//! belongs to (so Settle answers one status per descriptor), the check's
//! fields as reserved (`<algorithm tag>_<limit>_<period ms>_<burst>_<hits
//! (the estimate)>_<enforce 0|1>_<charges 0|1|2>`), when the store took
//! it, on its clock, what it took (its mark, `-` for nothing: a limit in
//! shadow mode it was over), and the key in hex. The MAC (32 hex digits,
//! `service::id_key`) covers all before it. Any replica settles any
//! reservation from the id alone: the store records nothing at reserve.
//!
//! The id is trusted only under its MAC: a forged or altered id is refused
//! before it reaches the store, so what a settle gives back or charges is
//! what was reserved.

use std::time::Duration;

use super::caps::MAX_DESCRIPTORS;
use super::id_key::MAC_BYTES;
use super::id_parts::{
    count, from_hex, hex_bytes, is_nonce, push_hex, push_hex_bytes, quote_start, random_nonce,
};
use crate::limiter::budget::Taken;
use crate::limiter::{Algorithm, Charges, Check};

/// The version prefix of every reservation id this format mints.
pub const PREFIX: &str = "r3.";

/// Longest reservation id accepted (and minted: a Reserve whose keys would
/// not fit is refused before it takes anything).
pub const MAX_RESERVATION_ID_BYTES: usize = 64 * 1024;

/// A Reserve's TTL when it asks for none.
pub const DEFAULT_TTL: Duration = Duration::from_secs(5 * 60);

/// The TTLs a Reserve may ask for: long enough for a slow call, short
/// enough that a forgotten reservation gives its budget back the same hour.
pub const TTL_RANGE: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(3600));

/// One check a reservation took its estimate from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservedKey {
    /// Index of the Reserve's descriptor this check's limit belongs to.
    pub descriptor: usize,
    /// The check as reserved (its `hits` the estimate).
    pub check: Check,
    /// What the reservation took from it, and when.
    pub taken: Taken,
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

/// An id as read: the reservation, what its MAC covers, and the MAC.
#[derive(Debug)]
pub struct Signed<'a> {
    pub reservation: ReservationId,
    pub payload: &'a str,
    pub mac: [u8; MAC_BYTES],
}

impl ReservationId {
    /// A new reservation id's nonce.
    pub fn new_nonce() -> String {
        random_nonce()
    }

    /// The checks, in order.
    pub fn checks(&self) -> Vec<Check> {
        self.keys.iter().map(|k| k.check.clone()).collect()
    }

    /// What the reservation took from each check, in order.
    pub fn taken(&self) -> Vec<Taken> {
        self.keys.iter().map(|k| k.taken).collect()
    }

    /// The counter keys, in the order of the reservation's checks.
    pub fn counter_keys(&self) -> Vec<String> {
        self.keys.iter().map(|k| k.check.key.clone()).collect()
    }

    /// The id without its MAC: what the MAC covers.
    pub fn payload(&self) -> String {
        let hex: usize = self.keys.iter().map(|k| 2 * k.check.key.len() + 96).sum();
        let mut id = String::with_capacity(PREFIX.len() + self.nonce.len() + 32 + hex);
        let mut n = itoa::Buffer::new();
        id.push_str(PREFIX);
        id.push_str(&self.nonce);
        for number in [self.ttl_ms, self.descriptors as u64] {
            id.push('.');
            id.push_str(n.format(number));
        }
        for key in &self.keys {
            let c = &key.check;
            id.push('.');
            id.push_str(n.format(key.descriptor));
            id.push(':');
            id.push_str(c.algorithm.key_tag());
            for field in [c.limit, c.period_ms, c.burst, c.hits] {
                id.push('_');
                id.push_str(n.format(field));
            }
            id.push_str(if c.enforce { "_1_" } else { "_0_" });
            id.push_str(n.format(c.charges as u8));
            id.push(':');
            id.push_str(n.format(key.taken.at_ms));
            id.push(':');
            match key.taken.mark {
                Some(mark) => id.push_str(n.format(mark)),
                None => id.push('-'),
            }
            id.push(':');
            push_hex(&mut id, &c.key);
        }
        id
    }

    /// The id: `payload` and its MAC.
    pub fn signed(payload: &str, mac: &[u8; MAC_BYTES]) -> String {
        let mut id = String::with_capacity(payload.len() + 1 + 2 * MAC_BYTES);
        id.push_str(payload);
        id.push('.');
        push_hex_bytes(&mut id, mac);
        id
    }

    /// Reads `id`, accepting only counter keys under `key_prefix`; its MAC
    /// is for the caller to check.
    pub fn decode<'a>(id: &'a str, key_prefix: &str) -> Result<Signed<'a>, String> {
        if id.is_empty() {
            return Err("the reservation id is empty".into());
        }
        if id.len() > MAX_RESERVATION_ID_BYTES {
            return Err(format!(
                "reservation id longer than {MAX_RESERVATION_ID_BYTES} bytes"
            ));
        }
        if !id.starts_with(PREFIX) {
            return Err(format!(
                "{} is not a reservation id of this version (they start with {PREFIX:?})",
                quote_start(id)
            ));
        }
        let bad = |what: &str| format!("malformed reservation id {}: {what}", quote_start(id));
        let (payload, mac_hex) = id.rsplit_once('.').unwrap_or((id, ""));
        let mac = mac_of(mac_hex).ok_or_else(|| bad("its MAC is not 32 hex digits"))?;
        let Some(rest) = payload.strip_prefix(PREFIX) else {
            return Err(bad("it holds nothing but a MAC"));
        };
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
            .ok_or_else(|| bad("its checks are not counter keys of this service"))?;
        Ok(Signed {
            reservation: ReservationId {
                nonce: nonce.to_owned(),
                ttl_ms,
                descriptors,
                keys,
            },
            payload,
            mac,
        })
    }
}

/// A MAC's 32 hex digits as bytes.
fn mac_of(hex: &str) -> Option<[u8; MAC_BYTES]> {
    hex_bytes(hex)?.try_into().ok()
}

/// One `<descriptor>:<fields>:<at>:<mark>:<hex key>` part, if well formed.
fn reserved_key(part: &str, descriptors: usize, key_prefix: &str) -> Option<ReservedKey> {
    let mut fields = part.splitn(5, ':');
    let descriptor = usize::try_from(count(fields.next()?)?).ok()?;
    let check = fields.next()?;
    let at_ms = count(fields.next()?)?;
    let mark = match fields.next()? {
        "-" => None,
        mark => Some(count(mark)?),
    };
    let key = from_hex(fields.next()?)?;
    if descriptor >= descriptors || !is_counter_key(&key, key_prefix) {
        return None;
    }
    Some(ReservedKey {
        descriptor,
        check: check_of(check, key)?,
        taken: Taken { at_ms, mark },
    })
}

/// A check's `<tag>_<limit>_<period>_<burst>_<hits>_<enforce>_<charges>`.
fn check_of(fields: &str, key: String) -> Option<Check> {
    let mut f = fields.split('_');
    let tag = f.next()?;
    let algorithm = Algorithm::ALL.into_iter().find(|a| a.key_tag() == tag)?;
    let mut number = || count(f.next()?);
    let (limit, period_ms, burst, hits) = (number()?, number()?, number()?, number()?);
    let enforce = match number()? {
        0 => false,
        1 => true,
        _ => return None,
    };
    let charges = match number()? {
        0 => Charges::Drop,
        1 => Charges::Record,
        2 => Charges::WhenOver,
        _ => return None,
    };
    if f.next().is_some() || period_ms == 0 {
        return None;
    }
    Some(Check {
        key,
        algorithm,
        limit,
        period_ms,
        burst,
        hits,
        enforce,
        charges,
    })
}

/// Whether `key` has the shape `keys::counter_key` gives: the prefix, a
/// `{...}` hash tag, and a rule id without braces. No control byte (a
/// counter key escapes them).
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

    fn check(key: &str, algorithm: Algorithm) -> Check {
        Check {
            key: key.into(),
            algorithm,
            limit: 1000,
            period_ms: 60_000,
            burst: 100,
            hits: 40,
            enforce: true,
            charges: Charges::WhenOver,
        }
    }

    fn reservation() -> ReservationId {
        ReservationId {
            nonce: ReservationId::new_nonce(),
            ttl_ms: 300_000,
            descriptors: 3,
            keys: vec![
                ReservedKey {
                    descriptor: 0,
                    check: check("rk:{d|user=a.b}:fw.60", Algorithm::FixedWindow),
                    taken: Taken {
                        at_ms: 1_800_000_000_000,
                        mark: Some(0),
                    },
                },
                ReservedKey {
                    descriptor: 2,
                    check: Check {
                        enforce: false,
                        charges: Charges::Drop,
                        ..check("rk:{d|org=x}:tb.3600", Algorithm::TokenBucket)
                    },
                    taken: Taken {
                        at_ms: 1_800_000_000_001,
                        mark: None,
                    },
                },
            ],
        }
    }

    #[test]
    fn round_trips() {
        let r = reservation();
        let payload = r.payload();
        let id = ReservationId::signed(&payload, &[0xab; MAC_BYTES]);
        assert!(id.starts_with("r3."), "{id}");
        let read = ReservationId::decode(&id, "rk:").unwrap();
        assert_eq!(read.reservation, r);
        assert_eq!(
            (read.payload, read.mac),
            (payload.as_str(), [0xab; MAC_BYTES])
        );
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
        let mac = "ab".repeat(MAC_BYTES);
        let f = "fw_10_60000_0_5_1_0";
        let cases = [
            (String::new(), "empty"),
            ("x".into(), "not a reservation id"),
            (format!("r1.{n}.300000.1.0:5:{key}"), "not a reservation id"),
            (
                format!("r2.{n}.300000.1.0:{f}:1:0:{key}.{mac}"),
                "not a reservation id",
            ),
            (format!("r3.{n}.300000.1.0:{f}:1:0:{key}"), "MAC"),
            (format!("r3.{n}.300000.1.0:{f}:1:0:{key}.abc"), "MAC"),
            (format!("r3.{n}.300000.1.{mac}"), "checks"),
            (format!("r3.{mac}"), "nothing but a MAC"),
            (format!("r3.short.300000.1.0:{f}:1:0:{key}.{mac}"), "nonce"),
            (format!("r3.{n}.ttl.1.0:{f}:1:0:{key}.{mac}"), "TTL is not"),
            (
                format!("r3.{n}.300000.x.0:{f}:1:0:{key}.{mac}"),
                "descriptor count is not",
            ),
            (format!("r3.{n}.999.1.0:{f}:1:0:{key}.{mac}"), "TTL outside"),
            (
                format!("r3.{n}.300000.0.0:{f}:1:0:{key}.{mac}"),
                "descriptor count",
            ),
            (format!("r3.{n}.300000.1.1:{f}:1:0:{key}.{mac}"), "checks"),
            (
                format!("r3.{n}.300000.1.0:xx_10_60000_0_5_1_0:1:0:{key}.{mac}"),
                "checks",
            ),
            (
                format!("r3.{n}.300000.1.0:fw_10_0_0_5_1_0:1:0:{key}.{mac}"),
                "checks",
            ),
            (
                format!("r3.{n}.300000.1.0:fw_10_60000_0_5_2_0:1:0:{key}.{mac}"),
                "checks",
            ),
            (
                format!("r3.{n}.300000.1.0:fw_10_60000_0_5_1_3:1:0:{key}.{mac}"),
                "checks",
            ),
            (
                format!("r3.{n}.300000.1.0:fw_10_60000_0_5_1_0_9:1:0:{key}.{mac}"),
                "checks",
            ),
            (format!("r3.{n}.300000.1.0:{f}:x:0:{key}.{mac}"), "checks"),
            (format!("r3.{n}.300000.1.0:{f}:1:+0:{key}.{mac}"), "checks"),
            (format!("r3.{n}.300000.1.0:{f}:1:0:zz.{mac}"), "checks"),
            (
                format!("r3.{n}.300000.1.0:{f}:1:0:{}.{mac}", hex("other:{d}:fw.60")),
                "checks",
            ),
            (
                format!("r3.{n}.300000.1.0:{f}:1:0:{}.{mac}", hex("rk:d:fw")),
                "checks",
            ),
            (
                format!(
                    "r3.{n}.300000.1.0:{f}:1:0:{}.{mac}",
                    hex("rk:{d}:fw.60\nrk:{d}:sw.60")
                ),
                "checks",
            ),
            (
                "r3.".to_owned() + &"a".repeat(MAX_RESERVATION_ID_BYTES),
                "longer than",
            ),
        ];
        for (bad, reason) in cases {
            let error = ReservationId::decode(&bad, "rk:").unwrap_err();
            assert!(error.contains(reason), "{bad:?}: {error}");
        }
        let good = ReservationId::signed(&r.payload(), &[1; MAC_BYTES]);
        assert!(ReservationId::decode(&good, "other:").is_err());
    }
}
