//! [`Communicator`] is one rank's NCCL communicator on one device (NCCL itself is loaded by
//! `ffi::nccl`). Collectives take any [`Queue`]: eagerly they run on its stream, inside a
//! capture they become graph nodes (and the graph keeps the communicator alive: NCCL refuses
//! to destroy a communicator while a graph that captured it exists).
//! Two watchdogs abort the communicator (NCCL's device code then stops waiting for peers)
//! when a peer fails or stalls. [`Communicator::synchronize`] waits for a stream while polling
//! NCCL's asynchronous error, the peers' liveness and a timeout, and returns the error. A
//! thread of the communicator's own watches every eager collective from its enqueue, so that
//! a rank whose host is blocked elsewhere is freed too: while a collective waits for a peer on
//! the device, CUDA calls that wait for the device (loading a kernel's module on first use, a
//! plain synchronisation of that stream) block, and only an abort ends that wait.
//!
//! The raw collectives ([`Communicator::all_reduce`], [`Communicator::broadcast`]) are
//! `unsafe`: NCCL trusts every rank to pass the same element count, and a rank whose count
//! differs makes it read and write past the smaller buffer. The safe ways to communicate
//! derive their counts from something every rank has checked first:
//! [`Communicator::all_agree`] and [`Communicator::barrier`] (fixed-size headers, then an
//! agreed length) and [`super::DistributedDataParallel`] (the verified parameter layout).

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use cudagraph::runtime::Context;
use cudagraph::{Device, DeviceBuffer, Elem, Event, Queue, Stream};
use cudarc::nccl::sys;

use super::rendezvous::{rendezvous, Health, PeerMonitor};
use super::{DistEnv, DistError, DistOptions};
use crate::error::{NnError, Result};
use crate::ffi::nccl::{
    api, id_from_bytes, nccl_error, unique_id, Api, RawComm, Status, IN_PROGRESS, SUCCESS,
};

/// Where a communicator being initialised on its own thread stands.
enum Slot {
    Waiting,
    Done(Status, usize),
    /// The waiter gave up: the thread aborts whatever it gets.
    Abandoned,
}

/// `ncclCommInitRank` running on its own thread, so that the caller can give up after a
/// timeout or when a peer fails (a blocking init whose peers never arrive does not return).
struct PendingInit {
    slot: Arc<Mutex<Slot>>,
    rank: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl PendingInit {
    fn start(
        api: &'static Api,
        ctx: &Context,
        rank: usize,
        world: usize,
        id: sys::ncclUniqueId,
    ) -> Result<Self> {
        let slot = Arc::new(Mutex::new(Slot::Waiting));
        let (s, ctx) = (slot.clone(), ctx.clone());
        std::thread::Builder::new()
            .name(format!("cudagraph-nccl-init-{rank}"))
            .spawn(move || {
                let mut comm: RawComm = ptr::null_mut();
                let st = match ctx.bind() {
                    // SAFETY: writes one communicator handle; the device is the context just
                    // made current; rank < world (checked by the caller).
                    Ok(()) => unsafe {
                        (api.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int)
                    },
                    Err(_) => -1,
                };
                let mut g = lock(&s);
                if matches!(*g, Slot::Abandoned) {
                    if st == SUCCESS {
                        // SAFETY: a communicator nobody else has seen, aborted once.
                        unsafe { (api.comm_abort)(comm) };
                    }
                } else {
                    *g = Slot::Done(st, comm as usize);
                }
            })
            .map_err(|e| DistError::Usage(format!("cannot start an NCCL init thread: {e}")))?;
        Ok(PendingInit { slot, rank })
    }

    /// Waits for the communicator until `deadline`, giving up early when `health` records a
    /// failed peer.
    fn wait(
        self,
        api: &'static Api,
        ctx: &Context,
        deadline: Instant,
        timeout: Duration,
        health: Option<&Health>,
    ) -> Result<RawComm> {
        loop {
            {
                let mut g = lock(&self.slot);
                if let Slot::Done(st, c) = *g {
                    if st == SUCCESS {
                        return Ok(c as RawComm);
                    }
                    if st == -1 {
                        // The context could not be bound: report the driver's error.
                        ctx.bind()?;
                    }
                    return Err(nccl_error(api, st, "ncclCommInitRank").into());
                }
                let failed = health.and_then(|h| h.failure());
                if failed.is_some() || Instant::now() >= deadline {
                    *g = Slot::Abandoned;
                    return Err(match failed {
                        Some(f) => DistError::PeerFailed(f),
                        None => DistError::Timeout {
                            what: format!("NCCL initialisation of rank {}", self.rank),
                            secs: timeout.as_secs_f64(),
                            hint: "another rank never reached it: look at the other ranks' output (CUDAGRAPH_DIST_TIMEOUT sets the limit)".into(),
                        },
                    }
                    .into());
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Element types NCCL reduces.
pub trait NcclElem: Elem + sealed::Sealed {
    /// `ncclDataType_t`.
    const DTYPE: c_int;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! nccl_elem {
    ($($t:ty => $code:expr),*) => {$(
        impl sealed::Sealed for $t {}
        impl NcclElem for $t {
            const DTYPE: c_int = $code;
        }
    )*};
}
nccl_elem!(i8 => 0, u8 => 1, i32 => 2, u32 => 3, i64 => 4, u64 => 5, f32 => 7, f64 => 8);

/// A reduction (`ncclRedOp_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Elementwise sum over ranks.
    Sum,
    /// Elementwise product over ranks.
    Prod,
    /// Elementwise maximum over ranks.
    Max,
    /// Elementwise minimum over ranks.
    Min,
    /// Sum divided by the number of ranks (NCCL 2.10+).
    Avg,
}

impl ReduceOp {
    fn raw(self) -> c_int {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Prod => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::Avg => 4,
        }
    }
}

struct CommInner {
    raw: RawComm,
    api: &'static Api,
    rank: usize,
    world: usize,
    ctx: Context,
    ordinal: usize,
    timeout: Duration,
    /// Failures of any rank (the peer monitor's record, or the threads' shared one).
    health: Option<Arc<Health>>,
    /// The liveness channel, dropped with the communicator (goodbye) or on abort.
    monitor: Mutex<Option<PeerMonitor>>,
    aborted: AtomicBool,
    abort_reason: Mutex<Option<String>>,
    /// Eager collectives not yet seen to finish, watched by the communicator's thread.
    inflight: Mutex<Inflight>,
    /// Why the watching thread aborted: handed to the first call that finds the abort (that
    /// rank's own root cause, e.g. its timeout), later calls get [`DistError::Aborted`].
    watch_error: Mutex<Option<DistError>>,
    /// Every NCCL call on the communicator holds this (NCCL calls on one communicator must
    /// not overlap, and the abort frees it: no call may be running then).
    calls: Mutex<()>,
    /// Held for the whole of one safe multi-collective exchange ([`Communicator::all_agree`]),
    /// so that two threads of one rank never interleave their halves.
    sequence: Mutex<()>,
}

// SAFETY: an NCCL communicator may be used from any thread once its device's context is
// current (every call binds it); all calls are serialised by `calls`. The raw handle is freed
// only by the abort (which holds `calls`, after `aborted` is set: no later call reaches
// NCCL) or by the drop of the last owner.
unsafe impl Send for CommInner {}
// SAFETY: as above.
unsafe impl Sync for CommInner {}

impl Drop for CommInner {
    fn drop(&mut self) {
        // Graphs that captured this communicator hold it, so none is left: destroy is local.
        if !*self.aborted.get_mut() && self.ctx.bind().is_ok() {
            // SAFETY: the communicator is live (not aborted) and this is its last owner.
            unsafe { (self.api.comm_destroy)(self.raw) };
        }
    }
}

/// One rank's NCCL communicator on one device. Cheap to clone (clones share it).
///
/// Collectives ([`Self::all_reduce`], [`Self::broadcast`]) are in place and enqueue on the
/// queue's stream; inside a capture they become graph nodes. Every rank must issue the same
/// collectives in the same order, with the same counts, captured or not alike: NCCL cannot
/// check it, so these two are `unsafe fn`s (see their `# Safety`). The safe layer on top
/// makes the counts agree: [`Self::all_agree`], [`Self::barrier`] and
/// [`super::DistributedDataParallel`]. Wait for them with
/// [`Self::synchronize`], which fails instead of hanging when a peer dies or stalls: after
/// such a failure the communicator is aborted and the process should exit (work on the
/// device may still wait for the lost peer, and anything that synchronises the device —
/// dropping a graph that ran, dropping the device — would wait with it).
#[derive(Clone)]
pub struct Communicator {
    inner: Arc<CommInner>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Communicator(rank {} of {} on device {}{})",
            self.inner.rank,
            self.inner.world,
            self.inner.ordinal,
            if self.is_aborted() { ", aborted" } else { "" }
        )
    }
}

impl Communicator {
    /// Joins the job the environment describes (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`; one process when they are unset), on `dev`: rendezvous, then NCCL.
    /// Timeouts from [`DistOptions::from_env`].
    pub fn from_env(dev: &Device) -> Result<Self> {
        let env = DistEnv::from_env()?.unwrap_or_else(DistEnv::single);
        Self::init(dev, &env, &DistOptions::from_env()?)
    }

    /// Joins the job `env` describes on `dev`. Every rank must call this; it returns once all
    /// have (or fails within the timeouts of `opts`, naming what to check).
    pub fn init(dev: &Device, env: &DistEnv, opts: &DistOptions) -> Result<Self> {
        if env.world_size == 0 || env.rank >= env.world_size {
            return Err(DistError::Usage(format!(
                "rank {} of a world of {}",
                env.rank, env.world_size
            ))
            .into());
        }
        // A missing NCCL fails here, before the rendezvous, on every rank alike.
        let api = api()?;
        let ctx = dev.context().clone();
        let m = rendezvous(env, opts.rendezvous_timeout, opts.heartbeat_timeout, || {
            unique_id(api, &ctx).map_err(|e| match e {
                NnError::Dist(d) => d,
                other => DistError::Usage(other.to_string()),
            })
        })?;
        let id = id_from_bytes(&m.payload)?;
        let health = m.monitor.as_ref().map(|x| x.health().clone());
        let pending = PendingInit::start(api, &ctx, env.rank, env.world_size, id)?;
        let deadline = Instant::now() + opts.timeout;
        let raw = match pending.wait(api, &ctx, deadline, opts.timeout, health.as_deref()) {
            Ok(raw) => raw,
            Err(e) => {
                // Tell the others why (the monitor relays it), then say so here.
                if let Some(mon) = &m.monitor {
                    mon.report_failure(&e.to_string());
                }
                return Err(e);
            }
        };
        Self::wrap(
            api,
            raw,
            env.rank,
            env.world_size,
            dev,
            opts.timeout,
            health,
            m.monitor,
        )
    }

    /// One communicator per device for one process (one thread per device): the same
    /// unique-id exchange in memory instead of over TCP. Devices must be distinct. Failures
    /// of any of them are shared, so a rank waiting in [`Self::synchronize`] fails when
    /// another one aborts. See [`super::run_threads`].
    pub fn init_threads(devices: &[Device], opts: &DistOptions) -> Result<Vec<Self>> {
        let world = devices.len();
        if world == 0 {
            return Err(DistError::Usage("no devices given".into()).into());
        }
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].iter().any(|o| o.ordinal() == d.ordinal()) {
                return Err(DistError::Usage(format!(
                    "device {} appears twice: NCCL needs one device per rank",
                    d.ordinal()
                ))
                .into());
            }
        }
        let api = api()?;
        let id = id_from_bytes(&unique_id(api, devices[0].context())?)?;
        let health = Health::new();
        let pending = devices
            .iter()
            .enumerate()
            .map(|(r, d)| PendingInit::start(api, d.context(), r, world, id))
            .collect::<Result<Vec<_>>>()?;
        let deadline = Instant::now() + opts.timeout;
        let mut comms = Vec::with_capacity(world);
        let mut first_err = None;
        for (p, d) in pending.into_iter().zip(devices) {
            match p.wait(api, d.context(), deadline, opts.timeout, Some(&health)) {
                Ok(raw) => comms.push(Self::wrap(
                    api,
                    raw,
                    comms.len(),
                    world,
                    d,
                    opts.timeout,
                    Some(health.clone()),
                    None,
                )),
                Err(e) => {
                    health.fail(e.to_string());
                    first_err.get_or_insert(e);
                    // The rest give up at once (their wait sees the failure).
                }
            }
        }
        if let Some(e) = first_err {
            // Communicators that did come up are destroyed by their drop.
            return Err(e);
        }
        comms.into_iter().collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn wrap(
        api: &'static Api,
        raw: RawComm,
        rank: usize,
        world: usize,
        dev: &Device,
        timeout: Duration,
        health: Option<Arc<Health>>,
        monitor: Option<PeerMonitor>,
    ) -> Result<Self> {
        let c = Communicator {
            inner: Arc::new(CommInner {
                raw,
                api,
                rank,
                world,
                ctx: dev.context().clone(),
                ordinal: dev.ordinal(),
                timeout,
                health,
                monitor: Mutex::new(monitor),
                aborted: AtomicBool::new(false),
                abort_reason: Mutex::new(None),
                inflight: Mutex::default(),
                watch_error: Mutex::new(None),
                calls: Mutex::new(()),
                sequence: Mutex::new(()),
            }),
        };
        let mut cu_dev: c_int = -1;
        // SAFETY: the communicator is live; writes one int.
        let st = unsafe { (api.comm_cu_device)(raw, &mut cu_dev) };
        if st != SUCCESS {
            return Err(c.fail_with(nccl_error(api, st, "ncclCommCuDevice")));
        }
        if cu_dev < 0 || cu_dev as usize != dev.ordinal() {
            return Err(c.fail_with(DistError::Usage(format!(
                "NCCL put rank {rank} on CUDA device {cu_dev}, expected device {}",
                dev.ordinal()
            ))));
        }
        if world > 1 {
            let weak = Arc::downgrade(&c.inner);
            std::thread::Builder::new()
                .name(format!("cudagraph-nccl-watch-{rank}"))
                .spawn(move || watch(weak))
                .map_err(|e| {
                    c.fail_with(DistError::Usage(format!(
                        "cannot start the NCCL watchdog thread: {e}"
                    )))
                })?;
        }
        Ok(c)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.world
    }

    /// The device the communicator runs on.
    pub fn device_ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// How long one [`Self::synchronize`] may wait.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Whether the communicator was aborted (then every call fails).
    pub fn is_aborted(&self) -> bool {
        self.inner.aborted.load(Ordering::Acquire)
    }

    fn aborted_error(&self) -> DistError {
        if let Some(e) = lock(&self.inner.watch_error).take() {
            return e;
        }
        DistError::Aborted {
            reason: lock(&self.inner.abort_reason)
                .clone()
                .unwrap_or_else(|| "unknown".into()),
        }
    }

    /// Runs one NCCL call on the live communicator, serialised with every other call and
    /// with the abort.
    fn with_comm<R>(
        &self,
        f: impl FnOnce(&'static Api, RawComm) -> R,
    ) -> std::result::Result<R, DistError> {
        // Checked before taking the lock too: an abort in progress holds it.
        if self.is_aborted() {
            return Err(self.aborted_error());
        }
        let _g = lock(&self.inner.calls);
        if self.is_aborted() {
            return Err(self.aborted_error());
        }
        Ok(f(self.inner.api, self.inner.raw))
    }

    /// Checks that `q` and `buf` are on this communicator's device, and records the
    /// communicator and the buffer with `q` (a capture keeps both alive).
    fn prepare<T: Elem>(&self, q: &dyn Queue, buf: &DeviceBuffer<T>) -> Result<()> {
        if self.is_aborted() {
            return Err(self.aborted_error().into());
        }
        let ordinal = self.inner.ordinal;
        for (what, got) in [
            ("queue", q.device().ordinal()),
            ("buffer", buf.block().device_ordinal()),
        ] {
            if got != ordinal {
                return Err(cudagraph::Error::WrongDevice {
                    what,
                    expected: ordinal,
                    got,
                }
                .into());
            }
        }
        q.use_block(buf.block());
        q.keep_alive(self.inner.clone());
        self.inner.ctx.bind()?;
        Ok(())
    }

    fn finish(&self, st: Status, call: &'static str) -> Result<()> {
        if st == SUCCESS {
            return Ok(());
        }
        let e = nccl_error(self.inner.api, st, call);
        Err(self.fail_with(e))
    }

    /// Hands the collective just enqueued on `q` to the watching thread, when `q` is eager
    /// (a captured collective runs at its graph's replays: [`Self::synchronize`] watches
    /// those). An event recorded after it tells when it has finished.
    fn watch_enqueued(&self, q: &dyn Queue) -> Result<()> {
        if self.inner.world == 1 || q.is_capturing() {
            return Ok(());
        }
        let spare = lock(&self.inner.inflight).spare.pop();
        let ev = match spare {
            Some(ev) => ev,
            None => q.device().new_event(false)?,
        };
        q.stream_handle().record(&ev)?;
        lock(&self.inner.inflight)
            .queue
            .push_back((ev, Instant::now()));
        Ok(())
    }

    /// Sums (or reduces with `op`) `buf` over all ranks, in place, on `q`'s stream.
    ///
    /// Checked here (typed errors, nothing enqueued): the queue and the buffer are on this
    /// communicator's device, and the communicator was not aborted. An empty buffer enqueues
    /// nothing. The buffer and the communicator are kept alive for as long as the work may
    /// run (by the queue, or by the graph a capture makes).
    ///
    /// # Safety
    /// Every rank of the communicator makes the matching call: `all_reduce` with the same
    /// element count (`buf.len()`), the same element type `T` and the same `op`, at the same
    /// place in its sequence of collectives on this communicator (a captured collective takes
    /// its place at every replay of its graph, in replay order; calls from several threads
    /// count in the order they reach this communicator). NCCL does not check any of it: with
    /// different counts it reads and writes past the end of the smaller buffer — in
    /// one-process mode ([`super::run_threads`]) another rank's buffer — and other mismatches
    /// hang or corrupt data. [`Self::all_agree`] lets the ranks check a count first.
    pub unsafe fn all_reduce<T: NcclElem>(
        &self,
        q: &dyn Queue,
        buf: &DeviceBuffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.prepare(q, buf)?;
        if buf.is_empty() {
            return Ok(());
        }
        let addr = buf.addr() as usize as *mut c_void;
        let stream = q.stream_handle().raw() as *mut c_void;
        let st = self.with_comm(|api, raw| {
            // SAFETY: `buf` holds `len` elements of `T` on this communicator's device
            // (checked in `prepare`), in place (send = receive buffer); the queue keeps the
            // buffer alive and ordered for as long as the work may run, and a capture keeps
            // the communicator. The peers make the matching call with the same count, type
            // and operation (this function's contract).
            unsafe { (api.all_reduce)(addr, addr, buf.len(), T::DTYPE, op.raw(), raw, stream) }
        })?;
        self.finish(st, "ncclAllReduce")?;
        self.watch_enqueued(q)
    }

    /// Copies `buf` from rank `root` to every rank, in place, on `q`'s stream.
    ///
    /// Checked here as in [`Self::all_reduce`], and `root` must be a rank of the world.
    ///
    /// # Safety
    /// Every rank of the communicator makes the matching call: `broadcast` with the same
    /// element count (`buf.len()`), the same element type `T` and the same `root`, at the same
    /// place in its sequence of collectives on this communicator (as for
    /// [`Self::all_reduce`]). With different counts NCCL writes past the end of a smaller
    /// receiving buffer.
    pub unsafe fn broadcast<T: NcclElem>(
        &self,
        q: &dyn Queue,
        buf: &DeviceBuffer<T>,
        root: usize,
    ) -> Result<()> {
        if root >= self.inner.world {
            return Err(DistError::Usage(format!(
                "broadcast from rank {root} in a world of {}",
                self.inner.world
            ))
            .into());
        }
        self.prepare(q, buf)?;
        if buf.is_empty() {
            return Ok(());
        }
        let addr = buf.addr() as usize as *mut c_void;
        let stream = q.stream_handle().raw() as *mut c_void;
        let st = self.with_comm(|api, raw| {
            // SAFETY: as in `all_reduce`; root < world.
            unsafe { (api.broadcast)(addr, addr, buf.len(), T::DTYPE, root as c_int, raw, stream) }
        })?;
        self.finish(st, "ncclBroadcast")?;
        self.watch_enqueued(q)
    }

    /// Whether every rank passed the same `values` (the same length and the same numbers),
    /// answered alike on every rank; waits for the answer with the watchdog (see
    /// [`Self::synchronize`]). Eager only: `s` is a stream, not a capture.
    ///
    /// Safe because its counts agree by construction: first every rank reduces a header of
    /// two numbers (the length), then — only where every rank found the lengths equal — the
    /// values themselves, whose count is that length. Two threads of one rank calling it at
    /// once take turns. It costs two small all-reduces and two host waits (one when the
    /// lengths differ, or for an empty slice); a one-rank world answers `true` at once.
    ///
    /// For checks such as "every rank holds the same weights" (compare checksums, e.g.
    /// `f64::to_bits` as `i64`) or "every rank built the same model".
    pub fn all_agree(&self, s: &Stream, values: &[i64]) -> Result<bool> {
        if self.inner.world == 1 {
            self.check()?;
            return Ok(true);
        }
        let _turn = lock(&self.inner.sequence);
        // The length as a bit pattern: injective for any slice length.
        let len = values.len() as u64 as i64;
        if !self.agree_step(s, &[len])? {
            return Ok(false);
        }
        if values.is_empty() {
            return Ok(true);
        }
        self.agree_step(s, values)
    }

    /// One all-reduce (max) of `values` interleaved with their bitwise complements, waited
    /// for; true when every rank passed the same `values`. The caller makes the count agree.
    fn agree_step(&self, s: &Stream, values: &[i64]) -> Result<bool> {
        let buf = s.alloc_from_host(&agreement_pairs(values))?;
        // SAFETY: every rank reaches this with the same count: the header has one value on
        // every rank, and the values' step runs only where every rank found the headers (the
        // lengths) equal; the same type (i64) and operation (max) everywhere, and `all_agree`
        // holds `sequence`, so this rank's two steps are not interleaved with another
        // thread's.
        unsafe { self.all_reduce(s, &buf, ReduceOp::Max)? };
        self.synchronize(s)?;
        Ok(agreed(values, &s.to_vec(&buf)?))
    }

    /// Waits until every rank has reached its `barrier` (or its [`Self::all_agree`] of an
    /// empty slice), with the watchdog: fails instead of hanging when a peer dies or stalls.
    /// Meeting another rank's `all_agree` of a non-empty slice instead means the ranks no
    /// longer issue the same collectives: that aborts the communicator with
    /// [`DistError::Mismatch`].
    pub fn barrier(&self, s: &Stream) -> Result<()> {
        if self.all_agree(s, &[])? {
            return Ok(());
        }
        Err(self.fail_with(DistError::Mismatch(format!(
            "rank {}'s barrier met a different collective on another rank; every rank must issue the same collectives in the same order",
            self.inner.rank
        ))))
    }

    /// Checks for failures without waiting: an earlier abort, a failed peer, NCCL's
    /// asynchronous error. Any of them aborts the communicator (if it was not) and is
    /// returned.
    pub fn check(&self) -> Result<()> {
        if self.is_aborted() {
            return Err(self.aborted_error().into());
        }
        match self.fault()? {
            Some(e) => Err(self.fail_with(e)),
            None => Ok(()),
        }
    }

    /// A failed peer or NCCL's asynchronous error, if there is one (nothing is aborted here);
    /// the abort's error where the communicator was aborted meanwhile.
    fn fault(&self) -> std::result::Result<Option<DistError>, DistError> {
        if let Some(f) = self.inner.health.as_ref().and_then(|h| h.failure()) {
            return Ok(Some(DistError::PeerFailed(f)));
        }
        let mut async_err: Status = SUCCESS;
        let st = self.with_comm(|api, raw| {
            // SAFETY: the communicator is live (not aborted, and no abort runs while we hold
            // the call lock); writes one status.
            unsafe { (api.comm_get_async_error)(raw, &mut async_err) }
        })?;
        let api = self.inner.api;
        Ok(if st != SUCCESS {
            Some(nccl_error(api, st, "ncclCommGetAsyncError"))
        } else if async_err != SUCCESS && async_err != IN_PROGRESS {
            Some(nccl_error(
                api,
                async_err,
                "an NCCL operation (asynchronous error)",
            ))
        } else {
            None
        })
    }

    /// Waits until `event` has completed, polling for failures (see [`Self::check`]); gives
    /// up after [`Self::timeout`], aborting the communicator.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if event.query()? {
                return self.check();
            }
            self.check()?;
            if start.elapsed() >= self.inner.timeout {
                return Err(self.fail_with(self.timeout_error("waiting for collectives")));
            }
            if spins < 1000 {
                spins += 1;
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// Waits for everything queued on `s` (collectives included) like
    /// [`Stream::synchronize`], but fails instead of hanging when a peer dies or stalls.
    pub fn synchronize(&self, s: &Stream) -> Result<()> {
        let ev = s.device().new_event(false)?;
        s.record(&ev)?;
        self.wait_event(&ev)?;
        Ok(s.synchronize()?)
    }

    /// Aborts the communicator: NCCL stops waiting for peers, every later call fails, and
    /// the other ranks are told `reason` (so they fail at once instead of timing out).
    /// Idempotent. Call it before exiting on an error of your own.
    pub fn abort(&self, reason: &str) {
        if self.inner.aborted.swap(true, Ordering::AcqRel) {
            return;
        }
        *lock(&self.inner.abort_reason) = Some(reason.to_string());
        if let Some(h) = &self.inner.health {
            h.fail(format!("rank {}: {reason}", self.inner.rank));
        }
        // Stopping the monitor sends the failure to the peers before this returns.
        drop(lock(&self.inner.monitor).take());
        // `ncclCommAbort` first raises the flag NCCL's kernels poll (they stop waiting for
        // peers), then may block until every graph that captured the communicator is gone:
        // run it on its own thread, after any call in flight.
        let inner = self.inner.clone();
        let _ = std::thread::Builder::new()
            .name("cudagraph-nccl-abort".into())
            .spawn(move || {
                let _g = lock(&inner.calls);
                if inner.ctx.bind().is_ok() {
                    // SAFETY: the communicator is live until this call, which is its last:
                    // `aborted` is set, so no other call reaches NCCL, and the drop skips
                    // the destroy.
                    unsafe { (inner.api.comm_abort)(inner.raw) };
                }
            });
    }

    /// Aborts with `e`'s message and hands `e` back as this layer's error.
    fn fail_with(&self, e: DistError) -> NnError {
        self.abort(&e.to_string());
        e.into()
    }
}

/// Eager collectives in flight, oldest first, each with the event recorded after it and the
/// time it was enqueued; events seen complete are kept for reuse.
#[derive(Default)]
struct Inflight {
    queue: VecDeque<(Event, Instant)>,
    spare: Vec<Event>,
}

/// How often the watching thread looks, with collectives in flight and without.
const WATCH_BUSY: Duration = Duration::from_millis(10);
const WATCH_IDLE: Duration = Duration::from_millis(100);

/// The communicator's watching thread: until the communicator is dropped or aborted, it
/// aborts it when a peer has failed, NCCL reports an asynchronous error, or an eager
/// collective has not finished [`Communicator::timeout`] after it was enqueued. The error
/// is kept for the rank's next call ([`CommInner::watch_error`]).
fn watch(inner: Weak<CommInner>) {
    loop {
        let Some(inner) = inner.upgrade() else { return };
        let c = Communicator { inner };
        if c.is_aborted() {
            return;
        }
        let (cause, busy) = c.watch_once();
        if let Some(e) = cause {
            let reason = e.to_string();
            *lock(&c.inner.watch_error) = Some(e);
            c.abort(&reason);
            return;
        }
        drop(c);
        std::thread::sleep(if busy { WATCH_BUSY } else { WATCH_IDLE });
    }
}

impl Communicator {
    /// One look of the watching thread: the failure to abort with, if any, and whether
    /// collectives are still in flight.
    fn watch_once(&self) -> (Option<DistError>, bool) {
        match self.fault() {
            Err(_) => return (None, false), // aborted meanwhile
            Ok(Some(e)) => return (Some(e), false),
            Ok(None) => {}
        }
        let mut g = lock(&self.inner.inflight);
        while let Some((ev, since)) = g.queue.pop_front() {
            // An event recorded into another library's capture never completes here.
            if ev.is_captured() || ev.query().unwrap_or(true) {
                g.spare.push(ev);
                continue;
            }
            let late = since.elapsed() >= self.inner.timeout;
            g.queue.push_front((ev, since));
            let cause = late.then(|| self.timeout_error("an NCCL collective enqueued"));
            return (cause, true);
        }
        (None, false)
    }

    /// This rank's timeout, waiting for `what`.
    fn timeout_error(&self, what: &str) -> DistError {
        DistError::Timeout {
            what: format!(
                "{what} on rank {} (device {})",
                self.inner.rank, self.inner.ordinal
            ),
            secs: self.inner.timeout.as_secs_f64(),
            hint: "a peer is stalled or did not issue the same collectives; the communicator was aborted (CUDAGRAPH_DIST_TIMEOUT sets the limit)".into(),
        }
    }
}

/// `values` interleaved with their bitwise complements: reduced with max over the ranks,
/// the pair of a position holds the largest value and the complement of the smallest.
/// (The complement, unlike the negation, reverses the order of every `i64`, `MIN` included.)
fn agreement_pairs(values: &[i64]) -> Vec<i64> {
    values.iter().flat_map(|&v| [v, !v]).collect()
}

/// Whether the max-reduction `reduced` of every rank's [`agreement_pairs`] shows that every
/// rank had this rank's `own` values: the largest and the smallest at each position are
/// `own`'s.
fn agreed(own: &[i64], reduced: &[i64]) -> bool {
    reduced == agreement_pairs(own).as_slice()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `all_agree` computes from every rank's values: the max-reduction of their pairs.
    fn reduce_max(ranks: &[Vec<i64>]) -> Vec<i64> {
        let pairs: Vec<Vec<i64>> = ranks.iter().map(|v| agreement_pairs(v)).collect();
        (0..pairs[0].len())
            .map(|i| pairs.iter().map(|p| p[i]).max().unwrap())
            .collect()
    }

    /// (issue 26, item 5) The agreement every safe collective count rests on: each rank
    /// answers "agreed" exactly when all ranks passed the same values, extremes included
    /// (a negation instead of the complement would let `i64::MIN` pass against `0`).
    #[test]
    fn agreement_holds_exactly_when_every_rank_has_the_same_values() {
        let samples = [
            i64::MIN,
            i64::MIN + 1,
            -2,
            -1,
            0,
            1,
            7,
            i64::MAX - 1,
            i64::MAX,
        ];
        for &a in &samples {
            for &b in &samples {
                for &c in &samples {
                    let ranks = vec![vec![a, c], vec![b, c], vec![a, c]];
                    let reduced = reduce_max(&ranks);
                    for (r, own) in ranks.iter().enumerate() {
                        assert_eq!(agreed(own, &reduced), a == b, "rank {r}: {ranks:?}");
                    }
                }
            }
        }
        // One position differs among many: every rank sees it.
        let mut ranks = vec![(0..100).collect::<Vec<i64>>(); 4];
        ranks[2][57] = 58;
        let reduced = reduce_max(&ranks);
        assert!(ranks.iter().all(|own| !agreed(own, &reduced)));
        // An empty slice agrees with itself; a reduction of the wrong length never agrees.
        assert!(agreed(&[], &[]));
        assert!(!agreed(&[1], &agreement_pairs(&[1, 2])));
    }
}
