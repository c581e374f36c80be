//! [`Queue`]: the operations legal both on an eager stream and inside a capture — allocate,
//! launch, copy, fill, and declare that library work uses a buffer. The trait is object-safe
//! (model code takes `&dyn Queue`); typed conveniences are in [`QueueExt`], implemented for every
//! queue. Nothing here blocks the host or reads device memory back, which is what makes every
//! method legal inside a capture.
//!
//! The trait is sealed: every safe operation built on it (checked launches, copies, the NN
//! layer's launchers and library calls) relies on its implementations declaring buffer uses
//! truthfully — a capture keeps each declared buffer alive, an eager stream fences its reuse —
//! so only the crate's queues ([`crate::Stream`], [`crate::CaptureStream`],
//! [`crate::SideStream`]) implement it.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use super::Device;
use crate::error::{Error, Result};
use crate::memory::{bytes_for, BlockRef, DeviceBuffer, Elem};
use crate::runtime::memory as raw;
use crate::runtime::module::{self, ParamValue};
use crate::runtime::{Function, LaunchConfig, StreamRef};

/// Anything a graph must keep alive besides buffers (kernels' modules, host callbacks, pools).
pub type Anchor = Arc<dyn Any + Send + Sync>;

/// Work registered with [`Queue::at_end`].
pub type EndWork = Box<dyn FnOnce(&dyn Queue) -> Result<()>>;

/// One kernel argument: a device address (with the block it points into, so captures keep it
/// alive and eager streams track its use) or a scalar.
#[derive(Clone, Copy)]
pub enum Arg<'a> {
    /// A device address. `holder` is the block it points into; `None` for addresses the
    /// library cannot see (null, or memory someone else owns).
    Ptr {
        /// The device address.
        addr: u64,
        /// The block it points into, if the library knows it.
        holder: Option<&'a Arc<BlockRef>>,
    },
    /// A 32-bit signed integer.
    I32(i32),
    /// A 32-bit unsigned integer.
    U32(u32),
    /// A 64-bit signed integer.
    I64(i64),
    /// A 64-bit unsigned integer (or a raw handle, as a value).
    U64(u64),
    /// A single-precision float.
    F32(f32),
    /// A double-precision float.
    F64(f64),
    /// A by-value struct parameter, its bytes laid out as the kernel declares the struct.
    /// Device addresses inside it are invisible to the library: the launching code must call
    /// [`Queue::use_block`] for every buffer they point into.
    Bytes(&'a [u8]),
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
            Arg::Bytes(b) => write!(f, "struct({} B)", b.len()),
        }
    }
}

impl<'a> Arg<'a> {
    /// A null pointer argument (an optional buffer left out).
    pub const NULL: Arg<'static> = Arg::Ptr {
        addr: 0,
        holder: None,
    };

    /// A pointer to element `offset` of `buf` (`offset <= buf.len()`).
    pub fn at<T: Elem>(buf: &'a DeviceBuffer<T>, offset: usize) -> Result<Self> {
        Ok(Arg::Ptr {
            addr: buf.addr_at(offset)?,
            holder: Some(buf.block()),
        })
    }

    /// A pointer to `buf`, or null.
    pub fn opt<T: Elem>(buf: Option<&'a DeviceBuffer<T>>) -> Self {
        buf.map(Arg::from).unwrap_or(Arg::NULL)
    }

    pub(crate) fn value(&self) -> ParamValue<'a> {
        match *self {
            Arg::Ptr { addr, .. } => ParamValue::int(addr, 8),
            Arg::I32(v) => ParamValue::int(v as u32 as u64, 4),
            Arg::U32(v) => ParamValue::int(v as u64, 4),
            Arg::I64(v) => ParamValue::int(v as u64, 8),
            Arg::U64(v) => ParamValue::int(v, 8),
            Arg::F32(v) => ParamValue::float(v.to_bits() as u64, 4),
            Arg::F64(v) => ParamValue::float(v.to_bits(), 8),
            Arg::Bytes(b) => ParamValue::bytes(b),
        }
    }

    pub(crate) fn holder(&self) -> Option<&'a Arc<BlockRef>> {
        match *self {
            Arg::Ptr { holder, .. } => holder,
            _ => None,
        }
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

impl<'a, T: Elem> From<&'a DeviceBuffer<T>> for Arg<'a> {
    fn from(b: &'a DeviceBuffer<T>) -> Self {
        Arg::Ptr {
            addr: b.addr(),
            holder: Some(b.block()),
        }
    }
}

impl<'a, T: Elem> From<&'a mut DeviceBuffer<T>> for Arg<'a> {
    fn from(b: &'a mut DeviceBuffer<T>) -> Self {
        Arg::from(&*b)
    }
}

/// Builds a `&[Arg]` from buffers and scalars: `args![&x, &y, n as i32, 0.5f32]`.
#[macro_export]
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        &[$($crate::Arg::from($a)),*]
    };
}

/// Arguments kept on the stack for the common case (no heap allocation per launch).
const INLINE_ARGS: usize = 32;

/// The seal of [`Queue`]: a public trait in a module users cannot name, implemented only for
/// the crate's queues.
pub(crate) mod sealed {
    pub trait Sealed {}
}

// `Stream` seals itself in `stream.rs`, and the capture queues one layer up (`crate::graph`):
// this module names no queue.

/// Work that runs eagerly on a [`crate::Stream`] or is recorded by a
/// [`crate::CaptureStream`]. Write model code against `&dyn Queue` (or `&impl Queue`) and it runs
/// eagerly or captured unchanged.
///
/// Sealed: implemented by [`crate::Stream`], [`crate::CaptureStream`] and
/// [`crate::SideStream`] only, because safe code (graph keep-alive, stream-safe reuse) relies on
/// what their `use_block`, `keep_alive` and `hold_function` do. A wrapper of your own does not
/// compile; hold a `&dyn Queue` inside it instead:
///
/// ```compile_fail
/// # use std::sync::Arc;
/// # use cudagraph::*;
/// struct Quiet<'a>(&'a Stream);
/// impl Queue for Quiet<'_> { // error: the trait bound `Quiet<'_>: Sealed` is not satisfied
///     fn device(&self) -> &Device { self.0.device() }
///     fn stream_handle(&self) -> StreamRef<'_> { self.0.stream_handle() }
///     fn capture_id(&self) -> Option<u64> { None }
///     fn alloc_block(&self, bytes: usize) -> Result<Arc<BlockRef>> { self.0.alloc_block(bytes) }
///     fn use_block(&self, _block: &Arc<BlockRef>) {} // would break keep-alive and fencing
///     fn keep_alive(&self, _anchor: Anchor) {}
///     fn hold_function(&self, _f: &Function) {}
///     fn check_flag_arg(&self) -> Result<Arg<'static>> { self.0.check_flag_arg() }
///     fn at_end(&self, key: usize, work: EndWork) -> Result<()> { self.0.at_end(key, work) }
/// }
/// ```
pub trait Queue: sealed::Sealed {
    /// The device this queue runs on.
    fn device(&self) -> &Device;

    /// The stream, as CUDA libraries need it (raw handle; nothing that synchronises).
    fn stream_handle(&self) -> StreamRef<'_>;

    /// The id of the capture recording this queue's work, `None` when eager.
    fn capture_id(&self) -> Option<u64>;

    /// Whether work on this queue is being recorded into a graph rather than run.
    fn is_capturing(&self) -> bool {
        self.capture_id().is_some()
    }

    /// Allocates `bytes` bytes (contents undefined): from the default pool on an eager
    /// stream, from the capture's pool inside a capture.
    fn alloc_block(&self, bytes: usize) -> Result<Arc<BlockRef>>;

    /// Declares that work about to be enqueued here uses `block` — call it for buffers passed
    /// to CUDA libraries by raw address. Inside a capture the graph keeps the block alive; on
    /// an eager stream that did not allocate it, the block is not reused before this stream's
    /// work is done. The crate's own launches, copies and fills call it for you.
    ///
    /// It cannot fail, so library code may enqueue right after it. On an eager [`crate::Stream`]
    /// that turns out to be part of a capture (see its docs), where the crate's own operations
    /// are refused, the block is kept until the process exits: the work is recorded into a
    /// graph that does not know the block.
    fn use_block(&self, block: &Arc<BlockRef>);

    /// The check record kernels that use [`crate::DEVICE_CHECK_CUDA`] take as their
    /// `cg_check*` parameter: this stream's own when eager (its [`crate::Stream::synchronize`]
    /// reports what they find), the graph's inside a capture (reported by the stream each
    /// replay runs on). Created on first use; the record outlives the work that writes it.
    fn check_flag_arg(&self) -> Result<Arg<'static>>;

    /// Runs `work` on this queue at the end: at once on an eager stream (returning its
    /// result); inside a capture,
    /// once per `key` (the first registration wins), on the capture stream right before the
    /// capture (or the conditional body being recorded) ends, so the graph ends with that work
    /// and every replay runs it. For state that work recorded in the capture must move on by
    /// itself at each replay, such as a random generator's counter (`key`: the state's
    /// address). `work` may not register more work.
    fn at_end(&self, key: usize, work: EndWork) -> Result<()>;

    /// Keeps `anchor` alive as long as the graph being captured (no-op when eager; kept until
    /// the process exits on an eager stream that is part of a capture, as for `use_block`).
    fn keep_alive(&self, anchor: Anchor);

    /// Keeps `f`'s module loaded as long as the graph being captured (no-op when eager; as
    /// `keep_alive` on an eager stream that is part of a capture).
    fn hold_function(&self, f: &Function);

    /// Launches a kernel. The argument count, sizes and kinds (integer/pointer or float) are
    /// checked against the kernel's declaration, the launch shape against its limits, and every
    /// buffer against the device — mismatches are typed errors and nothing is launched.
    ///
    /// # Safety
    /// The kernel must access only memory it owns or reaches through the pointer arguments,
    /// within the buffers those point into, and the scalar arguments must describe those
    /// buffers truthfully (a length passed as `n` must not exceed the buffer). Those are
    /// facts about the kernel's code that no signature shows. The library keeps every passed
    /// buffer alive and ordered for as long as the work may run; pointers the kernel derives
    /// otherwise (read from device memory, computed from another buffer) are not tracked.
    ///
    /// Launching without `unsafe` does not compile:
    ///
    /// ```compile_fail
    /// # use cudagraph::*;
    /// # fn f(s: &Stream, k: &Function, x: &DeviceBuffer<f32>) -> Result<()> {
    /// s.launch(k, LaunchConfig::for_elements(x.len(), 256), args![x, x.len() as i32])
    /// // error[E0133]: call to unsafe function `launch` is unsafe
    /// # }
    /// ```
    ///
    /// The usual shape is a safe function per kernel that checks the lengths, then launches:
    ///
    /// ```no_run
    /// # use cudagraph::*;
    /// fn add_one(q: &dyn Queue, k: &Function, x: &DeviceBuffer<f32>) -> Result<()> {
    ///     let n = i32::try_from(x.len()).map_err(|_| Error::SizeMismatch {
    ///         what: "add_one length", expected: i32::MAX as usize, got: x.len() })?;
    ///     // SAFETY: `add_one(float* x, int n)` touches x[0..n), and n = x.len().
    ///     unsafe { q.launch(k, LaunchConfig::for_elements(x.len(), 256), args![x, n]) }
    /// }
    /// ```
    #[track_caller]
    unsafe fn launch(&self, f: &Function, cfg: LaunchConfig, args: &[Arg<'_>]) -> Result<()> {
        // SAFETY: the caller's promise (this function's `# Safety`) is passed on unchanged.
        launch_checked(self, f, cfg, args, false, None)
    }

    /// [`Queue::launch`] with launch options, such as programmatic dependent launch
    /// ([`LaunchOptions::pdl`]): on devices of compute capability 9.0 and later the kernel may
    /// begin while the previous kernel on the stream is still running, and inside a capture
    /// the dependency becomes a programmatic edge. On older devices (or drivers without
    /// `cuLaunchKernelEx`) the option is ignored and the launch is an ordinary one, which
    /// gives the same results.
    ///
    /// # Safety
    /// The contract of [`Queue::launch`]. With `pdl`, in addition: the kernel executes
    /// `griddepcontrol.wait` (`CG_PDL_WAIT()` or `CG_PDL_ENTER()` from [`PDL_CUDA`]) before
    /// its first access to global memory — until then the previous kernel may still be
    /// running, and memory it used may not be reusable yet.
    #[track_caller]
    unsafe fn launch_with(
        &self,
        f: &Function,
        cfg: LaunchConfig,
        args: &[Arg<'_>],
        opts: LaunchOptions,
    ) -> Result<()> {
        let pdl = opts.pdl && self.device().supports_pdl();
        // SAFETY: the caller's promise (this function's `# Safety`) is passed on unchanged.
        launch_checked(self, f, cfg, args, pdl, opts.cluster)
    }
}

/// Options for [`Queue::launch_with`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchOptions {
    /// Programmatic dependent launch (sm_90+): see [`Queue::launch_with`].
    pub pdl: bool,
    /// Thread-block clusters of these dimensions (sm_90+, at most
    /// [`MAX_CLUSTER_BLOCKS`](crate::runtime::MAX_CLUSTER_BLOCKS) blocks, each
    /// dividing the grid's; a launch that cannot have them is an `InvalidLaunch` error, see
    /// [`Device::supports_clusters`](crate::Device::supports_clusters)). `None`: no clusters.
    pub cluster: Option<(u32, u32, u32)>,
}

impl LaunchOptions {
    /// Ordinary launch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Programmatic dependent launch on or off.
    pub fn pdl(mut self, on: bool) -> Self {
        self.pdl = on;
        self
    }

    /// Thread-block clusters of `dims` blocks (x, y, z).
    pub fn cluster(mut self, dims: (u32, u32, u32)) -> Self {
        self.cluster = Some(dims);
        self
    }
}

/// CUDA source for kernels launched with programmatic dependent launch: prepend it, and begin
/// every such kernel with `CG_PDL_ENTER();` (lets the next kernel launch, then waits for the
/// previous one and its memory). `CG_PDL_WAIT()` and `CG_PDL_TRIGGER()` are the two halves.
/// On devices before sm_90, and in kernels launched without the option, they do nothing.
pub const PDL_CUDA: &str = r#"
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define CG_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define CG_PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" :::)
#else
#define CG_PDL_WAIT() do {} while (0)
#define CG_PDL_TRIGGER() do {} while (0)
#endif
#define CG_PDL_ENTER() do { CG_PDL_TRIGGER(); CG_PDL_WAIT(); } while (0)
"#;

/// Enqueues a copy of `bytes` bytes from `src` to `dst` — one of them device memory of `q`'s
/// device, the other mapped page-locked memory (both device-side addresses) — as the
/// mapped-copy kernel when it fits ([`super::copy::mapped_kernel_for`]); `Ok(false)` when it
/// does not, leaving the copy to the caller's driver call.
///
/// # Safety
/// Both ranges must be valid for `bytes` bytes and stay alive, with no other access to the
/// destination, until the copy has run (for a capture: for as long as the graph can be
/// replayed); the caller has declared the device buffer with [`Queue::use_block`].
#[track_caller]
pub(crate) unsafe fn copy_mapped<Q: Queue + ?Sized>(
    q: &Q,
    dst: u64,
    src: u64,
    bytes: usize,
) -> Result<bool> {
    let Some(c) = super::copy::mapped_kernel_for(q.device(), q.is_capturing(), dst, src, bytes)?
    else {
        return Ok(false);
    };
    // SAFETY: the ranges are the caller's contract; the plan copies exactly `bytes` bytes
    // between 16-byte aligned addresses (mapped_kernel_for checked).
    launch_copy(q, &c, dst, src)?;
    Ok(true)
}

/// Launches `c` from `src` to `dst`: `cg_copy` moves 16·`c.words` + `c.tail` bytes.
///
/// # Safety
/// Both ranges must hold that many bytes, be 16-byte aligned, stay alive until the copy has
/// run, and the device buffers among them be declared with [`Queue::use_block`].
#[track_caller]
unsafe fn launch_copy<Q: Queue + ?Sized>(
    q: &Q,
    c: &super::copy::KernelCopy,
    dst: u64,
    src: u64,
) -> Result<()> {
    let args = [
        Arg::U64(dst),
        Arg::U64(src),
        Arg::U64(c.words),
        Arg::U32(c.tail),
    ];
    // SAFETY: passed on from this function's contract.
    launch_checked(q, &c.f, c.cfg, &args, false, None)
}

/// The checks of [`Queue::launch`], then the launch (programmatic when `pdl`).
///
/// # Safety
/// The contract of [`Queue::launch`], and with `pdl` that of [`Queue::launch_with`].
#[track_caller]
unsafe fn launch_checked<Q: Queue + ?Sized>(
    q: &Q,
    f: &Function,
    cfg: LaunchConfig,
    args: &[Arg<'_>],
    pdl: bool,
    cluster: Option<(u32, u32, u32)>,
) -> Result<()> {
    check_eager(q, "a kernel launch")?;
    let dev = q.device();
    if f.ordinal() != dev.ordinal() {
        return Err(Error::WrongDevice {
            what: "kernel",
            expected: dev.ordinal(),
            got: f.ordinal(),
        });
    }
    let dims = f.check(cfg, dev.info().max_grid_x)?;
    if let Some(c) = cluster {
        if !dev.supports_clusters() {
            return Err(Error::InvalidLaunch {
                kernel: f.name().to_string(),
                problem: "thread-block clusters need compute capability 9.0 or later and a \
                          driver with cuLaunchKernelEx"
                    .to_string(),
            });
        }
        module::check_cluster(f.name(), cfg.grid, c)?;
    }
    let mut inline = [ParamValue::int(0, 0); INLINE_ARGS];
    let mut heap = Vec::new();
    let params: &mut [ParamValue<'_>] = if args.len() <= INLINE_ARGS {
        &mut inline[..args.len()]
    } else {
        heap.resize(args.len(), ParamValue::int(0, 0));
        &mut heap
    };
    for (slot, a) in params.iter_mut().zip(args) {
        if let Some(b) = a.holder() {
            check_device(dev, b)?;
        }
        *slot = a.value();
    }
    f.check_args(params)?;
    for b in args.iter().filter_map(Arg::holder) {
        q.use_block(b);
    }
    q.hold_function(f);
    dev.context().bind()?;
    let stream = q.stream_handle().raw_handle();
    if pdl || cluster.is_some() {
        // SAFETY: arguments, shape and cluster were checked against `f` and the grid above;
        // the memory and wait contracts are the caller's, and every passed buffer is kept
        // alive and its reuse ordered by `use_block`.
        module::launch_ex(f, dims, params, stream, pdl, cluster)
    } else {
        // SAFETY: arguments and shape were checked against `f` above; the memory contract is
        // the caller's (`Queue::launch`'s `# Safety`), and every passed buffer is kept alive
        // and its reuse ordered by `use_block`.
        module::launch(f, dims, params, stream)
    }
}

/// Typed conveniences over any [`Queue`].
pub trait QueueExt: Queue {
    /// Allocates `len` elements (contents undefined).
    #[track_caller]
    fn alloc<T: Elem>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = bytes_for::<T>("allocation", len)?;
        DeviceBuffer::from_block(self.alloc_block(bytes)?, len)
    }

    /// Allocates `len` zeroed elements.
    #[track_caller]
    fn alloc_zeroed<T: Elem>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let b = self.alloc(len)?;
        self.memset_zero(&b)?;
        Ok(b)
    }

    /// Copies all of `src` into `dst` (equal lengths).
    #[track_caller]
    fn copy<T: Elem>(&self, src: &DeviceBuffer<T>, dst: &DeviceBuffer<T>) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::SizeMismatch {
                what: "device copy",
                expected: dst.len(),
                got: src.len(),
            });
        }
        self.copy_range(src, 0, dst, 0, src.len())
    }

    /// Copies `len` elements from `src[src_offset..]` to `dst[dst_offset..]`.
    #[track_caller]
    fn copy_range<T: Elem>(
        &self,
        src: &DeviceBuffer<T>,
        src_offset: usize,
        dst: &DeviceBuffer<T>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_eager(self, "a device copy")?;
        check_range("copy source", src_offset, len, src.len())?;
        check_range("copy destination", dst_offset, len, dst.len())?;
        check_device(self.device(), src.block())?;
        check_device(self.device(), dst.block())?;
        if len == 0 {
            return Ok(());
        }
        self.use_block(src.block());
        self.use_block(dst.block());
        self.device().context().bind()?;
        // In range (checked above), so the byte count fits (DeviceBuffer's invariant).
        let (d, s, bytes) = (
            dst.addr_at(dst_offset)?,
            src.addr_at(src_offset)?,
            len * std::mem::size_of::<T>(),
        );
        if let Some(c) = super::copy::kernel_for(self.device(), self.is_capturing(), d, s, bytes)? {
            // SAFETY: the kernel copies `bytes` bytes from src_offset and dst_offset, in range
            // of src and dst (checked above), both addresses 16-byte aligned (checked by
            // kernel_for); both blocks were declared with use_block.
            return unsafe { launch_copy(self, &c, d, s) };
        }
        raw::memcpy_dtod_async(d, s, bytes, self.stream_handle().raw_handle())
    }

    /// Sets every byte of `buf` to zero.
    #[track_caller]
    fn memset_zero<T: Elem>(&self, buf: &DeviceBuffer<T>) -> Result<()> {
        self.memset_zero_range(buf, 0, buf.len())
    }

    /// Sets the bytes of elements `offset..offset + len` to zero.
    #[track_caller]
    fn memset_zero_range<T: Elem>(
        &self,
        buf: &DeviceBuffer<T>,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        check_eager(self, "a memset")?;
        check_range("memset", offset, len, buf.len())?;
        check_device(self.device(), buf.block())?;
        if len == 0 {
            return Ok(());
        }
        self.use_block(buf.block());
        self.device().context().bind()?;
        raw::memset_d8_async(
            buf.addr_at(offset)?,
            0,
            len * std::mem::size_of::<T>(),
            self.stream_handle().raw_handle(),
        )
    }

    /// Sets `len` 32-bit elements starting at `offset` to `value` (f32, i32 or u32 buffers).
    #[track_caller]
    fn fill32<T: Elem>(
        &self,
        buf: &DeviceBuffer<T>,
        offset: usize,
        len: usize,
        value: T,
    ) -> Result<()> {
        if std::mem::size_of::<T>() != 4 {
            return Err(Error::SizeMismatch {
                what: "fill32 element size",
                expected: 4,
                got: std::mem::size_of::<T>(),
            });
        }
        check_eager(self, "a fill")?;
        check_range("fill", offset, len, buf.len())?;
        check_device(self.device(), buf.block())?;
        if len == 0 {
            return Ok(());
        }
        let bytes = T::as_bytes(std::slice::from_ref(&value));
        let word = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        self.use_block(buf.block());
        self.device().context().bind()?;
        raw::memset_d32_async(
            buf.addr_at(offset)?,
            word,
            len,
            self.stream_handle().raw_handle(),
        )
    }
}

impl<Q: Queue + ?Sized> QueueExt for Q {}

/// `start..start + len` must lie in `0..total`.
pub(crate) fn check_range(
    what: &'static str,
    start: usize,
    len: usize,
    total: usize,
) -> Result<()> {
    match start.checked_add(len) {
        Some(end) if end <= total => Ok(()),
        _ => Err(Error::OutOfRange {
            what,
            start,
            end: start.saturating_add(len),
            len: total,
        }),
    }
}

/// Refuses `what` on a queue that runs eagerly (no capture of its own) while its stream is part
/// of a capture (see [`crate::StreamRef::in_capture`]): a capture queue records into a graph
/// that keeps what it uses, an eager queue would record into one that does not. Costs an
/// atomic load for the crate's own streams and one `cuStreamIsCapturing` for streams wrapped
/// from other libraries (which can capture them without us).
#[track_caller]
pub(crate) fn check_eager<Q: Queue + ?Sized>(q: &Q, what: &'static str) -> Result<()> {
    if q.capture_id().is_some() {
        return Ok(());
    }
    q.stream_handle().check_eager(what)
}

/// `block` must be device memory of `device`: from a device allocator of that device (one
/// [`Device::open`] made; an allocator made with [`crate::memory::Allocator::new`] never
/// qualifies, whatever its ordinal), or external memory declared to be that device's.
pub(crate) fn check_device(device: &Device, block: &BlockRef) -> Result<()> {
    if block.device_ordinal() != device.ordinal() {
        return Err(Error::WrongDevice {
            what: "buffer",
            expected: device.ordinal(),
            got: block.device_ordinal(),
        });
    }
    if !block.is_device_memory() {
        return Err(Error::NotSupported {
            what: "a buffer from an allocator made with Allocator::new",
            detail: "only a device's own allocator (Device::open) hands out device memory; \
                     allocate device buffers with Queue::alloc"
                .into(),
        });
    }
    Ok(())
}
