//! The user's view of a GPU: a [`Device`] (context + caching allocator), eager [`Stream`]s, and
//! the [`Queue`] trait that eager streams and capture streams share, so the same model code runs
//! eagerly or inside a capture.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::memory::{
    source::DeviceSource, Allocator, BlockRef, DeviceBuffer, Elem, MemoryStats, PinnedBuffer,
    PinnedScope, Pool, PoolId,
};
use crate::runtime::{
    driver, Arg, Context, DeviceInfo, Event, Function, LaunchConfig, Module, StreamHandle,
};

/// One GPU: its CUDA context and the caching allocator every buffer comes from.
/// Cheap to clone (all clones share the context and allocator).
#[derive(Clone)]
pub struct Device {
    ctx: Context,
    alloc: Arc<Allocator>,
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
        let alloc = Allocator::new(
            Box::new(DeviceSource {
                ctx: ctx.handle.clone(),
            }),
            ordinal,
        );
        Ok(Self { ctx, alloc })
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }

    pub fn info(&self) -> &DeviceInfo {
        self.ctx.info()
    }

    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    pub fn allocator(&self) -> &Arc<Allocator> {
        &self.alloc
    }

    /// A new non-blocking stream.
    #[track_caller]
    pub fn new_stream(&self) -> Result<Stream> {
        Ok(Stream {
            handle: self.ctx.new_stream_handle()?,
            device: self.clone(),
        })
    }

    /// A new event (`timing` enables [`Event::elapsed_ms`]).
    #[track_caller]
    pub fn new_event(&self, timing: bool) -> Result<Event> {
        self.ctx.new_event(timing)
    }

    /// `len` elements of page-locked host memory, for fast asynchronous transfers
    /// ([`Stream::pinned_scope`]).
    #[track_caller]
    pub fn alloc_pinned<T: Elem>(&self, len: usize) -> Result<PinnedBuffer<T>> {
        PinnedBuffer::new(len, self.ctx.handle.raw)
    }

    /// A new, unbounded graph pool to share between captures (PyTorch's `graph_pool_handle()`).
    pub fn graph_pool_handle(&self) -> Pool {
        self.alloc.new_pool(None)
    }

    /// A new graph pool whose reserved memory may not exceed `limit` bytes.
    pub fn new_pool_with_limit(&self, limit: usize) -> Pool {
        self.alloc.new_pool(Some(limit))
    }

    /// Device-wide memory counters (every pool).
    pub fn memory_stats(&self) -> MemoryStats {
        self.alloc.stats()
    }

    /// Counters of one pool (`PoolId::DEFAULT` for eager allocations).
    pub fn pool_stats(&self, pool: PoolId) -> MemoryStats {
        self.alloc.pool_stats(pool)
    }

    /// Bytes currently handed out, device-wide (PyTorch's `memory_allocated()`).
    pub fn memory_allocated(&self) -> usize {
        self.alloc.stats().allocated
    }

    /// Bytes held from the driver, device-wide (PyTorch's `memory_reserved()`).
    pub fn memory_reserved(&self) -> usize {
        self.alloc.stats().reserved
    }

    /// Resets all peak counters to the current values.
    pub fn reset_peak_memory_stats(&self) {
        self.alloc.reset_peak()
    }

    /// Waits for all outstanding work, then returns unused cached segments to the driver.
    /// Segments of pools with live graphs are kept. Returns the bytes released.
    #[track_caller]
    pub fn empty_cache(&self) -> Result<usize> {
        self.ctx.bind()?;
        self.alloc.empty_cache()
    }

    /// Waits for all work on the device.
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.synchronize()
    }

    /// Compiles (or loads from cache) a CUDA C++ module with NVRTC.
    #[track_caller]
    pub fn compile(&self, name: &str, source: &str) -> Result<Module> {
        self.ctx.compile(name, source)
    }
}

/// Operations that both an eager [`Stream`] and a [`crate::CaptureStream`] accept: allocate,
/// launch, copy and fill on the device. Nothing here blocks the host or reads device memory
/// back, which is what makes every method legal inside a capture. Write model code against
/// `&impl Queue` and it runs eagerly or captured unchanged.
pub trait Queue {
    /// The device this queue runs on.
    fn device(&self) -> &Device;

    /// The underlying stream (for CUDA libraries such as cuBLAS).
    fn stream_handle(&self) -> &StreamHandle;

    /// Allocates `len` elements (contents undefined): from the default pool on an eager stream,
    /// from the capture's pool inside a capture.
    #[track_caller]
    fn alloc<T: Elem>(&self, len: usize) -> Result<DeviceBuffer<T>>;

    /// Keeps `block` alive for as long as the graph being captured lives (no-op when eager).
    /// Call it for buffers passed to CUDA libraries by raw address.
    fn hold(&self, block: &Arc<BlockRef>);

    /// The id of the capture recording this queue's work, `None` when eager.
    fn capture_id(&self) -> Option<u64>;

    /// Whether work on this queue is being recorded into a graph rather than run.
    fn is_capturing(&self) -> bool {
        self.capture_id().is_some()
    }

    /// Launches a kernel.
    #[track_caller]
    fn launch(&self, f: &Function, cfg: LaunchConfig, args: &[Arg<'_>]) -> Result<()> {
        for a in args {
            if let Arg::Ptr {
                holder: Some(b), ..
            } = a
            {
                check_device(self.device(), b)?;
                self.hold(b);
            }
        }
        self.stream_handle().launch(f, cfg, args)
    }

    /// Allocates `len` zeroed elements.
    #[track_caller]
    fn alloc_zeroed<T: Elem>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let b = self.alloc(len)?;
        self.memset_zero(&b)?;
        Ok(b)
    }

    /// Copies all of `src` into `dst` (equal lengths).
    #[track_caller]
    fn copy<T: Elem>(&self, src: &DeviceBuffer<T>, dst: &DeviceBuffer<T>) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::SizeMismatch {
                what: "device copy",
                expected: dst.len(),
                got: src.len(),
            });
        }
        self.copy_range(src, 0, dst, 0, src.len())
    }

    /// Copies `len` elements from `src[src_offset..]` to `dst[dst_offset..]`.
    #[track_caller]
    fn copy_range<T: Elem>(
        &self,
        src: &DeviceBuffer<T>,
        src_offset: usize,
        dst: &DeviceBuffer<T>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_range("copy source", src_offset, len, src.len())?;
        check_range("copy destination", dst_offset, len, dst.len())?;
        check_device(self.device(), src.block())?;
        check_device(self.device(), dst.block())?;
        if len == 0 {
            return Ok(());
        }
        self.hold(src.block());
        self.hold(dst.block());
        let sz = std::mem::size_of::<T>();
        bind(self)?;
        driver::memcpy_dtod_async(
            dst.addr() + (dst_offset * sz) as u64,
            src.addr() + (src_offset * sz) as u64,
            len * sz,
            self.stream_handle().raw,
        )
    }

    /// Sets every byte of `buf` to zero.
    #[track_caller]
    fn memset_zero<T: Elem>(&self, buf: &DeviceBuffer<T>) -> Result<()> {
        check_device(self.device(), buf.block())?;
        if buf.is_empty() {
            return Ok(());
        }
        self.hold(buf.block());
        bind(self)?;
        driver::memset_d8_async(buf.addr(), 0, buf.bytes(), self.stream_handle().raw)
    }

    /// Sets the bytes of elements `offset..offset + len` to zero.
    #[track_caller]
    fn memset_zero_range<T: Elem>(
        &self,
        buf: &DeviceBuffer<T>,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        check_range("memset", offset, len, buf.len())?;
        check_device(self.device(), buf.block())?;
        if len == 0 {
            return Ok(());
        }
        self.hold(buf.block());
        bind(self)?;
        let sz = std::mem::size_of::<T>();
        driver::memset_d8_async(
            buf.addr() + (offset * sz) as u64,
            0,
            len * sz,
            self.stream_handle().raw,
        )
    }

    /// Sets `len` 32-bit elements starting at `offset` to `value` (f32, i32 or u32 buffers).
    #[track_caller]
    fn fill32<T: Elem>(
        &self,
        buf: &DeviceBuffer<T>,
        offset: usize,
        len: usize,
        value: T,
    ) -> Result<()> {
        if std::mem::size_of::<T>() != 4 {
            return Err(Error::SizeMismatch {
                what: "fill32 element size",
                expected: 4,
                got: std::mem::size_of::<T>(),
            });
        }
        check_range("fill", offset, len, buf.len())?;
        check_device(self.device(), buf.block())?;
        if len == 0 {
            return Ok(());
        }
        let bytes = T::as_bytes(std::slice::from_ref(&value));
        let word = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        self.hold(buf.block());
        bind(self)?;
        driver::memset_d32_async(
            buf.addr() + (offset * 4) as u64,
            word,
            len,
            self.stream_handle().raw,
        )
    }
}

#[track_caller]
fn bind<Q: Queue + ?Sized>(q: &Q) -> Result<()> {
    q.device().context().bind()
}

pub(crate) fn check_range(
    what: &'static str,
    start: usize,
    len: usize,
    total: usize,
) -> Result<()> {
    match start.checked_add(len) {
        Some(end) if end <= total => Ok(()),
        _ => Err(Error::OutOfRange {
            what,
            start,
            end: start.saturating_add(len),
            len: total,
        }),
    }
}

pub(crate) fn check_device(device: &Device, block: &BlockRef) -> Result<()> {
    if block.device_ordinal() != device.ordinal() {
        return Err(Error::WrongDevice {
            what: "buffer",
            expected: device.ordinal(),
            got: block.device_ordinal(),
        });
    }
    Ok(())
}

/// An eager stream: work runs as it is enqueued. Adds host transfers and synchronisation to
/// the [`Queue`] operations. A capture borrows a stream mutably, so none of these methods can
/// be called on the stream while it is capturing.
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
    /// Blocks until all work enqueued on this stream has finished.
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        self.handle.synchronize()
    }

    /// Makes later work on this stream wait for everything enqueued on `other` so far.
    #[track_caller]
    pub fn wait_for(&self, other: &Stream) -> Result<()> {
        self.handle.wait_for(&other.handle)
    }

    /// Records `event` here.
    #[track_caller]
    pub fn record(&self, event: &Event) -> Result<()> {
        self.handle.record(event)
    }

    /// Copies host data into `dst` (same length). `src` may be reused as soon as this returns.
    #[track_caller]
    pub fn copy_from_host<T: Elem>(&self, src: &[T], dst: &DeviceBuffer<T>) -> Result<()> {
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
        self.device.context().bind()?;
        driver::memcpy_htod_pageable(dst.addr(), T::as_bytes(src), self.handle.raw)
    }

    /// Allocates a buffer and fills it from host data.
    #[track_caller]
    pub fn alloc_from_host<T: Elem>(&self, src: &[T]) -> Result<DeviceBuffer<T>> {
        let b = self.alloc(src.len())?;
        self.copy_from_host(src, &b)?;
        Ok(b)
    }

    /// Waits for this stream, then copies `src` into `dst` on the host.
    #[track_caller]
    pub fn copy_to_host<T: Elem>(&self, src: &DeviceBuffer<T>, dst: &mut [T]) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::SizeMismatch {
                what: "device-to-host copy",
                expected: dst.len(),
                got: src.len(),
            });
        }
        check_device(&self.device, src.block())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.device.context().bind()?;
        driver::memcpy_dtoh_sync(T::as_bytes_mut(dst), src.addr(), self.handle.raw)
    }

    /// Waits for this stream and returns the contents of `src`.
    #[track_caller]
    pub fn to_vec<T: Elem>(&self, src: &DeviceBuffer<T>) -> Result<Vec<T>> {
        let mut v = vec![T::default(); src.len()];
        self.copy_to_host(src, &mut v)?;
        Ok(v)
    }

    /// Runs `f` with a scope for asynchronous transfers between device buffers and
    /// [`PinnedBuffer`]s on this stream, then waits for the stream. Buffers handed to the scope
    /// stay borrowed until it ends, so the host cannot touch memory a transfer is using; the
    /// stream is synchronised even when `f` fails or panics.
    ///
    /// ```no_run
    /// # use cudagraph::*;
    /// # fn main() -> Result<()> {
    /// # let dev = Device::open(0)?;
    /// let s = dev.new_stream()?;
    /// let mut host_in = dev.alloc_pinned::<f32>(1024)?;
    /// let mut host_out = dev.alloc_pinned::<f32>(1024)?;
    /// host_in.as_mut_slice().fill(1.0);
    /// let x = s.alloc::<f32>(1024)?;
    /// s.pinned_scope(|sc| {
    ///     sc.upload(&host_in, &x)?;
    ///     // ... launch work on sc.stream() ...
    ///     sc.download(&x, &mut host_out)
    /// })?;
    /// assert_eq!(host_out.as_slice()[0], 1.0);
    /// # Ok(()) }
    /// ```
    pub fn pinned_scope<'s, R>(
        &'s self,
        f: impl for<'scope> FnOnce(&PinnedScope<'scope, 's>) -> Result<R>,
    ) -> Result<R> {
        crate::memory::pinned::scope(self, f)
    }

    /// Whether the driver reports a capture open on this stream (it never should be outside
    /// [`crate::Graph::capture`]; useful in tests).
    #[track_caller]
    pub fn driver_is_capturing(&self) -> Result<bool> {
        self.device.context().bind()?;
        driver::stream_is_capturing(self.handle.raw)
    }
}

impl Queue for Stream {
    fn device(&self) -> &Device {
        &self.device
    }

    fn stream_handle(&self) -> &StreamHandle {
        &self.handle
    }

    #[track_caller]
    fn alloc<T: Elem>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let block = self.device.alloc.allocate_block(
            len * std::mem::size_of::<T>(),
            PoolId::DEFAULT,
            self.handle.id(),
            0,
        )?;
        Ok(DeviceBuffer::from_block(block, len))
    }

    fn hold(&self, _block: &Arc<BlockRef>) {}

    fn capture_id(&self) -> Option<u64> {
        None
    }
}
