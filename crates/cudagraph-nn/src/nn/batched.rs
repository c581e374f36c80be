//! [`Batched`]: any [`NnModule`] as a [`cudagraph::BatchModel`], so it can be served through a
//! [`cudagraph::GraphCache`] (one graph per batch bucket, padding, eager fallback).

use std::sync::Arc;

use cudagraph::{BatchModel, DeviceBuffer, Queue};

use crate::autograd::tensor::{no_grad, Tensor};
use crate::nn::layers::NnModule;

/// A module served in batches of rows: `row_shape` is one input row's shape (e.g. `[1024]` or
/// `[1, 8, 8]`), `output_row` the number of outputs per row. Runs without autograd.
pub struct Batched<M: NnModule> {
    /// The module to run.
    pub module: M,
    /// One input row's shape, without the batch dimension.
    pub row_shape: Vec<usize>,
    /// Output values per row.
    pub output_row: usize,
}

impl<M: NnModule> BatchModel for Batched<M> {
    type In = f32;
    type Out = f32;

    fn input_row(&self) -> usize {
        self.row_shape.iter().product()
    }

    fn output_row(&self) -> usize {
        self.output_row
    }

    fn forward(
        &self,
        q: &dyn Queue,
        input: &DeviceBuffer<f32>,
        rows: usize,
    ) -> cudagraph::Result<DeviceBuffer<f32>> {
        no_grad(|| {
            let mut shape = vec![rows];
            shape.extend(&self.row_shape);
            let x = Tensor::from_buffer(Arc::new(input.alias()), &shape)?;
            let y = self.module.forward(q, &x)?;
            Ok(y.data()?.alias())
        })
    }
}
