//! Draining: on SIGTERM or the worker's drain key, stop taking work, report
//! not ready (NOT_SERVING on grpc.health, 503 on /readyz), deregister, let in-flight streams finish (bounded by the
//! drain timeout), then let the server stop.
use crate::drain_key::DrainKey;
use crate::scheduler::EngineStats;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenmesh_runtime::Readiness;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// Everything a drain touches.
pub struct Drain {
    /// The etcd drain key to watch, with etcd.
    pub key: Option<DrainKey>,
    /// How long in-flight streams may take.
    pub timeout: Duration,
    /// After a drain key: stay up, drained, until stopped.
    pub stay_drained: bool,
    pub stats: Arc<EngineStats>,
    /// Set not ready for the whole drain.
    pub readiness: Readiness,
    /// Tells the registration task to delete the key and revoke the lease.
    pub deregister: watch::Sender<bool>,
    pub registration: Option<JoinHandle<()>>,
}

impl Drain {
    /// Waits for `shutdown` or the drain key, drains, then sends on `stop`.
    pub async fn run(self, shutdown: impl Future<Output = ()>, stop: oneshot::Sender<()>) {
        let mut shutdown = Box::pin(shutdown);
        let by_key = match &self.key {
            Some(key) => tokio::select! {
                _ = &mut shutdown => false,
                reason = key.requested() => {
                    tracing::info!(key = %key.key, reason = %reason, "drain requested through etcd");
                    true
                }
            },
            None => {
                (&mut shutdown).await;
                false
            }
        };
        tracing::info!("draining: no new requests; finishing in-flight streams");
        self.stats.draining.store(true, Ordering::SeqCst);
        self.readiness.not_ready("drain", "draining");
        let _ = self.deregister.send(true);
        self.wait_for_streams().await;
        if let Some(reg) = self.registration {
            let _ = tokio::time::timeout(Duration::from_secs(3), reg).await;
        }
        if by_key {
            if self.stay_drained {
                tracing::info!("drained; staying up until stopped (--stay-drained)");
                shutdown.await;
            }
            if let Some(key) = &self.key {
                key.remove().await;
            }
        }
        let _ = stop.send(());
    }

    /// Until no sequence is running or waiting, or the timeout.
    async fn wait_for_streams(&self) {
        let deadline = Instant::now() + self.timeout;
        let busy = || {
            self.stats.active.load(Ordering::SeqCst) > 0
                || self.stats.queued.load(Ordering::SeqCst) > 0
        };
        while busy() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
