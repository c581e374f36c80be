//! [`ModelDescription`]: the JSON description of a `Sequential` (see [`super`]'s module docs for
//! the format), checked layer by layer against the shape before it, with the PyTorch names and
//! shapes of the parameters it needs.

use std::path::Path;

use serde::Deserialize;
use serde_json::{json, Value};

use cudagraph::Stream;

use crate::error::{IoError, Result};
use crate::nn::layers::{Conv2d, Layer, Linear, Sequential};
use crate::random::HostRng;

/// One layer of a [`ModelDescription`] (the PyTorch module it stands for).
#[derive(Clone, Debug, PartialEq)]
pub enum LayerSpec {
    /// `nn.Linear(in_features, out_features, bias)`.
    Linear {
        /// Size of each input row.
        in_features: usize,
        /// Size of each output row.
        out_features: usize,
        /// Whether the layer has a bias (`{layer}.bias` in the weights).
        bias: bool,
    },
    /// `nn.Conv2d(in_channels, out_channels, kernel, stride, padding, bias=bias)`.
    Conv2d {
        /// Input channels.
        in_channels: usize,
        /// Output channels.
        out_channels: usize,
        /// Side of the square kernel.
        kernel: usize,
        /// Stride, the same along both axes.
        stride: usize,
        /// Zero padding on each side.
        padding: usize,
        /// Whether the layer has a bias (`{layer}.bias` in the weights).
        bias: bool,
    },
    /// `nn.ReLU()`.
    ReLU,
    /// `nn.MaxPool2d(kernel, stride)`.
    MaxPool2d {
        /// Window side.
        kernel: usize,
        /// Step between windows.
        stride: usize,
    },
    /// `nn.Flatten()`.
    Flatten,
    /// `nn.Dropout(p)` (the identity in eval mode, which serving uses).
    Dropout {
        /// Probability of zeroing an element in training.
        p: f32,
    },
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
    /// The index of the layer that owns it.
    pub layer: usize,
    /// Its shape (PyTorch's layout: `[out, in]` or `[out, in, k, k]` for weights).
    pub shape: Vec<usize>,
}

/// The layers of a `Sequential` and one row's input shape (see the module docs for the JSON).
///
/// Construct it with [`ModelDescription::new`] or [`ModelDescription::from_json`]: both check
/// every layer against the shape before it, so a description value is always consistent.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelDescription {
    input: Vec<usize>,
    pub(super) layers: Vec<LayerSpec>,
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
pub(super) fn product(shape: &[usize]) -> Option<usize> {
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

    /// The layers, in order.
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
    pub fn init(&self, s: &Stream, rng: &mut HostRng) -> Result<Sequential> {
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
