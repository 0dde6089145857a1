//! Token sampling: greedy, temperature, top-k, top-p, repetition penalty, seed.
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How many recent tokens the repetition penalty looks at (llama.cpp's default).
pub const PENALTY_WINDOW: usize = 64;

/// Validated sampling settings of one request.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1].
    pub top_p: f32,
    /// 0 means off.
    pub top_k: usize,
    /// 1 means off.
    pub repetition_penalty: f32,
    /// Fixed seed for reproducible sampling.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            repetition_penalty: 1.0,
            seed: None,
        }
    }
}

/// Per-sequence sampler: owns the sequence's random state.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

/// The token picked and its natural-log probability under the model
/// (before temperature and truncation), for logprobs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
}

impl Sampler {
    /// A sampler seeded from `params.seed`, or from entropy.
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Self { params, rng }
    }

    /// Picks the next token from one row of logits. `recent` are the latest
    /// context tokens, for the repetition penalty.
    pub fn sample(&mut self, logits: &mut [f32], recent: &[u32]) -> Sampled {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let start = recent.len().saturating_sub(PENALTY_WINDOW);
            let mut seen = recent[start..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for &t in &seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        let log_z = log_sum_exp(logits);
        let token = if p.temperature <= 0.0 {
            argmax(logits)
        } else {
            self.sample_stochastic(logits)
        };
        Sampled {
            token,
            logprob: logits[token as usize] - log_z,
        }
    }

    fn sample_stochastic(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|&(_, l)| (l - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= sum);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, &x) in probs.iter().enumerate() {
                acc += x;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            cand.truncate(keep);
        }
        let total: f32 = probs.iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (i, &x) in probs.iter().enumerate() {
            if r < x {
                return cand[i].0;
            }
            r -= x;
        }
        cand[probs.len() - 1].0
    }
}

/// Index of the largest logit (greedy decoding), ties to the lowest id.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn log_sum_exp(xs: &[f32]) -> f32 {
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    max + xs.iter().map(|x| (x - max).exp()).sum::<f32>().ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            seed: Some(7),
            ..Default::default()
        }
    }

    #[test]
    fn greedy_picks_the_max_and_reports_its_logprob() {
        let mut s = Sampler::new(params(0.0));
        let mut logits = vec![0.0, 2.0, 1.0];
        let out = s.sample(&mut logits, &[]);
        assert_eq!(out.token, 1);
        let expected = 2.0 - (1f32 + 2f32.exp() + 1f32.exp()).ln();
        assert!((out.logprob - expected).abs() < 1e-5);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let run = || {
            let mut s = Sampler::new(params(1.0));
            (0..20)
                .map(|_| s.sample(&mut logits.clone(), &[]).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
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
            let mut s = Sampler::new(p);
            for _ in 0..20 {
                let mut fresh = logits;
                assert_eq!(s.sample(&mut fresh, &[]).token, 1);
            }
        }
    }

    #[test]
    fn repetition_penalty_demotes_recent_tokens() {
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..params(0.0)
        });
        // token 0 wins without the penalty; with it, 2.0 / 2 < 1.5.
        assert_eq!(s.sample(&mut [2.0, 1.5], &[0]).token, 1);
    }
}
