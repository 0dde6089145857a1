//! tokenmesh router: one gRPC endpoint that picks a model version by traffic
//! policy and a worker of that version by live load, and streams tokens back.
#![forbid(unsafe_code)]

pub mod admission;
pub mod config;
pub mod discovery;
pub mod errors;
pub mod registry;
pub mod route;
pub mod server;
pub mod stats;

use config::RouterConfig;
use registry::Registry;
use server::InferenceService;
use std::future::Future;
use std::time::Duration;
use tokenmesh_certs::tls::{AuthLayer, Role};
use tokenmesh_proto::keys::Keys;
use tokenmesh_proto::v1::inference_server::InferenceServer;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

/// Why the router could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Transport(#[from] tokenmesh_certs::tls::TransportError),
    #[error("--tls-dir: {0}")]
    Tls(#[from] tokenmesh_certs::tls::TlsError),
    #[error("choose discovery: --etcd URL[,URL...] or --static FILE")]
    NoDiscovery,
    #[error(transparent)]
    Discovery(#[from] discovery::DiscoveryError),
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("listener: {0}")]
    Listener(std::io::Error),
    #[error("--router-id {0:?}: must be non-empty and contain no '/'")]
    RouterId(String),
}

/// Serves `Inference` on `listener` until `shutdown` resolves.
pub async fn run(
    cfg: RouterConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let tls = tokenmesh_certs::tls::server_transport(
        cfg.tls_dir.as_deref(),
        cfg.insecure,
        Role::Router,
        ", also to workers",
    )?;
    let registry = Registry::new(cfg.channel(), tls.clone());
    let (stop_stats, stats_stopped) = tokio::sync::watch::channel(false);
    let mut publisher = None;
    if let Some(path) = &cfg.static_file {
        discovery::static_file::load(path, &registry)?;
    } else if !cfg.etcd.is_empty() {
        let router_id = cfg.router_id();
        if router_id.is_empty() || router_id.contains('/') {
            return Err(RunError::RouterId(router_id));
        }
        let etcd_tls = tokenmesh_certs::tls::etcd::client_paths(tls.as_ref(), &cfg.etcd);
        tokio::spawn(discovery::etcd::run(
            cfg.etcd.clone(),
            Keys::new(&cfg.etcd_prefix),
            registry.clone(),
            etcd_tls.clone(),
        ));
        publisher = Some(tokio::spawn(stats::publish::run(
            stats::publish::PublishConfig {
                endpoints: cfg.etcd.clone(),
                keys: Keys::new(&cfg.etcd_prefix),
                router_id,
                interval: Duration::from_millis(cfg.stats_interval_ms),
                tls: etcd_tls,
            },
            registry.stats().clone(),
            registry.clone(),
            stats_stopped,
        )));
    } else {
        return Err(RunError::NoDiscovery);
    }
    // The stats are withdrawn as soon as shutdown begins; streams in flight
    // still finish.
    let shutdown = async move {
        shutdown.await;
        let _ = stop_stats.send(true);
    };
    let service = InferenceService::new(
        registry,
        admission::Admission::new(cfg.admission()),
        cfg.routing(),
    );
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<InferenceServer<InferenceService>>()
        .await;
    let (reflection_v1, reflection_v1alpha) = tokenmesh_proto::server_support::reflection();
    let bound = listener.local_addr().map_err(RunError::Listener)?;
    let keepalive = Duration::from_millis(cfg.server_keepalive_interval_ms);
    let mut server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(keepalive))
        .http2_keepalive_timeout(Some(Duration::from_millis(cfg.keepalive_timeout_ms)));
    if cfg.max_connection_age_s > 0 {
        server = server
            .max_connection_age(Duration::from_secs(cfg.max_connection_age_s))
            .max_connection_age_grace(Duration::from_secs(cfg.max_connection_age_grace_s));
    }
    let routes = server
        .layer(AuthLayer::new(
            "router",
            &[Role::Client, Role::Operator],
            tls.is_some(),
        ))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(InferenceServer::new(service));
    match tls {
        Some(tls) => {
            let config = tls.server_config()?;
            let _watcher = tls.watch(cfg.tls_reload());
            println!("tokenmesh-router ready on {bound} (mTLS)");
            routes
                .serve_with_incoming_shutdown(
                    tokenmesh_certs::tls::server::incoming(listener, config),
                    shutdown,
                )
                .await?;
        }
        None => {
            println!("tokenmesh-router ready on {bound} (plaintext)");
            routes
                .serve_with_incoming_shutdown(
                    // Without TCP_NODELAY small HTTP/2 frames wait on Nagle.
                    TcpIncoming::from(listener).with_nodelay(Some(true)),
                    shutdown,
                )
                .await?;
        }
    }
    if let Some(publisher) = publisher {
        // Let the lease revocation reach etcd before the process exits.
        let _ = tokio::time::timeout(Duration::from_secs(3), publisher).await;
    }
    Ok(())
}
