//! [`GraphCache`]: one graph per batch-size bucket (seeds 002/004's dict of graphs, done fully).
//!
//! A request of n rows runs on the smallest captured size b ≥ n: its rows are copied into the
//! shared static input, the tail b − n is zeroed, the graph replays, and the first n output
//! rows are copied out. Above the largest size the model runs eagerly — counted, never silent.
//! All graphs share one pool and one static input (sized for the largest bucket), and are
//! captured largest first so the smaller ones reuse the larger ones' memory.
//!
//! Because outputs are copied out right after each replay on the caller's stream, graphs may
//! replay in any order (the pool contract only matters for outputs kept across replays).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use super::{CaptureMode, CaptureOptions, Graph};
use crate::device::{Device, Queue, QueueExt, Stream};
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, Elem, Pool};

/// A model that maps `rows` rows of input to `rows` rows of output, and can run on any queue.
pub trait BatchModel {
    type In: Elem;
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
    PowersOfTwo { max: usize },
    /// 1, 2, 4, 8, then steps of 8 up to `max` (vLLM's choice).
    Steps8 { max: usize },
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

/// Options for [`GraphCache::new`].
#[derive(Clone, Debug, Default)]
pub struct CacheOptions {
    /// Capture a size on its first request instead of up front.
    pub lazy: bool,
    /// Evict least-recently-used graphs when their working sets exceed this many bytes.
    pub memory_budget: Option<usize>,
    pub mode: CaptureMode,
}

/// How a request was served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// A graph of exactly the request's size.
    Exact { size: usize },
    /// A larger graph; `padded_rows` rows were padding.
    Padded { size: usize, padded_rows: usize },
    /// No graph was large enough: eager execution.
    Fallback,
}

/// Counters of a cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub requests: u64,
    pub exact: u64,
    pub padded: u64,
    pub fallbacks: u64,
    /// Rows computed only as padding.
    pub padded_rows: u64,
    /// Rows requested.
    pub rows: u64,
    pub captures: u64,
    pub evictions: u64,
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
            "{} requests: {} exact, {} padded, {} eager fallbacks; {:.1}% padding; {} captures ({:.1} ms), {} evictions",
            self.requests,
            self.exact,
            self.padded,
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
    pub size: usize,
    pub nodes: usize,
    pub capture_time: Duration,
    /// Peak bytes the capture allocated in the shared pool.
    pub peak_bytes: usize,
    pub hits: u64,
}

struct Entry<O: Elem> {
    graph: Graph,
    output: DeviceBuffer<O>,
    last_used: u64,
    hits: u64,
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
        self.clock += 1;
        self.entries.insert(
            size,
            Entry {
                graph,
                output,
                last_used: self.clock,
                hits: 0,
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

    /// Serves `rows` rows of `input` (which may be longer), returning the `rows` output rows in
    /// a new buffer and how they were served.
    #[track_caller]
    pub fn run(
        &mut self,
        stream: &mut Stream,
        input: &DeviceBuffer<M::In>,
        rows: usize,
    ) -> Result<(DeviceBuffer<M::Out>, Served)> {
        let (irow, orow) = (self.model.input_row(), self.model.output_row());
        let in_len = elems("graph cache request", rows, irow)?;
        let out_len = elems("graph cache request", rows, orow)?;
        if input.len() < in_len {
            return Err(Error::SizeMismatch {
                what: "graph cache input",
                expected: in_len,
                got: input.len(),
            });
        }
        self.stats.requests += 1;
        self.stats.rows += rows as u64;
        let Some(size) = bucket_for(&self.sizes, rows) else {
            self.stats.fallbacks += 1;
            let out = self.model.forward(&*stream, &input.prefix(in_len)?, rows)?;
            return Ok((out, Served::Fallback));
        };
        if !self.entries.contains_key(&size) {
            self.capture(stream, size)?;
        }
        stream.copy_range(input, 0, &self.input, 0, in_len)?;
        if size > rows {
            // size * irow fits: the static input holds the largest bucket.
            stream.memset_zero_range(&self.input, in_len, (size - rows) * irow)?;
        }
        self.clock += 1;
        let entry = self.entries.get_mut(&size).expect("captured above");
        entry.last_used = self.clock;
        entry.hits += 1;
        entry.graph.replay(stream)?;
        let out = stream.alloc::<M::Out>(out_len)?;
        stream.copy_range(&entry.output, 0, &out, 0, out_len)?;
        let served = if size == rows {
            self.stats.exact += 1;
            Served::Exact { size }
        } else {
            self.stats.padded += 1;
            self.stats.padded_rows += (size - rows) as u64;
            Served::Padded {
                size,
                padded_rows: size - rows,
            }
        };
        Ok((out, served))
    }

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

    pub fn model(&self) -> &M {
        &self.model
    }

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
