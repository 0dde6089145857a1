//! The load generator checked against a known source: a synthetic worker at a
//! set token rate. `meshctl bench` runs as the real binary with JSON output,
//! directly against the worker and through a router, and must measure the
//! configured tokens/s and inter-token latency within 5 %; and the same
//! through a router that demands mutual TLS, with `--tls-dir`.
use anyhow::{Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokenmesh_certs::Role;
use tokenmesh_tests::{bin, Creds, Pki, RouterProc, WorkerOpts, WorkerProc};

const RATE: f64 = 50.0; // tokens/s per sequence: one every 20 ms
const STREAMS: f64 = 4.0;

/// `meshctl bench` with the suite's load settings and `extra` arguments.
fn bench_command(extra: &[&str]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(bin("meshctl"));
    cmd.args([
        "bench",
        "--concurrency",
        "4",
        "--max-tokens",
        "25",
        "--prompt-words",
        "8..24",
        "--duration",
        "3",
        "--warmup",
        "0.5",
        "--drain-timeout",
        "10",
        "--output",
        "json",
        "--no-progress",
    ])
    .args(extra)
    // A run the timeout gives up on must not outlive the test.
    .kill_on_drop(true);
    cmd
}

/// Runs `meshctl bench` with `extra` arguments; its single JSON report.
async fn bench(extra: &[&str]) -> Result<Value> {
    let out = bench_command(extra).output().await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "meshctl bench failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout.lines().next().context("no report line")?;
    serde_json::from_str(line).with_context(|| format!("not a JSON report: {line}"))
}

fn within(measured: f64, expected: f64, what: &str, report: &Value) {
    let off = (measured - expected).abs() / expected;
    assert!(
        off <= 0.05,
        "{what}: measured {measured:.3}, configured {expected:.3} ({:.1} % off)\n{report:#}",
        off * 100.0
    );
}

fn check(report: &Value) {
    let f = |path: &[&str]| {
        path.iter()
            .fold(report, |v, k| &v[*k])
            .as_f64()
            .unwrap_or_else(|| panic!("{path:?} missing in {report:#}"))
    };
    assert_eq!(report["errors"], serde_json::json!({}), "{report:#}");
    assert!(f(&["requests"]) >= 16.0, "too few requests: {report:#}");
    // Each stream is busy all the time but for a request's set-up (well under
    // a millisecond against a 500 ms request), so the aggregate is streams × rate.
    within(
        f(&["output_tokens_per_sec"]),
        STREAMS * RATE,
        "tokens/s",
        report,
    );
    within(
        f(&["itl_ms", "mean"]),
        1000.0 / RATE,
        "mean inter-token latency",
        report,
    );
    within(
        f(&["itl_ms", "p50"]),
        1000.0 / RATE,
        "p50 inter-token latency",
        report,
    );
}

/// A synthetic worker at `RATE` serving the model `synthetic`; with `tls`,
/// mutual TLS.
async fn synthetic_worker(id: &str, tls: Option<(PathBuf, Creds)>, dir: &Path) -> WorkerProc {
    let opts = WorkerOpts {
        synthetic_tokens_per_sec: Some(RATE),
        extra: vec!["--model-name".into(), "synthetic".into()],
        tls,
        ..WorkerOpts::new(id)
    };
    WorkerProc::start(opts, dir).await.unwrap()
}

/// A router over a static file listing `worker` alone as `synthetic` v1, the
/// stable version; with `tls`, mutual TLS.
async fn synthetic_router(
    worker: &WorkerProc,
    tls: Option<(PathBuf, Creds)>,
    dir: &Path,
) -> RouterProc {
    let static_file = dir.join("static.toml");
    std::fs::write(
        &static_file,
        format!(
            "[[workers]]\nid = \"{}\"\nmodel = \"synthetic\"\nversion = \"v1\"\naddr = \"{}\"\n\n[models.\"synthetic\"]\nstable = \"v1\"\n",
            worker.id, worker.addr
        ),
    )
    .unwrap();
    let router = RouterProc::start_tls(
        &["--static".into(), static_file.display().to_string()],
        tls,
        dir,
    )
    .await
    .unwrap();
    router
        .wait_ready_workers("synthetic", 1, Duration::from_secs(10))
        .await
        .unwrap();
    router
}

#[tokio::test(flavor = "multi_thread")]
async fn bench_measures_the_synthetic_engine_rate_within_5_percent() {
    let dir = tempfile::tempdir().unwrap();
    let worker = synthetic_worker("w-synthetic", None, dir.path()).await;

    let direct = bench(&["--direct", "--target", &worker.addr])
        .await
        .unwrap();
    assert_eq!(direct["labels"]["api"], "worker");
    check(&direct);

    let router = synthetic_router(&worker, None, dir.path()).await;
    let routed = bench(&["--target", &router.addr]).await.unwrap();
    assert_eq!(routed["labels"]["api"], "router");
    check(&routed);
}

#[tokio::test(flavor = "multi_thread")]
async fn bench_loads_a_mutual_tls_router_with_tls_dir() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new().unwrap();
    let worker =
        synthetic_worker("w-tls", Some(pki.worker_tls("w-tls").unwrap()), dir.path()).await;
    let router = synthetic_router(
        &worker,
        Some(pki.router_tls("harness").unwrap()),
        dir.path(),
    )
    .await;
    let client_dir = pki.issue(Role::Client, "bench").unwrap();
    let client_dir = client_dir.display().to_string();
    let routed = bench(&["--target", &router.addr, "--tls-dir", &client_dir])
        .await
        .unwrap();
    assert_eq!(routed["labels"]["api"], "router");
    check(&routed);

    // Plaintext against the mTLS router fails with an error, not a hang: the
    // real command, bounded in time, exits with status 1 (a usage error would
    // be 2, a panic 101), prints no report, and says why on one stderr line.
    // Which gRPC status the refused connection surfaces as varies from run to
    // run (UNKNOWN "transport error", INTERNAL "h2 protocol error",
    // CANCELLED), so the line's wording is not pinned.
    let limit = Duration::from_secs(30);
    let out = tokio::time::timeout(limit, bench_command(&["--target", &router.addr]).output())
        .await
        .unwrap_or_else(|_| {
            panic!("meshctl bench against an mTLS router still runs after {limit:?}")
        })
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let shown = format!("status {}\nstdout: {stdout}\nstderr: {stderr}", out.status);
    assert_eq!(out.status.code(), Some(1), "an error exit: {shown}");
    assert!(stdout.trim().is_empty(), "no report: {shown}");
    assert!(
        stderr.starts_with("error: ") && stderr.trim_end().lines().count() == 1,
        "one error line on stderr: {shown}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bench_api_openai_measures_the_same_rate_over_http() {
    let dir = tempfile::tempdir().unwrap();
    let worker = synthetic_worker("w-http", None, dir.path()).await;
    let http = format!("127.0.0.1:{}", tokenmesh_tests::free_port());
    let static_file = dir.path().join("static.toml");
    std::fs::write(
        &static_file,
        format!(
            "[[workers]]\nid = \"{}\"\nmodel = \"synthetic\"\nversion = \"v1\"\naddr = \"{}\"\n",
            worker.id, worker.addr
        ),
    )
    .unwrap();
    let args = [
        "--static".to_string(),
        static_file.display().to_string(),
        "--http-listen".into(),
        http.clone(),
    ];
    let router = RouterProc::start_tls(&args, None, dir.path())
        .await
        .unwrap();
    router
        .wait_ready_workers("synthetic", 1, Duration::from_secs(10))
        .await
        .unwrap();
    // HTTP/1.1, a connection per stream, and HTTP/2 multiplexed.
    let h1 = bench(&["--api", "openai", "--target", &http])
        .await
        .unwrap();
    assert_eq!(h1["labels"]["api"], "openai");
    assert_eq!(h1["labels"]["model"], "synthetic", "from GET /v1/models");
    check(&h1);
    let h2 = bench(&["--api", "openai", "--http2", "--target", &http])
        .await
        .unwrap();
    assert_eq!(h2["labels"]["api"], "openai-h2");
    check(&h2);
}
