//! `cudagraph bench streams`: what ordering replays across streams costs. Graphs of one pool
//! never overlap (a replay on another stream than the pool's last one waits for that stream),
//! a graph replayed from another stream waits for its last replay, and a graph cache orders a
//! request on another stream after the last one. This measures, in µs per replay of the seed
//! MLP at batch 1 (the launch-bound case where any overhead shows):
//! - one graph replayed back to back on one stream (the ordering costs a lock and a compare);
//! - two graphs of one pool alternating on one stream;
//! - two graphs of one pool alternating between two streams (each replay waits for the other
//!   stream: an event record and a stream wait);
//! - two graphs of separate pools alternating between two streams (no ordering: they overlap);
//! - a graph cache serving requests on one stream, and alternating between two streams.

use std::time::Instant;

use clap::Args;
use cudagraph::{
    BucketPolicy, CacheOptions, CaptureOptions, Device, Graph, GraphCache, Pool, QueueExt, Stream,
};
use cudagraph_nn::{no_grad, Batched, HostRng, NnModule, Sequential, Tensor};
use serde::Serialize;

use crate::bench::workloads::seed_mlp;
use crate::report::median;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Args, Debug)]
pub struct StreamsArgs {
    /// Replays (or requests) per sample; the median of 7 samples is reported.
    #[arg(long, default_value_t = 2000)]
    pub iters: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Row {
    case: &'static str,
    us_per_replay: f64,
}

/// Median µs per call of `f` over 7 samples of `iters` calls, after a warm-up, with every
/// stream in `streams` synchronised around each sample.
fn time(
    iters: usize,
    streams: &[&Stream],
    mut f: impl FnMut(usize) -> AnyResult<()>,
) -> AnyResult<f64> {
    for i in 0..iters.min(50) {
        f(i)?;
    }
    let mut v = Vec::new();
    for _ in 0..7 {
        for s in streams {
            s.synchronize()?;
        }
        let t = Instant::now();
        for i in 0..iters {
            f(i)?;
        }
        for s in streams {
            s.synchronize()?;
        }
        v.push(t.elapsed().as_secs_f64() * 1e6 / iters as f64);
    }
    Ok(median(v))
}

fn capture(s: &mut Stream, model: &Sequential, x: &Tensor, pool: &Pool) -> AnyResult<Graph> {
    let (g, _y) = Graph::capture(s, CaptureOptions::new().pool(pool).upload(true), |cs| {
        Ok(no_grad(|| model.forward(cs, x))?)
    })?;
    Ok(g)
}

pub fn run(ordinal: usize, a: &StreamsArgs) -> AnyResult<()> {
    let dev = Device::open(ordinal)?;
    let mut s = dev.new_stream()?;
    let (s1, s2) = (dev.new_stream()?, dev.new_stream()?);
    let mut rng = HostRng::new(7);
    let model = seed_mlp(&s, &mut rng)?;
    let x = Tensor::from_host(&s, &rng.vec_normal(1024), &[1, 1024])?;
    // Eager warm-up: the engine registry measures the shapes before any capture.
    no_grad(|| model.forward(&s, &x))?;
    s.synchronize()?;
    let shared = dev.graph_pool_handle();
    let a_graph = capture(&mut s, &model, &x, &shared)?;
    let b_graph = capture(&mut s, &model, &x, &shared)?;
    let c_graph = capture(&mut s, &model, &x, &dev.graph_pool_handle())?;
    let n = a.iters;
    let mut rows = vec![
        Row {
            case: "one graph, one stream",
            us_per_replay: time(n, &[&s1], |_| Ok(a_graph.replay(&s1)?))?,
        },
        Row {
            case: "two graphs of one pool, one stream",
            us_per_replay: time(n, &[&s1], |i| {
                let g = if i % 2 == 0 { &a_graph } else { &b_graph };
                Ok(g.replay(&s1)?)
            })?,
        },
        Row {
            case: "two graphs of one pool, alternating streams (ordered)",
            us_per_replay: time(n, &[&s1, &s2], |i| {
                let (g, st) = if i % 2 == 0 {
                    (&a_graph, &s1)
                } else {
                    (&b_graph, &s2)
                };
                Ok(g.replay(st)?)
            })?,
        },
        Row {
            case: "two graphs of separate pools, alternating streams (concurrent)",
            us_per_replay: time(n, &[&s1, &s2], |i| {
                let (g, st) = if i % 2 == 0 {
                    (&a_graph, &s1)
                } else {
                    (&c_graph, &s2)
                };
                Ok(g.replay(st)?)
            })?,
        },
    ];
    // A graph cache (buckets 1..8) fed from a request buffer on each stream.
    let batched = Batched {
        module: seed_mlp(&s, &mut rng)?,
        row_shape: vec![1024],
        output_row: 10,
    };
    let mut cache = GraphCache::new(
        &mut s,
        batched,
        BucketPolicy::PowersOfTwo { max: 8 },
        CacheOptions::default(),
    )?;
    let mut t1 = dev.new_stream()?;
    let mut t2 = dev.new_stream()?;
    let req1 = t1.alloc_from_host(&rng.vec_normal(1024))?;
    let req2 = t2.alloc_from_host(&rng.vec_normal(1024))?;
    let out1 = t1.alloc_zeroed::<f32>(10)?;
    let out2 = t2.alloc_zeroed::<f32>(10)?;
    let mut cache_case = |alternate: bool| -> AnyResult<f64> {
        let mut v = Vec::new();
        for sample in 0..7 {
            t1.synchronize()?;
            t2.synchronize()?;
            let iters = if sample == 0 { n.min(50) } else { n };
            let t = Instant::now();
            for i in 0..iters {
                if alternate && i % 2 == 1 {
                    cache.run_into(&mut t2, &req2, 1, &out2)?;
                } else {
                    cache.run_into(&mut t1, &req1, 1, &out1)?;
                }
            }
            t1.synchronize()?;
            t2.synchronize()?;
            if sample > 0 {
                v.push(t.elapsed().as_secs_f64() * 1e6 / iters as f64);
            }
        }
        Ok(median(v))
    };
    let one = cache_case(false)?;
    let two = cache_case(true)?;
    rows.push(Row {
        case: "graph cache request, one stream",
        us_per_replay: one,
    });
    rows.push(Row {
        case: "graph cache request, alternating streams (ordered)",
        us_per_replay: two,
    });
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    outln!(
        "Replays across streams on {} (seed MLP, batch 1; µs per replay, median of samples of {n})",
        dev.info().name
    );
    outln!("{:<66} {:>10}", "case", "µs");
    for r in &rows {
        outln!("{:<66} {:>10.2}", r.case, r.us_per_replay);
    }
    Ok(())
}
