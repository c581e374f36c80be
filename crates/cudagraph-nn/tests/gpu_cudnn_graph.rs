//! GPU tests of cuDNN's graph-API convolution engines ([`cudagraph_nn::ffi::cudnn_graph`],
//! `ConvEngine::CudnnGraph`): every candidate configuration, in all three directions, on odd
//! geometries (1×1, 7×7, stride 2 with padding, primes, few and many channels, the shapes where
//! PyTorch beat our legacy-API choices) against the f64 CPU reference; a captured convolution
//! replays the eager bits; the deterministic policy offers no configuration with cuDNN's
//! NONDETERMINISTIC note (and those it offers give the same bits twice); a capture never builds
//! plans; the registry measures graph-API candidates beside the others.
//!
//! The forward with its bias fused (`ConvEngine::CudnnGraphBias`, convolution then a pointwise
//! add in one operation graph): every fused candidate on odd geometries (13×11 with 5 → 7
//! channels, stride 2 and padding; 1×1; the sweep's n=16 48 → 96 40×40 stride-2 point) against
//! the f64 reference of convolution + bias, replays equal to eager bits, at least one fused
//! candidate for a 3×3 forward on sm_80+ (the test prints what cuDNN listed), fused candidates
//! refuse to run without a bias or in another direction, and none is offered inside a capture
//! for a new key. On sm_80+ the tests over every fused candidate fail when they checked none
//! (an empty list is not a pass).
//!
//! Tolerance (‖gpu − ref‖ / ‖ref‖ against f64): 1e-4, as for every convolution engine (long fp32
//! sums plus the transform rounding of FFT and Winograd engines). Graph against eager with the
//! same configuration: 0 (bit-identical).
//!
//! The GPU machine is expected to have cuDNN 9: the tests fail when its graph API is missing
//! (a skipped engine is not a tested engine).

use std::sync::Arc;

use cudagraph::testing::assert_bits_eq;
use cudagraph::{gpu_test_device, CaptureOptions, Device, DeviceBuffer, Graph, QueueExt, Stream};
use cudagraph_nn::cpu::{self, rel_err, to_f64};
use cudagraph_nn::engine::conv::ConvGeom;
use cudagraph_nn::engine::conv::{
    conv2d_forward, conv_candidates, conv_key, conv_with, ConvDir, ConvIo,
};
use cudagraph_nn::engine::{ConvEngine, ConvFamily, Engines, Policy};
use cudagraph_nn::ffi::cudnn_graph::{Candidate, CudnnGraph};
use cudagraph_nn::*;

/// Workspace limit used when listing directly (the registry's: 1 GiB on an 80 GB device).
const WORKSPACE: usize = 1 << 30;

fn engines(dev: &Device) -> Arc<Engines> {
    let e = Engines::get(dev).unwrap();
    e.set_policy(Policy::default());
    e
}

fn graph_api(eng: &Engines) -> &CudnnGraph {
    eng.cudnn_graph()
        .expect("cuDNN 9 with its graph API must be installed on the GPU test machine")
}

/// A square-kernel geometry: (n, c, h, w, oc, k, stride, pad).
#[allow(clippy::too_many_arguments)]
fn g(n: usize, c: usize, h: usize, w: usize, oc: usize, k: usize, s: usize, p: usize) -> ConvGeom {
    ConvGeom {
        n,
        c,
        h,
        w,
        oc,
        kh: k,
        kw: k,
        stride: s,
        pad: p,
    }
}

fn geometries() -> Vec<ConvGeom> {
    vec![
        g(1, 1, 8, 8, 1, 1, 1, 0),      // 1×1, one channel
        g(2, 3, 11, 13, 5, 3, 2, 1),    // odd sizes, stride 2 + padding
        g(3, 7, 9, 9, 4, 7, 1, 1),      // 7×7
        g(1, 16, 17, 17, 33, 5, 2, 0),  // 5×5 stride 2, prime channels
        g(4, 128, 7, 7, 64, 1, 1, 0),   // 1×1, many channels
        g(2, 3, 32, 32, 8, 7, 2, 1),    // 7×7 stride 2 on a larger image
        g(2, 64, 16, 16, 128, 3, 2, 1), // the N128 C64→O128 16×16 s2 point, small batch
        g(2, 64, 8, 8, 64, 3, 1, 1),    // the N128 C64→O64 8×8 point, small batch
        g(1, 32, 28, 28, 64, 3, 2, 1),  // the N4 C32→O64 112×112 s2 point, smaller
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

/// Both policies' candidates, deterministic ones first, without repeats.
fn all_candidates(s: &Stream, api: &CudnnGraph, dir: ConvDir, geom: &ConvGeom) -> Vec<Candidate> {
    let mut v = api.candidates(s, dir, geom, true, WORKSPACE).unwrap();
    for c in api.candidates(s, dir, geom, false, WORKSPACE).unwrap() {
        if !v.iter().any(|d| d.rank == c.rank) {
            v.push(c);
        }
    }
    v
}

/// Inputs of one geometry on the device and the f64 references of the three directions.
struct Case {
    x: DeviceBuffer<f32>,
    w: DeviceBuffer<f32>,
    b: DeviceBuffer<f32>,
    dy: DeviceBuffer<f32>,
    want: [Vec<f64>; 3],
}

impl Case {
    fn new(s: &Stream, rng: &mut HostRng, geom: ConvGeom) -> Case {
        let cv = cpu_conv(&geom);
        let xh = rng.vec_normal(geom.input_len().unwrap());
        let wh = rng.vec_normal(geom.weight_len().unwrap());
        let bh = rng.vec_normal(geom.oc);
        let dyh = rng.vec_normal(geom.output_len().unwrap());
        let y = cv.forward(&to_f64(&xh), &to_f64(&wh), &to_f64(&bh));
        let (dx, dw, _) = cv.backward(&to_f64(&xh), &to_f64(&wh), &to_f64(&dyh));
        Case {
            x: s.alloc_from_host(&xh).unwrap(),
            w: s.alloc_from_host(&wh).unwrap(),
            b: s.alloc_from_host(&bh).unwrap(),
            dy: s.alloc_from_host(&dyh).unwrap(),
            want: [y, dx, dw],
        }
    }

    fn index(dir: ConvDir) -> usize {
        match dir {
            ConvDir::Forward => 0,
            ConvDir::BackwardData => 1,
            ConvDir::BackwardFilter => 2,
        }
    }

    fn out_len(&self, dir: ConvDir) -> usize {
        self.want[Self::index(dir)].len()
    }

    /// The inputs of one geometry and the f64 reference of its forward (convolution + bias)
    /// only (`want[1]` and `want[2]` empty): the fused engines run only the forward.
    fn forward(s: &Stream, rng: &mut HostRng, geom: ConvGeom) -> Case {
        let xh = rng.vec_normal(geom.input_len().unwrap());
        let wh = rng.vec_normal(geom.weight_len().unwrap());
        let bh = rng.vec_normal(geom.oc);
        let y = cpu_conv(&geom).forward(&to_f64(&xh), &to_f64(&wh), &to_f64(&bh));
        Case {
            x: s.alloc_from_host(&xh).unwrap(),
            w: s.alloc_from_host(&wh).unwrap(),
            b: s.alloc_from_host(&bh).unwrap(),
            dy: s.alloc::<f32>(1).unwrap(),
            want: [y, Vec::new(), Vec::new()],
        }
    }

    /// The buffers of `dir` with `out` as output (bias in forward).
    fn io<'a>(&'a self, dir: ConvDir, out: &'a DeviceBuffer<f32>) -> ConvIo<'a> {
        let (a, b) = match dir {
            ConvDir::Forward => (&self.x, &self.w),
            ConvDir::BackwardData => (&self.dy, &self.w),
            ConvDir::BackwardFilter => (&self.dy, &self.x),
        };
        ConvIo {
            a,
            b,
            out,
            bias: (dir == ConvDir::Forward).then_some(&self.b),
        }
    }
}

#[test]
fn every_graph_api_candidate_matches_cpu_in_every_direction() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    let api = graph_api(&eng);
    let mut rng = HostRng::new(301);
    let mut checked = 0;
    for geom in geometries() {
        let case = Case::new(&s, &mut rng, geom);
        for dir in ConvDir::ALL {
            let key = conv_key(dir, &geom, dir == ConvDir::Forward);
            let cands = all_candidates(&s, api, dir, &geom);
            assert!(!cands.is_empty(), "no graph-API candidate for {key}");
            for c in cands {
                let algo = ConvEngine::CudnnGraph(c.rank);
                let out = s
                    .alloc_from_host(&vec![f32::NAN; case.out_len(dir)])
                    .unwrap();
                conv_with(&s, &nn, algo, dir, &geom, case.io(dir, &out))
                    .unwrap_or_else(|e| panic!("{algo} ({}) {key}: {e}", c.tag()));
                let err = rel_err(&s.to_vec(&out).unwrap(), &case.want[Case::index(dir)]);
                println!(
                    "{key}: {algo} {} notes {:?} behaviour {:?} ws {} err {err:.1e}",
                    c.tag(),
                    c.notes,
                    c.behavior,
                    c.workspace
                );
                assert!(err < 1e-4, "{algo} ({}) {key}: {err}", c.tag());
                // Plain fp32 only: no tensor cores (TF32), down-conversion or reduced precision.
                assert!(!c.notes.iter().any(|n| [0, 1, 2].contains(n)), "{c:?}");
                checked += 1;
            }
        }
    }
    assert!(checked >= 3 * geometries().len(), "{checked}");
}

/// Runs `algo` for `dir` of `case` eagerly, then captured into a graph replayed twice; asserts
/// each replay equals the eager output bit for bit and returns the eager output. `what` names
/// the candidate in failure messages.
fn eager_equals_replays(
    s: &mut Stream,
    nn: &Nn,
    algo: ConvEngine,
    dir: ConvDir,
    geom: &ConvGeom,
    case: &Case,
    what: &str,
) -> Vec<f32> {
    let eager = s.alloc::<f32>(case.out_len(dir)).unwrap();
    conv_with(s, nn, algo, dir, geom, case.io(dir, &eager)).unwrap();
    let eager = s.to_vec(&eager).unwrap();
    let (graph, out) = Graph::capture(s, CaptureOptions::new(), |cs| {
        let out = cs.alloc::<f32>(case.out_len(dir))?;
        conv_with(cs, nn, algo, dir, geom, case.io(dir, &out))?;
        Ok(out)
    })
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    for _ in 0..2 {
        graph.replay(s).unwrap();
        let got = s.to_vec(&out).unwrap();
        assert_bits_eq(&got, &eager, format_args!("{what}: replay vs eager"));
    }
    eager
}

#[test]
fn graph_api_convolution_replays_equal_eager_bit_for_bit() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    let api = graph_api(&eng);
    let mut rng = HostRng::new(302);
    for geom in [g(2, 3, 11, 13, 5, 3, 2, 1), g(2, 64, 16, 16, 128, 3, 2, 1)] {
        let case = Case::new(&s, &mut rng, geom);
        for dir in ConvDir::ALL {
            let key = conv_key(dir, &geom, dir == ConvDir::Forward);
            let cands = api.candidates(&s, dir, &geom, true, WORKSPACE).unwrap();
            assert!(!cands.is_empty(), "{key}");
            for c in cands {
                let algo = ConvEngine::CudnnGraph(c.rank);
                let what = format!("{algo} ({}) {key}", c.tag());
                let eager = eager_equals_replays(&mut s, &nn, algo, dir, &geom, &case, &what);
                assert!(rel_err(&eager, &case.want[Case::index(dir)]) < 1e-4);
            }
        }
    }
}

#[test]
fn deterministic_policy_offers_no_nondeterministic_graph_api_engine() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    let api = graph_api(&eng);
    let mut rng = HostRng::new(303);
    // Few channels (where cuDNN's atomics-based weight gradient is its fastest), and wide.
    for geom in [
        g(2, 3, 32, 32, 16, 3, 1, 1),
        g(8, 1, 32, 32, 1, 3, 1, 0),
        g(2, 64, 8, 8, 64, 3, 1, 1),
    ] {
        let case = Case::new(&s, &mut rng, geom);
        for dir in ConvDir::ALL {
            let key = conv_key(dir, &geom, false);
            let det = api.candidates(&s, dir, &geom, true, WORKSPACE).unwrap();
            let any = api.candidates(&s, dir, &geom, false, WORKSPACE).unwrap();
            println!(
                "{key}: deterministic [{}]; any [{}]",
                det.iter()
                    .map(Candidate::tag)
                    .collect::<Vec<_>>()
                    .join(", "),
                any.iter()
                    .map(|c| format!(
                        "{}{}",
                        c.tag(),
                        if c.deterministic() { "" } else { " (ND)" }
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            assert!(
                !det.is_empty() && det.len() <= cudagraph_nn::ffi::cudnn_graph::CAP,
                "{key}"
            );
            // Ranks name the same configuration under both policies.
            for c in &any {
                if let Some(d) = det.iter().find(|d| d.rank == c.rank) {
                    assert_eq!(d, c);
                }
            }
            for c in &det {
                assert!(c.deterministic() && !c.notes.contains(&4), "{key}: {c:?}");
                // The same inputs twice: the same bits.
                let algo = ConvEngine::CudnnGraph(c.rank);
                let mut runs = Vec::new();
                for _ in 0..2 {
                    let out = s.alloc::<f32>(case.out_len(dir)).unwrap();
                    conv_with(&s, &nn, algo, dir, &geom, case.io(dir, &out)).unwrap();
                    runs.push(s.to_vec(&out).unwrap());
                }
                assert_bits_eq(
                    &runs[1],
                    &runs[0],
                    format_args!("{key}: {algo} ({}) run to run", c.tag()),
                );
            }
            // Through the registry's listing, under the default (deterministic) policy.
            let bias = dir == ConvDir::Forward;
            let fused = if bias {
                api.fused_bias_candidates(&s, &geom, true, WORKSPACE)
                    .unwrap()
            } else {
                Vec::new()
            };
            assert!(
                fused.len() <= cudagraph_nn::ffi::cudnn_graph::FUSED_CAP,
                "{key}"
            );
            let listed = conv_candidates(&s, &eng, dir, &geom, bias, &Policy::default()).unwrap();
            for a in listed {
                if let ConvEngine::CudnnGraph(r) = a {
                    assert!(
                        det.iter().any(|d| d.rank == r),
                        "{key}: {a} not deterministic"
                    );
                }
                if let ConvEngine::CudnnGraphBias(r) = a {
                    assert!(
                        fused.iter().any(|d| d.rank == r && d.deterministic()),
                        "{key}: {a} not deterministic"
                    );
                }
            }
        }
    }
}

#[test]
fn a_capture_uses_only_plans_built_eagerly() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    let api = graph_api(&eng);
    let mut rng = HostRng::new(304);
    // A geometry no other test uses: nothing built for it yet.
    let geom = g(1, 5, 10, 12, 6, 3, 1, 1);
    let case = Case::new(&s, &mut rng, geom);
    let dir = ConvDir::Forward;
    let policy = Policy::default();
    let (_, inside) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        let listed = conv_candidates(cs, &eng, dir, &geom, true, &policy)?;
        let direct = api.candidates(cs, dir, &geom, true, WORKSPACE)?;
        let fused = api.fused_bias_candidates(cs, &geom, true, WORKSPACE)?;
        let out = cs.alloc::<f32>(case.out_len(dir))?;
        cs.memset_zero(&out)?; // a capture must issue some work
        let mut runs = Vec::new();
        for algo in [ConvEngine::CudnnGraph(0), ConvEngine::CudnnGraphBias(0)] {
            let run = conv_with(cs, &nn, algo, dir, &geom, case.io(dir, &out));
            runs.push(run.map_err(|e| format!("{algo}: {e}")));
        }
        Ok((listed, direct, fused, runs))
    })
    .unwrap();
    let (listed, direct, fused, runs) = inside;
    assert!(
        !listed
            .iter()
            .any(|a| matches!(a, ConvEngine::CudnnGraph(_) | ConvEngine::CudnnGraphBias(_))),
        "{listed:?}"
    );
    assert!(direct.is_empty(), "{direct:?}");
    assert!(fused.is_empty(), "{fused:?}");
    for run in runs {
        let why = run.expect_err("a plan was built inside the capture");
        assert!(why.contains("before the capture"), "{why}");
    }
    // Listed eagerly, the same candidates are offered inside a capture and run there.
    let eager = conv_candidates(&s, &eng, dir, &geom, true, &policy).unwrap();
    let graph_algos: Vec<ConvEngine> = eager
        .iter()
        .copied()
        .filter(|a| matches!(a, ConvEngine::CudnnGraph(_)))
        .collect();
    assert!(!graph_algos.is_empty(), "{eager:?}");
    let (graph, (listed, out)) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        let listed = conv_candidates(cs, &eng, dir, &geom, true, &policy)?;
        let out = cs.alloc::<f32>(case.out_len(dir))?;
        conv_with(cs, &nn, graph_algos[0], dir, &geom, case.io(dir, &out))?;
        Ok((listed, out))
    })
    .unwrap();
    assert_eq!(listed, eager);
    graph.replay(&s).unwrap();
    assert!(rel_err(&s.to_vec(&out).unwrap(), &case.want[0]) < 1e-4);
}

#[test]
fn registry_measures_graph_api_engines_beside_the_legacy_ones() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    graph_api(&eng);
    let mut rng = HostRng::new(305);
    let geom = g(2, 64, 16, 16, 128, 3, 2, 1);
    let case = Case::new(&s, &mut rng, geom);
    eng.clear();
    let policy = Policy {
        conv: ConvFamily::Cudnn,
        ..Policy::default()
    };
    eng.set_policy(policy);
    let y = s.alloc::<f32>(case.out_len(ConvDir::Forward)).unwrap();
    let used = conv2d_forward(&s, &nn, &geom, &case.x, &case.w, Some(&case.b), &y).unwrap();
    assert!(
        rel_err(&s.to_vec(&y).unwrap(), &case.want[0]) < 1e-4,
        "{used}"
    );
    let key = format!(
        "{}{}",
        conv_key(ConvDir::Forward, &geom, true),
        policy.conv_scope()
    );
    let e = eng.entry(&key).expect("measured");
    let text = cudagraph_nn::engine::format_table(&eng.table());
    println!("{text}");
    assert!(e.measured, "{e:?}");
    let graph_timings: Vec<_> = e
        .timings
        .iter()
        .filter(|t| t.engine.starts_with("cudnnv8:"))
        .collect();
    assert!(!graph_timings.is_empty(), "{e:?}");
    assert!(
        graph_timings
            .iter()
            .all(|t| t.us.is_some_and(|us| us > 0.0)),
        "{e:?}"
    );
    assert!(
        e.timings.iter().any(|t| t.engine.starts_with("cudnn:")),
        "{e:?}"
    );
    // The choice is a cuDNN engine of either API, and it parses back.
    let chosen: ConvEngine = e.engine.parse().unwrap();
    assert_eq!(chosen.family(), ConvFamily::Cudnn);
    assert_eq!(chosen, used);
    // Each measured graph-API rank names a configuration built in this process.
    let api = graph_api(&eng);
    for t in &graph_timings {
        let Ok(ConvEngine::CudnnGraph(r)) = t.engine.parse::<ConvEngine>() else {
            panic!("{}", t.engine)
        };
        let c = api
            .describe(ConvDir::Forward, &geom, r)
            .unwrap_or_else(|| panic!("{} not described", t.engine));
        println!("{} = {} {:?}", t.engine, c.tag(), c.notes);
        assert_eq!(c.rank, r);
    }
    // Every fused candidate the listing offers (deterministic policy) was measured too.
    let fused = api
        .fused_bias_candidates(&s, &geom, true, WORKSPACE)
        .unwrap();
    println!(
        "{}",
        api.fused_bias_report(&geom)
            .unwrap_or_else(|| "fused set not built".into())
    );
    require_fused_candidates(&dev, fused.len(), "listed for the registry to measure");
    for c in &fused {
        let name = ConvEngine::CudnnGraphBias(c.rank).to_string();
        let t = e.timings.iter().find(|t| t.engine == name);
        assert!(
            t.is_some_and(|t| t.us.is_some_and(|us| us > 0.0)),
            "{name} not measured: {e:?}"
        );
        let d = api.describe_fused_bias(&geom, c.rank).expect("described");
        assert_eq!(&d, c);
    }
    eng.set_policy(Policy::default());
}

#[test]
fn no_graph_api_engine_when_cudnn_is_disabled() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let eng = engines(&dev);
    eng.set_policy(Policy {
        cudnn: false,
        ..Policy::default()
    });
    assert!(eng.cudnn_graph().is_none());
    let geom = g(2, 3, 11, 13, 5, 3, 2, 1);
    for dir in ConvDir::ALL {
        let p = eng.policy();
        let c = conv_candidates(&s, &eng, dir, &geom, dir == ConvDir::Forward, &p).unwrap();
        assert!(
            !c.iter().any(|a| matches!(
                a,
                ConvEngine::Cudnn(_) | ConvEngine::CudnnGraph(_) | ConvEngine::CudnnGraphBias(_)
            )),
            "{c:?}"
        );
    }
    eng.set_policy(Policy::default());
}

/// Geometries of the fused forward (convolution + bias in one operation graph).
fn fused_geometries() -> Vec<ConvGeom> {
    vec![
        g(3, 5, 13, 11, 7, 3, 2, 1),    // odd sizes, stride 2 + padding
        g(2, 16, 9, 7, 24, 1, 1, 0),    // 1×1
        g(16, 48, 40, 40, 96, 3, 2, 0), // the sweep's point where the bias was a second node
        g(2, 64, 16, 16, 128, 3, 2, 1), // the N128 C64→O128 16×16 s2 point, small batch
    ]
}

/// Both policies' fused candidates, deterministic ones first, without repeats.
fn all_fused_candidates(s: &Stream, api: &CudnnGraph, geom: &ConvGeom) -> Vec<Candidate> {
    let mut v = api.fused_bias_candidates(s, geom, true, WORKSPACE).unwrap();
    for c in api
        .fused_bias_candidates(s, geom, false, WORKSPACE)
        .unwrap()
    {
        if !v.iter().any(|d| d.rank == c.rank) {
            v.push(c);
        }
    }
    v
}

fn fused_report(api: &CudnnGraph, geom: &ConvGeom) -> String {
    api.fused_bias_report(geom)
        .unwrap_or_else(|| "the fused set was not built".into())
}

#[test]
fn every_fused_bias_candidate_matches_cpu() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    let api = graph_api(&eng);
    let mut rng = HostRng::new(306);
    let dir = ConvDir::Forward;
    let mut checked = 0;
    for geom in fused_geometries() {
        let case = Case::forward(&s, &mut rng, geom);
        let key = conv_key(dir, &geom, true);
        let cands = all_fused_candidates(&s, api, &geom);
        println!("{}", fused_report(api, &geom));
        assert!(
            cands.len() <= 2 * cudagraph_nn::ffi::cudnn_graph::FUSED_CAP,
            "{key}"
        );
        for c in cands {
            let algo = ConvEngine::CudnnGraphBias(c.rank);
            let out = s
                .alloc_from_host(&vec![f32::NAN; case.out_len(dir)])
                .unwrap();
            conv_with(&s, &nn, algo, dir, &geom, case.io(dir, &out))
                .unwrap_or_else(|e| panic!("{algo} ({}) {key}: {e}", c.tag()));
            let err = rel_err(&s.to_vec(&out).unwrap(), &case.want[0]);
            println!(
                "{key}: {algo} {} notes {:?} behaviour {:?} ws {} err {err:.1e}",
                c.tag(),
                c.notes,
                c.behavior,
                c.workspace
            );
            assert!(err < 1e-4, "{algo} ({}) {key}: {err}", c.tag());
            // Plain fp32 only: no tensor cores (TF32), down-conversion or reduced precision.
            assert!(!c.notes.iter().any(|n| [0, 1, 2].contains(n)), "{c:?}");
            checked += 1;
        }
    }
    println!("{checked} fused candidates checked");
    require_fused_candidates(&dev, checked, "checked against the f64 reference");
}

/// Fails a test over every fused candidate that checked none on a device where cuDNN must
/// offer some (sm_80+: see `a_fused_bias_candidate_exists_for_a_3x3_forward_on_sm80_or_later`,
/// and the registry's H100 table, where fused candidates of the deterministic policy won 49
/// of 72 forward keys): a loop over an empty list passes without testing anything.
fn require_fused_candidates(dev: &Device, checked: usize, what: &str) {
    let cc = dev.info().compute_capability;
    if cc < (8, 0) {
        println!(
            "compute capability {}.{}: no fused candidate required",
            cc.0, cc.1
        );
        return;
    }
    assert!(
        checked > 0,
        "no fused convolution + bias candidate was {what} on compute capability {}.{} \
         (cuDNN listed none for any of the fused geometries: see the reports printed above)",
        cc.0,
        cc.1
    );
}

#[test]
fn a_fused_bias_candidate_exists_for_a_3x3_forward_on_sm80_or_later() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let eng = engines(&dev);
    let api = graph_api(&eng);
    let cc = dev.info().compute_capability;
    let geom = g(16, 48, 40, 40, 96, 3, 2, 0);
    let key = conv_key(ConvDir::Forward, &geom, true);
    // Any policy: the question is whether cuDNN has a plain-fp32 engine for the fused graph.
    let listed = api.fused_bias_candidates(&s, &geom, false, WORKSPACE);
    let report = fused_report(api, &geom);
    println!(
        "compute capability {}.{}; {key}: {listed:?}\n{report}",
        cc.0, cc.1
    );
    if cc < (8, 0) {
        println!("compute capability below 8.0: no fused candidate required");
        return;
    }
    let listed = listed.unwrap_or_else(|e| panic!("{key}: the fused set failed: {e}\n{report}"));
    assert!(
        !listed.is_empty(),
        "{key}: cuDNN offered no plain-fp32 fused convolution + bias configuration on \
         compute capability {}.{}; what it listed:\n{report}",
        cc.0,
        cc.1
    );
    // Through the registry's listing too.
    let policy = Policy {
        deterministic: false,
        ..Policy::default()
    };
    let via = conv_candidates(&s, &eng, ConvDir::Forward, &geom, true, &policy).unwrap();
    assert!(
        via.iter()
            .any(|a| matches!(a, ConvEngine::CudnnGraphBias(_))),
        "{via:?}"
    );
    let without = conv_candidates(&s, &eng, ConvDir::Forward, &geom, false, &policy).unwrap();
    assert!(
        !without
            .iter()
            .any(|a| matches!(a, ConvEngine::CudnnGraphBias(_))),
        "{without:?}"
    );
}

#[test]
fn fused_bias_convolution_replays_equal_eager_bit_for_bit() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    let api = graph_api(&eng);
    let mut rng = HostRng::new(307);
    let dir = ConvDir::Forward;
    let mut checked = 0;
    for geom in fused_geometries() {
        let case = Case::forward(&s, &mut rng, geom);
        let key = conv_key(dir, &geom, true);
        // Deterministic configurations: the same inputs give the same bits.
        let cands = api
            .fused_bias_candidates(&s, &geom, true, WORKSPACE)
            .unwrap();
        if cands.is_empty() {
            println!(
                "{key}: no deterministic fused candidate\n{}",
                fused_report(api, &geom)
            );
        }
        for c in cands {
            let algo = ConvEngine::CudnnGraphBias(c.rank);
            let what = format!("{algo} ({}) {key}", c.tag());
            let eager = eager_equals_replays(&mut s, &nn, algo, dir, &geom, &case, &what);
            assert!(rel_err(&eager, &case.want[0]) < 1e-4, "{algo} {key}");
            checked += 1;
        }
    }
    println!("{checked} fused candidates replayed");
    require_fused_candidates(&dev, checked, "replayed against its eager run");
}

#[test]
fn a_fused_candidate_refuses_other_directions_and_a_missing_bias() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    graph_api(&eng);
    let mut rng = HostRng::new(308);
    let geom = g(3, 5, 13, 11, 7, 3, 2, 1);
    let case = Case::new(&s, &mut rng, geom);
    let algo = ConvEngine::CudnnGraphBias(0);
    // The forward without its bias.
    let y = s.alloc::<f32>(case.out_len(ConvDir::Forward)).unwrap();
    let io = ConvIo {
        bias: None,
        ..case.io(ConvDir::Forward, &y)
    };
    let e = conv_with(&s, &nn, algo, ConvDir::Forward, &geom, io)
        .expect_err("fused without a bias")
        .to_string();
    assert!(e.contains("with a bias"), "{e}");
    // The backward directions (which carry no bias).
    for dir in [ConvDir::BackwardData, ConvDir::BackwardFilter] {
        let out = s.alloc::<f32>(case.out_len(dir)).unwrap();
        let e = conv_with(&s, &nn, algo, dir, &geom, case.io(dir, &out))
            .expect_err("fused in a backward direction")
            .to_string();
        assert!(e.contains("forward"), "{e}");
        // Never offered there.
        let listed = conv_candidates(&s, &eng, dir, &geom, false, &Policy::default()).unwrap();
        assert!(
            !listed
                .iter()
                .any(|a| matches!(a, ConvEngine::CudnnGraphBias(_))),
            "{listed:?}"
        );
    }
    // A rank past the fused list is an error, not a panic.
    let out = s.alloc::<f32>(case.out_len(ConvDir::Forward)).unwrap();
    let e = conv_with(
        &s,
        &nn,
        ConvEngine::CudnnGraphBias(255),
        ConvDir::Forward,
        &geom,
        case.io(ConvDir::Forward, &out),
    );
    assert!(e.is_err());
}
