//! The response objects of OpenAI's API as tokenmesh fills them:
//! `chat.completion`, `chat.completion.chunk`, `text_completion` and the
//! model list, with the field names and types OpenAI's clients parse.
use serde::ser::{Serialize, Serializer};

/// Token counts, as OpenAI reports them.
#[derive(serde::Serialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
}

impl Usage {
    /// From the stream's usage.
    pub fn of(u: &tokenmesh_proto::v1::Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
        }
    }
}

/// A chunk's `usage`: absent unless `stream_options.include_usage`, then
/// `null` on every chunk but the last.
#[derive(Clone, Copy, Debug)]
pub enum ChunkUsage {
    Omit,
    Null,
    Some(Usage),
}

impl ChunkUsage {
    fn omitted(&self) -> bool {
        matches!(self, ChunkUsage::Omit)
    }
}

impl Serialize for ChunkUsage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ChunkUsage::Some(u) => u.serialize(s),
            _ => s.serialize_none(),
        }
    }
}

/// One token's log probability in a chat response
/// (`choices[].logprobs.content[]`). `token` is the text the token released
/// (empty while a multi-byte character or a possible stop string is held
/// back); `top_logprobs` is always empty: the worker reports only the
/// sampled token's.
#[derive(serde::Serialize, Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: [(); 0],
}

/// `choices[].logprobs` of a chat response or chunk.
#[derive(serde::Serialize, Clone, Debug, Default, PartialEq)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

/// `choices[].logprobs` of a (legacy) completion or chunk.
#[derive(serde::Serialize, Clone, Debug, Default, PartialEq)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Option<()>,
    pub text_offset: Vec<u32>,
}

/// The fields every response object opens with.
#[derive(serde::Serialize, Clone, Debug)]
pub struct Head<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    /// The version that served, so a client can tell canary from stable.
    pub system_fingerprint: &'a str,
}

/// `message` of a non-streamed chat choice.
#[derive(serde::Serialize, Debug)]
pub struct Message<'a> {
    pub role: &'static str,
    pub content: &'a str,
}

/// A choice of a non-streamed chat completion.
#[derive(serde::Serialize, Debug)]
pub struct ChatChoice<'a> {
    pub index: u32,
    pub message: Message<'a>,
    pub logprobs: Option<&'a ChatLogprobs>,
    pub finish_reason: &'static str,
}

/// `chat.completion`.
#[derive(serde::Serialize, Debug)]
pub struct ChatCompletion<'a> {
    #[serde(flatten)]
    pub head: Head<'a>,
    pub choices: [ChatChoice<'a>; 1],
    pub usage: Usage,
}

/// `delta` of a chat chunk.
#[derive(serde::Serialize, Debug, Default)]
pub struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
}

/// A choice of a chat chunk.
#[derive(serde::Serialize, Debug)]
pub struct ChunkChoice<'a> {
    pub index: u32,
    pub delta: Delta<'a>,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// `chat.completion.chunk`.
#[derive(serde::Serialize, Debug)]
pub struct ChatChunk<'a> {
    #[serde(flatten)]
    pub head: Head<'a>,
    pub choices: Vec<ChunkChoice<'a>>,
    #[serde(skip_serializing_if = "ChunkUsage::omitted")]
    pub usage: ChunkUsage,
}

/// A choice of a completion or completion chunk.
#[derive(serde::Serialize, Debug)]
pub struct TextChoice<'a> {
    pub index: u32,
    pub text: &'a str,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// `text_completion`, streamed or not.
#[derive(serde::Serialize, Debug)]
pub struct TextCompletion<'a> {
    #[serde(flatten)]
    pub head: Head<'a>,
    pub choices: Vec<TextChoice<'a>>,
    #[serde(skip_serializing_if = "ChunkUsage::omitted")]
    pub usage: ChunkUsage,
}

/// One entry of `GET /v1/models`.
#[derive(serde::Serialize, Debug, Clone, PartialEq)]
pub struct Model {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
}

/// `GET /v1/models`.
#[derive(serde::Serialize, Debug)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<Model>,
}
