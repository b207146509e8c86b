//! The crate's one error type and `Result` alias.

use std::path::PathBuf;

/// Everything that can go wrong inside ratekeeper.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A limits file (or the limits directory) could not be loaded.
    #[error("{0}")]
    Config(#[from] ConfigError),
    /// The counter store failed or did not answer in time.
    #[error("store: {0}")]
    Store(String),
    /// The store was not called: its circuit is open, it is not connected
    /// yet, or the call's deadline passed while it queued. Nothing was sent,
    /// so nothing was counted.
    #[error("store: {0}")]
    StoreNotCalled(String),
    /// A setting the server cannot start with.
    #[error("{0}")]
    Startup(String),
    /// Binding a socket or another I/O failure outside the store.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

/// A limits-file problem, always naming the file, and the line where known.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{}: {reason}", file.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
pub struct ConfigError {
    pub file: PathBuf,
    pub line: Option<usize>,
    pub reason: String,
}

impl ConfigError {
    pub fn new(file: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        ConfigError {
            file: file.into(),
            line: None,
            reason: reason.into(),
        }
    }
}

impl From<redis::RedisError> for Error {
    fn from(e: redis::RedisError) -> Self {
        Error::Store(e.to_string())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
