//! GPU tests of data-parallel training. Two-GPU tests are `#[ignore]`d, so that a one-GPU
//! suite never counts them as passed; `--include-ignored` runs them (`bash bench/device.sh ddp` does,
//! on a two-GPU machine). They start with `dist::multi_gpu_or_skip(2)`: run on a machine with
//! one GPU or no NCCL they print why they skip, and fail there when `CUDAGRAPH_REQUIRE_GPUS=2`
//! (set it on the two-GPU run). One-GPU tests use the usual gate.
//! Ranks run as threads of this process (`dist::run_threads`), through the same communicator
//! and DDP code as one process per GPU.
//!
//! Tolerances: two ranks' averaged gradient sums each half batch in its own GEMM and adds the
//! halves, one rank sums the full batch in one GEMM: fp32 sums in a different order, a
//! relative difference around 1e-7 per step that the updates carry along — we allow 1e-4 on
//! the parameters after 12 steps. The two ranks of one run must agree bit for bit (they apply
//! the same averaged gradient to the same weights), and so must eager and graphed steps of
//! the same rank (the same kernels on the same data; a two-rank average adds two halves,
//! which commutes and rounds alike). Every comparison fails on a NaN or an infinity and on
//! buffers of different lengths (issue 26, item 7): NaN gradients on both ranks are not
//! "equal".

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudagraph::{gpu_test_device, CaptureOptions, Graph, Queue, QueueExt, Stream};
use cudagraph_nn::autograd::ops;
use cudagraph_nn::cpu::{rel_err, to_f64};
use cudagraph_nn::dist::{self, run_threads, DistError, DistOptions, RankContext, ReduceOp};
use cudagraph_nn::*;

const IN: usize = 32;
const HIDDEN: usize = 64;
const OUT: usize = 16;
const BATCH: usize = 64;
const STEPS: usize = 12;
const LR: f32 = 0.05;

fn model(s: &Stream) -> Sequential {
    let mut rng = HostRng::new(42);
    Sequential::new(vec![
        Layer::Linear(Linear::new(s, IN, HIDDEN, &mut rng).unwrap()),
        Layer::ReLU,
        Layer::Linear(Linear::new(s, HIDDEN, OUT, &mut rng).unwrap()),
    ])
}

/// The full batch (same on every rank; each rank takes its rows).
fn batch() -> (Vec<f32>, Vec<f32>) {
    let mut rng = HostRng::new(7);
    (rng.vec_normal(BATCH * IN), rng.vec_normal(BATCH * OUT))
}

fn params(s: &Stream, m: &Sequential) -> Vec<Vec<f32>> {
    m.parameters()
        .iter()
        .map(|p| s.to_vec(p.data().unwrap()).unwrap())
        .collect()
}

fn opts() -> DistOptions {
    DistOptions {
        timeout: Duration::from_secs(120),
        ..DistOptions::default()
    }
}

/// One training step on `q`: forward on this rank's rows, MSE (mean), DDP backward (plain
/// backward when `ddp` is `None`), SGD.
fn step(
    q: &dyn cudagraph::Fork,
    m: &Sequential,
    ddp: Option<&mut DistributedDataParallel>,
    opt: &mut Sgd,
    x: &Tensor,
    y: &Tensor,
) -> Result<Tensor> {
    opt.zero_grad(q.as_queue(), true)?;
    let loss = mse_loss(
        q.as_queue(),
        &m.forward(q.as_queue(), x)?,
        y,
        Reduction::Mean,
    )?;
    match ddp {
        Some(d) => d.backward(q, &loss)?,
        None => loss.backward(q.as_queue())?,
    }
    opt.step(q.as_queue())?;
    Ok(loss)
}

/// `STEPS` steps: `eager` of them eagerly, the rest as replays of one captured step.
fn train(
    s: &mut Stream,
    m: &Sequential,
    mut ddp: Option<&mut DistributedDataParallel>,
    x: &Tensor,
    y: &Tensor,
    eager: usize,
) -> Vec<Vec<f32>> {
    let mut opt = Sgd::new(s, m.parameters(), LR, 0.0, 0.0).unwrap();
    for _ in 0..eager {
        step(&*s, m, ddp.as_deref_mut(), &mut opt, x, y).unwrap();
    }
    if eager < STEPS {
        let (g, _loss) = Graph::capture(s, CaptureOptions::new(), |cs| {
            Ok(step(cs, m, ddp.as_deref_mut(), &mut opt, x, y)?)
        })
        .unwrap();
        for _ in eager..STEPS {
            g.replay(s).unwrap();
        }
    }
    if let Some(d) = &ddp {
        d.synchronize(s).unwrap();
    }
    params(s, m)
}

/// One rank's shard of the batch as tensors on its device.
fn shard(s: &Stream, rank: usize, world: usize) -> (Tensor, Tensor) {
    let (xs, ys) = batch();
    let rows = BATCH / world;
    let x = Tensor::from_host(
        s,
        &xs[rank * rows * IN..(rank + 1) * rows * IN],
        &[rows, IN],
    )
    .unwrap();
    let y = Tensor::from_host(
        s,
        &ys[rank * rows * OUT..(rank + 1) * rows * OUT],
        &[rows, OUT],
    )
    .unwrap();
    (x, y)
}

/// Checks that `a` and `b` can be compared value by value: the same number of buffers, each
/// of the same length, and every value of both finite. Panics naming `what` otherwise.
fn assert_comparable(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    assert_eq!(
        a.len(),
        b.len(),
        "{what}: {} buffers against {}",
        a.len(),
        b.len()
    );
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(
            x.len(),
            y.len(),
            "{what}: buffer {i} has {} values against {}",
            x.len(),
            y.len()
        );
        for (side, v) in [("first", x), ("second", y)] {
            if let Some(j) = v.iter().position(|f| !f.is_finite()) {
                panic!("{what}: buffer {i} of the {side} has {} at {j}", v[j]);
            }
        }
    }
}

/// Fails unless `a` and `b` are comparable (see [`assert_comparable`]) and equal bit for bit.
fn assert_bit_identical(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    assert_comparable(a, b, what);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if let Some(j) = x
            .iter()
            .zip(y)
            .position(|(p, q)| p.to_bits() != q.to_bits())
        {
            panic!(
                "{what}: buffer {i} differs first at {j}: {:e} against {:e}",
                x[j], y[j]
            );
        }
    }
}

/// The largest relative difference (`rel_err`) of a buffer of `got` to its `want`, after
/// checking that they are comparable (see [`assert_comparable`]).
fn worst_rel_err(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) -> f64 {
    assert_comparable(got, want, what);
    got.iter()
        .zip(want)
        .map(|(g, w)| rel_err(g, &to_f64(w)))
        .fold(0.0, f64::max)
}

/// The largest absolute difference of two comparable sets of buffers.
fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) -> f32 {
    assert_comparable(a, b, what);
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The comparisons themselves can fail: on a NaN (on one side or both), an infinity, a
/// buffer of another length, a missing buffer, or one differing bit.
#[test]
fn comparisons_fail_on_nan_infinity_lengths_and_single_bits() {
    let fails = |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
    let ok = vec![vec![1.0f32, -2.0], vec![3.0]];
    assert_bit_identical(&ok, &ok.clone(), "same");
    assert_eq!(worst_rel_err(&ok, &ok, "same"), 0.0);
    let nan = vec![vec![1.0f32, f32::NAN], vec![3.0]];
    assert!(fails(&|| assert_bit_identical(&nan, &nan, "NaN on both")));
    assert!(fails(&|| assert_bit_identical(&ok, &nan, "NaN on one")));
    assert!(fails(&|| {
        worst_rel_err(&nan, &nan, "NaN on both");
    }));
    assert!(fails(&|| {
        max_abs_diff(&nan, &nan, "NaN on both");
    }));
    let inf = vec![vec![1.0f32, f32::INFINITY], vec![3.0]];
    assert!(fails(&|| assert_bit_identical(&inf, &inf, "infinity")));
    let short = vec![vec![1.0f32], vec![3.0]];
    assert!(fails(&|| assert_bit_identical(
        &ok,
        &short,
        "shorter buffer"
    )));
    assert!(fails(&|| {
        worst_rel_err(&ok, &short, "shorter buffer");
    }));
    assert!(fails(&|| assert_bit_identical(
        &ok,
        &ok[..1],
        "a buffer fewer"
    )));
    let ulp = vec![
        vec![1.0f32, f32::from_bits((-2.0f32).to_bits() + 1)],
        vec![3.0],
    ];
    assert!(fails(&|| assert_bit_identical(&ok, &ulp, "one bit")));
    let neg_zero = vec![vec![-0.0f32]];
    assert!(fails(&|| assert_bit_identical(
        &[vec![0.0f32]],
        &neg_zero,
        "signed zero"
    )));
}

#[test]
#[ignore = "needs 2 GPUs and NCCL: run with --include-ignored (bash bench/device.sh ddp)"]
fn two_rank_graphed_training_matches_one_rank_on_the_full_batch() {
    if !dist::multi_gpu_or_skip(2) {
        return;
    }
    // The reference: one GPU, no communicator, the whole batch, every step graphed.
    let reference = {
        let dev = cudagraph::Device::open(0).unwrap();
        let mut s = dev.new_stream().unwrap();
        let m = model(&s);
        let (x, y) = shard(&s, 0, 1);
        train(&mut s, &m, None, &x, &y, 0)
    };
    // Two ranks, half the batch each; two eager steps (NCCL connects), then graphed.
    let ranks = run_threads(&[0, 1], &opts(), |ctx: RankContext| {
        let mut s = ctx.device.new_stream()?;
        let m = model(&s);
        let mut ddp =
            DistributedDataParallel::new(&s, &ctx.comm, m.parameters(), DdpOptions::default())?;
        assert_eq!(
            ddp.buckets().len(),
            1,
            "four small parameters share one bucket"
        );
        let (x, y) = shard(&s, ctx.rank, ctx.world_size);
        Ok(train(&mut s, &m, Some(&mut ddp), &x, &y, 2))
    })
    .unwrap();
    assert_bit_identical(&ranks[0], &ranks[1], "the ranks' parameters after training");
    assert_comparable(&ranks[0], &reference, "two ranks against one");
    for (i, (got, want)) in ranks[0].iter().zip(&reference).enumerate() {
        let e = rel_err(got, &to_f64(want));
        println!("parameter {i}: relative difference to one rank {e:.2e}");
        assert!(e < 1e-4, "parameter {i}: {e}");
    }
    // And training moved the weights (the comparison is not between two initialisations).
    let init = {
        let dev = cudagraph::Device::open(0).unwrap();
        let s = dev.new_stream().unwrap();
        params(&s, &model(&s))
    };
    assert!(max_abs_diff(&reference, &init, "trained against initial") > 1e-3);
}

#[test]
#[ignore = "needs 2 GPUs and NCCL: run with --include-ignored (bash bench/device.sh ddp)"]
fn ddp_eager_and_graphed_steps_agree_on_every_rank() {
    if !dist::multi_gpu_or_skip(2) {
        return;
    }
    let runs = run_threads(&[0, 1], &opts(), |ctx: RankContext| {
        let mut s = ctx.device.new_stream()?;
        let (x, y) = shard(&s, ctx.rank, ctx.world_size);
        let run = |s: &mut Stream, eager: usize| -> Result<Vec<Vec<f32>>> {
            let m = model(s);
            let mut ddp =
                DistributedDataParallel::new(s, &ctx.comm, m.parameters(), DdpOptions::default())?;
            Ok(train(s, &m, Some(&mut ddp), &x, &y, eager))
        };
        let eager = run(&mut s, STEPS)?;
        let graphed = run(&mut s, 1)?;
        Ok((eager, graphed))
    })
    .unwrap();
    for (rank, (eager, graphed)) in runs.iter().enumerate() {
        println!(
            "rank {rank}: eager vs graphed relative difference {:.2e}",
            worst_rel_err(graphed, eager, "eager vs graphed")
        );
        assert_bit_identical(graphed, eager, &format!("rank {rank}: graphed vs eager"));
    }
    assert_bit_identical(&runs[0].1, &runs[1].1, "rank 0 vs rank 1, graphed");
}

#[test]
#[ignore = "needs 2 GPUs and NCCL: run with --include-ignored (bash bench/device.sh ddp)"]
fn a_parameter_unused_on_one_rank_is_still_averaged() {
    if !dist::multi_gpu_or_skip(2) {
        return;
    }
    // Rank 0 uses both layers, rank 1 only the first: the second layer's bucket is reduced
    // with zeros from rank 1, and both ranks end with the same gradients.
    let grads = run_threads(&[0, 1], &opts(), |ctx: RankContext| {
        let s = ctx.device.new_stream()?;
        let mut rng = HostRng::new(3);
        let a = Linear::new(&s, 8, 8, &mut rng)?;
        let b = Linear::new(&s, 8, 8, &mut rng)?;
        let mut all = a.parameters();
        all.extend(b.parameters());
        // A tiny cap: every parameter has its own bucket, reduced in place.
        let opts = DdpOptions {
            bucket_cap_bytes: 1,
            ..DdpOptions::default()
        };
        let mut ddp = DistributedDataParallel::new(&s, &ctx.comm, all.clone(), opts)?;
        let x = Tensor::from_host(
            &s,
            &HostRng::new(9 + ctx.rank as u64).vec_normal(4 * 8),
            &[4, 8],
        )?;
        let mut h = a.forward(&s, &x)?;
        if ctx.rank == 0 {
            h = b.forward(&s, &h)?;
        }
        let t = Tensor::zeros(&s, &[4, 8])?;
        for p in &all {
            p.zero_grad(&s, true)?;
        }
        let loss = mse_loss(&s, &h, &t, Reduction::Sum)?;
        ddp.backward(&s, &loss)?;
        ddp.synchronize(&s)?;
        Ok(all
            .iter()
            .map(|p| {
                s.to_vec(
                    p.grad()
                        .unwrap()
                        .expect("every parameter has a gradient")
                        .as_ref(),
                )
            })
            .collect::<std::result::Result<Vec<_>, _>>()?)
    })
    .unwrap();
    assert_bit_identical(&grads[0], &grads[1], "the ranks' averaged gradients");
    let b_weight = &grads[1][2];
    assert!(
        b_weight.iter().any(|&v| v != 0.0),
        "rank 1 got rank 0's half"
    );
}

#[test]
#[ignore = "needs 2 GPUs and NCCL: run with --include-ignored (bash bench/device.sh ddp)"]
fn collectives_run_eagerly_and_inside_a_graph() {
    if !dist::multi_gpu_or_skip(2) {
        return;
    }
    run_threads(&[0, 1], &opts(), |ctx: RankContext| {
        let r = ctx.rank as f32;
        let mut s = ctx.device.new_stream()?;
        let c = &ctx.comm;
        // SAFETY (every raw collective below): both ranks run this same closure, so they
        // make the same calls in the same order with buffers of the same lengths and types.
        let x = s.alloc_from_host(&[r + 1.0; 1000])?;
        unsafe { c.all_reduce(&s, &x, ReduceOp::Sum)? };
        c.synchronize(&s)?;
        assert!(s.to_vec(&x)?.iter().all(|&v| v == 3.0));
        unsafe { c.all_reduce(&s, &x, ReduceOp::Avg)? };
        let m = s.alloc_from_host(&[ctx.rank as i64 * 10 - 5, 7])?;
        unsafe { c.all_reduce(&s, &m, ReduceOp::Max)? };
        let b = s.alloc_from_host(&[r; 3])?;
        unsafe { c.broadcast(&s, &b, 1)? };
        c.synchronize(&s)?;
        assert!(s.to_vec(&x)?.iter().all(|&v| v == 3.0));
        assert_eq!(s.to_vec(&m)?, vec![5, 7]);
        assert_eq!(s.to_vec(&b)?, vec![1.0; 3]);
        // Captured: each replay doubles the (equal) values on both ranks.
        let ones = s.alloc_from_host(&[1.0f32; 4096])?;
        let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            // SAFETY: as above; both ranks replay their graphs the same number of times.
            unsafe { c.all_reduce(cs, &ones, ReduceOp::Sum)? };
            Ok(())
        })?;
        for k in 1..=3 {
            g.replay(&s)?;
            c.synchronize(&s)?;
            let want = (1u32 << k) as f32;
            assert!(s.to_vec(&ones)?.iter().all(|&v| v == want), "replay {k}");
        }
        // SAFETY: refused before anything reaches NCCL (the root is outside the world).
        let outside = unsafe { c.broadcast(&s, &b, 2) };
        assert!(
            matches!(outside, Err(NnError::Dist(DistError::Usage(_)))),
            "root outside the world: {outside:?}"
        );
        Ok(())
    })
    .unwrap();
}

/// (issue 26, item 5) The safe collectives: `all_agree` answers alike on every rank, also
/// when the ranks pass slices of different lengths (then the values' step is skipped on
/// every rank, so the next call still pairs up), and `barrier` waits for every rank but
/// refuses to pass for another rank's `all_agree`.
#[test]
#[ignore = "needs 2 GPUs and NCCL: run with --include-ignored (bash bench/device.sh ddp)"]
fn all_agree_answers_alike_on_every_rank_and_barriers_pair_up() {
    if !dist::multi_gpu_or_skip(2) {
        return;
    }
    let answers = run_threads(&[0, 1], &opts(), |ctx: RankContext| {
        let s = ctx.device.new_stream()?;
        let c = &ctx.comm;
        let r = ctx.rank as i64;
        let mut got = vec![
            c.all_agree(&s, &[1, 2, 3])?,
            c.all_agree(&s, &[1, 2, r])?,
            c.all_agree(&s, &[i64::MIN + r * i64::MAX])?, // MIN against -1
            c.all_agree(&s, &vec![5; 1 + ctx.rank])?,     // lengths 1 and 2
            c.all_agree(&s, &[])?,
        ];
        c.barrier(&s)?;
        // Still in step after the length mismatch: this pairs with the other rank's.
        got.push(c.all_agree(&s, &[9, 9])?);
        // A barrier meets the other rank's non-empty `all_agree`.
        let last = if ctx.rank == 0 {
            match c.barrier(&s) {
                Err(NnError::Dist(DistError::Mismatch(_))) => "mismatch".to_string(),
                other => format!("{other:?}"),
            }
        } else {
            format!("{:?}", c.all_agree(&s, &[1]))
        };
        Ok((got, last))
    })
    .unwrap();
    for (rank, (got, _)) in answers.iter().enumerate() {
        assert_eq!(
            got,
            &vec![true, false, false, false, true, true],
            "rank {rank}"
        );
    }
    assert_eq!(answers[0].1, "mismatch");
    // Rank 1 sees the disagreement, or — when rank 0's abort comes first — that abort.
    assert!(
        answers[1].1 == "Ok(false)" || answers[1].1.contains("PeerFailed"),
        "{}",
        answers[1].1
    );
}

/// (issue 26, item 5) Every way two ranks' DDP wrappers can differ in what decides their
/// collectives — the number of parameters, their shapes (even at equal sizes), the bucket cap,
/// whether `new` broadcasts — is refused on both ranks with `DistError::Mismatch` before any
/// collective whose size depends on it. (Before the check covered `broadcast_parameters`, a
/// rank that did not broadcast went on while the other waited in a broadcast of its own.)
#[test]
#[ignore = "needs 2 GPUs and NCCL: run with --include-ignored (bash bench/device.sh ddp)"]
fn ddp_refuses_ranks_whose_layouts_or_options_differ() {
    if !dist::multi_gpu_or_skip(2) {
        return;
    }
    type Setup = fn(&Stream, usize) -> Result<(Vec<Parameter>, DdpOptions)>;
    let cases: [(&str, Setup); 4] = [
        ("a parameter fewer on rank 1", |s, rank| {
            let mut p = vec![
                Parameter::from_host(s, "w", &[0.5; 6], &[2, 3])?,
                Parameter::from_host(s, "b", &[0.5; 2], &[2])?,
            ];
            p.truncate(2 - rank);
            Ok((p, DdpOptions::default()))
        }),
        ("the same sizes in other shapes", |s, rank| {
            let shape: &[usize] = if rank == 0 { &[2, 3] } else { &[3, 2] };
            Ok((
                vec![Parameter::from_host(s, "w", &[0.5; 6], shape)?],
                DdpOptions::default(),
            ))
        }),
        ("another bucket cap", |s, rank| {
            Ok((
                vec![Parameter::from_host(s, "w", &[0.5; 6], &[2, 3])?],
                DdpOptions {
                    bucket_cap_bytes: 1 + rank,
                    ..DdpOptions::default()
                },
            ))
        }),
        ("rank 1 does not broadcast", |s, rank| {
            Ok((
                vec![Parameter::from_host(s, "w", &[0.5; 6], &[2, 3])?],
                DdpOptions {
                    broadcast_parameters: rank == 0,
                    ..DdpOptions::default()
                },
            ))
        }),
    ];
    let short = DistOptions {
        timeout: Duration::from_secs(30),
        ..DistOptions::default()
    };
    for (what, setup) in cases {
        let outcomes = run_threads(&[0, 1], &short, |ctx: RankContext| {
            let s = ctx.device.new_stream()?;
            let (params, o) = setup(&s, ctx.rank)?;
            Ok(
                match DistributedDataParallel::new(&s, &ctx.comm, params, o) {
                    Err(NnError::Dist(DistError::Mismatch(m))) => {
                        format!("mismatch (aborted: {}): {m}", ctx.comm.is_aborted())
                    }
                    // The other rank found the disagreement first and aborted the
                    // communicator: this rank hears it as that rank's failure.
                    Err(NnError::Dist(DistError::PeerFailed(m)))
                        if m.contains("ranks disagree") =>
                    {
                        format!("mismatch (aborted: {}): {m}", ctx.comm.is_aborted())
                    }
                    other => format!("{other:?}"),
                },
            )
        })
        .unwrap();
        for (rank, o) in outcomes.iter().enumerate() {
            assert!(
                o.starts_with("mismatch (aborted: true): "),
                "{what}, rank {rank}: {o}"
            );
        }
    }
}

#[test]
#[ignore = "needs 2 GPUs and NCCL: run with --include-ignored (bash bench/device.sh ddp)"]
fn ddp_checks_that_ranks_wrap_the_same_parameters() {
    if !dist::multi_gpu_or_skip(2) {
        return;
    }
    let r = run_threads(&[0, 1], &opts(), |ctx: RankContext| {
        let s = ctx.device.new_stream()?;
        let mut rng = HostRng::new(1);
        let width = 8 + ctx.rank; // rank 1 built another model
        let l = Linear::new(&s, width, 4, &mut rng)?;
        DistributedDataParallel::new(&s, &ctx.comm, l.parameters(), DdpOptions::default())?;
        Ok(())
    });
    let e = r.unwrap_err();
    assert!(matches!(&e, NnError::Dist(DistError::Mismatch(_))), "{e:?}");
    assert!(e.to_string().contains("ranks disagree"), "{e}");
}

#[test]
fn backward_hook_reports_each_parameter_once_as_soon_as_its_gradient_is_complete() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let m = model(&s);
    let (x, y) = shard(&s, 0, 1);
    let ps = m.parameters();
    // Plain backward for the reference gradients.
    let loss = mse_loss(&s, &m.forward(&s, &x).unwrap(), &y, Reduction::Mean).unwrap();
    loss.backward(&s).unwrap();
    let want: Vec<Vec<f32>> = ps
        .iter()
        .map(|p| s.to_vec(p.grad().unwrap().unwrap().as_ref()).unwrap())
        .collect();
    for p in &ps {
        p.zero_grad(&s, true).unwrap();
    }
    let loss = mse_loss(&s, &m.forward(&s, &x).unwrap(), &y, Reduction::Mean).unwrap();
    let seen: Arc<Mutex<Vec<usize>>> = Arc::default();
    let seed = Tensor::full(&s, &[1], 1.0).unwrap();
    loss.backward_with_hook(&s, seed, &mut |_q: &dyn Queue, p: &Parameter| {
        let i = ps
            .iter()
            .position(|q| q.same_as(p))
            .expect("one of the model's");
        assert!(
            p.grad().unwrap().is_some(),
            "reported before its gradient exists"
        );
        seen.lock().unwrap().push(i);
        Ok(())
    })
    .unwrap();
    let order = seen.lock().unwrap().clone();
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        vec![0, 1, 2, 3],
        "each parameter exactly once: {order:?}"
    );
    // The last layer's parameters are complete before the first layer's.
    let pos = |i: usize| order.iter().position(|&j| j == i).unwrap();
    assert!(pos(2) < pos(0) && pos(3) < pos(1), "{order:?}");
    for (p, w) in ps.iter().zip(&want) {
        assert_eq!(&s.to_vec(p.grad().unwrap().unwrap().as_ref()).unwrap(), w);
    }

    // A weight used twice (two leaves of one parameter): reported once, after both uses.
    let w = Linear::new(&s, 8, 8, &mut HostRng::new(5)).unwrap().weight;
    let x = Tensor::from_host(&s, &HostRng::new(6).vec_normal(16), &[2, 8]).unwrap();
    let out = ops::linear(
        &s,
        &ops::linear(&s, &x, &w.tensor(), None, false).unwrap(),
        &w.tensor(),
        None,
        false,
    )
    .unwrap();
    let t = Tensor::zeros(&s, &[2, 8]).unwrap();
    mse_loss(&s, &out, &t, Reduction::Sum)
        .unwrap()
        .backward(&s)
        .unwrap();
    let want = s.to_vec(w.grad().unwrap().unwrap().as_ref()).unwrap();
    w.zero_grad(&s, true).unwrap();
    let out = ops::linear(
        &s,
        &ops::linear(&s, &x, &w.tensor(), None, false).unwrap(),
        &w.tensor(),
        None,
        false,
    )
    .unwrap();
    let loss = mse_loss(&s, &out, &t, Reduction::Sum).unwrap();
    let mut calls = 0;
    let seed = Tensor::full(&s, &[1], 1.0).unwrap();
    loss.backward_with_hook(&s, seed, &mut |_q: &dyn Queue, p: &Parameter| {
        calls += 1;
        assert!(p.same_as(&w));
        Ok(())
    })
    .unwrap();
    assert_eq!(calls, 1);
    assert_eq!(s.to_vec(w.grad().unwrap().unwrap().as_ref()).unwrap(), want);
}

#[test]
fn one_rank_communicator_works_eagerly_and_captured() {
    let dev = gpu_test_device!();
    // Under CUDAGRAPH_REQUIRE_GPU=1 a missing NCCL fails here instead of skipping.
    if !dist::nccl_or_skip() {
        return;
    }
    let comm = Communicator::init(&dev, &dist::DistEnv::single(), &opts()).unwrap();
    assert_eq!((comm.rank(), comm.world_size()), (0, 1));
    let mut s = dev.new_stream().unwrap();
    let x = s.alloc_from_host(&[2.5f32; 100]).unwrap();
    let y = s.alloc_from_host(&[0.0f32; 100]).unwrap();
    // SAFETY: a world of one rank: there is no peer whose call could differ.
    unsafe { comm.all_reduce(&s, &x, ReduceOp::Sum) }.unwrap();
    // (A one-rank in-place sum enqueues nothing; the copy keeps the capture non-empty.)
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        // SAFETY: as above.
        unsafe { comm.all_reduce(cs, &x, ReduceOp::Avg)? };
        cs.copy(&x, &y)
    })
    .unwrap();
    assert!(comm.all_agree(&s, &[1, 2, 3]).unwrap());
    comm.barrier(&s).unwrap();
    g.replay(&s).unwrap();
    comm.synchronize(&s).unwrap();
    assert!(s.to_vec(&x).unwrap().iter().all(|&v| v == 2.5));
    assert!(s.to_vec(&y).unwrap().iter().all(|&v| v == 2.5));
    // A DDP of one rank is plain training.
    let m = model(&s);
    let mut ddp =
        DistributedDataParallel::new(&s, &comm, m.parameters(), DdpOptions::default()).unwrap();
    let (x, y) = shard(&s, 0, 1);
    let loss = mse_loss(&s, &m.forward(&s, &x).unwrap(), &y, Reduction::Mean).unwrap();
    ddp.backward(&s, &loss).unwrap();
    assert!(m.parameters().iter().all(|p| p.grad().unwrap().is_some()));
    drop(g); // graphs that captured the communicator go before it
}
