//! [`Graph::rebind`]: making a graph use other buffers in place of the ones it captured,
//! without a capture or a copy — the checks of the pairs, the address remapping, the
//! rewrite (planned and applied one layer down, in the runtime's rebind) and letting go of
//! buffers the graph no longer refers to, once its last replay has finished.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::exec::Graph;
use super::retire::retire;
use crate::device::check_device;
use crate::error::{Error, Result};
use crate::memory::{BlockRef, DeviceBuffer, Elem};
use crate::runtime::graph::{self as raw, Remap};

/// What [`Graph::rebind`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RebindOutcome {
    /// The executable graph was updated in place (`nodes` nodes changed).
    Updated {
        /// Nodes whose parameters changed.
        nodes: usize,
    },
    /// The driver refused the in-place update; the graph was re-instantiated.
    Reinstantiated {
        /// Nodes whose parameters changed.
        nodes: usize,
    },
}

impl Graph {
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

    fn in_own_pool<T: Elem>(&self, b: &DeviceBuffer<T>) -> bool {
        self.pool.as_ref().is_some_and(|p| b.block().is_in(p))
    }

    /// (rebinds, of which re-instantiations) so far.
    pub fn rebind_counts(&self) -> (u64, u64) {
        (self.rebinds, self.reinstantiations)
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
