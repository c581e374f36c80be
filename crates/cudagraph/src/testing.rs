//! The one gate every GPU test starts with, and the checks GPU tests share.
//!
//! [`gpu_or_skip`] returns the device, or prints `skipped: no CUDA device` and returns `None`
//! so the test can return early. With `CUDAGRAPH_REQUIRE_GPU=1` (set by the GPU test runner) a
//! missing device is a failure instead: a GPU test that skipped is not a GPU test that passed.
//! Every other missing prerequisite (NVRTC, a fixture file, a second GPU) goes through
//! [`skip_or_fail`], which follows the same rule. [`assert_bits_eq`] is the comparison of
//! results documented as bit-identical (a graph replay against the eager run of the same
//! kernels): bits, not a tolerance, with the first differing index in the message.
//!
//! The variables these helpers read are named in [`crate::env`]; a value they cannot use
//! fails the test that reads it, naming the variable.

use crate::env;
use crate::Device;

/// Name of the variable that turns a missing GPU into a test failure ([`env::REQUIRE_GPU`]).
pub use crate::env::REQUIRE_GPU as REQUIRE_GPU_VAR;

/// Whether a missing GPU must fail the test ([`env::REQUIRE_GPU`]).
///
/// # Panics
/// When the variable is set to something other than an on/off switch.
#[track_caller]
pub fn gpu_required() -> bool {
    flag(env::REQUIRE_GPU)
}

/// Whether the test switch `var` is on (off when unset).
///
/// # Panics
/// When `var` is set to something other than an on/off switch (a test helper fails the test
/// rather than guess).
#[track_caller]
fn flag(var: &'static str) -> bool {
    env::switch(var, false).unwrap_or_else(|e| panic!("{e}"))
}

/// Device 0, or `None` (after printing why) when there is none and the GPU is not required.
///
/// # Panics
/// When no device can be opened and `CUDAGRAPH_REQUIRE_GPU=1`.
#[track_caller]
pub fn gpu_or_skip() -> Option<Device> {
    keep_context();
    match Device::open(0) {
        Ok(d) => Some(d),
        Err(e) => {
            skip_or_fail(format_args!("no CUDA device ({e})"));
            None
        }
    }
}

/// Says why a test does not run: prints `skipped: REASON`, so the test can return — or, with
/// `CUDAGRAPH_REQUIRE_GPU=1` (the GPU runner), panics with the reason, because there a
/// missing prerequisite (NVRTC, a fixture file, a second GPU) is a failure, not a pass.
///
/// ```no_run
/// # let nvrtc_found = false;
/// if !nvrtc_found {
///     return cudagraph::testing::skip_or_fail("NVRTC is not installed here");
/// }
/// ```
///
/// # Panics
/// When `CUDAGRAPH_REQUIRE_GPU=1`.
#[track_caller]
pub fn skip_or_fail(reason: impl std::fmt::Display) {
    let required = gpu_required().then(|| format!("{REQUIRE_GPU_VAR}=1"));
    skip_or_fail_when(required.as_deref(), &reason.to_string());
}

/// Skips with `reason`, or panics when `required_by` names the setting that requires it.
#[track_caller]
fn skip_or_fail_when(required_by: Option<&str>, reason: &str) {
    if let Some(setting) = required_by {
        panic!("{setting}, so a missing prerequisite fails the test: {reason}");
    }
    println!("skipped: {reason}");
}

/// Name of the variable that makes multi-GPU tests fail, instead of skipping, when fewer GPUs
/// are there ([`env::REQUIRE_GPUS`]): `CUDAGRAPH_REQUIRE_GPUS=2` on a two-GPU machine (the same
/// variable as the NN crate's distributed tests read).
pub use crate::env::REQUIRE_GPUS as REQUIRE_GPUS_VAR;

/// Devices `0..n`, or `None` (after printing why) when fewer can be opened. Fails instead when
/// `CUDAGRAPH_REQUIRE_GPU=1` or `CUDAGRAPH_REQUIRE_GPUS` is `n` or more.
///
/// # Panics
/// When fewer than `n` devices can be opened and either variable requires them.
#[track_caller]
pub fn gpus_or_skip(n: usize) -> Option<Vec<Device>> {
    keep_context();
    let mut devices = Vec::with_capacity(n);
    for ordinal in 0..n {
        match Device::open(ordinal) {
            Ok(d) => devices.push(d),
            Err(e) => {
                let required = if gpu_required() {
                    Some(format!("{REQUIRE_GPU_VAR}=1"))
                } else {
                    let want = gpus_required();
                    (want >= n).then(|| format!("{REQUIRE_GPUS_VAR}={want}"))
                };
                skip_or_fail_when(
                    required.as_deref(),
                    &format!("needs {n} GPUs, device {ordinal} could not be opened ({e})"),
                );
                return None;
            }
        }
    }
    Some(devices)
}

/// How many GPUs `CUDAGRAPH_REQUIRE_GPUS` requires (0 when unset or empty).
///
/// # Panics
/// When the variable is set to something other than a whole number.
#[track_caller]
fn gpus_required() -> usize {
    env::count(env::REQUIRE_GPUS)
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or(0)
}

/// The first index at which `got` and `want` differ bit for bit (`f32::to_bits`: the sign of
/// a zero and a NaN's payload count), or the shorter length when only the lengths differ;
/// `None` when they are identical.
pub fn first_bit_difference(got: &[f32], want: &[f32]) -> Option<usize> {
    got.iter()
        .zip(want)
        .position(|(g, w)| g.to_bits() != w.to_bits())
        .or_else(|| (got.len() != want.len()).then(|| got.len().min(want.len())))
}

/// Asserts that `got` equals `want` bit for bit: the comparison for results documented as
/// bit-identical (a graph replay against the eager run of the same kernels, a run against a
/// repeat of itself). A tolerance there would hide a replay that ran other kernels.
///
/// ```
/// cudagraph::testing::assert_bits_eq(&[1.0, -0.0], &[1.0, -0.0], "replay vs eager");
/// ```
///
/// # Panics
/// When the lengths or any element's bits differ; the message names `what`, the first
/// differing index with both values and their bits, and how many elements differ.
#[track_caller]
pub fn assert_bits_eq(got: &[f32], want: &[f32], what: impl std::fmt::Display) {
    let Some(i) = first_bit_difference(got, want) else {
        return;
    };
    if got.len() != want.len() {
        panic!(
            "{what}: not bit-identical: {} elements against {} expected",
            got.len(),
            want.len()
        );
    }
    let differ = got
        .iter()
        .zip(want)
        .filter(|(g, w)| g.to_bits() != w.to_bits())
        .count();
    let (g, w) = (got[i], want[i]);
    panic!(
        "{what}: not bit-identical: {differ} of {} elements differ, the first at index {i}: \
         {g:e} ({:#010x}) against {w:e} ({:#010x})",
        got.len(),
        g.to_bits(),
        w.to_bits()
    );
}

/// Name of the variable that keeps device 0's primary context retained for the whole test
/// process (`CUDAGRAPH_TEST_KEEP_CONTEXT=1`, [`env::TEST_KEEP_CONTEXT`]). Without it every test
/// that drops its last `Device` destroys the context and the next test creates a new one, as a
/// process that opens and closes the device would. Only the context is kept: the library's
/// per-device state (allocator, library handles) still goes with the last `Device`.
pub use crate::env::TEST_KEEP_CONTEXT as KEEP_CONTEXT_VAR;

fn keep_context() {
    use std::sync::OnceLock;
    static KEPT: OnceLock<Option<crate::runtime::Context>> = OnceLock::new();
    KEPT.get_or_init(|| {
        flag(env::TEST_KEEP_CONTEXT)
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

/// Name of the variable that asks GPU tests for fewer iterations ([`env::TEST_QUICK`], set by
/// `bench/sanitize.sh`: under compute-sanitizer every launch costs milliseconds).
pub use crate::env::TEST_QUICK as QUICK_VAR;

/// `quick` when `CUDAGRAPH_TEST_QUICK=1`, else `full`: the iteration count of a loop whose
/// length adds time but no coverage under instrumentation.
///
/// # Panics
/// When the variable is set to something other than an on/off switch.
#[track_caller]
pub fn iterations(full: usize, quick: usize) -> usize {
    if flag(env::TEST_QUICK) {
        quick
    } else {
        full
    }
}

/// Name of the variable that makes [`settle`] synchronise the device ([`env::TEST_SETTLE`]; an
/// experiment for runs under compute-sanitizer, whose reports inside WHILE bodies using memory
/// allocated just before or during the capture go away, in NVIDIA/warp#1406, with a
/// synchronisation in between).
pub use crate::env::TEST_SETTLE as SETTLE_VAR;

/// Synchronises `device` when `CUDAGRAPH_TEST_SETTLE=1` (or `true`); otherwise does nothing.
/// Tests call it between setting up buffers and capturing, and between capturing and replaying.
///
/// # Panics
/// When the synchronisation fails (the device reported an error), or the variable is set to
/// something other than an on/off switch.
#[track_caller]
pub fn settle(device: &Device) {
    if flag(env::TEST_SETTLE) {
        device.synchronize().expect("device synchronisation");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_slices_pass_and_the_first_difference_is_found() {
        assert_eq!(
            first_bit_difference(&[1.0, f32::NAN], &[1.0, f32::NAN]),
            None
        );
        assert_bits_eq(&[1.0, f32::NAN, -0.0], &[1.0, f32::NAN, -0.0], "same");
        // The sign of zero counts, and so does the last ulp.
        assert_eq!(first_bit_difference(&[1.0, 0.0], &[1.0, -0.0]), Some(1));
        let next = f32::from_bits(1.0f32.to_bits() + 1);
        assert_eq!(
            first_bit_difference(&[2.0, 1.0, 3.0], &[2.0, next, 4.0]),
            Some(1)
        );
        // A length mismatch is a difference at the end of the shorter slice.
        assert_eq!(first_bit_difference(&[1.0], &[1.0, 2.0]), Some(1));
        assert_eq!(first_bit_difference(&[], &[5.0]), Some(0));
    }

    #[test]
    #[should_panic(
        expected = "replay vs eager: not bit-identical: 2 of 3 elements differ, the first at index 1"
    )]
    fn a_bit_difference_names_the_first_index_and_the_count() {
        assert_bits_eq(&[1.0, 0.0, 2.0], &[1.0, -0.0, 3.0], "replay vs eager");
    }

    #[test]
    #[should_panic(expected = "out: not bit-identical: 2 elements against 3 expected")]
    fn a_shorter_result_is_not_bit_identical() {
        assert_bits_eq(&[1.0, 2.0], &[1.0, 2.0, 3.0], "out");
    }

    #[test]
    fn a_missing_prerequisite_skips_unless_required() {
        skip_or_fail_when(None, "NVRTC is not installed here");
    }

    #[test]
    #[should_panic(
        expected = "CUDAGRAPH_REQUIRE_GPU=1, so a missing prerequisite fails the test: fixtures"
    )]
    fn a_missing_prerequisite_fails_when_required() {
        skip_or_fail_when(Some("CUDAGRAPH_REQUIRE_GPU=1"), "fixtures are missing");
    }
}
