//! Reservations of cost budgets in the store (issue #23's reserve, then
//! settle; the service is `ratekeeper.v1.BudgetService`).
//!
//! A reservation takes an estimate from every check of a request, or from
//! none, and leaves a marker beside the counters, in each hash slot they
//! occupy: the keys, each check's fields, the time of the reservation on
//! the store's clock, and what it took from each key (its mark: the
//! sliding log's entry). The marker expires after the reservation's TTL;
//! until then one settle makes the charge the actual cost, and marks the
//! marker settled, so that a retry answers as the first did and charges
//! nothing. A settle trusts only the marker: the caller says which keys
//! and which nonce, and a marker that does not list exactly those keys is
//! not touched. Without a marker (expired, forged, never made) a settle
//! does nothing: an expired reservation stays charged at its estimate.

use super::Store;
use crate::limiter::{Check, Outcome, MAX_HITS};
use crate::Result;

/// Reserve's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    /// Whether the estimate was taken (from every check).
    pub granted: bool,
    /// One per check: as a request's, after the reservation when granted.
    pub outcomes: Vec<Outcome>,
}

/// Settle's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// This call settled it at `actual`; outcomes per check after the settlement.
    Settled { outcomes: Vec<Outcome> },
    /// An earlier Settle did, at `actual`; nothing charged now.
    Already { actual: u64, outcomes: Vec<Outcome> },
    /// No pending or settled marker: expired (its estimate stays charged), forged, or never made.
    Unknown,
}

/// What a marker holds about one slot's part of a reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marker {
    /// The checks as reserved (`hits` is the estimate), keys in order.
    pub checks: Vec<Check>,
    /// What the reservation took from each check (see
    /// [`crate::limiter::budget::Mark`]).
    pub marks: Vec<Option<u64>>,
    /// When it was made, on the store's clock (ms).
    pub reserved_at_ms: u64,
    /// The actual cost it was settled at, once settled.
    pub settled: Option<u64>,
}

impl Marker {
    /// Whether the marker is about exactly `keys`, in order.
    pub fn names(&self, keys: &[String]) -> bool {
        self.checks.len() == keys.len() && self.checks.iter().zip(keys).all(|(c, k)| c.key == *k)
    }
}

/// The marker key of a reservation in the hash slot of `counter_key`:
/// `<counter key up to and including its closing '}'>:rsv.<nonce>`. A key
/// without a hash tag gets its whole self as one (`{<key>}:rsv.<nonce>`),
/// which Redis Cluster files in the same slot as the key (unless it holds
/// a `}`: counter keys always carry a tag, see `keys`).
pub fn marker_key(counter_key: &str, nonce: &str) -> String {
    let tag_end = counter_key.find('{').and_then(|open| {
        let close = open + 1 + counter_key[open + 1..].find('}')?;
        (close > open + 1).then_some(close)
    });
    match tag_end {
        Some(close) => format!("{}:rsv.{nonce}", &counter_key[..=close]),
        None => format!("{{{counter_key}}}:rsv.{nonce}"),
    }
}

impl Store {
    /// checks: hits = the estimate, charges = false (admission: a refusal
    /// consumes nothing), enforce as the rule says. Takes the estimate from
    /// every check or from none, and when granted records, in each hash
    /// slot, a marker (expiring after `ttl_ms`) that holds what Settle
    /// needs (see the module doc). A check in shadow mode that is over its
    /// limit takes nothing and refuses nothing.
    pub async fn reserve(&self, checks: &[Check], nonce: &str, ttl_ms: u64) -> Result<Reserved> {
        if checks.is_empty() {
            return Ok(Reserved {
                granted: true,
                outcomes: Vec::new(),
            });
        }
        match self {
            Store::Memory(store) => Ok(store.reserve(checks, nonce, ttl_ms)),
            Store::Redis(store) => store.reserve(checks, nonce, ttl_ms).await,
        }
    }

    /// keys: the counter keys of the reservation (as in its checks, same
    /// order). Per hash slot, atomically (on a cluster the first slot
    /// decides, then the others follow: `RedisStore::settle`): if that
    /// slot's marker for `nonce` is pending and names exactly these keys,
    /// gives back `estimate - actual` on each check (or charges `actual -
    /// estimate` as a charge after the fact, bounded like every charge:
    /// `limiter::recordable`), and marks it settled at `actual` (on a
    /// cluster the later slots at the actual the first holds; kept until
    /// the marker's expiry, so a retry answers Already). `actual` above
    /// [`MAX_HITS`] counts as that.
    pub async fn settle(&self, keys: &[String], nonce: &str, actual: u64) -> Result<Settled> {
        if keys.is_empty() {
            return Ok(Settled::Unknown);
        }
        let actual = actual.min(MAX_HITS);
        match self {
            Store::Memory(store) => Ok(store.settle(keys, nonce, actual)),
            Store::Redis(store) => store.settle(keys, nonce, actual).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::cluster_slot;

    #[test]
    fn a_marker_lives_in_its_counters_hash_slot() {
        let counter = "rk:{api|user=alice}:fw.60";
        let marker = marker_key(counter, "n1");
        assert_eq!(marker, "rk:{api|user=alice}:rsv.n1");
        for key in [counter, "plain", "x{y"] {
            assert_eq!(
                cluster_slot(&marker_key(key, "n")),
                cluster_slot(key),
                "{key}"
            );
        }
    }
}
