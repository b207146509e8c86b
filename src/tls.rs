//! gRPC TLS and mutual TLS, with certificate rotation: the server
//! certificate, key and (optional) client CA are read from files, and read
//! again when any of them changes, without a restart. Each new connection
//! uses the configuration current at its handshake; a bad new file is logged
//! and the previous configuration stays.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

use crate::{Error, Result};

/// Where the server's TLS material lives.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// When set, clients must present a certificate signed by this CA.
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    fn paths(&self) -> Vec<&PathBuf> {
        [&self.cert, &self.key]
            .into_iter()
            .chain(&self.client_ca)
            .collect()
    }

    fn modified(&self) -> Vec<Option<SystemTime>> {
        self.paths()
            .into_iter()
            .map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
            .collect()
    }

    /// Builds a rustls server configuration from the files.
    pub fn load(&self) -> Result<ServerConfig> {
        let bad = |what: &PathBuf, e: &dyn std::fmt::Display| {
            Error::Startup(format!("TLS: {}: {e}", what.display()))
        };
        let certs = CertificateDer::pem_file_iter(&self.cert)
            .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
            .map_err(|e| bad(&self.cert, &e))?;
        // Never print the key or its parse error's contents: only the path.
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .map_err(|_| bad(&self.key, &"not a PEM private key"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Startup(format!("TLS: {e}")))?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for cert in CertificateDer::pem_file_iter(ca).map_err(|e| bad(ca, &e))? {
                    roots
                        .add(cert.map_err(|e| bad(ca, &e))?)
                        .map_err(|e| bad(ca, &e))?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|e| bad(ca, &e))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|e| bad(&self.cert, &e))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// The TLS configuration in force, reloaded when its files change.
#[derive(Clone)]
pub struct ReloadingTls {
    current: Arc<RwLock<Arc<ServerConfig>>>,
}

impl std::fmt::Debug for ReloadingTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReloadingTls")
    }
}

impl ReloadingTls {
    /// Loads the files (failing start-up if they are bad) and watches them
    /// every `interval`.
    pub fn start(files: TlsFiles, interval: Duration) -> Result<Self> {
        let tls = ReloadingTls {
            current: Arc::new(RwLock::new(Arc::new(files.load()?))),
        };
        let watched = tls.clone();
        tokio::spawn(async move {
            let mut seen = files.modified();
            loop {
                tokio::time::sleep(interval).await;
                let now = files.modified();
                if now == seen {
                    continue;
                }
                seen = now;
                match files.load() {
                    Ok(config) => {
                        *watched.current.write().unwrap_or_else(|p| p.into_inner()) =
                            Arc::new(config);
                        tracing::info!("TLS certificate reloaded");
                        metrics::counter!("ratekeeper_tls_reload_success").increment(1);
                    }
                    Err(error) => {
                        tracing::error!(%error, "TLS reload failed; keeping the current certificate");
                        metrics::counter!("ratekeeper_tls_reload_error").increment(1);
                    }
                }
            }
        });
        Ok(tls)
    }

    /// The configuration for the next handshake.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        let config = self
            .current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        tokio_rustls::TlsAcceptor::from(config)
    }
}
