//! Host-memory segment source for CPU tests of the allocator ([`HostSource`]), and the byte
//! views of plain element slices. Device memory comes from `source.rs`; the bookkeeping over
//! either source is in `caching`.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::BTreeMap;
use std::sync::Mutex;

use super::caching::SegmentSource;
use crate::error::{Error, Result};

pub(super) fn bytes_of<'a>(ptr: *const u8, n: usize) -> &'a [u8] {
    // SAFETY: only called by `Elem::as_bytes` with the pointer and byte length of a live slice
    // of plain numbers (no padding, every byte initialised); the lifetime is the slice's.
    unsafe { std::slice::from_raw_parts(ptr, n) }
}

pub(super) fn bytes_of_mut<'a>(ptr: *mut u8, n: usize) -> &'a mut [u8] {
    // SAFETY: as above, from a unique borrow; every bit pattern is a valid plain number.
    unsafe { std::slice::from_raw_parts_mut(ptr, n) }
}

/// Segments from real host memory, with an optional capacity to provoke out-of-memory.
/// Tests write through [`HostSource::fill`] and read through [`HostSource::verify`] to prove
/// that blocks handed out never overlap. Both check the range against the live segments and
/// hold the source's lock while they touch memory, so a concurrent release cannot free it
/// under them.
#[derive(Debug, Default)]
pub struct HostSource {
    capacity: Option<usize>,
    live: Mutex<BTreeMap<u64, usize>>,
}

const ALIGN: usize = 512;

impl HostSource {
    /// A source with no capacity limit.
    pub fn new() -> Self {
        Self::default()
    }

    /// A source that fails with `OutOfMemory` beyond `capacity` live bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            capacity: Some(capacity),
            live: Mutex::new(BTreeMap::new()),
        }
    }

    /// Bytes currently obtained from the host.
    pub fn live_bytes(&self) -> usize {
        self.live.lock().unwrap().values().sum()
    }

    /// Number of regions currently obtained from the host.
    pub fn live_segments(&self) -> usize {
        self.live.lock().unwrap().len()
    }

    /// Locks the live map and checks that `addr..addr + len` lies inside one live region; the
    /// returned guard keeps the region from being released while the caller touches it.
    fn lock_range(
        &self,
        what: &'static str,
        addr: u64,
        len: usize,
    ) -> Result<std::sync::MutexGuard<'_, BTreeMap<u64, usize>>> {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let out_of_range = || Error::OutOfRange {
            what,
            start: addr as usize,
            end: (addr as usize).saturating_add(len),
            len: 0,
        };
        let end = u64::try_from(len)
            .ok()
            .and_then(|l| addr.checked_add(l))
            .ok_or_else(out_of_range)?;
        let inside = live
            .range(..=addr)
            .next_back()
            .is_some_and(|(&base, &size)| base.checked_add(size as u64).is_some_and(|e| end <= e));
        if !inside {
            return Err(out_of_range());
        }
        Ok(live)
    }

    /// Writes `byte` into `len` bytes at `addr`. [`Error::OutOfRange`] unless the range lies
    /// inside one live region (a range whose end wraps around the address space does not).
    pub fn fill(&self, addr: u64, len: usize, byte: u8) -> Result<()> {
        let _live = self.lock_range("host segment fill", addr, len)?;
        // SAFETY: the range lies inside a region this source allocated, which cannot be
        // released while `_live` (the lock `release` takes) is held.
        unsafe { std::ptr::write_bytes(addr as *mut u8, byte, len) };
        Ok(())
    }

    /// Whether all `len` bytes at `addr` equal `byte`. [`Error::OutOfRange`] unless the range
    /// lies inside one live region.
    pub fn verify(&self, addr: u64, len: usize, byte: u8) -> Result<bool> {
        let _live = self.lock_range("host segment verify", addr, len)?;
        // SAFETY: as in `fill` (the lock is held until the slice is gone); the bytes were
        // initialised by alloc_zeroed or `fill`, and only `fill` writes them, under the lock.
        let s = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
        Ok(s.iter().all(|&b| b == byte))
    }
}

// SAFETY: every segment is a fresh `alloc_zeroed` region of at least `bytes` bytes, aligned to
// 512, owned by this source until `release` (or drop) deallocates it; regions never overlap.
// It is host memory: allocators over it are made with `Allocator::new`, whose blocks no device
// accepts.
unsafe impl SegmentSource for HostSource {
    fn allocate(&self, bytes: usize) -> Result<u64> {
        let mut live = self.live.lock().unwrap();
        let used: usize = live.values().sum();
        if self
            .capacity
            .is_some_and(|c| used.checked_add(bytes).is_none_or(|total| total > c))
        {
            return Err(Error::OutOfMemory {
                requested: bytes,
                reserved: used,
            });
        }
        let layout =
            Layout::from_size_align(bytes.max(1), ALIGN).map_err(|_| Error::OutOfMemory {
                requested: bytes,
                reserved: used,
            })?;
        // SAFETY: layout has non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        if p.is_null() {
            return Err(Error::OutOfMemory {
                requested: bytes,
                reserved: used,
            });
        }
        live.insert(p as u64, bytes);
        Ok(p as u64)
    }

    fn release(&self, addr: u64, bytes: usize) -> Result<()> {
        let mut live = self.live.lock().unwrap();
        let size = live.remove(&addr);
        assert_eq!(
            size,
            Some(bytes),
            "release of a region this source did not hand out"
        );
        let layout = Layout::from_size_align(bytes.max(1), ALIGN).expect("valid at allocation");
        // SAFETY: addr came from alloc_zeroed with this layout and is released once (removed
        // from `live` above).
        unsafe { dealloc(addr as *mut u8, layout) };
        Ok(())
    }
}

impl Drop for HostSource {
    fn drop(&mut self) {
        let live = std::mem::take(&mut *self.live.lock().unwrap());
        for (addr, bytes) in live {
            let layout = Layout::from_size_align(bytes.max(1), ALIGN).expect("valid");
            // SAFETY: regions still live at drop were allocated by us and never released.
            unsafe { dealloc(addr as *mut u8, layout) };
        }
    }
}
