//! How many completion tokens a `Delta` delivers, read alike by every
//! client of the wire (the router, which reads deltas without decoding
//! them, through [`TokenCount::add_counts`]).
use crate::v1::Delta;

/// Counts the completion tokens of one stream's deltas as they arrive.
#[derive(Clone, Copy, Debug, Default)]
pub struct TokenCount {
    /// The last cumulative `usage.completion_tokens` seen.
    completion: u32,
    /// Tokens counted so far.
    total: u64,
}

impl TokenCount {
    /// The tokens `d` delivers: its token ids, or, from a worker whose
    /// engine sends none (an OpenAI-compatible upstream), the advance of its
    /// cumulative usage.
    pub fn add(&mut self, d: &Delta) -> u32 {
        self.add_counts(d.token_ids.len(), d.usage.map(|u| u.completion_tokens))
    }

    /// [`Self::add`] for a delta read without decoding it: its number of
    /// token ids and its usage's `completion_tokens`, if it has a usage.
    pub fn add_counts(&mut self, ids: usize, completion: Option<u32>) -> u32 {
        let counted = match completion {
            Some(c) if ids == 0 => c.saturating_sub(self.completion),
            _ => ids as u32,
        };
        if let Some(c) = completion {
            self.completion = c;
        }
        self.total += u64::from(counted);
        counted
    }

    /// Tokens counted so far.
    pub fn total(&self) -> u64 {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::Usage;

    fn delta(ids: &[u32], completion: Option<u32>) -> Delta {
        Delta {
            token_ids: ids.to_vec(),
            usage: completion.map(|completion_tokens| Usage {
                prompt_tokens: 3,
                completion_tokens,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn ids_count_where_sent_and_the_usage_where_not() {
        let mut with_ids = TokenCount::default();
        let counts: Vec<u32> = [
            delta(&[5], Some(1)),
            delta(&[6, 7], Some(3)),
            // A tail of held-back text: no ids, the usage unchanged.
            delta(&[], Some(3)),
        ]
        .iter()
        .map(|d| with_ids.add(d))
        .collect();
        assert_eq!(counts, [1, 2, 0]);
        let mut text_only = TokenCount::default();
        let counts: Vec<u32> = [
            delta(&[], Some(1)),
            delta(&[], Some(3)),
            delta(&[], None),
            delta(&[], Some(4)),
        ]
        .iter()
        .map(|d| text_only.add(d))
        .collect();
        assert_eq!(counts, [1, 2, 0, 1]);
        assert_eq!((with_ids.total(), text_only.total()), (3, 4));
    }
}
