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
