//! Differentiable operations. Each allocates its output from the queue (the capture's pool
//! when capturing), launches its kernels through the checked functions of `crate::kernels`,
//! and records how to compute input gradients.

use std::sync::Arc;

use cudagraph::memory::{bf16, f16};
use cudagraph::{DeviceBuffer, Queue, QueueExt};

use crate::autograd::autocast::{compute_dtype, widen};
use crate::autograd::mixed::{conv2d_lowp, linear_lowp};
use crate::autograd::tensor::{grad_enabled, numel_checked, Node, Tensor};
use crate::dtype::{Dtype, Float, TypedBuffer};
use crate::engine::conv::{conv2d_backward_data, conv2d_backward_filter, conv2d_forward};
use crate::engine::gemm::{gemm, linear_weight_grad, GemmFamily, Trans};
use crate::engine::{CeEngine, Engines};
use crate::error::{NnError, Result};
use crate::extent::ConvGeom;
use crate::kernels::losses::{ce_group_plans, LossKernels};
/// How [`cross_entropy`] runs: its fixed plan for a shape and the options measured beside it.
pub use crate::kernels::losses::{ce_plan, ce_plan_with, CeOptions, CePlan, CE_FUSED_ROWS};
use crate::kernels::lowp::LowpKernels;
use crate::kernels::Nn;
use crate::random::Generator;

fn shape_err<T>(msg: String) -> Result<T> {
    Err(NnError::Shape(msg))
}

fn alloc(q: &dyn Queue, n: usize) -> Result<DeviceBuffer<f32>> {
    Ok(q.alloc::<f32>(n)?)
}

/// A backward closure's result: a gradient in a buffer it has just allocated, which autograd
/// may adopt or add into (see [`Tensor::gradient`]).
fn grad_tensor(buf: DeviceBuffer<f32>, shape: &[usize]) -> Result<Tensor> {
    Tensor::gradient(buf, shape)
}

/// `y = x · wᵀ + b`, optionally followed by ReLU (fused into the product's epilogue).
/// `x: [m, k]`, `w: [n, k]` (PyTorch's Linear layout), `b: [n]`.
///
/// Inside [`autocast`](crate::autocast) the product runs in the scope's type (bf16 or f16, on
/// tensor cores, f32 accumulation) whatever the inputs' types, and `y` has that type; outside
/// it the inputs must share one type (`NnError::Dtype` otherwise), which is `y`'s. Each input's
/// gradient comes in its own type.
pub fn linear(
    q: &dyn Queue,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    relu: bool,
) -> Result<Tensor> {
    let (xs, ws) = (x.shape(), w.shape());
    if xs.len() != 2 || ws.len() != 2 || xs[1] != ws[1] {
        return shape_err(format!(
            "linear: input {xs:?} and weight {ws:?} do not match"
        ));
    }
    let (m, k, n) = (xs[0], xs[1], ws[0]);
    if let Some(b) = b {
        if b.shape() != [n] {
            return shape_err(format!("linear: bias {:?} for {n} outputs", b.shape()));
        }
    }
    if relu && b.is_none() {
        return shape_err("linear: a fused ReLU needs a bias".into());
    }
    let mut all = vec![x, w];
    all.extend(b);
    match compute_dtype("linear", &all)? {
        Dtype::F32 => {}
        d => return linear_lowp(q, (x, w, b), relu, (m, k, n), d),
    }
    let nn = Nn::get(q.device())?;
    let mn = crate::autograd::tensor::numel_checked(&[m, n])?;
    let y = alloc(q, mn)?;
    // The registry picks the engine per shape (within CUDAGRAPH_GEMM's family).
    gemm(
        q,
        &nn,
        GemmFamily::Auto,
        (Trans::N, Trans::T),
        (m, n, k),
        1.0,
        x.data()?,
        w.data()?,
        0.0,
        &y,
        b.map(|b| b.data()).transpose()?,
        relu,
    )?;
    let mut inputs = vec![x.clone(), w.clone()];
    if let Some(b) = b {
        inputs.push(b.clone());
    }
    let y = Arc::new(y);
    let saved_y = relu.then(|| y.clone());
    let (xd, wd) = (x.data_arc()?.clone(), w.data_arc()?.clone());
    let (need_x, need_w, need_b) = (
        x.requires_grad(),
        w.requires_grad(),
        b.is_some_and(|b| b.requires_grad()),
    );
    let node = Node {
        unit_backward: None,
        inputs,
        name: if relu { "linear_relu" } else { "linear" },
        backward: Box::new(move |q, nn, g| {
            // Through the ReLU first: dz = g where y > 0.
            let dz = match &saved_y {
                Some(y) => {
                    let dz = alloc(q, mn)?;
                    nn.k.relu_bwd(q, g.data()?, y, &dz, mn)?;
                    Arc::new(dz)
                }
                None => g.data_arc()?.clone(),
            };
            let dx = if need_x {
                let dx = alloc(q, m * k)?;
                let (t, d) = ((Trans::N, Trans::N), (m, k, n));
                gemm(
                    q,
                    nn,
                    GemmFamily::Auto,
                    t,
                    d,
                    1.0,
                    &dz,
                    &wd,
                    0.0,
                    &dx,
                    None,
                    false,
                )?;
                Some(grad_tensor(dx, &[m, k])?)
            } else {
                None
            };
            // dW = dZᵀ·X, with db = Σ_rows dZ fused into it where an engine can.
            let dw = if need_w { Some(alloc(q, n * k)?) } else { None };
            let db = if need_b { Some(alloc(q, n)?) } else { None };
            match (&dw, &db) {
                (Some(dw), db) => {
                    let d = (m, n, k);
                    linear_weight_grad(q, nn, GemmFamily::Auto, d, &dz, &xd, dw, db.as_ref())?;
                }
                (None, Some(db)) => nn.k.col_sum(q, &dz, db, m, n)?,
                (None, None) => {}
            }
            let dw = dw.map(|dw| grad_tensor(dw, &[n, k])).transpose()?;
            let db = db.map(|db| grad_tensor(db, &[n])).transpose()?;
            Ok(vec![dx, dw, db])
        }),
    };
    Ok(Tensor::from_op_shared(y, vec![m, n], Some(node)))
}

/// `max(x, 0)`, in the input's type (NaN kept).
pub fn relu(q: &dyn Queue, x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        Dtype::F32 => relu_f32(q, x),
        Dtype::Bf16 => relu_lowp::<bf16>(q, x),
        Dtype::F16 => relu_lowp::<f16>(q, x),
    }
}

fn relu_f32(q: &dyn Queue, x: &Tensor) -> Result<Tensor> {
    let nn = Nn::get(q.device())?;
    let n = x.numel();
    let y = Arc::new(alloc(q, n)?);
    nn.k.relu_fwd(q, x.data()?, &y, n)?;
    let saved = y.clone();
    let shape = x.shape().to_vec();
    let node = Node {
        unit_backward: None,
        inputs: vec![x.clone()],
        name: "relu",
        backward: Box::new(move |q, nn, g| {
            let dx = alloc(q, n)?;
            nn.k.relu_bwd(q, g.data()?, &saved, &dx, n)?;
            Ok(vec![Some(grad_tensor(dx, &shape)?)])
        }),
    };
    Ok(Tensor::from_op_shared(y, x.shape().to_vec(), Some(node)))
}

fn relu_lowp<T: Float>(q: &dyn Queue, x: &Tensor) -> Result<Tensor> {
    let k = LowpKernels::get(q.device())?;
    let n = x.numel();
    let y = Arc::new(q.alloc::<T>(n)?);
    k.relu_fwd(q, x.data_as::<T>()?, &y)?;
    let saved = y.clone();
    let shape = x.shape().to_vec();
    let node = Node {
        unit_backward: None,
        inputs: vec![x.clone()],
        name: "relu",
        backward: Box::new(move |q, _nn, g| {
            let dx = Arc::new(q.alloc::<T>(n)?);
            LowpKernels::get(q.device())?.relu_bwd(q, g.data_as::<T>()?, &saved, &dx)?;
            Ok(vec![Some(Tensor::gradient_typed(
                TypedBuffer::new(dx),
                &shape,
            )?)])
        }),
    };
    Ok(Tensor::from_op_typed(
        TypedBuffer::new(y),
        x.shape().to_vec(),
        Some(node),
    ))
}

/// How a loss reduces over elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// The sum of the terms (PyTorch's `reduction='sum'`).
    Sum,
    /// The sum divided by the number of terms (PyTorch's `reduction='mean'`).
    Mean,
}

/// Squared error between `pred` and `target` (same shape), summed or averaged.
///
/// One pass computes the loss and, when it will be differentiated, the gradient with respect
/// to `pred` (saved in the autograd node); the backward pass only scales that gradient by the
/// upstream one, in place. The target gets no gradient.
pub fn mse_loss(
    q: &dyn Queue,
    pred: &Tensor,
    target: &Tensor,
    reduction: Reduction,
) -> Result<Tensor> {
    if pred.shape() != target.shape() {
        return shape_err(format!(
            "mse_loss: {:?} vs {:?}",
            pred.shape(),
            target.shape()
        ));
    }
    // An f32 op under autocast: a 16-bit prediction is widened first (exact).
    let (pred, target) = (&widen(q, pred)?, &widen(q, target)?);
    let k = LossKernels::get(q.device())?;
    let n = pred.numel();
    let scale = match reduction {
        Reduction::Sum => 1.0,
        Reduction::Mean => 1.0 / n.max(1) as f32,
    };
    let loss = alloc(q, 1)?;
    let grad = if grad_enabled() && pred.requires_grad() {
        Some(Arc::new(alloc(q, n)?))
    } else {
        None
    };
    k.mse(
        q,
        pred.data()?,
        target.data()?,
        grad.as_deref(),
        &loss,
        n,
        scale,
    )?;
    let Some(grad) = grad else {
        return Ok(Tensor::from_op(loss, vec![1], None));
    };
    let inputs = vec![pred.clone(), target.clone()];
    Ok(saved_grad_loss(
        loss,
        grad,
        pred.shape(),
        inputs,
        "mse_loss",
    ))
}

/// The scalar `loss` of a loss whose forward pass saved the gradient with respect to its first
/// input (shape `shape`; the other inputs get none) for an upstream gradient of one: backward
/// scales it in place by the upstream gradient; from `Tensor::backward()` (an implicit one) it
/// is handed on as it is.
fn saved_grad_loss(
    loss: DeviceBuffer<f32>,
    grad: Arc<DeviceBuffer<f32>>,
    shape: &[usize],
    inputs: Vec<Tensor>,
    name: &'static str,
) -> Tensor {
    let (shape, others) = (shape.to_vec(), inputs.len() - 1);
    let grads = move |grad: &Arc<DeviceBuffer<f32>>| -> Result<Vec<Option<Tensor>>> {
        // The buffer was allocated by the loss and is reachable only through its node, which
        // autograd frees before adopting it (until then the clones keep it from adoption).
        let mut v = vec![Some(Tensor::gradient_shared(grad.clone(), &shape)?)];
        v.extend(std::iter::repeat_n(None, others));
        Ok(v)
    };
    let node = Node {
        inputs,
        name,
        backward: Box::new({
            let (grad, grads) = (grad.clone(), grads.clone());
            move |q, _nn, g| {
                LossKernels::get(q.device())?.scale_by(q, &grad, g.data()?, grad.len())?;
                grads(&grad)
            }
        }),
        unit_backward: Some(Box::new(move |_q, _nn| grads(&grad))),
    };
    Tensor::from_op(loss, vec![1], Some(node))
}

/// Runs the cross-entropy kernels with the registry's plan for `(rows, classes)` (and whether a
/// gradient is written): the fixed plan, or a single block of lane groups where one fits
/// ([`ce_group_plans`]), measured on scratch outputs at the first eager call.
fn ce_run(
    q: &dyn Queue,
    k: &LossKernels,
    logits: &DeviceBuffer<f32>,
    targets: &DeviceBuffer<i32>,
    grad: Option<&DeviceBuffer<f32>>,
    loss: &DeviceBuffer<f32>,
    (m, c): (usize, usize),
) -> Result<()> {
    let opts = CeOptions::from_env()?;
    let base = ce_plan_with(m, c, k.sms(), opts);
    let groups = if opts.groups {
        ce_group_plans(m, c)
    } else {
        Vec::new()
    };
    if groups.is_empty() {
        return k.cross_entropy_planned(q, &base, logits, targets, grad, loss, m, c);
    }
    let plan_of = |a: CeEngine| match a {
        CeEngine::Lanes(l) => groups
            .iter()
            .find(|p| p.lanes == l as u32)
            .copied()
            .unwrap_or(base),
        CeEngine::Rows => base,
    };
    let mut candidates = vec![CeEngine::Rows];
    candidates.extend(groups.iter().map(|p| CeEngine::Lanes(p.lanes as u8)));
    let eng = Engines::get(q.device())?;
    let key = format!(
        "cross_entropy rows={m} classes={c}{}",
        if grad.is_some() { " grad" } else { "" }
    );
    let mut scratch: Option<(DeviceBuffer<f32>, Option<DeviceBuffer<f32>>)> = None;
    let algo = eng.choose(q, &key, None, &candidates, CeEngine::Rows, &mut |q, a| {
        if scratch.is_none() {
            let g = match grad {
                Some(g) => Some(q.alloc::<f32>(g.len())?),
                None => None,
            };
            scratch = Some((q.alloc::<f32>(1)?, g));
        }
        let (l, g) = scratch.as_ref().expect("allocated above");
        k.cross_entropy_planned(q, &plan_of(a), logits, targets, g.as_ref(), l, m, c)
    })?;
    k.cross_entropy_planned(q, &plan_of(algo), logits, targets, grad, loss, m, c)
}

/// Softmax cross-entropy of `logits: [m, c]` against class indices `targets: [m]`, mean over
/// rows. Row-parallel for any number of classes; the gradient `(softmax − onehot) / m` is
/// computed in the same pass when the loss will be differentiated, and the backward pass only
/// scales it by the upstream gradient, in place.
///
/// Targets must lie in `[0, c)`. The kernel cannot return an error, so a target outside that
/// range is clamped (nothing outside the logits is read) and raises the device's error flag:
/// the next synchronisation of the device (`Stream::synchronize`, `to_vec`,
/// `Graph::replay_checked`) returns `Error::DeviceCheck` naming the bad value and its row.
/// [`Targets::from_host`] checks host data before it is uploaded.
pub fn cross_entropy(
    q: &dyn Queue,
    logits: &Tensor,
    targets: &Arc<DeviceBuffer<i32>>,
) -> Result<Tensor> {
    let s = logits.shape();
    if s.len() != 2 || targets.len() != s[0] || s[0] == 0 || s[1] == 0 {
        return shape_err(format!(
            "cross_entropy: logits {s:?} with {} targets",
            targets.len()
        ));
    }
    let (m, c) = (s[0], s[1]);
    // An f32 op under autocast: 16-bit logits are widened first (exact).
    let logits = &widen(q, logits)?;
    let k = LossKernels::get(q.device())?;
    let mc = crate::autograd::tensor::numel_checked(&[m, c])?;
    let loss = alloc(q, 1)?;
    let grad = if grad_enabled() && logits.requires_grad() {
        Some(Arc::new(alloc(q, mc)?))
    } else {
        None
    };
    ce_run(
        q,
        &k,
        logits.data()?,
        targets,
        grad.as_deref(),
        &loss,
        (m, c),
    )?;
    let Some(grad) = grad else {
        return Ok(Tensor::from_op(loss, vec![1], None));
    };
    Ok(saved_grad_loss(
        loss,
        grad,
        &[m, c],
        vec![logits.clone()],
        "cross_entropy",
    ))
}

/// Class indices checked on the host before they reach the device.
pub struct Targets;

impl Targets {
    /// Uploads `targets` after checking each lies in `[0, classes)`: a bad value is an
    /// immediate `NnError::Shape` naming it and its position.
    pub fn from_host(
        s: &cudagraph::Stream,
        targets: &[i32],
        classes: usize,
    ) -> Result<Arc<DeviceBuffer<i32>>> {
        if let Some((i, t)) = targets
            .iter()
            .enumerate()
            .find(|(_, &t)| t < 0 || t as usize >= classes)
        {
            return shape_err(format!(
                "target {t} at position {i} is outside [0, {classes})"
            ));
        }
        Ok(Arc::new(s.alloc_from_host(targets)?))
    }
}

/// NCHW convolution: `x: [n, c, h, w]`, `w: [oc, c, kh, kw]`, `b: [oc]`.
///
/// Inside [`autocast`](crate::autocast) it runs in the scope's type (bf16 or f16, cuDNN on
/// tensor cores with f32 accumulation, NHWC engines competing) and `y` has that type; outside
/// it the inputs must share one type. Each input's gradient comes in its own type.
pub fn conv2d(
    q: &dyn Queue,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    stride: usize,
    pad: usize,
) -> Result<Tensor> {
    let (xs, ws) = (x.shape(), w.shape());
    if xs.len() != 4 || ws.len() != 4 || xs[1] != ws[1] || stride == 0 {
        return shape_err(format!(
            "conv2d: input {xs:?}, weight {ws:?}, stride {stride}"
        ));
    }
    let g = ConvGeom {
        n: xs[0],
        c: xs[1],
        h: xs[2],
        w: xs[3],
        oc: ws[0],
        kh: ws[2],
        kw: ws[3],
        stride,
        pad,
    };
    let (oh, ow) = g.out_hw()?;
    if let Some(b) = b {
        if b.shape() != [g.oc] {
            return shape_err(format!(
                "conv2d: bias {:?} for {} channels",
                b.shape(),
                g.oc
            ));
        }
    }
    let mut all = vec![x, w];
    all.extend(b);
    match compute_dtype("conv2d", &all)? {
        Dtype::F32 => {}
        d => return conv2d_lowp(q, (x, w, b), g, d),
    }
    let nn = Nn::get(q.device())?;
    let y = alloc(q, g.output_len()?)?;
    // The registry picks the engine per geometry (within CUDAGRAPH_CONV's family).
    conv2d_forward(
        q,
        &nn,
        &g,
        x.data()?,
        w.data()?,
        b.map(|b| b.data()).transpose()?,
        &y,
    )?;
    let mut inputs = vec![x.clone(), w.clone()];
    if let Some(b) = b {
        inputs.push(b.clone());
    }
    let (xd, wd) = (x.data_arc()?.clone(), w.data_arc()?.clone());
    let (need_x, need_w, need_b) = (
        x.requires_grad(),
        w.requires_grad(),
        b.is_some_and(|b| b.requires_grad()),
    );
    let node = Node {
        unit_backward: None,
        inputs,
        name: "conv2d",
        backward: Box::new(move |q, nn, gy| {
            let dx = if need_x {
                let dx = alloc(q, g.input_len()?)?;
                conv2d_backward_data(q, nn, &g, gy.data()?, &wd, &dx)?;
                Some(grad_tensor(dx, &[g.n, g.c, g.h, g.w])?)
            } else {
                None
            };
            let dw = if need_w {
                let dw = alloc(q, g.weight_len()?)?;
                conv2d_backward_filter(q, nn, &g, gy.data()?, &xd, &dw)?;
                Some(grad_tensor(dw, &[g.oc, g.c, g.kh, g.kw])?)
            } else {
                None
            };
            let db = if need_b {
                let db = alloc(q, g.oc)?;
                nn.k.channel_sum(q, gy.data()?, &db, g.n, g.oc, oh * ow)?;
                Some(grad_tensor(db, &[g.oc])?)
            } else {
                None
            };
            Ok(vec![dx, dw, db])
        }),
    };
    Ok(Tensor::from_op(y, vec![g.n, g.oc, oh, ow], Some(node)))
}

/// Max pooling over `k×k` windows with stride `s` on `x: [n, c, h, w]`.
pub fn max_pool2d(q: &dyn Queue, x: &Tensor, k: usize, s: usize) -> Result<Tensor> {
    let xs = x.shape();
    if xs.len() != 4 || k == 0 || s == 0 || xs[2] < k || xs[3] < k {
        return shape_err(format!("max_pool2d: input {xs:?}, window {k}, stride {s}"));
    }
    match x.dtype() {
        Dtype::F32 => {}
        Dtype::Bf16 => return max_pool2d_lowp::<bf16>(q, x, k, s),
        Dtype::F16 => return max_pool2d_lowp::<f16>(q, x, k, s),
    }
    let planes = xs[0] * xs[1];
    let (oh, ow) = ((xs[2] - k) / s + 1, (xs[3] - k) / s + 1);
    let nn = Nn::get(q.device())?;
    let total = crate::autograd::tensor::numel_checked(&[planes, oh, ow])?;
    let y = alloc(q, total)?;
    let idx = Arc::new(q.alloc::<i32>(total)?);
    nn.k.maxpool_fwd(q, x.data()?, &y, &idx, planes, (xs[2], xs[3]), k, s)?;
    let in_shape = xs.to_vec();
    let n_in = x.numel();
    let node = Node {
        unit_backward: None,
        inputs: vec![x.clone()],
        name: "max_pool2d",
        backward: Box::new(move |q, nn, g| {
            let dx = q.alloc_zeroed::<f32>(n_in)?;
            nn.k.maxpool_bwd(q, g.data()?, &idx, &dx, total)?;
            Ok(vec![Some(grad_tensor(dx, &in_shape)?)])
        }),
    };
    Ok(Tensor::from_op(y, vec![xs[0], xs[1], oh, ow], Some(node)))
}

/// [`max_pool2d`] of a 16-bit tensor: values selected as they are; the backward pass scatters
/// into an f32 gradient (atomic adds) and rounds it to the input's type once.
fn max_pool2d_lowp<T: Float>(q: &dyn Queue, x: &Tensor, k: usize, s: usize) -> Result<Tensor> {
    let xs = x.shape();
    let planes = numel_checked(&xs[..2])?;
    let (oh, ow) = ((xs[2] - k) / s + 1, (xs[3] - k) / s + 1);
    let lk = LowpKernels::get(q.device())?;
    let total = numel_checked(&[planes, oh, ow])?;
    let y = Arc::new(q.alloc::<T>(total)?);
    let idx = Arc::new(q.alloc::<i32>(total)?);
    lk.maxpool_fwd(q, x.data_as::<T>()?, &y, &idx, planes, (xs[2], xs[3]), k, s)?;
    let in_shape = xs.to_vec();
    let n_in = x.numel();
    let node = Node {
        unit_backward: None,
        inputs: vec![x.clone()],
        name: "max_pool2d",
        backward: Box::new(move |q, _nn, g| {
            let lk = LowpKernels::get(q.device())?;
            let dx = q.alloc_zeroed::<f32>(n_in)?;
            lk.maxpool_bwd(q, g.data_as::<T>()?, &idx, &dx, total)?;
            let dx = crate::kernels::cast::cast_new(q, &TypedBuffer::F32(Arc::new(dx)), T::DTYPE)?;
            Ok(vec![Some(Tensor::gradient_typed(dx, &in_shape)?)])
        }),
    };
    Ok(Tensor::from_op_typed(
        TypedBuffer::new(y),
        vec![xs[0], xs[1], oh, ow],
        Some(node),
    ))
}

/// `[n, ...] -> [n, prod(...)]`.
pub fn flatten(x: &Tensor) -> Result<Tensor> {
    let s = x.shape();
    if s.is_empty() {
        return shape_err("flatten: scalar input".into());
    }
    x.reshape(&[s[0], s[1..].iter().product()])
}

/// A tensor of uniform numbers in `[0, 1)` (PyTorch's `torch.rand`).
pub fn rand(q: &dyn Queue, gen: &Generator, shape: &[usize]) -> Result<Tensor> {
    let b = q.alloc::<f32>(numel_checked(shape)?)?;
    gen.fill_uniform(q, &b, 0.0, 1.0)?;
    Tensor::from_buffer(Arc::new(b), shape)
}

/// A tensor of standard normal numbers (PyTorch's `torch.randn`).
pub fn randn(q: &dyn Queue, gen: &Generator, shape: &[usize]) -> Result<Tensor> {
    let b = q.alloc::<f32>(numel_checked(shape)?)?;
    gen.fill_normal(q, &b, 0.0, 1.0)?;
    Tensor::from_buffer(Arc::new(b), shape)
}

/// Dropout (PyTorch's `F.dropout(x, p, training)`): in training, each element is zeroed with
/// probability `p` and the others are scaled by `1 / (1 − p)`; otherwise (or with `p = 0`)
/// `x` itself. The numbers come from `gen` (reserved now, drawn when the kernel runs; see
/// [`crate::random`]), and the keep-mask is saved (one bit per element) for the backward pass.
pub fn dropout(
    q: &dyn Queue,
    x: &Tensor,
    p: f32,
    training: bool,
    gen: &Generator,
) -> Result<Tensor> {
    if !(0.0..=1.0).contains(&p) {
        return shape_err(format!(
            "dropout probability has to be between 0 and 1, but got {p}"
        ));
    }
    if x.dtype() != Dtype::F32 && training && p != 0.0 {
        // A 16-bit tensor: the mask and scaling in f32 between exact widening and one rounding
        // back (differentiable through both casts).
        let wide = x.to_dtype(q, Dtype::F32)?;
        return dropout(q, &wide, p, training, gen)?.to_dtype(q, x.dtype());
    }
    if !training || p == 0.0 {
        return Ok(x.clone());
    }
    let n = x.numel();
    let k = crate::kernels::philox::PhiloxKernels::get(q.device())?;
    let (threshold, scale) = crate::random::dropout_params(p);
    let offset = gen.reserve(n)?;
    let y = alloc(q, n)?;
    let mask = Arc::new(q.alloc::<u32>(n.div_ceil(32))?);
    k.dropout_fwd(
        q,
        gen.state(),
        offset,
        x.data()?,
        &y,
        &mask,
        n,
        threshold,
        scale,
    )?;
    gen.drew(q)?;
    let shape = x.shape().to_vec();
    let node = Node {
        unit_backward: None,
        inputs: vec![x.clone()],
        name: "dropout",
        backward: Box::new(move |q, _nn, g| {
            let k = crate::kernels::philox::PhiloxKernels::get(q.device())?;
            let dx = alloc(q, n)?;
            k.dropout_bwd(q, g.data()?, &mask, &dx, n, scale)?;
            Ok(vec![Some(grad_tensor(dx, &shape)?)])
        }),
    };
    Ok(Tensor::from_op(y, x.shape().to_vec(), Some(node)))
}

/// `a + b` for two tensors of one shape (a residual connection), as PyTorch's `a + b`: in
/// their type when they share one; otherwise both are widened to f32 first (PyTorch's type
/// promotion: a 16-bit tensor plus an f32 one, or bf16 plus f16, gives f32), also inside
/// autocast (`add` is on none of its lists). Computed in f32 and rounded once. The gradient of
/// each input is the output's gradient (in the input's own type through the widening).
pub fn add(q: &dyn Queue, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.shape() != b.shape() {
        return shape_err(format!("add: {:?} and {:?} differ", a.shape(), b.shape()));
    }
    if a.dtype() != b.dtype() {
        return add(q, &widen(q, a)?, &widen(q, b)?);
    }
    let n = a.numel();
    let y = match (a.buffer(), b.buffer()) {
        (TypedBuffer::F32(x), TypedBuffer::F32(z)) => {
            let y = q.alloc::<f32>(n)?;
            q.copy_range(x, 0, &y, 0, n)?;
            Nn::get(q.device())?.k.add_inplace(q, &y, z)?;
            TypedBuffer::new(Arc::new(y))
        }
        (TypedBuffer::Bf16(x), TypedBuffer::Bf16(z)) => add_lowp(q, x, z, n)?,
        (TypedBuffer::F16(x), TypedBuffer::F16(z)) => add_lowp(q, x, z, n)?,
        (x, z) => {
            return Err(NnError::Dtype {
                what: "add",
                expected: x.dtype().name(),
                found: z.dtype().name(),
            })
        }
    };
    let (need_a, need_b) = (a.requires_grad(), b.requires_grad());
    let node = Node {
        unit_backward: None,
        inputs: vec![a.clone(), b.clone()],
        name: "add",
        // Both inputs get the upstream gradient itself: autograd copies a shared gradient
        // before it adds into it, so handing it to both is safe.
        backward: Box::new(move |_q, _nn, g| {
            Ok(vec![need_a.then(|| g.clone()), need_b.then(|| g.clone())])
        }),
    };
    Ok(Tensor::from_op_typed(y, a.shape().to_vec(), Some(node)))
}

/// `x + z` (first `n` elements) into a new 16-bit buffer.
fn add_lowp<T: Float>(
    q: &dyn Queue,
    x: &DeviceBuffer<T>,
    z: &DeviceBuffer<T>,
    n: usize,
) -> Result<TypedBuffer> {
    let y = q.alloc::<T>(n)?;
    q.copy_range(x, 0, &y, 0, n)?;
    LowpKernels::get(q.device())?.add_inplace(q, &y, z)?;
    Ok(TypedBuffer::new(Arc::new(y)))
}
