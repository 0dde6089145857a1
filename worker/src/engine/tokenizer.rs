//! The model's tokenizer, rebuilt from GGUF metadata.
//!
//! Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE) with these
//! `tokenizer.ggml.pre` values, mirroring llama.cpp's pre-tokenizer table:
//! - `smollm`, `starcoder`, `refact`, `command-r`, `codeshell`: every digit
//!   split on its own, then the GPT-2 regex;
//! - `gpt-2`, `mpt`, `olmo`, `jais`, `default`, or no `pre` key: the GPT-2
//!   regex alone.
//!
//! Anything else (SentencePiece models, llama3/qwen2/deepseek pre-tokenizers,
//! ...) is refused with an error: those use other split rules, and a guess
//! would silently feed the model token ids it was never trained on.
//!
//! Like llama.cpp with `parse_special = true`, the texts of control (type 3)
//! and user-defined (type 4) tokens are recognised anywhere in the input.
//! `unknown_token_id` and `padding_token_id` are not used: byte-level BPE
//! can spell any input, and nothing here pads.
use candle_core::quantized::gguf_file::{Content, Value};
use std::collections::HashMap;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, Tokenizer};

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TYPE_NORMAL: i32 = 1;
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;

/// Token texts that end a turn in common chat formats, besides the ids the
/// metadata names.
const END_OF_TURN_TEXTS: [&str; 2] = ["<|im_end|>", "<|endoftext|>"];

/// Why a tokenizer could not be built or could not encode.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("GGUF metadata lacks `{0}`")]
    MissingKey(&'static str),
    #[error("GGUF metadata `{key}` is not {expected}")]
    BadValue {
        key: &'static str,
        expected: &'static str,
    },
    #[error(
        "unsupported tokenizer model `{0}`: only `gpt2` (byte-level BPE) GGUF tokenizers are supported"
    )]
    UnsupportedModel(String),
    #[error(
        "unsupported pre-tokenizer `{0}` for a gpt2 tokenizer: supported are smollm, starcoder, \
         refact, command-r, codeshell, gpt-2, mpt, olmo, jais and default"
    )]
    UnsupportedPreTokenizer(String),
    #[error("`tokenizer.ggml.token_type` has {types} entries but there are {tokens} tokens")]
    TokenTypeCount { types: usize, tokens: usize },
    #[error("`{key}` = {id} is outside the vocabulary of {vocab_size} tokens")]
    IdOutOfRange {
        key: &'static str,
        id: u32,
        vocab_size: usize,
    },
    #[error("malformed merge rule {0:?}: expected two tokens separated by a space")]
    BadMerge(String),
    #[error("building the BPE tokenizer failed: {0}")]
    Build(#[source] tokenizers::Error),
    #[error("encoding failed: {0}")]
    Encode(#[source] tokenizers::Error),
}

/// A byte-level BPE tokenizer read from a GGUF file, with per-token output
/// bytes precomputed for streaming detokenization.
pub struct GgufTokenizer {
    inner: Tokenizer,
    /// GGUF token texts, indexed by id (in GPT-2's byte-to-unicode form).
    tokens: Vec<String>,
    /// The bytes each token adds to the output text, indexed by id.
    bytes: Vec<Box<[u8]>>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
}

impl GgufTokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata.
    pub fn from_gguf(content: &Content) -> Result<Self, TokenizerError> {
        let md = &content.metadata;
        let model = get_str(md, "tokenizer.ggml.model")?
            .ok_or(TokenizerError::MissingKey("tokenizer.ggml.model"))?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_string()));
        }
        let pre_tokenizer = pre_tokenizer_for(get_str(md, "tokenizer.ggml.pre")?)?;
        let tokens: Vec<String> = get_strings(md, "tokenizer.ggml.tokens")?
            .into_iter()
            .map(String::from)
            .collect();
        // Ids are u32; checking once here makes the `as u32` casts below exact.
        if u32::try_from(tokens.len()).is_err() {
            return Err(bad("tokenizer.ggml.tokens", "shorter than 2^32 entries"));
        }
        let types = get_token_types(md, tokens.len())?;
        let merges = get_strings(md, "tokenizer.ggml.merges")?
            .iter()
            .map(|rule| split_merge(rule))
            .collect::<Result<Vec<_>, _>>()?;

        let id_key = |key: &'static str| -> Result<Option<u32>, TokenizerError> {
            match get_u32(md, key)? {
                Some(id) if id as usize >= tokens.len() => Err(TokenizerError::IdOutOfRange {
                    key,
                    id,
                    vocab_size: tokens.len(),
                }),
                id => Ok(id),
            }
        };
        let bos_id = id_key("tokenizer.ggml.bos_token_id")?;
        let eos_id = id_key("tokenizer.ggml.eos_token_id")?;
        let eot_id = id_key("tokenizer.ggml.eot_token_id")?;
        // llama.cpp does not add a BOS to gpt2-style vocabularies unless told.
        let add_bos = match md.get("tokenizer.ggml.add_bos_token") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(bad("tokenizer.ggml.add_bos_token", "a bool")),
        };

        let inner = build_hf_tokenizer(&tokens, &types, merges, pre_tokenizer)?;
        let byte_of = unicode_to_byte();
        let bytes = tokens
            .iter()
            .zip(&types)
            .map(|(text, ty)| match *ty {
                TYPE_NORMAL => byte_level_decode(text, &byte_of),
                // User-defined tokens are stored as plain text, not byte-level.
                TYPE_USER_DEFINED => text.as_bytes().into(),
                // Control, unknown, unused and byte tokens print nothing (as
                // llama.cpp's token_to_piece with special=false).
                _ => Box::default(),
            })
            .collect();

        // Chat models end a turn with <|im_end|> or <|endoftext|>, whichever id
        // the GGUF calls "eos"; stopping on only that one would let generation
        // run on past the other (llama.cpp's end-of-generation set does the same).
        let mut eos_ids = Vec::new();
        let by_text = END_OF_TURN_TEXTS
            .iter()
            .filter_map(|text| tokens.iter().position(|t| t == text))
            .map(|i| i as u32);
        for id in [eos_id, eot_id].into_iter().flatten().chain(by_text) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }

        Ok(Self {
            inner,
            tokens,
            bytes,
            bos_id,
            eos_id,
            eos_ids,
            add_bos,
        })
    }

    /// Encodes `text`, turning special-token texts into their ids and adding
    /// BOS first only when the metadata asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(TokenizerError::Encode)?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if self.add_bos {
            ids.extend(self.bos_id);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// The raw bytes token `id` adds to the output text: empty for control
    /// tokens and unknown ids. Not necessarily valid UTF-8 on its own: a
    /// character may span several tokens, so callers concatenate first.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], |b| b)
    }

    /// Decodes `ids` to text, replacing invalid UTF-8 with U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| self.token_bytes(id))
            .copied()
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Every id that ends generation: the metadata's EOS and EOT ids plus
    /// `<|im_end|>` and `<|endoftext|>` when the vocabulary has them.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The BOS token's text, for chat templates.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_id.and_then(|id| self.token_text(id))
    }

    /// The EOS token's text, for chat templates.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_id.and_then(|id| self.token_text(id))
    }

    /// The number of tokens, i.e. one past the largest id.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The token's text as stored in the GGUF (GPT-2 byte-level form for
    /// ordinary tokens, e.g. "Ġthe"), or None for an unknown id.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The BOS id from the metadata, if any.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The underlying Hugging Face tokenizer, for what this type does not
    /// wrap (offsets, batch encoding). Decode with [`Self::decode`], which
    /// follows llama.cpp's rules for control and user-defined tokens.
    pub fn hf_tokenizer(&self) -> &Tokenizer {
        &self.inner
    }
}

/// Picks the pre-tokenizer for a `tokenizer.ggml.pre` value (see module docs).
fn pre_tokenizer_for(pre: Option<&str>) -> Result<PreTokenizerWrapper, TokenizerError> {
    // use_regex: ByteLevel itself applies the GPT-2 split regex.
    // add_prefix_space=false: llama.cpp encodes the text exactly as given.
    let byte_level = ByteLevel::new(false, true, true);
    match pre.unwrap_or("default") {
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" => {
            Ok(Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into())
        }
        "gpt-2" | "mpt" | "olmo" | "jais" | "default" => Ok(byte_level.into()),
        other => Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
    }
}

/// Assembles the Hugging Face tokenizer: BPE over the GGUF vocabulary, the
/// chosen pre-tokenizer, and control/user-defined tokens as added tokens.
fn build_hf_tokenizer(
    tokens: &[String],
    types: &[i32],
    merges: Vec<(String, String)>,
    pre_tokenizer: PreTokenizerWrapper,
) -> Result<Tokenizer, TokenizerError> {
    // On duplicate texts the last id wins, as in llama.cpp's token_to_id.
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(TokenizerError::Build)?;
    let mut inner = Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tokenizer));
    inner.with_decoder(Some(ByteLevel::default()));
    // Control and user-defined tokens are matched in the input text before
    // BPE runs, so "<|im_start|>" becomes its one id (llama.cpp's
    // parse_special=true) instead of being spelled out in pieces.
    let added = |kind: i32, special: bool| {
        tokens
            .iter()
            .zip(types)
            .filter(|(t, ty)| **ty == kind && !t.is_empty())
            .map(|(t, _)| AddedToken::from(t.clone(), special))
            .collect::<Vec<_>>()
    };
    inner
        .add_special_tokens(added(TYPE_CONTROL, true))
        .map_err(TokenizerError::Build)?;
    inner
        .add_tokens(added(TYPE_USER_DEFINED, false))
        .map_err(TokenizerError::Build)?;
    Ok(inner)
}

/// Splits a merge rule "a b" into its two halves. Searching from the second
/// character keeps a leading space part of the first half, as llama.cpp does.
fn split_merge(rule: &str) -> Result<(String, String), TokenizerError> {
    let first_len = rule.chars().next().map_or(0, char::len_utf8);
    match rule[first_len..].find(' ') {
        Some(at) => {
            let (a, b) = rule.split_at(first_len + at);
            Ok((a.to_string(), b[1..].to_string()))
        }
        None => Err(TokenizerError::BadMerge(rule.to_string())),
    }
}

/// The inverse of GPT-2's `bytes_to_unicode`: printable Latin-1 bytes stand
/// for themselves and the other 68 bytes were moved, in order, to U+0100...
fn unicode_to_byte() -> HashMap<char, u8> {
    let mut next_shifted = 0x100u32;
    (0..=255u8)
        .filter_map(|b| {
            let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            let code = if printable {
                u32::from(b)
            } else {
                let code = next_shifted;
                next_shifted += 1;
                code
            };
            char::from_u32(code).map(|c| (c, b))
        })
        .collect()
}

/// Undoes the byte-to-unicode mapping of one token. A character outside the
/// table (a malformed vocabulary) is kept as its own UTF-8 rather than lost.
fn byte_level_decode(text: &str, byte_of: &HashMap<char, u8>) -> Box<[u8]> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match byte_of.get(&c) {
            Some(&b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out.into_boxed_slice()
}

fn bad(key: &'static str, expected: &'static str) -> TokenizerError {
    TokenizerError::BadValue { key, expected }
}

fn get_str<'a>(
    md: &'a HashMap<String, Value>,
    key: &'static str,
) -> Result<Option<&'a str>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(bad(key, "a string")),
    }
}

/// Reads a required array of strings.
fn get_strings<'a>(
    md: &'a HashMap<String, Value>,
    key: &'static str,
) -> Result<Vec<&'a str>, TokenizerError> {
    let Some(value) = md.get(key) else {
        return Err(TokenizerError::MissingKey(key));
    };
    let Value::Array(items) = value else {
        return Err(bad(key, "an array of strings"));
    };
    items
        .iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.as_str()),
            _ => Err(bad(key, "an array of strings")),
        })
        .collect()
}

/// Reads `tokenizer.ggml.token_type`, one per token; without it every token
/// is an ordinary BPE piece.
fn get_token_types(
    md: &HashMap<String, Value>,
    n_tokens: usize,
) -> Result<Vec<i32>, TokenizerError> {
    const KEY: &str = "tokenizer.ggml.token_type";
    let Some(value) = md.get(KEY) else {
        return Ok(vec![TYPE_NORMAL; n_tokens]);
    };
    let Value::Array(items) = value else {
        return Err(bad(KEY, "an array of integers"));
    };
    let types = items
        .iter()
        .map(|v| as_i32(v).ok_or(bad(KEY, "an array of integers")))
        .collect::<Result<Vec<_>, _>>()?;
    if types.len() != n_tokens {
        return Err(TokenizerError::TokenTypeCount {
            types: types.len(),
            tokens: n_tokens,
        });
    }
    Ok(types)
}

/// Reads a token id; writers use various integer widths for these keys.
fn get_u32(md: &HashMap<String, Value>, key: &'static str) -> Result<Option<u32>, TokenizerError> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    let n = match *v {
        Value::U8(n) => Some(i64::from(n)),
        Value::U16(n) => Some(i64::from(n)),
        Value::U32(n) => Some(i64::from(n)),
        Value::U64(n) => i64::try_from(n).ok(),
        Value::I8(n) => Some(i64::from(n)),
        Value::I16(n) => Some(i64::from(n)),
        Value::I32(n) => Some(i64::from(n)),
        Value::I64(n) => Some(n),
        _ => None,
    };
    n.and_then(|n| u32::try_from(n).ok())
        .map(Some)
        .ok_or(bad(key, "a non-negative 32-bit integer"))
}

fn as_i32(v: &Value) -> Option<i32> {
    match *v {
        Value::I32(n) => Some(n),
        Value::U32(n) => i32::try_from(n).ok(),
        Value::I8(n) => Some(i32::from(n)),
        Value::U8(n) => Some(i32::from(n)),
        Value::I16(n) => Some(i32::from(n)),
        Value::U16(n) => Some(i32::from(n)),
        Value::I64(n) => i32::try_from(n).ok(),
        Value::U64(n) => i32::try_from(n).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::VersionedMagic;
    use std::sync::OnceLock;
    use tokenmesh_tests::model_path;

    fn content() -> &'static Content {
        static CONTENT: OnceLock<Content> = OnceLock::new();
        CONTENT.get_or_init(|| {
            let mut file = std::fs::File::open(model_path()).expect("open the model");
            Content::read(&mut file).expect("read GGUF metadata")
        })
    }

    fn tok() -> &'static GgufTokenizer {
        static TOK: OnceLock<GgufTokenizer> = OnceLock::new();
        TOK.get_or_init(|| GgufTokenizer::from_gguf(content()).expect("build the tokenizer"))
    }

    fn id_of(text: &str) -> u32 {
        let t = tok();
        (0..t.vocab_size() as u32)
            .find(|&id| t.token_text(id) == Some(text))
            .unwrap_or_else(|| panic!("{text:?} is not in the vocabulary"))
    }

    #[test]
    fn print_metadata_once() {
        let md = &content().metadata;
        let mut keys: Vec<_> = md.keys().collect();
        keys.sort();
        for k in keys {
            match &md[k] {
                Value::Array(a) => println!("{k}: array of {}", a.len()),
                Value::String(s) if s.len() > 80 => println!("{k}: string of {} bytes", s.len()),
                v => println!("{k}: {v:?}"),
            }
        }
    }

    #[test]
    fn smollm_special_ids_and_texts() {
        let t = tok();
        assert_eq!(t.vocab_size(), 49152);
        assert_eq!(t.bos_token(), Some("<|im_start|>"));
        assert_eq!(t.eos_token(), Some("<|im_end|>"));
        assert_eq!(t.eos_token_ids(), &[2, 0]);
        assert_eq!(t.token_bytes(1), b"");
        assert_eq!(t.token_bytes(u32::MAX), b"");
        assert_eq!(t.token_text(u32::MAX), None);
    }

    #[test]
    fn hello_world_round_trips() {
        let t = tok();
        let ids = t.encode("Hello, world!").unwrap();
        assert_eq!(t.decode(&ids), "Hello, world!");
        // add_bos_token is false for this model.
        assert_ne!(ids.first(), Some(&1));
    }

    #[test]
    fn special_tokens_are_single_ids() {
        let t = tok();
        let ids = t.encode("<|im_start|>user\nHi<|im_end|>\n").unwrap();
        assert_eq!(ids.first(), Some(&id_of("<|im_start|>")));
        assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 1);
        assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 1);
        assert_eq!(ids[ids.len() - 2], id_of("<|im_end|>"));
        // Control tokens print nothing; the rest round-trips.
        assert_eq!(t.decode(&ids), "user\nHi\n");
    }

    #[test]
    fn digits_are_split() {
        let t = tok();
        let ids = t.encode("12345").unwrap();
        assert_eq!(ids.len(), 5);
        let expected: Vec<u32> = "12345".chars().map(|c| id_of(&c.to_string())).collect();
        assert_eq!(ids, expected);
    }

    #[test]
    fn multibyte_text_round_trips() {
        let t = tok();
        for text in ["é", "café", "日本語", "🦀 rust", "naïve 😀!"] {
            let ids = t.encode(text).unwrap();
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&id| t.token_bytes(id))
                .copied()
                .collect();
            assert_eq!(bytes, text.as_bytes(), "{text:?} -> {ids:?}");
            assert_eq!(t.decode(&ids), text);
        }
        // An emoji is four bytes; at least one token must carry a partial
        // character, which is why token_bytes is bytes and not str.
        let ids = t.encode("😀").unwrap();
        assert!(ids.len() > 1 || t.token_bytes(ids[0]) == "😀".as_bytes());
    }

    #[test]
    fn france_prompt_ids() {
        let t = tok();
        let prompt = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
        let ids = t.encode(prompt).unwrap();
        println!("france prompt ids: {ids:?}");
        let pieces: Vec<_> = ids.iter().map(|&id| t.token_text(id).unwrap()).collect();
        println!("france prompt pieces: {pieces:?}");
        assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 3);
        assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 2);
        assert_eq!(
            t.decode(&ids),
            "system\nYou are a helpful assistant.\nuser\nWhat is the capital of France?\nassistant\n"
        );
    }

    /// A tiny made-up vocabulary, after `edit` has changed its metadata.
    fn synthetic(
        edit: impl FnOnce(&mut HashMap<String, Value>),
    ) -> Result<GgufTokenizer, TokenizerError> {
        let strings =
            |v: &[&str]| Value::Array(v.iter().map(|s| Value::String(s.to_string())).collect());
        // "Ã" and "©" are the byte-level forms of é's two UTF-8 bytes.
        let tokens = [
            "<|endoftext|>",
            "<|im_end|>",
            "<tool>",
            "a",
            "b",
            "ab",
            "Ġ",
            "1",
            "2",
            "Ã",
            "©",
        ];
        let types = [3, 3, 4, 1, 1, 1, 1, 1, 1, 1, 1];
        let mut md = HashMap::new();
        md.insert("tokenizer.ggml.model".into(), Value::String("gpt2".into()));
        md.insert("tokenizer.ggml.pre".into(), Value::String("smollm".into()));
        md.insert("tokenizer.ggml.tokens".into(), strings(&tokens));
        md.insert(
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.map(Value::I32).to_vec()),
        );
        md.insert("tokenizer.ggml.merges".into(), strings(&["a b"]));
        md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(1));
        edit(&mut md);
        GgufTokenizer::from_gguf(&Content {
            magic: VersionedMagic::GgufV3,
            metadata: md,
            tensor_infos: HashMap::new(),
            tensor_data_offset: 0,
        })
    }

    #[test]
    fn synthetic_vocabulary_encodes_and_decodes() {
        let t = synthetic(|_| {}).unwrap();
        let ids = t.encode("ab<|im_end|>a b<tool>12é").unwrap();
        assert_eq!(ids, [5, 1, 3, 6, 4, 2, 7, 8, 9, 10]);
        // Control tokens print nothing, user-defined ones their text, and é
        // is split across two tokens of one byte each.
        assert_eq!(t.decode(&ids), "aba b<tool>12é");
        assert_eq!(t.token_bytes(9), [0xC3]);
        assert_eq!(t.token_bytes(10), [0xA9]);
        assert_eq!(t.eos_token_ids(), [1, 0]);
        assert_eq!(t.bos_token(), None);
        assert_eq!(t.eos_token(), Some("<|im_end|>"));
    }

    #[test]
    fn bos_is_added_only_when_asked() {
        let t = synthetic(|md| {
            md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(0));
        })
        .unwrap();
        assert_eq!(t.encode("a").unwrap(), [3]);
        let t = synthetic(|md| {
            md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(0));
            md.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(true));
        })
        .unwrap();
        assert_eq!(t.encode("a").unwrap(), [0, 3]);
    }

    /// The error `synthetic` gives after setting `key` to `value`.
    fn error_with(key: &str, value: Value) -> TokenizerError {
        synthetic(|md| {
            md.insert(key.into(), value);
        })
        .err()
        .expect("an error")
    }

    #[test]
    fn bad_metadata_is_an_error() {
        use TokenizerError as E;
        let string = |s: &str| Value::String(s.into());
        let strings = |s: &str| Value::Array(vec![string(s)]);
        assert!(matches!(
            error_with("tokenizer.ggml.model", string("llama")),
            E::UnsupportedModel(m) if m == "llama"
        ));
        assert!(matches!(
            error_with("tokenizer.ggml.pre", string("qwen2")),
            E::UnsupportedPreTokenizer(p) if p == "qwen2"
        ));
        assert!(matches!(
            error_with("tokenizer.ggml.merges", strings("ab")),
            E::BadMerge(_)
        ));
        // A merge whose parts are not in the vocabulary.
        assert!(matches!(
            error_with("tokenizer.ggml.merges", strings("a c")),
            E::Build(_)
        ));
        assert!(matches!(
            error_with("tokenizer.ggml.eos_token_id", Value::U32(99)),
            E::IdOutOfRange { id: 99, .. }
        ));
        assert!(matches!(
            error_with("tokenizer.ggml.eos_token_id", Value::I32(-1)),
            E::BadValue { .. }
        ));
        assert!(matches!(
            error_with("tokenizer.ggml.bos_token_id", string("1")),
            E::BadValue { .. }
        ));
        assert!(matches!(
            error_with("tokenizer.ggml.tokens", Value::U32(3)),
            E::BadValue { .. }
        ));
        assert!(matches!(
            error_with(
                "tokenizer.ggml.token_type",
                Value::Array(vec![Value::I32(1)])
            ),
            E::TokenTypeCount {
                types: 1,
                tokens: 11
            }
        ));
        let missing = synthetic(|md| {
            md.remove("tokenizer.ggml.merges");
        });
        assert!(matches!(
            missing,
            Err(E::MissingKey("tokenizer.ggml.merges"))
        ));
    }

    #[test]
    fn tokenizer_is_shareable_across_threads() {
        fn check<T: Send + Sync>() {}
        check::<GgufTokenizer>();
    }

    #[test]
    fn merge_rules_split_on_the_separating_space() {
        assert_eq!(
            split_merge("Ġ t").unwrap(),
            ("Ġ".to_string(), "t".to_string())
        );
        assert!(split_merge("nospace").is_err());
        assert!(split_merge("").is_err());
    }

    #[test]
    fn byte_table_covers_all_bytes() {
        let table = unicode_to_byte();
        assert_eq!(table.len(), 256);
        assert_eq!(table[&'Ġ'], b' ');
        assert_eq!(table[&'Ċ'], b'\n');
    }

    #[test]
    fn unsupported_pre_tokenizer_is_an_error() {
        assert!(matches!(
            pre_tokenizer_for(Some("llama-bpe")),
            Err(TokenizerError::UnsupportedPreTokenizer(_))
        ));
        assert!(pre_tokenizer_for(None).is_ok());
    }
}
