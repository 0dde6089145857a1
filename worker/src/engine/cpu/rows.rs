//! Row-wise steps that feed the products: RMS norm, the SiLU gate and the
//! storing of activation rows in the formats the next projection reads (8-bit
//! blocks of 32 or 256, or f32), fused so that each row is computed once and
//! written straight into those formats, rows spread over the compute threads.
use super::kernels::CpuKernels;
use super::matmul::{Acts, Needs};
use super::quant::{self, BlockQ8A, BlockQ8K, QK, QK_K};
use super::threads::{ComputePool, Parts};

/// One block of activations quantized, with the SIMD kernel where it runs.
fn quantize_block(kernels: CpuKernels, x: &[f32]) -> BlockQ8A {
    #[cfg(target_arch = "x86_64")]
    if kernels.simd() {
        // SAFETY: the CPU has AVX2 and FMA; x holds a whole block.
        return unsafe { super::x86::quantize_block(x) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = kernels;
    quant::quantize_block(x)
}

/// One K block of activations quantized, with the SIMD kernel where it runs.
fn quantize_block_k(kernels: CpuKernels, x: &[f32]) -> BlockQ8K {
    #[cfg(target_arch = "x86_64")]
    if kernels.simd() {
        // SAFETY: the CPU has AVX2 and FMA; x holds a whole block.
        return unsafe { super::x86::quantize_block_k(x) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = kernels;
    quant::quantize_block_k(x)
}

/// Fills `out` with `rows` rows of `width` values in the formats `needs`
/// names: `f(r, row)` writes row `r`'s values into `row`, which is then
/// stored as f32 and/or quantized. Rows are spread over the threads.
fn fill(
    pool: &ComputePool,
    rows: usize,
    width: usize,
    needs: Needs,
    out: &mut Acts,
    f: &(dyn Fn(usize, &mut [f32]) + Sync),
) {
    out.shape(rows, width, needs);
    if rows == 0 {
        return;
    }
    let kernels = pool.kernels();
    let q8 = Parts(out.q8.as_mut_ptr());
    let q8k = Parts(out.q8k.as_mut_ptr());
    let float = Parts(out.float.as_mut_ptr());
    let per_task = rows.div_ceil(pool.threads() * 2);
    pool.run(rows.div_ceil(per_task), &|t| {
        // Each compute thread's row buffer, kept across steps.
        thread_local!(static ROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) });
        ROW.with_borrow_mut(|row| {
        row.resize(width, 0.0);
        let row = &mut row[..width];
        for r in t * per_task..((t + 1) * per_task).min(rows) {
            f(r, row);
            // SAFETY: `shape` sized each needed buffer for `rows` rows; row
            // r's part of each is written by this task only.
            unsafe {
                if needs.float {
                    std::slice::from_raw_parts_mut(float.get().add(r * width), width)
                        .copy_from_slice(row);
                }
                if needs.q8 {
                    let blocks =
                        std::slice::from_raw_parts_mut(q8.get().add(r * width / QK), width / QK);
                    for (b, v) in blocks.iter_mut().zip(row.chunks_exact(QK)) {
                        *b = quantize_block(kernels, v);
                    }
                }
                if needs.q8k {
                    let blocks = std::slice::from_raw_parts_mut(
                        q8k.get().add(r * width / QK_K),
                        width / QK_K,
                    );
                    for (b, v) in blocks.iter_mut().zip(row.chunks_exact(QK_K)) {
                        *b = quantize_block_k(kernels, v);
                    }
                }
            }
        }
        });
    });
}

/// `out` = the rows of `x` (rows of `width` values) in the formats `needs` names.
pub fn quantize(pool: &ComputePool, x: &[f32], width: usize, needs: Needs, out: &mut Acts) {
    fill(pool, x.len() / width, width, needs, out, &|r, row| {
        row.copy_from_slice(&x[r * width..(r + 1) * width])
    });
}

/// `out` = RMS norm of the rows of `x`, scaled by `weight`, in the formats
/// `needs` names.
pub fn norm_quantize(
    pool: &ComputePool,
    x: &[f32],
    weight: &[f32],
    eps: f32,
    needs: Needs,
    out: &mut Acts,
) {
    let width = weight.len();
    fill(pool, x.len() / width, width, needs, out, &|r, o| {
        let row = &x[r * width..(r + 1) * width];
        let ss: f32 = row.iter().map(|v| v * v).sum();
        let scale = 1.0 / (ss / width as f32 + eps).sqrt();
        for ((o, &v), &w) in o.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    });
}

/// `out` = `silu(gate) * up` in the formats `needs` names, where each row of
/// `gu` is the gate then the up projection, `ffn` values each.
pub fn silu_mul_quantize(pool: &ComputePool, gu: &[f32], ffn: usize, needs: Needs, out: &mut Acts) {
    let kernels = pool.kernels();
    fill(pool, gu.len() / (2 * ffn), ffn, needs, out, &|r, o| {
        let (g, u) = gu[r * 2 * ffn..(r + 1) * 2 * ffn].split_at(ffn);
        for ((o, g), u) in o
            .chunks_exact_mut(QK)
            .zip(g.chunks_exact(QK))
            .zip(u.chunks_exact(QK))
        {
            silu_mul_block(kernels, g, u, o.try_into().expect("a block"));
        }
    });
}

fn silu_mul_block(kernels: CpuKernels, g: &[f32], u: &[f32], out: &mut [f32; QK]) {
    #[cfg(target_arch = "x86_64")]
    if kernels.simd() {
        // SAFETY: the CPU has AVX2 and FMA; g and u hold a whole block.
        return unsafe { super::x86::silu_mul_block(g, u, out) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = kernels;
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// `out` = RMS norm of the rows of `x`, scaled by `weight`, unquantized (the
/// definition the fused version is tested against).
#[cfg(test)]
fn norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = row.iter().map(|v| v * v).sum();
        let scale = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, &v), &w) in o.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SIMD paths and the portable ones give what the definitions give.
    #[test]
    fn fused_rows_match_their_definitions() {
        for kernels in [CpuKernels::default(), CpuKernels::portable()] {
            fused_rows_match_with(&ComputePool::new(2, kernels).unwrap());
        }
    }

    /// The SIMD quantizers give the portable ones' bits, ties (halves after
    /// scaling, rounded to even) and all-zero blocks included.
    #[test]
    fn simd_quantizers_round_as_the_portable_ones() {
        let simd = CpuKernels::default();
        if !simd.simd() {
            return; // nothing to compare: both would be the portable code
        }
        // 127 as the largest magnitude makes the scale 1, so the halves
        // below are exact ties.
        let mut x: Vec<f32> = (0..QK_K)
            .map(|i| (i as f32 - 128.0) / 2.0 + if i % 7 == 0 { 0.3 } else { 0.0 })
            .collect();
        x[5] = -127.0;
        let zeros = vec![0f32; QK_K];
        let scaled: Vec<f32> = x.iter().map(|v| v * 0.013).collect();
        for v in [&x, &zeros, &scaled] {
            let (a, b) = (quantize_block_k(simd, v), quant::quantize_block_k(v));
            assert_eq!(
                (a.d.to_bits(), a.qs, a.bsums),
                (b.d.to_bits(), b.qs, b.bsums)
            );
            for c in v.chunks_exact(QK) {
                let (a, b) = (quantize_block(simd, c), quant::quantize_block(c));
                assert_eq!((a.d.to_bits(), a.qs, a.sum), (b.d.to_bits(), b.qs, b.sum));
            }
        }
    }

    const ALL: Needs = Needs {
        q8: true,
        q8k: true,
        float: true,
    };

    fn fused_rows_match_with(pool: &ComputePool) {
        let (rows, width) = (5, 2 * QK_K);
        let x: Vec<f32> = (0..rows * width)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0)
            .collect();
        let weight: Vec<f32> = (0..width).map(|i| 0.5 + (i % 7) as f32 / 10.0).collect();
        let mut got = Acts::default();
        norm_quantize(pool, &x, &weight, 1e-5, ALL, &mut got);
        let mut normed = vec![0f32; rows * width];
        norm(&x, &weight, 1e-5, &mut normed);
        assert_eq!(got.float, normed);
        let mut want = vec![BlockQ8A::default(); rows * width / QK];
        for (row, b) in normed
            .chunks_exact(width)
            .zip(want.chunks_exact_mut(width / QK))
        {
            quant::quantize_row(row, b);
        }
        for (g, w) in got.q8.iter().zip(&want) {
            assert_eq!((g.qs, g.sum), (w.qs, w.sum));
            assert!((g.d - w.d).abs() <= 1e-6 * w.d.abs());
        }
        let want_k: Vec<_> = normed
            .chunks_exact(QK_K)
            .map(quant::quantize_block_k)
            .collect();
        assert_eq!(got.q8k.len(), want_k.len());
        for (g, w) in got.q8k.iter().zip(&want_k) {
            assert_eq!((g.d, g.qs, g.bsums), (w.d, w.qs, w.bsums));
        }
        // Only the formats asked for are filled.
        let q8_only = Needs {
            q8: true,
            ..Needs::default()
        };
        norm_quantize(pool, &x, &weight, 1e-5, q8_only, &mut got);
        assert!(got.q8k.is_empty() && got.float.is_empty());
        assert_eq!(got.q8.len(), rows * width / QK);

        let ffn = 2 * QK;
        let gu: Vec<f32> = (0..rows * 2 * ffn)
            .map(|i| ((i * 53 % 89) as f32 - 44.0) / 9.0)
            .collect();
        let mut got = Acts::default();
        silu_mul_quantize(pool, &gu, ffn, q8_only, &mut got);
        for r in 0..rows {
            let (g, u) = gu[r * 2 * ffn..(r + 1) * 2 * ffn].split_at(ffn);
            let act: Vec<f32> = g
                .iter()
                .zip(u)
                .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let mut want = vec![BlockQ8A::default(); ffn / QK];
            quant::quantize_row(&act, &mut want);
            for (g, w) in got.q8[r * ffn / QK..(r + 1) * ffn / QK].iter().zip(&want) {
                // The vector exp differs from libm's in the last bits, which
                // can move a value across a rounding boundary.
                for (a, b) in g.qs.iter().zip(&w.qs) {
                    assert!((*a as i32 - *b as i32).abs() <= 1);
                }
                assert!((g.d - w.d).abs() <= 1e-5 * w.d.abs());
            }
        }
    }
}
