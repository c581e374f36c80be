//! Multi-tensor optimizer kernels (`optim_mt.cu`, their own NVRTC module) and their checked
//! launchers: one launch updates every parameter of a step, as PyTorch's `multi_tensor_apply`
//! (`_fused_adam`, `_fused_sgd`) does — optionally unscaling the gradients for a GradScaler
//! (and skipping the whole step on the device when it found an inf or NaN) and writing 16-bit
//! model copies of the new parameters in the same pass. [`OptimKernels::sgd_pure`] and
//! [`OptimKernels::adam_pure`] update parameters stored only in bf16 or f16 (no f32 master):
//! f32 arithmetic and f32 moments, one rounding of the new parameter per step.
//!
//! The tensors travel in a by-value table (a struct parameter: pointers, element counts,
//! chunk prefix sums; `mt_table.cu`, shared with the scaler and clipping kernels of
//! [`super::amp`]). Pointers inside a struct are invisible to the library, so the launchers
//! here check every length written into the table against its buffer, check each buffer's
//! device, and call [`Queue::use_block`] for every buffer (a graph keeps them alive, eager
//! streams order their reuse). Tables hold up to [`CAP_S`] tensors (about 3.5 KB of
//! parameters, cheap for eager launches) or [`CAP_L`] (about 28 KB, within CUDA 12.1+'s 32 KB
//! limit); more tensors take more launches.

use std::sync::Arc;

use cudagraph::memory::{bf16, f16};
use cudagraph::{Arg, BlockRef, Device, DeviceBuffer, Function, LaunchConfig, Queue};

use super::need;
use crate::dtype::{Dtype, Float};
use crate::error::{NnError, Result};

/// The optimizer kernels' own source (the module compiles [`module_source`]).
pub const SOURCE: &str = include_str!("optim_mt.cu");

/// The multi-tensor table and the GradScaler's slots, shared with the `amp` module.
pub const TABLE_SOURCE: &str = include_str!("mt_table.cu");

/// The optimizer module's source as compiled: `cast.cu` (the rounding of the 16-bit copies,
/// the very code of [`super::cast`]), `mt_table.cu`, `optim_mt.cu`.
pub fn module_source() -> String {
    format!("{}{}{}", super::cast::SOURCE, TABLE_SOURCE, SOURCE)
}

/// Tensors per table in the small kernels.
pub const CAP_S: usize = 64;
/// Tensors per table in the large kernels (32 KB kernel parameters: CUDA 12.1+, sm_70+).
pub const CAP_L: usize = 512;
/// Threads per block of the multi-tensor kernels.
pub const BLOCK: u32 = 256;

/// Slots of the hyperparameter buffer (`f32`), shared by the optimizers and the schedule node.
pub mod hp {
    /// The learning rate the next update uses.
    pub const LR: usize = 0;
    /// The learning rate a device-side schedule scales.
    pub const BASE_LR: usize = 1;
    pub const BETA1: usize = 2;
    pub const BETA2: usize = 3;
    pub const EPS: usize = 4;
    pub const WEIGHT_DECAY: usize = 5;
    pub const MOMENTUM: usize = 6;
    /// Length of the buffer.
    pub const LEN: usize = 8;
}

/// Slots of the optimizer state buffer (`u32`).
pub mod state {
    /// Optimizer steps completed (what a schedule reads).
    pub const STEP: usize = 0;
    /// The Adam kernels' last-block ticket (0 between launches; SGD advances the step count
    /// from one thread, as no block of its launch reads it). Only the kernels use it.
    #[allow(dead_code)]
    pub const TICKET: usize = 1;
    /// Length of the buffer.
    pub const LEN: usize = 2;
}

/// One tensor of a table: `depth` device addresses, its element count and its step-counter
/// slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableEntry<const D: usize> {
    pub addrs: [u64; D],
    pub n: u64,
    pub slot: u32,
}

/// Bytes of a table of depth `d` and capacity `cap` (even): the kernel's `MtTable<D, CAP>`.
pub const fn table_bytes(d: usize, cap: usize) -> usize {
    8 * ((d + 2) * cap + 1)
}

/// One launch's table: its bytes and the facts the launcher needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    pub bytes: Vec<u8>,
    /// Tensors in the table.
    pub count: usize,
    /// Chunks over all its tensors (the grid strides over them).
    pub chunks: u32,
    /// The capacity it was laid out for ([`CAP_S`] or [`CAP_L`]).
    pub cap: usize,
}

/// Elements per chunk for `total` elements on `sms` multiprocessors: about eight chunks per
/// multiprocessor, a multiple of 1024 (one 16-byte load per thread of a 256-thread block),
/// between 1024 and 65536 (PyTorch's chunk).
pub fn chunk_elems(total: u64, sms: u32) -> u32 {
    let target = (sms.max(1) as u64) * 8;
    let per = total.div_ceil(target).div_ceil(1024).saturating_mul(1024);
    per.clamp(1024, 65536) as u32
}

/// The grid of a launch over table `t` on `sms` multiprocessors: one block per chunk, at most
/// eight blocks per multiprocessor (the blocks stride over the rest).
pub fn grid_for(t: &Table, sms: u32) -> LaunchConfig {
    let grid = (t.chunks as u64).clamp(1, sms.max(1) as u64 * 8) as u32;
    LaunchConfig::linear(grid, BLOCK)
}

/// Lays `entries` out in tables of at most `cap_large` tensors (a table with at most
/// [`CAP_S`] uses the small layout), chunks of `chunk` elements. Zero-length tensors are left
/// out. Always returns at least one table (an empty one when nothing is left), so a launch
/// still advances the counters.
pub fn build_tables<const D: usize>(
    entries: &[TableEntry<D>],
    chunk: u32,
    cap_large: usize,
) -> Result<Vec<Table>> {
    if chunk == 0 || chunk % 4 != 0 {
        return Err(NnError::Shape(format!(
            "optimizer chunk of {chunk} elements (must be a positive multiple of 4)"
        )));
    }
    let cap_large = cap_large.clamp(CAP_S, CAP_L);
    let live: Vec<&TableEntry<D>> = entries.iter().filter(|e| e.n > 0).collect();
    let mut out = Vec::new();
    for group in live.chunks(cap_large) {
        out.push(layout(group, chunk, cap_large)?);
    }
    if out.is_empty() {
        out.push(layout::<D>(&[], chunk, CAP_S)?);
    }
    Ok(out)
}

fn layout<const D: usize>(group: &[&TableEntry<D>], chunk: u32, cap_large: usize) -> Result<Table> {
    let cap = if group.len() <= CAP_S {
        CAP_S
    } else {
        cap_large
    };
    let mut b = vec![0u8; table_bytes(D, cap)];
    let n_at = D * cap * 8;
    let chunk0_at = n_at + 8 * cap;
    let slot_at = chunk0_at + 4 * (cap + 1);
    let count_at = slot_at + 4 * cap;
    let put = |b: &mut [u8], at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
    let mut chunks: u32 = 0;
    for (i, e) in group.iter().enumerate() {
        for (d, a) in e.addrs.iter().enumerate() {
            put(&mut b, (d * cap + i) * 8, &a.to_le_bytes());
        }
        let n = i64::try_from(e.n)
            .map_err(|_| NnError::Shape(format!("optimizer tensor of {} elements", e.n)))?;
        put(&mut b, n_at + 8 * i, &n.to_le_bytes());
        put(&mut b, chunk0_at + 4 * i, &chunks.to_le_bytes());
        put(&mut b, slot_at + 4 * i, &e.slot.to_le_bytes());
        let c = u32::try_from(e.n.div_ceil(chunk as u64)).ok();
        chunks = c.and_then(|c| chunks.checked_add(c)).ok_or_else(|| {
            NnError::Shape("optimizer: more than 2^32 chunks in one launch".into())
        })?;
    }
    put(&mut b, chunk0_at + 4 * group.len(), &chunks.to_le_bytes());
    put(&mut b, count_at, &(group.len() as i32).to_le_bytes());
    Ok(Table {
        bytes: b,
        count: group.len(),
        chunks,
        cap,
    })
}

/// Slots of a GradScaler's device buffer (`f32`): the scale, then one found-inf flag per
/// optimizer stepped between two updates (the kernels' `AMP_SCALE`, `AMP_FOUND`).
pub mod amp_slots {
    /// The loss scale.
    pub const SCALE: usize = 0;
    /// The first found-inf flag (0.0 or 1.0); optimizer `k` of an iteration uses `FOUND + k`.
    pub const FOUND: usize = 1;
}

/// How an optimizer launch takes part in loss scaling: the scaler's device buffer (layout
/// [`amp_slots`]), which found-inf flag decides whether the step is skipped, and whether the
/// kernel multiplies the gradients by 1/scale as it loads them (writing them back unscaled).
#[derive(Clone, Copy)]
pub struct AmpArgs<'a> {
    pub buf: &'a DeviceBuffer<f32>,
    pub found: usize,
    pub unscale: bool,
}

/// A 16-bit model copy of a parameter, written by the update.
#[derive(Clone, Copy)]
pub enum CopyRef<'a> {
    Bf16(&'a DeviceBuffer<bf16>),
    F16(&'a DeviceBuffer<f16>),
}

impl CopyRef<'_> {
    fn dtype(&self) -> Dtype {
        match self {
            CopyRef::Bf16(_) => Dtype::Bf16,
            CopyRef::F16(_) => Dtype::F16,
        }
    }
    fn len(&self) -> usize {
        match self {
            CopyRef::Bf16(b) => b.len(),
            CopyRef::F16(b) => b.len(),
        }
    }
    fn addr(&self) -> u64 {
        match self {
            CopyRef::Bf16(b) => b.addr(),
            CopyRef::F16(b) => b.addr(),
        }
    }
    fn block(&self) -> &Arc<BlockRef> {
        match self {
            CopyRef::Bf16(b) => b.block(),
            CopyRef::F16(b) => b.block(),
        }
    }
    fn device_ordinal(&self) -> usize {
        self.block().device_ordinal()
    }
}

/// The copy kind every tensor of one launch shares (0: none, 1: bf16, 2: f16: the kernels'
/// `KIND`), or a typed error when they differ.
fn copy_kind<'a>(copies: impl Iterator<Item = Option<CopyRef<'a>>>) -> Result<usize> {
    let mut kind = None;
    for c in copies {
        let k = match c.map(|c| c.dtype()) {
            None => 0,
            Some(Dtype::Bf16) => 1,
            Some(_) => 2,
        };
        match kind {
            None => kind = Some(k),
            Some(prev) if prev != k => {
                return Err(NnError::Shape(
                    "optimizer: every tensor of one update needs the same kind of 16-bit copy \
                     (all bf16, all f16, or none)"
                        .into(),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(kind.unwrap_or(0))
}

/// The kernel arguments of `amp`: the buffer (or null), the flag's index, `unscale`.
fn amp_args<'a>(amp: Option<&AmpArgs<'a>>) -> Result<[Arg<'a>; 3]> {
    Ok(match amp {
        None => [Arg::NULL, Arg::I32(0), Arg::I32(0)],
        Some(a) => [
            a.buf.into(),
            Arg::I32(i32::try_from(a.found).map_err(|_| bad_amp(a))?),
            Arg::I32(a.unscale as i32),
        ],
    })
}

fn bad_amp(a: &AmpArgs<'_>) -> NnError {
    NnError::Shape(format!(
        "optimizer: found-inf flag {} of a scaler buffer of {} values",
        a.found,
        a.buf.len()
    ))
}

/// The scaler buffer must hold the scale and the flag the launch reads.
fn check_amp(q: &dyn Queue, amp: Option<&AmpArgs<'_>>) -> Result<()> {
    if let Some(a) = amp {
        let need_len = amp_slots::FOUND
            .checked_add(a.found)
            .and_then(|i| i.checked_add(1))
            .ok_or_else(|| bad_amp(a))?;
        if a.buf.len() < need_len {
            return Err(bad_amp(a));
        }
        same_device(q, a.buf)?;
    }
    Ok(())
}

/// One update's tables and the chunk (in elements) they were laid out with.
struct Tables {
    chunk: u32,
    list: Vec<Table>,
}

/// The optimizer kernels of one device (a [`Device::extension`]): `[copy kind][small, large]`.
pub struct OptimKernels {
    sgd: [[Function; 2]; 3],
    adam: [[Function; 2]; 3],
    /// Pure 16-bit updates: `[bf16, f16][small, large]`.
    sgd_pure: [[Function; 2]; 2],
    adam_pure: [[Function; 2]; 2],
    schedule: Function,
    /// Multiprocessors (grid sizing).
    sms: u32,
    /// Whether the driver takes 32 KB kernel parameters (CUDA 12.1+).
    large_params: bool,
}

/// One SGD tensor: parameter, gradient, momentum buffer (when the optimizer keeps them), 16-bit
/// copy (when it keeps them).
pub struct SgdTensor<'a> {
    pub w: &'a DeviceBuffer<f32>,
    pub g: &'a DeviceBuffer<f32>,
    pub buf: Option<&'a DeviceBuffer<f32>>,
    pub copy: Option<CopyRef<'a>>,
}

/// One Adam tensor: parameter, gradient, moments, its slot in the step counters, and its
/// 16-bit copy (when the optimizer keeps them).
pub struct AdamTensor<'a> {
    pub w: &'a DeviceBuffer<f32>,
    pub g: &'a DeviceBuffer<f32>,
    pub m: &'a DeviceBuffer<f32>,
    pub v: &'a DeviceBuffer<f32>,
    pub slot: u32,
    pub copy: Option<CopyRef<'a>>,
}

/// One SGD tensor of a pure 16-bit update: parameter and gradient stored in `T` (bf16 or f16;
/// no f32 master), the f32 momentum buffer when the optimizer keeps them.
pub struct PureSgdTensor<'a, T: Float> {
    pub w: &'a DeviceBuffer<T>,
    pub g: &'a DeviceBuffer<T>,
    pub buf: Option<&'a DeviceBuffer<f32>>,
}

/// One Adam tensor of a pure 16-bit update: parameter and gradient stored in `T` (bf16 or
/// f16; no f32 master), f32 moments, and its slot in the step counters.
pub struct PureAdamTensor<'a, T: Float> {
    pub w: &'a DeviceBuffer<T>,
    pub g: &'a DeviceBuffer<T>,
    pub m: &'a DeviceBuffer<f32>,
    pub v: &'a DeviceBuffer<f32>,
    pub slot: u32,
}

/// The index of `T` among the pure 16-bit kernels (`[bf16, f16]`); f32 parameters are the
/// ordinary updates' ([`OptimKernels::sgd`], [`OptimKernels::adam`]).
fn pure_index<T: Float>(what: &'static str) -> Result<usize> {
    match T::DTYPE {
        Dtype::Bf16 => Ok(0),
        Dtype::F16 => Ok(1),
        Dtype::F32 => Err(NnError::Dtype {
            what,
            expected: "bf16 or f16 (f32 parameters: OptimKernels::sgd / adam)",
            found: Dtype::F32.name(),
        }),
    }
}

/// `buf` must be memory of `q`'s device.
pub(crate) fn same_device<T: cudagraph::Elem>(q: &dyn Queue, buf: &DeviceBuffer<T>) -> Result<()> {
    same_ordinal(q, buf.block().device_ordinal())
}

fn same_ordinal(q: &dyn Queue, got: usize) -> Result<()> {
    let want = q.device().ordinal();
    if want != got {
        return Err(NnError::Core(cudagraph::Error::WrongDevice {
            what: "optimizer buffer",
            expected: want,
            got,
        }));
    }
    Ok(())
}

/// A copy must have one element per parameter element and live on `q`'s device.
fn check_copy(q: &dyn Queue, copy: Option<CopyRef<'_>>, n: usize) -> Result<()> {
    if let Some(c) = copy {
        if c.len() < n {
            return Err(NnError::Core(cudagraph::Error::SizeMismatch {
                what: "optimizer 16-bit copy",
                expected: n,
                got: c.len(),
            }));
        }
        same_ordinal(q, c.device_ordinal())?;
    }
    Ok(())
}

/// An SGD tensor's gradient and momentum buffer hold the parameter's length, returned, and
/// all three live on `q`'s device.
fn check_sgd_tensor<T: Float>(
    q: &dyn Queue,
    w: &DeviceBuffer<T>,
    g: &DeviceBuffer<T>,
    buf: Option<&DeviceBuffer<f32>>,
) -> Result<usize> {
    let n = w.len();
    need("sgd grad", g, n)?;
    same_device(q, w)?;
    same_device(q, g)?;
    if let Some(b) = buf {
        need("sgd momentum buffer", b, n)?;
        same_device(q, b)?;
    }
    Ok(n)
}

/// An Adam tensor's step slot is below `steps.len()` and not yet in `seen` (then added).
fn check_slot(
    slot: u32,
    steps: &DeviceBuffer<u32>,
    seen: &mut std::collections::HashSet<u32>,
) -> Result<()> {
    if slot as usize >= steps.len() {
        return Err(NnError::Shape(format!(
            "adam: step slot {slot} of {} counters",
            steps.len()
        )));
    }
    if !seen.insert(slot) {
        return Err(NnError::Shape(format!(
            "adam: step slot {slot} used twice in one update"
        )));
    }
    Ok(())
}

impl OptimKernels {
    /// The kernels of `device`, compiled on first use.
    pub fn get(device: &Device) -> Result<Arc<OptimKernels>> {
        device
            .extension(|d| {
                // Relaxed capture mode: the first use may be inside a capture (module loading).
                let m = cudagraph::runtime::with_relaxed_capture(|| {
                    d.compile(
                        "cudagraph_nn_optim",
                        &super::module_source("cudagraph_nn_optim"),
                    )
                })?;
                let pair = |name: &str| -> cudagraph::Result<[Function; 2]> {
                    Ok([
                        m.function(&name.replace("{}", "s"))?,
                        m.function(&name.replace("{}", "l"))?,
                    ])
                };
                Ok(OptimKernels {
                    sgd: [
                        pair("sgd_mt_{}")?,
                        pair("sgd_mt_{}_bf16")?,
                        pair("sgd_mt_{}_f16")?,
                    ],
                    adam: [
                        pair("adam_mt_{}")?,
                        pair("adam_mt_{}_bf16")?,
                        pair("adam_mt_{}_f16")?,
                    ],
                    sgd_pure: [pair("sgd_pure_mt_{}_bf16")?, pair("sgd_pure_mt_{}_f16")?],
                    adam_pure: [pair("adam_pure_mt_{}_bf16")?, pair("adam_pure_mt_{}_f16")?],
                    schedule: m.function("lr_schedule")?,
                    sms: d.info().multiprocessors,
                    large_params: d.info().driver_version >= 12010,
                })
            })
            .map_err(NnError::from)
    }

    /// The most tensors one launch's table may hold on this device.
    fn cap_large(&self) -> usize {
        if self.large_params {
            CAP_L
        } else {
            CAP_S
        }
    }

    fn grid(&self, t: &Table) -> LaunchConfig {
        grid_for(t, self.sms)
    }

    fn check_small_bufs(hp: &DeviceBuffer<f32>, state: &DeviceBuffer<u32>) -> Result<()> {
        need("optimizer hyperparameters", hp, hp::LEN)?;
        need("optimizer state", state, state::LEN)
    }

    /// The tables of one update of `entries`, in chunks sized for their total length.
    fn tables<const D: usize>(&self, entries: &[TableEntry<D>]) -> Result<Tables> {
        let total: u64 = entries.iter().map(|e| e.n).sum();
        let chunk = chunk_elems(total, self.sms);
        let list = build_tables(entries, chunk, self.cap_large())?;
        Ok(Tables { chunk, list })
    }

    /// Launches `fns` (`[small, large]`, by each table's layout) once per table, with the
    /// arguments the multi-tensor kernels take in this order: the table, `head`, `amp`'s
    /// three, the chunk, whether this launch advances the step count (the last one, when
    /// `advance`), then `tail`.
    ///
    /// # Safety
    /// Every tensor of every table must be in bounds of buffers of `fns`' element types, on
    /// `q`'s device and passed to [`Queue::use_block`]; `head` and `tail` must be the
    /// arguments `fns` take there, their buffers holding what `fns` index, and `amp` checked
    /// by `check_amp` (the callers' checks, stated at each call).
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_tables(
        &self,
        q: &dyn Queue,
        fns: &[Function; 2],
        tables: &Tables,
        head: &[Arg<'_>],
        amp: Option<&AmpArgs<'_>>,
        advance: bool,
        tail: &[Arg<'_>],
    ) -> Result<()> {
        let [amp_buf, found, unscale] = amp_args(amp)?;
        let last = tables.list.len() - 1;
        for (i, t) in tables.list.iter().enumerate() {
            let f = &fns[(t.cap != CAP_S) as usize];
            let mut args = Vec::with_capacity(head.len() + tail.len() + 6);
            args.push(Arg::Bytes(&t.bytes));
            args.extend_from_slice(head);
            args.extend([amp_buf, found, unscale]);
            args.push(Arg::I32(tables.chunk as i32));
            args.push(Arg::I32((advance && i == last) as i32));
            args.extend_from_slice(tail);
            // SAFETY: the caller's promise (# Safety) covers the tables, `head`, `tail` and
            // `amp`; the chunk is the one the tables were laid out with.
            unsafe { super::launch(q, f, self.grid(t), &args)? };
        }
        Ok(())
    }

    /// One SGD update of every tensor (PyTorch's rule: `d = g + wd·w`, with momentum
    /// `buf = momentum·buf + d; d = buf`, then `w -= lr·d`), hyperparameters read from `hp`;
    /// advances the step count in `state` when `advance`. With `amp`, the whole update is
    /// skipped on the device when the scaler's flag is set, and the gradients are unscaled
    /// as they are loaded when `amp.unscale`. Copies, when given (all of one kind), receive
    /// the new parameter values rounded to nearest even.
    pub fn sgd(
        &self,
        q: &dyn Queue,
        tensors: &[SgdTensor<'_>],
        hp: &DeviceBuffer<f32>,
        state: &DeviceBuffer<u32>,
        amp: Option<&AmpArgs<'_>>,
        advance: bool,
    ) -> Result<()> {
        Self::check_small_bufs(hp, state)?;
        check_amp(q, amp)?;
        let kind = copy_kind(tensors.iter().map(|t| t.copy))?;
        let mut entries = Vec::with_capacity(tensors.len());
        for t in tensors {
            let n = check_sgd_tensor(q, t.w, t.g, t.buf)?;
            check_copy(q, t.copy, n)?;
            entries.push(TableEntry::<4> {
                addrs: [
                    t.w.addr(),
                    t.g.addr(),
                    t.buf.map_or(0, |b| b.addr()),
                    t.copy.map_or(0, |c| c.addr()),
                ],
                n: n as u64,
                slot: 0,
            });
        }
        let tables = self.tables(&entries)?;
        for t in tensors {
            q.use_block(t.w.block());
            q.use_block(t.g.block());
            if let Some(b) = t.buf {
                q.use_block(b.block());
            }
            if let Some(c) = t.copy {
                q.use_block(c.block());
            }
        }
        let head = [hp.into(), state.into()];
        // SAFETY: every tensor in each table has n ≤ the length of its parameter, gradient,
        // momentum buffer and copy (checked above; a null momentum or copy pointer is never
        // touched, and the copy kind matches the kernel), all on this queue's device and
        // kept alive/ordered by `use_block`; the kernel touches p[d][i][0..n) only,
        // hp[0..8) and state[0..2) (checked), and reads amp[0] and amp[1 + found] (checked
        // by check_amp; a null amp is never read).
        unsafe { self.launch_tables(q, &self.sgd[kind], &tables, &head, amp, advance, &[]) }
    }

    /// One Adam (or, `decoupled`, AdamW) update of every tensor, PyTorch's fused rule; the
    /// step number of tensor `i` is `steps[slot_i] + 1` and is advanced by the launch. `amp`
    /// and copies as for [`Self::sgd`]; a skipped update advances no counter.
    #[allow(clippy::too_many_arguments)]
    pub fn adam(
        &self,
        q: &dyn Queue,
        tensors: &[AdamTensor<'_>],
        hp: &DeviceBuffer<f32>,
        state: &DeviceBuffer<u32>,
        steps: &DeviceBuffer<u32>,
        amp: Option<&AmpArgs<'_>>,
        decoupled: bool,
        advance: bool,
    ) -> Result<()> {
        Self::check_small_bufs(hp, state)?;
        check_amp(q, amp)?;
        let kind = copy_kind(tensors.iter().map(|t| t.copy))?;
        let mut entries = Vec::with_capacity(tensors.len());
        let mut seen_slots = std::collections::HashSet::new();
        for t in tensors {
            let n = t.w.len();
            need("adam grad", t.g, n)?;
            need("adam m", t.m, n)?;
            need("adam v", t.v, n)?;
            check_slot(t.slot, steps, &mut seen_slots)?;
            for b in [t.w, t.g, t.m, t.v] {
                same_device(q, b)?;
            }
            check_copy(q, t.copy, n)?;
            entries.push(TableEntry::<5> {
                addrs: [
                    t.w.addr(),
                    t.g.addr(),
                    t.m.addr(),
                    t.v.addr(),
                    t.copy.map_or(0, |c| c.addr()),
                ],
                n: n as u64,
                slot: t.slot,
            });
        }
        same_device(q, steps)?;
        let tables = self.tables(&entries)?;
        for t in tensors {
            for b in [t.w, t.g, t.m, t.v] {
                q.use_block(b.block());
            }
            if let Some(c) = t.copy {
                q.use_block(c.block());
            }
        }
        q.use_block(steps.block());
        let head = [hp.into(), state.into(), steps.into()];
        let tail = [Arg::I32(decoupled as i32)];
        // SAFETY: every tensor in each table has n ≤ the length of its parameter, gradient,
        // m, v and copy buffers (checked above; the copy kind matches the kernel, a null
        // copy is never touched), all on this queue's device and kept alive/ordered by
        // `use_block`; slots are distinct and below steps.len() (checked); the kernel
        // touches p[d][i][0..n), steps[slot_i], hp[0..8) and state[0..2) (both checked),
        // and reads amp[0] and amp[1 + found] (checked; a null amp is never read).
        unsafe { self.launch_tables(q, &self.adam[kind], &tables, &head, amp, advance, &tail) }
    }

    /// One SGD update of parameters stored only in `T` (bf16 or f16; `NnError::Dtype` for
    /// f32): each element widened, [`Self::sgd`]'s f32 rule (momentum buffers in f32), the
    /// new value rounded once to nearest even. `amp` as for [`Self::sgd`] (an unscaled
    /// gradient is written back rounded to `T`).
    pub fn sgd_pure<T: Float>(
        &self,
        q: &dyn Queue,
        tensors: &[PureSgdTensor<'_, T>],
        hp: &DeviceBuffer<f32>,
        state: &DeviceBuffer<u32>,
        amp: Option<&AmpArgs<'_>>,
        advance: bool,
    ) -> Result<()> {
        let ty = pure_index::<T>("pure 16-bit sgd: parameter")?;
        Self::check_small_bufs(hp, state)?;
        check_amp(q, amp)?;
        let mut entries = Vec::with_capacity(tensors.len());
        for t in tensors {
            let n = check_sgd_tensor(q, t.w, t.g, t.buf)?;
            entries.push(TableEntry::<3> {
                addrs: [t.w.addr(), t.g.addr(), t.buf.map_or(0, |b| b.addr())],
                n: n as u64,
                slot: 0,
            });
        }
        let tables = self.tables(&entries)?;
        for t in tensors {
            q.use_block(t.w.block());
            q.use_block(t.g.block());
            if let Some(b) = t.buf {
                q.use_block(b.block());
            }
        }
        let head = [hp.into(), state.into()];
        // SAFETY: every tensor in each table has n ≤ the length of its parameter, gradient
        // and momentum buffer (checked above; a null momentum pointer is never touched),
        // the parameter and gradient of the kernel's 16-bit type (`ty` from `T`), all on
        // this queue's device and kept alive/ordered by `use_block`; the kernel touches
        // p[d][i][0..n) only, hp[0..8) and state[0..2) (checked), and reads amp[0] and
        // amp[1 + found] (checked by check_amp; a null amp is never read).
        unsafe { self.launch_tables(q, &self.sgd_pure[ty], &tables, &head, amp, advance, &[]) }
    }

    /// One Adam (or, `decoupled`, AdamW) update of parameters stored only in `T` (bf16 or
    /// f16; `NnError::Dtype` for f32): each element widened, [`Self::adam`]'s f32 rule with
    /// f32 moments, the new value rounded once to nearest even. Step counters and `amp` as
    /// for [`Self::adam`].
    #[allow(clippy::too_many_arguments)]
    pub fn adam_pure<T: Float>(
        &self,
        q: &dyn Queue,
        tensors: &[PureAdamTensor<'_, T>],
        hp: &DeviceBuffer<f32>,
        state: &DeviceBuffer<u32>,
        steps: &DeviceBuffer<u32>,
        amp: Option<&AmpArgs<'_>>,
        decoupled: bool,
        advance: bool,
    ) -> Result<()> {
        let ty = pure_index::<T>("pure 16-bit adam: parameter")?;
        Self::check_small_bufs(hp, state)?;
        check_amp(q, amp)?;
        let mut entries = Vec::with_capacity(tensors.len());
        let mut seen_slots = std::collections::HashSet::new();
        for t in tensors {
            let n = t.w.len();
            need("adam grad", t.g, n)?;
            need("adam m", t.m, n)?;
            need("adam v", t.v, n)?;
            check_slot(t.slot, steps, &mut seen_slots)?;
            same_device(q, t.w)?;
            same_device(q, t.g)?;
            same_device(q, t.m)?;
            same_device(q, t.v)?;
            entries.push(TableEntry::<4> {
                addrs: [t.w.addr(), t.g.addr(), t.m.addr(), t.v.addr()],
                n: n as u64,
                slot: t.slot,
            });
        }
        same_device(q, steps)?;
        let tables = self.tables(&entries)?;
        for t in tensors {
            q.use_block(t.w.block());
            q.use_block(t.g.block());
            q.use_block(t.m.block());
            q.use_block(t.v.block());
        }
        q.use_block(steps.block());
        let head = [hp.into(), state.into(), steps.into()];
        let tail = [Arg::I32(decoupled as i32)];
        // SAFETY: every tensor in each table has n ≤ the length of its parameter, gradient,
        // m and v (checked above), the parameter and gradient of the kernel's 16-bit type
        // (`ty` from `T`), all on this queue's device and kept alive/ordered by
        // `use_block`; slots are distinct and below steps.len() (checked); the kernel
        // touches p[d][i][0..n), steps[slot_i], hp[0..8) and state[0..2) (both checked),
        // and reads amp[0] and amp[1 + found] (checked; a null amp is never read).
        unsafe { self.launch_tables(q, &self.adam_pure[ty], &tables, &head, amp, advance, &tail) }
    }

    /// The schedule node: `hp[LR] = schedule(hp[BASE_LR], state[STEP])`, `program` being
    /// [`crate::nn::schedule::Schedule::program`]'s bytes.
    pub fn lr_schedule(
        &self,
        q: &dyn Queue,
        program: &[u8],
        hp: &DeviceBuffer<f32>,
        state: &DeviceBuffer<u32>,
    ) -> Result<()> {
        Self::check_small_bufs(hp, state)?;
        // SAFETY: one thread reads state[0] and hp[1], writes hp[0] (both buffers checked);
        // the program is plain numbers (its size is checked against the declaration).
        unsafe {
            super::launch(
                q,
                &self.schedule,
                LaunchConfig::linear(1, 32),
                &[Arg::Bytes(program), hp.into(), state.into()],
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_u32(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }
    fn read_u64(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
    }

    fn entry(i: u64, n: u64) -> TableEntry<4> {
        TableEntry {
            addrs: [0x1000 * i, 0x1000 * i + 8, 0x1000 * i + 16, 0x1000 * i + 24],
            n,
            slot: i as u32,
        }
    }

    #[test]
    fn table_sizes_match_the_kernel_layout() {
        // sizeof(MtTable<D, CAP>) as static_assert'ed in mt_table.cu.
        assert_eq!(table_bytes(1, CAP_S), 1544);
        assert_eq!(table_bytes(4, CAP_S), 3080);
        assert_eq!(table_bytes(5, CAP_S), 3592);
        assert_eq!(table_bytes(5, CAP_L), 28680);
        assert!(
            table_bytes(5, CAP_S) + 64 <= 4096,
            "small tables and the other parameters fit the classic 4 KB"
        );
        assert!(
            table_bytes(5, CAP_L) + 64 <= 32764,
            "large tables and the other parameters fit CUDA 12.1's limit"
        );
        for (d, cap) in [
            (1, CAP_S),
            (1, CAP_L),
            (4, CAP_S),
            (4, CAP_L),
            (5, CAP_S),
            (5, CAP_L),
        ] {
            assert!(
                TABLE_SOURCE.contains(&format!(
                    "sizeof(MtTable<{d}, {}>) == 8 * ({} * {} + 1)",
                    if cap == CAP_S { "CAP_S" } else { "CAP_L" },
                    d + 2,
                    if cap == CAP_S { "CAP_S" } else { "CAP_L" },
                )),
                "mt_table.cu asserts the layout of depth {d}"
            );
        }
    }

    #[test]
    fn a_launch_takes_one_kind_of_copy() {
        assert_eq!(copy_kind([None, None].into_iter()).unwrap(), 0);
        assert_eq!(copy_kind(std::iter::empty()).unwrap(), 0);
    }

    #[test]
    fn the_module_rounds_copies_with_the_cast_kernels_own_code() {
        let m = module_source();
        assert!(m.starts_with(super::super::cast::SOURCE));
        assert!(m.contains("from_f32<bf16_t>") && m.contains("from_f32<f16_t>"));
        for k in [
            "sgd_mt_s_bf16",
            "sgd_mt_l_f16",
            "adam_mt_s_f16",
            "adam_mt_l_bf16",
        ] {
            assert!(m.contains(&format!("_KERNEL({k},")), "{k}");
        }
    }

    #[test]
    fn tables_hold_pointers_counts_prefix_sums_and_slots() {
        let es: Vec<_> = [1u64, 1024, 1025, 0, 7]
            .iter()
            .enumerate()
            .map(|(i, &n)| entry(i as u64 + 1, n))
            .collect();
        let t = build_tables(&es, 1024, CAP_L).unwrap();
        assert_eq!(t.len(), 1);
        let t = &t[0];
        assert_eq!((t.count, t.cap), (4, CAP_S)); // the empty tensor is left out
        assert_eq!(t.bytes.len(), table_bytes(4, CAP_S));
        // chunks: 1 + 1 + 2 + 1
        assert_eq!(t.chunks, 5);
        let n_at = 4 * CAP_S * 8;
        let c_at = n_at + 8 * CAP_S;
        let s_at = c_at + 4 * (CAP_S + 1);
        let count_at = s_at + 4 * CAP_S;
        assert_eq!(read_u32(&t.bytes, count_at), 4);
        let want_n = [1u64, 1024, 1025, 7];
        let want_c0 = [0u32, 1, 2, 4, 5];
        let want_slot = [1u32, 2, 3, 5];
        for i in 0..4 {
            assert_eq!(read_u64(&t.bytes, n_at + 8 * i), want_n[i]);
            assert_eq!(read_u32(&t.bytes, s_at + 4 * i), want_slot[i]);
            for d in 0..4 {
                assert_eq!(
                    read_u64(&t.bytes, (d * CAP_S + i) * 8),
                    es[want_slot[i] as usize - 1].addrs[d]
                );
            }
        }
        for (i, &c) in want_c0.iter().enumerate() {
            assert_eq!(read_u32(&t.bytes, c_at + 4 * i), c);
        }
        // Unused entries stay zero.
        assert_eq!(read_u64(&t.bytes, n_at + 8 * 4), 0);
    }

    #[test]
    fn many_tensors_split_into_as_few_tables_as_the_capacity_allows() {
        let es: Vec<_> = (0..1060u64).map(|i| entry(i + 1, 3 + i % 5)).collect();
        let t = build_tables(&es, 4096, CAP_L).unwrap();
        assert_eq!(
            t.iter().map(|t| t.count).collect::<Vec<_>>(),
            vec![512, 512, 36]
        );
        assert_eq!(
            t.iter().map(|t| t.cap).collect::<Vec<_>>(),
            vec![CAP_L, CAP_L, CAP_S]
        );
        assert!(t.iter().all(|t| t.chunks as usize == t.count)); // one chunk each
                                                                 // Without 32 KB parameters: tables of 64.
        let t = build_tables(&es, 4096, CAP_S).unwrap();
        assert_eq!(t.len(), 1060usize.div_ceil(64));
        assert!(t
            .iter()
            .all(|t| t.cap == CAP_S && t.bytes.len() == table_bytes(4, CAP_S)));
    }

    #[test]
    fn nothing_to_update_still_gives_one_empty_table() {
        let t = build_tables::<3>(&[], 1024, CAP_L).unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!((t[0].count, t[0].chunks), (0, 0));
    }

    #[test]
    fn bad_chunks_and_chunk_overflow_are_errors() {
        assert!(build_tables(&[entry(1, 10)], 0, CAP_L).is_err());
        assert!(build_tables(&[entry(1, 10)], 6, CAP_L).is_err());
        let huge = [entry(1, u64::MAX / 2)];
        assert!(build_tables(&huge, 1024, CAP_L).is_err());
        let big = [entry(1, 1 << 41), entry(2, 1 << 41)];
        assert!(build_tables(&big, 1024, CAP_L).is_err()); // 2^31 chunks each: 2^32 in all
    }

    #[test]
    fn chunks_aim_at_eight_per_multiprocessor_within_bounds() {
        assert_eq!(chunk_elems(0, 132), 1024);
        assert_eq!(chunk_elems(100_000, 132), 1024);
        assert_eq!(chunk_elems(8 << 20, 132), 8192);
        assert_eq!(chunk_elems(100_000_000, 132), 65536);
        assert_eq!(chunk_elems(8 << 20, 0), 65536);
        for n in [1u64, 999, 1 << 20, 123_456_789] {
            assert_eq!(chunk_elems(n, 132) % 1024, 0);
        }
    }
}
