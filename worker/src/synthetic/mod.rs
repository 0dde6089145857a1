//! The synthetic engine: a worker mode that loads no model and emits
//! deterministic tokens at a set rate with a set capacity, so that router
//! behaviour, overhead and the load generator can be measured without model
//! compute (the role of Dynamo's mocker). It is never the default: it runs
//! only with `--engine synthetic`.
//!
//! It is a model ([`SyntheticStepModel`]) behind the real scheduler, so the
//! queue, priorities, continuous batching, chunked prompts, KV accounting,
//! preemption, sampling and stop strings are the ones the GGUF model runs
//! with; what differs is documented here:
//! - **Tokenization**: the prompt (or the chat messages rendered as
//!   `role: content` lines) is split on whitespace, one token per word; a
//!   word's id is a hash of it modulo the vocabulary.
//! - **Vocabulary**: [`WORDS`], each token's text is a space and one word
//!   (some are non-ASCII, so text deltas exercise real UTF-8).
//! - **Output**: completion token `i` of a request is word
//!   `(seed + i) % WORDS.len()`, where `seed` is a hash of the prompt's token
//!   ids: the model's logits are one-hot on that word, so every sampling
//!   setting picks it (with log-probability 0). The same prompt always yields
//!   the same text, and a continuation after a failover (or a recomputation
//!   after a preemption) yields exactly what the first run would have.
//! - **Timing**: a step lasts `1 / tokens_per_sec` seconds, so each running
//!   sequence gets one token every such interval, the first one a step after
//!   it leaves the queue (a prompt longer than `--max-tokens-per-step` is
//!   read in several steps, as the scheduler chunks it). At most `max_batch`
//!   sequences run; the rest wait in the queue, and a full queue is
//!   RESOURCE_EXHAUSTED.
//! - **KV cache**: blocks are accounted, not stored, at
//!   [`KV_BYTES_PER_TOKEN`] per token of `--kv-budget-mib`, so KV use is
//!   reported and a small budget preempts as the real engine does.
//! - It never emits an end-of-sequence token: sequences end on `max_tokens`,
//!   a stop string or the context window.
//! - **Fault injection** (load tests of canary analysis): a set fraction of
//!   new requests, chosen by a hash of the request id, fail with INTERNAL
//!   "synthetic fault injected" when their first token would be due; and a
//!   set extra delay before every sequence's first token (rounded up to a
//!   whole step).
mod engine;

pub use engine::{
    injects_fault, start, SyntheticConfig, SyntheticSeq, SyntheticStepModel, FAULT_MESSAGE,
    KV_BYTES_PER_TOKEN,
};

use crate::errors::WorkerError;
use crate::request::PromptModel;
use tokenmesh_proto::v1::GenerateRequest;

/// The synthetic vocabulary.
pub const WORDS: [&str; 32] = [
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett",
    "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango",
    "uniform", "victor", "whiskey", "xray", "yankee", "zulu", "café", "naïve", "über", "señor",
    "日本", "Ωmega",
];

/// Context window of the synthetic model, in tokens.
pub const CONTEXT_LENGTH: usize = 32_768;

/// The synthetic model as request preparation sees it.
#[derive(Clone, Copy, Debug, Default)]
pub struct SyntheticModel;

impl PromptModel for SyntheticModel {
    fn context_length(&self) -> usize {
        CONTEXT_LENGTH
    }

    fn vocab_size(&self) -> usize {
        WORDS.len()
    }

    fn encode_prompt(&self, g: &GenerateRequest) -> Result<Vec<u32>, WorkerError> {
        let text = if g.messages.is_empty() {
            g.prompt.clone()
        } else {
            g.messages
                .iter()
                .map(|m| format!("{}: {}\n", m.role, m.content))
                .collect()
        };
        Ok(tokenize(&text))
    }
}

/// One token per whitespace-separated word.
pub fn tokenize(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .map(|w| (fnv1a(w.as_bytes()) % WORDS.len() as u64) as u32)
        .collect()
}

/// The bytes of token `id`: a space and its word.
pub fn token_bytes(id: u32) -> Vec<u8> {
    format!(" {}", WORDS[id as usize % WORDS.len()]).into_bytes()
}

/// The id of completion token `index` for a prompt of `prompt` token ids.
pub fn output_token(prompt: &[u32], index: usize) -> u32 {
    word(seed_of(prompt), index)
}

/// Where a prompt's word cycle starts.
fn seed_of(prompt: &[u32]) -> usize {
    let bytes: Vec<u8> = prompt.iter().flat_map(|t| t.to_le_bytes()).collect();
    fnv1a(&bytes) as usize % WORDS.len()
}

/// Completion token `index` of the cycle that starts at `seed`.
fn word(seed: usize, index: usize) -> u32 {
    ((seed + index) % WORDS.len()) as u32
}

/// FNV-1a: stable across runs and platforms, unlike std's hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenmesh_proto::v1::ChatMessage;

    #[test]
    fn one_token_per_word() {
        let ids = tokenize("  the quick\tbrown\nfox ");
        assert_eq!(ids.len(), 4);
        assert_eq!(tokenize("the"), tokenize("the"));
        let chat = GenerateRequest {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: "hello there".into(),
            }],
            ..Default::default()
        };
        // "user:", "hello", "there"
        assert_eq!(SyntheticModel.encode_prompt(&chat).unwrap().len(), 3);
    }

    #[test]
    fn output_is_a_deterministic_word_cycle() {
        let p = tokenize("what is the capital of France?");
        let first: Vec<u32> = (0..40).map(|i| output_token(&p, i)).collect();
        let again: Vec<u32> = (0..40).map(|i| output_token(&p, i)).collect();
        assert_eq!(first, again);
        assert_eq!(first[0], first[WORDS.len()]);
        assert_eq!((first[0] + 1) % WORDS.len() as u32, first[1]);
        for id in first {
            assert!(String::from_utf8(token_bytes(id)).is_ok());
        }
    }
}
