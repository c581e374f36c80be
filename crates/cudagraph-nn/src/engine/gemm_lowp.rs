//! Half-precision matrix products on tensor cores: [`gemm_lowp`] runs a [`GemmOp`] with A and
//! B in bf16 or f16 and C (and the epilogue's vector) in that type or f32, products
//! accumulated in f32, by the engine the registry measured for its key. The fp32 products
//! stay in [`crate::engine::gemm`] (`run_gemm`); the only kernel of ours here is the few-row
//! one (`gemv:KS`, below).
//!
//! Candidates, measured per key like the fp32 ones (the key adds the element types, and above
//! [`SHARED_ROWS_ABOVE`] rows names the range of row counts that share the choice,
//! [`rows_range`]: `gemm NT m=3585..4096 n=4096 k=4096 a=1 b=0 ep=bias in=bf16 out=f32`): cuBLASLt's heuristic
//! algorithms for the shape and types (the first twelve, as for fp32), with
//! `CUDAGRAPH_LT_SPLITK=1` their split-K variants and with `CUDAGRAPH_LT_SEARCH=1` searched
//! configurations, and cuBLAS's `cublasGemmEx` for products without a fused bias (what
//! `torch.matmul` calls on bf16 tensors), and, for decode-sized products, our memory-bound
//! few-row kernels `gemv:KS` ([`gemv_splits`] says when: `x·wᵀ`, at most [`GEMV_MAX_M`] rows,
//! k a multiple of 8, 16-byte aligned pointers, no bias gradient) and `gemv-mma:KS`, their
//! tensor-core variant (the same, up to [`GEMV_MMA_MAX_M`] rows: [`gemv_mma_splits`]).
//! Epilogues: none, bias, bias+ReLU, bias+GELU (GELU in
//! cuBLASLt's tanh approximation, `gelu(approximate="tanh")` in PyTorch) and the bias gradient,
//! fused by cuBLASLt (`BGRADB`) where it offers that for the types, otherwise a second product
//! `db = 1ᵀ·A` on the same libraries (f32 accumulation there too). Inside a capture with
//! nothing measured for the key, cuBLASLt's first heuristic algorithm runs (cuBLAS where
//! cuBLASLt is unavailable, then our few-row kernel where it takes the product).
//!
//! The epilogue, as cuBLASLt computes it (`D = act(alpha·op(A)·op(B) + beta·C + bias)`: its
//! bias epilogues add the bias to the scaled product and the scaled C, then apply the
//! activation), is what `gemv:KS` does in f32: `alpha·Σ`, plus `beta·C` (C read only when
//! beta ≠ 0, and in place: the result overwrites C), plus the bias, then ReLU or GELU, then
//! one rounding to the result type.
//!
//! No partial sum is ever added in 16 bits: cuBLASLt keeps only algorithms whose split-K
//! reductions are in the compute type when D is bf16 or f16, and cuBLAS runs with
//! `CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION`.
//!
//! ```no_run
//! use cudagraph::memory::bf16;
//! use cudagraph::{Device, QueueExt};
//! use cudagraph_nn::engine::gemm::{Epilogue, GemmOp, Trans};
//! use cudagraph_nn::engine::gemm_lowp;
//! use cudagraph_nn::Nn;
//! # fn main() -> cudagraph_nn::Result<()> {
//! let dev = Device::open(0)?;
//! let s = dev.new_stream()?;
//! let nn = Nn::get(&dev)?;
//! let (m, n, k) = (64, 1024, 512);
//! let x = s.alloc_from_host(&vec![bf16::from_f32(0.5); m * k])?;
//! let w = s.alloc_from_host(&vec![bf16::from_f32(0.25); n * k])?;
//! let bias = s.alloc_from_host(&vec![bf16::from_f32(1.0); n])?;
//! let y = s.alloc::<bf16>(m * n)?;
//! // y = gelu(x·wᵀ + bias), x: [m, k], w: [n, k].
//! let op = GemmOp {
//!     ta: Trans::N,
//!     tb: Trans::T,
//!     m,
//!     n,
//!     k,
//!     alpha: 1.0,
//!     beta: 0.0,
//!     epilogue: Epilogue::BiasGelu,
//! };
//! let engine = gemm_lowp(&s, &nn, &op, &x, &w, &y, Some(&bias))?;
//! println!("ran on {engine}");
//! # Ok(()) }
//! ```

use cudagraph::{DeviceBuffer, Queue, QueueExt};

use crate::dtype::{Dtype, Float};
use crate::engine::gemm::{
    lt_required, lt_shape, run_transposed, scratch_output, transposed_candidates, Epilogue, GemmOp,
    Trans,
};
use crate::engine::{Engines, GemmEngine, GemmFamily, Policy};
use crate::error::{NnError, Result};
use crate::extent::{alignment, gemm_on_device, need, prod};
use crate::ffi::blaslt::{LtAlgo, LtTypes, MEASURED_ALGOS};
use crate::kernels::gemv::{
    few_row_ok, fused_ok, FewRow, GemvKernels, RowsFrom, GEMV_FUSED_MAX_M, GEMV_SPLITS,
};
pub use crate::kernels::gemv::{GEMV_MAX_M, GEMV_MMA_MAX_M};
use crate::kernels::Nn;

/// Row-major `C[m×n] = epilogue(alpha·op(A)·op(B) + beta·C)` with A and B of `T` (bf16 or
/// f16) and C of `O` (`T` or f32), on tensor cores with f32 accumulation, by the registry's
/// engine for the product's key (measured on the first eager call; see the module docs).
/// Conventions as [`run_gemm`](crate::engine::gemm::run_gemm): op(A) is m×k (`ta`: A stored
/// k×m), op(B) k×n (`tb`: B stored n×k); `vec` is the bias (`Bias`, `BiasRelu`, `BiasGelu`,
/// length n) or the bias-gradient output (`BiasGrad`, length m, A transposed, alpha 1).
/// Returns the engine that ran.
///
/// Errors, before anything runs: `T` = f32 or `O` neither `T` nor f32
/// ([`NnError::NotSupported`]: f32 products go through `run_gemm`), a buffer shorter than the
/// product needs or a vector that does not match the epilogue (`SizeMismatch`, `Shape`), a
/// buffer of another device (`WrongDevice`), k = 0, and a product no engine can run here (an
/// epilogue without cuBLASLt, e.g. inside a capture before cuBLASLt was opened by an eager
/// call; a shape cuBLASLt has no algorithm for).
#[allow(clippy::too_many_arguments)]
pub fn gemm_lowp<T: Float, O: Float>(
    q: &dyn Queue,
    _nn: &Nn,
    op: &GemmOp,
    a: &DeviceBuffer<T>,
    b: &DeviceBuffer<T>,
    c: &DeviceBuffer<O>,
    vec: Option<&DeviceBuffer<O>>,
) -> Result<GemmEngine> {
    // SAFETY: `frozen` off: nothing is read early.
    unsafe { product(q, op, a, b, c, vec, false) }
}

/// [`gemm_lowp`] with a `b` nothing writes any more (a loaded model's weights): where our
/// few-row kernel runs the product inside a capture, it starts reading `b` before the
/// previous kernel has finished (see [`GemvKernels::run_early`]). Same engines, same results.
///
/// # Safety
/// The promise of [`GemvKernels::run_early`] for `b`.
pub(crate) unsafe fn gemm_lowp_frozen<T: Float, O: Float>(
    q: &dyn Queue,
    op: &GemmOp,
    a: &DeviceBuffer<T>,
    b: &DeviceBuffer<T>,
    c: &DeviceBuffer<O>,
    vec: Option<&DeviceBuffer<O>>,
) -> Result<GemmEngine> {
    // SAFETY: the caller's promise.
    unsafe { product(q, op, a, b, c, vec, true) }
}

/// [`gemm_lowp_frozen`] of the rows `from` describes, which the caller would otherwise
/// write into `a` first: where the registry's engine for the product on `a` is our lane
/// kernel (`gemv:KS`) and its fused form takes the shape ([`fused_ok`]: few rows, and a grid
/// that fits the device at once, where the launch saved is worth more than every block
/// computing the rows again; [`GemvKernels::run_from`]), one
/// launch computes the rows and the product with the bits of the two steps, and this returns
/// true (`a` is not written); otherwise nothing runs and it returns false — including before
/// the key is measured, so the first eager call of a shape runs the two steps and measures,
/// and for a norm with a residual add but no buffer for its sums.
///
/// # Safety
/// The promise of [`gemm_lowp_frozen`] for `b`.
#[allow(clippy::type_complexity)]
pub(crate) unsafe fn gemm_lowp_frozen_from<T: Float, O: Float>(
    q: &dyn Queue,
    op: &GemmOp,
    from: &RowsFrom<'_, T>,
    (a, b, c, vec): (
        &DeviceBuffer<T>,
        &DeviceBuffer<T>,
        &DeviceBuffer<O>,
        Option<&DeviceBuffer<O>>,
    ),
) -> Result<bool> {
    if op.m > GEMV_FUSED_MAX_M {
        // Never fused: the caller's two launches check the product (no lookups twice).
        return Ok(false);
    }
    validate(q, op, a, b, c, vec)?;
    if op.m == 0 || op.n == 0 || op.ta != Trans::N || op.tb != Trans::T {
        return Ok(false);
    }
    if let RowsFrom::Norm {
        add: Some(_),
        sum: None,
        ..
    } = from
    {
        // Nowhere for the residual sums (the norm kernel writes them into its input).
        return Ok(false);
    }
    let eng = Engines::get(q.device())?;
    // Few rows (at most `GEMV_FUSED_MAX_M`): the key is the row count's own.
    let (key, _, _, _) = product_key(&eng, op, (a, b, c, vec));
    let Some(GemmEngine::Gemv(ks)) = eng.lookup::<GemmEngine>(&key) else {
        return Ok(false);
    };
    let info = q.device().info();
    let dev = (
        info.max_shared_memory_per_block as usize,
        info.multiprocessors as usize,
    );
    let norm = matches!(from, RowsFrom::Norm { .. });
    if !fused_ok::<T>(norm, (op.m, op.n, op.k), ks, op.epilogue, dev) {
        return Ok(false);
    }
    let gemv = GemvKernels::get(q.device())?;
    let (dims, scales) = ((op.m, op.n, op.k), (op.alpha, op.beta));
    // SAFETY: the caller's promise for `b`.
    unsafe { gemv.run_from_early(q, dims, scales, op.epilogue, from, b, (c, vec), ks)? };
    Ok(true)
}

/// The registry keys of `op` on these buffers under the current policy — the key of its
/// rows' range ([`rows_range`]) and, where that is not the product's own row count, the key
/// of its own — with the family of engines it allows and the buffers' common alignment.
#[allow(clippy::type_complexity)]
fn product_key<T: Float, O: Float>(
    eng: &Engines,
    op: &GemmOp,
    (a, b, c, vec): (
        &DeviceBuffer<T>,
        &DeviceBuffer<T>,
        &DeviceBuffer<O>,
        Option<&DeviceBuffer<O>>,
    ),
) -> (String, Option<String>, GemmFamily, u32) {
    let policy = eng.policy();
    let family = lowp_family(policy.gemm, op.epilogue);
    let mut addrs = vec![a.addr(), b.addr(), c.addr()];
    addrs.extend(vec.map(|v| v.addr()));
    let align = alignment(&addrs);
    let scoped = |base: String| registry_key(base, align, &policy, family);
    let key = scoped(key(op, T::DTYPE, O::DTYPE));
    let exact = rows_range(op.m).map(|_| scoped(typed(op.key(), T::DTYPE, O::DTYPE)));
    (key, exact, family, align)
}

/// [`gemm_lowp`]; `frozen`: `b` may be read early by the few-row kernel.
///
/// # Safety
/// With `frozen`, the promise of [`gemm_lowp_frozen`].
unsafe fn product<T: Float, O: Float>(
    q: &dyn Queue,
    op: &GemmOp,
    a: &DeviceBuffer<T>,
    b: &DeviceBuffer<T>,
    c: &DeviceBuffer<O>,
    vec: Option<&DeviceBuffer<O>>,
    frozen: bool,
) -> Result<GemmEngine> {
    validate(q, op, a, b, c, vec)?;
    if op.m == 0 || op.n == 0 {
        // Nothing to write (as `run_gemm`).
        return Ok(GemmEngine::Cublas);
    }
    let eng = Engines::get(q.device())?;
    let (shared, exact, family, align) = product_key(&eng, op, (a, b, c, vec));
    // A key of a range of row counts needs the candidates of this one: its choice, made by
    // another row count, serves this one only if it can run it.
    let mut candidates = None;
    let key = match &exact {
        None => shared,
        Some(exact) => {
            let c = candidates_in::<T, O>(q, &eng, op, family, align)?;
            let key = eng.shared_or_exact(shared, exact.clone(), &c);
            candidates = Some(c);
            key
        }
    };
    if let Some(algo) = eng.lookup::<GemmEngine>(&key) {
        // SAFETY: `frozen` only as this function's caller promised.
        unsafe { run_lowp(q, &eng, algo, op, align, (a, b, c, vec), frozen)? };
        return Ok(algo);
    }
    let candidates = match candidates {
        Some(c) => c,
        None => candidates_in::<T, O>(q, &eng, op, family, align)?,
    };
    let Some(&default) = candidates.first() else {
        return Err(no_engine(op, &key, eng.cublaslt_for(q).is_some()));
    };
    let mut scratch = None;
    let algo = eng.choose(
        q,
        &key,
        exact.as_deref(),
        &candidates,
        default,
        &mut |q, algo| {
            let (cs, v) = scratch_output(q, op, &mut scratch, vec)?;
            // SAFETY: `frozen` off.
            unsafe { run_lowp(q, &eng, algo, op, align, (a, b, cs, v), false) }
        },
    )?;
    // SAFETY: `frozen` only as this function's caller promised.
    unsafe { run_lowp(q, &eng, algo, op, align, (a, b, c, vec), frozen)? };
    Ok(algo)
}

/// Runs `op` with exactly `algo`, without the registry (tests, benchmarks): the checks of
/// [`gemm_lowp`], then an error where `algo` cannot run the product (one of our fp32 kernels,
/// cuBLAS with a fused bias, a cuBLASLt rank, variant or configuration the plan does not
/// have); nothing runs then.
#[allow(clippy::too_many_arguments)]
pub fn gemm_lowp_with<T: Float, O: Float>(
    q: &dyn Queue,
    _nn: &Nn,
    algo: GemmEngine,
    op: &GemmOp,
    a: &DeviceBuffer<T>,
    b: &DeviceBuffer<T>,
    c: &DeviceBuffer<O>,
    vec: Option<&DeviceBuffer<O>>,
) -> Result<()> {
    validate(q, op, a, b, c, vec)?;
    if op.m == 0 || op.n == 0 {
        return Ok(());
    }
    let eng = Engines::get(q.device())?;
    let mut addrs = vec![a.addr(), b.addr(), c.addr()];
    addrs.extend(vec.map(|v| v.addr()));
    // SAFETY: `frozen` off.
    unsafe { run_lowp(q, &eng, algo, op, alignment(&addrs), (a, b, c, vec), false) }
}

/// The engines the registry measures for `op` with operands of `T` and a result of `O` on
/// `q`'s device under its policy, for pointers aligned to `align` bytes
/// ([`crate::engine::gemm::alignment`]): cuBLASLt's first, then cuBLAS (see the
/// module docs). Empty where nothing can run it.
pub fn lowp_candidates<T: Float, O: Float>(
    q: &dyn Queue,
    op: &GemmOp,
    align: u32,
) -> Result<Vec<GemmEngine>> {
    check_dtypes(T::DTYPE, O::DTYPE)?;
    check_op(op)?;
    let eng = Engines::get(q.device())?;
    let family = lowp_family(eng.policy().gemm, op.epilogue);
    candidates_in::<T, O>(q, &eng, op, family, align)
}

/// Products of more rows than this share their registry choice with the other row counts of
/// their range ([`rows_range`]); up to it — decode steps, where our few-row kernels compete —
/// every row count has a choice of its own.
pub const SHARED_ROWS_ABOVE: usize = GEMV_MMA_MAX_M;

/// The range of row counts, `(first, last)`, whose products share one registry choice with a
/// product of `m` rows; `None` up to [`SHARED_ROWS_ABOVE`] rows, where each row count has its
/// own. Above it the ranges are quarter octaves: `last` is the first multiple of `p / 4` at or
/// above `m`, where `p` is the largest power of two below `m` (65–80, 81–96, 97–112,
/// 113–128, 129–160, …, 897–1024, …), so a choice measured for one row count serves counts
/// within 25 % of it. A prefill's row count (its prompts' tokens) differs from one request to
/// the next; without ranges each new count measured every candidate of every product, a
/// stall of hundreds of milliseconds for a server.
pub fn rows_range(m: usize) -> Option<(usize, usize)> {
    if m <= SHARED_ROWS_ABOVE {
        return None;
    }
    let p = 1usize << (usize::BITS - 1 - (m - 1).leading_zeros());
    let step = p / 4;
    let last = m.div_ceil(step).saturating_mul(step);
    Some((last - step + 1, last))
}

/// The registry key of a half-precision product without the alignment and policy parts:
/// [`GemmOp::key`] with the row count's range where products of several row counts share
/// the choice ([`rows_range`]), and the element types, e.g.
/// `gemm NT m=32 n=512 k=1024 a=1 b=0 ep=bias in=bf16 out=f32` or
/// `gemm NT m=897..1024 n=2304 k=768 a=1 b=0 ep=bias in=bf16 out=bf16`.
pub fn key(op: &GemmOp, input: Dtype, output: Dtype) -> String {
    let base = match rows_range(op.m) {
        Some((first, last)) => op.key_with_rows(&format!("{first}..{last}")),
        None => op.key(),
    };
    typed(base, input, output)
}

/// `base` with the element types.
fn typed(base: String, input: Dtype, output: Dtype) -> String {
    format!("{base} in={input} out={output}")
}

/// The whole key: `base` (a [`key`]), the pointers' alignment where it is not the
/// allocator's 256 bytes, and the policy's restrictions that apply to half-precision
/// products (the family `family`, cuBLASLt off, split-K, search; not TF32, which changes
/// nothing here).
fn registry_key(base: String, align: u32, policy: &Policy, family: GemmFamily) -> String {
    let scope = Policy {
        tf32_matmul: false,
        ..*policy
    }
    .gemm_scope(family);
    match align {
        256 => format!("{base}{scope}"),
        a => format!("{base} align={a}{scope}"),
    }
}

/// The family a policy's `CUDAGRAPH_GEMM` means for a half-precision product: cuBLAS or
/// cuBLASLt alone where it names one of them (cuBLAS only for products without a fused bias,
/// which it cannot add), every engine otherwise (our kernels are fp32 only).
pub fn lowp_family(policy: GemmFamily, epilogue: Epilogue) -> GemmFamily {
    match policy {
        GemmFamily::CublasLt => GemmFamily::CublasLt,
        GemmFamily::Cublas if cublas_runs(epilogue) => GemmFamily::Cublas,
        _ => GemmFamily::Auto,
    }
}

/// Whether cuBLAS can run a product with `epilogue` (no fused bias: the bias gradient is a
/// second product).
fn cublas_runs(epilogue: Epilogue) -> bool {
    matches!(epilogue, Epilogue::None | Epilogue::BiasGrad)
}

/// `T` and `O` are a pair [`gemm_lowp`] takes: `T` bf16 or f16, `O` the same or f32.
pub fn check_dtypes(input: Dtype, output: Dtype) -> Result<()> {
    match input {
        Dtype::F32 => Err(NnError::NotSupported {
            op: "gemm_lowp",
            what: format!("operands of f32 (with a result of {output})"),
            fix: "run f32 products with engine::gemm::run_gemm",
        }),
        t if output == t || output == Dtype::F32 => Ok(()),
        t => Err(NnError::NotSupported {
            op: "gemm_lowp",
            what: format!("operands of {t} with a result of {output}"),
            fix: "ask for a result of the operands' type or f32 (cast one side first to mix \
                  bf16 and f16)",
        }),
    }
}

/// Every check before anything runs: element types, k and the alpha of a bias gradient
/// ([`check_op`]), lengths, the epilogue's vector (its length; A transposed for a bias
/// gradient) and devices.
fn validate<T: Float, O: Float>(
    q: &dyn Queue,
    op: &GemmOp,
    a: &DeviceBuffer<T>,
    b: &DeviceBuffer<T>,
    c: &DeviceBuffer<O>,
    vec: Option<&DeviceBuffer<O>>,
) -> Result<()> {
    check_dtypes(T::DTYPE, O::DTYPE)?;
    check_op(op)?;
    need("gemm A", a, prod("gemm A", &[op.m, op.k])?)?;
    need("gemm B", b, prod("gemm B", &[op.k, op.n])?)?;
    need("gemm C", c, prod("gemm C", &[op.m, op.n])?)?;
    op.check_vec(vec.map(|v| v.len()))?;
    gemm_on_device(q, a, b, c, vec)
}

/// What [`gemm_lowp`] refuses of an op whatever its buffers: k = 0 with something to write
/// (cuBLASLt multiplies no empty operands), a bias gradient scaled by alpha (the fused and
/// the separate reduction would disagree on whether alpha applies).
pub fn check_op(op: &GemmOp) -> Result<()> {
    if op.k == 0 && op.m > 0 && op.n > 0 {
        return Err(NnError::Shape(format!(
            "gemm_lowp: k = 0 (nothing to multiply) in {}; scale C directly instead",
            op.key()
        )));
    }
    if op.epilogue == Epilogue::BiasGrad && op.alpha != 1.0 {
        return Err(NnError::Shape(format!(
            "gemm_lowp: a fused bias gradient needs alpha 1 (got {}); scale the product \
             separately",
            op.alpha
        )));
    }
    Ok(())
}

fn no_engine(op: &GemmOp, key: &str, have_lt: bool) -> NnError {
    let why = if have_lt {
        "cuBLASLt offers no algorithm for this shape and these types (its heuristic returned \
         none: a misaligned leading dimension with this epilogue?), and cuBLAS adds no fused \
         bias"
    } else if matches!(op.epilogue, Epilogue::None | Epilogue::BiasGrad) {
        "neither cuBLASLt nor cuBLAS can run it"
    } else {
        "a fused bias needs cuBLASLt, which is missing, disabled by the engine policy, or \
         not opened yet inside this capture (run the product once eagerly before capturing)"
    };
    NnError::Library {
        library: "engine registry",
        call: "gemm_lowp",
        status: format!("no engine can run {key}: {why}"),
    }
}

/// The engines that can run `op` with these types within `family`, cuBLASLt's heuristic
/// algorithms first (the first is the default inside a capture), then its opt-in variants,
/// then cuBLAS, then our few-row kernels' depth splits ([`gemv_splits`], [`gemv_mma_splits`]).
/// Inside a capture, cuBLASLt is a candidate only if it was opened before.
fn candidates_in<T: Float, O: Float>(
    q: &dyn Queue,
    eng: &Engines,
    op: &GemmOp,
    family: GemmFamily,
    align: u32,
) -> Result<Vec<GemmEngine>> {
    let allowed = |e: GemmFamily| family == GemmFamily::Auto || family == e;
    let mut v = Vec::new();
    if allowed(GemmFamily::CublasLt) {
        if let Some(lt) = eng.cublaslt_for(q) {
            let shape = lt_shape(op, align);
            let types = LtTypes::new(T::DTYPE, O::DTYPE, None)?;
            // A shape cuBLASLt cannot plan simply has no cuBLASLt candidate.
            let count = lt.algo_count_typed(&shape, types).map_or(0, |(n, _)| n);
            v.extend((0..count.min(MEASURED_ALGOS)).map(|r| GemmEngine::CublasLt(r as u8)));
            v.extend(transposed_candidates::<O>(op, align, |s| {
                lt.algo_count_typed(s, types).map_or(0, |(n, _)| n)
            }));
            if count > 0 && eng.policy().lt_split_k {
                let variants = lt.split_k_variants_typed(&shape, types).unwrap_or_default();
                v.extend(
                    variants
                        .into_iter()
                        .map(|(rank, split)| GemmEngine::CublasLtSplitK { rank, split }),
                );
            }
            if eng.policy().lt_search {
                let configs = lt
                    .search_configs_typed(&shape, types)
                    .map_or(0, |c| c.len());
                v.extend(
                    (0..configs.min(u8::MAX as usize + 1))
                        .map(|i| GemmEngine::CublasLtConfig(i as u8)),
                );
            }
        }
    }
    if allowed(GemmFamily::Cublas) && cublas_runs(op.epilogue) {
        v.push(GemmEngine::Cublas);
    }
    if allowed(GemmFamily::Rows) {
        v.extend(gemv_splits(op, align).into_iter().map(GemmEngine::Gemv));
        v.extend(
            gemv_mma_splits(op, align)
                .into_iter()
                .map(GemmEngine::GemvMma),
        );
    }
    Ok(v)
}

/// The depth splits of our few-row kernel (`gemv:KS`) offered for `op` with pointers aligned
/// to `align` bytes: none unless `op` is `x·wᵀ` (A not transposed, B transposed: x `[m, k]`,
/// w `[n, k]`) with 1 ≤ m ≤ [`GEMV_MAX_M`], k a multiple of 8, every pointer 16-byte aligned
/// and the epilogue none, bias, bias + ReLU or bias + GELU (any alpha and beta); then one
/// warp per column (1), and 2, 4 or 8 warps splitting each column's depth where every warp
/// still has at least one 16-byte vector per lane (k ≥ 256·KS).
pub fn gemv_splits(op: &GemmOp, align: u32) -> Vec<u8> {
    few_row_splits(FewRow::Lanes(1), op, align, 256)
}

/// The depth splits of the tensor-core few-row kernel (`gemv-mma:KS`) offered for `op`: as
/// [`gemv_splits`] with up to [`GEMV_MMA_MAX_M`] rows; one warp per 16-column tile (1), and
/// 2, 4 or 8 where every warp still has at least two chunks of 32 (k ≥ 64·KS).
pub fn gemv_mma_splits(op: &GemmOp, align: u32) -> Vec<u8> {
    few_row_splits(FewRow::Mma(1), op, align, 64)
}

/// The splits of `kernel` for `op`: none unless the layout, alignment and shape suit it; 1,
/// and each larger split KS with k ≥ `depth`·KS.
fn few_row_splits(kernel: FewRow, op: &GemmOp, align: u32, depth: usize) -> Vec<u8> {
    let layout = op.ta == Trans::N && op.tb == Trans::T;
    if !layout || align < 16 || op.n == 0 || !few_row_ok(kernel, op.m, op.k, op.epilogue) {
        return Vec::new();
    }
    GEMV_SPLITS
        .into_iter()
        .filter(|&ks| ks == 1 || op.k >= depth * ks as usize)
        .collect()
}

/// Runs `op` with exactly `algo`; `frozen`: `b` may be read early by the few-row kernel.
///
/// # Safety
/// With `frozen`, the promise of [`gemm_lowp_frozen`].
#[allow(clippy::type_complexity)]
unsafe fn run_lowp<T: Float, O: Float>(
    q: &dyn Queue,
    eng: &Engines,
    algo: GemmEngine,
    op: &GemmOp,
    align: u32,
    (a, b, c, vec): (
        &DeviceBuffer<T>,
        &DeviceBuffer<T>,
        &DeviceBuffer<O>,
        Option<&DeviceBuffer<O>>,
    ),
    frozen: bool,
) -> Result<()> {
    let few_row = match algo {
        GemmEngine::Gemv(ks) => Some(FewRow::Lanes(ks)),
        GemmEngine::GemvMma(ks) => Some(FewRow::Mma(ks)),
        _ => None,
    };
    if let Some(kernel) = few_row {
        if op.ta != Trans::N || op.tb != Trans::T {
            return Err(NnError::NotSupported {
                op: "gemm_lowp",
                what: format!("engine {algo} for {} (it runs x·wᵀ only: NT)", op.key()),
                fix: "use a cuBLASLt or cuBLAS engine for other layouts",
            });
        }
        let dims = (op.m, op.n, op.k);
        let gemv = GemvKernels::get(q.device())?;
        let scales = (op.alpha, op.beta);
        return match frozen {
            // SAFETY: the promise of this function's caller for `b`.
            true => unsafe { gemv.run_early(q, dims, scales, op.epilogue, a, b, c, vec, kernel) },
            false => gemv.run(q, dims, scales, op.epilogue, a, b, c, vec, kernel),
        };
    }
    let which = match algo {
        GemmEngine::Cublas => {
            if !cublas_runs(op.epilogue) {
                return Err(NnError::NotSupported {
                    op: "gemm_lowp",
                    what: format!("cuBLAS with a fused bias ({})", op.key()),
                    fix: "use a cuBLASLt engine for products with a bias epilogue",
                });
            }
            let (dims, (alpha, beta)) = ((op.m, op.n, op.k), (op.alpha, op.beta));
            eng.blas()?
                .gemm_ex(q, op.ta, op.tb, dims, alpha, a, b, beta, c)?;
            return match (op.epilogue, vec) {
                (Epilogue::BiasGrad, Some(db)) => bias_grad(q, eng, op, a, db),
                _ => Ok(()),
            };
        }
        GemmEngine::CublasLt(rank) => LtAlgo::Rank(rank as usize),
        GemmEngine::CublasLtSplitK { rank, split } => LtAlgo::SplitK { rank, split },
        GemmEngine::CublasLtConfig(i) => LtAlgo::Config(i),
        GemmEngine::CublasLtTransposed(rank) => {
            let lt = lt_required(eng)?;
            let which = LtAlgo::Rank(rank as usize);
            // `t` has no epilogue: no vector.
            let none: Option<&DeviceBuffer<O>> = None;
            return run_transposed(q, op, c, |t, scratch| {
                let shape = lt_shape(t, align);
                lt.matmul_typed(q, &shape, which, t.alpha, b, a, 0.0, scratch, none)
            });
        }
        other => {
            return Err(NnError::NotSupported {
                op: "gemm_lowp",
                what: format!("engine {other} (our kernels are fp32 only)"),
                fix: "use cuBLAS or a cuBLASLt engine for half-precision products",
            })
        }
    };
    let lt = lt_required(eng)?;
    let shape = lt_shape(op, align);
    let fused = lt.matmul_typed(q, &shape, which, op.alpha, a, b, op.beta, c, vec)?;
    match (op.epilogue, vec) {
        (Epilogue::BiasGrad, Some(db)) if !fused => bias_grad(q, eng, op, a, db),
        _ => Ok(()),
    }
}

/// The bias gradient where no engine fused it: the row sums of op(A) (A stored k×m) as the
/// product `db[1×m] = 1[1×k]·A[k×m]`, on cuBLASLt's first algorithm where it has one (cuBLAS
/// otherwise), accumulated in f32 and rounded once to `O`. The ones come from the queue (the
/// graph's pool inside a capture), filled by a memset node.
fn bias_grad<T: Float, O: Float>(
    q: &dyn Queue,
    eng: &Engines,
    op: &GemmOp,
    a: &DeviceBuffer<T>,
    db: &DeviceBuffer<O>,
) -> Result<()> {
    let ones = ones::<T>(q, op.k)?;
    let sum = GemmOp {
        ta: Trans::N,
        tb: Trans::N,
        m: 1,
        n: op.m,
        k: op.k,
        alpha: 1.0,
        beta: 0.0,
        epilogue: Epilogue::None,
    };
    let align = alignment(&[ones.addr(), a.addr(), db.addr()]);
    let shape = lt_shape(&sum, align);
    if let Some(lt) = eng.cublaslt_for(q) {
        let types = LtTypes::new(T::DTYPE, O::DTYPE, None)?;
        if lt.algo_count_typed(&shape, types).is_ok_and(|(n, _)| n > 0) {
            let none = None::<&DeviceBuffer<O>>;
            lt.matmul_typed(q, &shape, LtAlgo::Rank(0), 1.0, &ones, a, 0.0, db, none)?;
            return Ok(());
        }
    }
    let dims = (sum.m, sum.n, sum.k);
    eng.blas()?
        .gemm_ex(q, sum.ta, sum.tb, dims, 1.0, &ones, a, 0.0, db)
}

/// `len` ones of `T` (one memset of 32-bit words holding two each).
fn ones<T: Float>(q: &dyn Queue, len: usize) -> Result<DeviceBuffer<T>> {
    let one = T::from_f32(1.0);
    let bytes = T::as_bytes(std::slice::from_ref(&one));
    let half = u16::from_le_bytes([bytes[0], bytes.get(1).copied().unwrap_or(0)]) as u32;
    let words = len.div_ceil(2).max(1);
    let block = q.alloc_block(prod("gemm_lowp ones", &[words, 4])?)?;
    let w = DeviceBuffer::<u32>::from_block(block.clone(), words)?;
    q.fill32(&w, 0, words, half | (half << 16))?;
    Ok(DeviceBuffer::<T>::from_block(block, len)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(ep: Epilogue) -> GemmOp {
        GemmOp {
            epilogue: ep,
            ..GemmOp::linear(32, 512, 1024)
        }
    }

    #[test]
    fn keys_add_the_element_types_to_the_f32_key() {
        assert_eq!(
            key(&op(Epilogue::Bias), Dtype::Bf16, Dtype::F32),
            "gemm NT m=32 n=512 k=1024 a=1 b=0 ep=bias in=bf16 out=f32"
        );
        assert_eq!(
            key(&op(Epilogue::BiasGelu), Dtype::F16, Dtype::F16),
            "gemm NT m=32 n=512 k=1024 a=1 b=0 ep=bias_gelu in=f16 out=f16"
        );
        // Alignment and policy parts follow, as for f32; TF32 is not one of them.
        let p = Policy::default();
        let o = op(Epilogue::None);
        let bf = || key(&o, Dtype::Bf16, Dtype::Bf16);
        assert_eq!(
            registry_key(bf(), 256, &p, GemmFamily::Auto),
            "gemm NT m=32 n=512 k=1024 a=1 b=0 ep=none in=bf16 out=bf16"
        );
        let tf32 = Policy {
            tf32_matmul: true,
            ..p
        };
        assert_eq!(
            registry_key(bf(), 256, &tf32, GemmFamily::Auto),
            registry_key(bf(), 256, &p, GemmFamily::Auto)
        );
        let k = registry_key(
            key(&o, Dtype::F16, Dtype::F32),
            16,
            &p,
            GemmFamily::CublasLt,
        );
        assert!(k.starts_with("gemm NT m=32 n=512 k=1024 a=1 b=0 ep=none in=f16 out=f32 align=16"));
        assert!(k.contains("cublaslt"), "{k}");
        // Different types never share a key.
        assert_ne!(
            key(&o, Dtype::Bf16, Dtype::Bf16),
            key(&o, Dtype::Bf16, Dtype::F32)
        );
        assert_ne!(
            key(&o, Dtype::Bf16, Dtype::F32),
            key(&o, Dtype::F16, Dtype::F32)
        );
    }

    #[test]
    fn row_counts_above_the_few_row_shapes_share_quarter_octaves() {
        for m in 0..=SHARED_ROWS_ABOVE {
            assert_eq!(rows_range(m), None, "{m}");
        }
        assert_eq!(rows_range(65), Some((65, 80)));
        assert_eq!(rows_range(80), Some((65, 80)));
        assert_eq!(rows_range(81), Some((81, 96)));
        assert_eq!(rows_range(128), Some((113, 128)));
        assert_eq!(rows_range(129), Some((129, 160)));
        assert_eq!(rows_range(1000), Some((897, 1024)));
        assert_eq!(rows_range(1025), Some((1025, 1280)));
        // Every count above the limit is in its range; consecutive ranges meet, each
        // spanning at most 25 % of its first count.
        let mut next = SHARED_ROWS_ABOVE + 1;
        for m in SHARED_ROWS_ABOVE + 1..20_000 {
            let (first, last) = rows_range(m).unwrap();
            assert!(first <= m && m <= last, "{m}: {first}..{last}");
            if m == first {
                assert_eq!(first, next, "{m}");
                next = last + 1;
            }
            assert!(4 * (last - first + 1) < first, "{m}: {first}..{last}");
        }
        assert!(rows_range(usize::MAX).is_some());
        // Keys: the range in place of the count, the same for every count of a range.
        let o = |m| GemmOp::linear(m, 2304, 768);
        assert_eq!(
            key(&o(1000), Dtype::Bf16, Dtype::Bf16),
            "gemm NT m=897..1024 n=2304 k=768 a=1 b=0 ep=none in=bf16 out=bf16"
        );
        assert_eq!(
            key(&o(897), Dtype::Bf16, Dtype::Bf16),
            key(&o(1024), Dtype::Bf16, Dtype::Bf16)
        );
        assert_ne!(
            key(&o(896), Dtype::Bf16, Dtype::Bf16),
            key(&o(897), Dtype::Bf16, Dtype::Bf16)
        );
        assert_eq!(
            key(&o(64), Dtype::F16, Dtype::F32),
            "gemm NT m=64 n=2304 k=768 a=1 b=0 ep=none in=f16 out=f32"
        );
    }

    #[test]
    fn only_half_precision_operands_with_their_own_or_an_f32_result_are_taken() {
        for (i, o) in [
            (Dtype::Bf16, Dtype::Bf16),
            (Dtype::Bf16, Dtype::F32),
            (Dtype::F16, Dtype::F16),
            (Dtype::F16, Dtype::F32),
        ] {
            check_dtypes(i, o).unwrap();
            LtTypes::new(i, o, None).unwrap();
            LtTypes::new(i, o, Some(Dtype::F32)).unwrap();
        }
        for (i, o) in [
            (Dtype::F32, Dtype::F32),
            (Dtype::F32, Dtype::Bf16),
            (Dtype::Bf16, Dtype::F16),
            (Dtype::F16, Dtype::Bf16),
        ] {
            let e = check_dtypes(i, o).unwrap_err();
            assert!(
                matches!(
                    e,
                    NnError::NotSupported {
                        op: "gemm_lowp",
                        ..
                    }
                ),
                "{i} → {o}: {e}"
            );
        }
        let e = check_dtypes(Dtype::F32, Dtype::F32)
            .unwrap_err()
            .to_string();
        assert!(e.contains("run_gemm"), "{e}");
        // cuBLASLt's table: f32 with f32 only; a vector of a third type is refused.
        assert!(LtTypes::new(Dtype::F32, Dtype::Bf16, None).is_err());
        assert!(LtTypes::new(Dtype::F32, Dtype::F32, Some(Dtype::Bf16)).is_err());
        assert!(LtTypes::new(Dtype::Bf16, Dtype::Bf16, Some(Dtype::F16)).is_err());
        assert!(LtTypes::new(Dtype::Bf16, Dtype::F32, Some(Dtype::Bf16)).is_err());
        assert_eq!(
            LtTypes::new(Dtype::F32, Dtype::F32, None).unwrap(),
            LtTypes::F32
        );
        // Products without a vector share the plan of their D type's vector.
        let t = LtTypes::new(Dtype::Bf16, Dtype::Bf16, Some(Dtype::F32)).unwrap();
        assert_eq!(t.for_epilogue(Epilogue::None).bias, Dtype::Bf16);
        assert_eq!(t.for_epilogue(Epilogue::Bias).bias, Dtype::F32);
    }

    #[test]
    fn the_policy_family_restricts_to_the_libraries_that_can_run_the_product() {
        use GemmFamily as F;
        assert_eq!(lowp_family(F::Auto, Epilogue::Bias), F::Auto);
        assert_eq!(lowp_family(F::CublasLt, Epilogue::None), F::CublasLt);
        assert_eq!(lowp_family(F::Cublas, Epilogue::None), F::Cublas);
        assert_eq!(lowp_family(F::Cublas, Epilogue::BiasGrad), F::Cublas);
        // cuBLAS adds no bias, our kernels run no half precision: every engine.
        assert_eq!(lowp_family(F::Cublas, Epilogue::BiasGelu), F::Auto);
        for f in [F::Tiled, F::WarpK, F::Rows] {
            assert_eq!(lowp_family(f, Epilogue::None), F::Auto);
        }
    }

    #[test]
    fn empty_depths_and_scaled_bias_gradients_are_refused() {
        let o = GemmOp {
            k: 0,
            ..op(Epilogue::None)
        };
        assert!(matches!(check_op(&o), Err(NnError::Shape(_))));
        // Nothing to write: no error.
        check_op(&GemmOp { m: 0, ..o }).unwrap();
        let g = GemmOp {
            ta: Trans::T,
            tb: Trans::N,
            alpha: 0.5,
            ..op(Epilogue::BiasGrad)
        };
        assert!(matches!(check_op(&g), Err(NnError::Shape(_))));
        check_op(&GemmOp { alpha: 1.0, ..g }).unwrap();
    }

    #[test]
    fn the_few_row_kernel_is_offered_only_for_few_row_forward_products() {
        let decode = GemmOp {
            m: 1,
            n: 2304,
            k: 768,
            ..op(Epilogue::BiasGelu)
        };
        assert_eq!(gemv_splits(&decode, 256), vec![1, 2]);
        assert_eq!(gemv_splits(&decode, 16), vec![1, 2]);
        let deep = GemmOp { k: 3072, ..decode };
        assert_eq!(gemv_splits(&deep, 256), vec![1, 2, 4, 8]);
        assert_eq!(gemv_splits(&GemmOp { k: 8, ..decode }, 256), vec![1]);
        // Any alpha and beta, every epilogue but the bias gradient, up to GEMV_MAX_M rows.
        for ep in [Epilogue::None, Epilogue::Bias, Epilogue::BiasRelu] {
            let o = GemmOp {
                m: GEMV_MAX_M,
                alpha: 0.5,
                beta: 1.0,
                epilogue: ep,
                ..decode
            };
            assert!(!gemv_splits(&o, 256).is_empty(), "{}", o.key());
        }
        for o in [
            GemmOp {
                m: GEMV_MAX_M + 1,
                ..decode
            },
            GemmOp { m: 0, ..decode },
            GemmOp { n: 0, ..decode },
            GemmOp { k: 764, ..decode },
            GemmOp {
                tb: Trans::N,
                ..decode
            },
            GemmOp {
                ta: Trans::T,
                tb: Trans::N,
                epilogue: Epilogue::BiasGrad,
                ..decode
            },
            GemmOp {
                epilogue: Epilogue::BiasGrad,
                ..decode
            },
        ] {
            assert!(gemv_splits(&o, 256).is_empty(), "{}", o.key());
        }
        assert!(gemv_splits(&decode, 8).is_empty());
        // The tensor-core variant: up to GEMV_MMA_MAX_M rows, two chunks of 32 a warp.
        assert_eq!(gemv_mma_splits(&decode, 256), vec![1, 2, 4, 8]);
        assert_eq!(
            gemv_mma_splits(&GemmOp { k: 128, ..decode }, 256),
            vec![1, 2]
        );
        assert_eq!(gemv_mma_splits(&GemmOp { k: 8, ..decode }, 256), vec![1]);
        let batch = GemmOp {
            m: GEMV_MMA_MAX_M,
            beta: 1.0,
            ..decode
        };
        assert_eq!(gemv_mma_splits(&batch, 16), vec![1, 2, 4, 8]);
        assert!(gemv_splits(&batch, 256).is_empty());
        for o in [
            GemmOp {
                m: GEMV_MMA_MAX_M + 1,
                ..decode
            },
            GemmOp { k: 764, ..decode },
            GemmOp {
                epilogue: Epilogue::BiasGrad,
                ..decode
            },
        ] {
            assert!(gemv_mma_splits(&o, 256).is_empty(), "{}", o.key());
        }
        assert!(gemv_mma_splits(&decode, 8).is_empty());
    }

    #[test]
    fn vectors_follow_the_epilogue() {
        let o = op(Epilogue::BiasGelu);
        assert_eq!(o.vec_len().unwrap(), Some(512));
        o.check_vec(Some(512)).unwrap();
        assert!(matches!(
            o.check_vec(Some(511)),
            Err(NnError::Core(cudagraph::Error::SizeMismatch { .. }))
        ));
        assert!(matches!(o.check_vec(None), Err(NnError::Shape(_))));
        let none = op(Epilogue::None);
        assert!(matches!(none.check_vec(Some(512)), Err(NnError::Shape(_))));
        // The bias gradient needs A transposed, and m entries.
        assert!(matches!(
            op(Epilogue::BiasGrad).check_vec(Some(32)),
            Err(NnError::Shape(_))
        ));
        let g = GemmOp {
            ta: Trans::T,
            tb: Trans::N,
            ..op(Epilogue::BiasGrad)
        };
        g.check_vec(Some(32)).unwrap();
    }
}
