//! [`Policy`]: what the registry may choose from — the families forced by `CUDAGRAPH_GEMM`
//! and `CUDAGRAPH_CONV`, libraries on or off, deterministic engines only unless
//! `CUDAGRAPH_DETERMINISTIC=0`, cuBLASLt's opt-in split-K variants and searched configurations
//! — and the part of a registry key that records its restrictions.

use std::sync::OnceLock;

use super::catalog::{ConvEngine, Engine};
use crate::error::{NnError, Result};

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
/// ([`Policy::from_env`]); [`Engines::set_policy`](super::Engines::set_policy) changes it (tests, comparisons).
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::catalog::{ConvAlgo, GemmAlgo};
    use crate::kernels::igemm::Tile;

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
}
