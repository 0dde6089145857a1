//! tokenmesh worker: a stateless process that runs one GGUF model, batches
//! concurrent requests, registers itself in etcd under a lease and streams
//! tokens to routers.
// Unsafe code is confined to the CPU kernels (SIMD intrinsics and threads
// writing disjoint parts of one output), each use allowed where it stands.
#![deny(unsafe_code)]

pub mod accelerator;
pub mod config;
pub mod drain_key;
pub mod engine;
pub mod errors;
pub mod model_cache;
pub mod registration;
pub mod request;
pub mod scheduler;
pub mod server;
pub mod synthetic;

use config::{EngineKind, WorkerConfig};
use engine::LoadedModel;
use scheduler::{EngineHandle, SchedulerConfig};
use server::{WorkerIdentity, WorkerService};
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenmesh_certs::tls::{AuthLayer, Role};
use tokenmesh_proto::keys::Keys;
use tokenmesh_proto::records::WorkerRecord;
use tokenmesh_proto::v1::worker_server::WorkerServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;

/// Why the worker could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Transport(#[from] tokenmesh_certs::tls::TransportError),
    #[error("--tls-dir: {0}")]
    Tls(#[from] tokenmesh_certs::tls::TlsError),
    #[error("--worker-id {flag} differs from the name in the worker certificate ({cert}); routers would refuse this worker")]
    IdMismatch { flag: String, cert: String },
    #[error("--synthetic-tokens-per-sec {0}: must be a positive number")]
    SyntheticRate(f64),
    #[error("{0} applies to the synthetic engine only; add --engine synthetic or drop it")]
    SyntheticOnly(&'static str),
    #[error(transparent)]
    Device(#[from] accelerator::AcceleratorError),
    #[error("allocating the KV cache pool: {0}")]
    KvPool(candle_core::Error),
    #[error(transparent)]
    Fetch(#[from] model_cache::FetchError),
    #[error(transparent)]
    Load(#[from] engine::LoadError),
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("listener: {0}")]
    Listener(std::io::Error),
    #[error("model loading was interrupted: {0}")]
    Join(#[from] tokio::task::JoinError),
}

/// A running engine and what the worker reports about it.
struct StartedEngine {
    model: Arc<dyn request::PromptModel>,
    engine: EngineHandle,
    model_name: String,
    digest: String,
    /// Reported as accelerator: `cpu`, `cuda`, or `synthetic`.
    accelerator: &'static str,
    /// Reported as device: its name.
    device: String,
    /// The real device, for memory telemetry (None for the synthetic engine).
    accel: Option<accelerator::Accelerator>,
}

/// Loads the GGUF model and starts its engine thread, or starts the
/// synthetic engine.
async fn start_engine(cfg: &WorkerConfig, worker_id: &str) -> Result<StartedEngine, RunError> {
    let labels = |model: &str| {
        vec![
            ("model", model.to_string()),
            ("version", cfg.model_version.clone()),
            ("worker", worker_id.to_string()),
        ]
    };
    let scheduler = SchedulerConfig {
        max_batch: cfg.max_batch.max(1),
        queue_capacity: cfg.queue_capacity,
        max_tokens_per_step: cfg.max_tokens_per_step.max(1),
        step_latency_target: (cfg.step_latency_target_ms > 0)
            .then(|| Duration::from_millis(cfg.step_latency_target_ms)),
        kv_budget_bytes: cfg.kv_budget_mib << 20,
        kv_block_size: cfg.kv_block_size.max(1),
        priority_aging: Duration::from_millis(cfg.priority_aging_ms),
        labels: vec![],
    };
    if cfg.engine != EngineKind::Synthetic {
        if cfg.synthetic_error_rate.is_some() {
            return Err(RunError::SyntheticOnly("--synthetic-error-rate"));
        }
        if cfg.synthetic_first_token_delay_ms.is_some() {
            return Err(RunError::SyntheticOnly("--synthetic-first-token-delay-ms"));
        }
    }
    if cfg.engine == EngineKind::Synthetic {
        let rate = cfg.synthetic_tokens_per_sec;
        if !(rate.is_finite() && rate > 0.0) {
            return Err(RunError::SyntheticRate(rate));
        }
        let error_rate = cfg.synthetic_error_rate.unwrap_or(0.0);
        let first_token_delay_ms = cfg.synthetic_first_token_delay_ms.unwrap_or(0);
        tracing::warn!(
            tokens_per_sec = rate,
            max_batch = scheduler.max_batch,
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
        let scheduler = SchedulerConfig {
            labels: labels(&model_name),
            ..scheduler
        };
        return Ok(StartedEngine {
            model: Arc::new(synthetic::SyntheticModel),
            engine: synthetic::start(synthetic, scheduler).map_err(RunError::KvPool)?,
            model_name,
            digest: "synthetic".into(),
            accelerator: "synthetic",
            device: "synthetic".into(),
            accel: None,
        });
    }
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
    let cache = cfg
        .model_cache
        .clone()
        .unwrap_or_else(model_cache::default_cache_dir);
    let spec = cfg.model.clone();
    let python = cfg.python.clone();
    let path =
        tokio::task::spawn_blocking(move || model_cache::resolve(&spec, &cache, Some(&python)))
            .await??;
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
    let scheduler = SchedulerConfig {
        labels: labels(&model_name),
        ..scheduler
    };
    Ok(StartedEngine {
        engine: EngineHandle::start(model.clone(), scheduler).map_err(RunError::KvPool)?,
        digest: model.digest.clone(),
        model,
        model_name,
        accelerator: accel.kind,
        device: accel.name.clone(),
        accel: Some(accel),
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
    let tls = tokenmesh_certs::tls::server_transport(
        cfg.tls_dir.as_deref(),
        cfg.insecure,
        Role::Worker,
        "",
    )?;
    if let Some(tls) = &tls {
        let name = tls.store.identity().name;
        if let Some(flag) = cfg.worker_id.as_ref().filter(|f| **f != name) {
            return Err(RunError::IdMismatch {
                flag: flag.clone(),
                cert: name,
            });
        }
    }
    let worker_id = cfg
        .worker_id
        .clone()
        .or_else(|| tls.as_ref().map(|t| t.store.identity().name))
        .unwrap_or_else(|| format!("worker-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]));
    let started = start_engine(&cfg, &worker_id).await?;
    let identity = WorkerIdentity {
        worker_id,
        model_name: started.model_name,
        version: cfg.model_version.clone(),
        accelerator: started.accelerator.into(),
        device: started.device.clone(),
        capacity: cfg.max_batch as u32,
    };
    if let Some(accel) = started.accel.filter(|a| a.memory().is_some()) {
        let labels = [
            ("worker", identity.worker_id.clone()),
            ("device", cfg.device.clone()),
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
    let engine = started.engine;
    let service = WorkerService::new(
        started.model,
        engine.clone(),
        identity.clone(),
        cfg.default_max_tokens,
    );

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<WorkerServer<WorkerService>>()
        .await;
    let (reflection_v1, reflection_v1alpha) = tokenmesh_proto::server_support::reflection();

    let bound = listener.local_addr().map_err(RunError::Listener)?;
    let (deregister_tx, deregister_rx) = watch::channel(false);
    let etcd_tls = tokenmesh_certs::tls::etcd::client_paths(tls.as_ref(), &cfg.etcd);
    let drain_key = (!cfg.etcd.is_empty()).then(|| drain_key::DrainKey {
        endpoints: cfg.etcd.clone(),
        key: Keys::new(&cfg.etcd_prefix).drain(&identity.worker_id),
        tls: etcd_tls.clone(),
    });
    let registration = if cfg.etcd.is_empty() {
        None
    } else {
        let keys = Keys::new(&cfg.etcd_prefix);
        let record = WorkerRecord {
            addr: cfg.advertised_addr(bound),
            model_digest: started.digest,
            accelerator: identity.accelerator.clone(),
            device: identity.device.clone(),
            capacity: identity.capacity,
            labels: Default::default(),
            started_at: time::OffsetDateTime::now_utc()
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
        };
        let reg = registration::RegistrationConfig {
            endpoints: cfg.etcd.clone(),
            key: keys.worker(&identity.model_name, &identity.version, &identity.worker_id),
            value: serde_json::to_string(&record).expect("a WorkerRecord serializes"),
            ttl: cfg.lease_ttl(),
            tls: etcd_tls,
        };
        Some(tokio::spawn(registration::run(reg, deregister_rx)))
    };

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let drain_timeout = Duration::from_secs(cfg.drain_timeout);
    let stats = engine.stats().clone();
    let drain_reporter = health_reporter.clone();
    let stay_drained = cfg.stay_drained;
    let drainer = tokio::spawn(async move {
        let mut shutdown = Box::pin(shutdown);
        let by_key = match &drain_key {
            Some(key) => tokio::select! {
                _ = &mut shutdown => false,
                reason = key.requested() => {
                    tracing::info!(key = %key.key, reason = %reason, "drain requested through etcd");
                    true
                }
            },
            None => {
                (&mut shutdown).await;
                false
            }
        };
        tracing::info!("draining: no new requests; finishing in-flight streams");
        stats.draining.store(true, Ordering::SeqCst);
        drain_reporter
            .set_not_serving::<WorkerServer<WorkerService>>()
            .await;
        let _ = deregister_tx.send(true);
        let deadline = Instant::now() + drain_timeout;
        while (stats.active.load(Ordering::SeqCst) > 0 || stats.queued.load(Ordering::SeqCst) > 0)
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if let Some(reg) = registration {
            let _ = tokio::time::timeout(Duration::from_secs(3), reg).await;
        }
        if by_key {
            if stay_drained {
                tracing::info!("drained; staying up until stopped (--stay-drained)");
                shutdown.await;
            }
            if let Some(key) = &drain_key {
                key.remove().await;
            }
        }
        let _ = stop_tx.send(());
    });

    println!(
        "tokenmesh-worker ready: {} serving {} {} on {bound}",
        identity.worker_id, identity.model_name, identity.version
    );
    let routes = tonic::transport::Server::builder()
        .layer(AuthLayer::new("worker", &[Role::Router], tls.is_some()))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(WorkerServer::new(service));
    let stopped = async {
        let _ = stop_rx.await;
    };
    match tls {
        Some(tls) => {
            let config = tls.server_config()?;
            let _watcher = tls.watch(Duration::from_millis(cfg.tls_reload_ms.max(10)));
            routes
                .serve_with_incoming_shutdown(
                    tokenmesh_certs::tls::server::incoming(listener, config),
                    stopped,
                )
                .await?
        }
        None => {
            routes
                .serve_with_incoming_shutdown(
                    // Without TCP_NODELAY small HTTP/2 frames wait on Nagle.
                    TcpIncoming::from(listener).with_nodelay(Some(true)),
                    stopped,
                )
                .await?
        }
    }
    drainer.abort();
    tracing::info!("worker stopped");
    Ok(())
}
