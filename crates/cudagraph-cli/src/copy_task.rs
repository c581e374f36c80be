//! `cudagraph train copy`: a GPT-2-shaped model (`Gpt`) learns to copy: each sequence is a
//! block of `--seq` random tokens followed by its repeat, and the model predicts every token
//! of the repeated half. The whole training step — forward (bf16 autocast with the
//! optimizer's 16-bit copies, or f32), cross-entropy, backward, gradient clipping and AdamW —
//! is captured into one CUDA graph and replayed (`--eager`: run step by step instead).
//!
//! Targets: the next token in the repeated half; token 0 (never drawn, the "blank") at the
//! other positions, so every row has a target and the loss is a plain mean over all rows (the
//! blank half is learnt in a few steps). Accuracy is measured on the repeated half only.
//! `bench/copy_task_torch.py` trains the same model on the same task in PyTorch.

use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use cudagraph::{CaptureOptions, Device, DeviceBuffer, Graph, Queue, QueueExt, Stream};
use cudagraph_nn::{
    autocast_with, clip_grad_norm, cross_entropy, no_grad, Adam, AdamConfig, AutocastOptions,
    Dtype, Gpt, GptConfig, HostRng, OptimOptions, Optimizer, Tensor,
};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Args, Debug)]
pub struct CopyArgs {
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Random tokens per block (each sequence is the block and its repeat: 2 · seq tokens).
    #[arg(long, default_value_t = 32)]
    pub seq: usize,
    /// Vocabulary (token 0 is the blank target; blocks draw from 1..vocab).
    #[arg(long, default_value_t = 64)]
    pub vocab: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Training steps (each on fresh sequences).
    #[arg(long, default_value_t = 3000)]
    pub steps: usize,
    /// AdamW learning rate (betas 0.9, 0.999, weight decay 0.01).
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f32,
    /// Gradient clipping to this total norm.
    #[arg(long, default_value_t = 1.0)]
    pub clip: f32,
    /// `bf16` (autocast, f32 masters and optimizer state) or `f32`.
    #[arg(long, default_value = "bf16")]
    pub dtype: Dtype,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print loss and accuracy every this many steps.
    #[arg(long, default_value_t = 100)]
    pub log_every: usize,
    /// Run the step eagerly instead of replaying one captured graph.
    #[arg(long)]
    pub eager: bool,
}

/// `batches` batches of copy-task sequences: ids and targets, `batch · 2 · seq` each.
fn sequences(a: &CopyArgs, rng: &mut HostRng, batches: usize) -> (Vec<i32>, Vec<i32>) {
    let t = 2 * a.seq;
    let (mut ids, mut tgt) = (Vec::new(), Vec::new());
    for _ in 0..batches * a.batch {
        let block: Vec<i32> = (0..a.seq)
            .map(|_| 1 + (rng.next_u64() % (a.vocab as u64 - 1)) as i32)
            .collect();
        let seq: Vec<i32> = block.iter().chain(&block).copied().collect();
        for i in 0..t {
            ids.push(seq[i]);
            // Position i predicts token i + 1; scored in the repeated half only.
            tgt.push(if i + 1 >= a.seq && i + 1 < t {
                seq[i + 1]
            } else {
                0
            });
        }
    }
    (ids, tgt)
}

/// Correct predictions and predictions in the repeated half of `logits` (one row per token).
fn accuracy(a: &CopyArgs, logits: &[f32], targets: &[i32]) -> (usize, usize) {
    let t = 2 * a.seq;
    let mut correct = 0;
    let mut total = 0;
    for (i, (row, &y)) in logits.chunks(a.vocab).zip(targets).enumerate() {
        let pos = i % t;
        if pos + 1 < a.seq || pos + 1 >= t {
            continue;
        }
        let arg = row
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |(bi, bv), (j, &v)| {
                if v > bv {
                    (j, v)
                } else {
                    (bi, bv)
                }
            })
            .0;
        correct += (arg as i32 == y) as usize;
        total += 1;
    }
    (correct, total)
}

fn check(a: &CopyArgs) -> AnyResult<()> {
    if a.layers == 0 || a.heads == 0 || a.hidden % a.heads.max(1) != 0 {
        return Err(
            "--layers and --heads must be at least 1, with --heads dividing --hidden".into(),
        );
    }
    if a.seq == 0 || a.batch == 0 || a.steps == 0 || a.log_every == 0 || a.vocab < 2 {
        return Err(
            "--seq, --batch, --steps and --log-every must be at least 1, --vocab at least 2".into(),
        );
    }
    if a.dtype == Dtype::F16 {
        return Err("--dtype f16 would need a loss scaler: use bf16 or f32".into());
    }
    Ok(())
}

pub fn run(ordinal: usize, a: &CopyArgs) -> AnyResult<()> {
    check(a)?;
    let tokens = 2 * a.seq;
    let rows = a.batch * tokens;
    let cfg = GptConfig {
        vocab: a.vocab,
        positions: tokens,
        hidden: a.hidden,
        heads: a.heads,
        layers: a.layers,
    };
    let mode = if a.eager { "eager" } else { "cudagraph" };
    outln!(
        "#### copy task, {mode} ({} layers, hidden {}, {} heads, {} + {} tokens, vocab {}, \
         batch {}, {} steps, AdamW lr {}, clip {}, {})",
        a.layers,
        a.hidden,
        a.heads,
        a.seq,
        a.seq,
        a.vocab,
        a.batch,
        a.steps,
        a.lr,
        a.clip,
        match a.dtype {
            Dtype::F32 => "f32".to_string(),
            d => format!("{d} autocast"),
        }
    );
    let dev = Device::open(ordinal)?;
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(a.seed);
    let model = Gpt::new(&s, cfg, &mut rng)?;
    let params = model.parameters();
    let n_params: usize = params.iter().map(|p| p.numel()).sum();
    outln!("- {n_params} parameters");
    let mut opt = Adam::with_options(
        &s,
        params.clone(),
        AdamConfig {
            lr: a.lr,
            ..AdamConfig::adamw()
        },
        OptimOptions {
            copies: (a.dtype != Dtype::F32).then_some(a.dtype),
        },
    )?;
    // Every step's fresh sequences, made up front and uploaded once; each step copies its
    // batch into the static inputs on the device.
    let (all_ids, tgt_host) = sequences(a, &mut rng, a.steps);
    let all_ids = s.alloc_from_host(&all_ids)?;
    let all_tgt = s.alloc_from_host(&tgt_host)?;
    let ids = Arc::new(s.alloc_zeroed::<i32>(rows)?);
    let targets = Arc::new(s.alloc_zeroed::<i32>(rows)?);
    let pos: Vec<i32> = (0..rows).map(|i| (i % tokens) as i32).collect();
    let pos = Arc::new(s.alloc_from_host(&pos)?);
    let load = |s: &Stream, step: usize| -> AnyResult<()> {
        QueueExt::copy_range(s, &all_ids, step * rows, &ids, 0, rows)?;
        QueueExt::copy_range(s, &all_tgt, step * rows, &targets, 0, rows)?;
        Ok(())
    };
    let copies = opt.copies().unwrap_or_default();
    let forward = |q: &dyn Queue, ids: &Arc<DeviceBuffer<i32>>| -> cudagraph_nn::Result<Tensor> {
        let options = AutocastOptions {
            dtype: a.dtype,
            copies: copies.clone(),
        };
        autocast_with(options, || model.forward(q, ids, &pos, a.batch))?
    };
    let step = |q: &dyn Queue, opt: &mut Adam| -> cudagraph_nn::Result<(Tensor, Tensor)> {
        opt.zero_grad(q, true)?;
        let logits = forward(q, &ids)?;
        let loss = cross_entropy(q, &logits, &targets)?;
        loss.backward(q)?;
        clip_grad_norm(q, &params, a.clip)?;
        opt.step(q)?;
        Ok((loss, logits))
    };
    load(&s, 0)?;
    // Warm-up: three steps on the first batch on a side stream (engines measured, kernels
    // compiled), in both modes, so the two train along the same trajectory.
    let side = dev.new_stream()?;
    cudagraph::warmup(&s, &side, 3, |q| {
        step(q, &mut opt).map(|_| ()).map_err(Into::into)
    })?;
    s.synchronize()?;
    let graph = if a.eager {
        None
    } else {
        let t = Instant::now();
        let (g, out) = Graph::capture(&mut s, CaptureOptions::new().upload(true), |cs| {
            Ok(step(cs, &mut opt)?)
        })?;
        outln!(
            "- graph capture: {:.1} ms, {} nodes",
            t.elapsed().as_secs_f64() * 1e3,
            g.node_count()
        );
        Some((g, out))
    };
    // Step time: the intervals between progress lines, each ended by a synchronisation
    // (the reads of the loss and logits are left out).
    let mut busy = 0.0f64;
    let mut mark = Instant::now();
    for i in 0..a.steps {
        load(&s, i)?;
        let (loss, logits) = match &graph {
            Some((g, out)) => {
                g.replay(&s)?;
                out.clone()
            }
            None => step(&s, &mut opt)?,
        };
        if (i + 1) % a.log_every == 0 || i + 1 == a.steps {
            s.synchronize()?;
            busy += mark.elapsed().as_secs_f64();
            let l = loss.to_vec(&s)?[0];
            let (c, n) = accuracy(a, &logits.to_vec(&s)?, &tgt_host[i * rows..(i + 1) * rows]);
            outln!(
                "step {:>6}/{}  loss {l:.4}  accuracy {:.2}% (batch, repeated half)",
                i + 1,
                a.steps,
                100.0 * c as f64 / n as f64
            );
            mark = Instant::now();
        }
    }
    let us = busy * 1e6 / a.steps as f64;
    // Final accuracy on fresh sequences (another seed), eagerly without gradients.
    let mut eval_rng = HostRng::new(a.seed ^ 0x5eed_cafe);
    let (mut correct, mut total) = (0, 0);
    for _ in 0..8 {
        let (ev_ids, ev_tgt) = sequences(a, &mut eval_rng, 1);
        let ev = Arc::new(s.alloc_from_host(&ev_ids)?);
        let logits = no_grad(|| forward(&s, &ev))?.to_vec(&s)?;
        let (c, n) = accuracy(a, &logits, &ev_tgt);
        correct += c;
        total += n;
    }
    outln!(
        "final accuracy: {:.2}% ({correct}/{total} tokens of the repeated half, fresh \
         sequences)",
        100.0 * correct as f64 / total as f64
    );
    outln!(
        "{mode}: {:.1} us/step ({} steps, batch copies included)",
        us,
        a.steps
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        copy: CopyArgs,
    }

    fn args(extra: &[&str]) -> CopyArgs {
        let mut v = vec!["copy"];
        v.extend(extra);
        Cli::parse_from(v).copy
    }

    #[test]
    fn sequences_repeat_their_block_and_target_the_repeated_half() {
        let a = args(&["--seq", "4", "--batch", "2", "--vocab", "5"]);
        let (ids, tgt) = sequences(&a, &mut HostRng::new(1), 3);
        assert_eq!((ids.len(), tgt.len()), (3 * 2 * 8, 3 * 2 * 8));
        for (s, t) in ids.chunks(8).zip(tgt.chunks(8)) {
            assert_eq!(s[..4], s[4..], "a block and its repeat");
            assert!(
                s.iter().all(|&x| (1..5).contains(&x)),
                "tokens from 1..vocab"
            );
            // Positions 3..=6 predict the repeat; the others the blank.
            assert_eq!(t[3..7], s[4..8]);
            assert!(t[..3].iter().chain(&t[7..]).all(|&x| x == 0));
        }
    }

    #[test]
    fn accuracy_counts_the_repeated_half_only() {
        let a = args(&["--seq", "2", "--batch", "1", "--vocab", "3"]);
        // Four tokens; rows 1 and 2 are scored. Logits pick class 2 everywhere.
        let logits: Vec<f32> = (0..4).flat_map(|_| [0.0, 0.5, 1.0]).collect();
        assert_eq!(accuracy(&a, &logits, &[0, 2, 1, 0]), (1, 2));
        assert_eq!(accuracy(&a, &logits, &[2, 2, 2, 2]), (2, 2));
    }

    #[test]
    fn bad_arguments_are_refused_before_any_device_work() {
        assert!(check(&args(&[])).is_ok());
        assert!(check(&args(&["--heads", "3"])).is_err());
        assert!(check(&args(&["--seq", "0"])).is_err());
        assert!(check(&args(&["--vocab", "1"])).is_err());
        assert!(check(&args(&["--dtype", "f16"])).is_err());
    }
}
