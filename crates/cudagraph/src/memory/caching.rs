//! The caching allocator's bookkeeping, independent of where segments come from.
//!
//! Segments (large regions from a [`SegmentSource`]) are split into blocks. A freed block goes
//! back to a free set keyed by (pool, stream, size class) and merges with free neighbours in its
//! segment. Reuse is stream-ordered: a block freed by work on stream S is handed out again only
//! to allocations on S, which the stream orders after the earlier use. Graph pools ignore the
//! stream: their blocks are only ever used by captures into that pool, and graphs in one pool
//! replay in capture order (the pool contract, see [`crate::memory::Pool`]).
//!
//! Size classes follow PyTorch: requests round up to 512 bytes; requests up to 1 MiB are small
//! and come from 2 MiB segments; larger ones come from 20 MiB segments, or from a segment of
//! their own (rounded to 2 MiB) above 10 MiB. Small and large blocks never share a segment.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::error::{Error, Result};
pub use crate::ids::PoolId;

pub(crate) const ROUND: usize = 512;
pub(crate) const SMALL_MAX: usize = 1 << 20;
pub(crate) const SMALL_SEGMENT: usize = 2 << 20;
pub(crate) const LARGE_SEGMENT: usize = 20 << 20;
pub(crate) const LARGE_ROUND: usize = 2 << 20;
pub(crate) const LARGE_SHARED_MAX: usize = 10 << 20;

/// Where segments come from: the device (cuMemAlloc) or, in tests, host memory.
pub trait SegmentSource: Send + Sync {
    /// Returns the address of a new region of `bytes` bytes, or `Error::OutOfMemory`.
    fn allocate(&self, bytes: usize) -> Result<u64>;
    /// Returns a region obtained from `allocate`.
    fn release(&self, addr: u64, bytes: usize) -> Result<()>;
    /// Waits until no queued work can still touch any segment (before segments are released).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

/// Memory counters of a pool, or of the whole device. Bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in blocks handed out and not yet freed (rounded sizes).
    pub allocated: usize,
    /// Bytes in segments obtained from the driver (allocated + cached).
    pub reserved: usize,
    pub peak_allocated: usize,
    pub peak_reserved: usize,
    /// Blocks currently handed out.
    pub active_blocks: usize,
    /// Segments currently held.
    pub segments: usize,
    /// Allocation requests served since creation.
    pub allocations: u64,
    /// Segment allocations from the source since creation.
    pub segment_allocations: u64,
}

impl MemoryStats {
    fn on_alloc(&mut self, size: usize) {
        self.allocated += size;
        self.active_blocks += 1;
        self.allocations += 1;
        self.peak_allocated = self.peak_allocated.max(self.allocated);
    }

    fn on_free(&mut self, size: usize) {
        self.allocated -= size;
        self.active_blocks -= 1;
    }

    fn on_segment(&mut self, size: usize) {
        self.reserved += size;
        self.segments += 1;
        self.segment_allocations += 1;
        self.peak_reserved = self.peak_reserved.max(self.reserved);
    }

    fn on_segment_release(&mut self, size: usize) {
        self.reserved -= size;
        self.segments -= 1;
    }

    /// Bytes held in segments but not handed out.
    pub fn cached(&self) -> usize {
        self.reserved - self.allocated
    }

    fn reset_peak(&mut self) {
        self.peak_allocated = self.allocated;
        self.peak_reserved = self.reserved;
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Class {
    Small,
    Large,
}

/// Rounded request size and its class.
fn classify(bytes: usize) -> (usize, Class) {
    let size = bytes.max(1).div_ceil(ROUND) * ROUND;
    if size <= SMALL_MAX {
        (size, Class::Small)
    } else {
        (size, Class::Large)
    }
}

/// Segment size for a rounded request.
fn segment_size(size: usize, class: Class) -> usize {
    match class {
        Class::Small => SMALL_SEGMENT,
        Class::Large if size <= LARGE_SHARED_MAX => LARGE_SEGMENT,
        Class::Large => size.div_ceil(LARGE_ROUND) * LARGE_ROUND,
    }
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
    size: usize,
    pool: PoolId,
    stream: u64,
    class: Class,
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
    pub addr: u64,
    /// Rounded size actually reserved for it.
    pub size: usize,
    pub pool: PoolId,
}

/// The allocator state machine. Not thread-safe; [`super::Allocator`] wraps it in a mutex.
pub struct AllocatorCore {
    source: Box<dyn SegmentSource>,
    segments: BTreeMap<u64, Segment>,
    blocks: BTreeMap<u64, Block>,
    free: BTreeSet<FreeKey>,
    pools: BTreeMap<PoolId, PoolState>,
    device: MemoryStats,
    next_pool: u64,
    /// Capture windows open in any pool: segments are never released meanwhile, since that
    /// needs a device synchronisation, which would invalidate the capture.
    captures_open: usize,
}

impl fmt::Debug for AllocatorCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AllocatorCore")
            .field("segments", &self.segments.len())
            .field("blocks", &self.blocks.len())
            .field("device", &self.device)
            .finish()
    }
}

impl AllocatorCore {
    pub fn new(source: Box<dyn SegmentSource>) -> Self {
        let mut pools = BTreeMap::new();
        pools.insert(PoolId::DEFAULT, PoolState::default());
        Self {
            source,
            segments: BTreeMap::new(),
            blocks: BTreeMap::new(),
            free: BTreeSet::new(),
            pools,
            device: MemoryStats::default(),
            next_pool: 1,
            captures_open: 0,
        }
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

    /// Sets or clears the default pool's byte limit.
    pub fn set_limit(&mut self, pool: PoolId, limit: Option<usize>) {
        if let Some(p) = self.pools.get_mut(&pool) {
            p.limit = limit;
        }
    }

    pub fn limit(&self, pool: PoolId) -> Option<usize> {
        self.pools.get(&pool).and_then(|p| p.limit)
    }

    pub fn pool_stats(&self, pool: PoolId) -> MemoryStats {
        self.pools.get(&pool).map(|p| p.stats).unwrap_or_default()
    }

    pub fn device_stats(&self) -> MemoryStats {
        self.device
    }

    /// Ids of pools that still exist (open, or holding memory).
    pub fn pool_ids(&self) -> Vec<PoolId> {
        self.pools.keys().copied().collect()
    }

    /// Resets peak counters of every pool and the device to the current values.
    pub fn reset_peak(&mut self) {
        self.device.reset_peak();
        for p in self.pools.values_mut() {
            p.stats.reset_peak();
        }
    }

    /// Hands out a block of at least `bytes` bytes from `pool`, ordered on `stream`.
    pub fn allocate(&mut self, bytes: usize, pool: PoolId, stream: u64) -> Result<Allocation> {
        let state = self.pools.get(&pool).ok_or(Error::InvalidGraph {
            problem: format!("{pool} no longer exists"),
        })?;
        debug_assert!(!state.closed, "allocation from a closed pool");
        let stream = if pool == PoolId::DEFAULT { stream } else { 0 };
        let (size, class) = classify(bytes);
        let addr = match self.best_fit(pool, stream, class, size) {
            Some(addr) => addr,
            None => self.grow(pool, stream, class, size)?,
        };
        // An unsplit remainder stays part of the block, so count the block's real size.
        let size = self.take(addr, size, class);
        let state = self.pools.get_mut(&pool).expect("pool checked above");
        state.stats.on_alloc(size);
        if let Some((start, peak)) = state.window.as_mut() {
            *peak = (*peak).max(state.stats.allocated - *start);
        }
        self.device.on_alloc(size);
        Ok(Allocation { addr, size, pool })
    }

    fn best_fit(&self, pool: PoolId, stream: u64, class: Class, size: usize) -> Option<u64> {
        self.free
            .range((pool, stream, class, size, 0)..=(pool, stream, class, usize::MAX, u64::MAX))
            .next()
            .map(|k| k.4)
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
        let rest = block_size - size;
        let b = self.blocks.get_mut(&addr).expect("block exists");
        b.allocated = true;
        if should_split(rest, class) {
            b.size = size;
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

    /// Gets a new segment for (pool, stream, class) able to hold `size`; returns its address.
    fn grow(&mut self, pool: PoolId, stream: u64, class: Class, size: usize) -> Result<u64> {
        let mut seg_size = segment_size(size, class);
        let (limit, graphs) = {
            let state = &self.pools[&pool];
            (state.limit, state.graphs)
        };
        if let Some(limit) = limit {
            if self.pools[&pool].stats.reserved + seg_size > limit {
                // Within a bounded pool, prefer a tight segment over failing.
                let tight = match class {
                    Class::Small => SMALL_SEGMENT,
                    Class::Large => size.div_ceil(LARGE_ROUND) * LARGE_ROUND,
                };
                if graphs == 0 {
                    self.release_free_segments(Some(pool))?;
                }
                let reserved = self.pools[&pool].stats.reserved;
                if reserved + tight > limit {
                    return Err(Error::PoolLimitExceeded {
                        pool,
                        limit,
                        reserved,
                        requested: tight,
                    });
                }
                seg_size = seg_size.min(limit - reserved).max(tight);
            }
        }
        let addr = match self.source.allocate(seg_size) {
            Ok(a) => a,
            Err(e) if e.is_out_of_memory() => {
                // Give cached segments back to the driver and try once more, as PyTorch does.
                self.release_free_segments(None)?;
                self.source
                    .allocate(seg_size)
                    .map_err(|e| match e.is_out_of_memory() {
                        true => Error::OutOfMemory {
                            requested: seg_size,
                            reserved: self.device.reserved,
                        },
                        false => e,
                    })?
            }
            Err(e) => return Err(e),
        };
        self.segments.insert(
            addr,
            Segment {
                size: seg_size,
                pool,
                stream,
                class,
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
        self.pools
            .get_mut(&pool)
            .expect("pool exists")
            .stats
            .on_segment(seg_size);
        self.device.on_segment(seg_size);
        Ok(addr)
    }

    /// Returns the block at `addr` to its pool, merging it with free neighbours.
    pub fn free(&mut self, addr: u64) {
        let Some(block) = self.blocks.get_mut(&addr) else {
            debug_assert!(false, "free of unknown block {addr:#x}");
            return;
        };
        if !block.allocated {
            debug_assert!(false, "double free of block {addr:#x}");
            return;
        }
        block.allocated = false;
        let (mut start, mut size, seg_base) = (addr, block.size, block.segment);
        let (pool, stream, class) = {
            let s = &self.segments[&seg_base];
            (s.pool, s.stream, s.class)
        };
        let state = self.pools.get_mut(&pool).expect("pool of a live block");
        state.stats.on_free(size);
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

        let state = &self.pools[&pool];
        if state.closed
            && state.graphs == 0
            && self.captures_open == 0
            && size == self.segments[&seg_base].size
            && self.source.synchronize().is_ok()
        {
            // Best effort: a segment that cannot be released stays cached and is counted.
            let _ = self.release_segment(seg_base);
            self.forget_pool_if_empty(pool);
        }
    }

    /// Releases one fully free segment to the source.
    fn release_segment(&mut self, base: u64) -> Result<()> {
        let seg = &self.segments[&base];
        let (size, pool, stream, class) = (seg.size, seg.pool, seg.stream, seg.class);
        self.source.release(base, size)?;
        self.free.remove(&(pool, stream, class, size, base));
        self.blocks.remove(&base);
        self.segments.remove(&base);
        if let Some(p) = self.pools.get_mut(&pool) {
            p.stats.on_segment_release(size);
        }
        self.device.on_segment_release(size);
        Ok(())
    }

    /// Releases every fully free segment (of one pool, or of all pools) whose pool has no live
    /// graphs. Returns the bytes released.
    pub fn release_free_segments(&mut self, only: Option<PoolId>) -> Result<usize> {
        let victims: Vec<u64> = self
            .segments
            .iter()
            .filter(|(base, seg)| {
                only.is_none_or(|p| p == seg.pool)
                    && self.pools.get(&seg.pool).is_some_and(|p| p.graphs == 0)
                    && self
                        .blocks
                        .get(base)
                        .is_some_and(|b| !b.allocated && b.size == seg.size)
            })
            .map(|(base, _)| *base)
            .collect();
        if victims.is_empty() || self.captures_open > 0 {
            return Ok(0);
        }
        self.source.synchronize()?;
        let mut released = 0;
        for base in victims {
            released += self.segments[&base].size;
            self.release_segment(base)?;
        }
        let closed: Vec<PoolId> = self
            .pools
            .iter()
            .filter(|(_, p)| p.closed)
            .map(|(id, _)| *id)
            .collect();
        for id in closed {
            self.forget_pool_if_empty(id);
        }
        Ok(released)
    }

    fn forget_pool_if_empty(&mut self, pool: PoolId) {
        if let Some(p) = self.pools.get(&pool) {
            if p.closed && p.stats.reserved == 0 {
                self.pools.remove(&pool);
            }
        }
    }

    /// Records that a graph replays from `pool` (its segments stay mapped until released).
    pub fn add_graph(&mut self, pool: PoolId) {
        if let Some(p) = self.pools.get_mut(&pool) {
            p.graphs += 1;
        }
    }

    /// Undoes [`Self::add_graph`].
    pub fn remove_graph(&mut self, pool: PoolId) {
        let closed = match self.pools.get_mut(&pool) {
            Some(p) => {
                p.graphs = p.graphs.saturating_sub(1);
                p.closed && p.graphs == 0
            }
            None => false,
        };
        if closed {
            let _ = self.release_free_segments(Some(pool));
        }
    }

    /// The pool's handle is gone: free its memory now, or as its last blocks come back.
    pub fn close_pool(&mut self, pool: PoolId) {
        if pool == PoolId::DEFAULT {
            return;
        }
        if let Some(p) = self.pools.get_mut(&pool) {
            p.closed = true;
            if p.graphs == 0 {
                let _ = self.release_free_segments(Some(pool));
            }
            self.forget_pool_if_empty(pool);
        }
    }

    /// Starts measuring a capture window in `pool`. Fails if one is already open.
    pub fn open_window(&mut self, pool: PoolId) -> bool {
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
        if self.pools.get(&pool).is_some_and(|p| p.window.is_some()) {
            self.captures_open -= 1;
        }
        match self.pools.get_mut(&pool).and_then(|p| {
            p.window
                .take()
                .map(|(start, peak)| (start, peak, p.stats.allocated))
        }) {
            Some((start, peak, now)) => WindowStats {
                peak_allocated: peak,
                live_at_end: now.saturating_sub(start),
            },
            None => WindowStats::default(),
        }
    }

    /// Checks every internal invariant; used by tests (and debug builds of tests above).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut allocated = 0;
        let mut active = 0;
        for (&base, seg) in &self.segments {
            let mut at = base;
            let end = base + seg.size as u64;
            let mut prev_free = false;
            for (&addr, b) in self.blocks.range(base..end) {
                if addr != at {
                    return Err(format!("gap or overlap at {addr:#x} in segment {base:#x}"));
                }
                if b.segment != base {
                    return Err(format!("block {addr:#x} names the wrong segment"));
                }
                if !b.allocated {
                    if prev_free {
                        return Err(format!("adjacent free blocks not merged at {addr:#x}"));
                    }
                    if !self
                        .free
                        .contains(&(seg.pool, seg.stream, seg.class, b.size, addr))
                    {
                        return Err(format!("free block {addr:#x} missing from the free set"));
                    }
                } else {
                    allocated += b.size;
                    active += 1;
                }
                prev_free = !b.allocated;
                at = addr + b.size as u64;
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
        if allocated != self.device.allocated || active != self.device.active_blocks {
            return Err(format!(
                "device stats say {} bytes in {} blocks, blocks say {allocated} in {active}",
                self.device.allocated, self.device.active_blocks
            ));
        }
        let reserved: usize = self.segments.values().map(|s| s.size).sum();
        if reserved != self.device.reserved {
            return Err(format!(
                "device reserved {} != segments {reserved}",
                self.device.reserved
            ));
        }
        let pool_alloc: usize = self.pools.values().map(|p| p.stats.allocated).sum();
        let pool_res: usize = self.pools.values().map(|p| p.stats.reserved).sum();
        if pool_alloc != self.device.allocated || pool_res != self.device.reserved {
            return Err("pool stats do not add up to device stats".into());
        }
        if self.free.len() != self.blocks.values().filter(|b| !b.allocated).count() {
            return Err("free set has stale entries".into());
        }
        Ok(())
    }
}
