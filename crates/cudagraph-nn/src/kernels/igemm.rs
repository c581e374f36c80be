//! cudagraph's own convolution engine: implicit-GEMM kernels for conv forward, backward-data and
//! backward-filter (`igemm.cu`, compiled as its own NVRTC module), and the spin kernel the
//! engine registry times behind (`spin.cu`, a tiny module of its own so products do not wait
//! for the conv kernels to compile). [`ConvKernels`] and [`Spin`] are per-device extensions;
//! every kernel is launched from one safe method here after every buffer was checked against
//! the extent the kernel indexes and every integer the kernel computes with was checked to fit
//! its type.
//!
//! The same module holds `conv_wgrad_small` (`wgrad.cu`): the weight gradient of convolutions
//! with few outputs (few channels), pixels split across blocks and summed in a fixed order.
//!
//! The direct kernels in `conv.cu` (module `cudagraph_nn`) stay as another candidate.

use std::sync::Arc;

use cudagraph::{Arg, Device, DeviceBuffer, Function, LaunchConfig, Queue, QueueExt};

use super::conv::conv_ints;
use crate::error::{NnError, Result};
use crate::extent::{conv_roles, ConvDir, ConvGeom};
use crate::kernels::int;

/// The CUDA source of the implicit-GEMM module (with the small weight-gradient kernel).
pub const SOURCE: &str = concat!(include_str!("igemm.cu"), include_str!("wgrad.cu"));

/// The CUDA source of the spin module.
pub const SPIN_SOURCE: &str = include_str!("spin.cu");

type Buf = DeviceBuffer<f32>;

/// Output tile of one block of the implicit-GEMM kernels (rows × columns of the product).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tile {
    /// 64 × 64: the general case.
    T64x64,
    /// 32 × 128: few output rows (small channel counts), many columns.
    T32x128,
    /// 128 × 32: many rows, few columns (backward-filter of small kernels).
    T128x32,
}

impl Tile {
    /// The three tiles, the general one first.
    pub const ALL: [Tile; 3] = [Tile::T64x64, Tile::T32x128, Tile::T128x32];

    /// (rows, columns) of the tile.
    pub fn dims(self) -> (usize, usize) {
        match self {
            Tile::T64x64 => (64, 64),
            Tile::T32x128 => (32, 128),
            Tile::T128x32 => (128, 32),
        }
    }

    fn index(self) -> usize {
        match self {
            Tile::T64x64 => 0,
            Tile::T32x128 => 1,
            Tile::T128x32 => 2,
        }
    }

    /// `64x64`, `32x128`, `128x32`.
    pub fn name(self) -> &'static str {
        match self {
            Tile::T64x64 => "64x64",
            Tile::T32x128 => "32x128",
            Tile::T128x32 => "128x32",
        }
    }

    /// The tile of a [`Self::name`], `None` for any other string.
    pub fn from_name(s: &str) -> Option<Tile> {
        Tile::ALL.into_iter().find(|t| t.name() == s)
    }
}

/// Sizes of the product behind a convolution direction: (M, N, K) as in `igemm.cu`'s header.
pub fn gemm_shape(dir: ConvDir, g: &ConvGeom) -> Result<(usize, usize, usize)> {
    let (oh, ow) = g.out_hw()?;
    let m = |d: &[usize]| {
        d.iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b))
            .ok_or_else(|| NnError::Shape(format!("conv2d: geometry {g:?} overflows")))
    };
    Ok(match dir {
        ConvDir::Forward => (g.oc, m(&[g.n, oh, ow])?, m(&[g.c, g.kh, g.kw])?),
        ConvDir::BackwardData => (g.c, m(&[g.n, g.h, g.w])?, m(&[g.oc, g.kh, g.kw])?),
        ConvDir::BackwardFilter => (g.oc, m(&[g.c, g.kh, g.kw])?, m(&[g.n, oh, ow])?),
    })
}

/// Largest M, N or K the kernels accept: their `int` index arithmetic adds up to one tile
/// (256) past the end before comparing.
const MAX_DIM: usize = i32::MAX as usize - 256;

/// Whether the implicit-GEMM kernels can run this geometry (every index fits their integer
/// types, the grid fits), or why not.
pub fn supports(dir: ConvDir, g: &ConvGeom, tile: Tile) -> Result<()> {
    conv_ints(g)?; // every dimension fits an int, and the weight count
    let (m, n, k) = gemm_shape(dir, g)?;
    let too_big = |what: &str, v: usize| {
        Err(NnError::Shape(format!(
            "conv2d implicit GEMM: {what} = {v} exceeds {MAX_DIM}"
        )))
    };
    for (what, v) in [("M", m), ("N", n), ("K", k)] {
        if v > MAX_DIM {
            return too_big(what, v);
        }
    }
    // Per-image offsets are computed in 32 bits.
    let (oh, ow) = g.out_hw()?;
    for (what, d) in [("C·H·W", [g.c, g.h, g.w]), ("OC·OH·OW", [g.oc, oh, ow])] {
        let v = d
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b))
            .unwrap_or(usize::MAX);
        if v > MAX_DIM {
            return too_big(what, v);
        }
    }
    // Padded extents (oh·stride stays below them).
    for v in [g.h, g.w] {
        match g.pad.checked_mul(2).and_then(|p| v.checked_add(p)) {
            Some(e) if e <= MAX_DIM => {}
            _ => return too_big("padded extent", v.saturating_add(g.pad.saturating_mul(2))),
        }
    }
    let (bm, _) = tile.dims();
    if m.div_ceil(bm) > 65535 {
        return too_big("M tiles (grid y)", m.div_ceil(bm));
    }
    Ok(())
}

/// Whether the direct kernels (`conv.cu`) can run this geometry: every dimension and the
/// weight count fit their `int`s.
pub fn direct_supports(g: &ConvGeom) -> bool {
    conv_ints(g).is_ok()
}

/// A split count that gives the device about two waves of blocks while each split keeps at
/// least four 16-deep K steps (1 = no split).
pub fn default_splits(dir: ConvDir, g: &ConvGeom, tile: Tile, multiprocessors: u32) -> usize {
    let Ok((m, n, k)) = gemm_shape(dir, g) else {
        return 1;
    };
    let (bm, bn) = tile.dims();
    let blocks = m.div_ceil(bm).saturating_mul(n.div_ceil(bn)).max(1);
    let want = (2 * multiprocessors.max(1) as usize).div_ceil(blocks);
    want.min(k.div_ceil(16) / 4).clamp(1, 64)
}

/// A deeper split than [`default_splits`], offered as a second candidate to measure: products
/// with few output blocks and a long K (the weight gradient of a convolution with few channels
/// over large images: a 16 × 27 output reduced over 100 000 pixels) leave most of the device
/// idle with two waves. About eight waves of blocks, each split keeping at least four 16-deep
/// K steps, at most 512 splits; `None` when that is not deeper than the default.
pub fn deep_splits(dir: ConvDir, g: &ConvGeom, tile: Tile, multiprocessors: u32) -> Option<usize> {
    let (m, n, k) = gemm_shape(dir, g).ok()?;
    let (bm, bn) = tile.dims();
    let blocks = m.div_ceil(bm).saturating_mul(n.div_ceil(bn)).max(1);
    let want = (8 * multiprocessors.max(1) as usize).div_ceil(blocks);
    let s = want.min(k.div_ceil(16) / 4).clamp(1, 512);
    (s > default_splits(dir, g, tile, multiprocessors)).then_some(s)
}

/// How many groups of splits `conv_igemm_reduce` gives each output (a power of two, at most
/// 16, each group keeping at least 8 splits): more while the outputs alone would leave the
/// device short of about 16 warps per multiprocessor, so a small output summed over hundreds
/// of splits is not read by a handful of threads.
pub fn reduce_groups(outputs: usize, splits: usize, multiprocessors: u32) -> usize {
    let enough = 512 * multiprocessors.max(1) as usize;
    let mut g = 1;
    while g < 16 && splits >= 16 * g && outputs.saturating_mul(g) < enough {
        g *= 2;
    }
    g
}

/// The most outputs (OC · C·KH·KW) `conv_wgrad_small` takes: 16 per thread of its block.
pub const WGRAD_MAX_OUTPUTS: usize = 4096;
/// The most rows (OC + C·KH·KW) of its shared-memory tiles (33 floats each, under 48 KiB).
const WGRAD_MAX_ROWS: usize = 320;
/// Output pixels per shared-memory tile of `conv_wgrad_small`.
const WGRAD_TILE: usize = 32;

/// Whether `conv_wgrad_small` takes this geometry: few outputs, and every index it computes in
/// 32 bits (input and output sizes, the pixel range with a block's chunk past it) fits.
pub fn wgrad_small_supports(g: &ConvGeom) -> bool {
    let Ok((m, n, k)) = gemm_shape(ConvDir::BackwardFilter, g) else {
        return false;
    };
    let fits = |v: Result<usize>| v.is_ok_and(|v| v <= MAX_DIM);
    conv_ints(g).is_ok()
        && m.saturating_mul(n) <= WGRAD_MAX_OUTPUTS
        && m + n <= WGRAD_MAX_ROWS
        && k.saturating_mul(2) <= MAX_DIM
        && fits(g.input_len())
        && fits(g.output_len())
}

/// The block counts `conv_wgrad_small` is measured with: enough blocks that each takes at
/// least four 32-pixel tiles, up to eight per multiprocessor; and a quarter of that (fewer
/// partial sums to add). Empty when the geometry has no pixels.
pub fn wgrad_parts(g: &ConvGeom, multiprocessors: u32) -> Vec<usize> {
    let Ok((_, _, pixels)) = gemm_shape(ConvDir::BackwardFilter, g) else {
        return Vec::new();
    };
    if pixels == 0 {
        return Vec::new();
    }
    let tiles = pixels.div_ceil(WGRAD_TILE);
    let most = (tiles / 4).clamp(1, 8 * multiprocessors.max(1) as usize);
    let mut v = vec![most];
    if most >= 8 {
        v.push(most / 4);
    }
    v
}

/// The tile that suits the product's shape (used before anything was measured).
pub fn default_tile(dir: ConvDir, g: &ConvGeom) -> Tile {
    match gemm_shape(dir, g) {
        Ok((m, _, _)) if m <= 32 => Tile::T32x128,
        Ok((_, n, _)) if n <= 32 => Tile::T128x32,
        _ => Tile::T64x64,
    }
}

/// The implicit-GEMM kernels of one device.
pub struct ConvKernels {
    /// [direction][tile]
    igemm: [[Function; 3]; 3],
    reduce: Function,
    wgrad_small: Function,
}

/// The spin kernel of one device.
pub struct Spin {
    spin: Function,
}

impl Spin {
    /// The kernel of `device`, compiled (or loaded from the NVRTC cache) on first use.
    pub fn get(device: &Device) -> Result<Arc<Spin>> {
        device
            .extension(|d| {
                let m = d.compile(
                    "cudagraph_nn_spin",
                    &super::module_source("cudagraph_nn_spin"),
                )?;
                Ok(Spin {
                    spin: m.function("engines_spin")?,
                })
            })
            .map_err(NnError::from)
    }

    /// Busy-waits `ns` nanoseconds on the queue's stream (at most 10 ms).
    pub fn spin(&self, q: &dyn Queue, ns: u64) -> Result<()> {
        let ns = ns.min(10_000_000) as i64;
        // SAFETY: the kernel touches no memory.
        unsafe {
            q.launch(&self.spin, LaunchConfig::linear(1, 1), &[Arg::I64(ns)])?;
        }
        Ok(())
    }
}

impl ConvKernels {
    /// The kernels of `device`, compiled (or loaded from the NVRTC cache) on first use.
    pub fn get(device: &Device) -> Result<Arc<ConvKernels>> {
        device
            .extension(|d| {
                let m = d.compile(
                    "cudagraph_nn_igemm",
                    &super::module_source("cudagraph_nn_igemm"),
                )?;
                let f = |n: &str| m.function(n);
                let dir = |d: &str| -> cudagraph::Result<[Function; 3]> {
                    Ok([
                        f(&format!("conv_igemm_{d}_64x64"))?,
                        f(&format!("conv_igemm_{d}_32x128"))?,
                        f(&format!("conv_igemm_{d}_128x32"))?,
                    ])
                };
                Ok(ConvKernels {
                    igemm: [dir("fwd")?, dir("bwd_data")?, dir("bwd_filter")?],
                    reduce: f("conv_igemm_reduce")?,
                    wgrad_small: f("conv_wgrad_small")?,
                })
            })
            .map_err(NnError::from)
    }

    /// Runs one direction of a convolution as an implicit GEMM with `tile` and about `splits`
    /// K splits. Buffers by direction: forward `a = x`, `b = w`, `out = y`, `bias` optional;
    /// backward-data `a = dy`, `b = w`, `out = dx`; backward-filter `a = dy`, `b = x`,
    /// `out = dw` (`bias` must be `None` for the backward directions).
    #[allow(clippy::too_many_arguments)]
    pub fn conv(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        tile: Tile,
        splits: usize,
        g: &ConvGeom,
        a: &Buf,
        b: &Buf,
        out: &Buf,
        bias: Option<&Buf>,
    ) -> Result<()> {
        supports(dir, g, tile)?;
        let ints = conv_ints(g)?;
        conv_roles(dir, g, (a, b, out), bias)?;
        // The kernel's operands: src_a, src_b (see igemm.cu) and the output.
        let (src_a, src_b) = match dir {
            ConvDir::Forward => (b, a),        // kernel: a = w, b = x
            ConvDir::BackwardData => (b, a),   // kernel: a = w, b = dy
            ConvDir::BackwardFilter => (a, b), // kernel: a = dy, b = x
        };
        let (m, n, k) = gemm_shape(dir, g)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (bm, bn) = tile.dims();
        let kchunk = k.div_ceil(splits.max(1)).div_ceil(16).max(1) * 16;
        let splits = k.div_ceil(kchunk).max(1);
        if splits > 65535 {
            return Err(NnError::Shape(format!("conv2d: {splits} K splits")));
        }
        let mn = m
            .checked_mul(n)
            .ok_or_else(|| NnError::Shape(format!("conv2d: {m}×{n} outputs overflow")))?;
        let partial = if splits > 1 {
            let len = mn.checked_mul(splits).ok_or_else(|| {
                NnError::Shape(format!("conv2d: {splits} splits of {mn} outputs overflow"))
            })?;
            Some(q.alloc::<f32>(len)?)
        } else {
            None
        };
        let grid_x = u32::try_from(n.div_ceil(bn))
            .map_err(|_| NnError::Shape(format!("conv2d: {n} columns exceed the grid")))?;
        let cfg = LaunchConfig {
            grid: (grid_x, m.div_ceil(bm) as u32, splits as u32),
            block: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args: Vec<Arg<'_>> = vec![
            src_a.into(),
            src_b.into(),
            out.into(),
            Arg::opt(bias),
            Arg::opt(partial.as_ref()),
        ];
        args.extend(ints.map(Arg::I32));
        args.push(Arg::I32(int("K chunk", kchunk)?));
        let f = &self.igemm[dir.index()][tile.index()];
        // SAFETY: `supports` checked that M, N, K and the per-image sizes fit the kernel's int
        // arithmetic (with a tile of headroom) and the grid fits. Every load is guarded by
        // m < M, column < N, k in [z·kchunk, min(K, (z+1)·kchunk)) and, for activations, by
        // 0 <= ih < H, 0 <= iw < W (and oh < OH, ow < OW for dy), which with the geometry keeps
        // reads of x below N·C·H·W, of w below OC·C·KH·KW and of dy below N·OC·OH·OW — the
        // extents checked above for the buffers passed in those roles. Writes go to `out` at
        // the (m, column) position of the direction's layout, below its checked extent, or to
        // `partial` below splits·M·N (allocated so); the bias is read below OC (checked).
        unsafe { q.launch(f, cfg, &args)? };
        if let Some(p) = &partial {
            // SAFETY: `p` holds splits·M·N partial sums of this direction's product (allocated
            // so above), `out` and `bias` were checked against the direction's extents.
            unsafe { self.reduce(q, dir, g, p, splits, mn, out, bias)? };
        }
        Ok(())
    }

    /// Adds `splits` partial products `partial[z][M·N]` of direction `dir` in z order into the
    /// direction's output layout (with the bias, forward only).
    ///
    /// # Safety
    /// `partial` holds at least `splits·mn` elements with `mn = M·N` of `dir`'s product of `g`;
    /// `out` holds the direction's output extent of `g` and `bias`, if any, `g.oc` elements.
    #[allow(clippy::too_many_arguments)]
    unsafe fn reduce(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        g: &ConvGeom,
        partial: &Buf,
        splits: usize,
        mn: usize,
        out: &Buf,
        bias: Option<&Buf>,
    ) -> Result<()> {
        let ints = conv_ints(g)?;
        let mut rargs: Vec<Arg<'_>> = vec![
            partial.into(),
            Arg::I32(int("splits", splits)?),
            out.into(),
            Arg::opt(bias),
            Arg::I32(dir.index() as i32),
        ];
        rargs.extend(ints[..9].iter().copied().map(Arg::I32));
        let groups = reduce_groups(mn, splits, q.device().info().multiprocessors);
        let width = 256 / groups;
        let blocks = u32::try_from(mn.div_ceil(width))
            .map_err(|_| NnError::Shape(format!("conv2d: {mn} outputs exceed the grid")))?;
        let cfg = LaunchConfig {
            grid: (blocks, 1, 1),
            block: (width as u32, groups as u32, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: thread (tx, ty) of block b handles e = b·width + tx; only e < M·N read
        // partial[z·M·N + e] for z < splits (the caller's extent) and write the direction's
        // output at the position of (e / N, e % N), below the extent the caller promised; the
        // bias (forward only) below OC. The block has width·groups = 256 threads, the kernel's
        // shared array size.
        unsafe { q.launch(&self.reduce, cfg, &rargs) }.map_err(Into::into)
    }

    /// The weight gradient `dw` from `dy` and `x` with `conv_wgrad_small` over `parts` blocks
    /// of output pixels (then a fixed-order sum of the parts). Errors for geometries
    /// [`wgrad_small_supports`] refuses.
    pub fn wgrad_small(
        &self,
        q: &dyn Queue,
        g: &ConvGeom,
        dy: &Buf,
        x: &Buf,
        dw: &Buf,
        parts: usize,
    ) -> Result<()> {
        if !wgrad_small_supports(g) {
            return Err(NnError::Shape(format!(
                "conv2d small weight gradient: {g:?} has more than {WGRAD_MAX_OUTPUTS} weights, \
                 or indices beyond 32 bits"
            )));
        }
        conv_roles(ConvDir::BackwardFilter, g, (dy, x, dw), None)?;
        let (oc, r, pixels) = gemm_shape(ConvDir::BackwardFilter, g)?;
        if oc == 0 || r == 0 {
            return Ok(());
        }
        if pixels == 0 {
            return q.memset_zero(&dw.prefix(oc * r)?).map_err(Into::into);
        }
        let chunk = pixels.div_ceil(parts.clamp(1, 65535));
        let parts = pixels.div_ceil(chunk);
        let outputs = oc * r;
        let partial = if parts > 1 {
            Some(q.alloc::<f32>(outputs * parts)?)
        } else {
            None
        };
        let ints = conv_ints(g)?;
        let mut args: Vec<Arg<'_>> =
            vec![dy.into(), x.into(), partial.as_ref().unwrap_or(dw).into()];
        args.extend(ints.map(Arg::I32));
        args.push(Arg::I32(int("pixel chunk", chunk)?));
        let smem = (oc + r) * (WGRAD_TILE + 1) * 4 + WGRAD_TILE * 4 * 4;
        let cfg = LaunchConfig {
            grid: (parts as u32, 1, 1),
            block: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: `wgrad_small_supports` bounds OC·R by 4096 (16 outputs per thread of 256)
        // and OC + R by 320 rows, so the shared tiles fit `smem` (< 48 KiB); N·C·H·W,
        // N·OC·OH·OW and the pixel range plus a chunk fit an int. Block z reads dy at
        // (n, o, pixel) for pixels below N·OH·OW and o < OC — below dy's checked extent — and
        // x at (n, ci, iy, ix) with 0 <= iy < H, 0 <= ix < W (guarded), ci < C — below x's
        // checked extent; it writes outputs e < OC·R of part z: `partial` holds parts·OC·R
        // (allocated so), or with one part `dw` holds OC·R (checked).
        unsafe { q.launch(&self.wgrad_small, cfg, &args)? };
        if let Some(p) = &partial {
            // SAFETY: `p` holds parts·OC·R sums in the backward-filter product's layout
            // (M = OC, N = C·KH·KW); `dw` holds OC·C·KH·KW (checked).
            unsafe { self.reduce(q, ConvDir::BackwardFilter, g, p, parts, outputs, dw, None)? };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The multiply-shift division of `igemm.cu`, mirrored on the host.
    fn fast_div(x: u32, d: u32) -> u32 {
        if d <= 1 {
            return x;
        }
        let l = 32 - (d - 1).leading_zeros();
        let p = 31 + l;
        let mul = (1u64 << p).div_ceil(d as u64) as u32; // ((1 << p) + d - 1) / d on the device
        (((x as u64 * mul as u64) >> 32) as u32) >> (p - 32)
    }

    #[test]
    fn fast_division_is_exact_for_every_int_dividend() {
        let mut rng = crate::random::HostRng::new(3);
        let divisors: Vec<u32> = (1..=300)
            .chain([
                511,
                512,
                513,
                4095,
                50176,
                12544,
                1 << 20,
                (1 << 30) + 7,
                i32::MAX as u32,
            ])
            .collect();
        for &d in &divisors {
            let edges = [
                0u32,
                1,
                d - 1,
                d,
                d + 1,
                i32::MAX as u32 - 1,
                i32::MAX as u32,
            ];
            for x in edges {
                assert_eq!(fast_div(x, d), x / d, "{x} / {d}");
            }
            for _ in 0..2000 {
                let x = (rng.next_u64() % i32::MAX as u64) as u32;
                assert_eq!(fast_div(x, d), x / d, "{x} / {d}");
            }
        }
    }

    #[test]
    fn product_shapes_follow_the_direction() {
        let g = ConvGeom::square(2, 3, 8, 5, 3, 1, 1); // 8x8 output
        assert_eq!(gemm_shape(ConvDir::Forward, &g).unwrap(), (5, 128, 27));
        assert_eq!(gemm_shape(ConvDir::BackwardData, &g).unwrap(), (3, 128, 45));
        assert_eq!(
            gemm_shape(ConvDir::BackwardFilter, &g).unwrap(),
            (5, 27, 128)
        );
    }

    #[test]
    fn splits_fill_the_device_only_when_blocks_are_few() {
        let big = ConvGeom::square(64, 64, 56, 64, 3, 1, 1);
        assert_eq!(default_splits(ConvDir::Forward, &big, Tile::T64x64, 132), 1);
        // Backward-filter of a small kernel: one 64x64 block, K = 64·56·56.
        let s = default_splits(ConvDir::BackwardFilter, &big, Tile::T64x64, 132);
        assert!(s > 1 && s <= 64, "{s}");
        // Tiny K never splits below four steps.
        let tiny = ConvGeom::square(1, 1, 4, 1, 1, 1, 0);
        assert_eq!(
            default_splits(ConvDir::BackwardFilter, &tiny, Tile::T64x64, 132),
            1
        );
    }

    #[test]
    fn reduce_groups_spread_few_outputs_over_their_splits() {
        // A 16 × 27 weight gradient over 512 splits: 16 groups of 32 splits.
        assert_eq!(reduce_groups(432, 512, 132), 16);
        // Many outputs fill the device alone.
        assert_eq!(reduce_groups(1 << 20, 512, 132), 1);
        // Each group keeps at least 8 splits.
        assert_eq!(reduce_groups(432, 8, 132), 1);
        assert_eq!(reduce_groups(432, 32, 132), 4);
        // Never more than 16 groups, and 256 threads divide evenly.
        for (o, s) in [(1, 1 << 16), (0, 1000), (100, 65535)] {
            let g = reduce_groups(o, s, 132);
            assert!(g.is_power_of_two() && g <= 16 && 256 % g == 0);
        }
    }

    #[test]
    fn deep_splits_only_where_k_is_long_and_blocks_few() {
        // Weight gradient of 3 → 16 channels, 3×3, over 2 × 224²: one 32x128 block, K = 100 352.
        let small_c = ConvGeom::square(2, 3, 224, 16, 3, 1, 1);
        let d = default_splits(ConvDir::BackwardFilter, &small_c, Tile::T32x128, 132);
        assert_eq!(d, 64);
        assert_eq!(
            deep_splits(ConvDir::BackwardFilter, &small_c, Tile::T32x128, 132),
            Some(512)
        );
        // A forward pass with many output blocks: no split, no deeper one.
        let big = ConvGeom::square(64, 64, 56, 64, 3, 1, 1);
        assert_eq!(deep_splits(ConvDir::Forward, &big, Tile::T64x64, 132), None);
        // Short K: capped by four K steps per split, never deeper than the default.
        let tiny = ConvGeom::square(1, 1, 4, 1, 1, 1, 0);
        assert_eq!(
            deep_splits(ConvDir::BackwardFilter, &tiny, Tile::T64x64, 132),
            None
        );
    }

    #[test]
    fn unsupported_sizes_are_errors_not_launches() {
        let ok = ConvGeom::square(1, 3, 8, 4, 3, 1, 1);
        assert!(supports(ConvDir::Forward, &ok, Tile::T64x64).is_ok());
        let huge = ConvGeom::square(1 << 16, 64, 256, 64, 3, 1, 1); // N·OH·OW > 2^31
        assert!(supports(ConvDir::Forward, &huge, Tile::T64x64).is_err());
        assert_eq!(default_tile(ConvDir::Forward, &ok), Tile::T32x128);
        assert_eq!(Tile::from_name("128x32"), Some(Tile::T128x32));
    }
}
