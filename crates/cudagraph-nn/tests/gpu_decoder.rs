//! GPU tests of the decoder language model (`Decoder`, `DecoderCache`): tiny random GPT-2,
//! Llama and Qwen2 models (two layers, width 64, four heads; Llama with two key/value heads,
//! Llama 3 rotary scaling and an untied head; Qwen2 with q, k and v biases and a tied head;
//! Llama with one key/value head and every bias; vocabulary 97) written as safetensors bytes in memory and
//! read through `DecoderWeights::from_files`, checked against an f64 CPU forward of the whole
//! model written here from the Hugging Face definitions: a prefill with every token's logits,
//! decode steps one token at a time, rows of different lengths padded as the contract says
//! (equal to each row run alone), a decode step captured once and replayed with advancing
//! positions (equal to eager bit for bit), loading from a folder, and misuse as typed errors.
//!
//! Tolerances against the reference, relative to its largest |logit|:
//! - f32: 1e-4. The products accumulate in f32 over at most 256 terms, softmax and norms are f32
//!   (`__expf`, a few ulp), the rotary angle is an f32 product: errors of order 1e-6 relative
//!   (measured on an H200: at most 7e-7 over the four models).
//! - f16: 5e-3; bf16: 4e-2, eight times as much, as bf16's unit roundoff (2⁻⁸) is eight times
//!   f16's (2⁻¹¹). Activations are rounded to the model's type after every operation, as
//!   Hugging Face rounds them, about a dozen roundings a layer over two layers, and the
//!   reference does not round at all (it uses the same rounded weights). Measured on an H200,
//!   the worst over the four models and every check: f16 1.7e-3, bf16 2.2e-2 — in the ratio
//!   of the unit roundoffs, so rounding, not a wrong term (a wrong term shows in f32 first).
//!
//! A row batched with others against the same row alone (same kernels) is held to the
//! project's tolerance between two runs of ours, [`consistency`]: f32 1e-4, 16-bit 2e-2.

use cudagraph::memory::{bf16, f16};
use cudagraph::testing::assert_bits_eq;
use cudagraph::{gpu_test_device, CaptureOptions, DeviceBuffer, Graph, QueueExt, Stream};
use cudagraph_nn::io::hf::{DecoderConfig, DecoderWeights};
use cudagraph_nn::*;
#[path = "common/temp.rs"]
mod temp;
#[path = "common/tiny_decoder.rs"]
mod tiny_decoder;

use temp::temp_dir;

use tiny_decoder::{safetensors_bytes, weights, Lcg, GPT2, LLAMA, LLAMA_BIASED, QWEN2};

const VOCAB: usize = 97;

/// The f64 reference model: the weights rounded to the decoder's dtype (as the decoder and
/// Hugging Face's `model.to(dtype)` hold them), every activation in f64.
struct Reference {
    w: DecoderWeights,
    dt: Dtype,
}

impl Reference {
    fn get(&self, name: &str) -> Vec<f64> {
        self.w
            .get(name)
            .unwrap_or_else(|| panic!("no {name}"))
            .to_f32()
            .into_iter()
            .map(|v| self.dt.round(v) as f64)
            .collect()
    }

    /// `name` when the weights hold it (the biases a config asks for).
    fn opt(&self, name: String) -> Option<String> {
        self.w.get(&name).is_some().then_some(name)
    }

    /// `x · Wᵀ (+ b)` for `W: [out, in]`.
    fn linear(&self, x: &[f64], w: &str, b: Option<&str>) -> Vec<f64> {
        let w = self.get(w);
        let k = x.len();
        let out = w.len() / k;
        let b = b.map(|b| self.get(b));
        (0..out)
            .map(|o| {
                let s: f64 = (0..k).map(|i| w[o * k + i] * x[i]).sum();
                s + b.as_ref().map_or(0.0, |b| b[o])
            })
            .collect()
    }

    fn norm(&self, x: &[f64], w: &str, b: Option<&str>, eps: f64, rms: bool) -> Vec<f64> {
        let n = x.len() as f64;
        let mu = if rms { 0.0 } else { x.iter().sum::<f64>() / n };
        let var = x.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / n;
        let rs = 1.0 / (var + eps).sqrt();
        let w = self.get(w);
        let b = b.map(|b| self.get(b));
        (0..x.len())
            .map(|i| (x[i] - mu) * rs * w[i] + b.as_ref().map_or(0.0, |b| b[i]))
            .collect()
    }

    /// Logits `[ids.len()][VOCAB]` of the sequence `ids` at positions `0..`.
    fn forward(&self, ids: &[i32]) -> Vec<Vec<f64>> {
        let cfg = &self.w.config;
        let gpt2 = matches!(cfg, DecoderConfig::Gpt2(_));
        let (d, heads, kv_heads, hd, eps, layers) = match cfg {
            DecoderConfig::Gpt2(c) => (
                c.n_embd,
                c.n_head,
                c.n_head,
                c.n_embd / c.n_head,
                c.layer_norm_epsilon,
                c.n_layer,
            ),
            DecoderConfig::Llama(c) => (
                c.hidden_size,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.rms_norm_eps,
                c.num_hidden_layers,
            ),
        };
        let inv_freq: Vec<f64> = match cfg {
            DecoderConfig::Gpt2(_) => vec![],
            DecoderConfig::Llama(c) => (0..hd / 2)
                .map(|j| {
                    let f = c.rope_theta.powf(-((2 * j) as f64) / hd as f64);
                    match &c.rope_scaling {
                        None => f,
                        Some(s) => {
                            let old = s.original_max_position_embeddings;
                            let wl = 2.0 * std::f64::consts::PI / f;
                            if wl < old / s.high_freq_factor {
                                f
                            } else if wl > old / s.low_freq_factor {
                                f / s.factor
                            } else {
                                let sm = (old / wl - s.low_freq_factor)
                                    / (s.high_freq_factor - s.low_freq_factor);
                                (1.0 - sm) * f / s.factor + sm * f
                            }
                        }
                    }
                })
                .collect(),
        };
        let rope = |v: &mut [f64], pos: usize| {
            for j in 0..hd / 2 {
                let (sn, cs) = (pos as f64 * inv_freq[j]).sin_cos();
                let (a, b) = (v[j], v[j + hd / 2]);
                v[j] = a * cs - b * sn;
                v[j + hd / 2] = b * cs + a * sn;
            }
        };
        let l = ids.len();
        let (wte_name, prefix) = if gpt2 {
            ("wte.weight", "h.")
        } else {
            ("model.embed_tokens.weight", "model.layers.")
        };
        let wte = self.get(wte_name);
        let wpe = gpt2.then(|| self.get("wpe.weight"));
        let mut x: Vec<Vec<f64>> = (0..l)
            .map(|t| {
                let id = ids[t] as usize;
                (0..d)
                    .map(|c| wte[id * d + c] + wpe.as_ref().map_or(0.0, |p| p[t * d + c]))
                    .collect()
            })
            .collect();
        for i in 0..layers {
            let p = |n: &str| format!("{prefix}{i}.{n}");
            let mut q = vec![vec![0.0; heads * hd]; l];
            let mut k = vec![vec![0.0; kv_heads * hd]; l];
            let mut v = vec![vec![0.0; kv_heads * hd]; l];
            for t in 0..l {
                if gpt2 {
                    let h = self.norm(&x[t], &p("ln_1.weight"), Some(&p("ln_1.bias")), eps, false);
                    let qkv =
                        self.linear(&h, &p("attn.c_attn.weight"), Some(&p("attn.c_attn.bias")));
                    q[t].copy_from_slice(&qkv[..d]);
                    k[t].copy_from_slice(&qkv[d..2 * d]);
                    v[t].copy_from_slice(&qkv[2 * d..]);
                } else {
                    let h = self.norm(&x[t], &p("input_layernorm.weight"), None, eps, true);
                    let proj = |n: &str| {
                        let b = self.opt(p(&format!("self_attn.{n}.bias")));
                        self.linear(&h, &p(&format!("self_attn.{n}.weight")), b.as_deref())
                    };
                    q[t] = proj("q_proj");
                    k[t] = proj("k_proj");
                    v[t] = proj("v_proj");
                    for hh in 0..heads {
                        rope(&mut q[t][hh * hd..(hh + 1) * hd], t);
                    }
                    for hh in 0..kv_heads {
                        rope(&mut k[t][hh * hd..(hh + 1) * hd], t);
                    }
                }
            }
            let scale = 1.0 / (hd as f64).sqrt();
            for t in 0..l {
                let mut att = vec![0.0; heads * hd];
                for hh in 0..heads {
                    let kh = hh / (heads / kv_heads);
                    let qv = &q[t][hh * hd..(hh + 1) * hd];
                    let s: Vec<f64> = (0..=t)
                        .map(|j| {
                            let kv = &k[j][kh * hd..(kh + 1) * hd];
                            qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f64>() * scale
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for j in 0..=t {
                        for c in 0..hd {
                            att[hh * hd + c] += e[j] / z * v[j][kh * hd + c];
                        }
                    }
                }
                let (o, b) = if gpt2 {
                    (p("attn.c_proj.weight"), Some(p("attn.c_proj.bias")))
                } else {
                    (
                        p("self_attn.o_proj.weight"),
                        self.opt(p("self_attn.o_proj.bias")),
                    )
                };
                let o = self.linear(&att, &o, b.as_deref());
                for c in 0..d {
                    x[t][c] += o[c];
                }
                let y = if gpt2 {
                    let h = self.norm(&x[t], &p("ln_2.weight"), Some(&p("ln_2.bias")), eps, false);
                    let a: Vec<f64> = self
                        .linear(&h, &p("mlp.c_fc.weight"), Some(&p("mlp.c_fc.bias")))
                        .into_iter()
                        .map(|u| {
                            let c = (2.0 / std::f64::consts::PI).sqrt();
                            0.5 * u * (1.0 + (c * (u + 0.044715 * u * u * u)).tanh())
                        })
                        .collect();
                    self.linear(&a, &p("mlp.c_proj.weight"), Some(&p("mlp.c_proj.bias")))
                } else {
                    let h = self.norm(
                        &x[t],
                        &p("post_attention_layernorm.weight"),
                        None,
                        eps,
                        true,
                    );
                    let mlp = |x: &[f64], n: &str| {
                        let b = self.opt(p(&format!("mlp.{n}.bias")));
                        self.linear(x, &p(&format!("mlp.{n}.weight")), b.as_deref())
                    };
                    let g = mlp(&h, "gate_proj");
                    let u = mlp(&h, "up_proj");
                    let a: Vec<f64> = g
                        .iter()
                        .zip(&u)
                        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                        .collect();
                    mlp(&a, "down_proj")
                };
                for c in 0..d {
                    x[t][c] += y[c];
                }
            }
        }
        let head = if cfg.tied() {
            wte_name
        } else {
            "lm_head.weight"
        };
        (0..l)
            .map(|t| {
                let h = if gpt2 {
                    self.norm(&x[t], "ln_f.weight", Some("ln_f.bias"), eps, false)
                } else {
                    self.norm(&x[t], "model.norm.weight", None, eps, true)
                };
                self.linear(&h, head, None)
            })
            .collect()
    }
}

/// Against the f64 reference (see the module docs).
fn tolerance(dt: Dtype) -> f64 {
    match dt {
        Dtype::F32 => 1e-4,
        Dtype::F16 => 5e-3,
        _ => 4e-2,
    }
}

/// Between two runs of ours on the same rows (batched and alone).
fn consistency(dt: Dtype) -> f64 {
    match dt {
        Dtype::F32 => 1e-4,
        _ => 2e-2,
    }
}

/// `got` (`rows × VOCAB`) against `want`, within the dtype's tolerance relative to the
/// largest |logit| of `want`.
fn check(dt: Dtype, got: &[f32], want: &[Vec<f64>], what: &str) {
    assert_eq!(got.len(), want.len() * VOCAB, "{what}: length");
    let scale = want
        .iter()
        .flatten()
        .fold(0.0f64, |m, v| m.max(v.abs()))
        .max(1e-3);
    let tol = tolerance(dt) * scale;
    let mut worst = 0.0f64;
    for (r, row) in want.iter().enumerate() {
        for (c, w) in row.iter().enumerate() {
            let g = got[r * VOCAB + c] as f64;
            assert!(
                (g - w).abs() <= tol && g.is_finite(),
                "{what}: row {r} logit {c}: {g} vs {w} (tolerance {tol})"
            );
            worst = worst.max((g - w).abs());
        }
    }
    println!(
        "{what}: worst error {:.2e} of the largest logit",
        worst / scale
    );
}

fn ids_of(seed: u64, n: usize) -> Vec<i32> {
    let mut rng = Lcg(seed);
    (0..n)
        .map(|_| ((rng.next() + 1.0) * 0.5 * VOCAB as f64) as i32 % VOCAB as i32)
        .collect()
}

fn buf(s: &Stream, v: &[i32]) -> DeviceBuffer<i32> {
    s.alloc_from_host(v).unwrap()
}

/// Runs one call eagerly and returns the logits.
#[allow(clippy::too_many_arguments)]
fn run(
    s: &Stream,
    dec: &Decoder,
    cache: &DecoderCache,
    ids: &[i32],
    pos: &[i32],
    slots: &[i32],
    (rows, tokens): (usize, usize),
    lf: LogitsFor,
) -> Vec<f32> {
    let out_rows = match lf {
        LogitsFor::All => rows * tokens,
        LogitsFor::Last => rows,
    };
    let logits = s.alloc::<f32>(out_rows * VOCAB).unwrap();
    let (i, p, sl) = (buf(s, ids), buf(s, pos), buf(s, slots));
    dec.forward(s, cache, &i, &p, &sl, (rows, tokens), lf, &logits)
        .unwrap();
    let v = s.to_vec(&logits).unwrap();
    s.synchronize().unwrap();
    v
}

fn models() -> [(&'static str, &'static str); 4] {
    [
        ("gpt2", GPT2),
        ("llama", LLAMA),
        ("qwen2", QWEN2),
        ("llama with biases", LLAMA_BIASED),
    ]
}

/// (1) a prefill with every token's logits, then (2) decode steps one token at a time, each
/// equal to the reference on the whole sequence so far; in slot 1 of a two-slot cache.
#[test]
fn prefill_then_decode_matches_the_reference() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for (name, json) in models() {
        let w = weights(json, 7);
        for dt in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            let what = format!("{name} {dt}");
            let dec = Decoder::from_weights(&s, &w, dt).unwrap();
            assert_eq!(dec.vocab(), VOCAB);
            assert_eq!(dec.dtype(), dt);
            let reference = Reference { w: w.clone(), dt };
            let cache = dec.new_cache(&s, 2, 24).unwrap();
            let mut seq = ids_of(11, 7);
            let pos: Vec<i32> = (0..7).collect();
            let got = run(&s, &dec, &cache, &seq, &pos, &[1], (1, 7), LogitsFor::All);
            check(
                dt,
                &got,
                &reference.forward(&seq),
                &format!("{what} prefill"),
            );
            for (step, tok) in ids_of(12, 6).into_iter().enumerate() {
                let p = seq.len() as i32;
                seq.push(tok);
                let got = run(
                    &s,
                    &dec,
                    &cache,
                    &[tok],
                    &[p],
                    &[1],
                    (1, 1),
                    LogitsFor::Last,
                );
                let want = reference.forward(&seq);
                check(
                    dt,
                    &got,
                    &want[want.len() - 1..],
                    &format!("{what} decode step {step}"),
                );
            }
            // Last on a prefill: the last token's row of All.
            let cache2 = dec.new_cache(&s, 1, 24).unwrap();
            let last = run(
                &s,
                &dec,
                &cache2,
                &seq[..5],
                &pos[..5],
                &[0],
                (1, 5),
                LogitsFor::Last,
            );
            let want = reference.forward(&seq[..5]);
            check(
                dt,
                &last,
                &want[4..],
                &format!("{what} prefill, last token"),
            );
        }
    }
}

/// A model with a sliding window (Mistral's) runs sequences up to the window, where it is full
/// attention: a longer cache is refused with the reason, and within it the logits match the
/// reference (which attends to every position).
#[test]
fn a_sliding_window_bounds_the_sequence() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(LLAMA).unwrap();
    cfg["model_type"] = "mistral".into();
    cfg["sliding_window"] = 16.into();
    let w = weights(&cfg.to_string(), 91);
    let dec = Decoder::from_weights(&s, &w, Dtype::F32).unwrap();
    assert_eq!(dec.max_positions(), 16);
    let msg = dec.new_cache(&s, 1, 17).err().unwrap().to_string();
    assert!(msg.contains("sliding window of 16"), "{msg}");
    let cache = dec.new_cache(&s, 1, 16).unwrap();
    let seq = ids_of(92, 16);
    let pos: Vec<i32> = (0..16).collect();
    let got = run(&s, &dec, &cache, &seq, &pos, &[0], (1, 16), LogitsFor::All);
    let reference = Reference { w, dt: Dtype::F32 };
    check(
        Dtype::F32,
        &got,
        &reference.forward(&seq),
        "mistral, window 16",
    );
}

/// (3) Rows of different lengths in one call, padded at their end with positions continuing
/// past the real length, in slots out of order, equal each row run alone; then one batched
/// decode step (each row's next token at its real length, overwriting the padded keys) equals
/// the reference on each row's sequence.
#[test]
fn rows_of_different_lengths_equal_each_row_alone() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for (name, json) in models() {
        let w = weights(json, 21);
        for dt in [Dtype::F32, Dtype::Bf16] {
            let what = format!("{name} {dt}");
            let dec = Decoder::from_weights(&s, &w, dt).unwrap();
            let reference = Reference { w: w.clone(), dt };
            let lens = [5usize, 3, 6];
            let slots = [2i32, 0, 1];
            let tokens = 6;
            let seqs: Vec<Vec<i32>> = lens
                .iter()
                .enumerate()
                .map(|(b, &l)| ids_of(30 + b as u64, l))
                .collect();
            let (mut ids, mut pos) = (Vec::new(), Vec::new());
            for seq in &seqs {
                // The real tokens, then padding (any id) at the positions that follow.
                ids.extend(seq.iter().copied().chain(std::iter::repeat(3)).take(tokens));
                pos.extend(0..tokens as i32);
            }
            let cache = dec.new_cache(&s, 3, 16).unwrap();
            let got = run(
                &s,
                &dec,
                &cache,
                &ids,
                &pos,
                &slots,
                (3, tokens),
                LogitsFor::All,
            );
            for (b, seq) in seqs.iter().enumerate() {
                let alone_cache = dec.new_cache(&s, 1, 16).unwrap();
                let n = lens[b];
                let alone = run(
                    &s,
                    &dec,
                    &alone_cache,
                    seq,
                    &pos[..n],
                    &[0],
                    (1, n),
                    LogitsFor::All,
                );
                let mine = &got[b * tokens * VOCAB..(b * tokens + n) * VOCAB];
                let want = reference.forward(seq);
                check(dt, mine, &want, &format!("{what} row {b} in the batch"));
                check(dt, &alone, &want, &format!("{what} row {b} alone"));
                // Same kernels, same row: within the tolerance of each other too.
                let scale = want.iter().flatten().fold(0.0f64, |m, v| m.max(v.abs()));
                for (i, (a, c)) in mine.iter().zip(&alone).enumerate() {
                    assert!(
                        ((a - c).abs() as f64) <= consistency(dt) * scale,
                        "{what} row {b}: element {i}: {a} batched, {c} alone"
                    );
                }
            }
            // One decode step for all rows at their real lengths.
            let next = ids_of(40, 3);
            let step_pos: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let got = run(
                &s,
                &dec,
                &cache,
                &next,
                &step_pos,
                &slots,
                (3, 1),
                LogitsFor::Last,
            );
            for (b, seq) in seqs.iter().enumerate() {
                let mut full = seq.clone();
                full.push(next[b]);
                let want = reference.forward(&full);
                check(
                    dt,
                    &got[b * VOCAB..(b + 1) * VOCAB],
                    &want[want.len() - 1..],
                    &format!("{what} row {b} decode after padding"),
                );
            }
        }
    }
}

/// (4) One decode step of two rows captured once; replays with new ids and advancing
/// positions equal the same step run eagerly on a second cache, bit for bit.
#[test]
fn a_captured_decode_step_replays_like_eager() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    for (name, json) in models() {
        let w = weights(json, 51);
        for dt in [Dtype::F32, Dtype::Bf16] {
            let what = format!("{name} {dt}");
            let dec = Decoder::from_weights(&s, &w, dt).unwrap();
            let graphed = dec.new_cache(&s, 2, 20).unwrap();
            let eager = dec.new_cache(&s, 2, 20).unwrap();
            let scratch = dec.new_cache(&s, 2, 20).unwrap();
            let prompt = ids_of(52, 8);
            let ppos: Vec<i32> = (0..4).chain(0..4).collect();
            for c in [&graphed, &eager] {
                run(
                    &s,
                    &dec,
                    c,
                    &prompt,
                    &ppos,
                    &[0, 1],
                    (2, 4),
                    LogitsFor::Last,
                );
            }
            // An eager step of the captured shapes first: the product engines are measured
            // and chosen before the capture, so eager and replay run the same ones.
            run(
                &s,
                &dec,
                &scratch,
                &[1, 2],
                &[0, 0],
                &[0, 1],
                (2, 1),
                LogitsFor::Last,
            );
            let ids = buf(&s, &[0, 0]);
            let pos = buf(&s, &[4, 4]);
            let slots = buf(&s, &[0, 1]);
            let out_g = s.alloc::<f32>(2 * VOCAB).unwrap();
            let out_e = s.alloc::<f32>(2 * VOCAB).unwrap();
            let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
                dec.forward(
                    cs,
                    &graphed,
                    &ids,
                    &pos,
                    &slots,
                    (2, 1),
                    LogitsFor::Last,
                    &out_g,
                )?;
                Ok(())
            })
            .unwrap();
            for step in 0..5 {
                let tok = ids_of(60 + step as u64, 2);
                s.copy_from_host(&tok, &ids).unwrap();
                s.copy_from_host(&[4 + step, 4 + step], &pos).unwrap();
                g.replay(&s).unwrap();
                dec.forward(
                    &s,
                    &eager,
                    &ids,
                    &pos,
                    &slots,
                    (2, 1),
                    LogitsFor::Last,
                    &out_e,
                )
                .unwrap();
                let (a, b) = (s.to_vec(&out_g).unwrap(), s.to_vec(&out_e).unwrap());
                s.synchronize().unwrap();
                assert_bits_eq(&a, &b, format_args!("{what} step {step}"));
                assert!(a.iter().all(|v| v.is_finite()), "{what} step {step}");
            }
        }
    }
}

/// `Decoder::load` reads a folder and gives the same logits as `from_weights`; a folder
/// without weights is an `Io` error naming it.
#[test]
fn a_folder_loads_like_the_weights_it_holds() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let dir = temp_dir("decoder");
    std::fs::write(dir.join("config.json"), LLAMA).unwrap();
    let config = DecoderConfig::from_json(LLAMA).unwrap();
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors_bytes(&config, 71),
    )
    .unwrap();
    let loaded = Decoder::load(&s, &dir, Dtype::Bf16).unwrap();
    let built = Decoder::from_weights(&s, &weights(LLAMA, 71), Dtype::Bf16).unwrap();
    assert_eq!(loaded.config(), built.config());
    assert_eq!(loaded.max_positions(), 64);
    let ids = ids_of(72, 5);
    let pos: Vec<i32> = (0..5).collect();
    let a = run(
        &s,
        &loaded,
        &loaded.new_cache(&s, 1, 8).unwrap(),
        &ids,
        &pos,
        &[0],
        (1, 5),
        LogitsFor::All,
    );
    let b = run(
        &s,
        &built,
        &built.new_cache(&s, 1, 8).unwrap(),
        &ids,
        &pos,
        &[0],
        (1, 5),
        LogitsFor::All,
    );
    assert_bits_eq(&a, &b, "loaded vs built");
    let empty = temp_dir("decoder");
    assert!(matches!(
        Decoder::load(&s, &empty, Dtype::F32),
        Err(NnError::Io(_))
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&empty);
}

/// (5) Misuse: short buffers, rows past the slots, tokens past the cache, a cache of another
/// dtype, a cache longer than the model's positions: typed errors before anything runs; a
/// slot outside the cache and a token id outside the vocabulary (device data): reported at
/// the next synchronisation.
#[test]
fn misuse_is_a_typed_error() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let w = weights(GPT2, 81);
    let dec = Decoder::from_weights(&s, &w, Dtype::F32).unwrap();
    let dec16 = Decoder::from_weights(&s, &w, Dtype::Bf16).unwrap();
    let cache = dec.new_cache(&s, 2, 8).unwrap();
    let ids = buf(&s, &[1, 2, 3, 4]);
    let pos = buf(&s, &[0, 1, 0, 1]);
    let slots = buf(&s, &[0, 1]);
    let logits = s.alloc::<f32>(4 * VOCAB).unwrap();
    let short = s.alloc::<f32>(4 * VOCAB - 1).unwrap();
    let size =
        |r: Result<()>| matches!(r, Err(NnError::Core(cudagraph::Error::SizeMismatch { .. })));
    let f =
        |i: &DeviceBuffer<i32>,
         p: &DeviceBuffer<i32>,
         sl: &DeviceBuffer<i32>,
         rt,
         lf,
         out: &DeviceBuffer<f32>| { dec.forward(&s, &cache, i, p, sl, rt, lf, out) };
    assert!(f(&ids, &pos, &slots, (2, 2), LogitsFor::All, &logits).is_ok());
    s.synchronize().unwrap();
    assert!(size(f(&ids, &pos, &slots, (2, 2), LogitsFor::All, &short)));
    assert!(f(&ids, &pos, &slots, (2, 2), LogitsFor::Last, &short).is_ok());
    let one = buf(&s, &[0]);
    assert!(size(f(&ids, &pos, &one, (2, 2), LogitsFor::Last, &logits)));
    assert!(size(f(
        &one,
        &pos,
        &slots,
        (2, 2),
        LogitsFor::Last,
        &logits
    )));
    assert!(size(f(
        &ids,
        &one,
        &slots,
        (2, 2),
        LogitsFor::Last,
        &logits
    )));
    let three = buf(&s, &[0, 1, 1]);
    assert!(matches!(
        f(&ids, &pos, &three, (3, 1), LogitsFor::Last, &logits),
        Err(NnError::Shape(_))
    ));
    let long_ids = buf(&s, &[0; 9]);
    let long_logits = s.alloc::<f32>(9 * VOCAB).unwrap();
    assert!(matches!(
        f(
            &long_ids,
            &long_ids,
            &slots,
            (1, 9),
            LogitsFor::All,
            &long_logits
        ),
        Err(NnError::Shape(_))
    ));
    assert!(matches!(
        f(&ids, &pos, &slots, (0, 2), LogitsFor::All, &logits),
        Err(NnError::Shape(_))
    ));
    let cache16 = dec16.new_cache(&s, 2, 8).unwrap();
    assert!(matches!(
        dec.forward(
            &s,
            &cache16,
            &ids,
            &pos,
            &slots,
            (2, 2),
            LogitsFor::All,
            &logits
        ),
        Err(NnError::Dtype { .. })
    ));
    assert!(matches!(dec.new_cache(&s, 1, 33), Err(NnError::Shape(_))));
    s.synchronize().unwrap();
    // Device data: a slot outside the cache, then an id outside the vocabulary.
    let bad_slot = buf(&s, &[0, 2]);
    f(&ids, &pos, &bad_slot, (2, 2), LogitsFor::Last, &logits).unwrap();
    let e = s.synchronize().unwrap_err();
    assert!(e.to_string().contains("attention cache slot"), "{e}");
    let bad_id = buf(&s, &[1, 2, 3, VOCAB as i32]);
    f(&bad_id, &pos, &slots, (2, 2), LogitsFor::Last, &logits).unwrap();
    let e = s.synchronize().unwrap_err();
    assert!(e.to_string().contains("decoder token id"), "{e}");
    // The stream stays usable.
    f(&ids, &pos, &slots, (2, 2), LogitsFor::Last, &logits).unwrap();
    s.synchronize().unwrap();
}

/// The decoder's attention kernel (flash decoding: keys split over blocks, each key row read
/// once for the query heads sharing it) against the KV cache's (head dimension over lanes, one
/// block per head) on caches of 2600 positions: head dimensions served by 16-byte loads (64,
/// 80, 96, 128, 256) and by pair loads (6), one to eight query heads per key/value head (more
/// than one block's four), a single token (the most splits), 2×2 tokens and 64 tokens (more
/// blocks than the device holds at once: the instances held to fewer registers), rows mapped
/// to slots out of order, lengths 1 to 2600. Equal within f32 rounding (1e-5 of the largest
/// |output|; the two sum in different orders), within one unit of the last place of bf16
/// (2⁻⁷ of the largest value) and f16 (2⁻¹⁰).
#[test]
fn the_two_attention_kernels_agree_on_long_caches() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for d in [64, 80, 128, 256, 6] {
        agree::<f32>(&s, (4, 2, d), (2, 2), 1e-5, 2600);
    }
    agree::<f32>(&s, (8, 1, 64), (1, 1), 1e-5, 2600);
    agree::<f32>(&s, (12, 2, 96), (1, 1), 1e-5, 2600);
    agree::<f32>(&s, (12, 2, 96), (3, 1), 1e-5, 2600);
    for (h, kv, d) in [(4, 2, 64), (12, 2, 96), (8, 1, 128), (4, 4, 6)] {
        for bt in [(1, 1), (2, 2)] {
            agree::<bf16>(&s, (h, kv, d), bt, 1.0 / 128.0, 2600);
        }
    }
    agree::<f16>(&s, (32, 8, 64), (1, 1), 1.0 / 1024.0, 2600);
    agree::<f16>(&s, (4, 2, 80), (2, 2), 1.0 / 1024.0, 2600);
    // Short caches and few blocks: the splits merge inside a thread-block cluster (sm_90+).
    agree::<f32>(&s, (4, 2, 64), (1, 1), 1e-5, 200);
    agree::<f32>(&s, (4, 2, 64), (2, 2), 1e-5, 200);
    agree::<bf16>(&s, (32, 8, 64), (1, 1), 1.0 / 128.0, 200);
    agree::<bf16>(&s, (12, 12, 64), (1, 1), 1.0 / 128.0, 200);
    agree::<f16>(&s, (4, 4, 6), (2, 1), 1.0 / 1024.0, 200);
    // More blocks than the device holds at once: the instances held to fewer registers (one
    // query head a block, and up to four).
    agree::<bf16>(&s, (12, 12, 64), (64, 1), 1.0 / 128.0, 2600);
    agree::<f32>(&s, (12, 12, 64), (64, 1), 1e-5, 2600);
    agree::<bf16>(&s, (32, 8, 64), (64, 1), 1.0 / 128.0, 2600);
    agree::<f16>(&s, (8, 1, 128), (16, 4), 1.0 / 1024.0, 2600);
}

fn agree<T: cudagraph_nn::dtype::Float>(
    s: &Stream,
    (heads, kv_heads, d): (usize, usize, usize),
    (batch, tokens): (usize, usize),
    tol: f64,
    max_len: usize,
) {
    use cudagraph::Queue;
    use cudagraph_nn::kernels::attention::AttentionKernels;
    use cudagraph_nn::kernels::decoder::DecoderKernels;
    let shape = AttentionShape {
        batch,
        slots: 3,
        tokens,
        heads,
        kv_heads,
        max_len,
        head_dim: d,
    };
    let mut rng = Lcg((d * 131 + heads) as u64);
    let mut random = |n: usize| -> DeviceBuffer<T> {
        let v: Vec<T> = (0..n).map(|_| T::from_f32(rng.next() as f32)).collect();
        s.alloc_from_host(&v).unwrap()
    };
    let q = random(shape.query_len().unwrap());
    let k = random(shape.cache_len().unwrap());
    let v = random(shape.cache_len().unwrap());
    let lengths = [2599, 0, 1, 1500, 37, 700];
    let pos: Vec<i32> = (0..batch * tokens)
        .map(|i| lengths[i % 6] % max_len as i32)
        .collect();
    let slot_of = [2, 0, 1];
    let slots: Vec<i32> = (0..batch).map(|b| slot_of[b % 3]).collect();
    let (pos, slots) = (buf(s, &pos), buf(s, &slots));
    let n = shape.query_len().unwrap();
    let (oa, ob) = (s.alloc::<T>(n).unwrap(), s.alloc::<T>(n).unwrap());
    let scale = 1.0 / (d as f32).sqrt();
    AttentionKernels::get(s.device())
        .unwrap()
        .attend(s, &shape, &q, (&k, &v), &pos, Some(&slots), &oa, scale)
        .unwrap();
    let dk = DecoderKernels::get(s.device()).unwrap();
    let scratch = dk.attend_scratch::<T>(s, &shape).unwrap();
    // 64 query tokens over a cache of 2600 positions: thousands of blocks, more than a device
    // holds at once, so the instances held to fewer registers are the ones checked.
    if batch * tokens >= 64 {
        assert!(
            scratch.waves(),
            "{heads}/{kv_heads} heads of {d}, {batch}×{tokens}"
        );
    }
    // Twice through one scratch: the arrival counters are left at zero for the next call.
    for _ in 0..2 {
        dk.attend(
            s,
            &shape,
            &q,
            (&k, &v),
            (&pos, &slots),
            &ob,
            scale,
            &scratch,
        )
        .unwrap();
    }
    let (a, b) = (s.to_vec(&oa).unwrap(), s.to_vec(&ob).unwrap());
    s.synchronize().unwrap();
    let what = format!(
        "{} heads {heads}/{kv_heads} of {d}, {batch}×{tokens}, cache {max_len}",
        T::DTYPE
    );
    let big = a.iter().fold(0.0f64, |m, x| m.max(x.to_f32().abs() as f64));
    assert!(big > 0.0, "{what}: all zero");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let (x, y) = (x.to_f32() as f64, y.to_f32() as f64);
        assert!(
            (x - y).abs() <= tol * big,
            "{what}: element {i}: {x} (KV cache's) vs {y} (decoder's)"
        );
    }
}

/// `data` in a buffer starting `offset` bytes into its allocation (an external block over it),
/// so that it is not 16-byte aligned.
fn offset_buffer<T: cudagraph_nn::dtype::Float>(
    s: &Stream,
    data: &[T],
    offset: u64,
) -> DeviceBuffer<T> {
    use cudagraph::{BlockRef, Queue};
    let n = data.len();
    let base = s.alloc::<T>(n + 16).unwrap();
    let bytes = std::mem::size_of_val(data);
    // SAFETY: [addr, addr + bytes) lies inside `base` (n + 16 elements, offset < 16 elements'
    // bytes), which the block keeps alive (the boxed alias) until its last holder is gone;
    // nothing else uses that memory.
    let block = unsafe {
        BlockRef::external(
            base.addr() + offset,
            bytes,
            s.device().ordinal(),
            Box::new(base.alias()),
        )
    };
    let buf = DeviceBuffer::<T>::from_block(block, n).unwrap();
    s.copy_from_host(data, &buf).unwrap();
    buf
}

/// Buffers that are not 16-byte aligned: the norm reads them element by element and the
/// attention with pair loads, giving the aligned results within f32 rounding (the sums run in
/// another order); a query not aligned to two elements is a typed error, not a fault.
#[test]
fn buffers_off_sixteen_bytes_take_the_narrow_loads() {
    use cudagraph_nn::kernels::decoder::DecoderKernels;
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let dk = DecoderKernels::get(&dev).unwrap();
    let mut rng = Lcg(7);
    // Norm: 3 rows of 256 bf16, x and y 4 bytes off.
    let (rows, cols) = (3, 256);
    let xs: Vec<bf16> = (0..rows * cols)
        .map(|_| bf16::from_f32(rng.next() as f32))
        .collect();
    let w = s.alloc_from_host(&vec![1.5f32; cols]).unwrap();
    let x = s.alloc_from_host(&xs).unwrap();
    let y = s.alloc::<bf16>(rows * cols).unwrap();
    let xo = offset_buffer(&s, &xs, 4);
    let yo = offset_buffer(&s, &vec![bf16::ZERO; rows * cols], 4);
    for (xb, yb) in [(&x, &y), (&xo, &yo)] {
        dk.norm(
            &s,
            xb,
            None,
            (&w, None),
            yb,
            (rows, cols),
            (1, 0),
            (1e-5, true),
        )
        .unwrap();
    }
    let (a, b) = (s.to_vec(&y).unwrap(), s.to_vec(&yo).unwrap());
    s.synchronize().unwrap();
    for (i, (p, q)) in a.iter().zip(&b).enumerate() {
        let (p, q) = (p.to_f32(), q.to_f32());
        assert!(
            (p - q).abs() <= 1.0 / 128.0 * p.abs().max(1e-3),
            "norm {i}: {p} vs {q}"
        );
    }
    // Attention: the query 4 bytes off (pair loads) against the aligned query.
    let shape = AttentionShape {
        batch: 1,
        slots: 1,
        tokens: 1,
        heads: 4,
        kv_heads: 2,
        max_len: 300,
        head_dim: 64,
    };
    let mut random =
        |n: usize| -> Vec<bf16> { (0..n).map(|_| bf16::from_f32(rng.next() as f32)).collect() };
    let qv = random(shape.query_len().unwrap());
    let (k, v) = (
        s.alloc_from_host(&random(shape.cache_len().unwrap()))
            .unwrap(),
        s.alloc_from_host(&random(shape.cache_len().unwrap()))
            .unwrap(),
    );
    let (pos, slots) = (buf(&s, &[299]), buf(&s, &[0]));
    let scratch = dk.attend_scratch::<bf16>(&s, &shape).unwrap();
    let n = shape.query_len().unwrap();
    let (oa, ob) = (s.alloc::<bf16>(n).unwrap(), s.alloc::<bf16>(n).unwrap());
    let scale = 0.125;
    let q_al = s.alloc_from_host(&qv).unwrap();
    let q_off = offset_buffer(&s, &qv, 4);
    for (qb, ob) in [(&q_al, &oa), (&q_off, &ob)] {
        dk.attend(
            &s,
            &shape,
            qb,
            (&k, &v),
            (&pos, &slots),
            ob,
            scale,
            &scratch,
        )
        .unwrap();
    }
    let (a, b) = (s.to_vec(&oa).unwrap(), s.to_vec(&ob).unwrap());
    s.synchronize().unwrap();
    let big = a.iter().fold(0.0f32, |m, x| m.max(x.to_f32().abs()));
    assert!(big > 0.0);
    for (i, (p, q)) in a.iter().zip(&b).enumerate() {
        let (p, q) = (p.to_f32(), q.to_f32());
        assert!((p - q).abs() <= big / 128.0, "attention {i}: {p} vs {q}");
    }
    let q_odd = offset_buffer(&s, &qv, 2);
    let err = dk
        .attend(
            &s,
            &shape,
            &q_odd,
            (&k, &v),
            (&pos, &slots),
            &ob,
            scale,
            &scratch,
        )
        .unwrap_err();
    assert!(err.to_string().contains("aligned to two elements"), "{err}");
    s.synchronize().unwrap();
}

/// The norm with a residual: the picked rows of `x` become `x + add` rounded to bf16 (exactly,
/// written back), the other rows stay, and `y` is the RMSNorm of the sum (within bf16
/// rounding of an f64 reference); on 16-byte aligned buffers (vector loads) and 4 bytes off
/// (element loads).
#[test]
fn the_norm_adds_the_residual_into_the_rows_it_reads() {
    use cudagraph_nn::kernels::decoder::DecoderKernels;
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let dk = DecoderKernels::get(&dev).unwrap();
    let mut rng = Lcg(11);
    // 6 rows of x; rows 1, 3, 5 picked (stride 2, offset 1).
    let (all, rows, cols, eps) = (6, 3, 256, 1e-5f32);
    let mut random = |n: usize| -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(4.0 * rng.next() as f32))
            .collect()
    };
    let (xs, adds) = (random(all * cols), random(all * cols));
    let wv: Vec<f32> = (0..cols).map(|c| 0.5 + (c % 7) as f32 * 0.25).collect();
    let w = s.alloc_from_host(&wv).unwrap();
    for offset in [0u64, 4] {
        let x = offset_buffer(&s, &xs, offset);
        let a = offset_buffer(&s, &adds, offset);
        let y = offset_buffer(&s, &vec![bf16::ZERO; rows * cols], offset);
        dk.norm(
            &s,
            &x,
            Some(&a),
            (&w, None),
            &y,
            (rows, cols),
            (2, 1),
            (eps, true),
        )
        .unwrap();
        let (xg, yg) = (s.to_vec(&x).unwrap(), s.to_vec(&y).unwrap());
        s.synchronize().unwrap();
        for r in 0..all {
            for c in 0..cols {
                let i = r * cols + c;
                let want = if r % 2 == 1 {
                    bf16::from_f32(xs[i].to_f32() + adds[i].to_f32())
                } else {
                    xs[i]
                };
                assert_eq!(
                    xg[i].to_bits(),
                    want.to_bits(),
                    "offset {offset}: x[{r}, {c}]"
                );
            }
        }
        for r in 0..rows {
            let row: Vec<f64> = (0..cols)
                .map(|c| xg[(2 * r + 1) * cols + c].to_f32() as f64)
                .collect();
            let ms = row.iter().map(|v| v * v).sum::<f64>() / cols as f64;
            let rs = 1.0 / (ms + eps as f64).sqrt();
            for c in 0..cols {
                let want = row[c] * rs * wv[c] as f64;
                let got = yg[r * cols + c].to_f32() as f64;
                assert!(
                    (got - want).abs() <= want.abs() / 64.0 + 1e-3,
                    "offset {offset}: y[{r}, {c}] = {got}, want {want}"
                );
            }
        }
    }
    // A residual shorter than the rows the norm reads is refused before anything runs.
    let x = s.alloc_from_host(&xs).unwrap();
    let short = s.alloc::<bf16>(all * cols - 1).unwrap();
    let y = s.alloc::<bf16>(rows * cols).unwrap();
    let err = dk
        .norm(
            &s,
            &x,
            Some(&short),
            (&w, None),
            &y,
            (rows, cols),
            (2, 1),
            (eps, true),
        )
        .unwrap_err();
    assert!(err.to_string().contains("decoder norm residual"), "{err}");
}

/// Steps of one token a row: the attention that splits the packed q|k|v product itself
/// (rotating queries and keys, writing each row's key and value into the caches) gives the
/// bits of the split kernel followed by the attention — outputs and both caches — with 16-byte
/// and pair loads, one to eight query heads a key/value head (two blocks of four), with and
/// without rotation, in f32, bf16 and f16, twice through one scratch; more than one token a
/// row and a short product are typed errors.
#[test]
fn the_one_token_attention_splits_the_product_itself() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for rotate in [false, true] {
        // A cache of 700: more splits than a cluster holds, merged through global memory, in
        // one wave (with the early reads); of 200: few blocks, merged inside a cluster
        // (sm_90+), with the early reads.
        for max_len in [700, 200] {
            one_token::<f32>(&s, (4, 2, 64), rotate, max_len);
            one_token::<bf16>(&s, (4, 2, 64), rotate, max_len);
            one_token::<bf16>(&s, (8, 1, 128), rotate, max_len);
            one_token::<f16>(&s, (12, 12, 64), rotate, max_len);
            one_token::<bf16>(&s, (4, 4, 6), rotate, max_len);
        }
    }
}

fn one_token<T: cudagraph_nn::dtype::Float>(
    s: &Stream,
    (heads, kv_heads, d): (usize, usize, usize),
    rotate: bool,
    max_len: usize,
) {
    use cudagraph::Queue;
    use cudagraph_nn::kernels::decoder::{DecoderKernels, QkvDims};
    let batch = 3;
    let shape = AttentionShape {
        batch,
        slots: 3,
        tokens: 1,
        heads,
        kv_heads,
        max_len,
        head_dim: d,
    };
    let what = format!(
        "{} heads {heads}/{kv_heads} of {d}, rotated {rotate}, cache {max_len}",
        T::DTYPE
    );
    let mut rng = Lcg((d * 71 + heads * 7 + kv_heads) as u64);
    let mut random =
        |n: usize| -> Vec<T> { (0..n).map(|_| T::from_f32(rng.next() as f32)).collect() };
    let packed = batch * (heads + 2 * kv_heads) * d;
    let qkv = s.alloc_from_host(&random(packed)).unwrap();
    let cl = shape.cache_len().unwrap();
    let (k0, v0) = (random(cl), random(cl));
    let (ka, va) = (
        s.alloc_from_host(&k0).unwrap(),
        s.alloc_from_host(&v0).unwrap(),
    );
    let (kb, vb) = (
        s.alloc_from_host(&k0).unwrap(),
        s.alloc_from_host(&v0).unwrap(),
    );
    // Positions at the cache's end, its start and inside; slots out of order.
    let last = max_len as i32 - 1;
    let (pos, slots) = (buf(s, &[last, 0, last * 2 / 7]), buf(s, &[2, 0, 1]));
    let freq: Vec<f32> = (0..d / 2)
        .map(|j| 10000f32.powf(-2.0 * j as f32 / d as f32))
        .collect();
    let freq = s.alloc_from_host(&freq).unwrap();
    let freq = rotate.then_some(&freq);
    let ql = shape.query_len().unwrap();
    let (qh, oa, ob) = (
        s.alloc::<T>(ql).unwrap(),
        s.alloc::<T>(ql).unwrap(),
        s.alloc::<T>(ql).unwrap(),
    );
    let scale = 1.0 / (d as f32).sqrt();
    let dk = DecoderKernels::get(s.device()).unwrap();
    let scratch = dk.attend_scratch::<T>(s, &shape).unwrap();
    let dims = QkvDims {
        rows: batch,
        tokens: 1,
        heads,
        kv_heads,
        head_dim: d,
        slots: 3,
        max_len,
    };
    dk.qkv(s, &dims, &qkv, freq, (&pos, &slots), &qh, (&ka, &va))
        .unwrap();
    dk.attend(
        s,
        &shape,
        &qh,
        (&ka, &va),
        (&pos, &slots),
        &oa,
        scale,
        &scratch,
    )
    .unwrap();
    let fused = |shape: &AttentionShape, qkv: &DeviceBuffer<T>| {
        let at = (&pos, &slots);
        dk.attend_qkv(s, shape, qkv, freq, (&kb, &vb), at, &ob, scale, &scratch)
    };
    for _ in 0..2 {
        fused(&shape, &qkv).unwrap();
    }
    // With the early reads: nothing that can still run writes the positions, slots,
    // frequencies or these caches (copies from the host, done before the launches above).
    let (kc, vc, oc) = (
        s.alloc_from_host(&k0).unwrap(),
        s.alloc_from_host(&v0).unwrap(),
        s.alloc::<T>(ql).unwrap(),
    );
    let at = (&pos, &slots);
    // SAFETY: the promise above.
    unsafe {
        dk.attend_qkv_early(
            s,
            &shape,
            &qkv,
            freq,
            (&kc, &vc),
            at,
            &oc,
            scale,
            &scratch,
            true,
        )
    }
    .unwrap();
    let f = |b: &DeviceBuffer<T>| -> Vec<f32> {
        s.to_vec(b).unwrap().iter().map(|x| x.to_f32()).collect()
    };
    let (a, b) = (f(&oa), f(&ob));
    assert!(a.iter().any(|x| *x != 0.0), "{what}: all zero");
    assert_bits_eq(&b, &a, format_args!("{what}: output"));
    assert_bits_eq(&f(&kb), &f(&ka), format_args!("{what}: key cache"));
    assert_bits_eq(&f(&vb), &f(&va), format_args!("{what}: value cache"));
    assert_bits_eq(&f(&oc), &a, format_args!("{what}: output, early reads"));
    assert_bits_eq(
        &f(&kc),
        &f(&ka),
        format_args!("{what}: key cache, early reads"),
    );
    assert_bits_eq(
        &f(&vc),
        &f(&va),
        format_args!("{what}: value cache, early reads"),
    );
    assert_ne!(
        f(&ka),
        k0.iter().map(|x| x.to_f32()).collect::<Vec<_>>(),
        "{what}: no key written"
    );
    let two = AttentionShape { tokens: 2, ..shape };
    let msg = format!("{:?}", fused(&two, &qkv).err());
    assert!(
        msg.contains("one token a row"),
        "{what}: two tokens a row: {msg}"
    );
    let short = s.alloc::<T>(packed - 1).unwrap();
    let msg = format!("{:?}", fused(&shape, &short).err());
    assert!(
        msg.contains("decoder qkv"),
        "{what}: a short product: {msg}"
    );
    s.synchronize().unwrap();
}
