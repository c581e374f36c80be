//! `cudagraph bench soak`: a long run that must leave memory where it started. Replays a captured
//! training step (seed 001's Linear(1024, 1024), MSE, SGD with momentum) and serves requests of
//! random sizes 1–256 through a `GraphCache` (the seed MLP), `--requests` times each (10⁶ by
//! default), and reports device memory (ours: allocated/reserved; the driver's free memory) at
//! the start, at every tenth of the run with the throughput of that tenth, and at the end. Every
//! 10⁵ requests one answer is checked against the eager result for the same input. Exits
//! non-zero if memory grew.

use std::time::Instant;

use clap::Args;
use cudagraph::{
    BucketPolicy, CacheOptions, CaptureOptions, Device, DeviceBuffer, Graph, GraphCache, Stream,
};
use cudagraph_nn::{
    mse_loss, no_grad, Batched, HostRng, Linear, NnModule, Optimizer, Reduction, Sequential, Sgd,
    Tensor,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::bench::cache::request_sizes;
use crate::bench::workloads::seed_mlp;
use crate::report::{device_report, DeviceReport};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Args, Debug, Clone)]
pub struct SoakArgs {
    /// Replays of the training step, and requests through the graph cache.
    #[arg(long, default_value_t = 1_000_000)]
    pub requests: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Memory at one point of the run.
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
struct Memory {
    allocated: usize,
    reserved: usize,
    driver_free: usize,
}

#[derive(Serialize)]
struct Phase {
    workload: &'static str,
    done: usize,
    per_second: f64,
    memory: Memory,
}

#[derive(Serialize)]
struct SoakReport {
    benchmark: &'static str,
    device: DeviceReport,
    requests: usize,
    phases: Vec<Phase>,
    start: Memory,
    end: Memory,
    flat: bool,
    checks: usize,
}

fn memory(dev: &Device) -> AnyResult<Memory> {
    let s = dev.memory_stats();
    Ok(Memory {
        allocated: s.allocated,
        reserved: s.reserved,
        driver_free: dev.context().mem_get_info()?.0,
    })
}

fn bar(n: usize, what: &str, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(n as u64);
    pb.set_style(
        ProgressStyle::with_template("{msg:>14} [{bar:40}] {pos}/{len} ({per_sec}, eta {eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

/// Records a [`Phase`] at every tenth of a workload's `n` iterations (and at the last one),
/// with a progress bar.
struct Tenths<'a> {
    dev: &'a Device,
    n: usize,
    tenth: usize,
    workload: &'static str,
    pb: ProgressBar,
    since: Instant,
}

impl<'a> Tenths<'a> {
    fn new(dev: &'a Device, n: usize, workload: &'static str, quiet: bool) -> Self {
        Tenths {
            dev,
            n,
            tenth: (n / 10).max(1),
            workload,
            pb: bar(n, workload, quiet),
            since: Instant::now(),
        }
    }

    /// After iteration `i` (1-based): at a tenth, waits for the stream and records the phase.
    fn tick(&mut self, i: usize, s: &Stream, phases: &mut Vec<Phase>) -> AnyResult<()> {
        if i % self.tenth != 0 && i != self.n {
            return Ok(());
        }
        s.synchronize()?;
        let done = if i % self.tenth == 0 {
            self.tenth
        } else {
            i % self.tenth
        };
        phases.push(Phase {
            workload: self.workload,
            done: i,
            per_second: done as f64 / self.since.elapsed().as_secs_f64(),
            memory: memory(self.dev)?,
        });
        self.pb.set_position(i as u64);
        self.since = Instant::now();
        Ok(())
    }

    fn finish(self) {
        self.pb.finish_and_clear();
    }
}

/// The eager answer for the first `rows` rows of `input` (1024 features each).
fn eager(
    s: &Stream,
    model: &Sequential,
    input: &DeviceBuffer<f32>,
    rows: usize,
) -> AnyResult<Vec<f32>> {
    let xr = Tensor::from_buffer(
        std::sync::Arc::new(input.prefix(rows * 1024)?),
        &[rows, 1024],
    )?;
    Ok(no_grad(|| model.forward(s, &xr))?.to_vec(s)?)
}

pub fn run(ordinal: usize, a: &SoakArgs) -> AnyResult<()> {
    let dev = Device::open(ordinal)?;
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(1);
    let n = a.requests.max(10);

    // The training step, captured once.
    let lin = Linear::new(&s, 1024, 1024, &mut rng)?;
    let mut opt = Sgd::new(&s, lin.parameters(), 1e-4, 0.9, 0.0)?;
    let x = Tensor::from_host(&s, &rng.vec_normal(64 * 1024), &[64, 1024])?;
    let y = Tensor::from_host(&s, &rng.vec_normal(64 * 1024), &[64, 1024])?;
    let (step, loss) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        opt.zero_grad(cs, true)?;
        let loss = mse_loss(cs, &lin.forward(cs, &x)?, &y, Reduction::Mean)?;
        loss.backward(cs)?;
        opt.step(cs)?;
        Ok(loss)
    })?;

    // The graph cache.
    let model = seed_mlp(&s, &mut rng)?;
    let input = s.alloc_from_host(&rng.vec_normal(256 * 1024))?;
    let mut cache = GraphCache::new(
        &mut s,
        Batched {
            module: model.clone(),
            row_shape: vec![1024],
            output_row: 10,
        },
        BucketPolicy::Steps8 { max: 256 },
        CacheOptions::default(),
    )?;
    let sizes = request_sizes(n);
    let is_check = |i: usize| i % 100_000 == 0 || i == n;
    // Warm up both, so the start measurement sees steady state. That includes the eager
    // forwards of the checked requests: a batch size the engine registry has not seen is
    // measured (and may create a library workspace) on first use, which is not a leak.
    for _ in 0..100 {
        step.replay(&s)?;
    }
    for &r in sizes.iter().take(100) {
        cache.run(&mut s, &input, r)?;
    }
    for i in (1..=n).filter(|&i| is_check(i)) {
        eager(&s, &model, &input, sizes[i - 1])?;
    }
    s.synchronize()?;
    let start = memory(&dev)?;
    let mut phases = Vec::new();

    let mut tenths = Tenths::new(&dev, n, "train step", a.json);
    for i in 1..=n {
        step.replay(&s)?;
        tenths.tick(i, &s, &mut phases)?;
    }
    tenths.finish();
    let final_loss = loss.to_vec(&s)?[0];
    if !final_loss.is_finite() {
        return Err(format!("training diverged: loss {final_loss}").into());
    }

    let mut tenths = Tenths::new(&dev, n, "graph cache", a.json);
    let mut checks = 0;
    for (i, &rows) in sizes.iter().enumerate() {
        let i = i + 1;
        let (out, _) = cache.run(&mut s, &input, rows)?;
        if is_check(i) {
            let got = s.to_vec(&out)?;
            let want = eager(&s, &model, &input, rows)?;
            let worst = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w).abs() / w.abs().max(1e-3))
                .fold(0.0f32, f32::max);
            if worst > 1e-4 {
                return Err(
                    format!("request {i} ({rows} rows) differs from eager by {worst}").into(),
                );
            }
            checks += 1;
        }
        drop(out);
        tenths.tick(i, &s, &mut phases)?;
    }
    tenths.finish();
    s.synchronize()?;
    let end = memory(&dev)?;
    // Ours must be exactly flat; the driver's free memory within 2 MiB (its own bookkeeping).
    let flat = end.allocated == start.allocated
        && end.reserved == start.reserved
        && start.driver_free.abs_diff(end.driver_free) <= 2 << 20;
    let report = SoakReport {
        benchmark: "soak",
        device: device_report(&dev)?,
        requests: n,
        phases,
        start,
        end,
        flat,
        checks,
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        outln!(
            "soak on {}: {} train-step replays and {} graph-cache requests (sizes 1-256)",
            report.device.name,
            n,
            n
        );
        outln!(
            "{:>12} {:>10} {:>12} {:>14} {:>14} {:>16}",
            "workload",
            "done",
            "per second",
            "allocated B",
            "reserved B",
            "driver free B"
        );
        for p in &report.phases {
            outln!(
                "{:>12} {:>10} {:>12.0} {:>14} {:>14} {:>16}",
                p.workload,
                p.done,
                p.per_second,
                p.memory.allocated,
                p.memory.reserved,
                p.memory.driver_free
            );
        }
        outln!(
            "memory start: allocated {} B, reserved {} B, driver free {} B",
            start.allocated,
            start.reserved,
            start.driver_free
        );
        outln!(
            "memory end:   allocated {} B, reserved {} B, driver free {} B -> {}",
            end.allocated,
            end.reserved,
            end.driver_free,
            if flat { "flat" } else { "GREW" }
        );
        outln!("answers checked against eager: {checks}; final training loss {final_loss:.4}");
    }
    if !flat {
        return Err("memory grew during the soak".into());
    }
    Ok(())
}
