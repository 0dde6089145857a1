//! The upstream engine: a worker that fronts an existing engine
//! (llama-server, vLLM, or any OpenAI-compatible server) behind its HTTP API and brings it into the mesh with
//! the same Worker API, registration, load reports, drains and failover as
//! the worker's own engine (`--engine upstream`).
//!
//! Each request is rendered and tokenized by the engine (so token ids are
//! the engine's), then forwarded to its streaming completion endpoint with
//! the prompt, and for a continuation after a failover the tokens already
//! emitted as token ids; its stream becomes `Accepted`/`Delta`/`Finished`.
//! llama-server takes the prompt as text (followed by the continuation's
//! ids) and tokenizes it inside the completion, so a request costs one
//! round trip to it, not two; it then says how many prompt tokens it
//! counted, which the usage reports.
//! At most `--max-batch` requests are forwarded at once (the engine's
//! slots), at most `--queue-capacity` wait for one; beyond that
//! RESOURCE_EXHAUSTED. What differs from the worker's own engine:
//! - sampling is the engine's: greedy output is deterministic, but a seeded
//!   draw is not a function of (seed, position), so only greedy
//!   continuations are guaranteed to be what an undisturbed run would give;
//! - llama-server leaves the id of a token that ends inside a UTF-8
//!   character out of its stream (its text comes whole with the next
//!   token); such gaps are counted in `tokenmesh_worker_upstream_gaps_total`;
//! - a generic OpenAI-compatible server (`--upstream-kind openai`: SGLang,
//!   TensorRT-LLM's trtllm-serve, TGI, ...) renders and tokenizes itself and
//!   streams text without token ids: its Deltas carry text and a token
//!   count, the worker registers `continues_from_token_ids: false` (a
//!   stream it served that breaks mid-way ends UNAVAILABLE at the router
//!   instead of being guessed at elsewhere) and refuses continuations;
//!   its `finish_reason: stop` is STOP with the matched string where the
//!   server names it (vLLM's `stop_reason`, SGLang's `matched_stop`), else
//!   EOS when the request had no stop strings and STOP with an empty
//!   string when it had some.
mod dialect;
mod error;
mod forward;
mod http;
pub use http::send_resending;
mod info;
pub mod load;
mod sse;

pub use error::UpstreamError;
pub use http::BadUrl;
pub use info::{EngineInfo, EnginePrompt, Prompt};

use crate::errors::WorkerError;
use crate::request::Limits;
use crate::scheduler::{EngineStats, Event, SequenceRequest, StreamKey, SubmitError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokenmesh_proto::v1::GenerateRequest;
use tokenmesh_runtime::Readiness;
use tokio::sync::{oneshot, watch, Semaphore};
use tracing::Instrument;

/// Flags of `--engine upstream`.
#[derive(clap::Args, Clone, Debug)]
pub struct UpstreamArgs {
    /// Upstream engine only: its base URL, e.g. http://127.0.0.1:8080
    /// (plain HTTP: run the engine beside the worker).
    #[arg(long, env = "TOKENMESH_UPSTREAM_URL", value_name = "URL")]
    pub upstream_url: Option<String>,

    /// Upstream engine only: which API it speaks.
    #[arg(
        long,
        env = "TOKENMESH_UPSTREAM_KIND",
        value_enum,
        default_value_t = UpstreamKind::LlamaServer
    )]
    pub upstream_kind: UpstreamKind,

    /// Upstream engine only: the accelerator it runs on, as registered
    /// (`cpu`, `cuda`, `npu`; default `cpu` for llama-server, `cuda` for
    /// vLLM and openai).
    #[arg(long, env = "TOKENMESH_UPSTREAM_ACCELERATOR", value_name = "KIND")]
    pub upstream_accelerator: Option<String>,

    /// Upstream engine only: the context window (prompt and completion
    /// tokens) of one sequence, instead of the one the engine reports
    /// (llama-server's slot n_ctx, vLLM's max_model_len); required for an
    /// openai-kind server whose /v1/models gives no max_model_len.
    #[arg(
        long,
        env = "TOKENMESH_UPSTREAM_CONTEXT_LENGTH",
        value_name = "TOKENS",
        value_parser = clap::value_parser!(u32).range(2..)
    )]
    pub upstream_context_length: Option<u32>,

    /// Upstream engine only: how often its /health and /metrics are polled,
    /// in milliseconds.
    #[arg(
        long,
        env = "TOKENMESH_UPSTREAM_POLL_MS",
        default_value_t = 500,
        value_parser = clap::value_parser!(u64).range(10..=60_000)
    )]
    pub upstream_poll_ms: u64,

    /// Upstream engine only: bound of each call that is not a stream
    /// (connect, tokenize, health), in milliseconds.
    #[arg(
        long,
        env = "TOKENMESH_UPSTREAM_TIMEOUT_MS",
        default_value_t = 10_000,
        value_parser = clap::value_parser!(u64).range(1..=600_000)
    )]
    pub upstream_timeout_ms: u64,

    /// Upstream llama-server only: whether each completion asks it to reuse
    /// a slot's cached prompt prefix (`cache_prompt`). `false` makes every
    /// request prefill its whole prompt, e.g. to compare like for like with
    /// clients that send `cache_prompt: false`; the openai kind then sends
    /// `cache_prompt: false` too (llama-server's extension of the API).
    /// vLLM's prefix caching is a server flag (`--enable-prefix-caching`)
    /// and ignores this.
    #[arg(
        long,
        env = "TOKENMESH_UPSTREAM_PROMPT_CACHE",
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_name = "BOOL"
    )]
    pub upstream_prompt_cache: bool,
}

/// The API an upstream engine speaks.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpstreamKind {
    /// llama.cpp's llama-server (/completion, /tokenize, /apply-template).
    LlamaServer,
    /// vLLM's OpenAI-compatible server (/v1/completions, /tokenize).
    Vllm,
    /// Any OpenAI-compatible server (/v1/completions for prompts,
    /// /v1/chat/completions for chats, /health, /v1/models): text only,
    /// without token ids, so its streams cannot fail over mid-way.
    Openai,
}

impl UpstreamKind {
    /// The name registered and reported.
    pub fn name(self) -> &'static str {
        match self {
            Self::LlamaServer => "llama-server",
            Self::Vllm => "vllm",
            Self::Openai => "openai",
        }
    }

    /// Whether a continuation's emitted tokens can go to the engine as ids
    /// (what the registration's `continues_from_token_ids` says).
    pub fn continues_from_token_ids(self) -> bool {
        self != Self::Openai
    }

    /// Whether the engine's usage follows the finish in its stream (and is
    /// what counts the completion's tokens): a generic OpenAI-compatible
    /// server's, which sends no ids to count.
    pub fn counts_by_usage(self) -> bool {
        self == Self::Openai
    }

    /// The accelerator registered when the flag leaves it unset.
    pub fn default_accelerator(self) -> &'static str {
        match self {
            Self::LlamaServer => "cpu",
            Self::Vllm | Self::Openai => "cuda",
        }
    }
}

/// Why the upstream engine could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("--engine upstream needs --upstream-url")]
    NoUrl,
    #[error(transparent)]
    Url(#[from] BadUrl),
    #[error("--upstream-accelerator {0:?}: one of cpu, cuda, npu")]
    Accelerator(String),
}

/// Streams waiting to be told to stop, by name.
type Aborts = Arc<Mutex<HashMap<StreamKey, oneshot::Sender<()>>>>;

/// A cheap, cloneable handle to the upstream engine.
#[derive(Clone)]
pub struct UpstreamEngine {
    http: http::EngineHttp,
    kind: UpstreamKind,
    info: Arc<EngineInfo>,
    stats: Arc<EngineStats>,
    queue: Arc<load::Queue>,
    slots: Arc<Semaphore>,
    queue_capacity: usize,
    /// llama-server's `cache_prompt` on every completion.
    prompt_cache: bool,
    aborts: Aborts,
    labels: Vec<(&'static str, String)>,
    series: Arc<forward::UpstreamSeries>,
    /// The engine answered its last health poll.
    healthy: Arc<AtomicBool>,
}

/// Checked flags: the client and the accelerator to register.
pub struct Setup {
    pub http: http::EngineHttp,
    pub kind: UpstreamKind,
    pub accelerator: String,
    pub poll: Duration,
    /// llama-server's `cache_prompt` (--upstream-prompt-cache).
    pub prompt_cache: bool,
    /// --upstream-context-length.
    pub context_length: Option<usize>,
}

impl Setup {
    /// Checks the flags; nothing is contacted yet.
    pub fn new(args: &UpstreamArgs) -> Result<Self, SetupError> {
        let url = args.upstream_url.as_deref().ok_or(SetupError::NoUrl)?;
        let http = http::EngineHttp::new(url, Duration::from_millis(args.upstream_timeout_ms))?;
        let kind = args.upstream_kind;
        let accelerator = args
            .upstream_accelerator
            .clone()
            .unwrap_or_else(|| kind.default_accelerator().to_string());
        if !["cpu", "cuda", "npu"].contains(&accelerator.as_str()) {
            return Err(SetupError::Accelerator(accelerator));
        }
        Ok(Self {
            http,
            kind,
            accelerator,
            poll: Duration::from_millis(args.upstream_poll_ms),
            prompt_cache: args.upstream_prompt_cache,
            context_length: args.upstream_context_length.map(|n| n as usize),
        })
    }

    /// The engine's base URL.
    pub fn url(&self) -> &str {
        self.http.base()
    }

    /// Asks the engine about its model until it answers (an engine still
    /// loading answers 503), so a worker may start before its engine.
    pub async fn discover(&self) -> EngineInfo {
        let mut backoff = tokenmesh_runtime::Backoff::RECONNECT.retries();
        let (_never, mut stop) = watch::channel(false);
        loop {
            match info::discover(&self.http, self.kind, self.context_length).await {
                Ok(info) => return info,
                Err(e) => {
                    tracing::warn!(url = %self.http.base(), error = %e, "upstream engine not answering yet; retrying");
                }
            }
            backoff.wait(&mut stop).await;
        }
    }

    /// The handle requests go through, allowing `max_in_flight` forwarded
    /// at once and `queue_capacity` waiting.
    pub fn engine(
        &self,
        info: EngineInfo,
        max_in_flight: usize,
        queue_capacity: usize,
        labels: Vec<(&'static str, String)>,
    ) -> UpstreamEngine {
        UpstreamEngine {
            http: self.http.clone(),
            kind: self.kind,
            info: Arc::new(info),
            stats: Arc::new(EngineStats::default()),
            queue: Arc::default(),
            slots: Arc::new(Semaphore::new(max_in_flight.max(1))),
            queue_capacity,
            prompt_cache: self.prompt_cache,
            aborts: Aborts::default(),
            series: Arc::new(forward::UpstreamSeries::new(labels.clone())),
            labels,
            healthy: Arc::default(),
        }
    }
}

impl UpstreamEngine {
    /// The model's sizes as the engine reports them.
    pub fn limits(&self) -> Limits {
        Limits {
            context_length: self.info.context_length,
            vocab_size: self.info.vocab_size,
        }
    }

    /// What the engine said about its model.
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// The API the engine speaks.
    pub fn kind(&self) -> UpstreamKind {
        self.kind
    }

    /// Whether a continuation's emitted tokens can go to the engine.
    pub fn continues_from_token_ids(&self) -> bool {
        self.kind.continues_from_token_ids()
    }

    /// Live counters.
    pub fn stats(&self) -> &Arc<EngineStats> {
        &self.stats
    }

    /// Whether the engine answered its last health poll (false until the
    /// first).
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::SeqCst)
    }

    /// Renders `g` through the engine, as the engine takes it in a
    /// completion.
    pub async fn encode_prompt(&self, g: &GenerateRequest) -> Result<Prompt, WorkerError> {
        info::encode_prompt(&self.http, self.kind, &self.info.model, g)
            .await
            .map_err(|e| self.failed(e))
    }

    /// Counts `e` and makes it the request's error.
    fn failed(&self, e: UpstreamError) -> WorkerError {
        e.count(&self.labels);
        WorkerError::Upstream(e)
    }

    /// Waits for a slot (refusing at once when the queue is full), opens the
    /// engine's stream and relays it to `req.events` from a task of its own.
    /// `prepare` is how long preparing the request waited on the engine;
    /// `prompt`, the prompt when the engine reads it itself (`req.context`
    /// then holds only a continuation's emitted tokens).
    pub async fn submit(
        &self,
        req: SequenceRequest,
        deadline: Option<tokio::time::Instant>,
        prepare: Duration,
        prompt: Option<EnginePrompt>,
    ) -> Result<(), WorkerError> {
        if self.stats.draining.load(Ordering::SeqCst) {
            return Err(SubmitError::Draining.into());
        }
        let permit = match self.slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                let waiting = self.queue.local.fetch_add(1, Ordering::SeqCst);
                if waiting as usize >= self.queue_capacity {
                    self.queue.local.fetch_sub(1, Ordering::SeqCst);
                    return Err(SubmitError::QueueFull {
                        capacity: self.queue_capacity,
                    }
                    .into());
                }
                let _waiting = Waiting(self);
                self.queue.publish(&self.stats);
                let acquire = self.slots.clone().acquire_owned();
                let acquired = match deadline {
                    Some(d) => tokio::time::timeout_at(d, acquire)
                        .await
                        .map_err(|_| self.failed(UpstreamError::Deadline))?,
                    None => acquire.await,
                };
                acquired.map_err(|_| SubmitError::Stopped)?
            }
        };
        let active = Active::new(self.stats.clone());
        let _ = req.events.send(Event::Started {
            queued: req.enqueued.elapsed(),
            prompt_tokens_cached: None,
        });
        let ask = dialect::CompletionAsk {
            prompt: prompt.as_ref(),
            context: &req.context,
            max_new_tokens: req.max_tokens.saturating_sub(req.already_emitted),
            sampling: &req.sampling,
            stop: &req.stop,
            logprobs: req.logprobs,
            cache_prompt: self.prompt_cache,
        };
        let (path, body) = dialect::completion_request(self.kind, &self.info.model, &ask);
        let asked = std::time::Instant::now();
        let open = self.http.post_stream(path, &body);
        let opened = match deadline {
            Some(d) => tokio::time::timeout_at(d, open)
                .await
                .unwrap_or(Err(UpstreamError::Deadline)),
            None => open.await,
        };
        let stream = opened.map_err(|e| self.failed(e))?;
        let key = StreamKey {
            request_id: req.request_id.clone(),
            attempt_id: req.attempt_id.clone(),
        };
        let (abort_tx, abort_rx) = oneshot::channel();
        self.aborts
            .lock()
            .expect("aborts lock")
            .insert(key.clone(), abort_tx);
        let forward = forward::Forward {
            kind: self.kind,
            eog: self.info.eog.clone().into(),
            stats: self.stats.clone(),
            series: self.series.clone(),
            abort: abort_rx,
            timing: forward::FirstToken { prepare, asked },
            counts_prompt: prompt.is_some(),
        };
        let aborts = self.aborts.clone();
        let span = req.span.clone();
        tokio::spawn(
            async move {
                let rest = forward.run(stream, req).await;
                aborts.lock().expect("aborts lock").remove(&key);
                drop((active, permit));
                if let Some(body) = rest {
                    http::drain(body).await;
                }
            }
            .instrument(span),
        );
        Ok(())
    }

    /// Stops the stream `key` names, which then finishes as CANCELLED.
    pub fn abort(&self, key: &StreamKey) {
        if let Some(tx) = self.aborts.lock().expect("aborts lock").remove(key) {
            let _ = tx.send(());
        }
    }

    /// Polls the engine's health and load until the worker stops; `up`
    /// follows whether it answers.
    pub fn spawn_poller(&self, readiness: Readiness, up: watch::Sender<bool>, interval: Duration) {
        let poller = load::Poller {
            http: self.http.clone(),
            kind: self.kind,
            stats: self.stats.clone(),
            queue: self.queue.clone(),
            readiness,
            up,
            healthy: self.healthy.clone(),
            interval,
            labels: self.labels.clone(),
        };
        tokio::spawn(poller.run());
    }
}

/// Counts one request waiting for a slot until dropped.
struct Waiting<'a>(&'a UpstreamEngine);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.queue.local.fetch_sub(1, Ordering::SeqCst);
        self.0.queue.publish(&self.0.stats);
    }
}

/// Counts one forwarded sequence as active until dropped.
struct Active(Arc<EngineStats>);

impl Active {
    fn new(stats: Arc<EngineStats>) -> Self {
        stats.active.fetch_add(1, Ordering::SeqCst);
        Self(stats)
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}
