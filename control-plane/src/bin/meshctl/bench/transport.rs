//! How the load generator reaches its target. Building the channel is the one
//! seam where mutual TLS goes once the servers speak it.
use anyhow::{bail, Context};
use std::path::PathBuf;
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};

/// Client-side mutual TLS settings.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// CA certificate (PEM) to verify the target with (mutual TLS; not in this build yet).
    #[arg(long, env = "TOKENMESH_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS (not in this build yet).
    #[arg(long, env = "TOKENMESH_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// Client private key (PEM) for mutual TLS (not in this build yet).
    #[arg(long, env = "TOKENMESH_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
}

impl TlsArgs {
    fn any(&self) -> bool {
        self.tls_ca.is_some() || self.tls_cert.is_some() || self.tls_key.is_some()
    }
}

/// `host:port` or a URL, as an `http://` URL.
pub fn url(addr: &str) -> String {
    if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    }
}

/// Connects one HTTP/2 channel to `addr`.
pub async fn connect(addr: &str, tls: &TlsArgs) -> anyhow::Result<Channel> {
    if tls.any() {
        // The servers refuse to start without --insecure until mutual TLS
        // lands; saying so beats a handshake error later.
        bail!(
            "--tls-ca/--tls-cert/--tls-key: mutual TLS is not supported by this build yet; \
             the servers run plaintext (--insecure), so leave these flags out"
        );
    }
    let url = url(addr);
    if url.starts_with("https://") {
        bail!("{url}: TLS is not supported by this build yet; use http://");
    }
    Endpoint::from_shared(url.clone())?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("cannot reach {url}"))
}
