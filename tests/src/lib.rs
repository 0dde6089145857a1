//! Harness for the end-to-end suites: starts real etcd, workers and routers on
//! ephemeral loopback ports, waits for them with readiness probes (never fixed
//! sleeps), and stops them when dropped.
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokenmesh_certs::{Ca, Identity, LeafSpec, Role};
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_proto::v1::worker_client::WorkerClient;
use tokenmesh_proto::v1::{
    generate_response::Event, Accepted, ChatMessage, Finished, GenerateRequest, ListModelsRequest,
    StatusRequest,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity as TlsIdentity};

pub mod control;

/// A test CA in a temporary directory that issues `--tls-dir` directories.
pub struct Pki {
    pub dir: tempfile::TempDir,
    pub ca: Ca,
}

impl Pki {
    /// A fresh CA.
    pub fn new() -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let ca = Ca::load_or_create(dir.path())?;
        Ok(Self { dir, ca })
    }

    /// A directory `{role}-{name}` holding ca.pem, {role}.pem and {role}.key
    /// for `spiffe://tokenmesh/{role}/{name}`, valid for a day.
    pub fn issue(&self, role: Role, name: &str) -> Result<PathBuf> {
        self.issue_spec(LeafSpec::new(Identity::new(role, name)?, 1))
    }

    /// Like [`Pki::issue`] with a custom spec (validity, SANs).
    pub fn issue_spec(&self, spec: LeafSpec) -> Result<PathBuf> {
        let role = spec.identity.role;
        let dir = self
            .dir
            .path()
            .join(format!("{role}-{}", spec.identity.name));
        tokenmesh_certs::write_leaf(&dir, role.as_str(), &self.ca.issue(&spec)?, &self.ca)?;
        Ok(dir)
    }

    /// Client credentials from a directory this CA issued.
    pub fn creds(&self, role: Role, name: &str) -> Result<Creds> {
        Ok(Creds::new(self.issue(role, name)?, role))
    }
}

/// What a test client presents: a `--tls-dir`-style directory and the role
/// whose certificate in it to use.
#[derive(Clone, Debug)]
pub struct Creds {
    pub dir: PathBuf,
    pub role: Role,
}

impl Creds {
    /// Credentials in `dir` for `role`.
    pub fn new(dir: PathBuf, role: Role) -> Self {
        Self { dir, role }
    }

    /// tonic's client TLS config: trusts ca.pem, presents {role}.pem.
    pub fn tls_config(&self) -> Result<ClientTlsConfig> {
        let read = |name: String| std::fs::read(self.dir.join(name));
        Ok(ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read("ca.pem".into())?))
            .identity(TlsIdentity::from_pem(
                read(format!("{}.pem", self.role))?,
                read(format!("{}.key", self.role))?,
            )))
    }
}

/// A channel to `addr` (`http://host:port`): mutual TLS with `creds`, or
/// plaintext without.
pub async fn channel(addr: &str, creds: Option<&Creds>) -> Result<Channel> {
    Ok(match creds {
        Some(c) => {
            Channel::from_shared(addr.replacen("http://", "https://", 1))?
                .tls_config(c.tls_config()?)?
                .connect()
                .await?
        }
        None => Channel::from_shared(addr.to_string())?.connect().await?,
    })
}

/// Where the release binaries are: `TOKENMESH_BIN_DIR`, else the profile
/// directory this test binary was built into (target/<profile>/deps/..).
pub fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TOKENMESH_BIN_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

/// A binary of the workspace; it must have been built (`cargo build --release`).
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.is_file(),
        "{} is missing: build the workspace first (cargo build --release --workspace)",
        p.display()
    );
    p
}

/// The model file: `TOKENMESH_TEST_MODEL`, else the default model's cache path.
pub fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("TOKENMESH_TEST_MODEL") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let cache = std::env::var_os("TOKENMESH_MODEL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".cache/tokenmesh/models"));
    let p = cache.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "model file {} is missing: run scripts/test.sh (it fetches the model) or set TOKENMESH_TEST_MODEL",
        p.display()
    );
    p
}

/// The name the default model is served under.
pub const MODEL: &str = "smollm2-135m-instruct";

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding an ephemeral port")
}

/// A child process killed (SIGKILL) when dropped, with its output in a log file.
pub struct Proc {
    pub name: String,
    child: Child,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `program args`, logging to `dir/name.log`.
    pub fn spawn(name: &str, program: &Path, args: &[String], dir: &Path) -> Result<Self> {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log)?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        Ok(Self {
            name: name.into(),
            child,
            log,
        })
    }

    /// The process id.
    pub fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(self.child.id() as i32)
    }

    /// Sends a signal.
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(self.pid(), sig);
    }

    /// Waits up to `timeout` for the process to exit; its exit code if it did.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// True while the process runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The log so far, for failure messages.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A single-node etcd from Debian's etcd-server package.
pub struct Etcd {
    pub url: String,
    /// With TLS: what [`Etcd::client`] presents.
    pub creds: Option<Creds>,
    _proc: Proc,
    _dir: tempfile::TempDir,
}

/// etcd client options, with mutual TLS when `creds` are given.
fn etcd_options(creds: Option<&Creds>) -> Result<Option<etcd_client::ConnectOptions>> {
    Ok(match creds {
        Some(c) => Some(etcd_client::ConnectOptions::new().with_tls(c.tls_config()?)),
        None => None,
    })
}

impl Etcd {
    /// Starts etcd on free loopback ports and waits until it answers.
    pub async fn start() -> Result<Self> {
        Self::start_opts(None).await
    }

    /// Starts etcd serving `https://` and demanding client certificates of
    /// `pki`'s CA (etcd's own client-certificate auth).
    pub async fn start_tls(pki: &Pki) -> Result<Self> {
        // etcd is no mesh role: any leaf of the mesh CA with its address in
        // the SANs can serve it; a `control` leaf named etcd is used.
        let server = pki.issue(Role::Control, "etcd")?;
        let probe = pki.creds(Role::Client, "etcd-probe")?;
        Self::start_opts(Some((server, probe))).await
    }

    async fn start_opts(tls: Option<(PathBuf, Creds)>) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let (client, peer) = (free_port(), free_port());
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let args: Vec<String> = [
            "--name",
            "test",
            "--data-dir",
            &dir.path().join("data").display().to_string(),
            "--listen-client-urls",
            &url,
            "--advertise-client-urls",
            &url,
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
            "--initial-cluster",
            &format!("test={peer_url}"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut args = args;
        if let Some((server, _)) = &tls {
            let f = |n: &str| server.join(n).display().to_string();
            args.extend([
                "--cert-file".into(),
                f("control.pem"),
                "--key-file".into(),
                f("control.key"),
                "--trusted-ca-file".into(),
                f("ca.pem"),
                "--client-cert-auth".into(),
            ]);
        }
        let creds = tls.map(|t| t.1);
        let etcd = which("etcd").context("etcd is not installed (apt-get install etcd-server)")?;
        let mut proc = Proc::spawn("etcd", &etcd, &args, dir.path())?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut c) =
                etcd_client::Client::connect([url.as_str()], etcd_options(creds.as_ref())?).await
            {
                if c.get("probe", None).await.is_ok() {
                    break;
                }
            }
            if !proc.running() || Instant::now() > deadline {
                bail!("etcd did not start:\n{}", proc.log_text());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Self {
            url,
            creds,
            _proc: proc,
            _dir: dir,
        })
    }

    /// Stops etcd (SIGKILL), as an outage.
    pub fn kill(&mut self) {
        self._proc.signal(nix::sys::signal::Signal::SIGKILL);
        let _ = self._proc.wait_exit(Duration::from_secs(5));
    }

    /// Every key under `prefix` with its value and lease id.
    pub async fn get_prefix(&self, prefix: &str) -> Vec<(String, String, i64)> {
        let resp = self
            .client()
            .await
            .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
            .await
            .expect("reading the test etcd");
        resp.kvs()
            .iter()
            .map(|kv| {
                (
                    kv.key_str().unwrap_or_default().to_string(),
                    kv.value_str().unwrap_or_default().to_string(),
                    kv.lease(),
                )
            })
            .collect()
    }

    /// A client.
    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect(
            [self.url.as_str()],
            etcd_options(self.creds.as_ref()).expect("etcd client credentials"),
        )
        .await
        .expect("connecting to the test etcd")
    }
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(name))
            .find(|p| p.is_file())
    })
}

/// A worker process.
pub struct WorkerProc {
    pub id: String,
    pub addr: String,
    pub proc: Proc,
    /// What the harness's own clients present (mTLS workers only).
    pub creds: Option<Creds>,
}

/// Options for a worker.
#[derive(Clone, Debug)]
pub struct WorkerOpts {
    pub id: String,
    pub version: String,
    pub etcd: Option<String>,
    pub extra: Vec<String>,
    /// Run the synthetic engine at this many tokens/s per sequence instead
    /// of the real model.
    pub synthetic_tokens_per_sec: Option<f64>,
    /// Serve mutual TLS from this `--tls-dir` instead of `--insecure`; the
    /// harness then probes with `probe` (a router certificate).
    pub tls: Option<(PathBuf, Creds)>,
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
            tls: None,
        }
    }
}

impl WorkerProc {
    /// Starts a worker (the real model unless `opts` asks for the synthetic
    /// engine) and waits until it serves.
    pub async fn start(opts: WorkerOpts, dir: &Path) -> Result<Self> {
        let port = free_port();
        let mut args: Vec<String> = transport_args(opts.tls.as_ref().map(|t| t.0.as_path()));
        args.extend([
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--model-version".into(),
            opts.version.clone(),
            "--worker-id".into(),
            opts.id.clone(),
        ]);
        match opts.synthetic_tokens_per_sec {
            Some(rate) => args.extend([
                "--engine".into(),
                "synthetic".into(),
                "--synthetic-tokens-per-sec".into(),
                rate.to_string(),
            ]),
            None => args.extend([
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
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(ch) = channel(&addr, creds.as_ref()).await {
                if WorkerClient::new(ch).status(StatusRequest {}).await.is_ok() {
                    break;
                }
            }
            if !proc.running() || Instant::now() > deadline {
                bail!("worker {} did not start:\n{}", opts.id, proc.log_text());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
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
}

/// `--tls-dir DIR`, or `--insecure` without one.
fn transport_args(tls_dir: Option<&Path>) -> Vec<String> {
    match tls_dir {
        Some(d) => vec!["--tls-dir".into(), d.display().to_string()],
        None => vec!["--insecure".into()],
    }
}

/// A router process.
pub struct RouterProc {
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
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(ch) = channel(&addr, creds.as_ref()).await {
                if InferenceClient::new(ch)
                    .list_models(ListModelsRequest {})
                    .await
                    .is_ok()
                {
                    break;
                }
            }
            if !proc.running() || Instant::now() > deadline {
                bail!("router did not start:\n{}", proc.log_text());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Self { addr, proc, creds })
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

/// Everything one Generate stream delivered.
#[derive(Debug, Default)]
pub struct Collected {
    pub accepted: Option<Accepted>,
    pub text: String,
    pub token_ids: Vec<u32>,
    pub finished: Option<Finished>,
    pub seqs: Vec<u64>,
}

/// Runs a Generate to its end and collects it; checks seq numbering.
pub async fn collect(
    client: &mut InferenceClient<Channel>,
    req: GenerateRequest,
) -> std::result::Result<Collected, tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = Collected::default();
    while let Some(msg) = stream.message().await? {
        out.seqs.push(msg.seq);
        match msg.event {
            Some(Event::Accepted(a)) => out.accepted = Some(a),
            Some(Event::Delta(d)) => {
                out.text.push_str(&d.text);
                out.token_ids.extend(d.token_ids);
            }
            Some(Event::Finished(f)) => out.finished = Some(f),
            None => {}
        }
    }
    let expected: Vec<u64> = (0..out.seqs.len() as u64).collect();
    assert_eq!(out.seqs, expected, "seq must be 0, 1, 2, ... without gaps");
    Ok(out)
}

/// The France chat of the foundation tests, greedy.
pub fn france_request(max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        model: MODEL.into(),
        messages: vec![
            ChatMessage {
                role: "system".into(),
                content: "You are a helpful assistant.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "What is the capital of France?".into(),
            },
        ],
        max_tokens: Some(max_tokens),
        temperature: Some(0.0),
        ..Default::default()
    }
}

/// Polls `f` until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
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
    let router = RouterProc::start(&args, dir).await.expect("router starts");
    router
        .wait_ready_workers(MODEL, workers.len(), Duration::from_secs(20))
        .await
        .expect("every worker becomes ready behind the router");
    router
}
