//! The allocator's state: [`AllocatorCore`] with its segments, blocks, free set and pools, the
//! accessors that read it, and the protocol that runs an allocation or a release with the
//! source called outside the lock ([`allocate_via`], [`release_via`]). Serving and freeing
//! blocks are in `alloc.rs`, giving segments back and pool lifecycles in `release.rs`, the
//! consistency check in `invariants.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::ids::PoolId;

use super::contract::{Fence, SegmentSource};
use super::plans::{AllocStep, Allocation, GrowPlan, ReleasePlan};
use super::sizes::Class;
use super::stats::MemoryStats;

#[derive(Debug)]
pub(super) struct Segment {
    /// Unique among the segments this core ever held: an address can come back from the
    /// source for a new segment while a release plan still names the old one.
    pub(super) id: u64,
    pub(super) size: usize,
    pub(super) pool: PoolId,
    pub(super) stream: u64,
    pub(super) class: Class,
    /// Detached into a release plan: out of the free set, on its way back to the source.
    pub(super) releasing: bool,
}

#[derive(Debug)]
pub(super) struct Block {
    pub(super) size: usize,
    pub(super) segment: u64,
    pub(super) allocated: bool,
}

/// (pool, stream, class, size, addr): ordered so a range query finds the best fit.
pub(super) type FreeKey = (PoolId, u64, Class, usize, u64);

#[derive(Debug, Default)]
pub(super) struct PoolState {
    pub(super) limit: Option<usize>,
    pub(super) stats: MemoryStats,
    /// Bytes of segments being obtained for this pool (grow plans in flight); they count
    /// against the limit until they arrive or the plan is cancelled.
    pub(super) growing: usize,
    /// Graphs that replay from this pool: its segments must stay mapped while any exist.
    pub(super) graphs: usize,
    /// The pool's handle was dropped: release segments as soon as they are empty.
    pub(super) closed: bool,
    /// An open capture window: (allocated at its start, peak allocated in it).
    pub(super) window: Option<(usize, usize)>,
}

/// The allocator state machine. Not thread-safe; [`crate::memory::Allocator`] wraps it in a mutex and
/// runs its phases with the mutex released around every call into the source.
pub struct AllocatorCore {
    pub(super) source: Arc<dyn SegmentSource>,
    pub(super) segments: BTreeMap<u64, Segment>,
    pub(super) blocks: BTreeMap<u64, Block>,
    pub(super) free: BTreeSet<FreeKey>,
    pub(super) pools: BTreeMap<PoolId, PoolState>,
    pub(super) device: MemoryStats,
    pub(super) next_pool: u64,
    /// Capture windows open in any pool: segments are never released meanwhile, since that
    /// needs a device synchronisation, which would invalidate the capture.
    pub(super) captures_open: usize,
    /// Blocks freed behind fences, by address: still allocated until every fence completes.
    pub(super) pending: BTreeMap<u64, Vec<Box<dyn Fence>>>,
    /// Fully free segments of closed pools, to release at the next opportunity.
    pub(super) closed_free: BTreeSet<u64>,
    /// Release plans handed out and not yet finished.
    pub(super) releases_in_flight: usize,
    /// Id of the next segment.
    pub(super) next_segment: u64,
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
}
