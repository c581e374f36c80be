//! GPU tests of `clip_grad_norm` (PyTorch's `clip_grad_norm_`, L2, eps 1e-6) on the device.
//!
//! Tolerances and exactness:
//! - the norm against the f64 reference: within 1.2e-7 relative (the device adds the squares
//!   in f64 and rounds once to f32, so it is the reference rounded to f32 up to a tie);
//! - the clipped gradients are exactly `g · c` with `c = max_norm / (norm + 1e-6)` computed in
//!   f32 on the host from the device's norm (IEEE division and product: the same bits);
//! - inf and NaN gradients give PyTorch's results; below the bound nothing changes (bits);
//! - the reduction is deterministic: two eager runs and a replayed graph give the same bits.

use std::sync::Arc;

use cudagraph::testing::assert_bits_eq;
use cudagraph::{gpu_test_device, BlockRef, CaptureOptions, Device, DeviceBuffer, Graph, Stream};
use cudagraph_nn::*;

/// A gradient buffer holding `data` that starts 4 bytes into its allocation: not 16-byte
/// aligned, so the kernels take their scalar path for it.
fn misaligned(dev: &Device, s: &Stream, data: &[f32]) -> Arc<DeviceBuffer<f32>> {
    let n = data.len();
    let base = s.alloc_from_host(&vec![0f32; n + 1]).unwrap();
    let addr = base.addr() + 4;
    // SAFETY: [addr, addr + 4n) lies inside `base` (n + 1 floats), which the block keeps alive
    // (the boxed alias) until its last holder is gone; nothing else writes that memory.
    let block = unsafe { BlockRef::external(addr, 4 * n, dev.ordinal(), Box::new(base.alias())) };
    let buf = DeviceBuffer::<f32>::from_block(block, n).unwrap();
    s.copy_from_host(data, &buf).unwrap();
    Arc::new(buf)
}

/// Parameters with the given gradients (the last one misaligned when `misalign`).
fn with_grads(dev: &Device, s: &Stream, grads: &[Vec<f32>], misalign: bool) -> Vec<Parameter> {
    grads
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let n = g.len();
            let p = Parameter::from_host(s, &format!("p{i}"), &vec![0.0; n], &[n]).unwrap();
            let buf = if misalign && i + 1 == grads.len() {
                misaligned(dev, s, g)
            } else {
                Arc::new(s.alloc_from_host(g).unwrap())
            };
            p.set_grad(Some(buf)).unwrap();
            p
        })
        .collect()
}

fn read_grads(s: &Stream, params: &[Parameter]) -> Vec<Vec<f32>> {
    params
        .iter()
        .map(|p| s.to_vec(&*p.grad().unwrap().unwrap()).unwrap())
        .collect()
}

fn norm_ref(grads: &[Vec<f32>]) -> f64 {
    grads
        .iter()
        .flatten()
        .map(|&g| g as f64 * g as f64)
        .sum::<f64>()
        .sqrt()
}

/// PyTorch's factor in f32: `min(1, max_norm / (norm + 1e-6))` (NaN stays NaN).
fn factor(max_norm: f32, norm: f32) -> f32 {
    let c = max_norm / (norm + 1e-6f32);
    if c > 1.0 {
        1.0
    } else {
        c
    }
}

fn random_grads(sizes: &[usize], seed: u64, scale: f32) -> Vec<Vec<f32>> {
    let mut rng = HostRng::new(seed);
    sizes
        .iter()
        .map(|&n| rng.vec_normal(n).into_iter().map(|v| v * scale).collect())
        .collect()
}

const SIZES: [usize; 12] = [1, 2, 3, 5, 127, 1023, 1024, 1025, 4099, 65537, 100003, 1031];

#[test]
fn the_norm_matches_the_f64_reference_and_clipping_is_exact() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for (seed, scale, max_norm) in [(1u64, 1.0f32, 10.0f32), (2, 1e-3, 1e-2), (3, 50.0, 1.0)] {
        let grads = random_grads(&SIZES, seed, scale);
        let params = with_grads(&dev, &s, &grads, true);
        let norm = clip_grad_norm(&s, &params, max_norm).unwrap();
        assert_eq!(norm.shape(), [1]);
        let got = norm.to_vec(&s).unwrap()[0];
        let want = norm_ref(&grads);
        assert!(
            (got as f64 - want).abs() <= want * 1.2e-7,
            "seed {seed}: norm {got} vs {want}"
        );
        let c = factor(max_norm, got);
        assert!(c < 1.0, "these gradients are clipped");
        for (i, (g, before)) in read_grads(&s, &params).iter().zip(&grads).enumerate() {
            let want: Vec<f32> = before.iter().map(|&v| v * c).collect();
            assert_bits_eq(g, &want, format_args!("seed {seed}: gradient {i}"));
        }
        // The clipped gradients' norm is the bound (to rounding).
        let after = norm_ref(&read_grads(&s, &params));
        assert!(
            (after - max_norm as f64).abs() <= max_norm as f64 * 1e-5,
            "{after}"
        );
    }
}

#[test]
fn gradients_within_the_bound_are_left_alone() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let grads = random_grads(&SIZES, 4, 1e-3);
    let params = with_grads(&dev, &s, &grads, true);
    let want = norm_ref(&grads);
    for max_norm in [want as f32 * 2.0, f32::INFINITY] {
        let got = clip_grad_norm(&s, &params, max_norm)
            .unwrap()
            .to_vec(&s)
            .unwrap()[0];
        assert!((got as f64 - want).abs() <= want * 1.2e-7);
        for (i, (g, before)) in read_grads(&s, &params).iter().zip(&grads).enumerate() {
            assert_bits_eq(g, before, format_args!("max_norm {max_norm}: gradient {i}"));
        }
    }
}

#[test]
fn parameters_without_gradients_are_left_out_and_none_give_zero() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let grads = random_grads(&[10, 20], 5, 1.0);
    let mut params = with_grads(&dev, &s, &grads, false);
    params.insert(
        1,
        Parameter::from_host(&s, "no_grad", &[1.0; 7], &[7]).unwrap(),
    );
    let got = clip_grad_norm(&s, &params, f32::INFINITY)
        .unwrap()
        .to_vec(&s)
        .unwrap()[0];
    let want = norm_ref(&grads);
    assert!((got as f64 - want).abs() <= want * 1.2e-7);
    assert!(params[1].grad().unwrap().is_none());
    let none = [Parameter::from_host(&s, "w", &[1.0], &[1]).unwrap()];
    assert_eq!(
        clip_grad_norm(&s, &none, 1.0).unwrap().to_vec(&s).unwrap(),
        vec![0.0]
    );
    assert_eq!(
        clip_grad_norm(&s, &[], 1.0).unwrap().to_vec(&s).unwrap(),
        vec![0.0]
    );
}

#[test]
fn inf_and_nan_gradients_give_pytorchs_results() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    // An inf: the norm is inf, the factor 1/inf = 0: finite elements become 0, the infinite
    // one inf·0 = NaN.
    let mut grads = random_grads(&[100, 1025], 6, 1.0);
    grads[1][700] = f32::NEG_INFINITY;
    let params = with_grads(&dev, &s, &grads, false);
    let n = clip_grad_norm(&s, &params, 1.0)
        .unwrap()
        .to_vec(&s)
        .unwrap()[0];
    assert_eq!(n, f32::INFINITY);
    let after = read_grads(&s, &params);
    for (i, (g, before)) in after.iter().zip(&grads).enumerate() {
        for (j, (&a, &b)) in g.iter().zip(before).enumerate() {
            if b.is_finite() {
                assert_eq!(a, 0.0, "gradient {i}[{j}]");
            } else {
                assert!(a.is_nan(), "gradient {i}[{j}]");
            }
        }
    }
    // A NaN: the norm and the factor are NaN, and so is every gradient (torch.clamp keeps
    // NaN).
    let mut grads = random_grads(&[100, 1025], 7, 1.0);
    grads[0][3] = f32::NAN;
    let params = with_grads(&dev, &s, &grads, false);
    let n = clip_grad_norm(&s, &params, 1.0)
        .unwrap()
        .to_vec(&s)
        .unwrap()[0];
    assert!(n.is_nan());
    assert!(read_grads(&s, &params).iter().flatten().all(|v| v.is_nan()));
    // Squares are taken in f64: 1e20 does not overflow the norm as an f32 square would.
    let big = vec![vec![1e20f32, 1e20]];
    let params = with_grads(&dev, &s, &big, false);
    let n = clip_grad_norm(&s, &params, 1.0)
        .unwrap()
        .to_vec(&s)
        .unwrap()[0];
    assert!(n.is_finite());
    assert_eq!(n, norm_ref(&big) as f32);
}

#[test]
fn misuse_a_bad_bound_is_a_typed_error() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let params = with_grads(&dev, &s, &[vec![1.0, 2.0]], false);
    for bad in [f32::NAN, -1.0, f32::NEG_INFINITY] {
        match clip_grad_norm(&s, &params, bad) {
            Err(NnError::Amp(AmpError::MaxNorm(v))) => assert!(v.is_nan() || v == bad),
            other => panic!("{bad}: {other:?}"),
        }
    }
    // Nothing ran: the gradient is as it was.
    assert_eq!(read_grads(&s, &params), vec![vec![1.0, 2.0]]);
    clip_grad_norm(&s, &params, 0.0).unwrap();
    assert_eq!(
        read_grads(&s, &params),
        vec![vec![0.0, 0.0]],
        "max_norm 0 zeroes them"
    );
}

/// 600 tensors (two tables of the multi-tensor kernels where the driver takes 32 KB of
/// parameters, ten without) and a few large ones, clipped.
fn many() -> Vec<Vec<f32>> {
    let mut sizes: Vec<usize> = (0..600).map(|i| 1 + (i * 37) % 300).collect();
    sizes.extend([70001, 4096, 3]);
    random_grads(&sizes, 8, 1.0)
}

#[test]
fn the_reduction_is_deterministic_and_replays_equal_eager() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let grads = many();
    let params = with_grads(&dev, &s, &grads, true);
    let reset = |s: &Stream| {
        for (p, g) in params.iter().zip(&grads) {
            s.copy_from_host(g, &*p.grad().unwrap().unwrap()).unwrap();
        }
    };
    let mut eager = Vec::new();
    for _ in 0..2 {
        reset(&s);
        let n = clip_grad_norm(&s, &params, 3.0)
            .unwrap()
            .to_vec(&s)
            .unwrap()[0];
        eager.push((n.to_bits(), read_grads(&s, &params)));
    }
    assert_eq!(eager[0].0, eager[1].0, "the same norm bits twice");
    for (a, b) in eager[0].1.iter().zip(&eager[1].1) {
        assert_bits_eq(a, b, "eager twice");
    }
    let want = norm_ref(&grads);
    let got = f32::from_bits(eager[0].0);
    assert!(
        (got as f64 - want).abs() <= want * 1.2e-7,
        "{got} vs {want}"
    );
    let (g, norm) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        Ok(clip_grad_norm(cs, &params, 3.0)?)
    })
    .unwrap();
    for round in 0..3 {
        reset(&s);
        g.replay(&s).unwrap();
        let n = norm.to_vec(&s).unwrap()[0];
        assert_eq!(n.to_bits(), eager[0].0, "replay {round}: norm");
        for (i, (a, b)) in read_grads(&s, &params).iter().zip(&eager[0].1).enumerate() {
            assert_bits_eq(a, b, format_args!("replay {round}: gradient {i}"));
        }
    }
}
