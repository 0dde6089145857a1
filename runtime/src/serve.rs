//! Start-up every tokenmesh server shares: gRPC health and reflection beside
//! the process's own service, the authorization layer that admits callers by
//! the role in their certificate, mutual TLS with reloadable certificates or
//! plaintext, graceful shutdown, and the plaintext probe listener. One
//! [`Readiness`] drives both grpc.health and `/readyz`.
use crate::probes::{ProbeError, Probes};
use crate::readiness::{Readiness, ReadinessWatch};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;
use tokenmesh_certs::tls::{AuthLayer, MeshTls, Role, TlsError};
use tokio::net::TcpListener;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::transport::server::TcpIncoming;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};
use tonic_health::ServingStatus;

/// Why a server could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Transport(#[from] tokenmesh_certs::tls::TransportError),
    #[error("--tls-dir: {0}")]
    Tls(#[from] TlsError),
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("listener: {0}")]
    Listener(std::io::Error),
    #[error(transparent)]
    Probes(#[from] ProbeError),
}

/// The address `listener` is bound to, for the ready line and registrations.
pub fn bound(listener: &TcpListener) -> Result<std::net::SocketAddr, ServeError> {
    listener.local_addr().map_err(ServeError::Listener)
}

/// One gRPC server of a tokenmesh process, before it serves.
pub struct Server {
    name: &'static str,
    admits: &'static [Role],
    tls: Option<MeshTls>,
    tls_reload: Duration,
    builder: tonic::transport::Server,
    health: HealthReporter,
    /// SERVING on grpc.health and 200 on `/readyz` exactly when ready.
    readiness: Readiness,
    /// The `--metrics-listen` listener, from [`Server::probes`] until the
    /// server has stopped.
    probes: Option<Probes>,
}

impl Server {
    /// A server named `name` (in refusals and logs) that admits callers whose
    /// certificate carries one of `admits` (under mutual TLS; plaintext
    /// admits everyone), with `tls` from
    /// [`tokenmesh_certs::tls::server_transport`].
    pub fn new(
        name: &'static str,
        admits: &'static [Role],
        tls: Option<MeshTls>,
        tls_reload: Duration,
    ) -> Self {
        Self {
            name,
            admits,
            tls,
            tls_reload,
            builder: tonic::transport::Server::builder(),
            health: HealthReporter::new(),
            readiness: Readiness::new(),
            probes: None,
        }
    }

    /// Serves `/metrics`, `/healthz` and `/readyz` on `addr`
    /// (`--metrics-listen`) from now until the server has stopped, so a
    /// worker loading its model is already alive (and not ready).
    pub fn probes(mut self, addr: Option<SocketAddr>) -> Result<Self, ServeError> {
        if let Some(addr) = addr {
            let metrics = crate::telemetry::metrics_handle();
            self.probes = Some(Probes::listen(addr, self.readiness.clone(), metrics)?);
        }
        Ok(self)
    }

    /// Adjusts the HTTP/2 server (keepalive, connection age, …).
    pub fn configure(
        mut self,
        f: impl FnOnce(tonic::transport::Server) -> tonic::transport::Server,
    ) -> Self {
        self.builder = f(self.builder);
        self
    }

    /// The server's readiness: each part of the process sets the conditions
    /// that hold it back (loading, draining, no discovery view yet, ...);
    /// grpc.health and `/readyz` follow it. Ready unless a condition is set.
    pub fn readiness(&self) -> Readiness {
        self.readiness.clone()
    }

    /// Whether the server runs mutual TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Serves `service`, health and reflection on `listener` until
    /// `shutdown` resolves; grpc.health reports the server and `service`
    /// SERVING while the readiness says ready, NOT_SERVING otherwise.
    /// `service` comes with its request-size limit set
    /// ([`crate::edge::MAX_REQUEST_BYTES`], a worker's
    /// [`crate::edge::MAX_WORKER_REQUEST_BYTES`]); health and reflection get
    /// the former, and [`crate::edge::layer`] turns refusals of undecodable or
    /// oversize requests into client statuses. Prints `ready` and the
    /// transport on stdout once the listener accepts, the line launchers and
    /// operators wait for.
    pub async fn serve<S>(
        self,
        service: S,
        listener: TcpListener,
        ready: String,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError>
    where
        S: tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        let _probes = self.probes;
        let mut readiness = self.readiness.subscribe();
        report(&self.health, S::NAME, readiness.current()).await;
        let follower = tokio::spawn(follow(self.health.clone(), S::NAME, readiness));
        let (reflection_v1, reflection_v1alpha) = crate::reflection::reflection();
        let limit = crate::edge::MAX_REQUEST_BYTES;
        let routes = self
            .builder
            .layer(AuthLayer::new(self.name, self.admits, self.tls.is_some()))
            .layer(crate::edge::layer())
            .add_service(
                HealthServer::new(HealthService::from_health_reporter(self.health.clone()))
                    .max_decoding_message_size(limit),
            )
            .add_service(reflection_v1.max_decoding_message_size(limit))
            .add_service(reflection_v1alpha.max_decoding_message_size(limit))
            .add_service(service);
        match self.tls {
            Some(tls) => {
                let config = tls.server_config()?;
                let watcher = tls.watch(self.tls_reload);
                println!("{ready} (mTLS)");
                let served = routes
                    .serve_with_incoming_shutdown(
                        tokenmesh_certs::tls::server::incoming(listener, config),
                        shutdown,
                    )
                    .await;
                watcher.abort();
                follower.abort();
                served?;
            }
            None => {
                println!("{ready} (plaintext)");
                let served = routes
                    .serve_with_incoming_shutdown(
                        // Without TCP_NODELAY small HTTP/2 frames wait on Nagle.
                        TcpIncoming::from(listener).with_nodelay(Some(true)),
                        shutdown,
                    )
                    .await;
                follower.abort();
                served?;
            }
        }
        Ok(())
    }
}

/// Sets grpc.health of the server ("") and `service` from `state`.
async fn report(health: &HealthReporter, service: &'static str, state: Result<(), String>) {
    let status = match state {
        Ok(()) => ServingStatus::Serving,
        Err(_) => ServingStatus::NotServing,
    };
    for name in ["", service] {
        health.set_service_status(name, status).await;
    }
}

/// Keeps grpc.health in step with the readiness, logging each change.
async fn follow(health: HealthReporter, service: &'static str, mut readiness: ReadinessWatch) {
    while readiness.changed().await {
        let state = readiness.current();
        match &state {
            Ok(()) => tracing::info!("ready"),
            Err(reason) => tracing::info!(%reason, "not ready"),
        }
        report(&health, service, state).await;
    }
}
