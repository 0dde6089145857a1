//! `tokenmesh-certs`: a mesh CA and leaf certificates for every role
//! (DESIGN.md, "Identities"). A leaf carries one SAN URI
//! `spiffe://tokenmesh/{role}/{name}` plus DNS and IP SANs, and is usable for
//! both server and client authentication (routers and workers are both).
//!
//! Layout, as `--tls-dir DIR` expects it: `ca.pem`, `{role}.pem`,
//! `{role}.key`; the CA key `ca.key` lives in the CA directory (by default the
//! same). Keys are written with mode 0600, atomically (write then rename), so
//! a process that hot-reloads never reads half a file.
#![forbid(unsafe_code)]

pub mod tls;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use time::{Duration, OffsetDateTime};
pub use tls::{Identity, Role};
use x509_parser::extensions::GeneralName;

/// Why certificates could not be issued, read or written.
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error(transparent)]
    Identity(#[from] crate::tls::IdentityError),
    #[error("invalid validity: not_after {not_after} is not after not_before {not_before}")]
    Validity {
        not_before: OffsetDateTime,
        not_after: OffsetDateTime,
    },
}

/// Default leaf lifetime.
pub const DEFAULT_LEAF_DAYS: i64 = 90;
/// Default CA lifetime.
pub const DEFAULT_CA_DAYS: i64 = 3650;

/// A loaded or new CA that can sign leaves.
pub struct Ca {
    pub cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

fn read_string(path: &Path) -> Result<String, CertsError> {
    std::fs::read_to_string(path).map_err(|source| CertsError::Read {
        path: path.into(),
        source,
    })
}

/// Writes `contents` to `path` through a temporary file in the same
/// directory and a rename; `private` files get mode 0600 from creation on.
pub fn write_atomic(path: &Path, contents: &str, private: bool) -> Result<(), CertsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let err = |source| CertsError::Write {
        path: path.into(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(err)?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("cert"),
        std::process::id()
    ));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(&tmp)
        .map_err(err)?;
    f.write_all(contents.as_bytes()).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

impl Ca {
    /// Loads `dir/ca.pem` and `dir/ca.key`, or creates them if neither exists.
    pub fn load_or_create(dir: &Path) -> Result<Self, CertsError> {
        let (cert, key) = (dir.join("ca.pem"), dir.join("ca.key"));
        if cert.exists() || key.exists() {
            return Self::load(dir);
        }
        let ca = Self::generate(DEFAULT_CA_DAYS)?;
        write_atomic(&key, &ca.issuer.key().serialize_pem(), true)?;
        write_atomic(&cert, &ca.cert_pem, false)?;
        Ok(ca)
    }

    /// Loads `dir/ca.pem` and `dir/ca.key`.
    pub fn load(dir: &Path) -> Result<Self, CertsError> {
        let (cert, key) = (dir.join("ca.pem"), dir.join("ca.key"));
        let cert_pem = read_string(&cert)?;
        let key_pair = KeyPair::from_pem(&read_string(&key)?).map_err(|e| CertsError::Parse {
            path: key.clone(),
            reason: format!("not a CA private key: {e}"),
        })?;
        let issuer =
            Issuer::from_ca_cert_pem(&cert_pem, key_pair).map_err(|e| CertsError::Parse {
                path: cert.clone(),
                reason: format!("not a CA certificate: {e}"),
            })?;
        Ok(Self { cert_pem, issuer })
    }

    /// A new self-signed CA, in memory.
    pub fn generate(days: i64) -> Result<Self, CertsError> {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "tokenmesh CA");
        params
            .distinguished_name
            .push(DnType::OrganizationName, "tokenmesh");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::minutes(5);
        params.not_after = now + Duration::days(days);
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        Ok(Self {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// Signs a leaf.
    pub fn issue(&self, spec: &LeafSpec) -> Result<Issued, CertsError> {
        if spec.not_after <= spec.not_before {
            return Err(CertsError::Validity {
                not_before: spec.not_before,
                not_after: spec.not_after,
            });
        }
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, spec.identity.to_string());
        params
            .distinguished_name
            .push(DnType::OrganizationName, "tokenmesh");
        params
            .subject_alt_names
            .push(SanType::URI(spec.identity.uri().try_into()?));
        for dns in &spec.dns {
            params
                .subject_alt_names
                .push(SanType::DnsName(dns.clone().try_into()?));
        }
        for ip in &spec.ips {
            params.subject_alt_names.push(SanType::IpAddress(*ip));
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        params.not_before = spec.not_before;
        params.not_after = spec.not_after;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// What a leaf certificate says.
#[derive(Clone, Debug)]
pub struct LeafSpec {
    pub identity: Identity,
    pub dns: Vec<String>,
    pub ips: Vec<IpAddr>,
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
}

impl LeafSpec {
    /// A leaf valid from now for `days`, with the default SANs `localhost`
    /// and `127.0.0.1`.
    pub fn new(identity: Identity, days: i64) -> Self {
        let now = OffsetDateTime::now_utc();
        Self {
            identity,
            dns: vec!["localhost".into()],
            ips: vec![IpAddr::from([127, 0, 0, 1])],
            // A little back-dating tolerates clock skew between machines.
            not_before: now - Duration::minutes(5),
            not_after: now + Duration::days(days),
        }
    }
}

/// A signed leaf and its key, in PEM.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

/// Writes `{stem}.pem`, `{stem}.key` (0600) and the CA certificate `ca.pem`
/// into `dir`. The key goes first: a reloading process that sees the new
/// certificate before the new key refuses the pair and takes it on the
/// next change, never a half-written file.
pub fn write_leaf(dir: &Path, stem: &str, issued: &Issued, ca: &Ca) -> Result<(), CertsError> {
    write_atomic(&dir.join(format!("{stem}.key")), &issued.key_pem, true)?;
    write_atomic(&dir.join(format!("{stem}.pem")), &issued.cert_pem, false)?;
    let ca_path = dir.join("ca.pem");
    if std::fs::read_to_string(&ca_path).ok().as_deref() != Some(ca.cert_pem.as_str()) {
        write_atomic(&ca_path, &ca.cert_pem, false)?;
    }
    Ok(())
}

/// What `list` shows about one certificate.
#[derive(Clone, Debug)]
pub struct CertInfo {
    pub path: PathBuf,
    pub subject: String,
    pub sans: Vec<String>,
    pub identity: Option<Identity>,
    pub is_ca: bool,
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
}

impl CertInfo {
    /// True once the certificate has expired.
    pub fn expired(&self) -> bool {
        OffsetDateTime::now_utc() > self.not_after
    }
}

/// Reads the first certificate of a PEM file.
pub fn describe(path: &Path) -> Result<CertInfo, CertsError> {
    let text = read_string(path)?;
    let parse = |reason: String| CertsError::Parse {
        path: path.into(),
        reason,
    };
    let (_, pem) = x509_parser::pem::parse_x509_pem(text.as_bytes())
        .map_err(|e| parse(format!("not a PEM certificate: {e}")))?;
    let cert = pem
        .parse_x509()
        .map_err(|e| parse(format!("not valid X.509: {e}")))?;
    let sans = cert
        .subject_alternative_name()
        .map_err(|e| parse(e.to_string()))?
        .map(|ext| {
            ext.value
                .general_names
                .iter()
                .map(|n| match n {
                    GeneralName::URI(u) => format!("URI:{u}"),
                    GeneralName::DNSName(d) => format!("DNS:{d}"),
                    GeneralName::IPAddress(b) => match b.len() {
                        4 => format!("IP:{}", IpAddr::from(<[u8; 4]>::try_from(*b).unwrap())),
                        16 => format!("IP:{}", IpAddr::from(<[u8; 16]>::try_from(*b).unwrap())),
                        _ => "IP:?".into(),
                    },
                    other => format!("{other:?}"),
                })
                .collect()
        })
        .unwrap_or_default();
    let v = cert.validity();
    Ok(CertInfo {
        path: path.into(),
        subject: cert.subject().to_string(),
        sans,
        identity: Identity::from_cert_der(&pem.contents).ok(),
        is_ca: cert.is_ca(),
        not_before: v.not_before.to_datetime(),
        not_after: v.not_after.to_datetime(),
    })
}

/// Every `*.pem` certificate in `dir`, sorted by file name.
pub fn list(dir: &Path) -> Result<Vec<CertInfo>, CertsError> {
    let entries = std::fs::read_dir(dir).map_err(|source| CertsError::Read {
        path: dir.into(),
        source,
    })?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "pem"))
        .collect();
    paths.sort();
    paths.iter().map(|p| describe(p)).collect()
}

/// Issues a fresh certificate and key for `dir/{stem}.pem` with the same
/// identity and SANs and a new validity, replacing both files.
pub fn renew(ca: &Ca, dir: &Path, stem: &str, days: i64) -> Result<Identity, CertsError> {
    let path = dir.join(format!("{stem}.pem"));
    let info = describe(&path)?;
    let identity = info.identity.clone().ok_or_else(|| CertsError::Parse {
        path: path.clone(),
        reason: "no spiffe://tokenmesh identity to renew".into(),
    })?;
    let mut spec = LeafSpec::new(identity.clone(), days);
    spec.dns = info
        .sans
        .iter()
        .filter_map(|s| s.strip_prefix("DNS:").map(str::to_string))
        .collect();
    spec.ips = info
        .sans
        .iter()
        .filter_map(|s| s.strip_prefix("IP:").and_then(|i| i.parse().ok()))
        .collect();
    write_leaf(dir, stem, &ca.issue(&spec)?, ca)?;
    Ok(identity)
}

/// True unless `path` holds a certificate valid for at least another day.
fn needs_issuing(path: &Path) -> bool {
    describe(path).map_or(true, |c| {
        c.not_after < OffsetDateTime::now_utc() + Duration::days(1)
    })
}

/// Development certificates for a local mesh, created on first use in `dir`:
/// the CA, one certificate for each role but `worker` in `dir` itself, and
/// for each worker id a directory `dir/workers/{id}` holding `ca.pem`,
/// `worker.pem`, `worker.key`. Valid existing files are kept, so clients keep
/// working across restarts; missing or (nearly) expired ones are issued anew.
pub fn ensure_dev_bundle(dir: &Path, worker_ids: &[String]) -> Result<(), CertsError> {
    let ca = Ca::load_or_create(dir)?;
    for role in Role::ALL.into_iter().filter(|r| *r != Role::Worker) {
        if needs_issuing(&dir.join(format!("{role}.pem"))) {
            let id = Identity::new(role, role.as_str())?;
            write_leaf(
                dir,
                role.as_str(),
                &ca.issue(&LeafSpec::new(id, DEFAULT_LEAF_DAYS))?,
                &ca,
            )?;
        }
    }
    for w in worker_ids {
        let wdir = worker_dir(dir, w);
        if needs_issuing(&wdir.join("worker.pem")) {
            let id = Identity::new(Role::Worker, w.clone())?;
            write_leaf(
                &wdir,
                "worker",
                &ca.issue(&LeafSpec::new(id, DEFAULT_LEAF_DAYS))?,
                &ca,
            )?;
        }
    }
    Ok(())
}

/// Where [`ensure_dev_bundle`] puts a worker's files.
pub fn worker_dir(dir: &Path, worker_id: &str) -> PathBuf {
    dir.join("workers").join(worker_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn issues_leaves_with_identity_and_private_keys() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::load_or_create(dir.path()).unwrap();
        let id = Identity::new(Role::Worker, "w-7").unwrap();
        let mut spec = LeafSpec::new(id.clone(), 1);
        spec.dns.push("worker.example".into());
        write_leaf(dir.path(), "worker", &ca.issue(&spec).unwrap(), &ca).unwrap();
        let info = describe(&dir.path().join("worker.pem")).unwrap();
        assert_eq!(info.identity, Some(id));
        assert!(info
            .sans
            .contains(&"URI:spiffe://tokenmesh/worker/w-7".into()));
        assert!(info.sans.contains(&"DNS:worker.example".into()));
        assert!(info.sans.contains(&"IP:127.0.0.1".into()));
        assert!(!info.expired());
        for key in ["worker.key", "ca.key"] {
            let mode = std::fs::metadata(dir.path().join(key))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{key}");
        }
        // The files load as a process's TLS material.
        crate::tls::MeshTls::load(dir.path(), Role::Worker).unwrap();
        // Reloading the CA from disk signs leaves the same trust anchor accepts.
        let again = Ca::load(dir.path()).unwrap();
        assert_eq!(again.cert_pem, ca.cert_pem);
    }

    #[test]
    fn expired_leaf_is_refused_by_the_loader() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::load_or_create(dir.path()).unwrap();
        let mut spec = LeafSpec::new(Identity::new(Role::Router, "r").unwrap(), 1);
        spec.not_before = OffsetDateTime::now_utc() - Duration::days(2);
        spec.not_after = OffsetDateTime::now_utc() - Duration::days(1);
        write_leaf(dir.path(), "router", &ca.issue(&spec).unwrap(), &ca).unwrap();
        assert!(describe(&dir.path().join("router.pem")).unwrap().expired());
        let err = crate::tls::MeshTls::load(dir.path(), Role::Router).unwrap_err();
        assert!(err.to_string().contains("router.pem"), "{err}");
    }

    #[test]
    fn renew_keeps_identity_and_sans() {
        let dir = tempfile::tempdir().unwrap();
        ensure_dev_bundle(dir.path(), &["w-1".into()]).unwrap();
        let before = describe(&dir.path().join("router.pem")).unwrap();
        let ca = Ca::load(dir.path()).unwrap();
        renew(&ca, dir.path(), "router", 30).unwrap();
        let after = describe(&dir.path().join("router.pem")).unwrap();
        assert_eq!(before.identity, after.identity);
        assert_eq!(before.sans, after.sans);
        assert!(after.not_after < before.not_after);
        let w = describe(&worker_dir(dir.path(), "w-1").join("worker.pem")).unwrap();
        assert_eq!(w.identity.unwrap().name, "w-1");
    }
}
