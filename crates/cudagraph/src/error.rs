//! The crate's one error type. Every variant carries what a user needs to act on it; driver
//! failures carry the call that failed and the source location of the user call that issued it.

use std::panic::Location;

use crate::ids::PoolId;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in cudagraph.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `libcuda` could not be loaded or initialised (no NVIDIA driver on this machine).
    #[error("no CUDA driver available: {detail}; install the NVIDIA driver or run on a machine with a GPU")]
    NoDriver {
        /// Why the driver could not be used (the loader's or `cuInit`'s message).
        detail: String,
    },

    /// The driver loaded but the requested device ordinal does not exist.
    #[error("CUDA device {ordinal} does not exist: the driver reports {count} device(s)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },

    /// A CUDA driver call returned an error.
    #[error("{call} failed: {name} ({code}): {description} (called at {at})")]
    Driver {
        /// The driver function that failed, e.g. `cuMemAlloc`.
        call: &'static str,
        /// Its `CUresult` status code.
        code: u32,
        /// The driver's name for the code, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
        /// The driver's description of the code.
        description: String,
        /// The call into this library that issued the driver call.
        at: &'static Location<'static>,
    },

    /// NVRTC is missing or rejected a kernel's source.
    #[error("could not compile CUDA module `{module}`: {log}")]
    Compile {
        /// The module's name, as passed to `compile`.
        module: String,
        /// NVRTC's log (or why NVRTC could not be used).
        log: String,
    },

    /// A compiled module does not contain the requested kernel.
    #[error("module `{module}` has no kernel named `{kernel}`; check the `extern \"C\"` name")]
    MissingKernel {
        /// The module's name.
        module: String,
        /// The kernel asked for.
        kernel: String,
    },

    /// A pool with a byte limit could not grow by `requested` bytes.
    #[error("pool {pool} is limited to {limit} bytes, holds {reserved} bytes and needs {requested} more; raise the limit, drop graphs that use the pool, or capture into another pool")]
    PoolLimitExceeded {
        /// The pool.
        pool: PoolId,
        /// Its limit on reserved bytes.
        limit: usize,
        /// Bytes it holds (reserved, and in flight) and cannot give back now.
        reserved: usize,
        /// Bytes of the segment it would need.
        requested: usize,
    },

    /// The device has no memory left for a new segment, even after freeing cached segments.
    #[error("out of device memory: needed a {requested}-byte segment while {reserved} bytes are reserved by cudagraph; free buffers or graphs, or call Device::empty_cache")]
    OutOfMemory {
        /// Bytes of the segment asked for.
        requested: usize,
        /// Bytes the allocator had reserved from the driver when the request failed.
        reserved: usize,
    },

    /// Two sizes that must agree do not.
    #[error("size mismatch in {what}: expected {expected}, got {got}")]
    SizeMismatch {
        /// What was being sized.
        what: &'static str,
        /// The size needed.
        expected: usize,
        /// The size given.
        got: usize,
    },

    /// A range lies outside a buffer.
    #[error("{what}: range {start}..{end} is outside a buffer of {len} elements")]
    OutOfRange {
        /// The operation that asked for the range.
        what: &'static str,
        /// First element of the range.
        start: usize,
        /// One past its last element.
        end: usize,
        /// Elements in the buffer.
        len: usize,
    },

    /// A launch configuration the device cannot run.
    #[error("invalid launch of `{kernel}`: {problem}")]
    InvalidLaunch {
        /// The kernel's name.
        kernel: String,
        /// What the device cannot run (block size, grid size, shared memory).
        problem: String,
    },

    /// Objects from two different devices were mixed.
    #[error("{what} belongs to device {got}, but was used with device {expected}")]
    WrongDevice {
        /// The object from the other device.
        what: &'static str,
        /// The device it was used with.
        expected: usize,
        /// The device it belongs to.
        got: usize,
    },

    /// The closure passed to a capture failed; the capture was ended and discarded.
    #[error("capture started at {at} failed and was discarded (the stream and pool are usable again): {source}")]
    CaptureFailed {
        /// The `capture` call.
        at: &'static Location<'static>,
        /// What failed inside it.
        #[source]
        source: Box<Error>,
    },

    /// The driver invalidated a capture (an unsafe call from this or another thread, or a
    /// dependency on work outside the capture). The capture was ended and discarded.
    #[error("capture started at {at} was invalidated by the driver (a synchronising or unsafe CUDA call happened while it was open; use CaptureMode::ThreadLocal or Relaxed if another thread must keep working): {detail}")]
    CaptureInvalidated {
        /// The `capture` call.
        at: &'static Location<'static>,
        /// The driver's error when the capture ended.
        detail: String,
    },

    /// An error from code layered on cudagraph (a model inside a capture closure, say).
    #[error("{0}")]
    External(Box<dyn std::error::Error + Send + Sync + 'static>),

    /// A graph that was built or updated by hand failed validation.
    #[error("invalid graph: {problem}")]
    InvalidGraph {
        /// What is wrong, and what to do instead.
        problem: String,
    },

    /// A count times an element size (or an offset) does not fit in the address space.
    #[error("{what}: {count} elements of {elem_size} bytes do not fit in the address space; the request is too large")]
    SizeOverflow {
        /// What was being sized.
        what: &'static str,
        /// The element count asked for.
        count: usize,
        /// Bytes per element.
        elem_size: usize,
    },

    /// A kernel launch whose arguments do not match the kernel's parameter list (count or
    /// byte sizes, as the driver reports them).
    #[error("arguments do not match the signature of `{kernel}`: {problem}")]
    ArgumentMismatch {
        /// The kernel's name.
        kernel: String,
        /// Which argument differs, and how.
        problem: String,
    },

    /// The device hit a fault (illegal or misaligned address, illegal instruction, failed
    /// launch). CUDA errors of this kind are sticky: the context is unusable from now on.
    #[error("{call} reported {name}: the CUDA context of this device is lost and every later call on it fails; drop every object of the device and restart the process (called at {at})")]
    ContextLost {
        /// The driver function that reported the fault.
        call: &'static str,
        /// The driver's name for the fault, e.g. `CUDA_ERROR_ILLEGAL_ADDRESS`.
        name: String,
        /// The call into this library that issued the driver call.
        at: &'static Location<'static>,
    },

    /// A capture recorded no work at all.
    #[error("the capture started at {at} recorded no work (the closure issued no kernel, copy or memset on the capture stream), so there is no graph to replay")]
    EmptyCapture {
        /// The `capture` call.
        at: &'static Location<'static>,
    },

    /// A kernel of the library found an invalid value on the device (an index outside its
    /// range, say). Graphs cannot return errors, so the kernel clamped the access, raised the
    /// device's error flag, and the next synchronisation reports it here.
    #[error("{check}: value {value} at position {position} is outside [0, {bound}); the result of that operation is wrong (the access was clamped, no memory outside the buffer was read)")]
    DeviceCheck {
        /// The check that failed, as registered ([`crate::register_check`]).
        check: &'static str,
        /// The value the kernel found.
        value: i64,
        /// The bound it must stay below.
        bound: i64,
        /// Where the kernel found it (the element index it reports).
        position: u64,
    },

    /// A feature the installed driver or device does not offer.
    #[error("{what} is not supported here: {detail}")]
    NotSupported {
        /// The feature.
        what: &'static str,
        /// What it needs, or what to do instead.
        detail: String,
    },

    /// An environment variable of this crate holds a value it cannot use (see
    /// [`crate::env`]).
    #[error("{var}={value:?} is not {expected}")]
    InvalidEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it accepts.
        expected: &'static str,
    },
}

impl Error {
    /// True when this error (or the error it wraps) is the driver's "out of memory".
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::OutOfMemory { .. } => true,
            Error::Driver { code, .. } => *code == 2,
            Error::CaptureFailed { source, .. } => source.is_out_of_memory(),
            _ => false,
        }
    }

    /// True when the device's context is lost (see [`Error::ContextLost`]), also when wrapped.
    pub fn is_context_lost(&self) -> bool {
        match self {
            Error::ContextLost { .. } => true,
            Error::CaptureFailed { source, .. } => source.is_context_lost(),
            _ => false,
        }
    }
}
