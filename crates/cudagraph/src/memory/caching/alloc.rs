//! Serving and freeing blocks: best fit from the free set, splitting, growing by a new
//! segment (decide in [`AllocatorCore::begin_allocate`], commit in
//! [`AllocatorCore::finish_grow`]), freeing with merges, and blocks freed behind fences that
//! stay allocated until the fences complete. Segments go back to the source in `release.rs`.

use crate::error::{Error, Result};
use crate::ids::PoolId;

use super::contract::Fence;
use super::plans::{AllocStep, Allocation, GrowPlan, ReleasePlan};
use super::sizes::{classify, fits, segment_size, should_split, tight_segment, Class, LARGE_ROUND};
use super::state::{allocate_via, AllocatorCore, Block, Segment};

impl AllocatorCore {
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

    pub(super) fn best_fit(
        &self,
        pool: PoolId,
        stream: u64,
        class: Class,
        size: usize,
    ) -> Option<u64> {
        self.free
            .range((pool, stream, class, size, 0)..=(pool, stream, class, usize::MAX, u64::MAX))
            .next()
            .map(|k| k.4)
    }

    /// Takes the free block at `addr` for a request of `size` and counts it.
    pub(super) fn hand_out(
        &mut self,
        addr: u64,
        size: usize,
        class: Class,
        pool: PoolId,
    ) -> Allocation {
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
    pub(super) fn take(&mut self, addr: u64, size: usize, class: Class) -> usize {
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
    pub(super) fn plan_grow(
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
    pub(super) fn settle_reused(&mut self, addr: u64) {
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
    pub(super) fn poll_pending(&mut self) {
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
    pub(super) fn free_block(&mut self, addr: u64) {
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
}
