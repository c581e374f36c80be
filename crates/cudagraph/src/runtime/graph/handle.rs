//! Owned driver graphs: [`GraphHandle`] (`CUgraph`: stream capture's result, hand-built
//! nodes, DOT output) and [`ExecHandle`] (`CUgraphExec`: launch, upload), and the host
//! callbacks host-function nodes run ([`HostFn`]). Reading nodes back, rebind's rewrite and
//! conditional nodes are in the sibling modules.
//!
//! The driver does not synchronise graph objects internally: the owners one layer up
//! (`crate::graph::Graph`) serialise every call on one graph.

use std::ffi::{c_void, CString};
use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys;

use super::nodes::{memcpy3d_device_blank, node_type, nodes_of};
use crate::error::{Error, Result};
use crate::runtime::context::Context;
use crate::runtime::module::{Dims, Function, ParamValue, Params};
use crate::runtime::raw::{RawGraph, RawGraphExec, RawNode, RawStream};
use crate::runtime::result::check;

/// An owned `CUgraph`, destroyed on drop.
pub(crate) struct GraphHandle {
    pub(super) raw: RawGraph,
    pub(super) ctx: Context,
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
    pub(super) fn nodes(&self) -> Result<Vec<sys::CUgraphNode>> {
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
    /// As for [`crate::runtime::module::launch`]: `params` checked against `f`, `dims` against its
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
    pub(super) raw: RawGraphExec,
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
