//! The model's tokenizer, rebuilt from GGUF metadata to tokenize exactly as
//! llama.cpp does (its vocabulary test suite is the judge:
//! worker/tests/tokenizer_suite.rs).
//!
//! Supported `tokenizer.ggml.model` values:
//! - `gpt2`: byte-level BPE, with the pre-tokenizer `tokenizer.ggml.pre`
//!   names (see `pre`: Llama 3, Qwen 2/3.5, DeepSeek, Falcon, StarCoder,
//!   GPT-2, SmolLM and their aliases);
//! - `llama`: SentencePiece BPE with byte fallback (Llama 2, Mistral,
//!   TinyLlama, Phi-3), see `spm`.
//!
//! Anything else is refused with an error naming what was found and what is
//! supported: a guess would silently feed the model token ids it was never
//! trained on.
//!
//! Encoding follows llama.cpp's `llama_tokenize`: special-token texts are cut
//! out first (`special`), BOS/EOS are added per `tokenizer.ggml.add_bos_token`
//! / `add_eos_token` (defaults as llama.cpp's per vocabulary type), and
//! SentencePiece text gets its leading space per `add_space_prefix`.
use candle_core::quantized::gguf_file::Content;
use std::collections::HashMap;

mod bpe;
mod metadata;
mod pieces;
mod pre;
mod special;
mod spm;

use metadata::{bad, get_bool, get_scores, get_str, get_strings, get_token_types, get_u32};
use pieces::TextForm;
use special::{attr, Fragment, SpecialTokens};

/// `tokenizer.ggml.token_type` of an ordinary token.
const TYPE_NORMAL: i32 = 1;

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
        "unsupported tokenizer model `tokenizer.ggml.model = {0}`: supported are `gpt2` \
         (byte-level BPE) and `llama` (SentencePiece)"
    )]
    UnsupportedModel(String),
    #[error(
        "unsupported pre-tokenizer `tokenizer.ggml.pre = {0}` for a gpt2 tokenizer: supported are {supported}",
        supported = pre::SUPPORTED
    )]
    UnsupportedPreTokenizer(String),
    #[error("`{key}` has {found} entries but there are {tokens} tokens")]
    Count {
        key: &'static str,
        found: usize,
        tokens: usize,
    },
    #[error("`{key}` = {id} is outside the vocabulary of {vocab_size} tokens")]
    IdOutOfRange {
        key: &'static str,
        id: u32,
        vocab_size: usize,
    },
    #[error("malformed merge rule {0:?}: expected two tokens separated by a space")]
    BadMerge(String),
    #[error("building the BPE tokenizer failed (corrupt vocabulary or merges?): {0}")]
    Build(#[source] tokenizers::Error),
    #[error("encoding failed: {0}")]
    Encode(#[source] tokenizers::Error),
}

/// How [`GgufTokenizer::encode_with`] treats special tokens, as llama.cpp's
/// `llama_tokenize` arguments of the same names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Add BOS/EOS where the vocabulary asks for them.
    pub add_special: bool,
    /// Turn the texts of control tokens (e.g. "<|im_start|>") into their
    /// ids; user-defined tokens are always recognised.
    pub parse_special: bool,
}

impl EncodeOptions {
    /// How prompts are encoded for the model: both on.
    pub const PROMPT: Self = Self {
        add_special: true,
        parse_special: true,
    };
    /// Text only: both off (llama.cpp's vocabulary test suite setting).
    pub const TEXT: Self = Self {
        add_special: false,
        parse_special: false,
    };
}

/// Boxed: both are large, and held once per tokenizer.
enum Model {
    Bpe(Box<bpe::Bpe>),
    Spm(Box<spm::Spm>),
}

/// A tokenizer read from a GGUF file, with per-token output bytes
/// precomputed for streaming detokenization.
pub struct GgufTokenizer {
    model: Model,
    specials: SpecialTokens,
    /// GGUF token texts, indexed by id.
    tokens: Vec<String>,
    /// The bytes each token adds to the output text, indexed by id.
    bytes: Vec<Box<[u8]>>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    /// SentencePiece: a space before text at the start and after specials.
    add_space_prefix: bool,
}

impl GgufTokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata.
    pub fn from_gguf(content: &Content) -> Result<Self, TokenizerError> {
        let md = &content.metadata;
        let model_name = get_str(md, "tokenizer.ggml.model")?
            .ok_or(TokenizerError::MissingKey("tokenizer.ggml.model"))?;
        let form = match model_name {
            "gpt2" => TextForm::ByteLevel,
            "llama" => TextForm::Sentencepiece,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        // The pre-tokenizer is checked before the (large) vocabulary is read.
        let pre = match form {
            TextForm::ByteLevel => Some(pre::PreTokenizer::for_name(get_str(
                md,
                "tokenizer.ggml.pre",
            )?)?),
            TextForm::Sentencepiece => None,
        };
        let mut tokens: Vec<String> = get_strings(md, "tokenizer.ggml.tokens")?
            .into_iter()
            .map(String::from)
            .collect();
        // Ids are u32; checking once here makes the `as u32` casts exact.
        if u32::try_from(tokens.len()).is_err() {
            return Err(bad("tokenizer.ggml.tokens", "shorter than 2^32 entries"));
        }
        // As llama.cpp: an empty text would match everywhere.
        for (i, t) in tokens.iter_mut().enumerate() {
            if t.is_empty() {
                *t = format!("[EMPTY_{i}]");
            }
        }
        let types = get_token_types(md, tokens.len())?;
        let mut attrs: Vec<u16> = types.iter().map(|&t| special::attr_of_type(t)).collect();
        mark_control_by_text(md, &tokens, &mut attrs);
        let general_name = get_str(md, "general.name")?.unwrap_or_default();
        mark_strip_flags(general_name, &tokens, &mut attrs);

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
        let eom_id = id_key("tokenizer.ggml.eom_token_id")?;
        let unk_id = id_key("tokenizer.ggml.unknown_token_id")?;

        let (model, default_bos, default_space) = match &pre {
            Some(pre) => {
                let merges = get_strings(md, "tokenizer.ggml.merges")?
                    .iter()
                    .map(|rule| metadata::split_merge(rule))
                    .collect::<Result<Vec<_>, _>>()?;
                (
                    Model::Bpe(Box::new(bpe::Bpe::new(&tokens, merges, pre)?)),
                    pre.add_bos,
                    false,
                )
            }
            None => {
                let scores = get_scores(md, tokens.len())?;
                (
                    Model::Spm(Box::new(spm::Spm::new(&tokens, scores, unk_id))),
                    true,
                    true,
                )
            }
        };
        let add_bos = get_bool(md, "tokenizer.ggml.add_bos_token")?.unwrap_or(default_bos);
        let add_eos = get_bool(md, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        let add_space_prefix =
            get_bool(md, "tokenizer.ggml.add_space_prefix")?.unwrap_or(default_space);

        // Chat models end a turn with e.g. <|im_end|> or <|eot_id|> whichever
        // id the GGUF calls "eos"; stopping on that one only would let
        // generation run on past the others (llama.cpp's end-of-generation
        // set does the same).
        let mut eos_ids = Vec::new();
        let by_text = tokens
            .iter()
            .enumerate()
            .filter(|(_, t)| special::END_OF_GENERATION_TEXTS.contains(&t.as_str()))
            .map(|(i, _)| i as u32);
        for id in [eos_id, eot_id, eom_id]
            .into_iter()
            .flatten()
            .chain(by_text)
        {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }

        Ok(Self {
            model,
            specials: SpecialTokens::new(&tokens, &attrs),
            bytes: pieces::token_bytes(&tokens, &attrs, form),
            tokens,
            bos_id,
            eos_id,
            eos_ids,
            add_bos,
            add_eos,
            add_space_prefix,
        })
    }

    /// Encodes a prompt for the model: special-token texts become their ids
    /// and BOS is added when the metadata asks for it, but not a second time
    /// when the text already starts with it (chat templates often write it).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = self.encode_with(text, EncodeOptions::PROMPT)?;
        if self.add_bos && ids.len() >= 2 && self.bos_id.is_some_and(|b| ids[0] == b && ids[1] == b)
        {
            ids.remove(0);
        }
        Ok(ids)
    }

    /// Encodes `text` exactly as llama.cpp's `llama_tokenize(text,
    /// add_special, parse_special)`.
    pub fn encode_with(&self, text: &str, opts: EncodeOptions) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        let add_bos = opts.add_special && self.add_bos;
        if add_bos {
            out.extend(self.bos_id);
        }
        // SentencePiece prefixes a space to text at the start and after a
        // special token.
        let mut after_special = true;
        for fragment in self.specials.partition(text, opts.parse_special) {
            match (fragment, &self.model) {
                (Fragment::Token(id), _) => {
                    out.push(id);
                    after_special = true;
                }
                (Fragment::Text(t), Model::Bpe(bpe)) => bpe.tokenize(t, &mut out)?,
                (Fragment::Text(t), Model::Spm(spm)) => {
                    let mut escaped = String::with_capacity(t.len() + 3);
                    if self.add_space_prefix && after_special {
                        escaped.push('▁');
                    }
                    for c in t.chars() {
                        escaped.push(if c == ' ' { '▁' } else { c });
                    }
                    spm.tokenize(&escaped, &mut out);
                    after_special = false;
                }
            }
        }
        if opts.add_special && self.add_eos {
            out.extend(self.eos_id);
        }
        Ok(out)
    }

    /// The raw bytes token `id` adds to the output text: empty for control
    /// tokens and unknown ids. Not necessarily valid UTF-8 on its own: a
    /// character may span several tokens, so callers concatenate first.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], |b| b)
    }

    /// Decodes `ids` to text, replacing invalid UTF-8 with U+FFFD: the
    /// tokens' bytes concatenated, less the one space SentencePiece put
    /// before the first text (llama.cpp's `llama_detokenize` without special
    /// tokens and without its clean-up of spaces before punctuation).
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes: Vec<u8> = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let piece = self.token_bytes(id);
            let piece = match piece {
                [b' ', rest @ ..] if i == 0 && self.add_space_prefix => rest,
                _ => piece,
            };
            bytes.extend_from_slice(piece);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Every id that ends generation: the metadata's EOS, EOT and EOM ids
    /// plus the tokens llama.cpp's end-of-generation list names by text
    /// (`<|im_end|>`, `<|eot_id|>`, `<|endoftext|>`, ...).
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

    /// The token's text as stored in the GGUF (GPT-2 byte-level form, e.g.
    /// "Ġthe", or SentencePiece form, e.g. "▁the"), or None for an unknown id.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The BOS id from the metadata, if any.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Whether prompts get a BOS (`tokenizer.ggml.add_bos_token` or the
    /// vocabulary type's default).
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }
}

/// Gives the control attribute to tokens llama.cpp treats as control by
/// their text whatever their type: the end-of-generation texts, and the
/// fill-in-the-middle texts of roles the metadata names no id for. On
/// duplicate texts the last id is the one (llama.cpp's token_to_id).
fn mark_control_by_text(md: &metadata::Metadata, tokens: &[String], attrs: &mut [u16]) {
    let mut texts: Vec<&str> = special::END_OF_GENERATION_TEXTS.to_vec();
    for (keys, fim) in special::FIM_TEXTS {
        if !keys.iter().any(|k| md.contains_key(*k)) {
            texts.extend_from_slice(fim);
        }
    }
    let mut last: HashMap<&str, usize> = HashMap::new();
    for (i, t) in tokens.iter().enumerate() {
        if texts.contains(&t.as_str()) {
            last.insert(t, i);
        }
    }
    for i in last.into_values() {
        attrs[i] |= attr::CONTROL;
    }
}

/// llama.cpp's per-model strip flags: Phi-3's special tokens swallow the
/// whitespace after them, except <unk>, <s> and <|endoftext|>.
fn mark_strip_flags(general_name: &str, tokens: &[String], attrs: &mut [u16]) {
    let name = general_name.to_ascii_lowercase();
    if !(name.contains("phi-3") || name.contains("phi3")) {
        return;
    }
    let special = attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN;
    for (t, a) in tokens.iter().zip(attrs.iter_mut()) {
        if *a & special != 0 || t == "</s>" {
            *a |= attr::RSTRIP;
        }
    }
    for (t, a) in tokens.iter().zip(attrs.iter_mut()) {
        if matches!(t.as_str(), "<unk>" | "<s>" | "<|endoftext|>") {
            *a &= !attr::RSTRIP;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::{Value, VersionedMagic};
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
            error_with("tokenizer.ggml.model", string("rwkv")),
            E::UnsupportedModel(m) if m == "rwkv"
        ));
        assert!(matches!(
            error_with("tokenizer.ggml.pre", string("tekken")),
            E::UnsupportedPreTokenizer(p) if p == "tekken"
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
            E::Count {
                found: 1,
                tokens: 11,
                ..
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
}
