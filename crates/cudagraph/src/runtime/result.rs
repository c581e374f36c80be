//! Driver status codes to [`Error`]s, and the few process-wide driver facts (is `libcuda`
//! there, initialisation, relaxed capture mode). Every other runtime module turns a `CUresult`
//! into a `Result` through [`check`], so each error names the driver call and the caller's
//! source location, and device faults become [`Error::ContextLost`].

use std::ffi::CStr;
use std::panic::Location;
use std::ptr;

use cudarc::driver::sys;

use crate::error::{Error, Result};

/// Turns a driver status into a `Result`, naming the call and the caller.
#[track_caller]
pub(crate) fn check(status: sys::CUresult, call: &'static str) -> Result<()> {
    if status == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(status, call, Location::caller()))
    }
}

/// The error for a failed driver call.
pub(crate) fn driver_error(
    status: sys::CUresult,
    call: &'static str,
    at: &'static Location<'static>,
) -> Error {
    let (name, description) = describe(status);
    if is_sticky(status) {
        return Error::ContextLost { call, name, at };
    }
    Error::Driver {
        call,
        code: status as u32,
        name,
        description,
        at,
    }
}

/// The driver's name and description of a status code.
fn describe(status: sys::CUresult) -> (String, String) {
    let mut name_ptr: *const std::ffi::c_char = ptr::null();
    let mut desc_ptr: *const std::ffi::c_char = ptr::null();
    // SAFETY: cuGetErrorName/String only write a pointer to a static string (or leave it null
    // for an unknown code); we read it only when it is non-null.
    unsafe {
        sys::cuGetErrorName(status, &mut name_ptr);
        sys::cuGetErrorString(status, &mut desc_ptr);
        let read = |p: *const std::ffi::c_char| {
            if p.is_null() {
                "unknown".to_string()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        (read(name_ptr), read(desc_ptr))
    }
}

/// Device faults that leave the context unusable (CUDA's "sticky" errors).
fn is_sticky(status: sys::CUresult) -> bool {
    use sys::CUresult as R;
    matches!(
        status,
        R::CUDA_ERROR_ILLEGAL_ADDRESS
            | R::CUDA_ERROR_ASSERT
            | R::CUDA_ERROR_HARDWARE_STACK_ERROR
            | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | R::CUDA_ERROR_MISALIGNED_ADDRESS
            | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | R::CUDA_ERROR_INVALID_PC
            | R::CUDA_ERROR_LAUNCH_FAILED
            | R::CUDA_ERROR_ECC_UNCORRECTABLE
            | R::CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

/// Whether `libcuda` can be loaded at all. Cheap after the first call.
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names; no CUDA call is made.
    unsafe { sys::is_culib_present() }
}

#[track_caller]
pub(crate) fn init() -> Result<()> {
    // SAFETY: cuInit has no preconditions; calling it more than once is allowed.
    check(unsafe { sys::cuInit(0) }, "cuInit")
}

#[track_caller]
pub(crate) fn driver_version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: writes one int.
    check(
        unsafe { sys::cuDriverGetVersion(&mut v) },
        "cuDriverGetVersion",
    )?;
    Ok(v)
}

/// Whether the loaded driver exports `symbol` (looked up without calling it; cudarc's bindings
/// would abort the process on a missing symbol).
pub(crate) fn driver_has(symbol: &str) -> bool {
    if !driver_present() {
        return false;
    }
    // SAFETY: only looks a symbol up in the already loaded library; nothing is called.
    unsafe { sys::culib().get::<*const ()>(symbol.as_bytes()).is_ok() }
}

/// A driver entry point looked up by name, for those cudarc's bindings lack (or would abort
/// the process on, where the driver is older): `None` when the driver does not export it.
///
/// # Safety
/// `F` is the C signature the driver's header gives `symbol`.
pub(crate) unsafe fn driver_symbol<F: Copy>(symbol: &str) -> Option<F> {
    if !driver_present() {
        return None;
    }
    // SAFETY: the caller's promise on `F`; the library stays loaded for the life of the process,
    // so the copied function pointer stays valid.
    unsafe { sys::culib().get::<F>(symbol.as_bytes()).ok().map(|f| *f) }
}

/// Runs `f` with this thread's stream-capture mode set to relaxed, then restores it. For
/// calls that allocate or free (our allocator, cuBLAS handle creation) and must work while a
/// capture is open on this thread.
pub fn with_relaxed_capture<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(sys::CUstreamCaptureMode);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: restores the mode saved by the exchange below (also when `f` panics).
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut self.0) };
        }
    }
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: writes the previous mode into `mode`; `Restore` puts it back.
    unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    let _restore = Restore(mode);
    f()
}
