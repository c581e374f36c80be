//! Reading a live graph back: its nodes, their type codes, kernel names and dependency
//! edges (with their programmatic kind), for node counts, topology drawings and rebind. Only
//! reads; the owners of graphs are in `handle.rs`.

use std::ptr;

use cudarc::driver::sys;

use crate::error::Result;
use crate::runtime::raw::RawGraph;
use crate::runtime::result::{check, driver_has, driver_symbol};

/// The `CUgraphNodeType` code of a node, as an integer: a driver newer than these bindings may
/// report a code they do not list, which must not become a Rust enum value.
pub(super) fn node_type(node: sys::CUgraphNode) -> Result<u32> {
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
pub(super) mod node_code {
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
pub(super) fn memcpy3d_device_blank() -> sys::CUDA_MEMCPY3D {
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
