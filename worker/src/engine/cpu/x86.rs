//! AVX2 kernels for the weight matrices' products (x86_64 with AVX2, FMA and
//! F16C, checked at run time by `matmul`): the 32-value block formats on
//! weights interleaved by eight rows (`quant::BlockQ4_0x8` and its kin), the
//! K-quants and the float formats row by row as stored; and the row-wise and
//! attention kernels of the CPU backend.
//!
//! A weight block is unpacked into a register once and multiplied with up to
//! four activation rows (the batch's tokens), so a batched decode step reads
//! each weight once however many sequences it carries. Each output element is
//! computed by the same instruction sequence whatever the tile size, so a
//! sequence's numbers do not depend on what else shares its batch.
use super::attention::KvHead;
use super::quant::{
    self, Bf16Bits, BlockQ4K, BlockQ4_0x8, BlockQ4_1x8, BlockQ5K, BlockQ5_0x8, BlockQ5_1x8,
    BlockQ6K, BlockQ8A, BlockQ8K, BlockQ8_0x8, F16Bits, QK_K,
};
use std::arch::x86_64::*;
use std::ops::Range;

/// Activation rows per tile: the rows whose blocks stay in L1 while a chunk of
/// weight rows passes over them.
const TILE: usize = 16;

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// Stores the first `lanes` of `v` (eight, except in a matrix's last,
/// padded group of rows).
#[inline(always)]
unsafe fn store(out: *mut f32, v: __m256, lanes: usize) {
    if lanes == 8 {
        _mm256_storeu_ps(out, v);
    } else {
        let mut tmp = [0f32; 8];
        _mm256_storeu_ps(tmp.as_mut_ptr(), v);
        std::ptr::copy_nonoverlapping(tmp.as_ptr(), out, lanes);
    }
}

/// An interleaved block of eight rows of 32 unsigned 4- or 5-bit values,
/// each weight `d * q + m`, as `tile_nibbles_x8` reads it.
trait NibblesX8 {
    /// Whether values have five bits (the i16 sums must then be widened per
    /// chunk: 8 * 2 * 31 * 128 overflows i16).
    const WIDE: bool;
    /// The values of chunk `c` (0..4): low nibbles (elements `4 c + e`) and
    /// high nibbles (elements `16 + 4 c + e`), one byte each.
    unsafe fn chunk(&self, c: usize) -> (__m256i, __m256i);
    /// The eight rows' scales `d` and offsets `m`.
    unsafe fn scales(&self) -> (__m256, __m256);
}

#[inline(always)]
unsafe fn nibbles(qs: &[u8; 128], c: usize) -> (__m256i, __m256i) {
    let m4 = _mm256_set1_epi8(0x0f);
    let raw = _mm256_loadu_si256(qs.as_ptr().add(32 * c) as *const __m256i);
    (
        _mm256_and_si256(raw, m4),
        _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4),
    )
}

/// Byte `k` of the result is 0x10 where bit `k` of `bits` is set (a fifth
/// bit moved into place).
#[inline(always)]
unsafe fn fifth_bits(bits: u32) -> __m256i {
    // Byte k gets byte k / 8 of `bits` (each 128-bit lane holds all four).
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        ),
    );
    let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let hit = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    _mm256_and_si256(hit, _mm256_set1_epi8(0x10))
}

#[inline(always)]
unsafe fn half8(bits: &[u16; 8]) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(bits.as_ptr() as *const __m128i))
}

impl NibblesX8 for BlockQ4_1x8 {
    const WIDE: bool = false;
    #[inline(always)]
    unsafe fn chunk(&self, c: usize) -> (__m256i, __m256i) {
        nibbles(&self.qs, c)
    }
    #[inline(always)]
    unsafe fn scales(&self) -> (__m256, __m256) {
        (half8(&self.d), half8(&self.m))
    }
}

impl NibblesX8 for BlockQ4_0x8 {
    const WIDE: bool = false;
    #[inline(always)]
    unsafe fn chunk(&self, c: usize) -> (__m256i, __m256i) {
        nibbles(&self.qs, c)
    }
    #[inline(always)]
    unsafe fn scales(&self) -> (__m256, __m256) {
        // d * (q - 8) = d * q + (-8 d), exactly (a power of two).
        let d = half8(&self.d);
        (d, _mm256_mul_ps(d, _mm256_set1_ps(-8.0)))
    }
}

impl NibblesX8 for BlockQ5_0x8 {
    const WIDE: bool = true;
    #[inline(always)]
    unsafe fn chunk(&self, c: usize) -> (__m256i, __m256i) {
        let (lo, hi) = nibbles(&self.qs, c);
        (
            _mm256_or_si256(lo, fifth_bits(self.qh[2 * c])),
            _mm256_or_si256(hi, fifth_bits(self.qh[2 * c + 1])),
        )
    }
    #[inline(always)]
    unsafe fn scales(&self) -> (__m256, __m256) {
        let d = half8(&self.d);
        (d, _mm256_mul_ps(d, _mm256_set1_ps(-16.0)))
    }
}

impl NibblesX8 for BlockQ5_1x8 {
    const WIDE: bool = true;
    #[inline(always)]
    unsafe fn chunk(&self, c: usize) -> (__m256i, __m256i) {
        let (lo, hi) = nibbles(&self.qs, c);
        (
            _mm256_or_si256(lo, fifth_bits(self.qh[2 * c])),
            _mm256_or_si256(hi, fifth_bits(self.qh[2 * c + 1])),
        )
    }
    #[inline(always)]
    unsafe fn scales(&self) -> (__m256, __m256) {
        (half8(&self.d), half8(&self.m))
    }
}

/// Eight interleaved rows of 4- or 5-bit values (Q4_0, Q4_1, Q5_0, Q5_1)
/// against up to four activation rows: writes eight consecutive outputs per
/// activation row.
#[inline(always)]
unsafe fn tile_nibbles_x8<B: NibblesX8, const R: usize, const VNNI: bool>(
    w: &[B],
    a: &[BlockQ8A],
    kb: usize,
    out: *mut f32,
    ld: usize,
    lanes: usize,
) {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    for (b, wb) in w.iter().enumerate() {
        // Integer phase: per activation row, the eight rows' block sums:
        // with VNNI in i32 lanes directly, else in i16 lanes (4-bit values:
        // at most 8 * 2 * 15 * 128 = 30720, no overflow) widened at the end,
        // or per chunk for 5-bit values.
        let mut sums = [_mm256_setzero_si256(); R];
        for c in 0..4 {
            let (lo, hi) = wb.chunk(c);
            for i in 0..R {
                let ap = a.get_unchecked(i * kb + b).qs.as_ptr() as *const i32;
                let x_lo = _mm256_set1_epi32(ap.add(c).read_unaligned());
                let x_hi = _mm256_set1_epi32(ap.add(4 + c).read_unaligned());
                if VNNI {
                    sums[i] = _mm256_dpbusd_epi32(sums[i], lo, x_lo);
                    sums[i] = _mm256_dpbusd_epi32(sums[i], hi, x_hi);
                } else {
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, x_lo),
                        _mm256_maddubs_epi16(hi, x_hi),
                    );
                    sums[i] = if B::WIDE {
                        _mm256_add_epi32(sums[i], _mm256_madd_epi16(p, ones))
                    } else {
                        _mm256_add_epi16(sums[i], p)
                    };
                }
            }
        }
        let (d, m) = wb.scales();
        for i in 0..R {
            let ab = a.get_unchecked(i * kb + b);
            let isum = if VNNI || B::WIDE {
                sums[i]
            } else {
                _mm256_madd_epi16(sums[i], ones)
            };
            let dot = _mm256_cvtepi32_ps(isum);
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(ab.d)), dot, acc[i]);
            acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(ab.s), acc[i]);
        }
    }
    for i in 0..R {
        store(out.add(i * ld), acc[i], lanes);
    }
}

/// Eight interleaved Q8_0 rows against up to four activation rows.
#[inline(always)]
unsafe fn tile_q8_0x8<const R: usize, const VNNI: bool>(
    w: &[BlockQ8_0x8],
    a: &[BlockQ8A],
    kb: usize,
    out: *mut f32,
    ld: usize,
    lanes: usize,
) {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    for (b, wb) in w.iter().enumerate() {
        let mut sums = [_mm256_setzero_si256(); R];
        for c in 0..8 {
            let wq = _mm256_loadu_si256(wb.qs.as_ptr().add(32 * c) as *const __m256i);
            // maddubs multiplies unsigned by signed: move w's sign onto x.
            let wabs = _mm256_sign_epi8(wq, wq);
            for i in 0..R {
                let ap = a.get_unchecked(i * kb + b).qs.as_ptr() as *const i32;
                let x = _mm256_sign_epi8(_mm256_set1_epi32(ap.add(c).read_unaligned()), wq);
                sums[i] = if VNNI {
                    _mm256_dpbusd_epi32(sums[i], wabs, x)
                } else {
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, x), ones);
                    _mm256_add_epi32(sums[i], p)
                };
            }
        }
        let d = _mm256_cvtph_ps(_mm_loadu_si128(wb.d.as_ptr() as *const __m128i));
        for i in 0..R {
            let ab = a.get_unchecked(i * kb + b);
            let dot = _mm256_cvtepi32_ps(sums[i]);
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(ab.d)), dot, acc[i]);
        }
    }
    for i in 0..R {
        store(out.add(i * ld), acc[i], lanes);
    }
}

macro_rules! groups_kernel {
    ($name:ident, $block:ty, $tile:ident $(<$g:ty>)?, $vnni:literal, $features:literal) => {
        /// Groups of eight interleaved weight rows (`groups`, each `kb`
        /// blocks; the matrix has `rows` rows, so its last group may be
        /// padded) against all `n` activation rows of `a`:
        /// `out[i * ld + 8 g + r]` for i < n, g in `groups`, 8 g + r < `rows`.
        ///
        /// # Safety
        /// The CPU must have the features enabled below; `w` holds the
        /// groups, `a` holds `n * kb` blocks, and `out` is valid for those
        /// writes.
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = $features)]
        pub unsafe fn $name(
            w: &[$block],
            kb: usize,
            groups: Range<usize>,
            rows: usize,
            a: &[BlockQ8A],
            n: usize,
            out: *mut f32,
            ld: usize,
        ) {
            let mut t0 = 0;
            while t0 < n {
                let t1 = (t0 + TILE).min(n);
                for g in groups.clone() {
                    let wg = w.get_unchecked(g * kb..(g + 1) * kb);
                    let lanes = (rows - 8 * g).min(8);
                    let mut i = t0;
                    while i + 4 <= t1 {
                        let o = out.add(i * ld + 8 * g);
                        $tile::<$($g,)? 4, $vnni>(wg, &a[i * kb..], kb, o, ld, lanes);
                        i += 4;
                    }
                    let (ar, o) = (&a[i * kb..], out.add(i * ld + 8 * g));
                    match t1 - i {
                        3 => $tile::<$($g,)? 3, $vnni>(wg, ar, kb, o, ld, lanes),
                        2 => $tile::<$($g,)? 2, $vnni>(wg, ar, kb, o, ld, lanes),
                        1 => $tile::<$($g,)? 1, $vnni>(wg, ar, kb, o, ld, lanes),
                        _ => {}
                    }
                }
                t0 = t1;
            }
        }
    };
}

groups_kernel!(
    groups_q4_0x8,
    BlockQ4_0x8,
    tile_nibbles_x8<BlockQ4_0x8>,
    false,
    "avx2,fma,f16c"
);
groups_kernel!(
    groups_q4_1x8,
    BlockQ4_1x8,
    tile_nibbles_x8<BlockQ4_1x8>,
    false,
    "avx2,fma,f16c"
);
groups_kernel!(
    groups_q5_0x8,
    BlockQ5_0x8,
    tile_nibbles_x8<BlockQ5_0x8>,
    false,
    "avx2,fma,f16c"
);
groups_kernel!(
    groups_q5_1x8,
    BlockQ5_1x8,
    tile_nibbles_x8<BlockQ5_1x8>,
    false,
    "avx2,fma,f16c"
);
groups_kernel!(
    groups_q8_0x8,
    BlockQ8_0x8,
    tile_q8_0x8,
    false,
    "avx2,fma,f16c"
);
groups_kernel!(
    groups_q4_0x8_vnni,
    BlockQ4_0x8,
    tile_nibbles_x8<BlockQ4_0x8>,
    true,
    "avx2,fma,f16c,avx512vnni,avx512vl"
);
groups_kernel!(
    groups_q4_1x8_vnni,
    BlockQ4_1x8,
    tile_nibbles_x8<BlockQ4_1x8>,
    true,
    "avx2,fma,f16c,avx512vnni,avx512vl"
);
groups_kernel!(
    groups_q5_0x8_vnni,
    BlockQ5_0x8,
    tile_nibbles_x8<BlockQ5_0x8>,
    true,
    "avx2,fma,f16c,avx512vnni,avx512vl"
);
groups_kernel!(
    groups_q5_1x8_vnni,
    BlockQ5_1x8,
    tile_nibbles_x8<BlockQ5_1x8>,
    true,
    "avx2,fma,f16c,avx512vnni,avx512vl"
);
groups_kernel!(
    groups_q8_0x8_vnni,
    BlockQ8_0x8,
    tile_q8_0x8,
    true,
    "avx2,fma,f16c,avx512vnni,avx512vl"
);

/// The eight 6-bit scales and minimums of a Q4_K or Q5_K super-block.
#[inline(always)]
fn scales_mins(scales: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let sm: [(u8, u8); 8] = std::array::from_fn(|j| quant::scale_min_k4(j, scales));
    (sm.map(|p| p.0), sm.map(|p| p.1))
}

/// Σ m_s * (the activation sum of sub-block s), for a Q4_K or Q5_K minimum.
#[inline(always)]
fn min_sum(mins: &[u8; 8], a: &BlockQ8K) -> i32 {
    (0..8)
        .map(|s| mins[s] as i32 * (a.bsums[2 * s] as i32 + a.bsums[2 * s + 1] as i32))
        .sum()
}

/// A weight row of K-quant super-blocks against up to four Q8_K activation
/// rows: `out[i * ld]` for i < R. `FIVE` selects Q5_K (`w5`) over Q4_K (`w4`).
#[inline(always)]
unsafe fn tile_q45_k<const R: usize, const FIVE: bool>(
    w4: &[BlockQ4K],
    w5: &[BlockQ5K],
    a: &[BlockQ8K],
    kb: usize,
    out: *mut f32,
    ld: usize,
) {
    let m4 = _mm256_set1_epi8(0x0f);
    let one = _mm256_set1_epi8(1);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut minus = [0f32; R];
    for b in 0..kb {
        let (d, dmin, scales, qs, qh) = if FIVE {
            let w = w5.get_unchecked(b);
            (w.d, w.dmin, &w.scales, &w.qs, Some(&w.qh))
        } else {
            let w = w4.get_unchecked(b);
            (w.d, w.dmin, &w.scales, &w.qs, None)
        };
        let (sc, mn) = scales_mins(scales);
        let mut high = match qh {
            Some(h) => _mm256_loadu_si256(h.as_ptr() as *const __m256i),
            None => _mm256_setzero_si256(),
        };
        let mut sums = [_mm256_setzero_si256(); R];
        for k in 0..4 {
            let raw = _mm256_loadu_si256(qs.as_ptr().add(32 * k) as *const __m256i);
            let mut lo = _mm256_and_si256(raw, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if FIVE {
                // Bits 2k and 2k + 1 of each qh byte (shifted down by 2 per
                // k; bits crossing from the upper byte are masked off).
                let b0 = _mm256_and_si256(high, one);
                let b1 = _mm256_and_si256(_mm256_srli_epi16(high, 1), one);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
                high = _mm256_srli_epi16(high, 2);
            }
            let (s_lo, s_hi) = (
                _mm256_set1_epi16(sc[2 * k] as i16),
                _mm256_set1_epi16(sc[2 * k + 1] as i16),
            );
            for i in 0..R {
                let x = a.get_unchecked(i * kb + b).qs.as_ptr().add(64 * k);
                let x_lo = _mm256_loadu_si256(x as *const __m256i);
                let x_hi = _mm256_loadu_si256(x.add(32) as *const __m256i);
                let p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x_lo), s_lo);
                let p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x_hi), s_hi);
                sums[i] = _mm256_add_epi32(sums[i], _mm256_add_epi32(p_lo, p_hi));
            }
        }
        let (d, dmin) = (quant::f16_to_f32(d), quant::f16_to_f32(dmin));
        for i in 0..R {
            let ab = a.get_unchecked(i * kb + b);
            let dot = _mm256_cvtepi32_ps(sums[i]);
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * ab.d), dot, acc[i]);
            minus[i] += dmin * ab.d * min_sum(&mn, ab) as f32;
        }
    }
    for i in 0..R {
        *out.add(i * ld) = hsum(acc[i]) - minus[i];
    }
}

/// Bits `SHIFT` and `SHIFT + 1` of each byte of `qh`, moved to bits 4 and 5
/// (a Q6_K value's high bits).
#[inline(always)]
unsafe fn q6_top<const SHIFT: i32>(qh: __m256i, m2: __m256i) -> __m256i {
    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16::<SHIFT>(qh), m2), 4)
}

/// A Q6_K weight row against up to four Q8_K activation rows.
#[inline(always)]
unsafe fn tile_q6_k<const R: usize>(
    w: &[BlockQ6K],
    a: &[BlockQ8K],
    kb: usize,
    out: *mut f32,
    ld: usize,
) {
    let m4 = _mm256_set1_epi8(0x0f);
    let m2 = _mm256_set1_epi8(3);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut minus = [0f32; R];
    for (b, wb) in w.iter().enumerate() {
        let mut sums = [_mm256_setzero_si256(); R];
        for h in 0..2 {
            let ql0 = _mm256_loadu_si256(wb.ql.as_ptr().add(64 * h) as *const __m256i);
            let ql1 = _mm256_loadu_si256(wb.ql.as_ptr().add(64 * h + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(wb.qh.as_ptr().add(32 * h) as *const __m256i);
            // Elements 128 h + 32 k + l, k = 0..4, as unsigned 6-bit values.
            let q = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), q6_top::<0>(qh, m2)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), q6_top::<2>(qh, m2)),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                    q6_top::<4>(qh, m2),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                    q6_top::<6>(qh, m2),
                ),
            ];
            for (k, q) in q.iter().enumerate() {
                // Scales of the two groups of 16, one per 128-bit lane.
                let g = 8 * h + 2 * k;
                let s = _mm256_set_m128i(
                    _mm_set1_epi16(wb.scales[g + 1] as i16),
                    _mm_set1_epi16(wb.scales[g] as i16),
                );
                for i in 0..R {
                    let x = a
                        .get_unchecked(i * kb + b)
                        .qs
                        .as_ptr()
                        .add(128 * h + 32 * k);
                    let x = _mm256_loadu_si256(x as *const __m256i);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(*q, x), s);
                    sums[i] = _mm256_add_epi32(sums[i], p);
                }
            }
        }
        let d = quant::f16_to_f32(wb.d);
        for i in 0..R {
            let ab = a.get_unchecked(i * kb + b);
            // The values are stored offset by 32.
            let offset: i32 = (0..16)
                .map(|g| wb.scales[g] as i32 * ab.bsums[g] as i32)
                .sum();
            acc[i] = _mm256_fmadd_ps(
                _mm256_set1_ps(d * ab.d),
                _mm256_cvtepi32_ps(sums[i]),
                acc[i],
            );
            minus[i] += d * ab.d * (32 * offset) as f32;
        }
    }
    for i in 0..R {
        *out.add(i * ld) = hsum(acc[i]) - minus[i];
    }
}

/// Runs `body` for tiles of activation rows `0..n` (`count` rows from `i`:
/// fours, then the remainder) for each weight row `r` of `rows`, tile by tile
/// of `TILE` activation rows so that those stay in L1. A macro rather than a
/// function taking a closure, so the body is compiled with the caller's
/// target features.
macro_rules! row_tiles {
    ($n:expr, $rows:expr, |$count:ident, $i:ident, $r:ident| $body:block) => {{
        let mut t0 = 0;
        while t0 < $n {
            let t1 = (t0 + TILE).min($n);
            for $r in $rows.clone() {
                let mut $i = t0;
                while $i + 4 <= t1 {
                    let $count = 4;
                    $body
                    $i += 4;
                }
                if $i < t1 {
                    let $count = t1 - $i;
                    $body
                }
            }
            t0 = t1;
        }
    }};
}

macro_rules! k_kernel {
    ($name:ident, $block:ty, |$w:ident, $a:ident, $kb:ident, $o:ident, $ld:ident, $R:ident| $tile:expr) => {
        /// Weight rows `rows` of a matrix of K-quant super-blocks (`kb` per
        /// row) against all `n` Q8_K activation rows of `a`:
        /// `out[i * ld + r]` for i < n, r in `rows`.
        ///
        /// # Safety
        /// The CPU must have AVX2, FMA and F16C; `w` holds the rows, `a`
        /// holds `n * kb` blocks, and `out` is valid for those writes.
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $name(
            w: &[$block],
            kb: usize,
            rows: Range<usize>,
            a: &[BlockQ8K],
            n: usize,
            out: *mut f32,
            ld: usize,
        ) {
            row_tiles!(n, rows, |count, i, r| {
                let $w = w.get_unchecked(r * kb..(r + 1) * kb);
                let ($a, $kb, $o, $ld) = (&a[i * kb..], kb, out.add(i * ld + r), ld);
                match count {
                    4 => {
                        const $R: usize = 4;
                        $tile
                    }
                    3 => {
                        const $R: usize = 3;
                        $tile
                    }
                    2 => {
                        const $R: usize = 2;
                        $tile
                    }
                    _ => {
                        const $R: usize = 1;
                        $tile
                    }
                }
            });
        }
    };
}

k_kernel!(rows_q4_k, BlockQ4K, |w, a, kb, o, ld, R| {
    tile_q45_k::<R, false>(w, &[], a, kb, o, ld)
});
k_kernel!(rows_q5_k, BlockQ5K, |w, a, kb, o, ld, R| {
    tile_q45_k::<R, true>(&[], w, a, kb, o, ld)
});
k_kernel!(rows_q6_k, BlockQ6K, |w, a, kb, o, ld, R| {
    tile_q6_k::<R>(w, a, kb, o, ld)
});

/// A float weight format: eight weights as f32.
pub trait FloatWeights: Copy {
    /// Eight weights from `p`.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; `p` is valid for eight reads.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl FloatWeights for F16Bits {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}
impl FloatWeights for Bf16Bits {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))
    }
}
impl FloatWeights for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

/// `K` consecutive weight rows from `w` (each `cols` long) against `R`
/// activation rows: each weight load and conversion feeds `R` FMAs and each
/// activation load `K`: `K·R` FMAs per `K + R` loads. Each (weight row,
/// activation row) pair keeps its own accumulator, summed over the columns in
/// order, so the result of a pair does not depend on `K` or `R`.
#[inline(always)]
unsafe fn tile_float_k<W: FloatWeights, const K: usize, const R: usize>(
    w: &[W],
    a: &[f32],
    cols: usize,
    out: *mut f32,
    ld: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); R]; K];
    for j in (0..cols).step_by(8) {
        let mut v = [_mm256_setzero_ps(); K];
        for (k, v) in v.iter_mut().enumerate() {
            *v = W::load8(w.as_ptr().add(k * cols + j));
        }
        for i in 0..R {
            let av = _mm256_loadu_ps(a.as_ptr().add(i * cols + j));
            for k in 0..K {
                acc[k][i] = _mm256_fmadd_ps(v[k], av, acc[k][i]);
            }
        }
    }
    for (k, acc) in acc.iter().enumerate() {
        for (i, &acc) in acc.iter().enumerate() {
            *out.add(i * ld + k) = hsum(acc);
        }
    }
}

/// Weight rows `rows` of a float matrix (`cols` values per row, a multiple
/// of 8) against all `n` float activation rows of `a`: `out[i * ld + r]`.
/// From four activation rows on, three weight rows at a time
/// ([`tile_float_k`]: 3 × 4 accumulators, 3 weights and an activation fill
/// the 16 AVX2 registers).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `w` holds the rows, `a` holds
/// `n * cols` values, and `out` is valid for those writes.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_float<W: FloatWeights>(
    w: &[W],
    cols: usize,
    rows: Range<usize>,
    a: &[f32],
    n: usize,
    out: *mut f32,
    ld: usize,
) {
    // Decode of one to three sequences is bound by reading the weights:
    // one weight row at a time, the single stream that prefetches best.
    let most = if n < 4 { 1 } else { 3 };
    let mut t0 = 0;
    while t0 < n {
        let t1 = (t0 + TILE).min(n);
        let mut r = rows.start;
        while r < rows.end {
            let k = (rows.end - r).min(most);
            let wk = &w[r * cols..(r + k) * cols];
            let mut i = t0;
            while i < t1 {
                let count = (t1 - i).min(4);
                let (ar, o) = (&a[i * cols..], out.add(i * ld + r));
                macro_rules! tile {
                    ($k:literal) => {
                        match count {
                            4 => tile_float_k::<W, $k, 4>(wk, ar, cols, o, ld),
                            3 => tile_float_k::<W, $k, 3>(wk, ar, cols, o, ld),
                            2 => tile_float_k::<W, $k, 2>(wk, ar, cols, o, ld),
                            _ => tile_float_k::<W, $k, 1>(wk, ar, cols, o, ld),
                        }
                    };
                }
                match k {
                    3 => tile!(3),
                    2 => tile!(2),
                    1 => tile!(1),
                    _ => unreachable!("k is 1 to 3"),
                }
                i += count;
            }
            r += k;
        }
        t0 = t1;
    }
}

/// True when this CPU runs the kernels above.
pub fn supported() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// True when this CPU also has the VNNI dot-product instruction (on 256-bit
/// registers), which replaces the multiply-add pairs of the integer phase.
pub fn vnni_supported() -> bool {
    supported() && is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")
}

/// The largest magnitude of the lanes of `v`.
#[inline(always)]
unsafe fn abs_max(v: &[__m256]) -> f32 {
    let sign = _mm256_set1_ps(-0.0);
    let mut amax = _mm256_andnot_ps(sign, v[0]);
    for x in &v[1..] {
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, *x));
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    _mm_cvtss_f32(m)
}

/// 32 values times `id`, rounded half to even: as i32 lanes, and packed to
/// 32 bytes in order.
#[inline(always)]
unsafe fn round_pack32(v: &[__m256], id: __m256) -> ([__m256i; 4], __m256i) {
    let q: [__m256i; 4] = std::array::from_fn(|i| {
        _mm256_cvtps_epi32(_mm256_round_ps(
            _mm256_mul_ps(v[i], id),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        ))
    });
    // The packs work per 128-bit lane, so restore the element order with a
    // final dword permutation.
    let w16 = [
        _mm256_packs_epi32(q[0], q[1]),
        _mm256_packs_epi32(q[2], q[3]),
    ];
    let b8 = _mm256_packs_epi16(w16[0], w16[1]);
    let b8 = _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    (q, b8)
}

/// The sum of the eight i32 lanes of `v`.
#[inline(always)]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0b01_00_11_10));
    let t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0b10_11_00_01));
    _mm_cvtsi128_si32(t)
}

/// `1 / d`, or 0 for an all-zero block.
#[inline(always)]
fn inverse(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// Quantizes 32 values to one activation block (round half to even, as
/// `quant::quantize_block` does).
///
/// # Safety
/// The CPU must have AVX2 and FMA; `x` holds at least 32 values.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_block(x: &[f32]) -> BlockQ8A {
    let p = x.as_ptr();
    let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(p.add(8 * i)));
    let d = abs_max(&v) / 127.0;
    let (q, b8) = round_pack32(&v, _mm256_set1_ps(inverse(d)));
    let sum = hsum_epi32(_mm256_add_epi32(
        _mm256_add_epi32(q[0], q[1]),
        _mm256_add_epi32(q[2], q[3]),
    ));
    let mut out = BlockQ8A {
        d,
        s: d * sum as f32,
        sum,
        ..Default::default()
    };
    _mm256_storeu_si256(out.qs.as_mut_ptr() as *mut __m256i, b8);
    out
}

/// Quantizes 256 values to one K activation block (as
/// `quant::quantize_block_k` does, bit for bit).
///
/// # Safety
/// The CPU must have AVX2 and FMA; `x` holds at least 256 values.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_block_k(x: &[f32]) -> BlockQ8K {
    let p = x.as_ptr();
    let v: [__m256; QK_K / 8] = std::array::from_fn(|i| _mm256_loadu_ps(p.add(8 * i)));
    let d = abs_max(&v) / 127.0;
    let id = _mm256_set1_ps(inverse(d));
    let mut out = BlockQ8K {
        d,
        ..Default::default()
    };
    for (c, v) in v.chunks_exact(4).enumerate() {
        let (q, b8) = round_pack32(v, id);
        _mm256_storeu_si256(out.qs.as_mut_ptr().add(32 * c) as *mut __m256i, b8);
        // Sums of 16: the first two and the last two vectors of eight.
        for (h, pair) in q.chunks_exact(2).enumerate() {
            out.bsums[2 * c + h] = hsum_epi32(_mm256_add_epi32(pair[0], pair[1])) as i16;
        }
    }
    out
}

/// e^x for eight lanes (Cephes' polynomial; relative error about 1e-7).
#[inline(always)]
unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(x, _mm256_set1_ps(88.376_26));
    let x = _mm256_max_ps(x, _mm256_set1_ps(-88.376_26));
    let fx = _mm256_floor_ps(_mm256_fmadd_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
        _mm256_set1_ps(0.5),
    ));
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
    let z = _mm256_mul_ps(x, x);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0));
    let n = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)),
        23,
    );
    _mm256_mul_ps(y, _mm256_castsi256_ps(n))
}

/// `out = silu(g) * u` for 32 values.
///
/// # Safety
/// The CPU must have AVX2 and FMA; each slice holds at least 32 values.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn silu_mul_block(g: &[f32], u: &[f32], out: &mut [f32; 32]) {
    let one = _mm256_set1_ps(1.0);
    for k in 0..4 {
        let gv = _mm256_loadu_ps(g.as_ptr().add(8 * k));
        let uv = _mm256_loadu_ps(u.as_ptr().add(8 * k));
        let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        let s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out.as_mut_ptr().add(8 * k), _mm256_mul_ps(s, uv));
    }
}

/// The horizontal sums of four vectors, each summed in [`hsum`]'s order
/// (so each equals `hsum` of its vector, bit for bit).
#[inline(always)]
unsafe fn hsum4(v: [__m256; 4]) -> __m128 {
    let half = |v: __m256| _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let (b0, b1, b2, b3) = (half(v[0]), half(v[1]), half(v[2]), half(v[3]));
    // Transpose: r_e holds element e of each b.
    let t0 = _mm_unpacklo_ps(b0, b1);
    let t1 = _mm_unpacklo_ps(b2, b3);
    let t2 = _mm_unpackhi_ps(b0, b1);
    let t3 = _mm_unpackhi_ps(b2, b3);
    let r0 = _mm_movelh_ps(t0, t1);
    let r1 = _mm_movehl_ps(t1, t0);
    let r2 = _mm_movelh_ps(t2, t3);
    let r3 = _mm_movehl_ps(t3, t2);
    // hsum's (b0 + b2) + (b1 + b3).
    _mm_add_ps(_mm_add_ps(r0, r2), _mm_add_ps(r1, r3))
}

/// One query head's attention over the slots of `kv`; `scores` is scratch.
/// Four slots' dot products at a time (four independent chains instead of
/// one), and the output's dims kept in registers across the slots; every
/// sum is in the same order as one slot and one dim at a time.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `q.len()` (the head size) is a multiple
/// of 8, every slot's range is inside `kv.keys` and `kv.values`, and `out`
/// holds `q.len()` values.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn head_attention(
    q: &[f32],
    kv: KvHead<'_>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let hd = q.len();
    let n = kv.slots.len();
    scores.clear();
    // Whole vectors, padded; the padding is never read back.
    scores.resize(n.div_ceil(8) * 8, f32::NEG_INFINITY);
    let qp = q.as_ptr();
    let sp = scores.as_mut_ptr();
    let mut quads = kv.slots.chunks_exact(4);
    let mut i = 0;
    for quad in quads.by_ref() {
        let k: [*const f32; 4] = std::array::from_fn(|s| kv.keys.as_ptr().add(kv.at(quad[s])));
        let mut acc = [_mm256_setzero_ps(); 4];
        for j in (0..hd).step_by(8) {
            let qv = _mm256_loadu_ps(qp.add(j));
            for s in 0..4 {
                acc[s] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[s].add(j)), acc[s]);
            }
        }
        _mm_storeu_ps(sp.add(i), _mm_mul_ps(hsum4(acc), _mm_set1_ps(scale)));
        i += 4;
    }
    for &slot in quads.remainder() {
        let k = kv.keys.as_ptr().add(kv.at(slot));
        let mut acc = _mm256_setzero_ps();
        for j in (0..hd).step_by(8) {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(j)), _mm256_loadu_ps(k.add(j)), acc);
        }
        *sp.add(i) = hsum(acc) * scale;
        i += 1;
    }
    let max = scores[..n].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let mv = _mm256_set1_ps(max);
    for c in scores.chunks_exact_mut(8) {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv));
        _mm256_storeu_ps(c.as_mut_ptr(), e);
    }
    let total: f32 = scores[..n].iter().sum();
    let inv = _mm256_set1_ps(1.0 / total);
    // Up to eight vectors of output dims in registers, over all the slots.
    const DIMS: usize = 64;
    let o = out.as_mut_ptr();
    for d0 in (0..hd).step_by(DIMS) {
        let width = (hd - d0).min(DIMS) / 8;
        let mut acc = [_mm256_setzero_ps(); DIMS / 8];
        for (&slot, &p) in kv.slots.iter().zip(&scores[..n]) {
            let v = kv.values.as_ptr().add(kv.at(slot) + d0);
            let pv = _mm256_set1_ps(p);
            for (c, acc) in acc.iter_mut().enumerate().take(width) {
                *acc = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v.add(8 * c)), *acc);
            }
        }
        for (c, acc) in acc.iter().enumerate().take(width) {
            _mm256_storeu_ps(o.add(d0 + 8 * c), _mm256_mul_ps(*acc, inv));
        }
    }
}

/// [`head_attention`] as it was, one slot and one dim at a time through
/// memory: the reference its bits must equal.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `q.len()` (the head size) is a multiple
/// of 8, every slot's range is inside `kv.keys` and `kv.values`, and `out`
/// holds `q.len()` values.
#[cfg(test)]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn head_attention_by_slot(
    q: &[f32],
    kv: KvHead<'_>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let hd = q.len();
    scores.clear();
    scores.reserve(kv.slots.len() + 8);
    let mut max = f32::NEG_INFINITY;
    for &slot in kv.slots {
        let k = kv.keys.as_ptr().add(kv.at(slot));
        let mut acc = _mm256_setzero_ps();
        for j in (0..hd).step_by(8) {
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(q.as_ptr().add(j)),
                _mm256_loadu_ps(k.add(j)),
                acc,
            );
        }
        let x = hsum(acc) * scale;
        max = max.max(x);
        scores.push(x);
    }
    let n = scores.len();
    // Pad to whole vectors; the padding is never read back.
    scores.resize(n.div_ceil(8) * 8, f32::NEG_INFINITY);
    let mv = _mm256_set1_ps(max);
    for c in scores.chunks_exact_mut(8) {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv));
        _mm256_storeu_ps(c.as_mut_ptr(), e);
    }
    let total: f32 = scores[..n].iter().sum();
    out.fill(0.0);
    let o = out.as_mut_ptr();
    for (&slot, &p) in kv.slots.iter().zip(&scores[..n]) {
        let v = kv.values.as_ptr().add(kv.at(slot));
        let pv = _mm256_set1_ps(p);
        for j in (0..hd).step_by(8) {
            let acc = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v.add(j)), _mm256_loadu_ps(o.add(j)));
            _mm256_storeu_ps(o.add(j), acc);
        }
    }
    let inv = _mm256_set1_ps(1.0 / total);
    for j in (0..hd).step_by(8) {
        _mm256_storeu_ps(o.add(j), _mm256_mul_ps(_mm256_loadu_ps(o.add(j)), inv));
    }
}
