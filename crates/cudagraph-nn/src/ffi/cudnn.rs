//! cuDNN convolutions (forward, backward-data, backward-filter; NCHW fp32, and bf16/f16 in NCHW
//! or NHWC with fp32 accumulation), loaded at run time.
//!
//! cudarc's `cudnn` feature finds and loads `libcudnn` (dynamic loading: nothing is needed at
//! build time); the functions themselves are looked up here, each with its C signature and raw
//! integer status codes and enums, so a newer cuDNN that returns a code our bindings do not
//! know cannot produce an invalid Rust enum, and a missing symbol is a clear "cuDNN unavailable"
//! instead of a panic. Every symbol is resolved, and cuDNN's sub-libraries are checked to load,
//! before any function is called (the `libcudnn` shim aborts the process when one is missing).
//!
//! One handle per device (in the device's [`super::libraries::Libraries`], holding its
//! `Context`), its stream set on every call. Math type `CUDNN_FMA_MATH` (no TF32, like PyTorch
//! with `allow_tf32 = False`), or `CUDNN_DEFAULT_MATH` where the caller allows TF32 (the
//! `*_math` methods' `tf32`, [`crate::engine::Policy::tf32_conv`]; separate descriptors). The workspace of every call comes from the caller's queue
//! (`QueueExt::alloc`): inside a capture it is taken from the graph's pool. Which algorithm
//! runs is the engine registry's choice ([`crate::engine`]); this module lists the candidates
//! (`cudnnGetConvolution*Algorithm_v7`, heuristic order) and runs the chosen one.
//!
//! **Half precision** ([`Cudnn::algos_lowp`], [`Cudnn::run_lowp`]): x, w and y in bf16 or f16
//! with an fp32 compute type — cuDNN's `PSEUDO_BFLOAT16_CONFIG` and `PSEUDO_HALF_CONFIG`, what
//! PyTorch runs for bf16/f16 convolutions —, math type `CUDNN_TENSOR_OP_MATH` (tensor cores
//! where an algorithm has them; never `..._ALLOW_CONVERSION`), tensors `NCHW` or `NHWC`
//! (weights `KRSC` then), with a dilation. cuDNN's algorithm list is its own word on what runs
//! for a type, layout and channel count: a configuration it cannot run (a misaligned channel
//! count on a tensor-core algorithm) simply is not listed, or fails its workspace query, and
//! the registry measures what remains.
use std::collections::HashMap;
use std::ffi::{c_char, c_int};
use std::sync::Mutex;

use cudagraph::runtime::{with_relaxed_capture, Context};
use cudagraph::{DeviceBuffer, Queue, QueueExt};
use cudarc::cudnn::sys as cs;

use super::loader::{check, describe, lib_fn, CPtr, Loaded, Ptr, Status, StatusText, SUCCESS};
use crate::dtype::{Dtype, Float};
use crate::error::{NnError, Result};
use crate::extent::{
    conv_on_device, conv_roles, handle_on_device, need, on_device, shape_roles, ConvDir, ConvGeom,
    ConvShape, Layout, RoleBuf,
};

const NCHW: u32 = cs::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW as u32;
const NHWC: u32 = cs::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC as u32;
const FLOAT: u32 = cs::cudnnDataType_t::CUDNN_DATA_FLOAT as u32;
const HALF: u32 = cs::cudnnDataType_t::CUDNN_DATA_HALF as u32;
const BFLOAT16: u32 = cs::cudnnDataType_t::CUDNN_DATA_BFLOAT16 as u32;
const CROSS_CORRELATION: u32 = cs::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION as u32;
const DEFAULT_MATH: u32 = cs::cudnnMathType_t::CUDNN_DEFAULT_MATH as u32;
const FMA_MATH: u32 = cs::cudnnMathType_t::CUDNN_FMA_MATH as u32;
const TENSOR_OP_MATH: u32 = cs::cudnnMathType_t::CUDNN_TENSOR_OP_MATH as u32;
const TENSOR_OP_MATH_ALLOW_CONVERSION: u32 =
    cs::cudnnMathType_t::CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION as u32;
const DETERMINISTIC: u32 = cs::cudnnDeterminism_t::CUDNN_DETERMINISTIC as u32;

/// `cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t` (the three share one layout), with raw
/// integers where the header has enums.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AlgoPerf {
    algo: u32,
    status: Status,
    time: f32,
    memory: usize,
    determinism: u32,
    math_type: u32,
    reserved: [c_int; 3],
}

/// (handle, desc1, desc2, conv, desc3, requested, returned, results)
type FindFn =
    unsafe extern "C" fn(Ptr, Ptr, Ptr, Ptr, Ptr, c_int, *mut c_int, *mut AlgoPerf) -> Status;
/// (handle, desc1, desc2, conv, desc3, algo, bytes)
type WorkspaceFn = unsafe extern "C" fn(Ptr, Ptr, Ptr, Ptr, Ptr, u32, *mut usize) -> Status;
/// (handle, alpha, desc1, ptr1, desc2, ptr2, conv, algo, workspace, bytes, beta, desc3, ptr3)
type ConvFn = unsafe extern "C" fn(
    Ptr,
    CPtr,
    Ptr,
    CPtr,
    Ptr,
    CPtr,
    Ptr,
    u32,
    Ptr,
    usize,
    CPtr,
    Ptr,
    Ptr,
) -> Status;

/// The cuDNN functions this module calls, with the signatures of cuDNN 8/9's headers.
struct Api {
    get_version: unsafe extern "C" fn() -> usize,
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    create: unsafe extern "C" fn(*mut Ptr) -> Status,
    destroy: unsafe extern "C" fn(Ptr) -> Status,
    set_stream: unsafe extern "C" fn(Ptr, Ptr) -> Status,
    create_tensor: unsafe extern "C" fn(*mut Ptr) -> Status,
    set_tensor_4d: unsafe extern "C" fn(Ptr, u32, u32, c_int, c_int, c_int, c_int) -> Status,
    destroy_tensor: unsafe extern "C" fn(Ptr) -> Status,
    create_filter: unsafe extern "C" fn(*mut Ptr) -> Status,
    set_filter_4d: unsafe extern "C" fn(Ptr, u32, u32, c_int, c_int, c_int, c_int) -> Status,
    destroy_filter: unsafe extern "C" fn(Ptr) -> Status,
    create_conv: unsafe extern "C" fn(*mut Ptr) -> Status,
    set_conv_2d:
        unsafe extern "C" fn(Ptr, c_int, c_int, c_int, c_int, c_int, c_int, u32, u32) -> Status,
    set_conv_math: unsafe extern "C" fn(Ptr, u32) -> Status,
    destroy_conv: unsafe extern "C" fn(Ptr) -> Status,
    output_dim: unsafe extern "C" fn(
        Ptr,
        Ptr,
        Ptr,
        *mut c_int,
        *mut c_int,
        *mut c_int,
        *mut c_int,
    ) -> Status,
    find: [FindFn; 3],
    workspace: [WorkspaceFn; 3],
    run: [ConvFn; 3],
    add_tensor: unsafe extern "C" fn(Ptr, CPtr, Ptr, CPtr, CPtr, Ptr, Ptr) -> Status,
}

/// The sub-libraries the convolution API needs, by cuDNN major version. cuDNN's `libcudnn` is
/// a shim that loads them on first use and aborts the process when one is missing, so they are
/// checked (loaded by name, as the shim does) before any cuDNN function is called.
const SUB_LIBRARIES: [&[&str]; 2] = [
    &[
        "libcudnn_graph.so.9",
        "libcudnn_ops.so.9",
        "libcudnn_cnn.so.9",
        "libcudnn_heuristic.so.9",
        "libcudnn_engines_precompiled.so.9",
        "libcudnn_engines_runtime_compiled.so.9",
    ],
    &[
        "libcudnn_ops_infer.so.8",
        "libcudnn_ops_train.so.8",
        "libcudnn_cnn_infer.so.8",
        "libcudnn_cnn_train.so.8",
    ],
];

/// Whether one complete set of sub-libraries loads; `Err` names what is missing.
fn sub_libraries_load() -> std::result::Result<(), String> {
    let mut missing = Vec::new();
    for set in SUB_LIBRARIES {
        let mut absent = Vec::new();
        for &name in set {
            // SAFETY: loading a cuDNN library runs only its (and its dependencies')
            // initialisers, which have no preconditions.
            match unsafe { libloading::Library::new(name) } {
                // Kept loaded: the shim loads it next anyway, and unloading libraries that
                // hold CUDA runtime state is best avoided.
                Ok(lib) => std::mem::forget(lib),
                Err(_) => absent.push(name),
            }
        }
        if absent.is_empty() {
            return Ok(());
        }
        missing.push(absent.join(", "));
    }
    Err(format!(
        "libcudnn is there but its sub-libraries are not (missing: {})",
        missing.join("; or for cuDNN 8: ")
    ))
}

fn load() -> std::result::Result<Api, String> {
    // SAFETY: only tries to dlopen libcudnn by its usual names.
    if !unsafe { cs::is_culib_present() } {
        return Err("libcudnn could not be loaded".into());
    }
    sub_libraries_load()?;
    // SAFETY: the library loads (checked above), so `culib` returns it instead of panicking.
    let lib = unsafe { cs::culib() };
    let api = Api {
        get_version: lib_fn!(lib, "cudnnGetVersion"),
        get_error_string: lib_fn!(lib, "cudnnGetErrorString"),
        create: lib_fn!(lib, "cudnnCreate"),
        destroy: lib_fn!(lib, "cudnnDestroy"),
        set_stream: lib_fn!(lib, "cudnnSetStream"),
        create_tensor: lib_fn!(lib, "cudnnCreateTensorDescriptor"),
        set_tensor_4d: lib_fn!(lib, "cudnnSetTensor4dDescriptor"),
        destroy_tensor: lib_fn!(lib, "cudnnDestroyTensorDescriptor"),
        create_filter: lib_fn!(lib, "cudnnCreateFilterDescriptor"),
        set_filter_4d: lib_fn!(lib, "cudnnSetFilter4dDescriptor"),
        destroy_filter: lib_fn!(lib, "cudnnDestroyFilterDescriptor"),
        create_conv: lib_fn!(lib, "cudnnCreateConvolutionDescriptor"),
        set_conv_2d: lib_fn!(lib, "cudnnSetConvolution2dDescriptor"),
        set_conv_math: lib_fn!(lib, "cudnnSetConvolutionMathType"),
        destroy_conv: lib_fn!(lib, "cudnnDestroyConvolutionDescriptor"),
        output_dim: lib_fn!(lib, "cudnnGetConvolution2dForwardOutputDim"),
        find: [
            lib_fn!(lib, "cudnnGetConvolutionForwardAlgorithm_v7"),
            lib_fn!(lib, "cudnnGetConvolutionBackwardDataAlgorithm_v7"),
            lib_fn!(lib, "cudnnGetConvolutionBackwardFilterAlgorithm_v7"),
        ],
        workspace: [
            lib_fn!(lib, "cudnnGetConvolutionForwardWorkspaceSize"),
            lib_fn!(lib, "cudnnGetConvolutionBackwardDataWorkspaceSize"),
            lib_fn!(lib, "cudnnGetConvolutionBackwardFilterWorkspaceSize"),
        ],
        run: [
            lib_fn!(lib, "cudnnConvolutionForward"),
            lib_fn!(lib, "cudnnConvolutionBackwardData"),
            lib_fn!(lib, "cudnnConvolutionBackwardFilter"),
        ],
        add_tensor: lib_fn!(lib, "cudnnAddTensor"),
    };
    // SAFETY: no arguments; returns a number.
    let v = unsafe { (api.get_version)() };
    if v < 8000 {
        return Err(format!("cuDNN {v} is too old (8.0 or newer is needed)"));
    }
    Ok(api)
}

/// The process's cuDNN functions, or why there are none.
fn api() -> std::result::Result<&'static Api, &'static str> {
    static API: Loaded<Api> = Loaded::new(load);
    API.get()
}

// SAFETY: `get_error_string` is `cudnnGetErrorString`, which returns a static NUL-terminated
// string (or null) for any status.
unsafe impl StatusText for Api {
    const LIBRARY: &'static str = "cuDNN";
    fn status_string(&self) -> unsafe extern "C" fn(Status) -> *const c_char {
        self.get_error_string
    }
}

/// The loaded cuDNN's version (e.g. 91400 for 9.14.0), or why it is unavailable.
pub fn version() -> std::result::Result<usize, String> {
    let api = api().map_err(str::to_string)?;
    // SAFETY: no arguments; returns a number.
    Ok(unsafe { (api.get_version)() })
}

fn index(dir: ConvDir) -> usize {
    match dir {
        ConvDir::Forward => 0,
        ConvDir::BackwardData => 1,
        ConvDir::BackwardFilter => 2,
    }
}

/// One cuDNN algorithm for a direction and geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AlgoInfo {
    /// The `cudnnConvolution*Algo_t` value.
    pub algo: u32,
    /// Workspace bytes it needs.
    pub workspace: usize,
    /// Whether cuDNN promises bit-identical results run to run.
    pub deterministic: bool,
}

/// What one set of descriptors describes: the geometry with its dilation, the data type of
/// x, w and y, the tensor format, and the math allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Spec {
    shape: ConvShape,
    /// `cudnnDataType_t` of x, w and y (the compute type is always FLOAT).
    dtype: u32,
    /// `cudnnTensorFormat_t` of x, y and the filter.
    format: u32,
    /// fp32 only: TF32 tensor cores allowed.
    tf32: bool,
}

/// The plan cache's key of a [`Spec`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    dims: [usize; 10],
    dtype: u32,
    format: u32,
    tf32: bool,
}

impl Spec {
    /// fp32 NCHW without dilation (the f32 engines' descriptors).
    fn f32(g: &ConvGeom, tf32: bool) -> Spec {
        Spec {
            shape: ConvShape::from(*g),
            dtype: FLOAT,
            format: NCHW,
            tf32,
        }
    }

    /// bf16 or f16 data (fp32 compute) in `layout`; an error for any other dtype.
    fn lowp(shape: &ConvShape, dtype: Dtype, layout: Layout) -> Result<Spec> {
        let dtype = match dtype {
            Dtype::Bf16 => BFLOAT16,
            Dtype::F16 => HALF,
            Dtype::F32 => {
                return Err(NnError::Dtype {
                    what: "cuDNN half-precision convolution (fp32: Cudnn::run)",
                    expected: "bf16 or f16",
                    found: "f32",
                })
            }
        };
        Ok(Spec {
            shape: *shape,
            dtype,
            format: match layout {
                Layout::Nchw => NCHW,
                Layout::Nhwc => NHWC,
            },
            tf32: false,
        })
    }

    fn half(&self) -> bool {
        self.dtype != FLOAT
    }

    fn key(&self) -> PlanKey {
        let g = &self.shape.geom;
        PlanKey {
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
            dtype: self.dtype,
            format: self.format,
            tf32: self.tf32,
        }
    }

    /// The convolution descriptor's math type: tensor cores for half data (their products
    /// of 16-bit values are exact, accumulated in fp32), FMA for fp32 unless TF32 is allowed.
    fn math(&self) -> u32 {
        if self.half() {
            TENSOR_OP_MATH
        } else if self.tf32 {
            DEFAULT_MATH
        } else {
            FMA_MATH
        }
    }

    /// Whether an algorithm cuDNN listed with `math_type` computes as this spec allows.
    fn admits(&self, math_type: u32) -> bool {
        if self.half() {
            // Half data: any math but the one that converts fp32 inputs down.
            math_type != TENSOR_OP_MATH_ALLOW_CONVERSION
        } else {
            math_type == FMA_MATH
                || math_type == DEFAULT_MATH
                || (self.tf32 && math_type == TENSOR_OP_MATH)
        }
    }
}

/// Descriptors of one geometry.
struct Plan {
    api: &'static Api,
    x: Ptr,
    w: Ptr,
    y: Ptr,
    bias: Ptr,
    conv: Ptr,
    /// Algorithms by direction, in cuDNN's heuristic order (filled on first request).
    algos: [Option<Vec<AlgoInfo>>; 3],
    /// Workspace bytes by (direction, algorithm).
    workspace: HashMap<(usize, u32), usize>,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by the matching create call (or is still null)
        // and is destroyed once, here; the owner has bound the context.
        unsafe {
            for t in [self.x, self.y, self.bias] {
                if !t.is_null() {
                    (self.api.destroy_tensor)(t);
                }
            }
            if !self.w.is_null() {
                (self.api.destroy_filter)(self.w);
            }
            if !self.conv.is_null() {
                (self.api.destroy_conv)(self.conv);
            }
        }
    }
}

struct State {
    handle: Ptr,
    /// Descriptors per geometry, data type, format and TF32 allowance.
    plans: HashMap<PlanKey, Plan>,
}

// SAFETY: the handle and descriptors are plain cuDNN objects, usable from any thread one call at
// a time; every use below holds the `Cudnn` mutex with the device's context bound.
unsafe impl Send for State {}

/// A cuDNN handle bound to one device (kept by the device's [`super::libraries::Libraries`]).
pub struct Cudnn {
    api: &'static Api,
    ctx: Context,
    state: Mutex<State>,
}

impl Drop for Cudnn {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if self.ctx.bind().is_ok() {
            st.plans.clear();
            // SAFETY: created by cudnnCreate, destroyed once, here; no call is in flight (we
            // own the state exclusively).
            unsafe {
                (self.api.destroy)(st.handle);
            }
        } else {
            // Without the context the descriptors cannot be destroyed safely; leak them.
            std::mem::forget(std::mem::take(&mut st.plans));
        }
    }
}

fn ci(what: &str, v: usize) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| NnError::Shape(format!("cuDNN: {what} = {v} exceeds an int")))
}

/// Whether cuDNN's legacy API can describe this geometry: positive dimensions, every tensor
/// below 2^31 elements.
pub fn supports(g: &ConvGeom) -> bool {
    supports_shape(&ConvShape::from(*g))
}

/// [`supports`] for a geometry with a dilation (which must fit an int too).
pub fn supports_shape(s: &ConvShape) -> bool {
    let g = &s.geom;
    let Ok((oh, ow)) = s.out_hw() else {
        return false;
    };
    let fits = |d: [usize; 4]| {
        d.iter().all(|&v| v > 0)
            && d.iter()
                .try_fold(1usize, |a, &b| a.checked_mul(b))
                .is_some_and(|v| v <= i32::MAX as usize)
    };
    fits([g.n, g.c, g.h, g.w])
        && fits([g.oc, g.c, g.kh, g.kw])
        && fits([g.n, g.oc, oh, ow])
        && i32::try_from(g.stride).is_ok()
        && i32::try_from(g.pad).is_ok()
        && i32::try_from(s.dilation).is_ok()
}

impl Cudnn {
    /// Loads cuDNN and creates a handle for `ctx`'s device. `Err` carries why cuDNN is
    /// unavailable (the caller prints it once and uses its own kernels).
    pub fn open(ctx: &Context) -> std::result::Result<Cudnn, String> {
        let api = api().map_err(str::to_string)?;
        ctx.bind().map_err(|e| e.to_string())?;
        let mut h: Ptr = std::ptr::null_mut();
        // SAFETY: writes one handle. Relaxed capture mode: creation may allocate.
        let st = with_relaxed_capture(|| unsafe { (api.create)(&mut h) });
        if st != SUCCESS || h.is_null() {
            return Err(format!("cudnnCreate failed: {}", describe(api, st)));
        }
        Ok(Cudnn {
            api,
            ctx: ctx.clone(),
            state: Mutex::new(State {
                handle: h,
                plans: HashMap::new(),
            }),
        })
    }

    fn check(&self, st: Status, call: &'static str) -> Result<()> {
        check(self.api, st, call)
    }

    /// The descriptors of `spec`, created on first use.
    fn plan<'s>(&self, st: &'s mut State, spec: &Spec) -> Result<&'s mut Plan> {
        if !supports_shape(&spec.shape) {
            return Err(NnError::Shape(format!(
                "cuDNN cannot describe the convolution {:?} (empty or over 2^31 elements)",
                spec.shape
            )));
        }
        Ok(match st.plans.entry(spec.key()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(new_plan_spec(self.api, spec)?)
            }
        })
    }

    /// (desc1, desc2, desc3) of a direction, in the order cuDNN's calls take them.
    fn descs(p: &Plan, dir: ConvDir) -> (Ptr, Ptr, Ptr) {
        match dir {
            ConvDir::Forward => (p.x, p.w, p.y),
            ConvDir::BackwardData => (p.w, p.y, p.x),
            ConvDir::BackwardFilter => (p.x, p.y, p.w),
        }
    }

    /// cuDNN's algorithms for a direction and geometry, in its heuristic order: only those
    /// that run without tensor cores (FMA), need at most `max_workspace` bytes and, with
    /// `deterministic`, give bit-identical results run to run.
    pub fn algos(
        &self,
        dir: ConvDir,
        g: &ConvGeom,
        deterministic: bool,
        max_workspace: usize,
    ) -> Result<Vec<AlgoInfo>> {
        self.algos_math(dir, g, deterministic, max_workspace, false)
    }

    /// As [`Cudnn::algos`]; with `tf32`, of the descriptors that allow TF32 tensor cores
    /// (`CUDNN_DEFAULT_MATH`), also the algorithms that use them (never those that convert
    /// to half precision).
    pub fn algos_math(
        &self,
        dir: ConvDir,
        g: &ConvGeom,
        deterministic: bool,
        max_workspace: usize,
        tf32: bool,
    ) -> Result<Vec<AlgoInfo>> {
        self.algos_spec(dir, &Spec::f32(g, tf32), deterministic, max_workspace)
    }

    /// cuDNN's algorithms for one direction of a half-precision convolution (`dtype` bf16 or
    /// f16 for x, w and y, fp32 compute, tensors in `layout`), in its heuristic order, chosen
    /// as [`Cudnn::algos`] chooses but admitting tensor-core algorithms. A `dtype` of f32 is
    /// a typed error (fp32 has [`Cudnn::algos_math`]).
    pub fn algos_lowp(
        &self,
        dir: ConvDir,
        shape: &ConvShape,
        dtype: Dtype,
        layout: Layout,
        deterministic: bool,
        max_workspace: usize,
    ) -> Result<Vec<AlgoInfo>> {
        let spec = Spec::lowp(shape, dtype, layout)?;
        self.algos_spec(dir, &spec, deterministic, max_workspace)
    }

    fn algos_spec(
        &self,
        dir: ConvDir,
        spec: &Spec,
        deterministic: bool,
        max_workspace: usize,
    ) -> Result<Vec<AlgoInfo>> {
        self.ctx.bind()?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let handle = st.handle;
        let p = self.plan(&mut st, spec)?;
        let d = index(dir);
        if p.algos[d].is_none() {
            let (d1, d2, d3) = Self::descs(p, dir);
            let mut perf = [AlgoPerf::default(); 16];
            let mut got: c_int = 0;
            // SAFETY: live handle and descriptors; cuDNN writes at most `requested` (16)
            // entries into `perf` and their count into `got`.
            self.check(
                unsafe {
                    (self.api.find[d])(handle, d1, d2, p.conv, d3, 16, &mut got, perf.as_mut_ptr())
                },
                "cudnnGetConvolution*Algorithm_v7",
            )?;
            let got = (got.max(0) as usize).min(perf.len());
            let mut list: Vec<AlgoInfo> = Vec::new();
            for r in &perf[..got] {
                if r.status == SUCCESS
                    && spec.admits(r.math_type)
                    && !list.iter().any(|a| a.algo == r.algo)
                {
                    list.push(AlgoInfo {
                        algo: r.algo,
                        workspace: r.memory,
                        deterministic: r.determinism == DETERMINISTIC,
                    });
                }
            }
            p.algos[d] = Some(list);
        }
        Ok(p.algos[d]
            .iter()
            .flatten()
            .filter(|a| (a.deterministic || !deterministic) && a.workspace <= max_workspace)
            .copied()
            .collect())
    }

    /// Runs `algo` for one direction. Buffers by direction (as [`crate::engine::conv`]): forward
    /// `a = x`, `b = w`, `out = y`; backward-data `a = dy`, `b = w`, `out = dx`;
    /// backward-filter `a = dy`, `b = x`, `out = dw`. A forward bias is added after, by the
    /// engine [`crate::engine::conv`] chooses ([`Cudnn::add_bias`] is one).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        algo: u32,
        g: &ConvGeom,
        a: &DeviceBuffer<f32>,
        b: &DeviceBuffer<f32>,
        out: &DeviceBuffer<f32>,
    ) -> Result<()> {
        self.run_math(q, dir, algo, g, a, b, out, false)
    }

    /// As [`Cudnn::run`], with the descriptors that allow TF32 tensor cores when `tf32` (an
    /// algorithm of [`Cudnn::algos_math`] with the same `tf32`).
    #[allow(clippy::too_many_arguments)]
    pub fn run_math(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        algo: u32,
        g: &ConvGeom,
        a: &DeviceBuffer<f32>,
        b: &DeviceBuffer<f32>,
        out: &DeviceBuffer<f32>,
        tf32: bool,
    ) -> Result<()> {
        // Each extent checked, the buffers by role.
        let (x, w, y) = conv_roles(dir, g, (a, b, out), None)?;
        handle_on_device(q, "cuDNN handle", self.ctx.ordinal())?;
        conv_on_device(q, dir, (a, b, out), None)?;
        let roles = [
            RoleBuf::of("conv2d x", x),
            RoleBuf::of("conv2d w", w),
            RoleBuf::of("conv2d y", y),
        ];
        self.run_roles(q, dir, algo, &Spec::f32(g, tf32), roles)
    }

    /// Runs `algo` (of [`Cudnn::algos_lowp`] for the same `shape` and `layout`) for one
    /// direction of a half-precision convolution: x, w and y of `T` (bf16 or f16; f32 is a
    /// typed error), in `layout` (`NHWC`: weights `OHWI`), fp32 accumulation. Buffers by
    /// direction as [`Cudnn::run`].
    #[allow(clippy::too_many_arguments)]
    pub fn run_lowp<T: Float>(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        algo: u32,
        shape: &ConvShape,
        layout: Layout,
        a: &DeviceBuffer<T>,
        b: &DeviceBuffer<T>,
        out: &DeviceBuffer<T>,
    ) -> Result<()> {
        let spec = Spec::lowp(shape, T::DTYPE, layout)?;
        handle_on_device(q, "cuDNN handle", self.ctx.ordinal())?;
        let (roles, _) = shape_roles(q, dir, shape, (a, b, out), None)?;
        self.run_roles(q, dir, algo, &spec, roles)
    }

    /// Runs `algo` on buffers `[x, w, y]` (by role) whose extents and device were checked
    /// against `spec`'s geometry.
    fn run_roles(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        algo: u32,
        spec: &Spec,
        [x, w, y]: [RoleBuf<'_>; 3],
    ) -> Result<()> {
        // The handle, the buffers (checked by the callers) and (below) the workspace are all
        // the queue's device's.
        handle_on_device(q, "cuDNN handle", self.ctx.ordinal())?;
        // (ptr1, ptr2, ptr3) in cuDNN's argument order.
        let (p1, p2, p3) = match dir {
            ConvDir::Forward => (x, w, y),
            ConvDir::BackwardData => (w, y, x),
            ConvDir::BackwardFilter => (x, y, w),
        };
        self.ctx.bind()?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let handle = st.handle;
        let p = self.plan(&mut st, spec)?;
        let d = index(dir);
        let (d1, d2, d3) = Self::descs(p, dir);
        let ws_bytes = match p.workspace.get(&(d, algo)) {
            Some(&b) => b,
            None => {
                let mut bytes = 0usize;
                // SAFETY: live handle and descriptors; writes one size. An algorithm cuDNN
                // does not support here is an error status, not a call.
                self.check(
                    unsafe {
                        (self.api.workspace[d])(handle, d1, d2, p.conv, d3, algo, &mut bytes)
                    },
                    "cudnnGetConvolution*WorkspaceSize",
                )?;
                p.workspace.insert((d, algo), bytes);
                bytes
            }
        };
        let ws = if ws_bytes > 0 {
            Some(q.alloc::<u8>(ws_bytes)?)
        } else {
            None
        };
        if let Some(ws) = &ws {
            on_device(q, [("cuDNN workspace", ws.block())])?;
        }
        for buf in [p1, p2, p3] {
            q.use_block(buf.block);
        }
        if let Some(ws) = &ws {
            q.use_block(ws.block());
        }
        let (one, zero) = (1.0f32, 0.0f32);
        let one_p = &one as *const f32 as CPtr;
        let zero_p = &zero as *const f32 as CPtr;
        let ws_p = ws
            .as_ref()
            .map_or(std::ptr::null_mut(), |w| w.addr() as Ptr);
        let stream = q.stream_handle().raw() as Ptr;
        // SAFETY: the handle and descriptors are live (held under the lock); the descriptors
        // describe exactly the geometry whose extents the callers checked against the buffers
        // (the same element count in either layout, elements of the spec's data type: `f32`
        // for the fp32 spec, `T` whose dtype made the half spec), so cuDNN reads and writes
        // inside them; alpha and beta are floats, as cuDNN takes them for fp32 compute; the buffers and the workspace are memory of
        // the queue's device, the handle's (checked); the workspace holds the `ws_bytes` cuDNN
        // asked for this algorithm; every buffer is kept alive and ordered by `use_block` (a
        // capture keeps them); alpha/beta are read before the call returns.
        unsafe {
            self.check((self.api.set_stream)(handle, stream), "cudnnSetStream")?;
            self.check(
                (self.api.run[d])(
                    handle,
                    one_p,
                    d1,
                    p1.addr as CPtr,
                    d2,
                    p2.addr as CPtr,
                    p.conv,
                    algo,
                    ws_p,
                    ws_bytes,
                    zero_p,
                    d3,
                    p3.addr as Ptr,
                ),
                match dir {
                    ConvDir::Forward => "cudnnConvolutionForward",
                    ConvDir::BackwardData => "cudnnConvolutionBackwardData",
                    ConvDir::BackwardFilter => "cudnnConvolutionBackwardFilter",
                },
            )?;
        }
        Ok(())
    }

    /// `y += bias` broadcast over the images and pixels of a forward output of `g`
    /// (`cudnnAddTensor`).
    pub fn add_bias(
        &self,
        q: &dyn Queue,
        g: &ConvGeom,
        bias: &DeviceBuffer<f32>,
        y: &DeviceBuffer<f32>,
    ) -> Result<()> {
        need("conv2d bias", bias, g.oc)?;
        need("conv2d y", y, g.output_len()?)?;
        handle_on_device(q, "cuDNN handle", self.ctx.ordinal())?;
        on_device(q, [("conv2d bias", bias.block()), ("conv2d y", y.block())])?;
        self.ctx.bind()?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let handle = st.handle;
        let p = self.plan(&mut st, &Spec::f32(g, false))?;
        q.use_block(bias.block());
        q.use_block(y.block());
        let one = 1.0f32;
        let one_p = &one as *const f32 as CPtr;
        let stream = q.stream_handle().raw() as Ptr;
        // SAFETY: live handle and descriptors (held under the lock); `p.bias` describes oc
        // values and `p.y` the forward output of `g`, both checked against the buffers above
        // (memory of the queue's device, the handle's), which `use_block` keeps alive and
        // ordered; alpha is read before the call returns.
        unsafe {
            self.check((self.api.set_stream)(handle, stream), "cudnnSetStream")?;
            self.check(
                (self.api.add_tensor)(
                    handle,
                    one_p,
                    p.bias,
                    bias.addr() as CPtr,
                    one_p,
                    p.y,
                    y.addr() as Ptr,
                ),
                "cudnnAddTensor",
            )
        }
    }
}

/// The fp32 NCHW descriptors of `g` (no handle needed); TF32 allowed only when `tf32`.
#[cfg(test)]
fn new_plan(a: &'static Api, g: &ConvGeom, tf32: bool) -> Result<Plan> {
    new_plan_spec(a, &Spec::f32(g, tf32))
}

/// The descriptors of `spec` (no handle needed).
fn new_plan_spec(a: &'static Api, spec: &Spec) -> Result<Plan> {
    let chk = |st, call| check(a, st, call);
    let g = &spec.shape.geom;
    let (oh, ow) = spec.shape.out_hw()?;
    let mut p = Plan {
        api: a,
        x: std::ptr::null_mut(),
        w: std::ptr::null_mut(),
        y: std::ptr::null_mut(),
        bias: std::ptr::null_mut(),
        conv: std::ptr::null_mut(),
        algos: [None, None, None],
        workspace: HashMap::new(),
    };
    let (n, c, h, w) = (ci("n", g.n)?, ci("c", g.c)?, ci("h", g.h)?, ci("w", g.w)?);
    let (oc, kh, kw) = (ci("oc", g.oc)?, ci("kh", g.kh)?, ci("kw", g.kw)?);
    let (s, pad, ohi, owi) = (
        ci("stride", g.stride)?,
        ci("pad", g.pad)?,
        ci("oh", oh)?,
        ci("ow", ow)?,
    );
    let dil = ci("dilation", spec.shape.dilation)?;
    let (fmt, dt) = (spec.format, spec.dtype);
    // SAFETY: each create writes one descriptor into `p` (destroyed by Plan's Drop, also on
    // the early returns); each set call receives a live descriptor and plain integers.
    unsafe {
        chk((a.create_tensor)(&mut p.x), "cudnnCreateTensorDescriptor")?;
        chk((a.create_tensor)(&mut p.y), "cudnnCreateTensorDescriptor")?;
        chk(
            (a.create_tensor)(&mut p.bias),
            "cudnnCreateTensorDescriptor",
        )?;
        chk((a.create_filter)(&mut p.w), "cudnnCreateFilterDescriptor")?;
        chk(
            (a.create_conv)(&mut p.conv),
            "cudnnCreateConvolutionDescriptor",
        )?;
        // Dimensions are always given as (n, c, h, w) and (k, c, r, s); the format says how
        // they lie in memory (NHWC: channels last, the filter KRSC).
        chk(
            (a.set_tensor_4d)(p.x, fmt, dt, n, c, h, w),
            "cudnnSetTensor4dDescriptor",
        )?;
        chk(
            (a.set_filter_4d)(p.w, dt, fmt, oc, c, kh, kw),
            "cudnnSetFilter4dDescriptor",
        )?;
        // The compute type is FLOAT for every data type (fp32, PSEUDO_HALF,
        // PSEUDO_BFLOAT16 configurations).
        chk(
            (a.set_conv_2d)(p.conv, pad, pad, s, s, dil, dil, CROSS_CORRELATION, FLOAT),
            "cudnnSetConvolution2dDescriptor",
        )?;
        // fp32: no TF32 (only FMA kernels) unless allowed, then cuDNN's default, which for
        // fp32 data lets it use TF32 tensor cores. Half data: tensor cores.
        chk(
            (a.set_conv_math)(p.conv, spec.math()),
            "cudnnSetConvolutionMathType",
        )?;
        let (mut dn, mut dc, mut dh, mut dw) = (0, 0, 0, 0);
        chk(
            (a.output_dim)(p.conv, p.x, p.w, &mut dn, &mut dc, &mut dh, &mut dw),
            "cudnnGetConvolution2dForwardOutputDim",
        )?;
        if (dn, dc, dh, dw) != (n, oc, ohi, owi) {
            return Err(NnError::Library {
                library: "cuDNN",
                call: "cudnnGetConvolution2dForwardOutputDim",
                status: format!(
                    "output {dn}×{dc}×{dh}×{dw}, expected {n}×{oc}×{ohi}×{owi} for {:?}",
                    spec.shape
                ),
            });
        }
        chk(
            (a.set_tensor_4d)(p.y, fmt, dt, n, oc, ohi, owi),
            "cudnnSetTensor4dDescriptor",
        )?;
        chk(
            (a.set_tensor_4d)(p.bias, fmt, dt, 1, oc, 1, 1),
            "cudnnSetTensor4dDescriptor",
        )?;
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perf_struct_matches_the_header_layout() {
        // int algo; cudnnStatus_t status; float time; size_t memory; cudnnDeterminism_t;
        // cudnnMathType_t; int reserved[3];
        assert_eq!(std::mem::size_of::<AlgoPerf>(), 48);
        assert_eq!(std::mem::offset_of!(AlgoPerf, memory), 16);
        assert_eq!(std::mem::offset_of!(AlgoPerf, math_type), 28);
    }

    /// Where cuDNN is installed (the GPU machine), every symbol resolves and the library
    /// answers; elsewhere the reason it is unavailable is a message, not a panic.
    #[test]
    fn every_symbol_resolves_where_cudnn_is_installed() {
        match api() {
            Ok(api) => {
                // SAFETY: no arguments.
                let v = unsafe { (api.get_version)() };
                assert!(v >= 8000, "version {v}");
                assert!(describe(api, SUCCESS).contains("SUCCESS"));
                println!("cuDNN {v}");
            }
            Err(why) => println!("cuDNN unavailable here: {why}"),
        }
    }

    /// Where cuDNN is installed: the descriptors of odd geometries are accepted and cuDNN
    /// computes the same output size as `ConvGeom::out_hw` (descriptors need no GPU).
    #[test]
    fn descriptors_match_our_geometry_where_cudnn_is_installed() {
        let Ok(api) = api() else {
            println!("cuDNN unavailable here");
            return;
        };
        let g = |n, c, h, w, oc, kh, kw, stride, pad| ConvGeom {
            n,
            c,
            h,
            w,
            oc,
            kh,
            kw,
            stride,
            pad,
        };
        for geom in [
            g(1, 1, 8, 8, 1, 1, 1, 1, 0),
            g(2, 3, 11, 13, 5, 3, 3, 2, 1),
            g(3, 7, 9, 9, 4, 7, 7, 1, 1),
            g(1, 16, 17, 17, 33, 5, 5, 2, 0),
            g(2, 5, 6, 7, 3, 2, 3, 1, 0),
        ] {
            let p = new_plan(api, &geom, false).unwrap();
            assert!(!p.x.is_null() && !p.w.is_null() && !p.y.is_null() && !p.conv.is_null());
        }
        // A geometry cuDNN cannot describe is an error, not a crash.
        assert!(new_plan(api, &g(1, 1, 2, 2, 1, 3, 3, 1, 0), false).is_err());
    }

    #[test]
    fn geometry_support_is_checked_without_cudnn() {
        let g = ConvGeom {
            n: 2,
            c: 3,
            h: 8,
            w: 8,
            oc: 4,
            kh: 3,
            kw: 3,
            stride: 1,
            pad: 1,
        };
        assert!(supports(&g));
        assert!(!supports(&ConvGeom { n: 0, ..g }));
        assert!(!supports(&ConvGeom {
            n: 1 << 20,
            c: 64,
            h: 64,
            w: 64,
            ..g
        }));
    }
}
