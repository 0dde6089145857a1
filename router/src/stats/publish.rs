//! Writes the router's stats to etcd: one key per model version, all under
//! one lease of this router, kept alive every TTL/3. If etcd goes away the
//! keys expire with the lease; when it is back a new lease is granted and
//! everything is written again (the counters themselves live in memory and
//! are never reset). On shutdown the lease is revoked, which deletes the keys.
use super::{Stats, WorkerViews};
use etcd_client::{Client, PutOptions};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokenmesh_certs::tls::TlsPaths;
use tokenmesh_proto::keys::Keys;
use tokenmesh_runtime::etcd;
use tokenmesh_runtime::lease::KeptLease;
use tokenmesh_runtime::Backoff;
use tokio::sync::watch;

/// Lease TTL of the stats keys, like the workers' registrations.
pub const LEASE_TTL: Duration = Duration::from_secs(10);

/// Where and how often to publish.
#[derive(Clone, Debug)]
pub struct PublishConfig {
    pub endpoints: Vec<String>,
    pub keys: Keys,
    pub router_id: String,
    pub interval: Duration,
    /// How long the stats of a version no worker or policy has outlive its
    /// last request.
    pub retention: Duration,
    /// Mutual TLS to etcd.
    pub tls: Option<TlsPaths>,
}

/// Publishes until `shutdown` turns true, then revokes the lease.
pub async fn run(
    cfg: PublishConfig,
    stats: Arc<Stats>,
    registry: Arc<dyn WorkerViews>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut backoff = Backoff::RECONNECT.retries();
    loop {
        if *shutdown.borrow() {
            return;
        }
        match publish_under_lease(&cfg, &stats, &*registry, &mut shutdown).await {
            Ok(()) => return,
            Err(e) => {
                tracing::warn!(error = %e, router_id = %cfg.router_id, "publishing stats to etcd failed; retrying");
            }
        }
        if !backoff.wait(&mut shutdown).await {
            return;
        }
    }
}

/// One lease: grant, then put every interval and keep alive every TTL/3.
/// Ok(()) after a clean shutdown.
async fn publish_under_lease(
    cfg: &PublishConfig,
    stats: &Stats,
    registry: &dyn WorkerViews,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), etcd_client::Error> {
    let mut client = etcd::connect(&cfg.endpoints, cfg.tls.as_ref(), etcd::Use::Streams).await?;
    let mut lease = KeptLease::grant(&client, LEASE_TTL).await?;
    tracing::info!(router_id = %cfg.router_id, lease = lease.id(), "publishing stats to etcd");
    let mut publish = tokio::time::interval(cfg.interval);
    publish.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut written: HashSet<String> = HashSet::new();
    loop {
        tokio::select! {
            _ = publish.tick() => {
                written = put_snapshot(&mut client, cfg, stats, registry, lease.id(), &written).await?;
            }
            _ = lease.due() => lease.renew().await?,
            _ = shutdown.changed() => {
                if *shutdown.borrow() {
                    // Revoking deletes every key under the lease; if etcd is
                    // away they expire with it anyway.
                    lease.revoke().await;
                    tracing::info!(router_id = %cfg.router_id, "stats withdrawn from etcd");
                    return Ok(());
                }
            }
        }
    }
}

/// Puts one record per version under `lease` and deletes the keys of
/// versions that are gone (no workers, and no traffic for the retention
/// time unless a policy names them); the keys written.
async fn put_snapshot(
    client: &mut Client,
    cfg: &PublishConfig,
    stats: &Stats,
    registry: &dyn WorkerViews,
    lease: i64,
    previous: &HashSet<String>,
) -> Result<HashSet<String>, etcd_client::Error> {
    let mut written = HashSet::new();
    for ((model, version), record) in stats.snapshot(registry, cfg.retention) {
        let key = cfg.keys.stats(&cfg.router_id, &model, &version);
        let value = serde_json::to_string(&record).expect("a StatsRecord serializes");
        client
            .put(
                key.as_str(),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )
            .await?;
        written.insert(key);
    }
    for gone in previous.difference(&written) {
        client.delete(gone.as_str(), None).await?;
    }
    Ok(written)
}
