//! One sequence on the engine: its streaming answer read event by event and
//! turned into the scheduler's [`Event`]s, until it finishes, fails, is
//! aborted, or its reply goes away (the client left or its deadline passed),
//! which drops the HTTP response and so stops the engine's work on it.
use super::dialect::{parse_event, Chunk, End};
use super::error::UpstreamError;
use super::sse::SseParser;
use super::UpstreamKind;
use crate::scheduler::{EngineStats, Event, Finish, SequenceRequest};
use crate::series::with_label;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use metrics::{Counter, Histogram};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// What a forwarded sequence needs besides its request.
pub(super) struct Forward {
    pub kind: UpstreamKind,
    /// End-of-generation ids, not output.
    pub eog: Arc<[u32]>,
    pub stats: Arc<EngineStats>,
    /// The worker's upstream series.
    pub series: Arc<UpstreamSeries>,
    /// Stops the sequence as CANCELLED.
    pub abort: oneshot::Receiver<()>,
    pub timing: FirstToken,
    /// The engine tokenized a text prompt: its count of the prompt's tokens
    /// is relayed before the first token.
    pub counts_prompt: bool,
}

/// The series a forwarded sequence records, looked up once per engine, not
/// by name and labels on every request (issue 20).
pub(super) struct UpstreamSeries {
    /// The worker's metric labels (model, version, worker), for the rare
    /// series made on use (errors by kind).
    pub labels: Vec<(&'static str, String)>,
    /// `tokenmesh_worker_upstream_first_token_seconds` by part: prepare,
    /// completion, worker.
    first_token: [Histogram; 3],
    /// `tokenmesh_worker_upstream_gaps_total{kind="token_ids_missing"}`.
    ids_missing: Counter,
}

impl UpstreamSeries {
    /// The series for `labels`, in the recorder installed now.
    pub fn new(labels: Vec<(&'static str, String)>) -> Self {
        let part = |p| {
            metrics::histogram!(
                "tokenmesh_worker_upstream_first_token_seconds",
                &with_label(&labels, "part", p)
            )
        };
        Self {
            first_token: [part("prepare"), part("completion"), part("worker")],
            ids_missing: metrics::counter!(
                "tokenmesh_worker_upstream_gaps_total",
                &with_label(&labels, "kind", "token_ids_missing")
            ),
            labels,
        }
    }
}

/// What the first token's time to arrive is made of, so that the worker's
/// own part of it is measured apart from the engine's (whose prefill
/// varies by far more than the worker adds).
pub(super) struct FirstToken {
    /// Preparing the request waited this long on the engine (its chat
    /// template, or its tokenizer where the prompt goes as ids).
    pub prepare: Duration,
    /// When the completion request was sent.
    pub asked: Instant,
}

impl FirstToken {
    /// Records the parts of the first token's time, which arrived from the
    /// engine at `arrived` and is relayed now: `prepare` and `completion`
    /// (the engine's, request sent → the event read) and `worker` (all the
    /// rest since the request came in: parsing, queueing for a slot,
    /// building the body, parsing the event, the hand-off to the reply).
    fn record(&self, req: &SequenceRequest, arrived: Instant, series: &UpstreamSeries) {
        let total = req.enqueued.elapsed();
        let completion = arrived.saturating_duration_since(self.asked);
        let worker = total.saturating_sub(self.prepare + completion);
        for (h, d) in series
            .first_token
            .iter()
            .zip([self.prepare, completion, worker])
        {
            h.record(d.as_secs_f64());
        }
        // One line per request at debug level: the benchmark reads the
        // worker's part from it (the histogram's buckets are too coarse for
        // tens of microseconds).
        tracing::debug!(
            prepare_us = self.prepare.as_micros() as u64,
            completion_us = completion.as_micros() as u64,
            worker_us = worker.as_micros() as u64,
            "upstream first token"
        );
    }
}

/// The sequence's progress.
struct Progress {
    /// Completion tokens this worker has output.
    tokens: usize,
    /// Tokens the engine says it generated (llama-server counts every one,
    /// also those it left out of the stream).
    engine_tokens: usize,
    first_token: Option<Duration>,
    /// Text the engine sent without a token, delivered with the next one.
    pending_text: String,
    /// The engine's count of the prompt's tokens was relayed.
    prompt_counted: bool,
    /// The engine's count of completion tokens (OpenAI's usage), which the
    /// finish reports where it came.
    engine_completion: Option<usize>,
    /// How the sequence ended, while the usage that follows is awaited (a
    /// generic OpenAI-compatible server sends it after the finish).
    ended: Option<(Finish, Option<String>)>,
}

impl Forward {
    /// Relays `body` to `req.events` until the sequence ends; the body's
    /// rest after a finish, to be read to its end so that its connection
    /// goes back to the pool (an aborted or failed stream's is dropped,
    /// which is what stops the engine's work on it).
    pub(super) async fn run(
        mut self,
        mut body: Incoming,
        req: SequenceRequest,
    ) -> Option<Incoming> {
        let mut parser = SseParser::default();
        let mut progress = Progress {
            tokens: 0,
            engine_tokens: 0,
            first_token: None,
            pending_text: String::new(),
            prompt_counted: false,
            engine_completion: None,
            ended: None,
        };
        let outcome = loop {
            let frame = tokio::select! {
                f = body.frame() => f,
                _ = req.events.closed() => {
                    tracing::debug!("reply gone; dropping the engine's stream");
                    return None;
                }
                _ = &mut self.abort => break Ok(Some((Finish::Cancelled, None))),
            };
            let data = match frame {
                // A finish already read ends the sequence even without the
                // usage and `[DONE]` that should have followed it.
                None => {
                    break match progress.ended.take() {
                        Some(end) => Ok(Some(end)),
                        None => Err(UpstreamError::Unfinished {
                            tokens: progress.tokens,
                        }),
                    }
                }
                Some(Err(e)) => {
                    break Err(UpstreamError::Broken {
                        tokens: progress.tokens,
                        reason: super::http::error_chain(&e),
                    })
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => data,
                    Err(_) => continue, // trailers
                },
            };
            let arrived = Instant::now();
            match parser
                .push(&data)
                .and_then(|events| self.events(&events, &req, &mut progress, arrived))
            {
                Ok(None) => {}
                Ok(Some(end)) => break Ok(Some(end)),
                Err(e) => break Err(e),
            }
        };
        match outcome {
            Ok(Some((reason, stop))) => {
                let finished = reason != Finish::Cancelled;
                let _ = req.events.send(Event::Finished {
                    reason,
                    stop,
                    tail: std::mem::take(&mut progress.pending_text),
                    completion_tokens: (req.already_emitted
                        + progress.engine_completion.unwrap_or(progress.tokens))
                        as u32,
                    first_token: progress.first_token,
                    total: req.enqueued.elapsed(),
                });
                finished.then_some(body)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(error = %e, tokens = progress.tokens, "upstream stream failed");
                e.count(&self.series.labels);
                let status = tonic::Status::new(e.code(), e.to_string());
                let _ = req.events.send(Event::Status(status));
                None
            }
        }
    }

    /// Handles the SSE events of one read; the end, once one says so.
    fn events(
        &self,
        events: &[String],
        req: &SequenceRequest,
        progress: &mut Progress,
        arrived: Instant,
    ) -> Result<Option<(Finish, Option<String>)>, UpstreamError> {
        for data in events {
            let chunk = parse_event(self.kind, data)?;
            if chunk.done {
                return match progress.ended.take() {
                    Some(end) => Ok(Some(end)),
                    None => Err(UpstreamError::Unfinished {
                        tokens: progress.tokens,
                    }),
                };
            }
            if let Some((prompt, completion)) = chunk.usage {
                self.count_prompt(prompt as usize, req, progress);
                progress.engine_completion = Some(completion as usize);
            }
            if progress.ended.is_some() {
                // Only the usage and `[DONE]` follow a finish.
                continue;
            }
            let end = chunk.end.clone();
            self.chunk(chunk, req, progress, arrived);
            if let Some(end) = end {
                let end = match end {
                    End::Eos => (Finish::Eos, None),
                    End::Length => (Finish::Length, None),
                    End::Stop(s) => (Finish::Stop, Some(s)),
                    End::StopOrEos if req.stop.is_empty() => (Finish::Eos, None),
                    End::StopOrEos => (Finish::Stop, Some(String::new())),
                };
                if self.kind.counts_by_usage() && progress.engine_completion.is_none() {
                    // Its usage comes after the finish: wait for it.
                    progress.ended = Some(end);
                    continue;
                }
                return Ok(Some(end));
            }
        }
        Ok(None)
    }

    /// Relays the engine's count of the prompt's tokens, once.
    fn count_prompt(&self, evaluated: usize, req: &SequenceRequest, progress: &mut Progress) {
        if !self.counts_prompt || progress.prompt_counted {
            return;
        }
        // llama-server's count covers a continuation's ids too.
        let tokens = evaluated.saturating_sub(req.already_emitted) as u32;
        let _ = req.events.send(Event::PromptCounted { tokens });
        progress.prompt_counted = true;
    }

    /// Sends a chunk's tokens, its text with the last of them.
    fn chunk(
        &self,
        chunk: Chunk,
        req: &SequenceRequest,
        progress: &mut Progress,
        arrived: Instant,
    ) {
        let Chunk {
            tokens,
            text,
            logprobs,
            generated,
            evaluated,
            untokenized,
            ..
        } = chunk;
        if let Some(evaluated) = evaluated {
            self.count_prompt(evaluated, req, progress);
        }
        progress.pending_text.push_str(&text);
        if untokenized > 0 {
            // Tokens without ids (a generic OpenAI-compatible server).
            if progress.first_token.is_none() {
                progress.first_token = Some(req.enqueued.elapsed());
            }
            progress.tokens += untokenized;
            self.stats
                .tokens_generated
                .fetch_add(untokenized as u64, Ordering::Relaxed);
            let _ = req.events.send(Event::Text {
                text: std::mem::take(&mut progress.pending_text),
                tokens: untokenized as u32,
                logprobs: if req.logprobs { logprobs } else { Vec::new() },
            });
            if progress.tokens == untokenized {
                self.timing.record(req, arrived, &self.series);
            }
            return;
        }
        let out: Vec<u32> = tokens
            .iter()
            .copied()
            // The end-of-turn token is not part of the output or its usage,
            // as on the worker's own engine.
            .filter(|t| !(text.is_empty() && self.eog.contains(t)))
            .collect();
        progress.engine_tokens += tokens.len();
        if let Some(generated) = generated {
            if generated > progress.engine_tokens {
                // llama-server leaves a token whose bytes end inside a UTF-8
                // character out of the stream (its text comes with the
                // next one): the text is whole, the id is lost.
                tracing::debug!(
                    missing = generated - progress.engine_tokens,
                    "engine left token ids out of its stream"
                );
                self.series
                    .ids_missing
                    .increment((generated - progress.engine_tokens) as u64);
                progress.engine_tokens = generated;
            }
        }
        let last = out.len();
        for (i, id) in out.into_iter().enumerate() {
            if progress.first_token.is_none() {
                progress.first_token = Some(req.enqueued.elapsed());
            }
            progress.tokens += 1;
            self.stats.tokens_generated.fetch_add(1, Ordering::Relaxed);
            let text = if i + 1 == last {
                std::mem::take(&mut progress.pending_text)
            } else {
                String::new()
            };
            let _ = req.events.send(Event::Token {
                id,
                text,
                logprob: req.logprobs.then(|| logprobs.get(i).copied()).flatten(),
            });
            if progress.tokens == 1 {
                self.timing.record(req, arrived, &self.series);
            }
        }
    }
}
