//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`): the `tokenizers` crate's
//! BPE over the GGUF vocabulary and merges, behind the pre-tokenizer of the
//! vocabulary's `tokenizer.ggml.pre`. Special tokens are split off before
//! this runs (see `special`), so it gets plain text only.
use super::pre::PreTokenizer;
use super::TokenizerError;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::Tokenizer;

pub(super) struct Bpe {
    inner: Tokenizer,
}

impl Bpe {
    /// Builds the BPE model. A merge naming a token the vocabulary lacks is
    /// an error (a corrupt vocabulary), not a silent skip.
    pub fn new(
        texts: &[String],
        merges: Vec<(String, String)>,
        pre: &PreTokenizer,
    ) -> Result<Self, TokenizerError> {
        // On duplicate texts the last id wins, as in llama.cpp's token_to_id.
        let vocab: Vocab = texts
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(pre.ignore_merges)
            .build()
            .map_err(TokenizerError::Build)?;
        let mut inner = Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre.build()?));
        Ok(Self { inner })
    }

    /// Appends the tokens of `text`.
    pub fn tokenize(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(TokenizerError::Encode)?;
        out.extend_from_slice(encoding.get_ids());
        Ok(())
    }
}
