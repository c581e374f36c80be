//! # cudagraph-nn
//!
//! A small GPU tensor and neural-network layer built for CUDA Graph capture: every buffer comes
//! from cudagraph's allocator (so a whole forward/backward/optimizer step allocates from the
//! graph's pool when captured), kernels are compiled at run time with NVRTC, GEMMs go through
//! cuBLAS with a workspace from our own pool, and every op works on an eager `Stream` or a
//! `CaptureStream` alike (model code takes `&dyn cudagraph::Queue`).
//!
//! Tensors are f32, bf16 or f16 ([`Dtype`]); [`autocast`] runs products and convolutions in
//! bf16/f16 on tensor cores with f32 master weights, [`GradScaler`] scales f16 losses on the
//! device, and the first transformer pieces are here ([`layer_norm`], [`rms_norm`], [`rotary`],
//! [`KvCache`], [`io::hf`]): see `docs/precision.md` and `docs/transformers.md`.
//!
//! ```no_run
//! use cudagraph::{CaptureOptions, Device, Graph};
//! use cudagraph_nn::*;
//! # fn main() -> Result<()> {
//! let dev = Device::open(0)?;
//! let mut s = dev.new_stream()?;
//! let mut rng = HostRng::new(0);
//! let model = Linear::new(&s, 1024, 1024, &mut rng)?;
//! let mut opt = Sgd::new(&s, model.parameters(), 1e-3, 0.0, 0.0)?;
//! let x = Tensor::from_host(&s, &rng.vec_normal(64 * 1024), &[64, 1024])?;
//! let y = Tensor::from_host(&s, &rng.vec_normal(64 * 1024), &[64, 1024])?;
//! // The whole training step in one graph.
//! let (step, loss) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
//!     opt.zero_grad(cs, true)?;
//!     let loss = mse_loss(cs, &model.forward(cs, &x)?, &y, Reduction::Sum)?;
//!     loss.backward(cs)?;
//!     opt.step(cs)?;
//!     Ok(loss)
//! }).map_err(NnError::from)?;
//! for _ in 0..100 { step.replay(&s)?; }
//! println!("loss {}", loss.to_vec(&s)?[0]);
//! # Ok(()) }
//! ```
//!
//! ## Rooms
//!
//! Top to bottom, each importing only those below it: [`dist`] (multi-GPU data parallelism),
//! [`serving`] (dynamic batching), [`io`] (model files, datasets), [`nn`] (layers, optimizers,
//! schedules, graphed modules), [`autograd`] (tensors and ops), [`random`] (the device
//! [`Generator`] and the host's [`HostRng`]), [`engine`] (the registry that picks the engine of
//! every product and convolution), and the ground: [`env`](mod@env) (every `CUDAGRAPH_*` variable) and
//! [`error`]. The CUDA libraries (`ffi`) and our kernels with their launchers (`kernels`) are
//! internal.
//!
//! Features: `cpu-reference` adds the `cpu` module, the plain f64 references the crate's tests
//! compare the GPU against; `internals` makes `ffi` and `kernels` public for the crate's own
//! tests and benchmarks (not a stable API). Both are off by default.

#![warn(missing_docs)]

pub mod autograd;
#[cfg(feature = "cpu-reference")]
pub mod cpu;
pub mod dist;
pub mod dtype;
pub mod engine;
pub mod env;
pub mod error;
mod extent;
pub mod io;
pub mod nn;
pub mod random;
pub mod serving;

// The internal rooms: the CUDA libraries (`ffi`) and our kernels with their launchers
// (`kernels`). Public only with the `internals` feature, which the crate's own tests turn on.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod ffi;
#[cfg(not(feature = "internals"))]
mod ffi;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod kernels;
#[cfg(not(feature = "internals"))]
mod kernels;

pub use autograd::ops::{
    add, conv2d, cross_entropy, dropout, flatten, linear, max_pool2d, mse_loss, rand, randn, relu,
    Reduction, Targets,
};
pub use dist::{Communicator, DdpOptions, DistributedDataParallel};
pub use error::{NnError, Result};
pub use io::{load_model, save_model, IoError, LayerSpec, ModelDescription, ModelFiles};
pub use kernels::cast;
pub use kernels::pdl::{pdl_enabled, set_pdl};
pub use kernels::Nn;
pub use nn::autocast::AutocastModule;
pub use nn::batched::Batched;
pub use nn::gpt::{Gpt, GptConfig};
pub use nn::graphed::GraphedModule;
pub use nn::layers::{Conv2d, Layer, Linear, NnModule, Sequential};

pub use autograd::attention::{AttentionShape, KvCache};
pub use autograd::autocast::{autocast, autocast_dtype, autocast_with, AutocastOptions};
pub use autograd::causal::causal_attention;
pub use autograd::scale::scale_by_device;
pub use autograd::tensor::{grad_enabled, no_grad, Parameter, Tensor};
pub use autograd::transformer::{
    embedding, gelu, layer_norm, llama3_frequency_scale, rms_norm, rope_inv_freq, rotary, silu,
    swiglu, Llama3RopeScaling, Rope, RopeLayout,
};
pub use dtype::{Dtype, Float, TypedBuffer};
pub use error::{AmpError, CheckpointError, HfError};
pub use io::checkpoint::{load_checkpoint, save_checkpoint, Checkpoint, CheckpointMut};
pub use nn::clip::clip_grad_norm;
pub use nn::optim::{
    Adam, AdamConfig, Hyperparameters, OptimOptions, Optimizer, ScaledStep, Sgd, SgdConfig,
    StateBuffer,
};
pub use nn::sampling::{DecodeState, Sampler, SamplingParams};
pub use nn::scaler::{GradScaler, GradScalerConfig, ScalerState};
pub use nn::schedule::Schedule;
pub use nn::steps::{step_if_finite, DeviceBatches};
pub use random::{Generator, HostRng};
pub use serving::decoder::{Decoder, DecoderCache, LogitsFor};
pub use serving::generation::{Finished, Generation, GenerationOptions, GenerationStats, Request};
pub use serving::{BatchRunner, Batcher, BatcherConfig, ModelRunner, ServeError};
