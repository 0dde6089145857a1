//! An etcd lease kept alive every TTL/3: the one helper behind worker
//! registration, router stats and the control plane's election.
//!
//! Use it in a `select!` loop: `_ = lease.due() => lease.renew().await?`.
//! `due` is cancel-safe (a tick), while `renew` runs to completion in the
//! branch body, so a keep-alive is never cut off halfway by another branch.
use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper};
use std::time::Duration;
use tokio::time::Interval;

/// A granted lease and its keep-alive stream.
pub struct KeptLease {
    client: Client,
    id: i64,
    keeper: LeaseKeeper,
    acks: LeaseKeepAliveStream,
    tick: Interval,
}

impl KeptLease {
    /// Grants a lease of `ttl` (at least a second) and opens its keep-alive.
    pub async fn grant(client: &Client, ttl: Duration) -> Result<Self, etcd_client::Error> {
        let mut client = client.clone();
        let ttl_s = ttl.as_secs().max(1);
        let id = client.lease_grant(ttl_s as i64, None).await?.id();
        let (keeper, acks) = client.lease_keep_alive(id).await?;
        let mut tick = tokio::time::interval(Duration::from_secs(ttl_s) / 3);
        // The first tick is immediate; the lease is fresh.
        tick.tick().await;
        Ok(Self {
            client,
            id,
            keeper,
            acks,
            tick,
        })
    }

    /// The lease id, for puts and campaigns under it.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// Resolves when the next keep-alive is due.
    pub async fn due(&mut self) {
        self.tick.tick().await;
    }

    /// Sends one keep-alive and checks etcd still holds the lease.
    pub async fn renew(&mut self) -> Result<(), etcd_client::Error> {
        self.keeper.keep_alive().await?;
        match self.acks.message().await? {
            Some(r) if r.ttl() > 0 => Ok(()),
            _ => Err(etcd_client::Error::LeaseKeepAliveError(format!(
                "lease {:x} expired",
                self.id
            ))),
        }
    }

    /// Revokes the lease, which deletes every key under it. Best effort: if
    /// etcd is away, the lease expires on its own.
    pub async fn revoke(mut self) {
        let _ = self.client.lease_revoke(self.id).await;
    }
}
