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
//!
//! A version that has had no traffic for a retention time
//! (`--stats-retention-s`) and is neither
//! registered nor named by a policy is dropped from the snapshots, and its
//! counters with it, so that a long-lived router does not publish every
//! version it ever served. Should it come back, its counters begin again
//! from zero under a new `started_at_ms`, which readers take for a new
//! series (the control plane's windows count such a series whole).
pub mod publish;

use std::collections::{BTreeMap, BTreeSet};
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

    /// (model, version) of every version a traffic policy names (stable or
    /// canary): their stats are kept while idle.
    fn policy_versions(&self) -> BTreeSet<(String, String)>;
}

/// Cumulative counters of one model version.
#[derive(Debug)]
pub struct VersionCounters {
    /// Unix milliseconds when these counters began.
    started_at_ms: u64,
    /// Unix milliseconds of the last attempt counted.
    used_at_ms: AtomicU64,
    requests: AtomicU64,
    errors: AtomicU64,
    /// One per bucket of [`TTFT_BUCKETS_MS`], plus one above the largest.
    ttft: Vec<AtomicU64>,
}

impl VersionCounters {
    fn new(started_at_ms: u64) -> Self {
        Self {
            started_at_ms,
            used_at_ms: AtomicU64::new(started_at_ms),
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

/// Every version's counters since this router started, less those of
/// versions gone idle (see the module's documentation).
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
        let now = unix_ms();
        let counters = self
            .versions
            .lock()
            .expect("stats lock")
            .entry((model.to_string(), version.to_string()))
            .or_insert_with(|| Arc::new(VersionCounters::new(now.max(self.started_at_ms))))
            .clone();
        counters.used_at_ms.store(now, Ordering::Relaxed);
        counters.requests.fetch_add(1, Ordering::Relaxed);
        Attempt {
            counters,
            failed: false,
        }
    }

    /// One record per version that has counters or registered workers,
    /// after dropping the counters of versions idle for `retention` that no
    /// worker or policy has.
    pub fn snapshot(
        &self,
        workers: &dyn WorkerViews,
        retention: Duration,
    ) -> BTreeMap<(String, String), StatsRecord> {
        self.snapshot_at(workers, retention, unix_ms())
    }

    fn snapshot_at(
        &self,
        workers: &dyn WorkerViews,
        retention: Duration,
        now: u64,
    ) -> BTreeMap<(String, String), StatsRecord> {
        let views = workers.worker_views();
        let policies = workers.policy_versions();
        let empty = || StatsRecord {
            started_at_ms: self.started_at_ms,
            updated_at_ms: now,
            ttft_counts: vec![0; TTFT_BUCKETS_MS.len() + 1],
            ..Default::default()
        };
        let retention = retention.as_millis() as u64;
        let mut out = BTreeMap::new();
        let mut versions = self.versions.lock().expect("stats lock");
        versions.retain(|key, c| {
            // An attempt still running holds the counters (a second Arc):
            // its outcome must not be lost.
            let idle = Arc::strong_count(c) == 1
                && now.saturating_sub(c.used_at_ms.load(Ordering::Relaxed)) >= retention;
            let keep = !idle || views.contains_key(key) || policies.contains(key);
            if !keep {
                tracing::debug!(model = %key.0, version = %key.1, "stats of an idle version dropped");
            }
            keep
        });
        for (key, c) in versions.iter() {
            out.insert(
                key.clone(),
                StatsRecord {
                    started_at_ms: c.started_at_ms,
                    requests: c.requests.load(Ordering::Relaxed),
                    errors: c.errors.load(Ordering::Relaxed),
                    ttft_counts: c.ttft.iter().map(|b| b.load(Ordering::Relaxed)).collect(),
                    ..empty()
                },
            );
        }
        drop(versions);
        for (key, views) in views {
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

        fn policy_versions(&self) -> BTreeSet<(String, String)> {
            BTreeSet::from([("m".to_string(), "stable".to_string())])
        }
    }

    const KEEP: Duration = Duration::from_secs(600);

    fn key(version: &str) -> (String, String) {
        ("m".to_string(), version.to_string())
    }

    #[test]
    fn an_idle_version_no_worker_or_policy_has_is_dropped_after_the_retention() {
        let stats = Stats::default();
        for v in ["gone", "v3", "stable", "busy"] {
            stats.attempt("m", v).ended(Code::Ok);
        }
        // "busy" has an attempt still running.
        let running = stats.attempt("m", "busy");
        let t0 = unix_ms();
        let snap = stats.snapshot_at(&OneWorker, KEEP, t0);
        assert_eq!(snap.len(), 4, "nothing is idle yet: {snap:?}");
        let gone_started = snap[&key("gone")].started_at_ms;
        assert!(gone_started >= stats.started_at_ms);

        // Just short of the retention: still there.
        let almost = t0 + KEEP.as_millis() as u64 - 1_000;
        assert!(stats
            .snapshot_at(&OneWorker, KEEP, almost)
            .contains_key(&key("gone")));

        // Past it, only the version nothing holds goes: v3 has a worker,
        // "stable" a policy, "busy" a running attempt.
        let later = t0 + KEEP.as_millis() as u64 + 1_000;
        let snap = stats.snapshot_at(&OneWorker, KEEP, later);
        let versions: Vec<&str> = snap.keys().map(|(_, v)| v.as_str()).collect();
        assert_eq!(versions, ["busy", "stable", "v3"]);
        assert_eq!(snap[&key("v3")].requests, 1, "kept with its counts");
        assert_eq!(
            stats.versions.lock().unwrap().len(),
            3,
            "the counters went too"
        );

        // Once the attempt ends and the time passes, "busy" goes as well.
        drop(running);
        let snap = stats.snapshot_at(&OneWorker, KEEP, later);
        assert!(!snap.contains_key(&key("busy")), "{snap:?}");

        // A version that comes back counts again from zero, as a new series.
        std::thread::sleep(Duration::from_millis(2));
        stats.attempt("m", "gone").ended(Code::Internal);
        let snap = stats.snapshot_at(&OneWorker, KEEP, unix_ms());
        let back = &snap[&key("gone")];
        assert_eq!((back.requests, back.errors), (1, 1));
        assert!(back.started_at_ms > gone_started, "{back:?}");
    }

    #[test]
    fn snapshots_cover_versions_with_traffic_or_workers() {
        let stats = Stats::default();
        stats.attempt("m", "v1").ended(Code::Unavailable);
        let snap = stats.snapshot(&OneWorker, KEEP);
        let v1 = &snap[&("m".to_string(), "v1".to_string())];
        assert_eq!((v1.requests, v1.errors), (1, 1));
        assert!(v1.workers.is_empty());
        let v3 = &snap[&("m".to_string(), "v3".to_string())];
        assert_eq!((v3.requests, v3.errors), (0, 0));
        assert_eq!(v3.ttft_counts, vec![0; TTFT_BUCKETS_MS.len() + 1]);
        assert_eq!(v3.workers["w1"].in_flight, 2);
    }
}
