//! What every model backend and the scheduler share: the model's shape and
//! architecture read from GGUF metadata, checks of the file's tensors, the model's errors, one sequence's share of a step and
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
    /// The file's architecture is not one the worker runs.
    #[error(
        "unsupported architecture {found:?}: tokenmesh runs GGUF models of the {} architectures",
        Arch::SUPPORTED
    )]
    Architecture { found: String },
    /// The file asks for something of a supported architecture that the
    /// worker does not implement (a rope scaling, a partial rotation).
    #[error("unsupported model feature: {0}")]
    Unsupported(String),
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

/// The model architectures the worker runs (GGUF `general.architecture`).
/// They share the llama block (RMS norms, rotary attention with grouped
/// keys and values, a SiLU-gated feed-forward block) and differ in details.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3.x, Mistral, TinyLlama, SmolLM: the plain block.
    Llama,
    /// Qwen 2/2.5: biases on the query, key and value projections.
    Qwen2,
    /// Qwen 3: an RMS norm over each query and key head before the rotation.
    Qwen3,
    /// Phi-3: fused qkv and gate-up matrices.
    Phi3,
}

impl Arch {
    /// The names, for messages.
    pub const SUPPORTED: &'static str = "llama, qwen2, qwen3 and phi3";

    /// The architecture named `name` in GGUF metadata, if supported.
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "llama" => Self::Llama,
            "qwen2" => Self::Qwen2,
            "qwen3" => Self::Qwen3,
            "phi3" => Self::Phi3,
            _ => return None,
        })
    }

    /// The GGUF name, which also prefixes the architecture's metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Phi3 => "phi3",
        }
    }

    /// Whether the rotation pairs dimension i with i + head_dim / 2 (what
    /// llama.cpp calls NEOX) rather than with i + 1: llama GGUF files have
    /// their query and key rows permuted for adjacent pairs, the others are
    /// stored as trained, in halves.
    pub fn rope_halves(self) -> bool {
        !matches!(self, Self::Llama)
    }
}

/// Largest context a file may declare: beyond any real model's, and small
/// enough that per-position tables stay bounded.
const MAX_CONTEXT: usize = 1 << 24;

/// Shape of a model of one of the [`Arch`]itectures, read from GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub arch: Arch,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    /// Width of one query, key or value head (not always hidden / n_head:
    /// Qwen 3 sets it apart).
    pub head_dim: usize,
    pub hidden: usize,
    /// Width of the feed-forward block.
    pub ffn: usize,
    pub rms_eps: f64,
    pub rope_theta: f32,
    /// Linear rope scaling: positions are multiplied by this (1 / the
    /// file's `rope.scaling.factor`).
    pub rope_freq_scale: f32,
    pub context_length: usize,
    pub vocab_size: usize,
}

impl LlamaConfig {
    /// Reads the `{arch}.*` keys of a GGUF file of a supported architecture,
    /// checked against the embedding's shape and the file's tensor count.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self, ModelError> {
        let md = &content.metadata;
        let found = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        let arch = Arch::from_name(&found).ok_or(ModelError::Architecture { found })?;
        let prefix = arch.name();
        let key = |k: &str| format!("{prefix}.{k}");
        let get = |k: &str| -> Result<&gguf_file::Value, ModelError> {
            md.get(&key(k))
                .ok_or_else(|| ModelError::Metadata(format!("{} is missing", key(k))))
        };
        let int = |k: &str| -> Result<usize, ModelError> {
            let v = get(k)?;
            v.to_u32()
                .map(|x| x as usize)
                .or_else(|_| v.to_u64().map(|x| x as usize))
                .or_else(|_| v.to_i32().map(|x| x.max(0) as usize))
                .map_err(|e| ModelError::Metadata(format!("{}: {e}", key(k))))
        };
        let float = |k: &str| -> Option<f32> {
            md.get(&key(k)).and_then(|v| {
                v.to_f32()
                    .ok()
                    .or_else(|| v.to_f64().ok().map(|x| x as f32))
            })
        };
        let hidden = int("embedding_length")?;
        let n_head = int("attention.head_count")?;
        let n_kv_head = int("attention.head_count_kv").unwrap_or(n_head);
        let rms_eps = float("attention.layer_norm_rms_epsilon").ok_or_else(|| {
            ModelError::Metadata(format!(
                "{} is missing or not a number",
                key("attention.layer_norm_rms_epsilon")
            ))
        })? as f64;
        let rope_theta = float("rope.freq_base").unwrap_or(10_000.0);
        if n_head == 0 || n_kv_head == 0 || n_head % n_kv_head != 0 {
            return Err(ModelError::Metadata(format!(
                "inconsistent heads: {n_head} heads, {n_kv_head} kv heads"
            )));
        }
        let head_dim = int("attention.key_length").unwrap_or(hidden / n_head);
        let value_dim = int("attention.value_length").unwrap_or(head_dim);
        if value_dim != head_dim {
            return Err(ModelError::Unsupported(format!(
                "value heads of {value_dim} against key heads of {head_dim}"
            )));
        }
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(ModelError::Metadata(format!(
                "head width {head_dim} (it must be even and above 0)"
            )));
        }
        let n_rot = int("rope.dimension_count").unwrap_or(head_dim);
        if n_rot != head_dim {
            return Err(ModelError::Unsupported(format!(
                "a rotation of {n_rot} of each head's {head_dim} dimensions (only whole heads \
                 are rotated here)"
            )));
        }
        let scaling = md
            .get(&key("rope.scaling.type"))
            .and_then(|v| v.to_string().ok())
            .map_or("none", |s| s.as_str());
        if !matches!(scaling, "none" | "linear") {
            return Err(ModelError::Unsupported(format!(
                "rope scaling {scaling:?} (supported: none, linear, and Llama 3.1's \
                 rope_freqs.weight)"
            )));
        }
        let factor = float("rope.scaling.factor").unwrap_or(0.0);
        let rope_freq_scale = if factor > 0.0 { 1.0 / factor } else { 1.0 };

        let embd = content
            .tensor_infos
            .get("token_embd.weight")
            .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
        let &[vocab_size, embd_width] = embd.shape.dims() else {
            return Err(ModelError::Shape {
                name: "token_embd.weight".into(),
                why: format!("shape {:?}, expected 2 dimensions", embd.shape.dims()),
            });
        };
        if embd_width != hidden || vocab_size == 0 {
            return Err(ModelError::Shape {
                name: "token_embd.weight".into(),
                why: format!(
                    "shape ({vocab_size}, {embd_width}) against {} of {hidden}",
                    key("embedding_length")
                ),
            });
        }
        let n_layer = int("block_count")?;
        // Every layer has several tensors: a count beyond the file's tensors
        // is corrupt metadata (and would size the layer list).
        if n_layer == 0 || n_layer > content.tensor_infos.len() {
            return Err(ModelError::Metadata(format!(
                "{} of {n_layer} in a file of {} tensors",
                key("block_count"),
                content.tensor_infos.len()
            )));
        }
        let context_length = int("context_length")?;
        if context_length == 0 || context_length > MAX_CONTEXT {
            return Err(ModelError::Metadata(format!(
                "{} of {context_length} (it must be between 1 and {MAX_CONTEXT})",
                key("context_length")
            )));
        }
        Ok(Self {
            arch,
            n_layer,
            n_head,
            n_kv_head,
            head_dim,
            hidden,
            ffn: int("feed_forward_length")?,
            rms_eps,
            rope_theta,
            rope_freq_scale,
            context_length,
            vocab_size,
        })
    }

    /// Width of a row of queries (all heads).
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of a row of keys (all kv heads), and of values.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
    }

    /// The shape of one token's keys and values in the KV cache.
    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            layers: self.n_layer,
            kv_dim: self.kv_dim(),
        }
    }

    /// The rotary frequencies, head_dim / 2 of them: `rope_theta^(-2i/d)`,
    /// divided by the file's per-dimension `factors` where it has them
    /// (Llama 3.1+'s `rope_freqs.weight`) and scaled linearly, as llama.cpp
    /// computes them.
    pub fn rope_frequencies(&self, factors: Option<&[f32]>) -> Vec<f32> {
        let d = self.head_dim as f32;
        (0..self.head_dim / 2)
            .map(|i| {
                // As the frequencies were computed before scaling existed,
                // to the bit, where nothing scales them.
                let f = 1.0 / self.rope_theta.powf(2.0 * i as f32 / d);
                let ff = factors.map_or(1.0, |v| v[i]);
                self.rope_freq_scale * f / ff
            })
            .collect()
    }
}

/// Checks that tensor `name` is in the file with `dims` (rows first, as candle reports
/// GGUF shapes).
pub fn check_dims(
    content: &gguf_file::Content,
    name: &str,
    dims: &[usize],
) -> Result<(), ModelError> {
    let info = content
        .tensor_infos
        .get(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    if info.shape.dims() != dims {
        return Err(ModelError::Shape {
            name: name.to_string(),
            why: format!("shape {:?}, expected {dims:?}", info.shape.dims()),
        });
    }
    Ok(())
}

/// Checks every tensor's stored bytes lie inside the file that `reader`
/// reads, before anything is allocated for them: a truncated file, or one
/// whose header declares a huge tensor, is refused here.
pub fn check_tensor_data<R: std::io::Seek>(
    content: &gguf_file::Content,
    reader: &mut R,
) -> Result<(), ModelError> {
    let file_len = reader
        .seek(std::io::SeekFrom::End(0))
        .map_err(|e| ModelError::Backend(format!("reading the model file: {e}")))?;
    for (name, info) in &content.tensor_infos {
        let dtype = info.ggml_dtype;
        let elems = info
            .shape
            .dims()
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
        let bytes = elems.and_then(|n| {
            (n % dtype.block_size() as u64 == 0)
                .then(|| (n / dtype.block_size() as u64).checked_mul(dtype.type_size() as u64))
                .flatten()
        });
        let end = bytes.and_then(|b| {
            content
                .tensor_data_offset
                .checked_add(info.offset)?
                .checked_add(b)
        });
        match end {
            Some(end) if end <= file_len => {}
            _ => {
                return Err(ModelError::Shape {
                    name: name.clone(),
                    why: format!(
                        "{:?} {dtype:?} at offset {} does not fit in the file of {file_len} \
                         bytes (truncated or corrupt)",
                        info.shape.dims(),
                        info.offset
                    ),
                })
            }
        }
    }
    Ok(())
}

/// Tensors some files of these architectures carry that the worker does not
/// implement; a file with one is refused rather than run without it.
const UNIMPLEMENTED_TENSORS: &[(&str, &str)] = &[
    ("output.bias", "an output bias"),
    (
        "rope_factors_long.weight",
        "LongRoPE scaling (128k-context Phi-3)",
    ),
    (
        "rope_factors_short.weight",
        "LongRoPE scaling (128k-context Phi-3)",
    ),
    ("blk.0.attn_output.bias", "an attention output bias"),
    ("blk.0.ffn_gate.bias", "feed-forward biases"),
    ("blk.0.ffn_up.bias", "feed-forward biases"),
    ("blk.0.ffn_down.bias", "feed-forward biases"),
    ("blk.0.ffn_gate_inp.weight", "mixture-of-experts layers"),
];

/// Refuses a file with a tensor of [`UNIMPLEMENTED_TENSORS`].
pub fn check_unimplemented(content: &gguf_file::Content) -> Result<(), ModelError> {
    for (name, what) in UNIMPLEMENTED_TENSORS {
        if content.tensor_infos.contains_key(*name) {
            return Err(ModelError::Unsupported(format!("{what} (tensor {name})")));
        }
    }
    Ok(())
}

/// Reads tensor `name` as f32 values, if the file has it.
pub fn read_vector<R: std::io::Read + std::io::Seek>(
    content: &gguf_file::Content,
    reader: &mut R,
    name: &str,
) -> Result<Option<Vec<f32>>, ModelError> {
    if !content.tensor_infos.contains_key(name) {
        return Ok(None);
    }
    Ok(Some(
        content
            .tensor(reader, name, &candle_core::Device::Cpu)?
            .dequantize(&candle_core::Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?,
    ))
}

/// The rotary frequencies of the model in `content`: those of `cfg`, with
/// `rope_freqs.weight` applied where the file has it (head_dim / 2 values).
pub fn read_rope_frequencies<R: std::io::Read + std::io::Seek>(
    cfg: &LlamaConfig,
    content: &gguf_file::Content,
    reader: &mut R,
) -> Result<Vec<f32>, ModelError> {
    const NAME: &str = "rope_freqs.weight";
    let factors = read_vector(content, reader, NAME)?;
    if let Some(f) = &factors {
        if f.len() != cfg.head_dim / 2 || f.iter().any(|&x| !(x > 0.0 && x.is_finite())) {
            return Err(ModelError::Shape {
                name: NAME.into(),
                why: format!(
                    "{} values, expected {} positive divisors",
                    f.len(),
                    cfg.head_dim / 2
                ),
            });
        }
    }
    Ok(cfg.rope_frequencies(factors.as_deref()))
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
