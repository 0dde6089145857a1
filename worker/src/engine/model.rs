//! What every model backend and the scheduler share: the llama shape read
//! from GGUF metadata, the model's errors, one sequence's share of a step and
//! the logits it yields, and [`StepModel`], the contract through which the
//! scheduler drives a model (the real one, or the synthetic engine).
use super::kv::{KvCache, KvPool, KvShape};
use candle_core::quantized::gguf_file;

/// Errors from loading or running the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A metadata key the architecture needs is missing or has the wrong type.
    #[error("model metadata: {0}")]
    Metadata(String),
    /// A tensor the architecture needs is missing.
    #[error("model tensor {0} is missing")]
    MissingTensor(String),
    /// The file is not a llama-architecture model.
    #[error("unsupported architecture {0:?} (tokenmesh runs llama-architecture GGUF models)")]
    Architecture(String),
    /// A tensor has a shape the backend cannot run.
    #[error("model tensor {name}: {why}")]
    Shape { name: String, why: String },
    /// A step was given a token id the model has no embedding for.
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    /// The backend could not start (compute threads) or was handed a KV pool
    /// that is not its own.
    #[error("model backend: {0}")]
    Backend(String),
    /// Tensor arithmetic failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Shape of a llama model, read from GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub hidden: usize,
    pub rms_eps: f64,
    pub rope_theta: f32,
    pub context_length: usize,
    pub vocab_size: usize,
}

impl LlamaConfig {
    /// Reads the `{arch}.*` keys of a llama-architecture GGUF file.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self, ModelError> {
        let md = &content.metadata;
        let arch = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        if arch != "llama" {
            return Err(ModelError::Architecture(arch));
        }
        let get = |key: &str| -> Result<&gguf_file::Value, ModelError> {
            md.get(&format!("llama.{key}"))
                .ok_or_else(|| ModelError::Metadata(format!("llama.{key} is missing")))
        };
        let int = |key: &str| -> Result<usize, ModelError> {
            let v = get(key)?;
            v.to_u32()
                .map(|x| x as usize)
                .or_else(|_| v.to_u64().map(|x| x as usize))
                .map_err(|e| ModelError::Metadata(format!("llama.{key}: {e}")))
        };
        let hidden = int("embedding_length")?;
        let n_head = int("attention.head_count")?;
        let n_kv_head = int("attention.head_count_kv").unwrap_or(n_head);
        let rms_eps = get("attention.layer_norm_rms_epsilon")?
            .to_f32()
            .map_err(|e| ModelError::Metadata(e.to_string()))? as f64;
        let rope_theta = get("rope.freq_base")
            .ok()
            .and_then(|v| v.to_f32().ok())
            .unwrap_or(10_000.0);
        let head_dim = int("rope.dimension_count").unwrap_or(hidden / n_head);
        let embd = content
            .tensor_infos
            .get("token_embd.weight")
            .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
        let vocab_size = embd.shape.dims()[0];
        if n_kv_head == 0 || n_head % n_kv_head != 0 || head_dim * n_head != hidden {
            return Err(ModelError::Metadata(format!(
                "inconsistent heads: {n_head} heads, {n_kv_head} kv heads, hidden {hidden}"
            )));
        }
        Ok(Self {
            n_layer: int("block_count")?,
            n_head,
            n_kv_head,
            head_dim,
            hidden,
            rms_eps,
            rope_theta,
            context_length: int("context_length")?,
            vocab_size,
        })
    }

    /// The shape of one token's keys and values in the KV cache.
    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            layers: self.n_layer,
            kv_dim: self.n_kv_head * self.head_dim,
        }
    }
}

/// One sequence's share of a batched forward step.
pub struct SeqStep<'a> {
    /// New tokens (a prompt chunk, or one decoded token).
    pub tokens: &'a [u32],
    /// The sequence's cache; it must already have room for `tokens`
    /// (`KvPool::reserve`), and is advanced past them.
    pub cache: &'a mut KvCache,
}

impl SeqStep<'_> {
    /// The same step, borrowed for a shorter while (to hand a backend a
    /// batch of its own).
    pub fn reborrow(&mut self) -> SeqStep<'_> {
        SeqStep {
            tokens: self.tokens,
            cache: &mut *self.cache,
        }
    }
}

/// The logits of one step: one row of `vocab` values per sequence.
pub struct Logits {
    values: Vec<f32>,
    vocab: usize,
}

impl Logits {
    /// Rows of `vocab` values, flattened.
    pub fn new(values: Vec<f32>, vocab: usize) -> Self {
        debug_assert!(
            vocab > 0 && values.len().is_multiple_of(vocab),
            "whole rows"
        );
        Self { values, vocab }
    }

    /// Rows, in the order of the step's sequences.
    pub fn rows_mut(&mut self) -> std::slice::ChunksExactMut<'_, f32> {
        self.values.chunks_exact_mut(self.vocab)
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.values[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// What a new sequence tells its model (the synthetic engine derives its
/// output and its fault injection from it; the real model needs none of it).
#[derive(Clone, Copy, Debug)]
pub struct SeqStart<'a> {
    pub request_id: &'a str,
    /// The prompt's tokens.
    pub prompt: &'a [u32],
    /// Completion tokens delivered before a failover, which follow the prompt.
    pub emitted: &'a [u32],
}

/// One sequence of a step, as the scheduler hands it to a [`StepModel`]: its
/// share of the forward pass and the state the model keeps for it.
pub struct BatchSeq<'a, S> {
    pub step: SeqStep<'a>,
    pub state: &'a mut S,
}

/// What one step produced.
pub struct StepOutput {
    /// One row per sequence of the batch, in order. A row predicts the next
    /// token only where the sequence's cache now holds its whole context; a
    /// model may advance a cache by less than its step's tokens (the
    /// synthetic engine holds a first token back this way), and the sequence
    /// then reads the rest in a later step.
    pub logits: Logits,
    /// Sequences the model failed, by index in the batch, with the reason;
    /// they leave the batch with an error, the others carry on.
    pub failed: Vec<(usize, String)>,
}

impl From<Logits> for StepOutput {
    fn from(logits: Logits) -> Self {
        Self {
            logits,
            failed: Vec::new(),
        }
    }
}

/// A model the scheduler can drive: batched steps over a paged KV pool.
///
/// The scheduler owns admission, batching, the KV accounting, preemption,
/// sampling, detokenization and stop strings; a model only says how big its
/// context and its cache are and runs steps.
pub trait StepModel: Send + 'static {
    /// What the model keeps for one sequence across steps (the real model
    /// keeps nothing: its state is the KV cache).
    type SeqState: Send;

    /// Tokens of context (prompt and completion) a sequence may fill.
    fn context_length(&self) -> usize;

    /// Tokens that end a sequence (none for a model that never stops itself).
    fn eos_token_ids(&self) -> &[u32];

    /// The text bytes of token `id` (possibly part of a UTF-8 character).
    fn token_bytes(&self, id: u32) -> &[u8];

    /// A KV pool of as many `block_size`-token blocks as `budget_bytes` holds,
    /// where this model reads it.
    fn kv_pool(&self, budget_bytes: usize, block_size: usize) -> candle_core::Result<KvPool>;

    /// The state of a sequence that has just been submitted.
    fn start_seq(&self, seq: SeqStart<'_>) -> Self::SeqState;

    /// Runs one step: feeds each sequence's tokens after what its cache holds
    /// (its blocks already reserved), advances the caches and returns one
    /// logits row per sequence. An error fails every sequence of the batch.
    fn step(
        &mut self,
        pool: &mut KvPool,
        batch: &mut [BatchSeq<'_, Self::SeqState>],
    ) -> Result<StepOutput, ModelError>;
}

/// Checks that a sequence's step fits its context and its reserved blocks.
pub fn check_step(cfg: &LlamaConfig, pool: &KvPool, s: &SeqStep<'_>) -> Result<(), ModelError> {
    let total = s.cache.len() + s.tokens.len();
    if s.tokens.is_empty() || total > cfg.context_length {
        return Err(ModelError::Candle(candle_core::Error::Msg(format!(
            "sequence of {} + {} tokens does not fit the context of {}",
            s.cache.len(),
            s.tokens.len(),
            cfg.context_length
        ))));
    }
    if pool.shortfall(s.cache, total) > 0 {
        return Err(ModelError::Candle(candle_core::Error::Msg(
            "KV blocks were not reserved before the step".into(),
        )));
    }
    Ok(())
}
