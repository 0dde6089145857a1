//! The stochastic choice: which token one random number `r` picks from a row
//! of logits under temperature, top-k and top-p, without sorting the
//! vocabulary.
//!
//! The rule, which every path below follows exactly:
//! 1. Each token's weight is `e^((logit - max) / T)`, computed by [`exp`]
//!    (the same bits on every CPU) and rounded to a multiple of 2^-30 (the
//!    most likely token weighs 1), so that sums of weights are exact, in
//!    `f64` or in integer units of 2^-30, in any order. Weights of 2^-31
//!    or less round to zero: such tokens are never drawn (a min-p of about
//!    5e-10).
//! 2. Tokens are ranked by logit, highest first (NaN last, -0 and +0 equal),
//!    ties to the lower token id. Top-k keeps the first `k`; top-p then keeps the
//!    shortest prefix of that ranking whose weight reaches
//!    `ceil(top_p · total)`.
//! 3. With `W` the kept weight, `target = ⌊r · W / 2^64⌋`; the token is the
//!    kept one, visited in token-id order, at which the running sum of
//!    weights first exceeds `target`.
//!
//! So the result depends only on (logits, settings, r), not on how the
//! partial selections below arrange their candidates.
use std::cell::RefCell;
use std::collections::BinaryHeap;

/// Weights are multiples of 2^-30 and at most 1: a vocabulary of up to 2^23
/// tokens sums exactly in an `f64` (53 bits).
const UNIT: f64 = (1u64 << 30) as f64;

/// Adding and then subtracting this rounds a weight in [0, 1] to a multiple
/// of 2^-30 (its sum with the weight lies where f32's spacing is 2^-30 or
/// coarser).
const GRID: f32 = 1.5 / 128.0;

/// Tokens the first top-p split keeps: nuclei are usually smaller, so one
/// partition of the candidates then suffices.
const FIRST_NUCLEUS_GUESS: usize = 64;

/// Up to this `k`, top-k keeps a bounded heap while scanning the row (few
/// tokens ever enter it); above, it selects over all of them.
const HEAP_TOP_K: usize = 1024;

/// What truncates the distribution.
#[derive(Clone, Copy, Debug)]
pub struct Truncation {
    /// Greater than 0.
    pub temperature: f32,
    /// 0 (or the vocabulary size or more) means off.
    pub top_k: usize,
    /// 1 or more means off.
    pub top_p: f32,
}

/// The token `r` picks from `logits`; `None` when every weight is zero
/// (logits all -inf or NaN, for instance), where the caller falls back to
/// greedy.
pub fn pick(logits: &[f32], t: Truncation, r: u64) -> Option<u32> {
    let inv_t = 1.0 / t.temperature;
    let top_p = (t.top_p < 1.0).then_some(t.top_p);
    if t.top_k > 0 && t.top_k < logits.len() {
        pick_top_k(logits, inv_t, t.top_k, top_p, r)
    } else if let Some(top_p) = top_p {
        pick_nucleus(logits, inv_t, top_p, r)
    } else {
        pick_untruncated(logits, inv_t, r)
    }
}

/// No truncation: a pass for the weights and their sum, and a walk in id
/// order to the target.
fn pick_untruncated(logits: &[f32], inv_t: f32, r: u64) -> Option<u32> {
    SCRATCH.with_borrow_mut(|Scratch { weights: w, .. }| {
        let (total, _) = weigh_all(logits, inv_t, w);
        if total == 0 {
            return None;
        }
        // Exact in f64: every partial sum is a multiple of 2^-30 below 2^23.
        let target = scale(r, total) as f64 / UNIT;
        let mut acc = 0f64;
        for (c, chunk) in w.chunks(CHUNK).enumerate() {
            let sum = sum_f64(chunk);
            if acc + sum <= target {
                acc += sum;
                continue;
            }
            for (j, &x) in chunk.iter().enumerate() {
                acc += x as f64;
                if acc > target {
                    return Some((c * CHUNK + j) as u32);
                }
            }
        }
        unreachable!("the running sum reaches the total, which exceeds the target")
    })
}

/// Top-p over the whole vocabulary: the weights, the tokens that have one,
/// then two partial selections (the nucleus by rank, the draw by id).
fn pick_nucleus(logits: &[f32], inv_t: f32, top_p: f32, r: u64) -> Option<u32> {
    SCRATCH.with_borrow_mut(|Scratch { weights: w, keys }| {
        let (total, max) = weigh_all(logits, inv_t, w);
        if total == 0 {
            return None;
        }
        let need = nucleus_threshold(top_p, total);
        let weight = |&k: &u64| units(w[id_of(k) as usize]);
        // The tokens within some depth of the best are a prefix of the
        // ranking; once they reach `need`, the nucleus is among them. Tokens
        // of zero weight change no prefix's weight: left out.
        let depth = |l: f32| (l - max) * inv_t;
        // (Within FAR every weight is far above zero.)
        let near = candidates(
            logits,
            w,
            |l, _| depth(l) >= -FAR,
            |l| depth(l) >= -NEAR,
            keys,
        );
        if near >= need {
            keys.retain(|&k| depth(logit_of(k)) >= -NEAR);
        } else if keys.iter().map(weight).sum::<u64>() < need {
            candidates(logits, w, |_, x| x > 0.0, |_| false, keys);
        }
        let last = prefix_reaching(keys, need, |&k| k, weight, FIRST_NUCLEUS_GUESS);
        keys.truncate(last + 1);
        Some(draw_by_id(keys, |&k| k, weight, r))
    })
}

/// How far below the best token (in nats of weight: (logit - max) / T) the
/// nucleus search looks: first within NEAR, where the nuclei of everyday
/// settings lie (a few hundred tokens); then within FAR (each token beyond
/// weighs at most e^-16: under 0.6% of the total over a 49,152-token
/// vocabulary); then everywhere.
const NEAR: f32 = 8.0;
const FAR: f32 = 16.0;

/// Fills `keys` with the rank keys of the tokens that `keep` (by logit and
/// weight) keeps; returns the weight, in units, of those `near` keeps too.
fn candidates(
    logits: &[f32],
    w: &[f32],
    keep: impl Fn(f32, f32) -> bool,
    near: impl Fn(f32) -> bool,
    keys: &mut Vec<u64>,
) -> u64 {
    keys.clear();
    let mut near_mass = 0;
    for (id, (&l, &x)) in logits.iter().zip(w).enumerate() {
        if keep(l, x) {
            keys.push(rank_key(l, id as u32));
            if near(l) {
                near_mass += units(x);
            }
        }
    }
    near_mass
}

/// Top-k (then top-p among those): the `k` best by rank, without weighing
/// the rest of the vocabulary.
fn pick_top_k(logits: &[f32], inv_t: f32, k: usize, top_p: Option<f32>, r: u64) -> Option<u32> {
    let best = best_keys(logits, k);
    // The best-ranked token holds the row's largest logit (NaN rank last).
    let max = best
        .iter()
        .min()
        .map_or(f32::NEG_INFINITY, |&k| logits[id_of(k) as usize]);
    let mut cand: Vec<(u64, u64)> = best
        .into_iter()
        .map(|k| (k, units(weight(logits[id_of(k) as usize], max, inv_t))))
        .filter(|&(_, w)| w > 0)
        .collect();
    let weight = |c: &(u64, u64)| c.1;
    let total: u64 = cand.iter().map(weight).sum();
    if total == 0 {
        return None;
    }
    if let Some(top_p) = top_p {
        let need = nucleus_threshold(top_p, total);
        let last = prefix_reaching(&mut cand, need, |c| c.0, weight, FIRST_NUCLEUS_GUESS);
        cand.truncate(last + 1);
    }
    Some(draw_by_id(&mut cand, |c| c.0, weight, r))
}

/// Rank keys of the `k` best tokens (`0 < k < logits.len()`), in no order.
fn best_keys(logits: &[f32], k: usize) -> Vec<u64> {
    if k > HEAP_TOP_K {
        let mut keys: Vec<u64> = (0..logits.len() as u32)
            .map(|id| rank_key(logits[id as usize], id))
            .collect();
        keys.select_nth_unstable(k - 1);
        keys.truncate(k);
        return keys;
    }
    // A max-heap of keys: its top is the worst of the best so far. Ids rise
    // through the scan, so a later token outranks the worst only with a
    // higher logit: one float comparison per token.
    let mut heap = BinaryHeap::with_capacity(k);
    let (first, rest) = logits.split_at(k);
    heap.extend(
        first
            .iter()
            .enumerate()
            .map(|(id, &l)| rank_key(l, id as u32)),
    );
    let mut bar = logit_of(*heap.peek().expect("k > 0"));
    for (id, &l) in rest.iter().enumerate() {
        if l > bar {
            if let Some(mut worst) = heap.peek_mut() {
                *worst = rank_key(l, (k + id) as u32);
            }
            bar = logit_of(*heap.peek().expect("k > 0"));
        }
    }
    heap.into_vec()
}

/// The kept token (rule 3) that `r` lands on, visiting `kept` in id order.
fn draw_by_id<T: Copy>(
    kept: &mut [T],
    rank: impl Fn(&T) -> u64 + Copy,
    weight: impl Fn(&T) -> u64 + Copy,
    r: u64,
) -> u32 {
    let target = scale(r, kept.iter().map(weight).sum());
    let half = kept.len() / 2;
    let by_id = move |c: &T| id_of(rank(c)) as u64;
    let at = prefix_reaching(kept, target + 1, by_id, weight, half);
    id_of(rank(&kept[at]))
}

/// Buffers of the vocabulary's size, kept between calls, one per sampling
/// thread.
#[derive(Default)]
struct Scratch {
    /// Every token's weight.
    weights: Vec<f32>,
    /// Candidates' rank keys.
    keys: Vec<u64>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// Weights the untruncated walk skips at a time.
const CHUNK: usize = 64;

/// Fills `w` with every token's weight (rule 1); returns their sum in
/// units and the largest logit.
fn weigh_all(logits: &[f32], inv_t: f32, w: &mut Vec<f32>) -> (u64, f32) {
    let max = max_logit(logits);
    w.clear();
    w.extend(logits.iter().map(|&l| weight(l, max, inv_t)));
    ((sum_f64(w) * UNIT) as u64, max)
}

/// The exact sum of weights, in lanes so that it vectorizes (any order
/// gives the same result).
fn sum_f64(w: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let chunks = w.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (s, &x) in lanes.iter_mut().zip(c) {
            *s += x as f64;
        }
    }
    lanes.iter().sum::<f64>() + tail.iter().map(|&x| x as f64).sum::<f64>()
}

/// A weight in integer units of 2^-30 (exact).
fn units(w: f32) -> u64 {
    (w as f64 * UNIT) as u64
}

/// A token's rank key: sorting keys ascending ranks tokens by logit,
/// highest first, NaN last, ties to the lower id (the low 32 bits).
fn rank_key(logit: f32, id: u32) -> u64 {
    // Adding +0 turns -0 into +0: the two tie, as numbers do.
    let logit = if logit.is_nan() {
        f32::NEG_INFINITY
    } else {
        logit + 0.0
    };
    // f32's order as an unsigned integer (what `total_cmp` compares),
    // inverted so that higher logits come first.
    let bits = logit.to_bits();
    let ascending = if bits >> 31 == 1 {
        !bits
    } else {
        bits | 1 << 31
    };
    (u64::from(!ascending) << 32) | u64::from(id)
}

fn id_of(key: u64) -> u32 {
    key as u32
}

/// The logit a rank key was made from (NaN as -inf, -0 as +0).
fn logit_of(key: u64) -> f32 {
    let ascending = !((key >> 32) as u32);
    let bits = if ascending >> 31 == 1 {
        ascending & !(1 << 31)
    } else {
        !ascending
    };
    f32::from_bits(bits)
}

/// Orders `items` by `key` just far enough to find the shortest prefix, in
/// that order, whose weights sum to at least `need` (1 ≤ `need` ≤ their
/// total; keys unique). Returns `i` such that `items[..i]` are the prefix's
/// other members (in no particular order) and `items[i]` is its last.
///
/// Each round splits the undecided range with a partial selection
/// (`select_nth_unstable`, linear time), after `first` items, then in the
/// middle, and keeps the side where the prefix ends: linear time overall.
fn prefix_reaching<T>(
    items: &mut [T],
    mut need: u64,
    key: impl Fn(&T) -> u64 + Copy,
    weight: impl Fn(&T) -> u64 + Copy,
    first: usize,
) -> usize {
    debug_assert!(need >= 1 && need <= items.iter().map(weight).sum());
    // Invariant: items[..lo] are in the prefix, items[hi..] are not, and
    // items[lo..hi] hold at least `need` more.
    let (mut lo, mut hi) = (0, items.len());
    let mut split = first;
    while hi - lo > 1 {
        let range = &mut items[lo..hi];
        let n = split.clamp(1, range.len() - 1);
        range.select_nth_unstable_by_key(n, key);
        let before: u64 = range[..n].iter().map(weight).sum();
        if before >= need {
            hi = lo + n;
        } else {
            need -= before;
            lo += n;
        }
        split = (hi - lo) / 2;
    }
    lo
}

/// `ceil(top_p · total)`, at least 1.
fn nucleus_threshold(top_p: f32, total: u64) -> u64 {
    ((top_p as f64 * total as f64).ceil() as u64).clamp(1, total)
}

/// `⌊r · total / 2^64⌋`: a uniform integer below `total`.
fn scale(r: u64, total: u64) -> u64 {
    ((r as u128 * total as u128) >> 64) as u64
}

/// The largest logit (NaNs ignored; -inf when there is none).
fn max_logit(logits: &[f32]) -> f32 {
    // Lanes, so the compiler can keep the comparisons in vector registers.
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = logits.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}

/// A token's weight (rule 1): a multiple of 2^-30 in [0, 1].
#[inline]
fn weight(logit: f32, max: f32, inv_t: f32) -> f32 {
    (exp((logit - max) * inv_t) + GRID) - GRID
}

/// `e^x` for `x ≤ 0` (NaN counts as very negative), within a few units in
/// the last place: a fixed sequence of IEEE operations with no library call,
/// so every CPU and every vector width computes the same bits, and the loops
/// over the vocabulary vectorize. Cephes' `expf` polynomial.
#[inline]
pub(super) fn exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 · 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    // Below -87 the result leaves f32's normal range; weights there are 0.
    // Not `clamp`, which would keep a NaN: `max` turns it into -87.
    #[allow(clippy::manual_clamp)]
    let x = x.max(-87.0).min(0.0);
    let rounded = x * LOG2_E + ROUND;
    let n = rounded - ROUND;
    // n as an integer, from the bits (a float-to-int cast would not vectorize).
    let n_int = rounded.to_bits().wrapping_sub(ROUND.to_bits());
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5; // Cephes' 5.0000001201e-1, which is 0.5 in f32
    let e = p * r * r + r + 1.0;
    // 2^n from its exponent bits; n ≥ -126 here.
    e * f32::from_bits(n_int.wrapping_add(127) << 23)
}

#[cfg(test)]
pub(super) mod reference {
    //! The rule of the module doc written plainly: sort the vocabulary,
    //! truncate, sort the kept tokens by id, walk. The fast paths must agree
    //! with it exactly.
    use super::*;

    pub fn pick(logits: &[f32], t: Truncation, r: u64) -> Option<u32> {
        let max = max_logit(logits);
        let inv_t = 1.0 / t.temperature;
        let unnan = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l };
        // Compared as numbers (-0 and +0 tie), NaN last.
        let mut all: Vec<(f32, u32, u64)> = logits
            .iter()
            .enumerate()
            .map(|(id, &l)| (unnan(l), id as u32, units(weight(l, max, inv_t))))
            .collect();
        all.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
        if t.top_k > 0 {
            all.truncate(t.top_k);
        }
        let total: u64 = all.iter().map(|c| c.2).sum();
        if total == 0 {
            return None;
        }
        if t.top_p < 1.0 {
            let need = nucleus_threshold(t.top_p, total);
            let mut acc = 0;
            let keep = all
                .iter()
                .position(|c| {
                    acc += c.2;
                    acc >= need
                })
                .unwrap();
            all.truncate(keep + 1);
        }
        all.sort_by_key(|c| c.1);
        let target = scale(r, all.iter().map(|c| c.2).sum());
        let mut acc = 0;
        all.iter()
            .find(|c| {
                acc += c.2;
                acc > target
            })
            .map(|c| c.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Weights lie on the 2^-30 grid, so their sums are exact in any order.
    #[test]
    fn weights_are_multiples_of_2_to_the_minus_30() {
        for i in 0..200_000 {
            let logit = -(i as f32) * 1.37e-4;
            let w = weight(logit, 0.0, 1.0);
            assert_eq!(units(w) as f64 / UNIT, w as f64, "logit {logit}");
            assert!((0.0..=1.0).contains(&w));
        }
        assert_eq!(weight(0.0, 0.0, 1.0), 1.0);
        assert_eq!(weight(-21.6, 0.0, 1.0), 0.0, "e^-21.6 < 2^-31");
        assert_eq!(units(weight(-20.0, 0.0, 1.0)), 2, "e^-20 · 2^30 ≈ 2.2");
    }
}
