//! Choosing the next token on the device, and the decode loop's bookkeeping, both capturable
//! (no host read): [`Sampler`] turns logits `[rows, vocab]` into one token per row with each
//! row's own [`SamplingParams`] (kept in device memory, so a captured step stays valid when a
//! row's request changes), drawing its randomness from a graph-safe [`Generator`];
//! [`DecodeState`] records the tokens, feeds them and their positions to the next step, and
//! marks rows finished on an end-of-sequence id or at their limit.
//!
//! **Semantics** (Hugging Face `generate`'s logits processors, in this order): divide by the
//! temperature (as a multiplication by its f32 reciprocal: within an ulp of the division); keep the `top_k` largest (ties: lower token id first); keep the smallest prefix
//! of what is left, sorted descending (ties: lower id first), whose probability reaches `top_p`
//! (always at least one token); draw from the softmax of what is kept. Temperature 0 is greedy:
//! the largest logit, the lowest id on ties.
//!
//! **Exact and deterministic.** Probabilities are fixed-point integers: a kept value `z` weighs
//! `exp(z - max)` in units of 2^-32 ([`reference::weight`]: 2^(n+f) with `2^f` a degree-7
//! polynomial in correctly rounded f32 fused multiply-adds, so the CPU computes the same
//! integers; error below 2e-6 relative plus one unit, values more than 32 octaves below the maximum weigh 0).
//! Sums are integer, so no reduction order matters. The top-p comparison is
//! `(f64) mass_before < (f64) top_p · (f64) total`. The draw takes the row's 64-bit Philox
//! number `r` (counter `base + offset + row`, words x and y) and picks, in token-id order, the
//! first kept token whose running weight exceeds `⌊r · total / 2^64⌋`. [`reference`](mod@reference) reproduces
//! every choice bit for bit on the CPU.
//!
//! **NaN and infinities.** A NaN logit is never chosen (nor counted by top-k). `+inf` logits
//! share all the probability equally (each weighs 2^32, everything else 0); `-inf` weighs 0. A
//! row with no logit above `-inf` gets token 0 and reports the device-side check
//! [`NO_LOGIT_CHECK`], so the next synchronisation returns `cudagraph::Error::DeviceCheck`
//! (position: the row).
//!
//! **Cost.** One `sample_rows` launch of 1024-thread blocks. A greedy row (temperature 0) is
//! split over up to 32 blocks (`kernels::sampling::greedy_split`: about 4 096 logits a block,
//! rows · split near 264 blocks) that read it once as float4 (coalesced, no arithmetic beyond a
//! compare per value) and fold a packed (key, id) maximum with `atomicMax` (order-free: the
//! same token whatever the order); the last block to finish writes the token and clears the
//! per-row scratch. A sampled row takes one block (the other blocks of its row exit at once);
//! each pass reads the row once (from L2 after the first) and costs some 20 instructions per
//! value (about 50 where it computes weights), so a block's arithmetic, not memory, bounds it.
//! Passes: temperature 2 (maximum; the draw's kept-weight sums over 32 contiguous warp runs
//! read coalesced, then a few strips to narrow the run down to one id); top-k adds 4 (radix
//! select on the order keys, 8-bit digits, a shared histogram with warp-aggregated adds);
//! top-p adds 4 (weights are computed for the top-k candidates only, so after a top-k these
//! cost like count passes); a threshold inside a run of equal values adds 2 (rare). Rows of
//! up to `i32::MAX - 1024` tokens. Expected on an H100 for a 50 257-token row, kernel time as
//! ncu reports it: greedy about 3 µs (13 blocks, one float4 per thread: a launch plus one
//! L2/DRAM round trip for the row's 200 KB; about the same for a batch of up to 32 rows), temperature about 8 µs, top-k + top-p about
//! 20 µs, top-p alone about 40 µs; 2.5 times the sampled costs for 128k tokens, the same for
//! a batch up to the number of multiprocessors. [`DecodeState::advance`] is one block of
//! `rows` threads (up to 256; then blocks of 256) whose loads are all issued before its
//! stores: about 2 µs. `sampling_cost_per_step_is_printed` in `tests/gpu_sampling.rs` prints
//! the measured numbers.

use std::sync::Arc;

use cudagraph::{DeviceBuffer, Queue, QueueExt, Stream};

use crate::error::{NnError, Result};
pub use crate::kernels::sampling::NO_LOGIT_CHECK;
use crate::kernels::sampling::{DecodeArgs, SampleArgs, SamplingKernels};
use crate::random::Generator;

/// Most end-of-sequence ids a [`DecodeState`] checks.
pub const MAX_EOS: usize = crate::kernels::sampling::DECODE_MAX_EOS;

/// Per-row sampling settings, kept in device memory so a captured step stays valid when a
/// row's request changes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// Logits are divided by it; 0 means greedy (argmax). Finite, at least 0.
    pub temperature: f32,
    /// Keep only the `top_k` largest; 0: off.
    pub top_k: u32,
    /// Keep the smallest most-probable set of at least this mass; 1: off. In `(0, 1]`.
    pub top_p: f32,
}

impl SamplingParams {
    /// Greedy decoding: the largest logit, the lowest id on ties.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        }
    }

    /// Checks the settings: `temperature` 0 or positive, finite, with a finite reciprocal;
    /// `0 < top_p <= 1`.
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        if !(t.is_finite() && (t == 0.0 || (t > 0.0 && (1.0 / t).is_finite()))) {
            return Err(NnError::Config(format!(
                "sampling: temperature {} (must be 0, greedy, or positive and finite with a \
                 finite reciprocal)",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(NnError::Config(format!(
                "sampling: top_p {} (must be in (0, 1]; 1 is off)",
                self.top_p
            )));
        }
        Ok(())
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

/// Device buffers for `rows` rows of sampling settings (all greedy at first).
pub struct Sampler {
    rows: usize,
    vocab: usize,
    temperature: DeviceBuffer<f32>,
    top_k: DeviceBuffer<u32>,
    top_p: DeviceBuffer<f32>,
    best: DeviceBuffer<u64>,
    done: DeviceBuffer<u32>,
    k: Arc<SamplingKernels>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sampler({} rows, vocabulary {})", self.rows, self.vocab)
    }
}

impl Sampler {
    /// A sampler for up to `rows` rows of `vocab` logits, every row greedy (eager `q`).
    pub fn new(q: &dyn Queue, rows: usize, vocab: usize) -> Result<Sampler> {
        if rows == 0 || vocab == 0 {
            return Err(NnError::Shape(format!(
                "sampler: {rows} rows of {vocab} tokens (both must be positive)"
            )));
        }
        crate::kernels::int_loop(
            "sampler vocabulary",
            vocab,
            crate::kernels::sampling::SAMPLE_THREADS,
        )?;
        crate::kernels::int("sampler rows", rows)?;
        let k = SamplingKernels::get(q.device())?;
        let temperature = q.alloc_zeroed::<f32>(rows)?;
        let top_k = q.alloc_zeroed::<u32>(rows)?;
        let top_p = q.alloc::<f32>(rows)?;
        q.fill32(&top_p, 0, rows, 1.0f32)?;
        let best = q.alloc_zeroed::<u64>(rows)?;
        let done = q.alloc_zeroed::<u32>(rows)?;
        Ok(Sampler {
            rows,
            vocab,
            temperature,
            top_k,
            top_p,
            best,
            done,
            k,
        })
    }

    /// Rows the sampler holds settings for.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Logits per row.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    fn args(&self) -> SampleArgs<'_> {
        SampleArgs {
            temperature: &self.temperature,
            top_k: &self.top_k,
            top_p: &self.top_p,
            best: &self.best,
            done: &self.done,
        }
    }

    /// Sets row `row`'s settings (validated, see [`SamplingParams::validate`]); stream-ordered
    /// with the steps on `s`.
    pub fn set(&self, s: &Stream, row: usize, p: &SamplingParams) -> Result<()> {
        p.validate()?;
        self.k
            .set(s, &self.args(), row, p.temperature, p.top_k, p.top_p)
    }

    /// The settings on the device: temperatures, top-k and top-p, one per row.
    pub fn params(&self) -> (&DeviceBuffer<f32>, &DeviceBuffer<u32>, &DeviceBuffer<f32>) {
        (&self.temperature, &self.top_k, &self.top_p)
    }

    /// `logits` `[rows, vocab]` f32 (`rows` at most the sampler's) → `tokens[rows]`. Draws one
    /// Philox counter per row from `gen` and advances its device offset like dropout does, so
    /// each replay of a captured call draws fresh numbers. Capturable. Calls on one sampler
    /// must be stream-ordered (not concurrent on two streams): a greedy row's split argmax
    /// uses per-row scratch of the sampler.
    pub fn sample(
        &self,
        q: &dyn Queue,
        logits: &DeviceBuffer<f32>,
        rows: usize,
        gen: &Generator,
        tokens: &DeviceBuffer<i32>,
    ) -> Result<()> {
        if rows > self.rows {
            return Err(NnError::Shape(format!(
                "sample: {rows} rows, the sampler holds {}",
                self.rows
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        let cells = rows
            .checked_mul(self.vocab)
            .ok_or_else(|| NnError::Shape("sample: too many logits".into()))?;
        crate::extent::need("sample logits", logits, cells)?;
        crate::extent::need("sampled tokens", tokens, rows)?;
        let offset = gen.reserve(rows * 4)?;
        self.k.sample(
            q,
            logits,
            rows,
            self.vocab,
            &self.args(),
            gen.state(),
            offset,
            tokens,
        )?;
        gen.drew(q)
    }
}

/// Stop conditions and the next step's inputs, on the device, for `rows` rows of up to
/// `max_new` generated tokens each. Every row starts finished (empty).
pub struct DecodeState {
    rows: usize,
    max_new: usize,
    positions: DeviceBuffer<i32>,
    finished: DeviceBuffer<i32>,
    generated: DeviceBuffer<i32>,
    limit: DeviceBuffer<i32>,
    history: DeviceBuffer<i32>,
    eos: DeviceBuffer<i32>,
    n_eos: usize,
    live: DeviceBuffer<u32>,
    k: Arc<SamplingKernels>,
}

impl std::fmt::Debug for DecodeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DecodeState({} rows, up to {} new tokens, {} eos ids)",
            self.rows, self.max_new, self.n_eos
        )
    }
}

impl DecodeState {
    /// State for `rows` rows of up to `max_new` new tokens, stopping at any of `eos` (at most
    /// [`MAX_EOS`] ids) (eager `q`).
    pub fn new(q: &dyn Queue, rows: usize, max_new: usize, eos: &[i32]) -> Result<DecodeState> {
        if rows == 0 || max_new == 0 {
            return Err(NnError::Shape(format!(
                "decode state: {rows} rows of {max_new} new tokens (both must be positive)"
            )));
        }
        if eos.len() > MAX_EOS {
            return Err(NnError::Config(format!(
                "decode state: {} end-of-sequence ids, at most {MAX_EOS}",
                eos.len()
            )));
        }
        crate::kernels::int("decode rows", rows)?;
        crate::kernels::int_loop("decode new tokens", max_new, 256)?;
        let cells = rows
            .checked_mul(max_new)
            .ok_or_else(|| NnError::Shape("decode state: history too large".into()))?;
        let k = SamplingKernels::get(q.device())?;
        let positions = q.alloc_zeroed::<i32>(rows)?;
        let finished = q.alloc::<i32>(rows)?;
        q.fill32(&finished, 0, rows, 1i32)?;
        let generated = q.alloc_zeroed::<i32>(rows)?;
        let limit = q.alloc_zeroed::<i32>(rows)?;
        let history = q.alloc::<i32>(cells)?;
        q.fill32(&history, 0, cells, -1i32)?;
        let eos_buf = q.alloc_zeroed::<i32>(MAX_EOS)?;
        for (i, &e) in eos.iter().enumerate() {
            q.fill32(&eos_buf, i, 1, e)?;
        }
        Ok(DecodeState {
            rows,
            max_new,
            positions,
            finished,
            generated,
            limit,
            history,
            eos: eos_buf,
            n_eos: eos.len(),
            live: q.alloc_zeroed::<u32>(1)?,
            k,
        })
    }

    fn args(&self) -> DecodeArgs<'_> {
        DecodeArgs {
            positions: &self.positions,
            finished: &self.finished,
            generated: &self.generated,
            limit: &self.limit,
            history: &self.history,
            max_new: self.max_new,
            eos: &self.eos,
            n_eos: self.n_eos,
            live: &self.live,
        }
    }

    /// Rows of the state.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Most new tokens per row (the history's row length).
    pub fn max_new(&self) -> usize {
        self.max_new
    }

    /// A sequence joins row `row` between steps: its next position (the first generated
    /// token's), up to `max_new` new tokens (`1..=` the state's `max_new`); its history is
    /// cleared to -1.
    pub fn start_row(
        &self,
        s: &Stream,
        row: usize,
        next_position: i32,
        max_new: i32,
    ) -> Result<()> {
        if max_new < 1 || max_new as usize > self.max_new {
            return Err(NnError::Shape(format!(
                "decode start: {max_new} new tokens, the state holds 1 to {}",
                self.max_new
            )));
        }
        if next_position < 0 {
            return Err(NnError::Shape(format!(
                "decode start: position {next_position} is negative"
            )));
        }
        self.k
            .start(s, &self.args(), self.rows, row, next_position, max_new)
    }

    /// A sequence leaves row `row` (finished = 1).
    pub fn stop_row(&self, s: &Stream, row: usize) -> Result<()> {
        self.k.stop(s, &self.args(), self.rows, row)
    }

    /// After sampling: for each unfinished row `r < rows`, records `tokens[r]` in the history,
    /// copies it into `ids[r]` (the next step's input), writes `positions[r]` into `pos_out[r]`
    /// (the next step's position) and advances the position and the count; marks the row
    /// finished when the token is an eos id or the count reaches the row's limit. A finished
    /// row keeps its ids and positions (its step is wasted work) and its history. Then sets
    /// [`DecodeState::live`] to whether any row `r < rows` is still unfinished (not for
    /// `rows == 0`, which does nothing). Capturable.
    pub fn advance(
        &self,
        q: &dyn Queue,
        tokens: &DeviceBuffer<i32>,
        rows: usize,
        ids: &DeviceBuffer<i32>,
        pos_out: &DeviceBuffer<i32>,
    ) -> Result<()> {
        if rows > self.rows {
            return Err(NnError::Shape(format!(
                "decode advance: {rows} rows, the state holds {}",
                self.rows
            )));
        }
        self.k.advance(q, &self.args(), tokens, rows, ids, pos_out)
    }

    /// Next position of each row.
    pub fn positions(&self) -> &DeviceBuffer<i32> {
        &self.positions
    }

    /// One `u32`: 1 if a row of the last [`DecodeState::advance`] was unfinished after it,
    /// else 0 — the condition of a WHILE node that runs decode steps until every row has ended
    /// ([`cudagraph::CaptureStream::while_loop_capped`]). 0 before the first advance.
    pub fn live(&self) -> &DeviceBuffer<u32> {
        &self.live
    }

    /// 1 where the row is finished (or empty), else 0.
    pub fn finished(&self) -> &DeviceBuffer<i32> {
        &self.finished
    }

    /// `[rows, max_new]` generated tokens, -1 past each row's count.
    pub fn history(&self) -> &DeviceBuffer<i32> {
        &self.history
    }

    /// Tokens generated by each row.
    pub fn generated(&self) -> &DeviceBuffer<i32> {
        &self.generated
    }

    /// Host copies of `(finished, generated, history)` (waits for `s`).
    pub fn read(&self, s: &Stream) -> Result<(Vec<i32>, Vec<i32>, Vec<i32>)> {
        Ok((
            s.to_vec(&self.finished)?,
            s.to_vec(&self.generated)?,
            s.to_vec(&self.history)?,
        ))
    }
}

/// What the sampling kernel computes, on the CPU, bit for bit.
pub mod reference {
    use super::SamplingParams;

    /// The order key of a value that is not NaN (`-0` counts as `+0`): unsigned order is float
    /// order.
    pub fn key(z: f32) -> u32 {
        let b = (if z == 0.0 { 0.0f32 } else { z }).to_bits();
        if b & 0x8000_0000 != 0 {
            !b
        } else {
            b | 0x8000_0000
        }
    }

    /// The value of an order key.
    pub fn unkey(k: u32) -> f32 {
        f32::from_bits(if k & 0x8000_0000 != 0 {
            k & 0x7fff_ffff
        } else {
            !k
        })
    }

    /// `exp(z - m)` in units of 2^-32 as the kernel computes it (`z <= m`, neither NaN; with
    /// `m = +inf` the `+inf` values weigh 2^32 and the rest 0).
    pub fn weight(z: f32, m: f32) -> u64 {
        let e = if m == f32::INFINITY {
            if z == m {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        } else {
            z - m
        };
        let t = e * f32::from_bits(0x3fb8_aa3b);
        if t.is_nan() || t < -32.0 {
            return 0;
        }
        let n = t.floor();
        let f = t - n;
        let mut p = f32::from_bits(0x377f_e5fe);
        for c in [
            0x3921_8489u32,
            0x3aae_c3ff,
            0x3c1d_955b,
            0x3d63_5847,
            0x3e75_fdf0,
            0x3f31_7218,
        ] {
            p = p.mul_add(f, f32::from_bits(c));
        }
        p = p.mul_add(f, 1.0);
        let mant = ((p * 8_388_608.0) as u32).min(0xff_ffff) as u64;
        let sh = n as i32 + 9;
        if sh >= 0 {
            mant << sh
        } else {
            mant >> -sh
        }
    }

    /// The 64-bit number row `row` draws: lanes x (high) and y (low) of Philox counter
    /// `base + offset + row` under `seed`.
    pub fn row_bits(seed: u64, base: u64, offset: u64, row: usize) -> u64 {
        let g = crate::random::reference::group(seed, base + offset + row as u64);
        ((g[0] as u64) << 32) | g[1] as u64
    }

    /// The values a row's settings keep, in (value descending, id ascending) order, with their
    /// weights, and the maximum: `None` when no value is above `-inf`. Greedy rows keep the
    /// argmax alone.
    pub fn kept(logits: &[f32], p: &SamplingParams) -> Option<Vec<(usize, u64)>> {
        // The reciprocal of the temperature (0: greedy), as the kernel multiplies by it.
        let t = if p.temperature > 0.0 {
            1.0 / p.temperature
        } else {
            0.0
        };
        let z: Vec<f32> = logits
            .iter()
            .map(|&x| if t > 0.0 { x * t } else { x })
            .collect();
        let mut order: Vec<usize> = (0..z.len()).filter(|&i| !z[i].is_nan()).collect();
        order.sort_by(|&a, &b| key(z[b]).cmp(&key(z[a])).then(a.cmp(&b)));
        let first = *order.first()?;
        if key(z[first]) <= key(f32::NEG_INFINITY) {
            return None;
        }
        if t == 0.0 {
            return Some(vec![(first, 1)]);
        }
        let m = unkey(key(z[first]));
        if p.top_k > 0 && (p.top_k as usize) < order.len() {
            order.truncate(p.top_k as usize);
        }
        let mut kept: Vec<(usize, u64)> = order.iter().map(|&i| (i, weight(z[i], m))).collect();
        if p.top_p < 1.0 {
            let total: u64 = kept.iter().map(|k| k.1).sum();
            let target = p.top_p as f64 * total as f64;
            let mut before = 0u64;
            let mut n = 0;
            for &(_, w) in &kept {
                if (before as f64) < target {
                    n += 1;
                    before += w;
                } else {
                    break;
                }
            }
            kept.truncate(n);
        }
        Some(kept)
    }

    /// The token the kernel picks for one row given the row's 64-bit number `bits`
    /// ([`row_bits`]); `None` for a row with no value above `-inf` (the kernel writes 0 and
    /// reports it).
    pub fn sample_row(logits: &[f32], p: &SamplingParams, bits: u64) -> Option<i32> {
        let mut kept = kept(logits, p)?;
        if p.temperature <= 0.0 {
            return Some(kept[0].0 as i32);
        }
        kept.sort_by_key(|k| k.0);
        let total: u64 = kept.iter().map(|k| k.1).sum();
        let target = ((bits as u128 * total as u128) >> 64) as u64;
        let mut c = 0u64;
        for &(i, w) in &kept {
            c += w;
            if c > target {
                return Some(i as i32);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::reference::*;
    use super::SamplingParams;

    fn params(temperature: f32, top_k: u32, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
        }
    }

    #[test]
    fn keys_follow_float_order() {
        let v = [
            f32::NEG_INFINITY,
            -3.4e38,
            -1.0,
            -1e-40,
            0.0,
            1e-40,
            1.0,
            3.4e38,
            f32::INFINITY,
        ];
        for w in v.windows(2) {
            assert!(key(w[0]) < key(w[1]), "{} {}", w[0], w[1]);
        }
        assert_eq!(key(-0.0), key(0.0));
        for x in v {
            assert_eq!(unkey(key(x)), x);
        }
    }

    #[test]
    fn weights_are_exp_in_fixed_point_and_monotone() {
        assert_eq!(weight(1.5, 1.5), 1 << 32);
        assert_eq!(weight(f32::NEG_INFINITY, 0.0), 0);
        assert_eq!(weight(-40.0, 0.0), 0);
        assert_eq!(weight(f32::INFINITY, f32::INFINITY), 1 << 32);
        assert_eq!(weight(1e30, f32::INFINITY), 0);
        let mut last = 0u64;
        let mut z = -22.0f32;
        while z <= 0.0 {
            let w = weight(z, 0.0);
            assert!(w >= last, "{z}");
            last = w;
            let want = (z as f64).exp() * 4_294_967_296.0;
            assert!(
                (w as f64 - want).abs() < 2e-6 * want + 1.0,
                "{z}: {w} vs {want}"
            );
            z += 0.001;
        }
    }

    #[test]
    fn validation_refuses_bad_settings() {
        assert!(params(0.0, 0, 1.0).validate().is_ok());
        assert!(params(0.7, 50, 0.9).validate().is_ok());
        for p in [
            params(-1.0, 0, 1.0),
            params(f32::NAN, 0, 1.0),
            params(f32::INFINITY, 0, 1.0),
            params(1e-45, 0, 1.0),
            params(1.0, 0, 0.0),
            params(1.0, 0, 1.5),
            params(1.0, 0, f32::NAN),
        ] {
            assert!(
                matches!(p.validate(), Err(crate::NnError::Config(_))),
                "{p:?}"
            );
        }
    }

    #[test]
    fn greedy_takes_the_lowest_id_among_ties_and_skips_nan() {
        let g = SamplingParams::greedy();
        assert_eq!(sample_row(&[1.0, 3.0, 3.0, 2.0], &g, 0), Some(1));
        assert_eq!(sample_row(&[f32::NAN, 0.5, f32::NAN], &g, 0), Some(1));
        assert_eq!(sample_row(&[f32::NAN, f32::NEG_INFINITY], &g, 0), None);
        assert_eq!(sample_row(&[-0.0, 0.0], &g, 0), Some(0));
    }

    #[test]
    fn top_k_and_top_p_keep_the_documented_sets() {
        let l = [0.0f32, 5.0, 3.0, 4.0, 3.0, 1.0];
        let ids = |p| -> Vec<usize> { kept(&l, &p).unwrap().iter().map(|k| k.0).collect() };
        assert_eq!(ids(params(1.0, 3, 1.0)), vec![1, 3, 2]);
        assert_eq!(ids(params(1.0, 4, 1.0)), vec![1, 3, 2, 4]);
        // Softmax of [5, 4, 3, 3, 1, 0]: 0.63, 0.23, 0.086, 0.086, ...: top_p 0.5 keeps the
        // first, 0.7 the first two, 0.9 three (0.63 + 0.23 = 0.86 < 0.9).
        assert_eq!(ids(params(1.0, 0, 0.5)), vec![1]);
        assert_eq!(ids(params(1.0, 0, 0.7)), vec![1, 3]);
        assert_eq!(ids(params(1.0, 0, 0.9)), vec![1, 3, 2]);
        assert_eq!(ids(params(1.0, 2, 0.99)), vec![1, 3]);
        // A tiny top_p still keeps one token.
        assert_eq!(ids(params(1.0, 0, 1e-9)), vec![1]);
        // +inf values share everything.
        let inf = [1.0, f32::INFINITY, 2.0, f32::INFINITY];
        let k = kept(&inf, &params(1.0, 0, 1.0)).unwrap();
        assert_eq!(k.iter().filter(|x| x.1 > 0).count(), 2);
        for bits in [0u64, u64::MAX / 3, u64::MAX] {
            let t = sample_row(&inf, &params(1.0, 0, 1.0), bits).unwrap();
            assert!(t == 1 || t == 3);
        }
    }

    /// Hugging Face's processors in f64: temperature, top-k (sort), top-p (ascending
    /// cumulative softmax, remove while <= 1 - top_p, keep the largest); the kept ids, and how
    /// close the top-p cut came to flipping (distance of the deciding cumulative mass from
    /// 1 - top_p).
    fn hf_kept(logits: &[f32], p: &SamplingParams) -> (Vec<usize>, f64) {
        let z: Vec<f64> = logits
            .iter()
            .map(|&x| x as f64 / p.temperature as f64)
            .collect();
        let mut order: Vec<usize> = (0..z.len()).collect();
        order.sort_by(|&a, &b| z[b].partial_cmp(&z[a]).unwrap());
        if p.top_k > 0 {
            order.truncate(p.top_k as usize);
        }
        let mut margin = f64::INFINITY;
        if p.top_p < 1.0 {
            let m = z[order[0]];
            let e: Vec<f64> = order.iter().map(|&i| (z[i] - m).exp()).collect();
            let total: f64 = e.iter().sum();
            let mut asc = 0.0;
            let mut keep = order.len();
            for j in (0..order.len()).rev() {
                asc += e[j] / total;
                margin = margin.min((asc - (1.0 - p.top_p as f64)).abs());
                if asc <= 1.0 - p.top_p as f64 && j > 0 {
                    keep = j;
                }
            }
            order.truncate(keep);
        }
        (order, margin)
    }

    #[test]
    fn kept_sets_match_hugging_face_semantics() {
        let mut rng = crate::random::HostRng::new(12);
        let mut checked = 0;
        for case in 0..600 {
            let vocab = 1 + case % 300;
            // Distinct values 1/16 apart, shuffled: no ties, nothing that rounding could reorder.
            let mut l: Vec<f32> = (0..vocab).map(|i| i as f32 / 16.0 - 6.0).collect();
            for i in (1..vocab).rev() {
                l.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            let p = params(
                [0.3f32, 0.8, 1.0, 2.5][case % 4],
                [0u32, 1, 7, 40][(case / 4) % 4],
                [1.0f32, 0.95, 0.6, 0.2][(case / 16) % 4],
            );
            let (want, margin) = hf_kept(&l, &p);
            if margin < 1e-4 {
                continue; // the cut is too close to call in f64 versus fixed point
            }
            let got: Vec<usize> = kept(&l, &p).unwrap().iter().map(|k| k.0).collect();
            assert_eq!(got, want, "case {case}: {p:?}");
            checked += 1;
        }
        assert!(checked > 500, "{checked}");
    }

    /// The kernel's algorithm step by step on the CPU (radix select over 8-bit digits, tie cuts
    /// by id, the draw narrowed over runs of 32-id strips), to check it against the sort-based
    /// reference.
    fn kernel_emulation(logits: &[f32], p: &SamplingParams, bits: u64) -> Option<i32> {
        const NONE: usize = usize::MAX;
        let v = logits.len();
        let t = if p.temperature > 0.0 {
            1.0 / p.temperature
        } else {
            0.0
        };
        let z = |i: usize| if t > 0.0 { logits[i] * t } else { logits[i] };
        let (mut bk, mut bi, mut nv) = (0u32, NONE, 0u64);
        for i in 0..v {
            if z(i).is_nan() {
                continue;
            }
            nv += 1;
            if key(z(i)) > bk {
                bk = key(z(i));
                bi = i;
            }
        }
        if bk <= key(f32::NEG_INFINITY) {
            return None;
        }
        if t == 0.0 {
            return Some(bi as i32);
        }
        let m = unkey(bk);
        let cand = |i: usize, kk: u32, ik: usize| {
            let zi = z(i);
            !zi.is_nan() && (key(zi) > kk || (key(zi) == kk && i <= ik))
        };
        // Largest K with Q(key >= K) reaching the target; (K, Q(> K), Q(== K)).
        let select = |mass: bool, count: u64, kk: u32, ik: usize| {
            let (mut prefix, mut above, mut eq) = (0u32, 0u64, 0u64);
            let mut target = 0.0f64;
            for level in 0..4 {
                let shift = 24 - 8 * level;
                let mut bins = [0u64; 256];
                for i in 0..v {
                    if !cand(i, kk, ik) {
                        continue;
                    }
                    let k = key(z(i));
                    if level > 0 && (k >> (shift + 8)) != (prefix >> (shift + 8)) {
                        continue;
                    }
                    bins[((k >> shift) & 255) as usize] += if mass { weight(z(i), m) } else { 1 };
                }
                if mass && level == 0 {
                    target = p.top_p as f64 * bins.iter().sum::<u64>() as f64;
                }
                let mut c = above;
                for b in (0..256).rev() {
                    let h = if mass {
                        (c + bins[b]) as f64 >= target
                    } else {
                        c + bins[b] >= count
                    };
                    if h {
                        prefix |= (b as u32) << shift;
                        above = c;
                        eq = bins[b];
                        break;
                    }
                    c += bins[b];
                }
            }
            (prefix, above, eq, target)
        };
        let tie_cut = |key_at: u32, kk: u32, ik: usize, r: u64| {
            let mut c = 0;
            (0..v)
                .find(|&i| {
                    if cand(i, kk, ik) && key(z(i)) == key_at {
                        c += 1;
                    }
                    c == r
                })
                .unwrap()
        };
        let (mut kk, mut ik) = (0u32, NONE);
        let k = p.top_k as u64;
        if k > 0 && k < nv {
            let (kx, above, eq, _) = select(false, k, 0, NONE);
            kk = kx;
            if k - above < eq {
                ik = tie_cut(kk, 0, NONE, k - above);
            }
        }
        let (mut kp, mut ip) = (0u32, NONE);
        if p.top_p < 1.0 {
            let (kx, above, eq_mass, pm) = select(true, 0, kk, ik);
            kp = kx;
            let w = weight(unkey(kp), m);
            let n_eq = eq_mass.checked_div(w).unwrap_or(1);
            let (mut lo, mut hi) = (1u64, n_eq);
            while lo < hi {
                let mid = lo + (hi - lo).div_ceil(2);
                if ((above + (mid - 1) * w) as f64) < pm {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            if lo < n_eq {
                ip = tie_cut(kp, kk, ik, lo);
            }
        }
        let kept = |i: usize| cand(i, kk, ik) && cand(i, kp, ip);
        // The draw as the kernel narrows it: runs of strips of 32 ids over 32 warps, then one
        // strip's inclusive scan.
        let w_of = |i: usize| {
            if i < v && kept(i) {
                weight(z(i), m)
            } else {
                0
            }
        };
        let strip_sum = |j: usize| (0..32).map(|l| w_of(j * 32 + l)).sum::<u64>();
        let (mut s0, mut s1) = (0usize, v.div_ceil(32));
        let (mut above, mut target) = (0u64, 0u64);
        let mut first = true;
        loop {
            let per = (s1 - s0).div_ceil(32);
            let sums: Vec<u64> = (0..32)
                .map(|w| {
                    let a = (s0 + w * per).min(s1);
                    (a..(a + per).min(s1)).map(strip_sum).sum()
                })
                .collect();
            let all: u64 = sums.iter().sum();
            let base = if first { 0 } else { above };
            if first {
                target = ((bits as u128 * all as u128) >> 64) as u64;
            }
            let mut inc = 0u64;
            let f = sums
                .iter()
                .position(|&w| {
                    inc += w;
                    target - base < inc
                })
                .expect("the target lies in the range");
            above = base + inc - sums[f];
            s0 += f * per;
            s1 = s1.min(s0 + per);
            first = false;
            if per <= 1 {
                break;
            }
        }
        let mut inc = 0u64;
        for l in 0..32 {
            inc += w_of(s0 * 32 + l);
            if target - above < inc {
                return Some((s0 * 32 + l) as i32);
            }
        }
        unreachable!("the draw found no token")
    }

    #[test]
    fn the_kernels_algorithm_picks_the_reference_tokens() {
        let mut rng = crate::random::HostRng::new(77);
        let settings = [
            SamplingParams::greedy(),
            params(0.7, 0, 1.0),
            params(1.0, 5, 1.0),
            params(1.3, 0, 0.9),
            params(0.9, 50, 0.8),
            params(2.0, 1, 1.0),
            params(1.0, 3, 0.5),
            params(0.5, 0, 0.3),
            params(1.0, 200, 0.97),
        ];
        for case in 0..400 {
            let vocab = 1 + (rng.next_u64() % 3000) as usize;
            // Coarse steps make long runs of equal values (thresholds inside ties).
            let step = [1.0 / 64.0, 0.5, 2.0][case % 3];
            let l: Vec<f32> = (0..vocab)
                .map(|i| {
                    if case % 5 == 4 && i % 13 == 3 {
                        f32::NAN
                    } else if case % 7 == 6 && i % 11 == 5 {
                        f32::NEG_INFINITY
                    } else {
                        (rng.symmetric(8.0) / step).floor() * step
                    }
                })
                .collect();
            let p = settings[case % settings.len()];
            for _ in 0..3 {
                let bits = rng.next_u64();
                assert_eq!(
                    kernel_emulation(&l, &p, bits),
                    sample_row(&l, &p, bits),
                    "case {case}, vocab {vocab}, {p:?}"
                );
            }
        }
    }

    #[test]
    fn the_draw_over_long_rows_picks_the_reference_tokens() {
        // Vocabularies of more than 32 · 32 strips: three levels of runs before the last strip.
        let mut rng = crate::random::HostRng::new(91);
        for (case, vocab) in [33 * 1024 + 5, 50_257].into_iter().enumerate() {
            let l: Vec<f32> = (0..vocab)
                .map(|_| (rng.symmetric(8.0) * 64.0).floor() / 64.0)
                .collect();
            for p in [
                params(1.0, 0, 1.0),
                params(0.6, 0, 0.9),
                params(1.1, 40, 1.0),
            ] {
                for bits in [0u64, u64::MAX, rng.next_u64(), rng.next_u64()] {
                    assert_eq!(
                        kernel_emulation(&l, &p, bits),
                        sample_row(&l, &p, bits),
                        "case {case}, vocab {vocab}, {p:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_greedy_split_stays_within_its_bounds() {
        use crate::kernels::sampling::{greedy_split, GREEDY_MAX_SPLIT};
        assert_eq!(greedy_split(1, 1), 1);
        assert_eq!(greedy_split(1, 50_257), 13);
        assert_eq!(greedy_split(32, 50_257), 8);
        assert_eq!(greedy_split(64, 50_257), 4);
        assert_eq!(greedy_split(1, 128_256), GREEDY_MAX_SPLIT);
        assert_eq!(greedy_split(1000, 128_256), 1);
        for rows in [1usize, 3, 100, 300, 1 << 20] {
            for vocab in [1usize, 1000, 8192, 8193, 1 << 20] {
                let s = greedy_split(rows, vocab);
                assert!((1..=GREEDY_MAX_SPLIT).contains(&s), "{rows} {vocab}");
                assert!(s == 1 || rows * s <= 264, "{rows} {vocab}");
            }
        }
    }

    #[test]
    fn draws_follow_the_softmax() {
        // 200k draws with evenly spread 64-bit numbers: the frequencies equal the softmax to
        // within the fixed-point and spacing error.
        let l = [0.3f32, -1.0, 2.0, 0.0, 1.1];
        let p = params(0.8, 0, 1.0);
        let n = 200_000u64;
        let mut counts = [0u64; 5];
        for j in 0..n {
            let bits = (((j as u128) << 64) / n as u128) as u64;
            counts[sample_row(&l, &p, bits).unwrap() as usize] += 1;
        }
        let e: Vec<f64> = l.iter().map(|&x| (x as f64 / 0.8).exp()).collect();
        let s: f64 = e.iter().sum();
        for i in 0..5 {
            let want = e[i] / s;
            assert!(
                (counts[i] as f64 / n as f64 - want).abs() < 2e-5,
                "{i}: {counts:?}"
            );
        }
    }
}
