//! The lowest layer: the CUDA context of one device, owned stream and event handles, compiled
//! modules and kernel launch parameters. All FFI lives in [`driver`] (the driver API) and
//! [`nvrtc`] (run-time compilation); everything above this module is safe Rust.
//!
//! Memory is not here: the caching allocator sits one layer up, in [`crate::memory`].

pub(crate) mod driver;
pub mod nvrtc;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdevice_attribute as Attr;

use crate::error::{Error, Result};
pub use driver::with_relaxed_capture;
pub(crate) use driver::{Dims, ParamSlot, RawContext, RawEvent, RawFunction, RawStream};

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
    dev: cudarc::driver::sys::CUdevice,
}

impl Drop for ContextHandle {
    fn drop(&mut self) {
        driver::primary_ctx_release(self.dev);
    }
}

impl ContextHandle {
    #[track_caller]
    pub(crate) fn bind(&self) -> Result<()> {
        driver::ctx_bind(self.raw)
    }
}

/// A CUDA context on one device: device facts, module cache, streams and events.
/// Cheap to clone; the context lives until the last clone and every object made from it is gone.
#[derive(Clone)]
pub struct Context {
    pub(crate) handle: Arc<ContextHandle>,
    info: Arc<DeviceInfo>,
    modules: Arc<Mutex<HashMap<u64, Module>>>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Context({} #{})", self.info.name, self.info.ordinal)
    }
}

/// Number of CUDA devices, or a typed error when no driver can be loaded.
pub fn device_count() -> Result<usize> {
    if !driver::driver_present() {
        return Err(Error::NoDriver {
            detail: "libcuda.so could not be loaded".into(),
        });
    }
    driver::init().map_err(|e| Error::NoDriver {
        detail: e.to_string(),
    })?;
    driver::device_count()
}

impl Context {
    /// Opens device `ordinal` (retaining its primary context, as the runtime API does).
    #[track_caller]
    pub fn open(ordinal: usize) -> Result<Self> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        let dev = driver::device_get(ordinal)?;
        let raw = driver::primary_ctx_retain(dev)?;
        let handle = Arc::new(ContextHandle { raw, dev });
        handle.bind()?;
        let attr = |a| driver::device_attribute(dev, a).map(|v| v.max(0) as u32);
        let info = DeviceInfo {
            ordinal,
            name: driver::device_name(dev)?,
            compute_capability: (
                attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            multiprocessors: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            total_memory: driver::device_total_mem(dev)?,
            max_threads_per_block: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            max_grid_x: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?,
            max_shared_memory_per_block: attr(
                Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
            )?,
            driver_version: driver::driver_version()?,
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

    /// Waits for all work on the device. Not allowed while a global-mode capture is open.
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        driver::ctx_synchronize()
    }

    /// (free, total) device memory as the driver sees it.
    #[track_caller]
    pub fn mem_get_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        driver::mem_get_info()
    }

    /// Creates a new non-blocking stream.
    #[track_caller]
    pub fn new_stream_handle(&self) -> Result<StreamHandle> {
        self.bind()?;
        let raw = driver::stream_create()?;
        let join = driver::event_create(false)?;
        Ok(StreamHandle {
            raw,
            id: next_stream_id(),
            ctx: self.clone(),
            join: Event {
                raw: join,
                ctx: self.clone(),
            },
        })
    }

    /// Creates an event; `timing` enables elapsed-time queries.
    #[track_caller]
    pub fn new_event(&self, timing: bool) -> Result<Event> {
        self.bind()?;
        Ok(Event {
            raw: driver::event_create(timing)?,
            ctx: self.clone(),
        })
    }

    /// Compiles `source` with NVRTC for this device (or takes it from the in-memory or disk
    /// cache) and loads it. `name` is used in error messages and cache file names.
    #[track_caller]
    pub fn compile(&self, name: &str, source: &str) -> Result<Module> {
        let key = nvrtc::cache_key(source, &self.info.arch());
        if let Some(m) = self
            .modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(m.clone());
        }
        let ptx = nvrtc::compile_cached(name, source, &self.info.arch(), key)?;
        self.bind()?;
        let raw = driver::module_load_ptx(&ptx)?;
        let module = Module {
            inner: Arc::new(ModuleInner {
                raw,
                name: name.to_string(),
                ctx: self.handle.clone(),
            }),
        };
        self.modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, module.clone());
        Ok(module)
    }
}

static STREAM_IDS: AtomicU64 = AtomicU64::new(1);

fn next_stream_id() -> u64 {
    STREAM_IDS.fetch_add(1, Ordering::Relaxed)
}

/// An owned CUDA stream. The user-facing [`crate::Stream`] wraps this with the allocator.
pub struct StreamHandle {
    pub(crate) raw: RawStream,
    id: u64,
    ctx: Context,
    join: Event,
}

impl fmt::Debug for StreamHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Stream#{}", self.id)
    }
}

impl Drop for StreamHandle {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            driver::stream_destroy(self.raw);
        }
    }
}

impl StreamHandle {
    /// Process-unique id of this stream (the allocator's stream-ordering key).
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The raw `CUstream`, for calling CUDA libraries (cuBLAS) on this stream.
    /// Do not destroy it and do not synchronise on it while it is capturing.
    pub fn raw_stream(&self) -> cudarc::driver::sys::CUstream {
        self.raw.0
    }

    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        driver::stream_synchronize(self.raw)
    }

    /// Makes future work on `self` wait for all work enqueued on `other` so far.
    #[track_caller]
    pub fn wait_for(&self, other: &StreamHandle) -> Result<()> {
        self.ctx.bind()?;
        driver::event_record(other.join.raw, other.raw)?;
        driver::stream_wait_event(self.raw, other.join.raw)
    }

    /// Records `event` on this stream.
    #[track_caller]
    pub fn record(&self, event: &Event) -> Result<()> {
        self.ctx.bind()?;
        driver::event_record(event.raw, self.raw)
    }

    /// Makes future work on this stream wait for `event`.
    #[track_caller]
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.ctx.bind()?;
        driver::stream_wait_event(self.raw, event.raw)
    }

    /// Launches `f` on this stream.
    #[track_caller]
    pub fn launch(&self, f: &Function, cfg: LaunchConfig, args: &[Arg<'_>]) -> Result<()> {
        self.ctx.bind()?;
        let dims = f.check(cfg)?;
        let params: Vec<ParamSlot> = args.iter().map(Arg::slot).collect();
        driver::launch(f.raw, dims, &params, self.raw)
    }
}

/// A CUDA event.
pub struct Event {
    pub(crate) raw: RawEvent,
    ctx: Context,
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            driver::event_destroy(self.raw);
        }
    }
}

impl Event {
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        driver::event_synchronize(self.raw)
    }

    /// Milliseconds between `self` (earlier) and `end`; both need timing enabled.
    #[track_caller]
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        self.ctx.bind()?;
        driver::event_elapsed_ms(self.raw, end.raw)
    }
}

struct ModuleInner {
    raw: driver::RawModule,
    name: String,
    ctx: Arc<ContextHandle>,
}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            driver::module_unload(self.raw);
        }
    }
}

/// A loaded CUDA module (from NVRTC). Cheap to clone.
#[derive(Clone)]
pub struct Module {
    inner: Arc<ModuleInner>,
}

impl fmt::Debug for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Module({})", self.inner.name)
    }
}

impl Module {
    /// Looks up an `extern "C" __global__` function.
    #[track_caller]
    pub fn function(&self, name: &str) -> Result<Function> {
        self.inner.ctx.bind()?;
        let raw =
            driver::module_function(self.inner.raw, name)?.ok_or_else(|| Error::MissingKernel {
                module: self.inner.name.clone(),
                kernel: name.to_string(),
            })?;
        let max_threads = driver::function_max_threads(raw)?;
        Ok(Function {
            raw,
            name: Arc::from(name),
            max_threads,
            _module: self.inner.clone(),
        })
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }
}

/// A kernel in a loaded module. Keeps its module loaded.
#[derive(Clone)]
pub struct Function {
    pub(crate) raw: RawFunction,
    name: Arc<str>,
    max_threads: u32,
    _module: Arc<ModuleInner>,
}

impl fmt::Debug for Function {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Function({})", self.name)
    }
}

impl Function {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Validates a launch configuration against this kernel's limits.
    pub(crate) fn check(&self, cfg: LaunchConfig) -> Result<Dims> {
        let (bx, by, bz) = cfg.block;
        let (gx, gy, gz) = cfg.grid;
        let threads = bx as u64 * by as u64 * bz as u64;
        let problem = if gx == 0 || gy == 0 || gz == 0 || threads == 0 {
            Some(format!(
                "grid {:?} and block {:?} must have no zero dimension",
                cfg.grid, cfg.block
            ))
        } else if threads > self.max_threads as u64 {
            Some(format!(
                "block {:?} has {threads} threads, this kernel allows at most {}",
                cfg.block, self.max_threads
            ))
        } else if gy > 65535 || gz > 65535 {
            Some(format!("grid {:?}: y and z are limited to 65535", cfg.grid))
        } else {
            None
        };
        match problem {
            Some(problem) => Err(Error::InvalidLaunch {
                kernel: self.name.to_string(),
                problem,
            }),
            None => Ok(Dims {
                grid: cfg.grid,
                block: cfg.block,
                shared_mem_bytes: cfg.shared_mem_bytes,
            }),
        }
    }
}

/// Grid and block shape of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// One thread per element, `block` threads per block (1-D).
    pub fn for_elements(n: usize, block: u32) -> Self {
        let blocks = n.div_ceil(block as usize).max(1);
        Self {
            grid: (blocks.min(u32::MAX as usize) as u32, 1, 1),
            block: (block, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// An explicit 1-D configuration.
    pub fn linear(grid: u32, block: u32) -> Self {
        Self {
            grid: (grid, 1, 1),
            block: (block, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// One kernel argument: a device buffer (its address) or a scalar.
#[derive(Clone, Copy)]
pub enum Arg<'a> {
    /// A device address, with the buffer it points into (so captures can keep it alive).
    Ptr {
        addr: u64,
        holder: Option<&'a Arc<crate::memory::BlockRef>>,
    },
    I32(i32),
    U32(u32),
    I64(i64),
    U64(u64),
    F32(f32),
    F64(f64),
}

impl fmt::Debug for Arg<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Arg::Ptr { addr, .. } => write!(f, "ptr({addr:#x})"),
            Arg::I32(v) => write!(f, "{v}i32"),
            Arg::U32(v) => write!(f, "{v}u32"),
            Arg::I64(v) => write!(f, "{v}i64"),
            Arg::U64(v) => write!(f, "{v}u64"),
            Arg::F32(v) => write!(f, "{v}f32"),
            Arg::F64(v) => write!(f, "{v}f64"),
        }
    }
}

impl Arg<'_> {
    pub(crate) fn slot(&self) -> ParamSlot {
        ParamSlot(match *self {
            Arg::Ptr { addr, .. } => addr,
            Arg::I32(v) => v as u32 as u64,
            Arg::U32(v) => v as u64,
            Arg::I64(v) => v as u64,
            Arg::U64(v) => v,
            Arg::F32(v) => v.to_bits() as u64,
            Arg::F64(v) => v.to_bits(),
        })
    }
}

macro_rules! arg_from {
    ($t:ty, $v:ident) => {
        impl From<$t> for Arg<'_> {
            fn from(x: $t) -> Self {
                Arg::$v(x)
            }
        }
    };
}
arg_from!(i32, I32);
arg_from!(u32, U32);
arg_from!(i64, I64);
arg_from!(u64, U64);
arg_from!(f32, F32);
arg_from!(f64, F64);

/// Builds a `&[Arg]` from buffers and scalars: `args![&x, &y, n as i32, 0.5f32]`.
#[macro_export]
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        &[$($crate::Arg::from($a)),*]
    };
}
