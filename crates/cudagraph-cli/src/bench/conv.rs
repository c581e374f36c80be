//! `cudagraph bench conv`: convolutions at real image sizes (ResNet-50's layers at batch 32 on
//! 224×224 images, and the small CNNs of the workloads) in f32, bf16 or f16 (`--dtype`), each
//! direction — forward, backward-data, backward-filter — run once eagerly (the engine registry
//! measures its candidates for the key) and then timed as 20 runs captured in one graph and
//! replayed, so launch overhead is out of the numbers. Prints µs per run, TFLOP/s
//! (2·multiply-adds per µs) and the engine the registry chose: for bf16/f16 with the layout it
//! computes in (`nhwc:cudnnv8:3` under `--layout nchw` is cuDNN's NHWC engine with the
//! transposes included).

use std::time::Instant;

use clap::Args;
use cudagraph::memory::{bf16, f16};
use cudagraph::{CaptureOptions, Device, DeviceBuffer, Graph, Queue, Stream};
use cudagraph_nn::dtype::{Dtype, Float};
use cudagraph_nn::engine::conv::{
    conv2d_backward_data, conv2d_backward_filter, conv2d_forward, ConvDir, ConvGeom,
};
use cudagraph_nn::engine::conv_lowp::{
    conv2d_lowp_backward_data, conv2d_lowp_backward_filter, conv2d_lowp_backward_filter_f32,
    conv2d_lowp_forward, ConvShape, Layout,
};
use cudagraph_nn::engine::Engines;
use cudagraph_nn::{HostRng, Nn};
use serde::Serialize;

use crate::report::{device_report, median, DeviceReport};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Runs captured per graph.
const RUNS_PER_GRAPH: usize = 20;

fn parse_dtype(s: &str) -> Result<Dtype, String> {
    s.parse::<Dtype>().map_err(|e| e.to_string())
}

fn parse_layout(s: &str) -> Result<Layout, String> {
    s.parse::<Layout>().map_err(|e| e.to_string())
}

#[derive(Args, Debug)]
pub struct ConvArgs {
    /// Element type: f32 (fp32 engines, TF32 as `CUDAGRAPH_TF32_CONV` says), bf16 or f16
    /// (tensor cores, fp32 accumulation).
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: Dtype,
    /// Layout of the tensors handed over (bf16/f16 only; f32 is NCHW): nchw or nhwc.
    #[arg(long, default_value = "nchw", value_parser = parse_layout)]
    pub layout: Layout,
    /// The forward with a bias and ReLU (bf16/f16: fused into cuDNN where it can).
    #[arg(long)]
    pub bias_relu: bool,
    /// bf16/f16: the weight gradient written in f32.
    #[arg(long)]
    pub dw_f32: bool,
    /// A short list (four shapes).
    #[arg(long)]
    pub quick: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
pub struct ConvRow {
    pub shape: String,
    pub direction: &'static str,
    pub n: usize,
    pub c: usize,
    pub hw: usize,
    pub oc: usize,
    pub k: usize,
    pub stride: usize,
    pub pad: usize,
    /// Microseconds per run inside a graph (median of 5 samples).
    pub us: f64,
    /// 2 · multiply-adds / time.
    pub tflops: f64,
    /// The registry's choice.
    pub engine: String,
}

/// (geometry, what): ResNet-50 at batch 32 (224×224 input), then the workloads' small CNNs.
fn shapes(quick: bool) -> Vec<(ConvGeom, &'static str)> {
    let g = ConvGeom::square;
    let all = vec![
        (g(32, 3, 224, 64, 7, 2, 3), "resnet50 stem 7x7/2"),
        (g(32, 64, 56, 64, 3, 1, 1), "resnet50 l1 3x3 64"),
        (g(32, 128, 28, 128, 3, 1, 1), "resnet50 l2 3x3 128"),
        (g(32, 256, 14, 256, 3, 1, 1), "resnet50 l3 3x3 256"),
        (g(32, 64, 56, 64, 1, 1, 0), "resnet50 l1 1x1 64>64"),
        (g(32, 64, 56, 256, 1, 1, 0), "resnet50 l1 1x1 64>256"),
        (g(32, 256, 56, 512, 1, 2, 0), "resnet50 l2 proj 1x1/2"),
        (g(32, 128, 56, 128, 3, 2, 1), "resnet50 l2 3x3/2 128"),
        (g(32, 1024, 14, 256, 1, 1, 0), "resnet50 l3 1x1 1024>256"),
        (g(32, 512, 7, 512, 3, 1, 1), "resnet50 l4 3x3 512"),
        (g(32, 512, 7, 2048, 1, 1, 0), "resnet50 l4 1x1 512>2048"),
        (g(32, 1024, 14, 2048, 1, 2, 0), "resnet50 l4 proj 1x1/2"),
        (g(8, 3, 32, 16, 3, 1, 1), "small CNN conv1"),
        (g(32, 16, 32, 32, 3, 1, 1), "small CNN conv2"),
    ];
    if quick {
        all.into_iter().take(4).collect()
    } else {
        all
    }
}

/// A buffer of `n` normal values in `T`.
fn normal<T: Float>(s: &Stream, rng: &mut HostRng, n: usize) -> AnyResult<DeviceBuffer<T>> {
    let v: Vec<T> = rng.vec_normal(n).into_iter().map(T::from_f32).collect();
    Ok(s.alloc_from_host(&v)?)
}

/// Times `run` (which returns the engine's name) as [`RUNS_PER_GRAPH`] runs in one graph:
/// µs per run, median of 5 samples of 10 replays, after one eager run that lets the registry
/// measure.
fn time(
    s: &mut Stream,
    run: &dyn Fn(&dyn Queue) -> cudagraph_nn::Result<String>,
) -> AnyResult<(f64, String)> {
    let engine = run(s)?;
    s.synchronize()?;
    let (g, ()) = Graph::capture(s, CaptureOptions::new().upload(true), |cs| {
        for _ in 0..RUNS_PER_GRAPH {
            run(cs)?;
        }
        Ok(())
    })?;
    g.replay(s)?;
    let mut samples = Vec::new();
    for _ in 0..5 {
        s.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..10 {
            g.replay(s)?;
        }
        s.synchronize()?;
        samples.push(t0.elapsed().as_secs_f64() * 1e6 / (10 * RUNS_PER_GRAPH) as f64);
    }
    Ok((median(samples), engine))
}

/// The three directions of `g` in f32 (NCHW): (direction, µs, engine).
fn f32_rows(
    s: &mut Stream,
    nn: &Nn,
    g: &ConvGeom,
    bias_relu: bool,
    rng: &mut HostRng,
) -> AnyResult<Vec<(ConvDir, f64, String)>> {
    let x = normal::<f32>(s, rng, g.input_len()?)?;
    let w = normal::<f32>(s, rng, g.weight_len()?)?;
    let b = normal::<f32>(s, rng, g.oc)?;
    let dy = normal::<f32>(s, rng, g.output_len()?)?;
    let (y, dx, dw) = (
        normal::<f32>(s, rng, g.output_len()?)?,
        normal::<f32>(s, rng, g.input_len()?)?,
        normal::<f32>(s, rng, g.weight_len()?)?,
    );
    let bias = bias_relu.then_some(&b);
    let mut rows = Vec::new();
    let (us, e) = time(s, &|q| {
        Ok(conv2d_forward(q, nn, g, &x, &w, bias, &y)?.to_string())
    })?;
    rows.push((ConvDir::Forward, us, e));
    let (us, e) = time(s, &|q| {
        Ok(conv2d_backward_data(q, nn, g, &dy, &w, &dx)?.to_string())
    })?;
    rows.push((ConvDir::BackwardData, us, e));
    let (us, e) = time(s, &|q| {
        Ok(conv2d_backward_filter(q, nn, g, &dy, &x, &dw)?.to_string())
    })?;
    rows.push((ConvDir::BackwardFilter, us, e));
    Ok(rows)
}

/// The three directions of `g` in bf16 or f16 (`T`) in `layout`: (direction, µs, engine).
fn lowp_rows<T: Float>(
    s: &mut Stream,
    nn: &Nn,
    g: &ConvGeom,
    a: &ConvArgs,
    rng: &mut HostRng,
) -> AnyResult<Vec<(ConvDir, f64, String)>> {
    let shape = ConvShape::from(*g);
    let layout = a.layout;
    let x = normal::<T>(s, rng, g.input_len()?)?;
    let w = normal::<T>(s, rng, g.weight_len()?)?;
    let b = normal::<T>(s, rng, g.oc)?;
    let dy = normal::<T>(s, rng, g.output_len()?)?;
    let (y, dx, dw) = (
        normal::<T>(s, rng, g.output_len()?)?,
        normal::<T>(s, rng, g.input_len()?)?,
        normal::<T>(s, rng, g.weight_len()?)?,
    );
    let dw32 = normal::<f32>(s, rng, g.weight_len()?)?;
    let bias = a.bias_relu.then_some(&b);
    let relu = a.bias_relu;
    let mut rows = Vec::new();
    let (us, e) = time(s, &|q| {
        Ok(conv2d_lowp_forward(q, nn, &shape, layout, &x, &w, bias, relu, &y)?.to_string())
    })?;
    rows.push((ConvDir::Forward, us, e));
    let (us, e) = time(s, &|q| {
        Ok(conv2d_lowp_backward_data(q, nn, &shape, layout, &dy, &w, &dx)?.to_string())
    })?;
    rows.push((ConvDir::BackwardData, us, e));
    let (us, e) = if a.dw_f32 {
        time(s, &|q| {
            Ok(conv2d_lowp_backward_filter_f32(q, nn, &shape, layout, &dy, &x, &dw32)?.to_string())
        })?
    } else {
        time(s, &|q| {
            Ok(conv2d_lowp_backward_filter(q, nn, &shape, layout, &dy, &x, &dw)?.to_string())
        })?
    };
    rows.push((ConvDir::BackwardFilter, us, e));
    Ok(rows)
}

pub fn measure(dev: &Device, a: &ConvArgs) -> AnyResult<Vec<ConvRow>> {
    let nn = Nn::get(dev)?;
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(28);
    let mut rows = Vec::new();
    for (g, what) in shapes(a.quick) {
        let timed = match a.dtype {
            Dtype::F32 => f32_rows(&mut s, &nn, &g, a.bias_relu, &mut rng)?,
            Dtype::Bf16 => lowp_rows::<bf16>(&mut s, &nn, &g, a, &mut rng)?,
            Dtype::F16 => lowp_rows::<f16>(&mut s, &nn, &g, a, &mut rng)?,
        };
        let macs = g.output_len()? as f64 * (g.c * g.kh * g.kw) as f64;
        for (dir, us, engine) in timed {
            rows.push(ConvRow {
                shape: what.to_string(),
                direction: dir.name(),
                n: g.n,
                c: g.c,
                hw: g.h,
                oc: g.oc,
                k: g.kh,
                stride: g.stride,
                pad: g.pad,
                us,
                tflops: 2.0 * macs / us / 1e6,
                engine,
            });
        }
    }
    Ok(rows)
}

pub fn run(ordinal: usize, a: &ConvArgs) -> AnyResult<()> {
    if a.dtype == Dtype::F32 && (a.layout != Layout::Nchw || a.dw_f32) {
        return Err("--layout nhwc and --dw-f32 apply to --dtype bf16 or f16".into());
    }
    let dev = Device::open(ordinal)?;
    let rows = measure(&dev, a)?;
    let eng = Engines::get(&dev)?;
    #[derive(Serialize)]
    struct Out<'a> {
        benchmark: &'static str,
        device: DeviceReport,
        libraries: &'a str,
        dtype: &'static str,
        layout: &'static str,
        bias_relu: bool,
        dw_f32: bool,
        tf32_conv: bool,
        rows: Vec<ConvRow>,
    }
    let out = Out {
        benchmark: "conv",
        device: device_report(&dev)?,
        libraries: eng.libraries(),
        dtype: a.dtype.name(),
        layout: a.layout.name(),
        bias_relu: a.bias_relu,
        dw_f32: a.dw_f32,
        tf32_conv: eng.policy().tf32_conv,
        rows,
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let what = match a.dtype {
        Dtype::F32 => format!("f32 convolutions (NCHW; {})", eng.policy().tf32_summary()),
        d => format!(
            "{d} convolutions ({} tensors, f32 accumulation{})",
            a.layout,
            if a.dw_f32 { ", dw in f32" } else { "" }
        ),
    };
    outln!(
        "{what} on {} ({}), µs per run inside a graph{}",
        out.device.name,
        out.libraries,
        if a.bias_relu {
            "; forward with bias + ReLU"
        } else {
            ""
        }
    );
    outln!(
        "{:<26} {:<16} {:>4} {:>5} {:>4} {:>5} {:>6} {:>10} {:>8}  engine",
        "shape",
        "direction",
        "n",
        "c",
        "hw",
        "oc",
        "k/s/p",
        "µs",
        "TFLOP/s"
    );
    for r in &out.rows {
        outln!(
            "{:<26} {:<16} {:>4} {:>5} {:>4} {:>5} {:>6} {:>10.2} {:>8.2}  {}",
            r.shape,
            r.direction,
            r.n,
            r.c,
            r.hw,
            r.oc,
            format!("{}/{}/{}", r.k, r.stride, r.pad),
            r.us,
            r.tflops,
            r.engine
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_has_an_output_and_the_quick_list_is_a_prefix() {
        let all = shapes(false);
        for (g, what) in &all {
            assert!(g.output_len().unwrap() > 0, "{what}");
        }
        let quick = shapes(true);
        assert_eq!(quick.len(), 4);
        assert!(quick.iter().zip(&all).all(|(a, b)| a.0 == b.0));
        // ResNet-50's stem: 224 → 112.
        assert_eq!(all[0].0.out_hw().unwrap(), (112, 112));
        assert!(all.iter().filter(|(g, _)| g.n == 32).count() >= 10);
    }

    #[test]
    fn flags_parse() {
        assert_eq!(parse_dtype("bf16").unwrap(), Dtype::Bf16);
        assert_eq!(parse_layout("NHWC").unwrap(), Layout::Nhwc);
        assert!(parse_dtype("f64").is_err());
        assert!(parse_layout("hwcn").is_err());
    }
}
