//! GPU tests of NN work that shares graphs and generators across streams (issue 26, items 3
//! and 4): one graph cache behind a `Mutex` serving two threads on two streams answers every
//! request exactly as it answers it alone on one stream, and a graph that draws random
//! numbers advances its generator on every replay like the eager calls it replaces.

use std::sync::{Arc, Mutex};

use cudagraph::{
    gpu_test_device, BucketPolicy, CacheOptions, CaptureOptions, Graph, GraphCache, QueueExt,
    Stream,
};
use cudagraph_nn::*;

fn mlp(s: &Stream, rng: &mut HostRng, dims: &[usize]) -> Sequential {
    let mut layers = Vec::new();
    for w in dims.windows(2) {
        layers.push(Layer::Linear(Linear::new(s, w[0], w[1], rng).unwrap()));
        layers.push(Layer::ReLU);
    }
    layers.pop();
    Sequential::new(layers)
}

/// Request `i`'s rows: a window of the base rows scaled by a factor of its own, so no two
/// requests have the same input (a stale or mixed-up input gives a different answer).
fn request(base: &[f32], width: usize, i: usize, rows: usize) -> Vec<f32> {
    let total = base.len() / width;
    let start = (i * 7) % (total - rows + 1);
    let scale = 1.0 + i as f32 / 8192.0;
    base[start * width..(start + rows) * width]
        .iter()
        .map(|v| v * scale)
        .collect()
}

fn rows_of(i: usize, max: usize) -> usize {
    // A fixed pseudo-random size in 1..=max per request.
    1 + ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as usize % max
}

#[test]
fn a_graph_cache_behind_a_mutex_serves_two_streams_like_one() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut rng = HostRng::new(26);
    const WIDTH: usize = 1024;
    const MAX: usize = 256;
    let requests: usize = cudagraph::testing::iterations(10_000, 200);
    let model = mlp(&s, &mut rng, &[WIDTH, 4096, 4096, 10]);
    let base = rng.vec_normal((MAX + 64) * WIDTH);
    let batched = Batched {
        module: model,
        row_shape: vec![WIDTH],
        output_row: 10,
    };
    let mut cache = GraphCache::new(
        &mut s,
        batched,
        BucketPolicy::PowersOfTwo { max: MAX },
        CacheOptions::default(),
    )
    .unwrap();
    // Every request served alone, one at a time, on one stream.
    let want: Vec<Vec<f32>> = (0..requests)
        .map(|i| {
            let rows = rows_of(i, MAX);
            let x = s.alloc_from_host(&request(&base, WIDTH, i, rows)).unwrap();
            let (out, _) = cache.run(&mut s, &x, rows).unwrap();
            s.to_vec(&out).unwrap()
        })
        .collect();
    let shared = Arc::new(Mutex::new(cache));
    let (base, want) = (Arc::new(base), Arc::new(want));
    let threads: Vec<_> = (0..2)
        .map(|t| {
            let (shared, base, want, dev) =
                (shared.clone(), base.clone(), want.clone(), dev.clone());
            std::thread::spawn(move || {
                let mut mine = dev.new_stream().unwrap();
                let mut wrong = Vec::new();
                for i in (t..requests).step_by(2) {
                    let rows = rows_of(i, MAX);
                    let x = mine
                        .alloc_from_host(&request(&base, WIDTH, i, rows))
                        .unwrap();
                    let out = {
                        let mut cache = shared.lock().unwrap();
                        cache.run(&mut mine, &x, rows).unwrap().0
                    };
                    let got = mine.to_vec(&out).unwrap();
                    let same = got.len() == want[i].len()
                        && got
                            .iter()
                            .zip(&want[i])
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                    if !same {
                        wrong.push(i);
                    }
                }
                wrong
            })
        })
        .collect();
    let wrong: Vec<usize> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {requests} requests differ from the same request served alone (first: {:?})",
        wrong.len(),
        &wrong[..wrong.len().min(8)]
    );
    assert_eq!(shared.lock().unwrap().stats().requests, 2 * requests as u64);
}

#[test]
fn a_graph_that_draws_advances_its_generator_on_every_replay() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    const N: usize = 1000;
    // Three eager draws from a fresh generator.
    let eager_gen = Generator::new(&s, 42).unwrap();
    let eager: Vec<Vec<f32>> = (0..3)
        .map(|_| rand(&s, &eager_gen, &[N]).unwrap().to_vec(&s).unwrap())
        .collect();
    assert_eq!(eager_gen.pending(), 0, "eager draws advance at once");
    // The same draw captured once, replayed three times, from a generator with the same seed.
    let gen = Generator::new(&s, 42).unwrap();
    let out = s.alloc_zeroed::<f32>(N).unwrap();
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        let t = rand(cs, &gen, &[N])?;
        cs.copy(t.data()?, &out)
    })
    .unwrap();
    assert_eq!(gen.pending(), 0, "the capture advances at its end");
    let mut replays = Vec::new();
    for _ in 0..3 {
        g.replay(&s).unwrap();
        replays.push(s.to_vec(&out).unwrap());
    }
    for (k, (r, e)) in replays.iter().zip(&eager).enumerate() {
        assert!(
            r.iter().zip(e).all(|(a, b)| a.to_bits() == b.to_bits()),
            "replay {k} differs from eager call {k}"
        );
    }
    assert_ne!(replays[0], replays[1]);
    assert_ne!(replays[1], replays[2]);
    assert_ne!(replays[0], replays[2]);
    // Eager draws and replays interleave without sharing counters: an eager draw now is the
    // fourth draw, the next replay the fifth.
    let fourth = rand(&s, &gen, &[N]).unwrap().to_vec(&s).unwrap();
    g.replay(&s).unwrap();
    let fifth = s.to_vec(&out).unwrap();
    let more: Vec<Vec<f32>> = (0..2)
        .map(|_| rand(&s, &eager_gen, &[N]).unwrap().to_vec(&s).unwrap())
        .collect();
    assert_eq!(fourth, more[0]);
    assert_eq!(fifth, more[1]);
}

#[test]
fn an_explicit_advance_inside_the_capture_adds_no_second_advance() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    const N: usize = 64;
    let gen = Generator::new(&s, 7).unwrap();
    let out = s.alloc_zeroed::<f32>(N).unwrap();
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        let t = rand(cs, &gen, &[N])?;
        cs.copy(t.data()?, &out)?;
        Ok(gen.advance(cs)?)
    })
    .unwrap();
    let eager_gen = Generator::new(&s, 7).unwrap();
    for k in 0..3 {
        g.replay(&s).unwrap();
        let want = rand(&s, &eager_gen, &[N]).unwrap().to_vec(&s).unwrap();
        assert_eq!(s.to_vec(&out).unwrap(), want, "replay {k}");
    }
    // One advance per replay: the base moved by exactly three draws' counters.
    let (_, base) = gen.seed_and_base(&s).unwrap();
    let (_, eager_base) = eager_gen.seed_and_base(&s).unwrap();
    assert_eq!(base, eager_base);
}
