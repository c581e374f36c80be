//! Device memory: the caching allocator, graph pools, buffers and statistics.
//!
//! Every device buffer the library hands out comes from one [`Allocator`] per device. The
//! bookkeeping lives in [`caching`] and is tested on the CPU against real host memory
//! ([`HostSource`]); on a GPU the same code runs over `cuMemAlloc` ([`source::DeviceSource`]).
//! Streams and kernel launches are one layer down ([`crate::runtime`]); queues and capture are
//! above ([`crate::device`], [`crate::graph`]).
//!
//! **Stream-safe reuse.** A block remembers every stream other than its own that work using it
//! was enqueued on ([`BlockRef::note_use`], called by the queues for every launch, copy, fill
//! and library call). When such a block is freed, an event is recorded on each of those
//! streams and the allocator does not hand the block out again until they have completed. The
//! one-stream path costs one comparison per use and nothing at free.
//!
//! **Buffers used by eager work that was captured anyway.** A stream that is part of a capture
//! refuses eager work (see [`crate::Stream`]), but a declaration of use cannot fail: a block
//! declared on such a stream ([`BlockRef::note_use`]), like a library's anchor, is kept for the
//! rest of the process (`hold_forever`) — the graph that recorded the work may replay it at
//! any time, and nothing tells us when that graph is gone.

mod allocator;
pub mod caching;
mod host;
pub(crate) mod order;
pub mod pinned;
pub(crate) mod source;

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub use allocator::Allocator;
pub use caching::{
    AllocStep, Allocation, AllocatorCore, Fence, GrowPlan, MemoryStats, ReleasePlan, SegmentSource,
    WindowStats,
};
pub use host::HostSource;
pub use pinned::PinnedBuffer;

use crate::error::{Error, Result};
pub use crate::ids::PoolId;
use crate::runtime::{capturing_on_this_thread, Event, StreamRef, WeakStream};

impl Fence for Event {
    fn is_complete(&self) -> bool {
        // On a thread that is capturing even an event query would invalidate the capture:
        // report "not yet" and let a later poll (outside the capture) find out.
        if capturing_on_this_thread() {
            return false;
        }
        // A lost context means nothing will run any more: the block is idle. Any other error
        // leaves it unknown, so the block is never handed out again.
        self.query().unwrap_or_else(|e| e.is_context_lost())
    }
}

/// Anchors kept until the process exits: what eager work that a capture recorded anyway uses
/// (see the module docs). Keyed by address so repeated declarations keep one entry.
static HELD_FOREVER: Mutex<Option<HashMap<usize, Arc<dyn Any + Send + Sync>>>> = Mutex::new(None);

/// Keeps `anchor` (a block, a module, a library handle) alive until the process exits: it is
/// used by work recorded into a graph that does not know it.
pub(crate) fn hold_forever(anchor: Arc<dyn Any + Send + Sync>) {
    let key = Arc::as_ptr(&anchor) as *const () as usize;
    HELD_FOREVER
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .entry(key)
        .or_insert(anchor);
}

/// External memory whose release waits for streams that used it, released later because the
/// thread that dropped its last holder was capturing (and may not query or wait on events).
struct DeferredRelease {
    fences: Vec<Event>,
    keep: Box<dyn Any + Send + Sync>,
}

static DEFERRED: Mutex<Vec<DeferredRelease>> = Mutex::new(Vec::new());
static DEFERRED_COUNT: AtomicUsize = AtomicUsize::new(0);

/// What to do with external memory once its fences are asked.
enum Settled {
    /// Every stream that used it is done (or the context is lost): release it.
    Done,
    /// Some work may still use it: ask again later.
    Pending,
    /// No fence can tell (an event query failed): never release it.
    Unknown,
}

/// Asks `fences` without waiting (never on a capturing thread: the caller checks).
fn poll_fences(fences: &[Event]) -> Settled {
    let mut state = Settled::Done;
    for f in fences {
        match f.query() {
            Ok(true) => {}
            Ok(false) => state = Settled::Pending,
            Err(e) if e.is_context_lost() => return Settled::Done,
            Err(_) => return Settled::Unknown,
        }
    }
    state
}

/// Releases deferred external memory whose fences have completed. Cheap when there is none;
/// does nothing on a capturing thread.
pub(crate) fn drain_deferred() {
    if DEFERRED_COUNT.load(Ordering::Acquire) == 0 || capturing_on_this_thread() {
        return;
    }
    let (done, unknown) = {
        let mut list = DEFERRED.lock().unwrap_or_else(|p| p.into_inner());
        let mut done = Vec::new();
        let mut unknown = Vec::new();
        let mut keep = Vec::new();
        for d in list.drain(..) {
            match poll_fences(&d.fences) {
                Settled::Done => done.push(d),
                Settled::Pending => keep.push(d),
                Settled::Unknown => unknown.push(d),
            }
        }
        *list = keep;
        DEFERRED_COUNT.store(list.len(), Ordering::Release);
        (done, unknown)
    };
    // Released outside the lock (a keep-alive's drop may free memory through another library).
    drop(done);
    for d in unknown {
        std::mem::forget(d.keep);
    }
}

struct PoolInner {
    id: PoolId,
    alloc: Arc<Allocator>,
    /// The stream of the last replay of any graph captured into the pool: replays of its
    /// graphs never overlap (see [`Pool`]).
    order: order::LastUse,
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        // SAFETY: the pool's only handle is gone (this is its last owner) and captures hold a
        // `Pool`, so none into it is open.
        unsafe { self.alloc.close_pool(self.id) };
    }
}

/// A graph memory pool (PyTorch's `graph_pool_handle()`): captures that name the same pool
/// allocate from the same memory.
///
/// **Sharing.** A block freed inside one capture may be handed out again to a later capture
/// into the same pool, so graphs of one pool may share their temporaries. Their replays are
/// therefore never allowed to overlap: the pool remembers the stream of the last replay of any
/// of its graphs, and a replay on another stream first waits (stream-ordered, no host wait) for
/// the work that stream had enqueued. Replays on one stream are ordered by the stream and cost
/// nothing extra. Graphs in different pools never share memory and replay concurrently.
///
/// A block still allocated when a capture ends (an output, anything the graph still writes)
/// belongs to that graph until the graph is dropped, even when the caller drops every handle
/// to it: only blocks freed *during* a capture are shared with later captures.
///
/// A pool's memory stays mapped while its handle or any graph captured into it is alive, and is
/// returned to the driver when the last of them is dropped.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<PoolInner>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Pool({}, {:?})", self.inner.id, self.stats())
    }
}

impl Pool {
    /// A new graph pool of `alloc`, optionally limited to `limit` reserved bytes.
    pub fn new(alloc: &Arc<Allocator>, limit: Option<usize>) -> Pool {
        Pool {
            inner: Arc::new(PoolInner {
                id: alloc.create_pool(limit),
                alloc: alloc.clone(),
                order: order::LastUse::default(),
            }),
        }
    }

    pub fn id(&self) -> PoolId {
        self.inner.id
    }

    pub fn stats(&self) -> MemoryStats {
        self.inner.alloc.pool_stats(self.inner.id)
    }

    /// The byte limit on this pool's reserved memory, if any.
    pub fn limit(&self) -> Option<usize> {
        self.inner.alloc.limit(self.inner.id)
    }

    /// Sets or clears the limit. Memory already reserved is not given back by this call.
    pub fn set_limit(&self, limit: Option<usize>) {
        self.inner.alloc.set_limit(self.inner.id, limit)
    }

    pub fn allocator(&self) -> &Arc<Allocator> {
        &self.inner.alloc
    }

    /// The order of replays of this pool's graphs.
    pub(crate) fn order(&self) -> &order::LastUse {
        &self.inner.order
    }

    /// Registers a graph that replays from this pool; the guard unregisters it on drop.
    pub(crate) fn pin(&self) -> PoolPin {
        self.inner.alloc.add_graph(self.inner.id);
        PoolPin { pool: self.clone() }
    }
}

/// Keeps a pool's segments mapped for as long as a graph can replay from them.
pub(crate) struct PoolPin {
    pool: Pool,
}

impl Drop for PoolPin {
    fn drop(&mut self) {
        // SAFETY: balances the `add_graph` of `Pool::pin`; the graph owning this pin drops it
        // only after its last replay has finished (see `crate::graph`).
        unsafe { self.pool.inner.alloc.remove_graph(self.pool.inner.id) };
    }
}

/// Who gives a block's memory back.
enum Owner {
    /// A block of our caching allocator.
    Allocator(Arc<Allocator>),
    /// Memory allocated elsewhere (cudarc, another library); `keep` owns it.
    External {
        keep: Option<Box<dyn Any + Send + Sync>>,
        ordinal: usize,
    },
}

/// One block of device memory. Shared (`Arc`) between the buffers that view it and any graph
/// that baked its address in; the block is given back when the last holder drops — and, if work
/// on other streams used it, not before that work has finished.
pub struct BlockRef {
    addr: u64,
    size: usize,
    pool: PoolId,
    capture: u64,
    /// Stream whose order governs reuse (0: none, for graph pools and external memory).
    home: u64,
    /// Other streams work using this block was enqueued on (weakly: a block never keeps a
    /// stream alive; a destroyed stream's final event still fences the block).
    foreign: Mutex<Vec<WeakStream>>,
    owner: Owner,
}

impl fmt::Debug for BlockRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Block({:#x}, {} B, {})", self.addr, self.size, self.pool)
    }
}

impl BlockRef {
    /// Wraps a block handed out by `alloc` (allocated on stream `home`, inside capture
    /// `capture`, 0 when eager).
    pub(crate) fn from_allocation(
        alloc: &Arc<Allocator>,
        a: Allocation,
        home: u64,
        capture: u64,
    ) -> Arc<Self> {
        drain_deferred();
        Arc::new(BlockRef {
            addr: a.addr,
            size: a.size,
            pool: a.pool,
            capture,
            home: if a.pool == PoolId::DEFAULT { home } else { 0 },
            foreign: Mutex::new(Vec::new()),
            owner: Owner::Allocator(alloc.clone()),
        })
    }

    /// A block over memory someone else allocated.
    ///
    /// # Safety
    /// `[addr, addr + size)` must be device memory of device `ordinal` that stays allocated,
    /// and is used by nothing else in ways that conflict with this library's work, until
    /// `keep` is dropped (which happens after the last holder of the block is gone and the
    /// work on every stream that used it has finished).
    pub unsafe fn external(
        addr: u64,
        size: usize,
        ordinal: usize,
        keep: Box<dyn Any + Send + Sync>,
    ) -> Arc<Self> {
        Arc::new(BlockRef {
            addr,
            size,
            pool: PoolId::DEFAULT,
            capture: 0,
            home: 0,
            foreign: Mutex::new(Vec::new()),
            owner: Owner::External {
                keep: Some(keep),
                ordinal,
            },
        })
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Bytes of the block (its rounded size).
    pub fn size(&self) -> usize {
        self.size
    }
    pub fn pool(&self) -> PoolId {
        self.pool
    }
    /// Id of the capture that allocated the block (0 for eager allocations).
    pub fn capture_id(&self) -> u64 {
        self.capture
    }
    /// Ordinal of the device the memory belongs to (for libraries that check buffers before
    /// passing their addresses to a CUDA library).
    pub fn device_ordinal(&self) -> usize {
        match &self.owner {
            Owner::Allocator(a) => a.ordinal(),
            Owner::External { ordinal, .. } => *ordinal,
        }
    }

    /// Whether the block is device memory: from a device's own allocator ([`crate::Device`]
    /// makes them), or external memory whose wrapper promised so ([`Self::external`]). Blocks
    /// of allocators made with [`Allocator::new`] (host memory in tests) are not, and no device
    /// accepts them.
    pub fn is_device_memory(&self) -> bool {
        match &self.owner {
            Owner::Allocator(a) => a.is_device_allocator(),
            Owner::External { .. } => true,
        }
    }

    /// Whether the block belongs to `pool` (same allocator and same pool id: pool ids are only
    /// unique within one allocator, and every `Device::open` has its own).
    pub fn is_in(&self, pool: &Pool) -> bool {
        match &self.owner {
            Owner::Allocator(a) => self.pool == pool.id() && Arc::ptr_eq(a, pool.allocator()),
            Owner::External { .. } => false,
        }
    }

    /// Records that work using this block is being enqueued on `stream` (eagerly). Costs an
    /// atomic load and one comparison when `stream` is the block's own.
    ///
    /// If `stream` is part of a capture after all ([`StreamRef::in_capture`]: a side stream
    /// still in the capture it joined, a cudarc stream cudarc is capturing), the work is
    /// recorded into a graph that does not know this block, so the block is kept until the
    /// process exits: leaked, never reused under a replay.
    pub fn note_use(self: &Arc<Self>, stream: StreamRef<'_>) {
        if stream.in_capture().unwrap_or(true) {
            hold_forever(self.clone());
            return;
        }
        if stream.id() == self.home {
            return;
        }
        let mut f = self.foreign.lock().unwrap_or_else(|p| p.into_inner());
        if !f.iter().any(|s| s.id() == stream.id()) {
            // Forget streams that are gone and done, so a long-lived block used from many
            // short-lived streams keeps a bounded list.
            if f.len() >= 8 {
                f.retain(|s| !s.is_done());
            }
            f.push(stream.downgrade());
        }
    }

    /// Fences on every foreign stream; `None` if one could not be made (a lost context, or a
    /// stream another library is capturing).
    fn fences(&mut self) -> Option<Vec<Event>> {
        let foreign = std::mem::take(self.foreign.get_mut().unwrap_or_else(|p| p.into_inner()));
        foreign.iter().map(|s| s.fence()).collect()
    }
}

impl Drop for BlockRef {
    fn drop(&mut self) {
        drain_deferred();
        let used_elsewhere = !self
            .foreign
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty();
        let fences = if used_elsewhere {
            self.fences()
        } else {
            Some(Vec::new())
        };
        match (&mut self.owner, fences) {
            // SAFETY: this is the block's last holder (buffers and graphs share this `Arc`);
            // work on its own stream is ordered before any reuse there, and work on every
            // other stream that used it is covered by a fence.
            (Owner::Allocator(a), Some(f)) if f.is_empty() => unsafe { a.free(self.addr) },
            // SAFETY: as above.
            (Owner::Allocator(a), Some(f)) => unsafe {
                a.free_after(
                    self.addr,
                    f.into_iter()
                        .map(|e| Box::new(e) as Box<dyn Fence>)
                        .collect(),
                )
            },
            // No way to know when the other streams are done: never reuse the block.
            (Owner::Allocator(_), None) => {}
            (Owner::External { keep, .. }, Some(fences)) => {
                let Some(keep) = keep.take() else { return };
                if fences.is_empty() {
                    drop(keep);
                } else if capturing_on_this_thread() {
                    // Waiting, even asking, would invalidate the capture: release it later,
                    // from a thread that is not capturing.
                    let mut list = DEFERRED.lock().unwrap_or_else(|p| p.into_inner());
                    list.push(DeferredRelease { fences, keep });
                    DEFERRED_COUNT.store(list.len(), Ordering::Release);
                } else if fences.iter().all(|f| f.synchronize().is_ok_or_lost()) {
                    drop(keep);
                } else {
                    // A fence that cannot be waited on: never release the memory.
                    std::mem::forget(keep);
                }
            }
            // No way to know when the other streams are done: never release the memory.
            (Owner::External { keep, .. }, None) => std::mem::forget(keep.take()),
        }
    }
}

/// A wait that returned, or failed because the context is lost (nothing runs any more).
trait OkOrLost {
    fn is_ok_or_lost(&self) -> bool;
}

impl OkOrLost for Result<()> {
    fn is_ok_or_lost(&self) -> bool {
        match self {
            Ok(()) => true,
            Err(e) => e.is_context_lost(),
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Element types a device buffer can hold: plain numbers, every bit pattern valid.
pub trait Elem: sealed::Sealed + Copy + Default + Send + Sync + fmt::Debug + 'static {
    /// Bytes as they are laid out in memory.
    fn as_bytes(v: &[Self]) -> &[u8];
    /// Mutable bytes of a slice.
    fn as_bytes_mut(v: &mut [Self]) -> &mut [u8];
}

macro_rules! elem {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Elem for $t {
            fn as_bytes(v: &[Self]) -> &[u8] {
                // Plain numbers: reading their bytes is always defined.
                let n = std::mem::size_of_val(v);
                bytes_of(v.as_ptr() as *const u8, n)
            }
            fn as_bytes_mut(v: &mut [Self]) -> &mut [u8] {
                let n = std::mem::size_of_val(v);
                bytes_of_mut(v.as_mut_ptr() as *mut u8, n)
            }
        }
    )*};
}
elem!(f32, f64, i8, u8, i16, u16, i32, u32, i64, u64);

use host::{bytes_of, bytes_of_mut};

/// Bytes of `len` elements of `T`, or the typed error for a count that does not fit.
pub fn bytes_for<T>(what: &'static str, len: usize) -> Result<usize> {
    len.checked_mul(std::mem::size_of::<T>())
        .ok_or(Error::SizeOverflow {
            what,
            count: len,
            elem_size: std::mem::size_of::<T>(),
        })
}

/// A typed device buffer: `len` elements of `T` at the start of a block.
///
/// Invariant: `len * size_of::<T>()` fits in the block, so every byte offset inside the
/// buffer is representable and inside memory the block owns.
///
/// Dropping it returns the block to its pool — unless a graph baked its address in, in which
/// case the graph keeps it until the graph is dropped.
pub struct DeviceBuffer<T: Elem> {
    block: Arc<BlockRef>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Elem> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DeviceBuffer<{}>[{}] @ {:#x} ({})",
            std::any::type_name::<T>(),
            self.len,
            self.block.addr,
            self.block.pool
        )
    }
}

impl<T: Elem> DeviceBuffer<T> {
    /// A buffer of `len` elements over `block`; fails unless they fit in it.
    pub fn from_block(block: Arc<BlockRef>, len: usize) -> Result<Self> {
        let bytes = bytes_for::<T>("buffer view", len)?;
        if bytes > block.size {
            return Err(Error::OutOfRange {
                what: "buffer view of a block",
                start: 0,
                end: bytes,
                len: block.size,
            });
        }
        Ok(Self {
            block,
            len,
            _t: PhantomData,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes of the elements (not of the rounded block).
    pub fn bytes(&self) -> usize {
        // Cannot overflow: checked when the buffer was made (see the type's invariant).
        self.len * std::mem::size_of::<T>()
    }

    /// Device address of element 0.
    pub fn addr(&self) -> u64 {
        self.block.addr
    }

    /// The pool the block came from.
    pub fn pool(&self) -> PoolId {
        self.block.pool
    }

    /// The shared block, for graph keep-alive and for CUDA libraries called on raw pointers.
    pub fn block(&self) -> &Arc<BlockRef> {
        &self.block
    }

    /// Another handle to the same device memory (it stays allocated while any handle, or a
    /// graph that uses it, is alive). Device memory is not Rust memory, so aliasing is sound;
    /// ordering reads and writes is up to the streams, as for every device buffer.
    pub fn alias(&self) -> DeviceBuffer<T> {
        Self {
            block: self.block.clone(),
            len: self.len,
            _t: PhantomData,
        }
    }

    /// A handle to the first `len` elements (`len` at most `self.len()`), sharing the memory.
    pub fn prefix(&self, len: usize) -> Result<DeviceBuffer<T>> {
        if len > self.len {
            return Err(Error::OutOfRange {
                what: "buffer prefix",
                start: 0,
                end: len,
                len: self.len,
            });
        }
        Ok(Self {
            block: self.block.clone(),
            len,
            _t: PhantomData,
        })
    }

    /// Device address of element `offset` (`offset` at most `len`: one past the end is allowed,
    /// as for slices).
    pub fn addr_at(&self, offset: usize) -> Result<u64> {
        if offset > self.len {
            return Err(Error::OutOfRange {
                what: "buffer offset",
                start: offset,
                end: offset,
                len: self.len,
            });
        }
        // Cannot overflow: offset <= len and len * size fits (the type's invariant).
        Ok(self.block.addr + (offset * std::mem::size_of::<T>()) as u64)
    }
}

const MB: f64 = 1024.0 * 1024.0;

/// Seed-000 style one-line log: `memory allocated 315.6 MB, cached 3292.0 MB`.
pub fn format_memory_line(s: &MemoryStats) -> String {
    format!(
        "memory allocated {:.1} MB, cached {:.1} MB",
        s.allocated as f64 / MB,
        s.reserved as f64 / MB
    )
}

/// Seed-000 style full line with peaks:
/// `memory_allocated 315.6 MB, max_memory_allocated 2892.0 MB, memory_cached 3292.0 MB, max_memory_cached 3292.0 MB`.
pub fn format_memory_full(s: &MemoryStats) -> String {
    format!(
        "memory_allocated {:.1} MB, max_memory_allocated {:.1} MB, memory_cached {:.1} MB, max_memory_cached {:.1} MB",
        s.allocated as f64 / MB,
        s.peak_allocated as f64 / MB,
        s.reserved as f64 / MB,
        s.peak_reserved as f64 / MB
    )
}

impl fmt::Display for MemoryStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_memory_full(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_allocator() -> Arc<Allocator> {
        // SAFETY: host memory for CPU tests; no block of it is passed to device work.
        unsafe { Allocator::new(Box::new(HostSource::new()), 0) }
    }

    #[test]
    fn pool_membership_needs_the_same_allocator() {
        let (a, b) = (host_allocator(), host_allocator());
        let (pa, pb) = (Pool::new(&a, None), Pool::new(&b, None));
        assert_eq!(pa.id(), pb.id(), "ids restart in every allocator");
        // As a capture allocates (`allocate_block` refuses graph pools).
        let block = BlockRef::from_allocation(
            &a,
            unsafe { a.allocate_raw(1024, pa.id(), 0) }.unwrap(),
            0,
            1,
        );
        assert!(block.is_in(&pa));
        assert!(
            !block.is_in(&pb),
            "same id, other allocator: not the same pool"
        );
    }

    #[test]
    fn graph_pools_hand_out_no_blocks_outside_captures() {
        let a = host_allocator();
        let pool = Pool::new(&a, None);
        let before = a.stats();
        assert!(matches!(
            unsafe { a.allocate_block_raw(1024, pool.id(), 1, 0) },
            Err(Error::InvalidGraph { .. })
        ));
        assert_eq!(a.stats(), before, "a refused request allocates nothing");
        // The default pool still works, and the pool is usable by captures afterwards.
        let eager = unsafe { a.allocate_block_raw(1024, PoolId::DEFAULT, 1, 0) }.unwrap();
        assert_eq!(eager.pool(), PoolId::DEFAULT);
        let captured = unsafe { a.allocate_raw(1024, pool.id(), 0) }.unwrap();
        assert_eq!(captured.pool, pool.id());
        // SAFETY: a raw allocation of this test, freed once, used by nothing else.
        unsafe { a.free(captured.addr) };
        a.check_invariants().unwrap();
    }

    #[test]
    fn blocks_of_allocators_made_outside_a_device_are_not_device_memory() {
        let a = host_allocator();
        assert!(!a.is_device_allocator());
        let block = unsafe { a.allocate_block_raw(1024, PoolId::DEFAULT, 1, 0) }.unwrap();
        assert_eq!(block.device_ordinal(), 0);
        assert!(
            !block.is_device_memory(),
            "a host allocator's block claims no device (every queue refuses it)"
        );
    }

    #[test]
    fn buffer_views_are_checked_against_the_block() {
        let a = host_allocator();
        let block = BlockRef::from_allocation(
            &a,
            unsafe { a.allocate_raw(1000, PoolId::DEFAULT, 1) }.unwrap(),
            1,
            0,
        );
        assert_eq!(block.size(), 1024);
        // 256 f32 fill the 1024-byte block; 257 do not.
        let buf = DeviceBuffer::<f32>::from_block(block.clone(), 256).unwrap();
        assert!(matches!(
            DeviceBuffer::<f32>::from_block(block.clone(), 257),
            Err(Error::OutOfRange { .. })
        ));
        // A count whose byte size overflows is a typed error, not a wrapped length.
        assert!(matches!(
            DeviceBuffer::<f32>::from_block(block.clone(), usize::MAX / 4 + 2),
            Err(Error::SizeOverflow { .. })
        ));
        assert!(matches!(
            bytes_for::<f64>("x", usize::MAX / 8 + 1),
            Err(Error::SizeOverflow { count, elem_size: 8, .. }) if count == usize::MAX / 8 + 1
        ));
        assert_eq!(buf.addr_at(256).unwrap(), buf.addr() + 1024);
        assert!(matches!(buf.addr_at(257), Err(Error::OutOfRange { .. })));
        assert!(matches!(
            buf.addr_at(usize::MAX),
            Err(Error::OutOfRange { .. })
        ));
        assert!(buf.prefix(257).is_err());
        assert_eq!(buf.prefix(3).unwrap().bytes(), 12);
    }

    #[test]
    fn a_block_used_on_another_stream_waits_for_its_fence() {
        use std::sync::atomic::{AtomicBool, Ordering};
        struct Flag(Arc<AtomicBool>);
        impl Fence for Flag {
            fn is_complete(&self) -> bool {
                self.0.load(Ordering::SeqCst)
            }
        }
        let a = host_allocator();
        let first = unsafe { a.allocate_raw(4096, PoolId::DEFAULT, 1) }.unwrap();
        let done = Arc::new(AtomicBool::new(false));
        // SAFETY: `first` is a raw allocation nothing else refers to.
        unsafe { a.free_after(first.addr, vec![Box::new(Flag(done.clone()))]) };
        let second = unsafe { a.allocate_raw(4096, PoolId::DEFAULT, 1) }.unwrap();
        assert_ne!(
            second.addr, first.addr,
            "reissued while foreign work is pending"
        );
        done.store(true, Ordering::SeqCst);
        let third = unsafe { a.allocate_raw(4096, PoolId::DEFAULT, 1) }.unwrap();
        assert_eq!(third.addr, first.addr, "reusable once the fence completed");
        // SAFETY: raw allocations nothing else refers to, freed once.
        unsafe {
            a.free(second.addr);
            a.free(third.addr);
        }
        a.check_invariants().unwrap();
    }
}
