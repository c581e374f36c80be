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
//! index and the field. A layer declared with `"bias": false` has no bias tensor in the file
//! (it runs with a zero bias).
//!
//! # Dtypes
//!
//! Weights may be `F32`, `BF16` or `F16` (`torch.float32`, `torch.bfloat16`, `torch.float16`;
//! one file may mix them) and load as the model's f32 parameters, exactly. [`save_model`] writes
//! F32; [`save_model_with`] and [`SaveOptions`] write [`Dtype::Bf16`] or [`Dtype::F16`],
//! rounding to nearest even as PyTorch does, and refuse a finite value the target cannot hold
//! ([`IoError::Overflow`]). Any other dtype (`F64`, `I64`, `U8`, …) is an
//! [`IoError::DtypeMismatch`] naming the tensor.
pub mod chat;
pub mod checkpoint;
pub mod datasets;
mod description;
mod dtype;
pub mod hf;
mod weights;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use cudagraph::Stream;

use crate::autograd::tensor::Parameter;
use crate::error::Result;
use crate::nn::layers::{Conv2d, Layer, Linear, NnModule, Sequential};
use description::product;

pub use crate::error::{HfError, IoError};
pub use description::{LayerSpec, ModelDescription, ParamSpec};
pub use dtype::Dtype;
pub use weights::{
    read_state_dict, read_tensors, serialize_state_dict, serialize_state_dict_as, HostTensor,
};

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
                data: p.to_vec(s)?,
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
    /// The JSON description of the layers.
    pub description: PathBuf,
    /// The safetensors file of the parameters.
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

/// How [`save_model_with`] writes the weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SaveOptions {
    /// The dtype every tensor is stored in: [`Dtype::F32`] (the default, exact), or
    /// [`Dtype::Bf16`] / [`Dtype::F16`] (half the bytes, rounded to nearest even).
    pub dtype: Dtype,
}

/// Writes `model` (rows of shape `input`) as a description and a safetensors file PyTorch
/// loads into the same `nn.Sequential` (`model.load_state_dict(load_file(...))`), in F32.
pub fn save_model(
    s: &Stream,
    model: &Sequential,
    input: Vec<usize>,
    path: &Path,
) -> Result<ModelFiles> {
    save_model_with(s, model, input, path, SaveOptions::default())
}

/// [`save_model`] with options: `SaveOptions { dtype: Dtype::Bf16 }` stores the weights as
/// BF16 (PyTorch loads them with `load_state_dict`, which converts to the module's dtype). A
/// weight that overflows the chosen dtype is an [`IoError::Overflow`], and nothing is written.
pub fn save_model_with(
    s: &Stream,
    model: &Sequential,
    input: Vec<usize>,
    path: &Path,
    options: SaveOptions,
) -> Result<ModelFiles> {
    let desc = ModelDescription::from_sequential(model, input)?;
    let files = ModelFiles::locate(path);
    let bytes = serialize_state_dict_as(&state_dict(s, model)?, options.dtype)?;
    write_file(&files.weights, &bytes)?;
    write_file(&files.description, desc.to_json().as_bytes())?;
    Ok(files)
}

#[cfg(test)]
mod tests {
    use safetensors::tensor::{Dtype as FileDtype, TensorView};
    use serde_json::{json, Value};

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
                    TensorView::new(FileDtype::F32, t.shape.clone(), b).unwrap(),
                ));
            }
        }
        views.push((
            "0.bias".into(),
            TensorView::new(FileDtype::F64, vec![4], &f64s).unwrap(),
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

    /// A safetensors file built byte by byte, as `safetensors.torch.save_file` lays it out
    /// (8-byte little-endian header length, the JSON header padded with spaces to a multiple
    /// of 8, then the tensors' little-endian bytes), independent of the crate's serializer.
    fn hand_written(tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
        let mut header = String::from(r#"{"__metadata__":{"format":"pt"}"#);
        let mut data = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            let start = data.len();
            data.extend_from_slice(bytes);
            header += &format!(
                r#","{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{start},{}]}}"#,
                data.len()
            );
        }
        header.push('}');
        while header.len() % 8 != 0 {
            header.push(' ');
        }
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend(data);
        out
    }

    fn le16(bits: &[u16]) -> Vec<u8> {
        bits.iter().flat_map(|b| b.to_le_bytes()).collect()
    }

    #[test]
    fn bf16_and_f16_files_load_as_exact_f32() {
        // Hand-checked bit patterns. bf16: 0x3F80 = 1.0, 0xC000 = -2.0, 0x4049 = 3.140625,
        // 0x0001 = 2^-133 (subnormal). f16: 0x3C00 = 1.0, 0xC000 = -2.0, 0x7BFF = 65504,
        // 0x0001 = 2^-24 (subnormal), 0x3555 = 0.333251953125.
        let bf16_w: Vec<u16> = [0x3F80, 0xC000, 0x4049, 0x0001, 0x8000, 0x3F00]
            .into_iter()
            .cycle()
            .take(12)
            .collect();
        let f32_w: Vec<f32> = (0..8).map(|i| i as f32 * 0.1).collect();
        let bytes = hand_written(&[
            (
                "0.bias",
                "F16",
                vec![4],
                le16(&[0x3C00, 0xC000, 0x7BFF, 0x0001]),
            ),
            ("0.weight", "BF16", vec![4, 3], le16(&bf16_w)),
            ("2.bias", "F16", vec![2], le16(&[0x3555, 0xFC00])),
            (
                "2.weight",
                "F32",
                vec![2, 4],
                f32_w.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
        ]);
        let got = read_state_dict(&bytes, &mlp(), "hand-written").unwrap();
        let names: Vec<&str> = got.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]);
        let tiny = f32::from_bits(0x0001_0000); // 2^-133
        assert_eq!(
            got[0].data[..6],
            [1.0, -2.0, 3.140625, tiny, -0.0, 0.5],
            "bf16 widened exactly"
        );
        assert_eq!(got[0].shape, [4, 3]);
        assert_eq!(got[1].data, [1.0, -2.0, 65504.0, 2f32.powi(-24)]);
        assert_eq!(got[2].data, f32_w, "f32 bit-exact");
        assert_eq!(got[3].data, [0.333_251_95, f32::NEG_INFINITY]);
        // `read_tensors` widens the same way.
        let all = read_tensors(&bytes, "hand-written").unwrap();
        assert_eq!(all.len(), 4);
        assert_eq!(all[0].data, got[1].data, "0.bias first by name");
    }

    #[test]
    fn state_dict_saves_as_bf16_and_f16() {
        // mlp_state's values are multiples of 0.25 below 16: exact in both half types.
        let state = mlp_state();
        let f32_len = serialize_state_dict(&state).unwrap().len();
        for (d, name) in [
            (Dtype::Bf16, "BF16"),
            (Dtype::F16, "F16"),
            (Dtype::F32, "F32"),
        ] {
            let bytes = serialize_state_dict_as(&state, d).unwrap();
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
            assert_eq!(header["__metadata__"]["format"], "pt");
            assert_eq!(header["0.weight"]["dtype"], name);
            let at = |i: usize| header["0.weight"]["data_offsets"][i].as_u64().unwrap() as usize;
            assert_eq!(at(1) - at(0), 12 * d.size(), "{d}: 12 values");
            let data_len = bytes.len() - 8 - n;
            assert_eq!(data_len, 26 * d.size(), "{d}: 26 values");
            assert_eq!(read_state_dict(&bytes, &mlp(), "t").unwrap(), state, "{d}");
            if d == Dtype::F32 {
                assert_eq!(bytes.len(), f32_len);
            }
        }
        // Values between representable ones round to the nearest: within the unit roundoff,
        // 2^-8 relative for bf16 (8 significant bits) and 2^-11 for f16 (11), and the stored
        // bits are the `half` crate's.
        let mut s = mlp_state();
        s[0].data = (0..12).map(|i| 1.0 / (i as f32 + 3.0)).collect();
        for (d, rel) in [(Dtype::Bf16, 2f32.powi(-8)), (Dtype::F16, 2f32.powi(-11))] {
            let back =
                read_state_dict(&serialize_state_dict_as(&s, d).unwrap(), &mlp(), "t").unwrap();
            for (x, y) in s[0].data.iter().zip(&back[0].data) {
                assert_eq!(*y, d.round(*x), "{d} {x}");
                assert!((y - x).abs() <= rel * x.abs(), "{d} {x} -> {y}");
            }
        }
        // A weight past f16's range is refused, naming the tensor and the element; bf16 holds it.
        let mut s = mlp_state();
        s[3].data[1] = 70000.0;
        match serialize_state_dict_as(&s, Dtype::F16) {
            Err(e @ IoError::Overflow { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("`2.bias` element 1 is 70000"), "{msg}");
            }
            other => panic!("{other:?}"),
        }
        assert!(serialize_state_dict_as(&s, Dtype::Bf16).is_ok());
    }

    #[test]
    fn unsupported_dtypes_are_refused_by_name() {
        for (dtype, size) in [
            ("I64", 8),
            ("F64", 8),
            ("U8", 1),
            ("F8_E4M3", 1),
            ("I32", 4),
        ] {
            let state = mlp_state();
            let mut tensors: Vec<(&str, &str, Vec<usize>, Vec<u8>)> = state
                .iter()
                .map(|t| {
                    let b = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
                    (t.name.as_str(), "F32", t.shape.clone(), b)
                })
                .collect();
            tensors[3] = ("2.bias", dtype, vec![2], vec![0u8; 2 * size]);
            let bytes = hand_written(&tensors);
            for result in [
                read_state_dict(&bytes, &mlp(), "f").map(|_| ()),
                read_tensors(&bytes, "f").map(|_| ()),
            ] {
                match result {
                    Err(e @ IoError::DtypeMismatch { .. }) => {
                        let msg = e.to_string();
                        for part in ["`2.bias`", dtype, "F32", "BF16", "F16"] {
                            assert!(msg.contains(part), "{part}: {msg}");
                        }
                    }
                    other => panic!("{dtype}: {other:?}"),
                }
            }
        }
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
