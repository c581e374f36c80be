//! Device segments from `cuMemAlloc`, for the device's allocator.

use std::sync::Arc;

use super::caching::SegmentSource;
use crate::error::{Error, Result};
use crate::runtime::context::ContextHandle;
use crate::runtime::memory;

pub(crate) struct DeviceSource {
    pub(crate) ctx: Arc<ContextHandle>,
    /// The device's memory: a larger request is refused without asking the driver.
    pub(crate) total: usize,
}

impl SegmentSource for DeviceSource {
    fn allocate(&self, bytes: usize) -> Result<u64> {
        if bytes > self.total {
            return Err(Error::OutOfMemory {
                requested: bytes,
                reserved: 0,
            });
        }
        self.ctx.bind()?;
        memory::mem_alloc(bytes).map_err(|e| {
            if e.is_out_of_memory() {
                Error::OutOfMemory {
                    requested: bytes,
                    reserved: 0,
                }
            } else {
                e
            }
        })
    }

    fn release(&self, addr: u64, _bytes: usize) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the allocator releases a segment once, after `synchronize` returned and with
        // no block of it handed out, so no work can still use it.
        unsafe { memory::mem_free(addr) }
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx.synchronize()
    }
}
