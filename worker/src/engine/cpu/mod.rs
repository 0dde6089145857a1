//! The CPU backend: the forward pass of the llama-family architectures
//! (`model::Arch`) over the GGUF file's quantized weights as they are, with
//! SIMD kernels of our own.
//!
//! candle's CPU path could not do this well: its Q4_1 dot product is a scalar
//! loop that runs one activation row at a time, so the first engine
//! dequantized every weight to f32 (four to eight times the bytes to read per
//! token, and the resident memory to match) and spent much of each step in
//! per-operation allocation. Here the weights stay in their blocks, every
//! projection is one batched quantized product (a weight block is read once
//! for all of a step's tokens), attention reads keys and values in place from
//! the KV pool's blocks, row-wise steps (norms, the SiLU gate) are fused into
//! the quantization of the next product's input, and the large buffers are
//! reused from step to step. The compute threads are our own fork-join pool
//! (`threads`), tuned for a step's many short parallel regions.
#[allow(unsafe_code)]
mod attention;
pub mod kernels;
#[allow(unsafe_code)]
pub mod matmul;
pub mod quant;
#[allow(unsafe_code)]
mod rows;
#[allow(unsafe_code)]
mod threads;
// The tiles index several per-row arrays with one counter.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code, clippy::needless_range_loop)]
mod x86;

use super::kv::KvPool;
use super::model::{
    check_dims, check_step, check_tensor_data, check_unimplemented, read_rope_frequencies,
    read_vector, Arch, LlamaConfig, ModelError, SeqStep,
};
use attention::{Heads, SeqRows};
use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::Device;
pub use kernels::CpuKernels;
use matmul::{Acts, Blocks, Linear, QMatrix};
use quant::QK;
use std::io::{Read, Seek, SeekFrom};
use std::sync::Mutex;
use threads::ComputePool;

struct Layer {
    attn_norm: Vec<f32>,
    /// q, k and v projections, fused where their formats match.
    wqkv: Linear,
    /// Biases of the q, k and v projections, in the order of wqkv's output
    /// (qwen2), where the file has them.
    qkv_bias: Option<Vec<f32>>,
    /// RMS norm weights of each query head and each key head (qwen3).
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    wo: Linear,
    ffn_norm: Vec<f32>,
    /// gate and up projections, fused where their formats match.
    w_gate_up: Linear,
    w_down: Linear,
}

/// Buffers reused from step to step.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    /// The input rows of the next projection, in the formats it reads.
    qa: Acts,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gu: Vec<f32>,
    logits: Vec<f32>,
    /// cos and sin of each row's position and each rotary frequency.
    rope: Vec<(f32, f32)>,
}

/// A model of one of the llama-family architectures on the CPU kernels.
pub struct CpuLlama {
    cfg: LlamaConfig,
    embed: QMatrix,
    /// None when the output matrix is the embedding (tied weights).
    lm_head: Option<QMatrix>,
    norm: Vec<f32>,
    layers: Vec<Layer>,
    /// Rotary frequencies, head_dim / 2 of them.
    inv_freq: Vec<f32>,
    /// Rotary pairs are (i, i + head_dim / 2), not (2i, 2i + 1).
    rope_halves: bool,
    scratch: Mutex<Scratch>,
    /// The compute threads (the engine thread and helpers).
    threads: ComputePool,
}

/// The stored bytes of tensor `name`.
fn read_raw<R: Read + Seek>(
    content: &gguf_file::Content,
    reader: &mut R,
    name: &str,
) -> Result<Vec<u8>, ModelError> {
    let info = content
        .tensor_infos
        .get(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    let elems = info.shape.elem_count();
    let dtype = info.ggml_dtype;
    let mut buf = vec![0u8; elems / dtype.block_size() * dtype.type_size()];
    reader
        .seek(SeekFrom::Start(content.tensor_data_offset + info.offset))
        .and_then(|_| reader.read_exact(&mut buf))
        .map_err(|e| ModelError::Candle(candle_core::Error::Msg(format!("reading {name}: {e}"))))?;
    Ok(buf)
}

/// Tensor types the kernels do not run, and how many tensors of each were
/// requantized to Q8_0 at load.
type Fallbacks = std::collections::BTreeMap<String, usize>;

/// A 2-D weight in a format the kernels run: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
/// Q4_K, Q5_K, Q6_K, F16, BF16 and F32 as stored; any rarer type (Q2_K,
/// Q3_K, Q8_1, ...) requantized to Q8_0 (8 bits per weight loses next to
/// nothing, but costs memory), counted in `fallbacks`.
fn matrix<R: Read + Seek>(
    content: &gguf_file::Content,
    reader: &mut R,
    fallbacks: &mut Fallbacks,
    name: &str,
) -> Result<QMatrix, ModelError> {
    let info = content
        .tensor_infos
        .get(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    let dims = info.shape.dims().to_vec();
    let [rows, cols] = dims[..] else {
        return Err(ModelError::Shape {
            name: name.to_string(),
            why: format!("shape {dims:?}, expected 2 dimensions"),
        });
    };
    let dtype = info.ggml_dtype;
    let block = dtype.block_size().max(QK);
    if cols % block != 0 {
        return Err(ModelError::Shape {
            name: name.to_string(),
            why: format!(
                "rows of {cols} values; the CPU kernels need a multiple of {block} for {dtype:?}"
            ),
        });
    }
    let mut raw = || read_raw(content, reader, name);
    let blocks = match dtype {
        GgmlDType::Q4_0 => Blocks::Q4_0(quant::parse_q4_0(&raw()?)),
        GgmlDType::Q4_1 => Blocks::Q4_1(quant::parse_q4_1(&raw()?)),
        GgmlDType::Q5_0 => Blocks::Q5_0(quant::parse_q5_0(&raw()?)),
        GgmlDType::Q5_1 => Blocks::Q5_1(quant::parse_q5_1(&raw()?)),
        GgmlDType::Q8_0 => Blocks::Q8_0(quant::parse_q8_0(&raw()?)),
        GgmlDType::Q4K => Blocks::Q4K(quant::parse_q4_k(&raw()?)),
        GgmlDType::Q5K => Blocks::Q5K(quant::parse_q5_k(&raw()?)),
        GgmlDType::Q6K => Blocks::Q6K(quant::parse_q6_k(&raw()?)),
        GgmlDType::F16 => Blocks::F16(quant::parse_f16(&raw()?)),
        GgmlDType::BF16 => Blocks::Bf16(quant::parse_bf16(&raw()?)),
        GgmlDType::F32 => Blocks::F32(quant::parse_f32(&raw()?)),
        other => {
            let dense = content
                .tensor(reader, name, &Device::Cpu)?
                .dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            *fallbacks.entry(format!("{other:?}")).or_default() += 1;
            Blocks::Q8_0(quant::quantize_q8_0(&dense))
        }
    };
    Ok(QMatrix { rows, cols, blocks })
}

/// A weight of `rows` rows of `cols` values, checked against the file.
fn matrix_of<R: Read + Seek>(
    content: &gguf_file::Content,
    reader: &mut R,
    tally: &mut Tally,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<QMatrix, ModelError> {
    check_dims(content, name, &[rows, cols])?;
    let m = matrix(content, reader, &mut tally.fallbacks, name)?;
    *tally.formats.entry(m.blocks.name()).or_default() += 1;
    Ok(m)
}

/// What loading the matrices found, for the start-up log: the formats kept
/// as stored and the types requantized.
#[derive(Default)]
struct Tally {
    fallbacks: Fallbacks,
    formats: std::collections::BTreeMap<&'static str, usize>,
}

/// A 1-D tensor of `len` values as f32.
fn vector<R: Read + Seek>(
    content: &gguf_file::Content,
    reader: &mut R,
    name: &str,
    len: usize,
) -> Result<Vec<f32>, ModelError> {
    check_dims(content, name, &[len])?;
    read_vector(content, reader, name)?.ok_or_else(|| ModelError::MissingTensor(name.to_string()))
}

/// Reads a layer's 1-D tensor by name, checked to have a length.
type VectorReader<'a> = dyn FnMut(&str, usize) -> Result<Vec<f32>, ModelError> + 'a;

/// The q, k and v biases of a layer, in the order of its qkv output: one
/// `attn_qkv.bias`, or any of `attn_q.bias`, `attn_k.bias` and `attn_v.bias`
/// (zeros for one that is missing); None where the layer has none (llama
/// files, usually) or all are missing.
fn qkv_bias(
    has: &dyn Fn(&str) -> bool,
    v: &mut VectorReader<'_>,
    q_dim: usize,
    kv_dim: usize,
) -> Result<Option<Vec<f32>>, ModelError> {
    if has("attn_qkv.bias") {
        return Ok(Some(v("attn_qkv.bias", q_dim + 2 * kv_dim)?));
    }
    let parts = [
        ("attn_q.bias", q_dim),
        ("attn_k.bias", kv_dim),
        ("attn_v.bias", kv_dim),
    ];
    if !parts.iter().any(|(n, _)| has(n)) {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(q_dim + 2 * kv_dim);
    for (n, len) in parts {
        if has(n) {
            out.extend(v(n, len)?);
        } else {
            out.resize(out.len() + len, 0.0);
        }
    }
    Ok(Some(out))
}

impl CpuLlama {
    /// Reads the weights, keeping every type the kernels run as stored (see
    /// `matrix`), laid out for `kernels`, and starts `threads` compute threads (the caller's
    /// included).
    pub fn load<R: Read + Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
        threads: usize,
        kernels: CpuKernels,
    ) -> Result<Self, ModelError> {
        let cfg = LlamaConfig::from_gguf(content)?;
        check_tensor_data(content, reader)?;
        check_unimplemented(content)?;
        let (hidden, ffn, hd) = (cfg.hidden, cfg.ffn, cfg.head_dim);
        let (q_dim, kv_dim) = (cfg.q_dim(), cfg.kv_dim());
        let mut tally = Tally::default();
        let embed = matrix_of(
            content,
            reader,
            &mut tally,
            "token_embd.weight",
            cfg.vocab_size,
            hidden,
        )?
        .interleaved(kernels);
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let name = |n: &str| format!("blk.{i}.{n}");
            let mut m =
                |n: &str, rows, cols| matrix_of(content, reader, &mut tally, &name(n), rows, cols);
            let fused = |parts| Linear::fused(parts, kernels);
            let has = |n: &str| content.tensor_infos.contains_key(&name(n));
            // q, k and v in one matrix (phi3 files), or three.
            let wqkv = if has("attn_qkv.weight") {
                fused(vec![m("attn_qkv.weight", q_dim + 2 * kv_dim, hidden)?])
            } else {
                fused(vec![
                    m("attn_q.weight", q_dim, hidden)?,
                    m("attn_k.weight", kv_dim, hidden)?,
                    m("attn_v.weight", kv_dim, hidden)?,
                ])
            };
            // gate and up in one matrix, the gate's rows first (phi3), or two.
            let w_gate_up = if has("ffn_gate.weight") {
                fused(vec![
                    m("ffn_gate.weight", ffn, hidden)?,
                    m("ffn_up.weight", ffn, hidden)?,
                ])
            } else {
                fused(vec![m("ffn_up.weight", 2 * ffn, hidden)?])
            };
            let wo = fused(vec![m("attn_output.weight", hidden, q_dim)?]);
            let w_down = fused(vec![m("ffn_down.weight", hidden, ffn)?]);
            let mut v = |n: &str, len| vector(content, reader, &name(n), len);
            let qkv_bias = qkv_bias(&has, &mut v, q_dim, kv_dim)?;
            let qk_norm = match cfg.arch {
                Arch::Qwen3 => Some((v("attn_q_norm.weight", hd)?, v("attn_k_norm.weight", hd)?)),
                _ => None,
            };
            layers.push(Layer {
                attn_norm: v("attn_norm.weight", hidden)?,
                ffn_norm: v("ffn_norm.weight", hidden)?,
                wqkv,
                qkv_bias,
                qk_norm,
                wo,
                w_gate_up,
                w_down,
            });
        }
        let norm = vector(content, reader, "output_norm.weight", hidden)?;
        // Tied embeddings (as in SmolLM2) have no separate output matrix.
        let lm_head = if content.tensor_infos.contains_key("output.weight") {
            Some(
                matrix_of(
                    content,
                    reader,
                    &mut tally,
                    "output.weight",
                    cfg.vocab_size,
                    hidden,
                )?
                .interleaved(kernels),
            )
        } else {
            None
        };
        let inv_freq = read_rope_frequencies(&cfg, content, reader)?;
        let rope_halves = cfg.arch.rope_halves();
        let model = Self {
            cfg,
            embed,
            lm_head,
            norm,
            layers,
            inv_freq,
            rope_halves,
            scratch: Mutex::default(),
            threads: ComputePool::new(threads, kernels)
                .map_err(|e| ModelError::Backend(format!("starting compute threads: {e}")))?,
        };
        tracing::info!(
            weights_mib = model.weight_bytes() >> 20,
            threads = model.threads.threads(),
            simd = kernels.simd(),
            vnni = kernels.vnni(),
            "CPU kernels: quantized weights loaded"
        );
        let formats: Vec<String> = tally
            .formats
            .iter()
            .map(|(f, n)| format!("{f}: {n}"))
            .collect();
        tracing::info!(matrices = %formats.join(", "), "CPU kernels: weight formats kept as stored");
        for (dtype, tensors) in &tally.fallbacks {
            // The documented fallback for types without kernels of their own.
            tracing::warn!(
                tensors,
                "CPU kernels: {dtype} weights have no kernels here; requantized to Q8_0 at load"
            );
        }
        Ok(model)
    }

    /// The model's shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The kernels this model runs.
    pub fn kernels(&self) -> CpuKernels {
        self.threads.kernels()
    }

    /// Bytes the weights take in memory.
    pub fn weight_bytes(&self) -> usize {
        self.embed.bytes()
            + self.lm_head.as_ref().map_or(0, QMatrix::bytes)
            + self
                .layers
                .iter()
                .map(|l| l.wqkv.bytes() + l.wo.bytes() + l.w_gate_up.bytes() + l.w_down.bytes())
                .sum::<usize>()
    }

    /// Runs one step for several sequences and returns the logits of each
    /// sequence's last new token, one row per sequence, flattened.
    pub fn forward(
        &self,
        pool: &mut KvPool,
        batch: &mut [SeqStep<'_>],
    ) -> Result<Vec<f32>, ModelError> {
        let mut slots: Vec<Vec<usize>> = Vec::with_capacity(batch.len());
        for s in batch.iter() {
            let total = s.cache.len() + s.tokens.len();
            check_step(&self.cfg, pool, s)?;
            slots.push((0..total).map(|p| pool.slot(s.cache, p)).collect());
        }
        let mut seqs = Vec::with_capacity(batch.len());
        let mut row = 0;
        for (s, sl) in batch.iter().zip(&slots) {
            let n = s.tokens.len();
            seqs.push(SeqRows {
                rows: row..row + n,
                pos0: s.cache.len(),
                slots: sl,
            });
            row += n;
        }

        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let sc = &mut *guard;
        self.prepare(sc, &seqs, row);
        self.embed(batch, &mut sc.x)?;
        for (li, layer) in self.layers.iter().enumerate() {
            self.layer(li, layer, sc, &seqs, pool)?;
        }
        self.head(sc, &seqs);
        for s in batch.iter_mut() {
            s.cache.advance(s.tokens.len());
        }
        Ok(sc.logits.clone())
    }

    /// Sizes the step's buffers for `n` rows and computes each row's rotation.
    fn prepare(&self, sc: &mut Scratch, seqs: &[SeqRows<'_>], n: usize) {
        let cfg = &self.cfg;
        let (q_dim, kv_dim, ffn) = (cfg.q_dim(), cfg.kv_dim(), cfg.ffn);
        sc.x.resize(n * cfg.hidden, 0.0);
        sc.qkv.resize(n * (q_dim + 2 * kv_dim), 0.0);
        sc.attn.resize(n * q_dim, 0.0);
        sc.proj.resize(n * cfg.hidden, 0.0);
        sc.gu.resize(n * 2 * ffn, 0.0);
        // Each row's rotation, computed once for all layers (a table over
        // the whole context would grow with it).
        sc.rope.clear();
        for s in seqs {
            for pos in s.pos0..s.pos0 + s.rows.len() {
                sc.rope.extend(self.inv_freq.iter().map(|f| {
                    let a = pos as f32 * f;
                    (a.cos(), a.sin())
                }));
            }
        }
    }

    /// The embedding rows of every new token, into `x`.
    fn embed(&self, batch: &[SeqStep<'_>], x: &mut [f32]) -> Result<(), ModelError> {
        let hidden = self.cfg.hidden;
        let mut r = 0;
        for s in batch {
            for &t in s.tokens {
                if t as usize >= self.embed.rows {
                    return Err(ModelError::TokenOutOfRange {
                        token: t,
                        vocab: self.embed.rows,
                    });
                }
                self.embed
                    .row(t as usize, &mut x[r * hidden..(r + 1) * hidden]);
                r += 1;
            }
        }
        Ok(())
    }

    /// Layer `li` over every row of the step: attention (writing the new
    /// keys and values into the pool), then the feed-forward block.
    fn layer(
        &self,
        li: usize,
        layer: &Layer,
        sc: &mut Scratch,
        seqs: &[SeqRows<'_>],
        pool: &mut KvPool,
    ) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let hd = cfg.head_dim;
        let (q_dim, kv_dim) = (cfg.q_dim(), cfg.kv_dim());
        let qkv_ld = q_dim + 2 * kv_dim;
        let n = sc.x.len() / cfg.hidden;
        let eps = cfg.rms_eps as f32;
        let needs = layer.wqkv.needs();
        rows::norm_quantize(
            &self.threads,
            &sc.x,
            &layer.attn_norm,
            eps,
            needs,
            &mut sc.qa,
        );
        layer.wqkv.forward(&self.threads, &sc.qa, n, &mut sc.qkv);

        let (keys, values) = pool
            .host_layer_mut(li)
            .ok_or_else(|| ModelError::Backend("the KV pool is not in host memory".into()))?;
        let half = hd / 2;
        for s in seqs {
            for (i, row) in s.rows.clone().enumerate() {
                let pos = s.pos0 + i;
                let line = &mut sc.qkv[row * qkv_ld..(row + 1) * qkv_ld];
                if let Some(bias) = &layer.qkv_bias {
                    add_into(line, bias);
                }
                if let Some((qn, kn)) = &layer.qk_norm {
                    let (q, k) = line[..q_dim + kv_dim].split_at_mut(q_dim);
                    head_norms(q, qn, eps);
                    head_norms(k, kn, eps);
                }
                let rot = &sc.rope[row * half..(row + 1) * half];
                if self.rope_halves {
                    rope_halves(&mut line[..q_dim + kv_dim], hd, rot);
                } else {
                    rope(&mut line[..q_dim + kv_dim], hd, rot);
                }
                let slot = s.slots[pos];
                keys[slot * kv_dim..(slot + 1) * kv_dim]
                    .copy_from_slice(&line[q_dim..q_dim + kv_dim]);
                values[slot * kv_dim..(slot + 1) * kv_dim].copy_from_slice(&line[q_dim + kv_dim..]);
            }
        }
        let (keys, values) = pool.host_layer(li).expect("host pool");
        let heads = Heads {
            n_head: cfg.n_head,
            n_kv_head: cfg.n_kv_head,
            head_dim: hd,
        };
        attention::attend(
            &self.threads,
            seqs,
            heads,
            &sc.qkv,
            qkv_ld,
            keys,
            values,
            &mut sc.attn,
        );
        rows::quantize(&self.threads, &sc.attn, q_dim, layer.wo.needs(), &mut sc.qa);
        layer.wo.forward(&self.threads, &sc.qa, n, &mut sc.proj);
        add_into(&mut sc.x, &sc.proj);

        let ffn = layer.w_down.cols;
        let needs = layer.w_gate_up.needs();
        rows::norm_quantize(
            &self.threads,
            &sc.x,
            &layer.ffn_norm,
            eps,
            needs,
            &mut sc.qa,
        );
        layer
            .w_gate_up
            .forward(&self.threads, &sc.qa, n, &mut sc.gu);
        let needs = layer.w_down.needs();
        rows::silu_mul_quantize(&self.threads, &sc.gu, ffn, needs, &mut sc.qa);
        layer.w_down.forward(&self.threads, &sc.qa, n, &mut sc.proj);
        add_into(&mut sc.x, &sc.proj);
        Ok(())
    }

    /// The logits of each sequence's last row (only those predict anything),
    /// into `sc.logits`.
    fn head(&self, sc: &mut Scratch, seqs: &[SeqRows<'_>]) {
        let hidden = self.cfg.hidden;
        let m = seqs.len();
        let mut last = vec![0f32; m * hidden];
        for (s, dst) in seqs.iter().zip(last.chunks_exact_mut(hidden)) {
            let r = s.rows.end - 1;
            dst.copy_from_slice(&sc.x[r * hidden..(r + 1) * hidden]);
        }
        let eps = self.cfg.rms_eps as f32;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        rows::norm_quantize(
            &self.threads,
            &last,
            &self.norm,
            eps,
            head.needs(),
            &mut sc.qa,
        );
        sc.logits.resize(m * head.rows, 0.0);
        head.matmul(&self.threads, &sc.qa, m, &mut sc.logits, head.rows, 0);
    }
}

/// Rotates every head of `line` (query heads, then key heads) by `rot`, the
/// (cos, sin) of each frequency at the row's position: interleaved pairs, the
/// layout GGUF llama weights are permuted for.
fn rope(line: &mut [f32], head_dim: usize, rot: &[(f32, f32)]) {
    for head in line.chunks_exact_mut(head_dim) {
        for (pair, &(c, s)) in head.chunks_exact_mut(2).zip(rot) {
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * c - b * s;
            pair[1] = a * s + b * c;
        }
    }
}

/// Rotates every head of `line` as `rope` does, pairing dimension i with
/// i + head_dim / 2 (llama.cpp's NEOX layout, which qwen and phi use).
fn rope_halves(line: &mut [f32], head_dim: usize, rot: &[(f32, f32)]) {
    let half = head_dim / 2;
    for head in line.chunks_exact_mut(head_dim) {
        let (lo, hi) = head.split_at_mut(half);
        for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(rot) {
            let (x, y) = (*a, *b);
            *a = x * c - y * s;
            *b = x * s + y * c;
        }
    }
}

/// RMS norm of each head of `line` (heads of `weight.len()` values), scaled
/// by `weight`.
fn head_norms(line: &mut [f32], weight: &[f32], eps: f32) {
    for head in line.chunks_exact_mut(weight.len()) {
        let ss: f32 = head.iter().map(|v| v * v).sum();
        let scale = 1.0 / (ss / weight.len() as f32 + eps).sqrt();
        for (v, &w) in head.iter_mut().zip(weight) {
            *v *= scale * w;
        }
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
