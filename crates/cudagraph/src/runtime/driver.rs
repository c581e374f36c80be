//! The only place the core crate touches the CUDA driver API. Each function here is a thin call
//! that turns a `CUresult` into [`Error`], tagged with the name of the driver call and the
//! caller's source location. Nothing above this module calls `cudarc::driver::sys` directly.
//!
//! Device addresses are plain `u64`s here: device memory is not Rust memory, so a wrong device
//! address produces a CUDA error (or wrong numbers), never host undefined behaviour. Host memory
//! that the device reads or writes asynchronously (pinned buffers) is different; the functions
//! that take it are `unsafe fn` and say what the caller must keep alive.

use std::ffi::{c_void, CStr, CString};
use std::panic::Location;
use std::ptr;

use cudarc::driver::sys;

use crate::error::{Error, Result};

pub(crate) type CuResult = sys::CUresult;

/// Turns a driver status into a `Result`, naming the call and the caller.
#[track_caller]
fn check(status: CuResult, call: &'static str) -> Result<()> {
    if status == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(status, call, Location::caller()))
    }
}

pub(crate) fn driver_error(
    status: CuResult,
    call: &'static str,
    at: &'static Location<'static>,
) -> Error {
    let mut name_ptr: *const std::ffi::c_char = ptr::null();
    let mut desc_ptr: *const std::ffi::c_char = ptr::null();
    // SAFETY: cuGetErrorName/String only write a pointer to a static string (or leave it null
    // for an unknown code); we read it only when it is non-null.
    let (name, description) = unsafe {
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
    };
    Error::Driver {
        call,
        code: status as u32,
        name,
        description,
        at,
    }
}

/// Whether `libcuda` can be loaded at all. Cheap after the first call.
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names; no CUDA call is made.
    unsafe { sys::is_culib_present() }
}

// ---------------------------------------------------------------------------------------------
// Raw handles. They are plain pointers owned by the safe types in `runtime`; the driver API is
// thread-safe for them as long as the owning context is current, which every caller ensures.
// ---------------------------------------------------------------------------------------------

macro_rules! raw_handle {
    ($name:ident, $ty:ty) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) struct $name(pub(crate) $ty);
        // SAFETY: CUDA driver handles may be used from any thread once their context is current
        // on that thread; the owners in `runtime` bind the context before every call.
        unsafe impl Send for $name {}
        // SAFETY: as above; the driver serialises concurrent calls on one handle internally.
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

// ---------------------------------------------------------------------------------------------
// Initialisation, devices and contexts.
// ---------------------------------------------------------------------------------------------

#[track_caller]
pub(crate) fn init() -> Result<()> {
    // SAFETY: cuInit has no preconditions; calling it more than once is allowed.
    check(unsafe { sys::cuInit(0) }, "cuInit")
}

#[track_caller]
pub(crate) fn device_count() -> Result<usize> {
    let mut n = 0;
    // SAFETY: writes one int.
    check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    Ok(n.max(0) as usize)
}

#[track_caller]
pub(crate) fn device_get(ordinal: usize) -> Result<sys::CUdevice> {
    let mut dev = 0;
    // SAFETY: writes one CUdevice.
    check(
        unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) },
        "cuDeviceGet",
    )?;
    Ok(dev)
}

#[track_caller]
pub(crate) fn device_name(dev: sys::CUdevice) -> Result<String> {
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: the driver writes at most `len` bytes including the terminator.
    check(
        unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev) },
        "cuDeviceGetName",
    )?;
    // SAFETY: the buffer is NUL-terminated by the driver (and zero-initialised).
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

#[track_caller]
pub(crate) fn device_attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    // SAFETY: writes one int.
    check(
        unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) },
        "cuDeviceGetAttribute",
    )?;
    Ok(v)
}

#[track_caller]
pub(crate) fn device_total_mem(dev: sys::CUdevice) -> Result<usize> {
    let mut v = 0;
    // SAFETY: writes one size_t.
    check(
        unsafe { sys::cuDeviceTotalMem_v2(&mut v, dev) },
        "cuDeviceTotalMem",
    )?;
    Ok(v)
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

#[track_caller]
pub(crate) fn primary_ctx_retain(dev: sys::CUdevice) -> Result<RawContext> {
    let mut ctx = ptr::null_mut();
    // SAFETY: writes one context handle; balanced by primary_ctx_release in ContextHandle::drop.
    check(
        unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
        "cuDevicePrimaryCtxRetain",
    )?;
    Ok(RawContext(ctx))
}

pub(crate) fn primary_ctx_release(dev: sys::CUdevice) {
    // SAFETY: called exactly once per successful retain, from ContextHandle::drop.
    unsafe {
        sys::cuDevicePrimaryCtxRelease_v2(dev);
    }
}

thread_local! {
    static CURRENT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Makes `ctx` current on this thread (skipped when it already is, as far as we know).
#[track_caller]
pub(crate) fn ctx_bind(ctx: RawContext) -> Result<()> {
    let key = ctx.0 as usize;
    if CURRENT.with(|c| c.get()) == key {
        return Ok(());
    }
    // SAFETY: ctx is a live primary context retained by its ContextHandle.
    check(unsafe { sys::cuCtxSetCurrent(ctx.0) }, "cuCtxSetCurrent")?;
    CURRENT.with(|c| c.set(key));
    Ok(())
}

#[track_caller]
pub(crate) fn ctx_synchronize() -> Result<()> {
    // SAFETY: no arguments; the caller bound the context.
    check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
}

/// (free, total) bytes of the current context's device.
#[track_caller]
pub(crate) fn mem_get_info() -> Result<(usize, usize)> {
    let (mut free, mut total) = (0, 0);
    // SAFETY: writes two size_t.
    check(
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
        "cuMemGetInfo",
    )?;
    Ok((free, total))
}

// ---------------------------------------------------------------------------------------------
// Streams and events.
// ---------------------------------------------------------------------------------------------

#[track_caller]
pub(crate) fn stream_create() -> Result<RawStream> {
    let mut s = ptr::null_mut();
    // SAFETY: writes one stream handle. Non-blocking: no implicit sync with the legacy stream,
    // which would otherwise break capture in global mode.
    check(
        unsafe { sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
        "cuStreamCreate",
    )?;
    Ok(RawStream(s))
}

pub(crate) fn stream_destroy(s: RawStream) {
    // SAFETY: called once from Stream::drop; pending work completes before resources go.
    unsafe {
        sys::cuStreamDestroy_v2(s.0);
    }
}

#[track_caller]
pub(crate) fn stream_synchronize(s: RawStream) -> Result<()> {
    // SAFETY: s is a live stream.
    check(
        unsafe { sys::cuStreamSynchronize(s.0) },
        "cuStreamSynchronize",
    )
}

#[track_caller]
pub(crate) fn stream_wait_event(s: RawStream, e: RawEvent) -> Result<()> {
    // SAFETY: both handles are live.
    check(
        unsafe { sys::cuStreamWaitEvent(s.0, e.0, 0) },
        "cuStreamWaitEvent",
    )
}

#[track_caller]
pub(crate) fn event_create(timing: bool) -> Result<RawEvent> {
    let mut e = ptr::null_mut();
    let flags = if timing {
        sys::CUevent_flags::CU_EVENT_DEFAULT as u32
    } else {
        sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
    };
    // SAFETY: writes one event handle.
    check(
        unsafe { sys::cuEventCreate(&mut e, flags) },
        "cuEventCreate",
    )?;
    Ok(RawEvent(e))
}

pub(crate) fn event_destroy(e: RawEvent) {
    // SAFETY: called once from Event::drop.
    unsafe {
        sys::cuEventDestroy_v2(e.0);
    }
}

#[track_caller]
pub(crate) fn event_record(e: RawEvent, s: RawStream) -> Result<()> {
    // SAFETY: both handles are live.
    check(unsafe { sys::cuEventRecord(e.0, s.0) }, "cuEventRecord")
}

#[track_caller]
pub(crate) fn event_synchronize(e: RawEvent) -> Result<()> {
    // SAFETY: e is live.
    check(
        unsafe { sys::cuEventSynchronize(e.0) },
        "cuEventSynchronize",
    )
}

#[track_caller]
pub(crate) fn event_elapsed_ms(start: RawEvent, end: RawEvent) -> Result<f32> {
    let mut ms = 0.0f32;
    // SAFETY: both events are live and were recorded with timing enabled.
    check(
        unsafe { sys::cuEventElapsedTime_v2(&mut ms, start.0, end.0) },
        "cuEventElapsedTime",
    )?;
    Ok(ms)
}

// ---------------------------------------------------------------------------------------------
// Memory.
// ---------------------------------------------------------------------------------------------

/// Allocates device memory. Runs under relaxed capture mode, as PyTorch's allocator does, so a
/// graph pool can grow while a capture is open on this thread (cuMemAlloc is otherwise
/// "unsafe" during global capture and would invalidate it).
#[track_caller]
pub(crate) fn mem_alloc(bytes: usize) -> Result<u64> {
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    let mut dptr = 0;
    // SAFETY: exchange writes the previous mode back into `mode`; we restore it right after.
    // cuMemAlloc writes one device pointer.
    let status = unsafe {
        sys::cuThreadExchangeStreamCaptureMode(&mut mode);
        let status = sys::cuMemAlloc_v2(&mut dptr, bytes);
        sys::cuThreadExchangeStreamCaptureMode(&mut mode);
        status
    };
    check(status, "cuMemAlloc")?;
    Ok(dptr)
}

/// Runs `f` with this thread's stream-capture mode set to relaxed, then restores it. For
/// library calls that allocate (cuBLAS handle creation) and must work while a capture is open.
pub fn with_relaxed_capture<R>(f: impl FnOnce() -> R) -> R {
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: writes the previous mode into `mode`; the second call restores it.
    unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    let r = f();
    // SAFETY: as above.
    unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    r
}

#[track_caller]
pub(crate) fn mem_free(dptr: u64) -> Result<()> {
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: dptr came from mem_alloc and is freed once by the allocator; relaxed mode as above.
    let status = unsafe {
        sys::cuThreadExchangeStreamCaptureMode(&mut mode);
        let status = sys::cuMemFree_v2(dptr);
        sys::cuThreadExchangeStreamCaptureMode(&mut mode);
        status
    };
    check(status, "cuMemFree")
}

#[track_caller]
pub(crate) fn memset_d8_async(dptr: u64, value: u8, bytes: usize, s: RawStream) -> Result<()> {
    // SAFETY: device addresses only; a bad address is reported by the driver.
    check(
        unsafe { sys::cuMemsetD8Async(dptr, value, bytes, s.0) },
        "cuMemsetD8Async",
    )
}

#[track_caller]
pub(crate) fn memset_d32_async(dptr: u64, value: u32, words: usize, s: RawStream) -> Result<()> {
    // SAFETY: device addresses only.
    check(
        unsafe { sys::cuMemsetD32Async(dptr, value, words, s.0) },
        "cuMemsetD32Async",
    )
}

#[track_caller]
pub(crate) fn memcpy_dtod_async(dst: u64, src: u64, bytes: usize, s: RawStream) -> Result<()> {
    // SAFETY: device addresses only.
    check(
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, s.0) },
        "cuMemcpyDtoDAsync",
    )
}

/// Copies pageable host memory to the device. For pageable memory the driver has finished
/// reading `src` when this returns (it is staged), so `src` may be reused at once.
#[track_caller]
pub(crate) fn memcpy_htod_pageable(dst: u64, src: &[u8], s: RawStream) -> Result<()> {
    // SAFETY: src is a live slice for the duration of the call; see the doc comment.
    check(
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr() as *const c_void, src.len(), s.0) },
        "cuMemcpyHtoDAsync",
    )
}

/// Copies device memory into `dst` and waits for the stream, so `dst` is filled on return.
#[track_caller]
pub(crate) fn memcpy_dtoh_sync(dst: &mut [u8], src: u64, s: RawStream) -> Result<()> {
    // SAFETY: dst stays borrowed until the stream synchronisation below has completed.
    check(
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len(), s.0) },
        "cuMemcpyDtoHAsync",
    )?;
    stream_synchronize(s)
}

/// Page-locked host memory that the device can copy to and from asynchronously.
pub(crate) struct PinnedAlloc {
    ptr: *mut u8,
    bytes: usize,
    ctx: RawContext,
}

impl std::fmt::Debug for PinnedAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedAlloc({} B)", self.bytes)
    }
}

// SAFETY: the allocation is plain host memory owned by this value.
unsafe impl Send for PinnedAlloc {}
// SAFETY: shared access only hands out `&[u8]`; mutation needs `&mut self`.
unsafe impl Sync for PinnedAlloc {}

impl PinnedAlloc {
    #[track_caller]
    pub(crate) fn new(bytes: usize, ctx: RawContext) -> Result<Self> {
        ctx_bind(ctx)?;
        let mut p = ptr::null_mut();
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: writes one host pointer to `bytes.max(1)` bytes of page-locked memory. Relaxed
        // capture mode around it (restored right after), as for cuMemAlloc: static outputs get
        // their staging while their capture is open.
        let status = unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode);
            let status = sys::cuMemAllocHost_v2(&mut p, bytes.max(1));
            sys::cuThreadExchangeStreamCaptureMode(&mut mode);
            status
        };
        check(status, "cuMemAllocHost")?;
        // SAFETY: the allocation is at least `bytes` long; zero it so reads are defined.
        unsafe { ptr::write_bytes(p as *mut u8, 0, bytes) };
        Ok(Self {
            ptr: p as *mut u8,
            bytes,
            ctx,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.bytes
    }

    fn addr(&self) -> *mut c_void {
        self.ptr as *mut c_void
    }

    /// The first `len` elements as `T`. Only read them when no device copy is in flight.
    pub(crate) fn typed<T: crate::memory::Elem>(&self, len: usize) -> &[T] {
        assert!(len * std::mem::size_of::<T>() <= self.bytes);
        // SAFETY: cuMemAllocHost returns page-aligned memory, so the alignment of any Elem
        // holds; the memory is initialised (zeroed at allocation) and every bit pattern is a
        // valid Elem; the length is checked above.
        unsafe { std::slice::from_raw_parts(self.ptr as *const T, len) }
    }

    /// The first `len` elements as `T`, writable through a shared handle.
    ///
    /// # Safety
    /// For the lifetime of the returned slice no other slice of this allocation may exist and no
    /// device copy from or into it may be in flight.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn typed_mut_unchecked<T: crate::memory::Elem>(
        &self,
        len: usize,
    ) -> &mut [T] {
        assert!(len * std::mem::size_of::<T>() <= self.bytes);
        std::slice::from_raw_parts_mut(self.ptr as *mut T, len)
    }

    /// Copies `src` to the start of the allocation through a shared handle.
    ///
    /// # Safety
    /// No slice obtained from `as_slice`/`typed` of this allocation may be alive, and no device
    /// copy from or into it may be in flight.
    pub(crate) unsafe fn write_from(&self, src: &[u8]) {
        assert!(src.len() <= self.bytes);
        ptr::copy_nonoverlapping(src.as_ptr(), self.ptr, src.len());
    }
}

impl Drop for PinnedAlloc {
    fn drop(&mut self) {
        if ctx_bind(self.ctx).is_ok() {
            let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
            // SAFETY: ptr came from cuMemAllocHost and is freed once, here (relaxed capture
            // mode as in `new`, restored right after).
            unsafe {
                sys::cuThreadExchangeStreamCaptureMode(&mut mode);
                sys::cuMemFreeHost(self.ptr as *mut c_void);
                sys::cuThreadExchangeStreamCaptureMode(&mut mode);
            }
        }
    }
}

/// Enqueues a copy from pinned host memory to the device.
///
/// # Safety
/// `src` must stay alive, and must not be written from the host, until the copy has executed
/// (for a capture: for as long as the graph that contains it can be replayed).
#[track_caller]
pub(crate) unsafe fn memcpy_htod_pinned_async(
    dst: u64,
    src: &PinnedAlloc,
    bytes: usize,
    s: RawStream,
) -> Result<()> {
    debug_assert!(bytes <= src.len());
    check(
        sys::cuMemcpyHtoDAsync_v2(dst, src.addr(), bytes, s.0),
        "cuMemcpyHtoDAsync",
    )
}

/// Enqueues a copy from the device to pinned host memory.
///
/// # Safety
/// `dst` must stay alive, and must not be read from the host, until the copy has executed (for
/// a capture: for as long as the graph that contains it can be replayed).
#[track_caller]
pub(crate) unsafe fn memcpy_dtoh_pinned_async(
    dst: &PinnedAlloc,
    src: u64,
    bytes: usize,
    s: RawStream,
) -> Result<()> {
    debug_assert!(bytes <= dst.len());
    check(
        sys::cuMemcpyDtoHAsync_v2(dst.addr(), src, bytes, s.0),
        "cuMemcpyDtoHAsync",
    )
}

// ---------------------------------------------------------------------------------------------
// Modules and launches.
// ---------------------------------------------------------------------------------------------

#[track_caller]
pub(crate) fn module_load_ptx(ptx: &str) -> Result<RawModule> {
    let image = CString::new(ptx).map_err(|_| Error::Compile {
        module: "<ptx>".into(),
        log: "PTX text contains a NUL byte".into(),
    })?;
    let mut m = ptr::null_mut();
    // SAFETY: image is a NUL-terminated PTX string alive for the call.
    check(
        unsafe { sys::cuModuleLoadData(&mut m, image.as_ptr() as *const c_void) },
        "cuModuleLoadData",
    )?;
    Ok(RawModule(m))
}

pub(crate) fn module_unload(m: RawModule) {
    // SAFETY: called once from the module owner's Drop, after every Function is gone (they
    // hold the owner alive).
    unsafe {
        sys::cuModuleUnload(m.0);
    }
}

/// Looks a kernel up by name; `Ok(None)` when the module has no such function.
#[track_caller]
pub(crate) fn module_function(m: RawModule, name: &str) -> Result<Option<RawFunction>> {
    let Ok(cname) = CString::new(name) else {
        return Ok(None);
    };
    let mut f = ptr::null_mut();
    // SAFETY: writes one function handle.
    let status = unsafe { sys::cuModuleGetFunction(&mut f, m.0, cname.as_ptr()) };
    if status == sys::CUresult::CUDA_ERROR_NOT_FOUND {
        return Ok(None);
    }
    check(status, "cuModuleGetFunction")?;
    Ok(Some(RawFunction(f)))
}

#[track_caller]
pub(crate) fn function_max_threads(f: RawFunction) -> Result<u32> {
    let mut v = 0;
    // SAFETY: writes one int.
    check(
        unsafe {
            sys::cuFuncGetAttribute(
                &mut v,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                f.0,
            )
        },
        "cuFuncGetAttribute",
    )?;
    Ok(v.max(0) as u32)
}

/// One kernel parameter, stored in an 8-byte slot (every parameter type we pass is at most 8
/// bytes; little-endian, so the value's bytes start at the slot's address).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ParamSlot(pub(crate) u64);

/// Kernel parameters laid out for cuLaunchKernel / kernel graph nodes.
pub(crate) struct Params {
    slots: Vec<u64>,
    ptrs: Vec<*mut c_void>,
}

impl Params {
    pub(crate) fn new(values: &[ParamSlot]) -> Self {
        let mut slots: Vec<u64> = values.iter().map(|v| v.0).collect();
        let ptrs = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        Self { slots, ptrs }
    }

    fn as_ptr(&mut self) -> *mut *mut c_void {
        if self.slots.is_empty() {
            ptr::null_mut()
        } else {
            self.ptrs.as_mut_ptr()
        }
    }
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dims {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

#[track_caller]
pub(crate) fn launch(f: RawFunction, dims: Dims, params: &[ParamSlot], s: RawStream) -> Result<()> {
    let mut p = Params::new(params);
    // SAFETY: the parameter array points into `p`, alive for the call (the driver copies the
    // values at launch). A mismatch between these values and the kernel's signature gives wrong
    // device-side results or a device fault, never host memory access.
    check(
        unsafe {
            sys::cuLaunchKernel(
                f.0,
                dims.grid.0,
                dims.grid.1,
                dims.grid.2,
                dims.block.0,
                dims.block.1,
                dims.block.2,
                dims.shared_mem_bytes,
                s.0,
                p.as_ptr(),
                ptr::null_mut(),
            )
        },
        "cuLaunchKernel",
    )
}

// ---------------------------------------------------------------------------------------------
// Stream capture and graphs.
// ---------------------------------------------------------------------------------------------

pub(crate) fn capture_mode_raw(mode: u32) -> sys::CUstreamCaptureMode {
    match mode {
        0 => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        1 => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        _ => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
    }
}

#[track_caller]
pub(crate) fn stream_begin_capture(s: RawStream, mode: u32) -> Result<()> {
    // SAFETY: s is a live, non-capturing stream (the caller holds it by &mut).
    check(
        unsafe { sys::cuStreamBeginCapture_v2(s.0, capture_mode_raw(mode)) },
        "cuStreamBeginCapture",
    )
}

/// Ends a capture. Returns the graph, or the driver's error; in the error case any partial graph
/// the driver handed back has already been destroyed.
#[track_caller]
pub(crate) fn stream_end_capture(s: RawStream) -> Result<RawGraph> {
    let mut g = ptr::null_mut();
    // SAFETY: writes one graph handle (possibly null on failure).
    let status = unsafe { sys::cuStreamEndCapture(s.0, &mut g) };
    if status != sys::CUresult::CUDA_SUCCESS {
        if !g.is_null() {
            graph_destroy(RawGraph(g));
        }
        return Err(driver_error(
            status,
            "cuStreamEndCapture",
            Location::caller(),
        ));
    }
    if g.is_null() {
        return Err(Error::InvalidGraph {
            problem: "the driver ended the capture without a graph".into(),
        });
    }
    Ok(RawGraph(g))
}

/// Whether `s` is currently capturing (true also for an invalidated capture not yet ended).
#[track_caller]
pub(crate) fn stream_is_capturing(s: RawStream) -> Result<bool> {
    let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: writes one status.
    check(
        unsafe { sys::cuStreamIsCapturing(s.0, &mut st) },
        "cuStreamIsCapturing",
    )?;
    Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

#[track_caller]
pub(crate) fn graph_create() -> Result<RawGraph> {
    let mut g = ptr::null_mut();
    // SAFETY: writes one graph handle.
    check(unsafe { sys::cuGraphCreate(&mut g, 0) }, "cuGraphCreate")?;
    Ok(RawGraph(g))
}

pub(crate) fn graph_destroy(g: RawGraph) {
    // SAFETY: called once per graph by its owner.
    unsafe {
        sys::cuGraphDestroy(g.0);
    }
}

#[track_caller]
pub(crate) fn graph_instantiate(g: RawGraph) -> Result<RawGraphExec> {
    let mut e = ptr::null_mut();
    // SAFETY: writes one executable-graph handle; g is a live graph.
    check(
        unsafe { sys::cuGraphInstantiateWithFlags(&mut e, g.0, 0) },
        "cuGraphInstantiate",
    )?;
    Ok(RawGraphExec(e))
}

pub(crate) fn graph_exec_destroy(e: RawGraphExec) {
    // SAFETY: called once per executable graph by its owner.
    unsafe {
        sys::cuGraphExecDestroy(e.0);
    }
}

#[track_caller]
pub(crate) fn graph_launch(e: RawGraphExec, s: RawStream) -> Result<()> {
    // SAFETY: both handles live; the owner keeps every resource the graph uses alive.
    check(unsafe { sys::cuGraphLaunch(e.0, s.0) }, "cuGraphLaunch")
}

#[track_caller]
pub(crate) fn graph_upload(e: RawGraphExec, s: RawStream) -> Result<()> {
    // SAFETY: both handles live.
    check(unsafe { sys::cuGraphUpload(e.0, s.0) }, "cuGraphUpload")
}

/// Every node of `g`.
#[track_caller]
fn graph_nodes(g: RawGraph) -> Result<Vec<sys::CUgraphNode>> {
    let mut n = 0usize;
    // SAFETY: with a null array the driver only writes the count.
    check(
        unsafe { sys::cuGraphGetNodes(g.0, ptr::null_mut(), &mut n) },
        "cuGraphGetNodes",
    )?;
    let mut nodes = vec![ptr::null_mut(); n];
    // SAFETY: the array has room for `n` nodes.
    check(
        unsafe { sys::cuGraphGetNodes(g.0, nodes.as_mut_ptr(), &mut n) },
        "cuGraphGetNodes",
    )?;
    nodes.truncate(n);
    Ok(nodes)
}

/// The type code of every node in `g` (see `CUgraphNodeType`).
#[track_caller]
pub(crate) fn graph_node_types(g: RawGraph) -> Result<Vec<u32>> {
    let nodes = graph_nodes(g)?;
    nodes
        .into_iter()
        .map(|node| {
            let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: node belongs to g; writes one type.
            check(
                unsafe { sys::cuGraphNodeGetType(node, &mut t) },
                "cuGraphNodeGetType",
            )?;
            Ok(t as u32)
        })
        .collect()
}

/// Writes Graphviz DOT for `g` to `path` (verbose: node parameters included).
#[track_caller]
pub(crate) fn graph_dot_print(g: RawGraph, path: &std::path::Path) -> Result<()> {
    let cpath =
        CString::new(path.to_string_lossy().as_bytes()).map_err(|_| Error::InvalidGraph {
            problem: format!("DOT path {path:?} contains a NUL byte"),
        })?;
    // SAFETY: cpath is a NUL-terminated path alive for the call.
    check(
        unsafe { sys::cuGraphDebugDotPrint(g.0, cpath.as_ptr(), 1) },
        "cuGraphDebugDotPrint",
    )
}

/// Adds a kernel node to a graph built by hand.
#[track_caller]
pub(crate) fn graph_add_kernel_node(
    g: RawGraph,
    deps: &[RawNode],
    f: RawFunction,
    dims: Dims,
    params: &[ParamSlot],
) -> Result<RawNode> {
    let mut p = Params::new(params);
    let node_params = sys::CUDA_KERNEL_NODE_PARAMS {
        func: f.0,
        gridDimX: dims.grid.0,
        gridDimY: dims.grid.1,
        gridDimZ: dims.grid.2,
        blockDimX: dims.block.0,
        blockDimY: dims.block.1,
        blockDimZ: dims.block.2,
        sharedMemBytes: dims.shared_mem_bytes,
        kernelParams: p.as_ptr(),
        extra: ptr::null_mut(),
        kern: ptr::null_mut(),
        ctx: ptr::null_mut(),
    };
    let deps_raw: Vec<sys::CUgraphNode> = deps.iter().map(|d| d.0).collect();
    let mut node = ptr::null_mut();
    // SAFETY: the driver copies the parameter values when the node is added; `p` and `deps_raw`
    // outlive the call.
    check(
        unsafe {
            sys::cuGraphAddKernelNode_v2(
                &mut node,
                g.0,
                deps_raw.as_ptr(),
                deps_raw.len(),
                &node_params,
            )
        },
        "cuGraphAddKernelNode",
    )?;
    Ok(RawNode(node))
}

/// A copy description with every field set (its memory-type enums have no zero value, so
/// `mem::zeroed` would be invalid): device to device, nothing else filled in.
fn memcpy3d_device_blank() -> sys::CUDA_MEMCPY3D {
    sys::CUDA_MEMCPY3D {
        srcXInBytes: 0,
        srcY: 0,
        srcZ: 0,
        srcLOD: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: ptr::null(),
        srcDevice: 0,
        srcArray: ptr::null_mut(),
        reserved0: ptr::null_mut(),
        srcPitch: 0,
        srcHeight: 0,
        dstXInBytes: 0,
        dstY: 0,
        dstZ: 0,
        dstLOD: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: ptr::null_mut(),
        dstDevice: 0,
        dstArray: ptr::null_mut(),
        reserved1: ptr::null_mut(),
        dstPitch: 0,
        dstHeight: 0,
        WidthInBytes: 0,
        Height: 0,
        Depth: 0,
    }
}

/// Adds a device-to-device 1-D copy node.
#[track_caller]
pub(crate) fn graph_add_memcpy_dtod_node(
    g: RawGraph,
    deps: &[RawNode],
    dst: u64,
    src: u64,
    bytes: usize,
    ctx: RawContext,
) -> Result<RawNode> {
    let mut p = memcpy3d_device_blank();
    p.srcMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    p.srcDevice = src;
    p.dstMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    p.dstDevice = dst;
    p.WidthInBytes = bytes;
    p.Height = 1;
    p.Depth = 1;
    let deps_raw: Vec<sys::CUgraphNode> = deps.iter().map(|d| d.0).collect();
    let mut node = ptr::null_mut();
    // SAFETY: parameters are copied by the driver; device addresses only.
    check(
        unsafe {
            sys::cuGraphAddMemcpyNode(&mut node, g.0, deps_raw.as_ptr(), deps_raw.len(), &p, ctx.0)
        },
        "cuGraphAddMemcpyNode",
    )?;
    Ok(RawNode(node))
}

/// Adds a 32-bit memset node over `words` words.
#[track_caller]
pub(crate) fn graph_add_memset_node(
    g: RawGraph,
    deps: &[RawNode],
    dst: u64,
    value: u32,
    words: usize,
    ctx: RawContext,
) -> Result<RawNode> {
    let p = sys::CUDA_MEMSET_NODE_PARAMS {
        dst,
        pitch: 0,
        value,
        elementSize: 4,
        width: words,
        height: 1,
    };
    let deps_raw: Vec<sys::CUgraphNode> = deps.iter().map(|d| d.0).collect();
    let mut node = ptr::null_mut();
    // SAFETY: parameters are copied by the driver; device addresses only.
    check(
        unsafe {
            sys::cuGraphAddMemsetNode(&mut node, g.0, deps_raw.as_ptr(), deps_raw.len(), &p, ctx.0)
        },
        "cuGraphAddMemsetNode",
    )?;
    Ok(RawNode(node))
}

/// A device-address remapping: addresses in `[old, old + len)` move to `new + (addr - old)`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Remap {
    pub old: u64,
    pub len: u64,
    pub new: u64,
}

fn remap(addr: u64, remaps: &[Remap]) -> Option<u64> {
    remaps
        .iter()
        .find(|r| addr >= r.old && addr < r.old + r.len)
        .map(|r| r.new + (addr - r.old))
}

enum Edit {
    Kernel {
        node: sys::CUgraphNode,
        params: sys::CUDA_KERNEL_NODE_PARAMS,
        // Owned parameter values the `kernelParams` pointers point into.
        _storage: Vec<Vec<u64>>,
        _ptrs: Vec<*mut c_void>,
    },
    Memcpy {
        node: sys::CUgraphNode,
        params: sys::CUDA_MEMCPY3D,
    },
    Memset {
        node: sys::CUgraphNode,
        params: sys::CUDA_MEMSET_NODE_PARAMS,
    },
}

/// What [`graph_rebind`] did.
pub(crate) struct RebindResult {
    pub nodes_changed: usize,
    /// False when the driver refused to update the executable graph in place.
    pub exec_updated: bool,
}

/// Rewrites every device address covered by `remaps` in the kernel parameters (every 8-byte
/// aligned word of every parameter, so pointers inside struct parameters of library kernels
/// are found too), copy and memset nodes of `g`, and applies the same edits to `exec`.
/// Nothing is modified unless every node could be read.
#[track_caller]
pub(crate) fn graph_rebind(
    g: RawGraph,
    exec: RawGraphExec,
    ctx: RawContext,
    remaps: &[Remap],
) -> Result<RebindResult> {
    let nodes = graph_nodes(g)?;
    let mut edits = Vec::new();
    for node in nodes {
        let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: node belongs to g; writes one type.
        check(
            unsafe { sys::cuGraphNodeGetType(node, &mut t) },
            "cuGraphNodeGetType",
        )?;
        match t {
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => {
                // SAFETY: the struct holds only pointers and integers (no enums), so all-zero
                // is a valid value; the driver fills it.
                let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
                // SAFETY: node is a kernel node of g.
                check(
                    unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut p) },
                    "cuGraphKernelNodeGetParams",
                )?;
                if p.func.is_null() && !p.kern.is_null() {
                    // SAFETY: kern is the node's live kernel handle; writes one function.
                    check(
                        unsafe { sys::cuKernelGetFunction(&mut p.func, p.kern) },
                        "cuKernelGetFunction",
                    )?;
                }
                if p.kernelParams.is_null() || p.func.is_null() {
                    return Err(Error::InvalidGraph {
                        problem: "a kernel node passes its parameters in a form rebind cannot read; re-capture instead".into(),
                    });
                }
                let mut storage = Vec::new();
                let mut changed = false;
                for i in 0..4096usize {
                    let (mut off, mut size) = (0usize, 0usize);
                    // SAFETY: writes two size_t; an index past the last parameter is an error.
                    let st = unsafe { sys::cuFuncGetParamInfo(p.func, i, &mut off, &mut size) };
                    if st != sys::CUresult::CUDA_SUCCESS {
                        break;
                    }
                    let mut words = vec![0u64; size.div_ceil(8)];
                    // SAFETY: kernelParams[i] points to `size` readable bytes owned by the graph
                    // (the driver's copy of the launch arguments); `words` has room for them.
                    unsafe {
                        let src = *p.kernelParams.add(i) as *const u8;
                        ptr::copy_nonoverlapping(src, words.as_mut_ptr() as *mut u8, size);
                    }
                    // Examine the 8-byte words that are 8-aligned in the parameter buffer.
                    let bytes = size;
                    let first = (8 - off % 8) % 8;
                    let mut pos = first;
                    while pos + 8 <= bytes {
                        let mut w = [0u8; 8];
                        // SAFETY: words holds at least `bytes` initialised bytes.
                        let view = unsafe {
                            std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, bytes)
                        };
                        w.copy_from_slice(&view[pos..pos + 8]);
                        if let Some(nv) = remap(u64::from_le_bytes(w), remaps) {
                            view[pos..pos + 8].copy_from_slice(&nv.to_le_bytes());
                            changed = true;
                        }
                        pos += 8;
                    }
                    storage.push(words);
                }
                if changed {
                    let mut ptrs: Vec<*mut c_void> = storage
                        .iter_mut()
                        .map(|w| w.as_mut_ptr() as *mut c_void)
                        .collect();
                    p.kernelParams = ptrs.as_mut_ptr();
                    p.extra = ptr::null_mut();
                    edits.push(Edit::Kernel {
                        node,
                        params: p,
                        _storage: storage,
                        _ptrs: ptrs,
                    });
                }
            }
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY => {
                let mut p = memcpy3d_device_blank();
                // SAFETY: node is a memcpy node of g.
                check(
                    unsafe { sys::cuGraphMemcpyNodeGetParams(node, &mut p) },
                    "cuGraphMemcpyNodeGetParams",
                )?;
                let mut changed = false;
                if p.srcMemoryType == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE {
                    if let Some(v) = remap(p.srcDevice, remaps) {
                        p.srcDevice = v;
                        changed = true;
                    }
                }
                if p.dstMemoryType == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE {
                    if let Some(v) = remap(p.dstDevice, remaps) {
                        p.dstDevice = v;
                        changed = true;
                    }
                }
                if changed {
                    edits.push(Edit::Memcpy { node, params: p });
                }
            }
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET => {
                // SAFETY: the struct holds only integers (no enums), so all-zero is a valid
                // value; the driver fills it.
                let mut p: sys::CUDA_MEMSET_NODE_PARAMS = unsafe { std::mem::zeroed() };
                // SAFETY: node is a memset node of g.
                check(
                    unsafe { sys::cuGraphMemsetNodeGetParams(node, &mut p) },
                    "cuGraphMemsetNodeGetParams",
                )?;
                if let Some(v) = remap(p.dst, remaps) {
                    p.dst = v;
                    edits.push(Edit::Memset { node, params: p });
                }
            }
            _ => {}
        }
    }
    let mut exec_updated = true;
    for e in &edits {
        // SAFETY: every node belongs to g, which `exec` was instantiated from; parameter
        // structs and the storage their pointers point into are alive (owned by `edits`).
        unsafe {
            match e {
                Edit::Kernel { node, params, .. } => {
                    check(
                        sys::cuGraphKernelNodeSetParams_v2(*node, params),
                        "cuGraphKernelNodeSetParams",
                    )?;
                    exec_updated &= sys::cuGraphExecKernelNodeSetParams_v2(exec.0, *node, params)
                        == sys::CUresult::CUDA_SUCCESS;
                }
                Edit::Memcpy { node, params } => {
                    check(
                        sys::cuGraphMemcpyNodeSetParams(*node, params),
                        "cuGraphMemcpyNodeSetParams",
                    )?;
                    exec_updated &=
                        sys::cuGraphExecMemcpyNodeSetParams(exec.0, *node, params, ctx.0)
                            == sys::CUresult::CUDA_SUCCESS;
                }
                Edit::Memset { node, params } => {
                    check(
                        sys::cuGraphMemsetNodeSetParams(*node, params),
                        "cuGraphMemsetNodeSetParams",
                    )?;
                    exec_updated &=
                        sys::cuGraphExecMemsetNodeSetParams(exec.0, *node, params, ctx.0)
                            == sys::CUresult::CUDA_SUCCESS;
                }
            }
        }
    }
    Ok(RebindResult {
        nodes_changed: edits.len(),
        exec_updated,
    })
}

/// A host callback a graph runs (a host-function node). Kept alive by the graph.
pub(crate) struct HostFn(pub(crate) Box<dyn Fn() + Send + Sync + 'static>);

/// Runs the callback; a panic is caught here (unwinding into the driver would abort) and
/// reported on stderr.
unsafe extern "C" fn host_trampoline(user: *mut c_void) {
    // SAFETY: `user` is the address of a `HostFn` that the graph owning this node keeps alive
    // (in an Arc) for as long as the graph can run; the driver passes it back unchanged.
    let f = unsafe { &*(user as *const HostFn) };
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (f.0)())).is_err() {
        eprintln!("cudagraph: a host-function node panicked; the panic was caught");
    }
}

/// Adds a host-function node that calls `f`.
///
/// The caller must keep `f` alive (and at the same address) for as long as the graph, or any
/// executable graph instantiated from it, can run; `GraphBuilder` stores it in the `Graph`.
#[track_caller]
pub(crate) fn graph_add_host_node(
    g: RawGraph,
    deps: &[RawNode],
    f: &std::sync::Arc<HostFn>,
) -> Result<RawNode> {
    let p = sys::CUDA_HOST_NODE_PARAMS {
        fn_: Some(host_trampoline),
        userData: std::sync::Arc::as_ptr(f) as *mut c_void,
    };
    let deps_raw: Vec<sys::CUgraphNode> = deps.iter().map(|d| d.0).collect();
    let mut node = ptr::null_mut();
    // SAFETY: the parameters are copied by the driver; `userData` stays valid as documented.
    check(
        unsafe { sys::cuGraphAddHostNode(&mut node, g.0, deps_raw.as_ptr(), deps_raw.len(), &p) },
        "cuGraphAddHostNode",
    )?;
    Ok(RawNode(node))
}

/// Adds a child-graph node (the driver clones `child` into `g`).
#[track_caller]
pub(crate) fn graph_add_child_node(
    g: RawGraph,
    deps: &[RawNode],
    child: RawGraph,
) -> Result<RawNode> {
    let deps_raw: Vec<sys::CUgraphNode> = deps.iter().map(|d| d.0).collect();
    let mut node = ptr::null_mut();
    // SAFETY: the child graph is live; the driver clones it.
    check(
        unsafe {
            sys::cuGraphAddChildGraphNode(
                &mut node,
                g.0,
                deps_raw.as_ptr(),
                deps_raw.len(),
                child.0,
            )
        },
        "cuGraphAddChildGraphNode",
    )?;
    Ok(RawNode(node))
}
