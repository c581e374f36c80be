//! [`Policy`]: what the registry may choose from — the families forced by `CUDAGRAPH_GEMM`
//! and `CUDAGRAPH_CONV`, libraries on or off, deterministic engines only unless
//! `CUDAGRAPH_DETERMINISTIC=0`, cuBLASLt's opt-in split-K variants and searched configurations,
//! the two TF32 switches (`CUDAGRAPH_TF32_MATMUL`, `CUDAGRAPH_TF32_CONV`, both off by default)
//! — and the part of a registry key that records its restrictions.

use std::sync::OnceLock;

use super::catalog::{ConvFamily, GemmFamily};
use crate::env::{
    self, CONV_VAR, DETERMINISTIC_VAR, GEMM_VAR, LT_SEARCH_VAR, LT_SPLITK_VAR, TF32_CONV_VAR,
    TF32_MATMUL_VAR,
};
use crate::error::{NnError, Result};

/// Parses a `CUDAGRAPH_GEMM` value.
pub fn parse_gemm_family(v: &str) -> Result<GemmFamily> {
    match v.trim().to_ascii_lowercase().as_str() {
        "cublas" => Ok(GemmFamily::Cublas),
        "cublaslt" => Ok(GemmFamily::CublasLt),
        "tiled" => Ok(GemmFamily::Tiled),
        "warpk" => Ok(GemmFamily::WarpK),
        "rows" => Ok(GemmFamily::Rows),
        "auto" | "" => Ok(GemmFamily::Auto),
        other => Err(NnError::Config(format!(
            "{GEMM_VAR}={other:?} is not an engine; use one of cublas, cublaslt, tiled, warpk, rows, auto"
        ))),
    }
}

/// Parses a `CUDAGRAPH_DETERMINISTIC` value (unset or empty: deterministic).
pub fn parse_deterministic(v: &str) -> Result<bool> {
    env::parse_switch(
        DETERMINISTIC_VAR,
        v,
        true,
        "1 (only bit-reproducible engines, the default) or 0 (also cuDNN's non-deterministic \
         algorithms)",
    )
}

/// Parses a `CUDAGRAPH_TF32_MATMUL` value (unset or empty: off).
pub fn parse_tf32_matmul(v: &str) -> Result<bool> {
    env::parse_switch(
        TF32_MATMUL_VAR,
        v,
        false,
        "1 (matrix products may use TF32 tensor cores) or 0 (full fp32, the default)",
    )
}

/// Parses a `CUDAGRAPH_TF32_CONV` value (unset or empty: off).
pub fn parse_tf32_conv(v: &str) -> Result<bool> {
    env::parse_switch(
        TF32_CONV_VAR,
        v,
        false,
        "1 (convolutions may use TF32 tensor cores) or 0 (full fp32, the default)",
    )
}

/// Parses a `CUDAGRAPH_CONV` value.
pub fn parse_conv_family(v: &str) -> Result<ConvFamily> {
    match v.trim().to_ascii_lowercase().as_str() {
        "cudnn" => Ok(ConvFamily::Cudnn),
        "ours" => Ok(ConvFamily::Ours),
        "igemm" => Ok(ConvFamily::Igemm),
        "direct" => Ok(ConvFamily::Direct),
        "auto" | "" => Ok(ConvFamily::Auto),
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
    pub gemm: GemmFamily,
    /// Convolution engines allowed (`Auto`: all).
    pub conv: ConvFamily,
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
    /// `cublasLtMatmulAlgoCheck` (`crate::ffi::blaslt`'s module docs; `CUDAGRAPH_LT_SEARCH=1`;
    /// default `false`: the search adds to every first call's measurement and is measured
    /// first on the device, shown as `cublaslt:cN`).
    pub lt_search: bool,
    /// Matrix products through cuBLAS and cuBLASLt may use TF32 tensor cores (10-bit
    /// mantissa), like PyTorch's `torch.backends.cuda.matmul.allow_tf32`
    /// (`CUDAGRAPH_TF32_MATMUL=1`; default `false`: f32 means f32, bit for bit as without the
    /// switch). Our own kernels never use TF32; they stay candidates either way.
    pub tf32_matmul: bool,
    /// Convolutions through cuDNN may use TF32 tensor cores, like PyTorch's
    /// `torch.backends.cudnn.allow_tf32` (`CUDAGRAPH_TF32_CONV=1`; default `false`; PyTorch's
    /// default is `true`).
    pub tf32_conv: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            gemm: GemmFamily::Auto,
            conv: ConvFamily::Auto,
            cudnn: true,
            cublaslt: true,
            deterministic: true,
            lt_split_k: false,
            lt_search: false,
            tf32_matmul: false,
            tf32_conv: false,
        }
    }
}

impl Policy {
    /// The default policy with `CUDAGRAPH_GEMM`, `CUDAGRAPH_CONV`, `CUDAGRAPH_DETERMINISTIC`,
    /// `CUDAGRAPH_LT_SPLITK`, `CUDAGRAPH_LT_SEARCH`, `CUDAGRAPH_TF32_MATMUL` and
    /// `CUDAGRAPH_TF32_CONV` applied (read once per process; an
    /// invalid value is an error every time).
    pub fn from_env() -> Result<Policy> {
        static ENV: OnceLock<std::result::Result<Policy, String>> = OnceLock::new();
        let parsed = ENV.get_or_init(|| {
            let get = |name: &str| env::var(name).unwrap_or_default();
            let switch = |var: &str, meaning: &str| {
                env::parse_switch(var, &get(var), false, meaning).map_err(|e| e.to_string())
            };
            Ok(Policy {
                gemm: parse_gemm_family(&get(GEMM_VAR)).map_err(|e| e.to_string())?,
                conv: parse_conv_family(&get(CONV_VAR)).map_err(|e| e.to_string())?,
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
                tf32_matmul: parse_tf32_matmul(&get(TF32_MATMUL_VAR)).map_err(|e| e.to_string())?,
                tf32_conv: parse_tf32_conv(&get(TF32_CONV_VAR)).map_err(|e| e.to_string())?,
                ..Policy::default()
            })
        });
        parsed.clone().map_err(NnError::Config)
    }

    /// The TF32 switches as shown by `cudagraph inspect` and `cudagraph bench engines`, e.g.
    /// `TF32 products off, convolutions off` (PyTorch's `torch.backends.cuda.matmul.allow_tf32`
    /// and `torch.backends.cudnn.allow_tf32`).
    pub fn tf32_summary(&self) -> String {
        let on = |b: bool| if b { "on" } else { "off" };
        format!(
            "TF32 products {}, convolutions {}",
            on(self.tf32_matmul),
            on(self.tf32_conv)
        )
    }

    /// The part of a key that records this policy's restrictions for products
    /// (empty for the default).
    pub fn gemm_scope(&self, family: GemmFamily) -> String {
        let mut parts = Vec::new();
        if family != GemmFamily::Auto {
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
        // A choice measured with TF32 allowed never serves a key without it (and vice versa).
        if self.tf32_matmul {
            parts.push("+tf32".into());
        }
        scope(parts)
    }

    /// The part of a key that records this policy's restrictions for convolutions.
    pub fn conv_scope(&self) -> String {
        let mut parts = Vec::new();
        if self.conv != ConvFamily::Auto {
            parts.push(self.conv.name().to_string());
        }
        if !self.cudnn {
            parts.push("-cudnn".into());
        }
        if !self.deterministic {
            parts.push("nondeterministic".into());
        }
        if self.tf32_conv {
            parts.push("+tf32".into());
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
    use crate::engine::catalog::{ConvEngine, GemmEngine};
    use crate::kernels::igemm::Tile;

    #[test]
    fn environment_values_parse_or_name_the_variable() {
        assert_eq!(parse_gemm_family("cublasLt").unwrap(), GemmFamily::CublasLt);
        assert_eq!(parse_gemm_family("").unwrap(), GemmFamily::Auto);
        assert_eq!(parse_gemm_family(" warpk ").unwrap(), GemmFamily::WarpK);
        assert_eq!(parse_gemm_family("rows").unwrap(), GemmFamily::Rows);
        assert_eq!(parse_conv_family("ours").unwrap(), ConvFamily::Ours);
        assert_eq!(parse_conv_family("AUTO").unwrap(), ConvFamily::Auto);
        let e = parse_gemm_family("cudnn").unwrap_err().to_string();
        assert!(
            e.contains("CUDAGRAPH_GEMM") && e.contains("cublaslt"),
            "{e}"
        );
        let e = parse_conv_family("fast").unwrap_err().to_string();
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
        assert!(ConvFamily::Ours.allows(ConvEngine::Direct));
        assert!(ConvFamily::Ours.allows(ConvEngine::Igemm(Tile::T64x64, 1)));
        assert!(!ConvFamily::Ours.allows(ConvEngine::Cudnn(0)));
        assert!(!ConvFamily::Ours.allows(ConvEngine::CudnnGraph(0)));
        assert!(ConvFamily::Cudnn.allows(ConvEngine::CudnnGraph(0)));
        assert!(ConvFamily::Auto.allows(ConvEngine::CudnnGraph(0)));
        assert_eq!(ConvEngine::CudnnGraph(2).family(), ConvFamily::Cudnn);
        // The fused convolution + bias is cuDNN's: forcing or disabling cuDNN covers it.
        assert_eq!(ConvEngine::CudnnGraphBias(1).family(), ConvFamily::Cudnn);
        assert!(ConvFamily::Cudnn.allows(ConvEngine::CudnnGraphBias(1)));
        assert!(ConvFamily::Auto.allows(ConvEngine::CudnnGraphBias(1)));
        for fam in [ConvFamily::Ours, ConvFamily::Igemm, ConvFamily::Direct] {
            assert!(!fam.allows(ConvEngine::CudnnGraphBias(1)), "{}", fam.name());
        }
        assert!(!ConvFamily::Igemm.allows(ConvEngine::Direct));
        assert_eq!(GemmEngine::CublasLt(0).family(), GemmFamily::CublasLt);
        let p = Policy::default();
        assert_eq!(p.gemm_scope(GemmFamily::Auto), "");
        assert_eq!(p.conv_scope(), "");
        let p = Policy {
            conv: ConvFamily::Ours,
            cudnn: false,
            cublaslt: false,
            ..Policy::default()
        };
        assert_eq!(p.conv_scope(), " [ours,-cudnn]");
        assert_eq!(p.gemm_scope(GemmFamily::Tiled), " [tiled,-cublaslt]");
        let p = Policy {
            lt_split_k: true,
            ..Policy::default()
        };
        assert_eq!(p.gemm_scope(GemmFamily::CublasLt), " [cublaslt,+splitk]");
        let p = Policy {
            lt_search: true,
            ..Policy::default()
        };
        assert_eq!(p.gemm_scope(GemmFamily::Auto), " [+search]");
        assert_eq!(p.gemm_scope(GemmFamily::CublasLt), " [cublaslt,+search]");
        let p = Policy {
            lt_split_k: true,
            lt_search: true,
            cublaslt: false,
            ..Policy::default()
        };
        assert_eq!(
            p.gemm_scope(GemmFamily::Auto),
            " [-cublaslt,+splitk,+search]"
        );
    }

    #[test]
    fn tf32_switches_parse_default_off_and_enter_the_keys() {
        assert!(!parse_tf32_matmul("").unwrap());
        assert!(parse_tf32_matmul("on").unwrap());
        assert!(!parse_tf32_matmul("0").unwrap());
        assert!(parse_tf32_conv(" TRUE ").unwrap());
        assert!(!parse_tf32_conv("off").unwrap());
        let e = parse_tf32_matmul("fast").unwrap_err().to_string();
        assert!(
            e.contains("CUDAGRAPH_TF32_MATMUL") && e.contains("\"fast\""),
            "{e}"
        );
        let e = parse_tf32_conv("2").unwrap_err().to_string();
        assert!(e.contains("CUDAGRAPH_TF32_CONV"), "{e}");
        let p = Policy::default();
        assert!(!p.tf32_matmul && !p.tf32_conv);
        // Off: the keys are exactly as before the switches existed.
        assert_eq!(p.gemm_scope(GemmFamily::Auto), "");
        assert_eq!(p.conv_scope(), "");
        let p = Policy {
            tf32_matmul: true,
            ..Policy::default()
        };
        assert_eq!(p.gemm_scope(GemmFamily::Auto), " [+tf32]");
        assert_eq!(p.gemm_scope(GemmFamily::Cublas), " [cublas,+tf32]");
        assert_eq!(
            p.conv_scope(),
            "",
            "the products' switch leaves convolutions alone"
        );
        let p = Policy {
            tf32_conv: true,
            deterministic: false,
            ..Policy::default()
        };
        assert_eq!(p.conv_scope(), " [nondeterministic,+tf32]");
        assert_eq!(p.tf32_summary(), "TF32 products off, convolutions on");
        assert_eq!(
            Policy::default().tf32_summary(),
            "TF32 products off, convolutions off"
        );
        assert_eq!(p.gemm_scope(GemmFamily::Auto), "");
    }
}
