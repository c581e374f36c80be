//! Device-side checks. Kernels cannot return errors, and inside a graph nothing reads their
//! results back, so a kernel that finds an invalid value (an index outside its range) clamps
//! the access and reports it: the first failing thread claims a word in device memory (a
//! device-scope atomic) and writes the report into a few words of host-mapped memory with
//! plain stores (system-scope atomics on host memory are not available over PCIe), which the
//! next synchronisation reads — no copy, no extra launch — and returns as
//! [`Error::DeviceCheck`]. Taking a report re-arms the claim word.

use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::runtime::memory::MappedWords;

/// Words of the host report: [raised, check id, value (2 words), bound (2), position (2)].
pub(crate) const WORDS: usize = 8;

/// Bytes of the device record: `struct cg_check { unsigned claim, pad; unsigned* host; }`.
pub(crate) const RECORD_BYTES: usize = 16;

/// CUDA source for kernels that report failed checks: prepend it and pass
/// [`crate::Device::check_flag_arg`] as a `cg_check*` parameter. The first failure wins.
pub const DEVICE_CHECK_CUDA: &str = r#"
struct cg_check { unsigned int claim; unsigned int pad; volatile unsigned int* host; };
__device__ __forceinline__ void cg_report(cg_check* chk, unsigned int check,
        long long value, long long bound, unsigned long long position) {
    if (chk != 0 && atomicCAS(&chk->claim, 0u, 1u) == 0u) {
        volatile unsigned int* h = chk->host;
        h[1] = check;
        h[2] = (unsigned int)value; h[3] = (unsigned int)((unsigned long long)value >> 32);
        h[4] = (unsigned int)bound; h[5] = (unsigned int)((unsigned long long)bound >> 32);
        h[6] = (unsigned int)position; h[7] = (unsigned int)(position >> 32);
        __threadfence_system();
        h[0] = 1u;
    }
}
"#;

static NAMES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

/// The id kernels pass to `cg_report` for a check called `name` (what the error message
/// calls it, e.g. "cross_entropy target"). The same name always gets the same id.
pub fn register_check(name: &'static str) -> u32 {
    let mut n = NAMES.lock().unwrap_or_else(|p| p.into_inner());
    match n.iter().position(|x| *x == name) {
        Some(i) => i as u32 + 1,
        None => {
            n.push(name);
            n.len() as u32
        }
    }
}

fn name_of(id: u32) -> &'static str {
    let n = NAMES.lock().unwrap_or_else(|p| p.into_inner());
    id.checked_sub(1)
        .and_then(|i| n.get(i as usize).copied())
        .unwrap_or("device-side check")
}

/// Reads and clears the host report; `rearm` then resets the device claim word (only called
/// when a report was taken). Returns the report as an error.
pub(crate) fn take(flag: &MappedWords, rearm: impl FnOnce() -> Result<()>) -> Result<()> {
    if flag.load(0) == 0 {
        return Ok(());
    }
    let wide = |i: usize| flag.load(i) as u64 | (flag.load(i + 1) as u64) << 32;
    let err = Error::DeviceCheck {
        check: name_of(flag.load(1)),
        value: wide(2) as i64,
        bound: wide(4) as i64,
        position: wide(6),
    };
    for i in 1..WORDS {
        flag.store(i, 0);
    }
    flag.store(0, 0);
    rearm()?;
    Err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_names_get_stable_ids() {
        let a = register_check("test check a");
        let b = register_check("test check b");
        assert_ne!(a, b);
        assert_eq!(register_check("test check a"), a);
        assert_eq!(name_of(b), "test check b");
        assert_eq!(name_of(0), "device-side check");
        assert_eq!(name_of(u32::MAX), "device-side check");
    }
}
