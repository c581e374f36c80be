//! Training checkpoints: a model's parameters, its optimizer's state and a GradScaler's state
//! in one safetensors file, so that a run stopped after step `k` and resumed from the file
//! continues bit for bit as if it had never stopped.
//!
//! # The file
//!
//! Tensors are F32, BF16, F16 or U32, little-endian, each named for what it restores:
//!
//! | name | dtype, shape | what |
//! |---|---|---|
//! | `model.<i>.<name>` | the parameter's dtype (F32, or BF16/F16 for pure 16-bit training), its shape | parameter `i` of the model's list (`<name>`: its own, e.g. `weight`) |
//! | `optim.hyperparameters` | F32 `[8]` | the device hyperparameters ([`Hyperparameters`] slots: lr, base lr, betas, eps, weight decay, momentum) |
//! | `optim.step` | U32 `[1]` | optimizer steps taken (what a schedule reads) |
//! | `optim.exp_avg.<i>`, `optim.exp_avg_sq.<i>` | F32 `[n_i]` | Adam's moments of parameter `i` of the optimizer's list |
//! | `optim.steps` | U32 `[params]` | Adam's per-parameter step counts |
//! | `optim.momentum_buffer.<i>` | F32 `[n_i]` | SGD's momentum buffers (with momentum) |
//! | `optim.schedule` | U32 `[274]` | the attached schedule's device program, when there is one |
//! | `scaler.scale`, `scaler.growth_tracker` | F32 `[1]`, U32 `[1]` | the GradScaler's device state |
//!
//! The metadata holds `format` (`cudagraph-checkpoint`), `version` ([`VERSION`]), `optimizer`
//! (`sgd`, `adam` or `adamw`), the optimizer's `copies` (`none`, `bf16`, `f16`: for the
//! reader; the 16-bit copies are not stored but recomputed from the loaded masters) and the
//! scaler's settings (`scaler.init_scale`, `scaler.growth_factor`, `scaler.backoff_factor`,
//! `scaler.growth_interval`, `scaler.enabled`), every number written so it reads back
//! exactly.
//!
//! Loading checks everything before it writes anything: the format and version, the
//! optimizer's kind, the schedule, and every tensor the loading side needs against the file —
//! a missing one, one nothing uses, or one of another dtype or shape is a typed
//! [`CheckpointError`], and the model, optimizer and scaler are left as they were.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use cudagraph::memory::{bf16, f16};
use cudagraph::{DeviceBuffer, Stream};
use safetensors::tensor::{Dtype as FileDtype, SafeTensors, TensorView};

use super::{read_file, write_file};
use crate::autograd::tensor::Parameter;
use crate::dtype::TypedBuffer;
use crate::error::{CheckpointError, IoError, NnError, Result};
use crate::nn::optim::{Hyperparameters, Optimizer, StateBuffer};
use crate::nn::scaler::{GradScaler, GradScalerConfig, ScalerState};

/// The format version this build writes and reads.
pub const VERSION: u32 = 1;
/// The `format` metadata of a checkpoint.
pub const FORMAT: &str = "cudagraph-checkpoint";

/// What [`save_checkpoint`] saves.
pub struct Checkpoint<'a> {
    /// The model's parameters, in a fixed order (`model.parameters()`).
    pub model: &'a [Parameter],
    /// The optimizer ([`Optimizer::kind`] must be `Some`).
    pub optimizer: &'a dyn Optimizer,
    /// The loss scaler, if the run uses one.
    pub scaler: Option<&'a GradScaler>,
}

/// What [`load_checkpoint`] loads into: a model, optimizer and scaler made as the saved ones
/// were (same parameter shapes and order, same optimizer kind and options, a scaler when one
/// was saved, the same schedule attached).
pub struct CheckpointMut<'a> {
    /// The model's parameters, in the order they were saved.
    pub model: &'a [Parameter],
    /// The optimizer.
    pub optimizer: &'a mut dyn Optimizer,
    /// The loss scaler, exactly when one was saved.
    pub scaler: Option<&'a mut GradScaler>,
}

/// A checkpoint tensor's values in host memory.
#[derive(Clone, Debug, PartialEq)]
pub enum Values {
    /// F32 values.
    F32(Vec<f32>),
    /// U32 values.
    U32(Vec<u32>),
    /// BF16 values (a pure-bf16 parameter).
    Bf16(Vec<bf16>),
    /// F16 values (a pure-f16 parameter).
    F16(Vec<f16>),
}

impl Values {
    fn dtype(&self) -> FileDtype {
        match self {
            Values::F32(_) => FileDtype::F32,
            Values::U32(_) => FileDtype::U32,
            Values::Bf16(_) => FileDtype::BF16,
            Values::F16(_) => FileDtype::F16,
        }
    }

    fn len(&self) -> usize {
        match self {
            Values::F32(v) => v.len(),
            Values::U32(v) => v.len(),
            Values::Bf16(v) => v.len(),
            Values::F16(v) => v.len(),
        }
    }

    fn bytes(&self) -> Vec<u8> {
        match self {
            Values::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Values::U32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Values::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Values::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

/// One named tensor of a checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// Its name in the file.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its values (as many as the shape's product).
    pub values: Values,
}

/// What the loading side needs of one tensor: its name, dtype and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    /// The tensor's name.
    pub name: String,
    /// `F32`, `U32`, or `BF16`/`F16` (16-bit parameters).
    pub dtype: FileDtype,
    /// The shape.
    pub shape: Vec<usize>,
}

fn format_err(what: &str, e: impl std::fmt::Display) -> IoError {
    IoError::Format {
        what: what.to_string(),
        detail: e.to_string(),
    }
}

/// The bytes of a checkpoint file with `entries` and `meta` (plus the format and version).
pub fn encode(entries: &[Entry], meta: &BTreeMap<String, String>) -> Result<Vec<u8>, IoError> {
    let mut names = std::collections::BTreeSet::new();
    for e in entries {
        if !names.insert(e.name.as_str()) {
            return Err(format_err(
                "checkpoint to save",
                format!("tensor `{}` appears twice", e.name),
            ));
        }
        if super::description::product(&e.shape) != Some(e.values.len()) {
            return Err(format_err(
                "checkpoint to save",
                format!(
                    "tensor `{}`: {} values for shape {:?}",
                    e.name,
                    e.values.len(),
                    e.shape
                ),
            ));
        }
    }
    let bytes: Vec<Vec<u8>> = entries.iter().map(|e| e.values.bytes()).collect();
    let views = entries
        .iter()
        .zip(&bytes)
        .map(|(e, b)| {
            TensorView::new(e.values.dtype(), e.shape.clone(), b)
                .map(|v| (e.name.clone(), v))
                .map_err(|err| format_err("checkpoint to save", err))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut info: HashMap<String, String> =
        meta.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    info.insert("format".into(), FORMAT.into());
    info.insert("version".into(), VERSION.to_string());
    safetensors::tensor::serialize(views, Some(info)).map_err(|e| format_err("checkpoint", e))
}

/// A checkpoint file's tensors (by name) and metadata; the format and version are checked
/// ([`CheckpointError::Version`]); `what` names the file in errors.
pub fn decode(
    bytes: &[u8],
    what: &str,
) -> Result<(BTreeMap<String, Entry>, BTreeMap<String, String>)> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| format_err(what, e))?;
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| format_err(what, e))?;
    let meta: BTreeMap<String, String> = header
        .metadata()
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let get = |k: &str| meta.get(k).cloned().unwrap_or_default();
    if get("format") != FORMAT || get("version") != VERSION.to_string() {
        return Err(CheckpointError::Version {
            format: get("format"),
            version: get("version"),
            supported: VERSION,
        }
        .into());
    }
    let mut out = BTreeMap::new();
    for (name, t) in st.tensors() {
        let data = t.data();
        let values = match t.dtype() {
            FileDtype::F32 => Values::F32(
                data.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            FileDtype::U32 => Values::U32(
                data.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            FileDtype::BF16 => Values::Bf16(
                data.chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            FileDtype::F16 => Values::F16(
                data.chunks_exact(2)
                    .map(|c| f16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            other => {
                return Err(CheckpointError::Mismatch {
                    name,
                    expected: "F32, BF16, F16 or U32".into(),
                    found: format!("{other:?}"),
                }
                .into())
            }
        };
        let shape = t.shape().to_vec();
        out.insert(
            name.clone(),
            Entry {
                name,
                shape,
                values,
            },
        );
    }
    Ok((out, meta))
}

fn describe(dtype: FileDtype, shape: &[usize]) -> String {
    format!("{dtype:?} {shape:?}")
}

/// Takes the tensors `specs` asks for out of `file`, in `specs` order, after checking that
/// every one is there with its dtype and shape and that nothing else is.
pub fn take_matching(mut file: BTreeMap<String, Entry>, specs: &[Spec]) -> Result<Vec<Entry>> {
    for s in specs {
        match file.get(&s.name) {
            None => {
                let shown: Vec<&str> = file.keys().take(8).map(String::as_str).collect();
                return Err(CheckpointError::Missing {
                    name: s.name.clone(),
                    available: format!(
                        "{} tensors: {}{}",
                        file.len(),
                        shown.join(", "),
                        if file.len() > 8 { ", ..." } else { "" }
                    ),
                }
                .into());
            }
            Some(e) if e.values.dtype() != s.dtype || e.shape != s.shape => {
                return Err(CheckpointError::Mismatch {
                    name: s.name.clone(),
                    expected: describe(s.dtype, &s.shape),
                    found: describe(e.values.dtype(), &e.shape),
                }
                .into());
            }
            Some(_) => {}
        }
    }
    let wanted: std::collections::BTreeSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    let extra: Vec<String> = file
        .keys()
        .filter(|k| !wanted.contains(k.as_str()))
        .cloned()
        .collect();
    if !extra.is_empty() {
        return Err(CheckpointError::Extra { names: extra }.into());
    }
    Ok(specs.iter().filter_map(|s| file.remove(&s.name)).collect())
}

fn f32_spec(name: String, shape: Vec<usize>) -> Spec {
    Spec {
        name,
        dtype: FileDtype::F32,
        shape,
    }
}

fn u32_spec(name: String, len: usize) -> Spec {
    Spec {
        name,
        dtype: FileDtype::U32,
        shape: vec![len],
    }
}

/// A device buffer a checkpoint tensor is read from or written to.
enum Target<'a> {
    F32(&'a DeviceBuffer<f32>),
    U32(&'a DeviceBuffer<u32>),
    Bf16(&'a DeviceBuffer<bf16>),
    F16(&'a DeviceBuffer<f16>),
    /// Written by hand after the check (hyperparameters, counters, scaler, schedule).
    Host,
}

/// The tensors of a checkpoint of `model`, `opt` and `scaler`: their specs and where each
/// one's values live on the device.
fn layout<'a>(
    model: &'a [Parameter],
    opt: &'a dyn Optimizer,
    has_scaler: bool,
) -> Result<Vec<(Spec, Target<'a>)>> {
    let mut out = Vec::new();
    for (i, p) in model.iter().enumerate() {
        let name = format!("model.{i}.{}", p.name());
        let (dtype, target) = match p.buffer() {
            TypedBuffer::F32(b) => (FileDtype::F32, Target::F32(b)),
            TypedBuffer::Bf16(b) => (FileDtype::BF16, Target::Bf16(b)),
            TypedBuffer::F16(b) => (FileDtype::F16, Target::F16(b)),
        };
        let shape = p.shape().to_vec();
        out.push((Spec { name, dtype, shape }, target));
    }
    let h = opt.hyperparameters().ok_or_else(not_checkpointable)?;
    out.push((
        f32_spec("optim.hyperparameters".into(), vec![h.buffer().len()]),
        Target::Host,
    ));
    out.push((u32_spec("optim.step".into(), 1), Target::Host));
    for (name, b) in opt.state_buffers() {
        let name = format!("optim.{name}");
        out.push(match b {
            StateBuffer::F32(b) => (f32_spec(name, vec![b.len()]), Target::F32(b)),
            StateBuffer::U32(b) => (u32_spec(name, b.len()), Target::U32(b)),
        });
    }
    if let Some(s) = h.schedule() {
        out.push((
            u32_spec("optim.schedule".into(), s.program().len() / 4),
            Target::Host,
        ));
    }
    if has_scaler {
        out.push((f32_spec("scaler.scale".into(), vec![1]), Target::Host));
        out.push((u32_spec("scaler.growth_tracker".into(), 1), Target::Host));
    }
    Ok(out)
}

fn not_checkpointable() -> NnError {
    NnError::Unsupported(
        "this optimizer keeps no device-side state a checkpoint can save (Sgd and Adam do)".into(),
    )
}

fn words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn copies_name(opt: &dyn Optimizer) -> &'static str {
    match opt.copies().and_then(|c| c.first().map(|(_, b)| b.dtype())) {
        Some(d) => d.name(),
        None => "none",
    }
}

fn scaler_meta(meta: &mut BTreeMap<String, String>, c: &GradScalerConfig) {
    // `{:?}` of a float is the shortest text that reads back to the same value.
    meta.insert("scaler.init_scale".into(), format!("{:?}", c.init_scale));
    meta.insert(
        "scaler.growth_factor".into(),
        format!("{:?}", c.growth_factor),
    );
    meta.insert(
        "scaler.backoff_factor".into(),
        format!("{:?}", c.backoff_factor),
    );
    meta.insert(
        "scaler.growth_interval".into(),
        c.growth_interval.to_string(),
    );
    meta.insert("scaler.enabled".into(), c.enabled.to_string());
}

/// The scaler settings in `meta` ([`CheckpointError::Kind`] for an unreadable one).
pub fn scaler_config(meta: &BTreeMap<String, String>) -> Result<GradScalerConfig> {
    fn field<T: std::str::FromStr>(
        meta: &BTreeMap<String, String>,
        key: &'static str,
    ) -> Result<T> {
        let v = meta.get(key).map(String::as_str).unwrap_or("");
        v.parse().map_err(|_| {
            CheckpointError::Kind {
                what: key,
                expected: "a number (or true/false) in the metadata".into(),
                found: v.to_string(),
            }
            .into()
        })
    }
    Ok(GradScalerConfig {
        init_scale: field(meta, "scaler.init_scale")?,
        growth_factor: field(meta, "scaler.growth_factor")?,
        backoff_factor: field(meta, "scaler.backoff_factor")?,
        growth_interval: field(meta, "scaler.growth_interval")?,
        enabled: field(meta, "scaler.enabled")?,
    })
}

/// The checkpoint of `ck` as the bytes of a safetensors file (reads the device: synchronises
/// `s`).
pub fn serialize_checkpoint(s: &Stream, ck: &Checkpoint<'_>) -> Result<Vec<u8>> {
    let kind = ck.optimizer.kind().ok_or_else(not_checkpointable)?;
    let h = ck
        .optimizer
        .hyperparameters()
        .ok_or_else(not_checkpointable)?;
    let mut entries = Vec::new();
    for (spec, target) in layout(ck.model, ck.optimizer, ck.scaler.is_some())? {
        let values = match (target, spec.name.as_str()) {
            (Target::F32(b), _) => Values::F32(s.to_vec(b)?),
            (Target::U32(b), _) => Values::U32(s.to_vec(b)?),
            (Target::Bf16(b), _) => Values::Bf16(s.to_vec(b)?),
            (Target::F16(b), _) => Values::F16(s.to_vec(b)?),
            (Target::Host, "optim.hyperparameters") => Values::F32(h.read(s)?.to_vec()),
            (Target::Host, "optim.step") => Values::U32(vec![h.step_count(s)?]),
            (Target::Host, "optim.schedule") => Values::U32(words(
                &h.schedule().map(|s| s.program()).unwrap_or_default(),
            )),
            (Target::Host, "scaler.scale") => Values::F32(vec![scaler_state(s, ck.scaler)?.scale]),
            (Target::Host, _) => Values::U32(vec![scaler_state(s, ck.scaler)?.growth_tracker]),
        };
        entries.push(Entry {
            name: spec.name,
            shape: spec.shape,
            values,
        });
    }
    let mut meta = BTreeMap::new();
    meta.insert("optimizer".to_string(), kind.to_string());
    meta.insert("copies".to_string(), copies_name(ck.optimizer).to_string());
    if let Some(sc) = ck.scaler {
        scaler_meta(&mut meta, &sc.config());
    }
    Ok(encode(&entries, &meta)?)
}

fn scaler_state(s: &Stream, scaler: Option<&GradScaler>) -> Result<ScalerState> {
    scaler
        .ok_or_else(|| NnError::Shape("checkpoint: scaler state without a scaler".into()))?
        .state_dict(s)
}

/// Writes the checkpoint of `ck` to `path` (one safetensors file; see the module
/// documentation). Reads the device: synchronises `s`.
pub fn save_checkpoint(s: &Stream, path: &Path, ck: &Checkpoint<'_>) -> Result<()> {
    let bytes = serialize_checkpoint(s, ck)?;
    Ok(write_file(path, &bytes)?)
}

/// Reads the checkpoint at `path` into `ck` (see [`load_checkpoint_bytes`]).
pub fn load_checkpoint(s: &Stream, path: &Path, ck: CheckpointMut<'_>) -> Result<()> {
    let bytes = read_file(path)?;
    load_checkpoint_bytes(s, &bytes, &path.display().to_string(), ck)
}

/// Loads a checkpoint's bytes into `ck`: checks the whole file against the model, optimizer
/// and scaler first (typed [`CheckpointError`]s; nothing is written then), then writes the
/// parameters, the optimizer's state, hyperparameters and step count, and the scaler's state
/// with stream-ordered copies on `s`, and recomputes the optimizer's 16-bit copies from the
/// loaded masters. `what` names the file in errors.
pub fn load_checkpoint_bytes(
    s: &Stream,
    bytes: &[u8],
    what: &str,
    ck: CheckpointMut<'_>,
) -> Result<()> {
    let (file, meta) = decode(bytes, what)?;
    let CheckpointMut {
        model,
        optimizer,
        scaler,
    } = ck;
    let kind = optimizer.kind().ok_or_else(not_checkpointable)?;
    let saved_kind = meta.get("optimizer").cloned().unwrap_or_default();
    if saved_kind != kind {
        return Err(CheckpointError::Kind {
            what: "optimizer",
            expected: kind.to_string(),
            found: saved_kind,
        }
        .into());
    }
    let h = optimizer.hyperparameters().ok_or_else(not_checkpointable)?;
    let schedule = h.schedule().map(|s| words(&s.program()));
    match (&schedule, file.contains_key("optim.schedule")) {
        (None, true) => {
            return Err(CheckpointError::Kind {
                what: "schedule",
                expected: "no schedule".into(),
                found: "a device schedule (attach it with set_schedule before loading)".into(),
            }
            .into())
        }
        (Some(_), false) => {
            return Err(CheckpointError::Kind {
                what: "schedule",
                expected: "the attached device schedule".into(),
                found: "no schedule".into(),
            }
            .into())
        }
        _ => {}
    }
    let scaler_cfg = match (&scaler, meta.contains_key("scaler.enabled")) {
        (Some(_), true) => Some(scaler_config(&meta)?),
        (Some(_), false) => {
            return Err(CheckpointError::Kind {
                what: "scaler",
                expected: "a GradScaler's state".into(),
                found: "no scaler".into(),
            }
            .into())
        }
        (None, true) => {
            return Err(CheckpointError::Kind {
                what: "scaler",
                expected: "no scaler".into(),
                found: "a GradScaler's state".into(),
            }
            .into())
        }
        (None, false) => None,
    };
    let plan = layout(model, &*optimizer, scaler.is_some())?;
    let specs: Vec<Spec> = plan.iter().map(|(s, _)| s.clone()).collect();
    let entries = take_matching(file, &specs)?;
    let by_name: HashMap<&str, &Values> = entries
        .iter()
        .map(|e| (e.name.as_str(), &e.values))
        .collect();
    let f32s = |name: &str| match by_name.get(name) {
        Some(Values::F32(v)) => v.clone(),
        _ => Vec::new(),
    };
    let u32s = |name: &str| match by_name.get(name) {
        Some(Values::U32(v)) => v.clone(),
        _ => Vec::new(),
    };
    // Everything is checked before anything is written.
    let hp_values = f32s("optim.hyperparameters");
    if let Some(bad) = hp_values.iter().find(|v| !v.is_finite()) {
        return Err(CheckpointError::Mismatch {
            name: "optim.hyperparameters".into(),
            expected: "finite values".into(),
            found: bad.to_string(),
        }
        .into());
    }
    if let Some(want) = &schedule {
        if u32s("optim.schedule") != *want {
            return Err(CheckpointError::Kind {
                what: "schedule",
                expected: "the attached device schedule".into(),
                found: "another schedule".into(),
            }
            .into());
        }
    }
    let scaler_state = match scaler_cfg {
        Some(config) => {
            let st = ScalerState {
                scale: f32s("scaler.scale")[0],
                growth_tracker: u32s("scaler.growth_tracker")[0],
                config,
            };
            st.config.validate()?;
            GradScalerConfig {
                init_scale: st.scale,
                ..st.config
            }
            .validate()?;
            Some(st)
        }
        None => None,
    };
    let mut hp = [0.0f32; 8];
    if hp_values.len() != hp.len() {
        return Err(CheckpointError::Mismatch {
            name: "optim.hyperparameters".into(),
            expected: format!("{} values", hp.len()),
            found: format!("{} values", hp_values.len()),
        }
        .into());
    }
    hp.copy_from_slice(&hp_values);
    let step = u32s("optim.step")[0];
    if let (Some(sc), Some(st)) = (&scaler, &scaler_state) {
        if sc.is_enabled() != st.config.enabled {
            return Err(CheckpointError::Kind {
                what: "scaler",
                expected: if sc.is_enabled() {
                    "enabled"
                } else {
                    "disabled"
                }
                .into(),
                found: if st.config.enabled {
                    "enabled"
                } else {
                    "disabled"
                }
                .into(),
            }
            .into());
        }
    }
    // Now write.
    for (spec, target) in &plan {
        match (target, by_name.get(spec.name.as_str())) {
            (Target::F32(b), Some(Values::F32(v))) => s.copy_from_host(v, b)?,
            (Target::U32(b), Some(Values::U32(v))) => s.copy_from_host(v, b)?,
            (Target::Bf16(b), Some(Values::Bf16(v))) => s.copy_from_host(v, b)?,
            (Target::F16(b), Some(Values::F16(v))) => s.copy_from_host(v, b)?,
            _ => {}
        }
    }
    drop(plan);
    restore_hyper(s, optimizer.hyperparameters_mut(), hp, step)?;
    if let (Some(sc), Some(st)) = (scaler, scaler_state) {
        sc.load_state_dict(s, &st)?;
    }
    optimizer.refresh_copies(s)
}

fn restore_hyper(
    s: &Stream,
    h: Option<&mut Hyperparameters>,
    hp: [f32; 8],
    step: u32,
) -> Result<()> {
    h.ok_or_else(not_checkpointable)?.restore(s, hp, step)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, shape: &[usize], values: Values) -> Entry {
        Entry {
            name: name.into(),
            shape: shape.to_vec(),
            values,
        }
    }

    fn sample() -> (Vec<Entry>, BTreeMap<String, String>) {
        let entries = vec![
            entry(
                "model.0.weight",
                &[2, 3],
                Values::F32(vec![1.0, -2.5, 3.0, 0.0, -0.0, 7.25]),
            ),
            entry("optim.steps", &[2], Values::U32(vec![5, u32::MAX])),
            entry("scaler.scale", &[1], Values::F32(vec![65536.0])),
        ];
        let mut meta = BTreeMap::new();
        meta.insert("optimizer".into(), "adam".into());
        scaler_meta(
            &mut meta,
            &GradScalerConfig {
                init_scale: 1.0e-3,
                growth_factor: 2.000000000000001,
                backoff_factor: 0.1,
                growth_interval: 7,
                enabled: true,
            },
        );
        (entries, meta)
    }

    #[test]
    fn tensors_and_settings_round_trip_exactly() {
        let (entries, meta) = sample();
        let bytes = encode(&entries, &meta).unwrap();
        let (back, m) = decode(&bytes, "test").unwrap();
        assert_eq!(m["format"], FORMAT);
        assert_eq!(m["version"], VERSION.to_string());
        assert_eq!(m["optimizer"], "adam");
        for e in &entries {
            assert_eq!(&back[&e.name], e);
        }
        // -0.0 keeps its sign bit.
        match &back["model.0.weight"].values {
            Values::F32(v) => assert_eq!(v[4].to_bits(), (-0.0f32).to_bits()),
            other => panic!("{other:?}"),
        }
        let cfg = scaler_config(&m).unwrap();
        assert_eq!(cfg.init_scale, 1.0e-3);
        assert_eq!(cfg.growth_factor, 2.000000000000001);
        assert_eq!(cfg.backoff_factor, 0.1);
        assert_eq!(cfg.growth_interval, 7);
        assert!(cfg.enabled);
    }

    #[test]
    fn other_files_and_versions_are_refused() {
        let (entries, meta) = sample();
        let mut bytes = encode(&entries, &meta).unwrap();
        // A plain state_dict (PyTorch's metadata) is not a checkpoint.
        let plain = super::super::serialize_state_dict(&[super::super::HostTensor {
            name: "0.weight".into(),
            shape: vec![1],
            data: vec![1.0],
        }])
        .unwrap();
        match decode(&plain, "plain") {
            Err(NnError::Io(IoError::Checkpoint(CheckpointError::Version { format, .. }))) => {
                assert_eq!(format, "pt")
            }
            other => panic!("{other:?}"),
        }
        // Another version: rewrite the digit in the header.
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
        let changed = header.replace("\"version\":\"1\"", "\"version\":\"9\"");
        assert_ne!(header, changed);
        bytes[8..8 + n].copy_from_slice(changed.as_bytes());
        match decode(&bytes, "v9") {
            Err(NnError::Io(IoError::Checkpoint(CheckpointError::Version {
                version,
                supported,
                ..
            }))) => assert_eq!((version.as_str(), supported), ("9", VERSION)),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            decode(b"not a file", "junk"),
            Err(NnError::Io(IoError::Format { .. }))
        ));
    }

    fn specs() -> Vec<Spec> {
        vec![
            f32_spec("model.0.weight".into(), vec![2, 3]),
            u32_spec("optim.steps".into(), 2),
            f32_spec("scaler.scale".into(), vec![1]),
        ]
    }

    fn ck_err(r: Result<Vec<Entry>>) -> CheckpointError {
        match r {
            Err(NnError::Io(IoError::Checkpoint(e))) => e,
            other => panic!("expected a checkpoint error, got {other:?}"),
        }
    }

    #[test]
    fn missing_extra_and_mismatched_tensors_are_named() {
        let (entries, _) = sample();
        let file = |es: &[Entry]| -> BTreeMap<String, Entry> {
            es.iter().map(|e| (e.name.clone(), e.clone())).collect()
        };
        // All there: in the order asked.
        let got = take_matching(file(&entries), &specs()).unwrap();
        assert_eq!(
            got.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(),
            ["model.0.weight", "optim.steps", "scaler.scale"]
        );
        // Missing.
        match ck_err(take_matching(file(&entries[..2]), &specs())) {
            CheckpointError::Missing { name, available } => {
                assert_eq!(name, "scaler.scale");
                assert!(available.starts_with("2 tensors"), "{available}");
            }
            other => panic!("{other:?}"),
        }
        // Extra.
        let mut more = entries.clone();
        more.push(entry("optim.exp_avg.9", &[1], Values::F32(vec![0.0])));
        match ck_err(take_matching(file(&more), &specs())) {
            CheckpointError::Extra { names } => assert_eq!(names, ["optim.exp_avg.9"]),
            other => panic!("{other:?}"),
        }
        // Another shape, another dtype.
        let mut reshaped = entries.clone();
        reshaped[0].shape = vec![3, 2];
        match ck_err(take_matching(file(&reshaped), &specs())) {
            CheckpointError::Mismatch {
                name,
                expected,
                found,
            } => {
                assert_eq!(name, "model.0.weight");
                assert_eq!(
                    (expected.as_str(), found.as_str()),
                    ("F32 [2, 3]", "F32 [3, 2]")
                );
            }
            other => panic!("{other:?}"),
        }
        let mut retyped = entries.clone();
        retyped[1].values = Values::F32(vec![5.0, 6.0]);
        match ck_err(take_matching(file(&retyped), &specs())) {
            CheckpointError::Mismatch { name, expected, .. } => {
                assert_eq!(
                    (name.as_str(), expected.as_str()),
                    ("optim.steps", "U32 [2]")
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_checkpoint_to_save_must_be_consistent() {
        let dup = vec![
            entry("a", &[1], Values::F32(vec![1.0])),
            entry("a", &[1], Values::U32(vec![1])),
        ];
        assert!(matches!(
            encode(&dup, &BTreeMap::new()),
            Err(IoError::Format { .. })
        ));
        let short = vec![entry("a", &[2, 2], Values::F32(vec![1.0]))];
        assert!(encode(&short, &BTreeMap::new()).is_err());
        // Another dtype in a file is a mismatch naming it.
        let f64_view = TensorView::new(FileDtype::F64, vec![1], &[0u8; 8]).unwrap();
        let mut info = HashMap::new();
        info.insert("format".to_string(), FORMAT.to_string());
        info.insert("version".to_string(), VERSION.to_string());
        let bytes = safetensors::tensor::serialize([("x", f64_view)], Some(info)).unwrap();
        match decode(&bytes, "f64") {
            Err(NnError::Io(IoError::Checkpoint(CheckpointError::Mismatch {
                name,
                found,
                ..
            }))) => {
                assert_eq!((name.as_str(), found.as_str()), ("x", "F64"))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unreadable_scaler_settings_are_named() {
        let (_, mut meta) = sample();
        meta.insert("scaler.growth_interval".into(), "often".into());
        match scaler_config(&meta) {
            Err(NnError::Io(IoError::Checkpoint(CheckpointError::Kind {
                what, found, ..
            }))) => {
                assert_eq!((what, found.as_str()), ("scaler.growth_interval", "often"))
            }
            other => panic!("{other:?}"),
        }
    }
}
