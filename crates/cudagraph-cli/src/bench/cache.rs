//! `cudagraph bench cache`: the seed MLP served at random batch sizes 1–256, per request:
//! eager, through a [`GraphCache`] (vLLM-style buckets, padding), and — in
//! bench/pytorch_baseline.py — PyTorch's dict-of-graphs pattern from seed 002 (exact sizes
//! 1/4/16/32 graphed, everything else eager). Also prints the planner's choice of capture sizes
//! for the recorded request histogram.

use std::time::Instant;

use clap::Args;
use cudagraph::{
    plan_capture_sizes, BucketPolicy, CacheOptions, Device, GraphCache, GraphCost, SizeHistogram,
};
use cudagraph_nn::{no_grad, Batched, Module, Rng, Tensor};
use serde::Serialize;

use crate::bench::workloads::seed_mlp;
use crate::report::{device_report, DeviceReport};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Args, Debug)]
pub struct CacheArgs {
    /// Requests to serve.
    #[arg(long, default_value_t = 2000)]
    pub requests: usize,
    /// Memory budget for the planner's suggestion, in MiB.
    #[arg(long, default_value_t = 16)]
    pub plan_budget_mib: usize,
    #[arg(long)]
    pub json: bool,
}

/// The request sizes, from the same generator as bench/pytorch_baseline.py uses.
pub fn request_sizes(n: usize) -> Vec<usize> {
    let mut x: u64 = 42;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            1 + ((x >> 33) % 256) as usize
        })
        .collect()
}

#[derive(Serialize)]
struct CacheReport {
    benchmark: &'static str,
    device: DeviceReport,
    requests: usize,
    eager_us_per_request: f64,
    cache_us_per_request: f64,
    speedup: f64,
    cache_stats: String,
    captured_sizes: usize,
    capture_ms_total: f64,
    pool_reserved_bytes: usize,
    pool_peak_bytes: usize,
    largest_entry_peak_bytes: usize,
    static_input_bytes: usize,
    plan: String,
}

pub fn run(ordinal: usize, a: &CacheArgs) -> AnyResult<()> {
    let dev = Device::open(ordinal)?;
    let mut s = dev.new_stream()?;
    let mut rng = Rng::new(6);
    let model = seed_mlp(&s, &mut rng)?;
    let x = s.alloc_from_host(&rng.vec_normal(256 * 1024))?;
    let sizes = request_sizes(a.requests);
    // Eager: the model on each request's rows, output kept as a new buffer.
    let eager_once = |rows: usize| -> AnyResult<()> {
        no_grad(|| {
            let t =
                Tensor::from_buffer(std::sync::Arc::new(x.prefix(rows * 1024)?), &[rows, 1024])?;
            model.forward(&s, &t)?;
            Ok::<_, cudagraph_nn::NnError>(())
        })?;
        Ok(())
    };
    for &r in sizes.iter().take(20) {
        eager_once(r)?;
    }
    s.synchronize()?;
    let t = Instant::now();
    for &r in &sizes {
        eager_once(r)?;
    }
    s.synchronize()?;
    let eager = t.elapsed().as_secs_f64() * 1e6 / sizes.len() as f64;

    let batched = Batched {
        module: model.clone(),
        row_shape: vec![1024],
        output_row: 10,
    };
    let mut cache = GraphCache::new(
        &mut s,
        batched,
        BucketPolicy::Steps8 { max: 256 },
        CacheOptions::default(),
    )?;
    for &r in sizes.iter().take(20) {
        cache.run(&mut s, &x, r)?;
    }
    s.synchronize()?;
    let t = Instant::now();
    for &r in &sizes {
        cache.run(&mut s, &x, r)?;
    }
    s.synchronize()?;
    let cached = t.elapsed().as_secs_f64() * 1e6 / sizes.len() as f64;

    // Correctness spot check on a padded size.
    let (out, _) = cache.run(&mut s, &x, 37)?;
    let xh = s.to_vec(&x.prefix(37 * 1024)?)?;
    let want =
        no_grad(|| model.forward(&s, &Tensor::from_host(&s, &xh, &[37, 1024])?))?.to_vec(&s)?;
    let got = s.to_vec(&out)?;
    let diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    if diff > 1e-3 {
        return Err(format!("cache output differs from eager by {diff}").into());
    }

    let entries = cache.entries();
    let largest = entries.iter().map(|e| e.peak_bytes).max().unwrap_or(0);
    let hist: SizeHistogram = sizes.iter().copied().collect();
    let per_row = largest / 256;
    let plan = plan_capture_sizes(
        &hist,
        GraphCost {
            bytes_per_graph: 64 * 1024,
            bytes_per_row: per_row.max(1),
        },
        a.plan_budget_mib << 20,
    )
    .map(|p| p.to_string())
    .unwrap_or_else(|e| format!("no plan fits: {e}"));
    let report = CacheReport {
        benchmark: "cache",
        device: device_report(&dev)?,
        requests: sizes.len(),
        eager_us_per_request: eager,
        cache_us_per_request: cached,
        speedup: eager / cached,
        cache_stats: cache.stats().to_string(),
        captured_sizes: entries.len(),
        capture_ms_total: cache.stats().capture_time.as_secs_f64() * 1e3,
        pool_reserved_bytes: cache.pool().stats().reserved,
        pool_peak_bytes: cache.pool().stats().peak_allocated,
        largest_entry_peak_bytes: largest,
        static_input_bytes: cache.static_input_bytes(),
        plan,
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    outln!(
        "seed MLP at random batch sizes 1..=256 on {}, {} requests",
        report.device.name,
        report.requests
    );
    outln!(
        "  eager:       {:8.2} us/request",
        report.eager_us_per_request
    );
    outln!(
        "  graph cache: {:8.2} us/request ({:.2}x)",
        report.cache_us_per_request,
        report.speedup
    );
    outln!("  {}", report.cache_stats);
    outln!(
        "  {} graphs: pool reserved {:.2} MB, pool peak {:.2} MB, largest graph alone {:.2} MB, shared static input {:.2} MB",
        report.captured_sizes,
        report.pool_reserved_bytes as f64 / 1048576.0,
        report.pool_peak_bytes as f64 / 1048576.0,
        report.largest_entry_peak_bytes as f64 / 1048576.0,
        report.static_input_bytes as f64 / 1048576.0
    );
    outln!(
        "  planner, {} MiB budget: {}",
        a.plan_budget_mib,
        report.plan
    );
    Ok(())
}
