//! Automatic prefix caching's index: which pool blocks hold a full block of
//! known tokens, and which of those no sequence holds any more, oldest
//! release first.
//!
//! A full block is named by a hash chained over the previous block's hash and
//! its own token ids, so equal hashes mean equal tokens at equal positions
//! after an equal prefix: equal keys and values. The chain starts from a seed
//! of the model's identity (file digest and version), so blocks of different
//! models never match, also where hashes are compared across workers.
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};

/// The name of a full KV block: sha256, truncated to 128 bits, of the
/// previous block's name and this block's token ids (little-endian u32).
/// 128 bits keep collisions (which would serve wrong keys and values)
/// out of reach at any pool size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 16]);

impl BlockHash {
    /// The start of every chain for one model: a hash of its identity.
    pub fn seed(identity: &str) -> Self {
        Self::of(
            Sha256::new()
                .chain_update(b"tokenmesh-kv-prefix-v1\0")
                .chain_update(identity),
        )
    }

    /// The name of the block of `tokens` that follows the block named `self`.
    pub fn next(&self, tokens: &[u32]) -> Self {
        let mut h = Sha256::new().chain_update(self.0);
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        Self::of(h)
    }

    fn of(h: Sha256) -> Self {
        let mut out = [0u8; 16];
        out.copy_from_slice(&h.finalize()[..16]);
        Self(out)
    }
}

/// Registered blocks by hash, and the unreferenced ones in release order.
#[derive(Debug)]
pub(super) struct PrefixIndex {
    seed: BlockHash,
    by_hash: HashMap<BlockHash, u32>,
    /// Per block: its name while registered.
    hash_of: Vec<Option<BlockHash>>,
    /// Registered blocks no sequence holds, by release tick: the first is
    /// the least recently used, evicted first.
    idle: BTreeMap<u64, u32>,
    /// Per block: its key in `idle` while there.
    idle_at: Vec<Option<u64>>,
    tick: u64,
    evicted: u64,
}

impl PrefixIndex {
    /// An empty index over `blocks` blocks for the model `identity` names.
    pub(super) fn new(identity: &str, blocks: usize) -> Self {
        Self {
            seed: BlockHash::seed(identity),
            by_hash: HashMap::new(),
            hash_of: vec![None; blocks],
            idle: BTreeMap::new(),
            idle_at: vec![None; blocks],
            tick: 0,
            evicted: 0,
        }
    }

    /// The hash every chain starts from.
    pub(super) fn seed(&self) -> BlockHash {
        self.seed
    }

    /// The block registered under `hash`.
    pub(super) fn lookup(&self, hash: &BlockHash) -> Option<u32> {
        self.by_hash.get(hash).copied()
    }

    /// Whether `block` is registered.
    pub(super) fn is_registered(&self, block: u32) -> bool {
        self.hash_of[block as usize].is_some()
    }

    /// Registers a held block whose keys and values are written. A name
    /// already registered keeps its block (two sequences computed the same
    /// prefix at once): this one stays private and is freed as usual.
    pub(super) fn register(&mut self, block: u32, hash: BlockHash) {
        debug_assert!(self.idle_at[block as usize].is_none(), "only held blocks");
        if self.hash_of[block as usize].is_some() || self.by_hash.contains_key(&hash) {
            return;
        }
        self.by_hash.insert(hash, block);
        self.hash_of[block as usize] = Some(hash);
    }

    /// A registered block the last sequence let go: it waits for reuse, the
    /// newest release last in line for eviction.
    pub(super) fn park(&mut self, block: u32) {
        debug_assert!(self.is_registered(block));
        self.tick += 1;
        self.idle.insert(self.tick, block);
        self.idle_at[block as usize] = Some(self.tick);
    }

    /// An idle block a sequence takes up again; no-op when it is held.
    pub(super) fn unpark(&mut self, block: u32) {
        if let Some(at) = self.idle_at[block as usize].take() {
            self.idle.remove(&at);
        }
    }

    /// Unregisters the least recently used idle block and returns it, empty.
    pub(super) fn evict_oldest(&mut self) -> Option<u32> {
        let (_, block) = self.idle.pop_first()?;
        self.idle_at[block as usize] = None;
        if let Some(hash) = self.hash_of[block as usize].take() {
            self.by_hash.remove(&hash);
        }
        self.evicted += 1;
        Some(block)
    }

    /// Registered blocks no sequence holds.
    pub(super) fn idle(&self) -> usize {
        self.idle.len()
    }

    /// Blocks evicted since start.
    pub(super) fn evicted(&self) -> u64 {
        self.evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_depends_on_the_model_the_tokens_and_everything_before() {
        let (a, b) = (BlockHash::seed("sha-a:v1"), BlockHash::seed("sha-b:v1"));
        assert_ne!(a, b, "two models");
        assert_ne!(a, BlockHash::seed("sha-a:v2"), "two versions");
        assert_eq!(
            a.next(&[1, 2, 3]),
            BlockHash::seed("sha-a:v1").next(&[1, 2, 3])
        );
        assert_ne!(a.next(&[1, 2, 3]), b.next(&[1, 2, 3]));
        assert_ne!(a.next(&[1, 2, 3]), a.next(&[1, 2, 4]));
        // The same block after different prefixes has different names.
        let x = a.next(&[1, 2, 3]);
        let y = a.next(&[9, 9, 9]);
        assert_ne!(x.next(&[4, 5, 6]), y.next(&[4, 5, 6]));
        // Token boundaries count: [1, 2] then [3] is not [1] then [2, 3].
        assert_ne!(a.next(&[1, 2]).next(&[3]), a.next(&[1]).next(&[2, 3]));
    }

    #[test]
    fn idle_blocks_are_evicted_oldest_release_first() {
        let mut ix = PrefixIndex::new("m", 4);
        let seed = BlockHash::seed("m");
        let h = |i: u32| seed.next(&[i]);
        for b in 0..3 {
            ix.register(b, h(b));
        }
        ix.park(2);
        ix.park(0);
        ix.park(1);
        // Taken up again and let go: now the most recently used.
        ix.unpark(2);
        ix.park(2);
        assert_eq!(ix.idle(), 3);
        assert_eq!(ix.evict_oldest(), Some(0));
        assert_eq!(ix.lookup(&h(0)), None, "an evicted block's name goes");
        assert_eq!(ix.lookup(&h(2)), Some(2));
        assert_eq!(ix.evict_oldest(), Some(1));
        assert_eq!(ix.evict_oldest(), Some(2));
        assert_eq!(ix.evict_oldest(), None);
        assert_eq!(ix.evicted(), 3);
        // A name registered twice keeps its first block.
        ix.register(0, h(7));
        ix.register(1, h(7));
        assert_eq!(ix.lookup(&h(7)), Some(0));
        assert!(!ix.is_registered(1));
    }
}
