//! The generation loop on the device: captured decode steps give exactly the tokens of eager
//! steps (greedy and sampled), greedy tokens follow the decoder's own argmax, sequences join
//! and leave between steps without disturbing each other, several steps a launch give the
//! tokens of single steps and stop when every row has ended, and misuse is a typed error.
//!
//! Tiny random GPT-2 and Llama decoders (tests/common/tiny_decoder.rs). "Follows the argmax"
//! is checked on the decoder's logits of the whole generated sequence (one teacher-forced call)
//! at every step whose top-2 margin exceeds 1e-3 of the row's largest logit: f32 results of one
//! product shape and another (one row or several) differ by far less than that, so a token may
//! only differ where the margin is smaller.

#[path = "common/tiny_decoder.rs"]
mod tiny_decoder;

use std::sync::Arc;

use cudagraph::{gpu_test_device, QueueExt, Stream};
use cudagraph_nn::*;
use tiny_decoder::{weights, Lcg, GPT2, LLAMA};

const VOCAB: usize = 97;

fn models() -> [(&'static str, &'static str); 2] {
    [("gpt2", GPT2), ("llama", LLAMA)]
}

fn prompt(seed: u64, n: usize) -> Vec<i32> {
    let mut r = Lcg(seed);
    (0..n)
        .map(|_| ((r.next() + 1.0) * 0.5 * VOCAB as f64) as i32 % VOCAB as i32)
        .collect()
}

fn request(seed: u64, len: usize, max_new: usize, sampling: SamplingParams) -> Request {
    Request {
        prompt: prompt(seed, len),
        max_new,
        sampling,
    }
}

/// Checks that `tokens` (generated after `prompt`) are the decoder's argmax at every step
/// whose margin is clear; returns how many steps were checked.
fn follows_argmax(s: &Stream, dec: &Decoder, prompt: &[i32], tokens: &[i32], what: &str) -> usize {
    let seq: Vec<i32> = prompt.iter().chain(tokens).copied().collect();
    let n = seq.len();
    let cache = dec.new_cache(s, 1, n).unwrap();
    let logits = s.alloc::<f32>(n * VOCAB).unwrap();
    let pos: Vec<i32> = (0..n as i32).collect();
    dec.forward(
        s,
        &cache,
        &s.alloc_from_host(&seq).unwrap(),
        &s.alloc_from_host(&pos).unwrap(),
        &s.alloc_from_host(&[0]).unwrap(),
        (1, n),
        LogitsFor::All,
        &logits,
    )
    .unwrap();
    let l = s.to_vec(&logits).unwrap();
    let mut checked = 0;
    for (j, &tok) in tokens.iter().enumerate() {
        let t = prompt.len() - 1 + j;
        let row = &l[t * VOCAB..(t + 1) * VOCAB];
        let mut idx: Vec<usize> = (0..VOCAB).collect();
        idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        let scale = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        if row[idx[0]] - row[idx[1]] > 1e-3 * scale {
            checked += 1;
            assert_eq!(tok, idx[0] as i32, "{what}: step {j}");
        }
    }
    checked
}

fn generation(s: &mut Stream, dec: &Arc<Decoder>, slots: usize, graphs: bool) -> Generation {
    let mut o = GenerationOptions::new(slots, 30);
    o.graphs = graphs;
    o.seed = 5;
    Generation::new(s, dec.clone(), o).unwrap()
}

#[test]
fn captured_steps_give_the_tokens_of_eager_steps() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    for (name, json) in models() {
        for dt in [Dtype::F32, Dtype::Bf16] {
            let dec = Arc::new(Decoder::from_weights(&s, &weights(json, 3), dt).unwrap());
            let sampled = SamplingParams {
                temperature: 0.8,
                top_k: 20,
                top_p: 0.9,
            };
            let requests = [
                request(1, 5, 12, SamplingParams::greedy()),
                request(2, 9, 7, sampled),
                request(3, 1, 10, sampled),
            ];
            let mut eager = generation(&mut s, &dec, 4, false);
            let mut graphed = generation(&mut s, &dec, 4, true);
            assert_eq!(graphed.buckets(), &[1, 2, 4]);
            assert_eq!(graphed.stats().graphs, 3);
            let a = eager.generate(&s, &requests, 3).unwrap();
            let b = graphed.generate(&s, &requests, 3).unwrap();
            assert_eq!(a, b, "{name} {dt}");
            for (r, t) in requests.iter().zip(&a) {
                assert_eq!(
                    t.len(),
                    r.max_new,
                    "{name} {dt}: no end token, so max_new tokens"
                );
                assert!(t.iter().all(|&x| (0..VOCAB as i32).contains(&x)));
            }
            if dt == Dtype::F32 {
                let checked = follows_argmax(&s, &dec, &requests[0].prompt, &a[0], name);
                assert!(
                    checked >= 6,
                    "{name}: only {checked} steps had a clear margin"
                );
            }
        }
    }
}

#[test]
fn sequences_join_and_leave_between_steps() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    for (name, json) in models() {
        let dec = Arc::new(Decoder::from_weights(&s, &weights(json, 4), Dtype::F32).unwrap());
        let mut g = generation(&mut s, &dec, 3, true);
        let a = request(10, 6, 20, SamplingParams::greedy());
        let b = request(11, 4, 8, SamplingParams::greedy());
        let c = request(12, 7, 9, SamplingParams::greedy());
        assert_eq!(g.join(&s, std::slice::from_ref(&a)).unwrap(), vec![0]);
        for _ in 0..3 {
            g.step(&s).unwrap();
        }
        assert_eq!(g.join(&s, std::slice::from_ref(&b)).unwrap(), vec![1]);
        assert_eq!(g.free_slots(), 1);
        // A leaves early; C takes its slot (and its stale cache) while B runs on.
        g.step(&s).unwrap();
        g.leave(&s, 0).unwrap();
        assert_eq!(g.join(&s, std::slice::from_ref(&c)).unwrap(), vec![0]);
        let mut done = Vec::new();
        for _ in 0..20 {
            g.step(&s).unwrap();
            done.extend(g.poll(&s).unwrap());
        }
        done.sort_by_key(|f| f.slot);
        assert_eq!(
            done.iter().map(|f| f.slot).collect::<Vec<_>>(),
            vec![0, 1],
            "{name}"
        );
        assert_eq!(done[0].tokens.len(), c.max_new);
        assert_eq!(done[1].tokens.len(), b.max_new);
        let checked = follows_argmax(&s, &dec, &c.prompt, &done[0].tokens, name)
            + follows_argmax(&s, &dec, &b.prompt, &done[1].tokens, name);
        assert!(
            checked >= 10,
            "{name}: only {checked} steps had a clear margin"
        );
        assert_eq!(g.free_slots(), 3);
        // Nothing occupied: a step does nothing.
        g.step(&s).unwrap();
        assert!(g.poll(&s).unwrap().is_empty());
    }
}

/// Steps a launch (a WHILE node around the captured step) give the tokens of single steps, and
/// a launch stops after the step in which its last row ended: the sequence that joins after it
/// draws the same random numbers as after single steps, which it would not if the launch had
/// run its remaining steps (each step moves the sampling generator).
#[test]
fn several_steps_a_launch_stop_when_every_row_has_ended() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let sampled = SamplingParams {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.9,
    };
    let first = [request(30, 4, 5, sampled), request(31, 6, 9, sampled)];
    let later = request(32, 3, 11, sampled);
    for (name, json) in models() {
        let dec = Arc::new(Decoder::from_weights(&s, &weights(json, 7), Dtype::F32).unwrap());
        let mut run = |k: u32, graphs: bool| {
            let mut o = GenerationOptions::new(2, 30);
            o.graphs = graphs;
            o.seed = 5;
            o.steps_per_launch = k;
            let mut g = Generation::new(&mut s, dec.clone(), o).unwrap();
            let mut tokens = Vec::new();
            for batch in [&first[..], std::slice::from_ref(&later)] {
                let slots = g.join(&s, batch).unwrap();
                let mut done = Vec::new();
                let mut launches = 0;
                while done.len() < batch.len() {
                    g.step(&s).unwrap();
                    launches += 1;
                    done.extend(g.poll(&s).unwrap());
                    assert!(launches <= 11, "{name} k {k}: the sequences did not end");
                }
                let most = batch.iter().map(|r| r.max_new).max().unwrap();
                assert_eq!(launches, most.div_ceil(k as usize), "{name} k {k}");
                for slot in slots {
                    let f = done.iter().find(|f| f.slot == slot).unwrap();
                    tokens.push(f.tokens.clone());
                }
            }
            assert_eq!(g.free_slots(), 2);
            tokens
        };
        let single = run(1, true);
        for (r, t) in first.iter().chain([&later]).zip(&single) {
            assert_eq!(t.len(), r.max_new, "{name}");
        }
        for (k, graphs) in [(16, true), (3, true), (16, false)] {
            assert_eq!(
                run(k, graphs),
                single,
                "{name}: {k} steps a launch, graphs {graphs}"
            );
        }
    }
}

#[test]
fn an_end_token_stops_a_sequence() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let dec = Arc::new(Decoder::from_weights(&s, &weights(GPT2, 5), Dtype::F32).unwrap());
    let r = request(20, 5, 12, SamplingParams::greedy());
    let free = generation(&mut s, &dec, 1, true)
        .generate(&s, std::slice::from_ref(&r), 4)
        .unwrap()
        .remove(0);
    // The third token generated becomes the end token: the sequence stops there.
    let eos = free[2];
    let first = free.iter().position(|&t| t == eos).unwrap();
    let mut o = GenerationOptions::new(1, 30);
    o.eos = vec![eos];
    o.seed = 5;
    let mut g = Generation::new(&mut s, dec.clone(), o).unwrap();
    let stopped = g
        .generate(&s, std::slice::from_ref(&r), 4)
        .unwrap()
        .remove(0);
    assert_eq!(stopped, free[..=first].to_vec());
}

#[test]
fn misuse_is_a_typed_error() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let dec = Arc::new(Decoder::from_weights(&s, &weights(LLAMA, 6), Dtype::F32).unwrap());
    let bad_opts = [
        GenerationOptions::new(0, 8),
        GenerationOptions::new(2, 0),
        GenerationOptions::new(2, 65), // the model has 64 positions
        GenerationOptions {
            buckets: vec![3],
            ..GenerationOptions::new(2, 8)
        },
        GenerationOptions {
            eos: vec![VOCAB as i32],
            ..GenerationOptions::new(2, 8)
        },
        GenerationOptions {
            eos: vec![1, 2, 3, 4, 5],
            ..GenerationOptions::new(2, 8)
        },
        GenerationOptions {
            steps_per_launch: 0,
            ..GenerationOptions::new(2, 8)
        },
    ];
    for o in bad_opts {
        let what = format!("{o:?}");
        assert!(
            Generation::new(&mut s, dec.clone(), o).is_err(),
            "{what} was accepted"
        );
    }
    let mut g = generation(&mut s, &dec, 2, true);
    let greedy = SamplingParams::greedy();
    let bad_requests = [
        request(1, 0, 4, greedy),
        request(1, 4, 0, greedy),
        request(1, 25, 6, greedy), // 31 positions for 30
        Request {
            prompt: vec![1, VOCAB as i32],
            max_new: 2,
            sampling: greedy,
        },
        Request {
            prompt: vec![1, -1],
            max_new: 2,
            sampling: greedy,
        },
        request(
            1,
            3,
            3,
            SamplingParams {
                temperature: -1.0,
                top_k: 0,
                top_p: 1.0,
            },
        ),
    ];
    for r in bad_requests {
        let what = format!("{r:?}");
        assert!(g.join(&s, &[r]).is_err(), "{what} was accepted");
    }
    assert_eq!(g.free_slots(), 2, "a refused request takes no slot");
    let three = vec![request(1, 3, 3, greedy); 3];
    assert!(g.join(&s, &three).is_err(), "three requests for two slots");
    assert_eq!(g.free_slots(), 2);
    assert!(g.leave(&s, 2).is_err());
    // After all that, a good request still runs.
    let out = g.generate(&s, &[request(1, 3, 3, greedy)], 2).unwrap();
    assert_eq!(out[0].len(), 3);
}
