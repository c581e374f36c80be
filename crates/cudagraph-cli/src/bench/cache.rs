//! `cudagraph bench cache`: the seed MLP served at random batch sizes 1–256, per request:
//! eager, and through a [`GraphCache`] (vLLM-style buckets, padding) in its three ways —
//! staged (the request produced straight into the static input, outputs borrowed; graph or
//! eager chosen per bucket by measurement, and graphs only), `run_into` and `run` (copies in
//! and out) — and, in bench/pytorch_cache.py, PyTorch's dict-of-graphs pattern from seed
//! 002 (exact sizes 1/4/16/32 graphed, everything else eager). Also prints each bucket's
//! measured choice and the planner's choice of capture sizes for the request histogram.

use std::time::Instant;

use clap::Args;
use cudagraph::graph::cache::{Choice, Selection};
use cudagraph::{
    plan_capture_sizes, BatchModel, BucketPolicy, CacheOptions, Device, GraphCache, GraphCost,
    QueueExt, SizeHistogram, Stream,
};
use cudagraph_nn::{no_grad, Batched, HostRng, NnModule, Tensor};
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

/// The request sizes, from the same generator as bench/pytorch_cache.py uses.
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
struct BucketRow {
    size: usize,
    choice: String,
    /// The choice for requests copied in from a caller's buffer (run, run_into).
    copy_choice: String,
    graph_us: Option<f64>,
    eager_us: Option<f64>,
    copy_in_us: Option<f64>,
    hits: u64,
}

#[derive(Serialize)]
struct CacheReport {
    benchmark: &'static str,
    device: DeviceReport,
    requests: usize,
    /// The model on each request's rows (input already on the device, new output buffer).
    eager_us_per_request: f64,
    /// `GraphCache::stage` + `Staged::run` with graph-or-eager chosen per bucket by
    /// measurement: the request is produced straight into the static input, the output rows
    /// are borrowed (no copies), as the eager path reads its input in place and gets a new
    /// output.
    cache_us_per_request: f64,
    speedup: f64,
    /// The same, every bucket by its graph.
    staged_graph_only_us_per_request: f64,
    /// `GraphCache::run_into`: copy in, replay (or eager), copy out into the caller's buffer.
    run_into_us_per_request: f64,
    /// `GraphCache::run`: copy in, replay (or eager), copy out into a new buffer.
    run_us_per_request: f64,
    cache_stats: String,
    buckets_graph: usize,
    buckets_eager: usize,
    /// Buckets that serve copied-in requests (run, run_into) eagerly.
    buckets_copied_eager: usize,
    buckets: Vec<BucketRow>,
    captured_sizes: usize,
    capture_ms_total: f64,
    pool_reserved_bytes: usize,
    pool_peak_bytes: usize,
    largest_entry_peak_bytes: usize,
    static_input_bytes: usize,
    plan: String,
}

/// Wall µs per request over all `sizes`, after one warm-up request of every distinct size:
/// first use of a size does one-time work (the engine registry measures the shape's GEMMs,
/// the cache captures the bucket's graph) that steady-state serving never repeats. `f` serves
/// one request of the given rows on the stream it is handed.
fn per_request(
    s: &mut Stream,
    sizes: &[usize],
    mut f: impl FnMut(&mut Stream, usize) -> AnyResult<()>,
) -> AnyResult<f64> {
    let distinct: std::collections::BTreeSet<usize> = sizes.iter().copied().collect();
    for r in distinct {
        f(s, r)?;
    }
    s.synchronize()?;
    let t = Instant::now();
    for &r in sizes {
        f(s, r)?;
    }
    s.synchronize()?;
    Ok(t.elapsed().as_secs_f64() * 1e6 / sizes.len() as f64)
}

/// One staged request: nothing to copy in (the producer wrote the static input), the output
/// rows borrowed.
fn staged<M: BatchModel>(c: &mut GraphCache<M>, s: &mut Stream, rows: usize) -> AnyResult<()> {
    let st = c.stage(s, rows)?;
    st.run(s)?;
    Ok(())
}

pub fn run(ordinal: usize, a: &CacheArgs) -> AnyResult<()> {
    let dev = Device::open(ordinal)?;
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(6);
    let model = seed_mlp(&s, &mut rng)?;
    let x = s.alloc_from_host(&rng.vec_normal(256 * 1024))?;
    let sizes = request_sizes(a.requests);
    // Eager: the model on each request's rows, output kept as a new buffer.
    let eager = per_request(&mut s, &sizes, |s, rows| {
        no_grad(|| {
            let t =
                Tensor::from_buffer(std::sync::Arc::new(x.prefix(rows * 1024)?), &[rows, 1024])?;
            model.forward(&*s, &t)?;
            Ok::<_, cudagraph_nn::NnError>(())
        })?;
        Ok(())
    })?;

    let batched = || Batched {
        module: model.clone(),
        row_shape: vec![1024],
        output_row: 10,
    };
    let policy = BucketPolicy::Steps8 { max: 256 };
    let mut graph_only =
        GraphCache::new(&mut s, batched(), policy.clone(), CacheOptions::default())?;
    let mut cache = GraphCache::new(
        &mut s,
        batched(),
        policy,
        CacheOptions {
            selection: Selection::Measure,
            ..CacheOptions::default()
        },
    )?;
    // The producer has written the requests' rows into the static inputs (once here: the
    // eager path, too, reads its rows where they already are).
    for c in [&mut graph_only, &mut cache] {
        let st = c.stage(&s, 256)?;
        s.copy(&x, st.input())?;
    }
    let graph_only_us = per_request(&mut s, &sizes, |s, r| staged(&mut graph_only, s, r))?;
    let cached = per_request(&mut s, &sizes, |s, r| staged(&mut cache, s, r))?;
    let out = s.alloc::<f32>(256 * 10)?;
    let run_into_us = per_request(&mut s, &sizes, |s, r| {
        cache.run_into(s, &x, r, &out)?;
        Ok(())
    })?;
    let run_us = per_request(&mut s, &sizes, |s, r| {
        cache.run(s, &x, r)?;
        Ok(())
    })?;

    // Correctness spot checks on padded sizes, every path against eager.
    let xh = s.to_vec(&x.prefix(37 * 1024)?)?;
    let want =
        no_grad(|| model.forward(&s, &Tensor::from_host(&s, &xh, &[37, 1024])?))?.to_vec(&s)?;
    let check = |got: &[f32], what: &str| -> AnyResult<()> {
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        if diff > 1e-3 || got.len() != want.len() {
            return Err(format!("cache output ({what}) differs from eager by {diff}").into());
        }
        Ok(())
    };
    let (o, _) = cache.run(&mut s, &x, 37)?;
    check(&s.to_vec(&o)?, "run")?;
    cache.run_into(&mut s, &x, 37, &out)?;
    check(&s.to_vec(&out.prefix(370)?)?, "run_into")?;
    {
        let st = cache.stage(&s, 37)?;
        s.copy_range(&x, 0, st.input(), 0, 37 * 1024)?;
        let (o, _) = st.run(&mut s)?;
        check(&o.to_vec(&s)?, "staged")?;
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
    let buckets: Vec<BucketRow> = entries
        .iter()
        .map(|e| BucketRow {
            size: e.size,
            choice: format!("{:?}", e.choice).to_lowercase(),
            copy_choice: format!("{:?}", e.copy_choice).to_lowercase(),
            graph_us: e.graph_us,
            eager_us: e.eager_us,
            copy_in_us: e.copy_in_us,
            hits: e.hits,
        })
        .collect();
    let report = CacheReport {
        benchmark: "cache",
        device: device_report(&dev)?,
        requests: sizes.len(),
        eager_us_per_request: eager,
        cache_us_per_request: cached,
        speedup: eager / cached,
        staged_graph_only_us_per_request: graph_only_us,
        run_into_us_per_request: run_into_us,
        run_us_per_request: run_us,
        cache_stats: cache.stats().to_string(),
        buckets_graph: entries.iter().filter(|e| e.choice == Choice::Graph).count(),
        buckets_eager: entries.iter().filter(|e| e.choice == Choice::Eager).count(),
        buckets_copied_eager: entries
            .iter()
            .filter(|e| e.copy_choice == Choice::Eager)
            .count(),
        buckets,
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
        "  eager:                         {:8.2} us/request",
        report.eager_us_per_request
    );
    outln!(
        "  graph cache (staged, measured): {:8.2} us/request ({:.2}x eager)",
        report.cache_us_per_request,
        report.speedup
    );
    outln!(
        "  graph cache (staged, graphs):   {:8.2} us/request ({:.2}x eager)",
        report.staged_graph_only_us_per_request,
        eager / report.staged_graph_only_us_per_request
    );
    outln!(
        "  graph cache (run_into):         {:8.2} us/request ({:.2}x eager)",
        report.run_into_us_per_request,
        eager / report.run_into_us_per_request
    );
    outln!(
        "  graph cache (run):              {:8.2} us/request ({:.2}x eager)",
        report.run_us_per_request,
        eager / report.run_us_per_request
    );
    outln!(
        "  buckets: {} by graph, {} eager when staged; {} eager for copied-in requests (measured once per bucket)",
        report.buckets_graph,
        report.buckets_eager,
        report.buckets_copied_eager
    );
    for b in &report.buckets {
        if let (Some(g), Some(e), Some(c)) = (b.graph_us, b.eager_us, b.copy_in_us) {
            outln!(
                "    bs {:>3}: graph {:7.2} us, eager {:7.2} us, copy in {:5.2} us -> staged {}, copied {} ({} hits)",
                b.size,
                g,
                e,
                c,
                b.choice,
                b.copy_choice,
                b.hits
            );
        }
    }
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
