//! cuBLASLt matrix products with fused epilogues, loaded at run time: the forward layout with
//! bias or bias+ReLU fused, the backward layouts, and the bias gradient fused into the weight
//! gradient (`BGRADB`) where cuBLASLt offers it for fp32.
//!
//! As for cuDNN ([`crate::ffi::cudnn`]), cudarc's `cublaslt` feature loads the library and this
//! module looks up each function with its C signature and raw integer status codes, all before
//! the first call (a missing symbol means "cuBLASLt unavailable", never a panic). Compute type
//! `CUBLAS_COMPUTE_32F` (no TF32), or `CUBLAS_COMPUTE_32F_FAST_TF32` where the caller allows
//! TF32 (the `*_math` methods' `tf32`; [`crate::engine::Policy::tf32_matmul`]), each with its
//! own plans. One handle per device; each call allocates the workspace its
//! algorithm asks for (none for most) from the queue, so inside a capture it comes from the
//! graph's pool and graphs never share one (unlike cuBLAS's per-stream workspace in
//! [`crate::ffi::blas`]); algorithms are offered up to [`workspace_for`] bytes. For each
//! product shape a plan keeps the descriptors and cuBLASLt's heuristic list of algorithms; the
//! engine registry ([`crate::engine`]) measures the first few and picks one by its rank.
//!
//! **Split-K variants** (opt-in, [`crate::engine::Policy::lt_split_k`]; made on the first
//! request for a shape, [`BlasLt::split_k_variants`]). When the grid of one of the first
//! [`SPLIT_K_RANKS`] heuristic
//! algorithms would not fill the device (fewer thread blocks than multiprocessors, see
//! [`split_choices`]), the plan also keeps copies of it with `CUBLASLT_ALGO_CONFIG_SPLITK_NUM`
//! set to a few of [`SPLITS`] and a reduction scheme the algorithm supports (in place where it
//! can, else through the workspace), each validated by `cublasLtMatmulAlgoCheck` with a workspace
//! that fits [`workspace_for`]; the registry measures them as `cublaslt:RANK/skS`. Where the
//! library lacks the functions this needs, a plan simply has no variants.
//!
//! **Searched configurations** (opt-in, [`crate::engine::Policy::lt_search`]). On the first
//! request for a shape ([`BlasLt::search_configs`]) the plan also asks `cublasLtMatmulAlgoGetIds`
//! for every algorithm id of its types (fp32 compute, scale, A, B, C and D), and for each
//! id (`cublasLtMatmulAlgoInit`) the tiles (`CUBLASLT_ALGO_CAP_TILE_IDS`) and stage counts
//! (`CUBLASLT_ALGO_CAP_STAGES_IDS`; none listed: undefined) it supports. Every (id, tile,
//! stages) with one K split and no CTA swizzling that is not one of the heuristic results
//! (compared by the configuration read back from them) is ranked by [`search_rank`] — grids of
//! at least one wave first, those filling their last wave best (in 5 % steps), then larger
//! tiles — and checked in that order by `cublasLtMatmulAlgoCheck` (alignment within the
//! plan's, workspace within [`workspace_for`]), at most [`SEARCH_CHECKS`] checks per shape,
//! until [`SEARCH_KEPT`] are accepted, at most [`SEARCH_PER_TILE`] per tile. The registry
//! measures the kept ones as `cublaslt:cINDEX`. A missing symbol or a refused call means fewer
//! (or no) configurations, never an error.
//!
//! **Half precision** ([`LtTypes`], [`BlasLt::matmul_typed`]). A and B in bf16 or f16 (the same
//! type), C and D in that type or f32, compute `CUBLAS_COMPUTE_32F` (tensor cores, products
//! accumulated in f32) with f32 alpha and beta: the combinations cuBLASLt's `cublasLtMatmul`
//! table lists for these types. Each (shape, types) has its own plan, heuristic list,
//! split-K variants and searched configurations. The bias (or bias-gradient) vector is of the
//! D type, as cuBLASLt assumes unless `CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE` says otherwise;
//! an f32 vector with a 16-bit D sets that attribute, and cuBLASLt then offers algorithms for
//! it or none (its documentation names only IMMA and FP8 kernels as taking another bias type;
//! the plan simply has no algorithms then). Epilogues: none, bias, bias+ReLU, bias+GELU
//! (`CUBLASLT_EPILOGUE_GELU_BIAS`, GELU's tanh approximation) and the fused bias gradient
//! (`BGRADB`) where the heuristic offers it. With a 16-bit D the heuristic and the split-K
//! variants keep only algorithms that add split-K partial sums in the compute type
//! (`CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK`): the in-place and output-type schemes would
//! add them in bf16 or f16. Alignment: the preference states the pointers' alignment (256 bytes
//! for the allocator's blocks), and leading dimensions that are no multiple of 16 bytes (odd
//! k or n) leave the heuristic the algorithms that allow them; a shape for which it has none
//! has no candidates (the caller's typed error).

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::Mutex;

use cudagraph::runtime::{with_relaxed_capture, Context};
use cudagraph::{DeviceBuffer, Queue, QueueExt};

use super::loader::{check, describe, CPtr, Ptr, SUCCESS};
use crate::dtype::{Dtype, Float};
use crate::error::{NnError, Result};
use crate::extent::{alignment, handle_on_device, need, on_device, prod};
use crate::ffi::blas::Epilogue;
use crate::ffi::blas::Trans;

mod api;
mod search;

pub use api::version;
use api::*;
// What only the tests use.
#[cfg(any(test, feature = "internals"))]
pub use search::{
    search_rank, split_choices, SEARCH_CHECKS, SEARCH_KEPT, SEARCH_PER_TILE, SPLITS, SPLIT_K_RANKS,
};

/// Workspace bytes per stream for a device of compute capability `major`.x: 32 MiB from Hopper
/// on, 4 MiB before (the sizes cuBLAS's documentation recommends; PyTorch's default on Hopper
/// is 32 MiB too). The heuristics offer split-K algorithms only within the workspace: with
/// 4 MiB, the 512 × 4096 → 1024 forward product measured 147 µs with the best of six on the
/// H100 where PyTorch's single pick took 132 µs.
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
/// forward products, at six) gets more chances at a faster one; measuring
/// costs a few milliseconds per shape, once.
pub const MEASURED_ALGOS: usize = 12;

/// A product shape as cuBLASLt plans it (row-major, as [`crate::engine::gemm::gemm`]).
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

/// The element types of a product as cuBLASLt plans it: A and B (`ab`), C and D (`cd`), the
/// bias or bias-gradient vector (`bias`). Compute and scale are f32 for every combination.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LtTypes {
    /// A and B.
    pub ab: Dtype,
    /// C and D.
    pub cd: Dtype,
    /// The bias or bias-gradient vector (the D type unless an epilogue's vector is f32).
    pub bias: Dtype,
}

impl LtTypes {
    /// Everything f32: the fp32 (and TF32) products.
    pub const F32: LtTypes = LtTypes {
        ab: Dtype::F32,
        cd: Dtype::F32,
        bias: Dtype::F32,
    };

    /// The types of a product with operands of `ab`, result of `cd` and, for an epilogue with
    /// a vector, a vector of `bias` (`None`: the D type), if cuBLASLt multiplies them: all f32,
    /// or A and B in bf16 or f16 with C and D of that type or f32 and a vector of the D type
    /// or f32. Anything else is [`NnError::NotSupported`].
    pub fn new(ab: Dtype, cd: Dtype, bias: Option<Dtype>) -> Result<LtTypes> {
        let bias = bias.unwrap_or(cd);
        let ok = match ab {
            Dtype::F32 => cd == Dtype::F32 && bias == Dtype::F32,
            Dtype::Bf16 | Dtype::F16 => {
                (cd == ab || cd == Dtype::F32) && (bias == cd || bias == Dtype::F32)
            }
        };
        if !ok {
            return Err(NnError::NotSupported {
                op: "cuBLASLt product",
                what: format!("operands of {ab} with a result of {cd} and a vector of {bias}"),
                fix: "use all f32, or bf16/f16 operands with a result of the same type or f32 \
                      and a vector of the result's type or f32",
            });
        }
        Ok(LtTypes { ab, cd, bias })
    }

    /// The types a plan is made for: the vector's type only where `epilogue` has a vector
    /// (otherwise the D type), so that products without one share a plan.
    pub fn for_epilogue(self, epilogue: Epilogue) -> LtTypes {
        match epilogue {
            Epilogue::None => LtTypes {
                bias: self.cd,
                ..self
            },
            _ => self,
        }
    }

    /// Whether C and D are 16-bit.
    fn narrow_output(self) -> bool {
        self.cd != Dtype::F32
    }
}

/// A configuration found by the search (see the module docs), as
/// [`BlasLt::search_configs`] lists them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LtConfig {
    /// cuBLASLt's algorithm id (`CUBLASLT_ALGO_CONFIG_ID`).
    pub algo_id: i32,
    /// `cublasLtMatmulTile_t` (0: undefined).
    pub tile: u32,
    /// Rows × columns of cuBLASLt's D (our output transposed) the tile covers, if known.
    pub tile_shape: Option<(usize, usize)>,
    /// `cublasLtMatmulStages_t` (0: undefined).
    pub stages: u32,
    /// Whether the algorithm could also swizzle its thread blocks (the search uses none).
    pub swizzle_supported: bool,
    /// Workspace bytes it needs.
    pub workspace: usize,
    /// cuBLASLt's `wavesCount` for it.
    pub waves: f32,
}

/// Which algorithm of a plan [`BlasLt::matmul`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LtAlgo {
    /// The heuristic algorithm of this rank.
    Rank(usize),
    /// The split-K variant of the heuristic algorithm of rank `rank` with `split` splits (one
    /// of [`BlasLt::split_k_variants`]).
    SplitK { rank: u8, split: u8 },
    /// The searched configuration of this index (one of [`BlasLt::search_configs`]).
    Config(u8),
}

/// A searched configuration as `cublasLtMatmulAlgoCheck` accepted it.
#[derive(Clone, Copy, Debug)]
struct SearchConfig {
    info: LtConfig,
    result: HeuristicResult,
}

/// Descriptors and heuristic algorithms of one shape.
struct Plan {
    api: &'static Api,
    desc: Ptr,
    a: Ptr,
    b: Ptr,
    c: Ptr,
    algos: Vec<HeuristicResult>,
    /// Split-K variants of the first [`SPLIT_K_RANKS`] algorithms (see the module docs;
    /// `None` until first asked for: they are made only under the policy that measures them).
    split_k: Option<Vec<SplitVariant>>,
    /// The searched configurations (`None` until first asked for, likewise).
    search: Option<Vec<SearchConfig>>,
    /// Whether the bias gradient is fused (`BGRADB`); otherwise the caller reduces it.
    fused_bgrad: bool,
    /// The descriptor's compute type (`COMPUTE_32F`, or `COMPUTE_32F_FAST_TF32` with TF32).
    compute: u32,
    /// The element types of its layouts and vector.
    types: LtTypes,
}

/// A heuristic algorithm with its K split `split` ways, as `cublasLtMatmulAlgoCheck` accepted
/// it (`result.algo` the changed configuration, `result.workspace_size` what it needs).
#[derive(Clone, Copy, Debug)]
struct SplitVariant {
    rank: u8,
    split: u8,
    result: HeuristicResult,
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
    /// Plans per shape, element types and TF32 allowance.
    plans: HashMap<(LtShape, LtTypes, bool), Plan>,
}

// SAFETY: the handle and descriptors are plain cuBLASLt objects usable from any thread one call
// at a time; every use holds the `BlasLt` mutex.
unsafe impl Send for State {}

/// A cuBLASLt handle bound to one device (kept by the device's [`super::libraries::Libraries`]).
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

/// The descriptor (fp32 compute and scale; TF32 tensor cores allowed only when `tf32`, which
/// only all-f32 `types` take) and the three layouts of a row-major product of `types`, as
/// cuBLASLt's column-major view of it: Cᵀ (n×m) = op(B)ᵀ·op(A)ᵀ, so our B is cuBLASLt's A and
/// our A its B (as in `ffi::blas`). A vector type other than the D type is set as
/// `CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE`. No handle is needed; the plan has no algorithms yet.
fn describe_shape(a: &'static Api, s: &LtShape, types: LtTypes, tf32: bool) -> Result<Plan> {
    if tf32 && types != LtTypes::F32 {
        return Err(NnError::NotSupported {
            op: "cuBLASLt product",
            what: format!("TF32 with operands of {}", types.ab),
            fix: "TF32 applies to f32 products only; pass tf32 = false",
        });
    }
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
        split_k: None,
        search: None,
        fused_bgrad: false,
        compute: if tf32 {
            COMPUTE_32F_FAST_TF32
        } else {
            COMPUTE_32F
        },
        types,
    };
    let (ab, cd) = (cuda_type(types.ab), cuda_type(types.cd));
    let (la_rows, la_cols) = if s.tb == Trans::N { (n, k) } else { (k, n) };
    let (lb_rows, lb_cols) = if s.ta == Trans::N { (k, m) } else { (m, k) };
    let op = |t: Trans| if t == Trans::N { OP_N } else { OP_T };
    // SAFETY: each create call writes one object into `p` (destroyed by Plan's Drop, also on
    // the early returns) from plain integers.
    unsafe {
        check(
            a,
            (a.desc_create)(&mut p.desc, p.compute, R_32F),
            "cublasLtMatmulDescCreate",
        )?;
        check(
            a,
            (a.layout_create)(&mut p.a, ab, la_rows as u64, la_cols as u64, la_rows),
            "cublasLtMatrixLayoutCreate",
        )?;
        check(
            a,
            (a.layout_create)(&mut p.b, ab, lb_rows as u64, lb_cols as u64, lb_rows),
            "cublasLtMatrixLayoutCreate",
        )?;
        check(
            a,
            (a.layout_create)(&mut p.c, cd, n as u64, m as u64, n),
            "cublasLtMatrixLayoutCreate",
        )?;
    }
    set_attr(a, p.desc, DESC_TRANSA, &op(s.tb).to_ne_bytes())?;
    set_attr(a, p.desc, DESC_TRANSB, &op(s.ta).to_ne_bytes())?;
    if types.bias != types.cd {
        // i32, a cudaDataType_t.
        let t = cuda_type(types.bias) as i32;
        set_attr(a, p.desc, DESC_BIAS_DATA_TYPE, &t.to_ne_bytes())?;
    }
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

/// A preference for at most `ws_bytes` of workspace, pointers aligned to `align` bytes (A,
/// B, C and D) and, where `reductions` is given, split-K reductions of those schemes only.
fn preference(
    a: &Api,
    align: u32,
    ws_bytes: usize,
    reductions: Option<u32>,
) -> Result<Preference<'_>> {
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
    if let Some(mask) = reductions {
        // u32, a mask of cublasLtReductionScheme_t.
        set(PREF_REDUCTION_SCHEME_MASK, &mask.to_ne_bytes())?;
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

    /// Descriptors of `s` for `types` and cuBLASLt's heuristic algorithms for them.
    fn new_plan(&self, handle: Ptr, s: &LtShape, types: LtTypes, tf32: bool) -> Result<Plan> {
        let mut p = describe_shape(self.api, s, types, tf32)?;
        let wanted = match s.epilogue {
            Epilogue::None => EPI_DEFAULT,
            Epilogue::Bias => EPI_BIAS,
            Epilogue::BiasRelu => EPI_RELU_BIAS,
            Epilogue::BiasGelu => EPI_GELU_BIAS,
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

    /// Makes the plan's split-K variants or searched configurations, whichever `which` picks
    /// from, if they were not made yet (heuristic ranks need nothing).
    fn prepare(&self, handle: Ptr, p: &mut Plan, s: &LtShape, which: LtAlgo) {
        match which {
            LtAlgo::Rank(_) => {}
            LtAlgo::SplitK { .. } if p.split_k.is_none() => {
                p.split_k = Some(self.split_variants(handle, p, s));
            }
            LtAlgo::Config(_) if p.search.is_none() => {
                p.search = Some(self.search(handle, p, s));
            }
            LtAlgo::SplitK { .. } | LtAlgo::Config(_) => {}
        }
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
        // With a 16-bit D, split-K partial sums are added in the compute type only.
        let reductions = p.types.narrow_output().then_some(REDUCE_COMPUTE_TYPE);
        let pref = preference(a, align, self.ws_bytes, reductions)?;
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

    /// Runs `f` on the handle and the plan of `s` (made on first use, with what `which`
    /// picks from: [`Self::prepare`]), under the state lock.
    fn with_plan<R>(
        &self,
        s: &LtShape,
        types: LtTypes,
        tf32: bool,
        which: LtAlgo,
        f: impl FnOnce(Ptr, &Plan) -> Result<R>,
    ) -> Result<R> {
        let types = types.for_epilogue(s.epilogue);
        self.ctx.bind()?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let handle = st.handle;
        let plan = match st.plans.entry((*s, types, tf32)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(self.new_plan(handle, s, types, tf32)?)
            }
        };
        self.prepare(handle, plan, s, which);
        f(handle, plan)
    }

    /// How many heuristic algorithms cuBLASLt offers for `s` (0: none; use another engine),
    /// and whether the bias gradient is fused (full fp32).
    pub fn algo_count(&self, s: &LtShape) -> Result<(usize, bool)> {
        self.algo_count_math(s, false)
    }

    /// As [`BlasLt::algo_count`], for the plan with TF32 allowed when `tf32`.
    pub fn algo_count_math(&self, s: &LtShape, tf32: bool) -> Result<(usize, bool)> {
        self.algo_count_of(s, LtTypes::F32, tf32)
    }

    /// As [`BlasLt::algo_count`], for the plan of `types` ([`LtTypes::new`]; no TF32).
    pub fn algo_count_typed(&self, s: &LtShape, types: LtTypes) -> Result<(usize, bool)> {
        self.algo_count_of(s, types, false)
    }

    fn algo_count_of(&self, s: &LtShape, types: LtTypes, tf32: bool) -> Result<(usize, bool)> {
        self.with_plan(s, types, tf32, LtAlgo::Rank(0), |_, p| {
            Ok((p.algos.len(), p.fused_bgrad))
        })
    }

    /// The split-K variants kept for `s`, as (rank, splits) pairs for [`BlasLt::matmul`],
    /// made on the first call for the shape (empty when no algorithm is under-occupied or the
    /// library cannot make them).
    pub fn split_k_variants(&self, s: &LtShape) -> Result<Vec<(u8, u8)>> {
        self.split_k_variants_math(s, false)
    }

    /// As [`BlasLt::split_k_variants`], for the plan with TF32 allowed when `tf32`.
    pub fn split_k_variants_math(&self, s: &LtShape, tf32: bool) -> Result<Vec<(u8, u8)>> {
        self.split_k_variants_of(s, LtTypes::F32, tf32)
    }

    /// As [`BlasLt::split_k_variants`], for the plan of `types` (no TF32).
    pub fn split_k_variants_typed(&self, s: &LtShape, types: LtTypes) -> Result<Vec<(u8, u8)>> {
        self.split_k_variants_of(s, types, false)
    }

    fn split_k_variants_of(
        &self,
        s: &LtShape,
        types: LtTypes,
        tf32: bool,
    ) -> Result<Vec<(u8, u8)>> {
        let which = LtAlgo::SplitK { rank: 0, split: 0 };
        self.with_plan(s, types, tf32, which, |_, p| {
            Ok(p.split_k
                .iter()
                .flatten()
                .map(|v| (v.rank, v.split))
                .collect())
        })
    }

    /// The configurations the search kept for `s` (see the module docs), searched on the first
    /// call for the shape; [`LtAlgo::Config`] indexes this list (empty when the library cannot
    /// search or nothing passed the check).
    pub fn search_configs(&self, s: &LtShape) -> Result<Vec<LtConfig>> {
        self.search_configs_math(s, false)
    }

    /// As [`BlasLt::search_configs`], for the plan with TF32 allowed when `tf32`.
    pub fn search_configs_math(&self, s: &LtShape, tf32: bool) -> Result<Vec<LtConfig>> {
        self.search_configs_of(s, LtTypes::F32, tf32)
    }

    /// As [`BlasLt::search_configs`], for the plan of `types` (no TF32).
    pub fn search_configs_typed(&self, s: &LtShape, types: LtTypes) -> Result<Vec<LtConfig>> {
        self.search_configs_of(s, types, false)
    }

    fn search_configs_of(&self, s: &LtShape, types: LtTypes, tf32: bool) -> Result<Vec<LtConfig>> {
        self.with_plan(s, types, tf32, LtAlgo::Config(0), |_, p| {
            Ok(p.search.iter().flatten().map(|c| c.info).collect())
        })
    }

    /// Row-major `C = epilogue(alpha·op(A)·op(B) + beta·C)` with cuBLASLt's algorithm `which`
    /// for the shape: a heuristic rank, a split-K variant (one of
    /// [`BlasLt::split_k_variants`]) or a searched configuration (one of
    /// [`BlasLt::search_configs`]); any other is an error and nothing runs. `bias` is the bias of
    /// `Bias`/`BiasRelu` (length n) or the output of `BiasGrad` (length m, the rows of op(A)).
    /// Returns whether the bias gradient was computed (with `BiasGrad`, `false` means the
    /// caller must reduce it). Full fp32; [`BlasLt::matmul_math`] may allow TF32.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        q: &dyn Queue,
        s: &LtShape,
        which: LtAlgo,
        alpha: f32,
        a: &DeviceBuffer<f32>,
        b: &DeviceBuffer<f32>,
        beta: f32,
        c: &DeviceBuffer<f32>,
        bias: Option<&DeviceBuffer<f32>>,
    ) -> Result<bool> {
        self.matmul_math(q, s, false, which, alpha, a, b, beta, c, bias)
    }

    /// As [`BlasLt::matmul`], with the plan that allows TF32 tensor cores when `tf32`
    /// (`CUBLAS_COMPUTE_32F_FAST_TF32`; its algorithm ranks are that plan's).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_math(
        &self,
        q: &dyn Queue,
        s: &LtShape,
        tf32: bool,
        which: LtAlgo,
        alpha: f32,
        a: &DeviceBuffer<f32>,
        b: &DeviceBuffer<f32>,
        beta: f32,
        c: &DeviceBuffer<f32>,
        bias: Option<&DeviceBuffer<f32>>,
    ) -> Result<bool> {
        self.matmul_inner(q, s, tf32, which, alpha, a, b, beta, c, bias)
    }

    /// As [`BlasLt::matmul`] for the element types of the buffers: A and B of `T`, C and D of
    /// `O`, the bias (or bias-gradient output) of `V` ([`LtTypes::new`] says which
    /// combinations; any other is [`NnError::NotSupported`] and nothing runs). Algorithm ranks,
    /// split-K variants and searched configurations are those of the plan of these types
    /// (`algo_count_typed` and its siblings); compute and scale f32, no TF32.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_typed<T: Float, O: Float, V: Float>(
        &self,
        q: &dyn Queue,
        s: &LtShape,
        which: LtAlgo,
        alpha: f32,
        a: &DeviceBuffer<T>,
        b: &DeviceBuffer<T>,
        beta: f32,
        c: &DeviceBuffer<O>,
        bias: Option<&DeviceBuffer<V>>,
    ) -> Result<bool> {
        self.matmul_inner(q, s, false, which, alpha, a, b, beta, c, bias)
    }

    /// The product on the plan of the buffers' element types (and TF32 when `tf32`): every
    /// length, device and alignment checked, then `cublasLtMatmul`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_inner<T: Float, O: Float, V: Float>(
        &self,
        q: &dyn Queue,
        s: &LtShape,
        tf32: bool,
        which: LtAlgo,
        alpha: f32,
        a: &DeviceBuffer<T>,
        b: &DeviceBuffer<T>,
        beta: f32,
        c: &DeviceBuffer<O>,
        bias: Option<&DeviceBuffer<V>>,
    ) -> Result<bool> {
        // The plan's layouts and vector are of exactly these element types.
        let types = LtTypes::new(T::DTYPE, O::DTYPE, bias.map(|_| V::DTYPE))?;
        need("gemm A", a, prod("cuBLASLt A", &[s.m, s.k])?)?;
        need("gemm B", b, prod("cuBLASLt B", &[s.k, s.n])?)?;
        need("gemm C", c, prod("cuBLASLt C", &[s.m, s.n])?)?;
        let bias_len = match s.epilogue {
            Epilogue::None => 0,
            Epilogue::Bias | Epilogue::BiasRelu | Epilogue::BiasGelu => s.n,
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
        // The handle, A, B, C, the bias and (below) the workspace are all the queue's device's.
        handle_on_device(q, "cuBLASLt handle", self.ctx.ordinal())?;
        let operands = [
            ("gemm A", a.block()),
            ("gemm B", b.block()),
            ("gemm C", c.block()),
        ];
        on_device(
            q,
            operands
                .into_iter()
                .chain(bias.map(|v| ("gemm bias", v.block()))),
        )?;
        let mut addrs = vec![a.addr(), b.addr(), c.addr()];
        addrs.extend(bias.map(|v| v.addr()));
        if alignment(&addrs) < s.align {
            return Err(NnError::Shape(format!(
                "cuBLASLt: pointers aligned to {} bytes for a plan that needs {}",
                alignment(&addrs),
                s.align
            )));
        }
        let stream = q.stream_handle();
        self.with_plan(s, types, tf32, which, |handle, p| {
            let algo = match which {
                LtAlgo::Rank(rank) => p.algos.get(rank).ok_or_else(|| NnError::Library {
                    library: "cuBLASLt",
                    call: "cublasLtMatmulAlgoGetHeuristic",
                    status: format!(
                        "no algorithm of rank {rank} for {s:?} ({} offered)",
                        p.algos.len()
                    ),
                })?,
                LtAlgo::SplitK {
                    rank,
                    split: splits,
                } => p
                    .split_k
                    .iter()
                    .flatten()
                    .find(|v| v.rank == rank && v.split == splits)
                    .map(|v| &v.result)
                    .ok_or_else(|| NnError::Library {
                        library: "cuBLASLt",
                        call: "cublasLtMatmulAlgoCheck",
                        status: format!(
                            "no split-K variant {rank}/sk{splits} for {s:?} (kept: {:?})",
                            p.split_k
                                .iter()
                                .flatten()
                                .map(|v| format!("{}/sk{}", v.rank, v.split))
                                .collect::<Vec<_>>()
                        ),
                    })?,
                LtAlgo::Config(i) => {
                    let kept = p.search.as_deref().unwrap_or_default();
                    kept.get(i as usize)
                        .map(|c| &c.result)
                        .ok_or_else(|| NnError::Library {
                            library: "cuBLASLt",
                            call: "cublasLtMatmulAlgoCheck",
                            status: format!(
                                "no searched configuration c{i} for {s:?} ({} kept)",
                                kept.len()
                            ),
                        })?
                }
            };
            let fused = match s.epilogue {
                Epilogue::None => false,
                Epilogue::Bias | Epilogue::BiasRelu | Epilogue::BiasGelu => true,
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
            if let Some(w) = &ws {
                on_device(q, [("cuBLASLt workspace", w.block())])?;
            }
            for block in [a.block(), b.block(), c.block()] {
                q.use_block(block);
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
            // describe m×k, k×n and m×n elements of the buffers' own element types (the plan
            // is keyed by `types`, derived from T, O and V above) in the checked buffers (and a
            // bias of the checked length and of the plan's vector type, used only with a fused
            // epilogue), all of them and the workspace
            // memory of the queue's device, the handle's (checked); the algorithm came from
            // cuBLASLt's heuristic for exactly these descriptors, or is a split-K variant of one
            // or a searched configuration that `cublasLtMatmulAlgoCheck` accepted for them
            // (alignment needs within the plan's), and gets the `workspace_size` bytes reported for it (null when none);
            // the pointers are at least as aligned as the plan assumed (checked); every buffer
            // is kept alive and ordered by `use_block`; alpha/beta and the attribute values are
            // read before the calls return.
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
        })
    }
}

#[cfg(test)]
mod tests {
    use cudarc::cublaslt::sys as ls;

    use super::search::*;
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
                // The split-K functions exist in every cuBLASLt from 10.1 on.
                assert!(
                    api.split_k.is_some(),
                    "cuBLASLt {v} without split-K functions"
                );
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
            let p = describe_shape(api, &s, LtTypes::F32, false).unwrap();
            let t = describe_shape(api, &s, LtTypes::F32, true).unwrap();
            assert_eq!((p.compute, t.compute), (COMPUTE_32F, COMPUTE_32F_FAST_TF32));
            for e in [
                EPI_DEFAULT,
                EPI_BIAS,
                EPI_RELU_BIAS,
                EPI_GELU_BIAS,
                EPI_BGRADB,
            ] {
                set_attr(api, p.desc, DESC_EPILOGUE, &e.to_ne_bytes()).unwrap();
            }
            set_attr(api, p.desc, DESC_BIAS_POINTER, &0x1000u64.to_ne_bytes()).unwrap();
        }
        for align in [4, 16, 256] {
            preference(api, align, workspace_for(9), None).unwrap();
            preference(api, align, workspace_for(9), Some(REDUCE_COMPUTE_TYPE)).unwrap();
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
            LtTypes::F32,
            false,
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
        assert!(describe_shape(api, &empty, LtTypes::F32, false).is_err());
    }

    /// Where cuBLASLt is installed: the half-precision layouts, an f32 vector type with a
    /// 16-bit D and the GELU epilogue are described without a GPU; TF32 is refused for them.
    #[test]
    fn half_precision_descriptors_are_accepted_where_cublaslt_is_installed() {
        let Ok(api) = api() else {
            println!("cuBLASLt unavailable here");
            return;
        };
        let s = LtShape {
            ta: Trans::N,
            tb: Trans::T,
            m: 3,
            n: 7,
            k: 13,
            epilogue: Epilogue::BiasGelu,
            align: 256,
        };
        for ab in [Dtype::Bf16, Dtype::F16] {
            for cd in [ab, Dtype::F32] {
                let t = LtTypes::new(ab, cd, None).unwrap();
                let p = describe_shape(api, &s, t, false).unwrap();
                assert_eq!((p.types, p.compute), (t, COMPUTE_32F));
                set_attr(api, p.desc, DESC_EPILOGUE, &EPI_GELU_BIAS.to_ne_bytes()).unwrap();
                assert!(describe_shape(api, &s, t, true).is_err());
                // An f32 vector with a 16-bit D: described, or refused with a typed error
                // (cuBLASLt documents that type only for IMMA and FP8 kernels).
                let f = LtTypes::new(ab, cd, Some(Dtype::F32)).unwrap();
                match describe_shape(api, &s, f, false) {
                    Ok(p) => assert_eq!(p.types, f),
                    Err(e) => assert!(matches!(e, NnError::Library { .. }), "{e}"),
                }
            }
        }
    }

    /// The numbers the half-precision plans use are the cuBLASLt 12/13 header's
    /// (cudaDataType_t, cublasLtMatmulDescAttributes_t, cublasLtEpilogue_t,
    /// cublasLtMatmulPreferenceAttributes_t).
    #[test]
    fn half_precision_attributes_have_the_header_values() {
        assert_eq!((R_32F, R_16F, R_16BF), (0, 2, 14));
        assert_eq!(
            (
                cuda_type(Dtype::F32),
                cuda_type(Dtype::F16),
                cuda_type(Dtype::Bf16)
            ),
            (0, 2, 14)
        );
        assert_eq!(DESC_BIAS_DATA_TYPE, 26);
        assert_eq!((EPI_GELU_BIAS, EPI_BGRADB), (36, 512));
        assert_eq!(PREF_REDUCTION_SCHEME_MASK, 3);
    }

    /// The attribute and scheme numbers split-K variants use are the cuBLASLt 12/13 header's
    /// (cublasLtMatmulAlgoConfigAttributes_t, cublasLtMatmulAlgoCapAttributes_t,
    /// cublasLtReductionScheme_t), whatever the bindings say.
    #[test]
    fn split_k_attributes_have_the_header_values() {
        assert_eq!(
            (CONFIG_TILE_ID, CONFIG_SPLITK_NUM, CONFIG_REDUCTION_SCHEME),
            (1, 2, 3)
        );
        assert_eq!(
            (
                CAP_SPLITK_SUPPORT,
                CAP_REDUCTION_SCHEME_MASK,
                CAP_MIN_ALIGNMENT_A
            ),
            (0, 1, 16)
        );
        assert_eq!(
            (REDUCE_INPLACE, REDUCE_COMPUTE_TYPE, REDUCE_OUTPUT_TYPE),
            (1, 2, 4)
        );
    }

    /// The tile table agrees with the bindings' `cublasLtMatmulTile_t` (ids and names) at its
    /// start, middle and end, and knows nothing past it.
    #[test]
    fn tile_shapes_follow_the_header() {
        use ls::cublasLtMatmulTile_t as T;
        for t in [
            T::CUBLASLT_MATMUL_TILE_8x8,
            T::CUBLASLT_MATMUL_TILE_64x128,
            T::CUBLASLT_MATMUL_TILE_128x128,
            T::CUBLASLT_MATMUL_TILE_192x128,
            T::CUBLASLT_MATMUL_TILE_256x32,
            T::CUBLASLT_MATMUL_TILE_8x128,
            T::CUBLASLT_MATMUL_TILE_680x64,
            T::CUBLASLT_MATMUL_TILE_256x152,
            T::CUBLASLT_MATMUL_TILE_768x80,
            T::CUBLASLT_MATMUL_TILE_512x1024,
        ] {
            let name = format!("{t:?}");
            let dims = name.trim_start_matches("CUBLASLT_MATMUL_TILE_");
            let (r, c) = dims.split_once('x').unwrap();
            let want = (r.parse().unwrap(), c.parse().unwrap());
            assert_eq!(tile_shape(t as u32), Some(want), "{name}");
        }
        assert_eq!(tile_shape(0), None);
        let known = TILE_SHAPES.split_ascii_whitespace().count();
        assert!(known >= T::CUBLASLT_MATMUL_TILE_END as usize - 1, "{known}");
        assert_eq!(tile_shape(known as u32 + 1), None);
        assert_eq!(tile_shape(u32::MAX), None);
    }

    #[test]
    fn split_choices_fill_about_one_wave_within_two() {
        // 512 × 1024 with 128 × 128 tiles on 132 SMs: 32 blocks, K = 256 (8 splits of 32).
        let fill = 32.0 / 132.0;
        assert_eq!(split_choices(fill, 256, 4), vec![3, 4, 6, 8]);
        assert_eq!(split_choices(fill, 256, 2), vec![3, 4]);
        // K = 96 keeps 32 per split for at most 3 splits.
        assert_eq!(split_choices(fill, 96, 4), vec![2, 3]);
        assert!(split_choices(fill, 63, 4).is_empty());
        // A handful of blocks: the deepest splits.
        assert_eq!(split_choices(3.0 / 132.0, 1023, 4), vec![4, 6, 8, 16]);
        // Nearly full: only two waves' worth.
        assert_eq!(split_choices(0.9, 4096, 4), vec![2]);
        // Full, or nothing known: no variants.
        for fill in [1.0, 3.5, 0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(split_choices(fill, 4096, 4).is_empty(), "{fill}");
        }
        assert!(split_choices(0.1, 4096, 0).is_empty());
        // Never more than SPLITS_PER_RANK in all.
        assert_eq!(SPLITS_PER_RANK.iter().sum::<usize>(), 8);
    }

    /// The attribute numbers the search uses are the cuBLASLt 12/13 header's
    /// (cublasLtMatmulAlgoConfigAttributes_t, cublasLtMatmulAlgoCapAttributes_t), whatever
    /// the bindings say.
    #[test]
    fn search_attributes_have_the_header_values() {
        assert_eq!(
            (CONFIG_ID, CONFIG_CTA_SWIZZLING, CONFIG_STAGES_ID),
            (0, 4, 6)
        );
        assert_eq!(
            (CAP_CTA_SWIZZLING_SUPPORT, CAP_TILE_IDS, CAP_STAGES_IDS),
            (2, 6, 13)
        );
        assert!(SEARCH_KEPT <= SEARCH_CHECKS && SEARCH_KEPT <= u8::MAX as usize + 1);
    }

    /// Sizes at the ends of the range rank without overflow (zero SMs count as one).
    #[test]
    fn search_rank_takes_any_size_without_overflow() {
        let huge = Some((usize::MAX, usize::MAX));
        assert_eq!(search_rank(huge, usize::MAX, usize::MAX, 0).0, 0);
        assert_eq!(search_rank(huge, 1, 1, 132).0, 1);
        let (group, fill, area) = search_rank(Some((1, 1)), usize::MAX, usize::MAX, 132);
        assert_eq!(group, 0);
        assert!(fill <= 0 && area == -1);
        assert_eq!(search_rank(Some((0, 64)), 10, 10, 132), (2, 0, 0));
    }

    /// The search's order: whole waves first (by how full their last wave keeps the device,
    /// in 5 % steps), then larger tiles; grids under one wave next (more blocks first), then
    /// unknown tiles.
    #[test]
    fn search_rank_prefers_full_waves_then_larger_tiles() {
        // cuBLASLt's D of the 512 × 256 → 1024 forward product is 1024 × 512; 132 SMs.
        let r = |t| search_rank(Some(t), 1024, 512, 132);
        // 32 × 64: 256 blocks in 2 waves (97 %); 32 × 32: 512 in 4 (97 %), smaller tile.
        assert!(r((32, 64)) < r((32, 32)));
        // Equal fill and area: equal rank (the enumeration order decides).
        assert_eq!(r((32, 64)), r((64, 32)));
        // 8 × 8: 8192 blocks in 63 waves (99 %): same 5 % step as 32 × 32, smaller tile.
        assert!(r((32, 32)) < r((8, 8)));
        // 64 × 48: 176 blocks in 2 waves (67 %): behind the fuller ones despite its size.
        assert!(r((8, 8)) < r((64, 48)));
        // Under one wave: 64 × 64 gives 128 blocks, 128 × 128 gives 32; both behind any
        // whole wave, more blocks first.
        assert!(r((64, 48)) < r((64, 64)));
        assert!(r((64, 64)) < r((128, 128)));
        // Unknown tiles last.
        assert!(r((256, 256)) < search_rank(None, 1024, 512, 132));
        assert_eq!(search_rank(Some((0, 8)), 1024, 512, 132), (2, 0, 0));
        // Exactly one full wave is the best fill there is.
        assert_eq!(search_rank(Some((1, 1)), 132, 1, 132), (0, -20, -1));
        // No SMs reported: treated as one.
        assert_eq!(search_rank(Some((4, 4)), 8, 8, 0).0, 0);
    }
}
