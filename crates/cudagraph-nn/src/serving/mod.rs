//! Serving a model under concurrent load: a dynamic [`Batcher`] in front of one worker thread
//! that owns the model, and [`ModelRunner`], the worker's GPU side (a `Sequential` served
//! through a [`GraphCache`], or eagerly).
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

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudagraph::{
    BatchModel, BucketPolicy, CacheOptions, Device, GraphCache, MemoryStats, Queue, Served, Stream,
};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::nn::batched::Batched;
use crate::nn::layers::Sequential;

/// Why a request was not answered with outputs.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The request has no rows.
    #[error("the request has no rows; send at least one row")]
    Empty,
    /// The request has more rows than one batch holds.
    #[error("the request has {rows} rows, but at most {max} rows fit in one batch; split it")]
    TooManyRows { rows: usize, max: usize },
    /// A request body holds more rows than one batch: [`parse_rows`] stopped at the first row
    /// past the limit, without reading the rest.
    #[error(
        "the request has more than {max} rows, but at most {max} rows fit in one batch; split it"
    )]
    RowLimit { max: usize },
    /// The values do not form whole rows of the model's input width.
    #[error("row {row} has {got} values, but the model takes rows of {expected}")]
    RowWidth {
        row: usize,
        expected: usize,
        got: usize,
    },
    /// A row of a request body holds more values than the model's input width: [`parse_rows`]
    /// stopped at the first value past the width, without reading the rest.
    #[error("row {row} has more than {expected} values, but the model takes rows of {expected}")]
    RowTooLong { row: usize, expected: usize },
    /// The request body is not `{"inputs": [[...], ...]}` (empty, not JSON, another shape,
    /// a value that is not a number).
    #[error(
        "malformed request: {reason}; send {{\"inputs\": [[...], ...]}} with rows of {width} numbers"
    )]
    Malformed { reason: String, width: usize },
    /// An input value is NaN or infinite.
    #[error("input row {row}, column {column} is {value}; only finite numbers are accepted")]
    NonFinite {
        row: usize,
        column: usize,
        value: String,
    },
    /// The queue is full (back-pressure): retry later.
    #[error("the server is at capacity ({capacity} requests queued); retry later")]
    Busy { capacity: usize },
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

/// How the batcher collects requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatcherConfig {
    /// Rows in the largest batch (and so the largest request).
    pub max_batch_rows: usize,
    /// How long the first request of a batch waits for others.
    pub max_wait: Duration,
    /// Requests that may wait in the queue; more are refused with [`ServeError::Busy`].
    pub queue_capacity: usize,
}

impl Default for BatcherConfig {
    fn default() -> Self {
        Self {
            max_batch_rows: 256,
            max_wait: Duration::from_micros(500),
            queue_capacity: 4096,
        }
    }
}

struct Job {
    input: Vec<f32>,
    rows: usize,
    reply: Reply,
    arrived: Instant,
}

/// Latency samples kept for percentiles (the most recent ones).
const LATENCY_WINDOW: usize = 1 << 16;

#[derive(Default)]
struct MetricsState {
    requests: u64,
    rows: u64,
    errors: u64,
    batches: u64,
    graphed_batches: u64,
    padded_rows: u64,
    /// Batches by size class: index `i` counts batches of `2^(i-1) < rows <= 2^i` rows.
    batch_rows: Vec<u64>,
    latencies_us: VecDeque<f64>,
    max_latency_us: f64,
    memory: Option<MemorySnapshot>,
    memory_at_start: Option<MemorySnapshot>,
}

/// One bucket of the batch-size histogram.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SizeBucket {
    /// Batches in this bucket have at most this many rows (and more than the previous bucket's).
    pub le: usize,
    pub batches: u64,
}

/// Counters of a batcher, as `/metrics` shows them.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MetricsSnapshot {
    /// Requests answered with outputs.
    pub requests: u64,
    /// Rows answered.
    pub rows: u64,
    /// Requests answered with an error by the worker (model failures).
    pub errors: u64,
    pub batches: u64,
    pub graphed_batches: u64,
    pub eager_batches: u64,
    /// Rows computed only as padding, and their share of all computed rows.
    pub padded_rows: u64,
    pub padding_fraction: f64,
    /// Average rows per batch.
    pub mean_batch_rows: f64,
    pub batch_size_histogram: Vec<SizeBucket>,
    /// Latency from `submit` to the answer, over the last 65536 requests, in microseconds.
    pub latency_p50_us: f64,
    pub latency_p95_us: f64,
    pub latency_p99_us: f64,
    pub latency_max_us: f64,
    /// Requests waiting in the queue now.
    pub queued: usize,
    /// Device memory after the first batch and after the latest one.
    pub memory_at_start: Option<MemorySnapshot>,
    pub memory: Option<MemorySnapshot>,
}

/// The `q`-quantile of sorted samples (nearest rank), 0 when there are none.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn size_class(rows: usize) -> usize {
    rows.next_power_of_two().trailing_zeros() as usize
}

struct Shared {
    metrics: Mutex<MetricsState>,
    queued: std::sync::atomic::AtomicUsize,
    stopped: Mutex<Option<String>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Collects concurrent requests into batches for one worker thread that owns a
/// [`BatchRunner`]. `Send + Sync`: share it (`Arc`) between request handlers.
pub struct Batcher {
    tx: Mutex<Option<SyncSender<Job>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    shared: Arc<Shared>,
    closing: AtomicBool,
    input_row: usize,
    output_row: usize,
    config: BatcherConfig,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Batcher({} -> {} per row, {:?})",
            self.input_row, self.output_row, self.config
        )
    }
}

impl Batcher {
    /// Moves `runner` to a new worker thread and starts collecting requests.
    pub fn start<R: BatchRunner>(runner: R, config: BatcherConfig) -> std::io::Result<Batcher> {
        let (input_row, output_row) = (runner.input_row(), runner.output_row());
        let config = BatcherConfig {
            max_batch_rows: config.max_batch_rows.max(1),
            queue_capacity: config.queue_capacity.max(1),
            ..config
        };
        let (tx, rx) = mpsc::sync_channel(config.queue_capacity);
        let shared = Arc::new(Shared {
            metrics: Mutex::new(MetricsState {
                batch_rows: vec![0; size_class(config.max_batch_rows) + 1],
                ..Default::default()
            }),
            queued: Default::default(),
            stopped: Mutex::new(None),
        });
        let worker = {
            let shared = shared.clone();
            let config = config.clone();
            std::thread::Builder::new()
                .name("cudagraph-serve-worker".into())
                .spawn(move || worker_loop(runner, rx, &shared, &config))?
        };
        Ok(Batcher {
            tx: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
            shared,
            closing: AtomicBool::new(false),
            input_row,
            output_row,
            config,
        })
    }

    pub fn input_row(&self) -> usize {
        self.input_row
    }

    pub fn output_row(&self) -> usize {
        self.output_row
    }

    pub fn config(&self) -> &BatcherConfig {
        &self.config
    }

    /// Parses a request body for this batcher's model: [`parse_rows`] with the model's input
    /// width and [`BatcherConfig::max_batch_rows`].
    pub fn parse_request(&self, body: &[u8]) -> std::result::Result<Rows, ServeError> {
        parse_rows(body, self.input_row, self.config.max_batch_rows)
    }

    /// Checks a request without queueing it: rows, width and finiteness.
    pub fn validate(&self, input: &[f32], rows: usize) -> std::result::Result<(), ServeError> {
        if rows == 0 {
            return Err(ServeError::Empty);
        }
        if rows > self.config.max_batch_rows {
            return Err(ServeError::TooManyRows {
                rows,
                max: self.config.max_batch_rows,
            });
        }
        if rows.checked_mul(self.input_row) != Some(input.len()) {
            return Err(ServeError::RowWidth {
                row: 0,
                expected: self.input_row,
                got: input.len() / rows,
            });
        }
        if let Some(i) = input.iter().position(|v| !v.is_finite()) {
            return Err(ServeError::NonFinite {
                row: i / self.input_row.max(1),
                column: i % self.input_row.max(1),
                value: input[i].to_string(),
            });
        }
        Ok(())
    }

    /// Queues `rows` rows (`input` holds `rows * input_row()` values, row-major). `reply` is
    /// called exactly once: with the rows' outputs, or with the reason there are none —
    /// right here when the request is refused (invalid, queue full, shutting down).
    pub fn submit(&self, input: Vec<f32>, rows: usize, reply: Reply) {
        if let Err(e) = self.validate(&input, rows) {
            return reply(Err(e));
        }
        if let Some(why) = lock(&self.shared.stopped).clone() {
            return reply(Err(ServeError::WorkerStopped(why)));
        }
        let job = Job {
            input,
            rows,
            reply,
            arrived: Instant::now(),
        };
        let tx = lock(&self.tx).clone();
        let Some(tx) = tx else {
            return (job.reply)(Err(ServeError::ShuttingDown));
        };
        self.shared.queued.fetch_add(1, Ordering::Relaxed);
        match tx.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(job)) => {
                self.shared.queued.fetch_sub(1, Ordering::Relaxed);
                (job.reply)(Err(ServeError::Busy {
                    capacity: self.config.queue_capacity,
                }))
            }
            Err(TrySendError::Disconnected(job)) => {
                self.shared.queued.fetch_sub(1, Ordering::Relaxed);
                let why = lock(&self.shared.stopped)
                    .clone()
                    .unwrap_or_else(|| "the worker exited".into());
                (job.reply)(Err(ServeError::WorkerStopped(why)))
            }
        }
    }

    /// The counters now.
    pub fn metrics(&self) -> MetricsSnapshot {
        let m = lock(&self.shared.metrics);
        let mut lat: Vec<f64> = m.latencies_us.iter().copied().collect();
        lat.sort_by(f64::total_cmp);
        let computed = m.rows + m.padded_rows;
        MetricsSnapshot {
            requests: m.requests,
            rows: m.rows,
            errors: m.errors,
            batches: m.batches,
            graphed_batches: m.graphed_batches,
            eager_batches: m.batches - m.graphed_batches,
            padded_rows: m.padded_rows,
            padding_fraction: m.padded_rows as f64 / computed.max(1) as f64,
            mean_batch_rows: m.rows as f64 / m.batches.max(1) as f64,
            batch_size_histogram: m
                .batch_rows
                .iter()
                .enumerate()
                .map(|(i, &n)| SizeBucket {
                    le: (1usize << i).min(self.config.max_batch_rows),
                    batches: n,
                })
                .collect(),
            latency_p50_us: percentile(&lat, 0.50),
            latency_p95_us: percentile(&lat, 0.95),
            latency_p99_us: percentile(&lat, 0.99),
            latency_max_us: m.max_latency_us,
            queued: self.shared.queued.load(Ordering::Relaxed),
            memory_at_start: m.memory_at_start,
            memory: m.memory,
        }
    }

    /// Whether the worker is running and accepting requests.
    pub fn is_healthy(&self) -> bool {
        !self.closing.load(Ordering::Acquire) && lock(&self.shared.stopped).is_none()
    }

    /// Why the worker stopped, if it did (a panic or a lost device).
    pub fn stopped_because(&self) -> Option<String> {
        lock(&self.shared.stopped).clone()
    }

    /// Stops taking requests, answers every queued one, and waits for the worker to exit.
    /// Idempotent; also run on drop.
    pub fn shutdown(&self) {
        self.closing.store(true, Ordering::Release);
        drop(lock(&self.tx).take());
        if let Some(w) = lock(&self.worker).take() {
            // The worker catches panics of the runner; a panic elsewhere has already answered
            // what it could.
            let _ = w.join();
        }
    }
}

impl Drop for Batcher {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A request's rows, parsed from its body: `rows * width` values, row after row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rows {
    /// The values, row-major.
    pub values: Vec<f32>,
    /// Number of rows.
    pub rows: usize,
}

/// Longest `reason` a [`ServeError::Malformed`] repeats from the parser (a message may quote
/// the client's input, which can be as long as the body).
const REASON_CHARS: usize = 200;

/// Parses a request body `{"inputs": [[...], ...]}` (rows of `width` numbers, at most
/// `max_rows` rows) straight into one flat `Vec<f32>`, checking as it reads.
///
/// Memory stays bounded by the limits, not by what the client sends: values go into a single
/// buffer sized once (at most `width * max_rows` values, and never more than the body could
/// spell), and parsing stops at the first value that breaks a limit without reading the rest
/// of the body:
/// - a row with more than `width` values: [`ServeError::RowTooLong`] (fewer:
///   [`ServeError::RowWidth`]);
/// - a row past `max_rows`: [`ServeError::RowLimit`];
/// - a number outside `f32`'s range: [`ServeError::NonFinite`] (JSON has no NaN or infinity,
///   so `NaN` is malformed);
/// - no rows: [`ServeError::Empty`];
/// - anything else (an empty body, not JSON, another shape, unknown or repeated fields, a
///   value that is not a number, text after the object): [`ServeError::Malformed`], whose
///   reason says what and where.
///
/// ```
/// use cudagraph_nn::serving::{parse_rows, ServeError};
/// let r = parse_rows(br#"{"inputs": [[1, 2], [3.5, -4]]}"#, 2, 8).unwrap();
/// assert_eq!((r.rows, r.values), (2, vec![1.0, 2.0, 3.5, -4.0]));
/// // Stops at the third value of row 0: the rest is never read.
/// let e = parse_rows(br#"{"inputs": [[1, 2, 3, this is not JSON"#, 2, 8).unwrap_err();
/// assert_eq!(e, ServeError::RowTooLong { row: 0, expected: 2 });
/// ```
pub fn parse_rows(body: &[u8], width: usize, max_rows: usize) -> Result<Rows, ServeError> {
    let malformed = |reason: String| ServeError::Malformed {
        reason: truncate(reason),
        width,
    };
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(malformed("empty body".into()));
    }
    // A value takes at least two bytes of the body (a digit and a separator).
    let capacity = width.saturating_mul(max_rows).min(body.len() / 2 + 1);
    let mut st = ParseState {
        width,
        max_rows,
        values: Vec::with_capacity(capacity),
        rows: 0,
        fault: None,
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed = BodySeed(&mut st)
        .deserialize(&mut de)
        .and_then(|()| de.end());
    match parsed {
        Ok(()) if st.rows == 0 => Err(ServeError::Empty),
        Ok(()) => Ok(Rows {
            values: st.values,
            rows: st.rows,
        }),
        // A limit the visitors hit is kept typed; serde's error only carried it out.
        Err(e) => Err(st.fault.take().unwrap_or_else(|| malformed(e.to_string()))),
    }
}

fn truncate(mut s: String) -> String {
    if let Some((i, _)) = s.char_indices().nth(REASON_CHARS) {
        s.truncate(i);
        s.push('…');
    }
    s
}

struct ParseState {
    width: usize,
    max_rows: usize,
    values: Vec<f32>,
    rows: usize,
    fault: Option<ServeError>,
}

impl ParseState {
    /// Records why parsing stops; the returned error only unwinds the deserializer.
    fn fail<E: de::Error>(&mut self, why: ServeError) -> E {
        let e = E::custom(&why);
        self.fault = Some(why);
        e
    }
}

/// The body: an object whose only field is `inputs`.
struct BodySeed<'a>(&'a mut ParseState);

impl<'de> DeserializeSeed<'de> for BodySeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BodySeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an object {\"inputs\": [[...], ...]}")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        let mut seen = false;
        while let Some(InputsField) = map.next_key()? {
            if seen {
                return Err(de::Error::duplicate_field("inputs"));
            }
            seen = true;
            map.next_value_seed(RowsSeed(&mut *self.0))?;
        }
        if !seen {
            return Err(de::Error::missing_field("inputs"));
        }
        Ok(())
    }
}

/// The key `inputs`; any other is refused before its value is read.
struct InputsField;

impl<'de> Deserialize<'de> for InputsField {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_identifier(InputsField)
    }
}

impl Visitor<'_> for InputsField {
    type Value = InputsField;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("the field `inputs`")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<InputsField, E> {
        match v {
            "inputs" => Ok(InputsField),
            other => Err(E::unknown_field(other, &["inputs"])),
        }
    }
}

/// `inputs`: an array of at most `max_rows` rows.
struct RowsSeed<'a>(&'a mut ParseState);

impl<'de> DeserializeSeed<'de> for RowsSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for RowsSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an array of rows")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        let st = self.0;
        loop {
            if st.rows == st.max_rows {
                // Another row is one too many: refuse it before reading it.
                let max = st.max_rows;
                seq.next_element_seed(Refuse(&mut *st, ServeError::RowLimit { max }))?;
                return Ok(());
            }
            match seq.next_element_seed(RowSeed(&mut *st))? {
                Some(()) => st.rows += 1,
                None => return Ok(()),
            }
        }
    }
}

/// One row: exactly `width` numbers, each finite as an `f32`.
struct RowSeed<'a>(&'a mut ParseState);

impl<'de> DeserializeSeed<'de> for RowSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for RowSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "a row of {} numbers", self.0.width)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        let st = self.0;
        let (row, width) = (st.rows, st.width);
        let mut got = 0;
        loop {
            if got == width {
                // A value past the width: refuse it before reading it.
                let too_long = ServeError::RowTooLong {
                    row,
                    expected: width,
                };
                seq.next_element_seed(Refuse(&mut *st, too_long))?;
                return Ok(());
            }
            let Some(v) = seq.next_element::<f64>()? else {
                let short = ServeError::RowWidth {
                    row,
                    expected: width,
                    got,
                };
                return Err(st.fail(short));
            };
            let x = v as f32;
            if !x.is_finite() {
                // JSON numbers are finite; this one is beyond f32's range.
                let value = format!("{v:e} (beyond f32's range)");
                return Err(st.fail(ServeError::NonFinite {
                    row,
                    column: got,
                    value,
                }));
            }
            st.values.push(x);
            got += 1;
        }
    }
}

/// An element that must not be there: fails without reading it.
struct Refuse<'a>(&'a mut ParseState, ServeError);

impl<'de> DeserializeSeed<'de> for Refuse<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, _: D) -> std::result::Result<(), D::Error> {
        Err(self.0.fail(self.1))
    }
}

fn worker_loop<R: BatchRunner>(
    mut runner: R,
    rx: Receiver<Job>,
    shared: &Shared,
    config: &BatcherConfig,
) {
    let (irow, orow) = (runner.input_row(), runner.output_row());
    let mut pending: Option<Job> = None;
    let mut input: Vec<f32> = Vec::new();
    loop {
        let first = match pending.take() {
            Some(j) => j,
            None => match rx.recv() {
                Ok(j) => j,
                Err(_) => return, // every sender is gone and the queue is empty
            },
        };
        let deadline = first.arrived + config.max_wait;
        let mut rows = first.rows;
        let mut batch = vec![first];
        while rows < config.max_batch_rows {
            let now = Instant::now();
            let next = if now >= deadline {
                // Past the deadline: take what is already queued, wait for nothing.
                rx.try_recv().ok()
            } else {
                // A timeout or a closed queue both end the batch.
                rx.recv_timeout(deadline - now).ok()
            };
            let Some(j) = next else { break };
            if rows + j.rows > config.max_batch_rows {
                pending = Some(j);
                break;
            }
            rows += j.rows;
            batch.push(j);
        }
        shared.queued.fetch_sub(batch.len(), Ordering::Relaxed);
        // A worker that stopped answers everything with the reason.
        if let Some(why) = lock(&shared.stopped).clone() {
            for j in batch {
                (j.reply)(Err(ServeError::WorkerStopped(why.clone())));
            }
            continue;
        }
        input.clear();
        for j in &batch {
            input.extend_from_slice(&j.input);
        }
        debug_assert_eq!(input.len(), rows * irow);
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| runner.run(&input, rows)));
        let result = match result {
            Ok(Ok(out)) if out.output.len() == rows * orow => Ok(out),
            Ok(Ok(out)) => Err((
                format!(
                    "the model returned {} values for {rows} rows of {orow}",
                    out.output.len()
                ),
                false,
            )),
            Ok(Err(e)) => {
                let fatal = runner.is_fatal(&e);
                Err((e, fatal))
            }
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                Err((format!("the model panicked: {msg}"), true))
            }
        };
        let memory = runner.memory();
        let now = Instant::now();
        let mut m = lock(&shared.metrics);
        match result {
            Ok(out) => {
                m.batches += 1;
                m.graphed_batches += out.graphed as u64;
                m.padded_rows += out.padded_rows as u64;
                m.rows += rows as u64;
                m.requests += batch.len() as u64;
                let class = size_class(rows).min(m.batch_rows.len() - 1);
                m.batch_rows[class] += 1;
                if m.memory_at_start.is_none() {
                    m.memory_at_start = memory;
                }
                m.memory = memory;
                let mut offset = 0;
                let mut replies = Vec::with_capacity(batch.len());
                for j in batch {
                    let n = j.rows * orow;
                    let rows_out = out.output[offset..offset + n].to_vec();
                    offset += n;
                    let us = now.duration_since(j.arrived).as_secs_f64() * 1e6;
                    if m.latencies_us.len() == LATENCY_WINDOW {
                        m.latencies_us.pop_front();
                    }
                    m.latencies_us.push_back(us);
                    m.max_latency_us = m.max_latency_us.max(us);
                    replies.push((j.reply, rows_out));
                }
                drop(m);
                for (reply, rows_out) in replies {
                    reply(Ok(rows_out));
                }
            }
            Err((e, fatal)) => {
                m.errors += batch.len() as u64;
                m.memory = memory;
                drop(m);
                if fatal {
                    *lock(&shared.stopped) = Some(e.clone());
                }
                for j in batch {
                    (j.reply)(Err(ServeError::Model(e.clone())));
                }
            }
        }
    }
}

/// The GPU side of serving a [`Sequential`]: rows are copied to the device, run through a
/// [`GraphCache`] (one graph per batch bucket, padded to the next bucket) or eagerly, and
/// copied back. Owns its stream; build it, then move it into a [`Batcher`].
pub struct ModelRunner {
    stream: Stream,
    device: Device,
    mode: Mode,
    input_row: usize,
    output_row: usize,
}

enum Mode {
    Graph(Box<GraphCache<Batched<Sequential>>>),
    Eager(Batched<Sequential>),
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
        mut stream: Stream,
        model: Sequential,
        row_shape: Vec<usize>,
        output_row: usize,
        buckets: Option<BucketPolicy>,
        options: CacheOptions,
    ) -> Result<Self> {
        let device = stream.device().clone();
        let batched = Batched {
            module: model,
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
    pub fn cache(&self) -> Option<&GraphCache<Batched<Sequential>>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    /// Output row = [sum of the row, number of rows in the batch].
    struct Sum {
        width: usize,
        batches: Arc<Mutex<Vec<usize>>>,
        fail_on: Option<f32>,
        delay: Duration,
    }

    impl BatchRunner for Sum {
        fn input_row(&self) -> usize {
            self.width
        }
        fn output_row(&self) -> usize {
            2
        }
        fn run(&mut self, input: &[f32], rows: usize) -> std::result::Result<BatchOutput, String> {
            std::thread::sleep(self.delay);
            if self.fail_on.is_some_and(|f| input.contains(&f)) {
                return Err("bad value".into());
            }
            if input.contains(&-999.0) {
                panic!("boom");
            }
            lock(&self.batches).push(rows);
            Ok(BatchOutput {
                output: input
                    .chunks(self.width)
                    .flat_map(|r| [r.iter().sum::<f32>(), rows as f32])
                    .collect(),
                padded_rows: rows.next_power_of_two() - rows,
                graphed: true,
            })
        }
    }

    fn sum_batcher(
        cfg: BatcherConfig,
        delay: Duration,
        fail_on: Option<f32>,
    ) -> (Batcher, Arc<Mutex<Vec<usize>>>) {
        let batches = Arc::new(Mutex::new(Vec::new()));
        let r = Sum {
            width: 3,
            batches: batches.clone(),
            fail_on,
            delay,
        };
        (Batcher::start(r, cfg).unwrap(), batches)
    }

    type Answer = std::result::Result<Vec<f32>, ServeError>;

    fn submit(b: &Batcher, rows: usize, base: f32) -> Receiver<Answer> {
        let (tx, rx) = channel();
        let input: Vec<f32> = (0..rows * 3).map(|i| base + i as f32).collect();
        b.submit(
            input,
            rows,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx
    }

    #[test]
    fn concurrent_requests_are_batched_and_each_gets_its_rows() {
        let cfg = BatcherConfig {
            max_batch_rows: 16,
            max_wait: Duration::from_millis(50),
            queue_capacity: 1000,
        };
        let (b, batches) = sum_batcher(cfg, Duration::ZERO, None);
        let b = Arc::new(b);
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let b = b.clone();
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    for k in 0..25 {
                        let rows = 1 + (t * 7 + k) % 5;
                        // Disjoint values per request (at most 15 from each base), so every
                        // row of every request has its own sum: a row answered from another
                        // request, or from a stale batch, cannot match.
                        let base = ((t * 25 + k) * 100) as f32;
                        let rx = submit(&b, rows, base);
                        got.push((rows, base, rx));
                    }
                    for (rows, base, rx) in got {
                        let out = rx.recv().expect("answered").expect("served");
                        assert_eq!(out.len(), rows * 2);
                        for r in 0..rows {
                            let start = base + (r * 3) as f32;
                            assert_eq!(out[r * 2], 3.0 * start + 3.0, "row {r} is this request's");
                            assert!(out[r * 2 + 1] >= rows as f32, "ran in a batch that held it");
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let m = b.metrics();
        assert_eq!(m.requests, 200);
        let sizes = lock(&batches).clone();
        assert!(sizes.iter().all(|&s| s <= 16), "{sizes:?}");
        assert!(
            sizes.len() < 200,
            "requests were batched together ({} batches)",
            sizes.len()
        );
        assert_eq!(m.rows, sizes.iter().sum::<usize>() as u64);
        assert_eq!(
            m.batch_size_histogram
                .iter()
                .map(|b| b.batches)
                .sum::<u64>(),
            m.batches
        );
        assert!(m.latency_p50_us > 0.0 && m.latency_p99_us >= m.latency_p50_us);
        assert!(m.padded_rows > 0 && m.padding_fraction > 0.0);
    }

    #[test]
    fn a_lone_request_waits_at_most_max_wait() {
        let cfg = BatcherConfig {
            max_batch_rows: 64,
            max_wait: Duration::from_millis(20),
            queue_capacity: 10,
        };
        let (b, _) = sum_batcher(cfg, Duration::ZERO, None);
        let t0 = Instant::now();
        let out = submit(&b, 2, 0.0).recv().unwrap().unwrap();
        let waited = t0.elapsed();
        assert_eq!(out, vec![3.0, 2.0, 12.0, 2.0]);
        assert!(waited >= Duration::from_millis(20), "{waited:?}");
        assert!(waited < Duration::from_secs(2), "{waited:?}");
    }

    #[test]
    fn a_full_batch_runs_without_waiting() {
        let cfg = BatcherConfig {
            max_batch_rows: 4,
            max_wait: Duration::from_secs(30),
            queue_capacity: 10,
        };
        let (b, batches) = sum_batcher(cfg, Duration::ZERO, None);
        let t0 = Instant::now();
        let rx = submit(&b, 4, 0.0);
        rx.recv().unwrap().unwrap();
        assert!(t0.elapsed() < Duration::from_secs(10));
        assert_eq!(*lock(&batches), vec![4]);
    }

    #[test]
    fn invalid_requests_are_refused_with_typed_errors() {
        let (b, _) = sum_batcher(BatcherConfig::default(), Duration::ZERO, None);
        let refuse = |input: Vec<f32>, rows: usize| {
            let (tx, rx) = channel();
            b.submit(input, rows, Box::new(move |r| tx.send(r).unwrap()));
            rx.recv().unwrap().unwrap_err()
        };
        assert_eq!(refuse(vec![], 0), ServeError::Empty);
        assert!(matches!(
            refuse(vec![0.0; 3 * 257], 257),
            ServeError::TooManyRows {
                rows: 257,
                max: 256
            }
        ));
        assert!(matches!(
            refuse(vec![0.0; 4], 1),
            ServeError::RowWidth { expected: 3, .. }
        ));
        let e = refuse(vec![0.0, 1.0, 2.0, 3.0, f32::NAN, 5.0], 2);
        assert_eq!(
            e,
            ServeError::NonFinite {
                row: 1,
                column: 1,
                value: "NaN".into()
            }
        );
        assert!(e.is_client_error());
        // Still serving.
        assert!(submit(&b, 1, 1.0).recv().unwrap().is_ok());
    }

    #[test]
    fn model_errors_reach_every_request_of_the_batch_and_serving_goes_on() {
        let cfg = BatcherConfig {
            max_batch_rows: 8,
            max_wait: Duration::from_millis(1),
            queue_capacity: 100,
        };
        let (b, _) = sum_batcher(cfg, Duration::ZERO, Some(1000.0));
        let bad = submit(&b, 1, 1000.0).recv().unwrap();
        assert!(matches!(bad, Err(ServeError::Model(ref m)) if m.contains("bad value")));
        assert!(submit(&b, 2, 0.0).recv().unwrap().is_ok());
        assert_eq!(b.metrics().errors, 1);
        assert!(b.is_healthy());
    }

    #[test]
    fn a_panicking_model_stops_the_worker_but_every_request_is_answered() {
        let (b, _) = sum_batcher(BatcherConfig::default(), Duration::ZERO, None);
        let (tx, rx) = channel();
        b.submit(
            vec![-999.0, 0.0, 0.0],
            1,
            Box::new(move |r| tx.send(r).unwrap()),
        );
        assert!(matches!(rx.recv().unwrap(), Err(ServeError::Model(m)) if m.contains("panicked")));
        assert!(!b.is_healthy());
        assert!(matches!(
            submit(&b, 1, 0.0).recv().unwrap(),
            Err(ServeError::WorkerStopped(_))
        ));
    }

    #[test]
    fn shutdown_answers_queued_requests_then_refuses_new_ones() {
        let cfg = BatcherConfig {
            max_batch_rows: 2,
            max_wait: Duration::from_millis(1),
            queue_capacity: 100,
        };
        let (b, _) = sum_batcher(cfg, Duration::from_millis(5), None);
        let pending: Vec<_> = (0..20).map(|i| submit(&b, 1, i as f32)).collect();
        b.shutdown();
        for rx in pending {
            assert!(rx.recv().unwrap().is_ok(), "queued work is answered");
        }
        assert_eq!(
            submit(&b, 1, 0.0).recv().unwrap(),
            Err(ServeError::ShuttingDown)
        );
        assert!(!b.is_healthy());
    }

    #[test]
    fn a_full_queue_pushes_back() {
        let cfg = BatcherConfig {
            max_batch_rows: 1,
            max_wait: Duration::ZERO,
            queue_capacity: 2,
        };
        let (b, _) = sum_batcher(cfg, Duration::from_millis(50), None);
        let rxs: Vec<_> = (0..10).map(|i| submit(&b, 1, i as f32)).collect();
        let answers: Vec<Answer> = rxs.into_iter().map(|r| r.recv().unwrap()).collect();
        assert!(answers
            .iter()
            .any(|a| matches!(a, Err(ServeError::Busy { capacity: 2 }))));
        assert!(answers.iter().any(|a| a.is_ok()));
    }

    fn parse(body: &str) -> std::result::Result<Rows, ServeError> {
        parse_rows(body.as_bytes(), 3, 4)
    }

    fn malformed(body: &str) -> String {
        match parse(body) {
            Err(ServeError::Malformed { reason, width: 3 }) => reason,
            other => panic!("{body:?}: expected Malformed, got {other:?}"),
        }
    }

    #[test]
    fn parse_rows_reads_rows_into_one_flat_buffer() {
        let r = parse(" {\n\"inputs\" : [[1, 2, 3], [-1.5e0, 0.25, 4E2], [0,0,-0]] } \n").unwrap();
        assert_eq!(r.rows, 3);
        assert_eq!(
            r.values,
            vec![1.0, 2.0, 3.0, -1.5, 0.25, 400.0, 0.0, 0.0, -0.0]
        );
        // Exactly at the limits.
        let full = format!("{{\"inputs\": [{}]}}", ["[1,2,3]"; 4].join(","));
        assert_eq!(parse(&full).unwrap().rows, 4);
        // f32 rounding as `as f32` does it.
        let r = parse(r#"{"inputs": [[0.1, 16777217, 3.4028235e38]]}"#).unwrap();
        assert_eq!(r.values, vec![0.1f32, 16777216.0, f32::MAX]);
        // Width 0: rows of nothing.
        let r = parse_rows(br#"{"inputs": [[], []]}"#, 0, 4).unwrap();
        assert_eq!((r.rows, r.values.len()), (2, 0));
    }

    #[test]
    fn parse_rows_stops_at_the_first_value_past_the_width() {
        // What follows the fourth value is not JSON: the parser never reads it.
        assert_eq!(
            parse(r#"{"inputs": [[1, 2, 3, 4, this is not JSON"#),
            Err(ServeError::RowTooLong {
                row: 0,
                expected: 3
            })
        );
        assert_eq!(
            parse(r#"{"inputs": [[1, 2, 3], [4, 5, 6], [7, 8, 9, "x"], [oops"#),
            Err(ServeError::RowTooLong {
                row: 2,
                expected: 3
            })
        );
        // A huge row costs nothing: no more than `width` values are kept.
        let huge = format!("{{\"inputs\": [[{}1]]}}", "1,".repeat(1 << 20));
        assert_eq!(
            parse(&huge),
            Err(ServeError::RowTooLong {
                row: 0,
                expected: 3
            })
        );
        let e = parse(&huge).unwrap_err().to_string();
        assert!(e.contains("more than 3 values"), "{e}");
        // Short rows say how short.
        assert_eq!(
            parse(r#"{"inputs": [[1, 2, 3], [1, 2]]}"#),
            Err(ServeError::RowWidth {
                row: 1,
                expected: 3,
                got: 2
            })
        );
        assert_eq!(
            parse(r#"{"inputs": [[]]}"#),
            Err(ServeError::RowWidth {
                row: 0,
                expected: 3,
                got: 0
            })
        );
    }

    #[test]
    fn parse_rows_stops_at_the_first_row_past_the_limit() {
        // Four rows fit; the fifth is refused before it is read (it is not JSON).
        let body = format!("{{\"inputs\": [{}, [garbage", ["[1,2,3]"; 4].join(","));
        assert_eq!(parse(&body), Err(ServeError::RowLimit { max: 4 }));
        let many = format!("{{\"inputs\": [{}]}}", ["[1,2,3]"; 100_000].join(","));
        assert_eq!(parse(&many), Err(ServeError::RowLimit { max: 4 }));
        let e = parse(&many).unwrap_err();
        assert!(e.is_client_error());
        assert!(e.to_string().contains("at most 4 rows"), "{e}");
        assert_eq!(parse(r#"{"inputs": []}"#), Err(ServeError::Empty));
    }

    #[test]
    fn parse_rows_keeps_at_most_the_limit_in_memory() {
        // Padding cannot make the buffer grow past what the limits allow.
        let padded = format!("{{\"inputs\": [[1,2,3]]{}}}", " ".repeat(1 << 20));
        let r = parse(&padded).unwrap();
        assert_eq!(r.values, vec![1.0, 2.0, 3.0]);
        assert!(r.values.capacity() <= 3 * 4, "{}", r.values.capacity());
        // Nor can a short body make it reserve the whole limit.
        let r = parse_rows(br#"{"inputs": [[7]]}"#, 1, 1 << 30).unwrap();
        assert!(r.values.capacity() <= 16, "{}", r.values.capacity());
    }

    #[test]
    fn parse_rows_refuses_values_that_are_not_finite_f32_numbers() {
        // Beyond f32's range: typed, with where and what.
        match parse(r#"{"inputs": [[1, 2, 3], [4, -1e39, 6]]}"#) {
            Err(ServeError::NonFinite { row, column, value }) => {
                assert_eq!((row, column), (1, 1));
                assert!(value.contains("-1e39"), "{value}");
            }
            other => panic!("{other:?}"),
        }
        // JSON has no NaN or infinity (as before: malformed), nor numbers beyond f64.
        for body in [
            r#"{"inputs": [[1, 2, NaN]]}"#,
            r#"{"inputs": [[1, 2, Infinity]]}"#,
            r#"{"inputs": [[1, 2, -inf]]}"#,
            r#"{"inputs": [[1, 2, 1e400]]}"#,
        ] {
            malformed(body);
        }
        // Values that are not numbers, with the place.
        for (body, says) in [
            (r#"{"inputs": [[1, 2, "3"]]}"#, "invalid type: string"),
            (r#"{"inputs": [[1, null, 3]]}"#, "invalid type: null"),
            (r#"{"inputs": [[true, 2, 3]]}"#, "invalid type: boolean"),
            (r#"{"inputs": [[1, [2], 3]]}"#, "invalid type: sequence"),
            (r#"{"inputs": [[1, {}, 3]]}"#, "invalid type: map"),
            (r#"{"inputs": [1, 2, 3]}"#, "a row of 3 numbers"),
            (r#"{"inputs": {"a": 1}}"#, "an array of rows"),
        ] {
            let reason = malformed(body);
            assert!(reason.contains(says), "{body}: {reason}");
            assert!(reason.contains("column"), "{body}: {reason}");
        }
    }

    #[test]
    fn parse_rows_refuses_bodies_of_another_shape() {
        for (body, says) in [
            ("", "empty body"),
            (" \r\n\t ", "empty body"),
            ("{}", "missing field `inputs`"),
            (r#"{"input": [[1,2,3]]}"#, "unknown field `input`"),
            (
                r#"{"inputs": [[1,2,3]], "inputs": [[1,2,3]]}"#,
                "duplicate field `inputs`",
            ),
            (r#"{"inputs": [[1,2,3]]} trailing"#, "trailing characters"),
            (r#"{"inputs": [[1,2,3]]"#, "EOF"),
            (r#"{"inputs": [[1, 2"#, "EOF"),
            ("[[1, 2, 3]]", "an object"),
            ("42", "an object"),
            ("\u{feff}{}", "expected value"),
            ("\u{0}", "expected value"),
        ] {
            let reason = malformed(body);
            assert!(reason.contains(says), "{body:?}: {reason}");
        }
        // Unknown fields are refused before their value is read.
        malformed(r#"{"junk": [[[[[[[[ not JSON"#);
        // A message never repeats a huge input back.
        let long_key = format!("{{\"{}\": 1}}", "k".repeat(100_000));
        let reason = malformed(&long_key);
        assert!(
            reason.chars().count() <= REASON_CHARS + 1,
            "{}",
            reason.len()
        );
        let e = parse(&long_key).unwrap_err();
        assert!(e.is_client_error());
        assert!(e.to_string().contains("rows of 3 numbers"), "{e}");
    }

    #[test]
    fn parse_rows_survives_deeply_nested_garbage() {
        // Deep nesting where a body, a row list, a row or a value is expected: refused at
        // the first bracket that does not fit, without recursing into the rest.
        let deep = "[".repeat(1 << 20);
        for body in [
            deep.clone(),
            format!("{{\"inputs\": {deep}"),
            format!("{{\"inputs\": [{deep}"),
            format!("{{\"inputs\": [[1, {deep}"),
            format!("{}{}", "{\"a\":".repeat(1 << 16), "1"),
            format!("{{\"inputs\": [[1, {}", "{\"a\":".repeat(1 << 16)),
        ] {
            malformed(&body);
        }
    }

    #[test]
    fn a_batcher_parses_requests_with_its_own_limits() {
        let cfg = BatcherConfig {
            max_batch_rows: 2,
            ..BatcherConfig::default()
        };
        let (b, _) = sum_batcher(cfg, Duration::ZERO, None);
        let r = b
            .parse_request(br#"{"inputs": [[1,2,3],[4,5,6]]}"#)
            .unwrap();
        assert_eq!(r.rows, 2);
        assert_eq!(
            b.parse_request(br#"{"inputs": [[1,2,3],[4,5,6],[7"#),
            Err(ServeError::RowLimit { max: 2 })
        );
        assert_eq!(
            b.parse_request(br#"{"inputs": [[1,2,3,4"#),
            Err(ServeError::RowTooLong {
                row: 0,
                expected: 3
            })
        );
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(|x| x as f64).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 1.0), 100.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(percentile(&[7.0], 0.01), 7.0);
    }
}
