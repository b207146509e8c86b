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
mod flow_depth;
mod merge;
pub mod runtime;
mod value_metric;
pub mod watch;
pub mod xds;
pub mod xds_client;
pub mod xds_decode;
mod yaml_last_wins;
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

/// Where the limits files are, and which files of it are limits files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitsDir {
    /// `*.yaml` / `*.yml` directly in the directory, hidden entries
    /// skipped: ratekeeper's `--config-dir`.
    Flat(PathBuf),
    /// envoyproxy/ratelimit's runtime layout (`RUNTIME_*`).
    Runtime(runtime::Runtime),
}

impl LimitsDir {
    /// The limits files, sorted by path.
    pub fn files(&self) -> Result<Vec<PathBuf>, ConfigError> {
        match self {
            LimitsDir::Flat(dir) => limits_files(dir),
            LimitsDir::Runtime(runtime) => runtime.files(),
        }
    }

    /// Whether the directory is missing where it may yet appear, as
    /// [`runtime::Runtime::not_there_yet`] says (a `--config-dir` must be
    /// there at start).
    pub fn not_there_yet(&self) -> bool {
        match self {
            LimitsDir::Flat(_) => false,
            LimitsDir::Runtime(runtime) => runtime.not_there_yet(),
        }
    }
}

impl std::fmt::Display for LimitsDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LimitsDir::Flat(dir) => dir.display().fmt(f),
            LimitsDir::Runtime(runtime) => runtime.base().display().fmt(f),
        }
    }
}

/// How a directory's files make domains.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// envoyproxy/ratelimit's `MERGE_DOMAIN_CONFIG`: files of one domain
    /// merge (else a second file of a domain is refused).
    pub merge_domains: bool,
}

/// Every domain of one successfully loaded limits directory.
#[derive(Debug, Default)]
pub struct Config {
    domains: HashMap<String, DomainConfig>,
    /// Where each domain came from: its file, or its xDS resource's name.
    sources: HashMap<String, PathBuf>,
    /// The xDS snapshot's version, for limits that came over xDS.
    version: Option<String>,
}

impl Config {
    /// Loads every `*.yaml` / `*.yml` file directly in `dir` (following
    /// symlinks, skipping hidden entries such as a ConfigMap's `..data`).
    pub fn load_dir(dir: &Path) -> Result<Config, ConfigError> {
        Config::load(&LimitsDir::Flat(dir.to_owned()), LoadOptions::default())
    }

    /// Loads every limits file of `dir`, read with `options`.
    pub fn load(dir: &LimitsDir, options: LoadOptions) -> Result<Config, ConfigError> {
        Config::check(dir, options).map_err(|errors| first(errors, Path::new(&dir.to_string())))
    }

    /// Loads as [`Config::load_dir`] does, but reads on past a bad file:
    /// every file's (first) error and every duplicate domain, in file order.
    /// What `ratekeeper validate` reports.
    pub fn check_dir(dir: &Path) -> Result<Config, Vec<ConfigError>> {
        Config::check(&LimitsDir::Flat(dir.to_owned()), LoadOptions::default())
    }

    /// As [`Config::check_dir`], for either layout, read with `options`.
    pub fn check(dir: &LimitsDir, options: LoadOptions) -> Result<Config, Vec<ConfigError>> {
        let files = dir.files().map_err(|error| vec![error])?;
        let parsed = files.into_iter().map(|path| {
            let bytes = std::fs::read(&path)
                .map_err(|e| ConfigError::new(&path, format!("cannot read: {e}")))?;
            let text = utf8(&path, bytes)?;
            let domains = file::parse(&path, &text)?;
            Ok((path, domains))
        });
        Config::collect(parsed, options)
    }

    /// Builds a config from `(file name, YAML text)` pairs.
    pub fn from_files<'a>(
        files: impl IntoIterator<Item = (&'a Path, &'a str)>,
    ) -> Result<Config, ConfigError> {
        Config::from_files_with(files, LoadOptions::default())
    }

    /// [`Config::from_files`] with `options`.
    pub fn from_files_with<'a>(
        files: impl IntoIterator<Item = (&'a Path, &'a str)>,
        options: LoadOptions,
    ) -> Result<Config, ConfigError> {
        let parsed = files
            .into_iter()
            .map(|(path, text)| Ok((path.to_owned(), file::parse(path, text)?)));
        Config::collect(parsed, options).map_err(|errors| first(errors, Path::new("")))
    }

    /// Builds a config from compiled domains, each with where it came from
    /// (a file, or a name for an xDS resource); a domain may appear once.
    pub fn from_domains(
        compiled: impl IntoIterator<Item = (PathBuf, DomainConfig)>,
    ) -> Result<Config, ConfigError> {
        Config::from_domains_with(compiled, LoadOptions::default())
    }

    /// [`Config::from_domains`] with `options`.
    pub fn from_domains_with(
        compiled: impl IntoIterator<Item = (PathBuf, DomainConfig)>,
        options: LoadOptions,
    ) -> Result<Config, ConfigError> {
        Config::assemble(compiled, options).map_err(|errors| first(errors, Path::new("")))
    }

    /// Every file's domains, or every file's error (and duplicates among
    /// the files that parsed).
    fn collect(
        files: impl IntoIterator<Item = Result<(PathBuf, Vec<DomainConfig>), ConfigError>>,
        options: LoadOptions,
    ) -> Result<Config, Vec<ConfigError>> {
        let mut errors = Vec::new();
        let mut domains = Vec::new();
        for parsed in files {
            match parsed {
                Ok((path, parsed)) => domains.extend(parsed.into_iter().map(|d| (path.clone(), d))),
                Err(error) => errors.push(error),
            }
        }
        match Config::assemble(domains, options) {
            Ok(config) if errors.is_empty() => Ok(config),
            Ok(_) => Err(errors),
            Err(duplicates) => {
                errors.extend(duplicates);
                Err(errors)
            }
        }
    }

    /// One map of the domains, refusing every second definition of a name
    /// (unless `options.merge_domains`: then merged, both files named when
    /// they clash).
    fn assemble(
        compiled: impl IntoIterator<Item = (PathBuf, DomainConfig)>,
        options: LoadOptions,
    ) -> Result<Config, Vec<ConfigError>> {
        let mut domains: HashMap<String, DomainConfig> = HashMap::new();
        let mut origin: HashMap<String, PathBuf> = HashMap::new();
        let mut errors = Vec::new();
        for (source, domain) in compiled {
            if let (true, Some(first), Some(into)) = (
                options.merge_domains,
                origin.get(&domain.name),
                domains.get_mut(&domain.name),
            ) {
                let name = domain.name.clone();
                if let Err(clash) = merge::merge_domain(into, domain) {
                    errors.push(ConfigError::new(
                        &source,
                        format!("domain {name:?} merged with {}: {clash}", first.display()),
                    ));
                }
                continue;
            }
            if let Some(first) = origin.get(&domain.name) {
                errors.push(ConfigError::new(
                    &source,
                    format!(
                        "duplicate domain {:?} (already defined in {})",
                        domain.name,
                        first.display()
                    ),
                ));
                continue;
            }
            origin.insert(domain.name.clone(), source);
            domains.insert(domain.name.clone(), domain);
        }
        if errors.is_empty() {
            Ok(Config {
                domains,
                sources: origin,
                version: None,
            })
        } else {
            Err(errors)
        }
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

    /// Where a domain came from: its limits file, or its xDS resource.
    pub fn source(&self, domain: &str) -> Option<&Path> {
        self.sources.get(domain).map(PathBuf::as_path)
    }

    /// The xDS snapshot version these limits came in (none from files).
    pub fn version(&self) -> Option<&str> {
        self.version.as_deref()
    }

    /// The same limits, marked as from xDS snapshot `version`.
    pub fn with_version(self, version: String) -> Config {
        Config {
            version: Some(version),
            ..self
        }
    }
}

/// The first of a load's errors: where loading stops for the server.
fn first(errors: Vec<ConfigError>, source: &Path) -> ConfigError {
    // A failed load has at least one error; the fallback only keeps this
    // total.
    errors
        .into_iter()
        .next()
        .unwrap_or_else(|| ConfigError::new(source, "the limits could not be loaded"))
}

/// A limits file's text; not UTF-8 text (as YAML must be), an error at
/// the line of the first byte that is not.
fn utf8(path: &Path, bytes: Vec<u8>) -> Result<String, ConfigError> {
    String::from_utf8(bytes).map_err(|e| {
        let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        let line = valid.iter().filter(|&&b| b == b'\n').count() + 1;
        let column = valid.len() - valid.iter().rposition(|&b| b == b'\n').map_or(0, |n| n + 1) + 1;
        ConfigError {
            file: path.to_owned(),
            line: Some(line),
            reason: format!("the text is not UTF-8 from column {column}"),
        }
    })
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
        if name.starts_with('.') || !is_yaml {
            continue;
        }
        // `metadata` follows symlinks: a ConfigMap's files are links into
        // `..data`. A limits file's name on what cannot be read as one (a
        // dangling or looping link, a directory) is an error, not skipped:
        // on a reload its domain would vanish unseen.
        match std::fs::metadata(&path) {
            Ok(m) if m.is_file() => files.push(path),
            Ok(_) => {
                return Err(ConfigError::new(
                    &path,
                    "not a file: a limits file's name on something else",
                ))
            }
            Err(e) => {
                return Err(ConfigError::new(
                    &path,
                    format!("cannot read the limits file: {e}"),
                ))
            }
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod xds_tests;
