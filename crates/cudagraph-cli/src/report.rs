//! `cudagraph info` and shared output helpers.

use cudagraph::{Device, Result};
use serde::Serialize;

#[derive(Serialize)]
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

/// A horizontal bar chart (eager vs graph µs per row), readable at a glance.
pub fn svg_chart(rows: &[crate::bench::workloads::Row], device: &str) -> String {
    let rows: Vec<_> = rows
        .iter()
        .filter(|r| r.eager_us.is_finite() && r.graph_us.is_finite())
        .collect();
    let (left, width, bar, gap) = (330.0, 520.0, 14.0, 14.0);
    let height = 70.0 + rows.len() as f64 * (2.0 * bar + gap) + 30.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"22\" font-size=\"15\" font-weight=\"bold\">cudagraph: eager vs graph, µs per iteration (shorter is better)</text>\n\
         <text x=\"10\" y=\"40\">{}</text>\n\
         <rect x=\"{left}\" y=\"48\" width=\"12\" height=\"10\" fill=\"#b0b0b0\"/><text x=\"{}\" y=\"57\">eager</text>\n\
         <rect x=\"{}\" y=\"48\" width=\"12\" height=\"10\" fill=\"#2a7ab9\"/><text x=\"{}\" y=\"57\">graph</text>\n",
        left + width + 120.0,
        xml_escape(device),
        left + 16.0,
        left + 70.0,
        left + 86.0
    );
    let mut y = 70.0;
    for r in rows {
        let max = r.eager_us.max(r.graph_us).max(1e-9);
        let label = xml_escape(&format!("{} {}", r.workload, r.config));
        s += &format!("<text x=\"10\" y=\"{}\">{label}</text>\n", y + bar + 4.0);
        for (i, (v, color)) in [(r.eager_us, "#b0b0b0"), (r.graph_us, "#2a7ab9")]
            .into_iter()
            .enumerate()
        {
            let yy = y + i as f64 * bar;
            let w = (v / max * width).max(1.0);
            s += &format!(
                "<rect x=\"{left}\" y=\"{yy}\" width=\"{w:.1}\" height=\"{}\" fill=\"{color}\"/><text x=\"{:.1}\" y=\"{:.1}\">{v:.1} µs</text>\n",
                bar - 2.0,
                left + w + 6.0,
                yy + bar - 4.0
            );
        }
        s += &format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" font-weight=\"bold\">{:.2}x</text>\n",
            left + width + 70.0,
            y + bar + 4.0,
            r.speedup
        );
        y += 2.0 * bar + gap;
    }
    s + "</svg>\n"
}

fn xml_escape(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
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
    use super::median;

    #[test]
    fn median_of_odd_and_even_samples() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
