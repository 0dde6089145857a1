//! Every weight type the CPU kernels keep as stored, against llama.cpp on the
//! same file: the default model requantized by llama.cpp's own
//! `llama-quantize --allow-requantize` to each type of `TYPES` (files under
//! the target directory, made once and reused, never committed), then served
//! by `llama-server`. Teacher-forced on llama-server's greedy tokens (so that
//! every step compares the same context), our next token equals llama.cpp's
//! or llama.cpp had the two within `NEAR_TIE`, and our probability of each of
//! llama.cpp's top-5 tokens stays within `MAX_PROB_DRIFT` of its
//! (`MAX_PROB_DRIFT_FLOAT` for the float types). The loaded
//! weights must also take no more memory than the file's tensors: a type
//! requantized to 8 bits at load would not.
//!
//! `TOKENMESH_WEIGHT_TYPES` (comma-separated llama-quantize names) narrows
//! the list; llama.cpp's binaries come from `TOKENMESH_LLAMA_CPP`.
mod common;

use common::{forward_one, llama_server, model_path, probs, render_chat};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tokenmesh_tests::{llama_cpp_bin, post_json, Proc};
use tokenmesh_worker::engine::backend::Backend;
use tokenmesh_worker::engine::chat_template::ChatTurn;
use tokenmesh_worker::engine::kv::KvCache;
use tokenmesh_worker::engine::sampling::argmax;
use tokenmesh_worker::engine::LoadedModel;

/// The file types people download (Q4_K_M and Q5_K_M mix Q4_K/Q5_K with
/// Q6_K, and, where a row is not a multiple of 256 as in SmolLM2, Q5_0, Q5_1
/// and Q8_0), plus the half-precision original.
const TYPES: &[&str] = &["Q4_0", "Q5_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16"];

/// Greedy steps per prompt: short, since the suite runs in CI.
const STEPS: usize = 12;
/// llama.cpp's probabilities of the two tokens differ by at most this where
/// the engines may pick differently. Wider than the reference test's 0.06:
/// on these requantized files the engines' probabilities part by up to
/// 0.097 (Q8_0, whose kernel the reference test also runs), so a pair
/// closer than that for llama.cpp may be ordered either way (a Q5_0 step
/// had llama.cpp at 0.531 against 0.448 and us at 0.469 against 0.514).
const NEAR_TIE: f32 = 0.10;
/// Largest difference allowed between the engines' probability of a token
/// in llama.cpp's top 5 for the quantized types: both round activations to
/// 8 bits (not identically) and llama.cpp keeps its KV cache in f16. Where
/// the differences fall depends on llama.cpp's kernels for the CPU: at most
/// 0.097 with its AVX-512 build on an Intel host, up to 0.166 (Q4_K_M) with
/// its AVX2 build on an AMD EPYC host without AVX-512, where our kernels
/// compute the same (the VNNI and AVX2 kernels are tested bit-equal). A
/// wrong kernel moves them by 0.4 or more.
const MAX_PROB_DRIFT: f32 = 0.2;
/// The same bound for the float types, whose activations neither engine
/// rounds to 8 bits: what is left is llama.cpp's f16 KV cache and summation
/// order (0.001 measured on F16; 8-bit activations had moved it by 0.4).
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
    let status = Command::new(llama_cpp_bin("llama-quantize"))
        .arg("--allow-requantize")
        .arg(model_path())
        .arg(&part)
        .arg(ty)
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
    let args = ["-t", "2", "-np", "1", "-c", "1024"];
    let name = format!("llama-server-{ty}");
    llama_server(model, dir, &name, &args, Duration::from_secs(120))
}

/// llama.cpp's greedy continuation of `ids`: per step, the chosen token and
/// the top 5 (token, probability), probabilities from the full-vocabulary
/// softmax (`n_probs`, before sampling).
fn llama_cpp_steps(url: &str, ids: &[u32]) -> Vec<(u32, Vec<(u32, f32)>)> {
    let body = json!({
        "prompt": ids,
        "n_predict": STEPS,
        "n_probs": 5,
        "temperature": 0.0,
        "cache_prompt": false,
    });
    let (code, v) = post_json(&format!("{url}/completion"), &body.to_string(), &[]);
    assert_eq!(code, 200, "{v}");
    let steps = v["completion_probabilities"]
        .as_array()
        .expect("probabilities");
    assert!(!steps.is_empty(), "{v}");
    let id = |e: &Value| e["id"].as_u64().expect("token id") as u32;
    steps
        .iter()
        .map(|s| {
            let top = s["top_logprobs"].as_array().expect("top_logprobs");
            let top: Vec<(u32, f32)> = top
                .iter()
                .map(|e| (id(e), e["logprob"].as_f64().unwrap().exp() as f32))
                .collect();
            (id(s), top)
        })
        .collect()
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
        let mut drift = 0f32;
        let mut ties = 0;
        for prompt in [chat.as_str(), "Once upon a time, there was a little"] {
            let ids = model.tokenizer.encode(prompt).unwrap();
            let steps = llama_cpp_steps(&url, &ids);
            let mut pool = model.backend.kv_pool(16 << 20, 16).unwrap();
            let mut cache = KvCache::default();
            let mut feed = ids;
            for (i, (theirs, top5)) in steps.iter().enumerate() {
                let p = probs(&forward_one(&model.backend, &mut pool, &feed, &mut cache));
                for &(t, q) in top5 {
                    drift = drift.max((p[t as usize] - q).abs());
                }
                let ours = argmax(&p);
                if ours != *theirs {
                    let their_p = |t: u32| top5.iter().find(|e| e.0 == t).map(|e| e.1);
                    let theirs_p = their_p(*theirs).unwrap();
                    let ours_p = their_p(ours).unwrap_or_else(|| {
                        panic!("{ty} step {i}: our {ours} is not in llama.cpp's top 5")
                    });
                    if (ours_p - theirs_p).abs() > NEAR_TIE {
                        failures.push(format!(
                            "{ty} step {i}: we pick {ours} ({:.3}; llama.cpp {ours_p:.3}), llama.cpp \
                             picks {theirs} ({theirs_p:.3}; ours {:.3}): not a near-tie",
                            p[ours as usize], p[*theirs as usize]
                        ));
                    }
                    ties += 1;
                }
                feed = vec![*theirs];
            }
        }
        let bound = match ty.as_str() {
            "F16" | "BF16" | "F32" => MAX_PROB_DRIFT_FLOAT,
            _ => MAX_PROB_DRIFT,
        };
        if drift > bound {
            failures.push(format!(
                "{ty}: a top-5 probability differs from llama.cpp's by {drift:.3}"
            ));
        }
        report.push(format!(
            "{ty}: {ties} near-tie divergences, largest top-5 probability difference {drift:.4}, \
             weights {} MiB of a {} MiB file",
            cpu.weight_bytes() >> 20,
            file_len >> 20
        ));
    }
    eprintln!("{}", report.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
