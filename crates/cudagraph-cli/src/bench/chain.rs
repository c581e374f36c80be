//! `cudagraph bench chain`: k tiny kernels launched one by one (eager) versus one graph launch
//! of the same k kernels. Measures launch overhead, which is what CUDA Graphs remove.
//!
//! Method: each configuration runs `iters` iterations back to back, then synchronises; the
//! wall time over the iterations is one sample; the median of `--repeats` samples is reported.
//! Everything is warmed up first (module load, first launch, graph upload).
//!
//! `--pdl` adds the same chain launched with programmatic dependent launch (sm_90+): each
//! kernel starts with `griddepcontrol.launch_dependents` + `griddepcontrol.wait`, so the next
//! one launches while the previous drains; captured, the dependencies are programmatic edges.

use clap::Args;
use cudagraph::{
    args, CaptureOptions, Device, Function, Graph, LaunchConfig, LaunchOptions, Queue, Result,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::report::{device_report, time_us, DeviceReport};

/// The kernel is the one `bench/raw/chain.cu` launches, so the raw CUDA C++ numbers compare.
pub const CHAIN_SRC: &str = r#"
extern "C" __global__ void chain_step(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * 0.999f + 0.001f;
}
// The PDL variant (bench/raw/chain.cu has the same): let the next kernel launch, wait for the
// previous one, then the same update.
extern "C" __global__ void chain_step_pdl(float* x, int n) {
    CG_PDL_ENTER();
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
    /// Also measure the chain with programmatic dependent launch (sm_90+), eager and graphed.
    #[arg(long)]
    pub pdl: bool,
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
    /// With `--pdl`: the PDL chain, eager and graphed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eager_pdl_us_per_kernel: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph_pdl_us_per_kernel: Option<f64>,
    /// Programmatic edges in the PDL graph (k − 1 where the device supports PDL).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pdl_programmatic_edges: Option<usize>,
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
    launch_chain_with(q, f, x, k, false)
}

fn launch_chain_with<Q: Queue>(
    q: &Q,
    f: &Function,
    x: &cudagraph::DeviceBuffer<f32>,
    k: usize,
    pdl: bool,
) -> Result<()> {
    let cfg = LaunchConfig::linear(1, N as u32);
    if x.len() < N {
        return Err(cudagraph::Error::SizeMismatch {
            what: "chain buffer",
            expected: N,
            got: x.len(),
        });
    }
    let opts = LaunchOptions::new().pdl(pdl);
    for _ in 0..k {
        // SAFETY: the chain kernel touches x[threadIdx.x] for threadIdx.x < n = N, and x holds
        // at least N elements (checked above); with `pdl` the kernel is chain_step_pdl, which
        // waits for the previous kernel (CG_PDL_ENTER) before touching x.
        unsafe { q.launch_with(f, cfg, args![x, N as i32], opts)? };
    }
    Ok(())
}

pub fn measure(dev: &Device, args: &ChainArgs, progress: &ProgressBar) -> Result<Vec<ChainRow>> {
    let m = dev.compile(
        "bench_chain",
        &format!("{}{}", cudagraph::PDL_CUDA, CHAIN_SRC),
    )?;
    let f = m.function("chain_step")?;
    let f_pdl = m.function("chain_step_pdl")?;
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
        let (mut eager_pdl, mut graph_pdl, mut edges) = (None, None, None);
        if args.pdl {
            launch_chain_with(&s, &f_pdl, &x, k, true)?;
            eager_pdl = Some(
                time_us(&s, 0, iters, args.repeats, || {
                    launch_chain_with(&s, &f_pdl, &x, k, true)
                })? / k as f64,
            );
            let (pg, ()) = Graph::capture(&mut s, CaptureOptions::new().upload(true), |cs| {
                launch_chain_with(cs, &f_pdl, &x, k, true)
            })?;
            pg.replay(&s)?;
            graph_pdl = Some(time_us(&s, 0, iters, args.repeats, || pg.replay(&s))? / k as f64);
            edges = Some(pg.info().programmatic_edges);
        }
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
            eager_pdl_us_per_kernel: eager_pdl,
            graph_pdl_us_per_kernel: graph_pdl,
            pdl_programmatic_edges: edges,
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
    if args.pdl {
        outln!(
            "programmatic dependent launch: {}",
            if dev.supports_pdl() {
                "on (sm_90+)"
            } else {
                "not supported here: the PDL columns are plain launches"
            }
        );
    }
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
        if let (Some(e), Some(g), Some(n)) = (
            r.eager_pdl_us_per_kernel,
            r.graph_pdl_us_per_kernel,
            r.pdl_programmatic_edges,
        ) {
            outln!(
                "{:>6} {:>8} {:>14} {:>14} {:>13.3} {:>13.3}   with PDL ({n} programmatic edges)",
                "",
                "",
                "",
                "",
                e,
                g
            );
        }
    }
    Ok(())
}
