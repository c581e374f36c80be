//! [`Device`]: one GPU as the library sees it — its context, the caching allocator every
//! buffer comes from, the device-side check records and their registry per stream, and the
//! per-device extensions of libraries layered on top. Streams and the queue of work are in
//! `stream.rs` and `queue.rs`.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use super::checks::{self, CheckRecord};
use crate::error::Result;
use crate::memory::{
    source::DeviceSource, Allocator, BlockRef, Elem, MemoryStats, PinnedBuffer, Pool, PoolId,
};
use crate::runtime::memory as raw;
use crate::runtime::primary::Quiet;
use crate::runtime::{Context, DeviceInfo, Event, Module, StreamHandle, StreamRef, WeakStream};

struct DeviceInner {
    ctx: Context,
    alloc: Arc<Allocator>,
    /// The lock word the writers of every check record of this device share (see [`checks`]).
    check_lock: Arc<BlockRef>,
    /// Every check record of this device, and which ones each stream reads.
    checks: Mutex<CheckRegistry>,
    /// Per-device state of libraries layered on top (kernels, library handles, tuning caches):
    /// it lives exactly as long as the device, so dropping the last `Device` handle releases it.
    extensions: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
    /// Held from the start of the drop until every field before it is gone (see `Drop`).
    quiet: Option<Quiet>,
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // Other handles of this device (every `Device::open` has its own) may be capturing on
        // other threads. What follows synchronises the context (`cuCtxSynchronize`, and the
        // `cudaFree`s and module unloads inside library handles' destruction, the allocator's
        // teardown and the mapped flag's release, which run as the fields drop after this),
        // which would invalidate their captures, so it waits for them to end and holds new
        // ones off until the last field is gone (`quiet` is dropped last). A thread that is
        // capturing itself cannot wait: it goes ahead as before.
        self.quiet = self.ctx.handle.gate().wait_quiet("dropping a device").ok();
        // Library state first (it may free buffers and destroy handles that use the context).
        self.extensions
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        // No stream or graph of this device is left (each holds the device), but work they
        // queued may still run and write the flag: wait for it before the flag is freed. Also
        // without the gate (this thread capturing while others are): the flag's safety comes
        // first, as before the gate existed (`Context::synchronize` would refuse here).
        let _ = self.ctx.handle.synchronize_quiet();
        // This handle's modules unload here (functions held elsewhere keep theirs loaded).
        self.ctx.forget_modules();
    }
}

/// One GPU: its CUDA context and the caching allocator every buffer comes from.
/// Cheap to clone (all clones share the context and allocator).
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({} #{})", self.info().name, self.ordinal())
    }
}

impl Device {
    /// Opens CUDA device `ordinal`. Fails with [`Error::NoDriver`](crate::Error::NoDriver) on a machine without the
    /// NVIDIA driver and [`Error::NoDevice`](crate::Error::NoDevice) for an ordinal the driver does not know.
    #[track_caller]
    pub fn open(ordinal: usize) -> Result<Self> {
        let ctx = Context::open(ordinal)?;
        let alloc = Allocator::for_device(
            Box::new(DeviceSource {
                ctx: ctx.handle.clone(),
                total: ctx.info().total_memory,
            }),
            ordinal,
        );
        let service = StreamHandle::new(&ctx)?;
        let check_lock = alloc.allocate_block(checks::LOCK_BYTES, service.as_ref())?;
        raw::memcpy_htod_from_host(check_lock.addr(), &[0u8; checks::LOCK_BYTES], service.raw())?;
        service.synchronize()?;
        Ok(Self {
            inner: Arc::new(DeviceInner {
                ctx,
                alloc,
                check_lock,
                checks: Mutex::new(CheckRegistry::default()),
                extensions: Mutex::new(HashMap::new()),
                quiet: None,
            }),
        })
    }

    /// The device's CUDA context (its retained primary context).
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Facts read off the device when it was opened.
    pub fn info(&self) -> &DeviceInfo {
        self.inner.ctx.info()
    }

    /// The device's ordinal (0 for the first GPU).
    pub fn ordinal(&self) -> usize {
        self.inner.ctx.ordinal()
    }

    /// The caching allocator every buffer of this device handle comes from.
    pub fn allocator(&self) -> &Arc<Allocator> {
        &self.inner.alloc
    }

    /// This device's instance of `T`, created by `init` on first use. For libraries layered on
    /// cudagraph (the NN layer keeps its kernels and cuBLAS handle here): the value lives as
    /// long as the device and is dropped with its last handle. `T` must not hold a `Device`
    /// (that would keep the device alive forever); hold its `Context` and `allocator()`.
    pub fn extension<T: Any + Send + Sync>(
        &self,
        init: impl FnOnce(&Device) -> Result<T>,
    ) -> Result<Arc<T>> {
        let key = TypeId::of::<T>();
        let get = |m: &HashMap<TypeId, Arc<dyn Any + Send + Sync>>| {
            m.get(&key).cloned().and_then(|v| v.downcast::<T>().ok())
        };
        if let Some(v) = get(&self
            .inner
            .extensions
            .lock()
            .unwrap_or_else(|p| p.into_inner()))
        {
            return Ok(v);
        }
        // Initialise without the lock (it may compile kernels for seconds); first one wins.
        let fresh = Arc::new(init(self)?);
        let mut m = self
            .inner
            .extensions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(v) = get(&m) {
            return Ok(v);
        }
        m.insert(key, fresh.clone());
        Ok(fresh)
    }

    /// This device's instance of `T` if one was created before (see [`Self::extension`]);
    /// never creates one (for use inside a capture, where creating may compile or allocate).
    pub(crate) fn extension_ready<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        self.inner
            .extensions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&TypeId::of::<T>())
            .cloned()
            .and_then(|v| v.downcast::<T>().ok())
    }

    /// Whether kernels can be launched with programmatic dependent launch here (compute
    /// capability 9.0 or later and a driver with `cuLaunchKernelEx`); see
    /// [`Queue::launch_with`](crate::Queue::launch_with).
    pub fn supports_pdl(&self) -> bool {
        self.info().compute_capability.0 >= 9 && crate::runtime::module::launch_ex_available()
    }

    /// Whether kernels on this device can be launched as thread-block clusters
    /// ([`LaunchOptions::cluster`](crate::LaunchOptions::cluster): compute capability 9.0 or
    /// later and a driver with `cuLaunchKernelEx`).
    pub fn supports_clusters(&self) -> bool {
        self.supports_pdl()
    }

    /// Whether `other` is a handle to this same `Device::open` (same allocator).
    pub fn same_as(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// A new event (`timing` enables [`Event::elapsed_ms`]).
    #[track_caller]
    pub fn new_event(&self, timing: bool) -> Result<Event> {
        Event::new(&self.inner.ctx, timing)
    }

    /// `len` elements of page-locked host memory, for fast asynchronous transfers
    /// ([`Stream::pinned_scope`](crate::Stream::pinned_scope)).
    #[track_caller]
    pub fn alloc_pinned<T: Elem>(&self, len: usize) -> Result<PinnedBuffer<T>> {
        PinnedBuffer::new(len, &self.inner.ctx.handle)
    }

    /// A new, unbounded graph pool to share between captures (PyTorch's `graph_pool_handle()`).
    pub fn graph_pool_handle(&self) -> Pool {
        Pool::new(&self.inner.alloc, None)
    }

    /// A new graph pool whose reserved memory may not exceed `limit` bytes.
    pub fn new_pool_with_limit(&self, limit: usize) -> Pool {
        Pool::new(&self.inner.alloc, Some(limit))
    }

    /// Device-wide memory counters (every pool).
    pub fn memory_stats(&self) -> MemoryStats {
        self.inner.alloc.stats()
    }

    /// Counters of one pool (`PoolId::DEFAULT` for eager allocations).
    pub fn pool_stats(&self, pool: PoolId) -> MemoryStats {
        self.inner.alloc.pool_stats(pool)
    }

    /// Bytes currently handed out, device-wide (PyTorch's `memory_allocated()`).
    pub fn memory_allocated(&self) -> usize {
        self.inner.alloc.stats().allocated
    }

    /// Bytes held from the driver, device-wide (PyTorch's `memory_reserved()`).
    pub fn memory_reserved(&self) -> usize {
        self.inner.alloc.stats().reserved
    }

    /// Resets all peak counters to the current values.
    pub fn reset_peak_memory_stats(&self) {
        self.inner.alloc.reset_peak()
    }

    /// Returns unused cached segments to the driver (after waiting for the work that could
    /// still use them). Segments of pools with live graphs are kept, and nothing is released
    /// while a capture is open on this device. Returns the bytes released.
    #[track_caller]
    pub fn empty_cache(&self) -> Result<usize> {
        self.inner.alloc.empty_cache()
    }

    /// Waits for all work on the device, then reports a failed device-side check, if any.
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        self.inner.ctx.synchronize()?;
        self.check_errors()
    }

    /// Reports (and marks taken) a device-side check that failed (an index out of range, say)
    /// in work of any stream or graph of this device since its last report, as
    /// [`Error::DeviceCheck`](crate::Error::DeviceCheck). Only work that has completed can have raised it: call after a
    /// synchronisation. [`Stream::synchronize`](crate::Stream::synchronize) reports only its own stream's work.
    pub fn check_errors(&self) -> Result<()> {
        let records: Vec<Arc<CheckRecord>> = {
            let mut reg = self.registry();
            reg.all.retain(|w| w.strong_count() > 0);
            reg.all.iter().filter_map(Weak::upgrade).collect()
        };
        records.iter().try_for_each(|r| r.take())
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, CheckRegistry> {
        self.inner.checks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new check record of this device (for a capture: the graph owns it).
    pub(crate) fn new_check_record(&self) -> Result<Arc<CheckRecord>> {
        let r = Arc::new(CheckRecord::new(
            &self.inner.ctx.handle,
            self.inner.check_lock.addr(),
        )?);
        self.registry().all.push(Arc::downgrade(&r));
        Ok(r)
    }

    /// The check record of eager stream `stream`, created on first use.
    pub(crate) fn stream_check_record(&self, stream: StreamRef<'_>) -> Result<Arc<CheckRecord>> {
        if let Some(r) = self.registry().entry(stream).own.clone() {
            return Ok(r);
        }
        let fresh = self.new_check_record()?;
        let mut reg = self.registry();
        let e = reg.entry(stream);
        Ok(e.own.get_or_insert(fresh).clone())
    }

    /// Makes `stream`'s next synchronisation read `record` (a graph's, replayed there).
    pub(crate) fn watch_check(&self, stream: StreamRef<'_>, record: &Arc<CheckRecord>) {
        let mut reg = self.registry();
        let e = reg.entry(stream);
        if !e.watched.iter().any(|r| Arc::ptr_eq(r, record)) {
            e.watched.push(record.clone());
        }
    }

    /// Reports a failed device-side check of the work `stream` ran (its own record, and those
    /// of the graphs replayed on it since its last report).
    pub(crate) fn stream_check_errors(&self, stream: StreamRef<'_>) -> Result<()> {
        let (own, watched) = {
            let mut reg = self.registry();
            let Some(e) = reg.find(stream.id()) else {
                return Ok(());
            };
            (e.own.clone(), std::mem::take(&mut e.watched))
        };
        let mut result = own.as_ref().map_or(Ok(()), |r| r.take());
        let mut unread = Vec::new();
        for r in watched {
            if result.is_ok() {
                result = r.take();
            } else {
                // Read at the next synchronisation: one report per call.
                unread.push(r);
            }
        }
        if !unread.is_empty() {
            let mut reg = self.registry();
            let e = reg.entry(stream);
            for r in unread {
                if !e.watched.iter().any(|w| Arc::ptr_eq(w, &r)) {
                    e.watched.push(r);
                }
            }
        }
        result
    }

    /// Compiles (or loads from cache) a CUDA C++ module with NVRTC.
    #[track_caller]
    pub fn compile(&self, name: &str, source: &str) -> Result<Module> {
        self.inner.ctx.compile(name, source)
    }
}

/// Check records by stream (see [`checks`]).
#[derive(Default)]
struct CheckRegistry {
    all: Vec<Weak<CheckRecord>>,
    streams: Vec<StreamChecks>,
}

struct StreamChecks {
    stream: WeakStream,
    /// The record kernels launched eagerly on the stream report into.
    own: Option<Arc<CheckRecord>>,
    /// Records of graphs replayed on the stream since its last report.
    watched: Vec<Arc<CheckRecord>>,
}

impl CheckRegistry {
    fn find(&mut self, id: u64) -> Option<&mut StreamChecks> {
        self.streams.iter_mut().find(|e| e.stream.id() == id)
    }

    fn entry(&mut self, stream: StreamRef<'_>) -> &mut StreamChecks {
        if let Some(i) = self
            .streams
            .iter()
            .position(|e| e.stream.id() == stream.id())
        {
            return &mut self.streams[i];
        }
        // Streams that are gone and whose work has finished need their records no more.
        self.streams.retain(|e| !e.stream.is_done());
        self.streams.push(StreamChecks {
            stream: stream.downgrade(),
            own: None,
            watched: Vec::new(),
        });
        self.streams.last_mut().expect("just pushed")
    }
}
