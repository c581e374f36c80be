//! Interoperability with [cudarc](https://docs.rs/cudarc): code written against cudarc — kernels
//! launched with its launch builder, its cuBLAS, allocations it makes on its stream — runs on
//! our streams and inside [`crate::Graph::capture`], and buffers cross both ways without copies.
//!
//! - [`Device::from_cudarc`] / [`Device::cudarc_context`]: the same primary context on both
//!   sides (cudarc's `CudaContext::new` retains it, as [`Device::open`] does).
//! - [`Stream::from_cudarc`]: a cudarc stream as our [`Stream`] (a [`Queue`]; not destroyed
//!   when our handle goes — the handle keeps cudarc's `Arc<CudaStream>` instead). Capture on
//!   it with `Graph::capture`, and inside the closure get the same cudarc stream back with
//!   [`cudarc_stream`] (`cs` is the capture stream) to run cudarc code into the graph.
//! - [`DeviceBuffer::from_cudarc`]: a `CudaSlice` as our buffer (no copy, before a capture);
//!   the buffer, and any graph that uses it, keeps the slice alive.
//! - [`DeviceBuffer::as_cudarc`]: one of our buffers as a `CudaSlice` cudarc code can take,
//!   which never frees our memory (cudarc's own unsafe `upgrade_device_ptr`/`leak`).
//!
//! # What cudarc code must avoid inside a capture
//!
//! Captured work does not run, so anything that reads results on the host or waits for the
//! device fails — the driver invalidates the capture and `Graph::capture` returns
//! [`Error::CaptureInvalidated`] or [`Error::CaptureFailed`] (the stream stays usable):
//!
//! - host reads and synchronisation: `clone_dtoh`, `memcpy_dtoh`, `synchronize`,
//!   `CudaEvent::synchronize`, `elapsed_ms`, `ctx.synchronize()`;
//! - **cudarc's multi-stream event tracking** (cudarc 0.19): once a context has created a
//!   stream with `ctx.new_stream()` (multi-stream mode) and tracking is on (the default), every
//!   launch, copy, `device_ptr` and `CudaSlice` drop records and waits on the slices' read/write
//!   events. Inside a capture those records become part of the graph, and every later wait or
//!   query of such an event outside the capture fails with `CUDA_ERROR_CAPTURED_EVENT` (cudarc
//!   stores that error and returns it from its next call). [`cudarc_stream`] and
//!   [`DeviceBuffer::as_cudarc`] refuse to hand work into a capture in that mode: call
//!   `unsafe { ctx.disable_event_tracking() }` (our queues order buffer reuse themselves), or
//!   use only streams wrapped from ours (`wrap_borrowed_stream` does not enter multi-stream mode);
//! - `ctx.new_stream()` while a capture is open: entering multi-stream mode synchronises the
//!   context;
//! - a device without stream-ordered allocation: `CudaSlice`'s drop then synchronises its
//!   stream (`has_async_alloc()` is true on every GPU that supports CUDA graphs well);
//! - slices cudarc allocates inside the capture (`alloc`, `alloc_zeros`, `clone_htod`) are
//!   graph memory: allocated by an alloc node on every replay and freed where the slice is
//!   dropped — drop them inside the closure (a free node). Keep results in buffers allocated
//!   before the capture or by the capture stream (`cs.alloc`, the graph's pool), and copy
//!   inputs in before capturing (host-to-device copies of pageable memory are not capturable).
//!
//! Graph memory nodes are the driver's memory (`cuDeviceGetGraphMemAttribute`), not our pool's:
//! they do not show in [`crate::MemoryStats`].

use std::ops::Deref;
use std::panic::Location;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaViewMut, DevicePtr, DriverError};

use crate::device::{check_eager, Device, Queue, Stream};
use crate::error::{Error, Result};
use crate::memory::{bytes_for, BlockRef, DeviceBuffer, Elem};
use crate::runtime::memory::{memory_kind, MemoryKind};
use crate::runtime::result::driver_error;
use crate::runtime::stream::raw_is_capturing;
use crate::runtime::StreamHandle;

impl From<DriverError> for Error {
    /// A cudarc driver error, as the driver call error it is (the call is not known).
    #[track_caller]
    fn from(e: DriverError) -> Self {
        driver_error(e.0, "a cudarc call", Location::caller())
    }
}

fn same_context(what: &'static str, device: &Device, ctx: &CudaContext) -> Result<()> {
    if ctx.cu_ctx() != device.context().raw_context() {
        return Err(Error::WrongDevice {
            what,
            expected: device.ordinal(),
            got: ctx.ordinal(),
        });
    }
    Ok(())
}

/// Refuses cudarc work headed into a capture while cudarc tracks events (see the module docs).
fn check_tracking(q: &(impl Queue + ?Sized), ctx: &CudaContext) -> Result<()> {
    if q.is_capturing() && ctx.is_managing_stream_synchronization() {
        return Err(Error::NotSupported {
            what: "cudarc's multi-stream event tracking inside a capture",
            detail: "the context created a stream with new_stream() and tracks events, so \
                     cudarc would record events into the graph (CUDA_ERROR_CAPTURED_EVENT \
                     later); call `unsafe { ctx.disable_event_tracking() }` before allocating \
                     the slices you capture with, or wrap our streams instead"
                .into(),
        });
    }
    Ok(())
}

impl Device {
    /// The device of a cudarc context, sharing its primary context (no new context). Each call
    /// opens a new `Device` (own allocator): call it once and clone the result.
    #[track_caller]
    pub fn from_cudarc(ctx: &CudaContext) -> Result<Device> {
        if !ctx.is_primary() {
            return Err(Error::NotSupported {
                what: "a non-primary cudarc context",
                detail: "cudagraph works in each device's primary context; create the cudarc \
                         context with CudaContext::new(ordinal)"
                    .into(),
            });
        }
        let dev = Device::open(ctx.ordinal())?;
        same_context("cudarc context", &dev, ctx)?;
        Ok(dev)
    }

    /// A cudarc context for this device: its primary context, retained once more (cudarc's
    /// `CudaContext::new`), so cudarc and cudagraph work in the same context.
    #[track_caller]
    pub fn cudarc_context(&self) -> Result<Arc<CudaContext>> {
        let ctx = CudaContext::new(self.ordinal())?;
        same_context("cudarc context", self, &ctx)?;
        Ok(ctx)
    }
}

impl Stream {
    /// A cudarc stream as our [`Stream`] (a [`Queue`] for our models, capturable with
    /// `Graph::capture`). The stream is not copied or recreated: our handle keeps `stream`
    /// alive and never destroys it. Refuses a stream of another context and cudarc's default
    /// streams (`default_stream`, `per_thread_stream`), which cannot be captured.
    #[track_caller]
    pub fn from_cudarc(device: &Device, stream: &Arc<CudaStream>) -> Result<Stream> {
        same_context("cudarc stream", device, stream.context())?;
        // SAFETY: the handle's owner is a clone of cudarc's `Arc<CudaStream>`, which keeps the
        // raw stream alive until the handle (and with it the owner) is gone.
        let handle = unsafe {
            StreamHandle::borrowed(
                device.context(),
                stream.cu_stream(),
                Arc::new(stream.clone()),
            )
        }?;
        Ok(Stream::from_handle(device.clone(), handle))
    }
}

/// The cudarc stream of a queue whose stream came from cudarc ([`Stream::from_cudarc`]),
/// eager or capturing: run cudarc code on it and, inside `Graph::capture`, it is recorded
/// into the graph. Refuses cudarc's event tracking inside a capture (see the module docs) and
/// queues on streams we created (wrap those with cudarc's own unsafe `wrap_borrowed_stream`).
#[track_caller]
pub fn cudarc_stream(q: &(impl Queue + ?Sized)) -> Result<Arc<CudaStream>> {
    let sref = q.stream_handle();
    let stream = sref
        .owner()
        .and_then(|o| o.downcast_ref::<Arc<CudaStream>>())
        .cloned()
        .ok_or(Error::NotSupported {
            what: "a cudarc view of this stream",
            detail: "the stream was created by cudagraph, not cudarc: create it with \
                     Stream::from_cudarc, or wrap its raw handle with \
                     `unsafe { ctx.wrap_borrowed_stream(q.stream_handle().raw()) }`"
                .into(),
        })?;
    check_tracking(q, stream.context())?;
    Ok(stream)
}

/// One of our buffers seen by cudarc: dereferences to a `CudaSlice<T>` over the buffer's
/// memory that never frees it (dropping this view leaks the slice back, as cudarc's `leak`),
/// and keeps the memory alive while it exists. Only shared access to the slice is given out
/// (so it cannot be swapped out and dropped); write through [`Self::as_view_mut`].
pub struct CudarcSlice<T: Elem> {
    slice: Option<CudaSlice<T>>,
    _block: Arc<BlockRef>,
}

impl<T: Elem> Deref for CudarcSlice<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        self.slice.as_ref().expect("present until drop")
    }
}

impl<T: Elem> CudarcSlice<T> {
    /// A mutable cudarc view (what cudarc's writing APIs, e.g. cuBLAS's output, take).
    pub fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice
            .as_mut()
            .expect("present until drop")
            .as_view_mut()
    }
}

impl<T: Elem> Drop for CudarcSlice<T> {
    fn drop(&mut self) {
        if let Some(s) = self.slice.take() {
            // Gives up the pointer without freeing it (our allocator owns the memory).
            let _ = s.leak();
        }
    }
}

impl<T: Elem> DeviceBuffer<T> {
    /// Wraps a cudarc slice as our buffer, without a copy. The buffer — and every graph that
    /// uses it — keeps the slice alive; it is dropped (freed by cudarc on its stream) once the
    /// last holder is gone and the work of every stream that used it has finished. Future
    /// work on `stream` waits for the work cudarc had queued on the slice's stream.
    ///
    /// Takes an eager [`Stream`] (a capture borrows its stream, so this cannot run inside one;
    /// a stream that is part of a capture anyway is refused) and refuses a slice whose stream
    /// is capturing (its memory may be graph memory, which the graph frees) and a slice the
    /// driver does not report as device memory (graph memory before its graph's first launch,
    /// say). A slice allocated inside a capture that has since ended is graph memory the
    /// driver cannot tell apart: allocate the slices you wrap outside captures.
    #[track_caller]
    pub fn from_cudarc(slice: CudaSlice<T>, stream: &Stream) -> Result<Self> {
        let q = stream;
        check_eager(q, "wrapping a cudarc slice")?;
        let dev = q.device();
        same_context("cudarc slice", dev, slice.context())?;
        dev.context().bind()?;
        let slice_stream = slice.stream().clone();
        let refuse = || Error::NotSupported {
            what: "wrapping a cudarc slice allocated inside a capture",
            detail: "that is graph memory, freed by the graph; allocate it before capturing".into(),
        };
        // SAFETY: the slice's stream is alive (the slice holds it).
        if unsafe { raw_is_capturing(slice_stream.cu_stream()) }? {
            return Err(refuse());
        }
        let addr = {
            let (ptr, _record) = slice.device_ptr(&slice_stream);
            ptr
        };
        let len = slice.len();
        let bytes = bytes_for::<T>("cudarc slice", len)?;
        if bytes > 0 && memory_kind(addr)? != MemoryKind::Device {
            return Err(Error::NotSupported {
                what: "wrapping a cudarc slice the driver does not report as device memory",
                detail: format!(
                    "address {addr:#x} is not device memory the driver knows (graph memory \
                     before its graph's first launch, or not device memory at all)"
                ),
            });
        }
        if slice_stream.cu_stream() != q.stream_handle().raw() {
            let done = slice_stream.record_event(None)?;
            // Asked after the record: if the slice's stream is capturing now, `done` may be a
            // captured event, and waiting on it would pull our stream into that capture. (A
            // capture that began and ended in between left `done` captured into a finished
            // graph, which no stream can join.)
            // SAFETY: the slice's stream is alive (the slice holds it).
            if unsafe { raw_is_capturing(slice_stream.cu_stream()) }? {
                return Err(refuse());
            }
            // SAFETY: `q`'s stream is alive for this call (we borrow `q`); the wrapper is
            // dropped right after the wait and does not own the stream.
            let ours = unsafe {
                slice_stream
                    .context()
                    .wrap_borrowed_stream(q.stream_handle().raw())
            };
            ours.wait(&done)?;
        }
        // SAFETY: `slice` moves into the block as its keep-alive: nothing else can free or use
        // the memory, which stays allocated until the block drops it (after the last holder is
        // gone and every stream that used it has finished, as `BlockRef::external` promises).
        let block = unsafe { BlockRef::external(addr, bytes, dev.ordinal(), Box::new(slice)) };
        DeviceBuffer::from_block(block, len)
    }

    /// This buffer as a `CudaSlice` for cudarc code running on `stream`, which must be `q`'s
    /// stream as cudarc sees it ([`cudarc_stream`], or cudarc's `wrap_borrowed_stream` of
    /// `q.stream_handle().raw()`). Declares the use on `q` (inside a capture the graph keeps
    /// the buffer alive). The view never frees our memory.
    ///
    /// # Safety
    /// cudarc work that uses the view must run on `stream` — or on a stream whose work is
    /// ordered before later work on `q`'s stream (cudarc orders it itself when its context
    /// manages stream synchronisation) — and must stay inside the buffer's `len()` elements,
    /// as for any kernel launch. If `stream` is a borrowed wrapper of one of our streams, do
    /// not use it (or the view's `stream()`) after that stream is dropped.
    #[track_caller]
    pub unsafe fn as_cudarc(
        &self,
        q: &(impl Queue + ?Sized),
        stream: &Arc<CudaStream>,
    ) -> Result<CudarcSlice<T>> {
        let dev = q.device();
        same_context("cudarc stream", dev, stream.context())?;
        if stream.cu_stream() != q.stream_handle().raw() {
            return Err(Error::NotSupported {
                what: "a cudarc view for another stream",
                detail: "pass the queue's own stream as cudarc sees it (cudarc_stream(q))".into(),
            });
        }
        check_eager(q, "a cudarc view of a buffer")?;
        crate::device::check_device(dev, self.block())?;
        check_tracking(q, stream.context())?;
        q.use_block(self.block());
        dev.context().bind()?;
        // SAFETY: the address and length describe this buffer's memory, which the returned
        // view keeps alive (it holds the block); the slice is leaked, never freed, on drop.
        let slice = unsafe { stream.upgrade_device_ptr::<T>(self.addr(), self.len()) };
        Ok(CudarcSlice {
            slice: Some(slice),
            _block: self.block().clone(),
        })
    }
}
