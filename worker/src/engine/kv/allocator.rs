//! The KV cache's block allocator: which fixed-size blocks each sequence
//! holds, and which are free. It knows nothing of what the blocks store, so
//! the scheduler's accounting is the same for every backend, the synthetic
//! one (which stores nothing) included.
//!
//! With automatic prefix caching on, blocks are reference-counted: a full
//! block whose keys and values are written is registered under its chained
//! hash ([`super::prefix`]), a new sequence takes up every leading block of
//! its context that is registered (read-only: nobody writes a full block
//! again), and a registered block no sequence holds stays cached until a
//! sequence needs room, the least recently released first. Cached blocks
//! count as free for admission and preemption.
use super::prefix::{BlockHash, PrefixIndex};

/// The pool has no free block for a sequence that must grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("KV cache pool exhausted: {needed} more blocks needed, {free} free")]
pub struct PoolExhausted {
    pub needed: usize,
    pub free: usize,
}

/// One sequence's blocks and how many token slots it has written.
#[derive(Debug, Default)]
pub struct KvCache {
    blocks: Vec<u32>,
    len: usize,
    /// Chained hashes of the leading full blocks (prefix caching only).
    hashes: Vec<BlockHash>,
}

impl KvCache {
    /// Tokens already in the cache, which is also the next token's position.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing has been cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Blocks held.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Marks `n` more positions as written; a model calls this once a step
    /// has stored their keys and values.
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Chained hashes of the leading full blocks registered or taken from
    /// the prefix cache (empty with prefix caching off).
    pub fn block_hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// Forgets the positions from `len` on (their blocks stay held), so that
    /// they are computed again; benchmarks rerun a step this way. Not for a
    /// pool with prefix caching, whose registered blocks must never change
    /// (the scheduler never truncates).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// Hands out blocks `0..total` of `block_size` token slots each.
#[derive(Debug)]
pub struct BlockAllocator {
    block_size: usize,
    /// Blocks no sequence holds and no cache keeps.
    free: Vec<u32>,
    /// Per block: the sequences holding it.
    refs: Vec<u32>,
    total: usize,
    /// Prefix caching's index (None: off, every released block is free).
    prefix: Option<PrefixIndex>,
}

impl BlockAllocator {
    /// `total` free blocks of `block_size` slots (both at least 1), prefix
    /// caching off.
    pub fn new(total: usize, block_size: usize) -> Self {
        let total = total.max(1);
        Self {
            block_size: block_size.max(1),
            // Hand out low block numbers first.
            free: (0..total as u32).rev().collect(),
            refs: vec![0; total],
            total,
            prefix: None,
        }
    }

    /// Turns automatic prefix caching on, for the model (digest and version)
    /// `identity` names; before any block is handed out.
    pub fn enable_prefix_cache(&mut self, identity: &str) {
        debug_assert_eq!(self.free.len(), self.total, "before any reservation");
        self.prefix = Some(PrefixIndex::new(identity, self.total));
    }

    /// Whether prefix caching is on.
    pub fn prefix_cache(&self) -> bool {
        self.prefix.is_some()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.total
    }

    /// Blocks a sequence can take: those held by no sequence, cached ones
    /// included (they are evicted when taken).
    pub fn free_blocks(&self) -> usize {
        self.free.len() + self.cached_blocks()
    }

    /// Blocks no sequence holds that the prefix cache keeps for reuse.
    pub fn cached_blocks(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixIndex::idle)
    }

    /// Cached blocks evicted to make room, since start.
    pub fn evicted_blocks(&self) -> u64 {
        self.prefix.as_ref().map_or(0, PrefixIndex::evicted)
    }

    /// Blocks needed to hold `tokens`.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Extra blocks `seq` needs to hold `tokens` in total.
    pub fn shortfall(&self, seq: &KvCache, tokens: usize) -> usize {
        self.blocks_for(tokens).saturating_sub(seq.blocks.len())
    }

    /// Gives `seq` room for `tokens` in total, all or nothing; free blocks
    /// first, then the least recently used cached ones.
    pub fn reserve(&mut self, seq: &mut KvCache, tokens: usize) -> Result<(), PoolExhausted> {
        let needed = self.shortfall(seq, tokens);
        let free = self.free_blocks();
        if needed > free {
            return Err(PoolExhausted { needed, free });
        }
        for _ in 0..needed {
            let block = match self.free.pop() {
                Some(b) => b,
                None => self
                    .prefix
                    .as_mut()
                    .and_then(PrefixIndex::evict_oldest)
                    .expect("counted as free above"),
            };
            self.refs[block as usize] = 1;
            seq.blocks.push(block);
        }
        Ok(())
    }

    /// Lets go of a sequence's blocks: those no other sequence holds are
    /// freed, or kept in the prefix cache when registered. The last block
    /// goes first, so that a prompt's tail is evicted before its head
    /// (heads are what other prompts share).
    pub fn release(&mut self, seq: &mut KvCache) {
        for &block in seq.blocks.iter().rev() {
            let refs = &mut self.refs[block as usize];
            debug_assert!(*refs > 0, "a block was released twice");
            *refs = refs.saturating_sub(1);
            if *refs > 0 {
                continue;
            }
            match self.prefix.as_mut() {
                Some(ix) if ix.is_registered(block) => ix.park(block),
                _ => self.free.push(block),
            }
        }
        seq.blocks.clear();
        seq.hashes.clear();
        seq.len = 0;
    }

    /// Takes up, for an empty `seq` about to read `context`, every leading
    /// full block of it that is cached, and returns the tokens they hold.
    /// At least the last token is left to compute, so that the step yields
    /// the logits of the next one; a block the context fills only in part
    /// is computed again.
    pub fn take_cached_prefix(&mut self, seq: &mut KvCache, context: &[u32]) -> usize {
        debug_assert!(seq.blocks.is_empty(), "an empty sequence");
        let Some(ix) = self.prefix.as_mut() else {
            return 0;
        };
        let limit = context.len().saturating_sub(1) / self.block_size;
        let mut prev = ix.seed();
        for tokens in context.chunks_exact(self.block_size).take(limit) {
            let hash = prev.next(tokens);
            let Some(block) = ix.lookup(&hash) else {
                break;
            };
            ix.unpark(block);
            self.refs[block as usize] += 1;
            seq.blocks.push(block);
            seq.hashes.push(hash);
            prev = hash;
        }
        seq.len = seq.blocks.len() * self.block_size;
        seq.len
    }

    /// Registers the blocks of `seq` that the last step filled, `context`
    /// being the tokens at its positions; with prefix caching off, nothing.
    pub fn register_full_blocks(&mut self, seq: &mut KvCache, context: &[u32]) {
        let Some(ix) = self.prefix.as_mut() else {
            return;
        };
        debug_assert!(context.len() >= seq.len, "the context covers the cache");
        let full = (seq.len / self.block_size).min(context.len() / self.block_size);
        while seq.hashes.len() < full {
            let i = seq.hashes.len();
            let prev = seq.hashes.last().copied().unwrap_or_else(|| ix.seed());
            let hash = prev.next(&context[i * self.block_size..(i + 1) * self.block_size]);
            ix.register(seq.blocks[i], hash);
            seq.hashes.push(hash);
        }
    }

    /// The slot (row of the storage arrays) that holds position `pos` of `seq`.
    pub fn slot(&self, seq: &KvCache, pos: usize) -> usize {
        seq.blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_is_all_or_nothing_and_release_returns_every_block() {
        let mut alloc = BlockAllocator::new(3, 4);
        let mut a = KvCache::default();
        alloc.reserve(&mut a, 9).unwrap();
        assert_eq!((a.blocks(), alloc.free_blocks()), (3, 0));
        // Low block numbers first: position 5 is in block 1.
        assert_eq!(alloc.slot(&a, 5), 5);
        let mut b = KvCache::default();
        assert_eq!(
            alloc.reserve(&mut b, 1),
            Err(PoolExhausted { needed: 1, free: 0 })
        );
        assert_eq!(b.blocks(), 0);
        alloc.release(&mut a);
        assert_eq!((a.blocks(), a.len(), alloc.free_blocks()), (0, 0, 3));
        alloc.reserve(&mut b, 1).unwrap();
    }

    /// A sequence that read `context` (blocks reserved, keys and values
    /// "written", full blocks registered), as the scheduler leaves it.
    fn written(alloc: &mut BlockAllocator, context: &[u32]) -> KvCache {
        let mut seq = KvCache::default();
        let hit = alloc.take_cached_prefix(&mut seq, context);
        alloc.reserve(&mut seq, context.len()).unwrap();
        seq.advance(context.len() - hit);
        alloc.register_full_blocks(&mut seq, context);
        seq
    }

    fn cached(alloc: &mut BlockAllocator, context: &[u32]) -> (usize, KvCache) {
        let mut seq = KvCache::default();
        let hit = alloc.take_cached_prefix(&mut seq, context);
        (hit, seq)
    }

    #[test]
    fn without_prefix_caching_nothing_outlives_its_sequence() {
        let mut alloc = BlockAllocator::new(4, 4);
        let ctx: Vec<u32> = (0..12).collect();
        let mut a = written(&mut alloc, &ctx);
        assert!(a.block_hashes().is_empty());
        alloc.release(&mut a);
        assert_eq!((alloc.free_blocks(), alloc.cached_blocks()), (4, 0));
        assert_eq!(cached(&mut alloc, &ctx).0, 0);
    }

    #[test]
    fn shared_blocks_are_counted_and_outlive_each_holder() {
        let mut alloc = BlockAllocator::new(8, 4);
        alloc.enable_prefix_cache("model:v1");
        let ctx: Vec<u32> = (0..10).collect(); // 2 full blocks and 2 tokens
        let mut a = written(&mut alloc, &ctx);
        assert_eq!((a.blocks(), a.block_hashes().len()), (3, 2));
        // b shares a's two full blocks (read-only) and has its own third.
        let mut b = written(&mut alloc, &ctx);
        assert_eq!(&b.blocks[..2], &a.blocks[..2]);
        assert_ne!(b.blocks[2], a.blocks[2]);
        assert_eq!(alloc.free_blocks(), 8 - 4);
        alloc.release(&mut a);
        // Still held by b: neither free nor cached; a's partial block is free.
        assert_eq!((alloc.free_blocks(), alloc.cached_blocks()), (5, 0));
        alloc.release(&mut b);
        assert_eq!((alloc.free_blocks(), alloc.cached_blocks()), (8, 2));
        // A third sequence finds both again.
        assert_eq!(cached(&mut alloc, &ctx).0, 8);
    }

    #[test]
    fn only_full_blocks_are_shared_and_one_token_is_always_left() {
        let mut alloc = BlockAllocator::new(8, 4);
        alloc.enable_prefix_cache("model:v1");
        let ctx: Vec<u32> = (0..8).collect();
        let mut a = written(&mut alloc, &ctx);
        alloc.release(&mut a);
        // Exactly two full blocks cached: the last must be computed again
        // to yield logits, so one block is reused.
        let (hit, mut s) = cached(&mut alloc, &ctx);
        assert_eq!((hit, s.len()), (4, 4));
        alloc.release(&mut s);
        // A prompt ending mid-block reuses only its full blocks.
        let (hit, mut s) = cached(&mut alloc, &ctx[..6]);
        assert_eq!(hit, 4);
        alloc.release(&mut s);
        // One more token: both full blocks.
        let longer: Vec<u32> = (0..9).collect();
        assert_eq!(cached(&mut alloc, &longer).0, 8);
        // Another first block shares nothing, even with equal later tokens.
        let other: Vec<u32> = [vec![99; 4], (4..9).collect()].concat();
        assert_eq!(cached(&mut alloc, &other).0, 0);
    }

    #[test]
    fn cached_blocks_count_as_free_and_the_least_recently_used_go_first() {
        let mut alloc = BlockAllocator::new(4, 2);
        alloc.enable_prefix_cache("model:v1");
        let a_ctx = [1, 2, 3, 4];
        let b_ctx = [5, 6, 7, 8];
        let mut a = written(&mut alloc, &a_ctx);
        let mut b = written(&mut alloc, &b_ctx);
        assert_eq!((&a.blocks[..], &b.blocks[..]), (&[0, 1][..], &[2, 3][..]));
        alloc.release(&mut a);
        alloc.release(&mut b);
        assert_eq!((alloc.free_blocks(), alloc.cached_blocks()), (4, 4));
        // a is used again (and let go): b is now the least recently used.
        let (hit, mut again) = cached(&mut alloc, &[1, 2, 3, 4, 9]);
        assert_eq!(hit, 4);
        alloc.release(&mut again);
        // New blocks evict b, its tail (released before its head) first.
        let mut c = KvCache::default();
        alloc.reserve(&mut c, 1).unwrap();
        assert_eq!((&c.blocks[..], alloc.evicted_blocks()), (&[3][..], 1));
        let mut d = KvCache::default();
        alloc.reserve(&mut d, 1).unwrap();
        assert_eq!((&d.blocks[..], alloc.evicted_blocks()), (&[2][..], 2));
        assert_eq!(cached(&mut alloc, &[5, 6, 7, 8, 9]).0, 0);
        // a survived; its blocks are the only ones left.
        let (hit, mut a2) = cached(&mut alloc, &[1, 2, 3, 4, 9]);
        assert_eq!((hit, &a2.blocks[..]), (4, &[0, 1][..]));
        assert_eq!(
            alloc.reserve(&mut KvCache::default(), 1),
            Err(PoolExhausted { needed: 1, free: 0 })
        );
        alloc.release(&mut a2);
        alloc.release(&mut c);
        alloc.release(&mut d);
        assert_eq!(alloc.free_blocks(), 4);
    }

    #[test]
    fn blocks_of_another_model_never_match() {
        let ctx: Vec<u32> = (0..9).collect();
        let mut a = BlockAllocator::new(4, 4);
        a.enable_prefix_cache("sha-a:v1");
        let mut b = BlockAllocator::new(4, 4);
        b.enable_prefix_cache("sha-b:v1");
        let (sa, sb) = (written(&mut a, &ctx), written(&mut b, &ctx));
        assert_eq!(sa.block_hashes().len(), 2);
        assert!(sa
            .block_hashes()
            .iter()
            .all(|h| !sb.block_hashes().contains(h)));
    }

    #[test]
    fn two_sequences_writing_the_same_block_register_it_once() {
        let mut alloc = BlockAllocator::new(4, 4);
        alloc.enable_prefix_cache("model:v1");
        let ctx: Vec<u32> = (0..5).collect();
        // Both start before either registered anything.
        let (mut a, mut b) = (KvCache::default(), KvCache::default());
        for s in [&mut a, &mut b] {
            alloc.reserve(s, ctx.len()).unwrap();
            s.advance(ctx.len());
        }
        alloc.register_full_blocks(&mut a, &ctx);
        alloc.register_full_blocks(&mut b, &ctx);
        alloc.release(&mut a);
        alloc.release(&mut b);
        // a's block is cached, b's duplicate is simply free.
        assert_eq!((alloc.free_blocks(), alloc.cached_blocks()), (4, 1));
    }
}
