//! etcd discovery: read `workers/`, `models/` and `drain/` at one revision,
//! then watch them from the next revision, so no change between the read and the watch is
//! missed. If etcd goes away the registry keeps the last known state; on
//! reconnection everything is read again and stale entries are dropped.
use crate::registry::Registry;
use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use std::collections::HashSet;
use std::sync::Arc;
use tokenmesh_certs::tls::TlsPaths;
use tokenmesh_proto::keys::Keys;
use tokenmesh_proto::records::{PolicyRecord, WorkerRecord};
use tokenmesh_runtime::backoff::Retries;
use tokenmesh_runtime::etcd;
use tokenmesh_runtime::Backoff;

/// Runs discovery forever. With `tls`, connects to etcd with mutual TLS.
pub async fn run(
    endpoints: Vec<String>,
    keys: Keys,
    registry: Arc<Registry>,
    tls: Option<TlsPaths>,
) {
    let mut backoff = Backoff::RECONNECT.retries();
    loop {
        // It returns only when the connection or a watch fails.
        let Err(e) = sync_and_watch(&endpoints, &keys, &registry, tls.as_ref(), &mut backoff).await;
        tracing::warn!(error = %e, "etcd discovery interrupted; keeping the last known state");
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

/// Reads the snapshot, then follows the watches until one fails (the only
/// way it returns); a read snapshot resets `backoff`, so a later outage
/// starts again from short waits.
async fn sync_and_watch(
    endpoints: &[String],
    keys: &Keys,
    registry: &Registry,
    tls: Option<&TlsPaths>,
    backoff: &mut Retries,
) -> Result<std::convert::Infallible, etcd_client::Error> {
    let mut client = etcd::connect(endpoints, tls, etcd::Use::Streams).await?;
    let revision = load_snapshot(&mut client, keys, registry).await?;
    backoff.reset();
    let watch_from = || {
        WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1)
    };
    let mut worker_watch = client
        .watch(keys.workers_prefix(), Some(watch_from()))
        .await?;
    let mut model_watch = client
        .watch(keys.models_prefix(), Some(watch_from()))
        .await?;
    let mut drain_watch = client
        .watch(keys.drain_prefix(), Some(watch_from()))
        .await?;
    loop {
        let resp = tokio::select! {
            r = worker_watch.message() => r?,
            r = model_watch.message() => r?,
            r = drain_watch.message() => r?,
        };
        let Some(resp) = resp else {
            return Err(etcd_client::Error::WatchError("watch stream ended".into()));
        };
        if resp.canceled() {
            return Err(etcd_client::Error::WatchError(format!(
                "watch cancelled: {}",
                resp.cancel_reason()
            )));
        }
        for ev in resp.events() {
            if let Some(kv) = ev.kv() {
                apply_event(keys, registry, ev.event_type(), kv.key_str()?, kv.value());
            }
        }
    }
}

/// Reads workers, policies and drain requests at one revision into the
/// registry, dropping what is gone; the revision, to watch from.
async fn load_snapshot(
    client: &mut Client,
    keys: &Keys,
    registry: &Registry,
) -> Result<i64, etcd_client::Error> {
    let workers = client
        .get(keys.workers_prefix(), Some(GetOptions::new().with_prefix()))
        .await?;
    let revision = workers.header().map(|h| h.revision()).unwrap_or(0);
    // Read policies and drain requests at the same revision as the workers.
    let at_revision = || GetOptions::new().with_prefix().with_revision(revision);
    let models = client
        .get(keys.models_prefix(), Some(at_revision()))
        .await?;
    let drains = client.get(keys.drain_prefix(), Some(at_revision())).await?;
    // Drain requests first, so a worker that has one is never ready for a moment.
    let mut drained = HashSet::new();
    for kv in drains.kvs() {
        if let Some(id) = keys.parse_drain(kv.key_str()?) {
            drained.insert(id.to_string());
        }
    }
    registry.set_drained(drained.clone());
    let mut seen_workers = HashSet::new();
    for kv in workers.kvs() {
        if let Some(id) = apply_worker_put(keys, registry, kv.key_str()?, kv.value()) {
            seen_workers.insert(id);
        }
    }
    registry.retain_workers(&seen_workers);
    let mut seen_models = HashSet::new();
    for kv in models.kvs() {
        if let Some(m) = apply_policy_put(keys, registry, kv.key_str()?, kv.value()) {
            seen_models.insert(m);
        }
    }
    registry.retain_policies(&seen_models);
    registry.mark_loaded();
    tracing::info!(
        revision,
        workers = seen_workers.len(),
        policies = seen_models.len(),
        drained = drained.len(),
        "etcd snapshot"
    );
    Ok(revision)
}

/// One watched change to a worker, policy or drain key.
fn apply_event(keys: &Keys, registry: &Registry, kind: EventType, key: &str, value: &[u8]) {
    match kind {
        EventType::Put => {
            apply_worker_put(keys, registry, key, value);
            apply_policy_put(keys, registry, key, value);
            if let Some(id) = keys.parse_drain(key) {
                registry.set_drain(id, true);
            }
        }
        EventType::Delete => {
            if let Some((_, _, id)) = keys.parse_worker(key) {
                registry.remove_worker(id);
            } else if let Some(model) = keys.parse_policy(key) {
                registry.set_policy(model, None);
            } else if let Some(id) = keys.parse_drain(key) {
                registry.set_drain(id, false);
            }
        }
    }
}

fn apply_worker_put(keys: &Keys, registry: &Registry, key: &str, value: &[u8]) -> Option<String> {
    let (model, version, id) = keys.parse_worker(key)?;
    match serde_json::from_slice::<WorkerRecord>(value) {
        Ok(record) => match registry.upsert_worker(id, model, version, record) {
            Ok(()) => Some(id.to_string()),
            Err(e) => {
                tracing::warn!(key, error = %e, "ignoring worker registration");
                None
            }
        },
        Err(e) => {
            tracing::warn!(key, error = %e, "ignoring malformed worker registration");
            None
        }
    }
}

/// Applies a policy key if it parses and passes the Control API's own checks
/// ([`PolicyRecord::validate`]: anyone with etcd access may have written
/// it); otherwise keeps the previous policy and says why. The model, when
/// the registry knows a policy for it afterwards (so a resynchronisation
/// keeps the last good one).
fn apply_policy_put(keys: &Keys, registry: &Registry, key: &str, value: &[u8]) -> Option<String> {
    let model = keys.parse_policy(key)?;
    let refused = match serde_json::from_slice::<PolicyRecord>(value) {
        Ok(p) => match p.validate() {
            Ok(()) => {
                registry.set_policy(model, Some(p));
                return Some(model.to_string());
            }
            Err(e) => e.to_string(),
        },
        Err(e) => format!("malformed JSON: {e}"),
    };
    let keeping = registry.policy(model);
    tracing::warn!(key, error = %refused, previous = ?keeping, "ignoring invalid traffic policy; keeping the previous one");
    keeping.map(|_| model.to_string())
}
