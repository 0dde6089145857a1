//! What the router's component tests share: synthetic workers and routers
//! run in-process on 127.0.0.1:0, each worker on a runtime of its own so
//! that a test can kill one outright (shutting its runtime down drops its
//! listener and connections at once, as a `kill -9` would).
// Each test crate uses its own part of it.
#![allow(dead_code)]
use clap::Parser;
use std::net::SocketAddr;
use std::time::Duration;
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_proto::v1::ListModelsRequest;
use tokenmesh_router::config::RouterConfig;
use tokenmesh_worker::config::WorkerConfig;
use tonic::transport::Channel;

/// The model every test worker serves.
pub const MODEL: &str = "m";

/// A worker serving `MODEL` with the synthetic engine; stops when dropped.
pub struct Worker {
    pub id: String,
    pub version: String,
    pub addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Worker {
    /// A worker of v1 at 200 tokens/s per sequence.
    pub fn start(id: &str) -> Self {
        Self::of_version(id, "v1")
    }

    /// A worker of `version` at 200 tokens/s per sequence.
    pub fn of_version(id: &str, version: &str) -> Self {
        Self::launch(id, version, Some(id), 200, &[])
    }

    /// A worker the static file lists as `id`, started with `--worker-id
    /// own_id` (none: it names itself), `tokens_per_sec` per sequence and
    /// the further `flags`.
    pub fn launch(
        id: &str,
        version: &str,
        own_id: Option<&str>,
        tokens_per_sec: u32,
        flags: &[&str],
    ) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let rate = tokens_per_sec.to_string();
        let mut argv = vec![
            "tokenmesh-worker",
            "--insecure",
            "--engine",
            "synthetic",
            "--synthetic-tokens-per-sec",
            &rate,
            "--model-name",
            MODEL,
            "--model-version",
            version,
        ];
        if let Some(own) = own_id {
            argv.extend(["--worker-id", own]);
        }
        argv.extend_from_slice(flags);
        let cfg = WorkerConfig::try_parse_from(argv).unwrap();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            tokenmesh_worker::run(cfg, listener, std::future::pending())
                .await
                .unwrap();
        });
        Self {
            id: id.into(),
            version: version.into(),
            addr,
            runtime: Some(runtime),
        }
    }

    /// Stops the worker abruptly: no drain, connections dropped.
    pub fn kill(&mut self) {
        // Called inside the test's own runtime: no blocking wait.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A router in-process and a client of it; stops when dropped.
pub struct Router {
    pub client: InferenceClient<Channel>,
    _stop: tokio::sync::oneshot::Sender<()>,
    _dir: tempfile::TempDir,
}

/// Runs the router with `argv` in-process on 127.0.0.1:0: a lazy channel to
/// it and the sender that stops it.
pub async fn spawn_router(argv: &[String]) -> (Channel, tokio::sync::oneshot::Sender<()>) {
    let cfg = RouterConfig::try_parse_from(argv).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(tokenmesh_router::run(cfg, listener, async {
        let _ = stopped.await;
    }));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    (channel, stop)
}

/// A router over a static file listing `workers`, with `extra` flags, once
/// it sees every one of them ready.
pub async fn router(workers: &[&Worker], extra: &[&str]) -> Router {
    let dir = tempfile::tempdir().unwrap();
    let mut toml = String::new();
    for w in workers {
        toml.push_str(&format!(
            "[[workers]]\nid = {:?}\nmodel = {MODEL:?}\nversion = {:?}\naddr = \"http://{}\"\n\n",
            w.id, w.version, w.addr
        ));
    }
    let path = dir.path().join("static.toml");
    std::fs::write(&path, toml).unwrap();
    let mut args = vec![
        "tokenmesh-router".to_string(),
        "--insecure".into(),
        "--static".into(),
        path.display().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let (channel, stop) = spawn_router(&args).await;
    let mut client = InferenceClient::new(channel);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let ready = match client.list_models(ListModelsRequest {}).await {
            Ok(r) => r
                .into_inner()
                .models
                .iter()
                .flat_map(|m| m.versions.iter().map(|v| v.ready_workers))
                .sum::<u32>(),
            Err(_) => 0,
        };
        if ready as usize == workers.len() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "workers not ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Router {
        client,
        _stop: stop,
        _dir: dir,
    }
}
