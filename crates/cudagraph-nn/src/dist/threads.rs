//! The single-process mode: one thread per device, each with its own rank of one NCCL
//! communicator — for quick use on one machine (tests, notebooks, benchmarks) without
//! launching processes. Production jobs use one process per GPU (`cudagraph launch`,
//! `torchrun`), which isolates failures better.

use std::panic::AssertUnwindSafe;

use cudagraph::Device;

use super::communicator::Communicator;
use super::{DistError, DistOptions};
use crate::error::{NnError, Result};

/// What each rank's closure gets in [`run_threads`].
#[derive(Clone, Debug)]
pub struct RankContext {
    /// This thread's rank, in `0..world_size`.
    pub rank: usize,
    /// Number of ranks (threads).
    pub world_size: usize,
    /// The GPU this rank drives.
    pub device: Device,
    /// This rank's communicator.
    pub comm: Communicator,
}

/// Opens the devices `ordinals` (rank `i` on `ordinals[i]`), makes one communicator over
/// them, and runs `f` on one thread per rank. Returns every rank's result in rank order, or
/// the error that started the trouble: when a rank fails (error or panic) its communicator
/// is aborted, and the others fail at their next wait instead of hanging.
pub fn run_threads<T, F>(ordinals: &[usize], opts: &DistOptions, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(RankContext) -> Result<T> + Sync,
{
    let devices = ordinals
        .iter()
        .map(|&o| Device::open(o))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let comms = Communicator::init_threads(&devices, opts)?;
    let world = devices.len();
    let f = &f;
    let results: Vec<Result<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = devices
            .into_iter()
            .zip(comms)
            .enumerate()
            .map(|(rank, (device, comm))| {
                scope.spawn(move || {
                    let ctx = RankContext {
                        rank,
                        world_size: world,
                        device,
                        comm: comm.clone(),
                    };
                    let out = match std::panic::catch_unwind(AssertUnwindSafe(|| f(ctx))) {
                        Ok(r) => r,
                        Err(_) => Err(DistError::Usage(format!("rank {rank} panicked")).into()),
                    };
                    if let Err(e) = &out {
                        comm.abort(&e.to_string());
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(DistError::Usage(format!("rank {rank} panicked")).into())
                })
            })
            .collect()
    });
    // Prefer the error that is not a consequence of another rank's failure.
    let consequence = |e: &NnError| {
        matches!(
            e,
            NnError::Dist(DistError::PeerFailed(_) | DistError::Aborted { .. })
        )
    };
    let (mut root, mut other, mut values) = (None, None, Vec::with_capacity(world));
    for r in results {
        match r {
            Ok(v) => values.push(v),
            Err(e) if !consequence(&e) => {
                root.get_or_insert(e);
            }
            Err(e) => {
                other.get_or_insert(e);
            }
        }
    }
    match root.or(other) {
        Some(e) => Err(e),
        None => Ok(values),
    }
}
