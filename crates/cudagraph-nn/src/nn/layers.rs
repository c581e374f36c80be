//! Layers (`Linear`, `Conv2d`, `ReLU`, `MaxPool2d`, `Flatten`) and `Sequential`, with
//! PyTorch's default initialisation drawn from a seeded [`HostRng`].
//!
//! Parameters are f32 by default. `to_dtype` on a layer or a `Sequential` (PyTorch's
//! `model.to(torch.bfloat16)`) stores them in bf16 or f16 instead, each value rounded to
//! nearest even, for pure 16-bit training: the forward pass then runs in that type (its
//! input must be of that type too, e.g. `x.to_dtype(q, Dtype::Bf16)`), gradients come in
//! that type, and [`Sgd`](crate::nn::optim::Sgd) / [`Adam`](crate::nn::optim::Adam) update
//! the 16-bit values with f32 moments (see [`crate::nn::optim`]). Convert before building
//! the optimizer: it keeps the parameter handles it was given.

use cudagraph::Queue;

use crate::autograd::ops;
use crate::autograd::tensor::{Parameter, Tensor};
use crate::dtype::Dtype;
use crate::error::{NnError, Result};
use crate::random::{Generator, HostRng};
use cudagraph::Stream;

/// A neural-network module (PyTorch's `nn.Module`): a forward pass and its parameters. Named
/// `NnModule` so that it is never confused with a compiled CUDA module (`cudagraph::Module`).
pub trait NnModule {
    /// Runs the module on `x`, enqueuing its work on `q` (an eager stream or a capture).
    fn forward(&self, q: &dyn Queue, x: &Tensor) -> Result<Tensor>;
    /// The module's trainable parameters, in a fixed order (weights before biases).
    fn parameters(&self) -> Vec<Parameter>;
}

/// `y = x wᵀ + b` (PyTorch's `nn.Linear`).
#[derive(Clone, Debug)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Parameter,
    /// `[out_features]`.
    pub bias: Parameter,
    /// Size of each input row.
    pub in_features: usize,
    /// Size of each output row.
    pub out_features: usize,
}

impl Linear {
    /// PyTorch's default init: weights and bias uniform in ±1/√in_features.
    pub fn new(
        s: &Stream,
        in_features: usize,
        out_features: usize,
        rng: &mut HostRng,
    ) -> Result<Self> {
        let bound = 1.0 / (in_features as f32).sqrt();
        let w = rng.vec_symmetric(in_features * out_features, bound);
        let b = rng.vec_symmetric(out_features, bound);
        Self::from_host(s, &w, &b, in_features, out_features)
    }

    /// A layer with the given weights (`[out, in]` row-major) and bias.
    pub fn from_host(
        s: &Stream,
        w: &[f32],
        b: &[f32],
        in_features: usize,
        out_features: usize,
    ) -> Result<Self> {
        Ok(Self {
            weight: Parameter::from_host(s, "weight", w, &[out_features, in_features])?,
            bias: Parameter::from_host(s, "bias", b, &[out_features])?,
            in_features,
            out_features,
        })
    }

    /// Stores the weight and bias in `dtype` (new parameters, values rounded to nearest even,
    /// cast on `q`; the same dtype keeps them): see the module documentation.
    pub fn to_dtype(&mut self, q: &dyn Queue, dtype: Dtype) -> Result<()> {
        self.weight = self.weight.to_dtype(q, dtype)?;
        self.bias = self.bias.to_dtype(q, dtype)?;
        Ok(())
    }

    /// The forward pass, with a fused ReLU when `relu` is true.
    pub fn forward_act(&self, q: &dyn Queue, x: &Tensor, relu: bool) -> Result<Tensor> {
        ops::linear(q, x, &self.weight.tensor(), Some(&self.bias.tensor()), relu)
    }
}

impl NnModule for Linear {
    fn forward(&self, q: &dyn Queue, x: &Tensor) -> Result<Tensor> {
        self.forward_act(q, x, false)
    }
    fn parameters(&self) -> Vec<Parameter> {
        vec![self.weight.clone(), self.bias.clone()]
    }
}

/// 2-D convolution (PyTorch's `nn.Conv2d`, square kernel).
#[derive(Clone, Debug)]
pub struct Conv2d {
    /// `[out_channels, in_channels, kernel, kernel]`.
    pub weight: Parameter,
    /// `[out_channels]`.
    pub bias: Parameter,
    /// Stride, the same along both axes.
    pub stride: usize,
    /// Zero padding on each side, the same along both axes.
    pub padding: usize,
}

impl Conv2d {
    /// PyTorch's default init: weights and bias uniform in ±1/√(in_channels·kernel²).
    pub fn new(
        s: &Stream,
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        rng: &mut HostRng,
    ) -> Result<Self> {
        let fan_in = in_channels * kernel * kernel;
        let bound = 1.0 / (fan_in as f32).sqrt();
        let w = rng.vec_symmetric(out_channels * fan_in, bound);
        let b = rng.vec_symmetric(out_channels, bound);
        Ok(Self {
            weight: Parameter::from_host(
                s,
                "weight",
                &w,
                &[out_channels, in_channels, kernel, kernel],
            )?,
            bias: Parameter::from_host(s, "bias", &b, &[out_channels])?,
            stride,
            padding,
        })
    }
}

impl Conv2d {
    /// Stores the weight and bias in `dtype` (as [`Linear::to_dtype`]).
    pub fn to_dtype(&mut self, q: &dyn Queue, dtype: Dtype) -> Result<()> {
        self.weight = self.weight.to_dtype(q, dtype)?;
        self.bias = self.bias.to_dtype(q, dtype)?;
        Ok(())
    }
}

impl NnModule for Conv2d {
    fn forward(&self, q: &dyn Queue, x: &Tensor) -> Result<Tensor> {
        ops::conv2d(
            q,
            x,
            &self.weight.tensor(),
            Some(&self.bias.tensor()),
            self.stride,
            self.padding,
        )
    }
    fn parameters(&self) -> Vec<Parameter> {
        vec![self.weight.clone(), self.bias.clone()]
    }
}

/// One layer of a [`Sequential`].
#[derive(Clone, Debug)]
pub enum Layer {
    /// A fully connected layer.
    Linear(Linear),
    /// A 2-D convolution.
    Conv2d(Conv2d),
    /// `max(x, 0)` elementwise; fused into a preceding `Linear`.
    ReLU,
    /// Max pooling over `kernel×kernel` windows (PyTorch's `nn.MaxPool2d`, no padding).
    MaxPool2d {
        /// Window side.
        kernel: usize,
        /// Step between windows.
        stride: usize,
    },
    /// `[n, ...] -> [n, prod(...)]` (PyTorch's `nn.Flatten()`).
    Flatten,
    /// Dropout with probability `p` in training mode, the identity in eval mode (numbers from
    /// the `Sequential`'s generator: [`Sequential::set_generator`]).
    Dropout {
        /// Probability of zeroing an element, in `[0, 1]`.
        p: f32,
    },
}

/// Layers applied in order. A `Linear` followed by `ReLU` runs as one fused kernel.
/// Training mode by default ([`Sequential::eval`] switches dropout off).
#[derive(Clone, Debug, Default)]
pub struct Sequential {
    /// The layers, in the order the forward pass applies them.
    pub layers: Vec<Layer>,
    eval: bool,
    generator: Option<Generator>,
}

impl Sequential {
    /// Layers in training mode, with no generator.
    pub fn new(layers: Vec<Layer>) -> Self {
        Self {
            layers,
            eval: false,
            generator: None,
        }
    }

    /// The generator dropout layers draw from. The forward pass advances it at its end
    /// whenever a dropout layer drew numbers, so each pass (and each replay of a graph that
    /// captured one) gets fresh masks.
    pub fn set_generator(&mut self, generator: Generator) {
        self.generator = Some(generator);
    }

    /// Builder form of [`Self::set_generator`].
    pub fn with_generator(mut self, generator: Generator) -> Self {
        self.generator = Some(generator);
        self
    }

    /// The dropout generator, `None` until [`Self::set_generator`].
    pub fn generator(&self) -> Option<&Generator> {
        self.generator.as_ref()
    }

    /// PyTorch's `train(mode)`: dropout active when `mode` is true.
    pub fn train(&mut self, mode: bool) {
        self.eval = !mode;
    }

    /// PyTorch's `eval()`: dropout is the identity.
    pub fn eval(&mut self) {
        self.eval = true;
    }

    /// True in training mode (dropout active).
    pub fn is_training(&self) -> bool {
        !self.eval
    }

    /// PyTorch's `model.to(dtype)`: stores every layer's parameters in `dtype` (new
    /// parameters, values rounded to nearest even, cast on `q`); see the module
    /// documentation. Build the optimizer afterwards.
    pub fn to_dtype(&mut self, q: &dyn Queue, dtype: Dtype) -> Result<()> {
        for l in &mut self.layers {
            match l {
                Layer::Linear(l) => l.to_dtype(q, dtype)?,
                Layer::Conv2d(c) => c.to_dtype(q, dtype)?,
                _ => {}
            }
        }
        Ok(())
    }

    /// The element type of the parameters (f32 for a model without any).
    pub fn dtype(&self) -> Dtype {
        self.parameters()
            .first()
            .map_or(Dtype::F32, Parameter::dtype)
    }
}

impl NnModule for Sequential {
    fn forward(&self, q: &dyn Queue, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        let mut drew = false;
        let mut i = 0;
        while i < self.layers.len() {
            let fuse_relu = matches!(self.layers.get(i + 1), Some(Layer::ReLU));
            h = match &self.layers[i] {
                Layer::Linear(l) => {
                    if fuse_relu {
                        i += 1;
                    }
                    l.forward_act(q, &h, fuse_relu)?
                }
                Layer::Conv2d(c) => c.forward(q, &h)?,
                Layer::ReLU => ops::relu(q, &h)?,
                Layer::MaxPool2d { kernel, stride } => ops::max_pool2d(q, &h, *kernel, *stride)?,
                Layer::Flatten => ops::flatten(&h)?,
                Layer::Dropout { p } => {
                    let active = self.is_training() && *p != 0.0;
                    match (&self.generator, active) {
                        (Some(g), true) => {
                            drew = true;
                            ops::dropout(q, &h, *p, true, g)?
                        }
                        (None, true) => {
                            return Err(NnError::Shape(
                                "Sequential: a Dropout layer in training mode needs a generator; call set_generator(Generator::new(&stream, seed)?) or eval()".into(),
                            ))
                        }
                        (_, false) if (0.0..=1.0).contains(p) => h.clone(),
                        (_, false) => {
                            return Err(NnError::Shape(format!(
                                "dropout probability has to be between 0 and 1, but got {p}"
                            )))
                        }
                    }
                }
            };
            i += 1;
        }
        if drew {
            if let Some(g) = &self.generator {
                g.advance(q)?;
            }
        }
        Ok(h)
    }

    fn parameters(&self) -> Vec<Parameter> {
        self.layers
            .iter()
            .flat_map(|l| match l {
                Layer::Linear(l) => l.parameters(),
                Layer::Conv2d(c) => c.parameters(),
                _ => Vec::new(),
            })
            .collect()
    }
}
