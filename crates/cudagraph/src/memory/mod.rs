//! Device memory: the caching allocator, graph pools, buffers and statistics.
//!
//! Every device buffer the library hands out comes from one [`Allocator`] per device. The
//! bookkeeping lives in [`caching`] and is tested on the CPU against real host memory
//! ([`HostSource`]); on a GPU the same code runs over `cuMemAlloc` ([`source::DeviceSource`]).
//! Streams and kernel launches are one layer down ([`crate::runtime`]); capture is one layer up
//! ([`crate::graph`]).

mod allocator;
pub mod caching;
mod host;
pub mod pinned;
pub(crate) mod source;

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

pub use allocator::Allocator;
pub use caching::{
    AllocStep, Allocation, AllocatorCore, Fence, GrowPlan, MemoryStats, PoolId, ReleasePlan,
    SegmentSource, WindowStats,
};
pub use host::HostSource;
pub use pinned::{PinnedBuffer, PinnedScope};

use crate::runtime::Arg;

struct PoolInner {
    id: PoolId,
    alloc: Arc<Allocator>,
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        self.alloc.close_pool(self.id);
    }
}

/// A graph memory pool (PyTorch's `graph_pool_handle()`): captures that name the same pool
/// allocate from the same memory.
///
/// **The pool contract.** A block freed inside one capture may be handed out again to a later
/// capture into the same pool. That is only correct if graphs sharing a pool replay in the
/// order they were captured, and never concurrently (the usual case: one graph per batch size,
/// one replay at a time). Graphs in different pools never share memory.
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

    pub(crate) fn allocator(&self) -> &Arc<Allocator> {
        &self.inner.alloc
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

impl PoolPin {
    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }
}

impl Drop for PoolPin {
    fn drop(&mut self) {
        self.pool.inner.alloc.remove_graph(self.pool.inner.id);
    }
}

/// One allocated block. Shared (`Arc`) between the buffer that owns it and any graph that
/// baked its address in; the block returns to its pool when the last holder drops.
pub struct BlockRef {
    addr: u64,
    size: usize,
    pool: PoolId,
    capture: u64,
    alloc: Arc<Allocator>,
}

impl fmt::Debug for BlockRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Block({:#x}, {} B, {})", self.addr, self.size, self.pool)
    }
}

impl BlockRef {
    pub fn addr(&self) -> u64 {
        self.addr
    }
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
    pub(crate) fn device_ordinal(&self) -> usize {
        self.alloc.ordinal()
    }

    /// Whether the block belongs to `pool` (same allocator and same pool id: pool ids are only
    /// unique within one allocator, and every `Device::open` has its own).
    pub fn is_in(&self, pool: &Pool) -> bool {
        self.pool == pool.id() && Arc::ptr_eq(&self.alloc, pool.allocator())
    }
}

impl Drop for BlockRef {
    fn drop(&mut self) {
        self.alloc.free(self.addr);
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

/// A typed device buffer: `len` elements of `T` in a block from the caching allocator.
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
    pub(crate) fn from_block(block: Arc<BlockRef>, len: usize) -> Self {
        Self {
            block,
            len,
            _t: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes of the elements (not of the rounded block).
    pub fn bytes(&self) -> usize {
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
    /// ordering reads and writes is up to the stream, as for every device buffer.
    pub fn alias(&self) -> DeviceBuffer<T> {
        Self::from_block(self.block.clone(), self.len)
    }

    /// A handle to the first `len` elements (`len` at most `self.len()`), sharing the memory.
    pub fn prefix(&self, len: usize) -> crate::Result<DeviceBuffer<T>> {
        if len > self.len {
            return Err(crate::Error::OutOfRange {
                what: "buffer prefix",
                start: 0,
                end: len,
                len: self.len,
            });
        }
        Ok(Self::from_block(self.block.clone(), len))
    }

    /// A kernel argument pointing at element `offset`.
    pub fn arg_at(&self, offset: usize) -> Arg<'_> {
        Arg::Ptr {
            addr: self.block.addr + (offset.min(self.len) * std::mem::size_of::<T>()) as u64,
            holder: Some(&self.block),
        }
    }
}

impl<'a, T: Elem> From<&'a DeviceBuffer<T>> for Arg<'a> {
    fn from(b: &'a DeviceBuffer<T>) -> Self {
        Arg::Ptr {
            addr: b.block.addr,
            holder: Some(&b.block),
        }
    }
}

impl<'a, T: Elem> From<&'a mut DeviceBuffer<T>> for Arg<'a> {
    fn from(b: &'a mut DeviceBuffer<T>) -> Self {
        Arg::from(&*b)
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
