//! The candle backend: the llama forward pass on candle tensors (what
//! `--device cuda:N` runs; the CPU backend is `engine::cpu`, the shape and
//! the shared step types are `engine::model`).
//!
//! candle's own `quantized_llama` keeps one KV cache and one position for the
//! whole batch inside the model, which rules out continuous batching. This
//! forward pass takes several sequences at once, each with its own position
//! and cache: the tokens of all sequences are flattened into one matrix for the
//! projections (where the time goes), attention runs per sequence, and logits
//! are computed only for each sequence's last token.
//!
//! Weights are dequantized to f32 at load: candle's quantized kernels do not
//! batch, and on a GPU the dequantized weights cost memory, not speed.
use super::kv::{KvCache, KvPool};
use super::model::{
    check_dims, check_step, check_tensor_data, check_unimplemented, read_rope_frequencies, Arch,
    LlamaConfig, ModelError, SeqStep,
};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use std::io::{Read, Seek};

struct Layer {
    attn_norm: Tensor,
    /// q, k and v projections fused into one (q + 2 kv, hidden) matrix.
    wqkv: Tensor,
    /// Their biases, (q + 2 kv) values (qwen2).
    qkv_bias: Option<Tensor>,
    /// RMS norm weights of each query head and each key head (qwen3).
    qk_norm: Option<(Tensor, Tensor)>,
    wo: Tensor,
    ffn_norm: Tensor,
    /// gate and up projections fused into one (2 ffn, hidden) matrix.
    w_gate_up: Tensor,
    w_down: Tensor,
    ffn: usize,
}

/// A model of one of the llama-family architectures, ready to run.
pub struct CandleLlama {
    cfg: LlamaConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Tensor,
    /// Rotary frequencies, head_dim / 2 of them.
    inv_freq: Vec<f32>,
    device: Device,
}

/// Tensor `name`, checked to have `dims`, dequantized to f32 on `device`.
fn tensor<R: Read + Seek>(
    content: &gguf_file::Content,
    reader: &mut R,
    name: &str,
    dims: &[usize],
    device: &Device,
) -> Result<Tensor, ModelError> {
    check_dims(content, name, dims)?;
    Ok(content
        .tensor(reader, name, device)?
        .dequantize(device)?
        .to_dtype(DType::F32)?)
}

impl CandleLlama {
    /// Loads and dequantizes every weight of the model.
    pub fn load<R: Read + Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let cfg = LlamaConfig::from_gguf(content)?;
        check_tensor_data(content, reader)?;
        check_unimplemented(content)?;
        let (hidden, ffn, hd) = (cfg.hidden, cfg.ffn, cfg.head_dim);
        let (q_dim, kv_dim) = (cfg.q_dim(), cfg.kv_dim());
        let embed = tensor(
            content,
            reader,
            "token_embd.weight",
            &[cfg.vocab_size, hidden],
            device,
        )?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let mut t = |n: &str, dims: &[usize]| {
                tensor(content, reader, &format!("blk.{i}.{n}"), dims, device)
            };
            let has = |n: &str| content.tensor_infos.contains_key(&format!("blk.{i}.{n}"));
            // q, k and v in one matrix (phi3 files), or three.
            let wqkv = if has("attn_qkv.weight") {
                t("attn_qkv.weight", &[q_dim + 2 * kv_dim, hidden])?
            } else {
                Tensor::cat(
                    &[
                        t("attn_q.weight", &[q_dim, hidden])?,
                        t("attn_k.weight", &[kv_dim, hidden])?,
                        t("attn_v.weight", &[kv_dim, hidden])?,
                    ],
                    0,
                )?
            };
            // gate and up in one matrix, the gate's rows first (phi3), or two.
            let w_gate_up = if has("ffn_gate.weight") {
                Tensor::cat(
                    &[
                        t("ffn_gate.weight", &[ffn, hidden])?,
                        t("ffn_up.weight", &[ffn, hidden])?,
                    ],
                    0,
                )?
            } else {
                t("ffn_up.weight", &[2 * ffn, hidden])?
            };
            // The biases where the file has them (qwen2), zeros for a
            // missing one of three.
            let qkv_bias = if has("attn_qkv.bias") {
                Some(t("attn_qkv.bias", &[q_dim + 2 * kv_dim])?)
            } else {
                let parts = [
                    ("attn_q.bias", q_dim),
                    ("attn_k.bias", kv_dim),
                    ("attn_v.bias", kv_dim),
                ];
                if parts.iter().any(|(n, _)| has(n)) {
                    let mut all = Vec::with_capacity(3);
                    for (n, len) in parts {
                        all.push(if has(n) {
                            t(n, &[len])?
                        } else {
                            Tensor::zeros(len, DType::F32, device)?
                        });
                    }
                    Some(Tensor::cat(&all, 0)?)
                } else {
                    None
                }
            };
            let qk_norm = match cfg.arch {
                Arch::Qwen3 => Some((
                    t("attn_q_norm.weight", &[hd])?,
                    t("attn_k_norm.weight", &[hd])?,
                )),
                _ => None,
            };
            layers.push(Layer {
                attn_norm: t("attn_norm.weight", &[hidden])?,
                wqkv,
                qkv_bias,
                qk_norm,
                wo: t("attn_output.weight", &[hidden, q_dim])?,
                ffn_norm: t("ffn_norm.weight", &[hidden])?,
                w_gate_up,
                w_down: t("ffn_down.weight", &[hidden, ffn])?,
                ffn,
            });
        }
        let norm = tensor(content, reader, "output_norm.weight", &[hidden], device)?;
        // Tied embeddings (as in SmolLM2) have no separate output matrix.
        let lm_head = if content.tensor_infos.contains_key("output.weight") {
            let dims = [cfg.vocab_size, hidden];
            tensor(content, reader, "output.weight", &dims, device)?
        } else {
            embed.clone()
        };
        let inv_freq = read_rope_frequencies(&cfg, content, reader)?;
        Ok(Self {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
            device: device.clone(),
        })
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The model's shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Runs one step for several sequences and returns the logits of each
    /// sequence's last new token, shape (sequences, vocab).
    pub fn forward(&self, pool: &KvPool, batch: &mut [SeqStep<'_>]) -> Result<Tensor, ModelError> {
        let cfg = &self.cfg;
        let ids: Vec<u32> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let mut slots = Vec::with_capacity(batch.len());
        for s in batch.iter() {
            check_step(cfg, pool, s)?;
            // The same slots serve every layer.
            slots.push(pool.slots(s.cache, s.cache.len() + s.tokens.len())?);
        }
        let n_total = ids.len();
        let ids = Tensor::from_vec(ids, n_total, &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?;
        let (q_dim, kv_dim) = (cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim);
        for (li, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, cfg.rms_eps as f32)?;
            let mut qkv = h.matmul(&layer.wqkv.t()?)?;
            if let Some(bias) = &layer.qkv_bias {
                qkv = qkv.broadcast_add(bias)?;
            }
            let mut outs = Vec::with_capacity(batch.len());
            let mut row = 0;
            for (s, slots) in batch.iter().zip(&slots) {
                let n = s.tokens.len();
                let part = qkv.narrow(0, row, n)?;
                row += n;
                let q = part.narrow(1, 0, q_dim)?;
                let k = part.narrow(1, q_dim, kv_dim)?;
                let v = part.narrow(1, q_dim + kv_dim, kv_dim)?;
                outs.push(self.attention(pool, layer, q, k, v, li, s.cache, slots)?);
            }
            let attn = Tensor::cat(&outs, 0)?;
            x = (x + attn.matmul(&layer.wo.t()?)?)?;

            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, cfg.rms_eps as f32)?;
            let gu = h.matmul(&layer.w_gate_up.t()?)?;
            let gate = candle_nn::ops::silu(&gu.narrow(1, 0, layer.ffn)?)?;
            let up = gu.narrow(1, layer.ffn, layer.ffn)?;
            x = (x + (gate * up)?.matmul(&layer.w_down.t()?)?)?;
        }
        let mut last = Vec::with_capacity(batch.len());
        let mut end = 0u32;
        for s in batch.iter_mut() {
            end += s.tokens.len() as u32;
            last.push(end - 1);
            s.cache.advance(s.tokens.len());
        }
        let last = Tensor::from_vec(last, batch.len(), &self.device)?;
        let x = x.index_select(&last, 0)?;
        let x = candle_nn::ops::rms_norm(&x, &self.norm, cfg.rms_eps as f32)?;
        Ok(x.matmul(&self.lm_head.t()?)?)
    }

    /// Causal attention of one sequence's new rows against its whole cache.
    /// q: (n, heads * head_dim); k, v: (n, kv_heads * head_dim).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        pool: &KvPool,
        weights: &Layer,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: usize,
        cache: &KvCache,
        slots: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let cfg = &self.cfg;
        let n = q.dim(0)?;
        let pos = cache.len();
        let hd = cfg.head_dim;
        let to_heads = |t: Tensor, heads: usize| -> candle_core::Result<Tensor> {
            t.reshape((1, n, heads, hd))?.transpose(1, 2)?.contiguous()
        };
        let (cos, sin) = self.rotation(pos, n)?;
        let (mut q, mut k) = (to_heads(q, cfg.n_head)?, to_heads(k, cfg.n_kv_head)?);
        if let Some((qn, kn)) = &weights.qk_norm {
            let eps = cfg.rms_eps as f32;
            q = candle_nn::ops::rms_norm(&q, qn, eps)?;
            k = candle_nn::ops::rms_norm(&k, kn, eps)?;
        }
        type Rope = fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>;
        let rope: Rope = if cfg.arch.rope_halves() {
            candle_nn::rotary_emb::rope
        } else {
            candle_nn::rotary_emb::rope_i
        };
        let q = rope(&q, &cos, &sin)?;
        let k = rope(&k, &cos, &sin)?;
        // The pool stores rotated keys token-major, (n, kv_dim).
        let kv_dim = cfg.n_kv_head * hd;
        let k_rows = k.squeeze(0)?.transpose(0, 1)?.reshape((n, kv_dim))?;
        pool.write(layer, cache, pos, &k_rows, &v.contiguous()?)?;
        let total = pos + n;
        let (k, v) = pool.gather(layer, slots)?;
        let from_rows = |t: Tensor| -> candle_core::Result<Tensor> {
            t.reshape((total, cfg.n_kv_head, hd))?
                .transpose(0, 1)?
                .contiguous()
        };
        let (k, v) = (from_rows(k)?, from_rows(v)?);
        // Grouped-query attention without copying keys: the query heads that
        // share a kv head are stacked as extra rows against that head.
        let rep = cfg.n_head / cfg.n_kv_head;
        let q = q.reshape((cfg.n_kv_head, rep * n, hd))?;
        let k = k.reshape((cfg.n_kv_head, total, hd))?;
        let v = v.reshape((cfg.n_kv_head, total, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut scores = (q.matmul(&k.t()?)? * scale)?;
        if n > 1 {
            let mask = causal_mask(n, pos, &self.device)?;
            scores = scores
                .reshape((cfg.n_kv_head, rep, n, total))?
                .broadcast_add(&mask)?
                .reshape((cfg.n_kv_head, rep * n, total))?;
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = probs.matmul(&v)?; // (kv_heads, rep * n, hd)
        let out = out
            .reshape((cfg.n_head, n, hd))?
            .transpose(0, 1)?
            .reshape((n, cfg.n_head * hd))?;
        Ok(out)
    }

    /// cos and sin, (n, head_dim / 2), of positions pos..pos + n (computed
    /// per step: a table over the whole context would grow with it).
    fn rotation(&self, pos: usize, n: usize) -> Result<(Tensor, Tensor), ModelError> {
        let half = self.inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(n * half), Vec::with_capacity(n * half));
        for p in pos..pos + n {
            for f in &self.inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        Ok((
            Tensor::from_vec(cos, (n, half), &self.device)?,
            Tensor::from_vec(sin, (n, half), &self.device)?,
        ))
    }

    /// Embedding row count (the vocabulary size).
    pub fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }
}

/// (n, pos + n) additive mask: row i (absolute position pos + i) sees columns 0..=pos + i.
fn causal_mask(n: usize, pos: usize, device: &Device) -> Result<Tensor, ModelError> {
    let total = pos + n;
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..total).map(move |j| if j > pos + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Ok(Tensor::from_vec(mask, (n, total), device)?)
}
