//! GPU tests of the NN layer's soundness and reliability (issues 13 and 8): indices checked on
//! the device (cross-entropy targets, eagerly and inside graphs), the bad-input matrix (each row
//! a typed error naming the problem, the stream and pools usable afterwards, nothing leaked),
//! documented NaN/Inf behaviour, teardown that gives every byte back to the driver, and models
//! used from several threads at once.
//!
//! Tests whose point is a deliberate driver error are named `misuse_*` (skipped by
//! `bench/sanitize.sh`, since compute-sanitizer rightly reports the errors they provoke).

use std::sync::{Arc, Mutex};

use cudagraph::{
    gpu_test_device, BucketPolicy, CacheOptions, CaptureOptions, Device, Error, Graph, GraphCache,
    QueueExt, Stream,
};
use cudagraph_nn::cpu::{self, rel_err, to_f64};
use cudagraph_nn::*;

fn mlp(s: &Stream, rng: &mut Rng, dims: &[usize]) -> Sequential {
    let mut layers = Vec::new();
    for w in dims.windows(2) {
        layers.push(Layer::Linear(Linear::new(s, w[0], w[1], rng).unwrap()));
        layers.push(Layer::ReLU);
    }
    layers.pop();
    Sequential::new(layers)
}

fn device_check(e: &NnError) -> Option<(&'static str, i64, i64, u64)> {
    match e {
        NnError::Core(Error::DeviceCheck {
            check,
            value,
            bound,
            position,
        }) => Some((check, *value, *bound, *position)),
        _ => None,
    }
}

// ---- Indices (issue 13, item 5) -------------------------------------------------------------

#[test]
fn a_cross_entropy_target_out_of_range_is_reported_eagerly_without_an_out_of_bounds_read() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = Rng::new(5);
    let (m, c) = (16, 10);
    let z = Tensor::from_host(&s, &rng.vec_normal(m * c), &[m, c]).unwrap();
    let mut tgt: Vec<i32> = (0..m as i32).map(|i| i % c as i32).collect();
    tgt[11] = 12; // outside [0, 10)
    let tg = Arc::new(s.alloc_from_host(&tgt).unwrap());
    let loss = cross_entropy(&s, &z, &tg).unwrap();
    let e = loss.to_vec(&s).unwrap_err();
    let (check, value, bound, position) = device_check(&e).expect("a device-side check");
    assert_eq!(
        (check, value, bound, position),
        ("cross_entropy target", 12, 10, 11)
    );
    assert!(e.to_string().contains("value 12 at position 11"), "{e}");
    // Reported once; the loss is finite (the target was clamped) and the stream works.
    let v = loss.to_vec(&s).unwrap();
    assert!(v[0].is_finite());
    tgt[11] = -3;
    s.copy_from_host(&tgt, &tg).unwrap();
    let loss = cross_entropy(&s, &z, &tg).unwrap();
    loss.backward(&s).unwrap();
    let e = s.synchronize().map_err(NnError::from).unwrap_err();
    assert_eq!(device_check(&e).map(|d| d.1), Some(-3));
    s.synchronize().unwrap();
}

#[test]
fn a_cross_entropy_target_out_of_range_inside_a_graph_is_reported_by_the_checked_replay() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = Rng::new(6);
    let (m, c) = (8, 5);
    let model = Linear::new(&s, 4, c, &mut rng).unwrap();
    let mut opt = Sgd::new(&s, model.parameters(), 0.1, 0.0, 0.0).unwrap();
    let x = Tensor::from_host(&s, &rng.vec_normal(m * 4), &[m, 4]).unwrap();
    let good: Vec<i32> = (0..m as i32).map(|i| i % c as i32).collect();
    let tg = Arc::new(s.alloc_from_host(&good).unwrap());
    let (step, loss) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        opt.zero_grad(cs, true)?;
        let loss = cross_entropy(cs, &model.forward(cs, &x)?, &tg)?;
        loss.backward(cs)?;
        opt.step(cs)?;
        Ok(loss)
    })
    .unwrap();
    step.replay_checked(&s).unwrap();
    let mut bad = good.clone();
    bad[3] = 99;
    s.copy_from_host(&bad, &tg).unwrap();
    let e = NnError::from(step.replay_checked(&s).unwrap_err());
    assert_eq!(device_check(&e).map(|d| (d.1, d.2, d.3)), Some((99, 5, 3)));
    s.copy_from_host(&good, &tg).unwrap();
    step.replay_checked(&s).unwrap();
    assert!(loss.to_vec(&s).unwrap()[0].is_finite());
}

#[test]
fn host_targets_are_checked_before_upload() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    assert_eq!(Targets::from_host(&s, &[0, 3, 9], 10).unwrap().len(), 3);
    let e = Targets::from_host(&s, &[0, 10, 2], 10).unwrap_err();
    assert!(
        e.to_string()
            .contains("target 10 at position 1 is outside [0, 10)"),
        "{e}"
    );
    assert!(Targets::from_host(&s, &[-1], 10).is_err());
}

// ---- The bad-input matrix (issue 8, item 3) -----------------------------------------------

/// Creates the stream's cuBLAS workspace (kept per stream by design) so that measurements of
/// allocated memory before and after a row compare like with like.
fn warm(s: &Stream) {
    let mut rng = Rng::new(99);
    let l = Linear::new(s, 4, 4, &mut rng).unwrap();
    l.forward(s, &Tensor::zeros(s, &[1, 4]).unwrap()).unwrap();
    s.synchronize().unwrap();
}

/// Runs `bad` (which must fail with a message containing `needle`), then checks the stream
/// still computes and that a failing call leaves nothing allocated. The first call warms up
/// what a first use legitimately creates (the engine registry measuring a new shape, a
/// library's per-stream workspace); the second, identical call must leave memory unchanged.
fn row(dev: &Device, s: &Stream, needle: &str, mut bad: impl FnMut() -> Result<()>) {
    let _ = bad();
    s.synchronize().unwrap();
    let before = dev.memory_allocated();
    let e = bad().expect_err(needle);
    assert!(
        e.to_string().contains(needle),
        "expected an error mentioning {needle:?}, got: {e}"
    );
    let t = Tensor::full(s, &[4], 2.0).unwrap();
    assert_eq!(relu(s, &t).unwrap().to_vec(s).unwrap(), vec![2.0; 4]);
    drop(t);
    s.synchronize().unwrap();
    assert_eq!(dev.memory_allocated(), before, "leak after: {needle}");
}

#[test]
fn every_op_rejects_mismatched_shapes_with_a_typed_error() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    warm(&s);
    let mut rng = Rng::new(7);
    let t = |shape: &[usize]| Tensor::zeros(&s, shape).unwrap();
    let lin = Linear::new(&s, 4, 3, &mut rng).unwrap();
    let conv = Conv2d::new(&s, 3, 2, 3, 1, 0, &mut rng).unwrap();
    row(&dev, &s, "do not match", || {
        linear(&s, &t(&[2, 5]), &lin.weight.tensor(), None, false).map(drop)
    });
    row(&dev, &s, "bias", || {
        linear(&s, &t(&[2, 4]), &lin.weight.tensor(), Some(&t(&[7])), false).map(drop)
    });
    row(&dev, &s, "conv2d", || {
        conv.forward(&s, &t(&[1, 4, 8, 8])).map(drop)
    });
    row(&dev, &s, "conv2d", || {
        conv.forward(&s, &t(&[1, 3, 2, 2])).map(drop)
    });
    row(&dev, &s, "conv2d", || {
        conv2d(&s, &t(&[1, 3, 8, 8]), &conv.weight.tensor(), None, 0, 0).map(drop)
    });
    row(&dev, &s, "max_pool2d", || {
        max_pool2d(&s, &t(&[1, 1, 2, 2]), 3, 1).map(drop)
    });
    row(&dev, &s, "max_pool2d", || {
        max_pool2d(&s, &t(&[1, 1, 4, 4]), 2, 0).map(drop)
    });
    row(&dev, &s, "mse_loss", || {
        mse_loss(&s, &t(&[2, 3]), &t(&[3, 2]), Reduction::Sum).map(drop)
    });
    let tg = Arc::new(s.alloc_from_host(&[0i32, 1]).unwrap());
    row(&dev, &s, "cross_entropy", || {
        cross_entropy(&s, &t(&[3, 4]), &tg).map(drop)
    });
    row(&dev, &s, "cross_entropy", || {
        cross_entropy(&s, &t(&[2, 0]), &tg).map(drop)
    });
    row(&dev, &s, "reshape", || {
        t(&[2, 3]).reshape(&[4, 2]).map(drop)
    });
    row(&dev, &s, "scalar", || {
        lin.forward(&s, &t(&[2, 4]))?.backward(&s)
    });
    row(&dev, &s, "backward_with", || {
        let y = lin.forward(&s, &t(&[2, 4]))?;
        y.backward_with(&s, t(&[5]))
    });
    row(&dev, &s, "cannot have shape", || {
        Tensor::from_buffer(Arc::new(s.alloc::<f32>(5)?), &[2, 3]).map(drop)
    });
    row(&dev, &s, "values for shape", || {
        Parameter::from_host(&s, "w", &[1.0; 5], &[2, 3]).map(drop)
    });
    row(&dev, &s, "do not match", || {
        mlp(&s, &mut rng, &[8, 4, 2])
            .forward(&s, &t(&[3, 5]))
            .map(drop)
    });
    row(&dev, &s, "too many elements", || {
        Tensor::zeros(&s, &[usize::MAX, 4]).map(drop)
    });
    row(&dev, &s, "too large", || {
        s.alloc::<f32>(usize::MAX / 2)
            .map(drop)
            .map_err(NnError::from)
    });
}

#[test]
fn zero_sized_batches_run_and_return_empty_results() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut rng = Rng::new(8);
    let model = mlp(&s, &mut rng, &[6, 5, 3]);
    let x = Tensor::zeros(&s, &[0, 6]).unwrap();
    let y = model.forward(&s, &x).unwrap();
    assert_eq!(y.shape(), &[0, 3]);
    assert!(y.to_vec(&s).unwrap().is_empty());
}

/// NaN and infinity are data, not errors: they propagate as PyTorch's do (a NaN through a
/// product or a loss gives NaN; ReLU passes NaN through as `torch.relu` does; ±inf through
/// ReLU gives inf/0). Nothing is checked or rejected on the device.
#[test]
fn nan_and_inf_inputs_propagate_like_pytorch() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let x = Tensor::from_host(
        &s,
        &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -1.0, 2.0],
        &[5],
    )
    .unwrap();
    let y = relu(&s, &x).unwrap().to_vec(&s).unwrap();
    assert!(y[0].is_nan());
    assert_eq!(&y[1..], &[f32::INFINITY, 0.0, 0.0, 2.0]);
    let mut rng = Rng::new(9);
    let lin = Linear::new(&s, 5, 2, &mut rng).unwrap();
    let out = lin.forward(&s, &x.reshape(&[1, 5]).unwrap()).unwrap();
    assert!(out.to_vec(&s).unwrap().iter().all(|v| v.is_nan()));
    let t = Tensor::zeros(&s, &[5]).unwrap();
    let l = mse_loss(&s, &x, &t, Reduction::Sum).unwrap();
    assert!(l.to_vec(&s).unwrap()[0].is_nan());
    s.synchronize().unwrap(); // no device-side check fires for NaN
}

#[test]
fn out_of_memory_inside_a_capture_is_typed_and_leaves_stream_and_pool_usable() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let pool = dev.graph_pool_handle();
    let mut rng = Rng::new(10);
    let model = mlp(&s, &mut rng, &[16, 8]);
    let x = Tensor::zeros(&s, &[4, 16]).unwrap();
    // Eagerly first: the engine registry measures this product and its library creates the
    // stream's workspace (kept per stream by design), so `before` compares like with like.
    no_grad(|| model.forward(&s, &x)).unwrap();
    s.synchronize().unwrap();
    let before = dev.memory_allocated();
    let e = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        let _small = cs.alloc::<f32>(1024)?;
        let _huge = cs.alloc::<u8>(1 << 50)?;
        Ok(())
    })
    .unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert!(!s.driver_is_capturing().unwrap());
    let (g, y) = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        Ok(no_grad(|| model.forward(cs, &x))?)
    })
    .unwrap();
    g.replay(&s).unwrap();
    assert_eq!(y.to_vec(&s).unwrap().len(), 32);
    drop((g, y));
    s.synchronize().unwrap();
    assert_eq!(dev.memory_allocated(), before);
}

#[test]
fn a_capture_closure_that_panics_mid_backward_is_discarded_cleanly() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = Rng::new(11);
    let model = mlp(&s, &mut rng, &[8, 8, 2]);
    let x = Tensor::zeros(&s, &[4, 8]).unwrap();
    warm(&s);
    // One eager forward first: the engines' per-stream workspaces (made on first use, kept
    // for the stream's life) are not what this test looks for.
    model.forward(&s, &x).unwrap();
    s.synchronize().unwrap();
    let before = dev.memory_allocated();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            let y = model.forward(cs, &x)?;
            let _ = y;
            panic!("model bug in the middle of a step");
            #[allow(unreachable_code)]
            Ok(())
        });
    }));
    assert!(r.is_err());
    assert!(!s.driver_is_capturing().unwrap());
    s.synchronize().unwrap();
    assert_eq!(dev.memory_allocated(), before);
    let y = model.forward(&s, &x).unwrap();
    assert_eq!(y.to_vec(&s).unwrap().len(), 8);
}

#[test]
fn misuse_synchronising_the_device_inside_a_capture_fails_the_capture_not_the_process() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = Rng::new(12);
    let model = mlp(&s, &mut rng, &[8, 4]);
    let x = Tensor::zeros(&s, &[2, 8]).unwrap();
    let d2 = dev.clone();
    let e = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        let _y = model.forward(cs, &x)?;
        d2.synchronize()?; // not allowed while this thread captures
        Ok(())
    })
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::CaptureFailed { .. } | Error::CaptureInvalidated { .. }
        ),
        "{e}"
    );
    assert!(!s.driver_is_capturing().unwrap());
    let y = model.forward(&s, &x).unwrap();
    assert_eq!(y.to_vec(&s).unwrap().len(), 8);
}

// ---- Teardown (issue 8, item 1) -----------------------------------------------------------

fn open_train_drop() {
    let dev = Device::open(0).unwrap();
    let mut s = dev.new_stream().unwrap();
    let mut rng = Rng::new(13);
    let model = mlp(&s, &mut rng, &[256, 512, 10]);
    let mut opt = Adam::new(&s, model.parameters(), 1e-3, 0.0, false).unwrap();
    let x = Tensor::from_host(&s, &rng.vec_normal(64 * 256), &[64, 256]).unwrap();
    let y = Tensor::from_host(&s, &rng.vec_normal(64 * 10), &[64, 10]).unwrap();
    let (step, _loss) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        opt.zero_grad(cs, true)?;
        let loss = mse_loss(cs, &model.forward(cs, &x)?, &y, Reduction::Mean)?;
        loss.backward(cs)?;
        opt.step(cs)?;
        Ok(loss)
    })
    .unwrap();
    for _ in 0..10 {
        step.replay(&s).unwrap();
    }
    s.synchronize().unwrap();
}

#[test]
fn opening_training_and_dropping_a_device_twenty_times_returns_its_memory() {
    let probe = gpu_test_device!(); // keeps the primary context alive to measure free memory
    let reserved0 = probe.memory_reserved(); // the probe's own check record
    open_train_drop(); // libraries' one-time state (cuBLAS) is not a leak
    let (free0, _) = probe.context().mem_get_info().unwrap();
    for _ in 0..20 {
        open_train_drop();
    }
    let (free1, _) = probe.context().mem_get_info().unwrap();
    let lost = free0.saturating_sub(free1);
    // Slack: the driver's own bookkeeping moves by a few MiB between measurements.
    assert!(
        lost <= 8 << 20,
        "20 open/train/drop cycles kept {} MiB",
        lost >> 20
    );
    assert_eq!(probe.memory_reserved(), reserved0);
}

// ---- Threads (issue 8, item 4) ------------------------------------------------------------

#[test]
fn four_threads_train_their_own_models_graphed_like_one_thread() {
    let dev = gpu_test_device!();
    let run = |dev: &Device| -> Vec<f32> {
        let mut s = dev.new_stream().unwrap();
        let mut rng = Rng::new(14);
        let model = mlp(&s, &mut rng, &[32, 64, 4]);
        let mut opt = Sgd::new(&s, model.parameters(), 0.05, 0.9, 0.0).unwrap();
        let x = Tensor::from_host(&s, &rng.vec_normal(16 * 32), &[16, 32]).unwrap();
        let y = Tensor::from_host(&s, &rng.vec_normal(16 * 4), &[16, 4]).unwrap();
        let (step, loss) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            opt.zero_grad(cs, true)?;
            let loss = mse_loss(cs, &model.forward(cs, &x)?, &y, Reduction::Mean)?;
            loss.backward(cs)?;
            opt.step(cs)?;
            Ok(loss)
        })
        .unwrap();
        for _ in 0..50 {
            step.replay(&s).unwrap();
        }
        let mut out = loss.to_vec(&s).unwrap();
        out.extend(s.to_vec(model.parameters()[0].data()).unwrap());
        out
    };
    let want = run(&dev);
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let dev = dev.clone();
            std::thread::spawn(move || run(&dev))
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), want);
    }
}

#[test]
fn a_graph_cache_behind_a_mutex_serves_four_threads_like_one() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = Rng::new(15);
    let model = mlp(&s, &mut rng, &[24, 32, 6]);
    // Every request (thread t, request i) has data of its own, and its eager answer on one
    // stream: an answer from another thread's input, or a stale one, cannot match.
    let rows_of = |t: usize, i: usize| 1 + (i * 7 + t * 3) % 40;
    let requests: Vec<Vec<(Vec<f32>, Vec<f32>)>> = (0..4)
        .map(|t| {
            (0..50)
                .map(|i| {
                    let rows = rows_of(t, i);
                    let xh = rng.vec_normal(rows * 24);
                    let x = Tensor::from_host(&s, &xh, &[rows, 24]).unwrap();
                    let want = no_grad(|| model.forward(&s, &x))
                        .unwrap()
                        .to_vec(&s)
                        .unwrap();
                    (xh, want)
                })
                .collect()
        })
        .collect();
    let batched = Batched {
        module: model,
        row_shape: vec![24],
        output_row: 6,
    };
    let cache = GraphCache::new(
        &mut s,
        batched,
        BucketPolicy::PowersOfTwo { max: 32 },
        CacheOptions::default(),
    )
    .unwrap();
    let shared = Arc::new(Mutex::new((cache, s)));
    let threads: Vec<_> = requests
        .into_iter()
        .enumerate()
        .map(|(t, mine_requests)| {
            let (shared, dev) = (shared.clone(), dev.clone());
            std::thread::spawn(move || {
                let mine = dev.new_stream().unwrap();
                for (i, (xh, want)) in mine_requests.into_iter().enumerate() {
                    let rows = rows_of(t, i);
                    let input = mine.alloc_from_host(&xh).unwrap();
                    mine.synchronize().unwrap();
                    let got = {
                        let mut g = shared.lock().unwrap();
                        let (cache, s) = &mut *g;
                        let (out, _) = cache.run(s, &input, rows).unwrap();
                        s.to_vec(&out).unwrap()
                    };
                    let e = rel_err(&got, &to_f64(&want));
                    assert!(e < 1e-5, "thread {t} request {i} ({rows} rows): {e}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let g = shared.lock().unwrap();
    assert_eq!(g.0.stats().requests, 200);
}

#[test]
fn nn_ops_on_a_buffer_from_another_stream_are_fenced() {
    let dev = gpu_test_device!();
    let a = dev.new_stream().unwrap();
    let b = dev.new_stream().unwrap();
    let mut rng = Rng::new(16);
    let xh = rng.vec_normal(1 << 16);
    let x = Tensor::from_host(&a, &xh, &[1 << 16]).unwrap();
    a.synchronize().unwrap();
    // Computed on B from a tensor A allocated; A's allocations right after must not reuse
    // B's output's inputs while B runs (the block tracks B).
    let y = relu(&b, &x).unwrap();
    drop(x);
    let z = Tensor::from_host(&a, &vec![0.5; 1 << 16], &[1 << 16]).unwrap();
    let got = y.to_vec(&b).unwrap();
    let want = cpu::relu(&to_f64(&xh));
    assert!(rel_err(&got, &want) == 0.0);
    assert!(z.to_vec(&a).unwrap().iter().all(|&v| v == 0.5));
}
