//! Tensors (f32, bf16 or f16; contiguous, row-major) and reverse-mode autograd.
//!
//! Every operation that has an input needing a gradient records a node (its inputs and a
//! backward closure) on its output, as PyTorch does. [`Tensor::backward`] walks the nodes from a
//! scalar loss in reverse topological order and frees them as it goes. Gradients of parameters
//! follow PyTorch's `zero_grad(set_to_none=True)`: a parameter whose gradient is "none" adopts
//! the first gradient computed for it (no copy, no memset); later ones are added in place. So a
//! captured training step needs no gradient reset kernel at all, and replays stay correct.
//!
//! Only a buffer autograd made for a gradient, and holds the only handle to, is ever adopted or
//! written in place (`Tensor::gradient`); anything else — the tensor a caller passes to
//! [`Tensor::backward_with`], a view or alias of it — is copied first, so accumulation and
//! `zero_grad` never write memory the caller can still see.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use cudagraph::{DeviceBuffer, Queue, QueueExt, Stream};

use crate::dtype::{Dtype, Float, TypedBuffer};
use crate::error::{NnError, Result};
use crate::kernels::lowp::LowpKernels;
use crate::kernels::Nn;

thread_local! {
    static GRAD_ENABLED: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

/// Runs `f` without recording autograd nodes (PyTorch's `torch.no_grad()`): inference keeps no
/// activations alive, so a captured forward pass frees its temporaries inside the capture.
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let prev = GRAD_ENABLED.with(|g| g.replace(false));
    let r = f();
    GRAD_ENABLED.with(|g| g.set(prev));
    r
}

/// Whether operations currently record autograd nodes.
pub fn grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// A hook called when a parameter's gradient is complete (see [`Tensor::backward_with_hook`]).
pub type GradHook<'a> = dyn FnMut(&dyn Queue, &Parameter) -> Result<()> + 'a;

type BackwardFn =
    Box<dyn Fn(&dyn Queue, &Nn, &Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// A node's input gradients when its upstream gradient is exactly one (the scalar that
/// [`Tensor::backward`] starts from): a loss that saved its unit gradient in the forward pass
/// hands it on as it is, with no seed to fill and no scaling kernel — two graph nodes fewer
/// per training step, and the same bits (`x · 1.0 = x`).
pub(crate) type UnitBackwardFn =
    Box<dyn Fn(&dyn Queue, &Nn) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// Locks a mutex, recovering the data if a panic poisoned it (autograd state stays usable).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How a tensor was computed: its inputs and how to turn its gradient into theirs.
pub(crate) struct Node {
    pub(crate) inputs: Vec<Tensor>,
    pub(crate) backward: BackwardFn,
    /// The input gradients for an upstream gradient of exactly one, where the node can give
    /// them without that gradient (see [`UnitBackwardFn`]).
    pub(crate) unit_backward: Option<UnitBackwardFn>,
    pub(crate) name: &'static str,
}

struct Inner {
    data: TypedBuffer,
    shape: Vec<usize>,
    requires_grad: bool,
    node: Mutex<Option<Node>>,
    param: Option<Parameter>,
    /// Made by autograd for a gradient (see [`Tensor::gradient`]): nothing outside autograd
    /// has a handle to the memory other than through this tensor's `Arc`s.
    autograd_owned: bool,
}

/// A device tensor. Cloning shares the data (like a PyTorch tensor handle). `Send + Sync`: a
/// model's tensors can move to another thread (work is ordered by the queue it runs on).
#[derive(Clone)]
pub struct Tensor(Arc<Inner>);

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = lock(&self.0.node).as_ref().map(|n| n.name);
        write!(
            f,
            "Tensor{:?}{}{}{}",
            self.0.shape,
            match self.dtype() {
                Dtype::F32 => String::new(),
                d => format!(" {d}"),
            },
            if self.0.requires_grad {
                " requires_grad"
            } else {
                ""
            },
            op.map(|o| format!(" grad_fn={o}")).unwrap_or_default()
        )
    }
}

/// Elements of a shape (saturating: an impossible shape never matches a real buffer).
pub(crate) fn numel(shape: &[usize]) -> usize {
    shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .unwrap_or(usize::MAX)
}

/// Elements of a shape, or a shape error when the product overflows.
pub(crate) fn numel_checked(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| NnError::Shape(format!("shape {shape:?} has too many elements")))
}

impl Tensor {
    /// Wraps a device buffer (no gradient). The buffer's length must match the shape.
    pub fn from_buffer(data: Arc<DeviceBuffer<f32>>, shape: &[usize]) -> Result<Self> {
        Self::from_typed(TypedBuffer::F32(data), shape)
    }

    /// Wraps a device buffer of any element type (no gradient). The buffer's length must
    /// match the shape.
    pub fn from_typed(data: TypedBuffer, shape: &[usize]) -> Result<Self> {
        if data.len() != numel(shape) {
            return Err(NnError::Shape(format!(
                "a buffer of {} elements cannot have shape {shape:?}",
                data.len()
            )));
        }
        Ok(Self::leaf(data, shape.to_vec(), false, None))
    }

    fn leaf(
        data: TypedBuffer,
        shape: Vec<usize>,
        requires_grad: bool,
        param: Option<Parameter>,
    ) -> Self {
        Tensor(Arc::new(Inner {
            data,
            shape,
            requires_grad,
            node: Mutex::new(None),
            param,
            autograd_owned: false,
        }))
    }

    /// A gradient autograd computed into `data`, a buffer it has just allocated (a node's
    /// backward output): autograd may adopt it as a parameter's gradient or add into it in
    /// place, once this tensor is the only handle to it. Only for buffers nothing outside
    /// autograd can reach (no alias, no prefix, no `Arc` handed out).
    pub(crate) fn gradient(data: DeviceBuffer<f32>, shape: &[usize]) -> Result<Self> {
        Self::gradient_shared(Arc::new(data), shape)
    }

    /// As [`Self::gradient`], for a buffer autograd also keeps elsewhere for now (a loss's
    /// saved gradient, held by its node until the node is freed): adoption waits until every
    /// other `Arc` is gone, and copies otherwise.
    pub(crate) fn gradient_shared(data: Arc<DeviceBuffer<f32>>, shape: &[usize]) -> Result<Self> {
        Self::gradient_typed(TypedBuffer::F32(data), shape)
    }

    /// As [`Self::gradient_shared`], for a buffer of any element type.
    pub(crate) fn gradient_typed(data: TypedBuffer, shape: &[usize]) -> Result<Self> {
        if data.len() != numel(shape) {
            return Err(NnError::Shape(format!(
                "a gradient of {} elements cannot have shape {shape:?}",
                data.len()
            )));
        }
        Ok(Tensor(Arc::new(Inner {
            data,
            shape: shape.to_vec(),
            requires_grad: false,
            node: Mutex::new(None),
            param: None,
            autograd_owned: true,
        })))
    }

    /// A gradient of ones (the implicit upstream gradient of a non-loss root), made by
    /// autograd.
    fn ones_gradient(q: &dyn Queue, shape: &[usize], dtype: Dtype) -> Result<Self> {
        let b = q.alloc::<f32>(numel_checked(shape)?)?;
        q.fill32(&b, 0, b.len(), 1.0)?;
        match dtype {
            Dtype::F32 => Self::gradient(b, shape),
            d => Self::gradient_typed(
                crate::kernels::cast::cast_new(q, &TypedBuffer::F32(Arc::new(b)), d)?,
                shape,
            ),
        }
    }

    /// Whether autograd may keep this tensor's buffer as a gradient and write it later: it was
    /// made by autograd ([`Self::gradient`]), no clone of this tensor exists, and no other
    /// handle holds its buffer. A caller's tensor never qualifies, whatever its handle
    /// counts: `DeviceBuffer::alias` and raw addresses share memory without sharing the `Arc`.
    fn adoptable(&mut self) -> bool {
        self.0.autograd_owned
            && Arc::get_mut(&mut self.0).is_some_and(|inner| match &mut inner.data {
                TypedBuffer::F32(b) => Arc::get_mut(b).is_some(),
                TypedBuffer::Bf16(b) => Arc::get_mut(b).is_some(),
                TypedBuffer::F16(b) => Arc::get_mut(b).is_some(),
            })
    }

    /// This gradient as a buffer autograd may write: itself when [`Self::adoptable`], else a
    /// copy into a buffer of autograd's own (enqueued on `q`).
    fn into_owned_gradient(mut self, q: &dyn Queue) -> Result<Self> {
        if self.adoptable() {
            return Ok(self);
        }
        fn copy<T: Float>(q: &dyn Queue, b: &DeviceBuffer<T>) -> Result<TypedBuffer> {
            let own = q.alloc::<T>(b.len())?;
            q.copy(b, &own)?;
            Ok(TypedBuffer::new(Arc::new(own)))
        }
        let own = match &self.0.data {
            TypedBuffer::F32(b) => copy(q, b)?,
            TypedBuffer::Bf16(b) => copy(q, b)?,
            TypedBuffer::F16(b) => copy(q, b)?,
        };
        Self::gradient_typed(own, &self.0.shape)
    }

    /// A new tensor computed by an operation; records `node` when any input needs a gradient.
    pub(crate) fn from_op(data: DeviceBuffer<f32>, shape: Vec<usize>, node: Option<Node>) -> Self {
        Self::from_op_shared(Arc::new(data), shape, node)
    }

    /// As [`Self::from_op`], for an output the backward closure also keeps.
    pub(crate) fn from_op_shared(
        data: Arc<DeviceBuffer<f32>>,
        shape: Vec<usize>,
        node: Option<Node>,
    ) -> Self {
        Self::from_op_typed(TypedBuffer::F32(data), shape, node)
    }

    /// As [`Self::from_op_shared`], for an output of any element type.
    pub(crate) fn from_op_typed(data: TypedBuffer, shape: Vec<usize>, node: Option<Node>) -> Self {
        let node = node.filter(|n| grad_enabled() && n.inputs.iter().any(|t| t.requires_grad()));
        Tensor(Arc::new(Inner {
            data,
            requires_grad: node.is_some(),
            shape,
            node: Mutex::new(node),
            param: None,
            autograd_owned: false,
        }))
    }

    /// Same data, another shape (a view; gradients flow through unchanged). A view of a
    /// gradient autograd made is still autograd's (it is adoptable only once the original is
    /// gone, see `Tensor::adoptable`).
    pub fn reshape(&self, shape: &[usize]) -> Result<Self> {
        if numel(shape) != self.numel() {
            return Err(NnError::Shape(format!(
                "cannot reshape {:?} into {shape:?}",
                self.0.shape
            )));
        }
        let node = Node {
            inputs: vec![self.clone()],
            name: "reshape",
            backward: {
                let shape = self.0.shape.clone();
                Box::new(move |_q, _nn, g| Ok(vec![Some(g.reshape(&shape)?)]))
            },
            unit_backward: None,
        };
        let node = Some(node).filter(|_| grad_enabled() && self.requires_grad());
        Ok(Tensor(Arc::new(Inner {
            data: self.0.data.clone(),
            shape: shape.to_vec(),
            requires_grad: node.is_some(),
            node: Mutex::new(node),
            param: None,
            autograd_owned: self.0.autograd_owned,
        })))
    }

    /// Copies host data into a new tensor (eager).
    pub fn from_host(s: &Stream, data: &[f32], shape: &[usize]) -> Result<Self> {
        Self::from_host_as(s, data, shape)
    }

    /// Copies host data of any element type (`f32`, `half::bf16`, `half::f16`) into a new
    /// tensor of that type (eager).
    pub fn from_host_as<T: Float>(s: &Stream, data: &[T], shape: &[usize]) -> Result<Self> {
        let buf = s.alloc_from_host(data)?;
        Self::from_typed(TypedBuffer::new(Arc::new(buf)), shape)
    }

    /// A zero-filled tensor.
    pub fn zeros(q: &dyn Queue, shape: &[usize]) -> Result<Self> {
        let b = q.alloc_zeroed::<f32>(numel_checked(shape)?)?;
        Self::from_buffer(Arc::new(b), shape)
    }

    /// A tensor filled with `v`.
    pub fn full(q: &dyn Queue, shape: &[usize], v: f32) -> Result<Self> {
        let b = q.alloc::<f32>(numel_checked(shape)?)?;
        q.fill32(&b, 0, b.len(), v)?;
        Self::from_buffer(Arc::new(b), shape)
    }

    /// The dimensions, outermost first (row-major).
    pub fn shape(&self) -> &[usize] {
        &self.0.shape
    }

    /// Number of elements, the product of the shape.
    pub fn numel(&self) -> usize {
        numel(&self.0.shape)
    }

    /// The parameter this tensor is a leaf of ([`Parameter::tensor`]), if any.
    pub fn param(&self) -> Option<&Parameter> {
        self.0.param.as_ref()
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        self.0.data.dtype()
    }

    /// The values on the device, row-major, of an f32 tensor (`NnError::Dtype` for another
    /// element type: see [`Self::data_as`]).
    pub fn data(&self) -> Result<&DeviceBuffer<f32>> {
        Ok(self.data_as::<f32>()?)
    }

    /// The values' buffer of an f32 tensor as the shared handle the tensor holds.
    pub fn data_arc(&self) -> Result<&Arc<DeviceBuffer<f32>>> {
        self.data_as::<f32>()
    }

    /// The values' buffer as one of `T`; `NnError::Dtype` when the tensor holds another type.
    pub fn data_as<T: Float>(&self) -> Result<&Arc<DeviceBuffer<T>>> {
        self.0.data.get::<T>().ok_or(NnError::Dtype {
            what: "tensor",
            expected: T::DTYPE.name(),
            found: self.dtype().name(),
        })
    }

    /// The values' buffer, whatever its element type.
    pub fn buffer(&self) -> &TypedBuffer {
        &self.0.data
    }

    /// Whether gradients flow back through this tensor (a parameter, or computed from one while
    /// gradients were enabled).
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad
    }

    /// Waits for the stream and returns the values as f32 (exact for every element type).
    pub fn to_vec(&self, s: &Stream) -> Result<Vec<f32>> {
        Ok(match &self.0.data {
            TypedBuffer::F32(b) => s.to_vec(b)?,
            TypedBuffer::Bf16(b) => s.to_vec(b)?.into_iter().map(|v| v.to_f32()).collect(),
            TypedBuffer::F16(b) => s.to_vec(b)?.into_iter().map(|v| v.to_f32()).collect(),
        })
    }

    fn key(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }

    /// Reverse-mode autograd from this scalar: fills the gradients of every parameter it
    /// depends on, and frees the recorded graph (activations go back to the pool).
    ///
    /// The upstream gradient is one. Losses hand on the gradient they saved in the forward
    /// pass as it is (no seed tensor is filled, nothing is scaled); any other root gets a
    /// seed of ones, as with `backward_with(q, ones)`. The gradients are the same bits either
    /// way. A second backward through a freed graph is `NnError::OutOfOrder` (see
    /// [`Self::backward_with`]).
    pub fn backward(&self, q: &dyn Queue) -> Result<()> {
        self.run_backward(q, None, None)
    }

    /// [`Self::backward`] that calls `hook` as [`Self::backward_with_hook`] does.
    pub(crate) fn backward_unit_with_hook(
        &self,
        q: &dyn Queue,
        hook: &mut GradHook<'_>,
    ) -> Result<()> {
        self.run_backward(q, None, Some(hook))
    }

    /// Reverse-mode autograd from this tensor with upstream gradient `grad` (same shape), as
    /// PyTorch's `y.backward(grad)`. `grad` is only read: where it would become a parameter's
    /// gradient as it is (this tensor is a parameter, or a view of one), the parameter gets a
    /// copy, so later accumulation and `zero_grad` never write the caller's memory.
    ///
    /// `NnError::OutOfOrder` (nothing enqueued) when the graph reaches a tensor whose node an
    /// earlier backward already freed, as PyTorch refuses a second backward without
    /// `retain_graph`.
    pub fn backward_with(&self, q: &dyn Queue, grad: Tensor) -> Result<()> {
        self.run_backward(q, Some(grad), None)
    }

    /// [`Self::backward_with`] that calls `hook(q, p)` as soon as parameter `p`'s gradient for
    /// this pass is complete — after the last operation that contributes to it, while the
    /// rest of the backward pass is still being enqueued — like PyTorch's post-accumulate-grad
    /// hooks. Data-parallel training uses it to start reducing gradients early. The hook runs
    /// once per parameter that receives a gradient (also when the parameter is used several
    /// times in the forward pass); parameters that receive none are not reported.
    pub fn backward_with_hook(
        &self,
        q: &dyn Queue,
        grad: Tensor,
        hook: &mut GradHook<'_>,
    ) -> Result<()> {
        self.run_backward(q, Some(grad), Some(hook))
    }

    /// Backward from this tensor with upstream gradient `grad`, or exactly one (`None`: only for
    /// a scalar, else `NnError::NotScalar`; nodes with a unit path take it, anything else gets
    /// a seed of ones).
    fn run_backward(
        &self,
        q: &dyn Queue,
        grad: Option<Tensor>,
        mut hook: Option<&mut GradHook<'_>>,
    ) -> Result<()> {
        match &grad {
            None if self.numel() != 1 => return Err(NnError::NotScalar(self.0.shape.clone())),
            Some(grad) if grad.numel() != self.numel() => {
                return Err(NnError::Shape(format!(
                    "backward_with: gradient {:?} for a tensor {:?}",
                    grad.shape(),
                    self.shape()
                )));
            }
            _ => {}
        }
        let order = self.topological_order()?;
        let nn = Nn::get(q.device())?;
        // With a hook, parameter leaves are accumulated as soon as every operation that uses
        // them has run (the depth-first order alone would leave them all to the end).
        let mut early = hook.as_ref().map(|_| EarlyLeaves::new(&order));
        let mut grads: HashMap<usize, Tensor> = HashMap::new();
        let unit_root = grad.is_none();
        if let Some(grad) = grad {
            grads.insert(self.key(), grad);
        }
        for t in order.iter().rev() {
            if let Some(e) = &early {
                if e.done.contains(&t.key()) {
                    continue;
                }
            }
            // `None`: the root's upstream gradient of exactly one, not materialised (the root
            // comes once in `order`).
            let g = match grads.remove(&t.key()) {
                Some(g) => Some(g),
                None if unit_root && t.key() == self.key() => None,
                None => {
                    if let Some(e) = &mut early {
                        // No gradient flows through `t`: its inputs get nothing from it.
                        let ready = match lock(&t.0.node).as_ref() {
                            Some(n) => e.consumed(&n.inputs),
                            None => Vec::new(),
                        };
                        e.finish_and_report(q, t, &mut hook)?;
                        e.flush(q, &nn, ready, &mut grads, &mut hook)?;
                    }
                    continue;
                }
            };
            if let Some(p) = &t.0.param {
                let g = match g {
                    Some(g) => g,
                    None => Tensor::ones_gradient(q, t.shape(), t.dtype())?,
                };
                p.accumulate(q, &nn, g)?;
                if let Some(e) = &mut early {
                    e.received.insert(p.key());
                    e.finish_and_report(q, t, &mut hook)?;
                }
                continue;
            }
            let node = lock(&t.0.node).take();
            let Some(node) = node else { continue };
            let input_grads = match (&g, &node.unit_backward) {
                (Some(g), _) => (node.backward)(q, &nn, g)?,
                (None, Some(unit)) => unit(q, &nn)?,
                (None, None) => {
                    (node.backward)(q, &nn, &Tensor::ones_gradient(q, t.shape(), t.dtype())?)?
                }
            };
            for (inp, ig) in node.inputs.iter().zip(input_grads) {
                let Some(ig) = ig else { continue };
                if !inp.requires_grad() {
                    continue;
                }
                // The first gradient is kept as it is (only read from then on); adding a second
                // one writes the first in place, so that must be a buffer of autograd's own.
                let acc = match grads.remove(&inp.key()) {
                    Some(acc) => {
                        let acc = acc.into_owned_gradient(q)?;
                        add_into(q, &nn, acc.buffer(), ig.buffer())?;
                        acc
                    }
                    None => ig,
                };
                grads.insert(inp.key(), acc);
            }
            if let Some(e) = &mut early {
                let ready = e.consumed(&node.inputs);
                // Release the node and its upstream gradient first, so a leaf can adopt a
                // gradient buffer nothing else refers to (as in the hook-free order).
                drop(node);
                drop(g);
                e.flush(q, &nn, ready, &mut grads, &mut hook)?;
            }
        }
        Ok(())
    }

    /// Every tensor this one depends on through tensors that need a gradient, inputs before
    /// the tensors computed from them (depth-first, iterative: deep models do not overflow).
    ///
    /// A tensor that needs a gradient but has neither a node nor a parameter had its node
    /// freed by an earlier backward: `NnError::OutOfOrder`, before any work is enqueued
    /// (going on would silently give its inputs no gradient).
    fn topological_order(&self) -> Result<Vec<Tensor>> {
        let mut order: Vec<Tensor> = Vec::new();
        let mut seen: HashSet<usize> = HashSet::new();
        let mut stack: Vec<(Tensor, bool)> = vec![(self.clone(), false)];
        while let Some((t, expanded)) = stack.pop() {
            if expanded {
                order.push(t);
                continue;
            }
            if !seen.insert(t.key()) {
                continue;
            }
            stack.push((t.clone(), true));
            match lock(&t.0.node).as_ref() {
                Some(n) => {
                    for i in &n.inputs {
                        if i.requires_grad() && !seen.contains(&i.key()) {
                            stack.push((i.clone(), false));
                        }
                    }
                }
                None if t.requires_grad() && t.0.param.is_none() => {
                    return Err(NnError::OutOfOrder {
                        call: "backward",
                        problem: "it reaches a tensor whose graph an earlier backward already \
                                  ran through and freed, so that part would get no gradient",
                        fix: "run the forward pass again before each backward, or add the \
                              losses up and call backward once",
                    });
                }
                None => {}
            }
        }
        Ok(order)
    }
}

/// Bookkeeping for [`Tensor::backward_with_hook`]: how many uses of each tensor are still to
/// be processed, and how many leaves of each parameter are still open.
struct EarlyLeaves {
    /// Uses (node inputs) of each tensor not processed yet.
    uses: HashMap<usize, usize>,
    /// Leaves of each parameter (keyed by the parameter) not finished yet.
    leaves: HashMap<usize, usize>,
    /// Leaves already handled.
    done: HashSet<usize>,
    /// Parameters that received a gradient in this pass.
    received: HashSet<usize>,
}

impl EarlyLeaves {
    fn new(order: &[Tensor]) -> Self {
        let mut uses: HashMap<usize, usize> = HashMap::new();
        let mut leaves: HashMap<usize, usize> = HashMap::new();
        for t in order {
            if let Some(n) = lock(&t.0.node).as_ref() {
                for i in n.inputs.iter().filter(|i| i.requires_grad()) {
                    *uses.entry(i.key()).or_default() += 1;
                }
            }
            if let Some(p) = &t.0.param {
                *leaves.entry(p.key()).or_default() += 1;
            }
        }
        Self {
            uses,
            leaves,
            done: HashSet::new(),
            received: HashSet::new(),
        }
    }

    /// One use of each of `inputs` has been processed; returns the parameter leaves among
    /// them that have no use left.
    fn consumed(&mut self, inputs: &[Tensor]) -> Vec<Tensor> {
        let mut ready = Vec::new();
        for i in inputs.iter().filter(|i| i.requires_grad()) {
            if let Some(c) = self.uses.get_mut(&i.key()) {
                *c = c.saturating_sub(1);
                if *c == 0 && i.0.param.is_some() && !self.done.contains(&i.key()) {
                    ready.push(i.clone());
                }
            }
        }
        ready
    }

    /// Marks leaf `t` handled; true when it was its parameter's last open leaf.
    fn finish_leaf(&mut self, t: &Tensor) -> bool {
        let Some(p) = &t.0.param else { return false };
        if !self.done.insert(t.key()) {
            return false;
        }
        match self.leaves.get_mut(&p.key()) {
            Some(c) => {
                *c = c.saturating_sub(1);
                *c == 0
            }
            None => false,
        }
    }

    /// Marks leaf `t` handled and reports its parameter if this was its last open leaf and
    /// it received a gradient in this pass.
    fn finish_and_report(
        &mut self,
        q: &dyn Queue,
        t: &Tensor,
        hook: &mut Option<&mut GradHook<'_>>,
    ) -> Result<()> {
        if self.finish_leaf(t) {
            if let (Some(p), Some(h)) = (&t.0.param, hook) {
                if self.received.contains(&p.key()) {
                    h(q, p)?;
                }
            }
        }
        Ok(())
    }

    /// Accumulates the gradients of leaves that became ready and reports each parameter
    /// whose last leaf this was.
    fn flush(
        &mut self,
        q: &dyn Queue,
        nn: &Nn,
        ready: Vec<Tensor>,
        grads: &mut HashMap<usize, Tensor>,
        hook: &mut Option<&mut GradHook<'_>>,
    ) -> Result<()> {
        for leaf in ready {
            let Some(p) = &leaf.0.param else { continue };
            if let Some(g) = grads.remove(&leaf.key()) {
                p.accumulate(q, nn, g)?;
                self.received.insert(p.key());
            }
            self.finish_and_report(q, &leaf, hook)?;
        }
        Ok(())
    }
}

/// `acc += g` for two gradients of one element type (f32 accumulation).
fn add_into(q: &dyn Queue, nn: &Nn, acc: &TypedBuffer, g: &TypedBuffer) -> Result<()> {
    match (acc, g) {
        (TypedBuffer::F32(a), TypedBuffer::F32(b)) => nn.k.add_inplace(q, a, b),
        (TypedBuffer::Bf16(a), TypedBuffer::Bf16(b)) => {
            LowpKernels::get(q.device())?.add_inplace(q, a.as_ref(), b.as_ref())
        }
        (TypedBuffer::F16(a), TypedBuffer::F16(b)) => {
            LowpKernels::get(q.device())?.add_inplace(q, a.as_ref(), b.as_ref())
        }
        (a, b) => Err(NnError::Dtype {
            what: "gradient",
            expected: a.dtype().name(),
            found: b.dtype().name(),
        }),
    }
}

struct ParamInner {
    name: String,
    data: TypedBuffer,
    shape: Vec<usize>,
    /// The gradient, always of the parameter's own element type.
    grad: Mutex<Option<TypedBuffer>>,
}

/// A trainable tensor with a persistent data buffer and a gradient slot.
///
/// Its element type ([`Self::dtype`]) is f32 by default — the masters of mixed precision —
/// or bf16/f16 for pure 16-bit training (PyTorch's `model.to(torch.bfloat16)`): see
/// [`Self::from_host_as`] and [`Self::to_dtype`]. A parameter's gradient always has the
/// parameter's own type.
#[derive(Clone)]
pub struct Parameter(Arc<ParamInner>);

impl fmt::Debug for Parameter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.dtype() {
            Dtype::F32 => write!(f, "Parameter({} {:?})", self.0.name, self.0.shape),
            d => write!(f, "Parameter({} {:?} {d})", self.0.name, self.0.shape),
        }
    }
}

impl Parameter {
    /// An f32 parameter initialised from host values.
    pub fn from_host(s: &Stream, name: &str, data: &[f32], shape: &[usize]) -> Result<Self> {
        Self::from_host_as(s, name, data, shape, Dtype::F32)
    }

    /// A parameter of element type `dtype` initialised from host values, each rounded to the
    /// nearest value of that type (ties to even; past the largest finite value, ±inf).
    pub fn from_host_as(
        s: &Stream,
        name: &str,
        data: &[f32],
        shape: &[usize],
        dtype: Dtype,
    ) -> Result<Self> {
        fn upload<T: Float>(s: &Stream, data: &[f32]) -> Result<TypedBuffer> {
            let v: Vec<T> = data.iter().map(|&x| T::from_f32(x)).collect();
            Ok(TypedBuffer::new(Arc::new(s.alloc_from_host(&v)?)))
        }
        Self::check_len(name, data.len(), shape)?;
        let buf = match dtype {
            Dtype::F32 => TypedBuffer::F32(Arc::new(s.alloc_from_host(data)?)),
            Dtype::Bf16 => upload::<half::bf16>(s, data)?,
            Dtype::F16 => upload::<half::f16>(s, data)?,
        };
        Self::from_typed(name, buf, shape)
    }

    fn check_len(name: &str, len: usize, shape: &[usize]) -> Result<()> {
        if len != numel(shape) {
            return Err(NnError::Shape(format!(
                "parameter {name}: {len} values for shape {shape:?}"
            )));
        }
        Ok(())
    }

    /// The parameter's name, e.g. `weight` or `bias`.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// Identity of the parameter (shared by its clones).
    pub(crate) fn key(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }

    /// Whether `other` is a handle to this same parameter.
    pub fn same_as(&self, other: &Parameter) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The dimensions, outermost first (row-major).
    pub fn shape(&self) -> &[usize] {
        &self.0.shape
    }

    /// Number of elements, the product of the shape.
    pub fn numel(&self) -> usize {
        numel(&self.0.shape)
    }

    /// The element type of the values (and of the gradient).
    pub fn dtype(&self) -> Dtype {
        self.0.data.dtype()
    }

    /// The parameter as a tensor of its own element type that records gradients.
    pub fn tensor(&self) -> Tensor {
        Tensor::leaf(
            self.0.data.clone(),
            self.0.shape.clone(),
            true,
            Some(self.clone()),
        )
    }

    /// The values on the device, row-major, of an f32 parameter (`NnError::Dtype` for a
    /// 16-bit one: see [`Self::data_as`] and [`Self::buffer`]).
    pub fn data(&self) -> Result<&DeviceBuffer<f32>> {
        Ok(self.data_as::<f32>()?)
    }

    /// The values' buffer as one of `T`; `NnError::Dtype` when the parameter holds another
    /// type.
    pub fn data_as<T: Float>(&self) -> Result<&Arc<DeviceBuffer<T>>> {
        self.0.data.get::<T>().ok_or(NnError::Dtype {
            what: "parameter",
            expected: T::DTYPE.name(),
            found: self.dtype().name(),
        })
    }

    /// The values' buffer, whatever its element type.
    pub fn buffer(&self) -> &TypedBuffer {
        &self.0.data
    }

    /// Waits for the stream and returns the values as f32 (exact for every element type).
    pub fn to_vec(&self, s: &Stream) -> Result<Vec<f32>> {
        self.tensor().to_vec(s)
    }

    /// An f32 parameter whose data is `data` (shared, not copied).
    pub fn from_buffer(name: &str, data: Arc<DeviceBuffer<f32>>, shape: &[usize]) -> Result<Self> {
        Self::from_typed(name, TypedBuffer::F32(data), shape)
    }

    /// A parameter of any element type whose data is `data` (shared, not copied).
    pub fn from_typed(name: &str, data: TypedBuffer, shape: &[usize]) -> Result<Self> {
        Self::check_len(name, data.len(), shape)?;
        Ok(Parameter(Arc::new(ParamInner {
            name: name.to_string(),
            data,
            shape: shape.to_vec(),
            grad: Mutex::new(None),
        })))
    }

    /// This parameter with its values converted to `dtype` (rounded to nearest, ties to even;
    /// cast on `q`), as a new parameter of the same name and shape with no gradient —
    /// PyTorch's `param.to(torch.bfloat16)`. The same dtype gives this parameter back (a
    /// handle to it, no copy). Modules convert all their parameters with `to_dtype`
    /// (`Linear`, `Conv2d`, `Sequential`); build the optimizer after converting, since it
    /// keeps the handles it was given.
    pub fn to_dtype(&self, q: &dyn Queue, dtype: Dtype) -> Result<Parameter> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let data = crate::kernels::cast::cast_new(q, &self.0.data, dtype)?;
        Self::from_typed(&self.0.name, data, &self.0.shape)
    }

    /// The current gradient buffer of an f32 parameter (`None` after `zero_grad(true)` until
    /// the next backward); `NnError::Dtype` for a 16-bit parameter (see
    /// [`Self::grad_typed`]).
    pub fn grad(&self) -> Result<Option<Arc<DeviceBuffer<f32>>>> {
        match lock(&self.0.grad).as_ref() {
            None if self.dtype() == Dtype::F32 => Ok(None),
            None => Err(self.grad_dtype_error()),
            Some(TypedBuffer::F32(g)) => Ok(Some(g.clone())),
            Some(_) => Err(self.grad_dtype_error()),
        }
    }

    fn grad_dtype_error(&self) -> NnError {
        NnError::Dtype {
            what: "parameter gradient",
            expected: Dtype::F32.name(),
            found: self.dtype().name(),
        }
    }

    /// The current gradient buffer, of the parameter's own element type (`None` after
    /// `zero_grad(true)` until the next backward).
    pub fn grad_typed(&self) -> Option<TypedBuffer> {
        lock(&self.0.grad).clone()
    }

    /// PyTorch's `zero_grad`: `set_to_none` drops the gradient (the next backward writes it
    /// fresh, with no memset); otherwise it is zeroed in place on `q`.
    pub fn zero_grad(&self, q: &dyn Queue, set_to_none: bool) -> Result<()> {
        let mut slot = lock(&self.0.grad);
        if set_to_none {
            *slot = None;
        } else {
            match slot.as_ref() {
                Some(TypedBuffer::F32(g)) => q.memset_zero(g.as_ref())?,
                Some(TypedBuffer::Bf16(g)) => q.memset_zero(g.as_ref())?,
                Some(TypedBuffer::F16(g)) => q.memset_zero(g.as_ref())?,
                None => {}
            }
        }
        Ok(())
    }

    /// Replaces the gradient buffer of an f32 parameter (`None` clears it, like
    /// `zero_grad(true)`); see [`Self::set_grad_typed`].
    pub fn set_grad(&self, grad: Option<Arc<DeviceBuffer<f32>>>) -> Result<()> {
        self.set_grad_typed(grad.map(TypedBuffer::F32))
    }

    /// Replaces the gradient buffer (`None` clears it, like `zero_grad(true)`). For code that
    /// produces gradients outside autograd (data-parallel reduction of a parameter that got
    /// no gradient locally); the buffer must hold one value per element, of the parameter's
    /// own type (else `NnError::Dtype`). The parameter owns it from then on: backward adds
    /// into it and `zero_grad(false)` zeroes it, in place.
    pub fn set_grad_typed(&self, grad: Option<TypedBuffer>) -> Result<()> {
        if let Some(g) = &grad {
            if g.len() != self.numel() {
                return Err(NnError::Shape(format!(
                    "parameter {}: a gradient of {} values for {} elements",
                    self.0.name,
                    g.len(),
                    self.numel()
                )));
            }
            if g.dtype() != self.dtype() {
                return Err(NnError::Dtype {
                    what: "parameter gradient",
                    expected: self.dtype().name(),
                    found: g.dtype().name(),
                });
            }
        }
        *lock(&self.0.grad) = grad;
        Ok(())
    }

    fn accumulate(&self, q: &dyn Queue, nn: &Nn, g: Tensor) -> Result<()> {
        if g.dtype() != self.dtype() {
            return Err(NnError::Dtype {
                what: "parameter gradient",
                expected: self.dtype().name(),
                found: g.dtype().name(),
            });
        }
        let mut slot = lock(&self.0.grad);
        match slot.as_ref() {
            Some(acc) => add_into(q, nn, acc, g.buffer()),
            None => {
                // Adopt the buffer only if it is autograd's alone; a caller's tensor is copied
                // (accumulation and `zero_grad` write the gradient in place later).
                let own = g.into_owned_gradient(q)?;
                *slot = Some(own.buffer().clone());
                Ok(())
            }
        }
    }
}

/// [`AmpError::LowPrecisionParams`](crate::error::AmpError::LowPrecisionParams) naming the
/// first of `params` stored in 16 bits, if any: for what needs f32 parameters and gradients.
pub(crate) fn require_f32_params(
    params: &[Parameter],
    what: &'static str,
    fix: &'static str,
) -> Result<()> {
    match params.iter().find(|p| p.dtype() != Dtype::F32) {
        None => Ok(()),
        Some(p) => Err(crate::error::AmpError::LowPrecisionParams {
            what,
            param: p.name().to_string(),
            dtype: p.dtype().name(),
            fix,
        }
        .into()),
    }
}

#[cfg(test)]
mod tests {
    //! Host-side autograd bookkeeping (issue 26, item 5): which gradients may be adopted, and
    //! backward through a freed graph. The tensors sit on fake blocks that nothing reads.
    use super::*;
    use cudagraph::BlockRef;

    /// A buffer of `n` elements at a made-up address.
    fn fake(n: usize) -> DeviceBuffer<f32> {
        // SAFETY: no work is ever enqueued on this block and nothing reads or writes its
        // address: these tests only count handles. `keep` holds nothing to release.
        let block = unsafe { BlockRef::external(0x1000, 4 * n, 0, Box::new(())) };
        DeviceBuffer::from_block(block, n).unwrap()
    }

    #[test]
    fn only_a_gradient_autograd_made_and_holds_alone_is_adopted() {
        // A caller's tensor never is, even when it is the only handle: its memory may be
        // shared through `DeviceBuffer::alias` or a raw address, which no count shows.
        let mut caller = Tensor::from_buffer(Arc::new(fake(4)), &[4]).unwrap();
        assert!(!caller.adoptable());
        let mut caller_view = caller.reshape(&[2, 2]).unwrap();
        drop(caller);
        assert!(!caller_view.adoptable());
        let mut aliased =
            Tensor::from_buffer(Arc::new(caller_view.data().unwrap().alias()), &[4]).unwrap();
        assert!(!aliased.adoptable());

        // Autograd's own gradient, held only here: adopted.
        let mut g = Tensor::gradient(fake(4), &[4]).unwrap();
        assert!(g.adoptable());
        // Not while a clone of the tensor is alive.
        let clone = g.clone();
        assert!(!g.adoptable());
        drop(clone);
        assert!(g.adoptable());
        // Not while its buffer has another holder (a loss node's saved gradient).
        let saved = g.data_arc().unwrap().clone();
        assert!(!g.adoptable());
        drop(saved);
        assert!(g.adoptable());
        // A view: not while the original is alive, then yes.
        let mut view = g.reshape(&[2, 2]).unwrap();
        assert!(!view.adoptable());
        drop(g);
        assert!(view.adoptable());
    }

    /// A bf16 buffer of `n` elements at a made-up address (see [`fake`]).
    fn fake_bf16(n: usize) -> DeviceBuffer<half::bf16> {
        // SAFETY: as in `fake`: nothing is enqueued on the block, nothing reads its address.
        let block = unsafe { BlockRef::external(0x2000, 2 * n, 0, Box::new(())) };
        DeviceBuffer::from_block(block, n).unwrap()
    }

    #[test]
    fn a_16_bit_parameter_has_its_own_type_and_refuses_f32_views() {
        let p =
            Parameter::from_typed("w", TypedBuffer::Bf16(Arc::new(fake_bf16(4))), &[2, 2]).unwrap();
        assert_eq!(p.dtype(), Dtype::Bf16);
        assert_eq!(p.tensor().dtype(), Dtype::Bf16);
        assert!(p.data_as::<half::bf16>().is_ok());
        assert!(format!("{p:?}").contains("bf16"), "{p:?}");
        for e in [
            p.data().map(|_| ()).unwrap_err(),
            p.grad().map(|_| ()).unwrap_err(),
            p.set_grad(Some(Arc::new(fake(4)))).unwrap_err(),
        ] {
            assert!(
                matches!(
                    e,
                    NnError::Dtype {
                        expected: "f32",
                        found: "bf16",
                        ..
                    } | NnError::Dtype {
                        expected: "bf16",
                        found: "f32",
                        ..
                    }
                ),
                "{e}"
            );
        }
        assert!(p.grad_typed().is_none());
        p.set_grad_typed(Some(TypedBuffer::Bf16(Arc::new(fake_bf16(4)))))
            .unwrap();
        assert_eq!(p.grad_typed().map(|g| g.dtype()), Some(Dtype::Bf16));
        let e = p
            .set_grad_typed(Some(TypedBuffer::Bf16(Arc::new(fake_bf16(3)))))
            .unwrap_err();
        assert!(matches!(e, NnError::Shape(_)), "{e}");
        let f = Parameter::from_buffer("b", Arc::new(fake(2)), &[2]).unwrap();
        assert_eq!(f.dtype(), Dtype::F32);
        assert!(f.grad().unwrap().is_none());
        let e = require_f32_params(&[f.clone(), p.clone()], "test", "fix").unwrap_err();
        assert!(e.to_string().contains("`w` is bf16"), "{e}");
        require_f32_params(&[f], "test", "fix").unwrap();
    }

    #[test]
    fn a_backward_through_a_freed_graph_is_refused_before_any_work() {
        let p = Parameter::from_buffer("w", Arc::new(fake(4)), &[4]).unwrap();
        let y = Tensor::from_op(
            fake(4),
            vec![4],
            Some(Node {
                inputs: vec![p.tensor()],
                backward: Box::new(|_, _, _| unreachable!("nothing runs here")),
                unit_backward: None,
                name: "test",
            }),
        );
        let z = y.reshape(&[2, 2]).unwrap();
        let order = z.topological_order().unwrap();
        assert_eq!(order.len(), 3);
        assert!(order[0].0.param.is_some(), "inputs come first");
        assert_eq!(order[2].key(), z.key());
        // A backward frees the nodes it runs through.
        lock(&y.0.node).take();
        let e = z.topological_order().unwrap_err();
        assert!(
            matches!(
                e,
                NnError::OutOfOrder {
                    call: "backward",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("earlier backward"), "{e}");
        // A parameter's leaf and a tensor that needs no gradient have no graph to free.
        assert_eq!(p.tensor().topological_order().unwrap().len(), 1);
        let plain = Tensor::from_buffer(Arc::new(fake(1)), &[1]).unwrap();
        assert_eq!(plain.topological_order().unwrap().len(), 1);
    }
}
