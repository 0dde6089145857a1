//! Drives load at one target and records what every request saw.
//!
//! Closed loop: `concurrency` streams, each sending its next request when the
//! last one ends. Open loop: requests arrive as a Poisson process at `rate`
//! per second whatever the target does, up to `max_in_flight` at once.
//! Requests that start during the warm-up are left out of the latency
//! figures; throughput counts the tokens that arrive inside the measurement
//! window. Every loop is bounded: issuing stops at the end of the window (or
//! after `--requests` measured requests) and every request is cut off at the
//! window end plus `--drain-timeout`.
use super::openai::{OpenAi, Tick};
use super::transport::{self, TlsArgs};
use super::workload::{Shape, ShapeArgs, Workload};
use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng;
use rand_distr::{Distribution, Exp};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_proto::v1::worker_client::WorkerClient;
use tokenmesh_proto::v1::{
    generate_response::Event, GenerateRequest, GenerateResponse, ListModelsRequest, StatusRequest,
    WorkerGenerateRequest,
};
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::Streaming;

/// Where and how hard to send load.
#[derive(clap::Args, Debug, Clone)]
pub struct LoadArgs {
    /// Address of the router, or of a worker with --direct.
    #[arg(long, env = "TOKENMESH_ROUTER", default_value = "127.0.0.1:50051")]
    pub target: String,
    /// Call a worker's Worker.Generate directly instead of a router's Inference.Generate.
    #[arg(long, conflicts_with = "api")]
    pub direct: bool,
    /// The router API to load: `grpc` (Inference.Generate), or `openai`
    /// (streamed POST /v1/completions on the router's --http-listen address,
    /// given as --target).
    #[arg(long, value_enum, default_value_t = Api::Grpc)]
    pub api: Api,
    /// With --api openai: HTTP/2 (prior knowledge), every stream over the
    /// --connections, instead of HTTP/1.1 with one connection per stream.
    #[arg(long)]
    pub http2: bool,
    /// With --api openai: a JSON object whose fields are set on every
    /// completion request's body (replacing any of the same name), e.g.
    /// '{"cache_prompt": false}' to turn off the prompt cache of a
    /// llama-server called directly.
    #[arg(long, value_name = "JSON", value_parser = super::openai::parse_extra_body)]
    pub extra_body: Option<super::openai::ExtraBody>,
    /// Model name (default: the only model the target serves).
    #[arg(long)]
    pub model: Option<String>,
    /// Closed loop: streams kept in flight, each sending its next request when the last ends.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Open loop instead: Poisson arrivals at this many requests per second.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Open loop: most requests in flight; arrivals beyond it are counted as
    /// CLIENT_LIMIT errors instead of sent.
    #[arg(long, default_value_t = 512)]
    pub max_in_flight: usize,
    /// Seconds of measurement after the warm-up.
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Also stop after this many measured requests.
    #[arg(long)]
    pub requests: Option<u64>,
    /// Seconds of load before measuring; requests started in it are not reported.
    #[arg(long, default_value_t = 1.0)]
    pub warmup: f64,
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// Sampling temperature (default: the server's).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Generate every request's max_tokens: the model's end-of-turn tokens
    /// are never sampled, so settings compare on equal work.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Seed of the prompts, max_tokens and arrival times.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// HTTP/2 connections to the target, used round-robin.
    #[arg(long, default_value_t = 1)]
    pub connections: usize,
    /// Seconds requests in flight at the end may take to finish.
    #[arg(long, default_value_t = 30.0)]
    pub drain_timeout: f64,
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// Which API of the router `meshctl bench` loads.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Api {
    #[default]
    Grpc,
    Openai,
}

/// What one request saw. Times are offsets from the run's start.
#[derive(Debug, Clone)]
pub struct Sample {
    pub start: Duration,
    pub end: Duration,
    /// Arrival time of each delta that carried tokens, and how many.
    pub tokens: Vec<(Duration, u32)>,
    /// None: completed with a Finished message; else the status code name.
    pub error: Option<String>,
    /// With an error: what the failure said (a status's message, an HTTP
    /// error's causes).
    pub detail: Option<String>,
}

/// A finished run.
#[derive(Debug)]
pub struct Run {
    pub samples: Vec<Sample>,
    /// The measurement window.
    pub window: (Duration, Duration),
    pub model: String,
}

/// Connections and the API to call.
#[derive(Clone)]
struct Target {
    channels: Arc<Vec<Channel>>,
    next: Arc<AtomicUsize>,
    direct: bool,
    /// `--api openai`: the HTTP client instead of the channels.
    openai: Option<OpenAi>,
}

impl Target {
    async fn generate(
        &self,
        req: GenerateRequest,
    ) -> Result<Streaming<GenerateResponse>, tonic::Status> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.channels.len();
        let channel = self.channels[i].clone();
        let resp = if self.direct {
            WorkerClient::new(channel)
                .generate(WorkerGenerateRequest {
                    request: Some(req),
                    ..Default::default()
                })
                .await?
        } else {
            InferenceClient::new(channel).generate(req).await?
        };
        Ok(resp.into_inner())
    }

    /// The model to ask for when none is given.
    async fn default_model(&self) -> anyhow::Result<String> {
        if let Some(openai) = &self.openai {
            return openai.default_model().await;
        }
        let channel = self.channels[0].clone();
        if self.direct {
            let status = WorkerClient::new(channel).status(StatusRequest {}).await?;
            return Ok(status.into_inner().model);
        }
        router_model(channel).await
    }
}

/// Shared between the issuing loops.
struct Shared {
    target: Target,
    model: String,
    temperature: Option<f32>,
    ignore_eos: bool,
    workload: Mutex<Workload>,
    samples: Mutex<Vec<Sample>>,
    t0: Instant,
    warm_end: Instant,
    issue_end: Instant,
    hard_end: Instant,
    /// Measured requests issued so far, against `--requests`.
    measured_issued: AtomicU64,
    max_measured: u64,
    completed: AtomicU64,
    tokens: AtomicU64,
}

impl Shared {
    /// Claims the right to issue one more request; false once issuing stops.
    fn may_issue(&self) -> bool {
        let now = Instant::now();
        if now >= self.issue_end {
            return false;
        }
        if now >= self.warm_end {
            return self.measured_issued.fetch_add(1, Ordering::SeqCst) < self.max_measured;
        }
        true
    }

    fn shape(&self) -> Shape {
        self.workload.lock().expect("workload lock").next_shape()
    }

    async fn one(&self, shape: Shape) {
        let start = Instant::now();
        let req = GenerateRequest {
            model: self.model.clone(),
            prompt: shape.prompt,
            max_tokens: Some(shape.max_tokens),
            temperature: self.temperature,
            ignore_eos: self.ignore_eos,
            ..Default::default()
        };
        let mut tokens = Vec::new();
        if let Some(openai) = &self.target.openai {
            let outcome = tokio::time::timeout_at(self.hard_end, async {
                let mut stream = openai.generate(&req).await?;
                while let Some(tick) = stream.next().await? {
                    match tick {
                        Tick::Tokens(n) => {
                            self.tokens.fetch_add(n as u64, Ordering::Relaxed);
                            tokens.push((self.t0.elapsed(), n));
                        }
                        Tick::Done => break,
                    }
                }
                let done = stream.done();
                if done {
                    stream.finish().await;
                }
                Ok::<bool, super::openai::Failure>(done)
            })
            .await;
            let failure = match outcome {
                Ok(Ok(true)) => None,
                Ok(Ok(false)) => Some(("INCOMPLETE".to_string(), String::new())),
                Ok(Err(f)) => Some((f.code, f.detail)),
                Err(_) => Some(("CLIENT_TIMEOUT".to_string(), String::new())),
            };
            self.record(start, tokens, failure);
            return;
        }
        let outcome = tokio::time::timeout_at(self.hard_end, async {
            let mut stream = self.target.generate(req).await?;
            let mut count = tokenmesh_proto::delta::TokenCount::default();
            while let Some(msg) = stream.message().await? {
                match msg.event {
                    Some(Event::Delta(d)) => {
                        let n = count.add(&d);
                        if n > 0 {
                            self.tokens.fetch_add(n as u64, Ordering::Relaxed);
                            tokens.push((self.t0.elapsed(), n));
                        }
                    }
                    Some(Event::Finished(_)) => return Ok(true),
                    _ => {}
                }
            }
            Ok::<bool, tonic::Status>(false)
        })
        .await;
        let failure = match outcome {
            Ok(Ok(true)) => None,
            Ok(Ok(false)) => Some(("INCOMPLETE".to_string(), String::new())),
            Ok(Err(status)) => Some((
                tokenmesh_proto::codes::code_name(status.code()).to_string(),
                status.message().to_string(),
            )),
            Err(_) => Some(("CLIENT_TIMEOUT".to_string(), String::new())),
        };
        self.record(start, tokens, failure);
    }

    /// Books one finished request; `failure` is its status code name and
    /// what the failure said.
    fn record(
        &self,
        start: Instant,
        tokens: Vec<(Duration, u32)>,
        failure: Option<(String, String)>,
    ) {
        self.completed.fetch_add(1, Ordering::Relaxed);
        let (error, detail) = match failure {
            Some((code, detail)) => (Some(code), Some(detail).filter(|d| !d.is_empty())),
            None => (None, None),
        };
        self.samples.lock().expect("samples lock").push(Sample {
            start: start - self.t0,
            end: self.t0.elapsed(),
            tokens,
            error,
            detail,
        });
    }

    fn refuse(&self, code: &str) {
        let now = self.t0.elapsed();
        self.samples.lock().expect("samples lock").push(Sample {
            start: now,
            end: now,
            tokens: vec![],
            error: Some(code.to_string()),
            detail: None,
        });
    }
}

/// Runs the load described by `args`; `progress` shows it while it runs.
pub async fn run(args: &LoadArgs, progress: bool) -> anyhow::Result<Run> {
    anyhow::ensure!(args.concurrency >= 1, "--concurrency must be at least 1");
    anyhow::ensure!(
        args.duration > 0.0 && args.duration.is_finite(),
        "--duration must be positive"
    );
    anyhow::ensure!(args.warmup >= 0.0, "--warmup must not be negative");
    if let Some(r) = args.rate {
        anyhow::ensure!(r > 0.0 && r.is_finite(), "--rate must be positive");
    }
    let mut channels = Vec::new();
    let mut openai = None;
    if args.api == Api::Openai {
        anyhow::ensure!(
            args.tls.tls_dir.is_none(),
            "--api openai speaks plaintext HTTP only (TLS is not supported by the load generator yet)"
        );
        openai = Some(OpenAi::new(
            &args.target,
            args.http2,
            args.extra_body.clone().unwrap_or_default(),
        )?);
    } else {
        anyhow::ensure!(
            args.extra_body.is_none(),
            "--extra-body goes with --api openai (a gRPC request has no JSON body)"
        );
        for _ in 0..args.connections.max(1) {
            channels.push(transport::connect(&args.target, &args.tls).await?);
        }
    }
    let target = Target {
        channels: Arc::new(channels),
        next: Arc::new(AtomicUsize::new(0)),
        direct: args.direct,
        openai,
    };
    let model = match &args.model {
        Some(m) => m.clone(),
        None => target.default_model().await?,
    };
    let t0 = Instant::now();
    let warm_end = t0 + Duration::from_secs_f64(args.warmup);
    let issue_end = warm_end + Duration::from_secs_f64(args.duration);
    let shared = Arc::new(Shared {
        target,
        model: model.clone(),
        temperature: args.temperature,
        ignore_eos: args.ignore_eos,
        workload: Mutex::new(Workload::new(args.seed, args.shape)),
        samples: Mutex::new(Vec::new()),
        t0,
        warm_end,
        issue_end,
        hard_end: issue_end + Duration::from_secs_f64(args.drain_timeout.max(0.0)),
        measured_issued: AtomicU64::new(0),
        max_measured: args.requests.unwrap_or(u64::MAX),
        completed: AtomicU64::new(0),
        tokens: AtomicU64::new(0),
    });

    let bar = progress_bar(progress, args.warmup + args.duration);
    let ticker = tokio::spawn(show_progress(shared.clone(), bar.clone()));

    match args.rate {
        None => closed_loop(&shared, args.concurrency).await,
        Some(rate) => open_loop(&shared, rate, args.max_in_flight, args.seed).await?,
    }
    ticker.abort();
    bar.finish_and_clear();

    let samples = std::mem::take(&mut *shared.samples.lock().expect("samples lock"));
    let window = measured_window(&shared, &samples);
    Ok(Run {
        samples,
        window,
        model,
    })
}

/// Updates the progress bar every 200 ms until aborted.
async fn show_progress(shared: Arc<Shared>, bar: ProgressBar) {
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tick.tick().await;
        let secs = shared.t0.elapsed().as_secs_f64();
        bar.set_position((secs * 10.0) as u64);
        let phase = if Instant::now() < shared.warm_end {
            "warm-up"
        } else {
            "measuring"
        };
        bar.set_message(format!(
            "{phase}: {} requests, {} tokens",
            shared.completed.load(Ordering::Relaxed),
            shared.tokens.load(Ordering::Relaxed)
        ));
    }
}

/// The measured window, from the end of the warm-up: count-bound runs end
/// when their last measured request does, time-bound ones at the end of the
/// window.
fn measured_window(shared: &Shared, samples: &[Sample]) -> (Duration, Duration) {
    let warm = shared.warm_end - shared.t0;
    let issue = shared.issue_end - shared.t0;
    let count_bound = shared.measured_issued.load(Ordering::SeqCst) >= shared.max_measured;
    let end = if count_bound {
        samples
            .iter()
            .filter(|s| s.start >= warm)
            .map(|s| s.end)
            .max()
            .unwrap_or(issue)
            .min(issue)
            .max(warm + Duration::from_millis(1))
    } else {
        issue
    };
    (warm, end)
}

async fn closed_loop(shared: &Arc<Shared>, concurrency: usize) {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let shared = shared.clone();
        tasks.spawn(async move {
            while shared.may_issue() {
                let shape = shared.shape();
                shared.one(shape).await;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

async fn open_loop(
    shared: &Arc<Shared>,
    rate: f64,
    max_in_flight: usize,
    seed: u64,
) -> anyhow::Result<()> {
    let gaps = Exp::new(rate)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let in_flight = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    let mut next = Instant::now();
    loop {
        next += Duration::from_secs_f64(gaps.sample(&mut rng));
        if next >= shared.issue_end {
            break;
        }
        tokio::time::sleep_until(next).await;
        // Reap finished tasks so the set stays small on long runs.
        while tasks.try_join_next().is_some() {}
        if !shared.may_issue() {
            break;
        }
        if in_flight.load(Ordering::SeqCst) >= max_in_flight {
            shared.refuse("CLIENT_LIMIT");
            continue;
        }
        in_flight.fetch_add(1, Ordering::SeqCst);
        let (shared, in_flight) = (shared.clone(), in_flight.clone());
        let shape = shared.shape();
        tasks.spawn(async move {
            shared.one(shape).await;
            in_flight.fetch_sub(1, Ordering::SeqCst);
        });
    }
    while tasks.join_next().await.is_some() {}
    Ok(())
}

fn progress_bar(show: bool, secs: f64) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new((secs * 10.0).ceil() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {elapsed:>3} {msg}")
            .expect("a valid progress template"),
    );
    bar
}

/// The one model a router serves, to ask for when none is given.
pub(crate) async fn router_model(channel: Channel) -> anyhow::Result<String> {
    let models = InferenceClient::new(channel)
        .list_models(ListModelsRequest {})
        .await?
        .into_inner();
    match models.models.as_slice() {
        [one] => Ok(one.name.clone()),
        [] => anyhow::bail!("the router knows no models yet"),
        _ => anyhow::bail!("several models are served; choose one with --model"),
    }
}
