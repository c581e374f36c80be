//! GPU tests of the transformer layers (`autograd::transformer`): LayerNorm, RMSNorm, GELU
//! (erf and tanh), SiLU, SwiGLU, rotary embeddings (both layouts, partial rotation, Llama 3
//! scaling) and embedding lookup, forward and backward in f32, bf16 and f16 against f64
//! references written here, at odd sizes (hidden 7, 33 and 4096; 1 and 5 tokens); NaN and
//! infinity as PyTorch gives them; autocast's types; replay of a captured forward and backward
//! equal to eager bit for bit; a captured rotary step reading advanced positions; and misuse
//! as typed errors.
//!
//! Tolerances, `|got - want| ≤ atol + rtol · |want|` against the f64 reference computed from
//! the same (rounded) inputs: f32 outputs rtol 1e-4, atol 1e-5 (f32 arithmetic, sums over up
//! to 4096 terms); bf16 rtol 1e-2, atol 1e-3 and f16 rtol 2e-3, atol 1e-4 (one rounding on
//! store, which an f32 error at a rounding boundary can move by one unit: 2^-7 and 2^-10
//! relative). Weight gradients are f32 whatever the input type: f32 tolerances, scaled by the
//! sum of the magnitudes of the terms.

use std::sync::Arc;

use cudagraph::memory::{bf16, f16};
use cudagraph::testing::assert_bits_eq;
use cudagraph::{gpu_test_device, CaptureOptions, DeviceBuffer, Graph, Queue, Stream};
use cudagraph_nn::*;

// ---- Helpers -------------------------------------------------------------------------------

/// `n` normal values scaled by `scale`, rounded to `d` (exact in `d`).
fn values(rng: &mut HostRng, n: usize, scale: f32, d: Dtype) -> Vec<f32> {
    rng.vec_normal(n)
        .into_iter()
        .map(|v| d.round(v * scale))
        .collect()
}

/// `(rtol, atol)` of an output of type `d`.
fn tol(d: Dtype) -> (f64, f64) {
    match d {
        Dtype::F32 => (1e-4, 1e-5),
        Dtype::Bf16 => (1e-2, 1e-3),
        Dtype::F16 => (2e-3, 1e-4),
    }
}

/// Every `got[i]` within `atol + rtol · |want[i]|` (NaN where the reference is NaN, the same
/// infinity where it is infinite).
fn check(what: &str, got: &[f32], want: &[f64], (rtol, atol): (f64, f64)) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = g as f64;
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: {g:e}, want NaN");
        } else if w.is_infinite() {
            assert_eq!(g, w, "{what}[{i}]");
        } else {
            assert!(
                (g - w).abs() <= atol + rtol * w.abs(),
                "{what}[{i}]: {g:e}, want {w:e} (rtol {rtol:e}, atol {atol:e})"
            );
        }
    }
}

/// A tensor of type `d` holding `v` (already exact in `d`), needing no gradient.
fn upload(s: &Stream, v: &[f32], shape: &[usize], d: Dtype) -> Tensor {
    match d {
        Dtype::F32 => Tensor::from_host(s, v, shape).unwrap(),
        Dtype::Bf16 => {
            let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
            Tensor::from_host_as(s, &h, shape).unwrap()
        }
        Dtype::F16 => {
            let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            Tensor::from_host_as(s, &h, shape).unwrap()
        }
    }
}

/// An input of type `d` that needs a gradient: an f32 parameter holding `v` (exact in `d`)
/// cast to `d`; the parameter's gradient is the input's gradient widened exactly.
fn input(s: &Stream, name: &str, v: &[f32], shape: &[usize], d: Dtype) -> (Parameter, Tensor) {
    let p = Parameter::from_host(s, name, v, shape).unwrap();
    let t = p.tensor().to_dtype(s, d).unwrap();
    assert_eq!(t.dtype(), d);
    (p, t)
}

fn grad(s: &Stream, p: &Parameter) -> Vec<f32> {
    s.to_vec(&p.grad().unwrap().expect("a gradient")).unwrap()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn ids_buffer(s: &Stream, ids: &[i32]) -> Arc<DeviceBuffer<i32>> {
    Arc::new(s.alloc_from_host(ids).unwrap())
}

// ---- f64 references ------------------------------------------------------------------------

/// erf in f64: its Taylor series up to |z| = 4 (terms below 2^-60 of the largest), ±1 past it
/// (erfc(4) < 1.6e-8, far below every tolerance here at the arguments used).
fn erf(z: f64) -> f64 {
    if z.is_nan() {
        return z;
    }
    if z.abs() > 4.0 {
        return z.signum();
    }
    let (mut sum, mut term, z2) = (z, z, z * z);
    for n in 1..200 {
        term *= -z2 / n as f64;
        let t = term / (2 * n + 1) as f64;
        sum += t;
        if t.abs() < 1e-18 * sum.abs().max(1e-300) {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

fn gelu_ref(x: f64, tanh: bool) -> f64 {
    if tanh {
        let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
        0.5 * x * (1.0 + u.tanh())
    } else {
        0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
    }
}

fn gelu_grad_ref(x: f64, tanh: bool) -> f64 {
    if tanh {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let u = c * (x + 0.044715 * x * x * x);
        let t = u.tanh();
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
    } else {
        let cdf = 0.5 * (1.0 + erf(x / std::f64::consts::SQRT_2));
        cdf + x * (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// LayerNorm (`centered`) or RMSNorm rows: `(y, dx, dw, db, |terms| of dw)`.
#[allow(clippy::type_complexity)]
fn norm_ref(
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    dy: &[f32],
    cols: usize,
    eps: f64,
    centered: bool,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = x.len() / cols;
    let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    let (mut dw, mut db, mut mag) = (vec![0.0; cols], vec![0.0; cols], vec![0.0; cols]);
    for r in 0..rows {
        let xr: Vec<f64> = f64s(&x[r * cols..(r + 1) * cols]);
        let dyr: Vec<f64> = f64s(&dy[r * cols..(r + 1) * cols]);
        let mean = if centered {
            xr.iter().sum::<f64>() / cols as f64
        } else {
            0.0
        };
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / cols as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        let xh: Vec<f64> = xr.iter().map(|v| (v - mean) * rstd).collect();
        let g: Vec<f64> = (0..cols).map(|c| dyr[c] * w[c] as f64).collect();
        let mg = if centered {
            g.iter().sum::<f64>() / cols as f64
        } else {
            0.0
        };
        let mgx = (0..cols).map(|c| g[c] * xh[c]).sum::<f64>() / cols as f64;
        for c in 0..cols {
            y[r * cols + c] = xh[c] * w[c] as f64 + b.map_or(0.0, |b| b[c] as f64);
            dx[r * cols + c] = rstd * (g[c] - mg - xh[c] * mgx);
            dw[c] += dyr[c] * xh[c];
            db[c] += dyr[c];
            mag[c] += (dyr[c] * xh[c]).abs() + dyr[c].abs();
        }
    }
    (y, dx, dw, db, mag)
}

/// Rotary reference: `x: [tokens, heads, head_dim]`, the angle `pos · f` taken in f32 as on
/// the device, then rotated in f64 (`inverse`: by minus the angle).
#[allow(clippy::too_many_arguments)]
fn rope_ref(
    x: &[f32],
    pos: &[i32],
    inv_freq: &[f32],
    heads: usize,
    head_dim: usize,
    every_two: bool,
    inverse: bool,
) -> Vec<f64> {
    let rot = inv_freq.len() * 2;
    let mut y = f64s(x);
    let tokens = x.len() / (heads * head_dim);
    for (t, &p) in pos.iter().enumerate().take(tokens) {
        for h in 0..heads {
            let base = (t * heads + h) * head_dim;
            for (k, &f) in inv_freq.iter().enumerate() {
                let angle = (p as f32 * f) as f64;
                let (sn, cs) = angle.sin_cos();
                let sn = if inverse { -sn } else { sn };
                let (ia, ib) = if every_two {
                    (base + 2 * k, base + 2 * k + 1)
                } else {
                    (base + k, base + k + rot / 2)
                };
                let (a, b) = (x[ia] as f64, x[ib] as f64);
                y[ia] = a * cs - b * sn;
                y[ib] = b * cs + a * sn;
            }
        }
    }
    y
}

// ---- Norms ---------------------------------------------------------------------------------

/// Sizes: (tokens, hidden).
const NORM_SIZES: [(usize, usize); 6] = [(1, 7), (5, 7), (1, 33), (5, 33), (1, 4096), (5, 4096)];

fn norm_case(s: &Stream, d: Dtype, (rows, cols): (usize, usize), layer: bool, with_bias: bool) {
    let mut rng = HostRng::new((rows * 131 + cols) as u64);
    let what = format!(
        "{} {d} [{rows}, {cols}]{}",
        if layer { "layer_norm" } else { "rms_norm" },
        if with_bias { "" } else { " no bias" }
    );
    // Inputs off zero mean and unit scale, so centering and scaling both matter.
    let xv: Vec<f32> = values(&mut rng, rows * cols, 1.5, Dtype::F32)
        .into_iter()
        .map(|v| d.round(v + 0.75))
        .collect();
    let wv: Vec<f32> = rng.vec_normal(cols).iter().map(|v| 1.0 + 0.5 * v).collect();
    let bv = rng.vec_normal(cols);
    let dyv = values(&mut rng, rows * cols, 1.0, d);
    let eps = 1e-5;
    let (px, x) = input(s, "x", &xv, &[rows, cols], d);
    let w = Parameter::from_host(s, "weight", &wv, &[cols]).unwrap();
    let b = Parameter::from_host(s, "bias", &bv, &[cols]).unwrap();
    let y = if layer {
        let bt = b.tensor();
        layer_norm(s, &x, &w.tensor(), with_bias.then_some(&bt), eps).unwrap()
    } else {
        rms_norm(s, &x, &w.tensor(), eps).unwrap()
    };
    assert_eq!((y.dtype(), y.shape()), (d, &[rows, cols][..]), "{what}");
    y.backward_with(s, upload(s, &dyv, &[rows, cols], d))
        .unwrap();
    let bias_ref = (layer && with_bias).then_some(&bv[..]);
    let (yr, dxr, dwr, dbr, mag) = norm_ref(&xv, &wv, bias_ref, &dyv, cols, eps as f64, layer);
    check(&format!("{what} y"), &y.to_vec(s).unwrap(), &yr, tol(d));
    // The input gradient: in d, then widened exactly by the cast's backward.
    check(&format!("{what} dx"), &grad(s, &px), &dxr, tol(d));
    // Weight and bias gradients: f32 sums over rows, compared against the terms' magnitude.
    let (rtol, _) = tol(Dtype::F32);
    let scaled = |got: &[f32], want: &[f64], what: &str| {
        for c in 0..cols {
            let e = (got[c] as f64 - want[c]).abs();
            assert!(
                e <= rtol * (mag[c] + 1.0),
                "{what}[{c}]: {} vs {}",
                got[c],
                want[c]
            );
        }
    };
    scaled(&grad(s, &w), &dwr, &format!("{what} dweight"));
    if layer && with_bias {
        scaled(&grad(s, &b), &dbr, &format!("{what} dbias"));
    } else {
        assert!(
            b.grad().unwrap().is_none(),
            "{what}: a bias not used has no gradient"
        );
    }
}

#[test]
fn layer_norm_forward_and_backward_match_f64_in_three_types() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for d in Dtype::ALL {
        for size in NORM_SIZES {
            norm_case(&s, d, size, true, true);
        }
        norm_case(&s, d, (5, 33), true, false);
    }
}

#[test]
fn rms_norm_forward_and_backward_match_f64_in_three_types() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for d in Dtype::ALL {
        for size in NORM_SIZES {
            norm_case(&s, d, size, false, false);
        }
    }
}

#[test]
fn a_nan_or_inf_in_a_row_touches_that_row_only_as_pytorch_does() {
    // As PyTorch's layer_norm: the row's mean or variance is NaN or infinite, the row NaN.
    // rms_norm: a NaN makes the mean square NaN (the row NaN); an infinity makes it infinite,
    // rsqrt 0, so the row is 0 but for the infinity itself (inf · 0 = NaN).
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let cols = 33;
    for d in Dtype::ALL {
        for bad in [f32::NAN, f32::INFINITY] {
            let mut xv = values(&mut HostRng::new(9), 3 * cols, 1.0, d);
            xv[cols + 4] = bad;
            let x = upload(&s, &xv, &[3, cols], d);
            let w = Tensor::full(&s, &[cols], 1.0).unwrap();
            let b = Tensor::zeros(&s, &[cols]).unwrap();
            for (rms, y) in [
                (false, layer_norm(&s, &x, &w, Some(&b), 1e-5).unwrap()),
                (true, rms_norm(&s, &x, &w, 1e-6).unwrap()),
            ] {
                let y = y.to_vec(&s).unwrap();
                assert!(y[..cols].iter().all(|v| v.is_finite()), "{d} {bad}: row 0");
                assert!(
                    y[2 * cols..].iter().all(|v| v.is_finite()),
                    "{d} {bad}: row 2"
                );
                let row = &y[cols..2 * cols];
                if rms && bad.is_infinite() {
                    for (c, v) in row.iter().enumerate() {
                        assert!(if c == 4 { v.is_nan() } else { *v == 0.0 }, "{d} [{c}] {v}");
                    }
                } else {
                    assert!(row.iter().all(|v| v.is_nan()), "{d} {bad} rms={rms}: row 1");
                }
            }
        }
    }
}

#[test]
fn norms_run_in_f32_under_autocast_and_other_ops_in_their_input_type() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let cols = 33;
    let xv = values(&mut HostRng::new(3), 5 * cols, 1.0, Dtype::Bf16);
    let (px, x) = input(&s, "x", &xv, &[5, cols], Dtype::Bf16);
    let w = Parameter::from_host(&s, "weight", &vec![1.0; cols], &[cols]).unwrap();
    let (y, g, a) = autocast(Dtype::Bf16, || {
        let y = layer_norm(&s, &x, &w.tensor(), None, 1e-5).unwrap();
        let r = rms_norm(&s, &x, &w.tensor(), 1e-5).unwrap();
        assert_eq!(r.dtype(), Dtype::F32, "rms_norm widens under autocast");
        let g = gelu(&s, &x, false).unwrap();
        let a = silu(&s, &Tensor::zeros(&s, &[4]).unwrap()).unwrap();
        (y, g, a)
    });
    assert_eq!(
        y.dtype(),
        Dtype::F32,
        "layer_norm is on autocast's f32 list"
    );
    assert_eq!(g.dtype(), Dtype::Bf16, "gelu runs in its input's type");
    assert_eq!(a.dtype(), Dtype::F32, "silu of an f32 input stays f32");
    // The same values as layer_norm on the input widened by hand, to the bit.
    let wide = layer_norm(
        &s,
        &x.to_dtype(&s, Dtype::F32).unwrap(),
        &w.tensor(),
        None,
        1e-5,
    )
    .unwrap();
    assert_bits_eq(
        &y.to_vec(&s).unwrap(),
        &wide.to_vec(&s).unwrap(),
        "autocast layer_norm",
    );
    // The input's gradient flows back through the cast.
    let dy = upload(&s, &vec![1.0; 5 * cols], &[5, cols], Dtype::F32);
    y.backward_with(&s, dy).unwrap();
    assert_eq!(grad(&s, &px).len(), 5 * cols);
    assert!(w.grad().unwrap().is_some());
}

// ---- Activations ---------------------------------------------------------------------------

/// Values with the special cases PyTorch defines: NaN stays NaN, gelu(+inf) = silu(+inf) =
/// +inf and gelu(-inf) = silu(-inf) = NaN (PyTorch's formulas give -inf · 0), ±0, and large
/// magnitudes.
fn activation_inputs(d: Dtype, n: usize) -> Vec<f32> {
    let mut v = values(&mut HostRng::new(5), n, 3.0, d);
    let specials = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        30.0,
        -30.0,
        1.0e4,
        -1.0e4,
    ];
    for (i, x) in specials.iter().enumerate() {
        v[i * 7] = d.round(*x);
    }
    v
}

fn is_inf_input(x: f32) -> bool {
    x.is_infinite()
}

#[test]
fn gelu_and_silu_forward_and_backward_match_f64_in_three_types() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for d in Dtype::ALL {
        for n in [71usize, 4096 + 33] {
            let xv = activation_inputs(d, n);
            let dyv = values(&mut HostRng::new(6), n, 1.0, d);
            for which in ["gelu", "gelu_tanh", "silu"] {
                let what = format!("{which} {d} n={n}");
                // Gradients only through finite inputs (an infinite one gives NaN · 0).
                let finite: Vec<f32> = xv
                    .iter()
                    .map(|&x| if is_inf_input(x) { 0.0 } else { x })
                    .collect();
                let x = upload(&s, &xv, &[n], d);
                let y = match which {
                    "gelu" => gelu(&s, &x, false),
                    "gelu_tanh" => gelu(&s, &x, true),
                    _ => silu(&s, &x),
                }
                .unwrap();
                assert_eq!(y.dtype(), d);
                let want: Vec<f64> = xv
                    .iter()
                    .map(|&x| {
                        let x = x as f64;
                        match which {
                            "gelu" => gelu_ref(x, false),
                            "gelu_tanh" => gelu_ref(x, true),
                            _ => x * sigmoid(x),
                        }
                    })
                    .map(|v| if v.is_nan() { f64::NAN } else { v })
                    .collect();
                // The f64 formulas give NaN at -inf (−inf · 0) as PyTorch's do.
                check(&format!("{what} y"), &y.to_vec(&s).unwrap(), &want, tol(d));
                let (px, xt) = input(&s, "x", &finite, &[n], d);
                let y = match which {
                    "gelu" => gelu(&s, &xt, false),
                    "gelu_tanh" => gelu(&s, &xt, true),
                    _ => silu(&s, &xt),
                }
                .unwrap();
                y.backward_with(&s, upload(&s, &dyv, &[n], d)).unwrap();
                let want: Vec<f64> = finite
                    .iter()
                    .zip(&dyv)
                    .map(|(&x, &g)| {
                        let x = x as f64;
                        let dd = match which {
                            "gelu" => gelu_grad_ref(x, false),
                            "gelu_tanh" => gelu_grad_ref(x, true),
                            _ => {
                                let sg = sigmoid(x);
                                sg * (1.0 + x * (1.0 - sg))
                            }
                        };
                        g as f64 * dd
                    })
                    .collect();
                check(&format!("{what} dx"), &grad(&s, &px), &want, tol(d));
            }
        }
    }
}

#[test]
fn swiglu_forward_and_backward_match_f64_in_three_types() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for d in Dtype::ALL {
        for (tokens, hidden) in [(1, 7), (5, 33), (5, 4096)] {
            let n = tokens * hidden;
            let mut rng = HostRng::new(n as u64);
            let (gv, uv, dyv) = (
                values(&mut rng, n, 2.0, d),
                values(&mut rng, n, 1.0, d),
                values(&mut rng, n, 1.0, d),
            );
            let (pg, gate) = input(&s, "gate", &gv, &[tokens, hidden], d);
            let (pu, up) = input(&s, "up", &uv, &[tokens, hidden], d);
            let y = swiglu(&s, &gate, &up).unwrap();
            assert_eq!((y.dtype(), y.shape()), (d, &[tokens, hidden][..]));
            y.backward_with(&s, upload(&s, &dyv, &[tokens, hidden], d))
                .unwrap();
            let (mut yr, mut dgr, mut dur) = (vec![], vec![], vec![]);
            for i in 0..n {
                let (g, u, dy) = (gv[i] as f64, uv[i] as f64, dyv[i] as f64);
                let sg = sigmoid(g);
                yr.push(g * sg * u);
                dgr.push(dy * u * sg * (1.0 + g * (1.0 - sg)));
                dur.push(dy * g * sg);
            }
            let what = format!("swiglu {d} [{tokens}, {hidden}]");
            check(&format!("{what} y"), &y.to_vec(&s).unwrap(), &yr, tol(d));
            check(&format!("{what} dgate"), &grad(&s, &pg), &dgr, tol(d));
            check(&format!("{what} dup"), &grad(&s, &pu), &dur, tol(d));
        }
    }
}

// ---- Rotary --------------------------------------------------------------------------------

/// (layout, head_dim, rotary_dim, theta, scale).
type RopeCase<'a> = (RopeLayout, usize, usize, f64, Option<&'a [f64]>);

#[test]
fn rotary_forward_and_backward_match_f64_in_both_layouts_and_three_types() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let llama3 = llama3_frequency_scale(
        64,
        500_000.0,
        &Llama3RopeScaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        },
    )
    .unwrap();
    // (layout, head_dim, rotary_dim, theta, scale): Llama 3 with its scaling, NeoX-style
    // partial rotate_half, GPT-J's partial rotate_every_two, a tiny head.
    let cases: [RopeCase<'_>; 4] = [
        (RopeLayout::RotateHalf, 64, 64, 500_000.0, Some(&llama3)),
        (RopeLayout::RotateHalf, 32, 8, 10_000.0, None),
        (RopeLayout::RotateEveryTwo, 16, 8, 10_000.0, None),
        (RopeLayout::RotateEveryTwo, 2, 2, 10_000.0, None),
    ];
    for d in Dtype::ALL {
        for (layout, head_dim, rot, theta, scale) in cases {
            let rope = Rope::new(&s, layout, (head_dim, rot), theta, scale).unwrap();
            assert_eq!(rope.inv_freq().len(), rot / 2);
            let every_two = layout == RopeLayout::RotateEveryTwo;
            for tokens in [1usize, 5] {
                let heads = 3;
                let n = tokens * heads * head_dim;
                let mut rng = HostRng::new(n as u64 + head_dim as u64);
                let (xv, dyv) = (values(&mut rng, n, 1.0, d), values(&mut rng, n, 1.0, d));
                // Positions: 0, small, past the original context, large; the buffer is longer
                // than the tokens (the rest is not read).
                let pos: Vec<i32> = [0, 1, 8191, 70_000, 3, 999, 999][..tokens + 2].to_vec();
                let pbuf = ids_buffer(&s, &pos);
                let (px, x) = input(&s, "x", &xv, &[tokens, heads, head_dim], d);
                let y = rotary(&s, &x, &pbuf, &rope).unwrap();
                assert_eq!(y.dtype(), d);
                y.backward_with(&s, upload(&s, &dyv, &[tokens, heads, head_dim], d))
                    .unwrap();
                let what = format!("rotary {layout:?} {d} hd={head_dim} rot={rot} t={tokens}");
                let f = rope.inv_freq();
                let want = rope_ref(&xv, &pos, f, heads, head_dim, every_two, false);
                check(&format!("{what} y"), &y.to_vec(&s).unwrap(), &want, tol(d));
                let want = rope_ref(&dyv, &pos, f, heads, head_dim, every_two, true);
                check(&format!("{what} dx"), &grad(&s, &px), &want, tol(d));
            }
        }
    }
}

#[test]
fn rope_frequencies_are_the_scaled_powers_of_theta_rounded_once() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let scale: Vec<f64> = (0..4).map(|k| 1.0 / (k + 1) as f64).collect();
    let rope = Rope::new(&s, RopeLayout::RotateHalf, (8, 8), 10_000.0, Some(&scale)).unwrap();
    for (k, &f) in rope.inv_freq().iter().enumerate() {
        let want = 10_000f64.powf(-(2.0 * k as f64) / 8.0) / (k + 1) as f64;
        assert_eq!(f, want as f32, "k = {k}");
    }
    assert_eq!(
        rope.inv_freq(),
        &rope_inv_freq(8, 10_000.0)
            .iter()
            .zip(&scale)
            .map(|(a, b)| (a * b) as f32)
            .collect::<Vec<_>>()[..]
    );
}

#[test]
fn a_captured_rotary_step_reads_the_positions_written_before_each_replay() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let rope = Rope::new(&s, RopeLayout::RotateHalf, (16, 16), 10_000.0, None).unwrap();
    let xv = values(&mut HostRng::new(8), 2 * 16, 1.0, Dtype::Bf16);
    let x = upload(&s, &xv, &[1, 2, 16], Dtype::Bf16);
    let pos = ids_buffer(&s, &[0]);
    let (g, y) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        Ok(no_grad(|| rotary(cs, &x, &pos, &rope))?)
    })
    .unwrap();
    for p in [5, 6, 7, 4000] {
        s.copy_from_host(&[p], &pos).unwrap();
        g.replay(&s).unwrap();
        let eager = no_grad(|| rotary(&s, &x, &pos, &rope)).unwrap();
        assert_bits_eq(
            &y.to_vec(&s).unwrap(),
            &eager.to_vec(&s).unwrap(),
            format!("position {p}"),
        );
        let want = rope_ref(&xv, &[p], rope.inv_freq(), 2, 16, false, false);
        check(
            "replayed rotary",
            &y.to_vec(&s).unwrap(),
            &want,
            tol(Dtype::Bf16),
        );
    }
}

// ---- Embedding -----------------------------------------------------------------------------

#[test]
fn embedding_gathers_rows_and_sums_gradients_of_repeated_ids() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let vocab = 11;
    for d in Dtype::ALL {
        for dim in [7usize, 33] {
            let wv = values(&mut HostRng::new(dim as u64), vocab * dim, 1.0, d);
            // Repeats (3 three times, 0 twice), the last id, and two out of range.
            let ids = [3, 0, 3, 10, -1, 3, 11, 0];
            let t = ids.len();
            let dyv = values(&mut HostRng::new(77), t * dim, 1.0, d);
            let (pw, w) = input(&s, "embed", &wv, &[vocab, dim], d);
            let y = embedding(&s, &ids_buffer(&s, &ids), &w).unwrap();
            assert_eq!((y.dtype(), y.shape()), (d, &[t, dim][..]));
            let got = y.to_vec(&s).unwrap();
            for (r, &id) in ids.iter().enumerate() {
                let row = &got[r * dim..(r + 1) * dim];
                if (0..vocab as i32).contains(&id) {
                    let id = id as usize;
                    assert_bits_eq(row, &wv[id * dim..(id + 1) * dim], format!("{d} row {r}"));
                } else {
                    assert!(row.iter().all(|v| *v == 0.0), "{d}: id {id} gives zeros");
                }
            }
            y.backward_with(&s, upload(&s, &dyv, &[t, dim], d)).unwrap();
            let mut want = vec![0.0f64; vocab * dim];
            for (r, &id) in ids.iter().enumerate() {
                if (0..vocab as i32).contains(&id) {
                    for c in 0..dim {
                        want[id as usize * dim + c] += dyv[r * dim + c] as f64;
                    }
                }
            }
            // Summed in f32, given in the weight's type (rounded once).
            check(
                &format!("embedding {d} dim={dim} dw"),
                &grad(&s, &pw),
                &want,
                tol(d),
            );
        }
    }
}

// ---- Replay --------------------------------------------------------------------------------

/// A small block using every op: embedding → (cast to the step's type) → rotary →
/// layer_norm → gelu and rms_norm → silu (each cast to the step's type) → swiglu → mse loss;
/// under autocast for a 16-bit step (the norms widen to f32).
struct Block {
    emb: Parameter,
    ln_w: Parameter,
    ln_b: Parameter,
    rms_w: Parameter,
    ids: Arc<DeviceBuffer<i32>>,
    pos: Arc<DeviceBuffer<i32>>,
    rope: Rope,
    target: Tensor,
}

impl Block {
    const TOKENS: usize = 5;
    const HEADS: usize = 2;
    const HEAD_DIM: usize = 16;
    const DIM: usize = 32;
    const VOCAB: usize = 13;

    fn new(s: &Stream) -> Self {
        let mut rng = HostRng::new(42);
        let (v, dm) = (Self::VOCAB, Self::DIM);
        Block {
            emb: Parameter::from_host(s, "emb", &rng.vec_normal(v * dm), &[v, dm]).unwrap(),
            ln_w: Parameter::from_host(s, "ln_w", &rng.vec_normal(dm), &[dm]).unwrap(),
            ln_b: Parameter::from_host(s, "ln_b", &rng.vec_normal(dm), &[dm]).unwrap(),
            rms_w: Parameter::from_host(s, "rms_w", &rng.vec_normal(dm), &[dm]).unwrap(),
            ids: ids_buffer(s, &[1, 4, 1, 12, 7]),
            pos: ids_buffer(s, &[0, 1, 2, 3, 4]),
            rope: Rope::new(s, RopeLayout::RotateHalf, (16, 16), 10_000.0, None).unwrap(),
            target: Tensor::from_host(s, &rng.vec_normal(Self::TOKENS * dm), &[Self::TOKENS, dm])
                .unwrap(),
        }
    }

    fn params(&self) -> [&Parameter; 4] {
        [&self.emb, &self.ln_w, &self.ln_b, &self.rms_w]
    }

    fn step(&self, q: &dyn Queue, d: Dtype) -> Result<Tensor> {
        for p in self.params() {
            p.zero_grad(q, true)?;
        }
        let (t, dm) = (Self::TOKENS, Self::DIM);
        let h = embedding(q, &self.ids, &self.emb.tensor())?.to_dtype(q, d)?;
        let h = h.reshape(&[t, Self::HEADS, Self::HEAD_DIM])?;
        let h = rotary(q, &h, &self.pos, &self.rope)?.reshape(&[t, dm])?;
        let ln = layer_norm(q, &h, &self.ln_w.tensor(), Some(&self.ln_b.tensor()), 1e-5)?;
        let a = gelu(q, &ln.to_dtype(q, d)?, true)?;
        let rms = rms_norm(q, &h, &self.rms_w.tensor(), 1e-6)?;
        let b = silu(q, &rms.to_dtype(q, d)?)?;
        assert_eq!((h.dtype(), a.dtype(), b.dtype()), (d, d, d));
        let y = swiglu(q, &a, &b)?;
        let loss = mse_loss(q, &y, &self.target, Reduction::Mean)?;
        loss.backward(q)?;
        Ok(loss)
    }
}

#[test]
fn a_captured_forward_and_backward_replays_equal_to_eager() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let block = Block::new(&s);
    for d in Dtype::ALL {
        let run = |q: &dyn Queue| match d {
            Dtype::F32 => block.step(q, d),
            d => autocast(d, || block.step(q, d)),
        };
        let eager_loss = run(&s).unwrap().to_vec(&s).unwrap();
        let eager: Vec<Vec<f32>> = block.params().iter().map(|p| grad(&s, p)).collect();
        assert!(eager_loss[0].is_finite(), "{d}");
        let (g, loss) = Graph::capture(&mut s, CaptureOptions::new(), |cs| Ok(run(cs)?)).unwrap();
        for _ in 0..3 {
            g.replay(&s).unwrap();
            assert_bits_eq(&loss.to_vec(&s).unwrap(), &eager_loss, format!("{d} loss"));
            for (p, e) in block.params().iter().zip(&eager) {
                assert_bits_eq(&grad(&s, p), e, format!("{d} gradient of {}", p.name()));
            }
        }
    }
}

// ---- Misuse --------------------------------------------------------------------------------

fn is_shape<T: std::fmt::Debug>(r: Result<T>) -> bool {
    matches!(r, Err(NnError::Shape(_)))
}

#[test]
fn misuse_is_a_typed_error() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let x = Tensor::zeros(&s, &[5, 33]).unwrap();
    let w = Tensor::full(&s, &[33], 1.0).unwrap();
    let w7 = Tensor::full(&s, &[7], 1.0).unwrap();
    // Norms: weight or bias of another size, a scalar or empty last dimension.
    assert!(is_shape(layer_norm(&s, &x, &w7, None, 1e-5)));
    assert!(is_shape(layer_norm(&s, &x, &w, Some(&w7), 1e-5)));
    assert!(is_shape(rms_norm(&s, &x, &w7, 1e-5)));
    let scalar = Tensor::zeros(&s, &[]).unwrap();
    assert!(is_shape(rms_norm(&s, &scalar, &w, 1e-5)));
    // SwiGLU: shapes and types must match.
    let other = Tensor::zeros(&s, &[5, 32]).unwrap();
    assert!(is_shape(swiglu(&s, &x, &other)));
    let x16 = x.to_dtype(&s, Dtype::Bf16).unwrap();
    assert!(matches!(swiglu(&s, &x, &x16), Err(NnError::Dtype { .. })));
    // Rotary: odd head_dim or rotary dimension, past head_dim, zero; bad theta or scale.
    for (hd, rot) in [(7, 7), (8, 7), (8, 10), (8, 0)] {
        assert!(is_shape(Rope::new(
            &s,
            RopeLayout::RotateHalf,
            (hd, rot),
            1e4,
            None
        )));
    }
    assert!(is_shape(Rope::new(
        &s,
        RopeLayout::RotateHalf,
        (8, 8),
        0.0,
        None
    )));
    assert!(is_shape(Rope::new(
        &s,
        RopeLayout::RotateHalf,
        (8, 8),
        1e4,
        Some(&[1.0; 3])
    )));
    assert!(is_shape(Rope::new(
        &s,
        RopeLayout::RotateHalf,
        (8, 8),
        1e4,
        Some(&[0.0; 4])
    )));
    let rope = Rope::new(&s, RopeLayout::RotateEveryTwo, (8, 8), 1e4, None).unwrap();
    let pos = ids_buffer(&s, &[0, 1, 2]);
    let q = Tensor::zeros(&s, &[3, 2, 8]).unwrap();
    assert!(rotary(&s, &q, &pos, &rope).is_ok());
    // Not [tokens, heads, head_dim] of the rope's head_dim; a positions buffer too short.
    assert!(is_shape(rotary(
        &s,
        &Tensor::zeros(&s, &[3, 2, 6]).unwrap(),
        &pos,
        &rope
    )));
    assert!(is_shape(rotary(
        &s,
        &Tensor::zeros(&s, &[3, 16]).unwrap(),
        &pos,
        &rope
    )));
    assert!(is_shape(rotary(
        &s,
        &Tensor::zeros(&s, &[4, 2, 8]).unwrap(),
        &pos,
        &rope
    )));
    // Embedding: the weight must be [vocab, dim].
    let ids = ids_buffer(&s, &[0, 1]);
    assert!(is_shape(embedding(
        &s,
        &ids,
        &Tensor::zeros(&s, &[4]).unwrap()
    )));
    assert!(is_shape(embedding(
        &s,
        &ids,
        &Tensor::zeros(&s, &[2, 2, 2]).unwrap()
    )));
    // A gradient of another type than the output's is a dtype error, not a wrong read.
    let (p, xt) = input(&s, "x", &[1.0; 14], &[2, 7], Dtype::F32);
    let y = gelu(&s, &xt, false).unwrap();
    let wrong = upload(&s, &[1.0; 14], &[2, 7], Dtype::F16);
    assert!(matches!(
        y.backward_with(&s, wrong),
        Err(NnError::Dtype { .. })
    ));
    drop(p);
}

/// Many tokens (three tiles of the id chains' kernel), repeated ids far apart and ids out of
/// range: the weight gradient is the f32 sum of each id's rows in token order, bit for bit.
#[test]
fn embedding_gradient_of_many_tokens_sums_each_id_in_token_order() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let (vocab, dim, t) = (13usize, 5usize, 700usize);
    let mut rng = HostRng::new(5);
    let ids: Vec<i32> = (0..t)
        .map(|i| {
            if i % 97 == 0 {
                -1
            } else {
                (rng.next_u64() % (vocab as u64 + 1)) as i32 // vocab itself is out of range
            }
        })
        .collect();
    let wv = values(&mut HostRng::new(1), vocab * dim, 1.0, Dtype::F32);
    let dyv = values(&mut HostRng::new(2), t * dim, 1.0, Dtype::F32);
    let (pw, w) = input(&s, "embed", &wv, &[vocab, dim], Dtype::F32);
    let y = embedding(&s, &ids_buffer(&s, &ids), &w).unwrap();
    y.backward_with(&s, upload(&s, &dyv, &[t, dim], Dtype::F32))
        .unwrap();
    let mut want = vec![0.0f32; vocab * dim];
    for (r, &id) in ids.iter().enumerate() {
        if (0..vocab as i32).contains(&id) {
            for c in 0..dim {
                want[id as usize * dim + c] += dyv[r * dim + c];
            }
        }
    }
    let got = grad(&s, &pw);
    assert_bits_eq(&got, &want, "embedding dw over 700 tokens");
}
