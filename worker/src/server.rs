//! The `tokenmesh.v1.Worker` gRPC service.
use crate::engines::ServingEngine;
use crate::errors::WorkerError;
use crate::reply::{Relay, ReplyTo};
use crate::request::Serving;
use crate::scheduler::{SequenceRequest, StreamKey};
use crate::series::{worker_labels, RequestSeries};
use crate::streams::LiveStreams;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokenmesh_proto::v1::worker_server::Worker;
use tokenmesh_proto::v1::{
    AbortRequest, AbortResponse, GenerateResponse, StatusRequest, StatusResponse,
    WorkerGenerateRequest,
};
use tokenmesh_proto::validate::InvalidField;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Who this worker is, as it registers and reports itself.
#[derive(Clone, Debug)]
pub struct WorkerIdentity {
    pub worker_id: String,
    pub model_name: String,
    pub version: String,
    pub accelerator: String,
    pub device: String,
    pub capacity: u32,
}

/// Serves Generate, Abort and Status over one engine: the real model, the
/// synthetic one or an upstream engine, which the router cannot tell apart.
#[derive(Clone)]
pub struct WorkerService {
    engine: ServingEngine,
    identity: WorkerIdentity,
    serving: Serving,
    live: LiveStreams,
    series: Arc<RequestSeries>,
}

/// The longest attempt id a caller may give (it reaches logs and spans).
pub const MAX_ATTEMPT_ID_BYTES: usize = 128;

impl WorkerService {
    /// A service over a started engine.
    pub fn new(engine: ServingEngine, identity: WorkerIdentity, default_max_tokens: usize) -> Self {
        let serving = Serving {
            model_name: identity.model_name.clone(),
            default_max_tokens,
            kv_capacity: engine.kv_capacity(),
        };
        let series = Arc::new(RequestSeries::new(worker_labels(
            &identity.model_name,
            &identity.version,
            &identity.worker_id,
        )));
        Self {
            engine,
            identity,
            serving,
            live: LiveStreams::default(),
            series,
        }
    }
}

type ResponseStream = ReceiverStream<Result<GenerateResponse, Status>>;

#[tonic::async_trait]
impl Worker for WorkerService {
    type GenerateStream = ResponseStream;

    async fn generate(
        &self,
        request: Request<WorkerGenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let enqueued = Instant::now();
        let deadline = tokenmesh_proto::deadline::grpc_timeout(request.metadata())
            .map(|t| tokio::time::Instant::now() + t);
        // An unsampled request makes no span at all (issue 20).
        let sampled = matches!(
            tokenmesh_runtime::telemetry::sampling(request.metadata()),
            tokenmesh_runtime::telemetry::Sampling::Record
        );
        let span = if !sampled {
            tracing::Span::none()
        } else {
            tracing::info_span!(
                "Generate",
                otel.name = "Generate",
                otel.kind = "server",
                otel.status_code = tracing::field::Empty,
                worker = self.identity.worker_id.as_str(),
                model = self.identity.model_name.as_str(),
                version = self.identity.version.as_str(),
                request_id = tracing::field::Empty,
                attempt_id = tracing::field::Empty,
                prompt_tokens = tracing::field::Empty,
                completion_tokens = tracing::field::Empty,
                finish_reason = tracing::field::Empty,
                prompt_tokens_cached = tracing::field::Empty,
                queue_ms = tracing::field::Empty,
                prefill_ms = tracing::field::Empty,
                decode_ms = tracing::field::Empty,
                trace_id = tracing::field::Empty,
                error = tracing::field::Empty,
            )
        };
        if sampled {
            tokenmesh_runtime::telemetry::adopt_parent(&span, request.metadata());
        }
        let req = request.into_inner();
        let series = &self.series;
        let prepared = self
            .engine
            .prepare(&self.serving, &req)
            .await
            .map_err(|e| refused(&span, series, e.into_status()))?;
        let request_id = req
            .request
            .as_ref()
            .map(|r| r.request_id.clone())
            .filter(|id| !id.is_empty())
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let key = StreamKey {
            request_id: request_id.clone(),
            attempt_id: attempt_id(&req.attempt_id)
                .map_err(|e| refused(&span, series, e.into_status()))?,
        };
        let live = self.live.claim(key.clone()).ok_or_else(|| {
            let taken = WorkerError::StreamExists {
                request_id: key.request_id.clone(),
                attempt_id: key.attempt_id.clone(),
            };
            refused(&span, series, taken.into_status())
        })?;
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        // One record call: each costs about 1 k instructions before its values.
        tracing::record_all!(
            span,
            request_id = request_id.as_str(),
            attempt_id = key.attempt_id.as_str(),
            // Otherwise the relay records it once the engine has counted.
            prompt_tokens = prepared
                .engine_prompt
                .is_none()
                .then_some(prepared.prompt_tokens),
        );
        self.engine
            .submit(
                SequenceRequest {
                    request_id: request_id.clone(),
                    attempt_id: key.attempt_id.clone(),
                    context: prepared.context,
                    already_emitted: prepared.already_emitted,
                    max_tokens: prepared.max_tokens,
                    sampling: prepared.sampling,
                    stop: prepared.stop,
                    logprobs: prepared.logprobs,
                    events: events_tx,
                    enqueued,
                    priority: prepared.priority,
                    span: span.clone(),
                },
                deadline,
                prepared.engine_wait,
                prepared.engine_prompt,
            )
            .await
            .map_err(|e| refused(&span, series, e.into_status()))?;
        tracing::debug!(
            request_id,
            attempt_id = %key.attempt_id,
            prompt_tokens = prepared.prompt_tokens,
            "queued"
        );
        let (out_tx, out_rx) = mpsc::channel(32);
        let relay = Relay::new(ReplyTo {
            identity: self.identity.clone(),
            request_id,
            prompt_tokens: prepared.prompt_tokens as u32,
            already_emitted: prepared.already_emitted as u32,
            deadline,
            out: out_tx,
            series: series.clone(),
            started: enqueued,
            span,
            _live: live,
            engine: self.engine.stats().clone(),
        });
        // Not instrumented: entering the span on every poll, that is every
        // token, is a per-token cost (issue 20); the relay logs nothing and
        // records on its span explicitly.
        tokio::spawn(relay.run(events_rx));
        let mut response = Response::new(ReceiverStream::new(out_rx));
        let md = response.metadata_mut();
        if let Ok(v) = self.identity.version.parse() {
            md.insert(tokenmesh_proto::headers::VERSION, v);
        }
        if let Ok(v) = self.identity.worker_id.parse() {
            md.insert(tokenmesh_proto::headers::WORKER, v);
        }
        if let Ok(v) = key.attempt_id.parse() {
            md.insert(tokenmesh_proto::headers::ATTEMPT, v);
        }
        Ok(response)
    }

    async fn abort(
        &self,
        request: Request<AbortRequest>,
    ) -> Result<Response<AbortResponse>, Status> {
        let req = request.into_inner();
        let missing = |field: &'static str, why: &str| {
            WorkerError::from(InvalidField {
                field,
                reason: format!("must not be empty; {why}"),
            })
            .into_status()
        };
        if req.request_id.is_empty() {
            return Err(missing("request_id", "name the stream to stop"));
        }
        if req.attempt_id.is_empty() {
            // A request id alone may name other callers' streams too.
            return Err(missing(
                "attempt_id",
                "give the attempt_id of the Generate call (its x-tokenmesh-attempt \
                 response header), since streams may share a request_id",
            ));
        }
        let key = StreamKey {
            request_id: req.request_id,
            attempt_id: req.attempt_id,
        };
        // Known here without a round trip to the engine thread: the stream's
        // reply holds its name until it ends.
        let found = self.live.contains(&key);
        if found {
            self.engine.abort(key);
        }
        Ok(Response::new(AbortResponse { found }))
    }

    async fn status(&self, _: Request<StatusRequest>) -> Result<Response<StatusResponse>, Status> {
        // Every router polls every worker: this is the poll load a fleet puts
        // on each worker (BENCHMARKS.md, "Fleet scale").
        self.series.status_polls.increment(1);
        if let Some(why) = self.engine.unavailable() {
            return Err(Status::unavailable(why));
        }
        let stats = self.engine.stats();
        Ok(Response::new(StatusResponse {
            worker_id: self.identity.worker_id.clone(),
            model: self.identity.model_name.clone(),
            version: self.identity.version.clone(),
            active_sequences: stats.active.load(Ordering::SeqCst),
            queue_depth: stats.queued.load(Ordering::SeqCst),
            kv_blocks_used: stats.kv_blocks_used.load(Ordering::SeqCst),
            kv_blocks_total: stats.kv_blocks_total.load(Ordering::SeqCst),
            queue_depth_high: stats.queued_by_priority[0].load(Ordering::SeqCst),
            queue_depth_normal: stats.queued_by_priority[1].load(Ordering::SeqCst),
            queue_depth_low: stats.queued_by_priority[2].load(Ordering::SeqCst),
            tokens_generated: stats.tokens_generated.load(Ordering::Relaxed),
            preemptions: stats.preemptions.load(Ordering::Relaxed),
            kv_blocks_cached: stats.kv_blocks_cached.load(Ordering::SeqCst),
            prompt_tokens_total: stats.prompt_tokens_total.load(Ordering::Relaxed),
            prompt_tokens_cached: stats.prompt_tokens_cached.load(Ordering::Relaxed),
            kv_blocks_evicted: stats.kv_blocks_evicted.load(Ordering::SeqCst),
            accelerator: self.identity.accelerator.clone(),
            device: self.identity.device.clone(),
            draining: stats.draining.load(Ordering::SeqCst),
            max_context: self.engine.context_length() as u32,
            capacity: self.identity.capacity,
        }))
    }
}

/// The caller's attempt id, checked, or a fresh one when it gave none.
fn attempt_id(given: &str) -> Result<String, WorkerError> {
    if given.len() > MAX_ATTEMPT_ID_BYTES {
        return Err(InvalidField {
            field: "attempt_id",
            reason: format!("{} bytes; at most {MAX_ATTEMPT_ID_BYTES}", given.len()),
        }
        .into());
    }
    Ok(if given.is_empty() {
        uuid::Uuid::new_v4().simple().to_string()
    } else {
        given.to_string()
    })
}

/// A request refused before it reached the engine: marked on its span and
/// counted.
fn refused(span: &tracing::Span, series: &RequestSeries, status: Status) -> Status {
    span.record("otel.status_code", "ERROR");
    span.record("error", status.message());
    series.outcome(status.code());
    status
}
