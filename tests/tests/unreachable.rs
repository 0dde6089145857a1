//! Passive health (issue 19): a worker that dies while idle is skipped from
//! the first call that finds it unreachable, not only after its next Status
//! poll fails, which in a large fleet may be N / budget seconds away. Here
//! the budget stretches each worker's poll interval to 100 s, so only the
//! failed call can tell the router; the poller then checks it again on the
//! failed-poll backoff (200 ms, doubling), so a restarted worker is ready
//! again within seconds.
use std::time::Duration;
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_tests::*;
use tonic::transport::Channel;

/// Retries the router has made, any reason (`llm_router_retries_total`).
async fn retries(metrics: &str) -> f64 {
    let text = scrape_text(metrics).await.expect("the router's metrics");
    text.lines()
        .filter(|l| l.starts_with("llm_router_retries_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A synthetic worker `id`, on `port` if given.
async fn worker(id: &str, port: Option<u16>, dir: &std::path::Path) -> WorkerProc {
    let opts = WorkerOpts {
        extra: vec!["--model-name".into(), MODEL.into()],
        synthetic_tokens_per_sec: Some(2_000.0),
        port,
        ..WorkerOpts::new(id)
    };
    WorkerProc::start(opts, dir).await.expect("worker starts")
}

/// Which worker served one short request; the request must succeed.
async fn served_by(client: &mut InferenceClient<Channel>, i: usize) -> String {
    let got = collect(client, prompt_request(&format!("request {i}"), 2))
        .await
        .unwrap_or_else(|s| panic!("request {i} failed: {s:?}"));
    got.accepted.expect("an Accepted").worker_id
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_idle_worker_is_skipped_after_the_first_call_that_finds_it_and_back_when_it_answers()
{
    let dir = tempfile::tempdir().unwrap();
    let a = worker("alive", None, dir.path()).await;
    let mut b = worker("doomed", None, dir.path()).await;
    let b_port: u16 = b.addr.rsplit(':').next().unwrap().parse().unwrap();
    let metrics = format!("127.0.0.1:{}", free_port());
    // 2 workers at 0.02 polls/s: each polled every 100 s (±20 %).
    let flags = [
        "--status-poll-budget",
        "0.02",
        "--worker-choice",
        "p2c",
        "--metrics-listen",
        metrics.as_str(),
    ];
    let router = static_router(dir.path(), &[&a, &b], &flags).await;
    let mut client = router.client().await;
    // Both serve.
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..200 {
        seen.insert(served_by(&mut client, i).await);
        if seen.len() == 2 {
            break;
        }
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(retries(&metrics).await, 0.0);

    b.proc.signal(nix::sys::signal::Signal::SIGKILL);
    assert!(b.proc.wait_exit(Duration::from_secs(10)).is_some());
    // Until a call is sent to it, the router still counts it ready.
    let ready = router
        .wait_ready_workers(MODEL, 2, Duration::from_secs(1))
        .await;
    assert!(ready.is_ok(), "{ready:?}");

    // P2C sends a request to it within a few; that one is retried on the
    // live worker, and the client never notices.
    let mut hit = None;
    for i in 0..100 {
        assert_eq!(served_by(&mut client, i).await, a.id);
        if retries(&metrics).await >= 1.0 {
            hit = Some(i);
            break;
        }
    }
    assert!(hit.is_some(), "no request was sent to the dead worker");
    assert_eq!(retries(&metrics).await, 1.0);
    // It is out of the choice at once, not after its poll (100 s away).
    let ready = router
        .wait_ready_workers(MODEL, 1, Duration::from_secs(1))
        .await
        .expect("the dead worker is not ready");
    assert_eq!(ready, std::slice::from_ref(&a.id));
    // No later request tries it: no retry more.
    for i in 0..40 {
        assert_eq!(served_by(&mut client, i).await, a.id);
    }
    assert_eq!(
        retries(&metrics).await,
        1.0,
        "a later request tried it again"
    );

    // Restarted where it was registered: ready again as soon as it
    // answers a poll, and served again.
    let b = worker("doomed", Some(b_port), dir.path()).await;
    router
        .wait_ready_workers(MODEL, 2, Duration::from_secs(20))
        .await
        .expect("the restarted worker is ready again");
    let mut back = false;
    for i in 0..200 {
        if served_by(&mut client, i).await == b.id {
            back = true;
            break;
        }
    }
    assert!(back, "no request reached the restarted worker");
    assert_eq!(retries(&metrics).await, 1.0);
}
