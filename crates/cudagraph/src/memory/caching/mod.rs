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
//! limit fails with [`Error::SizeOverflow`](crate::Error::SizeOverflow) or [`Error::PoolLimitExceeded`](crate::Error::PoolLimitExceeded), never wraps.
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
//!
//! Files by job: `contract.rs` ([`SegmentSource`], [`Fence`]), `sizes.rs` (size classes),
//! `stats.rs` ([`MemoryStats`], [`WindowStats`]), `plans.rs` ([`ReleasePlan`], [`GrowPlan`],
//! [`AllocStep`], [`Allocation`]), `state.rs` ([`AllocatorCore`] and the phase protocol),
//! `alloc.rs` (serving and freeing blocks), `release.rs` (giving segments back, pools, capture
//! windows), `invariants.rs` (the consistency check). The thread-safe wrapper is
//! [`crate::memory::Allocator`].

mod alloc;
mod contract;
mod invariants;
mod plans;
mod release;
mod sizes;
mod state;
pub(super) mod stats;

pub use contract::{Fence, SegmentSource};
pub use plans::{AllocStep, Allocation, GrowPlan, ReleasePlan};
pub use state::AllocatorCore;
pub(crate) use state::{allocate_via, release_via, CoreAccess};
pub use stats::{MemoryStats, WindowStats};

pub use crate::ids::PoolId;

#[cfg(test)]
mod tests;
