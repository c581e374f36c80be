//! The CUDA context of one device (its retained primary context) and the facts read off the
//! device when it is opened. Every runtime owner holds a [`Context`] and binds it before it
//! calls the driver, so objects work from any thread.
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

use std::collections::HashMap;
use std::fmt;
use std::ptr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::{self, ThreadId};
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use cudarc::driver::sys::CUdevice_attribute as Attr;

use super::module::Module;
use super::result::{check, driver_present, driver_version, init, raw_handle};
use super::stream::capturing_on_this_thread;
use crate::error::{Error, Result};

raw_handle!(RawContext, sys::CUcontext);

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

/// Facts about a device, read once when it is opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor), e.g. (9, 0) for Hopper.
    pub compute_capability: (u32, u32),
    pub multiprocessors: u32,
    pub total_memory: usize,
    pub max_threads_per_block: u32,
    pub max_grid_x: u32,
    pub max_shared_memory_per_block: u32,
    /// Driver's CUDA version, e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
}

impl DeviceInfo {
    /// "12.8"-style rendering of the driver's CUDA version.
    pub fn cuda_version_string(&self) -> String {
        format!(
            "{}.{}",
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        )
    }

    /// The `sm_XY` architecture name NVRTC targets for this device.
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
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
        // SAFETY: called exactly once per successful retain (in `Context::open`).
        unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

impl ContextHandle {
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

/// A CUDA context on one device: device facts and a module cache.
/// Cheap to clone; the context lives until the last clone and every object made from it is gone.
#[derive(Clone)]
pub struct Context {
    pub(crate) handle: Arc<ContextHandle>,
    info: Arc<DeviceInfo>,
    pub(super) modules: Arc<Mutex<HashMap<u64, Module>>>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Context({} #{})", self.info.name, self.info.ordinal)
    }
}

/// Number of CUDA devices, or a typed error when no driver can be loaded.
pub fn device_count() -> Result<usize> {
    if !driver_present() {
        return Err(Error::NoDriver {
            detail: "libcuda.so could not be loaded".into(),
        });
    }
    init().map_err(|e| Error::NoDriver {
        detail: e.to_string(),
    })?;
    let mut n = 0;
    // SAFETY: writes one int.
    check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    Ok(n.max(0) as usize)
}

#[track_caller]
fn device_name(dev: sys::CUdevice) -> Result<String> {
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: the driver writes at most `len` bytes including the terminator.
    check(
        unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev) },
        "cuDeviceGetName",
    )?;
    // SAFETY: the buffer is NUL-terminated by the driver (and zero-initialised).
    Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

#[track_caller]
fn device_attribute(dev: sys::CUdevice, attr: Attr) -> Result<u32> {
    let mut v = 0;
    // SAFETY: writes one int.
    check(
        unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) },
        "cuDeviceGetAttribute",
    )?;
    Ok(v.max(0) as u32)
}

impl Context {
    /// Opens device `ordinal` (retaining its primary context, as the runtime API does).
    #[track_caller]
    pub fn open(ordinal: usize) -> Result<Self> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        let mut dev = 0;
        // SAFETY: writes one CUdevice; the ordinal was checked against the count.
        check(
            unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) },
            "cuDeviceGet",
        )?;
        let mut raw = ptr::null_mut();
        // SAFETY: writes one context handle; balanced by the release in ContextHandle::drop.
        check(
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut raw, dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        let handle = Arc::new(ContextHandle {
            raw: RawContext(raw),
            dev,
            gate: CaptureGate::of(RawContext(raw)),
        });
        handle.bind()?;
        let mut total = 0;
        // SAFETY: writes one size_t.
        check(
            unsafe { sys::cuDeviceTotalMem_v2(&mut total, dev) },
            "cuDeviceTotalMem",
        )?;
        let attr = |a| device_attribute(dev, a);
        let info = DeviceInfo {
            ordinal,
            name: device_name(dev)?,
            compute_capability: (
                attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            multiprocessors: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            total_memory: total,
            max_threads_per_block: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            max_grid_x: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?,
            max_shared_memory_per_block: attr(
                Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
            )?,
            driver_version: driver_version()?,
        };
        Ok(Self {
            handle,
            info: Arc::new(info),
            modules: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn ordinal(&self) -> usize {
        self.info.ordinal
    }

    /// Makes this context current on the calling thread.
    #[track_caller]
    pub fn bind(&self) -> Result<()> {
        self.handle.bind()
    }

    /// Drops this context's cache of loaded modules (each unloads once no function of it is
    /// held elsewhere).
    pub(crate) fn forget_modules(&self) {
        self.modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// The raw `CUcontext`, for CUDA libraries and interoperability. Do not destroy it.
    pub fn raw_context(&self) -> sys::CUcontext {
        self.handle.raw.0
    }

    /// Waits for all work on the device. Waits first for captures of this device open on other
    /// threads to end (synchronising would invalidate them); fails with
    /// [`Error::NotSupported`] if this thread is capturing and another capture is open.
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        self.handle.synchronize()
    }

    /// Runs `f` with this device's captures held off: waits at most `patience` for captures
    /// open on other threads (through any `Device` handle of this device) to end, and no
    /// capture begins until `f` returns. For work that may synchronise the device behind the
    /// caller's back, which would invalidate other threads' captures: opening a CUDA library,
    /// the first call of a library routine (lazy kernel loading), loading a module. When the
    /// wait runs out, or this thread is capturing while other captures are open, `f` runs
    /// anyway (the bounded wait means this can never deadlock against a capturing thread that
    /// waits for the caller). Keep `f` short, a leaf: captures about to begin on other threads
    /// wait for it, so it must not wait for anything those threads may hold (a capture `f`
    /// itself begins on this thread does not wait).
    pub fn with_captures_held_off<R>(&self, patience: Duration, f: impl FnOnce() -> R) -> R {
        let _quiet = self.handle.gate().quiet_within(patience);
        f()
    }

    /// (free, total) device memory as the driver sees it.
    #[track_caller]
    pub fn mem_get_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: writes two size_t.
        check(
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
            "cuMemGetInfo",
        )?;
        Ok((free, total))
    }
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
