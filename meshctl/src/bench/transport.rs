//! How the load generator reaches its target: plaintext, or mutual TLS with
//! the certificates of a `--tls-dir` directory as `meshctl generate` uses.
use anyhow::{bail, Context};
use std::path::PathBuf;
use std::time::Duration;
use tokenmesh_certs::tls::{etcd::client_tls, Role, TlsPaths};
use tonic::transport::{Channel, Endpoint};

/// Client-side mutual TLS settings. Without `--tls-dir` the load generator
/// speaks plaintext (servers started with `--insecure`), unlike `meshctl
/// generate`, which falls back to the development certificates: a benchmark
/// should never change transport behind its user's back.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// Directory with ca.pem and {role}.pem/{role}.key: mutual TLS to the
    /// target (absent: plaintext).
    #[arg(long)]
    pub tls_dir: Option<PathBuf>,
    /// Which certificate in --tls-dir to present: client or operator to a
    /// router, router to a worker with --direct. `--role` is the same flag.
    #[arg(long, visible_alias = "role", default_value = "client")]
    pub tls_role: String,
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
    let endpoint = match &tls.tls_dir {
        Some(dir) => {
            let role: Role = tls
                .tls_role
                .parse()
                .with_context(|| format!("--tls-role {}", tls.tls_role))?;
            let host = addr.split("://").last().unwrap_or(addr);
            // The client config etcd connections use too: trust ca.pem,
            // present {role}.pem; rustls checks the target's name against
            // its certificate.
            let config = client_tls(&TlsPaths::find(dir, role)?)?;
            Endpoint::from_shared(format!("https://{host}"))?.tls_config(config)?
        }
        None => {
            let url = url(addr);
            if url.starts_with("https://") {
                bail!("{url}: TLS needs --tls-dir DIR (ca.pem, client.pem, client.key)");
            }
            Endpoint::from_shared(url)?
        }
    };
    let url = endpoint.uri().to_string();
    endpoint
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("cannot reach {url}"))
}
