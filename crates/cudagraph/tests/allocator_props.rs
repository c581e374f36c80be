//! Property tests of the caching allocator over real host memory.
//!
//! (a) Random sequences of every operation (allocations of 512 B to 24 MiB in several pools and
//! on several streams, frees, frees behind fences, fences completing, pools created and closed,
//! graphs added and removed, capture windows, `empty_cache`, `reset_peak`), checked after every
//! step against the allocator's invariants and a model: live blocks never overlap and keep
//! their contents, the counters match the blocks the model holds, reserved bytes match the host
//! memory actually held.
//!
//! (b) Reuse behind fences: no block is handed out again (no allocation overlaps it) while any
//! fence it was freed behind is incomplete, and once all are complete its memory is reusable.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudagraph::memory::{Allocation, AllocatorCore, Fence, HostSource, PoolId, SegmentSource};
use cudagraph::Error;
use proptest::prelude::*;
use proptest::sample::Index;

const KB: usize = 1024;
const MB: usize = 1024 * 1024;
/// Bytes of each block's head and tail that carry its pattern (whole blocks would make the
/// test slow; overlaps anywhere are caught by the model's interval check).
const MARK: usize = 4 * KB;
const FENCES: usize = 4;

/// A source shared between the test and the allocator, so the test can look at host memory.
struct Shared(Arc<HostSource>);

// SAFETY: forwards to `HostSource`, which owns each region exclusively until it is released.
unsafe impl SegmentSource for Shared {
    fn allocate(&self, bytes: usize) -> cudagraph::Result<u64> {
        self.0.allocate(bytes)
    }
    fn release(&self, addr: u64, bytes: usize) -> cudagraph::Result<()> {
        self.0.release(addr, bytes)
    }
}

/// A simulated event recorded on another stream.
#[derive(Clone, Default)]
struct SimFence(Arc<AtomicBool>);

impl Fence for SimFence {
    fn is_complete(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

impl SimFence {
    fn done(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

#[derive(Clone, Debug)]
struct Block {
    a: Allocation,
    /// Bytes requested.
    len: usize,
    tag: u8,
    stream: u64,
}

impl Block {
    fn end(&self) -> u64 {
        self.a.addr + self.a.size as u64
    }
    fn overlaps(&self, other: &Allocation) -> bool {
        self.a.addr < other.addr + other.size as u64 && other.addr < self.end()
    }
    fn marks(&self) -> [(u64, usize); 2] {
        let n = self.len.min(MARK);
        [(self.a.addr, n), (self.a.addr + (self.len - n) as u64, n)]
    }
}

#[derive(Debug)]
struct PoolModel {
    id: PoolId,
    closed: bool,
    graphs: usize,
    window: bool,
}

struct Model {
    c: AllocatorCore,
    src: Arc<HostSource>,
    pools: Vec<PoolModel>,
    live: Vec<Block>,
    pending: Vec<(Block, Vec<SimFence>)>,
    /// The current fence of each slot; completing a slot starts a fresh one.
    slots: Vec<SimFence>,
    tags: u8,
}

impl Model {
    fn new() -> Self {
        let src = Arc::new(HostSource::new());
        Model {
            c: AllocatorCore::new(Box::new(Shared(src.clone()))),
            src,
            pools: vec![PoolModel {
                id: PoolId::DEFAULT,
                closed: false,
                graphs: 0,
                window: false,
            }],
            live: Vec::new(),
            pending: Vec::new(),
            slots: (0..FENCES).map(|_| SimFence::default()).collect(),
            tags: 0,
        }
    }

    fn next_tag(&mut self) -> u8 {
        self.tags = self.tags % 254 + 1;
        self.tags
    }

    /// Checks a block's pattern (it must not have been handed out again).
    fn verify(&self, b: &Block) -> Result<(), TestCaseError> {
        for (addr, n) in b.marks() {
            prop_assert!(
                self.src.verify(addr, n, b.tag).unwrap(),
                "block {:#x} ({} B) was overwritten",
                b.a.addr,
                b.a.size
            );
        }
        Ok(())
    }

    /// What the allocator does at every poll: blocks whose fences all completed are freed.
    /// Called just before each operation that polls, so their contents are checked while the
    /// memory is certainly still held.
    fn poll(&mut self) -> Result<(), TestCaseError> {
        let (ready, still): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|(_, fences)| fences.iter().all(SimFence::done));
        self.pending = still;
        for (b, _) in &ready {
            self.verify(b)?;
        }
        Ok(())
    }

    /// Allocates and checks the new block against every block still held.
    fn alloc(
        &mut self,
        size: usize,
        pool: PoolId,
        stream: u64,
    ) -> Result<Option<Block>, TestCaseError> {
        self.poll()?;
        let bounded = self.c.limit(pool).is_some();
        match self.c.allocate(size, pool, stream) {
            Ok(a) => {
                prop_assert!(a.size >= size && a.size % 512 == 0);
                prop_assert_eq!(a.pool, pool);
                for b in self.live.iter().chain(self.pending.iter().map(|(b, _)| b)) {
                    prop_assert!(!b.overlaps(&a), "{a:?} overlaps a block still held: {b:?}");
                }
                let b = Block {
                    a,
                    len: size,
                    tag: self.next_tag(),
                    stream,
                };
                for (addr, n) in b.marks() {
                    self.src.fill(addr, n, b.tag).unwrap();
                }
                Ok(Some(b))
            }
            Err(Error::PoolLimitExceeded { .. }) if bounded => Ok(None),
            Err(e) => Err(TestCaseError::fail(format!("allocation failed: {e}"))),
        }
    }

    fn check(&self) -> Result<(), TestCaseError> {
        self.c
            .check_invariants()
            .map_err(|e| TestCaseError::fail(format!("invariant: {e}")))?;
        let held = || self.live.iter().chain(self.pending.iter().map(|(b, _)| b));
        let s = self.c.device_stats();
        prop_assert_eq!(s.allocated, held().map(|b| b.a.size).sum::<usize>());
        prop_assert_eq!(s.active_blocks, held().count());
        prop_assert_eq!(s.pending_blocks, self.pending.len());
        prop_assert_eq!(s.reserved, self.src.live_bytes());
        prop_assert!(s.peak_allocated >= s.allocated && s.peak_reserved >= s.reserved);
        let ids = self.c.pool_ids();
        for p in self.pools.iter().filter(|p| ids.contains(&p.id)) {
            let ps = self.c.pool_stats(p.id);
            let mine = held().filter(|b| b.a.pool == p.id);
            prop_assert_eq!(ps.allocated, mine.map(|b| b.a.size).sum::<usize>());
            if let Some(limit) = self.c.limit(p.id) {
                prop_assert!(ps.reserved <= limit, "{} over its limit", p.id);
            }
        }
        for p in self.pools.iter().filter(|p| !p.closed) {
            prop_assert!(ids.contains(&p.id), "open {} was forgotten", p.id);
        }
        Ok(())
    }

    /// Releases everything and checks that every byte went back to the host.
    fn finish(mut self) -> Result<(), TestCaseError> {
        for i in 0..self.pools.len() {
            if self.pools[i].window {
                self.c.close_window(self.pools[i].id);
            }
            for _ in 0..self.pools[i].graphs {
                self.c.remove_graph(self.pools[i].id);
            }
        }
        for f in &self.slots {
            f.0.store(true, Ordering::SeqCst);
        }
        // Every fence is complete: the next poll frees every pending block.
        self.poll()?;
        for b in std::mem::take(&mut self.live) {
            self.verify(&b)?;
            self.c.free(b.a.addr);
        }
        self.c
            .release_free_segments(None)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        self.check()?;
        let s = self.c.device_stats();
        prop_assert_eq!((s.allocated, s.reserved, s.pending_blocks), (0, 0, 0));
        prop_assert_eq!(self.src.live_bytes(), 0);
        let ids = self.c.pool_ids();
        for p in &self.pools {
            prop_assert_eq!(ids.contains(&p.id), !p.closed, "{:?}", p);
        }
        Ok(())
    }
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        size: usize,
        pool: Index,
        stream: u64,
    },
    Free(Index),
    FreeAfter(Index, Vec<usize>),
    Complete(usize),
    CreatePool(Option<usize>),
    ClosePool(Index),
    AddGraph(Index),
    RemoveGraph(Index),
    OpenWindow(Index),
    CloseWindow(Index),
    EmptyCache,
    ResetPeak,
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 1..=64 * KB,
        3 => 1..=2 * MB,
        2 => 1..=8 * MB,
        1 => 10 * MB..=24 * MB,
    ]
}

fn fences() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0..FENCES, 1..=3)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (size(), any::<Index>(), 1..4u64)
            .prop_map(|(size, pool, stream)| Op::Alloc { size, pool, stream }),
        5 => any::<Index>().prop_map(Op::Free),
        3 => (any::<Index>(), fences()).prop_map(|(i, f)| Op::FreeAfter(i, f)),
        3 => (0..FENCES).prop_map(Op::Complete),
        1 => prop::option::of(4 * MB..64 * MB).prop_map(Op::CreatePool),
        1 => any::<Index>().prop_map(Op::ClosePool),
        1 => any::<Index>().prop_map(Op::AddGraph),
        1 => any::<Index>().prop_map(Op::RemoveGraph),
        1 => any::<Index>().prop_map(Op::OpenWindow),
        1 => any::<Index>().prop_map(Op::CloseWindow),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::ResetPeak),
    ]
}

/// Indices of the model's pools satisfying `f`.
fn pick(pools: &[PoolModel], i: &Index, f: impl Fn(&PoolModel) -> bool) -> Option<usize> {
    let ok: Vec<usize> = (0..pools.len()).filter(|&j| f(&pools[j])).collect();
    (!ok.is_empty()).then(|| ok[i.index(ok.len())])
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut m = Model::new();
    for op in ops {
        match op {
            Op::Alloc { size, pool, stream } => {
                if let Some(j) = pick(&m.pools, &pool, |p| !p.closed) {
                    if let Some(b) = m.alloc(size, m.pools[j].id, stream)? {
                        m.live.push(b);
                    }
                }
            }
            Op::Free(i) if !m.live.is_empty() => {
                let b = m.live.swap_remove(i.index(m.live.len()));
                m.verify(&b)?;
                m.poll()?;
                m.c.free(b.a.addr);
            }
            Op::FreeAfter(i, ks) if !m.live.is_empty() => {
                let b = m.live.swap_remove(i.index(m.live.len()));
                m.verify(&b)?;
                let fences: Vec<SimFence> = ks.iter().map(|&k| m.slots[k].clone()).collect();
                let boxed = fences
                    .iter()
                    .map(|f| Box::new(f.clone()) as Box<dyn Fence>)
                    .collect();
                m.poll()?;
                m.c.free_after(b.a.addr, boxed);
                m.pending.push((b, fences));
            }
            Op::Complete(k) => {
                m.slots[k].0.store(true, Ordering::SeqCst);
                m.slots[k] = SimFence::default();
            }
            Op::CreatePool(limit) if m.pools.len() < 8 => {
                let id = m.c.create_pool(limit);
                m.pools.push(PoolModel {
                    id,
                    closed: false,
                    graphs: 0,
                    window: false,
                });
            }
            Op::ClosePool(i) => {
                let open = |p: &PoolModel| p.id != PoolId::DEFAULT && !p.closed && !p.window;
                if let Some(j) = pick(&m.pools, &i, open) {
                    m.c.close_pool(m.pools[j].id);
                    m.pools[j].closed = true;
                }
            }
            Op::AddGraph(i) => {
                let open = |p: &PoolModel| p.id != PoolId::DEFAULT && !p.closed;
                if let Some(j) = pick(&m.pools, &i, open) {
                    m.c.add_graph(m.pools[j].id);
                    m.pools[j].graphs += 1;
                }
            }
            Op::RemoveGraph(i) => {
                if let Some(j) = pick(&m.pools, &i, |p| p.graphs > 0) {
                    m.c.remove_graph(m.pools[j].id);
                    m.pools[j].graphs -= 1;
                }
            }
            Op::OpenWindow(i) => {
                if let Some(j) = pick(&m.pools, &i, |p| !p.closed) {
                    let opened = m.c.open_window(m.pools[j].id);
                    prop_assert_eq!(opened, !m.pools[j].window, "one window per pool");
                    m.pools[j].window = true;
                }
            }
            Op::CloseWindow(i) => {
                if let Some(j) = pick(&m.pools, &i, |p| p.window) {
                    m.c.close_window(m.pools[j].id);
                    m.pools[j].window = false;
                }
            }
            Op::EmptyCache => {
                let before = m.c.device_stats().reserved;
                m.poll()?;
                let released =
                    m.c.release_free_segments(None)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(before - m.c.device_stats().reserved, released);
                if m.pools.iter().any(|p| p.window) {
                    prop_assert_eq!(released, 0, "released during a capture window");
                }
            }
            Op::ResetPeak => {
                m.c.reset_peak();
                let s = m.c.device_stats();
                prop_assert_eq!(
                    (s.peak_allocated, s.peak_reserved),
                    (s.allocated, s.reserved)
                );
            }
            _ => {}
        }
        m.check()?;
    }
    m.finish()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_every_invariant(ops in prop::collection::vec(op(), 1..60)) {
        run(ops)?;
    }
}

// ----- (b) reuse behind fences -----------------------------------------------------------------

#[derive(Clone, Debug)]
enum FenceOp {
    Alloc { size: usize, stream: u64 },
    FreeAfter(Index, Vec<usize>),
    Free(Index),
    Complete(usize),
    EmptyCache,
}

fn fence_op() -> impl Strategy<Value = FenceOp> {
    prop_oneof![
        6 => (prop_oneof![3 => 1..=64 * KB, 1 => 1..=3 * MB], 1..3u64)
            .prop_map(|(size, stream)| FenceOp::Alloc { size, stream }),
        4 => (any::<Index>(), fences()).prop_map(|(i, f)| FenceOp::FreeAfter(i, f)),
        1 => any::<Index>().prop_map(FenceOp::Free),
        3 => (0..FENCES).prop_map(FenceOp::Complete),
        1 => Just(FenceOp::EmptyCache),
    ]
}

fn run_fences(ops: Vec<FenceOp>) -> Result<(), TestCaseError> {
    let mut m = Model::new();
    for op in ops {
        match op {
            FenceOp::Alloc { size, stream } => {
                // Blocks behind an incomplete fence right now: the new block must miss them.
                let blocked: Vec<Block> = m
                    .pending
                    .iter()
                    .filter(|(_, f)| !f.iter().all(SimFence::done))
                    .map(|(b, _)| b.clone())
                    .collect();
                if let Some(b) = m.alloc(size, PoolId::DEFAULT, stream)? {
                    for p in &blocked {
                        prop_assert!(!p.overlaps(&b.a), "{:?} reissued behind a fence", p.a);
                    }
                    m.live.push(b);
                }
            }
            FenceOp::FreeAfter(i, ks) if !m.live.is_empty() => {
                let b = m.live.swap_remove(i.index(m.live.len()));
                let fences: Vec<SimFence> = ks.iter().map(|&k| m.slots[k].clone()).collect();
                let boxed = fences
                    .iter()
                    .map(|f| Box::new(f.clone()) as Box<dyn Fence>)
                    .collect();
                m.poll()?;
                m.c.free_after(b.a.addr, boxed);
                m.pending.push((b, fences));
            }
            FenceOp::Free(i) if !m.live.is_empty() => {
                let b = m.live.swap_remove(i.index(m.live.len()));
                m.verify(&b)?;
                m.poll()?;
                m.c.free(b.a.addr);
            }
            FenceOp::Complete(k) => {
                let fence = std::mem::take(&mut m.slots[k]);
                fence.0.store(true, Ordering::SeqCst);
                // A block whose last fence just completed is reusable: a request of its size
                // on its stream is served from the cache (no new segment), at its next poll.
                let ready = m
                    .pending
                    .iter()
                    .find(|(_, f)| f.iter().all(SimFence::done))
                    .map(|(b, _)| (b.len, b.stream));
                if let Some((len, stream)) = ready {
                    let segments = m.c.device_stats().segment_allocations;
                    let b = m.alloc(len, PoolId::DEFAULT, stream)?;
                    prop_assert!(b.is_some());
                    prop_assert_eq!(
                        m.c.device_stats().segment_allocations,
                        segments,
                        "a freed block's memory was not reusable"
                    );
                    m.live.extend(b);
                }
            }
            FenceOp::EmptyCache => {
                m.poll()?;
                m.c.release_free_segments(None)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            _ => {}
        }
        for (b, _) in &m.pending {
            m.verify(b)?;
        }
        m.check()?;
    }
    m.finish()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn no_block_is_reissued_while_a_fence_is_incomplete(
        ops in prop::collection::vec(fence_op(), 1..80)
    ) {
        run_fences(ops)?;
    }
}
