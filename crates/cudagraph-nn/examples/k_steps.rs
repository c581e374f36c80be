//! k training steps per graph launch from a dataset resident on the device, with non-finite
//! steps skipped by an IF node (README example).

use cudagraph::{CaptureOptions, Device, Graph, QueueExt};
use cudagraph_nn::{io::datasets::digits, *};
use std::sync::Arc;

fn main() -> Result<()> {
    let dev = Device::open(0)?;
    let mut s = dev.new_stream()?;
    let data = digits()?;
    let (b, k) = (64, 8); // batch size, steps per launch
    let batches = DeviceBatches::new(&s, &data.images, &data.labels, 64, b)?;
    let mut rng = HostRng::new(0);
    let model = Sequential::new(vec![
        Layer::Linear(Linear::new(&s, 64, 128, &mut rng)?),
        Layer::ReLU,
        Layer::Linear(Linear::new(&s, 128, 10, &mut rng)?),
    ]);
    let mut opt = Adam::new(&s, model.parameters(), 2e-3, 0.0, false)?;
    let xb = s.alloc_zeroed::<f32>(b * 64)?;
    let yb = Arc::new(s.alloc_zeroed::<i32>(b)?);
    let x = Tensor::from_buffer(Arc::new(xb.alias()), &[b, 64])?;

    let (graph, loss) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        Ok(batches.train_steps(cs, k, &xb, &yb, |body| {
            opt.zero_grad(body, true)?;
            let loss = cross_entropy(body, &model.forward(body, &x)?, &yb)?;
            loss.backward(body)?;
            step_if_finite(body, &mut opt, &loss)?; // IF node inside the WHILE body
            Ok(loss)
        })?)
    })
    .map_err(NnError::from)?;
    for _epoch in 0..10 {
        batches.rewind(&s)?;
        for _ in 0..batches.batches().div_ceil(k as usize) {
            graph.replay(&s)?; // k steps, no host work in between
        }
    }
    println!(
        "loss {} ({:?})",
        loss.to_vec(&s)?[0],
        graph.info().conditionals
    );
    Ok(())
}
