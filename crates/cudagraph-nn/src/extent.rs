//! Buffer extents, checked before anything is launched: how many elements a buffer must hold
//! (`need`), products of dimensions without overflow (`prod`), and a row-major product's
//! dimensions (`GemmDims`). Below both the cuBLAS wrapper and our kernels, which check their
//! buffers with it.

use cudagraph::DeviceBuffer;

use crate::error::{NnError, Result};

type Buf = DeviceBuffer<f32>;

/// `buf` must hold at least `need` elements.
pub(crate) fn need<T: cudagraph::Elem>(
    what: &'static str,
    buf: &DeviceBuffer<T>,
    need: usize,
) -> Result<()> {
    if buf.len() < need {
        return Err(NnError::Core(cudagraph::Error::SizeMismatch {
            what,
            expected: need,
            got: buf.len(),
        }));
    }
    Ok(())
}

/// Product of `dims` (checked).
pub(crate) fn prod(what: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter().try_fold(1usize, |acc, &d| {
        acc.checked_mul(d)
            .ok_or_else(|| NnError::Shape(format!("{what}: {dims:?} overflows")))
    })
}

/// A row-major product `C[m×n] = op(A)·op(B)`: op(A) is m×k (`ta`: A is stored k×m), op(B) is
/// k×n (`tb`: B is stored n×k).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmDims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub ta: bool,
    pub tb: bool,
}

impl GemmDims {
    /// A, B and C (and the bias) hold the elements this product reads and writes.
    pub fn check_buffers(&self, a: &Buf, b: &Buf, c: &Buf, bias: Option<&Buf>) -> Result<()> {
        need("gemm A", a, prod("gemm A", &[self.m, self.k])?)?;
        need("gemm B", b, prod("gemm B", &[self.k, self.n])?)?;
        need("gemm C", c, prod("gemm C", &[self.m, self.n])?)?;
        if let Some(bias) = bias {
            need("gemm bias", bias, self.n)?;
        }
        Ok(())
    }

    pub(crate) fn tiles(&self) -> Result<(u32, u32)> {
        self.tiles_of(32, 32)
    }

    /// The grid of `bm`-row, `bn`-column output tiles: columns in x, rows in y (at most 65535).
    pub(crate) fn tiles_of(&self, bm: usize, bn: usize) -> Result<(u32, u32)> {
        let (gx, gy) = (self.n.div_ceil(bn), self.m.div_ceil(bm));
        if gy > 65535 {
            return Err(NnError::Shape(format!(
                "gemm: {} rows exceed the tiled kernels' grid",
                self.m
            )));
        }
        Ok((u32::try_from(gx).unwrap_or(u32::MAX), gy as u32))
    }
}
