//! Asynchronous transfers between device buffers and [`PinnedBuffer`]s that cannot race with the
//! host, issued inside [`Stream::pinned_scope`] in the style of `std::thread::scope`: a buffer
//! handed to an upload stays borrowed (shared) and a buffer handed to a download stays borrowed
//! (exclusively) until the scope ends, and the scope synchronises the stream before it returns
//! — also when the closure fails or panics. So the host can never write a buffer the device is
//! reading, or read one it is writing.

use std::marker::PhantomData;

use super::{check_device, check_eager, copy_mapped, Queue, Stream};
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, Elem, PinnedBuffer};
use crate::runtime::memory as raw;

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
        // A transfer recorded into a capture would outlive the scope's borrow of `src`.
        check_eager(self.stream, "a pinned upload")?;
        if src.len() != dst.len() {
            return Err(Error::SizeMismatch {
                what: "pinned upload",
                expected: dst.len(),
                got: src.len(),
            });
        }
        check_device(self.stream.device(), dst.block())?;
        self.stream.use_block(dst.block());
        self.stream.device().context().bind()?;
        // SAFETY: `src` is borrowed for 'scope, which ends only after `pinned_scope` has
        // synchronised the stream, so it stays alive and unwritten until the copy has run; the
        // lengths are equal, so `dst.bytes()` fits in `src` (`dst` declared above).
        if unsafe {
            copy_mapped(
                self.stream,
                dst.addr(),
                src.raw().device_addr(),
                dst.bytes(),
            )
        }? {
            return Ok(());
        }
        // SAFETY: as above.
        unsafe {
            raw::memcpy_htod_pinned_async(
                dst.addr(),
                src.raw(),
                dst.bytes(),
                self.stream.handle.raw(),
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
        // A transfer recorded into a capture would outlive the scope's borrow of `dst`.
        check_eager(self.stream, "a pinned download")?;
        if src.len() != dst.len() {
            return Err(Error::SizeMismatch {
                what: "pinned download",
                expected: dst.len(),
                got: src.len(),
            });
        }
        check_device(self.stream.device(), src.block())?;
        self.stream.use_block(src.block());
        self.stream.device().context().bind()?;
        // SAFETY: `dst` is exclusively borrowed for 'scope, which ends only after the stream
        // was synchronised, so nothing reads it before the copy has finished; equal lengths
        // (`src` declared above).
        if unsafe {
            copy_mapped(
                self.stream,
                dst.raw().device_addr(),
                src.addr(),
                src.bytes(),
            )
        }? {
            return Ok(());
        }
        // SAFETY: as above.
        unsafe {
            raw::memcpy_dtoh_pinned_async(
                dst.raw(),
                src.addr(),
                src.bytes(),
                self.stream.handle.raw(),
            )
        }
    }
}

/// Synchronises the stream when the scope ends, whatever way it ends.
struct SyncOnDrop<'s>(&'s Stream);

impl Drop for SyncOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self.0.handle.synchronize();
    }
}

impl Stream {
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
        check_eager(self, "a pinned transfer scope")?;
        let guard = SyncOnDrop(self);
        let sc = PinnedScope {
            stream: self,
            _scope: PhantomData,
        };
        let r = f(&sc);
        std::mem::forget(guard);
        // Always wait (not `Stream::synchronize`, which refuses a stream in a capture): the
        // borrows end when this returns.
        let synced = self
            .handle
            .synchronize()
            .and_then(|()| self.device.stream_check_errors(self.handle.as_ref()));
        let r = r?;
        synced?;
        Ok(r)
    }
}
