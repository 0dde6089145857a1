//! The process's own certificate, swappable at run time. Servers resolve it
//! per handshake and the router's worker channels present it per connection,
//! so a replaced file on disk is used by the next connection while existing
//! connections keep the certificate they were established with.
use crate::tls::identity::{Identity, Role};
use crate::tls::material::{load_certified_key, TlsError, TlsPaths};
use arc_swap::ArcSwap;
use rustls::client::ResolvesClientCert;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::SignatureScheme;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// One certificate and key, reloaded from disk when the files change.
pub struct CertStore {
    paths: TlsPaths,
    role: Role,
    current: ArcSwap<(Arc<CertifiedKey>, Identity)>,
}

impl fmt::Debug for CertStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertStore")
            .field("paths", &self.paths)
            .field("identity", &self.identity())
            .finish()
    }
}

/// What the watcher compares to notice a replaced file.
type Stamp = Option<(SystemTime, u64)>;

fn stamp(path: &std::path::Path) -> Stamp {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

impl CertStore {
    /// Loads the certificate and key; fails (naming the file) if either is
    /// unusable.
    pub fn load(paths: TlsPaths, role: Role) -> Result<Arc<Self>, TlsError> {
        let loaded = load_certified_key(&paths, role)?;
        Ok(Arc::new(Self {
            paths,
            role,
            current: ArcSwap::from_pointee(loaded),
        }))
    }

    /// The identity of the certificate in use.
    pub fn identity(&self) -> Identity {
        self.current.load().1.clone()
    }

    /// The certificate and key in use.
    pub fn certified_key(&self) -> Arc<CertifiedKey> {
        self.current.load().0.clone()
    }

    /// The files this store reads.
    pub fn paths(&self) -> &TlsPaths {
        &self.paths
    }

    /// Loads the files again and puts them in service if they pass every
    /// check and name the same identity (peers check it: a worker whose name
    /// changed under it would be refused as an impostor); otherwise the
    /// certificate in use stays.
    pub fn reload(&self) -> Result<Identity, TlsError> {
        let loaded = load_certified_key(&self.paths, self.role)?;
        let id = loaded.1.clone();
        let was = self.identity();
        if id != was {
            return Err(TlsError::IdentityChanged {
                path: self.paths.cert.clone(),
                was,
                now: id,
            });
        }
        self.current.store(Arc::new(loaded));
        Ok(id)
    }

    /// Polls the certificate and key files every `every` and reloads when
    /// either changed. A replacement that fails the checks is logged and
    /// refused; it is tried again only when the files change again (a
    /// certificate written before its key passes on the key's write).
    pub fn spawn_watcher(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let store = Arc::downgrade(self);
        let (cert, key) = (self.paths.cert.clone(), self.paths.key.clone());
        tokio::spawn(async move {
            let mut seen = (stamp(&cert), stamp(&key));
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(store) = store.upgrade() else { return };
                let now = (stamp(&cert), stamp(&key));
                if now == seen {
                    continue;
                }
                seen = now;
                match store.reload() {
                    Ok(id) => {
                        tracing::info!(identity = %id, cert = %cert.display(), "certificate reloaded")
                    }
                    Err(e) => tracing::error!(
                        error = %e,
                        "refusing the replaced certificate; keeping the one in use"
                    ),
                }
            }
        })
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.certified_key())
    }
}

impl ResolvesClientCert for CertStore {
    fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.certified_key())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    // tokenmesh-certs depends on this crate, so its `Role`/`Identity` are
    // another instance's types: only files cross over.
    use crate as certs;

    fn issue(ca: &certs::Ca, dir: &std::path::Path, role: certs::Role, name: &str) {
        let spec = certs::LeafSpec::new(certs::Identity::new(role, name).unwrap(), 1);
        certs::write_leaf(dir, role.as_str(), &ca.issue(&spec).unwrap(), ca).unwrap();
    }

    #[test]
    fn reload_takes_valid_replacements_and_refuses_others() {
        let dir = tempfile::tempdir().unwrap();
        let ca = certs::Ca::load_or_create(dir.path()).unwrap();
        issue(&ca, dir.path(), certs::Role::Router, "r1");
        let store =
            CertStore::load(TlsPaths::in_dir(dir.path(), Role::Router), Role::Router).unwrap();
        let first = store.certified_key().end_entity_cert().unwrap().to_vec();

        // Same identity, new certificate: taken.
        issue(&ca, dir.path(), certs::Role::Router, "r1");
        store.reload().unwrap();
        let second = store.certified_key().end_entity_cert().unwrap().to_vec();
        assert_ne!(first, second);

        // Another identity: refused, the second certificate stays.
        issue(&ca, dir.path(), certs::Role::Router, "r2");
        let err = store.reload().unwrap_err();
        assert!(matches!(err, TlsError::IdentityChanged { .. }), "{err}");
        // Garbage: refused, naming the file.
        std::fs::write(&store.paths().cert, "not a certificate").unwrap();
        let err = store.reload().unwrap_err();
        assert!(err.to_string().contains("router.pem"), "{err}");
        // A key that belongs to another certificate: refused.
        issue(&ca, dir.path(), certs::Role::Router, "r1");
        let other_key = dir.path().join("other.key");
        std::fs::copy(&store.paths().key, &other_key).unwrap();
        issue(&ca, dir.path(), certs::Role::Router, "r1");
        std::fs::copy(&other_key, &store.paths().key).unwrap();
        let err = store.reload().unwrap_err();
        assert!(matches!(err, TlsError::KeyMismatch { .. }), "{err}");
        assert_eq!(
            store.certified_key().end_entity_cert().unwrap().to_vec(),
            second
        );
        assert_eq!(store.identity().name, "r1");
    }
}
