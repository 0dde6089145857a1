//! The flags every server binary takes (DESIGN.md, "Command-line
//! conventions"), declared once and flattened into each binary's config;
//! `PORT` is the binary's own default gRPC port.
use crate::serve::ServeError;
use crate::telemetry::TelemetryArgs;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tokenmesh_certs::tls::{MeshTls, Role, TlsPaths};
use tokenmesh_proto::keys::Keys;

/// `--listen`, `--etcd`, `--etcd-prefix`, `--tls-dir`, `--insecure`,
/// `--tls-reload-ms`, `--runtime-threads` and the telemetry flags (`--log`, `--log-format`,
/// `--otlp-endpoint`, `--metrics-listen`).
#[derive(clap::Args, Clone, Debug)]
pub struct ServerArgs<const PORT: u16> {
    /// Address to serve gRPC on.
    #[arg(
        long,
        env = "TOKENMESH_LISTEN",
        default_value_t = SocketAddr::from(([0, 0, 0, 0], PORT))
    )]
    pub listen: SocketAddr,

    /// etcd endpoints, comma-separated (`https://` ones are dialled with this
    /// process's mesh certificate).
    #[arg(long, env = "TOKENMESH_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,

    /// Prefix of every etcd key.
    #[arg(long, env = "TOKENMESH_ETCD_PREFIX", default_value = "/tokenmesh")]
    pub etcd_prefix: String,

    /// Serve (and dial) plaintext gRPC with no identities, development only;
    /// warns at start. Required when no --tls-dir is given.
    #[arg(long, env = "TOKENMESH_INSECURE", conflicts_with = "tls_dir")]
    pub insecure: bool,

    /// Directory with ca.pem, {role}.pem and {role}.key (as tokenmesh-certs
    /// writes them, role = router, worker or control) or ca.crt, tls.crt and
    /// tls.key (as cert-manager writes a Kubernetes Secret) for mutual TLS;
    /// {role}.pem wins where both are present.
    #[arg(long, env = "TOKENMESH_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,

    /// How often the certificate and key files are checked for replacement,
    /// in milliseconds; a valid replacement serves new connections at once.
    #[arg(long, env = "TOKENMESH_TLS_RELOAD_MS", default_value_t = 2_000)]
    pub tls_reload_ms: u64,

    /// Threads of the async runtime; 0 is one per CPU this process may run
    /// on. With one, the single-threaded scheduler, which writes several
    /// streams' messages per syscall where the multi-threaded one wrote one
    /// (CPU work of the worker's engine runs on its own threads either way).
    #[arg(long, env = "TOKENMESH_RUNTIME_THREADS", default_value_t = 0)]
    pub runtime_threads: usize,

    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

impl<const PORT: u16> ServerArgs<PORT> {
    /// The async runtime `--runtime-threads` asks for.
    pub fn runtime(&self) -> std::io::Result<tokio::runtime::Runtime> {
        crate::scheduler::build(self.runtime_threads)
    }

    /// How often the certificate files are polled (at least every 10 ms).
    pub fn tls_reload(&self) -> Duration {
        Duration::from_millis(self.tls_reload_ms.max(10))
    }

    /// The server's transport from `--tls-dir` / `--insecure`: its mesh TLS
    /// material as `role`, or None for plaintext (logged as a warning, with
    /// `insecure_note` saying what that exposes).
    pub fn transport(
        &self,
        role: Role,
        insecure_note: &str,
    ) -> Result<Option<MeshTls>, ServeError> {
        Ok(tokenmesh_certs::tls::server_transport(
            self.tls_dir.as_deref(),
            self.insecure,
            role,
            insecure_note,
        )?)
    }

    /// The certificate files to present to etcd: this process's own when it
    /// runs mutual TLS and an endpoint is `https://`.
    pub fn etcd_tls(&self, tls: Option<&MeshTls>) -> Option<TlsPaths> {
        tokenmesh_certs::tls::etcd::client_paths(tls, &self.etcd)
    }

    /// The etcd key schema under `--etcd-prefix`.
    pub fn keys(&self) -> Keys {
        Keys::new(&self.etcd_prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cfg {
        #[command(flatten)]
        server: ServerArgs<50999>,
    }

    #[test]
    fn each_binary_has_its_own_listen_default() {
        let cfg = Cfg::try_parse_from(["t", "--insecure"]).unwrap();
        assert_eq!(cfg.server.listen.port(), 50999);
        assert!(cfg.server.etcd.is_empty());
        assert_eq!(cfg.server.keys().root(), "/tokenmesh/");
    }

    #[test]
    fn flags_parse() {
        let cfg = Cfg::try_parse_from([
            "t",
            "--listen",
            "127.0.0.1:1",
            "--etcd",
            "http://a:2379,http://b:2379",
            "--tls-dir",
            "/x",
            "--tls-reload-ms",
            "1",
            "--runtime-threads",
            "1",
        ])
        .unwrap();
        assert_eq!(cfg.server.etcd.len(), 2);
        assert_eq!(cfg.server.runtime_threads, 1);
        assert_eq!(cfg.server.tls_reload(), Duration::from_millis(10));
        assert!(Cfg::try_parse_from(["t", "--insecure", "--tls-dir", "/x"]).is_err());
    }

    /// Issues `spiffe://tokenmesh/router/{name}` into `dir` under tokenmesh's
    /// names (ca.pem, router.pem, router.key).
    fn issue_router(dir: &std::path::Path, ca: &tokenmesh_certs::Ca, name: &str) {
        let id = tokenmesh_certs::Identity::new(Role::Router, name).unwrap();
        let leaf = ca.issue(&tokenmesh_certs::LeafSpec::new(id, 1)).unwrap();
        tokenmesh_certs::write_leaf(dir, "router", &leaf, ca).unwrap();
    }

    fn transport_of(dir: &std::path::Path) -> Result<Option<MeshTls>, ServeError> {
        let dir = dir.to_str().unwrap();
        let cfg = Cfg::try_parse_from(["t", "--tls-dir", dir]).unwrap();
        cfg.server.transport(Role::Router, "")
    }

    #[test]
    fn tls_dir_takes_cert_manager_file_names() {
        let ca_dir = tempfile::tempdir().unwrap();
        let ca = tokenmesh_certs::Ca::load_or_create(ca_dir.path()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        issue_router(dir.path(), &ca, "r-cm");
        // The layout of a kubernetes.io/tls Secret volume.
        for (from, to) in [
            ("ca.pem", "ca.crt"),
            ("router.pem", "tls.crt"),
            ("router.key", "tls.key"),
        ] {
            std::fs::rename(dir.path().join(from), dir.path().join(to)).unwrap();
        }
        let tls = transport_of(dir.path()).unwrap().unwrap();
        assert_eq!(tls.store.identity().name, "r-cm");
        assert_eq!(tls.store.paths().cert, dir.path().join("tls.crt"));
        assert_eq!(tls.store.paths().ca, dir.path().join("ca.crt"));

        // Both schemes present: the role's own file wins.
        issue_router(dir.path(), &ca, "r-own");
        let tls = transport_of(dir.path()).unwrap().unwrap();
        assert_eq!(tls.store.identity().name, "r-own");
        assert_eq!(tls.store.paths().key, dir.path().join("router.key"));
    }

    #[test]
    fn tls_dir_without_either_scheme_names_both() {
        let dir = tempfile::tempdir().unwrap();
        let err = transport_of(dir.path()).unwrap_err().to_string();
        for name in ["router.pem", "router.key", "tls.crt", "tls.key"] {
            assert!(err.contains(name), "{err}");
        }
    }
}
