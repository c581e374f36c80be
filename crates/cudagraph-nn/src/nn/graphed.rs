//! [`GraphedModule`]: PyTorch's `make_graphed_callables` for a module. Its forward pass and its
//! backward pass are each captured once (after warm-up on a side stream) into graphs that share
//! one pool; calling it from eager code copies the input into the static input, replays the
//! forward graph, and returns an output that takes part in eager autograd: its backward copies
//! the incoming gradient into the static gradient, replays the backward graph, and hands the
//! input and parameter gradients back to the eager engine (which accumulates them as usual).
//!
//! Contract (as in PyTorch): the module runs at one fixed input shape; forward and backward
//! calls alternate (each forward's backward runs before the next forward's replay overwrites
//! the saved activations); backward runs on an eager stream. Unlike PyTorch, the alternation
//! is enforced: a forward while the previous forward's output still waits for its backward is
//! refused (`NnError::OutOfOrder`), so gradients always come from the activations of the
//! forward they belong to. Dropping that output (and everything computed from it) gives up its
//! backward; a forward under [`crate::no_grad`] records nothing to wait for.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use cudagraph::{CaptureOptions, Graph, Queue, QueueExt, Stream};

use crate::autograd::tensor::{Node, Parameter, Tensor};
use crate::error::{NnError, Result};
use crate::nn::layers::NnModule;

/// Whose activations the static buffers hold: the latest forward's, and whether its backward
/// is still due. A forward may replay only when no earlier output still waits for its
/// backward; a backward runs once, for the latest forward.
#[derive(Default)]
struct Turns {
    state: Mutex<TurnState>,
}

#[derive(Default)]
struct TurnState {
    /// Forwards replayed so far.
    generation: u64,
    /// The latest forward's turn, alive while its output's autograd node is.
    open: Weak<Turn>,
}

/// One forward's claim on the static activations, held by its output's autograd node (so it
/// ends when the backward frees that node, or when the output is dropped unused).
struct Turn {
    generation: u64,
    turns: Arc<Turns>,
    backward_done: AtomicBool,
}

fn lock(m: &Mutex<TurnState>) -> MutexGuard<'_, TurnState> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Turns {
    /// Claims the static activations for a new forward, or refuses while the previous
    /// forward's backward is still due.
    fn begin_forward(self: &Arc<Self>) -> Result<Arc<Turn>> {
        let mut st = lock(&self.state);
        if let Some(open) = st.open.upgrade() {
            if !open.backward_done.load(Ordering::Acquire) {
                return Err(NnError::OutOfOrder {
                    call: "GraphedModule::forward",
                    problem: "the output of the previous forward still waits for its backward, \
                              and this replay would overwrite the activations that backward \
                              reads",
                    fix: "run backward through that output first, or drop it and every tensor \
                          computed from it to give its backward up (run forwards that need no \
                          gradient under no_grad)",
                });
            }
        }
        st.generation += 1;
        let turn = Arc::new(Turn {
            generation: st.generation,
            turns: self.clone(),
            backward_done: AtomicBool::new(false),
        });
        st.open = Arc::downgrade(&turn);
        Ok(turn)
    }
}

impl Turn {
    /// Checks that this forward's activations are still the static ones and that its
    /// backward has not run yet, and marks it run.
    fn begin_backward(&self) -> Result<()> {
        let st = lock(&self.turns.state);
        if st.generation != self.generation {
            return Err(NnError::OutOfOrder {
                call: "GraphedModule backward",
                problem: "a later forward replaced the activations of this output's forward",
                fix: "run each forward's backward before the next forward",
            });
        }
        if self.backward_done.swap(true, Ordering::AcqRel) {
            return Err(NnError::OutOfOrder {
                call: "GraphedModule backward",
                problem: "this output's backward already ran",
                fix: "run the forward again before the next backward",
            });
        }
        Ok(())
    }
}

/// A module whose forward and backward passes each replay as one graph.
pub struct GraphedModule<M: NnModule> {
    module: M,
    fwd: Graph,
    bwd: Arc<Graph>,
    input: Parameter,
    output: Tensor,
    grad_output: Arc<cudagraph::DeviceBuffer<f32>>,
    input_grad: Arc<cudagraph::DeviceBuffer<f32>>,
    param_grads: Vec<Arc<cudagraph::DeviceBuffer<f32>>>,
    turns: Arc<Turns>,
}

impl<M: NnModule> GraphedModule<M> {
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
            let g = p.grad()?.ok_or_else(|| {
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
        let output = Tensor::from_buffer(output.data_arc()?.clone(), output.shape())?;
        Ok(Self {
            module,
            fwd,
            bwd: Arc::new(bwd),
            input,
            output,
            grad_output,
            input_grad,
            param_grads,
            turns: Arc::default(),
        })
    }

    /// The wrapped module.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The forward and backward graphs.
    pub fn graphs(&self) -> (&Graph, &Graph) {
        (&self.fwd, self.bwd.as_ref())
    }

    /// Runs the module on `x` (the captured shape) by replaying the forward graph; the result
    /// flows back through the backward graph when eager autograd reaches it.
    ///
    /// `NnError::OutOfOrder` (nothing enqueued) while the output of the previous forward
    /// still waits for its backward: the replay would overwrite the activations it needs.
    pub fn forward(&self, s: &Stream, x: &Tensor) -> Result<Tensor> {
        if x.shape() != self.input.shape() {
            return Err(NnError::Shape(format!(
                "graphed module captured for input {:?}, called with {:?}",
                self.input.shape(),
                x.shape()
            )));
        }
        let turn = self.turns.begin_forward()?;
        QueueExt::copy(s, x.data()?, self.input.data()?)?;
        self.fwd.replay(s)?;
        let out = s.alloc::<f32>(self.output.numel())?;
        QueueExt::copy(s, self.output.data()?, &out)?;
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
                turn.begin_backward()?;
                q.copy(g.data()?, &gout)?;
                bwd.replay_on(q.stream_handle())?;
                let copy =
                    |src: &cudagraph::DeviceBuffer<f32>, shape: &[usize]| -> Result<Tensor> {
                        let b = q.alloc::<f32>(src.len())?;
                        q.copy(src, &b)?;
                        Tensor::gradient(b, shape)
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

#[cfg(test)]
mod tests {
    //! The forward/backward alternation of a graphed module (issue 26, item 5), host side.
    use super::*;

    fn out_of_order(r: Result<impl Sized>) -> &'static str {
        match r {
            Err(NnError::OutOfOrder { call, .. }) => call,
            Err(e) => panic!("another error: {e}"),
            Ok(_) => panic!("accepted out of order"),
        }
    }

    #[test]
    fn a_second_forward_waits_for_the_first_forwards_backward() {
        let turns = Arc::new(Turns::default());
        let first = turns.begin_forward().unwrap();
        assert_eq!(
            out_of_order(turns.begin_forward()),
            "GraphedModule::forward"
        );
        first.begin_backward().unwrap();
        // Its node may outlive the backward a moment; the turn is over all the same.
        let second = turns.begin_forward().unwrap();
        drop(first);
        second.begin_backward().unwrap();
    }

    #[test]
    fn a_backward_runs_once_and_only_for_the_latest_forward() {
        let turns = Arc::new(Turns::default());
        let first = turns.begin_forward().unwrap();
        first.begin_backward().unwrap();
        assert_eq!(
            out_of_order(first.begin_backward()),
            "GraphedModule backward"
        );
        let _second = turns.begin_forward().unwrap();
        assert_eq!(
            out_of_order(first.begin_backward()),
            "GraphedModule backward"
        );
    }

    #[test]
    fn dropping_an_output_gives_its_backward_up() {
        let turns = Arc::new(Turns::default());
        drop(turns.begin_forward().unwrap());
        let second = turns.begin_forward().unwrap();
        second.begin_backward().unwrap();
    }
}
