//! What the router hashes of a prompt, without tokenizing it: a canonical
//! byte rendering cut into fixed-size chunks, each hashed chained onto the
//! one before (hash_i = H(hash_{i-1}, chunk_i)), so that a prompt that
//! extends another (the next turn of a chat re-sends every earlier turn)
//! keeps every full chunk hash of the shorter one. The seed covers model
//! and version: a version's workers hold only that version's KV.
//!
//! xxh3 with fixed seeds: fast, and its output is fixed by its
//! specification, so every router (of any build) hashes a prompt the same
//! way; that is what lets replicas agree without talking.
use tokenmesh_proto::v1::GenerateRequest;
use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// Bytes of rendering per chunk: about 32 tokens of English, two KV blocks
/// of 16 tokens; small enough that a match tracks the worker's blocks, large
/// enough that a prompt is a few dozen chunks.
pub const CHUNK_BYTES: usize = 128;

/// Chunks hashed per prompt at most (128 KiB, beyond the context of the
/// models served): bounds the work and the index entries of one request.
pub const MAX_CHUNKS: usize = 1024;

/// A plain prompt's conversation key covers at most its first bytes: a
/// prompt continued by appending keeps its key once it is this long.
pub const PROMPT_KEY_BYTES: usize = 2 * CHUNK_BYTES;

/// Separators of the rendering: bytes that never occur in valid UTF-8 text
/// boundaries the way they are used here (ASCII control characters).
const ROLE_END: u8 = 0x1f;
const MESSAGE_END: u8 = 0x1e;
const PROMPT_START: u8 = 0x02;

/// One request's prompt as the router sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptDigest {
    /// The chained hash of each full chunk, in order.
    pub chunks: Vec<u64>,
    /// Bytes of the rendering.
    pub bytes: usize,
    /// Chunks that cover the conversation key's bytes (through the first
    /// user message): a worker whose match is shorter may hold only what
    /// many conversations share (a system prompt, a common opening), not
    /// this conversation.
    pub key_chunks: usize,
    /// The key that rendezvous hashing places the conversation by: the
    /// session id when there is one, else the rendering up to the end of the
    /// first user message (for a plain prompt, its first
    /// [`PROMPT_KEY_BYTES`]); later turns keep it.
    pub conversation: u64,
}

/// The chunker: feeds bytes, hashes each chunk as it fills.
struct Chunker {
    buf: [u8; CHUNK_BYTES],
    len: usize,
    prev: u64,
    chunks: Vec<u64>,
    bytes: usize,
}

impl Chunker {
    /// A chunker for a rendering of about `bytes` bytes (its chunk list is
    /// allocated once, not grown by doubling).
    fn new(seed: u64, bytes: usize) -> Self {
        Self {
            buf: [0; CHUNK_BYTES],
            len: 0,
            prev: seed,
            chunks: Vec::with_capacity((bytes / CHUNK_BYTES).min(MAX_CHUNKS)),
            bytes: 0,
        }
    }

    fn feed(&mut self, mut data: &[u8]) {
        self.bytes += data.len();
        while !data.is_empty() && self.chunks.len() < MAX_CHUNKS {
            if self.len == 0 && data.len() >= CHUNK_BYTES {
                // A whole chunk in place: hashed where it lies, not copied.
                let (chunk, rest) = data.split_at(CHUNK_BYTES);
                self.prev = xxh3_64_with_seed(chunk, self.prev);
                self.chunks.push(self.prev);
                data = rest;
                continue;
            }
            let take = (CHUNK_BYTES - self.len).min(data.len());
            self.buf[self.len..self.len + take].copy_from_slice(&data[..take]);
            self.len += take;
            data = &data[take..];
            if self.len == CHUNK_BYTES {
                self.prev = xxh3_64_with_seed(&self.buf, self.prev);
                self.chunks.push(self.prev);
                self.len = 0;
            }
        }
    }
}

/// The seed of a model version's hashes.
pub fn seed(model: &str, version: &str) -> u64 {
    let mut h = Xxh3::with_seed(0x746f_6b65_6e6d_6573);
    h.update(model.as_bytes());
    h.update(&[0]);
    h.update(version.as_bytes());
    h.digest()
}

/// Digests `request`'s prompt for `version`; `session` is the sticky-session
/// key (from the request or its header), which names the conversation when
/// given.
pub fn digest(request: &GenerateRequest, version: &str, session: Option<&str>) -> PromptDigest {
    let seed = seed(&request.model, version);
    let rendering = request.prompt.len()
        + 1
        + request
            .messages
            .iter()
            .map(|m| m.role.len() + m.content.len() + 2)
            .sum::<usize>();
    let mut chunker = Chunker::new(seed, rendering);
    let mut key = Xxh3::with_seed(seed);
    let key_end;
    if request.messages.is_empty() {
        chunker.feed(&[PROMPT_START]);
        chunker.feed(request.prompt.as_bytes());
        let text = request.prompt.as_bytes();
        let keyed = &text[..text.len().min(PROMPT_KEY_BYTES - 1)];
        key.update(&[PROMPT_START]);
        key.update(keyed);
        key_end = 1 + keyed.len();
    } else {
        let mut keyed = true;
        let mut end = None;
        for m in &request.messages {
            for part in [
                m.role.as_bytes(),
                &[ROLE_END],
                m.content.as_bytes(),
                &[MESSAGE_END],
            ] {
                chunker.feed(part);
                if keyed {
                    key.update(part);
                }
            }
            if keyed && m.role == "user" {
                keyed = false;
                end = Some(chunker.bytes);
            }
        }
        key_end = end.unwrap_or(chunker.bytes);
    }
    let conversation = match session {
        Some(s) if !s.is_empty() => xxh3_64_with_seed(s.as_bytes(), seed ^ 0x5e55_1015),
        _ => key.digest(),
    };
    PromptDigest {
        key_chunks: key_end.div_ceil(CHUNK_BYTES),
        chunks: chunker.chunks,
        bytes: chunker.bytes,
        conversation,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenmesh_proto::v1::ChatMessage;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    fn chat(messages: Vec<ChatMessage>) -> GenerateRequest {
        GenerateRequest {
            model: "m".into(),
            messages,
            ..Default::default()
        }
    }

    fn long(word: &str, n: usize) -> String {
        vec![word; n].join(" ")
    }

    #[test]
    fn a_later_turn_keeps_every_full_chunk_and_the_conversation_key() {
        let system = msg("system", &long("rules", 100));
        let first = chat(vec![system.clone(), msg("user", &long("question", 30))]);
        let mut turns = first.messages.clone();
        turns.push(msg("assistant", &long("answer", 40)));
        turns.push(msg("user", "and then?"));
        let second = chat(turns);
        let (a, b) = (digest(&first, "v1", None), digest(&second, "v1", None));
        assert!(a.chunks.len() >= 6 && b.chunks.len() > a.chunks.len());
        assert_eq!(a.chunks[..], b.chunks[..a.chunks.len()]);
        assert_eq!(a.conversation, b.conversation);
        // System 607 bytes, user 275: the key ends at byte 882, in chunk 7,
        // which only the next turn has in full.
        assert_eq!((a.key_chunks, a.chunks.len()), (7, 6));
        assert_eq!(b.key_chunks, 7);
        assert_eq!(
            a.bytes,
            first
                .messages
                .iter()
                .map(|m| m.role.len() + m.content.len() + 2)
                .sum::<usize>()
        );
    }

    #[test]
    fn conversations_that_share_a_system_prompt_share_its_chunks_but_not_their_keys() {
        let system = msg("system", &long("rules", 100));
        let a = digest(
            &chat(vec![system.clone(), msg("user", "hello")]),
            "v1",
            None,
        );
        let b = digest(&chat(vec![system, msg("user", "goodbye")]), "v1", None);
        assert_eq!(a.chunks[..4], b.chunks[..4]);
        assert_ne!(a.conversation, b.conversation);
    }

    #[test]
    fn model_version_and_roles_change_the_hashes() {
        let req = chat(vec![msg("user", &long("same", 60))]);
        let v1 = digest(&req, "v1", None);
        assert_ne!(v1.chunks[0], digest(&req, "v2", None).chunks[0]);
        let other_model = GenerateRequest {
            model: "n".into(),
            ..req.clone()
        };
        assert_ne!(v1.chunks[0], digest(&other_model, "v1", None).chunks[0]);
        let as_system = chat(vec![msg("system", &long("same", 60))]);
        assert_ne!(v1.chunks[0], digest(&as_system, "v1", None).chunks[0]);
        // A prompt is not a user message with the same text.
        let prompt = GenerateRequest {
            model: "m".into(),
            prompt: long("same", 60),
            ..Default::default()
        };
        assert_ne!(v1.chunks[0], digest(&prompt, "v1", None).chunks[0]);
    }

    #[test]
    fn a_session_names_the_conversation_and_a_long_prompt_keeps_its_key() {
        let req = chat(vec![msg("user", "hi")]);
        let a = digest(&req, "v1", Some("s-1"));
        assert_eq!(
            a.conversation,
            digest(&chat(vec![msg("user", "other")]), "v1", Some("s-1")).conversation
        );
        assert_ne!(a.conversation, digest(&req, "v1", Some("s-2")).conversation);
        let prompt = |text: String| GenerateRequest {
            model: "m".into(),
            prompt: text,
            ..Default::default()
        };
        let short = digest(&prompt(long("word", 60)), "v1", None);
        let longer = digest(&prompt(long("word", 90)), "v1", None);
        assert_eq!(short.conversation, longer.conversation);
        assert_eq!(short.key_chunks, 2);
    }

    #[test]
    fn the_chunks_are_those_of_the_whole_rendering_however_the_parts_fall() {
        // Parts shorter than a chunk, longer than one, and ending on a
        // chunk's boundary: hashed in place or through the buffer, the chain
        // is that of the rendering cut into chunks.
        for (a, b) in [(10, 500), (127, 128), (126, 3 * CHUNK_BYTES), (300, 1)] {
            let req = chat(vec![
                msg("system", &"s".repeat(a)),
                msg("user", &"u".repeat(b)),
            ]);
            let mut rendering = Vec::new();
            for m in &req.messages {
                rendering.extend_from_slice(m.role.as_bytes());
                rendering.push(ROLE_END);
                rendering.extend_from_slice(m.content.as_bytes());
                rendering.push(MESSAGE_END);
            }
            let mut prev = seed("m", "v1");
            let want: Vec<u64> = rendering
                .chunks_exact(CHUNK_BYTES)
                .map(|c| {
                    prev = xxh3_64_with_seed(c, prev);
                    prev
                })
                .collect();
            let d = digest(&req, "v1", None);
            assert_eq!(d.chunks, want, "parts of {a} and {b} bytes");
            assert_eq!(d.bytes, rendering.len());
        }
    }

    #[test]
    fn the_chunks_of_one_prompt_are_bounded() {
        let huge = GenerateRequest {
            model: "m".into(),
            prompt: "x".repeat(CHUNK_BYTES * (MAX_CHUNKS + 10)),
            ..Default::default()
        };
        let d = digest(&huge, "v1", None);
        assert_eq!(d.chunks.len(), MAX_CHUNKS);
        assert_eq!(d.bytes, huge.prompt.len() + 1);
    }
}
