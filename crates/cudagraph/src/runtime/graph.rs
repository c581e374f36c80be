//! Graphs at the driver level: owned [`GraphHandle`] (`CUgraph`) and [`ExecHandle`]
//! (`CUgraphExec`), stream capture's result, hand-built nodes, node inspection, DOT output,
//! the in-place parameter rewrite behind `Graph::rebind`, and host-function nodes.
//!
//! The driver does not synchronise graph objects internally: the owners one layer up
//! (`crate::graph::Graph`) serialise every call on one graph.

use std::collections::BTreeSet;
use std::ffi::{c_void, CString};
use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys;

use super::context::{Context, RawContext};
use super::module::{
    driver_params, known_param_sizes, Dims, Function, ParamValue, Params, RawFunction,
};
use super::result::{check, driver_has, driver_symbol, raw_handle};
use super::stream::RawStream;
use crate::error::{Error, Result};

raw_handle!(RawGraph, sys::CUgraph);
raw_handle!(RawGraphExec, sys::CUgraphExec);
raw_handle!(RawNode, sys::CUgraphNode);

/// An owned `CUgraph`, destroyed on drop.
pub(crate) struct GraphHandle {
    raw: RawGraph,
    ctx: Context,
}

impl GraphHandle {
    pub(crate) fn from_raw(g: sys::CUgraph, ctx: &Context) -> Self {
        Self {
            raw: RawGraph(g),
            ctx: ctx.clone(),
        }
    }

    /// The raw graph (owned by `self`: do not destroy it).
    pub(crate) fn raw(&self) -> RawGraph {
        self.raw
    }

    /// A new, empty graph.
    #[track_caller]
    pub(crate) fn new(ctx: &Context) -> Result<Self> {
        ctx.bind()?;
        let mut g = ptr::null_mut();
        // SAFETY: writes one graph handle.
        check(unsafe { sys::cuGraphCreate(&mut g, 0) }, "cuGraphCreate")?;
        Ok(Self::from_raw(g, ctx))
    }

    /// A deep copy (the driver's `cuGraphClone`), owned independently of `self`.
    #[track_caller]
    pub(crate) fn try_clone(&self) -> Result<Self> {
        self.ctx.bind()?;
        let mut g = ptr::null_mut();
        // SAFETY: self.raw is a live graph; writes one handle.
        check(
            unsafe { sys::cuGraphClone(&mut g, self.raw.0) },
            "cuGraphClone",
        )?;
        Ok(Self::from_raw(g, &self.ctx))
    }

    /// Every node.
    #[track_caller]
    fn nodes(&self) -> Result<Vec<sys::CUgraphNode>> {
        self.ctx.bind()?;
        nodes_of(self.raw)
    }

    /// The type code of every node (see `CUgraphNodeType`).
    #[track_caller]
    pub(crate) fn node_types(&self) -> Result<Vec<u32>> {
        self.nodes()?.into_iter().map(node_type).collect()
    }

    /// Instantiates an executable graph.
    #[track_caller]
    pub(crate) fn instantiate(&self) -> Result<ExecHandle> {
        self.ctx.bind()?;
        let mut e = ptr::null_mut();
        // SAFETY: writes one executable-graph handle; the graph is live.
        check(
            unsafe { sys::cuGraphInstantiateWithFlags(&mut e, self.raw.0, 0) },
            "cuGraphInstantiate",
        )?;
        Ok(ExecHandle {
            raw: RawGraphExec(e),
            ctx: self.ctx.clone(),
        })
    }

    /// Writes Graphviz DOT (verbose: node parameters included) to `path`.
    #[track_caller]
    pub(crate) fn dot_print(&self, path: &std::path::Path) -> Result<()> {
        let cpath =
            CString::new(path.to_string_lossy().as_bytes()).map_err(|_| Error::InvalidGraph {
                problem: format!("DOT path {path:?} contains a NUL byte"),
            })?;
        self.ctx.bind()?;
        // SAFETY: cpath is a NUL-terminated path alive for the call; the graph is live.
        check(
            unsafe { sys::cuGraphDebugDotPrint(self.raw.0, cpath.as_ptr(), 1) },
            "cuGraphDebugDotPrint",
        )
    }

    fn add(
        &self,
        deps: &[RawNode],
        call: &'static str,
        f: impl FnOnce(*mut sys::CUgraphNode, *const sys::CUgraphNode, usize) -> sys::CUresult,
    ) -> Result<RawNode> {
        let deps_raw: Vec<sys::CUgraphNode> = deps.iter().map(|d| d.0).collect();
        let mut node = ptr::null_mut();
        check(f(&mut node, deps_raw.as_ptr(), deps_raw.len()), call)?;
        Ok(RawNode(node))
    }

    /// Adds a kernel node.
    ///
    /// # Safety
    /// As for [`super::module::launch`]: `params` checked against `f`, `dims` against its
    /// limits, and the memory the kernel reaches valid whenever the graph runs.
    #[track_caller]
    pub(crate) unsafe fn add_kernel(
        &self,
        deps: &[RawNode],
        f: &Function,
        dims: Dims,
        params: &[ParamValue<'_>],
    ) -> Result<RawNode> {
        let mut p = Params::new(params);
        let node_params = sys::CUDA_KERNEL_NODE_PARAMS {
            func: f.raw.0,
            gridDimX: dims.grid.0,
            gridDimY: dims.grid.1,
            gridDimZ: dims.grid.2,
            blockDimX: dims.block.0,
            blockDimY: dims.block.1,
            blockDimZ: dims.block.2,
            sharedMemBytes: dims.shared_mem_bytes,
            kernelParams: p.as_ptr(),
            extra: ptr::null_mut(),
            kern: ptr::null_mut(),
            ctx: ptr::null_mut(),
        };
        // The driver copies the parameter values when the node is added; `p` outlives the call.
        self.add(deps, "cuGraphAddKernelNode", |n, d, k| unsafe {
            sys::cuGraphAddKernelNode_v2(n, self.raw.0, d, k, &node_params)
        })
    }

    /// Adds a device-to-device 1-D copy node.
    #[track_caller]
    pub(crate) fn add_memcpy_dtod(
        &self,
        deps: &[RawNode],
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<RawNode> {
        let mut p = memcpy3d_device_blank();
        p.srcDevice = src;
        p.dstDevice = dst;
        p.WidthInBytes = bytes;
        p.Height = 1;
        p.Depth = 1;
        let ctx = self.ctx.handle.raw;
        // SAFETY: parameters are copied by the driver; device addresses only.
        self.add(deps, "cuGraphAddMemcpyNode", |n, d, k| unsafe {
            sys::cuGraphAddMemcpyNode(n, self.raw.0, d, k, &p, ctx.0)
        })
    }

    /// Adds a 32-bit memset node over `words` words.
    #[track_caller]
    pub(crate) fn add_memset32(
        &self,
        deps: &[RawNode],
        dst: u64,
        value: u32,
        words: usize,
    ) -> Result<RawNode> {
        let p = sys::CUDA_MEMSET_NODE_PARAMS {
            dst,
            pitch: 0,
            value,
            elementSize: 4,
            width: words,
            height: 1,
        };
        let ctx = self.ctx.handle.raw;
        // SAFETY: parameters are copied by the driver; device addresses only.
        self.add(deps, "cuGraphAddMemsetNode", |n, d, k| unsafe {
            sys::cuGraphAddMemsetNode(n, self.raw.0, d, k, &p, ctx.0)
        })
    }

    /// Adds a host-function node that calls `f`.
    ///
    /// # Safety
    /// `f` must stay alive (at the same address) for as long as this graph, or any executable
    /// graph instantiated from it, can run — including a replay still in flight.
    #[track_caller]
    pub(crate) unsafe fn add_host(&self, deps: &[RawNode], f: &Arc<HostFn>) -> Result<RawNode> {
        let p = sys::CUDA_HOST_NODE_PARAMS {
            fn_: Some(host_trampoline),
            userData: Arc::as_ptr(f) as *mut c_void,
        };
        self.add(deps, "cuGraphAddHostNode", |n, d, k| {
            sys::cuGraphAddHostNode(n, self.raw.0, d, k, &p)
        })
    }

    /// Adds a child-graph node (the driver copies `child` into this graph).
    #[track_caller]
    pub(crate) fn add_child(&self, deps: &[RawNode], child: &GraphHandle) -> Result<RawNode> {
        // SAFETY: both graphs are live; the driver clones the child.
        self.add(deps, "cuGraphAddChildGraphNode", |n, d, k| unsafe {
            sys::cuGraphAddChildGraphNode(n, self.raw.0, d, k, child.raw.0)
        })
    }
}

impl Drop for GraphHandle {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: the graph is owned by this value and destroyed once, here.
            unsafe {
                sys::cuGraphDestroy(self.raw.0);
            }
        }
    }
}

/// An owned `CUgraphExec`, destroyed on drop.
pub(crate) struct ExecHandle {
    raw: RawGraphExec,
    ctx: Context,
}

impl Drop for ExecHandle {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: owned by this value and destroyed once, here; the owner above waited for
            // the last launch before dropping it.
            unsafe {
                sys::cuGraphExecDestroy(self.raw.0);
            }
        }
    }
}

impl ExecHandle {
    /// Launches the executable graph on `s`.
    ///
    /// # Safety
    /// Everything the graph uses must stay valid until this launch has finished.
    #[track_caller]
    pub(crate) unsafe fn launch(&self, s: RawStream) -> Result<()> {
        check(sys::cuGraphLaunch(self.raw.0, s.0), "cuGraphLaunch")
    }

    #[track_caller]
    pub(crate) fn upload(&self, s: RawStream) -> Result<()> {
        // SAFETY: both handles are live; uploading runs nothing.
        check(
            unsafe { sys::cuGraphUpload(self.raw.0, s.0) },
            "cuGraphUpload",
        )
    }
}

/// The `CUgraphNodeType` code of a node, as an integer: a driver newer than these bindings may
/// report a code they do not list, which must not become a Rust enum value.
fn node_type(node: sys::CUgraphNode) -> Result<u32> {
    let mut t = 0u32;
    // SAFETY: node belongs to a live graph; `CUgraphNodeType` is a `repr(u32)` C enum, so the
    // driver writes one 32-bit code into `t`.
    check(
        unsafe { sys::cuGraphNodeGetType(node, (&mut t as *mut u32).cast()) },
        "cuGraphNodeGetType",
    )?;
    Ok(t)
}

/// `CUgraphNodeType` codes rebind reads.
mod node_code {
    use cudarc::driver::sys::CUgraphNodeType as T;
    pub const KERNEL: u32 = T::CU_GRAPH_NODE_TYPE_KERNEL as u32;
    pub const MEMCPY: u32 = T::CU_GRAPH_NODE_TYPE_MEMCPY as u32;
    pub const MEMSET: u32 = T::CU_GRAPH_NODE_TYPE_MEMSET as u32;
    pub const HOST: u32 = T::CU_GRAPH_NODE_TYPE_HOST as u32;
    pub const GRAPH: u32 = T::CU_GRAPH_NODE_TYPE_GRAPH as u32;
    pub const EMPTY: u32 = T::CU_GRAPH_NODE_TYPE_EMPTY as u32;
    pub const WAIT_EVENT: u32 = T::CU_GRAPH_NODE_TYPE_WAIT_EVENT as u32;
    pub const EVENT_RECORD: u32 = T::CU_GRAPH_NODE_TYPE_EVENT_RECORD as u32;
    pub const EXT_SEMAS_SIGNAL: u32 = T::CU_GRAPH_NODE_TYPE_EXT_SEMAS_SIGNAL as u32;
    pub const EXT_SEMAS_WAIT: u32 = T::CU_GRAPH_NODE_TYPE_EXT_SEMAS_WAIT as u32;
    pub const MEM_ALLOC: u32 = T::CU_GRAPH_NODE_TYPE_MEM_ALLOC as u32;
    pub const MEM_FREE: u32 = T::CU_GRAPH_NODE_TYPE_MEM_FREE as u32;
    pub const BATCH_MEM_OP: u32 = T::CU_GRAPH_NODE_TYPE_BATCH_MEM_OP as u32;
    pub const CONDITIONAL: u32 = T::CU_GRAPH_NODE_TYPE_CONDITIONAL as u32;
}

/// A copy description with every field set (its memory-type enums have no zero value, so
/// `mem::zeroed` would be invalid): device to device, nothing else filled in.
fn memcpy3d_device_blank() -> sys::CUDA_MEMCPY3D {
    sys::CUDA_MEMCPY3D {
        srcXInBytes: 0,
        srcY: 0,
        srcZ: 0,
        srcLOD: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: ptr::null(),
        srcDevice: 0,
        srcArray: ptr::null_mut(),
        reserved0: ptr::null_mut(),
        srcPitch: 0,
        srcHeight: 0,
        dstXInBytes: 0,
        dstY: 0,
        dstZ: 0,
        dstLOD: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: ptr::null_mut(),
        dstDevice: 0,
        dstArray: ptr::null_mut(),
        reserved1: ptr::null_mut(),
        dstPitch: 0,
        dstHeight: 0,
        WidthInBytes: 0,
        Height: 1,
        Depth: 1,
    }
}

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

/// A host callback a graph runs (a host-function node). Kept alive by the graph.
pub(crate) struct HostFn(pub(crate) Box<dyn Fn() + Send + Sync + 'static>);

/// Runs the callback; a panic is caught here (unwinding into the driver would abort) and
/// reported on stderr.
unsafe extern "C" fn host_trampoline(user: *mut c_void) {
    // SAFETY: `user` is the address of a `HostFn` that the graph owning this node keeps alive
    // (in an Arc) until its last replay has finished; the driver passes it back unchanged.
    let f = unsafe { &*(user as *const HostFn) };
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (f.0)())).is_err() {
        eprintln!("cudagraph: a host-function node panicked; the panic was caught");
    }
}

/// Every node of a live graph (the caller has bound the graph's context).
#[track_caller]
pub(crate) fn nodes_of(g: RawGraph) -> Result<Vec<sys::CUgraphNode>> {
    let mut n = 0usize;
    // SAFETY: with a null array the driver only writes the count.
    check(
        unsafe { sys::cuGraphGetNodes(g.0, ptr::null_mut(), &mut n) },
        "cuGraphGetNodes",
    )?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut nodes = vec![ptr::null_mut(); n];
    // SAFETY: the array has room for `n` nodes.
    check(
        unsafe { sys::cuGraphGetNodes(g.0, nodes.as_mut_ptr(), &mut n) },
        "cuGraphGetNodes",
    )?;
    nodes.truncate(n);
    Ok(nodes)
}

/// The type code of every node of a live graph (see `CUgraphNodeType`), in [`nodes_of`] order.
#[track_caller]
pub(crate) fn node_types_of(g: RawGraph) -> Result<Vec<u32>> {
    nodes_of(g)?.into_iter().map(node_type).collect()
}

/// `CUgraphNodeType` code of conditional nodes.
pub(crate) const NODE_TYPE_CONDITIONAL: u32 = node_code::CONDITIONAL;

/// One dependency edge of a graph, as indices into [`nodes_of`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Edge {
    pub from: usize,
    pub to: usize,
    /// A programmatic (PDL) edge: the successor kernel may start before the predecessor ends.
    pub programmatic: bool,
}

/// The edges of a live graph with their types (`cuGraphGetEdges_v2`, CUDA 12.3+; on older
/// drivers every edge is reported as a full dependency).
#[track_caller]
pub(crate) fn edges_of(g: RawGraph, nodes: &[sys::CUgraphNode]) -> Result<Vec<Edge>> {
    let typed = driver_has("cuGraphGetEdges_v2");
    let mut n = 0usize;
    // SAFETY: with null arrays the driver only writes the count; the graph is live.
    check(
        unsafe {
            if typed {
                sys::cuGraphGetEdges_v2(
                    g.0,
                    ptr::null_mut(),
                    ptr::null_mut(),
                    ptr::null_mut(),
                    &mut n,
                )
            } else {
                cu_graph_get_edges_untyped(g.0, ptr::null_mut(), ptr::null_mut(), &mut n)
            }
        },
        "cuGraphGetEdges",
    )?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut from = vec![ptr::null_mut(); n];
    let mut to = vec![ptr::null_mut(); n];
    let blank = sys::CUgraphEdgeData {
        from_port: 0,
        to_port: 0,
        type_: 0,
        reserved: [0; 5],
    };
    let mut data = vec![blank; n];
    // SAFETY: every array has room for `n` entries.
    check(
        unsafe {
            if typed {
                sys::cuGraphGetEdges_v2(
                    g.0,
                    from.as_mut_ptr(),
                    to.as_mut_ptr(),
                    data.as_mut_ptr(),
                    &mut n,
                )
            } else {
                cu_graph_get_edges_untyped(g.0, from.as_mut_ptr(), to.as_mut_ptr(), &mut n)
            }
        },
        "cuGraphGetEdges",
    )?;
    let index = |node: sys::CUgraphNode| nodes.iter().position(|&x| x == node);
    let programmatic = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
    Ok((0..n.min(from.len()))
        .filter_map(|i| {
            Some(Edge {
                from: index(from[i])?,
                to: index(to[i])?,
                programmatic: data[i].type_ == programmatic,
            })
        })
        .collect())
}

/// `cuGraphGetEdges` (no edge data) looked up by name: cudarc's CUDA 13 bindings only have the
/// `_v2` form, and drivers before 12.3 only this one.
///
/// # Safety
/// As for the driver call: `g` is a live graph, and `from`/`to` are null or have room for
/// `*n` nodes.
unsafe fn cu_graph_get_edges_untyped(
    g: sys::CUgraph,
    from: *mut sys::CUgraphNode,
    to: *mut sys::CUgraphNode,
    n: *mut usize,
) -> sys::CUresult {
    type F = unsafe extern "C" fn(
        sys::CUgraph,
        *mut sys::CUgraphNode,
        *mut sys::CUgraphNode,
        *mut usize,
    ) -> sys::CUresult;
    // SAFETY: the symbol has this C signature in every driver that exports it.
    match unsafe { driver_symbol::<F>("cuGraphGetEdges") } {
        // SAFETY: the caller's contract is the call's.
        Some(f) => unsafe { f(g, from, to, n) },
        None => sys::CUresult::CUDA_ERROR_NOT_SUPPORTED,
    }
}

/// The type code of one node.
#[track_caller]
pub(crate) fn node_type_code(node: sys::CUgraphNode) -> Result<u32> {
    node_type(node)
}

/// The name of a kernel node's function, when the driver can tell (`cuFuncGetName`, 12.3+).
pub(crate) fn kernel_node_name(node: sys::CUgraphNode) -> Option<String> {
    if !driver_has("cuFuncGetName") {
        return None;
    }
    // SAFETY: the struct holds only pointers and integers (no enums), so all-zero is a valid
    // value; the driver fills it.
    let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: the caller passes a kernel node of a live graph.
    if unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut p) } != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    if p.func.is_null() && !p.kern.is_null() {
        // SAFETY: kern is the node's live kernel handle; writes one function.
        if unsafe { sys::cuKernelGetFunction(&mut p.func, p.kern) } != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
    }
    if p.func.is_null() {
        return None;
    }
    let mut name: *const std::ffi::c_char = ptr::null();
    // SAFETY: func is a live function; the driver writes a pointer to a string it owns.
    if unsafe { sys::cuFuncGetName(&mut name, p.func) } != sys::CUresult::CUDA_SUCCESS
        || name.is_null()
    {
        return None;
    }
    // SAFETY: a NUL-terminated string owned by the driver, alive as long as the function.
    Some(
        unsafe { std::ffi::CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// What `cuStreamGetCaptureInfo` reports for a capturing stream, copied out (the driver's
/// arrays are valid only until the next call on the stream).
pub(crate) struct CaptureInfo {
    /// The graph the stream captures into (owned by the capture, not by us).
    pub graph: RawGraph,
    pub deps: Vec<sys::CUgraphNode>,
    /// Edge data of each dependency, when the driver reports any (else all default edges).
    pub edges: Option<Vec<sys::CUgraphEdgeData>>,
}

/// The capture state of `s`, which must be capturing.
#[track_caller]
pub(crate) fn capture_info(s: RawStream) -> Result<CaptureInfo> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id = 0u64;
    let mut graph = ptr::null_mut();
    let mut deps: *const sys::CUgraphNode = ptr::null();
    let mut edges: *const sys::CUgraphEdgeData = ptr::null();
    let mut n = 0usize;
    // SAFETY: every out-pointer is valid for one write; the arrays the driver returns are read
    // (copied) below before any other call on the stream.
    check(
        unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                s.0,
                &mut status,
                &mut id,
                &mut graph,
                &mut deps,
                &mut edges,
                &mut n,
            )
        },
        "cuStreamGetCaptureInfo",
    )?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || graph.is_null() {
        return Err(Error::InvalidGraph {
            problem: format!(
                "a conditional node needs a capturing stream, and the driver reports {status:?}"
            ),
        });
    }
    let deps_v = if n == 0 || deps.is_null() {
        Vec::new()
    } else {
        // SAFETY: the driver returned `n` dependencies, valid until the next call on `s`.
        unsafe { std::slice::from_raw_parts(deps, n) }.to_vec()
    };
    let edges_v = if n == 0 || edges.is_null() {
        None
    } else {
        // SAFETY: non-null edge data has one entry per dependency, valid as above.
        Some(unsafe { std::slice::from_raw_parts(edges, n) }.to_vec())
    };
    Ok(CaptureInfo {
        graph: RawGraph(graph),
        deps: deps_v,
        edges: edges_v,
    })
}

/// A conditional handle for a conditional node of `g` (the graph that will contain it). The
/// value is set before every use by a kernel (no default assignment).
#[track_caller]
pub(crate) fn conditional_handle_create(g: RawGraph, ctx: &Context) -> Result<u64> {
    let mut h: sys::CUgraphConditionalHandle = 0;
    // SAFETY: g is the live graph of an open capture; writes one handle.
    check(
        unsafe { sys::cuGraphConditionalHandleCreate(&mut h, g.0, ctx.handle.raw.0, 0, 0) },
        "cuGraphConditionalHandleCreate",
    )?;
    Ok(h)
}

/// IF (body runs once when the condition is non-zero) or WHILE (body repeats while it is).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConditionalKind {
    If,
    While,
}

/// Adds a conditional node to `info.graph` after `info`'s dependencies and returns it with
/// its body graph (owned by the node: never destroy it).
#[track_caller]
pub(crate) fn add_conditional_node(
    info: &CaptureInfo,
    handle: u64,
    kind: ConditionalKind,
    ctx: &Context,
) -> Result<(RawNode, RawGraph)> {
    // SAFETY: the struct is plain C data (integers, pointers and enums whose zero value is
    // valid: KERNEL and IF); the fields the driver reads are set below.
    let mut params: sys::CUgraphNodeParams = unsafe { std::mem::zeroed() };
    params.type_ = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_CONDITIONAL;
    params.__bindgen_anon_1.conditional = sys::CUDA_CONDITIONAL_NODE_PARAMS {
        handle,
        type_: match kind {
            ConditionalKind::If => sys::CUgraphConditionalNodeType::CU_GRAPH_COND_TYPE_IF,
            ConditionalKind::While => sys::CUgraphConditionalNodeType::CU_GRAPH_COND_TYPE_WHILE,
        },
        size: 1,
        phGraph_out: ptr::null_mut(),
        ctx: ctx.handle.raw.0,
    };
    let mut node = ptr::null_mut();
    let edges = info.edges.as_ref().map_or(ptr::null(), |e| e.as_ptr());
    // SAFETY: the graph is the live graph of an open capture, the dependencies are its nodes
    // (copied from the driver a moment ago), `edges` is null or has one entry per dependency;
    // the driver fills `phGraph_out` with an array it owns.
    check(
        unsafe {
            sys::cuGraphAddNode_v2(
                &mut node,
                info.graph.0,
                info.deps.as_ptr(),
                edges,
                info.deps.len(),
                &mut params,
            )
        },
        "cuGraphAddNode(conditional)",
    )?;
    // SAFETY: the conditional variant was written above and the driver filled its output.
    let body = unsafe { params.__bindgen_anon_1.conditional.phGraph_out };
    if body.is_null() {
        return Err(Error::InvalidGraph {
            problem: "the driver added a conditional node without a body graph".into(),
        });
    }
    // SAFETY: `size` is 1, so the driver's array has one body graph.
    Ok((RawNode(node), RawGraph(unsafe { *body })))
}

/// Makes `node` the only dependency of the next work captured on `s`.
#[track_caller]
pub(crate) fn set_capture_dependencies(s: RawStream, node: RawNode) -> Result<()> {
    let mut n = node.0;
    // SAFETY: `s` is capturing into the graph that holds `node`; one node, default edge.
    check(
        unsafe {
            sys::cuStreamUpdateCaptureDependencies_v2(
                s.0,
                &mut n,
                ptr::null(),
                1,
                sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES
                    as u32,
            )
        },
        "cuStreamUpdateCaptureDependencies",
    )
}

/// Begins capturing `s` into the existing graph `g` (a conditional node's body).
#[track_caller]
pub(crate) fn begin_capture_to_graph(
    s: RawStream,
    g: RawGraph,
    mode: crate::runtime::CaptureMode,
) -> Result<()> {
    // SAFETY: `s` is a live stream that is not capturing; `g` is a live body graph.
    check(
        unsafe {
            sys::cuStreamBeginCaptureToGraph(s.0, g.0, ptr::null(), ptr::null(), 0, mode.raw())
        },
        "cuStreamBeginCaptureToGraph",
    )
}

/// Ends a capture begun by [`begin_capture_to_graph`]. The graph stays owned by its node.
#[track_caller]
pub(crate) fn end_capture_to_graph(s: RawStream) -> Result<()> {
    let mut g = ptr::null_mut();
    // SAFETY: writes one graph handle, which we do not take ownership of.
    check(
        unsafe { sys::cuStreamEndCapture(s.0, &mut g) },
        "cuStreamEndCapture(body)",
    )
}

/// Whether the driver has every call conditional nodes captured from streams need.
pub(crate) fn conditional_nodes_available() -> bool {
    [
        "cuGraphConditionalHandleCreate",
        "cuGraphAddNode_v2",
        "cuStreamGetCaptureInfo_v3",
        "cuStreamUpdateCaptureDependencies_v2",
        "cuStreamBeginCaptureToGraph",
    ]
    .iter()
    .all(|s| driver_has(s))
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
