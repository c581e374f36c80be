//! GPU tests of 16-bit tensors: `Tensor::to_dtype` (values bit-equal to the `half` crate's
//! rounding, gradients cast back), ReLU in bf16/f16 (exact: no rounding happens), losses that
//! widen 16-bit predictions to f32 first, gradient accumulation of a 16-bit tensor used twice,
//! replay of all of it equal to eager bit for bit, and the typed errors of misuse.

use cudagraph::memory::{bf16, f16};
use cudagraph::testing::assert_bits_eq;
use cudagraph::{gpu_test_device, CaptureOptions, Graph, Stream};
use cudagraph_nn::*;

fn values(rng: &mut HostRng, n: usize) -> Vec<f32> {
    let mut v = rng.vec_normal(n);
    // Ties, signed zeros and a NaN among them.
    v[0] = 1.0 + 2f32.powi(-8);
    v[1] = -0.0;
    v[2] = f32::NAN;
    v[3] = 3.0e38;
    v
}

fn same(a: f32, b: f32) -> bool {
    (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
}

#[test]
fn to_dtype_rounds_to_nearest_even_and_widens_exactly() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let v = values(&mut HostRng::new(1), 1000);
    let x = Tensor::from_host(&s, &v, &[10, 100]).unwrap();
    for d in [Dtype::Bf16, Dtype::F16] {
        let y = x.to_dtype(&s, d).unwrap();
        assert_eq!((y.dtype(), y.shape()), (d, &[10usize, 100][..]));
        let got = y.to_vec(&s).unwrap();
        for (i, (g, x)) in got.iter().zip(&v).enumerate() {
            assert!(same(*g, d.round(*x)), "{d} [{i}]: {x:e} gave {g:e}");
        }
        // Widening back is exact; the same type is the tensor itself.
        let back = y.to_dtype(&s, Dtype::F32).unwrap();
        assert_eq!(back.dtype(), Dtype::F32);
        assert_eq!(back.to_vec(&s).unwrap().len(), got.len());
        for (a, b) in back.to_vec(&s).unwrap().iter().zip(&got) {
            assert!(same(*a, *b));
        }
        assert!(y.to_dtype(&s, d).unwrap().buffer().len() == y.numel());
        // bf16 → f16 goes through f32: one rounding from the bf16 value.
        let other = if d == Dtype::Bf16 {
            Dtype::F16
        } else {
            Dtype::Bf16
        };
        let z = y.to_dtype(&s, other).unwrap().to_vec(&s).unwrap();
        for (a, b) in z.iter().zip(&got) {
            assert!(same(*a, other.round(*b)));
        }
    }
}

#[test]
fn gradients_flow_back_through_casts_and_16_bit_relu() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(2);
    let n = 4096;
    let (v, t) = (rng.vec_normal(n), rng.vec_normal(n));
    for d in [Dtype::Bf16, Dtype::F16] {
        let p = Parameter::from_host(&s, "x", &v, &[n]).unwrap();
        let target = Tensor::from_host(&s, &t, &[n]).unwrap();
        let y = relu(&s, &p.tensor().to_dtype(&s, d).unwrap()).unwrap();
        assert_eq!(y.dtype(), d);
        let loss = mse_loss(&s, &y, &target, Reduction::Sum).unwrap();
        assert_eq!(loss.dtype(), Dtype::F32, "losses run in f32");
        loss.backward(&s).unwrap();
        let grad = s.to_vec(&p.grad().unwrap().unwrap()).unwrap();
        let got_y = y.to_vec(&s).unwrap();
        for i in 0..n {
            // relu(round(x)) exactly; the f32 gradient 2(y - t) rounded to d on its way
            // back through the widening, masked by the ReLU, widened exactly.
            let ry = d.round(v[i]).max(0.0);
            assert!(same(got_y[i], ry), "{d} y[{i}]");
            let g = if ry > 0.0 {
                d.round(2.0 * (ry - t[i]))
            } else {
                0.0
            };
            let tol = 1e-6 * g.abs().max(1.0);
            assert!(
                (grad[i] - g).abs() <= tol,
                "{d} grad[{i}]: {} vs {g}",
                grad[i]
            );
        }
    }
}

#[test]
fn sixteen_bit_relu_keeps_nan_and_signs_exactly() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let v = values(&mut HostRng::new(3), 777);
    for d in [Dtype::Bf16, Dtype::F16] {
        let x = Tensor::from_host(&s, &v, &[777])
            .unwrap()
            .to_dtype(&s, d)
            .unwrap();
        let got = relu(&s, &x).unwrap().to_vec(&s).unwrap();
        for (i, g) in got.iter().enumerate() {
            let r = d.round(v[i]);
            let want = if r.is_nan() || r > 0.0 { r } else { 0.0 };
            assert!(same(*g, want), "{d} relu[{i}] of {r:e}: {g:e}");
        }
    }
}

#[test]
fn a_captured_mixed_step_replays_equal_to_eager() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(4);
    let n = 3000;
    let (v, t) = (rng.vec_normal(n), rng.vec_normal(n));
    let p = Parameter::from_host(&s, "x", &v, &[n]).unwrap();
    let target = Tensor::from_host(&s, &t, &[n]).unwrap();
    let step = |q: &dyn cudagraph::Queue| -> Result<Tensor> {
        p.zero_grad(q, true)?;
        let y = relu(q, &p.tensor().to_dtype(q, Dtype::Bf16)?)?;
        let loss = mse_loss(q, &y, &target, Reduction::Mean)?;
        loss.backward(q)?;
        Ok(loss)
    };
    let eager_loss = step(&s).unwrap().to_vec(&s).unwrap();
    let eager_grad = s.to_vec(&p.grad().unwrap().unwrap()).unwrap();
    let (g, loss) = Graph::capture(&mut s, CaptureOptions::new(), |cs| Ok(step(cs)?)).unwrap();
    for _ in 0..3 {
        g.replay(&s).unwrap();
        assert_bits_eq(&loss.to_vec(&s).unwrap(), &eager_loss, "loss");
        assert_bits_eq(
            &s.to_vec(&p.grad().unwrap().unwrap()).unwrap(),
            &eager_grad,
            "gradient",
        );
    }
}

#[test]
fn misuse_reading_a_16_bit_tensor_as_f32_is_a_dtype_error() {
    let dev = gpu_test_device!();
    let s: Stream = dev.new_stream().unwrap();
    let x = Tensor::from_host_as(&s, &[bf16::ONE; 8], &[2, 4]).unwrap();
    assert_eq!(x.dtype(), Dtype::Bf16);
    let e = x.data().unwrap_err();
    assert!(
        matches!(
            e,
            NnError::Dtype {
                expected: "f32",
                found: "bf16",
                ..
            }
        ),
        "{e}"
    );
    assert!(x.data_as::<bf16>().is_ok());
    assert!(x.data_as::<f16>().is_err());
    // A shape that does not match the values.
    assert!(Tensor::from_host_as(&s, &[f16::ONE; 7], &[2, 4]).is_err());
}

#[test]
fn sixteen_bit_max_pool_selects_exactly_and_routes_gradients_to_the_argmax() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let (n, c, h, w, k, st) = (2, 3, 9, 7, 3, 2);
    let v = HostRng::new(5).vec_normal(n * c * h * w);
    let (oh, ow) = ((h - k) / st + 1, (w - k) / st + 1);
    for d in [Dtype::Bf16, Dtype::F16] {
        let p = Parameter::from_host(&s, "x", &v, &[n, c, h, w]).unwrap();
        let x = p.tensor().to_dtype(&s, d).unwrap();
        let y = max_pool2d(&s, &x, k, st).unwrap();
        assert_eq!((y.dtype(), y.shape()), (d, &[n, c, oh, ow][..]));
        let got = y.to_vec(&s).unwrap();
        // Upstream gradient 2·y (from sum(y²)): every input gets 2·y at the outputs whose
        // window maximum it is (overlapping windows add), rounded to d once.
        let loss = mse_loss(
            &s,
            &y,
            &Tensor::zeros(&s, &[n, c, oh, ow]).unwrap(),
            Reduction::Sum,
        )
        .unwrap();
        loss.backward(&s).unwrap();
        let grad = s.to_vec(&p.grad().unwrap().unwrap()).unwrap();
        let mut want_grad = vec![0f64; v.len()];
        for pl in 0..n * c {
            for i in 0..oh {
                for j in 0..ow {
                    let (mut best, mut arg) = (f32::NEG_INFINITY, 0);
                    for a in 0..k {
                        for b in 0..k {
                            let idx = (pl * h + i * st + a) * w + j * st + b;
                            let val = d.round(v[idx]);
                            if val > best {
                                best = val;
                                arg = idx;
                            }
                        }
                    }
                    let o = (pl * oh + i) * ow + j;
                    assert!(same(got[o], best), "{d} y[{o}]");
                    want_grad[arg] += d.round(2.0 * best) as f64;
                }
            }
        }
        for (i, (g, w)) in grad.iter().zip(&want_grad).enumerate() {
            let w = d.round(*w as f32);
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{d} dx[{i}]: {g} vs {w}"
            );
        }
    }
}

#[test]
fn sixteen_bit_dropout_is_the_f32_dropout_of_the_widened_values_rounded_once() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let v = HostRng::new(6).vec_normal(5000);
    for d in [Dtype::Bf16, Dtype::F16] {
        let x = Tensor::from_host(&s, &v, &[50, 100])
            .unwrap()
            .to_dtype(&s, d)
            .unwrap();
        let (g1, g2) = (
            Generator::new(&s, 77).unwrap(),
            Generator::new(&s, 77).unwrap(),
        );
        let y = dropout(&s, &x, 0.3, true, &g1).unwrap();
        assert_eq!(y.dtype(), d);
        let wide = dropout(&s, &x.to_dtype(&s, Dtype::F32).unwrap(), 0.3, true, &g2).unwrap();
        let (got, want) = (y.to_vec(&s).unwrap(), wide.to_vec(&s).unwrap());
        let zeros = got.iter().filter(|v| **v == 0.0).count();
        assert!(
            (1200..1800).contains(&zeros),
            "{d}: {zeros} of 5000 dropped at p = 0.3"
        );
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), d.round(*w).to_bits(), "{d} [{i}]");
        }
    }
}
