//! Start-up every tokenmesh server shares: gRPC health and reflection beside
//! the process's own service, the authorization layer that admits callers by
//! the role in their certificate, mutual TLS with reloadable certificates or
//! plaintext, and graceful shutdown.
use std::convert::Infallible;
use std::future::Future;
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
    /// Until it resolves, grpc.health reports NOT_SERVING.
    ready: Option<std::pin::Pin<Box<dyn Future<Output = ()> + Send>>>,
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
            ready: None,
        }
    }

    /// Reports NOT_SERVING on grpc.health, for the server and its service,
    /// until `ready` resolves (a router before its first discovery view).
    pub fn serving_once(mut self, ready: impl Future<Output = ()> + Send + 'static) -> Self {
        self.ready = Some(Box::pin(ready));
        self
    }

    /// Adjusts the HTTP/2 server (keepalive, connection age, …).
    pub fn configure(
        mut self,
        f: impl FnOnce(tonic::transport::Server) -> tonic::transport::Server,
    ) -> Self {
        self.builder = f(self.builder);
        self
    }

    /// The health reporter, for a process that changes its status while it
    /// runs (a draining worker reports NOT_SERVING).
    pub fn health(&self) -> HealthReporter {
        self.health.clone()
    }

    /// Whether the server runs mutual TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Serves `service` (reported SERVING on grpc.health), health and
    /// reflection on `listener` until `shutdown` resolves. `service` comes
    /// with its request-size limit set ([`crate::edge::MAX_REQUEST_BYTES`],
    /// a worker's [`crate::edge::MAX_WORKER_REQUEST_BYTES`]); health and
    /// reflection get the former, and [`crate::edge::layer`] turns refusals
    /// of undecodable or oversize requests into client statuses. Prints `ready` and
    /// the transport on stdout once the listener accepts, the line launchers
    /// and operators wait for.
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
        match self.ready {
            None => {
                self.health
                    .set_service_status(S::NAME, ServingStatus::Serving)
                    .await
            }
            Some(ready) => {
                for name in ["", S::NAME] {
                    self.health
                        .set_service_status(name, ServingStatus::NotServing)
                        .await;
                }
                let health = self.health.clone();
                tokio::spawn(async move {
                    ready.await;
                    for name in ["", S::NAME] {
                        health
                            .set_service_status(name, ServingStatus::Serving)
                            .await;
                    }
                });
            }
        }
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
                served?;
            }
            None => {
                println!("{ready} (plaintext)");
                routes
                    .serve_with_incoming_shutdown(
                        // Without TCP_NODELAY small HTTP/2 frames wait on Nagle.
                        TcpIncoming::from(listener).with_nodelay(Some(true)),
                        shutdown,
                    )
                    .await?;
            }
        }
        Ok(())
    }
}
