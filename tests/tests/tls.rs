//! End-to-end mutual TLS: real router and worker processes with certificates
//! from `tokenmesh-certs`, the real model, grpcurl and grpcio. Every refusal
//! is followed by a good client being served, so a bad caller never takes
//! the server down.
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use std::path::{Path, PathBuf};
use std::time::Duration;
use time::OffsetDateTime;
use tokenmesh_certs::{Identity, LeafSpec, Role};
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_proto::v1::worker_client::WorkerClient;
use tokenmesh_proto::v1::{generate_response::Event, ListModelsRequest, StatusRequest};
use tokenmesh_tests::*;
use tonic::Code;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

/// An mTLS worker whose certificate says `cert_name` and whose
/// `--worker-id` is the same.
async fn tls_worker(pki: &Pki, id: &str, etcd: Option<String>, dir: &Path) -> WorkerProc {
    let opts = WorkerOpts {
        etcd,
        tls: Some(pki.worker_tls(id).unwrap()),
        extra: vec!["--tls-reload-ms".into(), "200".into()],
        ..WorkerOpts::new(id)
    };
    WorkerProc::start(opts, dir).await.unwrap()
}

/// An mTLS worker behind an mTLS router over a static file, with
/// certificates from one test CA.
struct TlsMesh {
    pki: Pki,
    worker: WorkerProc,
    router: RouterProc,
    /// The router's `--tls-dir`.
    router_tls: PathBuf,
    _dir: tempfile::TempDir,
}

/// A [`TlsMesh`] whose worker is `worker_id`.
async fn tls_mesh(worker_id: &str) -> TlsMesh {
    let dir = tmp();
    let pki = Pki::new().unwrap();
    let worker = tls_worker(&pki, worker_id, None, dir.path()).await;
    let path = static_file(dir.path(), &[&worker]);
    let (router_tls, creds) = pki.router_tls("harness").unwrap();
    let discovery = [
        "--static".into(),
        path,
        "--tls-reload-ms".into(),
        "200".into(),
    ];
    let tls = Some((router_tls.clone(), creds));
    let router = RouterProc::start_ready(&discovery, tls, dir.path(), 1).await;
    TlsMesh {
        pki,
        worker,
        router,
        router_tls,
        _dir: dir,
    }
}

/// An mTLS router discovering workers through `etcd`; returns it and the
/// ready workers it sees, once it sees one.
async fn etcd_tls_router(pki: &Pki, etcd: &Etcd, dir: &Path) -> (RouterProc, Vec<String>) {
    let router = RouterProc::start_tls(
        &["--etcd".into(), etcd.url.clone()],
        Some(pki.router_tls("c").unwrap()),
        dir,
    )
    .await
    .unwrap();
    let ready = router
        .wait_ready_workers(MODEL, 1, Duration::from_secs(20))
        .await
        .unwrap();
    (router, ready)
}

/// A ListModels call over the channel `connect` opens; None if no answer
/// comes within 10 s.
async fn list_models_over(
    connect: impl std::future::Future<Output = anyhow::Result<tonic::transport::Channel>>,
) -> Option<Result<(), tonic::Status>> {
    let call = async {
        let ch = connect
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        InferenceClient::new(ch)
            .list_models(ListModelsRequest {})
            .await
            .map(|_| ())
    };
    tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .ok()
}

/// A ListModels call with `creds` (or plaintext), bounded in time.
async fn list_models_as(addr: &str, creds: Option<&Creds>) -> Result<(), tonic::Status> {
    list_models_over(channel(addr, creds))
        .await
        .unwrap_or_else(|| Err(tonic::Status::deadline_exceeded("no answer in 10 s")))
}

/// A good client is still served (after each refusal).
async fn still_serves(router: &RouterProc) {
    list_models_as(&router.addr, router.creds.as_ref())
        .await
        .expect("a good client is still served");
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_callers_are_refused_and_good_ones_served() {
    let m = tls_mesh("w-tls").await;
    let (pki, w, router) = (&m.pki, &m.worker, &m.router);

    // The good path: a client certificate, the real model, through the router
    // and its mTLS channel to the worker.
    let mut client = router.client().await;
    let out = collect(&mut client, france_request(24)).await.unwrap();
    assert!(out.text.contains("Paris"), "{:?}", out.text);
    assert_eq!(out.finished.unwrap().worker_id, "w-tls");
    // operator is admitted too.
    list_models_as(
        &router.addr,
        Some(&pki.creds(Role::Operator, "op").unwrap()),
    )
    .await
    .unwrap();

    // No client certificate: only the CA, so the handshake is refused.
    let ca_only = tonic::transport::ClientTlsConfig::new().ca_certificate(
        tonic::transport::Certificate::from_pem(
            std::fs::read(pki.dir.path().join("ca.pem")).unwrap(),
        ),
    );
    let no_cert = async {
        let url = router.addr.replacen("http", "https", 1);
        // Only the connection may fail; the URL and the config are good.
        let endpoint = tonic::transport::Channel::from_shared(url)
            .unwrap()
            .tls_config(ca_only)
            .unwrap();
        Ok(endpoint.connect().await?)
    };
    let refused = list_models_over(no_cert).await;
    assert!(refused.expect("an answer within 10 s").is_err());
    still_serves(router).await;

    // Plaintext against an mTLS router.
    assert!(list_models_as(&router.addr, None).await.is_err());
    still_serves(router).await;

    // A client certificate from another CA (which also does not trust ours).
    let other = Pki::new().unwrap();
    let mut foreign = other.creds(Role::Client, "mallory").unwrap();
    std::fs::copy(pki.dir.path().join("ca.pem"), foreign.dir.join("ca.pem")).unwrap();
    foreign.role = Role::Client;
    assert!(list_models_as(&router.addr, Some(&foreign)).await.is_err());
    still_serves(router).await;

    // An expired client certificate from the right CA.
    let mut spec = LeafSpec::new(Identity::new(Role::Client, "expired").unwrap(), 1);
    spec.not_before = OffsetDateTime::now_utc() - time::Duration::days(10);
    spec.not_after = OffsetDateTime::now_utc() - time::Duration::days(1);
    let expired = Creds::new(pki.issue_spec(spec).unwrap(), Role::Client);
    assert!(list_models_as(&router.addr, Some(&expired)).await.is_err());
    still_serves(router).await;

    // A valid certificate with the wrong role: PERMISSION_DENIED naming the
    // roles the router requires.
    let auditor = pki.creds(Role::Auditor, "aud").unwrap();
    let err = list_models_as(&router.addr, Some(&auditor))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(
        err.message().contains("role client or operator required"),
        "{}",
        err.message()
    );
    let mut aud_client = InferenceClient::new(channel(&router.addr, Some(&auditor)).await.unwrap());
    let err = aud_client.generate(france_request(8)).await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    still_serves(router).await;

    // A worker calling a worker, and a client calling a worker directly:
    // workers admit only routers.
    for (role, name) in [(Role::Worker, "w-other"), (Role::Client, "c")] {
        let creds = pki.creds(role, name).unwrap();
        let mut c = WorkerClient::new(channel(&w.addr, Some(&creds)).await.unwrap());
        let err = c.status(StatusRequest {}).await.unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{role}: {err:?}");
        assert!(
            err.message().contains("role router required"),
            "{}",
            err.message()
        );
    }
    w.client().await.status(StatusRequest {}).await.unwrap();
    let out = collect(&mut router.client().await, france_request(8))
        .await
        .unwrap();
    assert!(out.finished.is_some());
}

#[tokio::test(flavor = "multi_thread")]
async fn grpcurl_and_grpcio_call_over_mtls() {
    let m = tls_mesh("w-cli").await;
    let router = &m.router;
    let creds = router.creds.clone().unwrap();
    let file = |n: String| creds.dir.join(n).display().to_string();
    let (ca, cert, key) = (
        file("ca.pem".into()),
        file(format!("{}.pem", creds.role)),
        file(format!("{}.key", creds.role)),
    );
    let target = router.addr.trim_start_matches("http://");
    let list = grpcurl(&["-cacert", &ca, "-cert", &cert, "-key", &key, target, "list"]);
    for svc in ["tokenmesh.v1.Inference", "grpc.health.v1.Health"] {
        assert!(list.contains(svc), "{list}");
    }
    // Without a client certificate grpcurl gets nothing.
    let out = grpcurl_output(&["-cacert", &ca, target, "list"]);
    assert!(!out.status.success());

    let report = generate_client(target, &["--cacert", &ca, "--cert", &cert, "--key", &key]);
    assert!(
        report["text"].as_str().unwrap().contains("Paris"),
        "{report}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn impostor_registered_under_another_id_is_refused() {
    let dir = tmp();
    let etcd = Etcd::start().await.unwrap();
    let pki = Pki::new().unwrap();
    let real = tls_worker(&pki, "w-real", Some(etcd.url.clone()), dir.path()).await;
    // A forged registration: id w-forged, pointing at a server whose
    // certificate names w-real.
    let record = tokenmesh_proto::records::WorkerRecord {
        device: "cpu".into(),
        capacity: 8,
        ..tokenmesh_proto::records::WorkerRecord::new(real.addr.clone())
    };
    etcd.client()
        .await
        .put(
            format!("/tokenmesh/workers/{MODEL}/v1/w-forged"),
            serde_json::to_string(&record).unwrap(),
            None,
        )
        .await
        .unwrap();
    let (router, ready) = etcd_tls_router(&pki, &etcd, dir.path()).await;
    assert_eq!(ready, vec!["w-real"]);
    let warned = router
        .proc
        .wait_for_log(
            "peer certificate names another identity",
            Duration::from_secs(10),
        )
        .await;
    assert!(warned, "{}", router.proc.log_text());
    // The forged entry never becomes ready and never gets a request.
    let mut client = router.client().await;
    for _ in 0..4 {
        let out = collect(&mut client, france_request(4)).await.unwrap();
        assert_eq!(out.finished.unwrap().worker_id, "w-real");
    }
    let models = client
        .list_models(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    let ids: Vec<String> = models
        .models
        .iter()
        .flat_map(|m| m.versions.iter().flat_map(|v| v.worker_ids.clone()))
        .collect();
    assert_eq!(ids, vec!["w-real"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn etcd_with_client_certificate_auth() {
    let dir = tmp();
    let pki = Pki::new().unwrap();
    let etcd = Etcd::start_tls(&pki).await.unwrap();
    // Without a client certificate etcd answers nothing.
    let anonymous = async {
        let mut c = etcd_client::Client::connect(
            [etcd.url.as_str()],
            Some(etcd_client::ConnectOptions::new().with_tls(
                tonic::transport::ClientTlsConfig::new().ca_certificate(
                    tonic::transport::Certificate::from_pem(
                        std::fs::read(pki.dir.path().join("ca.pem")).unwrap(),
                    ),
                ),
            )),
        )
        .await?;
        c.get("probe", None).await
    };
    assert!(tokio::time::timeout(Duration::from_secs(10), anonymous)
        .await
        .map(|r| r.is_err())
        .unwrap_or(true));
    // The worker registers and the router discovers with their own mesh
    // certificates.
    let w = tls_worker(&pki, "w-etcd", Some(etcd.url.clone()), dir.path()).await;
    let (router, ready) = etcd_tls_router(&pki, &etcd, dir.path()).await;
    assert_eq!(ready, vec![w.id.clone()]);
    let out = collect(&mut router.client().await, france_request(4))
        .await
        .unwrap();
    assert_eq!(out.finished.unwrap().worker_id, "w-etcd");
}

#[tokio::test(flavor = "multi_thread")]
async fn corrupt_key_at_startup_fails_naming_the_file() {
    let dir = tmp();
    let pki = Pki::new().unwrap();
    let static_file = dir.path().join("static.toml");
    std::fs::write(&static_file, "").unwrap();
    for (role, bin_name, extra) in [
        (
            Role::Router,
            "tokenmesh-router",
            vec!["--static".to_string(), static_file.display().to_string()],
        ),
        (
            Role::Worker,
            "tokenmesh-worker",
            vec!["--model".to_string(), model_path().display().to_string()],
        ),
    ] {
        let tls_dir = pki.issue(role, "broken").unwrap();
        let key = tls_dir.join(format!("{role}.key"));
        std::fs::write(
            &key,
            "-----BEGIN PRIVATE KEY-----\nnot base64 at all\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        let mut args = vec![
            "--listen".to_string(),
            format!("127.0.0.1:{}", free_port()),
            "--tls-dir".into(),
            tls_dir.display().to_string(),
        ];
        args.extend(extra);
        let mut p = Proc::spawn(bin_name, &bin(bin_name), &args, dir.path()).unwrap();
        let status = p
            .wait_exit(Duration::from_secs(20))
            .unwrap_or_else(|| panic!("{bin_name} kept running:\n{}", p.log_text()));
        assert!(!status.success(), "{bin_name}: {status}");
        let log = p.log_text();
        assert!(
            log.contains(&key.display().to_string()),
            "{bin_name} must name {}:\n{log}",
            key.display()
        );
    }
    // Neither transport flag: a clear refusal, not plaintext by default.
    let mut p = Proc::spawn(
        "router-none",
        &bin("tokenmesh-router"),
        &[
            "--listen".into(),
            format!("127.0.0.1:{}", free_port()),
            "--static".into(),
            static_file.display().to_string(),
        ],
        dir.path(),
    )
    .unwrap();
    let status = p.wait_exit(Duration::from_secs(10)).unwrap();
    assert!(!status.success());
    assert!(p.log_text().contains("--insecure"), "{}", p.log_text());
}

/// The certificate a server presents to a new connection right now.
async fn presented_cert(addr: &str, creds: &Creds) -> Vec<u8> {
    let me = tokenmesh_certs::tls::MeshTls::load(&creds.dir, creds.role).unwrap();
    let cfg = tokenmesh_certs::tls::connector::peer_client_config(
        me.store.clone(),
        me.roots.clone(),
        Identity::new(Role::Router, "router").unwrap(),
    )
    .unwrap();
    let tcp = tokio::net::TcpStream::connect(addr.trim_start_matches("http://"))
        .await
        .unwrap();
    let conn = tokio_rustls::TlsConnector::from(cfg)
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    conn.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

fn file_cert(path: &Path) -> Vec<u8> {
    CertificateDer::from_pem_file(path).unwrap().to_vec()
}

#[tokio::test(flavor = "multi_thread")]
async fn certificates_reload_without_restart_or_failed_request() {
    let m = tls_mesh("w-reload").await;
    let (pki, router, tls_dir) = (&m.pki, &m.router, &m.router_tls);
    let creds = router.creds.clone().unwrap();
    let cert_path = tls_dir.join("router.pem");
    let old = file_cert(&cert_path);
    assert_eq!(presented_cert(&router.addr, &creds).await, old);

    // A long stream is in flight while the certificate changes.
    let mut client = router.client().await;
    let mut req = france_request(160);
    req.messages[1].content = "List the numbers from 1 to 300, separated by commas.".into();
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut taken = Collected::default();
    while taken.seqs.len() < 3 {
        let m = stream.message().await.unwrap().unwrap();
        assert!(
            !matches!(m.event, Some(Event::Finished(_))),
            "finished too early"
        );
        taken.seqs.push(m.seq);
    }

    // Renew the router's certificate in place (key then certificate, each
    // replaced atomically).
    let ca = tokenmesh_certs::Ca::load(pki.dir.path()).unwrap();
    tokenmesh_certs::renew(&ca, tls_dir, "router", 2).unwrap();
    let new = file_cert(&cert_path);
    assert_ne!(new, old);
    let swapped = eventually(Duration::from_secs(10), || async {
        presented_cert(&router.addr, &creds).await == new
    })
    .await;
    assert!(swapped, "new connections never saw the new certificate");

    // The in-flight stream was unaffected: it runs to its end without a gap
    // (collect_rest checks the seq numbers).
    let rest = collect_rest(&mut stream, taken)
        .await
        .expect("the in-flight stream survives");
    assert!(rest.finished.is_some());
    still_serves(router).await;

    // An invalid replacement is refused and the renewed certificate stays.
    std::fs::write(
        &cert_path,
        "-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let refused = router
        .proc
        .wait_for_log("refusing the replaced certificate", Duration::from_secs(10))
        .await;
    assert!(refused, "{}", router.proc.log_text());
    assert_eq!(presented_cert(&router.addr, &creds).await, new);
    let out = collect(&mut router.client().await, france_request(8))
        .await
        .unwrap();
    assert!(out.finished.is_some());
    // The worker's channel from the router keeps working across all of it.
    assert_eq!(out.accepted.unwrap().worker_id, "w-reload");
}

#[test]
fn no_key_or_certificate_is_committed() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let out = std::process::Command::new("git")
        .args(["ls-files"])
        .current_dir(root)
        .output()
        .expect("git runs");
    assert!(out.status.success(), "git ls-files failed");
    let files = String::from_utf8_lossy(&out.stdout);
    let secret: Vec<&str> = files
        .lines()
        .filter(|f| f.ends_with(".pem") || f.ends_with(".key") || f.ends_with(".p12"))
        .collect();
    assert!(secret.is_empty(), "committed key material: {secret:?}");
    let ignore = std::fs::read_to_string(root.join(".gitignore")).unwrap();
    assert!(ignore.lines().any(|l| l == "*.pem") && ignore.lines().any(|l| l == "*.key"));
}
