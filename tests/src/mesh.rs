//! Workers and routers as real processes, started on free loopback ports and
//! awaited with readiness probes, and the static discovery file that joins
//! them without etcd.
use crate::etcd::Etcd;
use crate::model::{model_path, MODEL};
use crate::pki::{channel, Creds};
use crate::process::{bin, eventually, free_port, transport_args, wait_serving, Proc};
use anyhow::{bail, Result};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_proto::v1::worker_client::WorkerClient;
use tokenmesh_proto::v1::{ListModelsRequest, StatusRequest, StatusResponse};
use tonic::transport::Channel;

/// A worker process.
pub struct WorkerProc {
    /// Its `--worker-id` (or, without the flag, its name in a static file).
    pub id: String,
    /// `http://127.0.0.1:PORT` of the Worker API.
    pub addr: String,
    pub proc: Proc,
    /// What the harness's own clients present (mTLS workers only).
    pub creds: Option<Creds>,
}

/// Options for a worker.
#[derive(Clone, Debug)]
pub struct WorkerOpts {
    /// `--worker-id`.
    pub id: String,
    /// `--model-version`.
    pub version: String,
    /// `--etcd` URL; none: not registered anywhere.
    pub etcd: Option<String>,
    /// Further flags, appended last.
    pub extra: Vec<String>,
    /// Run the synthetic engine at this many tokens/s per sequence instead
    /// of the real model.
    pub synthetic_tokens_per_sec: Option<f64>,
    /// Front the llama-server at this URL (`--engine upstream`) instead of
    /// running the real model.
    pub upstream_url: Option<String>,
    /// Serve mutual TLS from this `--tls-dir` instead of `--insecure`; the
    /// harness then probes with `probe` (a router certificate).
    pub tls: Option<(PathBuf, Creds)>,
    /// Pass `--worker-id id`; false: the worker names itself (`id` is then
    /// only the name the harness and a static file give it).
    pub pass_worker_id: bool,
    /// Listen on this port (a worker restarted where it was registered);
    /// none: a free one.
    pub port: Option<u16>,
}

impl WorkerOpts {
    /// A synthetic worker serving [`MODEL`] at `tokens_per_sec`, registered
    /// in `etcd`, with the `extra` flags.
    pub fn synthetic(
        id: &str,
        version: &str,
        tokens_per_sec: f64,
        etcd: &str,
        extra: &[&str],
    ) -> Self {
        let mut flags: Vec<String> = vec!["--model-name".into(), MODEL.into()];
        flags.extend(extra.iter().map(|s| s.to_string()));
        Self {
            version: version.into(),
            etcd: Some(etcd.into()),
            extra: flags,
            synthetic_tokens_per_sec: Some(tokens_per_sec),
            ..Self::new(id)
        }
    }

    /// A worker with this id, version v1, no etcd.
    pub fn new(id: &str) -> Self {
        Self {
            id: id.into(),
            version: "v1".into(),
            etcd: None,
            extra: vec![],
            synthetic_tokens_per_sec: None,
            upstream_url: None,
            tls: None,
            pass_worker_id: true,
            port: None,
        }
    }
}

impl WorkerProc {
    /// Starts a worker (the real model unless `opts` asks for the synthetic
    /// engine) and waits until it serves.
    pub async fn start(opts: WorkerOpts, dir: &Path) -> Result<Self> {
        let port = opts.port.unwrap_or_else(free_port);
        let mut args: Vec<String> = transport_args(opts.tls.as_ref().map(|t| t.0.as_path()));
        args.extend([
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--model-version".into(),
            opts.version.clone(),
        ]);
        if opts.pass_worker_id {
            args.extend(["--worker-id".into(), opts.id.clone()]);
        }
        match (opts.synthetic_tokens_per_sec, &opts.upstream_url) {
            (_, Some(url)) => args.extend([
                "--engine".into(),
                "upstream".into(),
                "--upstream-url".into(),
                url.clone(),
                "--model-name".into(),
                MODEL.into(),
            ]),
            (Some(rate), None) => args.extend([
                "--engine".into(),
                "synthetic".into(),
                "--synthetic-tokens-per-sec".into(),
                rate.to_string(),
            ]),
            (None, None) => args.extend([
                "--model".into(),
                model_path().display().to_string(),
                "--threads".into(),
                "1".into(),
            ]),
        }
        if let Some(e) = &opts.etcd {
            args.extend(["--etcd".into(), e.clone()]);
        }
        args.extend(opts.extra.iter().cloned());
        let mut proc = Proc::spawn(&opts.id, &bin("tokenmesh-worker"), &args, dir)?;
        let addr = format!("http://127.0.0.1:{port}");
        let creds = opts.tls.as_ref().map(|t| t.1.clone());
        let what = format!("worker {}", opts.id);
        let serving = (addr.as_str(), creds.as_ref());
        wait_serving(
            &mut proc,
            &what,
            Duration::from_secs(60),
            serving,
            |ch| async move { WorkerClient::new(ch).status(StatusRequest {}).await.is_ok() },
        )
        .await?;
        Ok(Self {
            id: opts.id,
            addr,
            proc,
            creds,
        })
    }

    /// A Worker client.
    pub async fn client(&self) -> WorkerClient<Channel> {
        WorkerClient::new(
            channel(&self.addr, self.creds.as_ref())
                .await
                .expect("connecting to a worker"),
        )
    }

    /// Its `Worker.Status`; the test fails if it does not answer.
    pub async fn status(&self) -> StatusResponse {
        self.client()
            .await
            .status(StatusRequest {})
            .await
            .expect("Worker.Status answers")
            .into_inner()
    }
}

/// A router process.
pub struct RouterProc {
    /// `http://127.0.0.1:PORT` of the Inference API.
    pub addr: String,
    pub proc: Proc,
    /// What the harness's own clients present (mTLS routers only).
    pub creds: Option<Creds>,
}

impl RouterProc {
    /// Starts a plaintext router with the given discovery arguments and waits until it serves.
    pub async fn start(discovery: &[String], dir: &Path) -> Result<Self> {
        Self::start_tls(discovery, None, dir).await
    }

    /// Starts a router; with `tls` = (its `--tls-dir`, the client
    /// credentials the harness probes with) it serves mutual TLS.
    pub async fn start_tls(
        discovery: &[String],
        tls: Option<(PathBuf, Creds)>,
        dir: &Path,
    ) -> Result<Self> {
        let port = free_port();
        let mut args: Vec<String> = transport_args(tls.as_ref().map(|t| t.0.as_path()));
        args.extend([
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--status-interval-ms".into(),
            "200".into(),
        ]);
        args.extend(discovery.iter().cloned());
        let mut proc = Proc::spawn("router", &bin("tokenmesh-router"), &args, dir)?;
        let addr = format!("http://127.0.0.1:{port}");
        let creds = tls.map(|t| t.1);
        let serving = (addr.as_str(), creds.as_ref());
        wait_serving(
            &mut proc,
            "router",
            Duration::from_secs(30),
            serving,
            |ch| async move {
                let probe = ListModelsRequest {};
                InferenceClient::new(ch).list_models(probe).await.is_ok()
            },
        )
        .await?;
        Ok(Self { addr, proc, creds })
    }

    /// Starts a router as [`RouterProc::start_tls`] does and waits until it
    /// sees `ready` ready workers of `MODEL`; the test fails otherwise.
    pub async fn start_ready(
        discovery: &[String],
        tls: Option<(PathBuf, Creds)>,
        dir: &Path,
        ready: usize,
    ) -> Self {
        let router = Self::start_tls(discovery, tls, dir)
            .await
            .expect("router starts");
        router
            .wait_ready_workers(MODEL, ready, Duration::from_secs(20))
            .await
            .expect("the workers become ready behind the router");
        router
    }

    /// An Inference client.
    pub async fn client(&self) -> InferenceClient<Channel> {
        InferenceClient::new(
            channel(&self.addr, self.creds.as_ref())
                .await
                .expect("connecting to the router"),
        )
    }

    /// Waits until the router sees exactly `want` ready workers of `model`.
    pub async fn wait_ready_workers(
        &self,
        model: &str,
        want: usize,
        timeout: Duration,
    ) -> Result<Vec<String>> {
        let deadline = Instant::now() + timeout;
        let mut client = self.client().await;
        loop {
            let resp = client.list_models(ListModelsRequest {}).await?.into_inner();
            let ready: Vec<String> = resp
                .models
                .iter()
                .filter(|m| m.name == model)
                .flat_map(|m| m.versions.iter().flat_map(|v| v.worker_ids.clone()))
                .collect();
            if ready.len() == want {
                return Ok(ready);
            }
            if Instant::now() > deadline {
                bail!("router sees {ready:?}, wanted {want} ready workers");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Writes a static discovery file listing `workers` (all serving `MODEL` v1)
/// into `dir`; returns its path for `--static`.
pub fn static_file(dir: &Path, workers: &[&WorkerProc]) -> String {
    let mut toml = String::new();
    for w in workers {
        toml.push_str(&format!(
            "[[workers]]\nid = \"{}\"\nmodel = \"{MODEL}\"\nversion = \"v1\"\naddr = \"{}\"\n\n",
            w.id, w.addr
        ));
    }
    let path = dir.join("static.toml");
    std::fs::write(&path, toml).expect("writing the static discovery file");
    path.display().to_string()
}

/// Waits up to `timeout` until the worker reports no active sequence.
pub async fn wait_idle(worker: &WorkerProc, timeout: Duration) -> bool {
    let wc = worker.client().await;
    eventually(timeout, || {
        let mut wc = wc.clone();
        async move {
            wc.status(StatusRequest {})
                .await
                .map(|s| s.into_inner().active_sequences == 0)
                .unwrap_or(false)
        }
    })
    .await
}

/// A plaintext router over a static file listing `workers`, started with the
/// `extra` flags, once every listed worker is ready behind it.
pub async fn static_router(dir: &Path, workers: &[&WorkerProc], extra: &[&str]) -> RouterProc {
    let mut args = vec!["--static".to_string(), static_file(dir, workers)];
    args.extend(extra.iter().map(|s| s.to_string()));
    RouterProc::start_ready(&args, None, dir, workers.len()).await
}

/// A plaintext router discovering workers through `etcd`, started with the
/// `extra` flags, once `ready` workers of `MODEL` are ready behind it.
pub async fn etcd_router(dir: &Path, etcd: &Etcd, ready: usize, extra: &[&str]) -> RouterProc {
    let mut args = vec!["--etcd".to_string(), etcd.url.clone()];
    args.extend(extra.iter().map(|s| s.to_string()));
    RouterProc::start_ready(&args, None, dir, ready).await
}

/// A worker running the real model (v1, no etcd) with the `extra` flags.
pub async fn real_worker(id: &str, extra: &[&str], dir: &Path) -> WorkerProc {
    let opts = WorkerOpts {
        extra: extra.iter().map(|s| s.to_string()).collect(),
        ..WorkerOpts::new(id)
    };
    WorkerProc::start(opts, dir).await.expect("worker starts")
}
