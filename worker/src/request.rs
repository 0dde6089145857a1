//! Turns a wire request into what the engine runs: validated sampling settings
//! and the token ids of the rendered prompt.
//!
//! Preparation needs only what [`PromptModel`] offers, so the same validation
//! serves the real GGUF model and the synthetic engine.
use crate::engine::chat_template::ChatTurn;
use crate::engine::sampling::SamplingParams;
use crate::engine::LoadedModel;
use crate::errors::WorkerError;
use crate::upstream::EnginePrompt;
use tokenmesh_proto::v1::{GenerateRequest, WorkerGenerateRequest};
use tokenmesh_proto::validate::check_request;

/// What request preparation needs to know about the served model.
pub trait PromptModel: Send + Sync + 'static {
    /// Tokens of context (prompt and completion) a sequence may fill.
    fn context_length(&self) -> usize;
    /// Token ids are below this.
    fn vocab_size(&self) -> usize;
    /// Renders the prompt or chat messages of `g` and tokenizes the result.
    fn encode_prompt(&self, g: &GenerateRequest) -> Result<Vec<u32>, WorkerError>;
}

impl PromptModel for LoadedModel {
    fn context_length(&self) -> usize {
        self.backend.config().context_length
    }

    fn vocab_size(&self) -> usize {
        self.backend.vocab_size()
    }

    fn encode_prompt(&self, g: &GenerateRequest) -> Result<Vec<u32>, WorkerError> {
        let text = if g.messages.is_empty() {
            g.prompt.clone()
        } else {
            let template = self.template.as_ref().ok_or_else(|| {
                WorkerError::Template(
                    "this model has no chat template; send a prompt instead".into(),
                )
            })?;
            let turns: Vec<ChatTurn> = g
                .messages
                .iter()
                .map(|m| ChatTurn {
                    role: m.role.clone(),
                    content: m.content.clone(),
                })
                .collect();
            template
                .render(&turns, true)
                .map_err(|e| WorkerError::Template(e.to_string()))?
        };
        self.tokenizer
            .encode(&text)
            .map_err(|e| WorkerError::Tokenize(e.to_string()))
    }
}

/// What this worker serves, and how much of it one sequence may use.
#[derive(Clone, Debug)]
pub struct Serving {
    /// The model name requests must ask for.
    pub model_name: String,
    /// `max_tokens` of a request that leaves it unset.
    pub default_max_tokens: usize,
    /// Tokens of context one sequence can hold in the engine's KV cache
    /// pool: the whole pool (`EngineHandle::kv_capacity`). With the context
    /// window it bounds what a request may ask for.
    pub kv_capacity: usize,
}

/// A request ready for the engine.
#[derive(Debug)]
pub struct Prepared {
    /// Prompt tokens followed by tokens already emitted before a failover.
    pub context: Vec<u32>,
    pub prompt_tokens: usize,
    pub already_emitted: usize,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub logprobs: bool,
    pub priority: crate::scheduler::Priority,
    /// Time spent waiting on an upstream engine to prepare the request (its
    /// template and tokenizer); zero on the worker's own engine.
    pub engine_wait: std::time::Duration,
    /// The prompt, for an engine that reads it itself (llama-server, a
    /// generic OpenAI-compatible server): `context` then holds only the
    /// emitted tokens, and `prompt_tokens` is 0 until the engine counts them.
    pub engine_prompt: Option<EnginePrompt>,
}

/// The sizes request preparation checks a request against.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Tokens of context (prompt and completion) a sequence may fill.
    pub context_length: usize,
    /// Token ids are below this.
    pub vocab_size: usize,
}

/// Validates `req` against the model and the KV cache, and tokenizes it.
/// A prompt neither holds is refused here, before the router has told its
/// client the request was accepted.
pub fn prepare(
    model: &dyn PromptModel,
    serving: &Serving,
    req: &WorkerGenerateRequest,
) -> Result<Prepared, WorkerError> {
    let g = checked(serving, req)?;
    let limits = Limits {
        context_length: model.context_length(),
        vocab_size: model.vocab_size(),
    };
    prepare_tokens(limits, serving, req, g, model.encode_prompt(g)?)
}

/// The client request inside `req`, checked on its own and against the
/// model this worker serves.
pub fn checked<'a>(
    serving: &Serving,
    req: &'a WorkerGenerateRequest,
) -> Result<&'a GenerateRequest, WorkerError> {
    let g = req.request.as_ref().ok_or_else(|| {
        WorkerError::Invalid(tokenmesh_proto::validate::InvalidField {
            field: "request",
            reason: "missing".into(),
        })
    })?;
    check_request(g)?;
    if g.model != serving.model_name {
        return Err(WorkerError::UnknownModel {
            asked: g.model.clone(),
            served: serving.model_name.clone(),
        });
    }
    Ok(g)
}

/// The rest of [`prepare`] once the prompt of `g`, the [`checked`] request
/// of `req`, is tokenized (by the worker's model, or by an upstream engine).
pub fn prepare_tokens(
    limits: Limits,
    serving: &Serving,
    req: &WorkerGenerateRequest,
    g: &GenerateRequest,
    prompt: Vec<u32>,
) -> Result<Prepared, WorkerError> {
    let context_len = limits.context_length;
    let kv_capacity = serving.kv_capacity;
    let prompt_tokens = prompt.len();
    if prompt_tokens >= context_len {
        return Err(WorkerError::PromptTooLong {
            prompt: prompt_tokens,
            context: context_len,
        });
    }
    // As the engine's own check: the prompt and the first generated token
    // must fit the pool.
    if prompt_tokens >= kv_capacity {
        return Err(WorkerError::PromptExceedsKvCache {
            prompt: prompt_tokens,
            capacity: kv_capacity,
        });
    }
    prepare_context(limits, serving, req, g, prompt, None)
}

/// [`prepare_tokens`] for a prompt the engine reads itself: the checks
/// that need the prompt's length are the engine's (llama-server refuses a
/// prompt over its context with HTTP 400, and stops a sequence that fills
/// it as `limit`), so no round trip to its tokenizer precedes the request.
pub fn prepare_engine_prompt(
    limits: Limits,
    serving: &Serving,
    req: &WorkerGenerateRequest,
    g: &GenerateRequest,
    prompt: EnginePrompt,
) -> Result<Prepared, WorkerError> {
    prepare_context(limits, serving, req, g, Vec::new(), Some(prompt))
}

/// Appends the emitted tokens of a continuation to `prompt` and checks
/// what is left to check.
fn prepare_context(
    limits: Limits,
    serving: &Serving,
    req: &WorkerGenerateRequest,
    g: &GenerateRequest,
    prompt: Vec<u32>,
    engine_prompt: Option<EnginePrompt>,
) -> Result<Prepared, WorkerError> {
    let context_len = limits.context_length;
    let kv_capacity = serving.kv_capacity;
    let mut context = prompt;
    let prompt_tokens = context.len();
    let vocab = limits.vocab_size as u32;
    if let Some(bad) = req.emitted_token_ids.iter().find(|&&t| t >= vocab) {
        return Err(WorkerError::BadContinuation(format!(
            "token id {bad} is outside the vocabulary of {vocab}"
        )));
    }
    context.extend_from_slice(&req.emitted_token_ids);
    let already_emitted = req.emitted_token_ids.len();
    let (limit, bound) = if kv_capacity < context_len {
        (kv_capacity, "the worker's KV cache")
    } else {
        (context_len, "the context window")
    };
    let max_tokens = match g.max_tokens {
        Some(m) if m as usize > limit => {
            return Err(WorkerError::MaxTokensTooLarge {
                max_tokens: m as usize,
                limit,
                bound,
            })
        }
        Some(m) => m as usize,
        None => serving.default_max_tokens.min(context_len - prompt_tokens),
    };
    if context.len() >= context_len {
        return Err(WorkerError::BadContinuation(format!(
            "prompt and emitted tokens ({}) fill the context window of {context_len}",
            context.len()
        )));
    }
    let defaults = SamplingParams::default();
    Ok(Prepared {
        context,
        prompt_tokens,
        already_emitted,
        max_tokens,
        sampling: SamplingParams {
            temperature: g.temperature.unwrap_or(defaults.temperature),
            top_p: g.top_p.unwrap_or(defaults.top_p),
            top_k: g.top_k.map(|k| k as usize).unwrap_or(defaults.top_k),
            repetition_penalty: g.repetition_penalty.unwrap_or(defaults.repetition_penalty),
            seed: g.seed,
            ignore_eos: g.ignore_eos,
        },
        stop: g.stop.clone(),
        logprobs: g.logprobs,
        priority: crate::scheduler::Priority::from_wire(g.priority),
        engine_wait: std::time::Duration::ZERO,
        engine_prompt,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::{SyntheticModel, CONTEXT_LENGTH};

    fn serving(kv_capacity: usize) -> Serving {
        Serving {
            model_name: "m".into(),
            default_max_tokens: 256,
            kv_capacity,
        }
    }

    /// A synthetic request: one token per word.
    fn words(n: usize, max_tokens: Option<u32>) -> WorkerGenerateRequest {
        WorkerGenerateRequest {
            request: Some(GenerateRequest {
                model: "m".into(),
                prompt: "word ".repeat(n),
                max_tokens,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_prompt_the_kv_cache_cannot_hold_is_refused_with_both_numbers() {
        let err = prepare(&SyntheticModel, &serving(64), &words(64, None)).unwrap_err();
        assert!(
            matches!(
                err,
                WorkerError::PromptExceedsKvCache {
                    prompt: 64,
                    capacity: 64
                }
            ),
            "{err:?}"
        );
        let status = err.into_status();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(
            status.message().contains("prompt is 64 tokens")
                && status.message().contains("KV cache holds 64 tokens"),
            "{}",
            status.message()
        );
        let fits = prepare(&SyntheticModel, &serving(64), &words(63, None)).unwrap();
        assert_eq!(fits.prompt_tokens, 63);
    }

    #[test]
    fn max_tokens_is_bounded_by_the_smaller_of_context_and_kv_cache() {
        let err = prepare(&SyntheticModel, &serving(64), &words(4, Some(65))).unwrap_err();
        let message = err.to_string();
        assert_eq!(
            message,
            "max_tokens: 65 is beyond the worker's KV cache of 64 tokens"
        );
        assert_eq!(err.into_status().code(), tonic::Code::InvalidArgument);
        assert!(prepare(&SyntheticModel, &serving(64), &words(4, Some(64))).is_ok());

        let big = serving(CONTEXT_LENGTH * 2);
        let over = Some(CONTEXT_LENGTH as u32 + 1);
        let err = prepare(&SyntheticModel, &big, &words(4, over)).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "max_tokens: {} is beyond the context window of {CONTEXT_LENGTH} tokens",
                CONTEXT_LENGTH + 1
            )
        );
    }
}
