//! The rendezvous top over a set's compact array of id hashes: the first
//! index of the highest weight, eight (AVX-512) or four (AVX2) workers at a
//! time where the CPU has the instructions, checked at run time, else one
//! at a time.
//!
//! At 1,000 workers this loop was three quarters of a cache-aware decision's
//! instructions (about 19 per worker; BENCHMARKS.md, issue 19). The weights
//! are [`super::rendezvous_weight`]'s exactly, integer arithmetic in every
//! path, so a router on any CPU ranks workers as every other router does.
//!
//! The only `unsafe` code of the router: the `std::arch` intrinsics. Each
//! vector path is entered only after `is_x86_feature_detected!` has said
//! the CPU has its features, reads the hashes only within the slice's
//! bounds, and is checked against the scalar loop by the tests below.
#![allow(unsafe_code)]

use super::rendezvous_weight;

/// The first index of the highest [`rendezvous_weight`] of `hashes` for
/// `key` (ties go to the smaller index), with that weight; None when empty.
pub fn first_max(hashes: &[u64], key: u64) -> Option<(usize, u64)> {
    #[cfg(target_arch = "x86_64")]
    {
        if hashes.len() >= 16 {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq") {
                // SAFETY: the CPU has AVX-512 F and DQ (checked just above).
                return Some(unsafe { x86::first_max_avx512(hashes, key) });
            }
            if is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked just above).
                return Some(unsafe { x86::first_max_avx2(hashes, key) });
            }
        }
    }
    scalar(hashes, key, 0)
}

/// The scalar loop, over `hashes` whose first element has index `base`.
fn scalar(hashes: &[u64], key: u64, base: usize) -> Option<(usize, u64)> {
    let mut best: Option<(usize, u64)> = None;
    for (i, &h) in hashes.iter().enumerate() {
        let w = rendezvous_weight(h, key);
        if best.is_none_or(|(_, bw)| w > bw) {
            best = Some((base + i, w));
        }
    }
    best
}

/// The better of two (index, weight) candidates: the higher weight, then the
/// smaller index.
fn better(a: (usize, u64), b: (usize, u64)) -> (usize, u64) {
    if b.1 > a.1 || (b.1 == a.1 && b.0 < a.0) {
        b
    } else {
        a
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{better, scalar};
    use std::arch::x86_64::*;

    // MurmurHash3's finalizer constants, as in `rendezvous_weight`.
    const M1: u64 = 0xff51_afd7_ed55_8ccd;
    const M2: u64 = 0xc4ce_b9fe_1a85_ec53;

    /// `rendezvous_weight` of eight hashes.
    #[target_feature(enable = "avx512f,avx512dq")]
    fn weights8(h: __m512i, k: __m512i, m1: __m512i, m2: __m512i) -> __m512i {
        let mut w = _mm512_xor_si512(h, k);
        w = _mm512_xor_si512(w, _mm512_srli_epi64::<33>(w));
        w = _mm512_mullo_epi64(w, m1);
        w = _mm512_xor_si512(w, _mm512_srli_epi64::<33>(w));
        w = _mm512_mullo_epi64(w, m2);
        _mm512_xor_si512(w, _mm512_srli_epi64::<33>(w))
    }

    /// Each lane starts at its first weight and keeps its first maximum
    /// (strict compare), so the lanes' winners, merged by weight then index,
    /// give the first maximum of all.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and DQ; `hashes` holds at least 8.
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(super) unsafe fn first_max_avx512(hashes: &[u64], key: u64) -> (usize, u64) {
        let lanes = hashes.len() / 8 * 8;
        let k = _mm512_set1_epi64(key as i64);
        let (m1, m2) = (_mm512_set1_epi64(M1 as i64), _mm512_set1_epi64(M2 as i64));
        let mut idx = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
        let eight = _mm512_set1_epi64(8);
        let p = hashes.as_ptr();
        // SAFETY: 8 <= lanes <= hashes.len(); unaligned load.
        let first = unsafe { _mm512_loadu_si512(p.cast()) };
        let mut best_w = weights8(first, k, m1, m2);
        let mut best_i = idx;
        for j in (8..lanes).step_by(8) {
            idx = _mm512_add_epi64(idx, eight);
            // SAFETY: j + 8 <= lanes <= hashes.len(); unaligned load.
            let h = unsafe { _mm512_loadu_si512(p.add(j).cast()) };
            let w = weights8(h, k, m1, m2);
            let take = _mm512_cmpgt_epu64_mask(w, best_w);
            best_w = _mm512_mask_blend_epi64(take, best_w, w);
            best_i = _mm512_mask_blend_epi64(take, best_i, idx);
        }
        let (mut ws, mut is) = ([0u64; 8], [0u64; 8]);
        // SAFETY: both arrays hold 8 u64; unaligned stores.
        unsafe {
            _mm512_storeu_si512(ws.as_mut_ptr().cast(), best_w);
            _mm512_storeu_si512(is.as_mut_ptr().cast(), best_i);
        }
        merge(&ws, &is, scalar(&hashes[lanes..], key, lanes))
    }

    /// `a * b` modulo 2^64 in each lane, from 32-bit multiplies (AVX2 has no
    /// 64-bit one): lo·lo + ((hi·lo + lo·hi) << 32).
    #[target_feature(enable = "avx2")]
    fn mullo(a: __m256i, b_lo: __m256i, b_hi: __m256i) -> __m256i {
        let lo_lo = _mm256_mul_epu32(a, b_lo);
        let hi_lo = _mm256_mul_epu32(_mm256_srli_epi64::<32>(a), b_lo);
        let lo_hi = _mm256_mul_epu32(a, b_hi);
        _mm256_add_epi64(
            lo_lo,
            _mm256_slli_epi64::<32>(_mm256_add_epi64(hi_lo, lo_hi)),
        )
    }

    /// `rendezvous_weight` of four hashes, with the sign bit flipped so that
    /// AVX2's signed compare orders them as unsigned.
    #[target_feature(enable = "avx2")]
    fn weights4_flipped(h: __m256i, k: __m256i) -> __m256i {
        let (m1_lo, m1_hi) = (
            _mm256_set1_epi64x((M1 & 0xffff_ffff) as i64),
            _mm256_set1_epi64x((M1 >> 32) as i64),
        );
        let (m2_lo, m2_hi) = (
            _mm256_set1_epi64x((M2 & 0xffff_ffff) as i64),
            _mm256_set1_epi64x((M2 >> 32) as i64),
        );
        let mut w = _mm256_xor_si256(h, k);
        w = _mm256_xor_si256(w, _mm256_srli_epi64::<33>(w));
        w = mullo(w, m1_lo, m1_hi);
        w = _mm256_xor_si256(w, _mm256_srli_epi64::<33>(w));
        w = mullo(w, m2_lo, m2_hi);
        w = _mm256_xor_si256(w, _mm256_srli_epi64::<33>(w));
        _mm256_xor_si256(w, _mm256_set1_epi64x(i64::MIN))
    }

    /// As [`first_max_avx512`], four lanes.
    ///
    /// # Safety
    /// The CPU has AVX2; `hashes` holds at least 4.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn first_max_avx2(hashes: &[u64], key: u64) -> (usize, u64) {
        let lanes = hashes.len() / 4 * 4;
        let k = _mm256_set1_epi64x(key as i64);
        let mut idx = _mm256_setr_epi64x(0, 1, 2, 3);
        let four = _mm256_set1_epi64x(4);
        let p = hashes.as_ptr();
        // SAFETY: 4 <= lanes <= hashes.len(); unaligned load.
        let first = unsafe { _mm256_loadu_si256(p.cast()) };
        let mut best_w = weights4_flipped(first, k);
        let mut best_i = idx;
        for j in (4..lanes).step_by(4) {
            idx = _mm256_add_epi64(idx, four);
            // SAFETY: j + 4 <= lanes <= hashes.len(); unaligned load.
            let h = unsafe { _mm256_loadu_si256(p.add(j).cast()) };
            let w = weights4_flipped(h, k);
            let take = _mm256_cmpgt_epi64(w, best_w);
            best_w = _mm256_blendv_epi8(best_w, w, take);
            best_i = _mm256_blendv_epi8(best_i, idx, take);
        }
        let (mut ws, mut is) = ([0u64; 4], [0u64; 4]);
        // SAFETY: both arrays hold 4 u64; unaligned stores.
        unsafe {
            _mm256_storeu_si256(ws.as_mut_ptr().cast(), best_w);
            _mm256_storeu_si256(is.as_mut_ptr().cast(), best_i);
        }
        for w in &mut ws {
            *w ^= 1 << 63;
        }
        merge(&ws, &is, scalar(&hashes[lanes..], key, lanes))
    }

    /// The lanes' winners and the scalar tail's, merged.
    fn merge(ws: &[u64], is: &[u64], tail: Option<(usize, u64)>) -> (usize, u64) {
        let mut best = (is[0] as usize, ws[0]);
        for (&w, &i) in ws.iter().zip(is).skip(1) {
            best = better(best, (i as usize, w));
        }
        tail.map_or(best, |t| better(best, t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn every_path_finds_the_scalar_loops_first_maximum() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(19);
        for len in (0..70).chain([999, 1_000, 1_001]) {
            let hashes: Vec<u64> = (0..len).map(|_| rng.random()).collect();
            let key = rng.random();
            let want = scalar(&hashes, key, 0);
            assert_eq!(first_max(&hashes, key), want, "len {len}");
            #[cfg(target_arch = "x86_64")]
            {
                if len >= 4 && is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2.
                    assert_eq!(Some(unsafe { x86::first_max_avx2(&hashes, key) }), want);
                }
                if len >= 8
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512dq")
                {
                    // SAFETY: the CPU has AVX-512 F and DQ.
                    assert_eq!(Some(unsafe { x86::first_max_avx512(&hashes, key) }), want);
                }
            }
        }
    }

    #[test]
    fn ties_go_to_the_first_index_in_every_lane_and_the_tail() {
        // Equal hashes have equal weights: plant the maximum at several
        // places (different lanes, and the scalar tail) and check that the
        // first one wins.
        let mut rng = rand::rngs::StdRng::seed_from_u64(20);
        for _ in 0..200 {
            let len = rng.random_range(16..120);
            let key: u64 = rng.random();
            let mut hashes: Vec<u64> = (0..len).map(|_| rng.random()).collect();
            let (top, _) = scalar(&hashes, key, 0).unwrap();
            let winner = hashes[top];
            let mut at: Vec<usize> = (0..3).map(|_| rng.random_range(0..len)).collect();
            at.push(len - 1);
            for &i in &at {
                hashes[i] = winner;
            }
            let first = hashes.iter().position(|&h| h == winner).unwrap();
            assert_eq!(first_max(&hashes, key).map(|t| t.0), Some(first));
        }
        // All equal, and weights of zero (a lane starts at its first weight,
        // whatever it is).
        let zero_key = 7u64;
        let all = vec![zero_key; 37];
        assert_eq!(first_max(&all, zero_key).map(|t| t.0), Some(0));
    }

    #[test]
    fn the_weights_are_rendezvous_weight_itself() {
        let hashes: Vec<u64> = (0..100u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        let (i, w) = first_max(&hashes, 42).unwrap();
        assert_eq!(w, rendezvous_weight(hashes[i], 42));
        assert!(hashes.iter().all(|&h| rendezvous_weight(h, 42) <= w));
    }
}
