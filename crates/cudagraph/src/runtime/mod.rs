//! The lowest layer: everything that calls the CUDA driver, one module per kind of CUDA object,
//! each owner type next to its FFI. Nothing here imports a layer above it.
//!
//! - [`context`]: the device's primary context ([`Context`], [`DeviceInfo`]);
//! - [`stream`]: [`StreamHandle`], [`Event`], the capture-safe [`StreamRef`], [`CaptureMode`];
//! - [`module`]: [`Module`], [`Function`] (with its parameter list), [`LaunchConfig`], launches;
//! - [`memory`]: device segments, copies and memsets, page-locked and host-mapped memory;
//! - [`graph`]: owned `CUgraph`/`CUgraphExec`, hand-built nodes, rebind, host callbacks;
//! - [`result`]: status codes to errors (device faults become `Error::ContextLost`);
//! - [`nvrtc`]: run-time compilation with its disk cache.
//!
//! Memory policy (the caching allocator) sits one layer up, in [`crate::memory`].

pub(crate) mod context;
pub(crate) mod graph;
pub(crate) mod memory;
pub(crate) mod module;
pub mod nvrtc;
pub(crate) mod result;
pub(crate) mod stream;

pub use context::{device_count, Context, DeviceInfo};
pub use module::{
    driver_reports_library_params, Function, LaunchConfig, Module, ParamDecl, ParamKind, ParamValue,
};
pub use result::with_relaxed_capture;
pub use stream::{
    capturing_on_this_thread, CaptureMode, Event, StreamHandle, StreamRef, WeakStream,
};
