//! Device memory: the caching allocator, graph pools, buffers and statistics.
//!
//! Every device buffer the library hands out comes from one [`Allocator`] per device. The
//! bookkeeping lives in [`caching`] and is tested on the CPU against real host memory
//! ([`HostSource`]); on a GPU the same code runs over `cuMemAlloc` (`source::DeviceSource`).
//! Streams and kernel launches are one layer down ([`crate::runtime`]); queues and capture are
//! above ([`crate::device`], [`crate::graph`]).
//!
//! **Stream-safe reuse.** A block remembers every stream other than its own that work using it
//! was enqueued on ([`BlockRef::note_use`], called by the queues for every launch, copy, fill
//! and library call). When such a block is freed, an event is recorded on each of those
//! streams and the allocator does not hand the block out again until they have completed. The
//! one-stream path costs one comparison per use and nothing at free.
//!
//! **Buffers used by eager work that was captured anyway.** A stream that is part of a capture
//! refuses eager work (see [`crate::Stream`]), but a declaration of use cannot fail: a block
//! declared on such a stream ([`BlockRef::note_use`]), like a library's anchor, is kept for the
//! rest of the process (`hold_forever`) — the graph that recorded the work may replay it at
//! any time, and nothing tells us when that graph is gone.
//!
//! Files by job: `caching/` (the allocator's bookkeeping), `allocator.rs` ([`Allocator`], the
//! thread-safe wrapper), `pool.rs` ([`Pool`]), `block.rs` ([`BlockRef`], stream-safe release),
//! `buffer.rs` ([`Elem`], [`DeviceBuffer`]), [`pinned`] ([`PinnedBuffer`]), `order.rs` (the
//! stream that last used a shared resource), `host.rs` and `source.rs` (where segments come
//! from: host memory for tests, `cuMemAlloc` on a device).

mod allocator;
mod block;
mod buffer;
pub mod caching;
mod host;
pub(crate) mod order;
pub mod pinned;
mod pool;
pub(crate) mod source;

pub use allocator::Allocator;
pub(crate) use block::hold_forever;
pub use block::BlockRef;
pub use buffer::{bytes_for, DeviceBuffer, Elem};
pub use caching::stats::{format_memory_full, format_memory_line};
pub use caching::{
    AllocStep, Allocation, AllocatorCore, Fence, GrowPlan, MemoryStats, ReleasePlan, SegmentSource,
    WindowStats,
};
/// The 16-bit float element types (the `half` crate's), for `DeviceBuffer<bf16>` and
/// `DeviceBuffer<f16>` without a direct dependency on `half`.
pub use half::{bf16, f16};
pub use host::HostSource;
pub use pinned::PinnedBuffer;
pub use pool::Pool;
pub(crate) use pool::PoolPin;

pub use crate::ids::PoolId;

#[cfg(test)]
mod tests;
