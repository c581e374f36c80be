//! GPU tests of token sampling and decode bookkeeping (`nn::sampling`): the kernel against the
//! CPU reference (`nn::sampling::reference`, exact: both compute the same fixed-point weights
//! with the same correctly rounded f32 operations and the same Philox numbers, so every token
//! must be equal, not merely close), greedy ties, the temperature distribution against the
//! f64 softmax (chi-square), greedy rows split over blocks (alignments, ties at the edges,
//! replays, a row switching modes), top-k's support, `DecodeState`'s stop conditions and history, a
//! captured sample + advance step replayed k times against k eager steps, and misuse as typed
//! errors.
//!
//! The logits of the exact comparison are multiples of 1/64 (well separated: a value differs
//! from its neighbours by far more than the rounding of `x / temperature`, so even a reference
//! computed another way would rank them the same); some rows are quantized coarsely so that
//! top-k and top-p thresholds fall inside runs of equal values (the tie cut by id).

use std::sync::Arc;

use cudagraph::{gpu_test_device, CaptureOptions, Error, Graph, QueueExt, Stream};
use cudagraph_nn::nn::sampling::{reference, NO_LOGIT_CHECK};
use cudagraph_nn::*;

const SEED: u64 = 0x5eed_0f5a_3b1e;

fn params(temperature: f32, top_k: u32, top_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
    }
}

/// The settings of row `r` of the mixed tests.
fn mixed(r: usize) -> SamplingParams {
    match r % 8 {
        0 => SamplingParams::greedy(),
        1 => params(0.7, 0, 1.0),
        2 => params(1.0, 5, 1.0),
        3 => params(1.3, 0, 0.9),
        4 => params(0.9, 50, 0.8),
        5 => params(2.0, 1, 1.0),
        6 => params(1.0, 3, 0.5),
        _ => params(0.5, 0, 0.3),
    }
}

/// Row `r` of `vocab` logits: multiples of 1/64 in [-8, 8); every third row quantized to
/// steps of 1/2 (long runs of equal values); NaN and -inf sprinkled in every fifth row.
fn row_logits(rng: &mut HostRng, r: usize, vocab: usize) -> Vec<f32> {
    let step = if r % 3 == 2 { 0.5 } else { 1.0 / 64.0 };
    (0..vocab)
        .map(|i| {
            let x = ((rng.symmetric(8.0) / step).floor() * step).clamp(-8.0, 8.0);
            if r % 5 == 4 && i % 97 == 3 {
                f32::NAN
            } else if r % 5 == 4 && i % 89 == 5 {
                f32::NEG_INFINITY
            } else {
                x
            }
        })
        .collect()
}

fn exact_case(s: &Stream, rows: usize, vocab: usize, calls: usize) {
    let mut rng = HostRng::new(rows as u64 * 31 + vocab as u64);
    let logits: Vec<Vec<f32>> = (0..rows).map(|r| row_logits(&mut rng, r, vocab)).collect();
    let flat: Vec<f32> = logits.iter().flatten().copied().collect();
    let d_logits = s.alloc_from_host(&flat).unwrap();
    let sampler = Sampler::new(s, rows, vocab).unwrap();
    for r in 0..rows {
        sampler.set(s, r, &mixed(r)).unwrap();
    }
    let gen = Generator::new(s, SEED).unwrap();
    let tokens = s.alloc_zeroed::<i32>(rows).unwrap();
    for call in 0..calls {
        let (_, base) = gen.seed_and_base(s).unwrap();
        assert_eq!(base, (call * rows) as u64, "one counter per row and call");
        sampler.sample(s, &d_logits, rows, &gen, &tokens).unwrap();
        let got = s.to_vec(&tokens).unwrap();
        for r in 0..rows {
            let bits = reference::row_bits(SEED, base, 0, r);
            let want = reference::sample_row(&logits[r], &mixed(r), bits).unwrap();
            assert_eq!(
                got[r],
                want,
                "vocab {vocab}, call {call}, row {r} ({:?})",
                mixed(r)
            );
        }
    }
}

#[test]
fn sampler_picks_exactly_the_reference_tokens() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    exact_case(&s, 48, 5003, 3);
    exact_case(&s, 16, 1, 1);
    exact_case(&s, 9, 700, 2);
    exact_case(&s, 8, 50_257, 2);
    exact_case(&s, 4, 262_144, 1);
}

#[test]
fn greedy_ties_take_the_lowest_id_and_nan_is_never_chosen() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let vocab = 4099;
    let mut rows = vec![vec![1.0f32; vocab]; 5];
    rows[1][3000] = 2.0;
    rows[1][7] = 2.0;
    rows[2] = vec![f32::NAN; vocab];
    rows[2][4098] = -1e30;
    rows[3][0] = f32::NAN;
    rows[4][2048] = f32::INFINITY;
    rows[4][1024] = f32::INFINITY;
    let flat: Vec<f32> = rows.iter().flatten().copied().collect();
    let logits = s.alloc_from_host(&flat).unwrap();
    let sampler = Sampler::new(&s, 5, vocab).unwrap();
    let gen = Generator::new(&s, SEED).unwrap();
    let tokens = s.alloc_zeroed::<i32>(5).unwrap();
    sampler.sample(&s, &logits, 5, &gen, &tokens).unwrap();
    assert_eq!(s.to_vec(&tokens).unwrap(), vec![0, 7, 4098, 1, 1024]);
    // Temperature with +inf: only the +inf tokens can come out; NaN never.
    for r in 0..5 {
        sampler.set(&s, r, &params(1.0, 0, 1.0)).unwrap();
    }
    for _ in 0..20 {
        sampler.sample(&s, &logits, 5, &gen, &tokens).unwrap();
        let t = s.to_vec(&tokens).unwrap();
        // Row 1 at temperature 1 is nearly uniform (e² against 4097·e): any token.
        assert!((0..vocab as i32).contains(&t[1]), "{t:?}");
        assert_eq!(t[2], 4098);
        assert!(t[3] != 0, "{t:?}");
        assert!(t[4] == 1024 || t[4] == 2048, "{t:?}");
    }
}

#[test]
fn greedy_rows_split_over_blocks_pick_the_reference_tokens() {
    // Greedy rows are split over several blocks (float4 reads from each row's first 16-byte
    // boundary, odd vocabularies put rows at every alignment) and folded with an order-free
    // maximum; the per-row scratch is cleared by each call, so repeated calls, captured
    // replays and rows switching between greedy and sampled all give the reference tokens.
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    for (rows, vocab) in [
        (1usize, 50_257usize),
        (3, 50_257),
        (5, 128_259),
        (40, 8_193),
        (2, 7),
    ] {
        let mut rng = HostRng::new(rows as u64 * 7 + vocab as u64);
        let mut logits: Vec<Vec<f32>> = (0..rows).map(|r| row_logits(&mut rng, r, vocab)).collect();
        // Row 0's maximum in its last value (the tail of the last block), row 1's (if any)
        // a tie between its first value (the head of block 0) and a later one.
        logits[0][vocab - 1] = 100.0;
        if rows > 1 {
            logits[1][0] = 50.0;
            logits[1][vocab / 2] = 50.0;
        }
        let flat: Vec<f32> = logits.iter().flatten().copied().collect();
        let d_logits = s.alloc_from_host(&flat).unwrap();
        let sampler = Sampler::new(&s, rows, vocab).unwrap();
        let gen = Generator::new(&s, SEED).unwrap();
        let tokens = Arc::new(s.alloc_zeroed::<i32>(rows).unwrap());
        let want: Vec<i32> = logits
            .iter()
            .map(|l| reference::sample_row(l, &SamplingParams::greedy(), 0).unwrap())
            .collect();
        for _ in 0..3 {
            s.fill32(&tokens, 0, rows, -7i32).unwrap();
            sampler.sample(&s, &d_logits, rows, &gen, &tokens).unwrap();
            assert_eq!(s.to_vec(&tokens).unwrap(), want, "{rows} rows of {vocab}");
        }
        let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            Ok(sampler.sample(cs, &d_logits, rows, &gen, &tokens)?)
        })
        .unwrap();
        for _ in 0..3 {
            s.fill32(&tokens, 0, rows, -7i32).unwrap();
            g.replay(&s).unwrap();
            assert_eq!(
                s.to_vec(&tokens).unwrap(),
                want,
                "replay, {rows} rows of {vocab}"
            );
        }
        // Row 0 sampled, then greedy again: the replayed graph follows the settings.
        sampler.set(&s, 0, &params(0.7, 0, 1.0)).unwrap();
        let (_, base) = gen.seed_and_base(&s).unwrap();
        g.replay(&s).unwrap();
        let got = s.to_vec(&tokens).unwrap();
        let bits = reference::row_bits(SEED, base, 0, 0);
        let sampled = reference::sample_row(&logits[0], &params(0.7, 0, 1.0), bits).unwrap();
        assert_eq!(got[0], sampled);
        assert_eq!(&got[1..], &want[1..]);
        sampler.set(&s, 0, &SamplingParams::greedy()).unwrap();
        g.replay(&s).unwrap();
        assert_eq!(s.to_vec(&tokens).unwrap(), want);
    }
    // A split row with nothing to choose reports, and the next call is clean again.
    let vocab = 100_003;
    let mut flat = vec![f32::NAN; 2 * vocab];
    flat[vocab + 77_777] = f32::NEG_INFINITY;
    let bad = s.alloc_from_host(&flat).unwrap();
    let sampler = Sampler::new(&s, 2, vocab).unwrap();
    let gen = Generator::new(&s, SEED).unwrap();
    let tokens = s.alloc_from_host(&[5i32, 5]).unwrap();
    sampler.sample(&s, &bad, 2, &gen, &tokens).unwrap();
    match s.synchronize() {
        Err(Error::DeviceCheck { check, .. }) => assert_eq!(check, NO_LOGIT_CHECK),
        other => panic!("expected a device check, got {other:?}"),
    }
    assert_eq!(s.to_vec(&tokens).unwrap(), vec![0, 0]);
    flat[3] = -2.0;
    flat[vocab + 99_999] = 1.0;
    let good = s.alloc_from_host(&flat).unwrap();
    sampler.sample(&s, &good, 2, &gen, &tokens).unwrap();
    s.synchronize().unwrap();
    assert_eq!(s.to_vec(&tokens).unwrap(), vec![3, 99_999]);
}

#[test]
fn temperature_sampling_frequencies_match_the_softmax() {
    // 16 tokens, 256 identical rows, 100 calls: 25 600 draws. Pearson's chi-square with 15
    // degrees of freedom exceeds 60 with probability below 1e-6 for a correct sampler; a wrong
    // temperature (a factor 1.1) or an off-by-one token moves it into the hundreds.
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let vocab = 16;
    let rows = 256;
    let temperature = 1.7f32;
    let row: Vec<f32> = (0..vocab)
        .map(|i| ((i * 7) % 16) as f32 * 0.25 - 1.0)
        .collect();
    let flat: Vec<f32> = (0..rows).flat_map(|_| row.clone()).collect();
    let logits = s.alloc_from_host(&flat).unwrap();
    let sampler = Sampler::new(&s, rows, vocab).unwrap();
    for r in 0..rows {
        sampler.set(&s, r, &params(temperature, 0, 1.0)).unwrap();
    }
    let gen = Generator::new(&s, 99).unwrap();
    let tokens = s.alloc_zeroed::<i32>(rows).unwrap();
    let mut counts = vec![0u64; vocab];
    let calls = 100;
    for _ in 0..calls {
        sampler.sample(&s, &logits, rows, &gen, &tokens).unwrap();
        for t in s.to_vec(&tokens).unwrap() {
            counts[t as usize] += 1;
        }
    }
    let e: Vec<f64> = row
        .iter()
        .map(|&x| (x as f64 / temperature as f64).exp())
        .collect();
    let sum: f64 = e.iter().sum();
    let n = (rows * calls) as f64;
    let chi2: f64 = (0..vocab)
        .map(|i| {
            let want = n * e[i] / sum;
            (counts[i] as f64 - want).powi(2) / want
        })
        .sum();
    assert!(chi2 < 60.0, "chi-square {chi2}: {counts:?}");
}

#[test]
fn top_k_never_returns_a_token_outside_the_top_k() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let (rows, vocab, k) = (32, 3000, 10u32);
    let mut rng = HostRng::new(4);
    let logits: Vec<Vec<f32>> = (0..rows).map(|_| rng.vec_normal(vocab)).collect();
    let flat: Vec<f32> = logits.iter().flatten().copied().collect();
    let d_logits = s.alloc_from_host(&flat).unwrap();
    let sampler = Sampler::new(&s, rows, vocab).unwrap();
    for r in 0..rows {
        // A high temperature flattens the distribution, so tokens outside the top k would
        // come out often if they could.
        sampler.set(&s, r, &params(50.0, k, 1.0)).unwrap();
    }
    let gen = Generator::new(&s, 5).unwrap();
    let tokens = s.alloc_zeroed::<i32>(rows).unwrap();
    let mut seen = vec![std::collections::BTreeSet::new(); rows];
    for _ in 0..50 {
        sampler.sample(&s, &d_logits, rows, &gen, &tokens).unwrap();
        for (r, t) in s.to_vec(&tokens).unwrap().into_iter().enumerate() {
            let mut sorted: Vec<f32> = logits[r].clone();
            sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
            assert!(
                logits[r][t as usize] >= sorted[k as usize - 1],
                "row {r}: token {t} is outside the top {k}"
            );
            seen[r].insert(t);
        }
    }
    // At temperature 50, 50 draws see several of the 10 tokens.
    assert!(seen.iter().all(|s| s.len() >= 4), "{seen:?}");
}

#[test]
fn decode_state_stops_on_eos_and_limit_and_keeps_finished_rows() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let rows = 4;
    let st = DecodeState::new(&s, rows, 6, &[2, 9]).unwrap();
    // Every row starts finished (empty).
    let (f, g, h) = st.read(&s).unwrap();
    assert_eq!(f, vec![1; rows]);
    assert_eq!(g, vec![0; rows]);
    assert!(h.iter().all(|&v| v == -1));
    st.start_row(&s, 0, 10, 6).unwrap();
    st.start_row(&s, 1, 20, 3).unwrap();
    st.start_row(&s, 2, 30, 6).unwrap();
    // Row 3 stays empty.
    let ids = s.alloc_from_host(&[-5i32; 4]).unwrap();
    let pos = s.alloc_from_host(&[-6i32; 4]).unwrap();
    let steps: [[i32; 4]; 5] = [
        [5, 6, 7, 8],
        [9, 1, 11, 8], // row 0 hits eos 9
        [3, 4, 2, 8],  // row 1 hits its limit 3; row 2 hits eos 2
        [4, 4, 4, 8],  // everyone finished: nothing changes
        [1, 1, 1, 1],
    ];
    let tokens = s.alloc_zeroed::<i32>(rows).unwrap();
    let mut last_ids = vec![-5; 4];
    let mut last_pos = vec![-6; 4];
    for (k, step) in steps.iter().enumerate() {
        s.copy_from_host(step, &tokens).unwrap();
        st.advance(&s, &tokens, rows, &ids, &pos).unwrap();
        let got_ids = s.to_vec(&ids).unwrap();
        let got_pos = s.to_vec(&pos).unwrap();
        for r in 0..3 {
            let active = match r {
                0 => k < 2,
                1 => k < 3,
                _ => k < 3,
            };
            if active {
                last_ids[r] = step[r];
                last_pos[r] = 10 * (r as i32 + 1) + k as i32;
            }
        }
        assert_eq!(got_ids, last_ids, "step {k}");
        assert_eq!(got_pos, last_pos, "step {k}");
    }
    let (f, g, h) = st.read(&s).unwrap();
    assert_eq!(f, vec![1, 1, 1, 1]);
    assert_eq!(g, vec![2, 3, 3, 0]);
    assert_eq!(&h[0..6], &[5, 9, -1, -1, -1, -1]);
    assert_eq!(&h[6..12], &[6, 1, 4, -1, -1, -1]);
    assert_eq!(&h[12..18], &[7, 11, 2, -1, -1, -1]);
    assert_eq!(&h[18..24], &[-1; 6]);
    assert_eq!(s.to_vec(st.positions()).unwrap(), vec![12, 23, 33, 0]);
    // stop_row ends a running row; a restarted row begins afresh.
    st.start_row(&s, 3, 7, 2).unwrap();
    s.copy_from_host(&[0, 0, 0, 4], &tokens).unwrap();
    st.advance(&s, &tokens, rows, &ids, &pos).unwrap();
    st.stop_row(&s, 3).unwrap();
    st.advance(&s, &tokens, rows, &ids, &pos).unwrap();
    let (f, g, h) = st.read(&s).unwrap();
    assert_eq!(f[3], 1);
    assert_eq!(g[3], 1);
    assert_eq!(&h[18..20], &[4, -1]);
    st.start_row(&s, 0, 100, 1).unwrap();
    let (f, g, h) = st.read(&s).unwrap();
    assert_eq!((f[0], g[0]), (0, 0));
    assert_eq!(&h[0..6], &[-1; 6]);
}

/// One decode step without a model: sample from fixed logits, then advance.
fn step(
    q: &dyn cudagraph::Queue,
    sampler: &Sampler,
    st: &DecodeState,
    gen: &Generator,
    logits: &cudagraph::DeviceBuffer<f32>,
    bufs: &(
        cudagraph::DeviceBuffer<i32>,
        cudagraph::DeviceBuffer<i32>,
        cudagraph::DeviceBuffer<i32>,
    ),
    rows: usize,
) -> Result<()> {
    sampler.sample(q, logits, rows, gen, &bufs.0)?;
    st.advance(q, &bufs.0, rows, &bufs.1, &bufs.2)
}

#[test]
fn a_captured_step_replayed_k_times_equals_k_eager_steps() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let (rows, vocab, k) = (12, 2053, 10);
    let mut rng = HostRng::new(8);
    let flat: Vec<f32> = (0..rows)
        .flat_map(|r| row_logits(&mut rng, r, vocab))
        .collect();
    let logits = s.alloc_from_host(&flat).unwrap();
    let mut runs = Vec::new();
    for graphed in [false, true] {
        let sampler = Sampler::new(&s, rows, vocab).unwrap();
        let st = DecodeState::new(&s, rows, 16, &[17]).unwrap();
        for r in 0..rows {
            sampler.set(&s, r, &mixed(r)).unwrap();
            st.start_row(&s, r, r as i32, 4 + (r % 9) as i32).unwrap();
        }
        let gen = Generator::new(&s, SEED).unwrap();
        let bufs = Arc::new((
            s.alloc_zeroed::<i32>(rows).unwrap(),
            s.alloc_zeroed::<i32>(rows).unwrap(),
            s.alloc_zeroed::<i32>(rows).unwrap(),
        ));
        let mut seen = Vec::new();
        if graphed {
            let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
                Ok(step(cs, &sampler, &st, &gen, &logits, &bufs, rows)?)
            })
            .unwrap();
            for _ in 0..k {
                g.replay(&s).unwrap();
                seen.push((
                    s.to_vec(&bufs.0).unwrap(),
                    s.to_vec(&bufs.1).unwrap(),
                    s.to_vec(&bufs.2).unwrap(),
                ));
            }
        } else {
            for _ in 0..k {
                step(&s, &sampler, &st, &gen, &logits, &bufs, rows).unwrap();
                seen.push((
                    s.to_vec(&bufs.0).unwrap(),
                    s.to_vec(&bufs.1).unwrap(),
                    s.to_vec(&bufs.2).unwrap(),
                ));
            }
        }
        runs.push((seen, st.read(&s).unwrap(), gen.seed_and_base(&s).unwrap()));
    }
    assert_eq!(runs[0].0, runs[1].0, "tokens, ids and positions per step");
    assert_eq!(runs[0].1, runs[1].1, "finished, generated, history");
    assert_eq!(runs[0].2, runs[1].2, "generator state");
    assert_eq!(runs[0].2, (SEED, (k * rows) as u64));
}

#[test]
fn misuse_is_a_typed_error() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let sampler = Sampler::new(&s, 4, 100).unwrap();
    let gen = Generator::new(&s, 1).unwrap();
    let logits = s.alloc_zeroed::<f32>(400).unwrap();
    let short = s.alloc_zeroed::<f32>(399).unwrap();
    let tokens = s.alloc_zeroed::<i32>(4).unwrap();
    let few = s.alloc_zeroed::<i32>(3).unwrap();
    assert!(matches!(
        sampler.sample(&s, &logits, 5, &gen, &tokens),
        Err(NnError::Shape(_))
    ));
    assert!(matches!(
        sampler.sample(&s, &short, 4, &gen, &tokens),
        Err(NnError::Core(Error::SizeMismatch { .. }))
    ));
    assert!(matches!(
        sampler.sample(&s, &logits, 4, &gen, &few),
        Err(NnError::Core(Error::SizeMismatch { .. }))
    ));
    assert_eq!(gen.pending(), 0, "a refused call reserves nothing");
    for p in [
        params(-1.0, 0, 1.0),
        params(f32::NAN, 0, 1.0),
        params(1.0, 0, 0.0),
    ] {
        assert!(matches!(sampler.set(&s, 0, &p), Err(NnError::Config(_))));
    }
    assert!(matches!(
        sampler.set(&s, 4, &SamplingParams::greedy()),
        Err(NnError::Shape(_))
    ));
    assert!(Sampler::new(&s, 0, 10).is_err());
    assert!(Sampler::new(&s, 1, 0).is_err());
    // DecodeState.
    assert!(matches!(
        DecodeState::new(&s, 2, 4, &[1, 2, 3, 4, 5]),
        Err(NnError::Config(_))
    ));
    let st = DecodeState::new(&s, 2, 4, &[1]).unwrap();
    assert!(matches!(st.start_row(&s, 2, 0, 4), Err(NnError::Shape(_))));
    assert!(matches!(st.start_row(&s, 0, 0, 5), Err(NnError::Shape(_))));
    assert!(matches!(st.start_row(&s, 0, -1, 2), Err(NnError::Shape(_))));
    assert!(matches!(st.stop_row(&s, 9), Err(NnError::Shape(_))));
    let two = s.alloc_zeroed::<i32>(2).unwrap();
    let one = s.alloc_zeroed::<i32>(1).unwrap();
    assert!(matches!(
        st.advance(&s, &tokens, 3, &tokens, &tokens),
        Err(NnError::Shape(_))
    ));
    assert!(matches!(
        st.advance(&s, &two, 2, &one, &two),
        Err(NnError::Core(Error::SizeMismatch { .. }))
    ));
    s.synchronize().unwrap();
    // A row with nothing to choose: token 0 and a device-side check at the next sync.
    let nan = s.alloc_from_host(&vec![f32::NAN; 400]).unwrap();
    sampler.sample(&s, &nan, 2, &gen, &tokens).unwrap();
    match s.synchronize() {
        Err(Error::DeviceCheck {
            check, position, ..
        }) => {
            assert_eq!(check, NO_LOGIT_CHECK);
            assert!(position < 2);
        }
        other => panic!("expected a device check, got {other:?}"),
    }
    assert_eq!(&s.to_vec(&tokens).unwrap()[..2], &[0, 0]);
}

#[test]
fn sampling_cost_per_step_is_printed() {
    // Not a pass/fail check: prints the device time of one sample call (a graph of 20 calls,
    // replayed 5 times after a warm-up) per vocabulary, batch and setting, and of one decode
    // advance per batch, for the docs.
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let modes = [
        ("greedy", SamplingParams::greedy()),
        ("temperature", params(0.8, 0, 1.0)),
        ("top-k 50 + top-p 0.9", params(0.8, 50, 0.9)),
        ("top-p 0.9", params(0.8, 0, 0.9)),
    ];
    for vocab in [50_257usize, 128_256] {
        for rows in [1usize, 8, 32] {
            let mut rng = HostRng::new(3);
            let logits = s.alloc_from_host(&rng.vec_normal(rows * vocab)).unwrap();
            let tokens = Arc::new(s.alloc_zeroed::<i32>(rows).unwrap());
            for (name, p) in modes {
                let sampler = Sampler::new(&s, rows, vocab).unwrap();
                for r in 0..rows {
                    sampler.set(&s, r, &p).unwrap();
                }
                let gen = Generator::new(&s, 1).unwrap();
                let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
                    for _ in 0..20 {
                        sampler.sample(cs, &logits, rows, &gen, &tokens)?;
                        gen.advance(cs)?;
                    }
                    Ok(())
                })
                .unwrap();
                g.replay(&s).unwrap();
                s.synchronize().unwrap();
                let t0 = std::time::Instant::now();
                for _ in 0..5 {
                    g.replay(&s).unwrap();
                }
                s.synchronize().unwrap();
                let us = t0.elapsed().as_secs_f64() * 1e6 / 100.0;
                eprintln!("sample: vocab {vocab}, {rows} rows, {name}: {us:.1} us per call");
            }
        }
    }
    // The decode bookkeeping after each sample call, the same way.
    for rows in [1usize, 8, 32] {
        let st = DecodeState::new(&s, rows, 4096, &[50_256]).unwrap();
        for r in 0..rows {
            st.start_row(&s, r, 0, 4096).unwrap();
        }
        let bufs = Arc::new((
            s.alloc_zeroed::<i32>(rows).unwrap(),
            s.alloc_zeroed::<i32>(rows).unwrap(),
            s.alloc_zeroed::<i32>(rows).unwrap(),
        ));
        let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            for _ in 0..20 {
                st.advance(cs, &bufs.0, rows, &bufs.1, &bufs.2)?;
            }
            Ok(())
        })
        .unwrap();
        g.replay(&s).unwrap();
        s.synchronize().unwrap();
        let t0 = std::time::Instant::now();
        for _ in 0..5 {
            g.replay(&s).unwrap();
        }
        s.synchronize().unwrap();
        let us = t0.elapsed().as_secs_f64() * 1e6 / 100.0;
        eprintln!("decode advance: {rows} rows: {us:.1} us per call");
    }
}
