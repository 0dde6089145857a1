//! The control plane's view of etcd: one consistent snapshot of every key it
//! reads, taken in a single range read, and compare-and-swap writes.
//!
//! Reads fall back to the last good snapshot when etcd is unreachable and say
//! how old it is; writes never fall back (UNAVAILABLE). Each etcd member has
//! a client of its own: a read goes on to the next member when one is
//! unavailable, a write when it could not be sent.
use crate::records::{ByIncarnation, Counters, RolloutRecord};
use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokenmesh_proto::keys::Keys;
use tokenmesh_proto::records::{PolicyRecord, StatsRecord, WorkerRecord};
use tokenmesh_runtime::etcd::{self, Retry};

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("etcd is unreachable: {0}")]
    Unavailable(String),
    #[error("{key} changed since it was read (expected revision {expected}, now {current}); read it again and retry")]
    Conflict {
        key: String,
        expected: i64,
        current: i64,
    },
    #[error("cannot encode {0}")]
    Encode(#[from] serde_json::Error),
}

impl From<etcd_client::Error> for StoreError {
    fn from(e: etcd_client::Error) -> Self {
        StoreError::Unavailable(e.to_string())
    }
}

/// A value with the etcd revision it was last modified at.
#[derive(Clone, Debug)]
pub struct Versioned<T> {
    pub value: T,
    pub mod_revision: i64,
}

impl<T> Versioned<T> {
    /// `value` as stored at `mod_revision`.
    pub fn at(value: T, mod_revision: i64) -> Self {
        Self {
            value,
            mod_revision,
        }
    }
}

/// A worker registration.
#[derive(Clone, Debug)]
pub struct Registered {
    pub model: String,
    pub version: String,
    pub worker_id: String,
    pub record: WorkerRecord,
}

/// What one router published about one version.
#[derive(Clone, Debug)]
pub struct RouterStats {
    pub router_id: String,
    pub model: String,
    pub version: String,
    pub record: StatsRecord,
}

/// Every key the control plane reads, at one revision.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub revision: i64,
    pub workers: Vec<Registered>,
    pub policies: BTreeMap<String, Versioned<PolicyRecord>>,
    /// The revisions of stored policies that are malformed or fail
    /// validation (logged and left out of `policies`), by model.
    pub invalid_policies: BTreeMap<String, i64>,
    /// Drain reason by worker id.
    pub drains: BTreeMap<String, String>,
    pub stats: Vec<RouterStats>,
    pub rollouts: BTreeMap<String, Versioned<RolloutRecord>>,
}

impl Snapshot {
    /// Versions with at least one registered worker, by model.
    pub fn registered_versions(&self, model: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .workers
            .iter()
            .filter(|w| w.model == model)
            .map(|w| w.version.clone())
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Whether the model is known at all: it has a policy or registered workers.
    pub fn knows_model(&self, model: &str) -> bool {
        self.policies.contains_key(model) || self.workers.iter().any(|w| w.model == model)
    }

    /// Every model name the snapshot mentions, sorted.
    pub fn models(&self) -> Vec<String> {
        let mut m: Vec<String> = self
            .policies
            .keys()
            .cloned()
            .chain(self.workers.iter().map(|w| w.model.clone()))
            .collect();
        m.sort();
        m.dedup();
        m
    }

    /// The counters every router published for `model`, by router incarnation
    /// (`router_id@started_at_ms`, so a restarted router counts afresh).
    pub fn counters(&self, model: &str) -> ByIncarnation {
        let mut out = ByIncarnation::new();
        for s in self.stats.iter().filter(|s| s.model == model) {
            let key = format!("{}@{}", s.router_id, s.record.started_at_ms);
            out.entry(key).or_default().insert(
                s.version.clone(),
                Counters {
                    requests: s.record.requests,
                    errors: s.record.errors,
                    ttft_counts: s.record.ttft_counts.clone(),
                },
            );
        }
        out
    }
}

/// How fresh a read is.
#[derive(Clone, Debug, Default)]
pub struct Freshness {
    pub stale: bool,
    pub age: Duration,
    pub reason: String,
}

impl From<Freshness> for tokenmesh_proto::v1::Freshness {
    fn from(f: Freshness) -> Self {
        Self {
            stale: f.stale,
            age_ms: f.age.as_millis() as u64,
            reason: f.reason,
        }
    }
}

/// A snapshot with the moment it was read.
pub type TimedSnapshot = (Instant, Arc<Snapshot>);

/// One key to change in a [`Store::commit`]: written only if its revision is
/// still `expected` (0: the key must not exist).
pub struct Guarded {
    pub key: String,
    pub expected: i64,
    /// New value; `None` deletes the key.
    pub value: Option<String>,
}

/// etcd access for the control plane.
#[derive(Clone)]
pub struct Store {
    members: etcd::Members,
    keys: Keys,
    last: Arc<Mutex<Option<TimedSnapshot>>>,
}

/// How long one etcd request may take before the read falls back to the cache.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

impl Store {
    /// A store on `endpoints`; the connection is made lazily and re-made by
    /// the client when etcd comes back.
    pub async fn connect(
        endpoints: &[String],
        keys: Keys,
        tls: Option<&tokenmesh_certs::tls::TlsPaths>,
    ) -> Result<Self, StoreError> {
        let members = etcd::Members::connect(endpoints, tls, REQUEST_TIMEOUT).await?;
        Ok(Self {
            members,
            keys,
            last: Arc::new(Mutex::new(None)),
        })
    }

    /// The key layout.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// A fresh snapshot from etcd, or the last good one with its age when
    /// etcd cannot be read. Err only when nothing was ever read.
    pub async fn read(&self) -> Result<(Arc<Snapshot>, Freshness), StoreError> {
        match self.read_live().await {
            Ok(s) => Ok((s, Freshness::default())),
            Err(e) => {
                let last = self.last.lock().expect("snapshot cache lock").clone();
                match last {
                    Some((at, snap)) => Ok((
                        snap,
                        Freshness {
                            stale: true,
                            age: at.elapsed(),
                            reason: e.to_string(),
                        },
                    )),
                    None => Err(e),
                }
            }
        }
    }

    /// A snapshot from etcd now; never the cache.
    pub async fn read_live(&self) -> Result<Arc<Snapshot>, StoreError> {
        let prefix = self.keys.root();
        let prefix = prefix.as_str();
        let resp = self
            .members
            .send(Retry::Read, |mut c| async move {
                c.get(prefix, Some(GetOptions::new().with_prefix())).await
            })
            .await?;
        let mut snap = Snapshot {
            revision: resp.header().map(|h| h.revision()).unwrap_or(0),
            ..Default::default()
        };
        for kv in resp.kvs() {
            let Ok(key) = kv.key_str() else { continue };
            self.parse_into(&mut snap, key, kv.value(), kv.mod_revision());
        }
        let snap = Arc::new(snap);
        *self.last.lock().expect("snapshot cache lock") = Some((Instant::now(), snap.clone()));
        Ok(snap)
    }

    /// One model's rollout from etcd now (a single key, for watchers that
    /// poll), or `None` when it has none.
    pub async fn rollout(
        &self,
        model: &str,
    ) -> Result<Option<Versioned<RolloutRecord>>, StoreError> {
        let key = self.keys.rollout(model);
        let key = key.as_str();
        let resp = self
            .members
            .send(Retry::Read, |mut c| async move { c.get(key, None).await })
            .await?;
        let Some(kv) = resp.kvs().first() else {
            return Ok(None);
        };
        Ok(Some(Versioned {
            value: serde_json::from_slice(kv.value())?,
            mod_revision: kv.mod_revision(),
        }))
    }

    fn parse_into(&self, snap: &mut Snapshot, key: &str, value: &[u8], rev: i64) {
        let k = &self.keys;
        if let Some((model, version, id)) = k.parse_worker(key) {
            if let Some(record) = parsed(key, value, "worker registration") {
                snap.workers.push(Registered {
                    model: model.into(),
                    version: version.into(),
                    worker_id: id.into(),
                    record,
                });
            }
        } else if let Some(model) = k.parse_policy(key) {
            // Checked as SetPolicy checks it: the key may have been written
            // straight into etcd.
            let policy = parsed::<PolicyRecord>(key, value, "traffic policy").filter(|p| {
                p.validate()
                    .map_err(|e| tracing::warn!(key, error = %e, "ignoring invalid traffic policy"))
                    .is_ok()
            });
            match policy {
                Some(p) => {
                    snap.policies.insert(model.into(), Versioned::at(p, rev));
                }
                None => {
                    snap.invalid_policies.insert(model.into(), rev);
                }
            }
        } else if let Some(id) = k.parse_drain(key) {
            snap.drains
                .insert(id.into(), String::from_utf8_lossy(value).into_owned());
        } else if let Some((router, model, version)) = k.parse_stats(key) {
            if let Some(record) = parsed(key, value, "router stats") {
                snap.stats.push(RouterStats {
                    router_id: router.into(),
                    model: model.into(),
                    version: version.into(),
                    record,
                });
            }
        } else if let Some(model) = k.parse_rollout(key) {
            if let Some(rollout) = parsed(key, value, "rollout record") {
                snap.rollouts
                    .insert(model.into(), Versioned::at(rollout, rev));
            }
        }
    }

    /// Applies every change at once if every key still has its expected
    /// revision; otherwise changes nothing and reports the first conflict.
    /// Returns the new store revision.
    pub async fn commit(&self, changes: Vec<Guarded>) -> Result<i64, StoreError> {
        let compares: Vec<Compare> = changes
            .iter()
            .map(|c| {
                if c.expected == 0 {
                    Compare::version(c.key.as_str(), CompareOp::Equal, 0)
                } else {
                    Compare::mod_revision(c.key.as_str(), CompareOp::Equal, c.expected)
                }
            })
            .collect();
        let ops: Vec<TxnOp> = changes
            .iter()
            .map(|c| match &c.value {
                Some(v) => TxnOp::put(c.key.as_str(), v.as_str(), None),
                None => TxnOp::delete(c.key.as_str(), None),
            })
            .collect();
        let reads: Vec<TxnOp> = changes
            .iter()
            .map(|c| TxnOp::get(c.key.as_str(), None))
            .collect();
        let txn = Txn::new().when(compares).and_then(ops).or_else(reads);
        let resp = self
            .members
            .send(Retry::Write, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        if resp.succeeded() {
            return Ok(resp.header().map(|h| h.revision()).unwrap_or(0));
        }
        for (change, op) in changes.iter().zip(resp.op_responses()) {
            if let etcd_client::TxnOpResponse::Get(g) = op {
                let current = g.kvs().first().map(|kv| kv.mod_revision()).unwrap_or(0);
                if current != change.expected {
                    return Err(StoreError::Conflict {
                        key: change.key.clone(),
                        expected: change.expected,
                        current,
                    });
                }
            }
        }
        Err(StoreError::Conflict {
            key: changes.first().map(|c| c.key.clone()).unwrap_or_default(),
            expected: changes.first().map(|c| c.expected).unwrap_or_default(),
            current: -1,
        })
    }

    /// Writes a key without a guard (drain requests, whose value is only a reason).
    pub async fn put(&self, key: &str, value: &str) -> Result<(), StoreError> {
        self.members
            .send(Retry::Write, |mut c| async move {
                c.put(key, value, None).await
            })
            .await?;
        Ok(())
    }

    /// Deletes a key without a guard.
    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.members
            .send(
                Retry::Write,
                |mut c| async move { c.delete(key, None).await },
            )
            .await?;
        Ok(())
    }
}

/// A stored JSON record, or None (logged) if it is malformed: one bad key
/// must not hide the rest of the snapshot.
fn parsed<T: serde::de::DeserializeOwned>(key: &str, value: &[u8], what: &str) -> Option<T> {
    serde_json::from_slice(value)
        .map_err(|e| tracing::warn!(key, error = %e, "ignoring malformed {what}"))
        .ok()
}
