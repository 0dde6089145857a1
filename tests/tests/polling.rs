//! Status polling that scales with the fleet (issue 19): a router spends at
//! most `--status-poll-budget` polls a second on all its workers together,
//! and a worker whose streams report its load in-band (`Accepted.load`,
//! `Finished.load`) is not polled while they do. Measured on the worker,
//! by the Status calls it answers (`llm_status_requests_total`).
use std::time::{Duration, Instant};
use tokenmesh_tests::*;

/// Status calls the worker whose metrics listener is `addr` has answered.
async fn polls(addr: &str) -> f64 {
    let text = scrape_text(addr).await.expect("the worker's metrics");
    text.lines()
        .filter(|l| l.starts_with("llm_status_requests_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Polls a second over `window`.
async fn poll_rate(addr: &str, window: Duration) -> f64 {
    let before = polls(addr).await;
    let t0 = Instant::now();
    tokio::time::sleep(window).await; // the measurement window itself
    (polls(addr).await - before) / t0.elapsed().as_secs_f64()
}

/// One synthetic worker process registered `ids` times in a static file
/// (plaintext: no identity check, so each id is its own endpoint with its
/// own poller, as `scripts/fleet_scale.py` simulates a fleet), and a router
/// over it with the `extra` flags. Returns the router, the worker and the
/// worker's metrics address.
async fn fleet(
    dir: &std::path::Path,
    ids: usize,
    extra: &[&str],
) -> (RouterProc, WorkerProc, String) {
    let metrics = format!("127.0.0.1:{}", free_port());
    let opts = WorkerOpts {
        extra: vec![
            "--model-name".into(),
            MODEL.into(),
            "--metrics-listen".into(),
            metrics.clone(),
        ],
        synthetic_tokens_per_sec: Some(2_000.0),
        ..WorkerOpts::new("proc")
    };
    let worker = WorkerProc::start(opts, dir).await.expect("worker starts");
    let mut toml = String::new();
    for i in 0..ids {
        toml.push_str(&format!(
            "[[workers]]\nid = \"sim-{i}\"\nmodel = \"{MODEL}\"\nversion = \"v1\"\naddr = \"{}\"\n\n",
            worker.addr
        ));
    }
    let file = dir.join("fleet.toml");
    std::fs::write(&file, toml).unwrap();
    let mut args = vec!["--static".to_string(), file.display().to_string()];
    args.extend(extra.iter().map(|s| s.to_string()));
    let router = RouterProc::start_ready(&args, None, dir, ids).await;
    (router, worker, metrics)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fleet_past_the_budget_is_polled_at_the_budget_not_per_worker() {
    let dir = tempfile::tempdir().unwrap();
    // 40 endpoints at the harness's 200 ms base interval would be 200
    // polls/s; the budget of 20/s stretches each one's interval to 2 s.
    let flags = ["--status-poll-budget", "20"];
    let (_router, _worker, metrics) = fleet(dir.path(), 40, &flags).await;
    let rate = poll_rate(&metrics, Duration::from_secs(3)).await;
    assert!(
        (10.0..=30.0).contains(&rate),
        "{rate:.1} polls/s for 40 workers under a budget of 20/s"
    );

    // The same fleet with no budget: every endpoint every 200 ms.
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--status-poll-budget", "0"];
    let (_router, _worker, metrics) = fleet(dir.path(), 40, &flags).await;
    let unlimited = poll_rate(&metrics, Duration::from_secs(3)).await;
    assert!(
        unlimited > 3.0 * rate,
        "without a budget {unlimited:.1} polls/s, with one {rate:.1}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_whose_streams_report_its_load_is_not_polled_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let router_metrics = format!("127.0.0.1:{}", free_port());
    // The harness's routers poll every 200 ms.
    let flags = ["--metrics-listen", router_metrics.as_str()];
    let (router, _worker, metrics) = fleet(dir.path(), 1, &flags).await;

    // Idle: polled every 200 ms, about 5 a second.
    let idle = poll_rate(&metrics, Duration::from_secs(2)).await;
    assert!(idle >= 3.0, "{idle:.1} polls/s while idle");

    // Busy: a stream ends every few milliseconds, each Finished an answer.
    let client = router.client().await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let (mut client, stop) = (client.clone(), stop.clone());
        tokio::spawn(async move {
            let mut served = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                collect(&mut client, prompt_request("keep it busy", 2))
                    .await
                    .expect("the worker serves");
                served += 1;
            }
            served
        })
    };
    // Once the first streams have ended, the worker goes unpolled.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let busy = poll_rate(&metrics, Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let served = traffic.await.unwrap();
    assert!(served > 20, "only {served} requests");
    assert!(
        busy < 0.5,
        "{busy:.1} polls/s while {served} streams reported the load in-band (idle: {idle:.1})"
    );
    // The router counts the polls it put off.
    let text = scrape_text(&router_metrics).await.unwrap();
    let deferred = sum_of(&text, "llm_router_status_polls_total", "deferred");
    assert!(deferred >= 1.0, "{text}");
}
