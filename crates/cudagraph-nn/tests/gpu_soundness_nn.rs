//! GPU tests of the NN layer's soundness and reliability (issues 13 and 8): indices checked on
//! the device (cross-entropy targets, eagerly and inside graphs), the bad-input matrix (each row
//! a typed error naming the problem, the stream and pools usable afterwards, nothing leaked),
//! documented NaN/Inf behaviour, teardown that gives every byte back to the driver, and models
//! used from several threads at once; and (issue 26, items 5 and 7) a block used on a busy
//! stream is not handed out again before that stream is done, for our kernels, copies, fills,
//! cuBLAS, cuBLASLt and cuDNN alike, and library calls refuse another device's buffers and
//! handles (two GPUs, ignored on one).
//!
//! Tests whose point is a deliberate driver error are named `misuse_*` (skipped by
//! `bench/sanitize.sh`, since compute-sanitizer rightly reports the errors they provoke).

use std::cell::OnceCell;
use std::sync::{Arc, Mutex};

use cudagraph::{
    gpu_test_device, BucketPolicy, CacheOptions, CaptureOptions, Device, DeviceBuffer, Error,
    Graph, GraphCache, QueueExt, Stream,
};
use cudagraph_nn::cpu::{self, rel_err, to_f64};
use cudagraph_nn::engine::conv::ConvGeom;
use cudagraph_nn::engine::conv::{conv_with, run_conv, ConvDir, ConvIo};
use cudagraph_nn::engine::gemm;
use cudagraph_nn::engine::gemm::{gemm_with, GemmOp};
use cudagraph_nn::engine::gemm::{Epilogue, Trans};
use cudagraph_nn::engine::{ConvEngine, Engines, GemmEngine, GemmFamily};
use cudagraph_nn::ffi::blaslt::{LtAlgo, LtShape};
use cudagraph_nn::kernels::igemm::Spin;
use cudagraph_nn::*;

fn mlp(s: &Stream, rng: &mut HostRng, dims: &[usize]) -> Sequential {
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
    let mut rng = HostRng::new(5);
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
    let mut rng = HostRng::new(6);
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
    let mut rng = HostRng::new(99);
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
    let mut rng = HostRng::new(7);
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
    let mut rng = HostRng::new(8);
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
    let mut rng = HostRng::new(9);
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
    let mut rng = HostRng::new(10);
    let model = mlp(&s, &mut rng, &[16, 8]);
    let x = Tensor::from_host(&s, &rng.vec_normal(4 * 16), &[4, 16]).unwrap();
    // Eagerly first: the engine registry measures this product and its library creates the
    // stream's workspace (kept per stream by design), so `before` compares like with like.
    let want = no_grad(|| model.forward(&s, &x))
        .unwrap()
        .to_vec(&s)
        .unwrap();
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
    cudagraph::testing::assert_bits_eq(
        &y.to_vec(&s).unwrap(),
        &want,
        "replay after the failed capture",
    );
    drop((g, y));
    s.synchronize().unwrap();
    assert_eq!(dev.memory_allocated(), before);
}

#[test]
fn a_capture_closure_that_panics_mid_backward_is_discarded_cleanly() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(11);
    let model = mlp(&s, &mut rng, &[8, 8, 2]);
    let x = Tensor::from_host(&s, &rng.vec_normal(4 * 8), &[4, 8]).unwrap();
    warm(&s);
    // One eager forward first: the engines' per-stream workspaces (made on first use, kept
    // for the stream's life) are not what this test looks for.
    let want = model.forward(&s, &x).unwrap().to_vec(&s).unwrap();
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
    cudagraph::testing::assert_bits_eq(&y.to_vec(&s).unwrap(), &want, "forward after the panic");
}

#[test]
fn misuse_synchronising_the_device_inside_a_capture_fails_the_capture_not_the_process() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(12);
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
    let mut rng = HostRng::new(13);
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
        let mut rng = HostRng::new(14);
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
        out.extend(s.to_vec(model.parameters()[0].data().unwrap()).unwrap());
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

/// One request of the graph-cache test: its rows, its input, and its own eager answer.
struct Request {
    rows: usize,
    input: Vec<f32>,
    want: Vec<f32>,
}

/// Every request has its own rows (random, drawn for that request alone) and is compared with
/// the eager forward of exactly those rows: a request answered from another request's input, or
/// from a stale static input, gives different rows and fails (with one shared array of inputs,
/// where each request was a prefix of the same data, a mixed-up input gave identical rows).
/// Tolerance 1e-5 (relative, over the request's rows): the graph runs the bucket's padded batch,
/// which may pick another engine than the eager batch of `rows`; another request's data is off
/// by order 1.
#[test]
fn a_graph_cache_behind_a_mutex_serves_four_threads_like_one() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(15);
    let model = mlp(&s, &mut rng, &[24, 32, 6]);
    const THREADS: usize = 4;
    const REQUESTS: usize = 50;
    // requests[t][i]: thread t's i-th request.
    let requests: Vec<Vec<Request>> = (0..THREADS)
        .map(|t| {
            (0..REQUESTS)
                .map(|i| {
                    let rows = 1 + (i * 7 + t * 3) % 40;
                    let input = rng.vec_normal(rows * 24);
                    let x = Tensor::from_host(&s, &input, &[rows, 24]).unwrap();
                    let want = no_grad(|| model.forward(&s, &x))
                        .unwrap()
                        .to_vec(&s)
                        .unwrap();
                    Request { rows, input, want }
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
    let requests = Arc::new(requests);
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (shared, requests, dev) = (shared.clone(), requests.clone(), dev.clone());
            std::thread::spawn(move || {
                let mine = dev.new_stream().unwrap();
                for (i, Request { rows, input, want }) in requests[t].iter().enumerate() {
                    let input = mine.alloc_from_host(input).unwrap();
                    mine.synchronize().unwrap();
                    let got = {
                        let mut g = shared.lock().unwrap();
                        let (cache, s) = &mut *g;
                        let (out, _) = cache.run(s, &input, *rows).unwrap();
                        s.to_vec(&out).unwrap()
                    };
                    let e = rel_err(&got, &to_f64(want));
                    assert!(e < 1e-5, "thread {t} request {i} ({rows} rows): {e}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let g = shared.lock().unwrap();
    assert_eq!(g.0.stats().requests, (THREADS * REQUESTS) as u64);
}

// ---- Cross-stream fencing (issue 26, item 7) ----------------------------------------------

/// A NaN with a payload no computation here produces: what stream A writes into the buffer it
/// allocates right after the block B uses was dropped.
const POISON: u32 = 0x7fc0_0bad;

/// Milliseconds stream B spins before the op under test: A's allocation, its poison fill and A's
/// synchronisation all happen while B's op has not started. An event recorded on B just before
/// the op says so; if it completed (a host stalled that long), the case fails rather than
/// passing without having tested anything.
const BUSY_MS: u64 = 200;

/// One case of the cross-stream fencing tests. `x` (holding `xh`) is allocated on stream A;
/// stream B is kept busy by the spin kernel, then `op` enqueues on B the work under test, which
/// uses `x` and returns the buffer (of B) it computed into, if it computed from `x`. Every handle
/// to `x` is dropped at once, and A allocates a buffer of the same length, fills it with
/// [`POISON`] and waits for the fill: all while B's op has provably not started. The block B's op
/// uses must not be handed out again before B's work completes, so: A's buffer is another
/// block; B's op computes from `x`'s own data (`check` sees its output, when it read `x`); and
/// A's buffer still holds the poison once B is done (when B's op wrote `x`).
///
/// Each of these fails if the op stops declaring its use of `x` on B (`Queue::use_block`): the
/// block then goes back to A's free list at the drop, and A's next buffer of that size is that
/// block, poisoned before B's op reads it, or overwritten by B's op after the poison.
///
/// Before the timed run, `op` runs once on a buffer of B: kernels compiled, library handles,
/// plans and workspaces made (some of which synchronise), so the timed run enqueues only the
/// op; `check` checks that run too.
fn fenced(
    dev: &Device,
    what: &str,
    xh: &[f32],
    op: impl Fn(&Stream, &DeviceBuffer<f32>) -> Option<DeviceBuffer<f32>>,
    check: impl Fn(&[f32]),
) {
    let a = dev.new_stream().unwrap();
    let b = dev.new_stream().unwrap();
    let spin = Spin::get(dev).unwrap();
    let warm = b.alloc_from_host(xh).unwrap();
    spin.spin(&b, 1_000).unwrap();
    if let Some(out) = op(&b, &warm) {
        check(&b.to_vec(&out).unwrap());
    }
    b.synchronize().unwrap();
    drop(warm);

    let x = a.alloc_from_host(xh).unwrap();
    a.synchronize().unwrap();
    let started = dev.new_event(false).unwrap();
    for _ in 0..BUSY_MS / 10 {
        spin.spin(&b, 10_000_000).unwrap();
    }
    b.record(&started).unwrap();
    let out = op(&b, &x);
    let x_addr = x.addr();
    drop(x);
    let p = a.alloc::<f32>(xh.len()).unwrap();
    a.fill32(&p, 0, xh.len(), f32::from_bits(POISON)).unwrap();
    a.synchronize().unwrap();
    assert!(
        !started.query().unwrap(),
        "{what}: stream B finished spinning before A refilled the block, so this run tested \
         nothing (raise BUSY_MS)"
    );
    assert_ne!(
        p.addr(),
        x_addr,
        "{what}: the block was handed to stream A while B's op on it was pending"
    );
    b.synchronize().unwrap();
    if let Some(out) = out {
        check(&b.to_vec(&out).unwrap());
    }
    let kept = a.to_vec(&p).unwrap();
    assert!(
        kept.iter().all(|v| v.to_bits() == POISON),
        "{what}: B's op wrote into the buffer A was given after the block was dropped"
    );
}

/// Our kernel launches, reading and writing a block of another stream.
#[test]
fn nn_ops_on_a_buffer_from_another_stream_are_fenced() {
    let dev = gpu_test_device!();
    let nn = Nn::get(&dev).unwrap();
    let mut rng = HostRng::new(16);
    let xh = rng.vec_normal(1 << 14);
    let n = xh.len();
    let want: Vec<f32> = xh.iter().map(|&v| v.max(0.0)).collect();
    fenced(
        &dev,
        "relu kernel reading the block",
        &xh,
        |b, x| {
            let y = b.alloc::<f32>(n).unwrap();
            nn.relu_fwd(b, x, &y, n).unwrap();
            Some(y)
        },
        |got| assert_eq!(got, &want[..], "relu kernel reading the block"),
    );
    let src = OnceCell::new();
    fenced(
        &dev,
        "relu kernel writing the block",
        &xh,
        |b, x| {
            let src = src.get_or_init(|| b.alloc_from_host(&xh).unwrap());
            nn.relu_fwd(b, src, x, n).unwrap();
            None
        },
        |_| {},
    );
}

/// Device copies (either side), host-to-device copies and fills into a block of another stream.
#[test]
fn copies_and_fills_on_a_buffer_from_another_stream_are_fenced() {
    let dev = gpu_test_device!();
    let mut rng = HostRng::new(17);
    let xh = rng.vec_normal(1 << 14);
    let n = xh.len();
    fenced(
        &dev,
        "device copy reading the block",
        &xh,
        |b, x| {
            let y = b.alloc::<f32>(n).unwrap();
            b.copy(x, &y).unwrap();
            Some(y)
        },
        |got| assert_eq!(got, &xh[..], "device copy reading the block"),
    );
    let src = OnceCell::new();
    fenced(
        &dev,
        "device copy writing the block",
        &xh,
        |b, x| {
            let src = src.get_or_init(|| b.alloc_from_host(&xh).unwrap());
            b.copy(src, x).unwrap();
            None
        },
        |_| {},
    );
    // A small copy from pageable memory: the driver stages it and returns with the copy queued
    // behind B's spin (should a driver wait for the stream instead, the harness's event check
    // fails the case rather than letting it pass untested).
    let small = rng.vec_normal(1 << 10);
    fenced(
        &dev,
        "host-to-device copy writing the block",
        &small,
        |b, x| {
            b.copy_from_host(&small, x).unwrap();
            None
        },
        |_| {},
    );
    fenced(
        &dev,
        "fill writing the block",
        &xh,
        |b, x| {
            b.fill32(x, 0, n, 3.0f32).unwrap();
            None
        },
        |_| {},
    );
    fenced(
        &dev,
        "memset writing the block",
        &xh,
        |b, x| {
            b.memset_zero(x).unwrap();
            None
        },
        |_| {},
    );
}

/// The product `y[m×n] = x[m×k]·w[n×k]ᵀ` of the library cases.
const LIB_MNK: (usize, usize, usize) = (64, 32, 256);

fn lib_op() -> GemmOp {
    let (m, n, k) = LIB_MNK;
    GemmOp::linear(m, n, k)
}

/// cuBLAS and cuBLASLt (each forced with `gemm_with`), reading the block as the product's A
/// operand and writing it as its output. Tolerance 1e-5 against the f64 reference (fp32 sums
/// of 256 terms); a poisoned operand gives NaN, which fails it.
#[test]
fn cublas_and_cublaslt_on_a_buffer_from_another_stream_are_fenced() {
    let dev = gpu_test_device!();
    let nn = Nn::get(&dev).unwrap();
    Engines::get(&dev)
        .unwrap()
        .cublaslt()
        .expect("cuBLASLt must be installed on the GPU test machine");
    let (m, n, k) = LIB_MNK;
    let op = lib_op();
    let mut rng = HostRng::new(18);
    let xh = rng.vec_normal(m * k);
    let wh = rng.vec_normal(n * k);
    let want = cpu::linear(&to_f64(&xh), &to_f64(&wh), &[], m, k, n);
    for algo in [GemmEngine::Cublas, GemmEngine::CublasLt(0)] {
        let w = OnceCell::new();
        let what = format!("{algo} reading the block");
        fenced(
            &dev,
            &what,
            &xh,
            |b, x| {
                let w = w.get_or_init(|| b.alloc_from_host(&wh).unwrap());
                let y = b.alloc::<f32>(m * n).unwrap();
                gemm_with(b, &nn, algo, &op, x, w, &y, None).unwrap();
                Some(y)
            },
            |got| {
                let e = rel_err(got, &want);
                assert!(e < 1e-5, "{what}: {e}");
            },
        );
        let inputs = OnceCell::new();
        fenced(
            &dev,
            &format!("{algo} writing the block"),
            &vec![0.0; m * n],
            |b, y| {
                let (x, w) = inputs.get_or_init(|| {
                    (
                        b.alloc_from_host(&xh).unwrap(),
                        b.alloc_from_host(&wh).unwrap(),
                    )
                });
                gemm_with(b, &nn, algo, &op, x, w, y, None).unwrap();
                None
            },
            |_| {},
        );
    }
}

/// The convolution of the cuDNN cases: 4 images of 16 channels, 16×16, 3×3 to 16 channels,
/// padding 1 (input and output 16384 values each).
fn lib_geom() -> ConvGeom {
    ConvGeom {
        n: 4,
        c: 16,
        h: 16,
        w: 16,
        oc: 16,
        kh: 3,
        kw: 3,
        stride: 1,
        pad: 1,
    }
}

/// cuDNN's legacy API (its first deterministic forward algorithm), its graph API (the first
/// deterministic configuration) and `cudnnAddTensor`, reading the block (the convolution's
/// input, the bias) and writing it (the output). Tolerance 1e-4 against the f64 reference, as
/// for every convolution engine; a poisoned input gives NaN, which fails it.
#[test]
fn cudnn_on_a_buffer_from_another_stream_is_fenced() {
    let dev = gpu_test_device!();
    let nn = Nn::get(&dev).unwrap();
    let eng = Engines::get(&dev).unwrap();
    let dnn = eng
        .cudnn()
        .expect("cuDNN must be installed on the GPU test machine");
    let graph_api = eng
        .cudnn_graph()
        .expect("cuDNN 9 with its graph API must be installed on the GPU test machine");
    let g = lib_geom();
    let (x_len, w_len, y_len) = (
        g.input_len().unwrap(),
        g.weight_len().unwrap(),
        g.output_len().unwrap(),
    );
    let s = dev.new_stream().unwrap();
    let legacy = dnn.algos(ConvDir::Forward, &g, true, 1 << 30).unwrap()[0].algo;
    let rank = graph_api
        .candidates(&s, ConvDir::Forward, &g, true, 1 << 30)
        .unwrap()[0]
        .rank;
    let mut rng = HostRng::new(19);
    let xh = rng.vec_normal(x_len);
    let wh = rng.vec_normal(w_len);
    let bh = rng.vec_normal(g.oc);
    let reference = cpu::Conv {
        n: g.n,
        c: g.c,
        h: g.h,
        w: g.w,
        oc: g.oc,
        k: g.kh,
        stride: g.stride,
        pad: g.pad,
    };
    let want = reference.forward(&to_f64(&xh), &to_f64(&wh), &vec![0.0; g.oc]);
    for algo in [ConvEngine::Cudnn(legacy), ConvEngine::CudnnGraph(rank)] {
        let w = OnceCell::new();
        let what = format!("{algo} reading the block");
        fenced(
            &dev,
            &what,
            &xh,
            |b, x| {
                let w = w.get_or_init(|| b.alloc_from_host(&wh).unwrap());
                let y = b.alloc::<f32>(y_len).unwrap();
                let io = ConvIo {
                    a: x,
                    b: w,
                    out: &y,
                    bias: None,
                };
                conv_with(b, &nn, algo, ConvDir::Forward, &g, io).unwrap();
                Some(y)
            },
            |got| {
                let e = rel_err(got, &want);
                assert!(e < 1e-4, "{what}: {e}");
            },
        );
        let inputs = OnceCell::new();
        fenced(
            &dev,
            &format!("{algo} writing the block"),
            &vec![0.0; y_len],
            |b, y| {
                let (x, w) = inputs.get_or_init(|| {
                    (
                        b.alloc_from_host(&xh).unwrap(),
                        b.alloc_from_host(&wh).unwrap(),
                    )
                });
                let io = ConvIo {
                    a: x,
                    b: w,
                    out: y,
                    bias: None,
                };
                conv_with(b, &nn, algo, ConvDir::Forward, &g, io).unwrap();
                None
            },
            |_| {},
        );
    }
    // cudnnAddTensor: the bias read from the block (added to zeros: exactly the bias), and the
    // output written in place.
    let hw = y_len / (g.n * g.oc);
    let broadcast: Vec<f32> = (0..y_len).map(|i| bh[(i / hw) % g.oc]).collect();
    fenced(
        &dev,
        "cudnnAddTensor reading the block",
        &bh,
        |b, bias| {
            let y = b.alloc_zeroed::<f32>(y_len).unwrap();
            dnn.add_bias(b, &g, bias, &y).unwrap();
            Some(y)
        },
        |got| assert_eq!(got, &broadcast[..], "cudnnAddTensor reading the block"),
    );
    let bias = OnceCell::new();
    fenced(
        &dev,
        "cudnnAddTensor writing the block",
        &vec![0.0; y_len],
        |b, y| {
            let bias = bias.get_or_init(|| b.alloc_from_host(&bh).unwrap());
            dnn.add_bias(b, &g, bias, y).unwrap();
            None
        },
        |_| {},
    );
}

// ---- Library calls check devices (issue 26, item 5) ---------------------------------------

/// Device 1 for the two-GPU tests (ignored by default; run with `--ignored` on a multi-GPU
/// machine). With fewer devices the test prints why it skips, or fails when
/// `CUDAGRAPH_REQUIRE_GPUS` asks for two or more.
fn second_device() -> Option<Device> {
    let count = cudagraph::runtime::device_count().unwrap_or(0);
    if count >= 2 {
        return Some(Device::open(1).unwrap());
    }
    let var = cudagraph_nn::env::REQUIRE_GPUS_VAR;
    let required = std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .is_some_and(|n| n >= 2);
    assert!(!required, "{var} requires two GPUs, found {count}");
    println!("skipped: needs two GPUs, found {count} (set {var}=2 to require it)");
    None
}

/// The name `r`'s error gives the refused object, which must be a buffer or handle of device 1
/// used with a queue of device 0.
#[track_caller]
fn refused<T>(case: &str, r: Result<T>) -> &'static str {
    match r {
        Err(NnError::Core(Error::WrongDevice {
            what,
            expected: 0,
            got: 1,
        })) => what,
        Err(e) => panic!("{case}: expected WrongDevice (device 1 used with device 0), got: {e}"),
        Ok(_) => panic!("{case}: device 1's object was accepted on device 0"),
    }
}

/// A buffer of device 1 in any role of a product or a convolution on device 0 is refused with
/// `WrongDevice` naming that role before anything runs: through the ops (`linear`, `conv2d`),
/// through the registry forced onto each library family (`gemm` with `GemmFamily::Cublas`,
/// `GemmFamily::CublasLt`, `GemmFamily::Auto`; `run_conv`), through each library engine by name
/// (`gemm_with`, `conv_with`), and through the library wrappers themselves (`Blas::gemm`,
/// `BlasLt::matmul`, `Cudnn::run`, `Cudnn::add_bias`, `CudnnGraph::run`,
/// `CudnnGraph::run_fused_bias`); a library handle of device 1 is refused on a queue of device 0.
/// Nothing was written (the outputs keep a sentinel) and both devices still compute.
#[test]
#[ignore = "needs two GPUs; run with --ignored on a multi-GPU machine"]
fn misuse_a_buffer_of_another_device_is_refused_by_cublas_cublaslt_and_cudnn_calls() {
    let dev = gpu_test_device!();
    let Some(other) = second_device() else {
        return;
    };
    let s = dev.new_stream().unwrap();
    let s1 = other.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = Engines::get(&dev).unwrap();
    let lt = eng
        .cublaslt()
        .expect("cuBLASLt must be installed on the GPU test machine");
    let dnn = eng
        .cudnn()
        .expect("cuDNN must be installed on the GPU test machine");
    let graph_api = eng
        .cudnn_graph()
        .expect("cuDNN 9 with its graph API must be installed on the GPU test machine");
    let mut rng = HostRng::new(26);
    const SENTINEL: f32 = 7.0;

    // A product y = x·wᵀ + bias: operands [x, w, y, bias], each in turn from device 1.
    let (m, n, k) = (8, 16, 32);
    let host = [
        rng.vec_normal(m * k),
        rng.vec_normal(n * k),
        vec![SENTINEL; m * n],
        rng.vec_normal(n),
    ];
    let on0: Vec<DeviceBuffer<f32>> = host.iter().map(|h| s.alloc_from_host(h).unwrap()).collect();
    let on1: Vec<DeviceBuffer<f32>> = host
        .iter()
        .map(|h| s1.alloc_from_host(h).unwrap())
        .collect();
    let names = ["gemm A", "gemm B", "gemm C", "gemm bias"];
    let op = GemmOp {
        ta: Trans::N,
        tb: Trans::T,
        m,
        n,
        k,
        alpha: 1.0,
        beta: 0.0,
        epilogue: Epilogue::Bias,
    };
    let shape = LtShape {
        ta: op.ta,
        tb: op.tb,
        m,
        n,
        k,
        epilogue: Epilogue::Bias,
        align: 256,
    };
    for (role, name) in names.iter().enumerate() {
        let pick = |i: usize| if i == role { &on1[i] } else { &on0[i] };
        let (a, b, c, v) = (pick(0), pick(1), pick(2), pick(3));
        for engine in [GemmFamily::Cublas, GemmFamily::CublasLt, GemmFamily::Auto] {
            let r = gemm::gemm(
                &s,
                &nn,
                engine,
                (Trans::N, Trans::T),
                (m, n, k),
                1.0,
                a,
                b,
                0.0,
                c,
                Some(v),
                false,
            );
            assert_eq!(&refused(&format!("gemm {engine:?}, {name}"), r), name);
        }
        for algo in [GemmEngine::Cublas, GemmEngine::CublasLt(0)] {
            let r = gemm_with(&s, &nn, algo, &op, a, b, c, Some(v));
            assert_eq!(&refused(&format!("gemm_with {algo}, {name}"), r), name);
        }
        if role < 3 {
            let r = eng
                .blas()
                .unwrap()
                .gemm(&s, Trans::N, Trans::T, m, n, k, 1.0, a, b, 0.0, c);
            assert_eq!(&refused(&format!("Blas::gemm, {name}"), r), name);
        }
        let r = lt.matmul(&s, &shape, LtAlgo::Rank(0), 1.0, a, b, 0.0, c, Some(v));
        assert_eq!(&refused(&format!("BlasLt::matmul, {name}"), r), name);
    }
    let t = |q: &Stream, i: usize, shape: &[usize]| Tensor::from_host(q, &host[i], shape).unwrap();
    let (x0, w0, b0) = (t(&s, 0, &[m, k]), t(&s, 1, &[n, k]), t(&s, 3, &[n]));
    let (x1, w1) = (t(&s1, 0, &[m, k]), t(&s1, 1, &[n, k]));
    let r = linear(&s, &x1, &w0, Some(&b0), false);
    assert_eq!(refused("linear, x from device 1", r), "gemm A");
    let r = linear(&s, &x0, &w1, Some(&b0), true);
    assert_eq!(refused("linear, w from device 1", r), "gemm B");

    // A convolution: buffers [x, w, y, bias], each in turn from device 1, forward through every
    // cuDNN engine; then device 1's input and output in the backward directions.
    let g = ConvGeom {
        n: 2,
        c: 3,
        h: 8,
        w: 8,
        oc: 4,
        kh: 3,
        kw: 3,
        stride: 1,
        pad: 1,
    };
    let (x_len, w_len, y_len) = (
        g.input_len().unwrap(),
        g.weight_len().unwrap(),
        g.output_len().unwrap(),
    );
    let chost = [
        rng.vec_normal(x_len),
        rng.vec_normal(w_len),
        vec![SENTINEL; y_len],
        rng.vec_normal(g.oc),
    ];
    let c0: Vec<DeviceBuffer<f32>> = chost
        .iter()
        .map(|h| s.alloc_from_host(h).unwrap())
        .collect();
    let c1: Vec<DeviceBuffer<f32>> = chost
        .iter()
        .map(|h| s1.alloc_from_host(h).unwrap())
        .collect();
    let first_algo = |dir: ConvDir| dnn.algos(dir, &g, true, 1 << 30).unwrap()[0].algo;
    let legacy = first_algo(ConvDir::Forward);
    let rank = graph_api
        .candidates(&s, ConvDir::Forward, &g, true, 1 << 30)
        .unwrap()[0]
        .rank;
    let fused = graph_api
        .fused_bias_candidates(&s, &g, true, 1 << 30)
        .unwrap()
        .first()
        .map(|c| c.rank);
    let mut algos = vec![ConvEngine::Cudnn(legacy), ConvEngine::CudnnGraph(rank)];
    algos.extend(fused.map(ConvEngine::CudnnGraphBias));
    let cnames = ["conv2d x", "conv2d w", "conv2d y", "conv2d bias"];
    for (role, name) in cnames.iter().enumerate() {
        let pick = |i: usize| if i == role { &c1[i] } else { &c0[i] };
        let io = ConvIo {
            a: pick(0),
            b: pick(1),
            out: pick(2),
            bias: Some(pick(3)),
        };
        for &algo in &algos {
            let r = conv_with(&s, &nn, algo, ConvDir::Forward, &g, io);
            assert_eq!(&refused(&format!("conv_with {algo}, {name}"), r), name);
        }
        let r = run_conv(&s, &nn, ConvDir::Forward, &g, io);
        assert_eq!(&refused(&format!("run_conv, {name}"), r), name);
        if role < 3 {
            let r = dnn.run(&s, ConvDir::Forward, legacy, &g, io.a, io.b, io.out);
            assert_eq!(&refused(&format!("Cudnn::run, {name}"), r), name);
            let r = graph_api.run(&s, ConvDir::Forward, rank, &g, io.a, io.b, io.out);
            assert_eq!(&refused(&format!("CudnnGraph::run, {name}"), r), name);
        }
        if let Some(fused) = fused {
            let r = graph_api.run_fused_bias(&s, fused, &g, io.a, io.b, pick(3), io.out);
            assert_eq!(
                &refused(&format!("CudnnGraph::run_fused_bias, {name}"), r),
                name
            );
        }
        if role >= 2 {
            let r = dnn.add_bias(&s, &g, pick(3), io.out);
            assert_eq!(&refused(&format!("Cudnn::add_bias, {name}"), r), name);
        }
    }
    // Backward directions (buffers a, b, out as `ConvIo` orders them): device 1's a or out.
    let backward = [
        (
            ConvDir::BackwardData,
            ["conv2d dy", "conv2d dx"],
            [y_len, w_len, x_len],
        ),
        (
            ConvDir::BackwardFilter,
            ["conv2d dy", "conv2d dw"],
            [y_len, x_len, w_len],
        ),
    ];
    for (dir, [a_name, out_name], lens) in backward {
        let algo = first_algo(dir);
        let bufs0: Vec<DeviceBuffer<f32>> =
            lens.iter().map(|&l| s.alloc_zeroed(l).unwrap()).collect();
        let bufs1: Vec<DeviceBuffer<f32>> =
            lens.iter().map(|&l| s1.alloc_zeroed(l).unwrap()).collect();
        for (role, name) in [(0, a_name), (2, out_name)] {
            let pick = |i: usize| if i == role { &bufs1[i] } else { &bufs0[i] };
            let io = ConvIo {
                a: pick(0),
                b: pick(1),
                out: pick(2),
                bias: None,
            };
            let r = conv_with(&s, &nn, ConvEngine::Cudnn(algo), dir, &g, io);
            assert_eq!(
                refused(&format!("conv_with {}, {name}", dir.name()), r),
                name
            );
            let r = run_conv(&s, &nn, dir, &g, io);
            assert_eq!(
                refused(&format!("run_conv {}, {name}", dir.name()), r),
                name
            );
        }
    }
    let ct =
        |q: &Stream, i: usize, shape: &[usize]| Tensor::from_host(q, &chost[i], shape).unwrap();
    let xs = [g.n, g.c, g.h, g.w];
    let ws = [g.oc, g.c, g.kh, g.kw];
    let r = conv2d(
        &s,
        &ct(&s1, 0, &xs),
        &ct(&s, 1, &ws),
        Some(&ct(&s, 3, &[g.oc])),
        1,
        1,
    );
    assert_eq!(refused("conv2d, x from device 1", r), "conv2d x");

    // Handles of device 1 on a queue of device 0, every buffer of device 0.
    let eng1 = Engines::get(&other).unwrap();
    let (a, b, c) = (&on0[0], &on0[1], &on0[2]);
    let r = eng1
        .blas()
        .unwrap()
        .gemm(&s, Trans::N, Trans::T, m, n, k, 1.0, a, b, 0.0, c);
    assert_eq!(refused("cuBLAS handle of device 1", r), "cuBLAS handle");
    let plain = LtShape {
        epilogue: Epilogue::None,
        ..shape
    };
    let r = eng1.cublaslt().expect("cuBLASLt on device 1").matmul(
        &s,
        &plain,
        LtAlgo::Rank(0),
        1.0,
        a,
        b,
        0.0,
        c,
        None,
    );
    assert_eq!(refused("cuBLASLt handle of device 1", r), "cuBLASLt handle");
    let (x, w, y) = (&c0[0], &c0[1], &c0[2]);
    let r = eng1
        .cudnn()
        .expect("cuDNN on device 1")
        .run(&s, ConvDir::Forward, legacy, &g, x, w, y);
    assert_eq!(refused("cuDNN handle of device 1", r), "cuDNN handle");
    let r = eng1
        .cudnn_graph()
        .expect("cuDNN's graph API on device 1")
        .run(&s, ConvDir::Forward, rank, &g, x, w, y);
    assert_eq!(
        refused("cuDNN graph API handle of device 1", r),
        "cuDNN graph API handle"
    );

    // Nothing ran: the outputs of device 0 keep their sentinel; then both devices compute.
    assert!(s.to_vec(&on0[2]).unwrap().iter().all(|&v| v == SENTINEL));
    assert!(s.to_vec(&c0[2]).unwrap().iter().all(|&v| v == SENTINEL));
    let h = |i: usize| to_f64(&host[i]);
    let want = cpu::linear(&h(0), &h(1), &h(3), m, k, n);
    for (d, q, bufs) in [(&dev, &s, &on0), (&other, &s1, &on1)] {
        let nn = Nn::get(d).unwrap();
        gemm_with(
            q,
            &nn,
            GemmEngine::Cublas,
            &op,
            &bufs[0],
            &bufs[1],
            &bufs[2],
            Some(&bufs[3]),
        )
        .unwrap();
        let e = rel_err(&q.to_vec(&bufs[2]).unwrap(), &want);
        assert!(e < 1e-5, "device {}: {e}", d.ordinal());
    }
    s.synchronize().unwrap();
    s1.synchronize().unwrap();
}
