//! The registry's record: one [`Entry`] per key (the chosen engine and every candidate's
//! [`Timing`]), kept on disk per device as a [`DiskTable`] (JSON next to the NVRTC cache,
//! [`table_file`]) and shown as text by [`format_table`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use cudagraph::runtime::DeviceInfo;
use serde::{Deserialize, Serialize};

/// Version of the on-disk table format (2: cuBLASLt ranks index the heuristics under the
/// device's workspace size, 32 MiB on Hopper, where format 1 had 4 MiB; 3: short candidates
/// are ranked by their time alone in a graph as well as in a chain, [`GraphTiming`](super::GraphTiming); 4:
/// under-occupied products also measure cuBLASLt's split-K variants, `cublaslt:R/skS`, which
/// choices measured before never saw; 5: forward convolutions with a bias also measure cuDNN's
/// graph API with the bias fused, `cudnnv8+bias:R`; 6: products measured under
/// `CUDAGRAPH_LT_SEARCH=1` may record cuBLASLt's searched configurations, `cublaslt:cN`, which
/// a reader of format 5 cannot parse; 7: products also measure our register-blocked kernel,
/// `reg:S`, which choices measured before never saw; 8: products of few rows measure our
/// column-warp kernels, `colsRxCwW:KS`, instead of the 8- and 4-row kernels). The TF32
/// switches needed no new format: a choice made with one on has its own key (ending in
/// `+tf32`, [`Policy::gemm_scope`](super::Policy::gemm_scope)), and keys without it are
/// unchanged and mean what they meant.
pub(super) const FORMAT: u32 = 8;

/// One candidate's measurement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// The candidate (`GemmEngine`/`ConvEngine` as text).
    pub engine: String,
    /// The µs per run it was ranked by (see [`GraphTiming`](super::GraphTiming)), `None` when it failed.
    pub us: Option<f64>,
    /// µs per run among `reps` runs captured in one graph (candidates timed in graphs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chain_us: Option<f64>,
    /// µs per replay of a graph of one run (candidates timed in graphs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub single_us: Option<f64>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The registry's record of one key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// The chosen engine (as text).
    pub engine: String,
    /// Whether it was measured (`false`: the heuristic default, chosen inside a capture).
    pub measured: bool,
    /// Every candidate's measurement (empty when unmeasured or there was one candidate).
    pub timings: Vec<Timing>,
    /// Whether the engine was chosen by timing the graphs that run the key
    /// ([`Engines::tune_graph`](super::Engines::tune_graph)) rather than by the candidates'
    /// own times alone; such keys are not tuned again. Absent from tables written before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tuned: bool,
    /// Whether this process checked the engine against the key's candidates (entries read from
    /// disk are checked on first use); checked entries are returned without listing candidates.
    #[serde(skip)]
    pub(crate) checked: bool,
}

/// One row of [`Engines::table`](super::Engines::table).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineRow {
    /// The product or convolution the row is about, as the registry keys it.
    pub key: String,
    /// The chosen engine and the candidates' timings.
    #[serde(flatten)]
    pub entry: Entry,
}

/// The on-disk form of a device's measured choices.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiskTable {
    pub format: u32,
    /// The device name (`DeviceInfo::name`).
    pub device: String,
    /// The driver's CUDA version.
    pub driver: i32,
    /// The cuDNN and cuBLASLt versions the choices were measured with.
    pub libraries: String,
    pub entries: BTreeMap<String, Entry>,
}

impl DiskTable {
    /// Reads a table; `None` when the file is missing or not a table of this format.
    pub fn load(path: &Path) -> Option<DiskTable> {
        let text = std::fs::read_to_string(path).ok()?;
        serde_json::from_str::<DiskTable>(&text)
            .ok()
            .filter(|t| t.format == FORMAT)
    }

    /// Writes the table atomically (temporary file, then rename).
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, path)
    }
}

/// The table file of a device in `dir`: `engines-<device name>-<driver version>.json`.
pub fn table_file(dir: &Path, device: &str, driver: i32) -> PathBuf {
    let clean: String = device
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    dir.join(format!("engines-{clean}-{driver}.json"))
}

/// Whether a disk table was measured on this device, driver and libraries.
pub(super) fn identity(t: &DiskTable, info: &DeviceInfo, libraries: &str) -> bool {
    t.device == info.name && t.driver == info.driver_version && t.libraries == libraries
}

/// The registry's table as text: one line per key with the chosen engine, then the measured
/// µs of every candidate (fastest first).
pub fn format_table(rows: &[EngineRow]) -> String {
    let mut s = String::new();
    for r in rows {
        let mark = match (r.entry.measured, r.entry.tuned) {
            (false, _) => " (unmeasured)",
            (true, true) => " (tuned in a graph)",
            (true, false) => "",
        };
        s.push_str(&format!("{}\n    -> {}{mark}", r.key, r.entry.engine));
        let mut t: Vec<&Timing> = r.entry.timings.iter().collect();
        t.sort_by(|a, b| {
            a.us.unwrap_or(f64::INFINITY)
                .total_cmp(&b.us.unwrap_or(f64::INFINITY))
        });
        if !t.is_empty() {
            let list: Vec<String> = t
                .iter()
                .map(|t| match t.us {
                    Some(us) => match (t.chain_us, t.single_us) {
                        (Some(c), Some(s1)) => {
                            format!("{} {us:.1} (chain {c:.1}, alone {s1:.1})", t.engine)
                        }
                        _ => format!("{} {us:.1}", t.engine),
                    },
                    None => format!("{} failed", t.engine),
                })
                .collect();
            s.push_str(&format!("   [µs: {}]", list.join(", ")));
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_table_round_trips_and_rejects_other_formats() {
        let dir = std::env::temp_dir().join(format!("cg-engines-{}", std::process::id()));
        let path = table_file(&dir, "NVIDIA H100 80GB HBM3", 13000);
        assert!(path
            .to_string_lossy()
            .ends_with("engines-NVIDIA_H100_80GB_HBM3-13000.json"));
        let mut entries = BTreeMap::new();
        entries.insert(
            "gemm NT m=32 n=512 k=1024 a=1 b=0 ep=bias".to_string(),
            Entry {
                engine: "tiled:8".into(),
                measured: true,
                timings: vec![
                    Timing {
                        engine: "tiled:8".into(),
                        us: Some(4.5),
                        chain_us: Some(4.0),
                        single_us: Some(5.0),
                        error: None,
                    },
                    Timing {
                        engine: "cublaslt:0".into(),
                        us: None,
                        chain_us: None,
                        single_us: None,
                        error: Some("not supported".into()),
                    },
                ],
                tuned: true,
                checked: false,
            },
        );
        let t = DiskTable {
            format: FORMAT,
            device: "NVIDIA H100 80GB HBM3".into(),
            driver: 13000,
            libraries: "cudnn 91400 cublasLt 130000".into(),
            entries,
        };
        t.save(&path).unwrap();
        assert_eq!(DiskTable::load(&path).unwrap(), t);
        // Another format version is ignored, as is a file that is not a table.
        let mut old = t.clone();
        old.format = FORMAT + 1;
        old.save(&path).unwrap();
        assert!(DiskTable::load(&path).is_none());
        std::fs::write(&path, "not json").unwrap();
        assert!(DiskTable::load(&path).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn table_text_lists_candidates_fastest_first() {
        let rows = vec![EngineRow {
            key: "conv_fwd n=1 c=3 h=8 w=8 oc=4 k=3x3 s=1 p=1 bias".into(),
            entry: Entry {
                engine: "cudnn:1".into(),
                measured: true,
                timings: vec![
                    Timing {
                        engine: "direct".into(),
                        us: Some(9.0),
                        chain_us: None,
                        single_us: None,
                        error: None,
                    },
                    Timing {
                        engine: "cudnn:1".into(),
                        us: Some(3.25),
                        chain_us: Some(3.0),
                        single_us: Some(3.5),
                        error: None,
                    },
                ],
                tuned: false,
                checked: true,
            },
        }];
        let s = format_table(&rows);
        assert!(
            s.contains("-> cudnn:1\n") || s.contains("-> cudnn:1 "),
            "{s}"
        );
        assert!(!s.contains("tuned"), "{s}");
        let (a, b) = (
            s.find("cudnn:1 3.2").unwrap(),
            s.find("direct 9.0").unwrap(),
        );
        assert!(a < b, "{s}");
        assert!(s.contains("cudnn:1 3.2 (chain 3.0, alone 3.5)"), "{s}");
        let mut tuned = rows;
        tuned[0].entry.tuned = true;
        let s = format_table(&tuned);
        assert!(s.contains("-> cudnn:1 (tuned in a graph)"), "{s}");
    }
}
