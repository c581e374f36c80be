//! Element types: [`Dtype`] names one (f32, bf16, f16), [`Float`] is the host type of each
//! (`f32` and the `half` crate's `bf16` and `f16`). Arithmetic on them always accumulates in f32.

use std::any::Any;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use cudagraph::DeviceBuffer;
use half::{bf16, f16};

use crate::error::IoError;

/// An element type: of a tensor, of a product's operands, of a safetensors tensor that
/// [`read_state_dict`](crate::io::read_state_dict) accepts and
/// [`serialize_state_dict_as`](crate::io::serialize_state_dict_as) writes.
///
/// Shown and parsed as PyTorch's short names: `"f32"`, `"bf16"`, `"f16"` (parsing also takes
/// `"float32"`, `"bfloat16"`, `"float16"`, and is case-insensitive), so a command-line flag can
/// take it as it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// `torch.float32`: safetensors `F32`. The default, and the parameters' own type.
    #[default]
    F32,
    /// `torch.bfloat16`: safetensors `BF16` (8 exponent bits, 8 significant bits).
    Bf16,
    /// `torch.float16`: safetensors `F16` (5 exponent bits, 11 significant bits, largest
    /// finite value 65504).
    F16,
}

impl Dtype {
    /// Every supported dtype, widest first.
    pub const ALL: [Dtype; 3] = [Dtype::F32, Dtype::Bf16, Dtype::F16];

    /// The short name: `"f32"`, `"bf16"` or `"f16"`.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }

    /// Bytes per element (on the device and in a file).
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    /// `v` rounded to the nearest value of this type (ties to even, as the device casts
    /// round) and widened back to f32: `v` itself for f32.
    pub fn round(self, v: f32) -> f32 {
        match self {
            Dtype::F32 => v,
            Dtype::Bf16 => bf16::from_f32(v).to_f32(),
            Dtype::F16 => f16::from_f32(v).to_f32(),
        }
    }

    /// The largest finite value: `f32::MAX`, about 3.39e38 for bf16, 65504 for f16.
    pub fn max_finite(self) -> f32 {
        match self {
            Dtype::F32 => f32::MAX,
            Dtype::Bf16 => bf16::MAX.to_f32(),
            Dtype::F16 => f16::MAX.to_f32(),
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = IoError;

    fn from_str(s: &str) -> Result<Self, IoError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float32" | "fp32" => Ok(Dtype::F32),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            "f16" | "float16" | "fp16" | "half" => Ok(Dtype::F16),
            _ => Err(IoError::DtypeName {
                given: s.to_string(),
            }),
        }
    }
}

/// The host type of a [`Dtype`]: `f32`, [`bf16`] or [`struct@f16`] (sealed: exactly those three).
pub trait Float: cudagraph::Elem + sealed::Sealed {
    /// The dtype of this type.
    const DTYPE: Dtype;
    /// The value as an f32 (exact).
    fn to_f32(self) -> f32;
    /// The nearest value to `v` (ties to even; past the largest finite value, ±inf).
    fn from_f32(v: f32) -> Self;
    /// A buffer of this type as a [`TypedBuffer`].
    fn typed(buf: Arc<DeviceBuffer<Self>>) -> TypedBuffer;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

impl Float for f32 {
    const DTYPE: Dtype = Dtype::F32;
    fn typed(buf: Arc<DeviceBuffer<Self>>) -> TypedBuffer {
        TypedBuffer::F32(buf)
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Float for bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    fn typed(buf: Arc<DeviceBuffer<Self>>) -> TypedBuffer {
        TypedBuffer::Bf16(buf)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Float for f16 {
    const DTYPE: Dtype = Dtype::F16;
    fn typed(buf: Arc<DeviceBuffer<Self>>) -> TypedBuffer {
        TypedBuffer::F16(buf)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// A shared device buffer of any [`Dtype`]: what a tensor holds, and the 16-bit copies of
/// parameters that optimizers and autocast keep.
#[derive(Clone, Debug)]
pub enum TypedBuffer {
    /// f32 elements.
    F32(Arc<DeviceBuffer<f32>>),
    /// bf16 elements.
    Bf16(Arc<DeviceBuffer<bf16>>),
    /// f16 elements.
    F16(Arc<DeviceBuffer<f16>>),
}

impl TypedBuffer {
    /// The element type.
    pub fn dtype(&self) -> Dtype {
        match self {
            TypedBuffer::F32(_) => Dtype::F32,
            TypedBuffer::Bf16(_) => Dtype::Bf16,
            TypedBuffer::F16(_) => Dtype::F16,
        }
    }

    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        match self {
            TypedBuffer::F32(b) => b.len(),
            TypedBuffer::Bf16(b) => b.len(),
            TypedBuffer::F16(b) => b.len(),
        }
    }

    /// The device address of the first element.
    pub fn addr(&self) -> u64 {
        match self {
            TypedBuffer::F32(b) => b.addr(),
            TypedBuffer::Bf16(b) => b.addr(),
            TypedBuffer::F16(b) => b.addr(),
        }
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer as one of `T`, or `None` when its dtype is another.
    pub fn get<T: Float>(&self) -> Option<&Arc<DeviceBuffer<T>>> {
        let any: &dyn Any = match self {
            TypedBuffer::F32(b) => b,
            TypedBuffer::Bf16(b) => b,
            TypedBuffer::F16(b) => b,
        };
        any.downcast_ref::<Arc<DeviceBuffer<T>>>()
    }

    /// Wraps a buffer of `T`.
    pub fn new<T: Float>(buf: Arc<DeviceBuffer<T>>) -> Self {
        T::typed(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1 + 2⁻⁹ lies halfway between two bf16 values (8-bit significand): ties to even gives 1;
    /// 1 + 3·2⁻⁹ rounds up to 1 + 2⁻⁷. f16 keeps both (11-bit significand); f32 keeps anything.
    #[test]
    fn round_rounds_to_nearest_even_in_the_type() {
        let (tie, up) = (1.0 + 2f32.powi(-9), 1.0 + 3.0 * 2f32.powi(-9));
        assert_eq!(Dtype::Bf16.round(tie), 1.0);
        assert_eq!(Dtype::Bf16.round(up), 1.0 + 2f32.powi(-7));
        assert_eq!((Dtype::F16.round(tie), Dtype::F16.round(up)), (tie, up));
        let x = 1.0 + f32::EPSILON;
        assert_eq!(Dtype::F32.round(x), x);
        assert_eq!(Dtype::F16.round(1e6), f32::INFINITY);
    }

    #[test]
    fn names_parse_back_and_sizes_match_the_host_types() {
        for d in Dtype::ALL {
            assert_eq!(d.name().parse::<Dtype>().unwrap(), d);
        }
        assert_eq!(Dtype::Bf16.size(), std::mem::size_of::<bf16>());
        assert_eq!(Dtype::F16.size(), std::mem::size_of::<f16>());
        assert_eq!(<f16 as Float>::DTYPE, Dtype::F16);
        assert_eq!(<bf16 as Float>::from_f32(1.5).to_f32(), 1.5);
        assert!("f64".parse::<Dtype>().is_err());
    }
}
