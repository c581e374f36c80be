//! Capture and replay: [`Graph::capture`] records work issued on a [`CaptureStream`] into a
//! CUDA graph, [`Graph::replay`] runs it with one launch, [`StaticGraph`] adds static inputs and
//! outputs (copy in, replay, read out) and [`warmup`] runs work on a side stream first.
//!
//! Safety by construction:
//! - the capture closure only gets a [`CaptureStream`], which has no synchronising or
//!   device-to-host method (the stream itself is borrowed mutably for the whole capture);
//! - every allocation inside the closure comes from the graph's pool;
//! - a graph holds its pool and every buffer from outside the capture that it uses, so dropping
//!   user handles can never leave a dangling address in a graph;
//! - a capture that fails for any reason (the closure's error, a panic, or the driver
//!   invalidating it) is ended and discarded: the stream and the pool are usable afterwards.

mod builder;
pub mod cache;
pub mod planner;
mod static_io;

use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;
use std::panic::Location;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use builder::{GraphBuilder, NodeId};

pub use cache::{
    bucket_for, BatchModel, BucketPolicy, CacheOptions, CacheStats, EntryInfo, GraphCache, Served,
};
pub use planner::{plan_capture_sizes, CapturePlan, GraphCost, SizeHistogram};
pub use static_io::{Outputs, StaticGraph};

use crate::device::{Device, Queue, Stream};
use crate::error::{Error, Result};
use crate::memory::{BlockRef, DeviceBuffer, Elem, Pool, PoolId, PoolPin, WindowStats};
use crate::runtime::driver::{self, PinnedAlloc, RawGraph, RawGraphExec, RawStream};
use crate::runtime::StreamHandle;

/// How strictly the driver polices other CUDA calls while a capture is open.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CaptureMode {
    /// Any potentially unsafe call (synchronisation, cuMemAlloc, legacy-stream work) from any
    /// thread invalidates the capture. The safest choice, and PyTorch's default.
    #[default]
    Global,
    /// Only unsafe calls from the capturing thread invalidate it.
    ThreadLocal,
    /// No call is policed; you are responsible for not synchronising on captured work.
    Relaxed,
}

impl CaptureMode {
    fn raw(self) -> u32 {
        match self {
            CaptureMode::Global => 0,
            CaptureMode::ThreadLocal => 1,
            CaptureMode::Relaxed => 2,
        }
    }
}

/// Options for [`Graph::capture`].
#[derive(Clone, Debug, Default)]
pub struct CaptureOptions {
    pool: Option<Pool>,
    mode: CaptureMode,
    upload: bool,
}

impl CaptureOptions {
    /// A private pool, global mode, no upload.
    pub fn new() -> Self {
        Self::default()
    }

    /// Capture into a shared pool (see the pool contract on [`Pool`]).
    pub fn pool(mut self, pool: &Pool) -> Self {
        self.pool = Some(pool.clone());
        self
    }

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

/// The stream handed to a capture closure. It implements [`Queue`] (allocate, launch, copy,
/// fill) and nothing else: no synchronisation and no device-to-host reads, so those mistakes
/// do not compile.
pub struct CaptureStream<'s> {
    stream: &'s Stream,
    pool: Pool,
    id: u64,
    held: RefCell<Vec<Arc<BlockRef>>>,
    held_addrs: RefCell<HashSet<u64>>,
    pub(super) pinned: RefCell<Vec<Arc<PinnedAlloc>>>,
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

    /// This capture's id (blocks allocated in it carry it).
    pub fn capture_id(&self) -> u64 {
        self.id
    }

    pub(super) fn raw(&self) -> RawStream {
        self.stream.handle.raw
    }
}

impl Queue for CaptureStream<'_> {
    fn device(&self) -> &Device {
        self.stream.device()
    }

    fn stream_handle(&self) -> &StreamHandle {
        &self.stream.handle
    }

    #[track_caller]
    fn alloc<T: Elem>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let block = self.pool.allocator().allocate_block(
            len * std::mem::size_of::<T>(),
            self.pool.id(),
            0,
            self.id,
        )?;
        Ok(DeviceBuffer::from_block(block, len))
    }

    fn hold(&self, block: &Arc<BlockRef>) {
        // Blocks of this capture's own pool live as long as the pool, which the graph holds;
        // anything else (weights, static inputs in the default pool) is kept by the graph.
        if block.is_in(&self.pool) {
            return;
        }
        if self.held_addrs.borrow_mut().insert(block.addr()) {
            self.held.borrow_mut().push(block.clone());
        }
    }

    fn capture_id(&self) -> Option<u64> {
        Some(self.id)
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
}

/// A captured (or built) and instantiated CUDA graph.
pub struct Graph {
    exec: RawGraphExec,
    graph: RawGraph,
    device: Device,
    _pin: Option<PoolPin>,
    _held: Vec<Arc<BlockRef>>,
    _pinned: Vec<Arc<PinnedAlloc>>,
    /// Host callbacks and pool pins of hand-built graphs (host nodes, child graphs).
    _extra: Vec<Anchor>,
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

impl Drop for Graph {
    fn drop(&mut self) {
        if self.device.context().bind().is_ok() {
            driver::graph_exec_destroy(self.exec);
            driver::graph_destroy(self.graph);
        }
    }
}

/// Anything a graph keeps alive besides buffers (host callbacks, pool pins).
pub(crate) type Anchor = Arc<dyn std::any::Any + Send + Sync>;

/// What a graph keeps alive, handed to a parent graph that embeds it.
pub(crate) struct KeepAlive {
    pub(crate) held: Vec<Arc<BlockRef>>,
    pub(crate) pinned: Vec<Arc<PinnedAlloc>>,
    pub(crate) extra: Vec<Anchor>,
    pub(crate) pool: Option<Pool>,
}

/// Ends a capture that is still open when it goes out of scope (error or panic in the closure).
struct OpenCapture {
    raw: RawStream,
    pool: Pool,
    open: bool,
    window: Option<WindowStats>,
}

impl OpenCapture {
    fn end(&mut self) -> Result<RawGraph> {
        self.open = false;
        let ended = driver::stream_end_capture(self.raw);
        self.window = Some(self.pool.allocator().close_window(self.pool.id()));
        ended
    }
}

impl Drop for OpenCapture {
    fn drop(&mut self) {
        if self.open {
            if let Ok(g) = self.end() {
                driver::graph_destroy(g);
            }
        }
    }
}

impl Graph {
    /// Captures the work `f` issues on the capture stream into a new graph, and instantiates it.
    ///
    /// `stream` is borrowed mutably for the whole capture, so it cannot be synchronised or read
    /// from inside `f`. Returns the graph and whatever `f` returned (typically output buffers,
    /// which live in the graph's pool). On any failure the capture is discarded and the stream
    /// and pool stay usable; the error names this call site and, inside it, the failing call.
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
    ///     cs.launch(&k, LaunchConfig::for_elements(1024, 256), args![&x, 1024i32])
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
        let raw = stream.handle.raw;
        let mut open = OpenCapture {
            raw,
            pool: pool.clone(),
            open: false,
            window: None,
        };
        let t0 = Instant::now();
        if let Err(e) = driver::stream_begin_capture(raw, opts.mode.raw()) {
            pool.allocator().close_window(pool.id());
            return Err(wrap(e));
        }
        open.open = true;
        let cs = CaptureStream {
            stream,
            pool: pool.clone(),
            id: CAPTURE_IDS.fetch_add(1, Ordering::Relaxed),
            held: RefCell::new(Vec::new()),
            held_addrs: RefCell::new(HashSet::new()),
            pinned: RefCell::new(Vec::new()),
        };
        let result = f(&cs);
        let ended = open.end();
        let raw_graph = match (result, ended) {
            (Err(e), Ok(g)) => {
                driver::graph_destroy(g);
                return Err(wrap(e));
            }
            (Err(e), Err(_)) => return Err(wrap(e)),
            (Ok(_), Err(e)) => {
                return Err(Error::CaptureInvalidated {
                    at,
                    detail: e.to_string(),
                })
            }
            (Ok(t), Ok(g)) => (t, g),
        };
        let (value, g) = raw_graph;
        let capture_time = t0.elapsed();
        let window = open.window.take().unwrap_or_default();
        let held = cs.held.into_inner();
        let pinned = cs.pinned.into_inner();
        let external_held = held.iter().map(|b| b.size()).sum();
        let memory = GraphMemory {
            pool: pool.id(),
            peak_allocated: window.peak_allocated,
            live_at_end: window.live_at_end,
            reserved_growth: pool.stats().reserved.saturating_sub(reserved_before),
            external_held,
        };
        let graph = Self::instantiate(
            &device,
            g,
            Some(pool.pin()),
            held,
            pinned,
            capture_time,
            memory,
        )?;
        if opts.upload {
            graph.upload(stream)?;
        }
        Ok((graph, value))
    }

    /// Instantiates a raw graph this value will own (and destroy).
    pub(crate) fn instantiate(
        device: &Device,
        g: RawGraph,
        pin: Option<PoolPin>,
        held: Vec<Arc<BlockRef>>,
        pinned: Vec<Arc<PinnedAlloc>>,
        capture_time: Duration,
        memory: GraphMemory,
    ) -> Result<Self> {
        let t1 = Instant::now();
        let types = match driver::graph_node_types(g) {
            Ok(t) => t,
            Err(e) => {
                driver::graph_destroy(g);
                return Err(e);
            }
        };
        let exec = match driver::graph_instantiate(g) {
            Ok(e) => e,
            Err(e) => {
                driver::graph_destroy(g);
                return Err(e);
            }
        };
        Ok(Graph {
            exec,
            graph: g,
            device: device.clone(),
            _pin: pin,
            _held: held,
            _pinned: pinned,
            _extra: Vec::new(),
            info: GraphInfo {
                nodes: NodeCounts::from_types(&types),
                capture_time,
                instantiate_time: t1.elapsed(),
                memory,
            },
            replays: AtomicU64::new(0),
            rebinds: 0,
            reinstantiations: 0,
        })
    }

    /// Makes the graph use `new` wherever it used `old` (same length): kernel arguments, copy
    /// and memset nodes are rewritten and the executable graph is updated in place, without a
    /// capture or a copy into a static buffer. When the driver refuses the update, the graph
    /// is re-instantiated instead (reported in the outcome and counted). The graph keeps `new`
    /// alive from now on.
    ///
    /// Rebinding is for buffers the graph reads or writes as a whole (inputs, outputs,
    /// weights). Pointers the graph computed from `old` at capture time but did not receive as
    /// arguments cannot be seen and are not rewritten.
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
        let mut remaps = Vec::with_capacity(pairs.len());
        for (old, new) in pairs {
            if old.len() != new.len() {
                return Err(Error::SizeMismatch {
                    what: "rebind buffer length",
                    expected: old.len(),
                    got: new.len(),
                });
            }
            crate::device::check_device(&self.device, new.block())?;
            remaps.push(driver::Remap {
                old: old.addr(),
                len: old.bytes().max(1) as u64,
                new: new.addr(),
            });
        }
        self.device.context().bind()?;
        let ctx = self.device.context().handle.raw;
        let r = driver::graph_rebind(self.graph, self.exec, ctx, &remaps)?;
        for (_, new) in pairs {
            if !self._held.iter().any(|b| b.addr() == new.addr()) {
                self._held.push(new.block().clone());
            }
        }
        self.rebinds += 1;
        if r.exec_updated {
            return Ok(RebindOutcome::Updated {
                nodes: r.nodes_changed,
            });
        }
        let exec = driver::graph_instantiate(self.graph)?;
        driver::graph_exec_destroy(self.exec);
        self.exec = exec;
        self.reinstantiations += 1;
        Ok(RebindOutcome::Reinstantiated {
            nodes: r.nodes_changed,
        })
    }

    /// Keeps `thing` alive as long as this graph (host callbacks, child graphs' pools).
    pub(crate) fn keep(&mut self, thing: Anchor) {
        self._extra.push(thing);
    }

    /// Everything this graph keeps alive, for a parent graph that embeds it as a child.
    pub(crate) fn keepalive(&self) -> KeepAlive {
        KeepAlive {
            held: self._held.clone(),
            pinned: self._pinned.clone(),
            extra: self._extra.clone(),
            pool: self._pin.as_ref().map(|p| p.pool().clone()),
        }
    }

    pub(crate) fn raw_graph(&self) -> RawGraph {
        self.graph
    }

    /// (rebinds, of which re-instantiations) so far.
    pub fn rebind_counts(&self) -> (u64, u64) {
        (self.rebinds, self.reinstantiations)
    }

    /// Launches the whole graph on `stream` (one driver call).
    #[track_caller]
    pub fn replay(&self, stream: &Stream) -> Result<()> {
        if stream.device().ordinal() != self.device.ordinal() {
            return Err(Error::WrongDevice {
                what: "graph",
                expected: stream.device().ordinal(),
                got: self.device.ordinal(),
            });
        }
        self.device.context().bind()?;
        driver::graph_launch(self.exec, stream.handle.raw)?;
        self.replays.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// [`Self::replay`] on a bare stream handle (for layers that hold a
    /// [`Queue::stream_handle`] rather than a [`Stream`]). Refuses a capturing stream.
    #[track_caller]
    pub fn replay_on(&self, handle: &StreamHandle) -> Result<()> {
        if handle.context().ordinal() != self.device.ordinal() {
            return Err(Error::WrongDevice {
                what: "graph",
                expected: handle.context().ordinal(),
                got: self.device.ordinal(),
            });
        }
        self.device.context().bind()?;
        if driver::stream_is_capturing(handle.raw)? {
            return Err(Error::InvalidGraph {
                problem: "replay_on a capturing stream: replay graphs from eager streams".into(),
            });
        }
        driver::graph_launch(self.exec, handle.raw)?;
        self.replays.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Uploads the executable graph to the device ahead of its first replay.
    #[track_caller]
    pub fn upload(&self, stream: &Stream) -> Result<()> {
        self.device.context().bind()?;
        driver::graph_upload(self.exec, stream.handle.raw)
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
        self._pin.as_ref().map(|p| p.pool())
    }

    /// Bytes this graph accounts for: its peak working set in its pool plus the external
    /// buffers it keeps alive.
    pub fn bytes_held(&self) -> usize {
        self.info.memory.peak_allocated + self.info.memory.external_held
    }

    /// Writes the graph in Graphviz DOT (with node parameters) to `path`.
    #[track_caller]
    pub fn write_dot(&self, path: &Path) -> Result<()> {
        self.device.context().bind()?;
        driver::graph_dot_print(self.graph, path)
    }

    pub fn device(&self) -> &Device {
        &self.device
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
