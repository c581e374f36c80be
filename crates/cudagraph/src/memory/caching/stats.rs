//! What the allocator counts: [`MemoryStats`] per pool and per device, [`WindowStats`] for a
//! capture window, and their one-line and full renderings for logs. The counting itself is
//! done by the core as it allocates, frees and releases.

use std::fmt;

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
    /// Freed blocks still waiting for fences ([`AllocatorCore::free_after`](super::AllocatorCore::free_after)) before reuse.
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
    pub(super) fn on_alloc(&mut self, size: usize) {
        self.allocated = self.allocated.saturating_add(size);
        self.active_blocks = self.active_blocks.saturating_add(1);
        self.allocations = self.allocations.saturating_add(1);
        self.peak_allocated = self.peak_allocated.max(self.allocated);
    }

    pub(super) fn on_free(&mut self, size: usize) {
        self.allocated = self.allocated.saturating_sub(size);
        self.active_blocks = self.active_blocks.saturating_sub(1);
    }

    pub(super) fn on_segment(&mut self, size: usize) {
        self.reserved = self.reserved.saturating_add(size);
        self.segments = self.segments.saturating_add(1);
        self.segment_allocations = self.segment_allocations.saturating_add(1);
        self.peak_reserved = self.peak_reserved.max(self.reserved);
    }

    pub(super) fn on_segment_release(&mut self, size: usize) {
        self.reserved = self.reserved.saturating_sub(size);
        self.segments = self.segments.saturating_sub(1);
    }

    /// Bytes held in segments but not handed out.
    pub fn cached(&self) -> usize {
        self.reserved.saturating_sub(self.allocated)
    }

    pub(super) fn reset_peak(&mut self) {
        self.peak_allocated = self.allocated;
        self.peak_reserved = self.reserved;
    }

    /// Forgets every live block and segment (teardown); peaks and totals stay.
    pub(super) fn clear_live(&mut self) {
        self.allocated = 0;
        self.reserved = 0;
        self.active_blocks = 0;
        self.pending_blocks = 0;
        self.segments = 0;
    }
}

/// What a finished capture window measured in a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowStats {
    /// Peak of (allocated − allocated at start) while the window was open.
    pub peak_allocated: usize,
    /// Bytes allocated in the window still allocated at its end (outputs kept by the user).
    pub live_at_end: usize,
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
