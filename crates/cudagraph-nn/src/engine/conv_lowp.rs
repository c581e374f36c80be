//! Convolutions in bf16 and f16 on tensor cores: forward (with its bias and a ReLU),
//! backward-data and backward-filter (the weight gradient in the inputs' type or in f32), in
//! `NCHW` or `NHWC`, with stride, padding and dilation — each run by the engine the registry
//! ([`crate::engine`]) measured fastest for its key. Products of 16-bit values are exact in
//! f32 and every sum is f32 (cuDNN's `PSEUDO_BFLOAT16`/`PSEUDO_HALF` configurations, as
//! PyTorch runs them); one rounding into the output's type. The f32 convolutions are
//! [`crate::engine::conv`]'s: these functions refuse f32 buffers with a typed error
//! (`NnError::Dtype`, naming the f32 function).
//!
//! **Candidates** ([`conv_lowp_candidates`]), per direction, shape, dtype, layout and
//! epilogue: cuDNN's legacy algorithms (`cudnn:A`) and graph-API configurations
//! (`cudnnv8:R`; a forward with a bias or ReLU also `cudnnv8+fused:R`, the epilogue inside
//! cuDNN's graph) in the caller's layout, the same in the *other* layout with the transposes
//! of inputs and output included in the run (so "NHWC with transposes" and "NCHW" are measured
//! as candidates of one key, and the faster wins), for a forward with fewer than 8 input
//! channels cuDNN's NHWC graph-API configurations on `x` and `w` padded with zero channels to
//! 4 and to 8 ([`PAD_CHANNELS`]: the channel groups tensor-core engines take, an image's three
//! channels included), our direct kernels (small shapes, and
//! whatever no cuDNN engine takes: a channel count no tensor-core engine aligns, cuDNN
//! missing), and for an f32 weight gradient `nchw:widen` — `x` and `dy` widened to f32
//! (exactly) and the f32 convolution's engine. An engine is named by the layout it computes in
//! and its kind: `nhwc:cudnnv8:3` under an `nchw` key is cuDNN's NHWC configuration 3 with
//! the transposes around it ([`LowpEngine`]).
//!
//! **Layouts.** Buffers are in the layout the caller names: `NCHW` (weights `OIHW`), PyTorch's
//! default, or `NHWC` (weights `OHWI`), PyTorch's `channels_last`. A caller holding `NCHW`
//! tensors never transposes anything itself: when NHWC is faster for a shape, the chosen
//! engine transposes inside the call (and its time includes that). [`faster_layout`] says which
//! layout the registry chose for a shape; [`relayout`] and [`relayout_weights`] convert
//! tensors for a caller that wants to keep them in `NHWC` between calls.
//!
//! **Bias and ReLU.** Forward only: `y = relu?(conv(x, w) + bias)`. The fused cuDNN engines
//! add the bias to the f32 sum and round once; the others round the convolution into `y`,
//! then add the bias and apply the ReLU in f32 and round again (our `bias_act` kernel).
//!
//! **Determinism, capture.** As for f32 ([`crate::engine`]): only deterministic candidates
//! unless the policy lifts it, measured on the first eager call per key, cuDNN's first choice
//! inside a capture for a key never measured; replays equal eager runs bit for bit.

use std::any::Any;
use std::fmt;
use std::str::FromStr;

use cudagraph::memory::{bf16, f16};
use cudagraph::{DeviceBuffer, Queue, QueueExt};

use super::catalog::Engine;
use super::conv::{conv2d_backward_filter, workspace_limit};
use crate::dtype::{Dtype, Float};
use crate::engine::{ConvFamily, Engines, Policy};
use crate::error::{NnError, Result};
pub use crate::extent::{ConvDir, ConvGeom, ConvShape, Layout};
use crate::ffi::cudnn_graph::CudnnGraph;
pub use crate::ffi::cudnn_graph::LowpOp;
use crate::kernels::conv_lowp::ConvLowpKernels;
use crate::kernels::Nn;

/// Above this many multiply-adds our direct kernels are not measured (unless forced, or no
/// other engine can run the convolution): one run would take tens of milliseconds.
const DIRECT_MAX_MACS: f64 = 2e9;

/// How a half-precision convolution runs, within a layout ([`LowpEngine`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LowpKind {
    /// cuDNN's legacy API with this `cudnnConvolution*Algo_t`; shown as `cudnn:A`.
    Cudnn(u32),
    /// cuDNN's graph API, configuration of this rank in the op's list (its epilogue, if any,
    /// after it by our kernel); shown as `cudnnv8:R`.
    CudnnGraph(u8),
    /// cuDNN's graph API running the forward with its bias and/or ReLU in one graph, this
    /// rank in the fused op's list; shown as `cudnnv8+fused:R`.
    CudnnGraphFused(u8),
    /// Our direct kernels (f32 sums); shown as `direct`.
    Direct,
    /// Weight gradient in f32 only: `x` and `dy` widened to f32 and the f32 convolution's
    /// engine (`crate::engine::conv`, NCHW, no dilation); shown as `widen`.
    Widen,
}

/// One concrete way to run a half-precision convolution: the layout it computes in (when it
/// is not the caller's, its run includes the transposes), the input channel count it pads to
/// (few-channel forwards only) and the engine there. Shown and stored as `LAYOUT:KIND`, e.g.
/// `nhwc:cudnnv8:2`, `nchw:cudnn:1`, `nchw:direct`, or `nhwc+c4:cudnnv8:3` for cuDNN's NHWC
/// configuration 3 on the input and weights padded with zero channels to 4.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LowpEngine {
    /// The layout the convolution itself runs in.
    pub layout: Layout,
    /// The engine there.
    pub kind: LowpKind,
    /// The input channels the convolution runs with ([`PAD_CHANNELS`]; 0: the op's own):
    /// `x` and `w` copied into NHWC scratch with zero channels added, which changes no sum
    /// (the products of the zeros are exact zeros). Forward only, `layout` NHWC.
    pub pad: u8,
}

/// The channel counts a forward with fewer input channels may be padded to: tensor-core
/// engines want channels in groups of 4 or 8 (cuDNN's first-layer engines for images take
/// exactly 4). Measured like every candidate; on the H100 the f16 7×7 stride-2 forward of
/// 3-channel 224² images runs cuDNN's first-layer kernel only with 4 channels (21 µs at batch
/// 8 against 54 with 3), which PyTorch's cuDNN reaches by padding inside its own transpose.
pub const PAD_CHANNELS: [usize; 2] = [4, 8];

impl LowpEngine {
    /// `kind` in `layout`, on the op's own channels.
    pub fn new(layout: Layout, kind: LowpKind) -> LowpEngine {
        LowpEngine {
            layout,
            kind,
            pad: 0,
        }
    }

    /// Whether it runs on cuDNN (either API).
    pub fn is_cudnn(self) -> bool {
        matches!(
            self.kind,
            LowpKind::Cudnn(_) | LowpKind::CudnnGraph(_) | LowpKind::CudnnGraphFused(_)
        )
    }
}

impl fmt::Display for LowpEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.layout)?;
        if self.pad > 0 {
            write!(f, "+c{}", self.pad)?;
        }
        write!(f, ":")?;
        match self.kind {
            LowpKind::Cudnn(a) => write!(f, "cudnn:{a}"),
            LowpKind::CudnnGraph(r) => write!(f, "cudnnv8:{r}"),
            LowpKind::CudnnGraphFused(r) => write!(f, "cudnnv8+fused:{r}"),
            LowpKind::Direct => write!(f, "direct"),
            LowpKind::Widen => write!(f, "widen"),
        }
    }
}

impl FromStr for LowpEngine {
    type Err = NnError;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || NnError::Config(format!("{s:?} is not a half-precision convolution engine"));
        let (layout, kind) = s.split_once(':').ok_or_else(bad)?;
        // Only canonical decimals, so that a name prints back as itself.
        fn num<N: FromStr + ToString>(v: &str) -> Option<N> {
            let n: N = v.parse().ok()?;
            (n.to_string() == v).then_some(n)
        }
        let (layout, pad) = match layout {
            "nchw" => (Layout::Nchw, 0),
            "nhwc" => (Layout::Nhwc, 0),
            _ => match layout.strip_prefix("nhwc+c").and_then(num::<u8>) {
                Some(c) if PAD_CHANNELS.contains(&(c as usize)) => (Layout::Nhwc, c),
                _ => return Err(bad()),
            },
        };
        let kind = match kind.split_once(':') {
            None if kind == "direct" => LowpKind::Direct,
            None if kind == "widen" => LowpKind::Widen,
            Some(("cudnn", a)) => LowpKind::Cudnn(num(a).ok_or_else(bad)?),
            Some(("cudnnv8", r)) => LowpKind::CudnnGraph(num(r).ok_or_else(bad)?),
            Some(("cudnnv8+fused", r)) => LowpKind::CudnnGraphFused(num(r).ok_or_else(bad)?),
            _ => return Err(bad()),
        };
        if pad > 0 && !matches!(kind, LowpKind::CudnnGraph(_) | LowpKind::CudnnGraphFused(_)) {
            return Err(bad());
        }
        Ok(LowpEngine { layout, kind, pad })
    }
}

impl Engine for LowpEngine {}

/// The buffers of one direction, as the f32 path's `ConvIo`: forward `a = x`, `b = w`,
/// `out = y` (+ `bias`); backward-data `a = dy`, `b = w`, `out = dx`; backward-filter
/// `a = dy`, `b = x`, `out = dw`. Inputs are `T` (bf16 or f16); the output is `T`, or f32 for
/// a weight gradient asked in f32 ([`LowpOp::out_f32`]).
pub struct LowpIo<'a, T: Float, O: Float> {
    /// First input: `x` (forward) or `dy`.
    pub a: &'a DeviceBuffer<T>,
    /// Second input: `w`, or `x` (backward-filter).
    pub b: &'a DeviceBuffer<T>,
    /// Output: `y`, `dx` or `dw`.
    pub out: &'a DeviceBuffer<O>,
    /// Forward only: `oc` elements.
    pub bias: Option<&'a DeviceBuffer<T>>,
}

impl<T: Float, O: Float> Clone for LowpIo<'_, T, O> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: Float, O: Float> Copy for LowpIo<'_, T, O> {}

/// The registry key of a half-precision convolution (without the policy's scope), e.g.
/// `conv_fwd bf16 n=32 c=64 h=56 w=56 oc=64 k=3x3 s=1 p=1 d=1 nchw bias relu` (`dw=f32` for
/// a weight gradient in f32).
pub fn conv_lowp_key(op: &LowpOp) -> String {
    let g = &op.shape.geom;
    format!(
        "{} {} n={} c={} h={} w={} oc={} k={}x{} s={} p={} d={} {}{}{}{}",
        op.dir.name(),
        op.dtype,
        g.n,
        g.c,
        g.h,
        g.w,
        g.oc,
        g.kh,
        g.kw,
        g.stride,
        g.pad,
        op.shape.dilation,
        op.layout,
        if op.bias { " bias" } else { "" },
        if op.relu { " relu" } else { "" },
        if op.out_f32 { " dw=f32" } else { "" },
    )
}

/// `T` must be bf16 or f16: f32 is a typed error, `what` naming the f32 path.
fn half_only<T: Float>(what: &'static str) -> Result<()> {
    if T::DTYPE == Dtype::F32 {
        return Err(NnError::Dtype {
            what,
            expected: "bf16 or f16",
            found: "f32",
        });
    }
    Ok(())
}

/// `op` describes buffers of `T` and `O` (and a bias exactly when it has one): a typed error
/// otherwise.
fn check_op<T: Float, O: Float>(op: &LowpOp, bias: bool) -> Result<()> {
    half_only::<T>("conv2d_lowp (f32 convolutions: engine::conv::run_conv)")?;
    if op.dtype != T::DTYPE {
        return Err(NnError::Dtype {
            what: "conv2d_lowp: an input",
            expected: op.dtype.name(),
            found: T::DTYPE.name(),
        });
    }
    let out = if op.out_f32 { Dtype::F32 } else { op.dtype };
    if O::DTYPE != out {
        return Err(NnError::Dtype {
            what: "conv2d_lowp: the output (f32 only for a weight gradient with out_f32)",
            expected: out.name(),
            found: O::DTYPE.name(),
        });
    }
    if op.out_f32 && op.dir != ConvDir::BackwardFilter {
        return Err(NnError::Shape(format!(
            "{}: only the weight gradient may be written in f32",
            op.dir.name()
        )));
    }
    if (op.bias || op.relu) && op.dir != ConvDir::Forward {
        return Err(NnError::Shape(format!(
            "{}: a bias or ReLU applies only to the forward direction",
            op.dir.name()
        )));
    }
    if bias != op.bias {
        return Err(NnError::Shape(format!(
            "{}: the op says bias = {}, but a bias buffer was {}",
            op.dir.name(),
            op.bias,
            if bias { "given" } else { "not given" }
        )));
    }
    Ok(())
}

/// `y = relu?(conv(x, w) + bias)` in bf16 or f16 (`T`; f32 is a typed error) with the
/// registry's engine for the key; returns it. `x`, `w`, `y` in `layout` (`NHWC`: weights
/// `OHWI`); `bias` has `oc` elements.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_lowp_forward<T: Float>(
    q: &dyn Queue,
    nn: &Nn,
    shape: &ConvShape,
    layout: Layout,
    x: &DeviceBuffer<T>,
    w: &DeviceBuffer<T>,
    bias: Option<&DeviceBuffer<T>>,
    relu: bool,
    y: &DeviceBuffer<T>,
) -> Result<LowpEngine> {
    half_only::<T>("conv2d_lowp_forward (f32: engine::conv::conv2d_forward)")?;
    let op = LowpOp {
        dir: ConvDir::Forward,
        shape: *shape,
        dtype: T::DTYPE,
        layout,
        out_f32: false,
        bias: bias.is_some(),
        relu,
    };
    let io = LowpIo {
        a: x,
        b: w,
        out: y,
        bias,
    };
    run_conv_lowp(q, nn, &op, io)
}

/// `dx` of a bf16/f16 convolution from `dy` and `w` (in `layout`), with the registry's engine.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_lowp_backward_data<T: Float>(
    q: &dyn Queue,
    nn: &Nn,
    shape: &ConvShape,
    layout: Layout,
    dy: &DeviceBuffer<T>,
    w: &DeviceBuffer<T>,
    dx: &DeviceBuffer<T>,
) -> Result<LowpEngine> {
    half_only::<T>("conv2d_lowp_backward_data (f32: engine::conv::conv2d_backward_data)")?;
    run_backward(q, nn, ConvDir::BackwardData, shape, layout, dy, w, dx)
}

/// `dw` (in `T`) of a bf16/f16 convolution from `dy` and `x` (in `layout`; `dw` `OIHW` or
/// `OHWI` to match), with the registry's engine.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_lowp_backward_filter<T: Float>(
    q: &dyn Queue,
    nn: &Nn,
    shape: &ConvShape,
    layout: Layout,
    dy: &DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
    dw: &DeviceBuffer<T>,
) -> Result<LowpEngine> {
    half_only::<T>("conv2d_lowp_backward_filter (f32: engine::conv::conv2d_backward_filter)")?;
    run_backward(q, nn, ConvDir::BackwardFilter, shape, layout, dy, x, dw)
}

/// `dw` in f32 from bf16/f16 `dy` and `x` (in `layout`): the f32 sum written without a
/// 16-bit rounding (for f32 master weights), with the registry's engine — cuDNN's graph API
/// where it has an engine for this type mix, the inputs widened to f32 and the f32
/// convolution, or our direct kernel.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_lowp_backward_filter_f32<T: Float>(
    q: &dyn Queue,
    nn: &Nn,
    shape: &ConvShape,
    layout: Layout,
    dy: &DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
    dw: &DeviceBuffer<f32>,
) -> Result<LowpEngine> {
    half_only::<T>(
        "conv2d_lowp_backward_filter_f32 (f32 inputs: engine::conv::conv2d_backward_filter)",
    )?;
    run_backward(q, nn, ConvDir::BackwardFilter, shape, layout, dy, x, dw)
}

/// Runs the backward direction `dir` of `shape` (no bias, no ReLU) on the bf16/f16 inputs `a`
/// and `b` into `out`, with the registry's engine; returns it. An f32 `out` is the weight
/// gradient written in f32.
#[allow(clippy::too_many_arguments)]
fn run_backward<T: Float, O: Float>(
    q: &dyn Queue,
    nn: &Nn,
    dir: ConvDir,
    shape: &ConvShape,
    layout: Layout,
    a: &DeviceBuffer<T>,
    b: &DeviceBuffer<T>,
    out: &DeviceBuffer<O>,
) -> Result<LowpEngine> {
    let op = LowpOp {
        dir,
        shape: *shape,
        dtype: T::DTYPE,
        layout,
        out_f32: O::DTYPE == Dtype::F32,
        bias: false,
        relu: false,
    };
    let io = LowpIo {
        a,
        b,
        out,
        bias: None,
    };
    run_conv_lowp(q, nn, &op, io)
}

/// Runs `op` on `io` with the registry's engine for its key (measured on the first eager
/// call); returns the engine used. The buffers' types, lengths and device are checked first
/// (typed errors), whichever engine would run.
pub fn run_conv_lowp<T: Float, O: Float>(
    q: &dyn Queue,
    nn: &Nn,
    op: &LowpOp,
    io: LowpIo<'_, T, O>,
) -> Result<LowpEngine> {
    check_io(q, op, &io)?;
    let out_len = out_len(op)?;
    let direct = LowpEngine::new(op.layout, LowpKind::Direct);
    if out_len == 0 {
        return Ok(direct);
    }
    let eng = Engines::get(q.device())?;
    let policy = eng.policy();
    let key = format!("{}{}", conv_lowp_key(op), policy.conv_scope());
    if let Some(algo) = eng.lookup::<LowpEngine>(&key) {
        lowp_engine(q, nn, &eng, algo, op, io)?;
        return Ok(algo);
    }
    let candidates = conv_lowp_candidates(q, &eng, op, &policy)?;
    let default = default_lowp_engine(op, &candidates);
    let mut scratch: Option<DeviceBuffer<O>> = None;
    let chosen = eng.choose(q, &key, None, &candidates, default, &mut |q, algo| {
        if scratch.is_none() {
            scratch = Some(q.alloc::<O>(out_len)?);
        }
        let out = scratch.as_ref().expect("allocated above");
        lowp_engine(q, nn, &eng, algo, op, LowpIo { out, ..io })
    });
    let algo = match chosen {
        Ok(a) => a,
        // Every measured candidate failed (cuDNN listed what it then could not run): the
        // direct kernels, never measured for this shape, still can.
        Err(NnError::Library {
            library: "engine registry",
            ..
        }) if !candidates.contains(&direct) => direct,
        Err(e) => return Err(e),
    };
    lowp_engine(q, nn, &eng, algo, op, io)?;
    Ok(algo)
}

/// Runs `op` with exactly `algo` (no registry); errors when `algo` cannot run it here (cuDNN
/// missing or disabled, a configuration cuDNN does not offer for the op).
pub fn conv_lowp_with<T: Float, O: Float>(
    q: &dyn Queue,
    nn: &Nn,
    algo: LowpEngine,
    op: &LowpOp,
    io: LowpIo<'_, T, O>,
) -> Result<()> {
    check_io(q, op, &io)?;
    let eng = Engines::get(q.device())?;
    lowp_engine(q, nn, &eng, algo, op, io)
}

/// Which layout the registry runs an `NCHW` call of `dir` on `shape` in for `T` (bf16 or
/// f16): [`Layout::Nhwc`] when cuDNN in NHWC *with the transposes of inputs and output*
/// measured faster than every NCHW candidate. Measures the key on first use (eagerly, on
/// zero-filled scratch buffers from `q`); inside a capture the key's recorded choice, or the
/// heuristic default for a key never measured.
pub fn faster_layout<T: Float>(
    q: &dyn Queue,
    nn: &Nn,
    dir: ConvDir,
    shape: &ConvShape,
) -> Result<Layout> {
    half_only::<T>("faster_layout (f32 convolutions run NCHW: engine::conv)")?;
    let op = LowpOp {
        dir,
        shape: *shape,
        dtype: T::DTYPE,
        layout: Layout::Nchw,
        out_f32: false,
        bias: false,
        relu: false,
    };
    let (x, w, y) = (shape.input_len()?, shape.weight_len()?, shape.output_len()?);
    let (a, b, out) = match dir {
        ConvDir::Forward => (x, w, y),
        ConvDir::BackwardData => (y, w, x),
        ConvDir::BackwardFilter => (y, x, w),
    };
    let (a, b, out) = (
        q.alloc_zeroed::<T>(a)?,
        q.alloc_zeroed::<T>(b)?,
        q.alloc_zeroed::<T>(out)?,
    );
    let io = LowpIo {
        a: &a,
        b: &b,
        out: &out,
        bias: None,
    };
    Ok(run_conv_lowp(q, nn, &op, io)?.layout)
}

/// An activation `n × c × h × w` from layout `from` to `to` (`dst` may not be `src`; the same
/// layout copies). bf16 or f16.
pub fn relayout<T: Float>(
    q: &dyn Queue,
    (n, c, h, w): (usize, usize, usize, usize),
    from: Layout,
    to: Layout,
    src: &DeviceBuffer<T>,
    dst: &DeviceBuffer<T>,
) -> Result<()> {
    half_only::<T>("relayout")?;
    let hw = h
        .checked_mul(w)
        .ok_or_else(|| NnError::Shape(format!("relayout: {h}×{w} overflows")))?;
    ConvLowpKernels::get(q.device())?.relayout(q, (n, c, hw), from, to, src, dst)
}

/// Weights `oc × c × kh × kw` from `OIHW` (with [`Layout::Nchw`]) to `OHWI` (with
/// [`Layout::Nhwc`]) or back. bf16 or f16.
pub fn relayout_weights<T: Float>(
    q: &dyn Queue,
    (oc, c, kh, kw): (usize, usize, usize, usize),
    from: Layout,
    to: Layout,
    src: &DeviceBuffer<T>,
    dst: &DeviceBuffer<T>,
) -> Result<()> {
    half_only::<T>("relayout_weights")?;
    let k = ConvLowpKernels::get(q.device())?;
    let khw = kh
        .checked_mul(kw)
        .ok_or_else(|| NnError::Shape(format!("relayout_weights: {kh}×{kw} overflows")))?;
    weights(&k, q, (oc, c, khw), from, to, src, dst)
}

/// Weights from `from` to `to` as [`relayout_weights`] (any pair the transposes take).
fn weights<A: Float, B: Float>(
    k: &ConvLowpKernels,
    q: &dyn Queue,
    (oc, c, khw): (usize, usize, usize),
    from: Layout,
    to: Layout,
    src: &DeviceBuffer<A>,
    dst: &DeviceBuffer<B>,
) -> Result<()> {
    match (from, to) {
        (Layout::Nchw, Layout::Nhwc) => k.transpose(q, oc, c, khw, src, dst),
        (Layout::Nhwc, Layout::Nchw) => k.transpose(q, oc, khw, c, src, dst),
        // The same layout: a copy (converted).
        _ => {
            let len = crate::extent::prod("conv2d weights", &[oc, c, khw])?;
            k.relayout(q, (1, 1, len), from, to, src, dst)
        }
    }
}

/// The element count of the direction's output.
fn out_len(op: &LowpOp) -> Result<usize> {
    match op.dir {
        ConvDir::Forward => op.shape.output_len(),
        ConvDir::BackwardData => op.shape.input_len(),
        ConvDir::BackwardFilter => op.shape.weight_len(),
    }
}

/// Types, the op's consistency, every extent and the device of every buffer, before any
/// engine runs or is measured.
fn check_io<T: Float, O: Float>(q: &dyn Queue, op: &LowpOp, io: &LowpIo<'_, T, O>) -> Result<()> {
    check_op::<T, O>(op, io.bias.is_some())?;
    crate::extent::shape_roles(q, op.dir, &op.shape, (io.a, io.b, io.out), io.bias)?;
    Ok(())
}

/// The engines that can run `op` on this machine under `policy`: cuDNN's (legacy, graph API,
/// fused) in the op's layout, then in the other layout (with transposes), then ours. When the
/// policy's family has none, every available engine; when cuDNN has none either, the direct
/// kernels whatever the shape's size. Inside a capture, cuDNN is a candidate only if it was
/// opened before, and graph-API plans only if they were built before.
pub fn conv_lowp_candidates(
    q: &dyn Queue,
    eng: &Engines,
    op: &LowpOp,
    policy: &Policy,
) -> Result<Vec<LowpEngine>> {
    let collect = |fam: ConvFamily| -> Vec<LowpEngine> {
        let mut v = Vec::new();
        let cudnn_ok = matches!(fam, ConvFamily::Auto | ConvFamily::Cudnn)
            && crate::ffi::cudnn::supports_shape(&op.shape);
        let limit = workspace_limit(eng.device_info().total_memory);
        let det = policy.deterministic;
        // cuDNN's graph-API configurations for `lop` as engines made by `at`: the plain
        // convolution's, then, where the op has an epilogue, those with it fused.
        let graph_configs = |v: &mut Vec<LowpEngine>,
                             g: &CudnnGraph,
                             lop: &LowpOp,
                             at: &dyn Fn(LowpKind) -> LowpEngine| {
            let plain = LowpOp {
                bias: false,
                relu: false,
                ..*lop
            };
            for c in g.lowp_candidates(q, &plain, det, limit).unwrap_or_default() {
                v.push(at(LowpKind::CudnnGraph(c.rank)));
            }
            if op.bias || op.relu {
                for c in g.lowp_candidates(q, lop, det, limit).unwrap_or_default() {
                    v.push(at(LowpKind::CudnnGraphFused(c.rank)));
                }
            }
        };
        for layout in [op.layout, op.layout.other()] {
            if !cudnn_ok {
                break;
            }
            let at = |kind| LowpEngine::new(layout, kind);
            let lop = LowpOp { layout, ..*op };
            if !op.out_f32 {
                if let Some(c) = eng.cudnn_for(q) {
                    // A shape cuDNN cannot plan simply has no cuDNN candidate.
                    for a in c
                        .algos_lowp(op.dir, &op.shape, op.dtype, layout, det, limit)
                        .unwrap_or_default()
                    {
                        v.push(at(LowpKind::Cudnn(a.algo)));
                    }
                }
            }
            if let Some(g) = eng.cudnn_graph_for(q) {
                graph_configs(&mut v, g, &lop, &at);
            }
        }
        if cudnn_ok {
            for pad in padded_channels(op) {
                let Some(g) = eng.cudnn_graph_for(q) else {
                    break;
                };
                let Ok(padded) = padded_op(op, pad) else {
                    continue;
                };
                let at = |kind| LowpEngine {
                    layout: Layout::Nhwc,
                    kind,
                    pad: pad as u8,
                };
                graph_configs(&mut v, g, &padded, &at);
            }
        }
        let ours = matches!(
            fam,
            ConvFamily::Auto | ConvFamily::Ours | ConvFamily::Direct
        );
        let small =
            fam != ConvFamily::Auto || op.shape.macs().is_some_and(|m| m <= DIRECT_MAX_MACS);
        if ours && small {
            v.push(LowpEngine::new(op.layout, LowpKind::Direct));
        }
        if op.out_f32 && op.shape.dilation == 1 && fam == ConvFamily::Auto {
            v.push(LowpEngine::new(Layout::Nchw, LowpKind::Widen));
        }
        v
    };
    let mut v = collect(policy.conv);
    if v.is_empty() && policy.conv != ConvFamily::Auto {
        v = collect(ConvFamily::Auto);
    }
    if v.is_empty() {
        v.push(LowpEngine::new(op.layout, LowpKind::Direct));
    }
    Ok(v)
}

/// The channel counts of [`PAD_CHANNELS`] a forward of `op` may be padded to: those above its
/// input channels (none for a weight gradient, a data gradient, or 8 channels and more).
fn padded_channels(op: &LowpOp) -> impl Iterator<Item = usize> {
    let c = op.shape.geom.c;
    let forward = op.dir == ConvDir::Forward && !op.out_f32;
    PAD_CHANNELS.into_iter().filter(move |&p| forward && c < p)
}

/// `op` on `pad` input channels, in NHWC.
fn padded_op(op: &LowpOp, pad: usize) -> Result<LowpOp> {
    let mut shape = op.shape;
    shape.geom.c = pad;
    shape.input_len()?;
    shape.weight_len()?;
    Ok(LowpOp {
        shape,
        layout: Layout::Nhwc,
        ..*op
    })
}

/// The heuristic default among `candidates` (non-empty): cuDNN's first choice in the op's own
/// layout (legacy API, then graph API), then any cuDNN engine, then the first candidate.
pub fn default_lowp_engine(op: &LowpOp, candidates: &[LowpEngine]) -> LowpEngine {
    let own = |pred: fn(LowpKind) -> bool| {
        candidates
            .iter()
            .find(|e| e.layout == op.layout && pred(e.kind))
            .copied()
    };
    own(|k| matches!(k, LowpKind::Cudnn(_)))
        .or_else(|| own(|k| matches!(k, LowpKind::CudnnGraph(_))))
        .or_else(|| candidates.iter().find(|e| e.is_cudnn()).copied())
        .or_else(|| candidates.first().copied())
        .unwrap_or(LowpEngine::new(op.layout, LowpKind::Direct))
}

/// `b` as a buffer of `B` when `A` is `B`.
fn same<A: Float, B: Float>(b: &DeviceBuffer<A>) -> Option<&DeviceBuffer<B>> {
    (b as &dyn Any).downcast_ref::<DeviceBuffer<B>>()
}

/// cuDNN's legacy API, or why it cannot run here.
fn cudnn(eng: &Engines) -> Result<&crate::ffi::cudnn::Cudnn> {
    eng.cudnn().ok_or_else(|| NnError::Library {
        library: "cuDNN",
        call: "dlopen",
        status: "unavailable (missing, or disabled by the engine policy)".into(),
    })
}

/// cuDNN's graph API, or why it cannot run here.
fn cudnn_graph(eng: &Engines) -> Result<&crate::ffi::cudnn_graph::CudnnGraph> {
    eng.cudnn_graph().ok_or_else(|| NnError::Library {
        library: "cuDNN graph API",
        call: "dlopen",
        status: "unavailable (missing, older than 9, or disabled by the engine policy)".into(),
    })
}

/// Runs `op` with exactly `algo`; the buffers were checked ([`check_io`]).
fn lowp_engine<T: Float, O: Float>(
    q: &dyn Queue,
    nn: &Nn,
    eng: &Engines,
    algo: LowpEngine,
    op: &LowpOp,
    io: LowpIo<'_, T, O>,
) -> Result<()> {
    let k = ConvLowpKernels::get(q.device())?;
    match algo.kind {
        LowpKind::Widen => return widen(q, nn, &k, op, io),
        LowpKind::Direct if algo.layout != op.layout => {
            return Err(NnError::Shape(format!(
                "{}: {algo} runs only in the call's own layout",
                conv_lowp_key(op)
            )))
        }
        _ => {}
    }
    if algo.pad > 0 {
        return padded(q, eng, &k, algo, op, io);
    }
    if algo.layout == op.layout {
        return in_layout(q, eng, &k, algo, op, io);
    }
    // In the other layout: inputs transposed into scratch, the output computed into scratch
    // and transposed back (its epilogue, if any, applied there first).
    let g = &op.shape.geom;
    let (oh, ow) = op.shape.out_hw()?;
    let x_dims = (g.n, g.c, g.h * g.w);
    let y_dims = (g.n, g.oc, oh * ow);
    let w_dims = (g.oc, g.c, g.kh * g.kw);
    let (from, to) = (op.layout, algo.layout);
    let a = q.alloc::<T>(match op.dir {
        ConvDir::Forward => op.shape.input_len()?,
        _ => op.shape.output_len()?,
    })?;
    let b = q.alloc::<T>(match op.dir {
        ConvDir::BackwardFilter => op.shape.input_len()?,
        _ => op.shape.weight_len()?,
    })?;
    let out = q.alloc::<O>(out_len(op)?)?;
    match op.dir {
        ConvDir::Forward => {
            k.relayout(q, x_dims, from, to, io.a, &a)?;
            weights(&k, q, w_dims, from, to, io.b, &b)?;
        }
        ConvDir::BackwardData => {
            k.relayout(q, y_dims, from, to, io.a, &a)?;
            weights(&k, q, w_dims, from, to, io.b, &b)?;
        }
        ConvDir::BackwardFilter => {
            k.relayout(q, y_dims, from, to, io.a, &a)?;
            k.relayout(q, x_dims, from, to, io.b, &b)?;
        }
    }
    let there = LowpOp { layout: to, ..*op };
    let inner = LowpIo {
        a: &a,
        b: &b,
        out: &out,
        bias: io.bias,
    };
    in_layout(q, eng, &k, algo, &there, inner)?;
    match op.dir {
        ConvDir::Forward => k.relayout(q, y_dims, to, from, &out, io.out),
        ConvDir::BackwardData => k.relayout(q, x_dims, to, from, &out, io.out),
        ConvDir::BackwardFilter => weights(&k, q, w_dims, to, from, &out, io.out),
    }
}

/// Runs a forward `op` with a padded-channel engine (`algo.pad > 0`): `x` and `w` copied
/// into NHWC scratch with zero channels up to `algo.pad`, the convolution there (into the
/// caller's output when it is NHWC, else into scratch transposed back), its epilogue in NHWC.
fn padded<T: Float, O: Float>(
    q: &dyn Queue,
    eng: &Engines,
    k: &ConvLowpKernels,
    algo: LowpEngine,
    op: &LowpOp,
    io: LowpIo<'_, T, O>,
) -> Result<()> {
    let pad = algo.pad as usize;
    if !padded_channels(op).any(|p| p == pad) || algo.layout != Layout::Nhwc {
        return Err(NnError::Shape(format!(
            "{}: {algo} runs only a forward with fewer than {pad} input channels",
            conv_lowp_key(op)
        )));
    }
    let there = padded_op(op, pad)?;
    let g = &op.shape.geom;
    let (oh, ow) = op.shape.out_hw()?;
    let a = q.alloc::<T>(there.shape.input_len()?)?;
    let b = q.alloc::<T>(there.shape.weight_len()?)?;
    k.pad_channels(q, (g.n, g.c, g.h * g.w), pad, op.layout, io.a, &a)?;
    k.pad_channels(q, (g.oc, g.c, g.kh * g.kw), pad, op.layout, io.b, &b)?;
    let inner = LowpEngine::new(Layout::Nhwc, algo.kind);
    if op.layout == Layout::Nhwc {
        let io = LowpIo {
            a: &a,
            b: &b,
            out: io.out,
            bias: io.bias,
        };
        return in_layout(q, eng, k, inner, &there, io);
    }
    let out = q.alloc::<O>(out_len(op)?)?;
    let scratch = LowpIo {
        a: &a,
        b: &b,
        out: &out,
        bias: io.bias,
    };
    in_layout(q, eng, k, inner, &there, scratch)?;
    k.relayout(
        q,
        (g.n, g.oc, oh * ow),
        Layout::Nhwc,
        op.layout,
        &out,
        io.out,
    )
}

/// Runs `op` with `algo` in the op's own layout (`algo.layout == op.layout`), then the
/// forward's epilogue when the engine did not fuse it.
fn in_layout<T: Float, O: Float>(
    q: &dyn Queue,
    eng: &Engines,
    k: &ConvLowpKernels,
    algo: LowpEngine,
    op: &LowpOp,
    io: LowpIo<'_, T, O>,
) -> Result<()> {
    let plain = LowpOp {
        bias: false,
        relu: false,
        ..*op
    };
    match algo.kind {
        LowpKind::Cudnn(a) => {
            let out = same::<O, T>(io.out).ok_or_else(|| NnError::Dtype {
                what: "cuDNN's legacy half-precision convolution: the output",
                expected: T::DTYPE.name(),
                found: O::DTYPE.name(),
            })?;
            cudnn(eng)?.run_lowp(q, op.dir, a, &op.shape, op.layout, io.a, io.b, out)?;
        }
        LowpKind::CudnnGraph(rank) => {
            cudnn_graph(eng)?.run_lowp(q, &plain, rank, io.a, io.b, io.out, None)?;
        }
        LowpKind::CudnnGraphFused(rank) => {
            if !(op.bias || op.relu) {
                return Err(NnError::Shape(format!(
                    "{}: {algo} runs only a forward with a bias or ReLU",
                    conv_lowp_key(op)
                )));
            }
            return cudnn_graph(eng)?.run_lowp(q, op, rank, io.a, io.b, io.out, io.bias);
        }
        LowpKind::Direct => k.direct(q, op.dir, &op.shape, op.layout, io.a, io.b, io.out)?,
        LowpKind::Widen => {
            return Err(NnError::Shape(format!(
                "{}: {algo} runs only an f32 weight gradient",
                conv_lowp_key(op)
            )))
        }
    }
    if op.dir == ConvDir::Forward && (op.bias || op.relu) {
        let y = same::<O, T>(io.out).ok_or_else(|| NnError::Dtype {
            what: "conv2d_lowp: the forward's output",
            expected: T::DTYPE.name(),
            found: O::DTYPE.name(),
        })?;
        let (oh, ow) = op.shape.out_hw()?;
        let g = &op.shape.geom;
        k.bias_act(q, (g.n, g.oc, oh * ow), op.layout, y, io.bias, op.relu)?;
    }
    Ok(())
}

/// The f32 weight gradient through the f32 convolution: `x` and `dy` widened to f32 (exact)
/// in NCHW, the f32 engine's `dw` (`OIHW`), transposed to `OHWI` for an NHWC call.
fn widen<T: Float, O: Float>(
    q: &dyn Queue,
    nn: &Nn,
    k: &ConvLowpKernels,
    op: &LowpOp,
    io: LowpIo<'_, T, O>,
) -> Result<()> {
    let dw = match (op.dir, op.shape.dilation, same::<O, f32>(io.out)) {
        (ConvDir::BackwardFilter, 1, Some(dw)) => dw,
        _ => {
            return Err(NnError::Shape(format!(
                "{}: nchw:widen runs only an f32 weight gradient without dilation",
                conv_lowp_key(op)
            )))
        }
    };
    let g = &op.shape.geom;
    let (oh, ow) = op.shape.out_hw()?;
    let x32 = q.alloc::<f32>(op.shape.input_len()?)?;
    let dy32 = q.alloc::<f32>(op.shape.output_len()?)?;
    match op.layout {
        Layout::Nchw => {
            widen_flat(q, io.b, &x32)?;
            widen_flat(q, io.a, &dy32)?;
        }
        Layout::Nhwc => {
            k.relayout(
                q,
                (g.n, g.c, g.h * g.w),
                Layout::Nhwc,
                Layout::Nchw,
                io.b,
                &x32,
            )?;
            k.relayout(
                q,
                (g.n, g.oc, oh * ow),
                Layout::Nhwc,
                Layout::Nchw,
                io.a,
                &dy32,
            )?;
        }
    }
    match op.layout {
        Layout::Nchw => {
            conv2d_backward_filter(q, nn, g, &dy32, &x32, dw)?;
        }
        Layout::Nhwc => {
            let oihw = q.alloc::<f32>(op.shape.weight_len()?)?;
            conv2d_backward_filter(q, nn, g, &dy32, &x32, &oihw)?;
            let w_dims = (g.oc, g.c, g.kh * g.kw);
            weights(k, q, w_dims, Layout::Nchw, Layout::Nhwc, &oihw, dw)?;
        }
    }
    Ok(())
}

/// `dst = f32(src)` element by element (`kernels::cast`), for bf16 or f16 `src` of `dst`'s
/// length.
fn widen_flat<T: Float>(
    q: &dyn Queue,
    src: &DeviceBuffer<T>,
    dst: &DeviceBuffer<f32>,
) -> Result<()> {
    let n = dst.len();
    if src.len() < n {
        return Err(NnError::Core(cudagraph::Error::SizeMismatch {
            what: "conv2d widen",
            expected: n,
            got: src.len(),
        }));
    }
    // The casts need equal lengths: a view of the first n elements.
    let src = src.prefix(n)?;
    if let Some(s) = same::<T, bf16>(&src) {
        crate::kernels::cast::from_bf16(q, s, dst)
    } else if let Some(s) = same::<T, f16>(&src) {
        crate::kernels::cast::from_f16(q, s, dst)
    } else {
        Err(NnError::Dtype {
            what: "conv2d_lowp widen: an input",
            expected: "bf16 or f16",
            found: T::DTYPE.name(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(dir: ConvDir, layout: Layout) -> LowpOp {
        LowpOp {
            dir,
            shape: ConvShape::new(
                ConvGeom {
                    n: 32,
                    c: 64,
                    h: 56,
                    w: 56,
                    oc: 64,
                    kh: 3,
                    kw: 3,
                    stride: 1,
                    pad: 1,
                },
                1,
            ),
            dtype: Dtype::Bf16,
            layout,
            out_f32: false,
            bias: false,
            relu: false,
        }
    }

    #[test]
    fn engine_names_round_trip_and_nothing_close_parses() {
        for layout in Layout::ALL {
            for kind in [
                LowpKind::Cudnn(0),
                LowpKind::Cudnn(7),
                LowpKind::CudnnGraph(0),
                LowpKind::CudnnGraph(255),
                LowpKind::CudnnGraphFused(3),
                LowpKind::Direct,
                LowpKind::Widen,
            ] {
                let e = LowpEngine::new(layout, kind);
                assert_eq!(e.to_string().parse::<LowpEngine>().unwrap(), e, "{e}");
            }
        }
        assert_eq!(
            LowpEngine::new(Layout::Nhwc, LowpKind::CudnnGraphFused(2)).to_string(),
            "nhwc:cudnnv8+fused:2"
        );
        for pad in PAD_CHANNELS {
            for kind in [LowpKind::CudnnGraph(3), LowpKind::CudnnGraphFused(1)] {
                let e = LowpEngine {
                    layout: Layout::Nhwc,
                    kind,
                    pad: pad as u8,
                };
                assert_eq!(e.to_string().parse::<LowpEngine>().unwrap(), e, "{e}");
            }
        }
        assert_eq!(
            "nhwc+c4:cudnnv8:3".parse::<LowpEngine>().unwrap(),
            LowpEngine {
                layout: Layout::Nhwc,
                kind: LowpKind::CudnnGraph(3),
                pad: 4
            }
        );
        for bad in [
            "cudnn:1",
            "nchw",
            "nchw:",
            "nchw:cudnn",
            "nchw:cudnn:01",
            "nchw:cudnn:-1",
            "nchw:cudnnv8:256",
            "nchw:cudnnv8+bias:1",
            "NCHW:direct",
            "nhwc:direct:1",
            "chwn:direct",
            "nchw:igemm:64x64:1",
            "nchw+c4:cudnnv8:1",
            "nhwc+c3:cudnnv8:1",
            "nhwc+c04:cudnnv8:1",
            "nhwc+c4:cudnn:1",
            "nhwc+c8:direct",
            "nhwc+:cudnnv8:1",
        ] {
            assert!(bad.parse::<LowpEngine>().is_err(), "{bad}");
        }
        // Not an f32 engine name, nor the reverse: the two tables never confuse them.
        assert!("cudnnv8:1".parse::<LowpEngine>().is_err());
        assert!("nchw:cudnnv8:1"
            .parse::<crate::engine::ConvEngine>()
            .is_err());
    }

    #[test]
    fn keys_name_direction_dtype_shape_layout_and_epilogue() {
        let mut o = op(ConvDir::Forward, Layout::Nchw);
        assert_eq!(
            conv_lowp_key(&o),
            "conv_fwd bf16 n=32 c=64 h=56 w=56 oc=64 k=3x3 s=1 p=1 d=1 nchw"
        );
        o.bias = true;
        o.relu = true;
        o.dtype = Dtype::F16;
        o.layout = Layout::Nhwc;
        o.shape.dilation = 2;
        assert_eq!(
            conv_lowp_key(&o),
            "conv_fwd f16 n=32 c=64 h=56 w=56 oc=64 k=3x3 s=1 p=1 d=2 nhwc bias relu"
        );
        let mut f = op(ConvDir::BackwardFilter, Layout::Nchw);
        f.out_f32 = true;
        assert!(conv_lowp_key(&f).ends_with("nchw dw=f32"));
        // Every field that changes the work changes the key.
        let base = conv_lowp_key(&op(ConvDir::Forward, Layout::Nchw));
        assert_ne!(base, conv_lowp_key(&op(ConvDir::Forward, Layout::Nhwc)));
        assert_ne!(
            base,
            conv_lowp_key(&op(ConvDir::BackwardData, Layout::Nchw))
        );
        // The f32 path's keys never equal these.
        assert!(!base.starts_with(&crate::extent::conv_key(
            ConvDir::Forward,
            &op(ConvDir::Forward, Layout::Nchw).shape.geom,
            false
        )));
    }

    #[test]
    fn few_channel_forwards_pad_to_four_and_eight() {
        let with_c = |dir, c| {
            let mut o = op(dir, Layout::Nchw);
            o.shape.geom.c = c;
            o
        };
        let pads = |o: &LowpOp| padded_channels(o).collect::<Vec<_>>();
        assert_eq!(pads(&with_c(ConvDir::Forward, 3)), vec![4, 8]);
        assert_eq!(pads(&with_c(ConvDir::Forward, 4)), vec![8]);
        assert_eq!(pads(&with_c(ConvDir::Forward, 5)), vec![8]);
        assert!(pads(&with_c(ConvDir::Forward, 8)).is_empty());
        assert!(pads(&with_c(ConvDir::BackwardData, 3)).is_empty());
        assert!(pads(&with_c(ConvDir::BackwardFilter, 3)).is_empty());
        let o = padded_op(&with_c(ConvDir::Forward, 3), 4).unwrap();
        assert_eq!((o.shape.geom.c, o.layout), (4, Layout::Nhwc));
        assert_eq!(o.shape.geom.oc, 64);
    }

    #[test]
    fn the_default_is_cudnns_first_choice_in_the_calls_layout() {
        let o = op(ConvDir::Forward, Layout::Nchw);
        let at = LowpEngine::new;
        let cands = vec![
            at(Layout::Nchw, LowpKind::CudnnGraph(0)),
            at(Layout::Nhwc, LowpKind::Cudnn(1)),
            at(Layout::Nchw, LowpKind::Cudnn(6)),
            at(Layout::Nchw, LowpKind::Direct),
        ];
        assert_eq!(
            default_lowp_engine(&o, &cands),
            at(Layout::Nchw, LowpKind::Cudnn(6))
        );
        assert_eq!(
            default_lowp_engine(&o, &cands[..2]),
            at(Layout::Nchw, LowpKind::CudnnGraph(0))
        );
        assert_eq!(
            default_lowp_engine(&o, &cands[1..2]),
            at(Layout::Nhwc, LowpKind::Cudnn(1))
        );
        assert_eq!(
            default_lowp_engine(&o, &cands[3..]),
            at(Layout::Nchw, LowpKind::Direct)
        );
        assert_eq!(
            default_lowp_engine(&o, &[]),
            at(Layout::Nchw, LowpKind::Direct)
        );
    }

    #[test]
    fn ops_are_checked_against_the_buffers_types() {
        let o = op(ConvDir::Forward, Layout::Nchw);
        check_op::<bf16, bf16>(&o, false).unwrap();
        assert!(matches!(
            check_op::<f32, f32>(
                &LowpOp {
                    dtype: Dtype::F32,
                    ..o
                },
                false
            ),
            Err(NnError::Dtype { found: "f32", .. })
        ));
        assert!(matches!(
            check_op::<f16, f16>(&o, false),
            Err(NnError::Dtype {
                found: "f16",
                expected: "bf16",
                ..
            })
        ));
        assert!(
            check_op::<bf16, bf16>(&o, true).is_err(),
            "a bias the op does not have"
        );
        assert!(check_op::<bf16, f32>(&o, false).is_err(), "f32 y");
        let mut f = op(ConvDir::BackwardFilter, Layout::Nhwc);
        f.out_f32 = true;
        check_op::<bf16, f32>(&f, false).unwrap();
        assert!(check_op::<bf16, bf16>(&f, false).is_err());
        let mut d = op(ConvDir::BackwardData, Layout::Nchw);
        d.relu = true;
        assert!(
            check_op::<bf16, bf16>(&d, false).is_err(),
            "ReLU off the forward"
        );
        d.relu = false;
        d.out_f32 = true;
        assert!(check_op::<bf16, f32>(&d, false).is_err(), "f32 dx");
        let e = half_only::<f32>("conv2d_lowp_forward (f32: engine::conv::conv2d_forward)")
            .unwrap_err()
            .to_string();
        assert!(e.contains("engine::conv") && e.contains("f32"), "{e}");
    }
}
