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
//! - any OpenAI-compatible server: `POST /v1/completions` (a prompt) or
//!   `/v1/chat/completions` (a chat) with `stream_options.include_usage`;
//!   text without token ids, a token count per chunk from its log-probs
//!   where sent (else one per chunk with text), the exact counts in the
//!   usage that follows the finish, then `[DONE]`.
use super::error::UpstreamError;
use super::info::EnginePrompt;
use super::UpstreamKind;
use crate::engine::sampling::{SamplingParams, PENALTY_WINDOW};
use serde::Deserialize;
use serde_json::{json, Value};

/// What one streamed completion asks of the engine.
#[derive(Clone, Debug)]
pub struct CompletionAsk<'a> {
    /// The prompt, for an engine that reads it itself (llama-server, a
    /// generic OpenAI-compatible server); `context` then holds only the
    /// tokens already emitted.
    pub prompt: Option<&'a EnginePrompt>,
    /// Prompt (unless `prompt`) and already emitted tokens.
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
            // Chats reach llama-server rendered (its /apply-template).
            let text = match ask.prompt {
                Some(EnginePrompt::Text(text)) => Some(text.as_str()),
                Some(EnginePrompt::Chat(_)) | None => None,
            };
            let prompt = match text {
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
                "ignore_eos": s.ignore_eos,
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
                "ignore_eos": s.ignore_eos,
            });
            if let Some(seed) = s.seed {
                body["seed"] = json!(seed);
            }
            if ask.logprobs {
                body["logprobs"] = json!(1);
            }
            ("/v1/completions", body)
        }
        UpstreamKind::Openai => openai_request(model, ask),
    }
}

/// A generic OpenAI-compatible server's streaming completion: only the
/// parameters the API defines, and the common extensions (`top_k`,
/// `repetition_penalty`) only where the request departs from their
/// neutral values, so a strict server refuses only what it cannot do.
fn openai_request(model: &str, ask: &CompletionAsk<'_>) -> (&'static str, Value) {
    let s = ask.sampling;
    // Chats ask for the chosen token's log-probability as a flag,
    // completions as a count of alternatives.
    let (path, mut body, logprobs) = match ask.prompt {
        Some(EnginePrompt::Chat(messages)) => {
            let messages: Vec<Value> = messages
                .iter()
                .map(|m| json!({"role": m.role, "content": m.content}))
                .collect();
            let body = json!({"messages": messages});
            ("/v1/chat/completions", body, json!(true))
        }
        Some(EnginePrompt::Text(text)) => ("/v1/completions", json!({"prompt": text}), json!(1)),
        // Token ids are a valid prompt in the API; the worker sends text.
        None => ("/v1/completions", json!({"prompt": ask.context}), json!(1)),
    };
    body["model"] = json!(model);
    body["max_tokens"] = json!(ask.max_new_tokens);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body["temperature"] = json!(s.temperature);
    body["top_p"] = json!(s.top_p);
    if !ask.stop.is_empty() {
        body["stop"] = json!(ask.stop);
    }
    if let Some(seed) = s.seed {
        body["seed"] = json!(seed);
    }
    if s.top_k > 0 && s.temperature > 0.0 {
        body["top_k"] = json!(s.top_k);
    }
    if s.repetition_penalty != 1.0 {
        body["repetition_penalty"] = json!(s.repetition_penalty);
    }
    if s.ignore_eos {
        // vLLM's and llama-server's extension.
        body["ignore_eos"] = json!(true);
    }
    if !ask.cache_prompt {
        // llama-server's extension, sent only when switched off: its
        // OpenAI endpoints reuse a slot's cached prefix by default.
        body["cache_prompt"] = json!(false);
    }
    if ask.logprobs {
        body["logprobs"] = logprobs;
    }
    (path, body)
}

/// How the engine ended a sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    Eos,
    Length,
    /// A stop string matched (it is not in the text).
    Stop(String),
    /// A stop string or the end of turn: a generic server's
    /// `finish_reason: stop` that does not say which.
    StopOrEos,
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
    /// Tokens generated since the last chunk whose ids the engine does not
    /// send (a generic OpenAI-compatible server); `tokens` is then empty.
    pub untokenized: usize,
    /// The engine's (prompt, completion) token counts, where it sends them
    /// (OpenAI's `usage`).
    pub usage: Option<(u32, u32)>,
    /// Set on the chunk that ends the sequence.
    pub end: Option<End>,
    /// OpenAI's `[DONE]`: nothing follows.
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
        UpstreamKind::Openai => openai_chunk(value),
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
        ..Chunk::default()
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
    // vLLM names no stop string (null) only for the end of sequence.
    let end = openai_end(
        choice.finish_reason.as_deref(),
        choice.stop_reason,
        End::Eos,
    )?;
    if end == Some(End::Eos) {
        // The end of sequence's id, which vLLM lists last, is not output.
        tokens.pop();
    }
    let logprobs = choice
        .logprobs
        .map(|l| l.token_logprobs.into_iter().flatten().collect())
        .unwrap_or_default();
    Ok(Chunk {
        tokens,
        text: choice.text,
        logprobs,
        end,
        ..Chunk::default()
    })
}

#[derive(Deserialize)]
struct OpenaiChunk {
    #[serde(default)]
    choices: Vec<OpenaiChoice>,
    #[serde(default)]
    usage: Option<OpenaiUsage>,
}

#[derive(Deserialize)]
struct OpenaiChoice {
    /// Completions.
    #[serde(default)]
    text: Option<String>,
    /// Chat completions.
    #[serde(default)]
    delta: Option<OpenaiDelta>,
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    finish_reason: Option<String>,
    /// vLLM's name for the stop string or token that matched.
    #[serde(default)]
    stop_reason: Option<Value>,
    /// SGLang's.
    #[serde(default)]
    matched_stop: Option<Value>,
}

#[derive(Deserialize)]
struct OpenaiDelta {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct OpenaiUsage {
    #[serde(default)]
    prompt_tokens: u32,
    #[serde(default)]
    completion_tokens: u32,
}

fn openai_chunk(value: Value) -> Result<Chunk, UpstreamError> {
    let c: OpenaiChunk = serde_json::from_value(value)
        .map_err(|e| UpstreamError::Malformed(format!("an OpenAI stream chunk: {e}")))?;
    let usage = c.usage.map(|u| (u.prompt_tokens, u.completion_tokens));
    // A usage-only chunk (include_usage) has no choices.
    let Some(choice) = c.choices.into_iter().next() else {
        return Ok(Chunk {
            usage,
            ..Chunk::default()
        });
    };
    let text = match (choice.text, choice.delta) {
        (Some(text), _) => text,
        (None, Some(delta)) => delta.content.unwrap_or_default(),
        (None, None) => String::new(),
    };
    // Completions list `token_logprobs`, chats `content[].logprob`.
    let logprobs: Vec<f32> = match &choice.logprobs {
        Some(l) => match (l.get("token_logprobs"), l.get("content")) {
            (Some(Value::Array(lps)), _) => lps.iter().filter_map(Value::as_f64).collect(),
            (_, Some(Value::Array(entries))) => entries
                .iter()
                .filter_map(|e| e.get("logprob").and_then(Value::as_f64))
                .collect(),
            _ => Vec::new(),
        }
        .into_iter()
        .map(|lp| lp as f32)
        .collect(),
        None => Vec::new(),
    };
    let untokenized = if !logprobs.is_empty() {
        logprobs.len()
    } else {
        usize::from(!text.is_empty())
    };
    let matched = choice.stop_reason.or(choice.matched_stop);
    let end = openai_end(choice.finish_reason.as_deref(), matched, End::StopOrEos)?;
    Ok(Chunk {
        text,
        logprobs,
        untokenized,
        usage,
        end,
        ..Chunk::default()
    })
}

/// The end an OpenAI-style `finish_reason` says, with what matched where
/// the server names it (a string: a stop string; a number: the id of a
/// stop token, the end of turn); `unnamed` is a `stop` with neither.
fn openai_end(
    reason: Option<&str>,
    matched: Option<Value>,
    unnamed: End,
) -> Result<Option<End>, UpstreamError> {
    Ok(match reason {
        None => None,
        Some("length") => Some(End::Length),
        Some("stop") => Some(match matched {
            Some(Value::String(s)) => End::Stop(s),
            Some(Value::Number(_)) => End::Eos,
            _ => unnamed,
        }),
        Some(other) => {
            return Err(UpstreamError::Failed(format!(
                "the sequence ended as {other:?}"
            )))
        }
    })
}

/// The start of a long payload, for error messages.
fn snippet(data: &str) -> String {
    data.chars().take(120).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenmesh_proto::v1::ChatMessage;

    #[test]
    fn llama_server_requests_carry_token_ids_and_mapped_sampling() {
        let sampling = SamplingParams {
            temperature: 0.0,
            top_p: 0.9,
            top_k: 40,
            repetition_penalty: 1.1,
            seed: Some(7),
            ignore_eos: false,
        };
        let ask = CompletionAsk {
            prompt: None,
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
        assert_eq!(body["ignore_eos"], false);
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
        let endless = SamplingParams {
            ignore_eos: true,
            ..sampling.clone()
        };
        let past_eos = CompletionAsk {
            sampling: &endless,
            ..ask.clone()
        };
        let (_, body) = completion_request(UpstreamKind::LlamaServer, "m", &past_eos);
        assert_eq!(body["ignore_eos"], true);
        let (_, body) = completion_request(UpstreamKind::Vllm, "m", &past_eos);
        assert_eq!(body["ignore_eos"], true);
        let hi = EnginePrompt::Text("Hi".into());
        let text = CompletionAsk {
            prompt: Some(&hi),
            context: &[],
            ..ask.clone()
        };
        let (_, body) = completion_request(UpstreamKind::LlamaServer, "m", &text);
        assert_eq!(body["prompt"], json!("Hi"));
        let continued = CompletionAsk {
            prompt: Some(&hi),
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

    #[test]
    fn openai_requests_send_text_or_messages_and_only_the_asked_extensions() {
        let greedy = SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 40,
            repetition_penalty: 1.0,
            seed: None,
            ignore_eos: false,
        };
        let hi = EnginePrompt::Text("Hi".into());
        let ask = CompletionAsk {
            prompt: Some(&hi),
            context: &[],
            max_new_tokens: 5,
            sampling: &greedy,
            stop: &[],
            logprobs: false,
            cache_prompt: true,
        };
        let (path, body) = completion_request(UpstreamKind::Openai, "m", &ask);
        assert_eq!(path, "/v1/completions");
        assert_eq!(
            body,
            json!({"model": "m", "prompt": "Hi", "max_tokens": 5, "stream": true,
                   "stream_options": {"include_usage": true}, "temperature": 0.0, "top_p": 1.0})
        );
        let chat = EnginePrompt::Chat(vec![ChatMessage {
            role: "user".into(),
            content: "Hello".into(),
        }]);
        let sampled = SamplingParams {
            temperature: 0.5,
            repetition_penalty: 1.1,
            seed: Some(3),
            ignore_eos: true,
            ..greedy.clone()
        };
        let stop = ["\n".to_string()];
        let asked = CompletionAsk {
            prompt: Some(&chat),
            sampling: &sampled,
            stop: &stop,
            logprobs: true,
            ..ask.clone()
        };
        let (path, body) = completion_request(UpstreamKind::Openai, "m", &asked);
        assert_eq!(path, "/v1/chat/completions");
        assert_eq!(
            body["messages"],
            json!([{"role": "user", "content": "Hello"}])
        );
        assert_eq!(body["top_k"], 40);
        assert_eq!(body["seed"], 3);
        assert_eq!(body["stop"], json!(["\n"]));
        assert_eq!(body["logprobs"], true);
        assert_eq!(body["ignore_eos"], true);
        let uncached = CompletionAsk {
            cache_prompt: false,
            ..ask.clone()
        };
        let (_, body_uncached) = completion_request(UpstreamKind::Openai, "m", &uncached);
        assert_eq!(body_uncached["cache_prompt"], false);
        assert!((body["repetition_penalty"].as_f64().unwrap() - 1.1).abs() < 1e-6);
    }

    #[test]
    fn openai_chunks_count_tokens_without_ids_and_carry_usage() {
        let k = UpstreamKind::Openai;
        let c = parse_event(
            k,
            r#"{"choices":[{"index":0,"text":" Par","finish_reason":null}]}"#,
        )
        .unwrap();
        assert_eq!(
            (c.text.as_str(), c.untokenized, c.tokens.len()),
            (" Par", 1, 0)
        );
        let c = parse_event(
            k,
            r#"{"choices":[{"text":"is","logprobs":{"tokens":["i","s"],"token_logprobs":[-0.5,-0.25]}}]}"#,
        )
        .unwrap();
        assert_eq!((c.untokenized, c.logprobs), (2, vec![-0.5, -0.25]));
        let c = parse_event(
            k,
            r#"{"choices":[{"delta":{"content":"Hi"},"logprobs":{"content":[{"token":"Hi","logprob":-1.0}]}}]}"#,
        )
        .unwrap();
        assert_eq!(
            (c.text.as_str(), c.untokenized, c.logprobs),
            ("Hi", 1, vec![-1.0])
        );
        let role = parse_event(
            k,
            r#"{"choices":[{"delta":{"role":"assistant","content":null}}]}"#,
        )
        .unwrap();
        assert_eq!((role.untokenized, role.end), (0, None));
        let end = |t: &str| parse_event(k, t).unwrap().end;
        assert_eq!(
            end(r#"{"choices":[{"text":"","finish_reason":"length"}]}"#),
            Some(End::Length)
        );
        assert_eq!(
            end(r#"{"choices":[{"text":"","finish_reason":"stop"}]}"#),
            Some(End::StopOrEos)
        );
        assert_eq!(
            end(r#"{"choices":[{"text":"","finish_reason":"stop","stop_reason":"."}]}"#),
            Some(End::Stop(".".into()))
        );
        assert_eq!(
            end(r#"{"choices":[{"delta":{},"finish_reason":"stop","matched_stop":2}]}"#),
            Some(End::Eos)
        );
        let u = parse_event(
            k,
            r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4}}"#,
        )
        .unwrap();
        assert_eq!((u.usage, u.untokenized), (Some((9, 4)), 0));
        // llama-server sends the usage with the finish.
        let both = parse_event(
            k,
            r#"{"choices":[{"delta":{},"finish_reason":"length"}],"usage":{"prompt_tokens":9,"completion_tokens":4}}"#,
        )
        .unwrap();
        assert_eq!((both.end, both.usage), (Some(End::Length), Some((9, 4))));
        assert!(matches!(
            parse_event(
                k,
                r#"{"choices":[{"text":"x","finish_reason":"content_filter"}]}"#
            ),
            Err(UpstreamError::Failed(_))
        ));
        assert!(matches!(
            parse_event(k, r#"{"choices":"x"}"#),
            Err(UpstreamError::Malformed(_))
        ));
    }
}
