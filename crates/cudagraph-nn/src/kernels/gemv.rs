//! The few-row product kernel of the half-precision products (`gemv.cu`, its own NVRTC module,
//! compiled after `cast.cu`): `y[r, j] = act(alpha·Σ_p x[r, p]·w[j, p] + beta·y[r, j] + bias[j])`
//! for `r < m ≤` [`GEMV_MAX_M`], `x: [m, k]` and `w: [n, k]` (PyTorch's Linear layout) of bf16 or
//! f16, `y` of that type or f32, f32 sums in a fixed order and one rounding on store. Two
//! memory-bound kernels ([`FewRow`]): the lane kernel (each warp streams one weight row with
//! 16-byte loads and sums with FMAs, for at most [`GEMV_MAX_M`] rows) and the tensor-core one
//! (each warp streams 16 weight rows into `mma.sync` with x's rows as the other operand, for at
//! most [`GEMV_MMA_MAX_M`] rows); in both `ks` warps of a block split the depth (see
//! `gemv.cu`). Used by [`crate::engine::gemm_lowp()`] as the engines `gemv:KS` and
//! `gemv-mma:KS`. The lane kernel also runs on rows it computes itself ([`RowsFrom`]: the
//! decoder's norm with its residual add, or SwiGLU), one launch with the bits of two, for
//! products of at most [`GEMV_FUSED_MAX_M`] rows whose grid fits the device at once
//! ([`fused_ok`]; [`GemvKernels::run_from`]).

use std::sync::Arc;

use cudagraph::{Arg, Device, DeviceBuffer, Function, LaunchConfig, Queue};

use crate::dtype::{Dtype, Float};
use crate::error::{NnError, Result};
use crate::extent::{gemm_on_device, need, on_device, prod};
use crate::ffi::blas::Epilogue;
use crate::kernels::int;

/// The most rows the kernel takes. Every warp reads the m rows of x for each 16-byte vector of
/// its weight row (from L1: the same positions for every column), so L1 traffic is m times the
/// weight stream: at 16 rows about 16 × 14 bytes a clock per SM on an H100 streaming HBM at
/// full rate, near L1's 128, where the tensor-core kernels are as fast; beyond that they win.
pub const GEMV_MAX_M: usize = 16;

/// The most rows the tensor-core kernel takes (eight tiles of eight rows). Each warp reads
/// x's rows again for every chunk of its weight rows (16 bytes a lane a tile for 32 bytes of
/// weights), so the x traffic grows with the rows; loading a few chunks' x vectors together,
/// every tile at once, keeps that from being a chain of L2 round trips. Measured on an H100
/// against cuBLASLt, it wins products of 8 rows, output heads of 8 to 64 rows and some
/// products of 32 rows inside a captured step (the registry's choice, tuned in the graph), and
/// is 1.5 to 2.5 times slower on products of 64 rows, where the registry keeps cuBLASLt.
pub const GEMV_MMA_MAX_M: usize = 64;

/// The most rows the lane kernel takes on rows it computes itself ([`RowsFrom`]; `M` of
/// `gemv_norm_S_mM` and `gemv_swiglu_S_mM`).
pub const GEMV_FUSED_MAX_M: usize = 4;

/// Rows per fused instance.
const FUSED_ROWS: [usize; 3] = [1, 2, 4];

/// Blocks a multiprocessor a fused launch may have at most (its grid, one block a column
/// group, in one wave at the fused kernels' occupancy): every block computes the rows again
/// and the fused kernels hold more registers than the plain one, so a launch of more blocks
/// pays more than the launch it saves (on the H100, a Llama-shaped gate|up product of 8192
/// blocks took 38.7 µs fused against 26.9 plain, GPT-2 small's q|k|v product of 288 blocks
/// fused took a step from 0.339 to 0.315 ms).
const FUSED_BLOCKS_PER_SM: usize = 4;

/// Shared memory kept for the fused kernels' static arrays (the block sums and the norm's
/// warp sums: well under this), out of what a block may use.
const FUSED_STATIC_SMEM: usize = 1024;

/// The widest row the norm of a fused launch takes (`DEC_ROW_THREADS · DEC_NORM_LOADS · 8`:
/// each thread keeps its part of the row in registers).
const FUSED_NORM_MAX_K: usize = 256 * 4 * 8;

/// The depth splits (warps sharing one column, or one 16-column tile) the kernels take.
pub const GEMV_SPLITS: [u8; 4] = [1, 2, 4, 8];

/// Which kernel of the module runs a product, with the warps splitting the depth of each
/// column (lane kernel) or 16-column tile (tensor-core kernel): one of [`GEMV_SPLITS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FewRow {
    /// FMAs, one weight row a warp; at most [`GEMV_MAX_M`] rows.
    Lanes(u8),
    /// `mma.sync` m16n8k16, 16 weight rows a warp; at most [`GEMV_MMA_MAX_M`] rows.
    Mma(u8),
}

impl FewRow {
    /// The warps splitting the depth.
    pub fn splits(self) -> u8 {
        match self {
            FewRow::Lanes(ks) | FewRow::Mma(ks) => ks,
        }
    }

    /// The most rows of x the kernel takes.
    pub fn max_m(self) -> usize {
        match self {
            FewRow::Lanes(_) => GEMV_MAX_M,
            FewRow::Mma(_) => GEMV_MMA_MAX_M,
        }
    }

    /// Output columns one block computes.
    fn columns_per_block(self) -> usize {
        match self {
            FewRow::Lanes(ks) => WARPS / ks as usize,
            FewRow::Mma(ks) => 16 * (WARPS / ks as usize),
        }
    }
}

/// Warps per block (`GV_WARPS`).
const WARPS: usize = 8;

/// Rows per kernel instance (`M` of `gemv_S_mM`).
const ROWS: [usize; 5] = [1, 2, 4, 8, 16];

/// Tiles of eight rows per tensor-core instance (`NT` of `gemv_mma_S_tNT`).
const TILES: [usize; 4] = [1, 2, 4, 8];

/// The type pairs (operands, result) the kernel is instantiated for, as suffixes.
#[cfg(any(test, feature = "internals"))]
pub const PAIRS: [&str; 4] = ["bf16_bf16", "bf16_f32", "f16_f16", "f16_f32"];

/// The name of every kernel of the module.
#[cfg(any(test, feature = "internals"))]
pub fn kernel_names() -> Vec<String> {
    PAIRS
        .iter()
        .flat_map(|p| ROWS.iter().map(move |m| format!("gemv_{p}_m{m}")))
        .chain(
            PAIRS
                .iter()
                .flat_map(|p| TILES.iter().map(move |t| format!("gemv_mma_{p}_t{t}"))),
        )
        .chain(PAIRS.iter().flat_map(|p| {
            FUSED_ROWS
                .iter()
                .map(move |m| format!("gemv_norm_{p}_m{m}"))
        }))
        .chain(["bf16_bf16", "f16_f16"].iter().flat_map(|p| {
            FUSED_ROWS
                .iter()
                .map(move |m| format!("gemv_swiglu_{p}_m{m}"))
        }))
        .collect()
}

/// The CUDA source of the module.
pub fn source() -> String {
    format!(
        "{}{}{}{}",
        cudagraph::PDL_CUDA,
        super::cast::SOURCE,
        include_str!("rowops.cu"),
        include_str!("gemv.cu")
    )
}

/// Whether `kernel` takes a product of `m` rows, depth `k`, with `epilogue` (shape only, the
/// split not checked; the launcher also checks the pointers' 16-byte alignment and the
/// lengths): 1 ≤ m ≤ its [`FewRow::max_m`], k a positive multiple of 8 whose rounding up to
/// whole chunks of 32 fits the kernels' `int` depth arithmetic, the epilogue none, bias,
/// bias + ReLU or bias + GELU.
pub fn few_row_ok(kernel: FewRow, m: usize, k: usize, epilogue: Epilogue) -> bool {
    (1..=kernel.max_m()).contains(&m)
        && k > 0
        && k % 8 == 0
        && k.next_multiple_of(32) <= i32::MAX as usize
        && matches!(
            epilogue,
            Epilogue::None | Epilogue::Bias | Epilogue::BiasRelu | Epilogue::BiasGelu
        )
}

/// The blocks of `kernel` for `n` output columns: every column index a block computes, past
/// `n` included (blocks · columns a block), must fit the kernels' `int` column arithmetic.
fn grid(kernel: FewRow, n: usize) -> Result<u32> {
    let cols = kernel.columns_per_block();
    let blocks = n.div_ceil(cols);
    blocks
        .checked_mul(cols)
        .filter(|&c| c <= i32::MAX as usize)
        .and_then(|_| u32::try_from(blocks).ok())
        .ok_or_else(|| NnError::Shape(format!("gemv: n = {n} exceeds the grid")))
}

/// Where the lane kernel's input rows come from when it computes them itself, one launch
/// doing the work of the kernel that would write them and of the product. The bits are those
/// of that kernel followed by [`GemvKernels::run`] with the same split.
pub enum RowsFrom<'a, T: Float> {
    /// Row r is the decoder's norm ([`crate::kernels::decoder::DecoderKernels::norm`]) of
    /// row `r·stride + off` of `x` (`[_, k]`): LayerNorm with `bias` (which may be absent) or,
    /// with `rms`, RMSNorm, with `weight`; with `add`, its row is first added into x's (the
    /// residual add, rounded to the model's type), and the sums are written to the same rows
    /// of `sum` when given — not into `x`, which other blocks are still reading.
    Norm {
        x: &'a DeviceBuffer<T>,
        add: Option<&'a DeviceBuffer<T>>,
        sum: Option<&'a DeviceBuffer<T>>,
        weight: &'a DeviceBuffer<f32>,
        bias: Option<&'a DeviceBuffer<f32>>,
        stride: usize,
        off: usize,
        eps: f32,
        rms: bool,
    },
    /// Row r is SwiGLU of the packed row r of `gu` (`[m, 2k]`: gate | up), as
    /// [`crate::kernels::decoder::DecoderKernels::swiglu`].
    SwiGlu { gu: &'a DeviceBuffer<T> },
}

/// Whether the fused lane kernels take `m` rows of depth `k` of `T` into `n` columns with
/// split `ks` and `epilogue`, on a device whose blocks get `smem` bytes of shared memory
/// without opting in and that has `sms` multiprocessors: the lane kernel's shapes
/// ([`few_row_ok`]) with at most [`GEMV_FUSED_MAX_M`] rows that fit the shared memory (less
/// `FUSED_STATIC_SMEM` for the kernels' own arrays), a norm at most `FUSED_NORM_MAX_K` wide,
/// and a grid of at most `FUSED_BLOCKS_PER_SM` blocks a multiprocessor.
pub fn fused_ok<T: Float>(
    norm: bool,
    (m, n, k): (usize, usize, usize),
    ks: u8,
    epilogue: Epilogue,
    (smem, sms): (usize, usize),
) -> bool {
    if !GEMV_SPLITS.contains(&ks) {
        return false;
    }
    let blocks = n.div_ceil(FewRow::Lanes(ks).columns_per_block());
    m <= GEMV_FUSED_MAX_M
        && few_row_ok(FewRow::Lanes(1), m, k, epilogue)
        && m * k * std::mem::size_of::<T>() + FUSED_STATIC_SMEM <= smem
        && (!norm || k <= FUSED_NORM_MAX_K)
        && blocks <= FUSED_BLOCKS_PER_SM * sms
}

/// Whether the byte ranges of two buffers meet.
fn overlap<A: cudagraph::Elem, B: cudagraph::Elem>(
    a: &DeviceBuffer<A>,
    b: &DeviceBuffer<B>,
) -> bool {
    let (a0, b0) = (a.addr(), b.addr());
    let a1 = a0 + (a.len() * std::mem::size_of::<A>()) as u64;
    let b1 = b0 + (b.len() * std::mem::size_of::<B>()) as u64;
    a0 < b1 && b0 < a1
}

/// The kernels of one device (a [`Device::extension`]): `[pair][rows]` and `[pair][tiles]`,
/// pairs in the order of `PAIRS`; the fused ones `[pair][rows]` (norm) and `[type][rows]`
/// (SwiGLU: bf16, f16).
pub struct GemvKernels {
    f: [[Function; 5]; 4],
    mma: [[Function; 4]; 4],
    norm: [[Function; 3]; 4],
    swiglu: [[Function; 3]; 2],
}

impl GemvKernels {
    /// The kernels of `device`, compiled on first use.
    pub fn get(device: &Device) -> Result<Arc<Self>> {
        Ok(device.extension(|d| {
            let m = cudagraph::runtime::with_relaxed_capture(|| {
                d.compile(
                    "cudagraph_nn_gemv",
                    &super::module_source("cudagraph_nn_gemv"),
                )
            })?;
            let row = |pair: &str| -> cudagraph::Result<[Function; 5]> {
                Ok([
                    m.function(&format!("gemv_{pair}_m1"))?,
                    m.function(&format!("gemv_{pair}_m2"))?,
                    m.function(&format!("gemv_{pair}_m4"))?,
                    m.function(&format!("gemv_{pair}_m8"))?,
                    m.function(&format!("gemv_{pair}_m16"))?,
                ])
            };
            let tiles = |pair: &str| -> cudagraph::Result<[Function; 4]> {
                Ok([
                    m.function(&format!("gemv_mma_{pair}_t1"))?,
                    m.function(&format!("gemv_mma_{pair}_t2"))?,
                    m.function(&format!("gemv_mma_{pair}_t4"))?,
                    m.function(&format!("gemv_mma_{pair}_t8"))?,
                ])
            };
            let fused = |kind: &str, pair: &str| -> cudagraph::Result<[Function; 3]> {
                Ok([
                    m.function(&format!("gemv_{kind}_{pair}_m1"))?,
                    m.function(&format!("gemv_{kind}_{pair}_m2"))?,
                    m.function(&format!("gemv_{kind}_{pair}_m4"))?,
                ])
            };
            Ok(GemvKernels {
                norm: [
                    fused("norm", "bf16_bf16")?,
                    fused("norm", "bf16_f32")?,
                    fused("norm", "f16_f16")?,
                    fused("norm", "f16_f32")?,
                ],
                swiglu: [fused("swiglu", "bf16_bf16")?, fused("swiglu", "f16_f16")?],
                f: [
                    row("bf16_bf16")?,
                    row("bf16_f32")?,
                    row("f16_f16")?,
                    row("f16_f32")?,
                ],
                mma: [
                    tiles("bf16_bf16")?,
                    tiles("bf16_f32")?,
                    tiles("f16_f16")?,
                    tiles("f16_f32")?,
                ],
            })
        })?)
    }

    /// `y = act(alpha·x·wᵀ + beta·y + bias)` (see the module docs) on `kernel`: `x: [m, k]`,
    /// `w: [n, k]`, `y: [m, n]` (read only when `beta ≠ 0`), `bias: [n]` for the bias
    /// epilogues (none otherwise). The epilogue adds in this order, in f32: `alpha·Σ`, then
    /// `beta·y`, then the bias, then the activation, then one rounding to `O`.
    ///
    /// Errors, before anything runs: `T` not bf16 or f16, `O` neither `T` nor f32
    /// ([`NnError::NotSupported`]); a shape [`few_row_ok`] refuses, a split not in
    /// [`GEMV_SPLITS`],
    /// `x` or `w` not 16-byte aligned, a bias missing or given against the epilogue
    /// ([`NnError::Shape`]); a buffer shorter than the product needs (`SizeMismatch`); sizes
    /// beyond the kernel's ints; a buffer of another device.
    #[allow(clippy::too_many_arguments)]
    pub fn run<T: Float, O: Float>(
        &self,
        q: &dyn Queue,
        dims: (usize, usize, usize),
        scales: (f32, f32),
        epilogue: Epilogue,
        x: &DeviceBuffer<T>,
        w: &DeviceBuffer<T>,
        y: &DeviceBuffer<O>,
        bias: Option<&DeviceBuffer<O>>,
        kernel: FewRow,
    ) -> Result<()> {
        // SAFETY: `early` off: the kernel reads nothing before the previous kernel is done.
        unsafe { self.launch(q, dims, scales, epilogue, (x, w, y, bias), kernel, false) }
    }

    /// [`GemvKernels::run`] for weights that nothing writes any more: launched with PDL
    /// (inside captures), the kernel loads the first part of its weight rows before waiting
    /// for the previous kernel, so the product's weight stream overlaps that kernel's end.
    /// Same checks, same results.
    ///
    /// # Safety
    /// `w` holds its final values before any work that can run before this product on `q`
    /// (or in the graph it is captured into) begins, and nothing writes it for as long as the
    /// product may run: not the previous kernel, not any kernel before it (a loaded model's
    /// weights, uploaded and synchronised once).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn run_early<T: Float, O: Float>(
        &self,
        q: &dyn Queue,
        dims: (usize, usize, usize),
        scales: (f32, f32),
        epilogue: Epilogue,
        x: &DeviceBuffer<T>,
        w: &DeviceBuffer<T>,
        y: &DeviceBuffer<O>,
        bias: Option<&DeviceBuffer<O>>,
        kernel: FewRow,
    ) -> Result<()> {
        // SAFETY: the caller's promise about `w`.
        unsafe { self.launch(q, dims, scales, epilogue, (x, w, y, bias), kernel, true) }
    }

    /// Checks and launches (see [`GemvKernels::run`]); `early`: the weights may be read
    /// before the PDL wait.
    ///
    /// # Safety
    /// With `early`, the promise of [`GemvKernels::run_early`].
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    unsafe fn launch<T: Float, O: Float>(
        &self,
        q: &dyn Queue,
        (m, n, k): (usize, usize, usize),
        (alpha, beta): (f32, f32),
        epilogue: Epilogue,
        (x, w, y, bias): (
            &DeviceBuffer<T>,
            &DeviceBuffer<T>,
            &DeviceBuffer<O>,
            Option<&DeviceBuffer<O>>,
        ),
        kernel: FewRow,
        early: bool,
    ) -> Result<()> {
        let pair = pair::<T, O>()?;
        if !few_row_ok(kernel, m, k, epilogue) || n == 0 {
            return Err(NnError::Shape(format!(
                "gemv: {kernel:?} takes 1 to {} rows, n ≥ 1, k a positive multiple of 8 and the \
                 epilogues none, bias, bias_relu, bias_gelu (got m={m} n={n} k={k} ep={epilogue:?})",
                kernel.max_m()
            )));
        }
        let ks = split(kernel)?;
        if x.addr() % 16 != 0 || w.addr() % 16 != 0 {
            return Err(NnError::Shape(format!(
                "gemv: x (at {:#x}) and w (at {:#x}) must be 16-byte aligned",
                x.addr(),
                w.addr()
            )));
        }
        gemm_on_device(q, x, w, y, bias)?;
        need("gemv x", x, prod("gemv x", &[m, k])?)?;
        need("gemv w", w, prod("gemv w", &[n, k])?)?;
        need("gemv y", y, prod("gemv y", &[m, n])?)?;
        let ep = epilogue_code(epilogue, bias, n)?;
        let blocks = grid(kernel, n)?;
        let f = match kernel {
            FewRow::Lanes(_) => {
                &self.f[pair][ROWS.iter().position(|&r| r >= m).expect("m ≤ GEMV_MAX_M")]
            }
            FewRow::Mma(_) => {
                let t = m.div_ceil(8);
                &self.mma[pair][TILES
                    .iter()
                    .position(|&v| v >= t)
                    .expect("m ≤ GEMV_MMA_MAX_M")]
            }
        };
        let mut args = vec![x.into(), w.into()];
        args.extend(product_args(
            y,
            bias,
            (m, n, k),
            ks,
            (alpha, beta),
            ep,
            early,
        )?);
        // SAFETY: gemv_S_mM and gemv_mma_S_tNT(x, w, y, bias, m, n, k, ks, alpha, beta,
        // beta_on, ep, early) with m ≤ M or m ≤ 8·NT (the instance chosen), GV_WARPS = 8 warps
        // a block and ks dividing it (checked): block b's warps take columns j = b·(8/ks) +
        // warp/ks (lanes) or 16-column tiles (mma; weight rows past n clamped to n - 1) and
        // read w[j·k + p] only for j < n, p < k (n·k checked), x[r·k + p] for r < m, p < k (m·k
        // checked) with 16-byte loads at multiples of 8 elements (x and w 16-byte aligned, k a
        // multiple of 8: checked); the finishing threads read and write y[r·n + j] for r < m,
        // j < n (m·n checked; read only with beta_on) and read bias[j] only for ep ≠ 0 (then
        // bias is given with n elements, checked); sizes within int (checked), element offsets
        // long long; the shared arrays are static. With `early`, the weight loads before the
        // PDL wait read memory no earlier work writes (the promise of this function's caller).
        unsafe {
            super::pdl::launch_decode(
                q,
                f,
                LaunchConfig::linear(blocks, (WARPS * 32) as u32),
                &args,
            )
        }
    }

    /// The lane kernel ([`FewRow::Lanes`] with split `ks`) on rows it computes itself:
    /// `y = act(alpha·rows·wᵀ + beta·y + bias)` with `rows: [m, k]` from `from` (see
    /// [`RowsFrom`]), in one launch; the bits of the kernel that writes the rows followed by
    /// [`GemvKernels::run`] with `FewRow::Lanes(ks)`.
    ///
    /// Errors, before anything runs: those of [`GemvKernels::run`]; a shape [`fused_ok`]
    /// refuses on this device; SwiGLU rows with a result other than `T`
    /// ([`NnError::NotSupported`]); a norm row picked past `x` (`stride` 0 or `off ≥
    /// stride` is a [`NnError::Shape`]), a norm weight or bias shorter than `k`, RMSNorm with a
    /// bias; a row buffer not 16-byte aligned; `sum` meeting `x` or `add`, or `y` meeting a
    /// buffer the launch reads or `sum` ([`NnError::Shape`]); a buffer of another device.
    #[allow(clippy::too_many_arguments)]
    #[cfg_attr(not(feature = "internals"), allow(dead_code))]
    pub fn run_from<T: Float, O: Float>(
        &self,
        q: &dyn Queue,
        dims: (usize, usize, usize),
        scales: (f32, f32),
        epilogue: Epilogue,
        from: &RowsFrom<'_, T>,
        w: &DeviceBuffer<T>,
        (y, bias): (&DeviceBuffer<O>, Option<&DeviceBuffer<O>>),
        ks: u8,
    ) -> Result<()> {
        // SAFETY: `early` off: the kernel reads nothing before the previous kernel is done.
        unsafe { self.launch_from(q, dims, scales, epilogue, from, w, (y, bias), ks, false) }
    }

    /// [`GemvKernels::run_from`] reading the first part of the weight rows before waiting
    /// for the previous kernel, as [`GemvKernels::run_early`]. Same checks, same results.
    ///
    /// # Safety
    /// The promise of [`GemvKernels::run_early`] for `w`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn run_from_early<T: Float, O: Float>(
        &self,
        q: &dyn Queue,
        dims: (usize, usize, usize),
        scales: (f32, f32),
        epilogue: Epilogue,
        from: &RowsFrom<'_, T>,
        w: &DeviceBuffer<T>,
        (y, bias): (&DeviceBuffer<O>, Option<&DeviceBuffer<O>>),
        ks: u8,
    ) -> Result<()> {
        // SAFETY: the caller's promise about `w`.
        unsafe { self.launch_from(q, dims, scales, epilogue, from, w, (y, bias), ks, true) }
    }

    /// Checks and launches [`GemvKernels::run_from`]; `early`: the weights may be read before
    /// the PDL wait.
    ///
    /// # Safety
    /// With `early`, the promise of [`GemvKernels::run_early`] for `w`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_from<T: Float, O: Float>(
        &self,
        q: &dyn Queue,
        (m, n, k): (usize, usize, usize),
        scales: (f32, f32),
        epilogue: Epilogue,
        from: &RowsFrom<'_, T>,
        w: &DeviceBuffer<T>,
        (y, bias): (&DeviceBuffer<O>, Option<&DeviceBuffer<O>>),
        ks: u8,
        early: bool,
    ) -> Result<()> {
        let pair = pair::<T, O>()?;
        let ks = split(FewRow::Lanes(ks))?;
        let info = q.device().info();
        let (smem, sms) = (
            info.max_shared_memory_per_block as usize,
            info.multiprocessors as usize,
        );
        let norm = matches!(from, RowsFrom::Norm { .. });
        if !fused_ok::<T>(norm, (m, n, k), ks, epilogue, (smem, sms)) || n == 0 {
            return Err(NnError::Shape(format!(
                "gemv on computed rows: takes 1 to {GEMV_FUSED_MAX_M} rows whose {} fit {smem} \
                 bytes of shared memory, n ≥ 1 columns in at most {FUSED_BLOCKS_PER_SM} blocks \
                 a multiprocessor ({sms} here), k a positive multiple of 8 (at most \
                 {FUSED_NORM_MAX_K} for a norm) and the epilogues none, bias, bias_relu, \
                 bias_gelu (got m={m} n={n} k={k} ks={ks} ep={epilogue:?})",
                T::DTYPE
            )));
        }
        let ep = epilogue_code(epilogue, bias, n)?;
        let mut blocks = vec![("gemv w", w.block()), ("gemv y", y.block())];
        blocks.extend(bias.map(|b| ("gemv bias", b.block())));
        match *from {
            RowsFrom::Norm {
                x,
                add,
                sum,
                weight,
                bias: nb,
                ..
            } => {
                blocks.push(("gemv norm input", x.block()));
                blocks.push(("gemv norm weight", weight.block()));
                blocks.extend(add.map(|a| ("gemv norm residual", a.block())));
                blocks.extend(sum.map(|a| ("gemv norm sum", a.block())));
                blocks.extend(nb.map(|b| ("gemv norm bias", b.block())));
            }
            RowsFrom::SwiGlu { gu } => blocks.push(("gemv SwiGLU input", gu.block())),
        }
        on_device(q, blocks)?;
        need("gemv w", w, prod("gemv w", &[n, k])?)?;
        need("gemv y", y, prod("gemv y", &[m, n])?)?;
        let aligned = |name: &str, addr: u64| -> Result<()> {
            if addr % 16 != 0 {
                return Err(NnError::Shape(format!(
                    "gemv on computed rows: {name} (at {addr:#x}) must be 16-byte aligned"
                )));
            }
            Ok(())
        };
        aligned("w", w.addr())?;
        let reads_y = |name: &str, meets: bool| -> Result<()> {
            if meets {
                return Err(NnError::Shape(format!(
                    "gemv on computed rows: the output y meets {name}, which the launch reads \
                     or writes; give it its own buffer"
                )));
            }
            Ok(())
        };
        reads_y("w", overlap(y, w))?;
        if let Some(b) = bias {
            reads_y("the bias", overlap(y, b))?;
        }
        let at = if norm { 0 } else { 1 };
        let mut args: Vec<Arg<'_>> = match *from {
            RowsFrom::Norm {
                x,
                add,
                sum,
                weight,
                bias: nb,
                stride,
                off,
                eps,
                rms,
            } => {
                if stride == 0 || off >= stride {
                    return Err(NnError::Shape(format!(
                        "gemv on computed rows: row stride {stride} with offset {off} (takes \
                         offset < stride)"
                    )));
                }
                // The last row read is (m - 1)·stride + off.
                let rows = (m - 1)
                    .checked_mul(stride)
                    .and_then(|v| v.checked_add(off + 1))
                    .ok_or_else(|| NnError::Shape("gemv on computed rows: rows overflow".into()))?;
                let extent = prod("gemv norm rows", &[rows, k])?;
                need("gemv norm input", x, extent)?;
                aligned("the norm input", x.addr())?;
                reads_y("the norm input", overlap(y, x))?;
                if let Some(a) = add {
                    need("gemv norm residual", a, extent)?;
                    aligned("the norm residual", a.addr())?;
                    reads_y("the norm residual", overlap(y, a))?;
                }
                if let Some(sm) = sum {
                    need("gemv norm sum", sm, extent)?;
                    aligned("the norm sum", sm.addr())?;
                    reads_y("the norm sum", overlap(y, sm))?;
                    if overlap(sm, x) || add.is_some_and(|a| overlap(sm, a)) {
                        return Err(NnError::Shape(
                            "gemv on computed rows: the norm's sum meets its input or residual, \
                             which other blocks are still reading; give it its own buffer"
                                .into(),
                        ));
                    }
                }
                need("gemv norm weight", weight, k)?;
                if let Some(b) = nb {
                    if rms {
                        return Err(NnError::Shape(
                            "gemv on computed rows: RMSNorm has no bias".into(),
                        ));
                    }
                    need("gemv norm bias", b, k)?;
                }
                vec![
                    x.into(),
                    Arg::opt(add),
                    Arg::opt(sum),
                    weight.into(),
                    Arg::opt(nb),
                    Arg::I32(int("gemv norm stride", stride)?),
                    Arg::I32(int("gemv norm offset", off)?),
                    Arg::F32(eps),
                    Arg::I32(rms as i32),
                    w.into(),
                ]
            }
            RowsFrom::SwiGlu { gu } => {
                if O::DTYPE != T::DTYPE {
                    return Err(NnError::NotSupported {
                        op: "gemv on SwiGLU rows",
                        what: format!("a result of {} from {} rows", O::DTYPE, T::DTYPE),
                        fix: "a result of the rows' type",
                    });
                }
                need(
                    "gemv SwiGLU input",
                    gu,
                    prod("gemv SwiGLU input", &[m, 2, k])?,
                )?;
                aligned("the SwiGLU input", gu.addr())?;
                reads_y("the SwiGLU input", overlap(y, gu))?;
                vec![gu.into(), w.into()]
            }
        };
        args.extend(product_args(y, bias, (m, n, k), ks, scales, ep, early)?);
        let rows = FUSED_ROWS
            .iter()
            .position(|&r| r >= m)
            .expect("m ≤ GEMV_FUSED_MAX_M");
        let f = match at {
            0 => &self.norm[pair][rows],
            // SwiGLU: O = T, so pair 0 (bf16) or 2 (f16).
            _ => &self.swiglu[pair / 2][rows],
        };
        let blocks = grid(FewRow::Lanes(ks), n)?;
        let mut cfg = LaunchConfig::linear(blocks, (WARPS * 32) as u32);
        cfg.shared_mem_bytes = (m * k * std::mem::size_of::<T>()) as u32;
        // SAFETY: gemv_norm_S_mM(x, a, xw, nw, nb, stride, off, eps, rms, w, <product>) and
        // gemv_swiglu_S_mM(gu, w, <product>) with m ≤ M (the instance chosen), 8 warps a
        // block, ks dividing them (checked) and m·k elements of T of dynamic shared memory
        // (within the device's limit: checked): every block computes rows r < m, k wide, into
        // shared memory, reading x, a (and writing xw, block 0) at ((r·stride + off)·k + c)
        // for c < k (extent checked), nw and nb at c < k (checked), or gu[r·2k + c] and
        // gu[r·2k + k + c] (2·m·k checked), with 16-byte accesses at multiples of 8 elements
        // (buffers aligned, k a multiple of 8: checked); then the lane kernel's product (the
        // grid as the plain kernel's, checked the same way), reading w[j·k + p] for j < n,
        // p < k and writing y[r·n + j] (extents checked), bias[j] for ep ≠ 0 (checked). No
        // buffer the launch writes meets one it reads (checked). With `early`, the weight loads before the PDL
        // wait read memory no earlier work writes (the caller's promise).
        unsafe { super::pdl::launch_decode(q, f, cfg, &args) }
    }
}

/// The index of the (operand, result) pair in `PAIRS`.
fn pair<T: Float, O: Float>() -> Result<usize> {
    match (T::DTYPE, O::DTYPE) {
        (Dtype::Bf16, Dtype::Bf16) => Ok(0),
        (Dtype::Bf16, Dtype::F32) => Ok(1),
        (Dtype::F16, Dtype::F16) => Ok(2),
        (Dtype::F16, Dtype::F32) => Ok(3),
        (t, o) => Err(NnError::NotSupported {
            op: "gemv",
            what: format!("operands of {t} with a result of {o}"),
            fix: "bf16 or f16 operands with a result of their type or f32",
        }),
    }
}

/// The split of `kernel`, one of [`GEMV_SPLITS`].
fn split(kernel: FewRow) -> Result<u8> {
    let ks = kernel.splits();
    if !GEMV_SPLITS.contains(&ks) {
        return Err(NnError::Shape(format!(
            "gemv: ks = {ks} (takes {GEMV_SPLITS:?})"
        )));
    }
    Ok(ks)
}

/// The kernels' `ep` for `epilogue` with `bias` (of at least `n` elements when given).
fn epilogue_code<O: Float>(
    epilogue: Epilogue,
    bias: Option<&DeviceBuffer<O>>,
    n: usize,
) -> Result<i32> {
    let ep = match (epilogue, bias) {
        (Epilogue::None, None) => 0,
        (Epilogue::Bias, Some(_)) => 1,
        (Epilogue::BiasRelu, Some(_)) => 2,
        (Epilogue::BiasGelu, Some(_)) => 3,
        (e, b) => {
            return Err(NnError::Shape(format!(
                "gemv: epilogue {e:?} with {} bias",
                if b.is_some() { "a" } else { "no" }
            )))
        }
    };
    if let Some(b) = bias {
        need("gemv bias", b, n)?;
    }
    Ok(ep)
}

/// The product's arguments after the kernel-specific ones: `y, bias, m, n, k, ks, alpha,
/// beta, beta_on, ep, early`.
#[allow(clippy::too_many_arguments)]
fn product_args<'a, O: Float>(
    y: &'a DeviceBuffer<O>,
    bias: Option<&'a DeviceBuffer<O>>,
    (m, n, k): (usize, usize, usize),
    ks: u8,
    (alpha, beta): (f32, f32),
    ep: i32,
    early: bool,
) -> Result<Vec<Arg<'a>>> {
    Ok(vec![
        y.into(),
        Arg::opt(bias),
        Arg::I32(int("gemv m", m)?),
        Arg::I32(int("gemv n", n)?),
        Arg::I32(int("gemv k", k)?),
        Arg::I32(ks as i32),
        Arg::F32(alpha),
        Arg::F32(beta),
        Arg::I32((beta != 0.0) as i32),
        Arg::I32(ep),
        Arg::I32(early as i32),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_the_kernel_takes() {
        assert!(few_row_ok(FewRow::Lanes(1), 1, 768, Epilogue::BiasGelu));
        assert!(few_row_ok(FewRow::Lanes(1), 16, 8, Epilogue::None));
        assert!(few_row_ok(FewRow::Lanes(1), 3, 3072, Epilogue::BiasRelu));
        assert!(!few_row_ok(FewRow::Lanes(1), 0, 768, Epilogue::Bias));
        assert!(!few_row_ok(FewRow::Lanes(1), 17, 768, Epilogue::Bias));
        assert!(!few_row_ok(FewRow::Lanes(1), 1, 0, Epilogue::Bias));
        assert!(!few_row_ok(FewRow::Lanes(1), 1, 12, Epilogue::Bias));
        assert!(!few_row_ok(FewRow::Lanes(1), 1, 768, Epilogue::BiasGrad));
        // Every m up to the bound has an instance of at least m rows.
        for m in 1..=GEMV_MAX_M {
            assert!(ROWS.iter().any(|&r| r >= m));
        }
        assert_eq!(*ROWS.last().unwrap(), GEMV_MAX_M);
        for ks in GEMV_SPLITS {
            assert_eq!(WARPS % ks as usize, 0);
        }
        assert_eq!(kernel_names().len(), 54);
        assert!(kernel_names().contains(&"gemv_mma_f16_f16_t8".to_string()));
        assert!(kernel_names().contains(&"gemv_norm_f16_f32_m4".to_string()));
        assert!(kernel_names().contains(&"gemv_swiglu_bf16_bf16_m1".to_string()));
        assert!(kernel_names().contains(&"gemv_f16_f32_m16".to_string()));
        assert!(kernel_names().contains(&"gemv_mma_bf16_f32_t4".to_string()));
        // The tensor-core kernel: every m up to its bound has an instance of enough tiles.
        assert!(few_row_ok(
            FewRow::Mma(1),
            GEMV_MMA_MAX_M,
            8,
            Epilogue::None
        ));
        assert!(!few_row_ok(
            FewRow::Mma(1),
            GEMV_MMA_MAX_M + 1,
            8,
            Epilogue::None
        ));
        assert!(!few_row_ok(
            FewRow::Lanes(1),
            GEMV_MAX_M + 1,
            8,
            Epilogue::None
        ));
        for m in 1..=GEMV_MMA_MAX_M {
            assert!(TILES.iter().any(|&t| 8 * t >= m));
        }
        assert_eq!(8 * *TILES.last().unwrap(), GEMV_MMA_MAX_M);
        assert_eq!(FewRow::Mma(2).columns_per_block(), 64);
        assert!(split(FewRow::Mma(16)).is_err());
        // Depths whose chunks of 32 would pass an int are refused by both kernels.
        let deepest = (i32::MAX as usize) / 32 * 32;
        for kernel in [FewRow::Lanes(1), FewRow::Mma(1)] {
            assert!(few_row_ok(kernel, 1, deepest, Epilogue::None));
            assert!(!few_row_ok(kernel, 1, deepest + 8, Epilogue::None));
        }
    }

    #[test]
    fn fused_shapes_fit_the_shared_memory_the_registers_and_one_wave() {
        use cudagraph::memory::bf16;
        let dev = (48 * 1024, 132);
        let ok = |norm, (m, n, k), ks, ep| fused_ok::<bf16>(norm, (m, n, k), ks, ep, dev);
        assert!(ok(true, (1, 2304, 768), 1, Epilogue::Bias));
        assert!(!ok(true, (1, 2304, 768), 4, Epilogue::Bias));
        assert!(ok(true, (4, 1000, 2048), 1, Epilogue::None));
        assert!(ok(false, (1, 4096, 14336), 1, Epilogue::None));
        // Five rows, a ragged depth, a norm past the registers, an epilogue it has not.
        assert!(!ok(true, (5, 768, 768), 4, Epilogue::None));
        assert!(!ok(true, (1, 768, 100), 4, Epilogue::None));
        assert!(!ok(true, (1, 768, 8200), 4, Epilogue::None));
        assert!(ok(true, (1, 768, FUSED_NORM_MAX_K), 4, Epilogue::None));
        assert!(!ok(true, (1, 768, 768), 4, Epilogue::BiasGrad));
        // Rows past the shared memory: three rows of 8192 fill the 48 KiB, with no room left
        // for the static arrays.
        assert!(!ok(false, (2, 768, 14336), 4, Epilogue::None));
        assert!(!ok(false, (3, 768, 8192), 4, Epilogue::None));
        assert!(ok(false, (2, 768, 8192), 4, Epilogue::None));
        // More blocks than four a multiprocessor: 132 · 4 blocks of 8 / ks columns.
        assert!(ok(false, (1, 528 * 2, 2048), 4, Epilogue::None));
        assert!(!ok(false, (1, 528 * 2 + 1, 2048), 4, Epilogue::None));
        assert!(!ok(false, (1, 16384, 2048), 4, Epilogue::None));
        assert!(ok(false, (1, 528 * 8, 2048), 1, Epilogue::None));
        assert!(!ok(false, (1, 768, 2048), 3, Epilogue::None));
        // Every m up to the bound has an instance.
        for m in 1..=GEMV_FUSED_MAX_M {
            assert!(FUSED_ROWS.iter().any(|&r| r >= m));
        }
        assert_eq!(*FUSED_ROWS.last().unwrap(), GEMV_FUSED_MAX_M);
    }

    #[test]
    fn the_grid_keeps_every_column_index_within_an_int() {
        assert_eq!(grid(FewRow::Lanes(1), 768).unwrap(), 96);
        assert_eq!(grid(FewRow::Lanes(2), 769).unwrap(), 193);
        assert_eq!(grid(FewRow::Mma(1), 2304).unwrap(), 18);
        assert_eq!(grid(FewRow::Mma(8), 17).unwrap(), 2);
        // n itself fits an int, but the last tile's columns would not.
        let top = i32::MAX as usize;
        let last = top / 128 * 128;
        assert_eq!(grid(FewRow::Mma(1), last).unwrap() as usize, last / 128);
        assert!(grid(FewRow::Mma(1), last + 1).is_err());
        assert!(grid(FewRow::Lanes(1), top - 6).is_err());
        assert!(grid(FewRow::Lanes(1), top / 8 * 8).is_ok());
        assert_eq!(FewRow::Lanes(2).columns_per_block(), 4);
    }
}
