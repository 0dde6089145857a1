//! Every weight type the CPU kernels keep as stored, against llama.cpp and
//! exact arithmetic on the same file: the default model requantized by
//! llama.cpp's own `llama-quantize --allow-requantize` to each type of
//! `TYPES` (files under the target directory, made once and reused, never
//! committed), then served by `llama-server` (f32 KV cache). Teacher-forced
//! on llama-server's greedy tokens (so that every step compares the same
//! context), a float64 forward pass of the file's weights dequantized as
//! stored (scripts/exact_forward.py) gives the distributions the file
//! defines, and:
//! - our probabilities of llama.cpp's top-5 tokens are as close to the
//!   exact ones as llama.cpp's are (mean and largest difference at most
//!   `MEAN_VS_LLAMA_CPP` and `MAX_VS_LLAMA_CPP` times llama.cpp's, plus
//!   `DRIFT_SLACK`);
//! - where our token differs from llama.cpp's, [`judge::judge`] accepts it:
//!   llama.cpp had the two near-tied, or the exact pass favours llama.cpp's
//!   by at most llama.cpp's own largest difference from it plus the
//!   near-tie (a pick an engine rounding activations to 8 bits, as llama.cpp
//!   does, can make);
//! - on the float types, where no engine rounds activations to 8 bits, our
//!   probabilities stay within `MAX_PROB_DRIFT_FLOAT` of llama.cpp's.
//!
//! The loaded weights must also take no more memory than the file's
//! tensors: a type requantized to 8 bits at load would not.
//!
//! `TOKENMESH_WEIGHT_TYPES` (comma-separated llama-quantize names) narrows
//! the list; a name may carry per-tensor overrides after `+`, each passed as
//! llama-quantize's `--tensor-type` (`Q8_0+ffn_down=q4_k` is Q8_0 with the
//! feed-forward output in Q4_K), to see which type of a mix does what.
//! llama.cpp's binaries come from `TOKENMESH_LLAMA_CPP`.
mod common;

use common::judge::{self, exact_pass, llama_cpp_drift, llama_cpp_steps, Comparison, Step};
use common::{forward_one, llama_server, model_path, probs, render_chat};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tokenmesh_tests::{llama_cpp_bin, Proc};
use tokenmesh_worker::engine::backend::Backend;
use tokenmesh_worker::engine::chat_template::ChatTurn;
use tokenmesh_worker::engine::kv::KvCache;
use tokenmesh_worker::engine::LoadedModel;

/// The file types people download (Q4_K_M and Q5_K_M mix Q4_K/Q5_K with
/// Q6_K, and, where a row is not a multiple of 256 as in SmolLM2, Q5_0, Q5_1
/// and Q8_0), plus the half-precision original.
const TYPES: &[&str] = &["Q4_0", "Q5_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16"];

/// Greedy steps per prompt: short, since the suite runs in CI.
const STEPS: usize = 16;
/// Bounds on our difference from the exact pass, relative to llama.cpp's:
/// both engines round activations to 8 bits on the quantized types, not
/// identically (llama.cpp keeps f16 block scales, and its kernels differ by
/// CPU), so each is some way from the exact pass, and the largest
/// difference is one step's, where a small change of logits moves a
/// probability most. Measured on an AVX-512 host: our mean 0.89 to 1.18
/// times llama.cpp's (Q4_K_M the highest, though none of its types alone
/// is: see BENCHMARKS.md), our largest 0.95 to 1.95 times (Q4_K_M: 0.125
/// against 0.064, one step); F16 ten times closer than llama.cpp. A wrong
/// kernel moves probabilities by 0.4 or more.
const MEAN_VS_LLAMA_CPP: f32 = 1.5;
const MAX_VS_LLAMA_CPP: f32 = 2.5;
const DRIFT_SLACK: f32 = 1e-4;
/// Largest difference from llama.cpp's probabilities on the float types,
/// whose activations neither engine rounds to 8 bits: what is left is the
/// summation order (8-bit activations had moved it by 0.4).
const MAX_PROB_DRIFT_FLOAT: f32 = 0.01;

/// The requested types.
fn types() -> Vec<String> {
    match std::env::var("TOKENMESH_WEIGHT_TYPES") {
        Ok(list) => list.split(',').map(|t| t.trim().to_string()).collect(),
        Err(_) => TYPES.iter().map(|t| t.to_string()).collect(),
    }
}

/// The default model requantized to `ty`, made once under the target
/// directory.
fn quantized(ty: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("weight-types");
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join(format!("model.{ty}.gguf"));
    if out.is_file() {
        return out;
    }
    let part = dir.join(format!("model.{ty}.gguf.part"));
    let mut parts = ty.split('+');
    let base = parts.next().unwrap_or_default();
    let status = Command::new(llama_cpp_bin("llama-quantize"))
        .arg("--allow-requantize")
        .args(parts.flat_map(|o| ["--tensor-type", o]))
        .arg(model_path())
        .arg(&part)
        .arg(base)
        .arg("2")
        .output()
        .expect("llama-quantize runs");
    assert!(
        status.status.success(),
        "llama-quantize {ty} failed:\n{}",
        String::from_utf8_lossy(&status.stderr)
    );
    std::fs::rename(&part, &out).unwrap();
    out
}

/// llama-server on `model`, healthy.
fn serve(model: &Path, dir: &Path, ty: &str) -> (Proc, String) {
    // An f32 KV cache and no flash attention: llama.cpp as exact as it
    // computes, as ours keeps its cache in f32.
    let args = [
        "-t", "2", "-np", "1", "-c", "1024", "-ctk", "f32", "-ctv", "f32", "-fa", "off",
    ];
    let name = format!("llama-server-{ty}");
    llama_server(model, dir, &name, &args, Duration::from_secs(120))
}

#[test]
fn each_weight_type_matches_llama_cpp() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("weight-types");
    let (mut report, mut failures) = (Vec::new(), Vec::new());
    for ty in types() {
        let file = quantized(&ty);
        let model = LoadedModel::load(&file, &candle_core::Device::Cpu).expect("model loads");
        let Backend::Cpu(cpu) = &model.backend else {
            panic!("the CPU backend")
        };
        let file_len = std::fs::metadata(&file).unwrap().len() as usize;
        assert!(
            cpu.weight_bytes() <= file_len,
            "{ty}: {} bytes of weights from a {file_len}-byte file: a type was requantized",
            cpu.weight_bytes()
        );
        let (_server, url) = serve(&file, &dir, &ty);
        let chat = render_chat(
            &model,
            &[ChatTurn {
                role: "user".into(),
                content: "What is the capital of France?".into(),
            }],
        );
        let prompts: Vec<Vec<u32>> = [
            chat.as_str(),
            "Once upon a time, there was a little",
            "def fibonacci(n):\n",
            "Water boils at a temperature of",
        ]
        .iter()
        .map(|prompt| model.tokenizer.encode(prompt).unwrap())
        .collect();
        let continuations: Vec<Vec<Step>> = prompts
            .iter()
            .map(|ids| llama_cpp_steps(&url, ids, STEPS, 5, true))
            .collect();
        let exact = exact_pass(
            &file,
            &dir,
            &prompts,
            &continuations,
            model.backend.vocab_size(),
        );
        let reference = llama_cpp_drift(&continuations, &exact);
        let tie = judge::tie(&reference);
        let mut forced = Comparison::default();
        for ((ids, steps), exact) in prompts.iter().zip(&continuations).zip(&exact) {
            let mut pool = model.backend.kv_pool(16 << 20, 16).unwrap();
            let mut cache = KvCache::default();
            let mut feed = ids.clone();
            for (i, (step, e)) in steps.iter().zip(exact).enumerate() {
                let p = probs(&forward_one(&model.backend, &mut pool, &feed, &mut cache));
                if let Err(why) = forced.step(step, e, &p, tie) {
                    failures.push(format!("{ty} step {i}: {why}"));
                }
                feed = vec![step.token];
            }
        }
        let float = matches!(ty.as_str(), "F16" | "BF16" | "F32");
        if float && forced.drift > MAX_PROB_DRIFT_FLOAT {
            failures.push(format!(
                "{ty}: a top-5 probability differs from llama.cpp's by {:.4}",
                forced.drift
            ));
        }
        if let Some(why) =
            forced.too_far(&reference, MEAN_VS_LLAMA_CPP, MAX_VS_LLAMA_CPP, DRIFT_SLACK)
        {
            failures.push(format!("{ty}: {why}"));
        }
        report.push(format!(
            "{ty}: {}; weights {} MiB of a {} MiB file",
            forced.summary(&reference),
            cpu.weight_bytes() >> 20,
            file_len >> 20
        ));
    }
    eprintln!("{}", report.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
