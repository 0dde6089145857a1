//! The `tokenmesh.v1.Inference` gRPC service: the thin edge of the request
//! path. It turns a call into an [`Incoming`] (identity, deadline, checks,
//! pin and session from the message or its headers), hands it to
//! [`Router::route`], and the result into a response; errors become statuses
//! here, once.
use crate::admission::Admission;
use crate::errors::RouterError;
use crate::registry::Registry;
use crate::route::version::has_canary;
use crate::route::wire::{ClientCodec, Outgoing};
use crate::route::{
    request_trace, Api, ClientEvents, ClientMessages, Incoming, RequestTrace, RouteSettings, Router,
};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;
use tokenmesh_proto::headers;
use tokenmesh_proto::v1::inference_server::{Inference, InferenceServer};
use tokenmesh_proto::v1::{
    GenerateRequest, ListModelsRequest, ListModelsResponse, ModelInfo, VersionInfo,
};
use tokenmesh_proto::validate::{check_id, check_name, check_request, MAX_NAME_BYTES};
use tokenmesh_runtime::telemetry::Unsampled;
use tonic::body::Body;
use tonic::metadata::MetadataMap;
use tonic::server::{NamedService, ServerStreamingService};
use tonic::{Request, Response, Status};

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
    let (md, _, mut req) = request.into_parts();
    if let Err(e) = check_request(&req) {
        span.record("identity", identity.as_str());
        return Err(e.into());
    }
    if req.request_id.is_empty() {
        req.request_id = crate::ids::uuid_v4().to_string();
    }
    // Only checked strings reach the span (and the log lines under it); in
    // one record call, which costs about 1 k instructions before its values.
    tracing::record_all!(
        span,
        identity = identity.as_str(),
        model = req.model.as_str(),
        request_id = req.request_id.as_str(),
    );
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
        unsampled: None,
    })
}

impl InferenceService {
    /// Routes one call; the response carries the version and worker that
    /// serve it in its metadata.
    async fn start(
        &self,
        request: Request<GenerateRequest>,
        span: tracing::Span,
        unsampled: Option<Unsampled>,
    ) -> Result<Response<ClientEvents>, RouterError> {
        let mut incoming = incoming(request, &span)?;
        incoming.unsampled = unsampled;
        let routed = self.router.route(incoming, &span).await?;
        let mut response = Response::new(routed.stream.encoded());
        if let Ok(v) = routed.version.parse() {
            response.metadata_mut().insert(headers::VERSION, v);
        }
        if let Ok(v) = routed.worker_id.parse() {
            response.metadata_mut().insert(headers::WORKER, v);
        }
        Ok(response)
    }

    /// `Generate`, with the client's messages as they go out.
    async fn generate_encoded(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<ClientEvents>, Status> {
        let RequestTrace { span, unsampled } = request_trace(Api::Grpc, request.metadata());
        // Kept for the refusal's metric label, if it can be one at all.
        let asked = Some(&request.get_ref().model)
            .filter(|m| m.len() <= MAX_NAME_BYTES)
            .cloned()
            .unwrap_or_default();
        // Not instrumented with the span: tracing-opentelemetry ends a span
        // at its last exit, which would end it with the routing rather than
        // the stream; log lines name it as their parent.
        match self.start(request, span.clone(), unsampled).await {
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
}

fn header<'a>(md: &'a MetadataMap, name: &str) -> Option<&'a str> {
    md.get(name)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
}

#[tonic::async_trait]
impl Inference for InferenceService {
    type GenerateStream = ClientMessages;

    /// The generated server's `Generate`, decoding every message; the router
    /// serves [`InferenceEdge`], which writes the encoded ones instead.
    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let response = self.generate_encoded(request).await?;
        let (md, stream, ext) = response.into_parts();
        Ok(Response::from_parts(md, ClientMessages::from(stream), ext))
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

/// The `Inference` service as the router serves it: `Generate` answered with
/// the worker's `Delta`s forwarded in their wire encoding ([`ClientCodec`]),
/// every other method by the generated server (issue 20).
#[derive(Clone)]
pub struct InferenceEdge {
    service: InferenceService,
    rest: InferenceServer<InferenceService>,
    max_decoding: usize,
}

const GENERATE: &str = "/tokenmesh.v1.Inference/Generate";

impl InferenceEdge {
    /// Serves `service`, refusing request messages over `max_decoding` bytes.
    pub fn new(service: InferenceService, max_decoding: usize) -> Self {
        Self {
            rest: InferenceServer::new(service.clone()).max_decoding_message_size(max_decoding),
            service,
            max_decoding,
        }
    }
}

impl NamedService for InferenceEdge {
    const NAME: &'static str = <InferenceServer<InferenceService> as NamedService>::NAME;
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl tower::Service<http::Request<Body>> for InferenceEdge {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        if req.uri().path() != GENERATE {
            return tower::Service::call(&mut self.rest, req);
        }
        let method = Generate(self.service.clone());
        let max = self.max_decoding;
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ClientCodec).max_decoding_message_size(max);
            Ok(grpc.server_streaming(method, req).await)
        })
    }
}

/// `Generate` for tonic's server-streaming plumbing.
struct Generate(InferenceService);

impl ServerStreamingService<GenerateRequest> for Generate {
    type Response = Outgoing;
    type ResponseStream = ClientEvents;
    type Future = BoxFuture<Result<Response<ClientEvents>, Status>>;

    fn call(&mut self, request: Request<GenerateRequest>) -> Self::Future {
        let service = self.0.clone();
        Box::pin(async move { service.generate_encoded(request).await })
    }
}
