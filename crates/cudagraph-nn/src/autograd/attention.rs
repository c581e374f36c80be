//! Causal attention over a key/value cache built for graphs: [`KvCache`] holds, per sequence
//! slot, room for `max_len` keys and values of every key/value head; [`KvCache::append`] writes
//! a call's new keys and values at their positions and [`KvCache::attend`] lets each query token
//! attend to its sequence's positions up to its own (grouped-query heads, f32 softmax). The
//! positions are a device buffer of one i32 per query token, so a decode step captured once
//! stays valid as the sequences grow: the host writes (or a kernel advances) the positions
//! between replays, and attention reads only each sequence's valid prefix.
//!
//! Inference only for now: the outputs record no autograd node (`NnError::Unsupported` when a
//! query needs a gradient).

use std::sync::Arc;

use cudagraph::memory::{bf16, f16};
use cudagraph::{DeviceBuffer, Queue, QueueExt};

use crate::autograd::tensor::Tensor;
use crate::dtype::{Dtype, Float, TypedBuffer};
use crate::error::{NnError, Result};
use crate::kernels::attention::AttentionKernels;
pub use crate::kernels::attention::{AttentionShape, MAX_HEAD_DIM};

/// Keys and values of `batch` sequence slots, `[batch, kv_heads, max_len, head_dim]` each, in
/// one element type (zeroed when made).
pub struct KvCache {
    dtype: Dtype,
    batch: usize,
    kv_heads: usize,
    max_len: usize,
    head_dim: usize,
    keys: TypedBuffer,
    values: TypedBuffer,
}

fn zeroed(q: &dyn Queue, dtype: Dtype, n: usize) -> Result<TypedBuffer> {
    Ok(match dtype {
        Dtype::F32 => TypedBuffer::new(Arc::new(q.alloc_zeroed::<f32>(n)?)),
        Dtype::Bf16 => TypedBuffer::new(Arc::new(q.alloc_zeroed::<bf16>(n)?)),
        Dtype::F16 => TypedBuffer::new(Arc::new(q.alloc_zeroed::<f16>(n)?)),
    })
}

impl KvCache {
    /// A zeroed cache on `q`'s device.
    pub fn new(
        q: &dyn Queue,
        dtype: Dtype,
        (batch, kv_heads, max_len, head_dim): (usize, usize, usize, usize),
    ) -> Result<Self> {
        let shape = AttentionShape {
            batch,
            slots: batch,
            tokens: 1,
            heads: kv_heads,
            kv_heads,
            max_len,
            head_dim,
        };
        shape.validate()?;
        let n = shape.cache_len()?;
        Ok(Self {
            dtype,
            batch,
            kv_heads,
            max_len,
            head_dim,
            keys: zeroed(q, dtype, n)?,
            values: zeroed(q, dtype, n)?,
        })
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Positions each sequence slot holds.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Sequence slots.
    pub fn slots(&self) -> usize {
        self.batch
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Elements per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The shape of a call with `query` `[rows, tokens, heads, head_dim]`: `rows` must be the
    /// cache's slots unless a slot map (`mapped`) says where each row goes.
    fn shape_for(
        &self,
        what: &'static str,
        t: &Tensor,
        heads_dim: usize,
        mapped: bool,
    ) -> Result<AttentionShape> {
        let s = t.shape();
        if s.len() != 4 || (!mapped && s[0] != self.batch) || s[3] != self.head_dim {
            return Err(NnError::Shape(format!(
                "attention {what}: {s:?} for a cache of {} sequences of head dimension {}",
                self.batch, self.head_dim
            )));
        }
        if t.dtype() != self.dtype {
            return Err(NnError::Dtype {
                what: "attention input",
                expected: self.dtype.name(),
                found: t.dtype().name(),
            });
        }
        if heads_dim == 2 && s[2] != self.kv_heads {
            return Err(NnError::Shape(format!(
                "attention {what}: {} heads for a cache of {} key/value heads",
                s[2], self.kv_heads
            )));
        }
        Ok(AttentionShape {
            batch: s[0],
            slots: self.batch,
            tokens: s[1],
            heads: s[2],
            kv_heads: self.kv_heads,
            max_len: self.max_len,
            head_dim: self.head_dim,
        })
    }

    /// Writes `keys` and `values` (`[batch, tokens, kv_heads, head_dim]`, the cache's type) at
    /// the positions `positions[b·tokens + t]`.
    pub fn append(
        &self,
        q: &dyn Queue,
        keys: &Tensor,
        values: &Tensor,
        positions: &DeviceBuffer<i32>,
    ) -> Result<()> {
        self.append_rows(q, keys, values, positions, None)
    }

    /// As [`KvCache::append`] for `rows` rows (`[rows, tokens, kv_heads, head_dim]`) each
    /// written to the slot `slots[b]` (device data, at least `rows` values, read when the
    /// kernel runs; `None`: row `b` is slot `b`). A slot outside `[0, slots)` is reported
    /// through the stream's check record, like a position outside the cache, and its row
    /// writes nothing.
    pub fn append_rows(
        &self,
        q: &dyn Queue,
        keys: &Tensor,
        values: &Tensor,
        positions: &DeviceBuffer<i32>,
        slots: Option<&DeviceBuffer<i32>>,
    ) -> Result<()> {
        let shape = self.shape_for("keys", keys, 2, slots.is_some())?;
        if values.shape() != keys.shape() || values.dtype() != keys.dtype() {
            return Err(NnError::Shape(format!(
                "attention: values {:?} ({}) for keys {:?} ({})",
                values.shape(),
                values.dtype(),
                keys.shape(),
                keys.dtype()
            )));
        }
        let k = AttentionKernels::get(q.device())?;
        let io = (keys, values, positions, slots);
        match self.dtype {
            Dtype::F32 => self.append_as::<f32>(q, &k, &shape, io),
            Dtype::Bf16 => self.append_as::<bf16>(q, &k, &shape, io),
            Dtype::F16 => self.append_as::<f16>(q, &k, &shape, io),
        }
    }

    #[allow(clippy::type_complexity)]
    fn append_as<T: Float>(
        &self,
        q: &dyn Queue,
        k: &AttentionKernels,
        shape: &AttentionShape,
        (keys, values, positions, slots): (
            &Tensor,
            &Tensor,
            &DeviceBuffer<i32>,
            Option<&DeviceBuffer<i32>>,
        ),
    ) -> Result<()> {
        k.append(
            q,
            shape,
            (keys.data_as::<T>()?, values.data_as::<T>()?),
            self.caches::<T>()?,
            positions,
            slots,
        )
    }

    /// The key and value buffers as `T` (`NnError::Dtype` for another type).
    pub(crate) fn caches<T: Float>(&self) -> Result<(&DeviceBuffer<T>, &DeviceBuffer<T>)> {
        let err = || NnError::Dtype {
            what: "attention cache",
            expected: T::DTYPE.name(),
            found: self.dtype.name(),
        };
        Ok((
            self.keys.get::<T>().ok_or_else(err)?,
            self.values.get::<T>().ok_or_else(err)?,
        ))
    }

    /// Attention of `query` (`[batch, tokens, heads, head_dim]`, the cache's type; `heads` a
    /// multiple of the cache's key/value heads) over the cache: each token attends to its
    /// sequence's positions `0..=positions[b·tokens + t]` with scores scaled by `scale`
    /// (usually `1/√head_dim`). The output has the query's shape and type.
    pub fn attend(
        &self,
        q: &dyn Queue,
        query: &Tensor,
        positions: &DeviceBuffer<i32>,
        scale: f32,
    ) -> Result<Tensor> {
        self.attend_rows(q, query, positions, None, scale)
    }

    /// As [`KvCache::attend`] for `rows` rows (`query` `[rows, tokens, heads, head_dim]`),
    /// row `b` reading the slot `slots[b]` (device data, at least `rows` values; `None`: row
    /// `b` is slot `b`). A slot outside `[0, slots)` is reported through the stream's check
    /// record and its row's output is zero.
    pub fn attend_rows(
        &self,
        q: &dyn Queue,
        query: &Tensor,
        positions: &DeviceBuffer<i32>,
        slots: Option<&DeviceBuffer<i32>>,
        scale: f32,
    ) -> Result<Tensor> {
        if query.requires_grad() && crate::autograd::tensor::grad_enabled() {
            return Err(NnError::Unsupported(
                "attention over a KV cache is inference only: run it under no_grad".into(),
            ));
        }
        let shape = self.shape_for("query", query, 0, slots.is_some())?;
        shape.validate()?;
        let k = AttentionKernels::get(q.device())?;
        let io = (query, positions, slots);
        let out = match self.dtype {
            Dtype::F32 => self.attend_as::<f32>(q, &k, &shape, io, scale)?,
            Dtype::Bf16 => self.attend_as::<bf16>(q, &k, &shape, io, scale)?,
            Dtype::F16 => self.attend_as::<f16>(q, &k, &shape, io, scale)?,
        };
        Tensor::from_typed(out, query.shape())
    }

    fn attend_as<T: Float>(
        &self,
        q: &dyn Queue,
        k: &AttentionKernels,
        shape: &AttentionShape,
        (query, positions, slots): (&Tensor, &DeviceBuffer<i32>, Option<&DeviceBuffer<i32>>),
        scale: f32,
    ) -> Result<TypedBuffer> {
        let out = Arc::new(q.alloc::<T>(shape.query_len()?)?);
        k.attend(
            q,
            shape,
            query.data_as::<T>()?,
            self.caches::<T>()?,
            positions,
            slots,
            &out,
            scale,
        )?;
        Ok(TypedBuffer::new(out))
    }
}
