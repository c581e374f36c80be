//! The two promises the caching allocator takes from outside: where segments come from
//! ([`SegmentSource`], an `unsafe trait`: a source promises memory it owns) and when work that
//! used a block has finished ([`Fence`]). The bookkeeping that relies on them is in the
//! sibling modules; the device's source is `crate::memory::source`.

use crate::error::Result;

/// Where segments come from: the device (cuMemAlloc) or, in tests, host memory.
///
/// Implementing it takes `unsafe`, because the addresses it returns become blocks that other
/// code writes through (a device's queues, [`crate::memory::HostSource::fill`]):
///
/// ```compile_fail
/// # use cudagraph::memory::SegmentSource;
/// struct Forged;
/// impl SegmentSource for Forged { // error[E0200]: the trait requires an `unsafe impl`
///     fn allocate(&self, _bytes: usize) -> cudagraph::Result<u64> { Ok(0x1000) }
///     fn release(&self, _addr: u64, _bytes: usize) -> cudagraph::Result<()> { Ok(()) }
/// }
/// ```
///
/// # Safety
/// `allocate(bytes)` returns the start of `bytes` bytes of memory that the source owns and
/// that nothing else uses until the same range is passed to `release` (live ranges never
/// overlap), aligned to at least 256 bytes. A source that a device allocates from returns memory of that
/// device; only the crate makes those (see [`crate::memory::Allocator::new`]). `synchronize`
/// returns `Ok` only once no queued work can still touch any of its segments. `exclusive`
/// runs its closure at most once and returns whether it did.
pub unsafe trait SegmentSource: Send + Sync {
    /// Returns the address of a new region of `bytes` bytes, or `Error::OutOfMemory`.
    fn allocate(&self, bytes: usize) -> Result<u64>;
    /// Returns a region obtained from `allocate`.
    fn release(&self, addr: u64, bytes: usize) -> Result<()>;
    /// Waits until no queued work can still touch any segment (before segments are released).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// Whether releasing (`synchronize`, then `release`) may happen now. The allocator asks
    /// before it detaches segments to release; when the answer is no, it keeps them cached
    /// and tries again at a later free. A device's source says no while any capture of its
    /// context is open, on any thread: synchronising would invalidate it.
    fn may_release(&self) -> bool {
        true
    }
    /// Runs `release` (which synchronises and releases) with releases allowed throughout, and
    /// returns true; or returns false without running it when they are not allowed now. With
    /// `wait`, waits until they are (the allocator's teardown) where the source can. The
    /// default runs it at once.
    fn exclusive(&self, wait: bool, release: &mut dyn FnMut()) -> bool {
        let _ = wait;
        release();
        true
    }
}

/// Completion of device work that used a block (an event recorded after that work).
///
/// The allocator asks with its lock held, at every allocation, free and `empty_cache` while
/// blocks are pending, so `is_complete` must be cheap and must not block (`cuEventQuery`, not
/// `cuEventSynchronize`). Once it has returned `true` it is not asked again.
pub trait Fence: Send + Sync {
    /// Whether the work this fence follows has finished.
    fn is_complete(&self) -> bool;
}
