//! Pre-tokenizers of byte-level BPE vocabularies, by `tokenizer.ggml.pre`:
//! the split regexes llama.cpp applies (src/llama-vocab.cpp,
//! `llm_tokenizer_bpe`), each splitting every piece the previous one left,
//! matches and the text between them alike, before bytes are mapped to
//! GPT-2's printable characters.
use super::TokenizerError;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

/// GPT-2's split rule (contractions, letters, digits, other, whitespace).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's rule; llama.cpp spells the case-insensitive contractions out
/// (`[sS]`), which also keeps Unicode case folding (`ſ` ~ `s`) out of them.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's rule: Llama 3's with single digits.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 3.5's rule: Qwen 2's with combining marks kept in words.
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The CJK ranges DeepSeek's tokenizers keep together.
const DEEPSEEK_CJK: &str = "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+";

/// DeepSeek LLM's letter class, as its tokenizer.json spells it.
const DEEPSEEK_LLM_LETTERS: &str = "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+";

/// How one family of vocabularies pre-tokenizes, and the defaults llama.cpp
/// gives it.
#[derive(Debug, Clone, Copy)]
pub(super) struct PreTokenizer {
    /// The split regexes, applied in order.
    pub regexes: &'static [&'static str],
    /// A piece that is itself a token is not merged from its characters
    /// (llama.cpp's `ignore_merges`, Llama 3 style vocabularies).
    pub ignore_merges: bool,
    /// Whether BOS is added when `tokenizer.ggml.add_bos_token` is absent.
    pub add_bos: bool,
}

/// The `tokenizer.ggml.pre` values this worker accepts, grouped as llama.cpp
/// groups them; named in the error for any other value.
pub(super) const SUPPORTED: &str = "llama-bpe (llama3, llama-v3, falcon3, falcon-h1, pixtral, \
     midm-2.0, lfm2), dbrx, smaug-bpe, qwen2 (deepseek-r1-qwen, kormo, megrez, stablelm2, \
     hunyuan, solar-open), qwen35, deepseek-llm, deepseek-coder, falcon, starcoder, refact, \
     command-r, smollm, codeshell, exaone, minerva-7b, gpt-2 (phi-2, mpt, olmo, jais, \
     exaone4, trillion, granite-docling, gigachat, a.x-4.0, mellum), default";

impl PreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` value (absent: llama.cpp's
    /// `default`).
    pub fn for_name(pre: Option<&str>) -> Result<Self, TokenizerError> {
        let plain = |regexes| Self {
            regexes,
            ignore_merges: false,
            add_bos: false,
        };
        Ok(match pre.unwrap_or("default") {
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
            | "midm-2.0" | "lfm2" => Self {
                regexes: &[LLAMA3],
                ignore_merges: true,
                add_bos: true,
            },
            "dbrx" | "smaug-bpe" => plain(&[LLAMA3]),
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "megrez" | "stablelm2" | "hunyuan"
            | "solar-open" => plain(&[QWEN2]),
            "qwen35" => plain(&[QWEN35]),
            "deepseek-llm" => plain(&[
                "[\r\n]",
                DEEPSEEK_LLM_LETTERS,
                "\\s?[!-/:-~\u{ff01}-\u{ff0f}\u{ff1a}-\u{ff5e}\u{2018}-\u{201f}\u{3000}-\u{3002}]+",
                "\\s+$",
                DEEPSEEK_CJK,
                r"\p{N}+",
            ]),
            "deepseek-coder" => {
                plain(&["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"])
            }
            "falcon" => plain(&[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"]),
            "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone"
            | "minerva-7b" => plain(&[r"\p{N}", GPT2]),
            "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "exaone4" | "trillion"
            | "granite-docling" | "gigachat" | "a.x-4.0" | "mellum" => plain(&[GPT2]),
            "default" => plain(&[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]),
            other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
        })
    }

    /// The Hugging Face pre-tokenizer: each regex as an isolating split, then
    /// the byte-to-character mapping with no regex of its own.
    pub fn build(&self) -> Result<PreTokenizerWrapper, TokenizerError> {
        let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(self.regexes.len() + 1);
        for re in self.regexes {
            let split = Split::new(
                SplitPattern::Regex((*re).to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(TokenizerError::Build)?;
            steps.push(split.into());
        }
        // add_prefix_space=false: llama.cpp encodes the text exactly as given.
        steps.push(ByteLevel::new(false, true, false).into());
        Ok(Sequence::new(steps).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_regex_compiles() {
        for name in [
            "llama-bpe",
            "dbrx",
            "qwen2",
            "qwen35",
            "deepseek-llm",
            "deepseek-coder",
            "falcon",
            "smollm",
            "gpt-2",
            "default",
        ] {
            let pre = PreTokenizer::for_name(Some(name)).unwrap();
            pre.build().unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        assert!(PreTokenizer::for_name(None).is_ok());
    }

    #[test]
    fn unknown_names_are_refused_by_name() {
        let err = PreTokenizer::for_name(Some("tekken")).unwrap_err();
        assert!(matches!(&err, TokenizerError::UnsupportedPreTokenizer(p) if p == "tekken"));
        assert!(err.to_string().contains("llama-bpe"), "{err}");
    }
}
