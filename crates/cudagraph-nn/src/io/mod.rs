//! Bring your own model: PyTorch `state_dict`s in safetensors files, in and out, and a small
//! JSON model description, so a [`Sequential`] can be built and served without code.
//!
//! Everything that touches only files and host memory ([`ModelDescription`], [`read_state_dict`],
//! [`serialize_state_dict`]) works and is tested without a GPU; [`build_sequential`],
//! [`state_dict`], [`load_model`] and [`save_model`] move the weights to and from a device.
//!
//! # The model description
//!
//! A JSON file next to the weights (`mlp.json` beside `mlp.safetensors`) lists one row's input
//! shape (without the batch dimension) and the layers in order, exactly as the PyTorch
//! `nn.Sequential` lists its modules, so layer `i`'s parameters are PyTorch's `i.weight` and
//! `i.bias`:
//!
//! ```json
//! {
//!   "input": [1, 28, 28],
//!   "layers": [
//!     {"conv2d": {"in": 1, "out": 8, "kernel": 3, "stride": 1, "padding": 1}},
//!     "relu",
//!     "max_pool2d",
//!     "flatten",
//!     {"linear": [1568, 10]}
//!   ]
//! }
//! ```
//!
//! | layer | PyTorch module | fields (defaults) |
//! |---|---|---|
//! | `{"linear": [in, out]}` or `{"linear": {"in", "out", "bias": true}}` | `nn.Linear(in, out, bias)` | weight `[out, in]`, bias `[out]` |
//! | `{"conv2d": {"in", "out", "kernel", "stride": 1, "padding": 0, "bias": true}}` | `nn.Conv2d(in, out, kernel, stride, padding, bias=bias)` (square kernel) | weight `[out, in, k, k]`, bias `[out]` |
//! | `"relu"` | `nn.ReLU()` | — |
//! | `"max_pool2d"` or `{"max_pool2d": {"kernel": 2, "stride": kernel}}` | `nn.MaxPool2d(kernel, stride)` | — |
//! | `"flatten"` | `nn.Flatten()` | — |
//! | `{"dropout": {"p": 0.5}}` or `"dropout"` (p = 0.5) | `nn.Dropout(p)` | — |
//!
//! Shapes are checked layer by layer when the description is read; an error names the layer
//! index and the field. Weights must be `float32` (`torch.float32`); a layer declared with
//! `"bias": false` has no bias tensor in the file (it runs with a zero bias).

pub mod datasets;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::Deserialize;
use serde_json::{json, Value};

use cudagraph::Stream;

use crate::autograd::tensor::Parameter;
use crate::error::Result;
use crate::nn::layers::{Conv2d, Layer, Linear, Module, Rng, Sequential};

pub use crate::error::IoError;

/// One layer of a [`ModelDescription`] (the PyTorch module it stands for).
#[derive(Clone, Debug, PartialEq)]
pub enum LayerSpec {
    /// `nn.Linear(in_features, out_features, bias)`.
    Linear {
        in_features: usize,
        out_features: usize,
        bias: bool,
    },
    /// `nn.Conv2d(in_channels, out_channels, kernel, stride, padding, bias=bias)`.
    Conv2d {
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        bias: bool,
    },
    /// `nn.ReLU()`.
    ReLU,
    /// `nn.MaxPool2d(kernel, stride)`.
    MaxPool2d { kernel: usize, stride: usize },
    /// `nn.Flatten()`.
    Flatten,
    /// `nn.Dropout(p)` (the identity in eval mode, which serving uses).
    Dropout { p: f32 },
}

impl LayerSpec {
    /// The name used in the JSON description.
    pub fn kind(&self) -> &'static str {
        match self {
            LayerSpec::Linear { .. } => "linear",
            LayerSpec::Conv2d { .. } => "conv2d",
            LayerSpec::ReLU => "relu",
            LayerSpec::MaxPool2d { .. } => "max_pool2d",
            LayerSpec::Flatten => "flatten",
            LayerSpec::Dropout { .. } => "dropout",
        }
    }
}

/// A named parameter the model needs, with its shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// PyTorch's name in the `nn.Sequential`'s state_dict: `"{layer}.weight"` or `"{layer}.bias"`.
    pub name: String,
    pub layer: usize,
    pub shape: Vec<usize>,
}

/// The layers of a `Sequential` and one row's input shape (see the module docs for the JSON).
///
/// Construct it with [`ModelDescription::new`] or [`ModelDescription::from_json`]: both check
/// every layer against the shape before it, so a description value is always consistent.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelDescription {
    input: Vec<usize>,
    layers: Vec<LayerSpec>,
    /// Row shape after each layer (`shapes[0]` is the input).
    shapes: Vec<Vec<usize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescription {
    input: Vec<usize>,
    layers: Vec<Value>,
}

fn yes() -> bool {
    true
}

fn one() -> usize {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LinearBody {
    #[serde(rename = "in")]
    in_features: usize,
    #[serde(rename = "out")]
    out_features: usize,
    #[serde(default = "yes")]
    bias: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Conv2dBody {
    #[serde(rename = "in")]
    in_channels: usize,
    #[serde(rename = "out")]
    out_channels: usize,
    kernel: usize,
    #[serde(default = "one")]
    stride: usize,
    #[serde(default)]
    padding: usize,
    #[serde(default = "yes")]
    bias: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolBody {
    kernel: usize,
    stride: Option<usize>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DropoutBody {
    p: f32,
}

const KINDS: &str = "\"linear\", \"conv2d\", \"relu\", \"max_pool2d\", \"flatten\", \"dropout\"";

/// Parses layer `i` from its JSON value.
fn parse_layer(i: usize, v: &Value) -> std::result::Result<LayerSpec, IoError> {
    let err = |kind: &str, problem: String| IoError::Layer {
        layer: i,
        kind: kind.to_string(),
        problem,
    };
    let (kind, body) = match v {
        Value::String(s) => (s.as_str(), None),
        Value::Object(m) if m.len() == 1 => {
            let (k, b) = m.iter().next().expect("one entry");
            (k.as_str(), Some(b))
        }
        other => {
            return Err(err(
                "?",
                format!("expected a layer name ({KINDS}) or an object with one of them as its only key, found {other}"),
            ))
        }
    };
    let body_of = |what: &str| -> std::result::Result<&Value, IoError> {
        body.ok_or_else(|| err(kind, format!("needs its fields: {what}")))
    };
    let parse = |b: &Value| -> std::result::Result<LayerSpec, serde_json::Error> {
        match kind {
            "linear" => {
                if let Value::Array(a) = b {
                    let dims: Vec<usize> = serde_json::from_value(Value::Array(a.clone()))?;
                    if dims.len() != 2 {
                        return Err(serde::de::Error::custom(format!(
                            "`[in, out]` needs two numbers, found {}",
                            dims.len()
                        )));
                    }
                    return Ok(LayerSpec::Linear {
                        in_features: dims[0],
                        out_features: dims[1],
                        bias: true,
                    });
                }
                let l: LinearBody = serde_json::from_value(b.clone())?;
                Ok(LayerSpec::Linear {
                    in_features: l.in_features,
                    out_features: l.out_features,
                    bias: l.bias,
                })
            }
            "conv2d" => {
                let c: Conv2dBody = serde_json::from_value(b.clone())?;
                Ok(LayerSpec::Conv2d {
                    in_channels: c.in_channels,
                    out_channels: c.out_channels,
                    kernel: c.kernel,
                    stride: c.stride,
                    padding: c.padding,
                    bias: c.bias,
                })
            }
            "max_pool2d" => {
                let p: PoolBody = serde_json::from_value(b.clone())?;
                Ok(LayerSpec::MaxPool2d {
                    kernel: p.kernel,
                    stride: p.stride.unwrap_or(p.kernel),
                })
            }
            "dropout" => {
                let d: DropoutBody = serde_json::from_value(b.clone())?;
                Ok(LayerSpec::Dropout { p: d.p })
            }
            _ => unreachable!("checked below"),
        }
    };
    match kind {
        "relu" | "flatten" => {
            if let Some(b) = body {
                if !(b.is_null() || b.as_object().is_some_and(|m| m.is_empty())) {
                    return Err(err(kind, format!("takes no fields, found {b}")));
                }
            }
            Ok(if kind == "relu" {
                LayerSpec::ReLU
            } else {
                LayerSpec::Flatten
            })
        }
        "max_pool2d" if body.is_none() => Ok(LayerSpec::MaxPool2d {
            kernel: 2,
            stride: 2,
        }),
        "dropout" if body.is_none() => Ok(LayerSpec::Dropout { p: 0.5 }),
        "linear" | "conv2d" | "max_pool2d" | "dropout" => {
            let b = body_of(match kind {
                "linear" => "[in, out] or {\"in\", \"out\", \"bias\"}",
                "conv2d" => "{\"in\", \"out\", \"kernel\", \"stride\", \"padding\", \"bias\"}",
                "dropout" => "{\"p\"}",
                _ => "{\"kernel\", \"stride\"}",
            })?;
            parse(b).map_err(|e| err(kind, e.to_string()))
        }
        other => Err(err(
            other,
            format!("unknown layer `{other}`; the layers are {KINDS}"),
        )),
    }
}

/// Elements of `shape`, or `None` when the product overflows.
fn product(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

/// Row shape after `layer` (index `i`), given the row shape before it.
fn next_shape(
    i: usize,
    layer: &LayerSpec,
    before: &[usize],
) -> std::result::Result<Vec<usize>, IoError> {
    let err = |problem: String| IoError::Layer {
        layer: i,
        kind: layer.kind().to_string(),
        problem,
    };
    let positive = |field: &str, v: usize| {
        if v == 0 {
            Err(err(format!("field `{field}` must be at least 1")))
        } else {
            Ok(())
        }
    };
    let chw = |what: &str| -> std::result::Result<(usize, usize, usize), IoError> {
        match before {
            [c, h, w] => Ok((*c, *h, *w)),
            _ => Err(err(format!(
                "{what} needs rows of shape [channels, height, width], but the layer before produces {before:?}"
            ))),
        }
    };
    let out = match *layer {
        LayerSpec::Linear {
            in_features,
            out_features,
            ..
        } => {
            positive("in", in_features)?;
            positive("out", out_features)?;
            match before {
                [n] if *n == in_features => vec![out_features],
                [n] => {
                    return Err(err(format!(
                        "field `in` is {in_features}, but the layer before produces rows of {n} values"
                    )))
                }
                _ => {
                    return Err(err(format!(
                        "needs flat rows, but the layer before produces shape {before:?}; add \"flatten\" before it"
                    )))
                }
            }
        }
        LayerSpec::Conv2d {
            in_channels,
            out_channels,
            kernel,
            stride,
            padding,
            ..
        } => {
            positive("in", in_channels)?;
            positive("out", out_channels)?;
            positive("kernel", kernel)?;
            positive("stride", stride)?;
            let (c, h, w) = chw("conv2d")?;
            if c != in_channels {
                return Err(err(format!(
                    "field `in` is {in_channels}, but the layer before produces {c} channels (shape {before:?})"
                )));
            }
            let pad2 = padding
                .checked_mul(2)
                .ok_or_else(|| err(format!("field `padding` {padding} is too large")))?;
            let (ph, pw) = (h.saturating_add(pad2), w.saturating_add(pad2));
            if ph < kernel || pw < kernel {
                return Err(err(format!(
                    "field `kernel` {kernel} is larger than the padded input {ph}x{pw}"
                )));
            }
            vec![
                out_channels,
                (ph - kernel) / stride + 1,
                (pw - kernel) / stride + 1,
            ]
        }
        LayerSpec::MaxPool2d { kernel, stride } => {
            positive("kernel", kernel)?;
            positive("stride", stride)?;
            let (c, h, w) = chw("max_pool2d")?;
            if h < kernel || w < kernel {
                return Err(err(format!(
                    "field `kernel` {kernel} is larger than the input {h}x{w}"
                )));
            }
            vec![c, (h - kernel) / stride + 1, (w - kernel) / stride + 1]
        }
        LayerSpec::ReLU => before.to_vec(),
        LayerSpec::Dropout { p } => {
            if !(0.0..1.0).contains(&p) {
                return Err(err(format!("field `p` {p} is outside [0, 1)")));
            }
            before.to_vec()
        }
        LayerSpec::Flatten => vec![product(before).ok_or_else(|| err("too many elements".into()))?],
    };
    product(&out).ok_or_else(|| err(format!("output shape {out:?} has too many elements")))?;
    Ok(out)
}

impl ModelDescription {
    /// A description of `layers` applied to rows of shape `input`; checks every layer against
    /// the shape before it.
    pub fn new(input: Vec<usize>, layers: Vec<LayerSpec>) -> std::result::Result<Self, IoError> {
        if input.is_empty() || input.contains(&0) {
            return Err(IoError::Description(format!(
                "`input` must be a non-empty list of positive sizes (one row's shape, without the batch dimension), found {input:?}"
            )));
        }
        if product(&input).is_none() {
            return Err(IoError::Description(format!(
                "`input` {input:?} has too many elements"
            )));
        }
        if layers.is_empty() {
            return Err(IoError::Description(
                "`layers` is empty; list the modules of the nn.Sequential in order".into(),
            ));
        }
        let mut shapes = vec![input.clone()];
        for (i, l) in layers.iter().enumerate() {
            let next = next_shape(i, l, shapes.last().expect("non-empty"))?;
            shapes.push(next);
        }
        Ok(Self {
            input,
            layers,
            shapes,
        })
    }

    /// Parses and checks a JSON description (see the module docs).
    pub fn from_json(text: &str) -> std::result::Result<Self, IoError> {
        let raw: RawDescription = serde_json::from_str(text).map_err(|e| {
            IoError::Description(format!(
                "{e} (expected {{\"input\": [...], \"layers\": [...]}})"
            ))
        })?;
        let layers = raw
            .layers
            .iter()
            .enumerate()
            .map(|(i, v)| parse_layer(i, v))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Self::new(raw.input, layers)
    }

    /// The description as JSON (the canonical form of the module docs' table).
    pub fn to_json(&self) -> String {
        let layers: Vec<Value> = self
            .layers
            .iter()
            .map(|l| match *l {
                LayerSpec::Linear {
                    in_features,
                    out_features,
                    bias: true,
                } => json!({ "linear": [in_features, out_features] }),
                LayerSpec::Linear {
                    in_features,
                    out_features,
                    bias: false,
                } => json!({ "linear": { "in": in_features, "out": out_features, "bias": false } }),
                LayerSpec::Conv2d {
                    in_channels,
                    out_channels,
                    kernel,
                    stride,
                    padding,
                    bias,
                } => json!({ "conv2d": {
                    "in": in_channels, "out": out_channels, "kernel": kernel,
                    "stride": stride, "padding": padding, "bias": bias } }),
                LayerSpec::MaxPool2d { kernel, stride } => {
                    json!({ "max_pool2d": { "kernel": kernel, "stride": stride } })
                }
                LayerSpec::ReLU => json!("relu"),
                LayerSpec::Flatten => json!("flatten"),
                LayerSpec::Dropout { p } => json!({ "dropout": { "p": p } }),
            })
            .collect();
        let v = json!({ "input": self.input, "layers": layers });
        serde_json::to_string_pretty(&v).expect("plain JSON values serialise")
    }

    /// Reads and checks a description file.
    pub fn read(path: &Path) -> std::result::Result<Self, IoError> {
        let text = std::fs::read_to_string(path).map_err(|source| IoError::File {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&text).map_err(|e| match e {
            IoError::Description(d) => IoError::Description(format!("{}: {d}", path.display())),
            other => other,
        })
    }

    /// One row's input shape (without the batch dimension).
    pub fn input(&self) -> &[usize] {
        &self.input
    }

    pub fn layers(&self) -> &[LayerSpec] {
        &self.layers
    }

    /// Values per input row.
    pub fn input_row(&self) -> usize {
        product(&self.input).expect("checked in new")
    }

    /// One row's output shape.
    pub fn output_shape(&self) -> &[usize] {
        self.shapes.last().expect("input shape at least")
    }

    /// Values per output row.
    pub fn output_row(&self) -> usize {
        product(self.output_shape()).expect("checked in new")
    }

    /// Row shape after each layer (`[0]` is the input).
    pub fn shapes(&self) -> &[Vec<usize>] {
        &self.shapes
    }

    /// The parameters the model needs, in layer order, with PyTorch's names.
    pub fn parameters(&self) -> Vec<ParamSpec> {
        let mut v = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let (w, out, bias) = match *l {
                LayerSpec::Linear {
                    in_features,
                    out_features,
                    bias,
                } => (vec![out_features, in_features], out_features, bias),
                LayerSpec::Conv2d {
                    in_channels,
                    out_channels,
                    kernel,
                    bias,
                    ..
                } => (
                    vec![out_channels, in_channels, kernel, kernel],
                    out_channels,
                    bias,
                ),
                _ => continue,
            };
            v.push(ParamSpec {
                name: format!("{i}.weight"),
                layer: i,
                shape: w,
            });
            if bias {
                v.push(ParamSpec {
                    name: format!("{i}.bias"),
                    layer: i,
                    shape: vec![out],
                });
            }
        }
        v
    }

    /// The description of a `Sequential` built by this crate, for rows of shape `input`.
    /// Every layer gets a bias (ours always have one).
    pub fn from_sequential(
        model: &Sequential,
        input: Vec<usize>,
    ) -> std::result::Result<Self, IoError> {
        let layers = model
            .layers
            .iter()
            .map(|l| match l {
                Layer::Linear(l) => LayerSpec::Linear {
                    in_features: l.in_features,
                    out_features: l.out_features,
                    bias: true,
                },
                Layer::Conv2d(c) => {
                    let s = c.weight.shape();
                    LayerSpec::Conv2d {
                        in_channels: s[1],
                        out_channels: s[0],
                        kernel: s[2],
                        stride: c.stride,
                        padding: c.padding,
                        bias: true,
                    }
                }
                Layer::ReLU => LayerSpec::ReLU,
                Layer::MaxPool2d { kernel, stride } => LayerSpec::MaxPool2d {
                    kernel: *kernel,
                    stride: *stride,
                },
                Layer::Flatten => LayerSpec::Flatten,
                Layer::Dropout { p } => LayerSpec::Dropout { p: *p },
            })
            .collect();
        Self::new(input, layers)
    }

    /// A model of this shape with PyTorch's default initialisation drawn from `rng`.
    pub fn init(&self, s: &Stream, rng: &mut Rng) -> Result<Sequential> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            layers.push(match *l {
                LayerSpec::Linear {
                    in_features,
                    out_features,
                    ..
                } => Layer::Linear(Linear::new(s, in_features, out_features, rng)?),
                LayerSpec::Conv2d {
                    in_channels,
                    out_channels,
                    kernel,
                    stride,
                    padding,
                    ..
                } => Layer::Conv2d(Conv2d::new(
                    s,
                    in_channels,
                    out_channels,
                    kernel,
                    stride,
                    padding,
                    rng,
                )?),
                LayerSpec::ReLU => Layer::ReLU,
                LayerSpec::MaxPool2d { kernel, stride } => Layer::MaxPool2d { kernel, stride },
                LayerSpec::Flatten => Layer::Flatten,
                LayerSpec::Dropout { p } => Layer::Dropout { p },
            });
        }
        Ok(Sequential::new(layers))
    }
}

/// A named f32 tensor in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

fn format_err(what: &str, e: impl std::fmt::Display) -> IoError {
    IoError::Format {
        what: what.to_string(),
        detail: e.to_string(),
    }
}

/// Every tensor of a safetensors file as f32 host tensors, sorted by name (for inputs and
/// outputs stored next to a model; a tensor that is not F32 is an error).
pub fn read_tensors(bytes: &[u8], what: &str) -> std::result::Result<Vec<HostTensor>, IoError> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| format_err(what, e))?;
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let t = st.tensor(&name).map_err(|e| format_err(what, e))?;
            decode(&name, &t)
        })
        .collect()
}

fn decode(name: &str, t: &TensorView<'_>) -> std::result::Result<HostTensor, IoError> {
    if t.dtype() != Dtype::F32 {
        return Err(IoError::DtypeMismatch {
            name: name.to_string(),
            found: format!("{:?}", t.dtype()),
        });
    }
    // Little-endian f32; the data may sit at any alignment inside the file.
    let data = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok(HostTensor {
        name: name.to_string(),
        shape: t.shape().to_vec(),
        data,
    })
}

/// Reads the parameters `desc` needs from a safetensors file's bytes (PyTorch's
/// `safetensors.torch.save_file(model.state_dict(), ...)`), in [`ModelDescription::parameters`]
/// order. Fails on a missing tensor, a tensor the model does not use, a shape or a dtype
/// mismatch; `what` names the file in errors.
pub fn read_state_dict(
    bytes: &[u8],
    desc: &ModelDescription,
    what: &str,
) -> std::result::Result<Vec<HostTensor>, IoError> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| format_err(what, e))?;
    let mut available: Vec<&str> = st.names();
    available.sort_unstable();
    let specs = desc.parameters();
    let mut out = Vec::with_capacity(specs.len());
    for p in &specs {
        let t = st.tensor(&p.name).map_err(|_| IoError::MissingTensor {
            name: p.name.clone(),
            layer: p.layer,
            available: if available.is_empty() {
                "no tensors".into()
            } else {
                let shown: Vec<&str> = available.iter().take(12).copied().collect();
                format!(
                    "{}{}",
                    shown.join(", "),
                    if available.len() > 12 { ", ..." } else { "" }
                )
            },
        })?;
        if t.dtype() != Dtype::F32 {
            return Err(IoError::DtypeMismatch {
                name: p.name.clone(),
                found: format!("{:?}", t.dtype()),
            });
        }
        if t.shape() != p.shape.as_slice() {
            return Err(IoError::ShapeMismatch {
                name: p.name.clone(),
                layer: p.layer,
                expected: p.shape.clone(),
                found: t.shape().to_vec(),
            });
        }
        out.push(decode(&p.name, &t)?);
    }
    let used: BTreeSet<&str> = specs.iter().map(|p| p.name.as_str()).collect();
    let extra: Vec<String> = available
        .iter()
        .filter(|n| !used.contains(*n))
        .map(|n| n.to_string())
        .collect();
    if !extra.is_empty() {
        return Err(IoError::ExtraTensors { names: extra });
    }
    Ok(out)
}

/// The bytes of a safetensors file holding `tensors` (F32, little-endian), with PyTorch's
/// `{"format": "pt"}` metadata so `safetensors.torch.load_file` reads it as a state_dict.
pub fn serialize_state_dict(tensors: &[HostTensor]) -> std::result::Result<Vec<u8>, IoError> {
    let mut seen = BTreeSet::new();
    let mut bytes = Vec::with_capacity(tensors.len());
    for t in tensors {
        if !seen.insert(t.name.as_str()) {
            return Err(format_err(
                "state_dict to save",
                format!("tensor name `{}` appears twice", t.name),
            ));
        }
        if product(&t.shape) != Some(t.data.len()) {
            return Err(IoError::ShapeMismatch {
                name: t.name.clone(),
                layer: 0,
                expected: t.shape.clone(),
                found: vec![t.data.len()],
            });
        }
        bytes.push(
            t.data
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
    }
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            TensorView::new(Dtype::F32, t.shape.clone(), b)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| format_err("state_dict to save", e))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::tensor::serialize(views, Some(meta)).map_err(|e| format_err("state_dict", e))
}

/// Builds the model `desc` describes with the given parameters (as [`read_state_dict`]
/// returns them). Layers declared without a bias get a zero bias.
pub fn build_sequential(
    s: &Stream,
    desc: &ModelDescription,
    params: &[HostTensor],
) -> Result<Sequential> {
    let by_name: HashMap<&str, &HostTensor> = params.iter().map(|t| (t.name.as_str(), t)).collect();
    let get = |name: String, layer: usize, shape: &[usize]| -> Result<Vec<f32>> {
        let t = by_name.get(name.as_str()).ok_or(IoError::MissingTensor {
            name: name.clone(),
            layer,
            available: format!("{} parameters", params.len()),
        })?;
        if t.shape != shape || product(shape) != Some(t.data.len()) {
            return Err(IoError::ShapeMismatch {
                name,
                layer,
                expected: shape.to_vec(),
                found: t.shape.clone(),
            }
            .into());
        }
        Ok(t.data.clone())
    };
    let mut layers = Vec::with_capacity(desc.layers.len());
    for (i, l) in desc.layers.iter().enumerate() {
        layers.push(match *l {
            LayerSpec::Linear {
                in_features,
                out_features,
                bias,
            } => {
                let w = get(format!("{i}.weight"), i, &[out_features, in_features])?;
                let b = if bias {
                    get(format!("{i}.bias"), i, &[out_features])?
                } else {
                    vec![0.0; out_features]
                };
                Layer::Linear(Linear::from_host(s, &w, &b, in_features, out_features)?)
            }
            LayerSpec::Conv2d {
                in_channels,
                out_channels,
                kernel,
                stride,
                padding,
                bias,
            } => {
                let wshape = [out_channels, in_channels, kernel, kernel];
                let w = get(format!("{i}.weight"), i, &wshape)?;
                let b = if bias {
                    get(format!("{i}.bias"), i, &[out_channels])?
                } else {
                    vec![0.0; out_channels]
                };
                Layer::Conv2d(Conv2d {
                    weight: Parameter::from_host(s, "weight", &w, &wshape)?,
                    bias: Parameter::from_host(s, "bias", &b, &[out_channels])?,
                    stride,
                    padding,
                })
            }
            LayerSpec::ReLU => Layer::ReLU,
            LayerSpec::MaxPool2d { kernel, stride } => Layer::MaxPool2d { kernel, stride },
            LayerSpec::Flatten => Layer::Flatten,
            LayerSpec::Dropout { p } => Layer::Dropout { p },
        });
    }
    // Loaded models serve: dropout is the identity until the caller switches to training.
    let mut model = Sequential::new(layers);
    model.eval();
    Ok(model)
}

/// The model's parameters on the host, named as PyTorch names an `nn.Sequential`'s state_dict
/// (`"{layer}.weight"`, `"{layer}.bias"`). Waits for `s`.
pub fn state_dict(s: &Stream, model: &Sequential) -> Result<Vec<HostTensor>> {
    let mut out = Vec::new();
    for (i, l) in model.layers.iter().enumerate() {
        for p in l_params(l) {
            out.push(HostTensor {
                name: format!("{i}.{}", p.name()),
                shape: p.shape().to_vec(),
                data: s.to_vec(p.data())?,
            });
        }
    }
    Ok(out)
}

fn l_params(l: &Layer) -> Vec<Parameter> {
    match l {
        Layer::Linear(l) => l.parameters(),
        Layer::Conv2d(c) => c.parameters(),
        _ => Vec::new(),
    }
}

/// Where a model's two files are: the description (`.json`) and the weights (`.safetensors`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelFiles {
    pub description: PathBuf,
    pub weights: PathBuf,
}

impl ModelFiles {
    /// The files for `path`: a directory holds `model.json` and `model.safetensors`; a path
    /// ending in `.json` or `.safetensors` (or with no extension) names both by its stem.
    pub fn locate(path: &Path) -> Self {
        if path.is_dir() {
            return Self {
                description: path.join("model.json"),
                weights: path.join("model.safetensors"),
            };
        }
        let stem = match path.extension().and_then(|e| e.to_str()) {
            Some("json") | Some("safetensors") => path.with_extension(""),
            _ => path.to_path_buf(),
        };
        let with = |ext: &str| {
            let mut s = stem.clone().into_os_string();
            s.push(ext);
            PathBuf::from(s)
        };
        Self {
            description: with(".json"),
            weights: with(".safetensors"),
        }
    }
}

fn read_file(path: &Path) -> std::result::Result<Vec<u8>, IoError> {
    std::fs::read(path).map_err(|source| IoError::File {
        path: path.to_path_buf(),
        source,
    })
}

fn write_file(path: &Path, bytes: &[u8]) -> std::result::Result<(), IoError> {
    std::fs::write(path, bytes).map_err(|source| IoError::File {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads a model's description and weights (see [`ModelFiles::locate`]) and builds it on `s`.
pub fn load_model(s: &Stream, path: &Path) -> Result<(ModelDescription, Sequential)> {
    let files = ModelFiles::locate(path);
    let desc = ModelDescription::read(&files.description)?;
    let bytes = read_file(&files.weights)?;
    let params = read_state_dict(&bytes, &desc, &files.weights.display().to_string())?;
    let model = build_sequential(s, &desc, &params)?;
    Ok((desc, model))
}

/// Writes `model` (rows of shape `input`) as a description and a safetensors file PyTorch
/// loads into the same `nn.Sequential` (`model.load_state_dict(load_file(...))`).
pub fn save_model(
    s: &Stream,
    model: &Sequential,
    input: Vec<usize>,
    path: &Path,
) -> Result<ModelFiles> {
    let desc = ModelDescription::from_sequential(model, input)?;
    let files = ModelFiles::locate(path);
    let bytes = serialize_state_dict(&state_dict(s, model)?)?;
    write_file(&files.weights, &bytes)?;
    write_file(&files.description, desc.to_json().as_bytes())?;
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CNN: &str = r#"{
        "input": [1, 28, 28],
        "layers": [
            {"conv2d": {"in": 1, "out": 4, "kernel": 3, "padding": 1}},
            "relu",
            "max_pool2d",
            {"conv2d": {"in": 4, "out": 8, "kernel": 3}},
            "relu",
            {"max_pool2d": {"kernel": 2}},
            "flatten",
            {"linear": [288, 32]},
            "relu",
            {"linear": {"in": 32, "out": 10, "bias": false}}
        ]
    }"#;

    fn layer_err(text: &str) -> (usize, String, String) {
        match ModelDescription::from_json(text) {
            Err(IoError::Layer {
                layer,
                kind,
                problem,
            }) => (layer, kind, problem),
            other => panic!("expected a layer error, got {other:?}"),
        }
    }

    #[test]
    fn description_infers_shapes_and_pytorch_names() {
        let d = ModelDescription::from_json(CNN).unwrap();
        assert_eq!(d.shapes()[1], vec![4, 28, 28]);
        assert_eq!(d.shapes()[3], vec![4, 14, 14]);
        assert_eq!(d.shapes()[4], vec![8, 12, 12]);
        assert_eq!(d.shapes()[6], vec![8, 6, 6]);
        assert_eq!(d.output_shape(), &[10]);
        assert_eq!((d.input_row(), d.output_row()), (784, 10));
        let names: Vec<String> = d.parameters().into_iter().map(|p| p.name).collect();
        assert_eq!(
            names,
            ["0.weight", "0.bias", "3.weight", "3.bias", "7.weight", "7.bias", "9.weight"]
        );
        assert_eq!(d.parameters()[2].shape, vec![8, 4, 3, 3]);
        // The canonical JSON reads back to the same description.
        assert_eq!(ModelDescription::from_json(&d.to_json()).unwrap(), d);
    }

    #[test]
    fn description_errors_name_the_layer_and_field() {
        let (i, kind, p) = layer_err(r#"{"input": [4], "layers": [{"linear": [5, 3]}]}"#);
        assert_eq!((i, kind.as_str()), (0, "linear"));
        assert!(p.contains("`in` is 5") && p.contains("4 values"), "{p}");

        let (i, _, p) = layer_err(
            r#"{"input": [1, 8, 8], "layers": ["relu", {"conv2d": {"in": 1, "out": 2}}]}"#,
        );
        assert_eq!(i, 1);
        assert!(p.contains("missing field `kernel`"), "{p}");

        let (i, _, p) = layer_err(
            r#"{"input": [1, 8, 8], "layers": [{"conv2d": {"in": 1, "out": 2, "kernal": 3}}]}"#,
        );
        assert_eq!(i, 0);
        assert!(p.contains("unknown field `kernal`"), "{p}");

        let (i, kind, p) = layer_err(r#"{"input": [1, 8, 8], "layers": [{"linear": [64, 2]}]}"#);
        assert_eq!((i, kind.as_str()), (0, "linear"));
        assert!(p.contains("flatten"), "{p}");

        let (i, _, p) = layer_err(r#"{"input": [3], "layers": ["relu", "softmax"]}"#);
        assert_eq!(i, 1);
        assert!(p.contains("unknown layer `softmax`"), "{p}");

        let (_, _, p) =
            layer_err(r#"{"input": [1, 2, 2], "layers": ["max_pool2d", "max_pool2d"]}"#);
        assert!(p.contains("larger than the input 1x1"), "{p}");

        let (_, _, p) = layer_err(
            r#"{"input": [2, 4, 4], "layers": [{"conv2d": {"in": 2, "out": 2, "kernel": 3, "stride": 0}}]}"#,
        );
        assert!(p.contains("`stride` must be at least 1"), "{p}");

        let (_, _, p) = layer_err(r#"{"input": [3], "layers": [{"linear": [3]}]}"#);
        assert!(p.contains("two numbers"), "{p}");

        let (_, _, p) = layer_err(r#"{"input": [3], "layers": [["linear"]]}"#);
        assert!(p.contains("expected a layer name"), "{p}");

        // Whole-file problems.
        for bad in [
            "not json",
            r#"{"layers": []}"#,
            r#"{"input": [3], "layers": []}"#,
            r#"{"input": [0], "layers": ["relu"]}"#,
            r#"{"input": [3], "layers": ["relu"], "extra": 1}"#,
        ] {
            assert!(
                matches!(
                    ModelDescription::from_json(bad),
                    Err(IoError::Description(_))
                ),
                "{bad}"
            );
        }
        // Sizes whose product overflows are errors, not wrapped numbers.
        let huge = format!(
            r#"{{"input": [{}, {}], "layers": ["flatten"]}}"#,
            usize::MAX / 2,
            4
        );
        assert!(ModelDescription::from_json(&huge).is_err());
    }

    fn tensor(name: &str, shape: &[usize], seed: f32) -> HostTensor {
        let n: usize = shape.iter().product();
        HostTensor {
            name: name.into(),
            shape: shape.to_vec(),
            data: (0..n).map(|i| seed + i as f32 * 0.25 - 3.0).collect(),
        }
    }

    fn mlp() -> ModelDescription {
        ModelDescription::from_json(
            r#"{"input": [3], "layers": [{"linear": [3, 4]}, "relu", {"linear": [4, 2]}]}"#,
        )
        .unwrap()
    }

    fn mlp_state() -> Vec<HostTensor> {
        vec![
            tensor("0.weight", &[4, 3], 1.0),
            tensor("0.bias", &[4], 2.0),
            tensor("2.weight", &[2, 4], 3.0),
            tensor("2.bias", &[2], 4.0),
        ]
    }

    #[test]
    fn state_dict_round_trips_through_the_file_format() {
        let state = mlp_state();
        let bytes = serialize_state_dict(&state).unwrap();
        // The format: 8-byte little-endian header length, JSON header, raw data.
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        assert_eq!(header["__metadata__"]["format"], "pt");
        assert_eq!(header["0.weight"]["dtype"], "F32");
        assert_eq!(header["0.weight"]["shape"], json!([4, 3]));
        let back = read_state_dict(&bytes, &mlp(), "test").unwrap();
        assert_eq!(back, state, "bit-exact, in parameter order");
        let mut all = read_tensors(&bytes, "test").unwrap();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(all.len(), 4);
    }

    #[test]
    fn state_dict_errors_are_typed() {
        let d = mlp();
        // Missing.
        let mut s = mlp_state();
        s.remove(1);
        match read_state_dict(&serialize_state_dict(&s).unwrap(), &d, "f") {
            Err(IoError::MissingTensor {
                name,
                layer,
                available,
            }) => {
                assert_eq!((name.as_str(), layer), ("0.bias", 0));
                assert!(available.contains("0.weight"), "{available}");
            }
            other => panic!("{other:?}"),
        }
        // Extra.
        let mut s = mlp_state();
        s.push(tensor("4.weight", &[1], 0.0));
        s.push(tensor("model.head", &[1], 0.0));
        match read_state_dict(&serialize_state_dict(&s).unwrap(), &d, "f") {
            Err(IoError::ExtraTensors { names }) => assert_eq!(names, ["4.weight", "model.head"]),
            other => panic!("{other:?}"),
        }
        // Shape.
        let mut s = mlp_state();
        s[2] = tensor("2.weight", &[4, 2], 0.0);
        match read_state_dict(&serialize_state_dict(&s).unwrap(), &d, "f") {
            Err(IoError::ShapeMismatch {
                name,
                layer,
                expected,
                found,
            }) => {
                assert_eq!((name.as_str(), layer), ("2.weight", 2));
                assert_eq!((expected, found), (vec![2, 4], vec![4, 2]));
            }
            other => panic!("{other:?}"),
        }
        // Dtype: an F64 tensor written by the crate directly.
        let f64s: Vec<u8> = (0..4).flat_map(|i| (i as f64).to_le_bytes()).collect();
        let mut views: Vec<(String, TensorView<'_>)> = Vec::new();
        let other: Vec<Vec<u8>> = mlp_state()
            .iter()
            .map(|t| t.data.iter().flat_map(|v| v.to_le_bytes()).collect())
            .collect();
        for (t, b) in mlp_state().iter().zip(&other) {
            if t.name != "0.bias" {
                views.push((
                    t.name.clone(),
                    TensorView::new(Dtype::F32, t.shape.clone(), b).unwrap(),
                ));
            }
        }
        views.push((
            "0.bias".into(),
            TensorView::new(Dtype::F64, vec![4], &f64s).unwrap(),
        ));
        let bytes = safetensors::tensor::serialize(views, None).unwrap();
        match read_state_dict(&bytes, &d, "f") {
            Err(e @ IoError::DtypeMismatch { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("0.bias") && msg.contains("F64"), "{msg}");
            }
            other => panic!("{other:?}"),
        }
        // Not a safetensors file at all, or truncated.
        assert!(matches!(
            read_state_dict(b"hello", &d, "f"),
            Err(IoError::Format { .. })
        ));
        let good = serialize_state_dict(&mlp_state()).unwrap();
        assert!(matches!(
            read_state_dict(&good[..good.len() - 3], &d, "f"),
            Err(IoError::Format { .. })
        ));
        // Duplicate names and wrong lengths cannot be saved.
        let mut s = mlp_state();
        s.push(tensor("0.bias", &[4], 0.0));
        assert!(serialize_state_dict(&s).is_err());
        let mut s = mlp_state();
        s[0].data.pop();
        assert!(serialize_state_dict(&s).is_err());
    }

    #[test]
    fn bias_free_layers_need_no_bias_tensor() {
        let d = ModelDescription::from_json(
            r#"{"input": [3], "layers": [{"linear": {"in": 3, "out": 2, "bias": false}}]}"#,
        )
        .unwrap();
        let s = vec![tensor("0.weight", &[2, 3], 0.0)];
        assert_eq!(
            read_state_dict(&serialize_state_dict(&s).unwrap(), &d, "f").unwrap(),
            s
        );
    }

    #[test]
    fn model_files_are_found_by_stem_or_directory() {
        let f = ModelFiles::locate(Path::new("/models/mlp.json"));
        assert_eq!(f.weights, PathBuf::from("/models/mlp.safetensors"));
        let f = ModelFiles::locate(Path::new("/models/mlp.safetensors"));
        assert_eq!(f.description, PathBuf::from("/models/mlp.json"));
        let f = ModelFiles::locate(Path::new("/models/mlp.v2"));
        assert_eq!(f.description, PathBuf::from("/models/mlp.v2.json"));
        let dir = std::env::temp_dir();
        assert_eq!(ModelFiles::locate(&dir).description, dir.join("model.json"));
    }
}
