//! The forward pass behind one interface: our quantized CPU kernels, or
//! candle's tensors on an accelerator.
use super::candle::CandleLlama;
use super::cpu::{CpuKernels, CpuLlama};
use super::kv::KvPool;
use super::model::{LlamaConfig, Logits, ModelError, SeqStep};
use candle_core::quantized::gguf_file;
use candle_core::Device;
use std::io::{Read, Seek};

/// A loaded model, ready to run batched steps.
pub enum Backend {
    /// Quantized weights as stored, SIMD kernels (`--device cpu`).
    Cpu(Box<CpuLlama>),
    /// Dequantized weights as candle tensors (`--device cuda:N`).
    Candle(CandleLlama),
}

/// How a model is loaded: settings of the CPU backend (the worker's
/// `--threads`, `--cpu-simd` and `--cpu-vnni`).
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Compute threads on the CPU (None: every core).
    pub threads: Option<usize>,
    /// Which CPU kernels run, narrowed to what the CPU has.
    pub cpu_kernels: CpuKernels,
}

impl Backend {
    /// Loads the weights for `device`: the CPU kernels on the CPU, candle on
    /// anything else.
    pub fn load<R: Read + Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
        device: &Device,
        opts: &LoadOptions,
    ) -> Result<Self, ModelError> {
        Ok(match device {
            Device::Cpu => {
                let threads = opts
                    .threads
                    .filter(|&n| n > 0)
                    .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
                let m = CpuLlama::load(content, reader, threads, opts.cpu_kernels)?;
                Backend::Cpu(Box::new(m))
            }
            _ => Backend::Candle(CandleLlama::load(content, reader, device)?),
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
            Backend::Cpu(m) => Ok(KvPool::host(
                m.config().kv_shape(),
                budget_bytes,
                block_size,
            )),
            Backend::Candle(m) => {
                KvPool::tensors(m.config().kv_shape(), budget_bytes, block_size, m.device())
            }
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
        Ok(Logits::new(values, vocab))
    }
}
