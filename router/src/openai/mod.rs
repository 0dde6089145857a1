//! The OpenAI-compatible HTTP API of the router (`--http-listen`):
//! `POST /v1/chat/completions`, `POST /v1/completions` (Server-Sent Events
//! with `"stream": true`, one JSON object otherwise) and `GET /v1/models`,
//! on the same request path as gRPC ([`Router::route`]: admission, version
//! policy, P2C, retries, failover, cancellation, deadlines, metrics with
//! `api="openai"`).
//!
//! - [`request`]: OpenAI bodies to a `GenerateRequest`, refusals naming the field;
//! - [`convert`] and [`wire`]: the stream back as OpenAI's response objects;
//! - [`errors`]: OpenAI's error shape, the one mapping from gRPC codes;
//! - [`auth`]: API keys (`--api-keys`) and client certificates;
//! - [`handlers`]: the routes.
//!
//! The listener speaks HTTP/1.1 and HTTP/2 (hyper, through axum's router).
//! Under `--tls-dir` it serves TLS with the router's certificate (reloaded
//! like the gRPC port's): client certificates are required at the handshake
//! unless `--api-keys` is given, when they are optional and a request
//! without one must carry a key.
pub mod auth;
pub mod convert;
pub mod errors;
pub mod handlers;
pub mod request;
pub mod wire;

use crate::route::Router;
use auth::{ApiKeys, ConnInfo};
use axum::routing::{get, post};
use handlers::AppState;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokenmesh_certs::tls::Identity;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::StreamExt;

/// Settings of the HTTP API.
#[derive(Debug, Clone)]
pub struct HttpSettings {
    /// `--api-keys`, loaded.
    pub keys: Option<ApiKeys>,
    /// Largest request body accepted (`--http-max-body-bytes`).
    pub max_body_bytes: usize,
}

/// How long streams in flight may run on after shutdown begins.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// The routes over `router`.
pub fn app(router: Arc<Router>, settings: HttpSettings) -> axum::Router {
    let state = Arc::new(AppState {
        router,
        keys: settings.keys,
        max_body_bytes: settings.max_body_bytes,
    });
    axum::Router::new()
        .route("/v1/chat/completions", post(handlers::chat))
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/models", get(handlers::models))
        .route("/v1/models/{model}", get(handlers::model))
        .fallback(handlers::no_route)
        .method_not_allowed_fallback(handlers::wrong_method)
        .with_state(state)
}

/// Serves `app` on `listener` (TLS with `tls`, else plaintext) until
/// `shutdown` turns true; then stops accepting and gives open connections
/// [`SHUTDOWN_GRACE`] to finish.
pub async fn serve(
    app: axum::Router,
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // hyper's HTTP/1 header timeout and HTTP/2 keepalive need a timer.
    builder.http1().timer(TokioTimer::new());
    builder.http2().timer(TokioTimer::new());
    let (open, mut all_closed) = tokio::sync::mpsc::channel::<()>(1);
    let server = Server {
        app,
        builder: Arc::new(builder),
        shutdown: shutdown.clone(),
        open,
    };
    let stopped = async {
        let _ = shutdown.wait_for(|stop| *stop).await;
    };
    match tls {
        Some(config) => {
            let mut accepted = tokenmesh_certs::tls::server::incoming(listener, config);
            tokio::pin!(stopped);
            loop {
                let stream = tokio::select! {
                    s = accepted.next() => s,
                    _ = &mut stopped => break,
                };
                let Some(Ok(stream)) = stream else { break };
                let (tcp, session) = stream.get_ref();
                let Ok(peer) = tcp.peer_addr() else { continue };
                let cert = session
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .map(|leaf| Identity::from_cert_der(leaf).map_err(|e| e.to_string()));
                server.connection(stream, ConnInfo { peer, cert });
            }
        }
        None => {
            tokio::pin!(stopped);
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = &mut stopped => break,
                };
                let (tcp, peer): (_, SocketAddr) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Usually out of file descriptors: back off instead of spinning.
                        tracing::warn!(error = %e, "http accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                // Without TCP_NODELAY small SSE frames wait on Nagle.
                let _ = tcp.set_nodelay(true);
                server.connection(tcp, ConnInfo { peer, cert: None });
            }
        }
    }
    // Every connection holds a sender; the channel closes with the last.
    drop(server);
    if tokio::time::timeout(SHUTDOWN_GRACE, all_closed.recv())
        .await
        .is_err()
    {
        tracing::warn!("http connections still open after the shutdown grace; closing them");
    }
}

struct Server {
    app: axum::Router,
    builder: Arc<auto::Builder<TokioExecutor>>,
    /// Turns true when shutdown begins: each connection then finishes its
    /// requests in flight and closes.
    shutdown: watch::Receiver<bool>,
    /// Held by every connection task, so shutdown can wait for the last.
    open: tokio::sync::mpsc::Sender<()>,
}

impl Server {
    /// Serves one connection in a task of its own; its requests carry `info`.
    fn connection<I>(&self, io: I, info: ConnInfo)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let svc = tower::ServiceExt::map_request(
            self.app.clone(),
            move |mut req: http::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(info.clone());
                req
            },
        );
        let svc = hyper_util::service::TowerToHyperService::new(svc);
        let builder = self.builder.clone();
        let mut shutdown = self.shutdown.clone();
        let open = self.open.clone();
        tokio::spawn(async move {
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), svc);
            tokio::pin!(conn);
            let mut stopping = false;
            let result = loop {
                tokio::select! {
                    r = conn.as_mut() => break r,
                    _ = shutdown.wait_for(|stop| *stop), if !stopping => {
                        // Finish the requests in flight, take no more.
                        conn.as_mut().graceful_shutdown();
                        stopping = true;
                    }
                }
            };
            if let Err(e) = result {
                tracing::debug!(error = %e, "http connection ended with an error");
            }
            drop(open);
        });
    }
}
