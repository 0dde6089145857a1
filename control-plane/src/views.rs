//! Read-only views of the mesh built from store snapshots: the worker list
//! (registration, drain, and load as the routers see it) and the per-version
//! status table, whose rates come from a short history of snapshots.
use crate::analysis;
use crate::records::State;
use crate::store::{Snapshot, Store, TimedSnapshot};
use std::collections::{BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokenmesh_proto::records::PolicyRecord;
use tokenmesh_proto::v1;
use tokenmesh_runtime::Readiness;

/// Snapshots sampled in the background, for rates over a window.
#[derive(Clone, Default)]
pub struct History {
    samples: Arc<Mutex<VecDeque<TimedSnapshot>>>,
}

/// The readiness condition of a control plane that cannot read etcd.
pub const ETCD: &str = "etcd";

impl History {
    /// Samples `store` every `every`, keeping `window` of history (this also
    /// keeps the stale-read cache warm); each read's outcome sets the
    /// [`ETCD`] condition of `readiness`.
    pub fn spawn(
        &self,
        store: Store,
        every: Duration,
        window: Duration,
        readiness: Readiness,
    ) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                match store.read_live().await {
                    Ok(s) => {
                        readiness.ready(ETCD);
                        this.record(s, window);
                    }
                    Err(e) => readiness.not_ready(ETCD, e.to_string()),
                }
            }
        })
    }

    /// Adds a sample, dropping those older than `window`.
    pub fn record(&self, snapshot: Arc<Snapshot>, window: Duration) {
        let mut s = self.samples.lock().expect("history lock");
        let now = Instant::now();
        s.push_back((now, snapshot));
        while s.len() > 2 && s.front().is_some_and(|(t, _)| now - *t > window) {
            s.pop_front();
        }
    }

    /// The oldest sample, if any.
    fn oldest(&self) -> Option<TimedSnapshot> {
        self.samples.lock().expect("history lock").front().cloned()
    }
}

/// The worker list, optionally for one model.
pub fn workers(snapshot: &Snapshot, model: &str) -> Vec<v1::WorkerInfo> {
    let mut out: Vec<v1::WorkerInfo> = snapshot
        .workers
        .iter()
        .filter(|w| model.is_empty() || w.model == model)
        .map(|w| worker_info(snapshot, &w.worker_id).expect("registered worker"))
        .collect();
    out.sort_by(|a, b| {
        (&a.model, &a.version, &a.worker_id).cmp(&(&b.model, &b.version, &b.worker_id))
    });
    out
}

/// One registered worker's row, or None when it is not registered.
pub fn worker_info(snapshot: &Snapshot, worker_id: &str) -> Option<v1::WorkerInfo> {
    let w = snapshot.workers.iter().find(|w| w.worker_id == worker_id)?;
    let mut info = v1::WorkerInfo {
        worker_id: w.worker_id.clone(),
        model: w.model.clone(),
        version: w.version.clone(),
        addr: w.record.addr.clone(),
        accelerator: w.record.accelerator.clone(),
        device: w.record.device.clone(),
        capacity: w.record.capacity,
        started_at: w.record.started_at.clone(),
        drain_reason: snapshot.drains.get(worker_id).cloned().unwrap_or_default(),
        ..Default::default()
    };
    for s in &snapshot.stats {
        if let Some(view) = s.record.workers.get(worker_id) {
            info.seen_by_routers += 1;
            info.healthy_routers += u32::from(view.healthy);
            info.in_flight += view.in_flight;
            info.queue_depth = info.queue_depth.max(view.queue_depth);
        }
    }
    Some(info)
}

/// The status table: one row per model version, with rates over the window
/// since the oldest sampled snapshot (the second value, in seconds).
pub fn mesh_status(
    snapshot: &Snapshot,
    history: &History,
    model: &str,
) -> (Vec<v1::VersionStatus>, f64) {
    let (base_snapshot, window_s) = match history.oldest() {
        Some((at, s)) if s.revision < snapshot.revision => (s, at.elapsed().as_secs_f64()),
        _ => (Arc::new(Snapshot::default()), 0.0),
    };
    let mut rows = Vec::new();
    for m in snapshot.models() {
        if !model.is_empty() && m != model {
            continue;
        }
        let policy = snapshot.policies.get(&m).map(|p| &p.value);
        let now = snapshot.counters(&m);
        let base = base_snapshot.counters(&m);
        let rollout = rollout_label(snapshot, &m);
        for v in versions(snapshot, &m, policy) {
            let (role, weight) = role_and_weight(policy, &v);
            let (ready, registered) = worker_counts(snapshot, &m, &v);
            let w = analysis::window(&now, &base, &v);
            let rps = if window_s > 0.0 {
                w.requests as f64 / window_s
            } else {
                0.0
            };
            rows.push(v1::VersionStatus {
                model: m.clone(),
                version: v,
                role: role.into(),
                weight,
                ready_workers: ready,
                registered_workers: registered,
                requests_per_second: rps,
                error_rate: w.error_rate(),
                ttft_p99_ms: w.ttft_p99_ms(),
                rollout: rollout.clone(),
            });
        }
    }
    (rows, window_s)
}

/// The versions of `model` worth a row, sorted: those with registered workers
/// and those the policy names, even with no worker (a policy pointing at
/// nothing is what an operator needs to see).
fn versions(snapshot: &Snapshot, model: &str, policy: Option<&PolicyRecord>) -> BTreeSet<String> {
    let mut versions: BTreeSet<String> = snapshot.registered_versions(model).into_iter().collect();
    if let Some(p) = policy {
        versions.insert(p.stable.clone());
        if let Some(c) = &p.canary {
            versions.insert(c.version.clone());
        }
    }
    versions
}

/// The role `version` plays in the policy and the traffic share it gets.
fn role_and_weight(policy: Option<&PolicyRecord>, version: &str) -> (&'static str, u32) {
    match policy {
        Some(p) if p.canary.as_ref().is_some_and(|c| c.version == version) => {
            let w = p.canary.as_ref().map(|c| c.weight).unwrap_or(0);
            ("canary", w)
        }
        Some(p) if p.stable == version => {
            let canary = p.canary.as_ref().map(|c| c.weight).unwrap_or(0);
            ("stable", 100 - canary.min(100))
        }
        _ => ("", 0),
    }
}

/// (ready, registered) workers of one version: ready means not drained and
/// healthy, not draining, in at least one router's view.
fn worker_counts(snapshot: &Snapshot, model: &str, version: &str) -> (u32, u32) {
    let registered: Vec<_> = snapshot
        .workers
        .iter()
        .filter(|w| w.model == model && w.version == version)
        .collect();
    let ready = registered
        .iter()
        .filter(|w| !snapshot.drains.contains_key(&w.worker_id))
        .filter(|w| {
            snapshot.stats.iter().any(|s| {
                s.record
                    .workers
                    .get(&w.worker_id)
                    .is_some_and(|view| view.healthy && !view.draining)
            })
        })
        .count();
    (ready as u32, registered.len() as u32)
}

/// "step N/M at W%" for a running rollout of `model`; empty otherwise.
fn rollout_label(snapshot: &Snapshot, model: &str) -> String {
    snapshot
        .rollouts
        .get(model)
        .filter(|r| r.value.state == State::Running)
        .map(|r| {
            format!(
                "step {}/{} at {}%",
                r.value.step + 1,
                r.value.steps.len(),
                r.value.weight()
            )
        })
        .unwrap_or_default()
}
