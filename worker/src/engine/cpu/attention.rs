//! Causal attention of a batch's new rows against each sequence's cached
//! keys and values, read in place from the KV pool's blocks.
use super::threads::{ComputePool, Parts};
use std::cell::RefCell;
use std::ops::Range;

/// One sequence's part of the batch.
pub struct SeqRows<'a> {
    /// Its rows in the batch's activation matrices.
    pub rows: Range<usize>,
    /// Position of its first new row.
    pub pos0: usize,
    /// Pool slot of every position 0..pos0 + rows.len().
    pub slots: &'a [usize],
}

/// Attention geometry.
#[derive(Clone, Copy)]
pub struct Heads {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
}

/// What one query head attends to: the slots it sees in the layer's
/// slot-major `keys` and `values` arrays, where its KV head's dims start at
/// `off` in each slot of `stride` values.
#[derive(Clone, Copy)]
pub(super) struct KvHead<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub slots: &'a [usize],
    pub stride: usize,
    pub off: usize,
}

impl KvHead<'_> {
    /// Where the head's dims start in `slot`.
    #[inline(always)]
    pub fn at(&self, slot: usize) -> usize {
        slot * self.stride + self.off
    }
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Writes `out[row * n_head * head_dim + head * head_dim ..]` for every row of
/// every sequence. `q` holds the rotated queries at the start of each row of
/// stride `q_ld`; `keys`/`values` are the layer's (slots, kv_heads * head_dim)
/// arrays. One task per (sequence, head), spread over the compute threads.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    pool: &ComputePool,
    seqs: &[SeqRows<'_>],
    heads: Heads,
    q: &[f32],
    q_ld: usize,
    keys: &[f32],
    values: &[f32],
    out: &mut [f32],
) {
    let Heads {
        n_head,
        n_kv_head,
        head_dim: hd,
    } = heads;
    let q_dim = n_head * hd;
    let kv_dim = n_kv_head * hd;
    let rep = n_head / n_kv_head;
    let scale = 1.0 / (hd as f32).sqrt();
    let rows_total = seqs.iter().map(|s| s.rows.end).max().unwrap_or(0);
    assert!(out.len() >= rows_total * q_dim, "attention output size");
    let base = Parts(out.as_mut_ptr());
    let simd = pool.kernels().simd() && hd % 8 == 0;
    let task = |t: usize| {
        let (s, h) = (&seqs[t / n_head], t % n_head);
        let kv_off = (h / rep) * hd;
        SCORES.with(|cell| {
            let mut scores = cell.borrow_mut();
            for (i, row) in s.rows.clone().enumerate() {
                let qh = &q[row * q_ld + h * hd..row * q_ld + (h + 1) * hd];
                // SAFETY: each (row, head) pair belongs to one task, so this
                // head_dim-wide slice is written by this task only.
                let o = unsafe {
                    std::slice::from_raw_parts_mut(base.get().add(row * q_dim + h * hd), hd)
                };
                let kv = KvHead {
                    keys,
                    values,
                    slots: &s.slots[..s.pos0 + i + 1],
                    stride: kv_dim,
                    off: kv_off,
                };
                if simd {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: the CPU has the features (`CpuKernels` checked),
                    // hd is a multiple of 8, slots index the layer arrays.
                    unsafe {
                        super::x86::head_attention(qh, kv, scale, &mut scores, o)
                    };
                } else {
                    head_attention(qh, kv, scale, &mut scores, o);
                }
            }
        });
    };
    pool.run(seqs.len() * n_head, &task);
}

/// One query head's attention over the visible positions (portable code;
/// `x86::head_attention` is the same with AVX2).
fn head_attention(q: &[f32], kv: KvHead<'_>, scale: f32, scores: &mut Vec<f32>, out: &mut [f32]) {
    let hd = q.len();
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    for &slot in kv.slots {
        let x = dot(q, &kv.keys[kv.at(slot)..kv.at(slot) + hd]) * scale;
        max = max.max(x);
        scores.push(x);
    }
    for x in scores.iter_mut() {
        *x = (*x - max).exp();
    }
    let total: f32 = scores.iter().sum();
    out.fill(0.0);
    for (&slot, &p) in kv.slots.iter().zip(scores.iter()) {
        let v = &kv.values[kv.at(slot)..kv.at(slot) + hd];
        for (o, &v) in out.iter_mut().zip(v) {
            *o += p * v;
        }
    }
    let inv = 1.0 / total;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// Dot product in eight independent lanes (which the compiler vectorizes
/// without reordering any one lane's sums).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::super::kernels::CpuKernels;
    use super::*;

    /// Two sequences with scattered slots: each row's output is the
    /// softmax-weighted mean of the values it may see, computed naively.
    #[test]
    fn matches_naive_attention_over_scattered_slots() {
        let heads = Heads {
            n_head: 4,
            n_kv_head: 2,
            head_dim: 8,
        };
        let (q_dim, kv_dim) = (32, 16);
        let slots_total = 12;
        let f = |i: usize| ((i * 7919 % 97) as f32 / 97.0) - 0.5;
        let keys: Vec<f32> = (0..slots_total * kv_dim).map(f).collect();
        let values: Vec<f32> = (0..slots_total * kv_dim).map(|i| f(i + 13)).collect();
        let q: Vec<f32> = (0..5 * q_dim).map(|i| f(i + 101)).collect();
        let a_slots = [3, 9, 4, 0];
        let b_slots = [11, 1, 7];
        let seqs = [
            SeqRows {
                rows: 0..2,
                pos0: 2,
                slots: &a_slots,
            },
            SeqRows {
                rows: 2..5,
                pos0: 0,
                slots: &b_slots,
            },
        ];
        let mut out = vec![0f32; 5 * q_dim];
        attend(
            &ComputePool::new(2, CpuKernels::default()).unwrap(),
            &seqs,
            heads,
            &q,
            q_dim,
            &keys,
            &values,
            &mut out,
        );
        for s in &seqs {
            for (i, row) in s.rows.clone().enumerate() {
                for h in 0..4 {
                    let kvh = h / 2;
                    let qh = &q[row * q_dim + h * 8..row * q_dim + h * 8 + 8];
                    let vis = &s.slots[..s.pos0 + i + 1];
                    let sc: Vec<f32> = vis
                        .iter()
                        .map(|&sl| {
                            let k = &keys[sl * kv_dim + kvh * 8..][..8];
                            qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() / 8f32.sqrt()
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = sc.iter().map(|x| (x - m).exp()).collect();
                    let z: f32 = e.iter().sum();
                    for d in 0..8 {
                        let want: f32 = vis
                            .iter()
                            .zip(&e)
                            .map(|(&sl, w)| w / z * values[sl * kv_dim + kvh * 8 + d])
                            .sum();
                        let got = out[row * q_dim + h * 8 + d];
                        assert!((got - want).abs() < 1e-5, "row {row} head {h} dim {d}");
                    }
                }
            }
        }
        // The portable path gives the same (it is what CPUs without AVX2
        // run, and the dispatch above took the SIMD path on most machines).
        let mut scores = Vec::new();
        for s in &seqs {
            for (i, row) in s.rows.clone().enumerate() {
                for h in 0..4 {
                    let mut o = [0f32; 8];
                    let kv = KvHead {
                        keys: &keys,
                        values: &values,
                        slots: &s.slots[..s.pos0 + i + 1],
                        stride: kv_dim,
                        off: (h / 2) * 8,
                    };
                    let qh = &q[row * q_dim + h * 8..][..8];
                    head_attention(qh, kv, 1.0 / 8f32.sqrt(), &mut scores, &mut o);
                    for (a, b) in o.iter().zip(&out[row * q_dim + h * 8..][..8]) {
                        assert!((a - b).abs() < 1e-5);
                    }
                }
            }
        }
    }

    /// The AVX2 head attention (four slots at a time, dims in registers)
    /// gives the same bits as one slot and one dim at a time, for head
    /// sizes below, at and above the 64 dims it keeps in registers.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_head_attention_has_the_bits_of_one_slot_at_a_time() {
        if !CpuKernels::default().simd() {
            return;
        }
        let f = |i: usize| (((i * 7919 + 13) % 1009) as f32 / 1009.0 - 0.5) * 3.0;
        for hd in [8, 64, 96, 128] {
            let stride = 2 * hd;
            let slots_total = 40;
            let keys: Vec<f32> = (0..slots_total * stride).map(f).collect();
            let values: Vec<f32> = (0..slots_total * stride).map(|i| f(i + 5)).collect();
            let q: Vec<f32> = (0..hd).map(|i| f(i + 77)).collect();
            let order: Vec<usize> = (0..slots_total).map(|i| (i * 17) % slots_total).collect();
            for n in 1..=13 {
                let kv = KvHead {
                    keys: &keys,
                    values: &values,
                    slots: &order[..n * 3 % slots_total + 1],
                    stride,
                    off: hd,
                };
                let (mut a, mut b) = (vec![0f32; hd], vec![0f32; hd]);
                let (mut sa, mut sb) = (Vec::new(), Vec::new());
                // SAFETY: the CPU has AVX2 and FMA (checked above), hd is a
                // multiple of 8, every slot's range is inside the arrays.
                unsafe {
                    super::super::x86::head_attention(&q, kv, 0.125, &mut sa, &mut a);
                    super::super::x86::head_attention_by_slot(&q, kv, 0.125, &mut sb, &mut b);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "head size {hd}, {n} slots");
            }
        }
    }
}
