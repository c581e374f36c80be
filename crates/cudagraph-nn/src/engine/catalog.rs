//! The names of the registry's choices: the families a policy can force ([`GemmFamily`] for
//! products, [`ConvFamily`] for convolutions) and the concrete candidates of each operation
//! ([`GemmEngine`], [`ConvEngine`], [`BiasEngine`], [`CeEngine`]), each with the text it is stored and
//! shown as (`cublaslt:0/sk4`, `igemm:64x64:8`, ...), which parses back to it.

use std::fmt;
use std::str::FromStr;

use crate::error::{NnError, Result};
use crate::kernels::igemm::Tile;

/// A family of product engines (the registry measures within it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmFamily {
    /// cuBLAS SGEMM, with our bias/ReLU and bias-gradient kernels.
    Cublas,
    /// cuBLASLt's heuristic top few algorithms, epilogues fused, and (when the policy asks,
    /// [`Policy::lt_split_k`](super::Policy::lt_split_k)) split-K variants of the first three where a product leaves the
    /// device under-occupied, and ([`Policy::lt_search`](super::Policy::lt_search)) up to eight configurations found by
    /// searching algorithm ids, tiles and stages.
    CublasLt,
    /// The tiled split-K kernel (any layout).
    Tiled,
    /// One kernel, K split across the warps of a block (forward layout `x·wᵀ`, alpha 1,
    /// beta 0 only; other products fall back to `Tiled`).
    WarpK,
    /// Our kernels for few rows, the few-rows and column-warp ones (forward layout, alpha 1,
    /// beta 0, at most [`crate::engine::gemm::ROWS_MAX_M`] rows, k a multiple of 4; other products fall
    /// back to `Tiled`); for half-precision products the few-row kernel `gemv:KS`
    /// ([`GemmEngine::Gemv`]), which the policy does not force (it only joins the measurement).
    Rows,
    /// Every engine available, measured per shape by the registry; before a measurement (in a
    /// capture) the heuristic default of [`crate::engine::gemm::auto_family`].
    Auto,
}

impl GemmFamily {
    /// The name `CUDAGRAPH_GEMM` uses.
    pub fn name(self) -> &'static str {
        match self {
            GemmFamily::Cublas => "cublas",
            GemmFamily::CublasLt => "cublaslt",
            GemmFamily::Tiled => "tiled",
            GemmFamily::WarpK => "warpk",
            GemmFamily::Rows => "rows",
            GemmFamily::Auto => "auto",
        }
    }
}

/// Which engines convolutions may use (`CUDAGRAPH_CONV`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConvFamily {
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

impl ConvFamily {
    /// The name `CUDAGRAPH_CONV` uses.
    pub fn name(self) -> &'static str {
        match self {
            ConvFamily::Auto => "auto",
            ConvFamily::Cudnn => "cudnn",
            ConvFamily::Ours => "ours",
            ConvFamily::Igemm => "igemm",
            ConvFamily::Direct => "direct",
        }
    }

    /// Whether `algo` belongs to this family.
    pub fn allows(self, algo: ConvEngine) -> bool {
        matches!(
            (self, algo),
            (ConvFamily::Auto, _)
                | (
                    ConvFamily::Cudnn,
                    ConvEngine::Cudnn(_)
                        | ConvEngine::CudnnGraph(_)
                        | ConvEngine::CudnnGraphBias(_)
                )
                | (
                    ConvFamily::Ours,
                    ConvEngine::Igemm(..) | ConvEngine::Direct | ConvEngine::Wgrad(_)
                )
                | (ConvFamily::Igemm, ConvEngine::Igemm(..))
                | (
                    ConvFamily::Direct,
                    ConvEngine::Direct | ConvEngine::Wgrad(_)
                )
        )
    }
}

/// One concrete way to run a matrix product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmEngine {
    /// cuBLAS SGEMM (+ our bias/ReLU or bias-gradient kernel).
    Cublas,
    /// cuBLASLt with its heuristic algorithm of this rank (epilogue fused).
    CublasLt(u8),
    /// cuBLASLt's heuristic algorithm of rank `rank` with K split `split` ways (a split-K
    /// variant the plan kept for an under-occupied product, see `crate::ffi::blaslt`); shown as
    /// `cublaslt:RANK/skSPLIT`.
    CublasLtSplitK {
        /// Rank of the algorithm in cuBLASLt's heuristic list (0: its first choice).
        rank: u8,
        /// Number of K splits (at least 2).
        split: u8,
    },
    /// cuBLASLt's configuration of this index among those its search kept for the shape
    /// ([`Policy::lt_search`](super::Policy::lt_search), `crate::ffi::blaslt::BlasLt::search_configs`); shown as
    /// `cublaslt:cINDEX`.
    CublasLtConfig(u8),
    /// cuBLASLt's heuristic algorithm of this rank for the transposed product, `Cᵀ =
    /// op(B)ᵀ·op(A)ᵀ`, into a scratch matrix, which a transposing copy then writes into C; shown
    /// as `cublaslt-t:RANK`. Offered where C's rows are no multiple of 16 bytes apart
    /// (n · the element size), beta is 0 and there is no epilogue: cuBLASLt's algorithms for a
    /// product whose rows are n elements long with n unaligned can be several times slower
    /// than the transposed product and the copy together (a head of 50 257 logits at 64 rows
    /// on an H200: 106–154 µs on cuBLASLt's algorithms, 38 as this engine, the copy included).
    CublasLtTransposed(u8),
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
    Rows {
        /// Rows per block: 16, 8 or 4.
        rows: u8,
        /// Warps splitting K per group of four columns.
        ks: u8,
    },
    /// Our column-warp kernels for few rows (forward layout, alpha 1, beta 0): each warp `rows`
    /// rows × `cols` columns, `warps` warps per block, `ks` of them splitting K per column group
    /// (`crate::kernels::ColsShape`); shown as `colsRxCwW:KS`.
    Cols {
        /// Rows per warp.
        rows: u8,
        /// Columns per warp.
        cols: u8,
        /// Warps per block.
        warps: u8,
        /// Warps splitting K per column group.
        ks: u8,
    },
    /// Our few-row matrix–vector kernel for half-precision products (`x·wᵀ`, at most
    /// [`crate::engine::gemm_lowp::GEMV_MAX_M`] rows, k a multiple of 8; any alpha and beta; the
    /// epilogues none, bias, bias + ReLU, bias + GELU) with this many warps splitting each
    /// column's depth (1, 2, 4 or 8); shown as `gemv:KS`. `gemm_lowp` only.
    Gemv(u8),
    /// The tensor-core variant of [`GemmEngine::Gemv`] (`mma.sync`, 16 weight rows a warp, at
    /// most [`crate::engine::gemm_lowp::GEMV_MMA_MAX_M`] rows; the same products and
    /// epilogues) with this many warps splitting each 16-column tile's depth (1, 2, 4 or 8);
    /// shown as `gemv-mma:KS`. `gemm_lowp` only.
    GemvMma(u8),
}

impl GemmEngine {
    /// The family it belongs to.
    pub fn family(self) -> GemmFamily {
        match self {
            GemmEngine::Cublas => GemmFamily::Cublas,
            GemmEngine::CublasLt(_)
            | GemmEngine::CublasLtSplitK { .. }
            | GemmEngine::CublasLtConfig(_)
            | GemmEngine::CublasLtTransposed(_) => GemmFamily::CublasLt,
            GemmEngine::Tiled(_)
            | GemmEngine::Reg(_)
            | GemmEngine::Cluster(_)
            | GemmEngine::Chunks(_) => GemmFamily::Tiled,
            GemmEngine::WarpK => GemmFamily::WarpK,
            GemmEngine::Rows { .. }
            | GemmEngine::Cols { .. }
            | GemmEngine::Gemv(_)
            | GemmEngine::GemvMma(_) => GemmFamily::Rows,
        }
    }
}

impl fmt::Display for GemmEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GemmEngine::Cublas => write!(f, "cublas"),
            GemmEngine::CublasLt(r) => write!(f, "cublaslt:{r}"),
            GemmEngine::CublasLtSplitK { rank, split } => write!(f, "cublaslt:{rank}/sk{split}"),
            GemmEngine::CublasLtConfig(i) => write!(f, "cublaslt:c{i}"),
            GemmEngine::CublasLtTransposed(r) => write!(f, "cublaslt-t:{r}"),
            GemmEngine::Tiled(s) => write!(f, "tiled:{s}"),
            GemmEngine::Reg(s) => write!(f, "reg:{s}"),
            GemmEngine::Cluster(s) => write!(f, "cluster:{s}"),
            GemmEngine::Chunks(s) => write!(f, "chunks:{s}"),
            GemmEngine::WarpK => write!(f, "warpk"),
            GemmEngine::Rows { rows: 16, ks } => write!(f, "rows:{ks}"),
            GemmEngine::Rows { rows, ks } => write!(f, "rows{rows}:{ks}"),
            GemmEngine::Cols {
                rows,
                cols,
                warps,
                ks,
            } => write!(f, "cols{rows}x{cols}w{warps}:{ks}"),
            GemmEngine::Gemv(ks) => write!(f, "gemv:{ks}"),
            GemmEngine::GemvMma(ks) => write!(f, "gemv-mma:{ks}"),
        }
    }
}

impl FromStr for GemmEngine {
    type Err = NnError;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || NnError::Config(format!("{s:?} is not a product engine"));
        match s.split_once(':') {
            None if s == "cublas" => Ok(GemmEngine::Cublas),
            None if s == "warpk" => Ok(GemmEngine::WarpK),
            Some(("cublaslt", r)) if r.starts_with('c') => {
                // Only the canonical decimal index (no sign, no leading zeros).
                let i: u8 = r[1..].parse().map_err(|_| bad())?;
                match r[1..] == i.to_string() {
                    true => Ok(GemmEngine::CublasLtConfig(i)),
                    false => Err(bad()),
                }
            }
            Some(("cublaslt", r)) => match r.split_once("/sk") {
                None => r.parse().map(GemmEngine::CublasLt).map_err(|_| bad()),
                Some((rank, split)) => {
                    let (rank, split) = (rank.parse(), split.parse());
                    match (rank, split) {
                        (Ok(rank), Ok(split)) if split >= 2 => {
                            Ok(GemmEngine::CublasLtSplitK { rank, split })
                        }
                        _ => Err(bad()),
                    }
                }
            },
            Some(("cublaslt-t", r)) => {
                // Only the canonical decimal (so that a name prints back as itself).
                let rank: u8 = r.parse().map_err(|_| bad())?;
                match r == rank.to_string() {
                    true => Ok(GemmEngine::CublasLtTransposed(rank)),
                    false => Err(bad()),
                }
            }
            Some(("tiled", r)) => r.parse().map(GemmEngine::Tiled).map_err(|_| bad()),
            Some(("reg", r)) => r.parse().map(GemmEngine::Reg).map_err(|_| bad()),
            Some(("cluster", r)) => r.parse().map(GemmEngine::Cluster).map_err(|_| bad()),
            Some(("chunks", r)) => r.parse().map(GemmEngine::Chunks).map_err(|_| bad()),
            Some((p @ ("gemv" | "gemv-mma"), r)) => {
                // Only the canonical decimal (so that a name prints back as itself).
                let ks: u8 = r.parse().map_err(|_| bad())?;
                match (r == ks.to_string(), p == "gemv") {
                    (true, true) => Ok(GemmEngine::Gemv(ks)),
                    (true, false) => Ok(GemmEngine::GemvMma(ks)),
                    (false, _) => Err(bad()),
                }
            }
            Some((p @ ("rows" | "rows8" | "rows4"), r)) => Ok(GemmEngine::Rows {
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
                Ok(GemmEngine::Cols {
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
pub enum ConvEngine {
    /// cuDNN with this `cudnnConvolution*Algo_t`.
    Cudnn(u32),
    /// cuDNN's graph API with the engine configuration of this rank in the key's filtered
    /// heuristic list (`crate::ffi::cudnn_graph`); shown as `cudnnv8:RANK`.
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

impl ConvEngine {
    /// The narrowest family it belongs to.
    pub fn family(self) -> ConvFamily {
        match self {
            ConvEngine::Cudnn(_) | ConvEngine::CudnnGraph(_) | ConvEngine::CudnnGraphBias(_) => {
                ConvFamily::Cudnn
            }
            ConvEngine::Igemm(..) => ConvFamily::Igemm,
            ConvEngine::Direct | ConvEngine::Wgrad(_) => ConvFamily::Direct,
        }
    }
}

impl fmt::Display for ConvEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConvEngine::Cudnn(a) => write!(f, "cudnn:{a}"),
            ConvEngine::CudnnGraph(r) => write!(f, "cudnnv8:{r}"),
            ConvEngine::CudnnGraphBias(r) => write!(f, "cudnnv8+bias:{r}"),
            ConvEngine::Igemm(t, s) => write!(f, "igemm:{}:{s}", t.name()),
            ConvEngine::Direct => write!(f, "direct"),
            ConvEngine::Wgrad(p) => write!(f, "wgrad:{p}"),
        }
    }
}

impl FromStr for ConvEngine {
    type Err = NnError;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || NnError::Config(format!("{s:?} is not a convolution engine"));
        let parts: Vec<&str> = s.split(':').collect();
        match parts.as_slice() {
            ["direct"] => Ok(ConvEngine::Direct),
            ["cudnn", a] => a.parse().map(ConvEngine::Cudnn).map_err(|_| bad()),
            ["cudnnv8", r] => r.parse().map(ConvEngine::CudnnGraph).map_err(|_| bad()),
            ["cudnnv8+bias", r] => r.parse().map(ConvEngine::CudnnGraphBias).map_err(|_| bad()),
            ["wgrad", p] => p.parse().map(ConvEngine::Wgrad).map_err(|_| bad()),
            ["igemm", t, n] => {
                let t = Tile::from_name(t).ok_or_else(bad)?;
                n.parse()
                    .map(|n| ConvEngine::Igemm(t, n))
                    .map_err(|_| bad())
            }
            _ => Err(bad()),
        }
    }
}

/// How a convolution's bias is added after an engine that does not fuse it (cuDNN's): measured
/// per output shape like the convolution itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BiasEngine {
    /// Our `bias_planes` kernel (four elements per thread where the planes allow).
    Planes,
    /// `cudnnAddTensor`.
    CudnnAdd,
}

impl fmt::Display for BiasEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BiasEngine::Planes => "bias:planes",
            BiasEngine::CudnnAdd => "bias:cudnn",
        })
    }
}

impl FromStr for BiasEngine {
    type Err = NnError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "bias:planes" => Ok(BiasEngine::Planes),
            "bias:cudnn" => Ok(BiasEngine::CudnnAdd),
            _ => Err(NnError::Config(format!("{s:?} is not a bias engine"))),
        }
    }
}

/// How a cross-entropy over narrow rows runs (`crate::autograd::ops::cross_entropy`): measured per
/// (rows, classes, gradient or not).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CeEngine {
    /// The fixed plan (`kernels::losses::ce_plan`): a warp a row, a sum pass when the rows take
    /// more than one block.
    Rows,
    /// One block where this many lanes take a row (`kernels::losses::ce_group_plans`).
    Lanes(u8),
}

impl fmt::Display for CeEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CeEngine::Rows => f.write_str("ce:rows"),
            CeEngine::Lanes(l) => write!(f, "ce:lanes{l}"),
        }
    }
}

impl FromStr for CeEngine {
    type Err = NnError;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || NnError::Config(format!("{s:?} is not a cross-entropy plan"));
        match s.strip_prefix("ce:") {
            Some("rows") => Ok(CeEngine::Rows),
            Some(l) => l
                .strip_prefix("lanes")
                .and_then(|n| n.parse().ok())
                .map(CeEngine::Lanes)
                .ok_or_else(bad),
            None => Err(bad()),
        }
    }
}

/// What the registry stores per key: implemented by [`GemmEngine`], [`ConvEngine`], [`BiasEngine`]
/// and [`CeEngine`].
pub trait Engine: Copy + PartialEq + fmt::Display + FromStr {}
impl Engine for GemmEngine {}
impl Engine for ConvEngine {}
impl Engine for BiasEngine {}
impl Engine for CeEngine {}

#[cfg(test)]
mod tests {
    use super::*;

    /// cuBLASLt's split-K variants are stored by their text (`cublaslt:RANK/skSPLIT`): it
    /// parses back to the same variant, belongs to the cuBLASLt family, and nothing close to
    /// it (a split below 2, missing numbers) parses.
    #[test]
    fn cublaslt_split_k_names_round_trip() {
        let a = GemmEngine::CublasLtSplitK { rank: 0, split: 4 };
        assert_eq!(a.to_string(), "cublaslt:0/sk4");
        assert_eq!("cublaslt:0/sk4".parse::<GemmEngine>().unwrap(), a);
        assert_eq!(a.family(), GemmFamily::CublasLt);
        for rank in 0..3u8 {
            for split in crate::ffi::blaslt::SPLITS {
                let a = GemmEngine::CublasLtSplitK { rank, split };
                assert_eq!(a.to_string().parse::<GemmEngine>().unwrap(), a);
                assert_ne!(
                    a.to_string().parse::<GemmEngine>().unwrap(),
                    GemmEngine::CublasLt(rank)
                );
            }
        }
        assert_eq!(
            "cublaslt:1".parse::<GemmEngine>().unwrap(),
            GemmEngine::CublasLt(1)
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
            assert!(bad.parse::<GemmEngine>().is_err(), "{bad}");
        }
    }

    /// The transposed cuBLASLt engine is stored as `cublaslt-t:RANK`: it parses back, belongs to
    /// the cuBLASLt family, is its own kind (the text before `:`), and nothing close parses.
    #[test]
    fn transposed_cublaslt_names_round_trip() {
        for r in [0u8, 1, 11, 255] {
            let a = GemmEngine::CublasLtTransposed(r);
            assert_eq!(a.to_string(), format!("cublaslt-t:{r}"));
            assert_eq!(a.to_string().parse::<GemmEngine>().unwrap(), a);
            assert_eq!(a.family(), GemmFamily::CublasLt);
            assert_ne!(a, GemmEngine::CublasLt(r));
        }
        for bad in [
            "cublaslt-t",
            "cublaslt-t:",
            "cublaslt-t:01",
            "cublaslt-t:256",
            "cublaslt-t:-1",
            "cublaslt-t:c1",
            "cublaslt-t:1/sk2",
            "cublas-t:1",
        ] {
            assert!(bad.parse::<GemmEngine>().is_err(), "{bad}");
        }
    }

    /// cuBLASLt's searched configurations are stored by their text (`cublaslt:cINDEX`): it
    /// parses back to the same configuration, belongs to the cuBLASLt family, differs from the
    /// heuristic rank of the same number, and nothing close to it parses.
    #[test]
    fn cublaslt_config_names_round_trip() {
        let a = GemmEngine::CublasLtConfig(3);
        assert_eq!(a.to_string(), "cublaslt:c3");
        assert_eq!("cublaslt:c3".parse::<GemmEngine>().unwrap(), a);
        assert_eq!(a.family(), GemmFamily::CublasLt);
        for i in [0u8, 1, 7, 8, 42, 255] {
            let a = GemmEngine::CublasLtConfig(i);
            assert_eq!(a.to_string().parse::<GemmEngine>().unwrap(), a);
            assert_ne!(a, GemmEngine::CublasLt(i));
            assert_ne!(a.to_string(), GemmEngine::CublasLt(i).to_string());
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
            assert!(bad.parse::<GemmEngine>().is_err(), "{bad}");
        }
    }

    #[test]
    fn engine_names_round_trip() {
        for a in [
            GemmEngine::Cublas,
            GemmEngine::CublasLt(2),
            GemmEngine::CublasLtSplitK { rank: 0, split: 4 },
            GemmEngine::CublasLtSplitK { rank: 2, split: 16 },
            GemmEngine::CublasLtConfig(0),
            GemmEngine::CublasLtConfig(7),
            GemmEngine::Tiled(16),
            GemmEngine::Reg(1),
            GemmEngine::Reg(12),
            GemmEngine::Cluster(8),
            GemmEngine::Chunks(1),
            GemmEngine::WarpK,
            GemmEngine::Rows { rows: 16, ks: 4 },
            GemmEngine::Rows { rows: 8, ks: 4 },
            GemmEngine::Rows { rows: 4, ks: 1 },
            GemmEngine::Cols {
                rows: 1,
                cols: 2,
                warps: 8,
                ks: 4,
            },
            GemmEngine::Cols {
                rows: 16,
                cols: 1,
                warps: 16,
                ks: 16,
            },
        ] {
            assert_eq!(a.to_string().parse::<GemmEngine>().unwrap(), a);
        }
        let cols = GemmEngine::Cols {
            rows: 2,
            cols: 2,
            warps: 8,
            ks: 8,
        };
        assert_eq!(cols.to_string(), "cols2x2w8:8");
        assert_eq!(cols.family(), GemmFamily::Rows);
        for bad in [
            "cols2x2w8",
            "cols2x2:8",
            "cols2w8:8",
            "cols02x2w8:8",
            "cols2x2w8:+8",
            "cols2x2w256:1",
            "colsxw:1",
        ] {
            assert!(bad.parse::<GemmEngine>().is_err(), "{bad}");
        }
        assert_eq!(GemmEngine::Rows { rows: 8, ks: 2 }.to_string(), "rows8:2");
        assert_eq!(GemmEngine::Rows { rows: 16, ks: 2 }.to_string(), "rows:2");
        assert!("rows16:2".parse::<GemmEngine>().is_err());
        assert_eq!(GemmEngine::Reg(3).to_string(), "reg:3");
        for ks in [1u8, 2, 4, 8] {
            let g = GemmEngine::Gemv(ks);
            assert_eq!(g.to_string(), format!("gemv:{ks}"));
            assert_eq!(g.to_string().parse::<GemmEngine>().unwrap(), g);
            assert_eq!(g.family(), GemmFamily::Rows);
            let t = GemmEngine::GemvMma(ks);
            assert_eq!(t.to_string(), format!("gemv-mma:{ks}"));
            assert_eq!(t.to_string().parse::<GemmEngine>().unwrap(), t);
            assert_eq!(t.family(), GemmFamily::Rows);
        }
        for bad in [
            "gemv",
            "gemv:",
            "gemv:x",
            "gemv:01",
            "gemv:+1",
            "gemv:256",
            "gemv1:1",
            "gemv-mma",
            "gemv-mma:",
            "gemv-mma:02",
            "gemv_mma:1",
        ] {
            assert!(bad.parse::<GemmEngine>().is_err(), "{bad}");
        }
        for bad in ["reg64:1", "reg:", "reg:x", "reg", "reg:-1"] {
            assert!(bad.parse::<GemmEngine>().is_err(), "{bad}");
        }
        for a in [BiasEngine::Planes, BiasEngine::CudnnAdd] {
            assert_eq!(a.to_string().parse::<BiasEngine>().unwrap(), a);
        }
        for a in [CeEngine::Rows, CeEngine::Lanes(1), CeEngine::Lanes(16)] {
            assert_eq!(a.to_string().parse::<CeEngine>().unwrap(), a);
        }
        for bad in ["bias:other", "ce:lanes", "ce:lanesx", "rows", "ce:rows2"] {
            assert!(
                bad.parse::<BiasEngine>().is_err() && bad.parse::<CeEngine>().is_err(),
                "{bad}"
            );
        }
        for a in [
            ConvEngine::Cudnn(1),
            ConvEngine::CudnnGraph(0),
            ConvEngine::CudnnGraph(255),
            ConvEngine::CudnnGraphBias(0),
            ConvEngine::CudnnGraphBias(3),
            ConvEngine::CudnnGraphBias(255),
            ConvEngine::Igemm(Tile::T32x128, 8),
            ConvEngine::Direct,
            ConvEngine::Wgrad(264),
        ] {
            assert_eq!(a.to_string().parse::<ConvEngine>().unwrap(), a);
        }
        assert_eq!(
            ConvEngine::Igemm(Tile::T64x64, 1).to_string(),
            "igemm:64x64:1"
        );
        assert!("cudnn".parse::<ConvEngine>().is_err());
        assert_eq!(ConvEngine::CudnnGraph(3).to_string(), "cudnnv8:3");
        assert!("cudnnv8:256".parse::<ConvEngine>().is_err());
        assert!("cudnnv8".parse::<ConvEngine>().is_err());
        assert_eq!(ConvEngine::CudnnGraphBias(2).to_string(), "cudnnv8+bias:2");
        assert_eq!(
            "cudnnv8+bias:2".parse::<ConvEngine>().unwrap(),
            ConvEngine::CudnnGraphBias(2)
        );
        for bad in [
            "cudnnv8+bias",
            "cudnnv8+bias:",
            "cudnnv8+bias:256",
            "cudnnv8+bias:-1",
            "cudnnv8:bias:1",
            "cudnn+bias:1",
        ] {
            assert!(bad.parse::<ConvEngine>().is_err(), "{bad}");
        }
        assert!("tiled:x".parse::<GemmEngine>().is_err());
        assert!("igemm:7x7:1".parse::<ConvEngine>().is_err());
    }
}
