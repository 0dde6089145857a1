use super::pick::{exp, reference};
use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn params(t: f32) -> SamplingParams {
    SamplingParams {
        temperature: t,
        seed: Some(7),
        ..Default::default()
    }
}

/// Logits with a few likely tokens and a long tail, like a model's.
fn model_like(rng: &mut StdRng, n: usize, spread: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u: f32 = rng.random_range(0.0..1.0);
            spread * u.powi(6) + rng.random_range(-1.0..1.0)
        })
        .collect()
}

#[test]
fn greedy_picks_the_max() {
    let s = Sampler::new(params(0.0));
    assert_eq!(s.sample(&mut [0.0, 2.0, 1.0, 2.0], &[], 0), 1);
}

/// The lane-wise scan finds the first largest logit, as a plain scan does.
#[test]
fn argmax_is_the_first_maximum() {
    let plain = |row: &[f32]| {
        let mut best = 0;
        for (i, &x) in row.iter().enumerate() {
            if x > row[best] || row[best].is_nan() && x > f32::NEG_INFINITY {
                best = i;
            }
        }
        best as u32
    };
    let mut rng = StdRng::seed_from_u64(9);
    for n in [1, 3, 8, 9, 16, 17, 100, 1000] {
        for _ in 0..50 {
            let row: Vec<f32> = (0..n)
                .map(|_| match rng.random_range(0..10) {
                    0 => f32::NEG_INFINITY,
                    1 => f32::NAN,
                    _ => rng.random_range(0..6) as f32,
                })
                .collect();
            assert_eq!(argmax(&row), plain(&row), "{row:?}");
        }
    }
    assert_eq!(argmax(&[f32::NEG_INFINITY; 20]), 0);
}

#[test]
fn logprob_is_the_log_softmax() {
    let expected = 2.0 - (1f32 + 2f32.exp() + 1f32.exp()).ln();
    assert!((logprob(&[0.0, 2.0, 1.0], 1) - expected).abs() < 1e-5);
}

#[test]
fn same_seed_same_tokens() {
    let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
    let run = || {
        let s = Sampler::new(params(1.0));
        (0..20)
            .map(|n| s.sample(&mut logits.clone(), &[], n))
            .collect::<Vec<_>>()
    };
    assert_eq!(run(), run());
}

/// The token at position N depends on (seed, N) alone: a fresh sampler (a
/// worker continuing after a failover) asked for positions in any order
/// gives what one sampler drawing 0, 1, 2, ... gave, under every setting.
#[test]
fn the_draw_at_position_n_does_not_depend_on_earlier_draws() {
    let mut rng = StdRng::seed_from_u64(3);
    let logits = model_like(&mut rng, 500, 6.0);
    for (top_k, top_p) in [(0, 1.0), (0, 0.95), (40, 1.0), (40, 0.9)] {
        let p = SamplingParams {
            top_k,
            top_p,
            ..params(0.8)
        };
        let first = Sampler::new(p.clone());
        let run: Vec<u32> = (0..40)
            .map(|n| first.sample(&mut logits.clone(), &[], n))
            .collect();
        let distinct = {
            let mut d = run.clone();
            d.sort_unstable();
            d.dedup();
            d.len()
        };
        assert!(distinct > 5, "the draws must vary: {run:?}");
        let continuation = Sampler::new(p);
        for n in [17, 39, 3, 0, 17, 25] {
            assert_eq!(
                continuation.sample(&mut logits.clone(), &[], n),
                run[n],
                "position {n}, top_k {top_k}, top_p {top_p}"
            );
        }
    }
}

#[test]
fn different_seeds_differ() {
    let mut rng = StdRng::seed_from_u64(4);
    let logits = model_like(&mut rng, 500, 6.0);
    let run = |seed| {
        let s = Sampler::new(SamplingParams {
            seed: Some(seed),
            ..params(1.0)
        });
        (0..30)
            .map(|n| s.sample(&mut logits.clone(), &[], n))
            .collect::<Vec<_>>()
    };
    assert_ne!(run(1), run(2));
}

/// Settings that leave only the best token: it comes every time,
/// whatever the temperature.
#[test]
fn top_k_one_and_tiny_top_p_are_greedy() {
    let mut top_k = params(5.0);
    top_k.top_k = 1;
    let mut top_p = params(1.0);
    top_p.top_p = 0.01;
    for (p, logits) in [(top_k, [0.1, 0.3, 0.2]), (top_p, [0.0, 3.0, 1.0])] {
        let s = Sampler::new(p);
        for n in 0..20 {
            let mut fresh = logits;
            assert_eq!(s.sample(&mut fresh, &[], n), 1);
        }
    }
}

#[test]
fn repetition_penalty_demotes_recent_tokens() {
    let s = Sampler::new(SamplingParams {
        repetition_penalty: 2.0,
        ..params(0.0)
    });
    // token 0 wins without the penalty; with it, 2.0 / 2 < 1.5.
    assert_eq!(s.sample(&mut [2.0, 1.5], &[0], 0), 1);
}

/// No weight at all (every logit -inf or NaN): greedy, not a panic.
#[test]
fn rows_without_weight_fall_back_to_greedy() {
    let s = Sampler::new(params(1.0));
    let mut row = [f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY];
    assert_eq!(s.sample(&mut row, &[], 0), 0);
    let mut inf = [0.0, f32::INFINITY, 1.0];
    assert_eq!(s.sample(&mut inf, &[], 0), 1);
}

/// Over many draws each kept token comes about as often as its truncated,
/// renormalized probability says, and no other token comes.
#[test]
fn frequencies_follow_the_truncated_distribution() {
    let logits = [0.0f32, 1.0, 2.0, 0.5, -1.0, 1.5];
    let softmax = |keep: &[usize], t: f32| -> Vec<f64> {
        let w: Vec<f64> = (0..logits.len())
            .map(|i| {
                if keep.contains(&i) {
                    ((logits[i] / t) as f64).exp()
                } else {
                    0.0
                }
            })
            .collect();
        let z: f64 = w.iter().sum();
        w.iter().map(|x| x / z).collect()
    };
    // Probabilities at t=1: 0.05 0.13 0.36 0.08 0.02 0.22 (tokens 2, 5, 1
    // hold 0.71).
    let cases = [
        (1.0, 0, 1.0, softmax(&[0, 1, 2, 3, 4, 5], 1.0)),
        (0.7, 0, 1.0, softmax(&[0, 1, 2, 3, 4, 5], 0.7)),
        (1.0, 2, 1.0, softmax(&[2, 5], 1.0)),
        (1.0, 0, 0.7, softmax(&[2, 5, 1], 1.0)),
        (1.0, 3, 0.8, softmax(&[2, 5], 1.0)),
    ];
    const DRAWS: usize = 40_000;
    for (t, top_k, top_p, expected) in cases {
        let s = Sampler::new(SamplingParams {
            top_k,
            top_p,
            ..params(t)
        });
        let mut counts = [0usize; 6];
        for n in 0..DRAWS {
            counts[s.sample(&mut logits.clone(), &[], n) as usize] += 1;
        }
        for (i, (&c, &p)) in counts.iter().zip(&expected).enumerate() {
            let seen = c as f64 / DRAWS as f64;
            // Five standard deviations at most.
            let bound = 5.0 * (p * (1.0 - p) / DRAWS as f64).sqrt() + 1e-9;
            assert!(
                (seen - p).abs() <= bound,
                "t {t} top_k {top_k} top_p {top_p}: token {i} came {seen:.4}, expected {p:.4}"
            );
        }
    }
}

/// The fast paths (one pass, partial selection) pick exactly the token the
/// plain full-sort reference picks for the same number, over many logit
/// rows, settings and draws, ties included.
#[test]
fn fast_paths_agree_with_the_full_sort_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut checked = 0;
    for case in 0..400 {
        let n = [1, 2, 7, 64, 300, 1000, 5000][case % 7];
        let logits: Vec<f32> = match case % 5 {
            0 => model_like(&mut rng, n, 12.0),
            1 => (0..n).map(|_| rng.random_range(-4.0..4.0)).collect(),
            // Many exact ties.
            2 => (0..n)
                .map(|_| (rng.random_range(-6.0f32..6.0) * 2.0).round() / 2.0)
                .collect(),
            // A few masked tokens among ties.
            3 => (0..n)
                .map(|i| {
                    if i % 5 == 0 {
                        f32::NEG_INFINITY
                    } else {
                        (i % 3) as f32
                    }
                })
                .collect(),
            // A long, flat tail under a huge spread, and signed zeros.
            _ => (0..n)
                .map(|i| match i % 7 {
                    0 => -0.0,
                    1 => 0.0,
                    _ => rng.random_range(-40.0..10.0),
                })
                .collect(),
        };
        for _ in 0..6 {
            let t = Truncation {
                temperature: [0.3, 0.8, 1.0, 1.7][rng.random_range(0..4)],
                top_k: [0, 1, 5, 40, n.saturating_sub(1), n, n + 3][rng.random_range(0..7)],
                top_p: [1.0, 0.999, 0.95, 0.5, 0.1][rng.random_range(0..5)],
            };
            for r in [0, u64::MAX, rng.random(), rng.random(), rng.random()] {
                assert_eq!(
                    pick(&logits, t, r),
                    reference::pick(&logits, t, r),
                    "case {case} ({n} tokens), {t:?}, r {r}"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 400 * 6 * 5);
}

/// The sampler's own `exp` stays within a few units in the last place of
/// the standard library's.
#[test]
fn exp_is_accurate() {
    let mut worst = 0f64;
    for i in 0..=870_000 {
        let x = -(i as f32) / 10_000.0;
        let (ours, std) = (exp(x) as f64, (x as f64).exp());
        worst = worst.max((ours - std).abs() / std);
    }
    assert!(
        worst < 4.0 * f32::EPSILON as f64,
        "relative error {worst:e}"
    );
    assert_eq!(exp(0.0), 1.0);
    assert_eq!(exp(f32::NEG_INFINITY), exp(-87.0));
}

/// Nuclei that reach tokens far below the best (beyond where the fast path
/// looks first, 8 and 16 nats down) still match the reference.
#[test]
fn a_nucleus_deep_in_the_tail_matches_the_reference() {
    // One token of weight 1 and 5,000 far below: top_p needs some of them.
    for (depth, top_p) in [(8.5f32, 0.7), (16.1, 0.9999)] {
        let mut logits = vec![-depth; 5000];
        logits[1234] = 0.0;
        let t = Truncation {
            temperature: 1.0,
            top_k: 0,
            top_p,
        };
        let mut rng = StdRng::seed_from_u64(12);
        for r in [0, u64::MAX, rng.random(), rng.random(), rng.random()] {
            assert_eq!(pick(&logits, t, r), reference::pick(&logits, t, r), "r {r}");
        }
        assert_ne!(pick(&logits, t, u64::MAX), Some(1234), "the tail is kept");
    }
}
