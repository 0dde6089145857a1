//! What each engine's API looks like: the streaming completion request for
//! a prompt given as text or token ids, and one SSE event of its answer
//! turned into a [`Chunk`]. Pure functions, tested against the engines' documented (and
//! here observed) shapes.
//!
//! - llama-server: `POST /completion` (its own API, which can return each
//!   chunk's token ids with `return_tokens`); the last event has
//!   `stop: true` and `stop_type` eos / word (with `stopping_word`) / limit.
//! - vLLM: `POST /v1/completions` with `return_token_ids` (vLLM 0.10.2 and
//!   later), `stream_options.include_usage`; `[DONE]` ends the stream.
use super::error::UpstreamError;
use super::UpstreamKind;
use crate::engine::sampling::{SamplingParams, PENALTY_WINDOW};
use serde::Deserialize;
use serde_json::{json, Value};

/// What one streamed completion asks of the engine.
#[derive(Clone, Debug)]
pub struct CompletionAsk<'a> {
    /// The prompt as text, for an engine that tokenizes it (llama-server);
    /// `context` then holds only the tokens already emitted.
    pub prompt_text: Option<&'a str>,
    /// Prompt (unless `prompt_text`) and already emitted tokens.
    pub context: &'a [u32],
    /// Tokens the engine may still generate.
    pub max_new_tokens: usize,
    pub sampling: &'a SamplingParams,
    pub stop: &'a [String],
    pub logprobs: bool,
    /// llama-server: reuse a slot's cached prompt prefix.
    pub cache_prompt: bool,
}

/// The path and JSON body of a streaming completion.
pub fn completion_request(
    kind: UpstreamKind,
    model: &str,
    ask: &CompletionAsk<'_>,
) -> (&'static str, Value) {
    let s = ask.sampling;
    match kind {
        UpstreamKind::LlamaServer => {
            // Text, then a continuation's ids: llama-server tokenizes a
            // leading string with BOS and special tokens parsed, as its
            // /tokenize with add_special and parse_special.
            let prompt = match ask.prompt_text {
                Some(text) if ask.context.is_empty() => json!(text),
                Some(text) => {
                    let mut mixed = Vec::with_capacity(ask.context.len() + 1);
                    mixed.push(json!(text));
                    mixed.extend(ask.context.iter().map(|&t| json!(t)));
                    Value::Array(mixed)
                }
                None => json!(ask.context),
            };
            let mut body = json!({
                "prompt": prompt,
                "n_predict": ask.max_new_tokens,
                "stream": true,
                "return_tokens": true,
                "cache_prompt": ask.cache_prompt,
                "temperature": s.temperature,
                "top_p": s.top_p,
                // Greedy is the top candidate whatever else is asked; with
                // top-k 1 llama-server's later samplers (temperature, the
                // final draw) see one candidate, not the whole vocabulary.
                "top_k": if s.temperature <= 0.0 { 1 } else { s.top_k },
                // The worker's own sampler has no min-p; llama-server's
                // default (0.05) would cut candidates ours keeps.
                "min_p": 0.0,
                "repeat_penalty": s.repetition_penalty,
                "repeat_last_n": PENALTY_WINDOW,
                "stop": ask.stop,
            });
            if let Some(seed) = s.seed {
                // llama-server's seed is 32 bits.
                body["seed"] = json!(seed as u32);
            }
            if ask.logprobs {
                body["n_probs"] = json!(1);
            }
            ("/completion", body)
        }
        UpstreamKind::Vllm => {
            let mut body = json!({
                "model": model,
                "prompt": ask.context,
                "max_tokens": ask.max_new_tokens,
                "stream": true,
                "stream_options": {"include_usage": true},
                "return_token_ids": true,
                "temperature": s.temperature,
                "top_p": s.top_p,
                // vLLM: -1 disables top-k.
                "top_k": if s.top_k == 0 { -1 } else { s.top_k as i64 },
                "repetition_penalty": s.repetition_penalty,
                "stop": ask.stop,
            });
            if let Some(seed) = s.seed {
                body["seed"] = json!(seed);
            }
            if ask.logprobs {
                body["logprobs"] = json!(1);
            }
            ("/v1/completions", body)
        }
    }
}

/// How the engine ended a sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    Eos,
    Length,
    /// A stop string matched (it is not in the text).
    Stop(String),
}

/// One event of the engine's stream.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Chunk {
    /// Tokens generated since the last chunk.
    pub tokens: Vec<u32>,
    /// Their text (already valid UTF-8: both engines hold back a split
    /// character until it is whole).
    pub text: String,
    /// One log-probability per token, when asked for and sent.
    pub logprobs: Vec<f32>,
    /// Tokens generated in all so far, where the engine says (llama-server),
    /// to notice tokens it left out of the stream.
    pub generated: Option<usize>,
    /// Tokens of the prompt (and continuation) the engine evaluated, where
    /// it says (llama-server's `tokens_evaluated`).
    pub evaluated: Option<usize>,
    /// Set on the chunk that ends the sequence.
    pub end: Option<End>,
    /// vLLM's `[DONE]`: nothing follows.
    pub done: bool,
}

#[derive(Deserialize)]
struct LlamaChunk {
    #[serde(default)]
    content: String,
    #[serde(default)]
    tokens: Vec<u32>,
    #[serde(default)]
    stop: bool,
    #[serde(default)]
    stop_type: Option<String>,
    #[serde(default)]
    stopping_word: Option<String>,
    #[serde(default)]
    tokens_predicted: Option<usize>,
    #[serde(default)]
    tokens_evaluated: Option<usize>,
    #[serde(default)]
    completion_probabilities: Vec<LlamaProb>,
}

#[derive(Deserialize)]
struct LlamaProb {
    #[serde(default)]
    logprob: Option<f32>,
}

#[derive(Deserialize)]
struct VllmChunk {
    #[serde(default)]
    choices: Vec<VllmChoice>,
}

#[derive(Deserialize)]
struct VllmChoice {
    #[serde(default)]
    text: String,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    logprobs: Option<VllmLogprobs>,
    #[serde(default)]
    finish_reason: Option<String>,
    #[serde(default)]
    stop_reason: Option<Value>,
}

#[derive(Deserialize)]
struct VllmLogprobs {
    #[serde(default)]
    token_logprobs: Vec<Option<f32>>,
}

/// Parses the data of one SSE event.
pub fn parse_event(kind: UpstreamKind, data: &str) -> Result<Chunk, UpstreamError> {
    if data.trim() == "[DONE]" {
        return Ok(Chunk {
            done: true,
            ..Chunk::default()
        });
    }
    let value: Value = serde_json::from_str(data).map_err(|e| {
        UpstreamError::Malformed(format!(
            "an event that is not JSON ({e}): {}",
            snippet(data)
        ))
    })?;
    if let Some(err) = value.get("error") {
        let message = err
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| err.to_string());
        return Err(UpstreamError::Failed(message));
    }
    match kind {
        UpstreamKind::LlamaServer => llama_chunk(value),
        UpstreamKind::Vllm => vllm_chunk(value),
    }
}

fn llama_chunk(value: Value) -> Result<Chunk, UpstreamError> {
    let c: LlamaChunk = serde_json::from_value(value)
        .map_err(|e| UpstreamError::Malformed(format!("a llama-server chunk: {e}")))?;
    let end = if c.stop {
        Some(match c.stop_type.as_deref() {
            Some("eos") => End::Eos,
            Some("limit") => End::Length,
            Some("word") => End::Stop(c.stopping_word.unwrap_or_default()),
            other => {
                return Err(UpstreamError::Failed(format!(
                    "the sequence stopped without a reason (stop_type {other:?})"
                )))
            }
        })
    } else {
        None
    };
    Ok(Chunk {
        logprobs: c
            .completion_probabilities
            .iter()
            .filter_map(|p| p.logprob)
            .collect(),
        tokens: c.tokens,
        text: c.content,
        generated: c.tokens_predicted,
        evaluated: c.tokens_evaluated,
        end,
        done: false,
    })
}

fn vllm_chunk(value: Value) -> Result<Chunk, UpstreamError> {
    let c: VllmChunk = serde_json::from_value(value)
        .map_err(|e| UpstreamError::Malformed(format!("a vLLM chunk: {e}")))?;
    // A usage-only chunk (include_usage) has no choices.
    let Some(choice) = c.choices.into_iter().next() else {
        return Ok(Chunk::default());
    };
    let mut tokens = choice.token_ids.ok_or_else(|| {
        UpstreamError::Malformed(
            "a vLLM chunk without token_ids: the engine needs return_token_ids (vLLM 0.10.2 or later)"
                .into(),
        )
    })?;
    let end = match choice.finish_reason.as_deref() {
        None => None,
        Some("length") => Some(End::Length),
        Some("stop") => match choice.stop_reason {
            Some(Value::String(s)) => Some(End::Stop(s)),
            // No stop string (null, or the id of a stop token): the end of
            // sequence, whose id vLLM lists last; it is not output.
            _ => {
                tokens.pop();
                Some(End::Eos)
            }
        },
        Some(other) => {
            return Err(UpstreamError::Failed(format!(
                "the sequence ended as {other:?}"
            )))
        }
    };
    let logprobs = choice
        .logprobs
        .map(|l| l.token_logprobs.into_iter().flatten().collect())
        .unwrap_or_default();
    Ok(Chunk {
        tokens,
        text: choice.text,
        logprobs,
        generated: None,
        evaluated: None,
        end,
        done: false,
    })
}

/// The start of a long payload, for error messages.
fn snippet(data: &str) -> String {
    data.chars().take(120).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_server_requests_carry_token_ids_and_mapped_sampling() {
        let sampling = SamplingParams {
            temperature: 0.0,
            top_p: 0.9,
            top_k: 40,
            repetition_penalty: 1.1,
            seed: Some(7),
        };
        let ask = CompletionAsk {
            prompt_text: None,
            context: &[1, 2, 3],
            max_new_tokens: 5,
            sampling: &sampling,
            stop: &["\n".to_string()],
            logprobs: true,
            cache_prompt: true,
        };
        let (path, body) = completion_request(UpstreamKind::LlamaServer, "m", &ask);
        assert_eq!(path, "/completion");
        assert_eq!(body["prompt"], json!([1, 2, 3]));
        assert_eq!(body["n_predict"], 5);
        assert_eq!(body["return_tokens"], true);
        assert_eq!(body["top_k"], 1, "greedy");
        assert_eq!(body["seed"], 7);
        assert_eq!(body["n_probs"], 1);
        assert_eq!(body["stop"], json!(["\n"]));
        assert_eq!(body["cache_prompt"], true);
        let uncached = CompletionAsk {
            cache_prompt: false,
            ..ask.clone()
        };
        let (_, body) = completion_request(UpstreamKind::LlamaServer, "m", &uncached);
        assert_eq!(body["cache_prompt"], false);
        let sampled = SamplingParams {
            temperature: 0.7,
            ..sampling.clone()
        };
        let drawn = CompletionAsk {
            sampling: &sampled,
            ..ask.clone()
        };
        let (_, body) = completion_request(UpstreamKind::LlamaServer, "m", &drawn);
        assert_eq!(body["top_k"], 40);
        let text = CompletionAsk {
            prompt_text: Some("Hi"),
            context: &[],
            ..ask.clone()
        };
        let (_, body) = completion_request(UpstreamKind::LlamaServer, "m", &text);
        assert_eq!(body["prompt"], json!("Hi"));
        let continued = CompletionAsk {
            prompt_text: Some("Hi"),
            ..ask.clone()
        };
        let (_, body) = completion_request(UpstreamKind::LlamaServer, "m", &continued);
        assert_eq!(body["prompt"], json!(["Hi", 1, 2, 3]));
        let (path, body) = completion_request(UpstreamKind::Vllm, "m", &ask);
        assert_eq!(path, "/v1/completions");
        assert_eq!(body["model"], "m");
        assert_eq!(body["max_tokens"], 5);
        assert_eq!(body["return_token_ids"], true);
        assert_eq!(body["logprobs"], 1);
    }

    #[test]
    fn llama_server_chunks_and_their_ends() {
        let k = UpstreamKind::LlamaServer;
        let c = parse_event(k, r#"{"content":" Paris","tokens":[7042],"stop":false,"tokens_predicted":3,"tokens_evaluated":9,"completion_probabilities":[{"id":7042,"logprob":-0.25}]}"#).unwrap();
        assert_eq!(
            (
                c.tokens,
                c.text.as_str(),
                c.logprobs,
                c.generated,
                c.evaluated
            ),
            (vec![7042], " Paris", vec![-0.25], Some(3), Some(9))
        );
        assert_eq!(c.end, None);
        let end = |t: &str| parse_event(k, t).unwrap().end;
        assert_eq!(
            end(r#"{"content":"","tokens":[],"stop":true,"stop_type":"eos"}"#),
            Some(End::Eos)
        );
        assert_eq!(
            end(r#"{"stop":true,"stop_type":"limit"}"#),
            Some(End::Length)
        );
        assert_eq!(
            end(r#"{"stop":true,"stop_type":"word","stopping_word":"."}"#),
            Some(End::Stop(".".into()))
        );
        assert!(matches!(
            parse_event(k, r#"{"stop":true,"stop_type":"none"}"#),
            Err(UpstreamError::Failed(_))
        ));
        let err = parse_event(k, r#"{"error":{"code":500,"message":"slot died"}}"#).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the upstream engine failed the request: slot died"
        );
        assert!(matches!(
            parse_event(k, "{not json"),
            Err(UpstreamError::Malformed(_))
        ));
        assert!(matches!(
            parse_event(k, r#"{"tokens":"x"}"#),
            Err(UpstreamError::Malformed(_))
        ));
    }

    #[test]
    fn vllm_chunks_and_their_ends() {
        let k = UpstreamKind::Vllm;
        let c = parse_event(
            k,
            r#"{"choices":[{"index":0,"text":" Par","token_ids":[12],"finish_reason":null}]}"#,
        )
        .unwrap();
        assert_eq!((c.tokens, c.text.as_str(), c.end), (vec![12], " Par", None));
        let c = parse_event(k, r#"{"choices":[{"text":"","token_ids":[2],"finish_reason":"stop","stop_reason":null}]}"#).unwrap();
        assert_eq!((c.tokens, c.end), (vec![], Some(End::Eos)));
        let c = parse_event(k, r#"{"choices":[{"text":"is","token_ids":[5],"finish_reason":"stop","stop_reason":"."}]}"#).unwrap();
        assert_eq!((c.tokens, c.end), (vec![5], Some(End::Stop(".".into()))));
        let c = parse_event(
            k,
            r#"{"choices":[{"text":"x","token_ids":[5],"finish_reason":"length"}]}"#,
        )
        .unwrap();
        assert_eq!(c.end, Some(End::Length));
        assert_eq!(
            parse_event(k, r#"{"choices":[],"usage":{"prompt_tokens":3}}"#).unwrap(),
            Chunk::default()
        );
        assert!(parse_event(k, "[DONE]").unwrap().done);
        assert!(matches!(
            parse_event(k, r#"{"choices":[{"text":"x"}]}"#),
            Err(UpstreamError::Malformed(_))
        ));
    }
}
