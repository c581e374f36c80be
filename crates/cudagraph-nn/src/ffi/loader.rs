//! What every library loaded at run time shares: the raw pointer and status types of their C
//! APIs, the symbol lookup that fills a function table ([`lib_fn!`]), the table loaded once
//! per process ([`Loaded`]), and the status text and error of a failed call ([`StatusText`],
//! [`check`]). cuBLASLt, cuDNN (legacy and graph API) and NCCL load through it; cuBLAS comes
//! with cudarc's typed bindings and only takes [`FIRST_USE_PATIENCE`] from here.

use std::ffi::{c_char, c_void, CStr};
use std::sync::OnceLock;

use crate::error::{NnError, Result};

/// An opaque handle or descriptor of a C API.
pub(crate) type Ptr = *mut c_void;
/// A read-only pointer argument of a C API.
pub(crate) type CPtr = *const c_void;
/// A cuDNN or cuBLASLt status, kept as the integer the library returned (a newer library may
/// return codes this build does not know, which a Rust enum could not hold). NCCL's statuses
/// are C `int`s of its own (`ffi::nccl`).
pub(crate) type Status = u32;
/// The success status of cuDNN and cuBLASLt.
pub(crate) const SUCCESS: Status = 0;

/// How long opening a library waits for other threads' captures of the device to end before it
/// goes ahead anyway (see `Context::with_captures_held_off`): opening one may synchronise the
/// device, which would invalidate those captures.
pub(crate) const FIRST_USE_PATIENCE: std::time::Duration = std::time::Duration::from_millis(250);

/// Looks up the C function `$name` in a loaded library (a `libloading::Library`) as the function
/// pointer type of the place it initialises, or returns `Err("<name> is missing (..)")` — or
/// the text `$missing` makes of the lookup error — from the enclosing loader.
macro_rules! lib_fn {
    ($lib:expr, $name:literal) => {
        $crate::ffi::loader::lib_fn!($lib, $name, |e| format!("{} is missing ({e})", $name))
    };
    ($lib:expr, $name:literal, $missing:expr) => {
        // SAFETY: looks the symbol up without calling it; the caller gives it the type of the
        // C prototype the library's header declares for that name.
        unsafe { $lib.get($name.as_bytes()) }
            .map(|s| *s)
            .map_err($missing)?
    };
}
pub(crate) use lib_fn;

/// A library's function table, loaded on first use and kept for the process (libraries are
/// never unloaded): the table, or why the library is unavailable — the same answer every time.
pub(crate) struct Loaded<A> {
    table: OnceLock<std::result::Result<A, String>>,
    load: fn() -> std::result::Result<A, String>,
}

impl<A> Loaded<A> {
    /// A table that `load` fills on first use.
    pub(crate) const fn new(load: fn() -> std::result::Result<A, String>) -> Self {
        Loaded {
            table: OnceLock::new(),
            load,
        }
    }

    /// The table, or why there is none.
    pub(crate) fn get(&self) -> std::result::Result<&A, &str> {
        self.table
            .get_or_init(self.load)
            .as_ref()
            .map_err(|e| e.as_str())
    }
}

/// A C string a library returned, copied; `None` for null.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that stays valid until this returns (the
/// libraries return static strings, or thread-local ones valid until their next call on this
/// thread).
pub(crate) unsafe fn c_str(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated, valid for this call (the caller's promise).
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// A function table that can name its library's statuses (cuDNN's `cudnnGetErrorString`,
/// cuBLASLt's `cublasLtGetStatusString`).
///
/// # Safety
/// [`StatusText::status_string`] is the library's function of that C prototype, which returns
/// null or a static NUL-terminated string for any status.
pub(crate) unsafe trait StatusText {
    /// The library's name in errors (`cuDNN`, `cuBLASLt`).
    const LIBRARY: &'static str;
    /// The library's status-to-text function.
    fn status_string(&self) -> unsafe extern "C" fn(Status) -> *const c_char;
}

/// Status `st` as its library names it, `NAME (st)`, or `status st` when it has no name.
pub(crate) fn describe<A: StatusText>(api: &A, st: Status) -> String {
    // SAFETY: `status_string` maps any status to null or a static NUL-terminated string (the
    // contract of `StatusText`), which `c_str` copies.
    match unsafe { c_str((api.status_string())(st)) } {
        Some(s) => format!("{s} ({st})"),
        None => format!("status {st}"),
    }
}

/// The error of `call` returning `st`.
pub(crate) fn error<A: StatusText>(api: &A, st: Status, call: &'static str) -> NnError {
    NnError::Library {
        library: A::LIBRARY,
        call,
        status: describe(api, st),
    }
}

/// `Ok` when `call` returned success, else its [`error`].
pub(crate) fn check<A: StatusText>(api: &A, st: Status, call: &'static str) -> Result<()> {
    if st == SUCCESS {
        Ok(())
    } else {
        Err(error(api, st, call))
    }
}
