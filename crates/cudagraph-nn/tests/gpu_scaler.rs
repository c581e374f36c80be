//! GPU tests of loss scaling on the device (`GradScaler`, `scale_by_device`) and of the fused
//! optimizers' 16-bit model copies.
//!
//! Tolerances and exactness:
//! - the scaler's numbers (scale, growth tracker, flags) are exact: the update is one thread
//!   computing PyTorch's rule, checked against the same rule on the host;
//! - scaling by a power of two and unscaling again is exact, so a scaled training run equals
//!   the unscaled one bit for bit (parameters, moments and the gradients after the step);
//! - a skipped step changes no bit of any parameter, moment, momentum buffer, counter or copy;
//! - every copy element is the bit pattern the `half` crate's round-to-nearest-even gives for
//!   the master (the cast kernels' contract; masters here are never NaN);
//! - `scale_by_device` against an f64 reference: 1e-6 relative (one or two f32 roundings per
//!   element);
//! - a captured step replays equal to the eager one, bit for bit (only this crate's kernels).

use std::sync::Arc;

use cudagraph::memory::{bf16, f16};
use cudagraph::testing::assert_bits_eq;
use cudagraph::{
    gpu_test_device, CaptureOptions, Device, DeviceBuffer, Graph, Queue, QueueExt, Stream,
};
use cudagraph_nn::cpu::{rel_err, to_f64};
use cudagraph_nn::dtype::{Dtype, TypedBuffer};
use cudagraph_nn::*;

/// The state of the GradScaler example: a parameter `w` (one element), the input `x`
/// (a device scalar written before each iteration), plain SGD with lr 1, and the scaler.
struct Example {
    w: Parameter,
    x: Arc<DeviceBuffer<f32>>,
    opt: Sgd,
    scaler: GradScaler,
    half: DeviceBuffer<f16>,
}

/// PyTorch's example (the issue: "at scale 4, inputs 5, 20000, 5, 40000 give gradients 20,
/// inf, 10, inf and scales 4, 2, 2, 1"), worked out: `loss = w·x` in an f16 model, so the
/// scaled gradient `scale·x` is held in f16. init_scale 4, backoff 0.5, growth 2 after 2000
/// good steps (PyTorch's defaults; any interval ≥ 2 gives the same four steps, while an
/// interval of 1 would grow the scale to 8 after the first one):
///
/// | x | scaled gradient | in f16 | step | scale after update |
/// |---|---|---|---|---|
/// | 5 | 4·5 = 20 | 20 | taken: w −= 20/4 | 4 (tracker 1) |
/// | 20000 | 4·20000 = 80000 | inf (> 65504) | skipped | 4·0.5 = 2 |
/// | 5 | 2·5 = 10 | 10 | taken: w −= 10/2 | 2 (tracker 1) |
/// | 40000 | 2·40000 = 80000 | inf | skipped | 1 |
///
/// Our tensors are f32, so the f16 model's gradient is made as it would hold it: the f32
/// gradient rounded to f16 and back (the cast kernels), where 80000 becomes inf.
fn example_config() -> GradScalerConfig {
    GradScalerConfig {
        init_scale: 4.0,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 2000,
        enabled: true,
    }
}

const XS: [f32; 4] = [5.0, 20000.0, 5.0, 40000.0];

impl Example {
    fn new(s: &Stream) -> Self {
        let w = Parameter::from_host(s, "w", &[1.0], &[1]).unwrap();
        Self {
            x: Arc::new(s.alloc_from_host(&[0.0f32]).unwrap()),
            opt: Sgd::new(s, vec![w.clone()], 1.0, 0.0, 0.0).unwrap(),
            scaler: GradScaler::new(s, example_config()).unwrap(),
            half: s.alloc::<f16>(1).unwrap(),
            w,
        }
    }

    /// Forward and backward: `w.grad` = the f16 value of `scale·x`.
    fn backward(&mut self, q: &dyn Queue) -> Result<()> {
        self.opt.zero_grad(q, true)?;
        let loss = scale_by_device(q, &self.w.tensor(), &self.x)?;
        self.scaler.scale(q, &loss)?.backward(q)?;
        let g = self.w.grad().unwrap().expect("w has a gradient");
        cast::to_f16(q, &g, &self.half)?;
        cast::from_f16(q, &self.half, &g)
    }

    /// The scaler's step (after `unscale` when `unscale_first`) and update.
    fn finish(&mut self, q: &dyn Queue, unscale_first: bool) -> Result<()> {
        if unscale_first {
            self.scaler.unscale(q, &self.opt)?;
        }
        self.scaler.step(q, &mut self.opt)?;
        self.scaler.update(q)
    }

    /// (w, gradient, scale, tracker, found_inf) after an iteration.
    fn record(&self, s: &Stream) -> (f32, f32, f32, u32, bool) {
        (
            s.to_vec(self.w.data().unwrap()).unwrap()[0],
            s.to_vec(&self.w.grad().unwrap().unwrap()).unwrap()[0],
            self.scaler.get_scale(s).unwrap(),
            self.scaler.growth_tracker(s).unwrap(),
            self.scaler.found_inf(s).unwrap(),
        )
    }
}

type Record = (f32, f32, f32, u32, bool);

fn bits(r: &[Record]) -> Vec<(u32, u32, u32, u32, bool)> {
    r.iter()
        .map(|&(w, g, sc, t, f)| (w.to_bits(), g.to_bits(), sc.to_bits(), t, f))
        .collect()
}

fn example_eager(dev: &Device, unscale_first: bool) -> (Vec<f32>, Vec<Record>) {
    let s = dev.new_stream().unwrap();
    let mut ex = Example::new(&s);
    let (mut scaled, mut records) = (Vec::new(), Vec::new());
    for x in XS {
        s.copy_from_host(&[x], &ex.x).unwrap();
        ex.backward(&s).unwrap();
        scaled.push(s.to_vec(&ex.w.grad().unwrap().unwrap()).unwrap()[0]);
        ex.finish(&s, unscale_first).unwrap();
        records.push(ex.record(&s));
    }
    (scaled, records)
}

#[test]
fn pytorchs_scaler_example_gives_its_gradients_and_scales() {
    let dev = gpu_test_device!();
    let (scaled, records) = example_eager(&dev, false);
    let inf = f32::INFINITY;
    assert_eq!(scaled, vec![20.0, inf, 10.0, inf], "scaled gradients");
    let scales: Vec<f32> = records.iter().map(|r| r.2).collect();
    assert_eq!(scales, vec![4.0, 2.0, 2.0, 1.0], "scales after each update");
    let trackers: Vec<u32> = records.iter().map(|r| r.3).collect();
    assert_eq!(trackers, vec![1, 0, 1, 0]);
    let found: Vec<bool> = records.iter().map(|r| r.4).collect();
    assert_eq!(found, vec![false, true, false, true]);
    // w moves by the unscaled gradient 5 at the good steps only: 1 → −4 → −4 → −9 → −9.
    let w: Vec<f32> = records.iter().map(|r| r.0).collect();
    assert_eq!(w, vec![-4.0, -4.0, -9.0, -9.0]);
    // The fused step writes the unscaled gradient back (PyTorch's fused optimizers do); a
    // skipped step leaves it as it was.
    let g: Vec<f32> = records.iter().map(|r| r.1).collect();
    assert_eq!(g, vec![5.0, inf, 5.0, inf]);
}

#[test]
fn unscaling_before_the_step_gives_the_same_bits() {
    let dev = gpu_test_device!();
    let (_, fused) = example_eager(&dev, false);
    let (_, unscaled) = example_eager(&dev, true);
    assert_eq!(bits(&unscaled), bits(&fused));
}

#[test]
fn the_example_captured_in_one_graph_replays_as_eager() {
    let dev = gpu_test_device!();
    let (_, eager) = example_eager(&dev, false);
    for unscale_first in [false, true] {
        let mut s = dev.new_stream().unwrap();
        let mut ex = Example::new(&s);
        let (g, _) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            ex.backward(cs)?;
            ex.finish(cs, unscale_first)?;
            Ok(())
        })
        .unwrap();
        let mut replayed = Vec::new();
        for x in XS {
            s.copy_from_host(&[x], &ex.x).unwrap();
            g.replay(&s).unwrap();
            replayed.push(ex.record(&s));
        }
        assert_eq!(
            bits(&replayed),
            bits(&eager),
            "unscale_first {unscale_first}: {replayed:?} vs {eager:?}"
        );
    }
}

/// PyTorch's `_amp_update_scale_` on the host (the kernel's rule, f64 products rounded once).
fn update_ref(scale: f32, tracker: u32, found: bool, c: &GradScalerConfig) -> (f32, u32) {
    if found {
        ((scale as f64 * c.backoff_factor) as f32, 0)
    } else if tracker + 1 == c.growth_interval {
        let g = (scale as f64 * c.growth_factor) as f32;
        (if g.is_finite() { g } else { scale }, 0)
    } else {
        (scale, tracker + 1)
    }
}

/// Parameters of odd sizes (vector path and scalar tails) with targets.
fn problem(s: &Stream, sizes: &[usize], seed: u64) -> (Vec<Parameter>, Vec<Tensor>) {
    let mut rng = HostRng::new(seed);
    let params = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| Parameter::from_host(s, &format!("p{i}"), &rng.vec_normal(n), &[n]).unwrap())
        .collect();
    let targets = sizes
        .iter()
        .map(|&n| Tensor::from_host(s, &rng.vec_normal(n), &[n]).unwrap())
        .collect();
    (params, targets)
}

const SIZES: [usize; 8] = [1, 3, 4, 127, 1024, 1025, 4099, 70001];

#[derive(Clone, Copy, Debug)]
enum Kind {
    Sgd,
    Adam,
}

fn make_opt(
    s: &Stream,
    kind: Kind,
    params: Vec<Parameter>,
    copies: Option<Dtype>,
) -> Box<dyn Optimizer> {
    let options = OptimOptions { copies };
    match kind {
        Kind::Sgd => Box::new(
            Sgd::with_options(
                s,
                params,
                SgdConfig {
                    lr: 0.01,
                    momentum: 0.9,
                    weight_decay: 0.01,
                },
                options,
            )
            .unwrap(),
        ),
        Kind::Adam => Box::new(
            Adam::with_options(
                s,
                params,
                AdamConfig {
                    lr: 0.01,
                    weight_decay: 0.05,
                    ..AdamConfig::adamw()
                },
                options,
            )
            .unwrap(),
        ),
    }
}

/// Every f32 state buffer of the optimizer, and every u32 one, read back.
fn opt_state(s: &Stream, opt: &dyn Optimizer) -> (Vec<Vec<f32>>, Vec<Vec<u32>>, u32) {
    let (mut f, mut u) = (Vec::new(), Vec::new());
    for (_, b) in opt.state_buffers() {
        match b {
            StateBuffer::F32(b) => f.push(s.to_vec(b).unwrap()),
            StateBuffer::U32(b) => u.push(s.to_vec(b).unwrap()),
        }
    }
    let steps = opt.hyperparameters().unwrap().step_count(s).unwrap();
    (f, u, steps)
}

/// The copies' bits.
fn copy_bits(s: &Stream, opt: &dyn Optimizer) -> Vec<Vec<u16>> {
    opt.copies()
        .unwrap_or_default()
        .iter()
        .map(|(_, c)| match c {
            TypedBuffer::Bf16(b) => s.to_vec(b).unwrap().iter().map(|v| v.to_bits()).collect(),
            TypedBuffer::F16(b) => s.to_vec(b).unwrap().iter().map(|v| v.to_bits()).collect(),
            TypedBuffer::F32(_) => panic!("an f32 copy"),
        })
        .collect()
}

/// The bits the `half` crate's round-to-nearest-even gives for `values` in `dtype`.
fn round_bits(values: &[f32], dtype: Dtype) -> Vec<u16> {
    values
        .iter()
        .map(|&v| match dtype {
            Dtype::Bf16 => bf16::from_f32(v).to_bits(),
            Dtype::F16 => f16::from_f32(v).to_bits(),
            Dtype::F32 => panic!("no f32 copies"),
        })
        .collect()
}

/// The copy bits the masters should have now.
fn host_copy_bits(s: &Stream, params: &[Parameter], dtype: Dtype) -> Vec<Vec<u16>> {
    params
        .iter()
        .map(|p| round_bits(&s.to_vec(p.data().unwrap()).unwrap(), dtype))
        .collect()
}

struct Run {
    params: Vec<Vec<f32>>,
    grads: Vec<Vec<f32>>,
    state: (Vec<Vec<f32>>, Vec<Vec<u32>>, u32),
    copies: Vec<Vec<u16>>,
}

/// `steps` updates on Σ‖p − t‖², through a scaler at `scale` (a power of two) or not.
fn train(dev: &Device, kind: Kind, scale: Option<f32>, copies: Option<Dtype>, steps: usize) -> Run {
    let s = dev.new_stream().unwrap();
    let (params, targets) = problem(&s, &SIZES, 7);
    let mut opt = make_opt(&s, kind, params.clone(), copies);
    let mut scaler = scale.map(|init_scale| {
        GradScaler::new(
            &s,
            GradScalerConfig {
                init_scale,
                ..GradScalerConfig::default()
            },
        )
        .unwrap()
    });
    for _ in 0..steps {
        opt.zero_grad(&s, true).unwrap();
        for (p, t) in params.iter().zip(&targets) {
            let loss = mse_loss(&s, &p.tensor(), t, Reduction::Sum).unwrap();
            match &scaler {
                Some(sc) => sc.scale(&s, &loss).unwrap().backward(&s).unwrap(),
                None => loss.backward(&s).unwrap(),
            }
        }
        match &mut scaler {
            Some(sc) => {
                sc.step(&s, &mut *opt).unwrap();
                sc.update(&s).unwrap();
            }
            None => opt.step(&s).unwrap(),
        }
    }
    if let Some(sc) = &scaler {
        assert!(!sc.found_inf(&s).unwrap());
        assert_eq!(
            sc.get_scale(&s).unwrap(),
            scale.unwrap(),
            "no growth within 2000 steps"
        );
        assert_eq!(sc.growth_tracker(&s).unwrap(), steps as u32);
    }
    Run {
        params: params
            .iter()
            .map(|p| s.to_vec(p.data().unwrap()).unwrap())
            .collect(),
        grads: params
            .iter()
            .map(|p| s.to_vec(&p.grad().unwrap().unwrap()).unwrap())
            .collect(),
        state: opt_state(&s, &*opt),
        copies: copy_bits(&s, &*opt),
    }
}

fn assert_runs_equal(a: &Run, b: &Run, what: &str) {
    for (i, (x, y)) in a.params.iter().zip(&b.params).enumerate() {
        assert_bits_eq(x, y, format_args!("{what}: parameter {i}"));
    }
    for (i, (x, y)) in a.grads.iter().zip(&b.grads).enumerate() {
        assert_bits_eq(x, y, format_args!("{what}: gradient {i}"));
    }
    for (i, (x, y)) in a.state.0.iter().zip(&b.state.0).enumerate() {
        assert_bits_eq(x, y, format_args!("{what}: state buffer {i}"));
    }
    assert_eq!(a.state.1, b.state.1, "{what}: step counts");
    assert_eq!(a.state.2, b.state.2, "{what}: optimizer steps");
    assert_eq!(a.copies, b.copies, "{what}: copies");
}

#[test]
fn scaled_training_equals_unscaled_training_bit_for_bit() {
    let dev = gpu_test_device!();
    for kind in [Kind::Sgd, Kind::Adam] {
        let plain = train(&dev, kind, None, None, 4);
        for scale in [65536.0, 0.25, 1.0] {
            let scaled = train(&dev, kind, Some(scale), None, 4);
            assert_runs_equal(&scaled, &plain, &format!("{kind:?} at scale {scale}"));
        }
    }
}

#[test]
fn copies_are_the_rounded_masters_and_leave_the_update_alone() {
    let dev = gpu_test_device!();
    for kind in [Kind::Sgd, Kind::Adam] {
        let plain = train(&dev, kind, None, None, 3);
        for dtype in [Dtype::Bf16, Dtype::F16] {
            let with = train(&dev, kind, None, Some(dtype), 3);
            // The masters, moments and counters are those of the run without copies.
            let Run {
                params,
                grads,
                state,
                copies,
            } = with;
            assert_runs_equal(
                &Run {
                    params: params.clone(),
                    grads,
                    state,
                    copies: Vec::new(),
                },
                &plain,
                &format!("{kind:?} with {dtype} copies"),
            );
            // Each copy element is the master rounded to nearest even.
            let want: Vec<Vec<u16>> = params.iter().map(|v| round_bits(v, dtype)).collect();
            assert_eq!(copies, want, "{kind:?} {dtype}");
            // And a scaled run writes the same copies.
            let scaled = train(&dev, kind, Some(1024.0), Some(dtype), 3);
            assert_eq!(scaled.copies, copies, "{kind:?} {dtype} under a scaler");
        }
    }
}

#[test]
fn copies_start_from_the_masters_and_refresh_after_a_direct_write() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let (params, _) = problem(&s, &SIZES, 11);
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for kind in [Kind::Sgd, Kind::Adam] {
            let opt = make_opt(&s, kind, params.clone(), Some(dtype));
            let copies = opt.copies().expect("copies");
            assert_eq!(copies.len(), params.len());
            for ((p, c), q) in copies.iter().zip(&params) {
                assert!(p.same_as(q), "in parameter order");
                assert_eq!((c.dtype(), c.len()), (dtype, q.numel()));
            }
            assert_eq!(copy_bits(&s, &*opt), host_copy_bits(&s, &params, dtype));
            // The cast kernels give the same bits (on the device).
            for ((p, c), want) in copies.iter().zip(host_copy_bits(&s, &params, dtype)) {
                let got: Vec<u16> = match c {
                    TypedBuffer::Bf16(_) => {
                        let b = s.alloc::<bf16>(p.numel()).unwrap();
                        cast::to_bf16(&s, p.data().unwrap(), &b).unwrap();
                        s.to_vec(&b).unwrap().iter().map(|v| v.to_bits()).collect()
                    }
                    TypedBuffer::F16(_) => {
                        let b = s.alloc::<f16>(p.numel()).unwrap();
                        cast::to_f16(&s, p.data().unwrap(), &b).unwrap();
                        s.to_vec(&b).unwrap().iter().map(|v| v.to_bits()).collect()
                    }
                    TypedBuffer::F32(_) => unreachable!(),
                };
                assert_eq!(got, want);
            }
            // A master written directly: the copy is stale until refreshed.
            let p = &params[3];
            let before = copy_bits(&s, &*opt)[3].clone();
            let new: Vec<f32> = (0..p.numel()).map(|i| i as f32 * 1.0e-3 + 0.1).collect();
            s.copy_from_host(&new, p.data().unwrap()).unwrap();
            assert_eq!(copy_bits(&s, &*opt)[3], before, "stale until refreshed");
            opt.refresh_copies(&s).unwrap();
            assert_eq!(copy_bits(&s, &*opt), host_copy_bits(&s, &params, dtype));
        }
    }
    // Without copies: none, and refreshing does nothing.
    let opt = make_opt(&s, Kind::Adam, params.clone(), None);
    assert!(opt.copies().is_none());
    opt.refresh_copies(&s).unwrap();
}

#[test]
fn misuse_f32_copies_are_a_typed_error() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let (params, _) = problem(&s, &[4], 12);
    let options = OptimOptions {
        copies: Some(Dtype::F32),
    };
    let e = Adam::with_options(&s, params.clone(), AdamConfig::default(), options).err();
    assert!(
        matches!(e, Some(NnError::Amp(AmpError::CopyDtype { dtype: "f32" }))),
        "{e:?}"
    );
    let e = Sgd::with_options(&s, params, SgdConfig::default(), options).err();
    assert!(
        matches!(e, Some(NnError::Amp(AmpError::CopyDtype { .. }))),
        "{e:?}"
    );
}

#[test]
fn an_overflow_skips_the_whole_step_on_the_device() {
    let dev = gpu_test_device!();
    for (kind, dtype) in [(Kind::Sgd, Dtype::Bf16), (Kind::Adam, Dtype::F16)] {
        let s = dev.new_stream().unwrap();
        let (params, targets) = problem(&s, &SIZES, 13);
        let mut opt = make_opt(&s, kind, params.clone(), Some(dtype));
        let cfg = GradScalerConfig {
            init_scale: 1024.0,
            growth_interval: 3,
            ..GradScalerConfig::default()
        };
        let mut scaler = GradScaler::new(&s, cfg).unwrap();
        let (mut scale, mut tracker) = (cfg.init_scale, 0u32);
        // Good, good, overflow (a NaN in one element of one gradient), good, overflow (an inf).
        for (i, poison) in [None, None, Some(f32::NAN), None, Some(f32::NEG_INFINITY)]
            .into_iter()
            .enumerate()
        {
            opt.zero_grad(&s, true).unwrap();
            for (p, t) in params.iter().zip(&targets) {
                let loss = mse_loss(&s, &p.tensor(), t, Reduction::Sum).unwrap();
                scaler.scale(&s, &loss).unwrap().backward(&s).unwrap();
            }
            if let Some(v) = poison {
                let g = params[5].grad().unwrap().unwrap();
                s.fill32(&g, 777, 1, v).unwrap();
            }
            let before_w: Vec<Vec<f32>> = params
                .iter()
                .map(|p| s.to_vec(p.data().unwrap()).unwrap())
                .collect();
            let before_state = opt_state(&s, &*opt);
            let before_copies = copy_bits(&s, &*opt);
            scaler.step(&s, &mut *opt).unwrap();
            scaler.update(&s).unwrap();
            let found = poison.is_some();
            assert_eq!(scaler.found_inf(&s).unwrap(), found, "iteration {i}");
            (scale, tracker) = update_ref(scale, tracker, found, &cfg);
            assert_eq!(scaler.get_scale(&s).unwrap(), scale, "iteration {i}");
            assert_eq!(scaler.growth_tracker(&s).unwrap(), tracker, "iteration {i}");
            let after_w: Vec<Vec<f32>> = params
                .iter()
                .map(|p| s.to_vec(p.data().unwrap()).unwrap())
                .collect();
            let after_state = opt_state(&s, &*opt);
            if found {
                for (j, (a, b)) in after_w.iter().zip(&before_w).enumerate() {
                    assert_bits_eq(a, b, format_args!("{kind:?} iteration {i}: parameter {j}"));
                }
                for (j, (a, b)) in after_state.0.iter().zip(&before_state.0).enumerate() {
                    assert_bits_eq(a, b, format_args!("{kind:?} iteration {i}: state {j}"));
                }
                assert_eq!(
                    after_state.1, before_state.1,
                    "per-parameter steps unchanged"
                );
                assert_eq!(after_state.2, before_state.2, "optimizer steps unchanged");
                assert_eq!(copy_bits(&s, &*opt), before_copies, "copies unchanged");
            } else {
                assert_ne!(
                    after_w[0], before_w[0],
                    "{kind:?} iteration {i}: a good step moves"
                );
                assert_eq!(after_state.2, before_state.2 + 1);
                assert_eq!(copy_bits(&s, &*opt), host_copy_bits(&s, &params, dtype));
            }
        }
        // Scales: 1024, 1024, 512 (backoff), 512, 256; three good steps never came in a row.
        assert_eq!(scale, 256.0);
        assert_eq!(opt.hyperparameters().unwrap().step_count(&s).unwrap(), 3);
    }
}

#[test]
fn the_scale_grows_every_interval_and_never_to_infinity() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    // The target is the parameter itself: zero gradients, which no scale makes overflow.
    let (params, _) = problem(&s, &[10], 14);
    let targets =
        [Tensor::from_host(&s, &s.to_vec(params[0].data().unwrap()).unwrap(), &[10]).unwrap()];
    for (init_scale, interval, growth) in [
        (8.0f32, 3u32, 2.0f64),
        (2f32.powi(127), 1, 2.0),
        (3.0, 2, 1.5),
    ] {
        let cfg = GradScalerConfig {
            init_scale,
            growth_factor: growth,
            growth_interval: interval,
            ..GradScalerConfig::default()
        };
        let mut opt = Sgd::new(&s, params.clone(), 1e-3, 0.0, 0.0).unwrap();
        let mut scaler = GradScaler::new(&s, cfg).unwrap();
        let (mut scale, mut tracker) = (init_scale, 0);
        for i in 0..7 {
            opt.zero_grad(&s, true).unwrap();
            let loss = mse_loss(&s, &params[0].tensor(), &targets[0], Reduction::Sum).unwrap();
            scaler.scale(&s, &loss).unwrap().backward(&s).unwrap();
            scaler.step(&s, &mut opt).unwrap();
            scaler.update(&s).unwrap();
            assert!(!scaler.found_inf(&s).unwrap());
            (scale, tracker) = update_ref(scale, tracker, false, &cfg);
            assert_eq!(scaler.get_scale(&s).unwrap(), scale, "{cfg:?} step {i}");
            assert_eq!(
                scaler.growth_tracker(&s).unwrap(),
                tracker,
                "{cfg:?} step {i}"
            );
        }
        assert!(scale.is_finite());
        if init_scale == 8.0 {
            assert_eq!(scale, 32.0, "two growths in seven steps");
        }
    }
}

#[test]
fn each_optimizer_is_skipped_on_its_own_gradients_and_update_backs_off_once() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let (params, targets) = problem(&s, &[100, 200], 15);
    let mut a = Adam::with_config(&s, vec![params[0].clone()], AdamConfig::default()).unwrap();
    let mut b = Sgd::new(&s, vec![params[1].clone()], 0.1, 0.0, 0.0).unwrap();
    let mut scaler = GradScaler::new(&s, GradScalerConfig::default()).unwrap();
    for p in [&mut a as &mut dyn Optimizer, &mut b] {
        p.zero_grad(&s, true).unwrap();
    }
    for (p, t) in params.iter().zip(&targets) {
        let loss = mse_loss(&s, &p.tensor(), t, Reduction::Sum).unwrap();
        scaler.scale(&s, &loss).unwrap().backward(&s).unwrap();
    }
    s.fill32(&params[1].grad().unwrap().unwrap(), 0, 1, f32::INFINITY)
        .unwrap();
    let w0: Vec<Vec<f32>> = params
        .iter()
        .map(|p| s.to_vec(p.data().unwrap()).unwrap())
        .collect();
    scaler.step(&s, &mut a).unwrap();
    scaler.step(&s, &mut b).unwrap();
    scaler.update(&s).unwrap();
    let w1: Vec<Vec<f32>> = params
        .iter()
        .map(|p| s.to_vec(p.data().unwrap()).unwrap())
        .collect();
    assert_ne!(w1[0], w0[0], "a's gradients were finite: it stepped");
    assert_bits_eq(&w1[1], &w0[1], "b found an inf: skipped");
    assert_eq!(a.step_counts(&s).unwrap(), vec![1]);
    assert!(scaler.found_inf(&s).unwrap());
    assert_eq!(
        scaler.get_scale(&s).unwrap(),
        32768.0,
        "one backoff for the iteration"
    );
}

#[test]
fn a_disabled_scaler_passes_everything_through() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let (params, targets) = problem(&s, &[33], 16);
    let mut opt = Sgd::new(&s, params.clone(), 0.1, 0.0, 0.0).unwrap();
    let mut scaler = GradScaler::new(
        &s,
        GradScalerConfig {
            enabled: false,
            ..GradScalerConfig::default()
        },
    )
    .unwrap();
    let loss = mse_loss(&s, &params[0].tensor(), &targets[0], Reduction::Sum).unwrap();
    let scaled = scaler.scale(&s, &loss).unwrap();
    assert!(
        Arc::ptr_eq(scaled.data_arc().unwrap(), loss.data_arc().unwrap()),
        "the loss itself"
    );
    scaled.backward(&s).unwrap();
    let g = s.to_vec(&params[0].grad().unwrap().unwrap()).unwrap();
    scaler.unscale(&s, &opt).unwrap();
    scaler.unscale(&s, &opt).unwrap(); // no bookkeeping while disabled
    let w0 = s.to_vec(params[0].data().unwrap()).unwrap();
    scaler.step(&s, &mut opt).unwrap();
    scaler.update(&s).unwrap();
    scaler.update(&s).unwrap();
    let w1 = s.to_vec(params[0].data().unwrap()).unwrap();
    let want: Vec<f64> = w0
        .iter()
        .zip(&g)
        .map(|(&w, &g)| w as f64 - 0.1 * g as f64)
        .collect();
    assert!(rel_err(&w1, &want) < 1e-6, "a plain SGD step");
    assert_eq!(scaler.get_scale(&s).unwrap(), 1.0);
}

/// An optimizer of the user's that knows nothing of device flags.
struct Custom(Vec<Parameter>);

impl Optimizer for Custom {
    fn step(&mut self, _q: &dyn Queue) -> Result<()> {
        Ok(())
    }
    fn params(&self) -> &[Parameter] {
        &self.0
    }
}

#[test]
fn misuse_of_the_scaler_is_a_typed_error() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let (params, targets) = problem(&s, &[8], 17);
    let mut opt = Sgd::new(&s, params.clone(), 0.1, 0.0, 0.0).unwrap();
    let mut scaler = GradScaler::new(&s, GradScalerConfig::default()).unwrap();
    let out_of_order = |r: Result<()>, call: &str| match r {
        Err(NnError::OutOfOrder { call: c, .. }) => assert_eq!(c, call),
        other => panic!("{call}: {other:?}"),
    };
    out_of_order(scaler.update(&s), "GradScaler::update");
    let loss = mse_loss(&s, &params[0].tensor(), &targets[0], Reduction::Sum).unwrap();
    scaler.scale(&s, &loss).unwrap().backward(&s).unwrap();
    scaler.unscale(&s, &opt).unwrap();
    out_of_order(scaler.unscale(&s, &opt), "GradScaler::unscale");
    scaler.step(&s, &mut opt).unwrap();
    out_of_order(scaler.step(&s, &mut opt), "GradScaler::step");
    scaler.update(&s).unwrap();
    // An optimizer that cannot skip on the device.
    let mut custom = Custom(params.clone());
    let e = scaler.step(&s, &mut custom).unwrap_err();
    assert!(matches!(e, NnError::Amp(AmpError::NotScalable)), "{e:?}");
    // The failed step left no bookkeeping behind: update still has nothing to act on.
    out_of_order(scaler.update(&s), "GradScaler::update");
    // Settings.
    assert!(matches!(
        scaler.set_scale(&s, 0.0),
        Err(NnError::Amp(AmpError::ScalerConfig {
            name: "init_scale",
            ..
        }))
    ));
    assert!(scaler.set_scale(&s, f32::NAN).is_err());
    scaler.set_scale(&s, 8.0).unwrap();
    assert_eq!(scaler.get_scale(&s).unwrap(), 8.0);
    assert!(GradScaler::new(
        &s,
        GradScalerConfig {
            growth_interval: 0,
            ..GradScalerConfig::default()
        }
    )
    .is_err());
    // A device scalar must have an element.
    let empty = Arc::new(s.alloc::<f32>(0).unwrap());
    assert!(scale_by_device(&s, &loss, &empty).is_err());
}

#[test]
fn scale_by_device_matches_the_f64_reference_forward_and_backward() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(18);
    let n = 4097;
    let xv = rng.vec_normal(n);
    let tv = rng.vec_normal(n);
    let p = Parameter::from_host(&s, "x", &xv, &[n]).unwrap();
    let t = Tensor::from_host(&s, &tv, &[n]).unwrap();
    let k = 0.3f32;
    let kb = Arc::new(s.alloc_from_host(&[k]).unwrap());
    let y = scale_by_device(&s, &p.tensor(), &kb).unwrap();
    let want_y: Vec<f64> = xv.iter().map(|&x| x as f64 * k as f64).collect();
    assert!(rel_err(&y.to_vec(&s).unwrap(), &want_y) < 1e-6);
    mse_loss(&s, &y, &t, Reduction::Sum)
        .unwrap()
        .backward(&s)
        .unwrap();
    let want_g: Vec<f64> = want_y
        .iter()
        .zip(to_f64(&tv))
        .map(|(y, t)| 2.0 * (y - t) * k as f64)
        .collect();
    let got = s.to_vec(&p.grad().unwrap().unwrap()).unwrap();
    assert!(rel_err(&got, &want_g) < 1e-6, "{}", rel_err(&got, &want_g));
    // From an implicit gradient of one, every element's gradient is the scalar itself.
    p.zero_grad(&s, true).unwrap();
    let one = Parameter::from_host(&s, "one", &[2.0], &[1]).unwrap();
    scale_by_device(&s, &one.tensor(), &kb)
        .unwrap()
        .backward(&s)
        .unwrap();
    assert_eq!(s.to_vec(&one.grad().unwrap().unwrap()).unwrap(), vec![k]);
}

/// A whole mixed-precision step — scaled loss, backward, unscale, clipping, the fused Adam
/// with bf16 copies, the scaler's update — eagerly or replayed; a device multiplier `k`
/// written before each iteration makes some of them overflow.
/// After one iteration: the parameters' bits, the copies' bits, the scale's bits, the
/// tracker, the norm's bits.
type Snapshot = (Vec<u32>, Vec<u16>, u32, u32, u32);

fn full_steps(dev: &Device, graphed: bool) -> Vec<Snapshot> {
    let mut s = dev.new_stream().unwrap();
    let (params, targets) = problem(&s, &SIZES, 19);
    let k = Arc::new(s.alloc_from_host(&[1.0f32]).unwrap());
    let mut opt = Adam::with_options(
        &s,
        params.clone(),
        AdamConfig::adamw(),
        OptimOptions {
            copies: Some(Dtype::Bf16),
        },
    )
    .unwrap();
    let mut scaler = GradScaler::new(
        &s,
        GradScalerConfig {
            growth_interval: 2,
            ..GradScalerConfig::default()
        },
    )
    .unwrap();
    let mut norm_out: Option<Tensor>;
    let step = |q: &dyn Queue, opt: &mut Adam, scaler: &mut GradScaler| -> Result<Tensor> {
        opt.zero_grad(q, true)?;
        for (p, t) in params.iter().zip(&targets) {
            let y = scale_by_device(q, &p.tensor(), &k)?;
            let loss = mse_loss(q, &y, t, Reduction::Mean)?;
            scaler.scale(q, &loss)?.backward(q)?;
        }
        scaler.unscale(q, &*opt)?;
        let norm = clip_grad_norm(q, opt.params(), 1.0)?;
        scaler.step(q, opt)?;
        scaler.update(q)?;
        Ok(norm)
    };
    let (graph, captured_norm) = if graphed {
        let (g, n) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            Ok(step(cs, &mut opt, &mut scaler)?)
        })
        .unwrap();
        (Some(g), Some(n))
    } else {
        (None, None)
    };
    let mut out = Vec::new();
    for (i, kv) in [1.0f32, 1.0, 1e30, 1.0, 1.0, 1.0, 1e30, 2.0]
        .into_iter()
        .enumerate()
    {
        s.copy_from_host(&[kv], &k).unwrap();
        match &graph {
            Some(g) => {
                g.replay(&s).unwrap();
                norm_out = captured_norm.clone();
            }
            None => norm_out = Some(step(&s, &mut opt, &mut scaler).unwrap()),
        }
        let w: Vec<u32> = params
            .iter()
            .flat_map(|p| s.to_vec(p.data().unwrap()).unwrap())
            .map(f32::to_bits)
            .collect();
        let c: Vec<u16> = copy_bits(&s, &opt).concat();
        let norm = norm_out.as_ref().unwrap().to_vec(&s).unwrap()[0];
        let found = scaler.found_inf(&s).unwrap();
        assert_eq!(found, kv == 1e30, "iteration {i}");
        out.push((
            w,
            c,
            scaler.get_scale(&s).unwrap().to_bits(),
            scaler.growth_tracker(&s).unwrap(),
            norm.to_bits(),
        ));
    }
    out
}

#[test]
fn a_full_mixed_precision_step_replays_equal_to_eager() {
    let dev = gpu_test_device!();
    let eager = full_steps(&dev, false);
    let graphed = full_steps(&dev, true);
    assert_eq!(eager.len(), graphed.len());
    for (i, (e, g)) in eager.iter().zip(&graphed).enumerate() {
        assert_eq!(e.0, g.0, "parameters after iteration {i}");
        assert_eq!(e.1, g.1, "copies after iteration {i}");
        assert_eq!(
            (e.2, e.3, e.4),
            (g.2, g.3, g.4),
            "scale, tracker, norm after iteration {i}"
        );
    }
    // Scale: 65536 → 65536 (tracker 1) → ×2 → backoff → …, as the rule says.
    let scales: Vec<f32> = eager.iter().map(|r| f32::from_bits(r.2)).collect();
    assert_eq!(
        scales,
        vec![65536.0, 131072.0, 65536.0, 65536.0, 131072.0, 131072.0, 65536.0, 65536.0]
    );
}

/// A scale that backed off to 0 (every step overflowed) is a state like any other: it is saved
/// and restored as PyTorch's scaler restores it; a NaN or infinite scale is refused.
#[test]
fn a_scale_that_backed_off_to_zero_restores_and_a_nan_scale_does_not() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut scaler = GradScaler::new(&s, example_config()).unwrap();
    let mut state = scaler.state_dict(&s).unwrap();
    state.scale = 0.0;
    scaler.load_state_dict(&s, &state).unwrap();
    assert_eq!(scaler.state_dict(&s).unwrap().scale, 0.0);
    for bad in [f32::NAN, f32::INFINITY, -1.0] {
        state.scale = bad;
        assert!(scaler.load_state_dict(&s, &state).is_err(), "scale {bad}");
    }
    assert_eq!(
        scaler.state_dict(&s).unwrap().scale,
        0.0,
        "a refused state changes nothing"
    );
}
