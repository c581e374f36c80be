//! `cudagraph bench rebind`: three ways to run a captured graph on a new input buffer, seed MLP
//! at batch 32: copy into the static input then replay; rebind the graph to the new buffer
//! (executable-graph update, no copy) then replay; capture and instantiate a new graph.

use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use cudagraph::{CaptureOptions, Device, Graph, QueueExt};
use cudagraph_nn::{no_grad, HostRng, NnModule, Tensor};

use crate::bench::workloads::seed_mlp;
use crate::report::median;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Args, Debug)]
pub struct RebindArgs {
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    #[arg(long, default_value_t = 200)]
    pub iters: usize,
}

pub fn run(ordinal: usize, a: &RebindArgs) -> AnyResult<()> {
    let dev = Device::open(ordinal)?;
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(7);
    let model = seed_mlp(&s, &mut rng)?;
    let bs = a.batch;
    let inputs: Vec<_> = (0..2)
        .map(|_| s.alloc_from_host(&rng.vec_normal(bs * 1024)))
        .collect::<Result<_, _>>()?;
    let static_in = Arc::new(s.alloc_zeroed::<f32>(bs * 1024)?);
    let x = Tensor::from_buffer(static_in.clone(), &[bs, 1024])?;
    let (mut g, _y) = Graph::capture(&mut s, CaptureOptions::new().upload(true), |cs| {
        Ok(no_grad(|| model.forward(cs, &x))?)
    })?;
    let time =
        |f: &mut dyn FnMut(usize) -> AnyResult<()>, s: &cudagraph::Stream| -> AnyResult<f64> {
            f(0)?;
            let mut v = Vec::new();
            for _ in 0..5 {
                s.synchronize()?;
                let t = Instant::now();
                for i in 0..a.iters {
                    f(i)?;
                }
                s.synchronize()?;
                v.push(t.elapsed().as_secs_f64() * 1e6 / a.iters as f64);
            }
            Ok(median(v))
        };
    let copy_in = time(
        &mut |i| {
            s.copy(&inputs[i % 2], &static_in)?;
            g.replay(&s)?;
            Ok(())
        },
        &s,
    )?;
    let mut current = static_in.alias();
    let mut outcomes = (0u64, 0u64);
    // A graph holding library kernels cannot be rebound on drivers that cannot list their
    // parameters (before CUDA 13.2): say so and measure the rest.
    let refused = match g.rebind(&current, &inputs[0]) {
        Ok(_) => {
            current = inputs[0].alias();
            None
        }
        Err(e @ cudagraph::Error::NotSupported { .. }) => Some(e.to_string()),
        Err(e) => return Err(e.into()),
    };
    let rebind = if refused.is_some() {
        f64::NAN
    } else {
        time(
            &mut |i| {
                let next = &inputs[i % 2];
                if next.addr() != current.addr() {
                    match g.rebind(&current, next)? {
                        cudagraph::RebindOutcome::Updated { .. } => outcomes.0 += 1,
                        cudagraph::RebindOutcome::Reinstantiated { .. } => outcomes.1 += 1,
                    }
                    current = next.alias();
                }
                g.replay(&s)?;
                Ok(())
            },
            &s,
        )?
    };
    let mut s2 = dev.new_stream()?;
    let recapture_once = |s2: &mut cudagraph::Stream, i: usize| -> AnyResult<()> {
        let xi = Tensor::from_buffer(Arc::new(inputs[i % 2].alias()), &[bs, 1024])?;
        let (g2, _y2) = Graph::capture(s2, CaptureOptions::new(), |cs| {
            Ok(no_grad(|| model.forward(cs, &xi))?)
        })?;
        g2.replay(s2)?;
        Ok(())
    };
    let reps = (a.iters / 10).max(5);
    let mut samples = Vec::new();
    for _ in 0..3 {
        s2.synchronize()?;
        let t = Instant::now();
        for i in 0..reps {
            recapture_once(&mut s2, i)?;
        }
        s2.synchronize()?;
        samples.push(t.elapsed().as_secs_f64() * 1e6 / reps as f64);
    }
    let recapture = median(samples);
    outln!(
        "new input buffer per request, seed MLP batch {bs} on {}",
        dev.info().name
    );
    outln!("  copy into static input + replay: {copy_in:9.2} us/request");
    match &refused {
        None => outln!(
            "  rebind (exec update) + replay:   {rebind:9.2} us/request  ({} updated in place, {} re-instantiated)",
            outcomes.0, outcomes.1
        ),
        Some(why) => outln!("  rebind (exec update) + replay:   not measured: {why}"),
    }
    outln!("  capture + instantiate + replay:  {recapture:9.2} us/request");
    Ok(())
}
