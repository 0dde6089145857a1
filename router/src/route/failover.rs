//! Failover (DESIGN.md, "Routing", steps 5 and 6): carries one client stream
//! across one or more worker streams.
//!
//! The router numbers the client's messages itself, replaces each worker's
//! `Accepted` with its own (only the first reaches the client), and records
//! every token id it forwards. If a worker fails with a retryable status or
//! the stream breaks before it finished, the request continues on another
//! worker of the same version from the tokens already delivered, so the
//! client sees one unbroken stream (no gap in `seq`, no token lost or
//! repeated); if no worker can continue it ends with UNAVAILABLE, as it
//! does at once when the lost worker's registration says its engine cannot
//! continue from token ids (`continues_from_token_ids`), and a continuation
//! goes only to workers that can. Each
//! failover is routed in its own `route` span, a child of the request's
//! `Generate` span. The relay runs inside the client's stream
//! ([`super::pump`]): a client that goes away drops that stream and with it
//! the upstream stream, at once, which frees the sequence on the worker.
//!
//! A `Delta` goes through as the bytes the worker sent ([`super::wire`]):
//! the router reads its token ids and writes its own `seq` in place of the
//! worker's, without decoding the message or encoding it again.
//!
//! The relay is not instrumented with the request's span: entering and
//! leaving a span on every poll, that is every token, cost the router about
//! an eighth of its instructions with tracing on (issue 20); its log lines
//! name the span as their parent instead.
use super::attempt::{Attempts, Upstream};
use super::meter::StreamMeter;
use super::pump::Outbox;
use super::wire::{EncodedDelta, Outgoing, WorkerMessage};
use super::{route_span, version};
use crate::admission::Permit;
use crate::errors::RouterError;
use std::time::Instant;
use tokenmesh_proto::codes::classify;
use tokenmesh_proto::delta::TokenCount;
use tokenmesh_proto::v1::{generate_response::Event, Accepted, GenerateResponse};
use tonic::Status;
use tracing::Span;

/// Everything needed to continue a request elsewhere.
pub struct FailoverContext {
    /// The workers tried so far and the budget further calls are paid from.
    pub attempts: Attempts,
    /// The client's `Accepted`: the version and the first worker.
    pub accepted: Accepted,
    /// Times the stream may move to another worker (`--max-failovers`).
    pub max_failovers: u32,
    /// When the router received the request.
    pub started: Instant,
    /// The admission slot, released when the stream ends.
    pub permit: Permit,
    /// The request's `Generate` span.
    pub span: Span,
    /// The front door, for the metrics.
    pub api: super::Api,
}

/// The client's side of the stream: numbering, the tokens delivered so far,
/// and the metrics.
struct ClientStream {
    out: Outbox<Result<Outgoing, Status>>,
    seq: u64,
    emitted: Vec<u32>,
    /// Completion tokens delivered: the ids of `emitted`, or the tokens of
    /// a worker that sends no ids, as its usage counts them.
    count: TokenCount,
    meter: StreamMeter,
    failovers: u32,
}

impl ClientStream {
    /// Sends the next message.
    async fn send(&mut self, event: Event) {
        let msg = GenerateResponse {
            seq: self.seq,
            event: Some(event),
        };
        self.seq += 1;
        self.out.send(Ok(Outgoing::Message(msg))).await;
    }

    /// Sends a worker's `Delta` as the next message.
    async fn send_delta(&mut self, delta: EncodedDelta) {
        let seq = self.seq;
        self.seq += 1;
        self.out.send(Ok(Outgoing::Delta { seq, delta })).await;
    }

    /// Ends the stream with `status`.
    async fn fail(&mut self, status: Status) {
        self.meter.code = status.code();
        self.out.send(Err(status)).await;
    }

    /// Ends the stream because no worker can continue it.
    async fn lost(&mut self, reason: String) {
        let delivered = self.emitted.len();
        self.fail(RouterError::StreamLost { delivered, reason }.into_status())
            .await;
    }
}

/// Pumps messages from workers to the client until the stream finishes, the
/// deadline passes, or no worker can continue (a client that leaves drops
/// this future).
pub async fn run(
    mut ctx: FailoverContext,
    mut upstream: Upstream,
    out: Outbox<Result<Outgoing, Status>>,
) {
    // The first worker's series: a failover stays in the same version.
    let meter = StreamMeter::new(
        upstream.guard.endpoint().stream_series(ctx.api),
        ctx.started,
        ctx.span.clone(),
    );
    let mut client = ClientStream {
        out,
        seq: 0,
        emitted: Vec::new(),
        count: TokenCount::default(),
        meter,
        failovers: 0,
    };
    client.send(Event::Accepted(ctx.accepted.clone())).await;
    let deadline = ctx.attempts.deadline();
    let expiry = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(expiry);
    loop {
        let Some(failure) = relay(&ctx, &mut upstream, &mut client, &mut expiry).await else {
            return;
        };
        match fail_over(&mut ctx, &mut client, upstream, failure).await {
            Some(next) => upstream = next,
            None => return,
        }
    }
}

/// Relays one worker stream to the client. `None` when the client's stream
/// is over; the failure if the worker stream broke and may continue elsewhere.
async fn relay(
    ctx: &FailoverContext,
    upstream: &mut Upstream,
    client: &mut ClientStream,
    expiry: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> Option<Status> {
    loop {
        let next = tokio::select! {
            m = upstream.stream.message() => m,
            _ = expiry.as_mut() => {
                // Dropping the upstream stream cancels the worker's sequence.
                upstream.attempt.ended(tonic::Code::DeadlineExceeded);
                let delivered = client.emitted.len();
                client.fail(RouterError::DeadlineExceeded { delivered }.into_status()).await;
                return None;
            }
        };
        let message = match next {
            Ok(Some(msg)) => msg,
            Ok(None) => {
                return Some(Status::unavailable(
                    "worker ended the stream without finishing",
                ))
            }
            Err(status) if classify(status.code()).is_retryable() => return Some(status),
            Err(status) => {
                upstream.attempt.ended(status.code());
                client.fail(status).await;
                return None;
            }
        };
        match message {
            WorkerMessage::Accepted(a) => {
                upstream.guard.endpoint().note_load(a.load.as_ref(), false)
            }
            WorkerMessage::Empty => {}
            WorkerMessage::Delta(d) => {
                let first = client.count.total() == 0;
                let tokens = client
                    .count
                    .add_counts(d.token_count(), d.completion_tokens())
                    as usize;
                if first && tokens > 0 {
                    upstream.attempt.first_token(ctx.started.elapsed());
                }
                client.meter.tokens(tokens);
                client.emitted.extend(d.token_ids());
                client.send_delta(d).await;
            }
            WorkerMessage::Finished(mut f) => {
                // Every finish reason ends the stream as the worker sent it,
                // a CANCELLED (the worker's Abort) or KV_CACHE_FULL one too:
                // neither is a failure another worker could mend.
                client.meter.code = tonic::Code::Ok;
                // The worker's load is for this router, not the client.
                upstream
                    .guard
                    .endpoint()
                    .note_load(f.load.take().as_ref(), true);
                if let Some(u) = &f.usage {
                    ctx.attempts.affinity().finished(u.prompt_tokens);
                }
                f.failovers = client.failovers;
                // Named as Accepted names workers: by the id the router
                // routed to, not the worker's own idea of its id.
                f.worker_id = upstream.guard.endpoint().id.clone();
                if let Some(t) = f.timings.as_mut() {
                    t.total_ms = ctx.started.elapsed().as_secs_f64() * 1000.0;
                }
                client.send(Event::Finished(f)).await;
                return None;
            }
        }
    }
}

/// Moves the stream off the worker that failed with `failure` onto another
/// of the same version, from the tokens delivered so far; `None` (and the
/// client told why) if none can take it.
async fn fail_over(
    ctx: &mut FailoverContext,
    client: &mut ClientStream,
    mut lost: Upstream,
    failure: Status,
) -> Option<Upstream> {
    lost.attempt.ended(failure.code());
    let from = lost.guard.endpoint().id.clone();
    let continues = lost.guard.endpoint().record.continues_from_token_ids;
    // The lost worker's load and client span end here; it is not tried again.
    drop(lost);
    tracing::warn!(
        parent: &ctx.span,
        request_id = %ctx.accepted.request_id,
        worker = %from,
        delivered = client.emitted.len(),
        error = %failure.message(),
        "worker lost mid-stream"
    );
    // Deltas were delivered (seq 0 is Accepted) by a worker whose engine
    // cannot resume from token ids: starting over elsewhere would repeat
    // or change what the client has, so the stream ends here.
    if client.seq > 1 && !continues {
        let reason = format!("worker {from} cannot continue a stream from token ids");
        client.lost(reason).await;
        return None;
    }
    if client.failovers >= ctx.max_failovers {
        let reason = format!("failover limit of {} reached", ctx.max_failovers);
        client.lost(reason).await;
        return None;
    }
    client.failovers += 1;
    let route = route_span(&ctx.span, ctx.attempts.phase_spans());
    tracing::record_all!(
        route,
        version = ctx.accepted.version.as_str(),
        arm = version::arm_name(ctx.accepted.arm()),
        failover = client.failovers,
    );
    let next = match ctx.attempts.open(&client.emitted, &route).await {
        Ok(next) => next,
        Err(e) => {
            client.lost(e.to_string()).await;
            return None;
        }
    };
    let version = ctx.accepted.version.clone();
    metrics::counter!("llm_failovers_total", "model" => ctx.accepted.model.clone(), "version" => version)
        .increment(1);
    tracing::info!(
        parent: &ctx.span,
        request_id = %ctx.accepted.request_id,
        from = %from,
        to = %next.guard.endpoint().id,
        delivered = client.emitted.len(),
        "stream continues on another worker"
    );
    Some(next)
}
