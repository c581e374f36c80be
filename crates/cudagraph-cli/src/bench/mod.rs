//! Benchmark commands. Each one measures eager and graph execution of the same work in one
//! process on one device, and prints a table (or JSON).

pub mod cache;
pub mod chain;
pub mod conv;
pub mod ddp;
pub mod decode;
pub mod engines;
pub mod gemm;
pub mod parity;
pub mod rebind;
pub mod serve;
pub mod soak;
pub mod streams;
pub mod sweep;
pub mod workloads;
