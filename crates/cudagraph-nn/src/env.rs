//! The process environment, read in one place: every `CUDAGRAPH_*` variable this crate honours
//! is named here with what it does, and every read of the environment goes through [`var`]
//! (the modules that act on a variable parse it). On/off switches take `1`, `true`, `yes`,
//! `on` or `0`, `false`, `no`, `off` (any case); unset or empty means the default. Anything
//! else is a typed error naming the variable and what its values do.

use crate::error::{NnError, Result};

/// Forces the product engine family: `cublas`, `cublaslt`, `tiled`, `warpk`, `rows` or `auto`
/// (the default; see `engine::Policy`).
pub const GEMM_VAR: &str = "CUDAGRAPH_GEMM";
/// Forces the convolution engine family: `cudnn`, `ours`, `igemm`, `direct` or `auto`.
pub const CONV_VAR: &str = "CUDAGRAPH_CONV";
/// Lets the registry choose non-deterministic engines (`CUDAGRAPH_DETERMINISTIC=0`; default
/// `1`).
pub const DETERMINISTIC_VAR: &str = "CUDAGRAPH_DETERMINISTIC";
/// Also measure cuBLASLt's split-K variants (`CUDAGRAPH_LT_SPLITK=1`; see
/// `engine::Policy::lt_split_k`).
pub const LT_SPLITK_VAR: &str = "CUDAGRAPH_LT_SPLITK";
/// Also measure cuBLASLt configurations found by search (`CUDAGRAPH_LT_SEARCH=1`; see
/// `engine::Policy::lt_search`).
pub const LT_SEARCH_VAR: &str = "CUDAGRAPH_LT_SEARCH";
/// Lets matrix products use TF32 tensor cores (cuBLAS `CUBLAS_TF32_TENSOR_OP_MATH`, cuBLASLt
/// `CUBLAS_COMPUTE_32F_FAST_TF32`), like PyTorch's `torch.backends.cuda.matmul.allow_tf32`
/// (`CUDAGRAPH_TF32_MATMUL=1`; default off: f32 means f32; see `engine::Policy::tf32_matmul`).
pub const TF32_MATMUL_VAR: &str = "CUDAGRAPH_TF32_MATMUL";
/// Lets convolutions use TF32 tensor cores (cuDNN), like PyTorch's
/// `torch.backends.cudnn.allow_tf32` (`CUDAGRAPH_TF32_CONV=1`; default off; see
/// `engine::Policy::tf32_conv`).
pub const TF32_CONV_VAR: &str = "CUDAGRAPH_TF32_CONV";
/// How the registry ranks candidates timed in graphs: `chain`, `single` or `both` (the
/// default; see `engine::GraphTiming`).
pub const TIMING_VAR: &str = "CUDAGRAPH_REGISTRY_TIMING";
/// Programmatic dependent launch: `1` for every NN kernel, `0` for none; unset, the decode
/// kernels inside captures only (see `kernels::pdl`).
pub const PDL_VAR: &str = "CUDAGRAPH_PDL";
/// Switch of the cross-entropy's split plan for wide rows (default on; `0` for comparisons).
pub const CE_SPLIT_VAR: &str = "CUDAGRAPH_CE_SPLIT";
/// Switch of the cross-entropy's lane groups for narrow rows (default on; `0` for
/// comparisons).
pub const CE_GROUPS_VAR: &str = "CUDAGRAPH_CE_GROUPS";
/// The NCCL library to load, by path (tried before the usual names).
pub const NCCL_LIB_VAR: &str = "CUDAGRAPH_NCCL_LIB";
/// Seconds the rendezvous of a multi-GPU job may take (`dist::DistOptions`).
pub const RDZV_TIMEOUT_VAR: &str = "CUDAGRAPH_RDZV_TIMEOUT";
/// Seconds a collective or NCCL's initialisation may take before the watchdog aborts.
pub const DIST_TIMEOUT_VAR: &str = "CUDAGRAPH_DIST_TIMEOUT";
/// Seconds without a peer's heartbeat before it counts as lost.
pub const HEARTBEAT_TIMEOUT_VAR: &str = "CUDAGRAPH_HEARTBEAT_TIMEOUT";
/// Makes multi-GPU tests fail instead of skipping when fewer GPUs (or no NCCL) are there:
/// `CUDAGRAPH_REQUIRE_GPUS=2` on a two-GPU machine.
pub const REQUIRE_GPUS_VAR: &str = "CUDAGRAPH_REQUIRE_GPUS";
/// The value of `name` in the process environment (`None` when unset or not Unicode): the
/// one place this crate reads the environment.
pub fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Parses the value `v` of switch `var`; `meaning` says what 1 and 0 do (for the error).
pub fn parse_switch(var: &str, v: &str, default: bool, meaning: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "" => Ok(default),
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        other => Err(NnError::Config(format!(
            "{var}={other:?} is not a switch; use {meaning}"
        ))),
    }
}

/// The switch `var` as set in the environment now (see [`parse_switch`]).
pub fn switch(name: &str, default: bool, meaning: &str) -> Result<bool> {
    match var(name) {
        Some(v) => parse_switch(name, &v, default, meaning),
        None => Ok(default),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_take_the_usual_spellings_and_refuse_others() {
        for v in ["1", "on", "TRUE", " yes "] {
            assert!(parse_switch("X", v, false, "1 or 0").unwrap());
        }
        for v in ["0", "Off", "false", "no"] {
            assert!(!parse_switch("X", v, true, "1 or 0").unwrap());
        }
        assert!(parse_switch("X", "", true, "1 or 0").unwrap());
        assert!(!parse_switch("X", " ", false, "1 or 0").unwrap());
        let e = parse_switch("CUDAGRAPH_X", "maybe", true, "1 (a) or 0 (b)").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("CUDAGRAPH_X=\"maybe\"") && msg.contains("1 (a) or 0 (b)"),
            "{msg}"
        );
    }
}
