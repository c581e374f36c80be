//! [`Keep`]: everything a graph keeps alive for as long as it can replay — buffers from outside
//! its pool, the blocks of its pool alive at the end of its capture, kernel modules, host
//! callbacks, check records and the pools of embedded child graphs. Filled by captures,
//! builders and child graphs; released with the graph (see `retire.rs`).

use std::collections::HashSet;
use std::sync::Arc;

use crate::device::{Anchor, CheckRecord};
use crate::memory::{BlockRef, Pool};
use crate::runtime::Function;

/// What a graph keeps alive.
#[derive(Default)]
pub(crate) struct Keep {
    pub(super) held: Vec<Arc<BlockRef>>,
    /// Blocks of the graph's own pool still allocated when its capture ended (outputs and
    /// anything else the graph writes): the graph's until it is dropped (see [`Pool`]).
    pub(super) owned: Vec<Arc<BlockRef>>,
    /// The check records the graph's kernels report into: its own, if a kernel asked for one,
    /// and those of embedded child graphs.
    pub(super) checks: Vec<Arc<CheckRecord>>,
    /// Pools of embedded child graphs, whose memory the graph's replays use too.
    pub(super) pools: Vec<Pool>,
    pub(super) held_set: HashSet<usize>,
    pub(super) anchors: Vec<Anchor>,
    pub(super) functions: HashSet<usize>,
    /// Blocks of the capture's own pool that a side branch used (kept as anchors, see
    /// [`SideStream`](crate::SideStream)).
    pub(super) side_pinned: HashSet<usize>,
}

impl Keep {
    pub(super) fn hold(&mut self, block: &Arc<BlockRef>) {
        if self.held_set.insert(Arc::as_ptr(block) as usize) {
            self.held.push(block.clone());
        }
    }

    pub(super) fn hold_function(&mut self, f: &Function) {
        if self.functions.insert(f.raw.0 as usize) {
            self.anchors.push(Arc::new(f.clone()));
        }
    }

    /// Takes over everything `other` keeps (a conditional body's share of the graph, an
    /// embedded child graph's).
    pub(super) fn merge(&mut self, other: Keep) {
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
    pub(super) fn pin(&mut self, block: &Arc<BlockRef>) {
        if self.side_pinned.insert(Arc::as_ptr(block) as usize) {
            self.anchors.push(block.clone());
        }
    }
}
