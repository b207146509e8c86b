//! Hot reload: the running config, shared by every request, and a poller that
//! reloads it when the limits directory's contents change.
//!
//! Polling contents (not inotify) sees every way a directory can change,
//! including the atomic symlink swap of a Kubernetes ConfigMap, at the cost of
//! reading a few small files once per interval.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use std::sync::{Arc, RwLock};
use std::time::Duration;

use super::{Config, LimitsDir, LoadOptions};
use crate::error::ConfigError;

/// The config in force; cheap to clone and to read.
#[derive(Debug, Clone, Default)]
pub struct SharedConfig(Arc<RwLock<Arc<Config>>>);

impl SharedConfig {
    pub fn new(config: Config) -> Self {
        SharedConfig(Arc::new(RwLock::new(Arc::new(config))))
    }

    /// The config in force now; a request keeps using it even if a reload
    /// lands meanwhile.
    pub fn current(&self) -> Arc<Config> {
        match self.0.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub fn replace(&self, config: Config) {
        let config = Arc::new(config);
        match self.0.write() {
            Ok(mut guard) => *guard = config,
            Err(poisoned) => *poisoned.into_inner() = config,
        }
    }
}

/// A fingerprint of the directory's limits files: names and contents.
pub fn fingerprint(dir: &LimitsDir) -> Option<u64> {
    let files = dir.files().ok()?;
    let mut hasher = DefaultHasher::new();
    for path in files {
        path.hash(&mut hasher);
        std::fs::read(&path).ok()?.hash(&mut hasher);
    }
    Some(hasher.finish())
}

/// Reloads `shared` from `dir` (read with `options`) whenever its
/// fingerprint changes, until the task is dropped. A config that fails to
/// load is logged and counted, and the running one stays.
pub async fn watch(
    (dir, options): (LimitsDir, LoadOptions),
    shared: SharedConfig,
    interval: Duration,
) {
    let mut last = fingerprint(&dir);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = fingerprint(&dir);
        if now == last {
            continue;
        }
        last = now;
        match Config::load(&dir, options) {
            Ok(config) => {
                tracing::info!(%dir, domains = ?config.domain_names(), "limits reloaded");
                shared.replace(config);
                record_load(Ok(()));
            }
            Err(error) => {
                tracing::error!(%error, "limits reload failed; keeping the running config");
                record_load(Err(&error));
            }
        }
    }
}

/// Counts a config load attempt in metrics, under ratekeeper's names and
/// envoyproxy/ratelimit's (Prometheus and statsd).
pub fn record_load(result: Result<(), &ConfigError>) {
    let outcome = match result {
        Ok(()) => "success",
        Err(_) => "error",
    };
    metrics::counter!(format!("ratekeeper_config_load_{outcome}")).increment(1);
    crate::their_stats::TheirCounter::new(&format!("ratelimit.service.config_load_{outcome}"))
        .add(1);
}
