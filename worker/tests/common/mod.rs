//! What the model-backed test binaries share: where the model is, a chat
//! rendered with its template, and one greedy reply through a backend.
#![allow(dead_code)] // each test binary uses its own part

pub use tokenmesh_tests::model_path;
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
