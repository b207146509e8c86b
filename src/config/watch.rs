//! Hot reload: the running config, shared by every request, and a poller that
//! reloads it when the limits directory's contents change.
//!
//! Polling contents (not inotify) sees every way a directory can change,
//! including the atomic symlink swap of a Kubernetes ConfigMap, at the cost of
//! reading a few small files once per interval.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use super::{Config, LimitsDir, LoadOptions};
use crate::error::ConfigError;

/// The config in force; cheap to clone and to read.
#[derive(Debug, Clone)]
pub struct SharedConfig {
    config: Arc<RwLock<Arc<Config>>>,
    /// False from [`SharedConfig::awaiting_first`] until the first
    /// [`SharedConfig::replace`].
    loaded: Arc<AtomicBool>,
}

impl SharedConfig {
    pub fn new(config: Config) -> Self {
        SharedConfig {
            config: Arc::new(RwLock::new(Arc::new(config))),
            loaded: Arc::new(AtomicBool::new(true)),
        }
    }

    /// No limits until a source delivers its first (an xDS server's first
    /// snapshot, a limits directory that loads later): meanwhile every
    /// domain is unknown, and [`SharedConfig::is_loaded`] false.
    pub fn awaiting_first() -> Self {
        let shared = SharedConfig::new(Config::default());
        shared.loaded.store(false, Ordering::Relaxed);
        shared
    }

    /// Whether any limits have been put in force (see
    /// [`SharedConfig::awaiting_first`]).
    pub fn is_loaded(&self) -> bool {
        self.loaded.load(Ordering::Relaxed)
    }

    /// The config in force now; a request keeps using it even if a reload
    /// lands meanwhile.
    pub fn current(&self) -> Arc<Config> {
        match self.config.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub fn replace(&self, config: Config) {
        let config = Arc::new(config);
        match self.config.write() {
            Ok(mut guard) => *guard = config,
            Err(poisoned) => *poisoned.into_inner() = config,
        }
        self.loaded.store(true, Ordering::Relaxed);
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

/// A limits directory to watch, and its [`fingerprint`] when the config in
/// force was loaded from it: `Some(None)` when it could not be read then
/// (it may appear later), `None` when none was taken (the watcher takes
/// it at its first look).
#[derive(Debug, Clone)]
pub struct Watched {
    pub dir: LimitsDir,
    pub loaded: Option<Option<u64>>,
}

/// Reloads `shared` from the directory (read with `options`) whenever its
/// fingerprint changes, until the task is dropped. A config that fails to
/// load is logged and counted, and the running one stays. Reading and
/// parsing run on the blocking pool: a huge or slow file must not stall the
/// HTTP listeners and shutdown that share this task's runtime.
pub async fn watch(
    (watched, options): (Watched, LoadOptions),
    shared: SharedConfig,
    interval: Duration,
) {
    let Watched { dir, loaded } = watched;
    let mut last = match loaded {
        Some(print) => print,
        None => off_runtime(dir.clone(), fingerprint).await.flatten(),
    };
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let seen = last;
        let changed = off_runtime(dir.clone(), move |dir| {
            let now = fingerprint(dir);
            (now != seen).then(|| (now, Config::load(dir, options)))
        });
        let Some((now, result)) = changed.await.flatten() else {
            continue;
        };
        last = now;
        match result {
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

/// `read(&dir)` on the blocking pool; `None` if it panicked.
async fn off_runtime<T: Send + 'static>(
    dir: LimitsDir,
    read: impl FnOnce(&LimitsDir) -> T + Send + 'static,
) -> Option<T> {
    tokio::task::spawn_blocking(move || read(&dir)).await.ok()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory that could not be read when the server loaded (it did
    /// not exist yet) is loaded once it appears, even before the watcher's
    /// first look.
    #[tokio::test]
    async fn a_directory_missing_at_the_load_is_loaded_when_it_appears() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("limits");
        let dir = LimitsDir::Flat(path.clone());
        let loaded = Some(fingerprint(&dir));
        assert_eq!(loaded, Some(None), "nothing to read yet");
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("l.yaml"), "domain: d\n").unwrap();
        let shared = SharedConfig::awaiting_first();
        let watched = Watched { dir, loaded };
        let interval = Duration::from_millis(20);
        let task = tokio::spawn(watch(
            (watched, LoadOptions::default()),
            shared.clone(),
            interval,
        ));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !shared.is_loaded() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(interval).await;
        }
        task.abort();
        assert!(shared.is_loaded(), "the directory was never loaded");
    }
}
