//! Optimizers whose whole `step()` is capturable: all state, including Adam's step count, lives
//! on the device (PyTorch's `capturable=True`), and nothing is read back to the host.

use cudagraph::{DeviceBuffer, Queue, QueueExt, Stream};

use crate::error::Result;
use crate::kernels::Nn;
use crate::tensor::Parameter;

/// Common optimizer interface.
pub trait Optimizer {
    /// PyTorch's `zero_grad(set_to_none)`.
    fn zero_grad(&self, q: &dyn Queue, set_to_none: bool) -> Result<()> {
        for p in self.params() {
            p.zero_grad(q, set_to_none)?;
        }
        Ok(())
    }
    /// One update of every parameter that has a gradient.
    fn step(&mut self, q: &dyn Queue) -> Result<()>;
    fn params(&self) -> &[Parameter];
}

/// SGD with optional momentum and weight decay.
pub struct Sgd {
    params: Vec<Parameter>,
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    bufs: Vec<Option<DeviceBuffer<f32>>>,
}

impl Sgd {
    pub fn new(
        s: &Stream,
        params: Vec<Parameter>,
        lr: f32,
        momentum: f32,
        weight_decay: f32,
    ) -> Result<Self> {
        let bufs = params
            .iter()
            .map(|p| {
                if momentum != 0.0 {
                    Ok(Some(
                        s.alloc_zeroed::<f32>(p.numel())
                            .map_err(crate::NnError::from)?,
                    ))
                } else {
                    Ok(None)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            params,
            lr,
            momentum,
            weight_decay,
            bufs,
        })
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, q: &dyn Queue) -> Result<()> {
        let nn = Nn::get(q.device())?;
        for (p, buf) in self.params.iter().zip(&self.bufs) {
            let Some(g) = p.grad() else { continue };
            nn.sgd_step(
                q,
                p.data(),
                &g,
                buf.as_ref(),
                self.lr,
                self.momentum,
                self.weight_decay,
            )?;
        }
        Ok(())
    }

    fn params(&self) -> &[Parameter] {
        &self.params
    }
}

/// Adam, or AdamW with `decoupled` weight decay; the step count is a device scalar.
pub struct Adam {
    params: Vec<Parameter>,
    pub lr: f32,
    pub betas: (f32, f32),
    pub eps: f32,
    pub weight_decay: f32,
    pub decoupled: bool,
    m: Vec<DeviceBuffer<f32>>,
    v: Vec<DeviceBuffer<f32>>,
    step: DeviceBuffer<f32>,
}

impl Adam {
    /// PyTorch's defaults: betas (0.9, 0.999), eps 1e-8.
    pub fn new(
        s: &Stream,
        params: Vec<Parameter>,
        lr: f32,
        weight_decay: f32,
        decoupled: bool,
    ) -> Result<Self> {
        let zeros = |p: &Parameter| s.alloc_zeroed::<f32>(p.numel());
        Ok(Self {
            m: params.iter().map(zeros).collect::<Result<_, _>>()?,
            v: params.iter().map(zeros).collect::<Result<_, _>>()?,
            step: s.alloc_zeroed::<f32>(1)?,
            params,
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay,
            decoupled,
        })
    }

    /// The device-side step counter.
    pub fn step_buffer(&self) -> &DeviceBuffer<f32> {
        &self.step
    }
}

impl Optimizer for Adam {
    fn step(&mut self, q: &dyn Queue) -> Result<()> {
        let nn = Nn::get(q.device())?;
        nn.step_inc(q, &self.step)?;
        let hp = [
            self.lr,
            self.betas.0,
            self.betas.1,
            self.eps,
            self.weight_decay,
        ];
        for ((p, m), v) in self.params.iter().zip(&self.m).zip(&self.v) {
            let Some(g) = p.grad() else { continue };
            nn.adam_step(q, p.data(), &g, m, v, &self.step, hp, self.decoupled)?;
        }
        Ok(())
    }

    fn params(&self) -> &[Parameter] {
        &self.params
    }
}
