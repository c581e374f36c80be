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

/// The kind of an engine: its name up to its `:` (`gemv`, `gemv-mma`, `cublaslt`, …).
fn kind(engine: &str) -> &str {
    engine.split(':').next().unwrap_or(engine)
}

/// The engines a tuning may give `e`'s key, one of each kind, fastest first as (kind, engine):
/// the choice for its own kind, and of each other kind the fastest measured candidate whose
/// own time is within `within` of the choice's. Empty for an entry that was not measured, or
/// was tuned before, or whose choice has no time.
pub(super) fn options(e: &Entry, within: f64) -> Vec<(String, String)> {
    if !e.measured || e.tuned {
        return Vec::new();
    }
    let Some(own) = e
        .timings
        .iter()
        .find(|t| t.engine == e.engine)
        .and_then(|t| t.us)
    else {
        return Vec::new();
    };
    let mine = kind(&e.engine);
    let mut best: BTreeMap<&str, (f64, &str)> = BTreeMap::new();
    best.insert(mine, (own, &e.engine));
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
    let mut v: Vec<(&str, (f64, &str))> = best.into_iter().collect();
    v.sort_by(|a, b| a.1 .0.total_cmp(&b.1 .0));
    v.into_iter()
        .map(|(k, (_, e))| (k.to_string(), e.to_string()))
        .collect()
}

/// The moves that put every key of `options` that has an engine of kind `to` on it, where
/// that is not its engine now (`now`); none where that moves fewer than two keys (a key on
/// its own is a trial of its own).
pub(super) fn moves_to_kind(
    options: &[(String, Vec<(String, String)>)],
    to: &str,
    now: impl Fn(&str) -> Option<String>,
) -> Vec<(String, String)> {
    let moves: Vec<(String, String)> = options
        .iter()
        .filter_map(|(key, opts)| {
            let (_, engine) = opts.iter().find(|(k, _)| k == to)?;
            (now(key).as_deref() != Some(engine.as_str())).then(|| (key.clone(), engine.clone()))
        })
        .collect();
    if moves.len() < 2 {
        return Vec::new();
    }
    moves
}

impl Engines {
    /// Captures `work` into a graph on `stream` (its allocations from `pool`) and times its
    /// replays; then, for each key of this registry that `work` uses whose choice was measured
    /// and not tuned before, captures and times it again with each alternative engine in
    /// place (the fastest of each other kind of engine whose own time was within
    /// [`TUNE_WITHIN`] of the choice's), one at a time, and keeps an alternative where the
    /// graph replays at least 0.5 % faster (both graphs timed twice); then, for each kind of
    /// engine, with every key that has one of that kind within the window on it at once, where
    /// that moves two keys or more, kept on the same terms. Every key tried is then
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
        let (graph, keys) = record_keys(|| capture(stream, pool, work));
        let graph = graph?;
        // Each key's engines to try, by kind, from its own times (before any trial moves it).
        let options: Vec<(String, Vec<(String, String)>)> = {
            let t = lock(&self.table);
            keys.into_iter()
                .filter_map(|k| {
                    let o = options(t.get(&k)?, TUNE_WITHIN);
                    (o.len() > 1).then_some((k, o))
                })
                .collect()
        };
        if options.is_empty() {
            return Ok(TuneReport {
                time: t0.elapsed(),
                ..TuneReport::default()
            });
        }
        let timer = Timer::new(self)?;
        timer.warm(stream, &graph)?;
        let best = timer.time(stream, &graph)?;
        let mut run = Tuning {
            eng: self,
            pool,
            timer,
            graph,
            best,
            tried: Vec::new(),
            report: TuneReport {
                before_us: best,
                ..TuneReport::default()
            },
        };
        // One key at a time: the fastest engine of each other kind, fastest first.
        for (key, opts) in &options {
            let Some(engine) = self.engine_of(key) else {
                continue;
            };
            for (_, alt) in opts.iter().filter(|(k, _)| k != kind(&engine)) {
                run.trial(stream, work, &[(key.clone(), alt.clone())])?;
            }
        }
        // Then every key on one kind at once: keys can act together, so that the step is
        // fastest with all of them on one kind and slower with any one moved alone (GPT-2
        // small at batch 1 on an H200: q|k|v and MLP up both on the lane kernel 0.271 ms a
        // step, either one on the tensor-core kernel 0.296–0.297, both 0.294).
        let kinds: BTreeSet<&str> = options
            .iter()
            .flat_map(|(_, o)| o.iter().map(|(k, _)| k.as_str()))
            .collect();
        for to in kinds {
            let moves = moves_to_kind(&options, to, |k| self.engine_of(k));
            if !moves.is_empty() {
                run.trial(stream, work, &moves)?;
            }
        }
        let Tuning {
            tried,
            mut report,
            best,
            ..
        } = run;
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

    /// The engine `key` records now, if it has an entry.
    fn engine_of(&self, key: &str) -> Option<String> {
        lock(&self.table).get(key).map(|e| e.engine.clone())
    }

    /// Records `engine` as `key`'s choice; returns the engine it replaces, or `None` where
    /// the key has no entry.
    fn set_engine(&self, key: &str, engine: &str) -> Option<String> {
        lock(&self.table)
            .get_mut(key)
            .map(|e| std::mem::replace(&mut e.engine, engine.to_string()))
    }
}

/// Captures `work` on `stream` into a graph, its allocations from `pool`.
fn capture(
    stream: &mut Stream,
    pool: &Pool,
    work: &mut dyn FnMut(&dyn Queue) -> Result<()>,
) -> Result<Graph> {
    Graph::capture(stream, CaptureOptions::new().pool(pool), |cs| {
        work(cs).map_err(cudagraph::Error::from)
    })
    .map(|(g, ())| g)
    .map_err(NnError::from)
}

/// A tuning under way: the graph with the choices kept so far, and its time.
struct Tuning<'a> {
    eng: &'a Engines,
    pool: &'a Pool,
    timer: Timer,
    graph: Graph,
    best: f64,
    /// Keys a trial moved.
    tried: Vec<String>,
    report: TuneReport,
}

impl Tuning<'_> {
    /// Captures `work` with each (key, engine) of `moves` recorded and times its replays;
    /// keeps the moves where the graph replays at least [`TUNE_MIN_GAIN`] faster than the
    /// graph kept so far (a close call timed again in reverse order), restores the keys'
    /// choices otherwise. A capture that fails (not fatally) is no trial; a replay that fails
    /// restores the choices and is the error.
    fn trial(
        &mut self,
        stream: &mut Stream,
        work: &mut dyn FnMut(&dyn Queue) -> Result<()>,
        moves: &[(String, String)],
    ) -> Result<()> {
        let eng = self.eng;
        // A product of a range's key that cannot run the trial's engine takes a key of its own
        // (`Engines::shared_or_exact`); a trial not kept removes the keys its capture added
        // (those this thread used that were not there before: never another thread's).
        let before: BTreeSet<String> = lock(&eng.table).keys().cloned().collect();
        let from: Vec<(&str, &str, String)> = moves
            .iter()
            .filter_map(|(key, to)| Some((key.as_str(), to.as_str(), eng.set_engine(key, to)?)))
            .collect();
        if from.is_empty() {
            return Ok(());
        }
        let undo = |used: &[String]| {
            for (key, _, was) in &from {
                eng.set_engine(key, was);
            }
            let mut t = lock(&eng.table);
            for k in used.iter().filter(|k| !before.contains(*k)) {
                t.remove(k);
            }
        };
        for (key, _, _) in &from {
            if !self.tried.iter().any(|k| k == key) {
                self.tried.push(key.to_string());
            }
        }
        self.report.trials += 1;
        let (trial, used) = record_keys(|| capture(stream, self.pool, work));
        let trial = match trial {
            Ok(g) => g,
            Err(e) if is_fatal(&e) => return Err(e),
            Err(_) => {
                undo(&used);
                return Ok(());
            }
        };
        let t = match self.rematch(stream, &trial) {
            Ok(t) => t,
            Err(e) => {
                undo(&used);
                return Err(e);
            }
        };
        if t >= self.best * (1.0 - TUNE_MIN_GAIN) {
            undo(&used);
            return Ok(());
        }
        // `from` of a key's report stays the measured choice; a key moved back to it leaves
        // the report.
        for (key, to, was) in &from {
            match self.report.changed.iter_mut().find(|r| r.key == *key) {
                Some(r) => r.to = to.to_string(),
                None => self.report.changed.push(Retuned {
                    key: key.to_string(),
                    from: was.clone(),
                    to: to.to_string(),
                }),
            }
        }
        self.report.changed.retain(|r| r.from != r.to);
        self.graph = trial;
        self.best = t;
        Ok(())
    }

    /// µs per replay of `trial`; where it beats the kept graph by [`TUNE_MIN_GAIN`], both are
    /// timed again in reverse order (kept, trial, trial, kept: a GPU whose speed drifts over
    /// the four timings favours neither) and each keeps its better time.
    fn rematch(&mut self, stream: &Stream, trial: &Graph) -> Result<f64> {
        let mut t = self.timer.time(stream, trial)?;
        if t < self.best * (1.0 - TUNE_MIN_GAIN) {
            t = t.min(self.timer.time(stream, trial)?);
            self.best = self.best.min(self.timer.time(stream, &self.graph)?);
        }
        Ok(t)
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

    /// The engines of `options` other than the choice's kind (its first entry of that kind).
    fn others(e: &Entry, within: f64) -> Vec<String> {
        let mine = kind(&e.engine);
        options(e, within)
            .into_iter()
            .filter(|(k, _)| k != mine)
            .map(|(_, e)| e)
            .collect()
    }

    #[test]
    fn options_are_the_choice_and_the_fastest_close_engine_of_each_other_kind() {
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
        let pair = |k: &str, e: &str| (k.to_string(), e.to_string());
        assert_eq!(
            options(&e, 0.25),
            vec![
                pair("cublaslt", "cublaslt:0"),
                pair("gemv-mma", "gemv-mma:8"),
                pair("gemv", "gemv:2")
            ]
        );
        assert_eq!(others(&e, 0.05), vec!["gemv-mma:8"]);
        assert_eq!(options(&e, 0.0), vec![pair("cublaslt", "cublaslt:0")]);
    }

    #[test]
    fn unmeasured_tuned_and_untimed_choices_have_no_options() {
        let times = [("gemv:1", Some(3.0)), ("cublaslt:0", Some(3.1))];
        let mut e = entry("gemv:1", &times);
        assert_eq!(others(&e, 0.25), vec!["cublaslt:0"]);
        e.tuned = true;
        assert!(options(&e, 0.25).is_empty());
        let mut e = entry("gemv:1", &times);
        e.measured = false;
        assert!(options(&e, 0.25).is_empty());
        // The choice itself without a time (a default kept for a long run that failed to
        // time, or an entry edited by hand): nothing to compare with.
        let e = entry("cublas", &times);
        assert!(options(&e, 0.25).is_empty());
        // A choice slower than another kind's candidate (a long run's default kept): the faster
        // one comes first.
        let e = entry(
            "cublaslt:0",
            &[("cublaslt:0", Some(10.0)), ("gemv:4", Some(9.0))],
        );
        assert_eq!(others(&e, 0.25), vec!["gemv:4"]);
        assert_eq!(options(&e, 0.25)[0].1, "gemv:4");
    }

    #[test]
    fn a_kind_move_takes_every_key_with_that_kind_off_another_engine_or_none() {
        let o = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter()
                .map(|&(k, e)| (k.to_string(), e.to_string()))
                .collect()
        };
        let options = vec![
            (
                "qkv".to_string(),
                o(&[("gemv", "gemv:1"), ("gemv-mma", "gemv-mma:8")]),
            ),
            (
                "up".to_string(),
                o(&[("gemv-mma", "gemv-mma:8"), ("gemv", "gemv:1")]),
            ),
            (
                "down".to_string(),
                o(&[("gemv", "gemv:4"), ("cublaslt", "cublaslt:0")]),
            ),
        ];
        // After one-key trials: q|k|v moved to the tensor-core kernel, the others measured.
        let now = |k: &str| {
            Some(
                match k {
                    "qkv" | "up" => "gemv-mma:8",
                    _ => "gemv:4",
                }
                .to_string(),
            )
        };
        let pair = |k: &str, e: &str| (k.to_string(), e.to_string());
        assert_eq!(
            moves_to_kind(&options, "gemv", now),
            vec![pair("qkv", "gemv:1"), pair("up", "gemv:1")]
        );
        // Every key with that kind is on it already, or only one would move: no trial.
        assert!(moves_to_kind(&options, "gemv-mma", now).is_empty());
        assert!(moves_to_kind(&options, "cublaslt", now).is_empty());
        // A key without an entry any more counts as not on the engine.
        let gone = |k: &str| (k != "down").then(|| "gemv-mma:8".to_string());
        assert_eq!(moves_to_kind(&options, "gemv", gone).len(), 3);
    }
}
