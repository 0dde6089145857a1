//! The server side of mutual TLS: our own rustls acceptor in front of
//! tonic's `serve_with_incoming`. tonic's built-in `ServerTlsConfig` fixes
//! the certificate at start-up; here each handshake asks the [`CertStore`]
//! for the certificate in use, so a reload needs no restart.
use crate::tls::material::{provider, TlsError};
use crate::tls::reload::CertStore;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;

/// How long a client may take to complete the handshake before it is
/// dropped, so a silent connection cannot hold a task forever.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A server config that demands a client certificate signed by `roots` and
/// presents the store's current certificate.
pub fn server_config(
    store: Arc<CertStore>,
    roots: Arc<RootCertStore>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider.clone()).build()?;
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(store);
    // gRPC is HTTP/2 only.
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}

/// Whether an HTTP listener demands a client certificate at the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientCerts {
    /// Every client presents a certificate signed by the mesh CA.
    Required,
    /// A client may present one (it is then verified against the mesh CA)
    /// or none, and authenticate some other way (an API key).
    Optional,
}

/// A server config for an HTTP listener (HTTP/2 and HTTP/1.1 by ALPN) that
/// presents the store's current certificate and verifies client
/// certificates against `roots` as `client_certs` says.
pub fn http_server_config(
    store: Arc<CertStore>,
    roots: Arc<RootCertStore>,
    client_certs: ClientCerts,
) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider.clone());
    let verifier = match client_certs {
        ClientCerts::Required => verifier.build()?,
        ClientCerts::Optional => verifier.allow_unauthenticated().build()?,
    };
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(store);
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// Accepts connections on `listener` and yields those that completed the
/// mutual-TLS handshake. Each handshake runs in its own task, so a slow or
/// failing client never delays the others; a failed one is logged and
/// dropped, and the server keeps serving.
pub fn incoming(
    listener: TcpListener,
    config: Arc<ServerConfig>,
) -> ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>> {
    let (tx, rx) = mpsc::channel(64);
    let acceptor = TlsAcceptor::from(config);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = tx.closed() => return,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Usually out of file descriptors: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => tracing::info!(%peer, error = %e, "tls handshake refused"),
                    Err(_) => tracing::info!(%peer, "tls handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}
