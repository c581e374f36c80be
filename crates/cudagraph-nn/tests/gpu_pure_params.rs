//! GPU tests of pure 16-bit training: parameters stored only in bf16 (PyTorch's
//! `model.to(torch.bfloat16)` with AdamW on those parameters) through `Parameter`,
//! `Sequential::to_dtype`, autograd, `Sgd`/`Adam` and checkpoints (an AdamW step of f16
//! parameters is checked against its reference too).
//!
//! Reference: the optimizer's rule in f64 from the state the device started the step from
//! (parameters, gradients and moments read back), with the f32 hyperparameters widened. A new
//! 16-bit parameter is the f32 result rounded once to nearest, so it lies within half a unit
//! in the last place of the reference plus the f32 arithmetic's error (1e-5 of the step's
//! terms), and at least 90 % of the elements equal the reference rounded to nearest even
//! exactly. f32 parameters of the same optimizer: within 1e-5 relative. A captured step
//! replays to the bits of the eager one; a resumed run continues bit for bit; misuse is a
//! typed error.

use cudagraph::memory::bf16;
use cudagraph::{gpu_test_device, CaptureOptions, Graph, Queue, QueueExt, Stream};
use cudagraph_nn::dtype::{Dtype, TypedBuffer};
use cudagraph_nn::io::checkpoint::{decode, Values};
use cudagraph_nn::*;

const IN: usize = 8;
const HIDDEN: usize = 32;
const OUT: usize = 4;

/// Linear → ReLU → Linear with PyTorch's init from `seed`, stored in bf16.
fn mlp(s: &Stream, seed: u64) -> Sequential {
    mlp_as(s, seed, Dtype::Bf16)
}

/// [`mlp`] stored in `dtype`.
fn mlp_as(s: &Stream, seed: u64, dtype: Dtype) -> Sequential {
    let mut rng = HostRng::new(seed);
    let mut m = Sequential::new(vec![
        Layer::Linear(Linear::new(s, IN, HIDDEN, &mut rng).unwrap()),
        Layer::ReLU,
        Layer::Linear(Linear::new(s, HIDDEN, OUT, &mut rng).unwrap()),
    ]);
    m.to_dtype(s, dtype).unwrap();
    m
}

/// A regression batch of `rows` rows: `x` (bf16) and `y = x·A` (f32) for a random `A`. Each
/// test uses its own row count, so the engine registry measures its products once, in that
/// test, and every later call (eager, captured, resumed) runs the engine chosen then.
fn batch(s: &Stream, seed: u64, rows: usize) -> (Tensor, Tensor) {
    batch_as(s, seed, rows, Dtype::Bf16)
}

/// [`batch`] with `x` in `dtype` (its values are bf16 values, exact in f16 too but for the
/// rare ones below f16's normal range).
fn batch_as(s: &Stream, seed: u64, rows: usize, dtype: Dtype) -> (Tensor, Tensor) {
    let mut rng = HostRng::new(seed);
    let a = rng.vec_normal(IN * OUT);
    let x: Vec<f32> = rng
        .vec_normal(rows * IN)
        .iter()
        .map(|&v| bf16::from_f32(v).to_f32())
        .collect();
    let mut y = vec![0.0f32; rows * OUT];
    for r in 0..rows {
        for o in 0..OUT {
            y[r * OUT + o] = (0..IN).map(|i| x[r * IN + i] * a[i * OUT + o]).sum();
        }
    }
    (
        Tensor::from_host(s, &x, &[rows, IN])
            .unwrap()
            .to_dtype(s, dtype)
            .unwrap(),
        Tensor::from_host(s, &y, &[rows, OUT]).unwrap(),
    )
}

fn adamw(s: &Stream, params: Vec<Parameter>) -> Adam {
    Adam::adamw(
        s,
        params,
        AdamConfig {
            lr: 1e-2,
            ..AdamConfig::adamw()
        },
    )
    .unwrap()
}

/// One training step: forward in bf16, the loss in f32, backward, the optimizer's step.
fn step(
    q: &dyn Queue,
    model: &Sequential,
    opt: &mut dyn Optimizer,
    x: &Tensor,
    y: &Tensor,
) -> Result<Tensor> {
    opt.zero_grad(q, true)?;
    let out = model.forward(q, x)?;
    let loss = mse_loss(q, &out, y, Reduction::Mean)?;
    loss.backward(q)?;
    opt.step(q)?;
    Ok(loss)
}

/// One step of a throwaway model on batches of `rows` rows, so the engine registry has chosen
/// every product's engine before the runs a test compares begin.
fn warm_up(s: &Stream, rows: usize) {
    let model = mlp(s, 0);
    let mut opt = adamw(s, model.parameters());
    let (x, y) = batch(s, 0, rows);
    step(s, &model, &mut opt, &x, &y).unwrap();
    s.synchronize().unwrap();
}

/// Every parameter's bits (bf16 values widened to f32 exactly, so equal bits are equal
/// bf16 bits).
fn bits(s: &Stream, params: &[Parameter]) -> Vec<Vec<u32>> {
    params
        .iter()
        .map(|p| p.to_vec(s).unwrap().iter().map(|v| v.to_bits()).collect())
        .collect()
}

fn state_bits(s: &Stream, opt: &dyn Optimizer) -> Vec<(String, Vec<u32>)> {
    opt.state_buffers()
        .into_iter()
        .map(|(name, b)| {
            let v = match b {
                StateBuffer::F32(b) => s.to_vec(b).unwrap().iter().map(|v| v.to_bits()).collect(),
                StateBuffer::U32(b) => s.to_vec(b).unwrap(),
            };
            (name, v)
        })
        .collect()
}

fn grad_f32(s: &Stream, p: &Parameter) -> Vec<f64> {
    match p.grad_typed().expect("a gradient") {
        TypedBuffer::Bf16(g) => s
            .to_vec(&g)
            .unwrap()
            .iter()
            .map(|v| v.to_f32() as f64)
            .collect(),
        TypedBuffer::F16(g) => s
            .to_vec(&g)
            .unwrap()
            .iter()
            .map(|v| v.to_f32() as f64)
            .collect(),
        TypedBuffer::F32(g) => s.to_vec(&g).unwrap().iter().map(|&v| v as f64).collect(),
    }
}

fn wide(s: &Stream, p: &Parameter) -> Vec<f64> {
    p.to_vec(s).unwrap().iter().map(|&v| v as f64).collect()
}

/// Half a unit in the last place at `r` of bf16 (8 significant bits, smallest normal
/// exponent -126) or f16 (11 bits, -14; below that the subnormals' fixed step).
fn half_ulp(dtype: Dtype, r: f64) -> f64 {
    let (bits, min_exp) = match dtype {
        Dtype::F16 => (11, -14),
        _ => (8, -126),
    };
    let e = if r == 0.0 {
        min_exp
    } else {
        (r.abs().log2().floor() as i32).max(min_exp)
    };
    2f64.powi(e - bits)
}

/// `v` rounded to nearest even in `dtype`.
fn round_to(dtype: Dtype, v: f64) -> f32 {
    match dtype {
        Dtype::F16 => half::f16::from_f32(v as f32).to_f32(),
        _ => bf16::from_f32(v as f32).to_f32(),
    }
}

/// New bf16 values against their f64 reference (see the module documentation).
fn check_bf16(what: &str, got: &[f64], want: &[f64], scale: &[f64]) {
    check_16(Dtype::Bf16, what, got, want, scale)
}

/// New 16-bit values of `dtype` against their f64 reference.
fn check_16(dtype: Dtype, what: &str, got: &[f64], want: &[f64], scale: &[f64]) {
    let mut exact = 0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let bound = half_ulp(dtype, w) + 1e-5 * scale[i];
        assert!(
            (g - w).abs() <= bound,
            "{what} {dtype} element {i}: {g} vs reference {w} (bound {bound:e})"
        );
        if g as f32 == round_to(dtype, w) {
            exact += 1;
        }
    }
    assert!(
        exact * 10 >= got.len() * 9,
        "{what}: only {exact} of {} equal the reference rounded to nearest",
        got.len()
    );
}

#[test]
fn to_dtype_stores_the_parameters_in_bf16_and_gradients_come_in_bf16() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(3);
    let l = Linear::new(&s, IN, OUT, &mut rng).unwrap();
    let w32 = l.weight.to_vec(&s).unwrap();
    let mut m = Sequential::new(vec![Layer::Linear(l)]);
    assert_eq!(m.dtype(), Dtype::F32);
    m.to_dtype(&s, Dtype::Bf16).unwrap();
    assert_eq!(m.dtype(), Dtype::Bf16);
    let params = m.parameters();
    assert!(params.iter().all(|p| p.dtype() == Dtype::Bf16));
    // Rounded to nearest even, once.
    let w16 = params[0].to_vec(&s).unwrap();
    for (a, b) in w16.iter().zip(&w32) {
        assert_eq!(a.to_bits(), bf16::from_f32(*b).to_f32().to_bits());
    }
    // from_host_as rounds the same way.
    let p = Parameter::from_host_as(&s, "w", &w32, &[OUT, IN], Dtype::Bf16).unwrap();
    assert_eq!(p.to_vec(&s).unwrap(), w16);
    let (x, y) = batch(&s, 7, 40);
    let loss = mse_loss(&s, &m.forward(&s, &x).unwrap(), &y, Reduction::Mean).unwrap();
    loss.backward(&s).unwrap();
    for p in &params {
        assert_eq!(p.grad_typed().unwrap().dtype(), Dtype::Bf16, "{}", p.name());
        assert!(matches!(
            p.grad().unwrap_err(),
            NnError::Dtype { found: "bf16", .. }
        ));
        assert!(matches!(
            p.data().unwrap_err(),
            NnError::Dtype { found: "bf16", .. }
        ));
    }
}

#[test]
fn gradients_of_a_bf16_parameter_accumulate_in_its_own_type() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(5);
    let p = Parameter::from_host_as(&s, "p", &rng.vec_normal(300), &[300], Dtype::Bf16).unwrap();
    let t = Tensor::from_host(&s, &rng.vec_normal(300), &[300]).unwrap();
    mse_loss(&s, &p.tensor(), &t, Reduction::Mean)
        .unwrap()
        .backward(&s)
        .unwrap();
    let once = grad_f32(&s, &p);
    // A second backward without zero_grad adds in place: g + g = 2g exactly in bf16.
    mse_loss(&s, &p.tensor(), &t, Reduction::Mean)
        .unwrap()
        .backward(&s)
        .unwrap();
    let twice = grad_f32(&s, &p);
    for (i, (a, b)) in once.iter().zip(&twice).enumerate() {
        assert_eq!(2.0 * a, *b, "element {i}");
    }
    // zero_grad(false) zeroes the bf16 buffer in place.
    p.zero_grad(&s, false).unwrap();
    assert!(grad_f32(&s, &p).iter().all(|&v| v == 0.0));
}

#[test]
fn one_adamw_step_of_bf16_parameters_matches_the_f64_rule_rounded_once() {
    adamw_step_matches_the_f64_rule(Dtype::Bf16, 64);
}

#[test]
fn one_adamw_step_of_f16_parameters_matches_the_f64_rule_rounded_once() {
    adamw_step_matches_the_f64_rule(Dtype::F16, 88);
}

fn adamw_step_matches_the_f64_rule(dtype: Dtype, rows: usize) {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let model = mlp_as(&s, 11, dtype);
    let params = model.parameters();
    let mut opt = adamw(&s, params.clone());
    let (x, y) = batch_as(&s, 12, rows, dtype);
    opt.zero_grad(&s, true).unwrap();
    let out = model.forward(&s, &x).unwrap();
    mse_loss(&s, &out, &y, Reduction::Mean)
        .unwrap()
        .backward(&s)
        .unwrap();
    let before: Vec<(Vec<f64>, Vec<f64>)> = params
        .iter()
        .map(|p| (wide(&s, p), grad_f32(&s, p)))
        .collect();
    opt.step(&s).unwrap();
    let (lr, wd) = (1e-2f32 as f64, 1e-2f32 as f64);
    let (b1, b2, eps) = (0.9f32 as f64, 0.999f32 as f64, 1e-8f32 as f64);
    for (p, (w0, g0)) in params.iter().zip(&before) {
        let mut want = Vec::with_capacity(w0.len());
        let mut scale = Vec::with_capacity(w0.len());
        for (&w, &g) in w0.iter().zip(g0) {
            // Step 1: m̂ = g, v̂ = g².
            let w1 = w - lr * wd * w;
            let m = (1.0 - b1) * g;
            let v = (1.0 - b2) * g * g;
            let upd = lr / (1.0 - b1) * m / (v.sqrt() / (1.0 - b2).sqrt() + eps);
            want.push(w1 - upd);
            scale.push(w.abs() + upd.abs());
        }
        check_16(
            dtype,
            &format!("adamw {}", p.name()),
            &wide(&s, p),
            &want,
            &scale,
        );
        assert_eq!(p.dtype(), dtype);
    }
    assert_eq!(opt.step_counts(&s).unwrap(), vec![1; params.len()]);
    assert_eq!(opt.hyperparameters().unwrap().step_count(&s).unwrap(), 1);
}

#[test]
fn an_sgd_of_f32_and_bf16_parameters_steps_both_in_one_step() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(21);
    let n = 1000;
    let p16 = Parameter::from_host_as(&s, "p16", &rng.vec_normal(n), &[n], Dtype::Bf16).unwrap();
    let p32 = Parameter::from_host(&s, "p32", &rng.vec_normal(n), &[n]).unwrap();
    let t = Tensor::from_host(&s, &rng.vec_normal(n), &[n]).unwrap();
    let (lr, momentum, wd) = (0.1f32, 0.9f32, 0.01f32);
    let mut opt = Sgd::new(&s, vec![p16.clone(), p32.clone()], lr, momentum, wd).unwrap();
    let (lr, momentum, wd) = (lr as f64, momentum as f64, wd as f64);
    for k in 1..=2u32 {
        opt.zero_grad(&s, true).unwrap();
        for p in [&p16, &p32] {
            let loss = mse_loss(&s, &p.tensor(), &t, Reduction::Sum).unwrap();
            loss.backward(&s).unwrap();
        }
        let bufs: Vec<Vec<f64>> = state_bits(&s, &opt)
            .into_iter()
            .map(|(_, b)| b.iter().map(|&u| f32::from_bits(u) as f64).collect())
            .collect();
        assert_eq!(bufs.len(), 2, "a momentum buffer per parameter");
        let before: Vec<(Vec<f64>, Vec<f64>)> = [&p16, &p32]
            .iter()
            .map(|p| (wide(&s, p), grad_f32(&s, p)))
            .collect();
        opt.step(&s).unwrap();
        for (i, p) in [&p16, &p32].iter().enumerate() {
            let (w0, g0) = &before[i];
            let mut want = Vec::with_capacity(n);
            let mut scale = Vec::with_capacity(n);
            for j in 0..n {
                let d = g0[j] + wd * w0[j];
                let buf = momentum * bufs[i][j] + d;
                want.push(w0[j] - lr * buf);
                scale.push(w0[j].abs() + (lr * buf).abs());
            }
            let got = wide(&s, p);
            let what = format!("sgd step {k} {}", p.name());
            if p.dtype() == Dtype::Bf16 {
                check_bf16(&what, &got, &want, &scale);
            } else {
                for j in 0..n {
                    assert!(
                        (got[j] - want[j]).abs() <= 1e-5 * scale[j] + 1e-12,
                        "{what} element {j}: {} vs {}",
                        got[j],
                        want[j]
                    );
                }
            }
        }
    }
    assert_eq!(opt.hyperparameters().unwrap().step_count(&s).unwrap(), 2);
}

#[test]
fn a_captured_pure_bf16_adamw_step_replays_to_the_bits_of_the_eager_one() {
    let dev = gpu_test_device!();
    let steps = 6;
    let (x_seed, model_seed) = (31, 32);
    // Eager throughout.
    let s = dev.new_stream().unwrap();
    warm_up(&s, 48);
    let model = mlp(&s, model_seed);
    let mut opt = adamw(&s, model.parameters());
    let (x, y) = batch(&s, x_seed, 48);
    let mut eager_losses = Vec::new();
    for _ in 0..steps {
        let loss = step(&s, &model, &mut opt, &x, &y).unwrap();
        eager_losses.push(loss.to_vec(&s).unwrap()[0].to_bits());
    }
    let eager = (bits(&s, &model.parameters()), state_bits(&s, &opt));
    // One eager step (the engines are chosen outside the capture), then a captured step
    // replayed for the rest.
    let mut s2 = dev.new_stream().unwrap();
    let model2 = mlp(&s2, model_seed);
    let mut opt2 = adamw(&s2, model2.parameters());
    let (x2, y2) = batch(&s2, x_seed, 48);
    let first = step(&s2, &model2, &mut opt2, &x2, &y2).unwrap();
    let mut graph_losses = vec![first.to_vec(&s2).unwrap()[0].to_bits()];
    let (g, loss) = Graph::capture(&mut s2, CaptureOptions::new(), |cs| {
        Ok(step(cs, &model2, &mut opt2, &x2, &y2)?)
    })
    .unwrap();
    for _ in 1..steps {
        g.replay(&s2).unwrap();
        graph_losses.push(loss.to_vec(&s2).unwrap()[0].to_bits());
    }
    let graphed = (bits(&s2, &model2.parameters()), state_bits(&s2, &opt2));
    assert_eq!(graph_losses, eager_losses, "losses");
    assert_eq!(graphed.0, eager.0, "bf16 parameters");
    assert_eq!(graphed.1, eager.1, "moments and step counts");
    assert!(model2.parameters().iter().all(|p| p.dtype() == Dtype::Bf16));
}

#[test]
fn the_loss_falls_training_a_pure_bf16_mlp() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let model = mlp(&s, 41);
    let mut opt = adamw(&s, model.parameters());
    let (x, y) = batch(&s, 42, 80);
    let mut losses = Vec::new();
    for _ in 0..200 {
        let loss = step(&s, &model, &mut opt, &x, &y).unwrap();
        losses.push(loss.to_vec(&s).unwrap()[0]);
    }
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    assert!(
        last.is_finite() && last < 0.2 * first,
        "loss {first} -> {last}"
    );
}

fn low_precision(e: NnError, what: &str) {
    assert!(
        matches!(&e, NnError::Amp(AmpError::LowPrecisionParams { what: w, dtype: "bf16", .. }) if *w == what),
        "{what}: {e}"
    );
}

#[test]
fn misuse_with_bf16_parameters_is_a_typed_error() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let model = mlp(&s, 51);
    let params = model.parameters();
    // 16-bit copies are made from f32 masters: none here.
    let e = Adam::with_options(
        &s,
        params.clone(),
        AdamConfig::adamw(),
        OptimOptions {
            copies: Some(Dtype::Bf16),
        },
    )
    .err()
    .expect("copies of bf16 parameters");
    low_precision(e, "optimizer copies");
    let e = Sgd::with_options(
        &s,
        params.clone(),
        SgdConfig::default(),
        OptimOptions {
            copies: Some(Dtype::F16),
        },
    )
    .err()
    .expect("copies of bf16 parameters");
    low_precision(e, "optimizer copies");
    // Gradients in bf16: the scaler and clipping refuse them.
    let mut opt = adamw(&s, params.clone());
    let (x, y) = batch(&s, 52, 72);
    let loss = mse_loss(&s, &model.forward(&s, &x).unwrap(), &y, Reduction::Mean).unwrap();
    loss.backward(&s).unwrap();
    let before = bits(&s, &params);
    let mut scaler = GradScaler::new(&s, GradScalerConfig::default()).unwrap();
    low_precision(scaler.unscale(&s, &opt).unwrap_err(), "GradScaler");
    low_precision(scaler.step(&s, &mut opt).unwrap_err(), "GradScaler");
    low_precision(
        clip_grad_norm(&s, &params, 1.0).unwrap_err(),
        "clip_grad_norm",
    );
    assert_eq!(bits(&s, &params), before, "nothing was updated");
    // A gradient of another type is refused too.
    let f32_grad = std::sync::Arc::new(s.alloc_zeroed::<f32>(params[0].numel()).unwrap());
    assert!(matches!(
        params[0].set_grad(Some(f32_grad)).unwrap_err(),
        NnError::Dtype {
            expected: "bf16",
            found: "f32",
            ..
        }
    ));
    // The optimizer itself steps them.
    opt.step(&s).unwrap();
    assert_ne!(bits(&s, &params), before);
}

#[test]
fn a_checkpoint_of_a_bf16_model_stores_bf16_and_resumes_bit_for_bit() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    warm_up(&s, 56);
    let (x, y) = batch(&s, 61, 56);
    let total = 6;
    let stop = 3;
    let want = {
        let model = mlp(&s, 62);
        let mut opt = adamw(&s, model.parameters());
        for _ in 0..total {
            step(&s, &model, &mut opt, &x, &y).unwrap();
        }
        (bits(&s, &model.parameters()), state_bits(&s, &opt))
    };
    let path = std::env::temp_dir().join(format!(
        "cudagraph-pure-bf16-{}.safetensors",
        std::process::id()
    ));
    {
        let model = mlp(&s, 62);
        let mut opt = adamw(&s, model.parameters());
        for _ in 0..stop {
            step(&s, &model, &mut opt, &x, &y).unwrap();
        }
        let params = model.parameters();
        let ck = Checkpoint {
            model: &params,
            optimizer: &opt,
            scaler: None,
        };
        save_checkpoint(&s, &path, &ck).unwrap();
    }
    // The file holds the parameters as BF16 tensors.
    let bytes = std::fs::read(&path).unwrap();
    let (entries, _) = decode(&bytes, "checkpoint").unwrap();
    let w = &entries["model.0.weight"];
    assert!(matches!(w.values, Values::Bf16(_)), "{:?}", w.values);
    assert_eq!(w.shape, vec![HIDDEN, IN]);
    // An f32 model does not take it (and keeps its values).
    {
        let mut rng = HostRng::new(63);
        let f32_model = Sequential::new(vec![
            Layer::Linear(Linear::new(&s, IN, HIDDEN, &mut rng).unwrap()),
            Layer::ReLU,
            Layer::Linear(Linear::new(&s, HIDDEN, OUT, &mut rng).unwrap()),
        ]);
        let params = f32_model.parameters();
        let before = bits(&s, &params);
        let mut opt = adamw(&s, params.clone());
        let e = load_checkpoint(
            &s,
            &path,
            CheckpointMut {
                model: &params,
                optimizer: &mut opt,
                scaler: None,
            },
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                NnError::Io(IoError::Checkpoint(CheckpointError::Mismatch { .. }))
            ),
            "{e}"
        );
        assert_eq!(bits(&s, &params), before);
    }
    // Another initialisation, loaded and continued, ends where the uninterrupted run did.
    let model = mlp(&s, 64);
    let params = model.parameters();
    assert_ne!(bits(&s, &params), want.0);
    let mut opt = adamw(&s, params.clone());
    load_checkpoint(
        &s,
        &path,
        CheckpointMut {
            model: &params,
            optimizer: &mut opt,
            scaler: None,
        },
    )
    .unwrap();
    std::fs::remove_file(&path).ok();
    for _ in stop..total {
        step(&s, &model, &mut opt, &x, &y).unwrap();
    }
    assert_eq!(bits(&s, &params), want.0, "bf16 parameters");
    assert_eq!(state_bits(&s, &opt), want.1, "moments and step counts");
}

#[test]
fn data_parallel_training_refuses_bf16_parameters() {
    let dev = gpu_test_device!();
    // Under CUDAGRAPH_REQUIRE_GPU=1 a missing NCCL fails here instead of skipping.
    if !cudagraph_nn::dist::nccl_or_skip() {
        return;
    }
    let opts = cudagraph_nn::dist::DistOptions {
        timeout: std::time::Duration::from_secs(120),
        ..Default::default()
    };
    let comm = Communicator::init(&dev, &cudagraph_nn::dist::DistEnv::single(), &opts).unwrap();
    let s = dev.new_stream().unwrap();
    let model = mlp(&s, 71);
    match DistributedDataParallel::new(&s, &comm, model.parameters(), DdpOptions::default()) {
        Ok(_) => panic!("DDP of bf16 parameters was accepted"),
        Err(e) => low_precision(e, "DistributedDataParallel"),
    }
}
