//! [`ModelRunner`]: the worker's GPU side — a [`Sequential`] served through a [`GraphCache`]
//! (one graph per batch bucket) or eagerly.

use cudagraph::{
    BatchModel, BucketPolicy, CacheOptions, Device, GraphCache, Queue, Served, Stream,
};

use super::{BatchOutput, BatchRunner, MemorySnapshot};
use crate::dtype::Dtype;
use crate::error::Result;
use crate::nn::autocast::AutocastModule;
use crate::nn::batched::Batched;
use crate::nn::layers::Sequential;

/// What a [`ModelRunner`] serves: the model, in the precision it was asked for.
pub type RunnerModel = Batched<AutocastModule<Sequential>>;

/// The GPU side of serving a [`Sequential`]: rows are copied to the device, run through a
/// [`GraphCache`] (one graph per batch bucket, padded to the next bucket) or eagerly, and
/// copied back. Owns its stream; build it, then move it into a [`Batcher`](super::Batcher).
pub struct ModelRunner {
    stream: Stream,
    device: Device,
    mode: Mode,
    input_row: usize,
    output_row: usize,
}

enum Mode {
    Graph(Box<GraphCache<RunnerModel>>),
    Eager(RunnerModel),
}

impl ModelRunner {
    /// Serves `model` (rows of shape `row_shape`, `output_row` values out) on `stream`.
    /// `buckets` = `Some(policy)` captures one graph per batch size of the policy up front
    /// (largest first, one shared pool) and serves each bucket the faster way, graph or eager,
    /// as measured once ([`cudagraph::Selection::Measure`]); `None` runs every batch eagerly.
    pub fn new(
        stream: Stream,
        model: Sequential,
        row_shape: Vec<usize>,
        output_row: usize,
        buckets: Option<BucketPolicy>,
    ) -> Result<Self> {
        let options = CacheOptions {
            selection: cudagraph::Selection::Measure,
            ..CacheOptions::default()
        };
        Self::with_cache_options(stream, model, row_shape, output_row, buckets, options)
    }

    /// As [`Self::new`], with the graph cache's options (`Selection::Graph` serves every
    /// bucket by its graph; `lazy` captures a bucket on its first batch).
    pub fn with_cache_options(
        stream: Stream,
        model: Sequential,
        row_shape: Vec<usize>,
        output_row: usize,
        buckets: Option<BucketPolicy>,
        options: CacheOptions,
    ) -> Result<Self> {
        Self::with_dtype(
            stream,
            model,
            (row_shape, output_row),
            buckets,
            options,
            Dtype::F32,
        )
    }

    /// As [`Self::with_cache_options`], with the products and convolutions in `dtype`: bf16
    /// or f16 run the model under autocast with 16-bit copies of its weights made once
    /// ([`AutocastModule`]); inputs and outputs stay f32.
    pub fn with_dtype(
        mut stream: Stream,
        model: Sequential,
        (row_shape, output_row): (Vec<usize>, usize),
        buckets: Option<BucketPolicy>,
        options: CacheOptions,
        dtype: Dtype,
    ) -> Result<Self> {
        let device = stream.device().clone();
        let batched = Batched {
            module: AutocastModule::new(&stream, model, dtype)?,
            row_shape,
            output_row,
        };
        let input_row = batched.input_row();
        let mode = match buckets {
            Some(policy) => Mode::Graph(Box::new(GraphCache::new(
                &mut stream,
                batched,
                policy,
                options,
            )?)),
            None => Mode::Eager(batched),
        };
        stream.synchronize()?;
        Ok(Self {
            stream,
            device,
            mode,
            input_row,
            output_row,
        })
    }

    /// Runs `rows` rows once, on the host's data, returning the outputs (waits for the stream).
    /// `input` holds exactly `rows * input_row` values (`rows >= 1`); anything else is refused
    /// with [`cudagraph::Error::SizeMismatch`] before anything runs (a graph would otherwise
    /// read a prefix of a longer input as rows of the wrong width).
    pub fn run_rows(&mut self, input: &[f32], rows: usize) -> Result<BatchOutput> {
        if rows == 0 {
            return Err(cudagraph::Error::SizeMismatch {
                what: "ModelRunner::run_rows rows (a batch needs at least one row)",
                expected: 1,
                got: 0,
            }
            .into());
        }
        let expected = rows.saturating_mul(self.input_row);
        if input.len() != expected {
            return Err(cudagraph::Error::SizeMismatch {
                what: "ModelRunner::run_rows input (rows × input row values)",
                expected,
                got: input.len(),
            }
            .into());
        }
        let x = self.stream.alloc_from_host(input)?;
        let (y, padded_rows, graphed) = match &mut self.mode {
            Mode::Graph(cache) => {
                let (y, served) = cache.run(&mut self.stream, &x, rows)?;
                match served {
                    Served::Exact { .. } => (y, 0, true),
                    Served::Padded { padded_rows, .. } => (y, padded_rows, true),
                    Served::Fallback | Served::Eager { .. } => (y, 0, false),
                }
            }
            Mode::Eager(model) => (model.forward(&self.stream, &x, rows)?, 0, false),
        };
        let output = self.stream.to_vec(&y)?;
        Ok(BatchOutput {
            output,
            padded_rows,
            graphed,
        })
    }

    /// The graph cache, when serving graphs.
    pub fn cache(&self) -> Option<&GraphCache<RunnerModel>> {
        match &self.mode {
            Mode::Graph(c) => Some(c),
            Mode::Eager(_) => None,
        }
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl BatchRunner for ModelRunner {
    fn input_row(&self) -> usize {
        self.input_row
    }

    fn output_row(&self) -> usize {
        self.output_row
    }

    fn run(&mut self, input: &[f32], rows: usize) -> std::result::Result<BatchOutput, String> {
        self.run_rows(input, rows).map_err(|e| e.to_string())
    }

    fn memory(&self) -> Option<MemorySnapshot> {
        let mut m = MemorySnapshot::from(&self.device.memory_stats());
        if let Mode::Graph(c) = &self.mode {
            m.graph_pool_reserved = c.pool().stats().reserved;
        }
        Some(m)
    }

    fn is_fatal(&self, error: &str) -> bool {
        // `Error::ContextLost`'s message: the context cannot run anything any more.
        error.contains("CUDA context of this device is lost")
    }
}
