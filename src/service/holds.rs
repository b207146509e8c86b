//! The leases this replica keeps alive for open `Hold` streams, refreshed
//! together: batched heartbeats (256 leases a store call) per tick, at a
//! third of the shortest TTL, so a lease survives two failed ticks. A lease the store
//! reports lost is handed back to its stream, which then ends. At shutdown
//! [`Holds::close`] tells every stream to give its lease back and end, so a
//! draining replica neither waits for long-lived streams nor leaves their
//! leases to expire.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{oneshot, watch, Notify};
use tokio::time::Instant;

use super::lease_id::LeaseId;
use crate::log_pace::Paced;
use crate::store::{LeaseRef, Store};

/// Held leases refreshed per store call: one Redis call for thousands
/// outlasts the call deadline (2,795 took Redis 55 to 72 ms), and then none
/// is refreshed.
const REFRESH_BATCH: usize = 256;

struct Held {
    lease: LeaseId,
    domain: String,
    lost: oneshot::Sender<()>,
}

/// Leases held for `Hold` streams on this replica.
pub struct Holds {
    store: Store,
    held: Mutex<HashMap<String, Held>>,
    changed: Notify,
    closing: watch::Sender<bool>,
}

impl std::fmt::Debug for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holds")
            .field("held", &self.lock().len())
            .finish()
    }
}

impl Holds {
    pub fn new(store: Store) -> Arc<Self> {
        Arc::new(Holds {
            store,
            held: Mutex::new(HashMap::new()),
            changed: Notify::new(),
            closing: watch::Sender::new(false),
        })
    }

    /// Asks every `Hold` stream, open or opened from now on, to release its
    /// lease and end (the replica is shutting down).
    pub fn close(&self) {
        self.closing.send_replace(true);
    }

    /// Resolves once [`Holds::close`] has been called.
    pub async fn closed(&self) {
        let mut closing = self.closing.subscribe();
        // The sender lives in `self`, so waiting cannot fail.
        let _ = closing.wait_for(|closing| *closing).await;
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Held>> {
        self.held
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn gauge(domain: &str, delta: f64) {
        metrics::gauge!("ratekeeper_concurrency_held_leases", "domain" => domain.to_owned())
            .increment(delta);
    }

    /// Keeps `lease` alive until [`Holds::release`]; `lost` fires if the
    /// store loses it first.
    pub fn insert(&self, id: String, lease: LeaseId, domain: &str, lost: oneshot::Sender<()>) {
        Self::gauge(domain, 1.0);
        self.lock().insert(
            id,
            Held {
                lease,
                domain: domain.to_owned(),
                lost,
            },
        );
        self.changed.notify_one();
    }

    /// Stops refreshing `id` and gives the lease back (the stream ended);
    /// a release that fails is tried again a second and ten seconds later,
    /// or the place would stay taken for the lease's whole TTL.
    pub async fn release(&self, id: &str) {
        let Some(held) = self.forget(id) else { return };
        if let Err(error) = self.store.release(&[held.lease.lease_ref()]).await {
            // Paced: a failing Redis fails every stream that ends.
            static LOG: Paced = Paced::new();
            if let Some(left_out) = LOG.admit() {
                tracing::warn!(%error, left_out, "could not release a held lease; trying again shortly");
            }
            self.store
                .release_later(&held.lease.member, held.lease.keys.clone());
        }
    }

    fn forget(&self, id: &str) -> Option<Held> {
        let held = self.lock().remove(id)?;
        Self::gauge(&held.domain, -1.0);
        Some(held)
    }

    /// Gives back every held lease (at shutdown), in one call.
    pub async fn release_all(&self) {
        let held: Vec<Held> = self.lock().drain().map(|(_, h)| h).collect();
        for h in &held {
            Self::gauge(&h.domain, -1.0);
        }
        let leases: Vec<LeaseRef<'_>> = held.iter().map(|h| h.lease.lease_ref()).collect();
        if let Err(error) = self.store.release(&leases).await {
            tracing::warn!(%error, leases = leases.len(), "could not release held leases at shutdown");
        }
    }

    /// The pause until the next refresh: a third of the shortest TTL held.
    fn tick(&self) -> Option<Duration> {
        let shortest = self.lock().values().map(|h| h.lease.ttl_ms).min()?;
        Some(Duration::from_millis((shortest / 3).clamp(50, 10_000)))
    }

    /// Refreshes all held leases each tick, until dropped.
    /// A lease held meanwhile waits for the tick (it was just made), unless
    /// its shorter TTL needs an earlier one: refreshing at every new lease
    /// sent every held lease to the store at each `Hold` opened.
    pub async fn refresh_forever(self: Arc<Self>) {
        let mut due: Option<Instant> = None;
        loop {
            let Some(pause) = self.tick() else {
                due = None;
                self.changed.notified().await;
                continue;
            };
            let soonest = Instant::now() + pause;
            let at = due.map_or(soonest, |due| due.min(soonest));
            due = Some(at);
            tokio::select! {
                () = tokio::time::sleep_until(at) => {
                    self.refresh_once().await;
                    due = None;
                }
                () = self.changed.notified() => {}
            }
        }
    }

    /// One tick: every held lease refreshed, [`REFRESH_BATCH`] to a store
    /// call.
    async fn refresh_once(&self) {
        let snapshot: Vec<(String, LeaseId)> = self
            .lock()
            .iter()
            .map(|(id, h)| (id.clone(), h.lease.clone()))
            .collect();
        let (mut failed, mut last_error) = (0, None);
        for batch in snapshot.chunks(REFRESH_BATCH) {
            if let Err(error) = self.refresh(batch).await {
                failed += batch.len();
                last_error = Some(error);
            }
        }
        if let Some(error) = last_error {
            // One line a tick, however many batches failed.
            tracing::warn!(%error, leases = failed, "could not refresh held leases; retrying next tick");
        }
    }

    async fn refresh(&self, batch: &[(String, LeaseId)]) -> crate::Result<()> {
        let leases: Vec<LeaseRef<'_>> = batch.iter().map(|(_, l)| l.lease_ref()).collect();
        let alive = self.store.heartbeat(&leases).await?;
        for ((id, _), alive) in batch.iter().zip(alive) {
            if !alive {
                if let Some(held) = self.forget(id) {
                    metrics::counter!("ratekeeper_concurrency_leases_lost").increment(1);
                    let _ = held.lost.send(());
                }
            }
        }
        Ok(())
    }
}
