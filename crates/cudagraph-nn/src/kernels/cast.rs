//! Casts between f32 and the 16-bit floats bf16 and f16 on raw device buffers: [`to_bf16`],
//! [`to_f16`], [`from_bf16`], [`from_f16`]. The kernels (`cast.cu`, its own NVRTC module) are
//! one template instantiated per pair of types. The same module transposes matrices
//! (`transpose`, the bits as they are).
//!
//! Narrowing rounds to nearest, ties to even, as `__float2bfloat16_rn` / `__float2half_rn`
//! (and PyTorch's `.to(torch.bfloat16)` / `.to(torch.float16)` on the device): values past the
//! largest finite one become ±inf, tiny ones ±0 or a subnormal, the sign of zero is kept, and a
//! NaN becomes the canonical NaN `0x7FFF`. Widening is exact. The bits equal the `half`
//! crate's conversions on the host for every non-NaN value.
//!
//! Each function casts all of `src` into `dst`, which must have the same length (a typed
//! [`SizeMismatch`](cudagraph::Error::SizeMismatch) otherwise). They are enqueued on `q`, an
//! eager stream or a capture alike; an empty pair enqueues nothing.

use std::sync::Arc;

use cudagraph::memory::{bf16, f16};
use cudagraph::{Arg, Device, DeviceBuffer, Elem, Function, LaunchConfig, Queue, QueueExt};

use crate::dtype::{Dtype, TypedBuffer};
use crate::error::{NnError, Result};
use crate::kernels::grid_stride;

/// The CUDA source of the module.
pub const SOURCE: &str = include_str!("cast.cu");

/// The cast kernels of one device (a [`Device::extension`]).
pub struct CastKernels {
    f32_bf16: Function,
    f32_f16: Function,
    bf16_f32: Function,
    f16_f32: Function,
    transpose_b2: Function,
    transpose_b4: Function,
}

impl CastKernels {
    /// The kernels of `device`, compiled on first use.
    pub fn get(device: &Device) -> Result<Arc<Self>> {
        Ok(device.extension(|d| {
            // Relaxed capture mode: the first use may be inside a capture (module loading).
            let m = cudagraph::runtime::with_relaxed_capture(|| {
                d.compile(
                    "cudagraph_nn_cast",
                    &super::module_source("cudagraph_nn_cast"),
                )
            })?;
            Ok(CastKernels {
                f32_bf16: m.function("cast_f32_bf16")?,
                f32_f16: m.function("cast_f32_f16")?,
                bf16_f32: m.function("cast_bf16_f32")?,
                f16_f32: m.function("cast_f16_f32")?,
                transpose_b2: m.function("transpose_b2")?,
                transpose_b4: m.function("transpose_b4")?,
            })
        })?)
    }
}

/// The element count of a cast from `src` to `dst`: their common length, as the kernel's
/// `long long`. A typed error when the lengths differ.
pub(crate) fn cast_len(what: &'static str, src: usize, dst: usize) -> Result<i64> {
    if src != dst {
        return Err(NnError::Core(cudagraph::Error::SizeMismatch {
            what,
            expected: src,
            got: dst,
        }));
    }
    i64::try_from(src).map_err(|_| NnError::Shape(format!("{what}: {src} elements exceed i64")))
}

/// The launch of a cast of `n` elements, grid-stride: one thread per element, or with `vec`
/// per group of four.
pub(crate) fn cast_config(n: usize, vec: bool) -> LaunchConfig {
    grid_stride(if vec { n.div_ceil(4) } else { n })
}

/// Whether a cast from `src` to `dst` may move groups of four elements: both addresses aligned
/// to four of their elements (16 bytes of f32, 8 of a 16-bit type).
fn vectorizable<A: Elem, B: Elem>(src: &DeviceBuffer<A>, dst: &DeviceBuffer<B>) -> bool {
    src.addr() % (4 * std::mem::size_of::<A>() as u64) == 0
        && dst.addr() % (4 * std::mem::size_of::<B>() as u64) == 0
}

/// Launches cast kernel `f` from `src` to `dst` after checking their lengths.
fn cast<A: Elem, B: Elem>(
    q: &dyn Queue,
    f: &Function,
    what: &'static str,
    src: &DeviceBuffer<A>,
    dst: &DeviceBuffer<B>,
) -> Result<()> {
    let n = cast_len(what, src.len(), dst.len())?;
    if n == 0 {
        return Ok(());
    }
    let vec = vectorizable(src, dst);
    // SAFETY: `f` is one of `cast.cu`'s kernels, whose parameters are (const A* src, B* dst,
    // long long n, int vec) with A and B of the sizes of these element types (4 bytes for
    // float, 2 for bf16_t / f16_t); it reads src[i] and writes dst[i] for i < n only, and
    // n = src.len() = dst.len() (checked above). With vec = 1 it moves groups of four as one
    // access of 4·size bytes, and both addresses are aligned to that (checked above).
    unsafe {
        Ok(q.launch(
            f,
            cast_config(src.len(), vec),
            &[src.into(), dst.into(), Arg::I64(n), Arg::I32(vec as i32)],
        )?)
    }
}

/// `dst[i] = bf16(src[i])`, rounded to nearest even (see the module's documentation).
pub fn to_bf16(q: &dyn Queue, src: &DeviceBuffer<f32>, dst: &DeviceBuffer<bf16>) -> Result<()> {
    let k = CastKernels::get(q.device())?;
    cast(q, &k.f32_bf16, "cast f32 → bf16", src, dst)
}

/// `dst[i] = f16(src[i])`, rounded to nearest even (see the module's documentation).
pub fn to_f16(q: &dyn Queue, src: &DeviceBuffer<f32>, dst: &DeviceBuffer<f16>) -> Result<()> {
    let k = CastKernels::get(q.device())?;
    cast(q, &k.f32_f16, "cast f32 → f16", src, dst)
}

/// `dst[i] = f32(src[i])`, exact.
pub fn from_bf16(q: &dyn Queue, src: &DeviceBuffer<bf16>, dst: &DeviceBuffer<f32>) -> Result<()> {
    let k = CastKernels::get(q.device())?;
    cast(q, &k.bf16_f32, "cast bf16 → f32", src, dst)
}

/// `dst[i] = f32(src[i])`, exact.
pub fn from_f16(q: &dyn Queue, src: &DeviceBuffer<f16>, dst: &DeviceBuffer<f32>) -> Result<()> {
    let k = CastKernels::get(q.device())?;
    cast(q, &k.f16_f32, "cast f16 → f32", src, dst)
}

/// Rows and columns of the tiles [`transpose`] moves; its blocks are 32 × 8 threads.
const TILE: usize = 32;
/// Most grid rows of [`transpose`] (its loop strides over the tile columns beyond).
const TRANSPOSE_MAX_GRID_ROWS: usize = 65_535;

/// The launch of [`transpose`] of a `rows` × `cols` matrix: one block per 32 × 32 tile, grid
/// columns over the tile rows, grid rows over the tile columns up to
/// [`TRANSPOSE_MAX_GRID_ROWS`]. `None` where the tile rows exceed a grid's columns.
pub(crate) fn transpose_config(rows: usize, cols: usize) -> Option<LaunchConfig> {
    let across = u32::try_from(rows.div_ceil(TILE).max(1)).ok()?;
    let down = cols.div_ceil(TILE).clamp(1, TRANSPOSE_MAX_GRID_ROWS) as u32;
    Some(LaunchConfig {
        grid: (across, down, 1),
        block: (TILE as u32, 8, 1),
        shared_mem_bytes: 0,
    })
}

/// Writes the transpose of `src`, a row-major `rows` × `cols` matrix, into `dst`
/// (`dst[c·rows + r] = src[r·cols + c]`): the bits as they are, for elements of 2 or 4 bytes.
/// A typed error where a buffer is too short or a count exceeds the kernel's integers;
/// nothing runs then.
pub(crate) fn transpose<T: Elem>(
    q: &dyn Queue,
    src: &DeviceBuffer<T>,
    dst: &DeviceBuffer<T>,
    (rows, cols): (usize, usize),
) -> Result<()> {
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let len = crate::extent::prod("transpose", &[rows, cols])?;
    crate::extent::need("transpose source", src, len)?;
    crate::extent::need("transpose destination", dst, len)?;
    let k = CastKernels::get(q.device())?;
    let f = match std::mem::size_of::<T>() {
        2 => &k.transpose_b2,
        4 => &k.transpose_b4,
        n => {
            return Err(NnError::NotSupported {
                op: "transpose",
                what: format!("elements of {n} bytes"),
                fix: "transpose elements of 2 or 4 bytes",
            })
        }
    };
    let too_many = || {
        NnError::Shape(format!(
            "transpose: {rows} × {cols} exceeds the kernel's grid"
        ))
    };
    let cfg = transpose_config(rows, cols).ok_or_else(too_many)?;
    // The column loop's index stays below cols + the grid's height ≤ i32::MAX.
    let c = crate::kernels::int_loop("transpose columns", cols, TILE * TRANSPOSE_MAX_GRID_ROWS)?;
    let r = i64::try_from(rows).map_err(|_| too_many())?;
    // SAFETY: `f` is transpose_b2 or transpose_b4 of `cast.cu`, (const E* src, E* dst, long
    // long rows, int cols) with E of T's size (checked above); it reads src[r·cols + c] and
    // writes dst[c·rows + r] for r < rows, c < cols only, both below rows·cols, the length
    // checked above; its tile rows start below rows (the grid's columns cover them once).
    unsafe { Ok(q.launch(f, cfg, &[src.into(), dst.into(), Arg::I64(r), Arg::I32(c)])?) }
}

/// A new buffer holding `src` converted to `to` (allocated on `q`): narrowing rounds to
/// nearest even, widening is exact, bf16 ↔ f16 goes through f32 (exact, then one rounding).
/// The same type gives `src` itself (no copy).
pub(crate) fn cast_new(q: &dyn Queue, src: &TypedBuffer, to: Dtype) -> Result<TypedBuffer> {
    let n = src.len();
    Ok(match (src, to) {
        (s, d) if s.dtype() == d => s.clone(),
        (TypedBuffer::F32(s), Dtype::Bf16) => {
            let d = q.alloc::<bf16>(n)?;
            to_bf16(q, s, &d)?;
            TypedBuffer::Bf16(Arc::new(d))
        }
        (TypedBuffer::F32(s), Dtype::F16) => {
            let d = q.alloc::<f16>(n)?;
            to_f16(q, s, &d)?;
            TypedBuffer::F16(Arc::new(d))
        }
        (TypedBuffer::Bf16(s), d) => {
            let w = q.alloc::<f32>(n)?;
            from_bf16(q, s, &w)?;
            cast_new(q, &TypedBuffer::F32(Arc::new(w)), d)?
        }
        (TypedBuffer::F16(s), d) => {
            let w = q.alloc::<f32>(n)?;
            from_f16(q, s, &w)?;
            cast_new(q, &TypedBuffer::F32(Arc::new(w)), d)?
        }
        // Every (F32, d) with d != F32 is above.
        (TypedBuffer::F32(s), _) => TypedBuffer::F32(s.clone()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{STRIDE_BLOCK, STRIDE_MAX_BLOCKS};

    /// One 32 × 8 block per 32 × 32 tile: grid columns over the tile rows, grid rows over the
    /// tile columns up to 65 535 (the kernel's loop strides over the rest).
    #[test]
    fn a_transpose_covers_every_tile_with_a_bounded_grid() {
        let c = transpose_config(50257, 64).unwrap();
        assert_eq!((c.grid, c.block), ((1571, 2, 1), (32, 8, 1)));
        assert_eq!(transpose_config(1, 1).unwrap().grid, (1, 1, 1));
        assert_eq!(
            transpose_config(3, 70_000_000).unwrap().grid,
            (1, 65_535, 1)
        );
        assert_eq!(
            transpose_config(32 * (u32::MAX as usize), 1)
                .unwrap()
                .grid
                .0,
            u32::MAX
        );
        assert!(transpose_config(32 * (u32::MAX as usize) + 1, 1).is_none());
    }

    #[test]
    fn a_cast_needs_equal_lengths() {
        assert_eq!(cast_len("c", 0, 0).unwrap(), 0);
        assert_eq!(cast_len("c", 12345, 12345).unwrap(), 12345);
        let e = cast_len("cast f32 → bf16", 10, 9).unwrap_err();
        assert!(
            matches!(
                e,
                NnError::Core(cudagraph::Error::SizeMismatch {
                    what: "cast f32 → bf16",
                    expected: 10,
                    got: 9
                })
            ),
            "{e:?}"
        );
        assert!(cast_len("c", 9, 10).is_err(), "a longer destination too");
        assert!(cast_len("c", usize::MAX, usize::MAX).is_err());
    }

    #[test]
    fn the_launch_covers_every_element_with_a_bounded_grid() {
        let c = cast_config(1, false);
        assert_eq!((c.grid.0, c.block.0), (1, STRIDE_BLOCK));
        assert_eq!(cast_config(256, false).grid.0, 1);
        assert_eq!(cast_config(257, false).grid.0, 2);
        // Groups of four: a quarter of the threads.
        assert_eq!(cast_config(1024, true).grid.0, 1);
        assert_eq!(cast_config(1025, true).grid.0, 2);
        // Past STRIDE_MAX_BLOCKS blocks the kernel's grid-stride loop covers the rest.
        assert_eq!(
            cast_config(usize::MAX, false).grid.0 as usize,
            STRIDE_MAX_BLOCKS
        );
        assert_eq!(
            cast_config(usize::MAX, true).grid.0 as usize,
            STRIDE_MAX_BLOCKS
        );
        assert_eq!(cast_config(0, false).grid.0, 1);
    }

    #[test]
    fn the_source_instantiates_every_launched_kernel_from_one_template() {
        for name in [
            "cast_f32_bf16",
            "cast_f32_f16",
            "cast_bf16_f32",
            "cast_f16_f32",
        ] {
            assert!(
                SOURCE.contains(&format!("extern \"C\" __global__ void {name}(")),
                "{name}"
            );
        }
        assert_eq!(
            SOURCE
                .matches("template <typename From, typename To>")
                .count(),
            1
        );
        assert!(
            !SOURCE.contains("#include"),
            "no header: NVRTC has no include path here"
        );
    }
}
