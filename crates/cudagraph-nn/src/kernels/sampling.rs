//! Launchers of the token-sampling and decode-bookkeeping kernels (`sampling.cu`, its own NVRTC
//! module `cudagraph_nn_sampling`, compiled after the device-check prologue) behind
//! [`crate::nn::sampling`]. Each checks every buffer against the extent its kernel indexes,
//! then makes the promise of [`Queue::launch`] in one `// SAFETY:` comment.

use std::sync::Arc;

use cudagraph::{register_check, Arg, Device, DeviceBuffer, Function, LaunchConfig, Queue};

use super::{int_loop, need};
use crate::error::{NnError, Result};

/// The CUDA source of the module.
pub const SOURCE: &str = include_str!("sampling.cu");

/// Threads of a sampling block (`SAMP_THREADS` in the kernel).
pub const SAMPLE_THREADS: usize = 1024;

/// Most blocks a greedy row is split over.
pub const GREEDY_MAX_SPLIT: usize = 32;

/// Logits a greedy block reads (one float4 per thread: every load in flight at once), unless
/// the row is shorter or the split is capped.
const GREEDY_BLOCK_VALUES: usize = 4 * SAMPLE_THREADS;

/// Blocks in flight the greedy split aims at (two per multiprocessor of an H100).
const GREEDY_TARGET_BLOCKS: usize = 264;

/// Most end-of-sequence ids `decode_advance` compares (`DECODE_MAX_EOS` in the kernel).
pub const DECODE_MAX_EOS: usize = 4;

/// Blocks per row of a `sample_rows` launch: a greedy row is split over this many blocks (its
/// argmax is order-free, so the split changes no token), `rows · split` staying near
/// `GREEDY_TARGET_BLOCKS`; 1 for long batches.
pub fn greedy_split(rows: usize, vocab: usize) -> usize {
    vocab
        .div_ceil(GREEDY_BLOCK_VALUES)
        .min(GREEDY_TARGET_BLOCKS / rows.max(1))
        .clamp(1, GREEDY_MAX_SPLIT)
}

/// Threads per block of the bookkeeping kernels.
const BLOCK: u32 = 256;

/// The name of the device-side check a row without a usable logit reports.
pub const NO_LOGIT_CHECK: &str = "sample: a row whose logits are all NaN or -inf";

/// The sampling kernels of one device (a [`Device::extension`]).
pub struct SamplingKernels {
    sample_rows: Function,
    set: Function,
    start: Function,
    stop: Function,
    advance: Function,
    check: u32,
}

/// The device buffers of one [`crate::nn::sampling::Sampler`]: per-row settings.
pub struct SampleArgs<'a> {
    /// Temperatures (0: greedy).
    pub temperature: &'a DeviceBuffer<f32>,
    /// Top-k (0: off).
    pub top_k: &'a DeviceBuffer<u32>,
    /// Top-p (1: off).
    pub top_p: &'a DeviceBuffer<f32>,
    /// Per-row scratch of the split greedy argmax (zero between calls; the kernel clears it).
    pub best: &'a DeviceBuffer<u64>,
    /// Per-row count of finished greedy blocks (zero between calls; the kernel clears it).
    pub done: &'a DeviceBuffer<u32>,
}

/// The device buffers of one [`crate::nn::sampling::DecodeState`].
pub struct DecodeArgs<'a> {
    /// Next position of each row.
    pub positions: &'a DeviceBuffer<i32>,
    /// 1 where the row is finished.
    pub finished: &'a DeviceBuffer<i32>,
    /// Tokens generated so far.
    pub generated: &'a DeviceBuffer<i32>,
    /// Most tokens to generate.
    pub limit: &'a DeviceBuffer<i32>,
    /// `[rows, max_new]` generated tokens.
    pub history: &'a DeviceBuffer<i32>,
    /// Tokens per history row.
    pub max_new: usize,
    /// End-of-sequence ids.
    pub eos: &'a DeviceBuffer<i32>,
    /// How many of `eos` are used.
    pub n_eos: usize,
    /// One flag, written by every advance: 1 while a row is unfinished.
    pub live: &'a DeviceBuffer<u32>,
}

impl DecodeArgs<'_> {
    fn check(&self, rows: usize) -> Result<()> {
        need("decode positions", self.positions, rows)?;
        need("decode finished", self.finished, rows)?;
        need("decode generated", self.generated, rows)?;
        need("decode limit", self.limit, rows)?;
        need(
            "decode history",
            self.history,
            rows.checked_mul(self.max_new)
                .ok_or_else(|| NnError::Shape("decode history: too many tokens".into()))?,
        )?;
        need("decode eos ids", self.eos, self.n_eos)?;
        need("decode live flag", self.live, 1)?;
        if self.n_eos > DECODE_MAX_EOS {
            return Err(NnError::Config(format!(
                "decode: {} end-of-sequence ids, at most {DECODE_MAX_EOS}",
                self.n_eos
            )));
        }
        int_loop("decode history tokens", self.max_new, BLOCK as usize)?;
        Ok(())
    }
}

fn row_int(row: usize, rows: usize, what: &str) -> Result<i32> {
    if row >= rows {
        return Err(NnError::Shape(format!(
            "{what}: row {row} outside the {rows} rows"
        )));
    }
    super::int("row", row)
}

impl SamplingKernels {
    /// The kernels of `device`, compiled on first use.
    pub fn get(device: &Device) -> Result<Arc<Self>> {
        Ok(device.extension(|d| {
            // Relaxed capture mode: the first use may be inside a capture (module loading).
            let m = cudagraph::runtime::with_relaxed_capture(|| {
                d.compile(
                    "cudagraph_nn_sampling",
                    &super::module_source("cudagraph_nn_sampling"),
                )
            })?;
            Ok(SamplingKernels {
                sample_rows: m.function("sample_rows")?,
                set: m.function("sampling_set")?,
                start: m.function("decode_start")?,
                stop: m.function("decode_stop")?,
                advance: m.function("decode_advance")?,
                check: register_check(NO_LOGIT_CHECK),
            })
        })?)
    }

    /// `tokens[r]` for `r < rows` from `logits` `[rows, vocab]` with the settings of `p` and the
    /// generator state `state` at `offset` (counter `base + offset + r` for row `r`).
    #[allow(clippy::too_many_arguments)]
    pub fn sample(
        &self,
        q: &dyn Queue,
        logits: &DeviceBuffer<f32>,
        rows: usize,
        vocab: usize,
        p: &SampleArgs<'_>,
        state: &DeviceBuffer<u64>,
        offset: u64,
        tokens: &DeviceBuffer<i32>,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        if vocab == 0 {
            return Err(NnError::Shape("sample: a vocabulary of 0 tokens".into()));
        }
        let vi = int_loop("sample vocabulary", vocab, SAMPLE_THREADS)?;
        let ri = int_loop("sample rows", rows, 1)?;
        need(
            "sample logits",
            logits,
            rows.checked_mul(vocab)
                .ok_or_else(|| NnError::Shape("sample: too many logits".into()))?,
        )?;
        need("sample temperatures", p.temperature, rows)?;
        need("sample top-k", p.top_k, rows)?;
        need("sample top-p", p.top_p, rows)?;
        need("generator state", state, 2)?;
        need("sampled tokens", tokens, rows)?;
        need("greedy scratch", p.best, rows)?;
        need("greedy block counts", p.done, rows)?;
        let split = greedy_split(rows, vocab);
        let blocks = rows
            .checked_mul(split)
            .filter(|&b| b <= i32::MAX as usize)
            .ok_or_else(|| NnError::Shape("sample: too many rows".into()))?;
        // SAFETY: sample_rows(const float* logits, int rows, int vocab, const float* temp, const
        // unsigned* topk, const float* topp, const u64* state, u64 offset, int* tokens, cg_check*,
        // unsigned, u64* best, unsigned* done, int split): block r·split + b (r < rows) reads
        // logits[r·vocab .. (r+1)·vocab) (rows·vocab checked; the float4 reads start at the
        // row's first 16-byte boundary and end within the row), temp/topk/topp[r], writes
        // tokens[r] and best/done[r] (rows checked), reads state[0..2) (checked); rows·split
        // blocks fit an i32 (checked); its loop indices step at most 1024 past vocab (<
        // i32::MAX, checked).
        // Launched as a decode-path kernel: it waits for the previous kernel before touching
        // memory (CG_PDL_ENTER), so inside a capture it may launch while that kernel drains.
        unsafe {
            super::pdl::launch_decode(
                q,
                &self.sample_rows,
                LaunchConfig::linear(blocks as u32, SAMPLE_THREADS as u32),
                &[
                    logits.into(),
                    Arg::I32(ri),
                    Arg::I32(vi),
                    p.temperature.into(),
                    p.top_k.into(),
                    p.top_p.into(),
                    state.into(),
                    Arg::U64(offset),
                    tokens.into(),
                    q.check_flag_arg()?,
                    Arg::U32(self.check),
                    p.best.into(),
                    p.done.into(),
                    Arg::I32(split as i32),
                ],
            )
        }
    }

    /// Row `row`'s settings (`row` below every buffer's length).
    pub fn set(
        &self,
        q: &dyn Queue,
        p: &SampleArgs<'_>,
        row: usize,
        temperature: f32,
        top_k: u32,
        top_p: f32,
    ) -> Result<()> {
        let rows = p.temperature.len().min(p.top_k.len()).min(p.top_p.len());
        let r = row_int(row, rows, "sampling settings")?;
        // SAFETY: sampling_set writes temp/topk/topp[row], row below all three lengths
        // (checked); one thread.
        unsafe {
            Ok(q.launch(
                &self.set,
                LaunchConfig::linear(1, 1),
                &[
                    p.temperature.into(),
                    p.top_k.into(),
                    p.top_p.into(),
                    Arg::I32(r),
                    temperature.into(),
                    Arg::U32(top_k),
                    top_p.into(),
                ],
            )?)
        }
    }

    /// A sequence joins row `row` of `rows`: next position `position`, limit `new_tokens`.
    pub fn start(
        &self,
        q: &dyn Queue,
        d: &DecodeArgs<'_>,
        rows: usize,
        row: usize,
        position: i32,
        new_tokens: i32,
    ) -> Result<()> {
        d.check(rows)?;
        let r = row_int(row, rows, "decode start")?;
        // SAFETY: decode_start writes positions/finished/generated/limit[row] (row < rows, each
        // holds rows, checked) and history[row·max_new + j] for j < max_new (rows·max_new
        // checked; the loop index passes max_new by less than a block, checked).
        unsafe {
            Ok(q.launch(
                &self.start,
                LaunchConfig::linear(1, BLOCK),
                &[
                    d.positions.into(),
                    d.finished.into(),
                    d.generated.into(),
                    d.limit.into(),
                    d.history.into(),
                    Arg::I32(d.max_new as i32),
                    Arg::I32(r),
                    Arg::I32(position),
                    Arg::I32(new_tokens),
                ],
            )?)
        }
    }

    /// Row `row` of `rows` leaves (finished = 1).
    pub fn stop(&self, q: &dyn Queue, d: &DecodeArgs<'_>, rows: usize, row: usize) -> Result<()> {
        d.check(rows)?;
        let r = row_int(row, rows, "decode stop")?;
        // SAFETY: one thread writes finished[row], row < rows (checked).
        unsafe {
            Ok(q.launch(
                &self.stop,
                LaunchConfig::linear(1, 1),
                &[d.finished.into(), Arg::I32(r)],
            )?)
        }
    }

    /// One decode step's bookkeeping for rows `r < rows` (see `decode_advance`).
    pub fn advance(
        &self,
        q: &dyn Queue,
        d: &DecodeArgs<'_>,
        tokens: &DeviceBuffer<i32>,
        rows: usize,
        ids: &DeviceBuffer<i32>,
        pos_out: &DeviceBuffer<i32>,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        d.check(rows)?;
        need("sampled tokens", tokens, rows)?;
        need("next input ids", ids, rows)?;
        need("next positions", pos_out, rows)?;
        let ri = int_loop("decode rows", rows, BLOCK as usize)?;
        // One block (its threads loop over the rows, so that it can tell whether any is left):
        // `rows` threads rounded up to a warp, at most BLOCK.
        let config = LaunchConfig::linear(1, rows.min(BLOCK as usize).next_multiple_of(32) as u32);
        // SAFETY: the block's threads take rows r < rows (the loop index passes rows by less
        // than a block, checked): each reads tokens/limit/finished/generated/positions[r],
        // writes ids/pos_out/positions/generated/finished[r] (each holds rows, checked), writes
        // history[r·max_new + g] only for 0 <= g < max_new (rows·max_new checked), reads
        // eos[e] only for e < n_eos (n_eos <= DECODE_MAX_EOS and eos holds n_eos, checked);
        // thread 0 writes live[0] (it holds one, checked).
        // A decode-path kernel too (CG_PDL_ENTER), after the sampling.
        unsafe {
            super::pdl::launch_decode(
                q,
                &self.advance,
                config,
                &[
                    tokens.into(),
                    Arg::I32(ri),
                    ids.into(),
                    pos_out.into(),
                    d.positions.into(),
                    d.finished.into(),
                    d.generated.into(),
                    d.limit.into(),
                    d.history.into(),
                    Arg::I32(d.max_new as i32),
                    d.eos.into(),
                    Arg::I32(d.n_eos as i32),
                    d.live.into(),
                ],
            )
        }
    }
}
