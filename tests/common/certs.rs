//! Throwaway certificates for TLS tests, made with the openssl CLI as Envoy
//! Gateway's certgen makes them: RSA keys in PKCS#1 PEM (`RSA PRIVATE
//! KEY`), key usage but no extended key usage, SANs only.

use std::path::PathBuf;
use std::process::Command;

/// A CA (`ca.crt`, `ca.key`) and certificates signed by it, in a temporary
/// directory.
pub struct Certs {
    dir: tempfile::TempDir,
}

impl Certs {
    /// A new CA named `cn`.
    pub fn ca(cn: &str) -> Certs {
        let dir = tempfile::tempdir().expect("tempdir");
        let certs = Certs { dir };
        std::fs::write(
            certs.path("openssl.cnf"),
            "[req]\ndistinguished_name = dn\n[dn]\n[ca]\nbasicConstraints = critical,CA:TRUE\n\
             keyUsage = critical,keyCertSign,digitalSignature,keyEncipherment\n",
        )
        .expect("openssl.cnf");
        certs.openssl(&["genrsa", "-traditional", "-out", "ca.key", "2048"]);
        certs.openssl(&[
            "req",
            "-x509",
            "-new",
            "-key",
            "ca.key",
            "-subj",
            &format!("/CN={cn}"),
            "-days",
            "1",
            "-config",
            "openssl.cnf",
            "-extensions",
            "ca",
            "-out",
            "ca.crt",
        ]);
        certs
    }

    /// `name.crt` and `name.key` for `cn`, valid for `san` (e.g.
    /// `DNS:localhost,IP:127.0.0.1`), signed by the CA.
    pub fn leaf(&self, name: &str, cn: &str, san: &str) {
        let ext = format!(
            "keyUsage = digitalSignature,nonRepudiation,keyEncipherment,dataEncipherment\n\
             subjectAltName = {san}\n"
        );
        std::fs::write(self.path(&format!("{name}.ext")), ext).expect("ext");
        let (key, csr, crt, ext) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
            format!("{name}.ext"),
        );
        self.openssl(&["genrsa", "-traditional", "-out", &key, "2048"]);
        self.openssl(&[
            "req",
            "-new",
            "-key",
            &key,
            "-subj",
            &format!("/CN={cn}"),
            "-config",
            "openssl.cnf",
            "-out",
            &csr,
        ]);
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            &ext,
            "-out",
            &crt,
        ]);
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .expect("openssl must be installed");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}
