//! Registration in etcd under a lease (DESIGN.md, "etcd keys").
//!
//! The worker's key lives exactly as long as its lease: the lease is kept alive
//! every TTL/3, and if etcd goes away the key expires on its own. When etcd
//! comes back the worker grants a new lease and registers again. On shutdown
//! the key is deleted and the lease revoked at once, so routers stop choosing
//! the worker before it stops serving.
use etcd_client::{Client, ConnectOptions, PutOptions};
use std::time::Duration;
use tokio::sync::watch;

/// Where and how to register.
#[derive(Clone, Debug)]
pub struct RegistrationConfig {
    pub endpoints: Vec<String>,
    pub key: String,
    /// JSON `WorkerRecord`.
    pub value: String,
    pub ttl: Duration,
    /// Mutual TLS to etcd (`https://` endpoints with `--tls-dir`).
    pub tls: Option<tokenmesh_certs::tls::TlsPaths>,
}

/// Keeps the registration alive until `shutdown` turns true, then removes it.
pub async fn run(cfg: RegistrationConfig, mut shutdown: watch::Receiver<bool>) {
    let mut backoff = Duration::from_millis(200);
    loop {
        if *shutdown.borrow() {
            return;
        }
        match register_once(&cfg, &mut shutdown).await {
            Ok(()) => return,
            Err(e) => {
                tracing::warn!(error = %e, key = %cfg.key, "etcd registration lost; retrying");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// One registration: grant, put, keep alive. Ok(()) after a clean shutdown.
async fn register_once(
    cfg: &RegistrationConfig,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), etcd_client::Error> {
    let mut client = connect(&cfg.endpoints, cfg.tls.as_ref(), true).await?;
    let ttl = cfg.ttl.as_secs().max(1) as i64;
    let lease = client.lease_grant(ttl, None).await?.id();
    client
        .put(
            cfg.key.as_str(),
            cfg.value.as_str(),
            Some(PutOptions::new().with_lease(lease)),
        )
        .await?;
    tracing::info!(key = %cfg.key, lease, ttl, "registered in etcd");
    let (mut keeper, mut responses) = client.lease_keep_alive(lease).await?;
    let mut tick = tokio::time::interval(cfg.ttl / 3);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                keeper.keep_alive().await?;
                match responses.message().await? {
                    Some(r) if r.ttl() > 0 => {}
                    _ => {
                        return Err(etcd_client::Error::LeaseKeepAliveError(
                            "lease expired".into(),
                        ))
                    }
                }
            }
            _ = shutdown.changed() => {
                if *shutdown.borrow() {
                    // Best effort: if etcd is away the lease expires anyway.
                    let _ = client.delete(cfg.key.as_str(), None).await;
                    let _ = client.lease_revoke(lease).await;
                    tracing::info!(key = %cfg.key, "deregistered from etcd");
                    return Ok(());
                }
            }
        }
    }
}

/// A client of the worker's etcd; with `tls`, mutual TLS. `request_timeout`
/// bounds each unary request (not for watches, which stay open).
pub(crate) async fn connect(
    endpoints: &[String],
    tls: Option<&tokenmesh_certs::tls::TlsPaths>,
    request_timeout: bool,
) -> Result<Client, etcd_client::Error> {
    let mut opts = ConnectOptions::new().with_connect_timeout(Duration::from_secs(2));
    opts = if request_timeout {
        opts.with_timeout(Duration::from_secs(3))
    } else {
        opts.with_keep_alive(Duration::from_secs(5), Duration::from_secs(3))
            .with_keep_alive_while_idle(true)
    };
    if let Some(paths) = tls {
        let tls = tokenmesh_certs::tls::etcd::client_tls(paths)
            .map_err(|e| etcd_client::Error::InvalidArgs(e.to_string()))?;
        opts = opts.with_tls(tls);
    }
    Client::connect(endpoints, Some(opts)).await
}
