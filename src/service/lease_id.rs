//! Lease ids: opaque to callers, self-describing to every replica.
//!
//! `<member>.<ttl ms>.<hex set key>[.<hex set key>...]` — the member is 128
//! random bits (the part nobody can guess), and the set keys let any replica
//! heartbeat or release the lease without an index in Redis and without
//! scanning. A forged id can only name keys of the lease-set shape, and
//! touches nothing unless its member is in them.

use std::collections::HashSet;

use super::id_parts::{count, from_hex, is_nonce, push_hex, quote_start, random_nonce};
use crate::config::file::LEASE_TTL_RANGE;
use crate::keys::{counter_key, Values};
use crate::store::LeaseRef;

/// The suffix of every lease set key (see `keys::counter_key`).
pub const SET_SUFFIX: &str = ":conn";

/// The key of the lease set of the entity `entries` name in `domain`.
pub fn set_key<'a>(
    key_prefix: &str,
    domain: &str,
    entries: impl IntoIterator<Item = (&'a str, &'a str)>,
    values: Values,
) -> String {
    counter_key(key_prefix, domain, entries, values, &SET_SUFFIX[1..])
}

/// Longest lease id accepted.
pub const MAX_LEASE_ID_BYTES: usize = 8 * 1024;

/// A decoded lease id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseId {
    pub member: String,
    pub ttl_ms: u64,
    pub keys: Vec<String>,
}

impl LeaseId {
    /// A new lease with a fresh random member.
    pub fn new(ttl_ms: u64, keys: Vec<String>) -> Self {
        LeaseId {
            member: random_nonce(),
            ttl_ms,
            keys,
        }
    }

    /// The lease as the store takes it.
    pub fn lease_ref(&self) -> LeaseRef<'_> {
        LeaseRef {
            member: &self.member,
            ttl_ms: self.ttl_ms,
            keys: &self.keys,
        }
    }

    pub fn encode(&self) -> String {
        let mut id = format!("{}.{}", self.member, self.ttl_ms);
        for key in &self.keys {
            id.push('.');
            push_hex(&mut id, key);
        }
        id
    }

    /// Decodes `id`, accepting only lease-set keys under `key_prefix`.
    pub fn decode(id: &str, key_prefix: &str) -> Result<LeaseId, String> {
        if id.len() > MAX_LEASE_ID_BYTES {
            return Err(format!("lease id longer than {MAX_LEASE_ID_BYTES} bytes"));
        }
        let bad = || format!("malformed lease id {}", quote_start(id));
        let mut parts = id.split('.');
        let member = parts.next().filter(|m| is_nonce(m));
        let ttl_ms = parts.next().and_then(count);
        let (Some(member), Some(ttl_ms)) = (member, ttl_ms) else {
            return Err(bad());
        };
        // Only the service mints ids, always with a TTL in range; a TTL
        // outside it is a forgery that could pin a lease (and its slot) for
        // years or overflow an expiry.
        let (min, max) = LEASE_TTL_RANGE;
        if !(min.as_millis()..=max.as_millis()).contains(&u128::from(ttl_ms)) {
            return Err(format!(
                "lease id {} carries a TTL outside {min:?}..={max:?}",
                quote_start(id)
            ));
        }
        let keys = parts
            .map(from_hex)
            .collect::<Option<Vec<String>>>()
            .filter(|keys| {
                !keys.is_empty()
                    && keys.iter().all(|k| {
                        k.strip_prefix(key_prefix).is_some_and(|rest| {
                            rest.starts_with('{') && rest.ends_with(&format!("}}{SET_SUFFIX}"))
                        })
                    })
                    // A lease takes one place per set: a set named twice
                    // is a forgery, made to cost the store more per id.
                    && keys.iter().collect::<HashSet<_>>().len() == keys.len()
            })
            .ok_or_else(bad)?;
        Ok(LeaseId {
            member: member.to_owned(),
            ttl_ms,
            keys,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_forgeries() {
        let lease = LeaseId::new(
            30_000,
            vec!["rk:{d|user=a.b}:conn".into(), "rk:{d|org=x}:conn".into()],
        );
        let id = lease.encode();
        assert_eq!(LeaseId::decode(&id, "rk:"), Ok(lease.clone()));
        assert_ne!(
            LeaseId::new(1000, vec![]).member,
            LeaseId::new(1000, vec![]).member
        );
        let hex = |s: &str| s.bytes().map(|b| format!("{b:02x}")).collect::<String>();
        for bad in [
            String::new(),
            "x".into(),
            format!("{}.30000", lease.member),
            format!("{}.30000.{}", lease.member, hex("rk:{d|user=a}:fw.60")),
            format!("{}.30000.{}", lease.member, hex("other:{d}:conn")),
            format!("{}.ttl.{}", lease.member, hex("rk:{d}:conn")),
            format!("short.30000.{}", hex("rk:{d}:conn")),
            format!("{}.30000.zz", lease.member),
            format!("{0}.30000.{1}.{1}", lease.member, hex("rk:{d}:conn")),
            format!("{}.999.{}", lease.member, hex("rk:{d}:conn")),
            format!("{}.3600001.{}", lease.member, hex("rk:{d}:conn")),
            format!("{}.{}.{}", lease.member, u64::MAX, hex("rk:{d}:conn")),
            "a".repeat(MAX_LEASE_ID_BYTES + 1),
        ] {
            assert!(LeaseId::decode(&bad, "rk:").is_err(), "{bad:?}");
        }
        assert!(LeaseId::decode(&id, "other:").is_err());
    }
}
