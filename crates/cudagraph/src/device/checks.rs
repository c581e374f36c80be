//! Device-side checks. Kernels cannot return errors, and inside a graph nothing reads their
//! results back, so a kernel that finds an invalid value (an index outside its range) clamps
//! the access, and raises the device's error flag: a few words of host-mapped memory that the
//! next synchronisation reads (no copy, no extra launch) and reports as
//! [`Error::DeviceCheck`].

use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::runtime::memory::MappedWords;

/// Words of the flag: [raised, check id, value (2 words), bound (2), position (2)].
pub(crate) const WORDS: usize = 8;

/// CUDA source for kernels that report failed checks: prepend it and pass
/// [`crate::Device::check_flag_arg`] as an `unsigned int*` parameter. The first failure wins.
pub const DEVICE_CHECK_CUDA: &str = r#"
__device__ __forceinline__ void cg_report(unsigned int* flag, unsigned int check,
        long long value, long long bound, unsigned long long position) {
    if (flag != 0 && atomicCAS_system(flag, 0u, 1u) == 0u) {
        flag[1] = check;
        flag[2] = (unsigned int)value; flag[3] = (unsigned int)((unsigned long long)value >> 32);
        flag[4] = (unsigned int)bound; flag[5] = (unsigned int)((unsigned long long)bound >> 32);
        flag[6] = (unsigned int)position; flag[7] = (unsigned int)(position >> 32);
        __threadfence_system();
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

/// Reads and clears the flag.
pub(crate) fn take(flag: &MappedWords) -> Result<()> {
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
