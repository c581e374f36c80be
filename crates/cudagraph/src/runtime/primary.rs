//! The retained primary context of a device ([`ContextHandle`]), making it current on a
//! thread, and the two accounts of open captures that context-wide calls consult: the
//! per-context [`CaptureGate`] and the per-thread count behind [`capturing_on_this_thread`].
//! Device facts, the module cache and the public [`super::Context`] are one floor up, in
//! `context.rs`.
//!
//! **The capture gate.** `cuCtxSynchronize` (and `cuMemFree`, which synchronises too) must not
//! run while any stream of the context is capturing, whichever thread captures: the driver
//! invalidates that capture, and with several threads capturing and synchronising at once it
//! has crashed inside `cuCtxSynchronize`. Every `Device` opened on a device shares its primary
//! context, and each has its own allocator, so no single allocator can know about the others'
//! captures. [`CaptureGate`] is the one place that does: one per context, process-wide, keyed
//! by the raw context. Captures this crate begins enter it (they wait only while a
//! synchronisation is running, which never waits for anything but the GPU); context-wide
//! synchronisations either wait until no capture is open ([`CaptureGate::wait_quiet`]) or,
//! where waiting is not wanted, take the gate only if it is free ([`CaptureGate::try_quiet`]:
//! the allocator then keeps its segments cached and releases them later).

use std::cell::Cell;
use std::collections::HashMap;
use std::ptr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::{self, ThreadId};
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::raw::RawContext;
use super::result::check;
use crate::error::{Error, Result};

thread_local! {
    /// Captures this thread has begun and not yet ended.
    static CAPTURING: Cell<usize> = const { Cell::new(0) };
}

/// Whether this thread has a capture open. While it does, it must not call what the driver
/// counts as unsafe during capture — synchronising, and even querying an event — or the
/// capture is invalidated; code that would poll (the allocator's fences, graph retirement)
/// asks this first and defers.
pub fn capturing_on_this_thread() -> bool {
    CAPTURING.with(|c| c.get() > 0)
}

/// Counts a capture this thread has begun (see [`capturing_on_this_thread`]).
pub(crate) fn capture_began_on_this_thread() {
    CAPTURING.with(|c| c.set(c.get() + 1));
}

/// Undoes one [`capture_began_on_this_thread`] once that capture has ended.
pub(crate) fn capture_ended_on_this_thread() {
    CAPTURING.with(|c| c.set(c.get().saturating_sub(1)));
}

/// How long loading a module, or looking up its functions (all of them together), waits for
/// other threads' captures of its context to end (lazy loading may synchronise the context)
/// before it goes ahead anyway.
pub(crate) const LOAD_PATIENCE: Duration = Duration::from_millis(250);

/// Keeps context-wide synchronisations and this crate's captures of one context apart, across
/// every thread and every `Device` handle of the context (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct CaptureGate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    /// Captures begun and not yet ended, from any thread.
    captures: usize,
    /// The threads holding a [`Quiet`] (a thread once per guard it holds).
    quiet: Vec<ThreadId>,
}

impl GateState {
    /// Whether a thread other than this one holds the gate quiet. A capture waits only for
    /// those: the holder itself beginning a capture is not racing with its own
    /// synchronisation, and waiting for itself would never end.
    fn quiet_elsewhere(&self) -> bool {
        let me = thread::current().id();
        self.quiet.iter().any(|&t| t != me)
    }

    fn hold(&mut self, gate: &Arc<CaptureGate>) -> Quiet {
        let me = thread::current().id();
        self.quiet.push(me);
        Quiet(gate.clone(), me)
    }
}

/// Held while a context-wide synchronisation (and the releases behind it) runs: no capture of
/// the context begins on another thread until it is dropped.
#[must_use = "the gate is open again as soon as this is dropped"]
pub(crate) struct Quiet(Arc<CaptureGate>, ThreadId);

impl Drop for Quiet {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        if let Some(i) = st.quiet.iter().position(|&t| t == self.1) {
            st.quiet.swap_remove(i);
        }
        drop(st);
        self.0.changed.notify_all();
    }
}

impl CaptureGate {
    /// The gate of the context `raw` (one per context for the life of the process).
    fn of(raw: RawContext) -> Arc<CaptureGate> {
        static GATES: OnceLock<Mutex<HashMap<usize, Arc<CaptureGate>>>> = OnceLock::new();
        let mut gates = GATES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        gates.entry(raw.0 as usize).or_default().clone()
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        // Every critical section leaves the counts whole; a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a capture that is about to begin; waits while another thread's synchronisation
    /// runs. Balance it with [`Self::leave_capture`] once the capture has ended (or failed to
    /// begin).
    pub(crate) fn enter_capture(&self) {
        let mut st = self.lock();
        while st.quiet_elsewhere() {
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.captures += 1;
    }

    /// Undoes one [`Self::enter_capture`].
    pub(crate) fn leave_capture(&self) {
        let mut st = self.lock();
        st.captures = st.captures.saturating_sub(1);
        drop(st);
        self.changed.notify_all();
    }

    /// Whether a capture of this context is open on any thread.
    pub(crate) fn capturing(&self) -> bool {
        self.lock().captures > 0
    }

    /// Holds captures off, if none is open now.
    pub(crate) fn try_quiet(self: &Arc<Self>) -> Option<Quiet> {
        let mut st = self.lock();
        if st.captures > 0 {
            return None;
        }
        Some(st.hold(self))
    }

    /// As [`Self::wait_quiet`], but waits at most `patience` (a thread that is capturing does
    /// not wait at all), and returns `None` when the gate did not open in time.
    pub(crate) fn quiet_within(self: &Arc<Self>, patience: Duration) -> Option<Quiet> {
        // A patience past the clock's range waits as long as it takes.
        self.quiet_by(Instant::now().checked_add(patience))
    }

    /// Waits until no capture of this context is open, then holds captures off. A thread that
    /// is capturing itself (any context) must not wait — the capture it holds could be the one
    /// waited for, or its end could wait on another thread waiting here — so it gets the gate
    /// only if it is free, and otherwise an error that names `what`.
    #[track_caller]
    pub(crate) fn wait_quiet(self: &Arc<Self>, what: &'static str) -> Result<Quiet> {
        self.quiet_by(None).ok_or_else(|| Error::NotSupported {
            what,
            detail: "it synchronises the whole device, which would invalidate the captures \
                     open on it, and this thread is capturing, so it cannot wait for them to \
                     end; do it before the capture begins or after it ends"
                .into(),
        })
    }

    /// Holds captures off once none is open, waiting until then or until `deadline` (never,
    /// for `None`). A capturing thread does not wait (see [`Self::wait_quiet`]). `None` when
    /// the gate did not open.
    fn quiet_by(self: &Arc<Self>, deadline: Option<Instant>) -> Option<Quiet> {
        if capturing_on_this_thread() {
            return self.try_quiet();
        }
        let mut st = self.lock();
        while st.captures > 0 {
            st = match deadline {
                None => self.changed.wait(st).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let left = d.checked_duration_since(Instant::now())?;
                    self.changed
                        .wait_timeout(st, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
        Some(st.hold(self))
    }
}

/// Owns a retained primary context; released when the last owner (a stream, module, buffer
/// or graph may outlive the `Device` value) goes away.
pub(crate) struct ContextHandle {
    pub(crate) raw: RawContext,
    dev: sys::CUdevice,
    /// Shared by every handle of this context (see [`CaptureGate`]).
    gate: Arc<CaptureGate>,
}

impl Drop for ContextHandle {
    fn drop(&mut self) {
        // SAFETY: called exactly once per successful retain (in `ContextHandle::retain`).
        unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

impl ContextHandle {
    /// Retains device `dev`'s primary context (as the runtime API does); released when the
    /// last clone of the returned handle goes.
    #[track_caller]
    pub(crate) fn retain(dev: sys::CUdevice) -> Result<Arc<Self>> {
        let mut raw = ptr::null_mut();
        // SAFETY: writes one context handle; balanced by the release in ContextHandle::drop.
        check(
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut raw, dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        Ok(Arc::new(ContextHandle {
            raw: RawContext(raw),
            dev,
            gate: CaptureGate::of(RawContext(raw)),
        }))
    }

    /// Makes the context current on this thread (if it is not already).
    #[track_caller]
    pub(crate) fn bind(&self) -> Result<()> {
        bind_raw(self.raw)
    }

    /// The context's capture gate.
    pub(crate) fn gate(&self) -> &Arc<CaptureGate> {
        &self.gate
    }

    /// Waits for all work in the context: first for every open capture of the context to end
    /// (on other threads; see [`CaptureGate::wait_quiet`]), then for the device.
    #[track_caller]
    pub(crate) fn synchronize(&self) -> Result<()> {
        let _quiet = self.gate.wait_quiet("synchronising the device")?;
        self.synchronize_quiet()
    }

    /// `cuCtxSynchronize`, for callers that hold the context's [`Quiet`].
    #[track_caller]
    pub(crate) fn synchronize_quiet(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: no arguments; the context was bound above.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }
}

/// Makes `ctx` current on this thread. Asks the driver which context is current rather than
/// trusting a cache, so code that switches contexts behind our back (other CUDA libraries,
/// cudarc) cannot make us issue work on the wrong device. `cuCtxGetCurrent` is a thread-local
/// read inside the driver.
#[track_caller]
pub(crate) fn bind_raw(ctx: RawContext) -> Result<()> {
    let mut cur = ptr::null_mut();
    // SAFETY: writes one context handle.
    check(unsafe { sys::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
    if cur == ctx.0 {
        return Ok(());
    }
    // SAFETY: ctx is a live primary context retained by its ContextHandle.
    check(unsafe { sys::cuCtxSetCurrent(ctx.0) }, "cuCtxSetCurrent")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::thread;
    use std::time::Duration;

    #[test]
    fn the_gate_is_quiet_only_while_no_capture_is_open() {
        let gate = Arc::new(CaptureGate::default());
        assert!(!gate.capturing());
        gate.enter_capture();
        gate.enter_capture();
        assert!(gate.capturing());
        assert!(gate.try_quiet().is_none(), "two captures open");
        gate.leave_capture();
        assert!(gate.try_quiet().is_none(), "one capture still open");
        gate.leave_capture();
        let quiet = gate.try_quiet().expect("no capture open");
        assert!(!gate.capturing());
        drop(quiet);
        // Unbalanced leaves never underflow.
        gate.leave_capture();
        assert!(gate.try_quiet().is_some());
    }

    #[test]
    fn a_synchronisation_waits_for_other_threads_captures_to_end() {
        let gate = Arc::new(CaptureGate::default());
        gate.enter_capture();
        let synced = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (gate, synced) = (gate.clone(), synced.clone());
            thread::spawn(move || {
                let _quiet = gate
                    .wait_quiet("test")
                    .expect("this thread does not capture");
                synced.store(true, Ordering::SeqCst);
            })
        };
        thread::sleep(Duration::from_millis(50));
        assert!(
            !synced.load(Ordering::SeqCst),
            "synchronised while a capture was open"
        );
        gate.leave_capture();
        waiter.join().unwrap();
        assert!(synced.load(Ordering::SeqCst));
    }

    #[test]
    fn a_capture_waits_for_a_running_synchronisation() {
        let gate = Arc::new(CaptureGate::default());
        let quiet = gate.try_quiet().unwrap();
        let began = Arc::new(AtomicBool::new(false));
        let capturer = {
            let (gate, began) = (gate.clone(), began.clone());
            thread::spawn(move || {
                gate.enter_capture();
                began.store(true, Ordering::SeqCst);
                gate.leave_capture();
            })
        };
        thread::sleep(Duration::from_millis(50));
        assert!(
            !began.load(Ordering::SeqCst),
            "a capture began during a synchronisation"
        );
        drop(quiet);
        capturer.join().unwrap();
        assert!(began.load(Ordering::SeqCst));
    }

    #[test]
    fn a_bounded_wait_gives_up_while_a_capture_stays_open() {
        let gate = Arc::new(CaptureGate::default());
        gate.enter_capture();
        let t = Instant::now();
        assert!(gate.quiet_within(Duration::from_millis(30)).is_none());
        assert!(t.elapsed() >= Duration::from_millis(30));
        gate.leave_capture();
        assert!(gate.quiet_within(Duration::from_millis(30)).is_some());
    }

    #[test]
    fn any_patience_is_taken_without_overflow() {
        let gate = Arc::new(CaptureGate::default());
        assert!(gate.quiet_within(Duration::MAX).is_some());
        assert!(gate.quiet_within(Duration::ZERO).is_some());
        gate.enter_capture();
        assert!(gate.quiet_within(Duration::ZERO).is_none());
        gate.leave_capture();
    }

    #[test]
    fn the_holder_of_the_gate_may_begin_a_capture_itself() {
        let gate = Arc::new(CaptureGate::default());
        let quiet = gate.try_quiet().unwrap();
        // Would wait forever if the holder waited for its own guard.
        gate.enter_capture();
        assert!(gate.capturing());
        gate.leave_capture();
        drop(quiet);
    }

    #[test]
    fn several_synchronisations_may_run_together() {
        let gate = Arc::new(CaptureGate::default());
        let a = gate.try_quiet().unwrap();
        let b = gate.wait_quiet("test").unwrap();
        drop((a, b));
        gate.enter_capture();
        assert!(gate.capturing());
        gate.leave_capture();
    }
}
