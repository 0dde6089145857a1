//! The worker's drain key, `drain/{worker_id}` (DESIGN.md, "etcd keys"): the
//! control plane writes it to take the worker out of service. The worker
//! watches it from start-up (a key written before the worker started counts
//! too); when it appears the worker drains as on SIGTERM. The key lives until
//! the worker is gone: the worker deletes it on its way out.
use crate::registration::REQUESTS;
use etcd_client::{EventType, WatchOptions};
use std::time::Duration;
use tokenmesh_certs::tls::TlsPaths;
use tokenmesh_runtime::etcd;
use tokenmesh_runtime::Backoff;

/// Which key to watch, where.
#[derive(Clone, Debug)]
pub struct DrainKey {
    pub endpoints: Vec<String>,
    pub key: String,
    /// Mutual TLS to etcd.
    pub tls: Option<TlsPaths>,
}

impl DrainKey {
    /// Resolves with the key's value (the reason) once the key exists;
    /// reconnects on its own while etcd is away.
    pub async fn requested(&self) -> String {
        let mut backoff = Backoff::RECONNECT.retries();
        loop {
            match self.wait_once().await {
                Ok(reason) => return reason,
                Err(e) => {
                    tracing::warn!(error = %e, key = %self.key, "watching the drain key failed; retrying")
                }
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    /// Reads the key, then watches it from the next revision.
    async fn wait_once(&self) -> Result<String, etcd_client::Error> {
        let mut client =
            etcd::connect(&self.endpoints, self.tls.as_ref(), etcd::Use::Streams).await?;
        let now = client.get(self.key.as_str(), None).await?;
        if let Some(kv) = now.kvs().first() {
            return Ok(kv.value_str()?.to_string());
        }
        let revision = now.header().map(|h| h.revision()).unwrap_or(0);
        let mut watch = client
            .watch(
                self.key.as_str(),
                Some(WatchOptions::new().with_start_revision(revision + 1)),
            )
            .await?;
        while let Some(resp) = watch.message().await? {
            if resp.canceled() {
                break;
            }
            for ev in resp.events() {
                if let (EventType::Put, Some(kv)) = (ev.event_type(), ev.kv()) {
                    return Ok(kv.value_str()?.to_string());
                }
            }
        }
        Err(etcd_client::Error::WatchError(
            "drain key watch ended".into(),
        ))
    }

    /// Deletes the key (best effort: the control plane can clean up after a
    /// worker that could not).
    pub async fn remove(&self) {
        let deleted = async {
            let mut client = etcd::connect(&self.endpoints, self.tls.as_ref(), REQUESTS).await?;
            client.delete(self.key.as_str(), None).await
        };
        match tokio::time::timeout(Duration::from_secs(5), deleted).await {
            Ok(Ok(_)) => tracing::info!(key = %self.key, "drain key removed"),
            Ok(Err(e)) => {
                tracing::warn!(key = %self.key, error = %e, "could not remove the drain key")
            }
            Err(_) => {
                tracing::warn!(key = %self.key, "could not remove the drain key: etcd timed out")
            }
        }
    }
}
