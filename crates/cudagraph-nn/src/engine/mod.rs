//! The engine registry: the one place where the engine of every matrix product and convolution
//! is chosen, remembered and shown.
//!
//! An *engine* is one concrete way to run an operation: cuBLAS, one of cuBLASLt's algorithms
//! (a heuristic one, or, when the policy asks, a split-K variant of one for an under-occupied
//! product, or a configuration found by searching its algorithm ids, tiles and stages —
//! [`Policy::lt_search`], `CUDAGRAPH_LT_SEARCH=1`), our split-K
//! tiled or warp-K GEMM kernels ([`GemmAlgo`]); one of cuDNN's algorithms, our
//! implicit-GEMM kernels with a tile and split count, or the direct kernels ([`ConvAlgo`]).
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
//! choice gets the heuristic default (the former fixed thresholds of `Engine::Auto` for
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
//! [`Engines::table`] returns every choice with the measured µs per candidate (shown by
//! `cudagraph inspect` and `cudagraph bench engines`).

pub mod conv;
pub mod gemm;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudagraph::runtime::{Context, DeviceInfo};
use cudagraph::{CaptureOptions, Device, Event, Graph, Queue};
use serde::{Deserialize, Serialize};

use crate::error::{NnError, Result};
use crate::ffi::blas::Blas;
use crate::ffi::blaslt::BlasLt;
use crate::ffi::cudnn::Cudnn;
use crate::ffi::cudnn_graph::CudnnGraph;
use crate::ffi::libraries::Libraries;
use crate::kernels::igemm::{Spin, Tile};

/// Name of the variable that forces the product engine family.
pub const GEMM_VAR: &str = "CUDAGRAPH_GEMM";
/// Name of the variable that forces the convolution engine family.
pub const CONV_VAR: &str = "CUDAGRAPH_CONV";
/// Name of the variable that lets the registry choose non-deterministic engines
/// (`CUDAGRAPH_DETERMINISTIC=0`; default `1`).
pub const DETERMINISTIC_VAR: &str = "CUDAGRAPH_DETERMINISTIC";
/// Also measure cuBLASLt's split-K variants (`CUDAGRAPH_LT_SPLITK=1`; see [`Policy::lt_split_k`]).
pub const LT_SPLITK_VAR: &str = "CUDAGRAPH_LT_SPLITK";
/// Also measure cuBLASLt configurations found by search (`CUDAGRAPH_LT_SEARCH=1`; see
/// [`Policy::lt_search`]).
pub const LT_SEARCH_VAR: &str = "CUDAGRAPH_LT_SEARCH";

/// Version of the on-disk table format (2: cuBLASLt ranks index the heuristics under the
/// device's workspace size, 32 MiB on Hopper, where format 1 had 4 MiB; 3: short candidates
/// are ranked by their time alone in a graph as well as in a chain, [`GraphTiming`]; 4:
/// under-occupied products also measure cuBLASLt's split-K variants, `cublaslt:R/skS`, which
/// choices measured before never saw; 5: forward convolutions with a bias also measure cuDNN's
/// graph API with the bias fused, `cudnnv8+bias:R`; 6: products measured under
/// `CUDAGRAPH_LT_SEARCH=1` may record cuBLASLt's searched configurations, `cublaslt:cN`, which
/// a reader of format 5 cannot parse; 7: products also measure our register-blocked kernel,
/// `reg:S`, which choices measured before never saw; 8: products of few rows measure our
/// column-warp kernels, `colsRxCwW:KS`, instead of the 8- and 4-row kernels).
const FORMAT: u32 = 8;

/// A family of product engines (the registry measures within it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Engine {
    Cublas,
    /// cuBLASLt's heuristic top few algorithms, epilogues fused, and (when the policy asks,
    /// [`Policy::lt_split_k`]) split-K variants of the first three where a product leaves the
    /// device under-occupied, and ([`Policy::lt_search`]) up to eight configurations found by
    /// searching algorithm ids, tiles and stages.
    CublasLt,
    /// The tiled split-K kernel (any layout).
    Tiled,
    /// One kernel, K split across the warps of a block (forward layout `x·wᵀ`, alpha 1,
    /// beta 0 only; other products fall back to `Tiled`).
    WarpK,
    /// Our kernels for few rows, the few-rows and column-warp ones (forward layout, alpha 1,
    /// beta 0, at most [`crate::engine::gemm::ROWS_MAX_M`] rows, k a multiple of 4; other products fall
    /// back to `Tiled`).
    Rows,
    /// Every engine available, measured per shape by the registry; before a measurement (in a
    /// capture) the heuristic default of [`crate::engine::gemm::auto_engine`].
    Auto,
}

impl Engine {
    /// The name `CUDAGRAPH_GEMM` uses.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Cublas => "cublas",
            Engine::CublasLt => "cublaslt",
            Engine::Tiled => "tiled",
            Engine::WarpK => "warpk",
            Engine::Rows => "rows",
            Engine::Auto => "auto",
        }
    }
}

/// Which engines convolutions may use (`CUDAGRAPH_CONV`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConvEngine {
    /// Every available engine, measured.
    Auto,
    /// cuDNN's algorithms (measured among them).
    Cudnn,
    /// Our kernels: implicit GEMM (every tile) and direct.
    Ours,
    /// Our implicit-GEMM kernels only.
    Igemm,
    /// Our direct kernels only.
    Direct,
}

impl ConvEngine {
    pub fn name(self) -> &'static str {
        match self {
            ConvEngine::Auto => "auto",
            ConvEngine::Cudnn => "cudnn",
            ConvEngine::Ours => "ours",
            ConvEngine::Igemm => "igemm",
            ConvEngine::Direct => "direct",
        }
    }

    /// Whether `algo` belongs to this family.
    pub fn allows(self, algo: ConvAlgo) -> bool {
        matches!(
            (self, algo),
            (ConvEngine::Auto, _)
                | (
                    ConvEngine::Cudnn,
                    ConvAlgo::Cudnn(_) | ConvAlgo::CudnnGraph(_) | ConvAlgo::CudnnGraphBias(_)
                )
                | (
                    ConvEngine::Ours,
                    ConvAlgo::Igemm(..) | ConvAlgo::Direct | ConvAlgo::Wgrad(_)
                )
                | (ConvEngine::Igemm, ConvAlgo::Igemm(..))
                | (ConvEngine::Direct, ConvAlgo::Direct | ConvAlgo::Wgrad(_))
        )
    }
}

/// Parses a `CUDAGRAPH_GEMM` value.
pub fn parse_gemm_engine(v: &str) -> Result<Engine> {
    match v.trim().to_ascii_lowercase().as_str() {
        "cublas" => Ok(Engine::Cublas),
        "cublaslt" => Ok(Engine::CublasLt),
        "tiled" => Ok(Engine::Tiled),
        "warpk" => Ok(Engine::WarpK),
        "rows" => Ok(Engine::Rows),
        "auto" | "" => Ok(Engine::Auto),
        other => Err(NnError::Config(format!(
            "{GEMM_VAR}={other:?} is not an engine; use one of cublas, cublaslt, tiled, warpk, rows, auto"
        ))),
    }
}

/// Parses a `CUDAGRAPH_DETERMINISTIC` value (unset or empty: deterministic).
pub fn parse_deterministic(v: &str) -> Result<bool> {
    crate::env::parse_switch(
        DETERMINISTIC_VAR,
        v,
        true,
        "1 (only bit-reproducible engines, the default) or 0 (also cuDNN's non-deterministic \
         algorithms)",
    )
}

/// Parses a `CUDAGRAPH_CONV` value.
pub fn parse_conv_engine(v: &str) -> Result<ConvEngine> {
    match v.trim().to_ascii_lowercase().as_str() {
        "cudnn" => Ok(ConvEngine::Cudnn),
        "ours" => Ok(ConvEngine::Ours),
        "igemm" => Ok(ConvEngine::Igemm),
        "direct" => Ok(ConvEngine::Direct),
        "auto" | "" => Ok(ConvEngine::Auto),
        other => Err(NnError::Config(format!(
            "{CONV_VAR}={other:?} is not an engine; use one of cudnn, ours, igemm, direct, auto"
        ))),
    }
}

/// What the registry may choose from, per device. The default comes from the environment
/// ([`Policy::from_env`]); [`Engines::set_policy`] changes it (tests, comparisons).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Product engines allowed (`Auto`: all).
    pub gemm: Engine,
    /// Convolution engines allowed (`Auto`: all).
    pub conv: ConvEngine,
    /// Use cuDNN when it is installed (`false` behaves as if it were missing).
    pub cudnn: bool,
    /// Use cuBLASLt when it is installed (`false` behaves as if it were missing).
    pub cublaslt: bool,
    /// Only engines whose results are bit-identical run to run (default `true`).
    pub deterministic: bool,
    /// Also measure cuBLASLt's split-K variants of its first algorithms for products that
    /// leave the device idle (`CUDAGRAPH_LT_SPLITK=1`; default `false`: on the H100 they lost
    /// at all 73 products of the sweep where they were candidates, by 4 % at best and 1.8×
    /// typically — see docs/engines.md — and they add to every first call's measurement).
    pub lt_split_k: bool,
    /// Also measure up to eight cuBLASLt configurations found by search rather than by its
    /// heuristic: every algorithm id for fp32 with each tile and stage count it supports,
    /// ranked by how well their grids fill whole waves of the device and validated by
    /// `cublasLtMatmulAlgoCheck` ([`crate::ffi::blaslt`]'s module docs; `CUDAGRAPH_LT_SEARCH=1`;
    /// default `false`: the search adds to every first call's measurement and is measured
    /// first on the device, shown as `cublaslt:cN`).
    pub lt_search: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            gemm: Engine::Auto,
            conv: ConvEngine::Auto,
            cudnn: true,
            cublaslt: true,
            deterministic: true,
            lt_split_k: false,
            lt_search: false,
        }
    }
}

impl Policy {
    /// The default policy with `CUDAGRAPH_GEMM`, `CUDAGRAPH_CONV`, `CUDAGRAPH_DETERMINISTIC`,
    /// `CUDAGRAPH_LT_SPLITK` and `CUDAGRAPH_LT_SEARCH` applied (read once per process; an
    /// invalid value is an error every time).
    pub fn from_env() -> Result<Policy> {
        static ENV: OnceLock<std::result::Result<Policy, String>> = OnceLock::new();
        let parsed = ENV.get_or_init(|| {
            let get = |name: &str| std::env::var(name).unwrap_or_default();
            let switch = |var: &str, meaning: &str| {
                crate::env::parse_switch(var, &get(var), false, meaning).map_err(|e| e.to_string())
            };
            Ok(Policy {
                gemm: parse_gemm_engine(&get(GEMM_VAR)).map_err(|e| e.to_string())?,
                conv: parse_conv_engine(&get(CONV_VAR)).map_err(|e| e.to_string())?,
                deterministic: parse_deterministic(&get(DETERMINISTIC_VAR))
                    .map_err(|e| e.to_string())?,
                lt_split_k: switch(
                    LT_SPLITK_VAR,
                    "1 (also measure cuBLASLt's split-K variants) or 0 (the default)",
                )?,
                lt_search: switch(
                    LT_SEARCH_VAR,
                    "1 (also measure cuBLASLt configurations found by search) or 0 (the default)",
                )?,
                ..Policy::default()
            })
        });
        parsed.clone().map_err(NnError::Config)
    }

    /// The part of a key that records this policy's restrictions for products
    /// (empty for the default).
    pub fn gemm_scope(&self, family: Engine) -> String {
        let mut parts = Vec::new();
        if family != Engine::Auto {
            parts.push(family.name().to_string());
        }
        if !self.cublaslt {
            parts.push("-cublaslt".into());
        }
        if self.lt_split_k {
            parts.push("+splitk".into());
        }
        if self.lt_search {
            parts.push("+search".into());
        }
        scope(parts)
    }

    /// The part of a key that records this policy's restrictions for convolutions.
    pub fn conv_scope(&self) -> String {
        let mut parts = Vec::new();
        if self.conv != ConvEngine::Auto {
            parts.push(self.conv.name().to_string());
        }
        if !self.cudnn {
            parts.push("-cudnn".into());
        }
        if !self.deterministic {
            parts.push("nondeterministic".into());
        }
        scope(parts)
    }
}

fn scope(parts: Vec<String>) -> String {
    if parts.is_empty() {
        String::new()
    } else {
        format!(" [{}]", parts.join(","))
    }
}

/// One concrete way to run a matrix product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmAlgo {
    /// cuBLAS SGEMM (+ our bias/ReLU or bias-gradient kernel).
    Cublas,
    /// cuBLASLt with its heuristic algorithm of this rank (epilogue fused).
    CublasLt(u8),
    /// cuBLASLt's heuristic algorithm of rank `rank` with K split `split` ways (a split-K
    /// variant the plan kept for an under-occupied product, see [`crate::ffi::blaslt`]); shown as
    /// `cublaslt:RANK/skSPLIT`.
    CublasLtSplitK { rank: u8, split: u8 },
    /// cuBLASLt's configuration of this index among those its search kept for the shape
    /// ([`Policy::lt_search`], [`crate::ffi::blaslt::BlasLt::search_configs`]); shown as
    /// `cublaslt:cINDEX`.
    CublasLtConfig(u8),
    /// Our split-K tiled kernel with about this many K splits.
    Tiled(u16),
    /// Our register-blocked kernel (64×64 outputs per block, four K groups) with about this
    /// many K splits (the tiled kernel's split-K contract); shown as `reg:SPLITS`.
    Reg(u16),
    /// The same tiled kernel with exactly this many K splits (2, 4 or 8) reduced inside a
    /// thread-block cluster: one kernel, no reduce node (sm_90+).
    Cluster(u8),
    /// Our forward-layout kernel that streams 128-wide K chunks of float4s, K split into this
    /// many ranges (1, 2, 4 or 8) reduced inside a thread-block cluster (sm_90+).
    Chunks(u8),
    /// Our warp-K kernel (forward layout, alpha 1, beta 0).
    WarpK,
    /// Our few-rows kernels (forward layout, alpha 1, beta 0), `rows` (16, 8 or 4) rows per
    /// block, `ks` warps splitting K per group of four columns: 16 rows for up to
    /// `gemm::ROWS_MAX_M` in a grid of such blocks (shown as `rows:KS`); 8 and 4 rows for at
    /// most that many, two K chunks in flight per warp (shown as `rows8:KS`, `rows4:KS`; no
    /// longer offered by the registry, where the column-warp kernels won every product the
    /// probe measured, but runnable by name).
    Rows { rows: u8, ks: u8 },
    /// Our column-warp kernels for few rows (forward layout, alpha 1, beta 0): each warp `rows`
    /// rows × `cols` columns, `warps` warps per block, `ks` of them splitting K per column group
    /// ([`crate::kernels::ColsShape`]); shown as `colsRxCwW:KS`.
    Cols {
        rows: u8,
        cols: u8,
        warps: u8,
        ks: u8,
    },
}

impl GemmAlgo {
    /// The family it belongs to.
    pub fn family(self) -> Engine {
        match self {
            GemmAlgo::Cublas => Engine::Cublas,
            GemmAlgo::CublasLt(_)
            | GemmAlgo::CublasLtSplitK { .. }
            | GemmAlgo::CublasLtConfig(_) => Engine::CublasLt,
            GemmAlgo::Tiled(_) | GemmAlgo::Reg(_) | GemmAlgo::Cluster(_) | GemmAlgo::Chunks(_) => {
                Engine::Tiled
            }
            GemmAlgo::WarpK => Engine::WarpK,
            GemmAlgo::Rows { .. } | GemmAlgo::Cols { .. } => Engine::Rows,
        }
    }
}

impl fmt::Display for GemmAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GemmAlgo::Cublas => write!(f, "cublas"),
            GemmAlgo::CublasLt(r) => write!(f, "cublaslt:{r}"),
            GemmAlgo::CublasLtSplitK { rank, split } => write!(f, "cublaslt:{rank}/sk{split}"),
            GemmAlgo::CublasLtConfig(i) => write!(f, "cublaslt:c{i}"),
            GemmAlgo::Tiled(s) => write!(f, "tiled:{s}"),
            GemmAlgo::Reg(s) => write!(f, "reg:{s}"),
            GemmAlgo::Cluster(s) => write!(f, "cluster:{s}"),
            GemmAlgo::Chunks(s) => write!(f, "chunks:{s}"),
            GemmAlgo::WarpK => write!(f, "warpk"),
            GemmAlgo::Rows { rows: 16, ks } => write!(f, "rows:{ks}"),
            GemmAlgo::Rows { rows, ks } => write!(f, "rows{rows}:{ks}"),
            GemmAlgo::Cols {
                rows,
                cols,
                warps,
                ks,
            } => write!(f, "cols{rows}x{cols}w{warps}:{ks}"),
        }
    }
}

impl FromStr for GemmAlgo {
    type Err = NnError;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || NnError::Config(format!("{s:?} is not a product engine"));
        match s.split_once(':') {
            None if s == "cublas" => Ok(GemmAlgo::Cublas),
            None if s == "warpk" => Ok(GemmAlgo::WarpK),
            Some(("cublaslt", r)) if r.starts_with('c') => {
                // Only the canonical decimal index (no sign, no leading zeros).
                let i: u8 = r[1..].parse().map_err(|_| bad())?;
                match r[1..] == i.to_string() {
                    true => Ok(GemmAlgo::CublasLtConfig(i)),
                    false => Err(bad()),
                }
            }
            Some(("cublaslt", r)) => match r.split_once("/sk") {
                None => r.parse().map(GemmAlgo::CublasLt).map_err(|_| bad()),
                Some((rank, split)) => {
                    let (rank, split) = (rank.parse(), split.parse());
                    match (rank, split) {
                        (Ok(rank), Ok(split)) if split >= 2 => {
                            Ok(GemmAlgo::CublasLtSplitK { rank, split })
                        }
                        _ => Err(bad()),
                    }
                }
            },
            Some(("tiled", r)) => r.parse().map(GemmAlgo::Tiled).map_err(|_| bad()),
            Some(("reg", r)) => r.parse().map(GemmAlgo::Reg).map_err(|_| bad()),
            Some(("cluster", r)) => r.parse().map(GemmAlgo::Cluster).map_err(|_| bad()),
            Some(("chunks", r)) => r.parse().map(GemmAlgo::Chunks).map_err(|_| bad()),
            Some((p @ ("rows" | "rows8" | "rows4"), r)) => Ok(GemmAlgo::Rows {
                rows: p[4..].parse().unwrap_or(16),
                ks: r.parse().map_err(|_| bad())?,
            }),
            Some((p, r)) if p.starts_with("cols") => {
                let (rows, rest) = p[4..].split_once('x').ok_or_else(bad)?;
                let (cols, warps) = rest.split_once('w').ok_or_else(bad)?;
                let num = |v: &str| -> Result<u8> {
                    // Only canonical decimals, so that a name prints back as itself.
                    let n: u8 = v.parse().map_err(|_| bad())?;
                    if n.to_string() == v {
                        Ok(n)
                    } else {
                        Err(bad())
                    }
                };
                Ok(GemmAlgo::Cols {
                    rows: num(rows)?,
                    cols: num(cols)?,
                    warps: num(warps)?,
                    ks: num(r)?,
                })
            }
            _ => Err(bad()),
        }
    }
}

/// One concrete way to run a convolution direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConvAlgo {
    /// cuDNN with this `cudnnConvolution*Algo_t`.
    Cudnn(u32),
    /// cuDNN's graph API with the engine configuration of this rank in the key's filtered
    /// heuristic list ([`crate::ffi::cudnn_graph`]); shown as `cudnnv8:RANK`.
    CudnnGraph(u8),
    /// cuDNN's graph API running the forward convolution and its bias as one operation graph
    /// (convolution, then a pointwise add of the bias), with the configuration of this rank in
    /// the fused graph's filtered heuristic list; forward with a bias only. Shown as
    /// `cudnnv8+bias:RANK`.
    CudnnGraphBias(u8),
    /// Our implicit-GEMM kernels with this tile and about this many K splits.
    Igemm(Tile, u16),
    /// Our direct kernels.
    Direct,
    /// Our small weight-gradient kernel (backward-filter only) over this many blocks of output
    /// pixels.
    Wgrad(u16),
}

impl ConvAlgo {
    /// The narrowest family it belongs to.
    pub fn family(self) -> ConvEngine {
        match self {
            ConvAlgo::Cudnn(_) | ConvAlgo::CudnnGraph(_) | ConvAlgo::CudnnGraphBias(_) => {
                ConvEngine::Cudnn
            }
            ConvAlgo::Igemm(..) => ConvEngine::Igemm,
            ConvAlgo::Direct | ConvAlgo::Wgrad(_) => ConvEngine::Direct,
        }
    }
}

impl fmt::Display for ConvAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConvAlgo::Cudnn(a) => write!(f, "cudnn:{a}"),
            ConvAlgo::CudnnGraph(r) => write!(f, "cudnnv8:{r}"),
            ConvAlgo::CudnnGraphBias(r) => write!(f, "cudnnv8+bias:{r}"),
            ConvAlgo::Igemm(t, s) => write!(f, "igemm:{}:{s}", t.name()),
            ConvAlgo::Direct => write!(f, "direct"),
            ConvAlgo::Wgrad(p) => write!(f, "wgrad:{p}"),
        }
    }
}

impl FromStr for ConvAlgo {
    type Err = NnError;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || NnError::Config(format!("{s:?} is not a convolution engine"));
        let parts: Vec<&str> = s.split(':').collect();
        match parts.as_slice() {
            ["direct"] => Ok(ConvAlgo::Direct),
            ["cudnn", a] => a.parse().map(ConvAlgo::Cudnn).map_err(|_| bad()),
            ["cudnnv8", r] => r.parse().map(ConvAlgo::CudnnGraph).map_err(|_| bad()),
            ["cudnnv8+bias", r] => r.parse().map(ConvAlgo::CudnnGraphBias).map_err(|_| bad()),
            ["wgrad", p] => p.parse().map(ConvAlgo::Wgrad).map_err(|_| bad()),
            ["igemm", t, n] => {
                let t = Tile::from_name(t).ok_or_else(bad)?;
                n.parse().map(|n| ConvAlgo::Igemm(t, n)).map_err(|_| bad())
            }
            _ => Err(bad()),
        }
    }
}

/// How a convolution's bias is added after an engine that does not fuse it (cuDNN's): measured
/// per output shape like the convolution itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BiasAlgo {
    /// Our `bias_planes` kernel (four elements per thread where the planes allow).
    Planes,
    /// `cudnnAddTensor`.
    CudnnAdd,
}

impl fmt::Display for BiasAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BiasAlgo::Planes => "bias:planes",
            BiasAlgo::CudnnAdd => "bias:cudnn",
        })
    }
}

impl FromStr for BiasAlgo {
    type Err = NnError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "bias:planes" => Ok(BiasAlgo::Planes),
            "bias:cudnn" => Ok(BiasAlgo::CudnnAdd),
            _ => Err(NnError::Config(format!("{s:?} is not a bias engine"))),
        }
    }
}

/// How a cross-entropy over narrow rows runs (`crate::autograd::ops::cross_entropy`): measured per
/// (rows, classes, gradient or not).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CeAlgo {
    /// The fixed plan (`kernels::losses::ce_plan`): a warp a row, a sum pass when the rows take
    /// more than one block.
    Rows,
    /// One block where this many lanes take a row (`kernels::losses::ce_group_plans`).
    Lanes(u8),
}

impl fmt::Display for CeAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CeAlgo::Rows => f.write_str("ce:rows"),
            CeAlgo::Lanes(l) => write!(f, "ce:lanes{l}"),
        }
    }
}

impl FromStr for CeAlgo {
    type Err = NnError;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || NnError::Config(format!("{s:?} is not a cross-entropy plan"));
        match s.strip_prefix("ce:") {
            Some("rows") => Ok(CeAlgo::Rows),
            Some(l) => l
                .strip_prefix("lanes")
                .and_then(|n| n.parse().ok())
                .map(CeAlgo::Lanes)
                .ok_or_else(bad),
            None => Err(bad()),
        }
    }
}

/// What the registry stores per key: implemented by [`GemmAlgo`], [`ConvAlgo`], [`BiasAlgo`]
/// and [`CeAlgo`].
pub trait Algo: Copy + PartialEq + fmt::Display + FromStr {}
impl Algo for GemmAlgo {}
impl Algo for ConvAlgo {}
impl Algo for BiasAlgo {}
impl Algo for CeAlgo {}

/// One candidate's measurement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// The candidate (`GemmAlgo`/`ConvAlgo` as text).
    pub engine: String,
    /// The µs per run it was ranked by (see [`GraphTiming`]), `None` when it failed.
    pub us: Option<f64>,
    /// µs per run among `reps` runs captured in one graph (candidates timed in graphs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chain_us: Option<f64>,
    /// µs per replay of a graph of one run (candidates timed in graphs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub single_us: Option<f64>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The registry's record of one key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// The chosen engine (as text).
    pub engine: String,
    /// Whether it was measured (`false`: the heuristic default, chosen inside a capture).
    pub measured: bool,
    /// Every candidate's measurement (empty when unmeasured or there was one candidate).
    pub timings: Vec<Timing>,
    /// Whether this process checked the engine against the key's candidates (entries read from
    /// disk are checked on first use); checked entries are returned without listing candidates.
    #[serde(skip)]
    pub(crate) checked: bool,
}

/// One row of [`Engines::table`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineRow {
    pub key: String,
    #[serde(flatten)]
    pub entry: Entry,
}

/// The on-disk form of a device's measured choices.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiskTable {
    pub format: u32,
    /// The device name (`DeviceInfo::name`).
    pub device: String,
    /// The driver's CUDA version.
    pub driver: i32,
    /// The cuDNN and cuBLASLt versions the choices were measured with.
    pub libraries: String,
    pub entries: BTreeMap<String, Entry>,
}

impl DiskTable {
    /// Reads a table; `None` when the file is missing or not a table of this format.
    pub fn load(path: &Path) -> Option<DiskTable> {
        let text = std::fs::read_to_string(path).ok()?;
        serde_json::from_str::<DiskTable>(&text)
            .ok()
            .filter(|t| t.format == FORMAT)
    }

    /// Writes the table atomically (temporary file, then rename).
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, path)
    }
}

/// The table file of a device in `dir`: `engines-<device name>-<driver version>.json`.
pub fn table_file(dir: &Path, device: &str, driver: i32) -> PathBuf {
    let clean: String = device
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    dir.join(format!("engines-{clean}-{driver}.json"))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The per-device engine registry (a [`Device::extension`]): policy and choices. The library
/// handles the engines use belong to the device's [`Libraries`]; the registry hands out those
/// its policy allows.
pub struct Engines {
    ctx: Context,
    info: DeviceInfo,
    libs: Arc<Libraries>,
    policy: Mutex<Policy>,
    table: Mutex<BTreeMap<String, Entry>>,
    file: Option<PathBuf>,
    libraries: String,
    /// The graph pool of the registry's timing graphs, made on first use and kept with the
    /// device; its lock serialises the graph timing of this device's measurements (the pool
    /// contract: its graphs never replay at once). Dropping each timing graph with a private
    /// pool closed that pool, a release that synchronises the context, per candidate: with
    /// other threads capturing at the same time, captures were invalidated and the process
    /// crashed inside cuCtxSynchronize (H100, 2026-11-24: gpu_engines with parallel test
    /// threads failed 6 of 8 runs, 0 of 8 with graph timing off).
    timing_pool: Mutex<Option<cudagraph::memory::Pool>>,
    /// When on ([`Engines::start_usage_log`]): every (key, engine) served, in order.
    usage: Mutex<Option<Vec<(String, String)>>>,
    usage_on: std::sync::atomic::AtomicBool,
}

impl fmt::Debug for Engines {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Engines({} #{}, {} choices, {})",
            self.info.name,
            self.info.ordinal,
            lock(&self.table).len(),
            self.libraries
        )
    }
}

/// A string naming the installed library versions (part of the disk table's identity).
fn library_versions() -> String {
    let v = |r: std::result::Result<usize, String>| r.map_or("none".to_string(), |v| v.to_string());
    format!(
        "cudnn {} cublasLt {}",
        v(crate::ffi::cudnn::version()),
        v(crate::ffi::blaslt::version())
    )
}

impl Engines {
    /// The registry of `device`, created on first use (reads the environment's policy and the
    /// disk table).
    pub fn get(device: &Device) -> Result<Arc<Engines>> {
        device
            .extension(|d| Engines::new(d).map_err(cudagraph::Error::from))
            .map_err(NnError::from)
    }

    fn new(d: &Device) -> Result<Engines> {
        let policy = Policy::from_env()?;
        let info = d.info().clone();
        let libraries = library_versions();
        let file = cudagraph::runtime::nvrtc::cache_dir()
            .map(|dir| table_file(&dir, &info.name, info.driver_version));
        let entries = file
            .as_deref()
            .and_then(DiskTable::load)
            .filter(|t| identity(t, &info, &libraries))
            .map(|t| t.entries)
            .unwrap_or_default();
        Ok(Engines {
            ctx: d.context().clone(),
            info,
            libs: Libraries::get(d)?,
            policy: Mutex::new(policy),
            table: Mutex::new(entries),
            file,
            libraries,
            timing_pool: Mutex::new(None),
            usage: Mutex::new(None),
            usage_on: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn same_identity(&self, t: &DiskTable) -> bool {
        identity(t, &self.info, &self.libraries)
    }

    /// The current policy.
    pub fn policy(&self) -> Policy {
        *lock(&self.policy)
    }

    /// Replaces the policy (keys record restrictions, so choices made under another policy stay
    /// cached under their own keys).
    pub fn set_policy(&self, p: Policy) {
        *lock(&self.policy) = p;
    }

    /// Forgets every choice in memory, so the next eager use of each key measures it again
    /// (the disk table keeps its entries; new measurements replace theirs).
    pub fn clear(&self) {
        lock(&self.table).clear();
    }

    /// The device's facts.
    pub fn device_info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The installed library versions, e.g. `cudnn 91400 cublasLt 130000`.
    pub fn libraries(&self) -> &str {
        &self.libraries
    }

    /// Where the measured choices are stored (`None`: disk cache off).
    pub fn table_path(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// The device's cuBLAS handle (made on first use).
    pub fn blas(&self) -> Result<&Blas> {
        self.libs.blas()
    }

    /// cuDNN, when installed and allowed by the policy (opened on first use; a missing library
    /// prints one notice).
    pub fn cudnn(&self) -> Option<&Cudnn> {
        self.policy().cudnn.then(|| self.libs.cudnn()).flatten()
    }

    /// cuDNN for listing candidates on `q`: as [`Engines::cudnn`], except that inside a capture
    /// a library not opened yet stays closed (opening it may allocate or synchronise, which a
    /// capture forbids); the capture then uses the other engines.
    pub(crate) fn cudnn_for(&self, q: &dyn Queue) -> Option<&Cudnn> {
        self.policy()
            .cudnn
            .then(|| self.libs.cudnn_for(q))
            .flatten()
    }

    /// cuDNN's graph API (every engine configuration), when cuDNN 9 is installed and the
    /// policy allows cuDNN (opened on first use; an unavailable API prints one notice).
    pub fn cudnn_graph(&self) -> Option<&CudnnGraph> {
        self.policy()
            .cudnn
            .then(|| self.libs.cudnn_graph())
            .flatten()
    }

    /// cuDNN's graph API for listing candidates on `q` (not opened inside a capture).
    pub(crate) fn cudnn_graph_for(&self, q: &dyn Queue) -> Option<&CudnnGraph> {
        self.policy()
            .cudnn
            .then(|| self.libs.cudnn_graph_for(q))
            .flatten()
    }

    /// cuBLASLt for listing candidates on `q` (closed libraries stay closed in a capture).
    pub(crate) fn cublaslt_for(&self, q: &dyn Queue) -> Option<&BlasLt> {
        self.policy()
            .cublaslt
            .then(|| self.libs.cublaslt_for(q))
            .flatten()
    }

    /// cuBLASLt, when installed and allowed by the policy.
    pub fn cublaslt(&self) -> Option<&BlasLt> {
        self.policy()
            .cublaslt
            .then(|| self.libs.cublaslt())
            .flatten()
    }

    /// Every choice, sorted by key.
    pub fn table(&self) -> Vec<EngineRow> {
        lock(&self.table)
            .iter()
            .map(|(k, e)| EngineRow {
                key: k.clone(),
                entry: e.clone(),
            })
            .collect()
    }

    /// The choice recorded for `key`, if any.
    pub fn entry(&self, key: &str) -> Option<Entry> {
        lock(&self.table).get(key).cloned()
    }

    /// The engine recorded for `key` if this process already checked it against the key's
    /// candidates (the fast path: callers list candidates only when this is `None`).
    pub(crate) fn lookup<A: Algo>(&self, key: &str) -> Option<A> {
        let t = lock(&self.table);
        let e = t.get(key)?;
        if e.checked {
            let a = e.engine.parse().ok();
            if a.is_some() {
                self.log_use(key, &e.engine);
            }
            a
        } else {
            None
        }
    }

    /// Starts recording which engine every product and convolution uses (for benchmarks that
    /// report it per workload); [`Self::take_usage_log`] returns and clears the record.
    pub fn start_usage_log(&self) {
        *lock(&self.usage) = Some(Vec::new());
        self.usage_on
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// The (key, engine) pairs served since [`Self::start_usage_log`] (or the last take), in
    /// order; empty when logging is off.
    pub fn take_usage_log(&self) -> Vec<(String, String)> {
        lock(&self.usage)
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    fn log_use(&self, key: &str, engine: &str) {
        if self.usage_on.load(std::sync::atomic::Ordering::Acquire) {
            if let Some(v) = lock(&self.usage).as_mut() {
                v.push((key.to_string(), engine.to_string()));
            }
        }
    }

    /// The engine for `key` among `candidates` (non-empty; `default` among them): the recorded
    /// choice when there is a valid one (measured, or the unmeasured default a capture chose);
    /// otherwise, on an eager queue, the fastest candidate measured with `run` (which must run
    /// the candidate on scratch outputs); inside a capture `default`, recorded as unmeasured.
    pub(crate) fn choose<A: Algo>(
        &self,
        q: &dyn Queue,
        key: &str,
        candidates: &[A],
        default: A,
        run: &mut dyn FnMut(&dyn Queue, A) -> Result<()>,
    ) -> Result<A> {
        let Some(&first) = candidates.first() else {
            return Ok(default);
        };
        let default = if candidates.contains(&default) {
            default
        } else {
            first
        };
        if let Some(e) = lock(&self.table).get_mut(key) {
            if let Ok(a) = e.engine.parse::<A>() {
                if candidates.contains(&a) {
                    e.checked = true;
                    self.log_use(key, &e.engine);
                    return Ok(a);
                }
            }
        }
        if q.is_capturing() || candidates.len() == 1 {
            let entry = Entry {
                engine: default.to_string(),
                measured: candidates.len() == 1,
                timings: Vec::new(),
                checked: true,
            };
            lock(&self.table).insert(key.to_string(), entry);
            self.log_use(key, &default.to_string());
            return Ok(default);
        }
        let timings = self.measure(q, candidates, run)?;
        let best = timings
            .iter()
            .filter_map(|(a, t)| t.as_ref().ok().map(|m| (*a, m.us)))
            .min_by(|x, y| x.1.total_cmp(&y.1))
            .map(|(a, _)| a);
        let Some(best) = best else {
            let why: Vec<String> = timings
                .iter()
                .map(|(a, t)| format!("{a}: {}", t.as_ref().err().map_or("?", |e| e)))
                .collect();
            return Err(NnError::Library {
                library: "engine registry",
                call: "measure",
                status: format!("no engine could run {key}: {}", why.join("; ")),
            });
        };
        let entry = Entry {
            engine: best.to_string(),
            measured: true,
            timings: timings
                .iter()
                .map(|(a, t)| Timing {
                    engine: a.to_string(),
                    us: t.as_ref().ok().map(|m| m.us),
                    chain_us: t.as_ref().ok().and_then(|m| m.chain),
                    single_us: t.as_ref().ok().and_then(|m| m.single),
                    error: t.as_ref().err().cloned(),
                })
                .collect(),
            checked: true,
        };
        self.log_use(key, &best.to_string());
        let measured: Vec<(String, Entry)> = {
            let mut t = lock(&self.table);
            t.insert(key.to_string(), entry);
            t.iter()
                .filter(|(_, e)| e.measured && !e.timings.is_empty())
                .map(|(k, e)| (k.clone(), e.clone()))
                .collect()
        };
        if let Some(path) = &self.file {
            // Merge into what is on disk (another process, or choices forgotten by `clear`).
            let mut table = DiskTable::load(path)
                .filter(|t| self.same_identity(t))
                .unwrap_or_else(|| DiskTable {
                    format: FORMAT,
                    device: self.info.name.clone(),
                    driver: self.info.driver_version,
                    libraries: self.libraries.clone(),
                    entries: BTreeMap::new(),
                });
            table.entries.extend(measured);
            // A table that cannot be written only costs a measurement next time.
            let _ = table.save(path);
        }
        Ok(best)
    }

    /// Times every candidate on `q` (eager): a warm-up, one timed run, then (unless it is
    /// clearly slower than the best so far) in graphs ([`graph_times`]) when that run was short
    /// and it captures, else a few runs queued behind a spin kernel. The
    /// candidates within [`REMEASURE_WITHIN`] of the fastest are then timed again in reverse
    /// order and keep their better time: one pass alone let the GPU's clock ramp or a noisy
    /// sample pick an engine a fifth slower (H100, 2026-11-23: a 7×7 convolution 69 → 86 µs
    /// between two runs of the same build).
    fn measure<A: Algo>(
        &self,
        q: &dyn Queue,
        candidates: &[A],
        run: &mut dyn FnMut(&dyn Queue, A) -> Result<()>,
    ) -> Result<Vec<(A, std::result::Result<Measured, String>)>> {
        let spin = Spin::get(q.device())?;
        let timing = graph_timing()?;
        // One side stream for every candidate timed in graphs here (made on first need).
        let mut side: Option<cudagraph::Stream> = None;
        let e0 = Event::new(&self.ctx, true)?;
        let e1 = Event::new(&self.ctx, true)?;
        let mut one = |a: A, best: f64| -> Result<Measured> {
            run(q, a)?; // warm-up: first-use costs (compiles, plans, workspaces)
            let s = q.stream_handle();
            s.record(&e0)?;
            run(q, a)?;
            s.record(&e1)?;
            e1.synchronize()?;
            // One run between events also counts the host's time to enqueue it (tens of µs
            // for some library calls): only clearly slower candidates are dropped on it.
            let once = e0.elapsed_ms(&e1)? as f64 * 1e3;
            if once > 4.0 * best + HOST_SLACK_US {
                return Ok(Measured::eager(once));
            }
            let reps = ((2000.0 / once.max(1.0)) as usize).clamp(2, 20);
            if once < GRAPH_TIMED_BELOW_US {
                let mut pool = lock(&self.timing_pool);
                let pool = pool.get_or_insert_with(|| q.device().graph_pool_handle());
                let timed = match &mut side {
                    Some(side) => Ok(side),
                    None => q.device().new_stream().map(|s| side.insert(s)),
                }
                .map_err(NnError::from)
                .and_then(|side| {
                    graph_times(side, pool, &spin, &e0, &e1, reps, timing, &mut |cs| {
                        run(cs, a)
                    })
                });
                match timed {
                    Ok(t) => return Ok(t),
                    Err(e) if is_fatal(&e) => return Err(e),
                    // Not capturable: timed eagerly below.
                    Err(_) => {}
                }
            }
            if once < 200.0 {
                // Keep the GPU busy while the host queues the timed runs.
                spin.spin(q, 50_000 + 40_000 * reps as u64)?;
            }
            s.record(&e0)?;
            for _ in 0..reps {
                run(q, a)?;
            }
            s.record(&e1)?;
            e1.synchronize()?;
            Ok(Measured::eager(
                e0.elapsed_ms(&e1)? as f64 * 1e3 / reps as f64,
            ))
        };
        let mut best = f64::INFINITY;
        let mut out = Vec::with_capacity(candidates.len());
        for &a in candidates {
            match one(a, best) {
                Ok(m) => {
                    best = best.min(m.us);
                    out.push((a, Ok(m)));
                }
                Err(e) if is_fatal(&e) => return Err(e),
                Err(e) => out.push((a, Err(e.to_string()))),
            }
        }
        let close: Vec<usize> = (0..out.len())
            .filter(|&i| matches!(&out[i].1, Ok(m) if m.us <= REMEASURE_WITHIN * best))
            .collect();
        if close.len() > 1 {
            for &i in close.iter().rev() {
                match one(out[i].0, best) {
                    Ok(m) => {
                        if let Ok(first) = &mut out[i].1 {
                            first.keep_better(&m);
                        }
                        best = best.min(m.us);
                    }
                    Err(e) if is_fatal(&e) => return Err(e),
                    // It ran once: keep that time.
                    Err(_) => {}
                }
            }
        }
        Ok(out)
    }
}

/// Candidates measured within this factor of the fastest are measured a second time.
const REMEASURE_WITHIN: f64 = 1.3;

/// Candidates whose single eager run took less than this many µs are timed as they will run,
/// in graphs ([`graph_times`]) — without the host's time to enqueue each run.
/// Eager back-to-back runs ranked short products differently from their graphs (H100,
/// 2026-11-23: the 8 × 256 → 256 forward product chose `rows8:2` by eager time in two
/// machines' runs, 4.5 µs graphed, where `cublaslt:0`, chosen in a third, took 3.7–3.9 µs
/// graphed), and counted the host time of cuDNN's legacy calls (cuDNN 9.14: about 60 µs for a
/// `cudnnAddTensor` of 131 072 elements) against them, so that `cudnn:7`, 21 µs graphed for a
/// 64 × 128 × 4² convolution, was no longer chosen (27.6 µs instead).
const GRAPH_TIMED_BELOW_US: f64 = 2000.0;

/// What a single eager run may spend on the host beyond 4× the best time before the candidate
/// is dropped without a proper measurement.
const HOST_SLACK_US: f64 = 200.0;

/// Name of the variable that says how the registry ranks candidates timed in graphs.
pub const TIMING_VAR: &str = "CUDAGRAPH_REGISTRY_TIMING";

/// How a candidate timed in graphs is ranked (`CUDAGRAPH_REGISTRY_TIMING`, read once per
/// process). Both graphs are timed and recorded either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphTiming {
    /// µs per run in a graph of `reps` runs: the candidate's cost inside a longer graph.
    Chain,
    /// µs per replay of a graph of one run: its cost as a graph of its own, launch included.
    Single,
    /// The mean of the two (the default).
    Both,
}

/// Parses a `CUDAGRAPH_REGISTRY_TIMING` value (unset or empty: `both`).
pub fn parse_graph_timing(v: &str) -> Result<GraphTiming> {
    match v.trim().to_ascii_lowercase().as_str() {
        "chain" => Ok(GraphTiming::Chain),
        "single" => Ok(GraphTiming::Single),
        "both" | "" => Ok(GraphTiming::Both),
        other => Err(NnError::Config(format!(
            "{TIMING_VAR}={other:?} is not a timing; use chain, single or both"
        ))),
    }
}

fn graph_timing() -> Result<GraphTiming> {
    static T: OnceLock<std::result::Result<GraphTiming, String>> = OnceLock::new();
    T.get_or_init(|| {
        parse_graph_timing(&std::env::var(TIMING_VAR).unwrap_or_default())
            .map_err(|e| e.to_string())
    })
    .clone()
    .map_err(NnError::Config)
}

/// One candidate's times: `us` ranks it; `chain`/`single` are its graph times when it was
/// timed in graphs.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Measured {
    us: f64,
    chain: Option<f64>,
    single: Option<f64>,
}

impl Measured {
    fn eager(us: f64) -> Measured {
        Measured {
            us,
            chain: None,
            single: None,
        }
    }

    /// Keeps the better of two measurements of one candidate (the lower `us`), whole: the
    /// graph times shown beside `us` are the ones it was ranked by.
    fn keep_better(&mut self, o: &Measured) {
        if o.us < self.us {
            *self = *o;
        }
    }
}

/// Times `run` as it replays in graphs, captured into `pool` (the registry's timing pool: a
/// dropped timing graph releases nothing), on `side`, a stream of the measuring queue's device
/// made once per measurement (the queue's work is complete: the caller synchronised on an
/// event after it, so the graphs read finished inputs). `chain`: `reps` runs captured into one
/// graph, replayed three times after an untimed replay, µs per run. `single`: one run captured
/// alone, its graph replayed max(`reps`, 10) times back to back behind a spin kernel (so the
/// host's launch rate is not what is timed), µs per replay. The two rank short kernels differently (H100, 2026-11-24: the 8 × 256 → 256
/// product's `rows8:1` took 3.7 µs per run in a chain and 4.5 as a graph of its own, where
/// cuBLASLt's first algorithm was slower in a chain and took 3.7–3.9 alone); `timing` says
/// which ranks.
#[allow(clippy::too_many_arguments)]
fn graph_times(
    side: &mut cudagraph::Stream,
    pool: &cudagraph::memory::Pool,
    spin: &Spin,
    e0: &Event,
    e1: &Event,
    reps: usize,
    timing: GraphTiming,
    run: &mut dyn FnMut(&dyn Queue) -> Result<()>,
) -> Result<Measured> {
    let (chain_g, ()) = Graph::capture(side, CaptureOptions::new().pool(pool), |cs| {
        for _ in 0..reps {
            run(cs).map_err(cudagraph::Error::from)?;
        }
        Ok(())
    })?;
    let (one_g, ()) = Graph::capture(side, CaptureOptions::new().pool(pool), |cs| {
        run(cs).map_err(cudagraph::Error::from)
    })?;
    const REPLAYS: usize = 3;
    chain_g.replay(side)?;
    side.record(e0)?;
    for _ in 0..REPLAYS {
        chain_g.replay(side)?;
    }
    side.record(e1)?;
    e1.synchronize()?;
    let chain = e0.elapsed_ms(e1)? as f64 * 1e3 / (REPLAYS * reps) as f64;
    let singles = reps.max(10);
    one_g.replay(side)?;
    spin.spin(&*side, 20_000 + 10_000 * singles as u64)?;
    side.record(e0)?;
    for _ in 0..singles {
        one_g.replay(side)?;
    }
    side.record(e1)?;
    e1.synchronize()?;
    let single = e0.elapsed_ms(e1)? as f64 * 1e3 / singles as f64;
    let us = match timing {
        GraphTiming::Chain => chain,
        GraphTiming::Single => single,
        GraphTiming::Both => 0.5 * (chain + single),
    };
    Ok(Measured {
        us,
        chain: Some(chain),
        single: Some(single),
    })
}

/// Whether a disk table was measured on this device, driver and libraries.
fn identity(t: &DiskTable, info: &DeviceInfo, libraries: &str) -> bool {
    t.device == info.name && t.driver == info.driver_version && t.libraries == libraries
}

/// Errors after which nothing else can run on the device.
fn is_fatal(e: &NnError) -> bool {
    matches!(e, NnError::Core(cudagraph::Error::ContextLost { .. }))
}

/// The registry's table as text: one line per key with the chosen engine, then the measured
/// µs of every candidate (fastest first).
pub fn format_table(rows: &[EngineRow]) -> String {
    let mut s = String::new();
    for r in rows {
        let mark = if r.entry.measured {
            ""
        } else {
            " (unmeasured)"
        };
        s.push_str(&format!("{}\n    -> {}{mark}", r.key, r.entry.engine));
        let mut t: Vec<&Timing> = r.entry.timings.iter().collect();
        t.sort_by(|a, b| {
            a.us.unwrap_or(f64::INFINITY)
                .total_cmp(&b.us.unwrap_or(f64::INFINITY))
        });
        if !t.is_empty() {
            let list: Vec<String> = t
                .iter()
                .map(|t| match t.us {
                    Some(us) => match (t.chain_us, t.single_us) {
                        (Some(c), Some(s1)) => {
                            format!("{} {us:.1} (chain {c:.1}, alone {s1:.1})", t.engine)
                        }
                        _ => format!("{} {us:.1}", t.engine),
                    },
                    None => format!("{} failed", t.engine),
                })
                .collect();
            s.push_str(&format!("   [µs: {}]", list.join(", ")));
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cuBLASLt's split-K variants are stored by their text (`cublaslt:RANK/skSPLIT`): it
    /// parses back to the same variant, belongs to the cuBLASLt family, and nothing close to
    /// it (a split below 2, missing numbers) parses.
    #[test]
    fn cublaslt_split_k_names_round_trip() {
        let a = GemmAlgo::CublasLtSplitK { rank: 0, split: 4 };
        assert_eq!(a.to_string(), "cublaslt:0/sk4");
        assert_eq!("cublaslt:0/sk4".parse::<GemmAlgo>().unwrap(), a);
        assert_eq!(a.family(), Engine::CublasLt);
        for rank in 0..3u8 {
            for split in crate::ffi::blaslt::SPLITS {
                let a = GemmAlgo::CublasLtSplitK { rank, split };
                assert_eq!(a.to_string().parse::<GemmAlgo>().unwrap(), a);
                assert_ne!(
                    a.to_string().parse::<GemmAlgo>().unwrap(),
                    GemmAlgo::CublasLt(rank)
                );
            }
        }
        assert_eq!(
            "cublaslt:1".parse::<GemmAlgo>().unwrap(),
            GemmAlgo::CublasLt(1)
        );
        for bad in [
            "cublaslt:0/sk1",
            "cublaslt:0/sk0",
            "cublaslt:0/sk",
            "cublaslt:/sk4",
            "cublaslt:0/sk4x",
            "cublaslt:0/4",
            "cublaslt:0/sk256",
            "cublaslt:0sk4",
        ] {
            assert!(bad.parse::<GemmAlgo>().is_err(), "{bad}");
        }
    }

    /// cuBLASLt's searched configurations are stored by their text (`cublaslt:cINDEX`): it
    /// parses back to the same configuration, belongs to the cuBLASLt family, differs from the
    /// heuristic rank of the same number, and nothing close to it parses.
    #[test]
    fn cublaslt_config_names_round_trip() {
        let a = GemmAlgo::CublasLtConfig(3);
        assert_eq!(a.to_string(), "cublaslt:c3");
        assert_eq!("cublaslt:c3".parse::<GemmAlgo>().unwrap(), a);
        assert_eq!(a.family(), Engine::CublasLt);
        for i in [0u8, 1, 7, 8, 42, 255] {
            let a = GemmAlgo::CublasLtConfig(i);
            assert_eq!(a.to_string().parse::<GemmAlgo>().unwrap(), a);
            assert_ne!(a, GemmAlgo::CublasLt(i));
            assert_ne!(a.to_string(), GemmAlgo::CublasLt(i).to_string());
        }
        for bad in [
            "cublaslt:c",
            "cublaslt:c-1",
            "cublaslt:c+1",
            "cublaslt:c01",
            "cublaslt:c256",
            "cublaslt:c1x",
            "cublaslt:cc1",
            "cublaslt:c 1",
            "cublaslt:C1",
            "cublaslt:c1/sk2",
            "cublaslt:0c1",
            "cublasltc1",
            "cublas:c1",
        ] {
            assert!(bad.parse::<GemmAlgo>().is_err(), "{bad}");
        }
    }

    #[test]
    fn engine_names_round_trip() {
        for a in [
            GemmAlgo::Cublas,
            GemmAlgo::CublasLt(2),
            GemmAlgo::CublasLtSplitK { rank: 0, split: 4 },
            GemmAlgo::CublasLtSplitK { rank: 2, split: 16 },
            GemmAlgo::CublasLtConfig(0),
            GemmAlgo::CublasLtConfig(7),
            GemmAlgo::Tiled(16),
            GemmAlgo::Reg(1),
            GemmAlgo::Reg(12),
            GemmAlgo::Cluster(8),
            GemmAlgo::Chunks(1),
            GemmAlgo::WarpK,
            GemmAlgo::Rows { rows: 16, ks: 4 },
            GemmAlgo::Rows { rows: 8, ks: 4 },
            GemmAlgo::Rows { rows: 4, ks: 1 },
            GemmAlgo::Cols {
                rows: 1,
                cols: 2,
                warps: 8,
                ks: 4,
            },
            GemmAlgo::Cols {
                rows: 16,
                cols: 1,
                warps: 16,
                ks: 16,
            },
        ] {
            assert_eq!(a.to_string().parse::<GemmAlgo>().unwrap(), a);
        }
        let cols = GemmAlgo::Cols {
            rows: 2,
            cols: 2,
            warps: 8,
            ks: 8,
        };
        assert_eq!(cols.to_string(), "cols2x2w8:8");
        assert_eq!(cols.family(), Engine::Rows);
        for bad in [
            "cols2x2w8",
            "cols2x2:8",
            "cols2w8:8",
            "cols02x2w8:8",
            "cols2x2w8:+8",
            "cols2x2w256:1",
            "colsxw:1",
        ] {
            assert!(bad.parse::<GemmAlgo>().is_err(), "{bad}");
        }
        assert_eq!(GemmAlgo::Rows { rows: 8, ks: 2 }.to_string(), "rows8:2");
        assert_eq!(GemmAlgo::Rows { rows: 16, ks: 2 }.to_string(), "rows:2");
        assert!("rows16:2".parse::<GemmAlgo>().is_err());
        assert_eq!(GemmAlgo::Reg(3).to_string(), "reg:3");
        for bad in ["reg64:1", "reg:", "reg:x", "reg", "reg:-1"] {
            assert!(bad.parse::<GemmAlgo>().is_err(), "{bad}");
        }
        for a in [BiasAlgo::Planes, BiasAlgo::CudnnAdd] {
            assert_eq!(a.to_string().parse::<BiasAlgo>().unwrap(), a);
        }
        for a in [CeAlgo::Rows, CeAlgo::Lanes(1), CeAlgo::Lanes(16)] {
            assert_eq!(a.to_string().parse::<CeAlgo>().unwrap(), a);
        }
        for bad in ["bias:other", "ce:lanes", "ce:lanesx", "rows", "ce:rows2"] {
            assert!(
                bad.parse::<BiasAlgo>().is_err() && bad.parse::<CeAlgo>().is_err(),
                "{bad}"
            );
        }
        for a in [
            ConvAlgo::Cudnn(1),
            ConvAlgo::CudnnGraph(0),
            ConvAlgo::CudnnGraph(255),
            ConvAlgo::CudnnGraphBias(0),
            ConvAlgo::CudnnGraphBias(3),
            ConvAlgo::CudnnGraphBias(255),
            ConvAlgo::Igemm(Tile::T32x128, 8),
            ConvAlgo::Direct,
            ConvAlgo::Wgrad(264),
        ] {
            assert_eq!(a.to_string().parse::<ConvAlgo>().unwrap(), a);
        }
        assert_eq!(
            ConvAlgo::Igemm(Tile::T64x64, 1).to_string(),
            "igemm:64x64:1"
        );
        assert!("cudnn".parse::<ConvAlgo>().is_err());
        assert_eq!(ConvAlgo::CudnnGraph(3).to_string(), "cudnnv8:3");
        assert!("cudnnv8:256".parse::<ConvAlgo>().is_err());
        assert!("cudnnv8".parse::<ConvAlgo>().is_err());
        assert_eq!(ConvAlgo::CudnnGraphBias(2).to_string(), "cudnnv8+bias:2");
        assert_eq!(
            "cudnnv8+bias:2".parse::<ConvAlgo>().unwrap(),
            ConvAlgo::CudnnGraphBias(2)
        );
        for bad in [
            "cudnnv8+bias",
            "cudnnv8+bias:",
            "cudnnv8+bias:256",
            "cudnnv8+bias:-1",
            "cudnnv8:bias:1",
            "cudnn+bias:1",
        ] {
            assert!(bad.parse::<ConvAlgo>().is_err(), "{bad}");
        }
        assert!("tiled:x".parse::<GemmAlgo>().is_err());
        assert!("igemm:7x7:1".parse::<ConvAlgo>().is_err());
    }

    #[test]
    fn environment_values_parse_or_name_the_variable() {
        assert_eq!(parse_gemm_engine("cublasLt").unwrap(), Engine::CublasLt);
        assert_eq!(parse_gemm_engine("").unwrap(), Engine::Auto);
        assert_eq!(parse_gemm_engine(" warpk ").unwrap(), Engine::WarpK);
        assert_eq!(parse_gemm_engine("rows").unwrap(), Engine::Rows);
        assert_eq!(parse_conv_engine("ours").unwrap(), ConvEngine::Ours);
        assert_eq!(parse_conv_engine("AUTO").unwrap(), ConvEngine::Auto);
        let e = parse_gemm_engine("cudnn").unwrap_err().to_string();
        assert!(
            e.contains("CUDAGRAPH_GEMM") && e.contains("cublaslt"),
            "{e}"
        );
        let e = parse_conv_engine("fast").unwrap_err().to_string();
        assert!(
            e.contains("CUDAGRAPH_CONV") && e.contains("\"fast\""),
            "{e}"
        );
        assert!(parse_deterministic("").unwrap());
        assert!(parse_deterministic(" 1").unwrap());
        assert!(!parse_deterministic("0").unwrap());
        assert!(!parse_deterministic("False").unwrap());
        let e = parse_deterministic("maybe").unwrap_err().to_string();
        assert!(
            e.contains("CUDAGRAPH_DETERMINISTIC") && e.contains("\"maybe\""),
            "{e}"
        );
    }

    #[test]
    fn families_and_scopes() {
        assert!(ConvEngine::Ours.allows(ConvAlgo::Direct));
        assert!(ConvEngine::Ours.allows(ConvAlgo::Igemm(Tile::T64x64, 1)));
        assert!(!ConvEngine::Ours.allows(ConvAlgo::Cudnn(0)));
        assert!(!ConvEngine::Ours.allows(ConvAlgo::CudnnGraph(0)));
        assert!(ConvEngine::Cudnn.allows(ConvAlgo::CudnnGraph(0)));
        assert!(ConvEngine::Auto.allows(ConvAlgo::CudnnGraph(0)));
        assert_eq!(ConvAlgo::CudnnGraph(2).family(), ConvEngine::Cudnn);
        // The fused convolution + bias is cuDNN's: forcing or disabling cuDNN covers it.
        assert_eq!(ConvAlgo::CudnnGraphBias(1).family(), ConvEngine::Cudnn);
        assert!(ConvEngine::Cudnn.allows(ConvAlgo::CudnnGraphBias(1)));
        assert!(ConvEngine::Auto.allows(ConvAlgo::CudnnGraphBias(1)));
        for fam in [ConvEngine::Ours, ConvEngine::Igemm, ConvEngine::Direct] {
            assert!(!fam.allows(ConvAlgo::CudnnGraphBias(1)), "{}", fam.name());
        }
        assert!(!ConvEngine::Igemm.allows(ConvAlgo::Direct));
        assert_eq!(GemmAlgo::CublasLt(0).family(), Engine::CublasLt);
        let p = Policy::default();
        assert_eq!(p.gemm_scope(Engine::Auto), "");
        assert_eq!(p.conv_scope(), "");
        let p = Policy {
            conv: ConvEngine::Ours,
            cudnn: false,
            cublaslt: false,
            ..Policy::default()
        };
        assert_eq!(p.conv_scope(), " [ours,-cudnn]");
        assert_eq!(p.gemm_scope(Engine::Tiled), " [tiled,-cublaslt]");
        let p = Policy {
            lt_split_k: true,
            ..Policy::default()
        };
        assert_eq!(p.gemm_scope(Engine::CublasLt), " [cublaslt,+splitk]");
        let p = Policy {
            lt_search: true,
            ..Policy::default()
        };
        assert_eq!(p.gemm_scope(Engine::Auto), " [+search]");
        assert_eq!(p.gemm_scope(Engine::CublasLt), " [cublaslt,+search]");
        let p = Policy {
            lt_split_k: true,
            lt_search: true,
            cublaslt: false,
            ..Policy::default()
        };
        assert_eq!(p.gemm_scope(Engine::Auto), " [-cublaslt,+splitk,+search]");
    }

    #[test]
    fn disk_table_round_trips_and_rejects_other_formats() {
        let dir = std::env::temp_dir().join(format!("cg-engines-{}", std::process::id()));
        let path = table_file(&dir, "NVIDIA H100 80GB HBM3", 13000);
        assert!(path
            .to_string_lossy()
            .ends_with("engines-NVIDIA_H100_80GB_HBM3-13000.json"));
        let mut entries = BTreeMap::new();
        entries.insert(
            "gemm NT m=32 n=512 k=1024 a=1 b=0 ep=bias".to_string(),
            Entry {
                engine: "tiled:8".into(),
                measured: true,
                timings: vec![
                    Timing {
                        engine: "tiled:8".into(),
                        us: Some(4.5),
                        chain_us: Some(4.0),
                        single_us: Some(5.0),
                        error: None,
                    },
                    Timing {
                        engine: "cublaslt:0".into(),
                        us: None,
                        chain_us: None,
                        single_us: None,
                        error: Some("not supported".into()),
                    },
                ],
                checked: false,
            },
        );
        let t = DiskTable {
            format: FORMAT,
            device: "NVIDIA H100 80GB HBM3".into(),
            driver: 13000,
            libraries: "cudnn 91400 cublasLt 130000".into(),
            entries,
        };
        t.save(&path).unwrap();
        assert_eq!(DiskTable::load(&path).unwrap(), t);
        // Another format version is ignored, as is a file that is not a table.
        let mut old = t.clone();
        old.format = FORMAT + 1;
        old.save(&path).unwrap();
        assert!(DiskTable::load(&path).is_none());
        std::fs::write(&path, "not json").unwrap();
        assert!(DiskTable::load(&path).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn table_text_lists_candidates_fastest_first() {
        let rows = vec![EngineRow {
            key: "conv_fwd n=1 c=3 h=8 w=8 oc=4 k=3x3 s=1 p=1 bias".into(),
            entry: Entry {
                engine: "cudnn:1".into(),
                measured: true,
                timings: vec![
                    Timing {
                        engine: "direct".into(),
                        us: Some(9.0),
                        chain_us: None,
                        single_us: None,
                        error: None,
                    },
                    Timing {
                        engine: "cudnn:1".into(),
                        us: Some(3.25),
                        chain_us: Some(3.0),
                        single_us: Some(3.5),
                        error: None,
                    },
                ],
                checked: true,
            },
        }];
        let s = format_table(&rows);
        assert!(s.contains("-> cudnn:1"), "{s}");
        let (a, b) = (
            s.find("cudnn:1 3.2").unwrap(),
            s.find("direct 9.0").unwrap(),
        );
        assert!(a < b, "{s}");
        assert!(s.contains("cudnn:1 3.2 (chain 3.0, alone 3.5)"), "{s}");
    }

    #[test]
    fn graph_timing_values_parse_and_others_are_refused() {
        assert_eq!(parse_graph_timing("").unwrap(), GraphTiming::Both);
        assert_eq!(parse_graph_timing(" Chain ").unwrap(), GraphTiming::Chain);
        assert_eq!(parse_graph_timing("single").unwrap(), GraphTiming::Single);
        assert_eq!(parse_graph_timing("both").unwrap(), GraphTiming::Both);
        let e = parse_graph_timing("fastest").unwrap_err().to_string();
        assert!(
            e.contains(TIMING_VAR) && e.contains("chain, single or both"),
            "{e}"
        );
    }

    #[test]
    fn a_second_measurement_keeps_the_better_one_whole() {
        let first = Measured {
            us: 4.0,
            chain: Some(3.0),
            single: Some(5.0),
        };
        let mut a = first;
        // Slower overall, though its single-graph time is lower: the first stays, whole, so
        // `us` is still the mean of the times shown beside it.
        a.keep_better(&Measured {
            us: 4.2,
            chain: Some(3.6),
            single: Some(4.8),
        });
        assert_eq!(a, first);
        let second = Measured {
            us: 3.8,
            chain: Some(3.4),
            single: Some(4.2),
        };
        a.keep_better(&second);
        assert_eq!(a, second);
        a.keep_better(&Measured::eager(3.7));
        assert_eq!(a, Measured::eager(3.7));
    }
}
