//! A whole training step (forward, backward, Adam) captured into one graph and replayed.
//! Run on a GPU machine: `cargo run --release -p cudagraph-nn --example train_step`.

use cudagraph::{CaptureOptions, Device, Graph};
use cudagraph_nn::*;

fn main() -> Result<()> {
    let dev = Device::open(0)?;
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(0);
    let model = Linear::new(&s, 1024, 1024, &mut rng)?;
    let mut opt = Adam::new(&s, model.parameters(), 1e-3, 0.0, false)?;
    let x = Tensor::from_host(&s, &rng.vec_normal(64 * 1024), &[64, 1024])?; // static input
    let y = Tensor::from_host(&s, &rng.vec_normal(64 * 1024), &[64, 1024])?; // static target

    // Forward, backward, optimizer step — captured once.
    let (step, loss) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        opt.zero_grad(cs, true)?; // set_to_none: backward writes fresh gradients, no memset
        let loss = mse_loss(cs, &model.forward(cs, &x)?, &y, Reduction::Sum)?;
        loss.backward(cs)?;
        opt.step(cs)?; // Adam's step count lives on the device
        Ok(loss)
    })
    .map_err(NnError::from)?;

    for _ in 0..100 {
        // copy the next batch into x and y here, then:
        step.replay(&s)?;
    }
    println!("loss {}", loss.to_vec(&s)?[0]);
    println!(
        "{}",
        cudagraph::memory::format_memory_line(&dev.memory_stats())
    );
    println!("{step:?}");
    Ok(())
}
