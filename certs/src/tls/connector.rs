//! The client side towards one peer whose identity is known in advance: the
//! router's channel to a worker presents the router's certificate and
//! accepts only a server certificate that chains to the mesh CA *and* names
//! the worker the registration says is there (`spiffe://tokenmesh/worker/{id}`),
//! so a forged registration cannot draw traffic to an impostor.
//!
//! The worker's address is not checked against DNS/IP SANs: a worker may be
//! reached at any address its registration advertises, and it is the
//! SPIFFE identity, not the address, that says who it is.
use crate::tls::identity::Identity;
use crate::tls::material::{provider, TlsError};
use crate::tls::reload::CertStore;
use hyper_util::rt::TokioIo;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::verify_server_cert_signed_by_trust_anchor;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// Verifies a server certificate against the CA and one expected identity.
#[derive(Debug)]
pub struct PeerIdentityVerifier {
    roots: Arc<RootCertStore>,
    expected: Identity,
    provider: Arc<CryptoProvider>,
    /// Warn once per channel, not on every reconnect attempt.
    warned: AtomicBool,
}

impl PeerIdentityVerifier {
    /// A verifier that accepts only `expected`.
    pub fn new(roots: Arc<RootCertStore>, expected: Identity) -> Self {
        Self {
            roots,
            expected,
            provider: provider(),
            warned: AtomicBool::new(false),
        }
    }
}

impl ServerCertVerifier for PeerIdentityVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let parsed = ParsedCertificate::try_from(end_entity)?;
        verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        let presented = Identity::from_cert_der(end_entity)
            .map_err(|e| rustls::Error::General(format!("peer certificate: {e}")))?;
        if presented != self.expected {
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    expected = %self.expected,
                    presented = %presented,
                    "peer certificate names another identity; refusing the connection"
                );
            }
            return Err(rustls::Error::General(format!(
                "peer presented {}, expected {}",
                presented.uri(),
                self.expected.uri()
            )));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A client config that presents the store's current certificate and
/// accepts only `expected` as the server.
pub fn peer_client_config(
    store: Arc<CertStore>,
    roots: Arc<RootCertStore>,
    expected: Identity,
) -> Result<Arc<ClientConfig>, TlsError> {
    let mut cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PeerIdentityVerifier::new(roots, expected)))
        .with_client_cert_resolver(store);
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}

/// A connector for tonic's `Endpoint::connect_with_connector`: TCP, then
/// mutual TLS with [`peer_client_config`]. The URI's scheme is ignored (the
/// registration says `http://`; the transport is decided here).
#[derive(Clone)]
pub struct PeerConnector {
    config: Arc<ClientConfig>,
}

impl PeerConnector {
    /// A connector over a client config.
    pub fn new(config: Arc<ClientConfig>) -> Self {
        Self { config }
    }
}

type ConnectFuture =
    Pin<Box<dyn Future<Output = Result<TokioIo<TlsStream<TcpStream>>, std::io::Error>> + Send>>;

impl tower::Service<http::Uri> for PeerConnector {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = ConnectFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connector = TlsConnector::from(self.config.clone());
        Box::pin(async move {
            let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
            let host = uri
                .host()
                .ok_or_else(|| invalid(format!("{uri}: no host")))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = uri.port_u16().unwrap_or(443);
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            // Only used for SNI here; identity is checked by the verifier.
            let name =
                ServerName::try_from(host.clone()).map_err(|e| invalid(format!("{host}: {e}")))?;
            let tls = connector.connect(name, tcp).await?;
            Ok(TokioIo::new(tls))
        })
    }
}
