//! [`Graph`]: an instantiated CUDA graph and its replay — one launch ordered after the last
//! replay of the graph and of every graph of the pools it uses, a completion event recorded
//! after it, and everything the graph holds released only once that event has completed. Also
//! what a graph reports about itself ([`GraphInfo`], [`NodeCounts`], [`GraphMemory`]).
//! Capture is in `capture.rs`, rebind in `rebind.rs`, hand-built graphs in `builder.rs`.

use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::keep::Keep;
use super::retire::{drain_retired, retire};
use crate::device::{Anchor, CheckRecord, Device, Stream};
use crate::error::{Error, Result};
use crate::memory::order::LastUse;
use crate::memory::{BlockRef, Pool, PoolId, PoolPin};
use crate::runtime::graph::{self as raw, CondRecord, ExecHandle, GraphHandle};
use crate::runtime::{capturing_on_this_thread, Event, StreamRef};

/// Counts of graph nodes by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeCounts {
    /// Kernel nodes.
    pub kernel: usize,
    /// Copy nodes.
    pub memcpy: usize,
    /// Memset nodes.
    pub memset: usize,
    /// Host-function nodes.
    pub host: usize,
    /// Child-graph nodes.
    pub child_graph: usize,
    /// Empty nodes (joins).
    pub empty: usize,
    /// Conditional (IF / WHILE) nodes; their bodies are counted in
    /// [`GraphInfo::conditionals`].
    pub conditional: usize,
    /// Nodes of any other kind (events, memory operations, …).
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

    /// Nodes of every kind together.
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
    /// Nodes of the top-level graph, by kind.
    pub nodes: NodeCounts,
    /// How long the capture took (zero for hand-built graphs).
    pub capture_time: Duration,
    /// How long instantiation took.
    pub instantiate_time: Duration,
    /// Memory the graph accounts for.
    pub memory: GraphMemory,
    /// Conditional nodes at every depth, by kind, and the nodes inside their bodies.
    pub conditionals: ConditionalCounts,
    /// Programmatic (PDL) dependency edges, in the graph and in conditional bodies.
    pub programmatic_edges: usize,
}

/// Conditional nodes of a graph (at any depth) and what their bodies hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConditionalCounts {
    /// IF nodes.
    pub if_nodes: usize,
    /// WHILE nodes.
    pub while_nodes: usize,
    /// Nodes inside conditional bodies, nested bodies included (the conditional nodes of
    /// nested conditionals among them).
    pub body_nodes: NodeCounts,
}

/// The driver objects of a graph; every call on them goes through this mutex.
pub(super) struct Exec {
    pub(super) graph: GraphHandle,
    pub(super) exec: ExecHandle,
}

/// Everything a graph releases when it goes, in one value so it can be handed to the
/// deferred-release list whole.
pub(super) struct Resources {
    pub(super) exec: Exec,
    /// Blocks of the graph's pool alive at the end of its capture (see [`Keep::owned`]).
    pub(super) owned: Vec<Arc<BlockRef>>,
    /// The records the graph's kernels report failed checks into.
    pub(super) checks: Vec<Arc<CheckRecord>>,
    /// Conditional nodes and their bodies (owned by `exec.graph`).
    pub(super) conds: Vec<CondRecord>,
    pub(super) held: Vec<Arc<BlockRef>>,
    pub(super) anchors: Vec<Anchor>,
    /// Set when rebind replaced the executable graph after a replay: the driver orders launches
    /// of one executable graph, not of two, so the next replay first waits for `done` (see
    /// [`Graph::replay_on`]).
    pub(super) order_after_done: bool,
    /// Keeps the pool's segments mapped while the graph exists.
    pub(super) _pin: Option<PoolPin>,
}

/// A captured (or built) and instantiated CUDA graph.
pub struct Graph {
    pub(super) res: Option<Mutex<Resources>>,
    /// Recorded after every replay: completes once the last replay (and every earlier one:
    /// launches of one executable graph are ordered by the driver, and the first replay after
    /// a re-instantiation waits for this event before it launches) has finished. Releases
    /// deferred with it stay safe when a later replay records it again.
    pub(super) done: Event,
    /// Set before the first launch: from then on, releasing resources waits for `done`.
    pub(super) replayed: AtomicBool,
    /// Set when a launch may not be covered by `done` (recording it failed after the launch
    /// and the device could not be waited for then): resources are released only after a
    /// device-wide synchronisation, or never.
    pub(super) completion_lost: AtomicBool,
    /// The stream of the last replay: a replay on another stream waits for it.
    pub(super) order: LastUse,
    /// Every pool whose memory replays use (its own and embedded child graphs'), in a fixed
    /// order: a replay is ordered after the last replay of every graph of each.
    pub(super) pools: Vec<Pool>,
    pub(super) device: Device,
    pub(super) pool: Option<Pool>,
    pub(super) info: GraphInfo,
    pub(super) replays: AtomicU64,
    pub(super) rebinds: u64,
    pub(super) reinstantiations: u64,
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

/// The pools a graph's replays use — its own first, then embedded child graphs' — each once,
/// sorted so that every graph enters their orders in the same sequence (no lock cycle).
pub(super) fn replay_pools(own: Option<&Pool>, mut others: Vec<Pool>) -> Vec<Pool> {
    others.extend(own.cloned());
    let key = |p: &Pool| (Arc::as_ptr(p.allocator()) as usize, p.id());
    others.sort_by_key(key);
    others.dedup_by_key(|p| key(p));
    others
}

impl Graph {
    /// Instantiates a raw graph this value will own.
    pub(super) fn instantiate(
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

    pub(super) fn lock(&self) -> MutexGuard<'_, Resources> {
        self.res
            .as_ref()
            .expect("resources live until drop")
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// After a replay whose completion could not be recorded (see `completion_lost`): waits
    /// for the whole device, after which `done` covers every replay again. Fails where that
    /// wait is impossible (a capturing thread, a lost context).
    #[track_caller]
    pub(super) fn settle_lost_completion(&self) -> Result<()> {
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
    /// [`Queue::stream_handle`](crate::Queue::stream_handle) rather than a [`Stream`]). Refuses a capturing stream.
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

    /// Facts about this graph: nodes, capture and instantiation times, memory.
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

    /// The device the graph runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }
}
