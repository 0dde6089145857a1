//! Carries one client stream across one or more worker streams.
//!
//! The router numbers the client's messages itself, replaces each worker's
//! `Accepted` with its own (only the first reaches the client), and records
//! every token id it forwards. If a worker fails before the stream finished,
//! the request continues on another worker of the same version from the tokens
//! already delivered, so the client sees one unbroken stream. A client that
//! goes away drops the upstream stream at once, which frees the sequence on
//! the worker.
use crate::admission::Permit;
use crate::balance;
use crate::errors::{retryable, RouterError};
use crate::registry::{InFlight, Registry};
use crate::stats::Attempt;
use std::sync::Arc;
use std::time::Instant;
use tokenmesh_proto::v1::{
    generate_response::Event, Accepted, GenerateRequest, GenerateResponse, WorkerGenerateRequest,
};
use tokenmesh_runtime::telemetry;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

/// A worker stream that has been opened, with the worker it runs on.
pub struct Upstream {
    pub stream: Streaming<GenerateResponse>,
    pub guard: InFlight,
    /// The client span of the call to the worker; ends with the stream.
    pub span: tracing::Span,
    /// This attempt in the per-version stats.
    pub attempt: Attempt,
}

/// Everything the relay needs to continue a request elsewhere.
pub struct RelayContext {
    pub registry: Arc<Registry>,
    pub request: GenerateRequest,
    pub accepted: Accepted,
    pub max_attempts: u32,
    pub max_failovers: u32,
    pub tried: Vec<String>,
    pub started: Instant,
    /// When the caller's deadline (grpc-timeout) expires, if it set one.
    pub deadline: Option<tokio::time::Instant>,
    /// The admission slot, released when the stream ends.
    pub permit: Permit,
}

/// Opens a worker stream for `request` on the best ready worker of
/// `model`/`version`, retrying on other workers for retryable failures.
pub async fn open(
    registry: &Registry,
    request: &GenerateRequest,
    version: &str,
    emitted: &[u32],
    tried: &mut Vec<String>,
    max_attempts: u32,
    deadline: Option<tokio::time::Instant>,
) -> Result<Upstream, Status> {
    let mut last_error: Option<Status> = None;
    for _ in 0..max_attempts.max(1) {
        let candidates = registry
            .model(&request.model)
            .and_then(|m| m.versions.get(version).cloned())
            .unwrap_or_default();
        let loads: Vec<String> = candidates
            .iter()
            .map(|e| {
                format!(
                    "{}:{}{}",
                    e.id,
                    e.load(),
                    if e.ready() { "" } else { "(not ready)" }
                )
            })
            .collect();
        let route = tracing::Span::current();
        route.record("candidates", loads.join(",").as_str());
        let Some(ep) = balance::pick(&candidates, tried, &mut rand::rng()) else {
            break;
        };
        route.record("worker", ep.id.as_str());
        let choices = candidates
            .iter()
            .filter(|e| e.ready() && !tried.contains(&e.id))
            .count();
        route.record(
            "reason",
            if choices > 1 {
                "lower load of two random ready workers"
            } else {
                "only ready worker left"
            },
        );
        tried.push(ep.id.clone());
        route.record("attempts", tried.len());
        let guard = InFlight::new(ep.clone());
        let mut client = ep.client();
        let mut call = tonic::Request::new(WorkerGenerateRequest {
            request: Some(request.clone()),
            emitted_token_ids: emitted.to_vec(),
        });
        let span = tracing::info_span!(
            "worker.Generate",
            otel.name = "tokenmesh.v1.Worker/Generate",
            otel.kind = "client",
            worker = %ep.id,
            emitted = emitted.len(),
        );
        telemetry::inject(&span, call.metadata_mut());
        if let Some(d) = deadline {
            // The worker gets what is left of the caller's deadline.
            let left = d.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Err(RouterError::DeadlineExceeded {
                    delivered: emitted.len(),
                }
                .into_status());
            }
            call.set_timeout(left);
        }
        let mut attempt = registry.stats().attempt(&ep.model, &ep.version);
        match client.generate(call).await {
            Ok(resp) => {
                return Ok(Upstream {
                    stream: resp.into_inner(),
                    guard,
                    span,
                    attempt,
                })
            }
            Err(status) if retryable(&status) => {
                attempt.ended(status.code());
                span.record("otel.status_code", "ERROR");
                tracing::warn!(worker = %ep.id, code = ?status.code(), error = %status.message(), "worker refused; trying another");
                last_error = Some(status);
            }
            Err(status) => {
                attempt.ended(status.code());
                return Err(status);
            }
        }
    }
    Err(match last_error {
        Some(s) => Status::new(
            s.code(),
            format!("no worker could take the request: {}", s.message()),
        ),
        None => RouterError::NoWorker {
            model: request.model.clone(),
            version: Some(version.into()),
        }
        .into_status(),
    })
}

/// Pumps messages from workers to the client until the stream finishes, the
/// client leaves, or no worker can continue.
pub async fn run(
    mut ctx: RelayContext,
    mut upstream: Upstream,
    out: mpsc::Sender<Result<GenerateResponse, Status>>,
) {
    let mut seq: u64 = 0;
    let mut emitted: Vec<u32> = Vec::new();
    let mut failovers: u32 = 0;
    let send = |seq: &mut u64, event: Event| {
        let msg = GenerateResponse {
            seq: *seq,
            event: Some(event),
        };
        *seq += 1;
        msg
    };
    let mut meter = StreamMeter::new(&ctx);
    let first = send(&mut seq, Event::Accepted(ctx.accepted.clone()));
    if out.send(Ok(first)).await.is_err() {
        return;
    }
    let expiry = async {
        match ctx.deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(expiry);
    loop {
        let next = tokio::select! {
            m = upstream.stream.message() => m,
            _ = out.closed() => {
                tracing::debug!(request_id = %ctx.accepted.request_id, "client went away; dropping upstream");
                return;
            }
            _ = &mut expiry => {
                // Dropping the upstream stream (on return) cancels the worker's sequence.
                meter.code = tonic::Code::DeadlineExceeded;
                upstream.attempt.ended(tonic::Code::DeadlineExceeded);
                let _ = out
                    .send(Err(RouterError::DeadlineExceeded { delivered: emitted.len() }.into_status()))
                    .await;
                return;
            }
        };
        let failure = match next {
            Ok(Some(msg)) => match msg.event {
                Some(Event::Accepted(_)) | None => continue,
                Some(Event::Delta(d)) => {
                    if emitted.is_empty() && !d.token_ids.is_empty() {
                        upstream.attempt.first_token(ctx.started.elapsed());
                    }
                    meter.tokens(d.token_ids.len());
                    emitted.extend_from_slice(&d.token_ids);
                    let m = send(&mut seq, Event::Delta(d));
                    if out.send(Ok(m)).await.is_err() {
                        return;
                    }
                    continue;
                }
                Some(Event::Finished(mut f)) => {
                    meter.code = tonic::Code::Ok;
                    f.failovers = failovers;
                    if let Some(t) = f.timings.as_mut() {
                        t.total_ms = ctx.started.elapsed().as_secs_f64() * 1000.0;
                    }
                    let m = send(&mut seq, Event::Finished(f));
                    let _ = out.send(Ok(m)).await;
                    return;
                }
            },
            Ok(None) => Status::unavailable("worker ended the stream without finishing"),
            Err(status) if !retryable(&status) => {
                meter.code = status.code();
                upstream.attempt.ended(status.code());
                let _ = out.send(Err(status)).await;
                return;
            }
            Err(status) => status,
        };
        upstream.attempt.ended(failure.code());
        let lost = upstream.guard.endpoint().id.clone();
        tracing::warn!(
            request_id = %ctx.accepted.request_id,
            worker = %lost,
            delivered = emitted.len(),
            error = %failure.message(),
            "worker lost mid-stream"
        );
        if failovers >= ctx.max_failovers {
            meter.code = tonic::Code::Unavailable;
            let _ = out
                .send(Err(RouterError::StreamLost {
                    delivered: emitted.len(),
                    reason: format!("failover limit of {} reached", ctx.max_failovers),
                }
                .into_status()))
                .await;
            return;
        }
        failovers += 1;
        let version = ctx.accepted.version.clone();
        match open(
            &ctx.registry,
            &ctx.request,
            &version,
            &emitted,
            &mut ctx.tried,
            ctx.max_attempts,
            ctx.deadline,
        )
        .await
        {
            Ok(next) => {
                metrics::counter!("llm_failovers_total", "model" => ctx.accepted.model.clone(), "version" => version.clone()).increment(1);
                tracing::info!(
                    request_id = %ctx.accepted.request_id,
                    from = %lost,
                    to = %next.guard.endpoint().id,
                    delivered = emitted.len(),
                    "stream continues on another worker"
                );
                upstream = next;
            }
            Err(e) => {
                meter.code = tonic::Code::Unavailable;
                let _ = out
                    .send(Err(RouterError::StreamLost {
                        delivered: emitted.len(),
                        reason: e.message().to_string(),
                    }
                    .into_status()))
                    .await;
                return;
            }
        }
    }
}

/// Records one client stream in the metrics: latencies as tokens arrive, the
/// outcome when dropped (whichever way the stream ends).
struct StreamMeter {
    model: String,
    version: String,
    started: Instant,
    last_token: Option<Instant>,
    /// The outcome; a stream dropped without one was cancelled by its client.
    code: tonic::Code,
}

impl StreamMeter {
    fn new(ctx: &RelayContext) -> Self {
        let (model, version) = (ctx.accepted.model.clone(), ctx.accepted.version.clone());
        metrics::gauge!("llm_active_streams", "model" => model.clone(), "version" => version.clone())
            .increment(1.0);
        Self {
            model,
            version,
            started: ctx.started,
            last_token: None,
            code: tonic::Code::Cancelled,
        }
    }

    fn tokens(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let now = Instant::now();
        let labels = [
            ("model", self.model.clone()),
            ("version", self.version.clone()),
        ];
        match self.last_token {
            None => {
                metrics::histogram!("llm_time_to_first_token_seconds", &labels)
                    .record((now - self.started).as_secs_f64());
                tracing::info!(tokens = n, "first token");
            }
            Some(prev) => metrics::histogram!("llm_inter_token_latency_seconds", &labels)
                .record((now - prev).as_secs_f64() / n as f64),
        }
        metrics::counter!("llm_tokens_generated_total", &labels).increment(n as u64);
        self.last_token = Some(now);
    }
}

impl Drop for StreamMeter {
    fn drop(&mut self) {
        let labels = [
            ("model", self.model.clone()),
            ("version", self.version.clone()),
        ];
        metrics::gauge!("llm_active_streams", &labels).decrement(1.0);
        metrics::histogram!("llm_request_duration_seconds", &labels)
            .record(self.started.elapsed().as_secs_f64());
        metrics::counter!(
            "llm_request_total",
            "model" => self.model.clone(),
            "version" => self.version.clone(),
            "code" => tokenmesh_proto::codes::code_name(self.code)
        )
        .increment(1);
        if !matches!(self.code, tonic::Code::Ok | tonic::Code::Cancelled) {
            metrics::counter!("llm_request_errors_total", &labels).increment(1);
            let span = tracing::Span::current();
            span.record("otel.status_code", "ERROR");
        }
    }
}
