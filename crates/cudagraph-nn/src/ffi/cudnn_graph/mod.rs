//! cuDNN's graph (backend) API for convolutions (NCHW fp32): every engine and knob configuration
//! cuDNN's heuristics offer for one direction — the API PyTorch 2.x reaches through
//! cudnn-frontend —, as engine-registry candidates beside the legacy algorithms of
//! [`crate::ffi::cudnn`].
//!
//! The library is the one [`crate::ffi::cudnn`] loads (its sub-libraries checked first); the backend
//! functions are looked up here with their C signatures, and every value cuDNN returns is read
//! as a raw integer (descriptor types, attribute names and types, notes, status codes), so a
//! newer cuDNN cannot produce an invalid Rust enum. Without cuDNN 9 or its backend symbols
//! there are simply no candidates (one notice at most).
//!
//! Per (direction, geometry, byte alignment) the operation graph is built once; cuDNN's
//! `INSTANT` and `FALLBACK` heuristic lists are joined in that order, configurations that are
//! not plain fp32 FMA (tensor cores/TF32, down-converted inputs, reduced-precision reduction)
//! are dropped, duplicates (same engine and knob choices) removed. A configuration's *rank* is
//! its position in that list, whatever the determinism policy, so `cudnnv8:RANK` names the same
//! configuration under every policy. Execution plans are finalized in rank order, eagerly (never
//! inside a capture), until [`CAP`] deterministic ones are built; the candidates are the first
//! [`CAP`] built plans the policy allows. Running a plan only enqueues work on the caller's
//! stream: the variant pack is host-side, the workspace comes from the caller's queue
//! (`QueueExt::alloc`, the graph's pool inside a capture) — so it can be captured.
//!
//! A forward convolution with a bias also has a fused set: an operation graph of the
//! convolution into a virtual tensor followed by a pointwise ADD of the bias (`[1, K, 1, 1]`,
//! broadcast) into `y`, so the forward with its bias is one cuDNN execution
//! (`cudnnv8+bias:RANK`). Its configurations are filtered, ranked and built the same way, at
//! most [`FUSED_CAP`] per key; where cuDNN offers no plain-fp32 engine for it (runtime-fusion
//! engines missing, or all TF32) there are simply no fused candidates.
//!
//! **Half precision** ([`LowpOp`]: [`CudnnGraph::lowp_candidates`], [`CudnnGraph::run_lowp`]):
//! x, w and y in bf16 or f16 with an fp32 compute type (cuDNN's `PSEUDO_BFLOAT16` and
//! `PSEUDO_HALF` configurations, PyTorch's choice for these types), tensors `NCHW` or `NHWC`
//! (filters `KRSC`), any dilation; the weight gradient may also be written in fp32 from 16-bit
//! `x` and `dy` (where cuDNN has an engine for that mix; otherwise the list is empty). Engines
//! with tensor cores are admitted, those that down-convert inputs or reduce in reduced
//! precision are not. A forward may fuse its bias and a ReLU: convolution into a virtual fp32
//! tensor, the bias added and the ReLU applied in fp32, one rounding into `y`
//! (`[1, K, 1, 1]` bias of the input type). Each (op, alignment) has its own plan set, listed,
//! built and ranked as the fp32 ones.

use std::collections::HashMap;
use std::sync::Mutex;

use cudagraph::runtime::{with_relaxed_capture, Context};
use cudagraph::{DeviceBuffer, Queue, QueueExt};

use super::loader::{check, describe, Ptr, SUCCESS};
use crate::dtype::{Dtype, Float};
use crate::error::{NnError, Result};
use crate::extent::{
    alignment, conv_key, conv_on_device, conv_roles, handle_on_device, on_device, shape_roles,
    ConvDir, ConvGeom, ConvShape, Layout, RoleBuf,
};

mod backend;
mod plans;

use backend::*;
use plans::*;

pub(super) const LIBRARY: &str = "cuDNN graph API";
const NOT_BUILT: &str = "no plan was built before the capture (run it eagerly first)";

/// At most this many candidates per key (the first built plans in heuristic order), so that
/// measuring them stays fast: as many as PyTorch's benchmark times (`cudnn.benchmark_limit`,
/// 10).
pub const CAP: usize = 10;

/// At most this many fused convolution + bias candidates per key (their engines may compile
/// at run time, when the set is built).
pub const FUSED_CAP: usize = 4;

/// The largest byte alignment a plan is built for (cudnn-frontend's and PyTorch's too).
pub const MAX_ALIGN: u32 = 16;

/// The alignment candidates are listed for: our buffers start at the start of an allocator
/// block (256-byte aligned), so every pointer a convolution gets has [`MAX_ALIGN`]. `run`
/// computes it from the actual pointers all the same (and builds plans for it when eager).
const LIST_ALIGN: u32 = MAX_ALIGN;

/// The byte alignment every pointer has, at most [`MAX_ALIGN`] (null counts as aligned).
fn plan_alignment(addrs: &[u64]) -> u32 {
    alignment(addrs).min(MAX_ALIGN)
}

/// The text of a plan set's key, e.g. `conv_fwd n=8 c=3 h=32 w=32 oc=16 k=3x3 s=1 p=1 align=16`
/// (`... p=1 bias align=16` for the fused forward with its bias).
fn set_name(dir: ConvDir, g: &ConvGeom, bias: bool, align: u32) -> String {
    format!("{} align={align}", conv_key(dir, g, bias))
}

/// One candidate configuration of a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// Position in the key's filtered, deduplicated heuristic list (`ConvEngine::CudnnGraph`, or
    /// `ConvEngine::CudnnGraphBias` in the fused forward's list).
    pub rank: u8,
    /// cuDNN's global engine index.
    pub engine: i64,
    /// (knob type, value) choices, sorted by type.
    pub knobs: Vec<(i32, i64)>,
    /// Numerical notes (`cudnnBackendNumericalNote_t` as integers; 4 = non-deterministic).
    pub notes: Vec<i32>,
    /// Behaviour notes (`cudnnBackendBehaviorNote_t`; 0 = compiled at run time).
    pub behavior: Vec<i32>,
    /// Workspace bytes of its plan.
    pub workspace: usize,
}

impl Candidate {
    /// Whether cuDNN promises bit-identical results run to run (no NONDETERMINISTIC note).
    pub fn deterministic(&self) -> bool {
        !nondeterministic(&self.notes)
    }

    /// `eng20 k2=6 k3=0`.
    pub fn tag(&self) -> String {
        tag(self.engine, &self.knobs)
    }
}

/// One half-precision convolution as an operation graph: direction, geometry with dilation,
/// element type of x, w and y (bf16 or f16), layout, and what the graph adds beyond the
/// convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LowpOp {
    /// Which product.
    pub dir: ConvDir,
    /// Geometry and dilation.
    pub shape: ConvShape,
    /// Element type of the inputs and (unless `out_f32`) the output: bf16 or f16.
    pub dtype: Dtype,
    /// `NCHW` (filters `OIHW`) or `NHWC` (filters `OHWI`).
    pub layout: Layout,
    /// Backward-filter only: `dw` in fp32 (from 16-bit `x` and `dy`).
    pub out_f32: bool,
    /// Forward only: `y = conv + bias` in one graph (bias `[oc]` of `dtype`).
    pub bias: bool,
    /// Forward only: ReLU applied (after the bias) in the same graph.
    pub relu: bool,
}

impl LowpOp {
    /// The graph's description at pointer alignment `align`; a typed error for what the op
    /// cannot be (an fp32 dtype, an fp32 output outside the weight gradient, an epilogue
    /// outside the forward).
    fn spec(&self, align: u32) -> Result<OpSpec> {
        let io_type = match self.dtype {
            Dtype::Bf16 => DATA_BFLOAT16,
            Dtype::F16 => DATA_HALF,
            Dtype::F32 => {
                return Err(NnError::Dtype {
                    what: "cuDNN graph API half-precision convolution (fp32: CudnnGraph::run)",
                    expected: "bf16 or f16",
                    found: "f32",
                })
            }
        };
        if self.out_f32 && self.dir != ConvDir::BackwardFilter {
            return Err(NnError::Shape(format!(
                "{}: only the weight gradient may be written in f32",
                self.dir.name()
            )));
        }
        if (self.bias || self.relu) && self.dir != ConvDir::Forward {
            return Err(NnError::Shape(format!(
                "{}: a bias or ReLU is fused only into the forward direction",
                self.dir.name()
            )));
        }
        let g = &self.shape.geom;
        Ok(OpSpec {
            dir: self.dir,
            dims: [
                g.n,
                g.c,
                g.h,
                g.w,
                g.oc,
                g.kh,
                g.kw,
                g.stride,
                g.pad,
                self.shape.dilation,
            ],
            io_type,
            out_type: if self.out_f32 { DATA_FLOAT } else { io_type },
            nhwc: self.layout == Layout::Nhwc,
            bias: self.bias,
            relu: self.relu,
            align,
            tf32: false,
        })
    }

    /// The text of its plan set, e.g.
    /// `conv_fwd n=8 c=3 h=32 w=32 oc=16 k=3x3 s=1 p=1 d=1 bf16 nhwc +bias+relu align=16`.
    pub fn name(&self, align: u32) -> String {
        let g = &self.shape.geom;
        format!(
            "{} n={} c={} h={} w={} oc={} k={}x{} s={} p={} d={} {} {}{}{}{} align={align}",
            self.dir.name(),
            g.n,
            g.c,
            g.h,
            g.w,
            g.oc,
            g.kh,
            g.kw,
            g.stride,
            g.pad,
            self.shape.dilation,
            self.dtype,
            self.layout,
            if self.out_f32 { " dw=f32" } else { "" },
            if self.bias { " +bias" } else { "" },
            if self.relu { " +relu" } else { "" },
        )
    }
}

struct State {
    handle: Ptr,
    /// Built sets per key and TF32 allowance, or why a key has none.
    sets: HashMap<(SetKey, bool), std::result::Result<Set, String>>,
    /// Built half-precision sets per op and alignment, or why one has none.
    lowp_sets: HashMap<OpSpec, std::result::Result<Set, String>>,
}

// SAFETY: the handle and descriptors are plain cuDNN objects, usable from any thread one call at
// a time; every use below holds the `CudnnGraph` mutex with the device's context bound.
unsafe impl Send for State {}

/// cuDNN's graph API bound to one device (kept by the device's
/// [`super::libraries::Libraries`]): its own cuDNN handle and the plans built so far.
pub struct CudnnGraph {
    api: &'static Api,
    ctx: Context,
    state: Mutex<State>,
}

impl Drop for CudnnGraph {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if self.ctx.bind().is_ok() {
            st.sets.clear();
            st.lowp_sets.clear();
            // SAFETY: created by cudnnCreate, destroyed once, here, after every descriptor
            // that refers to it; no call is in flight (we own the state exclusively).
            unsafe {
                (self.api.destroy)(st.handle);
            }
        } else {
            // Without the context the objects cannot be destroyed safely; leak them.
            std::mem::forget(std::mem::take(&mut st.sets));
            std::mem::forget(std::mem::take(&mut st.lowp_sets));
        }
    }
}

impl CudnnGraph {
    /// Loads the backend API and creates a handle for `ctx`'s device. `Err` carries why it is
    /// unavailable (the caller prints it once; the legacy API and our kernels remain).
    pub fn open(ctx: &Context) -> std::result::Result<CudnnGraph, String> {
        let api = api().map_err(str::to_string)?;
        ctx.bind().map_err(|e| e.to_string())?;
        let mut h: Ptr = std::ptr::null_mut();
        // SAFETY: writes one handle. Relaxed capture mode: creation may allocate.
        let st = with_relaxed_capture(|| unsafe { (api.create)(&mut h) });
        if st != SUCCESS || h.is_null() {
            return Err(format!("cudnnCreate failed: {}", describe(api, st)));
        }
        Ok(CudnnGraph {
            api,
            ctx: ctx.clone(),
            state: Mutex::new(State {
                handle: h,
                sets: HashMap::new(),
                lowp_sets: HashMap::new(),
            }),
        })
    }

    /// The set of (dir, g, bias fused or not, align, TF32 allowed or not), built now when missing and `may_build`
    /// (never inside a capture: finalizing may compile, allocate or synchronise).
    #[allow(clippy::too_many_arguments)]
    fn set<'s>(
        &self,
        st: &'s mut State,
        dir: ConvDir,
        g: &ConvGeom,
        bias: bool,
        align: u32,
        tf32: bool,
        may_build: bool,
    ) -> Option<&'s mut std::result::Result<Set, String>> {
        let key = (set_key(dir, g, bias, align), tf32);
        if !st.sets.contains_key(&key) {
            if !may_build {
                return None;
            }
            let handle = st.handle;
            let built =
                with_relaxed_capture(|| build_set(self.api, handle, dir, g, bias, align, tf32));
            st.sets.insert(key, built.map_err(|e| e.to_string()));
        }
        st.sets.get_mut(&key)
    }

    /// The half-precision set of `spec`, built now when missing and `may_build` (as
    /// [`CudnnGraph::set`]).
    fn lowp_set<'s>(
        &self,
        st: &'s mut State,
        spec: &OpSpec,
        may_build: bool,
    ) -> Option<&'s mut std::result::Result<Set, String>> {
        if !st.lowp_sets.contains_key(spec) {
            if !may_build {
                return None;
            }
            let handle = st.handle;
            let built = with_relaxed_capture(|| build_set_spec(self.api, handle, spec));
            st.lowp_sets.insert(*spec, built.map_err(|e| e.to_string()));
        }
        st.lowp_sets.get_mut(spec)
    }

    /// The candidate configurations of a half-precision convolution `op`, in heuristic order:
    /// fp32 accumulation (tensor cores admitted), at most `max_workspace` bytes of workspace,
    /// deterministic ones only with `deterministic`; at most [`CAP`] ([`FUSED_CAP`] with an
    /// epilogue). Plans are built on the first eager call; inside a capture only plans built
    /// before are offered. Empty where cuDNN has no engine for the op (a layout, channel
    /// count or type mix it cannot run).
    pub fn lowp_candidates(
        &self,
        q: &dyn Queue,
        op: &LowpOp,
        deterministic: bool,
        max_workspace: usize,
    ) -> Result<Vec<Candidate>> {
        let spec = op.spec(LIST_ALIGN)?;
        if !crate::ffi::cudnn::supports_shape(&op.shape) {
            return Ok(Vec::new());
        }
        self.ctx.bind()?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match self.lowp_set(&mut st, &spec, !q.is_capturing()) {
            None => Ok(Vec::new()),
            Some(Ok(set)) => Ok(set.candidates(deterministic, max_workspace)),
            Some(Err(why)) => Err(NnError::Library {
                library: LIBRARY,
                call: "operation graph",
                status: format!("{}: {why}", op.name(LIST_ALIGN)),
            }),
        }
    }

    /// What rank `rank` of `op`'s list runs, when its plan was built in this process.
    pub fn describe_lowp(&self, op: &LowpOp, rank: u8) -> Option<Candidate> {
        let spec = op.spec(LIST_ALIGN).ok()?;
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match st.lowp_sets.get(&spec)? {
            Ok(set) => set.candidate(rank),
            Err(_) => None,
        }
    }

    /// Every configuration cuDNN's heuristics listed for `op` and what became of it, or why
    /// the operation graph could not be built; `None` before it was listed.
    pub fn lowp_report(&self, op: &LowpOp) -> Option<String> {
        let spec = op.spec(LIST_ALIGN).ok()?;
        let name = op.name(LIST_ALIGN);
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        Some(match st.lowp_sets.get(&spec)? {
            Err(why) => format!("{name}: no operation graph: {why}"),
            Ok(set) => set.report(&name),
        })
    }

    /// Runs configuration `rank` of `op`'s list. Buffers by direction as [`CudnnGraph::run`]
    /// (`a`, `b` of `T`; `out` of `O`: `T`, or f32 for the weight gradient with
    /// `op.out_f32`), the bias (`op.bias`: `oc` elements of `T`) with the forward. The element
    /// types must be the op's (a typed error otherwise). Inside a capture the plan must have
    /// been built before.
    #[allow(clippy::too_many_arguments)]
    pub fn run_lowp<T: Float, O: Float>(
        &self,
        q: &dyn Queue,
        op: &LowpOp,
        rank: u8,
        a: &DeviceBuffer<T>,
        b: &DeviceBuffer<T>,
        out: &DeviceBuffer<O>,
        bias: Option<&DeviceBuffer<T>>,
    ) -> Result<()> {
        op.spec(LIST_ALIGN)?;
        let want_out = if op.out_f32 { Dtype::F32 } else { op.dtype };
        if T::DTYPE != op.dtype {
            return Err(NnError::Dtype {
                what: "CudnnGraph::run_lowp: an input",
                expected: op.dtype.name(),
                found: T::DTYPE.name(),
            });
        }
        if O::DTYPE != want_out {
            return Err(NnError::Dtype {
                what: "CudnnGraph::run_lowp: the output (f32 only for a dw with out_f32)",
                expected: want_out.name(),
                found: O::DTYPE.name(),
            });
        }
        if bias.is_some() != op.bias {
            return Err(NnError::Shape(format!(
                "{}: the op {} a bias",
                op.name(LIST_ALIGN),
                if op.bias { "needs" } else { "has no" }
            )));
        }
        if !crate::ffi::cudnn::supports_shape(&op.shape) {
            return Err(NnError::Shape(format!(
                "cuDNN cannot describe the convolution {:?} (empty or over 2^31 elements)",
                op.shape
            )));
        }
        handle_on_device(q, "cuDNN graph API handle", self.ctx.ordinal())?;
        let (roles, bias) = shape_roles(q, op.dir, &op.shape, (a, b, out), bias)?;
        let mut addrs: Vec<u64> = roles.iter().map(|r| r.addr).collect();
        addrs.extend(bias.map(|b| b.addr));
        let align = plan_alignment(&addrs);
        let spec = op.spec(align)?;
        let capturing = q.is_capturing();
        let name = || op.name(align);
        self.ctx.bind()?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let handle = st.handle;
        let set = match self.lowp_set(&mut st, &spec, !capturing) {
            Some(Ok(set)) => set,
            Some(Err(why)) => {
                return Err(NnError::Library {
                    library: LIBRARY,
                    call: "operation graph",
                    status: format!("{}: {why}", name()),
                })
            }
            None => {
                return Err(NnError::Library {
                    library: LIBRARY,
                    call: "execution plan",
                    status: format!("{}: {NOT_BUILT}", name()),
                })
            }
        };
        let (plan, ws_bytes) = self.plan_of(handle, set, rank, &name(), capturing)?;
        self.launch(q, handle, plan, ws_bytes, roles, bias)
    }

    /// The candidate configurations of one direction of `g`, in heuristic order: plain fp32
    /// (no TF32), at most `max_workspace` bytes of workspace, deterministic ones only with
    /// `deterministic`; at most [`CAP`]. Plans are built on the first eager call; inside a
    /// capture only plans built before are offered (none when the key is new).
    pub fn candidates(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        g: &ConvGeom,
        deterministic: bool,
        max_workspace: usize,
    ) -> Result<Vec<Candidate>> {
        self.candidates_math(q, dir, g, deterministic, max_workspace, false)
    }

    /// As [`CudnnGraph::candidates`]; with `tf32`, from the list that also admits TF32
    /// tensor-core engines ([`crate::engine::Policy::tf32_conv`]; its ranks are its own).
    pub fn candidates_math(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        g: &ConvGeom,
        deterministic: bool,
        max_workspace: usize,
        tf32: bool,
    ) -> Result<Vec<Candidate>> {
        self.list(q, dir, g, false, deterministic, max_workspace, tf32)
    }

    /// The candidate configurations of the forward convolution of `g` with its bias fused
    /// (`cudnnv8+bias:RANK`), chosen as [`CudnnGraph::candidates`] chooses, at most
    /// [`FUSED_CAP`]. Empty when cuDNN offers no plain-fp32 engine for the fused graph.
    pub fn fused_bias_candidates(
        &self,
        q: &dyn Queue,
        g: &ConvGeom,
        deterministic: bool,
        max_workspace: usize,
    ) -> Result<Vec<Candidate>> {
        self.fused_bias_candidates_math(q, g, deterministic, max_workspace, false)
    }

    /// As [`CudnnGraph::fused_bias_candidates`], admitting TF32 engines when `tf32`.
    pub fn fused_bias_candidates_math(
        &self,
        q: &dyn Queue,
        g: &ConvGeom,
        deterministic: bool,
        max_workspace: usize,
        tf32: bool,
    ) -> Result<Vec<Candidate>> {
        self.list(
            q,
            ConvDir::Forward,
            g,
            true,
            deterministic,
            max_workspace,
            tf32,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn list(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        g: &ConvGeom,
        bias: bool,
        deterministic: bool,
        max_workspace: usize,
        tf32: bool,
    ) -> Result<Vec<Candidate>> {
        if !crate::ffi::cudnn::supports(g) || (bias && dir != ConvDir::Forward) {
            return Ok(Vec::new());
        }
        self.ctx.bind()?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match self.set(&mut st, dir, g, bias, LIST_ALIGN, tf32, !q.is_capturing()) {
            None => Ok(Vec::new()),
            Some(Ok(set)) => Ok(set.candidates(deterministic, max_workspace)),
            Some(Err(why)) => Err(NnError::Library {
                library: LIBRARY,
                call: "operation graph",
                status: format!("{}: {why}", set_name(dir, g, bias, LIST_ALIGN)),
            }),
        }
    }

    /// What `cudnnv8:RANK` runs for one direction of `g` (engine, knobs, notes), when its plan
    /// was built in this process (for reports: the registry's table shows only the rank).
    pub fn describe(&self, dir: ConvDir, g: &ConvGeom, rank: u8) -> Option<Candidate> {
        self.describe_set(dir, g, false, rank)
    }

    /// What `cudnnv8+bias:RANK` runs for the forward of `g` with its bias fused, when its plan
    /// was built in this process.
    pub fn describe_fused_bias(&self, g: &ConvGeom, rank: u8) -> Option<Candidate> {
        self.describe_set(ConvDir::Forward, g, true, rank)
    }

    fn describe_set(&self, dir: ConvDir, g: &ConvGeom, bias: bool, rank: u8) -> Option<Candidate> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match st.sets.get(&(set_key(dir, g, bias, LIST_ALIGN), false))? {
            Ok(set) => set.candidate(rank),
            Err(_) => None,
        }
    }

    /// Every configuration cuDNN's heuristics listed for the fused forward of `g` and what
    /// became of it (rank and plan, or why it was dropped), or why the operation graph could
    /// not be built; `None` before it was listed (for reports and device-test diagnostics).
    pub fn fused_bias_report(&self, g: &ConvGeom) -> Option<String> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let key = (set_key(ConvDir::Forward, g, true, LIST_ALIGN), false);
        let name = set_name(ConvDir::Forward, g, true, LIST_ALIGN);
        Some(match st.sets.get(&key)? {
            Err(why) => format!("{name}: no operation graph: {why}"),
            Ok(set) => set.report(&name),
        })
    }

    /// Runs the configuration of rank `rank` for one direction. Buffers by direction (as
    /// [`crate::engine::conv`]): forward `a = x`, `b = w`, `out = y` (a bias is added after, by the
    /// engine `crate::engine::conv` chooses); backward-data `a = dy`, `b = w`, `out = dx`;
    /// backward-filter `a = dy`, `b = x`, `out = dw`. Inside a capture the plan must have been
    /// built before (by an eager call or an eager listing of candidates).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        rank: u8,
        g: &ConvGeom,
        a: &DeviceBuffer<f32>,
        b: &DeviceBuffer<f32>,
        out: &DeviceBuffer<f32>,
    ) -> Result<()> {
        self.execute(q, dir, rank, g, (a, b, out), None, false)
    }

    /// As [`CudnnGraph::run`], with a rank of [`CudnnGraph::candidates_math`]'s list for `tf32`.
    #[allow(clippy::too_many_arguments)]
    pub fn run_math(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        rank: u8,
        g: &ConvGeom,
        a: &DeviceBuffer<f32>,
        b: &DeviceBuffer<f32>,
        out: &DeviceBuffer<f32>,
        tf32: bool,
    ) -> Result<()> {
        self.execute(q, dir, rank, g, (a, b, out), None, tf32)
    }

    /// Runs the fused configuration of rank `rank`: `y = conv(x, w) + bias` in one cuDNN
    /// execution (`bias` has `g.oc` elements). Inside a capture the plan must have been built
    /// before.
    #[allow(clippy::too_many_arguments)]
    pub fn run_fused_bias(
        &self,
        q: &dyn Queue,
        rank: u8,
        g: &ConvGeom,
        x: &DeviceBuffer<f32>,
        w: &DeviceBuffer<f32>,
        bias: &DeviceBuffer<f32>,
        y: &DeviceBuffer<f32>,
    ) -> Result<()> {
        self.run_fused_bias_math(q, rank, g, x, w, bias, y, false)
    }

    /// As [`CudnnGraph::run_fused_bias`], with a rank of
    /// [`CudnnGraph::fused_bias_candidates_math`]'s list for `tf32`.
    #[allow(clippy::too_many_arguments)]
    pub fn run_fused_bias_math(
        &self,
        q: &dyn Queue,
        rank: u8,
        g: &ConvGeom,
        x: &DeviceBuffer<f32>,
        w: &DeviceBuffer<f32>,
        bias: &DeviceBuffer<f32>,
        y: &DeviceBuffer<f32>,
        tf32: bool,
    ) -> Result<()> {
        self.execute(q, ConvDir::Forward, rank, g, (x, w, y), Some(bias), tf32)
    }

    #[allow(clippy::too_many_arguments)]
    fn execute(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        rank: u8,
        g: &ConvGeom,
        (a, b, out): (&DeviceBuffer<f32>, &DeviceBuffer<f32>, &DeviceBuffer<f32>),
        bias: Option<&DeviceBuffer<f32>>,
        tf32: bool,
    ) -> Result<()> {
        if !crate::ffi::cudnn::supports(g) {
            return Err(NnError::Shape(format!(
                "cuDNN cannot describe the convolution {g:?} (empty or over 2^31 elements)"
            )));
        }
        // Buffers by unique id (x, w, y), after checking each extent (and the bias: `g.oc`
        // elements, forward only).
        let (x, w, y) = conv_roles(dir, g, (a, b, out), bias)?;
        // The handle, the buffers and (below) the workspace are all the queue's device's.
        handle_on_device(q, "cuDNN graph API handle", self.ctx.ordinal())?;
        conv_on_device(q, dir, (a, b, out), bias)?;
        let fused = bias.is_some();
        let mut addrs = vec![x.addr(), w.addr(), y.addr()];
        addrs.extend(bias.map(|b| b.addr()));
        let align = plan_alignment(&addrs);
        let capturing = q.is_capturing();
        let name = || set_name(dir, g, fused, align);
        self.ctx.bind()?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let handle = st.handle;
        let set = match self.set(&mut st, dir, g, fused, align, tf32, !capturing) {
            Some(Ok(set)) => set,
            Some(Err(why)) => {
                return Err(NnError::Library {
                    library: LIBRARY,
                    call: "operation graph",
                    status: format!("{}: {why}", name()),
                })
            }
            None => {
                return Err(NnError::Library {
                    library: LIBRARY,
                    call: "execution plan",
                    status: format!("{}: {NOT_BUILT}", name()),
                })
            }
        };
        let (plan, ws_bytes) = self.plan_of(handle, set, rank, &name(), capturing)?;
        let roles = [
            RoleBuf::of("conv2d x", x),
            RoleBuf::of("conv2d w", w),
            RoleBuf::of("conv2d y", y),
        ];
        let bias = bias.map(|b| RoleBuf::of("conv2d bias", b));
        self.launch(q, handle, plan, ws_bytes, roles, bias)
    }

    /// The plan of configuration `rank` of `set` (built now when untried and not
    /// `capturing`) and its workspace bytes; `name` names the set in errors.
    fn plan_of(
        &self,
        handle: Ptr,
        set: &mut Set,
        rank: u8,
        name: &str,
        capturing: bool,
    ) -> Result<(Ptr, usize)> {
        let listed = set.configs.len();
        let Some(c) = set.configs.get_mut(rank as usize) else {
            return Err(NnError::Library {
                library: LIBRARY,
                call: "execution plan",
                status: format!("{name}: no configuration of rank {rank} ({listed} listed)"),
            });
        };
        if matches!(c.slot, Slot::Untried) && !capturing {
            with_relaxed_capture(|| fill_slot(self.api, handle, c));
        }
        match &c.slot {
            Slot::Built { plan, workspace } => Ok((plan.raw, *workspace)),
            Slot::Failed(why) => Err(NnError::Library {
                library: LIBRARY,
                call: "cudnnBackendFinalize(EXECUTION_PLAN)",
                status: format!("{name} rank {rank} ({}): {why}", c.info_tag()),
            }),
            Slot::Untried => Err(NnError::Library {
                library: LIBRARY,
                call: "execution plan",
                status: format!("{name} rank {rank}: {NOT_BUILT}"),
            }),
        }
    }

    /// Executes `plan` on buffers `[x, w, y]` (by role) and the bias, whose extents and
    /// device the callers checked against the plan's graph, with a workspace of `ws_bytes`
    /// from `q`. The caller holds the state's lock (the plan lives in it).
    fn launch(
        &self,
        q: &dyn Queue,
        handle: Ptr,
        plan: Ptr,
        ws_bytes: usize,
        [x, w, y]: [RoleBuf<'_>; 3],
        bias: Option<RoleBuf<'_>>,
    ) -> Result<()> {
        let ws = if ws_bytes > 0 {
            Some(q.alloc::<u8>(ws_bytes)?)
        } else {
            None
        };
        if let Some(ws) = &ws {
            on_device(q, [("cuDNN workspace", ws.block())])?;
        }
        for buf in [x, w, y].into_iter().chain(bias) {
            q.use_block(buf.block);
        }
        if let Some(ws) = &ws {
            q.use_block(ws.block());
        }
        let ws_p = ws
            .as_ref()
            .map_or(std::ptr::null_mut(), |w| w.addr() as Ptr);
        let mut uids = vec![UID_X, UID_W, UID_Y];
        let mut ptrs = vec![x.addr as Ptr, w.addr as Ptr, y.addr as Ptr];
        if let Some(bias) = bias {
            uids.push(UID_BIAS);
            ptrs.push(bias.addr as Ptr);
        }
        let e = |call| err_of(self.api, call);
        let pack =
            Desc::new(self.api, D_VARIANT_PACK).map_err(e("cudnnBackendCreateDescriptor"))?;
        (|| {
            pack.set_i64(A_VP_UNIQUE_IDS, &uids)?;
            pack.set_ptrs(A_VP_DATA_POINTERS, &ptrs)?;
            pack.set_ptrs(A_VP_WORKSPACE, &[ws_p])?;
            pack.finalize()
        })()
        .map_err(e("cudnnBackend*(VARIANT_PACK)"))?;
        let stream = q.stream_handle().raw() as Ptr;
        // SAFETY: the handle, plan and variant pack are live (held under the lock by the
        // caller); the plan describes exactly the geometry (and, fused, the bias of `oc`
        // elements) whose extents the callers checked against the buffers, with the element
        // types the callers checked (f32, or the op's dtype), at the alignment of these
        // pointers, so cuDNN reads and writes inside them; the buffers and the workspace are memory of
        // the queue's device, the handle's (checked); the fused graph's intermediate is virtual (no
        // pointer); the workspace holds the bytes the plan asked for; every buffer is kept
        // alive and ordered by `use_block` (a capture keeps them).
        unsafe {
            check(
                self.api,
                (self.api.set_stream)(handle, stream),
                "cudnnSetStream",
            )?;
            check(
                self.api,
                (self.api.backend_execute)(handle, plan, pack.raw),
                "cudnnBackendExecute",
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::backend::*;
    use super::plans::*;
    use super::*;

    fn info(engine: i64, knobs: &[(i32, i64)], notes: &[i32]) -> ConfigInfo {
        ConfigInfo {
            engine,
            knobs: knobs.to_vec(),
            notes: notes.to_vec(),
            behavior: Vec::new(),
        }
    }

    #[test]
    fn notes_keep_plain_fp32_only() {
        assert!(fp32_fma(&[]));
        assert!(fp32_fma(&[3])); // FFT
        assert!(fp32_fma(&[5, 6])); // Winograd 4x4
        assert!(fp32_fma(&[9])); // strict NaN propagation
        assert!(fp32_fma(&[4])); // non-deterministic, but fp32
        assert!(fp32_fma(&[42])); // a note a newer cuDNN may add
        assert!(!fp32_fma(&[0])); // tensor cores (TF32)
        assert!(!fp32_fma(&[3, 1])); // down-converted inputs
        assert!(!fp32_fma(&[2])); // reduced-precision reduction
        assert!(nondeterministic(&[9, 4]));
        assert!(!nondeterministic(&[0, 3, 5]));
    }

    #[test]
    fn selection_filters_dedupes_and_keeps_heuristic_order() {
        let infos = vec![
            info(23, &[(2, 1)], &[0]),         // TF32: dropped
            info(20, &[(2, 6), (3, 0)], &[4]), // kept (non-deterministic)
            info(1, &[(2, 6), (3, 0)], &[]),   // kept
            info(0, &[], &[9]),                // kept
            info(20, &[(2, 6), (3, 0)], &[4]), // the FALLBACK list repeats it: dropped
            info(1, &[], &[]),                 // other knobs: kept
            info(17, &[(25, 0)], &[5, 6]),     // Winograd: kept
            info(1, &[(2, 6), (3, 0)], &[]),   // duplicate
        ];
        assert_eq!(select(&infos, false), vec![1, 2, 3, 5, 6]);
        // With TF32 allowed the tensor-core engine is kept too (first, in heuristic order).
        assert_eq!(select(&infos, true), vec![0, 1, 2, 3, 5, 6]);
        // Never down-converted inputs or reduced-precision reductions, TF32 or not.
        let lossy = vec![
            info(2, &[], &[0, 1]),
            info(3, &[], &[2]),
            info(4, &[], &[0]),
        ];
        assert_eq!(select(&lossy, true), vec![2]);
        assert!(select(&lossy, false).is_empty());
        // At most 256 (ranks are u8).
        let many: Vec<ConfigInfo> = (0..400).map(|e| info(e, &[], &[])).collect();
        assert_eq!(select(&many, false).len(), 256);
        assert_eq!(tag(20, &[(2, 6), (3, 0)]), "eng20 k2=6 k3=0");
        assert_eq!(tag(0, &[]), "eng0");
    }

    #[test]
    fn picking_takes_the_first_allowed_plans_up_to_the_cap() {
        // (rank, deterministic, workspace)
        let built: Vec<(u8, bool, usize)> = vec![
            (0, false, 0),
            (1, true, 0),
            (3, true, 1 << 40),
            (4, true, 64),
            (5, false, 0),
        ];
        assert_eq!(pick(built.clone(), true, 1 << 30, CAP), vec![1, 4]);
        assert_eq!(pick(built.clone(), false, 1 << 30, CAP), vec![0, 1, 4, 5]);
        assert_eq!(
            pick(built.clone(), false, usize::MAX, CAP),
            vec![0, 1, 3, 4, 5]
        );
        let long: Vec<(u8, bool, usize)> = (0..20).map(|r| (r, r % 3 != 0, 0)).collect();
        let det = pick(long.clone(), true, 0, CAP);
        assert_eq!(det.len(), CAP);
        assert!(det.iter().all(|r| r % 3 != 0));
        assert_eq!(
            pick(long.clone(), false, 0, CAP),
            (0..CAP as u8).collect::<Vec<_>>()
        );
        // The fused forward offers fewer.
        assert_eq!(pick(long.clone(), true, 0, FUSED_CAP), vec![1, 2, 4, 5]);
        assert_eq!(pick(long, false, 0, FUSED_CAP), vec![0, 1, 2, 3]);
        const { assert!(FUSED_CAP <= 4 && FUSED_CAP <= CAP) };
    }

    #[test]
    fn alignment_comes_from_the_pointers() {
        assert_eq!(plan_alignment(&[0x7f00_0000_0000, 0x7f00_0000_0100]), 16);
        assert_eq!(plan_alignment(&[0x7f00_0000_0100, 0x7f00_0000_0104]), 4);
        assert_eq!(plan_alignment(&[0x1008, 0x1000]), 8);
        assert_eq!(plan_alignment(&[0]), 16);
        assert_eq!(plan_alignment(&[]), 16);
    }

    #[test]
    fn keys_name_direction_geometry_and_alignment() {
        let g = ConvGeom {
            n: 128,
            c: 64,
            h: 16,
            w: 16,
            oc: 128,
            kh: 3,
            kw: 3,
            stride: 2,
            pad: 1,
        };
        assert_eq!(
            set_name(ConvDir::Forward, &g, false, 16),
            "conv_fwd n=128 c=64 h=16 w=16 oc=128 k=3x3 s=2 p=1 align=16"
        );
        assert_eq!(
            set_name(ConvDir::Forward, &g, true, 4),
            "conv_fwd n=128 c=64 h=16 w=16 oc=128 k=3x3 s=2 p=1 bias align=4"
        );
        assert_ne!(
            set_key(ConvDir::Forward, &g, false, 16),
            set_key(ConvDir::BackwardData, &g, false, 16)
        );
        assert_ne!(
            set_key(ConvDir::Forward, &g, false, 16),
            set_key(ConvDir::Forward, &g, false, 4)
        );
        // The fused forward is a set of its own.
        assert_ne!(
            set_key(ConvDir::Forward, &g, false, 16),
            set_key(ConvDir::Forward, &g, true, 16)
        );
        assert_eq!(
            op_attrs(ConvDir::BackwardFilter).0,
            D_OP_CONV_BACKWARD_FILTER
        );
    }

    /// Where cuDNN 9 is installed (the GPU machine), every backend symbol resolves, and
    /// descriptors that need no handle can be built; elsewhere the reason is a message.
    #[test]
    fn backend_api_loads_where_cudnn_9_is_installed() {
        match api() {
            Ok(api) => {
                assert!(describe(api, SUCCESS).contains("SUCCESS"));
                let t = tensor(api, [2, 3, 11, 13], UID_X, 16).unwrap();
                assert!(!t.raw.is_null());
                // Every direction's operation of odd geometries (the attribute types and
                // values are accepted; only the operation graph needs a handle, i.e. a GPU).
                let g = |n, c, h, w, oc, k, stride, pad| ConvGeom {
                    n,
                    c,
                    h,
                    w,
                    oc,
                    kh: k,
                    kw: k,
                    stride,
                    pad,
                };
                for geom in [
                    g(1, 1, 8, 8, 1, 1, 1, 0),
                    g(2, 3, 11, 13, 5, 3, 2, 1),
                    g(3, 7, 9, 9, 4, 7, 1, 1),
                    g(128, 64, 16, 16, 128, 3, 2, 1),
                ] {
                    for dir in ConvDir::ALL {
                        for align in [4, 16] {
                            build_op(api, dir, &geom, align, false).unwrap_or_else(|e| {
                                panic!("{}: {e}", set_name(dir, &geom, false, align))
                            });
                        }
                    }
                }
                // An output size that does not match the geometry is refused by cuDNN
                // (11x13, 3x3, stride 2, no padding: 5x6, not 6x7).
                let bad = g(2, 3, 11, 13, 5, 3, 2, 0);
                let (tensors, conv, _) = build_op(api, ConvDir::Forward, &bad, 16, false).unwrap();
                let wrong = tensor(api, [2, 5, 6, 7], UID_Y, 16).unwrap();
                let (op_type, [alpha, beta, conv_a, x_a, w_a, y_a]) = op_attrs(ConvDir::Forward);
                let op = Desc::new(api, op_type).unwrap();
                op.set_descs(x_a, &[&tensors[0]]).unwrap();
                op.set_descs(w_a, &[&tensors[1]]).unwrap();
                op.set_descs(y_a, &[&wrong]).unwrap();
                op.set_descs(conv_a, &[&conv]).unwrap();
                op.set_f32(alpha, 1.0).unwrap();
                op.set_f32(beta, 0.0).unwrap();
                assert!(op.finalize().is_err());
                // The fused forward's two operations: the convolution into a virtual tensor,
                // then the bias added into y; a bias is fused into the forward direction only.
                for geom in [g(2, 3, 11, 13, 5, 3, 2, 1), g(3, 5, 13, 11, 7, 1, 1, 0)] {
                    let name = set_name(ConvDir::Forward, &geom, true, 16);
                    let (tensors, _conv, _op) = build_op(api, ConvDir::Forward, &geom, 16, true)
                        .unwrap_or_else(|e| panic!("{name}: {e}"));
                    build_bias_add(api, &geom, 16, &tensors[2])
                        .unwrap_or_else(|e| panic!("{name}: {e}"));
                    assert!(build_op(api, ConvDir::BackwardData, &geom, 16, true).is_err());
                }
                println!("cuDNN graph API available");
            }
            Err(why) => println!("cuDNN graph API unavailable here: {why}"),
        }
    }
}
