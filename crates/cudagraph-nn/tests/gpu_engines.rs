//! GPU tests of the engine registry and of every engine it chooses from: cuBLAS, cuBLASLt (its
//! heuristic algorithms, their split-K variants and the configurations found by search), our tiled and warp-K GEMM kernels, cuDNN (each of its algorithms), our implicit-GEMM kernels
//! (each tile, with and without split-K) and the direct conv kernels — each forced one at a time
//! and checked against the f64 CPU reference (`cudagraph_nn::cpu`) in forward and backward, on
//! odd sizes (primes, 1, sizes that are no multiple of a tile, stride 2 with padding, 1×1 and
//! 7×7 kernels). Then: graph replays equal eager runs bit for bit with the same engines, the
//! fallback without cuDNN and cuBLASLt runs everything, and the registry measures eagerly and
//! keeps capture-time choices, unmeasured, until they are forgotten.
//!
//! Tolerances (‖gpu − ref‖ / ‖ref‖ against f64): fp32 products accumulate K terms in some
//! order, so the relative error grows like √K·2⁻²⁴ (about 4e-6 at K = 4096); we allow 2e-5 up
//! to K ≈ 1000 and 1e-4 beyond. Convolutions get 1e-4 everywhere: cuDNN's FFT and Winograd
//! algorithms add transform rounding on top of the long sums (still far below a real bug, which
//! shows as O(1)). Graph against eager with the same engines: 0 (bit-identical, compared with
//! `cudagraph::testing::assert_bits_eq`).
//!
//! The product tests run every candidate the registry computes for each shape they cover
//! (`gemm_candidates`, all families) besides the ones they name, so an engine the registry
//! would choose is never left unchecked; every row of the registry's table must parse as its
//! operation's engine (a row nothing can read is a failure, not a row to skip).
//!
//! The GPU machine is expected to have cuDNN and cuBLASLt: the tests that force them fail when
//! they are missing (a skipped engine is not a tested engine).

use cudagraph::testing::assert_bits_eq;
use cudagraph::{
    gpu_test_device, CaptureOptions, Device, DeviceBuffer, Graph, Queue, QueueExt, Stream,
};
use cudagraph_nn::cpu::{self, rel_err, to_f64};
use cudagraph_nn::engine::conv::ConvGeom;
use cudagraph_nn::engine::conv::{conv_candidates, conv_key, conv_with, ConvDir, ConvIo};
use cudagraph_nn::engine::gemm::alignment;
use cudagraph_nn::engine::gemm::Trans;
use cudagraph_nn::engine::gemm::{
    cols_candidates, gemm_candidates, gemm_with, run_gemm, Epilogue, GemmFamily, GemmOp,
};
use cudagraph_nn::engine::{
    BiasEngine, CeEngine, ConvEngine, ConvFamily, EngineRow, Engines, GemmEngine, Policy,
};
use cudagraph_nn::kernels::igemm;
use cudagraph_nn::*;

fn data(rng: &mut HostRng, n: usize) -> Vec<f32> {
    rng.vec_normal(n)
}

fn engines(dev: &Device) -> std::sync::Arc<Engines> {
    Engines::get(dev).unwrap()
}

fn set_policy(dev: &Device, f: impl FnOnce(&mut Policy)) {
    let e = engines(dev);
    let mut p = Policy::default();
    f(&mut p);
    e.set_policy(p);
}

fn grad(p: &Parameter, s: &Stream) -> Vec<f32> {
    s.to_vec(p.grad().unwrap().expect("gradient present").as_ref())
        .unwrap()
}

fn tol(k: usize) -> f64 {
    if k > 1100 {
        1e-4
    } else {
        2e-5
    }
}

/// `alpha·op(A)·op(B) + beta·C0` (+ bias, ReLU) in f64.
fn gemm_ref(op: &GemmOp, ah: &[f32], bh: &[f32], c0: &[f32], bias: &[f32]) -> Vec<f64> {
    let (m, n, k) = (op.m, op.n, op.k);
    let a_at = |i: usize, p: usize| {
        if op.ta == Trans::N {
            ah[i * k + p]
        } else {
            ah[p * m + i]
        }
    } as f64;
    let b_at = |p: usize, j: usize| {
        if op.tb == Trans::N {
            bh[p * n + j]
        } else {
            bh[j * k + p]
        }
    } as f64;
    (0..m * n)
        .map(|e| {
            let (i, j) = (e / n, e % n);
            let dot: f64 = (0..k).map(|p| a_at(i, p) * b_at(p, j)).sum();
            let mut v = op.alpha as f64 * dot + op.beta as f64 * c0[e] as f64;
            if matches!(op.epilogue, Epilogue::Bias | Epilogue::BiasRelu) {
                v += bias[j] as f64;
            }
            if op.epilogue == Epilogue::BiasRelu {
                v = v.max(0.0);
            }
            v
        })
        .collect()
}

/// Random operands of a product (the bias sized for any epilogue) and the output it starts
/// from, on the host and on the device.
struct Operands {
    ah: Vec<f32>,
    bh: Vec<f32>,
    c0: Vec<f32>,
    bias: Vec<f32>,
    a: DeviceBuffer<f32>,
    b: DeviceBuffer<f32>,
    bb: DeviceBuffer<f32>,
}

impl Operands {
    fn new(s: &Stream, rng: &mut HostRng, op: &GemmOp) -> Self {
        let (ah, bh, c0, bias) = (
            data(rng, op.m * op.k),
            data(rng, op.k * op.n),
            data(rng, op.m * op.n),
            data(rng, op.n),
        );
        let (a, b, bb) = (
            s.alloc_from_host(&ah).unwrap(),
            s.alloc_from_host(&bh).unwrap(),
            s.alloc_from_host(&bias).unwrap(),
        );
        Operands {
            ah,
            bh,
            c0,
            bias,
            a,
            b,
            bb,
        }
    }

    /// The f64 reference of `op` on these operands.
    fn want(&self, op: &GemmOp) -> Vec<f64> {
        gemm_ref(op, &self.ah, &self.bh, &self.c0, &self.bias)
    }
}

/// A product with alpha 1, beta 0.
fn plain_op(ta: Trans, tb: Trans, m: usize, n: usize, k: usize, epilogue: Epilogue) -> GemmOp {
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

/// cuBLASLt's candidates for `op`: its heuristic ranks and the split-K variants kept for the
/// shape (the policy is switched to list them; the test fails without cuBLASLt).
fn lt_algos(dev: &Device, s: &Stream, op: &GemmOp) -> Vec<GemmEngine> {
    let e = engines(dev);
    assert!(
        e.cublaslt().is_some(),
        "cuBLASLt must be installed on the GPU test machine"
    );
    e.set_policy(Policy {
        lt_split_k: true,
        ..e.policy()
    });
    gemm_candidates(s, &e, op, GemmFamily::CublasLt, 256)
        .unwrap()
        .into_iter()
        .filter(|a| {
            matches!(
                a,
                GemmEngine::CublasLt(_) | GemmEngine::CublasLtSplitK { .. }
            )
        })
        .collect()
}

fn is_split_k(a: &GemmEngine) -> bool {
    matches!(a, GemmEngine::CublasLtSplitK { .. })
}

/// Appends to `algos` every candidate the registry computes for `op` over these buffers (all
/// families, under the engines' current policy, at the buffers' alignment) that `algos` does
/// not hold yet; returns how many the registry listed (never none).
fn add_registry_candidates(
    s: &Stream,
    eng: &Engines,
    op: &GemmOp,
    buffers: &[&DeviceBuffer<f32>],
    algos: &mut Vec<GemmEngine>,
) -> usize {
    let addrs: Vec<u64> = buffers.iter().map(|b| b.addr()).collect();
    let listed = gemm_candidates(s, eng, op, GemmFamily::Auto, alignment(&addrs)).unwrap();
    assert!(
        !listed.is_empty(),
        "the registry lists nothing for {}",
        op.key()
    );
    for a in &listed {
        if !algos.contains(a) {
            algos.push(*a);
        }
    }
    listed.len()
}

/// Two graphs captured on one stream with cuBLAS and every cuBLASLt algorithm of a deep product
/// (split-K ones need a workspace; its split-K variants too, whose in-place reduction keeps
/// counters there), replayed interleaved on two other streams without waiting:
/// each keeps its own workspace, so both equal the eager result bit for bit (a workspace kept
/// per capture stream was shared by both).
#[test]
fn library_graphs_of_one_stream_replay_at_once_on_two() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let nn = Nn::get(&dev).unwrap();
    let mut rng = HostRng::new(109);
    let op = GemmOp {
        ta: Trans::N,
        tb: Trans::T,
        m: 64,
        n: 96,
        k: 16384,
        alpha: 1.0,
        beta: 0.0,
        epilogue: Epilogue::Bias,
    };
    let mut algos = lt_algos(&dev, &s, &op);
    assert!(!algos.is_empty());
    algos.push(GemmEngine::Cublas);
    for algo in algos {
        let inputs: Vec<_> = (0..2)
            .map(|_| {
                (
                    s.alloc_from_host(&data(&mut rng, op.m * op.k)).unwrap(),
                    s.alloc_from_host(&data(&mut rng, op.n * op.k)).unwrap(),
                    s.alloc_from_host(&data(&mut rng, op.n)).unwrap(),
                )
            })
            .collect();
        let eager: Vec<Vec<f32>> = inputs
            .iter()
            .map(|(a, b, v)| {
                let c = s.alloc_zeroed::<f32>(op.m * op.n).unwrap();
                gemm_with(&s, &nn, algo, &op, a, b, &c, Some(v)).unwrap();
                s.to_vec(&c).unwrap()
            })
            .collect();
        let mut graphs = Vec::new();
        for (a, b, v) in &inputs {
            let c = s.alloc_zeroed::<f32>(op.m * op.n).unwrap();
            let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
                gemm_with(cs, &nn, algo, &op, a, b, &c, Some(v)).map_err(Into::into)
            })
            .unwrap_or_else(|e| panic!("capturing {algo}: {e:?}"));
            graphs.push((g, c));
        }
        s.synchronize().unwrap();
        for _ in 0..20 {
            graphs[0].0.replay(&s1).unwrap();
            graphs[1].0.replay(&s2).unwrap();
        }
        s1.synchronize().unwrap();
        s2.synchronize().unwrap();
        for (i, (_, c)) in graphs.iter().enumerate() {
            assert_bits_eq(
                &s1.to_vec(c).unwrap(),
                &eager[i],
                format_args!("{algo}, graph {i} vs eager"),
            );
        }
    }
}

/// `C = relu(0.5·op(A)·op(B) + 0.25·C + bias)`: every part of the epilogue at once.
fn scaled_bias_relu(ta: Trans, tb: Trans, m: usize, n: usize, k: usize) -> GemmOp {
    GemmOp {
        ta,
        tb,
        m,
        n,
        k,
        alpha: 0.5,
        beta: 0.25,
        epilogue: Epilogue::BiasRelu,
    }
}

/// The register-blocked kernel as the tests run it: unsplit and split.
const REG_ALGOS: [GemmEngine; 3] = [GemmEngine::Reg(1), GemmEngine::Reg(3), GemmEngine::Reg(8)];

#[test]
fn every_gemm_engine_matches_cpu_in_every_layout_and_epilogue() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    // The default policy, cuBLASLt's split-K variants listed too (as `lt_algos` asks).
    eng.set_policy(Policy {
        lt_split_k: true,
        ..Policy::default()
    });
    let mut rng = HostRng::new(101);
    let (n, t) = (Trans::N, Trans::T);
    let shapes: &[(usize, usize, usize)] = &[
        (1, 1, 1),
        (1, 257, 3),
        (7, 13, 31),
        (33, 65, 70),
        (131, 97, 1031),
        (64, 256, 4096),
        // k a multiple of 4 (the few-rows kernel's float4 loads) but not of its 128-wide
        // chunks, odd rows and columns not a multiple of its 4-column groups.
        (1, 10, 256),
        (13, 131, 132),
        (16, 5, 2052),
        // The 8- and 4-row kernels: K past their last pair of chunks, a lone chunk, odd columns.
        (8, 131, 1028),
        (3, 67, 516),
        (4, 9, 128),
        // Sixteen warps per column group: 33 chunks (a lone last one), odd columns.
        (5, 259, 4100),
        // Few output tiles: cuBLASLt's split-K variants (K of 259 and 1023 split up to 8 and
        // 16 ways, odd rows and columns), and the sweep's 512 × 256 → 1024 forward product.
        (5, 77, 259),
        (5, 77, 1023),
        (512, 1024, 256),
    ];
    let mut checked = 0;
    let mut split_k_checked = 0;
    let mut registry_listed = 0;
    for &(m, nn_, k) in shapes {
        for (ta, tb) in [(n, n), (n, t), (t, n), (t, t)] {
            // The 4096-deep products only in the two layouts linear layers use most.
            if k >= 4096 && !(ta == n && tb == t || ta == t && tb == n) {
                continue;
            }
            // The 512 × 1024 × 256 product in the layouts of a linear layer's forward (NT) and
            // backward (NN, TN) passes: the f64 reference of the fourth costs seconds.
            if m * nn_ * k >= 1 << 27 && ta == t && tb == t {
                continue;
            }
            for (ep, alpha, beta) in [
                (Epilogue::None, 1.0f32, 0.0f32),
                (Epilogue::Bias, 1.0, 0.0),
                (Epilogue::BiasRelu, 0.5, 0.25),
            ] {
                let op = GemmOp {
                    ta,
                    tb,
                    m,
                    n: nn_,
                    k,
                    alpha,
                    beta,
                    epilogue: ep,
                };
                let o = Operands::new(&s, &mut rng, &op);
                let want = o.want(&op);
                let Operands { c0, a, b, bb, .. } = o;
                let mut algos = vec![
                    GemmEngine::Cublas,
                    GemmEngine::Tiled(1),
                    GemmEngine::Tiled(4),
                ];
                // Both register-blocked tiles, whole and split (also past K's 32-wide tiles).
                algos.extend(REG_ALGOS);
                // Every cluster size, also where K has fewer tiles than splits (empty splits).
                algos.extend([2, 4, 8].map(GemmEngine::Cluster));
                if ta == n && tb == t && k % 4 == 0 {
                    algos.extend([1, 2, 4, 8].map(GemmEngine::Chunks));
                }
                if ta == n && tb == t && alpha == 1.0 && beta == 0.0 {
                    algos.push(GemmEngine::WarpK);
                    if m <= cudagraph_nn::engine::gemm::ROWS_MAX_M && k % 4 == 0 {
                        algos.extend([1, 2, 8].map(|ks| GemmEngine::Rows { rows: 16, ks }));
                        for rows in [8u8, 4] {
                            if m <= rows as usize {
                                algos.extend(
                                    [1, 2, 4, 8, 16].map(|ks| GemmEngine::Rows { rows, ks }),
                                );
                            }
                        }
                        // The column-warp kernels the registry offers here.
                        algos.extend(cols_candidates(m, k));
                    }
                }
                let lt = lt_algos(&dev, &s, &op);
                assert!(!lt.is_empty(), "cuBLASLt offers no algorithm for {op:?}");
                algos.extend(lt);
                // And whatever else the registry would choose from for this product.
                let c = s.alloc::<f32>(op.m * op.n).unwrap();
                registry_listed +=
                    add_registry_candidates(&s, &eng, &op, &[&a, &b, &bb, &c], &mut algos);
                for algo in algos {
                    let c = s.alloc_from_host(&c0).unwrap();
                    let v = (ep != Epilogue::None).then_some(&bb);
                    gemm_with(&s, &nn, algo, &op, &a, &b, &c, v)
                        .unwrap_or_else(|e| panic!("{algo} {}: {e}", op.key()));
                    let got = s.to_vec(&c).unwrap();
                    let err = rel_err(&got, &want);
                    assert!(err < tol(k), "{algo} {}: {err}", op.key());
                    checked += 1;
                    split_k_checked += is_split_k(&algo) as usize;
                }
            }
        }
    }
    assert!(checked > 200, "{checked} products checked");
    assert!(
        split_k_checked > 0,
        "no cuBLASLt split-K variant was offered for any of the few-tile products"
    );
    println!(
        "{checked} products checked, {split_k_checked} with cuBLASLt split-K variants, \
         {registry_listed} registry candidates among them"
    );
    // More rows than a few-rows kernel takes: a typed error, nothing launched.
    let op = GemmOp {
        ta: n,
        tb: t,
        m: 5,
        n: 8,
        k: 128,
        alpha: 1.0,
        beta: 0.0,
        epilogue: Epilogue::None,
    };
    let (a, b, c) = (
        s.alloc::<f32>(5 * 128).unwrap(),
        s.alloc::<f32>(8 * 128).unwrap(),
        s.alloc::<f32>(5 * 8).unwrap(),
    );
    let refused = |algo| {
        gemm_with(&s, &nn, algo, &op, &a, &b, &c, None)
            .unwrap_err()
            .to_string()
    };
    let e = refused(GemmEngine::Rows { rows: 4, ks: 1 });
    assert!(e.contains("at most 4 rows"), "{e}");
    // Sixteen warps per group only with 8 or 4 rows per block.
    let e = refused(GemmEngine::Rows { rows: 16, ks: 16 });
    assert!(e.contains("warps per column group"), "{e}");
    // Column-warp shapes that do not exist: three rows per warp, more K splits than warps.
    for (rows, warps, ks) in [(3, 8, 1), (4, 4, 8), (4, 32, 1)] {
        let e = refused(GemmEngine::Cols {
            rows,
            cols: 1,
            warps,
            ks,
        });
        assert!(e.contains("per warp"), "{e}");
    }
    // More rows than the few-rows family takes.
    let big = GemmOp { m: 17, ..op };
    let a17 = s.alloc::<f32>(17 * 128).unwrap();
    let c17 = s.alloc::<f32>(17 * 8).unwrap();
    let cols = GemmEngine::Cols {
        rows: 16,
        cols: 1,
        warps: 8,
        ks: 1,
    };
    let e = gemm_with(&s, &nn, cols, &big, &a17, &b, &c17, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("at most 16 rows"), "{e}");
    s.synchronize().unwrap();
}

/// The cluster kernels reduce the same K splits as `tiled:S` plus its reduce node, in the same
/// order: equal values (splits past K add +0.0), one node instead of two, and a graph replay
/// equal to the eager run bit for bit. The chunked forward kernel (its own split order) against
/// the reference and eager against replay.
#[test]
fn cluster_splits_equal_tiled_splits_and_replay_bit_for_bit() {
    let dev = gpu_test_device!();
    assert!(
        cudagraph_nn::kernels::ClusterKernels::supported(&dev),
        "the GPU test machine (sm_90+) runs thread-block clusters"
    );
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let mut rng = HostRng::new(104);
    let (n, t) = (Trans::N, Trans::T);
    let shapes = [
        (32usize, 10usize, 256usize, n, t),
        (33, 65, 700, t, n),
        (64, 96, 64, t, t),
        (32, 512, 1024, n, t),
        (1, 1024, 4096, n, t),
        (7, 300, 257, n, n),
    ];
    // Under compute-sanitizer (CUDAGRAPH_TEST_QUICK=1) the three small shapes: every kernel,
    // every layout class, in a time racecheck finishes.
    for &(m, nn_, k, ta, tb) in &shapes[..cudagraph::testing::iterations(shapes.len(), 3)] {
        let op = scaled_bias_relu(ta, tb, m, nn_, k);
        let o = Operands::new(&s, &mut rng, &op);
        let want = o.want(&op);
        let Operands { c0, a, b, bb, .. } = o;
        let run = |q: &dyn Queue, algo: GemmEngine, c: &DeviceBuffer<f32>| {
            gemm_with(q, &nn, algo, &op, &a, &b, c, Some(&bb))
        };
        // The chunked forward kernel (x·wᵀ, k a multiple of 4): the reference, and a replay
        // equal to the eager run bit for bit, in one kernel node.
        if ta == n && tb == t && k % 4 == 0 {
            for splits in [1u8, 2, 4, 8] {
                let algo = GemmEngine::Chunks(splits);
                let eager = s.alloc_from_host(&c0).unwrap();
                run(&s, algo, &eager).unwrap();
                let ev = s.to_vec(&eager).unwrap();
                let err = rel_err(&ev, &want);
                assert!(err < tol(k), "{algo} {}: {err}", op.key());
                let replayed = s.alloc_from_host(&c0).unwrap();
                let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
                    run(cs, algo, &replayed).map_err(Into::into)
                })
                .unwrap();
                assert_eq!(g.info().nodes.kernel, 1, "{algo}: one kernel node");
                g.replay(&s).unwrap();
                let rv = s.to_vec(&replayed).unwrap();
                assert_bits_eq(
                    &rv,
                    &ev,
                    format_args!("{algo} replay vs eager {}", op.key()),
                );
            }
        }
        for splits in [2u8, 4, 8] {
            let tiled = s.alloc_from_host(&c0).unwrap();
            run(&s, GemmEngine::Tiled(splits as u16), &tiled).unwrap();
            let eager = s.alloc_from_host(&c0).unwrap();
            run(&s, GemmEngine::Cluster(splits), &eager).unwrap();
            let (tv, ev) = (s.to_vec(&tiled).unwrap(), s.to_vec(&eager).unwrap());
            assert_eq!(tv, ev, "cluster:{splits} vs tiled:{splits} {}", op.key());
            let replayed = s.alloc_from_host(&c0).unwrap();
            let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
                run(cs, GemmEngine::Cluster(splits), &replayed).map_err(Into::into)
            })
            .unwrap();
            assert_eq!(g.info().nodes.kernel, 1, "one kernel node: no reduce");
            g.replay(&s).unwrap();
            let rv = s.to_vec(&replayed).unwrap();
            assert_bits_eq(
                &rv,
                &ev,
                format_args!("cluster:{splits} replay vs eager {}", op.key()),
            );
        }
    }
}

/// The register-blocked kernel, whole and split, with float4 loads (every leading dimension a
/// multiple of 4) and scalar ones (odd sizes) in every layout: within the product tolerance
/// of the f64 reference, the same bits run to run, and a graph replay equal to the eager run
/// bit for bit.
#[test]
fn register_blocked_kernel_agrees_repeats_and_replays() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let mut rng = HostRng::new(105);
    let (n, t) = (Trans::N, Trans::T);
    let shapes = [
        (65usize, 63usize, 47usize, n, t),
        (128, 200, 300, t, n),
        (512, 1024, 256, n, t),
        (3, 130, 1000, n, n),
        (200, 70, 33, t, t),
        (64, 64, 4096, n, t),
    ];
    for &(m, nn_, k, ta, tb) in &shapes[..cudagraph::testing::iterations(shapes.len(), 2)] {
        let op = scaled_bias_relu(ta, tb, m, nn_, k);
        let o = Operands::new(&s, &mut rng, &op);
        let want = o.want(&op);
        let Operands { c0, a, b, bb, .. } = o;
        let run = |q: &dyn Queue, algo: GemmEngine, c: &DeviceBuffer<f32>| {
            gemm_with(q, &nn, algo, &op, &a, &b, c, Some(&bb))
        };
        for splits in [1u16, 2, 5, 16] {
            let algo = GemmEngine::Reg(splits);
            agrees_repeats_and_replays(&mut s, &run, algo, &op, &c0, &want, "f64");
        }
    }
    s.synchronize().unwrap();
}

/// The column-warp kernels at every rows/columns-per-warp kernel and several block shapes —
/// one warp group covering all rows or several block rows, K splits with and without a chunk
/// each, k not a multiple of 128, odd columns — agree with the f64 reference, repeat bit for
/// bit, and replay bit for bit.
#[test]
fn column_warp_kernels_agree_repeat_and_replay() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let mut rng = HostRng::new(106);
    let (n, t) = (Trans::N, Trans::T);
    let shapes = [
        (1usize, 257usize, 1028usize),
        (2, 1000, 128),
        (3, 3, 516),
        (8, 131, 4100),
        (13, 64, 256),
        (16, 1, 4),
    ];
    for &(m, nn_, k) in &shapes[..cudagraph::testing::iterations(shapes.len(), 3)] {
        let op = plain_op(n, t, m, nn_, k, Epilogue::BiasRelu);
        let o = Operands::new(&s, &mut rng, &op);
        let want = o.want(&op);
        let Operands { c0, a, b, bb, .. } = o;
        let run = |q: &dyn Queue, algo: GemmEngine, c: &DeviceBuffer<f32>| {
            gemm_with(q, &nn, algo, &op, &a, &b, c, Some(&bb))
        };
        for rows in [1u8, 2, 4, 8, 16] {
            for cols in [1u8, 2] {
                for (warps, ks) in [(4u8, 1u8), (4, 4), (8, 2), (8, 8), (16, 1), (16, 16)] {
                    let algo = GemmEngine::Cols {
                        rows,
                        cols,
                        warps,
                        ks,
                    };
                    agrees_repeats_and_replays(&mut s, &run, algo, &op, &c0, &want, "f64");
                }
            }
        }
    }
    s.synchronize().unwrap();
}

/// How one candidate of a product runs on a queue into an output buffer.
type GemmRun<'a> =
    dyn Fn(&dyn Queue, GemmEngine, &DeviceBuffer<f32>) -> cudagraph_nn::Result<()> + 'a;

/// Runs `algo` eagerly from `c0` (within `tol(op.k)` of `want`, named `against` in messages),
/// three more times (the same bits each time), and captured into a graph replayed once (the
/// same bits as eager).
fn agrees_repeats_and_replays(
    s: &mut Stream,
    run: &GemmRun<'_>,
    algo: GemmEngine,
    op: &GemmOp,
    c0: &[f32],
    want: &[f64],
    against: &str,
) {
    let eager = s.alloc_from_host(c0).unwrap();
    run(s, algo, &eager).unwrap_or_else(|e| panic!("{algo} {}: {e}", op.key()));
    let ev = s.to_vec(&eager).unwrap();
    let err = rel_err(&ev, want);
    assert!(err < tol(op.k), "{algo} vs {against} {}: {err}", op.key());
    for _ in 0..3 {
        let again = s.alloc_from_host(c0).unwrap();
        run(s, algo, &again).unwrap();
        let av = s.to_vec(&again).unwrap();
        assert_bits_eq(&av, &ev, format_args!("{algo} run to run {}", op.key()));
    }
    let replayed = s.alloc_from_host(c0).unwrap();
    let (g, ()) = Graph::capture(s, CaptureOptions::new(), |cs| {
        run(cs, algo, &replayed).map_err(Into::into)
    })
    .unwrap_or_else(|e| panic!("capturing {algo} {}: {e:?}", op.key()));
    g.replay(s).unwrap();
    let rv = s.to_vec(&replayed).unwrap();
    assert_bits_eq(
        &rv,
        &ev,
        format_args!("{algo} replay vs eager {}", op.key()),
    );
}

/// cuBLASLt's split-K variants (`cublaslt:R/skS`) of products with few output tiles: the
/// sweep's forward products where cuBLASLt's first algorithm leaves most of an H100 idle
/// (512 × 256 → 1024 and 128 × 256 → 4096, with bias) get some; in those and in the backward
/// layouts of the first, each variant agrees with cuBLASLt's first algorithm within the
/// product tolerance, repeated runs give the same bits, and a graph replay equals its eager
/// run bit for bit; the registry
/// measures the variants among cuBLASLt's candidates, none failing; a variant the plan did not
/// keep is an error, not a launch.
#[test]
fn cublaslt_split_k_variants_agree_and_replay_bit_for_bit() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    eng.set_policy(Policy {
        lt_split_k: true,
        ..Policy::default()
    });
    let mut rng = HostRng::new(110);
    let (n, t) = (Trans::N, Trans::T);
    let op = plain_op;
    let forward = [
        op(n, t, 512, 1024, 256, Epilogue::Bias),
        op(n, t, 128, 4096, 256, Epilogue::Bias),
    ];
    let backward = [
        // dX = dY·W and dW = dYᵀ·X of the first layer.
        op(n, n, 512, 256, 1024, Epilogue::None),
        op(t, n, 1024, 256, 512, Epilogue::None),
        // Odd sizes, alpha and beta, ReLU.
        GemmOp {
            alpha: 0.5,
            beta: 0.25,
            ..op(n, t, 5, 77, 1023, Epilogue::BiasRelu)
        },
    ];
    let mut variants_seen = 0;
    for (i, op) in forward.iter().chain(&backward).enumerate() {
        let algos: Vec<GemmEngine> = lt_algos(&dev, &s, op)
            .into_iter()
            .filter(is_split_k)
            .collect();
        println!("{}: {algos:?}", op.key());
        if i < forward.len() {
            assert!(
                !algos.is_empty(),
                "no split-K variant for the under-occupied {}",
                op.key()
            );
        }
        variants_seen += algos.len();
        let o = Operands::new(&s, &mut rng, op);
        let Operands { c0, a, b, bb, .. } = o;
        let v = (op.epilogue != Epilogue::None).then_some(&bb);
        let run = |q: &dyn Queue, algo: GemmEngine, c: &DeviceBuffer<f32>| {
            gemm_with(q, &nn, algo, op, &a, &b, c, v)
        };
        let first = s.alloc_from_host(&c0).unwrap();
        run(&s, GemmEngine::CublasLt(0), &first).unwrap();
        let want = to_f64(&s.to_vec(&first).unwrap());
        for algo in algos {
            // Deterministic too: the registry admits it under the default policy.
            agrees_repeats_and_replays(&mut s, &run, algo, op, &c0, &want, "cublaslt:0");
        }
        // A variant the plan did not keep: an error naming it, nothing launched.
        let absent = GemmEngine::CublasLtSplitK {
            rank: 200,
            split: 2,
        };
        let c = s.alloc_from_host(&c0).unwrap();
        let e = run(&s, absent, &c).unwrap_err().to_string();
        assert!(e.contains("200/sk2"), "{e}");
        assert_eq!(s.to_vec(&c).unwrap(), c0, "{absent} wrote its output");
    }
    assert!(variants_seen > 0);
    // The registry measures them with cuBLASLt's other candidates (the family cuBLASLt forces).
    eng.clear();
    let fw = forward[0];
    let (a, b, c, bias) = (
        s.alloc_from_host(&data(&mut rng, fw.m * fw.k)).unwrap(),
        s.alloc_from_host(&data(&mut rng, fw.k * fw.n)).unwrap(),
        s.alloc_zeroed::<f32>(fw.m * fw.n).unwrap(),
        s.alloc_from_host(&data(&mut rng, fw.n)).unwrap(),
    );
    let chosen = run_gemm(&s, &nn, GemmFamily::CublasLt, &fw, &a, &b, &c, Some(&bias)).unwrap();
    assert_eq!(chosen.family(), GemmFamily::CublasLt);
    let key = format!("{} [cublaslt,+splitk]", fw.key());
    let e = eng.entry(&key).expect("the product is recorded");
    let timed: Vec<_> = e
        .timings
        .iter()
        .filter(|t| t.engine.contains("/sk"))
        .collect();
    assert!(!timed.is_empty(), "{e:?}");
    assert!(
        timed.iter().all(|t| t.us.is_some() && t.error.is_none()),
        "{e:?}"
    );
    println!(
        "{key} -> {}: {}",
        e.engine,
        e.timings
            .iter()
            .map(|t| format!("{} {:.2}", t.engine, t.us.unwrap_or(f64::NAN)))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

/// cuBLASLt's searched configurations (`Policy::lt_search`): for the sweep's forward products
/// and odd backward layouts, every configuration the search kept agrees with the f64
/// reference, gives the same bits run to run and in a graph replay as eagerly, and one the
/// plan did not keep is an error that writes nothing; the registry measures them among
/// cuBLASLt's candidates without failures (each key's timings are printed, to see whether a
/// configuration beat `cublaslt:0`), and the 512 × 256 → 1024 forward product has at least one.
#[test]
fn cublaslt_search_configs_agree_and_replay_bit_for_bit() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    let policy = Policy {
        lt_search: true,
        ..Policy::default()
    };
    eng.set_policy(policy);
    let lt = eng
        .cublaslt()
        .expect("cuBLASLt must be installed on the GPU test machine");
    let mut rng = HostRng::new(111);
    let (n, t) = (Trans::N, Trans::T);
    let op = plain_op;
    let ops = [
        op(n, t, 512, 1024, 256, Epilogue::Bias),
        op(n, t, 128, 4096, 256, Epilogue::Bias),
        GemmOp {
            alpha: 0.5,
            beta: 0.25,
            ..op(n, n, 5, 77, 259, Epilogue::None)
        },
        op(t, n, 5, 77, 259, Epilogue::None),
    ];
    for (i, op) in ops.iter().enumerate() {
        let configs: Vec<GemmEngine> = gemm_candidates(&s, &eng, op, GemmFamily::CublasLt, 256)
            .unwrap()
            .into_iter()
            .filter(|a| matches!(a, GemmEngine::CublasLtConfig(_)))
            .collect();
        let shape = cudagraph_nn::ffi::blaslt::LtShape {
            ta: op.ta,
            tb: op.tb,
            m: op.m,
            n: op.n,
            k: op.k,
            epilogue: op.epilogue,
            align: 256,
        };
        let kept = lt.search_configs(&shape).unwrap();
        println!("{}: {} configurations: {kept:?}", op.key(), configs.len());
        assert_eq!(kept.len(), configs.len(), "{}", op.key());
        if i == 0 {
            assert!(
                !configs.is_empty(),
                "no searched configuration for {}",
                op.key()
            );
        }
        let o = Operands::new(&s, &mut rng, op);
        let want = o.want(op);
        let Operands { c0, a, b, bb, .. } = o;
        let v = (op.epilogue != Epilogue::None).then_some(&bb);
        let run = |q: &dyn Queue, algo: GemmEngine, c: &DeviceBuffer<f32>| {
            gemm_with(q, &nn, algo, op, &a, &b, c, v)
        };
        for algo in configs {
            agrees_repeats_and_replays(&mut s, &run, algo, op, &c0, &want, "f64");
        }
        // A configuration the plan did not keep: an error naming it, nothing launched.
        let absent = GemmEngine::CublasLtConfig(200);
        let c = s.alloc_from_host(&c0).unwrap();
        let e = run(&s, absent, &c).unwrap_err().to_string();
        assert!(e.contains("c200"), "{e}");
        assert_eq!(s.to_vec(&c).unwrap(), c0, "{absent} wrote its output");
    }
    // The registry measures them with cuBLASLt's other candidates (the family cuBLASLt forces).
    eng.clear();
    for op in &ops {
        let (a, b, c, bias) = (
            s.alloc_from_host(&data(&mut rng, op.m * op.k)).unwrap(),
            s.alloc_from_host(&data(&mut rng, op.k * op.n)).unwrap(),
            s.alloc_zeroed::<f32>(op.m * op.n).unwrap(),
            s.alloc_from_host(&data(&mut rng, op.n)).unwrap(),
        );
        let v = (op.epilogue != Epilogue::None).then_some(&bias);
        let chosen = run_gemm(&s, &nn, GemmFamily::CublasLt, op, &a, &b, &c, v).unwrap();
        assert_eq!(chosen.family(), GemmFamily::CublasLt);
        let key = format!("{} [cublaslt,+search]", op.key());
        let e = eng.entry(&key).expect("the product is recorded");
        let searched: Vec<_> = e
            .timings
            .iter()
            .filter(|t| t.engine.starts_with("cublaslt:c"))
            .collect();
        assert!(
            searched.iter().all(|t| t.us.is_some() && t.error.is_none()),
            "{e:?}"
        );
        let configs = searched.len();
        println!(
            "{key} -> {} ({configs} searched): {}",
            e.engine,
            e.timings
                .iter()
                .map(|t| format!("{} {:.2}", t.engine, t.us.unwrap_or(f64::NAN)))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    eng.set_policy(Policy::default());
}

#[test]
fn bias_gradient_engines_match_cpu() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    eng.set_policy(Policy {
        lt_split_k: true,
        ..Policy::default()
    });
    let mut rng = HostRng::new(102);
    // Linear layer sizes (batch, out, in): dW[out×in] = dZᵀ·X, db = Σ_rows dZ.
    for &(batch, out, inf) in &[
        (1usize, 1usize, 1usize),
        (5, 7, 3),
        (64, 131, 97),
        (257, 64, 1024),
        // Few output tiles, so cuBLASLt's split-K variants are checked too: odd sizes with a
        // K (the batch) of 259, and the weight gradient of the 512 × 256 → 1024 layer.
        (259, 77, 5),
        (512, 1024, 256),
    ] {
        let op = GemmOp {
            ta: Trans::T,
            tb: Trans::N,
            m: out,
            n: inf,
            k: batch,
            alpha: 1.0,
            beta: 0.0,
            epilogue: Epilogue::BiasGrad,
        };
        let (dzh, xh) = (data(&mut rng, batch * out), data(&mut rng, batch * inf));
        let wh = vec![0.0f64; out * inf];
        let (_, dw_want, db_want) =
            cpu::linear_backward(&to_f64(&xh), &wh, &to_f64(&dzh), batch, inf, out);
        let (dz, x) = (
            s.alloc_from_host(&dzh).unwrap(),
            s.alloc_from_host(&xh).unwrap(),
        );
        let mut algos = vec![
            GemmEngine::Cublas,
            GemmEngine::Tiled(1),
            GemmEngine::Tiled(3),
            GemmEngine::Cluster(4),
        ];
        algos.extend(REG_ALGOS);
        algos.extend(lt_algos(&dev, &s, &op));
        // And whatever else the registry would choose from for this product.
        let (dw, db) = (
            s.alloc::<f32>(out * inf).unwrap(),
            s.alloc::<f32>(out).unwrap(),
        );
        add_registry_candidates(&s, &eng, &op, &[&dz, &x, &dw, &db], &mut algos);
        for algo in algos {
            let dw = s.alloc_from_host(&vec![f32::NAN; out * inf]).unwrap();
            let db = s.alloc_from_host(&vec![f32::NAN; out]).unwrap();
            gemm_with(&s, &nn, algo, &op, &dz, &x, &dw, Some(&db))
                .unwrap_or_else(|e| panic!("{algo} {}: {e}", op.key()));
            let (gw, gb) = (s.to_vec(&dw).unwrap(), s.to_vec(&db).unwrap());
            assert!(
                rel_err(&gw, &dw_want) < tol(batch),
                "{algo} dW {}",
                op.key()
            );
            assert!(
                rel_err(&gb, &db_want) < tol(batch),
                "{algo} db {}",
                op.key()
            );
        }
    }
}

/// A Linear(+ReLU) layer forward and backward against the CPU.
fn check_linear(
    s: &Stream,
    rng: &mut HostRng,
    m: usize,
    k: usize,
    n: usize,
    relu: bool,
    what: &str,
) {
    let l = Linear::new(s, k, n, rng).unwrap();
    let xh = data(rng, m * k);
    let xp = Parameter::from_host(s, "x", &xh, &[m, k]).unwrap();
    let y = l.forward_act(s, &xp.tensor(), relu).unwrap();
    let (wh, bh) = (
        to_f64(&s.to_vec(l.weight.data().unwrap()).unwrap()),
        to_f64(&s.to_vec(l.bias.data().unwrap()).unwrap()),
    );
    let mut want = cpu::linear(&to_f64(&xh), &wh, &bh, m, k, n);
    if relu {
        want = cpu::relu(&want);
    }
    let got = y.to_vec(s).unwrap();
    assert!(rel_err(&got, &want) < tol(k), "{what} y {m}x{k}x{n}");
    let th = data(rng, m * n);
    let t = Tensor::from_host(s, &th, &[m, n]).unwrap();
    mse_loss(s, &y, &t, Reduction::Sum)
        .unwrap()
        .backward(s)
        .unwrap();
    let dy: Vec<f64> = cpu::mse_grad(&want, &to_f64(&th), false)
        .iter()
        .zip(&want)
        .map(|(g, y)| if relu && *y <= 0.0 { 0.0 } else { *g })
        .collect();
    let (dx, dw, db) = cpu::linear_backward(&to_f64(&xh), &wh, &dy, m, k, n);
    for (name, got, want, depth) in [
        ("dX", grad(&xp, s), dx, n),
        ("dW", grad(&l.weight, s), dw, m),
        ("db", grad(&l.bias, s), db, m),
    ] {
        let err = rel_err(&got, &want);
        assert!(
            err < tol(depth).max(2e-5),
            "{what} {name} {m}x{k}x{n}: {err}"
        );
    }
}

#[test]
fn linear_layers_match_cpu_under_every_gemm_policy() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(103);
    for family in [
        GemmFamily::Cublas,
        GemmFamily::CublasLt,
        GemmFamily::Tiled,
        GemmFamily::WarpK,
        GemmFamily::Rows,
        GemmFamily::Auto,
    ] {
        set_policy(&dev, |p| p.gemm = family);
        for &(m, k, n, relu) in &[
            (1usize, 256usize, 10usize, true),
            (5, 33, 7, false),
            (64, 1024, 512, true),
            (200, 97, 131, true),
            (11, 132, 9, true),
        ] {
            check_linear(&s, &mut rng, m, k, n, relu, family.name());
        }
    }
    // Every product the layers ran is in the table under its family's scope.
    let t = engines(&dev).table();
    for family in ["cublas", "cublaslt", "tiled"] {
        let rows: Vec<_> = t
            .iter()
            .filter(|r| r.key.ends_with(&format!(" [{family}]")))
            .collect();
        assert!(!rows.is_empty(), "no {family} rows");
        for r in rows {
            let algo: GemmEngine = r.entry.engine.parse().unwrap();
            assert_eq!(
                algo.family().name(),
                family,
                "{} -> {}",
                r.key,
                r.entry.engine
            );
        }
    }
}

fn geometries() -> Vec<ConvGeom> {
    let g = |n, c, h, w, oc, k, stride, pad| ConvGeom {
        n,
        c,
        h,
        w,
        oc,
        kh: k,
        kw: k,
        stride,
        pad,
    };
    vec![
        g(1, 1, 8, 8, 1, 1, 1, 0),     // 1×1, one channel
        g(2, 3, 11, 13, 5, 3, 2, 1),   // odd sizes, stride 2 + padding
        g(3, 7, 9, 9, 4, 7, 1, 1),     // 7×7
        g(1, 16, 17, 17, 33, 5, 2, 0), // 5×5 stride 2, prime channels
        g(2, 64, 8, 8, 128, 3, 1, 1),  // wide
        g(4, 128, 7, 7, 64, 1, 1, 0),  // 1×1, many channels
        g(2, 3, 32, 32, 8, 7, 2, 1),   // 7×7 stride 2 on a larger image
        g(2, 3, 64, 64, 4, 3, 1, 1),   // few channels, long K: a deep-split candidate
        g(3, 1, 12, 12, 6, 5, 1, 0),   // one channel 5×5: the direct kernel's 5×5 twin
        g(2, 2, 9, 9, 3, 4, 1, 1),     // 4×4 over 2 channels (32 taps): its general form
    ]
}

fn cpu_conv(g: &ConvGeom) -> cpu::Conv {
    assert_eq!(g.kh, g.kw);
    cpu::Conv {
        n: g.n,
        c: g.c,
        h: g.h,
        w: g.w,
        oc: g.oc,
        k: g.kh,
        stride: g.stride,
        pad: g.pad,
    }
}

/// The bound on a convolution engine's error against the f64 reference: 1e-4 for ours; 1e-3
/// for cuDNN's, some of whose plain-fp32 engines round further from the direct sum (Winograd
/// and FFT forms; on the H100, over one input channel with 5×5 taps: `cudnn:7`
/// forward 2.2e-4, `cudnnv8:4` weight gradient 2.3e-4, the latter with no transform note).
fn conv_bound(algo: ConvEngine) -> f64 {
    match algo {
        ConvEngine::Cudnn(_) | ConvEngine::CudnnGraph(_) | ConvEngine::CudnnGraphBias(_) => 1e-3,
        _ => 1e-4,
    }
}

#[test]
fn every_conv_engine_matches_cpu_forward_and_backward() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    assert!(
        eng.cudnn().is_some(),
        "cuDNN must be installed on the GPU test machine"
    );
    // Every algorithm cuDNN offers, deterministic or not.
    let policy = Policy {
        deterministic: false,
        ..Policy::default()
    };
    let mut rng = HostRng::new(104);
    let mut seen_cudnn = 0;
    for g in geometries() {
        let cv = cpu_conv(&g);
        let (xl, wl, yl) = (
            g.input_len().unwrap(),
            g.weight_len().unwrap(),
            g.output_len().unwrap(),
        );
        let (xh, wh, bh, dyh) = (
            data(&mut rng, xl),
            data(&mut rng, wl),
            data(&mut rng, g.oc),
            data(&mut rng, yl),
        );
        let y_want = cv.forward(&to_f64(&xh), &to_f64(&wh), &to_f64(&bh));
        let (dx_want, dw_want, _) = cv.backward(&to_f64(&xh), &to_f64(&wh), &to_f64(&dyh));
        let (x, w, b, dy) = (
            s.alloc_from_host(&xh).unwrap(),
            s.alloc_from_host(&wh).unwrap(),
            s.alloc_from_host(&bh).unwrap(),
            s.alloc_from_host(&dyh).unwrap(),
        );
        for dir in ConvDir::ALL {
            let cands =
                conv_candidates(&s, &eng, dir, &g, dir == ConvDir::Forward, &policy).unwrap();
            assert!(
                cands.iter().any(|a| matches!(a, ConvEngine::Cudnn(_))),
                "no cuDNN algorithm for {}",
                conv_key(dir, &g, false)
            );
            // Our kernels also with forced splits (covers the reduce kernel everywhere, and
            // more splits than K steps allow, which the launch trims).
            let mut all = cands.clone();
            for t in cudagraph_nn::engine::conv::Tile::ALL {
                all.push(ConvEngine::Igemm(t, 3));
                all.push(ConvEngine::Igemm(t, 200));
            }
            // The small weight-gradient kernel in one block (writing dw itself), in a few, and
            // in more blocks than 32-pixel tiles (the launch trims empty ones).
            if dir == ConvDir::BackwardFilter && igemm::wgrad_small_supports(&g) {
                all.extend([1, 3, 1000].map(ConvEngine::Wgrad));
            }
            for algo in all {
                seen_cudnn += matches!(algo, ConvEngine::Cudnn(_)) as usize;
                let (out_len, want, io_a, io_b) = match dir {
                    ConvDir::Forward => (yl, &y_want, &x, &w),
                    ConvDir::BackwardData => (xl, &dx_want, &dy, &w),
                    ConvDir::BackwardFilter => (wl, &dw_want, &dy, &x),
                };
                let out = s.alloc_from_host(&vec![f32::NAN; out_len]).unwrap();
                let io = ConvIo {
                    a: io_a,
                    b: io_b,
                    out: &out,
                    bias: (dir == ConvDir::Forward).then_some(&b),
                };
                conv_with(&s, &nn, algo, dir, &g, io)
                    .unwrap_or_else(|e| panic!("{algo} {}: {e}", conv_key(dir, &g, true)));
                let got = s.to_vec(&out).unwrap();
                let err = rel_err(&got, want);
                assert!(
                    err < conv_bound(algo),
                    "{algo} {}: {err}",
                    conv_key(dir, &g, true)
                );
            }
        }
    }
    assert!(seen_cudnn >= 3 * geometries().len());
    // The long-K geometry offered a deep split for its weight gradient, and it was checked.
    let long_k = geometries()
        .into_iter()
        .find(|g| (g.n, g.c, g.h, g.oc, g.kh) == (2, 3, 64, 4, 3))
        .expect("the long-K geometry is listed");
    let cands =
        conv_candidates(&s, &eng, ConvDir::BackwardFilter, &long_k, false, &policy).unwrap();
    let sms = dev.info().multiprocessors;
    assert!(
        cands.iter().any(|a| matches!(a, ConvEngine::Igemm(t, n)
            if Some(*n as usize) == igemm::deep_splits(
                ConvDir::BackwardFilter, &long_k, *t, sms))),
        "{cands:?}"
    );
    // Few channels: the small weight-gradient kernel is a candidate too.
    assert!(
        cands.iter().any(|a| matches!(a, ConvEngine::Wgrad(_))),
        "{cands:?}"
    );
}

/// The two ways a bias is added after cuDNN's convolution (our `bias_planes`, float4 and
/// scalar forms, and `cudnnAddTensor`) give exactly the f32 sums, and a cuDNN forward with a
/// bias records the measured choice for its output shape.
#[test]
fn conv_bias_engines_add_exactly() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    let cudnn = eng
        .cudnn()
        .expect("cuDNN must be installed on the GPU test machine");
    let g = |n, c, h, oc, k| ConvGeom {
        n,
        c,
        h,
        w: h,
        oc,
        kh: k,
        kw: k,
        stride: 1,
        pad: 0,
    };
    let mut rng = HostRng::new(107);
    // Output planes of 6×6 (a multiple of 4: float4), 5×5 and 1×1 (scalar).
    for geom in [g(3, 2, 8, 7, 3), g(2, 3, 7, 5, 3), g(5, 1, 1, 9, 1)] {
        let yl = geom.output_len().unwrap();
        let (oh, ow) = geom.out_hw().unwrap();
        let (yh, bh) = (data(&mut rng, yl), data(&mut rng, geom.oc));
        let want: Vec<f32> = (0..yl)
            .map(|i| yh[i] + bh[(i / (oh * ow)) % geom.oc])
            .collect();
        let b = s.alloc_from_host(&bh).unwrap();
        let ours = s.alloc_from_host(&yh).unwrap();
        nn.bias_planes(&s, &ours, &b, geom.n, geom.oc, oh * ow)
            .unwrap();
        let lib = s.alloc_from_host(&yh).unwrap();
        cudnn.add_bias(&s, &geom, &b, &lib).unwrap();
        assert_eq!(s.to_vec(&ours).unwrap(), want, "bias_planes {geom:?}");
        assert_eq!(s.to_vec(&lib).unwrap(), want, "cudnnAddTensor {geom:?}");
        // Too short a bias or output is a typed error, not a launch.
        assert!(nn
            .bias_planes(&s, &ours, &b, geom.n + 1, geom.oc, oh * ow)
            .is_err());
        if geom.oc > 1 {
            let short = s.alloc_from_host(&bh[..geom.oc - 1]).unwrap();
            assert!(cudnn.add_bias(&s, &geom, &short, &lib).is_err());
        }
        // Through a cuDNN forward: the output equals the CPU's, and the choice is recorded.
        let (xh, wh) = (
            data(&mut rng, geom.input_len().unwrap()),
            data(&mut rng, geom.weight_len().unwrap()),
        );
        let y_want = cpu_conv(&geom).forward(&to_f64(&xh), &to_f64(&wh), &to_f64(&bh));
        let (x, w) = (
            s.alloc_from_host(&xh).unwrap(),
            s.alloc_from_host(&wh).unwrap(),
        );
        let y = s.alloc_from_host(&vec![f32::NAN; yl]).unwrap();
        let io = ConvIo {
            a: &x,
            b: &w,
            out: &y,
            bias: Some(&b),
        };
        conv_with(&s, &nn, ConvEngine::Cudnn(0), ConvDir::Forward, &geom, io).unwrap();
        let err = rel_err(&s.to_vec(&y).unwrap(), &y_want);
        assert!(err < 1e-5, "{geom:?}: {err}");
        let key = cudagraph_nn::engine::conv::conv_bias_key(&geom).unwrap();
        let entry = eng.entry(&key).expect("the bias choice is recorded");
        assert!(entry.measured, "{key}: {entry:?}");
        assert!(
            ["bias:planes", "bias:cudnn"].contains(&entry.engine.as_str()),
            "{key}: {entry:?}"
        );
    }
}

/// conv2d (with bias) forward and backward through autograd, against the CPU.
fn check_conv_op(s: &Stream, rng: &mut HostRng, g: &ConvGeom, what: &str) {
    let cv = cpu_conv(g);
    let xh = data(rng, g.input_len().unwrap());
    let xp = Parameter::from_host(s, "x", &xh, &[g.n, g.c, g.h, g.w]).unwrap();
    let layer = Conv2d::new(s, g.c, g.oc, g.kh, g.stride, g.pad, rng).unwrap();
    let y = layer.forward(s, &xp.tensor()).unwrap();
    let (wh, bh) = (
        to_f64(&s.to_vec(layer.weight.data().unwrap()).unwrap()),
        to_f64(&s.to_vec(layer.bias.data().unwrap()).unwrap()),
    );
    let want = cv.forward(&to_f64(&xh), &wh, &bh);
    assert!(
        rel_err(&y.to_vec(s).unwrap(), &want) < 1e-4,
        "{what} y {g:?}"
    );
    let th = data(rng, want.len());
    let t = Tensor::from_host(s, &th, y.shape()).unwrap();
    mse_loss(s, &y, &t, Reduction::Sum)
        .unwrap()
        .backward(s)
        .unwrap();
    let dy = cpu::mse_grad(&want, &to_f64(&th), false);
    let (dx, dw, db) = cv.backward(&to_f64(&xh), &wh, &dy);
    for (name, got, want) in [
        ("dx", grad(&xp, s), dx),
        ("dw", grad(&layer.weight, s), dw),
        ("db", grad(&layer.bias, s), db),
    ] {
        let err = rel_err(&got, &want);
        assert!(err < 1e-4, "{what} {name} {g:?}: {err}");
    }
}

#[test]
fn conv2d_matches_cpu_under_every_conv_policy() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(105);
    for family in [
        ConvFamily::Cudnn,
        ConvFamily::Ours,
        ConvFamily::Igemm,
        ConvFamily::Direct,
        ConvFamily::Auto,
    ] {
        set_policy(&dev, |p| p.conv = family);
        for g in geometries().iter().take(5) {
            check_conv_op(&s, &mut rng, g, family.name());
        }
    }
    // The forced families show in the table with engines of that family only; every row
    // parses as its operation's engine.
    for r in engines(&dev).table() {
        let Some(e) = conv_engine_of(&r) else {
            continue; // a product, a bias or a cross-entropy: parsed, not a convolution
        };
        for family in [
            ConvFamily::Cudnn,
            ConvFamily::Ours,
            ConvFamily::Igemm,
            ConvFamily::Direct,
        ] {
            if r.key.ends_with(&format!(" [{}]", family.name())) {
                assert!(family.allows(e), "{} -> {e}", r.key);
            }
        }
    }
}

/// The convolution engine of a table row, `None` for a row of another operation. Every row's
/// engine, and the engine of each of its timings, must parse as its operation's kind (told by
/// the key: `gemm `, `conv_bias `, `conv_` — with a 16-bit type after it, a half-precision
/// convolution —, `cross_entropy `); anything else fails the test.
fn conv_engine_of(r: &EngineRow) -> Option<ConvEngine> {
    fn parses<A: std::str::FromStr>(key: &str, name: &str, what: &str)
    where
        A::Err: std::fmt::Display,
    {
        if let Err(e) = name.parse::<A>() {
            panic!("table row `{key}`: {what} `{name}` does not parse: {e}");
        }
    }
    let key = r.key.as_str();
    let names = std::iter::once((r.entry.engine.as_str(), "engine")).chain(
        r.entry
            .timings
            .iter()
            .map(|t| (t.engine.as_str(), "timed candidate")),
    );
    for (name, what) in names {
        if key.starts_with("gemm ") {
            parses::<GemmEngine>(key, name, what);
        } else if key.starts_with("conv_bias ") {
            parses::<BiasEngine>(key, name, what);
        } else if key.starts_with("conv_") && matches!(key.split(' ').nth(1), Some("bf16" | "f16"))
        {
            // A half-precision convolution (engine::conv_lowp): layout and engine kind.
            parses::<cudagraph_nn::engine::conv_lowp::LowpEngine>(key, name, what);
        } else if key.starts_with("conv_") {
            parses::<ConvEngine>(key, name, what);
        } else if key.starts_with("cross_entropy ") {
            parses::<CeEngine>(key, name, what);
        } else {
            panic!("table row `{key}` -> `{name}`: a key of no known operation");
        }
    }
    let lowp = matches!(key.split(' ').nth(1), Some("bf16" | "f16"));
    let conv = key.starts_with("conv_") && !key.starts_with("conv_bias ") && !lowp;
    conv.then(|| r.entry.engine.parse().expect("parsed above"))
}

/// A small CNN + MLP: conv(3→8, 3×3, pad 1) → ReLU → conv(8→16, 5×5, stride 2) → flatten →
/// Linear(+ReLU) → Linear, with an MSE loss. Returns the loss and the model.
fn cnn(s: &Stream, rng: &mut HostRng) -> Sequential {
    Sequential::new(vec![
        Layer::Conv2d(Conv2d::new(s, 3, 8, 3, 1, 1, rng).unwrap()),
        Layer::ReLU,
        Layer::Conv2d(Conv2d::new(s, 8, 16, 5, 2, 0, rng).unwrap()),
        Layer::Flatten,
        Layer::Linear(Linear::new(s, 16 * 6 * 6, 33, rng).unwrap()),
        Layer::ReLU,
        Layer::Linear(Linear::new(s, 33, 10, rng).unwrap()),
    ])
}

fn step(q: &dyn Queue, model: &Sequential, x: &Tensor, t: &Tensor) -> Result<(Tensor, Tensor)> {
    for p in model.parameters() {
        p.zero_grad(q, true)?;
    }
    let y = model.forward(q, x)?;
    let loss = mse_loss(q, &y, t, Reduction::Mean)?;
    loss.backward(q)?;
    Ok((loss, y))
}

/// Runs the CNN step eagerly, then captured and replayed, and compares everything bit for bit.
fn replay_equals_eager(dev: &Device, what: &str) {
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(106);
    let model = cnn(&s, &mut rng);
    let x = Tensor::from_host(&s, &data(&mut rng, 4 * 3 * 15 * 15), &[4, 3, 15, 15]).unwrap();
    let t = Tensor::from_host(&s, &data(&mut rng, 4 * 10), &[4, 10]).unwrap();
    // Eager first: measures every engine (the warm-up a user does before capturing).
    let (loss, y) = step(&s, &model, &x, &t).unwrap();
    let eager: Vec<Vec<f32>> = std::iter::once(loss.to_vec(&s).unwrap())
        .chain(std::iter::once(y.to_vec(&s).unwrap()))
        .chain(model.parameters().iter().map(|p| grad(p, &s)))
        .collect();
    let (graph, (gl, gy)) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        Ok(step(cs, &model, &x, &t)?)
    })
    .unwrap();
    for _ in 0..2 {
        graph.replay(&s).unwrap();
    }
    let replayed: Vec<Vec<f32>> = std::iter::once(gl.to_vec(&s).unwrap())
        .chain(std::iter::once(gy.to_vec(&s).unwrap()))
        .chain(model.parameters().iter().map(|p| grad(p, &s)))
        .collect();
    assert_eq!(eager.len(), replayed.len(), "{what}");
    for (i, (a, b)) in eager.iter().zip(&replayed).enumerate() {
        assert_bits_eq(b, a, format_args!("{what}: output {i}, replay vs eager"));
    }
    // Nothing was left unmeasured: the capture used the eager choices; and every row parses.
    for r in engines(dev).table() {
        assert!(r.entry.measured, "{what}: {} unmeasured", r.key);
        conv_engine_of(&r);
    }
}

#[test]
fn graph_replay_equals_eager_bit_for_bit_with_the_same_engines() {
    let dev = gpu_test_device!();
    engines(&dev).clear();
    replay_equals_eager(&dev, "auto");
    set_policy(&dev, |p| {
        p.conv = ConvFamily::Cudnn;
        p.gemm = GemmFamily::CublasLt;
    });
    replay_equals_eager(&dev, "cudnn+cublaslt");
    set_policy(&dev, |p| {
        p.conv = ConvFamily::Igemm;
        p.gemm = GemmFamily::Tiled;
    });
    replay_equals_eager(&dev, "igemm+tiled");
    set_policy(&dev, |p| {
        p.conv = ConvFamily::Ours;
        p.gemm = GemmFamily::Rows;
    });
    replay_equals_eager(&dev, "ours+rows");
}

#[test]
fn fallback_without_cudnn_and_cublaslt_runs_everything() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(107);
    engines(&dev).clear(); // choices loaded from disk may name the libraries
                           // Libraries "missing", our kernels forced (CUDAGRAPH_CONV=ours).
    set_policy(&dev, |p| {
        p.cudnn = false;
        p.cublaslt = false;
        p.conv = ConvFamily::Ours;
    });
    let eng = engines(&dev);
    assert!(eng.cudnn().is_none() && eng.cublaslt().is_none());
    for g in geometries().iter().take(4) {
        check_conv_op(&s, &mut rng, g, "fallback");
    }
    check_linear(&s, &mut rng, 33, 70, 65, true, "fallback");
    replay_equals_eager(&dev, "fallback");
    // cuDNN forced while "missing": falls back to our kernels instead of failing.
    set_policy(&dev, |p| {
        p.cudnn = false;
        p.cublaslt = false;
        p.conv = ConvFamily::Cudnn;
        p.gemm = GemmFamily::CublasLt;
    });
    check_conv_op(&s, &mut rng, &geometries()[1], "forced cudnn, missing");
    check_linear(&s, &mut rng, 7, 13, 31, false, "forced cublaslt, missing");
    for r in eng.table() {
        assert!(
            !r.entry.engine.starts_with("cudnn") && !r.entry.engine.starts_with("cublaslt"),
            "{} -> {} without the libraries",
            r.key,
            r.entry.engine
        );
    }
}

#[test]
fn registry_keeps_capture_choices_unmeasured_and_measures_eagerly() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let eng = engines(&dev);
    eng.clear();
    eng.set_policy(Policy::default()); // whatever CUDAGRAPH_GEMM/CONV say
    let mut rng = HostRng::new(108);
    let l = Linear::new(&s, 61, 29, &mut rng).unwrap();
    let x = Tensor::from_host(&s, &data(&mut rng, 19 * 61), &[19, 61]).unwrap();
    let key = "gemm NT m=19 n=29 k=61 a=1 b=0 ep=bias_relu";
    let (g, y) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        Ok(no_grad(|| l.forward_act(cs, &x, true))?)
    })
    .unwrap();
    let e = eng.entry(key).expect("captured product recorded");
    assert!(!e.measured && e.timings.is_empty(), "{e:?}");
    // The heuristic default (former GemmFamily::Auto table: split-K tiled at m = 19; one split
    // here); cuBLASLt was not opened inside the capture.
    assert_eq!(e.engine, "tiled:1");
    g.replay(&s).unwrap();
    let y_graph = y.to_vec(&s).unwrap();
    // Eager keeps the capture's choice (same engine, same bits) ...
    let y_same = no_grad(|| l.forward_act(&s, &x, true)).unwrap();
    assert!(!eng.entry(key).unwrap().measured);
    let same = y_same.to_vec(&s).unwrap();
    assert_bits_eq(&same, &y_graph, "eager after the capture vs replay");
    // ... until the choices are forgotten: then eager measures every candidate.
    eng.clear();
    let y_eager = no_grad(|| l.forward_act(&s, &x, true)).unwrap();
    let e = eng.entry(key).unwrap();
    assert!(e.measured, "{e:?}");
    assert!(e.timings.len() >= 3, "{e:?}"); // cuBLAS, tiled, cuBLASLt at least
    assert!(
        e.timings.iter().all(|t| t.us.is_some_and(|us| us > 0.0)),
        "{e:?}"
    );
    let best = e
        .timings
        .iter()
        .min_by(|a, b| a.us.unwrap().total_cmp(&b.us.unwrap()))
        .unwrap();
    assert_eq!(best.engine, e.engine);
    // Both runs agree with the CPU (different engines may have run them).
    let wh = to_f64(&s.to_vec(l.weight.data().unwrap()).unwrap());
    let bh = to_f64(&s.to_vec(l.bias.data().unwrap()).unwrap());
    let xh = to_f64(&x.to_vec(&s).unwrap());
    let want = cpu::relu(&cpu::linear(&xh, &wh, &bh, 19, 61, 29));
    assert!(rel_err(&y_graph, &want) < 2e-5);
    assert!(rel_err(&y_eager.to_vec(&s).unwrap(), &want) < 2e-5);
    // The same for a convolution direction, and the table text shows both.
    let gm = geometries()[1];
    let key = conv_key(ConvDir::Forward, &gm, true);
    let conv = Conv2d::new(&s, gm.c, gm.oc, gm.kh, gm.stride, gm.pad, &mut rng).unwrap();
    let xc = Tensor::from_host(
        &s,
        &data(&mut rng, gm.input_len().unwrap()),
        &[gm.n, gm.c, gm.h, gm.w],
    )
    .unwrap();
    no_grad(|| conv.forward(&s, &xc)).unwrap();
    let e = eng.entry(&key).expect("conv recorded");
    assert!(e.measured && e.timings.len() >= 4, "{e:?}");
    let text = cudagraph_nn::engine::format_table(&eng.table());
    assert!(
        text.contains(&key) && text.contains(&format!("-> {}", e.engine)),
        "{text}"
    );
    println!("{text}");
}

/// Row-major `A·B` (m×k by k×n) in f64, on every host core (the 1024³ reference of the TF32
/// test: about 10⁹ multiply-adds).
fn matmul_f64(ah: &[f32], bh: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    let bt: Vec<f64> = (0..n * k).map(|e| bh[(e % k) * n + e / k] as f64).collect();
    let mut out = vec![0.0f64; m * n];
    let threads = std::thread::available_parallelism().map_or(4, |t| t.get());
    let rows = m.div_ceil(threads).max(1);
    std::thread::scope(|sc| {
        for (chunk, o) in out.chunks_mut(rows * n).enumerate() {
            let bt = &bt;
            sc.spawn(move || {
                for (r, orow) in o.chunks_mut(n).enumerate() {
                    let i = chunk * rows + r;
                    let arow: Vec<f64> = ah[i * k..(i + 1) * k].iter().map(|&v| v as f64).collect();
                    for (j, v) in orow.iter_mut().enumerate() {
                        let bcol = &bt[j * k..(j + 1) * k];
                        *v = arow.iter().zip(bcol).map(|(x, y)| x * y).sum();
                    }
                }
            });
        }
    });
    out
}

/// The TF32 switches ([`Policy::tf32_matmul`], [`Policy::tf32_conv`], PyTorch's two
/// `allow_tf32`): off, a product (through cuBLAS, cuBLASLt and the registry) and a convolution
/// (through the registry) give exactly the bits of the default policy, also after running with
/// them on (TF32 plans and choices are kept apart: the registry's keys carry `+tf32`). On, a
/// 1024×1024×1024 product through cuBLAS and through cuBLASLt agrees with the f64 reference
/// within 1e-2 relative (‖gpu − ref‖ / ‖ref‖; TF32 rounds the inputs to a 10-bit mantissa,
/// 2⁻¹¹ ≈ 5e-4 relative per input), and the convolution within 1e-2 as well; bit-identity is
/// not required with them on.
#[test]
fn tf32_switches_keep_fp32_bits_off_and_stay_close_on() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    // The default policy comes back however this test ends, so a failure here does not leave
    // TF32 on for the tests after it.
    struct Restore(std::sync::Arc<Engines>);
    impl Drop for Restore {
        fn drop(&mut self) {
            self.0.set_policy(Policy::default());
        }
    }
    let _restore = Restore(eng.clone());
    assert!(
        eng.cublaslt().is_some(),
        "cuBLASLt is expected on the GPU machine"
    );
    let mut rng = HostRng::new(281);
    // A product, forced through each library and through the registry.
    let op = plain_op(Trans::N, Trans::N, 96, 160, 544, Epilogue::None);
    let ops = Operands::new(&s, &mut rng, &op);
    let run = |algo: Option<GemmEngine>| -> Vec<f32> {
        let c = s.alloc_zeroed::<f32>(op.m * op.n).unwrap();
        match algo {
            Some(algo) => gemm_with(&s, &nn, algo, &op, &ops.a, &ops.b, &c, None).unwrap(),
            None => cudagraph_nn::engine::gemm::gemm(
                &s,
                &nn,
                GemmFamily::Auto,
                (op.ta, op.tb),
                (op.m, op.n, op.k),
                1.0,
                &ops.a,
                &ops.b,
                0.0,
                &c,
                None,
                false,
            )
            .unwrap(),
        }
        s.to_vec(&c).unwrap()
    };
    let engines_run = [
        None,
        Some(GemmEngine::Cublas),
        Some(GemmEngine::CublasLt(0)),
    ];
    // A convolution through the registry.
    let g = ConvGeom {
        n: 2,
        c: 32,
        h: 16,
        w: 16,
        oc: 64,
        kh: 3,
        kw: 3,
        stride: 1,
        pad: 1,
    };
    let (xh, wh) = (
        data(&mut rng, g.input_len().unwrap()),
        data(&mut rng, g.weight_len().unwrap()),
    );
    let (x, w) = (
        s.alloc_from_host(&xh).unwrap(),
        s.alloc_from_host(&wh).unwrap(),
    );
    let conv = || -> Vec<f32> {
        let y = s.alloc_zeroed::<f32>(g.output_len().unwrap()).unwrap();
        cudagraph_nn::engine::conv::conv2d_forward(&s, &nn, &g, &x, &w, None, &y).unwrap();
        s.to_vec(&y).unwrap()
    };

    set_policy(&dev, |_| {});
    let base: Vec<Vec<f32>> = engines_run.iter().map(|&a| run(a)).collect();
    let base_conv = conv();
    let want = ops.want(&op);
    let cv = cpu_conv(&g);
    let want_conv = cv.forward(&to_f64(&xh), &to_f64(&wh), &vec![0.0; g.oc]);

    // On: close to the reference, under keys of their own.
    set_policy(&dev, |p| {
        p.tf32_matmul = true;
        p.tf32_conv = true;
    });
    for a in engines_run {
        let err = rel_err(&run(a), &want);
        assert!(err < 1e-2, "{a:?} with TF32: {err}");
    }
    let err = rel_err(&conv(), &want_conv);
    assert!(err < 1e-2, "convolution with TF32: {err}");
    let keys: Vec<String> = eng.table().into_iter().map(|r| r.key).collect();
    assert!(
        keys.iter()
            .any(|k| k.starts_with("gemm ") && k.ends_with("[+tf32]")),
        "{keys:?}"
    );
    assert!(
        keys.iter()
            .any(|k| k.starts_with("conv_fwd ") && k.ends_with("[+tf32]")),
        "{keys:?}"
    );

    // Off again (set explicitly): the default policy's bits exactly.
    set_policy(&dev, |p| {
        p.tf32_matmul = false;
        p.tf32_conv = false;
    });
    for (&a, b) in engines_run.iter().zip(&base) {
        assert_bits_eq(&run(a), b, format_args!("{a:?}, TF32 off vs default"));
    }
    assert_bits_eq(&conv(), &base_conv, "convolution, TF32 off vs default");

    // 1024³ with TF32 on through cuBLAS and cuBLASLt: within 1e-2 of the f64 reference.
    let n = 1024;
    let (ah, bh) = (data(&mut rng, n * n), data(&mut rng, n * n));
    let want = matmul_f64(&ah, &bh, n, n, n);
    let big = plain_op(Trans::N, Trans::N, n, n, n, Epilogue::None);
    let (a, b) = (
        s.alloc_from_host(&ah).unwrap(),
        s.alloc_from_host(&bh).unwrap(),
    );
    set_policy(&dev, |p| p.tf32_matmul = true);
    for algo in [GemmEngine::Cublas, GemmEngine::CublasLt(0)] {
        let c = s.alloc_zeroed::<f32>(n * n).unwrap();
        gemm_with(&s, &nn, algo, &big, &a, &b, &c, None).unwrap();
        let err = rel_err(&s.to_vec(&c).unwrap(), &want);
        assert!(err < 1e-2, "{algo} 1024³ with TF32: {err}");
    }
}
