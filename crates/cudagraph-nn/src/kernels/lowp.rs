//! Elementwise kernels and reductions on bf16 and f16 buffers (`lowp.cu`, compiled after
//! `cast.cu` as its own NVRTC module): one CUDA template per operation instantiated per 16-bit
//! type. Values are widened to f32, computed in f32 and rounded to nearest even once on store;
//! sums accumulate in f32 in a fixed order (deterministic).
//!
//! Every launcher is generic over [`Float`] and checks the element type (bf16 or f16; an f32
//! buffer is `NnError::Dtype`, its kernels are [`Nn`](super::Nn)'s) and every extent first.

use std::sync::Arc;

use cudagraph::{Arg, Device, DeviceBuffer, LaunchConfig, Queue};

use crate::dtype::{Dtype, Float};
use crate::error::{NnError, Result};
use crate::extent::{need, prod};
use crate::kernels::{count, grid_stride, int, ByType};

/// The CUDA source of the module (after the cast module's conversions).
pub fn source() -> String {
    format!("{}{}", super::cast::SOURCE, include_str!("lowp.cu"))
}

/// The 16-bit kernels of one device (a [`Device::extension`]).
pub struct LowpKernels {
    add_inplace: ByType,
    relu_fwd: ByType,
    relu_bwd: ByType,
    col_sum: ByType,
    col_sum_f32: ByType,
    maxpool_fwd: ByType,
    maxpool_bwd: ByType,
}

impl LowpKernels {
    /// The kernels of `device`, compiled on first use.
    pub fn get(device: &Device) -> Result<Arc<Self>> {
        Ok(device.extension(|d| {
            // Relaxed capture mode: the first use may be inside a capture (module loading).
            let m = cudagraph::runtime::with_relaxed_capture(|| {
                d.compile(
                    "cudagraph_nn_lowp",
                    &super::module_source("cudagraph_nn_lowp"),
                )
            })?;
            Ok(LowpKernels {
                add_inplace: ByType::load_half(&m, "add_inplace")?,
                relu_fwd: ByType::load_half(&m, "relu_fwd")?,
                relu_bwd: ByType::load_half(&m, "relu_bwd")?,
                col_sum: ByType::load_half(&m, "col_sum")?,
                maxpool_fwd: ByType::load_half(&m, "maxpool_fwd")?,
                maxpool_bwd: ByType::load_half(&m, "maxpool_bwd")?,
                col_sum_f32: ByType::load_half(&m, "col_sum_wide")?,
            })
        })?)
    }

    /// `a[i] += b[i]` for every element of `a` (`b` at least as long).
    pub fn add_inplace<T: Float>(
        &self,
        q: &dyn Queue,
        a: &DeviceBuffer<T>,
        b: &DeviceBuffer<T>,
    ) -> Result<()> {
        let f = self.add_inplace.of::<T>("add_inplace")?;
        let n = a.len();
        need("add_inplace b", b, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: add_inplace_{bf16,f16}(T* a, const T* b, long long n) reads a[i], b[i] and
        // writes a[i] for i < n only; both hold n elements of the kernel's 2-byte type.
        unsafe {
            Ok(q.launch(
                f,
                grid_stride(n),
                &[a.into(), b.into(), count("add_inplace", n)?],
            )?)
        }
    }

    /// `y[i] = max(x[i], 0)` over `x` (NaN kept); `y` as long.
    pub fn relu_fwd<T: Float>(
        &self,
        q: &dyn Queue,
        x: &DeviceBuffer<T>,
        y: &DeviceBuffer<T>,
    ) -> Result<()> {
        let f = self.relu_fwd.of::<T>("relu")?;
        let n = x.len();
        need("relu y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: relu_fwd_{bf16,f16}(const T* x, T* y, long long n) touches i < n only; both
        // buffers hold n elements.
        unsafe { Ok(q.launch(f, grid_stride(n), &[x.into(), y.into(), count("relu", n)?])?) }
    }

    /// `dx[i] = dy[i]` where `y[i] > 0`, else 0, over `dy` (`y`, `dx` as long).
    pub fn relu_bwd<T: Float>(
        &self,
        q: &dyn Queue,
        dy: &DeviceBuffer<T>,
        y: &DeviceBuffer<T>,
        dx: &DeviceBuffer<T>,
    ) -> Result<()> {
        let f = self.relu_bwd.of::<T>("relu backward")?;
        let n = dy.len();
        need("relu backward y", y, n)?;
        need("relu backward dx", dx, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: relu_bwd_{bf16,f16}(const T* dy, const T* y, T* dx, long long n) touches
        // i < n only; the three buffers hold n elements.
        unsafe {
            Ok(q.launch(
                f,
                grid_stride(n),
                &[dy.into(), y.into(), dx.into(), count("relu backward", n)?],
            )?)
        }
    }

    /// `db[c] = Σ_r dy[r, c]` for `dy: [rows, cols]`, summed in f32 in a fixed order, stored
    /// as `O` (`T` itself, or f32).
    pub fn col_sum<T: Float, O: Float>(
        &self,
        q: &dyn Queue,
        dy: &DeviceBuffer<T>,
        db: &DeviceBuffer<O>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let f = if O::DTYPE == Dtype::F32 {
            self.col_sum_f32.of::<T>("col_sum")?
        } else if O::DTYPE == T::DTYPE {
            self.col_sum.of::<T>("col_sum")?
        } else {
            return Err(NnError::Dtype {
                what: "col_sum output",
                expected: T::DTYPE.name(),
                found: O::DTYPE.name(),
            });
        };
        need("col_sum dy", dy, prod("col_sum", &[rows, cols])?)?;
        need("col_sum db", db, cols)?;
        if cols == 0 {
            return Ok(());
        }
        let (r, c) = (
            Arg::I32(int("col_sum rows", rows)?),
            Arg::I32(int("col_sum cols", cols)?),
        );
        let grid = u32::try_from(cols)
            .map_err(|_| NnError::Shape(format!("col_sum: {cols} columns exceed the grid")))?;
        // SAFETY: col_sum_*(const T* dy, O* db, int rows, int cols): block c < cols reads
        // dy[r·cols + c] for r < rows and writes db[c]; the extents were checked above, the
        // block is 256 threads (the kernel's shared array).
        unsafe {
            Ok(q.launch(
                f,
                LaunchConfig::linear(grid, 256),
                &[dy.into(), db.into(), r, c],
            )?)
        }
    }
}

impl LowpKernels {
    /// Max pooling of `planes` planes of `h × w` (window `k`, stride `s`) from `x` into `y`,
    /// with the argmax of each output in `idx`; returns the output size `(oh, ow)`.
    #[allow(clippy::too_many_arguments)]
    pub fn maxpool_fwd<T: Float>(
        &self,
        q: &dyn Queue,
        x: &DeviceBuffer<T>,
        y: &DeviceBuffer<T>,
        idx: &DeviceBuffer<i32>,
        planes: usize,
        (h, w): (usize, usize),
        k: usize,
        s: usize,
    ) -> Result<(usize, usize)> {
        let f = self.maxpool_fwd.of::<T>("max_pool2d")?;
        if k == 0 || s == 0 || h < k || w < k {
            return Err(NnError::Shape(format!(
                "max_pool2d: {h}×{w} input, window {k}, stride {s}"
            )));
        }
        let (oh, ow) = ((h - k) / s + 1, (w - k) / s + 1);
        let n_in = prod("max_pool2d input", &[planes, h, w])?;
        let n_out = prod("max_pool2d output", &[planes, oh, ow])?;
        // The kernel indexes inputs with int.
        int("max_pool2d input size", n_in)?;
        need("max_pool2d x", x, n_in)?;
        need("max_pool2d y", y, n_out)?;
        need("max_pool2d idx", idx, n_out)?;
        if n_out == 0 {
            return Ok((oh, ow));
        }
        let dims = [
            Arg::I32(int("planes", planes)?),
            Arg::I32(int("h", h)?),
            Arg::I32(int("w", w)?),
            Arg::I32(int("k", k)?),
            Arg::I32(int("s", s)?),
            Arg::I32(int("oh", oh)?),
            Arg::I32(int("ow", ow)?),
        ];
        let mut args = vec![x.into(), y.into(), idx.into()];
        args.extend(dims);
        // SAFETY: maxpool_fwd_{bf16,f16}(const T* x, T* y, int* idx, int planes, int H, int W,
        // int K, int S, int OH, int OW): output i < planes·oh·ow (the extent of y and idx,
        // checked) reads x at rows < h and columns < w of its plane (< planes·h·w, checked,
        // within int).
        unsafe { Ok(q.launch(f, grid_stride(n_out), &args).map(|_| (oh, ow))?) }
    }

    /// Adds `dy[i]` into the f32 gradient `dx` at `idx[i]` (clamped into `dx`), for the first
    /// `n_out` outputs.
    pub fn maxpool_bwd<T: Float>(
        &self,
        q: &dyn Queue,
        dy: &DeviceBuffer<T>,
        idx: &DeviceBuffer<i32>,
        dx: &DeviceBuffer<f32>,
        n_out: usize,
    ) -> Result<()> {
        let f = self.maxpool_bwd.of::<T>("max_pool2d backward")?;
        need("max_pool2d dy", dy, n_out)?;
        need("max_pool2d idx", idx, n_out)?;
        if dx.is_empty() {
            return Err(NnError::Shape("max_pool2d: empty input gradient".into()));
        }
        if n_out == 0 {
            return Ok(());
        }
        let args = [
            dy.into(),
            idx.into(),
            dx.into(),
            count("max_pool2d", n_out)?,
            count("max_pool2d", dx.len())?,
        ];
        // SAFETY: maxpool_bwd_{bf16,f16}(const T* dy, const int* idx, float* dx, long long n,
        // long long n_in) reads dy[i], idx[i] for i < n (both hold n, checked) and adds into
        // dx[j] with j clamped into [0, n_in), n_in = dx.len() > 0.
        unsafe { Ok(q.launch(f, grid_stride(n_out), &args)?) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_instantiated_for_both_types() {
        let src = source();
        for k in [
            "add_inplace",
            "relu_fwd",
            "relu_bwd",
            "col_sum",
            "col_sum_wide",
        ] {
            let name = format!("{k}_##S");
            assert!(src.contains(&format!("void {name}(")), "{name}");
        }
        assert!(src.contains("LOWP_INSTANCES(bf16_t, bf16)"));
        assert!(src.contains("LOWP_INSTANCES(f16_t, f16)"));
        assert!(
            !src.contains("#include"),
            "no header: NVRTC has no include path here"
        );
    }

    #[test]
    fn launches_are_bounded_and_integers_checked() {
        assert_eq!(grid_stride(1).grid.0, 1);
        assert_eq!(
            grid_stride(usize::MAX).grid.0 as usize,
            crate::kernels::STRIDE_MAX_BLOCKS
        );
        assert!(count("x", usize::MAX).is_err());
        assert!(int("x", 1 << 31).is_err());
        assert!(int("x", (1 << 31) - 1).is_ok());
    }
}
