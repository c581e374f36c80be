//! `cudagraph bench` (workloads): the seed workloads, eager vs graph, in one process.
//!
//! 1. `mlp`: seed 002's MLP 1024→512→256→10 inference at several batch sizes, the seed's way:
//!    device-resident input, `copy_` into the static input, replay, `clone` of the output,
//!    back to back. `mlp-host`: a serving request from host memory instead (copy in, forward,
//!    copy out, sync); graphed, one [`StaticGraph::run`] with the copies as graph nodes.
//! 2. `train`: seed 001's Linear(1024, 1024), MSE (sum), N = 64: forward + backward + optimizer
//!    step (SGD lr 1e-3, and Adam), `steps` back to back then one sync, per step.
//! 3. `pool`: seed 002/004's two models, Linear(1000, 500) at batch 32 and Conv2d(3, 64, 3) at
//!    16×3×224×224, captured into one 1 GiB-bounded pool; replay time and the pool's memory.
//! 4. `mlp-pool`: the seed MLP captured at nine batch sizes (256…1) into one shared pool,
//!    largest first: the pool's memory vs the largest capture alone.
//! 5. `dropout`: the seed MLP with dropout, a whole SGD training step graphed (fresh masks on
//!    every replay from the device-side generator), and one dropout op alone.
//!
//! `--dtype bf16` (or `f16`) runs them in mixed precision, as `bench/pytorch_baseline.py
//! --dtype` runs PyTorch's under `torch.autocast`: every forward pass and loss inside
//! [`autocast`](cudagraph_nn::autocast); inference models are [`AutocastModule`]s (weights cast
//! once; outputs kept in the 16-bit type, except the host round trip's, widened to f32 inside
//! the graph on both sides); training steps keep 16-bit copies of the parameters updated by the
//! fused optimizer (as `bench sweep --dtype`), and in f16 scale the loss with a [`GradScaler`]
//! (PyTorch's, with fused optimizers, the ones its scaler can step inside a capture). The
//! dropout op alone stays f32 (autocast leaves dropout in its input's type).
//!
//! `bench/pytorch_baseline.py` does the same work in PyTorch, measured the same way; with its
//! JSON (`--pytorch FILE`) the chart (`--svg FILE`) draws PyTorch's bars beside ours.
//! `--from-json FILE` reads the rows of an earlier `--json` run instead of measuring, to redraw
//! the chart or reprint the table without a GPU.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;
use cudagraph::{CaptureOptions, Device, Graph, QueueExt, StaticGraph, Stream};
use cudagraph_nn::{
    autocast_with, cross_entropy, mse_loss, no_grad, Adam, AdamConfig, AutocastModule,
    AutocastOptions, Conv2d, Dtype, Generator, GradScaler, GradScalerConfig, HostRng, Layer,
    Linear, NnModule, OptimOptions, Optimizer, Parameter, Reduction, Sequential, Sgd, SgdConfig,
    Targets, Tensor, TypedBuffer,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::report::{self, device_report, num, DeviceReport, Footnotes, NOT_APPLICABLE};

mod chart;

use chart::Baseline;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Args, Debug)]
pub struct WorkloadArgs {
    /// Workloads to run (comma separated): mlp, mlp-host, train, pool, mlp-pool, dropout.
    #[arg(long, value_delimiter = ',', default_values_t = ["mlp", "mlp-host", "train", "pool", "mlp-pool", "dropout"].map(String::from).to_vec())]
    pub only: Vec<String>,
    /// Batch sizes for the MLP inference workload.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 4, 8, 16, 32, 256])]
    pub batch_sizes: Vec<usize>,
    /// Timed iterations per sample.
    #[arg(long, default_value_t = 500)]
    pub iters: usize,
    /// Samples per measurement (median reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also write a bar chart of eager vs graph time to this SVG file.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// PyTorch's numbers for the same workloads (the JSON of bench/pytorch_baseline.py): the
    /// chart draws PyTorch's eager and graphed bars beside ours.
    #[arg(long, requires = "svg")]
    pub pytorch: Option<PathBuf>,
    /// Read the rows from this earlier `--json` output instead of measuring (no GPU needed):
    /// redraws the chart or reprints the table. A file of bench/results holding `ours` and
    /// `pytorch` serves as both, unless `--pytorch` names another.
    #[arg(long)]
    pub from_json: Option<PathBuf>,
    /// Element type of the products and convolutions: `f32` (exact f32, TF32 off), or `bf16` /
    /// `f16`: every forward pass and loss inside `autocast` with f32 master weights (see the
    /// module documentation), as `bench/pytorch_baseline.py --dtype` runs PyTorch's.
    #[arg(long, default_value = "f32")]
    pub dtype: Dtype,
}

/// One measured row: a workload at one configuration. A value that does not apply to the
/// row is `None` (`null` in JSON, `–` in the table), and `not_applicable` says why.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct Row {
    pub workload: String,
    pub config: String,
    pub eager_us: Option<f64>,
    pub graph_us: Option<f64>,
    pub speedup: Option<f64>,
    /// Peak bytes allocated above the baseline during the eager runs.
    pub eager_peak_bytes: Option<usize>,
    /// Bytes the graph's pool reserves.
    pub graph_pool_reserved: usize,
    /// Peak bytes the capture allocated in its pool.
    pub graph_peak_bytes: usize,
    pub capture_ms: f64,
    /// Largest relative difference between the graphed and the eager result.
    pub max_rel_diff: Option<f64>,
    /// Why some of the values above do not apply (the table's footnote).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_applicable: Option<String>,
}

/// Why the Adam training row has no max diff.
const ADAM_NOT_COMPARED: &str = "max diff not measured: Adam's moments and step count moved on \
     during the timing, so one more eager step and one replay do not start from the same state \
     (the GPU tests compare 100 graphed and eager Adam steps bit for bit)";

/// Why the nine-sizes row has no timings.
const MEMORY_ONLY: &str = "memory only: nine captures of the seed MLP sharing one pool; \
     nothing is timed or compared (the pool's numbers are in the note below)";

impl Row {
    /// A row for a workload measured eager and graphed, with the graph's memory and capture
    /// time from its `GraphInfo` (its pool's reserved bytes are read from the device).
    fn measured(
        workload: &str,
        config: String,
        (eager_us, graph_us, eager_peak_bytes): (f64, f64, usize),
        dev: &Device,
        info: &cudagraph::GraphInfo,
        max_rel_diff: Option<f64>,
    ) -> Self {
        Row {
            workload: workload.into(),
            config,
            eager_us: Some(eager_us),
            graph_us: Some(graph_us),
            speedup: Some(eager_us / graph_us),
            eager_peak_bytes: Some(eager_peak_bytes),
            graph_pool_reserved: dev.pool_stats(info.memory.pool).reserved,
            graph_peak_bytes: info.memory.peak_allocated,
            capture_ms: info.capture_time.as_secs_f64() * 1e3,
            max_rel_diff,
            not_applicable: None,
        }
    }
}

#[derive(Serialize, Deserialize)]
pub struct Report {
    pub benchmark: String,
    /// The element type of products and convolutions (`--dtype`; absent in older files: f32).
    #[serde(default = "f32_name")]
    pub dtype: String,
    pub device: DeviceReport,
    pub iters: usize,
    pub repeats: usize,
    pub rows: Vec<Row>,
    pub notes: Vec<String>,
}

fn f32_name() -> String {
    Dtype::F32.to_string()
}

/// An inference model in `--dtype`: with bf16/f16 an [`AutocastModule`] (16-bit weight copies
/// made once) whose output stays in the 16-bit type when `keep_output` (as `torch.autocast`
/// returns it) and is widened to f32 otherwise; with f32 the model itself, unchanged.
fn inference<M: NnModule>(
    s: &Stream,
    model: M,
    a: &WorkloadArgs,
    keep_output: bool,
) -> cudagraph_nn::Result<AutocastModule<M>> {
    Ok(AutocastModule::new(s, model, a.dtype)?.keep_output(keep_output))
}

/// The optimizer options of a training step in `--dtype`: bf16/f16 keep 16-bit copies of the
/// parameters, updated by the fused step and used by the forward pass instead of casts.
fn optim_options(a: &WorkloadArgs) -> OptimOptions {
    OptimOptions {
        copies: (a.dtype != Dtype::F32).then_some(a.dtype),
    }
}

/// The loss scaler of a training step in `--dtype`: PyTorch's defaults, enabled for f16 only
/// (disabled, every call passes through: the f32 and bf16 steps are what they were without it).
fn scaler(s: &Stream, a: &WorkloadArgs) -> cudagraph_nn::Result<GradScaler> {
    GradScaler::new(
        s,
        GradScalerConfig {
            enabled: a.dtype == Dtype::F16,
            ..GradScalerConfig::default()
        },
    )
}

/// `f` (a forward pass and its loss) inside an autocast scope of `--dtype` that uses the
/// optimizer's 16-bit `copies` (with f32: autocast off, `f` as it is).
fn mixed<R>(
    a: &WorkloadArgs,
    copies: &[(Parameter, TypedBuffer)],
    f: impl FnOnce() -> cudagraph_nn::Result<R>,
) -> cudagraph_nn::Result<R> {
    let options = AutocastOptions {
        dtype: a.dtype,
        copies: copies.to_vec(),
    };
    autocast_with(options, f)?
}

/// The backward pass and update of a training step from its unscaled `loss`: scaled,
/// stepped and the scale updated by `scaler` (pass-through unless f16).
fn scaled_step(
    q: &dyn cudagraph::Queue,
    scaler: &std::cell::RefCell<GradScaler>,
    opt: &mut dyn Optimizer,
    loss: &Tensor,
) -> cudagraph_nn::Result<()> {
    let mut scaler = scaler.borrow_mut();
    scaler.scale(q, loss)?.backward(q)?;
    scaler.step(q, opt)?;
    scaler.update(q)
}

/// A copy of `t`'s elements, in its own type (PyTorch's `static_output.clone()`).
fn clone_values(s: &Stream, t: &Tensor) -> AnyResult<TypedBuffer> {
    fn copy<T: cudagraph_nn::Float>(
        s: &Stream,
        b: &Arc<cudagraph::DeviceBuffer<T>>,
    ) -> AnyResult<TypedBuffer> {
        let out = s.alloc::<T>(b.len())?;
        s.copy(b, &out)?;
        Ok(TypedBuffer::new(Arc::new(out)))
    }
    match t.buffer() {
        TypedBuffer::F32(b) => copy(s, b),
        TypedBuffer::Bf16(b) => copy(s, b),
        TypedBuffer::F16(b) => copy(s, b),
    }
}

/// The workloads' timing: three warm-up calls, then [`report::time_us`].
fn time_us(
    s: &Stream,
    iters: usize,
    repeats: usize,
    body: impl FnMut() -> AnyResult<()>,
) -> AnyResult<f64> {
    report::time_us(s, 3, iters, repeats, body)
}

/// What every graphed workload here measures the same way: three warm-up runs of `work` on a
/// side stream (seed 001), eager timing with the peak bytes allocated above the baseline, then
/// one capture and the replay timing. Returns `(eager µs, graph µs, eager peak)`, the graph
/// and what the captured `work` returned.
fn eager_then_graph<T>(
    dev: &Device,
    s: &mut Stream,
    a: &WorkloadArgs,
    mut work: impl FnMut(&dyn cudagraph::Queue) -> cudagraph_nn::Result<T>,
) -> AnyResult<((f64, f64, usize), Graph, T)> {
    let side = dev.new_stream()?;
    cudagraph::warmup(s, &side, 3, |q| work(q).map(drop).map_err(Into::into))?;
    s.synchronize()?;
    dev.reset_peak_memory_stats();
    let base = dev.memory_stats().allocated;
    let eager = time_us(s, a.iters, a.repeats, || {
        work(&*s).map(drop).map_err(Into::into)
    })?;
    let eager_peak = dev.memory_stats().peak_allocated - base;
    let (g, out) = Graph::capture(s, CaptureOptions::new().upload(true), |cs| Ok(work(cs)?))?;
    let graph = time_us(s, a.iters, a.repeats, || g.replay(s).map_err(Into::into))?;
    Ok(((eager, graph, eager_peak), g, out))
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y).abs() / y.abs().max(1e-3)) as f64)
        .fold(0.0, f64::max)
}

pub fn seed_mlp(s: &Stream, rng: &mut HostRng) -> cudagraph_nn::Result<Sequential> {
    Ok(Sequential::new(vec![
        Layer::Linear(Linear::new(s, 1024, 512, rng)?),
        Layer::ReLU,
        Layer::Linear(Linear::new(s, 512, 256, rng)?),
        Layer::ReLU,
        Layer::Linear(Linear::new(s, 256, 10, rng)?),
    ]))
}

/// Seed 002's exact pattern: the input is already on the device; a graphed request is
/// `static_input.copy_(x)`, `replay()`, `static_output.clone()`; eager is `model(x)`. Requests
/// run back to back with one synchronisation at the end (throughput), as in the seed.
fn mlp_device(
    dev: &Device,
    a: &WorkloadArgs,
    rows: &mut Vec<Row>,
    pb: &ProgressBar,
) -> AnyResult<()> {
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(2);
    let model = seed_mlp(&s, &mut rng)?;
    let model = inference(&s, model, a, true)?;
    for &bs in &a.batch_sizes {
        pb.set_message(format!("mlp bs {bs}"));
        let x = Tensor::from_host(&s, &rng.vec_normal(bs * 1024), &[bs, 1024])?;
        let eager_out = no_grad(|| model.forward(&s, &x))?.to_vec(&s)?;
        s.synchronize()?;
        dev.reset_peak_memory_stats();
        let base = dev.memory_stats().allocated;
        let eager = time_us(&s, a.iters, a.repeats, || {
            no_grad(|| model.forward(&s, &x))?;
            Ok(())
        })?;
        let eager_peak = dev.memory_stats().peak_allocated - base;
        let static_in = s.alloc_zeroed::<f32>(bs * 1024)?;
        let sx = Tensor::from_buffer(Arc::new(static_in.alias()), &[bs, 1024])?;
        let (g, static_out) = Graph::capture(&mut s, CaptureOptions::new().upload(true), |cs| {
            Ok(no_grad(|| model.forward(cs, &sx))?)
        })?;
        let request = |s: &Stream| -> AnyResult<TypedBuffer> {
            s.copy(x.data()?, &static_in)?;
            g.replay(s)?;
            clone_values(s, &static_out)
        };
        let graph_out = Tensor::from_typed(request(&s)?, &[bs, 10])?.to_vec(&s)?;
        let graph = time_us(&s, a.iters, a.repeats, || request(&s).map(|_| ()))?;
        let info = *g.info();
        rows.push(Row::measured(
            "mlp-inference",
            format!("bs={bs}"),
            (eager, graph, eager_peak),
            dev,
            &info,
            Some(max_rel(&graph_out, &eager_out)),
        ));
        pb.inc(1);
    }
    Ok(())
}

/// A serving request from host memory: copy in, forward, copy out, synchronise (latency).
/// Graphed with [`StaticGraph`]: the copies are graph nodes and staging is pinned.
fn mlp_host(
    dev: &Device,
    a: &WorkloadArgs,
    rows: &mut Vec<Row>,
    pb: &ProgressBar,
) -> AnyResult<()> {
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(2);
    let model = seed_mlp(&s, &mut rng)?;
    // The output goes to f32 host memory: widened to f32 on the device, inside the graph.
    let model = inference(&s, model, a, false)?;
    for &bs in &a.batch_sizes {
        pb.set_message(format!("mlp bs {bs}"));
        let xh = rng.vec_normal(bs * 1024);
        // Eager request, like PyTorch's with a pinned host tensor prepared once: upload from
        // pinned memory, forward, download into pinned memory, one synchronisation.
        let mut x_pinned = dev.alloc_pinned::<f32>(bs * 1024)?;
        x_pinned.as_mut_slice().copy_from_slice(&xh);
        let mut out_pinned = dev.alloc_pinned::<f32>(bs * 10)?;
        let eager_req = |s: &Stream, out: &mut cudagraph::PinnedBuffer<f32>| -> AnyResult<()> {
            s.pinned_scope(|sc| {
                let x = sc.stream().alloc::<f32>(bs * 1024)?;
                sc.upload(&x_pinned, &x)?;
                let y = no_grad(|| {
                    model.forward(sc.stream(), &Tensor::from_buffer(Arc::new(x), &[bs, 1024])?)
                })?;
                sc.download(y.data()?, out)
            })?;
            Ok(())
        };
        eager_req(&s, &mut out_pinned)?;
        let eager_out = out_pinned.as_slice().to_vec();
        dev.reset_peak_memory_stats();
        let base = dev.memory_stats().allocated;
        let eager = time_us(&s, a.iters, a.repeats, || eager_req(&s, &mut out_pinned))?;
        let eager_peak = dev.memory_stats().peak_allocated - base;
        let mut sg = StaticGraph::<f32, f32>::capture(
            &mut s,
            CaptureOptions::new().upload(true),
            &[bs * 1024],
            |cs, ins| {
                no_grad(|| {
                    let x = Tensor::from_buffer(Arc::new(ins[0].alias()), &[bs, 1024])?;
                    Ok(vec![model.forward(cs, &x)?.data()?.alias()])
                })
            },
        )?;
        let graph_out = sg.run_to_vecs(&s, &[&xh])?.remove(0);
        // Like PyTorch's pinned host tensor prepared once: the request sits in pinned staging.
        sg.host_input_mut(0)?.copy_from_slice(&xh);
        let graph = time_us(&s, a.iters, a.repeats, || {
            sg.run_staged(&s)?;
            Ok(())
        })?;
        let info = *sg.info();
        rows.push(Row::measured(
            "mlp-host-roundtrip",
            format!("bs={bs}"),
            (eager, graph, eager_peak),
            dev,
            &info,
            Some(max_rel(&graph_out, &eager_out)),
        ));
        pb.inc(1);
    }
    Ok(())
}

fn train(dev: &Device, a: &WorkloadArgs, rows: &mut Vec<Row>, pb: &ProgressBar) -> AnyResult<()> {
    for adam in [false, true] {
        pb.set_message(if adam { "train adam" } else { "train sgd" });
        let mut s = dev.new_stream()?;
        let mut rng = HostRng::new(1);
        let model = Linear::new(&s, 1024, 1024, &mut rng)?;
        let mut opt: Box<dyn Optimizer> = if adam {
            let cfg = AdamConfig {
                lr: 1e-3,
                ..AdamConfig::default()
            };
            Box::new(Adam::with_options(
                &s,
                model.parameters(),
                cfg,
                optim_options(a),
            )?)
        } else {
            let cfg = SgdConfig {
                lr: 1e-3,
                momentum: 0.0,
                weight_decay: 0.0,
            };
            Box::new(Sgd::with_options(
                &s,
                model.parameters(),
                cfg,
                optim_options(a),
            )?)
        };
        let copies = opt.copies().unwrap_or_default();
        let scaler = std::cell::RefCell::new(scaler(&s, a)?);
        let x = Tensor::from_host(&s, &rng.vec_normal(64 * 1024), &[64, 1024])?;
        let y = Tensor::from_host(&s, &rng.vec_normal(64 * 1024), &[64, 1024])?;
        let step = |q: &dyn cudagraph::Queue,
                    opt: &mut Box<dyn Optimizer>|
         -> cudagraph_nn::Result<Tensor> {
            opt.zero_grad(q, true)?;
            let loss = mixed(a, &copies, || {
                mse_loss(q, &model.forward(q, &x)?, &y, Reduction::Sum)
            })?;
            scaled_step(q, &scaler, &mut **opt, &loss)?;
            Ok(loss)
        };
        let (times, g, _loss) = eager_then_graph(dev, &mut s, a, |q| step(q, &mut opt))?;
        // Same code, same data: one more eager step and one replay from equal weights (their
        // 16-bit copies recast, the scaler's state put back) agree.
        let w0 = s.to_vec(model.weight.data()?)?;
        let scale0 = scaler.borrow().state_dict(&s)?;
        step(&s, &mut opt)?;
        let w_eager = s.to_vec(model.weight.data()?)?;
        s.copy_from_host(&w0, model.weight.data()?)?;
        opt.refresh_copies(&s)?;
        scaler.borrow_mut().load_state_dict(&s, &scale0)?;
        g.replay(&s)?;
        let w_graph = s.to_vec(model.weight.data()?)?;
        let info = *g.info();
        // Adam's moments and step count moved on during the timing, so only SGD (stateless
        // here) can be compared this way.
        let mut row = Row::measured(
            "linear-train",
            if adam { "adam".into() } else { "sgd".into() },
            times,
            dev,
            &info,
            (!adam).then(|| max_rel(&w_graph, &w_eager)),
        );
        if adam {
            row.not_applicable = Some(ADAM_NOT_COMPARED.into());
        }
        rows.push(row);
        pb.inc(1);
    }
    Ok(())
}

/// `dropout`: a training step with dropout, graphed, which only works because the generator's
/// state lives on the device (each replay draws fresh masks): the seed MLP with Dropout(0.1)
/// after each ReLU, batch 64, cross-entropy, SGD (lr 0.01, no momentum, so a step is a function
/// of the weights and the generator alone and graph and eager can be compared); and one
/// dropout op (64×4096, p 0.1) alone, forward only.
fn dropout(dev: &Device, a: &WorkloadArgs, rows: &mut Vec<Row>, pb: &ProgressBar) -> AnyResult<()> {
    pb.set_message("dropout train");
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(3);
    let seed = 7;
    let gen = Generator::new(&s, seed)?;
    let model = Sequential::new(vec![
        Layer::Linear(Linear::new(&s, 1024, 512, &mut rng)?),
        Layer::ReLU,
        Layer::Dropout { p: 0.1 },
        Layer::Linear(Linear::new(&s, 512, 256, &mut rng)?),
        Layer::ReLU,
        Layer::Dropout { p: 0.1 },
        Layer::Linear(Linear::new(&s, 256, 10, &mut rng)?),
    ])
    .with_generator(gen.clone());
    let cfg = SgdConfig {
        lr: 0.01,
        momentum: 0.0,
        weight_decay: 0.0,
    };
    let mut opt = Sgd::with_options(&s, model.parameters(), cfg, optim_options(a))?;
    let copies = opt.copies().unwrap_or_default();
    let scaler = std::cell::RefCell::new(scaler(&s, a)?);
    let (bs, classes) = (64usize, 10usize);
    let x = Tensor::from_host(&s, &rng.vec_normal(bs * 1024), &[bs, 1024])?;
    let labels: Vec<i32> = (0..bs).map(|i| ((i * 7) % classes) as i32).collect();
    let y = Targets::from_host(&s, &labels, classes)?;
    let step = |q: &dyn cudagraph::Queue, opt: &mut Sgd| -> cudagraph_nn::Result<Tensor> {
        opt.zero_grad(q, true)?;
        let loss = mixed(a, &copies, || cross_entropy(q, &model.forward(q, &x)?, &y))?;
        scaled_step(q, &scaler, opt, &loss)?;
        Ok(loss)
    };
    let (times, g, _loss) = eager_then_graph(dev, &mut s, a, |q| step(q, &mut opt))?;
    // From equal weights and the same (seed, counter), one eager step and one replay draw the
    // same masks and agree; a second replay draws new masks and moves the weights differently.
    let first = match &model.layers[0] {
        Layer::Linear(l) => l.weight.data()?,
        _ => unreachable!("the first layer is the Linear built above"),
    };
    // Every parameter goes back to where the eager step started (the first layer's gradient
    // depends on the layers after it).
    let params = model.parameters();
    let mut start = Vec::with_capacity(params.len());
    for p in &params {
        start.push(s.to_vec(p.data()?)?);
    }
    let scale0 = scaler.borrow().state_dict(&s)?;
    gen.manual_seed(&s, seed)?;
    step(&s, &mut opt)?;
    let w_eager = s.to_vec(first)?;
    for (p, v) in params.iter().zip(&start) {
        s.copy_from_host(v, p.data()?)?;
    }
    opt.refresh_copies(&s)?;
    scaler.borrow_mut().load_state_dict(&s, &scale0)?;
    gen.manual_seed(&s, seed)?;
    g.replay(&s)?;
    let w_graph = s.to_vec(first)?;
    let info = *g.info();
    rows.push(Row::measured(
        "dropout-train",
        format!("mlp-p0.1-bs{bs}-sgd"),
        times,
        dev,
        &info,
        Some(max_rel(&w_graph, &w_eager)),
    ));
    pb.inc(1);

    pb.set_message("dropout op");
    let (m, n) = (64usize, 4096usize);
    let xo = Tensor::from_host(&s, &rng.vec_normal(m * n), &[m, n])?;
    let op = |q: &dyn cudagraph::Queue| -> cudagraph_nn::Result<Tensor> {
        let y = cudagraph_nn::autograd::ops::dropout(q, &xo, 0.1, true, &gen)?;
        gen.advance(q)?;
        Ok(y)
    };
    let (times, g, yo) = eager_then_graph(dev, &mut s, a, |q| no_grad(|| op(q)))?;
    gen.manual_seed(&s, seed)?;
    let ye = no_grad(|| op(&s))?.to_vec(&s)?;
    gen.manual_seed(&s, seed)?;
    g.replay(&s)?;
    let yg = yo.to_vec(&s)?;
    let info = *g.info();
    rows.push(Row::measured(
        "dropout-op",
        format!("{m}x{n}-p0.1"),
        times,
        dev,
        &info,
        Some(max_rel(&yg, &ye)),
    ));
    pb.inc(1);
    Ok(())
}

fn pool(
    dev: &Device,
    a: &WorkloadArgs,
    rows: &mut Vec<Row>,
    pb: &ProgressBar,
    notes: &mut Vec<String>,
) -> AnyResult<()> {
    pb.set_message("pool");
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(3);
    let pool = dev.new_pool_with_limit(1 << 30);
    let lin = inference(&s, Linear::new(&s, 1000, 500, &mut rng)?, a, true)?;
    let conv = inference(&s, Conv2d::new(&s, 3, 64, 3, 1, 0, &mut rng)?, a, true)?;
    let x1 = Tensor::from_host(&s, &rng.vec_normal(32 * 1000), &[32, 1000])?;
    let x2 = Tensor::from_host(&s, &rng.vec_normal(16 * 3 * 224 * 224), &[16, 3, 224, 224])?;
    let models: [(&str, &dyn NnModule, &Tensor); 2] = [
        ("linear-1000x500-bs32", &lin, &x1),
        ("conv2d-3x64-16x3x224x224", &conv, &x2),
    ];
    let mut keep = Vec::new(); // both graphs stay alive in the pool for the memory note below
    for (name, m, x) in models {
        let eager_out = no_grad(|| m.forward(&s, x))?.to_vec(&s)?;
        dev.reset_peak_memory_stats();
        let base = dev.memory_stats().allocated;
        let eager = time_us(&s, a.iters.min(200), a.repeats, || {
            no_grad(|| m.forward(&s, x))?;
            Ok(())
        })?;
        let eager_peak = dev.memory_stats().peak_allocated - base;
        let (g, y) = Graph::capture(
            &mut s,
            CaptureOptions::new().pool(&pool).upload(true),
            |cs| Ok(no_grad(|| m.forward(cs, x))?),
        )?;
        let graph = time_us(&s, a.iters.min(200), a.repeats, || {
            g.replay(&s).map_err(Into::into)
        })?;
        let info = *g.info();
        rows.push(Row::measured(
            "shared-pool",
            name.into(),
            (eager, graph, eager_peak),
            dev,
            &info,
            Some(max_rel(&y.to_vec(&s)?, &eager_out)),
        ));
        keep.push((g, y));
    }
    let st = pool.stats();
    notes.push(format!(
        "shared 1 GiB pool with both models: allocated {:.1} MB, reserved {:.1} MB, peak {:.1} MB",
        st.allocated as f64 / 1048576.0,
        st.reserved as f64 / 1048576.0,
        st.peak_allocated as f64 / 1048576.0
    ));
    drop(keep);
    pb.inc(1);
    Ok(())
}

fn mlp_pool(
    dev: &Device,
    a: &WorkloadArgs,
    rows: &mut Vec<Row>,
    pb: &ProgressBar,
    notes: &mut Vec<String>,
) -> AnyResult<()> {
    pb.set_message("mlp-pool");
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(4);
    let model = inference(&s, seed_mlp(&s, &mut rng)?, a, true)?;
    let sizes = [256usize, 192, 128, 64, 32, 16, 8, 4, 1];
    let single = {
        let x = Tensor::from_host(&s, &rng.vec_normal(256 * 1024), &[256, 1024])?;
        let (g, _y) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            Ok(no_grad(|| model.forward(cs, &x))?)
        })?;
        let p = g.pool().expect("captured graph has a pool").stats();
        (p.reserved, g.info().memory.peak_allocated)
    };
    let pool = dev.graph_pool_handle();
    let mut keep = Vec::new();
    for &bs in &sizes {
        let x = Tensor::from_host(&s, &rng.vec_normal(bs * 1024), &[bs, 1024])?;
        let (g, y) = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
            Ok(no_grad(|| model.forward(cs, &x))?)
        })?;
        keep.push((g, x, y));
    }
    let st = pool.stats();
    rows.push(Row {
        workload: "mlp-9-sizes-shared-pool".into(),
        config: "bs=256..1".into(),
        eager_us: None,
        graph_us: None,
        speedup: None,
        eager_peak_bytes: None,
        graph_pool_reserved: st.reserved,
        graph_peak_bytes: st.peak_allocated,
        capture_ms: keep
            .iter()
            .map(|(g, _, _)| g.info().capture_time.as_secs_f64() * 1e3)
            .sum(),
        max_rel_diff: None,
        not_applicable: Some(MEMORY_ONLY.into()),
    });
    // The largest working set of any one size (with split-K, not always the largest batch).
    let largest_entry = keep
        .iter()
        .map(|(g, _, _)| g.info().memory.peak_allocated)
        .max()
        .unwrap_or(0);
    notes.push(format!(
        "seed MLP at nine batch sizes in one pool: reserved {:.2} MB, peak allocated {:.3} MB; the largest entry's working set {:.3} MB (pool peak / largest entry {:.3}); bs 256 captured alone: reserved {:.2} MB, peak {:.3} MB (pool reserved / alone {:.3})",
        st.reserved as f64 / 1048576.0,
        st.peak_allocated as f64 / 1048576.0,
        largest_entry as f64 / 1048576.0,
        st.peak_allocated as f64 / largest_entry.max(1) as f64,
        single.0 as f64 / 1048576.0,
        single.1 as f64 / 1048576.0,
        st.reserved as f64 / single.0.max(1) as f64
    ));
    pb.inc(1);
    Ok(())
}

/// Measures the workloads `a.only` names on device `ordinal`.
fn measure(ordinal: usize, a: &WorkloadArgs) -> AnyResult<Report> {
    let dev = Device::open(ordinal)?;
    let total = a
        .only
        .iter()
        .map(|w| match w.as_str() {
            "mlp" | "mlp-host" => a.batch_sizes.len(),
            "train" | "dropout" => 2,
            _ => 1,
        })
        .sum::<usize>();
    let pb = ProgressBar::new(total as u64);
    pb.set_style(
        ProgressStyle::with_template("bench {bar:30} {pos}/{len} {msg}").expect("valid template"),
    );
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    for w in &a.only {
        match w.as_str() {
            "mlp" => mlp_device(&dev, a, &mut rows, &pb)?,
            "mlp-host" => mlp_host(&dev, a, &mut rows, &pb)?,
            "train" => train(&dev, a, &mut rows, &pb)?,
            "pool" => pool(&dev, a, &mut rows, &pb, &mut notes)?,
            "mlp-pool" => mlp_pool(&dev, a, &mut rows, &pb, &mut notes)?,
            "dropout" => dropout(&dev, a, &mut rows, &pb)?,
            other => {
                return Err(format!(
                    "unknown workload `{other}`; expected mlp, mlp-host, train, pool, mlp-pool or dropout"
                )
                .into())
            }
        }
    }
    pb.finish_and_clear();
    Ok(Report {
        benchmark: "workloads".into(),
        dtype: a.dtype.to_string(),
        device: device_report(&dev)?,
        iters: a.iters,
        repeats: a.repeats,
        rows,
        notes,
    })
}

/// An earlier `--json` output, or a file of bench/results that holds it as `ours` (with
/// PyTorch's beside it as `pytorch`, when that run has rows).
fn read_report(path: &Path) -> AnyResult<(Report, Option<Baseline>)> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let bad = |e: serde_json::Error| {
        format!(
            "{}: not a `cudagraph bench --json` output: {e}",
            path.display()
        )
    };
    let mut doc: serde_json::Value = serde_json::from_str(&text).map_err(bad)?;
    let Some(ours) = doc.get_mut("ours").map(serde_json::Value::take) else {
        return Ok((serde_json::from_value(doc).map_err(bad)?, None));
    };
    let pytorch = doc
        .get_mut("pytorch")
        .map(serde_json::Value::take)
        .and_then(|p| serde_json::from_value::<Baseline>(p).ok())
        .filter(|p| !p.rows.is_empty());
    Ok((serde_json::from_value(ours).map_err(bad)?, pytorch))
}

pub fn run(ordinal: usize, a: &WorkloadArgs) -> AnyResult<()> {
    // PyTorch's file is read first, so that a wrong path fails before the measurements.
    let pytorch = a.pytorch.as_deref().map(Baseline::read).transpose()?;
    let (report, pytorch) = match &a.from_json {
        Some(path) => {
            let (report, merged) = read_report(path)?;
            (report, pytorch.or(merged))
        }
        None => (measure(ordinal, a)?, pytorch),
    };
    if let Some(path) = &a.svg {
        std::fs::write(
            path,
            chart::svg(&report.rows, &report.device.name, pytorch.as_ref()),
        )?;
    }
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    for line in table(&report) {
        outln!("{line}");
    }
    Ok(())
}

/// The human-readable report: a header, one line per row (`–` where a value does not apply,
/// with a footnote under the table saying why), then the notes.
fn table(report: &Report) -> Vec<String> {
    let mut out = vec![
        format!(
            "cudagraph workloads on {} (CUDA {}), {}, median of {} samples x {} iterations",
            report.device.name,
            report.device.driver_cuda_version,
            if report.dtype == "f32" {
                "f32".to_string()
            } else {
                format!("{} autocast", report.dtype)
            },
            report.repeats,
            report.iters
        ),
        format!(
            "{:<24} {:<26} {:>10} {:>10} {:>8} {:>12} {:>12} {:>12} {:>9} {:>9}",
            "workload",
            "config",
            "eager us",
            "graph us",
            "speedup",
            "eager peak",
            "pool resv",
            "graph peak",
            "capt ms",
            "max diff"
        ),
    ];
    let mb = |b: usize| format!("{:.2} MB", b as f64 / 1048576.0);
    let mut footnotes = Footnotes::default();
    for r in &report.rows {
        let mut config = r.config.clone();
        if let Some(why) = &r.not_applicable {
            config += &footnotes.mark(why);
        }
        out.push(format!(
            "{:<24} {:<26} {:>10} {:>10} {:>8} {:>12} {:>12} {:>12} {:>9.2} {:>9}",
            r.workload,
            config,
            num(r.eager_us, 2),
            num(r.graph_us, 2),
            r.speedup
                .map_or(NOT_APPLICABLE.into(), |v| format!("{v:.2}x")),
            r.eager_peak_bytes.map_or(NOT_APPLICABLE.into(), mb),
            mb(r.graph_pool_reserved),
            mb(r.graph_peak_bytes),
            r.capture_ms,
            r.max_rel_diff
                .map_or(NOT_APPLICABLE.into(), |v| format!("{v:.1e}")),
        ));
    }
    out.extend(footnotes.lines());
    out.extend(report.notes.iter().map(|n| format!("note: {n}")));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn row(workload: &str, config: &str, eager: f64, graph: f64) -> Row {
        Row {
            workload: workload.into(),
            config: config.into(),
            eager_us: Some(eager),
            graph_us: Some(graph),
            speedup: Some(eager / graph),
            eager_peak_bytes: Some(1 << 20),
            graph_pool_reserved: 2 << 20,
            graph_peak_bytes: 1 << 20,
            capture_ms: 1.5,
            max_rel_diff: Some(1e-7),
            not_applicable: None,
        }
    }

    fn report(rows: Vec<Row>) -> Report {
        Report {
            benchmark: "workloads".into(),
            dtype: "f32".into(),
            device: DeviceReport {
                ordinal: 0,
                name: "Test GPU".into(),
                compute_capability: "9.0".into(),
                multiprocessors: 132,
                total_memory_mib: 81559.0,
                free_memory_mib: 80000.0,
                driver_cuda_version: "13.0".into(),
            },
            iters: 500,
            repeats: 5,
            rows,
            notes: vec!["a note".into()],
        }
    }

    /// The Adam row and the nine-sizes row, as the workloads build them.
    fn rows_with_gaps() -> Vec<Row> {
        let mut adam = row("linear-train", "adam", 50.4, 35.9);
        adam.max_rel_diff = None;
        adam.not_applicable = Some(ADAM_NOT_COMPARED.into());
        let nine = Row {
            eager_us: None,
            graph_us: None,
            speedup: None,
            eager_peak_bytes: None,
            max_rel_diff: None,
            not_applicable: Some(MEMORY_ONLY.into()),
            ..row("mlp-9-sizes-shared-pool", "bs=256..1", 0.0, 1.0)
        };
        vec![row("linear-train", "sgd", 51.1, 28.1), adam, nine]
    }

    #[test]
    fn values_that_do_not_apply_print_a_dash_and_a_footnote() {
        let lines = table(&report(rows_with_gaps()));
        let text = lines.join("\n");
        assert!(!text.contains("NaN"), "{text}");
        let adam = lines.iter().find(|l| l.contains("adam")).unwrap();
        assert!(adam.contains("adam [1]"), "{adam}");
        assert!(adam.trim_end().ends_with(NOT_APPLICABLE), "{adam}");
        assert!(adam.contains("50.40") && adam.contains("1.40x"), "{adam}");
        let nine = lines.iter().find(|l| l.contains("mlp-9-sizes")).unwrap();
        assert!(nine.contains("bs=256..1 [2]"), "{nine}");
        // eager, graph, speedup, eager peak and max diff.
        assert_eq!(nine.matches(NOT_APPLICABLE).count(), 5, "{nine}");
        let sgd = lines.iter().find(|l| l.contains("sgd")).unwrap();
        assert!(!sgd.contains(NOT_APPLICABLE) && !sgd.contains('['), "{sgd}");
        // The footnotes follow the rows, then the notes.
        let n = lines.len();
        assert_eq!(lines[n - 3], format!("[1] {ADAM_NOT_COMPARED}"));
        assert_eq!(lines[n - 2], format!("[2] {MEMORY_ONLY}"));
        assert_eq!(lines[n - 1], "note: a note");
    }

    #[test]
    fn the_dash_keeps_the_columns_aligned() {
        let lines = table(&report(rows_with_gaps()));
        let widths: Vec<usize> = lines[1..4].iter().map(|l| l.chars().count()).collect();
        assert!(
            widths.iter().all(|&w| w == widths[0]),
            "{widths:?}\n{}",
            lines.join("\n")
        );
    }

    #[test]
    fn json_has_null_where_a_value_does_not_apply() {
        let json = serde_json::to_string_pretty(&report(rows_with_gaps())).unwrap();
        assert!(!json.contains("NaN"), "{json}");
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        let nine = &v["rows"][2];
        for key in [
            "eager_us",
            "graph_us",
            "speedup",
            "eager_peak_bytes",
            "max_rel_diff",
        ] {
            assert!(nine[key].is_null(), "{key}: {}", nine[key]);
        }
        assert_eq!(nine["not_applicable"], MEMORY_ONLY);
        assert!(v["rows"][1]["max_rel_diff"].is_null());
        assert!(v["rows"][0].get("not_applicable").is_none());
        // And it reads back (`--from-json`).
        let back: Report = serde_json::from_str(&json).unwrap();
        assert_eq!(back.rows[2].graph_us, None);
        assert_eq!(back.rows[0].graph_us, Some(28.1));
    }

    #[test]
    fn the_precision_is_in_the_report_and_older_reports_read_as_f32() {
        let mut r = report(rows_with_gaps());
        assert!(table(&r)[0].contains(", f32, "), "{}", table(&r)[0]);
        r.dtype = "bf16".into();
        assert!(table(&r)[0].contains("bf16 autocast"), "{}", table(&r)[0]);
        let mut v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["dtype"], "bf16");
        v.as_object_mut().unwrap().remove("dtype");
        let back: Report = serde_json::from_value(v).unwrap();
        assert_eq!(back.dtype, "f32");
    }

    #[test]
    fn a_results_file_gives_both_sides() {
        let dir = std::env::temp_dir().join(format!("cudagraph-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("seed.json");
        let ours = serde_json::to_value(report(rows_with_gaps())).unwrap();
        let pytorch = serde_json::json!({"torch": "2.11", "device": "Test GPU", "rows": [
            {"workload": "linear-train", "config": "sgd", "eager_us": 523.4, "graph_us": 63.3},
            {"workload": "mlp-9-sizes-shared-pool", "config": "bs=256..1", "eager_us": null, "graph_us": null}
        ]});
        let doc = serde_json::json!({"device": "h100", "ours": ours, "pytorch": pytorch});
        std::fs::write(&path, doc.to_string()).unwrap();
        let (r, p) = read_report(&path).unwrap();
        assert_eq!(r.rows.len(), 3);
        assert_eq!(p.unwrap().rows[0].graph_us, Some(63.3));
        // A run without PyTorch (its side says why) gives ours alone.
        let doc = serde_json::json!({"ours": ours, "pytorch": {"torch": "not run", "device": "-", "rows": [], "notes": ["failed"]}});
        std::fs::write(&path, doc.to_string()).unwrap();
        assert!(read_report(&path).unwrap().1.is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
