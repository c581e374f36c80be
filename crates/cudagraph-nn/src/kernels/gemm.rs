//! Launchers of the product kernels (`gemm.cu`, `gemm_tile.cu`, and on sm_90+ `gemm_cluster.cu`
//! as [`ClusterKernels`]): the split-K tiled and register-blocked kernels with their reduce,
//! the cluster and chunked kernels, warp-K, and the few-rows and column-warp kernels, with the
//! launch shapes and operand checks each needs.

use std::sync::Arc;

use cudagraph::{Arg, Device, Function, LaunchConfig, Queue};

use super::{elems, int, int_loop, launch, module_source, pdl, prod, Buf, GemmDims, Kernels};
use crate::error::{NnError, Result};

/// Cluster sizes of `sgemm_tiled_cluster{S}`.
const TILED_CLUSTERS: [usize; 3] = [2, 4, 8];
/// K splits of `sgemm_nt_chunks{S}`.
const CHUNK_SPLITS: [usize; 4] = [1, 2, 4, 8];

/// The split-K kernels reduced inside a thread-block cluster (gemm_cluster.cu), one per
/// cluster size; sm_90+ only, compiled on first use.
pub struct ClusterKernels {
    /// `sgemm_tiled_cluster{S}`, S in [`TILED_CLUSTERS`].
    tiled: [Function; 3],
    /// `sgemm_nt_chunks{S}`, S in [`CHUNK_SPLITS`].
    nt: [Function; 4],
}

/// The kernel of `kernels` for `size` (their sizes in order in `sizes`), or an error naming
/// the sizes there are.
fn sized<'a>(
    kernels: &'a [Function],
    sizes: &[usize],
    size: usize,
    what: &str,
) -> Result<&'a Function> {
    sizes
        .iter()
        .position(|&s| s == size)
        .map(|i| &kernels[i])
        .ok_or_else(|| NnError::Shape(format!("gemm: {what} of {size} ({sizes:?} only)")))
}

impl ClusterKernels {
    /// Whether `device` runs thread-block clusters (compute capability 9.0 or later).
    pub fn supported(device: &Device) -> bool {
        device.info().compute_capability.0 >= 9
    }

    /// The kernels of `device`, compiled on first use; an error before sm_90.
    pub fn get(device: &Device) -> Result<Arc<Self>> {
        if !Self::supported(device) {
            let (major, minor) = device.info().compute_capability;
            return Err(NnError::Unsupported(format!(
                "gemm: the cluster kernels need compute capability 9.0 or later (this device \
                 has {major}.{minor}); use another product engine"
            )));
        }
        Ok(device.extension(|d| {
            // Relaxed capture mode: the first use may be inside a capture (module loading).
            let m = cudagraph::runtime::with_relaxed_capture(|| {
                d.compile(
                    "cudagraph_nn_cluster",
                    &module_source("cudagraph_nn_cluster"),
                )
            })?;
            Ok(ClusterKernels {
                tiled: [
                    m.function("sgemm_tiled_cluster2")?,
                    m.function("sgemm_tiled_cluster4")?,
                    m.function("sgemm_tiled_cluster8")?,
                ],
                nt: [
                    m.function("sgemm_nt_chunks1")?,
                    m.function("sgemm_nt_chunks2")?,
                    m.function("sgemm_nt_chunks4")?,
                    m.function("sgemm_nt_chunks8")?,
                ],
            })
        })?)
    }
}

/// Whether [`Kernels::sgemm_reg`] reads these operands as float4s: both leading dimensions (k or m
/// for A, k or n for B) multiples of 4 and both addresses 16-byte aligned.
pub fn reg_vec_ok(d: GemmDims, addrs: &[u64]) -> bool {
    let lda = if d.ta { d.m } else { d.k };
    let ldb = if d.tb { d.k } else { d.n };
    lda % 4 == 0 && ldb % 4 == 0 && addrs.iter().all(|a| a % 16 == 0)
}

/// Whether [`Kernels::sgemm_nt_rows`] can read these operands: k a multiple of 4 and every address
/// 16-byte aligned (its loads are float4s).
pub fn rows_ok(k: usize, addrs: &[u64]) -> bool {
    k % 4 == 0 && addrs.iter().all(|a| a % 16 == 0)
}

/// Rows per block the few-rows kernels come in: `sgemm_nt_rows` (16), `sgemm_nt_rows8`,
/// `sgemm_nt_rows4`.
pub const ROWS_PER_BLOCK: [usize; 3] = [16, 8, 4];

/// Warps per block of the few-rows kernels with `ks` warps per group of four columns: 8, or
/// `ks` when it is 16 (one group per block).
pub fn rows_warps(ks: usize) -> usize {
    ks.max(8)
}

/// Groups of four columns per block of the few-rows kernels (`ks` ≥ 1).
pub fn rows_groups(ks: usize) -> usize {
    rows_warps(ks) / ks.max(1)
}

/// The most warps per column group of the few-rows kernel with `per_block` rows: 8 for the
/// 16-row kernel (64 sums per lane leave no room for more warps), 16 for the 8- and 4-row ones.
pub fn rows_most_splits(per_block: usize) -> usize {
    if per_block == 16 {
        8
    } else {
        16
    }
}

/// The few-rows kernel's launch: `per_block` rows per block in y, 8 / ks groups of 4 columns
/// per block in x, 256 threads.
pub fn rows_grid(m: usize, n: usize, ks: usize, per_block: usize) -> Result<LaunchConfig> {
    let ks = ks.clamp(1, rows_most_splits(per_block));
    let gx = n.div_ceil(4).div_ceil(rows_groups(ks));
    let gy = m.div_ceil(per_block.max(1));
    match (u32::try_from(gx), u32::try_from(gy)) {
        (Ok(gx), Ok(gy)) if gx <= i32::MAX as u32 && gy <= 65535 => Ok(LaunchConfig {
            grid: (gx, gy, 1),
            block: (32 * rows_warps(ks) as u32, 1, 1),
            shared_mem_bytes: 0,
        }),
        _ => Err(NnError::Shape(format!(
            "gemm rows: {m}×{n} exceeds the grid"
        ))),
    }
}

/// The shape of a column-warp kernel launch (`sgemm_nt_cols_r{rows}c{cols}`): `rows` rows
/// (1, 2, 4, 8 or 16) and `cols` columns (1 or 2) per warp, `warps` warps per block (4, 8 or
/// 16), `ks` of them (a power of two up to `warps`) splitting K per column group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ColsShape {
    pub rows: usize,
    pub cols: usize,
    pub warps: usize,
    pub ks: usize,
}

/// Rows per warp the column-warp kernels come in.
pub const COLS_ROWS: [usize; 5] = [1, 2, 4, 8, 16];
/// Columns per warp the column-warp kernels come in.
pub const COLS_COLS: [usize; 2] = [1, 2];
/// Warps per block a column-warp kernel may have (its shared memory holds 16).
pub const COLS_WARPS: [usize; 3] = [4, 8, 16];

impl ColsShape {
    /// Why this shape cannot launch, if it cannot.
    pub fn check(self) -> Result<()> {
        let ColsShape {
            rows,
            cols,
            warps,
            ks,
        } = self;
        if !COLS_ROWS.contains(&rows)
            || !COLS_COLS.contains(&cols)
            || !COLS_WARPS.contains(&warps)
            || !ks.is_power_of_two()
            || ks > warps
        {
            return Err(NnError::Shape(format!(
                "gemm cols: {rows} rows × {cols} columns per warp, {warps} warps, {ks} splitting \
                 K (rows one of {COLS_ROWS:?}, columns one of {COLS_COLS:?}, warps one of \
                 {COLS_WARPS:?}, a power of two up to the warps splitting K)"
            )));
        }
        Ok(())
    }

    /// The launch for an m×n output: `warps / ks` column groups of `cols` columns per block in
    /// x, `rows` rows per block in y.
    pub fn grid(self, m: usize, n: usize) -> Result<LaunchConfig> {
        self.check()?;
        let gx = n.div_ceil(self.cols).div_ceil(self.warps / self.ks);
        let gy = m.div_ceil(self.rows);
        match (u32::try_from(gx), u32::try_from(gy)) {
            (Ok(gx), Ok(gy)) if gx <= i32::MAX as u32 && gy <= 65535 => Ok(LaunchConfig {
                grid: (gx, gy, 1),
                block: (32 * self.warps as u32, 1, 1),
                shared_mem_bytes: 0,
            }),
            _ => Err(NnError::Shape(format!(
                "gemm cols: {m}×{n} exceeds the grid"
            ))),
        }
    }
}

/// The forward layout `A·Bᵀ`: A m×k and B n×k, row-major.
fn nt_dims(m: usize, n: usize, k: usize) -> GemmDims {
    GemmDims {
        m,
        n,
        k,
        ta: false,
        tb: true,
    }
}

/// Checks that A, B, C and the bias hold what the product `d` indexes; `Ok(false)` when the
/// output is empty and nothing is to be launched.
fn buffers_ready(d: &GemmDims, a: &Buf, b: &Buf, c: &Buf, bias: Option<&Buf>) -> Result<bool> {
    d.check_buffers(a, b, c, bias)?;
    Ok(d.m > 0 && d.n > 0)
}

/// What both few-row launchers (`sgemm_nt_rows*`, `sgemm_nt_cols_*`) check of the forward
/// product `C = act(A·Bᵀ + bias)`, A m×k, B n×k: every buffer holds what the kernels index, k is
/// a multiple of 4 and A, B are 16-byte aligned (the kernels read float4s). `Ok(false)` when
/// the output is empty and nothing is to be launched.
fn few_rows_ready(
    what: &str,
    (m, n, k): (usize, usize, usize),
    a: &Buf,
    b: &Buf,
    c: &Buf,
    bias: Option<&Buf>,
) -> Result<bool> {
    let nonempty = buffers_ready(&nt_dims(m, n, k), a, b, c, bias)?;
    if !rows_ok(k, &[a.addr(), b.addr()]) {
        return Err(NnError::Shape(format!(
            "{what}: k = {k} must be a multiple of 4 and A, B 16-byte aligned"
        )));
    }
    Ok(nonempty)
}

/// The argument list of both few-row kernels: `(m, n, k, A, B, C, bias, relu, ks)`, the sizes
/// bounded so that the kernels' 32-bit indices past the last row, column or K chunk cannot
/// overflow.
fn few_rows_args<'a>(
    (m, n, k): (usize, usize, usize),
    a: &'a Buf,
    b: &'a Buf,
    c: &'a Buf,
    bias: Option<&'a Buf>,
    relu: bool,
    ks: usize,
) -> Result<[Arg<'a>; 9]> {
    Ok([
        int_loop("m", m, 1024)?.into(),
        int_loop("n", n, 1024)?.into(),
        int_loop("k", k, 4096)?.into(),
        a.into(),
        b.into(),
        c.into(),
        Arg::opt(bias),
        (relu as i32).into(),
        (ks as i32).into(),
    ])
}

/// The launch of the tiled kernels (`sgemm_tiled`, the register-blocked `sgemm_reg*`, and on
/// sm_90+ the cluster kernels): one `bm`×`bn` tile per block in x/y, K split into `splits`
/// ranges of `kc` (whole 32-wide tiles) in z.
struct TiledLaunch {
    gx: u32,
    gy: u32,
    kc: usize,
    splits: usize,
    mn: usize,
    mi: i32,
    ni: i32,
    ki: i32,
    lda: i32,
    ldb: i32,
    ta: bool,
    tb: bool,
    threads: u32,
}

/// Outputs per block (rows, columns; at most 128 each) and threads per block of a kernel with
/// `sgemm_tiled`'s arguments.
#[derive(Clone, Copy)]
struct TileShape {
    rows: usize,
    cols: usize,
    threads: u32,
}

/// `sgemm_tiled`'s blocks.
const TILED_SHAPE: TileShape = TileShape {
    rows: 32,
    cols: 32,
    threads: 256,
};

/// `sgemm_reg`'s blocks: eight K groups of 64 threads.
const REG_SHAPE: TileShape = TileShape {
    rows: 64,
    cols: 64,
    threads: 512,
};

impl TiledLaunch {
    /// K split into (about) `splits` ranges; `splits` is then the number of non-empty ones.
    fn new(d: GemmDims, splits: usize) -> Result<Self> {
        Self::with_tile(d, TILED_SHAPE, splits)
    }

    /// The same with the blocks of `shape`.
    fn with_tile(d: GemmDims, shape: TileShape, splits: usize) -> Result<Self> {
        let (gx, gy) = d.tiles_of(shape.rows, shape.cols)?;
        let kc = d.k.div_ceil(splits.max(1)).div_ceil(32).max(1) * 32;
        let splits = d.k.div_ceil(kc).max(1);
        if splits > 65535 {
            return Err(NnError::Shape(format!("gemm: {splits} K splits")));
        }
        Ok(Self {
            gx,
            gy,
            kc,
            splits,
            mn: prod("gemm C", &[d.m, d.n])?,
            // Tile offsets and K steps run up to a tile (at most 128) past each bound in `int`s.
            mi: int_loop("m", d.m, 1024)?,
            ni: int_loop("n", d.n, 1024)?,
            ki: int_loop("k", d.k, 1024)?,
            lda: int("lda", if d.ta { d.m } else { d.k })?,
            ldb: int("ldb", if d.tb { d.k } else { d.n })?,
            ta: d.ta,
            tb: d.tb,
            threads: shape.threads,
        })
    }

    fn config(&self, z: usize) -> LaunchConfig {
        LaunchConfig {
            grid: (self.gx, self.gy, z as u32),
            block: (self.threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// The arguments both kernels share, in their order (`sgemm_tiled` adds `partial`).
    #[allow(clippy::too_many_arguments)]
    fn args<'a>(
        &self,
        alpha: f32,
        a: &'a Buf,
        b: &'a Buf,
        beta: f32,
        c: &'a Buf,
        bias: Option<&'a Buf>,
        relu: bool,
    ) -> Vec<Arg<'a>> {
        vec![
            self.mi.into(),
            self.ni.into(),
            self.ki.into(),
            alpha.into(),
            a.into(),
            self.lda.into(),
            (self.ta as i32).into(),
            b.into(),
            self.ldb.into(),
            (self.tb as i32).into(),
            beta.into(),
            c.into(),
            Arg::opt(bias),
            (relu as i32).into(),
            // kc ≤ k rounded up to a tile: below i32::MAX by the `ki` check.
            (self.kc as i32).into(),
        ]
    }
}

impl Kernels {
    /// The split-K tiled SGEMM with fused bias/ReLU: `C = act(alpha·op(A)·op(B) + beta·C + bias)`.
    /// K is split into (about) `splits` ranges of whole 32-wide tiles; with more than one, the
    /// partial products go to a scratch buffer (from `q`) and a reduce kernel applies the
    /// epilogue in a fixed order.
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm_tiled(
        &self,
        q: &dyn Queue,
        d: GemmDims,
        alpha: f32,
        a: &Buf,
        b: &Buf,
        beta: f32,
        c: &Buf,
        bias: Option<&Buf>,
        relu: bool,
        splits: usize,
    ) -> Result<()> {
        let kernel = &self.sgemm_tiled;
        self.split_k_product(
            q,
            kernel,
            TILED_SHAPE,
            d,
            alpha,
            a,
            b,
            beta,
            c,
            bias,
            relu,
            splits,
        )
    }

    /// The register-blocked SGEMM (`sgemm_reg`, gemm.cu): `sgemm_tiled`'s product, arguments
    /// and split-K contract (the same 32-wide K ranges) with 64×64 outputs per block, eight K
    /// groups of 64 threads each holding an 8×8 tile in registers, for the mid-size products
    /// where the 32×32 tile is bound by shared-memory traffic and few warps. Operands whose
    /// leading dimensions are multiples of 4 at 16-byte aligned addresses are read as float4s
    /// (`sgemm_reg4`), others with scalar loads; both give the same bits.
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm_reg(
        &self,
        q: &dyn Queue,
        d: GemmDims,
        alpha: f32,
        a: &Buf,
        b: &Buf,
        beta: f32,
        c: &Buf,
        bias: Option<&Buf>,
        relu: bool,
        splits: usize,
    ) -> Result<()> {
        let kernel = match reg_vec_ok(d, &[a.addr(), b.addr()]) {
            true => &self.sgemm_reg4,
            false => &self.sgemm_reg,
        };
        self.split_k_product(
            q, kernel, REG_SHAPE, d, alpha, a, b, beta, c, bias, relu, splits,
        )
    }

    /// One split-K launch of a kernel with `sgemm_tiled`'s arguments and blocks of `shape`,
    /// then the reduce node if K was split.
    #[allow(clippy::too_many_arguments)]
    fn split_k_product(
        &self,
        q: &dyn Queue,
        kernel: &Function,
        shape: TileShape,
        d: GemmDims,
        alpha: f32,
        a: &Buf,
        b: &Buf,
        beta: f32,
        c: &Buf,
        bias: Option<&Buf>,
        relu: bool,
        splits: usize,
    ) -> Result<()> {
        if !buffers_ready(&d, a, b, c, bias)? {
            return Ok(());
        }
        let t = TiledLaunch::with_tile(d, shape, splits)?;
        let partial = if t.splits > 1 {
            Some(cudagraph::QueueExt::alloc::<f32>(
                q,
                prod("gemm split-K scratch", &[t.splits, t.mn])?,
            )?)
        } else {
            None
        };
        let mut args = t.args(alpha, a, b, beta, c, bias, relu);
        args.push(Arg::opt(partial.as_ref()));
        // SAFETY: `kernel` is `sgemm_tiled` or an `sgemm_reg*` kernel, launched with the
        // threads and the tile it was written for (`TILED_SHAPE`, `REG_SHAPE`); `sgemm_reg4`
        // only where `reg_vec_ok` holds: its float4 reads start at multiples of 4 elements of
        // 16-byte aligned operands and, with a leading dimension a multiple of 4, end inside
        // the row or column an in-bounds first element starts. Blocks cover rows < m and columns < n
        // (guarded in the kernel) and K ranges [z·kc, min(k, (z+1)·kc)); with lda/ldb derived
        // from the layout, every read of A is below m·k and of B below k·n (both checked),
        // writes go to C below m·n (checked) or, split, to partial below splits·m·n (allocated
        // so); bias below n (checked).
        unsafe { launch(q, kernel, t.config(t.splits), &args)? };
        if let Some(p) = &partial {
            // SAFETY: e < m·n reads partial[z·m·n + e] for z < splits (its extent) and writes
            // C[e] (checked); bias below n.
            unsafe {
                launch(
                    q,
                    &self.splitk_reduce,
                    elems(t.mn),
                    &[
                        p.into(),
                        (t.splits as i32).into(),
                        c.into(),
                        t.mi.into(),
                        t.ni.into(),
                        alpha.into(),
                        beta.into(),
                        Arg::opt(bias),
                        (relu as i32).into(),
                    ],
                )?;
            }
        }
        Ok(())
    }

    /// `sgemm_tiled`'s product with K split into exactly `splits` ∈ {2, 4, 8} ranges reduced
    /// inside a thread-block cluster (sm_90+, gemm_cluster.cu): one kernel, no scratch, the
    /// same result as `sgemm_tiled` with as many non-empty splits, bit for bit.
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm_cluster(
        &self,
        q: &dyn Queue,
        d: GemmDims,
        alpha: f32,
        a: &Buf,
        b: &Buf,
        beta: f32,
        c: &Buf,
        bias: Option<&Buf>,
        relu: bool,
        splits: usize,
    ) -> Result<()> {
        if !buffers_ready(&d, a, b, c, bias)? {
            return Ok(());
        }
        let ck = ClusterKernels::get(q.device())?;
        let f = sized(&ck.tiled, &TILED_CLUSTERS, splits, "a cluster of K splits")?;
        let t = TiledLaunch::new(d, splits)?;
        let args = t.args(alpha, a, b, beta, c, bias, relu);
        // SAFETY: as for `sgemm_tiled` without `partial`: blocks cover rows < m and columns < n
        // (guarded) and K ranges [z·kc, min(k, (z+1)·kc)) — empty for z ≥ t.splits — so reads of
        // A stay below m·k and of B below k·n, writes (rank 0 only) go to C below m·n, bias below
        // n (all checked). The grid's z is the cluster's size, as the kernel's
        // `__cluster_dims__` requires; shared memory is only read within the cluster, before
        // the barrier that ends every block.
        unsafe {
            q.launch_with(f, t.config(splits), &args, pdl::options(q.device()))?;
        }
        Ok(())
    }

    /// The forward layout `C = act(alpha·A·Bᵀ + beta·C + bias)`, A m×k and B n×k row-major,
    /// streamed in 128-wide K chunks of float4s (sm_90+, gemm_cluster.cu): K split into
    /// `splits` ∈ {1, 2, 4, 8} ranges of whole chunks, reduced inside a thread-block cluster.
    /// k must be a multiple of 4 and A and B 16-byte aligned ([`rows_ok`]).
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm_nt_chunks(
        &self,
        q: &dyn Queue,
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        a: &Buf,
        b: &Buf,
        beta: f32,
        c: &Buf,
        bias: Option<&Buf>,
        relu: bool,
        splits: usize,
    ) -> Result<()> {
        let d = nt_dims(m, n, k);
        if !buffers_ready(&d, a, b, c, bias)? {
            return Ok(());
        }
        if !rows_ok(k, &[a.addr(), b.addr()]) {
            return Err(NnError::Shape(format!(
                "gemm: the chunked kernel reads float4s: k ({k}) must be a multiple of 4 and \
                 A and B 16-byte aligned"
            )));
        }
        let ck = ClusterKernels::get(q.device())?;
        let f = sized(&ck.nt, &CHUNK_SPLITS, splits, "K splits in a cluster")?;
        let (gx, gy) = d.tiles()?;
        let kc = k.div_ceil(splits).div_ceil(128).max(1) * 128;
        // Block z starts at z·kc and chunks step past its end by less than 128.
        int_loop("k split", splits * kc, 128)?;
        let cfg = LaunchConfig {
            grid: (gx, gy, splits as u32),
            block: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            int_loop("m", m, 32)?.into(),
            int_loop("n", n, 32)?.into(),
            int_loop("k", k, 128)?.into(),
            alpha.into(),
            a.into(),
            b.into(),
            beta.into(),
            c.into(),
            Arg::opt(bias),
            (relu as i32).into(),
            int("kc", kc)?.into(),
        ];
        // SAFETY: reads of A are rows < m (guarded) at float4s [gk, gk + 4) with gk a multiple
        // of 4 below kend ≤ k (k a multiple of 4), so below m·k, 16-byte aligned (A aligned, k
        // and gk multiples of 4); likewise B below n·k; C is written (by rank 0 only) and read
        // (beta ≠ 0) below m·n, bias below n — all checked above. The grid's z is the cluster's
        // size, as the kernel's `__cluster_dims__` requires; distributed shared memory is read
        // before the barrier every block of the cluster passes last.
        unsafe {
            q.launch_with(f, cfg, &args, pdl::options(q.device()))?;
        }
        Ok(())
    }

    /// The warp-K kernel for the forward layout only: `C = act(A·Bᵀ + bias)`, A m×k, B n×k.
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm_nt_warpk(
        &self,
        q: &dyn Queue,
        m: usize,
        n: usize,
        k: usize,
        a: &Buf,
        b: &Buf,
        c: &Buf,
        bias: Option<&Buf>,
        relu: bool,
    ) -> Result<()> {
        let d = nt_dims(m, n, k);
        if !buffers_ready(&d, a, b, c, bias)? {
            return Ok(());
        }
        let (gx, gy) = d.tiles()?;
        let cfg = LaunchConfig {
            grid: (gx, gy, 1),
            block: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads of A (row < m, col < k) and B (row < n, col < k) are guarded in the
        // kernel and within m·k and n·k (checked); writes to C below m·n; bias below n.
        unsafe {
            launch(
                q,
                &self.sgemm_nt_warpk,
                cfg,
                &[
                    int_loop("m", m, 1024)?.into(),
                    int_loop("n", n, 1024)?.into(),
                    int_loop("k", k, 1024)?.into(),
                    a.into(),
                    b.into(),
                    c.into(),
                    Arg::opt(bias),
                    (relu as i32).into(),
                ],
            )
        }
    }

    /// The few-rows kernel for the forward layout: `C = act(A·Bᵀ + bias)`, A m×k, B n×k, with
    /// `ks` warps (1, 2, 4 or 8; 16 with 8 or 4 rows per block) splitting K per group of four
    /// columns. Needs k a multiple of 4
    /// and A, B 16-byte aligned (it reads float4s); [`rows_ok`] says whether it applies.
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm_nt_rows(
        &self,
        q: &dyn Queue,
        m: usize,
        n: usize,
        k: usize,
        a: &Buf,
        b: &Buf,
        c: &Buf,
        bias: Option<&Buf>,
        relu: bool,
        (ks, per_block): (usize, usize),
    ) -> Result<()> {
        if !ks.is_power_of_two() || ks > rows_most_splits(per_block) {
            return Err(NnError::Shape(format!(
                "gemm rows: {ks} warps per column group (1, 2, 4, 8, or 16 with at most 8 rows \
                 per block)"
            )));
        }
        let f = match per_block {
            16 => &self.sgemm_nt_rows,
            8 => &self.sgemm_nt_rows8,
            4 => &self.sgemm_nt_rows4,
            _ => {
                return Err(NnError::Shape(format!(
                    "gemm rows: {per_block} rows per block (one of {ROWS_PER_BLOCK:?})"
                )))
            }
        };
        if !few_rows_ready("gemm rows", (m, n, k), a, b, c, bias)? {
            return Ok(());
        }
        let cfg = rows_grid(m, n, ks, per_block)?;
        // SAFETY: a block covers rows [p·y, p·y + p) (p = per_block) and columns of its groups;
        // every load of A is at row < m (guarded) and k offset kk < k with kk % 4 == 0 and
        // k % 4 == 0 (checked), so the float4 at A + row·k + kk lies below m·k (checked) and is
        // 16-byte aligned (A aligned, k % 4 == 0); likewise B at column < n below n·k. Writes go
        // to C at row < m, column < n (guarded), below m·n (checked); the bias is read below n
        // (checked). The kernels' column offsets stay within 1024 of n and their k offsets
        // (a chunk ks·128 ahead, ks ≤ 16) within 2176 of k, which int_loop bounds. A block
        // has rows_warps(ks) warps, the ks warps of each group indexing `part` below 16.
        unsafe {
            launch(
                q,
                f,
                cfg,
                &few_rows_args((m, n, k), a, b, c, bias, relu, ks)?,
            )
        }
    }

    /// The column-warp kernel for the forward layout: `C = act(A·Bᵀ + bias)`, A m×k, B n×k,
    /// each warp `shape.rows` rows × `shape.cols` columns. Needs k a multiple of 4 and A, B
    /// 16-byte aligned (it reads float4s, [`rows_ok`]).
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm_nt_cols(
        &self,
        q: &dyn Queue,
        (m, n, k): (usize, usize, usize),
        a: &Buf,
        b: &Buf,
        c: &Buf,
        bias: Option<&Buf>,
        relu: bool,
        shape: ColsShape,
    ) -> Result<()> {
        shape.check()?;
        let f = match (shape.rows, shape.cols) {
            (1, 1) => &self.sgemm_nt_cols_r1c1,
            (1, _) => &self.sgemm_nt_cols_r1c2,
            (2, 1) => &self.sgemm_nt_cols_r2c1,
            (2, _) => &self.sgemm_nt_cols_r2c2,
            (4, 1) => &self.sgemm_nt_cols_r4c1,
            (4, _) => &self.sgemm_nt_cols_r4c2,
            (8, 1) => &self.sgemm_nt_cols_r8c1,
            (8, _) => &self.sgemm_nt_cols_r8c2,
            (_, 1) => &self.sgemm_nt_cols_r16c1,
            _ => &self.sgemm_nt_cols_r16c2,
        };
        if !few_rows_ready("gemm cols", (m, n, k), a, b, c, bias)? {
            return Ok(());
        }
        let cfg = shape.grid(m, n)?;
        // SAFETY: a block covers rows [R·y, R·y + R) and the columns of its warps' groups; every
        // load of A is at row < m (guarded) and k offset kk < k with kk % 4 == 0 and k % 4 == 0
        // (checked), so the float4 at A + row·k + kk lies below m·k (checked) and is 16-byte
        // aligned (A aligned, k % 4 == 0); likewise B at column < n below n·k. Writes go to C
        // at row < m, column < n (guarded), below m·n (checked); the bias is read below n
        // (checked). Column indices stay within 1024 of n (two columns times at most 16 warps
        // past the last group) and k offsets within 128 of k, which int_loop bounds. A block
        // has shape.warps ≤ 16 warps (checked), indexing the kernel's 16-row `part`.
        unsafe {
            launch(
                q,
                f,
                cfg,
                &few_rows_args((m, n, k), a, b, c, bias, relu, shape.ks)?,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{reg_vec_ok, GemmDims, TiledLaunch, REG_SHAPE};

    fn dims(m: usize, n: usize, k: usize, ta: bool, tb: bool) -> GemmDims {
        GemmDims { m, n, k, ta, tb }
    }

    /// float4 loads need both leading dimensions (k or m for A, k or n for B) to be multiples
    /// of 4 and both operands 16-byte aligned.
    #[test]
    fn float4_loads_need_aligned_rows_of_whole_float4s() {
        let aligned = [256u64, 4096];
        assert!(reg_vec_ok(dims(3, 5, 8, false, true), &aligned)); // lda = k, ldb = k
        assert!(!reg_vec_ok(dims(4, 8, 6, false, true), &aligned)); // k not a multiple of 4
        assert!(reg_vec_ok(dims(8, 12, 3, true, false), &aligned)); // lda = m, ldb = n
        assert!(!reg_vec_ok(dims(8, 10, 4, true, false), &aligned)); // ldb = n = 10
        assert!(!reg_vec_ok(dims(6, 8, 4, true, true), &aligned)); // lda = m = 6
        assert!(!reg_vec_ok(dims(4, 4, 4, false, false), &[256, 4100]));
        assert!(!reg_vec_ok(dims(4, 4, 4, false, false), &[8, 4096]));
    }

    /// 512 threads per block of 64 × 64 outputs; rows past the grid's 65535 blocks are a typed
    /// error, not a launch.
    #[test]
    fn register_blocked_launch_shape_and_grid_limit() {
        let t = TiledLaunch::with_tile(dims(130, 65, 100, false, true), REG_SHAPE, 1).unwrap();
        let cfg = t.config(t.splits);
        assert_eq!((cfg.grid, cfg.block), ((2, 3, 1), (512, 1, 1)));
        let t = TiledLaunch::with_tile(dims(64, 64, 1000, false, true), REG_SHAPE, 5).unwrap();
        assert_eq!((t.splits, t.kc), (5, 224));
        assert!(TiledLaunch::with_tile(dims(64 * 65536, 1, 1, false, true), REG_SHAPE, 1).is_err());
    }
}

#[cfg(test)]
mod cols_tests {
    use super::ColsShape;

    #[test]
    fn cols_shapes_check_and_grid() {
        let ok = ColsShape {
            rows: 2,
            cols: 2,
            warps: 8,
            ks: 4,
        };
        let cfg = ok.grid(3, 1001).unwrap();
        // 501 column pairs in groups of two per block; two block rows.
        assert_eq!((cfg.grid, cfg.block), ((251, 2, 1), (256, 1, 1)));
        for bad in [
            ColsShape { rows: 3, ..ok },
            ColsShape { cols: 4, ..ok },
            ColsShape { warps: 2, ..ok },
            ColsShape { warps: 32, ..ok },
            ColsShape { ks: 3, ..ok },
            ColsShape { ks: 16, ..ok },
            ColsShape { ks: 0, ..ok },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
            assert!(bad.grid(1, 1).is_err(), "{bad:?}");
        }
        // Grids past the device's limits are errors, not launches.
        assert!(ok.grid(2 * 65535 + 1, 1).is_err());
        assert!(ok.grid(1, usize::MAX).is_err());
        assert!(ok.grid(usize::MAX, usize::MAX).is_err());
    }
}
