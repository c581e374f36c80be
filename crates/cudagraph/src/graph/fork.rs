//! Work on a second stream: [`Fork`] (implemented by eager [`Stream`]s and
//! [`CaptureStream`]s) starts a [`SideStream`] that runs beside the main queue and joins back —
//! two streams ordered by events when eager, a parallel branch of the graph inside a capture —
//! and [`warmup`], PyTorch's warm-up on a side stream before a capture.

use std::fmt;
use std::sync::Arc;

use super::capture::CaptureStream;
use crate::device::{Anchor, Arg, Device, EndWork, Queue, Stream};
use crate::error::{Error, Result};
use crate::memory::BlockRef;
use crate::runtime::{Function, StreamHandle, StreamRef};

/// A queue whose work can branch onto a second stream and join back: an eager [`Stream`] or a
/// [`CaptureStream`]. Code written against `&dyn Fork` overlaps work on two streams eagerly and
/// records the same overlap as parallel branches of a graph when captured.
pub trait Fork: Queue {
    /// Starts a side branch on `side`: work enqueued on the returned [`SideStream`] runs after
    /// everything enqueued here so far, concurrently with what is enqueued here afterwards,
    /// until [`SideStream::join`] makes this queue wait for it.
    ///
    /// `side` must be another stream of the same device, not capturing. It stays borrowed
    /// until the branch ends. Inside a capture the side stream joins the capture (the driver
    /// keeps it there until the capture ends, so do not use it eagerly inside the closure).
    ///
    /// ```no_run
    /// # use cudagraph::*;
    /// # fn main() -> Result<()> {
    /// let dev = Device::open(0)?;
    /// let (mut s, mut comm) = (dev.new_stream()?, dev.new_stream()?);
    /// let (a, b) = (s.alloc_zeroed::<f32>(1 << 20)?, s.alloc_zeroed::<f32>(1 << 20)?);
    /// let (graph, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
    ///     let side = cs.fork(&mut comm)?;
    ///     side.memset_zero(&a)?; // a branch of the graph...
    ///     cs.memset_zero(&b)?; // ...beside this one
    ///     side.join() // the graph ends after both
    /// })?;
    /// graph.replay(&s)?;
    /// # Ok(()) }
    /// ```
    #[track_caller]
    fn fork<'a>(&'a self, side: &'a mut Stream) -> Result<SideStream<'a>>;

    /// This queue as a plain `&dyn Queue` (for code that takes one).
    fn as_queue(&self) -> &dyn Queue;
}

/// A branch of work on a second stream, forked from a [`Fork`] queue; implements [`Queue`].
///
/// Ordering: the branch starts after the work enqueued on the main queue before
/// [`Fork::fork`]; [`Self::wait_main`] orders later branch work after the main queue's work so
/// far; [`Self::join`] (or dropping the branch) orders the main queue's later work after the
/// whole branch. Buffers used on both streams must be ordered this way by the caller, as for
/// any two streams.
///
/// Memory: eagerly, the branch allocates on its own stream and the allocator fences buffers it
/// shares with other streams. Inside a capture it allocates from the capture's pool (after
/// waiting for the main branch, whose freed blocks the pool may hand out again), and the
/// graph keeps every buffer the branch uses until the graph is dropped.
pub struct SideStream<'a> {
    side: &'a Stream,
    main: &'a StreamHandle,
    capture: Option<&'a CaptureStream<'a>>,
    joined: bool,
}

impl fmt::Debug for SideStream<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SideStream({:?} forked from {:?}{})",
            self.side.handle,
            self.main,
            if self.capture.is_some() {
                ", capturing"
            } else {
                ""
            }
        )
    }
}

/// The checks every fork makes: same device, a different stream.
fn check_side(main: &Device, main_id: u64, side: &Stream) -> Result<()> {
    if side.device().ordinal() != main.ordinal() {
        return Err(Error::WrongDevice {
            what: "side stream",
            expected: main.ordinal(),
            got: side.device().ordinal(),
        });
    }
    if side.handle.id() == main_id {
        return Err(Error::InvalidGraph {
            problem: "a stream cannot fork onto itself: pass another stream".into(),
        });
    }
    Ok(())
}

impl<'a> SideStream<'a> {
    #[track_caller]
    fn start(
        main: &'a StreamHandle,
        side: &'a Stream,
        capture: Option<&'a CaptureStream<'a>>,
    ) -> Result<Self> {
        let mut branch = SideStream {
            side,
            main,
            capture,
            // Nothing to join until the side stream has waited for the fork point.
            joined: true,
        };
        branch.wait_main()?;
        branch.joined = false;
        Ok(branch)
    }

    /// Orders the branch's later work after everything enqueued on the main queue so far
    /// (a dependency, not a host wait: legal inside a capture). Uses the streams' own events,
    /// so forking creates no driver objects.
    #[track_caller]
    pub fn wait_main(&self) -> Result<()> {
        self.side.handle.wait_for(self.main)
    }

    /// Ends the branch: the main queue's later work waits for everything enqueued here.
    #[track_caller]
    pub fn join(mut self) -> Result<()> {
        self.joined = true;
        self.join_now()
    }

    #[track_caller]
    fn join_now(&self) -> Result<()> {
        self.main.wait_for(&self.side.handle)
    }

    /// The side stream, as CUDA libraries need it.
    pub fn stream(&self) -> StreamRef<'_> {
        self.side.handle.as_ref()
    }
}

impl Drop for SideStream<'_> {
    /// Joins a branch that was not joined explicitly (an error path): a capture cannot end
    /// with an unjoined branch, and eager work after it must not overtake it.
    fn drop(&mut self) {
        if !self.joined {
            let _ = self.join_now();
        }
    }
}

impl crate::device::Sealed for SideStream<'_> {}

impl Queue for SideStream<'_> {
    fn device(&self) -> &Device {
        self.side.device()
    }

    fn stream_handle(&self) -> StreamRef<'_> {
        self.side.handle.as_ref()
    }

    fn capture_id(&self) -> Option<u64> {
        self.capture.map(|c| c.id)
    }

    #[track_caller]
    fn alloc_block(&self, bytes: usize) -> Result<Arc<BlockRef>> {
        match self.capture {
            None => self.side.alloc_block(bytes),
            Some(cs) => {
                // The pool may hand out a block the main branch freed after the fork: order
                // this branch after the main branch's work so far, which includes every use
                // of such a block.
                self.wait_main()?;
                let block = cs.alloc_block(bytes)?;
                self.use_block(&block);
                Ok(block)
            }
        }
    }

    fn use_block(&self, block: &Arc<BlockRef>) {
        match self.capture {
            None => block.note_use(self.side.handle.as_ref()),
            Some(cs) => {
                if block.is_in(&cs.pool) {
                    // Never freed inside the capture, so the main branch cannot get it back
                    // from the pool while this branch may still use it.
                    cs.keep.borrow_mut().pin(block);
                } else {
                    cs.use_block(block);
                }
            }
        }
    }

    fn keep_alive(&self, anchor: Anchor) {
        if let Some(cs) = self.capture {
            cs.keep_alive(anchor);
        }
    }

    fn hold_function(&self, f: &Function) {
        if let Some(cs) = self.capture {
            cs.hold_function(f);
        }
    }

    fn check_flag_arg(&self) -> Result<Arg<'static>> {
        match self.capture {
            None => self.side.check_flag_arg(),
            Some(cs) => cs.check_flag_arg(),
        }
    }

    fn at_end(&self, key: usize, work: EndWork) -> Result<()> {
        match self.capture {
            None => work(self),
            // Run on the capture stream at its end, after this branch has joined it.
            Some(cs) => cs.at_end(key, work),
        }
    }
}

impl Fork for Stream {
    #[track_caller]
    fn fork<'a>(&'a self, side: &'a mut Stream) -> Result<SideStream<'a>> {
        let side: &'a Stream = side;
        check_side(self.device(), self.handle.id(), side)?;
        if side.driver_is_capturing()? {
            return Err(Error::InvalidGraph {
                problem: "the side stream is being captured: fork onto a stream that is idle \
                          or running eager work"
                    .into(),
            });
        }
        SideStream::start(&self.handle, side, None)
    }

    fn as_queue(&self) -> &dyn Queue {
        self
    }
}

impl Fork for CaptureStream<'_> {
    #[track_caller]
    fn fork<'a>(&'a self, side: &'a mut Stream) -> Result<SideStream<'a>> {
        let side: &'a Stream = side;
        check_side(self.device(), self.stream.handle.id(), side)?;
        if !self.sides.contains(&side.handle) {
            if side.driver_is_capturing()? || !side.handle.join_capture()? {
                return Err(Error::InvalidGraph {
                    problem: "the side stream is already part of another capture".into(),
                });
            }
            // Cleared once the capture has ended (the driver keeps a joined stream in the
            // capture until then).
            self.sides.0.borrow_mut().push(side.handle.clone());
        }
        SideStream::start(&self.stream.handle, side, Some(self))
    }

    fn as_queue(&self) -> &dyn Queue {
        self
    }
}

/// Runs `f` `iters` times on `side` after everything already queued on `main`, then makes
/// `main` wait for it: PyTorch's warm-up on a side stream before capture. Lets lazy
/// initialisation (module loads, library handles, allocator growth) happen before capture.
#[track_caller]
pub fn warmup<F>(main: &Stream, side: &Stream, iters: usize, mut f: F) -> Result<()>
where
    F: FnMut(&Stream) -> Result<()>,
{
    side.wait_for(main)?;
    for _ in 0..iters {
        f(side)?;
    }
    main.wait_for(side)
}
