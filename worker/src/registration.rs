//! Registration in etcd under a lease (DESIGN.md, "etcd keys").
//!
//! The worker's key lives exactly as long as its lease: the lease is kept alive
//! every TTL/3, and if etcd goes away the key expires on its own. When etcd
//! comes back the worker grants a new lease and registers again. On shutdown
//! the key is deleted and the lease revoked at once, so routers stop choosing
//! the worker before it stops serving.
use etcd_client::PutOptions;
use std::time::Duration;
use tokenmesh_runtime::etcd;
use tokenmesh_runtime::lease::KeptLease;
use tokenmesh_runtime::{Backoff, Readiness};
use tokio::sync::watch;

/// The readiness condition of a worker that is not registered in etcd.
pub const CONDITION: &str = "etcd";

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

/// Keeps the registration alive until `shutdown` turns true, then removes it;
/// `readiness` holds the worker back while it is not registered.
pub async fn run(
    cfg: RegistrationConfig,
    readiness: Readiness,
    mut shutdown: watch::Receiver<bool>,
) {
    if cfg.endpoints.is_empty() {
        return;
    }
    let mut backoff = Backoff::RECONNECT.retries();
    // Each attempt talks to one endpoint, the next one after a failure: a
    // client over the whole list kept picking a stopped etcd node (seen in
    // the compose cluster test) until the lease had lapsed.
    for attempt in 0usize.. {
        if *shutdown.borrow() {
            return;
        }
        let endpoint = &cfg.endpoints[attempt % cfg.endpoints.len()];
        let mut registered = false;
        match register_once(&cfg, endpoint, &readiness, &mut registered, &mut shutdown).await {
            Ok(()) => return,
            Err(e) => {
                readiness.not_ready(CONDITION, format!("not registered in etcd: {e}"));
                tracing::warn!(error = %e, key = %cfg.key, endpoint = %endpoint, "etcd registration lost; retrying on the next endpoint");
            }
        }
        if registered {
            backoff.reset();
        }
        if !backoff.wait(&mut shutdown).await {
            return;
        }
    }
}

/// One registration: grant, put, keep alive. Ok(()) after a clean shutdown.
async fn register_once(
    cfg: &RegistrationConfig,
    endpoint: &str,
    readiness: &Readiness,
    registered: &mut bool,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), etcd_client::Error> {
    let mut client = etcd::connect(&[endpoint.to_string()], cfg.tls.as_ref(), REQUESTS).await?;
    let mut lease = KeptLease::grant(&client, cfg.ttl).await?;
    client
        .put(
            cfg.key.as_str(),
            cfg.value.as_str(),
            Some(PutOptions::new().with_lease(lease.id())),
        )
        .await?;
    tracing::info!(key = %cfg.key, lease = lease.id(), ttl = cfg.ttl.as_secs(), endpoint, "registered in etcd");
    *registered = true;
    readiness.ready(CONDITION);
    loop {
        tokio::select! {
            _ = lease.due() => lease.renew().await?,
            _ = shutdown.changed() => {
                if *shutdown.borrow() {
                    // Best effort: if etcd is away the lease expires anyway.
                    let _ = client.delete(cfg.key.as_str(), None).await;
                    lease.revoke().await;
                    tracing::info!(key = %cfg.key, "deregistered from etcd");
                    return Ok(());
                }
            }
        }
    }
}

/// The worker's unary etcd requests: each bounded, so a stopped node cannot
/// hold the registration past its lease.
pub(crate) const REQUESTS: etcd::Use = etcd::Use::Requests {
    timeout: Duration::from_secs(3),
};

/// As [`run`], but registered only while `up` is true (an upstream worker's
/// engine answers): when it turns false the key is deleted and the lease
/// revoked, so routers stop choosing the worker, and when it turns true
/// again the worker registers anew.
pub async fn run_while(
    cfg: RegistrationConfig,
    readiness: Readiness,
    mut shutdown: watch::Receiver<bool>,
    mut up: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            r = up.wait_for(|&u| u) => if r.is_err() { return },
            _ = shutdown.wait_for(|&s| s) => return,
        }
        let (stop_tx, stop_rx) = watch::channel(false);
        let registered = tokio::spawn(run(cfg.clone(), readiness.clone(), stop_rx));
        let leaving = tokio::select! {
            _ = up.wait_for(|&u| !u) => false,
            _ = shutdown.wait_for(|&s| s) => true,
        };
        let _ = stop_tx.send(true);
        let _ = registered.await;
        if leaving {
            return;
        }
        tracing::info!(key = %cfg.key, "upstream engine away; deregistered until it answers again");
    }
}
