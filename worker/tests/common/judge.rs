//! The worker and llama.cpp judged by exact arithmetic: llama.cpp's greedy
//! steps with its top tokens' probabilities, the exact float64 forward pass
//! of the same weights (scripts/exact_forward.py) at each of those steps,
//! and the comparison rules arch_oracle.rs and weight_types.rs share.
use super::{python_with_gguf, run};
use serde_json::{json, Value};
use std::path::Path;
use tokenmesh_tests::post_json;
use tokenmesh_worker::engine::sampling::argmax;

/// Two tokens count as a near-tie when their probabilities differ by at
/// most this (the rule of tests/reference.rs).
pub const NEAR_TIE: f32 = 0.06;

/// The largest and the mean of some absolute differences between two
/// engines' probabilities.
#[derive(Default, Clone, Copy, Debug)]
pub struct Drift {
    pub max: f32,
    sum: f64,
    count: usize,
}

impl Drift {
    pub fn add(&mut self, d: f32) {
        self.max = self.max.max(d);
        self.sum += f64::from(d);
        self.count += 1;
    }

    pub fn mean(&self) -> f32 {
        (self.sum / self.count.max(1) as f64) as f32
    }

    /// Whether `self` (ours) is no further from the exact pass than
    /// `reference` (llama.cpp's), within the factors on the mean and the
    /// largest difference, plus `slack`.
    pub fn within(&self, reference: &Drift, mean_factor: f32, max_factor: f32, slack: f32) -> bool {
        self.mean() <= mean_factor * reference.mean() + slack
            && self.max <= max_factor * reference.max + slack
    }
}

/// One step of llama.cpp's continuation: its token and its top tokens with
/// their probabilities.
pub struct Step {
    pub token: u32,
    pub top: Vec<(u32, f32)>,
}

impl Step {
    /// llama.cpp's probability of `t`, if among its top tokens.
    pub fn prob(&self, t: u32) -> Option<f32> {
        self.top.iter().find(|e| e.0 == t).map(|e| e.1)
    }
}

/// llama.cpp's greedy continuation of the token ids `prompt`: `steps`
/// tokens, or (with `stop_at_eos`) up to its end of sequence, with its
/// `n_probs` most probable tokens per step, probabilities from the
/// full-vocabulary softmax. (Ignoring the end of sequence masks it, so a step
/// where it is the most probable token would not be greedy.)
pub fn llama_cpp_steps(
    url: &str,
    prompt: &[u32],
    steps: usize,
    n_probs: usize,
    stop_at_eos: bool,
) -> Vec<Step> {
    let body = json!({
        "prompt": prompt,
        "n_predict": steps,
        "n_probs": n_probs,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": !stop_at_eos,
        "cache_prompt": false,
    });
    let (code, reply) = post_json(&format!("{url}/completion"), &body.to_string(), &[]);
    assert_eq!(code, 200, "llama-server /completion: {reply}");
    assert_eq!(
        reply["tokens_evaluated"].as_u64(),
        Some(prompt.len() as u64),
        "llama-server evaluated the prompt ids as given: {reply}"
    );
    let id = |v: &Value| v["id"].as_u64().expect("token id") as u32;
    let out: Vec<Step> = reply["completion_probabilities"]
        .as_array()
        .unwrap_or_else(|| panic!("no completion_probabilities: {reply}"))
        .iter()
        .map(|s| Step {
            token: id(s),
            top: s["top_logprobs"]
                .as_array()
                .expect("top_logprobs")
                .iter()
                .map(|e| (id(e), e["logprob"].as_f64().unwrap().exp() as f32))
                .collect(),
        })
        .collect();
    assert!(
        out.len() == steps || (stop_at_eos && (1..steps).contains(&out.len())),
        "llama.cpp's steps ({} of {steps}): {reply}",
        out.len()
    );
    for s in &out {
        // Greedy: the emitted token is llama.cpp's own most probable one, so
        // the probabilities compared are the ones its choice came from.
        assert_eq!(s.token, s.top[0].0, "llama.cpp's greedy token is its top");
    }
    out
}

/// The exact pass (scripts/exact_forward.py: a float64 forward pass of
/// `model`'s weights, dequantized as stored) over each prompt followed by
/// llama.cpp's continuation of it: per prompt, the next-token distribution
/// at each of llama.cpp's steps. `dir` holds the exchanged files.
pub fn exact_pass(
    model: &Path,
    dir: &Path,
    prompts: &[Vec<u32>],
    continuations: &[Vec<Step>],
    vocab: usize,
) -> Vec<Vec<Vec<f32>>> {
    let sequences: Vec<Value> = prompts
        .iter()
        .zip(continuations)
        .map(|(prompt, steps)| {
            let tokens: Vec<u32> = prompt
                .iter()
                .copied()
                .chain(steps.iter().map(|s| s.token))
                .collect();
            json!({ "tokens": tokens, "from": prompt.len() })
        })
        .collect();
    let input = dir.join("exact-in.json");
    let output = dir.join("exact-out.bin");
    std::fs::write(&input, json!({ "sequences": sequences }).to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/exact_forward.py");
    run(
        python_with_gguf()
            .arg(script)
            .arg("--model")
            .arg(model)
            .arg("--in")
            .arg(&input)
            .arg("--out")
            .arg(&output),
        "exact_forward.py",
    );
    let bytes = std::fs::read(&output).unwrap();
    let floats: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let want: usize = continuations.iter().map(Vec::len).sum();
    assert_eq!(
        floats.len(),
        want * vocab,
        "exact_forward.py wrote {} floats, not {want} steps of {vocab}",
        floats.len()
    );
    let mut rows = floats.chunks_exact(vocab).map(<[f32]>::to_vec);
    continuations
        .iter()
        .map(|steps| rows.by_ref().take(steps.len()).collect())
        .collect()
}

/// llama.cpp's differences from the exact pass, over its top tokens at
/// every step.
pub fn llama_cpp_drift(continuations: &[Vec<Step>], exact: &[Vec<Vec<f32>>]) -> Drift {
    let mut d = Drift::default();
    for (steps, exact) in continuations.iter().zip(exact) {
        for (step, e) in steps.iter().zip(exact) {
            for &(t, q) in &step.top {
                d.add((q - e[t as usize]).abs());
            }
        }
    }
    d
}

/// How far the exact pass may favour llama.cpp's token over ours where
/// llama.cpp was not near-tied: llama.cpp's own largest difference from
/// exact (`reference`) plus `NEAR_TIE`, a pick an engine rounding
/// activations to 8 bits, as llama.cpp does, can make.
pub fn tie(reference: &Drift) -> f32 {
    NEAR_TIE + reference.max
}

/// Where our token `ours` (from our distribution `p`) differs from
/// llama.cpp's `step.token`: acceptable when llama.cpp had the two within
/// `NEAR_TIE`, or the exact pass `e` favours llama.cpp's by at most `tie`.
/// Ok(whether the exact pass favoured ours), or the reason it is not.
pub fn judge(step: &Step, ours: u32, e: &[f32], tie: f32, p: &[f32]) -> Result<bool, String> {
    let gap = e[step.token as usize] - e[ours as usize];
    let their_gap = step.top[0].1 - step.prob(ours).unwrap_or(0.0);
    if their_gap <= NEAR_TIE || gap <= tie {
        return Ok(gap < 0.0);
    }
    Err(format!(
        "we pick {ours} (ours {:.3}, llama.cpp {:.3}, exact {:.3}), llama.cpp picks {} (ours \
         {:.3}, llama.cpp {:.3}, exact {:.3}): not a near-tie for llama.cpp, and the exact pass \
         favours its pick by {gap:.3}, more than {tie:.3}",
        p[ours as usize],
        step.prob(ours).unwrap_or(0.0),
        e[ours as usize],
        step.token,
        p[step.token as usize],
        step.top[0].1,
        e[step.token as usize],
    ))
}

/// One backend's teacher-forced steps against llama.cpp and the exact pass.
#[derive(Default)]
pub struct Comparison {
    pub steps: usize,
    /// Steps where our token was not llama.cpp's.
    pub disagreements: usize,
    /// Of those, where the exact pass favoured ours.
    pub exact_favoured_ours: usize,
    /// Largest difference from llama.cpp's probabilities of its top tokens.
    pub drift: f32,
    /// Our differences from the exact pass's probabilities of llama.cpp's
    /// top tokens.
    pub ours_exact: Drift,
}

impl Comparison {
    /// Records one step: our distribution `p` against llama.cpp's `step`
    /// and the exact `e`; the reason when [`judge`] rejects our pick.
    pub fn step(&mut self, step: &Step, e: &[f32], p: &[f32], tie: f32) -> Result<(), String> {
        self.steps += 1;
        for &(t, q) in &step.top {
            let t = t as usize;
            self.drift = self.drift.max((p[t] - q).abs());
            self.ours_exact.add((p[t] - e[t]).abs());
        }
        let ours = argmax(p);
        if ours == step.token {
            return Ok(());
        }
        self.disagreements += 1;
        self.exact_favoured_ours += usize::from(judge(step, ours, e, tie, p)?);
        Ok(())
    }

    /// One line: the disagreements and both engines' differences from the
    /// exact pass (`reference`: llama.cpp's).
    pub fn summary(&self, reference: &Drift) -> String {
        format!(
            "{} teacher-forced steps, {} disagreements with llama.cpp (the exact pass favoured \
             ours at {}); top probabilities' largest difference from llama.cpp {:.2e}; from the \
             exact pass: ours mean {:.2e} max {:.2e}, llama.cpp's mean {:.2e} max {:.2e}",
            self.steps,
            self.disagreements,
            self.exact_favoured_ours,
            self.drift,
            self.ours_exact.mean(),
            self.ours_exact.max,
            reference.mean(),
            reference.max
        )
    }

    /// Why ours is further from the exact pass than `reference` (llama.cpp's)
    /// by more than the factors on the mean and the largest difference plus
    /// `slack`, if it is.
    pub fn too_far(&self, reference: &Drift, mean: f32, max: f32, slack: f32) -> Option<String> {
        let o = &self.ours_exact;
        (!o.within(reference, mean, max, slack)).then(|| {
            format!(
                "our probabilities are further from the exact pass (mean {:.4}, max {:.4}) than \
                 {mean} x llama.cpp's mean {:.4} or {max} x its max {:.4} (+ {slack})",
                o.mean(),
                o.max,
                reference.mean(),
                reference.max
            )
        })
    }
}
