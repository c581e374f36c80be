//! `cudagraph bench sweep`: graphed forward and graphed training steps over a grid of shapes
//! that are not the seeds' — Linear, Conv2d, cross-entropy from 10 to 50 000 classes, MLPs and
//! CNNs of several depths, and optimizer steps on 0.1–100 M parameters — beside
//! `bench/pytorch_sweep.py`, which measures the same points in PyTorch the same way.
//!
//! Both read the points from `data/sweep_points.json` in this crate (this binary carries a copy
//! from build time; `--points FILE` reads another). Per point and mode: capture once (after a two-step
//! warm-up on a side stream), then the median of `--repeats` samples, each as many back-to-back
//! replays as fill `--sample-ms` (at least one), ended by one synchronisation.
//! `bench/sweep_compare.py` joins the two JSON outputs into a markdown table.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use cudagraph::{CaptureOptions, Device, Graph, Queue, Stream};
use cudagraph_nn::autograd::ops::{ce_plan, ce_plan_with, CeOptions, CE_FUSED_ROWS};
use cudagraph_nn::engine::{CeEngine, Engines};
use cudagraph_nn::nn::optim::{CAP_L, CAP_S};
use cudagraph_nn::{
    autocast_with, cross_entropy, mse_loss, no_grad, Adam, AdamConfig, AutocastModule,
    AutocastOptions, Conv2d, Dtype, HostRng, Layer, Linear, NnModule, OptimOptions, Optimizer,
    Parameter, Reduction, Sequential, Sgd, SgdConfig, Targets, Tensor, TypedBuffer,
};
use serde::{Deserialize, Serialize};

use crate::report::{self, device_report, DeviceReport};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// The points, as built into this binary.
const POINTS: &str = include_str!("../../data/sweep_points.json");

#[derive(Args, Debug)]
pub struct SweepArgs {
    /// Points file (default: the copy of crates/cudagraph-cli/data/sweep_points.json built into
    /// this binary).
    #[arg(long)]
    pub points: Option<PathBuf>,
    /// Only points whose id contains one of these substrings (comma separated).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Milliseconds of back-to-back replays per sample.
    #[arg(long, default_value_t = 10.0)]
    pub sample_ms: f64,
    /// Samples per measurement (median reported; 3 for points slower than 50 ms).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Element type of the products and convolutions: `f32` (exact f32, TF32 off), or `bf16` /
    /// `f16` — every forward pass and loss inside `autocast` (parameters stay f32 masters;
    /// forward points return their output in the 16-bit type, as PyTorch's autocast does;
    /// training steps keep 16-bit copies updated by the fused optimizer, so no weight is cast
    /// per step), as `bench/pytorch_sweep.py --dtype` runs PyTorch's under `torch.autocast`.
    #[arg(long, default_value = "f32")]
    pub dtype: Dtype,
}

/// One point of data/sweep_points.json.
#[derive(Deserialize, Serialize, Debug, Clone)]
pub struct Point {
    pub id: String,
    #[serde(flatten)]
    pub spec: Spec,
}

/// What a point measures (the file's `kind` field).
#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Spec {
    /// `Linear(k, n)` at batch `m`; train: MSE (mean) against a fixed target, SGD lr 1e-3.
    Linear { m: usize, k: usize, n: usize },
    /// `Conv2d(c, oc, k, stride, pad)` on `n × c × hw × hw`; train as Linear.
    Conv2d {
        n: usize,
        c: usize,
        oc: usize,
        hw: usize,
        k: usize,
        stride: usize,
        pad: usize,
    },
    /// Cross-entropy of `rows × classes` logits (a parameter); train: backward and SGD.
    CrossEntropy { rows: usize, classes: usize },
    /// `depth` Linear layers (ReLU between) `input → width … → classes`; train: cross-entropy,
    /// Adam lr 1e-3.
    Mlp {
        batch: usize,
        input: usize,
        width: usize,
        depth: usize,
        classes: usize,
    },
    /// `depth` 3×3 convolutions (padding 1, ReLU, a 2×2 max-pool after every second) of
    /// `channels` channels, then Linear to `classes`; train: cross-entropy, SGD momentum 0.9
    /// lr 0.01.
    Cnn {
        batch: usize,
        image: usize,
        in_channels: usize,
        channels: usize,
        depth: usize,
        classes: usize,
    },
    /// The optimizer step alone (`sgd`, `momentum` 0.9, `adam`) on `tensors` parameters of
    /// `size` elements with preset gradients.
    Optimizer {
        opt: OptKind,
        tensors: usize,
        size: usize,
    },
}

#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OptKind {
    Sgd,
    Momentum,
    Adam,
}

#[derive(Deserialize)]
struct PointsFile {
    points: Vec<Point>,
}

/// The modes a point runs.
pub fn modes(spec: &Spec) -> &'static [&'static str] {
    match spec {
        Spec::Optimizer { .. } => &["step"],
        _ => &["forward", "train"],
    }
}

/// Parses a points file.
pub fn parse_points(text: &str) -> AnyResult<Vec<Point>> {
    let f: PointsFile = serde_json::from_str(text)?;
    Ok(f.points)
}

/// One measured point and mode.
#[derive(Serialize, Debug, Clone)]
pub struct Row {
    pub id: String,
    pub mode: String,
    pub graph_us: Option<f64>,
    pub engine: String,
    /// Bytes an optimizer step must move (4 B per element per read and write).
    pub bytes: Option<u64>,
    pub error: Option<String>,
}

#[derive(Serialize)]
pub struct Report {
    pub benchmark: &'static str,
    pub side: &'static str,
    /// The element type of products and convolutions (`--dtype`).
    pub dtype: String,
    pub device: DeviceReport,
    pub sample_ms: f64,
    pub repeats: usize,
    pub seconds: f64,
    /// Only bit-reproducible engines (`CUDAGRAPH_DETERMINISTIC`, default true).
    pub deterministic: bool,
    pub rows: Vec<Row>,
}

/// The distinct engines the registry served while a point ran (warm-up, capture and replays),
/// in order of first use, e.g. "cublaslt+cudnn:IMPLICIT_PRECOMP_GEMM".
fn used_engines(log: &[(String, String)]) -> String {
    let mut seen: Vec<&str> = Vec::new();
    for (_, e) in log {
        if !seen.contains(&e.as_str()) {
            seen.push(e);
        }
    }
    if seen.is_empty() {
        "-".into()
    } else {
        seen.join("+")
    }
}

/// The engines a point's products and kernels use, for the table.
pub fn engine_label(spec: &Spec, mode: &str, sms: u32, used: &[(String, String)]) -> String {
    let train = mode == "train";
    match *spec {
        Spec::Linear { .. } | Spec::Conv2d { .. } => used_engines(used),
        Spec::CrossEntropy { rows, classes } => {
            let p = ce_plan(rows, classes, sms)
                .unwrap_or_else(|_| ce_plan_with(rows, classes, sms, CeOptions::DEFAULT));
            if p.chunks > 1 {
                let passes = if train || rows > CE_FUSED_ROWS { 3 } else { 2 };
                return format!("ce rows split in {} chunks, {passes} passes", p.chunks);
            }
            // The registry's plan where it measured one (lane groups or the fixed plan).
            let lanes = used
                .iter()
                .rev()
                .find_map(|(_, e)| e.parse::<CeEngine>().ok());
            match lanes {
                Some(CeEngine::Lanes(l)) => return format!("ce {l} lanes/row, 1 block"),
                Some(CeEngine::Rows) | None => {}
            }
            format!(
                "ce {}{}",
                if p.warp_rows { "warp/row" } else { "block/row" },
                if p.two_pass {
                    ", 2 passes"
                } else {
                    ", 1 block"
                }
            )
        }
        Spec::Mlp { .. } => {
            let f = used_engines(used);
            if train {
                format!("{f} + fused adam")
            } else {
                f
            }
        }
        Spec::Cnn { .. } => {
            let f = used_engines(used);
            if train {
                format!("{f} + fused sgd")
            } else {
                f
            }
        }
        Spec::Optimizer { opt, tensors, .. } => {
            let per = if tensors <= CAP_S { CAP_S } else { CAP_L };
            format!(
                "fused {:?}, {} launch{}",
                opt,
                tensors.div_ceil(per),
                if tensors.div_ceil(per) == 1 { "" } else { "es" }
            )
            .to_lowercase()
        }
    }
}

/// Bytes an optimizer step moves: reads and writes of 4 B per element (SGD: w, g read, w
/// written; momentum adds the buffer read and written; Adam: w, g, m, v read, w, m, v written).
pub fn optimizer_bytes(opt: OptKind, elements: u64) -> u64 {
    let words = match opt {
        OptKind::Sgd => 3,
        OptKind::Momentum => 5,
        OptKind::Adam => 7,
    };
    4 * words * elements
}

/// Replays needed to fill `sample_ms` at `est_us` per replay (at least one, at most 2000).
pub fn iters_for(sample_ms: f64, est_us: f64) -> usize {
    if est_us.is_nan() || est_us <= 0.0 {
        return 1;
    }
    ((sample_ms * 1000.0 / est_us).round() as usize).clamp(1, 2000)
}

/// Median µs per replay of `g`.
fn time_graph(s: &Stream, g: &Graph, a: &SweepArgs) -> AnyResult<f64> {
    g.replay(s)?;
    g.replay(s)?;
    s.synchronize()?;
    // The fastest of three single replays sets the replays per sample, so that one slow
    // estimate (a host hiccup) cannot shrink every sample to a few replays plus a
    // synchronisation (bench/pytorch_sweep.py does the same).
    let mut est = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        g.replay(s)?;
        s.synchronize()?;
        est = est.min(t.elapsed().as_secs_f64() * 1e6);
    }
    let repeats = if est > 50_000.0 { 3 } else { a.repeats.max(1) };
    report::time_us(s, 0, iters_for(a.sample_ms, est), repeats, || {
        g.replay(s)
            .map_err(Into::<Box<dyn std::error::Error>>::into)
    })
}

/// Warms `step` up on a side stream (two calls), captures it and times its replays.
fn measure(
    dev: &Device,
    s: &mut Stream,
    a: &SweepArgs,
    mut step: impl FnMut(&dyn Queue) -> cudagraph_nn::Result<()>,
) -> AnyResult<f64> {
    let side = dev.new_stream()?;
    cudagraph::warmup(s, &side, 2, |q| step(q).map_err(Into::into))?;
    s.synchronize()?;
    let (g, ()) = Graph::capture(s, CaptureOptions::new().upload(true), |cs| Ok(step(cs)?))?;
    time_graph(s, &g, a)
}

fn tensor(s: &Stream, rng: &mut HostRng, shape: &[usize]) -> cudagraph_nn::Result<Tensor> {
    let n = shape.iter().product();
    Tensor::from_host(s, &rng.vec_normal(n), shape)
}

fn targets(
    s: &Stream,
    rows: usize,
    classes: usize,
) -> cudagraph_nn::Result<Arc<cudagraph::DeviceBuffer<i32>>> {
    let t: Vec<i32> = (0..rows).map(|r| ((r * 7919) % classes) as i32).collect();
    Targets::from_host(s, &t, classes)
}

fn mlp(
    s: &Stream,
    rng: &mut HostRng,
    input: usize,
    width: usize,
    depth: usize,
    classes: usize,
) -> cudagraph_nn::Result<Sequential> {
    let mut layers = Vec::new();
    let mut fan_in = input;
    for _ in 0..depth.saturating_sub(1) {
        layers.push(Layer::Linear(Linear::new(s, fan_in, width, rng)?));
        layers.push(Layer::ReLU);
        fan_in = width;
    }
    layers.push(Layer::Linear(Linear::new(s, fan_in, classes, rng)?));
    Ok(Sequential::new(layers))
}

fn cnn(
    s: &Stream,
    rng: &mut HostRng,
    (image, in_channels, channels, depth, classes): (usize, usize, usize, usize, usize),
) -> cudagraph_nn::Result<Sequential> {
    let mut layers = Vec::new();
    let (mut c, mut hw) = (in_channels, image);
    for i in 0..depth {
        layers.push(Layer::Conv2d(Conv2d::new(s, c, channels, 3, 1, 1, rng)?));
        layers.push(Layer::ReLU);
        c = channels;
        if i % 2 == 1 {
            layers.push(Layer::MaxPool2d {
                kernel: 2,
                stride: 2,
            });
            hw /= 2;
        }
    }
    layers.push(Layer::Flatten);
    layers.push(Layer::Linear(Linear::new(s, c * hw * hw, classes, rng)?));
    Ok(Sequential::new(layers))
}

/// The optimizer options of a training step in `--dtype`: bf16/f16 keep 16-bit copies of the
/// parameters, updated by the fused step, which the forward pass uses instead of casting the
/// weights (PyTorch's autocast casts them again every step).
fn optim_options(a: &SweepArgs) -> OptimOptions {
    OptimOptions {
        copies: (a.dtype != Dtype::F32).then_some(a.dtype),
    }
}

/// A forward point's model under `--dtype`: 16-bit copies of the weights made once, and the
/// output kept in the compute type, as `torch.autocast` returns it (no widening cast over the
/// output, which PyTorch's side does not pay either).
fn serving<M: NnModule>(
    s: &Stream,
    model: M,
    a: &SweepArgs,
) -> cudagraph_nn::Result<AutocastModule<M>> {
    Ok(AutocastModule::new(s, model, a.dtype)?.keep_output(true))
}

/// `f` inside an autocast scope of `--dtype` that uses the optimizer's 16-bit `copies`.
fn mixed_with<R>(
    a: &SweepArgs,
    copies: &[(Parameter, TypedBuffer)],
    f: impl FnOnce() -> cudagraph_nn::Result<R>,
) -> cudagraph_nn::Result<R> {
    let options = AutocastOptions {
        dtype: a.dtype,
        copies: copies.to_vec(),
    };
    autocast_with(options, f)?
}

/// Measures one point in one mode: µs per graph replay.
fn run_point(
    dev: &Device,
    s: &mut Stream,
    a: &SweepArgs,
    spec: &Spec,
    mode: &str,
) -> AnyResult<f64> {
    let mut rng = HostRng::new(7);
    let train = mode == "train";
    let sgd = |s: &Stream, params, lr| {
        Sgd::with_options(
            s,
            params,
            SgdConfig {
                lr,
                ..SgdConfig::default()
            },
            optim_options(a),
        )
    };
    match *spec {
        Spec::Linear { m, k, n } => {
            let model = Linear::new(s, k, n, &mut rng)?;
            let x = tensor(s, &mut rng, &[m, k])?;
            let y = tensor(s, &mut rng, &[m, n])?;
            if !train {
                let m = serving(s, model, a)?;
                return measure(dev, s, a, |q| no_grad(|| m.forward(q, &x)).map(drop));
            }
            let mut opt = sgd(s, model.parameters(), 1e-3)?;
            let copies = opt.copies().unwrap_or_default();
            measure(dev, s, a, |q| {
                opt.zero_grad(q, true)?;
                mixed_with(a, &copies, || {
                    mse_loss(q, &model.forward(q, &x)?, &y, Reduction::Mean)
                })?
                .backward(q)?;
                opt.step(q)
            })
        }
        Spec::Conv2d {
            n,
            c,
            oc,
            hw,
            k,
            stride,
            pad,
        } => {
            let model = Conv2d::new(s, c, oc, k, stride, pad, &mut rng)?;
            let x = tensor(s, &mut rng, &[n, c, hw, hw])?;
            let oh = (hw + 2 * pad - k) / stride + 1;
            let y = tensor(s, &mut rng, &[n, oc, oh, oh])?;
            if !train {
                let m = serving(s, model, a)?;
                return measure(dev, s, a, |q| no_grad(|| m.forward(q, &x)).map(drop));
            }
            let mut opt = sgd(s, model.parameters(), 1e-3)?;
            let copies = opt.copies().unwrap_or_default();
            measure(dev, s, a, |q| {
                opt.zero_grad(q, true)?;
                mixed_with(a, &copies, || {
                    mse_loss(q, &model.forward(q, &x)?, &y, Reduction::Mean)
                })?
                .backward(q)?;
                opt.step(q)
            })
        }
        Spec::CrossEntropy { rows, classes } => {
            let z = Parameter::from_host(
                s,
                "logits",
                &rng.vec_normal(rows * classes),
                &[rows, classes],
            )?;
            let t = targets(s, rows, classes)?;
            if !train {
                return measure(dev, s, a, |q| {
                    no_grad(|| cross_entropy(q, &z.tensor(), &t)).map(drop)
                });
            }
            let mut opt = sgd(s, vec![z.clone()], 1e-3)?;
            measure(dev, s, a, |q| {
                opt.zero_grad(q, true)?;
                cross_entropy(q, &z.tensor(), &t)?.backward(q)?;
                opt.step(q)
            })
        }
        Spec::Mlp {
            batch,
            input,
            width,
            depth,
            classes,
        } => {
            let model = mlp(s, &mut rng, input, width, depth, classes)?;
            let x = tensor(s, &mut rng, &[batch, input])?;
            let t = targets(s, batch, classes)?;
            if !train {
                let m = serving(s, model, a)?;
                return measure(dev, s, a, |q| no_grad(|| m.forward(q, &x)).map(drop));
            }
            let mut opt = Adam::with_options(
                s,
                model.parameters(),
                AdamConfig::default(),
                optim_options(a),
            )?;
            let copies = opt.copies().unwrap_or_default();
            measure(dev, s, a, |q| {
                opt.zero_grad(q, true)?;
                mixed_with(a, &copies, || cross_entropy(q, &model.forward(q, &x)?, &t))?
                    .backward(q)?;
                opt.step(q)
            })
        }
        Spec::Cnn {
            batch,
            image,
            in_channels,
            channels,
            depth,
            classes,
        } => {
            let model = cnn(s, &mut rng, (image, in_channels, channels, depth, classes))?;
            let x = tensor(s, &mut rng, &[batch, in_channels, image, image])?;
            let t = targets(s, batch, classes)?;
            if !train {
                let m = serving(s, model, a)?;
                return measure(dev, s, a, |q| no_grad(|| m.forward(q, &x)).map(drop));
            }
            let cfg = SgdConfig {
                lr: 0.01,
                momentum: 0.9,
                weight_decay: 0.0,
            };
            let mut opt = Sgd::with_options(s, model.parameters(), cfg, optim_options(a))?;
            let copies = opt.copies().unwrap_or_default();
            measure(dev, s, a, |q| {
                opt.zero_grad(q, true)?;
                mixed_with(a, &copies, || cross_entropy(q, &model.forward(q, &x)?, &t))?
                    .backward(q)?;
                opt.step(q)
            })
        }
        Spec::Optimizer { opt, tensors, size } => {
            let params = (0..tensors)
                .map(|i| Parameter::from_host(s, &format!("p{i}"), &rng.vec_normal(size), &[size]))
                .collect::<cudagraph_nn::Result<Vec<_>>>()?;
            // Preset gradients (2·w, from one eager backward); the graph is the step alone.
            let zeros = Tensor::zeros(&*s, &[size])?;
            for p in &params {
                mse_loss(&*s, &p.tensor(), &zeros, Reduction::Sum)?.backward(&*s)?;
            }
            let mut o: Box<dyn Optimizer> = match opt {
                OptKind::Sgd => Box::new(Sgd::new(s, params, 1e-3, 0.0, 0.0)?),
                OptKind::Momentum => Box::new(Sgd::with_config(
                    s,
                    params,
                    SgdConfig {
                        lr: 1e-3,
                        momentum: 0.9,
                        weight_decay: 0.0,
                    },
                )?),
                OptKind::Adam => Box::new(Adam::with_config(s, params, AdamConfig::default())?),
            };
            measure(dev, s, a, |q| o.step(q))
        }
    }
}

pub fn run(ordinal: usize, a: &SweepArgs) -> AnyResult<()> {
    let text = match &a.points {
        Some(p) => std::fs::read_to_string(p)?,
        None => POINTS.to_string(),
    };
    let points: Vec<Point> = parse_points(&text)?
        .into_iter()
        .filter(|p| a.only.is_empty() || a.only.iter().any(|o| p.id.contains(o.as_str())))
        .collect();
    let dev = Device::open(ordinal)?;
    let sms = dev.info().multiprocessors;
    let engines = Engines::get(&dev)?;
    engines.start_usage_log();
    let started = Instant::now();
    // Warm-up: the first point of a process measured slow (clocks and caches still cold:
    // conv-n1-c1-o1-8px-k1 forward 7.6 µs as a process's first point, 3.5 µs inside a
    // longer run), so it is run once and discarded first (bench/pytorch_sweep.py does the
    // same).
    if let Some(p) = points.first() {
        let mut s = dev.new_stream()?;
        let _ = run_point(&dev, &mut s, a, &p.spec, modes(&p.spec)[0]);
        let _ = s.synchronize();
        drop(s);
        dev.empty_cache()?;
    }
    let mut rows = Vec::new();
    for p in &points {
        for &mode in modes(&p.spec) {
            let mut s = dev.new_stream()?;
            engines.take_usage_log();
            let r = run_point(&dev, &mut s, a, &p.spec, mode);
            let _ = s.synchronize();
            let used = engines.take_usage_log();
            let bytes = match p.spec {
                Spec::Optimizer { opt, tensors, size } => {
                    Some(optimizer_bytes(opt, (tensors * size) as u64))
                }
                _ => None,
            };
            let row = Row {
                id: p.id.clone(),
                mode: mode.to_string(),
                graph_us: r.as_ref().ok().copied(),
                engine: engine_label(&p.spec, mode, sms, &used),
                bytes,
                error: r.err().map(|e| e.to_string()),
            };
            if !a.json {
                match (row.graph_us, &row.error) {
                    (Some(us), _) => outln!(
                        "{:<44} {:<8} {:>12.2} us  {}",
                        row.id,
                        row.mode,
                        us,
                        row.engine
                    ),
                    (None, Some(e)) => outln!("{:<44} {:<8} failed: {e}", row.id, row.mode),
                    _ => {}
                }
            } else {
                eprintln!("{} {}: {:?}", row.id, row.mode, row.graph_us);
            }
            rows.push(row);
            drop(s);
            dev.empty_cache()?;
        }
    }
    let report = Report {
        benchmark: "sweep",
        side: "ours",
        dtype: a.dtype.to_string(),
        device: device_report(&dev)?,
        sample_ms: a.sample_ms,
        repeats: a.repeats,
        seconds: started.elapsed().as_secs_f64(),
        deterministic: cudagraph_nn::engine::Policy::from_env()?.deterministic,
        rows,
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        outln!(
            "{} points in {:.1} s on {}",
            report.rows.len(),
            report.seconds,
            report.device.name
        );
        for r in report.rows.iter().filter(|r| r.bytes.is_some()) {
            if let (Some(us), Some(b)) = (r.graph_us, r.bytes) {
                outln!("  {}: {:.0} GB/s", r.id, b as f64 / us / 1e3);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_points_parse_and_cover_the_grid() {
        let p = parse_points(POINTS).unwrap();
        let count = |f: &dyn Fn(&Spec) -> bool| p.iter().filter(|x| f(&x.spec)).count();
        assert_eq!(count(&|s| matches!(s, Spec::Linear { .. })), 47);
        assert!(
            count(&|s| matches!(
                s,
                Spec::Linear {
                    m: 4096,
                    k: 4096,
                    n: 4096
                }
            )) == 1
        );
        let convs = count(&|s| matches!(s, Spec::Conv2d { .. }));
        assert!((30..=60).contains(&convs), "{convs} conv points");
        assert!(count(&|s| matches!(s, Spec::CrossEntropy { classes: 50000, .. })) > 0);
        assert!(count(&|s| matches!(s, Spec::CrossEntropy { classes: 10, .. })) > 0);
        assert!(count(&|s| matches!(s, Spec::Mlp { .. })) >= 3);
        assert!(count(&|s| matches!(s, Spec::Cnn { .. })) >= 3);
        let opt_elems: Vec<usize> = p
            .iter()
            .filter_map(|x| match x.spec {
                Spec::Optimizer { tensors, size, .. } => Some(tensors * size),
                _ => None,
            })
            .collect();
        assert!(opt_elems.contains(&(8 << 20)), "Adam on 8 x 1024^2");
        assert!(opt_elems.iter().any(|&e| e >= 100_000_000));
        assert!(opt_elems.iter().any(|&e| e <= 100_000));
        let mut ids: Vec<&str> = p.iter().map(|x| x.id.as_str()).collect();
        ids.sort_unstable();
        let n = ids.len();
        ids.dedup();
        assert_eq!(ids.len(), n, "point ids are unique");
        // Conv grid: kernels 1/3/5/7, strides 1/2, padding 0/1, images 8..224, batch 1..128.
        for (field, want) in [
            ("k", vec![1, 3, 5, 7]),
            ("stride", vec![1, 2]),
            ("pad", vec![0, 1]),
        ] {
            for w in want {
                assert!(
                    p.iter().any(|x| match x.spec {
                        Spec::Conv2d { k, stride, pad, .. } =>
                            w == match field {
                                "k" => k,
                                "stride" => stride,
                                _ => pad,
                            },
                        _ => false,
                    }),
                    "{field} = {w} missing"
                );
            }
        }
    }

    #[test]
    fn every_conv_and_cnn_point_has_an_output() {
        for p in parse_points(POINTS).unwrap() {
            match p.spec {
                Spec::Conv2d {
                    hw, k, pad, stride, ..
                } => {
                    assert!(hw + 2 * pad >= k && stride > 0, "{}", p.id)
                }
                Spec::Cnn { image, depth, .. } => {
                    assert!(image >> (depth / 2) >= 1, "{}", p.id)
                }
                _ => {}
            }
        }
    }

    #[test]
    fn optimizer_bytes_count_reads_and_writes() {
        // Adam on 8 × 1024²: 4 reads + 3 writes of 4 B per element.
        assert_eq!(optimizer_bytes(OptKind::Adam, 8 << 20), 28 * (8 << 20));
        assert_eq!(optimizer_bytes(OptKind::Sgd, 10), 120);
        assert_eq!(optimizer_bytes(OptKind::Momentum, 10), 200);
    }

    #[test]
    fn samples_hold_enough_replays() {
        assert_eq!(iters_for(10.0, 10.0), 1000);
        assert_eq!(iters_for(10.0, 1.0), 2000);
        assert_eq!(iters_for(10.0, 100_000.0), 1);
        assert_eq!(iters_for(10.0, 0.0), 1);
        assert_eq!(iters_for(10.0, f64::NAN), 1);
    }

    #[test]
    fn engine_labels_name_the_kernels() {
        assert!(engine_label(
            &Spec::CrossEntropy {
                rows: 16,
                classes: 50000
            },
            "forward",
            132,
            &[]
        )
        .contains("split in 17 chunks"));
        assert!(engine_label(
            &Spec::CrossEntropy {
                rows: 256,
                classes: 50000
            },
            "forward",
            132,
            &[]
        )
        .contains("block/row"));
        let o = Spec::Optimizer {
            opt: OptKind::Adam,
            tensors: 600,
            size: 1,
        };
        assert!(engine_label(&o, "step", 132, &[]).contains("2 launches"));
        let o = Spec::Optimizer {
            opt: OptKind::Adam,
            tensors: 8,
            size: 1,
        };
        assert!(engine_label(&o, "step", 132, &[]).contains("1 launch"));
        let used = [
            ("k1".to_string(), "cublaslt".to_string()),
            ("k2".to_string(), "cudnn:GEMM".to_string()),
            ("k3".to_string(), "cublaslt".to_string()),
        ];
        let lin = Spec::Linear {
            m: 8,
            k: 256,
            n: 256,
        };
        assert_eq!(
            engine_label(&lin, "forward", 132, &used),
            "cublaslt+cudnn:GEMM"
        );
        assert_eq!(engine_label(&lin, "forward", 132, &[]), "-");
    }
}
