//! The thread-safe caching allocator shared by a device, its pools and its buffers: a mutex
//! around [`AllocatorCore`], and the lock discipline. The bookkeeping itself lives in
//! [`super::caching`]; the handles built on it ([`Pool`](super::Pool),
//! [`BlockRef`](super::BlockRef)) in [`super`].
//!
//! **The lock is never held across a call into the [`SegmentSource`].** Those calls are slow
//! (`cuMemAlloc` and `cuMemFree` take tens of microseconds to milliseconds, and
//! `cuCtxSynchronize` waits for all queued work on the device), and every thread that
//! allocates or drops a buffer needs the lock: holding it across them would stall cache hits
//! on other streams behind one thread's miss, and a synchronisation behind a long kernel. So
//! the core works in phases (see [`super::caching`]):
//!
//! - *allocation*: under the lock, poll pending blocks and try the cache; on a miss, plan a new
//!   segment whose bytes count against the pool's limit while in flight (two threads growing a
//!   bounded pool cannot overshoot it). Unlock, release whatever the plan detached, ask the
//!   source for the segment; lock, commit (or cancel). Out of memory: detach every releasable
//!   free segment, release them unlocked, retry once.
//! - *release* (`empty_cache`, a closed pool's last block coming back or last graph going,
//!   teardown): under the lock, detach the victim segments from the bookkeeping; unlock,
//!   synchronise the device once, release each; lock, forget them (or put back those that
//!   failed).
//!
//! Capture windows make one exception a rule: releasing synchronises the device, which would
//! invalidate an open capture. No release starts while any window is open, and
//! [`Allocator::open_window`] (called just before a capture begins) waits on a condition
//! variable until the releases in flight have finished. So no capture is ever open while the
//! allocator synchronises the device or frees memory.
//!
//! Captures on other threads, through other allocators of the same context (every `Device`
//! handle has its own), are kept apart by the source: the device's source releases only while
//! it holds the context's capture gate (`runtime::primary::CaptureGate`), and says "not now"
//! while any capture of the context is open ([`SegmentSource::may_release`]). Segments it
//! could not release stay cached; closed pools' ones are retried at later frees.
//!
//! When the allocator itself goes (the last device handle, pool, buffer and graph are gone)
//! it synchronises once and returns every segment to the source.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::runtime::StreamRef;

use super::caching::{
    allocate_via, release_via, Allocation, AllocatorCore, CoreAccess, Fence, MemoryStats, PoolId,
    ReleasePlan, SegmentSource, WindowStats,
};
use crate::error::{Error, Result};

/// Refuses eager allocations from a graph pool (see [`Allocator::allocate`]).
pub(super) fn refuse_graph_pool(pool: PoolId) -> Result<()> {
    if pool != PoolId::DEFAULT {
        return Err(Error::InvalidGraph {
            problem: format!(
                "{pool} is a graph pool: only captures into it allocate there (its free \
                 blocks may be a graph's temporaries); allocate buffers with Queue::alloc \
                 or from PoolId::DEFAULT"
            ),
        });
    }
    Ok(())
}

/// The thread-safe allocator shared (`Arc`) by a device, its pools and its buffers.
pub struct Allocator {
    core: Mutex<AllocatorCore>,
    /// Signalled when the last release in flight finishes (`open_window` waits on it).
    released: Condvar,
    /// The core's source, reachable without the lock.
    source: Arc<dyn SegmentSource>,
    ordinal: usize,
    /// Made by a device over its own `cuMemAlloc` source ([`Self::for_device`]): only these
    /// blocks are accepted as device memory.
    device: bool,
}

impl fmt::Debug for Allocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Allocator(device {}, {:?})", self.ordinal, self.lock())
    }
}

/// The core reached by taking the wrapper's lock for each step of a protocol.
struct Locked<'a>(&'a Allocator);

impl CoreAccess for Locked<'_> {
    fn with<R>(&mut self, f: impl FnOnce(&mut AllocatorCore) -> R) -> R {
        let mut core = self.0.lock();
        let before = core.releases_in_flight();
        let r = f(&mut core);
        if before > 0 && core.releases_in_flight() == 0 {
            self.0.released.notify_all();
        }
        r
    }
}

impl Allocator {
    /// An allocator over any segment source (`HostSource` in CPU tests), reporting `ordinal`
    /// as its blocks' [`BlockRef::device_ordinal`](super::BlockRef::device_ordinal). Its blocks are never device memory as far
    /// as this crate is concerned ([`BlockRef::is_device_memory`](super::BlockRef::is_device_memory) is false): every queue,
    /// graph and builder refuses them with [`crate::Error::NotSupported`]. Devices make their
    /// own allocators.
    ///
    /// Creating one without `unsafe` does not compile:
    ///
    /// ```compile_fail
    /// # use cudagraph::memory::{Allocator, HostSource};
    /// let a = Allocator::new(Box::new(HostSource::new()), 0); // error[E0133]
    /// ```
    ///
    /// # Safety
    /// Code that checks buffers only by [`BlockRef::device_ordinal`](super::BlockRef::device_ordinal) before handing their
    /// addresses to CUDA libraries (libraries layered on cudagraph may) would take these blocks
    /// for device `ordinal`'s memory. No block of this allocator, nor of a [`Pool`](super::Pool) made from
    /// it, may reach such code; only this crate's own entry points, which check
    /// [`BlockRef::is_device_memory`](super::BlockRef::is_device_memory), may be given them.
    pub unsafe fn new(source: Box<dyn SegmentSource>, ordinal: usize) -> Arc<Self> {
        Self::with_kind(source, ordinal, false)
    }

    /// The allocator of device `ordinal`, over its `cuMemAlloc` source.
    pub(crate) fn for_device(source: Box<dyn SegmentSource>, ordinal: usize) -> Arc<Self> {
        Self::with_kind(source, ordinal, true)
    }

    fn with_kind(source: Box<dyn SegmentSource>, ordinal: usize, device: bool) -> Arc<Self> {
        let core = AllocatorCore::new(source);
        Arc::new(Self {
            source: core.source().clone(),
            core: Mutex::new(core),
            released: Condvar::new(),
            ordinal,
            device,
        })
    }

    /// Whether this is a device's allocator (its blocks are device memory).
    pub fn is_device_allocator(&self) -> bool {
        self.device
    }

    fn lock(&self) -> MutexGuard<'_, AllocatorCore> {
        // Every step under the lock leaves the bookkeeping consistent before it can panic (the
        // source is never called with the lock held), so a poisoned lock is still usable.
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs a release plan with the lock released around the source calls.
    fn release(&self, plan: ReleasePlan) -> Result<usize> {
        release_via(&mut Locked(self), &*self.source, plan)
    }

    /// Device ordinal this allocator serves.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Allocates at least `bytes` bytes from the default pool, stream-ordered on `stream`: the
    /// memory may have been used by earlier work on `stream` itself, so use
    /// it there, or order the stream you use it on after `stream`. The caller frees it with
    /// [`Self::free`] or [`Self::free_after`]. A stream of another device is refused
    /// ([`Error::WrongDevice`]), and so is a graph pool ([`Error::InvalidGraph`]): its free
    /// blocks may still be a live graph's temporaries, which its replays write; only captures
    /// into the pool allocate there.
    #[track_caller]
    pub fn allocate(
        &self,
        bytes: usize,
        pool: PoolId,
        stream: StreamRef<'_>,
    ) -> Result<Allocation> {
        self.check_stream(stream)?;
        refuse_graph_pool(pool)?;
        // SAFETY: the id is a real stream's (a `StreamRef`), and graph pools were refused.
        unsafe { self.allocate_raw(bytes, pool, stream.id()) }
    }

    /// [`Self::allocate`] by raw stream id and any pool (stream 0 for graph pools): what the
    /// crate's own queues and captures call, and CPU tests over host memory.
    ///
    /// # Safety
    /// `stream` is the id of the stream every use of the memory is ordered on (its reuse is
    /// ordered by that stream alone), and a graph pool is only allocated from by a capture into
    /// it (its free blocks may be a live graph's temporaries).
    pub unsafe fn allocate_raw(
        &self,
        bytes: usize,
        pool: PoolId,
        stream: u64,
    ) -> Result<Allocation> {
        allocate_via(&mut Locked(self), &*self.source, bytes, pool, stream)
    }

    pub(super) fn check_stream(&self, stream: StreamRef<'_>) -> Result<()> {
        let got = stream.context().ordinal();
        if self.is_device_allocator() && got != self.ordinal {
            return Err(Error::WrongDevice {
                what: "allocation stream",
                expected: self.ordinal,
                got,
            });
        }
        Ok(())
    }

    /// Returns the block at `addr` to its pool for reuse on its own stream. A closed pool's
    /// segment that becomes empty is released (lock not held).
    ///
    /// # Safety
    /// `addr` is a block this allocator handed out ([`Self::allocate`]) and has not freed, and
    /// nothing will use it again: no `BlockRef`, buffer or graph refers to it, and no queued
    /// work on any stream other than the one it was allocated on still uses it (use
    /// [`Self::free_after`] with fences for those). Blocks wrapped in a `BlockRef` free
    /// themselves; never free them by hand.
    pub unsafe fn free(&self, addr: u64) {
        let plan = self.lock().begin_free(addr);
        // Best effort: a segment that cannot be released stays cached and is counted.
        let _ = self.release(plan);
    }

    /// Frees the block at `addr` once every fence has completed: for a block that streams
    /// other than its own used, with an event recorded on each after that use. Until then the
    /// block stays allocated (counted in `pending_blocks`) and is never handed out again.
    ///
    /// # Safety
    /// As for [`Self::free`], except that work on other streams may still use the block as long
    /// as each such stream's last use is covered by one of `fences`.
    pub unsafe fn free_after(&self, addr: u64, fences: Vec<Box<dyn Fence>>) {
        let plan = self.lock().begin_free_after(addr, fences);
        let _ = self.release(plan);
    }

    /// Stats of one pool.
    pub fn pool_stats(&self, pool: PoolId) -> MemoryStats {
        self.lock().pool_stats(pool)
    }

    /// Stats of the whole device (every pool).
    pub fn stats(&self) -> MemoryStats {
        self.lock().device_stats()
    }

    /// Resets all peak counters.
    pub fn reset_peak(&self) {
        self.lock().reset_peak()
    }

    /// Returns cached, unused segments to the driver (never those of pools with live graphs,
    /// nothing while a capture is open). Returns the bytes released.
    pub fn empty_cache(&self) -> Result<usize> {
        let plan = self.lock().begin_release(None);
        self.release(plan)
    }

    /// Creates a graph pool, optionally limited to `limit` reserved bytes. The caller closes it
    /// with [`Self::close_pool`]; [`Self::new_pool`] returns a handle that does so on drop.
    pub fn create_pool(&self, limit: Option<usize>) -> PoolId {
        self.lock().create_pool(limit)
    }

    /// The pool's handle is gone: its memory goes back to the driver now, or as its last
    /// blocks and graphs go.
    ///
    /// # Safety
    /// Called once per pool from [`Self::create_pool`], after its last handle is gone
    /// (`Pool` does this on drop); no capture into it may still be open.
    pub unsafe fn close_pool(&self, pool: PoolId) {
        let plan = self.lock().begin_close_pool(pool);
        let _ = self.release(plan);
    }

    /// Records that a graph replays from `pool`: its segments stay mapped until
    /// [`Self::remove_graph`]. (Safe: it only keeps memory mapped longer.)
    pub fn add_graph(&self, pool: PoolId) {
        self.lock().add_graph(pool)
    }

    /// Undoes [`Self::add_graph`].
    ///
    /// # Safety
    /// Balances exactly one earlier `add_graph` of a graph that can no longer replay (its last
    /// replay has finished): the pool's segments may be released right after.
    pub unsafe fn remove_graph(&self, pool: PoolId) {
        let plan = self.lock().begin_remove_graph(pool);
        let _ = self.release(plan);
    }

    /// The byte limit of `pool`, if any.
    pub fn limit(&self, pool: PoolId) -> Option<usize> {
        self.lock().limit(pool)
    }

    /// Sets or clears the byte limit of `pool`. Memory already reserved is not given back.
    pub fn set_limit(&self, pool: PoolId, limit: Option<usize>) {
        self.lock().set_limit(pool, limit)
    }

    /// Starts measuring a capture window in `pool`, just before a capture begins: waits until
    /// no release is in flight, and no release starts until the window closes. False if a
    /// window is already open in `pool` (or the pool is gone).
    pub fn open_window(&self, pool: PoolId) -> bool {
        let mut core = self.lock();
        while core.releases_in_flight() > 0 {
            core = self.released.wait(core).unwrap_or_else(|p| p.into_inner());
        }
        core.open_window(pool)
    }

    /// Ends the capture window in `pool` and returns what it measured.
    ///
    /// # Safety
    /// Balances the `open_window` of a capture that has ended: while any capture is open, no
    /// segment may be released, and closing a window early would allow that.
    pub unsafe fn close_window(&self, pool: PoolId) -> WindowStats {
        self.lock().close_window(pool)
    }

    /// Checks every internal invariant of the bookkeeping (for tests).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.lock().check_invariants()
    }
}

impl Drop for Allocator {
    /// Teardown: synchronise once and give every segment back, live or cached. Nothing can
    /// use them any more: buffers, pools and graphs all hold the allocator. A device's source
    /// first waits for captures of the context open on other threads to end; only if this
    /// thread is itself capturing (on another handle of the device) while another capture is
    /// open are the segments left to the driver (freed with the context) rather than waited for.
    fn drop(&mut self) {
        let core = self.core.get_mut().unwrap_or_else(|p| p.into_inner());
        let mut plan = core.teardown();
        plan.execute(&*self.source);
        let _ = core.finish_release(plan);
    }
}
