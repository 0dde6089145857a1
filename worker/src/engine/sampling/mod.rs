//! Token sampling: greedy, temperature, top-k, top-p, repetition penalty, seed.
//!
//! Sampling randomness is a pure function of (seed, token position): the
//! completion token at position N takes the N-th number of the seed's stream
//! ([`draw`]), and [`pick`] turns that number into a token by a fixed rule. A
//! continuation after a failover (or a recomputation after a preemption)
//! therefore draws exactly what the first run drew.
mod draw;
mod pick;

pub use draw::Draws;
use pick::{pick, Truncation};

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
    /// Never pick an end-of-turn token (the engine masks them, as
    /// llama-server's `ignore_eos` does), so only the length or a stop
    /// string ends the sequence.
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            repetition_penalty: 1.0,
            seed: None,
            ignore_eos: false,
        }
    }
}

/// Per-sequence sampler: the settings and the sequence's random draws.
pub struct Sampler {
    params: SamplingParams,
    draws: Draws,
}

impl Sampler {
    /// A sampler drawing from `params.seed`, or from a seed taken from
    /// entropy (an unseeded request is not reproducible, across a failover
    /// or otherwise).
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        Self {
            draws: Draws::new(seed),
            params,
        }
    }

    /// Picks the completion token at `position` (the count of completion
    /// tokens before it, counting those emitted before a failover) from one
    /// row of logits. `recent` are the latest context tokens, for the
    /// repetition penalty, which is applied to `logits` in place.
    ///
    /// The result is a pure function of (seed, position, logits, recent).
    pub fn sample(&self, logits: &mut [f32], recent: &[u32], position: usize) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            penalize(logits, recent, p.repetition_penalty);
        }
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        let truncation = Truncation {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
        };
        pick(logits, truncation, self.draws.at(position)).unwrap_or_else(|| argmax(logits))
    }
}

/// Divides positive logits of the tokens in the last [`PENALTY_WINDOW`] of
/// `recent` by `penalty` and multiplies negative ones (each token once).
fn penalize(logits: &mut [f32], recent: &[u32], penalty: f32) {
    let start = recent.len().saturating_sub(PENALTY_WINDOW);
    let mut seen = recent[start..].to_vec();
    seen.sort_unstable();
    seen.dedup();
    for &t in &seen {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
    }
}

/// Index of the largest logit (greedy decoding), ties to the lowest id;
/// NaNs are skipped, and a row with no number above -inf gives 0.
pub fn argmax(logits: &[f32]) -> u32 {
    // Lanes, each keeping its first maximum, so that the scan vectorizes.
    const LANES: usize = 8;
    let mut best = [f32::NEG_INFINITY; LANES];
    let mut at = [0u32; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for (c, chunk) in chunks.enumerate() {
        for (j, &x) in chunk.iter().enumerate() {
            let gt = x > best[j];
            best[j] = if gt { x } else { best[j] };
            at[j] = if gt { (c * LANES + j) as u32 } else { at[j] };
        }
    }
    let mut winner = (f32::NEG_INFINITY, 0u32);
    for (&x, &i) in best.iter().zip(&at) {
        if x > winner.0 || (x == winner.0 && x > f32::NEG_INFINITY && i < winner.1) {
            winner = (x, i);
        }
    }
    // The tail's ids are above every lane's: only a larger value wins.
    let base = logits.len() - tail.len();
    for (j, &x) in tail.iter().enumerate() {
        if x > winner.0 {
            winner = (x, (base + j) as u32);
        }
    }
    winner.1
}

/// The natural-log probability of `token` under `logits` (after the
/// repetition penalty, before temperature and truncation), for logprobs.
/// Under `ignore_eos` the caller has masked the end-of-turn tokens, so the
/// probability is over the other tokens, the distribution actually drawn from.
pub fn logprob(logits: &[f32], token: u32) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_z = max + logits.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
    logits[token as usize] - log_z
}

#[cfg(test)]
mod tests;
