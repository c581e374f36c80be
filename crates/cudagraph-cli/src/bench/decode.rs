//! `cudagraph bench decode`: ms per decode step and tokens/s of a Hugging Face decoder, one
//! captured step per batch, after prompts of given lengths (beside `bench/decode_torch.py`,
//! which times Hugging Face transformers with a static cache and
//! `torch.compile(mode="reduce-overhead")` on the same files).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use cudagraph::{Device, Event, Queue};
use cudagraph_nn::SamplingParams;
use cudagraph_nn::{Decoder, Generation, GenerationOptions, Request};
use cudagraph_nn::{Dtype, HostRng};
use serde::{Deserialize, Serialize};

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
    /// Measure and tune the engines in this process. By default a child process (this
    /// command with `--measure-only`) measures every row's products and tunes its captured
    /// step first, saving the choices to the engine registry, and this process times the steps
    /// on them, as a server started on a warmed registry runs (docs/transformers.md, "Decode
    /// benchmark": both ways give the same steps). With --no-graph the engines are always
    /// measured here, by the first eager steps.
    #[arg(long, conflicts_with = "measure_only")]
    pub measure_in_process: bool,
    /// Measure and tune every row's shapes (prefill and captured step; the choices go to the
    /// engine registry), time no step, and write what each row's measuring took to FILE as
    /// JSON. Warms a registry for later processes.
    #[arg(long, value_name = "FILE", conflicts_with = "json")]
    pub measure_only: Option<PathBuf>,
}

/// What measuring one row's shapes took (a `--measure-only` run's JSON).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
struct MeasuredRow {
    prompt: usize,
    batch: usize,
    /// Building the `Generation`: measuring the step's products, tuning and capturing it.
    setup_ms: f64,
    /// Tuning the captured step (`Engines::tune_graph`), part of `setup_ms`.
    tune_ms: f64,
    /// The first prefill of the row's prompts (measuring its products).
    prefill_ms: f64,
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
    /// Tuning the captured forward's engines (0 where the registry had tuned them before; in
    /// the measuring child process where `measured_in` says so).
    tune_ms: f64,
    /// Where the engines were measured and tuned: `child process` or `this process`.
    measured_in: &'static str,
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

/// The `Generation` of one row: `batch` slots of `prompt` + `max_new` positions, one
/// captured bucket.
fn options(
    a: &DecodeArgs,
    prompt: usize,
    batch: usize,
    max_new: usize,
) -> AnyResult<GenerationOptions> {
    let max_len = prompt
        .checked_add(max_new)
        .ok_or("--prompts and --steps: too many positions")?;
    let mut opts = GenerationOptions::new(batch, max_len);
    opts.buckets = vec![batch];
    opts.graphs = !a.no_graph;
    opts.tune = !a.no_tune;
    opts.seed = a.seed;
    opts.steps_per_launch = a.steps_per_launch;
    Ok(opts)
}

/// `batch` greedy requests of `prompt` random ids below `vocab`.
fn random_requests(
    rng: &mut HostRng,
    vocab: usize,
    prompt: usize,
    batch: usize,
    max_new: usize,
) -> Vec<Request> {
    (0..batch)
        .map(|_| Request {
            prompt: (0..prompt)
                .map(|_| (rng.next_u64() % vocab as u64) as i32)
                .collect(),
            max_new,
            sampling: SamplingParams::greedy(),
        })
        .collect()
}

/// `--measure-only`: builds every row's `Generation` of `max_new` new positions (measuring
/// and tuning its step) and prefills its prompts once (measuring the prefill's products),
/// then writes the times to `file`.
fn measure_rows(
    s: &mut cudagraph::Stream,
    decoder: &Arc<Decoder>,
    a: &DecodeArgs,
    max_new: usize,
    file: &Path,
) -> AnyResult<()> {
    let mut rng = HostRng::new(a.seed);
    let mut rows = Vec::new();
    for &prompt in &a.prompts {
        for &batch in &a.batches {
            let t = Instant::now();
            let mut gen = Generation::new(s, decoder.clone(), options(a, prompt, batch, max_new)?)?;
            s.synchronize()?;
            let setup_ms = t.elapsed().as_secs_f64() * 1e3;
            let requests = random_requests(&mut rng, decoder.vocab(), prompt, batch, max_new);
            let t = Instant::now();
            let slots = gen.join(s, &requests)?;
            s.synchronize()?;
            let prefill_ms = t.elapsed().as_secs_f64() * 1e3;
            for slot in slots {
                gen.leave(s, slot)?;
            }
            let row = MeasuredRow {
                prompt,
                batch,
                setup_ms,
                tune_ms: gen.stats().tune_time.as_secs_f64() * 1e3,
                prefill_ms,
            };
            outln!(
                "measured prompt {prompt} batch {batch}: step {:.0} ms (tuning {:.0}), prefill {:.0} ms",
                row.setup_ms,
                row.tune_ms,
                row.prefill_ms
            );
            rows.push(row);
        }
    }
    std::fs::write(file, serde_json::to_string_pretty(&rows)?)?;
    Ok(())
}

/// Runs this command with `--measure-only` in a child process (before this one opens the
/// device or reads the engine registry) and returns what its rows' measuring took and its
/// wall time in seconds; `None` (measure here) where the registry is not saved to disk, so
/// that the child's choices could not reach this process.
fn measure_in_child(device: usize, a: &DecodeArgs) -> AnyResult<Option<(Vec<MeasuredRow>, f64)>> {
    // The registry's disk table lives in the cache directory (`Engines::table_path`). Not
    // `Engines::get` here: it reads the table, which the child is about to fill.
    if cudagraph::runtime::nvrtc::cache_dir().is_none() {
        eprintln!(
            "note: the engine registry is not saved to disk here, so the engines are measured in \
             this process (see CUDAGRAPH_CACHE_DIR)"
        );
        return Ok(None);
    }
    let file = std::env::temp_dir().join(format!(
        "cudagraph-decode-measure-{}.json",
        std::process::id()
    ));
    let t = Instant::now();
    let status = Command::new(std::env::current_exe()?)
        .args(child_args(device, a, &file))
        .status()?;
    if !status.success() {
        let _ = std::fs::remove_file(&file);
        return Err(format!(
            "the child process measuring the engines failed ({status}); \
             --measure-in-process measures them in this one"
        )
        .into());
    }
    let rows = std::fs::read(&file)
        .map_err(|e| format!("reading {}: {e}", file.display()))
        .and_then(|b| {
            serde_json::from_slice::<Vec<MeasuredRow>>(&b)
                .map_err(|e| format!("{}: {e}", file.display()))
        });
    let _ = std::fs::remove_file(&file);
    Ok(Some((rows?, t.elapsed().as_secs_f64())))
}

/// The arguments of the measuring child: this command's shapes and options with
/// `--measure-only FILE`.
fn child_args(device: usize, a: &DecodeArgs, file: &Path) -> Vec<OsString> {
    let list = |v: &[usize]| {
        v.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let mut v: Vec<OsString> = vec![
        "--device".into(),
        device.to_string().into(),
        "bench".into(),
        "decode".into(),
        "--model".into(),
        a.model.clone().into(),
        "--dtype".into(),
        a.dtype.to_string().into(),
        "--batches".into(),
        list(&a.batches).into(),
        "--prompts".into(),
        list(&a.prompts).into(),
        "--steps".into(),
        a.steps.to_string().into(),
        "--warmup".into(),
        a.warmup.to_string().into(),
        "--steps-per-launch".into(),
        a.steps_per_launch.to_string().into(),
        "--seed".into(),
        a.seed.to_string().into(),
        "--measure-only".into(),
        file.into(),
    ];
    if a.no_graph {
        v.push("--no-graph".into());
    }
    if a.no_tune {
        v.push("--no-tune".into());
    }
    v
}

pub fn run(device: usize, a: &DecodeArgs) -> AnyResult<()> {
    let (batches, prompts) = (&a.batches, &a.prompts);
    if a.steps == 0 || a.repeats == 0 || batches.contains(&0) || prompts.contains(&0) {
        return Err("--steps, --repeats, --batches and --prompts must be at least 1".into());
    }
    let k = a.steps_per_launch as usize;
    let (warmup_launches, launches) = launches(a.warmup, a.steps, k)?;
    // Eager steps (--no-graph) measure their products at their first run, in this process.
    let measured = if a.measure_only.is_none() && !a.measure_in_process && !a.no_graph {
        measure_in_child(device, a)?
    } else {
        None
    };
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
    let max_new = (warmup_launches + launches) * k;
    if let Some(file) = &a.measure_only {
        return measure_rows(&mut s, &decoder, a, max_new, file);
    }
    if let Some((_, secs)) = &measured {
        outln!("engines measured and tuned in a child process ({secs:.1} s); tune ms: its tuning");
    }
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
            let mut gen =
                Generation::new(&mut s, decoder.clone(), options(a, prompt, batch, max_new)?)?;
            let requests = random_requests(&mut rng, decoder.vocab(), prompt, batch, max_new);
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
                tune_ms: match &measured {
                    Some((rows, _)) => rows
                        .iter()
                        .find(|r| (r.prompt, r.batch) == (prompt, batch))
                        .map_or(0.0, |r| r.tune_ms),
                    None => stats.tune_time.as_secs_f64() * 1e3,
                },
                measured_in: match measured {
                    Some(_) => "child process",
                    None => "this process",
                },
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
    use super::{child_args, launches, DecodeArgs};
    use clap::Parser;
    use std::path::Path;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        a: DecodeArgs,
    }

    fn parse(args: &[&str]) -> Result<DecodeArgs, clap::Error> {
        Wrap::try_parse_from(std::iter::once("decode").chain(args.iter().copied())).map(|w| w.a)
    }

    #[test]
    fn the_measuring_child_gets_this_commands_shapes_and_options() {
        let a = parse(&[
            "--model",
            "/m/llama",
            "--dtype",
            "f16",
            "--batches",
            "1,8",
            "--prompts",
            "7",
            "--steps",
            "16",
            "--warmup",
            "3",
            "--repeats",
            "5",
            "--steps-per-launch",
            "4",
            "--seed",
            "9",
            "--no-tune",
            "--json",
            "/out.json",
        ])
        .unwrap();
        let args = child_args(2, &a, Path::new("/tmp/m.json"));
        let args: Vec<&str> = args.iter().map(|s| s.to_str().unwrap()).collect();
        assert_eq!(args[..4], ["--device", "2", "bench", "decode"]);
        let c = parse(&args[4..]).unwrap();
        assert_eq!(c.model, a.model);
        assert_eq!(c.dtype, a.dtype);
        assert_eq!((c.batches, c.prompts), (vec![1, 8], vec![7]));
        assert_eq!(
            (c.steps, c.warmup, c.steps_per_launch, c.seed),
            (16, 3, 4, 9)
        );
        assert_eq!((c.no_graph, c.no_tune), (false, true));
        assert_eq!(c.measure_only.as_deref(), Some(Path::new("/tmp/m.json")));
        // Nothing of the timing or of the output: the child measures, it writes no rows.
        assert_eq!(c.json, None);
        assert!(!c.measure_in_process);
        let g = parse(&["--model", "m", "--no-graph"]).unwrap();
        let args = child_args(0, &g, Path::new("f"));
        assert!(args.iter().any(|s| s == "--no-graph"));
        assert!(!args.iter().any(|s| s == "--no-tune"));
    }

    #[test]
    fn measuring_here_and_measuring_only_exclude_each_other() {
        let e = parse(&[
            "--model",
            "m",
            "--measure-in-process",
            "--measure-only",
            "f",
        ]);
        assert!(e.is_err());
        assert!(
            parse(&["--model", "m", "--measure-in-process"])
                .unwrap()
                .measure_in_process
        );
    }

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
