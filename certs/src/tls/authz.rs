//! Authorization at the server edge: one tower layer, used by every server,
//! reads the identity from the verified peer certificate, refuses roles the
//! server does not admit and attaches the [`Identity`] to the request's
//! extensions for the handlers.
use crate::tls::identity::{Identity, Role};
use futures::future::{Either, Ready};
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::Status;
use tower::{Layer, Service};

/// Who a server admits.
#[derive(Clone, Debug)]
pub struct AuthLayer {
    policy: Arc<Policy>,
}

#[derive(Debug)]
struct Policy {
    server: &'static str,
    admit: Vec<Role>,
    /// mTLS mode: a request without a peer certificate is refused. In
    /// plaintext mode (`--insecure`) there is no identity to check.
    require_identity: bool,
}

impl AuthLayer {
    /// `server` names the server in refusals; `admit` are the roles it serves.
    pub fn new(server: &'static str, admit: &[Role], require_identity: bool) -> Self {
        Self {
            policy: Arc::new(Policy {
                server,
                admit: admit.to_vec(),
                require_identity,
            }),
        }
    }

    /// The identity a request may proceed with, or the status refusing it.
    fn check<B>(&self, req: &http::Request<B>) -> Result<Option<Identity>, Status> {
        let p = &self.policy;
        let certs = req
            .extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(|i| i.peer_certs());
        let Some(leaf) = certs.as_ref().and_then(|c| c.first().cloned()) else {
            return if p.require_identity {
                Err(Status::unauthenticated(format!(
                    "{} requires a client certificate",
                    p.server
                )))
            } else {
                Ok(None)
            };
        };
        let identity = Identity::from_cert_der(&leaf).map_err(|e| {
            Status::unauthenticated(format!("client certificate has no identity: {e}"))
        })?;
        if !p.admit.contains(&identity.role) {
            let wanted: Vec<&str> = p.admit.iter().map(|r| r.as_str()).collect();
            return Err(Status::permission_denied(format!(
                "{} (role {}) may not call the {}: role {} required",
                identity.uri(),
                identity.role,
                p.server,
                wanted.join(" or ")
            )));
        }
        Ok(Some(identity))
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = Auth<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Auth {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`AuthLayer`] wraps around a server's routes.
#[derive(Clone, Debug)]
pub struct Auth<S> {
    inner: S,
    layer: AuthLayer,
}

impl<S, B> Service<http::Request<B>> for Auth<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<S::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        match self.layer.check(&req) {
            Ok(identity) => {
                if let Some(id) = identity {
                    tracing::debug!(identity = %id, path = %req.uri().path(), "authorized");
                    req.extensions_mut().insert(id);
                }
                Either::Left(self.inner.call(req))
            }
            Err(status) => {
                tracing::warn!(path = %req.uri().path(), code = ?status.code(), reason = %status.message(), "request refused");
                Either::Right(futures::future::ready(Ok(status.into_http())))
            }
        }
    }
}
