//! The backend layer of cuDNN's graph API as this crate uses it: descriptor types, attribute
//! names and values as raw integers, the function table (cuDNN 9's signatures), and [`Desc`],
//! a backend descriptor destroyed on drop with typed setters and getters.

use std::ffi::c_char;

use cudarc::cudnn::sys as cs;

use super::super::loader::{error, lib_fn, CPtr, Loaded, Ptr, Status, StatusText, SUCCESS};
use super::LIBRARY;
use crate::error::NnError;

pub(super) const NOT_SUPPORTED: std::ops::RangeInclusive<Status> = 3000..=3999;

// cudnnBackendDescriptorType_t
pub(super) const D_POINTWISE: u32 = 0;
pub(super) const D_CONVOLUTION: u32 = 1;
pub(super) const D_ENGINE: u32 = 2;
pub(super) const D_ENGINECFG: u32 = 3;
pub(super) const D_ENGINEHEUR: u32 = 4;
pub(super) const D_EXECUTION_PLAN: u32 = 5;
pub(super) const D_KNOB_CHOICE: u32 = 7;
pub(super) const D_OP_CONV_FORWARD: u32 = 10;
pub(super) const D_OP_CONV_BACKWARD_FILTER: u32 = 11;
pub(super) const D_OP_CONV_BACKWARD_DATA: u32 = 12;
pub(super) const D_OP_POINTWISE: u32 = 13;
pub(super) const D_OPERATION_GRAPH: u32 = 15;
pub(super) const D_VARIANT_PACK: u32 = 16;
pub(super) const D_TENSOR: u32 = 17;

// cudnnBackendAttributeType_t
pub(super) const T_HANDLE: u32 = 0;
pub(super) const T_DATA_TYPE: u32 = 1;
pub(super) const T_BOOLEAN: u32 = 2;
pub(super) const T_INT64: u32 = 3;
pub(super) const T_FLOAT: u32 = 4;
pub(super) const T_VOID_PTR: u32 = 6;
pub(super) const T_CONVOLUTION_MODE: u32 = 7;
pub(super) const T_HEUR_MODE: u32 = 8;
pub(super) const T_KNOB_TYPE: u32 = 9;
pub(super) const T_NUMERICAL_NOTE: u32 = 11;
pub(super) const T_POINTWISE_MODE: u32 = 14;
pub(super) const T_BACKEND_DESCRIPTOR: u32 = 15;
pub(super) const T_BEHAVIOR_NOTE: u32 = 19;

// cudnnBackendAttributeName_t
pub(super) const A_POINTWISE_MODE: u32 = 0;
pub(super) const A_POINTWISE_MATH_PREC: u32 = 1;
pub(super) const A_CONV_COMP_TYPE: u32 = 100;
pub(super) const A_CONV_MODE: u32 = 101;
pub(super) const A_CONV_DILATIONS: u32 = 102;
pub(super) const A_CONV_FILTER_STRIDES: u32 = 103;
pub(super) const A_CONV_POST_PADDINGS: u32 = 104;
pub(super) const A_CONV_PRE_PADDINGS: u32 = 105;
pub(super) const A_CONV_SPATIAL_DIMS: u32 = 106;
pub(super) const A_HEUR_MODE: u32 = 200;
pub(super) const A_HEUR_OPERATION_GRAPH: u32 = 201;
pub(super) const A_HEUR_RESULTS: u32 = 202;
pub(super) const A_CFG_ENGINE: u32 = 300;
pub(super) const A_CFG_KNOB_CHOICES: u32 = 302;
pub(super) const A_PLAN_HANDLE: u32 = 400;
pub(super) const A_PLAN_ENGINE_CONFIG: u32 = 401;
pub(super) const A_PLAN_WORKSPACE_SIZE: u32 = 402;
pub(super) const A_KNOB_TYPE: u32 = 600;
pub(super) const A_KNOB_VALUE: u32 = 601;
pub(super) const A_OP_POINTWISE_PW_DESCRIPTOR: u32 = 750;
pub(super) const A_OP_POINTWISE_XDESC: u32 = 751;
pub(super) const A_OP_POINTWISE_BDESC: u32 = 752;
pub(super) const A_OP_POINTWISE_YDESC: u32 = 753;
pub(super) const A_GRAPH_HANDLE: u32 = 800;
pub(super) const A_GRAPH_OPS: u32 = 801;
pub(super) const A_TENSOR_BYTE_ALIGNMENT: u32 = 900;
pub(super) const A_TENSOR_DATA_TYPE: u32 = 901;
pub(super) const A_TENSOR_DIMENSIONS: u32 = 902;
pub(super) const A_TENSOR_STRIDES: u32 = 903;
pub(super) const A_TENSOR_UNIQUE_ID: u32 = 906;
pub(super) const A_TENSOR_IS_VIRTUAL: u32 = 907;
pub(super) const A_VP_UNIQUE_IDS: u32 = 1000;
pub(super) const A_VP_DATA_POINTERS: u32 = 1001;
pub(super) const A_VP_WORKSPACE: u32 = 1003;
pub(super) const A_ENGINE_GLOBAL_INDEX: u32 = 1301;
pub(super) const A_ENGINE_NUMERICAL_NOTE: u32 = 1303;
pub(super) const A_ENGINE_BEHAVIOR_NOTE: u32 = 1305;

// Values.
pub(super) const DATA_FLOAT: i32 = 0;
pub(super) const DATA_HALF: i32 = 2;
pub(super) const DATA_BFLOAT16: i32 = 9;
pub(super) const CROSS_CORRELATION: i32 = 1;
pub(super) const POINTWISE_ADD: i32 = 0;
pub(super) const POINTWISE_RELU_FWD: i32 = 100;
pub(super) const HEUR_INSTANT: i32 = 0;
pub(super) const HEUR_FALLBACK: i32 = 2;
pub(super) const NOTE_TENSOR_CORE: i32 = 0;
pub(super) const NOTE_DOWN_CONVERT_INPUTS: i32 = 1;
pub(super) const NOTE_REDUCED_PRECISION_REDUCTION: i32 = 2;
pub(super) const NOTE_NONDETERMINISTIC: i32 = 4;

/// Unique ids of the three tensors in every direction: `x`/`dx`, `w`/`dw`, `y`/`dy`.
pub(super) const UID_X: i64 = 1;
pub(super) const UID_W: i64 = 2;
pub(super) const UID_Y: i64 = 3;
/// The bias of the fused forward (`[1, K, 1, 1]`).
pub(super) const UID_BIAS: i64 = 4;
/// The fused forward's convolution output: virtual (never in memory, never in a variant pack).
pub(super) const UID_CONV_OUT: i64 = 5;
/// The fused forward's biased output before its ReLU (virtual).
pub(super) const UID_EPILOGUE: i64 = 6;

/// Knob choices read per configuration (cuDNN 9 has 44 knob types).
pub(super) const MAX_KNOBS: usize = 64;
/// Notes read per engine (cuDNN 9 has 10 numerical and 5 behaviour notes).
pub(super) const MAX_NOTES: i64 = 16;

/// The cuDNN functions this module calls, with the signatures of cuDNN 9's headers.
pub(super) struct Api {
    pub(super) get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub(super) create: unsafe extern "C" fn(*mut Ptr) -> Status,
    pub(super) destroy: unsafe extern "C" fn(Ptr) -> Status,
    pub(super) set_stream: unsafe extern "C" fn(Ptr, Ptr) -> Status,
    /// (type, &descriptor)
    pub(super) backend_create: unsafe extern "C" fn(u32, *mut Ptr) -> Status,
    pub(super) backend_destroy: unsafe extern "C" fn(Ptr) -> Status,
    /// (descriptor, name, type, count, values)
    pub(super) backend_set: unsafe extern "C" fn(Ptr, u32, u32, i64, CPtr) -> Status,
    /// (descriptor, name, type, requested, &count, values)
    pub(super) backend_get: unsafe extern "C" fn(Ptr, u32, u32, i64, *mut i64, Ptr) -> Status,
    pub(super) backend_finalize: unsafe extern "C" fn(Ptr) -> Status,
    /// (handle, plan, variant pack)
    pub(super) backend_execute: unsafe extern "C" fn(Ptr, Ptr, Ptr) -> Status,
}

pub(super) fn load() -> std::result::Result<Api, String> {
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
pub(super) fn api() -> std::result::Result<&'static Api, &'static str> {
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

/// The error of `call` for a `map_err`.
pub(super) fn err_of(api: &'static Api, call: &'static str) -> impl Fn(Status) -> NnError {
    move |st| error(api, st, call)
}

/// One backend descriptor, destroyed on drop.
pub(super) struct Desc {
    pub(super) api: &'static Api,
    pub(super) raw: Ptr,
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

pub(super) type St<T> = std::result::Result<T, Status>;

pub(super) fn status(st: Status) -> St<()> {
    if st == SUCCESS {
        Ok(())
    } else {
        Err(st)
    }
}

impl Desc {
    pub(super) fn new(api: &'static Api, ty: u32) -> St<Desc> {
        let mut raw: Ptr = std::ptr::null_mut();
        // SAFETY: writes one descriptor handle into `raw`.
        status(unsafe { (api.backend_create)(ty, &mut raw) })?;
        if raw.is_null() {
            return Err(2002); // BAD_PARAM_NULL_POINTER
        }
        Ok(Desc { api, raw })
    }

    pub(super) fn many(api: &'static Api, ty: u32, n: usize) -> St<Vec<Desc>> {
        (0..n).map(|_| Desc::new(api, ty)).collect()
    }

    pub(super) fn set_i64(&self, name: u32, vals: &[i64]) -> St<()> {
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
    pub(super) fn set_enum(&self, name: u32, ty: u32, v: i32) -> St<()> {
        // SAFETY: live descriptor; one 4-byte integer, the C size of cuDNN's enums; copied
        // before returning.
        status(unsafe { (self.api.backend_set)(self.raw, name, ty, 1, (&v as *const i32).cast()) })
    }

    pub(super) fn set_bool(&self, name: u32, v: bool) -> St<()> {
        // SAFETY: live descriptor; one C `bool` (one byte, the type of BOOLEAN attributes);
        // copied before returning.
        status(unsafe {
            (self.api.backend_set)(self.raw, name, T_BOOLEAN, 1, (&v as *const bool).cast())
        })
    }

    pub(super) fn set_f32(&self, name: u32, v: f32) -> St<()> {
        // SAFETY: live descriptor; one C float; copied before returning.
        status(unsafe {
            (self.api.backend_set)(self.raw, name, T_FLOAT, 1, (&v as *const f32).cast())
        })
    }

    pub(super) fn set_descs(&self, name: u32, ds: &[&Desc]) -> St<()> {
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

    pub(super) fn set_handle(&self, name: u32, h: Ptr) -> St<()> {
        // SAFETY: live descriptor; one cudnnHandle_t (live for as long as the descriptor:
        // the handle is destroyed after every descriptor).
        status(unsafe {
            (self.api.backend_set)(self.raw, name, T_HANDLE, 1, (&h as *const Ptr).cast())
        })
    }

    pub(super) fn set_ptrs(&self, name: u32, ps: &[Ptr]) -> St<()> {
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

    pub(super) fn finalize(&self) -> St<()> {
        // SAFETY: live descriptor whose attributes were set above.
        status(unsafe { (self.api.backend_finalize)(self.raw) })
    }

    pub(super) fn get_i64(&self, name: u32) -> St<i64> {
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
    pub(super) fn get_enums(&self, name: u32, ty: u32, max: i64) -> St<Vec<i32>> {
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
    pub(super) fn count(&self, name: u32) -> St<usize> {
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
    pub(super) fn get_descs(&self, name: u32, into: &[Desc]) -> St<usize> {
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
