//! Token attributes and the special-token split, as llama.cpp derives and
//! applies them (src/llama-vocab.cpp: `load`, `tokenizer_st_partition`).
//!
//! Before any BPE or SentencePiece runs, the input is cut at the texts of
//! user-defined tokens (always) and of control and unknown tokens (only when
//! special tokens are parsed), longest text first; each cut becomes that
//! token's id and only the text between cuts is tokenized.

/// llama.cpp's `llama_token_attr` bits (the ones this tokenizer reads).
pub(super) mod attr {
    pub const UNKNOWN: u16 = 1 << 0;
    pub const UNUSED: u16 = 1 << 1;
    pub const NORMAL: u16 = 1 << 2;
    pub const CONTROL: u16 = 1 << 3;
    pub const USER_DEFINED: u16 = 1 << 4;
    pub const BYTE: u16 = 1 << 5;
    pub const LSTRIP: u16 = 1 << 7;
    pub const RSTRIP: u16 = 1 << 8;
}

/// The attribute of a `tokenizer.ggml.token_type` value.
pub(super) fn attr_of_type(token_type: i32) -> u16 {
    match token_type {
        1 => attr::NORMAL,
        2 => attr::UNKNOWN,
        3 => attr::CONTROL,
        4 => attr::USER_DEFINED,
        5 => attr::UNUSED,
        6 => attr::BYTE,
        _ => 0,
    }
}

/// Token texts llama.cpp treats as ending generation, and so as control
/// tokens whatever type the file gives them (its end-of-generation list).
pub(super) const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
];

/// Fill-in-the-middle token texts llama.cpp also makes control tokens when
/// the metadata names no id for their role: (id keys, texts).
pub(super) const FIM_TEXTS: &[(&[&str], &[&str])] = &[
    (
        &[
            "tokenizer.ggml.fim_pre_token_id",
            "tokenizer.ggml.prefix_token_id",
        ],
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
    ),
    (
        &[
            "tokenizer.ggml.fim_suf_token_id",
            "tokenizer.ggml.suffix_token_id",
        ],
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
    ),
    (
        &[
            "tokenizer.ggml.fim_mid_token_id",
            "tokenizer.ggml.middle_token_id",
        ],
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
    ),
    (
        &["tokenizer.ggml.fim_pad_token_id"],
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    ),
    (
        &["tokenizer.ggml.fim_rep_token_id"],
        &[
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
        ],
    ),
    (&["tokenizer.ggml.fim_sep_token_id"], &["<|file_sep|>"]),
];

/// A piece of the input after the special-token split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fragment<'a> {
    /// Text still to be tokenized.
    Text(&'a str),
    /// A special token's id.
    Token(u32),
}

struct Special {
    id: u32,
    text: String,
    /// Control or unknown: matched only when special tokens are parsed.
    control: bool,
    lstrip: bool,
    rstrip: bool,
}

/// The tokens the input is split at, longest text first.
pub(super) struct SpecialTokens {
    list: Vec<Special>,
}

impl SpecialTokens {
    /// Collects the control, user-defined and unknown tokens of a vocabulary.
    pub fn new(texts: &[String], attrs: &[u16]) -> Self {
        let mut list: Vec<Special> = texts
            .iter()
            .zip(attrs)
            .enumerate()
            .filter(|(_, (text, a))| {
                !text.is_empty() && **a & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0
            })
            .map(|(id, (text, &a))| Special {
                id: id as u32,
                text: text.clone(),
                control: a & (attr::CONTROL | attr::UNKNOWN) != 0,
                lstrip: a & attr::LSTRIP != 0,
                rstrip: a & attr::RSTRIP != 0,
            })
            .collect();
        // Stable, so equally long texts keep id order.
        list.sort_by_key(|s| std::cmp::Reverse(s.text.len()));
        Self { list }
    }

    /// Splits `text` at special-token texts; control and unknown tokens only
    /// when `parse_special`.
    pub fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let mut fragments = Vec::new();
        if !text.is_empty() {
            fragments.push(Fragment::Text(text));
        }
        for special in &self.list {
            if special.control && !parse_special {
                continue;
            }
            if !fragments
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(special.text.as_str())))
            {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                match fragment {
                    Fragment::Text(t) => split_at_special(t, special, &mut next),
                    token => next.push(token),
                }
            }
            fragments = next;
        }
        fragments
    }
}

/// Cuts every occurrence of `special` out of `text`. Matches of valid UTF-8
/// in valid UTF-8 start and end on character boundaries, and the stripping
/// removes ASCII whitespace only, so every slice is on a boundary.
fn split_at_special<'a>(mut text: &'a str, special: &Special, out: &mut Vec<Fragment<'a>>) {
    while let Some(at) = text.find(special.text.as_str()) {
        let mut left = &text[..at];
        if special.lstrip {
            left = left.trim_end_matches(is_c_space);
        }
        if !left.is_empty() {
            out.push(Fragment::Text(left));
        }
        out.push(Fragment::Token(special.id));
        text = &text[at + special.text.len()..];
        if special.rstrip {
            text = text.trim_start_matches(is_c_space);
        }
    }
    if !text.is_empty() {
        out.push(Fragment::Text(text));
    }
}

/// C's `isspace` in the "C" locale, which llama.cpp strips with.
fn is_c_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specials(entries: &[(&str, u16)]) -> SpecialTokens {
        let texts: Vec<String> = entries.iter().map(|(t, _)| t.to_string()).collect();
        let attrs: Vec<u16> = entries.iter().map(|(_, a)| *a).collect();
        SpecialTokens::new(&texts, &attrs)
    }

    #[test]
    fn control_tokens_split_only_when_parsed() {
        use Fragment::{Text, Token};
        let s = specials(&[
            ("a", attr::NORMAL),
            ("<s>", attr::CONTROL),
            ("<tool>", attr::USER_DEFINED),
        ]);
        assert_eq!(
            s.partition("x<s>y<tool>z", true),
            [Text("x"), Token(1), Text("y"), Token(2), Text("z")]
        );
        assert_eq!(
            s.partition("x<s>y<tool>z", false),
            [Text("x<s>y"), Token(2), Text("z")]
        );
        assert_eq!(s.partition("", true), []);
        assert_eq!(s.partition("<tool><tool>", false), [Token(2), Token(2)]);
    }

    #[test]
    fn longer_texts_win_and_strip_flags_eat_spaces() {
        use Fragment::{Text, Token};
        let s = specials(&[
            ("<|a|>", attr::CONTROL),
            ("<|a|>b", attr::CONTROL),
            ("<r>", attr::USER_DEFINED | attr::RSTRIP),
            ("<l>", attr::USER_DEFINED | attr::LSTRIP),
        ]);
        assert_eq!(s.partition("<|a|>b<|a|>", true), [Token(1), Token(0)]);
        assert_eq!(
            s.partition("x <r> \n y  <l>z", false),
            [Text("x "), Token(2), Text("y"), Token(3), Text("z")]
        );
    }
}
