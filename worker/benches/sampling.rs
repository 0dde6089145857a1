//! One sampled token over a 49,152-entry vocabulary (SmolLM2's): greedy, the
//! server's defaults (t=1, no top-k, no top-p), t=0.8 with top_p=0.95,
//! top_k=40, and the full-sort sampler this crate had before (kept here only,
//! for comparison).
//!
//! Two logit rows, shaped like the model's (measured on SmolLM2-135M over a
//! chat reply: the bulk roughly normal with a standard deviation of about
//! 4.3; the best tokens 10 to 25 above its mean): `peaked`, a dozen tokens
//! well above the bulk (at t=0.8 the 95% nucleus holds a few tokens, as in
//! most steps), and `flat`, the bulk alone (a nucleus of about a hundred,
//! as in open-ended steps).
//!
//! Run: `cargo bench -p tokenmesh-worker --bench sampling -- --warm-up-time 1 --measurement-time 3`
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokenmesh_worker::engine::sampling::{Sampler, SamplingParams};

const VOCAB: usize = 49_152;

fn row(peaked: bool) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(5);
    let mut normal = move || {
        // Box-Muller.
        let (u, v): (f32, f32) = (rng.random_range(f32::EPSILON..1.0), rng.random());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    };
    let mut row: Vec<f32> = (0..VOCAB).map(|_| 4.3 * normal() - 4.0).collect();
    if peaked {
        for i in 0..12 {
            row[(i * 4099 + 17) % VOCAB] = 14.0 + 4.0 * normal().abs();
        }
    }
    row
}

fn bench(c: &mut Criterion) {
    let settings = [
        ("greedy", 0.0, 0, 1.0),
        ("defaults_t1", 1.0, 0, 1.0),
        ("t0.8_top_p0.95", 0.8, 0, 0.95),
        ("top_k40", 1.0, 40, 1.0),
    ];
    for shape in ["peaked", "flat"] {
        let logits = row(shape == "peaked");
        let mut group = c.benchmark_group(format!("sample_{shape}"));
        for (name, temperature, top_k, top_p) in settings {
            let sampler = Sampler::new(SamplingParams {
                temperature,
                top_k,
                top_p,
                seed: Some(1),
                ..Default::default()
            });
            let mut row = logits.clone();
            let mut position = 0;
            group.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    position += 1;
                    // No repetition penalty: `row` is left as it was.
                    sampler.sample(&mut row, &[], position)
                })
            });
        }
        let mut old = full_sort::Sampler::new(7);
        group.bench_function(BenchmarkId::from_parameter("old_full_sort_t1"), |b| {
            b.iter(|| old.sample(&logits, 1.0, 0, 1.0))
        });
        group.finish();
    }
}

/// The sampler as it was: every stochastic token sorts the vocabulary, and
/// every token computes its log-probability (a log-sum-exp over the row).
mod full_sort {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    pub struct Sampler {
        rng: StdRng,
    }

    impl Sampler {
        pub fn new(seed: u64) -> Self {
            Self {
                rng: StdRng::seed_from_u64(seed),
            }
        }

        pub fn sample(&mut self, logits: &[f32], t: f32, top_k: usize, top_p: f32) -> (u32, f32) {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let log_z = max + logits.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
            let mut cand: Vec<(u32, f32)> = logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, l / t))
                .collect();
            cand.sort_by(|a, b| b.1.total_cmp(&a.1));
            if top_k > 0 {
                cand.truncate(top_k);
            }
            let max = cand[0].1;
            let mut probs: Vec<f32> = cand.iter().map(|&(_, l)| (l - max).exp()).collect();
            let sum: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|x| *x /= sum);
            if top_p < 1.0 {
                let mut acc = 0.0;
                let mut keep = probs.len();
                for (i, &x) in probs.iter().enumerate() {
                    acc += x;
                    if acc >= top_p {
                        keep = i + 1;
                        break;
                    }
                }
                probs.truncate(keep);
                cand.truncate(keep);
            }
            let total: f32 = probs.iter().sum();
            let mut r = self.rng.random::<f32>() * total;
            let mut token = cand[probs.len() - 1].0;
            for (i, &x) in probs.iter().enumerate() {
                if r < x {
                    token = cand[i].0;
                    break;
                }
                r -= x;
            }
            (token, logits[token as usize] - log_z)
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
