//! GPU tests of the half-precision products (`engine::gemm_lowp`): bf16 and f16 operands with
//! a result of their own type or f32, layouts NN, NT and TN, epilogues none, bias, bias+ReLU,
//! bias+GELU and the bias gradient, on odd shapes (m = 1 and 3, n = 7, k = 13) and one large
//! one (512 × 1024 × 768), every candidate the registry measures run one at a time and then
//! the registry's own choice, each against an f64 reference computed from the exact 16-bit
//! inputs. Then: a captured product replays equal to the eager one bit for bit (measured
//! first, and captured first with the unmeasured default); row counts of one range (above the
//! few-row shapes) share one measured choice; threads meeting a new key at once (one of them
//! capturing) all run the one engine the registry keeps; the f32 bias with a 16-bit result
//! where cuBLASLt offers it; misuse (f32 operands, a result of a third type, short buffers,
//! vectors that do not match the epilogue) is a typed error and runs nothing; products whose
//! rows of C are not 16-byte aligned also run as the transposed cuBLASLt product
//! (`cublaslt-t`), in every layout and past the transpose's grid, and it is refused elsewhere.
//!
//! Tolerances, per element, relative to the scale `S = |alpha|·Σ_p |op(A)[i,p]·op(B)[p,j]| +
//! |beta·C0[i,j]| + |bias[j]|` (an upper bound of every partial sum and of the result):
//! - The inputs are exact: every 16-bit value is an f32, and a product of two of them (8 × 8
//!   or 11 × 11 significant bits) is exact in f32, so the tensor cores' only error is the f32
//!   accumulation. Adding k terms in any order with rounding or truncation (some tensor-core
//!   accumulators truncate) errs by at most k·2⁻²³·S; we allow twice that, `(k + 4)·2⁻²²·S`
//!   (the 4: alpha, beta, bias in f32). A lost or doubled term of average size is about S/k,
//!   above this bound for every k tested (k ≤ 768: 2.7e-4·S against 1.3e-3·S).
//! - Rounding the result to the output type: half an ulp, 2⁻⁹ relative for bf16 and 2⁻¹² for
//!   f16; we allow a full ulp, 2⁻⁸·S and 2⁻¹¹·S, in case the epilogue rounds twice (the
//!   product, then the sum with the bias). f32 output: nothing beyond the accumulation term.
//!   f16 results below its normal range get an absolute 2⁻²⁴ (its subnormal spacing).
//! - GELU: cuBLASLt's tanh approximation against the same formula in f64; a fast tanh
//!   (`tanh.approx.f32`, about 2⁻¹¹ relative) errs by at most 2⁻¹¹·|x|/2; we allow 2⁻¹⁰·S.
//!   ReLU is exact.
//! - Bias gradient `db[i] = Σ_p op(A)[i,p]`: the same rules with `S = Σ_p |op(A)[i,p]|`.
//!
//! So 2⁻⁸ ≈ 3.9e-3 for bf16 results, 2⁻¹¹ ≈ 4.9e-4 for f16 and ≈ 2e-4 for f32 at k = 768, all
//! relative to S. Replay against eager: 0 (bits compared). The large shape is checked on every
//! 37th row and the last (all columns), to keep the f64 reference short.
//!
//! The GPU machine is expected to have cuBLAS and cuBLASLt.

use std::f64::consts::PI;

use cudagraph::memory::{bf16, f16};
use cudagraph::{gpu_test_device, CaptureOptions, DeviceBuffer, Graph, QueueExt, Stream};
use cudagraph_nn::dtype::{Dtype, Float};
use cudagraph_nn::engine::gemm::{alignment, run_gemm, Epilogue, GemmFamily, GemmOp, Trans};
use cudagraph_nn::engine::gemm_lowp::{gemm_lowp_with, key, lowp_candidates, rows_range};
use cudagraph_nn::engine::{gemm_lowp, Engines, GemmEngine};
use cudagraph_nn::ffi::blaslt::{LtAlgo, LtShape, LtTypes};
use cudagraph_nn::{HostRng, Nn, NnError};

const EPILOGUES: [Epilogue; 5] = [
    Epilogue::None,
    Epilogue::Bias,
    Epilogue::BiasRelu,
    Epilogue::BiasGelu,
    Epilogue::BiasGrad,
];

const LAYOUTS: [(Trans, Trans); 3] = [
    (Trans::N, Trans::N),
    (Trans::N, Trans::T),
    (Trans::T, Trans::N),
];

/// Odd shapes (m, n, k): one row, three rows, seven columns, depth 13 (leading dimensions of
/// 13 or 7 elements: no multiple of 16 bytes), and two aligned ones.
const SHAPES: [(usize, usize, usize); 5] = [
    (1, 7, 13),
    (3, 7, 13),
    (3, 64, 32),
    (33, 40, 24),
    (64, 128, 96),
];

const LARGE: (usize, usize, usize) = (512, 1024, 768);

/// The value written into outputs before a product, so that an element left unwritten fails.
const SENTINEL: f32 = 77.0;

fn values<T: Float>(rng: &mut HostRng, n: usize) -> Vec<T> {
    rng.vec_normal(n).into_iter().map(T::from_f32).collect()
}

fn wide<T: Float>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f32() as f64).collect()
}

fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

fn op_a(op: &GemmOp, a: &[f64], i: usize, p: usize) -> f64 {
    match op.ta {
        Trans::N => a[i * op.k + p],
        Trans::T => a[p * op.m + i],
    }
}

fn op_b(op: &GemmOp, b: &[f64], p: usize, j: usize) -> f64 {
    match op.tb {
        Trans::N => b[p * op.n + j],
        Trans::T => b[j * op.k + p],
    }
}

/// The exact products at the checked rows: Σ op(A)·op(B) and Σ |op(A)·op(B)| per (row, column),
/// row-major over `rows` × n.
struct Products {
    rows: Vec<usize>,
    sum: Vec<f64>,
    abs: Vec<f64>,
}

fn products(op: &GemmOp, a: &[f64], b: &[f64], rows: Vec<usize>) -> Products {
    let mut sum = Vec::with_capacity(rows.len() * op.n);
    let mut abs = Vec::with_capacity(rows.len() * op.n);
    for &i in &rows {
        let ai: Vec<f64> = (0..op.k).map(|p| op_a(op, a, i, p)).collect();
        for j in 0..op.n {
            let (mut s, mut t) = (0.0, 0.0);
            for (p, &x) in ai.iter().enumerate() {
                let y = x * op_b(op, b, p, j);
                s += y;
                t += y.abs();
            }
            sum.push(s);
            abs.push(t);
        }
    }
    Products { rows, sum, abs }
}

fn checked_rows(m: usize) -> Vec<usize> {
    if m <= 128 {
        (0..m).collect()
    } else {
        let mut r: Vec<usize> = (0..m).step_by(37).collect();
        if r.last() != Some(&(m - 1)) {
            r.push(m - 1);
        }
        r
    }
}

/// (relative to the scale, absolute) allowed for a result of `out` after k terms.
fn tolerance(out: Dtype, k: usize, epilogue: Epilogue) -> (f64, f64) {
    let rounding = match out {
        Dtype::Bf16 => 2f64.powi(-8),
        Dtype::F16 => 2f64.powi(-11),
        Dtype::F32 => 0.0,
    };
    let accumulation = (k as f64 + 4.0) * 2f64.powi(-22);
    let gelu = if epilogue == Epilogue::BiasGelu {
        2f64.powi(-10)
    } else {
        0.0
    };
    let abs = if out == Dtype::F16 {
        2f64.powi(-24)
    } else {
        0.0
    };
    // Two roundings to the output type: cuBLASLt's kernels may round the product before the
    // bias or beta·C is added and round the sum again (seen on the H100: one output ulp off
    // with a bias, where a single rounding allows half an ulp).
    (2.0 * rounding + accumulation + gelu, abs)
}

/// `got` (all m × n of them) against the expected values at the checked rows.
fn check_result<O: Float>(
    what: &str,
    op: &GemmOp,
    prods: &Products,
    got: &[O],
    c0: &[f64],
    bias: Option<&[f64]>,
) {
    let (rel, abs) = tolerance(O::DTYPE, op.k, op.epilogue);
    let mut bad = 0;
    let mut first = String::new();
    for (r, &i) in prods.rows.iter().enumerate() {
        for j in 0..op.n {
            let idx = i * op.n + j;
            let bj = match op.epilogue {
                Epilogue::Bias | Epilogue::BiasRelu | Epilogue::BiasGelu => bias.unwrap()[j],
                _ => 0.0,
            };
            let c = if op.beta != 0.0 { c0[idx] } else { 0.0 };
            let (alpha, beta) = (op.alpha as f64, op.beta as f64);
            let pre = alpha * prods.sum[r * op.n + j] + beta * c + bj;
            let scale = alpha.abs() * prods.abs[r * op.n + j] + (beta * c).abs() + bj.abs();
            let want = match op.epilogue {
                Epilogue::BiasRelu => pre.max(0.0),
                Epilogue::BiasGelu => gelu_tanh(pre),
                _ => pre,
            };
            let g = got[idx].to_f32() as f64;
            let err = (g - want).abs();
            let allowed = rel * scale + abs;
            if !g.is_finite() || err > allowed {
                bad += 1;
                if first.is_empty() {
                    first = format!(
                        "[{i},{j}]: got {g}, want {want} (error {err:.3e}, allowed {allowed:.3e}, scale {scale:.3e})"
                    );
                }
            }
        }
    }
    assert_eq!(
        bad,
        0,
        "{what} {}: {bad} elements off, first {first}",
        op.key()
    );
}

/// The bias gradient `db[i] = Σ_p op(A)[i,p]` against f64.
fn check_bias_grad<O: Float>(what: &str, op: &GemmOp, a: &[f64], got: &[O]) {
    let (rel, abs) = tolerance(O::DTYPE, op.k, Epilogue::BiasGrad);
    for (i, g) in got.iter().enumerate().take(op.m) {
        let (mut want, mut scale) = (0.0, 0.0);
        for p in 0..op.k {
            let x = op_a(op, a, i, p);
            want += x;
            scale += x.abs();
        }
        let g = g.to_f32() as f64;
        assert!(
            g.is_finite() && (g - want).abs() <= rel * scale + abs,
            "{what} {}: db[{i}] = {g}, want {want} (scale {scale:.3e}, allowed {:.3e})",
            op.key(),
            rel * scale + abs
        );
    }
}

/// The device inputs of one product and their exact values.
struct Inputs<T: Float> {
    a: DeviceBuffer<T>,
    b: DeviceBuffer<T>,
    wa: Vec<f64>,
    prods: Products,
}

fn inputs<T: Float>(s: &Stream, op: &GemmOp, seed: u64) -> Inputs<T> {
    let mut rng = HostRng::new(seed);
    let ha = values::<T>(&mut rng, op.m * op.k);
    let hb = values::<T>(&mut rng, op.k * op.n);
    let (wa, wb) = (wide(&ha), wide(&hb));
    let prods = products(op, &wa, &wb, checked_rows(op.m));
    Inputs {
        a: s.alloc_from_host(&ha).unwrap(),
        b: s.alloc_from_host(&hb).unwrap(),
        wa,
        prods,
    }
}

/// Runs a product into the given result and vector.
type RunInto<'a, O> =
    dyn FnMut(&DeviceBuffer<O>, Option<&DeviceBuffer<O>>) -> cudagraph_nn::Result<()> + 'a;

/// One product run by `run` (an engine or the registry) on fresh outputs, then checked.
fn run_and_check<T: Float, O: Float>(
    s: &Stream,
    what: &str,
    op: &GemmOp,
    inp: &Inputs<T>,
    rng: &mut HostRng,
    run: &mut RunInto<'_, O>,
) {
    let hc0: Vec<O> = if op.beta != 0.0 {
        values::<O>(rng, op.m * op.n)
    } else {
        vec![O::from_f32(SENTINEL); op.m * op.n]
    };
    let c = s.alloc_from_host(&hc0).unwrap();
    let hbias = values::<O>(rng, op.n);
    let bias = s.alloc_from_host(&hbias).unwrap();
    let db = s
        .alloc_from_host(&vec![O::from_f32(SENTINEL); op.m])
        .unwrap();
    let vec = match op.epilogue {
        Epilogue::None => None,
        Epilogue::BiasGrad => Some(&db),
        _ => Some(&bias),
    };
    run(&c, vec).unwrap_or_else(|e| panic!("{what} {}: {e}", op.key()));
    let got = s.to_vec(&c).unwrap();
    check_result(what, op, &inp.prods, &got, &wide(&hc0), Some(&wide(&hbias)));
    if op.epilogue == Epilogue::BiasGrad {
        check_bias_grad(what, op, &inp.wa, &s.to_vec(&db).unwrap());
    }
}

fn ops_for(m: usize, n: usize, k: usize, ta: Trans, tb: Trans) -> Vec<GemmOp> {
    let mut v = Vec::new();
    for epilogue in EPILOGUES {
        // The bias gradient is that of a weight gradient, dW = dZᵀ·X: A transposed.
        if epilogue == Epilogue::BiasGrad && ta != Trans::T {
            continue;
        }
        let base = GemmOp {
            ta,
            tb,
            m,
            n,
            k,
            alpha: 1.0,
            beta: 0.0,
            epilogue,
        };
        v.push(base);
        if epilogue != Epilogue::BiasGrad && m * n <= 64 * 128 {
            v.push(GemmOp {
                alpha: 0.5,
                beta: -0.75,
                ..base
            });
        }
    }
    v
}

/// Whether every leading dimension of `op` (A, B and C, row-major) is a multiple of 8
/// elements, 16 bytes of a 16-bit type: the alignment tensor-core kernels want.
fn leading_dims_aligned(op: &GemmOp) -> bool {
    let lda = if op.ta == Trans::N { op.k } else { op.m };
    let ldb = if op.tb == Trans::N { op.n } else { op.k };
    [lda, ldb, op.n].iter().all(|d| d % 8 == 0)
}

/// Every case of one operand type `T` and result type `O`: each candidate the registry
/// measures (a subset on the large shape), then the registry's choice. Returns how many
/// products ran and the ops no engine could run (each a typed error, checked here).
fn every_case<T: Float, O: Float>(
    s: &Stream,
    nn: &Nn,
    shapes: &[(usize, usize, usize)],
    all_candidates: bool,
) -> (usize, Vec<GemmOp>) {
    let mut ran = 0;
    let mut refused = Vec::new();
    let mut rng = HostRng::new(2800);
    for (si, &(m, n, k)) in shapes.iter().enumerate() {
        for (li, &(ta, tb)) in LAYOUTS.iter().enumerate() {
            let shape_op = GemmOp {
                ta,
                tb,
                m,
                n,
                k,
                alpha: 1.0,
                beta: 0.0,
                epilogue: Epilogue::None,
            };
            let inp = inputs::<T>(s, &shape_op, 100 + 10 * si as u64 + li as u64);
            for op in ops_for(m, n, k, ta, tb) {
                let align = alignment(&[inp.a.addr(), inp.b.addr()]);
                let cands = lowp_candidates::<T, O>(s, &op, align).unwrap();
                if op.epilogue == Epilogue::None {
                    assert!(
                        cands.contains(&GemmEngine::Cublas),
                        "cuBLAS runs every product without a fused bias: {cands:?}"
                    );
                }
                let wanted: Vec<GemmEngine> = if all_candidates {
                    cands.clone()
                } else {
                    cands
                        .iter()
                        .copied()
                        .filter(|&e| e == GemmEngine::CublasLt(0) || e == GemmEngine::Cublas)
                        .collect()
                };
                for algo in wanted {
                    let what = format!("{algo} {}→{}", T::DTYPE, O::DTYPE);
                    run_and_check::<T, O>(s, &what, &op, &inp, &mut rng, &mut |c, v| {
                        gemm_lowp_with(s, nn, algo, &op, &inp.a, &inp.b, c, v)
                    });
                    ran += 1;
                }
                if cands.is_empty() {
                    // No engine: a typed error naming the key, never a wrong result.
                    let c = s.alloc::<O>(m * n).unwrap();
                    let v = s.alloc::<O>(n.max(m)).unwrap();
                    let vec = (op.epilogue != Epilogue::None).then_some(&v);
                    match gemm_lowp(s, nn, &op, &inp.a, &inp.b, &c, vec) {
                        Err(NnError::Library { status, .. }) => {
                            assert!(status.contains("no engine"), "{status}");
                            println!("  no engine (a typed error): {status}");
                            refused.push(op);
                        }
                        other => panic!("no candidates for {} but {other:?}", op.key()),
                    }
                    continue;
                }
                let what = format!("registry {}→{}", T::DTYPE, O::DTYPE);
                let mut chosen = None;
                run_and_check::<T, O>(s, &what, &op, &inp, &mut rng, &mut |c, v| {
                    chosen = Some(gemm_lowp(s, nn, &op, &inp.a, &inp.b, c, v)?);
                    Ok(())
                });
                let chosen = chosen.unwrap();
                assert!(
                    cands.contains(&chosen),
                    "{chosen} is not a candidate of {}",
                    op.key()
                );
                ran += 1;
            }
        }
    }
    (ran, refused)
}

fn report(what: &str, (ran, refused): (usize, Vec<GemmOp>)) {
    println!(
        "{what}: {ran} products checked, {} without an engine",
        refused.len()
    );
    // Only a fused bias with misaligned leading dimensions may lack an engine (cuBLAS runs
    // the others).
    for op in &refused {
        assert!(
            !leading_dims_aligned(op) && op.epilogue != Epilogue::None,
            "no engine for {}",
            op.key()
        );
    }
}

#[test]
fn bf16_products_match_the_f64_reference() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    report(
        "bf16 → bf16",
        every_case::<bf16, bf16>(&s, &nn, &SHAPES, true),
    );
    report(
        "bf16 → f32",
        every_case::<bf16, f32>(&s, &nn, &SHAPES, true),
    );
}

#[test]
fn f16_products_match_the_f64_reference() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    report("f16 → f16", every_case::<f16, f16>(&s, &nn, &SHAPES, true));
    report("f16 → f32", every_case::<f16, f32>(&s, &nn, &SHAPES, true));
}

#[test]
fn a_large_product_matches_the_f64_reference_in_every_type() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let shapes = [LARGE];
    report(
        "large bf16 → bf16",
        every_case::<bf16, bf16>(&s, &nn, &shapes, false),
    );
    report(
        "large bf16 → f32",
        every_case::<bf16, f32>(&s, &nn, &shapes, false),
    );
    report(
        "large f16 → f16",
        every_case::<f16, f16>(&s, &nn, &shapes, false),
    );
    report(
        "large f16 → f32",
        every_case::<f16, f32>(&s, &nn, &shapes, false),
    );
}

fn bits<O: Float>(s: &Stream, b: &DeviceBuffer<O>) -> Vec<u8> {
    let v = s.to_vec(b).unwrap();
    O::as_bytes(&v).to_vec()
}

fn assert_same_bits(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got.iter().zip(want).position(|(g, w)| g != w) {
        panic!("{what}: first differing byte {i} of {}", got.len());
    }
}

/// Eager (measured) first, then the same product captured and replayed into other outputs:
/// the same engine, the same bits.
fn replay_equals_eager<T: Float, O: Float>(s: &mut Stream, nn: &Nn, op: GemmOp, eager_first: bool) {
    let mut rng = HostRng::new(77);
    let a = s
        .alloc_from_host(&values::<T>(&mut rng, op.m * op.k))
        .unwrap();
    let b = s
        .alloc_from_host(&values::<T>(&mut rng, op.k * op.n))
        .unwrap();
    let bias = s.alloc_from_host(&values::<O>(&mut rng, op.n)).unwrap();
    let fresh = |s: &Stream| {
        (
            s.alloc_from_host(&vec![O::from_f32(SENTINEL); op.m * op.n])
                .unwrap(),
            s.alloc_from_host(&vec![O::from_f32(SENTINEL); op.m])
                .unwrap(),
        )
    };
    let (ce, dbe) = fresh(s);
    let (cr, dbr) = fresh(s);
    let vec_of = |db| match op.epilogue {
        Epilogue::None => None,
        Epilogue::BiasGrad => Some(db),
        _ => Some(&bias),
    };
    let eager = |s: &Stream| gemm_lowp(s, nn, &op, &a, &b, &ce, vec_of(&dbe)).unwrap();
    let first = eager_first.then(|| eager(s));
    let (g, captured) = Graph::capture(s, CaptureOptions::new(), |cs| {
        gemm_lowp(cs, nn, &op, &a, &b, &cr, vec_of(&dbr)).map_err(Into::into)
    })
    .unwrap_or_else(|e| panic!("capturing {}: {e:?}", op.key()));
    let engine = first.unwrap_or_else(|| eager(s));
    assert_eq!(captured, engine, "{}: the capture's engine", op.key());
    if !eager_first {
        // Nothing measured before the capture: cuBLASLt's first heuristic algorithm.
        assert_eq!(captured, GemmEngine::CublasLt(0), "{}", op.key());
    }
    for _ in 0..3 {
        g.replay(s).unwrap();
    }
    s.synchronize().unwrap();
    let what = format!("{} {}→{} on {engine}", op.key(), T::DTYPE, O::DTYPE);
    assert_same_bits(
        &bits(s, &cr),
        &bits(s, &ce),
        &format!("replay vs eager {what}"),
    );
    if op.epilogue == Epilogue::BiasGrad {
        assert_same_bits(
            &bits(s, &dbr),
            &bits(s, &dbe),
            &format!("db replay vs eager {what}"),
        );
    }
}

fn gemm_op(ta: Trans, tb: Trans, (m, n, k): (usize, usize, usize), epilogue: Epilogue) -> GemmOp {
    GemmOp {
        ta,
        tb,
        m,
        n,
        k,
        alpha: 1.0,
        beta: 0.0,
        epilogue,
    }
}

#[test]
fn replays_equal_eager_products_bit_for_bit() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let (n, t) = (Trans::N, Trans::T);
    replay_equals_eager::<bf16, bf16>(
        &mut s,
        &nn,
        gemm_op(n, t, (256, 512, 384), Epilogue::BiasGelu),
        true,
    );
    replay_equals_eager::<f16, f32>(
        &mut s,
        &nn,
        gemm_op(n, t, (96, 200, 136), Epilogue::Bias),
        true,
    );
    replay_equals_eager::<bf16, f32>(
        &mut s,
        &nn,
        gemm_op(t, n, (128, 64, 512), Epilogue::BiasGrad),
        true,
    );
    replay_equals_eager::<f16, f16>(&mut s, &nn, gemm_op(n, n, (3, 7, 13), Epilogue::None), true);
    replay_equals_eager::<bf16, bf16>(
        &mut s,
        &nn,
        gemm_op(n, t, (1024, 1024, 1024), Epilogue::None),
        true,
    );
}

#[test]
fn a_product_captured_before_any_measurement_runs_cublaslt_first_choice_eagerly_too() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    // cuBLASLt opens on first eager use, never inside a capture.
    assert!(
        Engines::get(&dev).unwrap().cublaslt().is_some(),
        "cuBLASLt is expected on the GPU machine"
    );
    // Shapes no other test uses, so that their keys are new to this process.
    let op = gemm_op(Trans::N, Trans::T, (40, 56, 72), Epilogue::BiasRelu);
    replay_equals_eager::<bf16, bf16>(&mut s, &nn, op, false);
    let op = gemm_op(Trans::T, Trans::N, (48, 24, 80), Epilogue::BiasGrad);
    replay_equals_eager::<f16, f32>(&mut s, &nn, op, false);
    // The capture's choice is recorded unmeasured, under a key that names the types.
    let eng = Engines::get(&dev).unwrap();
    let k = key(&op, Dtype::F16, Dtype::F32);
    let row = eng
        .table()
        .into_iter()
        .find(|r| r.key.starts_with(&k))
        .unwrap_or_else(|| panic!("no registry row for {k}"));
    assert!(!row.entry.measured, "{}: {:?}", row.key, row.entry);
    assert_eq!(row.entry.engine, "cublaslt:0");
}

/// Products of more rows than the few-row shapes (a prefill's) share the registry's choice
/// within their rows' range: the first row count of a range is measured under the range's
/// key; another count of the range runs that choice without measuring (no row of its own, the
/// range's key served) and is right against the f64 reference; a third replays equal to its
/// eager run bit for bit; 64 rows keep a key of their own.
#[test]
fn row_counts_of_one_range_share_one_measured_choice() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = Engines::get(&dev).unwrap();
    // Choices from an earlier run on disk: measure again.
    eng.clear();
    let (n, k) = (200, 136);
    let first = gemm_op(Trans::N, Trans::T, (100, n, k), Epilogue::Bias);
    let second = GemmOp { m: 110, ..first };
    assert_eq!(rows_range(100), Some((97, 112)));
    let shared = key(&first, Dtype::Bf16, Dtype::Bf16);
    assert_eq!(shared, key(&second, Dtype::Bf16, Dtype::Bf16));
    assert!(shared.contains(" m=97..112 "), "{shared}");
    let mut rng = HostRng::new(31);

    let inp = inputs::<bf16>(&s, &first, 41);
    let mut chosen = None;
    run_and_check::<bf16, bf16>(
        &s,
        "first count of a range",
        &first,
        &inp,
        &mut rng,
        &mut |c, v| {
            chosen = Some(gemm_lowp(&s, &nn, &first, &inp.a, &inp.b, c, v)?);
            Ok(())
        },
    );
    let chosen = chosen.unwrap();
    let row = eng
        .table()
        .into_iter()
        .find(|r| r.key.starts_with(&shared))
        .unwrap_or_else(|| panic!("no registry row for {shared}"));
    assert!(
        row.entry.measured && !row.entry.timings.is_empty(),
        "{row:?}"
    );
    assert_eq!(row.entry.engine.parse::<GemmEngine>().unwrap(), chosen);

    let inp = inputs::<bf16>(&s, &second, 43);
    eng.start_usage_log();
    let mut ran = None;
    run_and_check::<bf16, bf16>(
        &s,
        "second count of a range",
        &second,
        &inp,
        &mut rng,
        &mut |c, v| {
            ran = Some(gemm_lowp(&s, &nn, &second, &inp.a, &inp.b, c, v)?);
            Ok(())
        },
    );
    assert_eq!(
        ran,
        Some(chosen),
        "the range's choice runs the second count"
    );
    assert_eq!(
        eng.take_usage_log(),
        [(row.key.clone(), row.entry.engine.clone())],
        "served from the range's key"
    );
    let rows = |prefix: &str| {
        eng.table()
            .into_iter()
            .filter(|r| r.key.starts_with(prefix))
            .count()
    };
    assert_eq!(
        rows(&format!("gemm NT m=110 n={n} ")),
        0,
        "a row of its own"
    );
    assert_eq!(rows(&shared), 1);

    replay_equals_eager::<bf16, bf16>(&mut s, &nn, GemmOp { m: 105, ..first }, true);
    assert_eq!(
        rows(&format!("gemm NT m=105 n={n} ")),
        0,
        "a row of its own"
    );

    let few = GemmOp { m: 64, ..first };
    let inp = inputs::<bf16>(&s, &few, 47);
    run_and_check::<bf16, bf16>(&s, "64 rows", &few, &inp, &mut rng, &mut |c, v| {
        gemm_lowp(&s, &nn, &few, &inp.a, &inp.b, c, v).map(|_| ())
    });
    assert_eq!(
        rows(&format!("gemm NT m=64 n={n} ")),
        1,
        "64 rows: a key of its own"
    );
}

/// Threads that meet a key nobody has chosen yet at the same moment, one of them capturing
/// the product and the others running it eagerly (so measuring it), end with one engine:
/// each eager thread's later call runs the engine its first one ran, and the capture's graph
/// replays equal to that thread's eager product bit for bit. Fresh shapes each round: 8 rows
/// (our few-row kernels and cuBLASLt measure close there), then four row counts of one range.
#[test]
fn threads_choosing_one_key_at_once_all_run_the_engine_the_registry_keeps() {
    const THREADS: usize = 4;
    let dev = gpu_test_device!();
    let eng = Engines::get(&dev).unwrap();
    let k = 256;
    let rows_of = |round: usize, t: usize| if round < 3 { 8 } else { 97 + 4 * t };
    let mut n = 136;
    for round in 0..6 {
        // Columns whose keys no choice (from disk either) holds yet.
        let fresh = |n: usize| {
            (0..THREADS).all(|t| {
                let op = gemm_op(
                    Trans::N,
                    Trans::T,
                    (rows_of(round, t), n, k),
                    Epilogue::None,
                );
                let base = key(&op, Dtype::Bf16, Dtype::Bf16);
                !eng.table().iter().any(|r| r.key.starts_with(&base))
            })
        };
        n += 8;
        while !fresh(n) {
            n += 8;
        }
        let start = std::sync::Barrier::new(THREADS);
        std::thread::scope(|sc| {
            let threads: Vec<_> = (0..THREADS)
                .map(|t| {
                    let (dev, start) = (dev.clone(), &start);
                    let op = gemm_op(
                        Trans::N,
                        Trans::T,
                        (rows_of(round, t), n, k),
                        Epilogue::None,
                    );
                    sc.spawn(move || {
                        let mut s = dev.new_stream().unwrap();
                        let nn = Nn::get(&dev).unwrap();
                        let inp = inputs::<bf16>(&s, &op, 50 + t as u64);
                        let c = || s.alloc_from_host(&vec![bf16::from_f32(SENTINEL); op.m * op.n]);
                        let (ce, cr) = (c().unwrap(), c().unwrap());
                        let what = format!("round {round}, thread {t}, {}", op.key());
                        start.wait();
                        if t == 0 {
                            let (g, captured) =
                                Graph::capture(&mut s, CaptureOptions::new(), |cs| {
                                    gemm_lowp(cs, &nn, &op, &inp.a, &inp.b, &cr, None)
                                        .map_err(Into::into)
                                })
                                .unwrap_or_else(|e| panic!("capturing {what}: {e:?}"));
                            let eager = gemm_lowp(&s, &nn, &op, &inp.a, &inp.b, &ce, None).unwrap();
                            assert_eq!(eager, captured, "{what}: eager after the capture");
                            g.replay(&s).unwrap();
                            s.synchronize().unwrap();
                            assert_same_bits(
                                &bits(&s, &cr),
                                &bits(&s, &ce),
                                &format!("{what}: replay vs eager"),
                            );
                        } else {
                            let first = gemm_lowp(&s, &nn, &op, &inp.a, &inp.b, &ce, None).unwrap();
                            let again = gemm_lowp(&s, &nn, &op, &inp.a, &inp.b, &cr, None).unwrap();
                            assert_eq!(again, first, "{what}: the second call's engine");
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
        });
    }
}

#[test]
fn registry_rows_of_half_precision_products_name_their_types() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let op = gemm_op(Trans::N, Trans::T, (72, 136, 264), Epilogue::Bias);
    let mut rng = HostRng::new(5);
    let a = s
        .alloc_from_host(&values::<bf16>(&mut rng, op.m * op.k))
        .unwrap();
    let b = s
        .alloc_from_host(&values::<bf16>(&mut rng, op.k * op.n))
        .unwrap();
    let bias = s.alloc_from_host(&values::<f32>(&mut rng, op.n)).unwrap();
    let c = s.alloc::<f32>(op.m * op.n).unwrap();
    let engine = gemm_lowp(&s, &nn, &op, &a, &b, &c, Some(&bias)).unwrap();
    let eng = Engines::get(&dev).unwrap();
    let k = key(&op, Dtype::Bf16, Dtype::F32);
    assert!(k.ends_with("ep=bias in=bf16 out=f32"), "{k}");
    let row = eng
        .table()
        .into_iter()
        .find(|r| r.key.starts_with(&k))
        .unwrap_or_else(|| panic!("no registry row for {k}"));
    assert_eq!(row.entry.engine.parse::<GemmEngine>().unwrap(), engine);
    assert!(row.entry.measured, "an eager first call measures");
    assert!(!row.entry.timings.is_empty());
    println!(
        "{}: {} of {} candidates",
        row.key,
        engine,
        row.entry.timings.len()
    );
}

/// cuBLASLt's documentation gives the bias the D type except for IMMA and FP8 kernels; where
/// it still offers algorithms for an f32 bias with a bf16/f16 D
/// (`CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE`), they must be right; where it offers none, asking
/// for one is a typed error.
#[test]
fn an_f32_bias_with_a_half_precision_result_is_right_where_cublaslt_offers_it() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let eng = Engines::get(&dev).unwrap();
    let lt = eng
        .cublaslt()
        .expect("cuBLASLt is expected on the GPU machine");
    fn one<T: Float>(s: &Stream, lt: &cudagraph_nn::ffi::blaslt::BlasLt) {
        let op = gemm_op(Trans::N, Trans::T, (64, 128, 96), Epilogue::Bias);
        let inp = inputs::<T>(s, &op, 9);
        let shape = LtShape {
            ta: op.ta,
            tb: op.tb,
            m: op.m,
            n: op.n,
            k: op.k,
            epilogue: op.epilogue,
            align: 256,
        };
        let types = LtTypes::new(T::DTYPE, T::DTYPE, Some(Dtype::F32)).unwrap();
        // A descriptor cuBLASLt refuses the vector type for counts as no algorithm.
        let count = match lt.algo_count_typed(&shape, types) {
            Ok((count, _)) => count,
            Err(e) => {
                println!(
                    "cuBLASLt refuses an f32 bias with a {} result: {e}",
                    T::DTYPE
                );
                0
            }
        };
        let mut rng = HostRng::new(10);
        let hbias = values::<f32>(&mut rng, op.n);
        let bias = s.alloc_from_host(&hbias).unwrap();
        let c = s
            .alloc_from_host(&vec![T::from_f32(SENTINEL); op.m * op.n])
            .unwrap();
        let r = lt.matmul_typed(
            s,
            &shape,
            LtAlgo::Rank(0),
            1.0,
            &inp.a,
            &inp.b,
            0.0,
            &c,
            Some(&bias),
        );
        if count == 0 {
            println!(
                "cuBLASLt offers no algorithm for an f32 bias with a {} result",
                T::DTYPE
            );
            assert!(
                r.is_err(),
                "no algorithm offered, yet the product ran: {r:?}"
            );
            untouched(s, &c, "an f32 bias cuBLASLt does not take");
            return;
        }
        println!(
            "cuBLASLt offers {count} algorithms for an f32 bias with a {} result",
            T::DTYPE
        );
        assert!(r.unwrap(), "a bias epilogue is fused");
        let got = s.to_vec(&c).unwrap();
        check_result("f32 bias", &op, &inp.prods, &got, &[], Some(&wide(&hbias)));
    }
    one::<bf16>(&s, lt);
    one::<f16>(&s, lt);
}

/// Fills a result with the sentinel and hands back a check that it still holds it.
fn untouched<O: Float>(s: &Stream, c: &DeviceBuffer<O>, what: &str) {
    s.synchronize().unwrap();
    let v = s.to_vec(c).unwrap();
    assert!(
        v.iter().all(|x| x.to_f32() == SENTINEL),
        "{what}: the result was written"
    );
}

#[test]
fn wrong_types_lengths_and_vectors_are_typed_errors_that_run_nothing() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let (m, n, k) = (16, 24, 32);
    let op = gemm_op(Trans::N, Trans::T, (m, n, k), Epilogue::Bias);
    let mut rng = HostRng::new(3);
    let a = s.alloc_from_host(&values::<bf16>(&mut rng, m * k)).unwrap();
    let b = s.alloc_from_host(&values::<bf16>(&mut rng, k * n)).unwrap();
    let bias = s.alloc_from_host(&values::<bf16>(&mut rng, n)).unwrap();
    let c = s
        .alloc_from_host(&vec![bf16::from_f32(SENTINEL); m * n])
        .unwrap();
    let not_supported = |r: cudagraph_nn::Result<GemmEngine>, what: &str| match r {
        Err(NnError::NotSupported {
            op: "gemm_lowp", ..
        }) => {}
        other => panic!("{what}: {other:?}"),
    };
    let size_mismatch = |r: cudagraph_nn::Result<GemmEngine>, want: &str, what: &str| match r {
        Err(NnError::Core(cudagraph::Error::SizeMismatch { what: w, .. })) if w == want => {}
        other => panic!("{what}: {other:?}"),
    };
    let shape = |r: cudagraph_nn::Result<GemmEngine>, what: &str| match r {
        Err(NnError::Shape(_)) => {}
        other => panic!("{what}: {other:?}"),
    };

    // f32 operands: run_gemm's, with a message saying so.
    let af = s.alloc_from_host(&vec![1.0f32; m * k]).unwrap();
    let bf = s.alloc_from_host(&vec![1.0f32; k * n]).unwrap();
    let cf = s.alloc_from_host(&vec![SENTINEL; m * n]).unwrap();
    let vf = s.alloc_from_host(&vec![0.0f32; n]).unwrap();
    let r = gemm_lowp(&s, &nn, &op, &af, &bf, &cf, Some(&vf));
    assert!(
        matches!(&r, Err(e @ NnError::NotSupported { .. }) if e.to_string().contains("run_gemm")),
        "{r:?}"
    );
    untouched(&s, &cf, "f32 operands");
    // A result of a third type: bf16 operands, f16 result (and the reverse).
    let ch = s
        .alloc_from_host(&vec![f16::from_f32(SENTINEL); m * n])
        .unwrap();
    let vh = s.alloc_from_host(&vec![f16::ZERO; n]).unwrap();
    not_supported(
        gemm_lowp(&s, &nn, &op, &a, &b, &ch, Some(&vh)),
        "bf16 → f16",
    );
    untouched(&s, &ch, "bf16 → f16");
    let ah = s.alloc_from_host(&vec![f16::ONE; m * k]).unwrap();
    let bh = s.alloc_from_host(&vec![f16::ONE; k * n]).unwrap();
    not_supported(
        gemm_lowp(&s, &nn, &op, &ah, &bh, &c, Some(&bias)),
        "f16 → bf16",
    );
    // Buffers too short for the product.
    let short_a = s.alloc::<bf16>(m * k - 1).unwrap();
    let short_b = s.alloc::<bf16>(k * n - 1).unwrap();
    let short_c = s
        .alloc_from_host(&vec![bf16::from_f32(SENTINEL); m * n - 1])
        .unwrap();
    let short_bias = s.alloc::<bf16>(n - 1).unwrap();
    size_mismatch(
        gemm_lowp(&s, &nn, &op, &short_a, &b, &c, Some(&bias)),
        "gemm A",
        "short A",
    );
    size_mismatch(
        gemm_lowp(&s, &nn, &op, &a, &short_b, &c, Some(&bias)),
        "gemm B",
        "short B",
    );
    size_mismatch(
        gemm_lowp(&s, &nn, &op, &a, &b, &short_c, Some(&bias)),
        "gemm C",
        "short C",
    );
    untouched(&s, &short_c, "short C");
    size_mismatch(
        gemm_lowp(&s, &nn, &op, &a, &b, &c, Some(&short_bias)),
        "gemm bias",
        "short bias",
    );
    // Vectors that do not match the epilogue.
    shape(
        gemm_lowp(&s, &nn, &op, &a, &b, &c, None),
        "a bias epilogue without a bias",
    );
    let plain = GemmOp {
        epilogue: Epilogue::None,
        ..op
    };
    shape(
        gemm_lowp(&s, &nn, &plain, &a, &b, &c, Some(&bias)),
        "a bias without an epilogue",
    );
    let grad_nt = GemmOp {
        epilogue: Epilogue::BiasGrad,
        ..op
    };
    let db = s.alloc::<bf16>(m).unwrap();
    shape(
        gemm_lowp(&s, &nn, &grad_nt, &a, &b, &c, Some(&db)),
        "a bias gradient of A not transposed",
    );
    let grad = GemmOp {
        ta: Trans::T,
        tb: Trans::N,
        alpha: 0.5,
        ..grad_nt
    };
    shape(
        gemm_lowp(&s, &nn, &grad, &a, &b, &c, Some(&db)),
        "a scaled bias gradient",
    );
    // k = 0.
    let empty = GemmOp { k: 0, ..op };
    shape(gemm_lowp(&s, &nn, &empty, &a, &b, &c, Some(&bias)), "k = 0");
    untouched(&s, &c, "every refused bf16 product");
    // Engines that cannot run a half-precision product, named exactly.
    let r = gemm_lowp_with(&s, &nn, GemmEngine::Tiled(1), &plain, &a, &b, &c, None);
    assert!(matches!(r, Err(NnError::NotSupported { .. })), "{r:?}");
    let r = gemm_lowp_with(&s, &nn, GemmEngine::Cublas, &op, &a, &b, &c, Some(&bias));
    assert!(matches!(r, Err(NnError::NotSupported { .. })), "{r:?}");
    let r = gemm_lowp_with(
        &s,
        &nn,
        GemmEngine::CublasLt(200),
        &op,
        &a,
        &b,
        &c,
        Some(&bias),
    );
    assert!(matches!(r, Err(NnError::Library { .. })), "{r:?}");
    untouched(&s, &c, "engines that cannot run it");
    // The f32 engines refuse GELU, whichever family is asked.
    let gelu = GemmOp {
        epilogue: Epilogue::BiasGelu,
        ..op
    };
    for family in [GemmFamily::Auto, GemmFamily::CublasLt, GemmFamily::Tiled] {
        let r = run_gemm(&s, &nn, family, &gelu, &af, &bf, &cf, Some(&vf));
        assert!(
            matches!(r, Err(NnError::NotSupported { op: "gemm", .. })),
            "{r:?}"
        );
    }
    untouched(&s, &cf, "f32 GELU");
}

/// One product of `T` into `O` on `cublaslt-t:0`: offered, right against f64, and replayed
/// from a graph with the eager run's bits.
fn transposed_case<T: Float, O: Float>(s: &mut Stream, nn: &Nn, op: &GemmOp, rng: &mut HostRng) {
    let engine = GemmEngine::CublasLtTransposed(0);
    let inp = inputs::<T>(s, op, op.m as u64 + op.n as u64);
    let align = alignment(&[inp.a.addr(), inp.b.addr()]);
    let cands = lowp_candidates::<T, O>(s, op, align).unwrap();
    assert!(
        cands.contains(&engine),
        "{} {}→{}: {cands:?}",
        op.key(),
        T::DTYPE,
        O::DTYPE
    );
    let what = format!("{engine} {}→{}", T::DTYPE, O::DTYPE);
    run_and_check::<T, O>(s, &what, op, &inp, rng, &mut |c, v| {
        gemm_lowp_with(s, nn, engine, op, &inp.a, &inp.b, c, v)
    });
    let fresh = vec![O::from_f32(SENTINEL); op.m * op.n];
    let (ce, cr) = (
        s.alloc_from_host(&fresh).unwrap(),
        s.alloc_from_host(&fresh).unwrap(),
    );
    gemm_lowp_with(s, nn, engine, op, &inp.a, &inp.b, &ce, None).unwrap();
    let (g, ()) = Graph::capture(s, CaptureOptions::new(), |cs| {
        gemm_lowp_with(cs, nn, engine, op, &inp.a, &inp.b, &cr, None).map_err(Into::into)
    })
    .unwrap_or_else(|e| panic!("capturing {what} {}: {e:?}", op.key()));
    for _ in 0..2 {
        g.replay(s).unwrap();
    }
    s.synchronize().unwrap();
    assert_same_bits(
        &bits(s, &cr),
        &bits(s, &ce),
        &format!("replay vs eager {what} {}", op.key()),
    );
}

/// Where C's rows are no multiple of 16 bytes apart (a head of 50 257 logits), cuBLASLt also
/// runs the transposed product into a scratch matrix and a transposing copy writes C
/// (`cublaslt-t`): offered exactly there (not for aligned rows, beta ≠ 0 or an epilogue),
/// right against f64 in every layout, for one row, a few, and more than the copy's grid
/// covers at once (2 097 121 rows: 65 535 tiles of 32 and one more), replayed bit for bit, and
/// refused with a typed error where it is not offered, writing nothing.
#[test]
fn unaligned_rows_run_as_the_transposed_product() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let mut rng = HostRng::new(4242);
    let (n, t) = (Trans::N, Trans::T);
    let cases = [
        (n, t, 1, 1001, 64),
        (n, t, 8, 1001, 64),
        (n, t, 64, 1001, 128),
        (n, n, 5, 13, 32),
        (t, n, 33, 7, 24),
        (t, t, 3, 1001, 16),
        (n, t, 70_000, 7, 16),
    ];
    for (ta, tb, m, n, k) in cases {
        let op = gemm_op(ta, tb, (m, n, k), Epilogue::None);
        transposed_case::<bf16, f32>(&mut s, &nn, &op, &mut rng);
        transposed_case::<bf16, bf16>(&mut s, &nn, &op, &mut rng);
        transposed_case::<f16, f16>(&mut s, &nn, &op, &mut rng);
    }
    let tall = gemm_op(n, t, (65_535 * 32 + 1, 7, 16), Epilogue::None);
    transposed_case::<bf16, bf16>(&mut s, &nn, &tall, &mut rng);
    // Not offered, and refused: rows aligned already, beta reading C, an epilogue.
    let engine = GemmEngine::CublasLtTransposed(0);
    let aligned = gemm_op(n, t, (8, 1008, 64), Epilogue::None);
    let scaled = GemmOp {
        beta: 0.5,
        ..gemm_op(n, t, (8, 1001, 64), Epilogue::None)
    };
    let bias = gemm_op(n, t, (8, 1001, 64), Epilogue::Bias);
    let grad = gemm_op(t, n, (8, 1001, 64), Epilogue::BiasGrad);
    for op in [aligned, scaled, bias, grad] {
        let inp = inputs::<bf16>(&s, &op, 7);
        let align = alignment(&[inp.a.addr(), inp.b.addr()]);
        let cands = lowp_candidates::<bf16, bf16>(&s, &op, align).unwrap();
        assert!(
            !cands
                .iter()
                .any(|e| matches!(e, GemmEngine::CublasLtTransposed(_))),
            "{}: {cands:?}",
            op.key()
        );
        let c = s
            .alloc_from_host(&vec![bf16::from_f32(SENTINEL); op.m * op.n])
            .unwrap();
        let v = s
            .alloc_from_host(&vec![bf16::from_f32(SENTINEL); op.m.max(op.n)])
            .unwrap();
        let vec = (op.epilogue != Epilogue::None).then_some(&v);
        let r = gemm_lowp_with(&s, &nn, engine, &op, &inp.a, &inp.b, &c, vec);
        assert!(
            matches!(r, Err(NnError::NotSupported { .. })),
            "{}: {r:?}",
            op.key()
        );
        untouched(&s, &c, &format!("{engine} refused for {}", op.key()));
    }
}
