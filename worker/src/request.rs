//! Turns a wire request into what the engine runs: validated sampling settings
//! and the token ids of the rendered prompt.
//!
//! Preparation needs only what [`PromptModel`] offers, so the same validation
//! serves the real GGUF model and the synthetic engine.
use crate::engine::chat_template::ChatTurn;
use crate::engine::sampling::SamplingParams;
use crate::engine::LoadedModel;
use crate::errors::WorkerError;
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
}

/// Validates `req` against the model and tokenizes it.
pub fn prepare(
    model: &dyn PromptModel,
    served_name: &str,
    default_max_tokens: usize,
    req: &WorkerGenerateRequest,
) -> Result<Prepared, WorkerError> {
    let g = req.request.as_ref().ok_or_else(|| {
        WorkerError::Invalid(tokenmesh_proto::validate::InvalidField {
            field: "request",
            reason: "missing".into(),
        })
    })?;
    check_request(g)?;
    if g.model != served_name {
        return Err(WorkerError::UnknownModel {
            asked: g.model.clone(),
            served: served_name.to_string(),
        });
    }
    let context_len = model.context_length();
    let mut context = model.encode_prompt(g)?;
    let prompt_tokens = context.len();
    if prompt_tokens >= context_len {
        return Err(WorkerError::PromptTooLong {
            prompt: prompt_tokens,
            context: context_len,
        });
    }
    let vocab = model.vocab_size() as u32;
    if let Some(bad) = req.emitted_token_ids.iter().find(|&&t| t >= vocab) {
        return Err(WorkerError::BadContinuation(format!(
            "token id {bad} is outside the vocabulary of {vocab}"
        )));
    }
    context.extend_from_slice(&req.emitted_token_ids);
    let already_emitted = req.emitted_token_ids.len();
    let max_tokens = match g.max_tokens {
        Some(m) if m as usize > context_len => {
            return Err(WorkerError::MaxTokensTooLarge {
                max_tokens: m as usize,
                context: context_len,
            })
        }
        Some(m) => m as usize,
        None => default_max_tokens.min(context_len - prompt_tokens),
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
        },
        stop: g.stop.clone(),
        logprobs: g.logprobs,
        priority: crate::scheduler::Priority::from_wire(g.priority),
    })
}
