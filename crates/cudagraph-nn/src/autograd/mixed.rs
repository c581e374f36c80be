//! The lower-precision forms of the products and convolutions: [`linear`](super::ops::linear)
//! and [`conv2d`](super::ops::conv2d) when they run in bf16 or f16 (inside
//! [`autocast`](super::autocast::autocast), or on 16-bit tensors).
//!
//! The operands are the 16-bit values of the inputs (a parameter's cached cast or copy inside
//! autocast); the autograd inputs stay the tensors the caller passed, and each gets its
//! gradient in its own type. A product writes it straight from the tensor cores (f32 output for
//! an f32 master weight: no 16-bit rounding of the weight gradient and no cast kernel, where
//! PyTorch rounds it to bf16 and widens it again); a convolution computes it in 16 bits and
//! widens it, as PyTorch does (cuDNN has no fast mixed-type weight gradient).

use std::sync::Arc;

use cudagraph::memory::{bf16, f16};
use cudagraph::{DeviceBuffer, Queue, QueueExt};

use crate::autograd::autocast::values_in;
use crate::autograd::tensor::{Node, Tensor};
use crate::dtype::{Dtype, Float, TypedBuffer};
use crate::engine::conv_lowp::{
    conv2d_lowp_backward_data, conv2d_lowp_backward_filter, conv2d_lowp_forward, ConvShape, Layout,
};
use crate::engine::gemm::{GemmOp, Trans};
use crate::engine::gemm_lowp::gemm_lowp;
use crate::error::{NnError, Result};
use crate::extent::ConvGeom;
use crate::ffi::blas::Epilogue;
use crate::kernels::cast::cast_new;
use crate::kernels::lowp::LowpKernels;
use crate::kernels::Nn;

/// `linear` computed in `dtype` (bf16 or f16); shapes already checked by the caller:
/// `x: [m, k]`, `w: [n, k]`, `b: [n]`.
pub(crate) fn linear_lowp(
    q: &dyn Queue,
    (x, w, b): (&Tensor, &Tensor, Option<&Tensor>),
    relu: bool,
    (m, k, n): (usize, usize, usize),
    dtype: Dtype,
) -> Result<Tensor> {
    match dtype {
        Dtype::Bf16 => linear_as::<bf16>(q, (x, w, b), relu, (m, k, n)),
        Dtype::F16 => linear_as::<f16>(q, (x, w, b), relu, (m, k, n)),
        Dtype::F32 => Err(NnError::Dtype {
            what: "linear_lowp",
            expected: "bf16 or f16",
            found: "f32",
        }),
    }
}

/// The buffer of `T` in a [`TypedBuffer`] known to hold `T`.
fn of<T: Float>(b: &TypedBuffer) -> Result<Arc<DeviceBuffer<T>>> {
    b.get::<T>().cloned().ok_or(NnError::Dtype {
        what: "linear operand",
        expected: T::DTYPE.name(),
        found: b.dtype().name(),
    })
}

fn linear_as<T: Float>(
    q: &dyn Queue,
    (x, w, b): (&Tensor, &Tensor, Option<&Tensor>),
    relu: bool,
    (m, k, n): (usize, usize, usize),
) -> Result<Tensor> {
    let nn = Nn::get(q.device())?;
    let xl = of::<T>(&values_in(q, x, T::DTYPE)?)?;
    let wl = of::<T>(&values_in(q, w, T::DTYPE)?)?;
    let bl = b
        .map(|b| values_in(q, b, T::DTYPE).and_then(|v| of::<T>(&v)))
        .transpose()?;
    let mn = crate::autograd::tensor::numel_checked(&[m, n])?;
    let y = Arc::new(q.alloc::<T>(mn)?);
    let op = GemmOp {
        epilogue: match (bl.is_some(), relu) {
            (false, _) => Epilogue::None,
            (true, false) => Epilogue::Bias,
            (true, true) => Epilogue::BiasRelu,
        },
        ..GemmOp::linear(m, n, k)
    };
    gemm_lowp::<T, T>(q, &nn, &op, &xl, &wl, &y, bl.as_deref())?;
    let mut inputs = vec![x.clone(), w.clone()];
    if let Some(b) = b {
        inputs.push(b.clone());
    }
    let saved_y = relu.then(|| y.clone());
    let (dx_type, dw_type, db_type) = (x.dtype(), w.dtype(), b.map(|b| b.dtype()));
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
            let lk = LowpKernels::get(q.device())?;
            let g = g.data_as::<T>()?;
            // Through the ReLU first: dz = g where y > 0.
            let dz = match &saved_y {
                Some(y) => {
                    let dz = Arc::new(q.alloc::<T>(mn)?);
                    lk.relu_bwd(q, g, y, &dz)?;
                    dz
                }
                None => g.clone(),
            };
            // dX = dZ·W, in x's type.
            let dx = if need_x {
                let op = GemmOp {
                    ta: Trans::N,
                    tb: Trans::N,
                    m,
                    n: k,
                    k: n,
                    alpha: 1.0,
                    beta: 0.0,
                    epilogue: Epilogue::None,
                };
                Some(product_into::<T>(q, nn, &op, &dz, &wl, dx_type, &[m, k])?)
            } else {
                None
            };
            // dW = dZᵀ·X, in w's type (f32 for a master weight).
            let dw = if need_w {
                let op = GemmOp {
                    ta: Trans::T,
                    tb: Trans::N,
                    m: n,
                    n: k,
                    k: m,
                    alpha: 1.0,
                    beta: 0.0,
                    epilogue: Epilogue::None,
                };
                Some(product_into::<T>(q, nn, &op, &dz, &xl, dw_type, &[n, k])?)
            } else {
                None
            };
            // db = Σ_rows dZ, summed in f32, in b's type.
            let db = match (need_b, db_type) {
                (true, Some(Dtype::F32)) => {
                    let db = Arc::new(q.alloc::<f32>(n)?);
                    lk.col_sum::<T, f32>(q, &dz, &db, m, n)?;
                    Some(Tensor::gradient_typed(TypedBuffer::new(db), &[n])?)
                }
                (true, Some(_)) => {
                    let db = Arc::new(q.alloc::<T>(n)?);
                    lk.col_sum::<T, T>(q, &dz, &db, m, n)?;
                    Some(Tensor::gradient_typed(TypedBuffer::new(db), &[n])?)
                }
                _ => None,
            };
            Ok(vec![dx, dw, db])
        }),
    };
    Ok(Tensor::from_op_typed(
        TypedBuffer::new(y),
        vec![m, n],
        Some(node),
    ))
}

/// `op` on 16-bit operands into a new gradient of type `out` (`T` itself or f32).
fn product_into<T: Float>(
    q: &dyn Queue,
    nn: &Nn,
    op: &GemmOp,
    a: &DeviceBuffer<T>,
    b: &DeviceBuffer<T>,
    out: Dtype,
    shape: &[usize],
) -> Result<Tensor> {
    let len = op.m * op.n;
    let buf = if out == Dtype::F32 {
        let c = Arc::new(q.alloc::<f32>(len)?);
        gemm_lowp::<T, f32>(q, nn, op, a, b, &c, None)?;
        TypedBuffer::new(c)
    } else if out == T::DTYPE {
        let c = Arc::new(q.alloc::<T>(len)?);
        gemm_lowp::<T, T>(q, nn, op, a, b, &c, None)?;
        TypedBuffer::new(c)
    } else {
        // A gradient for an input of the other 16-bit type: computed in T, then converted.
        let c = Arc::new(q.alloc::<T>(len)?);
        gemm_lowp::<T, T>(q, nn, op, a, b, &c, None)?;
        cast_new(q, &TypedBuffer::new(c), out)?
    };
    Tensor::gradient_typed(buf, shape)
}

/// `conv2d` computed in `dtype` (bf16 or f16) on `g`'s geometry (checked by the caller),
/// NCHW tensors; cuDNN's NHWC engines compete inside the registry (with their transposes).
pub(crate) fn conv2d_lowp(
    q: &dyn Queue,
    (x, w, b): (&Tensor, &Tensor, Option<&Tensor>),
    g: ConvGeom,
    dtype: Dtype,
) -> Result<Tensor> {
    match dtype {
        Dtype::Bf16 => conv2d_as::<bf16>(q, (x, w, b), g),
        Dtype::F16 => conv2d_as::<f16>(q, (x, w, b), g),
        Dtype::F32 => Err(NnError::Dtype {
            what: "conv2d_lowp",
            expected: "bf16 or f16",
            found: "f32",
        }),
    }
}

fn conv2d_as<T: Float>(
    q: &dyn Queue,
    (x, w, b): (&Tensor, &Tensor, Option<&Tensor>),
    g: ConvGeom,
) -> Result<Tensor> {
    let nn = Nn::get(q.device())?;
    let shape = ConvShape::from(g);
    let (oh, ow) = g.out_hw()?;
    let xl = of::<T>(&values_in(q, x, T::DTYPE)?)?;
    let wl = of::<T>(&values_in(q, w, T::DTYPE)?)?;
    let bl = b
        .map(|b| values_in(q, b, T::DTYPE).and_then(|v| of::<T>(&v)))
        .transpose()?;
    let y = Arc::new(q.alloc::<T>(g.output_len()?)?);
    conv2d_lowp_forward::<T>(
        q,
        &nn,
        &shape,
        Layout::Nchw,
        &xl,
        &wl,
        bl.as_deref(),
        false,
        &y,
    )?;
    let mut inputs = vec![x.clone(), w.clone()];
    if let Some(b) = b {
        inputs.push(b.clone());
    }
    let (dx_type, dw_type, db_type) = (x.dtype(), w.dtype(), b.map(|b| b.dtype()));
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
            let gy = gy.data_as::<T>()?;
            // dX in T, then in x's type.
            let dx = if need_x {
                let dx = Arc::new(q.alloc::<T>(g.input_len()?)?);
                conv2d_lowp_backward_data::<T>(q, nn, &shape, Layout::Nchw, gy, &wl, &dx)?;
                let dx = cast_new(q, &TypedBuffer::new(dx), dx_type)?;
                Some(Tensor::gradient_typed(dx, &[g.n, g.c, g.h, g.w])?)
            } else {
                None
            };
            // dW on tensor cores in T, then in w's type (widened exactly for a master weight,
            // as PyTorch's autocast does): cuDNN has no engine writing an f32 weight gradient
            // from 16-bit inputs, and computing it in f32 from widened inputs put the sweep's
            // bf16 convolution training steps at up to twice PyTorch's time on the H100.
            let dw = if need_w {
                let dw = Arc::new(q.alloc::<T>(g.weight_len()?)?);
                conv2d_lowp_backward_filter::<T>(q, nn, &shape, Layout::Nchw, gy, &xl, &dw)?;
                let dw = cast_new(q, &TypedBuffer::new(dw), dw_type)?;
                Some(Tensor::gradient_typed(dw, &[g.oc, g.c, g.kh, g.kw])?)
            } else {
                None
            };
            // db = Σ over images and pixels, in f32 from the widened gradient.
            let db = match (need_b, db_type) {
                (true, Some(bt)) => {
                    let wide = cast_new(q, &TypedBuffer::new(gy.clone()), Dtype::F32)?;
                    let wide = of::<f32>(&wide)?;
                    let db = Arc::new(q.alloc::<f32>(g.oc)?);
                    nn.k.channel_sum(q, &wide, &db, g.n, g.oc, oh * ow)?;
                    let db = cast_new(q, &TypedBuffer::new(db), bt)?;
                    Some(Tensor::gradient_typed(db, &[g.oc])?)
                }
                _ => None,
            };
            Ok(vec![dx, dw, db])
        }),
    };
    Ok(Tensor::from_op_typed(
        TypedBuffer::new(y),
        vec![g.n, g.oc, oh, ow],
        Some(node),
    ))
}
