//! The KV cache's block allocator: which fixed-size blocks each sequence
//! holds, and which are free. It knows nothing of what the blocks store, so
//! the scheduler's accounting is the same for every backend, the synthetic
//! one (which stores nothing) included.

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

    /// Forgets the positions from `len` on (their blocks stay held), so that
    /// they are computed again; benchmarks rerun a step this way.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// Hands out blocks `0..total` of `block_size` token slots each.
#[derive(Debug)]
pub struct BlockAllocator {
    block_size: usize,
    free: Vec<u32>,
    total: usize,
}

impl BlockAllocator {
    /// `total` free blocks of `block_size` slots (both at least 1).
    pub fn new(total: usize, block_size: usize) -> Self {
        let total = total.max(1);
        Self {
            block_size: block_size.max(1),
            // Hand out low block numbers first.
            free: (0..total as u32).rev().collect(),
            total,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.total
    }

    /// Blocks not held by any sequence.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks needed to hold `tokens`.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Extra blocks `seq` needs to hold `tokens` in total.
    pub fn shortfall(&self, seq: &KvCache, tokens: usize) -> usize {
        self.blocks_for(tokens).saturating_sub(seq.blocks.len())
    }

    /// Gives `seq` room for `tokens` in total, all or nothing.
    pub fn reserve(&mut self, seq: &mut KvCache, tokens: usize) -> Result<(), PoolExhausted> {
        let needed = self.shortfall(seq, tokens);
        if needed > self.free.len() {
            return Err(PoolExhausted {
                needed,
                free: self.free.len(),
            });
        }
        for _ in 0..needed {
            seq.blocks.push(self.free.pop().expect("checked above"));
        }
        Ok(())
    }

    /// Returns a sequence's blocks to the pool.
    pub fn release(&mut self, seq: &mut KvCache) {
        self.free.append(&mut seq.blocks);
        seq.len = 0;
        debug_assert!(self.free.len() <= self.total, "a block was released twice");
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
}
