//! GPU tests of training steps that run on the device: k steps per graph launch from a
//! resident dataset (a WHILE node) against the same steps run eagerly and one per launch,
//! skipping non-finite optimizer steps with an IF node, and programmatic dependent launch of
//! the NN kernels against plain launches. Same kernels in the same order on the same data, so
//! every comparison is bit-for-bit.

use std::sync::Arc;

use cudagraph::{gpu_test_device, CaptureOptions, Graph, Queue, QueueExt, Stream};
use cudagraph_nn::*;

const FEATURES: usize = 16;
const ROWS: usize = 8;
const BATCHES: usize = 7;

fn mlp(s: &Stream) -> Sequential {
    let mut rng = HostRng::new(21);
    Sequential::new(vec![
        Layer::Linear(Linear::new(s, FEATURES, 32, &mut rng).unwrap()),
        Layer::ReLU,
        Layer::Linear(Linear::new(s, 32, 4, &mut rng).unwrap()),
    ])
}

fn data() -> (Vec<f32>, Vec<i32>) {
    let mut rng = HostRng::new(22);
    let n = BATCHES * ROWS;
    let images = rng.vec_normal(n * FEATURES);
    let labels = (0..n).map(|_| (rng.next_u64() % 4) as i32).collect();
    (images, labels)
}

struct Run {
    model: Sequential,
    opt: Adam,
    x: DeviceBuffer<f32>,
    y: Arc<DeviceBuffer<i32>>,
    xt: Tensor,
    batches: DeviceBatches,
}

use cudagraph::DeviceBuffer;

fn setup(s: &Stream) -> Run {
    let model = mlp(s);
    let opt = Adam::new(s, model.parameters(), 1e-2, 0.0, false).unwrap();
    let x = s.alloc_zeroed::<f32>(ROWS * FEATURES).unwrap();
    let y = Arc::new(s.alloc_zeroed::<i32>(ROWS).unwrap());
    let xt = Tensor::from_buffer(Arc::new(x.alias()), &[ROWS, FEATURES]).unwrap();
    let (images, labels) = data();
    let batches = DeviceBatches::new(s, &images, &labels, FEATURES, ROWS).unwrap();
    Run {
        model,
        opt,
        x,
        y,
        xt,
        batches,
    }
}

fn step(q: &dyn Queue, r: &mut Run) -> cudagraph_nn::Result<Tensor> {
    r.opt.zero_grad(q, true)?;
    let logits = r.model.forward(q, &r.xt)?;
    let loss = cross_entropy(q, &logits, &r.y)?;
    loss.backward(q)?;
    r.opt.step(q)?;
    Ok(loss)
}

fn weights(s: &Stream, m: &Sequential) -> Vec<Vec<f32>> {
    m.parameters()
        .iter()
        .map(|p| s.to_vec(p.data().unwrap()).unwrap())
        .collect()
}

#[test]
fn k_steps_per_launch_equal_one_step_per_launch_and_eager_steps() {
    let dev = gpu_test_device!();
    assert!(
        dev.info().driver_version >= 12040,
        "conditional nodes need a CUDA 12.4+ driver"
    );
    let mut s = dev.new_stream().unwrap();
    // Eager: BATCHES steps, each loading its batch with the same kernel.
    let mut eager = setup(&s);
    let mut eager_losses = Vec::new();
    for _ in 0..BATCHES {
        eager.batches.load_next(&s, &eager.x, &eager.y).unwrap();
        let loss = step(&s, &mut eager).unwrap();
        eager_losses.push(loss.to_vec(&s).unwrap()[0]);
    }
    assert_eq!(eager.batches.position(&s).unwrap(), BATCHES as u32);
    let want = weights(&s, &eager.model);
    for k in [1u32, 3, 16] {
        let mut r = setup(&s);
        let batches = std::mem::replace(
            &mut r.batches,
            DeviceBatches::new(&s, &data().0, &data().1, FEATURES, ROWS).unwrap(),
        );
        let (x, y) = (r.x.alias(), r.y.clone());
        cudagraph::testing::settle(&dev);
        let (g, loss) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            Ok(batches.train_steps(cs, k, &x, &y, |body| step(body, &mut r))?)
        })
        .unwrap();
        cudagraph::testing::settle(&dev);
        assert_eq!(g.info().conditionals.while_nodes, 1);
        let launches = BATCHES.div_ceil(k as usize);
        for i in 0..launches {
            g.replay(&s).unwrap();
            let done = ((i + 1) * k as usize).min(BATCHES);
            assert_eq!(batches.position(&s).unwrap(), done as u32, "k={k}");
            assert_eq!(loss.to_vec(&s).unwrap()[0], eager_losses[done - 1], "k={k}");
        }
        // The epoch is over: another launch runs no step.
        g.replay(&s).unwrap();
        assert_eq!(weights(&s, &r.model), want, "k={k}");
        // Next epoch: rewind and the loop runs again.
        batches.rewind(&s).unwrap();
        g.replay(&s).unwrap();
        assert_eq!(
            batches.position(&s).unwrap(),
            (k as usize).min(BATCHES) as u32
        );
    }
}

#[test]
fn an_if_node_skips_the_optimizer_step_when_anything_is_not_finite() {
    let dev = gpu_test_device!();
    assert!(
        dev.info().driver_version >= 12040,
        "conditional nodes need a CUDA 12.4+ driver"
    );
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(31);
    let xh = rng.vec_normal(4 * 8);
    let th = rng.vec_normal(4 * 3);
    let make = |s: &Stream| {
        let mut r = HostRng::new(32);
        Linear::new(s, 8, 3, &mut r).unwrap()
    };
    let x = s.alloc_from_host(&xh).unwrap();
    let xt = Tensor::from_buffer(Arc::new(x.alias()), &[4, 8]).unwrap();
    let t = Tensor::from_host(&s, &th, &[4, 3]).unwrap();
    // The reference: the same step eagerly, always taken.
    let reference = make(&s);
    let mut ref_opt = Sgd::new(&s, reference.parameters(), 0.1, 0.9, 0.0).unwrap();
    let ref_step = |s: &Stream, opt: &mut Sgd| {
        opt.zero_grad(s, true).unwrap();
        let loss = mse_loss(s, &reference.forward(s, &xt).unwrap(), &t, Reduction::Sum).unwrap();
        loss.backward(s).unwrap();
        opt.step(s).unwrap();
    };
    let model = make(&s);
    let mut opt = Sgd::new(&s, model.parameters(), 0.1, 0.9, 0.0).unwrap();
    let (g, flag) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        opt.zero_grad(cs, true)?;
        let loss = mse_loss(cs, &model.forward(cs, &xt)?, &t, Reduction::Sum)?;
        loss.backward(cs)?;
        Ok(step_if_finite(cs, &mut opt, &loss)?)
    })
    .unwrap();
    assert_eq!(g.info().conditionals.if_nodes, 1);
    let w = |m: &Linear| {
        (
            s.to_vec(m.weight.data().unwrap()).unwrap(),
            s.to_vec(m.bias.data().unwrap()).unwrap(),
        )
    };
    g.replay(&s).unwrap();
    ref_step(&s, &mut ref_opt);
    assert_eq!(s.to_vec(&flag).unwrap(), vec![1]);
    assert_eq!(w(&model), w(&reference));
    // A NaN in the input: loss and gradients are NaN, the step (and its momentum update) is
    // skipped.
    let before = w(&model);
    let mut bad = xh.clone();
    bad[5] = f32::NAN;
    s.copy_from_host(&bad, &x).unwrap();
    g.replay(&s).unwrap();
    assert_eq!(s.to_vec(&flag).unwrap(), vec![0]);
    assert_eq!(w(&model), before);
    // An infinite input too.
    bad[5] = f32::INFINITY;
    s.copy_from_host(&bad, &x).unwrap();
    g.replay(&s).unwrap();
    assert_eq!(s.to_vec(&flag).unwrap(), vec![0]);
    assert_eq!(w(&model), before);
    // Finite again: the step runs and matches the reference's second step.
    s.copy_from_host(&xh, &x).unwrap();
    g.replay(&s).unwrap();
    ref_step(&s, &mut ref_opt);
    assert_eq!(s.to_vec(&flag).unwrap(), vec![1]);
    assert_eq!(w(&model), w(&reference));
}

/// The seed MLP (1024 → 512 → 256 → 10) at batch 32: forward and an SGD step.
fn seed_mlp(s: &Stream) -> (Sequential, Sgd) {
    let mut rng = HostRng::new(41);
    let m = Sequential::new(vec![
        Layer::Linear(Linear::new(s, 1024, 512, &mut rng).unwrap()),
        Layer::ReLU,
        Layer::Linear(Linear::new(s, 512, 256, &mut rng).unwrap()),
        Layer::ReLU,
        Layer::Linear(Linear::new(s, 256, 10, &mut rng).unwrap()),
    ]);
    let opt = Sgd::new(s, m.parameters(), 1e-3, 0.0, 0.0).unwrap();
    (m, opt)
}

#[test]
fn programmatic_launch_of_nn_kernels_is_bit_identical_to_plain_launch() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(42);
    let x = Tensor::from_host(&s, &rng.vec_normal(32 * 1024), &[32, 1024]).unwrap();
    let t = Tensor::from_host(&s, &rng.vec_normal(32 * 10), &[32, 10]).unwrap();
    let mut results = Vec::new();
    for pdl in [false, true] {
        set_pdl(Some(pdl));
        let (m, mut opt) = seed_mlp(&s);
        // Eager forward.
        let eager_out = no_grad(|| m.forward(&s, &x)).unwrap().to_vec(&s).unwrap();
        // Graphed inference and training steps.
        let (inf, out) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            Ok(no_grad(|| m.forward(cs, &x))?)
        })
        .unwrap();
        inf.replay(&s).unwrap();
        let graph_out = out.to_vec(&s).unwrap();
        assert_eq!(graph_out, eager_out, "pdl={pdl}: graph vs eager");
        let (train, _) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            opt.zero_grad(cs, true)?;
            let loss = mse_loss(cs, &m.forward(cs, &x)?, &t, Reduction::Sum)?;
            loss.backward(cs)?;
            opt.step(cs)?;
            Ok(())
        })
        .unwrap();
        for _ in 0..3 {
            train.replay(&s).unwrap();
        }
        if pdl && dev.supports_pdl() {
            assert!(
                inf.info().programmatic_edges > 0,
                "the PDL forward graph has programmatic edges"
            );
        } else {
            assert_eq!(inf.info().programmatic_edges, 0);
        }
        results.push((eager_out, weights(&s, &m)));
    }
    set_pdl(None);
    assert_eq!(results[0].0, results[1].0, "forward with and without PDL");
    assert_eq!(
        results[0].1, results[1].1,
        "weights after 3 steps with and without PDL"
    );
}
