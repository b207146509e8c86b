//! gRPC TLS and mutual TLS, with certificate rotation: the server
//! certificate, key and (optional) client CA are read from files, and read
//! again when any of them changes, without a restart. Each new connection
//! uses the configuration current at its handshake; a bad new file is logged
//! and the previous configuration stays. Also the client side of mutual TLS
//! (the xDS client's), from the same kind of files.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig,
    SignatureScheme,
};

use crate::log_pace::Paced;
use crate::{Error, Result};

/// Where the server's TLS material lives.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// When set, client certificates are checked against this CA.
    pub client_ca: Option<PathBuf>,
    /// With `client_ca`: clients must present a certificate (mutual TLS);
    /// otherwise one is asked for, and checked only when presented.
    pub client_cert_required: bool,
    /// With `client_ca`: a DNS name (or IP) the client certificate must be
    /// valid for (envoyproxy/ratelimit's `GRPC_CLIENT_TLS_SAN`).
    pub client_san: Option<String>,
}

impl TlsFiles {
    fn paths(&self) -> Vec<&PathBuf> {
        [&self.cert, &self.key]
            .into_iter()
            .chain(&self.client_ca)
            .collect()
    }

    /// What the files hold now ([`crate::fingerprint`]).
    fn fingerprint(&self) -> u64 {
        crate::fingerprint::of_files(self.paths(), |p| std::fs::read(p))
    }

    /// Whether the certificate file's first certificate is not valid yet
    /// (its `notBefore` is ahead of this clock).
    fn not_valid_yet(&self) -> bool {
        let Ok(certs) = read_certs(&self.cert) else {
            return false;
        };
        crate::cert_validity::of_certificate(certs[0].as_ref())
            .is_some_and(|validity| validity.not_before > unix_now())
    }

    /// Builds a rustls server configuration from the files. A certificate
    /// not valid now ([`crate::cert_validity`]) is an error with `dates`
    /// [`Dates::Refuse`] (a reload: the one in force stays), a warning with
    /// [`Dates::Warn`] (the start, which serves it, as theirs does).
    pub fn load(&self, dates: Dates) -> Result<ServerConfig> {
        let certs = read_certs(&self.cert)?;
        let validity = crate::cert_validity::of_certificate(certs[0].as_ref());
        if let Some(why) = validity.and_then(|v| v.not_valid_at(unix_now())) {
            let why = format!("the certificate is {why}: clients will refuse it");
            match dates {
                Dates::Refuse => return Err(bad(&self.cert, &why)),
                Dates::Warn => tracing::warn!(cert = %self.cert.display(), "TLS: {why}"),
            }
        }
        let key = read_key(&self.key)?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Startup(format!("TLS: {e}")))?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let roots = Arc::new(read_roots(ca)?);
                let mut verifier = WebPkiClientVerifier::builder_with_provider(roots, provider);
                if !self.client_cert_required {
                    verifier = verifier.allow_unauthenticated();
                }
                let verifier = verifier.build().map_err(|e| bad(ca, &e))?;
                match &self.client_san {
                    None => builder.with_client_cert_verifier(verifier),
                    Some(san) => {
                        let san = ServerName::try_from(san.clone())
                            .map_err(|e| Error::Startup(format!("TLS: client SAN {san:?}: {e}")))?;
                        builder.with_client_cert_verifier(Arc::new(SanVerifier {
                            inner: verifier,
                            san,
                        }))
                    }
                }
            }
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|e| bad(&self.cert, &e))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// Seconds since the Unix epoch, now, as certificates' dates are read.
fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// What [`TlsFiles::load`] makes of a certificate outside its dates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dates {
    Warn,
    Refuse,
}

/// A TLS client configuration: trusting the system's roots and `ca` (as
/// envoyproxy/ratelimit adds its CA file to the system pool), presenting
/// `identity` (certificate chain, key) when set. RSA keys may be PKCS#1
/// (`RSA PRIVATE KEY`, as Envoy Gateway writes them), PKCS#8 or SEC1 EC
/// keys. Speaks HTTP/2 (ALPN `h2`: gRPC servers refuse TLS clients that do
/// not offer it).
pub fn client_config(ca: Option<&Path>, identity: Option<(&Path, &Path)>) -> Result<ClientConfig> {
    let mut roots = match ca {
        Some(ca) => read_roots(ca)?,
        None => RootCertStore::empty(),
    };
    // Unreadable system roots only narrow what is trusted: not an error.
    roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Startup(format!("TLS: {e}")))?
        .with_root_certificates(roots);
    let mut config = match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(read_certs(cert)?, read_key(key)?)
            .map_err(|e| bad(cert, &e))?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// Checks a TLS client's PEM files (a CA, a certificate and its key) as
/// [`client_config`] reads them, naming the file that is wrong: for a
/// client that takes the files' bytes and would only fail when it
/// connects (the Redis client).
/// A certificate and a key that do not match are refused here too.
pub fn check_client_files(ca: Option<&Path>, identity: Option<(&Path, &Path)>) -> Result<()> {
    client_config(ca, identity).map(drop)
}

/// The system's roots and then `ca` (PEM), as PEM: what a client given a
/// CA file trusts, as [`client_config`] and envoyproxy/ratelimit (which
/// adds its CA file to the system pool), for a client that takes its roots
/// only as PEM and trusts nothing else when given some (the Redis client).
pub fn pem_with_system_roots(ca: &[u8]) -> Vec<u8> {
    use base64::Engine;
    let native = rustls_native_certs::load_native_certs();
    if !native.errors.is_empty() {
        tracing::warn!(errors = ?native.errors, "some system root certificates could not be read");
    }
    let mut pem = Vec::new();
    // Only those a root store takes: the Redis client refuses all its
    // roots if one is not a trust anchor, where the system's unusable
    // ones only narrow what is trusted (as `client_config` reads them).
    let anchors = native
        .certs
        .into_iter()
        .filter(|cert| RootCertStore::empty().add(cert.clone()).is_ok());
    for cert in anchors {
        let body = base64::engine::general_purpose::STANDARD.encode(cert.as_ref());
        pem.extend_from_slice(b"-----BEGIN CERTIFICATE-----\n");
        for line in body.as_bytes().chunks(64) {
            pem.extend_from_slice(line);
            pem.push(b'\n');
        }
        pem.extend_from_slice(b"-----END CERTIFICATE-----\n");
    }
    pem.extend_from_slice(ca);
    pem
}

fn bad(what: &Path, e: &dyn std::fmt::Display) -> Error {
    Error::Startup(format!("TLS: {}: {e}", what.display()))
}

/// A PEM error as text: the markers it names as text, not byte lists.
fn pem_error(error: &rustls::pki_types::pem::Error) -> String {
    use rustls::pki_types::pem::Error as Pem;
    match error {
        Pem::MissingSectionEnd { end_marker } => format!(
            "no \"-----END {}-----\" line: the file ends early",
            String::from_utf8_lossy(end_marker)
        ),
        Pem::IllegalSectionStart { line } => {
            format!(
                "not a PEM section start: {:?}",
                String::from_utf8_lossy(line)
            )
        }
        other => other.to_string(),
    }
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| bad(path, &pem_error(&e)))?;
    if certs.is_empty() {
        return Err(bad(path, &"no PEM certificate"));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    // Never print the key or its parse error's contents: only the path,
    // and why it could not be read (no such file, its permissions).
    PrivateKeyDer::from_pem_file(path).map_err(|e| match e {
        rustls::pki_types::pem::Error::Io(io) => bad(path, &io),
        _ => bad(path, &"not a PEM private key"),
    })
}

fn read_roots(path: &Path) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(path)? {
        roots.add(cert).map_err(|e| bad(path, &e))?;
    }
    Ok(roots)
}

/// Logs a failed TLS handshake. A client certificate refused (none,
/// untrusted, expired, for another name) at WARN, paced, as
/// envoyproxy/ratelimit logs "error validating client": a misconfigured
/// client is found from the logs. Anything else (a port scan, a plaintext
/// client, a load balancer's TCP check) at DEBUG.
pub fn handshake_failed(error: &std::io::Error, peer: Option<std::net::SocketAddr>) {
    let peer = peer.map(|p| p.to_string()).unwrap_or_default();
    let certificate_refused = error
        .get_ref()
        .and_then(|e| e.downcast_ref::<rustls::Error>())
        .is_some_and(|e| {
            matches!(
                e,
                rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented
            )
        });
    if !certificate_refused {
        tracing::debug!(%error, peer, "TLS handshake failed");
        return;
    }
    static LOG: Paced = Paced::new();
    if let Some(left_out) = LOG.admit() {
        tracing::warn!(%error, peer, left_out, "TLS handshake failed: the client's certificate was refused");
    }
}

/// Client certificates checked by the CA, then for one name
/// (envoyproxy/ratelimit's `GRPC_CLIENT_TLS_SAN`: a DNS or IP SAN).
#[derive(Debug)]
struct SanVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    san: ServerName<'static>,
}

impl ClientCertVerifier for SanVerifier {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        rustls::client::verify_server_name(&ParsedCertificate::try_from(end_entity)?, &self.san)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
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
        // Taken before the load: a rotation while loading is seen.
        let mut seen = files.fingerprint();
        let tls = ReloadingTls {
            current: Arc::new(RwLock::new(Arc::new(files.load(Dates::Warn)?))),
        };
        let watched = tls.clone();
        tokio::spawn(async move {
            // The files last refused for a certificate not valid yet.
            let mut refused = None;
            loop {
                tokio::time::sleep(interval).await;
                let now = files.fingerprint();
                if now == seen {
                    continue;
                }
                let loaded = files.load(Dates::Refuse);
                // A certificate not valid yet becomes valid: looked at
                // again at every tick (said once) until it loads.
                let early = loaded.is_err() && files.not_valid_yet();
                let said = early && refused == Some(now);
                if !early {
                    seen = now;
                }
                match loaded {
                    Ok(config) => {
                        *watched.current.write().unwrap_or_else(|p| p.into_inner()) =
                            Arc::new(config);
                        tracing::info!(cert = %files.cert.display(), key = %files.key.display(), "TLS certificate reloaded");
                        metrics::counter!("ratekeeper_tls_reload_success").increment(1);
                    }
                    Err(_) if said => {}
                    Err(error) => {
                        refused = Some(now);
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

#[cfg(test)]
mod tests {
    use super::read_certs;

    #[test]
    fn a_cut_certificate_is_named_in_words() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("tls.crt");
        std::fs::write(&path, "-----BEGIN CERTIFICATE-----\nMIIB\n").expect("file");
        let error = read_certs(&path).expect_err("cut short").to_string();
        assert!(
            error.contains("tls.crt: no \"-----END CERTIFICATE-----\" line"),
            "{error}"
        );
    }
}
