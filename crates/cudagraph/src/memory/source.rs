//! Device segments from `cuMemAlloc`, for the device's allocator: the [`SegmentSource`] every
//! [`crate::Device`] allocates through, releasing only while it holds the context's capture
//! gate. When to allocate or release is decided by the bookkeeping in `caching`; host memory
//! for tests comes from `host.rs`.

use std::sync::Arc;

use super::caching::SegmentSource;
use crate::env::{self, CachedSwitch};
use crate::error::{Error, Result};
use crate::runtime::memory;
use crate::runtime::primary::ContextHandle;

/// Whether every segment taken from and returned to the driver is printed
/// ([`env::TRACE_SEGMENTS`]); an error when the variable is not a switch.
fn trace_segments() -> Result<bool> {
    static ON: CachedSwitch = CachedSwitch::new(env::TRACE_SEGMENTS, false);
    ON.get()
}

pub(crate) struct DeviceSource {
    pub(crate) ctx: Arc<ContextHandle>,
    /// The device's memory: a larger request is refused without asking the driver.
    pub(crate) total: usize,
}

// SAFETY: every segment is a fresh cuMemAlloc of device memory in this device's primary
// context (aligned to at least 256 bytes by the driver), freed only by `release`;
// `synchronize` is a context synchronisation (run inside `exclusive`, which holds the
// context's capture gate, so no capture of the context is open meanwhile).
unsafe impl SegmentSource for DeviceSource {
    fn allocate(&self, bytes: usize) -> Result<u64> {
        if bytes > self.total {
            return Err(Error::OutOfMemory {
                requested: bytes,
                reserved: 0,
            });
        }
        // Read before the driver is asked, so a variable that is not a switch fails here
        // without taking a segment.
        let trace = trace_segments()?;
        self.ctx.bind()?;
        let addr = memory::mem_alloc(bytes).map_err(|e| {
            if e.is_out_of_memory() {
                Error::OutOfMemory {
                    requested: bytes,
                    reserved: 0,
                }
            } else {
                e
            }
        })?;
        if trace {
            eprintln!("cudagraph: segment alloc {addr:#x} {bytes} bytes");
        }
        Ok(addr)
    }

    fn release(&self, addr: u64, bytes: usize) -> Result<()> {
        self.ctx.bind()?;
        // Every segment released was allocated, and allocating read the switch: an invalid
        // value was reported there.
        if trace_segments().unwrap_or(false) {
            eprintln!("cudagraph: segment free {addr:#x} {bytes} bytes");
        }
        // SAFETY: the allocator releases a segment once, after `synchronize` returned and with
        // no block of it handed out, so no work can still use it.
        unsafe { memory::mem_free(addr) }
    }

    fn synchronize(&self) -> Result<()> {
        // Called only inside `exclusive`, which holds the context's gate.
        self.ctx.synchronize_quiet()
    }

    fn may_release(&self) -> bool {
        !self.ctx.gate().capturing()
    }

    fn exclusive(&self, wait: bool, release: &mut dyn FnMut()) -> bool {
        let gate = self.ctx.gate();
        let quiet = match wait {
            true => gate.wait_quiet("releasing device memory").ok(),
            false => gate.try_quiet(),
        };
        match quiet {
            Some(_quiet) => {
                release();
                true
            }
            None => false,
        }
    }
}
