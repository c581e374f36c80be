//! The CUDA libraries this crate calls: cuBLAS, cuBLASLt, cuDNN (legacy and graph API) and
//! NCCL, each loaded at run time.

pub mod blas;
pub mod blaslt;
pub mod cudnn;
pub mod cudnn_graph;
pub mod libraries;
pub(crate) mod loader;
pub mod nccl;
