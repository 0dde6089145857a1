//! tokenmesh worker: a stateless process that runs one GGUF model, batches
//! concurrent requests, registers itself in etcd under a lease and streams
//! tokens to routers.
// Unsafe code is confined to the CPU kernels (SIMD intrinsics and threads
// writing disjoint parts of one output), each use allowed where it stands.
#![deny(unsafe_code)]

pub mod accelerator;
pub mod config;
pub mod drain;
pub mod drain_key;
pub mod engine;
pub mod engines;
pub mod errors;
pub mod model_cache;
pub mod registration;
mod reply;
pub mod request;
pub mod scheduler;
mod series;
pub mod server;
pub mod streams;
pub mod synthetic;
pub mod tokenize;
pub mod upstream;

use config::{EngineKind, WorkerConfig};
use engine::LoadedModel;
use engines::ServingEngine;
use scheduler::{EngineHandle, SchedulerConfig};
use server::{WorkerIdentity, WorkerService};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenmesh_certs::tls::{MeshTls, Role};
use tokenmesh_proto::records::WorkerRecord;
use tokenmesh_proto::v1::worker_server::WorkerServer;
use tokenmesh_proto::validate::check_name;
use tokenmesh_runtime::{edge, Server};
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Why the worker could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("--worker-id {flag} differs from the name in the worker certificate ({cert}); routers would refuse this worker")]
    IdMismatch { flag: String, cert: String },
    #[error("--synthetic-tokens-per-sec {0}: must be a positive number")]
    SyntheticRate(f64),
    #[error("{0} applies to the synthetic engine only; add --engine synthetic or drop it")]
    SyntheticOnly(&'static str),
    #[error(transparent)]
    Upstream(#[from] upstream::SetupError),
    #[error(transparent)]
    Device(#[from] accelerator::AcceleratorError),
    #[error("allocating the KV cache pool: {0}")]
    KvPool(candle_core::Error),
    #[error(transparent)]
    Fetch(#[from] model_cache::FetchError),
    #[error(transparent)]
    Load(#[from] engine::LoadError),
    #[error(transparent)]
    Server(#[from] tokenmesh_runtime::ServeError),
    #[error("model loading was interrupted: {0}")]
    Join(#[from] tokio::task::JoinError),
    /// A name that would be a segment of the worker's etcd key and a metric
    /// label is not a valid one; the field is the flag.
    #[error(transparent)]
    Name(#[from] tokenmesh_proto::validate::InvalidField),
}

/// The readiness condition of a worker whose model is still loading.
const LOADING: &str = "model";

/// A running engine and what the worker reports about it.
struct StartedEngine {
    engine: ServingEngine,
    model_name: String,
    digest: String,
    /// Reported as accelerator: `cpu`, `cuda`, or `synthetic`.
    accelerator: &'static str,
    /// Reported as device: its name.
    device: String,
    /// The real device, for memory telemetry (None for the synthetic engine).
    accel: Option<accelerator::Accelerator>,
    /// An upstream engine's kind, its model's name there, and its poll
    /// interval (None for the worker's own engines).
    upstream: Option<(upstream::UpstreamKind, String, Duration)>,
}

/// Loads the GGUF model and starts its engine thread, or starts the
/// synthetic engine.
async fn start_engine(cfg: &WorkerConfig, worker_id: &str) -> Result<StartedEngine, RunError> {
    let labels = |model: &str| series::worker_labels(model, &cfg.model_version, worker_id);
    if cfg.engine != EngineKind::Synthetic {
        if cfg.synthetic_error_rate.is_some() {
            return Err(RunError::SyntheticOnly("--synthetic-error-rate"));
        }
        if cfg.synthetic_first_token_delay_ms.is_some() {
            return Err(RunError::SyntheticOnly("--synthetic-first-token-delay-ms"));
        }
    }
    match cfg.engine {
        EngineKind::Synthetic => start_synthetic(cfg, labels),
        EngineKind::Model => start_model(cfg, labels).await,
        EngineKind::Upstream => start_upstream(cfg, labels).await,
    }
}

/// Connects to the upstream engine (waiting until it answers) and learns
/// its model; nothing is loaded here.
async fn start_upstream(
    cfg: &WorkerConfig,
    labels: impl Fn(&str) -> Vec<(&'static str, String)>,
) -> Result<StartedEngine, RunError> {
    let setup = upstream::Setup::new(&cfg.upstream)?;
    let info = setup.discover().await;
    let model_name = cfg.model_name.clone().unwrap_or_else(|| info.model.clone());
    tracing::info!(
        url = setup.url(),
        kind = setup.kind.name(),
        engine_model = %info.model,
        context = info.context_length,
        "upstream engine answers"
    );
    let engine_model = info.model.clone();
    let engine = setup.engine(info, cfg.max_batch, cfg.queue_capacity, labels(&model_name));
    Ok(StartedEngine {
        engine: ServingEngine::Upstream(Box::new(engine)),
        model_name,
        digest: String::new(),
        accelerator: match setup.accelerator.as_str() {
            "cuda" => "cuda",
            "npu" => "npu",
            _ => "cpu",
        },
        device: format!("{} at {}", setup.kind.name(), setup.url()),
        accel: None,
        upstream: Some((setup.kind, engine_model, setup.poll)),
    })
}

/// The scheduler's settings from the flags, with the metrics' labels and
/// the model's identity (its digest), which with the version seeds the
/// prefix cache's block hashes.
fn scheduler_config(
    cfg: &WorkerConfig,
    labels: Vec<(&'static str, String)>,
    model_identity: &str,
) -> SchedulerConfig {
    SchedulerConfig {
        max_batch: cfg.max_batch.max(1),
        queue_capacity: cfg.queue_capacity,
        max_tokens_per_step: cfg.max_tokens_per_step.max(1),
        step_latency_target: (cfg.step_latency_target_ms > 0)
            .then(|| Duration::from_millis(cfg.step_latency_target_ms)),
        kv_budget_bytes: cfg.kv_budget_mib << 20,
        kv_block_size: cfg.kv_block_size.max(1),
        priority_aging: Duration::from_millis(cfg.priority_aging_ms),
        prefix_cache: cfg
            .prefix_cache
            .then(|| format!("{model_identity}:{}", cfg.model_version)),
        labels,
        phase_spans: cfg.server.telemetry.trace_phases,
    }
}

/// The synthetic engine behind the real scheduler; no model is loaded.
fn start_synthetic(
    cfg: &WorkerConfig,
    labels: impl Fn(&str) -> Vec<(&'static str, String)>,
) -> Result<StartedEngine, RunError> {
    let rate = cfg.synthetic_tokens_per_sec;
    if !(rate.is_finite() && rate > 0.0) {
        return Err(RunError::SyntheticRate(rate));
    }
    let error_rate = cfg.synthetic_error_rate.unwrap_or(0.0);
    let first_token_delay_ms = cfg.synthetic_first_token_delay_ms.unwrap_or(0);
    tracing::warn!(
        tokens_per_sec = rate,
        max_batch = cfg.max_batch.max(1),
        error_rate,
        first_token_delay_ms,
        "synthetic engine: no model is loaded; output is a deterministic word cycle"
    );
    let model_name = cfg.model_name.clone().unwrap_or_else(|| "synthetic".into());
    let synthetic = synthetic::SyntheticConfig {
        tokens_per_sec: rate,
        error_rate,
        first_token_delay: Duration::from_millis(first_token_delay_ms),
    };
    let scheduler = scheduler_config(cfg, labels(&model_name), "synthetic");
    Ok(StartedEngine {
        engine: ServingEngine::Scheduler {
            model: Arc::new(synthetic::SyntheticModel),
            engine: synthetic::start(synthetic, scheduler).map_err(RunError::KvPool)?,
        },
        model_name,
        digest: "synthetic".into(),
        accelerator: "synthetic",
        device: "synthetic".into(),
        accel: None,
        upstream: None,
    })
}

/// Opens the device, resolves and loads the GGUF model and starts its
/// engine thread.
async fn start_model(
    cfg: &WorkerConfig,
    labels: impl Fn(&str) -> Vec<(&'static str, String)>,
) -> Result<StartedEngine, RunError> {
    let accel = accelerator::Accelerator::open(&cfg.device)?;
    match accel.memory() {
        Some((used, total)) => tracing::info!(
            accelerator = accel.kind,
            device = %accel.name,
            memory_used_mib = used >> 20,
            memory_total_mib = total >> 20,
            "device opened"
        ),
        None => tracing::info!(accelerator = accel.kind, device = %accel.name, "device opened"),
    }
    let device = accel.device.clone();
    let source = cfg.source.clone();
    let path = tokio::task::spawn_blocking(move || source.resolve()).await??;
    let started = Instant::now();
    let load_path = path.clone();
    let opts = engine::LoadOptions {
        threads: cfg.threads,
        cpu_kernels: engine::CpuKernels::new(cfg.cpu_simd, cfg.cpu_vnni),
    };
    let model =
        tokio::task::spawn_blocking(move || LoadedModel::load_with(&load_path, &device, &opts))
            .await??;
    let model = Arc::new(model);
    let model_name = cfg
        .model_name
        .clone()
        .unwrap_or_else(|| model.default_name());
    tracing::info!(
        path = %path.display(),
        model = %model_name,
        version = %cfg.model_version,
        secs = started.elapsed().as_secs_f32(),
        "model loaded"
    );
    let scheduler = scheduler_config(cfg, labels(&model_name), &model.digest);
    Ok(StartedEngine {
        engine: ServingEngine::Scheduler {
            engine: EngineHandle::start(model.clone(), scheduler).map_err(RunError::KvPool)?,
            model: model.clone(),
        },
        digest: model.digest.clone(),
        model_name,
        accelerator: accel.kind,
        device: accel.name.clone(),
        accel: Some(accel),
        upstream: None,
    })
}

/// Loads the model, serves `Worker` on `listener` until `shutdown` resolves
/// or (with etcd) its drain key `drain/{worker_id}` appears, then drains:
/// stops taking work, deregisters, lets in-flight streams finish (bounded by
/// the drain timeout) and returns. After a drain key it deletes the key on
/// its way out, or with `--stay-drained` stays up, drained, until `shutdown`.
pub async fn run(
    cfg: WorkerConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    // Certificates are checked before the model loads, so a bad file fails
    // fast with its name in the error.
    let tls = cfg.server.transport(Role::Worker, "")?;
    let worker_id = worker_id(&cfg, tls.as_ref())?;
    // The names are segments of `workers/{model}/{version}/{worker_id}`:
    // checked before the model loads, the model's own name once it has.
    check_name("--worker-id", &worker_id)?;
    check_name("--model-version", &cfg.model_version)?;
    if let Some(name) = &cfg.model_name {
        check_name("--model-name", name)?;
    }
    let etcd_tls = cfg.server.etcd_tls(tls.as_ref());
    let server = Server::new("worker", &[Role::Router], tls, cfg.server.tls_reload());
    // Alive (/healthz) while the model loads, ready once it has loaded, is
    // registered (with etcd) and is not draining.
    let readiness = server.readiness();
    readiness.not_ready(LOADING, "loading the model");
    if !cfg.server.etcd.is_empty() {
        readiness.not_ready(registration::CONDITION, "not registered in etcd yet");
    }
    let server = server.probes(cfg.server.telemetry.metrics_listen)?;
    let started = start_engine(&cfg, &worker_id).await?;
    check_name("--model-name", &started.model_name).map_err(|mut e| {
        e.reason
            .push_str(" (the name was taken from the model file; give --model-name)");
        e
    })?;
    readiness.ready(LOADING);
    let identity = WorkerIdentity {
        worker_id,
        model_name: started.model_name,
        version: cfg.model_version.clone(),
        accelerator: started.accelerator.into(),
        device: started.device.clone(),
        capacity: cfg.max_batch as u32,
    };
    if let Some(accel) = started.accel.filter(|a| a.memory().is_some()) {
        spawn_memory_gauges(accel, &identity.worker_id, &cfg.device);
    }
    let engine = started.engine;
    let service = WorkerService::new(engine.clone(), identity.clone(), cfg.default_max_tokens);
    let bound = tokenmesh_runtime::serve::bound(&listener)?;
    let (deregister_tx, deregister_rx) = watch::channel(false);
    let mut record = record_of(&cfg, &identity, &started.digest, bound);
    // An upstream worker is ready, and registered, only while its engine
    // answers.
    let engine_up = match (&engine, &started.upstream) {
        (ServingEngine::Upstream(up), Some((kind, engine_model, poll))) => {
            record.engine = kind.name().to_string();
            record.engine_model = engine_model.clone();
            record.continues_from_token_ids = kind.continues_from_token_ids();
            readiness.not_ready(
                upstream::load::CONDITION,
                "the upstream engine is not polled yet",
            );
            let (up_tx, up_rx) = watch::channel(false);
            up.spawn_poller(readiness.clone(), up_tx, *poll);
            Some(up_rx)
        }
        _ => None,
    };
    let registration = registration_of(&cfg, &identity, &record, etcd_tls.clone()).map(|reg| {
        let readiness = readiness.clone();
        tokio::spawn(async move {
            match engine_up {
                Some(up) => registration::run_while(reg, readiness, deregister_rx, up).await,
                None => registration::run(reg, readiness, deregister_rx).await,
            }
        })
    });
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let drain = drain::Drain {
        key: (!cfg.server.etcd.is_empty()).then(|| drain_key::DrainKey {
            endpoints: cfg.server.etcd.clone(),
            key: cfg.server.keys().drain(&identity.worker_id),
            tls: etcd_tls,
        }),
        timeout: Duration::from_secs(cfg.drain_timeout),
        stay_drained: cfg.stay_drained,
        stats: engine.stats().clone(),
        readiness,
        deregister: deregister_tx,
        registration,
    };
    let drainer = tokio::spawn(drain.run(shutdown, stop_tx));
    let ready = format!(
        "tokenmesh-worker ready: {} serving {} {} on {bound}",
        identity.worker_id, identity.model_name, identity.version
    );
    let stopped = async {
        let _ = stop_rx.await;
    };
    server
        .serve(
            WorkerServer::new(service).max_decoding_message_size(edge::MAX_WORKER_REQUEST_BYTES),
            listener,
            ready,
            stopped,
        )
        .await?;
    drainer.abort();
    tracing::info!("worker stopped");
    Ok(())
}

/// `--worker-id`, else the certificate's name, else a random id; with a
/// certificate the two must agree, since routers check it.
fn worker_id(cfg: &WorkerConfig, tls: Option<&MeshTls>) -> Result<String, RunError> {
    let cert = tls.map(|t| t.store.identity().name);
    match (&cfg.worker_id, cert) {
        (Some(flag), Some(cert)) if *flag != cert => Err(RunError::IdMismatch {
            flag: flag.clone(),
            cert,
        }),
        (Some(flag), _) => Ok(flag.clone()),
        (None, Some(cert)) => Ok(cert),
        (None, None) => Ok(format!(
            "worker-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        )),
    }
}

/// Reports the accelerator's memory every 5 s.
fn spawn_memory_gauges(accel: accelerator::Accelerator, worker_id: &str, device: &str) {
    let labels = [
        ("worker", worker_id.to_string()),
        ("device", device.to_string()),
    ];
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            if let Some((used, total)) = accel.memory() {
                metrics::gauge!("gpu_memory_used_bytes", &labels).set(used as f64);
                metrics::gauge!("gpu_memory_total_bytes", &labels).set(total as f64);
            }
        }
    });
}

/// The worker's etcd record.
fn record_of(
    cfg: &WorkerConfig,
    identity: &WorkerIdentity,
    digest: &str,
    bound: std::net::SocketAddr,
) -> WorkerRecord {
    WorkerRecord {
        addr: cfg.advertised_addr(bound),
        model_digest: digest.to_string(),
        accelerator: identity.accelerator.clone(),
        device: identity.device.clone(),
        capacity: identity.capacity,
        labels: Default::default(),
        started_at: time::OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default(),
        // The worker's own engines take a continuation's emitted tokens as
        // ids; an upstream kind says for itself below.
        continues_from_token_ids: true,
        engine: String::new(),
        engine_model: String::new(),
    }
}

/// The etcd registration `workers/{model}/{version}/{worker_id}`, if the
/// worker runs with etcd.
fn registration_of(
    cfg: &WorkerConfig,
    identity: &WorkerIdentity,
    record: &WorkerRecord,
    tls: Option<tokenmesh_certs::tls::TlsPaths>,
) -> Option<registration::RegistrationConfig> {
    if cfg.server.etcd.is_empty() {
        return None;
    }
    Some(registration::RegistrationConfig {
        endpoints: cfg.server.etcd.clone(),
        key: cfg
            .server
            .keys()
            .worker(&identity.model_name, &identity.version, &identity.worker_id),
        value: serde_json::to_string(record).expect("a WorkerRecord serializes"),
        ttl: cfg.lease_ttl(),
        tls,
    })
}
