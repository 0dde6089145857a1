//! Leader election among control-plane replicas with etcd's election API: a
//! replica campaigns under its own lease; the winner leads the rollout
//! controller while it keeps that lease alive. A dead leader's lease expires
//! after its TTL and the next campaigner takes over; a leader that cannot
//! renew steps down at once rather than risk two leaders.
use etcd_client::{Client, ResignOptions};
use std::time::Duration;
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
    let mut backoff = Duration::from_millis(200);
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
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
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
    let ttl_s = ttl.as_secs().max(1) as i64;
    let lease = client.lease_grant(ttl_s, None).await?.id();
    let (mut keeper, mut acks) = client.lease_keep_alive(lease).await?;
    let mut tick = tokio::time::interval(Duration::from_secs(ttl_s as u64) / 3);
    let mut renew = async || -> Result<(), etcd_client::Error> {
        keeper.keep_alive().await?;
        match acks.message().await? {
            Some(r) if r.ttl() > 0 => Ok(()),
            _ => Err(etcd_client::Error::LeaseKeepAliveError(
                "election lease expired".into(),
            )),
        }
    };

    let mut campaigner = client.clone();
    let campaign = campaigner.campaign(name, id, lease);
    tokio::pin!(campaign);
    let leader_key = loop {
        tokio::select! {
            won = &mut campaign => break won?.take_leader(),
            _ = tick.tick() => renew().await?,
            _ = shutdown.changed() => {
                let _ = client.lease_revoke(lease).await;
                return Ok(());
            }
        }
    };
    tracing::info!(id, lease, "leading the rollout controller");
    leading.send_replace(true);
    metrics::gauge!("tokenmesh_control_leader").set(1.0);
    loop {
        tokio::select! {
            _ = tick.tick() => renew().await?,
            _ = shutdown.changed() => {
                leading.send_replace(false);
                metrics::gauge!("tokenmesh_control_leader").set(0.0);
                let mut opts = ResignOptions::new();
                if let Some(k) = leader_key {
                    opts = opts.with_leader(k);
                }
                let _ = client.resign(Some(opts)).await;
                let _ = client.lease_revoke(lease).await;
                tracing::info!(id, "resigned leadership");
                return Ok(());
            }
        }
    }
}
