//! `cudagraph bench engines`: runs a representative list of products (Linear forward, dX, dW with
//! the bias gradient) and convolutions (forward, backward-data, backward-filter) eagerly through
//! the engine registry, which measures every candidate on first use, and prints the registry's
//! table: each key, the engine chosen and the µs of every candidate. By default the choices
//! cached on disk are forgotten first, so everything is measured in this run (`--cached` shows
//! them as they were measured before).

use clap::Args;
use cudagraph::{Device, DeviceBuffer, QueueExt, Stream};
use cudagraph_nn::engine::conv::ConvGeom;
use cudagraph_nn::engine::conv::{conv2d_backward_data, conv2d_backward_filter, conv2d_forward};
use cudagraph_nn::engine::gemm::Trans;
use cudagraph_nn::engine::gemm::{gemm, linear_weight_grad, GemmFamily};
use cudagraph_nn::engine::{format_table, EngineRow, Engines};
use cudagraph_nn::Nn;
use serde::Serialize;

use crate::report::{device_report, DeviceReport};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Args, Debug)]
pub struct EnginesArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// A short list (three batch sizes, four convolutions).
    #[arg(long)]
    pub quick: bool,
    /// Keep the choices cached on disk instead of measuring everything again.
    #[arg(long)]
    pub cached: bool,
}

/// Linear layers: (batch m, in k, out n).
fn linear_shapes(quick: bool) -> Vec<(usize, usize, usize)> {
    let ms: &[usize] = if quick {
        &[1, 32, 512]
    } else {
        &[1, 8, 32, 128, 512]
    };
    let kn: &[(usize, usize)] = if quick {
        &[(1024, 1024)]
    } else {
        &[(256, 256), (1024, 1024), (1024, 4096), (4096, 4096)]
    };
    ms.iter()
        .flat_map(|&m| kn.iter().map(move |&(k, n)| (m, k, n)))
        .collect()
}

/// Convolutions: (n, c, h=w, oc, kernel, stride, pad, what).
#[allow(clippy::type_complexity)]
fn conv_shapes(quick: bool) -> Vec<(ConvGeom, &'static str)> {
    let g = ConvGeom::square;
    let all = vec![
        (g(8, 3, 32, 16, 3, 1, 1), "small CNN conv1"),
        (g(64, 1, 28, 6, 5, 1, 0), "LeNet conv1"),
        (g(64, 6, 12, 16, 5, 1, 0), "LeNet conv2"),
        (g(32, 16, 32, 32, 3, 1, 1), "small CNN conv2"),
        (g(16, 3, 224, 64, 3, 1, 1), "seed shared-pool conv"),
        (g(8, 3, 224, 64, 7, 2, 1), "7x7 stem, stride 2"),
        (g(32, 64, 56, 64, 3, 1, 1), "ResNet-like 3x3"),
        (g(32, 64, 56, 128, 1, 2, 0), "1x1 stride 2"),
        (g(128, 128, 8, 128, 3, 1, 1), "deep, small image"),
        (g(1, 32, 16, 32, 3, 2, 1), "batch 1, stride 2"),
    ];
    if quick {
        all.into_iter().take(4).collect()
    } else {
        all
    }
}

fn zeros(s: &Stream, n: usize) -> AnyResult<DeviceBuffer<f32>> {
    Ok(s.alloc_zeroed::<f32>(n)?)
}

/// Runs every shape once eagerly (the registry measures it) and returns the registry's rows for
/// the keys this run touched.
pub fn measure(dev: &Device, quick: bool, cached: bool) -> AnyResult<Vec<EngineRow>> {
    let nn = Nn::get(dev)?;
    let eng = Engines::get(dev)?;
    if !cached {
        eng.clear();
    }
    let s = dev.new_stream()?;
    for (m, k, n) in linear_shapes(quick) {
        let (x, w, b) = (zeros(&s, m * k)?, zeros(&s, n * k)?, zeros(&s, n)?);
        let (y, dx, dw, db) = (
            zeros(&s, m * n)?,
            zeros(&s, m * k)?,
            zeros(&s, n * k)?,
            zeros(&s, n)?,
        );
        let (nt, nn_) = ((Trans::N, Trans::T), (Trans::N, Trans::N));
        let auto = GemmFamily::Auto;
        gemm(
            &s,
            &nn,
            auto,
            nt,
            (m, n, k),
            1.0,
            &x,
            &w,
            0.0,
            &y,
            Some(&b),
            true,
        )?;
        gemm(
            &s,
            &nn,
            auto,
            nn_,
            (m, k, n),
            1.0,
            &y,
            &w,
            0.0,
            &dx,
            None,
            false,
        )?;
        linear_weight_grad(&s, &nn, auto, (m, n, k), &y, &x, &dw, Some(&db))?;
        s.synchronize()?;
    }
    for (g, _) in conv_shapes(quick) {
        let (x, w, b) = (
            zeros(&s, g.input_len()?)?,
            zeros(&s, g.weight_len()?)?,
            zeros(&s, g.oc)?,
        );
        let y = zeros(&s, g.output_len()?)?;
        let dx = zeros(&s, g.input_len()?)?;
        let dw = zeros(&s, g.weight_len()?)?;
        conv2d_forward(&s, &nn, &g, &x, &w, Some(&b), &y)?;
        conv2d_backward_data(&s, &nn, &g, &y, &w, &dx)?;
        conv2d_backward_filter(&s, &nn, &g, &y, &x, &dw)?;
        s.synchronize()?;
    }
    Ok(eng.table())
}

pub fn run(ordinal: usize, a: &EnginesArgs) -> AnyResult<()> {
    let dev = Device::open(ordinal)?;
    let rows = measure(&dev, a.quick, a.cached)?;
    let eng = Engines::get(&dev)?;
    #[derive(Serialize)]
    struct Out<'a> {
        benchmark: &'static str,
        device: DeviceReport,
        libraries: &'a str,
        policy: String,
        /// The TF32 switches (products; convolutions), as PyTorch's `allow_tf32` pair.
        tf32_matmul: bool,
        tf32_conv: bool,
        rows: Vec<EngineRow>,
    }
    let out = Out {
        benchmark: "engines",
        device: device_report(&dev)?,
        libraries: eng.libraries(),
        policy: format!("{:?}", eng.policy()),
        tf32_matmul: eng.policy().tf32_matmul,
        tf32_conv: eng.policy().tf32_conv,
        rows,
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    outln!(
        "engine choices on {} ({}; {}), µs per run measured eagerly; {}",
        out.device.name,
        out.libraries,
        eng.policy().tf32_summary(),
        match eng.table_path() {
            Some(p) => format!("cached in {}", p.display()),
            None => "disk cache off".into(),
        }
    );
    outln!("{}", format_table(&out.rows).trim_end());
    // Which families won how often.
    let mut wins: std::collections::BTreeMap<String, usize> = Default::default();
    for r in &out.rows {
        let family = r.entry.engine.split(':').next().unwrap_or("?").to_string();
        *wins.entry(family).or_default() += 1;
    }
    let summary: Vec<String> = wins.iter().map(|(f, n)| format!("{f} {n}")).collect();
    outln!("{} keys; chosen: {}", out.rows.len(), summary.join(", "));
    Ok(())
}
