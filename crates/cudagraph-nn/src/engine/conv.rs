//! Convolutions (NCHW, fp32), each direction run by the engine the registry
//! ([`crate::engine`]) chose for its geometry: one of cuDNN's algorithms (legacy API, or graph
//! API configurations), our implicit-GEMM kernels (a tile shape and a split count), our small
//! weight-gradient kernel (few channels: output pixels split across blocks), or our direct
//! kernels. A forward with a bias also measures cuDNN graph-API configurations that fuse the
//! bias into the convolution (`cudnnv8+bias:R`, one cuDNN execution); after cuDNN's other
//! engines the bias is a separate step measured on its own ([`conv_bias_key`]).
//!
//! Buffers by direction: forward reads `x`, `w` and writes `y` (+ `bias`); backward-data reads
//! `dy`, `w` and writes `dx`; backward-filter reads `dy`, `x` and writes `dw`. The bias gradient
//! is a channel sum (`Nn::channel_sum`) and not part of these.

use cudagraph::{DeviceBuffer, Queue, QueueExt};

use crate::engine::{BiasEngine, ConvEngine, ConvFamily, Engines, Policy};
use crate::error::{NnError, Result};
pub use crate::extent::{conv_key, ConvDir, ConvGeom};
pub use crate::kernels::igemm::Tile;
use crate::kernels::igemm::{self, ConvKernels};
use crate::kernels::Nn;

type Buf = DeviceBuffer<f32>;

/// Above this many multiply-adds the direct kernels are not measured unless forced (they are
/// candidates for small convolutions, where they can win; on large ones a single run would take
/// seconds).
const DIRECT_MAX_MACS: f64 = 2e10;

/// Multiply-adds of one direction (the same for all three).
fn macs(g: &ConvGeom) -> f64 {
    g.output_len().map_or(f64::INFINITY, |y| y as f64) * (g.c * g.kh * g.kw) as f64
}

/// The largest workspace a cuDNN candidate may ask for: 1 GiB, or an eighth of the device.
pub(crate) fn workspace_limit(total_memory: usize) -> usize {
    (total_memory / 8).min(1 << 30)
}

/// The engines that can run a direction of `g` on this machine under `policy`, cuDNN's in its
/// heuristic order first; with `bias` (forward only) also cuDNN's graph-API configurations
/// that fuse the bias. When the policy's family has none (cuDNN forced but missing), every
/// available engine. Inside a capture, cuDNN is a candidate only if it was opened before.
pub fn conv_candidates(
    q: &dyn Queue,
    eng: &Engines,
    dir: ConvDir,
    g: &ConvGeom,
    bias: bool,
    policy: &Policy,
) -> Result<Vec<ConvEngine>> {
    let family = policy.conv;
    let mut v = Vec::new();
    let allowed = |a: ConvEngine, fam: ConvFamily| fam.allows(a);
    let collect = |fam: ConvFamily, v: &mut Vec<ConvEngine>| -> Result<()> {
        if allowed(ConvEngine::Cudnn(0), fam) && crate::ffi::cudnn::supports(g) {
            if let Some(c) = eng.cudnn_for(q) {
                let limit = workspace_limit(eng.device_info().total_memory);
                // A geometry cuDNN cannot plan simply has no cuDNN candidate.
                for a in c
                    .algos_math(dir, g, policy.deterministic, limit, policy.tf32_conv)
                    .unwrap_or_default()
                {
                    v.push(ConvEngine::Cudnn(a.algo));
                }
            }
        }
        // cuDNN's graph API: its engine configurations (plans built eagerly, never in a capture).
        if allowed(ConvEngine::CudnnGraph(0), fam) && crate::ffi::cudnn::supports(g) {
            if let Some(c) = eng.cudnn_graph_for(q) {
                let limit = workspace_limit(eng.device_info().total_memory);
                for a in c
                    .candidates_math(q, dir, g, policy.deterministic, limit, policy.tf32_conv)
                    .unwrap_or_default()
                {
                    v.push(ConvEngine::CudnnGraph(a.rank));
                }
            }
        }
        // The forward with its bias fused into the same cuDNN operation graph: measured like
        // the others (none when cuDNN offers no plain-fp32 engine for the fused graph).
        if dir == ConvDir::Forward
            && bias
            && allowed(ConvEngine::CudnnGraphBias(0), fam)
            && crate::ffi::cudnn::supports(g)
        {
            if let Some(c) = eng.cudnn_graph_for(q) {
                let limit = workspace_limit(eng.device_info().total_memory);
                for a in c
                    .fused_bias_candidates_math(q, g, policy.deterministic, limit, policy.tf32_conv)
                    .unwrap_or_default()
                {
                    v.push(ConvEngine::CudnnGraphBias(a.rank));
                }
            }
        }
        let sms = eng.device_info().multiprocessors;
        for tile in Tile::ALL {
            if allowed(ConvEngine::Igemm(tile, 1), fam) && igemm::supports(dir, g, tile).is_ok() {
                v.push(ConvEngine::Igemm(tile, 1));
                let s = igemm::default_splits(dir, g, tile, sms);
                if s > 1 {
                    v.push(ConvEngine::Igemm(tile, s as u16));
                }
                if let Some(d) = igemm::deep_splits(dir, g, tile, sms) {
                    v.push(ConvEngine::Igemm(tile, d as u16));
                }
            }
        }
        let direct_ok = fam == ConvFamily::Direct || macs(g) <= DIRECT_MAX_MACS;
        if allowed(ConvEngine::Direct, fam) && igemm::direct_supports(g) && direct_ok {
            v.push(ConvEngine::Direct);
        }
        if dir == ConvDir::BackwardFilter
            && allowed(ConvEngine::Wgrad(1), fam)
            && igemm::wgrad_small_supports(g)
        {
            for p in igemm::wgrad_parts(g, sms) {
                v.push(ConvEngine::Wgrad(p.min(u16::MAX as usize) as u16));
            }
        }
        Ok(())
    };
    collect(family, &mut v)?;
    if v.is_empty() && family != ConvFamily::Auto {
        collect(ConvFamily::Auto, &mut v)?;
    }
    Ok(v)
}

/// The heuristic default among `candidates` (non-empty): cuDNN's first choice when cuDNN is a
/// candidate; else the direct kernel for a forward pass over at most 32 taps per output (its
/// fast path); else our implicit GEMM with the tile and split that suit the shape.
pub fn default_conv_engine(
    dir: ConvDir,
    g: &ConvGeom,
    candidates: &[ConvEngine],
    sms: u32,
) -> ConvEngine {
    if let Some(c) = candidates
        .iter()
        .find(|a| matches!(a, ConvEngine::Cudnn(_)))
    {
        return *c;
    }
    let taps = g.c.saturating_mul(g.kh).saturating_mul(g.kw);
    if dir == ConvDir::Forward && taps <= 32 && candidates.contains(&ConvEngine::Direct) {
        return ConvEngine::Direct;
    }
    let tile = igemm::default_tile(dir, g);
    let want = ConvEngine::Igemm(tile, igemm::default_splits(dir, g, tile, sms) as u16);
    if candidates.contains(&want) {
        return want;
    }
    candidates.first().copied().unwrap_or(ConvEngine::Direct)
}

/// The buffers of one direction: forward `a = x`, `b = w`, `out = y`; backward-data `a = dy`,
/// `b = w`, `out = dx`; backward-filter `a = dy`, `b = x`, `out = dw`.
#[derive(Clone, Copy)]
pub struct ConvIo<'a> {
    /// First input: `x` (forward) or `dy` (both backward directions).
    pub a: &'a Buf,
    /// Second input: `w` (forward, backward-data) or `x` (backward-filter).
    pub b: &'a Buf,
    /// Output: `y`, `dx` or `dw`.
    pub out: &'a Buf,
    /// Forward only.
    pub bias: Option<&'a Buf>,
}

/// `y = conv(x, w) + bias` with the registry's engine; returns the engine used.
pub fn conv2d_forward(
    q: &dyn Queue,
    nn: &Nn,
    g: &ConvGeom,
    x: &Buf,
    w: &Buf,
    bias: Option<&Buf>,
    y: &Buf,
) -> Result<ConvEngine> {
    let io = ConvIo {
        a: x,
        b: w,
        out: y,
        bias,
    };
    run_conv(q, nn, ConvDir::Forward, g, io)
}

/// `dx` of a convolution from `dy` and `w`, with the registry's engine.
pub fn conv2d_backward_data(
    q: &dyn Queue,
    nn: &Nn,
    g: &ConvGeom,
    dy: &Buf,
    w: &Buf,
    dx: &Buf,
) -> Result<ConvEngine> {
    let io = ConvIo {
        a: dy,
        b: w,
        out: dx,
        bias: None,
    };
    run_conv(q, nn, ConvDir::BackwardData, g, io)
}

/// `dw` of a convolution from `dy` and `x`, with the registry's engine.
pub fn conv2d_backward_filter(
    q: &dyn Queue,
    nn: &Nn,
    g: &ConvGeom,
    dy: &Buf,
    x: &Buf,
    dw: &Buf,
) -> Result<ConvEngine> {
    let io = ConvIo {
        a: dy,
        b: x,
        out: dw,
        bias: None,
    };
    run_conv(q, nn, ConvDir::BackwardFilter, g, io)
}

/// Runs one direction with the registry's engine for it; returns the engine used.
pub fn run_conv(
    q: &dyn Queue,
    nn: &Nn,
    dir: ConvDir,
    g: &ConvGeom,
    io: ConvIo<'_>,
) -> Result<ConvEngine> {
    check_io(q, dir, g, &io)?;
    let out_len = match dir {
        ConvDir::Forward => g.output_len()?,
        ConvDir::BackwardData => g.input_len()?,
        ConvDir::BackwardFilter => g.weight_len()?,
    };
    if out_len == 0 {
        return Ok(ConvEngine::Direct);
    }
    let eng = Engines::get(q.device())?;
    let policy = eng.policy();
    let key = format!(
        "{}{}",
        conv_key(dir, g, io.bias.is_some()),
        policy.conv_scope()
    );
    if let Some(algo) = eng.lookup::<ConvEngine>(&key) {
        conv_engine(q, nn, &eng, algo, dir, g, io)?;
        return Ok(algo);
    }
    let candidates = conv_candidates(q, &eng, dir, g, io.bias.is_some(), &policy)?;
    let sms = eng.device_info().multiprocessors;
    let default = default_conv_engine(dir, g, &candidates, sms);
    let mut scratch: Option<Buf> = None;
    let algo = eng.choose(q, &key, None, &candidates, default, &mut |q, algo| {
        if scratch.is_none() {
            scratch = Some(q.alloc::<f32>(out_len)?);
        }
        let out = scratch.as_ref().expect("allocated above");
        conv_engine(q, nn, &eng, algo, dir, g, ConvIo { out, ..io })
    })?;
    conv_engine(q, nn, &eng, algo, dir, g, io)?;
    Ok(algo)
}

/// Runs one direction with exactly `algo` (no registry). Errors when `algo` cannot run it here
/// (cuDNN missing or disabled, an algorithm cuDNN does not support for this geometry, sizes our
/// kernels do not take).
pub fn conv_with(
    q: &dyn Queue,
    nn: &Nn,
    algo: ConvEngine,
    dir: ConvDir,
    g: &ConvGeom,
    io: ConvIo<'_>,
) -> Result<()> {
    check_io(q, dir, g, &io)?;
    let eng = Engines::get(q.device())?;
    conv_engine(q, nn, &eng, algo, dir, g, io)
}

/// The buffers hold what the direction reads and writes and are memory of `q`'s device
/// (checked before any engine runs or is measured, so a buffer of another device is a
/// `WrongDevice` error whichever engine the registry would pick).
fn check_io(q: &dyn Queue, dir: ConvDir, g: &ConvGeom, io: &ConvIo<'_>) -> Result<()> {
    crate::extent::conv_roles(dir, g, (io.a, io.b, io.out), io.bias)?;
    crate::extent::conv_on_device(q, dir, (io.a, io.b, io.out), io.bias)
}

fn conv_engine(
    q: &dyn Queue,
    nn: &Nn,
    eng: &Engines,
    algo: ConvEngine,
    dir: ConvDir,
    g: &ConvGeom,
    io: ConvIo<'_>,
) -> Result<()> {
    match algo {
        ConvEngine::Cudnn(a) => {
            let tf32 = eng.policy().tf32_conv;
            cudnn(eng)?.run_math(q, dir, a, g, io.a, io.b, io.out, tf32)?;
            conv_bias(q, nn, eng, g, io)
        }
        ConvEngine::CudnnGraph(rank) => {
            let tf32 = eng.policy().tf32_conv;
            cudnn_graph(eng)?.run_math(q, dir, rank, g, io.a, io.b, io.out, tf32)?;
            conv_bias(q, nn, eng, g, io)
        }
        ConvEngine::CudnnGraphBias(rank) => {
            let bias = match (dir, io.bias) {
                (ConvDir::Forward, Some(bias)) => bias,
                _ => {
                    return Err(NnError::Shape(format!(
                        "{}: {algo} runs only a forward convolution with a bias",
                        conv_key(dir, g, io.bias.is_some())
                    )))
                }
            };
            let tf32 = eng.policy().tf32_conv;
            cudnn_graph(eng)?.run_fused_bias_math(q, rank, g, io.a, io.b, bias, io.out, tf32)
        }
        ConvEngine::Igemm(tile, splits) => {
            let k = ConvKernels::get(q.device())?;
            k.conv(
                q,
                dir,
                tile,
                splits as usize,
                g,
                io.a,
                io.b,
                io.out,
                io.bias,
            )
        }
        ConvEngine::Wgrad(parts) => {
            if dir != ConvDir::BackwardFilter {
                return Err(NnError::Shape(format!(
                    "{}: the small weight-gradient kernel runs only the weight gradient",
                    dir.name()
                )));
            }
            ConvKernels::get(q.device())?.wgrad_small(q, g, io.a, io.b, io.out, parts as usize)
        }
        ConvEngine::Direct => match dir {
            ConvDir::Forward => nn.k.conv2d_fwd(q, g, io.a, io.b, io.bias, io.out),
            ConvDir::BackwardData => nn.k.conv2d_bwd_input(q, g, io.a, io.b, io.out),
            ConvDir::BackwardFilter => nn.k.conv2d_bwd_weight(q, g, io.a, io.b, io.out),
        },
    }
}

/// cuDNN's legacy API, or why it cannot run here.
fn cudnn(eng: &Engines) -> Result<&crate::ffi::cudnn::Cudnn> {
    eng.cudnn().ok_or_else(|| NnError::Library {
        library: "cuDNN",
        call: "dlopen",
        status: "unavailable (missing, or disabled by the engine policy)".into(),
    })
}

/// cuDNN's graph API, or why it cannot run here.
fn cudnn_graph(eng: &Engines) -> Result<&crate::ffi::cudnn_graph::CudnnGraph> {
    eng.cudnn_graph().ok_or_else(|| NnError::Library {
        library: "cuDNN graph API",
        call: "dlopen",
        status: "unavailable (missing, older than 9, or disabled by the engine policy)".into(),
    })
}

/// The registry key of the bias added after a forward convolution of `g` by an engine that
/// does not fuse it (its output shape).
pub fn conv_bias_key(g: &ConvGeom) -> Result<String> {
    let (oh, ow) = g.out_hw()?;
    Ok(format!("conv_bias n={} oc={} hw={}", g.n, g.oc, oh * ow))
}

/// Adds `io.bias` (when there is one) to the forward output `io.out` of an engine that does
/// not fuse it, with the registry's choice for the output's shape: our `bias_planes` kernel or
/// `cudnnAddTensor`, measured on a zeroed scratch output.
fn conv_bias(q: &dyn Queue, nn: &Nn, eng: &Engines, g: &ConvGeom, io: ConvIo<'_>) -> Result<()> {
    let Some(bias) = io.bias else {
        return Ok(());
    };
    let (oh, ow) = g.out_hw()?;
    let hw = oh * ow;
    let run = |q: &dyn Queue, algo: BiasEngine, y: &Buf| match algo {
        BiasEngine::Planes => nn.k.bias_planes(q, y, bias, g.n, g.oc, hw),
        BiasEngine::CudnnAdd => cudnn(eng)?.add_bias(q, g, bias, y),
    };
    let key = conv_bias_key(g)?;
    let mut candidates = vec![BiasEngine::Planes];
    if eng.cudnn().is_some() {
        candidates.push(BiasEngine::CudnnAdd);
    }
    let mut scratch: Option<Buf> = None;
    let algo = eng.choose(
        q,
        &key,
        None,
        &candidates,
        BiasEngine::Planes,
        &mut |q, algo| {
            if scratch.is_none() {
                let s = q.alloc::<f32>(g.output_len()?)?;
                q.memset_zero(&s)?;
                scratch = Some(s);
            }
            run(q, algo, scratch.as_ref().expect("allocated above"))
        },
    )?;
    run(q, algo, io.out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom(c: usize, k: usize, stride: usize, pad: usize) -> ConvGeom {
        ConvGeom {
            n: 8,
            c,
            h: 32,
            w: 32,
            oc: 16,
            kh: k,
            kw: k,
            stride,
            pad,
        }
    }

    #[test]
    fn keys_name_direction_geometry_and_bias() {
        let g = geom(3, 3, 1, 1);
        assert_eq!(
            conv_key(ConvDir::Forward, &g, true),
            "conv_fwd n=8 c=3 h=32 w=32 oc=16 k=3x3 s=1 p=1 bias"
        );
        assert_eq!(
            conv_key(ConvDir::BackwardFilter, &geom(64, 7, 2, 0), false),
            "conv_bwd_filter n=8 c=64 h=32 w=32 oc=16 k=7x7 s=2 p=0"
        );
    }

    #[test]
    fn heuristic_default_prefers_cudnn_then_the_small_direct_path_then_igemm() {
        let g = geom(3, 3, 1, 1);
        let ours = [
            ConvEngine::Igemm(Tile::T64x64, 1),
            ConvEngine::Igemm(Tile::T32x128, 1),
            ConvEngine::Direct,
        ];
        let mut with_cudnn = vec![ConvEngine::Cudnn(1), ConvEngine::Cudnn(0)];
        with_cudnn.extend(ours);
        assert_eq!(
            default_conv_engine(ConvDir::Forward, &g, &with_cudnn, 132),
            ConvEngine::Cudnn(1)
        );
        // 27 taps per output: the direct kernel's fast path.
        assert_eq!(
            default_conv_engine(ConvDir::Forward, &g, &ours, 132),
            ConvEngine::Direct
        );
        // 16 output channels: the 32-row tile.
        let s = igemm::default_splits(ConvDir::BackwardData, &g, Tile::T32x128, 132) as u16;
        let mut cands = ours.to_vec();
        cands.push(ConvEngine::Igemm(Tile::T32x128, s));
        let want = ConvEngine::Igemm(Tile::T32x128, s);
        let big = geom(64, 3, 1, 1);
        let s2 = igemm::default_splits(ConvDir::BackwardData, &big, Tile::T64x64, 132) as u16;
        let mut cands2 = ours.to_vec();
        cands2.push(ConvEngine::Igemm(Tile::T64x64, s2));
        assert_eq!(
            default_conv_engine(ConvDir::BackwardData, &big, &cands2, 132),
            ConvEngine::Igemm(Tile::T64x64, s2)
        );
        assert_eq!(
            default_conv_engine(ConvDir::BackwardData, &g, &cands, 132),
            want
        );
        assert_eq!(workspace_limit(80 << 30), 1 << 30);
    }
}
