//! GPU tests of training checkpoints (`save_checkpoint` / `load_checkpoint`): a run stopped
//! after step `k`, saved, loaded into a freshly made model, optimizer and scaler (with other
//! initial weights) and continued ends with the same bits as a run that never stopped —
//! parameters, Adam's moments and step counts, the bf16 copies, the scaler's scale and
//! tracker. Misuse (another optimizer, other shapes, a missing scaler or schedule) is a typed
//! error that leaves everything as it was.
//!
//! The run is the scaler's f16 recipe on f32 tensors: Linear → ReLU → Linear with AdamW,
//! bf16 copies, a warm-up schedule on the device, and a GradScaler (2^16, growth every 3 good
//! steps); one step is made to overflow (its loss multiplied by 1e38 on the device), so the
//! state saved includes a backoff. Everything is exact: no tolerance.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudagraph::{gpu_test_device, Device, DeviceBuffer, Queue, Stream};
use cudagraph_nn::dtype::{Dtype, TypedBuffer};
use cudagraph_nn::*;

const IN: usize = 32;
const HIDDEN: usize = 64;
const OUT: usize = 10;
/// The loss multiplier of each step: step 2 overflows.
const KS: [f32; 9] = [1.0, 1.0, 1e38, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0];

struct Run {
    l1: Linear,
    l2: Linear,
    opt: Adam,
    scaler: GradScaler,
    k: Arc<DeviceBuffer<f32>>,
    batches: Vec<(Tensor, Tensor)>,
}

fn schedule() -> Schedule {
    Schedule::linear_warmup(4, 0.25).unwrap()
}

impl Run {
    /// A model initialised from `seed`, batches of `rows` rows (the same data for every
    /// seed). Each test uses its own row count: the engine registry then measures each of its
    /// products once, in its own test, and every later call runs the engine chosen then, even
    /// while other tests run beside it.
    fn new(s: &Stream, seed: u64, rows: usize) -> Self {
        let mut rng = HostRng::new(seed);
        let l1 = Linear::new(s, IN, HIDDEN, &mut rng).unwrap();
        let l2 = Linear::new(s, HIDDEN, OUT, &mut rng).unwrap();
        let mut opt = Adam::with_options(
            s,
            Self::params_of(&l1, &l2),
            AdamConfig {
                lr: 0.01,
                ..AdamConfig::adamw()
            },
            OptimOptions {
                copies: Some(Dtype::Bf16),
            },
        )
        .unwrap();
        opt.set_schedule(Some(schedule())).unwrap();
        let scaler = GradScaler::new(
            s,
            GradScalerConfig {
                growth_interval: 3,
                ..GradScalerConfig::default()
            },
        )
        .unwrap();
        let mut data = HostRng::new(1000);
        let batches = (0..3)
            .map(|_| {
                (
                    Tensor::from_host(s, &data.vec_normal(rows * IN), &[rows, IN]).unwrap(),
                    Tensor::from_host(s, &data.vec_normal(rows * OUT), &[rows, OUT]).unwrap(),
                )
            })
            .collect();
        Self {
            l1,
            l2,
            opt,
            scaler,
            k: Arc::new(s.alloc_from_host(&[1.0f32]).unwrap()),
            batches,
        }
    }

    fn params_of(l1: &Linear, l2: &Linear) -> Vec<Parameter> {
        let mut p = l1.parameters();
        p.extend(l2.parameters());
        p
    }

    fn params(&self) -> Vec<Parameter> {
        Self::params_of(&self.l1, &self.l2)
    }

    /// Training step `i` (batch `i mod 3`, loss multiplier `KS[i]`).
    fn step(&mut self, s: &Stream, i: usize) {
        s.copy_from_host(&[KS[i]], &self.k).unwrap();
        let (x, t) = &self.batches[i % self.batches.len()];
        let q: &dyn Queue = s;
        self.opt.zero_grad(q, true).unwrap();
        let h = self.l1.forward_act(q, x, true).unwrap();
        let y = self.l2.forward(q, &h).unwrap();
        let loss = mse_loss(q, &y, t, Reduction::Mean).unwrap();
        let loss = scale_by_device(q, &loss, &self.k).unwrap();
        self.scaler.scale(q, &loss).unwrap().backward(q).unwrap();
        self.scaler.step(q, &mut self.opt).unwrap();
        self.scaler.update(q).unwrap();
        assert_eq!(self.scaler.found_inf(s).unwrap(), KS[i] > 1.0, "step {i}");
    }

    /// Everything that must continue bit for bit.
    fn snapshot(&self, s: &Stream) -> Snapshot {
        let f32_bits = |b: &DeviceBuffer<f32>| -> Vec<u32> {
            s.to_vec(b).unwrap().iter().map(|v| v.to_bits()).collect()
        };
        let mut state = Vec::new();
        for (name, b) in self.opt.state_buffers() {
            state.push((
                name,
                match b {
                    StateBuffer::F32(b) => f32_bits(b),
                    StateBuffer::U32(b) => s.to_vec(b).unwrap(),
                },
            ));
        }
        let h = self.opt.hyperparameters().unwrap();
        Snapshot {
            params: self
                .params()
                .iter()
                .map(|p| f32_bits(p.data().unwrap()))
                .collect(),
            state,
            copies: self
                .opt
                .copies()
                .unwrap()
                .iter()
                .map(|(_, c)| match c {
                    TypedBuffer::Bf16(b) => {
                        s.to_vec(b).unwrap().iter().map(|v| v.to_bits()).collect()
                    }
                    other => panic!("bf16 copies, not {:?}", other.dtype()),
                })
                .collect(),
            hyper: h.read(s).unwrap().iter().map(|v| v.to_bits()).collect(),
            steps: h.step_count(s).unwrap(),
            scale: self.scaler.get_scale(s).unwrap().to_bits(),
            tracker: self.scaler.growth_tracker(s).unwrap(),
        }
    }
}

#[derive(Debug, PartialEq)]
struct Snapshot {
    params: Vec<Vec<u32>>,
    state: Vec<(String, Vec<u32>)>,
    copies: Vec<Vec<u16>>,
    hyper: Vec<u32>,
    steps: u32,
    scale: u32,
    tracker: u32,
}

/// A file name of this test's own under the temporary directory.
fn temp_file(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "cudagraph-checkpoint-{tag}-{}.safetensors",
        std::process::id()
    ))
}

fn save(s: &Stream, run: &Run, path: &Path) {
    let params = run.params();
    let ck = Checkpoint {
        model: &params,
        optimizer: &run.opt,
        scaler: Some(&run.scaler),
    };
    save_checkpoint(s, path, &ck).unwrap();
}

fn load(s: &Stream, run: &mut Run, path: &Path) -> Result<()> {
    let params = run.params();
    load_checkpoint(
        s,
        path,
        CheckpointMut {
            model: &params,
            optimizer: &mut run.opt,
            scaler: Some(&mut run.scaler),
        },
    )
}

fn uninterrupted(dev: &Device) -> Snapshot {
    let s = dev.new_stream().unwrap();
    let mut run = Run::new(&s, 1, 16);
    for i in 0..KS.len() {
        run.step(&s, i);
    }
    run.snapshot(&s)
}

#[test]
fn a_resumed_run_continues_bit_for_bit() {
    let dev = gpu_test_device!();
    let want = uninterrupted(&dev);
    for stop in [1usize, 3, 5] {
        let s = dev.new_stream().unwrap();
        let path = temp_file(&format!("resume{stop}"));
        {
            let mut first = Run::new(&s, 1, 16);
            for i in 0..stop {
                first.step(&s, i);
            }
            save(&s, &first, &path);
        }
        // Another initialisation, so that everything the run needs must come from the file.
        let mut second = Run::new(&s, 2, 16);
        assert_ne!(second.snapshot(&s).params, want.params);
        load(&s, &mut second, &path).unwrap();
        for i in stop..KS.len() {
            second.step(&s, i);
        }
        let got = second.snapshot(&s);
        std::fs::remove_file(&path).ok();
        assert_eq!(got.params, want.params, "stopped after {stop}: parameters");
        assert_eq!(
            got.state, want.state,
            "stopped after {stop}: moments and step counts"
        );
        assert_eq!(got.copies, want.copies, "stopped after {stop}: bf16 copies");
        assert_eq!(
            (got.hyper.clone(), got.steps, got.scale, got.tracker),
            (want.hyper.clone(), want.steps, want.scale, want.tracker),
            "stopped after {stop}: hyperparameters, steps, scale, tracker"
        );
    }
    // Eight steps taken (one skipped); the scale backed off once (step 2) and grew after
    // steps 5 and 8 (three good steps in a row each time).
    assert_eq!(want.steps, 8);
    assert_eq!((f32::from_bits(want.scale), want.tracker), (131072.0, 0));
}

#[test]
fn loading_restores_the_saved_state_exactly_and_recomputes_the_copies() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let path = temp_file("restore");
    let mut first = Run::new(&s, 3, 12);
    for i in 0..4 {
        first.step(&s, i);
    }
    save(&s, &first, &path);
    let saved = first.snapshot(&s);
    let mut second = Run::new(&s, 4, 12);
    load(&s, &mut second, &path).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(second.snapshot(&s), saved);
    assert_eq!(second.scaler.config(), first.scaler.config());
    assert_eq!(
        second.opt.step_counts(&s).unwrap(),
        first.opt.step_counts(&s).unwrap()
    );
}

#[test]
fn sgd_with_momentum_and_no_scaler_resumes_too() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let path = temp_file("sgd");
    let mut rng = HostRng::new(5);
    let make = |s: &Stream, rng: &mut HostRng| {
        let l = Linear::new(s, 8, 4, rng).unwrap();
        let opt = Sgd::with_options(
            s,
            l.parameters(),
            SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                weight_decay: 1e-3,
            },
            OptimOptions {
                copies: Some(Dtype::F16),
            },
        )
        .unwrap();
        (l, opt)
    };
    let x = Tensor::from_host(&s, &rng.vec_normal(5 * 8), &[5, 8]).unwrap();
    let t = Tensor::from_host(&s, &rng.vec_normal(5 * 4), &[5, 4]).unwrap();
    let step = |s: &Stream, l: &Linear, opt: &mut Sgd| {
        opt.zero_grad(s, true).unwrap();
        let loss = mse_loss(s, &l.forward(s, &x).unwrap(), &t, Reduction::Sum).unwrap();
        loss.backward(s).unwrap();
        opt.step(s).unwrap();
    };
    let bits = |s: &Stream, l: &Linear| -> Vec<u32> {
        l.parameters()
            .iter()
            .flat_map(|p| s.to_vec(p.data().unwrap()).unwrap())
            .map(f32::to_bits)
            .collect()
    };
    let (a, mut oa) = make(&s, &mut HostRng::new(6));
    for _ in 0..6 {
        step(&s, &a, &mut oa);
    }
    let (b, mut ob) = make(&s, &mut HostRng::new(6));
    for _ in 0..2 {
        step(&s, &b, &mut ob);
    }
    save_checkpoint(
        &s,
        &path,
        &Checkpoint {
            model: &b.parameters(),
            optimizer: &ob,
            scaler: None,
        },
    )
    .unwrap();
    let (c, mut oc) = make(&s, &mut HostRng::new(7));
    load_checkpoint(
        &s,
        &path,
        CheckpointMut {
            model: &c.parameters(),
            optimizer: &mut oc,
            scaler: None,
        },
    )
    .unwrap();
    std::fs::remove_file(&path).ok();
    let names: Vec<String> = oc.state_buffers().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["momentum_buffer.0", "momentum_buffer.1"]);
    for _ in 2..6 {
        step(&s, &c, &mut oc);
    }
    assert_eq!(bits(&s, &c), bits(&s, &a));
    assert_eq!(
        oc.hyperparameters().unwrap().step_count(&s).unwrap(),
        oa.hyperparameters().unwrap().step_count(&s).unwrap()
    );
}

fn checkpoint_error(r: Result<()>) -> CheckpointError {
    match r {
        Err(NnError::Io(IoError::Checkpoint(e))) => e,
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

#[test]
fn misuse_a_checkpoint_that_does_not_fit_is_a_typed_error_and_changes_nothing() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let path = temp_file("misuse");
    let mut run = Run::new(&s, 8, 8);
    run.step(&s, 0);
    save(&s, &run, &path);

    // Another optimizer kind.
    let mut other = Run::new(&s, 9, 8);
    let before = other.snapshot(&s);
    let params = other.params();
    let mut sgd = Sgd::new(&s, params.clone(), 0.1, 0.9, 0.0).unwrap();
    let e = checkpoint_error(load_checkpoint(
        &s,
        &path,
        CheckpointMut {
            model: &params,
            optimizer: &mut sgd,
            scaler: Some(&mut other.scaler),
        },
    ));
    assert!(
        matches!(
            e,
            CheckpointError::Kind {
                what: "optimizer",
                ..
            }
        ),
        "{e}"
    );

    // No scaler where one was saved.
    let e = checkpoint_error(load_checkpoint(
        &s,
        &path,
        CheckpointMut {
            model: &params,
            optimizer: &mut other.opt,
            scaler: None,
        },
    ));
    assert!(
        matches!(e, CheckpointError::Kind { what: "scaler", .. }),
        "{e}"
    );

    // No schedule attached where one was saved.
    other.opt.set_schedule(None).unwrap();
    let e = checkpoint_error(load(&s, &mut other, &path));
    assert!(
        matches!(
            e,
            CheckpointError::Kind {
                what: "schedule",
                ..
            }
        ),
        "{e}"
    );
    // Another schedule.
    other
        .opt
        .set_schedule(Some(Schedule::linear_warmup(5, 0.25).unwrap()))
        .unwrap();
    let e = checkpoint_error(load(&s, &mut other, &path));
    assert!(
        matches!(
            e,
            CheckpointError::Kind {
                what: "schedule",
                ..
            }
        ),
        "{e}"
    );
    other.opt.set_schedule(Some(schedule())).unwrap();

    // A model with one parameter less: the optimizer's list still has it, the model's not.
    let fewer = &params[..3];
    let e = checkpoint_error(load_checkpoint(
        &s,
        &path,
        CheckpointMut {
            model: fewer,
            optimizer: &mut other.opt,
            scaler: Some(&mut other.scaler),
        },
    ));
    match e {
        CheckpointError::Extra { names } => assert_eq!(names, ["model.3.bias"]),
        other => panic!("{other}"),
    }

    // A model of other shapes.
    let mut rng = HostRng::new(10);
    let wide = Linear::new(&s, IN, HIDDEN + 1, &mut rng).unwrap();
    let mut shapes = wide.parameters();
    shapes.extend(other.l2.parameters());
    let e = checkpoint_error(load_checkpoint(
        &s,
        &path,
        CheckpointMut {
            model: &shapes,
            optimizer: &mut other.opt,
            scaler: Some(&mut other.scaler),
        },
    ));
    match e {
        CheckpointError::Mismatch {
            name,
            expected,
            found,
        } => {
            assert_eq!(name, "model.0.weight");
            assert_eq!(
                (expected.as_str(), found.as_str()),
                ("F32 [65, 32]", "F32 [64, 32]")
            );
        }
        other => panic!("{other}"),
    }

    // Nothing was written by any of the failed loads.
    assert_eq!(other.snapshot(&s), before);

    // A file that is not a checkpoint, and a missing file.
    let plain = temp_file("plain");
    std::fs::write(&plain, b"not a safetensors file").unwrap();
    assert!(matches!(
        load(&s, &mut other, &plain),
        Err(NnError::Io(IoError::Format { .. }))
    ));
    std::fs::remove_file(&plain).ok();
    assert!(matches!(
        load(&s, &mut other, &temp_file("absent")),
        Err(NnError::Io(IoError::File { .. }))
    ));
    std::fs::remove_file(&path).ok();

    // An optimizer that keeps no device state cannot be saved.
    struct Custom(Vec<Parameter>);
    impl Optimizer for Custom {
        fn step(&mut self, _q: &dyn Queue) -> Result<()> {
            Ok(())
        }
        fn params(&self) -> &[Parameter] {
            &self.0
        }
    }
    let custom = Custom(params.clone());
    let e = save_checkpoint(
        &s,
        &path,
        &Checkpoint {
            model: &params,
            optimizer: &custom,
            scaler: None,
        },
    );
    assert!(matches!(e, Err(NnError::Unsupported(_))), "{e:?}");
    assert!(!path.exists());
}
