//! The engine registry: the one place where the engine of every matrix product and convolution
//! is chosen, remembered and shown.
//!
//! An *engine* is one concrete way to run an operation: cuBLAS, one of cuBLASLt's algorithms
//! (a heuristic one, or, when the policy asks, a split-K variant of one for an under-occupied
//! product, or a configuration found by searching its algorithm ids, tiles and stages —
//! [`Policy::lt_search`], `CUDAGRAPH_LT_SEARCH=1`), our split-K
//! tiled or warp-K GEMM kernels ([`GemmEngine`]); one of cuDNN's algorithms, our
//! implicit-GEMM kernels with a tile and split count, or the direct kernels ([`ConvEngine`]).
//! Operations describe themselves by a *key* — op, shape, layout, epilogue, and the policy's
//! restrictions, e.g. `gemm NT m=32 n=512 k=1024 a=1 b=0 ep=bias_relu` or
//! `conv_bwd_filter n=8 c=3 h=32 w=32 oc=16 k=3x3 s=1 p=1` — and list the candidates that can
//! run them on this machine.
//!
//! **Measured once, like PyTorch's `cudnn.benchmark`.** The first time a key is seen on an
//! eager queue, every candidate runs a warm-up, then a few timed runs (CUDA events on the same
//! stream, queued behind a short spin kernel so host launch gaps do not count), on scratch
//! outputs from our allocator (inputs are only read); the fastest wins. The choice is kept per
//! device in memory and on disk as JSON next to the NVRTC cache
//! (`cudagraph::runtime::nvrtc::cache_dir()`, one file per device name and driver version;
//! `CUDAGRAPH_CACHE_DIR=off` disables it), so the next process starts with it.
//!
//! **Inside a capture nothing is measured** (a capture may not synchronise): a key without a
//! choice gets the heuristic default (the former fixed thresholds of `GemmFamily::Auto` for
//! products, cuDNN's own first choice for convolutions) and is recorded as *unmeasured*. Later
//! eager calls keep that choice, so the graph and the eager path give the same bits; it is
//! never written to disk, and [`Engines::clear`] forgets it (the next eager call measures).
//! So: run a model once eagerly (a warm-up, as with `torch.backends.cudnn.benchmark`) before
//! capturing it, and the graph replays the measured engines forever — with results equal to
//! the eager ones bit for bit.
//!
//! **Deterministic by default.** Only candidates whose results do not depend on scheduling are
//! considered (cuDNN's non-deterministic algorithms are left out; our split-K reductions sum in a
//! fixed order), so replays equal eager runs bit for bit. [`Policy::deterministic`] lifts this,
//! or `CUDAGRAPH_DETERMINISTIC=0` (PyTorch's default, `cudnn.deterministic = False`, is the
//! non-deterministic one: its convolution backward passes may use cuDNN's atomics-based
//! algorithms, which are often faster for the weight gradient).
//!
//! **Forcing an engine** for comparisons: `CUDAGRAPH_GEMM=cublas|cublaslt|tiled|warpk|rows|auto` and
//! `CUDAGRAPH_CONV=cudnn|ours|igemm|direct|auto` (read once per process; an unknown value is an
//! error naming the variable and the accepted values). Forcing a family still measures within
//! it (cuDNN's algorithms, cuBLASLt's heuristic top few and, with `CUDAGRAPH_LT_SPLITK=1`, their
//! split-K variants, with `CUDAGRAPH_LT_SEARCH=1` up to eight searched configurations, our tile
//! shapes). A forced family that
//! cannot run an operation (a missing library, warp-K on a backward layout) falls back to the
//! heuristic default over what can. [`Engines::set_policy`] does the same per device.
//!
//! **TF32 off by default.** [`Policy::tf32_matmul`] (`CUDAGRAPH_TF32_MATMUL=1`) lets cuBLAS and
//! cuBLASLt use TF32 tensor cores, [`Policy::tf32_conv`] (`CUDAGRAPH_TF32_CONV=1`) lets cuDNN,
//! like PyTorch's two `allow_tf32` switches; keys then end in `+tf32`, so a choice made with a
//! switch on never serves a call with it off. Our kernels never use TF32.
//!
//! **Timed as they replay.** A candidate whose single eager run takes under 2 ms is timed in
//! graphs: as a chain of runs captured in one graph (its cost inside a longer graph) and as a
//! graph of one run replayed back to back (its cost as a graph of its own). It is ranked by the
//! mean of the two; `CUDAGRAPH_REGISTRY_TIMING=chain|single|both` ranks by one of them for
//! comparisons. Both times are recorded in the table.
//!
//! **Missing libraries**: without cuDNN or cuBLASLt a one-line notice is printed once and our
//! kernels (and cuBLAS) run; [`Policy::cudnn`] / [`Policy::cublaslt`] simulate that. A library
//! is opened on first eager use, never inside a capture (opening may allocate or synchronise):
//! a capture that comes first chooses among the other engines.
//!
//! **Half precision.** [`gemm_lowp()`] runs products with bf16 or f16 operands and a result of
//! their type or f32 on tensor cores (f32 accumulation): the same registry, with keys that
//! name the element types (`… ep=bias in=bf16 out=f32`), measuring cuBLASLt's heuristic
//! algorithms for those types and cuBLAS's `cublasGemmEx` (see [`gemm_lowp`](mod@gemm_lowp));
//! above 64 rows one choice serves a range of row counts (a prefill's tokens change with every
//! request: [`gemm_lowp::rows_range`]).
//! [`conv_lowp`] runs bf16/f16 convolutions (fp32 accumulation) the same way, with keys that
//! name dtype and layout and engines named `LAYOUT:KIND` ([`conv_lowp::LowpEngine`]): cuDNN in
//! the caller's layout and in the other one with the transposes timed in, so the faster layout
//! is chosen by measurement.
//!
//! [`Engines::table`] returns every choice with the measured µs per candidate (shown by
//! `cudagraph inspect` and `cudagraph bench engines`).

mod catalog;
pub mod conv;
pub mod conv_lowp;
pub mod gemm;
pub mod gemm_lowp;
mod measure;
mod policy;
mod registry;
mod table;
mod tune;

pub use catalog::{BiasEngine, CeEngine, ConvEngine, ConvFamily, Engine, GemmEngine, GemmFamily};
pub use gemm_lowp::gemm_lowp;
pub use measure::GraphTiming;
pub use policy::Policy;
pub use registry::Engines;
pub use table::{format_table, EngineRow, Entry, Timing};
pub use tune::{Retuned, TuneReport, TUNE_WITHIN};
