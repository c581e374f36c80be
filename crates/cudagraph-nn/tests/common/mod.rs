//! Shared pieces of the failure tests: a small model trained with DDP, and a hard deadline
//! that turns a hang into a failed test binary (a hung test would stall the whole GPU run).

#![allow(dead_code)]

use std::sync::mpsc::{channel, RecvTimeoutError};
use std::time::Duration;

use cudagraph::Stream;
use cudagraph_nn::*;

/// Runs `f` on a thread and returns its result, or exits the test process with an error
/// after `secs` seconds.
pub fn with_deadline<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(v) => v,
        Err(RecvTimeoutError::Timeout) => {
            eprintln!("HUNG: the test did not finish within {secs} s");
            std::process::exit(1);
        }
        Err(RecvTimeoutError::Disconnected) => panic!("the test body panicked (see above)"),
    }
}

/// Linear(64, 64) -> ReLU -> Linear(64, 8), SGD, on this rank's 16 rows.
pub struct Trainer {
    pub model: Sequential,
    pub ddp: DistributedDataParallel,
    pub opt: Sgd,
    pub x: Tensor,
    pub y: Tensor,
}

impl Trainer {
    pub fn new(s: &Stream, comm: &Communicator) -> Result<Self> {
        let mut rng = HostRng::new(11);
        let model = Sequential::new(vec![
            Layer::Linear(Linear::new(s, 64, 64, &mut rng)?),
            Layer::ReLU,
            Layer::Linear(Linear::new(s, 64, 8, &mut rng)?),
        ]);
        let ddp = DistributedDataParallel::new(s, comm, model.parameters(), DdpOptions::default())?;
        let opt = Sgd::new(s, model.parameters(), 0.01, 0.0, 0.0)?;
        let mut data = HostRng::new(100 + comm.rank() as u64);
        let x = Tensor::from_host(s, &data.vec_normal(16 * 64), &[16, 64])?;
        let y = Tensor::from_host(s, &data.vec_normal(16 * 8), &[16, 8])?;
        Ok(Trainer {
            model,
            ddp,
            opt,
            x,
            y,
        })
    }

    /// One eager step (nothing waits for it).
    pub fn step(&mut self, s: &Stream) -> Result<()> {
        self.opt.zero_grad(s, true)?;
        let loss = mse_loss(
            s,
            &self.model.forward(s, &self.x)?,
            &self.y,
            Reduction::Mean,
        )?;
        self.ddp.backward(s, &loss)?;
        self.opt.step(s)
    }
}
