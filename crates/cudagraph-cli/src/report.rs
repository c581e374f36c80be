//! `cudagraph info` and shared output helpers.

use cudagraph::{Device, Result};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct DeviceReport {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: String,
    pub multiprocessors: u32,
    pub total_memory_mib: f64,
    pub free_memory_mib: f64,
    pub driver_cuda_version: String,
}

pub fn device_report(dev: &Device) -> Result<DeviceReport> {
    let i = dev.info();
    let (free, total) = dev.context().mem_get_info()?;
    Ok(DeviceReport {
        ordinal: i.ordinal,
        name: i.name.clone(),
        compute_capability: format!("{}.{}", i.compute_capability.0, i.compute_capability.1),
        multiprocessors: i.multiprocessors,
        total_memory_mib: total as f64 / 1048576.0,
        free_memory_mib: free as f64 / 1048576.0,
        driver_cuda_version: i.cuda_version_string(),
    })
}

pub fn info(ordinal: usize, json: bool) -> Result<()> {
    let dev = Device::open(ordinal)?;
    let r = device_report(&dev)?;
    if json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&r).expect("serialisable")
        );
    } else {
        outln!("device {}: {}", r.ordinal, r.name);
        outln!(
            "  compute capability {}, {} SMs",
            r.compute_capability,
            r.multiprocessors
        );
        outln!(
            "  memory {:.0} MiB total, {:.0} MiB free",
            r.total_memory_mib,
            r.free_memory_mib
        );
        outln!("  driver supports CUDA {}", r.driver_cuda_version);
        outln!(
            "  {}",
            cudagraph::memory::format_memory_line(&dev.memory_stats())
        );
    }
    Ok(())
}

/// Median microseconds per iteration: `warmup` untimed calls, then `repeats` samples of
/// `iters` back-to-back calls of `body` ending in one synchronisation of `s`.
pub fn time_us<E: From<cudagraph::Error>>(
    s: &cudagraph::Stream,
    warmup: usize,
    iters: usize,
    repeats: usize,
    mut body: impl FnMut() -> Result<(), E>,
) -> Result<f64, E> {
    for _ in 0..warmup {
        body()?;
    }
    let mut samples = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        s.synchronize()?;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            body()?;
        }
        s.synchronize()?;
        samples.push(t.elapsed().as_secs_f64() * 1e6 / iters as f64);
    }
    Ok(median(samples))
}

/// What a table prints where a value does not apply (JSON has `null` there).
pub const NOT_APPLICABLE: &str = "–";

/// `v` with `decimals` decimals, or [`NOT_APPLICABLE`].
pub fn num(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| NOT_APPLICABLE.into(), |v| format!("{v:.decimals$}"))
}

/// The footnotes under a table: a row with values that do not apply carries a marker in the
/// table, and its footnote says why. Rows with the same reason share one footnote.
#[derive(Default)]
pub struct Footnotes {
    notes: Vec<String>,
}

impl Footnotes {
    /// The marker (` [n]`) for the footnote `why`, numbered in order of first use.
    pub fn mark(&mut self, why: &str) -> String {
        let n = match self.notes.iter().position(|n| n == why) {
            Some(i) => i + 1,
            None => {
                self.notes.push(why.into());
                self.notes.len()
            }
        };
        format!(" [{n}]")
    }

    /// One line per footnote, `[n] why`, in marker order.
    pub fn lines(&self) -> impl Iterator<Item = String> + '_ {
        self.notes
            .iter()
            .enumerate()
            .map(|(i, n)| format!("[{}] {n}", i + 1))
    }
}

/// Median of a non-empty sample.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::{median, num, Footnotes, NOT_APPLICABLE};

    #[test]
    fn median_of_odd_and_even_samples() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn a_missing_value_prints_a_dash() {
        assert_eq!(num(Some(1.234), 2), "1.23");
        assert_eq!(num(None, 2), NOT_APPLICABLE);
    }

    #[test]
    fn footnotes_are_numbered_once_per_reason() {
        let mut f = Footnotes::default();
        assert_eq!(f.mark("not timed"), " [1]");
        assert_eq!(f.mark("not compared"), " [2]");
        assert_eq!(f.mark("not timed"), " [1]");
        assert_eq!(
            f.lines().collect::<Vec<_>>(),
            ["[1] not timed", "[2] not compared"]
        );
    }
}
