//! Two-GPU test: a rank that fails mid-training makes the other rank fail within seconds
//! (its failure is shared with the peers), not hang in a collective that will never complete.
//! Its own binary: after an abort the device may still be draining the aborted collective.
//! Gate: `dist::multi_gpu_or_skip(2)` (see `gpu_dist.rs`).

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{with_deadline, Trainer};
use cudagraph_nn::dist::{self, run_threads, DistError, DistOptions, RankContext};
use cudagraph_nn::NnError;

#[test]
#[ignore = "needs 2 GPUs and NCCL: run with --include-ignored (bash bench/device.sh ddp)"]
fn a_rank_that_fails_mid_training_makes_the_other_fail_within_seconds() {
    if !dist::multi_gpu_or_skip(2) {
        return;
    }
    let waited: Arc<Mutex<Option<(Duration, String)>>> = Arc::default();
    let w = waited.clone();
    let err = with_deadline(90, move || {
        let opts = DistOptions {
            timeout: Duration::from_secs(60),
            ..DistOptions::default()
        };
        run_threads(&[0, 1], &opts, |ctx: RankContext| {
            let s = ctx.device.new_stream()?;
            let mut t = Trainer::new(&s, &ctx.comm)?;
            for k in 0..6 {
                if ctx.rank == 1 && k == 3 {
                    // Give rank 0 time to enter step 3, whose all-reduce then has no partner.
                    std::thread::sleep(Duration::from_secs(1));
                    return Err(
                        DistError::Usage("injected failure on rank 1 at step 3".into()).into(),
                    );
                }
                let t0 = Instant::now();
                let r = t.step(&s).and_then(|()| t.ddp.synchronize(&s));
                if let Err(e) = r {
                    *w.lock().unwrap() = Some((t0.elapsed(), format!("step {k}: {e:?}")));
                    return Err(e);
                }
            }
            Ok(())
        })
        .map(|_| ())
        .unwrap_err()
    });
    assert!(
        matches!(&err, NnError::Dist(DistError::Usage(m)) if m.contains("injected")),
        "the root cause comes back: {err}"
    );
    let (took, rank0) = waited.lock().unwrap().clone().expect("rank 0 waited");
    println!("rank 0 failed after {took:?}: {rank0}");
    assert!(
        rank0.contains("PeerFailed") && rank0.contains("injected"),
        "{rank0}"
    );
    assert!(rank0.starts_with("step 3"), "{rank0}");
    assert!(
        took < Duration::from_secs(10),
        "rank 0 took {took:?} (timeout 60 s)"
    );
}
