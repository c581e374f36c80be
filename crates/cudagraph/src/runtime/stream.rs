//! Streams and events: owned handles ([`StreamHandle`], [`Event`]) next to the driver calls
//! that use them, and [`StreamRef`], the view of a stream that CUDA libraries need (its raw
//! handle) without any method that synchronises or waits — what a capture may hand out.
//!
//! A stream also keeps the event recorded when its current capture began: the allocator uses
//! it as the completion fence of earlier work while the stream cannot take new events.
//!
//! **Which streams are capturing.** Eager work must never land in a capture (the graph would
//! not keep its buffers alive), so eager entry points ask [`StreamRef::in_capture`] first: our
//! own account for the captures this crate begins or joins (an atomic flag, free), and the
//! driver's (`cuStreamIsCapturing`, legal during capture) for streams another library can
//! capture behind our back ([`StreamHandle::borrowed`]). Our own streams enter a capture only
//! by beginning one or by waiting on an event recorded in one; every event remembers whether
//! its last record was captured, and a wait that would pull a stream into a capture it is not
//! part of is refused. Records and waits on a stream hold its capture lock, so neither
//! interleaves with a capture beginning on it or with it joining one.

use std::any::Any;
use std::fmt;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::sys;

use super::context::Context;
use super::graph::GraphHandle;
use super::primary::{
    capture_began_on_this_thread, capture_ended_on_this_thread, capturing_on_this_thread,
};
use super::raw::{RawEvent, RawStream};
use super::result::{check, driver_error};
use crate::error::{Error, Result};

static STREAM_IDS: AtomicU64 = AtomicU64::new(1);

/// How strictly the driver polices other CUDA calls while a capture is open.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CaptureMode {
    /// Potentially unsafe calls (synchronisation, `cuMemAlloc`, legacy-stream work) made by the
    /// capturing thread invalidate the capture; other threads keep working. The default: it is
    /// what lets several threads capture and replay at once.
    #[default]
    ThreadLocal,
    /// Such calls from **any** thread invalidate the capture (PyTorch's default). Safest when
    /// one thread captures while others might synchronise the device by mistake, but then no
    /// other thread may capture, instantiate or synchronise until the capture ends.
    Global,
    /// No call is policed; you are responsible for not synchronising on captured work.
    Relaxed,
}

impl CaptureMode {
    pub(crate) fn raw(self) -> sys::CUstreamCaptureMode {
        match self {
            CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => {
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            }
            CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        }
    }
}

struct EventInner {
    raw: RawEvent,
    ctx: Context,
    /// Whether the event's last record was captured (into a graph). Held across every record
    /// and every wait of the event, so a wait sees the state of the record it waits on.
    captured: Mutex<bool>,
}

impl Drop for EventInner {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: the event was created by cuEventCreate and is destroyed once, here.
            unsafe {
                sys::cuEventDestroy_v2(self.raw.0);
            }
        }
    }
}

/// A CUDA event. Cheap to clone (clones share the event).
#[derive(Clone)]
pub struct Event(Arc<EventInner>);

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Event({:p})", self.0.raw.0)
    }
}

impl Event {
    /// Creates an event; `timing` enables [`Event::elapsed_ms`].
    #[track_caller]
    pub fn new(ctx: &Context, timing: bool) -> Result<Self> {
        ctx.bind()?;
        let mut e = ptr::null_mut();
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT as u32
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        };
        // SAFETY: writes one event handle.
        check(
            unsafe { sys::cuEventCreate(&mut e, flags) },
            "cuEventCreate",
        )?;
        Ok(Event(Arc::new(EventInner {
            raw: RawEvent(e),
            ctx: ctx.clone(),
            captured: Mutex::new(false),
        })))
    }

    pub(crate) fn raw(&self) -> RawEvent {
        self.0.raw
    }

    /// Whether the event was last recorded into a capture: then only streams of that capture
    /// may wait on it (a wait from any other stream is refused, see [`StreamRef::wait_event`]).
    pub fn is_captured(&self) -> bool {
        *self.0.captured.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks until the work recorded before this event has finished.
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        self.0.ctx.bind()?;
        // SAFETY: the event is live.
        check(
            unsafe { sys::cuEventSynchronize(self.0.raw.0) },
            "cuEventSynchronize",
        )
    }

    /// Whether the work recorded before this event has finished (never blocks).
    #[track_caller]
    pub fn query(&self) -> Result<bool> {
        self.0.ctx.bind()?;
        // SAFETY: the event is live.
        let st = unsafe { sys::cuEventQuery(self.0.raw.0) };
        match st {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(driver_error(
                other,
                "cuEventQuery",
                std::panic::Location::caller(),
            )),
        }
    }

    /// Milliseconds between `self` (earlier) and `end`; both need timing enabled.
    #[track_caller]
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        self.0.ctx.bind()?;
        let mut ms = 0.0f32;
        // SAFETY: both events are live and were recorded with timing enabled.
        check(
            unsafe { sys::cuEventElapsedTime_v2(&mut ms, self.0.raw.0, end.0.raw.0) },
            "cuEventElapsedTime",
        )?;
        Ok(ms)
    }
}

/// Capture state of a stream, guarded so that recording a fence and beginning a capture never
/// interleave.
struct CaptureState {
    capturing: bool,
    /// Recorded right before the current capture began: completes when all earlier work did.
    begin_fence: Option<Event>,
}

pub(crate) struct StreamInner {
    raw: RawStream,
    id: u64,
    ctx: Context,
    join: Event,
    /// Also held across every record and wait on this stream (see the module docs).
    capture: Mutex<CaptureState>,
    /// `capture.capturing`, readable without the lock (eager work checks it on every call).
    /// Set before the driver's capture begins and cleared after it has ended.
    tracked: AtomicBool,
    tomb: Arc<Tomb>,
    /// For a stream created elsewhere ([`StreamHandle::borrowed`]): what keeps it alive. The
    /// stream is not destroyed here; the owner goes after this handle.
    owner: Option<Arc<dyn Any + Send + Sync>>,
}

/// What a stream leaves behind: an event recorded as it was destroyed, which completes once all
/// the work it ever queued has. Lets blocks used on a stream refer to it weakly (without keeping
/// the CUDA stream alive) and still fence their reuse after the stream is gone.
#[derive(Default)]
pub(crate) struct Tomb {
    event: Mutex<Option<Event>>,
    /// The stream went while another library had it capturing: no event can tell when its
    /// earlier work is done, so blocks it used are never handed out again.
    unknown: AtomicBool,
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        // Our own captures borrow the stream, so it cannot go mid-capture; a borrowed stream
        // can (another library captures it), and an event recorded now would be captured.
        let foreign_capture = self.owner.is_some()
            && self.ctx.bind().is_ok()
            // SAFETY: the stream is live until its owner goes, after this handle.
            && unsafe { raw_is_capturing(self.raw.0) }.unwrap_or(true);
        if foreign_capture {
            self.tomb.unknown.store(true, Ordering::Release);
        } else if let Ok(e) = Event::new(&self.ctx, false) {
            if self.ctx.bind().is_ok()
                // SAFETY: both handles are live.
                && unsafe { sys::cuEventRecord(e.raw().0, self.raw.0) } == sys::CUresult::CUDA_SUCCESS
            {
                *self.tomb.event.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            }
        }
        if self.owner.is_none() && self.ctx.bind().is_ok() {
            // SAFETY: created by cuStreamCreate, destroyed once, here. Work still queued
            // completes before the driver frees the stream's resources.
            unsafe {
                sys::cuStreamDestroy_v2(self.raw.0);
            }
        }
    }
}

/// An owned CUDA stream. The user-facing [`crate::Stream`] wraps this with its device. Blocks
/// used on a stream may keep it alive (to fence their reuse), so the handle is shared.
#[derive(Clone)]
pub struct StreamHandle(Arc<StreamInner>);

impl fmt::Debug for StreamHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Stream#{}", self.0.id)
    }
}

impl StreamHandle {
    /// Creates a non-blocking stream (no implicit synchronisation with the legacy stream,
    /// which would otherwise break capture).
    #[track_caller]
    pub(crate) fn new(ctx: &Context) -> Result<Self> {
        ctx.bind()?;
        let mut s = ptr::null_mut();
        // SAFETY: writes one stream handle.
        check(
            unsafe {
                sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            },
            "cuStreamCreate",
        )?;
        let raw = RawStream(s);
        let join = match Event::new(ctx, false) {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: the stream was just created and nothing else refers to it.
                unsafe { sys::cuStreamDestroy_v2(s) };
                return Err(e);
            }
        };
        Ok(StreamHandle(Arc::new(StreamInner {
            raw,
            id: STREAM_IDS.fetch_add(1, Ordering::Relaxed),
            ctx: ctx.clone(),
            join,
            capture: Mutex::new(CaptureState {
                capturing: false,
                begin_fence: None,
            }),
            tracked: AtomicBool::new(false),
            tomb: Arc::new(Tomb::default()),
            owner: None,
        })))
    }

    /// Wraps a stream created elsewhere (by cudarc, say) without taking it over: dropping the
    /// last handle does not destroy the stream, it drops `owner` (after the handle is gone).
    /// Refuses the legacy and per-thread default streams (they cannot be captured and
    /// synchronise implicitly) and a stream of another context.
    ///
    /// # Safety
    /// `raw` must be a live stream that stays alive while `owner` is alive (hold the stream's
    /// owning object in `owner`), and is not destroyed by anyone else before.
    #[track_caller]
    pub unsafe fn borrowed(
        ctx: &Context,
        raw: sys::CUstream,
        owner: Arc<dyn Any + Send + Sync>,
    ) -> Result<Self> {
        let addr = raw as usize;
        if addr == 0 || addr == 1 || addr == 2 {
            return Err(Error::NotSupported {
                what: "wrapping a default stream",
                detail: "the legacy and per-thread default streams cannot be captured and \
                         synchronise with other streams implicitly; use a stream created with \
                         CudaContext::new_stream (non-blocking)"
                    .into(),
            });
        }
        ctx.bind()?;
        let mut owner_ctx = ptr::null_mut();
        // SAFETY: `raw` is a live stream (this function's contract); writes one handle.
        check(
            unsafe { sys::cuStreamGetCtx(raw, &mut owner_ctx) },
            "cuStreamGetCtx",
        )?;
        if owner_ctx != ctx.raw_context() {
            return Err(Error::NotSupported {
                what: "a stream of another CUDA context",
                detail: format!(
                    "the stream belongs to context {owner_ctx:p}, not to device {}'s primary context",
                    ctx.ordinal()
                ),
            });
        }
        let join = Event::new(ctx, false)?;
        Ok(StreamHandle(Arc::new(StreamInner {
            raw: RawStream(raw),
            id: STREAM_IDS.fetch_add(1, Ordering::Relaxed),
            ctx: ctx.clone(),
            join,
            capture: Mutex::new(CaptureState {
                capturing: false,
                begin_fence: None,
            }),
            tracked: AtomicBool::new(false),
            tomb: Arc::new(Tomb::default()),
            owner: Some(owner),
        })))
    }

    /// What keeps a borrowed stream alive ([`Self::borrowed`]); `None` for our own streams.
    pub fn owner(&self) -> Option<&Arc<dyn Any + Send + Sync>> {
        self.0.owner.as_ref()
    }

    /// Process-unique id of this stream (the allocator's stream-ordering key).
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &Context {
        &self.0.ctx
    }

    pub(crate) fn raw(&self) -> RawStream {
        self.0.raw
    }

    /// The capture-safe view of this stream.
    pub fn as_ref(&self) -> StreamRef<'_> {
        StreamRef(&self.0)
    }

    /// Blocks until all work enqueued on this stream has finished (no device-side check is read
    /// here; [`crate::Stream::synchronize`] does that).
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        self.0.ctx.bind()?;
        // SAFETY: the stream is live.
        check(
            unsafe { sys::cuStreamSynchronize(self.0.raw.0) },
            "cuStreamSynchronize",
        )
    }

    /// Makes future work on `self` wait for all work enqueued on `other` so far. Refused
    /// (like [`StreamRef::wait_event`]) when `other` is capturing and `self` is not part of
    /// that capture: the wait would pull `self` into it.
    #[track_caller]
    pub fn wait_for(&self, other: &StreamHandle) -> Result<()> {
        other.record(&other.0.join)?;
        self.wait_event(&other.0.join)
    }

    /// Records `event` on this stream.
    #[track_caller]
    pub fn record(&self, event: &Event) -> Result<()> {
        self.as_ref().record(event)
    }

    /// Makes future work on this stream wait for `event`; see [`StreamRef::wait_event`].
    #[track_caller]
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.as_ref().wait_event(event)
    }

    /// Begins a capture on this stream. The event recorded right before stays available as
    /// this stream's fence until the capture ends.
    #[track_caller]
    pub(crate) fn begin_capture(&self, mode: CaptureMode) -> Result<()> {
        let mut st = self.0.capture.lock().unwrap_or_else(|p| p.into_inner());
        let fence = Event::new(&self.0.ctx, false)?;
        self.as_ref().record_locked(&fence)?;
        // Marked before the driver's capture begins (and cleared after it ends), so no eager
        // call ever sees "not capturing" while it is.
        self.0.tracked.store(true, Ordering::Release);
        // Counted in the context's gate for as long as the driver's capture is open, so no
        // context-wide synchronisation (any thread, any allocator) runs meanwhile.
        let gate = self.0.ctx.handle.gate();
        gate.enter_capture();
        // SAFETY: the stream is live and not capturing (the caller holds it exclusively).
        let begun = check(
            unsafe { sys::cuStreamBeginCapture_v2(self.0.raw.0, mode.raw()) },
            "cuStreamBeginCapture",
        );
        if let Err(e) = begun {
            gate.leave_capture();
            self.0.tracked.store(false, Ordering::Release);
            return Err(e);
        }
        capture_began_on_this_thread();
        st.capturing = true;
        st.begin_fence = Some(fence);
        Ok(())
    }

    /// Marks this stream as joining another stream's capture (a side stream forked from a
    /// capture: see `crate::graph::SideStream`). Like [`Self::begin_capture`], records the
    /// fence of the work queued so far first; call it before the stream waits on the capture's
    /// event, and [`Self::leave_capture`] once the origin capture has ended. False if the
    /// stream is already capturing by our account.
    #[track_caller]
    pub(crate) fn join_capture(&self) -> Result<bool> {
        let mut st = self.0.capture.lock().unwrap_or_else(|p| p.into_inner());
        if st.capturing {
            return Ok(false);
        }
        let fence = Event::new(&self.0.ctx, false)?;
        self.as_ref().record_locked(&fence)?;
        st.capturing = true;
        st.begin_fence = Some(fence);
        self.0.tracked.store(true, Ordering::Release);
        Ok(true)
    }

    /// Marks this stream as capturing into a graph of its own (a conditional node's body,
    /// captured with `cuStreamBeginCaptureToGraph`): call with `true` before that capture
    /// begins and with `false` once it has ended, so that eager work is refused meanwhile and
    /// [`StreamRef::record`] knows the stream is capturing without asking the driver. A body
    /// is only ever captured inside its parent's capture, which the context's gate already
    /// counts, so this does not enter the gate.
    pub(crate) fn mark_body_capture(&self, on: bool) {
        self.0.tracked.store(on, Ordering::Release);
    }

    /// Undoes [`Self::join_capture`] after the capture the stream joined has ended.
    pub(crate) fn leave_capture(&self) {
        let mut st = self.0.capture.lock().unwrap_or_else(|p| p.into_inner());
        st.capturing = false;
        st.begin_fence = None;
        self.0.tracked.store(false, Ordering::Release);
    }

    /// Ends the capture. Returns the graph, or the driver's error (any partial graph the
    /// driver handed back has been destroyed).
    #[track_caller]
    pub(crate) fn end_capture(&self) -> Result<GraphHandle> {
        let mut st = self.0.capture.lock().unwrap_or_else(|p| p.into_inner());
        let began = st.capturing;
        if began {
            capture_ended_on_this_thread();
        }
        let mut g = ptr::null_mut();
        // SAFETY: writes one graph handle (possibly null on failure).
        let status = unsafe { sys::cuStreamEndCapture(self.0.raw.0, &mut g) };
        if began {
            self.0.ctx.handle.gate().leave_capture();
        }
        // Cleared only now that the driver's capture is over (see `begin_capture`).
        st.capturing = false;
        st.begin_fence = None;
        self.0.tracked.store(false, Ordering::Release);
        let graph = (!g.is_null()).then(|| GraphHandle::from_raw(g, &self.0.ctx));
        check(status, "cuStreamEndCapture")?;
        graph.ok_or_else(|| Error::InvalidGraph {
            problem: "the driver ended the capture without a graph".into(),
        })
    }
}

/// The view of a stream handed to CUDA libraries (cuBLAS, cuDNN, NCCL, cudarc): its raw handle
/// and identity. It has no method that synchronises or waits, so code holding one inside a
/// capture cannot block on captured work:
///
/// ```compile_fail
/// # use cudagraph::*;
/// # fn f(mut s: Stream) -> Result<()> {
/// Graph::capture(&mut s, CaptureOptions::new(), |cs| {
///     cs.stream_handle().synchronize() // error: no method `synchronize` on `StreamRef`
/// })?;
/// # Ok(()) }
/// ```
#[derive(Clone, Copy)]
pub struct StreamRef<'a>(&'a Arc<StreamInner>);

impl fmt::Debug for StreamRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StreamRef#{}", self.0.id)
    }
}

impl<'a> StreamRef<'a> {
    /// The raw `CUstream` for a CUDA library call on this stream. Do not destroy it, and do not
    /// synchronise on it: it may be capturing.
    pub fn raw(&self) -> sys::CUstream {
        self.0.raw.0
    }

    /// Process-unique id of the stream.
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &'a Context {
        &self.0.ctx
    }

    pub(crate) fn raw_handle(&self) -> RawStream {
        self.0.raw
    }

    /// Whether the stream is capturing (by the driver's account).
    #[track_caller]
    pub fn is_capturing(&self) -> Result<bool> {
        self.0.ctx.bind()?;
        // SAFETY: the stream is live (this view borrows its handle).
        unsafe { raw_is_capturing(self.0.raw.0) }
    }

    /// Whether the stream is part of a capture, so that eager work must stay off it: a capture
    /// this crate began or a [`crate::SideStream`] joined (our own account, no driver call), or
    /// — for a stream created elsewhere ([`StreamHandle::borrowed`]), which its owner can
    /// capture without us — whatever capture the driver reports (one `cuStreamIsCapturing`).
    /// Our own streams cannot enter a capture any other way: waits that would pull them into
    /// one are refused ([`Self::wait_event`]).
    #[track_caller]
    pub fn in_capture(&self) -> Result<bool> {
        if self.0.tracked.load(Ordering::Acquire) {
            return Ok(true);
        }
        if self.0.owner.is_some() {
            return self.is_capturing();
        }
        Ok(false)
    }

    /// Refuses eager work (`what`) on this stream while it is part of a capture
    /// ([`Self::in_capture`]): recorded into a graph that does not know its buffers, the work
    /// would run on replays after they were freed.
    #[track_caller]
    pub(crate) fn check_eager(&self, what: &'static str) -> Result<()> {
        if self.in_capture()? {
            return Err(Error::InvalidGraph {
                problem: format!(
                    "{what} on stream #{}, which is part of a capture: eager work there would be \
                     recorded into the graph without the graph keeping its buffers alive; inside \
                     a capture use the capture's queues (the CaptureStream, or the SideStream \
                     from Fork::fork), and this stream once the capture has ended",
                    self.0.id
                ),
            });
        }
        Ok(())
    }

    /// Records `event` here (legal inside a capture: it becomes an event node, and the event
    /// remembers that it was captured).
    #[track_caller]
    pub fn record(&self, event: &Event) -> Result<()> {
        let _st = self.0.capture.lock().unwrap_or_else(|p| p.into_inner());
        self.record_locked(event)
    }

    /// [`Self::record`] with this stream's capture lock already held by the caller.
    #[track_caller]
    fn record_locked(&self, event: &Event) -> Result<()> {
        self.0.ctx.bind()?;
        let mut captured = event.0.captured.lock().unwrap_or_else(|p| p.into_inner());
        // Under this stream's lock no capture of ours begins or joins here meanwhile; another
        // library's can (a borrowed stream), so those are asked again after the record: a
        // capture that began in between makes the record count as captured. Our own streams
        // enter a capture only through this crate, which marks them first (`tracked`: a
        // capture begun, joined, or a conditional body), so for them no driver call is needed.
        let before = if self.0.owner.is_none() {
            self.0.tracked.load(Ordering::Acquire)
        } else {
            self.is_capturing()?
        };
        // SAFETY: both handles are live.
        check(
            unsafe { sys::cuEventRecord(event.raw().0, self.0.raw.0) },
            "cuEventRecord",
        )?;
        let after = if before || self.0.owner.is_none() {
            before
        } else {
            self.is_capturing().unwrap_or(true)
        };
        *captured = before || after;
        Ok(())
    }

    /// Makes later work here wait for `event` (legal inside a capture: fork/join). Enqueues a
    /// dependency; it does not block the host.
    ///
    /// Refused with [`Error::InvalidGraph`] when `event` was recorded in a capture that this
    /// stream is not part of: the wait would pull this stream into that capture, and work later
    /// enqueued here as eager work would be recorded into a graph that does not keep its
    /// buffers alive. (Costs nothing for events recorded eagerly; one `cuStreamIsCapturing`
    /// otherwise.)
    #[track_caller]
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        let st = self.0.capture.lock().unwrap_or_else(|p| p.into_inner());
        self.0.ctx.bind()?;
        let captured = event.0.captured.lock().unwrap_or_else(|p| p.into_inner());
        if *captured && !st.capturing && !self.is_capturing()? {
            return Err(Error::InvalidGraph {
                problem: format!(
                    "stream #{} would wait on an event recorded inside a capture it is not part \
                     of, which pulls it into that capture: fork onto it with Fork::fork inside \
                     the capture instead",
                    self.0.id
                ),
            });
        }
        // SAFETY: both handles are live.
        check(
            unsafe { sys::cuStreamWaitEvent(self.0.raw.0, event.raw().0, 0) },
            "cuStreamWaitEvent",
        )
    }

    /// A handle that does not keep the stream alive: for per-stream library state (a
    /// workspace) that should go when the stream does, and for fencing blocks used on it.
    pub fn downgrade(&self) -> WeakStream {
        WeakStream {
            stream: Arc::downgrade(self.0),
            tomb: self.0.tomb.clone(),
            id: self.0.id,
        }
    }
}

/// A stream reference that does not keep the stream alive ([`StreamRef::downgrade`]).
#[derive(Clone)]
pub struct WeakStream {
    stream: Weak<StreamInner>,
    tomb: Arc<Tomb>,
    id: u64,
}

impl fmt::Debug for WeakStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WeakStream#{}", self.id)
    }
}

impl WeakStream {
    /// Whether the stream still exists.
    pub fn is_alive(&self) -> bool {
        self.stream.strong_count() > 0
    }

    /// Id of the stream.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// An event that completes once all work queued on the stream so far has: a fresh one
    /// while it lives ([`StreamHandle::fence`]), the one recorded at its destruction after.
    /// `None` only if no event could be made (a lost context: nothing runs any more).
    pub(crate) fn fence(&self) -> Option<Event> {
        match self.stream.upgrade() {
            Some(s) => StreamHandle(s).fence().ok(),
            None => self
                .tomb
                .event
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        }
    }

    /// Whether the stream is gone and its last work has finished (so a block need not keep a
    /// reference to it). Never queries the device on a capturing thread.
    pub(crate) fn is_done(&self) -> bool {
        if self.is_alive()
            || capturing_on_this_thread()
            || self.tomb.unknown.load(Ordering::Acquire)
        {
            return false;
        }
        match &*self.tomb.event.lock().unwrap_or_else(|p| p.into_inner()) {
            // Any error but a lost context leaves the answer unknown: keep the reference.
            Some(e) => e.query().unwrap_or_else(|err| err.is_context_lost()),
            None => true,
        }
    }
}

impl<'a> StreamRef<'a> {
    /// What keeps the stream alive when it was created elsewhere ([`StreamHandle::borrowed`]).
    pub fn owner(&self) -> Option<&'a Arc<dyn Any + Send + Sync>> {
        self.0.owner.as_ref()
    }
}

/// Whether a raw stream (of the current context) is capturing, for streams this crate does
/// not own (cudarc's).
///
/// # Safety
/// `raw` must be a live stream.
#[track_caller]
pub(crate) unsafe fn raw_is_capturing(raw: sys::CUstream) -> Result<bool> {
    let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: `raw` is live (the caller's contract); writes one status.
    check(
        unsafe { sys::cuStreamIsCapturing(raw, &mut st) },
        "cuStreamIsCapturing",
    )?;
    Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

impl StreamHandle {
    /// An event that completes once all work enqueued on this stream so far has: recorded now,
    /// or, while the stream is capturing (so new events would join the capture), the one
    /// recorded when the capture began — captured work never runs, so that covers everything.
    /// An error for a stream in a capture we did not begin or join (another library's): no
    /// event can say when its earlier work is done.
    pub(crate) fn fence(&self) -> Result<Event> {
        let st = self.0.capture.lock().unwrap_or_else(|p| p.into_inner());
        if st.capturing {
            if let Some(f) = &st.begin_fence {
                return Ok(f.clone());
            }
        }
        let r = self.as_ref();
        if r.is_capturing()? {
            return Err(Error::InvalidGraph {
                problem: format!(
                    "no fence for stream #{}: it is part of a capture this crate did not begin",
                    self.0.id
                ),
            });
        }
        let e = Event::new(&self.0.ctx, false)?;
        r.record_locked(&e)?;
        Ok(e)
    }
}
