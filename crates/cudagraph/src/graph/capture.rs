//! Capture: [`Graph::capture`] records the work a closure issues on a [`CaptureStream`] into a
//! new graph and instantiates it, with [`CaptureOptions`] (pool, mode, upload). The capture
//! stream is a [`Queue`] that allocates from the capture's pool and keeps what the graph uses;
//! a capture that fails in any way is ended and discarded before `capture` returns.
//! Conditional bodies are recorded in `conditional.rs`, side branches in `fork.rs`.

use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;
use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use super::exec::{Graph, GraphMemory};
use super::keep::Keep;
use super::retire::drain_retired;
use crate::device::{Anchor, Arg, CheckRecord, Device, EndWork, Queue, Stream};
use crate::error::{Error, Result};
use crate::memory::{BlockRef, Pool, WindowStats};
use crate::runtime::graph::{CondRecord, GraphHandle};
use crate::runtime::{CaptureMode, Function, StreamHandle, StreamRef};

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

/// State of one capture shared by its capture stream, the streams recording its conditional
/// bodies and its side branches.
#[derive(Default)]
pub(super) struct CaptureShared {
    /// Every block allocated from the pool during the capture (those still alive at its end
    /// become the graph's).
    pub(super) allocated: RefCell<Vec<Weak<BlockRef>>>,
    /// The graph's check record, created when a kernel first asks for one.
    pub(super) check: RefCell<Option<Arc<CheckRecord>>>,
}

impl CaptureShared {
    pub(super) fn check_record(&self, device: &Device) -> Result<Arc<CheckRecord>> {
        let mut c = self.check.borrow_mut();
        if let Some(r) = c.as_ref() {
            return Ok(r.clone());
        }
        let r = device.new_check_record()?;
        *c = Some(r.clone());
        Ok(r)
    }

    /// The blocks allocated during the capture that are still alive.
    pub(super) fn live_blocks(&self) -> Vec<Arc<BlockRef>> {
        self.allocated
            .borrow()
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }
}

/// Work registered with [`Queue::at_end`] on one capture stream, in order, one per key.
#[derive(Default)]
pub(super) struct EndList(RefCell<Vec<(usize, Option<EndWork>)>>);

impl EndList {
    pub(super) fn add(&self, key: usize, work: EndWork) {
        let mut l = self.0.borrow_mut();
        if !l.iter().any(|(k, _)| *k == key) {
            l.push((key, Some(work)));
        }
    }

    /// Runs the registered work on `q`, in registration order.
    pub(super) fn run(&self, q: &dyn Queue) -> Result<()> {
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
pub(super) struct SideList(pub(super) RefCell<Vec<StreamHandle>>);

impl SideList {
    pub(super) fn contains(&self, s: &StreamHandle) -> bool {
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

/// What a stream recording a conditional body tracks: the blocks allocated inside the body,
/// and the blocks from outside it that the body used, held until the body is recorded. A loop
/// body runs again after it ends, so a block it reads must not be handed to a later
/// allocation of the same body (the allocator would otherwise reuse a block freed mid-body).
#[derive(Default)]
pub(crate) struct BodyScope {
    own: HashSet<usize>,
    hold: Vec<Arc<BlockRef>>,
    held: HashSet<usize>,
}

impl BodyScope {
    pub(crate) fn allocated(&mut self, block: &Arc<BlockRef>) {
        self.own.insert(Arc::as_ptr(block) as usize);
    }

    pub(crate) fn used(&mut self, block: &Arc<BlockRef>) {
        let key = Arc::as_ptr(block) as usize;
        if !self.own.contains(&key) && self.held.insert(key) {
            self.hold.push(block.clone());
        }
    }

    /// Takes over an inner body's blocks: its allocations are this body's too, and the blocks
    /// it held stay held while this body is recorded, unless this body allocated them.
    pub(super) fn absorb(&mut self, inner: BodyScope) {
        self.own.extend(inner.own);
        for b in inner.hold {
            self.used(&b);
        }
    }
}

/// The stream handed to a capture closure. It implements [`Queue`] (allocate, launch, copy,
/// fill) and nothing else: no synchronisation and no device-to-host reads, so those mistakes
/// do not compile.
pub struct CaptureStream<'s> {
    pub(super) stream: &'s Stream,
    pub(super) pool: Pool,
    pub(super) id: u64,
    pub(super) keep: RefCell<Keep>,
    /// Capture mode (conditional bodies are captured in the same mode).
    pub(super) mode: CaptureMode,
    /// The stream the capture began on, and how deep in conditional bodies this stream is.
    pub(super) root_stream: u64,
    pub(super) depth: usize,
    /// Set while this stream records a conditional body (see `conditional`).
    pub(super) scope: Option<RefCell<BodyScope>>,
    /// Conditional nodes recorded so far, at every depth.
    pub(super) conds: RefCell<Vec<CondRecord>>,
    /// Side streams that joined this capture (see [`Fork`](crate::Fork)).
    pub(super) sides: &'s SideList,
    /// State shared with the whole capture.
    pub(super) shared: &'s CaptureShared,
    /// Work to run on this stream right before it stops recording ([`Queue::at_end`]).
    pub(super) at_end: EndList,
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
}
