//! Router stats in etcd (issue 8): per model version, the upstream attempts,
//! the attempts that failed on the serving side and the time to first token,
//! under the router's lease, withdrawn when the router stops.
use std::collections::BTreeMap;
use std::time::Duration;
use tokenmesh_proto::keys::Keys;
use tokenmesh_proto::records::{StatsRecord, WorkerView, TTFT_BUCKETS_MS};
use tokenmesh_proto::v1::GenerateRequest;
use tokenmesh_tests::*;
use tonic::Code;

fn pinned(version: &str) -> GenerateRequest {
    GenerateRequest {
        version: Some(version.into()),
        ..prompt_request("count these words", 3)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn stats_count_attempts_errors_and_ttft_per_version_and_go_with_the_router() {
    const GOOD: u64 = 5;
    const BAD: u64 = 4;
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start().await.unwrap();
    // v1 is slow to its first token (1.1 s: the (1000, 2500] ms bucket);
    // v2 fails every request before its first token.
    let good = WorkerOpts::synthetic(
        "w-good",
        "v1",
        50.0,
        &etcd.url,
        &["--synthetic-first-token-delay-ms", "1100"],
    );
    let bad = WorkerOpts::synthetic(
        "w-bad",
        "v2",
        50.0,
        &etcd.url,
        &["--synthetic-error-rate", "1.0"],
    );
    let _good = WorkerProc::start(good, dir.path()).await.unwrap();
    let _bad = WorkerProc::start(bad, dir.path()).await.unwrap();
    let mut router = etcd_router(
        dir.path(),
        &etcd,
        2,
        &["--router-id", "r-stats", "--stats-interval-ms", "300"],
    )
    .await;

    let client = router.client().await;
    let mut tasks = Vec::new();
    for i in 0..GOOD + BAD {
        let mut c = client.clone();
        let version = if i < GOOD { "v1" } else { "v2" };
        tasks.push(tokio::spawn(async move {
            (version, collect(&mut c, pinned(version)).await)
        }));
    }
    for t in tasks {
        match t.await.unwrap() {
            ("v1", out) => {
                let out = out.expect("v1 serves");
                assert_eq!(out.token_ids.len(), 3);
            }
            (_, out) => {
                // The fault comes after Accepted; the only v2 worker is
                // excluded from the failover, so the stream is lost.
                let status = out.expect_err("v2 fails every request");
                assert_eq!(status.code(), Code::Unavailable, "{status:?}");
            }
        }
    }

    let keys = Keys::default();
    let read = || async {
        let mut out = BTreeMap::new();
        for (key, value, lease) in etcd.get_prefix(&keys.stats_prefix()).await {
            let (router_id, model, version) = keys.parse_stats(&key).expect("a stats key");
            assert_eq!((router_id, model), ("r-stats", MODEL));
            assert_ne!(lease, 0, "stats live under the router's lease");
            let record: StatsRecord = serde_json::from_str(&value).expect("a StatsRecord");
            out.insert(version.to_string(), record);
        }
        out
    };
    let expected = |r: &StatsRecord, requests: u64, errors: u64, ttft_bucket: Option<usize>| {
        let mut ttft = vec![0; TTFT_BUCKETS_MS.len() + 1];
        if let Some(b) = ttft_bucket {
            ttft[b] = requests;
        }
        r.requests == requests && r.errors == errors && r.ttft_counts == ttft
    };
    let idle = |id: &str| {
        BTreeMap::from([(
            id.to_string(),
            WorkerView {
                healthy: true,
                draining: false,
                in_flight: 0,
                queue_depth: 0,
            },
        )])
    };
    let settled = eventually(Duration::from_secs(10), || async {
        let s = read().await;
        match (s.get("v1"), s.get("v2")) {
            (Some(v1), Some(v2)) => {
                // 1.1 s to the first token: the (1000, 2500] ms bucket.
                expected(v1, GOOD, 0, Some(8))
                    && expected(v2, BAD, BAD, None)
                    && v1.workers == idle("w-good")
                    && v2.workers == idle("w-bad")
            }
            _ => false,
        }
    })
    .await;
    let last = read().await;
    assert!(settled, "published stats: {last:#?}");
    for r in last.values() {
        assert!(r.started_at_ms > 0 && r.started_at_ms <= r.updated_at_ms);
    }

    // SIGTERM: the router revokes its lease on the way out.
    let status = router.proc.terminate(Duration::from_secs(15));
    assert!(status.success(), "{}", router.proc.log_text());
    assert_eq!(
        etcd.get_prefix(&keys.stats_prefix()).await,
        vec![],
        "the router's stats must go with it"
    );
}

/// Every stats record `router_id` published, by version.
async fn published(etcd: &Etcd, router_id: &str) -> BTreeMap<String, StatsRecord> {
    let keys = Keys::default();
    let mut out = BTreeMap::new();
    for (key, value, _) in etcd.get_prefix(&keys.stats_prefix()).await {
        let (router, _, version) = keys.parse_stats(&key).expect("a stats key");
        if router == router_id {
            let record: StatsRecord = serde_json::from_str(&value).expect("a StatsRecord");
            out.insert(version.to_string(), record);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn a_version_s_stats_go_once_it_has_no_worker_and_no_traffic_for_the_retention() {
    const RETENTION: Duration = Duration::from_secs(2);
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start().await.unwrap();
    let stays = WorkerOpts::synthetic("w-stays", "v1", 200.0, &etcd.url, &[]);
    let leaves = WorkerOpts::synthetic("w-leaves", "v2", 200.0, &etcd.url, &[]);
    let _stays = WorkerProc::start(stays, dir.path()).await.unwrap();
    let mut leaves = WorkerProc::start(leaves, dir.path()).await.unwrap();
    let router = etcd_router(
        dir.path(),
        &etcd,
        2,
        &[
            "--router-id",
            "r-retention",
            "--stats-interval-ms",
            "200",
            "--stats-retention-s",
            &RETENTION.as_secs().to_string(),
        ],
    )
    .await;
    let mut client = router.client().await;
    collect(&mut client, pinned("v1")).await.expect("v1 serves");
    let last_v2 = std::time::Instant::now();
    collect(&mut client, pinned("v2")).await.expect("v2 serves");
    let both = eventually(Duration::from_secs(10), || async {
        let s = published(&etcd, "r-retention").await;
        s.get("v1").is_some_and(|r| r.requests == 1) && s.get("v2").is_some_and(|r| r.requests == 1)
    })
    .await;
    assert!(both, "{:#?}", published(&etcd, "r-retention").await);

    // v2's only worker drains and deregisters: its stats stay until the
    // retention has passed since its last request, then go.
    let status = leaves.proc.terminate(Duration::from_secs(15));
    assert!(status.success(), "{}", leaves.proc.log_text());
    let gone = eventually(Duration::from_secs(15), || async {
        !published(&etcd, "r-retention").await.contains_key("v2")
    })
    .await;
    let s = published(&etcd, "r-retention").await;
    assert!(gone, "v2's stats outlived the retention: {s:#?}");
    assert!(
        last_v2.elapsed() >= RETENTION,
        "v2's stats went {:?} after its last request, before the retention",
        last_v2.elapsed()
    );
    // v1, idle as long, stays: its worker is registered.
    assert_eq!(s["v1"].requests, 1, "{s:#?}");
}
