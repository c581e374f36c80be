//! Operation graphs and their plans: the convolution (and the fused forward's epilogue: bias
//! addition, ReLU) as backend descriptors of any data type and layout ([`OpSpec`]), cuDNN's
//! heuristic lists read and filtered (plain fp32 for fp32 data; fp32 accumulation for half
//! data), and the plan [`Set`] of one key with its execution plans built in rank order.

use super::super::loader::{describe, error, Ptr, Status};
use super::backend::*;
use super::{Candidate, CAP, FUSED_CAP};
use crate::error::{NnError, Result};
use crate::extent::{ConvDir, ConvGeom, ConvShape};

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
#[cfg(test)]
pub(super) fn select(infos: &[ConfigInfo], tf32: bool) -> Vec<usize> {
    select_by(infos, |notes| admitted(notes, tf32))
}

/// [`select`] with the admission rule `admit` (on an engine's numerical notes).
pub(super) fn select_by(infos: &[ConfigInfo], admit: impl Fn(&[i32]) -> bool) -> Vec<usize> {
    let mut seen = std::collections::HashSet::new();
    infos
        .iter()
        .enumerate()
        .filter(|(_, c)| admit(&c.notes))
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
    /// The convolution, then the epilogue of the fused forward (bias addition, ReLU).
    pub(super) _ops: Vec<Desc>,
    pub(super) _pointwise: Vec<Desc>,
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

/// What one operation graph describes: the direction, the geometry with its dilation, the data
/// types, the layout, the epilogue fused into a forward, the pointers' alignment, and which
/// engines are admitted. The key of its plan set too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct OpSpec {
    pub(super) dir: ConvDir,
    /// n, c, h, w, oc, kh, kw, stride, pad, dilation.
    pub(super) dims: [usize; 10],
    /// `cudnnDataType_t` of the inputs (and of the bias), and of the direction's output.
    pub(super) io_type: i32,
    pub(super) out_type: i32,
    /// Channels-last tensors (`NHWC`, filters `KRSC`).
    pub(super) nhwc: bool,
    /// Forward only: the bias added (`[1, K, 1, 1]`, broadcast), then `relu` applied, inside
    /// the graph; the convolution's output is then a virtual fp32 tensor.
    pub(super) bias: bool,
    pub(super) relu: bool,
    pub(super) align: u32,
    /// fp32 data only: TF32 tensor-core engines admitted.
    pub(super) tf32: bool,
}

impl OpSpec {
    /// fp32 NCHW without dilation; with `bias`, the forward with its bias fused.
    pub(super) fn f32(dir: ConvDir, g: &ConvGeom, bias: bool, align: u32, tf32: bool) -> OpSpec {
        OpSpec {
            dir,
            dims: [g.n, g.c, g.h, g.w, g.oc, g.kh, g.kw, g.stride, g.pad, 1],
            io_type: DATA_FLOAT,
            out_type: DATA_FLOAT,
            nhwc: false,
            bias,
            relu: false,
            align,
            tf32,
        }
    }

    pub(super) fn shape(&self) -> ConvShape {
        let d = self.dims;
        ConvShape {
            geom: ConvGeom {
                n: d[0],
                c: d[1],
                h: d[2],
                w: d[3],
                oc: d[4],
                kh: d[5],
                kw: d[6],
                stride: d[7],
                pad: d[8],
            },
            dilation: d[9],
        }
    }

    /// Whether the graph ends in an epilogue (then the convolution's output is virtual).
    pub(super) fn fused(&self) -> bool {
        self.bias || self.relu
    }

    /// Half-precision inputs.
    pub(super) fn half(&self) -> bool {
        self.io_type != DATA_FLOAT
    }

    /// Whether an engine with these numerical notes may run this graph: fp32 data as
    /// [`admitted`] says; half data with fp32 accumulation — tensor cores welcome, never
    /// down-converted inputs nor a reduced-precision reduction.
    pub(super) fn admits(&self, notes: &[i32]) -> bool {
        if self.half() {
            !notes.iter().any(|&n| {
                matches!(
                    n,
                    NOTE_DOWN_CONVERT_INPUTS | NOTE_REDUCED_PRECISION_REDUCTION
                )
            })
        } else {
            admitted(notes, self.tf32)
        }
    }

    /// The data type of the x, w and y tensors (the direction's output has `out_type`).
    fn types(&self) -> [i32; 3] {
        let (i, o) = (self.io_type, self.out_type);
        match self.dir {
            ConvDir::Forward => [i, i, o],
            ConvDir::BackwardData => [o, i, i],
            ConvDir::BackwardFilter => [i, o, i],
        }
    }
}

/// A finalized fp32 NCHW-packed tensor descriptor (for `[1, K, 1, 1]` the strides are
/// `[K, 1, 1, 1]`).
#[cfg(test)]
pub(super) fn tensor(api: &'static Api, dims: [i64; 4], uid: i64, align: u32) -> Result<Desc> {
    tensor_of(api, dims, uid, align, false)
}

/// [`tensor`], virtual when `is_virtual`: an intermediate of an operation graph that cuDNN
/// keeps to itself (no memory, not in the variant pack).
#[cfg(test)]
pub(super) fn tensor_of(
    api: &'static Api,
    dims: [i64; 4],
    uid: i64,
    align: u32,
    is_virtual: bool,
) -> Result<Desc> {
    tensor_typed(api, dims, uid, align, is_virtual, DATA_FLOAT, false)
}

/// The strides of packed `dims` (`[n, c, h, w]`, or `[k, c, r, s]` for a filter): NCHW, or
/// channels last (`nhwc`: NHWC, filters KRSC; `[1, K, 1, 1]` gets `[K, 1, K, K]`).
pub(super) fn strides(dims: [i64; 4], nhwc: bool) -> [i64; 4] {
    let [_, c, h, w] = dims;
    if nhwc {
        [c * h * w, 1, w * c, c]
    } else {
        [c * h * w, h * w, w, 1]
    }
}

/// A finalized packed tensor descriptor of any data type and layout.
pub(super) fn tensor_typed(
    api: &'static Api,
    dims: [i64; 4],
    uid: i64,
    align: u32,
    is_virtual: bool,
    data_type: i32,
    nhwc: bool,
) -> Result<Desc> {
    let call = "cudnnBackend*(TENSOR)";
    let t = Desc::new(api, D_TENSOR).map_err(|s| error(api, s, call))?;
    (|| {
        t.set_enum(A_TENSOR_DATA_TYPE, T_DATA_TYPE, data_type)?;
        t.set_i64(A_TENSOR_DIMENSIONS, &dims)?;
        t.set_i64(A_TENSOR_STRIDES, &strides(dims, nhwc))?;
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
#[cfg(test)]
pub(super) fn build_op(
    api: &'static Api,
    dir: ConvDir,
    g: &ConvGeom,
    align: u32,
    fused: bool,
) -> Result<(Vec<Desc>, Desc, Desc)> {
    build_conv(api, &OpSpec::f32(dir, g, fused, align, false))
}

/// The convolution operation of `spec` (its epilogue aside): (x, w, y) tensors of the spec's
/// types and layout, the convolution descriptor (fp32 compute, the spec's stride, padding and
/// dilation), the operation. A fused forward writes the virtual fp32 tensor [`UID_CONV_OUT`].
pub(super) fn build_conv(api: &'static Api, spec: &OpSpec) -> Result<(Vec<Desc>, Desc, Desc)> {
    let dir = spec.dir;
    if spec.fused() && dir != ConvDir::Forward {
        return Err(NnError::Shape(format!(
            "{}: a bias or activation is fused only into the forward direction",
            dir.name()
        )));
    }
    let shape = spec.shape();
    let g = &shape.geom;
    let (oh, ow) = shape.out_hw()?;
    let v = |what, x| i64_of(what, x);
    let (n, c, h, w) = (v("n", g.n)?, v("c", g.c)?, v("h", g.h)?, v("w", g.w)?);
    let (oc, kh, kw) = (v("oc", g.oc)?, v("kh", g.kh)?, v("kw", g.kw)?);
    let (s, p, d, oh, ow) = (
        v("stride", g.stride)?,
        v("pad", g.pad)?,
        v("dilation", shape.dilation)?,
        v("oh", oh)?,
        v("ow", ow)?,
    );
    let [tx, tw, ty] = spec.types();
    let (y_uid, y_virtual, ty) = if spec.fused() {
        (UID_CONV_OUT, true, DATA_FLOAT)
    } else {
        (UID_Y, false, ty)
    };
    let (a, nhwc) = (spec.align, spec.nhwc);
    let tensors = vec![
        tensor_typed(api, [n, c, h, w], UID_X, a, false, tx, nhwc)?,
        tensor_typed(api, [oc, c, kh, kw], UID_W, a, false, tw, nhwc)?,
        tensor_typed(api, [n, oc, oh, ow], y_uid, a, y_virtual, ty, nhwc)?,
    ];
    let e = |call| err_of(api, call);
    let conv = Desc::new(api, D_CONVOLUTION).map_err(e("cudnnBackendCreateDescriptor"))?;
    (|| {
        conv.set_enum(A_CONV_COMP_TYPE, T_DATA_TYPE, DATA_FLOAT)?;
        conv.set_enum(A_CONV_MODE, T_CONVOLUTION_MODE, CROSS_CORRELATION)?;
        conv.set_i64(A_CONV_SPATIAL_DIMS, &[2])?;
        conv.set_i64(A_CONV_DILATIONS, &[d, d])?;
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

/// One pointwise operation `y = mode(x[, b])` computed in fp32: its pointwise descriptor and
/// the operation (both finalized).
fn build_pointwise(
    api: &'static Api,
    mode: i32,
    x: &Desc,
    b: Option<&Desc>,
    y: &Desc,
) -> Result<(Desc, Desc)> {
    let e = |call| err_of(api, call);
    let pw = Desc::new(api, D_POINTWISE).map_err(e("cudnnBackendCreateDescriptor"))?;
    (|| {
        pw.set_enum(A_POINTWISE_MODE, T_POINTWISE_MODE, mode)?;
        pw.set_enum(A_POINTWISE_MATH_PREC, T_DATA_TYPE, DATA_FLOAT)?;
        pw.finalize()
    })()
    .map_err(e("cudnnBackend*(POINTWISE)"))?;
    let op = Desc::new(api, D_OP_POINTWISE).map_err(e("cudnnBackendCreateDescriptor"))?;
    (|| {
        op.set_descs(A_OP_POINTWISE_PW_DESCRIPTOR, &[&pw])?;
        op.set_descs(A_OP_POINTWISE_XDESC, &[x])?;
        if let Some(b) = b {
            op.set_descs(A_OP_POINTWISE_BDESC, &[b])?;
        }
        op.set_descs(A_OP_POINTWISE_YDESC, &[y])?;
        op.finalize()
    })()
    .map_err(e("cudnnBackend*(OPERATION_POINTWISE)"))?;
    Ok((pw, op))
}

/// The bias addition of the fused forward: `y = conv_out + bias`, the bias `[1, K, 1, 1]`
/// broadcast over batch and pixels, added in fp32. Returns the (bias, y) tensors, the
/// pointwise descriptor and the operation (all finalized; no handle needed).
#[cfg(test)]
pub(super) fn build_bias_add(
    api: &'static Api,
    g: &ConvGeom,
    align: u32,
    conv_out: &Desc,
) -> Result<(Vec<Desc>, Desc, Desc)> {
    let (tensors, mut pws, mut ops) = build_epilogue(
        api,
        &OpSpec::f32(ConvDir::Forward, g, true, align, false),
        conv_out,
    )?;
    match (pws.pop(), ops.pop()) {
        (Some(pw), Some(op)) => Ok((tensors, pw, op)),
        _ => Err(NnError::Shape("no bias addition was built".into())),
    }
}

/// The epilogue of a fused forward, after the convolution's virtual fp32 output `conv_out`:
/// the bias added (`[1, K, 1, 1]` of the input type, broadcast), then ReLU, each in fp32, the
/// last one writing `y` (the spec's output type and layout); intermediates are virtual fp32.
/// Returns the tensors made (bias, intermediate, y), the pointwise descriptors and the
/// operations in graph order (all finalized; no handle needed).
pub(super) fn build_epilogue(
    api: &'static Api,
    spec: &OpSpec,
    conv_out: &Desc,
) -> Result<(Vec<Desc>, Vec<Desc>, Vec<Desc>)> {
    let shape = spec.shape();
    let g = &shape.geom;
    let (oh, ow) = shape.out_hw()?;
    let v = |what, x| i64_of(what, x);
    let (n, oc, oh, ow) = (v("n", g.n)?, v("oc", g.oc)?, v("oh", oh)?, v("ow", ow)?);
    let (a, nhwc) = (spec.align, spec.nhwc);
    let y_dims = [n, oc, oh, ow];
    let mut tensors = Vec::new();
    let (mut pws, mut ops) = (Vec::new(), Vec::new());
    // Which tensor the next step reads: index into `tensors`, or the convolution's output.
    let mut input: Option<usize> = None;
    let steps = [(spec.bias, POINTWISE_ADD), (spec.relu, POINTWISE_RELU_FWD)];
    let last = steps.iter().rposition(|s| s.0);
    for (i, &(on, mode)) in steps.iter().enumerate() {
        if !on {
            continue;
        }
        let bias = if mode == POINTWISE_ADD {
            tensors.push(tensor_typed(
                api,
                [1, oc, 1, 1],
                UID_BIAS,
                a,
                false,
                spec.io_type,
                nhwc,
            )?);
            Some(tensors.len() - 1)
        } else {
            None
        };
        let out = if Some(i) == last {
            tensor_typed(api, y_dims, UID_Y, a, false, spec.out_type, nhwc)?
        } else {
            tensor_typed(api, y_dims, UID_EPILOGUE, a, true, DATA_FLOAT, nhwc)?
        };
        tensors.push(out);
        let y = tensors.len() - 1;
        let x = match input {
            Some(t) => &tensors[t],
            None => conv_out,
        };
        let (pw, op) = build_pointwise(api, mode, x, bias.map(|b| &tensors[b]), &tensors[y])?;
        pws.push(pw);
        ops.push(op);
        input = Some(y);
    }
    Ok((tensors, pws, ops))
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
    build_set_spec(api, handle, &OpSpec::f32(dir, g, bias, align, tf32))
}

/// [`build_set`] for any [`OpSpec`]: its configurations admitted by [`OpSpec::admits`].
pub(super) fn build_set_spec(api: &'static Api, handle: Ptr, spec: &OpSpec) -> Result<Set> {
    let (mut tensors, conv, op) = build_conv(api, spec)?;
    let mut ops = vec![op];
    let mut pointwise = Vec::new();
    if spec.fused() {
        let (more, pws, eps) = build_epilogue(api, spec, &tensors[2])?;
        tensors.extend(more);
        ops.extend(eps);
        pointwise = pws;
    }
    let cap = if spec.fused() { FUSED_CAP } else { CAP };
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
    let keep = select_by(&infos, |notes| spec.admits(notes));
    let refused = if spec.half() {
        "dropped (reduced precision)"
    } else {
        "dropped (not plain fp32)"
    };
    let listed = infos
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let fate = match keep.iter().position(|&k| k == i) {
                Some(rank) => format!("rank {rank}"),
                None if !spec.admits(&c.notes) => refused.to_string(),
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
