//! What the worker learns from the engine once, at start: the model it
//! serves, its context window and vocabulary, and its end-of-generation
//! tokens; and the engine's own prompt rendering and tokenization, so that
//! the token ids the mesh sees are the engine's (a generic OpenAI-compatible
//! server shows none: it renders and tokenizes inside its completions).
use super::error::UpstreamError;
use super::http::EngineHttp;
use super::UpstreamKind;
use serde_json::{json, Value};
use tokenmesh_proto::v1::{ChatMessage, GenerateRequest};

/// The engine's model, as it reports it.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    /// The model's name on the engine (vLLM's `model` request field).
    pub model: String,
    /// Tokens of context one sequence may fill.
    pub context_length: usize,
    /// Token ids are below this (`u32::MAX` where the engine does not say:
    /// it checks the ids itself).
    pub vocab_size: usize,
    /// End-of-generation token ids the engine streams but the mesh does not
    /// output (llama-server; vLLM's are handled by its finish).
    pub eog: Vec<u32>,
}

/// Asks the engine about its model; `context_length`, where set, is the
/// context window to use instead of the one it reports (a generic
/// OpenAI-compatible server may report none).
pub async fn discover(
    http: &EngineHttp,
    kind: UpstreamKind,
    context_length: Option<usize>,
) -> Result<EngineInfo, UpstreamError> {
    let models = http.get_json("/v1/models").await?;
    let first = models
        .pointer("/data/0")
        .ok_or_else(|| UpstreamError::Malformed("/v1/models lists no model".into()))?;
    let model = first
        .get("id")
        .and_then(Value::as_str)
        .ok_or_else(|| UpstreamError::Malformed("/v1/models: a model without an id".into()))?
        .to_string();
    Ok(match kind {
        UpstreamKind::LlamaServer => {
            let props = http.get_json("/props").await?;
            let context_length = context_length.map_or_else(
                || number(&props, "/default_generation_settings/n_ctx", "/props"),
                Ok,
            )?;
            let vocab_size = number(first, "/meta/n_vocab", "/v1/models")?;
            let eog = match props.get("eos_token").and_then(Value::as_str) {
                Some(eos) if !eos.is_empty() => llama_tokenize(http, eos, false).await?,
                _ => Vec::new(),
            };
            EngineInfo {
                model,
                context_length,
                vocab_size,
                eog,
            }
        }
        UpstreamKind::Vllm | UpstreamKind::Openai => {
            // vLLM and SGLang say `max_model_len`; other servers may say
            // nothing, and then the flag must.
            let context_length = context_length.map_or_else(
                || {
                    number(first, "/max_model_len", "/v1/models").map_err(|_| {
                        UpstreamError::Malformed(format!(
                            "/v1/models gives no max_model_len for {model}: set --upstream-context-length"
                        ))
                    })
                },
                Ok,
            )?;
            EngineInfo {
                context_length,
                model,
                vocab_size: u32::MAX as usize,
                eog: Vec::new(),
            }
        }
    })
}

/// A positive integer at `pointer` of `value`, which came from `path`.
fn number(value: &Value, pointer: &str, path: &str) -> Result<usize, UpstreamError> {
    value
        .pointer(pointer)
        .and_then(Value::as_u64)
        .filter(|&n| n > 0)
        .map(|n| n as usize)
        .ok_or_else(|| UpstreamError::Malformed(format!("{path}: no positive number at {pointer}")))
}

/// A prompt the engine reads itself, as part of the completion: no round
/// trip to its tokenizer first, and no token ids of the prompt seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnginePrompt {
    /// Rendered text the engine tokenizes (llama-server, whose `/completion`
    /// also takes text followed by the ids of a continuation; a prompt to
    /// an OpenAI-compatible server's `/v1/completions`).
    Text(String),
    /// Chat messages the engine renders with its own template (an
    /// OpenAI-compatible server's `/v1/chat/completions`).
    Chat(Vec<ChatMessage>),
}

/// A request's prompt as an engine takes it.
#[derive(Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Read by the engine as part of the completion.
    Engine(EnginePrompt),
    /// Token ids from the engine's tokenizer (vLLM, whose completions take
    /// either text or ids, not both, so a continuation needs the prompt's).
    Tokens(Vec<u32>),
}

/// The prompt or chat messages of `g`, rendered by the engine's chat
/// template (llama-server's `/apply-template`, vLLM's `/tokenize`), as
/// `kind` takes it in a completion; a generic OpenAI-compatible server
/// gets them as they came.
pub async fn encode_prompt(
    http: &EngineHttp,
    kind: UpstreamKind,
    model: &str,
    g: &GenerateRequest,
) -> Result<Prompt, UpstreamError> {
    let messages = || -> Vec<Value> {
        g.messages
            .iter()
            .map(|m| json!({"role": m.role, "content": m.content}))
            .collect()
    };
    match kind {
        UpstreamKind::Openai => Ok(Prompt::Engine(if g.messages.is_empty() {
            EnginePrompt::Text(g.prompt.clone())
        } else {
            EnginePrompt::Chat(g.messages.clone())
        })),
        UpstreamKind::LlamaServer => {
            if g.messages.is_empty() {
                return Ok(Prompt::Engine(EnginePrompt::Text(g.prompt.clone())));
            }
            let rendered = http
                .post_json("/apply-template", &json!({ "messages": messages() }))
                .await?;
            let text = rendered
                .get("prompt")
                .and_then(Value::as_str)
                .ok_or_else(|| UpstreamError::Malformed("/apply-template: no prompt".into()))?;
            Ok(Prompt::Engine(EnginePrompt::Text(text.to_string())))
        }
        UpstreamKind::Vllm => {
            let body = if g.messages.is_empty() {
                json!({"model": model, "prompt": g.prompt, "add_special_tokens": true})
            } else {
                json!({"model": model, "messages": messages(), "add_generation_prompt": true})
            };
            token_list(&http.post_json("/tokenize", &body).await?, "/tokenize").map(Prompt::Tokens)
        }
    }
}

/// llama-server's `/tokenize`, special tokens in the text parsed as such
/// (as its own chat path does); `add_special` adds BOS where the model
/// wants one.
async fn llama_tokenize(
    http: &EngineHttp,
    text: &str,
    add_special: bool,
) -> Result<Vec<u32>, UpstreamError> {
    let body = json!({"content": text, "add_special": add_special, "parse_special": true});
    token_list(&http.post_json("/tokenize", &body).await?, "/tokenize")
}

fn token_list(value: &Value, path: &str) -> Result<Vec<u32>, UpstreamError> {
    let malformed = || UpstreamError::Malformed(format!("{path}: no list of token ids"));
    value
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or_else(malformed)?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(malformed)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lists_are_checked() {
        assert_eq!(
            token_list(&json!({"tokens": [1, 2]}), "/t").unwrap(),
            vec![1, 2]
        );
        assert!(token_list(&json!({"tokens": [-1]}), "/t").is_err());
        assert!(token_list(&json!({"count": 2}), "/t").is_err());
        assert_eq!(number(&json!({"a": {"b": 8}}), "/a/b", "/p").unwrap(), 8);
        assert!(number(&json!({"a": 0}), "/a", "/p").is_err());
    }
}
