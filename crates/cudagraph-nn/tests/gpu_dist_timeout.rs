//! Two-GPU test: a rank that stalls (alive, but never joins the collective) makes the other
//! rank's watchdog time out, abort the communicator and return a timeout error, instead of
//! hanging. Its own binary: after an abort the device may still be draining the aborted
//! collective. Gate: `dist::multi_gpu_or_skip(2)` (see `gpu_dist.rs`).
//!
//! The stall comes before rank 0's first training step, so rank 0's host blocks inside that
//! step: loading the optimizer's kernels waits for the device, where the gradients'
//! all-reduce waits for rank 1. Only the communicator's own watching thread can end that
//! (docs/multi-gpu.md, "Failures").

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{with_deadline, Trainer};
use cudagraph_nn::dist::{self, run_threads, DistError, DistOptions, RankContext};
use cudagraph_nn::NnError;

/// How long the stalled rank stays stalled at most.
const STALL: Duration = Duration::from_secs(60);

#[test]
#[ignore = "needs 2 GPUs and NCCL: run with --include-ignored (bash bench/device.sh ddp)"]
fn a_stalled_rank_makes_the_other_time_out_and_abort() {
    if !dist::multi_gpu_or_skip(2) {
        return;
    }
    let waited: Arc<Mutex<Option<Duration>>> = Arc::default();
    let w = waited.clone();
    let err = with_deadline(90, move || {
        let opts = DistOptions {
            timeout: Duration::from_secs(3),
            ..DistOptions::default()
        };
        run_threads(&[0, 1], &opts, |ctx: RankContext| {
            let s = ctx.device.new_stream()?;
            let mut t = Trainer::new(&s, &ctx.comm)?;
            if ctx.rank == 1 {
                // Stalled: alive and polling, but never joining the collective, until rank
                // 0's abort reaches it — or a minute passes, and rank 0 hung.
                let t0 = Instant::now();
                while t0.elapsed() < STALL {
                    ctx.comm.check()?;
                    std::thread::sleep(Duration::from_millis(50));
                }
                return Ok(());
            }
            // From the step: the timeout counts from the collective's enqueue.
            let t0 = Instant::now();
            let r = t.step(&s).and_then(|()| t.ddp.synchronize(&s));
            *w.lock().unwrap() = Some(t0.elapsed());
            r
        })
        .map(|_| ())
        .unwrap_err()
    });
    assert!(
        matches!(&err, NnError::Dist(DistError::Timeout { .. })),
        "rank 0's timeout is the root cause: {err}"
    );
    let took = waited.lock().unwrap().expect("rank 0 waited");
    println!("rank 0 timed out after {took:?}: {err}");
    // At least the timeout (the collective is enqueued after the clock starts); the step's
    // first kernels compile meanwhile, so the upper bound is only "before rank 1 gave up".
    assert!(took >= Duration::from_secs(3) && took < STALL, "{took:?}");
}
