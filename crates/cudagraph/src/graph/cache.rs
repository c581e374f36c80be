//! [`GraphCache`]: one graph per batch-size bucket (seeds 002/004's dict of graphs, done fully).
//!
//! A request of n rows runs on the smallest captured size b ≥ n. Above the largest size the
//! model runs eagerly — counted, never silent. All graphs share one pool and one static input
//! (sized for the largest bucket), and are captured largest first so the smaller ones reuse the
//! larger ones' memory.
//!
//! **Rows must be independent** ([`BatchModel`]'s contract): row i of the output depends only
//! on row i of the input. The cache relies on it: the b − n padding rows of the static input
//! are not cleared (they hold whatever an earlier request left there) and their outputs are
//! never read. A model that mixes rows (batch statistics, attention across the batch) gives
//! wrong results through a cache with padding.
//!
//! Three ways to serve a request, from the most to the least copying:
//! - [`GraphCache::run`]: the rows are copied into the static input, the graph replays, the
//!   output rows are copied into a new buffer;
//! - [`GraphCache::run_into`]: the same, with the output rows copied into the caller's buffer;
//! - [`GraphCache::stage`]: the producer writes the request straight into the static input
//!   ([`Staged::input`]), and [`Staged::run`] returns the static output rows borrowed until the
//!   next request (no copy in, no copy out).
//!
//! With [`Selection::Measure`] each bucket is timed once, graph replay against the eager
//! forward pass at that size (like the per-shape engine choice), and served the faster way;
//! the choice and both times are in [`GraphCache::entries`], and eager-served requests are
//! counted in [`CacheStats::eager`].
//!
//! **Streams.** Requests may come on different streams (a worker per stream, the cache behind
//! a `Mutex`): a request on a stream other than the last request's first waits, on the device,
//! for everything that stream had enqueued — the last replay reading the static input, the copy
//! of its output rows — so requests never overlap. Requests on one stream are ordered by the
//! stream and pay nothing for this.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::time::{Duration, Instant};

use super::capture::CaptureOptions;
use super::exec::Graph;
use crate::device::{Device, Queue, QueueExt, Stream};
use crate::error::{Error, Result};
use crate::memory::order::LastUse;
use crate::memory::{DeviceBuffer, Elem, Pool};
use crate::runtime::CaptureMode;

/// A model that maps `rows` rows of input to `rows` rows of output, and can run on any queue.
///
/// Rows must be independent: output row i may depend only on input row i (a [`GraphCache`]
/// pads requests with stale rows whose outputs it never reads).
pub trait BatchModel {
    /// Element type of the input rows.
    type In: Elem;
    /// Element type of the output rows.
    type Out: Elem;
    /// Elements per input row.
    fn input_row(&self) -> usize;
    /// Elements per output row.
    fn output_row(&self) -> usize;
    /// Runs on `input` (exactly `rows * input_row()` elements), returning
    /// `rows * output_row()` elements.
    fn forward(
        &self,
        q: &dyn Queue,
        input: &DeviceBuffer<Self::In>,
        rows: usize,
    ) -> Result<DeviceBuffer<Self::Out>>;
}

/// `rows * row` elements, or the typed error when that does not fit.
fn elems(what: &'static str, rows: usize, row: usize) -> Result<usize> {
    rows.checked_mul(row).ok_or(Error::SizeOverflow {
        what,
        count: rows,
        elem_size: row,
    })
}

/// Which batch sizes to capture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BucketPolicy {
    /// Exactly these sizes.
    Sizes(Vec<usize>),
    /// 1, 2, 4, … up to and including `max`.
    PowersOfTwo {
        /// The largest size (included).
        max: usize,
    },
    /// 1, 2, 4, 8, then steps of 8 up to `max` (vLLM's choice).
    Steps8 {
        /// The largest size.
        max: usize,
    },
}

impl BucketPolicy {
    /// The sizes, sorted ascending, without duplicates or zeros.
    pub fn sizes(&self) -> Vec<usize> {
        let mut v = match self {
            BucketPolicy::Sizes(s) => s.clone(),
            BucketPolicy::PowersOfTwo { max } => {
                let mut v: Vec<usize> = std::iter::successors(Some(1usize), |s| s.checked_mul(2))
                    .take_while(|s| s <= max)
                    .collect();
                v.push(*max);
                v
            }
            BucketPolicy::Steps8 { max } => {
                let mut v: Vec<usize> = [1, 2, 4, 8].into_iter().filter(|s| s <= max).collect();
                v.extend((16..=*max).step_by(8));
                v.push(*max);
                v
            }
        };
        v.retain(|&s| s > 0);
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// The smallest size in `sizes` (sorted) that holds `rows`.
pub fn bucket_for(sizes: &[usize], rows: usize) -> Option<usize> {
    let i = sizes.partition_point(|&s| s < rows);
    sizes.get(i).copied()
}

/// How a bucket's requests are served.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Selection {
    /// Always by the bucket's graph (padding included).
    #[default]
    Graph,
    /// By whichever was faster when the bucket was captured: its graph, or the eager forward
    /// pass (timed back to back at the bucket's size, median of a few samples). Requests from
    /// a caller's buffer ([`GraphCache::run`], [`GraphCache::run_into`]) count the copy of
    /// their rows into the static input against the graph (measured too); staged requests
    /// ([`GraphCache::stage`]) do not pay it.
    Measure,
}

/// What a bucket serves its requests with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Replays of the bucket's graph.
    Graph,
    /// The model run eagerly on the request's rows.
    Eager,
}

/// Options for [`GraphCache::new`].
#[derive(Clone, Debug, Default)]
pub struct CacheOptions {
    /// Capture a size on its first request instead of up front.
    pub lazy: bool,
    /// Evict least-recently-used graphs when their working sets exceed this many bytes.
    pub memory_budget: Option<usize>,
    /// Capture mode of every capture the cache makes.
    pub mode: CaptureMode,
    /// Graph always, or graph or eager per bucket by measurement.
    pub selection: Selection,
}

/// How a request was served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// A graph of exactly the request's size.
    Exact {
        /// The graph's batch size.
        size: usize,
    },
    /// A larger graph; `padded_rows` rows were padding.
    Padded {
        /// The graph's batch size.
        size: usize,
        /// Rows computed only as padding.
        padded_rows: usize,
    },
    /// No graph was large enough: eager execution.
    Fallback,
    /// The bucket of `size` measured faster eagerly ([`Selection::Measure`]): the model ran
    /// eagerly on exactly the request's rows.
    Eager {
        /// The bucket's batch size.
        size: usize,
    },
}

/// Counters of a cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Requests served.
    pub requests: u64,
    /// Requests served by a graph of exactly their size.
    pub exact: u64,
    /// Requests served by a larger graph, with padding rows.
    pub padded: u64,
    /// Requests no graph was large enough for, run eagerly.
    pub fallbacks: u64,
    /// Requests served eagerly because their bucket measured faster that way.
    pub eager: u64,
    /// Rows computed only as padding.
    pub padded_rows: u64,
    /// Rows requested.
    pub rows: u64,
    /// Graphs captured (again after an eviction).
    pub captures: u64,
    /// Graphs evicted to stay within the memory budget.
    pub evictions: u64,
    /// Time spent capturing, all captures together.
    pub capture_time: Duration,
}

impl CacheStats {
    /// Share of computed rows (graph rows plus eager rows) that were padding.
    pub fn padding_fraction(&self) -> f64 {
        self.padded_rows as f64 / (self.rows + self.padded_rows).max(1) as f64
    }
}

impl fmt::Display for CacheStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} requests: {} exact, {} padded, {} eager by measurement, {} eager fallbacks; {:.1}% padding; {} captures ({:.1} ms), {} evictions",
            self.requests,
            self.exact,
            self.padded,
            self.eager,
            self.fallbacks,
            100.0 * self.padding_fraction(),
            self.captures,
            self.capture_time.as_secs_f64() * 1e3,
            self.evictions
        )
    }
}

/// One captured size, as reported by [`GraphCache::entries`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EntryInfo {
    /// The batch size captured.
    pub size: usize,
    /// Nodes of its graph.
    pub nodes: usize,
    /// How long its capture took.
    pub capture_time: Duration,
    /// Peak bytes the capture allocated in the shared pool.
    pub peak_bytes: usize,
    /// Requests routed to this size (by graph or eagerly).
    pub hits: u64,
    /// How the bucket serves staged requests ([`GraphCache::stage`]: the rows are already in
    /// the static input).
    pub choice: Choice,
    /// How the bucket serves requests from a caller's buffer ([`GraphCache::run`],
    /// [`GraphCache::run_into`]): a graph must first copy the rows into the static input, so
    /// the copy counts against it.
    pub copy_choice: Choice,
    /// Measured µs per graph replay at this size ([`Selection::Measure`] only).
    pub graph_us: Option<f64>,
    /// Measured µs per eager forward pass at this size ([`Selection::Measure`] only).
    pub eager_us: Option<f64>,
    /// Measured µs per copy of this size's rows into the static input ([`Selection::Measure`]
    /// only; NaN when there was no memory for the measurement's source buffer).
    pub copy_in_us: Option<f64>,
}

struct Entry<O: Elem> {
    graph: Graph,
    output: DeviceBuffer<O>,
    last_used: u64,
    hits: u64,
    measured: Option<Measured>,
}

impl<O: Elem> Entry<O> {
    /// How the bucket serves a request: by its graph unless measured slower than eager (with
    /// the copy into the static input counted against the graph when `copied`).
    fn choice(&self, copied: bool) -> Choice {
        self.measured.map_or(Choice::Graph, |m| {
            let copy = if copied { m.copy_in_us } else { 0.0 };
            choose(m.graph_us + copy, m.eager_us)
        })
    }
}

/// A bucket's measurement: µs per graph replay, per eager forward pass and per copy of its
/// rows into the static input.
#[derive(Clone, Copy, Debug)]
struct Measured {
    graph_us: f64,
    eager_us: f64,
    copy_in_us: f64,
}

/// Warm-up calls, samples and calls per sample of a bucket's measurement.
const MEASURE: (usize, usize, usize) = (2, 5, 10);

/// Median µs per call of `f`: `MEASURE`'s warm-up, then samples of back-to-back calls each
/// ended by one synchronisation of `stream`.
fn time_us(stream: &Stream, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let (warmup, samples, calls) = MEASURE;
    for _ in 0..warmup {
        f()?;
    }
    let mut v = Vec::with_capacity(samples);
    for _ in 0..samples {
        stream.synchronize()?;
        let t = Instant::now();
        for _ in 0..calls {
            f()?;
        }
        stream.synchronize()?;
        v.push(t.elapsed().as_secs_f64() * 1e6 / calls as f64);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(v[v.len() / 2])
}

/// The faster way to serve a bucket; ties go to the graph.
pub fn choose(graph_us: f64, eager_us: f64) -> Choice {
    if eager_us < graph_us {
        Choice::Eager
    } else {
        Choice::Graph
    }
}

/// A request's rows in the static input, for the producer to write (see
/// [`GraphCache::stage`]). Holds the cache mutably, so only one request is staged at a time.
pub struct Staged<'a, M: BatchModel> {
    cache: &'a mut GraphCache<M>,
    rows: usize,
    /// The static input's first rows, or a buffer of its own above the largest bucket.
    input: DeviceBuffer<M::In>,
}

/// The output rows of a request: the static output borrowed until the cache serves the next
/// request, or a buffer of its own (eager paths).
pub struct CacheOutput<'a, O: Elem> {
    buf: DeviceBuffer<O>,
    _cache: PhantomData<&'a ()>,
}

impl<O: Elem> CacheOutput<'_, O> {
    /// The `rows × output_row` elements.
    pub fn buffer(&self) -> &DeviceBuffer<O> {
        &self.buf
    }

    /// Copies them to the host (synchronises `stream`).
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<O>> {
        stream.to_vec(&self.buf)
    }
}

impl<'a, M: BatchModel> Staged<'a, M> {
    /// Where the producer writes the request: `rows × input_row()` elements, on the stream
    /// that will run it (or ordered before it).
    pub fn input(&self) -> &DeviceBuffer<M::In> {
        &self.input
    }

    /// The request's row count.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Serves the staged request: replays the bucket's graph on the static input as it is
    /// (or runs eagerly, see [`Served`]) and returns the output rows without copying them.
    #[track_caller]
    pub fn run(self, stream: &mut Stream) -> Result<(CacheOutput<'a, M::Out>, Served)> {
        let (buf, served) = self.cache.serve_staged(stream, &self.input, self.rows)?;
        Ok((
            CacheOutput {
                buf,
                _cache: PhantomData,
            },
            served,
        ))
    }

    /// As [`Self::run`], copying the output rows into `out` (at least `rows × output_row()`).
    #[track_caller]
    pub fn run_into(self, stream: &mut Stream, out: &DeviceBuffer<M::Out>) -> Result<Served> {
        let out_len = elems(
            "graph cache request",
            self.rows,
            self.cache.model.output_row(),
        )?;
        check_out(out, out_len)?;
        let (buf, served) = self.cache.serve_staged(stream, &self.input, self.rows)?;
        stream.copy_range(&buf, 0, out, 0, out_len)?;
        Ok(served)
    }
}

fn check_out<O: Elem>(out: &DeviceBuffer<O>, need: usize) -> Result<()> {
    if out.len() < need {
        return Err(Error::SizeMismatch {
            what: "graph cache output buffer",
            expected: need,
            got: out.len(),
        });
    }
    Ok(())
}

/// One graph per batch-size bucket, with padding, eager fallback and shared memory.
pub struct GraphCache<M: BatchModel> {
    model: M,
    device: Device,
    pool: Pool,
    sizes: Vec<usize>,
    input: DeviceBuffer<M::In>,
    entries: BTreeMap<usize, Entry<M::Out>>,
    stats: CacheStats,
    opts: CacheOptions,
    clock: u64,
    /// The stream of the last request: the static input, the static outputs and the pool are
    /// shared by every request, so a request on another stream waits for it.
    order: LastUse,
}

impl<M: BatchModel> fmt::Debug for GraphCache<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GraphCache(sizes {:?}, {} captured, {})",
            self.sizes,
            self.entries.len(),
            self.stats
        )
    }
}

impl<M: BatchModel> GraphCache<M> {
    /// Creates the cache and (unless `opts.lazy`) captures every size, largest first.
    #[track_caller]
    pub fn new(
        stream: &mut Stream,
        model: M,
        policy: BucketPolicy,
        opts: CacheOptions,
    ) -> Result<Self> {
        let sizes = policy.sizes();
        let Some(&max) = sizes.last() else {
            return Err(Error::InvalidGraph {
                problem: "a graph cache needs at least one batch size".into(),
            });
        };
        let device = stream.device().clone();
        let input =
            stream.alloc_zeroed::<M::In>(elems("graph cache input", max, model.input_row())?)?;
        let mut cache = Self {
            pool: device.graph_pool_handle(),
            device,
            model,
            sizes,
            input,
            entries: BTreeMap::new(),
            stats: CacheStats::default(),
            opts,
            clock: 0,
            order: LastUse::default(),
        };
        if !cache.opts.lazy {
            for size in cache.sizes.clone().into_iter().rev() {
                cache.capture(stream, size)?;
            }
        }
        Ok(cache)
    }

    fn capture(&mut self, stream: &mut Stream, size: usize) -> Result<()> {
        let input = self
            .input
            .prefix(elems("graph cache input", size, self.model.input_row())?)?;
        let model = &self.model;
        let opts = CaptureOptions::new()
            .pool(&self.pool)
            .mode(self.opts.mode)
            .upload(true);
        let (graph, output) = Graph::capture(stream, opts, |cs| model.forward(cs, &input, size))?;
        if output.len() != size * self.model.output_row() {
            return Err(Error::SizeMismatch {
                what: "model output of a captured batch",
                expected: size * self.model.output_row(),
                got: output.len(),
            });
        }
        self.stats.captures += 1;
        self.stats.capture_time += graph.info().capture_time;
        let measured = match self.opts.selection {
            Selection::Graph => None,
            Selection::Measure => {
                let stream: &Stream = stream;
                let graph_us = time_us(stream, || graph.replay(stream))?;
                let eager_us = time_us(stream, || model.forward(stream, &input, size).map(drop))?;
                // A caller's rows copied into the static input, as run/run_into do. Without
                // room for a second copy of the rows the copy is not measured (NaN): it then
                // does not count against the graph.
                let copy_in_us = match stream.alloc_zeroed::<M::In>(input.len()) {
                    Ok(rows) => time_us(stream, || {
                        stream.copy_range(&rows, 0, &input, 0, input.len())
                    })?,
                    Err(e) if e.is_out_of_memory() => f64::NAN,
                    Err(e) => return Err(e),
                };
                Some(Measured {
                    graph_us,
                    eager_us,
                    copy_in_us,
                })
            }
        };
        self.clock += 1;
        self.entries.insert(
            size,
            Entry {
                graph,
                output,
                last_used: self.clock,
                hits: 0,
                measured,
            },
        );
        self.evict_over_budget(size);
        Ok(())
    }

    fn working_set(&self) -> usize {
        self.entries
            .values()
            .map(|e| e.graph.info().memory.peak_allocated)
            .sum()
    }

    fn evict_over_budget(&mut self, keep: usize) {
        let Some(budget) = self.opts.memory_budget else {
            return;
        };
        while self.working_set() > budget && self.entries.len() > 1 {
            let victim = self
                .entries
                .iter()
                .filter(|(s, _)| **s != keep)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(s, _)| *s);
            match victim {
                Some(v) => {
                    self.entries.remove(&v);
                    self.stats.evictions += 1;
                }
                None => break,
            }
        }
    }

    /// The bucket for `rows` and how it serves requests (capturing it first when lazy), or
    /// `None` above the largest bucket. `copied`: the rows come from a caller's buffer and a
    /// graph would first copy them into the static input.
    fn route(
        &mut self,
        stream: &mut Stream,
        rows: usize,
        copied: bool,
    ) -> Result<Option<(usize, Choice)>> {
        let Some(size) = bucket_for(&self.sizes, rows) else {
            return Ok(None);
        };
        if !self.entries.contains_key(&size) {
            self.capture(stream, size)?;
        }
        Ok(self.entries.get(&size).map(|e| (size, e.choice(copied))))
    }

    /// Counts a request of `rows` served by bucket `size` the way `choice` says.
    fn count(&mut self, rows: usize, route: Option<(usize, Choice)>) -> Served {
        self.stats.requests += 1;
        self.stats.rows += rows as u64;
        let Some((size, choice)) = route else {
            self.stats.fallbacks += 1;
            return Served::Fallback;
        };
        self.clock += 1;
        if let Some(e) = self.entries.get_mut(&size) {
            e.last_used = self.clock;
            e.hits += 1;
        }
        match choice {
            Choice::Eager => {
                self.stats.eager += 1;
                Served::Eager { size }
            }
            Choice::Graph if size == rows => {
                self.stats.exact += 1;
                Served::Exact { size }
            }
            Choice::Graph => {
                self.stats.padded += 1;
                self.stats.padded_rows += (size - rows) as u64;
                Served::Padded {
                    size,
                    padded_rows: size - rows,
                }
            }
        }
    }

    /// Runs a request whose rows are already at the start of `input` (the static input when
    /// a graph serves it): returns the output rows, borrowed from the graph's static output or
    /// in a buffer of their own.
    fn serve(
        &mut self,
        stream: &mut Stream,
        input: &DeviceBuffer<M::In>,
        rows: usize,
        route: Option<(usize, Choice)>,
    ) -> Result<(DeviceBuffer<M::Out>, Served)> {
        let out_len = elems("graph cache request", rows, self.model.output_row())?;
        let in_len = elems("graph cache request", rows, self.model.input_row())?;
        let served = self.count(rows, route);
        match route {
            Some((size, Choice::Graph)) => {
                let entry = self.entries.get(&size).ok_or_else(|| Error::InvalidGraph {
                    problem: format!("graph cache: bucket {size} vanished"),
                })?;
                entry.graph.replay(stream)?;
                Ok((entry.output.prefix(out_len)?, served))
            }
            _ => {
                let out = self.model.forward(&*stream, &input.prefix(in_len)?, rows)?;
                if out.len() < out_len {
                    return Err(Error::SizeMismatch {
                        what: "model output of an eager batch",
                        expected: out_len,
                        got: out.len(),
                    });
                }
                Ok((out, served))
            }
        }
    }

    /// Checks a caller's input and copies its rows into the static input when a graph will
    /// serve them.
    fn take_input(
        &mut self,
        stream: &mut Stream,
        input: &DeviceBuffer<M::In>,
        rows: usize,
    ) -> Result<Option<(usize, Choice)>> {
        let in_len = elems("graph cache request", rows, self.model.input_row())?;
        if input.len() < in_len {
            return Err(Error::SizeMismatch {
                what: "graph cache input",
                expected: in_len,
                got: input.len(),
            });
        }
        self.order_on(stream)?;
        let route = self.route(stream, rows, true)?;
        if let Some((_, Choice::Graph)) = route {
            // No tail clearing: rows are independent and padded rows' outputs are never read.
            stream.copy_range(input, 0, &self.input, 0, in_len)?;
        }
        Ok(route)
    }

    /// Serves `rows` rows of `input` (which may be longer), returning the `rows` output rows in
    /// a new buffer and how they were served.
    #[track_caller]
    pub fn run(
        &mut self,
        stream: &mut Stream,
        input: &DeviceBuffer<M::In>,
        rows: usize,
    ) -> Result<(DeviceBuffer<M::Out>, Served)> {
        let route = self.take_input(stream, input, rows)?;
        let src = if matches!(route, Some((_, Choice::Graph))) {
            self.input.alias()
        } else {
            input.alias()
        };
        let (out, served) = self.serve(stream, &src, rows, route)?;
        if matches!(served, Served::Exact { .. } | Served::Padded { .. }) {
            // The static output is overwritten by the next replay: hand out a copy.
            let own = stream.alloc::<M::Out>(out.len())?;
            stream.copy(&out, &own)?;
            return Ok((own, served));
        }
        Ok((out, served))
    }

    /// Serves `rows` rows of `input`, writing the `rows` output rows into `out` (at least
    /// `rows × output_row()` elements).
    #[track_caller]
    pub fn run_into(
        &mut self,
        stream: &mut Stream,
        input: &DeviceBuffer<M::In>,
        rows: usize,
        out: &DeviceBuffer<M::Out>,
    ) -> Result<Served> {
        let out_len = elems("graph cache request", rows, self.model.output_row())?;
        check_out(out, out_len)?;
        let route = self.take_input(stream, input, rows)?;
        let src = if matches!(route, Some((_, Choice::Graph))) {
            self.input.alias()
        } else {
            input.alias()
        };
        let (buf, served) = self.serve(stream, &src, rows, route)?;
        stream.copy_range(&buf, 0, out, 0, out_len)?;
        Ok(served)
    }

    /// Stages a request of `rows` rows: the producer writes it into [`Staged::input`] — the
    /// static input itself, so a graph runs on it with no copy — then calls [`Staged::run`].
    /// Above the largest bucket the staged input is a buffer of its own (allocated on
    /// `stream`) and the request runs eagerly.
    pub fn stage(&mut self, stream: &Stream, rows: usize) -> Result<Staged<'_, M>> {
        let in_len = elems("graph cache request", rows, self.model.input_row())?;
        self.order_on(stream)?;
        let input = if bucket_for(&self.sizes, rows).is_some() {
            self.input.prefix(in_len)?
        } else {
            stream.alloc::<M::In>(in_len)?
        };
        Ok(Staged {
            cache: self,
            rows,
            input,
        })
    }

    fn serve_staged(
        &mut self,
        stream: &mut Stream,
        input: &DeviceBuffer<M::In>,
        rows: usize,
    ) -> Result<(DeviceBuffer<M::Out>, Served)> {
        self.order_on(stream)?;
        let route = self.route(stream, rows, false)?;
        self.serve(stream, input, rows, route)
    }

    /// Orders a request on `stream` after the last one, when that ran on another stream: it
    /// may still read the static input or its output may still be being copied out.
    fn order_on(&self, stream: &Stream) -> Result<()> {
        self.order.enter(stream.stream_handle()).map(drop)
    }

    /// Counters of every request so far.
    pub fn stats(&self) -> &CacheStats {
        &self.stats
    }

    /// The bucket sizes (captured or not yet).
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Captured sizes with their graphs' facts, smallest first.
    pub fn entries(&self) -> Vec<EntryInfo> {
        self.entries
            .iter()
            .map(|(&size, e)| EntryInfo {
                size,
                nodes: e.graph.node_count(),
                capture_time: e.graph.info().capture_time,
                peak_bytes: e.graph.info().memory.peak_allocated,
                hits: e.hits,
                choice: e.choice(false),
                copy_choice: e.choice(true),
                graph_us: e.measured.map(|m| m.graph_us),
                eager_us: e.measured.map(|m| m.eager_us),
                copy_in_us: e.measured.map(|m| m.copy_in_us),
            })
            .collect()
    }

    /// The pool all graphs share.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Bytes of the shared static input.
    pub fn static_input_bytes(&self) -> usize {
        self.input.bytes()
    }

    /// The model the cache runs.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The device the cache's graphs run on.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_produce_sorted_unique_sizes() {
        assert_eq!(
            BucketPolicy::PowersOfTwo { max: 20 }.sizes(),
            vec![1, 2, 4, 8, 16, 20]
        );
        assert_eq!(
            BucketPolicy::PowersOfTwo { max: 16 }.sizes(),
            vec![1, 2, 4, 8, 16]
        );
        assert_eq!(
            BucketPolicy::Steps8 { max: 40 }.sizes(),
            vec![1, 2, 4, 8, 16, 24, 32, 40]
        );
        assert_eq!(BucketPolicy::Steps8 { max: 3 }.sizes(), vec![1, 2, 3]);
        assert_eq!(
            BucketPolicy::Sizes(vec![32, 0, 4, 4, 1]).sizes(),
            vec![1, 4, 32]
        );
    }

    #[test]
    fn bucket_is_the_smallest_size_that_fits() {
        let s = [1, 4, 16, 32];
        assert_eq!(bucket_for(&s, 1), Some(1));
        assert_eq!(bucket_for(&s, 2), Some(4));
        assert_eq!(bucket_for(&s, 16), Some(16));
        assert_eq!(bucket_for(&s, 17), Some(32));
        assert_eq!(bucket_for(&s, 33), None);
        assert_eq!(bucket_for(&[], 1), None);
    }

    #[test]
    fn measured_choice_prefers_the_graph_on_ties() {
        assert_eq!(choose(10.0, 9.9), Choice::Eager);
        assert_eq!(choose(10.0, 10.0), Choice::Graph);
        assert_eq!(choose(10.0, 12.0), Choice::Graph);
        assert_eq!(choose(f64::NAN, 1.0), Choice::Graph);
        assert_eq!(Selection::default(), Selection::Graph);
        assert_eq!(CacheOptions::default().selection, Selection::Graph);
    }

    #[test]
    fn stats_show_eager_requests() {
        let s = CacheStats {
            requests: 5,
            exact: 1,
            padded: 1,
            eager: 2,
            fallbacks: 1,
            ..Default::default()
        };
        let text = s.to_string();
        assert!(text.contains("2 eager by measurement"), "{text}");
        assert!(text.contains("1 eager fallbacks"), "{text}");
    }

    #[test]
    fn padding_fraction_counts_padded_over_computed_rows() {
        let s = CacheStats {
            rows: 30,
            padded_rows: 10,
            ..Default::default()
        };
        assert!((s.padding_fraction() - 0.25).abs() < 1e-12);
        assert_eq!(CacheStats::default().padding_fraction(), 0.0);
    }
}
