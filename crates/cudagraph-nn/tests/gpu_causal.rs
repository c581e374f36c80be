//! GPU tests of causal self-attention for training (`causal_attention`) and of `add`: the
//! output and the gradients of the packed query, key and value against an f64 reference
//! written here, in f32, bf16 and f16, at odd sizes (1, 5, 9, 17, 33, 40, 70 and 257 tokens;
//! head_dim 5, 8, 12, 16, 40, 64 and 128; one and several sequences and heads); replay of a
//! captured forward and backward equal to eager bit for bit; misuse as typed errors.
//!
//! Tolerances, `|got − want| ≤ atol · max|want| + rtol · |want|` per tensor, against the f64
//! reference computed from the same (rounded) inputs: f32 rtol 1e-4, atol 1e-4 (f32 dot
//! products and softmax, sums over up to 257 terms); bf16 rtol 2e-2, atol 2e-2 and f16 rtol
//! 4e-3, atol 4e-3. In 16 bits the output is rounded once (2^-8 and 2^-11 relative), and the
//! backward's `delta = dout · out` uses the rounded output, as FlashAttention's does: an error
//! of about √head_dim half-units of the output's last place in `delta`, which moves every
//! gradient by that much times `|k|`, `|q|` (hence the tolerance relative to the tensor's
//! largest value).

use cudagraph::memory::{bf16, f16};
use cudagraph::testing::assert_bits_eq;
use cudagraph::{gpu_test_device, CaptureOptions, Graph, Stream};
use cudagraph_nn::*;

fn values(rng: &mut HostRng, n: usize, scale: f32, d: Dtype) -> Vec<f32> {
    rng.vec_normal(n)
        .into_iter()
        .map(|v| d.round(v * scale))
        .collect()
}

fn tol(d: Dtype) -> (f64, f64) {
    match d {
        Dtype::F32 => (1e-4, 1e-4),
        Dtype::Bf16 => (2e-2, 2e-2),
        Dtype::F16 => (4e-3, 4e-3),
    }
}

fn check(what: &str, got: &[f32], want: &[f64], (rtol, atol): (f64, f64)) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let top = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let e = (g as f64 - w).abs();
        assert!(
            e <= atol * top + rtol * w.abs(),
            "{what}[{i}]: {g:e}, want {w:e} (rtol {rtol:e}, atol {atol:e} · {top:e})"
        );
    }
}

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

/// An input of type `d` that needs a gradient: an f32 parameter cast to `d` (its gradient is
/// the input's, widened exactly).
fn input(s: &Stream, name: &str, v: &[f32], shape: &[usize], d: Dtype) -> (Parameter, Tensor) {
    let p = Parameter::from_host(s, name, v, shape).unwrap();
    let t = p.tensor().to_dtype(s, d).unwrap();
    (p, t)
}

fn grad(s: &Stream, p: &Parameter) -> Vec<f32> {
    s.to_vec(&p.grad().unwrap().expect("a gradient")).unwrap()
}

/// `(out, dqkv)` of causal attention in f64: `qkv: [b·t, 3·h·d]`, `dout: [b·t, h·d]`.
fn reference(
    qkv: &[f32],
    dout: &[f32],
    (batch, tokens, heads, hd): (usize, usize, usize, usize),
) -> (Vec<f64>, Vec<f64>) {
    let c = heads * hd;
    let scale = 1.0 / (hd as f64).sqrt();
    let mut out = vec![0.0; batch * tokens * c];
    let mut dx = vec![0.0; batch * tokens * 3 * c];
    let at = |row: usize, part: usize, h: usize, d: usize| row * 3 * c + part * c + h * hd + d;
    for b in 0..batch {
        for h in 0..heads {
            let row = |t: usize| b * tokens + t;
            // p[t][s] for s ≤ t.
            let mut p = vec![vec![0.0f64; tokens]; tokens];
            for t in 0..tokens {
                let sc: Vec<f64> = (0..=t)
                    .map(|s| {
                        (0..hd)
                            .map(|d| {
                                qkv[at(row(t), 0, h, d)] as f64 * qkv[at(row(s), 1, h, d)] as f64
                            })
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = sc.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v));
                let z: f64 = sc.iter().map(|v| (v - m).exp()).sum();
                for s in 0..=t {
                    p[t][s] = (sc[s] - m).exp() / z;
                }
                for d in 0..hd {
                    out[row(t) * c + h * hd + d] = (0..=t)
                        .map(|s| p[t][s] * qkv[at(row(s), 2, h, d)] as f64)
                        .sum();
                }
            }
            for t in 0..tokens {
                let dp: Vec<f64> = (0..=t)
                    .map(|s| {
                        (0..hd)
                            .map(|d| {
                                dout[row(t) * c + h * hd + d] as f64
                                    * qkv[at(row(s), 2, h, d)] as f64
                            })
                            .sum()
                    })
                    .collect();
                let delta: f64 = (0..=t).map(|s| p[t][s] * dp[s]).sum();
                for s in 0..=t {
                    let ds = p[t][s] * (dp[s] - delta);
                    for d in 0..hd {
                        dx[at(row(t), 0, h, d)] += scale * ds * qkv[at(row(s), 1, h, d)] as f64;
                        dx[at(row(s), 1, h, d)] += scale * ds * qkv[at(row(t), 0, h, d)] as f64;
                        dx[at(row(s), 2, h, d)] += p[t][s] * dout[row(t) * c + h * hd + d] as f64;
                    }
                }
            }
        }
    }
    (out, dx)
}

fn case(s: &Stream, d: Dtype, (batch, tokens, heads, hd): (usize, usize, usize, usize)) {
    let what = format!("{d} batch {batch} tokens {tokens} heads {heads} head_dim {hd}");
    let mut rng = HostRng::new((batch * 1000 + tokens * 10 + hd) as u64);
    let (rows, c) = (batch * tokens, heads * hd);
    let xv = values(&mut rng, rows * 3 * c, 1.0, d);
    let dyv = values(&mut rng, rows * c, 1.0, d);
    let (px, x) = input(s, "qkv", &xv, &[rows, 3 * c], d);
    let y = causal_attention(s, &x, batch, heads).unwrap();
    assert_eq!((y.dtype(), y.shape()), (d, &[rows, c][..]), "{what}");
    y.backward_with(s, upload(s, &dyv, &[rows, c], d)).unwrap();
    let (out, dx) = reference(&xv, &dyv, (batch, tokens, heads, hd));
    check(&format!("{what} out"), &y.to_vec(s).unwrap(), &out, tol(d));
    let g = grad(s, &px);
    // Query, key and value parts checked apart (each against its own largest value).
    for (part, name) in ["dq", "dk", "dv"].iter().enumerate() {
        let pick = |v: &[f32]| -> Vec<f32> {
            v.chunks(3 * c)
                .flat_map(|r| r[part * c..(part + 1) * c].to_vec())
                .collect()
        };
        let want: Vec<f64> = dx
            .chunks(3 * c)
            .flat_map(|r| r[part * c..(part + 1) * c].to_vec())
            .collect();
        check(&format!("{what} {name}"), &pick(&g), &want, tol(d));
    }
}

#[test]
fn causal_attention_forward_and_backward_match_f64_in_three_types() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for d in Dtype::ALL {
        for shape in [(2, 5, 2, 16), (1, 1, 3, 8), (1, 33, 3, 40), (3, 17, 2, 128)] {
            case(&s, d, shape);
        }
    }
    // A longer sequence, f32 and bf16 (the reference is cubic in the tokens).
    case(&s, Dtype::F32, (1, 257, 2, 64));
    case(&s, Dtype::Bf16, (1, 257, 2, 64));
}

/// Head dimensions that are not a multiple of the 16-byte loads (8 elements in 16 bits, 4 in
/// f32): the kernels' one-element staging; 70 tokens cross key tiles (32) and blocks (16 and 8
/// rows) unevenly.
#[test]
fn causal_attention_matches_f64_at_head_dims_off_the_vector_width_and_across_tiles() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for d in Dtype::ALL {
        for shape in [(1, 9, 1, 5), (2, 40, 2, 12), (1, 70, 1, 64)] {
            case(&s, d, shape);
        }
    }
}

#[test]
fn a_captured_attention_forward_and_backward_replays_equal_to_eager() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(7);
    let (batch, tokens, heads, hd) = (2, 19, 2, 32);
    let (rows, c) = (batch * tokens, heads * hd);
    for d in Dtype::ALL {
        let xv = values(&mut rng, rows * 3 * c, 1.0, d);
        let dyv = values(&mut rng, rows * c, 1.0, d);
        let p = Parameter::from_host(&s, "qkv", &xv, &[rows, 3 * c]).unwrap();
        let dy = upload(&s, &dyv, &[rows, c], d);
        let run = |q: &dyn cudagraph::Queue| -> Result<Tensor> {
            p.zero_grad(q, true)?;
            let y = causal_attention(q, &p.tensor().to_dtype(q, d)?, batch, heads)?;
            y.backward_with(q, dy.clone())?;
            Ok(y)
        };
        let eager_y = run(&s).unwrap().to_vec(&s).unwrap();
        let eager_g = grad(&s, &p);
        let (g, y) = Graph::capture(&mut s, CaptureOptions::new(), |cs| Ok(run(cs)?)).unwrap();
        for _ in 0..3 {
            g.replay(&s).unwrap();
            assert_bits_eq(&y.to_vec(&s).unwrap(), &eager_y, format!("{d} output"));
            assert_bits_eq(&grad(&s, &p), &eager_g, format!("{d} gradient"));
        }
    }
}

#[test]
fn add_sums_in_the_shared_type_promotes_mixed_types_and_passes_the_gradient_to_both() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(3);
    let n = 37;
    for (da, db) in [
        (Dtype::F32, Dtype::F32),
        (Dtype::Bf16, Dtype::Bf16),
        (Dtype::F16, Dtype::F16),
        (Dtype::F32, Dtype::Bf16),
        (Dtype::Bf16, Dtype::F16),
    ] {
        let av = values(&mut rng, n, 1.0, da);
        let bv = values(&mut rng, n, 1.0, db);
        let out = if da == db { da } else { Dtype::F32 };
        let dyv = values(&mut rng, n, 1.0, out);
        let (pa, a) = input(&s, "a", &av, &[n], da);
        let (pb, b) = input(&s, "b", &bv, &[n], db);
        let y = add(&s, &a, &b).unwrap();
        assert_eq!(y.dtype(), out, "{da} + {db}");
        // One rounding of the exact f32 sum (the inputs are exact in their types).
        let want: Vec<f32> = av.iter().zip(&bv).map(|(x, z)| out.round(x + z)).collect();
        assert_bits_eq(&y.to_vec(&s).unwrap(), &want, format!("{da} + {db}"));
        y.backward_with(&s, upload(&s, &dyv, &[n], out)).unwrap();
        // Each input's gradient is dy, in its own type (a narrowing rounds once).
        let ga: Vec<f32> = dyv.iter().map(|&v| da.round(v)).collect();
        let gb: Vec<f32> = dyv.iter().map(|&v| db.round(v)).collect();
        assert_bits_eq(&grad(&s, &pa), &ga, format!("{da} + {db}: da"));
        assert_bits_eq(&grad(&s, &pb), &gb, format!("{da} + {db}: db"));
    }
    // x + x: both uses add up (the shared gradient is copied before it is added into).
    let xv = values(&mut rng, n, 1.0, Dtype::F32);
    let (px, x) = input(&s, "x", &xv, &[n], Dtype::F32);
    let y = add(&s, &x, &x).unwrap();
    let dyv = values(&mut rng, n, 1.0, Dtype::F32);
    y.backward_with(&s, upload(&s, &dyv, &[n], Dtype::F32))
        .unwrap();
    let twice: Vec<f32> = dyv.iter().map(|v| 2.0 * v).collect();
    assert_bits_eq(&grad(&s, &px), &twice, "x + x");
}

fn is_shape<T: std::fmt::Debug>(r: Result<T>) -> bool {
    matches!(r, Err(NnError::Shape(_)))
}

#[test]
fn misuse_is_a_typed_error() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let x = Tensor::zeros(&s, &[6, 24]).unwrap();
    assert!(causal_attention(&s, &x, 2, 2).is_ok());
    // Rows not a multiple of the sequences; width not three times a multiple of the heads.
    assert!(is_shape(causal_attention(&s, &x, 4, 2)));
    assert!(is_shape(causal_attention(&s, &x, 2, 3)));
    assert!(is_shape(causal_attention(&s, &x, 0, 2)));
    assert!(is_shape(causal_attention(&s, &x, 2, 0)));
    assert!(is_shape(causal_attention(
        &s,
        &Tensor::zeros(&s, &[24]).unwrap(),
        1,
        1
    )));
    // head_dim 129 is past the kernels' 128.
    let wide = Tensor::zeros(&s, &[2, 3 * 129]).unwrap();
    assert!(is_shape(causal_attention(&s, &wide, 1, 1)));
    // A gradient of another type than the output's is a dtype error, not a wrong read.
    let (p, xt) = input(&s, "qkv", &[0.5; 6 * 24], &[6, 24], Dtype::Bf16);
    let y = causal_attention(&s, &xt, 2, 2).unwrap();
    let wrong = upload(&s, &[1.0; 6 * 8], &[6, 8], Dtype::F32);
    assert!(matches!(
        y.backward_with(&s, wrong),
        Err(NnError::Dtype { .. })
    ));
    drop(p);
    // add: shapes differ.
    let a = Tensor::zeros(&s, &[3, 4]).unwrap();
    let b = Tensor::zeros(&s, &[4, 3]).unwrap();
    assert!(is_shape(add(&s, &a, &b)));
}
