//! The half-precision convolutions' own kernels (`conv_lowp.cu`, compiled after `cast.cu` as
//! its own NVRTC module `cudagraph_nn_conv_lowp`): layout transposes between `NCHW` and `NHWC` (and between `OIHW`
//! and `OHWI` weights), widening bf16/f16 to f32 on the way where asked; the bias and ReLU
//! after a convolution that did not fuse them; and direct convolutions in all three
//! directions in either layout with any stride, padding and dilation — the engine of last
//! resort for shapes no cuDNN engine takes, and the weight gradient in f32 —, every sum in
//! f32. What runs when is the registry's choice (`crate::engine::conv_lowp`); these launchers
//! only check and launch.
//!
//! Every launcher checks each buffer against the extent its kernel indexes, computed from the
//! same integers that go to the kernel, and that those integers fit the kernel's types.

use std::sync::Arc;

use cudagraph::{Arg, Device, DeviceBuffer, Function, LaunchConfig, Queue};

use crate::dtype::{Dtype, Float};
use crate::error::{NnError, Result};
use crate::extent::{need, prod, ConvDir, ConvShape, Layout};
use crate::kernels::{grid_stride, int, STRIDE_MAX_BLOCKS};

/// The CUDA source of the module: `conv_lowp.cu` after the cast module's conversions.
pub fn source() -> String {
    format!("{}{}", super::cast::SOURCE, include_str!("conv_lowp.cu"))
}

// The elementwise and direct kernels launch grid-stride (`grid_stride`): blocks of 256
// threads, a whole number of warps, as the weight-gradient kernel needs (a warp per element).

/// The module's kernels on one device (a [`Device::extension`]).
pub struct ConvLowpKernels {
    /// (bf16→bf16, f16→f16, bf16→f32, f16→f32, f32→f32).
    transpose: [Function; 5],
    /// bf16, f16.
    bias_act: [Function; 2],
    /// The same eight elements (16 bytes) at a time, where the layout allows.
    bias_act8: [Function; 2],
    /// Channel padding into NHWC (bf16, f16).
    pad_channels: [Function; 2],
    fwd: [Function; 2],
    bwd_data: [Function; 2],
    /// (bf16→bf16, f16→f16, bf16→f32, f16→f32).
    bwd_filter: [Function; 4],
}

/// 0 for bf16, 1 for f16; a typed error for f32 (`op` names the caller).
fn half_index(op: &'static str, d: Dtype) -> Result<usize> {
    match d {
        Dtype::Bf16 => Ok(0),
        Dtype::F16 => Ok(1),
        Dtype::F32 => Err(NnError::Dtype {
            what: op,
            expected: "bf16 or f16",
            found: d.name(),
        }),
    }
}

/// The integers of a direct convolution, as the kernels take them: N, C, H, W, K, R, S, OH,
/// OW, stride, pad, dilation, nhwc. Errors when one does not fit an int, or when `h + 2·pad`
/// or `w + 2·pad` does not (the kernels compute input rows and columns as ints).
pub(crate) fn direct_ints(s: &ConvShape, layout: Layout) -> Result<[i32; 13]> {
    let g = &s.geom;
    let (oh, ow) = s.out_hw()?;
    for (what, side) in [("h", g.h), ("w", g.w)] {
        let padded = g.pad.checked_mul(2).and_then(|p| side.checked_add(p));
        padded.and_then(|v| i32::try_from(v).ok()).ok_or_else(|| {
            NnError::Shape(format!(
                "conv2d: {what} + 2·pad overflows a 32-bit int in {s:?}"
            ))
        })?;
    }
    Ok([
        int("n", g.n)?,
        int("c", g.c)?,
        int("h", g.h)?,
        int("w", g.w)?,
        int("oc", g.oc)?,
        int("kh", g.kh)?,
        int("kw", g.kw)?,
        int("oh", oh)?,
        int("ow", ow)?,
        int("stride", g.stride)?,
        int("pad", g.pad)?,
        int("dilation", s.dilation)?,
        (layout == Layout::Nhwc) as i32,
    ])
}

impl ConvLowpKernels {
    /// The kernels of `device`, compiled (or loaded from the NVRTC cache) on first use.
    pub fn get(device: &Device) -> Result<Arc<ConvLowpKernels>> {
        device
            .extension(|d| {
                // Relaxed capture mode: the first use may be inside a capture (module loading).
                let m = cudagraph::runtime::with_relaxed_capture(|| {
                    d.compile(
                        "cudagraph_nn_conv_lowp",
                        &super::module_source("cudagraph_nn_conv_lowp"),
                    )
                })?;
                let f = |n: &str| m.function(n);
                Ok(ConvLowpKernels {
                    transpose: [
                        f("lowp_transpose_bf16_bf16")?,
                        f("lowp_transpose_f16_f16")?,
                        f("lowp_transpose_bf16_f32")?,
                        f("lowp_transpose_f16_f32")?,
                        f("lowp_transpose_f32_f32")?,
                    ],
                    bias_act: [f("lowp_bias_act_bf16")?, f("lowp_bias_act_f16")?],
                    bias_act8: [f("lowp_bias_act8_bf16")?, f("lowp_bias_act8_f16")?],
                    pad_channels: [f("lowp_pad_channels_bf16")?, f("lowp_pad_channels_f16")?],
                    fwd: [f("lowp_conv_fwd_bf16")?, f("lowp_conv_fwd_f16")?],
                    bwd_data: [f("lowp_conv_bwd_data_bf16")?, f("lowp_conv_bwd_data_f16")?],
                    bwd_filter: [
                        f("lowp_conv_bwd_filter_bf16_bf16")?,
                        f("lowp_conv_bwd_filter_f16_f16")?,
                        f("lowp_conv_bwd_filter_bf16_f32")?,
                        f("lowp_conv_bwd_filter_f16_f32")?,
                    ],
                })
            })
            .map_err(NnError::from)
    }

    /// `dst[b][j][i] = src[b][i][j]` for `b < batches`, `i < rows`, `j < cols`: a batch of
    /// `rows × cols` matrices transposed, converted from `A` to `B` on the way (the same type:
    /// the bits are moved; bf16/f16 to f32: exact). The pairs are bf16→bf16, f16→f16,
    /// bf16→f32, f16→f32 and f32→f32 (any other is a typed error). `NCHW → NHWC` of an
    /// activation is `(n, c, h·w)`, `NHWC → NCHW` is `(n, h·w, c)`; weights `OIHW → OHWI` are
    /// `(oc, c, kh·kw)`, back `(oc, kh·kw, c)`.
    #[allow(clippy::too_many_arguments)]
    pub fn transpose<A: Float, B: Float>(
        &self,
        q: &dyn Queue,
        batches: usize,
        rows: usize,
        cols: usize,
        src: &DeviceBuffer<A>,
        dst: &DeviceBuffer<B>,
    ) -> Result<()> {
        let f = match (A::DTYPE, B::DTYPE) {
            (Dtype::Bf16, Dtype::Bf16) => &self.transpose[0],
            (Dtype::F16, Dtype::F16) => &self.transpose[1],
            (Dtype::Bf16, Dtype::F32) => &self.transpose[2],
            (Dtype::F16, Dtype::F32) => &self.transpose[3],
            (Dtype::F32, Dtype::F32) => &self.transpose[4],
            (_, to) => {
                return Err(NnError::Dtype {
                    what: "layout transpose: the destination",
                    expected: "the source's type, or f32",
                    found: to.name(),
                })
            }
        };
        let len = prod("layout transpose", &[batches, rows, cols])?;
        need("layout transpose source", src, len)?;
        need("layout transpose destination", dst, len)?;
        if len == 0 {
            return Ok(());
        }
        let (r, c) = (int("rows", rows)?, int("cols", cols)?);
        let b = i64::try_from(batches)
            .map_err(|_| NnError::Shape(format!("{batches} matrices exceed i64")))?;
        let tiles = rows.div_ceil(32) * cols.div_ceil(32);
        let cfg = LaunchConfig {
            grid: (
                tiles.clamp(1, STRIDE_MAX_BLOCKS) as u32,
                batches.clamp(1, 65_535) as u32,
                1,
            ),
            block: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel is one of `transpose_batch`'s instances for (A, B), whose
        // parameters are (const A* src, B* dst, long long batches, int rows, int cols); it reads
        // src and writes dst only at b·rows·cols + i·cols + j and b·rows·cols + j·rows + i for
        // b < batches, i < rows, j < cols, below batches·rows·cols = len, which both buffers
        // hold (checked above). Its loops are uniform per block, so every thread reaches its
        // barriers; the block is 32 × 8 as the kernel's tile loops assume.
        unsafe {
            q.launch(
                f,
                cfg,
                &[
                    src.into(),
                    dst.into(),
                    Arg::I64(b),
                    Arg::I32(r),
                    Arg::I32(c),
                ],
            )?;
        }
        Ok(())
    }

    /// An activation of `n × c × hw` from `from` to `to` layout (a copy when they are the
    /// same), converted from `A` to `B` as [`ConvLowpKernels::transpose`].
    #[allow(clippy::too_many_arguments)]
    pub fn relayout<A: Float, B: Float>(
        &self,
        q: &dyn Queue,
        (n, c, hw): (usize, usize, usize),
        from: Layout,
        to: Layout,
        src: &DeviceBuffer<A>,
        dst: &DeviceBuffer<B>,
    ) -> Result<()> {
        match (from, to) {
            // The same layout: each image a one-row matrix (a copy, converted; correct but not
            // fast — the casts of `kernels::cast` do this better where the types allow).
            (a, b) if a == b => self.transpose(q, n, 1, prod("relayout", &[c, hw])?, src, dst),
            (Layout::Nchw, _) => self.transpose(q, n, c, hw, src, dst),
            (Layout::Nhwc, _) => self.transpose(q, n, hw, c, src, dst),
        }
    }

    /// `src`, `batches × c × inner` in `layout` (`NCHW`: `[b][c][p]`, also `OIHW` weights;
    /// `NHWC`: `[b][p][c]`, also `OHWI`), into `dst` as NHWC with `pad` channels: channel
    /// `k < c` copied, `c ≤ k < pad` zero. `1 ≤ c ≤ pad ≤ 8`.
    #[allow(clippy::too_many_arguments)]
    pub fn pad_channels<T: Float>(
        &self,
        q: &dyn Queue,
        (batches, c, inner): (usize, usize, usize),
        pad: usize,
        layout: Layout,
        src: &DeviceBuffer<T>,
        dst: &DeviceBuffer<T>,
    ) -> Result<()> {
        let f = &self.pad_channels[half_index("channel padding", T::DTYPE)?];
        if c == 0 || c > pad || pad > 8 {
            return Err(NnError::Shape(format!(
                "channel padding: {c} channels to {pad} (needs 1 ≤ channels ≤ padded ≤ 8)"
            )));
        }
        need(
            "channel padding source",
            src,
            prod("channel padding", &[batches, c, inner])?,
        )?;
        let items = prod("channel padding", &[batches, inner])?;
        need(
            "channel padding destination",
            dst,
            prod("channel padding", &[items, pad])?,
        )?;
        if items == 0 {
            return Ok(());
        }
        let as_i64 = |v: usize| {
            i64::try_from(v).map_err(|_| NnError::Shape(format!("{v} elements exceed i64")))
        };
        // SAFETY: the kernel's parameters are (const T* src, T* dst, long long items, long
        // long inner, int c, int pad, int src_nhwc) with T 2 bytes (bf16_t / f16_t for this
        // dtype); for i < items = batches·inner it writes dst[i·pad + k], k < pad, below
        // items·pad, which dst holds, and reads src at i·c + k (NHWC) or (b·c + k)·inner + p
        // (NCHW, b = i / inner, p = i % inner) for k < c, below batches·c·inner, which src
        // holds (all checked above).
        unsafe {
            q.launch(
                f,
                grid_stride(items),
                &[
                    src.into(),
                    dst.into(),
                    Arg::I64(as_i64(items)?),
                    Arg::I64(as_i64(inner.max(1))?),
                    Arg::I32(c as i32),
                    Arg::I32(pad as i32),
                    Arg::I32((layout == Layout::Nhwc) as i32),
                ],
            )?;
        }
        Ok(())
    }

    /// `y = relu?(y + bias)` over an output of `n × c × hw` in `layout` (`bias`: `c` elements,
    /// or none), in f32 with one rounding.
    #[allow(clippy::too_many_arguments)]
    pub fn bias_act<T: Float>(
        &self,
        q: &dyn Queue,
        (n, c, hw): (usize, usize, usize),
        layout: Layout,
        y: &DeviceBuffer<T>,
        bias: Option<&DeviceBuffer<T>>,
        relu: bool,
    ) -> Result<()> {
        let which = half_index("conv2d bias", T::DTYPE)?;
        let len = prod("conv2d y", &[n, c, hw])?;
        need("conv2d y", y, len)?;
        if let Some(b) = bias {
            need("conv2d bias", b, c)?;
        }
        if len == 0 || (bias.is_none() && !relu) {
            return Ok(());
        }
        let inner = match layout {
            Layout::Nchw => hw,
            Layout::Nhwc => 1,
        };
        let as_i64 = |v: usize| {
            i64::try_from(v).map_err(|_| NnError::Shape(format!("{v} elements exceed i64")))
        };
        // Groups of eight in one channel (NCHW) or eight consecutive channels (NHWC).
        let grouped = match layout {
            Layout::Nchw => hw % 8 == 0,
            Layout::Nhwc => c % 8 == 0,
        };
        let wide = grouped && len % 8 == 0 && y.addr() % 16 == 0;
        let (f, items) = if wide {
            (&self.bias_act8[which], len / 8)
        } else {
            (&self.bias_act[which], len)
        };
        // SAFETY: the kernels' parameters are (T* y, const T* bias, long long n, long long
        // inner, int channels, int relu) with T 2 bytes (bf16_t / f16_t for this dtype);
        // `lowp_bias_act_*` reads and writes y[i] for i < len only, and reads
        // bias[(i / inner) % c] < c only when bias is not null; `lowp_bias_act8_*` reads and
        // writes the 16-byte groups y[8g .. 8g + 8] for g < len / 8 (len a multiple of 8, y
        // 16-byte aligned: checked) and reads bias[c0 + k] (NHWC, inner 1, c0 = 8g % c a
        // multiple of 8 with c a multiple of 8, so c0 + 7 < c) or bias[c0] (NCHW, c0 < c);
        // y holds len and bias c elements (checked above).
        unsafe {
            q.launch(
                f,
                grid_stride(items),
                &[
                    y.into(),
                    Arg::opt(bias),
                    Arg::I64(as_i64(items)?),
                    Arg::I64(as_i64(inner.max(1))?),
                    Arg::I32(int("channels", c)?),
                    Arg::I32(relu as i32),
                ],
            )?;
        }
        Ok(())
    }

    /// The direct convolution of one direction. Buffers by direction as the engines take
    /// them: forward `a = x`, `b = w`, `out = y`; backward-data `a = dy`, `b = w`,
    /// `out = dx`; backward-filter `a = dy`, `b = x`, `out = dw` (`O`: `T`, or f32 for the
    /// weight gradient only). `T` is bf16 or f16.
    #[allow(clippy::too_many_arguments)]
    pub fn direct<T: Float, O: Float>(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        shape: &ConvShape,
        layout: Layout,
        a: &DeviceBuffer<T>,
        b: &DeviceBuffer<T>,
        out: &DeviceBuffer<O>,
    ) -> Result<()> {
        let t = half_index("direct half-precision convolution", T::DTYPE)?;
        let wide = match (dir, O::DTYPE) {
            (_, o) if o == T::DTYPE => false,
            (ConvDir::BackwardFilter, Dtype::F32) => true,
            (_, o) => {
                return Err(NnError::Dtype {
                    what: "direct half-precision convolution: the output",
                    expected: "the inputs' type (or f32 for the weight gradient)",
                    found: o.name(),
                })
            }
        };
        let ints = direct_ints(shape, layout)?;
        let (x_len, w_len, y_len) = (shape.input_len()?, shape.weight_len()?, shape.output_len()?);
        let (f, out_len, cfg) = match dir {
            ConvDir::Forward => {
                need("conv2d x", a, x_len)?;
                need("conv2d w", b, w_len)?;
                need("conv2d y", out, y_len)?;
                (&self.fwd[t], y_len, grid_stride(y_len))
            }
            ConvDir::BackwardData => {
                need("conv2d dy", a, y_len)?;
                need("conv2d w", b, w_len)?;
                need("conv2d dx", out, x_len)?;
                (&self.bwd_data[t], x_len, grid_stride(x_len))
            }
            ConvDir::BackwardFilter => {
                need("conv2d dy", a, y_len)?;
                need("conv2d x", b, x_len)?;
                need("conv2d dw", out, w_len)?;
                // One warp per weight element.
                let threads = w_len
                    .checked_mul(32)
                    .ok_or_else(|| NnError::Shape(format!("conv2d dw: {w_len} warps overflow")))?;
                let f = &self.bwd_filter[if wide { 2 + t } else { t }];
                (f, w_len, grid_stride(threads))
            }
        };
        if out_len == 0 {
            return Ok(());
        }
        let mut args = vec![a.into(), b.into(), out.into()];
        args.extend(ints.iter().map(|&v| Arg::I32(v)));
        // SAFETY: the kernel is the instance for (dir, T, O) of `conv_lowp.cu`'s direct
        // kernels, whose parameters are (const T*, const T*, O*, then the 13 ints of
        // `direct_ints`), T 2 bytes and O 2 or 4 as its dtype; computed from those ints, it
        // reads the first input at activation (forward: x; backward: dy) indices below n·c·h·w
        // or n·oc·oh·ow, the second at indices below n·c·h·w (x) or oc·c·kh·kw (w) — every
        // input row and column checked against the image inside the kernel —, and writes the
        // output below its element count; each buffer holds the count of its role for this
        // shape (checked above, the same count in either layout). The ints fit the kernel's
        // int arithmetic (`direct_ints`); blocks are whole warps as the weight-gradient
        // kernel needs.
        unsafe {
            q.launch(f, cfg, &args)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extent::ConvGeom;

    fn shape(h: usize, pad: usize, dilation: usize) -> ConvShape {
        ConvShape::new(
            ConvGeom {
                n: 2,
                c: 3,
                h,
                w: h,
                oc: 5,
                kh: 3,
                kw: 3,
                stride: 2,
                pad,
            },
            dilation,
        )
    }

    #[test]
    fn direct_ints_follow_the_shape_and_refuse_what_an_int_cannot_hold() {
        let s = shape(11, 1, 2);
        let v = direct_ints(&s, Layout::Nhwc).unwrap();
        assert_eq!(v, [2, 3, 11, 11, 5, 3, 3, 5, 5, 2, 1, 2, 1]);
        assert_eq!(direct_ints(&s, Layout::Nchw).unwrap()[12], 0);
        assert!(direct_ints(&shape(i32::MAX as usize - 1, 1, 1), Layout::Nchw).is_err());
        assert!(
            direct_ints(&shape(11, 1, 9), Layout::Nchw).is_err(),
            "no output"
        );
    }

    #[test]
    fn grids_are_bounded_and_whole_warps() {
        assert_eq!(grid_stride(0).grid.0, 1);
        assert_eq!(grid_stride(257).grid.0, 2);
        assert_eq!(grid_stride(usize::MAX).grid.0 as usize, STRIDE_MAX_BLOCKS);
        assert_eq!(crate::kernels::STRIDE_BLOCK % 32, 0);
        assert!(half_index("t", Dtype::F32).is_err());
        assert_eq!(half_index("t", Dtype::F16).unwrap(), 1);
    }

    #[test]
    fn the_source_defines_every_kernel_loaded_and_no_include() {
        for name in [
            "lowp_transpose_bf16_bf16",
            "lowp_transpose_f16_f16",
            "lowp_transpose_bf16_f32",
            "lowp_transpose_f16_f32",
            "lowp_transpose_f32_f32",
            "lowp_bias_act_bf16",
            "lowp_bias_act8_bf16",
            "lowp_bias_act_f16",
            "lowp_bias_act8_f16",
            "lowp_pad_channels_bf16",
            "lowp_pad_channels_f16",
            "lowp_conv_fwd_bf16",
            "lowp_conv_fwd_f16",
            "lowp_conv_bwd_data_bf16",
            "lowp_conv_bwd_data_f16",
            "lowp_conv_bwd_filter_bf16_bf16",
            "lowp_conv_bwd_filter_f16_f16",
            "lowp_conv_bwd_filter_bf16_f32",
            "lowp_conv_bwd_filter_f16_f32",
        ] {
            assert!(
                source().contains(&format!("extern \"C\" __global__ void {name}(")),
                "{name}"
            );
        }
        assert!(!source().contains("#include"));
    }
}
