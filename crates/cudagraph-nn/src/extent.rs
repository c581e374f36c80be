//! Buffer extents, checked before anything is launched: how many elements a buffer must hold
//! (`need`), products of dimensions without overflow (`prod`), a row-major product's
//! dimensions (`GemmDims`), and which device a buffer or library handle belongs to
//! (`on_device`, `handle_on_device`: the check every call into cuBLAS, cuBLASLt and cuDNN makes
//! before handing them a raw address; our own kernels get the same check from
//! `Queue::launch`). Below the library wrappers and our kernels, which check their buffers with
//! it.

use std::sync::Arc;

use cudagraph::memory::BlockRef;
use cudagraph::{DeviceBuffer, Queue};

use crate::error::{NnError, Result};

type Buf = DeviceBuffer<f32>;

/// `buf` must hold at least `need` elements.
pub(crate) fn need<T: cudagraph::Elem>(
    what: &'static str,
    buf: &DeviceBuffer<T>,
    need: usize,
) -> Result<()> {
    if buf.len() < need {
        return Err(NnError::Core(cudagraph::Error::SizeMismatch {
            what,
            expected: need,
            got: buf.len(),
        }));
    }
    Ok(())
}

/// Product of `dims` (checked).
pub(crate) fn prod(what: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter().try_fold(1usize, |acc, &d| {
        acc.checked_mul(d)
            .ok_or_else(|| NnError::Shape(format!("{what}: {dims:?} overflows")))
    })
}

/// Every block in `bufs` (named for the error) must be device memory of `q`'s device: the
/// libraries take raw addresses, and an address of another device's memory (or of host memory
/// from a CPU-test allocator) would fault there or write what it must not. The same refusals as
/// the core's own entry points: [`cudagraph::Error::WrongDevice`] for another device's buffer,
/// [`cudagraph::Error::NotSupported`] for a block that is not device memory.
pub(crate) fn on_device<'b>(
    q: &dyn Queue,
    bufs: impl IntoIterator<Item = (&'static str, &'b Arc<BlockRef>)>,
) -> Result<()> {
    let ordinal = q.device().ordinal();
    bufs.into_iter()
        .try_for_each(|(what, block)| block_on_device(ordinal, what, block))
}

/// [`on_device`] for a product's operands: A, B, C and the bias (or bias-gradient) vector, of
/// any element types (A and B of one, C and the vector of another, as in a half-precision
/// product with an f32 result).
pub(crate) fn gemm_on_device<T: cudagraph::Elem, O: cudagraph::Elem>(
    q: &dyn Queue,
    a: &DeviceBuffer<T>,
    b: &DeviceBuffer<T>,
    c: &DeviceBuffer<O>,
    vec: Option<&DeviceBuffer<O>>,
) -> Result<()> {
    let operands = [
        ("gemm A", a.block()),
        ("gemm B", b.block()),
        ("gemm C", c.block()),
    ];
    on_device(
        q,
        operands
            .into_iter()
            .chain(vec.map(|v| ("gemm bias", v.block()))),
    )
}

/// [`on_device`] for one block, against device `ordinal`.
pub(crate) fn block_on_device(ordinal: usize, what: &'static str, block: &BlockRef) -> Result<()> {
    owned_by(
        ordinal,
        what,
        block.device_ordinal(),
        block.is_device_memory(),
    )
}

/// A library handle bound to device `handle` (`what` names it: "cuBLAS handle") may only run
/// work on queues of that device: its context, plans and workspaces are that device's.
pub(crate) fn handle_on_device(q: &dyn Queue, what: &'static str, handle: usize) -> Result<()> {
    owned_by(q.device().ordinal(), what, handle, true)
}

/// `what`, which belongs to device `got` (and is device memory or not), may be used with device
/// `expected`.
fn owned_by(expected: usize, what: &'static str, got: usize, device_memory: bool) -> Result<()> {
    if got != expected {
        return Err(NnError::Core(cudagraph::Error::WrongDevice {
            what,
            expected,
            got,
        }));
    }
    if !device_memory {
        return Err(NnError::Core(cudagraph::Error::NotSupported {
            what: "a buffer from an allocator made with Allocator::new",
            detail: format!(
                "{what} is not device memory, and only device memory may be handed to a CUDA \
                 library; allocate device buffers with Queue::alloc"
            ),
        }));
    }
    Ok(())
}

/// A row-major product `C[m×n] = op(A)·op(B)`: op(A) is m×k (`ta`: A is stored k×m), op(B) is
/// k×n (`tb`: B is stored n×k).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmDims {
    /// Rows of C (and of op(A)).
    pub m: usize,
    /// Columns of C (and of op(B)).
    pub n: usize,
    /// The inner dimension: columns of op(A), rows of op(B).
    pub k: usize,
    /// Whether A is stored transposed (k×m).
    pub ta: bool,
    /// Whether B is stored transposed (n×k).
    pub tb: bool,
}

impl GemmDims {
    /// A, B and C (and the bias) hold the elements this product reads and writes.
    pub fn check_buffers(&self, a: &Buf, b: &Buf, c: &Buf, bias: Option<&Buf>) -> Result<()> {
        need("gemm A", a, prod("gemm A", &[self.m, self.k])?)?;
        need("gemm B", b, prod("gemm B", &[self.k, self.n])?)?;
        need("gemm C", c, prod("gemm C", &[self.m, self.n])?)?;
        if let Some(bias) = bias {
            need("gemm bias", bias, self.n)?;
        }
        Ok(())
    }

    pub(crate) fn tiles(&self) -> Result<(u32, u32)> {
        self.tiles_of(32, 32)
    }

    /// The grid of `bm`-row, `bn`-column output tiles: columns in x, rows in y (at most 65535).
    pub(crate) fn tiles_of(&self, bm: usize, bn: usize) -> Result<(u32, u32)> {
        let (gx, gy) = (self.n.div_ceil(bn), self.m.div_ceil(bm));
        if gy > 65535 {
            return Err(NnError::Shape(format!(
                "gemm: {} rows exceed the tiled kernels' grid",
                self.m
            )));
        }
        Ok((u32::try_from(gx).unwrap_or(u32::MAX), gy as u32))
    }
}

/// Geometry of a 2-D convolution (NCHW input, OIHW weights).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvGeom {
    /// Batch size.
    pub n: usize,
    /// Input channels.
    pub c: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels (filters).
    pub oc: usize,
    /// Kernel height.
    pub kh: usize,
    /// Kernel width.
    pub kw: usize,
    /// Stride, the same along both axes.
    pub stride: usize,
    /// Zero padding on each side, the same along both axes.
    pub pad: usize,
}

impl ConvGeom {
    /// A square image (`hw × hw`) and a square `k × k` kernel: `n` images of `c` channels to
    /// `oc`, with `stride` and `pad` on both axes.
    pub fn square(
        n: usize,
        c: usize,
        hw: usize,
        oc: usize,
        k: usize,
        stride: usize,
        pad: usize,
    ) -> Self {
        ConvGeom {
            n,
            c,
            h: hw,
            w: hw,
            oc,
            kh: k,
            kw: k,
            stride,
            pad,
        }
    }

    /// Output height and width; an error when the kernel does not fit the padded input.
    pub fn out_hw(&self) -> Result<(usize, usize)> {
        let ph = self.h.checked_add(2 * self.pad);
        let pw = self.w.checked_add(2 * self.pad);
        match (ph, pw) {
            (Some(ph), Some(pw)) if self.stride > 0 && ph >= self.kh && pw >= self.kw => Ok((
                (ph - self.kh) / self.stride + 1,
                (pw - self.kw) / self.stride + 1,
            )),
            _ => Err(NnError::Shape(format!(
                "conv2d: geometry {self:?} has no output"
            ))),
        }
    }

    /// Elements of the input, `n·c·h·w`; an error on overflow.
    pub fn input_len(&self) -> Result<usize> {
        prod("conv2d input", &[self.n, self.c, self.h, self.w])
    }

    /// Elements of the weights, `oc·c·kh·kw`; an error on overflow.
    pub fn weight_len(&self) -> Result<usize> {
        prod("conv2d weight", &[self.oc, self.c, self.kh, self.kw])
    }

    /// Elements of the output, `n·oc·oh·ow`; an error when there is no output or on overflow.
    pub fn output_len(&self) -> Result<usize> {
        let (oh, ow) = self.out_hw()?;
        prod("conv2d output", &[self.n, self.oc, oh, ow])
    }
}

/// Which product of a convolution: forward (`y` from `x`, `w`), backward-data (`dx` from `dy`,
/// `w`) or backward-filter (`dw` from `dy`, `x`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConvDir {
    /// `y` from `x` and `w`.
    Forward,
    /// `dx` from `dy` and `w`.
    BackwardData,
    /// `dw` from `dy` and `x`.
    BackwardFilter,
}

impl ConvDir {
    /// The three directions, forward first.
    pub const ALL: [ConvDir; 3] = [
        ConvDir::Forward,
        ConvDir::BackwardData,
        ConvDir::BackwardFilter,
    ];

    /// Short name used in engine keys: `conv_fwd`, `conv_bwd_data`, `conv_bwd_filter`.
    pub fn name(self) -> &'static str {
        match self {
            ConvDir::Forward => "conv_fwd",
            ConvDir::BackwardData => "conv_bwd_data",
            ConvDir::BackwardFilter => "conv_bwd_filter",
        }
    }

    pub(crate) fn index(self) -> usize {
        match self {
            ConvDir::Forward => 0,
            ConvDir::BackwardData => 1,
            ConvDir::BackwardFilter => 2,
        }
    }
}

/// The registry key of a convolution direction (without the policy's scope), e.g.
/// `conv_fwd n=8 c=3 h=32 w=32 oc=16 k=3x3 s=1 p=1 bias`.
pub fn conv_key(dir: ConvDir, g: &ConvGeom, bias: bool) -> String {
    format!(
        "{} n={} c={} h={} w={} oc={} k={}x{} s={} p={}{}",
        dir.name(),
        g.n,
        g.c,
        g.h,
        g.w,
        g.oc,
        g.kh,
        g.kw,
        g.stride,
        g.pad,
        if bias { " bias" } else { "" }
    )
}

/// A direction's buffers by role — input `x`, weights `w`, output `y` — from the order every
/// engine takes them in (forward `a = x`, `b = w`, `out = y`; backward-data `a = dy`, `b = w`,
/// `out = dx`; backward-filter `a = dy`, `b = x`, `out = dw`), after checking each against its
/// extent in `g` and the bias rule (forward only, `g.oc` elements).
pub fn conv_roles<'a>(
    dir: ConvDir,
    g: &ConvGeom,
    (a, b, out): (&'a Buf, &'a Buf, &'a Buf),
    bias: Option<&Buf>,
) -> Result<(&'a Buf, &'a Buf, &'a Buf)> {
    let (x_len, w_len, y_len) = (g.input_len()?, g.weight_len()?, g.output_len()?);
    let roles = match dir {
        ConvDir::Forward => {
            need("conv2d x", a, x_len)?;
            need("conv2d w", b, w_len)?;
            need("conv2d y", out, y_len)?;
            (a, b, out)
        }
        ConvDir::BackwardData => {
            need("conv2d dy", a, y_len)?;
            need("conv2d w", b, w_len)?;
            need("conv2d dx", out, x_len)?;
            (out, b, a)
        }
        ConvDir::BackwardFilter => {
            need("conv2d dy", a, y_len)?;
            need("conv2d x", b, x_len)?;
            need("conv2d dw", out, w_len)?;
            (b, out, a)
        }
    };
    match (dir, bias) {
        (ConvDir::Forward, Some(bias)) => need("conv2d bias", bias, g.oc)?,
        (_, Some(_)) => {
            return Err(NnError::Shape(format!(
                "{}: a bias only applies to the forward direction",
                dir.name()
            )))
        }
        _ => {}
    }
    Ok(roles)
}

/// A direction's buffers (in the engines' order, as [`conv_roles`]) and the forward bias must be
/// memory of `q`'s device: the check a cuDNN call makes before handing cuDNN their addresses
/// (our kernels get it from `Queue::launch`), each buffer named by its role in the error.
pub fn conv_on_device(
    q: &dyn Queue,
    dir: ConvDir,
    (a, b, out): (&Buf, &Buf, &Buf),
    bias: Option<&Buf>,
) -> Result<()> {
    let names = match dir {
        ConvDir::Forward => ["conv2d x", "conv2d w", "conv2d y"],
        ConvDir::BackwardData => ["conv2d dy", "conv2d w", "conv2d dx"],
        ConvDir::BackwardFilter => ["conv2d dy", "conv2d x", "conv2d dw"],
    };
    let bufs = [
        (names[0], a.block()),
        (names[1], b.block()),
        (names[2], out.block()),
    ];
    on_device(
        q,
        bufs.into_iter()
            .chain(bias.map(|v| ("conv2d bias", v.block()))),
    )
}

/// The largest power of two (at most 256) dividing every address: what the libraries may
/// assume of the pointers they get (our allocator's blocks start 256-byte aligned).
pub fn alignment(addrs: &[u64]) -> u32 {
    let all = addrs.iter().fold(256u64, |acc, &a| acc | a);
    (1u64 << all.trailing_zeros().min(8)) as u32
}

/// How a convolution's tensors are laid out in memory: activations `NCHW` (channels before
/// pixels, PyTorch's default) or `NHWC` (channels last: each pixel's channels adjacent), and
/// the weights to match — `OIHW` with `NCHW`, `OHWI` (cuDNN's `KRSC`) with `NHWC`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Activations `[n, c, h, w]`, weights `[oc, c, kh, kw]`.
    #[default]
    Nchw,
    /// Activations `[n, h, w, c]`, weights `[oc, kh, kw, c]`.
    Nhwc,
}

impl Layout {
    /// Both layouts, `NCHW` first.
    pub const ALL: [Layout; 2] = [Layout::Nchw, Layout::Nhwc];

    /// `"nchw"` or `"nhwc"` (as in registry keys and engine names).
    pub fn name(self) -> &'static str {
        match self {
            Layout::Nchw => "nchw",
            Layout::Nhwc => "nhwc",
        }
    }

    /// The other layout.
    pub fn other(self) -> Layout {
        match self {
            Layout::Nchw => Layout::Nhwc,
            Layout::Nhwc => Layout::Nchw,
        }
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Layout {
    type Err = NnError;
    fn from_str(s: &str) -> Result<Layout> {
        match s.trim().to_ascii_lowercase().as_str() {
            "nchw" => Ok(Layout::Nchw),
            "nhwc" => Ok(Layout::Nhwc),
            _ => Err(NnError::Config(format!(
                "{s:?} is not a layout; use nchw or nhwc"
            ))),
        }
    }
}

/// A convolution's geometry ([`ConvGeom`]) with its dilation: kernel taps `dilation` pixels
/// apart (1: adjacent, as [`ConvGeom`] alone describes), the same along both axes, as
/// PyTorch's `dilation`. The half-precision convolutions take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvShape {
    /// Sizes, stride and padding.
    pub geom: ConvGeom,
    /// Distance between kernel taps, at least 1.
    pub dilation: usize,
}

impl From<ConvGeom> for ConvShape {
    fn from(geom: ConvGeom) -> ConvShape {
        ConvShape { geom, dilation: 1 }
    }
}

impl ConvShape {
    /// `geom` with dilation `dilation`.
    pub fn new(geom: ConvGeom, dilation: usize) -> ConvShape {
        ConvShape { geom, dilation }
    }

    /// Height and width the dilated kernel spans: `dilation·(k − 1) + 1`.
    pub fn span(&self) -> Result<(usize, usize)> {
        let g = &self.geom;
        let span = |k: usize| {
            k.checked_sub(1)
                .and_then(|k1| k1.checked_mul(self.dilation))
                .and_then(|v| v.checked_add(1))
        };
        match (span(g.kh), span(g.kw)) {
            (Some(sh), Some(sw)) if self.dilation > 0 => Ok((sh, sw)),
            _ => Err(NnError::Shape(format!(
                "conv2d: geometry {self:?} has no kernel (a zero size or dilation)"
            ))),
        }
    }

    /// Output height and width; an error when the dilated kernel does not fit the padded
    /// input (or a size, the stride or the dilation is zero).
    pub fn out_hw(&self) -> Result<(usize, usize)> {
        let g = &self.geom;
        let (sh, sw) = self.span()?;
        let ph = g.pad.checked_mul(2).and_then(|p| g.h.checked_add(p));
        let pw = g.pad.checked_mul(2).and_then(|p| g.w.checked_add(p));
        match (ph, pw) {
            (Some(ph), Some(pw)) if g.stride > 0 && ph >= sh && pw >= sw => {
                Ok(((ph - sh) / g.stride + 1, (pw - sw) / g.stride + 1))
            }
            _ => Err(NnError::Shape(format!(
                "conv2d: geometry {self:?} has no output"
            ))),
        }
    }

    /// Elements of the input, `n·c·h·w` (either layout).
    pub fn input_len(&self) -> Result<usize> {
        self.geom.input_len()
    }

    /// Elements of the weights, `oc·c·kh·kw` (either layout).
    pub fn weight_len(&self) -> Result<usize> {
        self.geom.weight_len()
    }

    /// Elements of the output, `n·oc·oh·ow` (either layout).
    pub fn output_len(&self) -> Result<usize> {
        let (oh, ow) = self.out_hw()?;
        prod("conv2d output", &[self.geom.n, self.geom.oc, oh, ow])
    }

    /// Multiply-adds of one direction (the same for all three); `None` without an output.
    pub fn macs(&self) -> Option<f64> {
        let y = self.output_len().ok()? as f64;
        Some(y * (self.geom.c * self.geom.kh * self.geom.kw) as f64)
    }
}

/// One buffer of a convolution by role, after its extent was checked: what it is (for
/// errors), its address and its block.
#[derive(Clone, Copy)]
pub(crate) struct RoleBuf<'a> {
    pub(crate) what: &'static str,
    pub(crate) addr: u64,
    pub(crate) block: &'a Arc<BlockRef>,
}

impl<'a> RoleBuf<'a> {
    pub(crate) fn of<T: cudagraph::Elem>(
        what: &'static str,
        b: &'a DeviceBuffer<T>,
    ) -> RoleBuf<'a> {
        RoleBuf {
            what,
            addr: b.addr(),
            block: b.block(),
        }
    }
}

/// [`conv_roles`] for a [`ConvShape`] and buffers of any element types (inputs `T`, output
/// `O`): each checked against its extent (the same in both layouts), the bias (forward only)
/// against `oc`; returns `[x, w, y]` (`dx`, `dw`, `dy` by direction) and the bias, every one
/// checked to be memory of `q`'s device.
#[allow(clippy::type_complexity)]
pub(crate) fn shape_roles<'a, T: cudagraph::Elem, O: cudagraph::Elem>(
    q: &dyn Queue,
    dir: ConvDir,
    s: &ConvShape,
    (a, b, out): (
        &'a DeviceBuffer<T>,
        &'a DeviceBuffer<T>,
        &'a DeviceBuffer<O>,
    ),
    bias: Option<&'a DeviceBuffer<T>>,
) -> Result<([RoleBuf<'a>; 3], Option<RoleBuf<'a>>)> {
    let (x_len, w_len, y_len) = (s.input_len()?, s.weight_len()?, s.output_len()?);
    let roles = match dir {
        ConvDir::Forward => {
            need("conv2d x", a, x_len)?;
            need("conv2d w", b, w_len)?;
            need("conv2d y", out, y_len)?;
            [
                RoleBuf::of("conv2d x", a),
                RoleBuf::of("conv2d w", b),
                RoleBuf::of("conv2d y", out),
            ]
        }
        ConvDir::BackwardData => {
            need("conv2d dy", a, y_len)?;
            need("conv2d w", b, w_len)?;
            need("conv2d dx", out, x_len)?;
            [
                RoleBuf::of("conv2d dx", out),
                RoleBuf::of("conv2d w", b),
                RoleBuf::of("conv2d dy", a),
            ]
        }
        ConvDir::BackwardFilter => {
            need("conv2d dy", a, y_len)?;
            need("conv2d x", b, x_len)?;
            need("conv2d dw", out, w_len)?;
            [
                RoleBuf::of("conv2d x", b),
                RoleBuf::of("conv2d dw", out),
                RoleBuf::of("conv2d dy", a),
            ]
        }
    };
    let bias = match (dir, bias) {
        (ConvDir::Forward, Some(bias)) => {
            need("conv2d bias", bias, s.geom.oc)?;
            Some(RoleBuf::of("conv2d bias", bias))
        }
        (_, Some(_)) => {
            return Err(NnError::Shape(format!(
                "{}: a bias only applies to the forward direction",
                dir.name()
            )))
        }
        (_, None) => None,
    };
    on_device(
        q,
        roles.iter().chain(bias.as_ref()).map(|r| (r.what, r.block)),
    )?;
    Ok((roles, bias))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_devices_buffer_or_handle_is_a_wrong_device_error_naming_both_devices() {
        let e = owned_by(0, "gemm A", 1, true).unwrap_err();
        assert!(
            matches!(
                e,
                NnError::Core(cudagraph::Error::WrongDevice {
                    what: "gemm A",
                    expected: 0,
                    got: 1
                })
            ),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "gemm A belongs to device 1, but was used with device 0"
        );
        // The device is checked first: host memory of another ordinal is still "another device".
        assert!(matches!(
            owned_by(2, "cuDNN workspace", 0, false),
            Err(NnError::Core(cudagraph::Error::WrongDevice {
                expected: 2,
                got: 0,
                ..
            }))
        ));
    }

    #[test]
    fn memory_that_is_not_device_memory_is_refused_even_on_the_right_ordinal() {
        let e = owned_by(0, "conv2d x", 0, false).unwrap_err();
        assert!(
            matches!(e, NnError::Core(cudagraph::Error::NotSupported { .. })),
            "{e}"
        );
        assert!(
            e.to_string().contains("conv2d x is not device memory"),
            "{e}"
        );
    }

    #[test]
    fn device_memory_of_the_queues_device_passes() {
        owned_by(0, "gemm C", 0, true).unwrap();
        owned_by(3, "cuBLAS handle", 3, true).unwrap();
    }

    #[test]
    fn alignment_is_the_common_power_of_two() {
        assert_eq!(alignment(&[0x1000, 0x2200]), 256);
        assert_eq!(alignment(&[0x1000, 0x2210]), 16);
        assert_eq!(alignment(&[0x1004]), 4);
        assert_eq!(alignment(&[]), 256);
    }

    #[test]
    fn dilated_shapes_span_and_output() {
        let g = ConvGeom {
            n: 2,
            c: 3,
            h: 11,
            w: 13,
            oc: 5,
            kh: 3,
            kw: 3,
            stride: 2,
            pad: 1,
        };
        let plain = ConvShape::from(g);
        assert_eq!(plain.out_hw().unwrap(), g.out_hw().unwrap());
        let d2 = ConvShape::new(g, 2);
        assert_eq!(d2.span().unwrap(), (5, 5));
        // (11 + 2 - 5) / 2 + 1 = 5, (13 + 2 - 5) / 2 + 1 = 6.
        assert_eq!(d2.out_hw().unwrap(), (5, 6));
        assert_eq!(d2.output_len().unwrap(), 2 * 5 * 5 * 6);
        assert!(ConvShape::new(g, 0).out_hw().is_err());
        assert!(
            ConvShape::new(g, 7).out_hw().is_err(),
            "span 15 > 13 padded"
        );
        assert!(ConvShape::new(g, usize::MAX).out_hw().is_err());
        assert!(ConvShape::new(ConvGeom { kh: 0, ..g }, 1).out_hw().is_err());
        assert_eq!("NHWC".parse::<Layout>().unwrap(), Layout::Nhwc);
        assert!("chwn".parse::<Layout>().is_err());
        for l in Layout::ALL {
            assert_eq!(l.name().parse::<Layout>().unwrap(), l);
            assert_eq!(l.other().other(), l);
        }
    }
}
