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
use crate::error::{NnError, Result};
use crate::extent::{block_on_device, handle_on_device, on_device, GemmDims};

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
        let to_i32 = |v: usize| {
            i32::try_from(v).map_err(|_| NnError::Shape(format!("gemm dimension {v} exceeds i32")))
        };
        let (mi, ni, ki) = (to_i32(m)?, to_i32(n)?, to_i32(k)?);
        // Column-major view: Cᵀ (n×m) = op(B)ᵀ · op(A)ᵀ, so B goes first.
        let lda = if ta == Trans::N { ki } else { mi };
        let ldb = if tb == Trans::N { ni } else { ki };
        q.use_block(a.block());
        q.use_block(b.block());
        q.use_block(c.block());
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
        let math = if tf32 {
            sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
        } else {
            sys::cublasMath_t::CUBLAS_DEFAULT_MATH
        };
        // SAFETY: h is live; the stream and workspace are live device objects (the workspace is
        // kept by `self` and, inside a capture, by the graph); the handle, A, B, C and the
        // workspace belong to the queue's device (checked above); A, B and C hold m·k, k·n and
        // m·n elements (checked above), which with these leading dimensions is every element
        // cuBLAS touches; alpha/beta are read before the call returns.
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
    }

    /// Bytes held for the workspaces of live streams.
    pub fn workspace_bytes(&self) -> usize {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.workspaces.retain(|_, (s, _)| s.is_alive());
        st.workspaces.len() * WORKSPACE_BYTES
    }
}
