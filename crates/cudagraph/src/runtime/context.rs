//! The CUDA context of one device (its retained primary context) and the facts read off the
//! device when it is opened. Every runtime owner holds a [`Context`] and binds it before it
//! calls the driver, so objects work from any thread.

use std::collections::HashMap;
use std::fmt;
use std::ptr;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::sys::CUdevice_attribute as Attr;

use super::module::Module;
use super::result::{check, driver_present, driver_version, init, raw_handle};
use crate::error::{Error, Result};

raw_handle!(RawContext, sys::CUcontext);

/// Facts about a device, read once when it is opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor), e.g. (9, 0) for Hopper.
    pub compute_capability: (u32, u32),
    pub multiprocessors: u32,
    pub total_memory: usize,
    pub max_threads_per_block: u32,
    pub max_grid_x: u32,
    pub max_shared_memory_per_block: u32,
    /// Driver's CUDA version, e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
}

impl DeviceInfo {
    /// "12.8"-style rendering of the driver's CUDA version.
    pub fn cuda_version_string(&self) -> String {
        format!(
            "{}.{}",
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        )
    }

    /// The `sm_XY` architecture name NVRTC targets for this device.
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }
}

/// Owns a retained primary context; released when the last owner (a stream, module, buffer
/// or graph may outlive the `Device` value) goes away.
pub(crate) struct ContextHandle {
    pub(crate) raw: RawContext,
    dev: sys::CUdevice,
}

impl Drop for ContextHandle {
    fn drop(&mut self) {
        // SAFETY: called exactly once per successful retain (in `Context::open`).
        unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

impl ContextHandle {
    /// Makes the context current on this thread (if it is not already).
    #[track_caller]
    pub(crate) fn bind(&self) -> Result<()> {
        bind_raw(self.raw)
    }

    /// Waits for all work in the context.
    #[track_caller]
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: no arguments; the context was bound above.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }
}

/// Makes `ctx` current on this thread. Asks the driver which context is current rather than
/// trusting a cache, so code that switches contexts behind our back (other CUDA libraries,
/// cudarc) cannot make us issue work on the wrong device. `cuCtxGetCurrent` is a thread-local
/// read inside the driver.
#[track_caller]
pub(crate) fn bind_raw(ctx: RawContext) -> Result<()> {
    let mut cur = ptr::null_mut();
    // SAFETY: writes one context handle.
    check(unsafe { sys::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
    if cur == ctx.0 {
        return Ok(());
    }
    // SAFETY: ctx is a live primary context retained by its ContextHandle.
    check(unsafe { sys::cuCtxSetCurrent(ctx.0) }, "cuCtxSetCurrent")
}

/// A CUDA context on one device: device facts and a module cache.
/// Cheap to clone; the context lives until the last clone and every object made from it is gone.
#[derive(Clone)]
pub struct Context {
    pub(crate) handle: Arc<ContextHandle>,
    info: Arc<DeviceInfo>,
    pub(super) modules: Arc<Mutex<HashMap<u64, Module>>>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Context({} #{})", self.info.name, self.info.ordinal)
    }
}

/// Number of CUDA devices, or a typed error when no driver can be loaded.
pub fn device_count() -> Result<usize> {
    if !driver_present() {
        return Err(Error::NoDriver {
            detail: "libcuda.so could not be loaded".into(),
        });
    }
    init().map_err(|e| Error::NoDriver {
        detail: e.to_string(),
    })?;
    let mut n = 0;
    // SAFETY: writes one int.
    check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    Ok(n.max(0) as usize)
}

#[track_caller]
fn device_name(dev: sys::CUdevice) -> Result<String> {
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: the driver writes at most `len` bytes including the terminator.
    check(
        unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev) },
        "cuDeviceGetName",
    )?;
    // SAFETY: the buffer is NUL-terminated by the driver (and zero-initialised).
    Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

#[track_caller]
fn device_attribute(dev: sys::CUdevice, attr: Attr) -> Result<u32> {
    let mut v = 0;
    // SAFETY: writes one int.
    check(
        unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) },
        "cuDeviceGetAttribute",
    )?;
    Ok(v.max(0) as u32)
}

impl Context {
    /// Opens device `ordinal` (retaining its primary context, as the runtime API does).
    #[track_caller]
    pub fn open(ordinal: usize) -> Result<Self> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        let mut dev = 0;
        // SAFETY: writes one CUdevice; the ordinal was checked against the count.
        check(
            unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) },
            "cuDeviceGet",
        )?;
        let mut raw = ptr::null_mut();
        // SAFETY: writes one context handle; balanced by the release in ContextHandle::drop.
        check(
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut raw, dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        let handle = Arc::new(ContextHandle {
            raw: RawContext(raw),
            dev,
        });
        handle.bind()?;
        let mut total = 0;
        // SAFETY: writes one size_t.
        check(
            unsafe { sys::cuDeviceTotalMem_v2(&mut total, dev) },
            "cuDeviceTotalMem",
        )?;
        let attr = |a| device_attribute(dev, a);
        let info = DeviceInfo {
            ordinal,
            name: device_name(dev)?,
            compute_capability: (
                attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            multiprocessors: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            total_memory: total,
            max_threads_per_block: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            max_grid_x: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?,
            max_shared_memory_per_block: attr(
                Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
            )?,
            driver_version: driver_version()?,
        };
        Ok(Self {
            handle,
            info: Arc::new(info),
            modules: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn ordinal(&self) -> usize {
        self.info.ordinal
    }

    /// Makes this context current on the calling thread.
    #[track_caller]
    pub fn bind(&self) -> Result<()> {
        self.handle.bind()
    }

    /// The raw `CUcontext`, for CUDA libraries and interoperability. Do not destroy it.
    pub fn raw_context(&self) -> sys::CUcontext {
        self.handle.raw.0
    }

    /// Waits for all work on the device. Not allowed while a global-mode capture is open.
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        self.handle.synchronize()
    }

    /// (free, total) device memory as the driver sees it.
    #[track_caller]
    pub fn mem_get_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: writes two size_t.
        check(
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
            "cuMemGetInfo",
        )?;
        Ok((free, total))
    }
}
