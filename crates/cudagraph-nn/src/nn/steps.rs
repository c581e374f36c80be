//! Training steps that run on the device without the host, built on conditional graph nodes
//! (CUDA 12.4+):
//!
//! - [`DeviceBatches`]: a dataset resident in device memory with a device-side cursor;
//!   [`DeviceBatches::train_steps`] captures a WHILE node whose body copies the next batch into
//!   the static input (a kernel reads the cursor) and runs your training step — `k` steps per
//!   graph launch, stopping early at the end of the epoch;
//! - [`step_if_finite`]: GradScaler's pattern without a host read — an IF node runs the
//!   optimizer step only when the loss and every gradient are finite.

use std::sync::Arc;

use cudagraph::{CaptureStream, DeviceBuffer, Queue, QueueExt, Stream};

use crate::autograd::tensor::{require_f32_params, Tensor};
use crate::error::{NnError, Result};
use crate::kernels::steps::StepKernels;
use crate::nn::optim::Optimizer;

/// A dataset in device memory, read batch by batch by kernels: batch `b` is rows
/// `[b·rows, (b+1)·rows)`. A cursor on the device says which batch comes next.
pub struct DeviceBatches {
    images: DeviceBuffer<f32>,
    labels: DeviceBuffer<i32>,
    cursor: DeviceBuffer<u32>,
    cond: DeviceBuffer<u32>,
    batches: usize,
    rows: usize,
    features: usize,
}

impl std::fmt::Debug for DeviceBatches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBatches({} batches of {}×{})",
            self.batches, self.rows, self.features
        )
    }
}

impl DeviceBatches {
    /// Uploads `images` (`n × features`, row-major) and `labels` (`n`) and cuts them into
    /// `⌊n / rows⌋` batches of `rows` rows (the remainder is not used). The cursor starts at 0.
    pub fn new(
        s: &Stream,
        images: &[f32],
        labels: &[i32],
        features: usize,
        rows: usize,
    ) -> Result<Self> {
        let batches = Self::check(images, labels, features, rows)?;
        let used = batches * rows;
        Ok(Self {
            images: s.alloc_from_host(&images[..used * features])?,
            labels: s.alloc_from_host(&labels[..used])?,
            cursor: s.alloc_zeroed::<u32>(1)?,
            cond: s.alloc_zeroed::<u32>(1)?,
            batches,
            rows,
            features,
        })
    }

    fn check(images: &[f32], labels: &[i32], features: usize, rows: usize) -> Result<usize> {
        if rows == 0 || features == 0 {
            return Err(NnError::Shape(format!(
                "device batches of {rows} rows of {features} features"
            )));
        }
        if Some(images.len()) != labels.len().checked_mul(features) {
            return Err(NnError::Shape(format!(
                "{} image values for {} labels of {features} features",
                images.len(),
                labels.len()
            )));
        }
        let batches = labels.len() / rows;
        if batches == 0 {
            return Err(NnError::Shape(format!(
                "{} rows make no batch of {rows}",
                labels.len()
            )));
        }
        Ok(batches)
    }

    /// Replaces the data (same sizes: a new epoch's order, say) and rewinds the cursor.
    /// Work already queued on `s` that reads the data runs first (same stream).
    pub fn reload(&self, s: &Stream, images: &[f32], labels: &[i32]) -> Result<()> {
        if Self::check(images, labels, self.features, self.rows)? != self.batches {
            return Err(NnError::Shape(format!(
                "reload: {} rows for {} batches of {}",
                labels.len(),
                self.batches,
                self.rows
            )));
        }
        let used = self.batches * self.rows;
        s.copy_from_host(&images[..used * self.features], &self.images)?;
        s.copy_from_host(&labels[..used], &self.labels)?;
        self.rewind(s)
    }

    /// Sets the cursor back to the first batch.
    pub fn rewind(&self, s: &Stream) -> Result<()> {
        Ok(s.memset_zero(&self.cursor)?)
    }

    /// The cursor (the index of the next batch; `batches()` once the epoch is done). Waits
    /// for the stream.
    pub fn position(&self, s: &Stream) -> Result<u32> {
        Ok(s.to_vec(&self.cursor)?[0])
    }

    /// Number of batches per epoch.
    pub fn batches(&self) -> usize {
        self.batches
    }

    /// Rows per batch.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Copies the batch under the cursor (modulo the batch count) into `x` (`rows × features`)
    /// and `y` (`rows`), then advances the cursor — eagerly or as a graph node.
    pub fn load_next(
        &self,
        q: &dyn Queue,
        x: &DeviceBuffer<f32>,
        y: &DeviceBuffer<i32>,
    ) -> Result<()> {
        self.gather(q, x, y, None)
    }

    fn gather(
        &self,
        q: &dyn Queue,
        x: &DeviceBuffer<f32>,
        y: &DeviceBuffer<i32>,
        cond: Option<&DeviceBuffer<u32>>,
    ) -> Result<()> {
        StepKernels::get(q.device())?.gather_batch(
            q,
            &self.images,
            &self.labels,
            x,
            y,
            &self.cursor,
            cond,
            self.batches,
            self.rows,
            self.features,
        )
    }

    /// Captures up to `k` training steps per launch: a WHILE node whose body loads the next
    /// batch into `x`/`y` ([`Self::load_next`]) and runs `step`, while batches are left in the
    /// epoch and fewer than `k` steps ran in this launch. Returns what the last `step`
    /// returned (its buffers hold the last step's values after each replay). Rewind or
    /// [`Self::reload`] between epochs.
    pub fn train_steps<T>(
        &self,
        cs: &CaptureStream<'_>,
        k: u32,
        x: &DeviceBuffer<f32>,
        y: &DeviceBuffer<i32>,
        mut step: impl FnMut(&CaptureStream<'_>) -> Result<T>,
    ) -> Result<T> {
        let sk = StepKernels::get(cs.device())?;
        sk.batches_left(cs, &self.cursor, self.batches, &self.cond)?;
        let out = cs.while_loop_capped(&self.cond, k, |body| {
            // Loads the batch, advances the cursor and sets the condition (batches left) for
            // the next iteration; the step does not touch either.
            self.gather(body, x, y, Some(&self.cond))?;
            Ok(step(body)?)
        })?;
        Ok(out)
    }
}

/// Runs `opt.step` inside an IF node that is taken only when `loss` and every gradient of
/// `opt`'s parameters are finite (PyTorch's GradScaler skips such steps the same way, but reads
/// the flag on the host). Returns the flag: `1` after a replay that stepped, `0` after one that
/// skipped. Call it where the step would be, after `backward`.
pub fn step_if_finite<O: Optimizer + ?Sized>(
    cs: &CaptureStream<'_>,
    opt: &mut O,
    loss: &Tensor,
) -> Result<Arc<DeviceBuffer<u32>>> {
    let sk = StepKernels::get(cs.device())?;
    let flag = Arc::new(cs.alloc::<u32>(1)?);
    cs.fill32(&flag, 0, 1, 1u32)?;
    sk.check_finite(cs, loss.data()?, &flag)?;
    require_f32_params(
        opt.params(),
        "step_if_finite",
        "check the loss alone, or keep f32 parameters with 16-bit optimizer copies",
    )?;
    for p in opt.params() {
        if let Some(g) = p.grad()? {
            sk.check_finite(cs, &g, &flag)?;
        }
    }
    cs.if_then(&flag, |body| opt.step(body).map_err(cudagraph::Error::from))?;
    Ok(flag)
}
