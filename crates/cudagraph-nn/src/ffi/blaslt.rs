//! cuBLASLt matrix products with fused epilogues, loaded at run time: the forward layout with
//! bias or bias+ReLU fused, the backward layouts, and the bias gradient fused into the weight
//! gradient (`BGRADB`) where cuBLASLt offers it for fp32.
//!
//! As for cuDNN ([`crate::ffi::cudnn`]), cudarc's `cublaslt` feature loads the library and this
//! module looks up each function with its C signature and raw integer status codes, all before
//! the first call (a missing symbol means "cuBLASLt unavailable", never a panic). Compute type
//! `CUBLAS_COMPUTE_32F` (no TF32). One handle per device; each call allocates the workspace its
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

use std::collections::HashMap;
use std::ffi::{c_char, c_int};
use std::sync::Mutex;

use cudagraph::runtime::{with_relaxed_capture, Context};
use cudagraph::{DeviceBuffer, Queue, QueueExt};
use cudarc::cublaslt::sys as ls;

use super::loader::{check, describe, lib_fn, CPtr, Loaded, Ptr, Status, StatusText, SUCCESS};
use crate::error::{NnError, Result};
use crate::extent::{alignment, handle_on_device, on_device};
use crate::ffi::blas::Epilogue;
use crate::ffi::blas::Trans;

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
const CONFIG_ID: u32 = ls::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_ID as u32;
const CONFIG_CTA_SWIZZLING: u32 =
    ls::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING as u32;
const CONFIG_STAGES_ID: u32 =
    ls::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_STAGES_ID as u32;
const CAP_CTA_SWIZZLING_SUPPORT: u32 =
    ls::cublasLtMatmulAlgoCapAttributes_t::CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT as u32;
const CAP_TILE_IDS: u32 = ls::cublasLtMatmulAlgoCapAttributes_t::CUBLASLT_ALGO_CAP_TILE_IDS as u32;
const CAP_STAGES_IDS: u32 =
    ls::cublasLtMatmulAlgoCapAttributes_t::CUBLASLT_ALGO_CAP_STAGES_IDS as u32;
const CONFIG_TILE_ID: u32 =
    ls::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_TILE_ID as u32;
const CONFIG_SPLITK_NUM: u32 =
    ls::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM as u32;
const CONFIG_REDUCTION_SCHEME: u32 =
    ls::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME as u32;
const CAP_SPLITK_SUPPORT: u32 =
    ls::cublasLtMatmulAlgoCapAttributes_t::CUBLASLT_ALGO_CAP_SPLITK_SUPPORT as u32;
const CAP_REDUCTION_SCHEME_MASK: u32 =
    ls::cublasLtMatmulAlgoCapAttributes_t::CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK as u32;
const CAP_MIN_ALIGNMENT_A: u32 =
    ls::cublasLtMatmulAlgoCapAttributes_t::CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES as u32;
const REDUCE_INPLACE: u32 = ls::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_INPLACE as u32;
const REDUCE_COMPUTE_TYPE: u32 =
    ls::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
const REDUCE_OUTPUT_TYPE: u32 =
    ls::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE as u32;

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

/// How many of the first heuristic algorithms get split-K variants.
pub const SPLIT_K_RANKS: usize = 3;

/// The K splits a split-K variant may use (at most four of them per algorithm, eight per shape).
pub const SPLITS: [u8; 6] = [2, 3, 4, 6, 8, 16];

/// How many split-K variants the algorithm of each rank below [`SPLIT_K_RANKS`] may get: eight
/// in all, so that measuring a shape's candidates stays cheap.
const SPLITS_PER_RANK: [usize; SPLIT_K_RANKS] = [4, 2, 2];

/// The fewest K elements a split keeps.
const MIN_K_PER_SPLIT: usize = 32;

/// The reduction schemes a variant tries, in order: in place (the output buffer, with counters
/// in the workspace that keep the splits in sequence, as the header puts it), then partial
/// results in the workspace in the compute type, then in the output type, each reduced in a
/// separate step (the same type here: fp32). The first one the algorithm supports and
/// `cublasLtMatmulAlgoCheck` accepts within the workspace is kept. None is described as using
/// atomics; the GPU tests check that repeated runs and graph replays give the same bits.
const REDUCTION_ORDER: [u32; 3] = [REDUCE_INPLACE, REDUCE_COMPUTE_TYPE, REDUCE_OUTPUT_TYPE];

/// How many algorithm ids the search asks `cublasLtMatmulAlgoGetIds` for.
const SEARCH_IDS: usize = 128;

/// The most `cublasLtMatmulAlgoCheck` calls the search makes per shape (each a host-side call
/// of microseconds; the shape's plan is searched once).
pub const SEARCH_CHECKS: usize = 256;

/// The most searched configurations a shape keeps (the registry measures them all).
pub const SEARCH_KEPT: usize = 8;

/// The most kept configurations with the same tile (different ids or stage counts), so that
/// the kept ones cover at least four tiles where that many pass the check.
pub const SEARCH_PER_TILE: usize = 2;

/// The longest capability list (tile or stage ids) read.
const MAX_CAP_LIST: usize = 4096;

/// Where a configuration whose tile is `tile` (rows × columns of cuBLASLt's D, `None` when
/// undefined or unknown) stands in the search's order for a D of `rows` × `cols` on `sms`
/// multiprocessors; smaller is tried first. With a known tile the grid has
/// ⌈rows/tile rows⌉·⌈cols/tile cols⌉ thread blocks: grids of at least one wave come first,
/// ordered by how full they keep the device over their waves (blocks / (waves rounded up ×
/// SMs), in 5 % steps, fuller first), then by larger tiles (more work per block, fewer
/// loads of A and B); grids under one wave come next, more blocks first, then larger tiles;
/// unknown tiles last. Ties keep the enumeration order (algorithm id, tile id, stages id).
pub fn search_rank(
    tile: Option<(usize, usize)>,
    rows: usize,
    cols: usize,
    sms: usize,
) -> (u8, i64, i64) {
    let Some((tr, tc)) = tile.filter(|&(r, c)| r > 0 && c > 0) else {
        return (2, 0, 0);
    };
    let sms = sms.max(1);
    let blocks = rows.div_ceil(tr).saturating_mul(cols.div_ceil(tc));
    let area = -(tr.saturating_mul(tc).min(i64::MAX as usize) as i64);
    if blocks >= sms {
        let slots = blocks.div_ceil(sms).saturating_mul(sms);
        let fill_step = (blocks.saturating_mul(20) / slots) as i64;
        (0, -fill_step, area)
    } else {
        (1, -(blocks as i64), area)
    }
}

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
    /// What split-K variants need (`None` where a symbol is missing: no variants).
    split_k: Option<SplitKApi>,
    /// What the search needs besides `split_k` (`None` where a symbol is missing: no
    /// searched configurations).
    search: Option<SearchApi>,
}

/// The functions that list a type combination's algorithm ids and make an algorithm of one.
struct SearchApi {
    /// `cublasLtMatmulAlgoGetIds(handle, compute, scale, A, B, C, D, requested, ids, count)`.
    #[allow(clippy::type_complexity)]
    get_ids: unsafe extern "C" fn(
        Ptr,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        c_int,
        *mut c_int,
        *mut c_int,
    ) -> Status,
    /// `cublasLtMatmulAlgoInit(handle, compute, scale, A, B, C, D, id, algo)`.
    #[allow(clippy::type_complexity)]
    init: unsafe extern "C" fn(Ptr, u32, u32, u32, u32, u32, u32, c_int, *mut [u64; 8]) -> Status,
}

/// The functions that read and change an algorithm's configuration and validate the result.
struct SplitKApi {
    /// `cublasLtMatmulAlgoCheck(handle, desc, A, B, C, D, algo, result)`.
    #[allow(clippy::type_complexity)]
    check: unsafe extern "C" fn(
        Ptr,
        Ptr,
        Ptr,
        Ptr,
        Ptr,
        Ptr,
        *const [u64; 8],
        *mut HeuristicResult,
    ) -> Status,
    /// `cublasLtMatmulAlgoConfigGetAttribute(algo, attr, buf, size, written)`.
    config_get: unsafe extern "C" fn(*const [u64; 8], u32, Ptr, usize, *mut usize) -> Status,
    /// `cublasLtMatmulAlgoConfigSetAttribute(algo, attr, buf, size)`.
    config_set: unsafe extern "C" fn(*mut [u64; 8], u32, CPtr, usize) -> Status,
    /// `cublasLtMatmulAlgoCapGetAttribute(algo, attr, buf, size, written)`.
    cap_get: unsafe extern "C" fn(*const [u64; 8], u32, Ptr, usize, *mut usize) -> Status,
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
        split_k: load_split_k(lib).ok(),
        search: load_search(lib).ok(),
    })
}

fn load_search(lib: &libloading::Library) -> std::result::Result<SearchApi, String> {
    Ok(SearchApi {
        get_ids: lib_fn!(lib, "cublasLtMatmulAlgoGetIds"),
        init: lib_fn!(lib, "cublasLtMatmulAlgoInit"),
    })
}

fn load_split_k(lib: &libloading::Library) -> std::result::Result<SplitKApi, String> {
    Ok(SplitKApi {
        check: lib_fn!(lib, "cublasLtMatmulAlgoCheck"),
        config_get: lib_fn!(lib, "cublasLtMatmulAlgoConfigGetAttribute"),
        config_set: lib_fn!(lib, "cublasLtMatmulAlgoConfigSetAttribute"),
        cap_get: lib_fn!(lib, "cublasLtMatmulAlgoCapGetAttribute"),
    })
}

impl SplitKApi {
    /// A 4-byte configuration attribute of `algo` (u32 for TILE_ID, SPLITK_NUM and
    /// REDUCTION_SCHEME); `None` when cuBLASLt refuses or writes another size.
    fn config(&self, algo: &[u64; 8], attr: u32) -> Option<[u8; 4]> {
        let mut v = [0u8; 4];
        let mut written = 0usize;
        // SAFETY: `algo` is a whole cublasLtMatmulAlgo_t (8 × u64) that the call only reads;
        // `v` has the 4 writable bytes passed as its size, `written` is a valid usize.
        let st =
            unsafe { (self.config_get)(algo, attr, v.as_mut_ptr() as Ptr, v.len(), &mut written) };
        (st == SUCCESS && written == v.len()).then_some(v)
    }

    /// A 4-byte capability attribute of `algo` (i32 for SPLITK_SUPPORT, u32 for
    /// REDUCTION_SCHEME_MASK and the MIN_ALIGNMENT_* bytes).
    fn cap(&self, algo: &[u64; 8], attr: u32) -> Option<[u8; 4]> {
        let mut v = [0u8; 4];
        let mut written = 0usize;
        // SAFETY: as in `config`: `algo` is read only, `v` has the 4 bytes passed.
        let st =
            unsafe { (self.cap_get)(algo, attr, v.as_mut_ptr() as Ptr, v.len(), &mut written) };
        (st == SUCCESS && written == v.len()).then_some(v)
    }

    /// A capability attribute of `algo` that is an array of u32 (TILE_IDS, STAGES_IDS): its
    /// size asked first (a zero-sized query), then read whole; empty when cuBLASLt refuses,
    /// lists nothing or answers a size that is no whole number of u32s.
    fn cap_list(&self, algo: &[u64; 8], attr: u32) -> Vec<u32> {
        let mut needed = 0usize;
        // SAFETY: `algo` is read only; a null buffer of size 0 asks for the size only, which
        // is written to `needed`.
        let st = unsafe { (self.cap_get)(algo, attr, std::ptr::null_mut(), 0, &mut needed) };
        if st != SUCCESS || needed == 0 || needed % 4 != 0 || needed > 4 * MAX_CAP_LIST {
            return Vec::new();
        }
        let mut v = vec![0u32; needed / 4];
        let mut written = 0usize;
        // SAFETY: `v` has the `needed` writable bytes passed as its size.
        let st = unsafe { (self.cap_get)(algo, attr, v.as_mut_ptr() as Ptr, needed, &mut written) };
        if st != SUCCESS || written > needed || written % 4 != 0 {
            return Vec::new();
        }
        v.truncate(written / 4);
        v
    }

    /// Sets a u32 configuration attribute of `algo`; `false` when cuBLASLt refuses.
    fn set_config(&self, algo: &mut [u64; 8], attr: u32, value: u32) -> bool {
        let v = value.to_ne_bytes();
        // SAFETY: `algo` is a whole cublasLtMatmulAlgo_t we own; the value is 4 readable
        // bytes, the size of the u32 attributes set here.
        let st = unsafe { (self.config_set)(algo, attr, v.as_ptr() as CPtr, v.len()) };
        st == SUCCESS
    }
}

/// Tile shapes of `cublasLtMatmulTile_t` by id, from 1 (`CUBLASLT_MATMUL_TILE_8x8`) on, as
/// rows × columns of cuBLASLt's D matrix (the header's order, unchanged from cuBLASLt 12.6 to
/// 13.4, which append new ids; 0 is `UNDEFINED`).
const TILE_SHAPES: &str = "\
    8x8 8x16 16x8 8x32 16x16 32x8 8x64 16x32 32x16 64x8 32x32 32x64 64x32 32x128 64x64 128x32 \
    64x128 128x64 64x256 128x128 256x64 64x512 128x256 256x128 512x64 64x96 96x64 96x128 128x160 \
    160x128 192x128 128x192 128x96 32x256 256x32 8x128 8x192 8x256 8x320 8x384 8x448 8x512 8x576 \
    8x640 8x704 8x768 16x64 16x128 16x192 16x256 16x320 16x384 16x448 16x512 16x576 16x640 16x704 \
    16x768 24x64 24x128 24x192 24x256 24x320 24x384 24x448 24x512 24x576 24x640 24x704 24x768 \
    32x192 32x320 32x384 32x448 32x512 32x576 32x640 32x704 32x768 40x64 40x128 40x192 40x256 \
    40x320 40x384 40x448 40x512 40x576 40x640 40x704 40x768 48x64 48x128 48x192 48x256 48x320 \
    48x384 48x448 48x512 48x576 48x640 48x704 48x768 56x64 56x128 56x192 56x256 56x320 56x384 \
    56x448 56x512 56x576 56x640 56x704 56x768 64x192 64x320 64x384 64x448 64x576 64x640 64x704 \
    64x768 72x64 72x128 72x192 72x256 72x320 72x384 72x448 72x512 72x576 72x640 80x64 80x128 \
    80x192 80x256 80x320 80x384 80x448 80x512 80x576 88x64 88x128 88x192 88x256 88x320 88x384 \
    88x448 88x512 96x192 96x256 96x320 96x384 96x448 96x512 104x64 104x128 104x192 104x256 \
    104x320 104x384 104x448 112x64 112x128 112x192 112x256 112x320 112x384 120x64 120x128 120x192 \
    120x256 120x320 120x384 128x320 128x384 136x64 136x128 136x192 136x256 136x320 144x64 144x128 \
    144x192 144x256 144x320 152x64 152x128 152x192 152x256 152x320 160x64 160x192 160x256 168x64 \
    168x128 168x192 168x256 176x64 176x128 176x192 176x256 184x64 184x128 184x192 184x256 192x64 \
    192x192 192x256 200x64 200x128 200x192 208x64 208x128 208x192 216x64 216x128 216x192 224x64 \
    224x128 224x192 232x64 232x128 232x192 240x64 240x128 240x192 248x64 248x128 248x192 256x192 \
    264x64 264x128 272x64 272x128 280x64 280x128 288x64 288x128 296x64 296x128 304x64 304x128 \
    312x64 312x128 320x64 320x128 328x64 328x128 336x64 336x128 344x64 344x128 352x64 352x128 \
    360x64 360x128 368x64 368x128 376x64 376x128 384x64 384x128 392x64 400x64 408x64 416x64 \
    424x64 432x64 440x64 448x64 456x64 464x64 472x64 480x64 488x64 496x64 504x64 520x64 528x64 \
    536x64 544x64 552x64 560x64 568x64 576x64 584x64 592x64 600x64 608x64 616x64 624x64 632x64 \
    640x64 648x64 656x64 664x64 672x64 680x64 688x64 696x64 704x64 712x64 720x64 728x64 736x64 \
    744x64 752x64 760x64 768x64 64x16 64x24 64x40 64x48 64x56 64x72 64x80 64x88 64x104 64x112 \
    64x120 64x136 64x144 64x152 64x160 64x168 64x176 64x184 64x200 64x208 64x216 64x224 64x232 \
    64x240 64x248 64x264 64x272 64x280 64x288 64x296 64x304 64x312 64x328 64x336 64x344 64x352 \
    64x360 64x368 64x376 64x392 64x400 64x408 64x416 64x424 64x432 64x440 64x456 64x464 64x472 \
    64x480 64x488 64x496 64x504 64x520 64x528 64x536 64x544 64x552 64x560 64x568 64x584 64x592 \
    64x600 64x608 64x616 64x624 64x632 64x648 64x656 64x664 64x672 64x680 64x688 64x696 64x712 \
    64x720 64x728 64x736 64x744 64x752 64x760 128x8 128x16 128x24 128x40 128x48 128x56 128x72 \
    128x80 128x88 128x104 128x112 128x120 128x136 128x144 128x152 128x168 128x176 128x184 128x200 \
    128x208 128x216 128x224 128x232 128x240 128x248 128x264 128x272 128x280 128x288 128x296 \
    128x304 128x312 128x328 128x336 128x344 128x352 128x360 128x368 128x376 128x392 128x400 \
    128x408 128x416 128x424 128x432 128x440 128x448 128x456 128x464 128x472 128x480 128x488 \
    128x496 128x504 128x512 192x8 192x16 192x24 192x32 192x40 192x48 192x56 192x72 192x80 192x88 \
    192x96 192x104 192x112 192x120 192x136 192x144 192x152 192x160 192x168 192x176 192x184 \
    192x200 192x208 192x216 192x224 192x232 192x240 192x248 192x264 192x272 192x280 192x288 \
    192x296 192x304 192x312 192x320 192x328 192x336 256x8 256x16 256x24 256x40 256x48 256x56 \
    256x72 256x80 256x88 256x96 256x104 256x112 256x120 256x136 256x144 256x152 256x160 256x168 \
    256x176 256x184 256x200 256x208 256x216 256x224 256x232 256x240 256x248 256x256 320x8 320x16 \
    320x24 320x32 320x40 320x48 320x56 320x72 320x80 320x88 320x96 320x104 320x112 320x120 \
    320x136 320x144 320x152 320x160 320x168 320x176 320x184 320x192 320x200 384x8 384x16 384x24 \
    384x32 384x40 384x48 384x56 384x72 384x80 384x88 384x96 384x104 384x112 384x120 384x136 \
    384x144 384x152 384x160 384x168 448x8 448x16 448x24 448x32 448x40 448x48 448x56 448x72 448x80 \
    448x88 448x96 448x104 448x112 448x120 448x128 448x136 448x144 512x8 512x16 512x24 512x32 \
    512x40 512x48 512x56 512x72 512x80 512x88 512x96 512x104 512x112 512x120 512x128 576x8 576x16 \
    576x24 576x32 576x40 576x48 576x56 576x72 576x80 576x88 576x96 576x104 576x112 640x8 640x16 \
    640x24 640x32 640x40 640x48 640x56 640x72 640x80 640x88 640x96 704x8 704x16 704x24 704x32 \
    704x40 704x48 704x56 704x72 704x80 704x88 768x8 768x16 768x24 768x32 768x40 768x48 768x56 \
    768x72 768x80 256x512 256x1024 512x512 512x1024 4x1 8x1 16x1 24x1 32x1 40x1 48x1 64x1 128x1 \
    192x1 256x1";

/// The rows × columns of D that tile `id` covers, if it is a known tile.
fn tile_shape(id: u32) -> Option<(usize, usize)> {
    let name = TILE_SHAPES
        .split_ascii_whitespace()
        .nth(usize::try_from(id).ok()?.checked_sub(1)?)?;
    let (r, c) = name.split_once('x')?;
    let (r, c) = (r.parse().ok()?, c.parse().ok()?);
    (r > 0 && c > 0).then_some((r, c))
}

/// The K splits to try for an algorithm whose grid fills `fill` of one wave of the device
/// (thread blocks / multiprocessors): none when it fills it (`fill` ≥ 1, or not a number);
/// otherwise those of [`SPLITS`] that keep at least 32 elements of K per split and make at most
/// two waves, the `most` nearest to one full wave (by ratio), in increasing order.
pub fn split_choices(fill: f64, k: usize, most: usize) -> Vec<u8> {
    if !(fill > 0.0 && fill < 1.0) {
        return Vec::new();
    }
    let mut v: Vec<u8> = SPLITS
        .into_iter()
        .filter(|&s| k / s as usize >= MIN_K_PER_SPLIT && fill * s as f64 <= 2.0)
        .collect();
    v.sort_by(|a, b| {
        let off = |s: u8| (fill * s as f64).ln().abs();
        off(*a).total_cmp(&off(*b))
    });
    v.truncate(most);
    v.sort_unstable();
    v
}

fn api() -> std::result::Result<&'static Api, &'static str> {
    static API: Loaded<Api> = Loaded::new(load);
    API.get()
}

// SAFETY: `status_string` is `cublasLtGetStatusString`, which returns a static NUL-terminated
// string (or null) for any status.
unsafe impl StatusText for Api {
    const LIBRARY: &'static str = "cuBLASLt";
    fn status_string(&self) -> unsafe extern "C" fn(Status) -> *const c_char {
        self.status_string
    }
}

/// The loaded cuBLASLt's version (e.g. 130000), or why it is unavailable.
pub fn version() -> std::result::Result<usize, String> {
    let api = api().map_err(str::to_string)?;
    // SAFETY: no arguments; returns a number.
    Ok(unsafe { (api.get_version)() })
}

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
    plans: HashMap<LtShape, Plan>,
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
        split_k: None,
        search: None,
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

    /// The split-K variants of the plan's first [`SPLIT_K_RANKS`] algorithms (its descriptor
    /// holds the epilogue its algorithms were asked for). An algorithm gets variants only if it
    /// is not split already, supports split-K, and its grid leaves multiprocessors idle: with
    /// a known tile, ⌈n/rows⌉·⌈m/cols⌉ thread blocks (cuBLASLt's D is n × m) fewer than the
    /// device's multiprocessors; with an undefined or unknown tile, cuBLASLt's `wavesCount`
    /// below 1. The splits are [`split_choices`]'s. Anything cuBLASLt refuses drops the
    /// variant; a library without the functions gives none.
    fn split_variants(&self, handle: Ptr, p: &Plan, s: &LtShape) -> Vec<SplitVariant> {
        let Some(api) = self.api.split_k.as_ref() else {
            return Vec::new();
        };
        let sms = self.ctx.info().multiprocessors.max(1) as f64;
        let u32_of = |v: Option<[u8; 4]>| v.map(u32::from_ne_bytes);
        let mut out: Vec<SplitVariant> = Vec::new();
        for (rank, base) in p.algos.iter().enumerate().take(SPLIT_K_RANKS) {
            if !matches!(
                u32_of(api.config(&base.algo, CONFIG_SPLITK_NUM)),
                Some(0 | 1)
            ) {
                continue; // already split (or unreadable)
            }
            let supported = api
                .cap(&base.algo, CAP_SPLITK_SUPPORT)
                .is_some_and(|v| i32::from_ne_bytes(v) != 0);
            let mask = u32_of(api.cap(&base.algo, CAP_REDUCTION_SCHEME_MASK)).unwrap_or(0);
            if !supported || mask & (REDUCE_INPLACE | REDUCE_COMPUTE_TYPE | REDUCE_OUTPUT_TYPE) == 0
            {
                continue;
            }
            let tile = u32_of(api.config(&base.algo, CONFIG_TILE_ID)).and_then(tile_shape);
            let fill = match tile {
                Some((rows, cols)) => {
                    (s.n.div_ceil(rows) as f64) * (s.m.div_ceil(cols) as f64) / sms
                }
                None => base.waves_count as f64,
            };
            for split in split_choices(fill, s.k, SPLITS_PER_RANK[rank]) {
                let accepted = REDUCTION_ORDER
                    .into_iter()
                    .filter(|&scheme| mask & scheme != 0)
                    .find_map(|scheme| self.check_variant(api, handle, p, s, base, split, scheme));
                let Some(result) = accepted else { continue };
                let duplicate = p.algos.iter().any(|a| a.algo == result.algo)
                    || out.iter().any(|v| v.result.algo == result.algo);
                if !duplicate {
                    out.push(SplitVariant {
                        rank: rank as u8,
                        split,
                        result,
                    });
                }
            }
        }
        out
    }

    /// `base` with `split` K splits reduced by `scheme`, if cuBLASLt takes the configuration,
    /// its alignment needs are within the plan's and `cublasLtMatmulAlgoCheck` accepts it for
    /// the plan's descriptors with a workspace within ours.
    #[allow(clippy::too_many_arguments)]
    fn check_variant(
        &self,
        api: &SplitKApi,
        handle: Ptr,
        p: &Plan,
        s: &LtShape,
        base: &HeuristicResult,
        split: u8,
        scheme: u32,
    ) -> Option<HeuristicResult> {
        let mut algo = base.algo;
        if !api.set_config(&mut algo, CONFIG_SPLITK_NUM, split as u32)
            || !api.set_config(&mut algo, CONFIG_REDUCTION_SCHEME, scheme)
        {
            return None;
        }
        self.validate(api, handle, p, s, algo)
    }

    /// `algo` as `cublasLtMatmulAlgoCheck` reports on it, if its alignment needs are within the
    /// plan's and the check accepts it for the plan's descriptors with a workspace within ours.
    fn validate(
        &self,
        api: &SplitKApi,
        handle: Ptr,
        p: &Plan,
        s: &LtShape,
        algo: [u64; 8],
    ) -> Option<HeuristicResult> {
        // A, B, C and D: the pointers are aligned to `s.align` bytes (checked at each call).
        for i in 0..4 {
            let need = u32::from_ne_bytes(api.cap(&algo, CAP_MIN_ALIGNMENT_A + i)?);
            if need > s.align {
                return None;
            }
        }
        let mut result = HeuristicResult::default();
        // SAFETY: the handle, descriptor and layouts are live (the caller holds the state
        // lock); `algo` is a whole algorithm struct read by the call; `result` is a writable
        // cublasLtMatmulHeuristicResult_t (layout checked by a test).
        let st = unsafe { (api.check)(handle, p.desc, p.a, p.b, p.c, p.c, &algo, &mut result) };
        if st != SUCCESS || result.state != SUCCESS || result.workspace_size > self.ws_bytes {
            return None;
        }
        result.algo = algo; // the check reports on `algo` but never writes it back
        Some(result)
    }

    /// The searched configurations of the plan (see the module docs): its descriptor holds
    /// the epilogue its algorithms run with, so each check is for exactly what will run.
    fn search(&self, handle: Ptr, p: &Plan, s: &LtShape) -> Vec<SearchConfig> {
        let (Some(api), Some(search)) = (self.api.split_k.as_ref(), self.api.search.as_ref())
        else {
            return Vec::new();
        };
        let sms = self.ctx.info().multiprocessors.max(1) as usize;
        let mut ids = [0 as c_int; SEARCH_IDS];
        let mut got: c_int = 0;
        // SAFETY: the handle is live (the caller holds the state lock); cuBLASLt writes at most
        // SEARCH_IDS ids into `ids` and their count into `got`; the types are plain enums.
        let st = unsafe {
            (search.get_ids)(
                handle,
                COMPUTE_32F,
                R_32F,
                R_32F,
                R_32F,
                R_32F,
                R_32F,
                SEARCH_IDS as c_int,
                ids.as_mut_ptr(),
                &mut got,
            )
        };
        if st != SUCCESS {
            return Vec::new();
        }
        let ids = &ids[..(got.max(0) as usize).min(SEARCH_IDS)];
        // What the heuristic already offers: (id, tile, stages, splits), splits 0 read as 1.
        let u32_at = |algo: &[u64; 8], attr| api.config(algo, attr).map(u32::from_ne_bytes);
        let signature = |algo: &[u64; 8]| {
            Some((
                i32::from_ne_bytes(api.config(algo, CONFIG_ID)?),
                u32_at(algo, CONFIG_TILE_ID)?,
                u32_at(algo, CONFIG_STAGES_ID)?,
                u32_at(algo, CONFIG_SPLITK_NUM)?.max(1),
            ))
        };
        let offered: Vec<_> = p.algos.iter().filter_map(|r| signature(&r.algo)).collect();
        // Every (id, tile, stages) not offered, with its rank ([`search_rank`]).
        let mut bases: Vec<([u64; 8], bool)> = Vec::new();
        let mut tried = Vec::new();
        for &id in ids {
            let mut algo = [0u64; 8];
            // SAFETY: as above; `algo` is a whole writable cublasLtMatmulAlgo_t.
            let st = unsafe {
                (search.init)(
                    handle,
                    COMPUTE_32F,
                    R_32F,
                    R_32F,
                    R_32F,
                    R_32F,
                    R_32F,
                    id,
                    &mut algo,
                )
            };
            if st != SUCCESS {
                continue;
            }
            let swizzle = api
                .cap(&algo, CAP_CTA_SWIZZLING_SUPPORT)
                .is_some_and(|v| u32::from_ne_bytes(v) != 0);
            let mut tiles = api.cap_list(&algo, CAP_TILE_IDS);
            if tiles.is_empty() {
                tiles.push(0);
            }
            let mut stages = api.cap_list(&algo, CAP_STAGES_IDS);
            if stages.is_empty() {
                stages.push(0);
            }
            let base = bases.len();
            bases.push((algo, swizzle));
            for &tile in &tiles {
                let shape = tile_shape(tile);
                let rank = search_rank(shape, s.n, s.m, sms);
                for &stage in &stages {
                    if !offered.contains(&(id, tile, stage, 1)) {
                        tried.push((rank, id, tile, stage, shape, base));
                    }
                }
            }
        }
        tried.sort_by_key(|&(rank, id, tile, stage, _, _)| (rank, id, tile, stage));
        let mut kept: Vec<SearchConfig> = Vec::new();
        let mut checks = 0;
        for (_, id, tile, stage, shape, base) in tried {
            if kept.len() >= SEARCH_KEPT || checks >= SEARCH_CHECKS {
                break;
            }
            if kept.iter().filter(|c| c.info.tile == tile).count() >= SEARCH_PER_TILE {
                continue;
            }
            let (mut algo, swizzle) = bases[base];
            if !(api.set_config(&mut algo, CONFIG_TILE_ID, tile)
                && api.set_config(&mut algo, CONFIG_STAGES_ID, stage)
                && api.set_config(&mut algo, CONFIG_SPLITK_NUM, 1)
                && api.set_config(&mut algo, CONFIG_CTA_SWIZZLING, 0))
            {
                continue;
            }
            checks += 1;
            let Some(result) = self.validate(api, handle, p, s, algo) else {
                continue;
            };
            let duplicate = p.algos.iter().any(|a| a.algo == result.algo)
                || kept.iter().any(|c| c.result.algo == result.algo);
            if !duplicate {
                kept.push(SearchConfig {
                    info: LtConfig {
                        algo_id: id,
                        tile,
                        tile_shape: shape,
                        stages: stage,
                        swizzle_supported: swizzle,
                        workspace: result.workspace_size,
                        waves: result.waves_count,
                    },
                    result,
                });
            }
        }
        kept
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

    /// Runs `f` on the handle and the plan of `s` (made on first use, with what `which`
    /// picks from: [`Self::prepare`]), under the state lock.
    fn with_plan<R>(
        &self,
        s: &LtShape,
        which: LtAlgo,
        f: impl FnOnce(Ptr, &Plan) -> Result<R>,
    ) -> Result<R> {
        self.ctx.bind()?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let handle = st.handle;
        let plan = match st.plans.entry(*s) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(self.new_plan(handle, s)?),
        };
        self.prepare(handle, plan, s, which);
        f(handle, plan)
    }

    /// How many heuristic algorithms cuBLASLt offers for `s` (0: none; use another engine),
    /// and whether the bias gradient is fused.
    pub fn algo_count(&self, s: &LtShape) -> Result<(usize, bool)> {
        self.with_plan(s, LtAlgo::Rank(0), |_, p| {
            Ok((p.algos.len(), p.fused_bgrad))
        })
    }

    /// The split-K variants kept for `s`, as (rank, splits) pairs for [`BlasLt::matmul`],
    /// made on the first call for the shape (empty when no algorithm is under-occupied or the
    /// library cannot make them).
    pub fn split_k_variants(&self, s: &LtShape) -> Result<Vec<(u8, u8)>> {
        let which = LtAlgo::SplitK { rank: 0, split: 0 };
        self.with_plan(s, which, |_, p| {
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
        self.with_plan(s, LtAlgo::Config(0), |_, p| {
            Ok(p.search.iter().flatten().map(|c| c.info).collect())
        })
    }

    /// Row-major `C = epilogue(alpha·op(A)·op(B) + beta·C)` with cuBLASLt's algorithm `which`
    /// for the shape: a heuristic rank, a split-K variant (one of
    /// [`BlasLt::split_k_variants`]) or a searched configuration (one of
    /// [`BlasLt::search_configs`]); any other is an error and nothing runs. `bias` is the bias of
    /// `Bias`/`BiasRelu` (length n) or the output of `BiasGrad` (length m, the rows of op(A)).
    /// Returns whether the bias gradient was computed (with `BiasGrad`, `false` means the
    /// caller must reduce it).
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
        self.with_plan(s, which, |handle, p| {
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
            if let Some(w) = &ws {
                on_device(q, [("cuBLASLt workspace", w.block())])?;
            }
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
            // describe m×k, k×n and m×n elements in the checked buffers (and a bias of the
            // checked length, used only with a fused epilogue), all of them and the workspace
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
