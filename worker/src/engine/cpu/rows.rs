//! Row-wise steps that feed the quantized products: RMS norm, the SiLU gate
//! and plain 8-bit quantization of activation rows, fused so that each row is
//! read once and written straight into activation blocks, rows spread over
//! the compute threads.
use super::kernels::CpuKernels;
use super::quant::{self, BlockQ8A, QK};
use super::threads::ComputePool;

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

/// `out` = quantized rows of `x` (rows of `width` values).
pub fn quantize(pool: &ComputePool, x: &[f32], width: usize, out: &mut [BlockQ8A]) {
    let (kb, kernels) = (width / QK, pool.kernels());
    pool.rows_mut(&mut out[..x.len() / QK], kb, &|r, blocks| {
        let row = &x[r * width..(r + 1) * width];
        for (b, v) in blocks.iter_mut().zip(row.chunks_exact(QK)) {
            *b = quantize_block(kernels, v);
        }
    });
}

/// `out` = quantized RMS norm of the rows of `x`, scaled by `weight`.
pub fn norm_quantize(
    pool: &ComputePool,
    x: &[f32],
    weight: &[f32],
    eps: f32,
    out: &mut [BlockQ8A],
) {
    let (width, kernels) = (weight.len(), pool.kernels());
    pool.rows_mut(&mut out[..x.len() / QK], width / QK, &|r, blocks| {
        let row = &x[r * width..(r + 1) * width];
        let ss: f32 = row.iter().map(|v| v * v).sum();
        let scale = 1.0 / (ss / width as f32 + eps).sqrt();
        let mut tmp = [0f32; QK];
        for ((b, v), w) in blocks
            .iter_mut()
            .zip(row.chunks_exact(QK))
            .zip(weight.chunks_exact(QK))
        {
            for ((t, &v), &w) in tmp.iter_mut().zip(v).zip(w) {
                *t = v * scale * w;
            }
            *b = quantize_block(kernels, &tmp);
        }
    });
}

/// `out` = quantized `silu(gate) * up`, where each row of `gu` is the gate
/// then the up projection, `ffn` values each.
pub fn silu_mul_quantize(pool: &ComputePool, gu: &[f32], ffn: usize, out: &mut [BlockQ8A]) {
    let (rows, kernels) = (gu.len() / (2 * ffn), pool.kernels());
    pool.rows_mut(&mut out[..rows * ffn / QK], ffn / QK, &|r, blocks| {
        let (g, u) = gu[r * 2 * ffn..(r + 1) * 2 * ffn].split_at(ffn);
        let mut tmp = [0f32; QK];
        for ((b, g), u) in blocks
            .iter_mut()
            .zip(g.chunks_exact(QK))
            .zip(u.chunks_exact(QK))
        {
            silu_mul_block(kernels, g, u, &mut tmp);
            *b = quantize_block(kernels, &tmp);
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

    fn fused_rows_match_with(pool: &ComputePool) {
        let (rows, width) = (5, 3 * QK);
        let x: Vec<f32> = (0..rows * width)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0)
            .collect();
        let weight: Vec<f32> = (0..width).map(|i| 0.5 + (i % 7) as f32 / 10.0).collect();
        let mut got = vec![BlockQ8A::default(); rows * width / QK];
        norm_quantize(pool, &x, &weight, 1e-5, &mut got);
        let mut normed = vec![0f32; rows * width];
        norm(&x, &weight, 1e-5, &mut normed);
        let mut want = vec![BlockQ8A::default(); rows * width / QK];
        for (row, b) in normed
            .chunks_exact(width)
            .zip(want.chunks_exact_mut(width / QK))
        {
            quant::quantize_row(row, b);
        }
        for (g, w) in got.iter().zip(&want) {
            assert_eq!((g.qs, g.sum), (w.qs, w.sum));
            assert!((g.d - w.d).abs() <= 1e-6 * w.d.abs());
        }

        let ffn = 2 * QK;
        let gu: Vec<f32> = (0..rows * 2 * ffn)
            .map(|i| ((i * 53 % 89) as f32 - 44.0) / 9.0)
            .collect();
        let mut got = vec![BlockQ8A::default(); rows * ffn / QK];
        silu_mul_quantize(pool, &gu, ffn, &mut got);
        for r in 0..rows {
            let (g, u) = gu[r * 2 * ffn..(r + 1) * 2 * ffn].split_at(ffn);
            let act: Vec<f32> = g
                .iter()
                .zip(u)
                .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let mut want = vec![BlockQ8A::default(); ffn / QK];
            quant::quantize_row(&act, &mut want);
            for (g, w) in got[r * ffn / QK..(r + 1) * ffn / QK].iter().zip(&want) {
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
