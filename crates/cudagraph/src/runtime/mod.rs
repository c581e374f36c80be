//! The lowest layer: everything that calls the CUDA driver, one module per kind of CUDA object,
//! each owner type next to its FFI. Nothing here imports a layer above it; memory policy (the
//! caching allocator) sits one layer up, in [`crate::memory`].
//!
//! Modules, lowest first (each imports only those before it):
//! - `raw`: the raw driver handles as `Copy` newtypes; `result`: status codes to errors
//!   (device faults become `Error::ContextLost`) and process-wide driver facts;
//! - `primary`: the retained primary context, binding it, the capture gate, and
//!   [`capturing_on_this_thread`];
//! - `module`: [`Module`], [`Function`] (with its parameter list), [`LaunchConfig`], launches;
//!   [`nvrtc`]: run-time compilation with its disk cache;
//! - `context`: [`Context`] (device facts, module cache, [`Context::compile`]) and
//!   [`DeviceInfo`];
//! - `graph`: owned `CUgraph`/`CUgraphExec`, hand-built nodes, node inspection, rebind's
//!   rewrite, conditional nodes, host callbacks;
//! - `stream`: [`StreamHandle`], [`Event`], the capture-safe [`StreamRef`], [`CaptureMode`],
//!   beginning and ending captures;
//! - `memory`: device segments, copies and memsets, page-locked and host-mapped memory.

pub(crate) mod context;
pub(crate) mod graph;
pub(crate) mod memory;
pub(crate) mod module;
pub mod nvrtc;
pub(crate) mod primary;
pub(crate) mod raw;
pub(crate) mod result;
pub(crate) mod stream;

pub use context::{device_count, Context, DeviceInfo};
pub use module::{
    driver_reports_library_params, Function, LaunchConfig, Module, ParamDecl, ParamKind,
    ParamValue, MAX_CLUSTER_BLOCKS,
};
pub use primary::capturing_on_this_thread;
pub use result::with_relaxed_capture;
pub use stream::{CaptureMode, Event, StreamHandle, StreamRef, WeakStream};
