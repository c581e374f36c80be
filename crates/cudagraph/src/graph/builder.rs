//! Explicit graph building (seed 003): kernel, copy, memset, host-function and child-graph
//! nodes with explicit dependencies, the way raw CUDA's `cudaGraphAddKernelNode` works, validated before the driver
//! sees them.
//!
//! Dependencies can only name nodes added earlier, so a built graph is acyclic by
//! construction; a dependency on a node that does not exist is a typed error.

use std::sync::Arc;

use super::{Anchor, Graph, GraphMemory};
use crate::device::{check_device, check_range, Device};
use crate::error::{Error, Result};
use crate::memory::Pool;
use crate::memory::{BlockRef, DeviceBuffer, Elem};
use crate::runtime::driver::{self, Dims, HostFn, ParamSlot, PinnedAlloc, RawGraph, RawNode};
use crate::runtime::{Arg, Function, LaunchConfig};

/// A node added to a [`GraphBuilder`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeId(usize);

enum Node {
    Kernel {
        f: Function,
        dims: Dims,
        params: Vec<ParamSlot>,
    },
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    Memset {
        dst: u64,
        value: u32,
        words: usize,
    },
    Host(Arc<HostFn>),
    Child(RawGraph),
}

/// Builds a graph node by node.
///
/// ```no_run
/// # use cudagraph::*;
/// # fn main() -> Result<()> {
/// # let dev = Device::open(0)?;
/// # let stream = dev.new_stream()?;
/// # let m = dev.compile("fb", "extern \"C\" __global__ void fwd(float* d){} extern \"C\" __global__ void bwd(float* d){}")?;
/// # let (fwd, bwd) = (m.function("fwd")?, m.function("bwd")?);
/// let data = stream.alloc_zeroed::<f32>(1024)?;
/// let mut b = GraphBuilder::new(&dev);
/// let f = b.kernel(&fwd, LaunchConfig::linear(1, 1024), args![&data], &[])?;
/// b.kernel(&bwd, LaunchConfig::linear(1, 1024), args![&data], &[f])?; // bwd after fwd
/// let graph = b.build()?;
/// graph.replay(&stream)?;
/// # Ok(()) }
/// ```
pub struct GraphBuilder {
    device: Device,
    nodes: Vec<(Node, Vec<usize>)>,
    held: Vec<Arc<BlockRef>>,
    pinned: Vec<Arc<PinnedAlloc>>,
    extra: Vec<Anchor>,
    pools: Vec<Pool>,
}

impl std::fmt::Debug for GraphBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphBuilder({} nodes)", self.nodes.len())
    }
}

impl GraphBuilder {
    pub fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            nodes: Vec::new(),
            held: Vec::new(),
            pinned: Vec::new(),
            extra: Vec::new(),
            pools: Vec::new(),
        }
    }

    /// Number of nodes added so far.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    fn deps(&self, deps: &[NodeId]) -> Result<Vec<usize>> {
        check_deps(self.nodes.len(), deps)
    }

    fn push(&mut self, node: Node, deps: Vec<usize>) -> NodeId {
        self.nodes.push((node, deps));
        NodeId(self.nodes.len() - 1)
    }

    /// Adds a kernel launch that runs after `deps`.
    pub fn kernel(
        &mut self,
        f: &Function,
        cfg: LaunchConfig,
        args: &[Arg<'_>],
        deps: &[NodeId],
    ) -> Result<NodeId> {
        let deps = self.deps(deps)?;
        let dims = f.check(cfg)?;
        if cfg.grid.0 > self.device.info().max_grid_x {
            return Err(Error::InvalidLaunch {
                kernel: f.name().to_string(),
                problem: format!(
                    "grid x {} exceeds the device limit {}",
                    cfg.grid.0,
                    self.device.info().max_grid_x
                ),
            });
        }
        for a in args {
            if let Arg::Ptr {
                holder: Some(b), ..
            } = a
            {
                check_device(&self.device, b)?;
                self.held.push((*b).clone());
            }
        }
        let params = args.iter().map(Arg::slot).collect();
        Ok(self.push(
            Node::Kernel {
                f: f.clone(),
                dims,
                params,
            },
            deps,
        ))
    }

    /// Adds a device-to-device copy of all of `src` into `dst` (equal lengths).
    pub fn copy<T: Elem>(
        &mut self,
        src: &DeviceBuffer<T>,
        dst: &DeviceBuffer<T>,
        deps: &[NodeId],
    ) -> Result<NodeId> {
        let deps = self.deps(deps)?;
        if src.len() != dst.len() {
            return Err(Error::SizeMismatch {
                what: "copy node",
                expected: dst.len(),
                got: src.len(),
            });
        }
        check_device(&self.device, src.block())?;
        check_device(&self.device, dst.block())?;
        self.held.push(src.block().clone());
        self.held.push(dst.block().clone());
        Ok(self.push(
            Node::Copy {
                dst: dst.addr(),
                src: src.addr(),
                bytes: src.bytes(),
            },
            deps,
        ))
    }

    /// Adds a node setting `len` 32-bit elements of `dst` from `offset` to `value`.
    pub fn fill32<T: Elem>(
        &mut self,
        dst: &DeviceBuffer<T>,
        offset: usize,
        len: usize,
        value: T,
        deps: &[NodeId],
    ) -> Result<NodeId> {
        let deps = self.deps(deps)?;
        if std::mem::size_of::<T>() != 4 {
            return Err(Error::SizeMismatch {
                what: "fill32 element size",
                expected: 4,
                got: std::mem::size_of::<T>(),
            });
        }
        check_range("fill node", offset, len, dst.len())?;
        check_device(&self.device, dst.block())?;
        self.held.push(dst.block().clone());
        let b = T::as_bytes(std::slice::from_ref(&value));
        Ok(self.push(
            Node::Memset {
                dst: dst.addr() + (offset * 4) as u64,
                value: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                words: len,
            },
            deps,
        ))
    }

    /// Adds a node that calls `f` on a driver thread when the graph reaches it. `f` must not
    /// call CUDA (the driver forbids it in host nodes); a panic in `f` is caught and reported.
    pub fn host_fn(
        &mut self,
        f: impl Fn() + Send + Sync + 'static,
        deps: &[NodeId],
    ) -> Result<NodeId> {
        let deps = self.deps(deps)?;
        let f = Arc::new(HostFn(Box::new(f)));
        self.extra.push(f.clone());
        Ok(self.push(Node::Host(f), deps))
    }

    /// Embeds a copy of `child` (captured or built) as one node. The parent keeps everything
    /// the child uses alive (buffers, pool, host callbacks).
    pub fn child(&mut self, child: &Graph, deps: &[NodeId]) -> Result<NodeId> {
        let deps = self.deps(deps)?;
        if child.device().ordinal() != self.device.ordinal() {
            return Err(Error::WrongDevice {
                what: "child graph",
                expected: self.device.ordinal(),
                got: child.device().ordinal(),
            });
        }
        let keep = child.keepalive();
        self.held.extend(keep.held);
        self.pinned.extend(keep.pinned);
        self.extra.extend(keep.extra);
        self.pools.extend(keep.pool);
        Ok(self.push(Node::Child(child.raw_graph()), deps))
    }

    /// Creates the CUDA graph, adds every node with its edges, and instantiates it.
    #[track_caller]
    pub fn build(mut self) -> Result<Graph> {
        if self.nodes.is_empty() {
            return Err(Error::InvalidGraph {
                problem: "a graph needs at least one node".into(),
            });
        }
        self.device.context().bind()?;
        let t0 = std::time::Instant::now();
        let g = driver::graph_create()?;
        let guard = DestroyOnError(Some(g));
        let ctx = self.device.context().handle.raw;
        let mut raw: Vec<RawNode> = Vec::with_capacity(self.nodes.len());
        for (node, deps) in &self.nodes {
            let d: Vec<RawNode> = deps.iter().map(|&i| raw[i]).collect();
            let n = match node {
                Node::Kernel { f, dims, params } => {
                    driver::graph_add_kernel_node(g, &d, f.raw, *dims, params)?
                }
                Node::Copy { dst, src, bytes } => {
                    driver::graph_add_memcpy_dtod_node(g, &d, *dst, *src, *bytes, ctx)?
                }
                Node::Memset { dst, value, words } => {
                    driver::graph_add_memset_node(g, &d, *dst, *value, *words, ctx)?
                }
                Node::Host(f) => driver::graph_add_host_node(g, &d, f)?,
                Node::Child(c) => driver::graph_add_child_node(g, &d, *c)?,
            };
            raw.push(n);
        }
        let g = guard.defuse();
        self.held.sort_by_key(|b| b.addr());
        self.held.dedup_by_key(|b| b.addr());
        let memory = GraphMemory {
            external_held: self.held.iter().map(|b| b.size()).sum(),
            ..Default::default()
        };
        let mut graph = Graph::instantiate(
            &self.device,
            g,
            None,
            std::mem::take(&mut self.held),
            std::mem::take(&mut self.pinned),
            t0.elapsed(),
            memory,
        )?;
        for x in self.extra.drain(..) {
            graph.keep(x);
        }
        for p in self.pools.drain(..) {
            graph.keep(Arc::new(p.pin()));
        }
        Ok(graph)
    }
}

/// Validates dependencies of a node about to become node number `existing`: each must name an
/// earlier node (so built graphs are acyclic by construction), and none may repeat.
pub(crate) fn check_deps(existing: usize, deps: &[NodeId]) -> Result<Vec<usize>> {
    let mut out = Vec::with_capacity(deps.len());
    for d in deps {
        if d.0 >= existing {
            return Err(Error::InvalidGraph {
                problem: format!(
                    "dependency on node {} but the builder has {existing} nodes",
                    d.0
                ),
            });
        }
        if out.contains(&d.0) {
            return Err(Error::InvalidGraph {
                problem: format!("node {} is listed twice as a dependency", d.0),
            });
        }
        out.push(d.0);
    }
    Ok(out)
}

struct DestroyOnError(Option<RawGraph>);

impl DestroyOnError {
    fn defuse(mut self) -> RawGraph {
        self.0.take().expect("set at creation")
    }
}

impl Drop for DestroyOnError {
    fn drop(&mut self) {
        if let Some(g) = self.0.take() {
            driver::graph_destroy(g);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dependencies_must_name_earlier_nodes_once() {
        assert_eq!(check_deps(3, &[NodeId(0), NodeId(2)]).unwrap(), vec![0, 2]);
        assert!(check_deps(0, &[]).unwrap().is_empty());
        // A node cannot depend on itself or a later node: no cycle can be expressed.
        assert!(matches!(
            check_deps(2, &[NodeId(2)]),
            Err(Error::InvalidGraph { .. })
        ));
        assert!(matches!(
            check_deps(2, &[NodeId(7)]),
            Err(Error::InvalidGraph { .. })
        ));
        let e = check_deps(4, &[NodeId(1), NodeId(1)]).unwrap_err();
        assert!(e.to_string().contains("listed twice"), "{e}");
    }
}
