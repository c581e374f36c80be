//! cuBLASLt's C API as this crate calls it: the attribute and enum values used, the function
//! table with each function's C signature (the split-K and search functions optional: a
//! library without them gives no variants or searched configurations), loaded once.

use std::ffi::{c_char, c_int};

use cudarc::cublaslt::sys as ls;

use super::super::loader::{lib_fn, CPtr, Loaded, Ptr, Status, StatusText, SUCCESS};
use crate::dtype::Dtype;

pub(super) const R_32F: u32 = ls::cudaDataType_t::CUDA_R_32F as u32;
pub(super) const R_16F: u32 = ls::cudaDataType_t::CUDA_R_16F as u32;
pub(super) const R_16BF: u32 = ls::cudaDataType_t::CUDA_R_16BF as u32;
pub(super) const COMPUTE_32F: u32 = ls::cublasComputeType_t::CUBLAS_COMPUTE_32F as u32;
pub(super) const COMPUTE_32F_FAST_TF32: u32 =
    ls::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32 as u32;
pub(super) const DESC_TRANSA: u32 =
    ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA as u32;
pub(super) const DESC_TRANSB: u32 =
    ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB as u32;
pub(super) const DESC_EPILOGUE: u32 =
    ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE as u32;
pub(super) const DESC_BIAS_POINTER: u32 =
    ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER as u32;
pub(super) const DESC_BIAS_DATA_TYPE: u32 =
    ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE as u32;
pub(super) const PREF_REDUCTION_SCHEME_MASK: u32 =
    ls::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK as u32;
pub(super) const PREF_MAX_WORKSPACE: u32 =
    ls::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES as u32;
pub(super) const PREF_ALIGN_A: u32 =
    ls::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES as u32;
pub(super) const EPI_DEFAULT: u32 = ls::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT as u32;
pub(super) const EPI_BIAS: u32 = ls::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS as u32;
pub(super) const EPI_RELU_BIAS: u32 = ls::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU_BIAS as u32;
pub(super) const EPI_GELU_BIAS: u32 = ls::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS as u32;
pub(super) const EPI_BGRADB: u32 = ls::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADB as u32;
pub(super) const OP_N: i32 = 0;
pub(super) const OP_T: i32 = 1;
pub(super) const CONFIG_ID: u32 =
    ls::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_ID as u32;
pub(super) const CONFIG_CTA_SWIZZLING: u32 =
    ls::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING as u32;
pub(super) const CONFIG_STAGES_ID: u32 =
    ls::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_STAGES_ID as u32;
pub(super) const CAP_CTA_SWIZZLING_SUPPORT: u32 =
    ls::cublasLtMatmulAlgoCapAttributes_t::CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT as u32;
pub(super) const CAP_TILE_IDS: u32 =
    ls::cublasLtMatmulAlgoCapAttributes_t::CUBLASLT_ALGO_CAP_TILE_IDS as u32;
pub(super) const CAP_STAGES_IDS: u32 =
    ls::cublasLtMatmulAlgoCapAttributes_t::CUBLASLT_ALGO_CAP_STAGES_IDS as u32;
pub(super) const CONFIG_TILE_ID: u32 =
    ls::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_TILE_ID as u32;
pub(super) const CONFIG_SPLITK_NUM: u32 =
    ls::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM as u32;
pub(super) const CONFIG_REDUCTION_SCHEME: u32 =
    ls::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME as u32;
pub(super) const CAP_SPLITK_SUPPORT: u32 =
    ls::cublasLtMatmulAlgoCapAttributes_t::CUBLASLT_ALGO_CAP_SPLITK_SUPPORT as u32;
pub(super) const CAP_REDUCTION_SCHEME_MASK: u32 =
    ls::cublasLtMatmulAlgoCapAttributes_t::CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK as u32;
pub(super) const CAP_MIN_ALIGNMENT_A: u32 =
    ls::cublasLtMatmulAlgoCapAttributes_t::CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES as u32;
pub(super) const REDUCE_INPLACE: u32 =
    ls::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_INPLACE as u32;
pub(super) const REDUCE_COMPUTE_TYPE: u32 =
    ls::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
pub(super) const REDUCE_OUTPUT_TYPE: u32 =
    ls::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE as u32;

/// cuBLASLt's name (`cudaDataType_t`) of an element type.
pub(super) fn cuda_type(d: Dtype) -> u32 {
    match d {
        Dtype::F32 => R_32F,
        Dtype::Bf16 => R_16BF,
        Dtype::F16 => R_16F,
    }
}

/// `cublasLtMatmulHeuristicResult_t` with the status as a raw integer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct HeuristicResult {
    pub(super) algo: [u64; 8],
    pub(super) workspace_size: usize,
    pub(super) state: Status,
    pub(super) waves_count: f32,
    pub(super) reserved: [c_int; 4],
}

/// The cuBLASLt functions this module calls, with the signatures of cuBLASLt 12/13's header.
pub(super) struct Api {
    pub(super) get_version: unsafe extern "C" fn() -> usize,
    pub(super) status_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub(super) create: unsafe extern "C" fn(*mut Ptr) -> Status,
    pub(super) destroy: unsafe extern "C" fn(Ptr) -> Status,
    pub(super) desc_create: unsafe extern "C" fn(*mut Ptr, u32, u32) -> Status,
    pub(super) desc_destroy: unsafe extern "C" fn(Ptr) -> Status,
    pub(super) desc_set: unsafe extern "C" fn(Ptr, u32, CPtr, usize) -> Status,
    pub(super) layout_create: unsafe extern "C" fn(*mut Ptr, u32, u64, u64, i64) -> Status,
    pub(super) layout_destroy: unsafe extern "C" fn(Ptr) -> Status,
    pub(super) pref_create: unsafe extern "C" fn(*mut Ptr) -> Status,
    pub(super) pref_destroy: unsafe extern "C" fn(Ptr) -> Status,
    pub(super) pref_set: unsafe extern "C" fn(Ptr, u32, CPtr, usize) -> Status,
    #[allow(clippy::type_complexity)]
    pub(super) heuristic: unsafe extern "C" fn(
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
    pub(super) matmul: unsafe extern "C" fn(
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
    pub(super) split_k: Option<SplitKApi>,
    /// What the search needs besides `split_k` (`None` where a symbol is missing: no
    /// searched configurations).
    pub(super) search: Option<SearchApi>,
}

/// The functions that list a type combination's algorithm ids and make an algorithm of one.
pub(super) struct SearchApi {
    /// `cublasLtMatmulAlgoGetIds(handle, compute, scale, A, B, C, D, requested, ids, count)`.
    #[allow(clippy::type_complexity)]
    pub(super) get_ids: unsafe extern "C" fn(
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
    pub(super) init:
        unsafe extern "C" fn(Ptr, u32, u32, u32, u32, u32, u32, c_int, *mut [u64; 8]) -> Status,
}

/// The functions that read and change an algorithm's configuration and validate the result.
pub(super) struct SplitKApi {
    /// `cublasLtMatmulAlgoCheck(handle, desc, A, B, C, D, algo, result)`.
    #[allow(clippy::type_complexity)]
    pub(super) check: unsafe extern "C" fn(
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
    pub(super) config_get:
        unsafe extern "C" fn(*const [u64; 8], u32, Ptr, usize, *mut usize) -> Status,
    /// `cublasLtMatmulAlgoConfigSetAttribute(algo, attr, buf, size)`.
    pub(super) config_set: unsafe extern "C" fn(*mut [u64; 8], u32, CPtr, usize) -> Status,
    /// `cublasLtMatmulAlgoCapGetAttribute(algo, attr, buf, size, written)`.
    pub(super) cap_get:
        unsafe extern "C" fn(*const [u64; 8], u32, Ptr, usize, *mut usize) -> Status,
}

pub(super) fn load() -> std::result::Result<Api, String> {
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

pub(super) fn load_search(lib: &libloading::Library) -> std::result::Result<SearchApi, String> {
    Ok(SearchApi {
        get_ids: lib_fn!(lib, "cublasLtMatmulAlgoGetIds"),
        init: lib_fn!(lib, "cublasLtMatmulAlgoInit"),
    })
}

pub(super) fn load_split_k(lib: &libloading::Library) -> std::result::Result<SplitKApi, String> {
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
    pub(super) fn config(&self, algo: &[u64; 8], attr: u32) -> Option<[u8; 4]> {
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
    pub(super) fn cap(&self, algo: &[u64; 8], attr: u32) -> Option<[u8; 4]> {
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
    pub(super) fn cap_list(&self, algo: &[u64; 8], attr: u32) -> Vec<u32> {
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
    pub(super) fn set_config(&self, algo: &mut [u64; 8], attr: u32, value: u32) -> bool {
        let v = value.to_ne_bytes();
        // SAFETY: `algo` is a whole cublasLtMatmulAlgo_t we own; the value is 4 readable
        // bytes, the size of the u32 attributes set here.
        let st = unsafe { (self.config_set)(algo, attr, v.as_ptr() as CPtr, v.len()) };
        st == SUCCESS
    }
}

pub(super) fn api() -> std::result::Result<&'static Api, &'static str> {
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

/// The longest capability list (tile or stage ids) read.
pub(super) const MAX_CAP_LIST: usize = 4096;
