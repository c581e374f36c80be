//! GPU tests of the graph-safe generator and dropout: the Philox kernel against Random123's
//! known answers and the CPU reference (bit-exact on u32 outputs), the counter layout, the
//! statistics of a million uniform and normal draws, dropout's keep rate, scaling and
//! gradient (bit-exact against the reference mask), and eager versus graphed training with
//! dropout step for step.
//!
//! Statistical bounds (n = 2^20 draws) are 5 to 9 standard errors wide, so a correct
//! generator fails them with negligible probability and a wrong one (a biased bit, a stuck
//! counter, a bad transform) fails them.

use std::sync::Arc;

use cudagraph::{gpu_test_device, CaptureOptions, Graph, QueueExt, Stream};
use cudagraph_nn::kernels::philox::PhiloxKernels;
use cudagraph_nn::random::{philox4x32_10, reference};
use cudagraph_nn::*;

const SEED: u64 = 0x1234_5678_9abc_def0;

fn stats(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, var)
}

#[test]
fn philox_kernel_matches_known_answers_and_the_cpu_reference() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let k = PhiloxKernels::get(&dev).unwrap();
    let mut records: Vec<[u32; 6]> = vec![
        [0, 0, 0, 0, 0, 0],
        [u32::MAX; 6],
        [
            0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0,
        ],
    ];
    let mut rng = HostRng::new(5);
    for _ in 0..1000 {
        let mut r = [0u32; 6];
        for w in &mut r {
            *w = rng.next_u64() as u32;
        }
        records.push(r);
    }
    let input = s
        .alloc_from_host(&records.iter().flatten().copied().collect::<Vec<u32>>())
        .unwrap();
    let out = s.alloc_zeroed::<u32>(records.len() * 4).unwrap();
    k.philox_raw(&s, &input, &out, records.len()).unwrap();
    let got = s.to_vec(&out).unwrap();
    assert_eq!(&got[..4], &[0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
    assert_eq!(
        &got[4..8],
        &[0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
    );
    assert_eq!(
        &got[8..12],
        &[0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
    );
    for (i, r) in records.iter().enumerate() {
        let want = philox4x32_10([r[0], r[1], r[2], r[3]], [r[4], r[5]]);
        assert_eq!(&got[4 * i..4 * i + 4], &want, "record {i}");
    }
}

#[test]
fn generator_draws_follow_the_counter_layout_and_advance_on_the_device() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let g = Generator::new(&s, SEED).unwrap();
    let a = s.alloc_zeroed::<u32>(1001).unwrap();
    let b = s.alloc_zeroed::<u32>(37).unwrap();
    g.fill_bits(&s, &a).unwrap();
    g.fill_bits(&s, &b).unwrap();
    assert_eq!(s.to_vec(&a).unwrap(), reference::bits(SEED, 0, 0, 1001));
    // 1001 numbers take 251 counters: the second op starts there (each eager draw moves the
    // base past what it drew, so nothing is left pending).
    assert_eq!(s.to_vec(&b).unwrap(), reference::bits(SEED, 0, 251, 37));
    assert_eq!(g.pending(), 0);
    assert_eq!(g.seed_and_base(&s).unwrap(), (SEED, 261));
    g.advance(&s).unwrap();
    assert_eq!(
        g.seed_and_base(&s).unwrap(),
        (SEED, 261),
        "nothing pending to advance"
    );
    g.fill_bits(&s, &b).unwrap();
    assert_eq!(s.to_vec(&b).unwrap(), reference::bits(SEED, 261, 0, 37));
    // manual_seed resets the seed and the base.
    g.manual_seed(&s, 9).unwrap();
    g.fill_bits(&s, &b).unwrap();
    assert_eq!(s.to_vec(&b).unwrap(), reference::bits(9, 0, 0, 37));
}

#[test]
fn a_million_uniform_and_normal_draws_have_the_right_statistics() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let n = 1 << 20;
    let g = Generator::new(&s, SEED).unwrap();
    let u = s.alloc::<f32>(n).unwrap();
    g.fill_uniform(&s, &u, -1.0, 3.0).unwrap();
    let uh = s.to_vec(&u).unwrap();
    // Bit-exact against the reference (same fused multiply-add).
    assert_eq!(uh, reference::uniform(SEED, 0, 0, n, -1.0, 3.0));
    assert!(uh.iter().all(|&v| (-1.0..3.0).contains(&v)));
    let (mean, var) = stats(&uh);
    // U[-1, 3): mean 1 (standard error 0.0011), variance 16/12 (standard error 0.0012).
    assert!((mean - 1.0).abs() < 0.01, "uniform mean {mean}");
    assert!((var - 16.0 / 12.0).abs() < 0.01, "uniform variance {var}");

    let z = s.alloc::<f32>(n).unwrap();
    g.fill_normal(&s, &z, 0.5, 2.0).unwrap();
    let zh = s.to_vec(&z).unwrap();
    // The reference in f64; the kernel's logf/sincospif are within a few ulps.
    let want = reference::normal(SEED, 0, (n / 4) as u64, n);
    for (i, (&got, &w)) in zh.iter().zip(&want).enumerate() {
        let w = 0.5 + 2.0 * w;
        assert!(
            (got as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "normal draw {i}: {got} vs {w}"
        );
    }
    let (mean, var) = stats(&zh);
    // N(0.5, 4): standard errors 0.002 (mean) and 0.0055 (variance).
    assert!((mean - 0.5).abs() < 0.01, "normal mean {mean}");
    assert!((var - 4.0).abs() < 0.04, "normal variance {var}");
    let within = zh.iter().filter(|&&v| (v - 0.5).abs() < 2.0).count() as f64 / n as f64;
    assert!(
        (within - 0.682_69).abs() < 0.003,
        "within one sigma {within}"
    );
}

#[test]
fn dropout_keeps_one_minus_p_scales_the_rest_and_routes_gradients_through_the_mask() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let n = 1 << 20;
    let p = 0.3f32;
    let mut rng = HostRng::new(11);
    let xh = rng.vec_normal(n);
    let x = Parameter::from_host(&s, "x", &xh, &[n]).unwrap();
    let g = Generator::new(&s, SEED).unwrap();
    let y = dropout(&s, &x.tensor(), p, true, &g).unwrap();
    let yh = y.to_vec(&s).unwrap();
    let keep = reference::dropout_keep(SEED, 0, 0, n, p);
    let scale = 1.0 / (1.0 - p);
    for i in 0..n {
        let want = if keep[i] { xh[i] * scale } else { 0.0 };
        assert_eq!(yh[i].to_bits(), want.to_bits(), "element {i}");
    }
    let rate = keep.iter().filter(|&&k| k).count() as f64 / n as f64;
    // Keep probability 0.7, standard error 0.00045.
    assert!((rate - 0.7).abs() < 0.003, "keep rate {rate}");
    // Backward: dx = dy · scale where kept.
    let dyh = rng.vec_normal(n);
    let dy = Tensor::from_host(&s, &dyh, &[n]).unwrap();
    y.backward_with(&s, dy).unwrap();
    let dx = s.to_vec(x.grad().unwrap().unwrap().as_ref()).unwrap();
    for i in 0..n {
        let want = if keep[i] { dyh[i] * scale } else { 0.0 };
        assert_eq!(dx[i].to_bits(), want.to_bits(), "gradient {i}");
    }
    // Edges: p = 0 and eval are the identity (no numbers drawn), p = 1 zeroes everything,
    // p outside [0, 1] is an error.
    let t = x.tensor();
    let before = g.pending();
    assert_eq!(
        dropout(&s, &t, 0.0, true, &g).unwrap().to_vec(&s).unwrap(),
        xh
    );
    assert_eq!(
        dropout(&s, &t, 0.9, false, &g).unwrap().to_vec(&s).unwrap(),
        xh
    );
    assert_eq!(g.pending(), before);
    let zero = dropout(&s, &t, 1.0, true, &g).unwrap().to_vec(&s).unwrap();
    assert!(zero.iter().all(|&v| v == 0.0));
    assert!(dropout(&s, &t, 1.5, true, &g).is_err());
    assert!(dropout(&s, &t, f32::NAN, true, &g).is_err());
}

fn dropout_model(s: &Stream, seed: u64) -> Sequential {
    let mut rng = HostRng::new(3);
    Sequential::new(vec![
        Layer::Linear(Linear::new(s, 16, 64, &mut rng).unwrap()),
        Layer::ReLU,
        Layer::Dropout { p: 0.5 },
        Layer::Linear(Linear::new(s, 64, 4, &mut rng).unwrap()),
    ])
    .with_generator(Generator::new(s, seed).unwrap())
}

#[test]
fn eager_and_graphed_training_with_dropout_match_step_for_step() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(4);
    let xh = rng.vec_normal(8 * 16);
    let th = rng.vec_normal(8 * 4);
    let x = Tensor::from_host(&s, &xh, &[8, 16]).unwrap();
    let t = Tensor::from_host(&s, &th, &[8, 4]).unwrap();
    let steps = 5;
    let run_step = |q: &dyn cudagraph::Queue,
                    model: &Sequential,
                    opt: &mut Sgd|
     -> cudagraph_nn::Result<(Tensor, Tensor)> {
        opt.zero_grad(q, true)?;
        let y = model.forward(q, &x)?;
        let loss = mse_loss(q, &y, &t, Reduction::Mean)?;
        loss.backward(q)?;
        opt.step(q)?;
        Ok((y, loss))
    };
    // Eager.
    let eager_model = dropout_model(&s, 77);
    let mut eager_opt = Sgd::new(&s, eager_model.parameters(), 0.05, 0.0, 0.0).unwrap();
    let mut eager = Vec::new();
    for _ in 0..steps {
        let (y, loss) = run_step(&s, &eager_model, &mut eager_opt).unwrap();
        eager.push((y.to_vec(&s).unwrap(), loss.to_vec(&s).unwrap()));
    }
    // Graphed: one capture, `steps` replays.
    let graph_model = dropout_model(&s, 77);
    let mut graph_opt = Sgd::new(&s, graph_model.parameters(), 0.05, 0.0, 0.0).unwrap();
    let (g, (y, loss)) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        Ok(run_step(cs, &graph_model, &mut graph_opt)?)
    })
    .unwrap();
    for (i, (ey, el)) in eager.iter().enumerate() {
        g.replay(&s).unwrap();
        assert_eq!(
            &y.to_vec(&s).unwrap(),
            ey,
            "step {i}: outputs (masks) differ"
        );
        assert_eq!(&loss.to_vec(&s).unwrap(), el, "step {i}: loss");
    }
    // Successive steps drew different masks.
    assert_ne!(eager[0].0, eager[1].0);
    let ge = eager_model.generator().unwrap().seed_and_base(&s).unwrap();
    let gg = graph_model.generator().unwrap().seed_and_base(&s).unwrap();
    assert_eq!(ge, gg);
    assert_eq!(ge.1, steps as u64 * (8 * 64u64).div_ceil(4));
    for (a, b) in eager_model
        .parameters()
        .iter()
        .zip(graph_model.parameters())
    {
        assert_eq!(
            s.to_vec(a.data().unwrap()).unwrap(),
            s.to_vec(b.data().unwrap()).unwrap()
        );
    }
    // Eval mode: no dropout, no draws.
    let mut m = dropout_model(&s, 1);
    m.eval();
    let a = no_grad(|| m.forward(&s, &x)).unwrap().to_vec(&s).unwrap();
    let b = no_grad(|| m.forward(&s, &x)).unwrap().to_vec(&s).unwrap();
    assert_eq!(a, b);
    assert_eq!(m.generator().unwrap().seed_and_base(&s).unwrap(), (1, 0));
    // Training mode without a generator is a typed error.
    let bare = Sequential::new(vec![Layer::Dropout { p: 0.1 }]);
    assert!(bare.forward(&s, &x).is_err());
}

#[test]
fn two_replays_draw_different_numbers_and_each_matches_the_reference() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let gen = Generator::new(&s, SEED).unwrap();
    let n = 4096;
    let out = Arc::new(s.alloc_zeroed::<f32>(n).unwrap());
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        gen.fill_uniform(cs, &out, 0.0, 1.0)?;
        Ok(gen.advance(cs)?)
    })
    .unwrap();
    g.replay(&s).unwrap();
    let first = s.to_vec(&out).unwrap();
    g.replay(&s).unwrap();
    let second = s.to_vec(&out).unwrap();
    assert_ne!(first, second);
    let per_step = (n / 4) as u64;
    assert_eq!(first, reference::uniform(SEED, 0, 0, n, 0.0, 1.0));
    assert_eq!(second, reference::uniform(SEED, per_step, 0, n, 0.0, 1.0));
    assert_eq!(gen.seed_and_base(&s).unwrap(), (SEED, 2 * per_step));
    // rand / randn shapes.
    let r = rand(&s, &gen, &[3, 5]).unwrap();
    assert_eq!(r.shape(), &[3, 5]);
    let z = randn(&s, &gen, &[7]).unwrap();
    assert_eq!(z.to_vec(&s).unwrap().len(), 7);
}
