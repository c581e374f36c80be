//! Explicit graph building (seed 003): kernel, copy, memset, host-function and child-graph
//! nodes with explicit dependencies, the way raw CUDA's `cudaGraphAddKernelNode` works,
//! validated before the driver sees them.
//!
//! Dependencies can only name nodes added earlier, so a built graph is acyclic by
//! construction; a dependency on a node that does not exist is a typed error.

use std::sync::Arc;

use super::exec::{Graph, GraphMemory};
use super::keep::Keep;
use crate::device::{check_device, check_range, Arg, Device};
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, Elem};
use crate::runtime::graph::{GraphHandle, HostFn};
use crate::runtime::module::{OwnedParam, ParamValue};
use crate::runtime::raw::RawNode;
use crate::runtime::{Function, LaunchConfig};

/// A node added to a [`GraphBuilder`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeId(usize);

enum Node {
    Kernel {
        f: Function,
        cfg: LaunchConfig,
        params: Vec<OwnedParam>,
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
    /// The builder's own copy of the child graph (so the child may be dropped meanwhile).
    Child(GraphHandle),
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
/// // SAFETY: both kernels only touch data[0..1024), one thread per element.
/// let f = unsafe { b.kernel(&fwd, LaunchConfig::linear(1, 1024), args![&data], &[])? };
/// unsafe { b.kernel(&bwd, LaunchConfig::linear(1, 1024), args![&data], &[f])? }; // bwd after fwd
/// let graph = b.build()?;
/// graph.replay(&stream)?;
/// # Ok(()) }
/// ```
pub struct GraphBuilder {
    device: Device,
    nodes: Vec<(Node, Vec<usize>)>,
    keep: Keep,
}

impl std::fmt::Debug for GraphBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphBuilder({} nodes)", self.nodes.len())
    }
}

impl GraphBuilder {
    /// An empty graph for `device`.
    pub fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            nodes: Vec::new(),
            keep: Keep::default(),
        }
    }

    /// Number of nodes added so far.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether no node has been added yet.
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

    /// Adds a kernel launch that runs after `deps`. Arguments are checked against the
    /// kernel's declaration and the shape against its limits, as for [`crate::Queue::launch`].
    ///
    /// # Safety
    /// The contract of [`crate::Queue::launch`]: the kernel touches only memory it reaches
    /// through its pointer arguments, within those buffers, as the scalars describe.
    pub unsafe fn kernel(
        &mut self,
        f: &Function,
        cfg: LaunchConfig,
        args: &[Arg<'_>],
        deps: &[NodeId],
    ) -> Result<NodeId> {
        let deps = self.deps(deps)?;
        if f.ordinal() != self.device.ordinal() {
            return Err(Error::WrongDevice {
                what: "kernel",
                expected: self.device.ordinal(),
                got: f.ordinal(),
            });
        }
        f.check(cfg, self.device.info().max_grid_x)?;
        let values: Vec<ParamValue<'_>> = args.iter().map(Arg::value).collect();
        f.check_args(&values)?;
        let params = values.into_iter().map(ParamValue::to_owned).collect();
        for b in args.iter().filter_map(Arg::holder) {
            check_device(&self.device, b)?;
        }
        for b in args.iter().filter_map(Arg::holder) {
            self.keep.hold(b);
        }
        self.keep.hold_function(f);
        Ok(self.push(
            Node::Kernel {
                f: f.clone(),
                cfg,
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
        self.keep.hold(src.block());
        self.keep.hold(dst.block());
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
        self.keep.hold(dst.block());
        let b = T::as_bytes(std::slice::from_ref(&value));
        Ok(self.push(
            Node::Memset {
                dst: dst.addr_at(offset)?,
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
        self.keep.anchors.push(f.clone());
        Ok(self.push(Node::Host(f), deps))
    }

    /// Embeds a copy of `child` (captured or built) as one node. The builder takes its own copy
    /// of the child's graph now, and the parent keeps everything the child uses alive (buffers,
    /// pool, kernels, host callbacks), so `child` may be dropped before [`Self::build`].
    pub fn child(&mut self, child: &Graph, deps: &[NodeId]) -> Result<NodeId> {
        let deps = self.deps(deps)?;
        if child.device().ordinal() != self.device.ordinal() {
            return Err(Error::WrongDevice {
                what: "child graph",
                expected: self.device.ordinal(),
                got: child.device().ordinal(),
            });
        }
        let (copy, keep) = child.share_for_child()?;
        self.keep.merge(keep);
        Ok(self.push(Node::Child(copy), deps))
    }

    /// Creates the CUDA graph, adds every node with its edges, and instantiates it.
    #[track_caller]
    pub fn build(self) -> Result<Graph> {
        if self.nodes.is_empty() {
            return Err(Error::InvalidGraph {
                problem: "a graph needs at least one node".into(),
            });
        }
        let t0 = std::time::Instant::now();
        let g = GraphHandle::new(self.device.context())?;
        let mut raw: Vec<RawNode> = Vec::with_capacity(self.nodes.len());
        for (node, deps) in &self.nodes {
            let d: Vec<RawNode> = deps.iter().map(|&i| raw[i]).collect();
            let n = match node {
                Node::Kernel { f, cfg, params } => {
                    let dims = f.check(*cfg, self.device.info().max_grid_x)?;
                    // SAFETY: checked against `f` in `kernel`, whose caller promised the memory
                    // contract; the graph holds every buffer and the module.
                    let values: Vec<ParamValue<'_>> =
                        params.iter().map(OwnedParam::as_value).collect();
                    unsafe { g.add_kernel(&d, f, dims, &values)? }
                }
                Node::Copy { dst, src, bytes } => g.add_memcpy_dtod(&d, *dst, *src, *bytes)?,
                Node::Memset { dst, value, words } => g.add_memset32(&d, *dst, *value, *words)?,
                // SAFETY: the callback is in `keep.anchors`, which the graph releases only
                // after its last replay has finished.
                Node::Host(f) => unsafe { g.add_host(&d, f)? },
                Node::Child(c) => g.add_child(&d, c)?,
            };
            raw.push(n);
        }
        let types = g.node_types()?;
        let memory = GraphMemory {
            external_held: self.keep.held.iter().map(|b| b.size()).sum(),
            ..Default::default()
        };
        Graph::instantiate(
            &self.device,
            g,
            types,
            None,
            self.keep,
            t0.elapsed(),
            memory,
        )
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
