//! Compiled modules, their kernels, and kernel launches. A [`Function`] knows its parameter
//! list — read from the PTX we compiled it from (sizes and whether each is a float or an
//! integer/pointer), so a launch with the wrong number or kind of arguments is a typed error
//! before the driver sees it. Launching stays `unsafe`: no signature says which memory a kernel
//! touches.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::fmt;
use std::ptr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::primary::{ContextHandle, LOAD_PATIENCE};
use super::raw::{RawFunction, RawModule, RawStream};
use super::result::{check, driver_has, driver_symbol};
use crate::error::{Error, Result};

/// What a kernel parameter holds, as far as its declaration tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// An integer or a pointer (PTX `.u32`, `.s64`, `.b64`, ...).
    Int,
    /// A floating-point number (PTX `.f32`, `.f64`).
    Float,
    /// A by-value aggregate (a struct parameter, PTX `.b8 name[N]`).
    Bytes,
    /// Unknown kind (read from the driver, which reports sizes only).
    Any,
}

/// One declared kernel parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ParamDecl {
    /// Bytes the parameter takes.
    pub size: usize,
    /// What it holds, as far as its declaration tells.
    pub kind: ParamKind,
}

/// Parses the parameter lists of every `.entry` in PTX text: kernel name → parameters.
pub(crate) fn ptx_entry_params(ptx: &str) -> HashMap<String, Vec<ParamDecl>> {
    let mut out = HashMap::new();
    let mut rest = ptx;
    while let Some(i) = rest.find(".entry") {
        rest = &rest[i + ".entry".len()..];
        let open = rest.find('(');
        let body = rest.find('{');
        let name_end = match (open, body) {
            (Some(o), Some(b)) => o.min(b),
            (Some(o), None) => o,
            (None, Some(b)) => b,
            (None, None) => break,
        };
        let name = rest[..name_end].trim().to_string();
        // A kernel without parameters may have no parenthesised list: its body comes first.
        let Some(open) = open.filter(|&o| o == name_end) else {
            out.insert(name, Vec::new());
            rest = &rest[name_end..];
            continue;
        };
        let Some(close) = rest[open..].find(')') else {
            break;
        };
        let list = &rest[open + 1..open + close];
        let params = list
            .split(',')
            .filter(|p| p.contains(".param"))
            .map(parse_param)
            .collect();
        out.insert(name, params);
        rest = &rest[open + close..];
    }
    out
}

fn parse_param(decl: &str) -> ParamDecl {
    let mut size = 0;
    let mut kind = ParamKind::Any;
    for tok in decl.split_whitespace() {
        let (base, width) = match tok {
            ".u8" | ".s8" | ".b8" => (ParamKind::Int, 1),
            ".u16" | ".s16" | ".b16" => (ParamKind::Int, 2),
            ".u32" | ".s32" | ".b32" => (ParamKind::Int, 4),
            ".u64" | ".s64" | ".b64" => (ParamKind::Int, 8),
            ".f16" => (ParamKind::Float, 2),
            ".f32" => (ParamKind::Float, 4),
            ".f64" => (ParamKind::Float, 8),
            _ => continue,
        };
        size = width;
        kind = base;
    }
    // An array declaration (`.b8 name[24]`) is a by-value aggregate of that many elements.
    if let (Some(l), Some(r)) = (decl.rfind('['), decl.rfind(']')) {
        if let Ok(n) = decl[l + 1..r].trim().parse::<usize>() {
            size *= n;
            kind = ParamKind::Bytes;
        }
    }
    ParamDecl { size, kind }
}

/// Parameter sizes of every kernel of every loaded module, by raw function handle: lets a
/// graph's kernel nodes be read back (rebind) without asking the driver. Entries leave with
/// their module, so a handle reused by a later module never maps to a stale signature.
fn registry() -> &'static Mutex<HashMap<usize, Vec<usize>>> {
    static R: OnceLock<Mutex<HashMap<usize, Vec<usize>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The parameter sizes of one of our kernels, by raw handle.
pub(crate) fn known_param_sizes(f: sys::CUfunction) -> Option<Vec<usize>> {
    registry()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&(f as usize))
        .cloned()
}

pub(super) struct ModuleInner {
    raw: RawModule,
    name: String,
    params: HashMap<String, Vec<ParamDecl>>,
    /// Raw handles of the functions looked up so far (registered in `registry`).
    functions: Mutex<Vec<usize>>,
    ordinal: usize,
    ctx: Arc<ContextHandle>,
    /// What is left of [`LOAD_PATIENCE`] for this module's function lookups together: a
    /// kernel set looks up dozens in a row, and while another thread holds a long capture each
    /// would otherwise wait the whole patience again.
    patience: Mutex<Duration>,
}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        let fs = std::mem::take(&mut *self.functions.lock().unwrap_or_else(|p| p.into_inner()));
        let mut r = registry().lock().unwrap_or_else(|p| p.into_inner());
        for f in fs {
            r.remove(&f);
        }
        drop(r);
        if self.ctx.bind().is_ok() {
            // SAFETY: loaded by cuModuleLoadData and unloaded once, here, after every Function
            // (each holds this owner) is gone.
            unsafe {
                sys::cuModuleUnload(self.raw.0);
            }
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

/// Loads PTX text into the context `ctx` of device `ordinal` (the body of
/// [`Module::load_ptx`], which takes the public [`super::Context`]).
#[track_caller]
pub(super) fn load_ptx(
    ctx: &Arc<ContextHandle>,
    ordinal: usize,
    name: &str,
    ptx: &str,
) -> Result<Module> {
    let image = CString::new(ptx).map_err(|_| Error::Compile {
        module: name.into(),
        log: "PTX text contains a NUL byte".into(),
    })?;
    ctx.bind()?;
    let mut m = ptr::null_mut();
    // Loading may synchronise the context: held off other threads' captures (bounded).
    let _quiet = ctx.gate().quiet_within(LOAD_PATIENCE);
    // SAFETY: image is a NUL-terminated PTX string alive for the call.
    check(
        unsafe { sys::cuModuleLoadData(&mut m, image.as_ptr() as *const c_void) },
        "cuModuleLoadData",
    )?;
    Ok(Module {
        inner: Arc::new(ModuleInner {
            raw: RawModule(m),
            name: name.to_string(),
            params: ptx_entry_params(ptx),
            functions: Mutex::new(Vec::new()),
            ordinal,
            ctx: ctx.clone(),
            patience: Mutex::new(LOAD_PATIENCE),
        }),
    })
}

impl Module {
    /// Looks up an `extern "C" __global__` function.
    #[track_caller]
    pub fn function(&self, name: &str) -> Result<Function> {
        let missing = || Error::MissingKernel {
            module: self.inner.name.clone(),
            kernel: name.to_string(),
        };
        // A name the PTX does not declare is refused here, without a failing driver call.
        let from_ptx = !self.inner.params.is_empty();
        if from_ptx && !self.inner.params.contains_key(name) {
            return Err(missing());
        }
        let Ok(cname) = CString::new(name) else {
            return Err(missing());
        };
        self.inner.ctx.bind()?;
        // Under lazy loading the attribute query below loads the function, which may
        // synchronise the context: held off other threads' captures (bounded, per module).
        let _quiet = {
            let mut left = self
                .inner
                .patience
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let t0 = Instant::now();
            let quiet = self.inner.ctx.gate().quiet_within(*left);
            *left = left.saturating_sub(t0.elapsed());
            quiet
        };
        let mut f = ptr::null_mut();
        // SAFETY: writes one function handle.
        let status = unsafe { sys::cuModuleGetFunction(&mut f, self.inner.raw.0, cname.as_ptr()) };
        if status == sys::CUresult::CUDA_ERROR_NOT_FOUND {
            return Err(missing());
        }
        check(status, "cuModuleGetFunction")?;
        let raw = RawFunction(f);
        let mut max_threads = 0;
        // SAFETY: writes one int for a live function.
        check(
            unsafe {
                sys::cuFuncGetAttribute(
                    &mut max_threads,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                    f,
                )
            },
            "cuFuncGetAttribute",
        )?;
        let params = match self.inner.params.get(name) {
            Some(p) => p.clone(),
            None => driver_params(raw)?.ok_or_else(|| Error::NotSupported {
                what: "reading a kernel's parameter list",
                detail: format!(
                    "`{name}` is not in the PTX this module was loaded from, and the driver cannot report parameters (CUDA 13.2+)"
                ),
            })?,
        };
        registry()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(f as usize, params.iter().map(|p| p.size).collect());
        self.inner
            .functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(f as usize);
        Ok(Function {
            raw,
            name: Arc::from(name),
            max_threads: max_threads.max(0) as u32,
            params: Arc::from(params),
            _module: self.inner.clone(),
        })
    }

    /// The name the module was compiled or loaded under.
    pub fn name(&self) -> &str {
        &self.inner.name
    }
}

/// Whether the driver can report the parameter list of a kernel that is not ours (another
/// library's, e.g. cuBLAS): it needs `cuFuncGetParamCount` (CUDA 13.2+ drivers). Older drivers
/// can only be asked parameter by parameter until they refuse, and the library never makes a
/// driver call that fails on purpose, so there such kernels' parameters are not read: a graph
/// holding them cannot be rebound ([`crate::Graph::rebind`] says so with a typed error).
pub fn driver_reports_library_params() -> bool {
    driver_has("cuFuncGetParamCount") && driver_has("cuFuncGetParamInfo")
}

/// The parameter sizes of any function (another library's kernel), from the driver, or `None`
/// where the driver cannot report them without a failing call (see
/// [`driver_reports_library_params`]).
pub(crate) fn driver_params(f: RawFunction) -> Result<Option<Vec<ParamDecl>>> {
    type CountFn = unsafe extern "C" fn(sys::CUfunction, *mut usize) -> sys::CUresult;
    if !driver_reports_library_params() {
        return Ok(None);
    }
    // SAFETY: this is cuFuncGetParamCount's C signature in every driver that exports it.
    let Some(count_fn) = (unsafe { driver_symbol::<CountFn>("cuFuncGetParamCount") }) else {
        return Ok(None);
    };
    let mut n = 0usize;
    // SAFETY: writes one size_t for a live function.
    check(unsafe { count_fn(f.0, &mut n) }, "cuFuncGetParamCount")?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let (mut off, mut size) = (0usize, 0usize);
        // SAFETY: writes two size_t for a live function; i is below its parameter count.
        check(
            unsafe { sys::cuFuncGetParamInfo(f.0, i, &mut off, &mut size) },
            "cuFuncGetParamInfo",
        )?;
        out.push(ParamDecl {
            size,
            kind: ParamKind::Any,
        });
    }
    Ok(Some(out))
}

/// A kernel in a loaded module. Keeps its module loaded.
#[derive(Clone)]
pub struct Function {
    pub(crate) raw: RawFunction,
    name: Arc<str>,
    max_threads: u32,
    params: Arc<[ParamDecl]>,
    _module: Arc<ModuleInner>,
}

impl fmt::Debug for Function {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Function({}, {} params)", self.name, self.params.len())
    }
}

/// One argument value as the driver receives it: a scalar of up to 8 bytes, or the bytes of
/// a by-value struct parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamValue<'a> {
    pub(crate) data: ParamData<'a>,
    pub(crate) size: usize,
    pub(crate) kind: ParamKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ParamData<'a> {
    /// Little-endian in a slot, so a smaller value's bytes start at the slot's address.
    Word(u64),
    Bytes(&'a [u8]),
}

impl<'a> ParamValue<'a> {
    /// An integer or pointer argument of `size` bytes: the low `size` bytes of `bits`.
    pub fn int(bits: u64, size: u8) -> Self {
        Self {
            data: ParamData::Word(bits),
            size: size as usize,
            kind: ParamKind::Int,
        }
    }
    /// A floating-point argument of `size` bytes: the low `size` bytes of `bits` (`f32::to_bits` or
    /// `f64::to_bits`).
    pub fn float(bits: u64, size: u8) -> Self {
        Self {
            data: ParamData::Word(bits),
            size: size as usize,
            kind: ParamKind::Float,
        }
    }
    /// The bytes of a by-value struct parameter (laid out as the kernel declares it).
    pub fn bytes(b: &'a [u8]) -> Self {
        Self {
            data: ParamData::Bytes(b),
            size: b.len(),
            kind: ParamKind::Bytes,
        }
    }

    /// A copy that owns its bytes (for nodes built later).
    pub(crate) fn to_owned(self) -> OwnedParam {
        OwnedParam {
            bytes: match self.data {
                ParamData::Word(w) => w.to_le_bytes()[..self.size.min(8)].to_vec(),
                ParamData::Bytes(b) => b.to_vec(),
            },
            kind: self.kind,
        }
    }
}

/// An argument value that owns its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct OwnedParam {
    bytes: Vec<u8>,
    kind: ParamKind,
}

impl OwnedParam {
    pub(crate) fn as_value(&self) -> ParamValue<'_> {
        ParamValue {
            data: ParamData::Bytes(&self.bytes),
            size: self.bytes.len(),
            kind: self.kind,
        }
    }
}

impl Function {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Ordinal of the device whose context the kernel was loaded into.
    pub fn ordinal(&self) -> usize {
        self._module.ordinal
    }

    /// The declared parameters.
    pub fn params(&self) -> &[ParamDecl] {
        &self.params
    }

    /// How many blocks of `block_threads` threads and `dynamic_smem` bytes of dynamic shared
    /// memory one multiprocessor holds at once (the driver's occupancy calculator: registers,
    /// shared memory and the block limit of this kernel on its device).
    pub fn max_active_blocks(&self, block_threads: u32, dynamic_smem: usize) -> Result<u32> {
        self._module.ctx.bind()?;
        let threads = i32::try_from(block_threads).map_err(|_| Error::InvalidLaunch {
            kernel: self.name.to_string(),
            problem: format!("{block_threads} threads a block"),
        })?;
        let mut n = 0;
        // SAFETY: writes one int for a live function of the bound context.
        check(
            unsafe {
                sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    &mut n,
                    self.raw.0,
                    threads,
                    dynamic_smem,
                )
            },
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        )?;
        Ok(n.max(0) as u32)
    }

    /// Checks argument count, sizes and kinds against the declaration.
    pub(crate) fn check_args(&self, args: &[ParamValue<'_>]) -> Result<()> {
        check_args(&self.name, &self.params, args)
    }

    /// Validates a launch configuration against this kernel's and the device's limits.
    pub(crate) fn check(&self, cfg: LaunchConfig, max_grid_x: u32) -> Result<Dims> {
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
        } else if gx > max_grid_x {
            Some(format!("grid x {gx} exceeds the device limit {max_grid_x}"))
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

/// Checks argument count, sizes and kinds against a kernel's declaration.
fn check_args(kernel: &str, decls: &[ParamDecl], args: &[ParamValue<'_>]) -> Result<()> {
    let problem = |p: String| {
        Err(Error::ArgumentMismatch {
            kernel: kernel.to_string(),
            problem: p,
        })
    };
    if args.len() != decls.len() {
        return problem(format!(
            "{} arguments given, the kernel declares {}",
            args.len(),
            decls.len()
        ));
    }
    for (i, (a, p)) in args.iter().zip(decls.iter()).enumerate() {
        if a.size != p.size {
            return problem(format!(
                "argument {i} has {} bytes, parameter {i} has {}",
                a.size, p.size
            ));
        }
        let kinds_clash = match (a.kind, p.kind) {
            (_, ParamKind::Any) => false,
            (x, y) => x != y,
        };
        if kinds_clash {
            return problem(format!(
                "argument {i} is {:?}, parameter {i} is {:?}",
                a.kind, p.kind
            ));
        }
    }
    Ok(())
}

/// Grid and block shape of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks along x, y and z.
    pub grid: (u32, u32, u32),
    /// Threads per block along x, y and z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// One thread per element, `block` threads per block (1-D). A count too large for one
    /// grid gives a grid the launch check refuses (never a silently smaller one).
    pub fn for_elements(n: usize, block: u32) -> Self {
        let blocks = n.div_ceil(block.max(1) as usize).max(1);
        Self {
            grid: (u32::try_from(blocks).unwrap_or(u32::MAX), 1, 1),
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

/// Grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dims {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

/// Kernel parameters laid out for cuLaunchKernel / kernel graph nodes: each argument's bytes
/// copied to its own 8-aligned place in one buffer, and the array of pointers to them.
pub(crate) struct Params {
    _words: Vec<u64>,
    ptrs: Vec<*mut c_void>,
}

impl Params {
    pub(crate) fn new(values: &[ParamValue<'_>]) -> Self {
        let total: usize = values.iter().map(|v| v.size.div_ceil(8).max(1)).sum();
        let mut words = vec![0u64; total];
        let mut offsets = Vec::with_capacity(values.len());
        let mut at = 0;
        for v in values {
            offsets.push(at);
            let n = v.size.div_ceil(8).max(1);
            match v.data {
                ParamData::Word(w) => words[at] = w,
                ParamData::Bytes(b) => {
                    for (i, chunk) in b.chunks(8).enumerate() {
                        let mut w = [0u8; 8];
                        w[..chunk.len()].copy_from_slice(chunk);
                        words[at + i] = u64::from_le_bytes(w);
                    }
                }
            }
            at += n;
        }
        let base = words.as_mut_ptr();
        // Pointers into `words`, whose heap buffer does not move when the Vec is moved.
        let ptrs = offsets
            .into_iter()
            .map(|o| base.wrapping_add(o) as *mut c_void)
            .collect();
        Self {
            _words: words,
            ptrs,
        }
    }

    pub(crate) fn as_ptr(&mut self) -> *mut *mut c_void {
        if self.ptrs.is_empty() {
            ptr::null_mut()
        } else {
            self.ptrs.as_mut_ptr()
        }
    }
}

/// Launches `f` on `s`.
///
/// # Safety
/// `params` must have been checked against `f` ([`Function::check_args`]) and `dims` against
/// its limits ([`Function::check`]), and whatever memory the kernel reaches through those
/// values must be valid for the accesses it makes until the kernel has finished (the contract
/// of [`crate::Queue::launch`]).
#[track_caller]
pub(crate) unsafe fn launch(
    f: &Function,
    dims: Dims,
    params: &[ParamValue<'_>],
    s: RawStream,
) -> Result<()> {
    let mut p = Params::new(params);
    check(
        sys::cuLaunchKernel(
            f.raw.0,
            dims.grid.0,
            dims.grid.1,
            dims.grid.2,
            dims.block.0,
            dims.block.1,
            dims.block.2,
            dims.shared_mem_bytes,
            s.0,
            p.as_ptr(),
            ptr::null_mut(),
        ),
        "cuLaunchKernel",
    )
}

/// Launches `f` on `s` through `cuLaunchKernelEx` with launch attributes: with `pdl`,
/// programmatic stream serialization (programmatic dependent launch, sm_90+: the grid may begin
/// while the previous kernel on the stream is still running, and inside a capture the
/// dependency becomes a programmatic edge); with `cluster`, thread-block clusters of those
/// dimensions (sm_90+).
///
/// # Safety
/// As for [`launch`]; in addition, with `pdl`, `f` must execute `griddepcontrol.wait` before
/// its first access to global memory that the previous kernels may still write or may still
/// use (see [`crate::PDL_CUDA`]); with `cluster`, the dimensions must divide the grid and be
/// at most 8 blocks (checked by [`check_cluster`]).
#[track_caller]
pub(crate) unsafe fn launch_ex(
    f: &Function,
    dims: Dims,
    params: &[ParamValue<'_>],
    s: RawStream,
    pdl: bool,
    cluster: Option<(u32, u32, u32)>,
) -> Result<()> {
    let mut p = Params::new(params);
    let mut attrs: [sys::CUlaunchAttribute; 2] = std::mem::zeroed();
    let mut n = 0;
    if pdl {
        // SAFETY: the attribute value is a plain C union; all-zero is a valid value, then the
        // one field this attribute reads is set.
        let mut value: sys::CUlaunchAttributeValue = std::mem::zeroed();
        value.programmaticStreamSerializationAllowed = 1;
        attrs[n] = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        n += 1;
    }
    if let Some((x, y, z)) = cluster {
        // SAFETY: as above; this attribute reads the cluster dimensions.
        let mut value: sys::CUlaunchAttributeValue = std::mem::zeroed();
        value.clusterDim.x = x;
        value.clusterDim.y = y;
        value.clusterDim.z = z;
        attrs[n] = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
            pad: [0; 4],
            value,
        };
        n += 1;
    }
    let config = sys::CUlaunchConfig {
        gridDimX: dims.grid.0,
        gridDimY: dims.grid.1,
        gridDimZ: dims.grid.2,
        blockDimX: dims.block.0,
        blockDimY: dims.block.1,
        blockDimZ: dims.block.2,
        sharedMemBytes: dims.shared_mem_bytes,
        hStream: s.0,
        attrs: attrs.as_mut_ptr(),
        numAttrs: n as u32,
    };
    check(
        sys::cuLaunchKernelEx(&config, f.raw.0, p.as_ptr(), ptr::null_mut()),
        "cuLaunchKernelEx",
    )
}

/// Most blocks of one thread-block cluster a launch may ask for (the portable limit).
pub const MAX_CLUSTER_BLOCKS: u32 = 8;

/// Checks thread-block cluster dimensions against a launch's grid: no zero dimension, at most
/// [`MAX_CLUSTER_BLOCKS`] blocks, and each dividing the grid's.
pub(crate) fn check_cluster(kernel: &str, grid: (u32, u32, u32), c: (u32, u32, u32)) -> Result<()> {
    let blocks = c.0 as u64 * c.1 as u64 * c.2 as u64;
    let problem = if blocks == 0 || blocks > MAX_CLUSTER_BLOCKS as u64 {
        Some(format!(
            "cluster {c:?} has {blocks} blocks; a cluster has 1 to {MAX_CLUSTER_BLOCKS}"
        ))
    } else if grid.0 % c.0 != 0 || grid.1 % c.1 != 0 || grid.2 % c.2 != 0 {
        Some(format!("cluster {c:?} does not divide grid {grid:?}"))
    } else {
        None
    };
    match problem {
        Some(problem) => Err(Error::InvalidLaunch {
            kernel: kernel.to_string(),
            problem,
        }),
        None => Ok(()),
    }
}

/// Whether the driver can launch with attributes (`cuLaunchKernelEx`, CUDA 11.8+).
pub(crate) fn launch_ex_available() -> bool {
    driver_has("cuLaunchKernelEx")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clusters_divide_the_grid_and_hold_at_most_eight_blocks() {
        assert!(check_cluster("k", (4, 2, 8), (1, 1, 8)).is_ok());
        assert!(check_cluster("k", (4, 2, 6), (1, 1, 3)).is_ok());
        assert!(check_cluster("k", (4, 2, 6), (2, 2, 1)).is_ok());
        for (grid, c, says) in [
            ((4, 2, 6), (1, 1, 4), "does not divide"),
            ((16, 1, 16), (1, 1, 16), "1 to 8"),
            ((8, 8, 1), (4, 4, 1), "1 to 8"),
            ((4, 1, 1), (0, 1, 1), "1 to 8"),
        ] {
            let e = check_cluster("k", grid, c).unwrap_err();
            assert!(matches!(e, Error::InvalidLaunch { .. }), "{e:?}");
            assert!(e.to_string().contains(says), "{grid:?} {c:?}: {e}");
        }
    }

    const PTX: &str = r#"
.version 8.5
.target sm_90
.address_size 64

	// .globl	add_one
.visible .entry add_one(
	.param .u64 add_one_param_0,
	.param .u32 add_one_param_1
)
{
	ret;
}
.visible .entry mix(
	.param .u64 .ptr .global .align 4 mix_param_0,
	.param .f32 mix_param_1,
	.param .f64 mix_param_2,
	.param .align 8 .b8 mix_param_3[24],
	.param .s64 mix_param_4
)
{
	ret;
}
.visible .entry empty()
{
	ret;
}
.visible .entry bare
{
	ret;
}
"#;

    #[test]
    fn ptx_parameter_lists_are_read_with_sizes_and_kinds() {
        let p = ptx_entry_params(PTX);
        let d = |size, kind| ParamDecl { size, kind };
        assert_eq!(
            p["add_one"],
            vec![d(8, ParamKind::Int), d(4, ParamKind::Int)]
        );
        assert_eq!(
            p["mix"],
            vec![
                d(8, ParamKind::Int),
                d(4, ParamKind::Float),
                d(8, ParamKind::Float),
                d(24, ParamKind::Bytes),
                d(8, ParamKind::Int)
            ]
        );
        assert_eq!(p["empty"], vec![]);
        assert_eq!(p["bare"], vec![]);
    }

    #[test]
    fn params_lay_out_scalars_and_structs_in_their_own_aligned_slots() {
        let s = [1u8, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
        let vals = [
            ParamValue::int(7, 4),
            ParamValue::bytes(&s),
            ParamValue::float(2.5f32.to_bits() as u64, 4),
        ];
        let mut p = Params::new(&vals);
        let ptrs = p.as_ptr();
        // SAFETY: three pointers into `p`'s buffer, each to at least the argument's bytes.
        unsafe {
            assert_eq!(*(*ptrs as *const u32), 7);
            let st = std::slice::from_raw_parts(*ptrs.add(1) as *const u8, 12);
            assert_eq!(st, &s);
            assert_eq!(*(*ptrs.add(2) as *const f32), 2.5);
            assert_eq!((*ptrs.add(1) as usize) % 8, 0, "8-aligned");
        }
        let f = |decl: &[ParamDecl], vals: &[ParamValue<'_>]| check_args("k", decl, vals);
        let d = |size, kind| ParamDecl { size, kind };
        assert!(f(
            &[
                d(4, ParamKind::Int),
                d(12, ParamKind::Bytes),
                d(4, ParamKind::Float)
            ],
            &vals
        )
        .is_ok());
        // A struct where an int is declared, a float where an int is, a wrong struct size.
        assert!(f(
            &[
                d(4, ParamKind::Int),
                d(12, ParamKind::Int),
                d(4, ParamKind::Float)
            ],
            &vals
        )
        .is_err());
        assert!(f(
            &[
                d(4, ParamKind::Float),
                d(12, ParamKind::Bytes),
                d(4, ParamKind::Float)
            ],
            &vals
        )
        .is_err());
        assert!(f(
            &[
                d(4, ParamKind::Int),
                d(16, ParamKind::Bytes),
                d(4, ParamKind::Float)
            ],
            &vals
        )
        .is_err());
        assert!(f(&[d(4, ParamKind::Int), d(12, ParamKind::Bytes)], &vals).is_err());
        // Driver-reported parameters have sizes only.
        assert!(f(
            &[
                d(4, ParamKind::Any),
                d(12, ParamKind::Any),
                d(4, ParamKind::Any)
            ],
            &vals
        )
        .is_ok());
    }

    #[test]
    fn launch_config_never_silently_shrinks_a_grid() {
        let c = LaunchConfig::for_elements(usize::MAX, 256);
        assert_eq!(c.grid.0, u32::MAX);
        assert_eq!(LaunchConfig::for_elements(0, 256).grid.0, 1);
        assert_eq!(LaunchConfig::for_elements(257, 256).grid.0, 2);
        assert_eq!(LaunchConfig::for_elements(10, 0).grid.0, 10);
    }
}
