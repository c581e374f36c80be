//! `cudagraph bench chain`: k tiny kernels launched one by one (eager) versus one graph launch
//! of the same k kernels. Measures launch overhead, which is what CUDA Graphs remove.
//!
//! Method: each configuration runs `iters` iterations back to back, then synchronises; the
//! wall time over the iterations is one sample; the median of `--repeats` samples is reported.
//! Everything is warmed up first (module load, first launch, graph upload).

use clap::Args;
use cudagraph::{args, CaptureOptions, Device, Function, Graph, LaunchConfig, Queue, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::report::{device_report, time_us, DeviceReport};

/// The kernel is the one `bench/raw/chain.cu` launches, so the raw CUDA C++ numbers compare.
pub const CHAIN_SRC: &str = r#"
extern "C" __global__ void chain_step(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * 0.999f + 0.001f;
}
"#;

/// Elements touched by each kernel (one block of 128 threads).
const N: usize = 128;

#[derive(Args, Debug)]
pub struct ChainArgs {
    /// Chain lengths to measure (comma separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 10, 100, 1000])]
    pub kernels: Vec<usize>,
    /// Kernel launches per sample (iterations = this / k, at least 100).
    #[arg(long, default_value_t = 100_000)]
    pub launches: usize,
    /// Samples per measurement; the median is reported.
    #[arg(long, default_value_t = 7)]
    pub repeats: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize, Debug)]
pub struct ChainRow {
    pub kernels: usize,
    pub iterations: usize,
    pub eager_us_per_iter: f64,
    pub graph_us_per_iter: f64,
    pub eager_us_per_kernel: f64,
    pub graph_us_per_kernel: f64,
    pub speedup: f64,
    pub capture_ms: f64,
    pub instantiate_ms: f64,
    pub graph_nodes: usize,
}

#[derive(Serialize)]
pub struct ChainReport {
    pub benchmark: &'static str,
    pub device: DeviceReport,
    pub rows: Vec<ChainRow>,
}

fn launch_chain<Q: Queue>(
    q: &Q,
    f: &Function,
    x: &cudagraph::DeviceBuffer<f32>,
    k: usize,
) -> Result<()> {
    let cfg = LaunchConfig::linear(1, N as u32);
    if x.len() < N {
        return Err(cudagraph::Error::SizeMismatch {
            what: "chain buffer",
            expected: N,
            got: x.len(),
        });
    }
    for _ in 0..k {
        // SAFETY: the chain kernel touches x[threadIdx.x] for threadIdx.x < n = N, and x holds
        // at least N elements (checked above).
        unsafe { q.launch(f, cfg, args![x, N as i32])? };
    }
    Ok(())
}

pub fn measure(dev: &Device, args: &ChainArgs, progress: &ProgressBar) -> Result<Vec<ChainRow>> {
    let f = dev
        .compile("bench_chain", CHAIN_SRC)?
        .function("chain_step")?;
    let mut s = dev.new_stream()?;
    let x = s.alloc_from_host(&vec![1.0f32; N])?;
    let mut rows = Vec::new();
    for &k in &args.kernels {
        let iters = (args.launches / k.max(1)).max(100);
        progress.set_message(format!("k={k}"));
        // Warm-up, then eager.
        launch_chain(&s, &f, &x, k)?;
        let eager = time_us(&s, 0, iters, args.repeats, || launch_chain(&s, &f, &x, k))?;
        let (graph, ()) = Graph::capture(&mut s, CaptureOptions::new().upload(true), |cs| {
            launch_chain(cs, &f, &x, k)
        })?;
        graph.replay(&s)?;
        let replay = time_us(&s, 0, iters, args.repeats, || graph.replay(&s))?;
        let info = graph.info();
        rows.push(ChainRow {
            kernels: k,
            iterations: iters,
            eager_us_per_iter: eager,
            graph_us_per_iter: replay,
            eager_us_per_kernel: eager / k as f64,
            graph_us_per_kernel: replay / k as f64,
            speedup: eager / replay,
            capture_ms: info.capture_time.as_secs_f64() * 1e3,
            instantiate_ms: info.instantiate_time.as_secs_f64() * 1e3,
            graph_nodes: graph.node_count(),
        });
        progress.inc(1);
    }
    Ok(rows)
}

pub fn run(ordinal: usize, args: &ChainArgs) -> Result<()> {
    let dev = Device::open(ordinal)?;
    let progress = ProgressBar::new(args.kernels.len() as u64);
    progress.set_style(
        ProgressStyle::with_template("bench chain {bar:30} {pos}/{len} {msg}")
            .expect("valid template"),
    );
    let rows = measure(&dev, args, &progress)?;
    progress.finish_and_clear();
    let report = ChainReport {
        benchmark: "chain",
        device: device_report(&dev)?,
        rows,
    };
    if args.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&report).expect("serialisable")
        );
        return Ok(());
    }
    outln!(
        "chain of k tiny kernels on {} (CUDA {}), eager vs graph, median of {} samples",
        report.device.name,
        report.device.driver_cuda_version,
        args.repeats
    );
    outln!(
        "{:>6} {:>8} {:>14} {:>14} {:>13} {:>13} {:>8} {:>10} {:>10}",
        "k",
        "iters",
        "eager us/iter",
        "graph us/iter",
        "eager us/kern",
        "graph us/kern",
        "speedup",
        "capture ms",
        "inst. ms"
    );
    for r in &report.rows {
        outln!(
            "{:>6} {:>8} {:>14.2} {:>14.2} {:>13.3} {:>13.3} {:>7.2}x {:>10.3} {:>10.3}",
            r.kernels,
            r.iterations,
            r.eager_us_per_iter,
            r.graph_us_per_iter,
            r.eager_us_per_kernel,
            r.graph_us_per_kernel,
            r.speedup,
            r.capture_ms,
            r.instantiate_ms
        );
    }
    Ok(())
}
