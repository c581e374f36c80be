//! The workloads' chart (`--svg`): per row, our eager and graphed µs as bars, and PyTorch's
//! beside them when its JSON (bench/pytorch_baseline.py, `--pytorch`) is given. Each row has
//! its own scale (the rows run from a few µs to a millisecond); the numbers are written beside
//! the bars and the speedups in two columns on the right.

use std::fmt::Write as _;
use std::path::Path;

use serde::Deserialize;

use super::Row;

/// PyTorch's run of the same workloads: what bench/pytorch_baseline.py prints.
#[derive(Deserialize, Debug)]
pub struct Baseline {
    #[serde(default)]
    pub torch: String,
    #[serde(default)]
    pub device: String,
    pub rows: Vec<BaselineRow>,
}

/// One of PyTorch's rows; a time that does not apply is `null`.
#[derive(Deserialize, Debug)]
pub struct BaselineRow {
    pub workload: String,
    pub config: String,
    #[serde(default)]
    pub eager_us: Option<f64>,
    #[serde(default)]
    pub graph_us: Option<f64>,
}

impl Baseline {
    pub fn read(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        serde_json::from_str(&nan_to_null(&text)).map_err(|e| {
            format!(
                "{}: not the JSON of bench/pytorch_baseline.py: {e}",
                path.display()
            )
        })
    }

    fn row(&self, r: &Row) -> Option<&BaselineRow> {
        self.rows
            .iter()
            .find(|p| p.workload == r.workload && p.config == r.config)
    }
}

/// The bars of one row: (CSS class, legend label, colour); blue is ours, orange PyTorch, the
/// light shade eager and the dark one graphed.
const SERIES: [(&str, &str, &str); 4] = [
    ("ours-eager", "cudagraph eager", "#9ecae1"),
    ("ours-graph", "cudagraph graph", "#2171b5"),
    ("pytorch-eager", "PyTorch eager", "#fdae6b"),
    ("pytorch-graph", "PyTorch graph", "#d94801"),
];
/// The order the bars of a row are drawn in (indices into [`SERIES`]): with PyTorch, eager
/// beside eager and graph beside graph.
const ORDER_OURS: [usize; 2] = [0, 1];
const ORDER_BOTH: [usize; 4] = [0, 2, 1, 3];

const BAR_X: f64 = 215.0;
const BAR_W: f64 = 430.0;
const BAR_H: f64 = 12.0;
const BAR_PITCH: f64 = 15.0;
const ROW_GAP: f64 = 18.0;
/// Space between the eager pair and the graph pair of bars.
const PAIR_GAP: f64 = 4.0;
/// Right edges of the two speedup columns.
const SPEEDUP_X: f64 = 810.0;
const VS_PYTORCH_X: f64 = 985.0;

/// The chart as an SVG document. Rows without our timings (memory-only rows) are listed under
/// the chart instead of drawn; PyTorch's bars appear when `pytorch` has rows.
pub fn svg(rows: &[Row], device: &str, pytorch: Option<&Baseline>) -> String {
    let pytorch = pytorch.filter(|p| !p.rows.is_empty());
    let order: &[usize] = if pytorch.is_some() {
        &ORDER_BOTH
    } else {
        &ORDER_OURS
    };
    let series = order.len();
    let width = if pytorch.is_some() { 1000.0 } else { 830.0 };
    let (drawn, left_out): (Vec<&Row>, Vec<&Row>) = rows
        .iter()
        .partition(|r| r.eager_us.is_some() && r.graph_us.is_some());
    let pair_gap = if series == 4 { PAIR_GAP } else { 0.0 };
    let row_h = series as f64 * BAR_PITCH + pair_gap + ROW_GAP;
    let top = 118.0;
    let height = top + drawn.len() as f64 * row_h + 24.0 + 18.0 * left_out.len() as f64 + 12.0;

    let mut s = String::new();
    let title = if pytorch.is_some() {
        "cudagraph and PyTorch: µs per iteration, eager and graphed (shorter is better)"
    } else {
        "cudagraph: µs per iteration, eager and graphed (shorter is better)"
    };
    let mut subtitle = device.to_string();
    if let Some(p) = pytorch {
        let _ = write!(subtitle, "; PyTorch {} on {}", p.torch, p.device);
    }
    subtitle += "; each row has its own scale";
    let _ = write!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"12\" y=\"26\" font-size=\"16\" font-weight=\"bold\">{}</text>\n\
         <text x=\"12\" y=\"46\" fill=\"#444\">{}</text>\n",
        xml_escape(title),
        xml_escape(&subtitle)
    );
    // Legend, one swatch per series.
    let mut x = 12.0;
    for (class, label, color) in order.iter().map(|&i| SERIES[i]) {
        let _ = writeln!(
            s,
            "<rect class=\"legend {class}\" x=\"{x}\" y=\"60\" width=\"14\" height=\"12\" fill=\"{color}\"/>\
             <text x=\"{}\" y=\"70\">{label}</text>",
            x + 19.0
        );
        x += 19.0 + label.len() as f64 * 7.0 + 22.0;
    }
    // Column headings.
    let _ = writeln!(
        s,
        "<g font-size=\"11\" fill=\"#444\" text-anchor=\"end\">\
         <text x=\"{SPEEDUP_X}\" y=\"{}\">ours, graph vs eager</text>\
         <text x=\"{SPEEDUP_X}\" y=\"{}\">(eager µs ÷ graph µs)</text>",
        top - 20.0,
        top - 7.0
    );
    if pytorch.is_some() {
        let _ = writeln!(
            s,
            "<text x=\"{VS_PYTORCH_X}\" y=\"{}\">graphed, ours vs PyTorch</text>\
             <text x=\"{VS_PYTORCH_X}\" y=\"{}\">(PyTorch µs ÷ ours)</text>",
            top - 20.0,
            top - 7.0
        );
    }
    s += "</g>\n";

    let mut y = top;
    for r in &drawn {
        let p = pytorch.and_then(|p| p.row(r));
        let values = [
            r.eager_us,
            r.graph_us,
            p.and_then(|p| p.eager_us),
            p.and_then(|p| p.graph_us),
        ];
        let max = order.iter().filter_map(|&i| values[i]).fold(1e-9, f64::max);
        let _ = writeln!(
            s,
            "<line x1=\"12\" x2=\"{}\" y1=\"{y}\" y2=\"{y}\" stroke=\"#ddd\"/>\n\
             <text x=\"12\" y=\"{}\" font-weight=\"bold\">{}</text>\n\
             <text x=\"12\" y=\"{}\" fill=\"#444\">{}</text>",
            width - 12.0,
            y + 20.0,
            xml_escape(&r.workload),
            y + 36.0,
            xml_escape(&r.config)
        );
        for (i, &k) in order.iter().enumerate() {
            let ((class, _, color), v) = (SERIES[k], values[k]);
            let yy = y + 8.0 + i as f64 * BAR_PITCH + if i >= 2 { pair_gap } else { 0.0 };
            match v {
                Some(v) => {
                    let w = (v / max * BAR_W).max(1.0);
                    let _ = writeln!(
                        s,
                        "<rect class=\"bar {class}\" x=\"{BAR_X}\" y=\"{yy}\" width=\"{w:.1}\" height=\"{BAR_H}\" fill=\"{color}\"/>\
                         <text x=\"{:.1}\" y=\"{:.1}\">{v:.1} µs</text>",
                        BAR_X + w + 5.0,
                        yy + BAR_H - 2.0
                    );
                }
                None => {
                    let _ = writeln!(
                        s,
                        "<text x=\"{BAR_X}\" y=\"{:.1}\" fill=\"#777\">not measured</text>",
                        yy + BAR_H - 2.0
                    );
                }
            }
        }
        let mid = y + 8.0 + (series as f64 * BAR_PITCH + pair_gap) / 2.0 + 3.0;
        if let Some(speedup) = r.speedup {
            let _ = writeln!(
                s,
                "<text x=\"{SPEEDUP_X}\" y=\"{mid:.1}\" text-anchor=\"end\" font-weight=\"bold\" fill=\"{}\">{speedup:.2}x</text>",
                SERIES[1].2
            );
        }
        if let (Some(ours), Some(theirs)) = (r.graph_us, values[3]) {
            let _ = writeln!(
                s,
                "<text x=\"{VS_PYTORCH_X}\" y=\"{mid:.1}\" text-anchor=\"end\" font-weight=\"bold\">{:.2}x</text>",
                theirs / ours
            );
        }
        y += row_h;
    }
    let _ = writeln!(
        s,
        "<line x1=\"12\" x2=\"{}\" y1=\"{y}\" y2=\"{y}\" stroke=\"#ddd\"/>",
        width - 12.0
    );
    y += 20.0;
    for r in left_out {
        let why = r.not_applicable.as_deref().unwrap_or("not timed");
        let why = why.split(':').next().unwrap_or(why);
        let _ = writeln!(
            s,
            "<text x=\"12\" y=\"{y}\" fill=\"#444\">Not drawn: {} {} ({}).</text>",
            xml_escape(&r.workload),
            xml_escape(&r.config),
            xml_escape(why)
        );
        y += 18.0;
    }
    s + "</svg>\n"
}

/// Older runs of bench/pytorch_baseline.py wrote `NaN` (which is not JSON) where a value does
/// not apply; it now writes `null`. Reads the old files too: a bare `NaN` value becomes `null`.
fn nan_to_null(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("NaN") {
        let before = rest[..i].trim_end();
        let after = rest[i + 3..].trim_start();
        let is_value = (before.ends_with(':') || before.ends_with(',') || before.ends_with('['))
            && (after.starts_with(',') || after.starts_with('}') || after.starts_with(']'));
        out += &rest[..i];
        out += if is_value { "null" } else { "NaN" };
        rest = &rest[i + 3..];
    }
    out + rest
}

fn xml_escape(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::super::tests::row;
    use super::*;

    fn classes(svg: &str) -> Vec<&str> {
        let mut c: Vec<&str> = svg
            .split("class=\"bar ")
            .skip(1)
            .map(|t| &t[..t.find('"').unwrap()])
            .collect();
        c.sort();
        c.dedup();
        c
    }

    fn baseline() -> Baseline {
        serde_json::from_str(
            r#"{"torch": "2.11.0", "device": "Test GPU", "rows": [
                {"workload": "linear-train", "config": "sgd", "eager_us": 523.4, "graph_us": 63.3},
                {"workload": "mlp-9-sizes-shared-pool", "config": "bs=256..1", "eager_us": null, "graph_us": null, "speedup": null}
            ]}"#,
        )
        .unwrap()
    }

    fn rows() -> Vec<Row> {
        let nine = Row {
            eager_us: None,
            graph_us: None,
            speedup: None,
            not_applicable: Some("memory only: nothing timed".into()),
            ..row("mlp-9-sizes-shared-pool", "bs=256..1", 0.0, 1.0)
        };
        vec![
            row("linear-train", "sgd", 51.1, 28.1),
            row("dropout-op", "64x4096-p0.1", 10.5, 5.5),
            nine,
        ]
    }

    #[test]
    fn with_pytorch_the_chart_has_four_series_and_a_legend() {
        let svg = svg(&rows(), "Test GPU", Some(&baseline()));
        assert_eq!(
            classes(&svg),
            ["ours-eager", "ours-graph", "pytorch-eager", "pytorch-graph"]
        );
        for (_, label, _) in SERIES {
            assert!(
                svg.contains(&format!(">{label}</text>")),
                "legend lacks {label}"
            );
        }
        assert!(svg.contains(">523.4 µs<") && svg.contains(">63.3 µs<"));
        // PyTorch graph ÷ ours graph for the row both measured.
        assert!(svg.contains(&format!(">{:.2}x<", 63.3 / 28.1)));
        // A row PyTorch lacks says so instead of drawing nothing.
        assert!(svg.contains(">not measured<"));
        assert!(svg.contains("Not drawn: mlp-9-sizes-shared-pool bs=256..1 (memory only)."));
        assert!(!svg.contains("NaN"));
    }

    #[test]
    fn without_pytorch_the_chart_has_ours_alone() {
        for pytorch in [
            None,
            Some(Baseline {
                torch: "not run".into(),
                device: "-".into(),
                rows: vec![],
            }),
        ] {
            let svg = svg(&rows(), "Test GPU", pytorch.as_ref());
            assert_eq!(classes(&svg), ["ours-eager", "ours-graph"]);
            assert!(!svg.contains("PyTorch"));
        }
    }

    #[test]
    fn older_pytorch_json_with_nan_reads_as_null() {
        let old = r#"{"rows": [{"workload": "NaN-named", "config": "x", "eager_us": NaN,
            "graph_us" :NaN, "speedup": NaN}], "notes": ["NaN stays in text"]}"#;
        let fixed = nan_to_null(old);
        assert!(fixed.contains(r#""workload": "NaN-named""#), "{fixed}");
        assert!(fixed.contains("NaN stays in text"), "{fixed}");
        let b: Baseline = serde_json::from_str(&fixed).unwrap();
        assert_eq!((b.rows[0].eager_us, b.rows[0].graph_us), (None, None));
    }

    #[test]
    fn pytorch_json_with_nulls_reads() {
        let b = baseline();
        assert_eq!(b.rows[1].graph_us, None);
        assert_eq!(b.rows[0].eager_us, Some(523.4));
    }
}
