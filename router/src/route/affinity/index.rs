//! The router's own approximate index of which worker holds which prompt
//! prefix: chunk hash -> the workers this router sent a prompt with that
//! chunk to, as the SGLang gateway and llm-d do without events from the
//! workers. It learns only from this router's own choices and never asks a
//! worker; it can be wrong (a worker evicted the blocks, another router
//! sent a prefix elsewhere), which costs a worse choice, never a wrong reply.
//!
//! Memory is bounded by `max_pairs` (chunk, worker) pairs: past it the
//! least recently used chunks go first. The caller names each worker's
//! cache (a holder): a worker recorded under a new name (restarted, or back
//! from a spell of unhealthiness) starts empty, and its old name's pairs
//! never match again; they are dropped when their chunk is next touched or
//! aged out.
//!
//! A decision reads little of it: the conversation's own worker's depth
//! (one binary search per chunk) and the holders of one chunk, so its cost
//! does not grow with the number of workers that share a system prompt.
use lru::LruCache;
use std::collections::{HashMap, HashSet};

/// One worker's cache as the index names it: its registration and its
/// spells of unhealthiness, hashed (the caller's choice of name); a new
/// name for the same worker id starts empty.
pub type Holder = u64;

/// Workers holding one chunk, sorted by holder.
type Holders = Vec<Holder>;

/// The index of one router (all models and versions: the chunk hashes are
/// seeded by model and version).
pub struct PrefixIndex {
    chunks: LruCache<u64, Holders>,
    /// (chunk, worker) pairs held, dead holders included until dropped.
    pairs: usize,
    max_pairs: usize,
    /// Worker id -> the holder it was last recorded under.
    workers: HashMap<String, Holder>,
    /// Pairs per holder, live or dead: a holder is gone once its count is.
    counts: HashMap<Holder, usize>,
    /// Replaced holders that still have pairs.
    dead: HashSet<Holder>,
    /// Holders whose last pair went since [`PrefixIndex::take_gone`].
    gone: Vec<Holder>,
}

impl PrefixIndex {
    /// An empty index of at most `max_pairs` (chunk, worker) pairs.
    pub fn new(max_pairs: usize) -> Self {
        Self {
            chunks: LruCache::unbounded(),
            pairs: 0,
            max_pairs: max_pairs.max(1),
            workers: HashMap::new(),
            counts: HashMap::new(),
            dead: HashSet::new(),
            gone: Vec::new(),
        }
    }

    /// (chunk, worker) pairs held now.
    pub fn pairs(&self) -> usize {
        self.pairs
    }

    /// Chunks held now.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// The holders of `chunk`, sorted (dead ones may be among them). Does
    /// not count as a use.
    pub fn holders_of(&self, chunk: u64) -> &[Holder] {
        self.chunks.peek(&chunk).map_or(&[], |h| h.as_slice())
    }

    /// How many leading `chunks` holder `h` holds: one binary search per
    /// chunk, stopping at the first it lacks. Does not count as a use (the
    /// choice's [`PrefixIndex::record`] does).
    pub fn depth(&self, chunks: &[u64], h: Holder) -> usize {
        if self.dead.contains(&h) {
            return 0;
        }
        chunks
            .iter()
            .take_while(|c| {
                self.chunks
                    .peek(c)
                    .is_some_and(|held| held.binary_search(&h).is_ok())
            })
            .count()
    }

    /// Holders whose last pair went (aged out, or dropped as dead) since the
    /// last call, for the caller to forget what it keeps about them.
    pub fn take_gone(&mut self) -> Vec<Holder> {
        std::mem::take(&mut self.gone)
    }

    /// Books one pair of `h` fewer.
    fn unhold(&mut self, h: Holder) {
        self.pairs -= 1;
        if let Some(n) = self.counts.get_mut(&h) {
            *n -= 1;
            if *n == 0 {
                self.counts.remove(&h);
                self.dead.remove(&h);
                self.gone.push(h);
            }
        }
    }

    /// Records that worker `id`, as holder `h`, was sent a prompt made of
    /// `chunks`: it holds them now, most recently used. A worker recorded
    /// before under another holder (a restart, a spell of unhealthiness)
    /// held nothing that still counts.
    pub fn record(&mut self, id: &str, h: Holder, chunks: &[u64]) {
        match self.workers.get_mut(id) {
            Some(old) if *old == h => {}
            Some(old) => {
                let old = std::mem::replace(old, h);
                if self.counts.contains_key(&old) {
                    self.dead.insert(old);
                }
            }
            None => {
                self.workers.insert(id.to_string(), h);
            }
        }
        self.dead.remove(&h);
        for &chunk in chunks {
            match self.chunks.get_mut(&chunk) {
                Some(held) => match held.binary_search(&h) {
                    Ok(_) => continue,
                    Err(at) => held.insert(at, h),
                },
                None => {
                    self.chunks.put(chunk, vec![h]);
                }
            }
            self.pairs += 1;
            *self.counts.entry(h).or_default() += 1;
        }
        self.purge(chunks);
        // Chunks just recorded are the most recent: the oldest go first.
        while self.pairs > self.max_pairs {
            let Some((_, held)) = self.chunks.pop_lru() else {
                break;
            };
            for h in held {
                self.unhold(h);
            }
        }
    }

    /// Drops the dead holders of `chunks`.
    fn purge(&mut self, chunks: &[u64]) {
        if self.dead.is_empty() {
            return;
        }
        let mut dropped = Vec::new();
        for chunk in chunks {
            if let Some(held) = self.chunks.peek_mut(chunk) {
                held.retain(|h| {
                    let dead = self.dead.contains(h);
                    if dead {
                        dropped.push(*h);
                    }
                    !dead
                });
            }
        }
        for h in dropped {
            self.unhold(h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depths(index: &PrefixIndex, chunks: &[u64], holders: &[Holder]) -> Vec<usize> {
        holders.iter().map(|&h| index.depth(chunks, h)).collect()
    }

    #[test]
    fn each_worker_matches_the_leading_chunks_it_was_sent() {
        let mut index = PrefixIndex::new(1_000);
        index.record("a", 10, &[1, 2, 3, 4]);
        index.record("b", 20, &[1, 2, 9]);
        assert_eq!(depths(&index, &[1, 2, 3, 4, 5], &[10, 20, 30]), [4, 2, 0]);
        // A chunk held after a gap does not count: the prefix ends at the gap.
        assert_eq!(depths(&index, &[1, 7, 3, 4], &[10, 20]), [1, 1]);
        assert_eq!(depths(&index, &[8, 1, 2], &[10, 20]), [0, 0]);
        assert_eq!(index.holders_of(2), [10, 20]);
        assert_eq!(index.holders_of(9), [20]);
        assert!(index.holders_of(77).is_empty());
        assert_eq!(index.pairs(), 7);
        // Recording again adds nothing.
        index.record("a", 10, &[1, 2, 3, 4]);
        assert_eq!(index.pairs(), 7);
    }

    #[test]
    fn memory_is_bounded_and_the_oldest_chunks_go_first() {
        let mut index = PrefixIndex::new(10);
        index.record("a", 1, &[1, 2, 3, 4]);
        index.record("b", 2, &[1, 2]);
        index.record("a", 1, &[10, 11, 12, 13, 14]);
        // 11 pairs: chunk 3, the least recently used (b's record used 1
        // and 2 again), went.
        assert_eq!(index.pairs(), 10);
        assert_eq!(depths(&index, &[1, 2, 3, 4], &[1, 2]), [2, 2]);
        assert_eq!(depths(&index, &[10, 11, 12, 13, 14], &[1]), [5]);
        for i in 0..1_000u64 {
            index.record("c", 3, &[100 + i, 5_000 + i]);
            assert!(index.pairs() <= 10);
        }
        assert!(index.chunks() <= 10);
        // The most recent survive.
        assert_eq!(depths(&index, &[1_099, 5_999], &[3]), [2]);
        assert_eq!(depths(&index, &[100, 5_000], &[3]), [0]);
        // a and b aged out entirely; c never did.
        let gone = index.take_gone();
        assert!(
            gone.contains(&1) && gone.contains(&2) && !gone.contains(&3),
            "{gone:?}"
        );
        assert!(index.take_gone().is_empty());
    }

    #[test]
    fn a_worker_under_a_new_holder_holds_nothing_and_its_old_pairs_go() {
        let mut index = PrefixIndex::new(1_000);
        index.record("a", 1, &[1, 2, 3]);
        index.record("b", 2, &[1, 2, 3]);
        // a restarted (or was unhealthy): it is holder 11 now.
        index.record("a", 11, &[4]);
        assert_eq!(depths(&index, &[1, 2, 3], &[1, 11, 2]), [0, 0, 3]);
        assert_eq!(index.pairs(), 7);
        // Its old pairs are dropped as their chunks are touched.
        index.record("b", 2, &[1, 2]);
        assert_eq!(index.pairs(), 5);
        assert!(index.take_gone().is_empty());
        index.record("b", 2, &[3]);
        assert_eq!(index.pairs(), 4);
        assert_eq!(index.take_gone(), [1]);
        index.record("a", 11, &[1, 2, 3, 4]);
        assert_eq!(depths(&index, &[1, 2, 3, 4], &[11]), [4]);
    }
}
