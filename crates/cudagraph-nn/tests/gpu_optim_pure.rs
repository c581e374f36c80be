//! GPU tests of the pure 16-bit optimizer updates (`OptimKernels::sgd_pure`, `adam_pure`):
//! parameters and gradients stored only in bf16 or f16 (no f32 master), f32 moments and
//! momentum buffers, f32 arithmetic, one rounding of each new parameter per step.
//!
//! Reference: the same rule in f64 from the state the device started each step from (read
//! back, so an error cannot compound), with the f32 hyperparameters widened. Tolerances:
//! moments and momentum buffers (f32, a few operations) within 1e-5 relative; a parameter is
//! rounded once from an f32 value within about 1e-6 relative of the reference, so it lies
//! within half a unit in the last place of the 16-bit type plus that (|Δ| ≤ u·|ref| + 1e-5·s,
//! u = 2⁻⁸ bf16, 2⁻¹¹ f16, s the size of the step's terms) and — one rounding, to nearest —
//! at least 90 % of the elements equal the reference rounded to nearest even exactly (a
//! truncating or twice-rounding update misses about half). A captured update replays to the
//! bits of the eager one; a scaler's found-inf flag skips everything; unscaling by a power of
//! two gives the bits of the unscaled update; misuse is a typed error.

use cudagraph::memory::{bf16, f16};
use cudagraph::{gpu_test_device, CaptureOptions, DeviceBuffer, Graph, Queue, QueueExt, Stream};
use cudagraph_nn::kernels::optim_mt::{hp, AmpArgs, OptimKernels, PureAdamTensor, PureSgdTensor};
use cudagraph_nn::{Dtype, Float, HostRng, NnError};

const SIZES: [usize; 4] = [1, 3, 1000, 4099];

fn unit<T: Float>() -> f64 {
    match T::DTYPE {
        Dtype::Bf16 => 2f64.powi(-8),
        Dtype::F16 => 2f64.powi(-11),
        Dtype::F32 => 2f64.powi(-24),
    }
}

/// Half the smallest subnormal step of `T` (an absolute floor for the rounding bound).
fn tiny<T: Float>() -> f64 {
    match T::DTYPE {
        Dtype::F16 => 2f64.powi(-25),
        _ => 1e-38,
    }
}

fn hyper(s: &Stream, lr: f32, wd: f32, momentum: f32) -> DeviceBuffer<f32> {
    let mut v = vec![0.0f32; hp::LEN];
    v[hp::LR] = lr;
    v[hp::BASE_LR] = lr;
    v[hp::BETA1] = 0.9;
    v[hp::BETA2] = 0.999;
    v[hp::EPS] = 1e-8;
    v[hp::WEIGHT_DECAY] = wd;
    v[hp::MOMENTUM] = momentum;
    s.alloc_from_host(&v).unwrap()
}

fn host<T: Float>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

fn wide<T: Float>(v: &[T]) -> Vec<f64> {
    v.iter().map(|&x| x.to_f32() as f64).collect()
}

/// Checks new 16-bit parameters against their f64 reference (see the module documentation).
fn check_params<T: Float>(what: &str, got: &[T], want: &[f64], scale: &[f64]) {
    let mut exact = 0usize;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g64 = g.to_f32() as f64;
        let bound = unit::<T>() * w.abs() + 1e-5 * scale[i] + tiny::<T>();
        assert!(
            (g64 - w).abs() <= bound,
            "{what} {}: element {i}: {g64} vs reference {w} (bound {bound:e})",
            T::DTYPE
        );
        if g.to_f32().to_bits() == T::from_f32(w as f32).to_f32().to_bits() {
            exact += 1;
        }
    }
    assert!(
        exact * 10 >= got.len() * 9,
        "{what} {}: only {exact} of {} equal the reference rounded to nearest",
        T::DTYPE,
        got.len()
    );
}

/// f32 state against f64: within 1e-5 of the size of the terms that made it (`terms[i]`, the
/// sum of their magnitudes): a moment that nearly cancels (β·m + (1-β)·g ≈ 0) carries the f32
/// rounding of its terms, not of its small result.
fn check_f32(what: &str, got: &[f32], want: &[f64], terms: &[f64]) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= 1e-5 * (w.abs() + terms[i]) + 1e-12,
            "{what} element {i}: {g} vs reference {w} (terms {:e})",
            terms[i]
        );
    }
}

struct AdamState<T: Float> {
    w: Vec<DeviceBuffer<T>>,
    g: Vec<DeviceBuffer<T>>,
    m: Vec<DeviceBuffer<f32>>,
    v: Vec<DeviceBuffer<f32>>,
    steps: DeviceBuffer<u32>,
    state: DeviceBuffer<u32>,
}

impl<T: Float> AdamState<T> {
    fn new(s: &Stream, rng: &mut HostRng) -> Self {
        let mut st = AdamState {
            w: Vec::new(),
            g: Vec::new(),
            m: Vec::new(),
            v: Vec::new(),
            steps: s.alloc_zeroed::<u32>(SIZES.len()).unwrap(),
            state: s.alloc_zeroed::<u32>(2).unwrap(),
        };
        for &n in &SIZES {
            st.w.push(s.alloc_from_host(&host::<T>(&rng.vec_normal(n))).unwrap());
            st.g.push(s.alloc_zeroed::<T>(n).unwrap());
            st.m.push(s.alloc_zeroed::<f32>(n).unwrap());
            st.v.push(s.alloc_zeroed::<f32>(n).unwrap());
        }
        st
    }

    fn tensors(&self) -> Vec<PureAdamTensor<'_, T>> {
        (0..SIZES.len())
            .map(|i| PureAdamTensor {
                w: &self.w[i],
                g: &self.g[i],
                m: &self.m[i],
                v: &self.v[i],
                slot: i as u32,
            })
            .collect()
    }
}

fn check_adam<T: Float>(s: &Stream, decoupled: bool) {
    let k = OptimKernels::get(s.device()).unwrap();
    let mut rng = HostRng::new(41);
    let (lr, wd) = (1e-2f32, 1e-2f32);
    let h = hyper(s, lr, wd, 0.0);
    let st = AdamState::<T>::new(s, &mut rng);
    let (b1, b2, eps) = (0.9f32 as f64, 0.999f32 as f64, 1e-8f32 as f64);
    let (lr64, wd64) = (lr as f64, wd as f64);
    for step in 1..=3i32 {
        for (i, &n) in SIZES.iter().enumerate() {
            let g: Vec<f32> = rng.vec_normal(n).iter().map(|x| x * 0.1).collect();
            s.copy_from_host(&host::<T>(&g), &st.g[i]).unwrap();
        }
        let before: Vec<_> = (0..SIZES.len())
            .map(|i| {
                (
                    wide(&s.to_vec(&st.w[i]).unwrap()),
                    wide(&s.to_vec(&st.g[i]).unwrap()),
                    s.to_vec(&st.m[i]).unwrap(),
                    s.to_vec(&st.v[i]).unwrap(),
                )
            })
            .collect();
        k.adam_pure(
            s,
            &st.tensors(),
            &h,
            &st.state,
            &st.steps,
            None,
            decoupled,
            true,
        )
        .unwrap();
        let t = step as f64;
        let (bc1, bc2_sqrt) = (1.0 - b1.powf(t), (1.0 - b2.powf(t)).sqrt());
        for (i, (w0, g0, m0, v0)) in before.iter().enumerate() {
            let n = SIZES[i];
            let (mut w_ref, mut m_ref, mut v_ref, mut scale) =
                (vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            let mut m_terms = vec![0.0; n];
            for j in 0..n {
                let (mut w, mut g) = (w0[j], g0[j]);
                if decoupled {
                    w -= lr64 * wd64 * w;
                } else {
                    g += wd64 * w;
                }
                let m = b1 * m0[j] as f64 + (1.0 - b1) * g;
                m_terms[j] = (b1 * m0[j] as f64).abs() + ((1.0 - b1) * g).abs();
                let v = b2 * v0[j] as f64 + (1.0 - b2) * g * g;
                let upd = lr64 / bc1 * m / (v.sqrt() / bc2_sqrt + eps);
                w_ref[j] = w - upd;
                m_ref[j] = m;
                v_ref[j] = v;
                scale[j] = w0[j].abs() + upd.abs();
            }
            let what = format!("adam (decoupled {decoupled}) step {step} tensor {i}");
            check_params::<T>(&what, &s.to_vec(&st.w[i]).unwrap(), &w_ref, &scale);
            check_f32(
                &format!("{what} m"),
                &s.to_vec(&st.m[i]).unwrap(),
                &m_ref,
                &m_terms,
            );
            check_f32(
                &format!("{what} v"),
                &s.to_vec(&st.v[i]).unwrap(),
                &v_ref,
                &v_ref,
            );
        }
    }
    assert_eq!(s.to_vec(&st.steps).unwrap(), vec![3u32; SIZES.len()]);
    assert_eq!(
        s.to_vec(&st.state).unwrap()[0],
        3,
        "the optimizer's step count"
    );
}

#[test]
fn pure_16_bit_adam_and_adamw_match_an_f64_reference() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for decoupled in [false, true] {
        check_adam::<bf16>(&s, decoupled);
        check_adam::<f16>(&s, decoupled);
    }
}

fn check_sgd<T: Float>(s: &Stream, momentum: f32) {
    let k = OptimKernels::get(s.device()).unwrap();
    let mut rng = HostRng::new(43);
    let (lr, wd) = (0.1f32, 1e-2f32);
    let h = hyper(s, lr, wd, momentum);
    let state = s.alloc_zeroed::<u32>(2).unwrap();
    let w: Vec<DeviceBuffer<T>> = SIZES
        .iter()
        .map(|&n| s.alloc_from_host(&host::<T>(&rng.vec_normal(n))).unwrap())
        .collect();
    let g: Vec<DeviceBuffer<T>> = SIZES
        .iter()
        .map(|&n| s.alloc_zeroed::<T>(n).unwrap())
        .collect();
    let bufs: Vec<DeviceBuffer<f32>> = SIZES
        .iter()
        .map(|&n| s.alloc_zeroed::<f32>(n).unwrap())
        .collect();
    let (lr64, wd64, mom64) = (lr as f64, wd as f64, momentum as f64);
    for step in 1..=3 {
        for (i, &n) in SIZES.iter().enumerate() {
            s.copy_from_host(&host::<T>(&rng.vec_normal(n)), &g[i])
                .unwrap();
        }
        let before: Vec<_> = (0..SIZES.len())
            .map(|i| {
                (
                    wide(&s.to_vec(&w[i]).unwrap()),
                    wide(&s.to_vec(&g[i]).unwrap()),
                    s.to_vec(&bufs[i]).unwrap(),
                )
            })
            .collect();
        let tensors: Vec<PureSgdTensor<'_, T>> = (0..SIZES.len())
            .map(|i| PureSgdTensor {
                w: &w[i],
                g: &g[i],
                buf: (momentum != 0.0).then_some(&bufs[i]),
            })
            .collect();
        k.sgd_pure(s, &tensors, &h, &state, None, true).unwrap();
        for (i, (w0, g0, b0)) in before.iter().enumerate() {
            let n = SIZES[i];
            let (mut w_ref, mut b_ref, mut scale) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            let mut b_terms = vec![0.0; n];
            for j in 0..n {
                let mut d = g0[j] + wd64 * w0[j];
                if momentum != 0.0 {
                    d += mom64 * b0[j] as f64;
                    b_ref[j] = d;
                    b_terms[j] = g0[j].abs() + (wd64 * w0[j]).abs() + (mom64 * b0[j] as f64).abs();
                }
                w_ref[j] = w0[j] - lr64 * d;
                scale[j] = w0[j].abs() + (lr64 * d).abs();
            }
            let what = format!("sgd (momentum {momentum}) step {step} tensor {i}");
            check_params::<T>(&what, &s.to_vec(&w[i]).unwrap(), &w_ref, &scale);
            if momentum != 0.0 {
                check_f32(
                    &format!("{what} buf"),
                    &s.to_vec(&bufs[i]).unwrap(),
                    &b_ref,
                    &b_terms,
                );
            }
        }
    }
    assert_eq!(
        s.to_vec(&state).unwrap()[0],
        3,
        "the optimizer's step count"
    );
}

#[test]
fn pure_16_bit_sgd_with_and_without_momentum_matches_an_f64_reference() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for momentum in [0.0, 0.9] {
        check_sgd::<bf16>(&s, momentum);
        check_sgd::<f16>(&s, momentum);
    }
}

fn read<T: Float>(s: &Stream, st: &AdamState<T>) -> Vec<u32> {
    let mut out = Vec::new();
    for i in 0..SIZES.len() {
        out.extend(
            s.to_vec(&st.w[i])
                .unwrap()
                .iter()
                .map(|x| x.to_f32().to_bits()),
        );
        out.extend(
            s.to_vec(&st.g[i])
                .unwrap()
                .iter()
                .map(|x| x.to_f32().to_bits()),
        );
        out.extend(s.to_vec(&st.m[i]).unwrap().iter().map(|x| x.to_bits()));
        out.extend(s.to_vec(&st.v[i]).unwrap().iter().map(|x| x.to_bits()));
    }
    out.extend(s.to_vec(&st.steps).unwrap());
    out.extend(s.to_vec(&st.state).unwrap());
    out
}

/// Two identical states (the same seed) with gradients `g·factor`.
fn pair<T: Float>(s: &Stream, factor: f32) -> (AdamState<T>, AdamState<T>) {
    let a = AdamState::<T>::new(s, &mut HostRng::new(47));
    let b = AdamState::<T>::new(s, &mut HostRng::new(47));
    let mut rng = HostRng::new(48);
    for (i, &n) in SIZES.iter().enumerate() {
        let g: Vec<f32> = rng.vec_normal(n).iter().map(|x| x * 0.1).collect();
        s.copy_from_host(&host::<T>(&g), &a.g[i]).unwrap();
        let scaled: Vec<f32> = host::<T>(&g).iter().map(|x| x.to_f32() * factor).collect();
        s.copy_from_host(&host::<T>(&scaled), &b.g[i]).unwrap();
    }
    (a, b)
}

fn check_replay_and_scaling<T: Float>(s: &mut Stream) {
    let k = OptimKernels::get(s.device()).unwrap();
    let h = hyper(s, 1e-2, 1e-2, 0.0);
    // A captured update replays to the bits of the eager one.
    let (a, b) = pair::<T>(s, 1.0);
    k.adam_pure(&*s, &a.tensors(), &h, &a.state, &a.steps, None, true, true)
        .unwrap();
    let (g, ()) = Graph::capture(s, CaptureOptions::new(), |cs| {
        Ok(k.adam_pure(cs, &b.tensors(), &h, &b.state, &b.steps, None, true, true)?)
    })
    .unwrap();
    g.replay(s).unwrap();
    assert_eq!(read(s, &a), read(s, &b), "{}: replay vs eager", T::DTYPE);
    // A scaler's found-inf flag skips everything: parameters, gradients, moments, counters.
    let amp = s.alloc_from_host(&[4.0f32, 1.0]).unwrap();
    let before = read(s, &b);
    let flagged = AmpArgs {
        buf: &amp,
        found: 0,
        unscale: true,
    };
    k.adam_pure(
        &*s,
        &b.tensors(),
        &h,
        &b.state,
        &b.steps,
        Some(&flagged),
        true,
        true,
    )
    .unwrap();
    assert_eq!(
        read(s, &b),
        before,
        "{}: a flagged step changes nothing",
        T::DTYPE
    );
    // Unscaling gradients scaled by 4 (exact in 16 bits) gives the unscaled update's bits,
    // and writes the gradients back unscaled.
    let (a, b) = pair::<T>(s, 4.0);
    let amp = s.alloc_from_host(&[4.0f32, 0.0]).unwrap();
    let scaled = AmpArgs {
        buf: &amp,
        found: 0,
        unscale: true,
    };
    k.adam_pure(&*s, &a.tensors(), &h, &a.state, &a.steps, None, true, true)
        .unwrap();
    k.adam_pure(
        &*s,
        &b.tensors(),
        &h,
        &b.state,
        &b.steps,
        Some(&scaled),
        true,
        true,
    )
    .unwrap();
    assert_eq!(read(s, &a), read(s, &b), "{}: unscaled update", T::DTYPE);
}

#[test]
fn pure_16_bit_updates_replay_bit_for_bit_and_follow_the_scaler() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    check_replay_and_scaling::<bf16>(&mut s);
    check_replay_and_scaling::<f16>(&mut s);
}

#[test]
fn pure_16_bit_misuse_is_a_typed_error() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let k = OptimKernels::get(&dev).unwrap();
    let h = hyper(&s, 1e-2, 0.0, 0.0);
    let state = s.alloc_zeroed::<u32>(2).unwrap();
    let steps = s.alloc_zeroed::<u32>(2).unwrap();
    let m = s.alloc_zeroed::<f32>(8).unwrap();
    let v = s.alloc_zeroed::<f32>(8).unwrap();
    // f32 parameters belong to the ordinary updates.
    let w32 = s.alloc_zeroed::<f32>(8).unwrap();
    let t32 = [PureAdamTensor {
        w: &w32,
        g: &w32,
        m: &m,
        v: &v,
        slot: 0,
    }];
    let e = k
        .adam_pure(&s, &t32, &h, &state, &steps, None, false, true)
        .unwrap_err();
    assert!(matches!(e, NnError::Dtype { .. }), "{e}");
    let s32 = [PureSgdTensor {
        w: &w32,
        g: &w32,
        buf: None,
    }];
    let e = k.sgd_pure(&s, &s32, &h, &state, None, true).unwrap_err();
    assert!(matches!(e, NnError::Dtype { .. }), "{e}");
    // A gradient shorter than its parameter, a slot past the counters, a slot used twice.
    let w = s.alloc_zeroed::<bf16>(8).unwrap();
    let short = s.alloc_zeroed::<bf16>(7).unwrap();
    let bad = [PureSgdTensor {
        w: &w,
        g: &short,
        buf: None,
    }];
    assert!(k.sgd_pure(&s, &bad, &h, &state, None, true).is_err());
    let g = s.alloc_zeroed::<bf16>(8).unwrap();
    let past = [PureAdamTensor {
        w: &w,
        g: &g,
        m: &m,
        v: &v,
        slot: 2,
    }];
    assert!(k
        .adam_pure(&s, &past, &h, &state, &steps, None, false, true)
        .is_err());
    let w2 = s.alloc_zeroed::<bf16>(8).unwrap();
    let g2 = s.alloc_zeroed::<bf16>(8).unwrap();
    let (m2, v2) = (
        s.alloc_zeroed::<f32>(8).unwrap(),
        s.alloc_zeroed::<f32>(8).unwrap(),
    );
    let twice = [
        PureAdamTensor {
            w: &w,
            g: &g,
            m: &m,
            v: &v,
            slot: 0,
        },
        PureAdamTensor {
            w: &w2,
            g: &g2,
            m: &m2,
            v: &v2,
            slot: 0,
        },
    ];
    assert!(k
        .adam_pure(&s, &twice, &h, &state, &steps, None, false, true)
        .is_err());
    // Nothing ran: the counters are untouched.
    assert_eq!(s.to_vec(&steps).unwrap(), vec![0, 0]);
    assert_eq!(s.to_vec(&state).unwrap(), vec![0, 0]);
}
