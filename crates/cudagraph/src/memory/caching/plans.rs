//! The plans that let the allocator call its source without holding its lock: a
//! [`ReleasePlan`] carries segments detached from the bookkeeping to be given back, a
//! [`GrowPlan`] a new segment to obtain, [`AllocStep`] says which an allocation needs. The
//! core creates and settles them; running them with the lock released is the protocol in
//! `state.rs`.

use crate::error::Error;
use crate::ids::PoolId;

use super::contract::SegmentSource;
use super::sizes::Class;

/// A block handed out by [`AllocatorCore::allocate`](super::AllocatorCore::allocate).
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
/// [`ReleasePlan::execute`], then [`AllocatorCore::finish_release`](super::AllocatorCore::finish_release).
///
/// While a non-empty plan is unfinished the allocator counts a release in flight (see
/// [`AllocatorCore::releases_in_flight`](super::AllocatorCore::releases_in_flight)); its segments are reserved but unusable. A plan that
/// is finished without being executed puts its segments back in the cache.
#[derive(Debug, Default)]
#[must_use = "a release plan must be finished with AllocatorCore::finish_release"]
pub struct ReleasePlan {
    pub(super) segments: Vec<Detached>,
    pub(super) error: Option<Error>,
    /// Counted in `releases_in_flight`.
    pub(super) counted: bool,
    /// The source did not allow releasing when the plan ran ([`SegmentSource::exclusive`]):
    /// nothing was released, and the segments go back to the cache (closed pools' ones to
    /// the queue that later frees retry).
    pub(super) deferred: bool,
    /// Releasing is what makes room for an allocation (a bounded pool's grow): a deferred
    /// plan is then an error.
    pub(super) required: bool,
    /// From `teardown`: the bookkeeping already forgot these segments.
    pub(super) forgotten: bool,
}

#[derive(Debug)]
pub(super) struct Detached {
    pub(super) base: u64,
    /// The segment's [`Segment::id`](super::state::Segment::id) when detached.
    pub(super) id: u64,
    pub(super) size: usize,
    pub(super) released: bool,
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
    /// Failures are recorded and reported by [`AllocatorCore::finish_release`](super::AllocatorCore::finish_release): after a
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
/// pool's limit from [`AllocatorCore::begin_allocate`](super::AllocatorCore::begin_allocate) until [`AllocatorCore::finish_grow`](super::AllocatorCore::finish_grow)
/// (or [`AllocatorCore::cancel_grow`](super::AllocatorCore::cancel_grow)).
#[derive(Debug)]
#[must_use = "a grow plan must be finished with AllocatorCore::finish_grow or cancel_grow"]
pub struct GrowPlan {
    pub(super) pool: PoolId,
    pub(super) stream: u64,
    pub(super) class: Class,
    /// Rounded request.
    pub(super) size: usize,
    pub(super) segment: usize,
    /// The pool's own free segments, to give back before asking for the new one.
    pub(super) release: ReleasePlan,
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

/// What [`AllocatorCore::begin_allocate`](super::AllocatorCore::begin_allocate) decided.
#[derive(Debug)]
#[must_use]
pub enum AllocStep {
    /// Served from the cache.
    Ready(Allocation),
    /// A new segment is needed first.
    Grow(GrowPlan),
}
