//! What the model-backed test binaries share: where the model is, a chat
//! rendered with its template, one greedy reply through a backend, the
//! softmax of a logits row, a llama-server to compare with, and (in
//! [`judge`]) the exact float64 forward pass that judges between the two.
#![allow(dead_code)] // each test binary uses its own part

pub mod judge;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
pub use tokenmesh_tests::model_path;
use tokenmesh_tests::{curl, free_port, llama_cpp_bin, Proc};
use tokenmesh_worker::engine::backend::Backend;
use tokenmesh_worker::engine::chat_template::ChatTurn;
use tokenmesh_worker::engine::kv::{KvCache, KvPool};
use tokenmesh_worker::engine::model::SeqStep;
use tokenmesh_worker::engine::sampling::argmax;
use tokenmesh_worker::engine::LoadedModel;

/// Runs `feed` through `backend` after what `cache` holds; the logits of its
/// last token.
pub fn forward_one(
    backend: &Backend,
    pool: &mut KvPool,
    feed: &[u32],
    cache: &mut KvCache,
) -> Vec<f32> {
    let want = cache.len() + feed.len();
    pool.reserve(cache, want).unwrap();
    backend
        .forward(
            pool,
            &mut [SeqStep {
                tokens: feed,
                cache,
            }],
        )
        .unwrap()
        .row(0)
        .to_vec()
}

/// `turns` in the model's chat template, ending where the assistant's reply
/// starts.
pub fn render_chat(model: &LoadedModel, turns: &[ChatTurn]) -> String {
    model
        .template
        .as_ref()
        .unwrap()
        .render(turns, true)
        .unwrap()
}

/// The greedy reply (at most 16 tokens) to "What is the capital of France?"
/// with the default system prompt; llama.cpp answers "The capital of France
/// is Paris.".
pub fn france_reply(model: &LoadedModel) -> String {
    let turns = [
        ChatTurn {
            role: "system".into(),
            content: "You are a helpful assistant.".into(),
        },
        ChatTurn {
            role: "user".into(),
            content: "What is the capital of France?".into(),
        },
    ];
    let prompt = render_chat(model, &turns);
    let mut feed = model.tokenizer.encode(&prompt).unwrap();
    let mut pool = model.backend.kv_pool(64 << 20, 16).unwrap();
    let mut cache = KvCache::default();
    let mut out = Vec::new();
    for _ in 0..16 {
        let logits = forward_one(&model.backend, &mut pool, &feed, &mut cache);
        let t = argmax(&logits);
        if model.tokenizer.eos_token_ids().contains(&t) {
            break;
        }
        out.push(t);
        feed = vec![t];
    }
    model.tokenizer.decode(&out)
}

/// Softmax of one logits row.
pub fn probs(row: &[f32]) -> Vec<f32> {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = row.iter().map(|x| (x - max).exp()).collect();
    let z: f32 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

/// llama-server (`$TOKENMESH_LLAMA_CPP/bin`) on `model` on an ephemeral
/// loopback port with the further `args`, once its /health answers (within
/// `ready_within`): the process, killed when dropped (also when the test
/// fails), and its URL.
pub fn llama_server(
    model: &Path,
    dir: &Path,
    name: &str,
    args: &[&str],
    ready_within: Duration,
) -> (Proc, String) {
    let port = free_port();
    let mut argv: Vec<String> = vec![
        "-m".into(),
        model.display().to_string(),
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        port.to_string(),
        "--no-webui".into(),
    ];
    argv.extend(args.iter().map(|s| s.to_string()));
    let mut proc = Proc::spawn(name, &llama_cpp_bin("llama-server"), &argv, dir)
        .expect("starting llama-server");
    let url = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + ready_within;
    while curl(&[&format!("{url}/health")]).0 != 200 {
        assert!(
            proc.running() && Instant::now() < deadline,
            "{name} did not become healthy:\n{}",
            proc.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (proc, url)
}

/// llama.cpp's sources and binaries (`TOKENMESH_LLAMA_CPP`: src/ with
/// gguf-py, bin/).
pub fn llama_cpp_root() -> PathBuf {
    PathBuf::from(std::env::var_os("TOKENMESH_LLAMA_CPP").expect(
        "TOKENMESH_LLAMA_CPP is not set: point it at llama.cpp (src/ with gguf-py, bin/ with \
         llama-server and llama-quantize; scripts/llama-cpp.sh prepares target/llama.cpp)",
    ))
}

/// The Python with numpy the model scripts run under (`TOKENMESH_PYTHON`,
/// else `python3`), gguf-py on its path.
pub fn python_with_gguf() -> Command {
    let python = std::env::var("TOKENMESH_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut cmd = Command::new(python);
    cmd.env("PYTHONPATH", llama_cpp_root().join("src/gguf-py"));
    cmd
}

/// Runs `cmd` to success, or panics with its output.
pub fn run(cmd: &mut Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
