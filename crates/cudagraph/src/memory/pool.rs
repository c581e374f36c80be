//! [`Pool`]: a graph memory pool handle (PyTorch's `graph_pool_handle()`), with the order of
//! its graphs' replays, and [`PoolPin`], which keeps a pool's segments mapped while a graph can
//! replay from them. The bookkeeping behind a pool is the allocator's (`caching`).

use std::fmt;
use std::sync::Arc;

use super::allocator::Allocator;
use super::caching::MemoryStats;
use super::order;
use crate::ids::PoolId;

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

    /// The pool's id in its allocator.
    pub fn id(&self) -> PoolId {
        self.inner.id
    }

    /// Memory counters of this pool.
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

    /// The allocator the pool belongs to.
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

impl Allocator {
    /// Creates a graph pool handle, optionally limited to `limit` reserved bytes.
    pub fn new_pool(self: &Arc<Self>, limit: Option<usize>) -> Pool {
        Pool::new(self, limit)
    }
}
