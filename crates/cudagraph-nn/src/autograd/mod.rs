//! Tensors and reverse-mode autograd, and the differentiable operations on them.

pub mod attention;
pub mod autocast;
mod mixed;
pub mod ops;
pub mod scale;
pub mod tensor;
