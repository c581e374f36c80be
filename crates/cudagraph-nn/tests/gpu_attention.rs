//! GPU tests of attention over a KV cache (`KvCache`): prefill and decode steps of sequences
//! at different positions against an f64 CPU reference computed from the exactly rounded
//! inputs, grouped-query heads, a decode step captured once and replayed as the positions
//! advance (equal to the same step run eagerly, bit for bit), positions outside the cache
//! reported as a typed error at the next synchronisation with nothing written, misuse.
//!
//! Tolerances: the kernel computes scores, the softmax and the weighted sums in f32 (`__expf`,
//! a few ulp) and rounds the output once: |out − ref| ≤ 2e-5 + 1e-4·|ref| in f32, plus one
//! unit of the output type (2⁻⁸ bf16, 2⁻¹¹ f16) relative to the largest |v| in 16 bits.

use cudagraph::memory::bf16;
use cudagraph::testing::assert_bits_eq;
use cudagraph::{gpu_test_device, CaptureOptions, DeviceBuffer, Graph, Stream};
use cudagraph_nn::*;

const B: usize = 2;
const H: usize = 8;
const HKV: usize = 2;
const TMAX: usize = 24;

fn tensor(s: &Stream, d: Dtype, v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_host(s, v, shape)
        .unwrap()
        .to_dtype(s, d)
        .unwrap()
}

/// The host's copy of the caches: `[B, HKV, TMAX, D]`, values already rounded to the type.
struct HostCache {
    d: usize,
    k: Vec<f64>,
    v: Vec<f64>,
}

impl HostCache {
    fn append(&mut self, dt: Dtype, tokens: usize, k: &[f32], v: &[f32], pos: &[i32]) {
        let d = self.d;
        for b in 0..B {
            for t in 0..tokens {
                let p = pos[b * tokens + t] as usize;
                for h in 0..HKV {
                    for e in 0..d {
                        let src = ((b * tokens + t) * HKV + h) * d + e;
                        let dst = ((b * HKV + h) * TMAX + p) * d + e;
                        self.k[dst] = dt.round(k[src]) as f64;
                        self.v[dst] = dt.round(v[src]) as f64;
                    }
                }
            }
        }
    }

    fn attend(&self, dt: Dtype, tokens: usize, q: &[f32], pos: &[i32], scale: f64) -> Vec<f64> {
        let d = self.d;
        let mut out = vec![0f64; B * tokens * H * d];
        for b in 0..B {
            for t in 0..tokens {
                let p = pos[b * tokens + t] as usize;
                for h in 0..H {
                    let kh = h / (H / HKV);
                    let qrow = ((b * tokens + t) * H + h) * d;
                    let scores: Vec<f64> = (0..=p)
                        .map(|j| {
                            let kr = ((b * HKV + kh) * TMAX + j) * d;
                            (0..d)
                                .map(|e| dt.round(q[qrow + e]) as f64 * self.k[kr + e])
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let sum: f64 = w.iter().sum();
                    for e in 0..d {
                        out[qrow + e] = (0..=p)
                            .map(|j| w[j] * self.v[((b * HKV + kh) * TMAX + j) * d + e])
                            .sum::<f64>()
                            / sum;
                    }
                }
            }
        }
        out
    }
}

fn check(dt: Dtype, got: &[f32], want: &[f64], what: &str) {
    let unit = match dt {
        Dtype::F32 => 0.0,
        Dtype::Bf16 => 2f64.powi(-8),
        Dtype::F16 => 2f64.powi(-11),
    };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = 2e-5 + 1e-4 * w.abs() + unit * 4.0;
        assert!(
            ((*g as f64) - w).abs() <= tol,
            "{dt} {what} [{i}]: {g} vs {w}"
        );
    }
}

#[test]
fn prefill_then_decode_matches_the_reference_in_every_type() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for dt in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
        for d in [64usize, 80, 128] {
            let mut rng = HostRng::new(d as u64);
            let cache = KvCache::new(&s, dt, (B, HKV, TMAX, d)).unwrap();
            let mut host = HostCache {
                d,
                k: vec![0.0; B * HKV * TMAX * d],
                v: vec![0.0; B * HKV * TMAX * d],
            };
            let scale = 1.0 / (d as f64).sqrt();
            // Prefill: 5 tokens each; the second sequence starts at position 7 (its earlier
            // positions hold zeros, attended to like any key).
            let tokens = 5;
            let pos: Vec<i32> = (0..5).chain(7..12).collect();
            let pd = s.alloc_from_host(&pos).unwrap();
            let (k, v, q) = (
                rng.vec_normal(B * tokens * HKV * d),
                rng.vec_normal(B * tokens * HKV * d),
                rng.vec_normal(B * tokens * H * d),
            );
            let kt = tensor(&s, dt, &k, &[B, tokens, HKV, d]);
            let vt = tensor(&s, dt, &v, &[B, tokens, HKV, d]);
            cache.append(&s, &kt, &vt, &pd).unwrap();
            host.append(dt, tokens, &k, &v, &pos);
            let out = no_grad(|| {
                cache.attend(
                    &s,
                    &tensor(&s, dt, &q, &[B, tokens, H, d]),
                    &pd,
                    scale as f32,
                )
            })
            .unwrap();
            assert_eq!((out.dtype(), out.shape()), (dt, &[B, tokens, H, d][..]));
            check(
                dt,
                &out.to_vec(&s).unwrap(),
                &host.attend(dt, tokens, &q, &pos, scale),
                "prefill",
            );
            // Three decode steps, one token each.
            for step in 0..3 {
                let pos = vec![5 + step, 12 + step];
                let pd = s.alloc_from_host(&pos).unwrap();
                let (k, v, q) = (
                    rng.vec_normal(B * HKV * d),
                    rng.vec_normal(B * HKV * d),
                    rng.vec_normal(B * H * d),
                );
                cache
                    .append(
                        &s,
                        &tensor(&s, dt, &k, &[B, 1, HKV, d]),
                        &tensor(&s, dt, &v, &[B, 1, HKV, d]),
                        &pd,
                    )
                    .unwrap();
                host.append(dt, 1, &k, &v, &pos);
                let out = cache
                    .attend(&s, &tensor(&s, dt, &q, &[B, 1, H, d]), &pd, scale as f32)
                    .unwrap();
                check(
                    dt,
                    &out.to_vec(&s).unwrap(),
                    &host.attend(dt, 1, &q, &pos, scale),
                    "decode",
                );
            }
            s.synchronize().unwrap();
        }
    }
}

/// One decode step (append, attend) captured once; replays with advancing positions and new
/// inputs equal the same step run eagerly on a second cache, bit for bit.
#[test]
fn a_captured_decode_step_follows_the_positions_and_replays_like_eager() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let (d, dt) = (64, Dtype::Bf16);
    let mut rng = HostRng::new(5);
    let graphed = KvCache::new(&s, dt, (B, HKV, TMAX, d)).unwrap();
    let eager = KvCache::new(&s, dt, (B, HKV, TMAX, d)).unwrap();
    let pos: DeviceBuffer<i32> = s.alloc_from_host(&[0i32, 3]).unwrap();
    let kx = Tensor::zeros(&s, &[B, 1, HKV, d])
        .unwrap()
        .to_dtype(&s, dt)
        .unwrap();
    let vx = Tensor::zeros(&s, &[B, 1, HKV, d])
        .unwrap()
        .to_dtype(&s, dt)
        .unwrap();
    let qx = Tensor::zeros(&s, &[B, 1, H, d])
        .unwrap()
        .to_dtype(&s, dt)
        .unwrap();
    let scale = 0.125;
    let (g, out) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        graphed.append(cs, &kx, &vx, &pos)?;
        Ok(graphed.attend(cs, &qx, &pos, scale)?)
    })
    .unwrap();
    for step in 0..6 {
        let p = [step, 3 + step];
        s.copy_from_host(&p, &pos).unwrap();
        let (k, v, q) = (
            rng.vec_normal(B * HKV * d),
            rng.vec_normal(B * HKV * d),
            rng.vec_normal(B * H * d),
        );
        let (kb, vb, qb): (Vec<bf16>, Vec<bf16>, Vec<bf16>) = (
            k.iter().map(|x| bf16::from_f32(*x)).collect(),
            v.iter().map(|x| bf16::from_f32(*x)).collect(),
            q.iter().map(|x| bf16::from_f32(*x)).collect(),
        );
        s.copy_from_host(&kb, kx.data_as::<bf16>().unwrap())
            .unwrap();
        s.copy_from_host(&vb, vx.data_as::<bf16>().unwrap())
            .unwrap();
        s.copy_from_host(&qb, qx.data_as::<bf16>().unwrap())
            .unwrap();
        g.replay(&s).unwrap();
        eager.append(&s, &kx, &vx, &pos).unwrap();
        let want = eager.attend(&s, &qx, &pos, scale).unwrap();
        assert_bits_eq(
            &out.to_vec(&s).unwrap(),
            &want.to_vec(&s).unwrap(),
            format_args!("step {step}"),
        );
    }
}

#[test]
fn a_position_outside_the_cache_is_reported_and_writes_nothing() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let d = 32;
    let cache = KvCache::new(&s, Dtype::F32, (B, HKV, TMAX, d)).unwrap();
    let pd = s.alloc_from_host(&[0i32, TMAX as i32]).unwrap();
    let k = Tensor::full(&s, &[B, 1, HKV, d], 1.0).unwrap();
    cache.append(&s, &k, &k, &pd).unwrap();
    let e = s.synchronize().unwrap_err();
    assert!(e.to_string().contains("attention position"), "{e}");
    // The stream stays usable; the in-range sequence got its key, the other nothing.
    let q = Tensor::full(&s, &[B, 1, H, d], 1.0).unwrap();
    let good = s.alloc_from_host(&[0i32, 0]).unwrap();
    let out = cache
        .attend(&s, &q, &good, 1.0)
        .unwrap()
        .to_vec(&s)
        .unwrap();
    assert!(
        out[..H * d].iter().all(|v| *v == 1.0),
        "sequence 0 attends to its one key"
    );
    assert!(
        out[H * d..].iter().all(|v| *v == 0.0),
        "sequence 1's cache is still zero"
    );
    let neg = s.alloc_from_host(&[-1i32, 0]).unwrap();
    let _ = cache.attend(&s, &q, &neg, 1.0).unwrap();
    assert!(
        s.synchronize().is_err(),
        "a negative position is reported too"
    );
}

#[test]
fn misuse_shapes_and_types_are_typed_errors() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let d = 16;
    let cache = KvCache::new(&s, Dtype::Bf16, (B, HKV, TMAX, d)).unwrap();
    let pd = s.alloc_from_host(&[0i32, 0]).unwrap();
    let q32 = Tensor::zeros(&s, &[B, 1, H, d]).unwrap();
    assert!(matches!(
        cache.attend(&s, &q32, &pd, 1.0),
        Err(NnError::Dtype { .. })
    ));
    let bad_heads = Tensor::zeros(&s, &[B, 1, 3, d])
        .unwrap()
        .to_dtype(&s, Dtype::Bf16)
        .unwrap();
    assert!(matches!(
        cache.attend(&s, &bad_heads, &pd, 1.0),
        Err(NnError::Shape(_))
    ));
    let short = s.alloc_from_host(&[0i32]).unwrap();
    let q = Tensor::zeros(&s, &[B, 1, H, d])
        .unwrap()
        .to_dtype(&s, Dtype::Bf16)
        .unwrap();
    assert!(
        cache.attend(&s, &q, &short, 1.0).is_err(),
        "positions for one of two sequences"
    );
    assert!(KvCache::new(&s, Dtype::F32, (1, 1, 8, MAX_HEAD_DIM_PLUS)).is_err());
    let p = Parameter::from_host(&s, "q", &vec![0.0; B * H * d], &[B, 1, H, d]).unwrap();
    assert!(matches!(
        cache.attend(&s, &p.tensor().to_dtype(&s, Dtype::Bf16).unwrap(), &pd, 1.0),
        Err(NnError::Unsupported(_))
    ));
}

const MAX_HEAD_DIM_PLUS: usize = 257;
