//! Causal self-attention for training (`causal.cu`, its own NVRTC module, compiled after
//! `cast.cu`): [`CausalKernels::forward`] over GPT-2's packed `q | k | v` rows, saving each
//! row's log-sum-exp, and [`CausalKernels::backward`], which recomputes the probabilities from
//! it and writes the gradient of the packed rows. Tiles of 32 rows staged in shared memory as
//! f32: lane j of a warp scores row j of a tile in full, one shuffle reduction per tile for the
//! softmax, then the lanes add the tile's rows split over the head dimension. Softmax and sums
//! in f32 in a fixed order (no atomics: deterministic). One template per kernel, instantiated
//! for f32, bf16 and f16.

use std::sync::Arc;

use cudagraph::{Arg, Device, DeviceBuffer, LaunchConfig, Queue};

use crate::dtype::Float;
use crate::error::{NnError, Result};
use crate::extent::{need, prod};
use crate::kernels::{int, ByType};

/// The largest head dimension the kernels take (32 lanes × 4 values, `CA_SLOTS`).
pub const CAUSAL_MAX_HEAD_DIM: usize = 128;

/// Warps per block, as `CA_WARPS` in the kernels.
const WARPS: usize = 4;

/// Query rows per block of the forward, as `CA_FROWS` in the kernel.
const FWD_ROWS: usize = 16;

/// Query (or key) rows per block of the backward kernels, as `CA_BROWS`.
const BWD_ROWS: usize = 8;

/// Rows of one tile, as `CA_TILE` (the kernels' tile loops step by it).
const TILE: usize = 32;

/// The most sequences or heads of one launch (the grid's y and z limits).
const GRID_YZ: usize = 65_535;

/// The shape of one causal attention call: `batch` sequences of `tokens` tokens, `heads` heads
/// of `head_dim` elements (hidden size `heads · head_dim`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CausalShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub tokens: usize,
    /// Heads.
    pub heads: usize,
    /// Elements per head (at most [`CAUSAL_MAX_HEAD_DIM`]).
    pub head_dim: usize,
}

impl CausalShape {
    /// Elements of the packed projections: `batch · tokens · 3 · heads · head_dim`.
    pub fn qkv_len(&self) -> Result<usize> {
        prod(
            "causal attention qkv",
            &[self.batch, self.tokens, 3, self.heads, self.head_dim],
        )
    }

    /// Elements of the output: `batch · tokens · heads · head_dim`.
    pub fn out_len(&self) -> Result<usize> {
        prod(
            "causal attention output",
            &[self.batch, self.tokens, self.heads, self.head_dim],
        )
    }

    /// Row statistics (log-sum-exp, delta): `batch · heads · tokens`.
    pub fn stats_len(&self) -> Result<usize> {
        prod(
            "causal attention statistics",
            &[self.batch, self.heads, self.tokens],
        )
    }

    /// Checks the shape: every size positive, `head_dim` at most [`CAUSAL_MAX_HEAD_DIM`],
    /// `batch` and `heads` within the grid, every count within the kernels' integers.
    pub fn validate(&self) -> Result<()> {
        let s = self;
        if [s.batch, s.tokens, s.heads, s.head_dim].contains(&0) {
            return Err(NnError::Shape(format!(
                "causal attention: every size must be positive ({s:?})"
            )));
        }
        if s.head_dim > CAUSAL_MAX_HEAD_DIM {
            return Err(NnError::Shape(format!(
                "causal attention: head_dim {} exceeds {CAUSAL_MAX_HEAD_DIM}",
                s.head_dim
            )));
        }
        if s.batch > GRID_YZ || s.heads > GRID_YZ {
            return Err(NnError::Shape(format!(
                "causal attention: {} sequences or {} heads exceed the grid ({GRID_YZ})",
                s.batch, s.heads
            )));
        }
        // Offsets are long long in the kernels; the sizes themselves are int (a tile loop ends
        // at most one tile past T).
        int("causal attention tokens", s.tokens.saturating_add(TILE))?;
        int(
            "causal attention hidden",
            prod("causal attention hidden", &[s.heads, s.head_dim])?,
        )?;
        self.qkv_len()?;
        self.stats_len()?;
        Ok(())
    }

    /// The padded shared row of the kernels, in floats: `4·k` with `k = ⌈head_dim / 4⌉` made
    /// odd (`ca_ld`; at most [`CAUSAL_MAX_HEAD_DIM`]` + 4`).
    fn padded_row(&self) -> usize {
        4 * (self.head_dim.div_ceil(4) | 1)
    }

    /// The launch of a kernel taking `rows` rows per block, with `shared_rows` padded rows of
    /// dynamic shared memory (its own rows and two tiles).
    fn config(&self, rows: usize, shared_rows: usize) -> Result<LaunchConfig> {
        let x = u32::try_from(self.tokens.div_ceil(rows))
            .map_err(|_| NnError::Shape(format!("causal attention: {self:?} exceeds the grid")))?;
        // At most 80 · 132 · 4 = 42,240 bytes (validated head_dim ≤ 128): no opt-in needed.
        let bytes = shared_rows * self.padded_row() * std::mem::size_of::<f32>();
        Ok(LaunchConfig {
            grid: (x, self.heads as u32, self.batch as u32),
            block: (32 * WARPS as u32, 1, 1),
            shared_mem_bytes: bytes as u32,
        })
    }

    /// The forward's launch: `CA_FROWS` query rows and two tiles of shared rows.
    fn fwd_config(&self) -> Result<LaunchConfig> {
        self.config(FWD_ROWS, FWD_ROWS + 2 * TILE)
    }

    /// Both backward kernels' launch: `2·CA_BROWS` rows and two tiles of shared rows.
    fn bwd_config(&self) -> Result<LaunchConfig> {
        self.config(BWD_ROWS, 2 * BWD_ROWS + 2 * TILE)
    }

    fn ints(&self) -> [Arg<'static>; 3] {
        [
            Arg::I32(self.tokens as i32),
            Arg::I32(self.heads as i32),
            Arg::I32(self.head_dim as i32),
        ]
    }
}

/// The CUDA source of the module (after the cast module's conversions).
pub fn source() -> String {
    format!("{}{}", super::cast::SOURCE, include_str!("causal.cu"))
}

/// Every kernel of the module, without its type suffix (`_f32`, `_bf16`, `_f16`).
#[cfg(any(test, feature = "internals"))]
pub const KERNELS: [&str; 3] = ["causal_fwd", "causal_bwd_q", "causal_bwd_kv"];

/// The causal attention kernels of one device (a [`Device::extension`]).
pub struct CausalKernels {
    fwd: ByType,
    bwd_q: ByType,
    bwd_kv: ByType,
}

impl CausalKernels {
    /// The kernels of `device`, compiled on first use.
    pub fn get(device: &Device) -> Result<Arc<Self>> {
        Ok(device.extension(|d| {
            // Relaxed capture mode: the first use may be inside a capture (module loading).
            let m = cudagraph::runtime::with_relaxed_capture(|| {
                d.compile(
                    "cudagraph_nn_causal",
                    &super::module_source("cudagraph_nn_causal"),
                )
            })?;
            Ok(CausalKernels {
                fwd: ByType::load(&m, "causal_fwd")?,
                bwd_q: ByType::load(&m, "causal_bwd_q")?,
                bwd_kv: ByType::load(&m, "causal_bwd_kv")?,
            })
        })?)
    }

    /// `out = softmax(q·kᵀ · scale, causal) · v` per sequence and head from the packed
    /// `qkv`, saving each row's log-sum-exp in `lse` (f32). Buffers as [`CausalShape`]
    /// describes.
    pub fn forward<T: Float>(
        &self,
        q: &dyn Queue,
        shape: &CausalShape,
        qkv: &DeviceBuffer<T>,
        out: &DeviceBuffer<T>,
        lse: &DeviceBuffer<f32>,
        scale: f32,
    ) -> Result<()> {
        shape.validate()?;
        need("causal attention qkv", qkv, shape.qkv_len()?)?;
        need("causal attention output", out, shape.out_len()?)?;
        need("causal attention lse", lse, shape.stats_len()?)?;
        let [t, h, d] = shape.ints();
        let args = [qkv.into(), out.into(), lse.into(), t, h, d, Arg::F32(scale)];
        // SAFETY: causal_fwd_*(qkv, out, lse, T, H, D, scale): block (x, h, b) takes the rows
        // t = 16x + r < T (r < 16) and reads qkv rows (b·T + s)·3C + {0, C, 2C} + h·D + d for
        // s < min(16x + 16, T), d < D (C = H·D; within qkv_len, checked; 16-byte loads only
        // where D and the base allow them, checked in the kernel), writes
        // out[(b·T + t)·C + h·D + d] (out_len, checked) and lse[(b·H + h)·T + t] (stats_len,
        // checked); the grid covers h < H, b < B exactly (validated within the grid), D ≤ 128,
        // T + 32 within int; the dynamic shared memory holds the kernel's 16 + 2·32 rows of
        // ca_ld(D) floats (fwd_config, the same formula).
        unsafe {
            Ok(q.launch(
                self.fwd.of::<T>("causal attention")?,
                shape.fwd_config()?,
                &args,
            )?)
        }
    }

    /// The gradient `dqkv` of the packed projections from the output's gradient `dout`, the
    /// forward's `qkv`, `out` and `lse`; `delta` (f32, [`CausalShape::stats_len`]) is scratch
    /// the two kernels share. Every element of `dqkv` is written.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<T: Float>(
        &self,
        q: &dyn Queue,
        shape: &CausalShape,
        (qkv, out, lse): (&DeviceBuffer<T>, &DeviceBuffer<T>, &DeviceBuffer<f32>),
        dout: &DeviceBuffer<T>,
        delta: &DeviceBuffer<f32>,
        dqkv: &DeviceBuffer<T>,
        scale: f32,
    ) -> Result<()> {
        shape.validate()?;
        let (ql, ol, sl) = (shape.qkv_len()?, shape.out_len()?, shape.stats_len()?);
        need("causal attention qkv", qkv, ql)?;
        need("causal attention dqkv", dqkv, ql)?;
        need("causal attention output", out, ol)?;
        need("causal attention output gradient", dout, ol)?;
        need("causal attention lse", lse, sl)?;
        need("causal attention delta", delta, sl)?;
        let cfg = shape.bwd_config()?;
        let [t, h, d] = shape.ints();
        let args = [
            qkv.into(),
            out.into(),
            dout.into(),
            lse.into(),
            delta.into(),
            dqkv.into(),
            t,
            h,
            d,
            Arg::F32(scale),
        ];
        // SAFETY: causal_bwd_q_*(qkv, out, dout, lse, delta, dqkv, T, H, D, scale): block
        // (x, h, b) takes the query rows t = 8x + r < T (r < 8), reads qkv's q of those rows and
        // k, v of rows s < min(8x + 8, T) (within qkv_len), out and dout at
        // (b·T + t)·C + h·D + d (out_len), lse at (b·H + h)·T + t (stats_len), and writes delta
        // there and dqkv's q part of row t (qkv_len); every extent checked above, the grid
        // covers h < H, b < B exactly, D ≤ 128, T + 32 within int; the dynamic shared memory
        // holds the kernel's 2·8 + 2·32 rows of ca_ld(D) floats (bwd_config).
        unsafe { q.launch(self.bwd_q.of::<T>("causal attention")?, cfg, &args)? };
        let args = [
            qkv.into(),
            dout.into(),
            lse.into(),
            delta.into(),
            dqkv.into(),
            t,
            h,
            d,
            Arg::F32(scale),
        ];
        // SAFETY: causal_bwd_kv_*(qkv, dout, lse, delta, dqkv, T, H, D, scale): block (x, h, b)
        // takes the key rows s = 8x + r < T (r < 8), reads qkv's k, v of those rows and q of
        // rows t < T from the tile of 32 holding 8x on, dout of those rows, lse and delta at
        // (b·H + h)·T + t, and writes dqkv's k and v parts of row s; every extent checked
        // above, the grid as for causal_bwd_q.
        unsafe { Ok(q.launch(self.bwd_kv.of::<T>("causal attention")?, cfg, &args)?) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_instantiated_for_three_types() {
        let src = source();
        for k in KERNELS {
            assert!(src.contains(&format!("void {k}_##S(")), "{k}");
        }
        for inst in [
            "CA_INSTANCES(float, f32)",
            "CA_INSTANCES(bf16_t, bf16)",
            "CA_INSTANCES(f16_t, f16)",
        ] {
            assert!(src.contains(inst), "{inst}");
        }
        assert!(!src.contains("#include"), "NVRTC has no include path here");
        assert!(src.contains(&format!("#define CA_WARPS {WARPS}")));
        assert!(src.contains(&format!("#define CA_FROWS {FWD_ROWS}")));
        assert!(src.contains(&format!("#define CA_BROWS {BWD_ROWS}")));
        assert!(src.contains(&format!("#define CA_TILE {TILE}")));
        // The shared rows: 4·k floats with k odd, at least the largest head dimension.
        assert!(src.contains(&format!("#define CA_LD {}", CAUSAL_MAX_HEAD_DIM + 4)));
        assert_eq!((CAUSAL_MAX_HEAD_DIM / 4 + 1) % 2, 1);
        assert!(src.contains(&format!("#define CA_SLOTS {}", CAUSAL_MAX_HEAD_DIM / 32)));
    }

    #[test]
    fn shapes_are_checked() {
        let s = CausalShape {
            batch: 2,
            tokens: 5,
            heads: 3,
            head_dim: 8,
        };
        s.validate().unwrap();
        assert_eq!(s.qkv_len().unwrap(), 2 * 5 * 3 * 24);
        assert_eq!(s.out_len().unwrap(), 2 * 5 * 24);
        assert_eq!(s.stats_len().unwrap(), 30);
        assert_eq!(s.fwd_config().unwrap().grid, (1, 3, 2));
        assert_eq!(s.bwd_config().unwrap().grid, (1, 3, 2));
        let long = CausalShape { tokens: 17, ..s };
        assert_eq!(long.fwd_config().unwrap().grid, (2, 3, 2));
        assert_eq!(long.bwd_config().unwrap().grid, (3, 3, 2));
        // Shared rows of ca_ld(head_dim) floats: 4·odd, at least head_dim.
        for (d, ld) in [
            (1, 4),
            (4, 4),
            (5, 12),
            (8, 12),
            (12, 12),
            (40, 44),
            (64, 68),
            (128, 132),
        ] {
            assert_eq!(CausalShape { head_dim: d, ..s }.padded_row(), ld, "{d}");
        }
        assert_eq!(s.fwd_config().unwrap().shared_mem_bytes, 80 * 12 * 4);
        let widest = CausalShape { head_dim: 128, ..s };
        assert_eq!(widest.fwd_config().unwrap().shared_mem_bytes, 42_240);
        assert_eq!(widest.bwd_config().unwrap().shared_mem_bytes, 42_240);
        for bad in [
            CausalShape { batch: 0, ..s },
            CausalShape { tokens: 0, ..s },
            CausalShape { head_dim: 129, ..s },
            CausalShape { heads: 70_000, ..s },
            CausalShape {
                tokens: i32::MAX as usize - 31,
                ..s
            },
        ] {
            assert!(matches!(bad.validate(), Err(NnError::Shape(_))), "{bad:?}");
        }
    }
}
