//! The forward pass behind one interface: our quantized CPU kernels, or
//! candle's tensors on an accelerator.
use super::cpu::CpuLlama;
use super::kv_pool::KvPool;
use super::llama::{LlamaConfig, LlamaModel, ModelError, SeqStep};
use candle_core::quantized::gguf_file;
use candle_core::Device;
use std::io::{Read, Seek};

/// A loaded model, ready to run batched steps.
pub enum Backend {
    /// Quantized weights as stored, SIMD kernels (`--device cpu`).
    Cpu(Box<CpuLlama>),
    /// Dequantized weights as candle tensors (`--device cuda:N`).
    Candle(LlamaModel),
}

/// The logits of one step: one row of `vocab` values per sequence.
pub struct Logits {
    values: Vec<f32>,
    vocab: usize,
}

impl Logits {
    /// Rows, in the order of the step's sequences.
    pub fn rows_mut(&mut self) -> std::slice::ChunksExactMut<'_, f32> {
        self.values.chunks_exact_mut(self.vocab)
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.values[i * self.vocab..(i + 1) * self.vocab]
    }
}

impl Backend {
    /// Loads the weights for `device`: the CPU kernels on the CPU (with
    /// `threads` compute threads, None for every core), candle on anything
    /// else.
    pub fn load<R: Read + Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
        device: &Device,
        threads: Option<usize>,
    ) -> Result<Self, ModelError> {
        Ok(match device {
            Device::Cpu => {
                let threads = threads
                    .filter(|&n| n > 0)
                    .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
                Backend::Cpu(Box::new(CpuLlama::load(content, reader, threads)?))
            }
            _ => Backend::Candle(LlamaModel::load(content, reader, device)?),
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &LlamaConfig {
        match self {
            Backend::Cpu(m) => m.config(),
            Backend::Candle(m) => m.config(),
        }
    }

    /// Token ids are below this.
    pub fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }

    /// A KV pool where this backend reads it: host memory for the CPU
    /// kernels, tensors on the device for candle.
    pub fn kv_pool(&self, budget_bytes: usize, block_size: usize) -> candle_core::Result<KvPool> {
        match self {
            Backend::Cpu(m) => Ok(KvPool::new_host(m.config(), budget_bytes, block_size)),
            Backend::Candle(m) => KvPool::new(m.config(), budget_bytes, block_size, m.device()),
        }
    }

    /// Runs one step for several sequences; the logits of each sequence's
    /// last new token.
    pub fn forward(
        &self,
        pool: &mut KvPool,
        batch: &mut [SeqStep<'_>],
    ) -> Result<Logits, ModelError> {
        let vocab = self.vocab_size();
        let values = match self {
            Backend::Cpu(m) => m.forward(pool, batch)?,
            Backend::Candle(m) => m.forward(pool, batch)?.flatten_all()?.to_vec1::<f32>()?,
        };
        Ok(Logits { values, vocab })
    }
}
