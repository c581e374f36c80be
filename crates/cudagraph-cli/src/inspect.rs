//! `cudagraph inspect`: captures one of the workloads and shows what is in the graph: node
//! counts by kind (conditional IF/WHILE nodes and their bodies, programmatic PDL edges
//! included), memory, capture and instantiate time, the engine chosen for every product and
//! convolution (the workload runs once eagerly first, so the engines are measured), and two DOT
//! files: the driver's verbose dump and a compact topology (conditional bodies as clusters, PDL
//! edges dashed), plus SVGs when Graphviz's `dot` is installed. `CUDAGRAPH_PDL=1` shows the NN
//! kernels' programmatic edges.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use clap::{Args, ValueEnum};
use cudagraph::{CaptureOptions, Device, Graph, QueueExt};
use cudagraph_nn::engine::{format_table, Engines};
use cudagraph_nn::{
    cross_entropy, mse_loss, no_grad, step_if_finite, Adam, DeviceBatches, HostRng, Layer, Linear,
    NnModule, Optimizer, Reduction, Sequential, Sgd, Tensor,
};

use crate::bench::workloads::seed_mlp;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Which {
    /// Seed 002's MLP inference at batch 32.
    Mlp,
    /// Seed 001's Linear(1024, 1024) training step with SGD.
    Train,
    /// Four MLP training steps per launch (a WHILE node loading batches on the device), each
    /// optimizer step inside an IF node that skips non-finite steps.
    Loop,
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    #[arg(value_enum, default_value_t = Which::Mlp)]
    pub which: Which,
    /// Where to write the DOT file (an SVG is written beside it when `dot` is available).
    #[arg(long, default_value = "graph.dot")]
    pub dot: PathBuf,
}

pub fn run(ordinal: usize, a: &InspectArgs) -> AnyResult<()> {
    let dev = Device::open(ordinal)?;
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(8);
    // Measure this workload's engines afresh (in memory; the disk table keeps other choices).
    Engines::get(&dev)?.clear();
    let graph = match a.which {
        Which::Mlp => {
            let model = seed_mlp(&s, &mut rng)?;
            let x = Tensor::from_buffer(Arc::new(s.alloc_zeroed::<f32>(32 * 1024)?), &[32, 1024])?;
            // Warm-up: the engine registry measures every product before the capture.
            no_grad(|| model.forward(&s, &x))?;
            Graph::capture(&mut s, CaptureOptions::new(), |cs| {
                Ok(no_grad(|| model.forward(cs, &x))?)
            })?
            .0
        }
        Which::Train => {
            let model = Linear::new(&s, 1024, 1024, &mut rng)?;
            let mut opt = Sgd::new(&s, model.parameters(), 1e-3, 0.0, 0.0)?;
            let x = Tensor::from_host(&s, &rng.vec_normal(64 * 1024), &[64, 1024])?;
            let y = Tensor::from_host(&s, &rng.vec_normal(64 * 1024), &[64, 1024])?;
            // Warm-up (forward and backward, no update): measures every product's engine.
            opt.zero_grad(&s, true)?;
            mse_loss(&s, &model.forward(&s, &x)?, &y, Reduction::Sum)?.backward(&s)?;
            Graph::capture(&mut s, CaptureOptions::new(), |cs| {
                opt.zero_grad(cs, true)?;
                let loss = mse_loss(cs, &model.forward(cs, &x)?, &y, Reduction::Sum)?;
                loss.backward(cs)?;
                opt.step(cs)?;
                Ok(())
            })?
            .0
        }
        Which::Loop => {
            let (rows, features) = (32usize, 64usize);
            let model = Sequential::new(vec![
                Layer::Linear(Linear::new(&s, features, 128, &mut rng)?),
                Layer::ReLU,
                Layer::Linear(Linear::new(&s, 128, 10, &mut rng)?),
            ]);
            let mut opt = Adam::new(&s, model.parameters(), 1e-3, 0.0, false)?;
            let images = rng.vec_normal(8 * rows * features);
            let labels: Vec<i32> = (0..8 * rows).map(|i| (i % 10) as i32).collect();
            let data = DeviceBatches::new(&s, &images, &labels, features, rows)?;
            let xb = s.alloc_zeroed::<f32>(rows * features)?;
            let yb = Arc::new(s.alloc_zeroed::<i32>(rows)?);
            let x = Tensor::from_buffer(Arc::new(xb.alias()), &[rows, features])?;
            Graph::capture(&mut s, CaptureOptions::new(), |cs| {
                Ok(data.train_steps(cs, 4, &xb, &yb, |body| {
                    opt.zero_grad(body, true)?;
                    let loss = cross_entropy(body, &model.forward(body, &x)?, &yb)?;
                    loss.backward(body)?;
                    step_if_finite(body, &mut opt, &loss)?;
                    Ok(())
                })?)
            })?
            .0
        }
    };
    let i = graph.info();
    outln!("{graph:?}");
    outln!(
        "nodes: {} kernel, {} memcpy, {} memset, {} host, {} child, {} empty, {} conditional, {} other",
        i.nodes.kernel,
        i.nodes.memcpy,
        i.nodes.memset,
        i.nodes.host,
        i.nodes.child_graph,
        i.nodes.empty,
        i.nodes.conditional,
        i.nodes.other
    );
    let c = &i.conditionals;
    if c.if_nodes + c.while_nodes > 0 {
        let b = &c.body_nodes;
        outln!(
            "conditional nodes (all depths): {} IF, {} WHILE; their bodies hold {} nodes ({} kernel, {} memcpy, {} memset, {} conditional)",
            c.if_nodes,
            c.while_nodes,
            b.total(),
            b.kernel,
            b.memcpy,
            b.memset,
            b.conditional
        );
    }
    outln!(
        "programmatic (PDL) edges: {}{}",
        i.programmatic_edges,
        if cudagraph_nn::pdl_enabled(&dev) {
            " (NN kernels launched with PDL)"
        } else {
            " (set CUDAGRAPH_PDL=1 on an sm_90+ device to launch NN kernels with PDL)"
        }
    );
    outln!(
        "memory: working set {:.3} MB in {}, outputs {:.3} MB, external buffers held {:.3} MB",
        i.memory.peak_allocated as f64 / 1048576.0,
        i.memory.pool,
        i.memory.live_at_end as f64 / 1048576.0,
        i.memory.external_held as f64 / 1048576.0
    );
    outln!(
        "capture {:.3} ms, instantiate {:.3} ms",
        i.capture_time.as_secs_f64() * 1e3,
        i.instantiate_time.as_secs_f64() * 1e3
    );
    let engines = Engines::get(&dev)?;
    outln!(
        "engines ({}; {}):",
        engines.libraries(),
        engines.policy().tf32_summary()
    );
    outln!("{}", format_table(&engines.table()).trim_end());
    graph.write_dot(&a.dot)?;
    outln!("DOT written to {}", a.dot.display());
    svg(&a.dot);
    let topo = a.dot.with_extension("topo.dot");
    graph.write_topology_dot(&topo)?;
    outln!(
        "topology DOT (conditional bodies as clusters, PDL edges dashed) written to {}",
        topo.display()
    );
    svg(&topo);
    Ok(())
}

/// Renders `dot` to an SVG beside it when Graphviz is installed.
fn svg(dot: &std::path::Path) {
    let svg = dot.with_extension("svg");
    match Command::new("dot")
        .arg("-Tsvg")
        .arg(dot)
        .arg("-o")
        .arg(&svg)
        .status()
    {
        Ok(st) if st.success() => outln!("SVG written to {}", svg.display()),
        _ => outln!(
            "(install Graphviz for an SVG: dot -Tsvg {} -o {})",
            dot.display(),
            svg.display()
        ),
    }
}
