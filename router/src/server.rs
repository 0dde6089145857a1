//! The `tokenmesh.v1.Inference` gRPC service: the thin edge of the request
//! path. It turns a call into an [`Incoming`] (identity, deadline, checks,
//! pin and session from the message or its headers), hands it to
//! [`Router::route`], and the result into a response; errors become statuses
//! here, once.
use crate::admission::Admission;
use crate::errors::RouterError;
use crate::registry::Registry;
use crate::route::version::has_canary;
use crate::route::{request_span, Api, ClientMessages, Incoming, RouteSettings, Router};
use std::sync::Arc;
use std::time::Instant;
use tokenmesh_proto::headers;
use tokenmesh_proto::v1::inference_server::Inference;
use tokenmesh_proto::v1::{
    GenerateRequest, ListModelsRequest, ListModelsResponse, ModelInfo, VersionInfo,
};
use tokenmesh_proto::validate::{check_id, check_name, check_request, MAX_NAME_BYTES};
use tokenmesh_runtime::telemetry;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// Serves Generate and ListModels from the registry.
#[derive(Clone)]
pub struct InferenceService {
    router: Arc<Router>,
}

impl InferenceService {
    /// A service over a registry that discovery keeps up to date.
    pub fn new(
        registry: Arc<Registry>,
        admission: Arc<Admission>,
        settings: RouteSettings,
    ) -> Self {
        Self::with_router(Arc::new(Router::new(registry, admission, settings)))
    }

    /// A service over a request path it shares (with the HTTP API).
    pub fn with_router(router: Arc<Router>) -> Self {
        Self { router }
    }
}

/// Who is calling, for per-identity limits and the trace: the verified
/// certificate identity under mutual TLS, else (plaintext, development only)
/// the peer's IP address.
fn identity_of<T>(request: &Request<T>) -> String {
    if let Some(id) = request.extensions().get::<tokenmesh_certs::tls::Identity>() {
        return id.to_string();
    }
    request
        .remote_addr()
        .map(|a| a.ip().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// Reads one call: checks the request, gives it an id if it has none, and
/// takes the pin and session from the message or else its headers.
fn incoming(
    request: Request<GenerateRequest>,
    span: &tracing::Span,
) -> Result<Incoming, RouterError> {
    let started = Instant::now();
    let deadline = tokenmesh_proto::deadline::grpc_timeout(request.metadata())
        .map(|t| tokio::time::Instant::now() + t);
    let identity = identity_of(&request);
    span.record("identity", identity.as_str());
    let (md, _, mut req) = request.into_parts();
    check_request(&req)?;
    // Only checked strings reach the span (and the log lines under it).
    span.record("model", req.model.as_str());
    if req.request_id.is_empty() {
        req.request_id = uuid::Uuid::new_v4().to_string();
    }
    span.record("request_id", req.request_id.as_str());
    let pin = match req.version.clone().filter(|v| !v.is_empty()) {
        Some(v) => Some(v),
        None => header(&md, headers::VERSION)
            .map(|v| check_name(headers::VERSION, v).map(|()| v.to_string()))
            .transpose()?,
    };
    let session = if req.session_id.is_empty() {
        header(&md, headers::SESSION)
            .map(|s| check_id(headers::SESSION, s).map(|()| s.to_string()))
            .transpose()?
    } else {
        Some(req.session_id.clone())
    };
    Ok(Incoming {
        request: req,
        identity,
        pin,
        session,
        deadline,
        started,
        api: Api::Grpc,
    })
}

impl InferenceService {
    /// Routes one call; the response carries the version and worker that
    /// serve it in its metadata.
    async fn start(
        &self,
        request: Request<GenerateRequest>,
        span: tracing::Span,
    ) -> Result<Response<ClientMessages>, RouterError> {
        let incoming = incoming(request, &span)?;
        let routed = self.router.route(incoming, &span).await?;
        let mut response = Response::new(routed.stream);
        if let Ok(v) = routed.version.parse() {
            response.metadata_mut().insert(headers::VERSION, v);
        }
        if let Ok(v) = routed.worker_id.parse() {
            response.metadata_mut().insert(headers::WORKER, v);
        }
        Ok(response)
    }
}

fn header<'a>(md: &'a MetadataMap, name: &str) -> Option<&'a str> {
    md.get(name)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
}

#[tonic::async_trait]
impl Inference for InferenceService {
    type GenerateStream = ClientMessages;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let span = request_span(Api::Grpc);
        telemetry::adopt_parent(&span, request.metadata());
        // Kept for the refusal's metric label, if it can be one at all.
        let asked = Some(&request.get_ref().model)
            .filter(|m| m.len() <= MAX_NAME_BYTES)
            .cloned()
            .unwrap_or_default();
        match self
            .start(request, span.clone())
            .instrument(span.clone())
            .await
        {
            Ok(r) => Ok(r),
            Err(e) => {
                let status = e.into_status();
                span.record("otel.status_code", "ERROR");
                span.record("error", status.message());
                tracing::info!(parent: &span, code = ?status.code(), error = %status.message(), "refused");
                self.router.count_refusal(&asked, Api::Grpc, status.code());
                Err(status)
            }
        }
    }

    async fn list_models(
        &self,
        _: Request<ListModelsRequest>,
    ) -> Result<Response<ListModelsResponse>, Status> {
        // An empty list would read as "no models"; the truth is "not yet".
        self.router.ensure_loaded()?;
        let models = self
            .router
            .registry()
            .models()
            .into_iter()
            .map(|(name, entry)| {
                let policy = entry.policy.clone().unwrap_or_default();
                let canary = policy.canary.clone().filter(|_| has_canary(&policy));
                let versions = entry
                    .versions
                    .iter()
                    .map(|(v, eps)| {
                        let ready: Vec<String> = eps
                            .iter()
                            .filter(|e| e.ready())
                            .map(|e| e.id.clone())
                            .collect();
                        let weight = match (&canary, entry.policy.is_some()) {
                            (Some(c), _) if c.version == *v => c.weight,
                            (Some(c), _) if policy.stable == *v => 100 - c.weight.min(100),
                            (None, true) if policy.stable == *v => 100,
                            _ => 0,
                        };
                        VersionInfo {
                            version: v.clone(),
                            weight,
                            ready_workers: ready.len() as u32,
                            worker_ids: ready,
                        }
                    })
                    .collect();
                ModelInfo {
                    name,
                    stable_version: policy.stable.clone(),
                    canary_version: canary
                        .as_ref()
                        .map(|c| c.version.clone())
                        .unwrap_or_default(),
                    canary_weight: canary.map(|c| c.weight).unwrap_or(0),
                    versions,
                    sticky: entry.policy.as_ref().is_none_or(|p| p.sticky),
                    pin_allowed: entry.policy.as_ref().is_none_or(|p| p.pin_allowed),
                }
            })
            .collect();
        Ok(Response::new(ListModelsResponse { models }))
    }
}
