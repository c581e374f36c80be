//! Dropout in a graphed training step: fresh masks on every replay, the same masks as eager
//! steps with the same seed (README example).

use cudagraph::{CaptureOptions, Device, Graph};
use cudagraph_nn::*;

fn main() -> Result<()> {
    let dev = Device::open(0)?;
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(0);
    let model = Sequential::new(vec![
        Layer::Linear(Linear::new(&s, 64, 128, &mut rng)?),
        Layer::ReLU,
        Layer::Dropout { p: 0.2 },
        Layer::Linear(Linear::new(&s, 128, 10, &mut rng)?),
    ])
    .with_generator(Generator::new(&s, 1234)?); // seed and counter live on the device
    let mut opt = Adam::new(&s, model.parameters(), 1e-3, 0.0, false)?;
    let x = Tensor::from_host(&s, &rng.vec_normal(32 * 64), &[32, 64])?; // static input
    let y = Targets::from_host(&s, &[3; 32], 10)?; // static targets

    let (step, loss) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        opt.zero_grad(cs, true)?;
        let loss = cross_entropy(cs, &model.forward(cs, &x)?, &y)?; // new mask every replay
        loss.backward(cs)?;
        opt.step(cs)?;
        Ok(loss)
    })
    .map_err(NnError::from)?;
    for _ in 0..100 {
        step.replay(&s)?; // same masks as 100 eager steps with seed 1234
    }
    println!("loss {}", loss.to_vec(&s)?[0]);
    Ok(())
}
