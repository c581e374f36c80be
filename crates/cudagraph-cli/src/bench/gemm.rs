//! `cudagraph bench gemm`: the matrix products of the workloads with each engine family —
//! cuBLAS, cuBLASLt, our tiled split-K and warp-K kernels — and with the registry's choice
//! (`auto`), each timed as 20 products captured in one graph and replayed (so launch overhead is
//! out of the numbers). Each family runs once eagerly first, so the registry has measured the
//! variants inside it (split counts, cuBLASLt's algorithms) before the capture.
//!
//! `--dtype bf16|f16`: half-precision products on tensor cores (`engine::gemm_lowp`, operands
//! and result in that type, f32 accumulation) — the squares 1024³ to 8192³ and the workloads'
//! shapes, each run once eagerly (the registry measures its candidates), then timed as
//! [`PRODUCTS_PER_GRAPH`] products in one graph, replayed between CUDA events: µs per product,
//! TFLOP/s and the engine chosen. `bench/pytorch_gemm.py` times `torch.matmul` the same way.

use std::time::Instant;

use clap::Args;
use cudagraph::memory::{bf16, f16};
use cudagraph::{CaptureOptions, Device, Event, Graph, Queue, QueueExt};
use cudagraph_nn::dtype::{Dtype, Float};
use cudagraph_nn::engine::gemm::alignment;
use cudagraph_nn::engine::gemm::Trans;
use cudagraph_nn::engine::gemm::{gemm, run_gemm, split_k, Epilogue, GemmFamily, GemmOp};
use cudagraph_nn::engine::gemm_lowp::{gemm_lowp_with, lowp_candidates};
use cudagraph_nn::engine::{gemm_lowp, Engines, GemmEngine};
use cudagraph_nn::{HostRng, Nn};
use serde::Serialize;

use crate::report::{device_report, median, DeviceReport, Footnotes, NOT_APPLICABLE};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Args, Debug)]
pub struct GemmArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Element type of the products: f32 (every engine family, the default), or bf16 / f16
    /// (tensor cores: the squares 1024³–8192³ and the workloads' shapes, µs and TFLOP/s).
    #[arg(long, default_value = "f32")]
    pub dtype: Dtype,
    /// bf16/f16: also time every candidate the registry measured, the same way as its choice
    /// (a graph of products, replayed), for products of at least this many GFLOP (0: all).
    #[arg(long, value_name = "GFLOP")]
    pub candidates: Option<f64>,
}

#[derive(Serialize)]
pub struct GemmRow {
    pub shape: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub splits: usize,
    pub cublas_us: f64,
    /// `None` when cuBLASLt is not installed.
    pub cublaslt_us: Option<f64>,
    pub tiled_us: f64,
    pub warpk_us: f64,
    /// The few-rows kernel (forward layout with k a multiple of 4 and at most 64 rows; other
    /// products fall back to the tiled kernel, as with warp-K).
    pub rows_us: f64,
    /// The registry's choice among every engine, and its time.
    pub auto_engine: String,
    pub auto_us: f64,
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
    let mut rng = HostRng::new(5);
    let mut rows = Vec::new();
    for &(m, n, k, ta, tb, name) in SHAPES {
        let a = s.alloc_from_host(&rng.vec_normal(m * k))?;
        let b = s.alloc_from_host(&rng.vec_normal(k * n))?;
        let c = s.alloc_from_host(&vec![0.0f32; m * n])?;
        let t = |x: bool| if x { Trans::T } else { Trans::N };
        let has_lt = Engines::get(dev)?.cublaslt().is_some();
        let mut us = [f64::NAN; 6];
        let mut auto_engine = String::new();
        for (slot, engine) in [
            GemmFamily::Cublas,
            GemmFamily::CublasLt,
            GemmFamily::Tiled,
            GemmFamily::WarpK,
            GemmFamily::Rows,
            GemmFamily::Auto,
        ]
        .into_iter()
        .enumerate()
        {
            if engine == GemmFamily::CublasLt && !has_lt {
                continue;
            }
            // Eager first: the registry measures the engines of this family.
            let op = GemmOp {
                ta: t(ta),
                tb: t(tb),
                m,
                n,
                k,
                alpha: 1.0,
                beta: 0.0,
                epilogue: Epilogue::None,
            };
            let chosen = run_gemm(&s, &nn, engine, &op, &a, &b, &c, None)?;
            if engine == GemmFamily::Auto {
                auto_engine = chosen.to_string();
            }
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
            cublaslt_us: has_lt.then_some(us[1]),
            tiled_us: us[2],
            warpk_us: us[3],
            rows_us: us[4],
            auto_engine,
            auto_us: us[5],
        });
    }
    Ok(rows)
}

pub fn run(ordinal: usize, a: &GemmArgs) -> AnyResult<()> {
    match a.dtype {
        Dtype::F32 => run_f32(ordinal, a),
        Dtype::Bf16 => run_lowp::<bf16>(ordinal, a),
        Dtype::F16 => run_lowp::<f16>(ordinal, a),
    }
}

fn run_f32(ordinal: usize, a: &GemmArgs) -> AnyResult<()> {
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
        "{:<22} {:>5} {:>5} {:>5} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:<12} {:>8}",
        "shape",
        "m",
        "n",
        "k",
        "splits",
        "cuBLAS",
        "cuBLASLt",
        "tiled",
        "warp-K",
        "rows",
        "auto",
        "auto engine",
        "auto/cuBLAS"
    );
    let mut footnotes = Footnotes::default();
    for r in &out.rows {
        let lt = r.cublaslt_us.map_or_else(
            || NOT_APPLICABLE.to_string() + &footnotes.mark("cuBLASLt did not load here"),
            |v| format!("{v:.2}"),
        );
        outln!(
            "{:<22} {:>5} {:>5} {:>5} {:>6} {:>9.2} {:>9} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:<12} {:>7.2}x",
            r.shape,
            r.m,
            r.n,
            r.k,
            r.splits,
            r.cublas_us,
            lt,
            r.tiled_us,
            r.warpk_us,
            r.rows_us,
            r.auto_us,
            r.auto_engine,
            r.cublas_us / r.auto_us
        );
    }
    for line in footnotes.lines() {
        outln!("{line}");
    }
    Ok(())
}

/// Products captured in each timed graph.
pub const PRODUCTS_PER_GRAPH: usize = 20;

/// The square products timed in half precision, besides the workloads' shapes.
pub const SQUARES: [usize; 4] = [1024, 2048, 4096, 8192];

/// One half-precision product's time.
#[derive(Serialize)]
pub struct LowpRow {
    pub shape: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Whether A is stored transposed (k×m), as `ta` of `GemmOp`.
    pub ta: bool,
    /// Whether B is stored transposed (n×k).
    pub tb: bool,
    /// µs per product (median of the samples).
    pub us: f64,
    /// 2·m·n·k / time.
    pub tflops: f64,
    /// The registry's engine.
    pub engine: String,
    /// With `--candidates`: every candidate's µs per product, timed like the choice.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<(String, f64)>,
}

/// The shapes timed in half precision: the squares, then the workloads' products.
pub fn lowp_shapes() -> Vec<(usize, usize, usize, bool, bool, String)> {
    let mut v: Vec<_> = SQUARES
        .iter()
        .map(|&d| (d, d, d, false, false, format!("square {d}")))
        .collect();
    v.extend(
        SHAPES
            .iter()
            .map(|&(m, n, k, ta, tb, name)| (m, n, k, ta, tb, name.to_string())),
    );
    v
}

/// Microseconds of replays before the samples of each half-precision shape.
const WARM_US: f64 = 200_000.0;

/// Times every shape of [`lowp_shapes`] with operands and result of `T` (and every candidate
/// of products of at least `candidates` GFLOP).
pub fn measure_lowp<T: Float>(dev: &Device, candidates: Option<f64>) -> AnyResult<Vec<LowpRow>> {
    let nn = Nn::get(dev)?;
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(5);
    let (e0, e1) = (
        Event::new(dev.context(), true)?,
        Event::new(dev.context(), true)?,
    );
    let mut rows = Vec::new();
    for (m, n, k, ta, tb, name) in lowp_shapes() {
        let data = |rng: &mut HostRng, len: usize| -> Vec<T> {
            rng.vec_normal(len).into_iter().map(T::from_f32).collect()
        };
        let a = s.alloc_from_host(&data(&mut rng, m * k))?;
        let b = s.alloc_from_host(&data(&mut rng, k * n))?;
        let c = s.alloc::<T>(m * n)?;
        let t = |x: bool| if x { Trans::T } else { Trans::N };
        let op = GemmOp {
            ta: t(ta),
            tb: t(tb),
            m,
            n,
            k,
            alpha: 1.0,
            beta: 0.0,
            epilogue: Epilogue::None,
        };
        // Eager first: the registry measures the candidates; the graph replays its choice.
        let engine = gemm_lowp(&s, &nn, &op, &a, &b, &c, None)?;
        let time = |s: &mut cudagraph::Stream, algo: Option<GemmEngine>| -> AnyResult<f64> {
            let (g, ()) = Graph::capture(s, CaptureOptions::new().upload(true), |cs| {
                for _ in 0..PRODUCTS_PER_GRAPH {
                    match algo {
                        None => gemm_lowp(cs, &nn, &op, &a, &b, &c, None).map(drop)?,
                        Some(e) => gemm_lowp_with(cs, &nn, e, &op, &a, &b, &c, None)?,
                    }
                }
                Ok(())
            })?;
            let replays = |s: &cudagraph::Stream, reps: usize| -> AnyResult<f64> {
                s.stream_handle().record(&e0)?;
                for _ in 0..reps {
                    g.replay(s)?;
                }
                s.stream_handle().record(&e1)?;
                e1.synchronize()?;
                Ok(e0.elapsed_ms(&e1)? as f64 * 1e3 / (reps * PRODUCTS_PER_GRAPH) as f64)
            };
            g.replay(s)?;
            // One replay sets how many make a sample of about 50 ms (at least one, at most 50).
            let once = replays(s, 1)? * PRODUCTS_PER_GRAPH as f64;
            let reps = ((50_000.0 / once.max(1.0)).ceil() as usize).clamp(1, 50);
            // 200 ms of replays first: every shape and candidate is timed at the clocks and
            // power state of sustained work (bench/pytorch_gemm.py does the same).
            replays(s, ((WARM_US / once.max(1.0)).ceil() as usize).max(1))?;
            let mut samples = Vec::new();
            for _ in 0..5 {
                samples.push(replays(s, reps)?);
            }
            Ok(median(samples))
        };
        let us = time(&mut s, None)?;
        let gflop = 2.0 * (m * n) as f64 * k as f64 / 1e9;
        let mut timed = Vec::new();
        if candidates.is_some_and(|min| gflop >= min) {
            let align = alignment(&[a.addr(), b.addr(), c.addr()]);
            for e in lowp_candidates::<T, T>(&s, &op, align)? {
                match time(&mut s, Some(e)) {
                    Ok(t) => timed.push((e.to_string(), t)),
                    Err(err) => timed.push((format!("{e} ({err})"), f64::NAN)),
                }
            }
        }
        rows.push(LowpRow {
            shape: name,
            m,
            n,
            k,
            ta,
            tb,
            us,
            tflops: 2.0 * (m * n) as f64 * k as f64 / (us * 1e6),
            engine: engine.to_string(),
            candidates: timed,
        });
    }
    Ok(rows)
}

fn run_lowp<T: Float>(ordinal: usize, a: &GemmArgs) -> AnyResult<()> {
    let dev = Device::open(ordinal)?;
    let rows = measure_lowp::<T>(&dev, a.candidates)?;
    #[derive(Serialize)]
    struct Out {
        benchmark: &'static str,
        dtype: &'static str,
        products_per_graph: usize,
        device: DeviceReport,
        rows: Vec<LowpRow>,
    }
    let out = Out {
        benchmark: "gemm",
        dtype: T::DTYPE.name(),
        products_per_graph: PRODUCTS_PER_GRAPH,
        device: device_report(&dev)?,
        rows,
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    outln!(
        "{} products on {} (operands and result {}, f32 accumulation), µs per product inside \
         a graph of {}",
        out.dtype,
        out.device.name,
        out.dtype,
        out.products_per_graph
    );
    outln!(
        "{:<22} {:>5} {:>5} {:>5} {:>6} {:>10} {:>9}  engine",
        "shape",
        "m",
        "n",
        "k",
        "layout",
        "µs",
        "TFLOP/s"
    );
    for r in &out.rows {
        let l = |t: bool| if t { 'T' } else { 'N' };
        outln!(
            "{:<22} {:>5} {:>5} {:>5} {:>6} {:>10.2} {:>9.1}  {}",
            r.shape,
            r.m,
            r.n,
            r.k,
            format!("{}{}", l(r.ta), l(r.tb)),
            r.us,
            r.tflops,
            r.engine
        );
        for (e, us) in &r.candidates {
            outln!("{:<22} {:>33.2}  candidate {e}", "", us);
        }
    }
    Ok(())
}
