//! The bytes each token adds to the output text, as llama.cpp's
//! `token_to_piece` with `special = false` gives them: control and unknown
//! tokens print nothing, user-defined ones their text, byte tokens their
//! byte, ordinary ones their text decoded (GPT-2's byte-to-character mapping
//! undone for byte-level BPE, "▁" back to a space for SentencePiece).
use super::special::attr;
use std::collections::HashMap;

/// How ordinary token texts are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TextForm {
    /// GPT-2 byte-level: each byte one printable character.
    ByteLevel,
    /// SentencePiece: UTF-8 with "▁" for a space.
    Sentencepiece,
}

/// The output bytes of every token, indexed by id.
pub(super) fn token_bytes(texts: &[String], attrs: &[u16], form: TextForm) -> Vec<Box<[u8]>> {
    let byte_of = unicode_to_byte();
    texts
        .iter()
        .zip(attrs)
        .map(|(text, &a)| -> Box<[u8]> {
            if a & (attr::CONTROL | attr::UNKNOWN) != 0 {
                Box::default()
            } else if a & attr::USER_DEFINED != 0 {
                text.as_bytes().into()
            } else if a & attr::NORMAL != 0 {
                match form {
                    TextForm::ByteLevel => byte_level_decode(text, &byte_of),
                    TextForm::Sentencepiece => text.replace('▁', " ").into_bytes().into(),
                }
            } else if a & attr::BYTE != 0 {
                hex_byte(text).map_or_else(Box::default, |b| Box::new([b]) as Box<[u8]>)
            } else {
                // Unused and undefined tokens.
                Box::default()
            }
        })
        .collect()
}

/// The byte of a `<0xXX>` token; None for any other text.
fn hex_byte(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// The inverse of GPT-2's `bytes_to_unicode`: printable Latin-1 bytes stand
/// for themselves and the other 68 bytes were moved, in order, to U+0100...
pub(super) fn unicode_to_byte() -> HashMap<char, u8> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_covers_all_bytes() {
        let table = unicode_to_byte();
        assert_eq!(table.len(), 256);
        assert_eq!(table[&'Ġ'], b' ');
        assert_eq!(table[&'Ċ'], b'\n');
    }

    #[test]
    fn pieces_follow_the_token_kind() {
        let texts: Vec<String> = ["<s>", "▁Hi", "<0x0A>", "<tool>", "<0xZZ>", "x"]
            .map(String::from)
            .to_vec();
        let attrs = [
            attr::CONTROL,
            attr::NORMAL,
            attr::BYTE,
            attr::USER_DEFINED,
            attr::BYTE,
            attr::UNUSED,
        ];
        let spm = token_bytes(&texts, &attrs, TextForm::Sentencepiece);
        let got: Vec<&[u8]> = spm.iter().map(|b| &b[..]).collect();
        assert_eq!(got, [&b""[..], b" Hi", b"\n", b"<tool>", b"", b""]);
        let bpe = token_bytes(&["Ġa".to_string()], &[attr::NORMAL], TextForm::ByteLevel);
        assert_eq!(&bpe[0][..], b" a");
    }
}
