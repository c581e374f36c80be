//! `cudagraph bench ddp`: data-parallel training steps on 1 and 2 GPUs (one process per GPU,
//! started like `cudagraph launch`; NCCL all-reduces in buckets on a communication stream),
//! eager vs the whole step in one graph per rank, for two models:
//!
//! - `linear`: seed 001's Linear(1024, 1024), MSE (sum), SGD, batch 64 per GPU — a step
//!   dominated by launch overhead;
//! - `mlp`: 8 × Linear(4096, 4096) with ReLU between, MSE (mean), SGD, batch 512 per GPU —
//!   compute-heavy (about 0.4 TFLOP per step per GPU), where two GPUs should scale.
//!
//! Per configuration: median µs per step over `--repeats` samples of back-to-back steps (the
//! ranks start each sample together; the sample ends with the watchdog wait on rank 0),
//! throughput in samples/s over all GPUs, and the scaling against one GPU.
//! `bench/pytorch_ddp.py` measures PyTorch's DDP on the same models the same way.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use cudagraph::{CaptureOptions, Device, Fork, Graph, Stream};
use cudagraph_nn::dist::{DistEnv, DistOptions};
use cudagraph_nn::{
    mse_loss, Communicator, DdpOptions, DistributedDataParallel, HostRng, Layer, Linear, NnModule,
    Optimizer, Reduction, Sequential, Sgd, Tensor,
};
use serde::{Deserialize, Serialize};

use crate::report::{device_report, median, DeviceReport, Footnotes, NOT_APPLICABLE};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Args, Debug, Clone)]
pub struct DdpArgs {
    /// Models (comma separated): linear, mlp.
    #[arg(long, value_delimiter = ',', default_values_t = ["linear", "mlp"].map(String::from).to_vec())]
    pub models: Vec<String>,
    /// GPU counts to measure (one process per GPU).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 2])]
    pub nprocs: Vec<usize>,
    /// Timed steps per sample for `linear` (`mlp` runs a twentieth of them, at least 10).
    #[arg(long, default_value_t = 500)]
    pub iters: usize,
    /// Samples per measurement (median reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Internal: run as one rank of a launched job; rank 0 writes its rows here.
    #[arg(long, hide = true)]
    pub worker_out: Option<PathBuf>,
}

/// One measured configuration.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct DdpRow {
    pub model: String,
    pub config: String,
    pub gpus: usize,
    pub batch_per_gpu: usize,
    pub params: usize,
    pub buckets: usize,
    pub eager_us: f64,
    pub graph_us: f64,
    /// Samples per second over all GPUs.
    pub eager_samples_per_s: f64,
    pub graph_samples_per_s: f64,
    pub capture_ms: f64,
    pub graph_nodes: usize,
}

#[derive(Serialize)]
struct Report {
    benchmark: &'static str,
    device: DeviceReport,
    nccl: String,
    iters: usize,
    repeats: usize,
    rows: Vec<DdpRow>,
    notes: Vec<String>,
}

/// A model, its DDP wrapper, optimizer and this rank's static batch.
struct Job {
    model: Sequential,
    ddp: DistributedDataParallel,
    opt: Sgd,
    x: Tensor,
    y: Tensor,
    reduction: Reduction,
}

impl Job {
    fn new(s: &Stream, comm: &Communicator, name: &str) -> AnyResult<(Job, String, usize)> {
        let mut rng = HostRng::new(1);
        let (layers, batch, width_in, width_out, reduction, config) = match name {
            "linear" => (
                vec![Layer::Linear(Linear::new(s, 1024, 1024, &mut rng)?)],
                64,
                1024,
                1024,
                Reduction::Sum,
                "Linear(1024,1024), MSE sum, SGD".to_string(),
            ),
            "mlp" => {
                let mut layers = Vec::new();
                for i in 0..8 {
                    if i > 0 {
                        layers.push(Layer::ReLU);
                    }
                    layers.push(Layer::Linear(Linear::new(s, 4096, 4096, &mut rng)?));
                }
                (
                    layers,
                    512,
                    4096,
                    4096,
                    Reduction::Mean,
                    "8 x Linear(4096,4096)+ReLU, MSE mean, SGD".to_string(),
                )
            }
            other => return Err(format!("unknown model `{other}` (linear, mlp)").into()),
        };
        let model = Sequential::new(layers);
        let ddp = DistributedDataParallel::new(s, comm, model.parameters(), DdpOptions::default())?;
        let opt = Sgd::new(s, model.parameters(), 1e-4, 0.0, 0.0)?;
        // Each rank its own data.
        let mut data = HostRng::new(100 + comm.rank() as u64);
        let x = Tensor::from_host(s, &data.vec_normal(batch * width_in), &[batch, width_in])?;
        let y = Tensor::from_host(s, &data.vec_normal(batch * width_out), &[batch, width_out])?;
        Ok((
            Job {
                model,
                ddp,
                opt,
                x,
                y,
                reduction,
            },
            config,
            batch,
        ))
    }

    fn step(&mut self, q: &dyn Fork) -> cudagraph_nn::Result<()> {
        let nq = q.as_queue();
        self.opt.zero_grad(nq, true)?;
        let loss = mse_loss(
            nq,
            &self.model.forward(nq, &self.x)?,
            &self.y,
            self.reduction,
        )?;
        self.ddp.backward(q, &loss)?;
        self.opt.step(nq)
    }
}

/// Median µs per call of `body` over `repeats` samples of `iters` calls; every sample starts
/// with a barrier and ends with the communicator's watchdog wait.
fn time_steps(
    comm: &Communicator,
    s: &Stream,
    iters: usize,
    repeats: usize,
    mut body: impl FnMut() -> AnyResult<()>,
) -> AnyResult<f64> {
    let mut samples = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        // Also waits for this rank's earlier work, with the watchdog.
        comm.barrier(s)?;
        let t = Instant::now();
        for _ in 0..iters {
            body()?;
        }
        comm.synchronize(s)?;
        samples.push(t.elapsed().as_secs_f64() * 1e6 / iters as f64);
    }
    Ok(median(samples))
}

fn measure(dev: &Device, comm: &Communicator, name: &str, a: &DdpArgs) -> AnyResult<DdpRow> {
    let mut s = dev.new_stream()?;
    let (mut job, config, batch) = Job::new(&s, comm, name)?;
    let iters = if name == "mlp" {
        (a.iters / 20).max(10)
    } else {
        a.iters
    };
    for _ in 0..3 {
        job.step(&s)?;
    }
    comm.synchronize(&s)?;
    let eager_us = time_steps(comm, &s, iters, a.repeats, || Ok(job.step(&s)?))?;
    let (graph, ()) = Graph::capture(&mut s, CaptureOptions::new().upload(true), |cs| {
        Ok(job.step(cs)?)
    })?;
    let capture_ms = graph.info().capture_time.as_secs_f64() * 1e3;
    let graph_us = time_steps(comm, &s, iters, a.repeats, || Ok(graph.replay(&s)?))?;
    let world = comm.world_size();
    let per_s = |us: f64| (world * batch) as f64 / us * 1e6;
    Ok(DdpRow {
        model: name.to_string(),
        config,
        gpus: world,
        batch_per_gpu: batch,
        params: job.model.parameters().iter().map(|p| p.numel()).sum(),
        buckets: job.ddp.buckets().len(),
        eager_us,
        graph_us,
        eager_samples_per_s: per_s(eager_us),
        graph_samples_per_s: per_s(graph_us),
        capture_ms,
        graph_nodes: graph.node_count(),
    })
}

/// One rank of a measurement job (under the launcher).
fn worker(a: &DdpArgs, out: &Path) -> AnyResult<()> {
    let env = DistEnv::from_env()?
        .ok_or("--worker-out is for processes started by `cudagraph bench ddp` (RANK unset)")?;
    let dev = Device::open(env.local_rank)?;
    let comm = Communicator::init(&dev, &env, &DistOptions::from_env()?)?;
    let rows: AnyResult<Vec<DdpRow>> = a
        .models
        .iter()
        .map(|m| measure(&dev, &comm, m, a))
        .collect();
    match rows {
        Ok(rows) => {
            if env.rank == 0 {
                std::fs::write(out, serde_json::to_string(&rows)?)?;
            }
            Ok(())
        }
        Err(e) => {
            let msg = e.to_string();
            comm.abort(&msg);
            eprintln!("error: rank {}: {msg}", env.rank);
            std::process::exit(1);
        }
    }
}

pub fn run(a: &DdpArgs) -> AnyResult<()> {
    if a.iters == 0 || a.repeats == 0 {
        return Err("--iters and --repeats must be at least 1".into());
    }
    if let Some(out) = &a.worker_out {
        return worker(a, out);
    }
    let available = cudagraph::runtime::device_count()?;
    let exe = std::env::current_exe()?;
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    for &n in &a.nprocs {
        if n == 0 || n > available {
            notes.push(format!("{n} GPU(s): skipped, this machine has {available}"));
            continue;
        }
        let file = std::env::temp_dir().join(format!(
            "cudagraph-bench-ddp-{}-{n}.json",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&file);
        let command = vec![
            exe.clone().into(),
            "bench".into(),
            "ddp".into(),
            "--models".into(),
            a.models.join(",").into(),
            "--iters".into(),
            a.iters.to_string().into(),
            "--repeats".into(),
            a.repeats.to_string().into(),
            "--worker-out".into(),
            file.clone().into(),
        ];
        let launch = crate::launch::LaunchArgs {
            nproc: n,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            command,
        };
        // Worker output goes to stderr, so --json output stays clean.
        let sink: crate::launch::Sink = Arc::new(|r, _, line| eprintln!("[rank {r}] {line}"));
        let outcome = crate::launch::launch(&launch, sink)?;
        if let Some((rank, how)) = outcome.failure {
            return Err(format!("{n}-GPU run: rank {rank} {how}").into());
        }
        let text = std::fs::read_to_string(&file)
            .map_err(|e| format!("{n}-GPU run left no results ({}): {e}", file.display()))?;
        let _ = std::fs::remove_file(&file);
        rows.extend(serde_json::from_str::<Vec<DdpRow>>(&text)?);
    }
    let dev = Device::open(0)?;
    let report = Report {
        benchmark: "ddp",
        device: device_report(&dev)?,
        nccl: cudagraph_nn::dist::nccl_version()?,
        iters: a.iters,
        repeats: a.repeats,
        rows,
        notes,
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    outln!(
        "cudagraph bench ddp — {}, NCCL {}, µs per step (median of {} samples)",
        report.device.name,
        report.nccl,
        a.repeats
    );
    outln!(
        "{:<8} {:>4} {:>9} {:>11} {:>11} {:>8} {:>14} {:>14} {:>12}",
        "model",
        "gpus",
        "batch/gpu",
        "eager us",
        "graph us",
        "speedup",
        "eager smp/s",
        "graph smp/s",
        "scaling(gr)"
    );
    let mut footnotes = Footnotes::default();
    for r in &report.rows {
        let scaling = match report
            .rows
            .iter()
            .find(|o| o.model == r.model && o.gpus == 1)
        {
            Some(o) => format!("{:.2}x", r.graph_samples_per_s / o.graph_samples_per_s),
            None => {
                NOT_APPLICABLE.to_string()
                    + &footnotes.mark("no 1-GPU run of this model to scale against")
            }
        };
        outln!(
            "{:<8} {:>4} {:>9} {:>11.1} {:>11.1} {:>7.2}x {:>14.0} {:>14.0} {:>12}",
            r.model,
            r.gpus,
            r.batch_per_gpu,
            r.eager_us,
            r.graph_us,
            r.eager_us / r.graph_us,
            r.eager_samples_per_s,
            r.graph_samples_per_s,
            scaling
        );
    }
    for line in footnotes.lines() {
        outln!("{line}");
    }
    for n in &report.notes {
        outln!("note: {n}");
    }
    Ok(())
}
