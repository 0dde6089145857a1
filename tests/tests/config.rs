//! Configuration that fails loudly (issue 18): a traffic policy written
//! straight into etcd is checked as the Control API's SetPolicy checks it
//! (the last good one stays, and the router says why); a static file's
//! `https://` worker address works under mutual TLS and is refused at
//! start-up by a plaintext router; a worker that never becomes ready is
//! logged with the reason, once.
use std::time::Duration;
use tokenmesh_proto::v1::{self, ListModelsRequest};
use tokenmesh_tests::control::{ControlOpts, ControlProc};
use tokenmesh_tests::*;

/// The (version, weight) pairs the router's ListModels shows for `MODEL`.
async fn weights(router: &RouterProc) -> Vec<(String, u32)> {
    let resp = router
        .client()
        .await
        .list_models(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    resp.models
        .iter()
        .filter(|m| m.name == MODEL)
        .flat_map(|m| m.versions.iter().map(|v| (v.version.clone(), v.weight)))
        .collect()
}

fn split(v1: u32, v2: u32) -> Vec<(String, u32)> {
    vec![("v1".into(), v1), ("v2".into(), v2)]
}

#[tokio::test(flavor = "multi_thread")]
async fn a_policy_written_into_etcd_is_checked_as_set_policy_checks_it() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start().await.unwrap();
    let mut kv = etcd.client().await;
    let key = format!("/tokenmesh/models/{MODEL}/policy");
    let good = r#"{"stable":"v1","canary":{"version":"v2","weight":10}}"#;
    kv.put(key.as_str(), good, None).await.unwrap();
    let mut workers = Vec::new();
    for (id, version) in [("w-v1", "v1"), ("w-v2", "v2")] {
        let opts = WorkerOpts::synthetic(id, version, 50.0, &etcd.url, &[]);
        workers.push(WorkerProc::start(opts, dir.path()).await.unwrap());
    }
    let router = etcd_router(dir.path(), &etcd, 2, &[]).await;
    assert_eq!(weights(&router).await, split(90, 10));

    // 250 % canary, written past the Control API: refused, the 10 % stays.
    let bad = r#"{"stable":"v1","canary":{"version":"v2","weight":250}}"#;
    kv.put(key.as_str(), bad, None).await.unwrap();
    assert!(
        router
            .proc
            .wait_for_log("ignoring invalid traffic policy", Duration::from_secs(10))
            .await,
        "{}",
        router.proc.log_text()
    );
    let log = router.proc.log_text();
    assert!(
        log.contains("policy.canary_weight must be 0..=100, got 250"),
        "{log}"
    );
    assert_eq!(weights(&router).await, split(90, 10));

    // A router that starts now (a full read of etcd) has no good policy to
    // keep: it serves as with no policy, never as 250 %.
    let fresh = etcd_router(dir.path(), &etcd, 2, &[]).await;
    let shown = weights(&fresh).await;
    assert!(shown.iter().all(|(_, w)| *w <= 100), "{shown:?}");
    assert!(
        fresh
            .proc
            .wait_for_log("ignoring invalid traffic policy", Duration::from_secs(10))
            .await
    );

    // The control plane shows no policy rather than 250 %, at the stored
    // key's revision, so that a SetPolicy replaces it.
    let control = ControlProc::start(ControlOpts::new("control-1", &etcd.url), dir.path())
        .await
        .unwrap();
    let mut c = control.client().await;
    let shown = c
        .get_policy(v1::GetPolicyRequest {
            model: MODEL.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(shown.policy, None, "{shown:?}");
    let stored = kv.get(key.as_str(), None).await.unwrap();
    let revision = stored.kvs()[0].mod_revision();
    assert_eq!(shown.revision, revision);
    c.set_policy(v1::SetPolicyRequest {
        model: MODEL.into(),
        policy: Some(v1::TrafficPolicy {
            stable_version: "v1".into(),
            canary_version: "v2".into(),
            canary_weight: 20,
            sticky: true,
            pin_allowed: true,
        }),
        expected_revision: revision,
    })
    .await
    .expect("SetPolicy replaces the invalid policy");
    let replaced = eventually(Duration::from_secs(10), || async {
        weights(&router).await == split(80, 20)
    })
    .await;
    assert!(replaced, "{:?}", weights(&router).await);
}

/// A static discovery file naming `id` at `addr`.
fn static_file_at(dir: &std::path::Path, id: &str, addr: &str) -> String {
    let path = dir.join(format!("static-{id}.toml"));
    std::fs::write(
        &path,
        format!("[[workers]]\nid = \"{id}\"\nmodel = \"{MODEL}\"\nversion = \"v1\"\naddr = \"{addr}\"\n"),
    )
    .unwrap();
    path.display().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_https_worker_address_works_under_mtls_and_is_refused_in_plaintext() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new().unwrap();
    let opts = WorkerOpts {
        tls: Some(pki.worker_tls("w-tls").unwrap()),
        synthetic_tokens_per_sec: Some(200.0),
        extra: vec!["--model-name".into(), MODEL.into()],
        ..WorkerOpts::new("w-tls")
    };
    let worker = WorkerProc::start(opts, dir.path()).await.unwrap();
    let https = worker.addr.replacen("http://", "https://", 1);
    let file = static_file_at(dir.path(), "w-tls", &https);

    // What a user of an mTLS mesh writes: the worker is ready and serves.
    let router = RouterProc::start_ready(
        &["--static".into(), file.clone()],
        Some(pki.router_tls("client").unwrap()),
        dir.path(),
        1,
    )
    .await;
    let out = collect(&mut router.client().await, prompt_request("one two", 3))
        .await
        .unwrap();
    assert_eq!(out.accepted.unwrap().worker_id, "w-tls");

    // A plaintext router would not encrypt what the address promises: it
    // refuses the file at start-up, saying what to change.
    let args = vec![
        "--insecure".to_string(),
        "--listen".into(),
        format!("127.0.0.1:{}", free_port()),
        "--static".into(),
        file,
    ];
    let mut refused = Proc::spawn(
        "router-plaintext",
        &bin("tokenmesh-router"),
        &args,
        dir.path(),
    )
    .unwrap();
    let exit = refused
        .wait_exit(Duration::from_secs(10))
        .expect("the plaintext router stops at start-up");
    assert!(!exit.success());
    let log = refused.log_text();
    assert!(
        log.contains("https://") && log.contains("--insecure") && log.contains("w-tls"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_that_never_becomes_ready_is_logged_once_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens there.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let file = static_file_at(dir.path(), "w-dead", &dead);
    let metrics = format!("127.0.0.1:{}", free_port());
    let router = RouterProc::start(
        &[
            "--static".into(),
            file,
            "--metrics-listen".into(),
            metrics.clone(),
        ],
        dir.path(),
    )
    .await
    .unwrap();
    assert!(
        router
            .proc
            .wait_for_log("worker unhealthy", Duration::from_secs(10))
            .await,
        "{}",
        router.proc.log_text()
    );
    // Until more polls have failed after the one that was logged.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let text = scrape_text(&metrics).await.unwrap();
        let failed = sum_of(&text, "llm_router_status_polls_total{", "\"failed\"");
        if failed >= 4.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "only {failed} failed polls in 30 s:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = router.proc.log_text();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("worker unhealthy"))
        .collect();
    assert_eq!(warnings.len(), 1, "once per change, not per poll:\n{log}");
    let line = warnings[0];
    assert!(line.contains("w-dead") && line.contains(&dead), "{line}");
    assert!(
        line.to_lowercase().contains("connect") || line.contains("refused"),
        "the reason: {line}"
    );
}
