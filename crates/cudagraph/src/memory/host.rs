//! Host-memory segment source for CPU tests of the allocator, and the byte views of plain
//! element slices. The only `unsafe` in the memory layer lives here.

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
/// that blocks handed out never overlap.
#[derive(Debug, Default)]
pub struct HostSource {
    capacity: Option<usize>,
    live: Mutex<BTreeMap<u64, usize>>,
}

const ALIGN: usize = 512;

impl HostSource {
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

    fn check_range(&self, addr: u64, len: usize) -> bool {
        let live = self.live.lock().unwrap();
        live.range(..=addr)
            .next_back()
            .is_some_and(|(&base, &size)| addr + len as u64 <= base + size as u64)
    }

    /// Writes `byte` into `len` bytes at `addr`. Panics unless the range lies in a live region.
    pub fn fill(&self, addr: u64, len: usize, byte: u8) {
        assert!(
            self.check_range(addr, len),
            "fill outside live host segments"
        );
        // SAFETY: the range lies inside a region this source allocated and has not released.
        unsafe { std::ptr::write_bytes(addr as *mut u8, byte, len) }
    }

    /// Whether all `len` bytes at `addr` equal `byte`. Panics unless the range is live.
    pub fn verify(&self, addr: u64, len: usize, byte: u8) -> bool {
        assert!(
            self.check_range(addr, len),
            "verify outside live host segments"
        );
        // SAFETY: as in `fill`; the bytes were initialised by alloc_zeroed or `fill`.
        let s = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
        s.iter().all(|&b| b == byte)
    }
}

impl SegmentSource for HostSource {
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
