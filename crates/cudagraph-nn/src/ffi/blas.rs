//! cuBLAS, through cudarc's typed bindings. One handle per device (kept by
//! [`super::libraries::Libraries`]); its workspace is a buffer from our own allocator, so
//! cuBLAS never allocates by itself (not during a capture either).
//!
//! Workspaces: eager GEMMs use one workspace per stream (in the default pool), ordered by the
//! stream. A GEMM inside a capture gets its own workspace from the queue, that is from the
//! graph's pool, kept alive by the graph: graphs never share a workspace with each other or
//! with eager work, so they may replay on any streams at the same time (graphs that share a
//! pool share its memory, and with it the pool's rules). Within one graph, GEMMs captured on
//! one stream reuse one block, in stream order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudagraph::memory::{Allocator, BlockRef};
use cudagraph::runtime::{with_relaxed_capture, Context, WeakStream};
use cudagraph::{DeviceBuffer, Queue, QueueExt};
use cudarc::cublas::sys;

use super::loader::FIRST_USE_PATIENCE;
use crate::dtype::{Dtype, Float};
use crate::error::{NnError, Result};
use crate::extent::{block_on_device, handle_on_device, need, on_device, prod, GemmDims};

/// Workspace bytes per stream (cuBLAS's recommendation for Hopper is up to 32 MiB; SGEMM at
/// these sizes uses far less).
pub const WORKSPACE_BYTES: usize = 4 << 20;

struct Handle(sys::cublasHandle_t);

// SAFETY: a cuBLAS handle may be used from any thread, one call at a time; every use below
// holds the `Blas` mutex.
unsafe impl Send for Handle {}

struct State {
    handle: Handle,
    /// One workspace per stream, released when its stream is gone (graphs that used it keep
    /// their own hold on the block).
    workspaces: HashMap<u64, (WeakStream, Arc<BlockRef>)>,
}

/// A cuBLAS handle bound to one device. Holds the device's context and allocator, not the
/// `Device` (it lives inside the device, in its [`super::libraries::Libraries`]).
pub struct Blas {
    state: Mutex<State>,
    ctx: Context,
    alloc: Arc<Allocator>,
}

impl Drop for Blas {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        // Workspaces go back to the allocator first; in-flight GEMMs are ordered before any
        // reuse on their streams.
        st.workspaces.clear();
        if self.ctx.bind().is_ok() {
            // SAFETY: the handle was created by cublasCreate and is destroyed once, here.
            unsafe {
                sys::cublasDestroy_v2(st.handle.0);
            }
        }
    }
}

fn check(status: sys::cublasStatus_t, call: &'static str) -> Result<()> {
    if status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(NnError::Cublas {
            call,
            status: format!("{status:?}"),
        })
    }
}

/// A dimension as cuBLAS's `int`.
fn to_i32(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| NnError::Shape(format!("gemm dimension {v} exceeds i32")))
}

/// cuBLAS's name of an element type.
fn cuda_type(d: Dtype) -> sys::cudaDataType {
    match d {
        Dtype::F32 => sys::cudaDataType::CUDA_R_32F,
        Dtype::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        Dtype::F16 => sys::cudaDataType::CUDA_R_16F,
    }
}

/// `N` (as stored) or `T` (transposed) for a row-major operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Trans {
    /// The operand as stored.
    N,
    /// The operand transposed.
    T,
}

/// What a product does after `alpha·op(A)·op(B) + beta·C`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// Nothing: the product's result as it is.
    None,
    /// `+ bias[j]` (length n).
    Bias,
    /// `+ bias[j]`, then ReLU.
    BiasRelu,
    /// `+ bias[j]`, then GELU in its tanh approximation, cuBLASLt's (`CUBLASLT_EPILOGUE_GELU_BIAS`):
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, PyTorch's `gelu(approximate="tanh")`, not
    /// the exact erf form. Half-precision products only
    /// ([`crate::engine::gemm_lowp()`]); the f32 engines refuse it.
    BiasGelu,
    /// Also writes the row sums of op(A) (length m): the bias gradient of a Linear layer when
    /// the product is its weight gradient `dW = dZᵀ·X` (A = dZ, transposed).
    BiasGrad,
}

impl Epilogue {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Epilogue::None => "none",
            Epilogue::Bias => "bias",
            Epilogue::BiasRelu => "bias_relu",
            Epilogue::BiasGelu => "bias_gelu",
            Epilogue::BiasGrad => "bias_grad",
        }
    }
}

impl Trans {
    fn op(self) -> sys::cublasOperation_t {
        match self {
            Trans::N => sys::cublasOperation_t::CUBLAS_OP_N,
            Trans::T => sys::cublasOperation_t::CUBLAS_OP_T,
        }
    }
}

impl Blas {
    /// Creates the handle (works inside a capture too: relaxed mode around creation).
    pub fn new(ctx: &Context, alloc: &Arc<Allocator>) -> Result<Self> {
        // SAFETY: only tries to dlopen libcublas.
        if !unsafe { sys::is_culib_present() } {
            return Err(NnError::Cublas {
                call: "dlopen",
                status: "libcublas could not be loaded; install CUDA's cuBLAS library".into(),
            });
        }
        ctx.bind()?;
        let mut h = std::ptr::null_mut();
        // Creating a handle may synchronise the device: held off other threads' captures.
        check(
            ctx.with_captures_held_off(FIRST_USE_PATIENCE, || {
                // SAFETY: writes one handle.
                with_relaxed_capture(|| unsafe { sys::cublasCreate_v2(&mut h) })
            }),
            "cublasCreate",
        )?;
        // Full fp32 (no TF32), to match PyTorch with TF32 off and our CPU references; each
        // product sets the mode it was asked for ([`Blas::gemm_math`]).
        // SAFETY: h is a live handle.
        check(
            unsafe { sys::cublasSetMathMode(h, sys::cublasMath_t::CUBLAS_DEFAULT_MATH) },
            "cublasSetMathMode",
        )?;
        Ok(Self {
            state: Mutex::new(State {
                handle: Handle(h),
                workspaces: HashMap::new(),
            }),
            ctx: ctx.clone(),
            alloc: alloc.clone(),
        })
    }

    /// Row-major `C[m×n] = alpha · op(A) · op(B) + beta · C`, where op(A) is m×k and op(B) k×n,
    /// in full fp32 (no TF32).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        q: &dyn Queue,
        ta: Trans,
        tb: Trans,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: &DeviceBuffer<f32>,
        b: &DeviceBuffer<f32>,
        beta: f32,
        c: &DeviceBuffer<f32>,
    ) -> Result<()> {
        self.gemm_math(q, ta, tb, m, n, k, alpha, a, b, beta, c, false)
    }

    /// As [`Blas::gemm`], with TF32 tensor cores allowed when `tf32`
    /// (`CUBLAS_TF32_TENSOR_OP_MATH`; otherwise `CUBLAS_DEFAULT_MATH`, full fp32). The handle's
    /// math mode is set on every call, under the handle's lock.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_math(
        &self,
        q: &dyn Queue,
        ta: Trans,
        tb: Trans,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: &DeviceBuffer<f32>,
        b: &DeviceBuffer<f32>,
        beta: f32,
        c: &DeviceBuffer<f32>,
        tf32: bool,
    ) -> Result<()> {
        let dims = GemmDims {
            m,
            n,
            k,
            ta: ta == Trans::T,
            tb: tb == Trans::T,
        };
        dims.check_buffers(a, b, c, None)?;
        // The handle, A, B, C and (below) the workspace are all the queue's device's.
        handle_on_device(q, "cuBLAS handle", self.ctx.ordinal())?;
        on_device(
            q,
            [
                ("gemm A", a.block()),
                ("gemm B", b.block()),
                ("gemm C", c.block()),
            ],
        )?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (mi, ni, ki) = (to_i32(m)?, to_i32(n)?, to_i32(k)?);
        // Column-major view: Cᵀ (n×m) = op(B)ᵀ · op(A)ᵀ, so B goes first.
        let lda = if ta == Trans::N { ki } else { mi };
        let ldb = if tb == Trans::N { ni } else { ki };
        let math = if tf32 {
            sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
        } else {
            sys::cublasMath_t::CUBLAS_DEFAULT_MATH
        };
        q.use_block(a.block());
        q.use_block(b.block());
        q.use_block(c.block());
        self.on_handle(q, math, |h| {
            // SAFETY: h is live and bound to the queue's stream with a live workspace
            // (`on_handle`); the handle, A, B and C belong to the queue's device (checked
            // above); A, B and C hold m·k, k·n and m·n elements (checked above), which with
            // these leading dimensions is every element cuBLAS touches; alpha/beta are read
            // before the call returns.
            unsafe {
                check(
                    sys::cublasSgemm_v2(
                        h,
                        tb.op(),
                        ta.op(),
                        ni,
                        mi,
                        ki,
                        &alpha,
                        b.addr() as *const f32,
                        ldb,
                        a.addr() as *const f32,
                        lda,
                        &beta,
                        c.addr() as *mut f32,
                        ni,
                    ),
                    "cublasSgemm",
                )
            }
        })
    }

    /// Row-major `C[m×n] = alpha · op(A) · op(B) + beta · C` with A and B in bf16 or f16 (the
    /// same type) and C in that type or f32 (`cublasGemmEx`): tensor cores, products
    /// accumulated in f32 (`CUBLAS_COMPUTE_32F`, alpha and beta f32), and no reduction of
    /// partial sums in 16 bits (`CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION`; PyTorch
    /// allows those by default). Other types are a [`NnError::NotSupported`] error.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_ex<T: Float, O: Float>(
        &self,
        q: &dyn Queue,
        ta: Trans,
        tb: Trans,
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        a: &DeviceBuffer<T>,
        b: &DeviceBuffer<T>,
        beta: f32,
        c: &DeviceBuffer<O>,
    ) -> Result<()> {
        let (ab, cd) = (cuda_type(T::DTYPE), cuda_type(O::DTYPE));
        if T::DTYPE == Dtype::F32 || (O::DTYPE != T::DTYPE && O::DTYPE != Dtype::F32) {
            return Err(NnError::NotSupported {
                op: "cublasGemmEx",
                what: format!("operands of {} with a result of {}", T::DTYPE, O::DTYPE),
                fix: "pass bf16 or f16 operands with a result of the same type or f32 (f32 \
                      products go through Blas::gemm_math)",
            });
        }
        need("gemm A", a, prod("gemm A", &[m, k])?)?;
        need("gemm B", b, prod("gemm B", &[k, n])?)?;
        need("gemm C", c, prod("gemm C", &[m, n])?)?;
        handle_on_device(q, "cuBLAS handle", self.ctx.ordinal())?;
        on_device(
            q,
            [
                ("gemm A", a.block()),
                ("gemm B", b.block()),
                ("gemm C", c.block()),
            ],
        )?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (mi, ni, ki) = (to_i32(m)?, to_i32(n)?, to_i32(k)?);
        // cuBLAS wants leading dimensions of at least one, also for k = 0.
        let lda = if ta == Trans::N { ki } else { mi }.max(1);
        let ldb = if tb == Trans::N { ni } else { ki }.max(1);
        q.use_block(a.block());
        q.use_block(b.block());
        q.use_block(c.block());
        let math = sys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
        self.on_handle(q, math, |h| {
            // SAFETY: as in `gemm_math`: h is live on the queue's stream with a live
            // workspace; A, B and C are the queue's device's memory and hold m·k, k·n and m·n
            // elements of the types named (checked above: `cuda_type` of their element
            // types), every element cuBLAS touches with these leading dimensions; alpha and
            // beta are f32, as CUBLAS_COMPUTE_32F reads them, before the call returns.
            unsafe {
                check(
                    sys::cublasGemmEx(
                        h,
                        tb.op(),
                        ta.op(),
                        ni,
                        mi,
                        ki,
                        &alpha as *const f32 as *const std::ffi::c_void,
                        b.addr() as *const std::ffi::c_void,
                        ab,
                        ldb,
                        a.addr() as *const std::ffi::c_void,
                        ab,
                        lda,
                        &beta as *const f32 as *const std::ffi::c_void,
                        c.addr() as *mut std::ffi::c_void,
                        cd,
                        ni,
                        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    ),
                    "cublasGemmEx",
                )
            }
        })
    }

    /// Runs `f` with the handle bound to `q`'s stream, its math mode set to `math` and a
    /// workspace: the stream's own for eager work, one from the graph's pool inside a capture
    /// (see the module notes), under the handle's lock.
    fn on_handle(
        &self,
        q: &dyn Queue,
        math: sys::cublasMath_t,
        f: impl FnOnce(sys::cublasHandle_t) -> Result<()>,
    ) -> Result<()> {
        self.ctx.bind()?;
        let stream = q.stream_handle();
        // Inside a capture: the graph's own workspace (see the module notes). Dropped after
        // the call, its block returns to the graph's pool in stream order; the graph holds it.
        let captured_ws = if q.is_capturing() {
            Some(q.alloc::<u8>(WORKSPACE_BYTES)?)
        } else {
            None
        };
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let ws = match (&captured_ws, st.workspaces.get(&stream.id())) {
            (Some(w), _) => w.block().clone(),
            (None, Some((_, w))) => w.clone(),
            (None, None) => {
                st.workspaces.retain(|_, (s, _)| s.is_alive());
                let w = self.alloc.allocate_block(WORKSPACE_BYTES, stream)?;
                st.workspaces
                    .insert(stream.id(), (stream.downgrade(), w.clone()));
                w
            }
        };
        block_on_device(self.ctx.ordinal(), "cuBLAS workspace", &ws)?;
        q.use_block(&ws);
        let h = st.handle.0;
        // SAFETY: h is live; the stream and workspace are live device objects (the workspace is
        // kept by `self` and, inside a capture, by the graph) of the handle's device, and the
        // workspace holds WORKSPACE_BYTES bytes.
        unsafe {
            check(sys::cublasSetMathMode(h, math), "cublasSetMathMode")?;
            check(
                sys::cublasSetStream_v2(h, stream.raw() as sys::cudaStream_t),
                "cublasSetStream",
            )?;
            check(
                sys::cublasSetWorkspace_v2(h, ws.addr() as *mut _, WORKSPACE_BYTES),
                "cublasSetWorkspace",
            )?;
        }
        f(h)
    }

    /// Bytes held for the workspaces of live streams.
    pub fn workspace_bytes(&self) -> usize {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.workspaces.retain(|_, (s, _)| s.is_alive());
        st.workspaces.len() * WORKSPACE_BYTES
    }
}
