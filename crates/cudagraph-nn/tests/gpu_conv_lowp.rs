//! GPU tests of the half-precision convolutions (`cudagraph_nn::engine::conv_lowp`): forward
//! (plain, with a bias, a ReLU, both), backward-data and backward-filter (`dw` in the inputs'
//! type and in f32), in bf16 and f16, `NCHW` and `NHWC`, with stride, padding, dilation and odd
//! channel counts (3, 5 — which tensor-core engines cannot align, so other candidates must
//! take them). Every candidate the registry would measure (cuDNN's legacy algorithms and
//! graph-API configurations in both layouts — the other layout with its transposes —, the fused
//! forward, our direct kernels, the widened f32 path) runs against an f64 CPU reference
//! computed from the exact 16-bit inputs; the registry's choice replays bit for bit as eager;
//! transposes move bits exactly; misuse is a typed error.
//!
//! **Tolerances**, per output element, relative to `S = Σ|a·b|` over the products summed into
//! it (plus `|bias|` with a bias): the products of 16-bit values are exact in f32 and every sum
//! is f32, so the sum's error is at most `k·2⁻²⁴·S` for `k` terms (≤ 1e-4·S for the shapes
//! here); one rounding into the output type adds at most `u·|y| ≤ u·S` (`u = 2⁻⁸ ≈ 3.9e-3` for
//! bf16, `2⁻¹¹ ≈ 4.9e-4` for f16), and a second one where the bias and ReLU follow the
//! convolution unfused. Hence **1e-2 for bf16** and **2e-3 for f16** (2.5× and 4× `u`), and
//! **1e-4 for a dw in f32** (no 16-bit rounding at all). Engines that transform (Winograd, FFT)
//! have errors relative to the whole tensor rather than to each output, so each bound also
//! carries `tol·S̄/16` (`S̄` the mean `S` of the tensor). Graph against eager, the same
//! engine twice, transposes there and back: 0 (bit-identical).
//!
//! The GPU machine is expected to have cuDNN 9 and a GPU of sm_80 or newer (bf16 tensor cores):
//! the candidate tests fail when no cuDNN candidate was checked for the aligned shapes.

use std::sync::Arc;

use cudagraph::memory::{bf16, f16};
use cudagraph::{gpu_test_device, CaptureOptions, Device, DeviceBuffer, Graph, QueueExt, Stream};
use cudagraph_nn::dtype::{Dtype, Float};
use cudagraph_nn::engine::conv_lowp::{
    conv2d_lowp_backward_data, conv2d_lowp_backward_filter, conv2d_lowp_backward_filter_f32,
    conv2d_lowp_forward, conv_lowp_candidates, conv_lowp_key, conv_lowp_with, faster_layout,
    relayout, relayout_weights, run_conv_lowp, ConvDir, ConvGeom, ConvShape, Layout, LowpEngine,
    LowpIo, LowpKind, LowpOp,
};
use cudagraph_nn::engine::{Engines, Policy};
use cudagraph_nn::*;

const TOL_BF16: f64 = 1e-2;
const TOL_F16: f64 = 2e-3;
const TOL_F32: f64 = 1e-4;

fn tol(d: Dtype) -> f64 {
    match d {
        Dtype::Bf16 => TOL_BF16,
        Dtype::F16 => TOL_F16,
        Dtype::F32 => TOL_F32,
    }
}

fn engines(dev: &Device) -> Arc<Engines> {
    let e = Engines::get(dev).unwrap();
    e.set_policy(Policy::default());
    e
}

/// (n, c, h, w, oc, kh, kw, stride, pad, dilation).
#[allow(clippy::too_many_arguments)]
fn shape(
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    oc: usize,
    (kh, kw): (usize, usize),
    stride: usize,
    pad: usize,
    dilation: usize,
) -> ConvShape {
    ConvShape::new(
        ConvGeom {
            n,
            c,
            h,
            w,
            oc,
            kh,
            kw,
            stride,
            pad,
        },
        dilation,
    )
}

/// Odd and aligned geometries: odd channel counts, stride 2 with padding, dilation 2, a
/// non-square kernel, 1×1, 5×5.
fn shapes() -> Vec<ConvShape> {
    vec![
        shape(2, 3, 11, 13, 5, (3, 3), 2, 1, 1), // 3 → 5 channels, stride 2
        shape(2, 5, 9, 9, 3, (3, 3), 1, 2, 2),   // dilation 2, 5 → 3 channels
        shape(1, 8, 8, 8, 16, (1, 1), 1, 0, 1),  // 1×1, aligned
        shape(2, 16, 10, 12, 8, (5, 5), 2, 2, 1), // 5×5 stride 2
        shape(3, 32, 7, 7, 32, (3, 3), 1, 1, 1), // aligned 3×3
        shape(1, 4, 9, 11, 6, (1, 3), 1, 1, 2),  // 1×3 kernel, dilation 2
    ]
}

/// The index of element (n, c, h, w) of an activation `[n, c, h, w]` stored in `l`.
#[allow(clippy::too_many_arguments)]
fn act(
    l: Layout,
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    cs: usize,
    hs: usize,
    ws: usize,
) -> usize {
    match l {
        Layout::Nchw => ((n * cs + c) * hs + h) * ws + w,
        Layout::Nhwc => ((n * hs + h) * ws + w) * cs + c,
    }
}

/// The index of weight (k, c, r, s) of `[k, c, r, s]` stored in `l` (`OIHW` or `OHWI`).
#[allow(clippy::too_many_arguments)]
fn wt(l: Layout, k: usize, c: usize, r: usize, s: usize, cs: usize, rs: usize, ss: usize) -> usize {
    match l {
        Layout::Nchw => ((k * cs + c) * rs + r) * ss + s,
        Layout::Nhwc => ((k * rs + r) * ss + s) * cs + c,
    }
}

/// The f64 references of the three directions in layout `l` and, per output element, the sum
/// of the magnitudes of its products (`S` of the module docs).
struct Ref {
    y: Vec<f64>,
    ys: Vec<f64>,
    dx: Vec<f64>,
    dxs: Vec<f64>,
    dw: Vec<f64>,
    dws: Vec<f64>,
}

fn reference(s: &ConvShape, l: Layout, x: &[f64], w: &[f64], dy: &[f64]) -> Ref {
    let g = &s.geom;
    let (oh, ow) = s.out_hw().unwrap();
    let (yl, xl, wl) = (
        s.output_len().unwrap(),
        s.input_len().unwrap(),
        s.weight_len().unwrap(),
    );
    let mut r = Ref {
        y: vec![0.0; yl],
        ys: vec![0.0; yl],
        dx: vec![0.0; xl],
        dxs: vec![0.0; xl],
        dw: vec![0.0; wl],
        dws: vec![0.0; wl],
    };
    for n in 0..g.n {
        for k in 0..g.oc {
            for py in 0..oh {
                for px in 0..ow {
                    let yi = act(l, n, k, py, px, g.oc, oh, ow);
                    for c in 0..g.c {
                        for kr in 0..g.kh {
                            let ih = (py * g.stride + kr * s.dilation) as isize - g.pad as isize;
                            if ih < 0 || ih >= g.h as isize {
                                continue;
                            }
                            for ks in 0..g.kw {
                                let iw =
                                    (px * g.stride + ks * s.dilation) as isize - g.pad as isize;
                                if iw < 0 || iw >= g.w as isize {
                                    continue;
                                }
                                let xi = act(l, n, c, ih as usize, iw as usize, g.c, g.h, g.w);
                                let wi = wt(l, k, c, kr, ks, g.c, g.kh, g.kw);
                                r.y[yi] += x[xi] * w[wi];
                                r.ys[yi] += (x[xi] * w[wi]).abs();
                                r.dx[xi] += dy[yi] * w[wi];
                                r.dxs[xi] += (dy[yi] * w[wi]).abs();
                                r.dw[wi] += dy[yi] * x[xi];
                                r.dws[wi] += (dy[yi] * x[xi]).abs();
                            }
                        }
                    }
                }
            }
        }
    }
    r
}

/// `y = relu?(y + bias[channel])` over a reference output in `l`, with the scale grown by
/// `|bias|`.
fn with_epilogue(
    s: &ConvShape,
    l: Layout,
    (y, ys): (&[f64], &[f64]),
    bias: Option<&[f64]>,
    relu: bool,
) -> (Vec<f64>, Vec<f64>) {
    let (oh, ow) = s.out_hw().unwrap();
    let oc = s.geom.oc;
    let channel = |i: usize| match l {
        Layout::Nchw => (i / (oh * ow)) % oc,
        Layout::Nhwc => i % oc,
    };
    let mut out = y.to_vec();
    let mut scale = ys.to_vec();
    for i in 0..out.len() {
        if let Some(b) = bias {
            out[i] += b[channel(i)];
            scale[i] += b[channel(i)].abs();
        }
        if relu && out[i] < 0.0 {
            out[i] = 0.0;
        }
    }
    (out, scale)
}

/// The first few elements (at most 8) of `got` outside the bound, as text; empty when all are
/// inside. The bound of element i is `tol·(S_i + S̄/16)`; a NaN is always outside.
fn outside<O: Float>(got: &[O], want: &[f64], scale: &[f64], tol: f64) -> String {
    assert_eq!(got.len(), want.len());
    let mean = scale.iter().sum::<f64>() / scale.len().max(1) as f64;
    let mut bad = Vec::new();
    let mut count = 0;
    for i in 0..got.len() {
        let g = got[i].to_f32() as f64;
        let bound = tol * (scale[i] + mean / 16.0);
        let err = (g - want[i]).abs();
        // A NaN (got or error) is outside too.
        if err.is_nan() || err > bound {
            count += 1;
            if bad.len() < 8 {
                bad.push(format!(
                    "[{i}] got {g:e} want {:e} err {err:.2e} bound {bound:.2e}",
                    want[i]
                ));
            }
        }
    }
    if count == 0 {
        String::new()
    } else {
        format!("{count} of {} outside: {}", got.len(), bad.join("; "))
    }
}

fn host<T: Float>(rng: &mut HostRng, n: usize) -> Vec<T> {
    rng.vec_normal(n).into_iter().map(T::from_f32).collect()
}

fn f64s<T: Float>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f32() as f64).collect()
}

/// The bytes of `v` as they lie in memory: every bit of every element (NaN payloads too).
fn bits<T: Float>(v: &[T]) -> Vec<u8> {
    T::as_bytes(v).to_vec()
}

/// One shape and layout: 16-bit inputs on the device and the f64 references.
struct Case<T: Float> {
    shape: ConvShape,
    layout: Layout,
    x: DeviceBuffer<T>,
    w: DeviceBuffer<T>,
    dy: DeviceBuffer<T>,
    b: DeviceBuffer<T>,
    bh: Vec<f64>,
    r: Ref,
}

impl<T: Float> Case<T> {
    fn new(s: &Stream, rng: &mut HostRng, shape: ConvShape, layout: Layout) -> Case<T> {
        let xh: Vec<T> = host(rng, shape.input_len().unwrap());
        let wh: Vec<T> = host(rng, shape.weight_len().unwrap());
        let dyh: Vec<T> = host(rng, shape.output_len().unwrap());
        let bh: Vec<T> = host(rng, shape.geom.oc);
        let r = reference(&shape, layout, &f64s(&xh), &f64s(&wh), &f64s(&dyh));
        Case {
            shape,
            layout,
            x: s.alloc_from_host(&xh).unwrap(),
            w: s.alloc_from_host(&wh).unwrap(),
            dy: s.alloc_from_host(&dyh).unwrap(),
            b: s.alloc_from_host(&bh).unwrap(),
            bh: f64s(&bh),
            r,
        }
    }

    fn op(&self, dir: ConvDir, bias: bool, relu: bool, out_f32: bool) -> LowpOp {
        LowpOp {
            dir,
            shape: self.shape,
            dtype: T::DTYPE,
            layout: self.layout,
            out_f32,
            bias,
            relu,
        }
    }

    /// The buffers of `op` with `out` as output.
    fn io<'a, O: Float>(&'a self, op: &LowpOp, out: &'a DeviceBuffer<O>) -> LowpIo<'a, T, O> {
        let (a, b) = match op.dir {
            ConvDir::Forward => (&self.x, &self.w),
            ConvDir::BackwardData => (&self.dy, &self.w),
            ConvDir::BackwardFilter => (&self.dy, &self.x),
        };
        LowpIo {
            a,
            b,
            out,
            bias: op.bias.then_some(&self.b),
        }
    }

    /// The reference output of `op` and its scale.
    fn want(&self, op: &LowpOp) -> (Vec<f64>, Vec<f64>) {
        match op.dir {
            ConvDir::Forward => with_epilogue(
                &self.shape,
                self.layout,
                (&self.r.y, &self.r.ys),
                op.bias.then_some(&self.bh[..]),
                op.relu,
            ),
            ConvDir::BackwardData => (self.r.dx.clone(), self.r.dxs.clone()),
            ConvDir::BackwardFilter => (self.r.dw.clone(), self.r.dws.clone()),
        }
    }
}

/// Both policies' candidates (deterministic ones first), without repeats.
fn all_candidates(s: &Stream, eng: &Engines, op: &LowpOp) -> Vec<LowpEngine> {
    let det = Policy::default();
    let any = Policy {
        deterministic: false,
        ..det
    };
    let mut v = conv_lowp_candidates(s, eng, op, &det).unwrap();
    for c in conv_lowp_candidates(s, eng, op, &any).unwrap() {
        if !v.contains(&c) {
            v.push(c);
        }
    }
    v
}

/// Runs every candidate of `op` on `case` against the reference; returns (failures, number of
/// cuDNN candidates checked, number checked).
fn check_every_candidate<T: Float, O: Float>(
    s: &Stream,
    nn: &Nn,
    eng: &Engines,
    case: &Case<T>,
    op: &LowpOp,
) -> (Vec<String>, usize, usize) {
    let key = conv_lowp_key(op);
    let (want, scale) = case.want(op);
    let t = tol(O::DTYPE);
    let mut failures = Vec::new();
    let (mut cudnn, mut checked) = (0, 0);
    let cands = all_candidates(s, eng, op);
    assert!(!cands.is_empty(), "{key}: no candidate at all");
    for algo in cands {
        let nan: Vec<O> = vec![O::from_f32(f32::NAN); want.len()];
        let out = s.alloc_from_host(&nan).unwrap();
        if let Err(e) = conv_lowp_with(s, nn, algo, op, case.io(op, &out)) {
            failures.push(format!("{key}: {algo}: {e}"));
            continue;
        }
        let got = s.to_vec(&out).unwrap();
        let bad = outside(&got, &want, &scale, t);
        println!("{key}: {algo} {}", if bad.is_empty() { "ok" } else { &bad });
        if !bad.is_empty() {
            failures.push(format!("{key}: {algo}: {bad}"));
        }
        checked += 1;
        cudnn += algo.is_cudnn() as usize;
    }
    (failures, cudnn, checked)
}

/// Every candidate of every direction (and forward epilogue) of every shape in both layouts.
fn every_candidate<T: Float>(seed: u64) {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    assert!(
        eng.cudnn().is_some(),
        "cuDNN must be installed on the GPU test machine"
    );
    let mut rng = HostRng::new(seed);
    let mut failures = Vec::new();
    let (mut cudnn_aligned, mut checked) = (0, 0);
    for (i, sh) in shapes().into_iter().enumerate() {
        for layout in Layout::ALL {
            let case = Case::<T>::new(&s, &mut rng, sh, layout);
            let mut ops = vec![
                case.op(ConvDir::Forward, false, false, false),
                case.op(ConvDir::BackwardData, false, false, false),
                case.op(ConvDir::BackwardFilter, false, false, false),
            ];
            // The epilogues on three shapes (fused engines compile at run time: keep it
            // short): odd channels (the bias kernel one element at a time), the aligned 1×1
            // (eight at a time in both layouts: 64 pixels, 16 channels) and the aligned 3×3
            // (49 pixels: eight at a time in NHWC only).
            if i == 0 || i == 2 || i == 4 {
                ops.push(case.op(ConvDir::Forward, true, false, false));
                ops.push(case.op(ConvDir::Forward, true, true, false));
                ops.push(case.op(ConvDir::Forward, false, true, false));
            }
            for op in ops {
                let (f, c, n) = check_every_candidate::<T, T>(&s, &nn, &eng, &case, &op);
                failures.extend(f);
                checked += n;
                if sh.geom.c % 8 == 0 && sh.geom.oc % 8 == 0 {
                    cudnn_aligned += c;
                }
            }
        }
    }
    println!("{checked} candidate runs checked, {cudnn_aligned} cuDNN runs on aligned shapes");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        cudnn_aligned >= 3 * 2 * 3,
        "only {cudnn_aligned} cuDNN candidates checked on the aligned shapes"
    );
}

#[test]
fn every_bf16_candidate_matches_the_f64_reference() {
    every_candidate::<bf16>(2801);
}

#[test]
fn every_f16_candidate_matches_the_f64_reference() {
    every_candidate::<f16>(2802);
}

/// The weight gradient in f32 from 16-bit inputs: every candidate (cuDNN's graph API where it
/// has an engine for the mix, the widened f32 path, the direct kernel), both layouts, with and
/// without dilation.
fn every_f32_dw_candidate<T: Float>(seed: u64) {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    let mut rng = HostRng::new(seed);
    let mut failures = Vec::new();
    let mut widened = 0;
    for sh in shapes() {
        for layout in Layout::ALL {
            let case = Case::<T>::new(&s, &mut rng, sh, layout);
            let op = case.op(ConvDir::BackwardFilter, false, false, true);
            let cands = all_candidates(&s, &eng, &op);
            if sh.dilation == 1 {
                assert!(
                    cands.contains(&LowpEngine::new(Layout::Nchw, LowpKind::Widen)),
                    "{}: {cands:?}",
                    conv_lowp_key(&op)
                );
                widened += 1;
            }
            let (f, _, _) = check_every_candidate::<T, f32>(&s, &nn, &eng, &case, &op);
            failures.extend(f);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(widened > 0);
}

#[test]
fn every_f32_weight_gradient_candidate_from_bf16_matches_the_reference() {
    every_f32_dw_candidate::<bf16>(2803);
}

#[test]
fn every_f32_weight_gradient_candidate_from_f16_matches_the_reference() {
    every_f32_dw_candidate::<f16>(2804);
}

/// Runs the registry's choice for `op` eagerly twice (the first measures), then captured and
/// replayed twice; every output equals the first bit for bit and matches the reference.
fn registry_case<T: Float, O: Float>(
    s: &mut Stream,
    nn: &Nn,
    case: &Case<T>,
    op: &LowpOp,
) -> LowpEngine {
    let key = conv_lowp_key(op);
    let (want, scale) = case.want(op);
    let eager = s.alloc::<O>(want.len()).unwrap();
    let chosen = run_conv_lowp(s, nn, op, case.io(op, &eager)).unwrap();
    let first = s.to_vec(&eager).unwrap();
    let bad = outside(&first, &want, &scale, tol(O::DTYPE));
    assert!(bad.is_empty(), "{key}: {chosen}: {bad}");
    let again = run_conv_lowp(s, nn, op, case.io(op, &eager)).unwrap();
    assert_eq!(
        again, chosen,
        "{key}: the recorded choice serves the next call"
    );
    assert_eq!(
        bits(&s.to_vec(&eager).unwrap()),
        bits(&first),
        "{key}: {chosen} twice"
    );
    let (graph, out) = Graph::capture(s, CaptureOptions::new(), |cs| {
        let out = cs.alloc::<O>(want.len())?;
        let used = run_conv_lowp(cs, nn, op, case.io(op, &out))?;
        assert_eq!(used, chosen, "{key}: the capture uses the measured engine");
        Ok(out)
    })
    .unwrap_or_else(|e| panic!("{key}: {e}"));
    for _ in 0..2 {
        graph.replay(s).unwrap();
        assert_eq!(
            bits(&s.to_vec(&out).unwrap()),
            bits(&first),
            "{key}: {chosen}: replay vs eager"
        );
    }
    chosen
}

#[test]
fn the_registry_choice_matches_the_reference_and_replays_bit_for_bit() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let _eng = engines(&dev);
    let mut rng = HostRng::new(2805);
    for sh in [
        shape(2, 3, 11, 13, 5, (3, 3), 2, 1, 1),
        shape(2, 32, 12, 12, 64, (3, 3), 1, 1, 1),
        shape(2, 16, 9, 9, 16, (3, 3), 1, 2, 2),
    ] {
        for layout in Layout::ALL {
            let b = Case::<bf16>::new(&s, &mut rng, sh, layout);
            let h = Case::<f16>::new(&s, &mut rng, sh, layout);
            for (bias, relu) in [(false, false), (true, true)] {
                let op = b.op(ConvDir::Forward, bias, relu, false);
                println!(
                    "{}: {}",
                    conv_lowp_key(&op),
                    registry_case::<bf16, bf16>(&mut s, &nn, &b, &op)
                );
                let op = h.op(ConvDir::Forward, bias, relu, false);
                println!(
                    "{}: {}",
                    conv_lowp_key(&op),
                    registry_case::<f16, f16>(&mut s, &nn, &h, &op)
                );
            }
            for dir in [ConvDir::BackwardData, ConvDir::BackwardFilter] {
                let op = b.op(dir, false, false, false);
                println!(
                    "{}: {}",
                    conv_lowp_key(&op),
                    registry_case::<bf16, bf16>(&mut s, &nn, &b, &op)
                );
                let op = h.op(dir, false, false, false);
                println!(
                    "{}: {}",
                    conv_lowp_key(&op),
                    registry_case::<f16, f16>(&mut s, &nn, &h, &op)
                );
            }
            let op = b.op(ConvDir::BackwardFilter, false, false, true);
            println!(
                "{}: {}",
                conv_lowp_key(&op),
                registry_case::<bf16, f32>(&mut s, &nn, &b, &op)
            );
            let op = h.op(ConvDir::BackwardFilter, false, false, true);
            println!(
                "{}: {}",
                conv_lowp_key(&op),
                registry_case::<f16, f32>(&mut s, &nn, &h, &op)
            );
        }
    }
}

/// The public entry points agree with `run_conv_lowp` and with the reference (one shape,
/// both layouts).
#[test]
fn the_public_functions_run_each_direction() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let _eng = engines(&dev);
    let mut rng = HostRng::new(2806);
    let sh = shape(2, 8, 10, 10, 16, (3, 3), 1, 1, 1);
    for layout in Layout::ALL {
        let c = Case::<bf16>::new(&s, &mut rng, sh, layout);
        let t = TOL_BF16;
        let y = s.alloc::<bf16>(sh.output_len().unwrap()).unwrap();
        conv2d_lowp_forward(&s, &nn, &sh, layout, &c.x, &c.w, Some(&c.b), true, &y).unwrap();
        let (want, scale) = c.want(&c.op(ConvDir::Forward, true, true, false));
        let bad = outside(&s.to_vec(&y).unwrap(), &want, &scale, t);
        assert!(bad.is_empty(), "forward {layout}: {bad}");
        let dx = s.alloc::<bf16>(sh.input_len().unwrap()).unwrap();
        conv2d_lowp_backward_data(&s, &nn, &sh, layout, &c.dy, &c.w, &dx).unwrap();
        let bad = outside(&s.to_vec(&dx).unwrap(), &c.r.dx, &c.r.dxs, t);
        assert!(bad.is_empty(), "backward-data {layout}: {bad}");
        let dw = s.alloc::<bf16>(sh.weight_len().unwrap()).unwrap();
        conv2d_lowp_backward_filter(&s, &nn, &sh, layout, &c.dy, &c.x, &dw).unwrap();
        let bad = outside(&s.to_vec(&dw).unwrap(), &c.r.dw, &c.r.dws, t);
        assert!(bad.is_empty(), "backward-filter {layout}: {bad}");
        let dw32 = s.alloc::<f32>(sh.weight_len().unwrap()).unwrap();
        conv2d_lowp_backward_filter_f32(&s, &nn, &sh, layout, &c.dy, &c.x, &dw32).unwrap();
        let bad = outside(&s.to_vec(&dw32).unwrap(), &c.r.dw, &c.r.dws, TOL_F32);
        assert!(bad.is_empty(), "backward-filter f32 {layout}: {bad}");
    }
}

/// Transposes move bits: NCHW → NHWC is the permutation the reference indexes with, and back
/// gives the input bit for bit (NaN payloads and signed zeros included); the same for weights.
fn relayouts<T: Float>(s: &Stream, rng: &mut HostRng) {
    let (n, c, h, w) = (3, 5, 7, 9);
    let mut xh: Vec<T> = host(rng, n * c * h * w);
    // Special values keep their bits (a transpose is no arithmetic): -0, inf, and a NaN with
    // a payload (the low bits of an f32 NaN become the 16-bit payload's high bits).
    xh[0] = T::from_f32(-0.0);
    xh[1] = T::from_f32(f32::INFINITY);
    xh[2] = T::from_f32(f32::from_bits(0x7fa0_0000));
    let x = s.alloc_from_host(&xh).unwrap();
    let t = s.alloc::<T>(xh.len()).unwrap();
    let back = s.alloc::<T>(xh.len()).unwrap();
    relayout(s, (n, c, h, w), Layout::Nchw, Layout::Nhwc, &x, &t).unwrap();
    relayout(s, (n, c, h, w), Layout::Nhwc, Layout::Nchw, &t, &back).unwrap();
    let th = s.to_vec(&t).unwrap();
    for (ni, ci, hi, wi) in (0..n).flat_map(|a| {
        (0..c).flat_map(move |b| (0..h).flat_map(move |d| (0..w).map(move |e| (a, b, d, e))))
    }) {
        let (i, j) = (
            act(Layout::Nhwc, ni, ci, hi, wi, c, h, w),
            act(Layout::Nchw, ni, ci, hi, wi, c, h, w),
        );
        assert_eq!(
            bits(&th[i..=i]),
            bits(&xh[j..=j]),
            "({ni}, {ci}, {hi}, {wi})"
        );
    }
    assert_eq!(bits(&s.to_vec(&back).unwrap()), bits(&xh), "there and back");
    let (oc, kh, kw) = (4, 3, 2);
    let wh: Vec<T> = host(rng, oc * c * kh * kw);
    let wd = s.alloc_from_host(&wh).unwrap();
    let wt_d = s.alloc::<T>(wh.len()).unwrap();
    let wb = s.alloc::<T>(wh.len()).unwrap();
    relayout_weights(s, (oc, c, kh, kw), Layout::Nchw, Layout::Nhwc, &wd, &wt_d).unwrap();
    relayout_weights(s, (oc, c, kh, kw), Layout::Nhwc, Layout::Nchw, &wt_d, &wb).unwrap();
    let got = s.to_vec(&wt_d).unwrap();
    for k in 0..oc {
        for ci in 0..c {
            for r in 0..kh {
                for q in 0..kw {
                    let (i, j) = (
                        wt(Layout::Nhwc, k, ci, r, q, c, kh, kw),
                        wt(Layout::Nchw, k, ci, r, q, c, kh, kw),
                    );
                    assert_eq!(bits(&got[i..=i]), bits(&wh[j..=j]));
                }
            }
        }
    }
    assert_eq!(
        bits(&s.to_vec(&wb).unwrap()),
        bits(&wh),
        "weights there and back"
    );
}

#[test]
fn relayouts_move_bits_exactly() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(2807);
    relayouts::<bf16>(&s, &mut rng);
    relayouts::<f16>(&s, &mut rng);
}

#[test]
fn faster_layout_reports_the_registry_choice_for_the_nchw_key() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = engines(&dev);
    let sh = shape(8, 64, 28, 28, 64, (3, 3), 1, 1, 1);
    for dir in ConvDir::ALL {
        let layout = faster_layout::<bf16>(&s, &nn, dir, &sh).unwrap();
        let op = LowpOp {
            dir,
            shape: sh,
            dtype: Dtype::Bf16,
            layout: Layout::Nchw,
            out_f32: false,
            bias: false,
            relu: false,
        };
        let key = format!("{}{}", conv_lowp_key(&op), eng.policy().conv_scope());
        let entry = eng
            .entry(&key)
            .unwrap_or_else(|| panic!("{key} not recorded"));
        let chosen: LowpEngine = entry.engine.parse().unwrap();
        assert_eq!(chosen.layout, layout, "{key}: {}", entry.engine);
        println!(
            "{key}: {} ({} candidates timed)",
            entry.engine,
            entry.timings.len()
        );
        // The NHWC-with-transposes candidates were measured beside the NCHW ones.
        if eng.cudnn().is_some() {
            assert!(
                entry.timings.iter().any(|t| t.engine.starts_with("nhwc:")),
                "{key}: {:?}",
                entry.timings
            );
        }
    }
    assert!(faster_layout::<f32>(&s, &nn, ConvDir::Forward, &sh).is_err());
}

#[test]
fn misuse_is_a_typed_error() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let _eng = engines(&dev);
    let sh = shape(2, 3, 8, 8, 4, (3, 3), 1, 1, 1);
    let l = Layout::Nchw;
    let (xl, wl, yl) = (
        sh.input_len().unwrap(),
        sh.weight_len().unwrap(),
        sh.output_len().unwrap(),
    );
    let x = s.alloc_zeroed::<bf16>(xl).unwrap();
    let w = s.alloc_zeroed::<bf16>(wl).unwrap();
    let y = s.alloc_zeroed::<bf16>(yl).unwrap();
    let b = s.alloc_zeroed::<bf16>(sh.geom.oc).unwrap();
    // f32 buffers: the f32 path's job.
    let (x32, w32, y32) = (
        s.alloc_zeroed::<f32>(xl).unwrap(),
        s.alloc_zeroed::<f32>(wl).unwrap(),
        s.alloc_zeroed::<f32>(yl).unwrap(),
    );
    let e = conv2d_lowp_forward(&s, &nn, &sh, l, &x32, &w32, None, false, &y32).unwrap_err();
    assert!(matches!(e, NnError::Dtype { found: "f32", .. }), "{e}");
    assert!(e.to_string().contains("engine::conv"), "{e}");
    let e = conv2d_lowp_backward_data(&s, &nn, &sh, l, &y32, &w32, &x32).unwrap_err();
    assert!(matches!(e, NnError::Dtype { .. }), "{e}");
    // Short buffers.
    let short = s.alloc_zeroed::<bf16>(xl - 1).unwrap();
    let e = conv2d_lowp_forward(&s, &nn, &sh, l, &short, &w, None, false, &y).unwrap_err();
    assert!(
        matches!(
            e,
            NnError::Core(cudagraph::Error::SizeMismatch {
                what: "conv2d x",
                ..
            })
        ),
        "{e}"
    );
    let short_w = s.alloc_zeroed::<bf16>(wl - 1).unwrap();
    let e = conv2d_lowp_backward_filter(&s, &nn, &sh, l, &y, &x, &short_w).unwrap_err();
    assert!(
        matches!(e, NnError::Core(cudagraph::Error::SizeMismatch { .. })),
        "{e}"
    );
    let short_b = s.alloc_zeroed::<bf16>(sh.geom.oc - 1).unwrap();
    let e = conv2d_lowp_forward(&s, &nn, &sh, l, &x, &w, Some(&short_b), true, &y).unwrap_err();
    assert!(
        matches!(
            e,
            NnError::Core(cudagraph::Error::SizeMismatch {
                what: "conv2d bias",
                ..
            })
        ),
        "{e}"
    );
    // Geometries without an output, a zero dilation.
    let none = shape(2, 3, 2, 2, 4, (3, 3), 1, 0, 1);
    let e = conv2d_lowp_forward(&s, &nn, &none, l, &x, &w, None, false, &y).unwrap_err();
    assert!(matches!(e, NnError::Shape(_)), "{e}");
    let zero = ConvShape { dilation: 0, ..sh };
    let e = conv2d_lowp_forward(&s, &nn, &zero, l, &x, &w, None, false, &y).unwrap_err();
    assert!(matches!(e, NnError::Shape(_)), "{e}");
    // An op that contradicts its buffers or itself.
    let fwd = LowpOp {
        dir: ConvDir::Forward,
        shape: sh,
        dtype: Dtype::Bf16,
        layout: l,
        out_f32: false,
        bias: false,
        relu: false,
    };
    let io = LowpIo {
        a: &x,
        b: &w,
        out: &y,
        bias: Some(&b),
    };
    assert!(matches!(
        run_conv_lowp(&s, &nn, &fwd, io),
        Err(NnError::Shape(_))
    ));
    let f16_op = LowpOp {
        dtype: Dtype::F16,
        ..fwd
    };
    let io = LowpIo {
        a: &x,
        b: &w,
        out: &y,
        bias: None,
    };
    assert!(matches!(
        run_conv_lowp(&s, &nn, &f16_op, io),
        Err(NnError::Dtype { .. })
    ));
    let relu_back = LowpOp {
        dir: ConvDir::BackwardData,
        relu: true,
        ..fwd
    };
    let io = LowpIo {
        a: &y,
        b: &w,
        out: &x,
        bias: None,
    };
    assert!(matches!(
        run_conv_lowp(&s, &nn, &relu_back, io),
        Err(NnError::Shape(_))
    ));
    // Engines asked for what they do not run.
    let io = LowpIo {
        a: &x,
        b: &w,
        out: &y,
        bias: None,
    };
    let padded = |pad, layout| LowpEngine {
        layout,
        kind: LowpKind::CudnnGraph(0),
        pad,
    };
    for algo in [
        LowpEngine::new(l, LowpKind::Widen),
        LowpEngine::new(Layout::Nhwc, LowpKind::Direct),
        LowpEngine::new(l, LowpKind::CudnnGraphFused(0)),
        LowpEngine::new(l, LowpKind::CudnnGraph(255)),
        // Padding to no more channels than the op has, to a count no candidate uses, in NCHW.
        padded(3, Layout::Nhwc),
        padded(6, Layout::Nhwc),
        padded(4, Layout::Nchw),
    ] {
        let e = conv_lowp_with(&s, &nn, algo, &fwd, io).unwrap_err();
        println!("{algo}: {e}");
    }
    // A padded engine runs forwards only.
    let back = LowpOp {
        dir: ConvDir::BackwardData,
        ..fwd
    };
    let io_back = LowpIo {
        a: &y,
        b: &w,
        out: &x,
        bias: None,
    };
    let e = conv_lowp_with(&s, &nn, padded(4, Layout::Nhwc), &back, io_back).unwrap_err();
    assert!(matches!(e, NnError::Shape(_)), "{e}");
    // The transposes take no f16 → bf16 pair, and refuse short buffers.
    let h = s.alloc_zeroed::<f16>(xl).unwrap();
    let k = cudagraph_nn::kernels::conv_lowp::ConvLowpKernels::get(&dev).unwrap();
    // Channel padding: only to more channels, at most 8, into a destination that holds them.
    let pad_to = |c, pad, dst: &cudagraph::DeviceBuffer<bf16>| {
        k.pad_channels(&s, (2, c, 64), pad, Layout::Nchw, &x, dst)
    };
    let wide = s.alloc_zeroed::<bf16>(2 * 64 * 16).unwrap();
    assert!(matches!(pad_to(3, 2, &wide), Err(NnError::Shape(_))));
    assert!(matches!(pad_to(3, 16, &wide), Err(NnError::Shape(_))));
    assert!(matches!(pad_to(0, 4, &wide), Err(NnError::Shape(_))));
    assert!(matches!(
        pad_to(3, 8, &short_w),
        Err(NnError::Core(cudagraph::Error::SizeMismatch { .. }))
    ));
    pad_to(3, 8, &wide).unwrap();
    assert!(matches!(
        k.transpose(&s, 2, 3, 64, &h, &x),
        Err(NnError::Dtype { .. })
    ));
    assert!(matches!(
        relayout(&s, (2, 3, 8, 8), Layout::Nchw, Layout::Nhwc, &x, &short),
        Err(NnError::Core(cudagraph::Error::SizeMismatch { .. }))
    ));
    // Nothing above ran a kernel on bad memory: the stream is still healthy.
    conv2d_lowp_forward(&s, &nn, &sh, l, &x, &w, Some(&b), true, &y).unwrap();
    s.synchronize().unwrap();
}

/// The f64 reference itself (no GPU): without dilation in NCHW it equals the crate's
/// `cpu::Conv`; a dilated kernel equals `cpu::Conv` with the dense kernel that has zeros
/// between the taps; in NHWC it is the NCHW reference permuted.
#[test]
fn the_reference_agrees_with_cpu_conv_and_between_layouts() {
    let mut rng = HostRng::new(2808);
    let close = |a: &[f64], b: &[f64], what: &str| {
        assert_eq!(a.len(), b.len(), "{what}");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-12 * (1.0 + y.abs()),
                "{what}[{i}]: {x} vs {y}"
            );
        }
    };
    for (sh, dense_k) in [
        (shape(2, 3, 11, 13, 5, (3, 3), 2, 1, 1), 3),
        (shape(2, 5, 9, 9, 3, (3, 3), 1, 2, 2), 5),
    ] {
        let g = sh.geom;
        let d = sh.dilation;
        let x = f64s(&rng.vec_normal(sh.input_len().unwrap()));
        let w = f64s(&rng.vec_normal(sh.weight_len().unwrap()));
        let dy = f64s(&rng.vec_normal(sh.output_len().unwrap()));
        let r = reference(&sh, Layout::Nchw, &x, &w, &dy);
        // The dense kernel: tap (r, s) of the dilated one at (d·r, d·s).
        let mut dense = vec![0.0; g.oc * g.c * dense_k * dense_k];
        for k in 0..g.oc {
            for c in 0..g.c {
                for kr in 0..g.kh {
                    for ks in 0..g.kw {
                        dense[((k * g.c + c) * dense_k + d * kr) * dense_k + d * ks] =
                            w[wt(Layout::Nchw, k, c, kr, ks, g.c, g.kh, g.kw)];
                    }
                }
            }
        }
        let cv = cpu::Conv {
            n: g.n,
            c: g.c,
            h: g.h,
            w: g.w,
            oc: g.oc,
            k: dense_k,
            stride: g.stride,
            pad: g.pad,
        };
        assert_eq!(cv.out_hw(), sh.out_hw().unwrap());
        close(&r.y, &cv.forward(&x, &dense, &vec![0.0; g.oc]), "y");
        let (dx, ddense, _) = cv.backward(&x, &dense, &dy);
        close(&r.dx, &dx, "dx");
        for k in 0..g.oc {
            for c in 0..g.c {
                for kr in 0..g.kh {
                    for ks in 0..g.kw {
                        let got = r.dw[wt(Layout::Nchw, k, c, kr, ks, g.c, g.kh, g.kw)];
                        let want = ddense[((k * g.c + c) * dense_k + d * kr) * dense_k + d * ks];
                        assert!((got - want).abs() <= 1e-12 * (1.0 + want.abs()), "dw");
                    }
                }
            }
        }
        // NHWC: the same numbers, permuted.
        let (oh, ow) = sh.out_hw().unwrap();
        let to_nhwc = |v: &[f64], c: usize, h: usize, w: usize| {
            let mut out = vec![0.0; v.len()];
            for n in 0..g.n {
                for ci in 0..c {
                    for hi in 0..h {
                        for wi in 0..w {
                            out[act(Layout::Nhwc, n, ci, hi, wi, c, h, w)] =
                                v[act(Layout::Nchw, n, ci, hi, wi, c, h, w)];
                        }
                    }
                }
            }
            out
        };
        let w_nhwc = {
            let mut out = vec![0.0; w.len()];
            for k in 0..g.oc {
                for c in 0..g.c {
                    for kr in 0..g.kh {
                        for ks in 0..g.kw {
                            out[wt(Layout::Nhwc, k, c, kr, ks, g.c, g.kh, g.kw)] =
                                w[wt(Layout::Nchw, k, c, kr, ks, g.c, g.kh, g.kw)];
                        }
                    }
                }
            }
            out
        };
        let rn = reference(
            &sh,
            Layout::Nhwc,
            &to_nhwc(&x, g.c, g.h, g.w),
            &w_nhwc,
            &to_nhwc(&dy, g.oc, oh, ow),
        );
        close(&rn.y, &to_nhwc(&r.y, g.oc, oh, ow), "nhwc y");
        close(&rn.ys, &to_nhwc(&r.ys, g.oc, oh, ow), "nhwc scale");
        close(&rn.dx, &to_nhwc(&r.dx, g.c, g.h, g.w), "nhwc dx");
        let mut dw_nhwc = vec![0.0; w.len()];
        for k in 0..g.oc {
            for c in 0..g.c {
                for kr in 0..g.kh {
                    for ks in 0..g.kw {
                        dw_nhwc[wt(Layout::Nhwc, k, c, kr, ks, g.c, g.kh, g.kw)] =
                            r.dw[wt(Layout::Nchw, k, c, kr, ks, g.c, g.kh, g.kw)];
                    }
                }
            }
        }
        close(&rn.dw, &dw_nhwc, "nhwc dw");
        // The epilogue's channel follows the layout.
        let b: Vec<f64> = (0..g.oc).map(|k| k as f64 - 1.5).collect();
        let (ye, _) = with_epilogue(&sh, Layout::Nchw, (&r.y, &r.ys), Some(&b), true);
        let (yn, _) = with_epilogue(&sh, Layout::Nhwc, (&rn.y, &rn.ys), Some(&b), true);
        close(&yn, &to_nhwc(&ye, g.oc, oh, ow), "nhwc epilogue");
        assert!(ye.iter().all(|&v| v >= 0.0));
    }
}
