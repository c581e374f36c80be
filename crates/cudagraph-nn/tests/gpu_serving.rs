//! GPU tests of serving (issue 26, item 7): `ModelRunner` through a graph cache and eagerly,
//! and a `Batcher` in front of it. Every request has data of its own (fresh random rows), and
//! every answer is compared with an eager run of that same request, so an answer computed
//! from another request's rows, or from rows a previous request left in the static input,
//! cannot pass.
//!
//! Tolerances: where the same batch size runs (an exact bucket, an eager batch of the
//! request's rows, or a padded bucket compared with an eager run of the same padded size) the
//! same kernels run on the same rows, so the answer must be bit-identical; rows are
//! independent in this model (Linear/ReLU), so padding rows do not change the others. Across
//! batch sizes (a request answered as part of a larger batch) the GEMM may tile differently:
//! relative L2 error at most 1e-5 (fp32, K ≤ 64).

use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::Duration;

use cudagraph::{
    gpu_test_device, BatchModel, BucketPolicy, CacheOptions, Device, Error, Selection, Stream,
};
use cudagraph_nn::cpu::{rel_err, to_f64};
use cudagraph_nn::serving::{BatchRunner, Batcher, BatcherConfig, ModelRunner, ServeError};
use cudagraph_nn::*;

const IN: usize = 48;
const OUT: usize = 10;
const MAX: usize = 32;
/// Across batch sizes (see the module docs).
const TOLERANCE: f64 = 1e-5;

/// Linear(48, 64) → ReLU → Linear(64, 64) → ReLU → Linear(64, 10).
fn model(s: &Stream, seed: u64) -> Sequential {
    let mut rng = HostRng::new(seed);
    Sequential::new(vec![
        Layer::Linear(Linear::new(s, IN, 64, &mut rng).unwrap()),
        Layer::ReLU,
        Layer::Linear(Linear::new(s, 64, 64, &mut rng).unwrap()),
        Layer::ReLU,
        Layer::Linear(Linear::new(s, 64, OUT, &mut rng).unwrap()),
    ])
}

/// The eager forward pass of `rows` rows, on a stream of its own.
fn eager(dev: &Device, model: &Sequential, input: &[f32], rows: usize) -> Vec<f32> {
    let s = dev.new_stream().unwrap();
    let batched = Batched {
        module: model.clone(),
        row_shape: vec![IN],
        output_row: OUT,
    };
    let x = s.alloc_from_host(input).unwrap();
    let y = batched.forward(&s, &x, rows).unwrap();
    s.to_vec(&y).unwrap()
}

/// The eager forward pass of the request padded with zero rows to `size` rows: what a graph
/// of that bucket computes for the request's rows.
fn eager_padded(
    dev: &Device,
    model: &Sequential,
    input: &[f32],
    rows: usize,
    size: usize,
) -> Vec<f32> {
    let mut padded = input.to_vec();
    padded.resize(size * IN, 0.0);
    let mut out = eager(dev, model, &padded, size);
    out.truncate(rows * OUT);
    out
}

fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: not bit-identical at {i} (row {}): {} vs {}",
            i / OUT,
            got[i],
            want[i]
        );
    }
}

/// Request sizes: the largest first, so smaller ones find its rows in the static input;
/// exact buckets, padded ones, one size above every bucket (eager fallback), repeats.
const SIZES: [usize; 16] = [32, 3, 1, 8, 5, 17, 24, 2, 31, 7, 40, 32, 1, 13, 3, 24];

/// One request: its rows and their data (distinct for every request).
fn requests(seed: u64) -> Vec<(usize, Vec<f32>)> {
    let mut rng = HostRng::new(seed);
    SIZES
        .iter()
        .map(|&rows| (rows, rng.vec_normal(rows * IN)))
        .collect()
}

/// A request for the batcher test: rows, data, the eager answer.
type Request = (usize, Vec<f32>, Vec<f32>);

fn bucket_for(sizes: &[usize], rows: usize) -> Option<usize> {
    sizes.iter().copied().filter(|&b| b >= rows).min()
}

/// Serves every request through `runner` and checks it against eager runs of that request.
/// Returns how many were served by a graph.
fn check_runner(dev: &Device, model: &Sequential, runner: &mut ModelRunner, seed: u64) -> usize {
    let buckets: Vec<usize> = match runner.cache() {
        Some(c) => c.entries().iter().map(|e| e.size).collect(),
        None => Vec::new(),
    };
    let mut graphed = 0;
    for (i, (rows, input)) in requests(seed).into_iter().enumerate() {
        let what = format!("request {i} ({rows} rows)");
        let out = runner.run_rows(&input, rows).unwrap();
        assert_eq!(out.output.len(), rows * OUT, "{what}");
        let exact = eager(dev, model, &input, rows);
        let e = rel_err(&out.output, &to_f64(&exact));
        assert!(e <= TOLERANCE, "{what}: {e:.3e} from eager");
        if out.graphed {
            graphed += 1;
            let size = rows + out.padded_rows;
            assert_eq!(Some(size), bucket_for(&buckets, rows), "{what}: its bucket");
            let same = eager_padded(dev, model, &input, rows, size);
            assert_bits_eq(&out.output, &same, &format!("{what}, graph of {size}"));
        } else {
            assert_eq!(out.padded_rows, 0, "{what}: eager runs pad nothing");
            assert_bits_eq(&out.output, &exact, &format!("{what}, eager"));
        }
    }
    graphed
}

#[test]
fn model_runner_with_graphs_answers_every_request_like_eager_on_its_own_rows() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let m = model(&s, 1);
    s.synchronize().unwrap();
    let policy = BucketPolicy::Steps8 { max: MAX };
    let options = CacheOptions {
        selection: Selection::Graph,
        ..CacheOptions::default()
    };
    let mut runner = ModelRunner::with_cache_options(
        dev.new_stream().unwrap(),
        m.clone(),
        vec![IN],
        OUT,
        Some(policy.clone()),
        options,
    )
    .unwrap();
    assert_eq!(
        runner.cache().unwrap().entries().len(),
        policy.sizes().len(),
        "every bucket captured up front"
    );
    let graphed = check_runner(&dev, &m, &mut runner, 2);
    // Every request but the one above the largest bucket ran a graph.
    let above = SIZES.iter().filter(|&&r| r > MAX).count();
    assert_eq!(graphed, SIZES.len() - above);
    let st = *runner.cache().unwrap().stats();
    assert_eq!(st.requests, SIZES.len() as u64);
    assert_eq!(st.fallbacks, above as u64);
}

#[test]
fn model_runner_measuring_graph_against_eager_answers_like_eager() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let m = model(&s, 3);
    s.synchronize().unwrap();
    // `new` picks graph or eager per bucket by timing: either way, the same answers.
    let mut runner = ModelRunner::new(
        dev.new_stream().unwrap(),
        m.clone(),
        vec![IN],
        OUT,
        Some(BucketPolicy::PowersOfTwo { max: MAX }),
    )
    .unwrap();
    let graphed = check_runner(&dev, &m, &mut runner, 4);
    println!("{graphed} of {} requests ran a graph", SIZES.len());
    assert!(runner.memory().unwrap().graph_pool_reserved > 0);
}

#[test]
fn model_runner_eager_answers_every_request_bit_for_bit() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let m = model(&s, 5);
    s.synchronize().unwrap();
    let mut runner =
        ModelRunner::new(dev.new_stream().unwrap(), m.clone(), vec![IN], OUT, None).unwrap();
    assert!(runner.cache().is_none());
    assert_eq!(check_runner(&dev, &m, &mut runner, 6), 0);
    assert_eq!(runner.memory().unwrap().graph_pool_reserved, 0);
}

#[test]
fn a_batcher_over_a_model_runner_answers_concurrent_requests_with_their_own_rows() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let m = model(&s, 7);
    s.synchronize().unwrap();
    // 4 threads × 25 requests of 1 to 12 rows, each with its own data and eager answer.
    let mut rng = HostRng::new(8);
    let work: Vec<Vec<Request>> = (0..4)
        .map(|t| {
            (0..25)
                .map(|k| {
                    let rows = 1 + (t * 5 + k * 7) % 12;
                    let input = rng.vec_normal(rows * IN);
                    let want = eager(&dev, &m, &input, rows);
                    (rows, input, want)
                })
                .collect()
        })
        .collect();
    let options = CacheOptions {
        selection: Selection::Graph,
        ..CacheOptions::default()
    };
    let runner = ModelRunner::with_cache_options(
        dev.new_stream().unwrap(),
        m,
        vec![IN],
        OUT,
        Some(BucketPolicy::Steps8 { max: MAX }),
        options,
    )
    .unwrap();
    let b = Arc::new(
        Batcher::start(
            runner,
            BatcherConfig {
                max_batch_rows: MAX,
                max_wait: Duration::from_millis(2),
                queue_capacity: 1024,
            },
        )
        .unwrap(),
    );
    let threads: Vec<_> = work
        .into_iter()
        .enumerate()
        .map(|(t, reqs)| {
            let b = b.clone();
            std::thread::spawn(move || {
                let pending: Vec<_> = reqs
                    .into_iter()
                    .map(|(rows, input, want)| {
                        let (tx, rx) = channel();
                        b.submit(
                            input,
                            rows,
                            Box::new(move |r| {
                                let _ = tx.send(r);
                            }),
                        );
                        (rows, want, rx)
                    })
                    .collect();
                for (k, (rows, want, rx)) in pending.into_iter().enumerate() {
                    let got = rx
                        .recv_timeout(Duration::from_secs(60))
                        .expect("answered")
                        .expect("served");
                    let e = rel_err(&got, &to_f64(&want));
                    assert!(
                        e <= TOLERANCE,
                        "thread {t} request {k} ({rows} rows): {e:.3e} from its eager answer"
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let metrics = b.metrics();
    assert_eq!((metrics.requests, metrics.errors), (100, 0));
    assert!(metrics.graphed_batches > 0);
    b.shutdown();
}

#[test]
fn model_runner_refuses_misuse_with_typed_errors_and_keeps_serving() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let m = model(&s, 9);
    s.synchronize().unwrap();
    let mut rng = HostRng::new(10);
    for graphs in [true, false] {
        let mut runner = ModelRunner::new(
            dev.new_stream().unwrap(),
            m.clone(),
            vec![IN],
            OUT,
            graphs.then_some(BucketPolicy::PowersOfTwo { max: 8 }),
        )
        .unwrap();
        for (input_len, rows, what) in [
            (2 * (IN + 1), 2, "rows one value too wide"),
            (2 * IN - 2, 2, "rows two values short in all"),
            (2 * IN + 1, 2, "one value too many"),
            (2 * IN, 3, "more rows than the data holds"),
            (4 * IN, 2, "fewer rows than the data holds"),
            (0, 0, "no rows"),
            (IN, 0, "zero rows with data"),
        ] {
            let input = rng.vec_normal(input_len);
            match runner.run_rows(&input, rows) {
                Err(NnError::Core(Error::SizeMismatch { expected, got, .. })) => {
                    assert_eq!(
                        (expected, got),
                        if rows == 0 {
                            (1, 0)
                        } else {
                            (rows * IN, input_len)
                        },
                        "{what} (graphs {graphs})"
                    );
                }
                other => panic!("{what} (graphs {graphs}): expected SizeMismatch, got {other:?}"),
            }
        }
        // Nothing ran: the next request is answered as if nothing had happened.
        let input = rng.vec_normal(3 * IN);
        let out = runner.run_rows(&input, 3).unwrap();
        let want = match out.graphed {
            true => eager_padded(&dev, &m, &input, 3, 3 + out.padded_rows),
            false => eager(&dev, &m, &input, 3),
        };
        assert_bits_eq(
            &out.output,
            &want,
            &format!("after misuse (graphs {graphs})"),
        );
    }
    // Through a batcher: requests over its limits never reach the runner.
    let runner = ModelRunner::new(
        dev.new_stream().unwrap(),
        m.clone(),
        vec![IN],
        OUT,
        Some(BucketPolicy::PowersOfTwo { max: 8 }),
    )
    .unwrap();
    let b = Batcher::start(
        runner,
        BatcherConfig {
            max_batch_rows: 8,
            ..BatcherConfig::default()
        },
    )
    .unwrap();
    let ask = |input: Vec<f32>, rows: usize| {
        let (tx, rx) = channel();
        b.submit(input, rows, Box::new(move |r| tx.send(r).unwrap()));
        rx.recv_timeout(Duration::from_secs(60)).unwrap()
    };
    assert_eq!(
        ask(vec![0.5; 9 * IN], 9),
        Err(ServeError::TooManyRows { rows: 9, max: 8 })
    );
    assert!(matches!(
        ask(vec![0.5; 2 * IN + 2], 2),
        Err(ServeError::RowWidth { expected: IN, .. })
    ));
    assert_eq!(ask(Vec::new(), 0), Err(ServeError::Empty));
    let mut nan = vec![0.5; 2 * IN];
    nan[IN + 3] = f32::NAN;
    assert!(matches!(
        ask(nan, 2),
        Err(ServeError::NonFinite {
            row: 1,
            column: 3,
            ..
        })
    ));
    // Request bodies over the limits are refused while parsing.
    let row = format!("[{}]", vec!["0.5"; IN].join(","));
    let nine = format!("{{\"inputs\": [{}]}}", [row.as_str(); 9].join(","));
    assert_eq!(
        b.parse_request(nine.as_bytes()),
        Err(ServeError::RowLimit { max: 8 })
    );
    let wide = format!("{{\"inputs\": [[{}]]}}", vec!["0.5"; IN + 1].join(","));
    assert_eq!(
        b.parse_request(wide.as_bytes()),
        Err(ServeError::RowTooLong {
            row: 0,
            expected: IN
        })
    );
    // And a good request is served, like eager.
    let input = rng.vec_normal(5 * IN);
    let body = format!(
        "{{\"inputs\": {}}}",
        serde_json::to_string(&input.chunks(IN).collect::<Vec<_>>()).unwrap()
    );
    let parsed = b.parse_request(body.as_bytes()).unwrap();
    assert_eq!(parsed.rows, 5);
    let got = ask(parsed.values, parsed.rows).unwrap();
    let e = rel_err(&got, &to_f64(&eager(&dev, &m, &input, 5)));
    assert!(e <= TOLERANCE, "{e:.3e}");
    assert_eq!(b.metrics().requests, 1);
}

/// A runner in bf16/f16 answers like the model run eagerly under autocast with its weights
/// cast once: a padded or exact bucket runs the same kernels on the same rows (bit for bit
/// where the batch size matches; across batch sizes within 1e-2 relative L2, the 16-bit
/// output's rounding), and inputs and outputs stay f32.
#[test]
fn a_16_bit_model_runner_answers_like_the_model_under_autocast() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let m = model(&s, 11);
    s.synchronize().unwrap();
    for d in [Dtype::Bf16, Dtype::F16] {
        let mut runner = ModelRunner::with_dtype(
            dev.new_stream().unwrap(),
            m.clone(),
            (vec![IN], OUT),
            Some(BucketPolicy::PowersOfTwo { max: MAX }),
            CacheOptions {
                selection: Selection::Graph,
                ..CacheOptions::default()
            },
            d,
        )
        .unwrap();
        let reference = AutocastModule::new(&s, m.clone(), d).unwrap();
        let mut rng = HostRng::new(12);
        for rows in [1, 3, 8, 17, 32] {
            let x = rng.vec_normal(rows * IN);
            let got = runner.run_rows(&x, rows).unwrap().output;
            let xt = Tensor::from_host(&s, &x, &[rows, IN]).unwrap();
            let want = no_grad(|| reference.forward(&s, &xt))
                .unwrap()
                .to_vec(&s)
                .unwrap();
            assert_eq!(got.len(), want.len());
            let err = rel_err(&got, &to_f64(&want));
            assert!(err <= 1e-2, "{d} rows {rows}: relative error {err}");
            if rows.is_power_of_two() {
                cudagraph::testing::assert_bits_eq(&got, &want, format_args!("{d} rows {rows}"));
            }
        }
    }
}
