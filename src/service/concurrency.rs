//! `ratekeeper.v1.ConcurrencyService`: concurrent-connection limits.
//!
//! A connection holds a lease in one set per limited entity: a sorted set of
//! lease ids scored by expiry (`lua/leases.lua`). `AcquireConnection` matches the request's descriptors against
//! the domain's `concurrency:` rules and takes a lease in every matched set,
//! or in none, in one atomic store call. `Heartbeat` and `Release` take lease
//! ids only: the ids carry their sets (see `lease_id`). `Hold` does the same
//! over a stream that this replica keeps alive (see `holds`).

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::caps;
use super::holds::Holds;
use super::id_parts::returnable;
use super::lease_id::{set_key, LeaseId, MAX_LEASE_ID_BYTES};
use super::wire::{duration, requested_ttl, Entries};
use crate::config::file::LEASE_TTL_RANGE;
use crate::config::watch::SharedConfig;
use crate::config::Config;
use crate::keys::Values;
use crate::pb::v1::concurrency_service_server::ConcurrencyService;
use crate::pb::v1::{
    hold_event, AcquireRequest, AcquireResponse, HeartbeatRequest, HeartbeatResponse, HoldEvent,
    ReleaseRequest, ReleaseResponse,
};
use crate::rules::ConcurrencyRule;
use crate::store::{LeaseRef, LeaseSlot, Store};

/// Most lease ids in one `Heartbeat` or `Release`.
pub const MAX_LEASE_IDS: usize = 1_000;

/// Why a `Heartbeat` or `Release` of more than [`MAX_LEASE_IDS`] is refused
/// where its ids are counted as its bytes arrive (`repeated_cap`), and the
/// call stopped past the cap: how many it holds is not known.
pub fn past_max_lease_ids() -> String {
    format!("more than {MAX_LEASE_IDS} lease ids: at most {MAX_LEASE_IDS} per call")
}

/// Most lease sets one store call of a `Heartbeat` or `Release` visits:
/// ids of many sets each (a lease of many rules, or a forgery) are split
/// into several calls, so that none stalls Redis (1,000 ids of 88 sets
/// each in one call held it 0.4 s).
pub const MAX_LEASE_SETS: usize = 4_096;

/// Longest `holder` kept with a lease: it is stored for every live lease, so
/// its size is bounded like everything else a caller makes the store keep.
pub const MAX_HOLDER_BYTES: usize = 256;

/// The concurrency service.
#[derive(Debug, Clone)]
pub struct Concurrency {
    config: SharedConfig,
    store: Store,
    key_prefix: String,
    values: Values,
    holds: Arc<Holds>,
}

impl Concurrency {
    pub fn new(
        config: SharedConfig,
        store: Store,
        key_prefix: String,
        values: Values,
        holds: Arc<Holds>,
    ) -> Self {
        Concurrency {
            config,
            store,
            key_prefix,
            values,
            holds,
        }
    }

    /// The same service, using serving lane `lane`'s store connections.
    pub fn for_lane(&self, lane: usize) -> Self {
        Concurrency {
            store: self.store.for_lane(lane),
            ..self.clone()
        }
    }

    /// The lease sets `request` takes a place in, each once, with its rule.
    fn matched_slots<'c>(
        &self,
        config: &'c Config,
        request: &AcquireRequest,
    ) -> Vec<(LeaseSlot, &'c ConcurrencyRule)> {
        let mut matched: Vec<(LeaseSlot, &ConcurrencyRule)> = Vec::new();
        let Some(domain) = config.domain(&request.domain) else {
            return matched;
        };
        for descriptor in &request.descriptors {
            let entries = descriptor.entries();
            let Some(rule) = domain.concurrency.find(entries.clone()) else {
                continue;
            };
            let key = set_key(&self.key_prefix, &request.domain, entries, self.values);
            if !matched.iter().any(|(slot, _)| slot.key == key) {
                let limit = u64::from(rule.max_connections);
                matched.push((LeaseSlot { key, limit }, rule));
            }
        }
        matched
    }

    /// Acquires for `request`: the answer, and the lease when one was taken.
    async fn acquire(
        &self,
        request: &AcquireRequest,
    ) -> Result<(AcquireResponse, Option<LeaseId>), Status> {
        caps::validate(&request.domain, &request.descriptors)?;
        let requested_ttl =
            requested_ttl(request.lease_ttl.as_ref(), LEASE_TTL_RANGE, "lease_ttl")?;
        if request.holder.len() > MAX_HOLDER_BYTES {
            return Err(Status::invalid_argument(format!(
                "holder is {} bytes: at most {MAX_HOLDER_BYTES}",
                request.holder.len()
            )));
        }
        let config = self.config.current();
        let matched = self.matched_slots(&config, request);
        if matched.is_empty() {
            // Nothing limits this connection.
            return Ok((
                AcquireResponse {
                    granted: true,
                    ..Default::default()
                },
                None,
            ));
        }
        let ttl = requested_ttl
            .or_else(|| matched.iter().map(|(_, rule)| rule.lease_ttl).min())
            .unwrap_or(crate::config::file::DEFAULT_LEASE_TTL);
        let ttl_ms = ttl.as_millis() as u64;
        let slots: Vec<LeaseSlot> = matched.iter().map(|(slot, _)| slot.clone()).collect();
        let lease = LeaseId::new(ttl_ms, slots.iter().map(|s| s.key.clone()).collect());
        // An id too long to come back in a Heartbeat or Release would hold
        // its places until the TTL.
        let id = returnable(lease.encode(), MAX_LEASE_ID_BYTES, "lease id", "lease sets")?;
        let acquired = self
            .store
            .acquire(&slots, &lease.member, &request.holder, ttl_ms)
            .await
            .map_err(|error| {
                for (_, rule) in &matched {
                    let (domain, path) = (request.domain.clone(), rule.path.clone());
                    metrics::counter!("ratekeeper_concurrency_acquires", "domain" => domain, "rule" => path, "result" => "failed")
                        .increment(1);
                }
                store_failed(error)
            })?;

        // Report the tightest set: the fewest free places (a full one refused).
        let tightest = (0..slots.len())
            .min_by_key(|&i| slots[i].limit.saturating_sub(acquired.active[i]))
            .unwrap_or(0);
        let result = if acquired.granted {
            "granted"
        } else {
            "refused"
        };
        for ((_, rule), active) in matched.iter().zip(&acquired.active) {
            let (domain, path) = (request.domain.clone(), rule.path.clone());
            metrics::counter!("ratekeeper_concurrency_acquires", "domain" => domain.clone(), "rule" => path.clone(), "result" => result)
                .increment(1);
            // Sampled: the active count seen by the latest acquire on this rule.
            metrics::gauge!("ratekeeper_concurrency_active", "domain" => domain, "rule" => path)
                .set(*active as f64);
        }
        if acquired.expired > 0 {
            metrics::counter!("ratekeeper_concurrency_leases_expired").increment(acquired.expired);
        }
        tracing::debug!(domain = %request.domain, holder = %request.holder, granted = acquired.granted, "acquire");
        let response = AcquireResponse {
            granted: acquired.granted,
            lease_id: if acquired.granted { id } else { String::new() },
            active: u32::try_from(acquired.active[tightest]).unwrap_or(u32::MAX),
            limit: u32::try_from(slots[tightest].limit).unwrap_or(u32::MAX),
            retry_after: (!acquired.granted).then(|| duration(acquired.retry_after_ms)),
            lease_ttl: Some(duration(ttl_ms)),
        };
        Ok((response, acquired.granted.then_some(lease)))
    }

    fn decode_all(&self, ids: &[String]) -> Result<Vec<LeaseId>, Status> {
        if ids.len() > MAX_LEASE_IDS {
            return Err(Status::invalid_argument(format!(
                "{} lease ids: at most {MAX_LEASE_IDS} per call",
                ids.len()
            )));
        }
        let leases: Vec<LeaseId> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                LeaseId::decode(id, &self.key_prefix)
                    .map_err(|e| Status::invalid_argument(format!("lease_ids[{i}]: {e}")))
            })
            .collect::<Result<_, _>>()?;
        Ok(leases)
    }
}

/// `leases` in runs of at most [`MAX_LEASE_SETS`] sets (a lease of more is
/// a run of its own), one store call each.
fn store_calls(leases: &[LeaseId]) -> Vec<&[LeaseId]> {
    let mut calls = Vec::new();
    let (mut start, mut sets) = (0, 0);
    for (i, lease) in leases.iter().enumerate() {
        if sets > 0 && sets + lease.keys.len() > MAX_LEASE_SETS {
            calls.push(&leases[start..i]);
            (start, sets) = (i, 0);
        }
        sets += lease.keys.len();
    }
    if start < leases.len() {
        calls.push(&leases[start..]);
    }
    calls
}

fn refs(leases: &[LeaseId]) -> Vec<LeaseRef<'_>> {
    leases.iter().map(LeaseId::lease_ref).collect()
}

fn store_failed(error: crate::Error) -> Status {
    super::wire::store_failed("lease", error)
}

#[tonic::async_trait]
impl ConcurrencyService for Concurrency {
    async fn acquire_connection(
        &self,
        request: Request<AcquireRequest>,
    ) -> Result<Response<AcquireResponse>, Status> {
        let (response, _) = self.acquire(request.get_ref()).await?;
        Ok(Response::new(response))
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let ids = &request.get_ref().lease_ids;
        let leases = self.decode_all(ids)?;
        let mut alive = Vec::with_capacity(leases.len());
        for call in store_calls(&leases) {
            let extended = self.store.heartbeat(&refs(call)).await;
            alive.extend(extended.map_err(store_failed)?);
        }
        let mut response = HeartbeatResponse::default();
        for (id, alive) in ids.iter().zip(alive) {
            if alive {
                response.extended.push(id.clone());
            } else {
                metrics::counter!("ratekeeper_concurrency_leases_lost").increment(1);
                response.lost.push(id.clone());
            }
        }
        Ok(Response::new(response))
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let leases = self.decode_all(&request.get_ref().lease_ids)?;
        for call in store_calls(&leases) {
            self.store
                .release(&refs(call))
                .await
                .map_err(store_failed)?;
        }
        Ok(Response::new(ReleaseResponse {}))
    }

    type HoldStream = ReceiverStream<Result<HoldEvent, Status>>;

    async fn hold(
        &self,
        request: Request<AcquireRequest>,
    ) -> Result<Response<Self::HoldStream>, Status> {
        let request = request.into_inner();
        let (response, lease) = self.acquire(&request).await?;
        let (tx, rx) = mpsc::channel(2);
        let id = response.lease_id.clone();
        let first = HoldEvent {
            event: Some(hold_event::Event::Acquired(response)),
        };
        // The channel is new and has room: this cannot fail.
        let _ = tx.try_send(Ok(first));
        if let Some(lease) = lease {
            let (lost_tx, lost_rx) = oneshot::channel();
            self.holds
                .insert(id.clone(), lease, &request.domain, lost_tx);
            let holds = self.holds.clone();
            tokio::spawn(async move {
                tokio::select! {
                    // The caller went away or ended the stream: release now.
                    () = tx.closed() => holds.release(&id).await,
                    Ok(()) = lost_rx => {
                        let _ = tx.send(Ok(HoldEvent { event: Some(hold_event::Event::Lost(id)) })).await;
                    }
                    // The replica is draining: give the place back before
                    // saying so, so the caller can hold again elsewhere at once.
                    () = holds.closed() => {
                        holds.release(&id).await;
                        let _ = tx.send(Err(Status::unavailable(
                            "ratekeeper is shutting down: the lease was released; hold again on another replica",
                        ))).await;
                    }
                }
            });
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_calls_hold_at_most_the_cap_of_sets_but_a_lease_whole() {
        let lease = |sets: usize| {
            let keys = (0..sets).map(|i| format!("rk:{{d|k={i}}}:conn")).collect();
            LeaseId::new(30_000, keys)
        };
        let leases: Vec<LeaseId> = [4_000, 96, 1, 5_000, 2].map(lease).to_vec();
        let calls: Vec<usize> = store_calls(&leases).iter().map(|c| c.len()).collect();
        assert_eq!(calls, [2, 1, 1, 1]);
        assert!(store_calls(&[]).is_empty());
    }
}
