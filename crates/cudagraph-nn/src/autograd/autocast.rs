//! Mixed precision: [`Tensor::to_dtype`], the differentiable cast, and [`autocast`], the scope
//! in which products and convolutions run in bf16 or f16 on tensor cores while everything
//! that needs range or precision stays f32 — PyTorch's `torch.autocast`.
//!
//! Inside `autocast(Dtype::Bf16, || …)` (or `Dtype::F16`), following PyTorch's CUDA op lists:
//! - **lower precision**: [`linear`](super::ops::linear) and [`conv2d`](super::ops::conv2d)
//!   cast their f32 inputs, weights and bias to the scope's type and compute in it (f32
//!   accumulation); their outputs are of that type;
//! - **f32**: [`mse_loss`](super::ops::mse_loss) and
//!   [`cross_entropy`](super::ops::cross_entropy) (PyTorch's `mse_loss`, `cross_entropy`,
//!   `softmax`, `log_softmax`, norms and reductions) widen a 16-bit input to f32 first — also
//!   outside autocast, so a 16-bit prediction never accumulates a loss in 16 bits;
//! - **the input's type**: everything else (ReLU, reshapes, pooling) runs in the type it is
//!   given.
//!
//! Parameters stay f32 (the master weights). A parameter's cast is made once per scope and
//! reused by every use inside it (PyTorch's autocast weight cache). The product keeps the
//! tensors it was given as its autograd inputs and computes each one's gradient in that
//! tensor's own type, straight from the tensor-core product: an f32 master weight gets an f32
//! gradient with no 16-bit rounding and no cast kernel. With [`AutocastOptions::copies`] the
//! scope takes 16-bit copies someone else keeps current (an optimizer that updates them in its
//! fused step), so no cast runs at all for those parameters.
//!
//! Casts are ordinary kernels on the queue: a whole step — casts, products, losses, backward,
//! optimizer — captures into one graph, and every replay casts the weights the previous
//! replay's optimizer step wrote. The scope is the forward pass (and the loss) of one step:
//! a cached cast is the parameter's value when the scope first used it, so run the optimizer
//! after the scope ends, as with PyTorch.

use std::cell::RefCell;
use std::collections::HashMap;

use cudagraph::Queue;

use crate::autograd::tensor::{Node, Parameter, Tensor};
use crate::dtype::{Dtype, TypedBuffer};
use crate::error::{NnError, Result};
use crate::kernels::cast::cast_new;

/// What an [`autocast_with`] scope does.
#[derive(Clone, Debug, Default)]
pub struct AutocastOptions {
    /// The type products and convolutions run in: `Bf16` or `F16` (`F32` turns autocast off
    /// inside the scope, like `torch.autocast(enabled=False)`).
    pub dtype: Dtype,
    /// 16-bit copies of parameters kept current by someone else (an optimizer's `copies()`),
    /// used instead of casting the parameter. A copy of another type than `dtype`, or of
    /// another length than its parameter, is an error when the scope opens.
    pub copies: Vec<(Parameter, TypedBuffer)>,
}

impl AutocastOptions {
    /// A scope of type `dtype` with no copies.
    pub fn new(dtype: Dtype) -> Self {
        Self {
            dtype,
            copies: Vec::new(),
        }
    }
}

struct Scope {
    dtype: Dtype,
    /// Casts made in this scope, by parameter.
    cache: HashMap<usize, TypedBuffer>,
    /// Copies given with the options, by parameter.
    copies: HashMap<usize, (Parameter, TypedBuffer)>,
}

thread_local! {
    static SCOPE: RefCell<Option<Scope>> = const { RefCell::new(None) };
}

/// Runs `f` with products and convolutions in `dtype` (`Dtype::Bf16` or `Dtype::F16`), as
/// `with torch.autocast("cuda", dtype=…)` (see the module documentation). Scopes nest; the
/// inner one's type applies inside it and the outer one's cache comes back after it.
pub fn autocast<R>(dtype: Dtype, f: impl FnOnce() -> R) -> R {
    in_scope(
        Scope {
            dtype,
            cache: HashMap::new(),
            copies: HashMap::new(),
        },
        f,
    )
}

/// [`autocast`] with options (the optimizer's 16-bit copies). An error, before `f` runs, when a
/// copy does not match its parameter or the scope's type.
pub fn autocast_with<R>(options: AutocastOptions, f: impl FnOnce() -> R) -> Result<R> {
    let mut copies = HashMap::new();
    for (p, c) in options.copies {
        if c.dtype() != options.dtype {
            return Err(NnError::Dtype {
                what: "autocast copy",
                expected: options.dtype.name(),
                found: c.dtype().name(),
            });
        }
        if c.len() != p.numel() {
            return Err(NnError::Shape(format!(
                "autocast: a copy of {} elements for parameter {} of {}",
                c.len(),
                p.name(),
                p.numel()
            )));
        }
        copies.insert(p.key(), (p, c));
    }
    let scope = Scope {
        dtype: options.dtype,
        cache: HashMap::new(),
        copies,
    };
    Ok(in_scope(scope, f))
}

/// Runs `f` inside `scope`, then restores the scope around it (also when `f` panics).
fn in_scope<R>(scope: Scope, f: impl FnOnce() -> R) -> R {
    let outer = SCOPE.with(|s| s.replace(Some(scope)));
    // Restore the outer scope even if `f` panics (a poisoned scope would leak to later code).
    struct Restore(Option<Option<Scope>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = self.0.take().flatten();
            SCOPE.with(|s| *s.borrow_mut() = outer);
        }
    }
    let _restore = Restore(Some(outer));
    f()
}

/// The type products and convolutions run in here: `Some(Bf16 | F16)` inside an autocast
/// scope, `None` outside one (or in a scope of `F32`).
pub fn autocast_dtype() -> Option<Dtype> {
    SCOPE.with(|s| {
        s.borrow()
            .as_ref()
            .map(|s| s.dtype)
            .filter(|d| *d != Dtype::F32)
    })
}

/// The values of `t` in `dtype`, for a lower-precision op (product, convolution) that keeps
/// `t` itself as its autograd input: `t`'s own buffer when it has that type, else for a
/// parameter inside an autocast scope the scope's copy or cached cast, else a new cast (not
/// differentiable by itself: the op computes `t`'s gradient in `t`'s type).
pub(crate) fn values_in(q: &dyn Queue, t: &Tensor, dtype: Dtype) -> Result<TypedBuffer> {
    if t.dtype() == dtype {
        return Ok(t.buffer().clone());
    }
    let key = t.param().map(|p| p.key());
    let cached = key.and_then(|key| {
        SCOPE.with(|s| {
            let s = s.borrow();
            let s = s.as_ref().filter(|s| s.dtype == dtype)?;
            s.cache
                .get(&key)
                .or_else(|| s.copies.get(&key).map(|(_, c)| c))
                .cloned()
        })
    });
    if let Some(c) = cached {
        return Ok(c);
    }
    let cast = cast_new(q, t.buffer(), dtype)?;
    if let Some(key) = key {
        SCOPE.with(|s| {
            if let Some(s) = s.borrow_mut().as_mut().filter(|s| s.dtype == dtype) {
                s.cache.insert(key, cast.clone());
            }
        });
    }
    Ok(cast)
}

/// The type a lower-precision op (product, convolution) runs in for `inputs`: the autocast
/// scope's, else their common type (`NnError::Dtype` naming `what` when they differ).
pub(crate) fn compute_dtype(what: &'static str, inputs: &[&Tensor]) -> Result<Dtype> {
    if let Some(d) = autocast_dtype() {
        return Ok(d);
    }
    let first = inputs.first().map(|t| t.dtype()).unwrap_or_default();
    match inputs.iter().find(|t| t.dtype() != first) {
        Some(t) => Err(NnError::Dtype {
            what,
            expected: first.name(),
            found: t.dtype().name(),
        }),
        None => Ok(first),
    }
}

/// An input of an f32 op (losses): `t` widened to f32 (exact) when it is 16-bit.
pub(crate) fn widen(q: &dyn Queue, t: &Tensor) -> Result<Tensor> {
    t.to_dtype(q, Dtype::F32)
}

impl Tensor {
    /// This tensor converted to `dtype`, as PyTorch's `x.to(dtype)`: narrowing rounds to
    /// nearest even (past the largest finite value: ±inf), widening is exact; the same type
    /// gives the tensor itself. Differentiable: the gradient is cast back to this tensor's
    /// type.
    pub fn to_dtype(&self, q: &dyn Queue, dtype: Dtype) -> Result<Tensor> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        let out = cast_new(q, self.buffer(), dtype)?;
        self.cast_node(out)
    }

    /// `out` (this tensor's values in another type, already computed) as the output of a cast
    /// of this tensor: the gradient flows back converted to this tensor's type.
    pub(crate) fn cast_node(&self, out: TypedBuffer) -> Result<Tensor> {
        if out.len() != self.numel() {
            return Err(NnError::Shape(format!(
                "a cast of {} elements for a tensor {:?}",
                out.len(),
                self.shape()
            )));
        }
        let from = self.dtype();
        let shape = self.shape().to_vec();
        let node = Node {
            inputs: vec![self.clone()],
            name: "to_dtype",
            unit_backward: None,
            backward: Box::new(move |q, _nn, g| {
                let gi = cast_new(q, g.buffer(), from)?;
                Ok(vec![Some(Tensor::gradient_typed(gi, &shape)?)])
            }),
        };
        Ok(Tensor::from_op_typed(
            out,
            self.shape().to_vec(),
            Some(node),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_restore_their_type() {
        assert_eq!(autocast_dtype(), None);
        autocast(Dtype::Bf16, || {
            assert_eq!(autocast_dtype(), Some(Dtype::Bf16));
            autocast(Dtype::F16, || {
                assert_eq!(autocast_dtype(), Some(Dtype::F16))
            });
            assert_eq!(autocast_dtype(), Some(Dtype::Bf16));
            // A scope of F32 turns autocast off inside it.
            autocast(Dtype::F32, || assert_eq!(autocast_dtype(), None));
            assert_eq!(autocast_dtype(), Some(Dtype::Bf16));
        });
        assert_eq!(autocast_dtype(), None);
    }

    #[test]
    fn a_panic_inside_a_scope_does_not_leave_it_open() {
        let r = std::panic::catch_unwind(|| autocast(Dtype::F16, || panic!("inside")));
        assert!(r.is_err());
        assert_eq!(autocast_dtype(), None);
    }

    #[test]
    fn scopes_are_per_thread() {
        autocast(Dtype::Bf16, || {
            let other = std::thread::spawn(autocast_dtype).join().unwrap();
            assert_eq!(other, None);
        });
    }
}
