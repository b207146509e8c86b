//! envoyproxy/ratelimit's runtime layout (`RUNTIME_ROOT`,
//! `RUNTIME_SUBDIRECTORY`, `RUNTIME_APPDIRECTORY`, `RUNTIME_IGNOREDOTFILES`,
//! `RUNTIME_WATCH_ROOT`): which files hold the limits, chosen as their
//! runtime loader (lyft/goruntime) chooses them: every file under the
//! directory, recursively, whatever its name, symlinked directories not
//! entered.

use std::path::{Path, PathBuf};

use crate::error::ConfigError;

/// Where envoyproxy/ratelimit's runtime keeps the limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runtime {
    pub root: PathBuf,
    pub subdirectory: String,
    /// The app directory (`config`): with `watch_root`, a key prefix.
    pub app_directory: String,
    /// Skip files and directories whose name starts with `.`.
    pub ignore_dotfiles: bool,
    /// Their `RUNTIME_WATCH_ROOT`: walk `root/subdirectory` and keep the
    /// keys (relative paths, `/` read as `.`) starting with
    /// `app_directory.`; otherwise walk `root/subdirectory/app_directory`.
    pub watch_root: bool,
}

impl Runtime {
    /// The directory walked.
    pub fn base(&self) -> PathBuf {
        let base = self.root.join(&self.subdirectory);
        if self.watch_root {
            base
        } else {
            base.join(&self.app_directory)
        }
    }

    /// Whether the limits directory is missing but may yet appear where
    /// envoyproxy/ratelimit would see it: with `watch_root` its runtime
    /// watches `root`'s parent (a symlink swap creates `root` there), so
    /// it starts with no limits and loads them once they appear; else it
    /// watches the directory itself, and a missing one stops the start.
    pub fn not_there_yet(&self) -> bool {
        let watched = match self.root.parent() {
            Some(parent) if parent.as_os_str().is_empty() => Path::new("."),
            Some(parent) => parent,
            None => return false,
        };
        self.watch_root
            && !self.subdirectory.is_empty()
            && !self.base().exists()
            && watched.is_dir()
    }

    /// The limits files, sorted by path.
    pub fn files(&self) -> Result<Vec<PathBuf>, ConfigError> {
        // goruntime loads nothing without a subdirectory to watch.
        if self.watch_root && self.subdirectory.is_empty() {
            return Ok(Vec::new());
        }
        let base = self.base();
        std::fs::metadata(&base).map_err(|e| {
            ConfigError::new(&base, format!("cannot read the limits directory: {e}"))
        })?;
        let mut files = Vec::new();
        self.walk(&base, &mut files)?;
        let prefix = format!("{}.", self.app_directory);
        if self.watch_root {
            files.retain(|path| key(&base, path).starts_with(&prefix));
        }
        files.sort();
        Ok(files)
    }

    /// Every file under `dir` (Go's `filepath.Walk`: entries by `lstat`, so
    /// a symlink to a file is read and one to a directory is not entered).
    fn walk(&self, dir: &Path, files: &mut Vec<PathBuf>) -> Result<(), ConfigError> {
        let entries = std::fs::read_dir(dir)
            .map_err(|e| ConfigError::new(dir, format!("cannot read the limits directory: {e}")))?;
        for entry in entries {
            let entry = entry.map_err(|e| {
                ConfigError::new(dir, format!("cannot read the limits directory: {e}"))
            })?;
            let dotted = entry.file_name().to_string_lossy().starts_with('.');
            if self.ignore_dotfiles && dotted {
                continue;
            }
            let path = entry.path();
            match entry.file_type() {
                Ok(kind) if kind.is_dir() => self.walk(&path, files)?,
                Ok(_) if std::fs::metadata(&path).is_ok_and(|m| m.is_file()) => files.push(path),
                // A dangling (or looping) link: loading it names it, and the
                // config in force stays. goruntime warns and reads on, and
                // the domain of a ConfigMap key whose file went vanished
                // unseen. (A key the kubelet drops dangles for a moment,
                // which the watcher waits out: `watch`.)
                Ok(kind) if kind.is_symlink() && std::fs::metadata(&path).is_err() => {
                    files.push(path)
                }
                // Not a file: a symlinked directory, a socket.
                _ => {}
            }
        }
        Ok(())
    }
}

/// goruntime's key of `path`: relative to `base`, `/` replaced by `.`.
fn key(base: &Path, path: &Path) -> String {
    let relative = path.strip_prefix(base).unwrap_or(path);
    relative.to_string_lossy().replace('/', ".")
}

#[cfg(test)]
mod tests {
    use super::Runtime;
    use std::path::Path;

    fn write(path: &Path) {
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, "x").expect("write");
    }

    fn names(runtime: &Runtime) -> Vec<String> {
        let base = runtime.root.clone();
        runtime
            .files()
            .expect("files")
            .iter()
            .map(|p| {
                p.strip_prefix(&base)
                    .expect("under root")
                    .display()
                    .to_string()
            })
            .collect()
    }

    #[test]
    fn chooses_the_files_goruntime_loads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        for file in [
            "rl/config/a.yaml",
            "rl/config/b.conf",
            "rl/config/nested/c",
            "rl/config/.hidden.yaml",
            "rl/config/.dot/d.yaml",
            "rl/config.extra",
            "rl/other/e.yaml",
        ] {
            write(&root.join(file));
        }
        std::os::unix::fs::symlink(root.join("rl/other"), root.join("rl/config/linked"))
            .expect("symlink");
        let mut runtime = Runtime {
            root: root.to_owned(),
            subdirectory: "rl".into(),
            app_directory: "config".into(),
            ignore_dotfiles: false,
            watch_root: true,
        };
        assert_eq!(
            names(&runtime),
            [
                "rl/config/.dot/d.yaml",
                "rl/config/.hidden.yaml",
                "rl/config/a.yaml",
                "rl/config/b.conf",
                "rl/config/nested/c",
                "rl/config.extra",
            ]
        );
        runtime.ignore_dotfiles = true;
        runtime.watch_root = false;
        assert_eq!(
            names(&runtime),
            ["rl/config/a.yaml", "rl/config/b.conf", "rl/config/nested/c"]
        );
        runtime.watch_root = true;
        runtime.subdirectory.clear();
        assert!(names(&runtime).is_empty(), "no subdirectory: nothing");
    }

    #[test]
    fn a_dangling_link_is_listed_to_be_named_when_loading() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        write(&root.join("rl/config/a.yaml"));
        std::os::unix::fs::symlink(root.join("gone.yaml"), root.join("rl/config/b.yaml"))
            .expect("symlink");
        let runtime = Runtime {
            root: root.to_owned(),
            subdirectory: "rl".into(),
            app_directory: "config".into(),
            ignore_dotfiles: true,
            watch_root: false,
        };
        assert_eq!(names(&runtime), ["rl/config/a.yaml", "rl/config/b.yaml"]);
    }
}
