//! PyTorch `state_dict`s in safetensors files: read into f32 host tensors in the order a
//! [`ModelDescription`] needs them (every name, shape and dtype checked; F32, BF16 and F16
//! widened exactly), and written back with PyTorch's metadata in F32, BF16 or F16.

use std::collections::{BTreeSet, HashMap};

use safetensors::tensor::{SafeTensors, TensorView};

use super::description::{product, ModelDescription};
use super::dtype::{narrow, widen, Dtype};
use crate::error::IoError;

/// A named f32 tensor in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// The name in the safetensors file, e.g. `0.weight`.
    pub name: String,
    /// The dimensions, outermost first.
    pub shape: Vec<usize>,
    /// The values, row-major; as many as the product of `shape`.
    pub data: Vec<f32>,
}

fn format_err(what: &str, e: impl std::fmt::Display) -> IoError {
    IoError::Format {
        what: what.to_string(),
        detail: e.to_string(),
    }
}

/// Every tensor of a safetensors file as f32 host tensors, sorted by name (for inputs and
/// outputs stored next to a model). F32, BF16 and F16 tensors are widened to f32 exactly; any
/// other dtype is an [`IoError::DtypeMismatch`].
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
    let dtype = Dtype::from_file(t.dtype()).ok_or_else(|| IoError::DtypeMismatch {
        name: name.to_string(),
        found: format!("{:?}", t.dtype()),
    })?;
    Ok(HostTensor {
        name: name.to_string(),
        shape: t.shape().to_vec(),
        data: widen(dtype, t.data()),
    })
}

/// Reads the parameters `desc` needs from a safetensors file's bytes (PyTorch's
/// `safetensors.torch.save_file(model.state_dict(), ...)`), in [`ModelDescription::parameters`]
/// order, as f32: F32, BF16 and F16 tensors (a file may mix them) are widened exactly. Fails on
/// a missing tensor, a tensor the model does not use, a shape mismatch or another dtype; `what`
/// names the file in errors.
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
        if Dtype::from_file(t.dtype()).is_none() {
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

/// The bytes of a safetensors file holding `tensors` in F32 (little-endian), with PyTorch's
/// `{"format": "pt"}` metadata so `safetensors.torch.load_file` reads it as a state_dict.
/// [`serialize_state_dict_as`] writes BF16 or F16.
pub fn serialize_state_dict(tensors: &[HostTensor]) -> std::result::Result<Vec<u8>, IoError> {
    serialize_state_dict_as(tensors, Dtype::F32)
}

/// [`serialize_state_dict`] with every tensor stored as `dtype`. Narrowing to BF16 or F16
/// rounds to nearest even, as PyTorch's `tensor.to(torch.bfloat16)` does; a finite value that
/// the target cannot hold (beyond 65504 in F16) is an [`IoError::Overflow`] naming the tensor,
/// the first such element and its value. NaN stays NaN, ±inf stays ±inf.
pub fn serialize_state_dict_as(
    tensors: &[HostTensor],
    dtype: Dtype,
) -> std::result::Result<Vec<u8>, IoError> {
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
        bytes.push(narrow(&t.name, dtype, &t.data)?);
    }
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            TensorView::new(dtype.to_file(), t.shape.clone(), b)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| format_err("state_dict to save", e))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::tensor::serialize(views, Some(meta)).map_err(|e| format_err("state_dict", e))
}
