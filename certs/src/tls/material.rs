//! Certificate material on disk: `--tls-dir DIR` holds `ca.pem`,
//! `{role}.pem` and `{role}.key` (as `tokenmesh-certs` writes them) or
//! `ca.crt`, `tls.crt` and `tls.key` (as cert-manager writes a Secret, and a
//! Kubernetes Secret volume shows it), and the checks every load makes, at
//! start-up and on each reload.
use crate::tls::identity::{Identity, IdentityError, Role};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use rustls::RootCertStore;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why certificate material could not be used. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Pem { path: PathBuf, reason: String },
    #[error("{key} is not the private key of the certificate in {cert}")]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    #[error("{path}: {source}")]
    Identity {
        path: PathBuf,
        source: IdentityError,
    },
    #[error("{path} is a certificate for role {found}; this process needs role {expected}")]
    WrongRole {
        path: PathBuf,
        found: Role,
        expected: Role,
    },
    #[error("{path}: certificate is not valid now (valid {not_before} to {not_after})")]
    OutsideValidity {
        path: PathBuf,
        not_before: String,
        not_after: String,
    },
    #[error("{path} names {now}, but this process runs as {was}; a new identity needs a restart")]
    IdentityChanged {
        path: PathBuf,
        was: Identity,
        now: Identity,
    },
    #[error("{dir} holds neither {role}.pem and {role}.key (as tokenmesh-certs writes them) nor tls.crt and tls.key (as cert-manager writes them)")]
    NoCertificate { dir: PathBuf, role: Role },
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("TLS client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// The three files of one process's identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsPaths {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsPaths {
    /// `dir/ca.pem`, `dir/{role}.pem`, `dir/{role}.key`.
    pub fn in_dir(dir: &Path, role: Role) -> Self {
        Self {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{role}.pem")),
            key: dir.join(format!("{role}.key")),
        }
    }

    /// `dir/ca.crt`, `dir/tls.crt`, `dir/tls.key`: the keys of a
    /// `kubernetes.io/tls` Secret that cert-manager issues.
    pub fn cert_manager(dir: &Path) -> Self {
        Self {
            ca: dir.join("ca.crt"),
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
        }
    }

    /// The files of `role` in `dir` under either naming scheme: tokenmesh's
    /// (`{role}.pem`) where that certificate is present, which also wins
    /// when both are, else cert-manager's (`tls.crt`). A directory with
    /// neither is refused, naming both.
    pub fn find(dir: &Path, role: Role) -> Result<Self, TlsError> {
        let own = Self::in_dir(dir, role);
        if own.cert.exists() {
            return Ok(own);
        }
        let cm = Self::cert_manager(dir);
        if cm.cert.exists() {
            return Ok(cm);
        }
        Err(TlsError::NoCertificate {
            dir: dir.into(),
            role,
        })
    }
}

/// The crypto provider of every tokenmesh TLS config: ring, the one tonic's
/// `tls-ring` feature brings, named explicitly so that no process-wide
/// default has to be installed.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.into(),
        source,
    })
}

/// Every certificate in a PEM file; at least one.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            path: path.into(),
            reason: format!("not a PEM certificate file: {e}"),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: path.into(),
            reason: "no certificate in the file".into(),
        });
    }
    Ok(certs)
}

/// The trust anchors in `ca.pem`.
pub fn load_roots(path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(path)? {
        roots.add(cert).map_err(|e| TlsError::Pem {
            path: path.into(),
            reason: format!("not a usable CA certificate: {e}"),
        })?;
    }
    Ok(Arc::new(roots))
}

/// Checks that a DER certificate is valid at this moment.
fn check_validity(path: &Path, der: &[u8]) -> Result<(), TlsError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| TlsError::Pem {
        path: path.into(),
        reason: format!("not valid X.509: {e}"),
    })?;
    let v = cert.validity();
    if !v.is_valid() {
        return Err(TlsError::OutsideValidity {
            path: path.into(),
            not_before: v.not_before.to_string(),
            not_after: v.not_after.to_string(),
        });
    }
    Ok(())
}

/// Loads and checks a certificate and its key: the key parses and belongs
/// to the certificate, the certificate is valid now and names an identity
/// of `role`. The same checks guard start-up and every reload, so a bad file
/// is never put in service.
pub fn load_certified_key(
    paths: &TlsPaths,
    role: Role,
) -> Result<(Arc<CertifiedKey>, Identity), TlsError> {
    let chain = load_certs(&paths.cert)?;
    let key_bytes = read(&paths.key)?;
    let key = PrivateKeyDer::from_pem_slice(&key_bytes).map_err(|e| TlsError::Pem {
        path: paths.key.clone(),
        reason: format!("not a PEM private key: {e}"),
    })?;
    let signing_key = provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| TlsError::Pem {
            path: paths.key.clone(),
            reason: format!("unusable private key: {e}"),
        })?;
    let certified = CertifiedKey::new(chain, signing_key);
    // `InconsistentKeys::Unknown` (a key type that cannot report its public
    // key) passes here; the handshake itself would then fail loudly.
    if let Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) =
        certified.keys_match()
    {
        return Err(TlsError::KeyMismatch {
            cert: paths.cert.clone(),
            key: paths.key.clone(),
        });
    }
    let leaf = certified.end_entity_cert()?;
    check_validity(&paths.cert, leaf)?;
    let identity = Identity::from_cert_der(leaf).map_err(|source| TlsError::Identity {
        path: paths.cert.clone(),
        source,
    })?;
    if identity.role != role {
        return Err(TlsError::WrongRole {
            path: paths.cert.clone(),
            found: identity.role,
            expected: role,
        });
    }
    Ok((Arc::new(certified), identity))
}
