//! The router's stream of `GenerateResponse` messages as OpenAI responses:
//! a whole `chat.completion` / `text_completion` once the stream finished, or
//! Server-Sent Events chunk by chunk (`data: {…}` frames, a last frame with
//! the usage when `stream_options.include_usage` asks for it, and
//! `data: [DONE]`; a stream that fails after it started ends with a
//! `data: {"error": …}` frame instead).
use super::errors::ApiError;
use super::request::Endpoint;
use super::wire::*;
use bytes::{BufMut, Bytes, BytesMut};
use tokenmesh_proto::v1::{self as pb, FinishReason};

/// What every response object of one request repeats.
#[derive(Debug, Clone)]
pub struct Answer {
    pub endpoint: Endpoint,
    /// `chatcmpl-{request id}` or `cmpl-{request id}`.
    pub id: String,
    /// Unix seconds when the request arrived.
    pub created: u64,
    /// The model as the client named it (without `@version`).
    pub model: String,
    /// The version serving it (also `system_fingerprint`).
    pub version: String,
    pub include_usage: bool,
    pub logprobs: bool,
}

/// OpenAI's `finish_reason`: a stop string or the end of the model's turn
/// is `stop`, `max_tokens` or the context window `length`.
pub fn finish_reason(f: &pb::Finished) -> &'static str {
    match f.finish_reason() {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

impl Answer {
    fn head(&self, object: &'static str) -> Head<'_> {
        Head {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            system_fingerprint: &self.version,
        }
    }

    fn chunk_usage(&self) -> ChunkUsage {
        if self.include_usage {
            ChunkUsage::Null
        } else {
            ChunkUsage::Omit
        }
    }

    /// The first SSE frame: a chat stream opens with the assistant's role.
    pub fn opening(&self) -> Bytes {
        let mut out = BytesMut::new();
        if self.endpoint == Endpoint::Chat {
            let delta = Delta {
                role: Some("assistant"),
                content: Some(""),
            };
            self.chat_frame(&mut out, delta, None, None);
        }
        out.freeze()
    }

    /// The SSE frame of one delta, if it carries anything.
    pub fn delta(&self, d: &pb::Delta) -> Option<Bytes> {
        let logprobs = self.logprobs && !d.logprobs.is_empty();
        if d.text.is_empty() && !logprobs {
            return None;
        }
        let mut out = BytesMut::new();
        match self.endpoint {
            Endpoint::Chat => {
                let lp = logprobs.then(|| ChatLogprobs {
                    content: chat_logprobs(d),
                });
                let delta = Delta {
                    role: None,
                    content: Some(&d.text),
                };
                self.chat_frame(&mut out, delta, lp, None);
            }
            Endpoint::Completions => {
                let mut lp = CompletionLogprobs::default();
                if logprobs {
                    // Offsets within this chunk's text.
                    text_logprobs(&mut lp, d, 0);
                }
                self.text_frame(&mut out, &d.text, logprobs.then_some(lp), None);
            }
        }
        Some(out.freeze())
    }

    /// The frames that end a finished stream: the finish reason, the usage
    /// if asked for, and `[DONE]`.
    pub fn finished(&self, f: &pb::Finished) -> Bytes {
        let mut out = BytesMut::new();
        let reason = Some(finish_reason(f));
        match self.endpoint {
            Endpoint::Chat => self.chat_frame(&mut out, Delta::default(), None, reason),
            Endpoint::Completions => self.text_frame(&mut out, "", None, reason),
        }
        if self.include_usage {
            let usage = ChunkUsage::Some(f.usage.as_ref().map(Usage::of).unwrap_or_default());
            match self.endpoint {
                Endpoint::Chat => frame(
                    &mut out,
                    &ChatChunk {
                        head: self.head("chat.completion.chunk"),
                        choices: vec![],
                        usage,
                    },
                ),
                Endpoint::Completions => frame(
                    &mut out,
                    &TextCompletion {
                        head: self.head("text_completion"),
                        choices: vec![],
                        usage,
                    },
                ),
            }
        }
        out.put_slice(b"data: [DONE]\n\n");
        out.freeze()
    }

    fn chat_frame(
        &self,
        out: &mut BytesMut,
        delta: Delta<'_>,
        logprobs: Option<ChatLogprobs>,
        finish_reason: Option<&'static str>,
    ) {
        frame(
            out,
            &ChatChunk {
                head: self.head("chat.completion.chunk"),
                choices: vec![ChunkChoice {
                    index: 0,
                    delta,
                    logprobs,
                    finish_reason,
                }],
                usage: self.chunk_usage(),
            },
        );
    }

    fn text_frame(
        &self,
        out: &mut BytesMut,
        text: &str,
        logprobs: Option<CompletionLogprobs>,
        finish_reason: Option<&'static str>,
    ) {
        frame(
            out,
            &TextCompletion {
                head: self.head("text_completion"),
                choices: vec![TextChoice {
                    index: 0,
                    text,
                    logprobs,
                    finish_reason,
                }],
                usage: self.chunk_usage(),
            },
        );
    }
}

/// The frame that ends a stream that failed after it started.
pub fn error_frame(e: &ApiError) -> Bytes {
    Bytes::from(format!("data: {}\n\n", e.json()))
}

fn frame(out: &mut BytesMut, value: &impl serde::Serialize) {
    out.put_slice(b"data: ");
    // Serializing these plain structs cannot fail.
    let _ = serde_json::to_writer((&mut *out).writer(), value);
    out.put_slice(b"\n\n");
}

/// One entry per token of a delta. The worker sends one token per delta, so
/// the delta's text is the token's.
fn chat_logprobs(d: &pb::Delta) -> Vec<TokenLogprob> {
    d.logprobs
        .iter()
        .enumerate()
        .map(|(i, &logprob)| {
            let token = if i + 1 == d.logprobs.len() {
                d.text.clone()
            } else {
                String::new()
            };
            TokenLogprob {
                bytes: token.as_bytes().to_vec(),
                token,
                logprob,
                top_logprobs: [],
            }
        })
        .collect()
}

fn text_logprobs(lp: &mut CompletionLogprobs, d: &pb::Delta, offset: u32) {
    for (i, &logprob) in d.logprobs.iter().enumerate() {
        let token = if i + 1 == d.logprobs.len() {
            d.text.clone()
        } else {
            String::new()
        };
        lp.tokens.push(token);
        lp.token_logprobs.push(logprob);
        lp.text_offset.push(offset);
    }
}

/// A whole response, built from the stream as it arrives.
#[derive(Default)]
pub struct Collected {
    text: String,
    chat_logprobs: ChatLogprobs,
    text_logprobs: CompletionLogprobs,
}

impl Collected {
    /// Adds one delta.
    pub fn delta(&mut self, d: &pb::Delta) {
        if !d.logprobs.is_empty() {
            self.chat_logprobs.content.extend(chat_logprobs(d));
            let offset = self.text.chars().count() as u32;
            text_logprobs(&mut self.text_logprobs, d, offset);
        }
        self.text.push_str(&d.text);
    }

    /// The JSON body once the stream finished with `f`.
    pub fn body(self, answer: &Answer, f: &pb::Finished) -> String {
        let usage = f.usage.as_ref().map(Usage::of).unwrap_or_default();
        let reason = finish_reason(f);
        let result = match answer.endpoint {
            Endpoint::Chat => serde_json::to_string(&ChatCompletion {
                head: answer.head("chat.completion"),
                choices: [ChatChoice {
                    index: 0,
                    message: Message {
                        role: "assistant",
                        content: &self.text,
                    },
                    logprobs: answer.logprobs.then_some(&self.chat_logprobs),
                    finish_reason: reason,
                }],
                usage,
            }),
            Endpoint::Completions => serde_json::to_string(&TextCompletion {
                head: answer.head("text_completion"),
                choices: vec![TextChoice {
                    index: 0,
                    text: &self.text,
                    logprobs: answer.logprobs.then_some(self.text_logprobs),
                    finish_reason: Some(reason),
                }],
                usage: ChunkUsage::Some(usage),
            }),
        };
        result.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn answer(endpoint: Endpoint, include_usage: bool) -> Answer {
        Answer {
            endpoint,
            id: "chatcmpl-1".into(),
            created: 7,
            model: "m".into(),
            version: "v1".into(),
            include_usage,
            logprobs: false,
        }
    }

    fn frames(b: &Bytes) -> Vec<String> {
        std::str::from_utf8(b)
            .unwrap()
            .split("\n\n")
            .filter(|f| !f.is_empty())
            .map(|f| f.strip_prefix("data: ").unwrap().to_string())
            .collect()
    }

    fn finished(reason: FinishReason) -> pb::Finished {
        pb::Finished {
            finish_reason: reason as i32,
            usage: Some(pb::Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_chat_stream_opens_with_the_role_and_ends_with_usage_and_done() {
        let a = answer(Endpoint::Chat, true);
        let open: Value = serde_json::from_str(&frames(&a.opening())[0]).unwrap();
        assert_eq!(open["object"], "chat.completion.chunk");
        assert_eq!(open["choices"][0]["delta"]["role"], "assistant");
        assert!(open["usage"].is_null() && open.get("usage").is_some());
        let d = pb::Delta {
            text: "Hi".into(),
            token_ids: vec![1],
            ..Default::default()
        };
        let chunk: Value = serde_json::from_str(&frames(&a.delta(&d).unwrap())[0]).unwrap();
        assert_eq!(chunk["choices"][0]["delta"]["content"], "Hi");
        assert!(chunk["choices"][0]["delta"].get("role").is_none());
        let end = frames(&a.finished(&finished(FinishReason::Eos)));
        assert_eq!(end.len(), 3);
        let last: Value = serde_json::from_str(&end[0]).unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        let usage: Value = serde_json::from_str(&end[1]).unwrap();
        assert_eq!(usage["choices"], Value::Array(vec![]));
        assert_eq!(usage["usage"]["total_tokens"], 5);
        assert_eq!(end[2], "[DONE]");
    }

    #[test]
    fn without_include_usage_no_chunk_has_a_usage_field() {
        let a = answer(Endpoint::Completions, false);
        assert!(a.opening().is_empty());
        let end = frames(&a.finished(&finished(FinishReason::Length)));
        assert_eq!(end.len(), 2);
        let last: Value = serde_json::from_str(&end[0]).unwrap();
        assert_eq!(last["object"], "text_completion");
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert!(last.get("usage").is_none());
        // A held-back token (no text) sends nothing.
        let empty = pb::Delta {
            token_ids: vec![1],
            ..Default::default()
        };
        assert!(a.delta(&empty).is_none());
    }

    #[test]
    fn a_whole_chat_completion() {
        let mut a = answer(Endpoint::Chat, false);
        a.logprobs = true;
        let mut c = Collected::default();
        for (t, lp) in [("Par", -0.5), ("is", -0.25)] {
            c.delta(&pb::Delta {
                text: t.into(),
                token_ids: vec![9],
                logprobs: vec![lp],
                ..Default::default()
            });
        }
        let v: Value = serde_json::from_str(&c.body(&a, &finished(FinishReason::Stop))).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["system_fingerprint"], "v1");
        assert_eq!(v["choices"][0]["message"]["content"], "Paris");
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["choices"][0]["logprobs"]["content"][1]["token"], "is");
        assert_eq!(v["choices"][0]["logprobs"]["content"][1]["logprob"], -0.25);
        assert_eq!(v["usage"]["prompt_tokens"], 3);
    }
}
