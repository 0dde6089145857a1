//! The engine thread: admits sequences from a bounded queue and runs every
//! active sequence through the model together, one token per step.
//!
//! Model compute never runs on the async runtime: requests arrive through a
//! channel, tokens leave through one unbounded channel per sequence, and a
//! sequence whose receiver is gone (client cancelled, stream dropped) leaves the
//! batch at the next step.
use crate::engine::detokenize::TextStream;
use crate::engine::llama::{KvCache, SeqStep};
use crate::engine::sampling::{Sampler, SamplingParams, PENALTY_WINDOW};
use crate::engine::LoadedModel;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    Eos,
}

/// What the engine tells one sequence's owner.
#[derive(Debug)]
pub enum Event {
    /// The sequence left the queue and entered the batch.
    Started { queued: Duration },
    /// One generated token and the text it released (may be empty).
    Token {
        id: u32,
        text: String,
        logprob: Option<f32>,
    },
    /// The last event of a sequence that ran to its end.
    Finished {
        reason: Finish,
        stop: Option<String>,
        /// Text released by the end itself (held-back bytes), possibly empty.
        tail: String,
        completion_tokens: u32,
        first_token: Option<Duration>,
        total: Duration,
    },
    /// The model failed on this sequence.
    Failed(String),
}

/// One sequence to generate.
pub struct SequenceRequest {
    pub request_id: String,
    /// Prompt tokens followed by tokens emitted before a failover.
    pub context: Vec<u32>,
    /// Tokens of `context` that were already delivered to the client.
    pub already_emitted: usize,
    /// Completion tokens allowed in total, including `already_emitted`.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub logprobs: bool,
    pub events: mpsc::UnboundedSender<Event>,
    pub enqueued: Instant,
}

/// Why a sequence was not admitted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the worker's queue is full ({capacity} waiting); retry later or on another worker")]
    QueueFull { capacity: usize },
    #[error("the worker is draining and takes no new requests")]
    Draining,
    #[error("the engine has stopped")]
    Stopped,
}

/// Counters the engine publishes for Status and metrics.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub active: AtomicU32,
    pub queued: AtomicU32,
    pub tokens_generated: AtomicU64,
    pub draining: AtomicBool,
}

/// Scheduling limits.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Sequences run together in one step.
    pub max_batch: usize,
    /// Sequences allowed to wait for a batch slot.
    pub queue_capacity: usize,
}

/// What an engine's handle sends it; every engine (the model's thread, the
/// synthetic task) consumes the same commands.
pub(crate) enum Command {
    Submit(Box<SequenceRequest>),
    Abort(String),
}

/// Cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    stats: Arc<EngineStats>,
    queue_capacity: usize,
}

impl EngineHandle {
    /// Starts the engine thread for `model`.
    pub fn start(model: Arc<LoadedModel>, cfg: SchedulerConfig) -> Self {
        let (handle, rx) = Self::channel(cfg.queue_capacity);
        let thread_stats = handle.stats.clone();
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || Scheduler::new(model, cfg, thread_stats).run(rx))
            .expect("spawning the engine thread");
        handle
    }

    /// A handle and the command receiver its engine consumes; the engine
    /// keeps `stats.active` current, the handle and the engine share
    /// `stats.queued` (see `Scheduler::publish`).
    pub(crate) fn channel(queue_capacity: usize) -> (Self, mpsc::UnboundedReceiver<Command>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let handle = Self {
            tx,
            stats: Arc::new(EngineStats::default()),
            queue_capacity,
        };
        (handle, rx)
    }

    /// Queues a sequence, or refuses at once when the queue is full.
    pub fn submit(&self, req: SequenceRequest) -> Result<(), SubmitError> {
        if self.stats.draining.load(Ordering::SeqCst) {
            return Err(SubmitError::Draining);
        }
        let queued = self.stats.queued.fetch_add(1, Ordering::SeqCst);
        if queued as usize >= self.queue_capacity {
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull {
                capacity: self.queue_capacity,
            });
        }
        self.tx.send(Command::Submit(Box::new(req))).map_err(|_| {
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            SubmitError::Stopped
        })
    }

    /// Stops a sequence by request id (dropping its receiver does too).
    pub fn abort(&self, request_id: &str) {
        let _ = self.tx.send(Command::Abort(request_id.to_string()));
    }

    /// Live counters.
    pub fn stats(&self) -> &Arc<EngineStats> {
        &self.stats
    }
}

struct Active {
    req: SequenceRequest,
    cache: KvCache,
    sampler: Sampler,
    text: TextStream,
    /// Tokens not yet fed to the model: the whole context at first, then the
    /// last sampled token.
    feed: Vec<u32>,
    generated: usize,
    first_token: Option<Duration>,
}

struct Scheduler {
    model: Arc<LoadedModel>,
    cfg: SchedulerConfig,
    stats: Arc<EngineStats>,
    waiting: VecDeque<SequenceRequest>,
    active: Vec<Active>,
}

impl Scheduler {
    fn new(model: Arc<LoadedModel>, cfg: SchedulerConfig, stats: Arc<EngineStats>) -> Self {
        Self {
            model,
            cfg,
            stats,
            waiting: VecDeque::new(),
            active: Vec::new(),
        }
    }

    fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        loop {
            if self.active.is_empty() && self.waiting.is_empty() {
                match rx.blocking_recv() {
                    Some(cmd) => self.handle(cmd),
                    None => return,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            self.drop_cancelled();
            self.admit();
            if !self.active.is_empty() {
                self.step();
            }
            self.publish();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(req) => self.waiting.push_back(*req),
            Command::Abort(id) => {
                self.remove_waiting(|r| r.request_id == id);
                self.active.retain(|a| a.req.request_id != id);
            }
        }
    }

    fn drop_cancelled(&mut self) {
        self.remove_waiting(|r| r.events.is_closed());
        self.active.retain(|a| !a.req.events.is_closed());
    }

    fn remove_waiting(&mut self, gone: impl Fn(&SequenceRequest) -> bool) {
        let before = self.waiting.len();
        self.waiting.retain(|r| !gone(r));
        let removed = (before - self.waiting.len()) as u32;
        self.stats.queued.fetch_sub(removed, Ordering::SeqCst);
    }

    fn admit(&mut self) {
        while self.active.len() < self.cfg.max_batch {
            let Some(req) = self.waiting.pop_front() else {
                break;
            };
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            let mut text = TextStream::new(req.stop.clone());
            // Replay what was delivered before a failover so that held-back
            // bytes and stop-string prefixes are where the client left them.
            let emitted_from = req.context.len() - req.already_emitted;
            for &t in &req.context[emitted_from..] {
                text.push(self.model.tokenizer.token_bytes(t));
            }
            let now = Instant::now();
            let _ = req.events.send(Event::Started {
                queued: now - req.enqueued,
            });
            self.active.push(Active {
                cache: self.model.llama.new_cache(),
                sampler: Sampler::new(req.sampling.clone()),
                text,
                feed: req.context.clone(),
                generated: req.already_emitted,
                first_token: None,
                req,
            });
        }
    }

    fn step(&mut self) {
        let logits = {
            let mut batch: Vec<SeqStep<'_>> = self
                .active
                .iter_mut()
                .map(|a| SeqStep {
                    tokens: &a.feed,
                    cache: &mut a.cache,
                })
                .collect();
            self.model
                .llama
                .forward(&mut batch)
                .and_then(|l| Ok(l.to_vec2::<f32>()?))
        };
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "forward pass failed");
                for a in self.active.drain(..) {
                    let _ = a.req.events.send(Event::Failed(e.to_string()));
                }
                return;
            }
        };
        let eos = self.model.tokenizer.eos_token_ids();
        let mut done = Vec::new();
        for (i, (a, mut row)) in self.active.iter_mut().zip(logits).enumerate() {
            let ctx = &a.req.context;
            let recent = &ctx[ctx.len().saturating_sub(PENALTY_WINDOW)..];
            let sampled = a.sampler.sample(&mut row, recent);
            if a.first_token.is_none() {
                a.first_token = Some(a.req.enqueued.elapsed());
            }
            // The end-of-turn token is not part of the output or its usage.
            if eos.contains(&sampled.token) {
                done.push((i, Finish::Eos, None));
                continue;
            }
            a.generated += 1;
            self.stats.tokens_generated.fetch_add(1, Ordering::Relaxed);
            let logprob = a.req.logprobs.then_some(sampled.logprob);
            let released = a.text.push(self.model.tokenizer.token_bytes(sampled.token));
            let _ = a.req.events.send(Event::Token {
                id: sampled.token,
                text: released.text,
                logprob,
            });
            a.feed = vec![sampled.token];
            a.req.context.push(sampled.token);
            if let Some(stop) = released.stop {
                done.push((i, Finish::Stop, Some(stop)));
            } else if a.generated >= a.req.max_tokens
                || a.cache.len() + 1 >= self.model.llama.config().context_length
            {
                done.push((i, Finish::Length, None));
            }
        }
        for (i, reason, stop) in done.into_iter().rev() {
            let mut a = self.active.remove(i);
            let tail = if reason == Finish::Stop {
                String::new()
            } else {
                a.text.finish()
            };
            let _ = a.req.events.send(Event::Finished {
                reason,
                stop,
                tail,
                completion_tokens: a.generated as u32,
                first_token: a.first_token,
                total: a.req.enqueued.elapsed(),
            });
        }
    }

    fn publish(&self) {
        // `queued` is counted by submit and by the removals above, so that a
        // request in the channel but not yet in `waiting` still counts.
        self.stats
            .active
            .store(self.active.len() as u32, Ordering::SeqCst);
    }
}
