//! [`Stream`]: an eager stream of one [`Device`] — host transfers, synchronisation, events —
//! and its [`Queue`] implementation (allocation on the stream, stream-safe reuse of blocks
//! used elsewhere, launches checked as for every queue).

use std::fmt;
use std::sync::Arc;

use super::gpu::Device;
use super::queue::{check_device, sealed, Anchor, Arg, EndWork, Queue, QueueExt};
use crate::error::{Error, Result};
use crate::memory::{hold_forever, BlockRef, DeviceBuffer, Elem};
use crate::runtime::memory as raw;
use crate::runtime::{Event, Function, StreamHandle, StreamRef};

impl Device {
    /// A new non-blocking stream.
    #[track_caller]
    pub fn new_stream(&self) -> Result<Stream> {
        Ok(Stream {
            handle: StreamHandle::new(self.context())?,
            device: self.clone(),
        })
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
    pub(super) device: Device,
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
    /// (a [`PinnedBuffer`](crate::PinnedBuffer)'s slice, cudarc's pinned memory, a registered range) is read by an
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

impl sealed::Sealed for Stream {}
