//! The in-place parameter rewrite behind `Graph::rebind`: every node of a graph is read,
//! every device address inside the rebound blocks is planned for rewriting (kernel
//! parameters, copy and memset nodes), and the plan is applied to the executable graph.
//! Graphs whose use of memory cannot be read completely are refused before anything changes.
//! Choosing what to rebind, and what to release afterwards, is one layer up.

use std::collections::BTreeSet;
use std::ffi::c_void;
use std::ptr;

use cudarc::driver::sys;

use super::handle::{ExecHandle, GraphHandle};
use super::nodes::{memcpy3d_device_blank, node_code, node_type};
use crate::error::{Error, Result};
use crate::runtime::module::{driver_params, known_param_sizes};
use crate::runtime::raw::{RawContext, RawFunction};
use crate::runtime::result::check;

/// A device-address remapping: addresses in `[old, old + len)` move to `new + (addr - old)`.
///
/// `Graph::rebind` builds one per rebound buffer over the buffer's whole block, so interior
/// pointers (an argument pointing into the middle of the block) move by the same offset; an
/// address one past the end of the block is not covered (it is the start of whatever lies
/// next in memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Remap {
    pub old: u64,
    pub len: u64,
    pub new: u64,
}

/// Where `addr` moves: the index of the remap whose old range holds it, and the new address.
fn remap_at(addr: u64, remaps: &[Remap]) -> Option<(usize, u64)> {
    remaps
        .iter()
        .position(|r| addr >= r.old && addr - r.old < r.len)
        .map(|i| (i, remaps[i].new + (addr - remaps[i].old)))
}

/// Whether `addr` lies inside any of `remaps`' old ranges.
fn remapped(addr: u64, remaps: &[Remap]) -> bool {
    remap_at(addr, remaps).is_some()
}

/// Rewrites `addr` when it lies in one of `remaps`' old ranges, noting which range in `hits`.
fn rewrite(addr: &mut u64, remaps: &[Remap], hits: &mut [bool]) -> bool {
    match remap_at(*addr, remaps) {
        Some((i, new)) => {
            *addr = new;
            hits[i] = true;
            true
        }
        None => false,
    }
}

/// Whether any address in `referenced` lies in `[addr, addr + size)`.
pub(crate) fn references_range(referenced: &BTreeSet<u64>, addr: u64, size: usize) -> bool {
    size > 0
        && referenced
            .range(addr..addr.saturating_add(size as u64))
            .next()
            .is_some()
}

enum Edit {
    Kernel {
        node: sys::CUgraphNode,
        params: sys::CUDA_KERNEL_NODE_PARAMS,
        // Owned parameter values the `kernelParams` pointers point into.
        _storage: Vec<Vec<u64>>,
        _ptrs: Vec<*mut c_void>,
    },
    Memcpy {
        node: sys::CUgraphNode,
        params: sys::CUDA_MEMCPY3D,
    },
    Memset {
        node: sys::CUgraphNode,
        params: sys::CUDA_MEMSET_NODE_PARAMS,
    },
}

/// The rewrite behind `Graph::rebind`, read from every node of a graph and not yet applied
/// (see [`plan_rebind`]).
pub(crate) struct RebindPlan<'g> {
    graph: &'g GraphHandle,
    edits: Vec<Edit>,
    /// Every 8-byte window (at every byte offset) of every kernel parameter and every address
    /// of copy and memset nodes, after the rewrite: what the graph will refer to directly.
    pub referenced: BTreeSet<u64>,
    /// Whether every kernel node runs one of our kernels (parameter list from our own PTX).
    /// Another library's kernels may also reach memory through addresses they read from
    /// device memory, which no rewrite sees: then nothing the graph holds is provably unused.
    pub all_kernels_ours: bool,
    /// The old start address of every remap through which at least one address was rewritten.
    pub moved_from: BTreeSet<u64>,
}

impl RebindPlan<'_> {
    /// Number of nodes the rewrite changes.
    pub(crate) fn nodes_changed(&self) -> usize {
        self.edits.len()
    }

    /// Applies the rewrite to the graph and to `exec` (which must have been instantiated from
    /// it). Returns whether `exec` took every edit in place; when it did not, the caller
    /// instantiates the graph again. On an error part of the edits may have been applied (to
    /// the graph and to `exec`): the caller must keep both the old and the new buffers alive.
    #[track_caller]
    pub(crate) fn apply(self, exec: &ExecHandle) -> Result<bool> {
        let ctx: RawContext = self.graph.ctx.handle.raw;
        let mut exec_updated = true;
        for e in &self.edits {
            // SAFETY: every node belongs to `self.graph`, which `exec` was instantiated from;
            // parameter structs and the storage their pointers point into are alive (owned by
            // `self.edits`).
            unsafe {
                match e {
                    Edit::Kernel { node, params, .. } => {
                        check(
                            sys::cuGraphKernelNodeSetParams_v2(*node, params),
                            "cuGraphKernelNodeSetParams",
                        )?;
                        exec_updated &=
                            sys::cuGraphExecKernelNodeSetParams_v2(exec.raw.0, *node, params)
                                == sys::CUresult::CUDA_SUCCESS;
                    }
                    Edit::Memcpy { node, params } => {
                        check(
                            sys::cuGraphMemcpyNodeSetParams(*node, params),
                            "cuGraphMemcpyNodeSetParams",
                        )?;
                        exec_updated &=
                            sys::cuGraphExecMemcpyNodeSetParams(exec.raw.0, *node, params, ctx.0)
                                == sys::CUresult::CUDA_SUCCESS;
                    }
                    Edit::Memset { node, params } => {
                        check(
                            sys::cuGraphMemsetNodeSetParams(*node, params),
                            "cuGraphMemsetNodeSetParams",
                        )?;
                        exec_updated &=
                            sys::cuGraphExecMemsetNodeSetParams(exec.raw.0, *node, params, ctx.0)
                                == sys::CUresult::CUDA_SUCCESS;
                    }
                }
            }
        }
        Ok(exec_updated)
    }
}

/// Parameter sizes of a kernel node's function and whether it is one of ours: ours are known
/// from their PTX, other libraries' from the driver where it can say. `None`: the node cannot
/// be read safely.
fn kernel_param_sizes(func: sys::CUfunction) -> Result<Option<(Vec<usize>, bool)>> {
    if let Some(s) = known_param_sizes(func) {
        return Ok(Some((s, true)));
    }
    Ok(driver_params(RawFunction(func))?.map(|v| (v.iter().map(|p| p.size).collect(), false)))
}

/// Records every 8-byte window of the first `size` bytes of `words` (a kernel parameter) in
/// `referenced`, at every byte offset.
fn note_words(words: &[u64], size: usize, referenced: &mut BTreeSet<u64>) {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let bytes = &bytes[..size.min(bytes.len())];
    for window in bytes.windows(8) {
        let mut b = [0u8; 8];
        b.copy_from_slice(window);
        referenced.insert(u64::from_ne_bytes(b));
    }
}

/// The typed refusal for a node rebind cannot account for.
fn cannot_rebind(what: &str) -> Error {
    Error::NotSupported {
        what: "rebinding this graph",
        detail: format!(
            "it holds {what}, whose use of device memory rebind can neither rewrite nor account for; nothing was changed. Copy into the graph's inputs, or capture a new graph with the new buffers"
        ),
    }
}

/// What a node type that rebind does not read is, for [`cannot_rebind`].
fn node_kind_name(t: u32) -> String {
    use node_code as N;
    match t {
        N::GRAPH => "a child-graph node".into(),
        N::CONDITIONAL => "a conditional node".into(),
        N::WAIT_EVENT => "an event-wait node".into(),
        N::EVENT_RECORD => "an event-record node".into(),
        N::EXT_SEMAS_SIGNAL | N::EXT_SEMAS_WAIT => "an external-semaphore node".into(),
        N::MEM_ALLOC => "a memory-allocation node".into(),
        N::MEM_FREE => "a memory-free node".into(),
        N::BATCH_MEM_OP => "a batched memory-operation node".into(),
        other => format!("a node of type {other}"),
    }
}

/// One endpoint of a copy node, rewritten in place when it lies in a rebound buffer and
/// recorded in `referenced`. Returns whether it changed.
fn copy_endpoint(
    kind: sys::CUmemorytype,
    device: &mut u64,
    host: u64,
    offsets: [usize; 4],
    remaps: &[Remap],
    hits: &mut [bool],
    referenced: &mut BTreeSet<u64>,
) -> Result<bool> {
    use sys::CUmemorytype as M;
    match kind {
        M::CU_MEMORYTYPE_DEVICE | M::CU_MEMORYTYPE_UNIFIED => {
            // The copy reaches memory at an offset from its base address: the base alone
            // would not say which buffer it touches.
            if offsets.iter().any(|&o| o != 0) {
                return Err(cannot_rebind(
                    "a copy node that starts at an offset from its base address",
                ));
            }
            let changed = rewrite(device, remaps, hits);
            referenced.insert(*device);
            Ok(changed)
        }
        M::CU_MEMORYTYPE_HOST => {
            // A host address cannot lie in a device buffer (one unified address space), but
            // an external block may wrap mapped host memory: count it, never rewrite it.
            if remapped(host, remaps) {
                return Err(cannot_rebind(
                    "a copy node whose host-memory endpoint lies inside a buffer being rebound",
                ));
            }
            referenced.insert(host);
            Ok(false)
        }
        _ => Err(cannot_rebind("a copy node with a CUDA array endpoint")),
    }
}

/// Reads every node of `g` and plans the rewrite of every device address covered by `remaps`
/// in kernel parameters (every 8-byte aligned word of every parameter, so pointers inside
/// struct parameters of library kernels are found too), copy and memset nodes. Changes
/// nothing: [`RebindPlan::apply`] does. Refuses (typed error) a graph holding any node whose
/// use of device memory it cannot read completely — child graphs, conditional nodes, event
/// and memory-operation nodes, copies with array endpoints, kernels whose parameter list is
/// unknown or that were launched with packed parameters.
#[track_caller]
pub(crate) fn plan_rebind<'g>(g: &'g GraphHandle, remaps: &[Remap]) -> Result<RebindPlan<'g>> {
    let nodes = g.nodes()?;
    let mut edits = Vec::new();
    let mut referenced = BTreeSet::new();
    let mut all_kernels_ours = true;
    let mut hits = vec![false; remaps.len()];
    for node in nodes {
        match node_type(node)? {
            node_code::KERNEL => {
                // SAFETY: the struct holds only pointers and integers (no enums), so all-zero
                // is a valid value; the driver fills it.
                let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
                // SAFETY: node is a kernel node of g.
                check(
                    unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut p) },
                    "cuGraphKernelNodeGetParams",
                )?;
                if p.func.is_null() && !p.kern.is_null() {
                    // SAFETY: kern is the node's live kernel handle; writes one function.
                    check(
                        unsafe { sys::cuKernelGetFunction(&mut p.func, p.kern) },
                        "cuKernelGetFunction",
                    )?;
                }
                let sizes = if p.func.is_null() {
                    None
                } else {
                    kernel_param_sizes(p.func)?
                };
                let sizes = match sizes {
                    Some((s, ours)) if !p.kernelParams.is_null() || s.is_empty() => {
                        all_kernels_ours &= ours;
                        s
                    }
                    Some(_) => {
                        return Err(Error::InvalidGraph {
                            problem: "a kernel node was launched with `extra` (packed parameters), which rebind cannot read; copy into the graph's inputs or re-capture instead of rebinding".into(),
                        })
                    }
                    None => {
                        return Err(Error::NotSupported {
                            what: "rebinding a graph that holds another library's kernels (cuBLAS, cuBLASLt, cuDNN)",
                            detail: "this driver cannot report those kernels' parameter lists (that needs cuFuncGetParamCount, CUDA 13.2+ drivers), so the pointers inside them cannot be found; nothing was changed. Copy into the graph's inputs, re-capture, or force our own engines (CUDAGRAPH_GEMM=tiled, CUDAGRAPH_CONV=ours) for graphs you rebind".into(),
                        })
                    }
                };
                let mut storage = Vec::with_capacity(sizes.len());
                let mut changed = false;
                for (i, &size) in sizes.iter().enumerate() {
                    let mut words = vec![0u64; size.div_ceil(8)];
                    // SAFETY: kernelParams[i] points to `size` readable bytes owned by the graph
                    // (the driver's copy of the launch arguments; i is below the parameter
                    // count); `words` has room for them.
                    unsafe {
                        let src = *p.kernelParams.add(i) as *const u8;
                        ptr::copy_nonoverlapping(src, words.as_mut_ptr() as *mut u8, size);
                    }
                    // Every 8-byte word of the parameter (pointers are 8-aligned in the
                    // parameter buffer, and parameters start 8-aligned when they hold one).
                    for w in words.iter_mut().take(size / 8) {
                        changed |= rewrite(w, remaps, &mut hits);
                    }
                    // What the graph still refers to, counted at every byte offset: a pointer
                    // at an odd offset of a packed struct cannot be rewritten, but must keep
                    // its block alive.
                    note_words(&words, size, &mut referenced);
                    storage.push(words);
                }
                if changed {
                    let mut ptrs: Vec<*mut c_void> = storage
                        .iter_mut()
                        .map(|w| w.as_mut_ptr() as *mut c_void)
                        .collect();
                    p.kernelParams = ptrs.as_mut_ptr();
                    p.extra = ptr::null_mut();
                    edits.push(Edit::Kernel {
                        node,
                        params: p,
                        _storage: storage,
                        _ptrs: ptrs,
                    });
                }
            }
            node_code::MEMCPY => {
                let mut p = memcpy3d_device_blank();
                // SAFETY: node is a memcpy node of g.
                check(
                    unsafe { sys::cuGraphMemcpyNodeGetParams(node, &mut p) },
                    "cuGraphMemcpyNodeGetParams",
                )?;
                let src_changed = copy_endpoint(
                    p.srcMemoryType,
                    &mut p.srcDevice,
                    p.srcHost as u64,
                    [p.srcXInBytes, p.srcY, p.srcZ, p.srcLOD],
                    remaps,
                    &mut hits,
                    &mut referenced,
                )?;
                let dst_changed = copy_endpoint(
                    p.dstMemoryType,
                    &mut p.dstDevice,
                    p.dstHost as u64,
                    [p.dstXInBytes, p.dstY, p.dstZ, p.dstLOD],
                    remaps,
                    &mut hits,
                    &mut referenced,
                )?;
                if src_changed || dst_changed {
                    edits.push(Edit::Memcpy { node, params: p });
                }
            }
            node_code::MEMSET => {
                // SAFETY: the struct holds only integers (no enums), so all-zero is a valid
                // value; the driver fills it.
                let mut p: sys::CUDA_MEMSET_NODE_PARAMS = unsafe { std::mem::zeroed() };
                // SAFETY: node is a memset node of g.
                check(
                    unsafe { sys::cuGraphMemsetNodeGetParams(node, &mut p) },
                    "cuGraphMemsetNodeGetParams",
                )?;
                if rewrite(&mut p.dst, remaps, &mut hits) {
                    edits.push(Edit::Memset { node, params: p });
                }
                referenced.insert(p.dst);
            }
            // Host-function nodes run code on the CPU (which cannot reach device memory) and
            // empty nodes nothing.
            node_code::HOST | node_code::EMPTY => {}
            other => return Err(cannot_rebind(&node_kind_name(other))),
        }
    }
    let moved_from = remaps
        .iter()
        .zip(&hits)
        .filter(|(_, &hit)| hit)
        .map(|(r, _)| r.old)
        .collect();
    Ok(RebindPlan {
        graph: g,
        edits,
        referenced,
        all_kernels_ours,
        moved_from,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_remap_moves_every_address_of_the_block_by_the_same_offset() {
        let r = [Remap {
            old: 0x1000_0000,
            len: 4 * MIB,
            new: 0x9000_0000,
        }];
        // The start, an interior pointer and the last byte all move by the same offset.
        assert_eq!(remap_at(0x1000_0000, &r), Some((0, 0x9000_0000)));
        assert_eq!(
            remap_at(0x1000_0000 + 12_345, &r),
            Some((0, 0x9000_0000 + 12_345))
        );
        assert_eq!(
            remap_at(0x1000_0000 + 4 * MIB - 1, &r),
            Some((0, 0x9000_0000 + 4 * MIB - 1))
        );
        // One past the end is the start of whatever lies next: untouched, as is what lies before.
        assert_eq!(remap_at(0x1000_0000 + 4 * MIB, &r), None);
        assert_eq!(remap_at(0x1000_0000 - 1, &r), None);
        assert!(!remapped(0, &r));
    }

    #[test]
    fn rewrite_notes_which_remap_it_used() {
        let r = [
            Remap {
                old: 0x1000,
                len: 0x200,
                new: 0x8000,
            },
            Remap {
                old: 0x2000,
                len: 0x200,
                new: 0x9000,
            },
        ];
        let mut hits = [false; 2];
        let mut a = 0x2010;
        assert!(rewrite(&mut a, &r, &mut hits));
        assert_eq!(a, 0x9010);
        assert_eq!(hits, [false, true]);
        let mut b = 0x3000;
        assert!(!rewrite(&mut b, &r, &mut hits));
        assert_eq!(b, 0x3000);
        assert_eq!(hits, [false, true]);
    }

    #[test]
    fn references_range_sees_interior_addresses_only() {
        let referenced: BTreeSet<u64> = [0x1000 + 100, 0x5000].into_iter().collect();
        assert!(references_range(&referenced, 0x1000, 0x200));
        assert!(!references_range(&referenced, 0x1000, 100)); // ends just before it
        assert!(references_range(&referenced, 0x5000, 1));
        assert!(!references_range(&referenced, 0x5000, 0)); // an empty block holds nothing
        assert!(!references_range(&referenced, 0x4000, 0x1000)); // 0x5000 is one past its end
        assert!(!references_range(&referenced, u64::MAX - 4, 8));
    }

    #[test]
    fn copy_endpoints_are_rewritten_counted_or_refused() {
        use sys::CUmemorytype as M;
        let r = [Remap {
            old: 0x1000,
            len: 0x1000,
            new: 0x8000,
        }];
        let mut hits = [false];
        let mut referenced = BTreeSet::new();
        let mut dev = 0x1800;
        for kind in [M::CU_MEMORYTYPE_DEVICE, M::CU_MEMORYTYPE_UNIFIED] {
            dev = 0x1800;
            assert!(
                copy_endpoint(kind, &mut dev, 0, [0; 4], &r, &mut hits, &mut referenced).unwrap()
            );
            assert_eq!(dev, 0x8800);
        }
        assert!(hits[0] && referenced.contains(&0x8800));
        // An offset from the base address would hide which buffer the copy reaches.
        let e = copy_endpoint(
            M::CU_MEMORYTYPE_DEVICE,
            &mut dev,
            0,
            [8, 0, 0, 0],
            &r,
            &mut hits,
            &mut referenced,
        )
        .unwrap_err();
        assert!(matches!(e, Error::NotSupported { .. }), "{e}");
        // Host endpoints are counted, never rewritten; inside a rebound range they are refused.
        assert!(!copy_endpoint(
            M::CU_MEMORYTYPE_HOST,
            &mut dev,
            0x7777_0000,
            [0; 4],
            &r,
            &mut hits,
            &mut referenced
        )
        .unwrap());
        assert!(referenced.contains(&0x7777_0000));
        let e = copy_endpoint(
            M::CU_MEMORYTYPE_HOST,
            &mut dev,
            0x1010,
            [0; 4],
            &r,
            &mut hits,
            &mut referenced,
        )
        .unwrap_err();
        assert!(e.to_string().contains("host-memory endpoint"), "{e}");
        let e = copy_endpoint(
            M::CU_MEMORYTYPE_ARRAY,
            &mut dev,
            0,
            [0; 4],
            &r,
            &mut hits,
            &mut referenced,
        )
        .unwrap_err();
        assert!(e.to_string().contains("array"), "{e}");
    }

    #[test]
    fn kernel_parameters_count_as_references_at_every_byte_offset() {
        // A 20-byte packed struct: a pointer at offset 0 and one at offset 9.
        let (a, b) = (0x7f00_0000_1000u64, 0x7f00_0000_2000u64);
        let mut bytes = [0u8; 24];
        bytes[..8].copy_from_slice(&a.to_ne_bytes());
        bytes[9..17].copy_from_slice(&b.to_ne_bytes());
        let words: Vec<u64> = bytes
            .chunks(8)
            .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        let mut referenced = BTreeSet::new();
        note_words(&words, 20, &mut referenced);
        assert!(referenced.contains(&a) && referenced.contains(&b));
        // Bytes past the parameter's size are not read.
        assert!(referenced.len() <= 20 - 8 + 1);
        // Parameters shorter than a pointer hold none.
        let mut none = BTreeSet::new();
        note_words(&[u64::MAX], 4, &mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn node_kinds_rebind_cannot_read_are_named() {
        assert_eq!(node_kind_name(node_code::GRAPH), "a child-graph node");
        assert_eq!(node_kind_name(node_code::CONDITIONAL), "a conditional node");
        assert_eq!(node_kind_name(99), "a node of type 99");
        let e = cannot_rebind(&node_kind_name(node_code::GRAPH));
        assert!(matches!(e, Error::NotSupported { .. }));
        assert!(e.to_string().contains("child-graph node"), "{e}");
    }
}
