//! The one gate every GPU test starts with.
//!
//! [`gpu_or_skip`] returns the device, or prints `skipped: no CUDA device` and returns `None`
//! so the test can return early. With `CUDAGRAPH_REQUIRE_GPU=1` (set by the GPU test runner) a
//! missing device is a failure instead: a GPU test that skipped is not a GPU test that passed.

use crate::Device;

/// Name of the variable that turns a missing GPU into a test failure.
pub const REQUIRE_GPU_VAR: &str = "CUDAGRAPH_REQUIRE_GPU";

/// Whether a missing GPU must fail the test.
pub fn gpu_required() -> bool {
    flag(REQUIRE_GPU_VAR)
}

/// Whether the test switch `var` is on (`1` or `true`).
fn flag(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// Device 0, or `None` (after printing why) when there is none and the GPU is not required.
///
/// # Panics
/// When no device can be opened and `CUDAGRAPH_REQUIRE_GPU=1`.
pub fn gpu_or_skip() -> Option<Device> {
    keep_context();
    match Device::open(0) {
        Ok(d) => Some(d),
        Err(e) if gpu_required() => {
            panic!("{REQUIRE_GPU_VAR}=1 but no CUDA device could be opened: {e}")
        }
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            None
        }
    }
}

/// Name of the variable that keeps device 0's primary context retained for the whole test
/// process (`CUDAGRAPH_TEST_KEEP_CONTEXT=1`). Without it every test that drops its last
/// `Device` destroys the context and the next test creates a new one, as a process that opens
/// and closes the device would. Only the context is kept: the library's per-device state
/// (allocator, library handles) still goes with the last `Device`.
pub const KEEP_CONTEXT_VAR: &str = "CUDAGRAPH_TEST_KEEP_CONTEXT";

fn keep_context() {
    use std::sync::OnceLock;
    static KEPT: OnceLock<Option<crate::runtime::Context>> = OnceLock::new();
    KEPT.get_or_init(|| {
        flag(KEEP_CONTEXT_VAR)
            .then(|| crate::runtime::Context::open(0).ok())
            .flatten()
    });
}

/// Runs `f` with the gate: `let Some(dev) = gpu_or_skip() else { return };` in one call.
#[macro_export]
macro_rules! gpu_test_device {
    () => {
        match $crate::testing::gpu_or_skip() {
            Some(d) => d,
            None => return,
        }
    };
}

/// Name of the variable that asks GPU tests for fewer iterations (set by `bench/sanitize.sh`:
/// under compute-sanitizer every launch costs milliseconds).
pub const QUICK_VAR: &str = "CUDAGRAPH_TEST_QUICK";

/// `quick` when `CUDAGRAPH_TEST_QUICK=1`, else `full`: the iteration count of a loop whose
/// length adds time but no coverage under instrumentation.
pub fn iterations(full: usize, quick: usize) -> usize {
    if flag(QUICK_VAR) {
        quick
    } else {
        full
    }
}

/// Name of the variable that makes [`settle`] synchronise the device (an experiment for runs
/// under compute-sanitizer, whose reports inside WHILE bodies using memory allocated just before
/// or during the capture go away, in NVIDIA/warp#1406, with a synchronisation in between).
pub const SETTLE_VAR: &str = "CUDAGRAPH_TEST_SETTLE";

/// Synchronises `device` when `CUDAGRAPH_TEST_SETTLE=1` (or `true`); otherwise does nothing. Tests call it
/// between setting up buffers and capturing, and between capturing and replaying.
///
/// # Panics
/// When the synchronisation fails (the device reported an error).
pub fn settle(device: &Device) {
    if flag(SETTLE_VAR) {
        device.synchronize().expect("device synchronisation");
    }
}
