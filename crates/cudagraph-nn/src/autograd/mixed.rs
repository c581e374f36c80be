//! The lower-precision forms of the products: [`linear`](super::ops::linear) when it runs in
//! bf16 or f16 (inside [`autocast`](super::autocast::autocast), or on 16-bit tensors).
//!
//! The operands are the 16-bit values of the inputs (a parameter's cached cast or copy inside
//! autocast); the autograd inputs stay the tensors the caller passed, and each gets its
//! gradient in its own type straight from the tensor-core product (f32 output for an f32
//! master weight: no 16-bit rounding of the weight gradient and no cast kernel, where PyTorch
//! rounds it to bf16 and widens it again).

use std::sync::Arc;

use cudagraph::memory::{bf16, f16};
use cudagraph::{DeviceBuffer, Queue, QueueExt};

use crate::autograd::autocast::values_in;
use crate::autograd::tensor::{Node, Tensor};
use crate::dtype::{Dtype, Float, TypedBuffer};
use crate::engine::gemm::{GemmOp, Trans};
use crate::engine::gemm_lowp::gemm_lowp;
use crate::error::{NnError, Result};
use crate::ffi::blas::Epilogue;
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
        ta: Trans::N,
        tb: Trans::T,
        m,
        n,
        k,
        alpha: 1.0,
        beta: 0.0,
        epilogue: match (bl.is_some(), relu) {
            (false, _) => Epilogue::None,
            (true, false) => Epilogue::Bias,
            (true, true) => Epilogue::BiasRelu,
        },
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
        crate::kernels::cast::cast_new(q, &TypedBuffer::new(c), out)?
    };
    Tensor::gradient_typed(buf, shape)
}
