//! GPU tests of the fused optimizers, device-side hyperparameters, learning-rate schedules and
//! fused losses: against f64 CPU references of PyTorch's rules, and captured steps against
//! eager runs of the same code.
//!
//! Tolerances (‖gpu − ref‖ / ‖ref‖ unless said otherwise):
//! - optimizer updates over a few steps: 1e-5 (fp32 rounding of a handful of operations per
//!   element and step, compounded; measured far below);
//! - cross-entropy and MSE: 1e-5 for the losses (fp32 sums of up to 10^6 terms in a fixed
//!   tree order); 1e-6 for MSE gradients (two roundings per element), 2e-6 for cross-entropy
//!   gradients (exp within 2 ulp, divided by a sum of up to 50 000 terms);
//! - graph replay vs eager with the same kernels: bit-identical where only this crate's
//!   kernels run (fixed grids, fixed reduction order); 1e-6 where a product goes through cuBLAS;
//! - device schedule vs host schedule: the learning rates agree to one f32 ulp (same f64
//!   operations, `cos` may differ by an ulp before rounding), trained weights to 1e-6.

use std::sync::Arc;

use cudagraph::testing::assert_bits_eq;
use cudagraph::{gpu_test_device, BlockRef, CaptureOptions, Device, DeviceBuffer, Graph, Stream};
use cudagraph_nn::cpu::{rel_err, to_f64};
use cudagraph_nn::*;

/// PyTorch's SGD (dampening 0, no Nesterov) in f64; `buf` is `None` without momentum.
fn sgd_ref(w: &mut [f64], g: &[f64], buf: Option<&mut Vec<f64>>, lr: f64, mom: f64, wd: f64) {
    let mut buf = buf;
    for i in 0..w.len() {
        let mut d = g[i] + wd * w[i];
        if let Some(b) = buf.as_deref_mut() {
            b[i] = mom * b[i] + d;
            d = b[i];
        }
        w[i] -= lr * d;
    }
}

/// PyTorch's fused Adam/AdamW in f64 at step `t` (1-based).
fn adam_ref(w: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], t: i32, c: AdamConfig) {
    let (lr, b1, b2, eps, wd) = (
        c.lr as f64,
        c.beta1 as f64,
        c.beta2 as f64,
        c.eps as f64,
        c.weight_decay as f64,
    );
    let bc1 = 1.0 - b1.powi(t);
    let bc2_sqrt = (1.0 - b2.powi(t)).sqrt();
    for i in 0..w.len() {
        let mut gi = g[i];
        if c.decoupled {
            w[i] -= lr * wd * w[i];
        } else {
            gi += wd * w[i];
        }
        m[i] = b1 * m[i] + (1.0 - b1) * gi;
        v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
        let denom = v[i].sqrt() / bc2_sqrt + eps;
        w[i] -= lr / bc1 * m[i] / denom;
    }
}

/// A parameter whose data starts 4 bytes into a buffer: not 16-byte aligned, so the fused
/// kernels take their scalar path for it.
fn misaligned_param(dev: &Device, s: &Stream, name: &str, data: &[f32]) -> Parameter {
    let n = data.len();
    let base = s.alloc_from_host(&vec![0f32; n + 1]).unwrap();
    let addr = base.addr() + 4;
    // SAFETY: [addr, addr + 4n) lies inside `base` (n + 1 floats), which the block keeps alive
    // (the boxed alias) until its last holder is gone; nothing else writes that memory.
    let block = unsafe { BlockRef::external(addr, 4 * n, dev.ordinal(), Box::new(base.alias())) };
    let buf = DeviceBuffer::<f32>::from_block(block, n).unwrap();
    s.copy_from_host(data, &buf).unwrap();
    Parameter::from_buffer(name, Arc::new(buf), &[n]).unwrap()
}

/// Gives every parameter the gradient of Σ (w − t)², i.e. 2 (w − t), through the fused MSE.
fn set_grads(q: &dyn cudagraph::Queue, params: &[Parameter], targets: &[Tensor]) {
    for (p, t) in params.iter().zip(targets) {
        mse_loss(q, &p.tensor(), t, Reduction::Sum)
            .unwrap()
            .backward(q)
            .unwrap();
    }
}

enum Kind {
    Sgd(SgdConfig),
    Adam(AdamConfig),
}

fn build(s: &Stream, params: Vec<Parameter>, kind: &Kind) -> Box<dyn Optimizer> {
    match kind {
        Kind::Sgd(c) => Box::new(Sgd::with_config(s, params, *c).unwrap()),
        Kind::Adam(c) => Box::new(Adam::with_config(s, params, *c).unwrap()),
    }
}

/// Runs `steps` fused updates over tensors of `sizes` (plus one misaligned tensor) and checks
/// every tensor against the f64 reference.
fn check_against_reference(dev: &Device, sizes: &[usize], kind: &Kind, steps: i32, seed: u64) {
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(seed);
    let mut params = Vec::new();
    let mut host_w = Vec::new();
    let mut targets = Vec::new();
    let mut host_t = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let w = rng.vec_normal(n);
        params.push(Parameter::from_host(&s, &format!("p{i}"), &w, &[n]).unwrap());
        host_w.push(to_f64(&w));
        let t = rng.vec_normal(n);
        targets.push(Tensor::from_host(&s, &t, &[n]).unwrap());
        host_t.push(to_f64(&t));
    }
    let w = rng.vec_normal(1031);
    params.push(misaligned_param(dev, &s, "misaligned", &w));
    host_w.push(to_f64(&w));
    let t = rng.vec_normal(1031);
    targets.push(Tensor::from_host(&s, &t, &[1031]).unwrap());
    host_t.push(to_f64(&t));

    let mut opt = build(&s, params.clone(), kind);
    let mut m: Vec<Vec<f64>> = host_w.iter().map(|w| vec![0.0; w.len()]).collect();
    let mut v = m.clone();
    for step in 1..=steps {
        opt.zero_grad(&s, true).unwrap();
        set_grads(&s, &params, &targets);
        opt.step(&s).unwrap();
        for i in 0..params.len() {
            let g: Vec<f64> = host_w[i]
                .iter()
                .zip(&host_t[i])
                .map(|(w, t)| 2.0 * (w - t))
                .collect();
            match kind {
                Kind::Sgd(c) => sgd_ref(
                    &mut host_w[i],
                    &g,
                    (c.momentum != 0.0).then_some(&mut m[i]),
                    c.lr as f64,
                    c.momentum as f64,
                    c.weight_decay as f64,
                ),
                Kind::Adam(c) => adam_ref(&mut host_w[i], &g, &mut m[i], &mut v[i], step, *c),
            }
        }
    }
    for (p, want) in params.iter().zip(&host_w) {
        let got = s.to_vec(p.data().unwrap()).unwrap();
        let err = rel_err(&got, want);
        assert!(err < 1e-5, "{} ({} elements): {err}", p.name(), want.len());
    }
    let h = opt.hyperparameters().unwrap();
    assert_eq!(h.step_count(&s).unwrap(), steps as u32);
}

const ODD_SIZES: [usize; 14] = [
    1, 2, 3, 5, 7, 13, 31, 127, 1023, 1024, 1025, 4099, 65537, 100003,
];

#[test]
fn fused_sgd_matches_pytorch_rule_over_steps_for_odd_sizes() {
    let dev = gpu_test_device!();
    for (k, c) in [
        SgdConfig {
            lr: 0.05,
            ..SgdConfig::default()
        },
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.01,
        },
    ]
    .into_iter()
    .enumerate()
    {
        check_against_reference(&dev, &ODD_SIZES, &Kind::Sgd(c), 6, 100 + k as u64);
    }
}

#[test]
fn fused_adam_and_adamw_match_pytorch_rule_over_steps_for_odd_sizes() {
    let dev = gpu_test_device!();
    for (k, c) in [
        AdamConfig {
            lr: 0.01,
            weight_decay: 0.01,
            ..AdamConfig::default()
        },
        AdamConfig {
            lr: 0.01,
            weight_decay: 0.1,
            ..AdamConfig::adamw()
        },
        AdamConfig {
            lr: 0.003,
            beta1: 0.8,
            beta2: 0.99,
            eps: 1e-6,
            ..AdamConfig::default()
        },
    ]
    .into_iter()
    .enumerate()
    {
        check_against_reference(&dev, &ODD_SIZES, &Kind::Adam(c), 6, 200 + k as u64);
    }
}

#[test]
fn hundreds_of_tensors_take_several_launches_and_all_update() {
    let dev = gpu_test_device!();
    // 600 + 1 tensors: a 512-tensor table and a small one (with 32 KB parameters), or ten
    // small tables without.
    let sizes: Vec<usize> = (0..600).map(|i| 1 + (i * 7) % 50).collect();
    check_against_reference(
        &dev,
        &sizes,
        &Kind::Adam(AdamConfig {
            lr: 0.02,
            ..AdamConfig::default()
        }),
        3,
        300,
    );
    check_against_reference(
        &dev,
        &sizes,
        &Kind::Sgd(SgdConfig {
            lr: 0.02,
            momentum: 0.5,
            weight_decay: 0.0,
        }),
        3,
        301,
    );
}

#[test]
fn adam_counts_steps_per_parameter_like_pytorch() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(400);
    let a = Parameter::from_host(&s, "a", &rng.vec_normal(10), &[10]).unwrap();
    let b = Parameter::from_host(&s, "b", &rng.vec_normal(20), &[20]).unwrap();
    let ta = Tensor::from_host(&s, &rng.vec_normal(10), &[10]).unwrap();
    let tb = Tensor::from_host(&s, &rng.vec_normal(20), &[20]).unwrap();
    let mut opt = Adam::new(&s, vec![a.clone(), b.clone()], 0.01, 0.0, false).unwrap();
    for step in 0..3 {
        opt.zero_grad(&s, true).unwrap();
        set_grads(&s, std::slice::from_ref(&a), std::slice::from_ref(&ta));
        if step != 1 {
            set_grads(&s, std::slice::from_ref(&b), std::slice::from_ref(&tb));
        }
        opt.step(&s).unwrap();
    }
    // `b` had no gradient at the second step: PyTorch skips it and its step count.
    assert_eq!(opt.step_counts(&s).unwrap(), vec![3, 2]);
    assert_eq!(opt.hyperparameters().unwrap().step_count(&s).unwrap(), 3);
}

/// Adam steps on parameters only (fused MSE + fused Adam: no cuBLAS), eager or graphed.
fn train_params(dev: &Device, graphed: bool, steps: usize) -> (Vec<Vec<f32>>, Vec<f32>) {
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(500);
    let sizes = [3usize, 1000, 4097, 70001];
    let params: Vec<Parameter> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            Parameter::from_host(&s, &format!("p{i}"), &rng.vec_normal(n), &[n]).unwrap()
        })
        .collect();
    let targets: Vec<Tensor> = sizes
        .iter()
        .map(|&n| Tensor::from_host(&s, &rng.vec_normal(n), &[n]).unwrap())
        .collect();
    let mut opt = Adam::with_config(&s, params.clone(), AdamConfig::adamw()).unwrap();
    let step = |q: &dyn cudagraph::Queue, opt: &mut Adam| -> Result<Tensor> {
        opt.zero_grad(q, true)?;
        let mut last = None;
        for (p, t) in params.iter().zip(&targets) {
            let loss = mse_loss(q, &p.tensor(), t, Reduction::Mean)?;
            loss.backward(q)?;
            last = Some(loss);
        }
        opt.step(q)?;
        Ok(last.expect("four parameters"))
    };
    let mut losses = Vec::new();
    if graphed {
        let (g, loss) =
            Graph::capture(&mut s, CaptureOptions::new(), |cs| Ok(step(cs, &mut opt)?)).unwrap();
        for _ in 0..steps {
            g.replay(&s).unwrap();
            losses.push(loss.to_vec(&s).unwrap()[0]);
        }
    } else {
        for _ in 0..steps {
            let loss = step(&s, &mut opt).unwrap();
            losses.push(loss.to_vec(&s).unwrap()[0]);
        }
    }
    let w = params
        .iter()
        .map(|p| s.to_vec(p.data().unwrap()).unwrap())
        .collect();
    (w, losses)
}

#[test]
fn graphed_fused_steps_equal_eager_bit_for_bit() {
    let dev = gpu_test_device!();
    let (we, le) = train_params(&dev, false, 12);
    let (wg, lg) = train_params(&dev, true, 12);
    assert_bits_eq(
        &lg,
        &le,
        format_args!("losses graphed {lg:?} vs eager {le:?}"),
    );
    assert_eq!(we.len(), wg.len());
    for (i, (a, b)) in we.iter().zip(&wg).enumerate() {
        assert_bits_eq(b, a, format_args!("parameter {i}, graphed vs eager"));
    }
}

#[test]
fn hyperparameters_change_between_replays_without_recapture() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(600);
    let n = 777;
    let w0 = rng.vec_normal(n);
    let th = rng.vec_normal(n);
    let p = Parameter::from_host(&s, "w", &w0, &[n]).unwrap();
    let t = Tensor::from_host(&s, &th, &[n]).unwrap();
    let mut opt = Sgd::new(&s, vec![p.clone()], 0.1, 0.0, 0.0).unwrap();
    assert!(opt.set_momentum(&s, 0.9).is_err(), "no momentum buffers");
    let (g, _) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        opt.zero_grad(cs, true)?;
        mse_loss(cs, &p.tensor(), &t, Reduction::Sum)?.backward(cs)?;
        opt.step(cs)?;
        Ok(())
    })
    .unwrap();
    let mut w = to_f64(&w0);
    let th = to_f64(&th);
    for lr in [0.1f32, 0.01, 0.2, 0.0] {
        if lr != 0.1 {
            opt.set_lr(&s, lr).unwrap();
        }
        let before = s.to_vec(p.data().unwrap()).unwrap();
        g.replay(&s).unwrap();
        let g_ref: Vec<f64> = w.iter().zip(&th).map(|(a, b)| 2.0 * (a - b)).collect();
        sgd_ref(&mut w, &g_ref, None, lr as f64, 0.0, 0.0);
        let got = s.to_vec(p.data().unwrap()).unwrap();
        assert!(rel_err(&got, &w) < 1e-6, "lr {lr}: {}", rel_err(&got, &w));
        if lr == 0.0 {
            assert_eq!(got, before, "lr 0 leaves the weights unchanged");
        }
    }
    assert_eq!(opt.config().lr, 0.0);
    assert_eq!(opt.hyperparameters().unwrap().read(&s).unwrap()[0], 0.0);
    assert!(opt.set_lr(&s, f32::NAN).is_err());
    assert!(opt.set_lr(&s, -1.0).is_err());
}

#[test]
fn adam_hyperparameters_set_from_the_host_reach_a_captured_step() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(650);
    let n = 513;
    let w0 = rng.vec_normal(n);
    let th = rng.vec_normal(n);
    let p = Parameter::from_host(&s, "w", &w0, &[n]).unwrap();
    let t = Tensor::from_host(&s, &th, &[n]).unwrap();
    let mut opt = Adam::with_config(&s, vec![p.clone()], AdamConfig::default()).unwrap();
    let (g, _) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        opt.zero_grad(cs, true)?;
        mse_loss(cs, &p.tensor(), &t, Reduction::Sum)?.backward(cs)?;
        opt.step(cs)?;
        Ok(())
    })
    .unwrap();
    let mut c = AdamConfig::default();
    let (mut w, th) = (to_f64(&w0), to_f64(&th));
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    for step in 1..=4 {
        if step == 3 {
            opt.set_lr(&s, 0.05).unwrap();
            opt.set_betas(&s, 0.5, 0.9).unwrap();
            opt.set_eps(&s, 1e-3).unwrap();
            opt.set_weight_decay(&s, 0.2).unwrap();
            c = AdamConfig {
                lr: 0.05,
                beta1: 0.5,
                beta2: 0.9,
                eps: 1e-3,
                weight_decay: 0.2,
                decoupled: false,
            };
            assert_eq!(opt.config(), c);
        }
        g.replay(&s).unwrap();
        let gr: Vec<f64> = w.iter().zip(&th).map(|(a, b)| 2.0 * (a - b)).collect();
        adam_ref(&mut w, &gr, &mut m, &mut v, step, c);
    }
    let got = s.to_vec(p.data().unwrap()).unwrap();
    assert!(rel_err(&got, &w) < 1e-5, "{}", rel_err(&got, &w));
    assert!(opt.set_betas(&s, 1.0, 0.9).is_err());
}

/// A small model trained `steps` steps with `schedule`: on the device (eager or graphed), or
/// from the host (`set_lr` before each eager step). Returns losses, learning rates read back
/// after each step, and the final weights.
fn train_scheduled(
    dev: &Device,
    adam: bool,
    how: &str,
    schedule: &Schedule,
    steps: u32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(700);
    let model = Linear::new(&s, 16, 4, &mut rng).unwrap();
    let x = Tensor::from_host(&s, &rng.vec_normal(8 * 16), &[8, 16]).unwrap();
    let y = Tensor::from_host(&s, &rng.vec_normal(8 * 4), &[8, 4]).unwrap();
    let base = 0.05f32;
    let mut opt: Box<dyn Optimizer> = if adam {
        Box::new(Adam::new(&s, model.parameters(), base, 0.0, true).unwrap())
    } else {
        Box::new(Sgd::new(&s, model.parameters(), base, 0.9, 0.0).unwrap())
    };
    if how != "host" {
        opt.set_schedule(Some(schedule.clone())).unwrap();
    }
    let step = |q: &dyn cudagraph::Queue, opt: &mut Box<dyn Optimizer>| -> Result<Tensor> {
        opt.zero_grad(q, true)?;
        let loss = mse_loss(q, &model.forward(q, &x)?, &y, Reduction::Mean)?;
        loss.backward(q)?;
        opt.step(q)?;
        Ok(loss)
    };
    let (mut losses, mut lrs) = (Vec::new(), Vec::new());
    let lr_now =
        |opt: &dyn Optimizer, s: &Stream| opt.hyperparameters().unwrap().read(s).unwrap()[0];
    match how {
        "graph" => {
            let (g, loss) =
                Graph::capture(&mut s, CaptureOptions::new(), |cs| Ok(step(cs, &mut opt)?))
                    .unwrap();
            for _ in 0..steps {
                g.replay(&s).unwrap();
                losses.push(loss.to_vec(&s).unwrap()[0]);
                lrs.push(lr_now(opt.as_ref(), &s));
            }
        }
        _ => {
            for t in 0..steps {
                if how == "host" {
                    opt.set_lr(&s, schedule.lr(base, t)).unwrap();
                }
                let loss = step(&s, &mut opt).unwrap();
                losses.push(loss.to_vec(&s).unwrap()[0]);
                lrs.push(lr_now(opt.as_ref(), &s));
            }
        }
    }
    (losses, lrs, s.to_vec(model.weight.data().unwrap()).unwrap())
}

#[test]
fn graphed_training_with_a_schedule_matches_eager_step_for_step() {
    let dev = gpu_test_device!();
    let schedule = Schedule::linear_warmup(5, 0.1)
        .unwrap()
        .then(5, Schedule::cosine_annealing(20, 0.001).unwrap())
        .unwrap()
        .chain(Schedule::step_lr(10, 0.5).unwrap())
        .unwrap();
    let steps = 30;
    for adam in [false, true] {
        let (le, lre, we) = train_scheduled(&dev, adam, "eager", &schedule, steps);
        let (lg, lrg, wg) = train_scheduled(&dev, adam, "graph", &schedule, steps);
        let (lh, lrh, wh) = train_scheduled(&dev, adam, "host", &schedule, steps);
        for t in 0..steps as usize {
            let want = schedule.lr(0.05, t as u32);
            // The device node's rate equals the host formula to one f32 ulp.
            assert!(
                (lre[t] - want).abs() <= want.abs() * f32::EPSILON,
                "adam {adam} step {t}: device lr {} vs host {want}",
                lre[t]
            );
            assert_eq!(lrg[t], lre[t], "graphed lr follows the schedule (step {t})");
            assert_eq!(lrh[t], want);
            let d = ((lg[t] - le[t]) / le[t].abs().max(1e-6)).abs();
            assert!(
                d <= 1e-6,
                "adam {adam} step {t}: loss eager {} graphed {}",
                le[t],
                lg[t]
            );
            let d = ((lh[t] - le[t]) / le[t].abs().max(1e-6)).abs();
            assert!(
                d <= 1e-6,
                "adam {adam} step {t}: loss host-scheduled {} vs {}",
                lh[t],
                le[t]
            );
        }
        assert!(
            rel_err(&wg, &to_f64(&we)) <= 1e-6,
            "adam {adam}: weights graphed vs eager"
        );
        assert!(
            rel_err(&wh, &to_f64(&we)) <= 1e-6,
            "adam {adam}: weights host vs device"
        );
        // The schedule really changed the rate (warm-up, cosine and step decay all visible).
        assert!(lre[0] < lre[5] && lre[29] < lre[10]);
    }
}

/// Mean cross-entropy and its gradient in f64.
fn ce_ref(z: &[f32], tgt: &[i32], rows: usize, cols: usize) -> (f64, Vec<f64>) {
    let mut loss = 0.0;
    let mut dz = vec![0.0; rows * cols];
    for r in 0..rows {
        let row = &z[r * cols..(r + 1) * cols];
        let mx = row.iter().fold(f64::MIN, |a, &b| a.max(b as f64));
        let s: f64 = row.iter().map(|&v| (v as f64 - mx).exp()).sum();
        let t = tgt[r] as usize;
        loss += s.ln() + mx - row[t] as f64;
        for c in 0..cols {
            let p = (row[c] as f64 - mx).exp() / s;
            dz[r * cols + c] = (p - if c == t { 1.0 } else { 0.0 }) / rows as f64;
        }
    }
    (loss / rows as f64, dz)
}

#[test]
fn cross_entropy_matches_f64_from_10_to_50000_classes() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(800);
    for &(rows, cols) in &[
        (1usize, 1usize),
        (1, 10),
        (37, 10),  // 4 lanes a row, one block of 256 threads
        (250, 7),  // 2 lanes a row, 512 threads
        (60, 64),  // 16 lanes a row
        (1000, 3), // a lane a row
        (99, 30),  // 8 lanes a row, the last warp one row short
        (257, 13), // 4 lanes would need 1028 threads: a warp per row, a sum pass
        (64, 100), // a warp per row, a sum pass
        (4099, 10),
        (33, 1024),
        (5, 1025),
        (64, 1000),
        (3, 50000),
        (128, 50000),
        (1, 49999),
        (7, 10007),  // split rows (H100: 10 chunks, the last shorter)
        (5, 4500),   // split rows (H100: 5 chunks)
        (131, 1031), // a block per row (H100: 2 chunks would be too few to split)
        (200, 1500), // a block per row
    ] {
        let zh: Vec<f32> = rng
            .vec_normal(rows * cols)
            .iter()
            .map(|v| 3.0 * v)
            .collect();
        let tgt: Vec<i32> = (0..rows).map(|r| ((r * 7919 + 3) % cols) as i32).collect();
        let p = Parameter::from_host(&s, "logits", &zh, &[rows, cols]).unwrap();
        let tg = Targets::from_host(&s, &tgt, cols).unwrap();
        let loss = cross_entropy(&s, &p.tensor(), &tg).unwrap();
        loss.backward(&s).unwrap();
        let (want, dz) = ce_ref(&zh, &tgt, rows, cols);
        let got = loss.to_vec(&s).unwrap()[0];
        assert!(
            ((got as f64 - want) / want.abs().max(1e-12)).abs() < 1e-5,
            "{rows}x{cols}: loss {got} vs {want}"
        );
        let g = s.to_vec(p.grad().unwrap().unwrap().as_ref()).unwrap();
        let err = rel_err(&g, &dz);
        assert!(err < 2e-6, "{rows}x{cols}: gradient {err}");
        // Without gradients: the same loss up to rounding (the registry measures the plan of
        // each mode on its own, and plans sum in different orders), no node.
        let l2 = no_grad(|| cross_entropy(&s, &p.tensor(), &tg)).unwrap();
        assert!(!l2.requires_grad());
        let l2 = l2.to_vec(&s).unwrap()[0];
        assert!(
            (l2 - got).abs() <= 1e-6 * got.abs(),
            "{rows}x{cols}: {l2} without a gradient, {got} with"
        );
    }
}

/// Every plan the registry may choose for narrow rows (the fixed one and each lane-group
/// plan) against the f64 reference, with and without the gradient; a plan made for other
/// sizes is refused.
#[test]
fn every_cross_entropy_plan_matches_f64() {
    use cudagraph_nn::kernels::losses::{ce_group_plans, ce_plan, LossKernels};
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let k = LossKernels::get(&dev).unwrap();
    let mut rng = HostRng::new(830);
    let mut plans_checked = 0;
    for &(rows, cols) in &[
        (9usize, 10usize),
        (33, 10),
        (256, 10),
        (60, 64),
        (64, 100),
        (99, 30),
        (1000, 3),
    ] {
        let mut zh: Vec<f32> = rng
            .vec_normal(rows * cols)
            .iter()
            .map(|v| 3.0 * v)
            .collect();
        // A masked logit (not the row's target): it adds nothing, its gradient is 0.
        zh[1] = f32::NEG_INFINITY;
        let tgt: Vec<i32> = (0..rows).map(|r| ((r * 7919 + 3) % cols) as i32).collect();
        let (want, dz) = ce_ref(&zh, &tgt, rows, cols);
        let z = s.alloc_from_host(&zh).unwrap();
        let t = s.alloc_from_host(&tgt).unwrap();
        let mut plans = vec![ce_plan(rows, cols, k.sms()).unwrap()];
        plans.extend(ce_group_plans(rows, cols));
        assert!(plans.len() > 1, "{rows}x{cols}: no lane-group plan");
        for plan in &plans {
            for with_grad in [false, true] {
                let loss = s.alloc_from_host(&[f32::NAN]).unwrap();
                let grad = s.alloc_from_host(&vec![f32::NAN; rows * cols]).unwrap();
                let g = with_grad.then_some(&grad);
                k.cross_entropy_planned(&s, plan, &z, &t, g, &loss, rows, cols)
                    .unwrap();
                let got = s.to_vec(&loss).unwrap()[0] as f64;
                assert!(
                    ((got - want) / want.abs().max(1e-12)).abs() < 1e-5,
                    "{rows}x{cols} {plan:?}: loss {got} vs {want}"
                );
                if with_grad {
                    let err = rel_err(&s.to_vec(&grad).unwrap(), &dz);
                    assert!(err < 2e-6, "{rows}x{cols} {plan:?}: gradient {err}");
                }
            }
            plans_checked += 1;
        }
        // The largest group plan of these sizes is not a plan for twice the rows.
        let loss = s.alloc_from_host(&[0.0f32]).unwrap();
        let big = ce_group_plans(rows, cols).pop().unwrap();
        if !ce_group_plans(rows * 2, cols).contains(&big) {
            let z2 = s.alloc_from_host(&vec![0.0f32; 2 * rows * cols]).unwrap();
            let t2 = s.alloc_from_host(&vec![0i32; 2 * rows]).unwrap();
            let e = k
                .cross_entropy_planned(&s, &big, &z2, &t2, None, &loss, 2 * rows, cols)
                .unwrap_err();
            assert!(e.to_string().contains("is not a plan"), "{e}");
        }
    }
    assert!(plans_checked >= 16, "{plans_checked}");
}

#[test]
fn cross_entropy_reports_and_clamps_bad_targets_in_every_kernel() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(810);
    // A warp per row, lanes groups per row, rows split across blocks, a block per row.
    for &(rows, cols) in &[(4usize, 10usize), (40, 30), (4, 5000), (200, 1500)] {
        let z = Tensor::from_host(&s, &rng.vec_normal(rows * cols), &[rows, cols]).unwrap();
        let mut tgt: Vec<i32> = vec![0; rows];
        tgt[2] = cols as i32 + 5;
        let tg = Arc::new(s.alloc_from_host(&tgt).unwrap());
        let loss = cross_entropy(&s, &z, &tg).unwrap();
        match s.synchronize() {
            Err(cudagraph::Error::DeviceCheck {
                check,
                value,
                bound,
                position,
            }) => {
                assert_eq!(check, "cross_entropy target");
                assert_eq!((value, bound, position), (cols as i64 + 5, cols as i64, 2));
            }
            other => panic!("{rows}x{cols}: expected a device check, got {other:?}"),
        }
        assert!(
            loss.to_vec(&s).unwrap()[0].is_finite(),
            "clamped, not garbage"
        );
    }
}

#[test]
fn cross_entropy_replays_equal_eager_bit_for_bit() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(820);
    for &(rows, cols) in &[(64usize, 10usize), (300, 1000), (16, 50000)] {
        let p = Parameter::from_host(&s, "z", &rng.vec_normal(rows * cols), &[rows, cols]).unwrap();
        let tgt: Vec<i32> = (0..rows).map(|r| (r % cols) as i32).collect();
        let tg = Targets::from_host(&s, &tgt, cols).unwrap();
        p.zero_grad(&s, true).unwrap();
        let le = cross_entropy(&s, &p.tensor(), &tg).unwrap();
        le.backward(&s).unwrap();
        let (le, ge) = (
            le.to_vec(&s).unwrap(),
            s.to_vec(p.grad().unwrap().unwrap().as_ref()).unwrap(),
        );
        let (g, lg) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            p.zero_grad(cs, true)?;
            let l = cross_entropy(cs, &p.tensor(), &tg)?;
            l.backward(cs)?;
            Ok(l)
        })
        .unwrap();
        g.replay(&s).unwrap();
        assert_bits_eq(
            &lg.to_vec(&s).unwrap(),
            &le,
            format_args!("{rows}x{cols} loss, replay vs eager"),
        );
        assert_bits_eq(
            &s.to_vec(p.grad().unwrap().unwrap().as_ref()).unwrap(),
            &ge,
            format_args!("{rows}x{cols} gradient, replay vs eager"),
        );
    }
}

#[test]
fn mse_matches_f64_with_any_upstream_gradient() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(900);
    for &n in &[1usize, 7, 32768, 32769, 1_000_003] {
        for (reduction, mean) in [(Reduction::Sum, false), (Reduction::Mean, true)] {
            let (ph, th) = (rng.vec_normal(n), rng.vec_normal(n));
            let p = Parameter::from_host(&s, "p", &ph, &[n]).unwrap();
            let t = Tensor::from_host(&s, &th, &[n]).unwrap();
            let loss = mse_loss(&s, &p.tensor(), &t, reduction).unwrap();
            let (pd, td) = (to_f64(&ph), to_f64(&th));
            let want = cudagraph_nn::cpu::mse(&pd, &td, mean);
            let got = loss.to_vec(&s).unwrap()[0] as f64;
            assert!(
                ((got - want) / want.max(1e-12)).abs() < 1e-5,
                "n {n}: {got} vs {want}"
            );
            // Upstream gradient 2.5: dp = 2.5 · 2·scale·(p − t).
            loss.backward_with(&s, Tensor::full(&s, &[1], 2.5).unwrap())
                .unwrap();
            let want_g: Vec<f64> = cudagraph_nn::cpu::mse_grad(&pd, &td, mean)
                .iter()
                .map(|g| 2.5 * g)
                .collect();
            let g = s.to_vec(p.grad().unwrap().unwrap().as_ref()).unwrap();
            assert!(
                rel_err(&g, &want_g) < 1e-6,
                "n {n}: {}",
                rel_err(&g, &want_g)
            );
            p.zero_grad(&s, true).unwrap();
            let l2 = no_grad(|| mse_loss(&s, &p.tensor(), &t, reduction)).unwrap();
            assert!(!l2.requires_grad());
            assert_eq!(l2.to_vec(&s).unwrap()[0] as f64, got);
        }
    }
}

#[test]
fn optimizers_reject_bad_configurations() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let p = Parameter::from_host(&s, "w", &[1.0, 2.0], &[2]).unwrap();
    assert!(Sgd::new(&s, vec![p.clone()], -0.1, 0.0, 0.0).is_err());
    assert!(Sgd::new(&s, vec![p.clone()], 0.1, f32::NAN, 0.0).is_err());
    assert!(Adam::with_config(
        &s,
        vec![p.clone()],
        AdamConfig {
            beta2: 1.0,
            ..AdamConfig::default()
        }
    )
    .is_err());
    // The same parameter twice would be updated twice, concurrently.
    assert!(Adam::new(&s, vec![p.clone(), p.clone()], 0.1, 0.0, false).is_err());
    // An optimizer with no gradients at all still steps (and counts the step).
    let mut opt = Sgd::new(&s, vec![p.clone()], 0.1, 0.0, 0.0).unwrap();
    opt.step(&s).unwrap();
    assert_eq!(s.to_vec(p.data().unwrap()).unwrap(), vec![1.0, 2.0]);
    assert_eq!(opt.hyperparameters().unwrap().step_count(&s).unwrap(), 1);
}

#[test]
fn graph_cache_staged_run_into_and_measured_choice_match_eager() {
    use cudagraph::graph::cache::{choose, Choice, Selection};
    use cudagraph::{BucketPolicy, CacheOptions, GraphCache, QueueExt, Served};
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(1000);
    let model = Sequential::new(vec![
        Layer::Linear(Linear::new(&s, 64, 32, &mut rng).unwrap()),
        Layer::ReLU,
        Layer::Linear(Linear::new(&s, 32, 10, &mut rng).unwrap()),
    ]);
    let eager = |s: &Stream, xh: &[f32], rows: usize| {
        no_grad(|| model.forward(s, &Tensor::from_host(s, xh, &[rows, 64]).unwrap()))
            .unwrap()
            .to_vec(s)
            .unwrap()
    };
    for selection in [Selection::Graph, Selection::Measure] {
        let batched = Batched {
            module: model.clone(),
            row_shape: vec![64],
            output_row: 10,
        };
        let opts = CacheOptions {
            selection,
            ..CacheOptions::default()
        };
        let mut cache =
            GraphCache::new(&mut s, batched, BucketPolicy::Sizes(vec![1, 4, 16]), opts).unwrap();
        for e in cache.entries() {
            match selection {
                Selection::Graph => {
                    assert_eq!(
                        (
                            e.choice,
                            e.copy_choice,
                            e.graph_us,
                            e.eager_us,
                            e.copy_in_us
                        ),
                        (Choice::Graph, Choice::Graph, None, None, None)
                    )
                }
                Selection::Measure => {
                    let (g, x) = (e.graph_us.unwrap(), e.eager_us.unwrap());
                    let c = e.copy_in_us.unwrap();
                    assert!(g > 0.0 && x > 0.0 && c > 0.0);
                    assert_eq!(e.choice, choose(g, x));
                    // From a caller's buffer the graph pays the copy into the static input.
                    assert_eq!(e.copy_choice, choose(g + c, x));
                }
            }
        }
        let choice_of = |cache: &GraphCache<Batched<Sequential>>, size: usize, copied: bool| {
            let e = *cache.entries().iter().find(|e| e.size == size).unwrap();
            if copied {
                e.copy_choice
            } else {
                e.choice
            }
        };
        let out = s.alloc::<f32>(20 * 10).unwrap();
        // 16 rows first, so later padded requests see stale rows in the static input.
        for rows in [16usize, 3, 1, 4, 7, 20, 16, 2] {
            let xh = rng.vec_normal(rows * 64);
            let want = eager(&s, &xh, rows);
            let bucket = [1usize, 4, 16].into_iter().find(|&b| b >= rows);
            // Every size was captured (and measured) up front, so the way is known.
            let want_served = |copied: bool| match bucket {
                None => Served::Fallback,
                Some(b) => match choice_of(&cache, b, copied) {
                    Choice::Eager => Served::Eager { size: b },
                    Choice::Graph if b == rows => Served::Exact { size: b },
                    Choice::Graph => Served::Padded {
                        size: b,
                        padded_rows: b - rows,
                    },
                },
            };
            let (staged_way, copied_way) = (want_served(false), want_served(true));
            let expect = |served: Served, want: Served| assert_eq!(served, want, "{rows} rows");
            // Staged: the producer writes straight into the static input.
            let st = cache.stage(&s, rows).unwrap();
            assert_eq!(st.input().len(), rows * 64);
            s.copy_from_host(&xh, st.input()).unwrap();
            let (o, served) = st.run(&mut s).unwrap();
            let got = o.to_vec(&s).unwrap();
            assert!(
                rel_err(&got, &to_f64(&want)) < 1e-5,
                "staged {rows}: {served:?}"
            );
            expect(served, staged_way);
            // run_into and run from a caller's buffer.
            let x = s.alloc_from_host(&xh).unwrap();
            let served = cache.run_into(&mut s, &x, rows, &out).unwrap();
            let got = s.to_vec(&out.prefix(rows * 10).unwrap()).unwrap();
            assert!(rel_err(&got, &to_f64(&want)) < 1e-5, "run_into {rows}");
            expect(served, copied_way);
            let (o, served) = cache.run(&mut s, &x, rows).unwrap();
            assert!(
                rel_err(&s.to_vec(&o).unwrap(), &to_f64(&want)) < 1e-5,
                "run {rows}"
            );
            expect(served, copied_way);
        }
        let st = *cache.stats();
        assert_eq!(st.requests, 24);
        assert_eq!(st.exact + st.padded + st.eager + st.fallbacks, 24);
        assert_eq!(st.fallbacks, 3);
        // An output buffer too small for the rows is refused before anything runs.
        let x = s.alloc_from_host(&rng.vec_normal(4 * 64)).unwrap();
        assert!(cache
            .run_into(&mut s, &x, 4, &out.prefix(39).unwrap())
            .is_err());
    }
}
