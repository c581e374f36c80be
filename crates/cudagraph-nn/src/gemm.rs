//! Matrix products for the NN layer, with a choice of engine.
//!
//! Small products (the small-batch case this project is for) are latency-bound: cuBLAS SGEMM
//! launches only a handful of blocks for, say, 32×512 outputs with K = 1024. Two kernels of
//! ours fuse the bias and ReLU: `sgemm_tiled` splits K across blocks (plus a reduce kernel) and
//! wins at 8 ≤ m ≤ 64; `sgemm_nt_warpk` splits K across the warps of one block (no reduce
//! node) and wins at 65 ≤ m ≤ 256. cuBLAS keeps the rest. See [`auto_engine`]. `CUDAGRAPH_GEMM=cublas|tiled|auto` (default `auto`) overrides the choice.

use std::sync::OnceLock;

use cudagraph::{DeviceBuffer, Queue};

use crate::blas::Trans;
use crate::error::{NnError, Result};
use crate::kernels::{GemmDims, Nn};

/// Which implementation runs a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    Cublas,
    /// The tiled split-K kernel (any layout).
    Tiled,
    /// One kernel, K split across the warps of a block (forward layout `x·wᵀ`, alpha 1,
    /// beta 0 only; other products fall back to `Tiled`).
    WarpK,
    /// The fastest for the shape, from `cudagraph bench gemm` on an H100
    /// (bench/results/gemm-2026-11-22.txt): for the forward layout `x·wᵀ`, split-K tiled at
    /// 8 ≤ m ≤ 64 and warp-K at 65 ≤ m ≤ 256; cuBLAS otherwise (its GEMV path wins at m = 1,
    /// and it wins the backward layouts).
    Auto,
}

/// The engine `Auto` picks for a product.
pub fn auto_engine(ta: Trans, tb: Trans, m: usize, alpha: f32, beta: f32) -> Engine {
    let forward = ta == Trans::N && tb == Trans::T;
    match m {
        8..=64 if forward => Engine::Tiled,
        65..=256 if forward && alpha == 1.0 && beta == 0.0 => Engine::WarpK,
        65..=256 if forward => Engine::Tiled,
        _ => Engine::Cublas,
    }
}

/// The engine chosen by `CUDAGRAPH_GEMM` (read once).
pub fn engine_from_env() -> Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    *E.get_or_init(|| match std::env::var("CUDAGRAPH_GEMM").as_deref() {
        Ok("cublas") => Engine::Cublas,
        Ok("tiled") => Engine::Tiled,
        _ => Engine::Auto,
    })
}

/// Row-major `C[m×n] = alpha·op(A)·op(B) + beta·C`, then `+ bias[j]` and ReLU if asked.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    q: &dyn Queue,
    nn: &Nn,
    engine: Engine,
    (ta, tb): (Trans, Trans),
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: &DeviceBuffer<f32>,
    b: &DeviceBuffer<f32>,
    beta: f32,
    c: &DeviceBuffer<f32>,
    bias: Option<&DeviceBuffer<f32>>,
    relu: bool,
) -> Result<()> {
    let warpk_ok = ta == Trans::N && tb == Trans::T && alpha == 1.0 && beta == 0.0;
    let engine = match engine {
        Engine::Auto => auto_engine(ta, tb, m, alpha, beta),
        e => e,
    };
    match engine {
        Engine::Cublas => {
            nn.blas.gemm(q, ta, tb, m, n, k, alpha, a, b, beta, c)?;
            match (bias, relu) {
                (Some(bias), relu) => nn.bias_act(q, c, bias, m, n, relu),
                (None, true) => Err(NnError::Shape("a fused ReLU needs a bias".into())),
                (None, false) => Ok(()),
            }
        }
        Engine::WarpK if warpk_ok => nn.sgemm_nt_warpk(q, m, n, k, a, b, c, bias, relu),
        _ => {
            let dims = GemmDims {
                m,
                n,
                k,
                ta: ta == Trans::T,
                tb: tb == Trans::T,
            };
            nn.sgemm_tiled(q, dims, alpha, a, b, beta, c, bias, relu, split_k(m, n, k))
        }
    }
}

/// How many K splits give the device enough blocks (about two waves of 132 SMs) while each
/// split keeps at least two 32-wide K tiles.
pub fn split_k(m: usize, n: usize, k: usize) -> usize {
    let blocks = m.div_ceil(32) * n.div_ceil(32);
    let k_tiles = k.div_ceil(32);
    let want = (264usize).div_ceil(blocks.max(1));
    want.min(k_tiles / 2).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_follows_the_measured_table() {
        let (n, t) = (Trans::N, Trans::T);
        assert_eq!(auto_engine(n, t, 1, 1.0, 0.0), Engine::Cublas);
        assert_eq!(auto_engine(n, t, 32, 1.0, 0.0), Engine::Tiled);
        assert_eq!(auto_engine(n, t, 64, 1.0, 0.0), Engine::Tiled);
        assert_eq!(auto_engine(n, t, 256, 1.0, 0.0), Engine::WarpK);
        assert_eq!(auto_engine(n, t, 256, 0.5, 0.0), Engine::Tiled);
        assert_eq!(auto_engine(n, t, 512, 1.0, 0.0), Engine::Cublas);
        assert_eq!(auto_engine(t, n, 64, 1.0, 0.0), Engine::Cublas);
        assert_eq!(auto_engine(n, n, 64, 1.0, 0.0), Engine::Cublas);
    }

    #[test]
    fn split_k_fills_the_device_but_keeps_two_tiles_per_split() {
        assert_eq!(split_k(32, 512, 1024), 16); // 16 blocks: 16 splits of 2 tiles
        assert_eq!(split_k(1024, 1024, 64), 1); // 1024 blocks already
        assert_eq!(split_k(64, 1024, 1024), 5);
        assert_eq!(split_k(1, 10, 256), 4); // one block, 8 tiles: 4 splits of 2
        assert_eq!(split_k(4, 4, 16), 1); // a single tile cannot split
    }
}
