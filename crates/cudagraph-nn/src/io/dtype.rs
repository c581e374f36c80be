//! The element types a safetensors weights file may hold (F32, BF16, F16) and the conversions
//! between them and the model's f32 parameters, through the `half` crate.
//!
//! Widening (BF16 or F16 to f32) is exact. Narrowing (f32 to BF16 or F16) rounds to the nearest
//! value, ties to even, as PyTorch's `tensor.to(torch.bfloat16)` does; values too small for the
//! target become its subnormals or a signed zero, as in PyTorch. A finite value that would
//! become ±inf in the target is refused ([`IoError::Overflow`]); NaN stays NaN and ±inf stays
//! ±inf.

use half::{bf16, f16};
use safetensors::tensor::Dtype as FileDtype;

pub use crate::dtype::Dtype;
use crate::error::IoError;

impl Dtype {
    /// The dtype as the safetensors header writes it.
    pub(crate) fn to_file(self) -> FileDtype {
        match self {
            Dtype::F32 => FileDtype::F32,
            Dtype::Bf16 => FileDtype::BF16,
            Dtype::F16 => FileDtype::F16,
        }
    }

    /// The dtype of a safetensors tensor, if it is one of ours.
    pub(crate) fn from_file(d: FileDtype) -> Option<Self> {
        match d {
            FileDtype::F32 => Some(Dtype::F32),
            FileDtype::BF16 => Some(Dtype::Bf16),
            FileDtype::F16 => Some(Dtype::F16),
            _ => None,
        }
    }
}

/// The f32 values of a tensor's little-endian bytes stored as `dtype` (exact: every BF16 and
/// F16 value is an f32). The bytes may sit at any alignment inside the file.
pub(crate) fn widen(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    let u16s = || {
        bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::Bf16 => u16s().map(|b| bf16::from_bits(b).to_f32()).collect(),
        Dtype::F16 => u16s().map(|b| f16::from_bits(b).to_f32()).collect(),
    }
}

/// The little-endian bytes of `values` stored as `dtype`, rounded to nearest even; a finite
/// value that overflows the target is an [`IoError::Overflow`] naming tensor `name`, the first
/// such element and its value.
pub(crate) fn narrow(name: &str, dtype: Dtype, values: &[f32]) -> Result<Vec<u8>, IoError> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    let overflow = |index: usize, value: f32| IoError::Overflow {
        name: name.to_string(),
        dtype: dtype.name(),
        max: dtype.max_finite(),
        index,
        value,
    };
    match dtype {
        Dtype::F32 => out.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        Dtype::Bf16 => {
            for (i, &v) in values.iter().enumerate() {
                let h = bf16::from_f32(v);
                if h.is_infinite() && v.is_finite() {
                    return Err(overflow(i, v));
                }
                out.extend(h.to_bits().to_le_bytes());
            }
        }
        Dtype::F16 => {
            for (i, &v) in values.iter().enumerate() {
                let h = f16::from_f32(v);
                if h.is_infinite() && v.is_finite() {
                    return Err(overflow(i, v));
                }
                out.extend(h.to_bits().to_le_bytes());
            }
        }
    }
    Ok(out)
}

/// Tolerances: narrowing a normal number rounds to nearest, so the relative error is at most
/// half a unit in the last place; the tests allow 2^-8 for bf16 (8 significant bits) and 2^-11
/// for f16 (11 significant bits) on normal numbers, and half the smallest subnormal (2^-134,
/// 2^-25) as absolute error below the normal range. The bits themselves must equal the `half`
/// crate's reference conversion, and widening must be exact.
#[cfg(test)]
mod tests {
    use super::*;

    fn bits16(bytes: &[u8]) -> Vec<u16> {
        bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    }

    fn le16(bits: &[u16]) -> Vec<u8> {
        bits.iter().flat_map(|b| b.to_le_bytes()).collect()
    }

    /// f32 values over the whole range: a fixed linear congruential walk through the bit
    /// patterns (finite ones only), plus values at and between the half types' boundaries.
    fn samples() -> Vec<f32> {
        let mut x: u32 = 0x1234_5678;
        let mut out: Vec<f32> = (0..20_000)
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                f32::from_bits(x)
            })
            .filter(|v| v.is_finite())
            .collect();
        out.extend([
            0.0,
            -0.0,
            1.0,
            -2.0,
            0.1,
            1.0 / 3.0,
            65504.0,
            65519.0,
            -65519.0,
            6.1e-5,
            5.9e-8,
            1e-40,
            3.0e38,
            -1e-30,
        ]);
        out
    }

    #[test]
    fn names_display_and_parse() {
        for d in Dtype::ALL {
            assert_eq!(d.to_string().parse::<Dtype>().unwrap(), d);
            assert_eq!(Dtype::from_file(d.to_file()), Some(d));
        }
        assert_eq!(Dtype::default(), Dtype::F32);
        assert_eq!(Dtype::Bf16.to_string(), "bf16");
        assert_eq!("BFloat16".parse::<Dtype>().unwrap(), Dtype::Bf16);
        assert_eq!(" float16".parse::<Dtype>().unwrap(), Dtype::F16);
        assert_eq!("fp32".parse::<Dtype>().unwrap(), Dtype::F32);
        for bad in ["f64", "int8", ""] {
            match bad.parse::<Dtype>() {
                Err(e @ IoError::DtypeName { .. }) => {
                    let msg = e.to_string();
                    assert!(
                        msg.contains(&format!("`{bad}`")) && msg.contains("bf16"),
                        "{msg}"
                    );
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        assert_eq!(Dtype::from_file(FileDtype::F64), None);
        assert_eq!(Dtype::F16.max_finite(), 65504.0);
    }

    #[test]
    fn widening_is_exact_for_every_bit_pattern() {
        // Every 16-bit pattern widens to an f32 that narrows back to the same pattern (NaN to a
        // NaN), so no value is lost; and the f32 equals the `half` crate's own widening.
        let all: Vec<u16> = (0..=u16::MAX).collect();
        for d in [Dtype::Bf16, Dtype::F16] {
            let wide = widen(d, &le16(&all));
            assert_eq!(wide.len(), all.len());
            let back = bits16(&narrow("t", d, &wide).unwrap());
            for ((&b, &w), &r) in all.iter().zip(&wide).zip(&back) {
                let reference = match d {
                    Dtype::Bf16 => bf16::from_bits(b).to_f32(),
                    _ => f16::from_bits(b).to_f32(),
                };
                assert_eq!(w.to_bits(), reference.to_bits(), "{d} {b:#06x}");
                if w.is_nan() {
                    let nan = match d {
                        Dtype::Bf16 => bf16::from_bits(r).is_nan(),
                        _ => f16::from_bits(r).is_nan(),
                    };
                    assert!(nan, "{d} {b:#06x} -> {r:#06x}");
                } else {
                    assert_eq!(r, b, "{d} {b:#06x} -> {w:e} -> {r:#06x}");
                }
            }
        }
        // F32 is the identity, whatever the alignment of the bytes.
        let v = samples();
        let mut bytes = vec![0u8];
        bytes.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        let got = widen(Dtype::F32, &bytes[1..]);
        assert!(got.iter().zip(&v).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert_eq!(narrow("t", Dtype::F32, &v).unwrap(), bytes[1..]);
    }

    #[test]
    fn narrowing_matches_half_and_stays_within_precision() {
        let v: Vec<f32> = samples()
            .into_iter()
            .filter(|x| x.abs() <= 65504.0)
            .collect();
        assert!(v.len() > 1000, "{}", v.len());
        for (d, rel, min_normal, abs) in [
            (Dtype::Bf16, 2f64.powi(-8), 2f64.powi(-126), 2f64.powi(-134)),
            (Dtype::F16, 2f64.powi(-11), 2f64.powi(-14), 2f64.powi(-25)),
        ] {
            let bits = bits16(&narrow("t", d, &v).unwrap());
            let back = widen(d, &le16(&bits));
            for ((&x, &b), &y) in v.iter().zip(&bits).zip(&back) {
                let reference = match d {
                    Dtype::Bf16 => bf16::from_f32(x).to_bits(),
                    _ => f16::from_f32(x).to_bits(),
                };
                assert_eq!(b, reference, "{d} {x:e}");
                let (x, y) = (f64::from(x), f64::from(y));
                let err = (y - x).abs();
                if x.abs() >= min_normal {
                    assert!(err <= rel * x.abs(), "{d} {x:e} -> {y:e}");
                } else {
                    assert!(err <= abs, "{d} subnormal {x:e} -> {y:e}");
                }
            }
        }
    }

    #[test]
    fn narrowing_rounds_to_nearest_even_by_hand() {
        // (f32 bits, bf16 bits): 1.0, -2.0, halfway between 1.0 and 1.0078125 (ties to the even
        // 1.0), halfway between 1.0078125 and 1.015625 (ties to the even 1.015625), just above
        // a halfway point (rounds up).
        let cases = [
            (0x3F80_0000u32, 0x3F80u16),
            (0xC000_0000, 0xC000),
            (0x3F80_8000, 0x3F80),
            (0x3F81_8000, 0x3F82),
            (0x3F80_8001, 0x3F81),
        ];
        let v: Vec<f32> = cases.iter().map(|c| f32::from_bits(c.0)).collect();
        let want: Vec<u16> = cases.iter().map(|c| c.1).collect();
        assert_eq!(bits16(&narrow("t", Dtype::Bf16, &v).unwrap()), want);
        // f16: 1.0, -2.0, 65504 (largest), 65519 (rounds down to 65504), 1 + 2^-11 (a tie:
        // to the even 1.0), 2^-24 (smallest subnormal), 2^-25 (a tie: to the even 0).
        let v = [
            1.0f32,
            -2.0,
            65504.0,
            65519.0,
            1.0 + 2f32.powi(-11),
            2f32.powi(-24),
            2f32.powi(-25),
        ];
        assert_eq!(
            bits16(&narrow("t", Dtype::F16, &v).unwrap()),
            [0x3C00, 0xC000, 0x7BFF, 0x7BFF, 0x3C00, 0x0001, 0x0000]
        );
    }

    #[test]
    fn overflow_is_refused_with_the_first_index() {
        let v = [1.0f32, -3.5, 70000.0, 1e9, 2.0];
        match narrow("0.weight", Dtype::F16, &v) {
            Err(e @ IoError::Overflow { .. }) => {
                let IoError::Overflow {
                    ref name,
                    dtype,
                    max,
                    index,
                    value,
                } = e
                else {
                    unreachable!()
                };
                assert_eq!(
                    (name.as_str(), dtype, max, index, value),
                    ("0.weight", "f16", 65504.0, 2, 70000.0)
                );
                let msg = e.to_string();
                for part in ["`0.weight`", "element 2", "70000", "f16", "65504"] {
                    assert!(msg.contains(part), "{part}: {msg}");
                }
            }
            other => panic!("{other:?}"),
        }
        // The first value past the rounding boundary, negative too.
        assert!(matches!(
            narrow("t", Dtype::F16, &[-65520.0]),
            Err(IoError::Overflow { index: 0, .. })
        ));
        // bf16 shares f32's exponent range: only values that round up past its largest finite
        // value overflow (f32::MAX does), and 70000 is fine.
        assert!(narrow("t", Dtype::Bf16, &[70000.0, 3.0e38]).is_ok());
        assert!(matches!(
            narrow("t", Dtype::Bf16, &[0.0, f32::MAX]),
            Err(IoError::Overflow {
                index: 1,
                dtype: "bf16",
                ..
            })
        ));
    }

    #[test]
    fn nan_infinities_and_signed_zero_are_kept() {
        let v = [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0];
        for d in [Dtype::Bf16, Dtype::F16] {
            let back = widen(d, &narrow("t", d, &v).unwrap());
            assert!(back[0].is_nan() && back[1].is_nan(), "{d}: {back:?}");
            assert_eq!(back[2], f32::INFINITY);
            assert_eq!(back[3], f32::NEG_INFINITY);
            assert_eq!(back[4].to_bits(), (-0.0f32).to_bits());
        }
    }

    #[test]
    fn subnormals_narrow_and_widen() {
        // f32 subnormals are bf16 subnormals: 2^-130 is exact (0x0008), 2^-149 rounds to 0.
        // (Built from bits: `powi` of a negative exponent this small divides by infinity.)
        let v = [
            f32::from_bits(0x0008_0000),
            f32::from_bits(0x8001_0000),
            f32::MIN_POSITIVE,
            f32::from_bits(0x0000_0001),
        ];
        let bits = bits16(&narrow("t", Dtype::Bf16, &v).unwrap());
        assert_eq!(bits, [0x0008, 0x8001, 0x0080, 0x0000]);
        assert_eq!(widen(Dtype::Bf16, &le16(&bits))[..3], v[..3]);
        // f16 subnormals: 2^-20 and 2^-24 exact, 1.5 * 2^-24 ties to the even 2^-23, values
        // below 2^-25 become zero.
        let v = [2f32.powi(-20), 2f32.powi(-24), 1.5 * 2f32.powi(-24), 1e-9];
        let bits = bits16(&narrow("t", Dtype::F16, &v).unwrap());
        assert_eq!(bits, [0x0010, 0x0001, 0x0002, 0x0000]);
        assert_eq!(
            widen(Dtype::F16, &le16(&bits)),
            [2f32.powi(-20), 2f32.powi(-24), 2f32.powi(-23), 0.0]
        );
    }
}
