//! The user's view of a GPU: a [`Device`] (context, caching allocator, device-side error flag),
//! eager [`Stream`]s, and the [`Queue`] trait that eager streams and capture streams share, so
//! the same model code runs eagerly or inside a capture.
//!
//! Threads: `Device`, `Stream`, `DeviceBuffer`, `PinnedBuffer` and `Graph` are `Send + Sync`.
//! CUDA streams accept work from any thread, every driver call binds the device's context
//! first, the allocator is behind a mutex, and graphs serialise their own driver calls.
//! `CaptureStream` is neither (a capture belongs to the thread that runs its closure).

mod checks;
mod copy;
mod pinned_scope;
mod queue;

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};

pub(crate) use checks::CheckRecord;
pub use checks::{register_check, DEVICE_CHECK_CUDA};
pub(crate) use copy::prepare as prepare_copy_kernels;
pub use copy::{
    kernel_copy_fits, mapped_copy_fits, COPY_CUDA, COPY_KERNEL_VAR, MAX_KERNEL_COPY,
    MAX_MAPPED_COPY,
};
pub use pinned_scope::PinnedScope;
pub(crate) use queue::copy_mapped;
pub(crate) use queue::sealed::Sealed;
pub(crate) use queue::{check_device, check_eager, check_range};
pub use queue::{Anchor, Arg, EndWork, LaunchOptions, Queue, QueueExt, PDL_CUDA};

use crate::error::{Error, Result};
use crate::memory::{
    hold_forever, source::DeviceSource, Allocator, BlockRef, DeviceBuffer, Elem, MemoryStats,
    PinnedBuffer, Pool, PoolId,
};
use crate::runtime::memory as raw;
use crate::runtime::primary::Quiet;
use crate::runtime::{
    Context, DeviceInfo, Event, Function, Module, StreamHandle, StreamRef, WeakStream,
};

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
    /// Opens CUDA device `ordinal`. Fails with [`Error::NoDriver`] on a machine without the
    /// NVIDIA driver and [`Error::NoDevice`] for an ordinal the driver does not know.
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

    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    pub fn info(&self) -> &DeviceInfo {
        self.inner.ctx.info()
    }

    pub fn ordinal(&self) -> usize {
        self.inner.ctx.ordinal()
    }

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
    /// [`Queue::launch_with`].
    pub fn supports_pdl(&self) -> bool {
        self.info().compute_capability.0 >= 9 && crate::runtime::module::launch_ex_available()
    }

    /// Whether `other` is a handle to this same `Device::open` (same allocator).
    pub fn same_as(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// A new non-blocking stream.
    #[track_caller]
    pub fn new_stream(&self) -> Result<Stream> {
        Ok(Stream {
            handle: StreamHandle::new(&self.inner.ctx)?,
            device: self.clone(),
        })
    }

    /// A new event (`timing` enables [`Event::elapsed_ms`]).
    #[track_caller]
    pub fn new_event(&self, timing: bool) -> Result<Event> {
        Event::new(&self.inner.ctx, timing)
    }

    /// `len` elements of page-locked host memory, for fast asynchronous transfers
    /// ([`Stream::pinned_scope`]).
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
    /// [`Error::DeviceCheck`]. Only work that has completed can have raised it: call after a
    /// synchronisation. [`Stream::synchronize`] reports only its own stream's work.
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

/// An eager stream: work runs as it is enqueued. Adds host transfers and synchronisation to
/// the [`Queue`] operations. A capture borrows a stream mutably, so none of these methods can
/// be called on the stream while it is capturing.
///
/// A stream can still be part of a capture it did not begin: a side stream that a capture
/// forked onto ([`crate::Fork::fork`]) stays in the capture until the capture ends, and a
/// stream wrapped from cudarc ([`Stream::from_cudarc`]) can be captured by cudarc. While it is
/// ([`StreamRef::in_capture`]), every method that enqueues work or waits — the [`Queue`]
/// operations, copies, fills, launches, `synchronize`, `record`, `wait_for`, `wait_event`,
/// [`Stream::pinned_scope`] — fails with [`Error::InvalidGraph`] and enqueues nothing: the
/// graph would not keep the buffers that work uses. (Buffers that CUDA libraries declare with
/// [`Queue::use_block`] on such a stream, which cannot fail, are kept alive for the rest of the
/// process instead.) The check is an atomic load for our own streams and one
/// `cuStreamIsCapturing` for streams wrapped from cudarc.
pub struct Stream {
    pub(crate) handle: StreamHandle,
    device: Device,
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} on {:?}", self.handle, self.device)
    }
}

impl Stream {
    /// A stream of `device` over `handle` (for streams wrapped from other libraries).
    pub(crate) fn from_handle(device: Device, handle: StreamHandle) -> Stream {
        Stream { handle, device }
    }

    /// Blocks until all work enqueued on this stream has finished, then reports a device-side
    /// check that failed in work this stream ran (its kernels and the graphs replayed on it),
    /// if any. Other streams' reports stay theirs.
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        self.check_eager("synchronize")?;
        self.handle.synchronize()?;
        self.device.stream_check_errors(self.handle.as_ref())
    }

    /// Makes later work on this stream wait for everything enqueued on `other` so far. Refused
    /// while `other` is capturing (the wait would pull this stream into the capture).
    #[track_caller]
    pub fn wait_for(&self, other: &Stream) -> Result<()> {
        self.check_eager("wait_for")?;
        self.handle.wait_for(&other.handle)
    }

    /// Records `event` here.
    #[track_caller]
    pub fn record(&self, event: &Event) -> Result<()> {
        self.check_eager("record")?;
        self.handle.record(event)
    }

    /// Makes later work here wait for `event`. Refused when `event` was recorded inside a
    /// capture (see [`StreamRef::wait_event`]).
    #[track_caller]
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.check_eager("wait_event")?;
        self.handle.wait_event(event)
    }

    /// Refuses `what` while this stream is part of a capture (see the type's docs).
    #[track_caller]
    fn check_eager(&self, what: &'static str) -> Result<()> {
        self.handle.as_ref().check_eager(what)
    }

    /// The owned stream handle (ids, raw handle for libraries).
    pub fn handle(&self) -> &StreamHandle {
        &self.handle
    }

    /// Copies host data into `dst` (same length). `src` may be reused as soon as this returns:
    /// pageable memory is staged by the driver before the call returns; page-locked memory
    /// (a [`PinnedBuffer`]'s slice, cudarc's pinned memory, a registered range) is read by an
    /// asynchronous DMA, so for it this also waits for the stream (use
    /// [`Stream::pinned_scope`] for transfers that overlap with other work).
    #[track_caller]
    pub fn copy_from_host<T: Elem>(&self, src: &[T], dst: &DeviceBuffer<T>) -> Result<()> {
        self.check_eager("a host-to-device copy")?;
        if src.len() != dst.len() {
            return Err(Error::SizeMismatch {
                what: "host-to-device copy",
                expected: dst.len(),
                got: src.len(),
            });
        }
        check_device(&self.device, dst.block())?;
        if src.is_empty() {
            return Ok(());
        }
        self.use_block(dst.block());
        self.device.context().bind()?;
        raw::memcpy_htod_from_host(dst.addr(), T::as_bytes(src), self.handle.raw())
    }

    /// Allocates a buffer and fills it from host data.
    #[track_caller]
    pub fn alloc_from_host<T: Elem>(&self, src: &[T]) -> Result<DeviceBuffer<T>> {
        let b = self.alloc(src.len())?;
        self.copy_from_host(src, &b)?;
        Ok(b)
    }

    /// Waits for this stream, then copies `src` into `dst` on the host. Reports a failed
    /// device-side check like [`Stream::synchronize`].
    #[track_caller]
    pub fn copy_to_host<T: Elem>(&self, src: &DeviceBuffer<T>, dst: &mut [T]) -> Result<()> {
        self.check_eager("a device-to-host copy")?;
        if src.len() != dst.len() {
            return Err(Error::SizeMismatch {
                what: "device-to-host copy",
                expected: dst.len(),
                got: src.len(),
            });
        }
        check_device(&self.device, src.block())?;
        if !dst.is_empty() {
            self.use_block(src.block());
            self.device.context().bind()?;
            raw::memcpy_dtoh_sync(T::as_bytes_mut(dst), src.addr(), self.handle.raw())?;
        }
        self.device.stream_check_errors(self.handle.as_ref())
    }

    /// Waits for this stream and returns the contents of `src`.
    #[track_caller]
    pub fn to_vec<T: Elem>(&self, src: &DeviceBuffer<T>) -> Result<Vec<T>> {
        let mut v = vec![T::default(); src.len()];
        self.copy_to_host(src, &mut v)?;
        Ok(v)
    }

    /// Whether the driver reports a capture open on this stream (it never should be outside
    /// [`crate::Graph::capture`]; useful in tests).
    #[track_caller]
    pub fn driver_is_capturing(&self) -> Result<bool> {
        self.handle.as_ref().is_capturing()
    }
}

impl Queue for Stream {
    fn device(&self) -> &Device {
        &self.device
    }

    fn stream_handle(&self) -> StreamRef<'_> {
        self.handle.as_ref()
    }

    fn capture_id(&self) -> Option<u64> {
        None
    }

    #[track_caller]
    fn alloc_block(&self, bytes: usize) -> Result<Arc<BlockRef>> {
        self.check_eager("an allocation")?;
        let alloc = self.device.allocator();
        alloc.allocate_block(bytes, self.handle.as_ref())
    }

    fn at_end(&self, _key: usize, work: EndWork) -> Result<()> {
        // Eagerly the end is now.
        work(self)
    }

    fn check_flag_arg(&self) -> Result<Arg<'static>> {
        self.check_eager("a device-side check")?;
        let r = self.device.stream_check_record(self.handle.as_ref())?;
        Ok(Arg::Ptr {
            addr: r.device_addr(),
            holder: None,
        })
    }

    fn use_block(&self, block: &Arc<BlockRef>) {
        // Also keeps the block for good if this stream is part of a capture (see `note_use`).
        block.note_use(self.handle.as_ref());
    }

    fn keep_alive(&self, anchor: Anchor) {
        // Eagerly nothing to keep; in a capture no graph of ours would keep it (see the
        // type's docs), so it is kept for the rest of the process.
        if self.handle.as_ref().in_capture().unwrap_or(true) {
            hold_forever(anchor);
        }
    }

    fn hold_function(&self, f: &Function) {
        if self.handle.as_ref().in_capture().unwrap_or(true) {
            hold_forever(Arc::new(f.clone()));
        }
    }
}
