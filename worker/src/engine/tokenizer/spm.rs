//! SentencePiece BPE (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral,
//! TinyLlama, Phi-3), as llama.cpp's `llm_tokenizer_spm` does it: start from
//! single characters, repeatedly merge the adjacent pair whose concatenation
//! is the highest-scoring token (leftmost on ties), and spell whatever is not
//! a token at the end as byte tokens `<0xXX>`.
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// The vocabulary as the merge loop needs it.
pub(super) struct Spm {
    /// Token text to id; on duplicate texts the last id wins, as in llama.cpp.
    ids: HashMap<String, u32>,
    /// Merge priority of each id.
    scores: Vec<f32>,
    /// The token for each byte (`<0xXX>`, else the byte as a one-character
    /// token), for characters no token covers.
    byte_ids: [Option<u32>; 256],
    /// Emitted for a byte that has no token either (llama.cpp would throw).
    unk_id: Option<u32>,
}

/// A span of the text; `len == 0` once merged into its left neighbour.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of `left` with the symbol after it.
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    /// Byte length of the merged text; a stale entry no longer matches it.
    size: usize,
}

impl Ord for Bigram {
    /// Higher score first, then the leftmost (llama.cpp's comparator). NaN
    /// scores compare equal, as C++'s `<` leaves them.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .partial_cmp(&other.score)
            .unwrap_or(Ordering::Equal)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

impl Spm {
    /// Indexes `texts` (already with empty texts replaced) and their scores.
    pub fn new(texts: &[String], scores: Vec<f32>, unk_id: Option<u32>) -> Self {
        let ids: HashMap<String, u32> = texts
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            *slot = ids.get(&hex).copied().or_else(|| {
                // A one-byte string is only valid UTF-8 (and so a possible
                // token text) for ASCII.
                (b < 0x80)
                    .then(|| ids.get(&char::from(b as u8).to_string()).copied())
                    .flatten()
            });
        }
        Self {
            ids,
            scores,
            byte_ids,
            unk_id,
        }
    }

    /// Appends the tokens of `text` (spaces already escaped as "▁").
    pub fn tokenize(&self, text: &str, out: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            let len = c.len_utf8();
            symbols.push(Symbol {
                start,
                len,
                prev: i.checked_sub(1),
                next: (start + len < text.len()).then_some(i + 1),
            });
        }
        let mut queue = BinaryHeap::new();
        for i in 1..symbols.len() {
            self.push_bigram(text, &symbols, i - 1, i, &mut queue);
        }
        while let Some(bigram) = queue.pop() {
            let (left, right) = (symbols[bigram.left], symbols[bigram.right]);
            // Skip pairs one side of which was merged away since.
            if left.len == 0 || right.len == 0 || left.len + right.len != bigram.size {
                continue;
            }
            symbols[bigram.left].len += right.len;
            symbols[bigram.right].len = 0;
            symbols[bigram.left].next = right.next;
            if let Some(next) = right.next {
                symbols[next].prev = Some(bigram.left);
            }
            if let Some(prev) = left.prev {
                self.push_bigram(text, &symbols, prev, bigram.left, &mut queue);
            }
            if let Some(next) = right.next {
                self.push_bigram(text, &symbols, bigram.left, next, &mut queue);
            }
        }
        let mut at = (!symbols.is_empty()).then_some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                // Only a single character can be left without a token (every
                // merge makes one), so llama.cpp's re-segmentation of merged
                // pieces never applies: spell it in bytes.
                None => out.extend(
                    piece
                        .bytes()
                        .filter_map(|b| self.byte_ids[usize::from(b)].or(self.unk_id)),
                ),
            }
            at = s.next;
        }
    }

    fn push_bigram(
        &self,
        text: &str,
        symbols: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Bigram>,
    ) {
        let (l, r) = (symbols[left], symbols[right]);
        let merged = &text[l.start..r.start + r.len];
        if let Some(&id) = self.ids.get(merged) {
            queue.push(Bigram {
                left,
                right,
                score: self.scores.get(id as usize).copied().unwrap_or(0.0),
                size: merged.len(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spm(entries: &[(&str, f32)]) -> Spm {
        let texts: Vec<String> = entries.iter().map(|(t, _)| t.to_string()).collect();
        let scores = entries.iter().map(|(_, s)| *s).collect();
        Spm::new(&texts, scores, None)
    }

    #[test]
    fn highest_score_merges_first_and_bytes_fill_gaps() {
        let mut entries: Vec<(String, f32)> =
            (0..=255u8).map(|b| (format!("<0x{b:02X}>"), 0.0)).collect();
        entries.extend(
            [
                ("▁", -1.0),
                ("a", -1.0),
                ("b", -1.0),
                ("▁a", -2.0),
                ("ab", -0.5),
                ("▁ab", -3.0),
            ]
            .map(|(t, s)| (t.to_string(), s)),
        );
        let borrowed: Vec<(&str, f32)> = entries.iter().map(|(t, s)| (t.as_str(), *s)).collect();
        let t = spm(&borrowed);
        let id = |s: &str| entries.iter().position(|(t, _)| t == s).unwrap() as u32;
        let mut out = Vec::new();
        // "ab" (-0.5) beats "▁a" (-2), then "▁"+"ab" makes "▁ab".
        t.tokenize("▁ab", &mut out);
        assert_eq!(out, [id("▁ab")]);
        out.clear();
        // "é" has no token: its two UTF-8 bytes.
        t.tokenize("aé", &mut out);
        assert_eq!(out, [id("a"), 0xC3, 0xA9]);
        out.clear();
        t.tokenize("", &mut out);
        assert!(out.is_empty());
    }
}
