//! Buffer extents, checked before anything is launched: how many elements a buffer must hold
//! (`need`), products of dimensions without overflow (`prod`), a row-major product's
//! dimensions (`GemmDims`), and which device a buffer or library handle belongs to
//! (`on_device`, `handle_on_device`: the check every call into cuBLAS, cuBLASLt and cuDNN makes
//! before handing them a raw address; our own kernels get the same check from
//! `Queue::launch`). Below the library wrappers and our kernels, which check their buffers with
//! it.

use std::sync::Arc;

use cudagraph::memory::BlockRef;
use cudagraph::{DeviceBuffer, Queue};

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

/// Every block in `bufs` (named for the error) must be device memory of `q`'s device: the
/// libraries take raw addresses, and an address of another device's memory (or of host memory
/// from a CPU-test allocator) would fault there or write what it must not. The same refusals as
/// the core's own entry points: [`cudagraph::Error::WrongDevice`] for another device's buffer,
/// [`cudagraph::Error::NotSupported`] for a block that is not device memory.
pub(crate) fn on_device<'b>(
    q: &dyn Queue,
    bufs: impl IntoIterator<Item = (&'static str, &'b Arc<BlockRef>)>,
) -> Result<()> {
    let ordinal = q.device().ordinal();
    bufs.into_iter()
        .try_for_each(|(what, block)| block_on_device(ordinal, what, block))
}

/// [`on_device`] for one block, against device `ordinal`.
pub(crate) fn block_on_device(ordinal: usize, what: &'static str, block: &BlockRef) -> Result<()> {
    owned_by(
        ordinal,
        what,
        block.device_ordinal(),
        block.is_device_memory(),
    )
}

/// A library handle bound to device `handle` (`what` names it: "cuBLAS handle") may only run
/// work on queues of that device: its context, plans and workspaces are that device's.
pub(crate) fn handle_on_device(q: &dyn Queue, what: &'static str, handle: usize) -> Result<()> {
    owned_by(q.device().ordinal(), what, handle, true)
}

/// `what`, which belongs to device `got` (and is device memory or not), may be used with device
/// `expected`.
fn owned_by(expected: usize, what: &'static str, got: usize, device_memory: bool) -> Result<()> {
    if got != expected {
        return Err(NnError::Core(cudagraph::Error::WrongDevice {
            what,
            expected,
            got,
        }));
    }
    if !device_memory {
        return Err(NnError::Core(cudagraph::Error::NotSupported {
            what: "a buffer from an allocator made with Allocator::new",
            detail: format!(
                "{what} is not device memory, and only device memory may be handed to a CUDA \
                 library; allocate device buffers with Queue::alloc"
            ),
        }));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_devices_buffer_or_handle_is_a_wrong_device_error_naming_both_devices() {
        let e = owned_by(0, "gemm A", 1, true).unwrap_err();
        assert!(
            matches!(
                e,
                NnError::Core(cudagraph::Error::WrongDevice {
                    what: "gemm A",
                    expected: 0,
                    got: 1
                })
            ),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "gemm A belongs to device 1, but was used with device 0"
        );
        // The device is checked first: host memory of another ordinal is still "another device".
        assert!(matches!(
            owned_by(2, "cuDNN workspace", 0, false),
            Err(NnError::Core(cudagraph::Error::WrongDevice {
                expected: 2,
                got: 0,
                ..
            }))
        ));
    }

    #[test]
    fn memory_that_is_not_device_memory_is_refused_even_on_the_right_ordinal() {
        let e = owned_by(0, "conv2d x", 0, false).unwrap_err();
        assert!(
            matches!(e, NnError::Core(cudagraph::Error::NotSupported { .. })),
            "{e}"
        );
        assert!(
            e.to_string().contains("conv2d x is not device memory"),
            "{e}"
        );
    }

    #[test]
    fn device_memory_of_the_queues_device_passes() {
        owned_by(0, "gemm C", 0, true).unwrap();
        owned_by(3, "cuBLAS handle", 3, true).unwrap();
    }
}
