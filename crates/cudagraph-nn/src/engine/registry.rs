//! [`Engines`], the per-device registry: the policy in force, every key's choice (measured on
//! the first eager call, the heuristic default inside a capture), the disk table it loads and
//! merges into, and the usage log benchmarks read.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use cudagraph::runtime::{Context, DeviceInfo};
use cudagraph::{Device, Queue};

use super::catalog::Engine;
use super::policy::Policy;
use super::table::{identity, table_file, DiskTable, EngineRow, Entry, Timing, FORMAT};
use crate::error::{NnError, Result};
use crate::ffi::blas::Blas;
use crate::ffi::blaslt::BlasLt;
use crate::ffi::cudnn::Cudnn;
use crate::ffi::cudnn_graph::CudnnGraph;
use crate::ffi::libraries::Libraries;

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The per-device engine registry (a [`Device::extension`]): policy and choices. The library
/// handles the engines use belong to the device's `Libraries`; the registry hands out those
/// its policy allows.
pub struct Engines {
    pub(super) ctx: Context,
    info: DeviceInfo,
    libs: Arc<Libraries>,
    policy: Mutex<Policy>,
    pub(super) table: Mutex<BTreeMap<String, Entry>>,
    file: Option<PathBuf>,
    libraries: String,
    /// The graph pool of the registry's timing graphs, made on first use and kept with the
    /// device; its lock serialises the graph timing of this device's measurements (the pool
    /// contract: its graphs never replay at once). Dropping each timing graph with a private
    /// pool closed that pool, a release that synchronises the context, per candidate: with
    /// other threads capturing at the same time, captures were invalidated and the process
    /// crashed inside cuCtxSynchronize (H100: gpu_engines with parallel test
    /// threads failed 6 of 8 runs, 0 of 8 with graph timing off).
    pub(super) timing_pool: Mutex<Option<cudagraph::memory::Pool>>,
    /// When on ([`Engines::start_usage_log`]): every (key, engine) served, in order.
    usage: Mutex<Option<Vec<(String, String)>>>,
    usage_on: std::sync::atomic::AtomicBool,
}

impl fmt::Debug for Engines {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Engines({} #{}, {} choices, {})",
            self.info.name,
            self.info.ordinal,
            lock(&self.table).len(),
            self.libraries
        )
    }
}

/// A string naming the installed library versions (part of the disk table's identity).
fn library_versions() -> String {
    let v = |r: std::result::Result<usize, String>| r.map_or("none".to_string(), |v| v.to_string());
    format!(
        "cudnn {} cublasLt {}",
        v(crate::ffi::cudnn::version()),
        v(crate::ffi::blaslt::version())
    )
}

thread_local! {
    /// The keys served on this thread while [`record_keys`] runs, first use first.
    static KEYS: std::cell::RefCell<Option<Vec<String>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` and returns, with its result, the registry keys it used on this thread (every
/// device's), each once, in the order of first use. A recording around it (a caller's) goes on
/// afterwards, also when `f` panics.
pub(super) fn record_keys<R>(f: impl FnOnce() -> R) -> (R, Vec<String>) {
    /// Puts the recording around back when dropped.
    struct Restore(Option<Option<Vec<String>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(outer) = self.0.take() {
                KEYS.with(|k| *k.borrow_mut() = outer);
            }
        }
    }
    let mut restore = Restore(Some(KEYS.with(|k| k.borrow_mut().replace(Vec::new()))));
    let r = f();
    let outer = restore.0.take().expect("taken once");
    let keys = KEYS.with(|k| std::mem::replace(&mut *k.borrow_mut(), outer));
    (r, keys.unwrap_or_default())
}

/// Adds `key` to this thread's recording, if one runs ([`record_keys`]).
fn note_key(key: &str) {
    KEYS.with(|k| {
        if let Some(v) = k.borrow_mut().as_mut() {
            if !v.iter().any(|x| x == key) {
                v.push(key.to_string());
            }
        }
    });
}

/// The engine `e` records, where it is one of `candidates` (the engines that can run the
/// product at hand).
fn among<A: Engine>(e: &Entry, candidates: &[A]) -> Option<A> {
    e.engine
        .parse::<A>()
        .ok()
        .filter(|a| candidates.contains(a))
}

/// [`Engines::shared_or_exact`] on `table`.
fn shared_or_exact<A: Engine>(
    table: &BTreeMap<String, Entry>,
    shared: String,
    exact: String,
    candidates: &[A],
) -> String {
    if table.contains_key(&exact) {
        return exact;
    }
    match table.get(&shared) {
        Some(e) if among(e, candidates).is_none() => exact,
        _ => shared,
    }
}

/// Records `entry` (the choice `chosen`, one of `candidates`) under `key` unless a choice
/// among `candidates` is already there — another thread's, recorded while this one measured
/// or captured: the first recorded choice wins, so that every graph and eager call of a key
/// runs one engine. A choice there that this process already uses and `candidates` cannot
/// run (a range's, made by another row count) is not replaced either: `entry` then goes
/// under `exact`, the product's own key, on the same terms. Returns the key and engine in
/// force.
fn settle<A: Engine>(
    table: &mut BTreeMap<String, Entry>,
    key: &str,
    exact: Option<&str>,
    (chosen, entry): (A, Entry),
    candidates: &[A],
) -> (String, A) {
    if let Some(e) = table.get_mut(key) {
        if let Some(a) = among(e, candidates) {
            e.checked = true;
            return (key.to_string(), a);
        }
        if let Some(exact) = exact.filter(|x| *x != key && e.checked) {
            return settle(table, exact, None, (chosen, entry), candidates);
        }
    }
    table.insert(key.to_string(), entry);
    (key.to_string(), chosen)
}

/// Runs at least this long (µs) are "long" for [`Engines::choose`]'s preference of the default.
const LONG_RUN_US: f64 = 1000.0;
/// How much faster than the default another candidate of a long run must measure to replace it
/// (on the H100, cuBLASLt's algorithms for an 8192³ bf16 product measured within 3 % of each
/// other, and one of them 1518 and 1738 µs in two steady-state timings of one process).
const LONG_RUN_MARGIN: f64 = 0.03;

impl Engines {
    /// The registry of `device`, created on first use (reads the environment's policy and the
    /// disk table).
    pub fn get(device: &Device) -> Result<Arc<Engines>> {
        device
            .extension(|d| Engines::new(d).map_err(cudagraph::Error::from))
            .map_err(NnError::from)
    }

    fn new(d: &Device) -> Result<Engines> {
        let policy = Policy::from_env()?;
        let info = d.info().clone();
        let libraries = library_versions();
        let file = cudagraph::runtime::nvrtc::cache_dir()
            .map(|dir| table_file(&dir, &info.name, info.driver_version));
        let entries = file
            .as_deref()
            .and_then(DiskTable::load)
            .filter(|t| identity(t, &info, &libraries))
            .map(|t| t.entries)
            .unwrap_or_default();
        Ok(Engines {
            ctx: d.context().clone(),
            info,
            libs: Libraries::get(d)?,
            policy: Mutex::new(policy),
            table: Mutex::new(entries),
            file,
            libraries,
            timing_pool: Mutex::new(None),
            usage: Mutex::new(None),
            usage_on: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn same_identity(&self, t: &DiskTable) -> bool {
        identity(t, &self.info, &self.libraries)
    }

    /// The current policy.
    pub fn policy(&self) -> Policy {
        *lock(&self.policy)
    }

    /// Replaces the policy (keys record restrictions, so choices made under another policy stay
    /// cached under their own keys).
    pub fn set_policy(&self, p: Policy) {
        *lock(&self.policy) = p;
    }

    /// Forgets every choice in memory, so the next eager use of each key measures it again
    /// (the disk table keeps its entries; new measurements replace theirs).
    pub fn clear(&self) {
        lock(&self.table).clear();
    }

    /// The device's facts.
    pub fn device_info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The installed library versions, e.g. `cudnn 91400 cublasLt 130000`.
    pub fn libraries(&self) -> &str {
        &self.libraries
    }

    /// Where the measured choices are stored (`None`: disk cache off).
    pub fn table_path(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// The device's cuBLAS handle (made on first use).
    pub fn blas(&self) -> Result<&Blas> {
        self.libs.blas()
    }

    /// cuDNN, when installed and allowed by the policy (opened on first use; a missing library
    /// prints one notice).
    pub fn cudnn(&self) -> Option<&Cudnn> {
        self.policy().cudnn.then(|| self.libs.cudnn()).flatten()
    }

    /// cuDNN for listing candidates on `q`: as [`Engines::cudnn`], except that inside a capture
    /// a library not opened yet stays closed (opening it may allocate or synchronise, which a
    /// capture forbids); the capture then uses the other engines.
    pub(crate) fn cudnn_for(&self, q: &dyn Queue) -> Option<&Cudnn> {
        self.policy()
            .cudnn
            .then(|| self.libs.cudnn_for(q))
            .flatten()
    }

    /// cuDNN's graph API (every engine configuration), when cuDNN 9 is installed and the
    /// policy allows cuDNN (opened on first use; an unavailable API prints one notice).
    pub fn cudnn_graph(&self) -> Option<&CudnnGraph> {
        self.policy()
            .cudnn
            .then(|| self.libs.cudnn_graph())
            .flatten()
    }

    /// cuDNN's graph API for listing candidates on `q` (not opened inside a capture).
    pub(crate) fn cudnn_graph_for(&self, q: &dyn Queue) -> Option<&CudnnGraph> {
        self.policy()
            .cudnn
            .then(|| self.libs.cudnn_graph_for(q))
            .flatten()
    }

    /// cuBLASLt for listing candidates on `q` (closed libraries stay closed in a capture).
    pub(crate) fn cublaslt_for(&self, q: &dyn Queue) -> Option<&BlasLt> {
        self.policy()
            .cublaslt
            .then(|| self.libs.cublaslt_for(q))
            .flatten()
    }

    /// cuBLASLt, when installed and allowed by the policy.
    pub fn cublaslt(&self) -> Option<&BlasLt> {
        self.policy()
            .cublaslt
            .then(|| self.libs.cublaslt())
            .flatten()
    }

    /// Every choice, sorted by key.
    pub fn table(&self) -> Vec<EngineRow> {
        lock(&self.table)
            .iter()
            .map(|(k, e)| EngineRow {
                key: k.clone(),
                entry: e.clone(),
            })
            .collect()
    }

    /// The choice recorded for `key`, if any.
    pub fn entry(&self, key: &str) -> Option<Entry> {
        lock(&self.table).get(key).cloned()
    }

    /// The engine recorded for `key` if this process already checked it against the key's
    /// candidates (the fast path: callers list candidates only when this is `None`).
    pub(crate) fn lookup<A: Engine>(&self, key: &str) -> Option<A> {
        let t = lock(&self.table);
        let e = t.get(key)?;
        if e.checked {
            let a = e.engine.parse().ok();
            if a.is_some() {
                self.log_use(key, &e.engine);
            }
            a
        } else {
            None
        }
    }

    /// The key a product is chosen under when `shared` is the key of a range of shapes it
    /// belongs to (the same product of other row counts) and `exact` the key of its own
    /// shape, `candidates` the engines that can run it: `exact` once that has an entry;
    /// otherwise `shared`, unless its recorded engine is not among `candidates` — then
    /// `exact`, so that a choice another shape of the range made (and whose graphs and eager
    /// calls run it) is never measured over.
    pub(crate) fn shared_or_exact<A: Engine>(
        &self,
        shared: String,
        exact: String,
        candidates: &[A],
    ) -> String {
        shared_or_exact(&lock(&self.table), shared, exact, candidates)
    }

    /// Starts recording which engine every product and convolution uses (for benchmarks that
    /// report it per workload); [`Self::take_usage_log`] returns and clears the record.
    pub fn start_usage_log(&self) {
        *lock(&self.usage) = Some(Vec::new());
        self.usage_on
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// The (key, engine) pairs served since [`Self::start_usage_log`] (or the last take), in
    /// order; empty when logging is off.
    pub fn take_usage_log(&self) -> Vec<(String, String)> {
        lock(&self.usage)
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    fn log_use(&self, key: &str, engine: &str) {
        note_key(key);
        if self.usage_on.load(std::sync::atomic::Ordering::Acquire) {
            if let Some(v) = lock(&self.usage).as_mut() {
                v.push((key.to_string(), engine.to_string()));
            }
        }
    }

    /// The engine for `key` among `candidates` (non-empty; `default` among them): the recorded
    /// choice when there is a valid one (measured, or the unmeasured default a capture chose);
    /// otherwise, on an eager queue, the fastest candidate measured with `run` (which must run
    /// the candidate on scratch outputs); inside a capture `default`, recorded as unmeasured.
    /// A choice another thread records for `key` meanwhile wins over this one's; `exact`
    /// (where `key` is a range's, [`Engines::shared_or_exact`]) is where this one's goes when
    /// that choice cannot run the product.
    pub(crate) fn choose<A: Engine>(
        &self,
        q: &dyn Queue,
        key: &str,
        exact: Option<&str>,
        candidates: &[A],
        default: A,
        run: &mut dyn FnMut(&dyn Queue, A) -> Result<()>,
    ) -> Result<A> {
        let Some(&first) = candidates.first() else {
            return Ok(default);
        };
        let default = if candidates.contains(&default) {
            default
        } else {
            first
        };
        if let Some(e) = lock(&self.table).get_mut(key) {
            if let Some(a) = among(e, candidates) {
                e.checked = true;
                self.log_use(key, &e.engine);
                return Ok(a);
            }
        }
        if q.is_capturing() || candidates.len() == 1 {
            let entry = Entry {
                engine: default.to_string(),
                measured: candidates.len() == 1,
                timings: Vec::new(),
                tuned: false,
                checked: true,
            };
            let settled = settle(
                &mut lock(&self.table),
                key,
                exact,
                (default, entry),
                candidates,
            );
            self.log_use(&settled.0, &settled.1.to_string());
            return Ok(settled.1);
        }
        let timings = self.measure(q, candidates, run)?;
        let time_of = |e: A| {
            timings
                .iter()
                .find(|(a, _)| *a == e)
                .and_then(|(_, t)| t.as_ref().ok().map(|m| m.us))
        };
        let best = timings
            .iter()
            .filter_map(|(a, t)| t.as_ref().ok().map(|m| (*a, m.us)))
            .min_by(|x, y| x.1.total_cmp(&y.1))
            .map(|(a, us)| match time_of(default) {
                // A long run (a large product) measured a few times ranks close candidates by
                // the GPU's clock and power state as much as by the engine: the default (the
                // library's own first choice) keeps its place unless another is clearly faster.
                Some(d) if us >= LONG_RUN_US && d <= us * (1.0 + LONG_RUN_MARGIN) => default,
                _ => a,
            });
        let Some(best) = best else {
            let why: Vec<String> = timings
                .iter()
                .map(|(a, t)| format!("{a}: {}", t.as_ref().err().map_or("?", |e| e)))
                .collect();
            return Err(NnError::Library {
                library: "engine registry",
                call: "measure",
                status: format!("no engine could run {key}: {}", why.join("; ")),
            });
        };
        let entry = Entry {
            engine: best.to_string(),
            measured: true,
            timings: timings
                .iter()
                .map(|(a, t)| Timing {
                    engine: a.to_string(),
                    us: t.as_ref().ok().map(|m| m.us),
                    chain_us: t.as_ref().ok().and_then(|m| m.chain),
                    single_us: t.as_ref().ok().and_then(|m| m.single),
                    error: t.as_ref().err().cloned(),
                })
                .collect(),
            tuned: false,
            checked: true,
        };
        let (key, chosen) = settle(
            &mut lock(&self.table),
            key,
            exact,
            (best, entry),
            candidates,
        );
        self.log_use(&key, &chosen.to_string());
        self.save();
        Ok(chosen)
    }

    /// Merges the measured choices into the disk table (when there is one).
    pub(super) fn save(&self) {
        let measured: Vec<(String, Entry)> = lock(&self.table)
            .iter()
            .filter(|(_, e)| e.measured && !e.timings.is_empty())
            .map(|(k, e)| (k.clone(), e.clone()))
            .collect();
        if let Some(path) = &self.file {
            // Merge into what is on disk (another process, or choices forgotten by `clear`).
            let mut table = DiskTable::load(path)
                .filter(|t| self.same_identity(t))
                .unwrap_or_else(|| DiskTable {
                    format: FORMAT,
                    device: self.info.name.clone(),
                    driver: self.info.driver_version,
                    libraries: self.libraries.clone(),
                    entries: BTreeMap::new(),
                });
            table.entries.extend(measured);
            // A table that cannot be written only costs a measurement next time.
            let _ = table.save(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::{note_key, record_keys, settle, shared_or_exact, Entry, KEYS};
    use crate::engine::GemmEngine;

    #[test]
    fn recorded_keys_are_each_once_in_order_and_nest() {
        let (r, outer) = record_keys(|| {
            note_key("a");
            let ((), inner) = record_keys(|| {
                note_key("b");
                note_key("b");
                note_key("c");
            });
            assert_eq!(inner, ["b", "c"]);
            note_key("d");
            note_key("a");
            7
        });
        assert_eq!(r, 7);
        assert_eq!(outer, ["a", "d"]);
        // Nothing records outside.
        note_key("e");
        assert!(KEYS.with(|k| k.borrow().is_none()));
    }

    #[test]
    fn a_panic_inside_puts_the_outer_recording_back() {
        let ((), outer) = record_keys(|| {
            note_key("a");
            let caught = std::panic::catch_unwind(|| {
                record_keys(|| {
                    note_key("b");
                    panic!("inside");
                })
            });
            assert!(caught.is_err());
            note_key("c");
        });
        assert_eq!(outer, ["a", "c"]);
        let _ = std::panic::catch_unwind(|| record_keys(|| panic!("alone")));
        assert!(KEYS.with(|k| k.borrow().is_none()));
    }

    #[test]
    fn a_shared_choice_serves_the_shapes_that_can_run_it_and_is_never_measured_over() {
        let entry = |engine: &str| Entry {
            engine: engine.into(),
            measured: true,
            timings: Vec::new(),
            tuned: false,
            checked: true,
        };
        let pick = |t: &BTreeMap<String, Entry>, c: &[GemmEngine]| {
            shared_or_exact(t, "m=65..80".into(), "m=70".into(), c)
        };
        let lt = |r| GemmEngine::CublasLt(r);
        let mut t = BTreeMap::new();
        // Nothing recorded: the range's key, measured for it.
        assert_eq!(pick(&t, &[lt(0), lt(1)]), "m=65..80");
        // A choice this shape can run serves it.
        t.insert("m=65..80".to_string(), entry("cublaslt:1"));
        assert_eq!(pick(&t, &[lt(0), lt(1), GemmEngine::Cublas]), "m=65..80");
        // One it cannot run (a rank its plan lacks), or a text that names no engine: its
        // own key, so the range's choice stays.
        assert_eq!(pick(&t, &[lt(0), GemmEngine::Cublas]), "m=70");
        t.insert("m=65..80".to_string(), entry("no such engine"));
        assert_eq!(pick(&t, &[lt(0)]), "m=70");
        // Once its own key has an entry, that stays its key whatever the range records.
        t.insert("m=65..80".to_string(), entry("cublaslt:0"));
        t.insert("m=70".to_string(), entry("cublas"));
        assert_eq!(pick(&t, &[lt(0), GemmEngine::Cublas]), "m=70");
    }

    #[test]
    fn the_first_choice_recorded_for_a_key_wins() {
        let entry = |engine: &str, checked| Entry {
            engine: engine.into(),
            measured: true,
            timings: Vec::new(),
            tuned: false,
            checked,
        };
        let lt = |r| GemmEngine::CublasLt(r);
        let all = [lt(0), lt(1), GemmEngine::Cublas];
        let mine = |e: GemmEngine| (e, entry(&e.to_string(), true));
        let mut t = BTreeMap::new();
        // Nothing there: this thread's choice is recorded.
        assert_eq!(
            settle(&mut t, "k", None, mine(lt(1)), &all),
            ("k".into(), lt(1))
        );
        assert_eq!(t["k"].engine, "cublaslt:1");
        // Another thread's choice arrived first: it stays, and is the one returned.
        assert_eq!(
            settle(&mut t, "k", None, mine(lt(0)), &all),
            ("k".into(), lt(1))
        );
        assert_eq!(t["k"].engine, "cublaslt:1");
        // A disk entry that names no candidate of this product is replaced.
        t.insert("d".into(), entry("cublaslt:7", false));
        assert_eq!(
            settle(&mut t, "d", None, mine(lt(0)), &all),
            ("d".into(), lt(0))
        );
        // A range's choice in use that this row count cannot run stays; this count's
        // choice goes under its own key, where the first one wins too.
        t.insert("m=65..80".into(), entry("cublaslt:1", true));
        let few = [lt(0), GemmEngine::Cublas];
        let got = settle(
            &mut t,
            "m=65..80",
            Some("m=70"),
            mine(GemmEngine::Cublas),
            &few,
        );
        assert_eq!(got, ("m=70".into(), GemmEngine::Cublas));
        assert_eq!(t["m=65..80"].engine, "cublaslt:1");
        let again = settle(&mut t, "m=65..80", Some("m=70"), mine(lt(0)), &few);
        assert_eq!(again, ("m=70".into(), GemmEngine::Cublas));
        // Without an own key the range's entry is replaced, as for any key.
        let plain = settle(&mut t, "m=65..80", None, mine(lt(0)), &few);
        assert_eq!(plain, ("m=65..80".into(), lt(0)));
    }
}
