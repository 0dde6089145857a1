//! `meshctl up`: a local mesh of one router and N workers as separate
//! processes, with static discovery (no etcd needed).
use crate::children::Children;
use crate::mesh;
use anyhow::{bail, Context};
use std::path::PathBuf;
use std::time::Duration;
use tokenmesh_worker::model_cache::ModelSource;

/// Settings of the local mesh.
#[derive(clap::Args, Debug, Clone)]
pub struct UpArgs {
    #[command(flatten)]
    pub source: ModelSource,
    /// Number of worker processes.
    #[arg(long, default_value_t = 2)]
    pub workers: u16,
    /// Router address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: String,
    /// The router's OpenAI-compatible HTTP address (DESIGN.md's port 8080).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub http_listen: String,
    /// Port of the first worker; the others follow.
    #[arg(long, default_value_t = 50061)]
    pub worker_base_port: u16,
    /// Compute threads per worker (default: cores / workers, at least 1).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Directory for the static discovery file and logs (default: a temporary one).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Where development certificates are created on first use and kept
    /// (default: ~/.config/tokenmesh/dev-certs).
    #[arg(long, env = "TOKENMESH_DEV_CERTS")]
    pub certs_dir: Option<PathBuf>,
    /// Plaintext gRPC with no certificates (development only).
    #[arg(long)]
    pub insecure: bool,
    /// Exit once the mesh is ready instead of serving until Ctrl-C (for scripts and tests).
    #[arg(long)]
    pub check: bool,
}

/// A started local mesh.
struct Up {
    mesh: Children,
    run_dir: PathBuf,
    model_name: String,
    /// The development certificates (None: plaintext).
    certs: Option<PathBuf>,
}

/// Starts the mesh, waits until it serves, prints how to call it and serves
/// until Ctrl-C or SIGTERM.
pub async fn up(args: UpArgs) -> anyhow::Result<()> {
    let mut up = start(&args).await?;
    if let Err(e) = mesh::wait_ready(
        &mut up.mesh,
        &args.listen,
        up.certs.as_deref(),
        &up.model_name,
        args.workers as u32,
        Duration::from_secs(120),
    )
    .await
    {
        up.mesh.stop(Duration::from_secs(15)).await;
        bail!("{e:#}\nlogs are in {}", up.run_dir.display());
    }
    println!("{}", usage(&args, &up));
    if args.check {
        up.mesh.stop(Duration::from_secs(15)).await;
        return Ok(());
    }
    println!("press Ctrl-C to stop");
    serve_until_stopped(up).await
}

/// Resolves the model, creates the certificates and starts every process.
async fn start(args: &UpArgs) -> anyhow::Result<Up> {
    let (model, model_name) = mesh::model(&args.source).await?;
    let worker_bin = crate::children::sibling("tokenmesh-worker")?;
    let router_bin = crate::children::sibling("tokenmesh-router")?;
    let run_dir = match &args.run_dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("tokenmesh-{}", std::process::id())),
    };
    std::fs::create_dir_all(&run_dir)?;
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let threads = args
        .threads
        .unwrap_or_else(|| (cores / args.workers.max(1) as usize).max(1));
    let worker_ids: Vec<String> = (1..=args.workers).map(|i| format!("worker-{i}")).collect();
    let certs = dev_certs(args, &worker_ids)?;
    let mut mesh = Children::default();
    eprintln!(
        "starting {} workers of {model_name} ({})",
        args.workers,
        model.display()
    );
    let mut listed = Vec::new();
    for (i, id) in worker_ids.iter().enumerate() {
        let port = args.worker_base_port + i as u16;
        let tls = certs.as_deref().map(|d| tokenmesh_certs::worker_dir(d, id));
        let mut wargs = transport(tls);
        wargs.extend([
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--model".into(),
            model.display().to_string(),
            "--model-name".into(),
            model_name.clone(),
            "--model-version".into(),
            "v1".into(),
            "--worker-id".into(),
            id.clone(),
            "--threads".into(),
            threads.to_string(),
        ]);
        mesh.spawn(id, &worker_bin, &wargs, &run_dir.join(format!("{id}.log")))?;
        listed.push(mesh::StaticWorker {
            id: id.clone(),
            port,
            capacity: None,
        });
    }
    let static_path = run_dir.join("static.toml");
    std::fs::write(&static_path, mesh::static_discovery(&model_name, &listed))?;
    let mut rargs = transport(certs.clone());
    rargs.extend([
        "--listen".into(),
        args.listen.clone(),
        "--static".into(),
        static_path.display().to_string(),
        "--http-listen".into(),
        args.http_listen.clone(),
    ]);
    mesh.spawn("router", &router_bin, &rargs, &run_dir.join("router.log"))?;
    Ok(Up {
        mesh,
        run_dir,
        model_name,
        certs,
    })
}

/// The development certificates, created on first use (None with --insecure).
fn dev_certs(args: &UpArgs, worker_ids: &[String]) -> anyhow::Result<Option<PathBuf>> {
    if args.insecure {
        eprintln!("INSECURE: plaintext gRPC with no identities (--insecure); development only");
        return Ok(None);
    }
    let dir = args
        .certs_dir
        .clone()
        .unwrap_or_else(crate::client::default_dev_certs);
    tokenmesh_certs::ensure_dev_bundle(&dir, worker_ids)
        .with_context(|| format!("creating development certificates in {}", dir.display()))?;
    Ok(Some(dir))
}

/// `--tls-dir DIR`, or `--insecure` without one.
fn transport(tls_dir: Option<PathBuf>) -> Vec<String> {
    match tls_dir {
        Some(d) => vec!["--tls-dir".into(), d.display().to_string()],
        None => vec!["--insecure".into()],
    }
}

/// How to call the mesh that is up.
fn usage(args: &UpArgs, up: &Up) -> String {
    let model_name = &up.model_name;
    let body = format!(
        "'{{\"model\":\"{model_name}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hi!\"}}],\"max_tokens\":32}}'"
    );
    let (mode, grpcurl_tls, meshctl_tls, curl_tls, scheme) = match &up.certs {
        Some(d) => (
            format!(
                "mutual TLS; client certificate {c}/client.pem, key {c}/client.key, CA {c}/ca.pem",
                c = d.display()
            ),
            format!(
                "-cacert {c}/ca.pem -cert {c}/client.pem -key {c}/client.key",
                c = d.display()
            ),
            format!("--tls-dir {}", d.display()),
            format!(
                "--cacert {c}/ca.pem --cert {c}/client.pem --key {c}/client.key ",
                c = d.display()
            ),
            "https",
        ),
        None => (
            "plaintext, development only".to_string(),
            "-plaintext".to_string(),
            "--insecure".to_string(),
            String::new(),
            "http",
        ),
    };
    format!(
        "tokenmesh is up: router {listen} ({mode}), {n} workers of {model_name}\n\
         logs and static discovery file: {dir}\n\n\
         try it:\n  meshctl generate --router {listen} {meshctl_tls} \"What is the capital of France?\"\n  \
         grpcurl {grpcurl_tls} -d {body} {listen} tokenmesh.v1.Inference/Generate\n  \
         curl -N {curl_tls}{scheme}://{http}/v1/chat/completions -H 'Content-Type: application/json' \
         -d {stream_body}\n",
        listen = args.listen,
        http = args.http_listen,
        stream_body = body.replacen('{', "{\"stream\":true,", 1),
        n = args.workers,
        dir = up.run_dir.display()
    )
}

/// Serves until Ctrl-C or SIGTERM, or until a process of the mesh exits.
async fn serve_until_stopped(mut up: Up) -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut poll = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = poll.tick() => {
                if let Some(what) = up.mesh.exited() {
                    eprintln!("{what}; stopping the mesh (logs in {})", up.run_dir.display());
                    up.mesh.stop(Duration::from_secs(15)).await;
                    bail!("{what}");
                }
            }
        }
    }
    eprintln!("stopping");
    up.mesh.stop(Duration::from_secs(15)).await;
    Ok(())
}
