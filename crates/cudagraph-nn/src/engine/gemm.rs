//! Matrix products for the NN layer, each run by the engine the registry ([`crate::engine`])
//! chose for its shape: cuBLAS, cuBLASLt (bias, bias+ReLU and bias-gradient epilogues fused;
//! its heuristic algorithms and, for under-occupied products, split-K variants of the first
//! three; opt-in: split-K with `CUDAGRAPH_LT_SPLITK=1`, and up to eight configurations found by
//! searching algorithm ids, tiles and stages with `CUDAGRAPH_LT_SEARCH=1`, `cublaslt:cN`), or
//! our kernels — `sgemm_tiled` (split-K over blocks plus a fixed-order reduce, fused
//! bias/ReLU; on sm_90+ also with the splits reduced inside a thread-block cluster, one kernel),
//! `sgemm_nt_chunks` (sm_90+, forward layout: 128-wide K chunks of float4s, splits reduced in
//! a cluster),
//! `sgemm_nt_warpk` (K split across the warps of one block, forward layout) and
//! `sgemm_nt_rows` (few rows: every lane streams float4s of four weight rows, K split across
//! lanes and warps and summed in a fixed order inside the kernel, forward layout) and the
//! column-warp kernels `sgemm_nt_cols_rRcC` (few rows: each warp a few rows × one or two columns,
//! its sums reduce-scattered by shuffles, forward layout; [`cols_shapes`]).
//!
//! [`gemm`] keeps its signature: `GemmFamily::Auto` asks the registry (within the policy's
//! family, `CUDAGRAPH_GEMM`), any other `GemmFamily` restricts the registry to that family.
//! [`gemm_with`] runs one exact [`GemmEngine`] (tests, benchmarks). Before anything is measured
//! (inside a capture), [`auto_family`] — the thresholds measured once on the seed shapes — is
//! the heuristic default.

use cudagraph::{DeviceBuffer, Queue, QueueExt};

use crate::engine::{Engines, GemmEngine, Policy};
use crate::error::{NnError, Result};
pub use crate::extent::alignment;
use crate::extent::gemm_on_device;
pub use crate::ffi::blas::Trans;
use crate::ffi::blaslt::{BlasLt, LtAlgo, LtShape, MEASURED_ALGOS};
use crate::kernels::{
    rows_groups, rows_most_splits, ClusterKernels, ColsShape, GemmDims, Kernels, Nn, ROWS_PER_BLOCK,
};

type Buf = DeviceBuffer<f32>;

/// `Kernels::sgemm_tiled` and `Kernels::sgemm_cluster`.
type TiledFn = fn(
    &Kernels,
    &dyn Queue,
    GemmDims,
    f32,
    &Buf,
    &Buf,
    f32,
    &Buf,
    Option<&Buf>,
    bool,
    usize,
) -> Result<()>;

pub use crate::engine::GemmFamily;

pub use crate::ffi::blas::Epilogue;

/// The heuristic default family for a product (from `cudagraph bench gemm` on an H100,
/// `bash bench/device.sh gemm`): for the forward layout `x·wᵀ`, split-K tiled at
/// 8 ≤ m ≤ 64 and warp-K at 65 ≤ m ≤ 256; cuBLAS otherwise (its GEMV path wins at m = 1, and
/// it wins the backward layouts).
pub fn auto_family(ta: Trans, tb: Trans, m: usize, alpha: f32, beta: f32) -> GemmFamily {
    let forward = ta == Trans::N && tb == Trans::T;
    match m {
        8..=64 if forward => GemmFamily::Tiled,
        65..=256 if forward && alpha == 1.0 && beta == 0.0 => GemmFamily::WarpK,
        65..=256 if forward => GemmFamily::Tiled,
        _ => GemmFamily::Cublas,
    }
}

/// The family `CUDAGRAPH_GEMM` selects (read once per process; an unknown value is an error).
pub fn family_from_env() -> Result<GemmFamily> {
    Ok(Policy::from_env()?.gemm)
}

/// One product: row-major `C[m×n] = epilogue(alpha·op(A)·op(B) + beta·C)`, op(A) m×k (`ta`: A
/// is stored k×m), op(B) k×n (`tb`: B is stored n×k).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmOp {
    /// Whether A is stored transposed (k×m).
    pub ta: Trans,
    /// Whether B is stored transposed (n×k).
    pub tb: Trans,
    /// Rows of C (and of op(A)).
    pub m: usize,
    /// Columns of C (and of op(B)).
    pub n: usize,
    /// The inner dimension: columns of op(A), rows of op(B).
    pub k: usize,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the existing C (0: C is overwritten).
    pub beta: f32,
    /// What is applied after the product (bias, ReLU, bias gradient).
    pub epilogue: Epilogue,
}

impl GemmOp {
    /// `y[m×n] = x[m×k] · w[n×k]ᵀ`, PyTorch's Linear layout (B stored transposed), alpha 1,
    /// beta 0, no epilogue; set `epilogue` for a fused bias or activation.
    pub fn linear(m: usize, n: usize, k: usize) -> GemmOp {
        GemmOp {
            ta: Trans::N,
            tb: Trans::T,
            m,
            n,
            k,
            alpha: 1.0,
            beta: 0.0,
            epilogue: Epilogue::None,
        }
    }

    /// The registry key (without the policy's scope), e.g.
    /// `gemm NT m=32 n=512 k=1024 a=1 b=0 ep=bias_relu`.
    pub fn key(&self) -> String {
        self.key_with_rows(&self.m.to_string())
    }

    /// [`Self::key`] with `rows` in place of the row count (a range of them, for keys that
    /// products of several row counts share).
    pub(crate) fn key_with_rows(&self, rows: &str) -> String {
        let t = |x: Trans| if x == Trans::N { 'N' } else { 'T' };
        format!(
            "gemm {}{} m={rows} n={} k={} a={} b={} ep={}",
            t(self.ta),
            t(self.tb),
            self.n,
            self.k,
            if self.alpha == 1.0 { "1" } else { "*" },
            if self.beta == 0.0 { "0" } else { "*" },
            self.epilogue.name()
        )
    }

    fn dims(&self) -> GemmDims {
        GemmDims {
            m: self.m,
            n: self.n,
            k: self.k,
            ta: self.ta == Trans::T,
            tb: self.tb == Trans::T,
        }
    }

    /// The buffers hold what the product reads and writes and are memory of `q`'s device
    /// (checked before any engine runs or is measured, so a buffer of another device is a
    /// `WrongDevice` error whichever engine the registry would pick); `vec` is the bias
    /// (`Bias*`, length n) or the bias-gradient output (`BiasGrad`, length m).
    fn validate(&self, q: &dyn Queue, a: &Buf, b: &Buf, c: &Buf, vec: Option<&Buf>) -> Result<()> {
        if self.epilogue == Epilogue::BiasGelu {
            return Err(NnError::NotSupported {
                op: "gemm",
                what: "a GELU epilogue in an f32 product".into(),
                fix: "run the product in bf16 or f16 (engine::gemm_lowp), or apply GELU after it",
            });
        }
        self.dims().check_buffers(a, b, c, None)?;
        gemm_on_device(q, a, b, c, vec)?;
        self.check_vec(vec.map(|v| v.len()))
    }

    /// The length the epilogue's vector needs: the bias (`Bias*`, n) or the bias-gradient
    /// output (`BiasGrad`, m; A must be transposed: `dW = dZᵀ·X`); `None` without one.
    pub(crate) fn vec_len(&self) -> Result<Option<usize>> {
        Ok(match self.epilogue {
            Epilogue::None => None,
            Epilogue::Bias | Epilogue::BiasRelu | Epilogue::BiasGelu => Some(self.n),
            Epilogue::BiasGrad => {
                if self.ta != Trans::T {
                    return Err(NnError::Shape(
                        "gemm: a fused bias gradient needs A transposed (dW = dZᵀ·X)".into(),
                    ));
                }
                Some(self.m)
            }
        })
    }

    /// A vector of `got` elements (or none) is what the epilogue needs ([`Self::vec_len`]).
    pub(crate) fn check_vec(&self, got: Option<usize>) -> Result<()> {
        let want = self.vec_len()?;
        match (want, got) {
            (None, None) => Ok(()),
            (Some(n), Some(v)) if v >= n => Ok(()),
            (Some(n), Some(v)) => Err(NnError::Core(cudagraph::Error::SizeMismatch {
                what: "gemm bias",
                expected: n,
                got: v,
            })),
            (Some(_), None) => Err(NnError::Shape(format!(
                "gemm: epilogue {:?} needs a bias vector",
                self.epilogue
            ))),
            (None, Some(_)) => Err(NnError::Shape(
                "gemm: a bias vector without a bias epilogue".into(),
            )),
        }
    }

    fn warpk_ok(&self) -> bool {
        self.ta == Trans::N
            && self.tb == Trans::T
            && self.alpha == 1.0
            && self.beta == 0.0
            && self.epilogue != Epilogue::BiasGrad
    }

    /// The few-rows kernel applies: the warp-K conditions, few rows, float4-readable operands.
    fn rows_ok(&self, align: u32) -> bool {
        self.warpk_ok()
            && self.m <= ROWS_MAX_M
            && align >= 16
            && crate::kernels::rows_ok(self.k, &[])
    }

    /// The chunked forward kernel applies: `x·wᵀ` (any alpha, beta, a bias epilogue or none),
    /// float4-readable operands.
    fn chunks_ok(&self, align: u32) -> bool {
        self.ta == Trans::N
            && self.tb == Trans::T
            && self.epilogue != Epilogue::BiasGrad
            && align >= 16
            && crate::kernels::rows_ok(self.k, &[])
            && self.tiled_ok()
    }

    fn tiled_ok(&self) -> bool {
        self.m.div_ceil(32) <= 65535
    }
}

/// Row-major `C[m×n] = alpha·op(A)·op(B) + beta·C`, then `+ bias[j]` and ReLU if asked (a
/// ReLU needs a bias). `engine` restricts the registry's choice to a family (`Auto`: the
/// policy's, by default every engine).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    q: &dyn Queue,
    nn: &Nn,
    engine: GemmFamily,
    (ta, tb): (Trans, Trans),
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: &Buf,
    b: &Buf,
    beta: f32,
    c: &Buf,
    bias: Option<&Buf>,
    relu: bool,
) -> Result<()> {
    let epilogue = match (bias, relu) {
        (None, false) => Epilogue::None,
        (Some(_), false) => Epilogue::Bias,
        (Some(_), true) => Epilogue::BiasRelu,
        (None, true) => return Err(NnError::Shape("a fused ReLU needs a bias".into())),
    };
    let op = GemmOp {
        ta,
        tb,
        m,
        n,
        k,
        alpha,
        beta,
        epilogue,
    };
    run_gemm(q, nn, engine, &op, a, b, c, bias).map(|_| ())
}

/// The weight (and bias) gradient of a Linear layer: `dW[n×k] = dZᵀ·X` for `dZ: [m, n]`,
/// `X: [m, k]`, and `db[n] = Σ_rows dZ` when `db` is given (fused into the product where an
/// engine can).
#[allow(clippy::too_many_arguments)]
pub fn linear_weight_grad(
    q: &dyn Queue,
    nn: &Nn,
    engine: GemmFamily,
    (m, n, k): (usize, usize, usize),
    dz: &Buf,
    x: &Buf,
    dw: &Buf,
    db: Option<&Buf>,
) -> Result<GemmEngine> {
    let op = GemmOp {
        ta: Trans::T,
        tb: Trans::N,
        m: n,
        n: k,
        k: m,
        alpha: 1.0,
        beta: 0.0,
        epilogue: if db.is_some() {
            Epilogue::BiasGrad
        } else {
            Epilogue::None
        },
    };
    run_gemm(q, nn, engine, &op, dz, x, dw, db)
}

/// Runs `op` with the registry's engine for it (restricted to `engine`'s family unless
/// `Auto`); returns the engine used.
#[allow(clippy::too_many_arguments)]
pub fn run_gemm(
    q: &dyn Queue,
    nn: &Nn,
    engine: GemmFamily,
    op: &GemmOp,
    a: &Buf,
    b: &Buf,
    c: &Buf,
    vec: Option<&Buf>,
) -> Result<GemmEngine> {
    op.validate(q, a, b, c, vec)?;
    if op.m == 0 || op.n == 0 {
        // Nothing to write (a bias gradient of m = 0 rows is empty too).
        return Ok(GemmEngine::Cublas);
    }
    let eng = Engines::get(q.device())?;
    let policy = eng.policy();
    let family = if engine == GemmFamily::Auto {
        policy.gemm
    } else {
        engine
    };
    let mut addrs = vec![a.addr(), b.addr(), c.addr()];
    addrs.extend(vec.map(|v| v.addr()));
    let align = alignment(&addrs);
    // Alignment changes cuBLASLt's candidates; the allocator's blocks are always 256-aligned.
    let key = match align {
        256 => format!("{}{}", op.key(), policy.gemm_scope(family)),
        a => format!("{} align={a}{}", op.key(), policy.gemm_scope(family)),
    };
    if let Some(algo) = eng.lookup::<GemmEngine>(&key) {
        run_algo(q, nn, &eng, algo, op, align, a, b, c, vec)?;
        return Ok(algo);
    }
    let candidates = gemm_candidates(q, &eng, op, family, align)?;
    let default = default_engine(op, &candidates);
    let mut scratch = None;
    let algo = eng.choose(q, &key, None, &candidates, default, &mut |q, algo| {
        let (cs, v) = scratch_output(q, op, &mut scratch, vec)?;
        run_algo(q, nn, &eng, algo, op, align, a, b, cs, v)
    })?;
    run_algo(q, nn, &eng, algo, op, align, a, b, c, vec)?;
    Ok(algo)
}

/// The output and vector a measured run of `op` writes in place of the caller's (so that
/// measuring leaves the caller's output alone): an output of `m·n` elements, allocated on the
/// first run into `scratch` and zeroed where `beta` reads it, and for the bias gradient a
/// vector of `m` beside it; otherwise the caller's `vec`, which the run reads.
pub(crate) fn scratch_output<'a, O: cudagraph::Elem>(
    q: &dyn Queue,
    op: &GemmOp,
    scratch: &'a mut Option<(DeviceBuffer<O>, Option<DeviceBuffer<O>>)>,
    vec: Option<&'a DeviceBuffer<O>>,
) -> Result<(&'a DeviceBuffer<O>, Option<&'a DeviceBuffer<O>>)> {
    if scratch.is_none() {
        let cs = q.alloc::<O>(op.m * op.n)?;
        if op.beta != 0.0 {
            q.memset_zero(&cs)?;
        }
        let vs = match op.epilogue {
            Epilogue::BiasGrad => Some(q.alloc::<O>(op.m)?),
            _ => None,
        };
        *scratch = Some((cs, vs));
    }
    let (cs, vs) = scratch.as_ref().expect("allocated above");
    let v = match op.epilogue {
        Epilogue::BiasGrad => vs.as_ref(),
        _ => vec,
    };
    Ok((cs, v))
}

/// cuBLASLt, or why it is not there.
pub(crate) fn lt_required(eng: &Engines) -> Result<&BlasLt> {
    eng.cublaslt().ok_or_else(|| NnError::Library {
        library: "cuBLASLt",
        call: "dlopen",
        status: "unavailable (missing, or disabled by the engine policy)".into(),
    })
}

/// The product [`GemmEngine::CublasLtTransposed`] runs for `op` with a result of `O`: `Cᵀ =
/// op(B)ᵀ·op(A)ᵀ`, the row-major n × m product of B and A (in that order). `None` where the
/// engine is not offered: C's rows are a multiple of 16 bytes apart already, beta is not 0 (the
/// scratch holds no C to scale) or there is an epilogue.
pub(crate) fn transposed_op<O: cudagraph::Elem>(op: &GemmOp) -> Option<GemmOp> {
    let per_16_bytes = 16 / std::mem::size_of::<O>().clamp(1, 16);
    let flip = |t: Trans| match t {
        Trans::N => Trans::T,
        Trans::T => Trans::N,
    };
    let offered = op.n % per_16_bytes != 0 && op.beta == 0.0 && op.epilogue == Epilogue::None;
    offered.then_some(GemmOp {
        ta: flip(op.tb),
        tb: flip(op.ta),
        m: op.n,
        n: op.m,
        ..*op
    })
}

/// [`GemmEngine::CublasLtTransposed`] of each rank cuBLASLt has for the transposed product of
/// `op` with a result of `O` (`count`: its number of algorithms for a shape), at most
/// [`MEASURED_ALGOS`]; none where the engine is not offered ([`transposed_op`]).
pub(crate) fn transposed_candidates<O: cudagraph::Elem>(
    op: &GemmOp,
    align: u32,
    count: impl FnOnce(&LtShape) -> usize,
) -> Vec<GemmEngine> {
    let Some(t) = transposed_op::<O>(op) else {
        return Vec::new();
    };
    let n = count(&lt_shape(&t, align)).min(MEASURED_ALGOS);
    (0..n)
        .map(|r| GemmEngine::CublasLtTransposed(r as u8))
        .collect()
}

/// Runs `op` as [`GemmEngine::CublasLtTransposed`]: `product` writes [`transposed_op`] (on B and
/// A) into a scratch matrix of the queue's (the graph's pool inside a capture), then its
/// transpose is written into `c`. An error where the engine is not offered for `op`.
pub(crate) fn run_transposed<O: cudagraph::Elem>(
    q: &dyn Queue,
    op: &GemmOp,
    c: &DeviceBuffer<O>,
    product: impl FnOnce(&GemmOp, &DeviceBuffer<O>) -> Result<bool>,
) -> Result<()> {
    let t = transposed_op::<O>(op).ok_or_else(|| NnError::NotSupported {
        op: "gemm",
        what: format!(
            "engine cublaslt-t for {} (C's rows aligned already, beta not 0, or an epilogue)",
            op.key()
        ),
        fix: "use another cuBLASLt engine for this product",
    })?;
    let scratch = q.alloc::<O>(crate::extent::prod("transposed product", &[op.m, op.n])?)?;
    product(&t, &scratch)?;
    crate::kernels::cast::transpose(q, &scratch, c, (op.n, op.m))
}

/// Runs `op` with exactly `algo` (no registry). Errors when `algo` cannot run it (warp-K on
/// another layout, cuBLASLt missing or without an algorithm of that rank, or without that
/// split-K variant or searched configuration for this shape: see
/// `crate::ffi::blaslt::BlasLt::split_k_variants` and `crate::ffi::blaslt::BlasLt::search_configs`;
/// nothing runs then).
#[allow(clippy::too_many_arguments)]
pub fn gemm_with(
    q: &dyn Queue,
    nn: &Nn,
    algo: GemmEngine,
    op: &GemmOp,
    a: &Buf,
    b: &Buf,
    c: &Buf,
    vec: Option<&Buf>,
) -> Result<()> {
    op.validate(q, a, b, c, vec)?;
    if op.m == 0 || op.n == 0 {
        return Ok(());
    }
    let eng = Engines::get(q.device())?;
    let mut addrs = vec![a.addr(), b.addr(), c.addr()];
    addrs.extend(vec.map(|v| v.addr()));
    run_algo(q, nn, &eng, algo, op, alignment(&addrs), a, b, c, vec)
}

/// The engines that can run `op` on this machine within `family` (if none can, the
/// candidates of `Tiled` for `WarpK`, of `Auto` otherwise). Inside a capture, cuBLASLt is a
/// candidate only if it was opened before.
pub fn gemm_candidates(
    q: &dyn Queue,
    eng: &Engines,
    op: &GemmOp,
    family: GemmFamily,
    align: u32,
) -> Result<Vec<GemmEngine>> {
    let allowed = |e: GemmFamily| family == GemmFamily::Auto || family == e;
    let mut v = Vec::new();
    if allowed(GemmFamily::Cublas) {
        v.push(GemmEngine::Cublas);
    }
    if allowed(GemmFamily::CublasLt) && op.k > 0 {
        if let Some(lt) = eng.cublaslt_for(q) {
            // A shape cuBLASLt cannot plan simply has no cuBLASLt candidate.
            let shape = lt_shape(op, align);
            let tf32 = eng.policy().tf32_matmul;
            let count = lt.algo_count_math(&shape, tf32).map_or(0, |(n, _)| n);
            v.extend((0..count.min(MEASURED_ALGOS)).map(|r| GemmEngine::CublasLt(r as u8)));
            v.extend(transposed_candidates::<f32>(op, align, |s| {
                lt.algo_count_math(s, tf32).map_or(0, |(n, _)| n)
            }));
            // Split-K variants of the first few, where the product leaves the device idle,
            // when the policy asks for them (off by default: see `Policy::lt_split_k`).
            let variants = match eng.policy().lt_split_k {
                true => lt.split_k_variants_math(&shape, tf32).unwrap_or_default(),
                false => Vec::new(),
            };
            v.extend(
                variants
                    .into_iter()
                    .map(|(rank, split)| GemmEngine::CublasLtSplitK { rank, split }),
            );
            // Configurations found by search rather than the heuristic, when the policy asks
            // for them (off by default: see `Policy::lt_search`).
            let configs = match eng.policy().lt_search {
                true => lt.search_configs_math(&shape, tf32).map_or(0, |c| c.len()),
                false => 0,
            };
            v.extend(
                (0..configs.min(u8::MAX as usize + 1)).map(|i| GemmEngine::CublasLtConfig(i as u8)),
            );
        }
    }
    if allowed(GemmFamily::Tiled) && op.tiled_ok() {
        v.push(GemmEngine::Tiled(1));
        let s = split_k(op.m, op.n, op.k);
        if s > 1 {
            v.push(GemmEngine::Tiled(s.min(u16::MAX as usize) as u16));
        }
    }
    if allowed(GemmFamily::Tiled) && op.k > 0 {
        let sms = eng.device_info().multiprocessors;
        v.extend(
            reg_splits(op.m, op.n, op.k, sms)
                .into_iter()
                .map(GemmEngine::Reg),
        );
    }
    if allowed(GemmFamily::Tiled) && op.tiled_ok() && ClusterKernels::supported(q.device()) {
        let sms = eng.device_info().multiprocessors;
        v.extend(
            cluster_splits(op.m, op.n, op.k, sms)
                .into_iter()
                .map(GemmEngine::Cluster),
        );
        if op.chunks_ok(align) {
            v.extend(
                chunk_splits(op.m, op.n, op.k, sms)
                    .into_iter()
                    .map(GemmEngine::Chunks),
            );
        }
    }
    if allowed(GemmFamily::WarpK) && op.warpk_ok() && op.tiled_ok() {
        v.push(GemmEngine::WarpK);
    }
    if allowed(GemmFamily::Rows) && op.rows_ok(align) {
        // The 16-row kernel (a grid of blocks covers up to ROWS_MAX_M rows), and the
        // column-warp kernels, which won every product of m ≤ 8 the probe measured against the
        // 8- and 4-row kernels (see `cols_shapes`): those two are no longer offered.
        let sms = eng.device_info().multiprocessors;
        let ks = rows_split(op.m, op.n, op.k, sms, 16);
        let splits = if ks > 1 { vec![ks, ks / 2] } else { vec![ks] };
        for ks in splits {
            v.push(GemmEngine::Rows {
                rows: 16,
                ks: ks as u8,
            });
        }
        v.extend(cols_candidates(op.m, op.k));
    }
    if v.is_empty() {
        let fallback = if matches!(family, GemmFamily::WarpK | GemmFamily::Rows) {
            GemmFamily::Tiled
        } else {
            GemmFamily::Auto
        };
        if family != fallback {
            return gemm_candidates(q, eng, op, fallback, align);
        }
        v.push(GemmEngine::Cublas);
    }
    Ok(v)
}

/// The heuristic default among `candidates` (non-empty): [`auto_family`]'s family, else the
/// first candidate.
pub fn default_engine(op: &GemmOp, candidates: &[GemmEngine]) -> GemmEngine {
    let want = match auto_family(op.ta, op.tb, op.m, op.alpha, op.beta) {
        GemmFamily::WarpK if op.warpk_ok() => GemmEngine::WarpK,
        GemmFamily::WarpK | GemmFamily::Tiled => {
            GemmEngine::Tiled(split_k(op.m, op.n, op.k).min(u16::MAX as usize) as u16)
        }
        _ => GemmEngine::Cublas,
    };
    if candidates.contains(&want) {
        want
    } else {
        candidates.first().copied().unwrap_or(GemmEngine::Cublas)
    }
}

/// The shape cuBLASLt plans for `op` on pointers aligned to `align` bytes, C dense.
pub(crate) fn lt_shape(op: &GemmOp, align: u32) -> LtShape {
    LtShape {
        ta: op.ta,
        tb: op.tb,
        m: op.m,
        n: op.n,
        k: op.k,
        epilogue: op.epilogue,
        align,
    }
}

#[allow(clippy::too_many_arguments)]
fn run_algo(
    q: &dyn Queue,
    nn: &Nn,
    eng: &Engines,
    algo: GemmEngine,
    op: &GemmOp,
    align: u32,
    a: &Buf,
    b: &Buf,
    c: &Buf,
    vec: Option<&Buf>,
) -> Result<()> {
    let (bias, relu) = match op.epilogue {
        Epilogue::Bias => (vec, false),
        Epilogue::BiasRelu => (vec, true),
        Epilogue::None | Epilogue::BiasGrad => (None, false),
        // Refused by `GemmOp::validate` before any engine runs.
        Epilogue::BiasGelu => {
            return Err(NnError::NotSupported {
                op: "gemm",
                what: "a GELU epilogue in an f32 product".into(),
                fix: "run the product in bf16 or f16 (engine::gemm_lowp)",
            })
        }
    };
    // Bias gradient by reduction (engines that do not fuse it): row sums of op(A) = column
    // sums of A stored k×m.
    let bgrad = |q: &dyn Queue| match (op.epilogue, vec) {
        (Epilogue::BiasGrad, Some(db)) => nn.k.col_sum(q, a, db, op.k, op.m),
        _ => Ok(()),
    };
    // The tiled kernel with a reduce node, or (sm_90+) the same splits summed inside a
    // thread-block cluster: one argument list, two launchers.
    let tiled = |launch: TiledFn, splits: usize| -> Result<()> {
        let d = op.dims();
        launch(&nn.k, q, d, op.alpha, a, b, op.beta, c, bias, relu, splits)?;
        bgrad(q)
    };
    // cuBLASLt's algorithm of a rank, a split-K variant or a searched configuration.
    let cublaslt = |which: LtAlgo| -> Result<()> {
        let lt = lt_required(eng)?;
        let shape = lt_shape(op, align);
        let (alpha, beta) = (op.alpha, op.beta);
        let tf32 = eng.policy().tf32_matmul;
        let fused = lt.matmul_math(q, &shape, tf32, which, alpha, a, b, beta, c, vec)?;
        if !fused {
            bgrad(q)?;
        }
        Ok(())
    };
    match algo {
        GemmEngine::Cublas => {
            let tf32 = eng.policy().tf32_matmul;
            eng.blas()?.gemm_math(
                q, op.ta, op.tb, op.m, op.n, op.k, op.alpha, a, b, op.beta, c, tf32,
            )?;
            if let Some(bias) = bias {
                nn.k.bias_act(q, c, bias, op.m, op.n, relu)?;
            }
            bgrad(q)
        }
        GemmEngine::CublasLt(rank) => cublaslt(LtAlgo::Rank(rank as usize)),
        GemmEngine::CublasLtSplitK { rank, split } => cublaslt(LtAlgo::SplitK { rank, split }),
        GemmEngine::CublasLtConfig(i) => cublaslt(LtAlgo::Config(i)),
        GemmEngine::CublasLtTransposed(rank) => {
            let lt = lt_required(eng)?;
            let (which, tf32) = (LtAlgo::Rank(rank as usize), eng.policy().tf32_matmul);
            run_transposed(q, op, c, |t, scratch| {
                let shape = lt_shape(t, align);
                lt.matmul_math(q, &shape, tf32, which, t.alpha, b, a, 0.0, scratch, None)
            })
        }
        GemmEngine::Tiled(splits) => tiled(Kernels::sgemm_tiled, splits as usize),
        GemmEngine::Cluster(splits) => tiled(Kernels::sgemm_cluster, splits as usize),
        GemmEngine::Reg(splits) => tiled(Kernels::sgemm_reg, splits as usize),
        GemmEngine::Chunks(splits) => {
            if !op.chunks_ok(align) {
                return Err(NnError::Shape(format!(
                    "gemm: the chunked kernel runs only x·wᵀ with k a multiple of 4 and 16-byte \
                     aligned operands ({})",
                    op.key()
                )));
            }
            nn.k.sgemm_nt_chunks(
                q,
                (op.m, op.n, op.k),
                op.alpha,
                a,
                b,
                op.beta,
                c,
                bias,
                relu,
                splits as usize,
            )
        }
        GemmEngine::Rows { rows, ks } => {
            // The 16-row kernel covers up to ROWS_MAX_M rows in a grid; the 8- and 4-row ones
            // one block row.
            let most = if rows == 16 {
                ROWS_MAX_M
            } else {
                rows as usize
            };
            if !op.rows_ok(align) || op.m > most || !ROWS_PER_BLOCK.contains(&(rows as usize)) {
                return Err(NnError::Shape(format!(
                    "gemm: the {rows}-row kernel runs only x·wᵀ with alpha 1, beta 0, at most \
                     {most} rows, k a multiple of 4 and 16-byte aligned operands ({})",
                    op.key()
                )));
            }
            let d = (ks as usize, rows as usize);
            nn.k.sgemm_nt_rows(q, op.m, op.n, op.k, a, b, c, bias, relu, d)
        }
        GemmEngine::Cols {
            rows,
            cols,
            warps,
            ks,
        } => {
            if !op.rows_ok(align) {
                return Err(NnError::Shape(format!(
                    "gemm: the column-warp kernel runs only x·wᵀ with alpha 1, beta 0, at most \
                     {ROWS_MAX_M} rows, k a multiple of 4 and 16-byte aligned operands ({})",
                    op.key()
                )));
            }
            let shape = ColsShape {
                rows: rows as usize,
                cols: cols as usize,
                warps: warps as usize,
                ks: ks as usize,
            };
            nn.k.sgemm_nt_cols(q, (op.m, op.n, op.k), a, b, c, bias, relu, shape)
        }
        GemmEngine::Gemv(_) | GemmEngine::GemvMma(_) => Err(NnError::NotSupported {
            op: "gemm",
            what: format!("engine {algo} (half-precision operands only)"),
            fix: "run f32 products on another engine, or bf16/f16 ones with gemm_lowp",
        }),
        GemmEngine::WarpK => {
            if !op.warpk_ok() {
                return Err(NnError::Shape(format!(
                    "gemm: warp-K runs only x·wᵀ with alpha 1, beta 0 ({})",
                    op.key()
                )));
            }
            nn.k.sgemm_nt_warpk(q, op.m, op.n, op.k, a, b, c, bias, relu)
        }
    }
}

/// The most rows the few-rows kernel is offered for. Every block reads its rows of the input
/// for only a few columns, so the input's traffic grows with the rows: measured on the H100
/// (`bench gemm`) it wins at 8 rows (3.9 µs against 5.8 for split-K tiled and 6.5
/// for cuBLAS, 512 × 1024 weights) and only ties or loses from 32 rows on.
pub const ROWS_MAX_M: usize = 16;

/// The column-warp shapes the registry measures for a product of `m` rows (1 ≤ m ≤
/// [`ROWS_MAX_M`]; none otherwise) and depth `k`: rows per warp the next power of two at or
/// above m and twice that (at most 16), one or two columns per warp, and (warps per block,
/// warps splitting K) of (4, 1), (4, 2), (8, 1), (8, 2), (8, 4) and (8, 8) where each splitting
/// warp has a 128-wide K chunk of its own. Measured on the H100 (docs/engines.md), the fastest
/// shape of each of 36 products (m 1–8, k and n 256–4096) is among these, and 8 % to 33 % faster
/// than the best 8- or 4-row kernel at each.
pub fn cols_shapes(m: usize, k: usize) -> Vec<ColsShape> {
    if m == 0 || m > ROWS_MAX_M {
        return Vec::new();
    }
    let p = m.next_power_of_two();
    let chunks = k.div_ceil(128).max(1);
    let mut v = Vec::new();
    for rows in [p, 2 * p].into_iter().filter(|&r| r <= 16) {
        for cols in [1, 2] {
            for (warps, ks) in [(4, 1), (4, 2), (8, 1), (8, 2), (8, 4), (8, 8)] {
                if ks <= chunks {
                    v.push(ColsShape {
                        rows,
                        cols,
                        warps,
                        ks,
                    });
                }
            }
        }
    }
    v
}

/// [`cols_shapes`] as the registry's candidates (`GemmEngine::Cols`).
pub fn cols_candidates(m: usize, k: usize) -> Vec<GemmEngine> {
    // Every field of a shape cols_shapes offers is at most 16.
    cols_shapes(m, k)
        .into_iter()
        .map(|c| GemmEngine::Cols {
            rows: c.rows as u8,
            cols: c.cols as u8,
            warps: c.warps as u8,
            ks: c.ks as u8,
        })
        .collect()
}

/// How many warps of the few-rows kernel (`per_block` rows per block) split K per group of
/// four columns (1, 2, 4, 8, or 16 for the 8- and 4-row kernels): the fewest that give the
/// device about two blocks per multiprocessor, while every warp keeps at least one 128-wide K
/// chunk. The registry also measures half as many.
pub fn rows_split(m: usize, n: usize, k: usize, multiprocessors: u32, per_block: usize) -> usize {
    let want = 2 * multiprocessors.max(1) as usize;
    let chunks = k.div_ceil(128);
    let rows = m.div_ceil(per_block.max(1));
    let most = rows_most_splits(per_block);
    let blocks = |ks: usize| n.div_ceil(4).div_ceil(rows_groups(ks)) * rows;
    let mut ks = 1;
    while ks < most && blocks(ks) < want && chunks >= 2 * ks {
        ks *= 2;
    }
    ks
}

/// The cluster sizes (K splits reduced inside a thread-block cluster) offered for a product:
/// 2, 4 and 8 where every split keeps at least two 32-wide K tiles and the grid stays within
/// about eight blocks per multiprocessor (beyond that the device is full without splitting).
pub fn cluster_splits(m: usize, n: usize, k: usize, multiprocessors: u32) -> Vec<u8> {
    let tiles = m.div_ceil(32).saturating_mul(n.div_ceil(32));
    let k_tiles = k.div_ceil(32);
    let most = 8 * multiprocessors.max(1) as usize;
    [2u8, 4, 8]
        .into_iter()
        .filter(|&s| 2 * s as usize <= k_tiles && tiles.saturating_mul(s as usize) <= most)
        .collect()
}

/// The K splits offered to the chunked forward kernel: 1, and 2, 4, 8 where every split keeps
/// a 128-wide chunk and the grid stays within about eight blocks per multiprocessor.
pub fn chunk_splits(m: usize, n: usize, k: usize, multiprocessors: u32) -> Vec<u8> {
    let tiles = m.div_ceil(32).saturating_mul(n.div_ceil(32));
    let chunks = k.div_ceil(128);
    let most = 8 * multiprocessors.max(1) as usize;
    [1u8, 2, 4, 8]
        .into_iter()
        .filter(|&s| s == 1 || (s as usize <= chunks && tiles.saturating_mul(s as usize) <= most))
        .collect()
}

/// The K splits offered to the register-blocked kernel (64×64 outputs per block), where the
/// rows fill at least half a tile: unsplit, and split as often as it takes to give every
/// multiprocessor a block (at most 16 ways, every split keeping at least two 32-wide K steps)
/// where the unsplit grid leaves half of them idle.
pub fn reg_splits(m: usize, n: usize, k: usize, multiprocessors: u32) -> Vec<u16> {
    let sms = multiprocessors.max(1) as usize;
    if m < 32 || k == 0 || m.div_ceil(64) > 65535 {
        return Vec::new();
    }
    let tiles = m.div_ceil(64).saturating_mul(n.div_ceil(64));
    let most = k.div_ceil(64).min(16);
    let mut v = vec![1];
    if tiles.saturating_mul(2) <= sms && most >= 2 {
        v.push(sms.div_ceil(tiles).min(most) as u16);
    }
    v
}

/// How many K splits give the device enough blocks (about two waves of 132 SMs) while each
/// split keeps at least two 32-wide K tiles.
pub fn split_k(m: usize, n: usize, k: usize) -> usize {
    let blocks = m.div_ceil(32) * n.div_ceil(32);
    let k_tiles = k.div_ceil(32);
    let want = (264usize).div_ceil(blocks.max(1));
    want.min(k_tiles / 2).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The transposed cuBLASLt engine is offered exactly where C's rows are no multiple of 16
    /// bytes apart, beta is 0 and there is no epilogue; it runs Cᵀ = op(B)ᵀ·op(A)ᵀ.
    #[test]
    fn unaligned_rows_are_offered_the_transposed_product() {
        use cudagraph::memory::bf16;
        let head = GemmOp::linear(64, 50257, 768);
        let t = transposed_op::<f32>(&head).unwrap();
        assert_eq!(
            (t.ta, t.tb, t.m, t.n, t.k),
            (Trans::N, Trans::T, 50257, 64, 768)
        );
        assert_eq!(transposed_op::<bf16>(&head), Some(t));
        // Each layout: op(B)ᵀ is B stored as it is when B was stored transposed, and so on.
        for (ta, tb) in [
            (Trans::N, Trans::N),
            (Trans::T, Trans::N),
            (Trans::T, Trans::T),
        ] {
            let op = GemmOp { ta, tb, ..head };
            let t = transposed_op::<f32>(&op).unwrap();
            assert_eq!((t.ta == tb, t.tb == ta), (false, false), "{ta:?} {tb:?}");
        }
        for n in [1, 3, 7, 13] {
            let op = GemmOp::linear(8, n, 64);
            assert!(transposed_op::<f32>(&op).is_some(), "{n}");
            assert!(transposed_op::<bf16>(&op).is_some(), "{n}");
        }
        // Aligned rows: nothing to gain.
        for n in [8, 768, 50264, 128256] {
            let op = GemmOp::linear(8, n, 64);
            assert_eq!(transposed_op::<bf16>(&op), None, "{n}");
            assert_eq!(transposed_op::<f32>(&op), None, "{n}");
        }
        assert_eq!(transposed_op::<f32>(&GemmOp::linear(8, 12, 64)), None);
        assert!(transposed_op::<bf16>(&GemmOp::linear(8, 12, 64)).is_some());
        // One candidate per algorithm of the transposed shape, at most MEASURED_ALGOS; none
        // where not offered (the count is then not asked for).
        let ranks = |n| {
            transposed_candidates::<f32>(&head, 16, |s| {
                assert_eq!((s.m, s.n), (50257, 64));
                n
            })
        };
        assert_eq!(ranks(2), [0, 1].map(GemmEngine::CublasLtTransposed));
        assert_eq!(ranks(usize::MAX).len(), MEASURED_ALGOS);
        let aligned = GemmOp::linear(8, 768, 64);
        assert!(transposed_candidates::<f32>(&aligned, 16, |_| unreachable!()).is_empty());
        // beta reads C, which the scratch does not hold; epilogues are along C's columns.
        assert_eq!(transposed_op::<f32>(&GemmOp { beta: 0.5, ..head }), None);
        for epilogue in [Epilogue::Bias, Epilogue::BiasGelu, Epilogue::BiasGrad] {
            assert_eq!(transposed_op::<bf16>(&GemmOp { epilogue, ..head }), None);
        }
    }

    #[test]
    fn a_linear_op_is_x_times_w_transposed() {
        let op = GemmOp::linear(8, 2304, 768);
        assert_eq!(op.key(), "gemm NT m=8 n=2304 k=768 a=1 b=0 ep=none");
        assert_eq!(
            (op.ta, op.tb, op.alpha, op.beta),
            (Trans::N, Trans::T, 1.0, 0.0)
        );
    }

    #[test]
    fn cols_shapes_follow_the_rows_and_the_chunks() {
        let shape = |rows, cols, warps, ks| ColsShape {
            rows,
            cols,
            warps,
            ks,
        };
        // One row, four 128-wide chunks: one and two rows per warp, every block shape with
        // at most four warps splitting K.
        let v = cols_shapes(1, 512);
        assert_eq!(v.len(), 2 * 2 * 5);
        assert!(v.contains(&shape(1, 1, 4, 1)));
        assert!(v.contains(&shape(2, 2, 8, 4)));
        assert!(!v.iter().any(|c| c.ks > 4));
        // Five rows: eight and sixteen per warp; a lone chunk: no K splits.
        let v = cols_shapes(5, 100);
        assert!(v.iter().all(|c| (c.rows == 8 || c.rows == 16) && c.ks == 1));
        assert_eq!(v.len(), 2 * 2 * 2);
        // Nine rows: sixteen per warp only; k = 0 still has one shape per block width.
        assert!(cols_shapes(9, 4096).iter().all(|c| c.rows == 16));
        assert_eq!(cols_shapes(9, 0).len(), 2 * 2);
        // Every offered shape launches.
        for m in 1..=ROWS_MAX_M {
            for c in cols_shapes(m, usize::MAX) {
                c.check().unwrap();
                assert_eq!(c.warps % c.ks, 0);
            }
        }
        // The registry's names for them, one per shape, each parsing back to itself.
        let names = cols_candidates(1, 512);
        assert_eq!(names.len(), cols_shapes(1, 512).len());
        assert!(names.contains(&GemmEngine::Cols {
            rows: 2,
            cols: 2,
            warps: 8,
            ks: 4
        }));
        for a in names {
            assert_eq!(a.to_string().parse::<GemmEngine>().unwrap(), a);
        }
        assert!(cols_shapes(0, 512).is_empty());
        assert!(cols_shapes(ROWS_MAX_M + 1, 512).is_empty());
        assert!(cols_shapes(usize::MAX, 512).is_empty());
    }

    #[test]
    fn auto_follows_the_measured_table() {
        let (n, t) = (Trans::N, Trans::T);
        assert_eq!(auto_family(n, t, 1, 1.0, 0.0), GemmFamily::Cublas);
        assert_eq!(auto_family(n, t, 32, 1.0, 0.0), GemmFamily::Tiled);
        assert_eq!(auto_family(n, t, 64, 1.0, 0.0), GemmFamily::Tiled);
        assert_eq!(auto_family(n, t, 256, 1.0, 0.0), GemmFamily::WarpK);
        assert_eq!(auto_family(n, t, 256, 0.5, 0.0), GemmFamily::Tiled);
        assert_eq!(auto_family(n, t, 512, 1.0, 0.0), GemmFamily::Cublas);
        assert_eq!(auto_family(t, n, 64, 1.0, 0.0), GemmFamily::Cublas);
        assert_eq!(auto_family(n, n, 64, 1.0, 0.0), GemmFamily::Cublas);
    }

    #[test]
    fn rows_split_fills_the_device_but_keeps_a_chunk_per_warp() {
        // The seed MLP at batch 32: 128 column groups, 2 row blocks; 1024 = 8 chunks.
        assert_eq!(rows_split(32, 512, 1024, 132, 16), 8);
        assert_eq!(rows_split(8, 512, 1024, 132, 16), 8);
        // 256 → 10 classes: two 128-wide chunks, so at most two warps per group.
        assert_eq!(rows_split(32, 10, 256, 132, 16), 2);
        // A wide layer needs little splitting.
        assert_eq!(rows_split(1, 4096, 1024, 132, 16), 4);
        assert_eq!(rows_split(1, 16384, 1024, 132, 16), 1);
        // A long K with few columns splits as far as 8 warps with 16 rows per block, 16
        // (one column group per block) with 8 or 4.
        assert_eq!(rows_split(1, 64, 4096, 132, 16), 8);
        assert_eq!(rows_split(1, 256, 4096, 132, 8), 16);
        assert_eq!(rows_split(8, 256, 4096, 132, 4), 16);
        // ... but keeps a chunk per warp: 1024 = 8 chunks.
        assert_eq!(rows_split(1, 256, 1024, 132, 8), 8);
    }

    #[test]
    fn rows_grids_hold_max_8_or_ks_warps() {
        use crate::kernels::rows_grid;
        let g = rows_grid(1, 256, 16, 8).unwrap();
        assert_eq!((g.grid, g.block), ((64, 1, 1), (512, 1, 1)));
        let g = rows_grid(1, 256, 8, 8).unwrap();
        assert_eq!((g.grid, g.block), ((64, 1, 1), (256, 1, 1)));
        let g = rows_grid(9, 256, 2, 4).unwrap();
        assert_eq!((g.grid, g.block), ((16, 3, 1), (256, 1, 1)));
        // The 16-row kernel stays at 8 warps.
        let g = rows_grid(16, 256, 16, 16).unwrap();
        assert_eq!(g.block, (256, 1, 1));
    }

    #[test]
    fn cluster_splits_keep_two_tiles_per_split_and_a_bounded_grid() {
        // The seed MLP at batch 32: 16 tiles, 32 K tiles.
        assert_eq!(cluster_splits(32, 512, 1024, 132), vec![2, 4, 8]);
        // 256 → 10: one tile, 8 K tiles: at most 4 splits of 2 tiles.
        assert_eq!(cluster_splits(32, 10, 256, 132), vec![2, 4]);
        // Too shallow to split.
        assert!(cluster_splits(64, 64, 96, 132).is_empty());
        // 1024 tiles fill the device already: no split keeps the grid under 8 per SM.
        assert_eq!(cluster_splits(1024, 1024, 4096, 132), Vec::<u8>::new());
        assert_eq!(cluster_splits(256, 1024, 4096, 132), vec![2, 4]);
    }

    #[test]
    fn chunk_splits_keep_a_chunk_per_split_and_a_bounded_grid() {
        assert_eq!(chunk_splits(32, 512, 1024, 132), vec![1, 2, 4, 8]);
        // 256 deep: two chunks.
        assert_eq!(chunk_splits(32, 10, 256, 132), vec![1, 2]);
        assert_eq!(chunk_splits(32, 10, 4, 132), vec![1]);
        // 1024 tiles fill the device: no split.
        assert_eq!(chunk_splits(1024, 1024, 4096, 132), vec![1]);
    }

    #[test]
    fn reg_splits_need_half_a_tile_of_rows_and_split_only_idle_grids() {
        // Too few rows, or no K: none.
        assert!(reg_splits(31, 4096, 4096, 132).is_empty());
        assert!(reg_splits(64, 64, 0, 132).is_empty());
        // Half a tile of rows; a 1 × 4 grid splits (at most K/64 = 2 ways).
        assert_eq!(reg_splits(32, 256, 128, 132), vec![1, 2]);
        // 512 × 1024: 128 blocks fill the device; 256 × 1024 (64 blocks) splits 3 ways.
        assert_eq!(reg_splits(512, 1024, 256, 132), vec![1]);
        assert_eq!(reg_splits(256, 1024, 256, 132), vec![1, 3]);
        // Deep K: at most 16 splits.
        assert_eq!(reg_splits(64, 64, 1 << 20, 132), vec![1, 16]);
        // Grids past 65535 block rows are not offered; zero multiprocessors do not divide by 0.
        assert!(reg_splits(64 * 65536, 64, 64, 0).is_empty());
        assert_eq!(reg_splits(64 * 65535, 64, 64, 0), vec![1]);
        assert!(reg_splits(usize::MAX, usize::MAX, usize::MAX, 132).is_empty());
    }

    #[test]
    fn split_k_fills_the_device_but_keeps_two_tiles_per_split() {
        assert_eq!(split_k(32, 512, 1024), 16); // 16 blocks: 16 splits of 2 tiles
        assert_eq!(split_k(1024, 1024, 64), 1); // 1024 blocks already
        assert_eq!(split_k(64, 1024, 1024), 5);
        assert_eq!(split_k(1, 10, 256), 4); // one block, 8 tiles: 4 splits of 2
        assert_eq!(split_k(4, 4, 16), 1); // a single tile cannot split
    }

    fn op(ta: Trans, tb: Trans, m: usize, alpha: f32, beta: f32, ep: Epilogue) -> GemmOp {
        GemmOp {
            ta,
            tb,
            m,
            n: 512,
            k: 1024,
            alpha,
            beta,
            epilogue: ep,
        }
    }

    #[test]
    fn keys_name_layout_shape_scalars_and_epilogue() {
        let o = op(Trans::N, Trans::T, 32, 1.0, 0.0, Epilogue::BiasRelu);
        assert_eq!(o.key(), "gemm NT m=32 n=512 k=1024 a=1 b=0 ep=bias_relu");
        let o = op(Trans::T, Trans::N, 7, 0.5, 0.25, Epilogue::BiasGrad);
        assert_eq!(o.key(), "gemm TN m=7 n=512 k=1024 a=* b=* ep=bias_grad");
    }

    #[test]
    fn heuristic_default_is_the_former_auto_table() {
        let all = [
            GemmEngine::Cublas,
            GemmEngine::CublasLt(0),
            GemmEngine::Tiled(1),
            GemmEngine::Tiled(16),
            GemmEngine::Tiled(3),
            GemmEngine::WarpK,
        ];
        let (n, t) = (Trans::N, Trans::T);
        let d = |o: GemmOp| default_engine(&o, &all);
        assert_eq!(d(op(n, t, 1, 1.0, 0.0, Epilogue::Bias)), GemmEngine::Cublas);
        assert_eq!(
            d(op(n, t, 32, 1.0, 0.0, Epilogue::Bias)),
            GemmEngine::Tiled(16)
        );
        assert_eq!(
            d(op(n, t, 200, 1.0, 0.0, Epilogue::None)),
            GemmEngine::WarpK
        );
        assert_eq!(
            d(op(n, t, 200, 0.5, 0.0, Epilogue::None)),
            GemmEngine::Tiled(3)
        );
        assert_eq!(
            d(op(t, n, 64, 1.0, 0.0, Epilogue::BiasGrad)),
            GemmEngine::Cublas
        );
        // A default outside the candidates (a forced family) gives the first candidate.
        let lt = [GemmEngine::CublasLt(0), GemmEngine::CublasLt(1)];
        assert_eq!(
            default_engine(&op(n, t, 32, 1.0, 0.0, Epilogue::None), &lt),
            GemmEngine::CublasLt(0)
        );
    }
}
