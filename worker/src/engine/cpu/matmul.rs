//! Weight matrices in the file's own formats and their product with a batch
//! of activation rows, split over the compute threads by weight rows.
//!
//! Each format reads its activations in the form its kernels multiply: the
//! 32-value block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) 8-bit blocks of 32
//! (`BlockQ8A`), the K-quants (Q4_K, Q5_K, Q6_K) 8-bit blocks of 256
//! (`BlockQ8K`), and the float formats (F16, BF16, F32) the f32 values
//! themselves: half- and full-precision weights are chosen for accuracy, and
//! rounding their activations to 8 bits would throw it away.
use super::kernels::CpuKernels;
use super::quant::{
    self, Bf16Bits, BlockQ4K, BlockQ4_0, BlockQ4_0x8, BlockQ4_1, BlockQ4_1x8, BlockQ5K, BlockQ5_0,
    BlockQ5_0x8, BlockQ5_1, BlockQ5_1x8, BlockQ6K, BlockQ8A, BlockQ8K, BlockQ8_0, BlockQ8_0x8,
    F16Bits, QK, QK_K,
};
use super::threads::{ComputePool, Parts};
use std::ops::Range;

/// The activation formats a projection's matrices read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// 8-bit blocks of 32 (`BlockQ8A`).
    pub q8: bool,
    /// 8-bit blocks of 256 (`BlockQ8K`).
    pub q8k: bool,
    /// f32 values.
    pub float: bool,
}

impl Needs {
    /// The formats either needs.
    pub fn union(self, other: Needs) -> Needs {
        Needs {
            q8: self.q8 || other.q8,
            q8k: self.q8k || other.q8k,
            float: self.float || other.float,
        }
    }
}

/// A batch of activation rows (one projection's input) in each format its
/// matrices read (`Needs`); the other formats stay empty. The buffers are
/// reused from step to step.
#[derive(Default)]
pub struct Acts {
    /// Rows in the batch.
    pub rows: usize,
    /// Values per row.
    pub width: usize,
    /// `rows * width / 32` blocks, when needed.
    pub q8: Vec<BlockQ8A>,
    /// `rows * width / 256` blocks, when needed.
    pub q8k: Vec<BlockQ8K>,
    /// `rows * width` values, when needed.
    pub float: Vec<f32>,
}

impl Acts {
    /// Sizes the buffers for `rows` rows of `width` values in the formats
    /// `needs` names (the others emptied, keeping their capacity).
    pub fn shape(&mut self, rows: usize, width: usize, needs: Needs) {
        let (all, q8, q8k) = (rows * width, needs.q8, needs.q8k);
        self.rows = rows;
        self.width = width;
        self.q8
            .resize(if q8 { all / QK } else { 0 }, BlockQ8A::default());
        self.q8k
            .resize(if q8k { all / QK_K } else { 0 }, BlockQ8K::default());
        self.float.resize(if needs.float { all } else { 0 }, 0.0);
    }
}

/// A matrix's weights, row-major, in one of the formats the kernels run.
#[derive(Clone)]
pub enum Blocks {
    Q4_0(Vec<BlockQ4_0>),
    Q4_1(Vec<BlockQ4_1>),
    Q5_0(Vec<BlockQ5_0>),
    Q5_1(Vec<BlockQ5_1>),
    Q8_0(Vec<BlockQ8_0>),
    /// Groups of eight rows interleaved (`quant::BlockQ4_0x8`), group-major.
    Q4_0x8(Vec<BlockQ4_0x8>),
    /// Groups of eight rows interleaved (`quant::BlockQ4_1x8`), group-major.
    Q4_1x8(Vec<BlockQ4_1x8>),
    /// Groups of eight rows interleaved (`quant::BlockQ5_0x8`), group-major.
    Q5_0x8(Vec<BlockQ5_0x8>),
    /// Groups of eight rows interleaved (`quant::BlockQ5_1x8`), group-major.
    Q5_1x8(Vec<BlockQ5_1x8>),
    /// Groups of eight rows interleaved (`quant::BlockQ8_0x8`), group-major.
    Q8_0x8(Vec<BlockQ8_0x8>),
    Q4K(Vec<BlockQ4K>),
    Q5K(Vec<BlockQ5K>),
    Q6K(Vec<BlockQ6K>),
    F16(Vec<F16Bits>),
    Bf16(Vec<Bf16Bits>),
    F32(Vec<f32>),
}

/// Runs `$body` with `$w` bound to the vector of whichever variant `$blocks` is.
macro_rules! each_format {
    ($blocks:expr, $w:ident => $body:expr) => {
        match $blocks {
            Blocks::Q4_0($w) => $body,
            Blocks::Q4_1($w) => $body,
            Blocks::Q5_0($w) => $body,
            Blocks::Q5_1($w) => $body,
            Blocks::Q8_0($w) => $body,
            Blocks::Q4_0x8($w) => $body,
            Blocks::Q4_1x8($w) => $body,
            Blocks::Q5_0x8($w) => $body,
            Blocks::Q5_1x8($w) => $body,
            Blocks::Q8_0x8($w) => $body,
            Blocks::Q4K($w) => $body,
            Blocks::Q5K($w) => $body,
            Blocks::Q6K($w) => $body,
            Blocks::F16($w) => $body,
            Blocks::Bf16($w) => $body,
            Blocks::F32($w) => $body,
        }
    };
}

impl Blocks {
    /// Values per block: 32, 256 for the K-quants, 1 for the float formats.
    pub fn block_values(&self) -> usize {
        match self {
            Blocks::Q4K(_) | Blocks::Q5K(_) | Blocks::Q6K(_) => QK_K,
            Blocks::F16(_) | Blocks::Bf16(_) | Blocks::F32(_) => 1,
            _ => QK,
        }
    }

    /// The activation format the format's kernels read.
    pub fn needs(&self) -> Needs {
        match self.block_values() {
            QK_K => Needs {
                q8k: true,
                ..Needs::default()
            },
            1 => Needs {
                float: true,
                ..Needs::default()
            },
            _ => Needs {
                q8: true,
                ..Needs::default()
            },
        }
    }

    /// The format's name as GGML spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Blocks::Q4_0(_) | Blocks::Q4_0x8(_) => "Q4_0",
            Blocks::Q4_1(_) | Blocks::Q4_1x8(_) => "Q4_1",
            Blocks::Q5_0(_) | Blocks::Q5_0x8(_) => "Q5_0",
            Blocks::Q5_1(_) | Blocks::Q5_1x8(_) => "Q5_1",
            Blocks::Q8_0(_) | Blocks::Q8_0x8(_) => "Q8_0",
            Blocks::Q4K(_) => "Q4_K",
            Blocks::Q5K(_) => "Q5_K",
            Blocks::Q6K(_) => "Q6_K",
            Blocks::F16(_) => "F16",
            Blocks::Bf16(_) => "BF16",
            Blocks::F32(_) => "F32",
        }
    }

    fn interleaved(&self) -> bool {
        matches!(
            self,
            Blocks::Q4_0x8(_)
                | Blocks::Q4_1x8(_)
                | Blocks::Q5_0x8(_)
                | Blocks::Q5_1x8(_)
                | Blocks::Q8_0x8(_)
        )
    }
}

/// A (rows, cols) weight matrix; `cols` is a multiple of 32 (of 256 for the
/// K-quants).
#[derive(Clone)]
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub blocks: Blocks,
}

impl QMatrix {
    /// Blocks per row (values, for the float formats).
    pub fn row_blocks(&self) -> usize {
        self.cols / self.blocks.block_values()
    }

    /// The activation format this matrix reads.
    pub fn needs(&self) -> Needs {
        self.blocks.needs()
    }

    /// Bytes the blocks take in memory.
    pub fn bytes(&self) -> usize {
        each_format!(&self.blocks, b => std::mem::size_of_val(b.as_slice()))
    }

    /// Row `r`, dequantized (an embedding lookup).
    pub fn row(&self, r: usize, out: &mut [f32]) {
        let kb = self.row_blocks();
        let blocks = r * kb..(r + 1) * kb;
        macro_rules! plain {
            ($b:expr, $f:path, $n:expr) => {
                for (blk, o) in $b[blocks].iter().zip(out.chunks_exact_mut($n)) {
                    $f(blk, o)
                }
            };
        }
        macro_rules! lanes {
            ($b:expr, $lane:path, $f:path) => {
                for (blk, o) in lane_row($b, kb, r, $lane).zip(out.chunks_exact_mut(QK)) {
                    $f(&blk, o)
                }
            };
        }
        match &self.blocks {
            Blocks::Q4_0(b) => plain!(b, quant::dequantize_q4_0, QK),
            Blocks::Q4_1(b) => plain!(b, quant::dequantize_q4_1, QK),
            Blocks::Q5_0(b) => plain!(b, quant::dequantize_q5_0, QK),
            Blocks::Q5_1(b) => plain!(b, quant::dequantize_q5_1, QK),
            Blocks::Q8_0(b) => plain!(b, quant::dequantize_q8_0, QK),
            Blocks::Q4_0x8(b) => lanes!(b, quant::lane_q4_0, quant::dequantize_q4_0),
            Blocks::Q4_1x8(b) => lanes!(b, quant::lane_q4_1, quant::dequantize_q4_1),
            Blocks::Q5_0x8(b) => lanes!(b, quant::lane_q5_0, quant::dequantize_q5_0),
            Blocks::Q5_1x8(b) => lanes!(b, quant::lane_q5_1, quant::dequantize_q5_1),
            Blocks::Q8_0x8(b) => lanes!(b, quant::lane_q8_0, quant::dequantize_q8_0),
            Blocks::Q4K(b) => plain!(b, quant::dequantize_q4_k, QK_K),
            Blocks::Q5K(b) => plain!(b, quant::dequantize_q5_k, QK_K),
            Blocks::Q6K(b) => plain!(b, quant::dequantize_q6_k, QK_K),
            Blocks::F16(b) => {
                for (o, h) in out.iter_mut().zip(&b[blocks]) {
                    *o = quant::f16_to_f32(h.0);
                }
            }
            Blocks::Bf16(b) => {
                for (o, h) in out.iter_mut().zip(&b[blocks]) {
                    *o = quant::bf16_to_f32(h.0);
                }
            }
            Blocks::F32(b) => out[..kb].copy_from_slice(&b[blocks]),
        }
    }

    /// The same matrix with groups of eight rows interleaved for the SIMD
    /// kernels (the last group padded), where `kernels` run them and the
    /// format has an interleaved layout; else unchanged.
    pub fn interleaved(self, kernels: CpuKernels) -> QMatrix {
        if !kernels.simd() {
            return self;
        }
        let kb = self.row_blocks();
        let blocks = match self.blocks {
            Blocks::Q4_0(b) => Blocks::Q4_0x8(quant::interleave_q4_0(&b, kb)),
            Blocks::Q4_1(b) => Blocks::Q4_1x8(quant::interleave_q4_1(&b, kb)),
            Blocks::Q5_0(b) => Blocks::Q5_0x8(quant::interleave_q5_0(&b, kb)),
            Blocks::Q5_1(b) => Blocks::Q5_1x8(quant::interleave_q5_1(&b, kb)),
            Blocks::Q8_0(b) => Blocks::Q8_0x8(quant::interleave_q8_0(&b, kb)),
            other => other,
        };
        QMatrix { blocks, ..self }
    }

    /// Rows per unit of work: eight for interleaved groups, else one.
    fn unit(&self) -> usize {
        if self.blocks.interleaved() {
            8
        } else {
            1
        }
    }

    /// Stacks matrices with the same columns and format into one (fused
    /// projections: one pass over the activations, one parallel region).
    pub fn stack(parts: Vec<QMatrix>) -> Option<QMatrix> {
        let mut parts = parts.into_iter();
        let mut stacked = parts.next()?;
        if stacked.blocks.interleaved() {
            return None;
        }
        for p in parts {
            if p.cols != stacked.cols {
                return None;
            }
            macro_rules! extend {
                ($($v:ident),*) => {
                    match (&mut stacked.blocks, p.blocks) {
                        $((Blocks::$v(all), Blocks::$v(b)) => all.extend(b),)*
                        _ => return None,
                    }
                };
            }
            extend!(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4K, Q5K, Q6K, F16, Bf16, F32);
            stacked.rows += p.rows;
        }
        Some(stacked)
    }

    /// `out[i * ld + col0 + r] = a_i · row_r` for the first `n` activation
    /// rows of `a` (rows of `cols` values, in the format this matrix reads).
    pub fn matmul(
        &self,
        pool: &ComputePool,
        a: &Acts,
        n: usize,
        out: &mut [f32],
        ld: usize,
        col0: usize,
    ) {
        let kb = self.row_blocks();
        assert!(n <= a.rows && a.width == self.cols, "activation shape");
        let have = match self.blocks.block_values() {
            QK_K => a.q8k.len(),
            1 => a.float.len(),
            _ => a.q8.len(),
        };
        assert!(
            have >= n * kb,
            "activations in {}'s format",
            self.blocks.name()
        );
        assert!(
            n == 0 || out.len() >= (n - 1) * ld + col0 + self.rows,
            "output size"
        );
        let threads = pool.threads();
        // Work is split in units of whole interleaved groups. Several chunks
        // per thread even for small matrices, so a thread that starts late
        // still finds work.
        let units = self.rows.div_ceil(self.unit());
        let chunk = units.div_ceil(threads * 4).max(8 / self.unit());
        let chunks = units.div_ceil(chunk);
        let base = Parts(out[col0..].as_mut_ptr());
        let kernels = pool.kernels();
        let run = |c: usize| {
            let rows = c * chunk..((c + 1) * chunk).min(units);
            // SAFETY: rows are disjoint between chunks, so are the written
            // elements; the asserts above bound every index.
            unsafe { self.rows_into(kernels, rows, a, n, base.get(), ld) }
        };
        pool.run(chunks, &run);
    }

    /// `rows` counts units (`unit()` rows each).
    ///
    /// # Safety
    /// `out` must be valid for `out[i * ld + r]`, i < n, r in `rows`' rows.
    unsafe fn rows_into(
        &self,
        kernels: CpuKernels,
        rows: Range<usize>,
        a: &Acts,
        n: usize,
        out: *mut f32,
        ld: usize,
    ) {
        let kb = self.row_blocks();
        #[cfg(not(target_arch = "x86_64"))]
        let _ = kernels;
        // The interleaved layouts are made for the SIMD kernels (which
        // `kernels` enables only on a CPU that has them); the plain 32-value
        // ones, and any layout with the portable kernels, take the loops
        // below.
        #[cfg(target_arch = "x86_64")]
        if kernels.simd() {
            use super::x86;
            let (vnni, all, q8) = (kernels.vnni(), self.rows, &a.q8[..]);
            macro_rules! groups {
                ($w:expr, $plain:path, $vnni:path) => {
                    return if vnni {
                        $vnni($w, kb, rows, all, q8, n, out, ld)
                    } else {
                        $plain($w, kb, rows, all, q8, n, out, ld)
                    }
                };
            }
            match &self.blocks {
                Blocks::Q4_0x8(w) => groups!(w, x86::groups_q4_0x8, x86::groups_q4_0x8_vnni),
                Blocks::Q4_1x8(w) => groups!(w, x86::groups_q4_1x8, x86::groups_q4_1x8_vnni),
                Blocks::Q5_0x8(w) => groups!(w, x86::groups_q5_0x8, x86::groups_q5_0x8_vnni),
                Blocks::Q5_1x8(w) => groups!(w, x86::groups_q5_1x8, x86::groups_q5_1x8_vnni),
                Blocks::Q8_0x8(w) => groups!(w, x86::groups_q8_0x8, x86::groups_q8_0x8_vnni),
                Blocks::Q4K(w) => return x86::rows_q4_k(w, kb, rows, &a.q8k, n, out, ld),
                Blocks::Q5K(w) => return x86::rows_q5_k(w, kb, rows, &a.q8k, n, out, ld),
                Blocks::Q6K(w) => return x86::rows_q6_k(w, kb, rows, &a.q8k, n, out, ld),
                Blocks::F16(w) => return x86::rows_float(w, kb, rows, &a.float, n, out, ld),
                Blocks::Bf16(w) => return x86::rows_float(w, kb, rows, &a.float, n, out, ld),
                Blocks::F32(w) => return x86::rows_float(w, kb, rows, &a.float, n, out, ld),
                _ => {}
            }
        }
        let unit = self.unit();
        for r in rows.start * unit..(rows.end * unit).min(self.rows) {
            let w = r * kb..(r + 1) * kb;
            for i in 0..n {
                let ai = i * kb..(i + 1) * kb;
                let (q8, q8k, x) = (&a.q8, &a.q8k, &a.float);
                macro_rules! lanes {
                    ($b:expr, $lane:path, $dot:path) => {{
                        let row: Vec<_> = lane_row($b, kb, r, $lane).collect();
                        $dot(&row, &q8[ai])
                    }};
                }
                *out.add(i * ld + r) = match &self.blocks {
                    Blocks::Q4_0(b) => quant::dot_q4_0(&b[w.clone()], &q8[ai]),
                    Blocks::Q4_1(b) => quant::dot_q4_1(&b[w.clone()], &q8[ai]),
                    Blocks::Q5_0(b) => quant::dot_q5_0(&b[w.clone()], &q8[ai]),
                    Blocks::Q5_1(b) => quant::dot_q5_1(&b[w.clone()], &q8[ai]),
                    Blocks::Q8_0(b) => quant::dot_q8_0(&b[w.clone()], &q8[ai]),
                    Blocks::Q4_0x8(b) => lanes!(b, quant::lane_q4_0, quant::dot_q4_0),
                    Blocks::Q4_1x8(b) => lanes!(b, quant::lane_q4_1, quant::dot_q4_1),
                    Blocks::Q5_0x8(b) => lanes!(b, quant::lane_q5_0, quant::dot_q5_0),
                    Blocks::Q5_1x8(b) => lanes!(b, quant::lane_q5_1, quant::dot_q5_1),
                    Blocks::Q8_0x8(b) => lanes!(b, quant::lane_q8_0, quant::dot_q8_0),
                    Blocks::Q4K(b) => quant::dot_q4_k(&b[w.clone()], &q8k[ai]),
                    Blocks::Q5K(b) => quant::dot_q5_k(&b[w.clone()], &q8k[ai]),
                    Blocks::Q6K(b) => quant::dot_q6_k(&b[w.clone()], &q8k[ai]),
                    Blocks::F16(b) => {
                        quant::dot_f32(b[w.clone()].iter().map(|h| quant::f16_to_f32(h.0)), &x[ai])
                    }
                    Blocks::Bf16(b) => {
                        quant::dot_f32(b[w.clone()].iter().map(|h| quant::bf16_to_f32(h.0)), &x[ai])
                    }
                    Blocks::F32(b) => quant::dot_f32(b[w.clone()].iter().copied(), &x[ai]),
                };
            }
        }
    }
}

/// Row `r` of a matrix of interleaved groups of `kb` blocks, as plain blocks
/// (`lane` takes one row out of an interleaved block).
fn lane_row<'a, X, B: 'a>(
    w: &'a [X],
    kb: usize,
    r: usize,
    lane: fn(&X, usize) -> B,
) -> impl Iterator<Item = B> + 'a {
    w[r / 8 * kb..(r / 8 + 1) * kb]
        .iter()
        .map(move |b| lane(b, r % 8))
}

/// A projection made of one or more stacked matrices (fused where their
/// formats allow), writing side by side into one output row.
pub struct Linear {
    parts: Vec<QMatrix>,
    /// Output width: the sum of the parts' rows.
    pub rows: usize,
    pub cols: usize,
}

impl Linear {
    /// Fuses `parts` (same columns) into as few matrices as their formats allow.
    pub fn fused(parts: Vec<QMatrix>, kernels: CpuKernels) -> Linear {
        let rows = parts.iter().map(|p| p.rows).sum();
        let cols = parts.first().map_or(0, |p| p.cols);
        let same_format = parts
            .windows(2)
            .all(|w| std::mem::discriminant(&w[0].blocks) == std::mem::discriminant(&w[1].blocks));
        let parts = if same_format && parts.len() > 1 {
            vec![QMatrix::stack(parts).expect("same columns and format")]
        } else {
            parts
        };
        let parts = parts.into_iter().map(|p| p.interleaved(kernels)).collect();
        Linear { parts, rows, cols }
    }

    /// The activation formats the parts read.
    pub fn needs(&self) -> Needs {
        self.parts
            .iter()
            .fold(Needs::default(), |n, p| n.union(p.needs()))
    }

    /// Bytes the weights take in memory.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(QMatrix::bytes).sum()
    }

    /// `out` (n × rows) = `a` (n rows of `cols`, in the formats `needs()`
    /// names) times the weights, transposed.
    pub fn forward(&self, pool: &ComputePool, a: &Acts, n: usize, out: &mut [f32]) {
        let mut col0 = 0;
        for p in &self.parts {
            p.matmul(pool, a, n, out, self.rows, col0);
            col0 += p.rows;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::quant::tests::lcg;
    use super::super::rows;
    use super::*;
    use half::{bf16, f16};

    /// Every format the loader keeps, by GGML name.
    const FORMATS: [&str; 11] = [
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32",
    ];

    fn put_f16(bytes: &mut [u8], at: usize, v: f32) {
        bytes[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
    }

    /// A (rows, cols) matrix of `format` made from random file bytes (the
    /// scales set to sensible f16 values), read by the loader's parsers.
    pub(in crate::engine::cpu) fn random_matrix(
        format: &str,
        rows: usize,
        cols: usize,
        seed: &mut u64,
    ) -> QMatrix {
        let n = rows * cols;
        let mut byte = || (lcg(seed).abs() * 256.0) as u8;
        // (bytes per block, values per block, offsets of f16 scales, of f16 minimums)
        let (size, values, scales, mins): (usize, usize, &[usize], &[usize]) = match format {
            "Q4_0" => (quant::Q4_0_BYTES, QK, &[0], &[]),
            "Q4_1" => (quant::Q4_1_BYTES, QK, &[0], &[2]),
            "Q5_0" => (quant::Q5_0_BYTES, QK, &[0], &[]),
            "Q5_1" => (quant::Q5_1_BYTES, QK, &[0], &[2]),
            "Q8_0" => (quant::Q8_0_BYTES, QK, &[0], &[]),
            "Q4_K" => (quant::Q4_K_BYTES, QK_K, &[0, 2], &[]),
            "Q5_K" => (quant::Q5_K_BYTES, QK_K, &[0, 2], &[]),
            "Q6_K" => (quant::Q6_K_BYTES, QK_K, &[208], &[]),
            _ => (0, 1, &[], &[]),
        };
        let mut bytes: Vec<u8> = (0..n / values * size).map(|_| byte()).collect();
        let blocks = match format {
            "F16" | "BF16" | "F32" => {
                let x: Vec<f32> = (0..n).map(|_| lcg(seed)).collect();
                match format {
                    "F16" => Blocks::F16(
                        x.iter()
                            .map(|&v| F16Bits(f16::from_f32(v).to_bits()))
                            .collect(),
                    ),
                    "BF16" => Blocks::Bf16(
                        x.iter()
                            .map(|&v| Bf16Bits(bf16::from_f32(v).to_bits()))
                            .collect(),
                    ),
                    _ => Blocks::F32(x),
                }
            }
            _ => {
                for b in bytes.chunks_exact_mut(size) {
                    for &at in scales {
                        put_f16(b, at, 0.002 + 0.01 * lcg(seed).abs());
                    }
                    for &at in mins {
                        put_f16(b, at, -0.2 * lcg(seed).abs());
                    }
                }
                match format {
                    "Q4_0" => Blocks::Q4_0(quant::parse_q4_0(&bytes)),
                    "Q4_1" => Blocks::Q4_1(quant::parse_q4_1(&bytes)),
                    "Q5_0" => Blocks::Q5_0(quant::parse_q5_0(&bytes)),
                    "Q5_1" => Blocks::Q5_1(quant::parse_q5_1(&bytes)),
                    "Q8_0" => Blocks::Q8_0(quant::parse_q8_0(&bytes)),
                    "Q4_K" => Blocks::Q4K(quant::parse_q4_k(&bytes)),
                    "Q5_K" => Blocks::Q5K(quant::parse_q5_k(&bytes)),
                    _ => Blocks::Q6K(quant::parse_q6_k(&bytes)),
                }
            }
        };
        QMatrix { rows, cols, blocks }
    }

    /// Activation row `i` as the kernels see it (dequantized from the
    /// format `needs` names), in f64.
    fn seen_row(a: &Acts, needs: Needs, i: usize) -> Vec<f64> {
        let w = a.width;
        if needs.float {
            a.float[i * w..(i + 1) * w]
                .iter()
                .map(|&v| v as f64)
                .collect()
        } else if needs.q8k {
            a.q8k[i * w / QK_K..(i + 1) * w / QK_K]
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&q| b.d as f64 * q as f64))
                .collect()
        } else {
            a.q8[i * w / QK..(i + 1) * w / QK]
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&q| b.d as f64 * q as f64))
                .collect()
        }
    }

    /// Every format's kernels (SIMD and portable, plain and interleaved
    /// layouts) against a scalar reference: the weights dequantized by the
    /// format's `dequantize` (GGML's layout) dotted in f64 with the
    /// activations as that format quantizes them. And rows computed in a
    /// batch of any size equal the same row computed alone, bit for bit.
    #[test]
    fn every_format_matches_the_dequantized_dot_in_any_batch() {
        let mut seed = 3;
        // 70 rows: the last interleaved group is padded; 512 columns: two
        // K-quant super-blocks.
        let (rows, cols) = (70, 2 * QK_K);
        let pools = [
            ComputePool::new(2, CpuKernels::default()).unwrap(),
            ComputePool::new(2, CpuKernels::portable()).unwrap(),
        ];
        let n = 23; // tiles of 16, groups of 4 and a remainder of 3
        let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed)).collect();
        for format in FORMATS {
            let plain = random_matrix(format, rows, cols, &mut seed);
            assert_eq!(plain.blocks.name(), format);
            let needs = plain.needs();
            let mut a = Acts::default();
            rows::quantize(&pools[1], &x, cols, needs, &mut a);
            let mut weights = vec![0f32; rows * cols];
            for (r, w) in weights.chunks_exact_mut(cols).enumerate() {
                plain.row(r, w);
            }
            let interleaved = plain.clone().interleaved(CpuKernels::default());
            for (pool, m) in pools.iter().flat_map(|p| [(p, &plain), (p, &interleaved)]) {
                let mut all = vec![0f32; n * rows];
                m.matmul(pool, &a, n, &mut all, rows, 0);
                for i in 0..n {
                    let mut one_a = Acts::default();
                    rows::quantize(pool, &x[i * cols..(i + 1) * cols], cols, needs, &mut one_a);
                    let mut one = vec![0f32; rows];
                    m.matmul(pool, &one_a, 1, &mut one, rows, 0);
                    assert_eq!(&all[i * rows..(i + 1) * rows], &one[..], "{format} row {i}");
                    let ai = seen_row(&a, needs, i);
                    for (r, got) in one.iter().enumerate() {
                        let w = &weights[r * cols..(r + 1) * cols];
                        let want: f64 = w.iter().zip(&ai).map(|(&w, &x)| w as f64 * x).sum();
                        let scale: f64 =
                            w.iter().zip(&ai).map(|(&w, &x)| (w as f64 * x).abs()).sum();
                        assert!(
                            (*got as f64 - want).abs() <= 1e-5 * scale + 1e-6,
                            "{format} row {i} col {r}: {got} vs {want}"
                        );
                    }
                }
                // The embedding lookup reads rows back from any layout.
                let (mut got, mut want) = (vec![0f32; cols], vec![0f32; cols]);
                m.row(13, &mut got);
                plain.row(13, &mut want);
                assert_eq!(got, want, "{format}");
            }
        }
    }

    /// Matrices of one format stack into one; of different formats they stay
    /// apart, and each part reads its own activation format.
    #[test]
    fn projections_fuse_by_format_and_read_their_own_activations() {
        let mut seed = 5;
        let cols = QK_K;
        let pool = ComputePool::new(2, CpuKernels::default()).unwrap();
        let q4k = random_matrix("Q4_K", 9, cols, &mut seed);
        let q6k = random_matrix("Q6_K", 7, cols, &mut seed);
        let f16 = random_matrix("F16", 5, cols, &mut seed);
        let same = Linear::fused(vec![q4k.clone(), q4k.clone()], CpuKernels::default());
        assert_eq!(same.parts.len(), 1);
        let mixed = Linear::fused(
            vec![q4k.clone(), q6k.clone(), f16.clone()],
            CpuKernels::default(),
        );
        assert_eq!((mixed.parts.len(), mixed.rows), (3, 21));
        let needs = mixed.needs();
        assert!(needs.q8k && needs.float && !needs.q8);
        let x: Vec<f32> = (0..2 * cols).map(|_| lcg(&mut seed)).collect();
        let mut a = Acts::default();
        rows::quantize(&pool, &x, cols, needs, &mut a);
        let mut out = vec![0f32; 2 * 21];
        mixed.forward(&pool, &a, 2, &mut out);
        let mut col0 = 0;
        for m in [&q4k, &q6k, &f16] {
            let mut part = vec![0f32; 2 * m.rows];
            m.matmul(&pool, &a, 2, &mut part, m.rows, 0);
            for i in 0..2 {
                assert_eq!(
                    &out[i * 21 + col0..i * 21 + col0 + m.rows],
                    &part[i * m.rows..(i + 1) * m.rows]
                );
            }
            col0 += m.rows;
        }
    }

    /// One of `x86`'s groups kernels.
    #[cfg(target_arch = "x86_64")]
    type GroupsKernel<B> =
        unsafe fn(&[B], usize, Range<usize>, usize, &[BlockQ8A], usize, *mut f32, usize);

    /// The n x rows outputs of `kernel` over every group of `w`.
    ///
    /// # Safety
    /// The CPU has the kernel's features; `w` holds `rows.div_ceil(8)`
    /// groups of `kb` blocks and `a` holds `n * kb` blocks.
    #[cfg(target_arch = "x86_64")]
    unsafe fn all_groups<B>(
        kernel: GroupsKernel<B>,
        w: &[B],
        kb: usize,
        rows: usize,
        a: &[BlockQ8A],
        n: usize,
    ) -> Vec<f32> {
        let mut out = vec![0f32; n * rows];
        let groups = 0..rows.div_ceil(8);
        kernel(w, kb, groups, rows, a, n, out.as_mut_ptr(), rows);
        out
    }

    /// The VNNI kernels give the plain AVX2 kernels' results bit for bit.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vnni_kernels_equal_the_avx2_kernels() {
        if !super::super::x86::vnni_supported() {
            eprintln!("no AVX-512 VNNI here; nothing to compare");
            return;
        }
        use super::super::x86;
        let mut seed = 11;
        let (rows, cols, n) = (30, 6 * QK, 7);
        let kb = cols / QK;
        let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed)).collect();
        let mut a = vec![BlockQ8A::default(); n * kb];
        for (row, blocks) in x.chunks_exact(cols).zip(a.chunks_exact_mut(kb)) {
            quant::quantize_row(row, blocks);
        }
        macro_rules! check {
            ($format:literal, $variant:ident, $plain:path, $vnni:path) => {
                let m = random_matrix($format, rows, cols, &mut seed);
                let Blocks::$variant(w) = m.interleaved(CpuKernels::default()).blocks else {
                    unreachable!()
                };
                // SAFETY: the CPU has the features (checked above); `w`
                // holds the matrix's groups, `a` its n rows of kb blocks.
                unsafe {
                    assert_eq!(
                        all_groups($plain, &w, kb, rows, &a, n),
                        all_groups($vnni, &w, kb, rows, &a, n),
                        $format
                    );
                }
            };
        }
        check!("Q4_0", Q4_0x8, x86::groups_q4_0x8, x86::groups_q4_0x8_vnni);
        check!("Q4_1", Q4_1x8, x86::groups_q4_1x8, x86::groups_q4_1x8_vnni);
        check!("Q5_0", Q5_0x8, x86::groups_q5_0x8, x86::groups_q5_0x8_vnni);
        check!("Q5_1", Q5_1x8, x86::groups_q5_1x8, x86::groups_q5_1x8_vnni);
        check!("Q8_0", Q8_0x8, x86::groups_q8_0x8, x86::groups_q8_0x8_vnni);
    }
}
