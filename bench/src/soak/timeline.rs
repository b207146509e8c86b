//! What a soak run counted, second by second and replica by replica, so the
//! report can line the counts up with what the harness did to Redis at
//! known times (kill, restart, failover): answers decided by the store,
//! answers given without it (its failure mode), errors, late answers, and
//! the lease calls' outcomes.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Counts of one second on one replica.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Counts {
    /// ShouldRateLimit answered OK, decided by the store.
    pub store_ok: u64,
    /// ShouldRateLimit answered OVER_LIMIT by the store (or by the replica's
    /// over-limit cache, which only holds what the store said).
    pub store_over: u64,
    /// ShouldRateLimit answered without the store (the answer carries
    /// `ratekeeper.store_error`: the domain's failure mode decided).
    pub without_store: u64,
    /// ShouldRateLimit failed (a gRPC error, or no answer by the timeout).
    pub errors: u64,
    /// ShouldRateLimit answered (or failed) after its deadline.
    pub late: u64,
    /// Due ShouldRateLimit calls not sent: too many already in flight.
    pub skipped: u64,
    pub lease_granted: u64,
    pub lease_refused: u64,
    /// Acquire, heartbeat or release failed.
    pub lease_errors: u64,
    pub heartbeat_extended: u64,
    /// Heartbeats that found the lease gone (expired, or the store lost it).
    pub heartbeat_lost: u64,
    /// Lease calls answered (or failed) after the deadline.
    pub lease_late: u64,
}

impl Counts {
    pub fn add(&mut self, other: &Counts) {
        self.store_ok += other.store_ok;
        self.store_over += other.store_over;
        self.without_store += other.without_store;
        self.errors += other.errors;
        self.late += other.late;
        self.skipped += other.skipped;
        self.lease_granted += other.lease_granted;
        self.lease_refused += other.lease_refused;
        self.lease_errors += other.lease_errors;
        self.heartbeat_extended += other.heartbeat_extended;
        self.heartbeat_lost += other.heartbeat_lost;
        self.lease_late += other.lease_late;
    }
}

/// One line of the timeline file.
#[derive(Debug, Serialize)]
struct Row<'a> {
    /// Unix second the calls were sent in.
    t: u64,
    replica: usize,
    #[serde(flatten)]
    counts: &'a Counts,
}

/// Counts keyed by (Unix second of the send, replica).
#[derive(Debug, Default)]
pub struct Timeline {
    rows: BTreeMap<(u64, usize), Counts>,
}

impl Timeline {
    /// The counts of the second `at` falls in, on `replica`.
    pub fn at(&mut self, at: SystemTime, replica: usize) -> &mut Counts {
        self.rows.entry((unix_seconds(at), replica)).or_default()
    }

    /// Every second's counts added up.
    pub fn total(&self) -> Counts {
        let mut total = Counts::default();
        self.rows.values().for_each(|c| total.add(c));
        total
    }

    /// The timeline as JSON lines, in time order.
    pub fn json_lines(&self) -> serde_json::Result<String> {
        let mut out = String::new();
        for (&(t, replica), counts) in &self.rows {
            out.push_str(&serde_json::to_string(&Row { t, replica, counts })?);
            out.push('\n');
        }
        Ok(out)
    }
}

/// Whole seconds since the Unix epoch (0 for a clock before it).
pub fn unix_seconds(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Milliseconds since the Unix epoch (0 for a clock before it).
pub fn unix_millis(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn counts_land_in_their_second_and_replica_and_add_up() {
        let mut timeline = Timeline::default();
        let t0 = UNIX_EPOCH + Duration::from_millis(10_900);
        timeline.at(t0, 0).store_ok += 2;
        timeline.at(t0 + Duration::from_millis(50), 0).store_ok += 1;
        timeline
            .at(t0 + Duration::from_millis(200), 1)
            .without_store += 1;
        let lines = timeline.json_lines().unwrap();
        let rows: Vec<serde_json::Value> = lines
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), 2, "{lines}");
        assert_eq!(
            (rows[0]["t"].as_u64(), rows[0]["store_ok"].as_u64()),
            (Some(10), Some(3))
        );
        assert_eq!(
            (rows[1]["t"].as_u64(), rows[1]["replica"].as_u64()),
            (Some(11), Some(1))
        );
        let total = timeline.total();
        assert_eq!((total.store_ok, total.without_store), (3, 1));
    }
}
