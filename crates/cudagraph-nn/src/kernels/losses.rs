//! Fused loss kernels (`loss_fused.cu`, their own NVRTC module) and their checked launchers:
//! row-parallel softmax cross-entropy for any number of classes, and MSE, each computing the
//! gradient in the forward pass when the loss will be differentiated (the backward pass then
//! only scales it by the upstream gradient, in place).
//!
//! Reductions are deterministic (fixed grids, fixed summation order), so a replay equals the
//! eager run bit for bit. Problems one block covers in a single pass (cross-entropy: up to 32
//! rows of up to 1024 classes, or one wide row, and with lane groups up to 1024 narrow rows,
//! [`ce_group_plans`]; MSE: at most [`SINGLE_BLOCK_ELEMS`] elements) run as one block that also
//! writes the loss: one graph node. Anything larger is spread over
//! many blocks (a block walking rows or elements in sequence is latency-bound: measured 4.7×
//! slower than PyTorch at 256 rows × 10 classes when one block did all rows).

use std::sync::Arc;

use cudagraph::{
    register_check, Arg, Device, DeviceBuffer, Function, LaunchConfig, Queue, QueueExt,
};

use super::{int, long, need, prod};
use crate::env::{CE_GROUPS_VAR, CE_SPLIT_VAR};
use crate::error::{NnError, Result};

/// MSE problems up to this many elements run in a single block (16 elements per thread; one
/// launch, no partial sums).
pub const SINGLE_BLOCK_ELEMS: usize = 4 * 1024;
/// Widest rows cross-entropy handles with one warp per row.
pub const WARP_ROW_MAX: usize = 1024;
const BLOCK: u32 = 256;
/// Threads of `ce_fwd_block` (one block per wide row: more threads share the row).
const WIDE_BLOCK: u32 = 1024;
/// At most this many rows take the split forward pass (no gradient) in one kernel after the
/// chunk statistics (`ce_split_mean`: row losses and their mean), instead of two.
pub const CE_FUSED_ROWS: usize = 256;

type Buf = DeviceBuffer<f32>;

/// The loss kernels of one device (a [`Device::extension`]).
pub struct LossKernels {
    ce_fwd_warp: Function,
    ce_fwd_block: Function,
    ce_split_stats: Function,
    ce_split_finish: Function,
    ce_split_mean: Function,
    sum_scaled: Function,
    mse_fwd: Function,
    scale_by: Function,
    /// Id of the "cross_entropy target" device-side check (the same id as the NN context's).
    ce_check: u32,
    sms: u32,
}

/// How `LossKernels::cross_entropy` runs a problem: grid, whether one warp handles a row,
/// whether a second pass reduces per-row losses, and into how many chunks each row is split
/// across blocks (1: not split).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CePlan {
    /// Blocks in the grid.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
    /// Whether one warp handles a row (else one block per row or chunk).
    pub warp_rows: bool,
    /// Lanes per row of the warp-row kernel (a power of two up to 32).
    pub lanes: u32,
    /// Whether a second pass reduces the per-row losses.
    pub two_pass: bool,
    /// Chunks each row is split into across blocks (1: not split).
    pub chunks: u32,
}

/// Fewest classes a chunk of a split row holds (below that, merging partials costs more than
/// the extra blocks save).
const MIN_CHUNK: usize = 1024;
/// Most chunks per row (one warp merges a row's chunks, a lane each).
const MAX_CHUNKS: usize = 32;
/// Fewest chunks worth splitting a row into. Measured on the H100 (beside the block-per-row
/// plan): 9 and 17 chunks per row were faster (32 × 10 000 forward
/// 10.3 → 8.9 µs, 16 × 50 000 21.1 → 11.1 µs), 3 chunks slower (128 × 10 000 forward
/// 10.3 → 11.5 µs, 128 × 50 000 21.7 → 25.5 µs): the merge pass costs more than 3 blocks
/// per row save.
const MIN_SPLIT_CHUNKS: usize = 4;

/// Which of the plan's measured options are on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CeOptions {
    /// Wide rows (fewer than the multiprocessors) may be split across blocks.
    pub split: bool,
    /// The registry may measure plans where narrow rows share a warp (a group of lanes per
    /// row) so that one block covers more rows in one pass (`ce_group_plans`).
    pub groups: bool,
}

impl CeOptions {
    /// Both on: the default.
    pub const DEFAULT: CeOptions = CeOptions {
        split: true,
        groups: true,
    };

    /// From [`CE_SPLIT_VAR`] and [`CE_GROUPS_VAR`] (read once per process).
    pub fn from_env() -> Result<CeOptions> {
        static ON: std::sync::OnceLock<std::result::Result<CeOptions, String>> =
            std::sync::OnceLock::new();
        ON.get_or_init(|| {
            let read = |var, what| {
                crate::env::switch(var, true, &format!("1 ({what}, the default) or 0"))
                    .map_err(|e| e.to_string())
            };
            Ok(CeOptions {
                split: read(CE_SPLIT_VAR, "split wide rows across blocks")?,
                groups: read(CE_GROUPS_VAR, "several narrow rows per warp")?,
            })
        })
        .clone()
        .map_err(NnError::Config)
    }
}

/// The single-block plans where a group of lanes takes a row (more than 8 and at most 1024
/// narrow rows): lanes a power of two below 32 giving each about 8, 4 or 2 classes, as long as
/// the block holds every row at once (one pass, the mean included: one node). The engine
/// registry measures them against [`ce_plan_with`]'s plan (`crate::autograd::ops::cross_entropy`).
/// Measured on the H100, 256 × 10 forward: 4.9 µs in 32 blocks and a sum pass,
/// 4.0 with 2 lanes a row, 5.2 with 4 (before the last loads of a lane were batched).
pub fn ce_group_plans(rows: usize, cols: usize) -> Vec<CePlan> {
    if rows <= (BLOCK / 32) as usize || cols > WARP_ROW_MAX {
        return Vec::new();
    }
    let mut out: Vec<CePlan> = Vec::new();
    for per_lane in [8, 4, 2] {
        let lanes = cols.div_ceil(per_lane).next_power_of_two();
        let threads = rows.saturating_mul(lanes);
        if lanes >= 32 || threads > WIDE_BLOCK as usize {
            continue;
        }
        let plan = CePlan {
            grid: 1,
            block: (threads.next_power_of_two() as u32).max(32),
            warp_rows: true,
            lanes: lanes as u32,
            two_pass: false,
            chunks: 1,
        };
        if !out.contains(&plan) {
            out.push(plan);
        }
    }
    out
}

/// The launch plan for `rows × cols` logits on `sms` multiprocessors, with the options set in
/// the environment.
pub fn ce_plan(rows: usize, cols: usize, sms: u32) -> Result<CePlan> {
    Ok(ce_plan_with(rows, cols, sms, CeOptions::from_env()?))
}

/// The launch plan for `rows × cols` logits on `sms` multiprocessors with options `o`.
pub fn ce_plan_with(rows: usize, cols: usize, sms: u32, o: CeOptions) -> CePlan {
    let warp_rows = cols <= WARP_ROW_MAX;
    let sms = sms.max(1) as usize;
    // Wide rows, fewer than the multiprocessors: a block per row would leave most of the GPU
    // idle and run each row's long dependent chain on one multiprocessor. Split each row so
    // that about two blocks per multiprocessor run, each chunk holding at least MIN_CHUNK, when
    // that gives at least MIN_SPLIT_CHUNKS chunks.
    if !warp_rows && rows < sms && o.split {
        let chunks = (2 * sms)
            .div_ceil(rows.max(1))
            .min(cols.div_ceil(MIN_CHUNK))
            .clamp(1, MAX_CHUNKS);
        if chunks >= MIN_SPLIT_CHUNKS {
            return CePlan {
                grid: (rows * chunks) as u32,
                block: BLOCK,
                warp_rows: false,
                lanes: 32,
                two_pass: true,
                chunks: chunks as u32,
            };
        }
    }
    // Up to 32 narrow rows: one block of a warp per row does the rows and the mean (one node
    // instead of a row pass and a sum pass). Measured on the H100: 32 × 10
    // forward 5.0 → 4.5 µs; two rows per warp in sequence lose (64 × 100 forward 5.5 → 8.2 µs).
    if warp_rows && rows > (BLOCK / 32) as usize && rows <= (WIDE_BLOCK / 32) as usize {
        return CePlan {
            grid: 1,
            block: WIDE_BLOCK,
            warp_rows,
            lanes: 32,
            two_pass: false,
            chunks: 1,
        };
    }
    let per_block = if warp_rows { (BLOCK / 32) as usize } else { 1 };
    let most = (sms * 16).min(CE_MAX_GRID);
    // One block only when it covers every row in a single pass.
    let needed = rows.div_ceil(per_block).max(1);
    let single = needed == 1;
    let grid = needed.clamp(1, most);
    CePlan {
        grid: grid as u32,
        block: if warp_rows { BLOCK } else { WIDE_BLOCK },
        warp_rows,
        lanes: 32,
        two_pass: !single,
        chunks: 1,
    }
}

/// Most rows, and most classes, the cross-entropy kernels take: their `int` loop indices step
/// up to a grid of warps (rows) or a block (classes) past the last element, which must not
/// overflow (`i32::MAX` rows of one class would wrap a loop index and read outside the logits).
pub const CE_MAX_DIM: usize = i32::MAX as usize - (1 << 16);

/// Most blocks a row-parallel cross-entropy grid has (grid-stride loops beyond that), so that
/// a loop index stepping a whole grid of warps past the last row stays below `i32::MAX`.
const CE_MAX_GRID: usize = 8192;

/// `rows` and `cols` as the kernels' `int`s, or a shape error above [`CE_MAX_DIM`].
fn ce_dims(rows: usize, cols: usize) -> Result<(i32, i32)> {
    for (what, v) in [("rows", rows), ("classes", cols)] {
        if v > CE_MAX_DIM {
            return Err(NnError::Shape(format!(
                "cross_entropy: {v} {what}, at most {CE_MAX_DIM}; split the batch"
            )));
        }
    }
    Ok((rows as i32, cols as i32))
}

/// Blocks of the MSE pass for `n` elements: one when small, else about 4096 elements per
/// block up to four per multiprocessor.
pub fn mse_blocks(n: usize, sms: u32) -> u32 {
    if n <= SINGLE_BLOCK_ELEMS {
        1
    } else {
        n.div_ceil(4096).clamp(1, sms.max(1) as usize * 4) as u32
    }
}

impl LossKernels {
    /// The kernels of `device`, compiled on first use.
    pub fn get(device: &Device) -> Result<Arc<LossKernels>> {
        device
            .extension(|d| {
                let m = d.compile(
                    "cudagraph_nn_loss",
                    &super::module_source("cudagraph_nn_loss"),
                )?;
                Ok(LossKernels {
                    ce_fwd_warp: m.function("ce_fwd_warp")?,
                    ce_fwd_block: m.function("ce_fwd_block")?,
                    ce_split_stats: m.function("ce_split_stats")?,
                    ce_split_finish: m.function("ce_split_finish")?,
                    ce_split_mean: m.function("ce_split_mean")?,
                    sum_scaled: m.function("sum_scaled")?,
                    mse_fwd: m.function("mse_fwd")?,
                    scale_by: m.function("scale_by")?,
                    ce_check: register_check("cross_entropy target"),
                    sms: d.info().multiprocessors,
                })
            })
            .map_err(NnError::from)
    }

    /// `out[0] = scale · Σ v[0..count)` in one block, fixed order.
    fn sum_scaled(
        &self,
        q: &dyn Queue,
        v: &Buf,
        count: usize,
        out: &Buf,
        scale: f32,
    ) -> Result<()> {
        need("loss partial sums", v, count)?;
        need("loss output", out, 1)?;
        // SAFETY: one block reads v[0..count) (checked) and writes out[0] (checked).
        unsafe {
            super::launch(
                q,
                &self.sum_scaled,
                LaunchConfig::linear(1, BLOCK),
                &[
                    v.into(),
                    Arg::I32(int("count", count)?),
                    out.into(),
                    scale.into(),
                ],
            )
        }
    }

    /// `loss[0] = scale · Σ (p − t)²` over `n` elements; with `grad`, also
    /// `grad = 2·scale·(p − t)` (the gradient for an upstream gradient of 1).
    #[allow(clippy::too_many_arguments)]
    pub fn mse(
        &self,
        q: &dyn Queue,
        p: &Buf,
        t: &Buf,
        grad: Option<&Buf>,
        loss: &Buf,
        n: usize,
        scale: f32,
    ) -> Result<()> {
        need("mse pred", p, n)?;
        need("mse target", t, n)?;
        need("mse loss", loss, 1)?;
        if let Some(g) = grad {
            need("mse gradient", g, n)?;
        }
        let blocks = mse_blocks(n, self.sms);
        let n_arg = Arg::I64(long(n)?);
        if blocks == 1 {
            // SAFETY: one block reads p, t below n and writes grad below n (all checked) and
            // loss[0] (checked); partial is null and unused when loss is set.
            return unsafe {
                super::launch(
                    q,
                    &self.mse_fwd,
                    LaunchConfig::linear(1, 1024),
                    &[
                        p.into(),
                        t.into(),
                        Arg::opt(grad),
                        Arg::NULL,
                        loss.into(),
                        n_arg,
                        scale.into(),
                    ],
                )
            };
        }
        let partial = q.alloc::<f32>(blocks as usize)?;
        // SAFETY: `blocks` blocks read p, t and write grad below n (checked) and write
        // partial[blockIdx.x] (partial holds `blocks`); loss is null.
        unsafe {
            super::launch(
                q,
                &self.mse_fwd,
                LaunchConfig::linear(blocks, BLOCK),
                &[
                    p.into(),
                    t.into(),
                    Arg::opt(grad),
                    (&partial).into(),
                    Arg::NULL,
                    n_arg,
                    scale.into(),
                ],
            )?;
        }
        self.sum_scaled(q, &partial, blocks as usize, loss, scale)
    }

    /// `g[0..n) *= s[0]` in place.
    pub fn scale_by(&self, q: &dyn Queue, g: &Buf, s: &Buf, n: usize) -> Result<()> {
        need("scaled gradient", g, n)?;
        need("upstream gradient", s, 1)?;
        if n == 0 {
            return Ok(());
        }
        let blocks = n
            .div_ceil(4 * BLOCK as usize)
            .clamp(1, self.sms.max(1) as usize * 8);
        // SAFETY: threads touch g below n (checked) and read s[0] (checked).
        unsafe {
            super::launch(
                q,
                &self.scale_by,
                LaunchConfig::linear(blocks as u32, BLOCK),
                &[g.into(), s.into(), Arg::I64(long(n)?)],
            )
        }
    }

    /// Softmax cross-entropy of `rows × cols` logits against `targets`, mean over rows into
    /// `loss[0]`; with `grad`, also `grad = (softmax − onehot) / rows`. Targets outside
    /// `[0, cols)` are clamped (nothing outside a row is read) and reported through the
    /// device's error flag.
    // Not called by the ops, which launch by plan ([`ce_plan`]).
    #[allow(clippy::too_many_arguments, dead_code)]
    pub fn cross_entropy(
        &self,
        q: &dyn Queue,
        logits: &Buf,
        targets: &DeviceBuffer<i32>,
        grad: Option<&Buf>,
        loss: &Buf,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let plan = ce_plan(rows, cols, self.sms)?;
        self.cross_entropy_planned(q, &plan, logits, targets, grad, loss, rows, cols)
    }

    /// Multiprocessors of the device (what the plans are made for).
    pub fn sms(&self) -> u32 {
        self.sms
    }

    /// [`Self::cross_entropy`] with `plan`: the one [`ce_plan`] makes or one of
    /// [`ce_group_plans`] for these sizes (any other is an error).
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_planned(
        &self,
        q: &dyn Queue,
        plan: &CePlan,
        logits: &Buf,
        targets: &DeviceBuffer<i32>,
        grad: Option<&Buf>,
        loss: &Buf,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        if rows == 0 || cols == 0 {
            return Err(NnError::Shape(format!(
                "cross_entropy over {rows} rows of {cols} classes"
            )));
        }
        let n = prod("cross_entropy", &[rows, cols])?;
        need("cross_entropy logits", logits, n)?;
        need("cross_entropy targets", targets, rows)?;
        need("cross_entropy loss", loss, 1)?;
        if let Some(g) = grad {
            need("cross_entropy gradient", g, n)?;
        }
        let (ri, ci) = ce_dims(rows, cols)?;
        if *plan != ce_plan(rows, cols, self.sms)? && !ce_group_plans(rows, cols).contains(plan) {
            return Err(NnError::Config(format!(
                "cross_entropy: {plan:?} is not a plan for {rows} rows of {cols} classes"
            )));
        }
        let plan = *plan;
        if plan.chunks > 1 {
            return self.cross_entropy_split(q, logits, targets, grad, loss, (ri, ci), plan);
        }
        let row_loss = if plan.two_pass {
            Some(q.alloc::<f32>(rows)?)
        } else {
            None
        };
        let f = if plan.warp_rows {
            &self.ce_fwd_warp
        } else {
            &self.ce_fwd_block
        };
        let inv_rows = 1.0 / rows as f32;
        // SAFETY: rows r < rows read logits and write grad in [r·cols, (r+1)·cols) (both hold
        // rows·cols, checked), read targets[r] (holds rows), clamp the target into [0, cols)
        // before it indexes, and write row_loss[r] (allocated with rows) or, single-block,
        // loss[0]; flag is the device's mapped error word.
        unsafe {
            super::launch(
                q,
                f,
                LaunchConfig::linear(plan.grid, plan.block),
                &[
                    logits.into(),
                    targets.into(),
                    Arg::opt(grad),
                    Arg::opt(row_loss.as_ref()),
                    if plan.two_pass {
                        Arg::NULL
                    } else {
                        loss.into()
                    },
                    Arg::I32(ri),
                    Arg::I32(ci),
                    inv_rows.into(),
                    Arg::I32(plan.lanes as i32),
                    q.check_flag_arg()?,
                    Arg::U32(self.ce_check),
                ],
            )?;
        }
        match &row_loss {
            Some(r) => self.sum_scaled(q, r, rows, loss, inv_rows),
            None => Ok(()),
        }
    }

    /// Cross-entropy with each row split into `plan.chunks` chunks across blocks: chunk
    /// statistics; then per row the merged statistics, the row's loss and (with `grad`) the
    /// gradient per chunk; then the mean over rows in one block. `(ri, ci)`: rows and classes
    /// as [`ce_dims`] checked them.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_split(
        &self,
        q: &dyn Queue,
        logits: &Buf,
        targets: &DeviceBuffer<i32>,
        grad: Option<&Buf>,
        loss: &Buf,
        (ri, ci): (i32, i32),
        plan: CePlan,
    ) -> Result<()> {
        let rows = ri as usize;
        let chunks = plan.chunks as usize;
        if chunks > MAX_CHUNKS {
            return Err(NnError::Shape(format!(
                "cross_entropy: {chunks} chunks per row, at most {MAX_CHUNKS}"
            )));
        }
        let parts = prod("cross_entropy chunks", &[rows, chunks])?;
        let ki = int("chunks", chunks)?;
        let (pm, ps) = (q.alloc::<f32>(parts)?, q.alloc::<f32>(parts)?);
        let zt = q.alloc::<f32>(rows)?;
        let inv_rows = 1.0 / rows as f32;
        // SAFETY: block b = r·chunks + k (b < rows·chunks = grid) reads logits of row r < rows
        // in columns [k·len, min((k+1)·len, cols)) and its target logit (targets[r] clamped
        // into [0, cols) before it indexes; logits hold rows·cols, targets rows, checked by
        // the caller), writes pm[b], ps[b] (allocated with rows·chunks) and zt[r] (allocated
        // with rows); flag is the device's error word.
        unsafe {
            super::launch(
                q,
                &self.ce_split_stats,
                LaunchConfig::linear(plan.grid, BLOCK),
                &[
                    logits.into(),
                    targets.into(),
                    Arg::I32(ri),
                    Arg::I32(ci),
                    Arg::I32(ki),
                    (&pm).into(),
                    (&ps).into(),
                    (&zt).into(),
                    q.check_flag_arg()?,
                    Arg::U32(self.ce_check),
                ],
            )?;
        }
        if grad.is_none() && rows <= CE_FUSED_ROWS {
            need("loss output", loss, 1)?;
            // As many whole warps as the lane groups need (32 / g rows a warp, g the next power
            // of two of the chunks), not 1024 threads whatever the rows.
            let g = chunks.next_power_of_two();
            let threads = (rows.div_ceil(32 / g) * 32).clamp(32, WIDE_BLOCK as usize);
            // SAFETY: one block; lane j < chunks of row r's group (r < rows) reads
            // pm/ps[r·chunks + j] (chunks ≤ 32; allocated with rows·chunks) and zt[r]
            // (allocated with rows);
            // rows ≤ CE_FUSED_ROWS, the kernel's shared row array; writes loss[0] (checked).
            return unsafe {
                super::launch(
                    q,
                    &self.ce_split_mean,
                    LaunchConfig::linear(1, threads as u32),
                    &[
                        (&pm).into(),
                        (&ps).into(),
                        (&zt).into(),
                        loss.into(),
                        Arg::I32(ri),
                        Arg::I32(ki),
                        inv_rows.into(),
                    ],
                )
            };
        }
        let row_loss = q.alloc::<f32>(rows)?;
        let per_row = if grad.is_some() { chunks } else { 1 };
        let blocks = u32::try_from(rows * per_row).map_err(|_| {
            NnError::Shape(format!("cross_entropy: {rows} rows × {per_row} chunks"))
        })?;
        // SAFETY: block b = r·per_row + k (r < rows) reads pm/ps[r·chunks .. r·chunks +
        // chunks) (chunks ≤ 32; allocated with rows·chunks), zt[r] (allocated with rows),
        // targets[r] (clamped into [0, cols) before it indexes) and logits of row r; writes
        // row_loss[r] (allocated with rows) and, with a gradient, grad over chunk k of row r
        // (grad holds rows·cols, checked by the caller).
        unsafe {
            super::launch(
                q,
                &self.ce_split_finish,
                LaunchConfig::linear(blocks, if grad.is_some() { BLOCK } else { 32 }),
                &[
                    logits.into(),
                    targets.into(),
                    Arg::opt(grad),
                    (&pm).into(),
                    (&ps).into(),
                    (&zt).into(),
                    (&row_loss).into(),
                    Arg::I32(ri),
                    Arg::I32(ci),
                    Arg::I32(ki),
                    Arg::I32(int("chunks", per_row)?),
                    inv_rows.into(),
                ],
            )?;
        }
        self.sum_scaled(q, &row_loss, rows, loss, inv_rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(rows: usize, cols: usize, sms: u32) -> CePlan {
        ce_plan_with(rows, cols, sms, CeOptions::DEFAULT)
    }

    #[test]
    fn small_cross_entropy_runs_in_one_block() {
        assert_eq!(
            plan(8, 10, 132),
            CePlan {
                grid: 1,
                block: BLOCK,
                warp_rows: true,
                lanes: 32,
                two_pass: false,
                chunks: 1,
            }
        );
        // One wide row that one chunk covers: one block.
        assert_eq!(
            plan(1, 1000, 132),
            CePlan {
                grid: 1,
                block: BLOCK,
                warp_rows: true,
                lanes: 32,
                two_pass: false,
                chunks: 1,
            }
        );
    }

    #[test]
    fn sizes_whose_loop_indices_could_wrap_are_refused() {
        assert_eq!(ce_dims(3, 10).unwrap(), (3, 10));
        assert_eq!(
            ce_dims(CE_MAX_DIM, CE_MAX_DIM).unwrap(),
            (CE_MAX_DIM as i32, CE_MAX_DIM as i32)
        );
        for (r, c) in [
            (CE_MAX_DIM + 1, 1),
            (1, CE_MAX_DIM + 1),
            (1, i32::MAX as usize),
        ] {
            let e = ce_dims(r, c).unwrap_err().to_string();
            assert!(e.contains("at most"), "{e}");
        }
        // The largest step a loop index takes past the last element: a grid of at most
        // CE_MAX_GRID blocks of 8 warps (rows), or a block of 1024 threads (classes).
        assert!(CE_MAX_DIM + CE_MAX_GRID * 8 <= i32::MAX as usize);
        assert!(CE_MAX_DIM + 1024 <= i32::MAX as usize);
        assert!(plan(1 << 30, 10, 100_000).grid as usize <= CE_MAX_GRID);
        assert!(plan(1 << 30, 5000, 100_000).grid as usize <= CE_MAX_GRID);
    }

    #[test]
    fn few_wide_rows_are_split_across_blocks() {
        // 16 rows of 50000: 17 chunks of at least 1024 (about two blocks per SM).
        let p = plan(16, 50000, 132);
        assert_eq!((p.chunks, p.grid, p.two_pass), (17, 16 * 17, true));
        // Capped by the chunk size: 2 rows of 5000 classes give 5 chunks each.
        assert_eq!(plan(2, 5000, 132).chunks, 5);
        // Fewer than MIN_SPLIT_CHUNKS chunks: a block per row (measured faster).
        assert_eq!(plan(2, 3000, 132).chunks, 1);
        assert_eq!(plan(128, 10000, 132).chunks, 1);
        assert_eq!(plan(64, 10000, 132).chunks, 5);
        let p = plan(1, 30000, 132);
        assert_eq!((p.chunks, p.grid), (30, 30));
        // And by one warp's lanes: never more than 32 chunks.
        assert_eq!(plan(1, 1 << 20, 132).chunks, 32);
        // As many rows as SMs or more: a block per row, no split.
        assert_eq!(plan(132, 50000, 132).chunks, 1);
        assert_eq!(plan(1 << 20, 50000, 132).chunks, 1);
    }

    #[test]
    fn large_cross_entropy_is_row_parallel() {
        let p = plan(4096, 10, 132);
        assert!(p.warp_rows && p.two_pass);
        assert_eq!(p.grid, 512); // 8 rows per block
                                 // Without lane groups, 256 rows of 10 take 32 blocks and a sum pass: never one block
                                 // walking 32 rows per warp.
        let no_groups = CeOptions {
            groups: false,
            ..CeOptions::DEFAULT
        };
        let p = ce_plan_with(256, 10, 132, no_groups);
        assert!(p.warp_rows && p.two_pass);
        assert_eq!((p.grid, p.lanes), (32, 32));
        // 9 to 32 narrow rows: one block of 1024 threads, a warp per row, mean included.
        for rows in [9, 32] {
            let p = plan(rows, 1000, 132);
            assert_eq!(
                (p.grid, p.block, p.lanes, p.two_pass),
                (1, WIDE_BLOCK, 32, false)
            );
        }
        assert!(ce_plan_with(33, 10, 132, no_groups).two_pass);
        assert!(plan(33, 1000, 132).two_pass);
        assert!(plan(2, 50000, 132).two_pass);
        let p = plan(200, 50000, 132);
        assert!(!p.warp_rows && p.two_pass && p.chunks == 1);
        assert_eq!(p.grid, 200); // a block per row
        let p = plan(1 << 20, 50000, 132);
        assert_eq!(p.grid, 132 * 16); // grid-stride beyond that
        assert!(!plan(3, 1025, 132).warp_rows);
    }

    #[test]
    fn narrow_rows_may_share_warps_to_fit_one_block() {
        // 256 rows of 10: 2 and 4 lanes a row fit one block (the mean included); 8 do not.
        let p = ce_group_plans(256, 10);
        let shapes: Vec<_> = p
            .iter()
            .map(|p| (p.grid, p.block, p.lanes, p.two_pass))
            .collect();
        assert_eq!(shapes, [(1, 512, 2, false), (1, 1024, 4, false)]);
        // 60 rows of 64: 8 and 16 lanes (32 would be the plain warp a row).
        let lanes: Vec<u32> = ce_group_plans(60, 64).iter().map(|p| p.lanes).collect();
        assert_eq!(lanes, [8, 16]);
        // 33 rows of 10: 66, 132 and 264 threads, rounded up to powers of two (the block sum's
        // tree).
        let blocks: Vec<u32> = ce_group_plans(33, 10).iter().map(|p| p.block).collect();
        assert_eq!(blocks, [128, 256, 512]);
        // 1000 rows of 3: a lane a row.
        assert_eq!(ce_group_plans(1000, 3)[0].lanes, 1);
        // None for few rows (one block of a warp a row already), wide rows, or too many rows.
        assert!(ce_group_plans(8, 10).is_empty());
        assert!(ce_group_plans(64, 1025).is_empty());
        assert!(ce_group_plans(1025, 1).is_empty());
        // 64 rows of 100: only 16 lanes (7 classes each) fit.
        let lanes: Vec<u32> = ce_group_plans(64, 100).iter().map(|p| p.lanes).collect();
        assert_eq!(lanes, [16]);
        // The plain plan is unchanged by the options.
        let p = plan(256, 10, 132);
        assert!(p.two_pass && p.lanes == 32 && p.grid == 32);
    }

    #[test]
    fn mse_uses_one_block_when_small() {
        assert_eq!(mse_blocks(1, 132), 1);
        assert_eq!(mse_blocks(SINGLE_BLOCK_ELEMS, 132), 1);
        assert_eq!(mse_blocks(SINGLE_BLOCK_ELEMS + 1, 132), 2);
        assert_eq!(mse_blocks(1 << 30, 132), 528);
    }
}
