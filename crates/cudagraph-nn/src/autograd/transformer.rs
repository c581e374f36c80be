//! The transformer layers' differentiable operations: [`layer_norm`], [`rms_norm`], [`gelu`],
//! [`silu`], [`swiglu`], rotary position embeddings ([`rotary`] with a [`Rope`]) and
//! [`embedding`], on f32, bf16 and f16 tensors.
//!
//! A 16-bit operation reads and writes its tensors' type and computes in f32, rounding once
//! on store. Weights are read as f32 (a parameter is an f32 master; a 16-bit weight is widened
//! exactly first) and their gradients are computed in f32, given in the weight's own type
//! (f32 for a master: no 16-bit rounding). Reductions run in a fixed order: the same inputs
//! give the same bits, eager or replayed from a graph.
//!
//! Inside [`autocast`](super::autocast::autocast), following PyTorch's CUDA op lists:
//! [`layer_norm`] is on the f32 list and [`rms_norm`] is made of ops on it (`pow`, `rsqrt`; Hugging
//! Face's `LlamaRMSNorm` also widens explicitly), so both widen a 16-bit input to f32 and give
//! an f32 output (the input's gradient comes back in its own type through the cast); the
//! activations, [`rotary`] and [`embedding`] are on no list and run in their input's type
//! (the embedding in its weight's: an f32 master gives f32 rows).

use std::sync::Arc;

use cudagraph::memory::{bf16, f16};
use cudagraph::{DeviceBuffer, Queue, QueueExt, Stream};

use crate::autograd::autocast::{autocast_dtype, values_in, widen};
use crate::autograd::tensor::{numel_checked, Node, Tensor};
use crate::dtype::{Dtype, Float, TypedBuffer};
use crate::error::{NnError, Result};
use crate::kernels::cast::cast_new;
use crate::kernels::transformer::{RopeDims, TransformerKernels};

fn shape_err<T>(msg: String) -> Result<T> {
    Err(NnError::Shape(msg))
}

/// The buffer of `T` in a [`TypedBuffer`] known to hold `T`.
fn of<T: Float>(what: &'static str, b: &TypedBuffer) -> Result<Arc<DeviceBuffer<T>>> {
    b.get::<T>().cloned().ok_or(NnError::Dtype {
        what,
        expected: T::DTYPE.name(),
        found: b.dtype().name(),
    })
}

/// An f32 gradient `g` of shape `shape` given in `dtype` (cast when it is 16-bit).
fn grad_in(q: &dyn Queue, g: DeviceBuffer<f32>, dtype: Dtype, shape: &[usize]) -> Result<Tensor> {
    let g = TypedBuffer::new(Arc::new(g));
    let g = if dtype == Dtype::F32 {
        g
    } else {
        cast_new(q, &g, dtype)?
    };
    Tensor::gradient_typed(g, shape)
}

/// A gradient of `T` just computed into `g`.
fn grad_of<T: Float>(g: DeviceBuffer<T>, shape: &[usize]) -> Result<Tensor> {
    Tensor::gradient_typed(TypedBuffer::new(Arc::new(g)), shape)
}

/// The input of a norm: widened to f32 inside autocast (PyTorch's f32 list), else as given.
fn norm_input(q: &dyn Queue, x: &Tensor) -> Result<Tensor> {
    if autocast_dtype().is_some() {
        widen(q, x)
    } else {
        Ok(x.clone())
    }
}

/// Rows and hidden size of a norm's input, and the check of a `[hidden]` weight or bias.
fn norm_dims(
    what: &str,
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<(usize, usize)> {
    let Some(&hidden) = x.shape().last() else {
        return shape_err(format!("{what}: a scalar input has no last dimension"));
    };
    if hidden == 0 {
        return shape_err(format!(
            "{what}: input {:?} has an empty last dimension",
            x.shape()
        ));
    }
    for (name, t) in [("weight", Some(weight)), ("bias", bias)] {
        if let Some(t) = t {
            if t.shape() != [hidden] {
                return shape_err(format!(
                    "{what}: {name} {:?} for input {:?} (expected [{hidden}])",
                    t.shape(),
                    x.shape()
                ));
            }
        }
    }
    Ok((x.numel() / hidden, hidden))
}

/// LayerNorm over the last dimension (PyTorch's `layer_norm(x, [hidden], weight, bias, eps)`):
/// `(x - mean) / sqrt(var + eps) · weight + bias` with the biased variance, computed in f32
/// (mean and `1/sqrt(var + eps)` saved in f32 for the backward). `weight` and `bias` are
/// `[hidden]`. Runs in f32 inside autocast (see the module documentation), else in `x`'s type.
/// A row holding a NaN or an infinity gives a row of NaN, as in PyTorch.
pub fn layer_norm(
    q: &dyn Queue,
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<Tensor> {
    let dims = norm_dims("layer_norm", x, weight, bias)?;
    let x = norm_input(q, x)?;
    match x.dtype() {
        Dtype::F32 => norm_as::<f32>(q, &x, weight, Some(bias), eps, dims),
        Dtype::Bf16 => norm_as::<bf16>(q, &x, weight, Some(bias), eps, dims),
        Dtype::F16 => norm_as::<f16>(q, &x, weight, Some(bias), eps, dims),
    }
}

/// RMSNorm over the last dimension, as Llama's: `x · rsqrt(mean(x²) + eps) · weight`, all in
/// f32 and rounded once (Hugging Face's `LlamaRMSNorm` rounds `x · rsqrt(…)` to the input's
/// type before the product with the weight; this does not). `weight` is `[hidden]`. Runs in
/// f32 inside autocast, else in `x`'s type.
pub fn rms_norm(q: &dyn Queue, x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    let dims = norm_dims("rms_norm", x, weight, None)?;
    let x = norm_input(q, x)?;
    match x.dtype() {
        Dtype::F32 => norm_as::<f32>(q, &x, weight, None, eps, dims),
        Dtype::Bf16 => norm_as::<bf16>(q, &x, weight, None, eps, dims),
        Dtype::F16 => norm_as::<f16>(q, &x, weight, None, eps, dims),
    }
}

/// LayerNorm (`bias` = `Some(optional bias)`) or RMSNorm (`bias` = `None`) in `T`.
fn norm_as<T: Float>(
    q: &dyn Queue,
    x: &Tensor,
    weight: &Tensor,
    bias: Option<Option<&Tensor>>,
    eps: f32,
    (rows, cols): (usize, usize),
) -> Result<Tensor> {
    let k = TransformerKernels::get(q.device())?;
    let layer = bias.is_some();
    let bias = bias.flatten();
    let xd = x.data_as::<T>()?.clone();
    let w = of::<f32>("norm weight", &values_in(q, weight, Dtype::F32)?)?;
    let b = bias
        .map(|b| values_in(q, b, Dtype::F32).and_then(|v| of::<f32>("norm bias", &v)))
        .transpose()?;
    let n = numel_checked(x.shape())?;
    let y = q.alloc::<T>(n)?;
    let rstd = Arc::new(q.alloc::<f32>(rows)?);
    let mean = if layer {
        let mean = Arc::new(q.alloc::<f32>(rows)?);
        k.layer_norm_fwd(
            q,
            &xd,
            &w,
            b.as_deref(),
            &y,
            (&mean, &rstd),
            (rows, cols),
            eps,
        )?;
        Some(mean)
    } else {
        k.rms_norm_fwd(q, &xd, &w, &y, &rstd, (rows, cols), eps)?;
        None
    };
    let mut inputs = vec![x.clone(), weight.clone()];
    inputs.extend(bias.cloned());
    let (need_x, need_w, need_b) = (
        x.requires_grad(),
        weight.requires_grad(),
        bias.is_some_and(|b| b.requires_grad()),
    );
    let (w_type, b_type) = (weight.dtype(), bias.map(|b| b.dtype()));
    let x_shape = x.shape().to_vec();
    let node = Node {
        unit_backward: None,
        inputs,
        name: if layer { "layer_norm" } else { "rms_norm" },
        backward: Box::new(move |q, _nn, g| {
            let k = TransformerKernels::get(q.device())?;
            let g = g.data_as::<T>()?;
            let stats = (mean.as_deref(), rstd.as_ref());
            let dx = if need_x {
                let dx = q.alloc::<T>(n)?;
                k.norm_bwd_dx(q, (g, &xd), &w, stats, &dx, (rows, cols))?;
                Some(grad_of(dx, &x_shape)?)
            } else {
                None
            };
            let (dw, db) = if need_w || need_b {
                let dw = q.alloc::<f32>(cols)?;
                let db = if need_b {
                    Some(q.alloc::<f32>(cols)?)
                } else {
                    None
                };
                k.norm_bwd_wb(q, (g, &xd), stats, &dw, db.as_ref(), (rows, cols))?;
                let dw = if need_w {
                    Some(grad_in(q, dw, w_type, &[cols])?)
                } else {
                    None
                };
                let db = match (db, b_type) {
                    (Some(db), Some(t)) => Some(grad_in(q, db, t, &[cols])?),
                    _ => None,
                };
                (dw, db)
            } else {
                (None, None)
            };
            let mut out = vec![dx, dw];
            if b_type.is_some() {
                out.push(db);
            }
            Ok(out)
        }),
    };
    Ok(Tensor::from_op_typed(
        TypedBuffer::new(Arc::new(y)),
        x.shape().to_vec(),
        Some(node),
    ))
}

/// Which activation an elementwise node computes.
#[derive(Clone, Copy)]
enum Act {
    Gelu { tanh: bool },
    Silu,
}

/// GELU, as PyTorch's `gelu(x, approximate=…)`: exact `x · Φ(x)` (with `erf`), or with
/// `approximate` the tanh form `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`. In `x`'s type
/// (also inside autocast), computed in f32.
pub fn gelu(q: &dyn Queue, x: &Tensor, approximate: bool) -> Result<Tensor> {
    act(q, x, Act::Gelu { tanh: approximate })
}

/// SiLU (swish), `x · σ(x)`, as PyTorch's `silu`. In `x`'s type, computed in f32.
pub fn silu(q: &dyn Queue, x: &Tensor) -> Result<Tensor> {
    act(q, x, Act::Silu)
}

fn act(q: &dyn Queue, x: &Tensor, a: Act) -> Result<Tensor> {
    match x.dtype() {
        Dtype::F32 => act_as::<f32>(q, x, a),
        Dtype::Bf16 => act_as::<bf16>(q, x, a),
        Dtype::F16 => act_as::<f16>(q, x, a),
    }
}

fn act_as<T: Float>(q: &dyn Queue, x: &Tensor, a: Act) -> Result<Tensor> {
    let k = TransformerKernels::get(q.device())?;
    let xd = x.data_as::<T>()?.clone();
    let n = xd.len();
    let y = q.alloc::<T>(n)?;
    match a {
        Act::Gelu { tanh } => k.gelu_fwd(q, &xd, &y, tanh)?,
        Act::Silu => k.silu_fwd(q, &xd, &y)?,
    }
    let shape = x.shape().to_vec();
    let node = Node {
        unit_backward: None,
        inputs: vec![x.clone()],
        name: match a {
            Act::Gelu { .. } => "gelu",
            Act::Silu => "silu",
        },
        backward: Box::new(move |q, _nn, g| {
            let k = TransformerKernels::get(q.device())?;
            let g = g.data_as::<T>()?;
            let dx = q.alloc::<T>(n)?;
            match a {
                Act::Gelu { tanh } => k.gelu_bwd(q, g, &xd, &dx, tanh)?,
                Act::Silu => k.silu_bwd(q, g, &xd, &dx)?,
            }
            Ok(vec![Some(grad_of(dx, &shape)?)])
        }),
    };
    Ok(Tensor::from_op_typed(
        TypedBuffer::new(Arc::new(y)),
        x.shape().to_vec(),
        Some(node),
    ))
}

/// SwiGLU, `silu(gate) · up` (Llama's MLP), on two tensors of one shape and one type (the
/// output's; `NnError::Dtype` when they differ, also inside autocast). Computed in f32.
pub fn swiglu(q: &dyn Queue, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.shape() != up.shape() {
        return shape_err(format!(
            "swiglu: gate {:?} and up {:?} differ",
            gate.shape(),
            up.shape()
        ));
    }
    if gate.dtype() != up.dtype() {
        return Err(NnError::Dtype {
            what: "swiglu up",
            expected: gate.dtype().name(),
            found: up.dtype().name(),
        });
    }
    match gate.dtype() {
        Dtype::F32 => swiglu_as::<f32>(q, gate, up),
        Dtype::Bf16 => swiglu_as::<bf16>(q, gate, up),
        Dtype::F16 => swiglu_as::<f16>(q, gate, up),
    }
}

fn swiglu_as<T: Float>(q: &dyn Queue, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let k = TransformerKernels::get(q.device())?;
    let (gd, ud) = (gate.data_as::<T>()?.clone(), up.data_as::<T>()?.clone());
    let n = gd.len();
    let y = q.alloc::<T>(n)?;
    k.swiglu_fwd(q, &gd, &ud, &y)?;
    let shape = gate.shape().to_vec();
    let (need_g, need_u) = (gate.requires_grad(), up.requires_grad());
    let node = Node {
        unit_backward: None,
        inputs: vec![gate.clone(), up.clone()],
        name: "swiglu",
        backward: Box::new(move |q, _nn, g| {
            let k = TransformerKernels::get(q.device())?;
            let g = g.data_as::<T>()?;
            let (dg, du) = (q.alloc::<T>(n)?, q.alloc::<T>(n)?);
            k.swiglu_bwd(q, g, (&gd, &ud), (&dg, &du))?;
            Ok(vec![
                need_g.then(|| grad_of(dg, &shape)).transpose()?,
                need_u.then(|| grad_of(du, &shape)).transpose()?,
            ])
        }),
    };
    Ok(Tensor::from_op_typed(
        TypedBuffer::new(Arc::new(y)),
        gate.shape().to_vec(),
        Some(node),
    ))
}

/// Which components a rotary embedding pairs, named after Hugging Face's functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RopeLayout {
    /// `rotate_half` (Llama, GPT-NeoX, Mistral, Qwen): component `k` pairs with `k + d/2`.
    #[default]
    RotateHalf,
    /// `rotate_every_two` (GPT-J; "interleaved"): component `2k` pairs with `2k + 1`.
    RotateEveryTwo,
}

/// Llama 3's `rope_scaling` (`"rope_type": "llama3"` in a Hugging Face config).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    /// `factor`: how much the low frequencies are slowed (8 for Llama 3.1, 32 for 3.2).
    pub factor: f64,
    /// `low_freq_factor` (1 in Meta's configurations).
    pub low_freq_factor: f64,
    /// `high_freq_factor` (4 in Meta's configurations).
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings` (8192).
    pub original_max_position_embeddings: f64,
}

/// The rotary frequencies `theta^(-2k/rotary_dim)` for `k < rotary_dim / 2`, in f64 (Hugging
/// Face's default `inv_freq`, which it computes in f32).
pub fn rope_inv_freq(rotary_dim: usize, theta: f64) -> Vec<f64> {
    (0..rotary_dim / 2)
        .map(|k| theta.powf(-((2 * k) as f64) / rotary_dim as f64))
        .collect()
}

/// The per-frequency scale of Llama 3's `rope_scaling` (the `new / old` ratio of each entry of
/// [`rope_inv_freq`]), as Hugging Face's `_compute_llama3_parameters`: a wavelength
/// `2π / f` below `original_max_position_embeddings / high_freq_factor` keeps its frequency
/// (scale 1); one above `original_max_position_embeddings / low_freq_factor` is divided by
/// `factor`; in between, with `s = (original / wavelength - low) / (high - low)`, the scale is
/// `(1 - s) / factor + s`. `NnError::Shape` for factors that are not finite and positive or
/// equal low and high factors (the formula divides by their difference).
pub fn llama3_frequency_scale(
    rotary_dim: usize,
    theta: f64,
    s: &Llama3RopeScaling,
) -> Result<Vec<f64>> {
    let ok = |v: f64| v.is_finite() && v > 0.0;
    if !(ok(s.factor)
        && ok(s.low_freq_factor)
        && ok(s.high_freq_factor)
        && ok(s.original_max_position_embeddings)
        && ok(theta))
        || s.high_freq_factor == s.low_freq_factor
    {
        return shape_err(format!(
            "llama3 rope scaling: {s:?} with theta {theta} (every factor finite and positive, \
             high_freq_factor ≠ low_freq_factor)"
        ));
    }
    let old = s.original_max_position_embeddings;
    let low_wavelen = old / s.low_freq_factor;
    let high_wavelen = old / s.high_freq_factor;
    Ok(rope_inv_freq(rotary_dim, theta)
        .into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                1.0 / s.factor
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) / s.factor + smooth
            }
        })
        .collect())
}

/// A rotary position embedding: its layout, dimensions and frequencies (f32 on the device,
/// `theta^(-2k/rotary_dim) · scale[k]` computed in f64 and rounded once — Hugging Face
/// computes them in f32, which can differ in the last bit).
#[derive(Clone, Debug)]
pub struct Rope {
    layout: RopeLayout,
    head_dim: usize,
    rotary_dim: usize,
    inv_freq: Arc<DeviceBuffer<f32>>,
    host: Vec<f32>,
}

impl Rope {
    /// A rotary embedding of the first `rotary_dim` components of heads of `head_dim`
    /// (`rotary_dim = head_dim` for Llama; GPT-J and GPT-NeoX rotate a part), base `theta`
    /// (`rope_theta`), with an optional per-frequency scale (`rotary_dim / 2` entries, e.g.
    /// from [`llama3_frequency_scale`]). `NnError::Shape` for an odd or zero dimension, a
    /// rotary dimension past `head_dim`, a theta or scale that is not finite and positive, or
    /// a scale of another length. The frequencies are copied to the device on `s` (eager).
    pub fn new(
        s: &Stream,
        layout: RopeLayout,
        (head_dim, rotary_dim): (usize, usize),
        theta: f64,
        scale: Option<&[f64]>,
    ) -> Result<Self> {
        RopeDims {
            tokens: 0,
            heads: 0,
            head_dim,
            rot: rotary_dim,
            every_two: false,
        }
        .check()?;
        if !(theta.is_finite() && theta > 0.0) {
            return shape_err(format!("rotary: theta {theta} must be finite and positive"));
        }
        let half = rotary_dim / 2;
        if let Some(sc) = scale {
            if sc.len() != half || sc.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
                return shape_err(format!(
                    "rotary: a scale of {} values for {half} frequencies (each finite and \
                     positive)",
                    sc.len()
                ));
            }
        }
        let host: Vec<f32> = rope_inv_freq(rotary_dim, theta)
            .into_iter()
            .enumerate()
            .map(|(k, f)| (f * scale.map_or(1.0, |sc| sc[k])) as f32)
            .collect();
        let inv_freq = Arc::new(s.alloc_from_host(&host)?);
        Ok(Rope {
            layout,
            head_dim,
            rotary_dim,
            inv_freq,
            host,
        })
    }

    /// The layout.
    pub fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// Components per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Components rotated (the first ones of each head).
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// The frequencies on the device hold these values.
    pub fn inv_freq(&self) -> &[f32] {
        &self.host
    }

    fn dims(&self, tokens: usize, heads: usize) -> RopeDims {
        RopeDims {
            tokens,
            heads,
            head_dim: self.head_dim,
            rot: self.rotary_dim,
            every_two: self.layout == RopeLayout::RotateEveryTwo,
        }
    }
}

/// Rotary position embedding of `x: [tokens, heads, head_dim]` at `positions` (one i32 per
/// token, read on the device when the kernel runs: a captured decode step that writes the next
/// positions into the same buffer before each replay stays valid; the buffer may be longer
/// than `tokens`, and the backward reads it again). Component pairs chosen by the rope's
/// layout are rotated by `position · inv_freq[k]` (the product in f32, as Hugging Face), in
/// f32, rounded once to `x`'s type (also inside autocast); components past `rotary_dim` are
/// copied. The backward rotates the gradient back. `NnError::Shape` for a shape that does not
/// match the rope or a positions buffer shorter than `tokens`.
pub fn rotary(
    q: &dyn Queue,
    x: &Tensor,
    positions: &Arc<DeviceBuffer<i32>>,
    rope: &Rope,
) -> Result<Tensor> {
    let (tokens, heads) = match x.shape() {
        &[t, h, d] if d == rope.head_dim => (t, h),
        s => {
            return shape_err(format!(
                "rotary: input {s:?} is not [tokens, heads, {}]",
                rope.head_dim
            ))
        }
    };
    if positions.len() < tokens {
        return shape_err(format!(
            "rotary: {} positions for {tokens} tokens",
            positions.len()
        ));
    }
    match x.dtype() {
        Dtype::F32 => rotary_as::<f32>(q, x, positions, rope, (tokens, heads)),
        Dtype::Bf16 => rotary_as::<bf16>(q, x, positions, rope, (tokens, heads)),
        Dtype::F16 => rotary_as::<f16>(q, x, positions, rope, (tokens, heads)),
    }
}

fn rotary_as<T: Float>(
    q: &dyn Queue,
    x: &Tensor,
    positions: &Arc<DeviceBuffer<i32>>,
    rope: &Rope,
    (tokens, heads): (usize, usize),
) -> Result<Tensor> {
    let k = TransformerKernels::get(q.device())?;
    let xd = x.data_as::<T>()?;
    let dims = rope.dims(tokens, heads);
    let n = dims.check()?;
    let y = q.alloc::<T>(n)?;
    k.rope(q, xd, &y, positions, &rope.inv_freq, dims, false)?;
    let (pos, freq) = (positions.clone(), rope.inv_freq.clone());
    let shape = x.shape().to_vec();
    let node = Node {
        unit_backward: None,
        inputs: vec![x.clone()],
        name: "rotary",
        backward: Box::new(move |q, _nn, g| {
            let k = TransformerKernels::get(q.device())?;
            let dx = q.alloc::<T>(n)?;
            k.rope(q, g.data_as::<T>()?, &dx, &pos, &freq, dims, true)?;
            Ok(vec![Some(grad_of(dx, &shape)?)])
        }),
    };
    Ok(Tensor::from_op_typed(
        TypedBuffer::new(Arc::new(y)),
        x.shape().to_vec(),
        Some(node),
    ))
}

/// Embedding lookup, as PyTorch's `embedding(ids, weight)`: row `ids[t]` of
/// `weight: [vocab, dim]` for every id of `ids` (one token each), giving `[ids.len(), dim]` in
/// the weight's type (also inside autocast: an f32 master gives f32 rows).
///
/// An id outside `[0, vocab)` — PyTorch raises a device-side assert — gives a row of zeros
/// and no gradient (the ids are read on the device, so a captured step cannot check them on
/// the host). The weight's gradient is computed in f32, deterministically without atomics or
/// a sort: one thread per (token, column), the first token of each id summing the gradient
/// rows of every token with that id in order, into a zeroed `[vocab, dim]` gradient (given in
/// the weight's type).
pub fn embedding(q: &dyn Queue, ids: &Arc<DeviceBuffer<i32>>, weight: &Tensor) -> Result<Tensor> {
    let &[vocab, dim] = weight.shape() else {
        return shape_err(format!(
            "embedding: weight {:?} is not [vocab, dim]",
            weight.shape()
        ));
    };
    match weight.dtype() {
        Dtype::F32 => embedding_as::<f32>(q, ids, weight, (vocab, dim)),
        Dtype::Bf16 => embedding_as::<bf16>(q, ids, weight, (vocab, dim)),
        Dtype::F16 => embedding_as::<f16>(q, ids, weight, (vocab, dim)),
    }
}

fn embedding_as<T: Float>(
    q: &dyn Queue,
    ids: &Arc<DeviceBuffer<i32>>,
    weight: &Tensor,
    (vocab, dim): (usize, usize),
) -> Result<Tensor> {
    let k = TransformerKernels::get(q.device())?;
    let tokens = ids.len();
    let geom = (tokens, dim, vocab);
    let y = q.alloc::<T>(numel_checked(&[tokens, dim])?)?;
    k.embed_fwd(q, ids, weight.data_as::<T>()?, &y, geom)?;
    let ids = ids.clone();
    let w_type = weight.dtype();
    let node = Node {
        unit_backward: None,
        inputs: vec![weight.clone()],
        name: "embedding",
        backward: Box::new(move |q, _nn, g| {
            let k = TransformerKernels::get(q.device())?;
            let dw = q.alloc_zeroed::<f32>(numel_checked(&[vocab, dim])?)?;
            k.embed_bwd(q, &ids, g.data_as::<T>()?, &dw, geom)?;
            Ok(vec![Some(grad_in(q, dw, w_type, &[vocab, dim])?)])
        }),
    };
    Ok(Tensor::from_op_typed(
        TypedBuffer::new(Arc::new(y)),
        vec![tokens, dim],
        Some(node),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 3.2's rope scaling (factor 32, low 1, high 4, 8192 original positions, theta
    /// 500000, head_dim 64), against numbers worked out by hand from Hugging Face's formula:
    /// `f_k = 500000^(-k/32)`, wavelength `2π / f_k`; the high-frequency bound is
    /// 8192 / 4 = 2048 and the low one 8192. `2π · 500000^(k/32)` is 1956.5 at k = 14 (kept),
    /// 2948.3 at k = 15, 4442.9 at k = 16 (`2π · √500000`), 6695.1 at k = 17 (smoothed) and
    /// 10089.1 at k = 18 (divided by 32). At k = 16: s = (8192 / 4442.8829 - 1) / 3 =
    /// 0.2812826…, scale = (1 - s) / 32 + s = 0.3037425….
    #[test]
    fn llama3_scaling_matches_the_formula_worked_by_hand() {
        let s = Llama3RopeScaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let scale = llama3_frequency_scale(64, 500_000.0, &s).unwrap();
        assert_eq!(scale.len(), 32);
        for (k, v) in scale.iter().enumerate().take(15) {
            assert_eq!(*v, 1.0, "k = {k} is a high frequency");
        }
        for (k, v) in scale.iter().enumerate().skip(18) {
            assert_eq!(*v, 1.0 / 32.0, "k = {k} is a low frequency");
        }
        let want = [
            (15, 0.6055727545341233),
            (16, 0.3037425237518995),
            (17, 0.10344760903071981),
        ];
        for (k, w) in want {
            assert!((scale[k] - w).abs() < 1e-12, "k = {k}: {} vs {w}", scale[k]);
        }
        // By hand at k = 16, from the decimal values in the comment above.
        let s16: f64 = (8192.0 / 4442.882938158366 - 1.0) / 3.0;
        assert!((s16 - 0.2812826).abs() < 1e-7);
        assert!(((1.0 - s16) / 32.0 + s16 - scale[16]).abs() < 1e-12);
        // The frequencies themselves: 1 at k = 0, 1/√500000 at k = 16.
        let f = rope_inv_freq(64, 500_000.0);
        assert_eq!(f[0], 1.0);
        assert!((f[16] - 1.0 / 500_000f64.sqrt()).abs() < 1e-15);
        // Scaled frequency at k = 31: 500000^(-31/32) / 32.
        assert!((f[31] * scale[31] - 9.41830672543491e-08).abs() < 1e-20);
    }

    #[test]
    fn llama3_scaling_refuses_bad_factors() {
        let good = Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        assert!(llama3_frequency_scale(128, 500_000.0, &good).is_ok());
        for bad in [
            Llama3RopeScaling {
                factor: 0.0,
                ..good
            },
            Llama3RopeScaling {
                high_freq_factor: 1.0,
                ..good
            },
            Llama3RopeScaling {
                original_max_position_embeddings: f64::NAN,
                ..good
            },
        ] {
            assert!(matches!(
                llama3_frequency_scale(128, 500_000.0, &bad),
                Err(NnError::Shape(_))
            ));
        }
        assert!(llama3_frequency_scale(128, -1.0, &good).is_err());
    }
}
