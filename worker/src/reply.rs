//! One sequence's reply: the engine's events for it turned into numbered
//! wire messages (`Accepted`, `Delta`s, one `Finished`, or an error status),
//! with the per-request metrics counted as they pass. The per-token series'
//! handles are looked up once per worker ([`RequestSeries`]), not per
//! request or token (issue 20).
use crate::errors::WorkerError;
use crate::scheduler::{EngineStats, Event, Finish};
use crate::series::RequestSeries;
use crate::server::WorkerIdentity;
use crate::streams::LiveStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenmesh_proto::v1::{
    generate_response, Accepted, Arm, Delta, FinishReason, Finished, GenerateResponse, Timings,
    Usage, WorkerLoad,
};
use tokio::sync::mpsc;
use tonic::Status;

/// Who the reply goes to and what it belongs to.
pub(crate) struct ReplyTo {
    pub identity: WorkerIdentity,
    pub request_id: String,
    pub prompt_tokens: u32,
    /// Completion tokens delivered before a failover.
    pub already_emitted: u32,
    /// The caller's deadline; past it the sequence is dropped.
    pub deadline: Option<tokio::time::Instant>,
    pub out: mpsc::Sender<Result<GenerateResponse, Status>>,
    /// This worker's request metrics.
    pub series: Arc<RequestSeries>,
    /// When the request arrived.
    pub started: Instant,
    pub span: tracing::Span,
    /// Keeps the stream's name taken (for Abort) until the reply ends.
    pub _live: LiveStream,
    /// The engine's live counters, read into `Accepted.load` and
    /// `Finished.load`: a busy worker's routers learn its load from its
    /// streams, not only from Status polls (BENCHMARKS.md, "Fleet scale").
    pub engine: Arc<EngineStats>,
}

/// The load fields of Status, as they are now.
pub(crate) fn load_of(stats: &EngineStats) -> WorkerLoad {
    WorkerLoad {
        queue_depth: stats.queued.load(Ordering::SeqCst),
        active_sequences: stats.active.load(Ordering::SeqCst),
        draining: stats.draining.load(Ordering::SeqCst),
    }
}

/// Converts one sequence's engine events into numbered wire messages.
pub(crate) struct Relay {
    to: ReplyTo,
    completion_tokens: u32,
    seq: u64,
    queued: Duration,
    last_token: Option<Instant>,
    /// The outcome; a stream dropped without one was cancelled by its client.
    code: tonic::Code,
}

impl Drop for Relay {
    fn drop(&mut self) {
        let series = &self.to.series;
        series.active.decrement(1.0);
        series
            .duration
            .record(self.to.started.elapsed().as_secs_f64());
        series.outcome(self.code);
        if tokenmesh_proto::codes::classify(self.code).is_failure() {
            self.to.span.record("otel.status_code", "ERROR");
        }
    }
}

impl Relay {
    /// A reply that counts itself as an active stream until it ends.
    pub(crate) fn new(to: ReplyTo) -> Self {
        to.series.active.increment(1.0);
        Self {
            completion_tokens: to.already_emitted,
            to,
            seq: 0,
            queued: Duration::ZERO,
            last_token: None,
            code: tonic::Code::Cancelled,
        }
    }

    /// Relays `events` until the sequence ends, the client leaves or the
    /// deadline passes.
    pub(crate) async fn run(mut self, mut events: mpsc::UnboundedReceiver<Event>) {
        let accepted = generate_response::Event::Accepted(Accepted {
            request_id: self.to.request_id.clone(),
            model: self.to.identity.model_name.clone(),
            version: self.to.identity.version.clone(),
            arm: Arm::Unspecified as i32,
            worker_id: self.to.identity.worker_id.clone(),
            load: Some(load_of(&self.to.engine)),
        });
        if !self.send(accepted).await {
            return;
        }
        let deadline = self.to.deadline;
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
                _ = self.to.out.closed() => return,
                _ = &mut expiry => {
                    // Returning drops `events`, which frees the sequence.
                    let message = format!(
                        "deadline exceeded after {} completion tokens",
                        self.completion_tokens
                    );
                    self.fail(Status::deadline_exceeded(message)).await;
                    return;
                }
            };
            let more = match event {
                None => {
                    self.fail(Status::internal("the engine dropped the sequence"))
                        .await;
                    false
                }
                Some(Event::Started {
                    queued,
                    prompt_tokens_cached,
                }) => {
                    self.queued = queued;
                    tracing::record_all!(self.to.span, queue_ms = ms(queued), prompt_tokens_cached);
                    true
                }
                Some(Event::PromptCounted { tokens }) => {
                    self.to.prompt_tokens = tokens;
                    self.to.span.record("prompt_tokens", tokens);
                    true
                }
                Some(Event::Token { id, text, logprob }) => {
                    let logprobs = logprob.into_iter().collect();
                    self.tokens(vec![id], 1, text, logprobs).await
                }
                Some(Event::Text {
                    text,
                    tokens,
                    logprobs,
                }) => self.tokens(vec![], tokens, text, logprobs).await,
                Some(Event::Finished {
                    reason,
                    stop,
                    tail,
                    completion_tokens,
                    first_token,
                    total,
                }) => {
                    self.completion_tokens = completion_tokens;
                    // The phases' times, where `--trace-phases` is off the
                    // only record of them in the trace: prefill from the
                    // batch's admission to the first token, decode after it.
                    if let Some(first) = first_token {
                        tracing::record_all!(
                            self.to.span,
                            prefill_ms = ms(first.saturating_sub(self.queued)),
                            decode_ms = ms(total.saturating_sub(first)),
                        );
                    }
                    let timings = Timings {
                        queue_ms: ms(self.queued),
                        time_to_first_token_ms: first_token.map(ms).unwrap_or(0.0),
                        total_ms: ms(total),
                    };
                    self.finish(reason, stop, tail, timings).await;
                    false
                }
                Some(Event::Rejected(msg)) => {
                    self.fail(Status::resource_exhausted(msg)).await;
                    false
                }
                Some(Event::Failed(msg)) => {
                    self.fail(WorkerError::Engine(msg).into_status()).await;
                    false
                }
                Some(Event::Status(status)) => {
                    self.fail(status).await;
                    false
                }
            };
            if !more {
                return;
            }
        }
    }

    /// `n` tokens (with their ids, where the engine gave them): their
    /// metrics and their delta; false once the client is gone.
    async fn tokens(&mut self, ids: Vec<u32>, n: u32, text: String, logprobs: Vec<f32>) -> bool {
        self.completion_tokens += n;
        let now = Instant::now();
        match self.last_token {
            None => self
                .to
                .series
                .ttft
                .record((now - self.to.started).as_secs_f64()),
            Some(prev) => self
                .to
                .series
                .itl
                .record((now - prev).as_secs_f64() / f64::from(n.max(1))),
        }
        self.last_token = Some(now);
        self.to.series.tokens.increment(u64::from(n));
        let delta = self.delta(ids, text, logprobs);
        self.send(delta).await
    }

    /// The end of the sequence: held-back text, then `Finished`.
    async fn finish(
        &mut self,
        reason: Finish,
        stop: Option<String>,
        tail: String,
        timings: Timings,
    ) {
        self.code = tonic::Code::Ok;
        tracing::record_all!(
            self.to.span,
            completion_tokens = self.completion_tokens,
            finish_reason = reason.as_str(),
        );
        if !tail.is_empty() && !self.send(self.delta(vec![], tail, vec![])).await {
            return;
        }
        let finished = generate_response::Event::Finished(Finished {
            finish_reason: match reason {
                Finish::Stop => FinishReason::Stop,
                Finish::Length => FinishReason::Length,
                Finish::Eos => FinishReason::Eos,
                Finish::Cancelled => FinishReason::Cancelled,
                Finish::KvCacheFull => FinishReason::KvCacheFull,
            } as i32,
            stop: stop.unwrap_or_default(),
            usage: Some(self.usage()),
            failovers: 0,
            timings: Some(timings),
            worker_id: self.to.identity.worker_id.clone(),
            load: Some(load_of(&self.to.engine)),
        });
        self.send(finished).await;
    }

    /// Ends the stream with `status`, which is also the recorded outcome.
    async fn fail(&mut self, status: Status) {
        self.code = status.code();
        let _ = self.to.out.send(Err(status)).await;
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.to.prompt_tokens,
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
        self.to.out.send(Ok(msg)).await.is_ok()
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
