//! tokenmesh control plane: the `Control` gRPC API over etcd (traffic policy
//! with compare-and-swap writes, canary rollouts, workers and drains), the
//! leader-elected rollout controller with automated canary analysis, and
//! the `meshctl` command line (src/bin/meshctl).
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
use tokenmesh_certs::tls::{AuthLayer, Role};
use tokenmesh_proto::keys::Keys;
use tokenmesh_proto::v1::control_server::ControlServer;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

/// How often snapshots are sampled for status rates and the stale-read cache.
const SAMPLE_EVERY: Duration = Duration::from_secs(2);

/// Why the control plane could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Transport(#[from] tokenmesh_certs::tls::TransportError),
    #[error("--tls-dir: {0}")]
    Tls(#[from] tokenmesh_certs::tls::TlsError),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("listener: {0}")]
    Listener(std::io::Error),
}

/// Serves `Control` on `listener` and campaigns to lead the rollout
/// controller, until `shutdown` resolves.
pub async fn run(
    cfg: ControlConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let tls = tokenmesh_certs::tls::server_transport(
        cfg.tls_dir.as_deref(),
        cfg.insecure,
        Role::Control,
        ": anyone may write",
    )?;
    let etcd_tls = tokenmesh_certs::tls::etcd::client_paths(tls.as_ref(), &cfg.etcd);
    let keys = Keys::new(&cfg.etcd_prefix);
    let store = store::Store::connect(&cfg.etcd, keys.clone(), etcd_tls.as_ref()).await?;
    let id = cfg.id();

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (leading_tx, leading_rx) = tokio::sync::watch::channel(false);
    let election_client = store::connect_client(&cfg.etcd, etcd_tls.as_ref(), None).await?;
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
    );
    let service = service::ControlService::new(store, history, cfg.rollout_defaults());

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<ControlServer<service::ControlService>>()
        .await;
    let (reflection_v1, reflection_v1alpha) = tokenmesh_proto::server_support::reflection();
    let bound = listener.local_addr().map_err(RunError::Listener)?;
    let routes = tonic::transport::Server::builder()
        .layer(AuthLayer::new(
            "control plane",
            &[Role::Operator, Role::Auditor],
            tls.is_some(),
        ))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(ControlServer::new(service));
    let shutdown = async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    };
    let served = match tls {
        Some(tls) => {
            let config = tls.server_config()?;
            let _watcher = tls.watch(Duration::from_millis(cfg.tls_reload_ms.max(10)));
            println!("tokenmesh-control {id} ready on {bound} (mTLS)");
            routes
                .serve_with_incoming_shutdown(
                    tokenmesh_certs::tls::server::incoming(listener, config),
                    shutdown,
                )
                .await
        }
        None => {
            println!("tokenmesh-control {id} ready on {bound} (plaintext)");
            routes
                .serve_with_incoming_shutdown(
                    TcpIncoming::from(listener).with_nodelay(Some(true)),
                    shutdown,
                )
                .await
        }
    };
    sampler.abort();
    // Resign so that another replica leads at once rather than after the TTL.
    let _ = tokio::time::timeout(Duration::from_secs(3), election).await;
    let _ = controller.await;
    served?;
    Ok(())
}
