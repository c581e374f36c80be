//! The caching allocator's bookkeeping, independent of where segments come from.
//!
//! Segments (large regions from a [`SegmentSource`]) are split into blocks. A freed block goes
//! back to a free set keyed by (pool, stream, size class) and merges with free neighbours in its
//! segment. Reuse is stream-ordered: a block freed by work on stream S is handed out again only
//! to allocations on S, which the stream orders after the earlier use. A block that other
//! streams used too is freed behind [`Fence`]s ([`AllocatorCore::free_after`]): it stays
//! allocated, on a pending list, until every fence has completed. Graph pools ignore the
//! stream: their blocks are only ever used by captures into that pool, and graphs in one pool
//! replay in capture order (the pool contract, see [`crate::memory::Pool`]).
//!
//! Size classes follow PyTorch: requests round up to 512 bytes; requests up to 1 MiB are small
//! and come from 2 MiB segments; larger ones come from 20 MiB segments, or from a segment of
//! their own (rounded to 2 MiB) above 10 MiB. Small and large blocks never share a segment.
//! Every rounding and every sum of sizes is checked: a request too large to round or to fit a
//! limit fails with [`Error::SizeOverflow`] or [`Error::PoolLimitExceeded`], never wraps.
//!
//! Calls into the source are slow (cuMemAlloc, cuMemFree, cuCtxSynchronize), so the core works
//! in phases that the thread-safe [`crate::memory::Allocator`] runs with its lock released
//! around each source call: [`AllocatorCore::begin_allocate`] either serves the request or
//! returns a [`GrowPlan`] whose bytes are reserved against the pool's limit, finished by
//! [`AllocatorCore::finish_grow`]; segments to give back are detached into a [`ReleasePlan`]
//! (`begin_*`), executed with [`ReleasePlan::execute`] and settled by
//! [`AllocatorCore::finish_release`]. The synchronous methods ([`AllocatorCore::allocate`],
//! [`AllocatorCore::free`], [`AllocatorCore::release_free_segments`], ...) run the same phases
//! back to back.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};
pub use crate::ids::PoolId;

pub(crate) const ROUND: usize = 512;
pub(crate) const SMALL_MAX: usize = 1 << 20;
pub(crate) const SMALL_SEGMENT: usize = 2 << 20;
pub(crate) const LARGE_SEGMENT: usize = 20 << 20;
pub(crate) const LARGE_ROUND: usize = 2 << 20;
pub(crate) const LARGE_SHARED_MAX: usize = 10 << 20;

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

/// Memory counters of a pool, or of the whole device. Bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in blocks handed out and not yet freed (rounded sizes), pending blocks included.
    pub allocated: usize,
    /// Bytes in segments obtained from the driver (allocated + cached).
    pub reserved: usize,
    /// Largest `allocated` since creation or the last `reset_peak`.
    pub peak_allocated: usize,
    /// Largest `reserved` since creation or the last `reset_peak`.
    pub peak_reserved: usize,
    /// Blocks currently handed out (pending blocks included).
    pub active_blocks: usize,
    /// Freed blocks still waiting for fences ([`AllocatorCore::free_after`]) before reuse.
    pub pending_blocks: usize,
    /// Segments currently held.
    pub segments: usize,
    /// Allocation requests served since creation.
    pub allocations: u64,
    /// Segment allocations from the source since creation.
    pub segment_allocations: u64,
}

// The counters add and subtract sizes of memory that really exists, so no sum can exceed the
// address space; they saturate rather than wrap or panic should the bookkeeping ever be wrong
// (`check_invariants` would then report it).
impl MemoryStats {
    fn on_alloc(&mut self, size: usize) {
        self.allocated = self.allocated.saturating_add(size);
        self.active_blocks = self.active_blocks.saturating_add(1);
        self.allocations = self.allocations.saturating_add(1);
        self.peak_allocated = self.peak_allocated.max(self.allocated);
    }

    fn on_free(&mut self, size: usize) {
        self.allocated = self.allocated.saturating_sub(size);
        self.active_blocks = self.active_blocks.saturating_sub(1);
    }

    fn on_segment(&mut self, size: usize) {
        self.reserved = self.reserved.saturating_add(size);
        self.segments = self.segments.saturating_add(1);
        self.segment_allocations = self.segment_allocations.saturating_add(1);
        self.peak_reserved = self.peak_reserved.max(self.reserved);
    }

    fn on_segment_release(&mut self, size: usize) {
        self.reserved = self.reserved.saturating_sub(size);
        self.segments = self.segments.saturating_sub(1);
    }

    /// Bytes held in segments but not handed out.
    pub fn cached(&self) -> usize {
        self.reserved.saturating_sub(self.allocated)
    }

    fn reset_peak(&mut self) {
        self.peak_allocated = self.allocated;
        self.peak_reserved = self.reserved;
    }

    /// Forgets every live block and segment (teardown); peaks and totals stay.
    fn clear_live(&mut self) {
        self.allocated = 0;
        self.reserved = 0;
        self.active_blocks = 0;
        self.pending_blocks = 0;
        self.segments = 0;
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Class {
    Small,
    Large,
}

fn overflow(bytes: usize) -> Error {
    Error::SizeOverflow {
        what: "allocation",
        count: bytes,
        elem_size: 1,
    }
}

/// Rounded request size and its class.
fn classify(bytes: usize) -> Result<(usize, Class)> {
    let size = bytes
        .max(1)
        .checked_next_multiple_of(ROUND)
        .ok_or_else(|| overflow(bytes))?;
    Ok(if size <= SMALL_MAX {
        (size, Class::Small)
    } else {
        (size, Class::Large)
    })
}

/// The smallest segment that can hold a rounded request of `size` bytes.
fn tight_segment(size: usize, class: Class, bytes: usize) -> Result<usize> {
    match class {
        Class::Small => Ok(SMALL_SEGMENT),
        Class::Large => size
            .checked_next_multiple_of(LARGE_ROUND)
            .ok_or_else(|| overflow(bytes)),
    }
}

/// Segment size for a rounded request (`bytes` is the request, for the error).
fn segment_size(size: usize, class: Class, bytes: usize) -> Result<usize> {
    match class {
        Class::Large if size <= LARGE_SHARED_MAX => Ok(LARGE_SEGMENT),
        _ => tight_segment(size, class, bytes),
    }
}

/// Whether `used + extra` bytes stay within `limit` (an overflowing sum does not).
fn fits(used: usize, extra: usize, limit: usize) -> bool {
    used.checked_add(extra).is_some_and(|total| total <= limit)
}

/// Whether a free remainder of `rest` bytes is worth splitting off.
fn should_split(rest: usize, class: Class) -> bool {
    match class {
        Class::Small => rest >= ROUND,
        Class::Large => rest > SMALL_MAX,
    }
}

#[derive(Debug)]
struct Segment {
    /// Unique among the segments this core ever held: an address can come back from the
    /// source for a new segment while a release plan still names the old one.
    id: u64,
    size: usize,
    pool: PoolId,
    stream: u64,
    class: Class,
    /// Detached into a release plan: out of the free set, on its way back to the source.
    releasing: bool,
}

#[derive(Debug)]
struct Block {
    size: usize,
    segment: u64,
    allocated: bool,
}

/// (pool, stream, class, size, addr): ordered so a range query finds the best fit.
type FreeKey = (PoolId, u64, Class, usize, u64);

#[derive(Debug, Default)]
struct PoolState {
    limit: Option<usize>,
    stats: MemoryStats,
    /// Bytes of segments being obtained for this pool (grow plans in flight); they count
    /// against the limit until they arrive or the plan is cancelled.
    growing: usize,
    /// Graphs that replay from this pool: its segments must stay mapped while any exist.
    graphs: usize,
    /// The pool's handle was dropped: release segments as soon as they are empty.
    closed: bool,
    /// An open capture window: (allocated at its start, peak allocated in it).
    window: Option<(usize, usize)>,
}

/// What a finished capture window measured in a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowStats {
    /// Peak of (allocated − allocated at start) while the window was open.
    pub peak_allocated: usize,
    /// Bytes allocated in the window still allocated at its end (outputs kept by the user).
    pub live_at_end: usize,
}

/// A block handed out by [`AllocatorCore::allocate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Address of the block's first byte.
    pub addr: u64,
    /// Rounded size actually reserved for it.
    pub size: usize,
    /// The pool it came from.
    pub pool: PoolId,
}

/// Segments detached from the bookkeeping, to be given back to the source with no lock held:
/// [`ReleasePlan::execute`], then [`AllocatorCore::finish_release`].
///
/// While a non-empty plan is unfinished the allocator counts a release in flight (see
/// [`AllocatorCore::releases_in_flight`]); its segments are reserved but unusable. A plan that
/// is finished without being executed puts its segments back in the cache.
#[derive(Debug, Default)]
#[must_use = "a release plan must be finished with AllocatorCore::finish_release"]
pub struct ReleasePlan {
    segments: Vec<Detached>,
    error: Option<Error>,
    /// Counted in `releases_in_flight`.
    counted: bool,
    /// The source did not allow releasing when the plan ran ([`SegmentSource::exclusive`]):
    /// nothing was released, and the segments go back to the cache (closed pools' ones to
    /// the queue that later frees retry).
    deferred: bool,
    /// Releasing is what makes room for an allocation (a bounded pool's grow): a deferred
    /// plan is then an error.
    required: bool,
    /// From `teardown`: the bookkeeping already forgot these segments.
    forgotten: bool,
}

#[derive(Debug)]
struct Detached {
    base: u64,
    /// The segment's [`Segment::id`] when detached.
    id: u64,
    size: usize,
    released: bool,
}

impl ReleasePlan {
    /// Whether there is nothing to release.
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }

    /// (address, bytes) of every segment in the plan.
    pub fn segments(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.segments.iter().map(|d| (d.base, d.size))
    }

    /// Bytes in the plan.
    pub fn bytes(&self) -> usize {
        self.segments
            .iter()
            .fold(0usize, |sum, d| sum.saturating_add(d.size))
    }

    /// Whether the source deferred this plan (see [`SegmentSource::exclusive`]).
    pub fn was_deferred(&self) -> bool {
        self.deferred
    }

    /// Synchronises `source` once, then releases every segment; call it with no lock held.
    /// Failures are recorded and reported by [`AllocatorCore::finish_release`]: after a
    /// failed synchronisation nothing is released (queued work may still use the memory).
    /// When the source does not allow releasing now, nothing is released and the plan is
    /// marked deferred (the teardown's plan waits until it may).
    pub fn execute(&mut self, source: &dyn SegmentSource) {
        if self.segments.is_empty() {
            return;
        }
        let (segments, error) = (&mut self.segments, &mut self.error);
        let ran = source.exclusive(self.forgotten, &mut || {
            if let Err(e) = source.synchronize() {
                *error = Some(e);
                return;
            }
            for d in segments.iter_mut().filter(|d| !d.released) {
                match source.release(d.base, d.size) {
                    Ok(()) => d.released = true,
                    Err(e) => {
                        error.get_or_insert(e);
                    }
                }
            }
        });
        if !ran {
            self.deferred = true;
            if self.required {
                self.error = Some(Error::NotSupported {
                    what: "growing a bounded pool",
                    detail: "its cached segments had to be released to make room, and a \
                             capture of this device began on another thread meanwhile \
                             (releasing would have invalidated it); retry the allocation"
                        .into(),
                });
            }
        }
    }
}

/// A new segment to obtain for an allocation that missed the cache: reserved against the
/// pool's limit from [`AllocatorCore::begin_allocate`] until [`AllocatorCore::finish_grow`]
/// (or [`AllocatorCore::cancel_grow`]).
#[derive(Debug)]
#[must_use = "a grow plan must be finished with AllocatorCore::finish_grow or cancel_grow"]
pub struct GrowPlan {
    pool: PoolId,
    stream: u64,
    class: Class,
    /// Rounded request.
    size: usize,
    segment: usize,
    /// The pool's own free segments, to give back before asking for the new one.
    release: ReleasePlan,
}

impl GrowPlan {
    /// Bytes to ask the source for.
    pub fn segment_bytes(&self) -> usize {
        self.segment
    }

    /// The pool that grows.
    pub fn pool(&self) -> PoolId {
        self.pool
    }

    /// The segments (of a bounded pool) to release before the new segment is asked for;
    /// leaves an empty plan behind. Execute and finish it like any release plan.
    pub fn take_release(&mut self) -> ReleasePlan {
        let mut plan = std::mem::take(&mut self.release);
        plan.required = true;
        plan
    }
}

/// What [`AllocatorCore::begin_allocate`] decided.
#[derive(Debug)]
#[must_use]
pub enum AllocStep {
    /// Served from the cache.
    Ready(Allocation),
    /// A new segment is needed first.
    Grow(GrowPlan),
}

/// The allocator state machine. Not thread-safe; [`super::Allocator`] wraps it in a mutex and
/// runs its phases with the mutex released around every call into the source.
pub struct AllocatorCore {
    source: Arc<dyn SegmentSource>,
    segments: BTreeMap<u64, Segment>,
    blocks: BTreeMap<u64, Block>,
    free: BTreeSet<FreeKey>,
    pools: BTreeMap<PoolId, PoolState>,
    device: MemoryStats,
    next_pool: u64,
    /// Capture windows open in any pool: segments are never released meanwhile, since that
    /// needs a device synchronisation, which would invalidate the capture.
    captures_open: usize,
    /// Blocks freed behind fences, by address: still allocated until every fence completes.
    pending: BTreeMap<u64, Vec<Box<dyn Fence>>>,
    /// Fully free segments of closed pools, to release at the next opportunity.
    closed_free: BTreeSet<u64>,
    /// Release plans handed out and not yet finished.
    releases_in_flight: usize,
    /// Id of the next segment.
    next_segment: u64,
}

impl fmt::Debug for AllocatorCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AllocatorCore")
            .field("segments", &self.segments.len())
            .field("blocks", &self.blocks.len())
            .field("pending", &self.pending.len())
            .field("device", &self.device)
            .finish()
    }
}

/// How the allocation and release protocols reach the core: directly (the synchronous
/// methods of [`AllocatorCore`]) or by taking the wrapper's lock for each step.
pub(crate) trait CoreAccess {
    fn with<R>(&mut self, f: impl FnOnce(&mut AllocatorCore) -> R) -> R;
}

impl CoreAccess for AllocatorCore {
    fn with<R>(&mut self, f: impl FnOnce(&mut AllocatorCore) -> R) -> R {
        f(self)
    }
}

/// Finishes a release plan even if the source panics, so a release is never left in flight
/// (which would keep `open_window` waiting forever).
struct ReleaseGuard<'a, A: CoreAccess> {
    access: &'a mut A,
    plan: ReleasePlan,
}

impl<A: CoreAccess> Drop for ReleaseGuard<'_, A> {
    fn drop(&mut self) {
        let plan = std::mem::take(&mut self.plan);
        if !plan.is_empty() {
            let _ = self.access.with(|c| c.finish_release(plan));
        }
    }
}

/// Runs a release plan: source calls outside `access`, bookkeeping inside. Returns the bytes
/// released.
pub(crate) fn release_via<A: CoreAccess>(
    access: &mut A,
    source: &dyn SegmentSource,
    plan: ReleasePlan,
) -> Result<usize> {
    if plan.is_empty() {
        return Ok(0);
    }
    let mut guard = ReleaseGuard { access, plan };
    guard.plan.execute(source);
    let plan = std::mem::take(&mut guard.plan);
    guard.access.with(|c| c.finish_release(plan))
}

/// Cancels a grow plan unless it was finished (also when the source panics).
struct GrowGuard<'a, A: CoreAccess> {
    access: &'a mut A,
    plan: Option<GrowPlan>,
}

impl<A: CoreAccess> Drop for GrowGuard<'_, A> {
    fn drop(&mut self) {
        if let Some(plan) = self.plan.take() {
            self.access.with(|c| c.cancel_grow(plan));
        }
    }
}

/// The allocation protocol: decide under `access`, call the source outside it, commit under
/// it. A miss in a bounded pool may first release the pool's own free segments; out of memory
/// releases every releasable free segment and retries once, as PyTorch does.
pub(crate) fn allocate_via<A: CoreAccess>(
    access: &mut A,
    source: &dyn SegmentSource,
    bytes: usize,
    pool: PoolId,
    stream: u64,
) -> Result<Allocation> {
    let mut plan = match access.with(|c| c.begin_allocate(bytes, pool, stream))? {
        AllocStep::Ready(a) => return Ok(a),
        AllocStep::Grow(plan) => plan,
    };
    let release = plan.take_release();
    let seg_bytes = plan.segment_bytes();
    let mut guard = GrowGuard {
        access,
        plan: Some(plan),
    };
    release_via(guard.access, source, release)?;
    let segment = match source.allocate(seg_bytes) {
        Err(e) if e.is_out_of_memory() => {
            let release = guard.access.with(|c| c.begin_release(None));
            release_via(guard.access, source, release)?;
            source.allocate(seg_bytes)
        }
        other => other,
    };
    match guard.plan.take() {
        Some(plan) => guard.access.with(|c| c.finish_grow(plan, segment)),
        None => Err(Error::InvalidGraph {
            problem: "allocation plan lost".into(),
        }),
    }
}

impl AllocatorCore {
    /// A core over `source`, with the default pool and nothing allocated.
    pub fn new(source: Box<dyn SegmentSource>) -> Self {
        let mut pools = BTreeMap::new();
        pools.insert(PoolId::DEFAULT, PoolState::default());
        Self {
            source: Arc::from(source),
            segments: BTreeMap::new(),
            blocks: BTreeMap::new(),
            free: BTreeSet::new(),
            pools,
            device: MemoryStats::default(),
            next_pool: 1,
            captures_open: 0,
            pending: BTreeMap::new(),
            closed_free: BTreeSet::new(),
            releases_in_flight: 0,
            next_segment: 0,
        }
    }

    /// The segment source, for running plans without holding the core.
    pub fn source(&self) -> &Arc<dyn SegmentSource> {
        &self.source
    }

    /// Creates a graph pool, optionally bounded to `limit` reserved bytes.
    pub fn create_pool(&mut self, limit: Option<usize>) -> PoolId {
        let id = PoolId(self.next_pool);
        self.next_pool += 1;
        self.pools.insert(
            id,
            PoolState {
                limit,
                ..Default::default()
            },
        );
        id
    }

    /// Sets or clears a pool's byte limit. Memory already reserved is not given back.
    pub fn set_limit(&mut self, pool: PoolId, limit: Option<usize>) {
        if let Some(p) = self.pools.get_mut(&pool) {
            p.limit = limit;
        }
    }

    /// A pool's byte limit, if it has one.
    pub fn limit(&self, pool: PoolId) -> Option<usize> {
        self.pools.get(&pool).and_then(|p| p.limit)
    }

    /// Counters of one pool (zeros for a pool that no longer exists).
    pub fn pool_stats(&self, pool: PoolId) -> MemoryStats {
        self.pools.get(&pool).map(|p| p.stats).unwrap_or_default()
    }

    /// Counters of the whole device (every pool).
    pub fn device_stats(&self) -> MemoryStats {
        self.device
    }

    /// Ids of pools that still exist (open, or holding memory).
    pub fn pool_ids(&self) -> Vec<PoolId> {
        self.pools.keys().copied().collect()
    }

    /// Release plans handed out and not yet finished. A capture must not begin while this is
    /// non-zero (the wrapper's `open_window` waits for it to drop to zero).
    pub fn releases_in_flight(&self) -> usize {
        self.releases_in_flight
    }

    /// Resets peak counters of every pool and the device to the current values.
    pub fn reset_peak(&mut self) {
        self.device.reset_peak();
        for p in self.pools.values_mut() {
            p.stats.reset_peak();
        }
    }

    // ----- allocation -------------------------------------------------------------------

    /// Hands out a block of at least `bytes` bytes from `pool`, ordered on `stream`
    /// (synchronous: calls the source directly when the cache misses).
    pub fn allocate(&mut self, bytes: usize, pool: PoolId, stream: u64) -> Result<Allocation> {
        let source = self.source.clone();
        allocate_via(self, &*source, bytes, pool, stream)
    }

    /// Decide phase of an allocation: frees pending blocks whose fences completed, then serves
    /// the request from the cache, or plans a new segment (reserving its bytes against the
    /// pool's limit). Never calls the source.
    pub fn begin_allocate(&mut self, bytes: usize, pool: PoolId, stream: u64) -> Result<AllocStep> {
        self.poll_pending();
        let state = self.pools.get(&pool).ok_or_else(|| Error::InvalidGraph {
            problem: format!("{pool} no longer exists"),
        })?;
        if state.closed {
            return Err(Error::InvalidGraph {
                problem: format!("{pool} was closed (its last handle was dropped)"),
            });
        }
        let stream = if pool == PoolId::DEFAULT { stream } else { 0 };
        let (size, class) = classify(bytes)?;
        if let Some(addr) = self.best_fit(pool, stream, class, size) {
            return Ok(AllocStep::Ready(self.hand_out(addr, size, class, pool)));
        }
        self.plan_grow(bytes, pool, stream, class, size)
            .map(AllocStep::Grow)
    }

    fn best_fit(&self, pool: PoolId, stream: u64, class: Class, size: usize) -> Option<u64> {
        self.free
            .range((pool, stream, class, size, 0)..=(pool, stream, class, usize::MAX, u64::MAX))
            .next()
            .map(|k| k.4)
    }

    /// Takes the free block at `addr` for a request of `size` and counts it.
    fn hand_out(&mut self, addr: u64, size: usize, class: Class, pool: PoolId) -> Allocation {
        // An unsplit remainder stays part of the block, so count the block's real size.
        let size = self.take(addr, size, class);
        if let Some(state) = self.pools.get_mut(&pool) {
            state.stats.on_alloc(size);
            if let Some((start, peak)) = state.window.as_mut() {
                *peak = (*peak).max(state.stats.allocated.saturating_sub(*start));
            }
        }
        self.device.on_alloc(size);
        Allocation { addr, size, pool }
    }

    /// Marks the free block at `addr` allocated for `size` bytes, splitting off the rest when
    /// worth it. Returns the block's final size.
    fn take(&mut self, addr: u64, size: usize, class: Class) -> usize {
        let (seg_base, block_size) = {
            let b = &self.blocks[&addr];
            (b.segment, b.size)
        };
        let seg = &self.segments[&seg_base];
        let key = (seg.pool, seg.stream, seg.class, block_size, addr);
        let removed = self.free.remove(&key);
        debug_assert!(removed, "free block missing from the free set");
        // `size <= block_size`: the block came from a best-fit query or is a fresh segment.
        let rest = block_size - size;
        let b = self.blocks.get_mut(&addr).expect("block exists");
        b.allocated = true;
        if should_split(rest, class) {
            b.size = size;
            // Inside the segment, which is a real region of memory: cannot overflow.
            let rest_addr = addr + size as u64;
            self.blocks.insert(
                rest_addr,
                Block {
                    size: rest,
                    segment: seg_base,
                    allocated: false,
                },
            );
            self.free
                .insert((seg.pool, seg.stream, seg.class, rest, rest_addr));
            size
        } else {
            block_size
        }
    }

    /// Plans a new segment for (pool, stream, class) able to hold `size`.
    fn plan_grow(
        &mut self,
        bytes: usize,
        pool: PoolId,
        stream: u64,
        class: Class,
        size: usize,
    ) -> Result<GrowPlan> {
        let mut segment = segment_size(size, class, bytes)?;
        // begin_allocate checked the pool; a vanished one is an error, not a panic.
        let Some(state) = self.pools.get(&pool) else {
            return Err(Error::InvalidGraph {
                problem: format!("{pool} no longer exists"),
            });
        };
        let (limit, graphs) = (state.limit, state.graphs);
        let committed = state.stats.reserved.saturating_add(state.growing);
        let mut release = ReleasePlan::default();
        if let Some(limit) = limit {
            if !fits(committed, segment, limit) {
                // Within a bounded pool, prefer a tight segment over failing, and giving the
                // pool's own cached segments back over failing.
                // Segments stay multiples of 2 MiB (so blocks stay 512-byte aligned whatever
                // the limit); `tight` is one, so rounding the room down keeps it >= tight.
                let tight = tight_segment(size, class, bytes)?;
                let room = limit.saturating_sub(committed);
                if tight <= room {
                    segment = segment.min(room - room % LARGE_ROUND);
                } else {
                    let givable = if graphs == 0 && self.may_release() {
                        self.whole_free_segments(Some(pool))
                    } else {
                        Vec::new()
                    };
                    let give = givable
                        .iter()
                        .fold(0usize, |s, b| s.saturating_add(self.segments[b].size));
                    let kept = committed.saturating_sub(give);
                    let room = limit.saturating_sub(kept);
                    if tight > room {
                        return Err(Error::PoolLimitExceeded {
                            pool,
                            limit,
                            reserved: kept,
                            requested: tight,
                        });
                    }
                    segment = segment.min(room - room % LARGE_ROUND);
                    release = self.detach(givable);
                }
            }
        }
        if let Some(s) = self.pools.get_mut(&pool) {
            s.growing = s.growing.saturating_add(segment);
        }
        Ok(GrowPlan {
            pool,
            stream,
            class,
            size,
            segment,
            release,
        })
    }

    /// Commit phase of a grow: `segment` is what the source returned for
    /// [`GrowPlan::segment_bytes`]. Takes the block from the new segment, or, on error, undoes
    /// the plan and reports the error (out of memory as [`Error::OutOfMemory`]).
    pub fn finish_grow(&mut self, plan: GrowPlan, segment: Result<u64>) -> Result<Allocation> {
        let (pool, stream, class, size, seg_size) =
            (plan.pool, plan.stream, plan.class, plan.size, plan.segment);
        let addr = match segment {
            Ok(addr) => addr,
            Err(e) => {
                self.cancel_grow(plan);
                return Err(match e.is_out_of_memory() {
                    true => Error::OutOfMemory {
                        requested: seg_size,
                        reserved: self.device.reserved,
                    },
                    false => e,
                });
            }
        };
        if !plan.release.is_empty() {
            let _ = self.finish_release(plan.release);
        }
        self.settle_reused(addr);
        let id = self.next_segment;
        self.next_segment = self.next_segment.wrapping_add(1);
        self.segments.insert(
            addr,
            Segment {
                id,
                size: seg_size,
                pool,
                stream,
                class,
                releasing: false,
            },
        );
        self.blocks.insert(
            addr,
            Block {
                size: seg_size,
                segment: addr,
                allocated: false,
            },
        );
        self.free.insert((pool, stream, class, seg_size, addr));
        if let Some(p) = self.pools.get_mut(&pool) {
            p.growing = p.growing.saturating_sub(seg_size);
            p.stats.on_segment(seg_size);
        }
        self.device.on_segment(seg_size);
        Ok(self.hand_out(addr, size, class, pool))
    }

    /// The source handed out `addr` for a new segment while the bookkeeping still holds a
    /// segment there: one detached into a release plan that another thread has carried out
    /// (the source could not reuse the address otherwise) and not finished yet. Its release is
    /// settled here, so the new segment replaces nothing; that plan then finds the id changed
    /// and only counts the bytes.
    fn settle_reused(&mut self, addr: u64) {
        let Some(old) = self.segments.remove(&addr) else {
            return;
        };
        debug_assert!(
            old.releasing,
            "the source returned a live segment's address"
        );
        // A releasing segment is one free block at its base, out of the free set.
        self.blocks.remove(&addr);
        self.free
            .remove(&(old.pool, old.stream, old.class, old.size, addr));
        self.closed_free.remove(&addr);
        if let Some(p) = self.pools.get_mut(&old.pool) {
            p.stats.on_segment_release(old.size);
        }
        self.device.on_segment_release(old.size);
        self.forget_pool_if_empty(old.pool);
    }

    /// Abandons a grow plan: its bytes no longer count against the limit, and segments it
    /// detached but did not release go back to the cache.
    pub fn cancel_grow(&mut self, mut plan: GrowPlan) {
        let release = plan.take_release();
        if !release.is_empty() {
            let _ = self.finish_release(release);
        }
        if let Some(p) = self.pools.get_mut(&plan.pool) {
            p.growing = p.growing.saturating_sub(plan.segment);
        }
        self.forget_pool_if_empty(plan.pool);
    }

    // ----- freeing ----------------------------------------------------------------------

    /// Returns the block at `addr` to its pool, merging it with free neighbours (synchronous:
    /// a closed pool's segment that becomes empty is released at once).
    pub fn free(&mut self, addr: u64) {
        let plan = self.begin_free(addr);
        // Best effort: a segment that cannot be released stays cached and is counted.
        let _ = self.run_release(plan);
    }

    /// Frees the block at `addr` in the bookkeeping; returns the segments of closed pools that
    /// are now empty, for the caller to release with no lock held.
    pub fn begin_free(&mut self, addr: u64) -> ReleasePlan {
        self.free_block(addr);
        self.poll_pending();
        self.take_closed_plan()
    }

    /// Frees the block at `addr` once every fence has completed (it was used on streams other
    /// than its own; each fence follows that work). Until then it stays allocated and is
    /// counted in `pending_blocks`; it is freed at the first poll (allocation, free,
    /// `empty_cache`) that finds all its fences complete. No fences: the same as [`Self::free`].
    pub fn free_after(&mut self, addr: u64, fences: Vec<Box<dyn Fence>>) {
        let plan = self.begin_free_after(addr, fences);
        let _ = self.run_release(plan);
    }

    /// Bookkeeping of [`Self::free_after`]; returns what the caller must release.
    pub fn begin_free_after(&mut self, addr: u64, fences: Vec<Box<dyn Fence>>) -> ReleasePlan {
        if fences.is_empty() {
            return self.begin_free(addr);
        }
        let pool = match self.blocks.get(&addr) {
            Some(b) if b.allocated && !self.pending.contains_key(&addr) => {
                self.segments[&b.segment].pool
            }
            _ => {
                debug_assert!(false, "free_after of a block that is not live: {addr:#x}");
                return ReleasePlan::default();
            }
        };
        if let Some(p) = self.pools.get_mut(&pool) {
            p.stats.pending_blocks = p.stats.pending_blocks.saturating_add(1);
        }
        self.device.pending_blocks = self.device.pending_blocks.saturating_add(1);
        self.pending.insert(addr, fences);
        self.poll_pending();
        self.take_closed_plan()
    }

    /// Frees every pending block whose fences have all completed.
    fn poll_pending(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let ready: Vec<u64> = self
            .pending
            .iter_mut()
            .filter_map(|(&addr, fences)| {
                // Completed fences are dropped; stop at the first one still running.
                while fences.last().is_some_and(|f| f.is_complete()) {
                    fences.pop();
                }
                fences.is_empty().then_some(addr)
            })
            .collect();
        for addr in ready {
            self.pending.remove(&addr);
            let pool = self
                .blocks
                .get(&addr)
                .map(|b| self.segments[&b.segment].pool);
            if let Some(p) = pool.and_then(|pool| self.pools.get_mut(&pool)) {
                p.stats.pending_blocks = p.stats.pending_blocks.saturating_sub(1);
            }
            self.device.pending_blocks = self.device.pending_blocks.saturating_sub(1);
            self.free_block(addr);
        }
    }

    /// Marks the block free and merges it; queues its segment if a closed pool's segment
    /// became empty. Never calls the source.
    fn free_block(&mut self, addr: u64) {
        let Some(block) = self.blocks.get_mut(&addr) else {
            debug_assert!(false, "free of unknown block {addr:#x}");
            return;
        };
        if !block.allocated || self.pending.contains_key(&addr) {
            debug_assert!(false, "double free of block {addr:#x}");
            return;
        }
        block.allocated = false;
        let (mut start, mut size, seg_base) = (addr, block.size, block.segment);
        let (pool, stream, class, seg_size) = {
            let s = &self.segments[&seg_base];
            (s.pool, s.stream, s.class, s.size)
        };
        if let Some(state) = self.pools.get_mut(&pool) {
            state.stats.on_free(size);
        }
        self.device.on_free(size);

        // Merge with the next block, then with the previous one, inside the same segment.
        let next_addr = start + size as u64;
        if let Some(next) = self.blocks.get(&next_addr) {
            if next.segment == seg_base && !next.allocated {
                let n = next.size;
                self.free.remove(&(pool, stream, class, n, next_addr));
                self.blocks.remove(&next_addr);
                size += n;
            }
        }
        if let Some((&prev_addr, prev)) = self.blocks.range(..start).next_back() {
            if prev.segment == seg_base && !prev.allocated && prev_addr + prev.size as u64 == start
            {
                let p = prev.size;
                self.free.remove(&(pool, stream, class, p, prev_addr));
                self.blocks.remove(&start);
                start = prev_addr;
                size += p;
            }
        }
        let b = self.blocks.get_mut(&start).expect("merged block exists");
        b.size = size;
        self.free.insert((pool, stream, class, size, start));

        if size == seg_size
            && self
                .pools
                .get(&pool)
                .is_some_and(|p| p.closed && p.graphs == 0)
        {
            self.closed_free.insert(seg_base);
        }
    }

    // ----- releasing segments -----------------------------------------------------------

    /// Releases every fully free segment (of one pool, or of all pools) whose pool has no live
    /// graphs, unless a capture window is open. Returns the bytes released (synchronous).
    pub fn release_free_segments(&mut self, only: Option<PoolId>) -> Result<usize> {
        let plan = self.begin_release(only);
        self.run_release(plan)
    }

    /// Decide phase of [`Self::release_free_segments`]: frees pending blocks whose fences
    /// completed, then detaches the releasable segments (none while a capture window is open).
    pub fn begin_release(&mut self, only: Option<PoolId>) -> ReleasePlan {
        self.poll_pending();
        if !self.may_release() {
            return ReleasePlan::default();
        }
        let victims = self.whole_free_segments(only);
        self.detach(victims)
    }

    /// Commit phase of every release: forgets the segments the plan released, puts back in the
    /// cache those it did not, and reports the plan's first error. Returns the bytes released.
    pub fn finish_release(&mut self, plan: ReleasePlan) -> Result<usize> {
        let ReleasePlan {
            segments,
            error,
            counted,
            forgotten,
            deferred,
            required: _,
        } = plan;
        if counted {
            self.releases_in_flight = self.releases_in_flight.saturating_sub(1);
        }
        let mut released = 0usize;
        let mut touched = BTreeSet::new();
        for d in segments {
            if forgotten {
                if d.released {
                    released = released.saturating_add(d.size);
                }
                continue;
            }
            let Some(seg) = self.segments.get_mut(&d.base).filter(|s| s.id == d.id) else {
                // Settled when the source reused the address (`settle_reused`), or gone.
                if d.released {
                    released = released.saturating_add(d.size);
                }
                continue;
            };
            if d.released {
                let pool = seg.pool;
                self.segments.remove(&d.base);
                self.blocks.remove(&d.base);
                if let Some(p) = self.pools.get_mut(&pool) {
                    p.stats.on_segment_release(d.size);
                }
                self.device.on_segment_release(d.size);
                released = released.saturating_add(d.size);
                touched.insert(pool);
            } else {
                seg.releasing = false;
                self.free
                    .insert((seg.pool, seg.stream, seg.class, seg.size, d.base));
                // A closed pool's segment that could not be released yet: later frees retry.
                if deferred
                    && self
                        .pools
                        .get(&seg.pool)
                        .is_some_and(|p| p.closed && p.graphs == 0)
                {
                    self.closed_free.insert(d.base);
                }
            }
        }
        for pool in touched {
            self.forget_pool_if_empty(pool);
        }
        match error {
            Some(e) => Err(e),
            None => Ok(released),
        }
    }

    /// Detaches every segment from the bookkeeping, live blocks and pending ones included, for
    /// the allocator's teardown: afterwards the core holds nothing. The plan releases them all.
    pub fn teardown(&mut self) -> ReleasePlan {
        let segments: Vec<Detached> = self
            .segments
            .iter()
            .filter(|(_, s)| !s.releasing)
            .map(|(&base, s)| Detached {
                base,
                id: s.id,
                size: s.size,
                released: false,
            })
            .collect();
        self.segments.clear();
        self.blocks.clear();
        self.free.clear();
        self.pending.clear();
        self.closed_free.clear();
        self.device.clear_live();
        self.pools.retain(|_, p| !p.closed);
        for p in self.pools.values_mut() {
            p.stats.clear_live();
            p.growing = 0;
        }
        let counted = !segments.is_empty();
        if counted {
            self.releases_in_flight = self.releases_in_flight.saturating_add(1);
        }
        ReleasePlan {
            segments,
            error: None,
            counted,
            forgotten: true,
            deferred: false,
            required: false,
        }
    }

    /// Whether segments may be released now: no capture window of this allocator is open, and
    /// the source allows it ([`SegmentSource::may_release`]: no capture of the device is open
    /// on any thread, through any allocator).
    fn may_release(&self) -> bool {
        self.captures_open == 0 && self.source.may_release()
    }

    fn run_release(&mut self, plan: ReleasePlan) -> Result<usize> {
        let source = self.source.clone();
        release_via(self, &*source, plan)
    }

    /// Segments (of `only`, or of every pool) that are fully free, not on their way out, and
    /// whose pool has no graphs.
    fn whole_free_segments(&self, only: Option<PoolId>) -> Vec<u64> {
        self.segments
            .iter()
            .filter(|(&base, _)| self.is_releasable(base, only))
            .map(|(&base, _)| base)
            .collect()
    }

    fn is_releasable(&self, base: u64, only: Option<PoolId>) -> bool {
        self.segments.get(&base).is_some_and(|seg| {
            !seg.releasing
                && only.is_none_or(|p| p == seg.pool)
                && self.pools.get(&seg.pool).is_some_and(|p| p.graphs == 0)
                && self
                    .blocks
                    .get(&base)
                    .is_some_and(|b| !b.allocated && b.size == seg.size)
        })
    }

    /// Takes fully free segments out of the free set into a plan.
    fn detach(&mut self, bases: Vec<u64>) -> ReleasePlan {
        let mut segments = Vec::with_capacity(bases.len());
        for base in bases {
            let Some(seg) = self.segments.get_mut(&base) else {
                continue;
            };
            seg.releasing = true;
            self.free
                .remove(&(seg.pool, seg.stream, seg.class, seg.size, base));
            segments.push(Detached {
                base,
                id: seg.id,
                size: seg.size,
                released: false,
            });
        }
        let counted = !segments.is_empty();
        if counted {
            self.releases_in_flight = self.releases_in_flight.saturating_add(1);
        }
        ReleasePlan {
            segments,
            error: None,
            counted,
            forgotten: false,
            deferred: false,
            required: false,
        }
    }

    /// Detaches the queued empty segments of closed pools (unless a capture window is open).
    fn take_closed_plan(&mut self) -> ReleasePlan {
        if self.closed_free.is_empty() || !self.may_release() {
            return ReleasePlan::default();
        }
        let queued = std::mem::take(&mut self.closed_free);
        let victims: Vec<u64> = queued
            .into_iter()
            .filter(|&base| {
                self.is_releasable(base, None)
                    && self
                        .pools
                        .get(&self.segments[&base].pool)
                        .is_some_and(|p| p.closed)
            })
            .collect();
        self.detach(victims)
    }

    fn queue_closed_segments(&mut self, pool: PoolId) {
        let empty = self.whole_free_segments(Some(pool));
        self.closed_free.extend(empty);
    }

    fn forget_pool_if_empty(&mut self, pool: PoolId) {
        if self.pools.get(&pool).is_some_and(|p| {
            p.closed
                && p.stats.reserved == 0
                && p.growing == 0
                && p.graphs == 0
                && p.window.is_none()
        }) {
            self.pools.remove(&pool);
        }
    }

    // ----- pools, graphs, capture windows -----------------------------------------------

    /// Records that a graph replays from `pool` (its segments stay mapped until released).
    pub fn add_graph(&mut self, pool: PoolId) {
        if let Some(p) = self.pools.get_mut(&pool) {
            p.graphs += 1;
        }
    }

    /// Undoes [`Self::add_graph`]; a closed pool's last graph going releases its free segments
    /// (synchronous).
    pub fn remove_graph(&mut self, pool: PoolId) {
        let plan = self.begin_remove_graph(pool);
        let _ = self.run_release(plan);
    }

    /// Bookkeeping of [`Self::remove_graph`]; returns what the caller must release.
    pub fn begin_remove_graph(&mut self, pool: PoolId) -> ReleasePlan {
        let closed = match self.pools.get_mut(&pool) {
            Some(p) => {
                p.graphs = p.graphs.saturating_sub(1);
                p.closed && p.graphs == 0
            }
            None => false,
        };
        if closed {
            self.queue_closed_segments(pool);
            self.forget_pool_if_empty(pool);
        }
        self.take_closed_plan()
    }

    /// The pool's handle is gone: free its memory now, or as its last blocks come back
    /// (synchronous).
    pub fn close_pool(&mut self, pool: PoolId) {
        let plan = self.begin_close_pool(pool);
        let _ = self.run_release(plan);
    }

    /// Bookkeeping of [`Self::close_pool`]; returns what the caller must release.
    pub fn begin_close_pool(&mut self, pool: PoolId) -> ReleasePlan {
        if pool == PoolId::DEFAULT {
            return ReleasePlan::default();
        }
        let Some(p) = self.pools.get_mut(&pool) else {
            return ReleasePlan::default();
        };
        p.closed = true;
        if p.graphs == 0 {
            self.queue_closed_segments(pool);
        }
        self.forget_pool_if_empty(pool);
        self.take_closed_plan()
    }

    /// Starts measuring a capture window in `pool`. Fails if one is already open. While any
    /// window is open no segment is released; the caller must not open one while a release is
    /// in flight ([`Self::releases_in_flight`]).
    pub fn open_window(&mut self, pool: PoolId) -> bool {
        debug_assert_eq!(self.releases_in_flight, 0, "window opened during a release");
        match self.pools.get_mut(&pool) {
            Some(p) if p.window.is_none() => {
                p.window = Some((p.stats.allocated, 0));
                self.captures_open += 1;
                true
            }
            _ => false,
        }
    }

    /// Ends the capture window in `pool` and returns what it measured.
    pub fn close_window(&mut self, pool: PoolId) -> WindowStats {
        let Some((start, peak, now)) = self.pools.get_mut(&pool).and_then(|p| {
            p.window
                .take()
                .map(|(start, peak)| (start, peak, p.stats.allocated))
        }) else {
            return WindowStats::default();
        };
        self.captures_open = self.captures_open.saturating_sub(1);
        self.forget_pool_if_empty(pool);
        WindowStats {
            peak_allocated: peak,
            live_at_end: now.saturating_sub(start),
        }
    }

    // ----- checking ---------------------------------------------------------------------

    /// Checks every internal invariant; used by tests.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let add = |a: usize, b: usize| {
            a.checked_add(b)
                .ok_or_else(|| "byte counts overflow".to_string())
        };
        let mut per_pool: BTreeMap<PoolId, MemoryStats> = BTreeMap::new();
        for (&base, seg) in &self.segments {
            let counted = per_pool.entry(seg.pool).or_default();
            counted.reserved = add(counted.reserved, seg.size)?;
            counted.segments += 1;
            let end = base
                .checked_add(seg.size as u64)
                .ok_or_else(|| format!("segment {base:#x} wraps the address space"))?;
            let mut at = base;
            let mut prev_free = false;
            for (&addr, b) in self.blocks.range(base..end) {
                if addr != at {
                    return Err(format!("gap or overlap at {addr:#x} in segment {base:#x}"));
                }
                if b.segment != base {
                    return Err(format!("block {addr:#x} names the wrong segment"));
                }
                let key = (seg.pool, seg.stream, seg.class, b.size, addr);
                if seg.releasing {
                    if b.allocated || b.size != seg.size || self.free.contains(&key) {
                        return Err(format!("releasing segment {base:#x} is not detached whole"));
                    }
                } else if !b.allocated {
                    if prev_free {
                        return Err(format!("adjacent free blocks not merged at {addr:#x}"));
                    }
                    if !self.free.contains(&key) {
                        return Err(format!("free block {addr:#x} missing from the free set"));
                    }
                    if self.pending.contains_key(&addr) {
                        return Err(format!("pending block {addr:#x} is free"));
                    }
                } else {
                    counted.allocated = add(counted.allocated, b.size)?;
                    counted.active_blocks += 1;
                    if self.pending.contains_key(&addr) {
                        counted.pending_blocks += 1;
                    }
                }
                prev_free = !b.allocated;
                at = add(addr as usize, b.size)? as u64;
            }
            if at != end {
                return Err(format!("segment {base:#x} not covered by its blocks"));
            }
        }
        if self
            .blocks
            .values()
            .any(|b| !self.segments.contains_key(&b.segment))
        {
            return Err("block outside any segment".into());
        }
        if let Some(addr) = self
            .pending
            .keys()
            .find(|a| !self.blocks.get(a).is_some_and(|b| b.allocated))
        {
            return Err(format!("pending block {addr:#x} is not a live block"));
        }
        let same = |what: String, s: &MemoryStats, c: &MemoryStats| {
            let got = (
                s.allocated,
                s.reserved,
                s.active_blocks,
                s.pending_blocks,
                s.segments,
            );
            let want = (
                c.allocated,
                c.reserved,
                c.active_blocks,
                c.pending_blocks,
                c.segments,
            );
            match got == want {
                true => Ok(()),
                false => Err(format!(
                    "{what} stats say (allocated, reserved, active, pending, segments) = \
                     {got:?}, the blocks say {want:?}"
                )),
            }
        };
        let mut total = MemoryStats::default();
        for (pool, counted) in &per_pool {
            let Some(state) = self.pools.get(pool) else {
                return Err(format!("segments of {pool}, which no longer exists"));
            };
            same(pool.to_string(), &state.stats, counted)?;
            total.allocated = add(total.allocated, counted.allocated)?;
            total.reserved = add(total.reserved, counted.reserved)?;
            total.active_blocks += counted.active_blocks;
            total.pending_blocks += counted.pending_blocks;
            total.segments += counted.segments;
        }
        for (pool, state) in &self.pools {
            if !per_pool.contains_key(pool) {
                same(pool.to_string(), &state.stats, &MemoryStats::default())?;
            }
            if state.stats.peak_allocated < state.stats.allocated
                || state.stats.peak_reserved < state.stats.reserved
            {
                return Err(format!("{pool}: a peak is below the current value"));
            }
        }
        same("device".into(), &self.device, &total)?;
        if self.device.pending_blocks != self.pending.len() {
            return Err("pending count differs from the pending list".into());
        }
        let free_blocks = self
            .blocks
            .iter()
            .filter(|(_, b)| !b.allocated)
            .filter(|(_, b)| !self.segments[&b.segment].releasing)
            .count();
        if self.free.len() != free_blocks {
            return Err("free set has stale entries".into());
        }
        let windows = self.pools.values().filter(|p| p.window.is_some()).count();
        if windows != self.captures_open {
            return Err(format!(
                "{windows} windows open, {} counted",
                self.captures_open
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_checked_at_the_top_of_the_address_space() {
        assert_eq!(classify(0).unwrap(), (512, Class::Small));
        assert_eq!(classify(SMALL_MAX).unwrap(), (SMALL_MAX, Class::Small));
        assert_eq!(
            classify(usize::MAX - 511).unwrap(),
            (usize::MAX - 511, Class::Large),
            "already a multiple of 512"
        );
        for bytes in [usize::MAX, usize::MAX - 510] {
            assert!(
                matches!(
                    classify(bytes),
                    Err(Error::SizeOverflow { what: "allocation", count, elem_size: 1 }) if count == bytes
                ),
                "{bytes} rounds past the maximum"
            );
        }
        let (size, class) = classify(usize::MAX - 511).unwrap();
        assert!(matches!(
            segment_size(size, class, usize::MAX - 511),
            Err(Error::SizeOverflow { .. })
        ));
        let top = usize::MAX - (LARGE_ROUND - 1); // the largest multiple of 2 MiB
        assert_eq!(segment_size(top, Class::Large, top).unwrap(), top);
        assert_eq!(
            segment_size(MB + 512, Class::Large, 0).unwrap(),
            LARGE_SEGMENT
        );
        assert_eq!(segment_size(512, Class::Small, 0).unwrap(), SMALL_SEGMENT);
    }

    #[test]
    fn limit_sums_do_not_wrap() {
        assert!(fits(usize::MAX - 1, 1, usize::MAX));
        assert!(
            !fits(usize::MAX, 1, usize::MAX),
            "overflowing sum does not fit"
        );
        assert!(!fits(2, usize::MAX - 1, usize::MAX));
        assert!(!fits(3, 3, 5));
        assert!(fits(0, 0, 0));
    }

    #[test]
    fn stats_saturate_instead_of_wrapping() {
        let mut s = MemoryStats {
            allocated: usize::MAX - 1,
            ..Default::default()
        };
        s.on_alloc(10);
        assert_eq!(s.allocated, usize::MAX);
        s.on_free(usize::MAX);
        s.on_free(1);
        assert_eq!((s.allocated, s.active_blocks), (0, 0));
        s.on_segment_release(5);
        assert_eq!((s.reserved, s.cached()), (0, 0));
    }

    /// A source that hands back the address it released last (as the driver may), from a
    /// range it never touches (the core only does bookkeeping).
    struct Reusing {
        next: std::sync::Mutex<Vec<u64>>,
    }

    // SAFETY: the addresses are bookkeeping only in this test (nothing reads or writes them);
    // a range is handed out again only after its release.
    unsafe impl SegmentSource for Reusing {
        fn allocate(&self, bytes: usize) -> Result<u64> {
            let mut next = self.next.lock().unwrap();
            match next.pop() {
                Some(a) => Ok(a),
                None => Err(Error::OutOfMemory {
                    requested: bytes,
                    reserved: 0,
                }),
            }
        }
        fn release(&self, addr: u64, _bytes: usize) -> Result<()> {
            self.next.lock().unwrap().push(addr);
            Ok(())
        }
    }

    /// One thread's `empty_cache` releases a segment and, before it takes the lock back to
    /// finish, another thread's allocation gets the same address from the source for a new
    /// segment: the old plan must not remove the new segment (it did: the next allocation
    /// found a free block without a segment and panicked).
    #[test]
    fn a_release_finished_after_its_address_came_back_leaves_the_new_segment() {
        let source = Arc::new(Reusing {
            next: std::sync::Mutex::new(vec![0x4000_0000]),
        });
        let mut core = AllocatorCore::new(Box::new(ArcSource(source.clone())));
        let a = core.allocate(4096, PoolId::DEFAULT, 0).unwrap();
        core.free(a.addr);
        assert_eq!(core.device_stats().segments, 1);
        // Thread 1: detach and release (no lock), not finished yet.
        let mut plan = core.begin_release(None);
        assert_eq!(plan.segments().count(), 1);
        plan.execute(&*source);
        // Thread 2: misses the cache, the source hands the same address back.
        let grow = match core.begin_allocate(4096, PoolId::DEFAULT, 0).unwrap() {
            AllocStep::Grow(g) => g,
            AllocStep::Ready(_) => panic!("the segment was detached: the cache is empty"),
        };
        let seg = source.allocate(grow.segment_bytes());
        let b = core.finish_grow(grow, seg).unwrap();
        assert_eq!(b.addr, 0x4000_0000);
        core.check_invariants().unwrap();
        // Thread 1 finishes: the old segment's bytes are reported, the new one stays.
        assert_eq!(core.finish_release(plan).unwrap(), SMALL_SEGMENT);
        core.check_invariants().unwrap();
        let stats = core.device_stats();
        assert_eq!((stats.segments, stats.reserved), (1, SMALL_SEGMENT));
        // The new segment's rest serves the next request; both free back into it.
        let c = core.allocate(4096, PoolId::DEFAULT, 0).unwrap();
        core.free(b.addr);
        core.free(c.addr);
        core.check_invariants().unwrap();
        assert_eq!(core.release_free_segments(None).unwrap(), SMALL_SEGMENT);
        assert_eq!(core.device_stats().segments, 0);
    }

    /// Shares a test source with the core.
    struct ArcSource(Arc<Reusing>);

    // SAFETY: forwards to the wrapped source.
    unsafe impl SegmentSource for ArcSource {
        fn allocate(&self, bytes: usize) -> Result<u64> {
            self.0.allocate(bytes)
        }
        fn release(&self, addr: u64, bytes: usize) -> Result<()> {
            self.0.release(addr, bytes)
        }
    }

    const MB: usize = 1 << 20;
}
