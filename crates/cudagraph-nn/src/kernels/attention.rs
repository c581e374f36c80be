//! Attention over a key/value cache (`attention.cu`, its own NVRTC module, compiled after the
//! device-check prologue and `cast.cu`): [`AttentionKernels::attend`] — every query token
//! attends to the cache positions up to its own, grouped-query heads, f32 softmax and sums —
//! and [`AttentionKernels::append`], which writes new keys and values at their positions. One
//! template per kernel, instantiated for f32, bf16 and f16.
//!
//! Positions are device data (one i32 per query token), and so are the cache slots of the rows
//! (one i32 per row, or none: row `b` is slot `b`), so a captured decode step stays valid as
//! sequences grow and move between slots: the launch only fixes the shapes. A slot outside
//! `[0, slots)` or a position outside `[0, max_len)` is reported through the stream's check
//! record (the next synchronisation returns it as a typed error) and touches no memory outside
//! the cache.

use std::sync::Arc;

use cudagraph::{register_check, Arg, Device, DeviceBuffer, LaunchConfig, Queue};

use crate::dtype::Float;
use crate::error::{NnError, Result};
use crate::extent::{need, prod};
use crate::kernels::{grid_stride, ByType};

/// The shapes of one attention call: `batch` rows (sequences) of `tokens` query tokens,
/// `heads` query heads over `kv_heads` key/value heads (`heads` a multiple of it), caches of
/// `slots` sequence slots of `max_len` positions, head dimension `head_dim` (at most
/// [`MAX_HEAD_DIM`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Rows (sequences) of this call.
    pub batch: usize,
    /// Sequence slots of the caches (each row is mapped to one of them; without a slot map,
    /// row `b` is slot `b` and `batch ≤ slots`).
    pub slots: usize,
    /// Query tokens per sequence in this call (1 when decoding).
    pub tokens: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention: each serves `heads / kv_heads` query heads).
    pub kv_heads: usize,
    /// Positions each cache holds.
    pub max_len: usize,
    /// Elements per head.
    pub head_dim: usize,
}

/// The largest head dimension the kernels take (32 lanes × 8 values).
pub const MAX_HEAD_DIM: usize = 256;

/// Warps per attention block (as `ATT_WARPS` in the kernel).
const WARPS: u32 = 4;

impl AttentionShape {
    /// Elements of the queries (and of the output): `batch · tokens · heads · head_dim`.
    pub fn query_len(&self) -> Result<usize> {
        prod(
            "attention queries",
            &[self.batch, self.tokens, self.heads, self.head_dim],
        )
    }

    /// Elements of one cache: `slots · kv_heads · max_len · head_dim`.
    pub fn cache_len(&self) -> Result<usize> {
        prod(
            "attention cache",
            &[self.slots, self.kv_heads, self.max_len, self.head_dim],
        )
    }

    /// Elements of the new keys (and values) of one call: `batch · tokens · kv_heads · head_dim`.
    pub fn new_kv_len(&self) -> Result<usize> {
        prod(
            "attention new keys",
            &[self.batch, self.tokens, self.kv_heads, self.head_dim],
        )
    }

    /// Positions of one call: `batch · tokens`.
    pub fn positions_len(&self) -> Result<usize> {
        prod("attention positions", &[self.batch, self.tokens])
    }

    /// Checks the buffers of one attention call against the shape (validated before): `query`
    /// and `out` hold `query_len`, each cache `cache_len`, `positions` `positions_len` elements.
    /// Returns `positions_len` (the call's query tokens).
    pub(crate) fn check_buffers<T: Float>(
        &self,
        query: &DeviceBuffer<T>,
        out: &DeviceBuffer<T>,
        (k_cache, v_cache): (&DeviceBuffer<T>, &DeviceBuffer<T>),
        positions: &DeviceBuffer<i32>,
    ) -> Result<usize> {
        let (ql, cl, pl) = (self.query_len()?, self.cache_len()?, self.positions_len()?);
        need("attention query", query, ql)?;
        need("attention output", out, ql)?;
        need("attention key cache", k_cache, cl)?;
        need("attention value cache", v_cache, cl)?;
        need("attention positions", positions, pl)?;
        Ok(pl)
    }

    /// Checks the shape: every size positive, `heads` a multiple of `kv_heads`, `head_dim` at
    /// most [`MAX_HEAD_DIM`], every count within the kernels' integers.
    pub fn validate(&self) -> Result<()> {
        let s = self;
        if [
            s.batch, s.slots, s.tokens, s.heads, s.kv_heads, s.max_len, s.head_dim,
        ]
        .contains(&0)
        {
            return Err(NnError::Shape(format!("attention: a zero size in {s:?}")));
        }
        if s.heads % s.kv_heads != 0 {
            return Err(NnError::Shape(format!(
                "attention: {} query heads cannot share {} key/value heads evenly",
                s.heads, s.kv_heads
            )));
        }
        if s.head_dim > MAX_HEAD_DIM {
            return Err(NnError::Shape(format!(
                "attention: head dimension {} is over the kernels' {MAX_HEAD_DIM}",
                s.head_dim
            )));
        }
        for (what, v) in [
            ("batch", s.batch),
            ("tokens", s.tokens),
            ("heads", s.heads),
            ("max_len", s.max_len),
            ("slots", s.slots),
        ] {
            if v > 65_535 && what != "heads" && what != "slots" || i32::try_from(v).is_err() {
                return Err(NnError::Shape(format!(
                    "attention: {what} = {v} is over the launch grid's limit"
                )));
            }
        }
        // The element counts must fit i64 (checked products); per-row indices are i64 inside.
        s.query_len()?;
        s.cache_len()?;
        Ok(())
    }
}

/// The attention kernels of one device (a [`Device::extension`]).
pub struct AttentionKernels {
    attend: ByType,
    append: ByType,
    check: u32,
    slot_check: u32,
}

/// The CUDA source of the module.
pub fn source() -> String {
    format!(
        "{}{}{}",
        cudagraph::DEVICE_CHECK_CUDA,
        super::cast::SOURCE,
        include_str!("attention.cu")
    )
}

impl AttentionKernels {
    /// The kernels of `device`, compiled on first use.
    pub fn get(device: &Device) -> Result<Arc<Self>> {
        Ok(device.extension(|d| {
            let m = cudagraph::runtime::with_relaxed_capture(|| {
                d.compile(
                    "cudagraph_nn_attention",
                    &super::module_source("cudagraph_nn_attention"),
                )
            })?;
            Ok(AttentionKernels {
                attend: ByType::load(&m, "attend_kv")?,
                append: ByType::load(&m, "kv_append")?,
                check: register_check("attention position"),
                slot_check: register_check("attention cache slot"),
            })
        })?)
    }

    /// `out = softmax(q·kᵀ · scale) · v` per query token and head, over the cache positions
    /// `0..=pos` of its row's slot (`pos` = `positions[b·tokens + t]`, its key and value
    /// already in the cache; the slot `slots[b]`, or `b` without a slot map). Buffers as
    /// [`AttentionShape`] describes; `positions` holds `batch · tokens` values, `slots`
    /// `batch`.
    #[allow(clippy::too_many_arguments)]
    pub fn attend<T: Float>(
        &self,
        q: &dyn Queue,
        shape: &AttentionShape,
        query: &DeviceBuffer<T>,
        (k_cache, v_cache): (&DeviceBuffer<T>, &DeviceBuffer<T>),
        positions: &DeviceBuffer<i32>,
        slots: Option<&DeviceBuffer<i32>>,
        out: &DeviceBuffer<T>,
        scale: f32,
    ) -> Result<()> {
        shape.validate()?;
        check_slots(shape, slots)?;
        shape.check_buffers(query, out, (k_cache, v_cache), positions)?;
        let s = shape;
        let cfg = LaunchConfig {
            grid: (s.heads as u32, s.tokens as u32, s.batch as u32),
            block: (32 * WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        let i = |v: usize| Arg::I32(v as i32);
        // SAFETY: attend_kv_{f32,bf16,f16}(const T* q, const T* kc, const T* vc, const int* pos,
        // const int* slot, T* out, int B, int Tq, int H, int Hkv, int S, int Tmax, int D,
        // float scale, cg_check* flag, unsigned check, unsigned slot_check): block (h, t, b)
        // reads q and writes out at row (b·Tq + t)·H + h of D elements (< query_len, checked for
        // both), reads pos[b·Tq + t] (< positions_len, checked) and slot[b] (slot map: at least
        // B values, checked; null: b < B ≤ S, checked), and reads cache rows
        // ((sl·Hkv + h/(H/Hkv))·Tmax + p)·D for 0 ≤ sl < S, 0 ≤ p < Tmax only (anything else
        // reads nothing; cache_len = S·Hkv·Tmax·D checked for both caches); D ≤ 256 and every
        // size fits i32 (validated); the grid is within limits (validated).
        unsafe {
            Ok(q.launch(
                self.attend.of::<T>("attention")?,
                cfg,
                &[
                    query.into(),
                    k_cache.into(),
                    v_cache.into(),
                    positions.into(),
                    Arg::opt(slots),
                    out.into(),
                    i(s.batch),
                    i(s.tokens),
                    i(s.heads),
                    i(s.kv_heads),
                    i(s.slots),
                    i(s.max_len),
                    i(s.head_dim),
                    Arg::F32(scale),
                    q.check_flag_arg()?,
                    Arg::U32(self.check),
                    Arg::U32(self.slot_check),
                ],
            )?)
        }
    }

    /// Writes `new_k`, `new_v` (`[batch, tokens, kv_heads, head_dim]`) into the caches at
    /// each token's position (`positions[b·tokens + t]`) in its row's slot (`slots[b]`, or `b`
    /// without a slot map).
    #[allow(clippy::too_many_arguments)]
    pub fn append<T: Float>(
        &self,
        q: &dyn Queue,
        shape: &AttentionShape,
        (new_k, new_v): (&DeviceBuffer<T>, &DeviceBuffer<T>),
        (k_cache, v_cache): (&DeviceBuffer<T>, &DeviceBuffer<T>),
        positions: &DeviceBuffer<i32>,
        slots: Option<&DeviceBuffer<i32>>,
    ) -> Result<()> {
        shape.validate()?;
        check_slots(shape, slots)?;
        let (nl, cl, pl) = (
            shape.new_kv_len()?,
            shape.cache_len()?,
            shape.positions_len()?,
        );
        need("attention new keys", new_k, nl)?;
        need("attention new values", new_v, nl)?;
        need("attention key cache", k_cache, cl)?;
        need("attention value cache", v_cache, cl)?;
        need("attention positions", positions, pl)?;
        let s = shape;
        let i = |v: usize| Arg::I32(v as i32);
        // SAFETY: kv_append_{f32,bf16,f16}(const T* kn, const T* vn, T* kc, T* vc, const int*
        // pos, const int* slot, int B, int Tq, int Hkv, int S, int Tmax, int D, cg_check* flag,
        // unsigned check, unsigned slot_check): element i < B·Tq·Hkv·D (new_kv_len, checked for
        // both inputs) is written to the caches at row ((sl·Hkv + kvh)·Tmax + p)·D with
        // 0 ≤ sl < S and 0 ≤ p < Tmax only (cache_len = S·Hkv·Tmax·D checked for both),
        // reading pos[b·Tq + t] (positions_len checked) and slot[b] (at least B values, checked;
        // null: b < B ≤ S, checked); sizes fit i32 (validated), the loop strides.
        unsafe {
            Ok(q.launch(
                self.append.of::<T>("attention append")?,
                grid_stride(nl),
                &[
                    new_k.into(),
                    new_v.into(),
                    k_cache.into(),
                    v_cache.into(),
                    positions.into(),
                    Arg::opt(slots),
                    i(s.batch),
                    i(s.tokens),
                    i(s.kv_heads),
                    i(s.slots),
                    i(s.max_len),
                    i(s.head_dim),
                    q.check_flag_arg()?,
                    Arg::U32(self.check),
                    Arg::U32(self.slot_check),
                ],
            )?)
        }
    }
}

/// The slot map of a call: at least `batch` values, or (none) `batch ≤ slots`.
fn check_slots(shape: &AttentionShape, slots: Option<&DeviceBuffer<i32>>) -> Result<()> {
    match slots {
        Some(m) => need("attention cache slots", m, shape.batch),
        None if shape.batch <= shape.slots => Ok(()),
        None => Err(NnError::Shape(format!(
            "attention: {} rows for a cache of {} slots (without a slot map, row b is slot b)",
            shape.batch, shape.slots
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> AttentionShape {
        AttentionShape {
            batch: 2,
            slots: 2,
            tokens: 3,
            heads: 8,
            kv_heads: 2,
            max_len: 16,
            head_dim: 64,
        }
    }

    #[test]
    fn shapes_are_checked_before_anything_runs() {
        assert!(shape().validate().is_ok());
        assert_eq!(shape().query_len().unwrap(), 2 * 3 * 8 * 64);
        assert_eq!(shape().cache_len().unwrap(), 2 * 2 * 16 * 64);
        assert_eq!(shape().new_kv_len().unwrap(), 2 * 3 * 2 * 64);
        for bad in [
            AttentionShape {
                kv_heads: 3,
                ..shape()
            },
            AttentionShape {
                head_dim: 257,
                ..shape()
            },
            AttentionShape {
                tokens: 0,
                ..shape()
            },
            AttentionShape {
                slots: 0,
                ..shape()
            },
            AttentionShape {
                batch: 70_000,
                ..shape()
            },
            AttentionShape {
                max_len: usize::MAX,
                ..shape()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_source_instantiates_both_kernels_for_every_type() {
        let src = source();
        for inst in [
            "ATT_INSTANCES(float, f32)",
            "ATT_INSTANCES(bf16_t, bf16)",
            "ATT_INSTANCES(f16_t, f16)",
        ] {
            assert!(src.contains(inst), "{inst}");
        }
        assert!(!src.contains("#include"));
    }
}
