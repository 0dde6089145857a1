//! Health a platform can read (issue 18): every server answers plaintext
//! `GET /healthz` and `GET /readyz` on its `--metrics-listen` listener, also
//! when its gRPC port demands a client certificate that a kubelet or a load
//! balancer does not have. `/readyz` is the same signal as grpc.health: a
//! router is ready with its discovery view and a ready worker, a worker with
//! its model loaded and registered and not draining, a control plane while
//! it reads etcd.
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;
use tokenmesh_proto::v1::generate_response::Event;
use tokenmesh_tests::control::{ControlOpts, ControlProc};
use tokenmesh_tests::*;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// Waits until `GET path` on `addr` answers `status` with a body containing
/// `text`; fails with the last answer.
async fn wait_probe(addr: &str, path: &str, status: u16, text: &str, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let got = http_get(addr, path).await;
        if matches!(&got, Ok((s, body)) if *s == status && body.contains(text)) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "GET {path} on {addr}: wanted {status} with {text:?}, last answer {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// What the compose health check (`tokenmesh-entrypoint ready PORT`) says
/// of the probe listener at `addr`: whether it passes, and its output.
fn compose_check(addr: &str) -> (bool, String) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/entrypoint.sh");
    let port = addr.rsplit(':').next().unwrap();
    let out = Command::new("bash")
        .arg(script)
        .args(["ready", port])
        .output()
        .expect("running bash");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn metrics_addr() -> String {
    format!("127.0.0.1:{}", free_port())
}

/// The grpc.health status of the whole server at `addr`.
async fn grpc_health(addr: &str, creds: &Creds) -> ServingStatus {
    let ch = channel(addr, Some(creds)).await.expect("connecting");
    HealthClient::new(ch)
        .check(HealthCheckRequest::default())
        .await
        .expect("grpc.health answers")
        .into_inner()
        .status()
}

#[tokio::test(flavor = "multi_thread")]
async fn healthz_and_readyz_in_plaintext_beside_mutual_tls_follow_each_server_s_state() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new().unwrap();
    let mut etcd = Etcd::start().await.unwrap();
    let long = Duration::from_secs(20);

    // A router with no worker yet: alive, not ready, and says why.
    let router_probes = metrics_addr();
    let router = RouterProc::start_tls(
        &[
            "--etcd".into(),
            etcd.url.clone(),
            "--metrics-listen".into(),
            router_probes.clone(),
        ],
        Some(pki.router_tls("client").unwrap()),
        dir.path(),
    )
    .await
    .unwrap();
    wait_probe(&router_probes, "/healthz", 200, "ok", long).await;
    wait_probe(&router_probes, "/readyz", 503, "no ready worker", long).await;
    let (passes, said) = compose_check(&router_probes);
    assert!(!passes && said.contains("no ready worker"), "{said}");

    // The control plane: ready while it reads etcd.
    let control_probes = metrics_addr();
    let control = ControlProc::start(
        ControlOpts {
            tls: Some((
                pki.issue(tokenmesh_certs::Role::Control, "control")
                    .unwrap(),
                pki.creds(tokenmesh_certs::Role::Operator, "op").unwrap(),
            )),
            extra: vec!["--metrics-listen".into(), control_probes.clone()],
            ..ControlOpts::new("control-1", &etcd.url)
        },
        dir.path(),
    )
    .await
    .unwrap();
    wait_probe(&control_probes, "/healthz", 200, "ok", long).await;
    wait_probe(&control_probes, "/readyz", 200, "ready", long).await;

    // A worker (mutual TLS too), slow enough that a stream is in flight when
    // it is stopped.
    let worker_probes = metrics_addr();
    let mut opts = WorkerOpts::synthetic(
        "w-probed",
        "v1",
        10.0,
        &etcd.url,
        &["--metrics-listen", &worker_probes],
    );
    opts.tls = Some(pki.worker_tls("w-probed").unwrap());
    let mut worker = WorkerProc::start(opts, dir.path()).await.unwrap();
    wait_probe(&worker_probes, "/healthz", 200, "ok", long).await;
    wait_probe(&worker_probes, "/readyz", 200, "ready", long).await;
    wait_probe(&router_probes, "/readyz", 200, "ready", long).await;
    for probes in [&worker_probes, &router_probes, &control_probes] {
        let (passes, said) = compose_check(probes);
        assert!(passes, "{probes}: {said}");
    }
    let worker_creds = worker.creds.clone().unwrap();
    assert_eq!(
        grpc_health(&worker.addr, &worker_creds).await,
        ServingStatus::Serving
    );

    // SIGTERM with a stream in flight: the worker drains. It is still alive
    // and its stream still runs, but it is not ready, on /readyz and on
    // grpc.health alike; the router, whose only worker it was, is not ready
    // either.
    let mut client = router.client().await;
    let mut stream = client
        .generate(prompt_request("keep talking please", 40))
        .await
        .unwrap()
        .into_inner();
    let mut taken = Collected::default();
    loop {
        let msg = stream.message().await.unwrap().expect("a token");
        taken.seqs.push(msg.seq);
        if matches!(msg.event, Some(Event::Delta(_))) {
            break;
        }
    }
    worker.proc.signal(nix::sys::signal::Signal::SIGTERM);
    wait_probe(&worker_probes, "/readyz", 503, "draining", long).await;
    let (passes, said) = compose_check(&worker_probes);
    assert!(!passes && said.contains("draining"), "{said}");
    let (status, _) = http_get(&worker_probes, "/healthz").await.unwrap();
    assert_eq!(status, 200, "alive while it drains");
    assert_eq!(
        grpc_health(&worker.addr, &worker_creds).await,
        ServingStatus::NotServing
    );
    wait_probe(&router_probes, "/readyz", 503, "no ready worker", long).await;
    let rest = collect_rest(&mut stream, taken)
        .await
        .expect("the stream in flight finishes during the drain");
    assert!(rest.finished.is_some());
    // /metrics is served by the same listener.
    let scraped = scrape_text(&worker_probes).await.unwrap();
    assert!(scraped.contains("llm_tokens_generated_total"), "{scraped}");
    let exit = worker
        .proc
        .wait_exit(long)
        .expect("the drained worker exits");
    assert!(exit.success(), "{exit:?}");

    // etcd gone: the control plane serves stale reads, but is not ready.
    etcd.kill();
    wait_probe(&control_probes, "/readyz", 503, "etcd", long).await;
    let (status, _) = http_get(&control_probes, "/healthz").await.unwrap();
    assert_eq!(status, 200);
    drop(control);
}
