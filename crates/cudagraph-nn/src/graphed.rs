//! [`GraphedModule`]: PyTorch's `make_graphed_callables` for a module. Its forward pass and its
//! backward pass are each captured once (after warm-up on a side stream) into graphs that share
//! one pool; calling it from eager code copies the input into the static input, replays the
//! forward graph, and returns an output that takes part in eager autograd: its backward copies
//! the incoming gradient into the static gradient, replays the backward graph, and hands the
//! input and parameter gradients back to the eager engine (which accumulates them as usual).
//!
//! Contract (as in PyTorch): the module runs at one fixed input shape; forward and backward
//! calls alternate (each forward's backward runs before the next forward's replay overwrites
//! the saved activations); backward runs on an eager stream.

use std::sync::Arc;

use cudagraph::{CaptureOptions, Graph, Queue, QueueExt, Stream};

use crate::error::{NnError, Result};
use crate::layers::Module;
use crate::tensor::{Node, Parameter, Tensor};

/// A module whose forward and backward passes each replay as one graph.
pub struct GraphedModule<M: Module> {
    module: M,
    fwd: Graph,
    bwd: Arc<Graph>,
    input: Parameter,
    output: Tensor,
    grad_output: Arc<cudagraph::DeviceBuffer<f32>>,
    input_grad: Arc<cudagraph::DeviceBuffer<f32>>,
    param_grads: Vec<Arc<cudagraph::DeviceBuffer<f32>>>,
}

impl<M: Module> GraphedModule<M> {
    /// Warms `module` up `warmup` times on a side stream at `input_shape`, then captures its
    /// forward and backward passes on `stream`.
    pub fn new(
        stream: &mut Stream,
        module: M,
        input_shape: &[usize],
        warmup: usize,
    ) -> Result<Self> {
        let dev = Queue::device(stream).clone();
        let n: usize = input_shape.iter().product();
        let static_in = Arc::new(stream.alloc_zeroed::<f32>(n)?);
        let input = Parameter::from_buffer("graphed input", static_in, input_shape)?;
        let params = module.parameters();
        // Warm-up on a side stream: lazy initialisation happens outside the capture.
        let side = dev.new_stream()?;
        cudagraph::warmup(stream, &side, warmup, |q| {
            let y = module.forward(q, &input.tensor())?;
            let g = Tensor::full(q, y.shape(), 1.0)?;
            y.backward_with(q, g)?;
            Ok(())
        })?;
        for p in params.iter().chain(std::iter::once(&input)) {
            p.zero_grad(stream, true)?;
        }
        let pool = dev.graph_pool_handle();
        // Forward graph: records autograd nodes whose saved activations live in the pool.
        let (fwd, output) = Graph::capture(stream, CaptureOptions::new().pool(&pool), |cs| {
            Ok(module.forward(cs, &input.tensor())?)
        })?;
        let grad_output = Arc::new(stream.alloc_zeroed::<f32>(output.numel())?);
        // Backward graph, same pool, captured (and always replayed) after the forward graph.
        let go = Tensor::from_buffer(grad_output.clone(), output.shape())?;
        let (bwd, ()) = Graph::capture(stream, CaptureOptions::new().pool(&pool), |cs| {
            Ok(output.backward_with(cs, go)?)
        })?;
        let take = |p: &Parameter| -> Result<Arc<cudagraph::DeviceBuffer<f32>>> {
            let g = p.grad().ok_or_else(|| {
                NnError::Shape(format!(
                    "{} got no gradient in the captured backward pass",
                    p.name()
                ))
            })?;
            p.zero_grad(stream, true)?;
            Ok(g)
        };
        let input_grad = take(&input)?;
        let param_grads = params.iter().map(take).collect::<Result<Vec<_>>>()?;
        // The output the caller sees is detached from the captured autograd nodes.
        let output = Tensor::from_buffer(output.data_arc().clone(), output.shape())?;
        Ok(Self {
            module,
            fwd,
            bwd: Arc::new(bwd),
            input,
            output,
            grad_output,
            input_grad,
            param_grads,
        })
    }

    pub fn module(&self) -> &M {
        &self.module
    }

    /// The forward and backward graphs.
    pub fn graphs(&self) -> (&Graph, &Graph) {
        (&self.fwd, self.bwd.as_ref())
    }

    /// Runs the module on `x` (the captured shape) by replaying the forward graph; the result
    /// flows back through the backward graph when eager autograd reaches it.
    pub fn forward(&self, s: &Stream, x: &Tensor) -> Result<Tensor> {
        if x.shape() != self.input.shape() {
            return Err(NnError::Shape(format!(
                "graphed module captured for input {:?}, called with {:?}",
                self.input.shape(),
                x.shape()
            )));
        }
        QueueExt::copy(s, x.data(), self.input.data())?;
        self.fwd.replay(s)?;
        let out = s.alloc::<f32>(self.output.numel())?;
        QueueExt::copy(s, self.output.data(), &out)?;
        let params = self.module.parameters();
        let mut inputs = vec![x.clone()];
        inputs.extend(params.iter().map(Parameter::tensor));
        let bwd = self.bwd.clone();
        let (gout, gin) = (self.grad_output.clone(), self.input_grad.clone());
        let pgrads = self.param_grads.clone();
        let shapes: Vec<Vec<usize>> = params.iter().map(|p| p.shape().to_vec()).collect();
        let x_shape = x.shape().to_vec();
        let node = Node {
            unit_backward: None,
            inputs,
            name: "graphed_module",
            backward: Box::new(move |q: &dyn Queue, _nn, g| {
                q.copy(g.data(), &gout)?;
                bwd.replay_on(q.stream_handle())?;
                let copy =
                    |src: &cudagraph::DeviceBuffer<f32>, shape: &[usize]| -> Result<Tensor> {
                        let b = q.alloc::<f32>(src.len())?;
                        q.copy(src, &b)?;
                        Tensor::from_buffer(Arc::new(b), shape)
                    };
                let mut grads = vec![Some(copy(&gin, &x_shape)?)];
                for (pg, shape) in pgrads.iter().zip(&shapes) {
                    grads.push(Some(copy(pg, shape)?));
                }
                Ok(grads)
            }),
        };
        Ok(Tensor::from_op(
            out,
            self.output.shape().to_vec(),
            Some(node),
        ))
    }
}
