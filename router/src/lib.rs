//! tokenmesh router: one gRPC endpoint that picks a model version by traffic
//! policy and a worker of that version by live load, and streams tokens back.
// Denied, not forbidden: route::affinity::top holds the router's one use
// (SIMD intrinsics, behind run-time feature checks).
#![deny(unsafe_code)]

pub mod admission;
pub mod config;
pub mod discovery;
pub mod errors;
pub mod ids;
pub mod openai;
pub mod registry;
pub mod route;
pub mod server;
pub mod stats;

use config::RouterConfig;
use registry::Registry;
use server::{InferenceEdge, InferenceService};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokenmesh_certs::tls::Role;
use tokenmesh_runtime::{edge, Server};
use tokio::net::TcpListener;

/// Why the router could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("choose discovery: --etcd URL[,URL...] or --static FILE")]
    NoDiscovery,
    #[error(transparent)]
    Discovery(#[from] discovery::DiscoveryError),
    #[error(transparent)]
    Server(#[from] tokenmesh_runtime::ServeError),
    #[error("--router-id {0:?}: must be non-empty and contain no '/'")]
    RouterId(String),
    #[error(transparent)]
    ApiKeys(#[from] openai::auth::ApiKeysError),
    #[error("binding --http-listen {addr}: {source}")]
    HttpBind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// Serves `Inference` on `listener` until `shutdown` resolves.
pub async fn run(
    cfg: RouterConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let tls = cfg.server.transport(Role::Router, ", also to workers")?;
    let registry = Registry::new(cfg.channel(), tls.clone());
    let server = Server::new(
        "router",
        &[Role::Client, Role::Operator],
        tls.clone(),
        cfg.server.tls_reload(),
    );
    let readiness = server.readiness();
    readiness.not_ready(
        DISCOVERY,
        "waiting for discovery's first view (the etcd snapshot)",
    );
    readiness.not_ready(WORKERS, NO_WORKER);
    let server = server.probes(cfg.server.telemetry.metrics_listen)?;
    let follower = tokio::spawn(follow_registry(registry.clone(), readiness));
    let (stop, stats_stopped) = tokio::sync::watch::channel(false);
    let stop = Arc::new(stop);
    let publisher = start_discovery(&cfg, &registry, tls.as_ref(), stats_stopped)?;
    let router = Arc::new(route::Router::new(
        registry,
        admission::Admission::new(cfg.admission()),
        cfg.routing(),
    ));
    let http = start_http(&cfg, &router, tls.as_ref(), stop.subscribe()).await?;
    // The stats are withdrawn and the HTTP listener closes as soon as
    // shutdown begins; streams in flight still finish.
    let shutdown = {
        let stop = stop.clone();
        async move {
            shutdown.await;
            let _ = stop.send(true);
        }
    };
    let service = InferenceService::with_router(router);
    let bound = tokenmesh_runtime::serve::bound(&listener)?;
    let served = server
        .configure(|server| {
            let server = server
                .http2_keepalive_interval(Some(Duration::from_millis(
                    cfg.server_keepalive_interval_ms,
                )))
                .http2_keepalive_timeout(Some(Duration::from_millis(cfg.keepalive_timeout_ms)));
            if cfg.max_connection_age_s == 0 {
                return server;
            }
            server
                .max_connection_age(Duration::from_secs(cfg.max_connection_age_s))
                .max_connection_age_grace(Duration::from_secs(cfg.max_connection_age_grace_s))
        })
        .serve(
            InferenceEdge::new(service, edge::MAX_REQUEST_BYTES),
            listener,
            format!("tokenmesh-router ready on {bound}"),
            shutdown,
        )
        .await;
    follower.abort();
    let _ = stop.send(true);
    if let Some(http) = http {
        let _ = http.await;
    }
    served?;
    if let Some(publisher) = publisher {
        // Let the lease revocation reach etcd before the process exits.
        let _ = tokio::time::timeout(Duration::from_secs(3), publisher).await;
    }
    Ok(())
}

/// Readiness condition: discovery's first view is not in yet.
const DISCOVERY: &str = "discovery";
/// Readiness condition: no worker may take a stream.
const WORKERS: &str = "workers";
const NO_WORKER: &str = "no ready worker";

/// Keeps the router's readiness (grpc.health and `/readyz`) in step with
/// the registry: ready once discovery has delivered its first view and while
/// at least one worker is ready.
async fn follow_registry(registry: Arc<Registry>, readiness: tokenmesh_runtime::Readiness) {
    loop {
        let loaded = registry.is_loaded();
        if loaded {
            readiness.ready(DISCOVERY);
        }
        readiness.set(
            WORKERS,
            match registry.ready_workers() {
                0 => Err(NO_WORKER.into()),
                _ => Ok(()),
            },
        );
        tokio::select! {
            _ = registry.changed() => {}
            _ = registry.wait_loaded(), if !loaded => {}
        }
    }
}

/// Binds and serves the OpenAI-compatible HTTP API when `--http-listen` is
/// given, until `stop` turns true.
async fn start_http(
    cfg: &RouterConfig,
    router: &Arc<route::Router>,
    tls: Option<&tokenmesh_certs::tls::MeshTls>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Option<tokio::task::JoinHandle<()>>, RunError> {
    let Some(addr) = cfg.http.http_listen else {
        return Ok(None);
    };
    let keys = match &cfg.http.api_keys {
        Some(path) => Some(openai::auth::ApiKeys::load(path)?),
        None => None,
    };
    use tokenmesh_certs::tls::server::ClientCerts;
    let client_certs = if keys.is_some() {
        ClientCerts::Optional
    } else {
        ClientCerts::Required
    };
    let tls_config = match tls {
        Some(t) => Some(
            t.http_server_config(client_certs)
                .map_err(tokenmesh_runtime::ServeError::from)?,
        ),
        None => None,
    };
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| RunError::HttpBind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| RunError::HttpBind { addr, source })?;
    let mode = match (&tls_config, &keys) {
        (Some(_), Some(_)) => "TLS; API key or client certificate",
        (Some(_), None) => "mTLS",
        (None, Some(_)) => "plaintext; API keys",
        (None, None) => "plaintext",
    };
    if let Some(k) = &keys {
        tracing::info!(keys = k.len(), "api keys loaded");
    }
    println!("tokenmesh-router OpenAI-compatible HTTP on {bound} ({mode})");
    let app = openai::app(
        router.clone(),
        openai::HttpSettings {
            keys,
            max_body_bytes: cfg.http.http_max_body_bytes,
        },
    );
    Ok(Some(tokio::spawn(openai::serve(
        app, listener, tls_config, stop,
    ))))
}

/// Fills the registry from the static file, or from etcd with a watch (and
/// then also publishes this router's stats there, until `stop`).
fn start_discovery(
    cfg: &RouterConfig,
    registry: &Arc<Registry>,
    tls: Option<&tokenmesh_certs::tls::MeshTls>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Option<tokio::task::JoinHandle<()>>, RunError> {
    if let Some(path) = &cfg.static_file {
        discovery::static_file::load(path, registry)?;
        return Ok(None);
    }
    let etcd = &cfg.server.etcd;
    if etcd.is_empty() {
        return Err(RunError::NoDiscovery);
    }
    let router_id = cfg.router_id();
    if router_id.is_empty() || router_id.contains('/') {
        return Err(RunError::RouterId(router_id));
    }
    let etcd_tls = cfg.server.etcd_tls(tls);
    tokio::spawn(discovery::etcd::run(
        etcd.clone(),
        cfg.server.keys(),
        registry.clone(),
        etcd_tls.clone(),
    ));
    Ok(Some(tokio::spawn(stats::publish::run(
        stats::publish::PublishConfig {
            endpoints: etcd.clone(),
            keys: cfg.server.keys(),
            router_id,
            interval: Duration::from_millis(cfg.stats_interval_ms),
            retention: Duration::from_secs(cfg.stats_retention_s),
            tls: etcd_tls,
        },
        registry.stats().clone(),
        registry.clone(),
        stop,
    ))))
}
