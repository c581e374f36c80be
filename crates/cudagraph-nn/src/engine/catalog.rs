//! The names of the registry's choices: the families a policy can force ([`Engine`] for
//! products, [`ConvEngine`] for convolutions) and the concrete candidates of each operation
//! ([`GemmAlgo`], [`ConvAlgo`], [`BiasAlgo`], [`CeAlgo`]), each with the text it is stored and
//! shown as (`cublaslt:0/sk4`, `igemm:64x64:8`, ...), which parses back to it.

use std::fmt;
use std::str::FromStr;

use crate::error::{NnError, Result};
use crate::kernels::igemm::Tile;

/// A family of product engines (the registry measures within it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Engine {
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
    /// ([`Policy::lt_search`](super::Policy::lt_search), [`crate::ffi::blaslt::BlasLt::search_configs`]); shown as
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
}
