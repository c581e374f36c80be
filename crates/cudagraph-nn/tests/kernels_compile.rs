//! Every NVRTC module of the NN layer compiles, and declares every kernel its loader looks up.
//! Runs wherever NVRTC can be loaded (the GPU machine; or any machine with `libnvrtc.so.13` on
//! the loader path, e.g. from the `nvidia-cuda-nvrtc` wheel) — no GPU needed, so a kernel that
//! does not compile fails here before any device time is spent. Without NVRTC it says so and
//! skips — or fails under `CUDAGRAPH_REQUIRE_GPU=1` (the GPU runner, where NVRTC must be there).

use cudagraph::runtime::nvrtc::{compile, nvrtc_present};
use cudagraph_nn::kernels::module_sources;

/// Kernels each module's loader asks for (its `m.function(..)` calls).
const EXPECTED: &[(&str, &[&str])] = &[
    (
        "cudagraph_nn_sampling",
        &[
            "sample_rows",
            "sampling_set",
            "decode_start",
            "decode_stop",
            "decode_advance",
        ],
    ),
    (
        "cudagraph_nn",
        &[
            "sgemm_tiled",
            "splitk_reduce",
            "sgemm_nt_warpk",
            "sgemm_nt_rows",
            "bias_act",
            "relu_fwd",
            "relu_bwd",
            "add_inplace",
            "col_sum",
            "channel_sum",
            "sum_parts",
            "conv2d_fwd",
            "conv2d_fwd_small",
            "conv2d_bwd_input",
            "conv2d_bwd_weight",
            "maxpool_fwd",
            "maxpool_bwd",
        ],
    ),
    (
        "cudagraph_nn_loss",
        &[
            "ce_split_mean",
            "ce_fwd_warp",
            "ce_fwd_block",
            "mse_fwd",
            "scale_by",
            "sum_scaled",
        ],
    ),
    (
        "cudagraph_nn_optim",
        &[
            "sgd_mt_s",
            "sgd_mt_l",
            "adam_mt_s",
            "adam_mt_l",
            "sgd_mt_s_bf16",
            "sgd_mt_l_bf16",
            "sgd_mt_s_f16",
            "sgd_mt_l_f16",
            "adam_mt_s_bf16",
            "adam_mt_l_bf16",
            "adam_mt_s_f16",
            "adam_mt_l_f16",
            "sgd_pure_mt_s_bf16",
            "sgd_pure_mt_l_bf16",
            "sgd_pure_mt_s_f16",
            "sgd_pure_mt_l_f16",
            "adam_pure_mt_s_bf16",
            "adam_pure_mt_l_bf16",
            "adam_pure_mt_s_f16",
            "adam_pure_mt_l_f16",
            "lr_schedule",
        ],
    ),
    (
        "cudagraph_nn_amp",
        &[
            "amp_scale",
            "amp_unscale_s",
            "amp_unscale_l",
            "amp_update",
            "clip_partials_s",
            "clip_partials_l",
            "clip_total",
            "clip_scale_s",
            "clip_scale_l",
        ],
    ),
    ("cudagraph_nn_spin", &["engines_spin"]),
    (
        "cudagraph_nn_cluster",
        &[
            "sgemm_tiled_cluster2",
            "sgemm_tiled_cluster4",
            "sgemm_tiled_cluster8",
            "sgemm_nt_chunks1",
            "sgemm_nt_chunks2",
            "sgemm_nt_chunks4",
            "sgemm_nt_chunks8",
        ],
    ),
    (
        "cudagraph_nn_igemm",
        &[
            "conv_igemm_fwd_64x64",
            "conv_igemm_fwd_32x128",
            "conv_igemm_fwd_128x32",
            "conv_igemm_bwd_data_64x64",
            "conv_igemm_bwd_filter_64x64",
            "conv_igemm_reduce",
            "conv_wgrad_small",
        ],
    ),
    (
        "cudagraph_nn_rng",
        &[
            "philox_raw",
            "rng_bits",
            "rng_uniform",
            "rng_normal",
            "rng_advance",
            "dropout_fwd",
            "dropout_bwd",
        ],
    ),
    (
        "cudagraph_nn_steps",
        &[
            "gather_batch",
            "advance_cursor",
            "batches_left",
            "check_finite",
        ],
    ),
    (
        "cudagraph_nn_transformer",
        &[
            "ln_fwd_f32",
            "ln_fwd_bf16",
            "ln_fwd_f16",
            "norm_bwd_dx_f32",
            "norm_bwd_dx_bf16",
            "norm_bwd_dx_f16",
            "norm_bwd_wb_f32",
            "norm_bwd_wb_bf16",
            "norm_bwd_wb_f16",
            "rms_fwd_f32",
            "rms_fwd_bf16",
            "rms_fwd_f16",
            "gelu_fwd_f32",
            "gelu_fwd_bf16",
            "gelu_fwd_f16",
            "gelu_bwd_f32",
            "gelu_bwd_bf16",
            "gelu_bwd_f16",
            "silu_fwd_f32",
            "silu_fwd_bf16",
            "silu_fwd_f16",
            "silu_bwd_f32",
            "silu_bwd_bf16",
            "silu_bwd_f16",
            "swiglu_fwd_f32",
            "swiglu_fwd_bf16",
            "swiglu_fwd_f16",
            "swiglu_bwd_f32",
            "swiglu_bwd_bf16",
            "swiglu_bwd_f16",
            "rope_f32",
            "rope_bf16",
            "rope_f16",
            "embed_fwd_f32",
            "embed_fwd_bf16",
            "embed_fwd_f16",
            "embed_bwd_f32",
            "embed_bwd_bf16",
            "embed_bwd_f16",
            "embed_links",
        ],
    ),
    (
        "cudagraph_nn_lowp",
        &[
            "add_inplace_bf16",
            "add_inplace_f16",
            "relu_fwd_bf16",
            "relu_fwd_f16",
            "relu_bwd_bf16",
            "relu_bwd_f16",
            "col_sum_bf16",
            "col_sum_f16",
            "col_sum_wide_bf16",
            "col_sum_wide_f16",
            "maxpool_fwd_bf16",
            "maxpool_fwd_f16",
            "maxpool_bwd_bf16",
            "maxpool_bwd_f16",
        ],
    ),
    (
        "cudagraph_nn_attention",
        &[
            "attend_kv_f32",
            "attend_kv_bf16",
            "attend_kv_f16",
            "kv_append_f32",
            "kv_append_bf16",
            "kv_append_f16",
        ],
    ),
    (
        "cudagraph_nn_causal",
        &[
            "causal_fwd_f32",
            "causal_fwd_bf16",
            "causal_fwd_f16",
            "causal_bwd_q_f32",
            "causal_bwd_q_bf16",
            "causal_bwd_q_f16",
            "causal_bwd_kv_f32",
            "causal_bwd_kv_bf16",
            "causal_bwd_kv_f16",
        ],
    ),
    (
        "cudagraph_nn_decoder",
        &[
            "dec_embed_f32",
            "dec_embed_bf16",
            "dec_embed_f16",
            "dec_norm_f32",
            "dec_norm_bf16",
            "dec_norm_f16",
            "dec_qkv_f32",
            "dec_qkv_bf16",
            "dec_qkv_f16",
            "dec_swiglu_f32",
            "dec_swiglu_bf16",
            "dec_swiglu_f16",
            "dec_attend_v1_f32",
            "dec_attend_v1_bf16",
            "dec_attend_v1_f16",
            "dec_attend_v2_f32",
            "dec_attend_v2_bf16",
            "dec_attend_v2_f16",
            "dec_attend_v4_f32",
            "dec_attend_v4_bf16",
            "dec_attend_v4_f16",
            "dec_attend_p4_f32",
            "dec_attend_p4_bf16",
            "dec_attend_p4_f16",
        ],
    ),
    (
        "cudagraph_nn_gemv",
        &[
            "gemv_bf16_bf16_m1",
            "gemv_bf16_bf16_m2",
            "gemv_bf16_bf16_m4",
            "gemv_bf16_bf16_m8",
            "gemv_bf16_bf16_m16",
            "gemv_bf16_f32_m1",
            "gemv_bf16_f32_m2",
            "gemv_bf16_f32_m4",
            "gemv_bf16_f32_m8",
            "gemv_bf16_f32_m16",
            "gemv_f16_f16_m1",
            "gemv_f16_f16_m2",
            "gemv_f16_f16_m4",
            "gemv_f16_f16_m8",
            "gemv_f16_f16_m16",
            "gemv_f16_f32_m1",
            "gemv_f16_f32_m2",
            "gemv_f16_f32_m4",
            "gemv_f16_f32_m8",
            "gemv_f16_f32_m16",
            "gemv_norm_bf16_bf16_m1",
            "gemv_norm_bf16_f32_m4",
            "gemv_norm_f16_f16_m2",
            "gemv_norm_f16_f32_m1",
            "gemv_swiglu_bf16_bf16_m1",
            "gemv_swiglu_bf16_bf16_m4",
            "gemv_swiglu_f16_f16_m2",
        ],
    ),
    (
        "cudagraph_nn_pdl",
        &["sgemm_tiled", "relu_fwd", "maxpool_bwd"],
    ),
];

#[test]
fn every_kernel_module_compiles_and_declares_what_its_loader_looks_up() {
    if !nvrtc_present() {
        return cudagraph::testing::skip_or_fail(
            "NVRTC is not installed here (put libnvrtc.so.13 on the loader path)",
        );
    }
    let modules = module_sources();
    for (name, src) in &modules {
        let ptx = compile(name, src, "sm_90").unwrap_or_else(|e| panic!("{name}: {e}"));
        for (module, kernels) in EXPECTED {
            if module == name {
                for k in *kernels {
                    assert!(
                        ptx.contains(&format!(".entry {k}(")),
                        "module {name} has no kernel {k}"
                    );
                }
            }
        }
    }
    // The core crate's device-to-device copy kernel.
    let ptx = compile("cudagraph_copy", cudagraph::COPY_CUDA, "sm_90").unwrap();
    assert!(ptx.contains(".entry cg_copy("), "no cg_copy");
    for (module, _) in EXPECTED {
        assert!(
            modules.iter().any(|(n, _)| n == module),
            "no module named {module}"
        );
    }
}
