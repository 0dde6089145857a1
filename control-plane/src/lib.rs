//! tokenmesh control plane: the `Control` gRPC API over etcd (traffic policy
//! with compare-and-swap writes, canary rollouts, workers and drains), the
//! leader-elected rollout controller with automated canary analysis. Its
//! command line, meshctl, is a crate of its own (meshctl/).
#![forbid(unsafe_code)]

pub mod analysis;
pub mod config;
pub mod controller;
pub mod election;
pub mod errors;
pub mod records;
pub mod rollout;
pub mod service;
pub mod store;
pub mod views;

use config::ControlConfig;
use std::future::Future;
use std::time::Duration;
use tokenmesh_certs::tls::Role;
use tokenmesh_proto::v1::control_server::ControlServer;
use tokenmesh_runtime::{edge, Server};
use tokio::net::TcpListener;

/// How often snapshots are sampled for status rates and the stale-read cache.
const SAMPLE_EVERY: Duration = Duration::from_secs(2);

/// Why the control plane could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("--etcd URL[,URL...] is required: the control plane keeps all its state in etcd")]
    NoEtcd,
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error(transparent)]
    Server(#[from] tokenmesh_runtime::ServeError),
}

/// Serves `Control` on `listener` and campaigns to lead the rollout
/// controller, until `shutdown` resolves.
pub async fn run(
    cfg: ControlConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let tls = cfg.server.transport(Role::Control, ": anyone may write")?;
    let etcd = &cfg.server.etcd;
    if etcd.is_empty() {
        return Err(RunError::NoEtcd);
    }
    let server = Server::new(
        "control plane",
        &[Role::Operator, Role::Auditor],
        tls.clone(),
        cfg.server.tls_reload(),
    );
    // Ready while its reads of etcd succeed (the sampler below reads every
    // SAMPLE_EVERY); when etcd is away it still serves stale reads, but
    // writes fail, so it is not ready.
    let readiness = server.readiness();
    readiness.not_ready(views::ETCD, "not connected to etcd yet");
    let server = server.probes(cfg.server.telemetry.metrics_listen)?;
    let etcd_tls = cfg.server.etcd_tls(tls.as_ref());
    let keys = cfg.server.keys();
    let store = store::Store::connect(etcd, keys.clone(), etcd_tls.as_ref()).await?;
    let id = cfg.id();

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (leading_tx, leading_rx) = tokio::sync::watch::channel(false);
    // No per-request timeout: a campaign call waits as long as another leads.
    let election_client = tokenmesh_runtime::etcd::connect(
        etcd,
        etcd_tls.as_ref(),
        tokenmesh_runtime::etcd::Use::Streams,
    )
    .await
    .map_err(store::StoreError::from)?;
    let election = tokio::spawn(election::run(
        election_client,
        keys.control_election(),
        id.clone(),
        Duration::from_secs(cfg.election_ttl_s.max(1)),
        leading_tx,
        stop_rx.clone(),
    ));
    let controller = tokio::spawn(controller::run(
        store.clone(),
        id.clone(),
        cfg.analysis_interval(),
        leading_rx,
        stop_rx,
    ));
    let history = views::History::default();
    let sampler = history.spawn(
        store.clone(),
        SAMPLE_EVERY,
        Duration::from_secs(cfg.status_window_s.max(1)),
        readiness,
    );
    let service = service::ControlService::new(store, history, cfg.rollout_defaults());
    let bound = tokenmesh_runtime::serve::bound(&listener)?;
    let shutdown = async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    };
    let served = server
        .serve(
            ControlServer::new(service).max_decoding_message_size(edge::MAX_REQUEST_BYTES),
            listener,
            format!("tokenmesh-control {id} ready on {bound}"),
            shutdown,
        )
        .await;
    sampler.abort();
    // Resign so that another replica leads at once rather than after the TTL.
    let _ = tokio::time::timeout(Duration::from_secs(3), election).await;
    let _ = controller.await;
    served?;
    Ok(())
}
