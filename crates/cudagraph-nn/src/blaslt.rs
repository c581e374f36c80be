//! cuBLASLt matrix products with fused epilogues, loaded at run time: the forward layout with
//! bias or bias+ReLU fused, the backward layouts, and the bias gradient fused into the weight
//! gradient (`BGRADB`) where cuBLASLt offers it for fp32.
//!
//! As for cuDNN ([`crate::cudnn`]), cudarc's `cublaslt` feature loads the library and this
//! module looks up each function with its C signature and raw integer status codes, all before
//! the first call (a missing symbol means "cuBLASLt unavailable", never a panic). Compute type
//! `CUBLAS_COMPUTE_32F` (no TF32). One handle per device; each call allocates the workspace its
//! algorithm asks for (none for most) from the queue, so inside a capture it comes from the
//! graph's pool and graphs never share one (unlike cuBLAS's per-stream workspace in
//! [`crate::blas`]); algorithms are offered up to [`workspace_for`] bytes. For each
//! product shape a plan keeps the descriptors and cuBLASLt's heuristic list of algorithms; the
//! engine registry ([`crate::engine`]) measures the first few and picks one by its rank.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Mutex, OnceLock};

use cudagraph::runtime::{with_relaxed_capture, Context};
use cudagraph::{DeviceBuffer, Queue, QueueExt};
use cudarc::cublaslt::sys as ls;

use crate::blas::Epilogue;
use crate::blas::Trans;
use crate::cudnn::lib_fn;
use crate::error::{NnError, Result};

type Status = u32;
type Ptr = *mut c_void;
type CPtr = *const c_void;

const SUCCESS: Status = 0;
const R_32F: u32 = ls::cudaDataType_t::CUDA_R_32F as u32;
const COMPUTE_32F: u32 = ls::cublasComputeType_t::CUBLAS_COMPUTE_32F as u32;
const DESC_TRANSA: u32 = ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA as u32;
const DESC_TRANSB: u32 = ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB as u32;
const DESC_EPILOGUE: u32 = ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE as u32;
const DESC_BIAS_POINTER: u32 =
    ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER as u32;
const PREF_MAX_WORKSPACE: u32 =
    ls::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES as u32;
const PREF_ALIGN_A: u32 =
    ls::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES as u32;
const EPI_DEFAULT: u32 = ls::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT as u32;
const EPI_BIAS: u32 = ls::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS as u32;
const EPI_RELU_BIAS: u32 = ls::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU_BIAS as u32;
const EPI_BGRADB: u32 = ls::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADB as u32;
const OP_N: i32 = 0;
const OP_T: i32 = 1;

/// Workspace bytes per stream for a device of compute capability `major`.x: 32 MiB from Hopper
/// on, 4 MiB before (the sizes cuBLAS's documentation recommends; PyTorch's default on Hopper
/// is 32 MiB too). The heuristics offer split-K algorithms only within the workspace: with
/// 4 MiB, the 512 × 4096 → 1024 forward product measured 147 µs with the best of six on the
/// H100 where PyTorch's single pick took 132 µs (2026-11-23).
pub fn workspace_for(major: u32) -> usize {
    if major >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

/// How many heuristic candidates a plan keeps (the registry measures the first
/// [`MEASURED_ALGOS`]).
const HEURISTIC_ALGOS: usize = 16;

/// How many of cuBLASLt's heuristic algorithms the engine registry measures: twelve, so that a
/// product where PyTorch's single heuristic pick and ours tie (the sweep's 512- and 128-row
/// forward products, 2026-11-23 and -24, at six) gets more chances at a faster one; measuring
/// costs a few milliseconds per shape, once.
pub const MEASURED_ALGOS: usize = 12;

/// `cublasLtMatmulHeuristicResult_t` with the status as a raw integer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct HeuristicResult {
    algo: [u64; 8],
    workspace_size: usize,
    state: Status,
    waves_count: f32,
    reserved: [c_int; 4],
}

/// The cuBLASLt functions this module calls, with the signatures of cuBLASLt 12/13's header.
struct Api {
    get_version: unsafe extern "C" fn() -> usize,
    status_string: unsafe extern "C" fn(Status) -> *const c_char,
    create: unsafe extern "C" fn(*mut Ptr) -> Status,
    destroy: unsafe extern "C" fn(Ptr) -> Status,
    desc_create: unsafe extern "C" fn(*mut Ptr, u32, u32) -> Status,
    desc_destroy: unsafe extern "C" fn(Ptr) -> Status,
    desc_set: unsafe extern "C" fn(Ptr, u32, CPtr, usize) -> Status,
    layout_create: unsafe extern "C" fn(*mut Ptr, u32, u64, u64, i64) -> Status,
    layout_destroy: unsafe extern "C" fn(Ptr) -> Status,
    pref_create: unsafe extern "C" fn(*mut Ptr) -> Status,
    pref_destroy: unsafe extern "C" fn(Ptr) -> Status,
    pref_set: unsafe extern "C" fn(Ptr, u32, CPtr, usize) -> Status,
    #[allow(clippy::type_complexity)]
    heuristic: unsafe extern "C" fn(
        Ptr,
        Ptr,
        Ptr,
        Ptr,
        Ptr,
        Ptr,
        Ptr,
        c_int,
        *mut HeuristicResult,
        *mut c_int,
    ) -> Status,
    #[allow(clippy::type_complexity)]
    matmul: unsafe extern "C" fn(
        Ptr,
        Ptr,
        CPtr,
        CPtr,
        Ptr,
        CPtr,
        Ptr,
        CPtr,
        CPtr,
        Ptr,
        Ptr,
        Ptr,
        *const [u64; 8],
        Ptr,
        usize,
        Ptr,
    ) -> Status,
}

fn load() -> std::result::Result<Api, String> {
    // SAFETY: only tries to dlopen libcublasLt by its usual names.
    if !unsafe { ls::is_culib_present() } {
        return Err("libcublasLt could not be loaded".into());
    }
    // SAFETY: the library loads (checked above), so `culib` returns it instead of panicking.
    let lib = unsafe { ls::culib() };
    Ok(Api {
        get_version: lib_fn!(lib, "cublasLtGetVersion"),
        status_string: lib_fn!(lib, "cublasLtGetStatusString"),
        create: lib_fn!(lib, "cublasLtCreate"),
        destroy: lib_fn!(lib, "cublasLtDestroy"),
        desc_create: lib_fn!(lib, "cublasLtMatmulDescCreate"),
        desc_destroy: lib_fn!(lib, "cublasLtMatmulDescDestroy"),
        desc_set: lib_fn!(lib, "cublasLtMatmulDescSetAttribute"),
        layout_create: lib_fn!(lib, "cublasLtMatrixLayoutCreate"),
        layout_destroy: lib_fn!(lib, "cublasLtMatrixLayoutDestroy"),
        pref_create: lib_fn!(lib, "cublasLtMatmulPreferenceCreate"),
        pref_destroy: lib_fn!(lib, "cublasLtMatmulPreferenceDestroy"),
        pref_set: lib_fn!(lib, "cublasLtMatmulPreferenceSetAttribute"),
        heuristic: lib_fn!(lib, "cublasLtMatmulAlgoGetHeuristic"),
        matmul: lib_fn!(lib, "cublasLtMatmul"),
    })
}

fn api() -> std::result::Result<&'static Api, &'static str> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(|e| e.as_str())
}

/// The loaded cuBLASLt's version (e.g. 130000), or why it is unavailable.
pub fn version() -> std::result::Result<usize, String> {
    let api = api().map_err(str::to_string)?;
    // SAFETY: no arguments; returns a number.
    Ok(unsafe { (api.get_version)() })
}

fn describe(api: &Api, st: Status) -> String {
    // SAFETY: returns a static NUL-terminated string (or null).
    let p = unsafe { (api.status_string)(st) };
    if p.is_null() {
        format!("status {st}")
    } else {
        // SAFETY: non-null, static and NUL-terminated (cuBLASLt's contract).
        let s = unsafe { CStr::from_ptr(p) }.to_string_lossy();
        format!("{s} ({st})")
    }
}

/// A product shape as cuBLASLt plans it (row-major, as [`crate::gemm::gemm`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LtShape {
    pub ta: Trans,
    pub tb: Trans,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub epilogue: Epilogue,
    /// Largest power of two (at most 256) dividing every pointer passed.
    pub align: u32,
}

/// Descriptors and heuristic algorithms of one shape.
struct Plan {
    api: &'static Api,
    desc: Ptr,
    a: Ptr,
    b: Ptr,
    c: Ptr,
    algos: Vec<HeuristicResult>,
    /// Whether the bias gradient is fused (`BGRADB`); otherwise the caller reduces it.
    fused_bgrad: bool,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each object was created by the matching create call (or is null) and is
        // destroyed once, here.
        unsafe {
            for l in [self.a, self.b, self.c] {
                if !l.is_null() {
                    (self.api.layout_destroy)(l);
                }
            }
            if !self.desc.is_null() {
                (self.api.desc_destroy)(self.desc);
            }
        }
    }
}

struct State {
    handle: Ptr,
    plans: HashMap<LtShape, Plan>,
}

// SAFETY: the handle and descriptors are plain cuBLASLt objects usable from any thread one call
// at a time; every use holds the `BlasLt` mutex.
unsafe impl Send for State {}

/// A cuBLASLt handle bound to one device (kept by the engine registry).
pub struct BlasLt {
    api: &'static Api,
    ctx: Context,
    /// Most workspace bytes an algorithm may use ([`workspace_for`]).
    ws_bytes: usize,
    state: Mutex<State>,
}

impl Drop for BlasLt {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        st.plans.clear();
        if self.ctx.bind().is_ok() {
            // SAFETY: created by cublasLtCreate, destroyed once, here.
            unsafe {
                (self.api.destroy)(st.handle);
            }
        }
    }
}

/// The largest power of two (at most 256) dividing every address.
pub fn alignment(addrs: &[u64]) -> u32 {
    let all = addrs.iter().fold(256u64, |acc, &a| acc | a);
    (1u64 << all.trailing_zeros().min(8)) as u32
}

fn check(api: &Api, st: Status, call: &'static str) -> Result<()> {
    if st == SUCCESS {
        Ok(())
    } else {
        Err(NnError::Library {
            library: "cuBLASLt",
            call,
            status: describe(api, st),
        })
    }
}

/// Sets a matmul-descriptor attribute to the value whose bytes are `v` (of the type the header
/// gives the attribute: i32 for TRANSA/B, u32 for EPILOGUE, a pointer for BIAS_POINTER).
fn set_attr(api: &Api, desc: Ptr, attr: u32, v: &[u8]) -> Result<()> {
    // SAFETY: `desc` is a live descriptor; the value is `v.len()` readable bytes.
    check(
        api,
        unsafe { (api.desc_set)(desc, attr, v.as_ptr() as CPtr, v.len()) },
        "cublasLtMatmulDescSetAttribute",
    )
}

/// The descriptor (fp32 compute, no TF32) and the three layouts of a row-major product, as
/// cuBLASLt's column-major view of it: Cᵀ (n×m) = op(B)ᵀ·op(A)ᵀ, so our B is cuBLASLt's A and
/// our A its B (as in blas.rs). No handle is needed; the plan has no algorithms yet.
fn describe_shape(a: &'static Api, s: &LtShape) -> Result<Plan> {
    let dim = |v: usize| {
        i64::try_from(v)
            .ok()
            .filter(|&v| v > 0 && v <= i32::MAX as i64)
            .ok_or_else(|| NnError::Shape(format!("cuBLASLt: dimension {v} is 0 or exceeds i32")))
    };
    let (m, n, k) = (dim(s.m)?, dim(s.n)?, dim(s.k)?);
    let mut p = Plan {
        api: a,
        desc: std::ptr::null_mut(),
        a: std::ptr::null_mut(),
        b: std::ptr::null_mut(),
        c: std::ptr::null_mut(),
        algos: Vec::new(),
        fused_bgrad: false,
    };
    let (la_rows, la_cols) = if s.tb == Trans::N { (n, k) } else { (k, n) };
    let (lb_rows, lb_cols) = if s.ta == Trans::N { (k, m) } else { (m, k) };
    let op = |t: Trans| if t == Trans::N { OP_N } else { OP_T };
    // SAFETY: each create call writes one object into `p` (destroyed by Plan's Drop, also on
    // the early returns) from plain integers.
    unsafe {
        check(
            a,
            (a.desc_create)(&mut p.desc, COMPUTE_32F, R_32F),
            "cublasLtMatmulDescCreate",
        )?;
        check(
            a,
            (a.layout_create)(&mut p.a, R_32F, la_rows as u64, la_cols as u64, la_rows),
            "cublasLtMatrixLayoutCreate",
        )?;
        check(
            a,
            (a.layout_create)(&mut p.b, R_32F, lb_rows as u64, lb_cols as u64, lb_rows),
            "cublasLtMatrixLayoutCreate",
        )?;
        check(
            a,
            (a.layout_create)(&mut p.c, R_32F, n as u64, m as u64, n),
            "cublasLtMatrixLayoutCreate",
        )?;
    }
    set_attr(a, p.desc, DESC_TRANSA, &op(s.tb).to_ne_bytes())?;
    set_attr(a, p.desc, DESC_TRANSB, &op(s.ta).to_ne_bytes())?;
    Ok(p)
}

/// A matmul preference, destroyed on drop.
struct Preference<'a>(Ptr, &'a Api);

impl Drop for Preference<'_> {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatmulPreferenceCreate, destroyed once, here.
        unsafe {
            (self.1.pref_destroy)(self.0);
        }
    }
}

/// A preference for at most `ws_bytes` of workspace and pointers aligned to `align` bytes (A,
/// B, C and D).
fn preference(a: &Api, align: u32, ws_bytes: usize) -> Result<Preference<'_>> {
    let mut p: Ptr = std::ptr::null_mut();
    // SAFETY: writes one preference handle.
    check(
        a,
        unsafe { (a.pref_create)(&mut p) },
        "cublasLtMatmulPreferenceCreate",
    )?;
    let pref = Preference(p, a);
    let set = |attr: u32, v: &[u8]| {
        // SAFETY: the preference is live; the value has the header's type for the attribute
        // (u64 for MAX_WORKSPACE_BYTES, u32 for the alignments).
        check(
            a,
            unsafe { (a.pref_set)(pref.0, attr, v.as_ptr() as CPtr, v.len()) },
            "cublasLtMatmulPreferenceSetAttribute",
        )
    };
    set(PREF_MAX_WORKSPACE, &(ws_bytes as u64).to_ne_bytes())?;
    for i in 0..4 {
        set(PREF_ALIGN_A + i, &align.to_ne_bytes())?;
    }
    Ok(pref)
}

impl BlasLt {
    /// Loads cuBLASLt and creates a handle for `ctx`'s device, offering algorithms that need at
    /// most `ws_bytes` of workspace ([`workspace_for`]); `Err` says why it is unavailable.
    pub fn open(ctx: &Context, ws_bytes: usize) -> std::result::Result<BlasLt, String> {
        let api = api().map_err(str::to_string)?;
        ctx.bind().map_err(|e| e.to_string())?;
        let mut h: Ptr = std::ptr::null_mut();
        // SAFETY: writes one handle. Relaxed capture mode: creation may allocate.
        let st = with_relaxed_capture(|| unsafe { (api.create)(&mut h) });
        if st != SUCCESS || h.is_null() {
            return Err(format!("cublasLtCreate failed: {}", describe(api, st)));
        }
        Ok(BlasLt {
            api,
            ctx: ctx.clone(),
            ws_bytes,
            state: Mutex::new(State {
                handle: h,
                plans: HashMap::new(),
            }),
        })
    }

    /// Descriptors of `s` and cuBLASLt's heuristic algorithms for them.
    fn new_plan(&self, handle: Ptr, s: &LtShape) -> Result<Plan> {
        let mut p = describe_shape(self.api, s)?;
        let wanted = match s.epilogue {
            Epilogue::None => EPI_DEFAULT,
            Epilogue::Bias => EPI_BIAS,
            Epilogue::BiasRelu => EPI_RELU_BIAS,
            Epilogue::BiasGrad => EPI_BGRADB,
        };
        p.algos = self.heuristic(handle, &p, wanted, s.align)?;
        p.fused_bgrad = s.epilogue == Epilogue::BiasGrad && !p.algos.is_empty();
        if s.epilogue == Epilogue::BiasGrad && p.algos.is_empty() {
            // No fused bias gradient for this shape: a plain product, the caller reduces.
            p.algos = self.heuristic(handle, &p, EPI_DEFAULT, s.align)?;
        }
        Ok(p)
    }

    /// Sets `epilogue` on the plan's descriptor and asks cuBLASLt for its algorithms (an
    /// epilogue or layout it does not support gives an empty list).
    fn heuristic(
        &self,
        handle: Ptr,
        p: &Plan,
        epilogue: u32,
        align: u32,
    ) -> Result<Vec<HeuristicResult>> {
        let a = self.api;
        set_attr(a, p.desc, DESC_EPILOGUE, &epilogue.to_ne_bytes())?;
        let pref = preference(a, align, self.ws_bytes)?;
        let mut out = [HeuristicResult::default(); HEURISTIC_ALGOS];
        let mut got: c_int = 0;
        // SAFETY: the handle, descriptor, layouts and preference are live; cuBLASLt writes at
        // most HEURISTIC_ALGOS results into `out` and their count into `got`.
        let st = unsafe {
            (a.heuristic)(
                handle,
                p.desc,
                p.a,
                p.b,
                p.c,
                p.c,
                pref.0,
                HEURISTIC_ALGOS as c_int,
                out.as_mut_ptr(),
                &mut got,
            )
        };
        if st != SUCCESS {
            return Ok(Vec::new());
        }
        let got = (got.max(0) as usize).min(HEURISTIC_ALGOS);
        Ok(out[..got]
            .iter()
            .filter(|r| r.state == SUCCESS && r.workspace_size <= self.ws_bytes)
            .copied()
            .collect())
    }

    /// How many heuristic algorithms cuBLASLt offers for `s` (0: none; use another engine),
    /// and whether the bias gradient is fused.
    pub fn algo_count(&self, s: &LtShape) -> Result<(usize, bool)> {
        self.ctx.bind()?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let handle = st.handle;
        if !st.plans.contains_key(s) {
            let plan = self.new_plan(handle, s)?;
            st.plans.insert(*s, plan);
        }
        let p = &st.plans[s];
        Ok((p.algos.len(), p.fused_bgrad))
    }

    /// Row-major `C = epilogue(alpha·op(A)·op(B) + beta·C)` with cuBLASLt's algorithm of rank
    /// `rank` for the shape. `bias` is the bias of `Bias`/`BiasRelu` (length n) or the
    /// output of `BiasGrad` (length m, the rows of op(A)). Returns whether the bias gradient
    /// was computed (with `BiasGrad`, `false` means the caller must reduce it).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        q: &dyn Queue,
        s: &LtShape,
        rank: usize,
        alpha: f32,
        a: &DeviceBuffer<f32>,
        b: &DeviceBuffer<f32>,
        beta: f32,
        c: &DeviceBuffer<f32>,
        bias: Option<&DeviceBuffer<f32>>,
    ) -> Result<bool> {
        let len = |dims: [usize; 2]| {
            dims[0]
                .checked_mul(dims[1])
                .ok_or_else(|| NnError::Shape(format!("cuBLASLt: {dims:?} overflows")))
        };
        let need = |what: &'static str, buf: &DeviceBuffer<f32>, n: usize| {
            if buf.len() < n {
                Err(NnError::Core(cudagraph::Error::SizeMismatch {
                    what,
                    expected: n,
                    got: buf.len(),
                }))
            } else {
                Ok(())
            }
        };
        need("gemm A", a, len([s.m, s.k])?)?;
        need("gemm B", b, len([s.k, s.n])?)?;
        need("gemm C", c, len([s.m, s.n])?)?;
        let bias_len = match s.epilogue {
            Epilogue::None => 0,
            Epilogue::Bias | Epilogue::BiasRelu => s.n,
            Epilogue::BiasGrad => s.m,
        };
        match (bias, bias_len) {
            (Some(v), n) if n > 0 => need("gemm bias", v, n)?,
            (None, 0) => {}
            _ => {
                return Err(NnError::Shape(format!(
                    "cuBLASLt: epilogue {:?} with bias {}",
                    s.epilogue,
                    if bias.is_some() { "given" } else { "missing" }
                )))
            }
        }
        if s.m == 0 || s.n == 0 || s.k == 0 {
            return Err(NnError::Shape(format!(
                "cuBLASLt: empty product {}×{}×{}",
                s.m, s.n, s.k
            )));
        }
        let mut addrs = vec![a.addr(), b.addr(), c.addr()];
        addrs.extend(bias.map(|v| v.addr()));
        if alignment(&addrs) < s.align {
            return Err(NnError::Shape(format!(
                "cuBLASLt: pointers aligned to {} bytes for a plan that needs {}",
                alignment(&addrs),
                s.align
            )));
        }
        self.ctx.bind()?;
        let stream = q.stream_handle();
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let handle = st.handle;
        if !st.plans.contains_key(s) {
            let plan = self.new_plan(handle, s)?;
            st.plans.insert(*s, plan);
        }
        let p = &st.plans[s];
        let Some(algo) = p.algos.get(rank) else {
            return Err(NnError::Library {
                library: "cuBLASLt",
                call: "cublasLtMatmulAlgoGetHeuristic",
                status: format!(
                    "no algorithm of rank {rank} for {s:?} ({} offered)",
                    p.algos.len()
                ),
            });
        };
        let fused = match s.epilogue {
            Epilogue::None => false,
            Epilogue::Bias | Epilogue::BiasRelu => true,
            Epilogue::BiasGrad => p.fused_bgrad,
        };
        // The algorithm's own workspace, from the queue (the graph's pool inside a capture):
        // each call, and so each graph, has its own, and graphs replayed at the same time on
        // different streams never share one (a workspace kept per stream was shared by every
        // graph captured on that stream).
        let ws_len = algo.workspace_size;
        let ws = if ws_len > 0 {
            Some(q.alloc::<u8>(ws_len)?)
        } else {
            None
        };
        for buf in [a, b, c] {
            q.use_block(buf.block());
        }
        if let Some(w) = &ws {
            q.use_block(w.block());
        }
        let ws_ptr = ws
            .as_ref()
            .map_or(std::ptr::null_mut(), |w| w.addr() as Ptr);
        if let Some(v) = bias {
            q.use_block(v.block());
        }
        let bias_ptr: u64 = if fused {
            bias.map_or(0, |v| v.addr())
        } else {
            0
        };
        // SAFETY: the handle, descriptor and layouts are live under the lock; the layouts
        // describe m×k, k×n and m×n elements in the checked buffers (and a bias of the checked
        // length, used only with a fused epilogue); the algorithm came from cuBLASLt's
        // heuristic for exactly these descriptors and gets the `workspace_size` bytes it
        // asked for (null when none); the pointers are at least as aligned as the plan assumed
        // (checked); every buffer is kept alive and ordered by `use_block`; alpha/beta and the
        // attribute values are read before the calls return.
        unsafe {
            if fused {
                set_attr(self.api, p.desc, DESC_BIAS_POINTER, &bias_ptr.to_ne_bytes())?;
            }
            check(
                self.api,
                (self.api.matmul)(
                    handle,
                    p.desc,
                    &alpha as *const f32 as CPtr,
                    b.addr() as CPtr,
                    p.a,
                    a.addr() as CPtr,
                    p.b,
                    &beta as *const f32 as CPtr,
                    c.addr() as CPtr,
                    p.c,
                    c.addr() as Ptr,
                    p.c,
                    &algo.algo,
                    ws_ptr,
                    ws_len,
                    stream.raw() as Ptr,
                ),
                "cublasLtMatmul",
            )?;
        }
        Ok(fused)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heuristic_result_matches_the_header_layout() {
        // cublasLtMatmulAlgo_t (8 × u64), size_t workspaceSize, cublasStatus_t state,
        // float wavesCount, int reserved[4].
        assert_eq!(std::mem::size_of::<HeuristicResult>(), 96);
        assert_eq!(std::mem::offset_of!(HeuristicResult, state), 72);
    }

    /// Where cuBLASLt is installed, every symbol resolves and the library answers; elsewhere
    /// the reason it is unavailable is a message, not a panic.
    #[test]
    fn every_symbol_resolves_where_cublaslt_is_installed() {
        match api() {
            Ok(api) => {
                // SAFETY: no arguments.
                let v = unsafe { (api.get_version)() };
                assert!(v >= 110000, "version {v}");
                let text = describe(api, SUCCESS);
                assert!(!text.starts_with("status"), "no status text: {text}");
                println!("cuBLASLt {v}: {text}");
            }
            Err(why) => println!("cuBLASLt unavailable here: {why}"),
        }
    }

    /// Where cuBLASLt is installed: descriptors, layouts, every epilogue and the preference
    /// attributes are accepted with the value sizes used here (no GPU needed for these).
    #[test]
    fn descriptors_and_attributes_are_accepted_where_cublaslt_is_installed() {
        let Ok(api) = api() else {
            println!("cuBLASLt unavailable here");
            return;
        };
        for (ta, tb) in [
            (Trans::N, Trans::N),
            (Trans::N, Trans::T),
            (Trans::T, Trans::N),
            (Trans::T, Trans::T),
        ] {
            let s = LtShape {
                ta,
                tb,
                m: 7,
                n: 13,
                k: 31,
                epilogue: Epilogue::Bias,
                align: 16,
            };
            let p = describe_shape(api, &s).unwrap();
            for e in [EPI_DEFAULT, EPI_BIAS, EPI_RELU_BIAS, EPI_BGRADB] {
                set_attr(api, p.desc, DESC_EPILOGUE, &e.to_ne_bytes()).unwrap();
            }
            set_attr(api, p.desc, DESC_BIAS_POINTER, &0x1000u64.to_ne_bytes()).unwrap();
        }
        for align in [4, 16, 256] {
            preference(api, align, workspace_for(9)).unwrap();
        }
        // A wrongly sized value is rejected (so the sizes above are the checked ones).
        let p = describe_shape(
            api,
            &LtShape {
                ta: Trans::N,
                tb: Trans::T,
                m: 1,
                n: 1,
                k: 1,
                epilogue: Epilogue::None,
                align: 256,
            },
        )
        .unwrap();
        assert!(set_attr(api, p.desc, DESC_EPILOGUE, &[1u8]).is_err());
        // Empty products are not described.
        let empty = LtShape {
            ta: Trans::N,
            tb: Trans::N,
            m: 0,
            n: 3,
            k: 3,
            epilogue: Epilogue::None,
            align: 256,
        };
        assert!(describe_shape(api, &empty).is_err());
    }

    #[test]
    fn alignment_is_the_common_power_of_two() {
        assert_eq!(alignment(&[0x1000, 0x2200]), 256);
        assert_eq!(alignment(&[0x1000, 0x2210]), 16);
        assert_eq!(alignment(&[0x1004]), 4);
        assert_eq!(alignment(&[]), 256);
    }
}
