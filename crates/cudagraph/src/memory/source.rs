//! Device segments from `cuMemAlloc`, for the device's allocator.

use std::sync::Arc;

use super::caching::SegmentSource;
use crate::error::{Error, Result};
use crate::runtime::context::ContextHandle;
use crate::runtime::memory;

/// `CUDAGRAPH_TRACE_SEGMENTS=1` prints every segment taken from and returned to the driver
/// (to match addresses in compute-sanitizer reports against the allocator's segments).
fn trace_segments() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("CUDAGRAPH_TRACE_SEGMENTS").is_ok_and(|v| v == "1"))
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
        if trace_segments() {
            eprintln!("cudagraph: segment alloc {addr:#x} {bytes} bytes");
        }
        Ok(addr)
    }

    fn release(&self, addr: u64, bytes: usize) -> Result<()> {
        self.ctx.bind()?;
        if trace_segments() {
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
