//! Opening a worker stream (DESIGN.md, "Routing", steps 3 to 5): pick a ready
//! worker of the request's version ([`super::affinity`]: cache-aware, or P2C)
//! and call it; if it refuses with a
//! retryable status, try another one, after a jittered backoff and only while
//! the version's retry budget allows, up to `--max-attempts` workers.
//!
//! The routing facts (candidates and their loads, the worker chosen and why,
//! the attempts so far) are written on the `route` span the caller passes in,
//! which is also the parent of the client span of each call to a worker.
//! Each call carries a fresh random `attempt_id` (on that client span too),
//! which with the request id names the stream on the worker, for
//! `Worker.Abort`: request ids are chosen by clients and need not be unique.
use super::affinity::RequestAffinity;
use super::candidates::Candidates;
use super::retry_budget::{RetryBudget, RetryReason};
use super::wire::{WorkerCodec, WorkerMessage};
use crate::errors::RouterError;
use crate::registry::{Endpoint, InFlight, Registry};
use crate::stats::Attempt;
use std::sync::Arc;
use tokenmesh_proto::codes::classify;
use tokenmesh_proto::v1::{GenerateRequest, WorkerGenerateRequest};
use tokenmesh_runtime::{telemetry, Backoff};
use tokio::time::Instant;
use tonic::{Status, Streaming};
use tracing::Span;

/// A worker stream that has been opened, with the worker it runs on.
pub struct Upstream {
    /// The worker's messages, `Delta`s still encoded ([`super::wire`]).
    pub stream: Streaming<WorkerMessage>,
    /// Counts the stream in the worker's load until dropped.
    pub guard: InFlight,
    /// The client span of the call to the worker; ends with the stream.
    pub span: Span,
    /// This attempt in the per-version stats.
    pub attempt: Attempt,
}

/// Limits of the calls one request may make to workers before a first token.
#[derive(Clone, Copy, Debug)]
pub struct AttemptLimits {
    /// Workers tried per opening (`--max-attempts`).
    pub max_attempts: u32,
    /// Wait between them.
    pub backoff: Backoff,
}

/// One client request's calls to workers: which were tried (none is tried
/// twice, across retries and failovers alike) and what a retry costs.
pub struct Attempts {
    registry: Arc<Registry>,
    request: GenerateRequest,
    version: String,
    tried: Vec<String>,
    limits: AttemptLimits,
    budget: Arc<RetryBudget>,
    /// When the caller's deadline (grpc-timeout) expires, if it set one.
    deadline: Option<Instant>,
    /// How workers are chosen for it, and what the choice learns.
    affinity: RequestAffinity,
    /// The trace context sent to workers for a request with no span.
    unsampled: Option<telemetry::Unsampled>,
    /// Whether each call gets a client span of its own (`--trace-phases`).
    phase_spans: bool,
}

/// What every call to a worker carries from the request.
pub struct CallContext {
    /// The caller's deadline, if any.
    pub deadline: Option<Instant>,
    /// The trace context sent to workers for a request with no span.
    pub unsampled: Option<telemetry::Unsampled>,
    /// Whether each call gets a client span of its own (`--trace-phases`);
    /// without it, calls are recorded on the span they are made under.
    pub phase_spans: bool,
}

/// How one call to a worker failed.
enum CallError {
    /// Another worker may succeed.
    Retry(Status),
    /// The request fails with this.
    Fail(RouterError),
}

impl Attempts {
    /// No worker tried yet; retries are paid from `budget`.
    pub fn new(
        registry: Arc<Registry>,
        request: GenerateRequest,
        version: String,
        limits: AttemptLimits,
        budget: Arc<RetryBudget>,
        affinity: RequestAffinity,
        call: CallContext,
    ) -> Self {
        let CallContext {
            deadline,
            unsampled,
            phase_spans,
        } = call;
        Self {
            registry,
            request,
            version,
            tried: Vec::new(),
            limits,
            budget,
            deadline,
            affinity,
            unsampled,
            phase_spans,
        }
    }

    /// The request's worker choice.
    pub fn affinity(&self) -> &RequestAffinity {
        &self.affinity
    }

    /// The caller's deadline, if any.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Whether routings and calls are spans of their own (`--trace-phases`).
    pub fn phase_spans(&self) -> bool {
        self.phase_spans
    }

    /// Opens a stream on the best ready worker not tried yet, continuing
    /// after the `emitted` tokens, retrying retryable refusals on others.
    /// Every call but the request's very first is paid from the budget: the
    /// first call of an opening after a failover as `StreamLost`, each retry
    /// as `Refused`; no budget is spent when no worker is left to try.
    /// `route` is the span the choice is recorded on: the `route` span, or
    /// the request's `Generate` span without `--trace-phases`.
    pub async fn open(&mut self, emitted: &[u32], route: &Span) -> Result<Upstream, RouterError> {
        let mut last: Option<Status> = None;
        for retry in 0..self.limits.max_attempts.max(1) {
            let all = self.registry.endpoints(&self.request.model, &self.version);
            // A continuation sends the emitted tokens as ids.
            let candidates = Candidates {
                endpoints: &all,
                token_ids: !emitted.is_empty(),
                exclude: &self.tried,
            };
            let choice = self
                .affinity
                .choose(&candidates, !route.is_disabled(), &mut rand::rng());
            let Some(ep) = choice.worker else {
                route.record("candidates", choice.candidates.as_str());
                break;
            };
            if !self.tried.is_empty() {
                let reason = match retry {
                    0 => RetryReason::StreamLost,
                    _ => RetryReason::Refused,
                };
                if !self.budget.withdraw(reason) {
                    route.record("candidates", choice.candidates.as_str());
                    return Err(RouterError::RetryBudgetExhausted {
                        last: last.map(|s| (s.code(), s.message().to_string())),
                    });
                }
            }
            if retry > 0 {
                self.back_off(retry, emitted.len()).await?;
            }
            self.tried.push(ep.id.clone());
            // In one record call, as the version's fields are.
            tracing::record_all!(
                route,
                candidates = choice.candidates.as_str(),
                worker = ep.id.as_str(),
                reason = choice.reason.as_str(),
                attempts = self.tried.len(),
            );
            match self.call(&ep, emitted, route).await {
                Ok(upstream) => {
                    self.affinity.opened(&ep);
                    return Ok(upstream);
                }
                Err(CallError::Fail(e)) => return Err(e),
                Err(CallError::Retry(status)) => {
                    tracing::warn!(parent: route, worker = %ep.id, code = ?status.code(), error = %status.message(), "worker refused; trying another");
                    last = Some(status);
                }
            }
        }
        Err(match last {
            Some(s) => RouterError::AttemptsFailed {
                code: s.code(),
                message: s.message().to_string(),
            },
            None => RouterError::NoWorker {
                model: self.request.model.clone(),
                version: Some(self.version.clone()),
            },
        })
    }

    /// Waits before the `retry`-th retry, never past the caller's deadline.
    async fn back_off(&self, retry: u32, delivered: usize) -> Result<(), RouterError> {
        let delay = self.limits.backoff.delay(retry, &mut rand::rng());
        let until = Instant::now() + delay;
        match self.deadline {
            Some(d) if d <= until => {
                tokio::time::sleep_until(d).await;
                Err(RouterError::DeadlineExceeded { delivered })
            }
            _ => {
                tokio::time::sleep_until(until).await;
                Ok(())
            }
        }
    }

    /// One call to `ep`, counted in its load and in the version's stats;
    /// its trace context is a client span under `route` with
    /// `--trace-phases`, else `route` itself.
    async fn call(
        &self,
        ep: &Arc<Endpoint>,
        emitted: &[u32],
        route: &Span,
    ) -> Result<Upstream, CallError> {
        let guard = InFlight::new(ep.clone());
        // The stream's own name on the worker: request ids are the
        // clients', and two streams may share one.
        let attempt_id = crate::ids::uuid_v4().simple().to_string();
        // No span under a request that has none: it would be a root.
        let span = if route.is_disabled() || !self.phase_spans {
            Span::none()
        } else {
            tracing::info_span!(
                parent: route,
                "worker.Generate",
                otel.name = "tokenmesh.v1.Worker/Generate",
                otel.kind = "client",
                otel.status_code = tracing::field::Empty,
                worker = %ep.id,
                attempt_id = %attempt_id,
                emitted = emitted.len(),
            )
        };
        let mut call = tonic::Request::new(WorkerGenerateRequest {
            request: Some(self.request.clone()),
            emitted_token_ids: emitted.to_vec(),
            attempt_id,
        });
        match &self.unsampled {
            Some(unsampled) => unsampled.inject(call.metadata_mut()),
            None if span.is_disabled() => telemetry::inject(route, call.metadata_mut()),
            None => telemetry::inject(&span, call.metadata_mut()),
        }
        if let Some(d) = self.deadline {
            // The worker gets what is left of the caller's deadline.
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CallError::Fail(RouterError::DeadlineExceeded {
                    delivered: emitted.len(),
                }));
            }
            call.set_timeout(left);
        }
        let mut attempt = self.registry.stats().attempt(&ep.model, &ep.version);
        match generate(ep, call).await {
            Ok(resp) => Ok(Upstream {
                stream: resp.into_inner(),
                guard,
                span,
                attempt,
            }),
            Err(status) => {
                attempt.ended(status.code());
                span.record("otel.status_code", "ERROR");
                if classify(status.code()).is_retryable() {
                    if in_transport(&status) {
                        ep.unreachable(status.message());
                    }
                    Err(CallError::Retry(status))
                } else {
                    Err(CallError::Fail(RouterError::Worker(status)))
                }
            }
        }
    }
}

/// `Worker.Generate` on `ep`'s channel, as its generated client calls it but
/// with the stream read as [`WorkerMessage`]s.
async fn generate(
    ep: &Endpoint,
    mut call: tonic::Request<WorkerGenerateRequest>,
) -> Result<tonic::Response<Streaming<WorkerMessage>>, Status> {
    let mut grpc = tonic::client::Grpc::new(ep.channel.clone());
    if let Err(e) = grpc.ready().await {
        let mut status = Status::unknown(format!("Service was not ready: {e}"));
        // Kept as the source: the failure was the connection's.
        status.set_source(Arc::new(e));
        return Err(status);
    }
    call.extensions_mut()
        .insert(tonic::GrpcMethod::new("tokenmesh.v1.Worker", "Generate"));
    let path = http::uri::PathAndQuery::from_static("/tokenmesh.v1.Worker/Generate");
    grpc.server_streaming(call, path, WorkerCodec).await
}

/// Whether a failed call failed below gRPC: a status the worker sent comes
/// from its response and has no source; one tonic made of a connection
/// error (refused, reset, an HTTP/2 GOAWAY or reset stream) keeps that
/// error as its source. Only UNAVAILABLE, UNKNOWN and INTERNAL count, the
/// codes tonic gives those errors.
fn in_transport(status: &Status) -> bool {
    use tonic::Code;
    matches!(
        status.code(),
        Code::Unavailable | Code::Unknown | Code::Internal
    ) && std::error::Error::source(status).is_some()
}

/// Candidates listed one by one on the `route` span; past this many the
/// rest are counted instead: listing 1,000 workers on every request would
/// cost more than all the rest of the decision (BENCHMARKS.md, "Fleet scale").
pub const LISTED_CANDIDATES: usize = 16;

/// The candidates and their loads, as the `route` span shows them: the first
/// [`LISTED_CANDIDATES`], then how many more and how many of those are ready.
pub fn describe(candidates: &[Arc<Endpoint>]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for (i, e) in candidates.iter().take(LISTED_CANDIDATES).enumerate() {
        let sep = if i == 0 { "" } else { "," };
        let not_ready = if e.ready() { "" } else { "(not ready)" };
        let _ = write!(out, "{sep}{}:{}{not_ready}", e.id, e.load());
    }
    if let Some(rest) = candidates
        .get(LISTED_CANDIDATES..)
        .filter(|r| !r.is_empty())
    {
        let ready = rest.iter().filter(|e| e.ready()).count();
        let _ = write!(out, ",+{} more ({ready} ready)", rest.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::testing::{add, registry};

    #[tokio::test]
    async fn candidates_past_the_listed_ones_are_counted_not_listed() {
        let reg = registry();
        for i in 0..3 {
            add(&reg, &format!("w{i}"), "m", "v1", i != 1);
        }
        let eps = reg.endpoints("m", "v1");
        assert_eq!(describe(&eps), "w0:0,w1:0(not ready),w2:0");
        for i in 3..40 {
            add(&reg, &format!("w{i:02}"), "m", "v1", i % 2 == 0);
        }
        let eps = reg.endpoints("m", "v1");
        let text = describe(&eps);
        assert_eq!(text.matches(':').count(), LISTED_CANDIDATES, "{text}");
        // 40 workers, 16 listed, 24 counted: some ready, some not.
        let ready = eps[LISTED_CANDIDATES..]
            .iter()
            .filter(|e| e.ready())
            .count();
        assert!(
            text.ends_with(&format!(",+24 more ({ready} ready)")),
            "{text}"
        );
        assert!(ready > 0 && ready < 24, "{text}");
    }
}
