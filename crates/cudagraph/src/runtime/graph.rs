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
        self.nodes()?
            .into_iter()
            .map(|node| Ok(node_type(node)? as u32))
            .collect()
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

fn node_type(node: sys::CUgraphNode) -> Result<sys::CUgraphNodeType> {
    let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    // SAFETY: node belongs to a live graph; writes one type.
    check(
        unsafe { sys::cuGraphNodeGetType(node, &mut t) },
        "cuGraphNodeGetType",
    )?;
    Ok(t)
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
#[derive(Clone, Copy, Debug)]
pub(crate) struct Remap {
    pub old: u64,
    pub len: u64,
    pub new: u64,
}

fn remap(addr: u64, remaps: &[Remap]) -> Option<u64> {
    remaps
        .iter()
        .find(|r| addr >= r.old && addr - r.old < r.len)
        .map(|r| r.new + (addr - r.old))
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

/// What [`rebind`] did.
pub(crate) struct RebindResult {
    pub nodes_changed: usize,
    /// False when the driver refused to update the executable graph in place.
    pub exec_updated: bool,
    /// Every 8-byte word of every kernel parameter and every device address of copy and memset
    /// nodes, after the rewrite: what the graph still refers to.
    pub referenced: BTreeSet<u64>,
}

/// Parameter sizes of a kernel node's function: ours are known from their PTX, other
/// libraries' from the driver where it can say. `None`: the node cannot be read safely.
fn kernel_param_sizes(func: sys::CUfunction) -> Result<Option<Vec<usize>>> {
    if let Some(s) = known_param_sizes(func) {
        return Ok(Some(s));
    }
    Ok(driver_params(RawFunction(func))?.map(|v| v.iter().map(|p| p.size).collect()))
}

/// Rewrites every device address covered by `remaps` in the kernel parameters (every 8-byte
/// aligned word of every parameter, so pointers inside struct parameters of library kernels
/// are found too), copy and memset nodes of `g`, and applies the same edits to `exec`.
/// Nothing is modified unless every node could be read.
#[track_caller]
pub(crate) fn rebind(g: &GraphHandle, exec: &ExecHandle, remaps: &[Remap]) -> Result<RebindResult> {
    let nodes = g.nodes()?;
    let ctx: RawContext = g.ctx.handle.raw;
    let mut edits = Vec::new();
    let mut referenced = BTreeSet::new();
    for node in nodes {
        match node_type(node)? {
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => {
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
                    Some(s) if !p.kernelParams.is_null() || s.is_empty() => s,
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
                        if let Some(nv) = remap(*w, remaps) {
                            *w = nv;
                            changed = true;
                        }
                        referenced.insert(*w);
                    }
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
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY => {
                let mut p = memcpy3d_device_blank();
                // SAFETY: node is a memcpy node of g.
                check(
                    unsafe { sys::cuGraphMemcpyNodeGetParams(node, &mut p) },
                    "cuGraphMemcpyNodeGetParams",
                )?;
                let mut changed = false;
                if p.srcMemoryType == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE {
                    if let Some(v) = remap(p.srcDevice, remaps) {
                        p.srcDevice = v;
                        changed = true;
                    }
                    referenced.insert(p.srcDevice);
                }
                if p.dstMemoryType == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE {
                    if let Some(v) = remap(p.dstDevice, remaps) {
                        p.dstDevice = v;
                        changed = true;
                    }
                    referenced.insert(p.dstDevice);
                }
                if changed {
                    edits.push(Edit::Memcpy { node, params: p });
                }
            }
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET => {
                // SAFETY: the struct holds only integers (no enums), so all-zero is a valid
                // value; the driver fills it.
                let mut p: sys::CUDA_MEMSET_NODE_PARAMS = unsafe { std::mem::zeroed() };
                // SAFETY: node is a memset node of g.
                check(
                    unsafe { sys::cuGraphMemsetNodeGetParams(node, &mut p) },
                    "cuGraphMemsetNodeGetParams",
                )?;
                if let Some(v) = remap(p.dst, remaps) {
                    p.dst = v;
                    edits.push(Edit::Memset { node, params: p });
                }
                referenced.insert(p.dst);
            }
            _ => {}
        }
    }
    let mut exec_updated = true;
    for e in &edits {
        // SAFETY: every node belongs to g, which `exec` was instantiated from; parameter
        // structs and the storage their pointers point into are alive (owned by `edits`).
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
    Ok(RebindResult {
        nodes_changed: edits.len(),
        exec_updated,
        referenced,
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
    nodes_of(g)?
        .into_iter()
        .map(|node| Ok(node_type(node)? as u32))
        .collect()
}

/// `CUgraphNodeType` code of conditional nodes.
pub(crate) const NODE_TYPE_CONDITIONAL: u32 =
    sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_CONDITIONAL as u32;

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
    Ok(node_type(node)? as u32)
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
