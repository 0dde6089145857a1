//! The KV cache as fixed-size blocks from one pool allocated at start-up.
//!
//! Every layer's keys and values live in two preallocated (slots, kv_dim)
//! arrays sized by a memory budget (candle tensors on the model's device for
//! the candle backend, host memory for the CPU kernels, where pages are only
//! touched as blocks are first used); a sequence owns a list of blocks of
//! `block_size` slots. Sequences of any length come and go without the memory
//! fragmenting or growing, and a full pool is a scheduling decision (wait or
//! preempt), never an allocation failure.
use super::llama::LlamaConfig;
use candle_core::{DType, Device, Tensor};

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

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Forgets the positions from `len` on (their blocks stay held), so that
    /// they are computed again; benchmarks rerun a step this way.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// Where the keys and values live.
enum Storage {
    /// Per layer: keys and values, (blocks * block_size, kv_dim) tensors.
    Tensors(Vec<(Tensor, Tensor)>, Device),
    /// Per layer: keys and values, blocks * block_size * kv_dim values.
    Host(Vec<(Vec<f32>, Vec<f32>)>),
}

/// The preallocated block pool.
pub struct KvPool {
    block_size: usize,
    kv_dim: usize,
    storage: Storage,
    free: Vec<u32>,
    total: usize,
}

impl KvPool {
    /// Bytes one token takes in the cache of a model of this shape (f32 keys
    /// and values in every layer).
    pub fn bytes_per_token(cfg: &LlamaConfig) -> usize {
        cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * DType::F32.size_in_bytes()
    }

    /// A pool of as many `block_size`-token blocks as `budget_bytes` holds,
    /// as tensors on `device` (the candle backend).
    pub fn new(
        cfg: &LlamaConfig,
        budget_bytes: usize,
        block_size: usize,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let (block_size, total, kv_dim) = Self::shape(cfg, budget_bytes, block_size);
        let slots = total * block_size;
        let layers = (0..cfg.n_layer)
            .map(|_| {
                Ok((
                    Tensor::zeros((slots, kv_dim), DType::F32, device)?,
                    Tensor::zeros((slots, kv_dim), DType::F32, device)?,
                ))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self::with_storage(
            block_size,
            total,
            kv_dim,
            Storage::Tensors(layers, device.clone()),
        ))
    }

    /// The same pool in host memory (the CPU kernels).
    pub fn new_host(cfg: &LlamaConfig, budget_bytes: usize, block_size: usize) -> Self {
        let (block_size, total, kv_dim) = Self::shape(cfg, budget_bytes, block_size);
        let len = total * block_size * kv_dim;
        // Zeroed allocations map untouched pages: resident memory grows with
        // the blocks in use, up to the budget.
        let layers = (0..cfg.n_layer)
            .map(|_| (vec![0f32; len], vec![0f32; len]))
            .collect();
        Self::with_storage(block_size, total, kv_dim, Storage::Host(layers))
    }

    fn shape(cfg: &LlamaConfig, budget_bytes: usize, block_size: usize) -> (usize, usize, usize) {
        let block_size = block_size.max(1);
        let total = (budget_bytes / (Self::bytes_per_token(cfg) * block_size)).max(1);
        (block_size, total, cfg.n_kv_head * cfg.head_dim)
    }

    fn with_storage(block_size: usize, total: usize, kv_dim: usize, storage: Storage) -> Self {
        Self {
            block_size,
            kv_dim,
            storage,
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
    }

    /// The slot (row of the layer arrays) that holds position `pos` of `seq`.
    pub fn slot(&self, seq: &KvCache, pos: usize) -> usize {
        seq.blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// Values per slot: kv heads times head size.
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Host keys and values of `layer`, (slots, kv_dim) row-major.
    pub fn host_layer(&self, layer: usize) -> Option<(&[f32], &[f32])> {
        match &self.storage {
            Storage::Host(l) => Some((&l[layer].0, &l[layer].1)),
            Storage::Tensors(..) => None,
        }
    }

    /// Host keys and values of `layer`, for writing.
    pub fn host_layer_mut(&mut self, layer: usize) -> Option<(&mut [f32], &mut [f32])> {
        match &mut self.storage {
            Storage::Host(l) => {
                let (k, v) = &mut l[layer];
                Some((k, v))
            }
            Storage::Tensors(..) => None,
        }
    }

    fn tensors(&self, layer: usize) -> candle_core::Result<(&Tensor, &Tensor, &Device)> {
        match &self.storage {
            Storage::Tensors(l, device) => Ok((&l[layer].0, &l[layer].1, device)),
            Storage::Host(_) => Err(candle_core::Error::Msg(
                "the KV pool is in host memory, not tensors".into(),
            )),
        }
    }

    /// Slot indices of positions 0..len of `seq`, for `gather`.
    pub fn slots(&self, seq: &KvCache, len: usize) -> candle_core::Result<Tensor> {
        let ids: Vec<u32> = (0..len).map(|p| self.slot(seq, p) as u32).collect();
        let (.., device) = self.tensors(0)?;
        Tensor::from_vec(ids, len, device)
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
        let (kc, vc, _) = self.tensors(layer)?;
        let n = k.dim(0)?;
        debug_assert_eq!(k.dim(1)?, self.kv_dim);
        let mut done = 0;
        // One copy per run of positions that stays inside a block.
        while done < n {
            let pos = start + done;
            let run = (self.block_size - pos % self.block_size).min(n - done);
            let at = self.slot(seq, pos);
            kc.slice_set(&k.narrow(0, done, run)?.contiguous()?, 0, at)?;
            vc.slice_set(&v.narrow(0, done, run)?.contiguous()?, 0, at)?;
            done += run;
        }
        Ok(())
    }

    /// Keys and values of the slots in `slots`, (len, kv_dim) each.
    pub fn gather(&self, layer: usize, slots: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let (kc, vc, _) = self.tensors(layer)?;
        Ok((kc.index_select(slots, 0)?, vc.index_select(slots, 0)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> LlamaConfig {
        LlamaConfig {
            n_layer: 2,
            n_head: 2,
            n_kv_head: 1,
            head_dim: 4,
            hidden: 8,
            rms_eps: 1e-5,
            rope_theta: 10_000.0,
            context_length: 64,
            vocab_size: 10,
        }
    }

    #[test]
    fn budget_sizes_the_pool_and_reserve_is_all_or_nothing() {
        let c = cfg();
        // 2 layers * 2 (k, v) * 4 dims * 4 bytes = 64 bytes per token.
        assert_eq!(KvPool::bytes_per_token(&c), 64);
        let mut pool = KvPool::new(&c, 64 * 4 * 3, 4, &Device::Cpu).unwrap();
        assert_eq!(pool.total_blocks(), 3);
        let mut a = KvCache::default();
        pool.reserve(&mut a, 9).unwrap();
        assert_eq!((a.blocks(), pool.free_blocks()), (3, 0));
        let mut b = KvCache::default();
        assert_eq!(
            pool.reserve(&mut b, 1),
            Err(PoolExhausted { needed: 1, free: 0 })
        );
        pool.release(&mut a);
        assert_eq!(pool.free_blocks(), 3);
        pool.reserve(&mut b, 1).unwrap();
    }

    #[test]
    fn writes_across_block_boundaries_read_back_in_order() {
        let c = cfg();
        let mut pool = KvPool::new(&c, 64 * 4 * 4, 4, &Device::Cpu).unwrap();
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
