//! GPU tests of the NN audit findings of issue 26 (item 5): a gradient never aliases a
//! caller's tensor (`backward_with` copies what autograd did not make, and still adopts what it
//! did), a graphed module refuses out-of-order forward and backward calls (and eager autograd a
//! backward through a graph an earlier backward freed), and max-pool propagates NaN like
//! PyTorch with every gradient inside its window.
//!
//! Comparisons: gradients that are copies or sums of a few small integers are compared exactly;
//! a graphed module against the same module run eagerly agrees to 1e-5 (the same kernels, as in
//! `gpu_nn.rs`).

use std::sync::Arc;

use cudagraph::{gpu_test_device, CaptureOptions, Graph, Stream};
use cudagraph_nn::cpu::{self, rel_err, to_f64};
use cudagraph_nn::*;

fn grad(p: &Parameter, s: &Stream) -> Vec<f32> {
    s.to_vec(p.grad().unwrap().expect("gradient present").as_ref())
        .unwrap()
}

fn out_of_order_call(e: &NnError) -> Option<&'static str> {
    match e {
        NnError::OutOfOrder { call, .. } => Some(call),
        _ => None,
    }
}

// ---- Gradients never alias a caller's tensor ---------------------------------------------

/// `backward_with(g)` used to adopt `g`'s buffer as a parameter's gradient whenever the `Arc`
/// count looked low (a clone of `g`, an alias of its memory, or `g` itself with an alias kept):
/// `zero_grad` and the next accumulation then wrote the caller's memory. Each way a caller can
/// keep seeing that memory, into a parameter directly and through a reshape node.
#[test]
fn backward_with_never_adopts_the_callers_tensor_as_a_gradient() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let gh = [1.0f32, -2.0, 3.0, -4.0];
    let g2h = [10.0f32, 20.0, 30.0, 40.0];
    for via_reshape in [false, true] {
        for case in ["a clone", "an alias", "a view", "the tensor itself"] {
            let what = format!("{case}{}", if via_reshape { ", via reshape" } else { "" });
            let p = Parameter::from_host(&s, "w", &[0.5; 4], &[4]).unwrap();
            let root = |p: &Parameter| match via_reshape {
                true => p.tensor().reshape(&[2, 2]).unwrap(),
                false => p.tensor(),
            };
            let g = Tensor::from_host(&s, &gh, &[4]).unwrap();
            // What the caller keeps seeing: the memory of `g`, through a handle of its own.
            let watch = g.data().unwrap().alias();
            let passed = match case {
                "a clone" => g.clone(),
                "an alias" => {
                    Tensor::from_buffer(Arc::new(g.data().unwrap().alias()), &[4]).unwrap()
                }
                "a view" => g.reshape(&[2, 2]).unwrap(),
                _ => g,
            };
            root(&p).backward_with(&s, passed).unwrap();
            assert_eq!(grad(&p, &s), gh, "{what}: the gradient");
            assert_ne!(
                p.grad().unwrap().unwrap().addr(),
                watch.addr(),
                "{what}: the caller's buffer became the gradient"
            );
            p.zero_grad(&s, false).unwrap(); // zeroes the gradient in place
            assert_eq!(
                s.to_vec(&watch).unwrap(),
                gh,
                "{what}: zero_grad wrote the caller's tensor"
            );
            let g2 = Tensor::from_host(&s, &g2h, &[4]).unwrap();
            root(&p).backward_with(&s, g2).unwrap(); // adds into the gradient in place
            assert_eq!(
                s.to_vec(&watch).unwrap(),
                gh,
                "{what}: accumulation wrote the caller's tensor"
            );
            assert_eq!(grad(&p, &s), g2h, "{what}: the accumulated gradient");
        }
    }
}

/// The other side of the rule: a gradient autograd made itself (here a loss's saved one) is
/// still adopted as it is, so a captured step with `zero_grad(set_to_none)` has no copy node:
/// loss plus backward is exactly as many nodes as the loss alone.
#[test]
fn autograd_still_adopts_its_own_gradients_without_a_copy() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(61);
    let n = 1000;
    let (ph, th) = (rng.vec_normal(n), rng.vec_normal(n));
    let p = Parameter::from_host(&s, "p", &ph, &[n]).unwrap();
    let t = Tensor::from_host(&s, &th, &[n]).unwrap();
    // Eagerly first (kernels compiled outside the captures).
    mse_loss(&s, &p.tensor(), &t, Reduction::Sum)
        .unwrap()
        .backward(&s)
        .unwrap();
    let want = cpu::mse_grad(&to_f64(&ph), &to_f64(&th), false);
    assert!(rel_err(&grad(&p, &s), &want) < 1e-6);
    let (loss_only, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        no_grad(|| mse_loss(cs, &p.tensor(), &t, Reduction::Sum))?;
        Ok(())
    })
    .unwrap();
    let (step, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        p.zero_grad(cs, true)?;
        mse_loss(cs, &p.tensor(), &t, Reduction::Sum)?.backward(cs)?;
        Ok(())
    })
    .unwrap();
    assert_eq!(
        step.info().nodes,
        loss_only.info().nodes,
        "adopting the loss's own gradient costs no node"
    );
    step.replay(&s).unwrap();
    assert!(rel_err(&grad(&p, &s), &want) < 1e-6);
}

// ---- Forward and backward in order -------------------------------------------------------

fn block(s: &Stream) -> Sequential {
    let mut rng = HostRng::new(21);
    Sequential::new(vec![
        Layer::Linear(Linear::new(s, 16, 32, &mut rng).unwrap()),
        Layer::ReLU,
        Layer::Linear(Linear::new(s, 32, 8, &mut rng).unwrap()),
    ])
}

fn inputs(s: &Stream) -> (Tensor, Tensor, Tensor) {
    let mut rng = HostRng::new(22);
    let mut t = |shape: &[usize]| {
        Tensor::from_host(s, &rng.vec_normal(shape.iter().product()), shape).unwrap()
    };
    (t(&[5, 16]), t(&[5, 16]), t(&[5, 8]))
}

/// forward(x1), forward(x2), backward through the first used to compute x1's gradients from
/// x2's activations. Now the second forward is refused (nothing replayed), the first's
/// gradients are x1's, and after its backward the next forward runs.
#[test]
fn graphed_module_refuses_a_second_forward_before_backward() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let eager = block(&s);
    let module = block(&s);
    let graphed = GraphedModule::new(&mut s, module, &[5, 16], 2).unwrap();
    let (x1, x2, t) = inputs(&s);
    let y1 = graphed.forward(&s, &x1).unwrap();
    let e = graphed.forward(&s, &x2).unwrap_err();
    assert_eq!(out_of_order_call(&e), Some("GraphedModule::forward"), "{e}");
    assert!(e.to_string().contains("backward"), "says what to do: {e}");
    mse_loss(&s, &y1, &t, Reduction::Sum)
        .unwrap()
        .backward(&s)
        .unwrap();
    mse_loss(&s, &eager.forward(&s, &x1).unwrap(), &t, Reduction::Sum)
        .unwrap()
        .backward(&s)
        .unwrap();
    for (pg, pe) in graphed.module().parameters().iter().zip(eager.parameters()) {
        let err = rel_err(&grad(pg, &s), &to_f64(&grad(&pe, &s)));
        assert!(err < 1e-5, "{}: gradient of x1 off by {err}", pg.name());
    }
    // Its backward done, the next forward replays (for x2 this time).
    let y2 = graphed.forward(&s, &x2).unwrap();
    let want = no_grad(|| eager.forward(&s, &x2)).unwrap();
    assert!(rel_err(&y2.to_vec(&s).unwrap(), &to_f64(&want.to_vec(&s).unwrap())) < 1e-5);
}

/// An output whose backward will never run gives the activations up when it (and everything
/// computed from it) is dropped; a forward under `no_grad` holds nothing.
#[test]
fn graphed_module_forward_is_free_again_once_the_waiting_output_is_dropped() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let module = block(&s);
    let graphed = GraphedModule::new(&mut s, module, &[5, 16], 2).unwrap();
    let (x1, x2, _) = inputs(&s);
    let y1 = graphed.forward(&s, &x1).unwrap();
    let z = relu(&s, &y1).unwrap();
    drop(y1);
    // `z` still leads back to y1's backward.
    let e = graphed.forward(&s, &x2).unwrap_err();
    assert_eq!(out_of_order_call(&e), Some("GraphedModule::forward"), "{e}");
    drop(z);
    drop(graphed.forward(&s, &x2).unwrap());
    let a = no_grad(|| graphed.forward(&s, &x1)).unwrap();
    let b = no_grad(|| graphed.forward(&s, &x2)).unwrap();
    assert!(!a.requires_grad() && !b.requires_grad());
    s.synchronize().unwrap();
}

/// A second backward through the same output, with no forward between, used to return `Ok`
/// having done nothing (the first backward freed the graph); it is a typed error now and the
/// gradients stay those of the first.
#[test]
fn graphed_module_refuses_a_second_backward_without_forward() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let module = block(&s);
    let graphed = GraphedModule::new(&mut s, module, &[5, 16], 2).unwrap();
    let params = graphed.module().parameters();
    let (x1, _, t) = inputs(&s);
    let loss = mse_loss(&s, &graphed.forward(&s, &x1).unwrap(), &t, Reduction::Sum).unwrap();
    loss.backward(&s).unwrap();
    let once: Vec<Vec<f32>> = params.iter().map(|p| grad(p, &s)).collect();
    let e = loss.backward(&s).unwrap_err();
    assert_eq!(out_of_order_call(&e), Some("backward"), "{e}");
    let after: Vec<Vec<f32>> = params.iter().map(|p| grad(p, &s)).collect();
    assert_eq!(after, once, "nothing was accumulated");
    // A new forward starts a new turn.
    mse_loss(&s, &graphed.forward(&s, &x1).unwrap(), &t, Reduction::Sum)
        .unwrap()
        .backward(&s)
        .unwrap();
}

/// The same rule in eager autograd: two losses over one forward, backward through each — the
/// second reaches tensors whose graph the first freed, and is refused before any work.
#[test]
fn a_second_backward_through_a_freed_graph_is_refused() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let model = Linear::new(&s, 6, 3, &mut HostRng::new(51)).unwrap();
    let mut rng = HostRng::new(52);
    let mut t = |shape: &[usize]| {
        Tensor::from_host(&s, &rng.vec_normal(shape.iter().product()), shape).unwrap()
    };
    let (x, t1, t2) = (t(&[4, 6]), t(&[4, 3]), t(&[4, 3]));
    let y = model.forward(&s, &x).unwrap();
    let l1 = mse_loss(&s, &y, &t1, Reduction::Sum).unwrap();
    let l2 = mse_loss(&s, &y, &t2, Reduction::Sum).unwrap();
    l1.backward(&s).unwrap();
    let once: Vec<Vec<f32>> = model.parameters().iter().map(|p| grad(p, &s)).collect();
    for (name, loss) in [("another loss", &l2), ("the same loss", &l1)] {
        let e = loss.backward(&s).unwrap_err();
        assert_eq!(out_of_order_call(&e), Some("backward"), "{name}: {e}");
    }
    let after: Vec<Vec<f32>> = model.parameters().iter().map(|p| grad(p, &s)).collect();
    assert_eq!(after, once, "nothing was accumulated");
}

// ---- Max-pool and NaN ----------------------------------------------------------------------

/// Max-pool used to write −FLT_MAX for a window of only NaN/−inf and send its gradient to
/// element 0 of the plane, and dropped NaN inside a window. Now as PyTorch: NaN wins (the last
/// NaN of the window), a window of −inf gives −inf at its first element, and the gradient of
/// every output lands inside its window. Checked against the f64 reference (itself tested in
/// `cpu.rs`) on hand-made windows and on ragged overlapping ones with whole planes of NaN and
/// of −inf; values and gradients exactly (distinct small integers as upstream gradients).
#[test]
fn max_pool_propagates_nan_and_keeps_gradients_inside_the_window() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let (nan, ninf, inf) = (f32::NAN, f32::NEG_INFINITY, f32::INFINITY);
    #[rustfmt::skip]
    let hand = vec![
        1.0, nan,   nan, 5.0,
        3.0, 2.0,   0.0, nan,
        ninf, ninf, ninf, ninf,
        ninf, ninf, nan,  ninf,
        inf,  0.0,  -7.0, -3.0,
        nan,  1.0,  -5.0, -4.0,
        ninf, ninf, 2.0,  2.0,
        ninf, -1.0, 2.0,  2.0,
    ];
    let mut rng = HostRng::new(71);
    let (h, w) = (7, 9);
    let mut ragged = rng.vec_normal(3 * h * w);
    for (i, v) in ragged[..h * w].iter_mut().enumerate() {
        if i % 5 == 0 {
            *v = nan;
        } else if i % 3 == 0 {
            *v = ninf;
        }
    }
    ragged[h * w..2 * h * w].fill(nan);
    ragged[2 * h * w..].fill(ninf);
    for (xh, shape, k, stride) in [(hand, [1, 2, 4, 4], 2, 2), (ragged, [1, 3, h, w], 3, 2)] {
        let p = Parameter::from_host(&s, "x", &xh, &shape).unwrap();
        let y = max_pool2d(&s, &p.tensor(), k, stride).unwrap();
        let planes = shape[0] * shape[1];
        let (want, idx) = cpu::max_pool(&to_f64(&xh), planes, shape[2], shape[3], k, stride);
        let got = y.to_vec(&s).unwrap();
        assert_eq!(got.len(), want.len());
        for (o, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g.is_nan() && w.is_nan()) || *g as f64 == *w,
                "{shape:?} output {o}: {g} vs {w}"
            );
        }
        let dyh: Vec<f32> = (1..=got.len()).map(|v| v as f32).collect();
        y.backward_with(&s, Tensor::from_host(&s, &dyh, y.shape()).unwrap())
            .unwrap();
        let mut dx = vec![0.0f64; xh.len()];
        for (o, &i) in idx.iter().enumerate() {
            dx[i] += dyh[o] as f64;
        }
        assert_eq!(to_f64(&grad(&p, &s)), dx, "{shape:?}: gradients");
    }
}
