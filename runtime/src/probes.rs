//! The plaintext HTTP listener of `--metrics-listen`: Prometheus text at
//! `/metrics`, `GET /healthz` (the process is alive: 200) and `GET /readyz`
//! (200 when the server's [`Readiness`] says ready, else 503 with the reason
//! as plain text), for platforms that cannot present a mesh client
//! certificate (Kubernetes probes, load balancers, compose health checks).
//!
//! It accepts only what probes and scrapers send: `GET` or `HEAD`, no body,
//! headers within a small buffer read within a few seconds, a bounded number
//! of connections at once, each for a bounded time.
use crate::histograms::MetricsHandle;
use crate::readiness::Readiness;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ALLOW, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

/// Connections served at once; more are closed as they arrive.
const MAX_CONNECTIONS: usize = 64;
/// A request's headers must arrive within this.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection, keep-alive included, lasts at most this.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);
/// hyper's read buffer (its minimum): a request is its headers only.
const MAX_BUF: usize = 8192;

/// Why the listener could not start.
#[derive(Debug, thiserror::Error)]
#[error("binding --metrics-listen {addr}: {source}")]
pub struct ProbeError {
    pub addr: SocketAddr,
    pub source: std::io::Error,
}

/// The running listener; stops when dropped.
pub struct Probes {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Probes {
    /// Binds `addr` and serves at once (call inside the tokio runtime).
    /// `/metrics` renders `metrics`; without a recorder it answers 404.
    pub fn listen(
        addr: SocketAddr,
        readiness: Readiness,
        metrics: Option<MetricsHandle>,
    ) -> Result<Self, ProbeError> {
        let err = |source| ProbeError { addr, source };
        let std = std::net::TcpListener::bind(addr).map_err(err)?;
        std.set_nonblocking(true).map_err(err)?;
        let bound = std.local_addr().map_err(err)?;
        let listener = TcpListener::from_std(std).map_err(err)?;
        let state = Arc::new(State { readiness, metrics });
        Ok(Self {
            addr: bound,
            task: tokio::spawn(accept(listener, state)),
        })
    }

    /// The address it is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Probes {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct State {
    readiness: Readiness,
    metrics: Option<MetricsHandle>,
}

async fn accept(listener: TcpListener, state: Arc<State>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors and the like: wait instead of spinning.
                tracing::warn!(error = %e, "metrics listener: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let response = respond(&state, &req);
                async move { Ok::<_, Infallible>(response) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(MAX_BUF)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_TIMEOUT, conn).await;
            drop(slot);
        });
    }
}

/// The answer to one request.
fn respond(state: &State, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET and HEAD are served\n".into(),
        );
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        r.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
        return r;
    }
    if has_body(req) {
        // Never read: the connection closes after the answer.
        let mut r = text(
            StatusCode::PAYLOAD_TOO_LARGE,
            "no request body is accepted\n".into(),
        );
        r.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
        return r;
    }
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => match state.readiness.check() {
            Ok(()) => text(StatusCode::OK, "ready\n".into()),
            Err(reason) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {reason}\n"),
            ),
        },
        "/metrics" => match &state.metrics {
            Some(handle) => {
                let mut r = Response::new(Full::new(Bytes::from(handle.render())));
                r.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                r
            }
            None => text(
                StatusCode::NOT_FOUND,
                "no metrics are recorded in this process\n".into(),
            ),
        },
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; this listener serves /metrics, /healthz and /readyz\n".into(),
        ),
    }
}

/// Whether the request announces a body (a length above zero, or chunks).
fn has_body(req: &Request<Incoming>) -> bool {
    let h = req.headers();
    h.contains_key(hyper::header::TRANSFER_ENCODING)
        || h.get(CONTENT_LENGTH)
            .is_some_and(|v| v.to_str().map_or(true, |s| s.trim() != "0"))
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Sends `request` as is and returns the whole answer.
    async fn raw(addr: SocketAddr, request: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        // A refused request may be cut short: keep what came back.
        let _ = s.write_all(request.as_bytes()).await;
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    fn get(path: &str) -> String {
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    }

    fn listen(readiness: &Readiness) -> Probes {
        Probes::listen("127.0.0.1:0".parse().unwrap(), readiness.clone(), None).unwrap()
    }

    #[tokio::test]
    async fn healthz_is_alive_and_readyz_follows_readiness() {
        let readiness = Readiness::new();
        readiness.not_ready("model", "loading the model");
        let probes = listen(&readiness);
        let addr = probes.local_addr();
        assert!(raw(addr, &get("/healthz"))
            .await
            .starts_with("HTTP/1.1 200"));
        let not_ready = raw(addr, &get("/readyz")).await;
        assert!(not_ready.starts_with("HTTP/1.1 503"), "{not_ready}");
        assert!(
            not_ready.ends_with("not ready: loading the model\n"),
            "{not_ready}"
        );
        readiness.ready("model");
        let ready = raw(addr, &get("/readyz")).await;
        assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
        assert!(ready.ends_with("ready\n"), "{ready}");
    }

    #[tokio::test]
    async fn only_bodiless_get_and_head_of_known_paths_are_served() {
        let probes = listen(&Readiness::new());
        let addr = probes.local_addr();
        let post = "POST /readyz HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc";
        assert!(raw(addr, post).await.starts_with("HTTP/1.1 405"));
        let with_body = "GET /readyz HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc";
        assert!(raw(addr, with_body).await.starts_with("HTTP/1.1 413"));
        let head = "HEAD /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        assert!(raw(addr, head).await.starts_with("HTTP/1.1 200"));
        assert!(raw(addr, &get("/nope")).await.starts_with("HTTP/1.1 404"));
        // No recorder in this test process.
        assert!(raw(addr, &get("/metrics"))
            .await
            .starts_with("HTTP/1.1 404"));
        // Headers beyond the buffer are refused, not buffered.
        let huge = format!(
            "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\n\r\n",
            "a".repeat(64 * 1024)
        );
        let answer = raw(addr, &huge).await;
        assert!(
            answer.is_empty() || answer.starts_with("HTTP/1.1 431"),
            "{answer}"
        );
    }
}
