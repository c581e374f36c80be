//! TEMPORARY stand-in with the final API; replaced by the lock-light allocator at merge.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use super::caching::{Allocation, AllocatorCore, MemoryStats, SegmentSource, WindowStats};
use crate::error::Result;
use crate::ids::PoolId;

/// Completion of device work that used a block (an event recorded after that work).
pub trait Fence: Send + Sync {
    fn is_complete(&self) -> bool;
}

#[allow(clippy::type_complexity)] // temporary stand-in
pub struct Allocator {
    core: Mutex<AllocatorCore>,
    pending: Mutex<Vec<(u64, Vec<Box<dyn Fence>>)>>,
    ordinal: usize,
}

impl fmt::Debug for Allocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Allocator(device {})", self.ordinal)
    }
}

impl Allocator {
    pub fn new(source: Box<dyn SegmentSource>, ordinal: usize) -> Arc<Self> {
        Arc::new(Self {
            core: Mutex::new(AllocatorCore::new(source)),
            pending: Mutex::new(Vec::new()),
            ordinal,
        })
    }
    fn lock(&self) -> MutexGuard<'_, AllocatorCore> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn poll(&self) {
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let mut keep = Vec::new();
        for (addr, f) in p.drain(..) {
            if f.iter().all(|f| f.is_complete()) {
                self.lock().free(addr);
            } else {
                keep.push((addr, f));
            }
        }
        *p = keep;
    }
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    pub fn allocate(&self, bytes: usize, pool: PoolId, stream: u64) -> Result<Allocation> {
        self.poll();
        self.lock().allocate(bytes, pool, stream)
    }
    pub fn free(&self, addr: u64) {
        self.lock().free(addr)
    }
    pub fn free_after(&self, addr: u64, fences: Vec<Box<dyn Fence>>) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((addr, fences));
    }
    pub fn pool_stats(&self, pool: PoolId) -> MemoryStats {
        self.lock().pool_stats(pool)
    }
    pub fn stats(&self) -> MemoryStats {
        self.lock().device_stats()
    }
    pub fn reset_peak(&self) {
        self.lock().reset_peak()
    }
    pub fn empty_cache(&self) -> Result<usize> {
        self.poll();
        self.lock().release_free_segments(None)
    }
    pub fn create_pool(&self, limit: Option<usize>) -> PoolId {
        self.lock().create_pool(limit)
    }
    pub fn close_pool(&self, id: PoolId) {
        self.lock().close_pool(id)
    }
    pub fn add_graph(&self, id: PoolId) {
        self.lock().add_graph(id)
    }
    pub fn remove_graph(&self, id: PoolId) {
        self.lock().remove_graph(id)
    }
    pub fn limit(&self, id: PoolId) -> Option<usize> {
        self.lock().limit(id)
    }
    pub fn set_limit(&self, id: PoolId, limit: Option<usize>) {
        self.lock().set_limit(id, limit)
    }
    pub fn open_window(&self, id: PoolId) -> bool {
        self.lock().open_window(id)
    }
    pub fn close_window(&self, id: PoolId) -> WindowStats {
        self.lock().close_window(id)
    }
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.lock().check_invariants()
    }
}
