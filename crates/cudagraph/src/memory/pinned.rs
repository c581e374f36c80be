//! Page-locked host buffers and asynchronous transfers that cannot race with the host.
//!
//! [`PinnedBuffer`] is host memory the device copies to and from with DMA. Transfers are issued
//! inside [`crate::Stream::pinned_scope`], in the style of `std::thread::scope`: a buffer handed
//! to an upload stays borrowed (shared) and a buffer handed to a download stays borrowed
//! (exclusively) until the scope ends, and the scope synchronises the stream before it returns
//! — also when the closure fails or panics. So the host can never write a buffer the device is
//! reading, or read one it is writing.

use std::fmt;
use std::marker::PhantomData;

use crate::device::{check_device, Stream};
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, Elem};
use crate::runtime::driver::{self, PinnedAlloc};

/// `len` elements of `T` in page-locked host memory.
pub struct PinnedBuffer<T: Elem> {
    raw: PinnedAlloc,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Elem> fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "PinnedBuffer<{}>[{}]",
            std::any::type_name::<T>(),
            self.len
        )
    }
}

impl<T: Elem> PinnedBuffer<T> {
    pub(crate) fn new(len: usize, ctx: driver::RawContext) -> Result<Self> {
        Ok(Self {
            raw: PinnedAlloc::new(len * std::mem::size_of::<T>(), ctx)?,
            len,
            _t: PhantomData,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The contents (zero-initialised at allocation).
    pub fn as_slice(&self) -> &[T] {
        self.raw.typed(self.len)
    }

    /// The contents, writable.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: `&mut self` is the only access to the allocation; transfers borrow the
        // buffer for their whole scope, so none is in flight while this borrow exists.
        unsafe { self.raw.typed_mut_unchecked(self.len) }
    }
}

/// Asynchronous pinned transfers on one stream; see [`Stream::pinned_scope`].
///
/// Touching a buffer while a transfer may still use it does not compile:
///
/// ```compile_fail
/// # use cudagraph::*;
/// # fn f(s: &Stream, dev: &Device, x: &DeviceBuffer<f32>) -> Result<()> {
/// let mut h = dev.alloc_pinned::<f32>(4)?;
/// s.pinned_scope(|sc| {
///     sc.upload(&h, x)?;
///     h.as_mut_slice()[0] = 1.0; // error: `h` is borrowed by the upload until the scope ends
///     Ok(())
/// })
/// # }
/// ```
///
/// ```compile_fail
/// # use cudagraph::*;
/// # fn f(s: &Stream, dev: &Device, x: &DeviceBuffer<f32>) -> Result<()> {
/// let mut h = dev.alloc_pinned::<f32>(4)?;
/// s.pinned_scope(|sc| {
///     sc.download(x, &mut h)?;
///     println!("{}", h.as_slice()[0]); // error: the download still holds `h`
///     Ok(())
/// })
/// # }
/// ```
pub struct PinnedScope<'scope, 's: 'scope> {
    stream: &'s Stream,
    // Invariant in 'scope, as in std::thread::Scope: borrows handed in must last the scope.
    _scope: PhantomData<&'scope mut &'scope ()>,
}

impl<'scope, 's> PinnedScope<'scope, 's> {
    /// The stream the transfers run on (launch work between uploads and downloads here).
    pub fn stream(&self) -> &'s Stream {
        self.stream
    }

    /// Enqueues `src → dst` (equal lengths). `src` stays borrowed until the scope ends.
    #[track_caller]
    pub fn upload<T: Elem>(
        &self,
        src: &'scope PinnedBuffer<T>,
        dst: &DeviceBuffer<T>,
    ) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::SizeMismatch {
                what: "pinned upload",
                expected: dst.len(),
                got: src.len(),
            });
        }
        check_device(crate::Queue::device(self.stream), dst.block())?;
        crate::Queue::device(self.stream).context().bind()?;
        // SAFETY: `src` is borrowed for 'scope, which ends only after `pinned_scope` has
        // synchronised the stream, so it stays alive and unwritten until the copy has run.
        unsafe {
            driver::memcpy_htod_pinned_async(
                dst.addr(),
                &src.raw,
                dst.bytes(),
                self.stream.handle.raw,
            )
        }
    }

    /// Enqueues `src → dst` (equal lengths). `dst` stays exclusively borrowed until the scope
    /// ends; read it after [`Stream::pinned_scope`] returns.
    #[track_caller]
    pub fn download<T: Elem>(
        &self,
        src: &DeviceBuffer<T>,
        dst: &'scope mut PinnedBuffer<T>,
    ) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::SizeMismatch {
                what: "pinned download",
                expected: dst.len(),
                got: src.len(),
            });
        }
        check_device(crate::Queue::device(self.stream), src.block())?;
        crate::Queue::device(self.stream).context().bind()?;
        // SAFETY: `dst` is exclusively borrowed for 'scope, which ends only after the stream
        // was synchronised, so nothing reads it before the copy has finished.
        unsafe {
            driver::memcpy_dtoh_pinned_async(
                &dst.raw,
                src.addr(),
                src.bytes(),
                self.stream.handle.raw,
            )
        }
    }
}

/// Synchronises the stream when the scope ends, whatever way it ends.
pub(crate) struct SyncOnDrop<'s>(pub(crate) &'s Stream);

impl Drop for SyncOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self.0.synchronize();
    }
}

pub(crate) fn scope<'s, R>(
    stream: &'s Stream,
    f: impl for<'scope> FnOnce(&PinnedScope<'scope, 's>) -> Result<R>,
) -> Result<R> {
    let guard = SyncOnDrop(stream);
    let sc = PinnedScope {
        stream,
        _scope: PhantomData,
    };
    let r = f(&sc);
    std::mem::forget(guard);
    let synced = stream.synchronize();
    let r = r?;
    synced?;
    Ok(r)
}
