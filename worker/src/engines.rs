//! The engines a worker serves from, behind the one interface the gRPC
//! service drives: the scheduler (over the GGUF model or the synthetic
//! engine), or an upstream engine reached over HTTP. Both take the same
//! prepared [`SequenceRequest`] and answer with the same [`Event`]s, so
//! replies, metrics, drains and Abort are shared.
//!
//! [`Event`]: crate::scheduler::Event
use crate::errors::WorkerError;
use crate::request::{self, Prepared, PromptModel, Serving};
use crate::scheduler::{EngineHandle, EngineStats, SequenceRequest, StreamKey};
use crate::upstream::{EnginePrompt, Prompt, UpstreamEngine};
use std::sync::Arc;
use tokenmesh_proto::v1::WorkerGenerateRequest;

/// Where a worker's sequences run.
#[derive(Clone)]
pub enum ServingEngine {
    /// The worker's own scheduler over a model it runs itself.
    Scheduler {
        model: Arc<dyn PromptModel>,
        engine: EngineHandle,
    },
    /// An existing engine behind its HTTP API (boxed: its handle is far
    /// larger than the scheduler's).
    Upstream(Box<UpstreamEngine>),
}

impl ServingEngine {
    /// Validates and tokenizes `req`; an upstream engine renders a chat
    /// through its own template and, where it can take the prompt as text
    /// (llama-server) or as a chat (a generic OpenAI-compatible server),
    /// tokenizes it itself as part of the completion.
    pub async fn prepare(
        &self,
        serving: &Serving,
        req: &WorkerGenerateRequest,
    ) -> Result<Prepared, WorkerError> {
        match self {
            Self::Scheduler { model, .. } => request::prepare(model.as_ref(), serving, req),
            Self::Upstream(up) => {
                let g = request::checked(serving, req)?;
                if !req.emitted_token_ids.is_empty() && !up.continues_from_token_ids() {
                    return Err(WorkerError::BadContinuation(format!(
                        "this worker's engine ({}) takes no token ids, so it cannot continue a stream",
                        up.kind().name()
                    )));
                }
                let asked = std::time::Instant::now();
                let mut prepared = match up.encode_prompt(g).await? {
                    Prompt::Engine(prompt) => {
                        request::prepare_engine_prompt(up.limits(), serving, req, g, prompt)?
                    }
                    Prompt::Tokens(ids) => {
                        request::prepare_tokens(up.limits(), serving, req, g, ids)?
                    }
                };
                prepared.engine_wait = asked.elapsed();
                Ok(prepared)
            }
        }
    }

    /// Starts a sequence. The scheduler queues it; an upstream engine also
    /// waits for a slot and opens the engine's stream first (bounded by
    /// `deadline`), so that the engine's refusals are this call's statuses.
    /// `engine_wait` is the time [`Self::prepare`] spent waiting on an
    /// upstream engine, which its first token's timing leaves out of the
    /// worker's own time; `engine_prompt`, the prompt an upstream engine
    /// reads itself ([`request::Prepared::engine_prompt`]).
    pub async fn submit(
        &self,
        req: SequenceRequest,
        deadline: Option<tokio::time::Instant>,
        engine_wait: std::time::Duration,
        engine_prompt: Option<EnginePrompt>,
    ) -> Result<(), WorkerError> {
        match self {
            Self::Scheduler { engine, .. } => Ok(engine.submit(req)?),
            Self::Upstream(up) => up.submit(req, deadline, engine_wait, engine_prompt).await,
        }
    }

    /// Stops the sequence `key` names (it finishes as CANCELLED).
    pub fn abort(&self, key: StreamKey) {
        match self {
            Self::Scheduler { engine, .. } => engine.abort(key),
            Self::Upstream(up) => up.abort(&key),
        }
    }

    /// Live counters for Status, metrics and drains.
    pub fn stats(&self) -> &Arc<EngineStats> {
        match self {
            Self::Scheduler { engine, .. } => engine.stats(),
            Self::Upstream(up) => up.stats(),
        }
    }

    /// Tokens of context one sequence can hold in the engine's KV cache.
    pub fn kv_capacity(&self) -> usize {
        match self {
            Self::Scheduler { engine, .. } => engine.kv_capacity(),
            Self::Upstream(up) => up.limits().context_length,
        }
    }

    /// Why the engine cannot serve now (an upstream engine that does not
    /// answer), for Status: routers then stop choosing this worker.
    pub fn unavailable(&self) -> Option<String> {
        match self {
            Self::Scheduler { .. } => None,
            Self::Upstream(up) => (!up.healthy())
                .then(|| "the upstream engine does not answer its health check".to_string()),
        }
    }

    /// The model's context window, in tokens.
    pub fn context_length(&self) -> usize {
        match self {
            Self::Scheduler { model, .. } => model.context_length(),
            Self::Upstream(up) => up.limits().context_length,
        }
    }
}
