//! Differentiable operations. Each allocates its output from the queue (the capture's pool
//! when capturing), launches its kernels, and records how to compute input gradients.

use std::rc::Rc;

use cudagraph::{args, DeviceBuffer, LaunchConfig};

use crate::blas::Trans;
use crate::error::{NnError, Result};
use crate::exec::Exec;
use crate::gemm::{engine_from_env, gemm};
use crate::kernels::Nn;
use crate::tensor::{Node, Tensor};

fn elems(n: usize) -> LaunchConfig {
    LaunchConfig::for_elements(n, 256)
}

fn shape_err<T>(msg: String) -> Result<T> {
    Err(NnError::Shape(msg))
}

/// `y = x · wᵀ + b`, optionally followed by ReLU (fused into the bias kernel).
/// `x: [m, k]`, `w: [n, k]` (PyTorch's Linear layout), `b: [n]`.
pub fn linear(
    q: &dyn Exec,
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
    let nn = Nn::get(q.device())?;
    let y = q.alloc_f32(m * n)?;
    if relu && b.is_none() {
        return shape_err("linear: a fused ReLU needs a bias".into());
    }
    let engine = engine_from_env();
    gemm(
        q,
        &nn,
        engine,
        (Trans::N, Trans::T),
        (m, n, k),
        1.0,
        x.data(),
        w.data(),
        0.0,
        &y,
        b.map(|b| b.data()),
        relu,
    )?;
    let mut inputs = vec![x.clone(), w.clone()];
    if let Some(b) = b {
        inputs.push(b.clone());
    }
    let y = Rc::new(y);
    let saved_y = relu.then(|| y.clone());
    let (xd, wd) = (x.data_rc().clone(), w.data_rc().clone());
    let (need_x, need_w, need_b) = (
        x.requires_grad(),
        w.requires_grad(),
        b.is_some_and(|b| b.requires_grad()),
    );
    let node = Node {
        inputs,
        name: if relu { "linear_relu" } else { "linear" },
        backward: Box::new(move |q, nn, g| {
            // Through the ReLU first: dz = g where y > 0.
            let dz = match &saved_y {
                Some(y) => {
                    let dz = q.alloc_f32(m * n)?;
                    q.launch(
                        &nn.k.relu_bwd,
                        elems(m * n),
                        args![g.data(), y.as_ref(), &dz, (m * n) as i64],
                    )?;
                    Rc::new(dz)
                }
                None => g.data_rc().clone(),
            };
            let dx = if need_x {
                let dx = q.alloc_f32(m * k)?;
                let (t, d) = ((Trans::N, Trans::N), (m, k, n));
                gemm(q, nn, engine, t, d, 1.0, &dz, &wd, 0.0, &dx, None, false)?;
                Some(Tensor::from_buffer(Rc::new(dx), &[m, k])?)
            } else {
                None
            };
            let dw = if need_w {
                let dw = q.alloc_f32(n * k)?;
                let (t, d) = ((Trans::T, Trans::N), (n, k, m));
                gemm(q, nn, engine, t, d, 1.0, &dz, &xd, 0.0, &dw, None, false)?;
                Some(Tensor::from_buffer(Rc::new(dw), &[n, k])?)
            } else {
                None
            };
            let db = if need_b {
                let db = q.alloc_f32(n)?;
                q.launch(
                    &nn.k.col_sum,
                    LaunchConfig::linear(n as u32, 256),
                    args![dz.as_ref(), &db, m as i32, n as i32],
                )?;
                Some(Tensor::from_buffer(Rc::new(db), &[n])?)
            } else {
                None
            };
            Ok(vec![dx, dw, db])
        }),
    };
    Ok(Tensor::from_op_shared(y, vec![m, n], Some(node)))
}

/// `max(x, 0)`.
pub fn relu(q: &dyn Exec, x: &Tensor) -> Result<Tensor> {
    let nn = Nn::get(q.device())?;
    let n = x.numel();
    let y = Rc::new(q.alloc_f32(n)?);
    q.launch(
        &nn.k.relu_fwd,
        elems(n),
        args![x.data(), y.as_ref(), n as i64],
    )?;
    let saved = y.clone();
    let shape = x.shape().to_vec();
    let node = Node {
        inputs: vec![x.clone()],
        name: "relu",
        backward: Box::new(move |q, nn, g| {
            let dx = q.alloc_f32(n)?;
            q.launch(
                &nn.k.relu_bwd,
                elems(n),
                args![g.data(), saved.as_ref(), &dx, n as i64],
            )?;
            Ok(vec![Some(Tensor::from_buffer(Rc::new(dx), &shape)?)])
        }),
    };
    Ok(Tensor::from_op_shared(y, x.shape().to_vec(), Some(node)))
}

/// How a loss reduces over elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    Sum,
    Mean,
}

/// Squared error between `pred` and `target` (same shape), summed or averaged.
pub fn mse_loss(
    q: &dyn Exec,
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
    let nn = Nn::get(q.device())?;
    let n = pred.numel();
    let scale = match reduction {
        Reduction::Sum => 1.0,
        Reduction::Mean => 1.0 / n as f32,
    };
    let loss = q.alloc_f32(1)?;
    // Two passes, deterministic: up to 256 blocks of partial sums, then one block adds them.
    let blocks = n.div_ceil(1024).clamp(1, 256);
    let partial = q.alloc_f32(blocks)?;
    q.launch(
        &nn.k.mse_partial,
        LaunchConfig::linear(blocks as u32, 256),
        args![pred.data(), target.data(), &partial, n as i64],
    )?;
    q.launch(
        &nn.k.sum_partials,
        LaunchConfig::linear(1, 256),
        args![&partial, blocks as i32, &loss, scale],
    )?;
    let (p, t) = (pred.data_rc().clone(), target.data_rc().clone());
    let shape = pred.shape().to_vec();
    let node = Node {
        inputs: vec![pred.clone(), target.clone()],
        name: "mse_loss",
        backward: Box::new(move |q, nn, g| {
            let dp = q.alloc_f32(n)?;
            q.launch(
                &nn.k.mse_bwd,
                elems(n),
                args![p.as_ref(), t.as_ref(), g.data(), &dp, n as i64, scale],
            )?;
            Ok(vec![Some(Tensor::from_buffer(Rc::new(dp), &shape)?), None])
        }),
    };
    Ok(Tensor::from_op(loss, vec![1], Some(node)))
}

/// Softmax cross-entropy of `logits: [m, c]` against class indices `targets: [m]`, mean over rows.
pub fn cross_entropy(
    q: &dyn Exec,
    logits: &Tensor,
    targets: &Rc<DeviceBuffer<i32>>,
) -> Result<Tensor> {
    let s = logits.shape();
    if s.len() != 2 || targets.len() != s[0] {
        return shape_err(format!(
            "cross_entropy: logits {s:?} with {} targets",
            targets.len()
        ));
    }
    let (m, c) = (s[0], s[1]);
    let nn = Nn::get(q.device())?;
    let probs = Rc::new(q.alloc_f32(m * c)?);
    let loss = q.alloc_f32(1)?;
    q.hold(targets.block());
    q.launch(
        &nn.k.ce_fwd,
        LaunchConfig::linear(1, 256),
        args![
            logits.data(),
            targets.as_ref(),
            probs.as_ref(),
            &loss,
            m as i32,
            c as i32
        ],
    )?;
    let tg = targets.clone();
    let node = Node {
        inputs: vec![logits.clone()],
        name: "cross_entropy",
        backward: Box::new(move |q, nn, g| {
            let dz = q.alloc_f32(m * c)?;
            q.launch(
                &nn.k.ce_bwd,
                elems(m * c),
                args![
                    probs.as_ref(),
                    tg.as_ref(),
                    g.data(),
                    &dz,
                    m as i32,
                    c as i32
                ],
            )?;
            Ok(vec![Some(Tensor::from_buffer(Rc::new(dz), &[m, c])?)])
        }),
    };
    Ok(Tensor::from_op(loss, vec![1], Some(node)))
}

/// Geometry of a 2-D convolution.
#[derive(Clone, Copy, Debug)]
struct ConvGeom {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    oc: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    stride: usize,
    pad: usize,
}

impl ConvGeom {
    /// Kernel arguments: the buffers, then the eleven geometry integers every conv kernel takes
    /// in the same order.
    fn launch_args<'a>(&self, bufs: &[cudagraph::Arg<'a>]) -> Vec<cudagraph::Arg<'a>> {
        let mut v = bufs.to_vec();
        v.extend(self.args().map(cudagraph::Arg::I32));
        v
    }

    fn args(&self) -> [i32; 11] {
        [
            self.n,
            self.c,
            self.h,
            self.w,
            self.oc,
            self.kh,
            self.kw,
            self.oh,
            self.ow,
            self.stride,
            self.pad,
        ]
        .map(|v| v as i32)
    }
}

/// NCHW convolution: `x: [n, c, h, w]`, `w: [oc, c, kh, kw]`, `b: [oc]`.
pub fn conv2d(
    q: &dyn Exec,
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
    if xs[2] + 2 * pad < ws[2] || xs[3] + 2 * pad < ws[3] {
        return shape_err(format!(
            "conv2d: kernel {ws:?} larger than padded input {xs:?}"
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
        oh: (xs[2] + 2 * pad - ws[2]) / stride + 1,
        ow: (xs[3] + 2 * pad - ws[3]) / stride + 1,
        stride,
        pad,
    };
    if let Some(b) = b {
        if b.shape() != [g.oc] {
            return shape_err(format!(
                "conv2d: bias {:?} for {} channels",
                b.shape(),
                g.oc
            ));
        }
    }
    let nn = Nn::get(q.device())?;
    let total = g.n * g.oc * g.oh * g.ow;
    let y = q.alloc_f32(total)?;
    let bias = match b {
        Some(b) => b.data().arg_at(0),
        None => cudagraph::Arg::U64(0),
    };
    let ckk = g.c * g.kh * g.kw;
    let weights_bytes = g.oc * ckk * 4;
    let (kernel, cfg) = if ckk <= 32 && weights_bytes <= 48 * 1024 {
        let mut cfg = LaunchConfig::for_elements(g.n * g.oh * g.ow, 128);
        cfg.shared_mem_bytes = weights_bytes as u32;
        (&nn.k.conv2d_fwd_small, cfg)
    } else {
        (&nn.k.conv2d_fwd, elems(total))
    };
    q.launch(
        kernel,
        cfg,
        &g.launch_args(&[x.data().into(), w.data().into(), bias, (&y).into()]),
    )?;
    let mut inputs = vec![x.clone(), w.clone()];
    if let Some(b) = b {
        inputs.push(b.clone());
    }
    let (xd, wd) = (x.data_rc().clone(), w.data_rc().clone());
    let (need_x, need_w, need_b) = (
        x.requires_grad(),
        w.requires_grad(),
        b.is_some_and(|b| b.requires_grad()),
    );
    let node = Node {
        inputs,
        name: "conv2d",
        backward: Box::new(move |q, nn, gy| {
            let dx = if need_x {
                let n_in = g.n * g.c * g.h * g.w;
                let dx = q.alloc_f32(n_in)?;
                q.launch(
                    &nn.k.conv2d_bwd_input,
                    elems(n_in),
                    &g.launch_args(&[gy.data().into(), wd.as_ref().into(), (&dx).into()]),
                )?;
                Some(Tensor::from_buffer(Rc::new(dx), &[g.n, g.c, g.h, g.w])?)
            } else {
                None
            };
            let dw = if need_w {
                let nw = g.oc * g.c * g.kh * g.kw;
                let dw = q.alloc_f32(nw)?;
                q.launch(
                    &nn.k.conv2d_bwd_weight,
                    LaunchConfig::linear(nw as u32, 256),
                    &g.launch_args(&[gy.data().into(), xd.as_ref().into(), (&dw).into()]),
                )?;
                Some(Tensor::from_buffer(Rc::new(dw), &[g.oc, g.c, g.kh, g.kw])?)
            } else {
                None
            };
            let db = if need_b {
                let db = q.alloc_f32(g.oc)?;
                q.launch(
                    &nn.k.channel_sum,
                    LaunchConfig::linear(g.oc as u32, 256),
                    args![
                        gy.data(),
                        &db,
                        g.n as i32,
                        g.oc as i32,
                        (g.oh * g.ow) as i32
                    ],
                )?;
                Some(Tensor::from_buffer(Rc::new(db), &[g.oc])?)
            } else {
                None
            };
            Ok(vec![dx, dw, db])
        }),
    };
    Ok(Tensor::from_op(y, vec![g.n, g.oc, g.oh, g.ow], Some(node)))
}

/// Max pooling over `k×k` windows with stride `s` on `x: [n, c, h, w]`.
pub fn max_pool2d(q: &dyn Exec, x: &Tensor, k: usize, s: usize) -> Result<Tensor> {
    let xs = x.shape();
    if xs.len() != 4 || k == 0 || s == 0 || xs[2] < k || xs[3] < k {
        return shape_err(format!("max_pool2d: input {xs:?}, window {k}, stride {s}"));
    }
    let (planes, h, w) = (xs[0] * xs[1], xs[2], xs[3]);
    let (oh, ow) = ((h - k) / s + 1, (w - k) / s + 1);
    let nn = Nn::get(q.device())?;
    let total = planes * oh * ow;
    let y = q.alloc_f32(total)?;
    let idx = Rc::new(q.alloc_i32(total)?);
    q.launch(
        &nn.k.maxpool_fwd,
        elems(total),
        args![
            x.data(),
            &y,
            idx.as_ref(),
            planes as i32,
            h as i32,
            w as i32,
            k as i32,
            s as i32,
            oh as i32,
            ow as i32
        ],
    )?;
    let in_shape = xs.to_vec();
    let n_in = x.numel();
    let node = Node {
        inputs: vec![x.clone()],
        name: "max_pool2d",
        backward: Box::new(move |q, nn, g| {
            let dx = q.alloc_f32(n_in)?;
            q.zero(&dx)?;
            q.launch(
                &nn.k.maxpool_bwd,
                elems(total),
                args![g.data(), idx.as_ref(), &dx, total as i64],
            )?;
            Ok(vec![Some(Tensor::from_buffer(Rc::new(dx), &in_shape)?)])
        }),
    };
    Ok(Tensor::from_op(y, vec![xs[0], xs[1], oh, ow], Some(node)))
}

/// `[n, ...] -> [n, prod(...)]`.
pub fn flatten(x: &Tensor) -> Result<Tensor> {
    let s = x.shape();
    if s.is_empty() {
        return shape_err("flatten: scalar input".into());
    }
    x.reshape(&[s[0], s[1..].iter().product()])
}
