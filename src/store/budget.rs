//! Reservations of cost budgets in the store (issue #23's reserve, then
//! settle; the service is `ratekeeper.v1.BudgetService`).
//!
//! A reservation takes an estimate from every check of a request, or from
//! none, and records nothing beside the counters: its answer says when it
//! was made on the store's clock and what it took from each key (its
//! [`Taken`]), and the service carries those, with the checks, in the id
//! it signs (`service::reservation_id`). A settle brings them back; the
//! store trusts them (the service verified the id) and, before the
//! reservation's TTL has passed on its clock, records the settlement as a
//! field named by the reservation's nonce ([`record_bucket`]), in each
//! hash slot it took from, and makes the charge the actual cost. A retry
//! finds the record and answers as the first did, charging nothing. After
//! the TTL a settle changes nothing: an expired reservation stays charged
//! at its estimate.
//!
//! Nothing is recorded at reserve because a new key per reservation costs
//! Redis more than the rest of its work (BENCHMARKS.md, "Reserve and
//! settle").

use super::Store;
use crate::limiter::{Check, Outcome, MAX_HITS};
use crate::Result;

pub use crate::limiter::budget::Taken;

/// Reserve's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    /// Whether the estimate was taken (from every check).
    pub granted: bool,
    /// One per check: as a request's, after the reservation when granted.
    pub outcomes: Vec<Outcome>,
    /// When granted, what it took from each check (empty when refused).
    pub taken: Vec<Taken>,
}

/// Settle's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// This call settled it at `actual`; outcomes per check after the settlement.
    Settled { outcomes: Vec<Outcome> },
    /// An earlier Settle did, at `actual`; nothing charged now.
    Already { actual: u64, outcomes: Vec<Outcome> },
    /// Its TTL has passed (its estimate stays charged).
    Unknown,
}

/// A granted reservation, as a settle names it.
#[derive(Debug, Clone, Copy)]
pub struct Reservation<'a> {
    /// 128 random bits, hex: names its settlement's record.
    pub nonce: &'a str,
    /// Its checks as reserved (`hits` the estimate), keys in order.
    pub checks: &'a [Check],
    /// What it took from each check, and when.
    pub taken: &'a [Taken],
    /// How long after it was made (on the store's clock) it may settle.
    pub ttl_ms: u64,
}

/// The hash a reservation's settlement is recorded in, as the field named
/// by its nonce: `<head>rsvb.<second of ttl_ends_ms>.<nonce's first
/// character>`, `ttl_ends_ms` when its TTL ends on the store's clock. A
/// field in a shared hash costs Redis less time than a key of its own
/// (BENCHMARKS.md); the second and the shard (one of 16 by a hex nonce)
/// keep each hash to a sixteenth of a second's settlements, quick to free.
/// Named by what the reservation's id holds, so a retried settle finds it.
/// The head is the counter key's prefix (up to its tag), or on a cluster
/// its tag and a `:` so the hash shares the counters' slot. A key without
/// a tag (counter keys always carry one, see `keys`) heads with
/// `{<key>}:`, which Redis Cluster files in its slot unless it holds a `}`.
pub fn record_bucket(counter_key: &str, nonce: &str, ttl_ends_ms: u64, in_slot: bool) -> String {
    let tag = counter_key.find('{').and_then(|open| {
        let close = open + 1 + counter_key[open + 1..].find('}')?;
        (close > open + 1).then_some((open, close))
    });
    let shard = nonce.get(..1).unwrap_or("");
    let second = ttl_ends_ms / 1000;
    match tag {
        Some((_, close)) if in_slot => {
            format!("{}:rsvb.{second}.{shard}", &counter_key[..=close])
        }
        Some((open, _)) => format!("{}rsvb.{second}.{shard}", &counter_key[..open]),
        None => format!("{{{counter_key}}}:rsvb.{second}.{shard}"),
    }
}

impl Store {
    /// checks: hits = the estimate, charges = false (admission: a refusal
    /// consumes nothing), enforce as the rule says. Takes the estimate from
    /// every check or from none, for a reservation that may settle for
    /// `ttl_ms` (a bucket keeps its give-backs that long). A check in
    /// shadow mode that is over its limit takes nothing and refuses
    /// nothing. `nonce` names the reservation on a Cluster, where a
    /// refusal in a later hash slot settles the earlier ones at 0.
    pub async fn reserve(&self, checks: &[Check], nonce: &str, ttl_ms: u64) -> Result<Reserved> {
        if checks.is_empty() {
            return Ok(Reserved {
                granted: true,
                outcomes: Vec::new(),
                taken: Vec::new(),
            });
        }
        match self {
            Store::Memory(store) => Ok(store.reserve(checks, ttl_ms)),
            Store::Redis(store) => store.reserve(checks, nonce, ttl_ms).await,
        }
    }

    /// Per hash slot, atomically (on a cluster the first slot decides,
    /// then the others follow: `RedisStore::settle`): unless the
    /// reservation's TTL has passed or its settlement is recorded, gives
    /// back `estimate - actual` on each check (or charges `actual -
    /// estimate` as a charge after the fact, bounded like every charge:
    /// `limiter::recordable`), and records it settled at `actual` (on a
    /// cluster the later slots at the actual the first holds; kept until
    /// the reservation's expiry, so a retry answers Already). `actual`
    /// above [`MAX_HITS`] counts as that.
    pub async fn settle(&self, reservation: &Reservation<'_>, actual: u64) -> Result<Settled> {
        if reservation.checks.is_empty() || reservation.taken.len() != reservation.checks.len() {
            return Ok(Settled::Unknown);
        }
        let actual = actual.min(MAX_HITS);
        match self {
            Store::Memory(store) => Ok(store.settle(reservation, actual)),
            Store::Redis(store) => store.settle(reservation, actual).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::cluster_slot;

    #[test]
    fn a_record_bucket_is_shared_unless_it_must_share_a_slot() {
        let counter = "rk:{api|user=alice}:fw.60";
        assert_eq!(
            record_bucket(counter, "a1f", 1_234_567, false),
            "rk:rsvb.1234.a"
        );
        assert_eq!(
            record_bucket(counter, "a1f", 1_234_999, true),
            "rk:{api|user=alice}:rsvb.1234.a"
        );
        for key in [counter, "plain", "x{y"] {
            assert_eq!(
                cluster_slot(&record_bucket(key, "n", 0, true)),
                cluster_slot(key),
                "{key}"
            );
        }
    }
}
