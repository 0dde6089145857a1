//! Identities and mutual TLS shared by every tokenmesh process
//! (DESIGN.md, "Identities"): SPIFFE identities in certificates, loading and
//! hot-reloading the process's own certificate, the server-side acceptor, the
//! authorization layer every server uses, and the router's connector that
//! checks a worker is who it registered as. No business logic lives here.

pub mod authz;
pub mod connector;
pub mod etcd;
pub mod identity;
pub mod material;
pub mod reload;
pub mod server;

pub use authz::AuthLayer;
pub use identity::{Identity, IdentityError, Role};
pub use material::{TlsError, TlsPaths};
pub use reload::CertStore;

use rustls::RootCertStore;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Why a server has no transport to serve on.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("choose a transport: --tls-dir DIR for mutual TLS, or --insecure for plaintext (development only)")]
    NoTransport,
    #[error("--tls-dir: {0}")]
    Tls(#[from] TlsError),
}

/// A server's transport from its `--tls-dir` and `--insecure` flags: its
/// mutual-TLS material as `role`, or `None` for plaintext (logged as a
/// warning, with `insecure_note` saying what that exposes).
pub fn server_transport(
    tls_dir: Option<&Path>,
    insecure: bool,
    role: Role,
    insecure_note: &str,
) -> Result<Option<MeshTls>, TransportError> {
    match tls_dir {
        Some(dir) => {
            let tls = MeshTls::load(dir, role)?;
            tracing::info!(identity = %tls.store.identity(), dir = %dir.display(), "mutual TLS");
            Ok(Some(tls))
        }
        None if insecure => {
            tracing::warn!("INSECURE: plaintext gRPC with no identities (--insecure){insecure_note}; development only");
            Ok(None)
        }
        None => Err(TransportError::NoTransport),
    }
}

/// One process's mutual-TLS material: the mesh CA and its own certificate.
#[derive(Clone, Debug)]
pub struct MeshTls {
    pub store: Arc<CertStore>,
    pub roots: Arc<RootCertStore>,
}

impl MeshTls {
    /// Loads `dir/ca.pem`, `dir/{role}.pem` and `dir/{role}.key`, or
    /// cert-manager's `ca.crt`, `tls.crt` and `tls.key` ([`TlsPaths::find`]),
    /// checking each; the error names the file at fault.
    pub fn load(dir: &Path, role: Role) -> Result<Self, TlsError> {
        let paths = TlsPaths::find(dir, role)?;
        let roots = material::load_roots(&paths.ca)?;
        let store = CertStore::load(paths, role)?;
        Ok(Self { store, roots })
    }

    /// Starts reloading the certificate when its files change.
    pub fn watch(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        self.store.spawn_watcher(every)
    }

    /// The server config: client certificates required, own certificate
    /// resolved per handshake.
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        server::server_config(self.store.clone(), self.roots.clone())
    }

    /// The config of an HTTP listener (the router's OpenAI-compatible API):
    /// HTTP/2 and HTTP/1.1, client certificates as `client_certs` says.
    pub fn http_server_config(
        &self,
        client_certs: server::ClientCerts,
    ) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        server::http_server_config(self.store.clone(), self.roots.clone(), client_certs)
    }

    /// A connector to a peer that must present `expected`.
    pub fn connector_to(&self, expected: Identity) -> Result<connector::PeerConnector, TlsError> {
        Ok(connector::PeerConnector::new(
            connector::peer_client_config(self.store.clone(), self.roots.clone(), expected)?,
        ))
    }
}
