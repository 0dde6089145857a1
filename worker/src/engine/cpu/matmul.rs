//! Quantized weight matrices and their product with a batch of activation
//! rows, split over the compute threads by weight rows.
use super::kernels::CpuKernels;
use super::quant::{self, BlockQ4_1, BlockQ4_1x8, BlockQ8A, BlockQ8_0, BlockQ8_0x8, QK};
use super::threads::{ComputePool, Parts};
use std::ops::Range;

/// A matrix's blocks, row-major, in one of the formats the kernels run.
#[derive(Clone)]
pub enum Blocks {
    Q4_1(Vec<BlockQ4_1>),
    Q8_0(Vec<BlockQ8_0>),
    /// Groups of eight rows interleaved (`quant::BlockQ4_1x8`), group-major.
    Q4_1x8(Vec<BlockQ4_1x8>),
    /// Groups of eight rows interleaved (`quant::BlockQ8_0x8`), group-major.
    Q8_0x8(Vec<BlockQ8_0x8>),
}

/// A (rows, cols) weight matrix; `cols` is a multiple of 32.
#[derive(Clone)]
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub blocks: Blocks,
}

impl QMatrix {
    /// Blocks per row.
    pub fn row_blocks(&self) -> usize {
        self.cols / QK
    }

    /// Bytes the blocks take in memory.
    pub fn bytes(&self) -> usize {
        match &self.blocks {
            Blocks::Q4_1(b) => std::mem::size_of_val(b.as_slice()),
            Blocks::Q8_0(b) => std::mem::size_of_val(b.as_slice()),
            Blocks::Q4_1x8(b) => std::mem::size_of_val(b.as_slice()),
            Blocks::Q8_0x8(b) => std::mem::size_of_val(b.as_slice()),
        }
    }

    /// Row `r`, dequantized (an embedding lookup).
    pub fn row(&self, r: usize, out: &mut [f32]) {
        let kb = self.row_blocks();
        let blocks = r * kb..(r + 1) * kb;
        match &self.blocks {
            Blocks::Q4_1(b) => {
                for (blk, o) in b[blocks].iter().zip(out.chunks_exact_mut(QK)) {
                    quant::dequantize_q4_1(blk, o)
                }
            }
            Blocks::Q8_0(b) => {
                for (blk, o) in b[blocks].iter().zip(out.chunks_exact_mut(QK)) {
                    quant::dequantize_q8_0(blk, o)
                }
            }
            Blocks::Q4_1x8(b) => {
                for (blk, o) in lane_row(b, kb, r, quant::lane_q4_1).zip(out.chunks_exact_mut(QK)) {
                    quant::dequantize_q4_1(&blk, o)
                }
            }
            Blocks::Q8_0x8(b) => {
                for (blk, o) in lane_row(b, kb, r, quant::lane_q8_0).zip(out.chunks_exact_mut(QK)) {
                    quant::dequantize_q8_0(&blk, o)
                }
            }
        }
    }

    /// The same matrix with groups of eight rows interleaved for the SIMD
    /// kernels (the last group padded), where `kernels` run them; else
    /// unchanged.
    pub fn interleaved(self, kernels: CpuKernels) -> QMatrix {
        if !kernels.simd() {
            return self;
        }
        let kb = self.row_blocks();
        let blocks = match self.blocks {
            Blocks::Q4_1(b) => Blocks::Q4_1x8(quant::interleave_q4_1(&b, kb)),
            Blocks::Q8_0(b) => Blocks::Q8_0x8(quant::interleave_q8_0(&b, kb)),
            other => other,
        };
        QMatrix { blocks, ..self }
    }

    /// Rows per unit of work: eight for interleaved groups, else one.
    fn unit(&self) -> usize {
        match self.blocks {
            Blocks::Q4_1x8(_) | Blocks::Q8_0x8(_) => 8,
            _ => 1,
        }
    }

    /// Stacks matrices with the same columns and format into one (fused
    /// projections: one pass over the activations, one parallel region).
    pub fn stack(parts: Vec<QMatrix>) -> Option<QMatrix> {
        let mut parts = parts.into_iter();
        let mut stacked = parts.next()?;
        if matches!(stacked.blocks, Blocks::Q4_1x8(_) | Blocks::Q8_0x8(_)) {
            return None;
        }
        for p in parts {
            if p.cols != stacked.cols {
                return None;
            }
            match (&mut stacked.blocks, p.blocks) {
                (Blocks::Q4_1(all), Blocks::Q4_1(b)) => all.extend(b),
                (Blocks::Q8_0(all), Blocks::Q8_0(b)) => all.extend(b),
                _ => return None,
            }
            stacked.rows += p.rows;
        }
        Some(stacked)
    }

    /// `out[i * ld + col0 + r] = a_i · row_r` for the `n` quantized activation
    /// rows in `a` (each `cols / 32` blocks).
    pub fn matmul(
        &self,
        pool: &ComputePool,
        a: &[BlockQ8A],
        n: usize,
        out: &mut [f32],
        ld: usize,
        col0: usize,
    ) {
        let kb = self.row_blocks();
        assert!(a.len() >= n * kb, "activation blocks");
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
        a: &[BlockQ8A],
        n: usize,
        out: *mut f32,
        ld: usize,
    ) {
        let kb = self.row_blocks();
        #[cfg(not(target_arch = "x86_64"))]
        let _ = kernels;
        // The interleaved layouts are made for the SIMD kernels (which
        // `kernels` enables only on a CPU that has them); the plain ones, and
        // any layout with the portable kernels, take the loops below.
        #[cfg(target_arch = "x86_64")]
        if kernels.simd() {
            use super::x86;
            let (vnni, all) = (kernels.vnni(), self.rows);
            match &self.blocks {
                Blocks::Q4_1x8(w) if vnni => {
                    return x86::groups_q4_1x8_vnni(w, kb, rows, all, a, n, out, ld);
                }
                Blocks::Q8_0x8(w) if vnni => {
                    return x86::groups_q8_0x8_vnni(w, kb, rows, all, a, n, out, ld);
                }
                Blocks::Q4_1x8(w) => return x86::groups_q4_1x8(w, kb, rows, all, a, n, out, ld),
                Blocks::Q8_0x8(w) => return x86::groups_q8_0x8(w, kb, rows, all, a, n, out, ld),
                Blocks::Q4_1(_) | Blocks::Q8_0(_) => {}
            }
        }
        let unit = self.unit();
        for r in rows.start * unit..(rows.end * unit).min(self.rows) {
            for i in 0..n {
                let ai = &a[i * kb..(i + 1) * kb];
                *out.add(i * ld + r) = match &self.blocks {
                    Blocks::Q4_1(w) => quant::dot_q4_1(&w[r * kb..(r + 1) * kb], ai),
                    Blocks::Q8_0(w) => quant::dot_q8_0(&w[r * kb..(r + 1) * kb], ai),
                    Blocks::Q4_1x8(w) => {
                        let row: Vec<_> = lane_row(w, kb, r, quant::lane_q4_1).collect();
                        quant::dot_q4_1(&row, ai)
                    }
                    Blocks::Q8_0x8(w) => {
                        let row: Vec<_> = lane_row(w, kb, r, quant::lane_q8_0).collect();
                        quant::dot_q8_0(&row, ai)
                    }
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
        let same_format = parts.windows(2).all(|w| {
            matches!(
                (&w[0].blocks, &w[1].blocks),
                (Blocks::Q4_1(_), Blocks::Q4_1(_)) | (Blocks::Q8_0(_), Blocks::Q8_0(_))
            )
        });
        let parts = if same_format && parts.len() > 1 {
            vec![QMatrix::stack(parts).expect("same columns and format")]
        } else {
            parts
        };
        let parts = parts.into_iter().map(|p| p.interleaved(kernels)).collect();
        Linear { parts, rows, cols }
    }

    /// Bytes the weights take in memory.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(QMatrix::bytes).sum()
    }

    /// `out` (n × rows) = `a` (n quantized rows of `cols`) times the weights, transposed.
    pub fn forward(&self, pool: &ComputePool, a: &[BlockQ8A], n: usize, out: &mut [f32]) {
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
    use super::*;

    fn q4_1_matrix(rows: usize, cols: usize, seed: &mut u64) -> QMatrix {
        let blocks = (0..rows * cols / QK)
            .map(|_| BlockQ4_1 {
                d: half::f16::from_f32(0.05 + 0.05 * lcg(seed).abs()).to_bits(),
                m: half::f16::from_f32(-0.4 * lcg(seed).abs()).to_bits(),
                qs: std::array::from_fn(|_| (lcg(seed).abs() * 255.0) as u8),
            })
            .collect();
        QMatrix {
            rows,
            cols,
            blocks: Blocks::Q4_1(blocks),
        }
    }

    /// Rows computed in a batch of any size equal the same row computed
    /// alone, bit for bit, in every layout and with either kernel choice; the
    /// interleaved kernels agree with the plain ones and with the portable
    /// dot product.
    #[test]
    fn batched_rows_equal_single_rows_bit_for_bit() {
        let mut seed = 3;
        // 70 rows: the last interleaved group is padded.
        let (rows, cols) = (70, 4 * QK);
        let q4 = q4_1_matrix(rows, cols, &mut seed);
        let dense: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
        let q8 = QMatrix {
            rows,
            cols,
            blocks: Blocks::Q8_0(quant::quantize_q8_0(&dense)),
        };
        let kb = cols / QK;
        // The SIMD kernels where the CPU has them, and the portable loops
        // over the same layouts.
        let pools = [
            ComputePool::new(2, CpuKernels::default()).unwrap(),
            ComputePool::new(2, CpuKernels::portable()).unwrap(),
        ];
        let n = 23; // tiles of 16, groups of 4 and a remainder of 3
        let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed)).collect();
        let mut a = vec![BlockQ8A::default(); n * kb];
        for (row, blocks) in x.chunks_exact(cols).zip(a.chunks_exact_mut(kb)) {
            quant::quantize_row(row, blocks);
        }
        for plain in [q4, q8] {
            let portable = |r: usize, ai: &[BlockQ8A]| match &plain.blocks {
                Blocks::Q4_1(w) => quant::dot_q4_1(&w[r * kb..(r + 1) * kb], ai),
                Blocks::Q8_0(w) => quant::dot_q8_0(&w[r * kb..(r + 1) * kb], ai),
                _ => unreachable!(),
            };
            let interleaved = plain.clone().interleaved(CpuKernels::default());
            for (pool, m) in pools.iter().flat_map(|p| [(p, &plain), (p, &interleaved)]) {
                let mut all = vec![0f32; n * rows];
                m.matmul(pool, &a, n, &mut all, rows, 0);
                for i in 0..n {
                    let ai = &a[i * kb..(i + 1) * kb];
                    let mut one = vec![0f32; rows];
                    m.matmul(pool, ai, 1, &mut one, rows, 0);
                    assert_eq!(&all[i * rows..(i + 1) * rows], &one[..], "row {i}");
                    for (r, got) in one.iter().enumerate() {
                        let want = portable(r, ai);
                        assert!(
                            (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                            "row {i} col {r}: {got} vs {want}"
                        );
                    }
                }
                // The embedding lookup reads rows back from any layout.
                let (mut got, mut want) = (vec![0f32; cols], vec![0f32; cols]);
                m.row(13, &mut got);
                plain.row(13, &mut want);
                assert_eq!(got, want);
            }
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
        let dense: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
        let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed)).collect();
        let mut a = vec![BlockQ8A::default(); n * kb];
        for (row, blocks) in x.chunks_exact(cols).zip(a.chunks_exact_mut(kb)) {
            quant::quantize_row(row, blocks);
        }
        let q4 = quant::interleave_q4_1(
            match &q4_1_matrix(rows, cols, &mut seed).blocks {
                Blocks::Q4_1(b) => b,
                _ => unreachable!(),
            },
            kb,
        );
        let q8 = quant::interleave_q8_0(&quant::quantize_q8_0(&dense), kb);
        // SAFETY: the CPU has the features (checked above); `q4` and `q8`
        // hold the matrix's groups, `a` its n rows of kb blocks.
        unsafe {
            assert_eq!(
                all_groups(x86::groups_q4_1x8, &q4, kb, rows, &a, n),
                all_groups(x86::groups_q4_1x8_vnni, &q4, kb, rows, &a, n)
            );
            assert_eq!(
                all_groups(x86::groups_q8_0x8, &q8, kb, rows, &a, n),
                all_groups(x86::groups_q8_0x8_vnni, &q8, kb, rows, &a, n)
            );
        }
    }
}
