//! Raw memory calls: device segments for the allocator, memset and copies, page-locked host
//! memory ([`PinnedAlloc`]) and host-mapped words the device can write ([`MappedWords`], the
//! device-side error flag). Typed views and every policy live one layer up in `crate::memory`.
//!
//! Device addresses are plain `u64`s here. Functions that make the device read or write host
//! memory asynchronously are `unsafe fn` and say what the caller must keep alive.

use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicU32, Ordering};

use cudarc::driver::sys;

use std::sync::Arc;

use super::primary::ContextHandle;
use super::raw::RawStream;
use super::result::{check, with_relaxed_capture};
use crate::error::Result;

/// Allocates device memory. Runs under relaxed capture mode, as PyTorch's allocator does, so a
/// graph pool can grow while a capture is open on this thread (cuMemAlloc is otherwise
/// "unsafe" during capture and would invalidate it).
#[track_caller]
pub(crate) fn mem_alloc(bytes: usize) -> Result<u64> {
    let mut dptr = 0;
    // SAFETY: cuMemAlloc writes one device pointer.
    let status = with_relaxed_capture(|| unsafe { sys::cuMemAlloc_v2(&mut dptr, bytes) });
    check(status, "cuMemAlloc")?;
    Ok(dptr)
}

/// Frees memory from [`mem_alloc`].
///
/// # Safety
/// `dptr` came from `mem_alloc`, is freed once, and no queued or running work uses it.
#[track_caller]
pub(crate) unsafe fn mem_free(dptr: u64) -> Result<()> {
    let status = with_relaxed_capture(|| sys::cuMemFree_v2(dptr));
    check(status, "cuMemFree")
}

/// Enqueues a byte memset. Device addresses only: a wrong address is the device's fault to
/// report, never a host memory access.
#[track_caller]
pub(crate) fn memset_d8_async(dptr: u64, value: u8, bytes: usize, s: RawStream) -> Result<()> {
    // SAFETY: device addresses only (see above).
    check(
        unsafe { sys::cuMemsetD8Async(dptr, value, bytes, s.0) },
        "cuMemsetD8Async",
    )
}

/// Enqueues a 32-bit memset of `words` words.
#[track_caller]
pub(crate) fn memset_d32_async(dptr: u64, value: u32, words: usize, s: RawStream) -> Result<()> {
    // SAFETY: device addresses only.
    check(
        unsafe { sys::cuMemsetD32Async(dptr, value, words, s.0) },
        "cuMemsetD32Async",
    )
}

/// Enqueues a device-to-device copy.
#[track_caller]
pub(crate) fn memcpy_dtod_async(dst: u64, src: u64, bytes: usize, s: RawStream) -> Result<()> {
    // SAFETY: device addresses only.
    check(
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, s.0) },
        "cuMemcpyDtoDAsync",
    )
}

/// What the driver knows about an address (`CU_POINTER_ATTRIBUTE_MEMORY_TYPE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MemoryKind {
    /// Not the driver's: ordinary pageable host memory, or nothing at all.
    Unknown,
    /// Page-locked host memory: `cuMemAllocHost`/`cuMemHostAlloc`, or a `cuMemHostRegister`ed
    /// range (what cudarc's pinned slices are). The device reads and writes it by DMA.
    PageLocked,
    /// Device memory (`cuMemAlloc`, stream-ordered pools).
    Device,
    /// Arrays or managed memory.
    Other,
}

/// Asks the driver what `addr` is. Uses `cuPointerGetAttributes`, which, unlike
/// `cuPointerGetAttribute`, succeeds (reporting memory type 0) for addresses the driver does
/// not know, so no probe fails on purpose (compute-sanitizer stays quiet). The address is
/// only looked up, never dereferenced.
#[track_caller]
pub(crate) fn memory_kind(addr: u64) -> Result<MemoryKind> {
    let mut kind: u32 = 0;
    let mut attr = [sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE];
    let mut data = [&mut kind as *mut u32 as *mut c_void];
    // SAFETY: one attribute, whose value (a CUmemorytype, 32 bits) is written to `kind`.
    check(
        unsafe { sys::cuPointerGetAttributes(1, attr.as_mut_ptr(), data.as_mut_ptr(), addr) },
        "cuPointerGetAttributes",
    )?;
    Ok(match kind {
        0 => MemoryKind::Unknown,
        k if k == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 => MemoryKind::PageLocked,
        k if k == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 => MemoryKind::Device,
        _ => MemoryKind::Other,
    })
}

/// Copies host memory to the device; returns once `src` may be reused. Pageable memory is
/// staged by the driver before the call returns; page-locked memory (ours, cudarc's, or any
/// registered range) is read by an asynchronous DMA instead, so for it this waits for the
/// stream. Costs one or two `cuPointerGetAttributes` lookups (the first and the last byte).
/// Call it on a stream that is not capturing.
#[track_caller]
pub(crate) fn memcpy_htod_from_host(dst: u64, src: &[u8], s: RawStream) -> Result<()> {
    let Some(last) = src.len().checked_sub(1) else {
        return Ok(());
    };
    // Any memory the driver knows may be read by DMA after this returns.
    let known = |p: *const u8| memory_kind(p as u64).map(|k| k != MemoryKind::Unknown);
    let locked = known(src.as_ptr())? || known(src[last..].as_ptr())?;
    // SAFETY: src is a live slice for the duration of the call; pageable memory has been read
    // when it returns, page-locked memory once the synchronisation below has returned.
    check(
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr() as *const c_void, src.len(), s.0) },
        "cuMemcpyHtoDAsync",
    )?;
    if locked {
        // SAFETY: the stream is live.
        check(
            unsafe { sys::cuStreamSynchronize(s.0) },
            "cuStreamSynchronize",
        )?;
    }
    Ok(())
}

/// Copies device memory into `dst` and waits for the stream, so `dst` is filled on return.
#[track_caller]
pub(crate) fn memcpy_dtoh_sync(dst: &mut [u8], src: u64, s: RawStream) -> Result<()> {
    // SAFETY: dst stays borrowed until the stream synchronisation below has completed (and on
    // an error from the enqueue nothing was queued).
    check(
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len(), s.0) },
        "cuMemcpyDtoHAsync",
    )?;
    // SAFETY: the stream is live.
    check(
        unsafe { sys::cuStreamSynchronize(s.0) },
        "cuStreamSynchronize",
    )
}

/// Page-locked host memory that the device can copy to and from asynchronously. Bytes only;
/// typed views live in `crate::memory::pinned`.
pub(crate) struct PinnedAlloc {
    ptr: *mut u8,
    bytes: usize,
    /// The address kernels reach it at (mapped into the device's address space).
    device_addr: u64,
    /// Kept alive so the free in `drop` still has its context.
    ctx: Arc<ContextHandle>,
}

impl std::fmt::Debug for PinnedAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedAlloc({} B)", self.bytes)
    }
}

// SAFETY: the allocation is plain host memory owned by this value.
unsafe impl Send for PinnedAlloc {}
// SAFETY: shared access only reads through `as_ptr`; writes go through `unsafe` methods whose
// callers guarantee exclusive access.
unsafe impl Sync for PinnedAlloc {}

impl PinnedAlloc {
    /// `bytes` bytes of zeroed page-locked memory (page-aligned), mapped into the device's
    /// address space (portable to every context) so kernels can copy it as well as DMA.
    #[track_caller]
    pub(crate) fn new(bytes: usize, ctx: &Arc<ContextHandle>) -> Result<Self> {
        ctx.bind()?;
        let mut p = ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: writes one host pointer to `bytes.max(1)` bytes of page-locked memory. Relaxed
        // capture mode around it: static outputs get their staging while their capture is open.
        let status =
            with_relaxed_capture(|| unsafe { sys::cuMemHostAlloc(&mut p, bytes.max(1), flags) });
        check(status, "cuMemHostAlloc")?;
        // SAFETY: the allocation is at least `bytes` long; zero it so reads are defined.
        unsafe { ptr::write_bytes(p as *mut u8, 0, bytes) };
        let mut device_addr = 0;
        // SAFETY: p is mapped memory from cuMemHostAlloc with DEVICEMAP; writes one pointer.
        let status = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_addr, p, 0) };
        if let Err(e) = check(status, "cuMemHostGetDevicePointer") {
            // SAFETY: p came from cuMemHostAlloc above and nothing else refers to it.
            with_relaxed_capture(|| unsafe { sys::cuMemFreeHost(p) });
            return Err(e);
        }
        Ok(Self {
            ptr: p as *mut u8,
            bytes,
            device_addr,
            ctx: ctx.clone(),
        })
    }

    /// The address of the first byte in the device's address space (what a kernel reads or
    /// writes; the host pointer itself under unified addressing).
    pub(crate) fn device_addr(&self) -> u64 {
        self.device_addr
    }

    pub(crate) fn len(&self) -> usize {
        self.bytes
    }

    /// Start of the allocation (page-aligned, `len()` initialised bytes).
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for PinnedAlloc {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: ptr came from cuMemHostAlloc and is freed once, here (relaxed capture
            // mode as in `new`).
            with_relaxed_capture(|| unsafe {
                sys::cuMemFreeHost(self.ptr as *mut c_void);
            });
        }
    }
}

/// Enqueues a copy from pinned host memory to the device.
///
/// # Safety
/// `src` must stay alive, and must not be written from the host, until the copy has executed
/// (for a capture: for as long as the graph that contains it can be replayed); `bytes` must
/// not exceed `src.len()`.
#[track_caller]
pub(crate) unsafe fn memcpy_htod_pinned_async(
    dst: u64,
    src: &PinnedAlloc,
    bytes: usize,
    s: RawStream,
) -> Result<()> {
    debug_assert!(bytes <= src.len());
    check(
        sys::cuMemcpyHtoDAsync_v2(dst, src.ptr as *const c_void, bytes, s.0),
        "cuMemcpyHtoDAsync",
    )
}

/// Enqueues a copy from the device to pinned host memory.
///
/// # Safety
/// `dst` must stay alive, and must not be read from the host, until the copy has executed (for
/// a capture: for as long as the graph that contains it can be replayed); `bytes` must not
/// exceed `dst.len()`.
#[track_caller]
pub(crate) unsafe fn memcpy_dtoh_pinned_async(
    dst: &PinnedAlloc,
    src: u64,
    bytes: usize,
    s: RawStream,
) -> Result<()> {
    debug_assert!(bytes <= dst.len());
    check(
        sys::cuMemcpyDtoHAsync_v2(dst.ptr as *mut c_void, src, bytes, s.0),
        "cuMemcpyDtoHAsync",
    )
}

/// A few 32-bit words of page-locked host memory mapped into the device's address space:
/// kernels write them (an error flag), the host reads them after a synchronisation without a
/// copy. Zeroed at creation.
pub(crate) struct MappedWords {
    ptr: *mut AtomicU32,
    words: usize,
    device_addr: u64,
    ctx: Arc<ContextHandle>,
}

// SAFETY: host memory owned by this value; all host access goes through atomics.
unsafe impl Send for MappedWords {}
// SAFETY: as above.
unsafe impl Sync for MappedWords {}

impl MappedWords {
    #[track_caller]
    pub(crate) fn new(words: usize, ctx: &Arc<ContextHandle>) -> Result<Self> {
        ctx.bind()?;
        let bytes = words.max(1) * 4;
        let mut p = ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: writes one host pointer to `bytes` bytes of mapped, page-locked memory.
        let status = with_relaxed_capture(|| unsafe { sys::cuMemHostAlloc(&mut p, bytes, flags) });
        check(status, "cuMemHostAlloc")?;
        // SAFETY: zero the fresh allocation (page-aligned, `bytes` long) before any use.
        unsafe { ptr::write_bytes(p as *mut u8, 0, bytes) };
        let mut dptr = 0;
        // SAFETY: p is mapped memory from cuMemHostAlloc with DEVICEMAP; writes one pointer.
        let status = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, p, 0) };
        if let Err(e) = check(status, "cuMemHostGetDevicePointer") {
            // SAFETY: p came from cuMemHostAlloc above and nothing else refers to it.
            unsafe { sys::cuMemFreeHost(p) };
            return Err(e);
        }
        Ok(Self {
            ptr: p as *mut AtomicU32,
            words: words.max(1),
            device_addr: dptr,
            ctx: ctx.clone(),
        })
    }

    /// The address kernels write to.
    pub(crate) fn device_addr(&self) -> u64 {
        self.device_addr
    }

    /// Reads word `i` (device writes are visible once the writing work has completed).
    pub(crate) fn load(&self, i: usize) -> u32 {
        assert!(i < self.words, "mapped word {i} of {}", self.words);
        // SAFETY: i is in bounds; the memory is initialised, aligned for u32 (page-aligned
        // base) and only accessed atomically on the host.
        unsafe { (*self.ptr.add(i)).load(Ordering::Acquire) }
    }

    /// Writes word `i`.
    pub(crate) fn store(&self, i: usize, v: u32) {
        assert!(i < self.words, "mapped word {i} of {}", self.words);
        // SAFETY: as in `load`.
        unsafe { (*self.ptr.add(i)).store(v, Ordering::Release) }
    }
}

impl Drop for MappedWords {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc, freed once, here. The owner (the device)
            // outlives every kernel that could write it.
            with_relaxed_capture(|| unsafe {
                sys::cuMemFreeHost(self.ptr as *mut c_void);
            });
        }
    }
}
