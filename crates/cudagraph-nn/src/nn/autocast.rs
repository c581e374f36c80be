//! [`AutocastModule`]: a module whose forward pass runs under [`autocast`](crate::autocast)
//! with 16-bit copies of its parameters made once, not per call — for inference and serving,
//! where the weights do not change between calls (PyTorch users get the same from
//! `torch.autocast` around a model whose weights they converted once). Outputs come back as
//! f32 by default, so a caller (a [`Batched`](crate::Batched) model, a server) sees the same
//! element type whatever the precision inside; [`AutocastModule::keep_output`] returns them
//! as the module made them (a product's or convolution's output in the 16-bit type), as
//! `torch.autocast` does, with no widening cast over the whole output.

use cudagraph::Queue;

use crate::autograd::autocast::{autocast_with, AutocastOptions};
use crate::autograd::tensor::{Parameter, Tensor};
use crate::dtype::{Dtype, TypedBuffer};
use crate::engine::Engines;
use crate::error::Result;
use crate::kernels::cast::cast_new;
use crate::nn::layers::NnModule;

/// `module` run in `dtype` (see the module documentation). With `Dtype::F32` it is `module`
/// itself, with nothing copied.
pub struct AutocastModule<M: NnModule> {
    module: M,
    dtype: Dtype,
    copies: Vec<(Parameter, TypedBuffer)>,
    keep_output: bool,
}

impl<M: NnModule> AutocastModule<M> {
    /// Wraps `module`, casting each parameter to `dtype` once, on `q` (round to nearest
    /// even).
    /// Also opens cuBLASLt on `q`'s device for a 16-bit `dtype`, so that the module's first
    /// forward may be inside a capture (the fused 16-bit products need it, and a library
    /// cannot be opened inside a capture).
    pub fn new(q: &dyn Queue, module: M, dtype: Dtype) -> Result<Self> {
        if dtype != Dtype::F32 {
            let _ = Engines::get(q.device())?.cublaslt();
        }
        let mut m = Self {
            module,
            dtype,
            copies: Vec::new(),
            keep_output: false,
        };
        m.refresh(q)?;
        Ok(m)
    }

    /// Casts the parameters again, on `q`: after their values changed (training, loading).
    /// A graph captured before keeps reading the old copies; capture again after this.
    pub fn refresh(&mut self, q: &dyn Queue) -> Result<()> {
        self.copies = match self.dtype {
            Dtype::F32 => Vec::new(),
            d => self
                .module
                .parameters()
                .into_iter()
                .map(|p| {
                    let c = cast_new(q, p.tensor().buffer(), d)?;
                    Ok((p, c))
                })
                .collect::<Result<_>>()?,
        };
        Ok(())
    }

    /// With `keep`, [`forward`](NnModule::forward) returns the module's output in the type
    /// the module made it in — for a module ending in a product or convolution, `dtype` — as
    /// `torch.autocast` does, instead of widening it to f32 (the default: a cast over the
    /// whole output). The values are the same: widening is exact, so the kept output widened
    /// is bit for bit the default output.
    pub fn keep_output(mut self, keep: bool) -> Self {
        self.keep_output = keep;
        self
    }

    /// Whether outputs are returned in the type the module made them in
    /// ([`AutocastModule::keep_output`]) rather than as f32.
    pub fn keeps_output(&self) -> bool {
        self.keep_output
    }

    /// The type products and convolutions run in.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The wrapped module.
    pub fn module(&self) -> &M {
        &self.module
    }
}

impl<M: NnModule> NnModule for AutocastModule<M> {
    fn forward(&self, q: &dyn Queue, x: &Tensor) -> Result<Tensor> {
        if self.dtype == Dtype::F32 {
            return self.module.forward(q, x);
        }
        let options = AutocastOptions {
            dtype: self.dtype,
            copies: self.copies.clone(),
        };
        let y = autocast_with(options, || self.module.forward(q, x))??;
        if self.keep_output {
            Ok(y)
        } else {
            y.to_dtype(q, Dtype::F32)
        }
    }

    fn parameters(&self) -> Vec<Parameter> {
        self.module.parameters()
    }
}
