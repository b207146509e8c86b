//! The limits configuration. Two sources, one compiler: a directory of YAML
//! files in envoyproxy/ratelimit's format ([`file`](mod@file)) and xDS
//! `RateLimitConfig` messages ([`xds`]) each translate into a
//! [`description`], which [`compile`] checks and builds into the model below
//! (a [`DomainConfig`] per domain, its rules in [`crate::rules`]). Loading is
//! all-or-nothing: any error in any file refuses the whole directory, and the
//! running config stays.

pub mod compile;
pub mod description;
pub mod file;
pub mod watch;
pub mod xds;
pub mod xds_client;
mod yaml_lines;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::ConfigError;
use crate::rules::{ConcurrencyRule, RuleTree};
use crate::vocab::FailureMode;

/// Per-domain settings (ratekeeper's additions to the format).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainOptions {
    /// A refused request consumes nothing (default); `false` is Envoy's
    /// behaviour, where the descriptors that fit are consumed anyway.
    pub all_or_nothing: bool,
    /// Whether to add RateLimit-* headers; `None` follows the server flag.
    pub response_headers: Option<bool>,
    /// The answer while the store fails; `None` follows the server flag.
    pub failure_mode: Option<FailureMode>,
}

/// One domain, compiled.
#[derive(Debug)]
pub struct DomainConfig {
    pub name: String,
    pub rules: RuleTree,
    /// The `concurrency:` rules.
    pub concurrency: RuleTree<ConcurrencyRule>,
    pub options: DomainOptions,
}

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
        let mut domains = Vec::new();
        for (path, text) in files {
            for domain in file::parse(path, text)? {
                domains.push((path.to_owned(), domain));
            }
        }
        Config::from_domains(domains)
    }

    /// Builds a config from compiled domains, each with where it came from
    /// (a file, or a name for an xDS resource); a domain may appear once.
    pub fn from_domains(
        compiled: impl IntoIterator<Item = (PathBuf, DomainConfig)>,
    ) -> Result<Config, ConfigError> {
        let mut domains = HashMap::new();
        let mut origin: HashMap<String, PathBuf> = HashMap::new();
        for (source, domain) in compiled {
            if let Some(first) = origin.get(&domain.name) {
                return Err(ConfigError::new(
                    &source,
                    format!(
                        "duplicate domain {:?} (already defined in {})",
                        domain.name,
                        first.display()
                    ),
                ));
            }
            origin.insert(domain.name.clone(), source);
            domains.insert(domain.name.clone(), domain);
        }
        Ok(Config { domains })
    }

    pub fn domain(&self, name: &str) -> Option<&DomainConfig> {
        self.domains.get(name)
    }

    /// Whether no domain is defined.
    pub fn is_empty(&self) -> bool {
        self.domains.is_empty()
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

#[cfg(test)]
mod xds_tests;
