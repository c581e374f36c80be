//! [`Exec`]: an object-safe view of a [`cudagraph::Queue`], so model code and autograd closures
//! can take `&dyn Exec` and run unchanged on an eager stream or inside a capture.

use std::sync::Arc;

use cudagraph::memory::BlockRef;
use cudagraph::runtime::StreamHandle;
use cudagraph::{Arg, Device, DeviceBuffer, Function, LaunchConfig, Queue};

use crate::error::Result;

/// Where NN work goes: an eager `Stream` or a `CaptureStream` (both implement it).
pub trait Exec {
    fn device(&self) -> &Device;
    fn stream(&self) -> &StreamHandle;
    fn alloc_f32(&self, len: usize) -> Result<DeviceBuffer<f32>>;
    fn alloc_i32(&self, len: usize) -> Result<DeviceBuffer<i32>>;
    fn launch(&self, f: &Function, cfg: LaunchConfig, args: &[Arg<'_>]) -> Result<()>;
    fn zero(&self, b: &DeviceBuffer<f32>) -> Result<()>;
    fn fill(&self, b: &DeviceBuffer<f32>, v: f32) -> Result<()>;
    fn copy(&self, src: &DeviceBuffer<f32>, dst: &DeviceBuffer<f32>) -> Result<()>;
    fn copy_range(
        &self,
        src: &DeviceBuffer<f32>,
        src_offset: usize,
        dst: &DeviceBuffer<f32>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()>;
    fn hold(&self, b: &Arc<BlockRef>);
    fn capture_id(&self) -> Option<u64>;
}

impl<Q: Queue> Exec for Q {
    fn device(&self) -> &Device {
        Queue::device(self)
    }
    fn stream(&self) -> &StreamHandle {
        self.stream_handle()
    }
    fn alloc_f32(&self, len: usize) -> Result<DeviceBuffer<f32>> {
        Ok(self.alloc(len)?)
    }
    fn alloc_i32(&self, len: usize) -> Result<DeviceBuffer<i32>> {
        Ok(self.alloc(len)?)
    }
    fn launch(&self, f: &Function, cfg: LaunchConfig, args: &[Arg<'_>]) -> Result<()> {
        Ok(Queue::launch(self, f, cfg, args)?)
    }
    fn zero(&self, b: &DeviceBuffer<f32>) -> Result<()> {
        Ok(self.memset_zero(b)?)
    }
    fn fill(&self, b: &DeviceBuffer<f32>, v: f32) -> Result<()> {
        Ok(self.fill32(b, 0, b.len(), v)?)
    }
    fn copy(&self, src: &DeviceBuffer<f32>, dst: &DeviceBuffer<f32>) -> Result<()> {
        Ok(Queue::copy(self, src, dst)?)
    }
    fn copy_range(
        &self,
        src: &DeviceBuffer<f32>,
        src_offset: usize,
        dst: &DeviceBuffer<f32>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        Ok(Queue::copy_range(
            self, src, src_offset, dst, dst_offset, len,
        )?)
    }
    fn hold(&self, b: &Arc<BlockRef>) {
        Queue::hold(self, b)
    }
    fn capture_id(&self) -> Option<u64> {
        Queue::capture_id(self)
    }
}
