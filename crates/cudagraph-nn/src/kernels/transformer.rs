//! The transformer layers' kernels (`transformer.cu`, compiled after `cast.cu` as its own NVRTC
//! module): LayerNorm, RMSNorm, GELU, SiLU, SwiGLU, rotary position embeddings and embedding
//! lookup, forward and backward, one CUDA template per operation instantiated for f32, bf16
//! and f16. Values are computed in f32 and rounded once on store; reductions run in a fixed
//! order (deterministic, replay equal to eager bit for bit). Weights and saved row statistics
//! are f32.
//!
//! Every launcher is generic over [`Float`] and checks every extent first, from the same
//! integers that go to the kernel.

use std::sync::Arc;

use cudagraph::{Arg, Device, DeviceBuffer, LaunchConfig, Queue, QueueExt};

use crate::dtype::Float;
use crate::error::{NnError, Result};
use crate::extent::{need, prod};
use crate::kernels::{count, grid_stride, int, ByType};

/// The CUDA source of the module (after the cast module's conversions).
pub fn source() -> String {
    format!("{}{}", super::cast::SOURCE, include_str!("transformer.cu"))
}

/// Every kernel of the module, without its type suffix (`_f32`, `_bf16`, `_f16`).
#[cfg(any(test, feature = "internals"))]
pub const KERNELS: [&str; 13] = [
    "ln_fwd",
    "norm_bwd_dx",
    "norm_bwd_wb",
    "rms_fwd",
    "gelu_fwd",
    "gelu_bwd",
    "silu_fwd",
    "silu_bwd",
    "swiglu_fwd",
    "swiglu_bwd",
    "rope",
    "embed_fwd",
    "embed_bwd",
];

/// Threads of the row kernels (`TF_ROW_THREADS` in the source: one block per row, or for
/// `ln_fwd` one warp per row).
const ROW_THREADS: u32 = 256;
/// Rows of `ln_fwd` per block, one warp each (`TF_LN_ROWS`).
const LN_ROWS: usize = ROW_THREADS as usize / 32;
/// Threads (and ids per shared tile) of `embed_links` (`EMB_TILE` in the source).
const EMB_TILE: u32 = 256;
/// Columns one block of the weight-gradient kernel covers.
const WB_COLS: usize = 32;

/// A grid of `n` blocks (`n ≥ 1`, within the grid's x limit).
fn grid(what: &'static str, n: usize) -> Result<u32> {
    u32::try_from(n.max(1))
        .ok()
        .filter(|&g| g <= i32::MAX as u32)
        .ok_or_else(|| NnError::Shape(format!("{what}: {n} blocks exceed the grid")))
}

/// Rows and columns of a row-wise operation: `rows · cols` elements, each within `int`.
fn row_dims(what: &'static str, rows: usize, cols: usize) -> Result<(usize, i32, i32)> {
    let n = prod(what, &[rows, cols])?;
    if cols == 0 {
        return Err(NnError::Shape(format!("{what}: rows of zero elements")));
    }
    // Columns index with int (plus the loop step); rows with long long.
    let c = super::int_loop(what, cols, ROW_THREADS as usize)?;
    Ok((n, int(what, rows)?, c))
}

/// Rotary embedding geometry: `tokens` rows of `heads` heads of `head_dim` components, the
/// first `rot` of them rotated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeDims {
    /// Rows (tokens) of the tensor.
    pub tokens: usize,
    /// Heads per token.
    pub heads: usize,
    /// Components per head (even).
    pub head_dim: usize,
    /// Components rotated, from the first (even, `≤ head_dim`, `> 0`).
    pub rot: usize,
    /// Pairs `(2k, 2k + 1)` (GPT-J's `rotate_every_two`) instead of `(k, k + rot/2)`
    /// (`rotate_half`).
    pub every_two: bool,
}

impl RopeDims {
    /// Checks the geometry (`NnError::Shape`); returns the element count.
    pub fn check(&self) -> Result<usize> {
        let RopeDims { head_dim, rot, .. } = *self;
        if head_dim % 2 != 0 || rot % 2 != 0 || rot == 0 || rot > head_dim {
            return Err(NnError::Shape(format!(
                "rotary: head_dim {head_dim} and rotary dimension {rot} must be even, with \
                 0 < rotary dimension ≤ head_dim"
            )));
        }
        prod("rotary", &[self.tokens, self.heads, head_dim])
    }
}

/// The transformer kernels of one device (a [`Device::extension`]).
pub struct TransformerKernels {
    ln_fwd: ByType,
    norm_bwd_dx: ByType,
    norm_bwd_wb: ByType,
    rms_fwd: ByType,
    gelu_fwd: ByType,
    gelu_bwd: ByType,
    silu_fwd: ByType,
    silu_bwd: ByType,
    swiglu_fwd: ByType,
    swiglu_bwd: ByType,
    rope: ByType,
    embed_fwd: ByType,
    embed_bwd: ByType,
    embed_links: cudagraph::Function,
}

impl TransformerKernels {
    /// The kernels of `device`, compiled on first use.
    pub fn get(device: &Device) -> Result<Arc<Self>> {
        Ok(device.extension(|d| {
            // Relaxed capture mode: the first use may be inside a capture (module loading).
            let m = cudagraph::runtime::with_relaxed_capture(|| {
                d.compile(
                    "cudagraph_nn_transformer",
                    &super::module_source("cudagraph_nn_transformer"),
                )
            })?;
            let t = |name: &str| ByType::load(&m, name);
            Ok(TransformerKernels {
                ln_fwd: t("ln_fwd")?,
                norm_bwd_dx: t("norm_bwd_dx")?,
                norm_bwd_wb: t("norm_bwd_wb")?,
                rms_fwd: t("rms_fwd")?,
                gelu_fwd: t("gelu_fwd")?,
                gelu_bwd: t("gelu_bwd")?,
                silu_fwd: t("silu_fwd")?,
                silu_bwd: t("silu_bwd")?,
                swiglu_fwd: t("swiglu_fwd")?,
                swiglu_bwd: t("swiglu_bwd")?,
                rope: t("rope")?,
                embed_fwd: t("embed_fwd")?,
                embed_bwd: t("embed_bwd")?,
                embed_links: m.function("embed_links")?,
            })
        })?)
    }

    /// LayerNorm over the last dimension of `x: [rows, cols]` into `y`, with weight `w` and
    /// optional bias `b` (`[cols]`, f32); saves each row's `mean` and `rstd` (`[rows]`, f32).
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_fwd<T: Float>(
        &self,
        q: &dyn Queue,
        x: &DeviceBuffer<T>,
        w: &DeviceBuffer<f32>,
        b: Option<&DeviceBuffer<f32>>,
        y: &DeviceBuffer<T>,
        (mean, rstd): (&DeviceBuffer<f32>, &DeviceBuffer<f32>),
        (rows, cols): (usize, usize),
        eps: f32,
    ) -> Result<()> {
        let (n, r, c) = row_dims("layer_norm", rows, cols)?;
        need("layer_norm x", x, n)?;
        need("layer_norm y", y, n)?;
        need("layer_norm weight", w, cols)?;
        if let Some(b) = b {
            need("layer_norm bias", b, cols)?;
        }
        need("layer_norm mean", mean, rows)?;
        need("layer_norm rstd", rstd, rows)?;
        if rows == 0 {
            return Ok(());
        }
        // One warp per row, LN_ROWS rows a block.
        let cfg = LaunchConfig::linear(grid("layer_norm", rows.div_ceil(LN_ROWS))?, ROW_THREADS);
        let args = [
            x.into(),
            w.into(),
            Arg::opt(b),
            y.into(),
            mean.into(),
            rstd.into(),
            Arg::I32(r),
            Arg::I32(c),
            Arg::F32(eps),
        ];
        // SAFETY: ln_fwd_*(x, w, b, y, mean, rstd, rows, cols, eps): warp w of block k takes
        // row r = 8k + w, only when r < rows, reads x[r·cols + c], w[c], b[c] (b null: not
        // read) and writes y[r·cols + c] for c < cols, mean[r], rstd[r]; x, y hold rows·cols,
        // w and b cols, mean and rstd rows (checked); 256 threads (8 warps, TF_LN_ROWS).
        unsafe { Ok(q.launch(self.ln_fwd.of::<T>("ln_fwd")?, cfg, &args)?) }
    }

    /// RMSNorm over the last dimension of `x: [rows, cols]` into `y` with weight `w`
    /// (`[cols]`, f32); saves each row's `rstd` (`[rows]`, f32).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_fwd<T: Float>(
        &self,
        q: &dyn Queue,
        x: &DeviceBuffer<T>,
        w: &DeviceBuffer<f32>,
        y: &DeviceBuffer<T>,
        rstd: &DeviceBuffer<f32>,
        (rows, cols): (usize, usize),
        eps: f32,
    ) -> Result<()> {
        let (n, _, c) = row_dims("rms_norm", rows, cols)?;
        need("rms_norm x", x, n)?;
        need("rms_norm y", y, n)?;
        need("rms_norm weight", w, cols)?;
        need("rms_norm rstd", rstd, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig::linear(grid("rms_norm", rows)?, ROW_THREADS);
        let args = [
            x.into(),
            w.into(),
            y.into(),
            rstd.into(),
            Arg::I32(c),
            Arg::F32(eps),
        ];
        // SAFETY: rms_fwd_*(x, w, y, rstd, cols, eps): block r < rows reads x[r·cols + c],
        // w[c] and writes y[r·cols + c] for c < cols and rstd[r]; extents checked above.
        unsafe { Ok(q.launch(self.rms_fwd.of::<T>("rms_fwd")?, cfg, &args)?) }
    }

    /// The input gradient of LayerNorm (`mean` given) or RMSNorm (`mean` = `None`):
    /// `dx: [rows, cols]` from `dy`, `x`, the weight and the saved row statistics.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_bwd_dx<T: Float>(
        &self,
        q: &dyn Queue,
        (dy, x): (&DeviceBuffer<T>, &DeviceBuffer<T>),
        w: &DeviceBuffer<f32>,
        (mean, rstd): (Option<&DeviceBuffer<f32>>, &DeviceBuffer<f32>),
        dx: &DeviceBuffer<T>,
        (rows, cols): (usize, usize),
    ) -> Result<()> {
        let (n, _, c) = row_dims("norm backward", rows, cols)?;
        need("norm backward dy", dy, n)?;
        need("norm backward x", x, n)?;
        need("norm backward dx", dx, n)?;
        need("norm backward weight", w, cols)?;
        if let Some(m) = mean {
            need("norm backward mean", m, rows)?;
        }
        need("norm backward rstd", rstd, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig::linear(grid("norm backward", rows)?, ROW_THREADS);
        let args = [
            dy.into(),
            x.into(),
            w.into(),
            // RMSNorm: no mean; the kernel does not read it (rstd stands in, never null).
            mean.unwrap_or(rstd).into(),
            rstd.into(),
            dx.into(),
            Arg::I32(c),
            Arg::I32(mean.is_some() as i32),
        ];
        // SAFETY: norm_bwd_dx_*(dy, x, w, mean, rstd, dx, cols, centered): block r < rows
        // reads dy, x at r·cols + c and w[c] for c < cols, rstd[r], mean[r] only when
        // centered (= mean given), and writes dx[r·cols + c]; extents checked above.
        unsafe { Ok(q.launch(self.norm_bwd_dx.of::<T>("norm_bwd_dx")?, cfg, &args)?) }
    }

    /// The weight gradient `dw[c] = Σ_r dy · xhat` (and with `db`, `db[c] = Σ_r dy`) of
    /// LayerNorm (`mean` given) or RMSNorm, in f32, summed over rows in a fixed order.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_bwd_wb<T: Float>(
        &self,
        q: &dyn Queue,
        (dy, x): (&DeviceBuffer<T>, &DeviceBuffer<T>),
        (mean, rstd): (Option<&DeviceBuffer<f32>>, &DeviceBuffer<f32>),
        dw: &DeviceBuffer<f32>,
        db: Option<&DeviceBuffer<f32>>,
        (rows, cols): (usize, usize),
    ) -> Result<()> {
        let (n, r, c) = row_dims("norm weight gradient", rows, cols)?;
        need("norm weight gradient dy", dy, n)?;
        need("norm weight gradient x", x, n)?;
        if let Some(m) = mean {
            need("norm weight gradient mean", m, rows)?;
        }
        need("norm weight gradient rstd", rstd, rows)?;
        need("norm weight gradient dw", dw, cols)?;
        if let Some(db) = db {
            need("norm weight gradient db", db, cols)?;
        }
        // Rows loop by 8 from below 8.
        let r = super::int_loop("norm weight gradient rows", r as usize, 8)?;
        let cfg = LaunchConfig::linear(grid("norm weight gradient", cols.div_ceil(WB_COLS))?, 256);
        let args = [
            dy.into(),
            x.into(),
            // RMSNorm: no mean; the kernel does not read it (rstd stands in, never null).
            mean.unwrap_or(rstd).into(),
            rstd.into(),
            dw.into(),
            Arg::opt(db),
            Arg::I32(r),
            Arg::I32(c),
            Arg::I32(mean.is_some() as i32),
        ];
        // SAFETY: norm_bwd_wb_*(dy, x, mean, rstd, dw, db, rows, cols, centered): column
        // c = block·32 + lane, only when c < cols, reads dy, x at r·cols + c, rstd[r] and (when
        // centered, mean given) mean[r] for r < rows, and writes dw[c] and (non-null) db[c];
        // extents checked above; 256 threads (the kernel's 8 × 32 shared arrays).
        unsafe { Ok(q.launch(self.norm_bwd_wb.of::<T>("norm_bwd_wb")?, cfg, &args)?) }
    }

    /// `y = gelu(x)` over `x` (exact, or with `tanh_approx` PyTorch's tanh form); `y` as long.
    pub fn gelu_fwd<T: Float>(
        &self,
        q: &dyn Queue,
        x: &DeviceBuffer<T>,
        y: &DeviceBuffer<T>,
        tanh_approx: bool,
    ) -> Result<()> {
        let n = x.len();
        need("gelu y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            x.into(),
            y.into(),
            count("gelu", n)?,
            Arg::I32(tanh_approx as i32),
        ];
        // One thread per 16 bytes (the kernel moves aligned groups of 16 / size elements; its
        // loops stride over the grid, so any grid covers every element).
        let cfg = grid_stride(n.div_ceil(16 / std::mem::size_of::<T>()));
        // SAFETY: gelu_fwd_*(x, y, n, tanh) touches i < n only (16-byte groups only below
        // n / group · group, with both bases aligned, checked in the kernel); both hold n
        // elements.
        unsafe { Ok(q.launch(self.gelu_fwd.of::<T>("gelu_fwd")?, cfg, &args)?) }
    }

    /// `dx = dy · gelu'(x)` over `dy` (`x`, `dx` as long).
    pub fn gelu_bwd<T: Float>(
        &self,
        q: &dyn Queue,
        dy: &DeviceBuffer<T>,
        x: &DeviceBuffer<T>,
        dx: &DeviceBuffer<T>,
        tanh_approx: bool,
    ) -> Result<()> {
        let n = dy.len();
        need("gelu backward x", x, n)?;
        need("gelu backward dx", dx, n)?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            dy.into(),
            x.into(),
            dx.into(),
            count("gelu backward", n)?,
            Arg::I32(tanh_approx as i32),
        ];
        // SAFETY: gelu_bwd_*(dy, x, dx, n, tanh) touches i < n only; the three hold n.
        unsafe { Ok(q.launch(self.gelu_bwd.of::<T>("gelu_bwd")?, grid_stride(n), &args)?) }
    }

    /// `y = x · σ(x)` over `x`; `y` as long.
    pub fn silu_fwd<T: Float>(
        &self,
        q: &dyn Queue,
        x: &DeviceBuffer<T>,
        y: &DeviceBuffer<T>,
    ) -> Result<()> {
        let n = x.len();
        need("silu y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: silu_fwd_*(x, y, n) touches i < n only; both hold n elements.
        unsafe {
            Ok(q.launch(
                self.silu_fwd.of::<T>("silu_fwd")?,
                grid_stride(n),
                &[x.into(), y.into(), count("silu", n)?],
            )?)
        }
    }

    /// `dx = dy · silu'(x)` over `dy` (`x`, `dx` as long).
    pub fn silu_bwd<T: Float>(
        &self,
        q: &dyn Queue,
        dy: &DeviceBuffer<T>,
        x: &DeviceBuffer<T>,
        dx: &DeviceBuffer<T>,
    ) -> Result<()> {
        let n = dy.len();
        need("silu backward x", x, n)?;
        need("silu backward dx", dx, n)?;
        if n == 0 {
            return Ok(());
        }
        let args = [dy.into(), x.into(), dx.into(), count("silu backward", n)?];
        // SAFETY: silu_bwd_*(dy, x, dx, n) touches i < n only; the three hold n.
        unsafe { Ok(q.launch(self.silu_bwd.of::<T>("silu_bwd")?, grid_stride(n), &args)?) }
    }

    /// `y = silu(gate) · up` over `gate` (`up`, `y` as long).
    pub fn swiglu_fwd<T: Float>(
        &self,
        q: &dyn Queue,
        gate: &DeviceBuffer<T>,
        up: &DeviceBuffer<T>,
        y: &DeviceBuffer<T>,
    ) -> Result<()> {
        let n = gate.len();
        need("swiglu up", up, n)?;
        need("swiglu y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        let args = [gate.into(), up.into(), y.into(), count("swiglu", n)?];
        // SAFETY: swiglu_fwd_*(gate, up, y, n) touches i < n only; the three hold n.
        unsafe {
            Ok(q.launch(
                self.swiglu_fwd.of::<T>("swiglu_fwd")?,
                grid_stride(n),
                &args,
            )?)
        }
    }

    /// `dgate = dy · up · silu'(gate)`, `dup = dy · silu(gate)` over `dy` (every buffer as
    /// long).
    pub fn swiglu_bwd<T: Float>(
        &self,
        q: &dyn Queue,
        dy: &DeviceBuffer<T>,
        (gate, up): (&DeviceBuffer<T>, &DeviceBuffer<T>),
        (dgate, dup): (&DeviceBuffer<T>, &DeviceBuffer<T>),
    ) -> Result<()> {
        let n = dy.len();
        need("swiglu backward gate", gate, n)?;
        need("swiglu backward up", up, n)?;
        need("swiglu backward dgate", dgate, n)?;
        need("swiglu backward dup", dup, n)?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            dy.into(),
            gate.into(),
            up.into(),
            dgate.into(),
            dup.into(),
            count("swiglu backward", n)?,
        ];
        // SAFETY: swiglu_bwd_*(dy, gate, up, dgate, dup, n) touches i < n only; all hold n.
        unsafe {
            Ok(q.launch(
                self.swiglu_bwd.of::<T>("swiglu_bwd")?,
                grid_stride(n),
                &args,
            )?)
        }
    }

    /// Rotary position embedding of `x` into `y` (`[tokens, heads, head_dim]`) at the
    /// positions `pos` (one per token, at least `tokens`) with the frequencies `inv_freq`
    /// (`rot / 2`); `inverse` rotates back (the backward).
    #[allow(clippy::too_many_arguments)]
    pub fn rope<T: Float>(
        &self,
        q: &dyn Queue,
        x: &DeviceBuffer<T>,
        y: &DeviceBuffer<T>,
        pos: &DeviceBuffer<i32>,
        inv_freq: &DeviceBuffer<f32>,
        d: RopeDims,
        inverse: bool,
    ) -> Result<()> {
        let n = d.check()?;
        need("rotary x", x, n)?;
        need("rotary y", y, n)?;
        need("rotary positions", pos, d.tokens)?;
        need("rotary frequencies", inv_freq, d.rot / 2)?;
        if n == 0 {
            return Ok(());
        }
        // Tokens, heads and head_dim within int; the element index is long long.
        let args = [
            x.into(),
            y.into(),
            pos.into(),
            inv_freq.into(),
            Arg::I32(int("rotary tokens", d.tokens)?),
            Arg::I32(int("rotary heads", d.heads)?),
            Arg::I32(int("rotary head_dim", d.head_dim)?),
            Arg::I32(int("rotary dimension", d.rot)?),
            Arg::I32(d.every_two as i32),
            Arg::I32(inverse as i32),
        ];
        // SAFETY: rope_*(x, y, pos, inv_freq, tokens, heads, head_dim, rot, every_two, inverse)
        // runs i < tokens·heads·head_dim/2; each reads pos[t] (t < tokens), inv_freq[k]
        // (k < rot/2) and x, writes y at indices below tokens·heads·head_dim (head_dim and rot
        // even, rot ≤ head_dim: checked); extents checked above.
        unsafe { Ok(q.launch(self.rope.of::<T>("rope")?, grid_stride(n / 2), &args)?) }
    }

    /// `y[t, :] = w[ids[t], :]` for `t < tokens` (`w: [vocab, dim]`); an id outside
    /// `[0, vocab)` gives a row of zeros.
    #[allow(clippy::too_many_arguments)]
    pub fn embed_fwd<T: Float>(
        &self,
        q: &dyn Queue,
        ids: &DeviceBuffer<i32>,
        w: &DeviceBuffer<T>,
        y: &DeviceBuffer<T>,
        (tokens, dim, vocab): (usize, usize, usize),
    ) -> Result<()> {
        let n = prod("embedding", &[tokens, dim])?;
        need("embedding ids", ids, tokens)?;
        need(
            "embedding weight",
            w,
            prod("embedding weight", &[vocab, dim])?,
        )?;
        need("embedding y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            ids.into(),
            w.into(),
            y.into(),
            Arg::I32(int("embedding tokens", tokens)?),
            Arg::I32(int("embedding dim", dim)?),
            Arg::I32(int("embedding vocab", vocab)?),
        ];
        // SAFETY: embed_fwd_*(ids, w, y, tokens, dim, vocab) runs i < tokens·dim (y's
        // extent), reads ids[t] (t < tokens) and w[id·dim + c] only for 0 ≤ id < vocab,
        // c < dim (within vocab·dim); extents checked above.
        unsafe { Ok(q.launch(self.embed_fwd.of::<T>("embed_fwd")?, grid_stride(n), &args)?) }
    }

    /// `dw[ids[t], :] = Σ` of `dy[t', :]` over the tokens `t'` with that id, into the f32
    /// gradient `dw: [vocab, dim]`, which the caller zeroed (rows of ids not used stay as
    /// they are); ids outside `[0, vocab)` are skipped.
    pub fn embed_bwd<T: Float>(
        &self,
        q: &dyn Queue,
        ids: &DeviceBuffer<i32>,
        dy: &DeviceBuffer<T>,
        dw: &DeviceBuffer<f32>,
        (tokens, dim, vocab): (usize, usize, usize),
    ) -> Result<()> {
        let n = prod("embedding backward", &[tokens, dim])?;
        need("embedding backward ids", ids, tokens)?;
        need("embedding backward dy", dy, n)?;
        let vd = prod("embedding backward weight", &[vocab, dim])?;
        need("embedding backward dw", dw, vd)?;
        if n == 0 {
            return Ok(());
        }
        let tokens_i = int("embedding tokens", tokens)?;
        // Each token's next token with the same id, and whether it is its id's first.
        let links = q.alloc::<i32>(prod("embedding links", &[tokens, 2])?)?;
        let blocks = grid("embedding links", tokens.div_ceil(EMB_TILE as usize))?;
        let link_args = [ids.into(), (&links).into(), Arg::I32(tokens_i)];
        // SAFETY: embed_links(ids, links, tokens) runs one thread per token t < tokens (blocks
        // of EMB_TILE, the tile size in the source), reads ids[0..tokens) and writes
        // links[2t], links[2t + 1]; both extents checked (links allocated for 2·tokens).
        unsafe {
            q.launch(
                &self.embed_links,
                LaunchConfig::linear(blocks, EMB_TILE),
                &link_args,
            )?
        };
        let args = [
            ids.into(),
            (&links).into(),
            dy.into(),
            dw.into(),
            Arg::I32(tokens_i),
            Arg::I32(int("embedding dim", dim)?),
            Arg::I32(int("embedding vocab", vocab)?),
        ];
        // SAFETY: embed_bwd_*(ids, links, dy, dw, tokens, dim, vocab) runs i < tokens·dim,
        // reads ids[t], links[2t..2t+2] (whose next-token entries are tokens u < tokens or -1,
        // written just above) and dy[u·dim + c] for u < tokens, c < dim, and writes
        // dw[id·dim + c] only for 0 ≤ id < vocab; extents checked above.
        unsafe { Ok(q.launch(self.embed_bwd.of::<T>("embed_bwd")?, grid_stride(n), &args)?) }
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
            "TF_INSTANCES(float, f32)",
            "TF_INSTANCES(bf16_t, bf16)",
            "TF_INSTANCES(f16_t, f16)",
        ] {
            assert!(src.contains(inst), "{inst}");
        }
        assert!(!src.contains("#include"), "NVRTC has no include path here");
        assert!(src.contains("#define TF_ROW_THREADS 256"));
        assert!(src.contains("#define TF_LN_ROWS (TF_ROW_THREADS / 32)"));
        assert_eq!(LN_ROWS, 8);
        assert_eq!(ROW_THREADS, 256);
    }

    #[test]
    fn rotary_geometry_is_checked() {
        let d = RopeDims {
            tokens: 5,
            heads: 3,
            head_dim: 8,
            rot: 8,
            every_two: false,
        };
        assert_eq!(d.check().unwrap(), 120);
        for (head_dim, rot) in [(7, 6), (8, 7), (8, 0), (8, 10)] {
            let bad = RopeDims { head_dim, rot, ..d };
            assert!(matches!(bad.check(), Err(NnError::Shape(_))), "{bad:?}");
        }
    }

    #[test]
    fn row_sizes_are_checked() {
        assert!(row_dims("x", 4, 0).is_err());
        assert!(row_dims("x", 1 << 32, 1).is_err());
        assert!(row_dims("x", 1, i32::MAX as usize).is_err());
        assert_eq!(row_dims("x", 5, 7).unwrap(), (35, 5, 7));
        assert!(grid("x", 0).unwrap() == 1);
    }
}
