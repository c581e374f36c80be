//! Random numbers: on the device, [`Generator`], a Philox generator that stays random inside
//! CUDA graphs (its kernels are `kernels::philox`); on the host, [`HostRng`], which initialises
//! weights and makes synthetic data. Below autograd: dropout and `rand`/`randn` draw from a
//! `Generator`.
//!
//! A [`Generator`] is a counter-based Philox4x32-10 generator whose seed and base counter live
//! in device memory (two `u64`s it owns). An op that draws numbers reserves a range of
//! counters when it is issued — at capture time for a graph — and its kernel uses
//! `base + offset + i`, reading the base from device memory when it runs. [`Generator::advance`]
//! adds the counters reserved since the last advance to the base *on the device* (a one-thread
//! kernel, a graph node when captured).
//!
//! **Randomness advances by itself.** Every draw registers an advance for the end of its queue
//! ([`cudagraph::Queue::at_end`]): eagerly that is right after the draw, so each eager call
//! draws fresh numbers and leaves nothing pending; inside a capture it is the end of the
//! capture (or of the conditional body the draw is in), so the graph ends with an advance node
//! and each replay draws fresh numbers — replay k draws what the k-th eager call of the same
//! work with the same seed draws. An explicit `advance` inside the capture (a k-steps-per-launch
//! loop body, `Sequential`'s forward pass) leaves nothing pending, and then no node is added.
//!
//! **Eager draws and replays interleave freely** on one stream: every draw, eager or replayed,
//! starts at the base the previous one left and moves it past what it drew, in stream order, so
//! no two draws share counters. Use one generator per stream of work: two streams drawing from
//! one generator at once would read the same base.
//!
//! [`philox4x32_10`] and [`reference`](mod@reference) are the CPU reference the GPU tests compare against.

use std::sync::{Arc, Mutex};

use cudagraph::{DeviceBuffer, Queue, Stream};

use crate::error::{NnError, Result};
use crate::kernels::philox::PhiloxKernels;

mod host;

pub use host::HostRng;

struct Inner {
    /// `[seed, base]`.
    state: DeviceBuffer<u64>,
    /// Counters reserved since the last advance.
    pending: Mutex<u64>,
}

/// A Philox generator with its state on the device (PyTorch's `torch.Generator(device="cuda")`,
/// graph-safe). Cheap to clone; clones share the state.
#[derive(Clone)]
pub struct Generator(Arc<Inner>);

impl std::fmt::Debug for Generator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Generator(pending {})", self.pending())
    }
}

impl Generator {
    /// A generator seeded with `seed`, base counter 0.
    pub fn new(s: &Stream, seed: u64) -> Result<Self> {
        Ok(Generator(Arc::new(Inner {
            state: s.alloc_from_host(&[seed, 0u64])?,
            pending: Mutex::new(0),
        })))
    }

    /// Resets the seed and the base counter (PyTorch's `manual_seed`); every graph that draws
    /// from this generator follows on its next replay.
    pub fn manual_seed(&self, s: &Stream, seed: u64) -> Result<()> {
        s.copy_from_host(&[seed, 0u64], &self.0.state)?;
        *self.lock() = 0;
        Ok(())
    }

    /// Reads `(seed, base)` back (waits for the stream).
    pub fn seed_and_base(&self, s: &Stream) -> Result<(u64, u64)> {
        let v = s.to_vec(&self.0.state)?;
        Ok((v[0], v[1]))
    }

    /// The device state `[seed, base]`, for kernels of your own.
    pub fn state(&self) -> &DeviceBuffer<u64> {
        &self.0.state
    }

    /// Counters reserved since the last [`Self::advance`].
    pub fn pending(&self) -> u64 {
        *self.lock()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, u64> {
        self.0.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserves the counters for `numbers` random 32-bit numbers (one counter gives four) and
    /// returns the offset of the first from the base.
    pub fn reserve(&self, numbers: usize) -> Result<u64> {
        let groups = numbers.div_ceil(4) as u64;
        let mut p = self.lock();
        let offset = *p;
        *p = offset.checked_add(groups).ok_or_else(|| {
            NnError::Shape("generator: more counters reserved than a u64 holds".into())
        })?;
        Ok(offset)
    }

    /// Registers, after a kernel that draws counters reserved with [`Self::reserve`] was
    /// enqueued on `q`, the advance past them: now when eager, at the end of the capture (or
    /// conditional body) otherwise (see the module docs). Ops that draw call it for you.
    pub fn drew(&self, q: &dyn Queue) -> Result<()> {
        let g = self.clone();
        let key = Arc::as_ptr(&self.0) as usize;
        q.at_end(key, Box::new(move |q| Ok(g.advance(q)?)))?;
        Ok(())
    }

    /// Moves the base counter past everything reserved since the last advance, on the device
    /// (a graph node when `q` is capturing). Nothing to do when nothing was reserved.
    pub fn advance(&self, q: &dyn Queue) -> Result<()> {
        let mut p = self.lock();
        if *p == 0 {
            return Ok(());
        }
        PhiloxKernels::get(q.device())?.advance(q, &self.0.state, *p)?;
        *p = 0;
        Ok(())
    }

    /// Fills `out` with random 32-bit numbers.
    pub fn fill_bits(&self, q: &dyn Queue, out: &DeviceBuffer<u32>) -> Result<()> {
        let k = PhiloxKernels::get(q.device())?;
        let offset = self.reserve(out.len())?;
        k.bits(q, &self.0.state, offset, out, out.len())?;
        self.drew(q)
    }

    /// Fills `out` uniformly from `[low, high)` (PyTorch's `uniform_`).
    pub fn fill_uniform(
        &self,
        q: &dyn Queue,
        out: &DeviceBuffer<f32>,
        low: f32,
        high: f32,
    ) -> Result<()> {
        if !(low.is_finite() && high.is_finite() && low <= high) {
            return Err(NnError::Shape(format!(
                "uniform: [{low}, {high}) is not a finite interval"
            )));
        }
        let k = PhiloxKernels::get(q.device())?;
        let offset = self.reserve(out.len())?;
        k.uniform(q, &self.0.state, offset, out, out.len(), low, high - low)?;
        self.drew(q)
    }

    /// Fills `out` from the normal distribution `N(mean, std²)` (PyTorch's `normal_`).
    pub fn fill_normal(
        &self,
        q: &dyn Queue,
        out: &DeviceBuffer<f32>,
        mean: f32,
        std: f32,
    ) -> Result<()> {
        if !(mean.is_finite() && std.is_finite() && std >= 0.0) {
            return Err(NnError::Shape(format!(
                "normal: mean {mean}, std {std} (std must be finite and non-negative)"
            )));
        }
        let k = PhiloxKernels::get(q.device())?;
        let offset = self.reserve(out.len())?;
        k.normal(q, &self.0.state, offset, out, out.len(), mean, std)?;
        self.drew(q)
    }
}

/// The kernel parameters of dropout with probability `p` (in `[0, 1]`): the 24-bit threshold
/// below which an element is dropped, and the scale of kept elements.
pub fn dropout_params(p: f32) -> (u32, f32) {
    let threshold = (p as f64 * 16_777_216.0).round() as u32;
    let scale = if p >= 1.0 { 0.0 } else { 1.0 / (1.0 - p) };
    (threshold, scale)
}

/// Philox4x32-10 on the CPU: the reference the device kernel must match bit for bit
/// (Salmon et al., SC 2011, with the Random123 constants).
pub fn philox4x32_10(mut c: [u32; 4], mut k: [u32; 2]) -> [u32; 4] {
    for r in 0..10 {
        if r > 0 {
            k[0] = k[0].wrapping_add(0x9E37_79B9);
            k[1] = k[1].wrapping_add(0xBB67_AE85);
        }
        let p0 = 0xD251_1F53u64 * c[0] as u64;
        let p1 = 0xCD9E_8D57u64 * c[2] as u64;
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// What a generator's kernels compute, on the CPU.
pub mod reference {
    use super::philox4x32_10;

    /// The four numbers of counter `idx` under `seed`.
    pub fn group(seed: u64, idx: u64) -> [u32; 4] {
        philox4x32_10(
            [idx as u32, (idx >> 32) as u32, 0, 0],
            [seed as u32, (seed >> 32) as u32],
        )
    }

    /// The first `n` numbers of an op at `offset` from `base`.
    pub fn bits(seed: u64, base: u64, offset: u64, n: usize) -> Vec<u32> {
        (0..n)
            .map(|i| group(seed, base + offset + (i / 4) as u64)[i % 4])
            .collect()
    }

    /// The kernel's uniform numbers (bit-exact: the same f32 fused multiply-add).
    pub fn uniform(seed: u64, base: u64, offset: u64, n: usize, low: f32, high: f32) -> Vec<f32> {
        bits(seed, base, offset, n)
            .into_iter()
            .map(|v| (high - low).mul_add((v >> 8) as f32 * (1.0 / 16_777_216.0), low))
            .collect()
    }

    /// The kernel's standard normal numbers, computed in f64 (the kernel's `logf` and
    /// `sincospif` differ from these by a few ulps).
    pub fn normal(seed: u64, base: u64, offset: u64, n: usize) -> Vec<f64> {
        let b = bits(seed, base, offset, n.div_ceil(4) * 4);
        let mut out = Vec::with_capacity(b.len());
        for pair in b.chunks(2) {
            let u1 = ((pair[0] >> 8) as f64 + 1.0) / 16_777_216.0;
            let u2 = (pair[1] >> 8) as f64 / 16_777_216.0;
            let r = (-2.0 * u1.ln()).sqrt();
            let a = 2.0 * std::f64::consts::PI * u2;
            out.push(r * a.cos());
            out.push(r * a.sin());
        }
        out.truncate(n);
        out
    }

    /// Which elements dropout with probability `p` keeps.
    pub fn dropout_keep(seed: u64, base: u64, offset: u64, n: usize, p: f32) -> Vec<bool> {
        let (threshold, _) = super::dropout_params(p);
        bits(seed, base, offset, n)
            .into_iter()
            .map(|v| (v >> 8) >= threshold)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_matches_the_random123_known_answers() {
        // Random123's kat_vectors, "philox4x32 10": counter, key -> output.
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn reference_streams_follow_the_counter_layout() {
        let b = reference::bits(7, 10, 3, 9);
        assert_eq!(&b[..4], &reference::group(7, 13));
        assert_eq!(&b[4..8], &reference::group(7, 14));
        assert_eq!(b[8], reference::group(7, 15)[0]);
        // Offsets are relative to the base: (base 10, offset 3) = (base 13, offset 0).
        assert_eq!(b, reference::bits(7, 13, 0, 9));
        let u = reference::uniform(1, 0, 0, 1000, -2.0, 3.0);
        assert!(u.iter().all(|&v| (-2.0..3.0).contains(&v)));
        let z = reference::normal(1, 0, 0, 7);
        assert_eq!(z.len(), 7);
        assert!(z.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn dropout_parameters_cover_the_edges() {
        assert_eq!(dropout_params(0.0), (0, 1.0));
        assert_eq!(dropout_params(1.0), (1 << 24, 0.0));
        let (t, s) = dropout_params(0.5);
        assert_eq!(t, 1 << 23);
        assert_eq!(s, 2.0);
        // Keep rate of the reference stream at p = 0.25 over 100k draws: 0.75 ± 0.01.
        let keep = reference::dropout_keep(3, 0, 0, 100_000, 0.25);
        let rate = keep.iter().filter(|&&k| k).count() as f64 / keep.len() as f64;
        assert!((rate - 0.75).abs() < 0.01, "{rate}");
    }
}
