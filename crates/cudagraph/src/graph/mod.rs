//! Capture and replay: [`Graph::capture`] records work issued on a [`CaptureStream`] into a
//! CUDA graph, [`Graph::replay`] runs it with one launch, [`StaticGraph`] adds static inputs and
//! outputs (copy in, replay, read out) and [`warmup`] runs work on a side stream first.
//!
//! Safety by construction:
//! - the capture closure only gets a [`CaptureStream`], which has no synchronising or
//!   device-to-host method, and whose library view ([`crate::StreamRef`]) cannot wait either
//!   (the stream itself is borrowed mutably for the whole capture);
//! - every allocation inside the closure comes from the graph's pool;
//! - a graph holds its pool and every buffer, kernel module and host callback it uses, so
//!   dropping user handles can never leave a dangling address in a graph;
//! - a graph never releases anything while a replay may still run: each replay records an
//!   event, and dropping the graph (or rebinding away from a buffer) waits for it — or, where
//!   waiting is not allowed (on a thread that is capturing), hands the resources to a
//!   deferred-release list drained once the event has completed. Every recording of the event
//!   covers every earlier replay (the first replay after a re-instantiation waits for it), so
//!   a later replay recording it again never shortens a deferred release; a replay whose event
//!   could not be recorded makes the graph wait for the whole device before it releases
//!   anything (or, where it cannot, keep everything);
//! - rebind lets go only of buffers it moved the graph away from and proved unreferenced, and
//!   refuses graphs it cannot read completely;
//! - the driver's graph objects are not thread-safe, so a graph serialises its own calls;
//! - a capture that fails for any reason (the closure's error, a panic, or the driver
//!   invalidating it) is ended and discarded: the stream and the pool are usable afterwards.
//!
//! Work can branch onto a second stream and come back ([`Fork::fork`] gives a [`SideStream`],
//! [`SideStream::join`] ends it): eagerly that is two streams ordered by events; inside a
//! capture the side stream joins the capture, so the graph gets a parallel branch (NCCL
//! collectives beside the backward pass, say). A side branch allocates from the capture's
//! pool and the graph keeps everything it uses.

mod builder;
pub mod cache;
mod conditional;
pub mod planner;
mod static_io;
mod topology;

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;
use std::panic::Location;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

pub use builder::{GraphBuilder, NodeId};

pub use cache::{
    bucket_for, BatchModel, BucketPolicy, CacheOptions, CacheOutput, CacheStats, Choice, EntryInfo,
    GraphCache, Selection, Served, Staged,
};
pub use conditional::ConditionalKind;
pub use planner::{plan_capture_sizes, CapturePlan, GraphCost, SizeHistogram};
pub use static_io::{Outputs, StaticGraph};

use crate::device::{check_device, Anchor, Arg, CheckRecord, Device, EndWork, Queue, Stream};
use crate::error::{Error, Result};
use crate::memory::order::LastUse;
use crate::memory::{BlockRef, DeviceBuffer, Elem, Pool, PoolId, PoolPin, WindowStats};
use crate::runtime::graph::{self as raw, ExecHandle, GraphHandle, Remap};
use crate::runtime::{
    capturing_on_this_thread, CaptureMode, Event, Function, StreamHandle, StreamRef,
};

/// Options for [`Graph::capture`].
#[derive(Clone, Debug, Default)]
pub struct CaptureOptions {
    pool: Option<Pool>,
    mode: CaptureMode,
    upload: bool,
}

impl CaptureOptions {
    /// A private pool, thread-local mode, no upload.
    pub fn new() -> Self {
        Self::default()
    }

    /// Capture into a shared pool (see [`Pool`]: graphs of one pool share temporaries, and
    /// their replays are ordered so that they never overlap).
    pub fn pool(mut self, pool: &Pool) -> Self {
        self.pool = Some(pool.clone());
        self
    }

    /// How strictly the driver polices other calls during the capture (see [`CaptureMode`]).
    pub fn mode(mut self, mode: CaptureMode) -> Self {
        self.mode = mode;
        self
    }

    /// Upload the executable graph to the device right after instantiation, so the first
    /// replay is as fast as the rest.
    pub fn upload(mut self, upload: bool) -> Self {
        self.upload = upload;
        self
    }
}

static CAPTURE_IDS: AtomicU64 = AtomicU64::new(1);

/// What a graph keeps alive.
#[derive(Default)]
pub(crate) struct Keep {
    held: Vec<Arc<BlockRef>>,
    /// Blocks of the graph's own pool still allocated when its capture ended (outputs and
    /// anything else the graph writes): the graph's until it is dropped (see [`Pool`]).
    owned: Vec<Arc<BlockRef>>,
    /// The check records the graph's kernels report into: its own, if a kernel asked for one,
    /// and those of embedded child graphs.
    checks: Vec<Arc<CheckRecord>>,
    /// Pools of embedded child graphs, whose memory the graph's replays use too.
    pools: Vec<Pool>,
    held_set: HashSet<usize>,
    anchors: Vec<Anchor>,
    functions: HashSet<usize>,
    /// Blocks of the capture's own pool that a side branch used (kept as anchors, see
    /// [`SideStream`]).
    side_pinned: HashSet<usize>,
}

impl Keep {
    fn hold(&mut self, block: &Arc<BlockRef>) {
        if self.held_set.insert(Arc::as_ptr(block) as usize) {
            self.held.push(block.clone());
        }
    }

    fn hold_function(&mut self, f: &Function) {
        if self.functions.insert(f.raw.0 as usize) {
            self.anchors.push(Arc::new(f.clone()));
        }
    }

    /// Takes over everything `other` keeps (a conditional body's share of the graph, an
    /// embedded child graph's).
    fn merge(&mut self, other: Keep) {
        for b in &other.held {
            self.hold(b);
        }
        self.anchors.extend(other.anchors);
        self.functions.extend(other.functions);
        self.side_pinned.extend(other.side_pinned);
        self.owned.extend(other.owned);
        self.checks.extend(other.checks);
        self.pools.extend(other.pools);
    }

    /// Keeps a block of the capture's own pool until the graph goes, so that it is not handed
    /// out again inside the capture (where the main branch could reuse it while the side
    /// branch still runs).
    fn pin(&mut self, block: &Arc<BlockRef>) {
        if self.side_pinned.insert(Arc::as_ptr(block) as usize) {
            self.anchors.push(block.clone());
        }
    }
}

/// The pools a graph's replays use — its own first, then embedded child graphs' — each once,
/// sorted so that every graph enters their orders in the same sequence (no lock cycle).
fn replay_pools(own: Option<&Pool>, mut others: Vec<Pool>) -> Vec<Pool> {
    others.extend(own.cloned());
    let key = |p: &Pool| (Arc::as_ptr(p.allocator()) as usize, p.id());
    others.sort_by_key(key);
    others.dedup_by_key(|p| key(p));
    others
}

/// State of one capture shared by its capture stream, the streams recording its conditional
/// bodies and its side branches.
#[derive(Default)]
struct CaptureShared {
    /// Every block allocated from the pool during the capture (those still alive at its end
    /// become the graph's).
    allocated: RefCell<Vec<Weak<BlockRef>>>,
    /// The graph's check record, created when a kernel first asks for one.
    check: RefCell<Option<Arc<CheckRecord>>>,
}

impl CaptureShared {
    fn check_record(&self, device: &Device) -> Result<Arc<CheckRecord>> {
        let mut c = self.check.borrow_mut();
        if let Some(r) = c.as_ref() {
            return Ok(r.clone());
        }
        let r = device.new_check_record()?;
        *c = Some(r.clone());
        Ok(r)
    }

    /// The blocks allocated during the capture that are still alive.
    fn live_blocks(&self) -> Vec<Arc<BlockRef>> {
        self.allocated
            .borrow()
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }
}

/// Work registered with [`Queue::at_end`] on one capture stream, in order, one per key.
#[derive(Default)]
struct EndList(RefCell<Vec<(usize, Option<EndWork>)>>);

impl EndList {
    fn add(&self, key: usize, work: EndWork) {
        let mut l = self.0.borrow_mut();
        if !l.iter().any(|(k, _)| *k == key) {
            l.push((key, Some(work)));
        }
    }

    /// Runs the registered work on `q`, in registration order.
    fn run(&self, q: &dyn Queue) -> Result<()> {
        let mut i = 0;
        loop {
            let work = {
                let mut l = self.0.borrow_mut();
                match l.get_mut(i) {
                    Some((_, w)) => w.take(),
                    None => return Ok(()),
                }
            };
            if let Some(w) = work {
                w(q)?;
            }
            i += 1;
        }
    }
}

/// Side streams that joined a capture; their capture state is cleared when the capture has
/// ended (also on error or panic: this value is dropped after the capture is ended).
#[derive(Default)]
struct SideList(RefCell<Vec<StreamHandle>>);

impl SideList {
    fn contains(&self, s: &StreamHandle) -> bool {
        self.0.borrow().iter().any(|h| h.id() == s.id())
    }
}

impl Drop for SideList {
    fn drop(&mut self) {
        for s in self.0.get_mut().drain(..) {
            s.leave_capture();
        }
    }
}

/// The stream handed to a capture closure. It implements [`Queue`] (allocate, launch, copy,
/// fill) and nothing else: no synchronisation and no device-to-host reads, so those mistakes
/// do not compile.
pub struct CaptureStream<'s> {
    stream: &'s Stream,
    pool: Pool,
    id: u64,
    keep: RefCell<Keep>,
    /// Capture mode (conditional bodies are captured in the same mode).
    mode: CaptureMode,
    /// The stream the capture began on, and how deep in conditional bodies this stream is.
    root_stream: u64,
    depth: usize,
    /// Set while this stream records a conditional body (see `conditional`).
    scope: Option<RefCell<conditional::BodyScope>>,
    /// Conditional nodes recorded so far, at every depth.
    conds: RefCell<Vec<conditional::CondRecord>>,
    /// Side streams that joined this capture (see [`Fork`]).
    sides: &'s SideList,
    /// State shared with the whole capture.
    shared: &'s CaptureShared,
    /// Work to run on this stream right before it stops recording ([`Queue::at_end`]).
    at_end: EndList,
}

impl fmt::Debug for CaptureStream<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CaptureStream(#{} into {})", self.id, self.pool.id())
    }
}

impl CaptureStream<'_> {
    /// The pool this capture allocates from.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }
}

impl crate::device::Sealed for CaptureStream<'_> {}

impl Queue for CaptureStream<'_> {
    fn device(&self) -> &Device {
        self.stream.device()
    }

    fn stream_handle(&self) -> StreamRef<'_> {
        self.stream.handle.as_ref()
    }

    fn capture_id(&self) -> Option<u64> {
        Some(self.id)
    }

    #[track_caller]
    fn alloc_block(&self, bytes: usize) -> Result<Arc<BlockRef>> {
        let alloc = self.pool.allocator();
        // SAFETY: a capture into this pool allocates from it; graph pools ignore the stream.
        let a = unsafe { alloc.allocate_raw(bytes, self.pool.id(), 0) }?;
        let block = BlockRef::from_allocation(alloc, a, 0, self.id);
        self.shared
            .allocated
            .borrow_mut()
            .push(Arc::downgrade(&block));
        if let Some(scope) = &self.scope {
            scope.borrow_mut().allocated(&block);
        }
        Ok(block)
    }

    fn use_block(&self, block: &Arc<BlockRef>) {
        // Blocks of this capture's own pool live as long as the pool, which the graph holds;
        // anything else (weights, static inputs in the default pool) is kept by the graph.
        if !block.is_in(&self.pool) {
            self.keep.borrow_mut().hold(block);
        }
        // Inside a conditional body, blocks from outside the body stay allocated until the
        // body is recorded (a loop body reruns: its inputs must not be reused inside it).
        if let Some(scope) = &self.scope {
            scope.borrow_mut().used(block);
        }
    }

    fn keep_alive(&self, anchor: Anchor) {
        self.keep.borrow_mut().anchors.push(anchor);
    }

    fn hold_function(&self, f: &Function) {
        self.keep.borrow_mut().hold_function(f);
    }

    fn check_flag_arg(&self) -> Result<Arg<'static>> {
        let r = self.shared.check_record(self.device())?;
        Ok(Arg::Ptr {
            addr: r.device_addr(),
            holder: None,
        })
    }

    fn at_end(&self, key: usize, work: EndWork) -> Result<()> {
        self.at_end.add(key, work);
        Ok(())
    }
}

/// Counts of graph nodes by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeCounts {
    pub kernel: usize,
    pub memcpy: usize,
    pub memset: usize,
    pub host: usize,
    pub child_graph: usize,
    pub empty: usize,
    /// Conditional (IF / WHILE) nodes; their bodies are counted in
    /// [`GraphInfo::conditionals`].
    pub conditional: usize,
    pub other: usize,
}

impl NodeCounts {
    pub(crate) fn from_types(types: &[u32]) -> Self {
        let mut c = NodeCounts::default();
        for t in types {
            match t {
                0 => c.kernel += 1,
                1 => c.memcpy += 1,
                2 => c.memset += 1,
                3 => c.host += 1,
                4 => c.child_graph += 1,
                5 => c.empty += 1,
                &t if t == raw::NODE_TYPE_CONDITIONAL => c.conditional += 1,
                _ => c.other += 1,
            }
        }
        c
    }

    pub fn total(&self) -> usize {
        self.kernel
            + self.memcpy
            + self.memset
            + self.host
            + self.child_graph
            + self.empty
            + self.conditional
            + self.other
    }
}

/// Memory a graph accounts for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphMemory {
    /// The pool the graph allocated from.
    pub pool: PoolId,
    /// Peak bytes allocated in the pool during the capture (the graph's working set).
    pub peak_allocated: usize,
    /// Bytes allocated during the capture that were still allocated when it ended (outputs).
    pub live_at_end: usize,
    /// Bytes the pool reserved from the driver during the capture.
    pub reserved_growth: usize,
    /// Bytes of buffers from outside the capture (weights, static inputs) the graph keeps alive.
    pub external_held: usize,
}

/// Facts about one graph.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GraphInfo {
    pub nodes: NodeCounts,
    pub capture_time: Duration,
    pub instantiate_time: Duration,
    pub memory: GraphMemory,
    /// Conditional nodes at every depth, by kind, and the nodes inside their bodies.
    pub conditionals: ConditionalCounts,
    /// Programmatic (PDL) dependency edges, in the graph and in conditional bodies.
    pub programmatic_edges: usize,
}

/// Conditional nodes of a graph (at any depth) and what their bodies hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConditionalCounts {
    pub if_nodes: usize,
    pub while_nodes: usize,
    /// Nodes inside conditional bodies, nested bodies included (the conditional nodes of
    /// nested conditionals among them).
    pub body_nodes: NodeCounts,
}

/// The driver objects of a graph; every call on them goes through this mutex.
struct Exec {
    graph: GraphHandle,
    exec: ExecHandle,
}

/// Everything a graph releases when it goes, in one value so it can be handed to the
/// deferred-release list whole.
struct Resources {
    exec: Exec,
    /// Blocks of the graph's pool alive at the end of its capture (see [`Keep::owned`]).
    owned: Vec<Arc<BlockRef>>,
    /// The records the graph's kernels report failed checks into.
    checks: Vec<Arc<CheckRecord>>,
    /// Conditional nodes and their bodies (owned by `exec.graph`).
    conds: Vec<conditional::CondRecord>,
    held: Vec<Arc<BlockRef>>,
    anchors: Vec<Anchor>,
    /// Set when rebind replaced the executable graph after a replay: the driver orders launches
    /// of one executable graph, not of two, so the next replay first waits for `done` (see
    /// [`Graph::replay_on`]).
    order_after_done: bool,
    /// Keeps the pool's segments mapped while the graph exists.
    _pin: Option<PoolPin>,
}

/// A captured (or built) and instantiated CUDA graph.
pub struct Graph {
    res: Option<Mutex<Resources>>,
    /// Recorded after every replay: completes once the last replay (and every earlier one:
    /// launches of one executable graph are ordered by the driver, and the first replay after
    /// a re-instantiation waits for this event before it launches) has finished. Releases
    /// deferred with it stay safe when a later replay records it again.
    done: Event,
    /// Set before the first launch: from then on, releasing resources waits for `done`.
    replayed: AtomicBool,
    /// Set when a launch may not be covered by `done` (recording it failed after the launch
    /// and the device could not be waited for then): resources are released only after a
    /// device-wide synchronisation, or never.
    completion_lost: AtomicBool,
    /// The stream of the last replay: a replay on another stream waits for it.
    order: LastUse,
    /// Every pool whose memory replays use (its own and embedded child graphs'), in a fixed
    /// order: a replay is ordered after the last replay of every graph of each.
    pools: Vec<Pool>,
    device: Device,
    pool: Option<Pool>,
    info: GraphInfo,
    replays: AtomicU64,
    rebinds: u64,
    reinstantiations: u64,
}

/// What [`Graph::rebind`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RebindOutcome {
    /// The executable graph was updated in place (`nodes` nodes changed).
    Updated { nodes: usize },
    /// The driver refused the in-place update; the graph was re-instantiated.
    Reinstantiated { nodes: usize },
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.info;
        write!(
            f,
            "Graph({} nodes: {} kernel, {} memcpy, {} memset; {}; peak {} B, outputs {} B, held {} B; captured in {:.1?}, instantiated in {:.1?}; {} replays)",
            i.nodes.total(),
            i.nodes.kernel,
            i.nodes.memcpy,
            i.nodes.memset,
            i.memory.pool,
            i.memory.peak_allocated,
            i.memory.live_at_end,
            i.memory.external_held,
            i.capture_time,
            i.instantiate_time,
            self.replays.load(Ordering::Relaxed)
        )
    }
}

/// Resources waiting for a replay to finish before they may be released.
struct Retired {
    done: Event,
    _what: Box<dyn Any + Send>,
}

static RETIRED: Mutex<Vec<Retired>> = Mutex::new(Vec::new());
static RETIRED_COUNT: AtomicUsize = AtomicUsize::new(0);

/// Releases `what` once `done` has completed: now if it has, after waiting if this thread may
/// wait, else later (see [`drain_retired`]).
fn retire(done: &Event, what: Box<dyn Any + Send>) {
    // On a capturing thread even querying the event would invalidate the capture: defer.
    if !capturing_on_this_thread() {
        match done.synchronize() {
            // Finished, or the context is lost and nothing runs any more: release.
            Ok(()) => return,
            Err(e) if e.is_context_lost() => return,
            // The wait failed for another reason (another thread's global-mode capture, a
            // host callback that drops the graph): the replay may still run. Keep it all and
            // ask the event again later (`drain_retired`).
            Err(_) => {}
        }
    }
    let mut r = RETIRED.lock().unwrap_or_else(|p| p.into_inner());
    r.push(Retired {
        done: done.clone(),
        _what: what,
    });
    RETIRED_COUNT.store(r.len(), Ordering::Release);
}

/// Releases retired resources whose replays have finished. Cheap when there are none.
pub(crate) fn drain_retired() {
    if RETIRED_COUNT.load(Ordering::Acquire) == 0 || capturing_on_this_thread() {
        return;
    }
    let done: Vec<Retired> = {
        let mut r = RETIRED.lock().unwrap_or_else(|p| p.into_inner());
        let (done, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut *r)
            .into_iter()
            // Released once the event says done (or the context is lost); kept while it
            // cannot say.
            .partition(|x| x.done.query().unwrap_or_else(|e| e.is_context_lost()));
        *r = keep;
        RETIRED_COUNT.store(r.len(), Ordering::Release);
        done
    };
    drop(done);
}

impl Drop for Graph {
    fn drop(&mut self) {
        let Some(res) = self.res.take() else { return };
        let res = res.into_inner().unwrap_or_else(|p| p.into_inner());
        if self.settle_lost_completion().is_err() {
            // A launch `done` does not cover may still run, and the device cannot be waited
            // for: never release what it may use.
            std::mem::forget(res);
            return;
        }
        if self.replayed.load(Ordering::Acquire) {
            retire(&self.done, Box::new(res));
        }
    }
}

/// Ends a capture that is still open when it goes out of scope (error or panic in the closure),
/// and closes the pool's capture window.
struct OpenCapture<'a> {
    stream: &'a StreamHandle,
    pool: Pool,
    capturing: bool,
    window: Option<WindowStats>,
}

impl OpenCapture<'_> {
    fn end(&mut self) -> Result<GraphHandle> {
        self.capturing = false;
        let ended = self.stream.end_capture();
        self.close_window();
        ended
    }

    fn close_window(&mut self) {
        if self.window.is_none() {
            // SAFETY: balances the `open_window` in `Graph::capture`; the capture has ended
            // (or never began) when this runs.
            self.window = Some(unsafe { self.pool.allocator().close_window(self.pool.id()) });
        }
    }
}

impl Drop for OpenCapture<'_> {
    fn drop(&mut self) {
        if self.capturing {
            // Discard whatever was captured; the stream leaves capture mode either way.
            let _ = self.end();
        }
        self.close_window();
    }
}

impl Graph {
    /// Captures the work `f` issues on the capture stream into a new graph, and instantiates it.
    ///
    /// `stream` is borrowed mutably for the whole capture, so it cannot be synchronised or read
    /// from inside `f`. Returns the graph and whatever `f` returned (typically output buffers,
    /// which live in the graph's pool). On any failure the capture is discarded and the stream
    /// and pool stay usable; the error names this call site and, inside it, the failing call.
    /// A closure that issues no work gives [`Error::EmptyCapture`].
    ///
    /// ```no_run
    /// # use cudagraph::*;
    /// # fn main() -> Result<()> {
    /// let dev = Device::open(0)?;
    /// let mut stream = dev.new_stream()?;
    /// let k = dev.compile("scale", r#"extern "C" __global__ void scale(float* x, int n) {
    ///     int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= 2.0f; }"#)?
    ///     .function("scale")?;
    /// let x = stream.alloc_from_host(&[1.0f32; 1024])?;
    /// let (graph, ()) = Graph::capture(&mut stream, CaptureOptions::new(), |cs| {
    ///     // SAFETY: `scale` writes x[0..n) with n = x.len().
    ///     unsafe { cs.launch(&k, LaunchConfig::for_elements(1024, 256), args![&x, 1024i32]) }
    /// })?;
    /// graph.replay(&stream)?;
    /// assert_eq!(stream.to_vec(&x)?[0], 2.0);
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn capture<T, F>(stream: &mut Stream, opts: CaptureOptions, f: F) -> Result<(Graph, T)>
    where
        F: FnOnce(&CaptureStream<'_>) -> Result<T>,
    {
        let at = Location::caller();
        let device = stream.device().clone();
        let wrap = |e: Error| Error::CaptureFailed {
            at,
            source: Box::new(e),
        };
        device.context().bind().map_err(wrap)?;
        drain_retired();
        let pool = opts
            .pool
            .clone()
            .unwrap_or_else(|| device.graph_pool_handle());
        if pool.allocator().ordinal() != device.ordinal() {
            return Err(Error::WrongDevice {
                what: "pool",
                expected: device.ordinal(),
                got: pool.allocator().ordinal(),
            });
        }
        let reserved_before = pool.stats().reserved;
        if !pool.allocator().open_window(pool.id()) {
            return Err(wrap(Error::InvalidGraph {
                problem: format!(
                    "{} is already being captured into by another capture",
                    pool.id()
                ),
            }));
        }
        // Declared before `open`, so dropped after it has ended the capture.
        let sides = SideList::default();
        let shared = CaptureShared::default();
        let mut open = OpenCapture {
            stream: &stream.handle,
            pool: pool.clone(),
            capturing: false,
            window: None,
        };
        let t0 = Instant::now();
        stream.handle.begin_capture(opts.mode).map_err(wrap)?;
        open.capturing = true;
        let cs = CaptureStream {
            stream,
            pool: pool.clone(),
            id: CAPTURE_IDS.fetch_add(1, Ordering::Relaxed),
            keep: RefCell::new(Keep::default()),
            mode: opts.mode,
            root_stream: stream.handle.id(),
            depth: 0,
            scope: None,
            conds: RefCell::new(Vec::new()),
            sides: &sides,
            shared: &shared,
            at_end: EndList::default(),
        };
        let result = f(&cs).and_then(|t| cs.at_end.run(&cs).map(|()| t));
        let ended = open.end();
        let (value, g) = match (result, ended) {
            (Err(e), _) => return Err(wrap(e)),
            (Ok(_), Err(e)) => {
                return Err(Error::CaptureInvalidated {
                    at,
                    detail: e.to_string(),
                })
            }
            (Ok(t), Ok(g)) => (t, g),
        };
        let capture_time = t0.elapsed();
        let window = open.window.take().unwrap_or_default();
        let mut keep = cs.keep.into_inner();
        let conds = cs.conds.into_inner();
        keep.owned = shared.live_blocks();
        keep.checks.extend(shared.check.into_inner());
        let memory = GraphMemory {
            pool: pool.id(),
            peak_allocated: window.peak_allocated,
            live_at_end: window.live_at_end,
            reserved_growth: pool.stats().reserved.saturating_sub(reserved_before),
            external_held: keep.held.iter().map(|b| b.size()).sum(),
        };
        let types = g.node_types().map_err(wrap)?;
        if types.is_empty() {
            return Err(Error::EmptyCapture { at });
        }
        let mut graph =
            Self::instantiate(&device, g, types, Some(pool), keep, capture_time, memory)
                .map_err(wrap)?;
        graph.adopt_conditionals(conds).map_err(wrap)?;
        if opts.upload {
            graph.upload(stream)?;
        }
        Ok((graph, value))
    }

    /// Instantiates a raw graph this value will own.
    fn instantiate(
        device: &Device,
        g: GraphHandle,
        types: Vec<u32>,
        pool: Option<Pool>,
        keep: Keep,
        capture_time: Duration,
        memory: GraphMemory,
    ) -> Result<Self> {
        let t1 = Instant::now();
        let exec = g.instantiate()?;
        let done = device.new_event(false)?;
        Ok(Graph {
            res: Some(Mutex::new(Resources {
                exec: Exec { graph: g, exec },
                owned: keep.owned,
                checks: keep.checks,
                conds: Vec::new(),
                held: keep.held,
                anchors: keep.anchors,
                order_after_done: false,
                _pin: pool.as_ref().map(Pool::pin),
            })),
            done,
            replayed: AtomicBool::new(false),
            completion_lost: AtomicBool::new(false),
            order: LastUse::default(),
            pools: replay_pools(pool.as_ref(), keep.pools),
            device: device.clone(),
            pool,
            info: GraphInfo {
                nodes: NodeCounts::from_types(&types),
                capture_time,
                instantiate_time: t1.elapsed(),
                memory,
                conditionals: ConditionalCounts::default(),
                programmatic_edges: 0,
            },
            replays: AtomicU64::new(0),
            rebinds: 0,
            reinstantiations: 0,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Resources> {
        self.res
            .as_ref()
            .expect("resources live until drop")
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Makes the graph use `new`'s memory wherever it used `old`'s: kernel arguments, copy and
    /// memset nodes are rewritten and the executable graph is updated in place, without a
    /// capture or a copy into a static buffer. When the driver refuses the update, the graph
    /// is re-instantiated instead (reported in the outcome and counted). The graph keeps `new`
    /// alive from now on, and lets go of `old` once no node refers to it any more (after the
    /// last replay that may use it has finished), so rebinding to fresh buffers keeps memory
    /// flat.
    ///
    /// Rebinding moves whole blocks: every address inside `old`'s block (the memory all views
    /// of it share, [`DeviceBuffer::block`]) moves to the same offset in `new`'s block, interior
    /// pointers included. So `new` must hold at least as many elements as `old`, and its block
    /// at least as many bytes as `old`'s whole block — the graph may reach any byte of it,
    /// whichever view of it `old` is — or rebind returns [`Error::SizeMismatch`]. Buffers of
    /// equal length up to 1 MiB have equal blocks; larger blocks may be rounded up by the
    /// allocator, and the error says how many bytes `new` needs.
    ///
    /// Rebinding is for buffers allocated outside the capture (inputs, weights, outputs
    /// allocated beforehand) that the graph reads or writes as a whole. Pointers the graph
    /// computed from `old` at capture time but did not receive as arguments cannot be seen
    /// and are not rewritten; neither is an argument pointing one past the end of `old`'s
    /// block (that address is the start of whatever lies next in memory).
    ///
    /// Refused with a typed error, changing nothing:
    /// - `old` in the graph's own pool ([`Error::NotSupported`]): the graph's temporaries reuse
    ///   the addresses of its pool, so one address there may stand for several buffers;
    /// - graphs with conditional nodes ([`Error::InvalidGraph`]) or with nodes whose use of
    ///   memory rebind cannot read completely — child graphs, event, memory-operation and
    ///   external-semaphore nodes, copies with array endpoints ([`Error::NotSupported`]);
    /// - graphs that hold another library's kernels (cuBLAS, cuBLASLt, cuDNN) where the driver
    ///   cannot report those kernels' parameter lists (before CUDA 13.2, see
    ///   [`crate::runtime::driver_reports_library_params`]; [`Error::NotSupported`]);
    /// - one block listed twice as `old` ([`Error::InvalidGraph`]).
    ///
    /// A graph lets go of `old` only when every kernel node runs one of our kernels (compiled
    /// by this library, so every address it receives is in its parameters). Another library's
    /// kernels may also reach memory through addresses stored in device memory, which rebind
    /// cannot see: a graph holding them keeps every buffer it was bound to until it is dropped.
    #[track_caller]
    pub fn rebind<T: Elem>(
        &mut self,
        old: &DeviceBuffer<T>,
        new: &DeviceBuffer<T>,
    ) -> Result<RebindOutcome> {
        self.rebind_all(&[(old, new)])
    }

    /// [`Self::rebind`] for several buffers at once.
    #[track_caller]
    pub fn rebind_all<T: Elem>(
        &mut self,
        pairs: &[(&DeviceBuffer<T>, &DeviceBuffer<T>)],
    ) -> Result<RebindOutcome> {
        if self.info.nodes.conditional > 0 {
            return Err(Error::InvalidGraph {
                problem: "rebind cannot rewrite kernels inside conditional bodies, so graphs with conditional nodes cannot be rebound; copy into the graph's inputs or re-capture".into(),
            });
        }
        let mut checked = Vec::with_capacity(pairs.len());
        for (old, new) in pairs {
            check_device(&self.device, new.block())?;
            checked.push(RebindPair {
                old_len: old.len(),
                new_len: new.len(),
                old_block: (old.block().addr(), old.block().size()),
                new_block: (new.block().addr(), new.block().size()),
                old_in_own_pool: self.in_own_pool(old),
            });
        }
        let remaps = plan_remaps(&checked)?;
        self.device.context().bind()?;
        self.settle_lost_completion()?;
        let done = self.done.clone();
        let replayed = self.replayed.load(Ordering::Acquire);
        let mut guard = self.lock();
        let res = &mut *guard;
        // Reads every node; refuses (changing nothing) a graph it cannot read completely.
        let mut plan = raw::plan_rebind(&res.exec.graph, &remaps)?;
        let nodes = plan.nodes_changed();
        let all_kernels_ours = plan.all_kernels_ours;
        let referenced = std::mem::take(&mut plan.referenced);
        let moved_from = std::mem::take(&mut plan.moved_from);
        // Hold every new buffer the rewritten graph refers to before any node changes, so that
        // even a driver error half-way leaves nothing the graph may use unheld.
        for (_, new) in pairs {
            let b = new.block();
            if !self.in_own_pool(new)
                && raw::references_range(&referenced, b.addr(), b.size())
                && !res.held.iter().any(|h| Arc::ptr_eq(h, b))
            {
                res.held.push(b.clone());
            }
        }
        let outcome = if plan.apply(&res.exec.exec)? {
            RebindOutcome::Updated { nodes }
        } else {
            let exec = res.exec.graph.instantiate()?;
            let old = std::mem::replace(&mut res.exec.exec, exec);
            if replayed {
                // The driver orders launches of one executable graph, not of two: the next
                // replay waits for the last one of the old graph, so that `done` keeps covering
                // every replay (and the release below, if deferred, waits for this one).
                res.order_after_done = true;
                retire(&done, Box::new(old));
            }
            RebindOutcome::Reinstantiated { nodes }
        };
        // Let go of a held block only when this rebind moved the graph's references away from
        // it, none is left, and every reference is visible (see the doc comment) — never of
        // anything else the graph holds: a block a library declared with `Queue::use_block`
        // may be reached only through device memory.
        let released: Vec<Arc<BlockRef>> = if all_kernels_ours {
            let (keep, released) = std::mem::take(&mut res.held).into_iter().partition(|b| {
                let moved = moved_from.contains(&b.addr())
                    && pairs.iter().any(|(old, _)| Arc::ptr_eq(b, old.block()));
                !moved || raw::references_range(&referenced, b.addr(), b.size())
            });
            res.held = keep;
            released
        } else {
            Vec::new()
        };
        drop(guard);
        if matches!(outcome, RebindOutcome::Reinstantiated { .. }) {
            self.reinstantiations += 1;
        }
        if replayed && !released.is_empty() {
            retire(&done, Box::new(released));
        }
        self.rebinds += 1;
        Ok(outcome)
    }

    /// After a replay whose completion could not be recorded (see `completion_lost`): waits
    /// for the whole device, after which `done` covers every replay again. Fails where that
    /// wait is impossible (a capturing thread, a lost context).
    #[track_caller]
    fn settle_lost_completion(&self) -> Result<()> {
        if !self.completion_lost.load(Ordering::Acquire) {
            return Ok(());
        }
        if capturing_on_this_thread() {
            return Err(Error::InvalidGraph {
                problem: "an earlier replay of this graph could not record its completion event, so the graph must wait for the whole device before it is replayed, rebound or released, and this thread is capturing; end the capture first".into(),
            });
        }
        self.device.context().synchronize()?;
        self.completion_lost.store(false, Ordering::Release);
        Ok(())
    }

    fn in_own_pool<T: Elem>(&self, b: &DeviceBuffer<T>) -> bool {
        self.pool.as_ref().is_some_and(|p| b.block().is_in(p))
    }

    /// Everything this graph keeps alive, for a parent graph that embeds it as a child: a copy
    /// of its `CUgraph` (the parent's builder owns it) and shared handles to its resources.
    pub(crate) fn share_for_child(&self) -> Result<(GraphHandle, Keep)> {
        let res = self.lock();
        let copy = res.exec.graph.try_clone()?;
        let mut keep = Keep {
            anchors: res.anchors.clone(),
            owned: res.owned.clone(),
            checks: res.checks.clone(),
            pools: self.pools.clone(),
            ..Keep::default()
        };
        for b in &res.held {
            keep.hold(b);
        }
        if let Some(p) = &self.pool {
            keep.anchors.push(Arc::new(p.pin()));
        }
        Ok((copy, keep))
    }

    /// (rebinds, of which re-instantiations) so far.
    pub fn rebind_counts(&self) -> (u64, u64) {
        (self.rebinds, self.reinstantiations)
    }

    /// Launches the whole graph on `stream` (one driver call, plus recording the completion
    /// event this graph's drop waits for).
    #[track_caller]
    pub fn replay(&self, stream: &Stream) -> Result<()> {
        self.replay_on(stream.handle.as_ref())
    }

    /// [`Self::replay`], then waits for the stream and reports a failed device-side check
    /// (see [`Device::check_errors`]).
    #[track_caller]
    pub fn replay_checked(&self, stream: &Stream) -> Result<()> {
        self.replay(stream)?;
        stream.synchronize()
    }

    /// [`Self::replay`] on a library's view of a stream (for layers that hold a
    /// [`Queue::stream_handle`] rather than a [`Stream`]). Refuses a capturing stream.
    #[track_caller]
    pub fn replay_on(&self, stream: StreamRef<'_>) -> Result<()> {
        if stream.context().ordinal() != self.device.ordinal() {
            return Err(Error::WrongDevice {
                what: "graph",
                expected: stream.context().ordinal(),
                got: self.device.ordinal(),
            });
        }
        self.device.context().bind()?;
        if stream.is_capturing()? {
            return Err(Error::InvalidGraph {
                problem: "replay on a capturing stream: replay graphs from eager streams".into(),
            });
        }
        drain_retired();
        self.settle_lost_completion()?;
        let mut res = self.lock();
        // Order this replay after the last one of this graph and of every graph of its pool
        // when they ran on another stream (a lock and a comparison on the same stream).
        let _graph_use = self.order.enter(stream)?;
        // Usually one pool: no allocation for it (embedded child graphs' pools go in a list).
        let (first, rest) = match self.pools.split_first() {
            Some((p, rest)) => (Some(p.order().enter(stream)?), rest),
            None => (None, &[][..]),
        };
        let _pool_uses = (
            first,
            rest.iter()
                .map(|p| p.order().enter(stream))
                .collect::<Result<Vec<_>>>()?,
        );
        for r in &res.checks {
            self.device.watch_check(stream, r);
        }
        if res.order_after_done {
            // The executable graph was replaced since the last replay: order this launch after
            // it, so that `done` recorded below also covers the old graph's launches.
            stream.wait_event(&self.done)?;
        }
        // Before the launch, so that no path after it can leave the graph released unwaited.
        self.replayed.store(true, Ordering::Release);
        // SAFETY: the graph holds every buffer, module, host callback and pool it uses, and
        // releases none of them before `done` (recorded right after, under the same lock) has
        // completed — or, if recording fails, before the device has been waited for.
        unsafe { res.exec.exec.launch(stream.raw_handle()) }?;
        res.order_after_done = false;
        if let Err(e) = stream.record(&self.done) {
            // The launch is enqueued and `done` does not cover it: wait for the device now, or
            // leave that to the next replay, rebind or drop (which never release unwaited).
            self.completion_lost.store(true, Ordering::Release);
            drop(res);
            let _ = self.settle_lost_completion();
            return Err(e);
        }
        drop(res);
        self.replays.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Uploads the executable graph to the device ahead of its first replay.
    #[track_caller]
    pub fn upload(&self, stream: &Stream) -> Result<()> {
        self.device.context().bind()?;
        self.lock().exec.exec.upload(stream.handle.raw())
    }

    /// Waits until the last replay has finished.
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        self.settle_lost_completion()?;
        if self.replayed.load(Ordering::Acquire) {
            self.done.synchronize()?;
        }
        Ok(())
    }

    pub fn info(&self) -> &GraphInfo {
        &self.info
    }

    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.info.nodes.total()
    }

    /// Times this graph was replayed.
    pub fn replays(&self) -> u64 {
        self.replays.load(Ordering::Relaxed)
    }

    /// The pool this graph's memory lives in (`None` for hand-built graphs).
    pub fn pool(&self) -> Option<&Pool> {
        self.pool.as_ref()
    }

    /// Bytes this graph accounts for: its peak working set in its pool plus the external
    /// buffers it keeps alive.
    pub fn bytes_held(&self) -> usize {
        self.info.memory.peak_allocated + self.info.memory.external_held
    }

    /// Buffers from outside its pool that the graph currently keeps alive.
    pub fn held_buffers(&self) -> usize {
        self.lock().held.len()
    }

    /// Bytes of the blocks of its own pool that the graph owns: those still allocated when its
    /// capture ended (outputs, anything it writes). They are not handed out again, even after
    /// the caller drops every handle to them, until the graph is dropped.
    pub fn owned_bytes(&self) -> usize {
        self.lock().owned.iter().map(|b| b.size()).sum()
    }

    /// Writes the graph in Graphviz DOT (with node parameters) to `path`.
    #[track_caller]
    pub fn write_dot(&self, path: &Path) -> Result<()> {
        self.lock().exec.graph.dot_print(path)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }
}

/// One pair of [`Graph::rebind_all`], reduced to what its checks need: lengths in elements,
/// blocks as (address, bytes).
#[derive(Clone, Copy, Debug)]
struct RebindPair {
    old_len: usize,
    new_len: usize,
    old_block: (u64, usize),
    new_block: (u64, usize),
    old_in_own_pool: bool,
}

/// Checks the pairs of a rebind and returns the address remapping: each `old` block, whole,
/// onto the start of its `new` block (which must be at least as large: every byte of the old
/// block may be reached by the graph, through any view of it or an interior pointer).
fn plan_remaps(pairs: &[RebindPair]) -> Result<Vec<Remap>> {
    let mut remaps: Vec<Remap> = Vec::with_capacity(pairs.len());
    for p in pairs {
        if p.new_len < p.old_len {
            return Err(Error::SizeMismatch {
                what: "rebind buffer length (the new buffer needs at least the old one's elements)",
                expected: p.old_len,
                got: p.new_len,
            });
        }
        if p.old_in_own_pool {
            return Err(Error::NotSupported {
                what: "rebinding a buffer of the graph's own pool",
                detail: "the graph's temporaries reuse the addresses of its pool, so an address there may stand for several buffers inside the graph; nothing was changed. Rebind buffers allocated outside the capture (inputs, weights, outputs allocated beforehand), or re-capture".into(),
            });
        }
        let ((old, old_bytes), (new, new_bytes)) = (p.old_block, p.new_block);
        if new_bytes < old_bytes {
            return Err(Error::SizeMismatch {
                what: "rebind: bytes of the new buffer's block, which must be at least those of the old buffer's whole block (the graph may reach any of them, whichever view of the block was passed); allocate the new buffer at least that large",
                expected: old_bytes,
                got: new_bytes,
            });
        }
        let r = Remap {
            old,
            len: old_bytes as u64,
            new,
        };
        let end = |r: &Remap| r.old.saturating_add(r.len);
        if let Some(o) = remaps.iter().find(|o| r.old < end(o) && o.old < end(&r)) {
            return Err(Error::InvalidGraph {
                problem: format!(
                    "rebind lists the block at {:#x} twice as `old` (it overlaps the block at {:#x}); list each buffer once",
                    r.old, o.old
                ),
            });
        }
        if r.len > 0 {
            remaps.push(r);
        }
    }
    Ok(remaps)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn pair(old: (u64, usize, usize), new: (u64, usize, usize)) -> RebindPair {
        RebindPair {
            old_len: old.2,
            new_len: new.2,
            old_block: (old.0, old.1),
            new_block: (new.0, new.1),
            old_in_own_pool: false,
        }
    }

    #[test]
    fn a_rebind_remaps_the_whole_block_of_old() {
        // `old` is a one-element view (prefix) of a 4 MiB block: the remap still covers the
        // whole block, so a memset or an interior pointer anywhere in it moves with it.
        let r = plan_remaps(&[pair((0x1000_0000, 4 * MIB, 1), (0x9000_0000, 4 * MIB, 1))]).unwrap();
        assert_eq!(
            r,
            vec![Remap {
                old: 0x1000_0000,
                len: 4 * MIB as u64,
                new: 0x9000_0000
            }]
        );
        // A larger replacement (longer buffer, larger block) is fine.
        assert!(plan_remaps(&[pair((0x1000, 512, 100), (0x9000, 4096, 1000))]).is_ok());
    }

    #[test]
    fn a_replacement_smaller_than_the_old_block_is_refused() {
        // The audit's case: x.prefix(1) of 2^20 f32 rebound onto a one-element buffer would
        // have turned the 4 MiB memset into a write past the end of the small block.
        let e = plan_remaps(&[pair((0x1000_0000, 4 * MIB, 1), (0x9000_0000, 512, 1))]).unwrap_err();
        match &e {
            Error::SizeMismatch {
                what,
                expected,
                got,
            } => {
                assert!(what.contains("block"), "{e}");
                assert_eq!((*expected, *got), (4 * MIB, 512));
            }
            other => panic!("{other}"),
        }
        // Fewer elements than `old` is refused too (as before).
        let e = plan_remaps(&[pair((0x1000, 4096, 1000), (0x9000, 4096, 999))]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::SizeMismatch {
                    expected: 1000,
                    got: 999,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn own_pool_and_repeated_blocks_are_refused() {
        let mut p = pair((0x1000, 4096, 10), (0x9000, 4096, 10));
        p.old_in_own_pool = true;
        let e = plan_remaps(&[p]).unwrap_err();
        assert!(matches!(e, Error::NotSupported { .. }), "{e}");
        assert!(e.to_string().contains("own pool"), "{e}");
        // The same block twice (two views of it) as `old`.
        let e = plan_remaps(&[
            pair((0x1000, 4096, 10), (0x9000, 4096, 10)),
            pair((0x1000, 4096, 1), (0xa000, 4096, 1)),
        ])
        .unwrap_err();
        assert!(matches!(e, Error::InvalidGraph { .. }), "{e}");
        // Disjoint blocks, including a swap of two buffers, are fine.
        let r = plan_remaps(&[
            pair((0x1000, 4096, 10), (0x2000, 4096, 10)),
            pair((0x2000, 4096, 10), (0x1000, 4096, 10)),
        ])
        .unwrap();
        assert_eq!(r.len(), 2);
        // An empty block covers no address.
        assert!(plan_remaps(&[pair((0x1000, 0, 0), (0x2000, 0, 0))])
            .unwrap()
            .is_empty());
    }
}
