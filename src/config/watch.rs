//! Hot reload: the running config, shared by every request, and a poller that
//! reloads it when the limits directory's contents change.
//!
//! Polling contents (not inotify) sees every way a directory can change,
//! including the atomic symlink swap of a Kubernetes ConfigMap, at the cost of
//! reading a few small files once per interval.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use super::{Config, LimitsDir, LoadOptions};

/// The config in force; cheap to clone and to read.
#[derive(Debug, Clone)]
pub struct SharedConfig {
    config: Arc<RwLock<Arc<Config>>>,
    /// False from [`SharedConfig::awaiting_first`] until the first
    /// [`SharedConfig::replace`].
    loaded: Arc<AtomicBool>,
    /// Woken by every [`SharedConfig::replace`] (see [`SharedConfig::changed`]).
    changed: Arc<tokio::sync::Notify>,
}

impl SharedConfig {
    pub fn new(config: Config) -> Self {
        SharedConfig {
            config: Arc::new(RwLock::new(Arc::new(config))),
            loaded: Arc::new(AtomicBool::new(true)),
            changed: Arc::default(),
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
        let old = match self.config.write() {
            Ok(mut guard) => std::mem::replace(&mut *guard, config),
            Err(poisoned) => std::mem::replace(&mut *poisoned.into_inner(), config),
        };
        self.loaded.store(true, Ordering::Relaxed);
        self.changed.notify_one();
        retire(old);
    }

    /// Resolves once the config has been replaced since the last call
    /// returned (or since the start): for the one task that follows it,
    /// readiness (which may need a domain loaded).
    pub async fn changed(&self) {
        self.changed.notified().await;
    }
}

/// Frees a config taken out of force away from requests: a large one takes
/// long to free (some 100 ms for 100,000 descriptors), and whoever drops
/// the last reference pays it. Dropped under the write lock, it held up
/// every request for that long; so the blocking pool waits (a while) for
/// the requests still reading it to finish, then frees it.
fn retire(old: Arc<Config>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn_blocking(move || {
        let mut old = old;
        for _ in 0..1_000 {
            old = match Arc::try_unwrap(old) {
                Ok(config) => {
                    drop(config);
                    return;
                }
                Err(still_read) => still_read,
            };
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

/// A fingerprint of the directory's limits files: names and contents, or
/// why one cannot be read (so that an edit to another is still seen); when
/// they cannot be listed (the directory missing, a name on a dangling
/// link), of why: a listing failing for another reason is a change too.
pub fn fingerprint(dir: &LimitsDir) -> u64 {
    fingerprint_read(dir, |path| std::fs::read(path))
}

fn fingerprint_read(
    dir: &LimitsDir,
    read: impl Fn(&std::path::Path) -> std::io::Result<Vec<u8>>,
) -> u64 {
    match dir.files() {
        Ok(files) => crate::fingerprint::of_files(files, read),
        Err(why) => {
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            std::hash::Hash::hash(&why.to_string(), &mut hasher);
            std::hash::Hasher::finish(&hasher)
        }
    }
}

/// A limits directory to watch, and its [`fingerprint`] when the config in
/// force was loaded from it (of why it could not be read, when it could
/// not: it may appear later), `None` when none was taken (the watcher
/// takes it at its first look).
#[derive(Debug, Clone)]
pub struct Watched {
    pub dir: LimitsDir,
    pub loaded: Option<u64>,
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
        Some(print) => Some(print),
        None => off_runtime(dir.clone(), fingerprint).await,
    };
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The directory whose failure to load was a dangling link, not yet
    // reported: it is looked at again first.
    let mut deferred = None;
    loop {
        tick.tick().await;
        let seen = last;
        let changed = off_runtime(dir.clone(), move |dir| {
            let now = fingerprint(dir);
            if Some(now) == seen {
                return None;
            }
            let result = Config::load(dir, options);
            let dangling = result.as_ref().is_err_and(|e| is_dangling_link(&e.file));
            // Changed while loading (a ConfigMap swapped, a file still being
            // written): what was read may mix the two; the next look loads
            // it again rather than report a half-read directory.
            (fingerprint(dir) == now).then_some((now, result, dangling))
        });
        let Some((now, result, dangling)) = changed.await.flatten() else {
            continue;
        };
        // Kubernetes updates a ConfigMap by re-pointing `..data`, then
        // removes the links of keys gone from it: in between, such a link
        // dangles. Such a failure is reported only if the next look finds
        // the directory the same; until then `last` stays, so it is
        // loaded again.
        if dangling && deferred != Some(now) {
            deferred = Some(now);
            continue;
        }
        deferred = None;
        last = Some(now);
        match result {
            Ok(config) => {
                tracing::info!(%dir, domains = ?config.domain_names(), "limits reloaded");
                shared.replace(config);
                record_load(true);
            }
            Err(error) => {
                tracing::error!(%error, "limits reload failed; keeping the running config");
                record_load(false);
            }
        }
    }
}

/// Whether `path` is a symbolic link to nothing.
fn is_dangling_link(path: &std::path::Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
        && std::fs::metadata(path).is_err()
}

/// `read(&dir)` on the blocking pool; `None` if it panicked.
async fn off_runtime<T: Send + 'static>(
    dir: LimitsDir,
    read: impl FnOnce(&LimitsDir) -> T + Send + 'static,
) -> Option<T> {
    tokio::task::spawn_blocking(move || read(&dir)).await.ok()
}

/// Counts a config load attempt in metrics, under ratekeeper's names and
/// envoyproxy/ratelimit's (Prometheus and statsd), and sets
/// `ratekeeper_config_load_failing`: 1 from a refused load until one
/// succeeds, so that an alert stays up as long as what is on disk (or
/// offered over xDS) is refused, not only for a while after.
pub fn record_load(loaded: bool) {
    let outcome = if loaded { "success" } else { "error" };
    metrics::gauge!("ratekeeper_config_load_failing").set(if loaded { 0.0 } else { 1.0 });
    metrics::counter!(format!("ratekeeper_config_load_{outcome}")).increment(1);
    crate::their_stats::TheirCounter::new(&format!("ratelimit.service.config_load_{outcome}"))
        .add(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file that cannot be read still leaves the others watched: an edit
    /// to them changes the fingerprint (and so is loaded, and its failure
    /// reported, again), while nothing changing keeps it.
    #[test]
    fn an_unreadable_file_hides_no_edit_to_the_others() {
        let root = tempfile::tempdir().unwrap();
        let (a, b) = (root.path().join("a.yaml"), root.path().join("b.yaml"));
        std::fs::write(&a, "domain: a\n").unwrap();
        std::fs::write(&b, "domain: b\n").unwrap();
        let dir = LimitsDir::Flat(root.path().to_path_buf());
        let denied = |path: &std::path::Path| {
            if path.ends_with("b.yaml") {
                Err(std::io::ErrorKind::PermissionDenied.into())
            } else {
                std::fs::read(path)
            }
        };
        let before = fingerprint_read(&dir, denied);
        assert_eq!(fingerprint_read(&dir, denied), before, "nothing changed");
        std::fs::write(&a, "domain: a2\n").unwrap();
        assert_ne!(fingerprint_read(&dir, denied), before, "a.yaml was edited");
        assert_ne!(
            fingerprint(&dir),
            fingerprint_read(&dir, denied),
            "b.yaml readable again"
        );
    }

    /// A listing that fails is told apart by why: another failing name is
    /// a change (the watcher then loads it and names the new one).
    #[test]
    fn listing_failures_differ_by_what_failed() {
        let root = tempfile::tempdir().unwrap();
        let dir = LimitsDir::Flat(root.path().to_owned());
        std::fs::create_dir(root.path().join("dir.yaml")).unwrap();
        assert!(dir.files().is_err(), "a directory's yaml name fails");
        let first = fingerprint(&dir);
        assert_eq!(fingerprint(&dir), first);
        std::fs::remove_dir(root.path().join("dir.yaml")).unwrap();
        std::os::unix::fs::symlink("nowhere", root.path().join("dang.yaml")).unwrap();
        assert!(dir.files().is_err(), "a dangling link's name fails");
        assert_ne!(fingerprint(&dir), first, "another name fails");
    }

    /// A directory that could not be read when the server loaded (it did
    /// not exist yet) is loaded once it appears, even before the watcher's
    /// first look.
    #[tokio::test]
    async fn a_directory_missing_at_the_load_is_loaded_when_it_appears() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("limits");
        let dir = LimitsDir::Flat(path.clone());
        let loaded = Some(fingerprint(&dir));
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
