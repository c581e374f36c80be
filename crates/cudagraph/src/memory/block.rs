//! [`BlockRef`]: one block of device memory shared by the buffers that view it and the graphs
//! that baked its address in, given back when the last holder drops — behind fences when other
//! streams used it. Also the blocks kept for the rest of the process (work a capture recorded
//! without knowing them) and external memory whose release had to be deferred. Typed views of
//! a block are in `buffer.rs`; the allocator that hands blocks out is in `allocator.rs`.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::allocator::{refuse_graph_pool, Allocator};
use super::caching::{Allocation, Fence};
use super::pool::Pool;
use crate::error::Result;
use crate::ids::PoolId;
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

    /// Device address of the block's first byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Bytes of the block (its rounded size).
    pub fn size(&self) -> usize {
        self.size
    }
    /// The pool the block came from (the default pool for external memory).
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

impl Allocator {
    /// Allocates a shared block of the default pool, stream-ordered on `stream` (see
    /// [`Self::allocate`]), that frees itself when its last holder drops. For library state
    /// such as workspaces; model code allocates with `Queue::alloc`.
    #[track_caller]
    pub fn allocate_block(
        self: &Arc<Self>,
        bytes: usize,
        stream: StreamRef<'_>,
    ) -> Result<Arc<BlockRef>> {
        self.check_stream(stream)?;
        // SAFETY: the id is a real stream's (a `StreamRef`); the default pool.
        unsafe { self.allocate_block_raw(bytes, PoolId::DEFAULT, stream.id(), 0) }
    }

    /// [`Self::allocate_block`] by raw stream id, inside capture `capture` (0 when eager):
    /// for the crate's queues and CPU tests. Graph pools are refused as by
    /// [`Self::allocate`].
    ///
    /// # Safety
    /// As for [`Self::allocate_raw`]: `stream` is the id of the stream every use of the block
    /// is ordered on, the block's reuse being ordered by that stream.
    pub unsafe fn allocate_block_raw(
        self: &Arc<Self>,
        bytes: usize,
        pool: PoolId,
        stream: u64,
        capture: u64,
    ) -> Result<Arc<BlockRef>> {
        refuse_graph_pool(pool)?;
        // SAFETY: the caller's promise; graph pools were refused.
        let a = unsafe { self.allocate_raw(bytes, pool, stream) }?;
        Ok(BlockRef::from_allocation(self, a, stream, capture))
    }
}
