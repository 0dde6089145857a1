//! The engine: a bounded priority queue in front of a continuous batch.
//!
//! Model compute never runs on the async runtime: requests arrive through a
//! channel to the engine thread (`engine_loop`), tokens leave through one
//! unbounded channel per sequence, and a sequence whose receiver is gone
//! (client cancelled, stream dropped) leaves the batch, and frees its KV
//! blocks, at the next step. The thread drives a model through
//! [`StepModel`]: the GGUF model, or the synthetic engine.
mod engine_loop;
pub mod queue;
mod series;

use crate::engine::model::StepModel;
use crate::engine::sampling::SamplingParams;
pub use queue::Priority;
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
    /// Stopped by an abort.
    Cancelled,
    /// Its next token needs more KV cache than the whole pool has.
    KvCacheFull,
}

impl Finish {
    /// The variant's name, as traces record it (a `&str` records without
    /// going through a formatter, which `Debug` would).
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "Stop",
            Finish::Length => "Length",
            Finish::Eos => "Eos",
            Finish::Cancelled => "Cancelled",
            Finish::KvCacheFull => "KvCacheFull",
        }
    }
}

/// Names one stream on this worker: the client's request id (which several
/// streams may share) and the attempt id of the call that opened it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StreamKey {
    pub request_id: String,
    pub attempt_id: String,
}

/// What the engine tells one sequence's owner.
#[derive(Debug)]
pub enum Event {
    /// The sequence left the queue and entered the batch.
    Started {
        queued: Duration,
        /// Prompt tokens the prefix cache served (None: the engine does not
        /// say, as an upstream engine does not).
        prompt_tokens_cached: Option<u32>,
    },
    /// The engine counted the prompt's tokens: an upstream engine that
    /// tokenized a text prompt itself, before its first token.
    PromptCounted { tokens: u32 },
    /// One generated token and the text it released (may be empty).
    Token {
        id: u32,
        text: String,
        logprob: Option<f32>,
    },
    /// Generated tokens whose ids the engine does not say (a generic
    /// OpenAI-compatible upstream), and their text.
    Text {
        text: String,
        tokens: u32,
        /// One per token, when asked for and sent.
        logprobs: Vec<f32>,
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
    /// The sequence can never run here (it needs more KV cache than exists).
    Rejected(String),
    /// An upstream engine failed the sequence; the status says how.
    Status(tonic::Status),
}

/// One sequence to generate.
pub struct SequenceRequest {
    pub request_id: String,
    /// With `request_id`, what an abort names (see [`StreamKey`]).
    pub attempt_id: String,
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
    pub priority: Priority,
    /// The request's span: queue, prefill and decode spans are its children.
    pub span: tracing::Span,
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
    /// Requests submitted and not yet in the batch (counted by `submit`, so a
    /// request still in the channel counts too).
    pub queued: AtomicU32,
    /// Waiting requests per priority: HIGH, NORMAL, LOW.
    pub queued_by_priority: [AtomicU32; 3],
    /// KV blocks held by sequences.
    pub kv_blocks_used: AtomicU32,
    pub kv_blocks_total: AtomicU32,
    /// KV blocks no sequence holds, kept by the prefix cache for reuse.
    pub kv_blocks_cached: AtomicU32,
    /// Cached KV blocks evicted to make room, since start.
    pub kv_blocks_evicted: AtomicU64,
    /// Context tokens of every admission to the batch (a prompt, or for a
    /// continuation or a preempted sequence's return, the prompt and its
    /// tokens so far), since start.
    pub prompt_tokens_total: AtomicU64,
    /// Of those, tokens served from the prefix cache instead of computed.
    pub prompt_tokens_cached: AtomicU64,
    pub tokens_generated: AtomicU64,
    pub preemptions: AtomicU64,
    pub draining: AtomicBool,
}

/// Scheduling limits.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Sequences run together in one step.
    pub max_batch: usize,
    /// Sequences allowed to wait for a batch slot.
    pub queue_capacity: usize,
    /// Tokens run through the model in one step: every decoding sequence's
    /// one token, then prompt chunks up to this budget, so that a long prompt
    /// never stalls the streams already running.
    pub max_tokens_per_step: usize,
    /// A step should take about this long: the prompt budget shrinks when
    /// steps run slower (None: no target).
    pub step_latency_target: Option<Duration>,
    /// Memory for the KV cache pool, in bytes.
    pub kv_budget_bytes: usize,
    /// Tokens per KV block.
    pub kv_block_size: usize,
    /// Automatic prefix caching: `Some(identity)` of the model (file digest
    /// and version, which seeds the block hashes) keeps full KV blocks after
    /// their sequence for later ones with the same prefix; None frees them.
    pub prefix_cache: Option<String>,
    /// A waiting request moves up one priority class per this much waiting.
    pub priority_aging: Duration,
    /// Metric labels of this worker (model, version, worker).
    pub labels: Vec<(&'static str, String)>,
    /// Each sequence's `queue`, `prefill` and `decode` as spans under its
    /// `Generate` span (`--trace-phases`); otherwise their times are only
    /// attributes of that span, which costs a fraction (issue 20).
    pub phase_spans: bool,
}

/// What an engine's handle sends its thread.
pub(crate) enum Command {
    Submit(Box<SequenceRequest>),
    Abort(StreamKey),
}

/// Cheap, cloneable handle to the engine thread. Dropping the last clone
/// stops the engine and waits for its thread (at most one step).
#[derive(Clone)]
pub struct EngineHandle {
    // Field order matters: the sender drops (closing the channel the engine
    // watches) before `thread` joins.
    tx: mpsc::UnboundedSender<Command>,
    stats: Arc<EngineStats>,
    queue_capacity: usize,
    /// Tokens the KV pool holds (blocks times block size).
    kv_capacity: usize,
    thread: Arc<EngineThread>,
}

/// Joins the engine thread when the last handle goes. Without this, a step
/// still running when the process exits races the CUDA libraries' exit-time
/// teardown (seen on an H200: a segfault inside cuBLAS after the batching
/// tests had all passed).
#[derive(Default)]
struct EngineThread(Option<std::thread::JoinHandle<()>>);

impl Drop for EngineThread {
    fn drop(&mut self) {
        if let Some(thread) = self.0.take() {
            // The engine never holds a handle, but never join oneself.
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

impl EngineHandle {
    /// Starts the engine thread for `model`; fails when its KV pool cannot
    /// be allocated.
    pub fn start<M: StepModel>(model: M, cfg: SchedulerConfig) -> Result<Self, candle_core::Error> {
        let (mut handle, rx) = Self::channel(cfg.queue_capacity);
        let scheduler = engine_loop::Scheduler::new(model, cfg, handle.stats.clone())?;
        handle.kv_capacity = scheduler.kv_capacity();
        let thread = std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || scheduler.run(rx))
            .expect("spawning the engine thread");
        handle.thread = Arc::new(EngineThread(Some(thread)));
        Ok(handle)
    }

    /// A handle and the command receiver its engine consumes; the engine
    /// keeps `stats.active` current, the handle and the engine share
    /// `stats.queued`.
    fn channel(queue_capacity: usize) -> (Self, mpsc::UnboundedReceiver<Command>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let handle = Self {
            tx,
            stats: Arc::new(EngineStats::default()),
            queue_capacity,
            kv_capacity: 0,
            thread: Arc::default(),
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

    /// Stops the sequence `key` names, which then finishes as
    /// [`Finish::Cancelled`] with the tokens it has (dropping its receiver
    /// stops it too, silently).
    pub fn abort(&self, key: StreamKey) {
        let _ = self.tx.send(Command::Abort(key));
    }

    /// Tokens of context one sequence can hold in the KV cache pool.
    pub fn kv_capacity(&self) -> usize {
        self.kv_capacity
    }

    /// Live counters.
    pub fn stats(&self) -> &Arc<EngineStats> {
        &self.stats
    }
}
