//! GPU tests of products under autocast and on 16-bit tensors (`linear` in bf16/f16 on
//! tensor cores): forward against an f64 reference computed from the exactly rounded
//! operands, gradients of f32 masters computed in f32 straight from the product, the weight
//! cast made once per scope, optimizer-style copies used instead of casts, replay of a whole
//! mixed training step equal to eager bit for bit, and misuse as typed errors.
//!
//! Tolerances. Forward: the product accumulates in f32 and rounds once to the output type,
//! so |y − ref| ≤ u·|ref| + 1e-5·Σ|x||w| with u the output's unit roundoff (2⁻⁸ bf16, 2⁻¹¹
//! f16; doubled here for the bias epilogue's extra f32 addition). Gradients: the upstream
//! gradient is rounded to the 16-bit type by the cast back (reproduced exactly on the host
//! from the device's own output), then the products accumulate in f32 with no rounding to 16
//! bits: |g − ref| ≤ 1e-5·Σ|a||b| (k ≤ 1024 terms, f32 unit roundoff 6e-8).

#![allow(clippy::needless_range_loop)] // index loops mirror the formulas

use std::sync::Arc;

use cudagraph::memory::{bf16, f16};
use cudagraph::testing::assert_bits_eq;
use cudagraph::{gpu_test_device, CaptureOptions, Graph, Queue, QueueExt, Stream};
use cudagraph_nn::*;

fn unit(d: Dtype) -> f64 {
    match d {
        Dtype::Bf16 => 2f64.powi(-8),
        Dtype::F16 => 2f64.powi(-11),
        Dtype::F32 => 2f64.powi(-24),
    }
}

struct Case {
    m: usize,
    k: usize,
    n: usize,
    bias: bool,
    relu: bool,
}

fn check_linear(s: &Stream, d: Dtype, c: &Case, seed: u64) {
    let Case {
        m,
        k,
        n,
        bias,
        relu,
    } = *c;
    let mut rng = HostRng::new(seed);
    let (xv, wv, bv, tv) = (
        rng.vec_normal(m * k),
        rng.vec_normal(n * k)
            .into_iter()
            .map(|v| v * 0.1)
            .collect::<Vec<_>>(),
        rng.vec_normal(n),
        rng.vec_normal(m * n),
    );
    let xp = Parameter::from_host(s, "x", &xv, &[m, k]).unwrap();
    let w = Parameter::from_host(s, "w", &wv, &[n, k]).unwrap();
    let b = Parameter::from_host(s, "b", &bv, &[n]).unwrap();
    let t = Tensor::from_host(s, &tv, &[m, n]).unwrap();
    let (x, wt, bt) = (xp.tensor(), w.tensor(), b.tensor());
    let y = autocast(d, || linear(s, &x, &wt, bias.then_some(&bt), relu)).unwrap();
    assert_eq!((y.dtype(), y.shape()), (d, &[m, n][..]), "{d} output");
    let loss = mse_loss(s, &y, &t, Reduction::Sum).unwrap();
    loss.backward(s).unwrap();
    let yg = y.to_vec(s).unwrap();
    let r = |v: &[f32]| v.iter().map(|&a| d.round(a) as f64).collect::<Vec<f64>>();
    let (xr, wr, br) = (r(&xv), r(&wv), r(&bv));
    let what = format!("{d} m={m} k={k} n={n} bias={bias} relu={relu}");
    // Forward.
    for i in 0..m {
        for j in 0..n {
            let (mut acc, mut mag) = (0f64, 0f64);
            for l in 0..k {
                acc += xr[i * k + l] * wr[j * k + l];
                mag += (xr[i * k + l] * wr[j * k + l]).abs();
            }
            if bias {
                acc += br[j];
                mag += br[j].abs();
            }
            if relu {
                acc = acc.max(0.0);
            }
            let got = yg[i * n + j] as f64;
            let tol = 2.0 * unit(d) * acc.abs() + 1e-5 * mag + 1e-30;
            assert!(
                (got - acc).abs() <= tol,
                "{what} y[{i},{j}]: {got} vs {acc} (tol {tol})"
            );
        }
    }
    // Gradients: g = round_d(2(y − t)) through the ReLU mask of the device's own output.
    let g: Vec<f64> = (0..m * n)
        .map(|e| {
            if relu && yg[e] <= 0.0 {
                0.0
            } else {
                d.round(2.0 * (yg[e] - tv[e])) as f64
            }
        })
        .collect();
    let dw = s.to_vec(&w.grad().unwrap().unwrap()).unwrap();
    for j in 0..n {
        for l in 0..k {
            let (mut acc, mut mag) = (0f64, 0f64);
            for i in 0..m {
                acc += g[i * n + j] * xr[i * k + l];
                mag += (g[i * n + j] * xr[i * k + l]).abs();
            }
            let got = dw[j * k + l] as f64;
            assert!(
                (got - acc).abs() <= 1e-5 * mag + 1e-30,
                "{what} dw[{j},{l}]: {got} vs {acc}"
            );
        }
    }
    let dx = s.to_vec(&xp.grad().unwrap().unwrap()).unwrap();
    for i in 0..m {
        for l in 0..k {
            let (mut acc, mut mag) = (0f64, 0f64);
            for j in 0..n {
                acc += g[i * n + j] * wr[j * k + l];
                mag += (g[i * n + j] * wr[j * k + l]).abs();
            }
            let got = dx[i * k + l] as f64;
            assert!(
                (got - acc).abs() <= 1e-5 * mag + 1e-30,
                "{what} dx[{i},{l}]: {got} vs {acc}"
            );
        }
    }
    if bias {
        let db = s.to_vec(&b.grad().unwrap().unwrap()).unwrap();
        for j in 0..n {
            let acc: f64 = (0..m).map(|i| g[i * n + j]).sum();
            let mag: f64 = (0..m).map(|i| g[i * n + j].abs()).sum();
            let got = db[j] as f64;
            assert!(
                (got - acc).abs() <= 1e-5 * mag + 1e-30,
                "{what} db[{j}]: {got} vs {acc}"
            );
        }
    } else {
        assert!(b.grad().unwrap().is_none());
    }
}

#[test]
fn autocast_linear_matches_an_f64_reference_from_the_rounded_operands() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let cases = [
        Case {
            m: 3,
            k: 40,
            n: 8,
            bias: true,
            relu: true,
        },
        Case {
            m: 64,
            k: 256,
            n: 128,
            bias: true,
            relu: false,
        },
        Case {
            m: 1,
            k: 1024,
            n: 1000,
            bias: false,
            relu: false,
        },
        Case {
            m: 33,
            k: 72,
            n: 24,
            bias: true,
            relu: true,
        },
    ];
    for d in [Dtype::Bf16, Dtype::F16] {
        for (i, c) in cases.iter().enumerate() {
            check_linear(&s, d, c, 10 + i as u64);
        }
    }
}

#[test]
fn sixteen_bit_tensors_run_linear_without_autocast_and_accumulate_a_reused_input() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let (m, k) = (16, 48);
    let v = HostRng::new(3).vec_normal(m * k);
    for d in [Dtype::Bf16, Dtype::F16] {
        let p = Parameter::from_host(&s, "x", &v, &[m, k]).unwrap();
        let x = p.tensor().to_dtype(&s, d).unwrap();
        // x·xᵀ: x is both operands, so its gradient is the sum of two products.
        let y = linear(&s, &x, &x, None, false).unwrap();
        assert_eq!(y.dtype(), d);
        let loss = mse_loss(&s, &y, &Tensor::zeros(&s, &[m, m]).unwrap(), Reduction::Sum).unwrap();
        loss.backward(&s).unwrap();
        let yg = y.to_vec(&s).unwrap();
        let xr: Vec<f64> = v.iter().map(|&a| d.round(a) as f64).collect();
        let g: Vec<f64> = yg.iter().map(|&a| d.round(2.0 * a) as f64).collect();
        let got = s.to_vec(&p.grad().unwrap().unwrap()).unwrap();
        for i in 0..m {
            for l in 0..k {
                // d/dx[i,l] of Σ y² with y = x xᵀ: (G + Gᵀ)·x, each product rounded to d, their
                // sum rounded to d, then widened.
                let (mut a, mut b, mut mag) = (0f64, 0f64, 0f64);
                for j in 0..m {
                    a += g[i * m + j] * xr[j * k + l];
                    b += g[j * m + i] * xr[j * k + l];
                    mag +=
                        (g[i * m + j] * xr[j * k + l]).abs() + (g[j * m + i] * xr[j * k + l]).abs();
                }
                let want = a + b;
                let tol = 3.0 * unit(d) * (a.abs() + b.abs()) + 1e-5 * mag;
                let gv = got[i * k + l] as f64;
                assert!((gv - want).abs() <= tol, "{d} dx[{i},{l}]: {gv} vs {want}");
            }
        }
    }
}

#[test]
fn a_weight_is_cast_once_per_scope_and_copies_replace_the_cast() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(4);
    let (m, k, n) = (8, 64, 32);
    let w = Parameter::from_host(&s, "w", &rng.vec_normal(n * k), &[n, k]).unwrap();
    let x = Tensor::from_host(&s, &rng.vec_normal(m * k), &[m, k]).unwrap();
    let fwd = |q: &dyn Queue, scopes: usize| -> Result<Vec<Tensor>> {
        let mut out = Vec::new();
        for _ in 0..scopes {
            out.extend(autocast(Dtype::Bf16, || -> Result<Vec<Tensor>> {
                let a = linear(q, &x, &w.tensor(), None, false)?;
                let b = if scopes == 1 {
                    Some(linear(q, &x, &w.tensor(), None, false)?)
                } else {
                    None
                };
                Ok(std::iter::once(a).chain(b).collect())
            })?);
        }
        Ok(out)
    };
    // Eager once first: the registry measures the product outside the captures.
    no_grad(|| fwd(&s, 1)).unwrap();
    let (one, _) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        Ok(no_grad(|| fwd(cs, 1))?)
    })
    .unwrap();
    let (two, _) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        Ok(no_grad(|| fwd(cs, 2))?)
    })
    .unwrap();
    // Two uses in one scope: one weight cast; two scopes: two. (x is not a parameter: it is
    // cast at each use either way.)
    assert_eq!(two.node_count(), one.node_count() + 1, "one cast per scope");
    // A copy (here the exact cast, as an optimizer keeps it) replaces the cast.
    let copy = Arc::new(s.alloc_zeroed::<bf16>(n * k).unwrap());
    cast::to_bf16(&s, w.data().unwrap(), &copy).unwrap();
    let opts = AutocastOptions {
        dtype: Dtype::Bf16,
        copies: vec![(w.clone(), TypedBuffer::Bf16(copy.clone()))],
    };
    let with_copy = |q: &dyn Queue| -> Result<Tensor> {
        autocast_with(opts.clone(), || linear(q, &x, &w.tensor(), None, false))?
    };
    let plain = |q: &dyn Queue| -> Result<Tensor> {
        autocast(Dtype::Bf16, || linear(q, &x, &w.tensor(), None, false))
    };
    let a = no_grad(|| with_copy(&s)).unwrap().to_vec(&s).unwrap();
    let b = no_grad(|| plain(&s)).unwrap().to_vec(&s).unwrap();
    assert_bits_eq(&a, &b, "copy vs cast");
    let (gc, _) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        Ok(no_grad(|| with_copy(cs))?)
    })
    .unwrap();
    let (gp, _) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        Ok(no_grad(|| plain(cs))?)
    })
    .unwrap();
    assert_eq!(gc.node_count() + 1, gp.node_count(), "no cast with a copy");
    // Copies that do not fit are refused before anything runs.
    let short = Arc::new(s.alloc_zeroed::<bf16>(n * k - 1).unwrap());
    let bad = AutocastOptions {
        dtype: Dtype::Bf16,
        copies: vec![(w.clone(), TypedBuffer::Bf16(short))],
    };
    assert!(matches!(autocast_with(bad, || ()), Err(NnError::Shape(_))));
    let wrong = AutocastOptions {
        dtype: Dtype::F16,
        copies: vec![(w.clone(), TypedBuffer::Bf16(copy))],
    };
    assert!(matches!(
        autocast_with(wrong, || ()),
        Err(NnError::Dtype { .. })
    ));
}

fn mixed_training(
    dev: &cudagraph::Device,
    d: Dtype,
    graphed: bool,
    steps: usize,
) -> (Vec<f32>, f32) {
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(9);
    let model = Sequential::new(vec![
        Layer::Linear(Linear::new(&s, 32, 64, &mut rng).unwrap()),
        Layer::ReLU,
        Layer::Linear(Linear::new(&s, 64, 4, &mut rng).unwrap()),
    ]);
    // A learnable task: the class is the argmax of four fixed projections of the input.
    let (rows, proj) = (256, rng.vec_normal(32 * 4));
    let xv = rng.vec_normal(rows * 32);
    let labels: Vec<i32> = (0..rows)
        .map(|r| {
            (0..4)
                .map(|c| {
                    (0..32)
                        .map(|i| xv[r * 32 + i] * proj[i * 4 + c])
                        .sum::<f32>()
                })
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(c, _)| c as i32)
                .unwrap()
        })
        .collect();
    let x = Tensor::from_host(&s, &xv, &[rows, 32]).unwrap();
    let t = Targets::from_host(&s, &labels, 4).unwrap();
    let mut opt = Adam::new(&s, model.parameters(), 1e-2, 0.0, false).unwrap();
    let step = |q: &dyn Queue, opt: &mut Adam| -> Result<Tensor> {
        opt.zero_grad(q, true)?;
        let loss = autocast(d, || cross_entropy(q, &model.forward(q, &x)?, &t))?;
        loss.backward(q)?;
        opt.step(q)?;
        Ok(loss)
    };
    let mut last = step(&s, &mut opt).unwrap();
    if graphed {
        let (g, loss) =
            Graph::capture(&mut s, CaptureOptions::new(), |cs| Ok(step(cs, &mut opt)?)).unwrap();
        for _ in 1..steps {
            g.replay(&s).unwrap();
        }
        last = loss;
    } else {
        for _ in 1..steps {
            last = step(&s, &mut opt).unwrap();
        }
    }
    let w = model
        .parameters()
        .iter()
        .flat_map(|p| s.to_vec(p.data().unwrap()).unwrap())
        .collect();
    (w, last.to_vec(&s).unwrap()[0])
}

#[test]
fn a_mixed_training_step_replays_equal_to_eager_and_learns_like_f32() {
    let dev = gpu_test_device!();
    let (_, l32) = mixed_training(&dev, Dtype::F32, false, 200);
    for d in [Dtype::Bf16, Dtype::F16] {
        let (we, le) = mixed_training(&dev, d, false, 200);
        let (wg, lg) = mixed_training(&dev, d, true, 200);
        assert_bits_eq(&wg, &we, format_args!("{d} weights, graphed vs eager"));
        assert_bits_eq(&[lg], &[le], format_args!("{d} loss, graphed vs eager"));
        let (_, l1) = mixed_training(&dev, d, false, 1);
        assert!(
            le < 0.25 * l1,
            "{d}: loss {le} after 200 steps, {l1} after 1"
        );
        assert!(le < l32 + 0.1, "{d}: loss {le} vs f32 {l32}");
    }
}

#[test]
fn misuse_mixing_element_types_outside_autocast_is_a_dtype_error() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let x = Tensor::from_host_as(&s, &[bf16::ONE; 8], &[2, 4]).unwrap();
    let w = Tensor::from_host(&s, &[1.0; 12], &[3, 4]).unwrap();
    let e = linear(&s, &x, &w, None, false).unwrap_err();
    assert!(matches!(e, NnError::Dtype { .. }), "{e}");
    let wh = Tensor::from_host_as(&s, &[f16::ONE; 12], &[3, 4]).unwrap();
    assert!(matches!(
        linear(&s, &x, &wh, None, false),
        Err(NnError::Dtype { .. })
    ));
    // Inside autocast the same inputs are cast to the scope's type and run.
    let y = autocast(Dtype::F16, || linear(&s, &x, &w, None, false)).unwrap();
    assert_eq!(y.dtype(), Dtype::F16);
    assert_eq!(y.to_vec(&s).unwrap(), vec![4.0; 6]);
}

#[test]
fn autocast_conv2d_matches_an_f64_reference_and_its_master_gradients_are_f32() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let (n, c, h, oc, k, pad) = (2, 8, 9, 16, 3, 1);
    let mut rng = HostRng::new(21);
    let (xv, wv, bv) = (
        rng.vec_normal(n * c * h * h),
        rng.vec_normal(oc * c * k * k)
            .into_iter()
            .map(|v| v * 0.2)
            .collect::<Vec<_>>(),
        rng.vec_normal(oc),
    );
    for d in [Dtype::Bf16, Dtype::F16] {
        let xp = Parameter::from_host(&s, "x", &xv, &[n, c, h, h]).unwrap();
        let w = Parameter::from_host(&s, "w", &wv, &[oc, c, k, k]).unwrap();
        let b = Parameter::from_host(&s, "b", &bv, &[oc]).unwrap();
        let y = autocast(d, || {
            conv2d(&s, &xp.tensor(), &w.tensor(), Some(&b.tensor()), 1, pad)
        })
        .unwrap();
        assert_eq!((y.dtype(), y.shape()), (d, &[n, oc, h, h][..]));
        let loss = mse_loss(
            &s,
            &y,
            &Tensor::zeros(&s, &[n, oc, h, h]).unwrap(),
            Reduction::Sum,
        )
        .unwrap();
        loss.backward(&s).unwrap();
        let yg = y.to_vec(&s).unwrap();
        let r = |v: &[f32]| v.iter().map(|&a| d.round(a) as f64).collect::<Vec<f64>>();
        let (xr, wr, br) = (r(&xv), r(&wv), r(&bv));
        let at = |img: usize, ch: usize, i: isize, j: isize| -> f64 {
            if i < 0 || j < 0 || i >= h as isize || j >= h as isize {
                0.0
            } else {
                xr[((img * c + ch) * h + i as usize) * h + j as usize]
            }
        };
        let g: Vec<f64> = yg.iter().map(|&v| d.round(2.0 * v) as f64).collect();
        let mut dw_ref = vec![0f64; wv.len()];
        let mut dw_mag = vec![0f64; wv.len()];
        for img in 0..n {
            for o in 0..oc {
                for i in 0..h {
                    for j in 0..h {
                        let (mut acc, mut mag) = (br[o], br[o].abs());
                        let e = ((img * oc + o) * h + i) * h + j;
                        for ch in 0..c {
                            for a in 0..k {
                                for bb in 0..k {
                                    let xv = at(
                                        img,
                                        ch,
                                        (i + a) as isize - pad as isize,
                                        (j + bb) as isize - pad as isize,
                                    );
                                    let wi = ((o * c + ch) * k + a) * k + bb;
                                    acc += xv * wr[wi];
                                    mag += (xv * wr[wi]).abs();
                                    dw_ref[wi] += g[e] * xv;
                                    dw_mag[wi] += (g[e] * xv).abs();
                                }
                            }
                        }
                        let got = yg[e] as f64;
                        // cuDNN may pick Winograd or FFT engines, whose error grows with the window's
                        // magnitude: 4 units of the output type relative to Σ|x||w|.
                        let tol = 2.0 * unit(d) * acc.abs() + 4.0 * unit(d) * mag;
                        assert!((got - acc).abs() <= tol, "{d} y[{e}]: {got} vs {acc}");
                    }
                }
            }
        }
        let dw = s.to_vec(&w.grad().unwrap().unwrap()).unwrap();
        for (i, (got, want)) in dw.iter().zip(&dw_ref).enumerate() {
            let tol = 4.0 * unit(d) * dw_mag[i] + 1e-30;
            assert!(
                (*got as f64 - want).abs() <= tol,
                "{d} dw[{i}]: {got} vs {want}"
            );
        }
        let db = s.to_vec(&b.grad().unwrap().unwrap()).unwrap();
        for o in 0..oc {
            let want: f64 = (0..n)
                .flat_map(|img| (0..h * h).map(move |p| (img, p)))
                .map(|(img, p)| g[(img * oc + o) * h * h + p])
                .sum();
            let mag: f64 = (0..n)
                .flat_map(|img| (0..h * h).map(move |p| (img, p)))
                .map(|(img, p)| g[(img * oc + o) * h * h + p].abs())
                .sum();
            assert!(
                (db[o] as f64 - want).abs() <= 1e-5 * mag + 1e-30,
                "{d} db[{o}]"
            );
        }
        assert!(
            xp.grad().unwrap().is_some(),
            "{d}: the input's gradient flows too"
        );
    }
}

#[test]
fn an_autocast_module_serves_with_copies_made_once_and_f32_outputs() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(22);
    let model = Sequential::new(vec![
        Layer::Linear(Linear::new(&s, 64, 128, &mut rng).unwrap()),
        Layer::ReLU,
        Layer::Linear(Linear::new(&s, 128, 10, &mut rng).unwrap()),
    ]);
    let x = Tensor::from_host(&s, &rng.vec_normal(32 * 64), &[32, 64]).unwrap();
    let want = no_grad(|| autocast(Dtype::Bf16, || model.forward(&s, &x)))
        .unwrap()
        .to_vec(&s)
        .unwrap();
    let m = AutocastModule::new(&s, model, Dtype::Bf16).unwrap();
    let y = no_grad(|| m.forward(&s, &x)).unwrap();
    assert_eq!(y.dtype(), Dtype::F32);
    assert_bits_eq(
        &y.to_vec(&s).unwrap(),
        &want,
        "copies made once vs casts per call",
    );
    // Captured: only the input cast and the products, no weight casts.
    let (g, out) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        Ok(no_grad(|| m.forward(cs, &x))?)
    })
    .unwrap();
    g.replay(&s).unwrap();
    assert_bits_eq(&out.to_vec(&s).unwrap(), &want, "replay");
    let f32m = AutocastModule::new(&s, m.module().clone(), Dtype::F32).unwrap();
    assert_eq!(
        no_grad(|| f32m.forward(&s, &x)).unwrap().dtype(),
        Dtype::F32
    );
}

#[test]
fn an_autocast_module_keeping_its_output_returns_the_16_bit_bits_before_the_widening() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    for d in [Dtype::Bf16, Dtype::F16] {
        let mut rng = HostRng::new(23);
        let model = Sequential::new(vec![
            Layer::Linear(Linear::new(&s, 64, 128, &mut rng).unwrap()),
            Layer::ReLU,
            Layer::Linear(Linear::new(&s, 128, 10, &mut rng).unwrap()),
        ]);
        let x = Tensor::from_host(&s, &rng.vec_normal(32 * 64), &[32, 64]).unwrap();
        let widened = AutocastModule::new(&s, model.clone(), d).unwrap();
        assert!(!widened.keeps_output(), "f32 outputs by default");
        let want = no_grad(|| widened.forward(&s, &x)).unwrap();
        assert_eq!(want.dtype(), Dtype::F32);
        let want = want.to_vec(&s).unwrap();
        let kept = AutocastModule::new(&s, model, d).unwrap().keep_output(true);
        assert!(kept.keeps_output());
        let y = no_grad(|| kept.forward(&s, &x)).unwrap();
        assert_eq!(y.dtype(), d, "{d}: the output in the compute type");
        assert_eq!(y.shape(), &[32, 10]);
        // The 16-bit bits themselves: narrowing the widened output is exact (it came from
        // these very values), so they must equal it element for element.
        let bits: Vec<u16> = match d {
            Dtype::Bf16 => s
                .to_vec(y.data_as::<bf16>().unwrap())
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect(),
            _ => s
                .to_vec(y.data_as::<f16>().unwrap())
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect(),
        };
        let want_bits: Vec<u16> = want
            .iter()
            .map(|&v| match d {
                Dtype::Bf16 => bf16::from_f32(v).to_bits(),
                _ => f16::from_f32(v).to_bits(),
            })
            .collect();
        assert_eq!(bits, want_bits, "{d}: kept output vs the widened one");
        assert_bits_eq(&y.to_vec(&s).unwrap(), &want, "kept output widened");
        // Captured: replay gives the same bits, and no cast of the output runs.
        let (g, out) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            Ok(no_grad(|| kept.forward(cs, &x))?)
        })
        .unwrap();
        g.replay(&s).unwrap();
        assert_eq!(out.dtype(), d);
        assert_bits_eq(&out.to_vec(&s).unwrap(), &want, "replay of the kept output");
    }
}
