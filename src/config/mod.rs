//! The limits configuration: a directory of YAML files, one domain each, in
//! envoyproxy/ratelimit's format. Loading is all-or-nothing: any error in any
//! file refuses the whole directory, and the running config stays.

pub mod file;
pub mod watch;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub use self::file::DomainConfig;
use crate::error::ConfigError;

/// Every domain of one successfully loaded limits directory.
#[derive(Debug, Default)]
pub struct Config {
    domains: HashMap<String, DomainConfig>,
}

impl Config {
    /// Loads every `*.yaml` / `*.yml` file directly in `dir` (following
    /// symlinks, skipping hidden entries such as a ConfigMap's `..data`).
    pub fn load_dir(dir: &Path) -> Result<Config, ConfigError> {
        let files = limits_files(dir)?;
        let mut texts = Vec::with_capacity(files.len());
        for path in files {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| ConfigError::new(&path, format!("cannot read: {e}")))?;
            texts.push((path, text));
        }
        Config::from_files(texts.iter().map(|(p, t)| (p.as_path(), t.as_str())))
    }

    /// Builds a config from `(file name, YAML text)` pairs.
    pub fn from_files<'a>(
        files: impl IntoIterator<Item = (&'a Path, &'a str)>,
    ) -> Result<Config, ConfigError> {
        let mut domains = HashMap::new();
        let mut origin: HashMap<String, PathBuf> = HashMap::new();
        for (path, text) in files {
            let domain = file::parse(path, text)?;
            if let Some(first) = origin.get(&domain.name) {
                return Err(ConfigError::new(
                    path,
                    format!(
                        "duplicate domain {:?} (already defined in {})",
                        domain.name,
                        first.display()
                    ),
                ));
            }
            origin.insert(domain.name.clone(), path.to_owned());
            domains.insert(domain.name.clone(), domain);
        }
        Ok(Config { domains })
    }

    pub fn domain(&self, name: &str) -> Option<&DomainConfig> {
        self.domains.get(name)
    }

    /// Domain names, sorted.
    pub fn domain_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.domains.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }
}

/// The limits files in `dir`, sorted by name.
pub fn limits_files(dir: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| ConfigError::new(dir, format!("cannot read the limits directory: {e}")))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry
            .map_err(|e| ConfigError::new(dir, format!("cannot read the limits directory: {e}")))?;
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let is_yaml = name.ends_with(".yaml") || name.ends_with(".yml");
        // `metadata` follows symlinks: a ConfigMap's files are links into `..data`.
        if name.starts_with('.') || !is_yaml || !std::fs::metadata(&path).is_ok_and(|m| m.is_file())
        {
            continue;
        }
        files.push(path);
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests;
