//! The `tokenmesh.v1.Inference` gRPC service.
use crate::admission::Admission;
use crate::errors::RouterError;
use crate::policy::{choose_version, has_canary, VersionAsk};
use crate::registry::Registry;
use crate::relay::{self, RelayContext};
use std::sync::Arc;
use std::time::Instant;
use tokenmesh_proto::codes::code_name;
use tokenmesh_proto::headers;
use tokenmesh_proto::v1::inference_server::Inference;
use tokenmesh_proto::v1::{
    Accepted, GenerateRequest, GenerateResponse, ListModelsRequest, ListModelsResponse, ModelInfo,
    VersionInfo,
};
use tokenmesh_proto::validate::check_request;
use tokenmesh_runtime::telemetry;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// Request-path settings.
#[derive(Clone, Debug)]
pub struct RoutingSettings {
    pub max_attempts: u32,
    pub max_failovers: u32,
}

/// Serves Generate and ListModels from the registry.
#[derive(Clone)]
pub struct InferenceService {
    registry: Arc<Registry>,
    admission: Arc<Admission>,
    settings: RoutingSettings,
}

impl InferenceService {
    /// A service over a registry that discovery keeps up to date.
    pub fn new(
        registry: Arc<Registry>,
        admission: Arc<Admission>,
        settings: RoutingSettings,
    ) -> Self {
        Self {
            registry,
            admission,
            settings,
        }
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

impl InferenceService {
    /// Admits, routes and opens the first upstream stream; the rest of the
    /// stream is carried by the relay task, inside `span`.
    async fn start(
        &self,
        request: Request<GenerateRequest>,
        span: tracing::Span,
    ) -> Result<Response<ReceiverStream<Result<GenerateResponse, Status>>>, Status> {
        let started = Instant::now();
        let deadline = tokenmesh_proto::deadline::grpc_timeout(request.metadata())
            .map(|t| tokio::time::Instant::now() + t);
        let identity = identity_of(&request);
        span.record("identity", identity.as_str());
        let md = request.metadata().clone();
        let mut req = request.into_inner();
        check_request(&req).map_err(RouterError::from)?;
        if req.request_id.is_empty() {
            req.request_id = uuid::Uuid::new_v4().to_string();
        }
        span.record("request_id", req.request_id.as_str());
        let pin = req
            .version
            .clone()
            .filter(|v| !v.is_empty())
            .or_else(|| header(&md, headers::VERSION).map(str::to_string));
        let session = if req.session_id.is_empty() {
            header(&md, headers::SESSION).map(str::to_string)
        } else {
            Some(req.session_id.clone())
        };
        let entry = self
            .registry
            .model(&req.model)
            .ok_or_else(|| RouterError::UnknownModel {
                asked: req.model.clone(),
                available: self.registry.models().keys().cloned().collect(),
            })?;
        let route = tracing::info_span!(
            "route",
            policy = tracing::field::Empty,
            pin = pin.as_deref().unwrap_or(""),
            sticky = session.is_some(),
            version = tracing::field::Empty,
            arm = tracing::field::Empty,
            candidates = tracing::field::Empty,
            worker = tracing::field::Empty,
            reason = tracing::field::Empty,
            attempts = tracing::field::Empty,
        );
        if let Some(p) = &entry.policy {
            route.record("policy", tracing::field::debug(p));
        }
        let choice = choose_version(
            &req.model,
            &entry,
            VersionAsk {
                pin: pin.as_deref(),
                session: session.as_deref(),
            },
            &mut rand::rng(),
        )?;
        route.record("version", choice.version.as_str());
        route.record("arm", tracing::field::debug(choice.arm));
        span.record("version", choice.version.as_str());
        span.record("arm", tracing::field::debug(choice.arm));
        let permit = self
            .admission
            .admit(&identity)
            .instrument(route.clone())
            .await
            .map_err(RouterError::from)?;
        let mut tried = Vec::new();
        let upstream = relay::open(
            &self.registry,
            &req,
            &choice.version,
            &[],
            &mut tried,
            self.settings.max_attempts,
            deadline,
        )
        .instrument(route.clone())
        .await?;
        drop(route);
        let worker_id = upstream.guard.endpoint().id.clone();
        span.record("worker", worker_id.as_str());
        let accepted = Accepted {
            request_id: req.request_id.clone(),
            model: req.model.clone(),
            version: choice.version.clone(),
            arm: choice.arm as i32,
            worker_id: worker_id.clone(),
        };
        let (tx, rx) = mpsc::channel(32);
        let ctx = RelayContext {
            registry: self.registry.clone(),
            request: req,
            accepted,
            max_attempts: self.settings.max_attempts,
            max_failovers: self.settings.max_failovers,
            tried,
            started,
            deadline,
            permit,
        };
        tokio::spawn(relay::run(ctx, upstream, tx).instrument(span));
        let mut response = Response::new(ReceiverStream::new(rx));
        if let Ok(v) = choice.version.parse() {
            response.metadata_mut().insert(headers::VERSION, v);
        }
        if let Ok(v) = worker_id.parse() {
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
    type GenerateStream = ReceiverStream<Result<GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let span = tracing::info_span!(
            "Generate",
            otel.name = "Generate",
            otel.kind = "server",
            otel.status_code = tracing::field::Empty,
            model = %request.get_ref().model,
            request_id = tracing::field::Empty,
            identity = tracing::field::Empty,
            version = tracing::field::Empty,
            arm = tracing::field::Empty,
            worker = tracing::field::Empty,
            trace_id = tracing::field::Empty,
            error = tracing::field::Empty,
        );
        telemetry::adopt_parent(&span, request.metadata());
        let model = request.get_ref().model.clone();
        match self
            .start(request, span.clone())
            .instrument(span.clone())
            .await
        {
            Ok(r) => Ok(r),
            Err(status) => {
                span.record("otel.status_code", "ERROR");
                span.record("error", status.message());
                tracing::info!(parent: &span, code = ?status.code(), error = %status.message(), "refused");
                metrics::counter!("llm_request_total", "model" => model.clone(), "version" => "", "code" => code_name(status.code())).increment(1);
                metrics::counter!("llm_request_errors_total", "model" => model, "version" => "")
                    .increment(1);
                Err(status)
            }
        }
    }

    async fn list_models(
        &self,
        _: Request<ListModelsRequest>,
    ) -> Result<Response<ListModelsResponse>, Status> {
        let models = self
            .registry
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
