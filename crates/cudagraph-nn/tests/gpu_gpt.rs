//! GPU tests of the GPT-2-shaped training model (`Gpt`): one training step (forward in bf16
//! autocast with the optimizer's 16-bit copies, or in f32; cross-entropy, backward, gradient
//! clipping, AdamW) captured into one graph gives bit for bit the parameters, gradients and
//! loss of the same step run eagerly; the loss falls over a few steps on a tiny configuration;
//! the parameters are GPT-2's (shapes, tied lm_head, initialisation scales); misuse is a typed
//! error.

use std::sync::Arc;

use cudagraph::testing::assert_bits_eq;
use cudagraph::{gpu_test_device, CaptureOptions, DeviceBuffer, Graph, Queue, Stream};
use cudagraph_nn::*;

const TINY: GptConfig = GptConfig {
    vocab: 17,
    positions: 16,
    hidden: 32,
    heads: 2,
    layers: 2,
};
const BATCH: usize = 3;
const TOKENS: usize = 12;

/// A copy-task batch: 6 random tokens (1..vocab) then their repeat; targets the next token in
/// the repeated half, token 0 elsewhere.
fn batch(s: &Stream, rng: &mut HostRng) -> (Arc<DeviceBuffer<i32>>, Arc<DeviceBuffer<i32>>) {
    let half = TOKENS / 2;
    let (mut ids, mut tgt) = (Vec::new(), Vec::new());
    for _ in 0..BATCH {
        let r: Vec<i32> = (0..half)
            .map(|_| 1 + (rng.next_u64() % (TINY.vocab as u64 - 1)) as i32)
            .collect();
        let seq: Vec<i32> = r.iter().chain(&r).copied().collect();
        for t in 0..TOKENS {
            ids.push(seq[t]);
            tgt.push(if t + 1 >= half && t + 1 < TOKENS {
                seq[t + 1]
            } else {
                0
            });
        }
    }
    (
        Arc::new(s.alloc_from_host(&ids).unwrap()),
        Arc::new(s.alloc_from_host(&tgt).unwrap()),
    )
}

fn positions(s: &Stream) -> Arc<DeviceBuffer<i32>> {
    let p: Vec<i32> = (0..BATCH * TOKENS).map(|i| (i % TOKENS) as i32).collect();
    Arc::new(s.alloc_from_host(&p).unwrap())
}

struct Setup {
    model: Gpt,
    opt: Adam,
    ids: Arc<DeviceBuffer<i32>>,
    targets: Arc<DeviceBuffer<i32>>,
    pos: Arc<DeviceBuffer<i32>>,
    dtype: Dtype,
}

impl Setup {
    fn new(s: &Stream, dtype: Dtype) -> Self {
        let model = Gpt::new(s, TINY, &mut HostRng::new(5)).unwrap();
        let opt = Adam::with_options(
            s,
            model.parameters(),
            AdamConfig {
                lr: 3e-3,
                ..AdamConfig::adamw()
            },
            OptimOptions {
                copies: (dtype != Dtype::F32).then_some(dtype),
            },
        )
        .unwrap();
        let (ids, targets) = batch(s, &mut HostRng::new(9));
        Setup {
            model,
            opt,
            ids,
            targets,
            pos: positions(s),
            dtype,
        }
    }

    /// Forward under autocast (the optimizer's copies), cross-entropy, backward, clipping to
    /// norm 1, AdamW.
    fn step(&mut self, q: &dyn Queue) -> Result<Tensor> {
        self.opt.zero_grad(q, true)?;
        let options = AutocastOptions {
            dtype: self.dtype,
            copies: self.opt.copies().unwrap_or_default(),
        };
        let logits = autocast_with(options, || {
            self.model.forward(q, &self.ids, &self.pos, BATCH)
        })??;
        assert_eq!(
            (logits.dtype(), logits.shape()),
            (Dtype::F32, &[BATCH * TOKENS, TINY.vocab][..])
        );
        let loss = cross_entropy(q, &logits, &self.targets)?;
        loss.backward(q)?;
        clip_grad_norm(q, &self.model.parameters(), 1.0)?;
        self.opt.step(q)?;
        Ok(loss)
    }

    fn snapshot(&self, s: &Stream) -> Vec<Vec<f32>> {
        let mut v = Vec::new();
        for p in self.model.parameters() {
            v.push(s.to_vec(p.data().unwrap()).unwrap());
            v.push(s.to_vec(&p.grad().unwrap().expect("a gradient")).unwrap());
        }
        v
    }
}

#[test]
fn a_captured_training_step_equals_the_eager_step_bit_for_bit() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    for dtype in [Dtype::Bf16, Dtype::F32] {
        // Two models from the same seed: one runs two eager steps, the other one eager step
        // (the warm-up) and then the captured step; both must agree after each.
        let mut eager = Setup::new(&s, dtype);
        let mut graphed = Setup::new(&s, dtype);
        let l0 = eager.step(&s).unwrap().to_vec(&s).unwrap();
        let g0 = graphed.step(&s).unwrap().to_vec(&s).unwrap();
        assert_bits_eq(&g0, &l0, format!("{dtype} first loss"));
        let (g, loss) =
            Graph::capture(&mut s, CaptureOptions::new(), |cs| Ok(graphed.step(cs)?)).unwrap();
        for i in 0..3 {
            let le = eager.step(&s).unwrap().to_vec(&s).unwrap();
            g.replay(&s).unwrap();
            assert_bits_eq(
                &loss.to_vec(&s).unwrap(),
                &le,
                format!("{dtype} loss, step {i}"),
            );
            for (k, (a, b)) in graphed
                .snapshot(&s)
                .iter()
                .zip(eager.snapshot(&s))
                .enumerate()
            {
                assert_bits_eq(a, &b, format!("{dtype} step {i}, buffer {k}"));
            }
        }
    }
}

#[test]
fn the_loss_falls_over_a_few_steps() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for dtype in [Dtype::Bf16, Dtype::F32] {
        let mut m = Setup::new(&s, dtype);
        let first = m.step(&s).unwrap().to_vec(&s).unwrap()[0];
        // At initialisation the logits are near zero: the loss is about ln(vocab).
        assert!(
            (first - (TINY.vocab as f32).ln()).abs() < 0.3,
            "{dtype}: first loss {first}"
        );
        let mut last = first;
        for _ in 0..30 {
            last = m.step(&s).unwrap().to_vec(&s).unwrap()[0];
            assert!(last.is_finite(), "{dtype}");
        }
        assert!(last < 0.7 * first, "{dtype}: {first} → {last}");
    }
}

#[test]
fn parameters_are_gpt2s() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let cfg = GptConfig {
        vocab: 50,
        positions: 64,
        hidden: 64,
        heads: 4,
        layers: 3,
    };
    let m = Gpt::new(&s, cfg, &mut HostRng::new(1)).unwrap();
    let p = m.parameters();
    // wte, wpe, 12 per block, ln_f: the lm_head is the token embedding (tied).
    assert_eq!(p.len(), 2 + 12 * 3 + 2);
    assert_eq!(p[0].shape(), &[50, 64]);
    assert_eq!(p[1].shape(), &[64, 64]);
    let by_name = |n: &str| p.iter().find(|q| q.name() == n).expect(n).clone();
    assert_eq!(by_name("h.0.attn.c_attn.weight").shape(), &[192, 64]);
    assert_eq!(by_name("h.2.mlp.c_fc.weight").shape(), &[256, 64]);
    assert_eq!(by_name("h.2.mlp.c_proj.weight").shape(), &[64, 256]);
    let std = |n: &str| {
        let v = s.to_vec(by_name(n).data().unwrap()).unwrap();
        (v.iter().map(|x| (x * x) as f64).sum::<f64>() / v.len() as f64).sqrt()
    };
    // Normal 0.02, and 0.02 / √(2 · layers) for the residual projections (within 10 %).
    for (n, want) in [
        ("wte.weight", 0.02),
        ("h.1.mlp.c_fc.weight", 0.02),
        ("h.1.attn.c_proj.weight", 0.02 / 6f64.sqrt()),
        ("h.1.mlp.c_proj.weight", 0.02 / 6f64.sqrt()),
    ] {
        let got = std(n);
        assert!(
            (got - want).abs() < 0.1 * want,
            "{n}: std {got}, want {want}"
        );
    }
    assert!(s
        .to_vec(by_name("h.0.ln_1.weight").data().unwrap())
        .unwrap()
        .iter()
        .all(|&v| v == 1.0));
    assert!(s
        .to_vec(by_name("h.0.attn.c_attn.bias").data().unwrap())
        .unwrap()
        .iter()
        .all(|&v| v == 0.0));
}

#[test]
fn misuse_is_a_typed_error() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let bad = |cfg: GptConfig| {
        matches!(
            Gpt::new(&s, cfg, &mut HostRng::new(1)),
            Err(NnError::Shape(_))
        )
    };
    assert!(bad(GptConfig { heads: 3, ..TINY }));
    assert!(bad(GptConfig { layers: 0, ..TINY }));
    let m = Gpt::new(&s, TINY, &mut HostRng::new(1)).unwrap();
    let ids = Arc::new(s.alloc_from_host(&[1i32; 12]).unwrap());
    let short = Arc::new(s.alloc_from_host(&[0i32; 11]).unwrap());
    assert!(matches!(
        m.forward(&s, &ids, &short, 1),
        Err(NnError::Shape(_))
    ));
    assert!(matches!(
        m.forward(&s, &ids, &ids, 5),
        Err(NnError::Shape(_))
    ));
    assert!(m.forward(&s, &ids, &ids, 2).is_ok());
}
