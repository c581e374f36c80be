//! # cudagraph
//!
//! CUDA Graphs for Rust, made practical and safe: capture a fixed stream of GPU work once and
//! replay it with one launch; feed it through static buffers; keep graph memory in private or
//! shared, optionally size-bounded pools; observe memory per pool, per graph and per device.
//!
//! Layers (see ARCHITECTURE.md): [`runtime`] (context, streams, kernels; all FFI) →
//! [`memory`] (caching allocator, pools, stats) → [`device`] (devices, streams, the `Queue`
//! of work) → [`graph`] (capture, replay, static I/O); [`error`], [`ids`] and
//! [`env`](mod@env) (every environment variable the crate reads) sit below them all,
//! [`interop`] (cudarc) and [`testing`] (the GPU test gate) above. Kernel launches are
//! `unsafe`: no signature says which memory a kernel touches (argument counts and kinds are
//! checked).
//!
//! ```no_run
//! use cudagraph::*;
//! # fn main() -> Result<()> {
//! let dev = Device::open(0)?;
//! let mut stream = dev.new_stream()?;
//! let add = dev
//!     .compile("add", r#"extern "C" __global__ void add_one(float* x, int n) {
//!         int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += 1.0f; }"#)?
//!     .function("add_one")?;
//! let x = stream.alloc_from_host(&vec![0.0f32; 256])?;
//! let (graph, ()) = Graph::capture(&mut stream, CaptureOptions::new(), |cs| {
//!     for _ in 0..10 {
//!         // SAFETY: `add_one` touches x[0..n) with n = 256 = x.len().
//!         unsafe { cs.launch(&add, LaunchConfig::for_elements(256, 256), args![&x, 256i32])? };
//!     }
//!     Ok(())
//! })?;
//! graph.replay(&stream)?; // ten kernels, one launch
//! assert_eq!(stream.to_vec(&x)?[0], 10.0);
//! println!("{}", cudagraph::memory::format_memory_line(&dev.memory_stats()));
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub mod device;
pub mod env;
pub mod error;
pub mod graph;
pub mod ids;
pub mod interop;
pub mod memory;
pub mod runtime;
pub mod testing;

/// The cudarc version cudagraph is built against (for [`interop`]): use its types through this
/// re-export so both sides agree.
pub use cudarc;
pub use device::{
    kernel_copy_fits, mapped_copy_fits, register_check, Anchor, Arg, Device, EndWork,
    LaunchOptions, PinnedScope, Queue, QueueExt, Stream, COPY_CUDA, COPY_KERNEL_VAR,
    DEVICE_CHECK_CUDA, MAX_KERNEL_COPY, MAX_MAPPED_COPY, PDL_CUDA,
};
pub use error::{Error, Result};
pub use graph::{
    bucket_for, plan_capture_sizes, warmup, BatchModel, BucketPolicy, CacheOptions, CacheOutput,
    CacheStats, CaptureOptions, CapturePlan, CaptureStream, Choice, ConditionalCounts,
    ConditionalKind, Fork, Graph, GraphBuilder, GraphCache, GraphCost, GraphInfo, GraphMemory,
    NodeCounts, NodeId, Outputs, RebindOutcome, Selection, Served, SideStream, SizeHistogram,
    Staged, StaticGraph,
};
pub use ids::PoolId;
pub use interop::{cudarc_stream, CudarcSlice};
pub use memory::{BlockRef, DeviceBuffer, Elem, MemoryStats, PinnedBuffer, Pool};
pub use runtime::{
    CaptureMode, DeviceInfo, Event, Function, LaunchConfig, Module, StreamHandle, StreamRef,
};
