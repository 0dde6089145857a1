//! Turns a stream of token bytes into text deltas that are always valid UTF-8
//! and stops on stop strings.
//!
//! Two things are held back until they resolve: bytes of a character split
//! across tokens, and text that could be the start of a stop string (so that a
//! stop string is never partly sent before it matches).

/// What one token released.
#[derive(Debug, Default, PartialEq)]
pub struct Released {
    /// Text that is now final and can be sent.
    pub text: String,
    /// The stop string that matched, if any: the sequence ends here and the
    /// stop string itself is not part of `text`.
    pub stop: Option<String>,
}

/// Incremental decoder for one sequence.
#[derive(Debug, Default)]
pub struct TextStream {
    stops: Vec<String>,
    /// Bytes of an incomplete UTF-8 character.
    pending: Vec<u8>,
    /// Decoded text not yet released because it may begin a stop string.
    held: String,
}

impl TextStream {
    /// A decoder that ends on any of `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            ..Default::default()
        }
    }

    /// Feeds one token's bytes.
    pub fn push(&mut self, bytes: &[u8]) -> Released {
        self.pending.extend_from_slice(bytes);
        let decoded = take_valid_utf8(&mut self.pending);
        self.held.push_str(&decoded);
        if let Some((at, stop)) = self.find_stop() {
            let text = self.held[..at].to_string();
            self.held.clear();
            self.pending.clear();
            return Released {
                text,
                stop: Some(stop),
            };
        }
        let keep = self.stop_prefix_len();
        let cut = self.held.len() - keep;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        Released { text, stop: None }
    }

    /// Releases whatever is still held when the sequence ends for another
    /// reason; incomplete bytes become U+FFFD.
    pub fn finish(&mut self) -> String {
        let mut out = std::mem::take(&mut self.held);
        if !self.pending.is_empty() {
            out.push_str(&String::from_utf8_lossy(&self.pending));
            self.pending.clear();
        }
        out
    }

    fn find_stop(&self) -> Option<(usize, String)> {
        self.stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|i| (i, s.clone())))
            .min_by_key(|(i, _)| *i)
    }

    /// Length of the longest suffix of `held` that is a proper prefix of a
    /// stop string, on a character boundary.
    fn stop_prefix_len(&self) -> usize {
        let mut best = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > best && self.held.ends_with(&s[..i]) {
                    best = i;
                }
            }
        }
        best
    }
}

/// Removes and returns the longest decodable prefix of `buf`. Bytes that can
/// never be valid become U+FFFD; an incomplete trailing character stays.
fn take_valid_utf8(buf: &mut Vec<u8>) -> String {
    let mut out = String::new();
    loop {
        match std::str::from_utf8(buf) {
            Ok(s) => {
                out.push_str(s);
                buf.clear();
                return out;
            }
            Err(e) => {
                let good = e.valid_up_to();
                // The prefix was just checked, so this cannot fail.
                out.push_str(std::str::from_utf8(&buf[..good]).unwrap_or_default());
                match e.error_len() {
                    None => {
                        buf.drain(..good);
                        return out;
                    }
                    Some(bad) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        buf.drain(..good + bad);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_multibyte_character_is_held_until_complete() {
        let mut s = TextStream::new(vec![]);
        let bytes = "é!".as_bytes();
        assert_eq!(s.push(&bytes[..1]).text, "");
        assert_eq!(s.push(&bytes[1..]).text, "é!");
        let emoji = "🙂".as_bytes();
        for b in &emoji[..3] {
            assert_eq!(s.push(&[*b]).text, "");
        }
        assert_eq!(s.push(&emoji[3..]).text, "🙂");
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut s = TextStream::new(vec![]);
        assert_eq!(s.push(&[b'a', 0xff, b'b']).text, "a\u{fffd}b");
        assert_eq!(s.push(&[0xe6]).text, "");
        assert_eq!(s.finish(), "\u{fffd}");
    }

    #[test]
    fn stop_string_across_tokens_is_never_sent() {
        let mut s = TextStream::new(vec!["\n\nUser:".into()]);
        assert_eq!(s.push(b"Hello").text, "Hello");
        assert_eq!(s.push(b"\n").text, "");
        assert_eq!(s.push(b"\nUs").text, "");
        let r = s.push(b"er: hi");
        assert_eq!(r.text, "");
        assert_eq!(r.stop.as_deref(), Some("\n\nUser:"));
    }

    #[test]
    fn false_start_of_a_stop_string_is_released() {
        let mut s = TextStream::new(vec!["END".into()]);
        assert_eq!(s.push(b"the E").text, "the ");
        assert_eq!(s.push(b"N").text, "");
        assert_eq!(s.push(b"D").stop.as_deref(), Some("END"));
        let mut s = TextStream::new(vec!["END".into()]);
        s.push(b"E");
        assert_eq!(s.push(b"x").text, "Ex");
        s.push(b"EN");
        assert_eq!(s.finish(), "EN");
    }

    #[test]
    fn earliest_stop_wins_and_text_before_it_is_kept() {
        let mut s = TextStream::new(vec!["b".into(), "a".into()]);
        let r = s.push(b"xxab");
        assert_eq!(r.text, "xx");
        assert_eq!(r.stop.as_deref(), Some("a"));
    }
}
