//! Raw driver handles: one `Copy` newtype per kind of CUDA object, `Send` and `Sync` so that
//! the owners built on them can be shared between threads. The newtypes own nothing; the
//! owner types of the other runtime modules create and destroy the objects. Nothing here calls
//! the driver.

use cudarc::driver::sys;

/// Declares a `Copy` newtype around a raw driver handle. Owners (RAII types in this layer)
/// destroy the handle; the newtype itself owns nothing.
macro_rules! raw_handle {
    ($name:ident, $ty:ty) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) struct $name(pub(crate) $ty);
        // SAFETY: CUDA driver handles may be used from any thread once their context is current
        // on that thread; every owner binds the context before each call.
        unsafe impl Send for $name {}
        // SAFETY: as above. Objects the driver does not synchronise internally (graphs,
        // executable graphs) are only reached through owners that serialise access.
        unsafe impl Sync for $name {}
    };
}

raw_handle!(RawContext, sys::CUcontext);
raw_handle!(RawStream, sys::CUstream);
raw_handle!(RawEvent, sys::CUevent);
raw_handle!(RawModule, sys::CUmodule);
raw_handle!(RawFunction, sys::CUfunction);
raw_handle!(RawGraph, sys::CUgraph);
raw_handle!(RawGraphExec, sys::CUgraphExec);
raw_handle!(RawNode, sys::CUgraphNode);
