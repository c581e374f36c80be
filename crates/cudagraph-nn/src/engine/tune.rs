//! Choosing engines where they run: [`Engines::tune_graph`] times a captured graph with the
//! close alternatives of the engines its keys chose and keeps the ones that make the graph
//! faster.
//!
//! The registry ranks a key's candidates by their own time, each run alone or after itself
//! with its operands hot in L2. Inside a longer graph a kernel's neighbours change that: our
//! few-row kernels start streaming their weights before the kernel before them has ended
//! (programmatic dependent launch), cuBLASLt's kernels do not, and a model's weights come from
//! device memory, not L2. On an H100, GPT-2 small's decode step at batch 8 ran 12 % faster with
//! its q|k|v and MLP-up products on the tensor-core few-row kernel (`gemv-mma:8`), which their
//! own times ranked 2 % behind cuBLASLt.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use cudagraph::{CaptureOptions, Event, Graph, Pool, Queue, Stream};

use super::measure::{is_fatal, replays_back_to_back};
use super::registry::{lock, record_keys, Engines};
use super::table::Entry;
use crate::error::{NnError, Result};

/// An alternative engine is tried where its own time is within this fraction of the chosen
/// engine's.
pub const TUNE_WITHIN: f64 = 0.25;

/// A trial replaces the choice where the graph replays at least this fraction faster (the
/// graph with the choice and with the trial each timed twice, the better time of each).
const TUNE_MIN_GAIN: f64 = 0.005;

/// Replays per timing: about this many µs of them.
const TIMED_US: f64 = 10_000.0;

/// Replays before the first timing: about this many µs of them. A GPU that was idle (as after
/// compiling a model's kernels) runs slower for a while; the graph timed first must not pay
/// for that.
const WARM_US: f64 = 50_000.0;

/// One choice [`Engines::tune_graph`] changed.
#[derive(Clone, Debug, PartialEq)]
pub struct Retuned {
    /// The registry key.
    pub key: String,
    /// The engine its candidates' own times chose.
    pub from: String,
    /// The engine the graph ran faster with.
    pub to: String,
}

/// What [`Engines::tune_graph`] did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TuneReport {
    /// Keys of the graph whose alternatives were timed.
    pub keys: usize,
    /// Graphs captured with an alternative in place.
    pub trials: usize,
    /// The choices it changed.
    pub changed: Vec<Retuned>,
    /// µs per replay of the graph with the choices before and after.
    pub before_us: f64,
    /// See `before_us`.
    pub after_us: f64,
    /// Wall time of the tuning (captures and timed replays).
    pub time: Duration,
}

/// The engines worth timing in place of `e`'s choice: of each kind of engine other than the
/// choice's (the engine's name up to its `:`, e.g. `gemv-mma` or `cublaslt`), the fastest
/// measured candidate, where its own time is within `within` of the choice's; fastest first.
/// None for an entry that was not measured, or was tuned before.
pub(super) fn alternatives(e: &Entry, within: f64) -> Vec<String> {
    if !e.measured || e.tuned {
        return Vec::new();
    }
    let kind = |s: &str| s.split(':').next().unwrap_or(s).to_string();
    let Some(own) = e
        .timings
        .iter()
        .find(|t| t.engine == e.engine)
        .and_then(|t| t.us)
    else {
        return Vec::new();
    };
    let mine = kind(&e.engine);
    let mut best: BTreeMap<String, (f64, &str)> = BTreeMap::new();
    for t in &e.timings {
        let (Some(us), k) = (t.us, kind(&t.engine)) else {
            continue;
        };
        if k == mine || us > own * (1.0 + within) {
            continue;
        }
        let slot = best.entry(k).or_insert((us, &t.engine));
        if us < slot.0 {
            *slot = (us, &t.engine);
        }
    }
    let mut v: Vec<(f64, &str)> = best.into_values().collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v.into_iter().map(|(_, e)| e.to_string()).collect()
}

impl Engines {
    /// Captures `work` into a graph on `stream` (its allocations from `pool`) and times its
    /// replays; then, for each key of this registry that `work` uses whose choice was measured
    /// and not tuned before, captures and times it again with each alternative engine in
    /// place (the fastest of each other kind of engine whose own time was within
    /// [`TUNE_WITHIN`] of the choice's), one at a time, and keeps an alternative where the
    /// graph replays at least 0.5 % faster (both graphs timed twice). Every key tried is then
    /// recorded as tuned (on disk too), so later captures, eager calls and processes run the
    /// kept engine and do not tune the key again. Returns what changed.
    ///
    /// `work` runs once per capture and every graph replays many times: it must be work whose
    /// repetition is harmless — a forward pass into scratch buffers, not an optimizer step
    /// (nothing unsafe happens otherwise, but the buffers it updates are updated each time).
    /// Run it once eagerly first, so that its keys are measured (a key first seen inside the
    /// capture has no measurements to choose from). While this runs, another thread that
    /// uses the same keys may run a trial's engine: a valid engine for the key, whose results
    /// can differ in the last bits from the final choice's.
    ///
    /// Errors: those of capturing and replaying `work` with the choices in place (a trial
    /// whose capture fails is skipped, its choice restored; one whose replay fails returns
    /// that error with the key's choice from before that trial restored — the measured one,
    /// or an earlier trial of the key that was kept — and the keys tried are not marked
    /// tuned).
    ///
    /// ```no_run
    /// use cudagraph::memory::bf16;
    /// use cudagraph::{Device, Queue, QueueExt};
    /// use cudagraph_nn::engine::gemm::GemmOp;
    /// use cudagraph_nn::engine::{gemm_lowp, Engines};
    /// use cudagraph_nn::Nn;
    /// # fn main() -> cudagraph_nn::Result<()> {
    /// let dev = Device::open(0)?;
    /// let mut s = dev.new_stream()?;
    /// let nn = Nn::get(&dev)?;
    /// // One decode-sized product: y[8, 2304] = x[8, 768] · w[2304, 768]ᵀ.
    /// let op = GemmOp::linear(8, 2304, 768);
    /// let x = s.alloc_zeroed::<bf16>(8 * 768)?;
    /// let w = s.alloc_zeroed::<bf16>(2304 * 768)?;
    /// let y = s.alloc::<bf16>(8 * 2304)?;
    /// let mut forward = |q: &dyn Queue| -> cudagraph_nn::Result<()> {
    ///     gemm_lowp(q, &nn, &op, &x, &w, &y, None)?;
    ///     Ok(())
    /// };
    /// forward(&s)?; // eagerly first: the registry measures the product's candidates
    /// let report = Engines::get(&dev)?.tune_graph(&mut s, &dev.graph_pool_handle(), &mut forward)?;
    /// println!("{:?}: {:.1} -> {:.1} µs a replay", report.changed, report.before_us, report.after_us);
    /// // Capture `forward` now: the graph runs the kept engines.
    /// # Ok(()) }
    /// ```
    pub fn tune_graph(
        &self,
        stream: &mut Stream,
        pool: &Pool,
        work: &mut dyn FnMut(&dyn Queue) -> Result<()>,
    ) -> Result<TuneReport> {
        let t0 = Instant::now();
        let capture = |stream: &mut Stream, work: &mut dyn FnMut(&dyn Queue) -> Result<()>| {
            Graph::capture(stream, CaptureOptions::new().pool(pool), |cs| {
                work(cs).map_err(cudagraph::Error::from)
            })
            .map(|(g, ())| g)
            .map_err(NnError::from)
        };
        let (graph, keys) = record_keys(|| capture(stream, work));
        let mut graph = graph?;
        let trials: Vec<(String, String)> = {
            let t = lock(&self.table);
            keys.iter()
                .filter_map(|k| t.get(k).map(|e| (k, alternatives(e, TUNE_WITHIN))))
                .flat_map(|(k, alts)| alts.into_iter().map(move |a| (k.clone(), a)))
                .collect()
        };
        let mut report = TuneReport::default();
        if trials.is_empty() {
            report.time = t0.elapsed();
            return Ok(report);
        }
        let timer = Timer::new(self)?;
        timer.warm(stream, &graph)?;
        let mut best = timer.time(stream, &graph)?;
        report.before_us = best;
        let mut tried: Vec<String> = Vec::new();
        for (key, alt) in trials {
            // A product of a range's key that cannot run the trial's engine takes a key of its
            // own (`Engines::shared_or_exact`); a trial not kept removes the keys its capture
            // added (those this thread used that were not there before: never another
            // thread's).
            let before: BTreeSet<String> = lock(&self.table).keys().cloned().collect();
            let undo = |from: &str, used: &[String]| {
                self.set_engine(&key, from);
                let mut t = lock(&self.table);
                for k in used.iter().filter(|k| !before.contains(*k)) {
                    t.remove(k);
                }
            };
            let Some(from) = self.set_engine(&key, &alt) else {
                continue;
            };
            if !tried.contains(&key) {
                tried.push(key.clone());
            }
            report.trials += 1;
            let (trial, used) = record_keys(|| capture(stream, work));
            let trial = match trial {
                Ok(g) => g,
                Err(e) if is_fatal(&e) => return Err(e),
                Err(_) => {
                    undo(&from, &used);
                    continue;
                }
            };
            // A replay that fails leaves the choice before the trial recorded, not the trial.
            let timed = (|| {
                let mut t = timer.time(stream, &trial)?;
                if t < best * (1.0 - TUNE_MIN_GAIN) {
                    // Close calls twice, the second time in reverse order (choice, trial,
                    // trial, choice): a GPU whose speed drifts over the four timings favours
                    // neither graph.
                    t = t.min(timer.time(stream, &trial)?);
                    best = best.min(timer.time(stream, &graph)?);
                }
                Ok::<f64, NnError>(t)
            })();
            let t = match timed {
                Ok(t) => t,
                Err(e) => {
                    undo(&from, &used);
                    return Err(e);
                }
            };
            if t < best * (1.0 - TUNE_MIN_GAIN) {
                // Another trial of this key may still beat this one: `from` stays the
                // measured choice in the report.
                match report.changed.iter_mut().find(|r| r.key == key) {
                    Some(r) => r.to = alt,
                    None => report.changed.push(Retuned { key, from, to: alt }),
                }
                graph = trial;
                best = t;
            } else {
                undo(&from, &used);
            }
        }
        report.keys = tried.len();
        report.after_us = best;
        {
            let mut t = lock(&self.table);
            for k in &tried {
                if let Some(e) = t.get_mut(k) {
                    e.tuned = true;
                }
            }
        }
        self.save();
        report.time = t0.elapsed();
        Ok(report)
    }

    /// Records `engine` as `key`'s choice; returns the engine it replaces, or `None` where
    /// the key has no entry.
    fn set_engine(&self, key: &str, engine: &str) -> Option<String> {
        lock(&self.table)
            .get_mut(key)
            .map(|e| std::mem::replace(&mut e.engine, engine.to_string()))
    }
}

/// Times graph replays on a stream: µs per replay, replayed back to back.
struct Timer {
    e0: Event,
    e1: Event,
}

impl Timer {
    fn new(eng: &Engines) -> Result<Timer> {
        Ok(Timer {
            e0: Event::new(&eng.ctx, true)?,
            e1: Event::new(&eng.ctx, true)?,
        })
    }

    /// µs of one replay of `g`, after one replay before it.
    fn once(&self, stream: &Stream, g: &Graph) -> Result<f64> {
        g.replay(stream)?;
        stream.record(&self.e0)?;
        g.replay(stream)?;
        stream.record(&self.e1)?;
        self.e1.synchronize()?;
        Ok(self.e0.elapsed_ms(&self.e1)? as f64 * 1e3)
    }

    /// Replays `g` for about [`WARM_US`], untimed.
    fn warm(&self, stream: &Stream, g: &Graph) -> Result<()> {
        let reps = ((WARM_US / self.once(stream, g)?.max(1.0)) as usize).clamp(3, 5000);
        replays_back_to_back(stream, (&self.e0, &self.e1), g, reps)?;
        Ok(())
    }

    fn time(&self, stream: &Stream, g: &Graph) -> Result<f64> {
        let reps = ((TIMED_US / self.once(stream, g)?.max(1.0)) as usize).clamp(3, 500);
        replays_back_to_back(stream, (&self.e0, &self.e1), g, reps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Timing;

    fn entry(engine: &str, times: &[(&str, Option<f64>)]) -> Entry {
        Entry {
            engine: engine.into(),
            measured: true,
            timings: times
                .iter()
                .map(|&(e, us)| Timing {
                    engine: e.into(),
                    us,
                    chain_us: None,
                    single_us: None,
                    error: us.is_none().then(|| "failed".into()),
                })
                .collect(),
            tuned: false,
            checked: true,
        }
    }

    #[test]
    fn alternatives_are_the_fastest_close_engine_of_each_other_kind() {
        let e = entry(
            "cublaslt:0",
            &[
                ("cublaslt:0", Some(4.0)),
                ("cublaslt:1", Some(4.1)),
                ("cublas", Some(5.2)),
                ("gemv-mma:4", Some(4.6)),
                ("gemv-mma:8", Some(4.08)),
                ("gemv:2", Some(4.9)),
                ("gemv:1", None),
                ("tiled:8", Some(9.0)),
            ],
        );
        // Same kind (cublaslt:1), beyond 25 % (cublas 5.2, tiled 9.0) and failed ones are left
        // out; gemv-mma's fastest only.
        assert_eq!(alternatives(&e, 0.25), vec!["gemv-mma:8", "gemv:2"]);
        assert_eq!(alternatives(&e, 0.05), vec!["gemv-mma:8"]);
        assert!(alternatives(&e, 0.0).is_empty());
    }

    #[test]
    fn unmeasured_tuned_and_untimed_choices_have_no_alternatives() {
        let times = [("gemv:1", Some(3.0)), ("cublaslt:0", Some(3.1))];
        let mut e = entry("gemv:1", &times);
        assert_eq!(alternatives(&e, 0.25), vec!["cublaslt:0"]);
        e.tuned = true;
        assert!(alternatives(&e, 0.25).is_empty());
        let mut e = entry("gemv:1", &times);
        e.measured = false;
        assert!(alternatives(&e, 0.25).is_empty());
        // The choice itself without a time (a default kept for a long run that failed to
        // time, or an entry edited by hand): nothing to compare with.
        let e = entry("cublas", &times);
        assert!(alternatives(&e, 0.25).is_empty());
        // A choice slower than another kind's candidate (a long run's default kept): the faster
        // one is an alternative.
        let e = entry(
            "cublaslt:0",
            &[("cublaslt:0", Some(10.0)), ("gemv:4", Some(9.0))],
        );
        assert_eq!(alternatives(&e, 0.25), vec!["gemv:4"]);
    }
}
