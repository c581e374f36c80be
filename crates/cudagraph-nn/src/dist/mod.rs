//! Data-parallel training on several GPUs with NCCL: one process per GPU (launched like
//! `torchrun`: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), or one thread
//! per GPU in a single process for quick use.
//!
//! - [`DistEnv`] reads PyTorch's launch variables; [`DistOptions`] the timeouts.
//! - [`rendezvous`]: rank 0 listens on `MASTER_ADDR:MASTER_PORT`, the others connect (std TCP,
//!   timeouts everywhere) and receive the NCCL unique id; the connections stay open as a
//!   liveness channel, so a rank that dies is noticed by the others at once, on one machine or
//!   across machines.
//! - [`Communicator`] (in `nccl`): an NCCL communicator on one device — in-place all-reduce
//!   and broadcast on any [`cudagraph::Queue`] (eager or inside a capture; `unsafe`, because
//!   NCCL trusts every rank to pass the same counts), safe agreement checks and a barrier
//!   whose counts agree by construction, and a watchdog wait that turns a dead peer, an NCCL
//!   error or a timeout into an error (aborting the communicator) instead of a hang.
//! - [`DistributedDataParallel`]: gradients in buckets, each all-reduced on a communication
//!   stream as soon as its gradients are ready, overlapping the rest of the backward pass —
//!   eagerly, or captured with the whole step into one graph per rank.
//!
//! NCCL is loaded at run time (cudarc, dynamic loading): building needs no NCCL, and a
//! machine without it gets one [`DistError::NcclMissing`] naming what was tried.
//! `CUDAGRAPH_NCCL_LIB` may point at the library (e.g. a `libnccl.so.2` inside a Python
//! environment).

mod communicator;
mod ddp;
pub mod rendezvous;
mod threads;

use std::time::Duration;

pub use communicator::{Communicator, NcclElem, ReduceOp};
pub use ddp::{plan_buckets, BucketInfo, DdpOptions, DistributedDataParallel};
pub use rendezvous::{Health, Membership, PeerMonitor};
pub use threads::{run_threads, RankContext};

use crate::env::{
    self, DIST_TIMEOUT_VAR, HEARTBEAT_TIMEOUT_VAR, RDZV_TIMEOUT_VAR, REQUIRE_GPUS_VAR,
};
pub use crate::error::DistError;
pub use crate::ffi::nccl::nccl_version;

/// The variables `torchrun` (and `cudagraph launch`) set for each process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    /// This process's rank in `0..world_size` (`RANK`).
    pub rank: usize,
    /// Number of processes (`WORLD_SIZE`).
    pub world_size: usize,
    /// Rank on this machine, which is also the CUDA device to use (`LOCAL_RANK`; defaults to
    /// `RANK`).
    pub local_rank: usize,
    /// Host name or address of rank 0 (`MASTER_ADDR`).
    pub master_addr: String,
    /// Port rank 0 listens on for the rendezvous (`MASTER_PORT`).
    pub master_port: u16,
}

impl DistEnv {
    /// Reads the launch variables from the process environment. `Ok(None)` when neither
    /// `RANK` nor `WORLD_SIZE` is set (not launched for distributed work).
    pub fn from_env() -> Result<Option<Self>, DistError> {
        Self::from_lookup(env::var)
    }

    /// [`Self::from_env`] over any variable lookup (tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, DistError> {
        let (rank, world) = (get("RANK"), get("WORLD_SIZE"));
        if rank.is_none() && world.is_none() {
            return Ok(None);
        }
        let num = |var: &'static str, v: Option<String>| -> Result<usize, DistError> {
            let v = v.ok_or_else(|| DistError::Env {
                var,
                problem: "not set (RANK and WORLD_SIZE go together)".into(),
            })?;
            v.trim().parse::<usize>().map_err(|_| DistError::Env {
                var,
                problem: format!("`{v}` is not a non-negative integer"),
            })
        };
        let world_size = num("WORLD_SIZE", world)?;
        let rank = num("RANK", rank)?;
        if world_size == 0 {
            return Err(DistError::Env {
                var: "WORLD_SIZE",
                problem: "must be at least 1".into(),
            });
        }
        if rank >= world_size {
            return Err(DistError::Env {
                var: "RANK",
                problem: format!("{rank} is not below WORLD_SIZE={world_size}"),
            });
        }
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => num("LOCAL_RANK", Some(v))?,
            None => rank,
        };
        // One process needs no rendezvous: the address only matters for two or more.
        let need = world_size > 1;
        let master_addr = match get("MASTER_ADDR") {
            Some(a) if !a.trim().is_empty() => a.trim().to_string(),
            _ if need => {
                return Err(DistError::Env {
                    var: "MASTER_ADDR",
                    problem: "not set: the host rank 0 runs on (127.0.0.1 on one machine)".into(),
                })
            }
            _ => "127.0.0.1".into(),
        };
        let master_port = match get("MASTER_PORT") {
            Some(p) => match p.trim().parse::<u16>() {
                Ok(port) if port > 0 => port,
                _ => {
                    return Err(DistError::Env {
                        var: "MASTER_PORT",
                        problem: format!("`{p}` is not a port number in 1..=65535"),
                    })
                }
            },
            None if need => {
                return Err(DistError::Env {
                    var: "MASTER_PORT",
                    problem: "not set: a free TCP port on rank 0's host (e.g. 29500)".into(),
                })
            }
            None => 29500,
        };
        Ok(Some(DistEnv {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        }))
    }

    /// A single process (rank 0 of 1): no rendezvous, no peers.
    pub fn single() -> Self {
        DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
        }
    }
}

/// Timeouts of distributed work. `from_env` reads overrides in seconds from
/// `CUDAGRAPH_RDZV_TIMEOUT`, `CUDAGRAPH_DIST_TIMEOUT` and `CUDAGRAPH_HEARTBEAT_TIMEOUT`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DistOptions {
    /// How long the rendezvous may take: rank 0 waits this long for every rank to connect,
    /// the others keep retrying to reach rank 0 this long (default 120 s).
    pub rendezvous_timeout: Duration,
    /// How long NCCL initialisation, any one wait for queued collectives, and any eager
    /// collective from its enqueue to its end may take before the communicator is aborted
    /// (default 300 s, like a patient `torchrun` job; lower it to notice a hung peer sooner,
    /// raise it when ranks may reach a collective that far apart).
    pub timeout: Duration,
    /// A peer whose connection has been silent this long (no heartbeat: its host or network
    /// is down) counts as failed (default 30 s; heartbeats go out every second).
    pub heartbeat_timeout: Duration,
}

impl Default for DistOptions {
    fn default() -> Self {
        DistOptions {
            rendezvous_timeout: Duration::from_secs(120),
            timeout: Duration::from_secs(300),
            heartbeat_timeout: Duration::from_secs(30),
        }
    }
}

impl DistOptions {
    /// Defaults, overridden by the environment variables named on the type.
    pub fn from_env() -> Result<Self, DistError> {
        Self::from_lookup(env::var)
    }

    /// [`Self::from_env`] over any variable lookup (tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, DistError> {
        let mut o = DistOptions::default();
        let secs = |var: &'static str, default: Duration| -> Result<Duration, DistError> {
            match get(var) {
                None => Ok(default),
                Some(v) => match v.trim().parse::<f64>() {
                    Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
                    _ => Err(DistError::Env {
                        var,
                        problem: format!("`{v}` is not a positive number of seconds"),
                    }),
                },
            }
        };
        o.rendezvous_timeout = secs(RDZV_TIMEOUT_VAR, o.rendezvous_timeout)?;
        o.timeout = secs(DIST_TIMEOUT_VAR, o.timeout)?;
        o.heartbeat_timeout = secs(HEARTBEAT_TIMEOUT_VAR, o.heartbeat_timeout)?;
        Ok(o)
    }
}

/// Whether `CUDAGRAPH_REQUIRE_GPUS` asks for `n` GPUs or more.
fn gpus_required(n: usize) -> bool {
    env::var(REQUIRE_GPUS_VAR)
        .and_then(|v| v.trim().parse::<usize>().ok())
        .is_some_and(|r| r >= n)
}

/// What a test gate does with `problem` (none: run the test): skip with a message, or fail
/// (`Err`, the panic message) when `required_by` names the variable that requires it.
fn gate(problem: Option<String>, required_by: Option<&str>) -> std::result::Result<bool, String> {
    match (problem, required_by) {
        (None, _) => Ok(true),
        (Some(p), Some(var)) => Err(format!("{var} is set, so this must not skip: {p}")),
        (Some(p), None) => {
            println!("skipped: {p}");
            Ok(false)
        }
    }
}

/// The gate of multi-GPU tests: true when `n` devices and NCCL are available; otherwise prints
/// why the test is skipped and returns false — or panics (fails the test) when
/// `CUDAGRAPH_REQUIRE_GPUS` is `n` or more, and, for a missing NCCL on a machine that has the
/// GPUs, also when `CUDAGRAPH_REQUIRE_GPU=1` (the GPU test runner's switch).
pub fn multi_gpu_or_skip(n: usize) -> bool {
    let (problem, nccl) = match cudagraph::runtime::device_count() {
        Ok(c) if c < n => (Some(format!("needs {n} GPUs, found {c}")), false),
        Err(e) => (Some(format!("needs {n} GPUs: {e}")), false),
        Ok(_) => (nccl_version().err().map(|e| e.to_string()), true),
    };
    let required_by = if gpus_required(n) {
        Some(REQUIRE_GPUS_VAR)
    } else if nccl && cudagraph::testing::gpu_required() {
        Some(cudagraph::testing::REQUIRE_GPU_VAR)
    } else {
        None
    };
    gate(problem, required_by).unwrap_or_else(|m| panic!("{m}"))
}

/// The gate of one-GPU tests that need NCCL (after the device gate): true when NCCL loads;
/// otherwise prints why the test is skipped and returns false — or panics (fails the test)
/// under `CUDAGRAPH_REQUIRE_GPU=1` or `CUDAGRAPH_REQUIRE_GPUS`: a GPU run that requires its
/// tests must not count a missing NCCL as a pass.
pub fn nccl_or_skip() -> bool {
    let required_by = if cudagraph::testing::gpu_required() {
        Some(cudagraph::testing::REQUIRE_GPU_VAR)
    } else if gpus_required(1) {
        Some(REQUIRE_GPUS_VAR)
    } else {
        None
    };
    gate(nccl_version().err().map(|e| e.to_string()), required_by).unwrap_or_else(|m| panic!("{m}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn no_launch_variables_means_not_distributed() {
        assert_eq!(DistEnv::from_lookup(env(&[])).unwrap(), None);
    }

    #[test]
    fn torchrun_variables_are_read() {
        let e = DistEnv::from_lookup(env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", " node0.example "),
            ("MASTER_PORT", "29511"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            DistEnv {
                rank: 3,
                world_size: 4,
                local_rank: 1,
                master_addr: "node0.example".into(),
                master_port: 29511
            }
        );
    }

    #[test]
    fn local_rank_defaults_to_rank_and_one_process_needs_no_address() {
        let e = DistEnv::from_lookup(env(&[("RANK", "0"), ("WORLD_SIZE", "1")]))
            .unwrap()
            .unwrap();
        assert_eq!((e.local_rank, e.world_size), (0, 1));
    }

    #[test]
    fn bad_launch_variables_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("RANK", "0")], "WORLD_SIZE"),
            (&[("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "2"), ("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE"),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")],
                "MASTER_ADDR",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
                "MASTER_PORT",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "70000"),
                ],
                "MASTER_PORT",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "-1"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "5"),
                ],
                "LOCAL_RANK",
            ),
        ];
        for (vars, name) in cases {
            match DistEnv::from_lookup(env(vars)) {
                Err(DistError::Env { var, .. }) => assert_eq!(var, *name, "{vars:?}"),
                other => panic!("{vars:?}: expected an error about {name}, got {other:?}"),
            }
        }
    }

    /// (issue 26, item 7) A missing NCCL skips the test only when nothing requires it.
    #[test]
    fn the_gate_skips_only_when_nothing_requires_the_test() {
        assert_eq!(gate(None, None), Ok(true));
        assert_eq!(gate(None, Some("CUDAGRAPH_REQUIRE_GPU")), Ok(true));
        assert_eq!(gate(Some("no NCCL".into()), None), Ok(false));
        let e = gate(Some("no NCCL".into()), Some("CUDAGRAPH_REQUIRE_GPU")).unwrap_err();
        assert!(
            e.contains("CUDAGRAPH_REQUIRE_GPU") && e.contains("no NCCL"),
            "{e}"
        );
    }

    #[test]
    fn timeouts_come_from_the_environment() {
        let o = DistOptions::from_lookup(env(&[
            ("CUDAGRAPH_DIST_TIMEOUT", "15"),
            ("CUDAGRAPH_RDZV_TIMEOUT", "2.5"),
        ]))
        .unwrap();
        assert_eq!(o.timeout, Duration::from_secs(15));
        assert_eq!(o.rendezvous_timeout, Duration::from_millis(2500));
        assert_eq!(
            o.heartbeat_timeout,
            DistOptions::default().heartbeat_timeout
        );
        for bad in ["0", "-3", "soon", "inf"] {
            assert!(matches!(
                DistOptions::from_lookup(env(&[("CUDAGRAPH_DIST_TIMEOUT", bad)])),
                Err(DistError::Env {
                    var: "CUDAGRAPH_DIST_TIMEOUT",
                    ..
                })
            ));
        }
    }
}
