//! What this router saw of each model version, for the control plane's canary
//! analysis (DESIGN.md, `stats/{router_id}/{model}/{version}`).
//!
//! Counting is per upstream attempt, by the version of the worker attempted:
//! every call to a worker is one request of its version; an attempt that
//! fails on the serving side (a worker error status, a broken stream, a
//! deadline) is one error of that version, also when the router then retries
//! or fails over to another worker. A client that cancels causes no error.
//! The time to first token, from when the router received the request, is
//! recorded once per client request, against the attempt that delivered it.
//!
//! Which outcome is an error is the shared table of
//! [`tokenmesh_proto::codes::classify`].
//!
//! `publish` writes the snapshots to etcd under the router's lease. The
//! stats learn the workers of each version through [`WorkerViews`], which the
//! registry implements, so the dependency runs one way: registry → stats.
pub mod publish;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokenmesh_proto::codes::classify;
use tokenmesh_proto::records::{StatsRecord, WorkerView, TTFT_BUCKETS_MS};
use tonic::Code;

/// The workers behind each version as the router sees them, for the
/// `workers` field of the published records.
pub trait WorkerViews: Send + Sync {
    /// (model, version) → worker id → view, for every registered worker.
    fn worker_views(&self) -> BTreeMap<(String, String), BTreeMap<String, WorkerView>>;
}

/// Cumulative counters of one model version.
#[derive(Debug)]
pub struct VersionCounters {
    requests: AtomicU64,
    errors: AtomicU64,
    /// One per bucket of [`TTFT_BUCKETS_MS`], plus one above the largest.
    ttft: Vec<AtomicU64>,
}

impl Default for VersionCounters {
    fn default() -> Self {
        Self {
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            ttft: (0..=TTFT_BUCKETS_MS.len())
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }
}

/// The bucket of [`TTFT_BUCKETS_MS`] a time to first token falls in: the
/// first whose upper bound is at least `ms`, else the last (above them all).
pub fn ttft_bucket(ms: f64) -> usize {
    TTFT_BUCKETS_MS
        .iter()
        .position(|&bound| ms <= bound)
        .unwrap_or(TTFT_BUCKETS_MS.len())
}

/// Every version's counters since this router started.
#[derive(Debug)]
pub struct Stats {
    started_at_ms: u64,
    versions: Mutex<BTreeMap<(String, String), Arc<VersionCounters>>>,
}

impl Default for Stats {
    fn default() -> Self {
        Self {
            started_at_ms: unix_ms(),
            versions: Mutex::new(BTreeMap::new()),
        }
    }
}

impl Stats {
    /// Counts one attempt on a worker of `model`/`version`; its outcome is
    /// recorded through the returned [`Attempt`].
    pub fn attempt(&self, model: &str, version: &str) -> Attempt {
        let counters = self
            .versions
            .lock()
            .expect("stats lock")
            .entry((model.to_string(), version.to_string()))
            .or_default()
            .clone();
        counters.requests.fetch_add(1, Ordering::Relaxed);
        Attempt {
            counters,
            failed: false,
        }
    }

    /// One record per version that has counters or registered workers.
    pub fn snapshot(&self, workers: &dyn WorkerViews) -> BTreeMap<(String, String), StatsRecord> {
        let now = unix_ms();
        let empty = || StatsRecord {
            started_at_ms: self.started_at_ms,
            updated_at_ms: now,
            ttft_counts: vec![0; TTFT_BUCKETS_MS.len() + 1],
            ..Default::default()
        };
        let mut out = BTreeMap::new();
        for (key, c) in self.versions.lock().expect("stats lock").iter() {
            out.insert(
                key.clone(),
                StatsRecord {
                    requests: c.requests.load(Ordering::Relaxed),
                    errors: c.errors.load(Ordering::Relaxed),
                    ttft_counts: c.ttft.iter().map(|b| b.load(Ordering::Relaxed)).collect(),
                    ..empty()
                },
            );
        }
        for (key, views) in workers.worker_views() {
            out.entry(key).or_insert_with(empty).workers = views;
        }
        out
    }
}

/// One upstream attempt, already counted as a request of its version.
#[derive(Debug)]
pub struct Attempt {
    counters: Arc<VersionCounters>,
    failed: bool,
}

impl Attempt {
    /// The attempt ended with `code`; a serving-side failure counts one error
    /// (at most one per attempt).
    pub fn ended(&mut self, code: Code) {
        if !self.failed && classify(code).is_serving_error() {
            self.failed = true;
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// This attempt delivered the request's first token, `ttft` after the
    /// router received the request.
    pub fn first_token(&self, ttft: Duration) {
        let bucket = ttft_bucket(ttft.as_secs_f64() * 1000.0);
        self.counters.ttft[bucket].fetch_add(1, Ordering::Relaxed);
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_upper_bounds_inclusive_with_an_overflow_bucket() {
        assert_eq!(ttft_bucket(0.0), 0);
        assert_eq!(ttft_bucket(5.0), 0);
        assert_eq!(ttft_bucket(5.01), 1);
        assert_eq!(ttft_bucket(250.0), 5);
        assert_eq!(ttft_bucket(1100.0), 8);
        assert_eq!(ttft_bucket(30_000.0), TTFT_BUCKETS_MS.len() - 1);
        assert_eq!(ttft_bucket(30_000.5), TTFT_BUCKETS_MS.len());
        assert_eq!(ttft_bucket(f64::INFINITY), TTFT_BUCKETS_MS.len());
    }

    #[test]
    fn attempts_count_per_version_and_errors_once_per_attempt() {
        let stats = Stats::default();
        let mut a = stats.attempt("m", "v1");
        a.ended(Code::Internal);
        a.ended(Code::Unavailable);
        let mut b = stats.attempt("m", "v1");
        b.first_token(Duration::from_millis(30));
        b.ended(Code::Ok);
        let mut c = stats.attempt("m", "v2");
        c.ended(Code::Cancelled);
        let versions = stats.versions.lock().unwrap();
        assert_eq!(versions.len(), 2);
        let v1 = &versions[&("m".to_string(), "v1".to_string())];
        assert_eq!(v1.requests.load(Ordering::Relaxed), 2);
        assert_eq!(v1.errors.load(Ordering::Relaxed), 1);
        let ttft: Vec<u64> = v1.ttft.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        assert_eq!(ttft.len(), TTFT_BUCKETS_MS.len() + 1);
        assert_eq!(ttft.iter().sum::<u64>(), 1);
        assert_eq!(ttft[3], 1, "30 ms is in the (25, 50] bucket");
        let v2 = &versions[&("m".to_string(), "v2".to_string())];
        assert_eq!(v2.requests.load(Ordering::Relaxed), 1);
        assert_eq!(v2.errors.load(Ordering::Relaxed), 0);
    }

    struct OneWorker;

    impl WorkerViews for OneWorker {
        fn worker_views(&self) -> BTreeMap<(String, String), BTreeMap<String, WorkerView>> {
            let view = WorkerView {
                healthy: true,
                draining: false,
                in_flight: 2,
                queue_depth: 1,
            };
            BTreeMap::from([(
                ("m".to_string(), "v3".to_string()),
                BTreeMap::from([("w1".to_string(), view)]),
            )])
        }
    }

    #[test]
    fn snapshots_cover_versions_with_traffic_or_workers() {
        let stats = Stats::default();
        stats.attempt("m", "v1").ended(Code::Unavailable);
        let snap = stats.snapshot(&OneWorker);
        let v1 = &snap[&("m".to_string(), "v1".to_string())];
        assert_eq!((v1.requests, v1.errors), (1, 1));
        assert!(v1.workers.is_empty());
        let v3 = &snap[&("m".to_string(), "v3".to_string())];
        assert_eq!((v3.requests, v3.errors), (0, 0));
        assert_eq!(v3.ttft_counts, vec![0; TTFT_BUCKETS_MS.len() + 1]);
        assert_eq!(v3.workers["w1"].in_flight, 2);
    }
}
