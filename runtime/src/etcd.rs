//! Connections to etcd, with the same timeouts and keepalive in every
//! process, and mutual TLS towards an etcd that requires client certificates.
use etcd_client::{Client, ConnectOptions};
use std::time::Duration;
use tokenmesh_certs::tls::TlsPaths;

/// How long a connection attempt to one endpoint may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// What a client is for, which decides its timeouts. Every client keeps its
/// connection alive with HTTP/2 pings, also while idle, so a dead peer is
/// noticed within seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// Unary requests (put, get, lease grant): each bounded by `timeout`, so
    /// a stopped node cannot hang a caller.
    Requests { timeout: Duration },
    /// Long calls (watches, election campaigns): no per-request bound.
    Streams,
}

/// A client of `endpoints` for `usage`; with `tls`, mutual TLS.
pub async fn connect(
    endpoints: &[String],
    tls: Option<&TlsPaths>,
    usage: Use,
) -> Result<Client, etcd_client::Error> {
    let mut opts = ConnectOptions::new()
        .with_connect_timeout(CONNECT_TIMEOUT)
        .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3))
        .with_keep_alive_while_idle(true);
    if let Use::Requests { timeout } = usage {
        opts = opts.with_timeout(timeout);
    }
    if let Some(paths) = tls {
        let tls = tokenmesh_certs::tls::etcd::client_tls(paths)
            .map_err(|e| etcd_client::Error::InvalidArgs(format!("etcd TLS: {e}")))?;
        opts = opts.with_tls(tls);
    }
    Client::connect(endpoints, Some(opts)).await
}

/// Whether `e` failed before the request reached etcd: its endpoint could
/// not be connected to.
///
/// tonic's balancer (the client's channel, even for one endpoint) counts an
/// endpoint whose last reconnect failed as ready and hands that failure to
/// the next request, however old it is (from while the member was down,
/// say), and it keeps picking the endpoint it picked last while that one is
/// "ready": a member that is down fails requests, and one more after it is
/// back. Such a request was never sent, so sending it elsewhere is safe,
/// writes included.
pub fn never_sent(e: &etcd_client::Error) -> bool {
    let etcd_client::Error::GRpcStatus(status) = e else {
        return false;
    };
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        if err.is::<tonic::ConnectError>() {
            return true;
        }
        source = err.source();
    }
    false
}

/// When a failed request may go to the next member: what etcd's own Go
/// client does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// A read: after any unavailable member, a timeout included.
    Read,
    /// A write: only when it was never sent ([`never_sent`]); one that may
    /// have reached etcd is the caller's to judge.
    Write,
}

impl Retry {
    fn allows(self, e: &etcd_client::Error) -> bool {
        if never_sent(e) {
            return true;
        }
        let etcd_client::Error::GRpcStatus(status) = e else {
            return false;
        };
        self == Retry::Read
            && matches!(
                status.code(),
                // Cancelled: tonic's name for the request timeout running out.
                tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
            )
    }
}

/// A client of each etcd member on its own, for unary requests that should
/// not fail while one member is down: a request goes to the member that
/// answered last and, when [`Retry`] allows, on to the next one.
#[derive(Clone)]
pub struct Members {
    clients: std::sync::Arc<[Client]>,
    preferred: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// No further member is tried once a request has taken this long.
    budget: Duration,
}

impl Members {
    /// Lazily connected clients of each of `endpoints`, every request
    /// bounded by `timeout`.
    pub async fn connect(
        endpoints: &[String],
        tls: Option<&TlsPaths>,
        timeout: Duration,
    ) -> Result<Self, etcd_client::Error> {
        let mut clients = Vec::with_capacity(endpoints.len());
        for e in endpoints {
            clients.push(connect(std::slice::from_ref(e), tls, Use::Requests { timeout }).await?);
        }
        if clients.is_empty() {
            return Err(etcd_client::Error::InvalidArgs("no etcd endpoints".into()));
        }
        Ok(Self {
            clients: clients.into(),
            preferred: Default::default(),
            budget: timeout,
        })
    }

    /// `op` on the preferred member's client, then on each next one while
    /// `retry` allows and the budget lasts.
    pub async fn send<T, F, Fut>(&self, retry: Retry, op: F) -> Result<T, etcd_client::Error>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        use std::sync::atomic::Ordering::Relaxed;
        let started = std::time::Instant::now();
        let n = self.clients.len();
        let first = self.preferred.load(Relaxed) % n;
        let mut tried = 0;
        loop {
            let i = (first + tried) % n;
            tried += 1;
            match op(self.clients[i].clone()).await {
                Ok(v) => {
                    self.preferred.store(i, Relaxed);
                    return Ok(v);
                }
                Err(e) if retry.allows(&e) => {
                    self.preferred.store((i + 1) % n, Relaxed);
                    if tried == n || started.elapsed() >= self.budget {
                        return Err(e);
                    }
                    tracing::debug!(member = i, error = %e, "etcd member unavailable; trying the next");
                }
                Err(e) => return Err(e),
            }
        }
    }
}
