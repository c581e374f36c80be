//! Tensors and reverse-mode autograd, and the differentiable operations on them (`ops`: the
//! products, convolutions, losses; `transformer`: norms, activations, rotary embeddings and
//! embedding lookup; `causal`: causal self-attention for training).

pub mod attention;
pub mod autocast;
pub mod causal;
mod mixed;
pub mod ops;
pub mod scale;
pub mod tensor;
pub mod transformer;
