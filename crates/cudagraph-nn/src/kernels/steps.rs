//! Launchers of the device-side training-step kernels (`steps.cu`, its own NVRTC module):
//! the next batch from a resident dataset, the batches-left condition, and the finiteness
//! check. Each checks every buffer against the extent its kernel indexes before launching.

use std::sync::Arc;

use cudagraph::{Arg, Device, DeviceBuffer, Function, LaunchConfig, Queue};

use super::need;
use super::pdl::launch_entered;
use crate::error::{NnError, Result};
use crate::kernels::int;

/// The CUDA source of the module.
pub const SOURCE: &str = include_str!("steps.cu");

/// The step kernels of one device (a [`Device::extension`]).
pub struct StepKernels {
    gather: Function,
    advance: Function,
    batches_left: Function,
    check_finite: Function,
}

impl StepKernels {
    /// The kernels of `device`, compiled on first use.
    pub fn get(device: &Device) -> Result<Arc<Self>> {
        Ok(device.extension(|d| {
            // Relaxed capture mode: the first use may be inside a capture (module loading).
            let m = cudagraph::runtime::with_relaxed_capture(|| {
                d.compile(
                    "cudagraph_nn_steps",
                    &super::module_source("cudagraph_nn_steps"),
                )
            })?;
            Ok(StepKernels {
                gather: m.function("gather_batch")?,
                advance: m.function("advance_cursor")?,
                batches_left: m.function("batches_left")?,
                check_finite: m.function("check_finite")?,
            })
        })?)
    }
}

fn mul(what: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| NnError::Shape(format!("{what}: {a} × {b} overflows")))
}

impl StepKernels {
    /// Copies batch `cursor[0] mod batches` (`rows` rows of `features` values) of the resident
    /// `images`/`labels` into `x`/`y`, then advances the cursor (a second, one-thread kernel)
    /// and, with `cond`, sets `cond[0] = cursor[0] < batches` (batches left).
    #[allow(clippy::too_many_arguments)]
    pub fn gather_batch(
        &self,
        q: &dyn Queue,
        images: &DeviceBuffer<f32>,
        labels: &DeviceBuffer<i32>,
        x: &DeviceBuffer<f32>,
        y: &DeviceBuffer<i32>,
        cursor: &DeviceBuffer<u32>,
        cond: Option<&DeviceBuffer<u32>>,
        batches: usize,
        rows: usize,
        features: usize,
    ) -> Result<()> {
        if batches == 0 || rows == 0 {
            return Err(NnError::Shape(format!(
                "gather_batch: {batches} batches of {rows} rows"
            )));
        }
        let batch = mul("batch", rows, features)?;
        need(
            "resident images",
            images,
            mul("resident images", batches, batch)?,
        )?;
        need(
            "resident labels",
            labels,
            mul("resident labels", batches, rows)?,
        )?;
        need("batch input", x, batch)?;
        need("batch targets", y, rows)?;
        need("batch cursor", cursor, 1)?;
        int("batches · rows", mul("batches · rows", batches, rows)?)?;
        // The labels loop steps a 1024-thread block past `rows`.
        let ri = super::int_loop("batch rows", rows, 1024)?;
        if let Some(c) = cond {
            need("loop condition", c, 1)?;
        }
        let bi = int("batches", batches)?;
        // SAFETY: one block; b < batches (the kernel takes the cursor modulo batches) reads
        // images[(b·rows)·features + i] for i < rows·features, below batches·rows·features,
        // and labels[b·rows + i] for i < rows, below batches·rows (both checked); writes x below
        // rows·features and y below rows (checked); reads cursor[0].
        unsafe {
            launch_entered(
                q,
                &self.gather,
                LaunchConfig::linear(1, 1024),
                &[
                    images.into(),
                    labels.into(),
                    x.into(),
                    y.into(),
                    cursor.into(),
                    Arg::I32(bi),
                    Arg::I32(ri),
                    Arg::I32(int("features", features)?),
                ],
            )?;
        }
        // SAFETY: one thread reads and writes cursor[0] and writes cond[0] when given (both
        // checked to hold one element).
        unsafe {
            launch_entered(
                q,
                &self.advance,
                LaunchConfig::linear(1, 1),
                &[cursor.into(), Arg::I32(bi), Arg::opt(cond)],
            )
        }
    }

    /// `cond[0] = cursor[0] < batches`.
    pub fn batches_left(
        &self,
        q: &dyn Queue,
        cursor: &DeviceBuffer<u32>,
        batches: usize,
        cond: &DeviceBuffer<u32>,
    ) -> Result<()> {
        need("batch cursor", cursor, 1)?;
        need("loop condition", cond, 1)?;
        // SAFETY: one thread reads cursor[0] and writes cond[0] (both checked).
        unsafe {
            launch_entered(
                q,
                &self.batches_left,
                LaunchConfig::linear(1, 1),
                &[
                    cursor.into(),
                    Arg::I32(int("batches", batches)?),
                    cond.into(),
                ],
            )
        }
    }

    /// `flag[0] = 0` when any of `x` is NaN or infinite (left as it is otherwise).
    pub fn check_finite(
        &self,
        q: &dyn Queue,
        x: &DeviceBuffer<f32>,
        flag: &DeviceBuffer<u32>,
    ) -> Result<()> {
        need("finite flag", flag, 1)?;
        if x.is_empty() {
            return Ok(());
        }
        let n = i64::try_from(x.len())
            .map_err(|_| NnError::Shape("check_finite: too many elements".into()))?;
        // SAFETY: i < n = x.len() reads x[i]; one write of flag[0] (checked).
        unsafe {
            launch_entered(
                q,
                &self.check_finite,
                LaunchConfig::for_elements(x.len(), 256),
                &[x.into(), Arg::I64(n), flag.into()],
            )
        }
    }
}
