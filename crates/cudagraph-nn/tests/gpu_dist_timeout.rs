//! Two-GPU test: a rank that stalls (alive, but never joins the collective) makes the other
//! rank's watchdog time out, abort the communicator and return a timeout error, instead of
//! hanging. Its own binary: after an abort the device may still be draining the aborted
//! collective. Gate: `dist::multi_gpu_or_skip(2)` (see `gpu_dist.rs`).
//!
//! Known to hang on two H200s (the runner stops it): the stall comes before rank 0's first
//! training step, and rank 0 blocks before its watchdog runs. NCCL's lazy connection setup
//! (2.22+) was the first suspect, but with `NCCL_RUNTIME_CONNECT=0` it hangs the same, and
//! `with_deadline` does not end it either; see docs/multi-gpu.md.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{with_deadline, Trainer};
use cudagraph_nn::dist::{self, run_threads, DistError, DistOptions, RankContext};
use cudagraph_nn::NnError;

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
                // Stalled: no collective, no error, for longer than rank 0's timeout.
                std::thread::sleep(Duration::from_secs(8));
                ctx.comm.check()?; // by now rank 0 has aborted
                return Ok(());
            }
            t.step(&s)?;
            let t0 = Instant::now();
            let r = t.ddp.synchronize(&s);
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
    assert!(
        took >= Duration::from_secs(3) && took < Duration::from_secs(8),
        "{took:?}"
    );
}
