//! Conditional nodes (IF and WHILE, CUDA 12.4+) at the driver level: a capturing stream's
//! state, conditional handles, adding the node after the capture's dependencies, and
//! capturing a body into the node's own graph. What runs the condition and how bodies are
//! recorded is one layer up (`crate::graph`'s conditional module).

use std::ptr;

use cudarc::driver::sys;

use crate::error::{Error, Result};
use crate::runtime::context::Context;
use crate::runtime::raw::{RawGraph, RawNode, RawStream};
use crate::runtime::result::{check, driver_has};
use crate::runtime::stream::CaptureMode;

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
    /// Runs its body once when the condition is non-zero.
    If,
    /// Runs its body as long as the condition is non-zero, tested before each iteration.
    While,
}

/// A conditional node recorded in a capture: its kind, the node and its body graph (both
/// owned by the captured graph).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CondRecord {
    pub kind: ConditionalKind,
    pub node: RawNode,
    pub body: RawGraph,
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
pub(crate) fn begin_capture_to_graph(s: RawStream, g: RawGraph, mode: CaptureMode) -> Result<()> {
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
