//! Leader election among control-plane replicas with etcd's election API: a
//! replica campaigns under its own lease; the winner leads the rollout
//! controller while it keeps that lease alive. A dead leader's lease expires
//! after its TTL and the next campaigner takes over; a leader that cannot
//! renew steps down at once rather than risk two leaders.
use etcd_client::{Client, ResignOptions};
use std::time::Duration;
use tokenmesh_runtime::lease::KeptLease;
use tokenmesh_runtime::Backoff;
use tokio::sync::watch;

/// Campaigns forever, publishing whether this replica leads on `leading`.
pub async fn run(
    client: Client,
    name: String,
    id: String,
    ttl: Duration,
    leading: watch::Sender<bool>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut backoff = Backoff::RECONNECT.retries();
    loop {
        if *shutdown.borrow() {
            return;
        }
        match term(client.clone(), &name, &id, ttl, &leading, &mut shutdown).await {
            Ok(()) => return,
            Err(e) => {
                metrics::gauge!("tokenmesh_control_leader").set(0.0);
                if leading.send_replace(false) {
                    tracing::warn!(error = %e, "lost leadership of the rollout controller");
                } else {
                    tracing::warn!(error = %e, "leader election interrupted; campaigning again");
                }
            }
        }
        if !backoff.wait(&mut shutdown).await {
            return;
        }
    }
}

/// One lease: campaign, lead while it lives. Ok(()) after a clean shutdown.
async fn term(
    mut client: Client,
    name: &str,
    id: &str,
    ttl: Duration,
    leading: &watch::Sender<bool>,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), etcd_client::Error> {
    let mut lease = KeptLease::grant(&client, ttl).await?;
    let mut campaigner = client.clone();
    let campaign = campaigner.campaign(name, id, lease.id());
    tokio::pin!(campaign);
    let leader_key = loop {
        tokio::select! {
            won = &mut campaign => break won?.take_leader(),
            _ = lease.due() => lease.renew().await?,
            _ = shutdown.changed() => {
                lease.revoke().await;
                return Ok(());
            }
        }
    };
    tracing::info!(id, lease = lease.id(), "leading the rollout controller");
    leading.send_replace(true);
    metrics::gauge!("tokenmesh_control_leader").set(1.0);
    loop {
        tokio::select! {
            _ = lease.due() => lease.renew().await?,
            _ = shutdown.changed() => {
                leading.send_replace(false);
                metrics::gauge!("tokenmesh_control_leader").set(0.0);
                let mut opts = ResignOptions::new();
                if let Some(k) = leader_key {
                    opts = opts.with_leader(k);
                }
                let _ = client.resign(Some(opts)).await;
                lease.revoke().await;
                tracing::info!(id, "resigned leadership");
                return Ok(());
            }
        }
    }
}
