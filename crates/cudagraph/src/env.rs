//! Every environment variable this crate reads, named once with what it does, and the one
//! parser for their values: switches take `1`, `true`, `yes`, `on` or `0`, `false`, `no`,
//! `off` (any case; unset or empty means the default), and anything else is
//! [`Error::InvalidEnv`] naming the variable. No other module of the crate reads a
//! `CUDAGRAPH_*` variable itself.
//!
//! This module sits at the bottom of the crate with [`crate::error`] and [`crate::ids`] and
//! imports nothing above them. The NN crate's switches are its own (`cudagraph_nn::env`).

use std::ffi::OsString;
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// Where compiled kernels (PTX) are cached on disk: a directory, or `off` for no disk cache.
/// Unset: `$XDG_CACHE_HOME/cudagraph`, else `~/.cache/cudagraph` (see
/// [`crate::runtime::nvrtc::cache_dir`]).
pub const CACHE_DIR: &str = "CUDAGRAPH_CACHE_DIR";

/// Switch, on by default: device-to-device copies between 16-byte aligned addresses (up to
/// 64 MiB) and copies to and from mapped page-locked staging (up to 2 MiB) run as a kernel
/// instead of the driver's copy. `0` gives every copy to the driver (see
/// [`crate::MAX_KERNEL_COPY`]). Read once, at the first copy.
pub const COPY_KERNEL: &str = "CUDAGRAPH_COPY_KERNEL";

/// Switch, off by default: print every segment taken from and returned to the driver on
/// stderr, to match addresses in compute-sanitizer reports against the allocator's segments.
/// Read once, at the first segment.
pub const TRACE_SEGMENTS: &str = "CUDAGRAPH_TRACE_SEGMENTS";

/// Switch, off by default: a GPU test that finds no device (or another missing prerequisite)
/// fails instead of printing `skipped: …` (set by the GPU test runner; see
/// [`crate::testing::gpu_or_skip`]).
pub const REQUIRE_GPU: &str = "CUDAGRAPH_REQUIRE_GPU";

/// A number of GPUs: multi-GPU tests that need that many or fewer fail, instead of skipping,
/// when fewer devices open (`CUDAGRAPH_REQUIRE_GPUS=2` on a two-GPU machine; the NN crate's
/// distributed tests read the same variable). Unset or empty: 0.
pub const REQUIRE_GPUS: &str = "CUDAGRAPH_REQUIRE_GPUS";

/// Switch, off by default: the test gate keeps device 0's primary context retained for the
/// whole test process, so tests do not each create and destroy it (only the context is kept:
/// a `Device`'s allocator and library handles still go with its last handle).
pub const TEST_KEEP_CONTEXT: &str = "CUDAGRAPH_TEST_KEEP_CONTEXT";

/// Switch, off by default: GPU tests run fewer iterations of loops whose length adds time but
/// no coverage (set by `bench/sanitize.sh`: under compute-sanitizer every launch costs
/// milliseconds; see [`crate::testing::iterations`]).
pub const TEST_QUICK: &str = "CUDAGRAPH_TEST_QUICK";

/// Switch, off by default: [`crate::testing::settle`] synchronises the device between a test's
/// setup, capture and replay (an experiment for runs under compute-sanitizer).
pub const TEST_SETTLE: &str = "CUDAGRAPH_TEST_SETTLE";

/// What a switch accepts, for [`Error::InvalidEnv`].
const SWITCH_VALUES: &str = "an on/off switch: 1, true, yes or on; 0, false, no or off; unset \
                             or empty for the default";

/// Parses `value`, the value of switch `var` (see the module docs); `default` when it is empty.
///
/// ```
/// use cudagraph::env::{parse_switch, COPY_KERNEL};
/// assert!(!parse_switch(COPY_KERNEL, " Off ", true).unwrap());
/// assert!(parse_switch(COPY_KERNEL, "", true).unwrap());
/// assert!(parse_switch(COPY_KERNEL, "maybe", true).is_err());
/// ```
pub fn parse_switch(var: &'static str, value: &str, default: bool) -> Result<bool> {
    parse_switch_value(value, default).map_err(|value| invalid(var, value, SWITCH_VALUES))
}

/// The switch `var` as set in the environment now; `default` when it is unset or empty.
pub fn switch(var: &'static str, default: bool) -> Result<bool> {
    match std::env::var_os(var) {
        None => Ok(default),
        Some(v) => parse_switch(var, &v.to_string_lossy(), default),
    }
}

/// The count `var` as set in the environment now: `None` when it is unset or empty.
pub fn count(var: &'static str) -> Result<Option<usize>> {
    let Some(v) = std::env::var_os(var) else {
        return Ok(None);
    };
    let v = v.to_string_lossy();
    match v.trim() {
        "" => Ok(None),
        t => t
            .parse()
            .map(Some)
            .map_err(|_| invalid(var, v.into_owned(), "a whole number")),
    }
}

/// The raw value of `var` (a path, say), unset as `None`; not interpreted here.
pub fn value(var: &'static str) -> Option<OsString> {
    std::env::var_os(var)
}

/// A switch read from the environment once, at its first use, and remembered for the life of
/// the process (for switches asked on hot paths).
pub(crate) struct CachedSwitch {
    var: &'static str,
    default: bool,
    /// The parsed value, or the value that is not a switch.
    value: OnceLock<std::result::Result<bool, String>>,
}

impl CachedSwitch {
    /// Switch `var` with its default (nothing is read until [`Self::get`]).
    pub(crate) const fn new(var: &'static str, default: bool) -> Self {
        Self {
            var,
            default,
            value: OnceLock::new(),
        }
    }

    /// The switch's value, read on the first call.
    pub(crate) fn get(&self) -> Result<bool> {
        let parsed = self.value.get_or_init(|| match std::env::var_os(self.var) {
            None => Ok(self.default),
            Some(v) => parse_switch_value(&v.to_string_lossy(), self.default),
        });
        match parsed {
            Ok(on) => Ok(*on),
            Err(value) => Err(invalid(self.var, value.clone(), SWITCH_VALUES)),
        }
    }
}

/// The switch value `value`, or the value itself when it is not one.
fn parse_switch_value(value: &str, default: bool) -> std::result::Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "" => Ok(default),
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(value.to_string()),
    }
}

fn invalid(var: &'static str, value: String, expected: &'static str) -> Error {
    Error::InvalidEnv {
        var,
        value,
        expected,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_take_the_usual_spellings_and_refuse_others() {
        for v in ["1", "on", "TRUE", " yes "] {
            assert!(parse_switch(COPY_KERNEL, v, false).unwrap());
        }
        for v in ["0", "Off", "false", "no"] {
            assert!(!parse_switch(COPY_KERNEL, v, true).unwrap());
        }
        assert!(parse_switch(COPY_KERNEL, "", true).unwrap());
        assert!(!parse_switch(COPY_KERNEL, " ", false).unwrap());
        let e = parse_switch(COPY_KERNEL, "maybe", true).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("CUDAGRAPH_COPY_KERNEL=\"maybe\"") && msg.contains("on/off switch"),
            "{msg}"
        );
        assert!(matches!(
            e,
            Error::InvalidEnv {
                var: COPY_KERNEL,
                ..
            }
        ));
    }
}
