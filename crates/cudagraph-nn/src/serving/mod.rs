//! Serving a model under concurrent load: a dynamic [`Batcher`] in front of one worker thread
//! that owns the model, and [`ModelRunner`], the worker's GPU side (a `Sequential` served
//! through a [`GraphCache`](cudagraph::GraphCache), or eagerly).
//!
//! Requests (rows of `f32`) from any number of threads are queued; the worker takes the first
//! waiting request, then collects more until the batch holds `max_batch_rows` rows or
//! `max_wait` has passed since that first request arrived (requests already queued by then
//! still join without waiting), runs the batch once, and answers each request with its own
//! rows. A request never splits across batches, and every accepted request is answered
//! exactly once — with its rows, or with the error its batch hit — also while shutting down:
//! [`Batcher::shutdown`] stops new requests, lets the worker drain the queue, and joins it.
//!
//! Nothing here knows about HTTP or async runtimes: answers go through a callback
//! ([`Reply`]), so a server sends them over its own channels. [`parse_rows`] (or
//! [`Batcher::parse_request`]) reads a request body `{"inputs": [[...], ...]}` straight into
//! one flat buffer, refusing it at the first value past the batcher's limits, so a server's
//! memory per request stays bounded by those limits.
//!
//! Language models: [`decoder::Decoder`] runs GPT-2 and Llama-family decoders from Hugging Face
//! folders on a KV cache built for graphs, and [`generation::Generation`] is the step-by-step
//! generation loop over it (sequences join and leave between steps; one captured decode step
//! per batch bucket).

mod batcher;
pub mod decoder;
pub mod generation;
mod parse;
mod runner;
#[cfg(test)]
mod tests;

use cudagraph::MemoryStats;
use serde::Serialize;

pub use batcher::{percentile, Batcher, BatcherConfig, MetricsSnapshot, SizeBucket};
pub use parse::{parse_rows, Rows};
pub use runner::ModelRunner;

/// Why a request was not answered with outputs.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The request has no rows.
    #[error("the request has no rows; send at least one row")]
    Empty,
    /// The request has more rows than one batch holds.
    #[error("the request has {rows} rows, but at most {max} rows fit in one batch; split it")]
    TooManyRows {
        /// Rows in the request.
        rows: usize,
        /// The largest batch size.
        max: usize,
    },
    /// A request body holds more rows than one batch: [`parse_rows`] stopped at the first row
    /// past the limit, without reading the rest.
    #[error(
        "the request has more than {max} rows, but at most {max} rows fit in one batch; split it"
    )]
    RowLimit {
        /// The largest batch size.
        max: usize,
    },
    /// The values do not form whole rows of the model's input width.
    #[error("row {row} has {got} values, but the model takes rows of {expected}")]
    RowWidth {
        /// The first row that does not fit (from 0).
        row: usize,
        /// The model's input width.
        expected: usize,
        /// Values found in that row.
        got: usize,
    },
    /// A row of a request body holds more values than the model's input width: [`parse_rows`]
    /// stopped at the first value past the width, without reading the rest.
    #[error("row {row} has more than {expected} values, but the model takes rows of {expected}")]
    RowTooLong {
        /// The row (from 0).
        row: usize,
        /// The model's input width.
        expected: usize,
    },
    /// The request body is not `{"inputs": [[...], ...]}` (empty, not JSON, another shape,
    /// a value that is not a number).
    #[error(
        "malformed request: {reason}; send {{\"inputs\": [[...], ...]}} with rows of {width} numbers"
    )]
    Malformed {
        /// What is wrong with the body.
        reason: String,
        /// The model's input width, for the hint.
        width: usize,
    },
    /// An input value is NaN or infinite.
    #[error("input row {row}, column {column} is {value}; only finite numbers are accepted")]
    NonFinite {
        /// The row (from 0).
        row: usize,
        /// The column within the row (from 0).
        column: usize,
        /// The value as text (`NaN`, `inf`, ...).
        value: String,
    },
    /// The queue is full (back-pressure): retry later.
    #[error("the server is at capacity ({capacity} requests queued); retry later")]
    Busy {
        /// The queue's capacity in requests.
        capacity: usize,
    },
    /// The batcher is shutting down and takes no new requests.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// Running the batch failed (the message is the model's error).
    #[error("the model failed on this batch: {0}")]
    Model(String),
    /// The worker stopped after a panic or a lost device; no request can be served any more.
    #[error("the model worker has stopped: {0}")]
    WorkerStopped(String),
}

impl ServeError {
    /// Whether the client's request was at fault (an HTTP 4xx), rather than the server.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            ServeError::Empty
                | ServeError::TooManyRows { .. }
                | ServeError::RowLimit { .. }
                | ServeError::RowWidth { .. }
                | ServeError::RowTooLong { .. }
                | ServeError::NonFinite { .. }
                | ServeError::Malformed { .. }
        )
    }
}

/// What running one batch produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BatchOutput {
    /// `rows * output_row` values.
    pub output: Vec<f32>,
    /// Rows computed only as padding (a graph of a larger batch size ran).
    pub padded_rows: usize,
    /// Whether a captured graph ran (false: eager execution).
    pub graphed: bool,
}

/// Device memory as the worker last saw it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemorySnapshot {
    /// Bytes handed out on the device (PyTorch's `memory_allocated`).
    pub allocated: usize,
    /// Bytes held from the driver (PyTorch's `memory_reserved`).
    pub reserved: usize,
    /// Most bytes handed out at once (PyTorch's `max_memory_allocated`).
    pub peak_allocated: usize,
    /// Bytes the graphs' shared pool reserves (0 when eager).
    pub graph_pool_reserved: usize,
}

impl From<&MemoryStats> for MemorySnapshot {
    fn from(s: &MemoryStats) -> Self {
        Self {
            allocated: s.allocated,
            reserved: s.reserved,
            peak_allocated: s.peak_allocated,
            graph_pool_reserved: 0,
        }
    }
}

/// The worker's side of serving: a model that maps rows to rows. It is moved to the worker
/// thread, which alone calls it.
pub trait BatchRunner: Send + 'static {
    /// Values per input row.
    fn input_row(&self) -> usize;
    /// Values per output row.
    fn output_row(&self) -> usize;
    /// Runs `rows` rows (`input.len() == rows * input_row()`, `1 <= rows <= max_batch_rows`).
    fn run(&mut self, input: &[f32], rows: usize) -> std::result::Result<BatchOutput, String>;
    /// Device memory now, if the runner has a device.
    fn memory(&self) -> Option<MemorySnapshot> {
        None
    }
    /// Whether an error from [`Self::run`] leaves the runner unusable (a lost device context).
    fn is_fatal(&self, _error: &str) -> bool {
        false
    }
}

/// Answers a request: its output rows, or why there are none. Called exactly once, from the
/// worker thread (or from [`Batcher::submit`]'s caller when the request is refused up front).
pub type Reply = Box<dyn FnOnce(std::result::Result<Vec<f32>, ServeError>) + Send>;
