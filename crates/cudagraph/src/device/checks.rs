//! Device-side checks. Kernels cannot return errors, and inside a graph nothing reads their
//! results back, so a kernel that finds an invalid value (an index outside its range) clamps
//! the access and reports it into a [`CheckRecord`]: a few words of host-mapped memory, which
//! the next synchronisation of the stream that ran the work reads — no copy, no extra launch —
//! and returns as [`Error::DeviceCheck`].
//!
//! **One record per queue.** Every eager stream has its own record, created when a kernel
//! first asks for it ([`crate::Queue::check_flag_arg`]); a capture gives its graph a record of
//! its own, and every replay hands that record to the stream it ran on. So a stream's
//! `synchronize` reports the failures of the work it ran, never another thread's, and
//! [`crate::Device::synchronize`] reports any record's.
//!
//! **No lost reports.** A report is written under a seqlock: the writer (one at a time per
//! device, through a spin lock in device memory that it takes and releases itself) bumps the
//! sequence word to odd, writes the report, bumps it to even. The host takes a report when the
//! sequence differs from the one it last took, and marks it taken by storing that sequence
//! (`seen`): nothing on the device is re-armed, so a failure right after a report was taken is
//! reported at the next synchronisation. Kernels skip writing while a report is waiting to be
//! taken, so a launch in which a million threads fail writes one report, not a million.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::runtime::memory::MappedWords;
use crate::runtime::primary::ContextHandle;

/// Words of a record: [seq, seen, check id, value (2), bound (2), position (2), pad,
/// lock pointer (2)].
pub(crate) const WORDS: usize = 12;
const SEQ: usize = 0;
const SEEN: usize = 1;
const LOCK: usize = 10;

/// Bytes of the device lock word the writers of every record of a device share.
pub(crate) const LOCK_BYTES: usize = 16;

/// CUDA source for kernels that report failed checks: prepend it and pass
/// [`crate::Queue::check_flag_arg`] as a `cg_check*` parameter.
pub const DEVICE_CHECK_CUDA: &str = r#"
struct cg_check {
    unsigned int seq; unsigned int seen; unsigned int check;
    unsigned int value[2]; unsigned int bound[2]; unsigned int position[2];
    unsigned int pad; unsigned int* lock;
};
__device__ __forceinline__ void cg_report(cg_check* chk, unsigned int check,
        long long value, long long bound, unsigned long long position) {
    if (chk == 0) return;
    volatile cg_check* c = (volatile cg_check*)chk;
    // A report is waiting to be taken: it says that a check failed; do not overwrite it.
    if (c->seq != c->seen) return;
    unsigned int* lock = chk->lock;
    for (unsigned int spin = 0; spin < (1u << 24); ++spin) {
        if (atomicCAS(lock, 0u, 1u) == 0u) {
            __threadfence();
            unsigned int s = c->seq;
            if (s == c->seen) {
                c->seq = s + 1u;
                __threadfence_system();
                c->check = check;
                c->value[0] = (unsigned int)value;
                c->value[1] = (unsigned int)((unsigned long long)value >> 32);
                c->bound[0] = (unsigned int)bound;
                c->bound[1] = (unsigned int)((unsigned long long)bound >> 32);
                c->position[0] = (unsigned int)position;
                c->position[1] = (unsigned int)(position >> 32);
                __threadfence_system();
                c->seq = s + 2u;
                __threadfence_system();
            }
            atomicExch(lock, 0u);
            return;
        }
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 700)
        __nanosleep(32);
#endif
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

/// The words of a record as the host sees them (mapped memory on a device; plain atomics in
/// the CPU tests).
pub(crate) trait Words {
    fn load(&self, i: usize) -> u32;
    fn store(&self, i: usize, v: u32);
}

impl Words for MappedWords {
    fn load(&self, i: usize) -> u32 {
        MappedWords::load(self, i)
    }
    fn store(&self, i: usize, v: u32) {
        MappedWords::store(self, i, v)
    }
}

impl Words for [AtomicU32] {
    fn load(&self, i: usize) -> u32 {
        self[i].load(Ordering::Acquire)
    }
    fn store(&self, i: usize, v: u32) {
        self[i].store(v, Ordering::Release)
    }
}

/// Takes the report waiting in `w`, if any, and marks it taken. A writer caught half-way
/// (work of another stream that shares the record still running) is waited out briefly; the
/// report is read again until two reads of the sequence agree.
pub(crate) fn take<W: Words + ?Sized>(w: &W) -> Result<()> {
    let mut last = None;
    for _ in 0..1 << 16 {
        let seq = w.load(SEQ);
        if seq == w.load(SEEN) {
            return Ok(());
        }
        if seq & 1 == 1 {
            std::hint::spin_loop();
            continue;
        }
        let wide = |i: usize| w.load(i) as u64 | (w.load(i + 1) as u64) << 32;
        let err = Error::DeviceCheck {
            check: name_of(w.load(2)),
            value: wide(3) as i64,
            bound: wide(5) as i64,
            position: wide(7),
        };
        if w.load(SEQ) == seq {
            w.store(SEEN, seq);
            return Err(err);
        }
        last = Some(err);
    }
    // A writer that never finishes cannot happen (it holds no lock the host waits for);
    // report what was read rather than nothing.
    last.map_or(Ok(()), Err)
}

/// One queue's check record: host-mapped words kernels report into (see the module docs).
pub(crate) struct CheckRecord {
    words: MappedWords,
}

impl CheckRecord {
    /// A record whose writers take the device's lock word at `lock`.
    pub(crate) fn new(ctx: &std::sync::Arc<ContextHandle>, lock: u64) -> Result<Self> {
        let words = MappedWords::new(WORDS, ctx)?;
        words.store(LOCK, lock as u32);
        words.store(LOCK + 1, (lock >> 32) as u32);
        Ok(Self { words })
    }

    /// The address kernels take as their `cg_check*`.
    pub(crate) fn device_addr(&self) -> u64 {
        self.words.device_addr()
    }

    /// Takes the waiting report, if any.
    pub(crate) fn take(&self) -> Result<()> {
        take(&self.words)
    }
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

    fn words() -> Vec<AtomicU32> {
        (0..WORDS).map(|_| AtomicU32::new(0)).collect()
    }

    /// What `cg_report` does, on the host.
    fn report(w: &[AtomicU32], check: u32, value: i64) {
        let s = w.load(SEQ);
        if s != w.load(SEEN) {
            return;
        }
        w.store(SEQ, s + 1);
        w.store(2, check);
        w.store(3, value as u32);
        w.store(4, (value as u64 >> 32) as u32);
        w.store(SEQ, s + 2);
    }

    #[test]
    fn a_report_is_taken_once_and_the_next_failure_is_reported_without_rearming() {
        let w = words();
        let id = register_check("test check seq");
        assert!(take(&w[..]).is_ok());
        report(&w, id, -5);
        match take(&w[..]) {
            Err(Error::DeviceCheck { check, value, .. }) => {
                assert_eq!(check, "test check seq");
                assert_eq!(value, -5);
            }
            other => panic!("{other:?}"),
        }
        assert!(take(&w[..]).is_ok(), "taken once");
        // Nothing is re-armed: the next failure is written and reported.
        report(&w, id, 7);
        assert!(matches!(
            take(&w[..]),
            Err(Error::DeviceCheck { value: 7, .. })
        ));
        assert!(take(&w[..]).is_ok());
    }

    #[test]
    fn a_waiting_report_is_not_overwritten() {
        let w = words();
        let id = register_check("test check first");
        report(&w, id, 1);
        report(&w, id, 2);
        assert!(matches!(
            take(&w[..]),
            Err(Error::DeviceCheck { value: 1, .. })
        ));
    }

    #[test]
    fn sequences_wrap_around() {
        let w = words();
        w.store(SEQ, u32::MAX - 1);
        w.store(SEEN, u32::MAX - 1);
        let id = register_check("test check wrap");
        let report_wrapping = |v: i64| {
            let s = w.load(SEQ);
            w.store(SEQ, s.wrapping_add(1));
            w.store(3, v as u32);
            w.store(2, id);
            w.store(SEQ, s.wrapping_add(2));
        };
        report_wrapping(3);
        assert!(matches!(
            take(&w[..]),
            Err(Error::DeviceCheck { value: 3, .. })
        ));
        assert!(take(&w[..]).is_ok());
    }
}
