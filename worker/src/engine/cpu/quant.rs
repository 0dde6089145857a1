//! Weight formats, bit for bit as GGML lays them out in a GGUF file, and the
//! 8-bit quantization of activations that the integer dot products use.
//!
//! Weights stay in the file's blocks in memory (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
//! the K-quants Q4_K, Q5_K, Q6_K, and F16, BF16, F32): decoding reads every
//! weight once per step, so the bytes read (not the arithmetic) bound
//! single-stream speed, and a 4-bit weight is an eighth of an f32 one.
//! Activations are quantized to 8 bits per 32-value block (`BlockQ8A`) for
//! the 32-value formats and per 256-value block (`BlockQ8K`) for the
//! K-quants, as llama.cpp does, so that a block's dot product is integer
//! arithmetic. The `dot_*` functions are the portable kernels and the
//! definition the SIMD ones are tested against; `dequantize_*` are the
//! scalar reference of each layout.
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

// ---- Further block formats, kept as the file stores them. ----

/// GGML Q4_0: 32 weights as `d * (q - 8)` with 4-bit `q`, nibbles as in
/// `BlockQ4_1`.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ4_0 {
    /// Scale, f16 bits.
    pub d: u16,
    pub qs: [u8; QK / 2],
}

/// GGML Q5_0: 32 weights as `d * (q - 16)` with 5-bit `q`: the low four bits
/// as in `BlockQ4_0`, bit 4 of element `j` in bit `j` of `qh` (little endian).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ5_0 {
    /// Scale, f16 bits.
    pub d: u16,
    pub qh: u32,
    pub qs: [u8; QK / 2],
}

/// GGML Q5_1: 32 weights as `d * q + m`, `q` laid out as in `BlockQ5_0`.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ5_1 {
    /// Scale, f16 bits.
    pub d: u16,
    /// Minimum, f16 bits.
    pub m: u16,
    pub qh: u32,
    pub qs: [u8; QK / 2],
}

/// Values per K-quant super-block (and per `BlockQ8K`).
pub const QK_K: usize = 256;

/// GGML Q4_K: 256 weights in eight sub-blocks of 32, sub-block `s` as
/// `d * sc_s * q - dmin * m_s` with 4-bit `q` and 6-bit `sc_s`, `m_s` packed
/// in `scales` (see `scale_min_k4`). Sub-blocks `2k` and `2k + 1` are the
/// low and high nibbles of `qs[32 k..32 k + 32]`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4K {
    /// Super-block scale, f16 bits.
    pub d: u16,
    /// Super-block scale of the minimums, f16 bits.
    pub dmin: u16,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}

/// GGML Q5_K: `BlockQ4K` with a fifth bit per weight: bit `s` of `qh[l]` is
/// bit 4 of element `l` of sub-block `s`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ5K {
    /// Super-block scale, f16 bits.
    pub d: u16,
    /// Super-block scale of the minimums, f16 bits.
    pub dmin: u16,
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// GGML Q6_K: 256 weights in sixteen sub-blocks of 16 as `d * sc * (q - 32)`
/// with 6-bit `q` (low four bits in `ql`, high two in `qh`) and signed 8-bit
/// `sc`; see `dequantize_q6_k` for where each element's bits are.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    /// Super-block scale, f16 bits.
    pub d: u16,
}

/// 256 activations quantized to 8 bits (GGML's Q8_K, what the K-quant
/// products read): `x ≈ d * q`, and `bsums[g]` is the sum of the sixteen `q`
/// of group `g`, which the K-quants' minimums and offsets multiply.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        Self {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        }
    }
}

/// Bytes of one block in a GGUF file.
pub const Q4_0_BYTES: usize = 18;
/// Bytes of one block in a GGUF file.
pub const Q5_0_BYTES: usize = 22;
/// Bytes of one block in a GGUF file.
pub const Q5_1_BYTES: usize = 24;
/// Bytes of one super-block in a GGUF file.
pub const Q4_K_BYTES: usize = 144;
/// Bytes of one super-block in a GGUF file.
pub const Q5_K_BYTES: usize = 176;
/// Bytes of one super-block in a GGUF file.
pub const Q6_K_BYTES: usize = 210;

fn le16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

fn array<const N: usize>(b: &[u8]) -> [u8; N] {
    b[..N].try_into().expect("slice of N bytes")
}

/// Reads Q4_0 blocks from their file bytes.
pub fn parse_q4_0(bytes: &[u8]) -> Vec<BlockQ4_0> {
    bytes
        .chunks_exact(Q4_0_BYTES)
        .map(|b| BlockQ4_0 {
            d: le16(b),
            qs: array(&b[2..]),
        })
        .collect()
}

/// Reads Q5_0 blocks from their file bytes.
pub fn parse_q5_0(bytes: &[u8]) -> Vec<BlockQ5_0> {
    bytes
        .chunks_exact(Q5_0_BYTES)
        .map(|b| BlockQ5_0 {
            d: le16(b),
            qh: u32::from_le_bytes(array(&b[2..])),
            qs: array(&b[6..]),
        })
        .collect()
}

/// Reads Q5_1 blocks from their file bytes.
pub fn parse_q5_1(bytes: &[u8]) -> Vec<BlockQ5_1> {
    bytes
        .chunks_exact(Q5_1_BYTES)
        .map(|b| BlockQ5_1 {
            d: le16(b),
            m: le16(&b[2..]),
            qh: u32::from_le_bytes(array(&b[4..])),
            qs: array(&b[8..]),
        })
        .collect()
}

/// Reads Q4_K super-blocks from their file bytes.
pub fn parse_q4_k(bytes: &[u8]) -> Vec<BlockQ4K> {
    bytes
        .chunks_exact(Q4_K_BYTES)
        .map(|b| BlockQ4K {
            d: le16(b),
            dmin: le16(&b[2..]),
            scales: array(&b[4..]),
            qs: array(&b[16..]),
        })
        .collect()
}

/// Reads Q5_K super-blocks from their file bytes.
pub fn parse_q5_k(bytes: &[u8]) -> Vec<BlockQ5K> {
    bytes
        .chunks_exact(Q5_K_BYTES)
        .map(|b| BlockQ5K {
            d: le16(b),
            dmin: le16(&b[2..]),
            scales: array(&b[4..]),
            qh: array(&b[16..]),
            qs: array(&b[48..]),
        })
        .collect()
}

/// Reads Q6_K super-blocks from their file bytes.
pub fn parse_q6_k(bytes: &[u8]) -> Vec<BlockQ6K> {
    bytes
        .chunks_exact(Q6_K_BYTES)
        .map(|b| BlockQ6K {
            ql: array(b),
            qh: array(&b[128..]),
            scales: array::<16>(&b[192..]).map(|s| s as i8),
            d: le16(&b[208..]),
        })
        .collect()
}

/// An F16 weight's bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16Bits(pub u16);

/// A BF16 weight's bits (the top half of an f32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16Bits(pub u16);

/// Reads little-endian F16 weights.
pub fn parse_f16(bytes: &[u8]) -> Vec<F16Bits> {
    bytes.chunks_exact(2).map(|b| F16Bits(le16(b))).collect()
}

/// Reads little-endian BF16 weights.
pub fn parse_bf16(bytes: &[u8]) -> Vec<Bf16Bits> {
    bytes.chunks_exact(2).map(|b| Bf16Bits(le16(b))).collect()
}

/// Reads little-endian F32 weights.
pub fn parse_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(array(b)))
        .collect()
}

/// A bf16 value's f32.
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// An f16 value's f32.
pub fn f16_to_f32(bits: u16) -> f32 {
    to_f32(bits)
}

/// The 32 values of a Q4_0 block.
pub fn dequantize_q4_0(b: &BlockQ4_0, out: &mut [f32]) {
    let d = to_f32(b.d);
    for j in 0..QK / 2 {
        out[j] = ((b.qs[j] & 0x0f) as i32 - 8) as f32 * d;
        out[j + QK / 2] = ((b.qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// The 5-bit values of a Q5_0 or Q5_1 block, in element order.
fn q5_values(qh: u32, qs: &[u8; QK / 2]) -> [u8; QK] {
    std::array::from_fn(|j| {
        let low = if j < QK / 2 {
            qs[j] & 0x0f
        } else {
            qs[j - QK / 2] >> 4
        };
        low | (((qh >> j) & 1) as u8) << 4
    })
}

/// The 32 values of a Q5_0 block.
pub fn dequantize_q5_0(b: &BlockQ5_0, out: &mut [f32]) {
    let d = to_f32(b.d);
    for (o, q) in out.iter_mut().zip(q5_values(b.qh, &b.qs)) {
        *o = (q as i32 - 16) as f32 * d;
    }
}

/// The 32 values of a Q5_1 block.
pub fn dequantize_q5_1(b: &BlockQ5_1, out: &mut [f32]) {
    let (d, m) = (to_f32(b.d), to_f32(b.m));
    for (o, q) in out.iter_mut().zip(q5_values(b.qh, &b.qs)) {
        *o = q as f32 * d + m;
    }
}

/// Scale and minimum of sub-block `j` (0..8) of a Q4_K or Q5_K super-block:
/// six bits each; sub-blocks 0..4 in the low bits of bytes `j` and `j + 4`,
/// sub-blocks 4..8 in the nibbles of byte `j + 4` with their top two bits in
/// the high bits of bytes `j - 4` and `j`.
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 256 values of a Q4_K super-block.
pub fn dequantize_q4_k(b: &BlockQ4K, out: &mut [f32]) {
    let (d, dmin) = (to_f32(b.d), to_f32(b.dmin));
    for s in 0..8 {
        let (sc, m) = scale_min_k4(s, &b.scales);
        let (scale, min) = (d * sc as f32, dmin * m as f32);
        let qs = &b.qs[32 * (s / 2)..32 * (s / 2) + 32];
        for (l, o) in out[32 * s..32 * s + 32].iter_mut().enumerate() {
            let q = if s % 2 == 0 { qs[l] & 0x0f } else { qs[l] >> 4 };
            *o = scale * q as f32 - min;
        }
    }
}

/// The 256 values of a Q5_K super-block.
pub fn dequantize_q5_k(b: &BlockQ5K, out: &mut [f32]) {
    let (d, dmin) = (to_f32(b.d), to_f32(b.dmin));
    for s in 0..8 {
        let (sc, m) = scale_min_k4(s, &b.scales);
        let (scale, min) = (d * sc as f32, dmin * m as f32);
        let qs = &b.qs[32 * (s / 2)..32 * (s / 2) + 32];
        for (l, o) in out[32 * s..32 * s + 32].iter_mut().enumerate() {
            let low = if s % 2 == 0 { qs[l] & 0x0f } else { qs[l] >> 4 };
            let q = low | ((b.qh[l] >> s) & 1) << 4;
            *o = scale * q as f32 - min;
        }
    }
}

/// The 6-bit value of element `e` (0..256) of a Q6_K super-block: in each
/// half of 128, element `32 k + l` has its low four bits in `ql[l + 32 (k % 2)]`
/// (low nibble for k < 2, high for k >= 2) and its high two bits at bit `2 k`
/// of `qh[l]`.
pub fn q6_k_value(b: &BlockQ6K, e: usize) -> u8 {
    let (half, k, l) = (e / 128, (e % 128) / 32, e % 32);
    let ql = b.ql[64 * half + l + 32 * (k % 2)];
    let low = if k < 2 { ql & 0x0f } else { ql >> 4 };
    let high = (b.qh[32 * half + l] >> (2 * k)) & 3;
    low | high << 4
}

/// The 256 values of a Q6_K super-block.
pub fn dequantize_q6_k(b: &BlockQ6K, out: &mut [f32]) {
    let d = to_f32(b.d);
    for (e, o) in out[..QK_K].iter_mut().enumerate() {
        *o = d * b.scales[e / 16] as f32 * (q6_k_value(b, e) as i32 - 32) as f32;
    }
}

/// Quantizes 256 activations to one `BlockQ8K`: `d = max|x| / 127`, `q = x / d`
/// rounded half to even.
pub fn quantize_block_k(v: &[f32]) -> BlockQ8K {
    let v = &v[..QK_K];
    let amax = v.iter().fold(0f32, |a, &x| a.max(x.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut b = BlockQ8K {
        d,
        ..Default::default()
    };
    for (q, &x) in b.qs.iter_mut().zip(v) {
        *q = (x * id).round_ties_even() as i8;
    }
    for (s, g) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
        *s = g.iter().map(|&q| q as i16).sum();
    }
    b
}

/// Dot product of a Q4_0 row with an activation row, portable code.
pub fn dot_q4_0(w: &[BlockQ4_0], a: &[BlockQ8A]) -> f32 {
    let mut acc = 0f32;
    for (w, a) in w.iter().zip(a) {
        let mut sum = 0i32;
        for j in 0..QK / 2 {
            sum += ((w.qs[j] & 0x0f) as i32 - 8) * a.qs[j] as i32;
            sum += ((w.qs[j] >> 4) as i32 - 8) * a.qs[j + QK / 2] as i32;
        }
        acc += to_f32(w.d) * a.d * sum as f32;
    }
    acc
}

/// Dot product of a Q5_0 row with an activation row, portable code.
pub fn dot_q5_0(w: &[BlockQ5_0], a: &[BlockQ8A]) -> f32 {
    let mut acc = 0f32;
    for (w, a) in w.iter().zip(a) {
        let q = q5_values(w.qh, &w.qs);
        let sum: i32 = q
            .iter()
            .zip(&a.qs)
            .map(|(&q, &x)| (q as i32 - 16) * x as i32)
            .sum();
        acc += to_f32(w.d) * a.d * sum as f32;
    }
    acc
}

/// Dot product of a Q5_1 row with an activation row, portable code.
pub fn dot_q5_1(w: &[BlockQ5_1], a: &[BlockQ8A]) -> f32 {
    let (mut acc, mut mins) = (0f32, 0f32);
    for (w, a) in w.iter().zip(a) {
        let q = q5_values(w.qh, &w.qs);
        let sum: i32 = q
            .iter()
            .zip(&a.qs)
            .map(|(&q, &x)| q as i32 * x as i32)
            .sum();
        acc += to_f32(w.d) * a.d * sum as f32;
        mins += to_f32(w.m) * a.s;
    }
    acc + mins
}

/// Dot product of a Q4_K or Q5_K super-block (its 256 unsigned values `q`,
/// scales and minimums) with a `BlockQ8K`.
fn dot_k_minned(d: u16, dmin: u16, scales: &[u8; 12], q: &[u8; QK_K], a: &BlockQ8K) -> f32 {
    let (mut sum, mut mins) = (0i32, 0i32);
    for s in 0..8 {
        let (sc, m) = scale_min_k4(s, scales);
        let part: i32 = (32 * s..32 * s + 32)
            .map(|e| q[e] as i32 * a.qs[e] as i32)
            .sum();
        sum += sc as i32 * part;
        mins += m as i32 * (a.bsums[2 * s] as i32 + a.bsums[2 * s + 1] as i32);
    }
    a.d * (to_f32(d) * sum as f32 - to_f32(dmin) * mins as f32)
}

/// Dot product of a Q4_K row with an activation row, portable code.
pub fn dot_q4_k(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
    w.iter()
        .zip(a)
        .map(|(w, a)| {
            let q = std::array::from_fn(|e| {
                let byte = w.qs[32 * (e / 64) + e % 32];
                if (e / 32) % 2 == 0 {
                    byte & 0x0f
                } else {
                    byte >> 4
                }
            });
            dot_k_minned(w.d, w.dmin, &w.scales, &q, a)
        })
        .sum()
}

/// Dot product of a Q5_K row with an activation row, portable code.
pub fn dot_q5_k(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
    w.iter()
        .zip(a)
        .map(|(w, a)| {
            let q = std::array::from_fn(|e| {
                let byte = w.qs[32 * (e / 64) + e % 32];
                let low = if (e / 32) % 2 == 0 {
                    byte & 0x0f
                } else {
                    byte >> 4
                };
                low | ((w.qh[e % 32] >> (e / 32)) & 1) << 4
            });
            dot_k_minned(w.d, w.dmin, &w.scales, &q, a)
        })
        .sum()
}

/// Dot product of a Q6_K row with an activation row, portable code.
pub fn dot_q6_k(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
    w.iter()
        .zip(a)
        .map(|(w, a)| {
            let mut sum = 0i32;
            for g in 0..16 {
                let part: i32 = (16 * g..16 * g + 16)
                    .map(|e| (q6_k_value(w, e) as i32 - 32) * a.qs[e] as i32)
                    .sum();
                sum += w.scales[g] as i32 * part;
            }
            a.d * to_f32(w.d) * sum as f32
        })
        .sum()
}

/// Dot product of a float row (f32 values of `w`) with float activations.
pub fn dot_f32(w: impl Iterator<Item = f32>, x: &[f32]) -> f32 {
    w.zip(x).map(|(w, x)| w * x).sum()
}

/// Block `b` of eight consecutive Q4_0 rows, interleaved like `BlockQ4_1x8`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4_0x8 {
    /// Scales of the eight rows, f16 bits.
    pub d: [u16; 8],
    pub qs: [u8; 128],
}

/// Block `b` of eight consecutive Q5_0 rows: `qs` interleaved like
/// `BlockQ4_1x8`, and the fifth bits in the same order: bit `4 r + e` of
/// `qh[2 c]` is row `r`'s bit of element `4 c + e`, of `qh[2 c + 1]` its bit
/// of element `16 + 4 c + e` (the low and high nibbles of `qs` chunk `c`).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ5_0x8 {
    /// Scales of the eight rows, f16 bits.
    pub d: [u16; 8],
    pub qh: [u32; 8],
    pub qs: [u8; 128],
}

/// Block `b` of eight consecutive Q5_1 rows, interleaved like `BlockQ5_0x8`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ5_1x8 {
    /// Scales of the eight rows, f16 bits.
    pub d: [u16; 8],
    /// Minimums of the eight rows, f16 bits.
    pub m: [u16; 8],
    pub qh: [u32; 8],
    pub qs: [u8; 128],
}

/// The fifth bits of eight rows' Q5 blocks in `BlockQ5_0x8`'s order.
fn interleave_qh(qh: [u32; 8]) -> [u32; 8] {
    let mut out = [0u32; 8];
    for c in 0..4 {
        for (r, &h) in qh.iter().enumerate() {
            for e in 0..4 {
                out[2 * c] |= ((h >> (4 * c + e)) & 1) << (4 * r + e);
                out[2 * c + 1] |= ((h >> (16 + 4 * c + e)) & 1) << (4 * r + e);
            }
        }
    }
    out
}

/// Row `r`'s fifth bits out of interleaved ones (`interleave_qh` undone).
fn lane_qh(qh: &[u32; 8], r: usize) -> u32 {
    let mut h = 0;
    for c in 0..4 {
        for e in 0..4 {
            h |= ((qh[2 * c] >> (4 * r + e)) & 1) << (4 * c + e);
            h |= ((qh[2 * c + 1] >> (4 * r + e)) & 1) << (16 + 4 * c + e);
        }
    }
    h
}

/// Interleaves a Q4_0 matrix of rows of `kb` blocks, padded like
/// `interleave_q4_1`.
pub fn interleave_q4_0(w: &[BlockQ4_0], kb: usize) -> Vec<BlockQ4_0x8> {
    interleave(w, kb, |rows| BlockQ4_0x8 {
        d: rows.map(|b| b.d),
        qs: interleave_qs(rows.map(|b| &b.qs[..])),
    })
}

/// Interleaves a Q5_0 matrix of rows of `kb` blocks, padded like
/// `interleave_q4_1`.
pub fn interleave_q5_0(w: &[BlockQ5_0], kb: usize) -> Vec<BlockQ5_0x8> {
    interleave(w, kb, |rows| BlockQ5_0x8 {
        d: rows.map(|b| b.d),
        qh: interleave_qh(rows.map(|b| b.qh)),
        qs: interleave_qs(rows.map(|b| &b.qs[..])),
    })
}

/// Interleaves a Q5_1 matrix of rows of `kb` blocks, padded like
/// `interleave_q4_1`.
pub fn interleave_q5_1(w: &[BlockQ5_1], kb: usize) -> Vec<BlockQ5_1x8> {
    interleave(w, kb, |rows| BlockQ5_1x8 {
        d: rows.map(|b| b.d),
        m: rows.map(|b| b.m),
        qh: interleave_qh(rows.map(|b| b.qh)),
        qs: interleave_qs(rows.map(|b| &b.qs[..])),
    })
}

/// Row `r` (0..8) of an interleaved Q4_0 block, as a plain block.
pub fn lane_q4_0(b: &BlockQ4_0x8, r: usize) -> BlockQ4_0 {
    BlockQ4_0 {
        d: b.d[r],
        qs: lane_qs(&b.qs, r),
    }
}

/// Row `r` (0..8) of an interleaved Q5_0 block, as a plain block.
pub fn lane_q5_0(b: &BlockQ5_0x8, r: usize) -> BlockQ5_0 {
    BlockQ5_0 {
        d: b.d[r],
        qh: lane_qh(&b.qh, r),
        qs: lane_qs(&b.qs, r),
    }
}

/// Row `r` (0..8) of an interleaved Q5_1 block, as a plain block.
pub fn lane_q5_1(b: &BlockQ5_1x8, r: usize) -> BlockQ5_1 {
    BlockQ5_1 {
        d: b.d[r],
        m: b.m[r],
        qh: lane_qh(&b.qh, r),
        qs: lane_qs(&b.qs, r),
    }
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

    fn f16_bytes(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_bits().to_le_bytes()
    }

    /// GGML's layouts, from hand-made file bytes: where each element's bits
    /// and each sub-block's scale sit.
    #[test]
    fn file_bytes_decode_as_ggml_lays_them_out() {
        let mut out = [0f32; QK_K];
        // Q4_0: d * (q - 8), element 16 is byte 0's high nibble.
        let mut b = vec![0u8; Q4_0_BYTES];
        b[0..2].copy_from_slice(&f16_bytes(0.5));
        b[2] = 0x3a;
        dequantize_q4_0(&parse_q4_0(&b)[0], &mut out);
        assert_eq!((out[0], out[16], out[1]), (1.0, -2.5, -4.0));
        // Q5_0 / Q5_1: bit j of qh (little endian) is element j's bit 4.
        let mut b = vec![0u8; Q5_1_BYTES];
        b[0..2].copy_from_slice(&f16_bytes(0.5));
        b[2..4].copy_from_slice(&f16_bytes(1.0));
        b[4..8].copy_from_slice(&(1u32 | 1 << 17).to_le_bytes());
        b[8] = 0x3a;
        b[9] = 0x20;
        dequantize_q5_1(&parse_q5_1(&b)[0], &mut out);
        assert_eq!(
            (out[0], out[16], out[17], out[1]),
            (13.0 + 1.0, 2.5, 9.0 + 1.0, 1.0)
        );
        let mut b0 = vec![0u8; Q5_0_BYTES];
        b0[0..2].copy_from_slice(&f16_bytes(0.5));
        b0[2..6].copy_from_slice(&(1u32 | 1 << 17).to_le_bytes());
        b0[6] = 0x3a;
        b0[7] = 0x20;
        dequantize_q5_0(&parse_q5_0(&b0)[0], &mut out);
        assert_eq!((out[0], out[16], out[17], out[1]), (5.0, -6.5, 1.0, -8.0));
        // Q4_K: sub-block 4's six-bit scale and minimum are split over
        // scales[8] (low bits) and the top bits of scales[0] and scales[4].
        let mut b = vec![0u8; Q4_K_BYTES];
        b[0..2].copy_from_slice(&f16_bytes(0.5));
        b[2..4].copy_from_slice(&f16_bytes(0.25));
        b[4] = 0b11_000101; // sc0 = 5, top of sc4 = 3
        b[4 + 4] = 0b10_000011; // m0 = 3, top of m4 = 2
        b[4 + 8] = 0x27; // sc4 low = 7, m4 low = 2
        b[16] = 0x4a; // element 0: 10 (sub-block 0), element 32: 4 (sub-block 1)
        b[16 + 64] = 0x09; // element 128: 9 (sub-block 4)
        let k4 = &parse_q4_k(&b)[0];
        assert_eq!(scale_min_k4(4, &k4.scales), (55, 34));
        dequantize_q4_k(k4, &mut out);
        assert_eq!(out[0], 0.5 * 5.0 * 10.0 - 0.25 * 3.0);
        assert_eq!(out[128], 0.5 * 55.0 * 9.0 - 0.25 * 34.0);
        // Q5_K: bit s of qh[l] is bit 4 of element l of sub-block s.
        let mut b5 = vec![0u8; Q5_K_BYTES];
        b5[..16].copy_from_slice(&b[..16]);
        b5[16 + 3] = 1 << 4; // element 4 * 32 + 3
        b5[48 + 64 + 3] = 0x01;
        dequantize_q5_k(&parse_q5_k(&b5)[0], &mut out);
        assert_eq!(out[131], 0.5 * 55.0 * 17.0 - 0.25 * 34.0);
        // Q6_K: element 200 = 128 + 2 * 32 + 8: high nibble of ql[64 + 8],
        // bits 4 and 5 of qh[32 + 8], scale 200 / 16.
        let mut b = vec![0u8; Q6_K_BYTES];
        b[72] = 0xb0;
        b[128 + 40] = 0b0010_0000;
        b[192 + 12] = (-3i8) as u8;
        b[208..210].copy_from_slice(&f16_bytes(0.25));
        let k6 = &parse_q6_k(&b)[0];
        assert_eq!(q6_k_value(k6, 200), 43);
        dequantize_q6_k(k6, &mut out);
        assert_eq!(out[200], 0.25 * -3.0 * 11.0);
        assert_eq!(out[0], 0.0); // scale 0
    }

    #[test]
    fn q8_k_blocks_hold_sixteen_group_sums() {
        let mut seed = 9;
        let x: Vec<f32> = (0..QK_K).map(|_| lcg(&mut seed)).collect();
        let b = quantize_block_k(&x);
        for (g, s) in b.bsums.iter().enumerate() {
            let want: i16 = b.qs[16 * g..16 * g + 16].iter().map(|&q| q as i16).sum();
            assert_eq!(*s, want);
        }
        for (&q, &v) in b.qs.iter().zip(&x) {
            assert!((q as f32 * b.d - v).abs() <= 0.5 * b.d + 1e-6);
        }
        assert_eq!(b.qs.iter().map(|q| q.unsigned_abs()).max(), Some(127));
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
