//! Launchers of the random-number and dropout kernels of [`crate::random::Generator`]
//! (Philox4x32-10, `philox.cu`, its own NVRTC module `cudagraph_nn_rng`). Each checks every
//! buffer against the extent its kernel indexes (checked arithmetic), then makes the promise
//! of [`Queue::launch_with`] in one `// SAFETY:` comment. The kernels begin with
//! `CG_PDL_ENTER()`, so they are launched with programmatic dependent launch when it is on
//! (see [`super::pdl`]).

use std::sync::Arc;

use cudagraph::{Arg, Device, DeviceBuffer, Function, LaunchConfig, Queue};

use super::need;
use super::pdl::launch_entered;
use crate::error::{NnError, Result};

/// Philox4x32-10 and the draw of a generator's numbers as device functions (`philox_draw.cu`):
/// the first part of this module's source, and compiled before the sampling kernels, which
/// draw from the same generator.
pub const DRAW: &str = include_str!("philox_draw.cu");

/// The CUDA source of the module.
pub const SOURCE: &str = concat!(include_str!("philox_draw.cu"), include_str!("philox.cu"));

/// Threads per block (a multiple of 32: `dropout_fwd` assembles mask words within warps).
const BLOCK: u32 = 256;

/// The random-number kernels of one device (a [`Device::extension`]).
pub struct PhiloxKernels {
    // The raw Philox kernel is launched only by the tests (known answers).
    #[cfg_attr(not(feature = "internals"), allow(dead_code))]
    philox_raw: Function,
    bits: Function,
    uniform: Function,
    normal: Function,
    dropout_fwd: Function,
    dropout_bwd: Function,
    advance: Function,
}

impl PhiloxKernels {
    /// The kernels of `device`, compiled on first use.
    pub fn get(device: &Device) -> Result<Arc<Self>> {
        Ok(device.extension(|d| {
            // Relaxed capture mode: the first use may be inside a capture (module loading).
            let m = cudagraph::runtime::with_relaxed_capture(|| {
                d.compile(
                    "cudagraph_nn_rng",
                    &super::module_source("cudagraph_nn_rng"),
                )
            })?;
            Ok(PhiloxKernels {
                philox_raw: m.function("philox_raw")?,
                bits: m.function("rng_bits")?,
                uniform: m.function("rng_uniform")?,
                normal: m.function("rng_normal")?,
                dropout_fwd: m.function("dropout_fwd")?,
                dropout_bwd: m.function("dropout_bwd")?,
                advance: m.function("rng_advance")?,
            })
        })?)
    }
}

fn long(v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| NnError::Shape(format!("count {v} exceeds a 64-bit int")))
}

/// One thread per group of four elements.
fn groups(n: usize) -> LaunchConfig {
    LaunchConfig::for_elements(n.div_ceil(4), BLOCK)
}

/// `state` must be a generator state: two words (seed, base).
fn state_ok(state: &DeviceBuffer<u64>) -> Result<()> {
    need("generator state", state, 2)
}

impl PhiloxKernels {
    /// Philox4x32-10 of `n` records (`input`: counter\[4\], key\[2\] each; `out`: 4 words each).
    #[cfg_attr(not(feature = "internals"), allow(dead_code))]
    pub fn philox_raw(
        &self,
        q: &dyn Queue,
        input: &DeviceBuffer<u32>,
        out: &DeviceBuffer<u32>,
        n: usize,
    ) -> Result<()> {
        need(
            "philox input",
            input,
            n.checked_mul(6)
                .ok_or_else(|| NnError::Shape("philox: too many records".into()))?,
        )?;
        need(
            "philox output",
            out,
            n.checked_mul(4)
                .ok_or_else(|| NnError::Shape("philox: too many records".into()))?,
        )?;
        // SAFETY: thread i < n reads input[6i..6i+6) and writes out[4i..4i+4): within 6n and 4n,
        // both checked.
        unsafe {
            launch_entered(
                q,
                &self.philox_raw,
                LaunchConfig::for_elements(n, BLOCK),
                &[input.into(), out.into(), Arg::I64(long(n)?)],
            )
        }
    }

    /// The first `n` 32-bit numbers of an op at `offset` into `out`.
    pub fn bits(
        &self,
        q: &dyn Queue,
        state: &DeviceBuffer<u64>,
        offset: u64,
        out: &DeviceBuffer<u32>,
        n: usize,
    ) -> Result<()> {
        state_ok(state)?;
        need("random bits", out, n)?;
        // SAFETY: state[0..2) is read (checked); group g writes out[4g + k] only below n
        // (checked).
        unsafe {
            launch_entered(
                q,
                &self.bits,
                groups(n),
                &[
                    state.into(),
                    Arg::U64(offset),
                    out.into(),
                    Arg::I64(long(n)?),
                ],
            )
        }
    }

    /// `out[i] = low + scale · u` for `i < n`, `u` uniform in `[0, 1)`.
    #[allow(clippy::too_many_arguments)]
    pub fn uniform(
        &self,
        q: &dyn Queue,
        state: &DeviceBuffer<u64>,
        offset: u64,
        out: &DeviceBuffer<f32>,
        n: usize,
        low: f32,
        scale: f32,
    ) -> Result<()> {
        let what = "uniform output";
        self.affine(q, &self.uniform, what, state, offset, out, n, low, scale)
    }

    /// `out[i] = mean + std · z` for `i < n`, `z` standard normal.
    #[allow(clippy::too_many_arguments)]
    pub fn normal(
        &self,
        q: &dyn Queue,
        state: &DeviceBuffer<u64>,
        offset: u64,
        out: &DeviceBuffer<f32>,
        n: usize,
        mean: f32,
        std: f32,
    ) -> Result<()> {
        let what = "normal output";
        self.affine(q, &self.normal, what, state, offset, out, n, mean, std)
    }

    /// `out[i] = a + b · r` for `i < n` with `f` one of the (state, offset, out, n, a, b)
    /// kernels (`uniform`, `normal`).
    #[allow(clippy::too_many_arguments)]
    fn affine(
        &self,
        q: &dyn Queue,
        f: &Function,
        what: &'static str,
        state: &DeviceBuffer<u64>,
        offset: u64,
        out: &DeviceBuffer<f32>,
        n: usize,
        a: f32,
        b: f32,
    ) -> Result<()> {
        state_ok(state)?;
        need(what, out, n)?;
        // SAFETY: as for `bits`: state[0..2), out below n.
        unsafe {
            launch_entered(
                q,
                f,
                groups(n),
                &[
                    state.into(),
                    Arg::U64(offset),
                    out.into(),
                    Arg::I64(long(n)?),
                    a.into(),
                    b.into(),
                ],
            )
        }
    }

    /// Dropout of `x[0..n)` into `y`, keep-bits into `mask` (`⌈n/32⌉` words).
    #[allow(clippy::too_many_arguments)]
    pub fn dropout_fwd(
        &self,
        q: &dyn Queue,
        state: &DeviceBuffer<u64>,
        offset: u64,
        x: &DeviceBuffer<f32>,
        y: &DeviceBuffer<f32>,
        mask: &DeviceBuffer<u32>,
        n: usize,
        threshold: u32,
        scale: f32,
    ) -> Result<()> {
        state_ok(state)?;
        need("dropout input", x, n)?;
        need("dropout output", y, n)?;
        need("dropout mask", mask, n.div_ceil(32))?;
        // SAFETY: group g reads x and writes y below n (checked) and, in the lane with g % 8 == 0
        // and 4g < n, writes mask[g / 8] < ⌈n/32⌉ (checked); state[0..2).
        unsafe {
            launch_entered(
                q,
                &self.dropout_fwd,
                groups(n),
                &[
                    state.into(),
                    Arg::U64(offset),
                    x.into(),
                    y.into(),
                    mask.into(),
                    Arg::I64(long(n)?),
                    Arg::U32(threshold),
                    scale.into(),
                ],
            )
        }
    }

    /// `dx = dy · scale` where `mask` keeps, else 0, over `n` elements.
    pub fn dropout_bwd(
        &self,
        q: &dyn Queue,
        dy: &DeviceBuffer<f32>,
        mask: &DeviceBuffer<u32>,
        dx: &DeviceBuffer<f32>,
        n: usize,
        scale: f32,
    ) -> Result<()> {
        need("dropout grad", dy, n)?;
        need("dropout input grad", dx, n)?;
        need("dropout mask", mask, n.div_ceil(32))?;
        // SAFETY: i < n reads dy[i], mask[i / 32] (< ⌈n/32⌉) and writes dx[i]; all checked.
        unsafe {
            launch_entered(
                q,
                &self.dropout_bwd,
                LaunchConfig::for_elements(n, BLOCK),
                &[
                    dy.into(),
                    mask.into(),
                    dx.into(),
                    Arg::I64(long(n)?),
                    scale.into(),
                ],
            )
        }
    }

    /// `state[1] += by` on the device.
    pub fn advance(&self, q: &dyn Queue, state: &DeviceBuffer<u64>, by: u64) -> Result<()> {
        state_ok(state)?;
        // SAFETY: one thread updates state[1] (state holds two words, checked).
        unsafe {
            launch_entered(
                q,
                &self.advance,
                LaunchConfig::linear(1, 1),
                &[state.into(), Arg::U64(by)],
            )
        }
    }
}
