//! Quantized block formats, bit for bit as GGML lays them out in a GGUF file,
//! and the 8-bit quantization of activations that the dot products use.
//!
//! Weights stay in the file's 4-bit (Q4_1) or 8-bit (Q8_0) blocks in memory:
//! decoding reads every weight once per step, so the bytes read (not the
//! arithmetic) bound single-stream speed, and a 4-bit weight is an eighth of
//! an f32 one. Activations are quantized to 8 bits per 32-value block, as
//! llama.cpp does, so that a block's dot product is integer arithmetic.
use half::f16;

/// Values per block, in every format here.
pub const QK: usize = 32;

/// GGML Q4_1: 32 weights as `d * q + m` with 4-bit `q`; element `j` is the
/// low nibble of `qs[j]`, element `j + 16` its high nibble.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ4_1 {
    /// Scale, f16 bits.
    pub d: u16,
    /// Minimum, f16 bits.
    pub m: u16,
    pub qs: [u8; QK / 2],
}

/// GGML Q8_0: 32 weights as `d * q` with signed 8-bit `q`.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// Scale, f16 bits.
    pub d: u16,
    pub qs: [i8; QK],
}

/// One block of a quantized activation row: `x ≈ d * q`, and `s = d * Σq`
/// (what a Q4_1 block's minimum multiplies).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ8A {
    pub qs: [i8; QK],
    pub d: f32,
    pub s: f32,
    /// Σq, for kernels that offset signed weights to unsigned.
    pub sum: i32,
}

/// Block `b` of eight consecutive Q4_1 rows, interleaved so that one 256-bit
/// register holds four elements of each of the eight rows: byte
/// `32 c + 4 r + e` is row `r`'s `qs[4 c + e]` (low nibble: element `4 c + e`,
/// high nibble: element `16 + 4 c + e`). The kernels then multiply eight rows
/// against one broadcast group of four activations per instruction, and the
/// scales of the eight rows are one vector: the per-block float work is
/// shared by eight outputs instead of done once per output.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4_1x8 {
    /// Scales of the eight rows, f16 bits.
    pub d: [u16; 8],
    /// Minimums of the eight rows, f16 bits.
    pub m: [u16; 8],
    pub qs: [u8; 128],
}

/// Block `b` of eight consecutive Q8_0 rows, interleaved like `BlockQ4_1x8`:
/// byte `32 c + 4 r + e` is row `r`'s `qs[4 c + e]`, c in 0..8.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8_0x8 {
    /// Scales of the eight rows, f16 bits.
    pub d: [u16; 8],
    pub qs: [i8; 256],
}

/// Groups a matrix of rows of `kb` blocks by eight rows and makes each
/// group's block `b` from the eight rows' blocks `b` (group-major); a last
/// group of fewer than eight rows is padded with zero blocks (their outputs
/// are never stored).
fn interleave<B: Default, X>(w: &[B], kb: usize, make: impl Fn([&B; 8]) -> X) -> Vec<X> {
    let rows = w.len() / kb;
    let groups = rows.div_ceil(8);
    let zero = B::default();
    let mut out = Vec::with_capacity(groups * kb);
    for g in 0..groups {
        for b in 0..kb {
            out.push(make(std::array::from_fn(|r| {
                if g * 8 + r < rows {
                    &w[(g * 8 + r) * kb + b]
                } else {
                    &zero
                }
            })));
        }
    }
    out
}

/// The quants of eight rows' blocks, four bytes of each row in turn: byte
/// `32 c + 4 r + e` is row `r`'s `qs[4 c + e]`, c in 0..N / 32.
fn interleave_qs<T: Copy + Default, const N: usize>(rows: [&[T]; 8]) -> [T; N] {
    let mut qs = [T::default(); N];
    for c in 0..N / 32 {
        for (r, row) in rows.iter().enumerate() {
            qs[32 * c + 4 * r..32 * c + 4 * r + 4].copy_from_slice(&row[4 * c..4 * c + 4]);
        }
    }
    qs
}

/// Row `r`'s quants out of interleaved ones (`interleave_qs` undone).
fn lane_qs<T: Copy, const N: usize>(qs: &[T], r: usize) -> [T; N] {
    std::array::from_fn(|j| qs[32 * (j / 4) + 4 * r + j % 4])
}

/// Interleaves a Q4_1 matrix of rows of `kb` blocks; a last group of fewer
/// than eight rows is padded with zero blocks (their outputs are never stored).
pub fn interleave_q4_1(w: &[BlockQ4_1], kb: usize) -> Vec<BlockQ4_1x8> {
    interleave(w, kb, |rows| BlockQ4_1x8 {
        d: rows.map(|b| b.d),
        m: rows.map(|b| b.m),
        qs: interleave_qs(rows.map(|b| &b.qs[..])),
    })
}

/// Interleaves a Q8_0 matrix of rows of `kb` blocks, padded like
/// `interleave_q4_1`.
pub fn interleave_q8_0(w: &[BlockQ8_0], kb: usize) -> Vec<BlockQ8_0x8> {
    interleave(w, kb, |rows| BlockQ8_0x8 {
        d: rows.map(|b| b.d),
        qs: interleave_qs(rows.map(|b| &b.qs[..])),
    })
}

/// Row `r` (0..8) of an interleaved Q4_1 block, as a plain block.
pub fn lane_q4_1(b: &BlockQ4_1x8, r: usize) -> BlockQ4_1 {
    BlockQ4_1 {
        d: b.d[r],
        m: b.m[r],
        qs: lane_qs(&b.qs, r),
    }
}

/// Row `r` (0..8) of an interleaved Q8_0 block, as a plain block.
pub fn lane_q8_0(b: &BlockQ8_0x8, r: usize) -> BlockQ8_0 {
    BlockQ8_0 {
        d: b.d[r],
        qs: lane_qs(&b.qs, r),
    }
}

/// Bytes of one block in a GGUF file.
pub const Q4_1_BYTES: usize = 20;
/// Bytes of one block in a GGUF file.
pub const Q8_0_BYTES: usize = 34;

/// Reads Q4_1 blocks from their file bytes.
pub fn parse_q4_1(bytes: &[u8]) -> Vec<BlockQ4_1> {
    bytes
        .chunks_exact(Q4_1_BYTES)
        .map(|b| {
            let mut qs = [0u8; QK / 2];
            qs.copy_from_slice(&b[4..20]);
            BlockQ4_1 {
                d: u16::from_le_bytes([b[0], b[1]]),
                m: u16::from_le_bytes([b[2], b[3]]),
                qs,
            }
        })
        .collect()
}

/// Reads Q8_0 blocks from their file bytes.
pub fn parse_q8_0(bytes: &[u8]) -> Vec<BlockQ8_0> {
    bytes
        .chunks_exact(Q8_0_BYTES)
        .map(|b| {
            let mut qs = [0i8; QK];
            for (q, &byte) in qs.iter_mut().zip(&b[2..34]) {
                *q = byte as i8;
            }
            BlockQ8_0 {
                d: u16::from_le_bytes([b[0], b[1]]),
                qs,
            }
        })
        .collect()
}

fn to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// The 32 values of a Q4_1 block.
pub fn dequantize_q4_1(b: &BlockQ4_1, out: &mut [f32]) {
    let (d, m) = (to_f32(b.d), to_f32(b.m));
    for j in 0..QK / 2 {
        out[j] = (b.qs[j] & 0x0f) as f32 * d + m;
        out[j + QK / 2] = (b.qs[j] >> 4) as f32 * d + m;
    }
}

/// The 32 values of a Q8_0 block.
pub fn dequantize_q8_0(b: &BlockQ8_0, out: &mut [f32]) {
    let d = to_f32(b.d);
    for (o, &q) in out.iter_mut().zip(&b.qs) {
        *o = q as f32 * d;
    }
}

/// Quantizes weights of any other type (after candle dequantized them) to
/// Q8_0, GGML's reference rounding. `x.len()` must be a multiple of 32.
pub fn quantize_q8_0(x: &[f32]) -> Vec<BlockQ8_0> {
    x.chunks_exact(QK)
        .map(|v| {
            let amax = v.iter().fold(0f32, |a, &x| a.max(x.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let mut qs = [0i8; QK];
            for (q, &x) in qs.iter_mut().zip(v) {
                *q = (x * id).round() as i8;
            }
            BlockQ8_0 {
                d: f16::from_f32(d).to_bits(),
                qs,
            }
        })
        .collect()
}

/// Quantizes one block of 32 activations: `d = max|x| / 127`, `q = x / d`
/// rounded half to even (as the SIMD kernel rounds).
pub fn quantize_block(v: &[f32]) -> BlockQ8A {
    let v = &v[..QK];
    let amax = v.iter().fold(0f32, |a, &x| a.max(x.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut b = BlockQ8A::default();
    let mut sum = 0i32;
    for (q, &x) in b.qs.iter_mut().zip(v) {
        let r = (x * id).round_ties_even() as i32;
        *q = r as i8;
        sum += r;
    }
    b.d = d;
    b.s = d * sum as f32;
    b.sum = sum;
    b
}

/// Quantizes one activation row (a multiple of 32 values) into `out`, block
/// by block with the portable code: the definition the kernels' tests hold
/// the fused SIMD paths (`rows`) to.
#[cfg(test)]
pub(super) fn quantize_row(x: &[f32], out: &mut [BlockQ8A]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (v, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        *b = quantize_block(v);
    }
}

/// Dot product of a Q4_1 row with an activation row, portable code.
pub fn dot_q4_1(w: &[BlockQ4_1], a: &[BlockQ8A]) -> f32 {
    let mut acc = 0f32;
    let mut mins = 0f32;
    for (w, a) in w.iter().zip(a) {
        let mut sum = 0i32;
        for j in 0..QK / 2 {
            sum += (w.qs[j] & 0x0f) as i32 * a.qs[j] as i32;
            sum += (w.qs[j] >> 4) as i32 * a.qs[j + QK / 2] as i32;
        }
        acc += to_f32(w.d) * a.d * sum as f32;
        mins += to_f32(w.m) * a.s;
    }
    acc + mins
}

/// Dot product of a Q8_0 row with an activation row, portable code.
pub fn dot_q8_0(w: &[BlockQ8_0], a: &[BlockQ8A]) -> f32 {
    let mut acc = 0f32;
    for (w, a) in w.iter().zip(a) {
        let sum: i32 =
            w.qs.iter()
                .zip(&a.qs)
                .map(|(&x, &y)| x as i32 * y as i32)
                .sum();
        acc += to_f32(w.d) * a.d * sum as f32;
    }
    acc
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A small deterministic generator of values in (-1, 1), for the
    /// kernels' tests.
    pub(in crate::engine::cpu) fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn q4_1_file_bytes_decode_to_d_times_q_plus_m() {
        let mut bytes = vec![0u8; Q4_1_BYTES];
        bytes[0..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        bytes[2..4].copy_from_slice(&f16::from_f32(-1.0).to_bits().to_le_bytes());
        bytes[4] = 0x3a; // element 0: 0xa, element 16: 0x3
        let b = parse_q4_1(&bytes);
        let mut out = [0f32; QK];
        dequantize_q4_1(&b[0], &mut out);
        assert_eq!(out[0], 10.0 * 0.5 - 1.0);
        assert_eq!(out[16], 3.0 * 0.5 - 1.0);
        assert_eq!(out[1], -1.0);
    }

    #[test]
    fn interleaved_blocks_give_back_each_row() {
        let (kb, rows) = (3, 13);
        let w4: Vec<BlockQ4_1> = (0..rows * kb)
            .map(|i| BlockQ4_1 {
                d: i as u16,
                m: 1000 + i as u16,
                qs: std::array::from_fn(|j| (i * 16 + j) as u8),
            })
            .collect();
        let w8: Vec<BlockQ8_0> = (0..rows * kb)
            .map(|i| BlockQ8_0 {
                d: i as u16,
                qs: std::array::from_fn(|j| (i * 32 + j) as i8),
            })
            .collect();
        let (x4, x8) = (interleave_q4_1(&w4, kb), interleave_q8_0(&w8, kb));
        assert_eq!((x4.len(), x8.len()), (2 * kb, 2 * kb));
        for row in 0..rows {
            for b in 0..kb {
                let (g, r) = (row / 8, row % 8);
                let (a, want) = (lane_q4_1(&x4[g * kb + b], r), w4[row * kb + b]);
                assert_eq!((a.d, a.m, a.qs), (want.d, want.m, want.qs));
                let (a, want) = (lane_q8_0(&x8[g * kb + b], r), w8[row * kb + b]);
                assert_eq!((a.d, a.qs), (want.d, want.qs));
            }
        }
    }

    #[test]
    fn integer_dots_match_the_dequantized_dot() {
        let mut seed = 7;
        let x: Vec<f32> = (0..4 * QK).map(|_| lcg(&mut seed)).collect();
        let w: Vec<f32> = (0..4 * QK).map(|_| lcg(&mut seed)).collect();
        let mut a = vec![BlockQ8A::default(); 4];
        quantize_row(&x, &mut a);
        let w8 = quantize_q8_0(&w);
        let mut wd = vec![0f32; 4 * QK];
        for (b, o) in w8.iter().zip(wd.chunks_exact_mut(QK)) {
            dequantize_q8_0(b, o);
        }
        let exact: f32 = wd.iter().zip(&x).map(|(a, b)| a * b).sum();
        // Only the activation rounding separates the two: under 1 %.
        assert!((dot_q8_0(&w8, &a) - exact).abs() < 0.01 * exact.abs().max(1.0));

        let w4: Vec<BlockQ4_1> = (0..4)
            .map(|i| BlockQ4_1 {
                d: f16::from_f32(0.1).to_bits(),
                m: f16::from_f32(-0.8).to_bits(),
                qs: std::array::from_fn(|j| ((i * 16 + j) % 256) as u8),
            })
            .collect();
        let mut wd = vec![0f32; 4 * QK];
        for (b, o) in w4.iter().zip(wd.chunks_exact_mut(QK)) {
            dequantize_q4_1(b, o);
        }
        let exact: f32 = wd.iter().zip(&x).map(|(a, b)| a * b).sum();
        assert!((dot_q4_1(&w4, &a) - exact).abs() < 0.01 * exact.abs().max(1.0));
    }
}
