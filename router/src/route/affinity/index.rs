//! The router's own approximate index of which worker holds which prompt
//! prefix: chunk hash -> the workers this router sent a prompt with that
//! chunk to, as the SGLang gateway and llm-d do without events from the
//! workers. It learns only from this router's own choices and never asks a
//! worker; it can be wrong (a worker evicted the blocks, another router
//! sent a prefix elsewhere), which costs a worse choice, never a wrong reply.
//!
//! Memory is bounded by `max_pairs` (chunk, worker) pairs: past it the
//! least recently used chunks go first. A worker that is forgotten (removed,
//! restarted, unhealthy) loses its holder id at once, so its entries never
//! match again; they are dropped when their chunk is next touched or aged out.
use lru::LruCache;
use std::collections::{HashMap, HashSet};

/// One worker incarnation in the index.
pub type Holder = u64;

/// Workers holding one chunk, sorted by holder id.
type Holders = Vec<Holder>;

/// The index of one router (all models and versions: the chunk hashes are
/// seeded by model and version).
pub struct PrefixIndex {
    chunks: LruCache<u64, Holders>,
    /// (chunk, worker) pairs held, dead holders included until dropped.
    pairs: usize,
    max_pairs: usize,
    /// Worker id -> (the fingerprint of its registration, its holder id).
    workers: HashMap<String, (u64, Holder)>,
    /// Pairs per holder, live or dead: a dead holder is gone once its count is.
    counts: HashMap<Holder, usize>,
    /// Forgotten holders that still have pairs.
    dead: HashSet<Holder>,
    next_holder: Holder,
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
            next_holder: 0,
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

    /// The holder id of worker `id` if the index knows this registration of
    /// it (`fingerprint`); a worker re-registered under the same id (a
    /// restart) is a new holder, whose cache starts empty.
    pub fn holder(&self, id: &str, fingerprint: u64) -> Option<Holder> {
        match self.workers.get(id) {
            Some(&(f, h)) if f == fingerprint => Some(h),
            _ => None,
        }
    }

    /// The holder id of worker `id`, made if need be.
    fn holder_or_new(&mut self, id: &str, fingerprint: u64) -> Holder {
        if let Some(h) = self.holder(id, fingerprint) {
            return h;
        }
        // A new registration: the old one's pairs are dead.
        self.forget(id);
        let h = self.next_holder;
        self.next_holder += 1;
        self.workers.insert(id.to_string(), (fingerprint, h));
        h
    }

    /// Forgets worker `id`: nothing it was sent counts any more.
    pub fn forget(&mut self, id: &str) {
        if let Some((_, h)) = self.workers.remove(id) {
            if self.counts.contains_key(&h) {
                self.dead.insert(h);
            }
        }
    }

    /// Books one pair of `h` fewer.
    fn unhold(&mut self, h: Holder) {
        self.pairs -= 1;
        if let Some(n) = self.counts.get_mut(&h) {
            *n -= 1;
            if *n == 0 {
                self.counts.remove(&h);
                self.dead.remove(&h);
            }
        }
    }

    /// How many leading `chunks` each of `holders` holds, by one walk over
    /// the chunks that stops at the first chunk none of them holds. Does not
    /// count as a use (the choice's [`PrefixIndex::record`] does).
    pub fn matched(&self, chunks: &[u64], holders: &[Option<Holder>], out: &mut Vec<usize>) {
        out.clear();
        out.resize(holders.len(), 0);
        for (i, chunk) in chunks.iter().enumerate() {
            let Some(held) = self.chunks.peek(chunk) else {
                return;
            };
            let mut any = false;
            for (c, h) in holders.iter().enumerate() {
                if let Some(h) = h {
                    if out[c] == i && held.binary_search(h).is_ok() {
                        out[c] = i + 1;
                        any = true;
                    }
                }
            }
            if !any {
                return;
            }
        }
    }

    /// Records that worker `id` (registration `fingerprint`) was sent a
    /// prompt made of `chunks`: it holds them now, most recently used.
    pub fn record(&mut self, id: &str, fingerprint: u64, chunks: &[u64]) {
        let h = self.holder_or_new(id, fingerprint);
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
        let mut gone = Vec::new();
        for chunk in chunks {
            if let Some(held) = self.chunks.peek_mut(chunk) {
                held.retain(|h| {
                    let dead = self.dead.contains(h);
                    if dead {
                        gone.push(*h);
                    }
                    !dead
                });
            }
        }
        for h in gone {
            self.unhold(h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holders(index: &PrefixIndex, ids: &[&str]) -> Vec<Option<Holder>> {
        ids.iter().map(|id| index.holder(id, 1)).collect()
    }

    fn matched(index: &PrefixIndex, chunks: &[u64], ids: &[&str]) -> Vec<usize> {
        let mut out = Vec::new();
        index.matched(chunks, &holders(index, ids), &mut out);
        out
    }

    #[test]
    fn each_worker_matches_the_leading_chunks_it_was_sent() {
        let mut index = PrefixIndex::new(1_000);
        index.record("a", 1, &[1, 2, 3, 4]);
        index.record("b", 1, &[1, 2, 9]);
        assert_eq!(
            matched(&index, &[1, 2, 3, 4, 5], &["a", "b", "c"]),
            [4, 2, 0]
        );
        // A chunk held after a gap does not count: the prefix ends at the gap.
        assert_eq!(matched(&index, &[1, 7, 3, 4], &["a", "b"]), [1, 1]);
        assert_eq!(matched(&index, &[8, 1, 2], &["a", "b"]), [0, 0]);
        assert_eq!(index.pairs(), 7);
        // Recording again adds nothing.
        index.record("a", 1, &[1, 2, 3, 4]);
        assert_eq!(index.pairs(), 7);
    }

    #[test]
    fn memory_is_bounded_and_the_oldest_chunks_go_first() {
        let mut index = PrefixIndex::new(10);
        index.record("a", 1, &[1, 2, 3, 4]);
        index.record("b", 1, &[1, 2]);
        index.record("a", 1, &[10, 11, 12, 13, 14]);
        // 11 pairs: chunk 3, the least recently used (b's record used 1
        // and 2 again), went.
        assert_eq!(index.pairs(), 10);
        assert_eq!(matched(&index, &[1, 2, 3, 4], &["a", "b"]), [2, 2]);
        assert_eq!(matched(&index, &[10, 11, 12, 13, 14], &["a"]), [5]);
        for i in 0..1_000u64 {
            index.record("c", 1, &[100 + i, 5_000 + i]);
            assert!(index.pairs() <= 10);
        }
        assert!(index.chunks() <= 10);
        // The most recent survive.
        assert_eq!(matched(&index, &[1_099, 5_999], &["c"]), [2]);
        assert_eq!(matched(&index, &[100, 5_000], &["c"]), [0]);
    }

    #[test]
    fn a_forgotten_or_restarted_worker_holds_nothing() {
        let mut index = PrefixIndex::new(1_000);
        index.record("a", 1, &[1, 2, 3]);
        index.record("b", 1, &[1, 2, 3]);
        index.forget("a");
        assert_eq!(matched(&index, &[1, 2, 3], &["a", "b"]), [0, 3]);
        // Its pairs are dropped as their chunks are touched.
        index.record("b", 1, &[1, 2, 3]);
        assert_eq!(index.pairs(), 3);
        // The same id under a new registration starts empty too.
        index.record("b", 1, &[4]);
        let mut out = Vec::new();
        index.matched(&[1, 2, 3], &[index.holder("b", 2)], &mut out);
        assert_eq!(out, [0]);
        index.record("b", 2, &[5]);
        index.matched(&[1, 2, 3], &[index.holder("b", 2)], &mut out);
        assert_eq!(out, [0]);
        // The old registration's pairs went as their chunks were touched or
        // aged out; here they are only dead, and go with their chunks.
        index.record("b", 2, &[1, 2, 3, 4]);
        assert_eq!(index.pairs(), 5);
        index.matched(&[5], &[index.holder("b", 2)], &mut out);
        assert_eq!(out, [1]);
    }
}
