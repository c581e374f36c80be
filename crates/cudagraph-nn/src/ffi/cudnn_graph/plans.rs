//! Operation graphs and their plans: the convolution (and the fused forward's bias addition)
//! as backend descriptors, cuDNN's heuristic lists read and filtered to plain fp32, and the
//! plan [`Set`] of one key with its execution plans built in rank order.

use super::super::loader::{describe, error, Ptr, Status};
use super::backend::*;
use super::{Candidate, CAP, FUSED_CAP};
use crate::error::{NnError, Result};
use crate::extent::{ConvDir, ConvGeom};

/// What the heuristics say about one engine configuration (raw integers as cuDNN gave them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct ConfigInfo {
    /// `CUDNN_ATTR_ENGINE_GLOBAL_INDEX`.
    pub(super) engine: i64,
    /// (knob type, value), sorted.
    pub(super) knobs: Vec<(i32, i64)>,
    /// `cudnnBackendNumericalNote_t` values.
    pub(super) notes: Vec<i32>,
    /// `cudnnBackendBehaviorNote_t` values.
    pub(super) behavior: Vec<i32>,
}

/// Whether an engine with these numerical notes computes in plain fp32 (FMA): no tensor cores
/// (TF32), no down-converted inputs, no reduced-precision reduction. Unknown notes are ignored.
pub(super) fn fp32_fma(notes: &[i32]) -> bool {
    !notes.iter().any(|&n| {
        matches!(
            n,
            NOTE_TENSOR_CORE | NOTE_DOWN_CONVERT_INPUTS | NOTE_REDUCED_PRECISION_REDUCTION
        )
    })
}

/// Whether an engine with these numerical notes may run when TF32 is allowed (`tf32`,
/// [`crate::engine::Policy::tf32_conv`]) or not: plain fp32 ([`fp32_fma`]), or, with `tf32`,
/// also tensor cores (TF32 for fp32 data) — never down-converted inputs or a
/// reduced-precision reduction.
pub(super) fn admitted(notes: &[i32], tf32: bool) -> bool {
    fp32_fma(notes)
        || (tf32
            && !notes.iter().any(|&n| {
                matches!(
                    n,
                    NOTE_DOWN_CONVERT_INPUTS | NOTE_REDUCED_PRECISION_REDUCTION
                )
            }))
}

pub(super) fn nondeterministic(notes: &[i32]) -> bool {
    notes.contains(&NOTE_NONDETERMINISTIC)
}

/// `eng20 k2=6 k3=0`: engine index and knob choices (the identity used to remove duplicates).
pub(super) fn tag(engine: i64, knobs: &[(i32, i64)]) -> String {
    let mut s = format!("eng{engine}");
    for (t, v) in knobs {
        s.push_str(&format!(" k{t}={v}"));
    }
    s
}

/// The configurations kept, as indices into `infos` (heuristic order): plain fp32 only (with
/// `tf32`, also TF32 tensor cores: [`admitted`]), the first of each (engine, knobs), at most
/// 256 (ranks are `u8`).
pub(super) fn select(infos: &[ConfigInfo], tf32: bool) -> Vec<usize> {
    let mut seen = std::collections::HashSet::new();
    infos
        .iter()
        .enumerate()
        .filter(|(_, c)| admitted(&c.notes, tf32))
        .filter(|(_, c)| seen.insert((c.engine, c.knobs.clone())))
        .map(|(i, _)| i)
        .take(u8::MAX as usize + 1)
        .collect()
}

/// The candidates among built plans `(rank, deterministic, workspace)` in rank order: the
/// first `cap` ([`CAP`], or [`FUSED_CAP`] for the fused forward) the policy allows, without
/// those needing more than `max_workspace` bytes.
pub(super) fn pick(
    built: impl IntoIterator<Item = (u8, bool, usize)>,
    deterministic_only: bool,
    max_workspace: usize,
    cap: usize,
) -> Vec<u8> {
    built
        .into_iter()
        .filter(|&(_, det, _)| det || !deterministic_only)
        .take(cap)
        .filter(|&(_, _, ws)| ws <= max_workspace)
        .map(|(r, _, _)| r)
        .collect()
}

/// The state of one configuration's plan.
pub(super) enum Slot {
    Untried,
    Built { plan: Desc, workspace: usize },
    Failed(String),
}

/// One kept configuration. Field order is drop order: the plan before its configuration.
pub(super) struct Config {
    pub(super) slot: Slot,
    pub(super) info: ConfigInfo,
    pub(super) cfg: Desc,
}

/// Everything built for one (direction, geometry, bias fused or not, alignment). Field order
/// is drop order: plans and configurations, then the heuristics they came from, then the
/// operation graph and its parts.
pub(super) struct Set {
    pub(super) configs: Vec<Config>,
    /// How many candidates it offers at most ([`CAP`] or [`FUSED_CAP`]).
    pub(super) cap: usize,
    /// Every configuration the heuristics listed and what became of it (for reports).
    pub(super) listed: Vec<String>,
    pub(super) _heuristics: Vec<Desc>,
    pub(super) _graph: Desc,
    /// The convolution, then the bias addition of the fused forward.
    pub(super) _ops: Vec<Desc>,
    pub(super) _pointwise: Option<Desc>,
    pub(super) _conv: Desc,
    pub(super) _tensors: Vec<Desc>,
}

impl Set {
    pub(super) fn candidate(&self, rank: u8) -> Option<Candidate> {
        let c = self.configs.get(rank as usize)?;
        let workspace = match c.slot {
            Slot::Built { workspace, .. } => workspace,
            _ => return None,
        };
        Some(Candidate {
            rank,
            engine: c.info.engine,
            knobs: c.info.knobs.clone(),
            notes: c.info.notes.clone(),
            behavior: c.info.behavior.clone(),
            workspace,
        })
    }

    /// What the heuristics listed and, per kept configuration, its plan (one line each).
    pub(super) fn report(&self, name: &str) -> String {
        let mut s = format!(
            "{name}: {} configurations listed, {} kept",
            self.listed.len(),
            self.configs.len()
        );
        for l in &self.listed {
            s.push_str(&format!("\n  listed {l}"));
        }
        for (rank, c) in self.configs.iter().enumerate() {
            let plan = match &c.slot {
                Slot::Untried => "plan not built".to_string(),
                Slot::Built { workspace, .. } => format!("plan built, workspace {workspace}"),
                Slot::Failed(why) => format!("plan failed: {why}"),
            };
            s.push_str(&format!("\n  rank {rank} {}: {plan}", c.info_tag()));
        }
        s
    }

    pub(super) fn candidates(
        &self,
        deterministic_only: bool,
        max_workspace: usize,
    ) -> Vec<Candidate> {
        let built = self
            .configs
            .iter()
            .enumerate()
            .filter_map(|(r, c)| match c.slot {
                Slot::Built { workspace, .. } => {
                    Some((r as u8, !nondeterministic(&c.info.notes), workspace))
                }
                _ => None,
            });
        pick(built, deterministic_only, max_workspace, self.cap)
            .into_iter()
            .filter_map(|r| self.candidate(r))
            .collect()
    }
}

pub(super) type SetKey = (usize, bool, [usize; 9], u32);

pub(super) fn set_key(dir: ConvDir, g: &ConvGeom, bias: bool, align: u32) -> SetKey {
    let d = match dir {
        ConvDir::Forward => 0,
        ConvDir::BackwardData => 1,
        ConvDir::BackwardFilter => 2,
    };
    (
        d,
        bias,
        [g.n, g.c, g.h, g.w, g.oc, g.kh, g.kw, g.stride, g.pad],
        align,
    )
}

/// (descriptor type, alpha, beta, conv, x, w, y) attribute names of a direction's operation.
pub(super) fn op_attrs(dir: ConvDir) -> (u32, [u32; 6]) {
    match dir {
        ConvDir::Forward => (D_OP_CONV_FORWARD, [700, 701, 702, 704, 703, 705]),
        ConvDir::BackwardData => (D_OP_CONV_BACKWARD_DATA, [706, 707, 708, 710, 709, 711]),
        ConvDir::BackwardFilter => (D_OP_CONV_BACKWARD_FILTER, [712, 713, 714, 716, 715, 717]),
    }
}

pub(super) fn i64_of(what: &str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| NnError::Shape(format!("cuDNN: {what} = {v} exceeds an int64")))
}

/// A finalized fp32 NCHW-packed tensor descriptor (for `[1, K, 1, 1]` the strides are
/// `[K, 1, 1, 1]`).
pub(super) fn tensor(api: &'static Api, dims: [i64; 4], uid: i64, align: u32) -> Result<Desc> {
    tensor_of(api, dims, uid, align, false)
}

/// [`tensor`], virtual when `is_virtual`: an intermediate of an operation graph that cuDNN
/// keeps to itself (no memory, not in the variant pack).
pub(super) fn tensor_of(
    api: &'static Api,
    dims: [i64; 4],
    uid: i64,
    align: u32,
    is_virtual: bool,
) -> Result<Desc> {
    let strides = [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1];
    let call = "cudnnBackend*(TENSOR)";
    let t = Desc::new(api, D_TENSOR).map_err(|s| error(api, s, call))?;
    (|| {
        t.set_enum(A_TENSOR_DATA_TYPE, T_DATA_TYPE, DATA_FLOAT)?;
        t.set_i64(A_TENSOR_DIMENSIONS, &dims)?;
        t.set_i64(A_TENSOR_STRIDES, &strides)?;
        t.set_i64(A_TENSOR_UNIQUE_ID, &[uid])?;
        t.set_i64(A_TENSOR_BYTE_ALIGNMENT, &[align as i64])?;
        if is_virtual {
            t.set_bool(A_TENSOR_IS_VIRTUAL, true)?;
        }
        t.finalize()
    })()
    .map_err(|s| error(api, s, call))?;
    Ok(t)
}

/// Reads one heuristic result.
pub(super) fn read_config(api: &'static Api, cfg: &Desc) -> St<ConfigInfo> {
    let engine = Desc::new(api, D_ENGINE)?;
    if cfg.get_descs(A_CFG_ENGINE, std::slice::from_ref(&engine))? != 1 {
        return Err(2000);
    }
    let index = engine.get_i64(A_ENGINE_GLOBAL_INDEX)?;
    // Notes that cannot be read cannot be checked: such a configuration is not used.
    let notes = engine.get_enums(A_ENGINE_NUMERICAL_NOTE, T_NUMERICAL_NOTE, MAX_NOTES)?;
    let behavior = engine
        .get_enums(A_ENGINE_BEHAVIOR_NOTE, T_BEHAVIOR_NOTE, MAX_NOTES)
        .unwrap_or_default();
    let choices = Desc::many(api, D_KNOB_CHOICE, MAX_KNOBS)?;
    let n = cfg.get_descs(A_CFG_KNOB_CHOICES, &choices).unwrap_or(0);
    let mut knobs = Vec::with_capacity(n);
    for k in &choices[..n] {
        let t = k.get_enums(A_KNOB_TYPE, T_KNOB_TYPE, 1)?;
        let v = k.get_i64(A_KNOB_VALUE)?;
        if let Some(&t) = t.first() {
            knobs.push((t, v));
        }
    }
    knobs.sort_unstable();
    Ok(ConfigInfo {
        engine: index,
        knobs,
        notes,
        behavior,
    })
}

/// Finalizes the execution plan of one configuration; returns it with its workspace bytes.
pub(super) fn build_plan(api: &'static Api, handle: Ptr, cfg: &Desc) -> St<(Desc, usize)> {
    let plan = Desc::new(api, D_EXECUTION_PLAN)?;
    plan.set_handle(A_PLAN_HANDLE, handle)?;
    plan.set_descs(A_PLAN_ENGINE_CONFIG, &[cfg])?;
    plan.finalize()?;
    let ws = plan.get_i64(A_PLAN_WORKSPACE_SIZE)?;
    Ok((plan, ws.max(0) as usize))
}

pub(super) fn fill_slot(api: &'static Api, handle: Ptr, c: &mut Config) {
    c.slot = match build_plan(api, handle, &c.cfg) {
        Ok((plan, workspace)) => Slot::Built { plan, workspace },
        Err(st) if NOT_SUPPORTED.contains(&st) => Slot::Failed(describe(api, st)),
        Err(st) => Slot::Failed(format!("finalize failed: {}", describe(api, st))),
    };
}

/// The convolution operation of one direction and what it refers to: (x, w, y) tensors, the
/// convolution descriptor, the operation (all finalized; no handle needed). With `fused`
/// (forward only) its output is the virtual tensor [`UID_CONV_OUT`] the bias is added to.
pub(super) fn build_op(
    api: &'static Api,
    dir: ConvDir,
    g: &ConvGeom,
    align: u32,
    fused: bool,
) -> Result<(Vec<Desc>, Desc, Desc)> {
    if fused && dir != ConvDir::Forward {
        return Err(NnError::Shape(format!(
            "{}: a bias is fused only into the forward direction",
            dir.name()
        )));
    }
    let (oh, ow) = g.out_hw()?;
    let v = |what, x| i64_of(what, x);
    let (n, c, h, w) = (v("n", g.n)?, v("c", g.c)?, v("h", g.h)?, v("w", g.w)?);
    let (oc, kh, kw) = (v("oc", g.oc)?, v("kh", g.kh)?, v("kw", g.kw)?);
    let (s, p, oh, ow) = (
        v("stride", g.stride)?,
        v("pad", g.pad)?,
        v("oh", oh)?,
        v("ow", ow)?,
    );
    let (y_uid, y_virtual) = if fused {
        (UID_CONV_OUT, true)
    } else {
        (UID_Y, false)
    };
    let tensors = vec![
        tensor(api, [n, c, h, w], UID_X, align)?,
        tensor(api, [oc, c, kh, kw], UID_W, align)?,
        tensor_of(api, [n, oc, oh, ow], y_uid, align, y_virtual)?,
    ];
    let e = |call| err_of(api, call);
    let conv = Desc::new(api, D_CONVOLUTION).map_err(e("cudnnBackendCreateDescriptor"))?;
    (|| {
        conv.set_enum(A_CONV_COMP_TYPE, T_DATA_TYPE, DATA_FLOAT)?;
        conv.set_enum(A_CONV_MODE, T_CONVOLUTION_MODE, CROSS_CORRELATION)?;
        conv.set_i64(A_CONV_SPATIAL_DIMS, &[2])?;
        conv.set_i64(A_CONV_DILATIONS, &[1, 1])?;
        conv.set_i64(A_CONV_FILTER_STRIDES, &[s, s])?;
        conv.set_i64(A_CONV_PRE_PADDINGS, &[p, p])?;
        conv.set_i64(A_CONV_POST_PADDINGS, &[p, p])?;
        conv.finalize()
    })()
    .map_err(e("cudnnBackend*(CONVOLUTION)"))?;
    let (op_type, [alpha, beta, conv_a, x_a, w_a, y_a]) = op_attrs(dir);
    let op = Desc::new(api, op_type).map_err(e("cudnnBackendCreateDescriptor"))?;
    (|| {
        op.set_descs(x_a, &[&tensors[0]])?;
        op.set_descs(w_a, &[&tensors[1]])?;
        op.set_descs(y_a, &[&tensors[2]])?;
        op.set_descs(conv_a, &[&conv])?;
        op.set_f32(alpha, 1.0)?;
        op.set_f32(beta, 0.0)?;
        op.finalize()
    })()
    .map_err(e("cudnnBackend*(OPERATION_CONVOLUTION)"))?;
    Ok((tensors, conv, op))
}

/// The bias addition of the fused forward: `y = conv_out + bias`, the bias `[1, K, 1, 1]`
/// broadcast over batch and pixels, added in fp32. Returns the (bias, y) tensors, the
/// pointwise descriptor and the operation (all finalized; no handle needed).
pub(super) fn build_bias_add(
    api: &'static Api,
    g: &ConvGeom,
    align: u32,
    conv_out: &Desc,
) -> Result<(Vec<Desc>, Desc, Desc)> {
    let (oh, ow) = g.out_hw()?;
    let v = |what, x| i64_of(what, x);
    let (n, oc, oh, ow) = (v("n", g.n)?, v("oc", g.oc)?, v("oh", oh)?, v("ow", ow)?);
    let tensors = vec![
        tensor(api, [1, oc, 1, 1], UID_BIAS, align)?,
        tensor(api, [n, oc, oh, ow], UID_Y, align)?,
    ];
    let e = |call| err_of(api, call);
    let pw = Desc::new(api, D_POINTWISE).map_err(e("cudnnBackendCreateDescriptor"))?;
    (|| {
        pw.set_enum(A_POINTWISE_MODE, T_POINTWISE_MODE, POINTWISE_ADD)?;
        pw.set_enum(A_POINTWISE_MATH_PREC, T_DATA_TYPE, DATA_FLOAT)?;
        pw.finalize()
    })()
    .map_err(e("cudnnBackend*(POINTWISE)"))?;
    let op = Desc::new(api, D_OP_POINTWISE).map_err(e("cudnnBackendCreateDescriptor"))?;
    (|| {
        op.set_descs(A_OP_POINTWISE_PW_DESCRIPTOR, &[&pw])?;
        op.set_descs(A_OP_POINTWISE_XDESC, &[conv_out])?;
        op.set_descs(A_OP_POINTWISE_BDESC, &[&tensors[0]])?;
        op.set_descs(A_OP_POINTWISE_YDESC, &[&tensors[1]])?;
        op.finalize()
    })()
    .map_err(e("cudnnBackend*(OPERATION_POINTWISE)"))?;
    Ok((tensors, pw, op))
}

/// The operation graph of one direction (with `bias`: the forward with its bias fused), its
/// heuristic list and the plans of its first configurations (host work only; may compile
/// engines at run time).
pub(super) fn build_set(
    api: &'static Api,
    handle: Ptr,
    dir: ConvDir,
    g: &ConvGeom,
    bias: bool,
    align: u32,
    tf32: bool,
) -> Result<Set> {
    let (mut tensors, conv, op) = build_op(api, dir, g, align, bias)?;
    let mut ops = vec![op];
    let mut pointwise = None;
    if bias {
        let (more, pw, add) = build_bias_add(api, g, align, &tensors[2])?;
        tensors.extend(more);
        ops.push(add);
        pointwise = Some(pw);
    }
    let cap = if bias { FUSED_CAP } else { CAP };
    let e = |call| err_of(api, call);
    let graph = Desc::new(api, D_OPERATION_GRAPH).map_err(e("cudnnBackendCreateDescriptor"))?;
    (|| {
        graph.set_descs(A_GRAPH_OPS, &ops.iter().collect::<Vec<_>>())?;
        graph.set_handle(A_GRAPH_HANDLE, handle)?;
        graph.finalize()
    })()
    .map_err(e("cudnnBackend*(OPERATIONGRAPH)"))?;

    // INSTANT first, then FALLBACK; a list cuDNN cannot give is skipped.
    let mut heuristics = Vec::new();
    let mut found: Vec<(ConfigInfo, Desc)> = Vec::new();
    for mode in [HEUR_INSTANT, HEUR_FALLBACK] {
        let Ok(he) = Desc::new(api, D_ENGINEHEUR) else {
            continue;
        };
        let listed = (|| {
            he.set_descs(A_HEUR_OPERATION_GRAPH, &[&graph])?;
            he.set_enum(A_HEUR_MODE, T_HEUR_MODE, mode)?;
            he.finalize()?;
            let cfgs = Desc::many(api, D_ENGINECFG, he.count(A_HEUR_RESULTS)?)?;
            let got = he.get_descs(A_HEUR_RESULTS, &cfgs)?;
            Ok::<_, Status>(cfgs.into_iter().take(got).collect::<Vec<_>>())
        })();
        let Ok(cfgs) = listed else {
            continue;
        };
        for cfg in cfgs {
            if let Ok(info) = read_config(api, &cfg) {
                found.push((info, cfg));
            }
        }
        heuristics.push(he);
    }
    let infos: Vec<ConfigInfo> = found.iter().map(|(i, _)| i.clone()).collect();
    let keep = select(&infos, tf32);
    let listed = infos
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let fate = match keep.iter().position(|&k| k == i) {
                Some(rank) => format!("rank {rank}"),
                None if !admitted(&c.notes, tf32) => "dropped (not plain fp32)".to_string(),
                None => "dropped (repeated)".to_string(),
            };
            format!(
                "{} notes {:?} behaviour {:?}: {fate}",
                tag(c.engine, &c.knobs),
                c.notes,
                c.behavior
            )
        })
        .collect();
    let mut slots: Vec<Option<(ConfigInfo, Desc)>> = found.into_iter().map(Some).collect();
    let mut configs: Vec<Config> = keep
        .into_iter()
        .filter_map(|i| slots[i].take())
        .map(|(info, cfg)| Config {
            slot: Slot::Untried,
            info,
            cfg,
        })
        .collect();
    drop(slots); // configurations not kept
    let mut deterministic_built = 0;
    for c in &mut configs {
        if deterministic_built >= cap {
            break;
        }
        fill_slot(api, handle, c);
        if matches!(c.slot, Slot::Built { .. }) && !nondeterministic(&c.info.notes) {
            deterministic_built += 1;
        }
    }
    Ok(Set {
        configs,
        cap,
        listed,
        _heuristics: heuristics,
        _graph: graph,
        _ops: ops,
        _pointwise: pointwise,
        _conv: conv,
        _tensors: tensors,
    })
}

impl Config {
    pub(super) fn info_tag(&self) -> String {
        tag(self.info.engine, &self.info.knobs)
    }
}
