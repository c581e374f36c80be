//! GPU tests of `Engines::tune_graph`, which times a captured graph with the close alternatives
//! of its products' engines: two chained bf16 products of eight rows (the shapes of a decode
//! step, where our few-row kernels and cuBLASLt measure close) are measured eagerly, then
//! tuned. Checked: every change names an engine the registry measured for the key, of another
//! kind, within `TUNE_WITHIN` of the measured choice; every key with such an alternative is
//! recorded as tuned and a second tuning tries nothing; the graph with the kept engines
//! replays equal to the eager products bit for bit; a failing `work` is its error, and work
//! that uses no registry key is no trial.

use cudagraph::memory::bf16;
use cudagraph::{gpu_test_device, CaptureOptions, DeviceBuffer, Graph, Queue, QueueExt, Stream};
use cudagraph_nn::dtype::Dtype;
use cudagraph_nn::engine::gemm::GemmOp;
use cudagraph_nn::engine::gemm_lowp::key;
use cudagraph_nn::engine::{gemm_lowp, Engines, Entry, TUNE_WITHIN};
use cudagraph_nn::{HostRng, Nn, NnError};

fn values(rng: &mut HostRng, n: usize) -> Vec<bf16> {
    rng.vec_normal(n)
        .into_iter()
        .map(|v| bf16::from_f32(0.1 * v))
        .collect()
}

fn bits(s: &Stream, b: &DeviceBuffer<bf16>) -> Vec<u16> {
    s.to_vec(b).unwrap().iter().map(|v| v.to_bits()).collect()
}

/// The registry's entry for `op` on bf16 (the key with the policy's scope, if any).
fn entry_of(eng: &Engines, op: &GemmOp) -> Entry {
    let k = key(op, Dtype::Bf16, Dtype::Bf16);
    eng.table()
        .into_iter()
        .find(|r| r.key.starts_with(&k))
        .unwrap_or_else(|| panic!("no registry entry for {k}"))
        .entry
}

fn kind(engine: &str) -> &str {
    engine.split(':').next().unwrap_or(engine)
}

fn us_of(e: &Entry, engine: &str) -> Option<f64> {
    e.timings
        .iter()
        .find(|t| t.engine == engine)
        .and_then(|t| t.us)
}

/// Whether a measured engine of another kind is within `TUNE_WITHIN` of the choice.
fn has_alternative(e: &Entry) -> bool {
    let Some(own) = us_of(e, &e.engine) else {
        return false;
    };
    e.timings.iter().any(|t| {
        kind(&t.engine) != kind(&e.engine) && t.us.is_some_and(|us| us <= own * (1.0 + TUNE_WITHIN))
    })
}

#[test]
fn tuning_keeps_measured_engines_and_the_graph_equals_the_eager_products() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let nn = Nn::get(&dev).unwrap();
    let eng = Engines::get(&dev).unwrap();
    // Choices from an earlier run on disk may be tuned already: measure again.
    eng.clear();
    let (m, k, n1, n2) = (8, 768, 2304, 768);
    let (op1, op2) = (GemmOp::linear(m, n1, k), GemmOp::linear(m, n2, n1));
    let mut rng = HostRng::new(5);
    let x = s.alloc_from_host(&values(&mut rng, m * k)).unwrap();
    let w1 = s.alloc_from_host(&values(&mut rng, n1 * k)).unwrap();
    let w2 = s.alloc_from_host(&values(&mut rng, n2 * n1)).unwrap();
    let y1 = s.alloc::<bf16>(m * n1).unwrap();
    let y2 = s.alloc::<bf16>(m * n2).unwrap();
    let work = |q: &dyn Queue, y1: &DeviceBuffer<bf16>, y2: &DeviceBuffer<bf16>| {
        gemm_lowp(q, &nn, &op1, &x, &w1, y1, None)?;
        gemm_lowp(q, &nn, &op2, y1, &w2, y2, None)?;
        Ok::<(), NnError>(())
    };
    work(&s, &y1, &y2).unwrap();
    s.synchronize().unwrap();
    let measured = [entry_of(&eng, &op1), entry_of(&eng, &op2)];
    for e in &measured {
        assert!(e.measured && !e.tuned, "{e:?}");
    }

    let pool = dev.graph_pool_handle();
    let r = eng
        .tune_graph(&mut s, &pool, &mut |q| work(q, &y1, &y2))
        .unwrap();
    let tuned = [entry_of(&eng, &op1), entry_of(&eng, &op2)];
    let expected: usize = measured.iter().filter(|e| has_alternative(e)).count();
    assert_eq!(r.keys, expected, "{r:?}; measured {measured:?}");
    assert!(r.trials >= r.keys && r.changed.len() <= r.keys, "{r:?}");
    if r.trials > 0 {
        assert!(r.before_us > 0.0 && r.after_us > 0.0, "{r:?}");
        assert!(r.after_us <= r.before_us, "{r:?}");
    }
    for (before, after) in measured.iter().zip(&tuned) {
        assert_eq!(after.tuned, has_alternative(before), "{after:?}");
        let own = us_of(before, &before.engine).unwrap();
        if after.engine != before.engine {
            // A changed choice: measured for this key, another kind, within the margin.
            let us = us_of(before, &after.engine).expect("a measured candidate");
            assert_ne!(kind(&after.engine), kind(&before.engine));
            assert!(us <= own * (1.0 + TUNE_WITHIN), "{after:?}");
            assert!(
                r.changed
                    .iter()
                    .any(|c| c.from == before.engine && c.to == after.engine),
                "{r:?}"
            );
        }
    }

    // Tuned keys are not tuned again.
    let again = eng
        .tune_graph(&mut s, &pool, &mut |q| work(q, &y1, &y2))
        .unwrap();
    assert_eq!((again.keys, again.trials), (0, 0), "{again:?}");
    assert!(again.changed.is_empty());

    // The kept engines: eager and captured give the same bits.
    let (y1e, y2e) = (
        s.alloc::<bf16>(m * n1).unwrap(),
        s.alloc::<bf16>(m * n2).unwrap(),
    );
    work(&s, &y1e, &y2e).unwrap();
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        work(cs, &y1, &y2).map_err(Into::into)
    })
    .unwrap();
    g.replay(&s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(
        bits(&s, &y2),
        bits(&s, &y2e),
        "replay vs eager after tuning"
    );
    assert_eq!(bits(&s, &y1), bits(&s, &y1e));

    // Work that fails: its error, and no choice changes.
    let before = eng.table();
    let e = eng
        .tune_graph(&mut s, &pool, &mut |_| {
            Err(NnError::Shape("the work refuses".into()))
        })
        .unwrap_err();
    assert!(e.to_string().contains("the work refuses"), "{e}");
    assert_eq!(eng.table(), before);
    // Work that uses no registry key: nothing to try.
    let z = s.alloc::<f32>(16).unwrap();
    let r = eng
        .tune_graph(&mut s, &pool, &mut |q| Ok(q.memset_zero(&z)?))
        .unwrap();
    assert_eq!((r.keys, r.trials, r.changed.len()), (0, 0, 0), "{r:?}");
    // The stream is usable afterwards.
    assert_eq!(s.to_vec(&z).unwrap(), vec![0.0; 16]);
}
