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

use std::collections::HashMap;
use std::ffi::c_char;
use std::sync::{Mutex, Once};

use cudagraph::runtime::{with_relaxed_capture, Context};
use cudagraph::{DeviceBuffer, Queue, QueueExt};
use cudarc::cudnn::sys as cs;

use super::loader::{
    check, describe, error, lib_fn, CPtr, Loaded, Ptr, Status, StatusText, SUCCESS,
};
use crate::error::{NnError, Result};
use crate::extent::{
    alignment, conv_key, conv_on_device, conv_roles, handle_on_device, on_device, ConvDir, ConvGeom,
};

const LIBRARY: &str = "cuDNN graph API";
const NOT_BUILT: &str = "no plan was built before the capture (run it eagerly first)";

/// At most this many candidates per key (the first built plans in heuristic order), so that
/// measuring them stays fast (PyTorch's `cudnn.benchmark_limit` is 10).
pub const CAP: usize = 8;

/// At most this many fused convolution + bias candidates per key (their engines may compile
/// at run time, when the set is built).
pub const FUSED_CAP: usize = 4;

/// The largest byte alignment a plan is built for (cudnn-frontend's and PyTorch's too).
pub const MAX_ALIGN: u32 = 16;

/// The alignment candidates are listed for: our buffers start at the start of an allocator
/// block (256-byte aligned), so every pointer a convolution gets has [`MAX_ALIGN`]. `run`
/// computes it from the actual pointers all the same (and builds plans for it when eager).
const LIST_ALIGN: u32 = MAX_ALIGN;

const NOT_SUPPORTED: std::ops::RangeInclusive<Status> = 3000..=3999;

// cudnnBackendDescriptorType_t
const D_POINTWISE: u32 = 0;
const D_CONVOLUTION: u32 = 1;
const D_ENGINE: u32 = 2;
const D_ENGINECFG: u32 = 3;
const D_ENGINEHEUR: u32 = 4;
const D_EXECUTION_PLAN: u32 = 5;
const D_KNOB_CHOICE: u32 = 7;
const D_OP_CONV_FORWARD: u32 = 10;
const D_OP_CONV_BACKWARD_FILTER: u32 = 11;
const D_OP_CONV_BACKWARD_DATA: u32 = 12;
const D_OP_POINTWISE: u32 = 13;
const D_OPERATION_GRAPH: u32 = 15;
const D_VARIANT_PACK: u32 = 16;
const D_TENSOR: u32 = 17;

// cudnnBackendAttributeType_t
const T_HANDLE: u32 = 0;
const T_DATA_TYPE: u32 = 1;
const T_BOOLEAN: u32 = 2;
const T_INT64: u32 = 3;
const T_FLOAT: u32 = 4;
const T_VOID_PTR: u32 = 6;
const T_CONVOLUTION_MODE: u32 = 7;
const T_HEUR_MODE: u32 = 8;
const T_KNOB_TYPE: u32 = 9;
const T_NUMERICAL_NOTE: u32 = 11;
const T_POINTWISE_MODE: u32 = 14;
const T_BACKEND_DESCRIPTOR: u32 = 15;
const T_BEHAVIOR_NOTE: u32 = 19;

// cudnnBackendAttributeName_t
const A_POINTWISE_MODE: u32 = 0;
const A_POINTWISE_MATH_PREC: u32 = 1;
const A_CONV_COMP_TYPE: u32 = 100;
const A_CONV_MODE: u32 = 101;
const A_CONV_DILATIONS: u32 = 102;
const A_CONV_FILTER_STRIDES: u32 = 103;
const A_CONV_POST_PADDINGS: u32 = 104;
const A_CONV_PRE_PADDINGS: u32 = 105;
const A_CONV_SPATIAL_DIMS: u32 = 106;
const A_HEUR_MODE: u32 = 200;
const A_HEUR_OPERATION_GRAPH: u32 = 201;
const A_HEUR_RESULTS: u32 = 202;
const A_CFG_ENGINE: u32 = 300;
const A_CFG_KNOB_CHOICES: u32 = 302;
const A_PLAN_HANDLE: u32 = 400;
const A_PLAN_ENGINE_CONFIG: u32 = 401;
const A_PLAN_WORKSPACE_SIZE: u32 = 402;
const A_KNOB_TYPE: u32 = 600;
const A_KNOB_VALUE: u32 = 601;
const A_OP_POINTWISE_PW_DESCRIPTOR: u32 = 750;
const A_OP_POINTWISE_XDESC: u32 = 751;
const A_OP_POINTWISE_BDESC: u32 = 752;
const A_OP_POINTWISE_YDESC: u32 = 753;
const A_GRAPH_HANDLE: u32 = 800;
const A_GRAPH_OPS: u32 = 801;
const A_TENSOR_BYTE_ALIGNMENT: u32 = 900;
const A_TENSOR_DATA_TYPE: u32 = 901;
const A_TENSOR_DIMENSIONS: u32 = 902;
const A_TENSOR_STRIDES: u32 = 903;
const A_TENSOR_UNIQUE_ID: u32 = 906;
const A_TENSOR_IS_VIRTUAL: u32 = 907;
const A_VP_UNIQUE_IDS: u32 = 1000;
const A_VP_DATA_POINTERS: u32 = 1001;
const A_VP_WORKSPACE: u32 = 1003;
const A_ENGINE_GLOBAL_INDEX: u32 = 1301;
const A_ENGINE_NUMERICAL_NOTE: u32 = 1303;
const A_ENGINE_BEHAVIOR_NOTE: u32 = 1305;

// Values.
const DATA_FLOAT: i32 = 0;
const CROSS_CORRELATION: i32 = 1;
const POINTWISE_ADD: i32 = 0;
const HEUR_INSTANT: i32 = 0;
const HEUR_FALLBACK: i32 = 2;
const NOTE_TENSOR_CORE: i32 = 0;
const NOTE_DOWN_CONVERT_INPUTS: i32 = 1;
const NOTE_REDUCED_PRECISION_REDUCTION: i32 = 2;
const NOTE_NONDETERMINISTIC: i32 = 4;

/// Unique ids of the three tensors in every direction: `x`/`dx`, `w`/`dw`, `y`/`dy`.
const UID_X: i64 = 1;
const UID_W: i64 = 2;
const UID_Y: i64 = 3;
/// The bias of the fused forward (`[1, K, 1, 1]`).
const UID_BIAS: i64 = 4;
/// The fused forward's convolution output: virtual (never in memory, never in a variant pack).
const UID_CONV_OUT: i64 = 5;

/// Knob choices read per configuration (cuDNN 9 has 44 knob types).
const MAX_KNOBS: usize = 64;
/// Notes read per engine (cuDNN 9 has 10 numerical and 5 behaviour notes).
const MAX_NOTES: i64 = 16;

/// The cuDNN functions this module calls, with the signatures of cuDNN 9's headers.
struct Api {
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    create: unsafe extern "C" fn(*mut Ptr) -> Status,
    destroy: unsafe extern "C" fn(Ptr) -> Status,
    set_stream: unsafe extern "C" fn(Ptr, Ptr) -> Status,
    /// (type, &descriptor)
    backend_create: unsafe extern "C" fn(u32, *mut Ptr) -> Status,
    backend_destroy: unsafe extern "C" fn(Ptr) -> Status,
    /// (descriptor, name, type, count, values)
    backend_set: unsafe extern "C" fn(Ptr, u32, u32, i64, CPtr) -> Status,
    /// (descriptor, name, type, requested, &count, values)
    backend_get: unsafe extern "C" fn(Ptr, u32, u32, i64, *mut i64, Ptr) -> Status,
    backend_finalize: unsafe extern "C" fn(Ptr) -> Status,
    /// (handle, plan, variant pack)
    backend_execute: unsafe extern "C" fn(Ptr, Ptr, Ptr) -> Status,
}

fn load() -> std::result::Result<Api, String> {
    // Loads libcudnn and checks its sub-libraries (the shim aborts the process when one is
    // missing) before any function is called.
    let version = crate::ffi::cudnn::version()?;
    if version < 90000 {
        return Err(format!(
            "cuDNN {version} is older than 9.0 (the backend attributes used are cuDNN 9's)"
        ));
    }
    // SAFETY: libcudnn loads (`version` succeeded), so `culib` returns it instead of panicking.
    let lib = unsafe { cs::culib() };
    Ok(Api {
        get_error_string: lib_fn!(lib, "cudnnGetErrorString"),
        create: lib_fn!(lib, "cudnnCreate"),
        destroy: lib_fn!(lib, "cudnnDestroy"),
        set_stream: lib_fn!(lib, "cudnnSetStream"),
        backend_create: lib_fn!(lib, "cudnnBackendCreateDescriptor"),
        backend_destroy: lib_fn!(lib, "cudnnBackendDestroyDescriptor"),
        backend_set: lib_fn!(lib, "cudnnBackendSetAttribute"),
        backend_get: lib_fn!(lib, "cudnnBackendGetAttribute"),
        backend_finalize: lib_fn!(lib, "cudnnBackendFinalize"),
        backend_execute: lib_fn!(lib, "cudnnBackendExecute"),
    })
}

/// The process's backend functions, or why there are none.
fn api() -> std::result::Result<&'static Api, &'static str> {
    static API: Loaded<Api> = Loaded::new(load);
    API.get()
}

// SAFETY: `get_error_string` is `cudnnGetErrorString`, which returns a static NUL-terminated
// string (or null) for any status.
unsafe impl StatusText for Api {
    const LIBRARY: &'static str = LIBRARY;
    fn status_string(&self) -> unsafe extern "C" fn(Status) -> *const c_char {
        self.get_error_string
    }
}

/// Prints once why the graph API is unavailable — unless cuDNN itself is missing, which the
/// legacy path already reports.
pub(crate) fn notice_once(why: &str) {
    static ONCE: Once = Once::new();
    if crate::ffi::cudnn::version().is_err() {
        return;
    }
    ONCE.call_once(|| {
        eprintln!(
            "cudagraph-nn: cuDNN graph API unavailable ({why}); convolutions use cuDNN's \
             legacy API and cudagraph's own kernels"
        );
    });
}

/// The error of `call` for a `map_err`.
fn err_of(api: &'static Api, call: &'static str) -> impl Fn(Status) -> NnError {
    move |st| error(api, st, call)
}

/// One backend descriptor, destroyed on drop.
struct Desc {
    api: &'static Api,
    raw: Ptr,
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by cudnnBackendCreateDescriptor and destroyed once, here; descriptors
        // that refer to it are dropped first (field order of their owners).
        unsafe {
            (self.api.backend_destroy)(self.raw);
        }
    }
}

type St<T> = std::result::Result<T, Status>;

fn status(st: Status) -> St<()> {
    if st == SUCCESS {
        Ok(())
    } else {
        Err(st)
    }
}

impl Desc {
    fn new(api: &'static Api, ty: u32) -> St<Desc> {
        let mut raw: Ptr = std::ptr::null_mut();
        // SAFETY: writes one descriptor handle into `raw`.
        status(unsafe { (api.backend_create)(ty, &mut raw) })?;
        if raw.is_null() {
            return Err(2002); // BAD_PARAM_NULL_POINTER
        }
        Ok(Desc { api, raw })
    }

    fn many(api: &'static Api, ty: u32, n: usize) -> St<Vec<Desc>> {
        (0..n).map(|_| Desc::new(api, ty)).collect()
    }

    fn set_i64(&self, name: u32, vals: &[i64]) -> St<()> {
        // SAFETY: live descriptor; `vals` holds `len` 8-byte integers, the C type of INT64
        // attributes; cuDNN copies them before returning.
        status(unsafe {
            (self.api.backend_set)(
                self.raw,
                name,
                T_INT64,
                vals.len() as i64,
                vals.as_ptr().cast(),
            )
        })
    }

    /// An attribute whose type is one of cuDNN's 4-byte enums (data type, mode, ...).
    fn set_enum(&self, name: u32, ty: u32, v: i32) -> St<()> {
        // SAFETY: live descriptor; one 4-byte integer, the C size of cuDNN's enums; copied
        // before returning.
        status(unsafe { (self.api.backend_set)(self.raw, name, ty, 1, (&v as *const i32).cast()) })
    }

    fn set_bool(&self, name: u32, v: bool) -> St<()> {
        // SAFETY: live descriptor; one C `bool` (one byte, the type of BOOLEAN attributes);
        // copied before returning.
        status(unsafe {
            (self.api.backend_set)(self.raw, name, T_BOOLEAN, 1, (&v as *const bool).cast())
        })
    }

    fn set_f32(&self, name: u32, v: f32) -> St<()> {
        // SAFETY: live descriptor; one C float; copied before returning.
        status(unsafe {
            (self.api.backend_set)(self.raw, name, T_FLOAT, 1, (&v as *const f32).cast())
        })
    }

    fn set_descs(&self, name: u32, ds: &[&Desc]) -> St<()> {
        let raws: Vec<Ptr> = ds.iter().map(|d| d.raw).collect();
        // SAFETY: live descriptors; an array of `len` descriptor handles, the C type of
        // BACKEND_DESCRIPTOR attributes; cuDNN reads them before returning (the referenced
        // descriptors are kept alive by our owners regardless).
        status(unsafe {
            (self.api.backend_set)(
                self.raw,
                name,
                T_BACKEND_DESCRIPTOR,
                raws.len() as i64,
                raws.as_ptr().cast(),
            )
        })
    }

    fn set_handle(&self, name: u32, h: Ptr) -> St<()> {
        // SAFETY: live descriptor; one cudnnHandle_t (live for as long as the descriptor:
        // the handle is destroyed after every descriptor).
        status(unsafe {
            (self.api.backend_set)(self.raw, name, T_HANDLE, 1, (&h as *const Ptr).cast())
        })
    }

    fn set_ptrs(&self, name: u32, ps: &[Ptr]) -> St<()> {
        // SAFETY: live descriptor; an array of `len` void pointers; copied before returning.
        status(unsafe {
            (self.api.backend_set)(
                self.raw,
                name,
                T_VOID_PTR,
                ps.len() as i64,
                ps.as_ptr().cast(),
            )
        })
    }

    fn finalize(&self) -> St<()> {
        // SAFETY: live descriptor whose attributes were set above.
        status(unsafe { (self.api.backend_finalize)(self.raw) })
    }

    fn get_i64(&self, name: u32) -> St<i64> {
        let (mut v, mut n) = (0i64, 0i64);
        // SAFETY: live descriptor; room for the one 8-byte integer requested.
        status(unsafe {
            (self.api.backend_get)(
                self.raw,
                name,
                T_INT64,
                1,
                &mut n,
                (&mut v as *mut i64).cast(),
            )
        })?;
        Ok(v)
    }

    /// Up to `max` values of a 4-byte enum attribute, as raw integers.
    fn get_enums(&self, name: u32, ty: u32, max: i64) -> St<Vec<i32>> {
        let mut v = vec![0i32; max as usize];
        let mut n = 0i64;
        // SAFETY: live descriptor; room for `max` 4-byte values, cuDNN writes at most that many.
        status(unsafe {
            (self.api.backend_get)(self.raw, name, ty, max, &mut n, v.as_mut_ptr().cast())
        })?;
        v.truncate(n.clamp(0, max) as usize);
        Ok(v)
    }

    /// How many descriptors a descriptor-array attribute holds.
    fn count(&self, name: u32) -> St<usize> {
        let mut n = 0i64;
        // SAFETY: live descriptor; requesting 0 elements with a null array only writes the count.
        status(unsafe {
            (self.api.backend_get)(
                self.raw,
                name,
                T_BACKEND_DESCRIPTOR,
                0,
                &mut n,
                std::ptr::null_mut(),
            )
        })?;
        Ok(n.max(0) as usize)
    }

    /// Fills the pre-created descriptors `into` from a descriptor-array attribute; returns how
    /// many were filled.
    fn get_descs(&self, name: u32, into: &[Desc]) -> St<usize> {
        let mut raws: Vec<Ptr> = into.iter().map(|d| d.raw).collect();
        let mut n = 0i64;
        // SAFETY: live descriptors; an array of `len` created descriptors of the attribute's
        // type, which cuDNN fills in place (the handles themselves are not replaced).
        status(unsafe {
            (self.api.backend_get)(
                self.raw,
                name,
                T_BACKEND_DESCRIPTOR,
                raws.len() as i64,
                &mut n,
                raws.as_mut_ptr().cast(),
            )
        })?;
        Ok((n.max(0) as usize).min(into.len()))
    }
}

/// What the heuristics say about one engine configuration (raw integers as cuDNN gave them).
#[derive(Clone, Debug, PartialEq, Eq)]
struct ConfigInfo {
    /// `CUDNN_ATTR_ENGINE_GLOBAL_INDEX`.
    engine: i64,
    /// (knob type, value), sorted.
    knobs: Vec<(i32, i64)>,
    /// `cudnnBackendNumericalNote_t` values.
    notes: Vec<i32>,
    /// `cudnnBackendBehaviorNote_t` values.
    behavior: Vec<i32>,
}

/// Whether an engine with these numerical notes computes in plain fp32 (FMA): no tensor cores
/// (TF32), no down-converted inputs, no reduced-precision reduction. Unknown notes are ignored.
fn fp32_fma(notes: &[i32]) -> bool {
    !notes.iter().any(|&n| {
        matches!(
            n,
            NOTE_TENSOR_CORE | NOTE_DOWN_CONVERT_INPUTS | NOTE_REDUCED_PRECISION_REDUCTION
        )
    })
}

fn nondeterministic(notes: &[i32]) -> bool {
    notes.contains(&NOTE_NONDETERMINISTIC)
}

/// `eng20 k2=6 k3=0`: engine index and knob choices (the identity used to remove duplicates).
fn tag(engine: i64, knobs: &[(i32, i64)]) -> String {
    let mut s = format!("eng{engine}");
    for (t, v) in knobs {
        s.push_str(&format!(" k{t}={v}"));
    }
    s
}

/// The configurations kept, as indices into `infos` (heuristic order): plain fp32 only, the
/// first of each (engine, knobs), at most 256 (ranks are `u8`).
fn select(infos: &[ConfigInfo]) -> Vec<usize> {
    let mut seen = std::collections::HashSet::new();
    infos
        .iter()
        .enumerate()
        .filter(|(_, c)| fp32_fma(&c.notes))
        .filter(|(_, c)| seen.insert((c.engine, c.knobs.clone())))
        .map(|(i, _)| i)
        .take(u8::MAX as usize + 1)
        .collect()
}

/// The candidates among built plans `(rank, deterministic, workspace)` in rank order: the
/// first `cap` ([`CAP`], or [`FUSED_CAP`] for the fused forward) the policy allows, without
/// those needing more than `max_workspace` bytes.
fn pick(
    built: impl IntoIterator<Item = (u8, bool, usize)>,
    deterministic_only: bool,
    max_workspace: usize,
    cap: usize,
) -> Vec<u8> {
    built
        .into_iter()
        .filter(|&(_, det, _)| det || !deterministic_only)
        .take(cap)
        .filter(|&(_, _, ws)| ws <= max_workspace)
        .map(|(r, _, _)| r)
        .collect()
}

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
    /// Position in the key's filtered, deduplicated heuristic list (`ConvAlgo::CudnnGraph`, or
    /// `ConvAlgo::CudnnGraphBias` in the fused forward's list).
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

/// The state of one configuration's plan.
enum Slot {
    Untried,
    Built { plan: Desc, workspace: usize },
    Failed(String),
}

/// One kept configuration. Field order is drop order: the plan before its configuration.
struct Config {
    slot: Slot,
    info: ConfigInfo,
    cfg: Desc,
}

/// Everything built for one (direction, geometry, bias fused or not, alignment). Field order
/// is drop order: plans and configurations, then the heuristics they came from, then the
/// operation graph and its parts.
struct Set {
    configs: Vec<Config>,
    /// How many candidates it offers at most ([`CAP`] or [`FUSED_CAP`]).
    cap: usize,
    /// Every configuration the heuristics listed and what became of it (for reports).
    listed: Vec<String>,
    _heuristics: Vec<Desc>,
    _graph: Desc,
    /// The convolution, then the bias addition of the fused forward.
    _ops: Vec<Desc>,
    _pointwise: Option<Desc>,
    _conv: Desc,
    _tensors: Vec<Desc>,
}

impl Set {
    fn candidate(&self, rank: u8) -> Option<Candidate> {
        let c = self.configs.get(rank as usize)?;
        let workspace = match c.slot {
            Slot::Built { workspace, .. } => workspace,
            _ => return None,
        };
        Some(Candidate {
            rank,
            engine: c.info.engine,
            knobs: c.info.knobs.clone(),
            notes: c.info.notes.clone(),
            behavior: c.info.behavior.clone(),
            workspace,
        })
    }

    /// What the heuristics listed and, per kept configuration, its plan (one line each).
    fn report(&self, name: &str) -> String {
        let mut s = format!(
            "{name}: {} configurations listed, {} kept",
            self.listed.len(),
            self.configs.len()
        );
        for l in &self.listed {
            s.push_str(&format!("\n  listed {l}"));
        }
        for (rank, c) in self.configs.iter().enumerate() {
            let plan = match &c.slot {
                Slot::Untried => "plan not built".to_string(),
                Slot::Built { workspace, .. } => format!("plan built, workspace {workspace}"),
                Slot::Failed(why) => format!("plan failed: {why}"),
            };
            s.push_str(&format!("\n  rank {rank} {}: {plan}", c.info_tag()));
        }
        s
    }

    fn candidates(&self, deterministic_only: bool, max_workspace: usize) -> Vec<Candidate> {
        let built = self
            .configs
            .iter()
            .enumerate()
            .filter_map(|(r, c)| match c.slot {
                Slot::Built { workspace, .. } => {
                    Some((r as u8, !nondeterministic(&c.info.notes), workspace))
                }
                _ => None,
            });
        pick(built, deterministic_only, max_workspace, self.cap)
            .into_iter()
            .filter_map(|r| self.candidate(r))
            .collect()
    }
}

type SetKey = (usize, bool, [usize; 9], u32);

fn set_key(dir: ConvDir, g: &ConvGeom, bias: bool, align: u32) -> SetKey {
    let d = match dir {
        ConvDir::Forward => 0,
        ConvDir::BackwardData => 1,
        ConvDir::BackwardFilter => 2,
    };
    (
        d,
        bias,
        [g.n, g.c, g.h, g.w, g.oc, g.kh, g.kw, g.stride, g.pad],
        align,
    )
}

struct State {
    handle: Ptr,
    /// Built sets, or why a key has none.
    sets: HashMap<SetKey, std::result::Result<Set, String>>,
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
            // SAFETY: created by cudnnCreate, destroyed once, here, after every descriptor
            // that refers to it; no call is in flight (we own the state exclusively).
            unsafe {
                (self.api.destroy)(st.handle);
            }
        } else {
            // Without the context the objects cannot be destroyed safely; leak them.
            std::mem::forget(std::mem::take(&mut st.sets));
        }
    }
}

/// (descriptor type, alpha, beta, conv, x, w, y) attribute names of a direction's operation.
fn op_attrs(dir: ConvDir) -> (u32, [u32; 6]) {
    match dir {
        ConvDir::Forward => (D_OP_CONV_FORWARD, [700, 701, 702, 704, 703, 705]),
        ConvDir::BackwardData => (D_OP_CONV_BACKWARD_DATA, [706, 707, 708, 710, 709, 711]),
        ConvDir::BackwardFilter => (D_OP_CONV_BACKWARD_FILTER, [712, 713, 714, 716, 715, 717]),
    }
}

fn i64_of(what: &str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| NnError::Shape(format!("cuDNN: {what} = {v} exceeds an int64")))
}

/// A finalized fp32 NCHW-packed tensor descriptor (for `[1, K, 1, 1]` the strides are
/// `[K, 1, 1, 1]`).
fn tensor(api: &'static Api, dims: [i64; 4], uid: i64, align: u32) -> Result<Desc> {
    tensor_of(api, dims, uid, align, false)
}

/// [`tensor`], virtual when `is_virtual`: an intermediate of an operation graph that cuDNN
/// keeps to itself (no memory, not in the variant pack).
fn tensor_of(
    api: &'static Api,
    dims: [i64; 4],
    uid: i64,
    align: u32,
    is_virtual: bool,
) -> Result<Desc> {
    let strides = [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1];
    let call = "cudnnBackend*(TENSOR)";
    let t = Desc::new(api, D_TENSOR).map_err(|s| error(api, s, call))?;
    (|| {
        t.set_enum(A_TENSOR_DATA_TYPE, T_DATA_TYPE, DATA_FLOAT)?;
        t.set_i64(A_TENSOR_DIMENSIONS, &dims)?;
        t.set_i64(A_TENSOR_STRIDES, &strides)?;
        t.set_i64(A_TENSOR_UNIQUE_ID, &[uid])?;
        t.set_i64(A_TENSOR_BYTE_ALIGNMENT, &[align as i64])?;
        if is_virtual {
            t.set_bool(A_TENSOR_IS_VIRTUAL, true)?;
        }
        t.finalize()
    })()
    .map_err(|s| error(api, s, call))?;
    Ok(t)
}

/// Reads one heuristic result.
fn read_config(api: &'static Api, cfg: &Desc) -> St<ConfigInfo> {
    let engine = Desc::new(api, D_ENGINE)?;
    if cfg.get_descs(A_CFG_ENGINE, std::slice::from_ref(&engine))? != 1 {
        return Err(2000);
    }
    let index = engine.get_i64(A_ENGINE_GLOBAL_INDEX)?;
    // Notes that cannot be read cannot be checked: such a configuration is not used.
    let notes = engine.get_enums(A_ENGINE_NUMERICAL_NOTE, T_NUMERICAL_NOTE, MAX_NOTES)?;
    let behavior = engine
        .get_enums(A_ENGINE_BEHAVIOR_NOTE, T_BEHAVIOR_NOTE, MAX_NOTES)
        .unwrap_or_default();
    let choices = Desc::many(api, D_KNOB_CHOICE, MAX_KNOBS)?;
    let n = cfg.get_descs(A_CFG_KNOB_CHOICES, &choices).unwrap_or(0);
    let mut knobs = Vec::with_capacity(n);
    for k in &choices[..n] {
        let t = k.get_enums(A_KNOB_TYPE, T_KNOB_TYPE, 1)?;
        let v = k.get_i64(A_KNOB_VALUE)?;
        if let Some(&t) = t.first() {
            knobs.push((t, v));
        }
    }
    knobs.sort_unstable();
    Ok(ConfigInfo {
        engine: index,
        knobs,
        notes,
        behavior,
    })
}

/// Finalizes the execution plan of one configuration; returns it with its workspace bytes.
fn build_plan(api: &'static Api, handle: Ptr, cfg: &Desc) -> St<(Desc, usize)> {
    let plan = Desc::new(api, D_EXECUTION_PLAN)?;
    plan.set_handle(A_PLAN_HANDLE, handle)?;
    plan.set_descs(A_PLAN_ENGINE_CONFIG, &[cfg])?;
    plan.finalize()?;
    let ws = plan.get_i64(A_PLAN_WORKSPACE_SIZE)?;
    Ok((plan, ws.max(0) as usize))
}

fn fill_slot(api: &'static Api, handle: Ptr, c: &mut Config) {
    c.slot = match build_plan(api, handle, &c.cfg) {
        Ok((plan, workspace)) => Slot::Built { plan, workspace },
        Err(st) if NOT_SUPPORTED.contains(&st) => Slot::Failed(describe(api, st)),
        Err(st) => Slot::Failed(format!("finalize failed: {}", describe(api, st))),
    };
}

/// The convolution operation of one direction and what it refers to: (x, w, y) tensors, the
/// convolution descriptor, the operation (all finalized; no handle needed). With `fused`
/// (forward only) its output is the virtual tensor [`UID_CONV_OUT`] the bias is added to.
fn build_op(
    api: &'static Api,
    dir: ConvDir,
    g: &ConvGeom,
    align: u32,
    fused: bool,
) -> Result<(Vec<Desc>, Desc, Desc)> {
    if fused && dir != ConvDir::Forward {
        return Err(NnError::Shape(format!(
            "{}: a bias is fused only into the forward direction",
            dir.name()
        )));
    }
    let (oh, ow) = g.out_hw()?;
    let v = |what, x| i64_of(what, x);
    let (n, c, h, w) = (v("n", g.n)?, v("c", g.c)?, v("h", g.h)?, v("w", g.w)?);
    let (oc, kh, kw) = (v("oc", g.oc)?, v("kh", g.kh)?, v("kw", g.kw)?);
    let (s, p, oh, ow) = (
        v("stride", g.stride)?,
        v("pad", g.pad)?,
        v("oh", oh)?,
        v("ow", ow)?,
    );
    let (y_uid, y_virtual) = if fused {
        (UID_CONV_OUT, true)
    } else {
        (UID_Y, false)
    };
    let tensors = vec![
        tensor(api, [n, c, h, w], UID_X, align)?,
        tensor(api, [oc, c, kh, kw], UID_W, align)?,
        tensor_of(api, [n, oc, oh, ow], y_uid, align, y_virtual)?,
    ];
    let e = |call| err_of(api, call);
    let conv = Desc::new(api, D_CONVOLUTION).map_err(e("cudnnBackendCreateDescriptor"))?;
    (|| {
        conv.set_enum(A_CONV_COMP_TYPE, T_DATA_TYPE, DATA_FLOAT)?;
        conv.set_enum(A_CONV_MODE, T_CONVOLUTION_MODE, CROSS_CORRELATION)?;
        conv.set_i64(A_CONV_SPATIAL_DIMS, &[2])?;
        conv.set_i64(A_CONV_DILATIONS, &[1, 1])?;
        conv.set_i64(A_CONV_FILTER_STRIDES, &[s, s])?;
        conv.set_i64(A_CONV_PRE_PADDINGS, &[p, p])?;
        conv.set_i64(A_CONV_POST_PADDINGS, &[p, p])?;
        conv.finalize()
    })()
    .map_err(e("cudnnBackend*(CONVOLUTION)"))?;
    let (op_type, [alpha, beta, conv_a, x_a, w_a, y_a]) = op_attrs(dir);
    let op = Desc::new(api, op_type).map_err(e("cudnnBackendCreateDescriptor"))?;
    (|| {
        op.set_descs(x_a, &[&tensors[0]])?;
        op.set_descs(w_a, &[&tensors[1]])?;
        op.set_descs(y_a, &[&tensors[2]])?;
        op.set_descs(conv_a, &[&conv])?;
        op.set_f32(alpha, 1.0)?;
        op.set_f32(beta, 0.0)?;
        op.finalize()
    })()
    .map_err(e("cudnnBackend*(OPERATION_CONVOLUTION)"))?;
    Ok((tensors, conv, op))
}

/// The bias addition of the fused forward: `y = conv_out + bias`, the bias `[1, K, 1, 1]`
/// broadcast over batch and pixels, added in fp32. Returns the (bias, y) tensors, the
/// pointwise descriptor and the operation (all finalized; no handle needed).
fn build_bias_add(
    api: &'static Api,
    g: &ConvGeom,
    align: u32,
    conv_out: &Desc,
) -> Result<(Vec<Desc>, Desc, Desc)> {
    let (oh, ow) = g.out_hw()?;
    let v = |what, x| i64_of(what, x);
    let (n, oc, oh, ow) = (v("n", g.n)?, v("oc", g.oc)?, v("oh", oh)?, v("ow", ow)?);
    let tensors = vec![
        tensor(api, [1, oc, 1, 1], UID_BIAS, align)?,
        tensor(api, [n, oc, oh, ow], UID_Y, align)?,
    ];
    let e = |call| err_of(api, call);
    let pw = Desc::new(api, D_POINTWISE).map_err(e("cudnnBackendCreateDescriptor"))?;
    (|| {
        pw.set_enum(A_POINTWISE_MODE, T_POINTWISE_MODE, POINTWISE_ADD)?;
        pw.set_enum(A_POINTWISE_MATH_PREC, T_DATA_TYPE, DATA_FLOAT)?;
        pw.finalize()
    })()
    .map_err(e("cudnnBackend*(POINTWISE)"))?;
    let op = Desc::new(api, D_OP_POINTWISE).map_err(e("cudnnBackendCreateDescriptor"))?;
    (|| {
        op.set_descs(A_OP_POINTWISE_PW_DESCRIPTOR, &[&pw])?;
        op.set_descs(A_OP_POINTWISE_XDESC, &[conv_out])?;
        op.set_descs(A_OP_POINTWISE_BDESC, &[&tensors[0]])?;
        op.set_descs(A_OP_POINTWISE_YDESC, &[&tensors[1]])?;
        op.finalize()
    })()
    .map_err(e("cudnnBackend*(OPERATION_POINTWISE)"))?;
    Ok((tensors, pw, op))
}

/// The operation graph of one direction (with `bias`: the forward with its bias fused), its
/// heuristic list and the plans of its first configurations (host work only; may compile
/// engines at run time).
fn build_set(
    api: &'static Api,
    handle: Ptr,
    dir: ConvDir,
    g: &ConvGeom,
    bias: bool,
    align: u32,
) -> Result<Set> {
    let (mut tensors, conv, op) = build_op(api, dir, g, align, bias)?;
    let mut ops = vec![op];
    let mut pointwise = None;
    if bias {
        let (more, pw, add) = build_bias_add(api, g, align, &tensors[2])?;
        tensors.extend(more);
        ops.push(add);
        pointwise = Some(pw);
    }
    let cap = if bias { FUSED_CAP } else { CAP };
    let e = |call| err_of(api, call);
    let graph = Desc::new(api, D_OPERATION_GRAPH).map_err(e("cudnnBackendCreateDescriptor"))?;
    (|| {
        graph.set_descs(A_GRAPH_OPS, &ops.iter().collect::<Vec<_>>())?;
        graph.set_handle(A_GRAPH_HANDLE, handle)?;
        graph.finalize()
    })()
    .map_err(e("cudnnBackend*(OPERATIONGRAPH)"))?;

    // INSTANT first, then FALLBACK; a list cuDNN cannot give is skipped.
    let mut heuristics = Vec::new();
    let mut found: Vec<(ConfigInfo, Desc)> = Vec::new();
    for mode in [HEUR_INSTANT, HEUR_FALLBACK] {
        let Ok(he) = Desc::new(api, D_ENGINEHEUR) else {
            continue;
        };
        let listed = (|| {
            he.set_descs(A_HEUR_OPERATION_GRAPH, &[&graph])?;
            he.set_enum(A_HEUR_MODE, T_HEUR_MODE, mode)?;
            he.finalize()?;
            let cfgs = Desc::many(api, D_ENGINECFG, he.count(A_HEUR_RESULTS)?)?;
            let got = he.get_descs(A_HEUR_RESULTS, &cfgs)?;
            Ok::<_, Status>(cfgs.into_iter().take(got).collect::<Vec<_>>())
        })();
        let Ok(cfgs) = listed else {
            continue;
        };
        for cfg in cfgs {
            if let Ok(info) = read_config(api, &cfg) {
                found.push((info, cfg));
            }
        }
        heuristics.push(he);
    }
    let infos: Vec<ConfigInfo> = found.iter().map(|(i, _)| i.clone()).collect();
    let keep = select(&infos);
    let listed = infos
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let fate = match keep.iter().position(|&k| k == i) {
                Some(rank) => format!("rank {rank}"),
                None if !fp32_fma(&c.notes) => "dropped (not plain fp32)".to_string(),
                None => "dropped (repeated)".to_string(),
            };
            format!(
                "{} notes {:?} behaviour {:?}: {fate}",
                tag(c.engine, &c.knobs),
                c.notes,
                c.behavior
            )
        })
        .collect();
    let mut slots: Vec<Option<(ConfigInfo, Desc)>> = found.into_iter().map(Some).collect();
    let mut configs: Vec<Config> = keep
        .into_iter()
        .filter_map(|i| slots[i].take())
        .map(|(info, cfg)| Config {
            slot: Slot::Untried,
            info,
            cfg,
        })
        .collect();
    drop(slots); // configurations not kept
    let mut deterministic_built = 0;
    for c in &mut configs {
        if deterministic_built >= cap {
            break;
        }
        fill_slot(api, handle, c);
        if matches!(c.slot, Slot::Built { .. }) && !nondeterministic(&c.info.notes) {
            deterministic_built += 1;
        }
    }
    Ok(Set {
        configs,
        cap,
        listed,
        _heuristics: heuristics,
        _graph: graph,
        _ops: ops,
        _pointwise: pointwise,
        _conv: conv,
        _tensors: tensors,
    })
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
            }),
        })
    }

    /// The set of (dir, g, bias fused or not, align), built now when missing and `may_build`
    /// (never inside a capture: finalizing may compile, allocate or synchronise).
    fn set<'s>(
        &self,
        st: &'s mut State,
        dir: ConvDir,
        g: &ConvGeom,
        bias: bool,
        align: u32,
        may_build: bool,
    ) -> Option<&'s mut std::result::Result<Set, String>> {
        let key = set_key(dir, g, bias, align);
        if !st.sets.contains_key(&key) {
            if !may_build {
                return None;
            }
            let handle = st.handle;
            let built = with_relaxed_capture(|| build_set(self.api, handle, dir, g, bias, align));
            st.sets.insert(key, built.map_err(|e| e.to_string()));
        }
        st.sets.get_mut(&key)
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
        self.list(q, dir, g, false, deterministic, max_workspace)
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
        self.list(q, ConvDir::Forward, g, true, deterministic, max_workspace)
    }

    fn list(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        g: &ConvGeom,
        bias: bool,
        deterministic: bool,
        max_workspace: usize,
    ) -> Result<Vec<Candidate>> {
        if !crate::ffi::cudnn::supports(g) || (bias && dir != ConvDir::Forward) {
            return Ok(Vec::new());
        }
        self.ctx.bind()?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match self.set(&mut st, dir, g, bias, LIST_ALIGN, !q.is_capturing()) {
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
        match st.sets.get(&set_key(dir, g, bias, LIST_ALIGN))? {
            Ok(set) => set.candidate(rank),
            Err(_) => None,
        }
    }

    /// Every configuration cuDNN's heuristics listed for the fused forward of `g` and what
    /// became of it (rank and plan, or why it was dropped), or why the operation graph could
    /// not be built; `None` before it was listed (for reports and device-test diagnostics).
    pub fn fused_bias_report(&self, g: &ConvGeom) -> Option<String> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let key = set_key(ConvDir::Forward, g, true, LIST_ALIGN);
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
        self.execute(q, dir, rank, g, (a, b, out), None)
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
        self.execute(q, ConvDir::Forward, rank, g, (x, w, y), Some(bias))
    }

    fn execute(
        &self,
        q: &dyn Queue,
        dir: ConvDir,
        rank: u8,
        g: &ConvGeom,
        (a, b, out): (&DeviceBuffer<f32>, &DeviceBuffer<f32>, &DeviceBuffer<f32>),
        bias: Option<&DeviceBuffer<f32>>,
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
        let set = match self.set(&mut st, dir, g, fused, align, !capturing) {
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
        let Some(c) = set.configs.get_mut(rank as usize) else {
            return Err(NnError::Library {
                library: LIBRARY,
                call: "execution plan",
                status: format!(
                    "{}: no configuration of rank {rank} ({} listed)",
                    name(),
                    set.configs.len()
                ),
            });
        };
        if matches!(c.slot, Slot::Untried) && !capturing {
            with_relaxed_capture(|| fill_slot(self.api, handle, c));
        }
        let (plan, ws_bytes) = match &c.slot {
            Slot::Built { plan, workspace } => (plan.raw, *workspace),
            Slot::Failed(why) => {
                return Err(NnError::Library {
                    library: LIBRARY,
                    call: "cudnnBackendFinalize(EXECUTION_PLAN)",
                    status: format!("{} rank {rank} ({}): {why}", name(), c.info_tag()),
                })
            }
            Slot::Untried => {
                return Err(NnError::Library {
                    library: LIBRARY,
                    call: "execution plan",
                    status: format!("{} rank {rank}: {NOT_BUILT}", name()),
                })
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
        for buf in [x, w, y].into_iter().chain(bias) {
            q.use_block(buf.block());
        }
        if let Some(ws) = &ws {
            q.use_block(ws.block());
        }
        let ws_p = ws
            .as_ref()
            .map_or(std::ptr::null_mut(), |w| w.addr() as Ptr);
        let mut uids = vec![UID_X, UID_W, UID_Y];
        let mut ptrs = vec![x.addr() as Ptr, w.addr() as Ptr, y.addr() as Ptr];
        if let Some(bias) = bias {
            uids.push(UID_BIAS);
            ptrs.push(bias.addr() as Ptr);
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
        // SAFETY: the handle, plan and variant pack are live (held under the lock); the plan
        // describes exactly the geometry (and, fused, the bias of `g.oc` elements) whose
        // extents were checked against the buffers above, at the alignment of these pointers,
        // so cuDNN reads and writes inside them; the buffers and the workspace are memory of
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

impl Config {
    fn info_tag(&self) -> String {
        tag(self.info.engine, &self.info.knobs)
    }
}

#[cfg(test)]
mod tests {
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
        assert_eq!(select(&infos), vec![1, 2, 3, 5, 6]);
        // At most 256 (ranks are u8).
        let many: Vec<ConfigInfo> = (0..400).map(|e| info(e, &[], &[])).collect();
        assert_eq!(select(&many).len(), 256);
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
