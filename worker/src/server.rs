//! The `tokenmesh.v1.Worker` gRPC service.
use crate::errors::WorkerError;
use crate::request::{prepare, PromptModel};
use crate::scheduler::{EngineHandle, Event, Finish, SequenceRequest};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenmesh_proto::v1::worker_server::Worker;
use tokenmesh_proto::v1::{
    generate_response, AbortRequest, AbortResponse, Accepted, Arm, Delta, FinishReason, Finished,
    GenerateResponse, StatusRequest, StatusResponse, Timings, Usage, WorkerGenerateRequest,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

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

/// Serves Generate, Abort and Status over one engine: the real model or the
/// synthetic one, which the router cannot tell apart.
#[derive(Clone)]
pub struct WorkerService {
    model: Arc<dyn PromptModel>,
    engine: EngineHandle,
    identity: WorkerIdentity,
    default_max_tokens: usize,
}

impl WorkerService {
    fn labels(&self) -> Labels {
        [
            ("model", self.identity.model_name.clone()),
            ("version", self.identity.version.clone()),
            ("worker", self.identity.worker_id.clone()),
        ]
    }

    /// A service over a started engine.
    pub fn new(
        model: Arc<dyn PromptModel>,
        engine: EngineHandle,
        identity: WorkerIdentity,
        default_max_tokens: usize,
    ) -> Self {
        Self {
            model,
            engine,
            identity,
            default_max_tokens,
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
        let span = tracing::info_span!(
            "Generate",
            otel.name = "Generate",
            otel.kind = "server",
            otel.status_code = tracing::field::Empty,
            worker = %self.identity.worker_id,
            model = %self.identity.model_name,
            version = %self.identity.version,
            request_id = tracing::field::Empty,
            prompt_tokens = tracing::field::Empty,
            completion_tokens = tracing::field::Empty,
            finish_reason = tracing::field::Empty,
            trace_id = tracing::field::Empty,
            error = tracing::field::Empty,
        );
        tokenmesh_proto::telemetry::adopt_parent(&span, request.metadata());
        let req = request.into_inner();
        let labels = self.labels();
        let prepared = prepare(
            self.model.as_ref(),
            &self.identity.model_name,
            self.default_max_tokens,
            &req,
        )
        .map_err(|e| {
            let status = e.into_status();
            span.record("otel.status_code", "ERROR");
            span.record("error", status.message());
            record_outcome(&labels, status.code());
            status
        })?;
        let request_id = req
            .request
            .as_ref()
            .map(|r| r.request_id.clone())
            .filter(|id| !id.is_empty())
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        span.record("request_id", request_id.as_str());
        span.record("prompt_tokens", prepared.prompt_tokens);
        self.engine
            .submit(SequenceRequest {
                request_id: request_id.clone(),
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
            })
            .map_err(|e| {
                let status = WorkerError::from(e).into_status();
                span.record("otel.status_code", "ERROR");
                span.record("error", status.message());
                record_outcome(&labels, status.code());
                status
            })?;
        tracing::debug!(request_id, prompt_tokens = prepared.prompt_tokens, "queued");
        let (out_tx, out_rx) = mpsc::channel(32);
        let relay = Relay {
            identity: self.identity.clone(),
            request_id,
            prompt_tokens: prepared.prompt_tokens as u32,
            completion_tokens: prepared.already_emitted as u32,
            seq: 0,
            queued: Duration::ZERO,
            deadline,
            out: out_tx,
            labels,
            started: enqueued,
            last_token: None,
            code: tonic::Code::Cancelled,
            span: span.clone(),
        };
        metrics::gauge!("llm_active_streams", &relay.labels).increment(1.0);
        tokio::spawn(relay.run(events_rx).instrument(span));
        let mut response = Response::new(ReceiverStream::new(out_rx));
        let md = response.metadata_mut();
        if let Ok(v) = self.identity.version.parse() {
            md.insert(tokenmesh_proto::headers::VERSION, v);
        }
        if let Ok(v) = self.identity.worker_id.parse() {
            md.insert(tokenmesh_proto::headers::WORKER, v);
        }
        Ok(response)
    }

    async fn abort(
        &self,
        request: Request<AbortRequest>,
    ) -> Result<Response<AbortResponse>, Status> {
        let id = request.into_inner().request_id;
        if id.is_empty() {
            return Err(Status::invalid_argument("request_id: must not be empty"));
        }
        self.engine.abort(&id);
        // The engine applies the abort asynchronously; `found` is not knowable
        // without a round trip, so report that the abort was accepted.
        Ok(Response::new(AbortResponse { found: true }))
    }

    async fn status(&self, _: Request<StatusRequest>) -> Result<Response<StatusResponse>, Status> {
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
            accelerator: self.identity.accelerator.clone(),
            device: self.identity.device.clone(),
            draining: stats.draining.load(Ordering::SeqCst),
            max_context: self.model.context_length() as u32,
            capacity: self.identity.capacity,
        }))
    }
}

/// Converts one sequence's engine events into numbered wire messages.
struct Relay {
    identity: WorkerIdentity,
    request_id: String,
    prompt_tokens: u32,
    completion_tokens: u32,
    seq: u64,
    queued: Duration,
    /// The caller's deadline; past it the sequence is dropped.
    deadline: Option<tokio::time::Instant>,
    out: mpsc::Sender<Result<GenerateResponse, Status>>,
    labels: Labels,
    started: Instant,
    last_token: Option<Instant>,
    /// The outcome; a stream dropped without one was cancelled by its client.
    code: tonic::Code,
    span: tracing::Span,
}

type Labels = [(&'static str, String); 3];

/// Counts one request's outcome.
fn record_outcome(labels: &Labels, code: tonic::Code) {
    let mut with_code: Vec<(&'static str, String)> = labels.to_vec();
    with_code.push(("code", tokenmesh_proto::codes::code_name(code).to_string()));
    metrics::counter!("llm_request_total", &with_code).increment(1);
    if tokenmesh_proto::codes::classify(code).is_failure() {
        metrics::counter!("llm_request_errors_total", labels).increment(1);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        metrics::gauge!("llm_active_streams", &self.labels).decrement(1.0);
        metrics::histogram!("llm_request_duration_seconds", &self.labels)
            .record(self.started.elapsed().as_secs_f64());
        record_outcome(&self.labels, self.code);
        if tokenmesh_proto::codes::classify(self.code).is_failure() {
            self.span.record("otel.status_code", "ERROR");
        }
    }
}

impl Relay {
    async fn run(mut self, mut events: mpsc::UnboundedReceiver<Event>) {
        let accepted = generate_response::Event::Accepted(Accepted {
            request_id: self.request_id.clone(),
            model: self.identity.model_name.clone(),
            version: self.identity.version.clone(),
            arm: Arm::Unspecified as i32,
            worker_id: self.identity.worker_id.clone(),
        });
        if !self.send(accepted).await {
            return;
        }
        let deadline = self.deadline;
        let expiry = async move {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(expiry);
        loop {
            // Watch the client too, so that a cancel while queued frees the slot.
            let event = tokio::select! {
                e = events.recv() => e,
                _ = self.out.closed() => return,
                _ = &mut expiry => {
                    // Returning drops `events`, which frees the sequence.
                    self.code = tonic::Code::DeadlineExceeded;
                    let _ = self
                        .out
                        .send(Err(Status::deadline_exceeded(format!(
                            "deadline exceeded after {} completion tokens",
                            self.completion_tokens
                        ))))
                        .await;
                    return;
                }
            };
            let Some(event) = event else {
                self.code = tonic::Code::Internal;
                let _ = self
                    .out
                    .send(Err(Status::internal("the engine dropped the sequence")))
                    .await;
                return;
            };
            match event {
                Event::Started { queued } => self.queued = queued,
                Event::Token { id, text, logprob } => {
                    self.completion_tokens += 1;
                    let now = Instant::now();
                    match self.last_token {
                        None => {
                            metrics::histogram!("llm_time_to_first_token_seconds", &self.labels)
                                .record((now - self.started).as_secs_f64())
                        }
                        Some(prev) => {
                            metrics::histogram!("llm_inter_token_latency_seconds", &self.labels)
                                .record((now - prev).as_secs_f64())
                        }
                    }
                    self.last_token = Some(now);
                    metrics::counter!("llm_tokens_generated_total", &self.labels).increment(1);
                    let delta = self.delta(vec![id], text, logprob.into_iter().collect());
                    if !self.send(delta).await {
                        return;
                    }
                }
                Event::Finished {
                    reason,
                    stop,
                    tail,
                    completion_tokens,
                    first_token,
                    total,
                } => {
                    self.completion_tokens = completion_tokens;
                    self.code = tonic::Code::Ok;
                    self.span.record("completion_tokens", completion_tokens);
                    self.span
                        .record("finish_reason", tracing::field::debug(reason));
                    if !tail.is_empty() && !self.send(self.delta(vec![], tail, vec![])).await {
                        return;
                    }
                    let finished = generate_response::Event::Finished(Finished {
                        finish_reason: match reason {
                            Finish::Stop => FinishReason::Stop,
                            Finish::Length => FinishReason::Length,
                            Finish::Eos => FinishReason::Eos,
                        } as i32,
                        stop: stop.unwrap_or_default(),
                        usage: Some(self.usage()),
                        failovers: 0,
                        timings: Some(Timings {
                            queue_ms: ms(self.queued),
                            time_to_first_token_ms: first_token.map(ms).unwrap_or(0.0),
                            total_ms: ms(total),
                        }),
                        worker_id: self.identity.worker_id.clone(),
                    });
                    self.send(finished).await;
                    return;
                }
                Event::Rejected(msg) => {
                    self.code = tonic::Code::ResourceExhausted;
                    let _ = self.out.send(Err(Status::resource_exhausted(msg))).await;
                    return;
                }
                Event::Failed(msg) => {
                    self.code = tonic::Code::Internal;
                    let _ = self
                        .out
                        .send(Err(WorkerError::Engine(msg).into_status()))
                        .await;
                    return;
                }
            }
        }
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
        }
    }

    fn delta(
        &self,
        token_ids: Vec<u32>,
        text: String,
        logprobs: Vec<f32>,
    ) -> generate_response::Event {
        generate_response::Event::Delta(Delta {
            token_ids,
            text,
            logprobs,
            usage: Some(self.usage()),
        })
    }

    /// Sends one numbered message; false once the client is gone.
    async fn send(&mut self, event: generate_response::Event) -> bool {
        let msg = GenerateResponse {
            seq: self.seq,
            event: Some(event),
        };
        self.seq += 1;
        self.out.send(Ok(msg)).await.is_ok()
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
