//! Giving segments back to the source: which fully free segments may go, detaching them into
//! a [`ReleasePlan`] and settling it afterwards, the teardown, and the lifecycle of pools that
//! decides it — graphs replaying from a pool, closed pools, capture windows (no segment is
//! released while one is open).

use std::collections::BTreeSet;

use crate::error::Result;
use crate::ids::PoolId;

use super::plans::{Detached, ReleasePlan};
use super::state::{release_via, AllocatorCore};
use super::stats::WindowStats;

impl AllocatorCore {
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
    /// the source allows it ([`SegmentSource::may_release`](super::SegmentSource::may_release): no capture of the device is open
    /// on any thread, through any allocator).
    pub(super) fn may_release(&self) -> bool {
        self.captures_open == 0 && self.source.may_release()
    }

    pub(super) fn run_release(&mut self, plan: ReleasePlan) -> Result<usize> {
        let source = self.source.clone();
        release_via(self, &*source, plan)
    }

    /// Segments (of `only`, or of every pool) that are fully free, not on their way out, and
    /// whose pool has no graphs.
    pub(super) fn whole_free_segments(&self, only: Option<PoolId>) -> Vec<u64> {
        self.segments
            .iter()
            .filter(|(&base, _)| self.is_releasable(base, only))
            .map(|(&base, _)| base)
            .collect()
    }

    pub(super) fn is_releasable(&self, base: u64, only: Option<PoolId>) -> bool {
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
    pub(super) fn detach(&mut self, bases: Vec<u64>) -> ReleasePlan {
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
    pub(super) fn take_closed_plan(&mut self) -> ReleasePlan {
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

    pub(super) fn queue_closed_segments(&mut self, pool: PoolId) {
        let empty = self.whole_free_segments(Some(pool));
        self.closed_free.extend(empty);
    }

    pub(super) fn forget_pool_if_empty(&mut self, pool: PoolId) {
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
}
