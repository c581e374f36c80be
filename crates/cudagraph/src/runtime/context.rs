//! The CUDA context of one device as the rest of the crate sees it: [`Context`] (the retained
//! primary context, the facts read off the device when it is opened, and the cache of modules
//! compiled for it) and [`DeviceInfo`]. Every runtime owner holds a [`Context`] and binds it
//! before it calls the driver, so objects work from any thread.
//!
//! The primary context's owner, binding and the capture gate live one floor down, in
//! `primary.rs`; loading a module is here ([`Context::compile`], [`Module::load_ptx`]) because
//! the context caches what it compiled.

use std::collections::HashMap;
use std::ffi::CStr;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::sys;
use cudarc::driver::sys::CUdevice_attribute as Attr;

use super::module::{self, Module};
use super::nvrtc;
use super::primary::ContextHandle;
use super::result::{check, driver_present, driver_version, init};
use crate::error::{Error, Result};

/// Facts about a device, read once when it is opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's ordinal.
    pub ordinal: usize,
    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Compute capability (major, minor), e.g. (9, 0) for Hopper.
    pub compute_capability: (u32, u32),
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Device memory, in bytes.
    pub total_memory: usize,
    /// Most threads one block may have.
    pub max_threads_per_block: u32,
    /// Most blocks along a grid's x dimension.
    pub max_grid_x: u32,
    /// Shared memory one block may use without opting in, in bytes.
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
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
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
        let handle = ContextHandle::retain(dev)?;
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

    /// Facts read off the device when it was opened.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.info.ordinal
    }

    /// Makes this context current on the calling thread.
    #[track_caller]
    pub fn bind(&self) -> Result<()> {
        self.handle.bind()
    }

    /// Drops this context's cache of loaded modules (each unloads once no function of it is
    /// held elsewhere).
    pub(crate) fn forget_modules(&self) {
        self.modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// The raw `CUcontext`, for CUDA libraries and interoperability. Do not destroy it.
    pub fn raw_context(&self) -> sys::CUcontext {
        self.handle.raw.0
    }

    /// Waits for all work on the device. Waits first for captures of this device open on other
    /// threads to end (synchronising would invalidate them); fails with
    /// [`Error::NotSupported`] if this thread is capturing and another capture is open.
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        self.handle.synchronize()
    }

    /// Runs `f` with this device's captures held off: waits at most `patience` for captures
    /// open on other threads (through any `Device` handle of this device) to end, and no
    /// capture begins until `f` returns. For work that may synchronise the device behind the
    /// caller's back, which would invalidate other threads' captures: opening a CUDA library,
    /// the first call of a library routine (lazy kernel loading), loading a module. When the
    /// wait runs out, or this thread is capturing while other captures are open, `f` runs
    /// anyway (the bounded wait means this can never deadlock against a capturing thread that
    /// waits for the caller). Keep `f` short, a leaf: captures about to begin on other threads
    /// wait for it, so it must not wait for anything those threads may hold (a capture `f`
    /// itself begins on this thread does not wait).
    pub fn with_captures_held_off<R>(&self, patience: Duration, f: impl FnOnce() -> R) -> R {
        let _quiet = self.handle.gate().quiet_within(patience);
        f()
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

impl Context {
    /// Compiles `source` with NVRTC for this device (or takes it from the in-memory or disk
    /// cache) and loads it. `name` is used in error messages and cache file names.
    #[track_caller]
    pub fn compile(&self, name: &str, source: &str) -> Result<Module> {
        let key = nvrtc::cache_key(source, &self.info().arch());
        if let Some(m) = self
            .modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(m.clone());
        }
        let ptx = nvrtc::compile_cached(name, source, &self.info().arch(), key)?;
        let module = Module::load_ptx(self, name, &ptx)?;
        self.modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, module.clone());
        Ok(module)
    }
}

impl Module {
    /// Loads PTX text into `ctx`.
    #[track_caller]
    pub fn load_ptx(ctx: &Context, name: &str, ptx: &str) -> Result<Self> {
        module::load_ptx(&ctx.handle, ctx.ordinal(), name, ptx)
    }
}
