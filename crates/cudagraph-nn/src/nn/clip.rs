//! Gradient clipping by global norm on the device (PyTorch's `clip_grad_norm_`): the norm,
//! the factor and the scaling are computed by kernels from device memory, so a clipped step
//! captures into one graph and nothing is read back.
//!
//! The norm is a deterministic reduction: per-chunk sums of squares over every gradient in one
//! multi-tensor launch, then one block that adds them in a fixed order — the same bits on every
//! run, eager or replayed. Squares and sums are in f64 (PyTorch adds f32 norms of f32 sums of
//! squares), so the norm is the f64 value rounded once to f32; a gradient beyond 1.8e19 does
//! not make it overflow as an f32 square would.

use std::sync::Arc;

use cudagraph::{DeviceBuffer, Queue, QueueExt};

use crate::autograd::tensor::{require_f32_params, Parameter, Tensor};
use crate::error::{AmpError, Result};
use crate::kernels::amp::AmpKernels;

/// PyTorch's `torch.nn.utils.clip_grad_norm_(params, max_norm)` (L2 norm, eps 1e-6,
/// `error_if_nonfinite=False`): the total norm `‖(g₁, g₂, …)‖₂` over the gradients of
/// `params` (parameters without one are left out) is returned as a one-element device tensor,
/// and every gradient is multiplied in place by `min(1, max_norm / (norm + 1e-6))`, computed
/// on the device in f32 as PyTorch does — not at all when that factor is 1.
///
/// A gradient with an inf makes the norm inf and the factor 0 (finite elements become 0,
/// infinite ones NaN); a NaN makes both NaN and every gradient NaN — PyTorch's results. No
/// gradient at all: the norm is 0 and nothing runs. `max_norm` must be ≥ 0 (`inf`: measure
/// without clipping); NaN or negative is [`AmpError::MaxNorm`]. Parameters stored in 16 bits
/// (pure 16-bit training) are [`AmpError::LowPrecisionParams`].
///
/// Under a [`GradScaler`](crate::nn::scaler::GradScaler), unscale the optimizer first
/// (`scaler.unscale(q, &opt)`) so the norm is that of the true gradients.
pub fn clip_grad_norm(q: &dyn Queue, params: &[Parameter], max_norm: f32) -> Result<Tensor> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(AmpError::MaxNorm(max_norm).into());
    }
    require_f32_params(
        params,
        "clip_grad_norm",
        "clip the gradients of f32 parameters (keep f32 masters and train with 16-bit \
         optimizer copies, OptimOptions { copies }), or train the 16-bit parameters unclipped",
    )?;
    let mut grads: Vec<Arc<DeviceBuffer<f32>>> = Vec::new();
    for p in params {
        grads.extend(p.grad()?);
    }
    if grads.is_empty() {
        return Tensor::zeros(q, &[1]);
    }
    let k = AmpKernels::get(q.device())?;
    let norm = q.alloc::<f32>(1)?;
    let coef = q.alloc::<f32>(1)?;
    let refs: Vec<&DeviceBuffer<f32>> = grads.iter().map(|g| &**g).collect();
    k.clip(q, &refs, max_norm, &norm, &coef)?;
    Tensor::from_buffer(Arc::new(norm), &[1])
}
