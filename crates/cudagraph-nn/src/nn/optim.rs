//! Optimizers whose whole `step()` is one capturable kernel launch for all parameters
//! (PyTorch's fused, `capturable=True` optimizers): every piece of state — moments, momentum
//! buffers, per-parameter step counts, and the hyperparameters themselves — lives on the
//! device, and nothing is read back to the host.
//!
//! Hyperparameters are device scalars ([`Hyperparameters`]): `set_lr(&stream, v)` and friends
//! write them with a stream-ordered memset, so a captured step uses the new value from the
//! next replay on that stream on — no re-capture. A [`Schedule`] attached with
//! `set_schedule` runs as a one-thread kernel at the start of each `step()` (and so inside a
//! captured step), computing the learning rate from the device step counter.
//!
//! What is not here: dampening, Nesterov momentum, AMSGrad, `maximize`, parameter groups.

use std::sync::Arc;

use cudagraph::{DeviceBuffer, Queue, QueueExt, Stream};

use crate::autograd::tensor::Parameter;
use crate::error::{NnError, Result};
use crate::kernels::optim_mt::{hp, state, AdamTensor, OptimKernels, SgdTensor};
/// Tensors per table of the multi-tensor kernels: small (4 KB of kernel parameters) and large.
pub use crate::kernels::optim_mt::{CAP_L, CAP_S};
use crate::nn::schedule::Schedule;

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
    /// The parameters the optimizer updates, in the order it was given them.
    fn params(&self) -> &[Parameter];

    /// The device-side hyperparameters, for optimizers that keep them there.
    fn hyperparameters(&self) -> Option<&Hyperparameters> {
        None
    }
    /// Mutable access to [`Self::hyperparameters`].
    fn hyperparameters_mut(&mut self) -> Option<&mut Hyperparameters> {
        None
    }
    /// Sets the learning rate (and the base rate a device schedule scales) with a
    /// stream-ordered write on `q`: work enqueued on `q` after this call (the next step, the
    /// next replay of a captured step on that stream) uses it.
    fn set_lr(&mut self, q: &dyn Queue, lr: f32) -> Result<()> {
        self.hyperparameters_mut()
            .ok_or_else(no_hyper)?
            .set_lr(q, lr)
    }
    /// Attaches (or, with `None`, removes) a learning-rate schedule evaluated on the device at
    /// the start of every `step()`. A step captured before this call keeps what it captured.
    fn set_schedule(&mut self, schedule: Option<Schedule>) -> Result<()> {
        self.hyperparameters_mut()
            .ok_or_else(no_hyper)?
            .set_schedule(schedule);
        Ok(())
    }
}

fn no_hyper() -> NnError {
    NnError::Shape("this optimizer keeps no device-side hyperparameters".into())
}

fn bad(what: &str) -> NnError {
    NnError::Shape(format!("optimizer: {what}"))
}

/// Device-side hyperparameters and counters of an optimizer.
///
/// The `f32` buffer holds the slots of `hp` (learning rate, base learning rate, betas,
/// epsilon, weight decay, momentum); the `u32` buffer the slots of `state` (steps completed
/// and the kernels' ticket). Setters write with `fill32` on the given queue: stream-ordered,
/// no host synchronisation, legal inside a capture (where they become memset nodes that reset
/// the value at every replay).
pub struct Hyperparameters {
    hp: DeviceBuffer<f32>,
    state: DeviceBuffer<u32>,
    host: [f32; hp::LEN],
    schedule: Option<(Schedule, Vec<u8>)>,
}

impl Hyperparameters {
    fn new(s: &Stream, values: [f32; hp::LEN]) -> Result<Self> {
        Ok(Self {
            hp: s.alloc_from_host(&values)?,
            state: s.alloc_zeroed::<u32>(state::LEN)?,
            host: values,
            schedule: None,
        })
    }

    /// Writes slot `slot` (one of `hp`'s constants) on `q`.
    pub fn set(&mut self, q: &dyn Queue, slot: usize, value: f32) -> Result<()> {
        if slot >= hp::LEN {
            return Err(bad(&format!("hyperparameter slot {slot} of {}", hp::LEN)));
        }
        q.fill32(&self.hp, slot, 1, value)?;
        self.host[slot] = value;
        Ok(())
    }

    /// Sets the learning rate and the base rate (see [`Optimizer::set_lr`]).
    pub fn set_lr(&mut self, q: &dyn Queue, lr: f32) -> Result<()> {
        check_lr(lr)?;
        self.set(q, hp::LR, lr)?;
        self.set(q, hp::BASE_LR, lr)
    }

    /// The value last set from the host for `slot` (a device schedule changes the device's
    /// learning rate without updating this; read the device with [`Self::read`]).
    pub fn host_value(&self, slot: usize) -> Option<f32> {
        self.host.get(slot).copied()
    }

    /// Reads every slot back from the device (synchronises `s`).
    pub fn read(&self, s: &Stream) -> Result<[f32; hp::LEN]> {
        let v = s.to_vec(&self.hp)?;
        let mut out = [0.0; hp::LEN];
        out.copy_from_slice(&v[..hp::LEN]);
        Ok(out)
    }

    /// Optimizer steps completed, read from the device (synchronises `s`).
    pub fn step_count(&self, s: &Stream) -> Result<u32> {
        Ok(s.to_vec(&self.state)?[state::STEP])
    }

    /// Sets the device step count (what a schedule reads), e.g. to resume training.
    pub fn set_step_count(&mut self, q: &dyn Queue, steps: u32) -> Result<()> {
        q.fill32(&self.state, state::STEP, 1, steps)?;
        Ok(())
    }

    /// The hyperparameter buffer (layout: `hp`).
    pub fn buffer(&self) -> &DeviceBuffer<f32> {
        &self.hp
    }

    /// The state buffer (layout: `state`).
    pub fn state_buffer(&self) -> &DeviceBuffer<u32> {
        &self.state
    }

    /// Attaches or removes the device-side schedule.
    pub fn set_schedule(&mut self, schedule: Option<Schedule>) {
        self.schedule = schedule.map(|s| {
            let p = s.program();
            (s, p)
        });
    }

    /// The attached schedule.
    pub fn schedule(&self) -> Option<&Schedule> {
        self.schedule.as_ref().map(|(s, _)| s)
    }

    /// Enqueues the schedule node, if any.
    fn before_step(&self, q: &dyn Queue, k: &OptimKernels) -> Result<()> {
        if let Some((_, program)) = &self.schedule {
            k.lr_schedule(q, program, &self.hp, &self.state)?;
        }
        Ok(())
    }
}

fn check_lr(lr: f32) -> Result<()> {
    if lr.is_finite() && lr >= 0.0 {
        Ok(())
    } else {
        Err(bad(&format!("invalid learning rate {lr}")))
    }
}

fn check_nonneg(name: &str, v: f32) -> Result<()> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(bad(&format!("invalid {name} {v}")))
    }
}

fn check_beta(name: &str, v: f32) -> Result<()> {
    if (0.0..1.0).contains(&v) {
        Ok(())
    } else {
        Err(bad(&format!("invalid {name} {v} (must be in [0, 1))")))
    }
}

/// Parameters must not share their data (an update would be applied twice, concurrently).
fn check_distinct(params: &[Parameter]) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for p in params {
        if !p.data().is_empty() && !seen.insert(p.data().addr()) {
            return Err(bad(&format!(
                "parameter {} appears more than once (or shares its data with another)",
                p.name()
            )));
        }
    }
    Ok(())
}

/// SGD's hyperparameters (PyTorch's names; dampening 0, no Nesterov).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor (0: plain SGD).
    pub momentum: f32,
    /// L2 penalty: `weight_decay·w` is added to the gradient (0: none).
    pub weight_decay: f32,
}

impl Default for SgdConfig {
    /// PyTorch's defaults: lr 1e-3, no momentum, no weight decay.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            momentum: 0.0,
            weight_decay: 0.0,
        }
    }
}

/// SGD with optional momentum and weight decay: one fused launch per step.
pub struct Sgd {
    params: Vec<Parameter>,
    bufs: Vec<Option<DeviceBuffer<f32>>>,
    hyper: Hyperparameters,
}

impl Sgd {
    /// SGD with learning rate `lr`, `momentum` and `weight_decay`.
    pub fn new(
        s: &Stream,
        params: Vec<Parameter>,
        lr: f32,
        momentum: f32,
        weight_decay: f32,
    ) -> Result<Self> {
        Self::with_config(
            s,
            params,
            SgdConfig {
                lr,
                momentum,
                weight_decay,
            },
        )
    }

    /// SGD from a [`SgdConfig`]. Momentum buffers exist when `momentum != 0` (then
    /// [`Self::set_momentum`] can change it later; without them it must stay 0).
    pub fn with_config(s: &Stream, params: Vec<Parameter>, cfg: SgdConfig) -> Result<Self> {
        check_lr(cfg.lr)?;
        check_nonneg("momentum", cfg.momentum)?;
        check_nonneg("weight decay", cfg.weight_decay)?;
        check_distinct(&params)?;
        let bufs = params
            .iter()
            .map(|p| {
                Ok(if cfg.momentum != 0.0 {
                    Some(s.alloc_zeroed::<f32>(p.numel())?)
                } else {
                    None
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut v = [0.0; hp::LEN];
        v[hp::LR] = cfg.lr;
        v[hp::BASE_LR] = cfg.lr;
        v[hp::MOMENTUM] = cfg.momentum;
        v[hp::WEIGHT_DECAY] = cfg.weight_decay;
        Ok(Self {
            params,
            bufs,
            hyper: Hyperparameters::new(s, v)?,
        })
    }

    /// The hyperparameters last set from the host.
    pub fn config(&self) -> SgdConfig {
        SgdConfig {
            lr: self.hyper.host[hp::LR],
            momentum: self.hyper.host[hp::MOMENTUM],
            weight_decay: self.hyper.host[hp::WEIGHT_DECAY],
        }
    }

    /// Sets the momentum on the device (needs momentum buffers unless `momentum` is 0).
    pub fn set_momentum(&mut self, q: &dyn Queue, momentum: f32) -> Result<()> {
        check_nonneg("momentum", momentum)?;
        if momentum != 0.0 && self.bufs.iter().any(Option::is_none) {
            return Err(bad(
                "this SGD was created without momentum, so it has no momentum buffers",
            ));
        }
        self.hyper.set(q, hp::MOMENTUM, momentum)
    }

    /// Sets the weight decay on the device.
    pub fn set_weight_decay(&mut self, q: &dyn Queue, wd: f32) -> Result<()> {
        check_nonneg("weight decay", wd)?;
        self.hyper.set(q, hp::WEIGHT_DECAY, wd)
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, q: &dyn Queue) -> Result<()> {
        let k = OptimKernels::get(q.device())?;
        self.hyper.before_step(q, &k)?;
        let grads: Vec<(usize, Arc<DeviceBuffer<f32>>)> = self
            .params
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.grad().map(|g| (i, g)))
            .collect();
        let tensors: Vec<SgdTensor<'_>> = grads
            .iter()
            .map(|(i, g)| SgdTensor {
                w: self.params[*i].data(),
                g,
                buf: self.bufs[*i].as_ref(),
            })
            .collect();
        k.sgd(q, &tensors, &self.hyper.hp, &self.hyper.state, true)
    }

    fn params(&self) -> &[Parameter] {
        &self.params
    }

    fn hyperparameters(&self) -> Option<&Hyperparameters> {
        Some(&self.hyper)
    }

    fn hyperparameters_mut(&mut self) -> Option<&mut Hyperparameters> {
        Some(&mut self.hyper)
    }
}

/// Adam's hyperparameters (PyTorch's names). `decoupled` selects AdamW's weight decay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f32,
    /// Decay rate of the running mean of gradients (PyTorch's `betas[0]`).
    pub beta1: f32,
    /// Decay rate of the running mean of squared gradients (PyTorch's `betas[1]`).
    pub beta2: f32,
    /// Added to the denominator for numerical stability.
    pub eps: f32,
    /// Weight decay factor (0: none); how it applies depends on `decoupled`.
    pub weight_decay: f32,
    /// AdamW: decay the weights directly (`w ← w·(1 − lr·wd)`) instead of adding `wd·w` to
    /// the gradient.
    pub decoupled: bool,
}

impl Default for AdamConfig {
    /// PyTorch's `Adam` defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, no weight decay.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
        }
    }
}

impl AdamConfig {
    /// PyTorch's `AdamW` defaults: as Adam, with decoupled weight decay 1e-2.
    pub fn adamw() -> Self {
        Self {
            weight_decay: 1e-2,
            decoupled: true,
            ..Self::default()
        }
    }
}

/// Adam, or AdamW with `decoupled` weight decay: one fused launch per step, per-parameter
/// step counts on the device (as PyTorch's `capturable=True`).
pub struct Adam {
    params: Vec<Parameter>,
    m: Vec<DeviceBuffer<f32>>,
    v: Vec<DeviceBuffer<f32>>,
    steps: DeviceBuffer<u32>,
    decoupled: bool,
    hyper: Hyperparameters,
}

impl Adam {
    /// Adam (or AdamW when `decoupled`) with learning rate `lr`, weight decay
    /// `weight_decay`, betas (0.9, 0.999) and eps 1e-8.
    pub fn new(
        s: &Stream,
        params: Vec<Parameter>,
        lr: f32,
        weight_decay: f32,
        decoupled: bool,
    ) -> Result<Self> {
        Self::with_config(
            s,
            params,
            AdamConfig {
                lr,
                weight_decay,
                decoupled,
                ..AdamConfig::default()
            },
        )
    }

    /// Adam from an [`AdamConfig`].
    pub fn with_config(s: &Stream, params: Vec<Parameter>, cfg: AdamConfig) -> Result<Self> {
        check_lr(cfg.lr)?;
        check_beta("beta1", cfg.beta1)?;
        check_beta("beta2", cfg.beta2)?;
        check_nonneg("eps", cfg.eps)?;
        check_nonneg("weight decay", cfg.weight_decay)?;
        check_distinct(&params)?;
        let zeros = |p: &Parameter| s.alloc_zeroed::<f32>(p.numel());
        let mut v = [0.0; hp::LEN];
        v[hp::LR] = cfg.lr;
        v[hp::BASE_LR] = cfg.lr;
        v[hp::BETA1] = cfg.beta1;
        v[hp::BETA2] = cfg.beta2;
        v[hp::EPS] = cfg.eps;
        v[hp::WEIGHT_DECAY] = cfg.weight_decay;
        Ok(Self {
            m: params.iter().map(zeros).collect::<Result<_, _>>()?,
            v: params.iter().map(zeros).collect::<Result<_, _>>()?,
            steps: s.alloc_zeroed::<u32>(params.len().max(1))?,
            params,
            decoupled: cfg.decoupled,
            hyper: Hyperparameters::new(s, v)?,
        })
    }

    /// AdamW from an [`AdamConfig`] (forces `decoupled`).
    pub fn adamw(s: &Stream, params: Vec<Parameter>, cfg: AdamConfig) -> Result<Self> {
        Self::with_config(
            s,
            params,
            AdamConfig {
                decoupled: true,
                ..cfg
            },
        )
    }

    /// The hyperparameters last set from the host.
    pub fn config(&self) -> AdamConfig {
        let h = &self.hyper.host;
        AdamConfig {
            lr: h[hp::LR],
            beta1: h[hp::BETA1],
            beta2: h[hp::BETA2],
            eps: h[hp::EPS],
            weight_decay: h[hp::WEIGHT_DECAY],
            decoupled: self.decoupled,
        }
    }

    /// Sets the betas on the device.
    pub fn set_betas(&mut self, q: &dyn Queue, beta1: f32, beta2: f32) -> Result<()> {
        check_beta("beta1", beta1)?;
        check_beta("beta2", beta2)?;
        self.hyper.set(q, hp::BETA1, beta1)?;
        self.hyper.set(q, hp::BETA2, beta2)
    }

    /// Sets epsilon on the device.
    pub fn set_eps(&mut self, q: &dyn Queue, eps: f32) -> Result<()> {
        check_nonneg("eps", eps)?;
        self.hyper.set(q, hp::EPS, eps)
    }

    /// Sets the weight decay on the device.
    pub fn set_weight_decay(&mut self, q: &dyn Queue, wd: f32) -> Result<()> {
        check_nonneg("weight decay", wd)?;
        self.hyper.set(q, hp::WEIGHT_DECAY, wd)
    }

    /// Each parameter's step count (PyTorch's `state[p]["step"]`), read from the device.
    pub fn step_counts(&self, s: &Stream) -> Result<Vec<u32>> {
        let mut v = s.to_vec(&self.steps)?;
        v.truncate(self.params.len());
        Ok(v)
    }
}

impl Optimizer for Adam {
    fn step(&mut self, q: &dyn Queue) -> Result<()> {
        let k = OptimKernels::get(q.device())?;
        self.hyper.before_step(q, &k)?;
        let grads: Vec<(usize, Arc<DeviceBuffer<f32>>)> = self
            .params
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.grad().map(|g| (i, g)))
            .collect();
        let tensors = grads
            .iter()
            .map(|(i, g)| {
                Ok(AdamTensor {
                    w: self.params[*i].data(),
                    g,
                    m: &self.m[*i],
                    v: &self.v[*i],
                    slot: u32::try_from(*i).map_err(|_| bad("more than 2^32 parameters"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        k.adam(
            q,
            &tensors,
            &self.hyper.hp,
            &self.hyper.state,
            &self.steps,
            self.decoupled,
            true,
        )
    }

    fn params(&self) -> &[Parameter] {
        &self.params
    }

    fn hyperparameters(&self) -> Option<&Hyperparameters> {
        Some(&self.hyper)
    }

    fn hyperparameters_mut(&mut self) -> Option<&mut Hyperparameters> {
        Some(&mut self.hyper)
    }
}
