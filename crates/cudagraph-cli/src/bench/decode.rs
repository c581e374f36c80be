//! `cudagraph bench decode`: ms per decode step and tokens/s of a Hugging Face decoder, one
//! captured step per batch, after prompts of given lengths (beside `bench/decode_torch.py`,
//! which times Hugging Face transformers with a static cache and
//! `torch.compile(mode="reduce-overhead")` on the same files).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use cudagraph::{Device, Event, Queue};
use cudagraph_nn::SamplingParams;
use cudagraph_nn::{Decoder, Generation, GenerationOptions, Request};
use cudagraph_nn::{Dtype, HostRng};
use serde::Serialize;

use crate::report::median;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Args, Debug)]
pub struct DecodeArgs {
    /// A Hugging Face model folder: config.json and model.safetensors (or shards).
    #[arg(long)]
    pub model: PathBuf,
    /// Element type of the weights and activations.
    #[arg(long, default_value = "bf16")]
    pub dtype: Dtype,
    /// Batch sizes (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 8, 32, 64])]
    pub batches: Vec<usize>,
    /// Prompt lengths (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![128usize, 1024])]
    pub prompts: Vec<usize>,
    /// Timed decode steps per (prompt, batch).
    #[arg(long, default_value_t = 64)]
    pub steps: usize,
    /// Untimed decode steps before them.
    #[arg(long, default_value_t = 8)]
    pub warmup: usize,
    /// Timed runs per (prompt, batch), each from the same prompts (prefilled again, then the
    /// warm-up and the timed steps); the row reports their median, as
    /// `bench/decode_torch.py --repeats` does.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Decode steps per launch (a WHILE node around the captured step); --steps must be a
    /// multiple, the warm-up is rounded up to one.
    #[arg(long, default_value_t = 1)]
    pub steps_per_launch: u32,
    /// Run the steps eagerly instead of replaying captured steps.
    #[arg(long)]
    pub no_graph: bool,
    /// Capture the steps with the engines the registry measured per product, without timing
    /// alternatives in the captured forward (`GenerationOptions::tune` off).
    #[arg(long)]
    pub no_tune: bool,
    /// Seed of the random prompts (and the sampler; decoding is greedy).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write the rows as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Row {
    model: String,
    dtype: String,
    prompt: usize,
    batch: usize,
    graphs: bool,
    steps_per_launch: u32,
    ms_per_step: f64,
    tokens_per_s: f64,
    prefill_ms: f64,
    capture_ms: f64,
    /// Tuning the captured forward's engines (0 where the registry had tuned them before).
    tune_ms: f64,
    graph_mib: f64,
    repeats: usize,
    /// Every repeat's ms per step, in order.
    samples_ms: Vec<f64>,
    /// Host µs to launch a step (the timed launches' enqueue time over the steps; median of
    /// the repeats): below `ms_per_step`, the GPU, not the host, sets the pace.
    launch_us: f64,
}

/// The untimed and timed launches of `k` steps each: the warm-up rounded up to whole launches,
/// the timed steps a multiple of `k` (at least 1), all the steps countable.
fn launches(warmup: usize, steps: usize, k: usize) -> Result<(usize, usize), String> {
    if k == 0 || steps % k != 0 {
        return Err(format!(
            "--steps {steps} is not a multiple of --steps-per-launch {k} (at least 1)"
        ));
    }
    let (untimed, timed) = (warmup.div_ceil(k), steps / k);
    untimed
        .checked_add(timed)
        .and_then(|l| l.checked_mul(k))
        .ok_or_else(|| format!("--warmup {warmup} and --steps {steps}: too many steps"))?;
    Ok((untimed, timed))
}

pub fn run(device: usize, a: &DecodeArgs) -> AnyResult<()> {
    let (batches, prompts) = (&a.batches, &a.prompts);
    if a.steps == 0 || a.repeats == 0 || batches.contains(&0) || prompts.contains(&0) {
        return Err("--steps, --repeats, --batches and --prompts must be at least 1".into());
    }
    let k = a.steps_per_launch as usize;
    let (warmup_launches, launches) = launches(a.warmup, a.steps, k)?;
    let dev = Device::open(device)?;
    let mut s = dev.new_stream()?;
    let t = Instant::now();
    let decoder = Arc::new(Decoder::load(&s, &a.model, a.dtype)?);
    s.synchronize()?;
    let name = a.model.file_name().map_or_else(
        || a.model.display().to_string(),
        |n| n.to_string_lossy().into(),
    );
    outln!(
        "{name}: {} layers, vocab {}, {} weights, loaded in {:.1} s; {} timed steps after {} warm-up, {k} a launch; median of {} runs",
        decoder.config().layers(),
        decoder.vocab(),
        a.dtype,
        t.elapsed().as_secs_f64(),
        a.steps,
        warmup_launches * k,
        a.repeats
    );
    outln!(
        "{:>7} {:>6} {:>12} {:>12} {:>11} {:>11} {:>9} {:>10}",
        "prompt",
        "batch",
        "ms/step",
        "tokens/s",
        "prefill ms",
        "capture ms",
        "tune ms",
        "graph MiB"
    );
    let (e0, e1) = (
        Event::new(dev.context(), true)?,
        Event::new(dev.context(), true)?,
    );
    let mut rng = HostRng::new(a.seed);
    let mut rows = Vec::new();
    for &prompt in prompts {
        for &batch in batches {
            let max_new = (warmup_launches + launches) * k;
            let max_len = prompt
                .checked_add(max_new)
                .ok_or("--prompts and --steps: too many positions")?;
            let mut opts = GenerationOptions::new(batch, max_len);
            opts.buckets = vec![batch];
            opts.graphs = !a.no_graph;
            opts.tune = !a.no_tune;
            opts.seed = a.seed;
            opts.steps_per_launch = a.steps_per_launch;
            let mut gen = Generation::new(&mut s, decoder.clone(), opts)?;
            let vocab = decoder.vocab() as u64;
            let requests: Vec<Request> = (0..batch)
                .map(|_| Request {
                    prompt: (0..prompt)
                        .map(|_| (rng.next_u64() % vocab) as i32)
                        .collect(),
                    max_new,
                    sampling: SamplingParams::greedy(),
                })
                .collect();
            let (mut samples, mut prefills, mut enqueues) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..a.repeats {
                s.synchronize()?;
                let t = Instant::now();
                let slots = gen.join(&s, &requests)?;
                s.synchronize()?;
                prefills.push(t.elapsed().as_secs_f64() * 1e3);
                for _ in 0..warmup_launches {
                    gen.step(&s)?;
                }
                s.stream_handle().record(&e0)?;
                let t = Instant::now();
                for _ in 0..launches {
                    gen.step(&s)?;
                }
                enqueues.push(t.elapsed().as_secs_f64() * 1e6 / a.steps as f64);
                s.stream_handle().record(&e1)?;
                e1.synchronize()?;
                samples.push(e0.elapsed_ms(&e1)? as f64 / a.steps as f64);
                for slot in slots {
                    gen.leave(&s, slot)?;
                }
            }
            let (ms, prefill_ms) = (median(samples.clone()), median(prefills));
            let stats = gen.stats();
            let row = Row {
                model: name.clone(),
                dtype: a.dtype.to_string(),
                prompt,
                batch,
                graphs: !a.no_graph,
                steps_per_launch: a.steps_per_launch,
                ms_per_step: ms,
                tokens_per_s: batch as f64 * 1e3 / ms,
                prefill_ms,
                capture_ms: stats.capture_time.as_secs_f64() * 1e3,
                tune_ms: stats.tune_time.as_secs_f64() * 1e3,
                graph_mib: stats.graph_bytes as f64 / (1 << 20) as f64,
                repeats: a.repeats,
                samples_ms: samples,
                launch_us: median(enqueues),
            };
            outln!(
                "{:>7} {:>6} {:>12.4} {:>12.0} {:>11.1} {:>11.1} {:>9.1} {:>10.1}",
                row.prompt,
                row.batch,
                row.ms_per_step,
                row.tokens_per_s,
                row.prefill_ms,
                row.capture_ms,
                row.tune_ms,
                row.graph_mib
            );
            rows.push(row);
            drop(gen);
        }
    }
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::launches;

    #[test]
    fn launches_cover_the_steps_in_whole_launches() {
        assert_eq!(launches(8, 64, 1), Ok((8, 64)));
        assert_eq!(launches(8, 64, 8), Ok((1, 8)));
        assert_eq!(launches(5, 64, 4), Ok((2, 16)));
        assert_eq!(launches(0, 6, 3), Ok((0, 2)));
        assert!(launches(usize::MAX, 8, 8).is_err());
        for (steps, k) in [(10, 3), (64, 0)] {
            let e = launches(8, steps, k).unwrap_err();
            assert!(e.contains("--steps-per-launch"), "{e}");
        }
    }
}
