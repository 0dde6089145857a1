//! The KV cache as fixed-size blocks from one pool allocated at start-up.
//!
//! A pool is a block allocator ([`allocator`]: which blocks each sequence
//! holds) over a storage ([`storage`]: where keys and values live, sized by a
//! memory budget). Sequences of any length come and go without the memory
//! fragmenting or growing, and a full pool is a scheduling decision (wait or
//! preempt), never an allocation failure. With prefix caching on, full
//! blocks outlive their sequence and are shared by later ones ([`prefix`]).
pub mod allocator;
pub mod prefix;
pub mod storage;

pub use allocator::{BlockAllocator, KvCache, PoolExhausted};
pub use prefix::BlockHash;
pub use storage::{KvShape, KvStorage};

use candle_core::{Device, Tensor};

/// The preallocated block pool: an allocator and the storage its blocks index.
pub struct KvPool {
    alloc: BlockAllocator,
    storage: KvStorage,
    kv_dim: usize,
}

/// Blocks of `block_size` tokens that `budget_bytes` holds at
/// `bytes_per_token`.
fn blocks_in(budget_bytes: usize, bytes_per_token: usize, block_size: usize) -> usize {
    (budget_bytes / (bytes_per_token.max(1) * block_size.max(1))).max(1)
}

impl KvPool {
    /// As many `block_size`-token blocks as `budget_bytes` holds, as tensors
    /// on `device` (the candle backend).
    pub fn tensors(
        shape: KvShape,
        budget_bytes: usize,
        block_size: usize,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let alloc = BlockAllocator::new(
            blocks_in(budget_bytes, shape.bytes_per_token(), block_size),
            block_size,
        );
        let slots = alloc.total_blocks() * alloc.block_size();
        let storage = KvStorage::tensors(shape, slots, device)?;
        Ok(Self::new(alloc, storage, shape.kv_dim))
    }

    /// The same pool in host memory (the CPU kernels).
    pub fn host(shape: KvShape, budget_bytes: usize, block_size: usize) -> Self {
        let alloc = BlockAllocator::new(
            blocks_in(budget_bytes, shape.bytes_per_token(), block_size),
            block_size,
        );
        let slots = alloc.total_blocks() * alloc.block_size();
        Self::new(alloc, KvStorage::host(shape, slots), shape.kv_dim)
    }

    /// Blocks that store nothing, as many as `budget_bytes` would hold at
    /// `bytes_per_token`: the scheduler's accounting for a model that keeps
    /// no keys or values (the synthetic engine).
    pub fn accounting(bytes_per_token: usize, budget_bytes: usize, block_size: usize) -> Self {
        let alloc = BlockAllocator::new(
            blocks_in(budget_bytes, bytes_per_token, block_size),
            block_size,
        );
        Self::new(alloc, KvStorage::Accounting, 0)
    }

    fn new(alloc: BlockAllocator, storage: KvStorage, kv_dim: usize) -> Self {
        Self {
            alloc,
            storage,
            kv_dim,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.alloc.block_size()
    }

    /// Blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.alloc.total_blocks()
    }

    /// Blocks a sequence can take: those no sequence holds, cached ones
    /// included.
    pub fn free_blocks(&self) -> usize {
        self.alloc.free_blocks()
    }

    /// Turns automatic prefix caching on for the model `identity` names
    /// (file digest and version); before the first reservation.
    pub fn enable_prefix_cache(&mut self, identity: &str) {
        self.alloc.enable_prefix_cache(identity)
    }

    /// Blocks no sequence holds that the prefix cache keeps for reuse.
    pub fn cached_blocks(&self) -> usize {
        self.alloc.cached_blocks()
    }

    /// Cached blocks evicted to make room, since start.
    pub fn evicted_blocks(&self) -> u64 {
        self.alloc.evicted_blocks()
    }

    /// Gives an empty `seq` the cached leading full blocks of `context`;
    /// returns the tokens they hold (see [`BlockAllocator::take_cached_prefix`]).
    pub fn take_cached_prefix(&mut self, seq: &mut KvCache, context: &[u32]) -> usize {
        self.alloc.take_cached_prefix(seq, context)
    }

    /// Registers the blocks of `seq` the last step filled.
    pub fn register_full_blocks(&mut self, seq: &mut KvCache, context: &[u32]) {
        self.alloc.register_full_blocks(seq, context)
    }

    /// Blocks needed to hold `tokens`.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        self.alloc.blocks_for(tokens)
    }

    /// Extra blocks `seq` needs to hold `tokens` in total.
    pub fn shortfall(&self, seq: &KvCache, tokens: usize) -> usize {
        self.alloc.shortfall(seq, tokens)
    }

    /// Gives `seq` room for `tokens` in total, all or nothing.
    pub fn reserve(&mut self, seq: &mut KvCache, tokens: usize) -> Result<(), PoolExhausted> {
        self.alloc.reserve(seq, tokens)
    }

    /// Returns a sequence's blocks to the pool (registered ones to the
    /// prefix cache).
    pub fn release(&mut self, seq: &mut KvCache) {
        self.alloc.release(seq)
    }

    /// The slot (row of the layer arrays) that holds position `pos` of `seq`.
    pub fn slot(&self, seq: &KvCache, pos: usize) -> usize {
        self.alloc.slot(seq, pos)
    }

    /// Values per slot: kv heads times head size.
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Host keys and values of `layer`, (slots, kv_dim) row-major.
    pub fn host_layer(&self, layer: usize) -> Option<(&[f32], &[f32])> {
        self.storage.host_layer(layer)
    }

    /// Host keys and values of `layer`, for writing.
    pub fn host_layer_mut(&mut self, layer: usize) -> Option<(&mut [f32], &mut [f32])> {
        self.storage.host_layer_mut(layer)
    }

    /// Slot indices of positions 0..len of `seq`, for `gather`.
    pub fn slots(&self, seq: &KvCache, len: usize) -> candle_core::Result<Tensor> {
        let ids: Vec<u32> = (0..len).map(|p| self.slot(seq, p) as u32).collect();
        Tensor::from_vec(ids, len, self.storage.device()?)
    }

    /// Writes keys and values (n, kv_dim) for positions start..start + n.
    pub fn write(
        &self,
        layer: usize,
        seq: &KvCache,
        start: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<()> {
        let (kc, vc, _) = self.storage.layer_tensors(layer)?;
        let n = k.dim(0)?;
        debug_assert_eq!(k.dim(1)?, self.kv_dim);
        let block_size = self.block_size();
        let mut done = 0;
        // One copy per run of positions that stays inside a block.
        while done < n {
            let pos = start + done;
            let run = (block_size - pos % block_size).min(n - done);
            let at = self.slot(seq, pos);
            kc.slice_set(&k.narrow(0, done, run)?.contiguous()?, 0, at)?;
            vc.slice_set(&v.narrow(0, done, run)?.contiguous()?, 0, at)?;
            done += run;
        }
        Ok(())
    }

    /// Keys and values of the slots in `slots`, (len, kv_dim) each.
    pub fn gather(&self, layer: usize, slots: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let (kc, vc, _) = self.storage.layer_tensors(layer)?;
        Ok((kc.index_select(slots, 0)?, vc.index_select(slots, 0)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2 layers of one 4-wide kv head.
    const SHAPE: KvShape = KvShape {
        layers: 2,
        kv_dim: 4,
    };

    #[test]
    fn the_budget_sizes_the_pool() {
        // 2 layers * 2 (k, v) * 4 dims * 4 bytes = 64 bytes per token.
        assert_eq!(SHAPE.bytes_per_token(), 64);
        let pool = KvPool::tensors(SHAPE, 64 * 4 * 3, 4, &Device::Cpu).unwrap();
        assert_eq!(pool.total_blocks(), 3);
        let host = KvPool::host(SHAPE, 64 * 4 * 3, 4);
        assert_eq!(host.total_blocks(), 3);
        assert_eq!(host.host_layer(1).unwrap().0.len(), 3 * 4 * 4);
        let counted = KvPool::accounting(1024, 1 << 20, 16);
        assert_eq!(counted.total_blocks(), 64);
        assert!(counted.host_layer(0).is_none());
    }

    #[test]
    fn writes_across_block_boundaries_read_back_in_order() {
        let mut pool = KvPool::tensors(SHAPE, 64 * 4 * 4, 4, &Device::Cpu).unwrap();
        // Interleave two sequences so their blocks are not contiguous.
        let (mut a, mut b) = (KvCache::default(), KvCache::default());
        pool.reserve(&mut a, 4).unwrap();
        pool.reserve(&mut b, 4).unwrap();
        pool.reserve(&mut a, 7).unwrap();
        let rows: Vec<f32> = (0..7 * 4).map(|x| x as f32).collect();
        let k = Tensor::from_vec(rows.clone(), (7, 4), &Device::Cpu).unwrap();
        let v = (&k * 2.0).unwrap();
        pool.write(
            1,
            &a,
            0,
            &k.narrow(0, 0, 3).unwrap(),
            &v.narrow(0, 0, 3).unwrap(),
        )
        .unwrap();
        pool.write(
            1,
            &a,
            3,
            &k.narrow(0, 3, 4).unwrap(),
            &v.narrow(0, 3, 4).unwrap(),
        )
        .unwrap();
        let (gk, gv) = pool.gather(1, &pool.slots(&a, 7).unwrap()).unwrap();
        assert_eq!(gk.flatten_all().unwrap().to_vec1::<f32>().unwrap(), rows);
        assert_eq!(
            gv.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            rows.iter().map(|x| x * 2.0).collect::<Vec<_>>()
        );
    }
}
