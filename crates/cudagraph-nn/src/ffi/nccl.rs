//! NCCL loaded at run time: the library is found through cudarc's loader (its `nccl-02028`
//! bindings: `libnccl.so` on the loader path) or, failing that, at `CUDAGRAPH_NCCL_LIB` or as
//! `libnccl.so.2`; every function we call is resolved by name once, before any is called, so a
//! library that lacks one is a clear error rather than an abort mid-run, and we call nothing
//! NCCL 2.28 lacks. Status codes are read as integers (a newer library may return codes this
//! build does not know). The communicator built on it lives in `dist`.

use std::ffi::{c_char, c_int, c_void};
use std::ptr;

use cudagraph::runtime::Context;
use cudarc::nccl::sys;
use libloading::Library;

use super::loader::{c_str, lib_fn, Loaded};
use crate::env::{self, NCCL_LIB_VAR};
use crate::error::{DistError, Result};

/// `ncclComm_t`.
pub(crate) type RawComm = *mut c_void;
/// `ncclResult_t`, kept as the integer the library returned.
pub(crate) type Status = c_int;

pub(crate) const SUCCESS: Status = 0;
pub(crate) const IN_PROGRESS: Status = 7;
/// Oldest NCCL we accept: 2.13 has everything below (`ncclAvg` 2.10, `ncclGetLastError` and
/// `ncclRemoteError` 2.13, `ncclCommGetAsyncError` and `ncclCommAbort` 2.4).
const MIN_VERSION: c_int = 21300;

/// The NCCL functions this module calls, resolved from the library by name.
pub(crate) struct Api {
    pub(crate) version: c_int,
    pub(crate) get_unique_id: unsafe extern "C" fn(*mut sys::ncclUniqueId) -> Status,
    pub(crate) comm_init_rank:
        unsafe extern "C" fn(*mut RawComm, c_int, sys::ncclUniqueId, c_int) -> Status,
    pub(crate) comm_destroy: unsafe extern "C" fn(RawComm) -> Status,
    pub(crate) comm_abort: unsafe extern "C" fn(RawComm) -> Status,
    pub(crate) comm_get_async_error: unsafe extern "C" fn(RawComm, *mut Status) -> Status,
    pub(crate) comm_cu_device: unsafe extern "C" fn(RawComm, *mut c_int) -> Status,
    pub(crate) all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        *mut c_void,
    ) -> Status,
    pub(crate) broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        *mut c_void,
    ) -> Status,
    pub(crate) get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub(crate) get_last_error: unsafe extern "C" fn(RawComm) -> *const c_char,
}

/// The loaded library (once per process; libraries are never unloaded).
fn library() -> std::result::Result<&'static Library, String> {
    let leak = |l: Library| -> &'static Library { Box::leak(Box::new(l)) };
    if let Some(path) = env::var(NCCL_LIB_VAR) {
        // SAFETY: loading a shared library runs its initialisers; NCCL's have no
        // preconditions. The user named this file as NCCL.
        return unsafe { Library::new(&path) }
            .map(leak)
            .map_err(|e| format!("{NCCL_LIB_VAR}={path} could not be loaded: {e}"));
    }
    // SAFETY: only tries to open the library by its usual names (and closes it again).
    if unsafe { sys::is_culib_present() } {
        // SAFETY: present (checked above), so cudarc's loader opens it instead of panicking.
        return Ok(unsafe { sys::culib() });
    }
    // The name NCCL's packages (and Python wheels) install without a development symlink.
    // SAFETY: as for the explicit path above.
    if let Ok(l) = unsafe { Library::new("libnccl.so.2") } {
        return Ok(leak(l));
    }
    Err(format!(
        "no NCCL library found (tried {} and libnccl.so.2)",
        cudarc::get_lib_name_candidates("nccl").join(", ")
    ))
}

fn load() -> std::result::Result<Api, String> {
    let lib = library()?;
    // Every symbol gets the C prototype from nccl.h (2.28), with enums as `int` and
    // `ncclResult_t` read as `int`.
    macro_rules! sym {
        ($name:literal) => {
            lib_fn!(lib, $name, |e| format!(
                "the library lacks {}: {e} (NCCL too old or not NCCL)",
                $name
            ))
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> Status = sym!("ncclGetVersion");
    let mut version = 0;
    // SAFETY: writes one int.
    let st = unsafe { get_version(&mut version) };
    if st != SUCCESS {
        return Err(format!("ncclGetVersion failed with status {st}"));
    }
    if version < MIN_VERSION {
        return Err(format!(
            "found NCCL {}, need 2.13 or newer",
            version_string(version)
        ));
    }
    Ok(Api {
        version,
        get_unique_id: sym!("ncclGetUniqueId"),
        comm_init_rank: sym!("ncclCommInitRank"),
        comm_destroy: sym!("ncclCommDestroy"),
        comm_abort: sym!("ncclCommAbort"),
        comm_get_async_error: sym!("ncclCommGetAsyncError"),
        comm_cu_device: sym!("ncclCommCuDevice"),
        all_reduce: sym!("ncclAllReduce"),
        broadcast: sym!("ncclBroadcast"),
        get_error_string: sym!("ncclGetErrorString"),
        get_last_error: sym!("ncclGetLastError"),
    })
}

pub(crate) fn api() -> std::result::Result<&'static Api, DistError> {
    static API: Loaded<Api> = Loaded::new(load);
    API.get().map_err(|detail| DistError::NcclMissing {
        detail: detail.to_string(),
    })
}

fn version_string(v: c_int) -> String {
    format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
}

/// The NCCL version as `major.minor.patch`, or why NCCL cannot be used here.
pub fn nccl_version() -> std::result::Result<String, DistError> {
    Ok(version_string(api()?.version))
}

pub(crate) fn nccl_error(api: &Api, status: Status, call: &'static str) -> DistError {
    // SAFETY: ncclGetErrorString maps any code to a static string, which `c_str` copies.
    let name = unsafe { c_str((api.get_error_string)(status)) }.unwrap_or_default();
    // SAFETY: ncclGetLastError only reads the library's last error message (its communicator
    // argument is documented as unused and may be null); the string stays valid until the
    // next NCCL call on this thread, and `c_str` copies it right away.
    let last = unsafe { c_str((api.get_last_error)(ptr::null_mut())) }.unwrap_or_default();
    DistError::Nccl {
        call,
        code: status,
        name,
        detail: if last.is_empty() {
            String::new()
        } else {
            format!(": {last}")
        },
    }
}

/// A fresh NCCL unique id (rank 0 creates it; the rendezvous hands it to the others).
pub(crate) fn unique_id(api: &Api, ctx: &Context) -> Result<Vec<u8>> {
    ctx.bind()?;
    // SAFETY: all-zero bytes are a valid `ncclUniqueId` (an array of chars).
    let mut id: sys::ncclUniqueId = unsafe { std::mem::zeroed() };
    // SAFETY: writes one unique id.
    let st = unsafe { (api.get_unique_id)(&mut id) };
    if st != SUCCESS {
        return Err(nccl_error(api, st, "ncclGetUniqueId").into());
    }
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

pub(crate) fn id_from_bytes(b: &[u8]) -> std::result::Result<sys::ncclUniqueId, DistError> {
    // SAFETY: all-zero bytes are a valid `ncclUniqueId`.
    let mut id: sys::ncclUniqueId = unsafe { std::mem::zeroed() };
    if b.len() != id.internal.len() {
        return Err(DistError::Usage(format!(
            "the rendezvous handed out {} bytes, an NCCL unique id has {}",
            b.len(),
            id.internal.len()
        )));
    }
    for (d, &s) in id.internal.iter_mut().zip(b) {
        *d = s as c_char;
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without NCCL this is the one clear error; with NCCL, a version.
    #[test]
    fn nccl_is_found_or_reported_clearly() {
        match nccl_version() {
            Ok(v) => {
                let parts: Vec<&str> = v.split('.').collect();
                assert_eq!(parts.len(), 3, "{v}");
                assert!(parts.iter().all(|p| p.parse::<u32>().is_ok()), "{v}");
            }
            Err(DistError::NcclMissing { detail }) => {
                assert!(detail.contains("libnccl"), "{detail}");
                let msg = DistError::NcclMissing { detail }.to_string();
                assert!(msg.contains("CUDAGRAPH_NCCL_LIB"), "{msg}");
            }
            Err(other) => panic!("unexpected error: {other}"),
        }
    }

    #[test]
    fn unique_ids_round_trip_and_wrong_lengths_are_refused() {
        let bytes: Vec<u8> = (0..128u32).map(|i| (i * 7) as u8).collect();
        let id = id_from_bytes(&bytes).unwrap();
        let back: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        assert_eq!(back, bytes);
        assert!(matches!(
            id_from_bytes(&bytes[..127]),
            Err(DistError::Usage(_))
        ));
        assert_eq!(version_string(22809), "2.28.9");
    }
}
