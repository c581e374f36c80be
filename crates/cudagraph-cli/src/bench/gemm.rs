//! `cudagraph bench gemm`: the matrix products of the workloads, cuBLAS vs our tiled split-K
//! kernel, each timed as 20 products captured in one graph and replayed (so launch overhead
//! is out of the numbers). The data behind `Engine::Auto`'s choice.

use std::time::Instant;

use clap::Args;
use cudagraph::{CaptureOptions, Device, Graph};
use cudagraph_nn::blas::Trans;
use cudagraph_nn::gemm::{gemm, split_k, Engine};
use cudagraph_nn::{Nn, Rng};
use serde::Serialize;

use crate::report::{device_report, median, DeviceReport};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Args, Debug)]
pub struct GemmArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
pub struct GemmRow {
    pub shape: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub splits: usize,
    pub cublas_us: f64,
    pub tiled_us: f64,
    pub warpk_us: f64,
}

const SHAPES: &[(usize, usize, usize, bool, bool, &str)] = &[
    (1, 512, 1024, false, true, "mlp L1 bs1"),
    (8, 512, 1024, false, true, "mlp L1 bs8"),
    (32, 512, 1024, false, true, "mlp L1 bs32"),
    (256, 512, 1024, false, true, "mlp L1 bs256"),
    (32, 256, 512, false, true, "mlp L2 bs32"),
    (32, 10, 256, false, true, "mlp L3 bs32"),
    (32, 500, 1000, false, true, "linear 1000x500 bs32"),
    (64, 1024, 1024, false, true, "train fwd"),
    (1024, 1024, 64, true, false, "train dW"),
    (64, 1024, 1024, false, false, "train dX"),
];

pub fn measure(dev: &Device) -> AnyResult<Vec<GemmRow>> {
    let nn = Nn::get(dev)?;
    let mut s = dev.new_stream()?;
    let mut rng = Rng::new(5);
    let mut rows = Vec::new();
    for &(m, n, k, ta, tb, name) in SHAPES {
        let a = s.alloc_from_host(&rng.vec_normal(m * k))?;
        let b = s.alloc_from_host(&rng.vec_normal(k * n))?;
        let c = s.alloc_from_host(&vec![0.0f32; m * n])?;
        let t = |x: bool| if x { Trans::T } else { Trans::N };
        let mut us = [0.0; 3];
        for (slot, engine) in [Engine::Cublas, Engine::Tiled, Engine::WarpK]
            .into_iter()
            .enumerate()
        {
            let (g, ()) = Graph::capture(&mut s, CaptureOptions::new().upload(true), |cs| {
                for _ in 0..20 {
                    gemm(
                        cs,
                        &nn,
                        engine,
                        (t(ta), t(tb)),
                        (m, n, k),
                        1.0,
                        &a,
                        &b,
                        0.0,
                        &c,
                        None,
                        false,
                    )?;
                }
                Ok(())
            })?;
            g.replay(&s)?;
            let mut samples = Vec::new();
            for _ in 0..5 {
                s.synchronize()?;
                let t0 = Instant::now();
                for _ in 0..50 {
                    g.replay(&s)?;
                }
                s.synchronize()?;
                samples.push(t0.elapsed().as_secs_f64() * 1e6 / 1000.0);
            }
            us[slot] = median(samples);
        }
        rows.push(GemmRow {
            shape: name.into(),
            m,
            n,
            k,
            splits: split_k(m, n, k),
            cublas_us: us[0],
            tiled_us: us[1],
            warpk_us: us[2],
        });
    }
    Ok(rows)
}

pub fn run(ordinal: usize, a: &GemmArgs) -> AnyResult<()> {
    let dev = Device::open(ordinal)?;
    let rows = measure(&dev)?;
    #[derive(Serialize)]
    struct Out {
        benchmark: &'static str,
        device: DeviceReport,
        rows: Vec<GemmRow>,
    }
    let out = Out {
        benchmark: "gemm",
        device: device_report(&dev)?,
        rows,
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    outln!(
        "fp32 products on {}, µs per product inside a graph",
        out.device.name
    );
    outln!(
        "{:<22} {:>5} {:>5} {:>5} {:>6} {:>10} {:>10} {:>10} {:>8}",
        "shape",
        "m",
        "n",
        "k",
        "splits",
        "cuBLAS",
        "tiled",
        "warp-K",
        "best/cuBLAS"
    );
    for r in &out.rows {
        outln!(
            "{:<22} {:>5} {:>5} {:>5} {:>6} {:>10.2} {:>10.2} {:>10.2} {:>7.2}x",
            r.shape,
            r.m,
            r.n,
            r.k,
            r.splits,
            r.cublas_us,
            r.tiled_us,
            r.warpk_us,
            r.cublas_us / r.tiled_us.min(r.warpk_us)
        );
    }
    Ok(())
}
