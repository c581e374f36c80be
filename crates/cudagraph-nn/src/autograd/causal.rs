//! Causal self-attention for training: [`causal_attention`] over GPT-2's packed `q | k | v`
//! projections, differentiable. Inference over a growing key/value cache is
//! [`KvCache`](super::attention::KvCache)'s.
//!
//! The forward saves each row's log-sum-exp (f32) and its output; the backward recomputes the
//! probabilities from them (as FlashAttention does), so no `[tokens, tokens]` matrix is ever
//! stored. Sums run in a fixed order with no atomics: the same inputs give the same bits,
//! eager or replayed from a graph.

use std::sync::Arc;

use cudagraph::memory::{bf16, f16};
use cudagraph::{Queue, QueueExt};

use crate::autograd::tensor::{Node, Tensor};
use crate::dtype::{Dtype, Float, TypedBuffer};
use crate::error::{NnError, Result};
/// The largest head dimension [`causal_attention`] takes.
pub use crate::kernels::causal::CAUSAL_MAX_HEAD_DIM;
use crate::kernels::causal::{CausalKernels, CausalShape};

/// Causal multi-head self-attention of `batch` sequences, as GPT-2's attention block between
/// its two projections (`c_attn` and `c_proj`).
///
/// `qkv: [batch · tokens, 3 · hidden]` holds each token's query, key and value side by side
/// (each `[heads, head_dim]`, `head_dim = hidden / heads`), sequence after sequence; the
/// result is `[batch · tokens, hidden]`, each token's heads side by side: token `t` attends to
/// tokens `0..=t` of its own sequence with scores `q · k / √head_dim` and a softmax in f32.
/// Runs in `qkv`'s type (f32, bf16 or f16; inside autocast, the 16-bit output of the
/// projection), computed in f32 and rounded once on store. The backward gives the gradient
/// of `qkv` in its type.
///
/// `NnError::Shape` when the rows are not a multiple of `batch`, the width is not three times
/// a multiple of `heads`, or `head_dim` exceeds [`CAUSAL_MAX_HEAD_DIM`].
pub fn causal_attention(q: &dyn Queue, qkv: &Tensor, batch: usize, heads: usize) -> Result<Tensor> {
    let &[rows, width] = qkv.shape() else {
        return Err(NnError::Shape(format!(
            "causal_attention: input {:?} is not [batch · tokens, 3 · hidden]",
            qkv.shape()
        )));
    };
    if batch == 0 || heads == 0 || rows % batch != 0 || width % (3 * heads) != 0 || rows == 0 {
        return Err(NnError::Shape(format!(
            "causal_attention: input {:?} for {batch} sequences of {heads} heads (rows a \
             multiple of the sequences, width three times a multiple of the heads)",
            qkv.shape()
        )));
    }
    let shape = CausalShape {
        batch,
        tokens: rows / batch,
        heads,
        head_dim: width / 3 / heads,
    };
    shape.validate()?;
    match qkv.dtype() {
        Dtype::F32 => causal_as::<f32>(q, qkv, shape),
        Dtype::Bf16 => causal_as::<bf16>(q, qkv, shape),
        Dtype::F16 => causal_as::<f16>(q, qkv, shape),
    }
}

fn causal_as<T: Float>(q: &dyn Queue, qkv: &Tensor, shape: CausalShape) -> Result<Tensor> {
    let k = CausalKernels::get(q.device())?;
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    let x = qkv.data_as::<T>()?.clone();
    let out = Arc::new(q.alloc::<T>(shape.out_len()?)?);
    let lse = Arc::new(q.alloc::<f32>(shape.stats_len()?)?);
    k.forward(q, &shape, &x, &out, &lse, scale)?;
    let hidden = shape.heads * shape.head_dim;
    let rows = shape.batch * shape.tokens;
    let saved = out.clone();
    let in_shape = qkv.shape().to_vec();
    let node = Node {
        unit_backward: None,
        inputs: vec![qkv.clone()],
        name: "causal_attention",
        backward: Box::new(move |q, _nn, g| {
            let dout = g.data_as::<T>()?;
            let k = CausalKernels::get(q.device())?;
            let delta = q.alloc::<f32>(shape.stats_len()?)?;
            let dx = q.alloc::<T>(shape.qkv_len()?)?;
            k.backward(q, &shape, (&x, &saved, &lse), dout, &delta, &dx, scale)?;
            Ok(vec![Some(Tensor::gradient_typed(
                TypedBuffer::new(Arc::new(dx)),
                &in_shape,
            )?)])
        }),
    };
    Ok(Tensor::from_op_typed(
        TypedBuffer::new(out),
        vec![rows, hidden],
        Some(node),
    ))
}
