//! Multiplication by a scalar that lives in device memory: what a
//! [`GradScaler`](crate::nn::scaler::GradScaler) does to the loss. The scalar is read by the
//! kernel when it runs, so a captured step follows the value the device holds at each
//! replay (PyTorch's `outputs * self._scale`, a product with a one-element tensor).

use std::sync::Arc;

use cudagraph::{DeviceBuffer, Queue, QueueExt};

use crate::autograd::tensor::{Node, Tensor};
use crate::error::Result;
use crate::kernels::amp::AmpKernels;

/// `x · s[0]`, `s` a device buffer of at least one element (read when the kernel runs, in the
/// forward and again in the backward pass). Gradients flow to `x` (`dx = g · s[0]`; from an
/// implicit upstream gradient of one, `dx = s[0]` in every element); `s` gets none.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use cudagraph::{Device, QueueExt};
/// # use cudagraph_nn::*;
/// # fn main() -> Result<()> {
/// # let dev = Device::open(0)?;
/// # let s = dev.new_stream()?;
/// let x = Tensor::from_host(&s, &[1.0, 2.0], &[2])?;
/// let k = Arc::new(s.alloc_from_host(&[4.0f32])?);
/// assert_eq!(scale_by_device(&s, &x, &k)?.to_vec(&s)?, vec![4.0, 8.0]);
/// # Ok(()) }
/// ```
pub fn scale_by_device(q: &dyn Queue, x: &Tensor, s: &Arc<DeviceBuffer<f32>>) -> Result<Tensor> {
    let k = AmpKernels::get(q.device())?;
    let n = x.numel();
    let y = q.alloc::<f32>(n)?;
    k.scale(q, Some(x.data()?), &y, s)?;
    let shape = x.shape().to_vec();
    let (s_back, s_unit) = (s.clone(), s.clone());
    let (shape_back, shape_unit) = (shape.clone(), shape.clone());
    let node = Node {
        inputs: vec![x.clone()],
        name: "scale_by_device",
        backward: Box::new(move |q, _nn, g| {
            let dx = q.alloc::<f32>(n)?;
            AmpKernels::get(q.device())?.scale(q, Some(g.data()?), &dx, &s_back)?;
            Ok(vec![Some(Tensor::gradient(dx, &shape_back)?)])
        }),
        // 1 · s[0] = s[0]: the scale itself, with no seed of ones to fill first.
        unit_backward: Some(Box::new(move |q, _nn| {
            let dx = q.alloc::<f32>(n)?;
            AmpKernels::get(q.device())?.scale(q, None, &dx, &s_unit)?;
            Ok(vec![Some(Tensor::gradient(dx, &shape_unit)?)])
        })),
    };
    Ok(Tensor::from_op(y, shape, Some(node)))
}
