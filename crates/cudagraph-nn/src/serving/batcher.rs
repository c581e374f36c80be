//! [`Batcher`]: the queue in front of one worker thread that owns a [`BatchRunner`] — requests
//! collected into batches (up to `max_batch_rows` rows or `max_wait` after the first), each
//! answered exactly once, shutdown that drains the queue — and its metrics.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::parse::{parse_rows, Rows};
use super::{BatchRunner, MemorySnapshot, Reply, ServeError};

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
    /// Batches run with a size in this bucket.
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
    /// Batches run.
    pub batches: u64,
    /// Batches that replayed a captured graph.
    pub graphed_batches: u64,
    /// Batches run eagerly (no graph for their size).
    pub eager_batches: u64,
    /// Rows computed only as padding, and their share of all computed rows.
    pub padded_rows: u64,
    /// `padded_rows` over all computed rows, in `[0, 1]`.
    pub padding_fraction: f64,
    /// Average rows per batch.
    pub mean_batch_rows: f64,
    /// Batches run per size bucket (powers of two up to the largest batch).
    pub batch_size_histogram: Vec<SizeBucket>,
    /// Latency from `submit` to the answer, over the last 65536 requests, in microseconds.
    pub latency_p50_us: f64,
    /// 95th percentile latency, in microseconds.
    pub latency_p95_us: f64,
    /// 99th percentile latency, in microseconds.
    pub latency_p99_us: f64,
    /// Largest latency, in microseconds.
    pub latency_max_us: f64,
    /// Requests waiting in the queue now.
    pub queued: usize,
    /// Device memory after the first batch and after the latest one.
    pub memory_at_start: Option<MemorySnapshot>,
    /// Device memory after the latest batch; `None` before the first batch.
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

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
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

    /// Values per input row of the model.
    pub fn input_row(&self) -> usize {
        self.input_row
    }

    /// Values per output row of the model.
    pub fn output_row(&self) -> usize {
        self.output_row
    }

    /// The configuration in use (`max_batch_rows` and `queue_capacity` raised to at least 1).
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
