//! The portable kernels (what a CPU without AVX2 runs) end to end: with
//! `TOKENMESH_CPU_SIMD=0` the model answers the reference chat prompt as the
//! SIMD kernels and llama.cpp do. Its own test binary, so the setting is in
//! place before any kernel runs.
use std::path::PathBuf;
use tokenmesh_worker::engine::chat_template::ChatTurn;
use tokenmesh_worker::engine::cpu::matmul::simd_available;
use tokenmesh_worker::engine::kv_pool::KvCache;
use tokenmesh_worker::engine::llama::{argmax, SeqStep};
use tokenmesh_worker::engine::LoadedModel;

#[test]
fn portable_kernels_answer_like_the_simd_ones() {
    std::env::set_var("TOKENMESH_CPU_SIMD", "0");
    assert!(!simd_available());
    let path = std::env::var_os("TOKENMESH_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap())
                .join(".cache/tokenmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    let model = LoadedModel::load(&path, &candle_core::Device::Cpu)
        .expect("model (run scripts/test.sh to fetch it)");
    let prompt = model
        .template
        .as_ref()
        .unwrap()
        .render(
            &[
                ChatTurn {
                    role: "system".into(),
                    content: "You are a helpful assistant.".into(),
                },
                ChatTurn {
                    role: "user".into(),
                    content: "What is the capital of France?".into(),
                },
            ],
            true,
        )
        .unwrap();
    let mut feed = model.tokenizer.encode(&prompt).unwrap();
    let mut pool = model.llama.kv_pool(16 << 20, 16).unwrap();
    let mut cache = KvCache::default();
    let mut out = Vec::new();
    for _ in 0..16 {
        let want = cache.len() + feed.len();
        pool.reserve(&mut cache, want).unwrap();
        let logits = model
            .llama
            .forward(
                &mut pool,
                &mut [SeqStep {
                    tokens: &feed,
                    cache: &mut cache,
                }],
            )
            .unwrap();
        let t = argmax(logits.row(0));
        if model.tokenizer.eos_token_ids().contains(&t) {
            break;
        }
        out.push(t);
        feed = vec![t];
    }
    assert_eq!(
        model.tokenizer.decode(&out),
        "The capital of France is Paris."
    );
}
