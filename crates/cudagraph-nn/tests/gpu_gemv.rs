//! GPU tests of our few-row kernels for half-precision products (`gemm_lowp` engines `gemv:KS`
//! and its tensor-core variant `gemv-mma:KS`): `y = act(alpha·x·wᵀ + beta·y + bias)` with x
//! `[m, k]` and w `[n, k]` of bf16 or f16 and y of that type or f32, for m ∈ {1, 3, 8, 16} (both
//! kernels) and {25, 32} (tensor cores only), decode-sized shapes (768 → 2304, 3072 → 768), a
//! depth of 8, a wide one with n not a multiple of 8 (2048 → 32003), every epilogue it takes,
//! beta 0 (y written only) and beta 1 (in place: y is the residual), every depth split the
//! registry offers, each against an f64 reference from the exact 16-bit inputs. Then: the
//! registry offers it exactly where it should; shapes and engines it does not take are typed
//! errors that leave the output untouched; a captured product replays equal to the eager one
//! bit for bit (beta 0 and in place).
//!
//! Tolerances, per element, with `S = |alpha|·Σ_p |x[r,p]·w[j,p]| + |beta·y0[r,j]| + |bias[j]|`
//! (a bound of every partial sum and of the pre-activation value):
//! - The inputs are exact in f32, and a product of two 16-bit values (at most 11 × 11 bits) is
//!   exact in f32, so the error before the epilogue is the f32 accumulation: k terms summed by
//!   a lane in order, a butterfly over 32 lanes and at most 8 warps, each addition rounding to
//!   nearest, at most (k + 8)·2⁻²⁴·S; alpha, beta·y and the bias add three roundings. We allow
//!   `(k + 16)·2⁻²³·S`, twice that, which also covers tensor cores' additions (at most one
//!   ulp each where they truncate instead of rounding). A lost or doubled term of average
//!   size, S/k, is far above it.
//! - GELU in f32 (`tanhf`, within 2 ulp, of an argument rounded a few times): its error stays
//!   below 2⁻²⁰·S (|gelu'| ≤ 1.13, the argument's few ulps, tanh's 2 ulp times |v|/2).
//! - One rounding to the output type on store: at most half an ulp, `u·|v|` with u = 2⁻⁸ for
//!   bf16 and 2⁻¹¹ for f16 (their unit roundoffs), v the value rounded; we take v as the larger
//!   of |want| and |got|. f16 results below its normal range: an absolute 2⁻²⁵ (half its
//!   subnormal spacing). f32 output: nothing. A kernel rounding twice (the product, then after
//!   the bias) would exceed this on some element of these sizes.
//!
//! Replay against eager: 0 (bits compared).

use std::f64::consts::PI;

use cudagraph::memory::{bf16, f16};
use cudagraph::{gpu_test_device, CaptureOptions, DeviceBuffer, Graph, QueueExt, Stream};
use cudagraph_nn::dtype::{Dtype, Float};
use cudagraph_nn::engine::gemm::{Epilogue, GemmOp, Trans};
use cudagraph_nn::engine::gemm_lowp::{
    gemm_lowp_with, gemv_mma_splits, gemv_splits, lowp_candidates, GEMV_MAX_M, GEMV_MMA_MAX_M,
};
use cudagraph_nn::engine::GemmEngine;
use cudagraph_nn::{HostRng, Nn, NnError};

const EPILOGUES: [Epilogue; 4] = [
    Epilogue::None,
    Epilogue::Bias,
    Epilogue::BiasRelu,
    Epilogue::BiasGelu,
];

const ROWS: [usize; 8] = [1, 3, 8, 16, 25, 32, 41, 64];

/// Both few-row engines with every split the registry offers for `op`.
fn engines(op: &GemmOp) -> Vec<GemmEngine> {
    let lanes = gemv_splits(op, 256).into_iter().map(GemmEngine::Gemv);
    lanes
        .chain(
            gemv_mma_splits(op, 256)
                .into_iter()
                .map(GemmEngine::GemvMma),
        )
        .collect()
}

/// (n, k): GPT-2's q|k|v (768 → 2304), its MLP down projection (3072 → 768), a depth of one
/// vector.
const SHAPES: [(usize, usize); 3] = [(2304, 768), (768, 3072), (40, 8)];

/// A wide output head, n not a multiple of 8 (rows 1 and 3 only: the reference is long).
const WIDE: (usize, usize) = (32003, 2048);

/// Written into outputs before a product that must not read them.
const SENTINEL: f32 = 77.0;

fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

fn values<T: Float>(rng: &mut HostRng, n: usize, scale: f32) -> Vec<T> {
    rng.vec_normal(n)
        .into_iter()
        .map(|v| T::from_f32(v * scale))
        .collect()
}

fn wide<T: Float>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f32() as f64).collect()
}

/// x `[m, k]` (unit normal) and w `[n, k]` (normal of deviation 1/√k, as a trained layer's),
/// on the device and exactly in f64, with the exact Σ x·w and Σ |x·w| per (row, column).
struct Case<T: Float> {
    m: usize,
    n: usize,
    k: usize,
    x: DeviceBuffer<T>,
    w: DeviceBuffer<T>,
    sum: Vec<f64>,
    abs: Vec<f64>,
}

fn case<T: Float>(s: &Stream, (m, n, k): (usize, usize, usize), seed: u64) -> Case<T> {
    let mut rng = HostRng::new(seed);
    let hx = values::<T>(&mut rng, m * k, 1.0);
    let hw = values::<T>(&mut rng, n * k, 1.0 / (k as f32).sqrt());
    let (wx, ww) = (wide(&hx), wide(&hw));
    let mut sum = vec![0.0; m * n];
    let mut abs = vec![0.0; m * n];
    for j in 0..n {
        let wj = &ww[j * k..(j + 1) * k];
        for r in 0..m {
            let xr = &wx[r * k..(r + 1) * k];
            let (mut a, mut b) = (0.0, 0.0);
            for (p, q) in xr.iter().zip(wj) {
                a += p * q;
                b += (p * q).abs();
            }
            sum[r * n + j] = a;
            abs[r * n + j] = b;
        }
    }
    Case {
        m,
        n,
        k,
        x: s.alloc_from_host(&hx).unwrap(),
        w: s.alloc_from_host(&hw).unwrap(),
        sum,
        abs,
    }
}

fn op_of<T: Float>(c: &Case<T>, epilogue: Epilogue, (alpha, beta): (f32, f32)) -> GemmOp {
    GemmOp {
        ta: Trans::N,
        tb: Trans::T,
        m: c.m,
        n: c.n,
        k: c.k,
        alpha,
        beta,
        epilogue,
    }
}

/// Unit roundoff of the output type (half an ulp, relative), and the absolute allowance below
/// its normal range.
fn rounding(out: Dtype) -> (f64, f64) {
    match out {
        Dtype::Bf16 => (2f64.powi(-8), 0.0),
        Dtype::F16 => (2f64.powi(-11), 2f64.powi(-25)),
        Dtype::F32 => (0.0, 0.0),
    }
}

/// Runs `op` on `algo` into a fresh y (random with beta ≠ 0, the sentinel otherwise) and
/// checks every element against the reference.
fn run_and_check<T: Float, O: Float>(
    s: &Stream,
    nn: &Nn,
    c: &Case<T>,
    op: &GemmOp,
    algo: GemmEngine,
    rng: &mut HostRng,
) {
    let (m, n) = (c.m, c.n);
    let hy0: Vec<O> = if op.beta != 0.0 {
        values::<O>(rng, m * n, 1.0)
    } else {
        vec![O::from_f32(SENTINEL); m * n]
    };
    let hbias: Vec<O> = values::<O>(rng, n, 0.5);
    let y = s.alloc_from_host(&hy0).unwrap();
    let bias = s.alloc_from_host(&hbias).unwrap();
    let vec = (op.epilogue != Epilogue::None).then_some(&bias);
    gemm_lowp_with(s, nn, algo, op, &c.x, &c.w, &y, vec)
        .unwrap_or_else(|e| panic!("{algo} {}: {e}", op.key()));
    let got = s.to_vec(&y).unwrap();
    let (y0, b) = (wide(&hy0), wide(&hbias));
    let (alpha, beta) = (op.alpha as f64, op.beta as f64);
    let acc = (c.k as f64 + 16.0) * 2f64.powi(-23);
    let gelu = if op.epilogue == Epilogue::BiasGelu {
        2f64.powi(-20)
    } else {
        0.0
    };
    let (u, tiny) = rounding(O::DTYPE);
    let mut bad = 0;
    let mut first = String::new();
    for r in 0..m {
        for (j, &bias_j) in b.iter().enumerate() {
            let i = r * n + j;
            let bj = if op.epilogue == Epilogue::None {
                0.0
            } else {
                bias_j
            };
            let yc = if op.beta != 0.0 { beta * y0[i] } else { 0.0 };
            let pre = alpha * c.sum[i] + yc + bj;
            let scale = alpha.abs() * c.abs[i] + yc.abs() + bj.abs();
            let want = match op.epilogue {
                Epilogue::BiasRelu => pre.max(0.0),
                Epilogue::BiasGelu => gelu_tanh(pre),
                _ => pre,
            };
            let g = got[i].to_f32() as f64;
            let allowed = (acc + gelu) * scale + u * want.abs().max(g.abs()) + tiny;
            let err = (g - want).abs();
            if !g.is_finite() || err > allowed {
                bad += 1;
                if first.is_empty() {
                    first = format!(
                        "[{r},{j}]: got {g}, want {want} (error {err:.3e}, allowed \
                         {allowed:.3e}, scale {scale:.3e})"
                    );
                }
            }
        }
    }
    assert_eq!(
        bad,
        0,
        "{algo} {}→{} {}: {bad} elements off, first {first}",
        T::DTYPE,
        O::DTYPE,
        op.key()
    );
}

/// Every epilogue, beta 0 and 1, both kernels with every offered split, for one case and
/// result type.
fn every_product<T: Float, O: Float>(s: &Stream, nn: &Nn, c: &Case<T>, rng: &mut HostRng) -> usize {
    let mut ran = 0;
    for epilogue in EPILOGUES {
        for scales in [(1.0, 0.0), (0.75, 1.0)] {
            let op = op_of(c, epilogue, scales);
            let all = engines(&op);
            assert!(
                all.contains(&GemmEngine::GemvMma(1)),
                "{}: {all:?}",
                op.key()
            );
            let lanes = all.contains(&GemmEngine::Gemv(1));
            assert_eq!(lanes, c.m <= GEMV_MAX_M, "{}: {all:?}", op.key());
            for algo in all {
                run_and_check::<T, O>(s, nn, c, &op, algo, rng);
                ran += 1;
            }
        }
    }
    ran
}

fn all_shapes<T: Float>(s: &Stream, nn: &Nn) {
    let mut rng = HostRng::new(2900);
    let mut ran = 0;
    for (si, &(n, k)) in SHAPES.iter().enumerate() {
        for &m in &ROWS {
            let c = case::<T>(s, (m, n, k), 10 * si as u64 + m as u64);
            ran += every_product::<T, T>(s, nn, &c, &mut rng);
            ran += every_product::<T, f32>(s, nn, &c, &mut rng);
        }
    }
    println!("{}: {ran} products checked", T::DTYPE);
}

#[test]
fn bf16_products_match_the_f64_reference() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    all_shapes::<bf16>(&s, &nn);
}

#[test]
fn f16_products_match_the_f64_reference() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    all_shapes::<f16>(&s, &nn);
}

#[test]
fn a_wide_head_with_n_not_a_multiple_of_8_matches_the_f64_reference() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let mut rng = HostRng::new(2901);
    for m in [1, 3] {
        let c = case::<bf16>(&s, (m, WIDE.0, WIDE.1), 50 + m as u64);
        for (epilogue, scales) in [(Epilogue::None, (1.0, 0.0)), (Epilogue::Bias, (1.0, 1.0))] {
            let op = op_of(&c, epilogue, scales);
            for algo in engines(&op) {
                run_and_check::<bf16, bf16>(&s, &nn, &c, &op, algo, &mut rng);
                run_and_check::<bf16, f32>(&s, &nn, &c, &op, algo, &mut rng);
            }
        }
    }
    let c = case::<f16>(&s, (2, WIDE.0, WIDE.1), 60);
    let op = op_of(&c, Epilogue::BiasGelu, (1.0, 0.0));
    for algo in [GemmEngine::Gemv(1), GemmEngine::GemvMma(1)] {
        run_and_check::<f16, f16>(&s, &nn, &c, &op, algo, &mut rng);
    }
}

#[test]
fn the_registry_offers_it_exactly_for_few_row_forward_products() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let _nn = Nn::get(&dev).unwrap();
    let base = GemmOp {
        ta: Trans::N,
        tb: Trans::T,
        m: 1,
        n: 2304,
        k: 768,
        alpha: 1.0,
        beta: 0.0,
        epilogue: Epilogue::BiasGelu,
    };
    let few_row = |e: &GemmEngine| matches!(e, GemmEngine::Gemv(_) | GemmEngine::GemvMma(_));
    let has_gemv = |op: &GemmOp, align: u32| {
        let c = lowp_candidates::<bf16, bf16>(&s, op, align).unwrap();
        let g: Vec<_> = c.iter().filter(|e| few_row(e)).copied().collect();
        // Never the default (the first candidate) while cuBLASLt or cuBLAS has one.
        if let Some(first) = c.first() {
            if c.len() > g.len() {
                assert!(!few_row(first), "{c:?}");
            }
        }
        g
    };
    let mma =
        |ks: &[u8]| -> Vec<GemmEngine> { ks.iter().map(|&k| GemmEngine::GemvMma(k)).collect() };
    let want: Vec<_> = [GemmEngine::Gemv(1), GemmEngine::Gemv(2)]
        .into_iter()
        .chain(mma(&[1, 2, 4, 8]))
        .collect();
    assert_eq!(has_gemv(&base, 256), want);
    let deep = GemmOp { k: 3072, ..base };
    assert_eq!(has_gemv(&deep, 256).len(), 8);
    // Two chunks of 32 a warp at least: k = 128 takes splits 1 and 2 on tensor cores.
    let shallow = GemmOp { k: 128, ..base };
    let want: Vec<_> = std::iter::once(GemmEngine::Gemv(1))
        .chain(mma(&[1, 2]))
        .collect();
    assert_eq!(has_gemv(&shallow, 256), want);
    // Past the lane kernel's rows, the tensor-core kernel alone; past its own, neither.
    let wide = GemmOp {
        m: GEMV_MMA_MAX_M,
        ..base
    };
    assert_eq!(has_gemv(&wide, 256), mma(&[1, 2, 4, 8]));
    let top = GemmOp {
        m: GEMV_MAX_M,
        beta: 1.0,
        alpha: 0.5,
        ..base
    };
    assert!(!has_gemv(&top, 256).is_empty());
    for ep in [Epilogue::None, Epilogue::Bias, Epilogue::BiasRelu] {
        assert!(!has_gemv(
            &GemmOp {
                epilogue: ep,
                ..base
            },
            16
        )
        .is_empty());
    }
    for op in [
        GemmOp {
            m: GEMV_MMA_MAX_M + 1,
            ..base
        },
        GemmOp { k: 12, ..base },
        GemmOp {
            ta: Trans::N,
            tb: Trans::N,
            ..base
        },
        GemmOp {
            ta: Trans::T,
            tb: Trans::N,
            epilogue: Epilogue::BiasGrad,
            ..base
        },
    ] {
        assert!(has_gemv(&op, 256).is_empty(), "{}", op.key());
    }
    // Pointers aligned to less than 16 bytes.
    assert!(has_gemv(&base, 8).is_empty());
}

#[test]
fn shapes_it_does_not_take_are_typed_errors_and_run_nothing() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let (m, n, k) = (GEMV_MMA_MAX_M + 1, 64, 24);
    let mut rng = HostRng::new(2902);
    let x = s
        .alloc_from_host(&values::<bf16>(&mut rng, m * k, 1.0))
        .unwrap();
    let w = s
        .alloc_from_host(&values::<bf16>(&mut rng, n * k, 1.0))
        .unwrap();
    let bias = s
        .alloc_from_host(&values::<bf16>(&mut rng, n.max(m), 1.0))
        .unwrap();
    let sentinel = vec![bf16::from_f32(SENTINEL); m * n];
    let y = s.alloc_from_host(&sentinel).unwrap();
    let ok = GemmOp {
        ta: Trans::N,
        tb: Trans::T,
        m: 2,
        n,
        k,
        alpha: 1.0,
        beta: 0.0,
        epilogue: Epilogue::Bias,
    };
    let refused = [
        (
            GemmOp {
                m: GEMV_MAX_M + 1,
                ..ok
            },
            GemmEngine::Gemv(1),
            true,
        ),
        (GemmOp { k: 20, ..ok }, GemmEngine::Gemv(1), true),
        (
            GemmOp {
                ta: Trans::N,
                tb: Trans::N,
                ..ok
            },
            GemmEngine::Gemv(1),
            true,
        ),
        (
            GemmOp {
                ta: Trans::T,
                tb: Trans::N,
                epilogue: Epilogue::BiasGrad,
                ..ok
            },
            GemmEngine::Gemv(1),
            true,
        ),
        (ok, GemmEngine::Gemv(3), true),
        (ok, GemmEngine::Gemv(0), true),
        (ok, GemmEngine::Gemv(16), true),
        (GemmOp { m, ..ok }, GemmEngine::GemvMma(1), true),
        (GemmOp { k: 20, ..ok }, GemmEngine::GemvMma(1), true),
        (ok, GemmEngine::GemvMma(3), true),
        (ok, GemmEngine::GemvMma(0), true),
        (ok, GemmEngine::GemvMma(16), true),
    ];
    let db = s.alloc::<bf16>(2).unwrap();
    for (op, algo, with_vec) in refused {
        let v = match op.epilogue {
            Epilogue::BiasGrad => &db,
            _ => &bias,
        };
        let vec = with_vec.then_some(v);
        let e = gemm_lowp_with(&s, &nn, algo, &op, &x, &w, &y, vec)
            .expect_err(&format!("{algo} {} should be refused", op.key()));
        assert!(
            matches!(e, NnError::Shape(_) | NnError::NotSupported { .. }),
            "{algo} {}: {e:?}",
            op.key()
        );
    }
    // A short weight buffer: the common checks refuse it first.
    let short = GemmOp { n: n + 1, ..ok };
    assert!(gemm_lowp_with(
        &s,
        &nn,
        GemmEngine::Gemv(1),
        &short,
        &x,
        &w,
        &y,
        Some(&bias)
    )
    .is_err());
    s.synchronize().unwrap();
    assert_eq!(
        s.to_vec(&y)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>(),
        sentinel.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "a refused product wrote its output"
    );
    // The same product it does take runs.
    gemm_lowp_with(&s, &nn, GemmEngine::Gemv(1), &ok, &x, &w, &y, Some(&bias)).unwrap();
}

fn bits<O: Float>(s: &Stream, b: &DeviceBuffer<O>) -> Vec<u8> {
    O::as_bytes(&s.to_vec(b).unwrap()).to_vec()
}

/// Eager, then captured and replayed from the same starting y: the same bits.
fn replay_equals_eager<T: Float, O: Float>(s: &mut Stream, nn: &Nn, op: GemmOp, algo: GemmEngine) {
    let mut rng = HostRng::new(2903);
    let x = s
        .alloc_from_host(&values::<T>(&mut rng, op.m * op.k, 1.0))
        .unwrap();
    let w = s
        .alloc_from_host(&values::<T>(&mut rng, op.n * op.k, 0.05))
        .unwrap();
    let bias = s
        .alloc_from_host(&values::<O>(&mut rng, op.n, 0.5))
        .unwrap();
    let y0 = values::<O>(&mut rng, op.m * op.n, 1.0);
    let ye = s.alloc_from_host(&y0).unwrap();
    let yr = s.alloc_from_host(&y0).unwrap();
    let vec = (op.epilogue != Epilogue::None).then_some(&bias);
    gemm_lowp_with(s, nn, algo, &op, &x, &w, &ye, vec).unwrap();
    let (g, ()) = Graph::capture(s, CaptureOptions::new(), |cs| {
        gemm_lowp_with(cs, nn, algo, &op, &x, &w, &yr, vec).map_err(Into::into)
    })
    .unwrap_or_else(|e| panic!("capturing {}: {e:?}", op.key()));
    let want = bits(s, &ye);
    for _ in 0..3 {
        // In place (beta ≠ 0) every replay starts again from y0.
        s.copy_from_host(&y0, &yr).unwrap();
        g.replay(s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(
            bits(s, &yr),
            want,
            "replay vs eager {} {}→{} on {algo}",
            op.key(),
            T::DTYPE,
            O::DTYPE
        );
    }
}

#[test]
fn replays_equal_eager_products_bit_for_bit() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let base = GemmOp {
        ta: Trans::N,
        tb: Trans::T,
        m: 3,
        n: 2304,
        k: 768,
        alpha: 1.0,
        beta: 0.0,
        epilogue: Epilogue::BiasGelu,
    };
    let (lanes, mma) = (GemmEngine::Gemv, GemmEngine::GemvMma);
    replay_equals_eager::<bf16, bf16>(&mut s, &nn, base, lanes(1));
    replay_equals_eager::<bf16, bf16>(&mut s, &nn, base, lanes(2));
    replay_equals_eager::<bf16, bf16>(&mut s, &nn, base, mma(2));
    let residual = GemmOp {
        n: 768,
        k: 3072,
        beta: 1.0,
        epilogue: Epilogue::Bias,
        ..base
    };
    replay_equals_eager::<bf16, bf16>(&mut s, &nn, residual, lanes(4));
    replay_equals_eager::<f16, f32>(&mut s, &nn, GemmOp { m: 1, ..residual }, lanes(8));
    replay_equals_eager::<f16, f16>(&mut s, &nn, GemmOp { m: 30, ..residual }, mma(4));
    replay_equals_eager::<bf16, f32>(&mut s, &nn, GemmOp { m: 1, ..residual }, mma(1));
    replay_equals_eager::<bf16, bf16>(&mut s, &nn, GemmOp { m: 64, ..residual }, mma(8));
}
