//! The soak run's lease churn: clients that each loop acquire → a few
//! heartbeats → release on `ConcurrencyService`, each call to a replica
//! picked at random (any replica may heartbeat or release any lease), until
//! the run ends; a lease still held then is released.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tonic::Status;

use crate::keys::Rng;
use crate::soak::lease_api::ConcurrencyClient;
use crate::soak::Soak;

/// Pause after a refused or failed acquire before the next one.
const RETRY: Duration = Duration::from_millis(100);

/// Heartbeats per held lease: 1 to this many.
const MAX_HEARTBEATS: u64 = 4;

/// One lease client, looping until the run ends.
pub async fn run_client(soak: Arc<Soak>, index: usize, seed: u64) {
    let mut rng = Rng(seed);
    let holder = format!("soak-{index}");
    while Instant::now() < soak.end {
        let user = format!("u{}", rng.below(soak.args.lease_users));
        let replica = pick(&soak, &mut rng);
        let acquired = timed(&soak, replica, |mut c| {
            let (soak, user, holder) = (soak.clone(), user.clone(), holder.clone());
            async move {
                c.acquire(&soak.args.lease_domain, &soak.args.key, &user, &holder)
                    .await
            }
        })
        .await;
        match acquired {
            Ok(response) if response.granted && !response.lease_id.is_empty() => {
                soak.recorder
                    .count(SystemTime::now(), replica, |c| c.lease_granted += 1);
                hold(&soak, &mut rng, &response.lease_id).await;
            }
            Ok(response) if response.granted => {
                // Granted with nothing to hold: no rule limits the user.
                soak.recorder
                    .count(SystemTime::now(), replica, |c| c.lease_errors += 1);
                soak.recorder.error(format!(
                    "AcquireConnection: no concurrency rule in domain {} limits {}",
                    soak.args.lease_domain, soak.args.key
                ));
                tokio::time::sleep(RETRY).await;
            }
            Ok(_) => {
                soak.recorder
                    .count(SystemTime::now(), replica, |c| c.lease_refused += 1);
                tokio::time::sleep(RETRY).await;
            }
            Err(message) => {
                soak.recorder
                    .count(SystemTime::now(), replica, |c| c.lease_errors += 1);
                soak.recorder.error(format!("AcquireConnection: {message}"));
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

/// Heartbeats a granted lease a few times, then releases it (unless a
/// heartbeat found it lost).
async fn hold(soak: &Arc<Soak>, rng: &mut Rng, lease_id: &str) {
    let beats = 1 + rng.below(MAX_HEARTBEATS);
    for _ in 0..beats {
        tokio::time::sleep(Duration::from_millis(soak.args.heartbeat_ms)).await;
        if Instant::now() >= soak.end {
            break;
        }
        let replica = pick(soak, rng);
        let id = lease_id.to_owned();
        let beat = timed(soak, replica, |mut c| async move { c.heartbeat(&id).await }).await;
        match beat {
            Ok(response) if response.lost.iter().any(|l| l == lease_id) => {
                soak.recorder
                    .count(SystemTime::now(), replica, |c| c.heartbeat_lost += 1);
                return;
            }
            Ok(_) => soak
                .recorder
                .count(SystemTime::now(), replica, |c| c.heartbeat_extended += 1),
            Err(message) => {
                soak.recorder
                    .count(SystemTime::now(), replica, |c| c.lease_errors += 1);
                soak.recorder.error(format!("Heartbeat: {message}"));
            }
        }
    }
    let replica = pick(soak, rng);
    let id = lease_id.to_owned();
    if let Err(message) = timed(soak, replica, |mut c| async move { c.release(&id).await }).await {
        soak.recorder
            .count(SystemTime::now(), replica, |c| c.lease_errors += 1);
        soak.recorder.error(format!("Release: {message}"));
    }
}

fn pick(soak: &Soak, rng: &mut Rng) -> usize {
    rng.below(soak.leases.len() as u64) as usize
}

/// Runs one lease call on `replica` with the run's timeout, counting it late
/// past the deadline.
async fn timed<T, F, Fut>(soak: &Arc<Soak>, replica: usize, call: F) -> Result<T, String>
where
    F: FnOnce(ConcurrencyClient) -> Fut,
    Fut: Future<Output = Result<T, Status>>,
{
    let sent = SystemTime::now();
    let started = Instant::now();
    let timeout = Duration::from_millis(soak.args.timeout_ms);
    let result = tokio::time::timeout(timeout, call(soak.leases[replica].clone())).await;
    if started.elapsed() > Duration::from_millis(soak.args.deadline_ms) {
        soak.recorder.count(sent, replica, |c| c.lease_late += 1);
    }
    match result {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(status)) => Err(format!("{:?}: {}", status.code(), status.message())),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}
