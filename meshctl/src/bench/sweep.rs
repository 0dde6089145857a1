//! `meshctl bench sweep`: for every worker count and max batch size, start
//! that many worker processes and a router with a static discovery file, load
//! the router at every concurrency, then stop them; write the reports as JSON
//! lines and heatmaps of tokens/s and p99 latency.
use super::heatmap::{self, Grid};
use super::load::{self, LoadArgs};
use super::report::{self, Format, Report};
use super::transport::TlsArgs;
use super::workload::ShapeArgs;
use super::OutputArgs;
use crate::children::Children;
use crate::mesh::{static_discovery, wait_ready, StaticWorker};
use anyhow::{bail, Context};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokenmesh_worker::model_cache::ModelSource;

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
    /// Real engine: the model (--model, --model-cache, --python).
    #[command(flatten)]
    pub source: ModelSource,
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
    #[command(flatten)]
    pub shape: ShapeArgs,
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
            let (path, name) = crate::mesh::model(&args.source).await?;
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
    let mut listed = Vec::new();
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
        listed.push(StaticWorker {
            id,
            port,
            capacity: Some(max_batch),
        });
    }
    let static_path = dir.join(format!("static-w{workers}-b{max_batch}.toml"));
    std::fs::write(&static_path, static_discovery(&plan.model_name, &listed))?;
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
    let ready = wait_ready(
        &mut procs,
        &router_addr,
        None,
        &plan.model_name,
        workers,
        Duration::from_secs(60),
    )
    .await;
    if let Err(e) = ready {
        procs.stop(Duration::from_secs(10)).await;
        bail!("{e:#}; logs in {}", dir.display());
    }
    Ok((procs, router_addr))
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
    for &w in &args.workers {
        for &b in &args.max_batch {
            let (mut procs, router) = start_mesh(&plan, &args, w, b, &logs).await?;
            for &c in &args.concurrency {
                eprintln!(
                    "[{}/{total}] workers={w} max_batch={b} concurrency={c}",
                    results.len() + 1
                );
                let load = point_load(&args, &router, &plan.model_name, c);
                let run = match load::run(&load, output.progress()).await {
                    Ok(run) => run,
                    Err(e) => {
                        procs.stop(Duration::from_secs(10)).await;
                        return Err(e.context(format!("workers={w} max_batch={b} concurrency={c}")));
                    }
                };
                let r = report::summarize(&run, point_labels(&args, w, b, c));
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
    let (tps, p99) = write_heatmaps(&args, &plan, &results)?;
    eprintln!(
        "wrote {}, {} and {}",
        jsonl_path.display(),
        tps.display(),
        p99.display()
    );
    Ok(())
}

/// The closed-loop load of one grid point.
fn point_load(args: &SweepArgs, router: &str, model: &str, concurrency: u32) -> LoadArgs {
    LoadArgs {
        target: router.to_string(),
        direct: false,
        api: super::load::Api::Grpc,
        http2: false,
        extra_body: None,
        model: Some(model.to_string()),
        concurrency: concurrency as usize,
        rate: None,
        max_in_flight: concurrency as usize,
        duration: args.duration,
        requests: None,
        warmup: args.warmup,
        shape: args.shape,
        temperature: None,
        ignore_eos: false,
        seed: args.seed,
        connections: 1,
        drain_timeout: 60.0,
        tls: TlsArgs::default(),
    }
}

/// The labels of one grid point's report.
fn point_labels(args: &SweepArgs, w: u32, b: u32, c: u32) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "engine".to_string(),
            format!("{:?}", args.engine).to_lowercase(),
        ),
        ("workers".to_string(), w.to_string()),
        ("max_batch".to_string(), b.to_string()),
        ("concurrency".to_string(), c.to_string()),
        ("max_tokens".to_string(), args.shape.max_tokens.to_string()),
    ])
}

/// Writes the tokens/s and p99 latency heatmaps; their paths.
fn write_heatmaps(
    args: &SweepArgs,
    plan: &Plan,
    results: &BTreeMap<(u32, u32, u32), Report>,
) -> anyhow::Result<(PathBuf, PathBuf)> {
    let grid = Grid {
        workers: args.workers.clone(),
        max_batch: args.max_batch.clone(),
        concurrency: args.concurrency.clone(),
    };
    let engine = match args.engine {
        Engine::Synthetic => format!(
            "synthetic engine, {} tok/s per sequence",
            args.synthetic_tokens_per_sec
        ),
        Engine::Model => format!("{}, {} thread(s) per worker", plan.model_name, args.threads),
    };
    let measured = |w, b, c| results.get(&(w, b, c)).filter(|r| r.requests > 0);
    let tps = args.out_dir.join("tokens_per_sec.svg");
    heatmap::write_svg(
        &tps,
        &format!("output tokens/s through the router ({engine})"),
        &grid,
        |w, b, c| measured(w, b, c).map(|r| r.output_tokens_per_sec),
    )?;
    let p99 = args.out_dir.join("p99_latency.svg");
    heatmap::write_svg(
        &p99,
        &format!("p99 end-to-end latency, ms, lower is better ({engine})"),
        &grid,
        |w, b, c| measured(w, b, c).map(|r| r.e2e_ms.p99),
    )?;
    Ok((tps, p99))
}
