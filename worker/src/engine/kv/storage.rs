//! Where the KV cache's keys and values live: per layer, two preallocated
//! (slots, kv_dim) arrays, as candle tensors on the model's device or in host
//! memory, or nowhere at all for a model that only needs the accounting.
use candle_core::{DType, Device, Tensor};

/// The shape of one token's keys and values across the model's layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub layers: usize,
    /// Values per slot: kv heads times head size.
    pub kv_dim: usize,
}

impl KvShape {
    /// Bytes one token takes in the cache (f32 keys and values in every layer).
    pub fn bytes_per_token(&self) -> usize {
        self.layers * 2 * self.kv_dim * DType::F32.size_in_bytes()
    }
}

/// The keys and values of every layer.
pub enum KvStorage {
    /// Per layer: keys and values, (slots, kv_dim) tensors.
    Tensors(Vec<(Tensor, Tensor)>, Device),
    /// Per layer: keys and values, slots * kv_dim values.
    Host(Vec<(Vec<f32>, Vec<f32>)>),
    /// Nothing is stored: the blocks are accounting only (the synthetic engine).
    Accounting,
}

impl KvStorage {
    /// Zeroed tensors for `slots` slots of `shape` on `device`.
    pub fn tensors(shape: KvShape, slots: usize, device: &Device) -> candle_core::Result<Self> {
        let layers = (0..shape.layers)
            .map(|_| {
                Ok((
                    Tensor::zeros((slots, shape.kv_dim), DType::F32, device)?,
                    Tensor::zeros((slots, shape.kv_dim), DType::F32, device)?,
                ))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self::Tensors(layers, device.clone()))
    }

    /// Zeroed host arrays for `slots` slots of `shape`.
    pub fn host(shape: KvShape, slots: usize) -> Self {
        let len = slots * shape.kv_dim;
        // Zeroed allocations map untouched pages: resident memory grows with
        // the blocks in use, up to the budget.
        Self::Host(
            (0..shape.layers)
                .map(|_| (vec![0f32; len], vec![0f32; len]))
                .collect(),
        )
    }

    /// Host keys and values of `layer`, (slots, kv_dim) row-major.
    pub fn host_layer(&self, layer: usize) -> Option<(&[f32], &[f32])> {
        match self {
            Self::Host(l) => Some((&l[layer].0, &l[layer].1)),
            Self::Tensors(..) | Self::Accounting => None,
        }
    }

    /// Host keys and values of `layer`, for writing.
    pub fn host_layer_mut(&mut self, layer: usize) -> Option<(&mut [f32], &mut [f32])> {
        match self {
            Self::Host(l) => {
                let (k, v) = &mut l[layer];
                Some((k, v))
            }
            Self::Tensors(..) | Self::Accounting => None,
        }
    }

    /// The key and value tensors of `layer` and their device.
    pub fn layer_tensors(&self, layer: usize) -> candle_core::Result<(&Tensor, &Tensor, &Device)> {
        match self {
            Self::Tensors(l, device) => Ok((&l[layer].0, &l[layer].1, device)),
            Self::Host(_) | Self::Accounting => Err(candle_core::Error::Msg(
                "the KV pool does not hold tensors".into(),
            )),
        }
    }

    /// The device tensors live on.
    pub fn device(&self) -> candle_core::Result<&Device> {
        match self {
            Self::Tensors(_, device) => Ok(device),
            Self::Host(_) | Self::Accounting => Err(candle_core::Error::Msg(
                "the KV pool does not hold tensors".into(),
            )),
        }
    }
}
