//! OpenAI request bodies to a `GenerateRequest`. The body is read as JSON and
//! walked field by field, so that every refusal names the field at fault
//! (`messages[2].content`, `stop[1]`), a field of the wrong type says what
//! was expected, and no field is ever silently ignored: a field with no
//! counterpart in tokenmesh is refused unless its value is the neutral one
//! (`n: 1`, `presence_penalty: 0`, …). A `null` value reads as absent, as
//! OpenAI treats it.
use super::errors::ApiError;
use serde_json::{Map, Value};
use tokenmesh_proto::v1::{ChatMessage, GenerateRequest};

/// Which endpoint a body was posted to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
}

/// A request as the router routes it, plus how to answer.
#[derive(Debug, Default)]
pub struct Parsed {
    /// Model (without any `@version`), input and sampling.
    pub request: GenerateRequest,
    /// A version pin given as `model@version`.
    pub pin: Option<String>,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Whether the sampled tokens' log probabilities are returned.
    pub logprobs: bool,
    /// `user`: the sticky-session key when no header gives one.
    pub user: Option<String>,
}

/// Fields OpenAI defines that tokenmesh has no counterpart for, with why.
const UNSUPPORTED: &[(&str, &str)] = &[
    ("tools", "tool calling is not supported"),
    ("tool_choice", "tool calling is not supported"),
    ("parallel_tool_calls", "tool calling is not supported"),
    ("functions", "function calling is not supported"),
    ("function_call", "function calling is not supported"),
    ("response_format", "structured output is not supported"),
    ("logit_bias", "logit bias is not supported"),
    ("modalities", "only text output is supported"),
    ("audio", "only text output is supported"),
    ("prediction", "predicted outputs are not supported"),
    ("reasoning_effort", "the models served do not reason"),
    ("web_search_options", "web search is not supported"),
    ("service_tier", "there are no service tiers"),
    ("store", "completions are not stored"),
    ("metadata", "completions are not stored"),
    ("suffix", "insertion (suffix) is not supported"),
];

/// Reads `body` posted to `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Parsed, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            tonic::Code::InvalidArgument,
            format!("the body is not valid JSON: {e}"),
        )
        .reason("invalid_json")
    })?;
    let Value::Object(fields) = value else {
        return Err(ApiError::new(
            tonic::Code::InvalidArgument,
            format!("the body must be a JSON object, not {}", kind(&value)),
        )
        .reason("invalid_json"));
    };
    let mut p = Parsed::default();
    let mut max_tokens: Option<(u32, &str)> = None;
    let mut stream_options: Option<&Map<String, Value>> = None;
    let mut top_logprobs = 0;
    for (key, v) in &fields {
        if v.is_null() {
            continue;
        }
        let k = key.as_str();
        let r = &mut p.request;
        match (endpoint, k) {
            (_, "model") => r.model = string(k, v)?,
            (Endpoint::Chat, "messages") => r.messages = messages(v)?,
            (Endpoint::Completions, "prompt") => r.prompt = prompt(v)?,
            (Endpoint::Chat, "max_completion_tokens") | (_, "max_tokens") => {
                let n = uint(k, v)?;
                if let Some((m, other)) = max_tokens {
                    if m != n {
                        return Err(ApiError::invalid(
                            k,
                            format!("is {n} but {other} is {m}; give one of them"),
                        ));
                    }
                }
                max_tokens = Some((n, k));
            }
            (_, "temperature") => r.temperature = Some(float(k, v)?),
            (_, "top_p") => r.top_p = Some(float(k, v)?),
            (_, "top_k") => r.top_k = Some(uint(k, v)?),
            (_, "repetition_penalty") => r.repetition_penalty = Some(float(k, v)?),
            // vLLM's extension, for benchmarks of a fixed length.
            (_, "ignore_eos") => r.ignore_eos = boolean(k, v)?,
            (_, "seed") => r.seed = Some(seed(v)?),
            (_, "stop") => r.stop = stop(v)?,
            (_, "user") => p.user = Some(string(k, v)?).filter(|u| !u.is_empty()),
            (_, "stream") => p.stream = boolean(k, v)?,
            (_, "stream_options") => stream_options = Some(object(k, v)?),
            (_, "n") => neutral(k, uint(k, v)? == 1, "only n = 1 is supported")?,
            (Endpoint::Completions, "best_of") => {
                neutral(k, uint(k, v)? == 1, "only best_of = 1 is supported")?
            }
            (Endpoint::Completions, "echo") => {
                neutral(k, !boolean(k, v)?, "echoing the prompt is not supported")?
            }
            (_, "presence_penalty" | "frequency_penalty") => neutral(
                k,
                float(k, v)? == 0.0,
                "only 0 is supported; use repetition_penalty (1 = off) instead",
            )?,
            (Endpoint::Chat, "logprobs") => p.logprobs = boolean(k, v)?,
            (Endpoint::Chat, "top_logprobs") => top_logprobs = uint(k, v)?,
            (Endpoint::Completions, "logprobs") => {
                // The legacy API's logprobs is a count of alternatives; the
                // worker reports the sampled token's only.
                neutral(
                    k,
                    uint(k, v)? == 0,
                    "only 0 (the sampled token's log probability) is supported",
                )?;
                p.logprobs = true;
            }
            _ => {
                let why = UNSUPPORTED
                    .iter()
                    .find(|(name, _)| *name == k)
                    .map(|(_, why)| *why);
                return Err(match why {
                    Some(why) => ApiError::unsupported(k, &format!("not supported: {why}")),
                    None => ApiError::invalid(k, "unknown field").reason("unknown_parameter"),
                });
            }
        }
    }
    if p.request.model.is_empty() {
        return Err(ApiError::invalid(
            "model",
            "required; GET /v1/models lists them",
        ));
    }
    if let Some((name, version)) = p.request.model.split_once('@') {
        if name.is_empty() || version.is_empty() {
            return Err(ApiError::invalid(
                "model",
                "write a version pin as model@version",
            ));
        }
        p.pin = Some(version.to_string());
        p.request.model = name.to_string();
    }
    match endpoint {
        Endpoint::Chat if p.request.messages.is_empty() => {
            return Err(ApiError::invalid("messages", "required: a non-empty array"));
        }
        Endpoint::Completions if !fields.contains_key("prompt") => {
            return Err(ApiError::invalid("prompt", "required: a string"));
        }
        _ => {}
    }
    if top_logprobs > 0 {
        return Err(ApiError::unsupported(
            "top_logprobs",
            "only 0: the worker reports the sampled token's log probability, no alternatives",
        ));
    }
    p.request.logprobs = p.logprobs;
    p.request.max_tokens = max_tokens.map(|(n, _)| n);
    if let Some(opts) = stream_options {
        if !p.stream {
            return Err(ApiError::invalid(
                "stream_options",
                "only allowed when stream is true",
            ));
        }
        for (k, v) in opts {
            match k.as_str() {
                "include_usage" => {
                    p.include_usage = v.is_null() || boolean("stream_options.include_usage", v)?
                }
                "continuous_usage_stats" | "include_obfuscation"
                    if !v.as_bool().unwrap_or(false) => {}
                other => {
                    return Err(ApiError::invalid(
                        format!("stream_options.{other}"),
                        "unknown field",
                    )
                    .reason("unknown_parameter"))
                }
            }
        }
    }
    Ok(p)
}

/// A field that is accepted only at its neutral value.
fn neutral(k: &str, ok: bool, why: &str) -> Result<(), ApiError> {
    if ok {
        Ok(())
    } else {
        Err(ApiError::unsupported(k, why))
    }
}

/// The JSON type of `v`, for messages.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong(k: &str, want: &str, v: &Value) -> ApiError {
    ApiError::invalid(k, format!("expected {want}, got {}", kind(v))).reason("invalid_type")
}

fn string(k: &str, v: &Value) -> Result<String, ApiError> {
    v.as_str()
        .map(str::to_string)
        .ok_or_else(|| wrong(k, "a string", v))
}

fn boolean(k: &str, v: &Value) -> Result<bool, ApiError> {
    v.as_bool().ok_or_else(|| wrong(k, "true or false", v))
}

fn object<'a>(k: &str, v: &'a Value) -> Result<&'a Map<String, Value>, ApiError> {
    v.as_object().ok_or_else(|| wrong(k, "an object", v))
}

fn uint(k: &str, v: &Value) -> Result<u32, ApiError> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| wrong(k, "a non-negative integer below 2^32", v))
}

fn float(k: &str, v: &Value) -> Result<f32, ApiError> {
    v.as_f64()
        .map(|f| f as f32)
        .ok_or_else(|| wrong(k, "a number", v))
}

/// `seed`: any 64-bit integer; a negative one is taken modulo 2^64.
fn seed(v: &Value) -> Result<u64, ApiError> {
    v.as_u64()
        .or_else(|| v.as_i64().map(|n| n as u64))
        .ok_or_else(|| wrong("seed", "an integer", v))
}

/// `stop`: a string or a list of strings.
fn stop(v: &Value) -> Result<Vec<String>, ApiError> {
    match v {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, s)| string(&format!("stop[{i}]"), s))
            .collect(),
        other => Err(wrong("stop", "a string or an array of strings", other)),
    }
}

/// `prompt`: one string (arrays of prompts or of token ids are refused).
fn prompt(v: &Value) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(_) => Err(ApiError::unsupported(
            "prompt",
            "arrays (several prompts, or token ids) are not supported; send one string",
        )),
        other => Err(wrong("prompt", "a string", other)),
    }
}

/// `messages`: objects with a role and content (a string or text parts).
fn messages(v: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let Value::Array(items) = v else {
        return Err(wrong("messages", "an array of messages", v));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, m)| message(&format!("messages[{i}]"), m))
        .collect()
}

fn message(at: &str, v: &Value) -> Result<ChatMessage, ApiError> {
    let fields = object(at, v)?;
    let mut role = None;
    let mut content = String::new();
    for (k, v) in fields {
        let path = format!("{at}.{k}");
        match k.as_str() {
            "role" => role = Some(string(&path, v)?),
            "content" => content = message_content(&path, v)?,
            "name" | "tool_calls" | "tool_call_id" | "function_call" | "refusal" | "audio"
                if !v.is_null() =>
            {
                return Err(ApiError::unsupported(
                    &path,
                    "not supported: messages carry a role and text content only",
                ))
            }
            "name" | "tool_calls" | "tool_call_id" | "function_call" | "refusal" | "audio" => {}
            _ => return Err(ApiError::invalid(path, "unknown field").reason("unknown_parameter")),
        }
    }
    let role = role.ok_or_else(|| ApiError::invalid(format!("{at}.role"), "required"))?;
    // OpenAI's newer name for the system role.
    let role = if role == "developer" {
        "system".to_string()
    } else {
        role
    };
    Ok(ChatMessage { role, content })
}

/// A message's content: a string, null, or an array of text parts (joined
/// with newlines).
fn message_content(at: &str, v: &Value) -> Result<String, ApiError> {
    let parts = match v {
        Value::Null => return Ok(String::new()),
        Value::String(s) => return Ok(s.clone()),
        Value::Array(parts) => parts,
        other => return Err(wrong(at, "a string or an array of text parts", other)),
    };
    let mut texts = Vec::with_capacity(parts.len());
    for (i, part) in parts.iter().enumerate() {
        let path = format!("{at}[{i}]");
        let fields = object(&path, part)?;
        match fields.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some(other) => {
                return Err(ApiError::unsupported(
                    &format!("{path}.type"),
                    &format!("{other:?} parts are not supported; only \"text\""),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    format!("{path}.type"),
                    "required: \"text\"",
                ))
            }
        }
        let text = fields
            .get("text")
            .ok_or_else(|| ApiError::invalid(format!("{path}.text"), "required"))?;
        texts.push(string(&format!("{path}.text"), text)?);
    }
    Ok(texts.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<Parsed, ApiError> {
        parse(Endpoint::Chat, body.as_bytes())
    }

    fn param(e: ApiError) -> String {
        assert_eq!(e.status.as_u16(), 400, "{}", e.message);
        e.param.unwrap_or_default()
    }

    #[test]
    fn a_full_chat_request() {
        let p = chat(
            r#"{"model":"m@v2","messages":[{"role":"developer","content":"be brief"},
               {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
               "max_completion_tokens":7,"temperature":0,"top_p":0.5,"stop":"x","seed":-1,
               "user":"u1","n":1,"stream":true,"stream_options":{"include_usage":true},
               "presence_penalty":0,"logprobs":true,"tools":null,"ignore_eos":true}"#,
        )
        .unwrap();
        assert_eq!(p.request.model, "m");
        assert_eq!(p.pin.as_deref(), Some("v2"));
        assert_eq!(p.request.messages[0].role, "system");
        assert_eq!(p.request.messages[1].content, "a\nb");
        assert_eq!(p.request.max_tokens, Some(7));
        assert_eq!(p.request.stop, vec!["x"]);
        assert_eq!(p.request.seed, Some(u64::MAX));
        assert!(p.stream && p.include_usage && p.logprobs && p.request.logprobs);
        assert_eq!(p.user.as_deref(), Some("u1"));
        assert!(p.request.ignore_eos);
    }

    #[test]
    fn every_refusal_names_its_field() {
        for (body, field) in [
            (r#"{"messages":[{"role":"user","content":"x"}]}"#, "model"),
            (r#"{"model":"m","messages":[]}"#, "messages"),
            (r#"{"model":"m"}"#, "messages"),
            (r#"{"model":"m","messages":"hi"}"#, "messages"),
            (r#"{"model":7,"messages":[]}"#, "model"),
            (
                r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
                "messages[0].content",
            ),
            (
                r#"{"model":"m","messages":[{"content":"x"}]}"#,
                "messages[0].role",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
                "messages[0].content[0].type",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":"9"}"#,
                "max_tokens",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#,
                "max_tokens",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stop":["a",3]}"#,
                "stop[1]",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":2}"#,
                "n",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"ignore_eos":1}"#,
                "ignore_eos",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"frequency_penalty":0.5}"#,
                "frequency_penalty",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[]}"#,
                "tools",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"foo":1}"#,
                "foo",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":2,"logprobs":true}"#,
                "top_logprobs",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}}"#,
                "stream_options",
            ),
            (
                r#"{"model":"m@","messages":[{"role":"user","content":"x"}]}"#,
                "model",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":3,"max_completion_tokens":4}"#,
                "max_completion_tokens",
            ),
        ] {
            let got = chat(body).map(|_| ()).map_err(param);
            let got = got.err().unwrap_or_default();
            // The duplicate-max check names whichever of the two came second.
            if field == "max_completion_tokens" {
                assert!(got.starts_with("max_"), "{body}: {got}");
            } else {
                assert_eq!(got, field, "{body}");
            }
        }
    }

    #[test]
    fn malformed_or_non_object_bodies_are_400() {
        for body in ["{", "[]", "\"x\"", ""] {
            let e = chat(body).err().unwrap();
            assert_eq!(e.status.as_u16(), 400, "{body}");
            assert_eq!(e.reason, Some("invalid_json"));
        }
    }

    #[test]
    fn completions_take_one_prompt_string() {
        let p = parse(
            Endpoint::Completions,
            br#"{"model":"m","prompt":"Once","max_tokens":5,"echo":false,"best_of":1,"logprobs":0}"#,
        )
        .unwrap();
        assert_eq!(p.request.prompt, "Once");
        assert!(p.logprobs);
        for (body, field) in [
            (r#"{"model":"m","prompt":["a","b"]}"#, "prompt"),
            (r#"{"model":"m","prompt":[1,2]}"#, "prompt"),
            (r#"{"model":"m"}"#, "prompt"),
            (r#"{"model":"m","prompt":"x","echo":true}"#, "echo"),
            (r#"{"model":"m","prompt":"x","logprobs":3}"#, "logprobs"),
            (r#"{"model":"m","prompt":"x","messages":[]}"#, "messages"),
        ] {
            let e = parse(Endpoint::Completions, body.as_bytes()).err().unwrap();
            assert_eq!(param(e), field, "{body}");
        }
    }
}
