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
//! Mixed precision ([`OptimOptions`]): the parameters stay f32 (the masters) and their
//! gradients f32; with `copies: Some(Dtype::Bf16)` (or `F16`) the optimizer also keeps a
//! 16-bit copy of every parameter ([`Optimizer::copies`]), made from the masters at
//! construction and rewritten by the same fused kernel that updates them: each copy element
//! is the new master value rounded to nearest even, bit for bit what
//! [`crate::cast::to_bf16`] / [`crate::cast::to_f16`] would give. Under a
//! [`GradScaler`](crate::nn::scaler::GradScaler) the same kernel also unscales the gradients
//! and skips the whole update on the device when the scaler found an inf or NaN.
//!
//! Pure 16-bit training: parameters stored only in bf16 or f16 (PyTorch's
//! `model.to(torch.bfloat16)` followed by an optimizer on those parameters; see
//! [`Parameter::to_dtype`]) have gradients of their own type, and the step updates them with
//! the same rules in f32 arithmetic — moments and momentum buffers in f32, the new value
//! rounded once to nearest even per step. An optimizer may hold parameters of several types;
//! each type is one fused launch of the same step (sharing the step counters,
//! hyperparameters and schedule), still with no host read. 16-bit parameters have no f32
//! masters, so they take no [`OptimOptions::copies`] ([`AmpError::LowPrecisionParams`]).
//!
//! What is not here: dampening, Nesterov momentum, AMSGrad, `maximize`, parameter groups.

use std::sync::Arc;

use cudagraph::memory::{bf16, f16};
use cudagraph::{DeviceBuffer, Queue, QueueExt, Stream};

use crate::autograd::tensor::{require_f32_params, Parameter};
use crate::dtype::{Dtype, Float, TypedBuffer};
use crate::error::{AmpError, NnError, Result};
use crate::kernels::cast;
use crate::kernels::optim_mt::{
    hp, state, AdamTensor, AmpArgs, CopyRef, OptimKernels, PureAdamTensor, PureSgdTensor, SgdTensor,
};
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

    /// The 16-bit model copies ([`OptimOptions::copies`]), one per parameter in
    /// [`Self::params`] order, or `None` when the optimizer keeps none.
    ///
    /// Each step rewrites every copy whose parameter it updates. Writing a master by other
    /// means (loading weights, `copy_from_host` into [`Parameter::data`]) leaves its copy
    /// stale until the next step updates that parameter; [`Self::refresh_copies`] makes
    /// them equal again at once.
    fn copies(&self) -> Option<Vec<(Parameter, TypedBuffer)>> {
        None
    }

    /// Rewrites every 16-bit copy from its master (a cast per parameter, enqueued on `q`;
    /// nothing without copies).
    fn refresh_copies(&self, q: &dyn Queue) -> Result<()> {
        let _ = q;
        Ok(())
    }

    /// One update under a GradScaler: [`GradScaler::step`](crate::nn::scaler::GradScaler::step)
    /// calls it after checking the gradients on the device. The optimizers of this crate
    /// unscale in their fused kernel and skip the update on the device when the scaler
    /// found an inf or NaN; any other optimizer cannot ([`AmpError::NotScalable`]).
    fn step_scaled(&mut self, q: &dyn Queue, scaling: &ScaledStep<'_>) -> Result<()> {
        let _ = (q, scaling);
        Err(AmpError::NotScalable.into())
    }

    /// The algorithm, for checkpoints: `"sgd"`, `"adam"` or `"adamw"` here; `None` for an
    /// optimizer that cannot be checkpointed.
    fn kind(&self) -> Option<&'static str> {
        None
    }

    /// The per-parameter state, for checkpoints: named device buffers in a fixed order
    /// (`exp_avg.<i>`, `exp_avg_sq.<i>`, `steps` for Adam; `momentum_buffer.<i>` for SGD
    /// with momentum), `i` being the parameter's index in [`Self::params`]. The
    /// hyperparameters and the step count are [`Self::hyperparameters`]. Loading a
    /// checkpoint writes these buffers in place.
    fn state_buffers(&self) -> Vec<(String, StateBuffer<'_>)> {
        Vec::new()
    }
}

/// One device buffer of an optimizer's state ([`Optimizer::state_buffers`]).
#[derive(Clone, Copy, Debug)]
pub enum StateBuffer<'a> {
    /// f32 values (moments, momentum buffers).
    F32(&'a DeviceBuffer<f32>),
    /// u32 values (per-parameter step counts).
    U32(&'a DeviceBuffer<u32>),
}

/// What a [`GradScaler`](crate::nn::scaler::GradScaler) hands the optimizer's step: its
/// device buffer, the found-inf flag that decides whether the step runs, and whether the
/// gradients are still scaled. Made only by the scaler.
pub struct ScaledStep<'a> {
    pub(crate) amp: AmpArgs<'a>,
}

/// Options beyond the hyperparameters, shared by [`Sgd::with_options`] and
/// [`Adam::with_options`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OptimOptions {
    /// Keep a 16-bit copy of every parameter ([`Dtype::Bf16`] or [`Dtype::F16`]), written
    /// by the fused update (see the module documentation); [`Dtype::F32`] is
    /// [`AmpError::CopyDtype`]. `None` (the default): no copies.
    pub copies: Option<Dtype>,
}

/// The 16-bit copies of `params` in `dtype`, cast from the masters on `s`.
fn make_copies(
    s: &Stream,
    params: &[Parameter],
    dtype: Option<Dtype>,
) -> Result<Option<Vec<TypedBuffer>>> {
    let Some(dtype) = dtype else { return Ok(None) };
    if dtype == Dtype::F32 {
        return Err(AmpError::CopyDtype { dtype: "f32" }.into());
    }
    require_f32_params(
        params,
        "optimizer copies",
        "16-bit copies are made from f32 masters: keep the parameters f32 and use the \
         copies, or train the 16-bit parameters without copies (OptimOptions::default())",
    )?;
    let mut out = Vec::with_capacity(params.len());
    for p in params {
        let n = p.numel();
        out.push(if dtype == Dtype::F16 {
            let b = s.alloc::<f16>(n)?;
            cast::to_f16(s, p.data()?, &b)?;
            TypedBuffer::F16(Arc::new(b))
        } else {
            let b = s.alloc::<bf16>(n)?;
            cast::to_bf16(s, p.data()?, &b)?;
            TypedBuffer::Bf16(Arc::new(b))
        });
    }
    Ok(Some(out))
}

/// Casts every master into its copy on `q`.
fn refresh(q: &dyn Queue, params: &[Parameter], copies: Option<&Vec<TypedBuffer>>) -> Result<()> {
    for (p, c) in params.iter().zip(copies.into_iter().flatten()) {
        match c {
            TypedBuffer::Bf16(b) => cast::to_bf16(q, p.data()?, b)?,
            TypedBuffer::F16(b) => cast::to_f16(q, p.data()?, b)?,
            TypedBuffer::F32(_) => {}
        }
    }
    Ok(())
}

fn copy_ref(copies: Option<&Vec<TypedBuffer>>, i: usize) -> Option<CopyRef<'_>> {
    match copies?.get(i)? {
        TypedBuffer::Bf16(b) => Some(CopyRef::Bf16(b)),
        TypedBuffer::F16(b) => Some(CopyRef::F16(b)),
        TypedBuffer::F32(_) => None,
    }
}

fn pair_copies(
    params: &[Parameter],
    copies: Option<&Vec<TypedBuffer>>,
) -> Option<Vec<(Parameter, TypedBuffer)>> {
    copies.map(|c| params.iter().cloned().zip(c.iter().cloned()).collect())
}

/// The parameters that have a gradient, with their index, grouped by element type (a
/// parameter's gradient always has the parameter's type).
#[derive(Default)]
struct Grads {
    f32: Vec<WithGrad<f32>>,
    bf16: Vec<WithGrad<bf16>>,
    f16: Vec<WithGrad<f16>>,
}

/// A parameter's index, its values and its gradient, both of type `T`.
type WithGrad<T> = (usize, Arc<DeviceBuffer<T>>, Arc<DeviceBuffer<T>>);

impl Grads {
    /// Which launch advances the optimizer's step count: the last of the ones that run (f32
    /// runs also when no parameter has a gradient, so a step always counts).
    fn last(&self) -> Dtype {
        if !self.f16.is_empty() {
            Dtype::F16
        } else if !self.bf16.is_empty() {
            Dtype::Bf16
        } else {
            Dtype::F32
        }
    }

    /// Whether the f32 launch runs.
    fn run_f32(&self) -> bool {
        !self.f32.is_empty() || self.last() == Dtype::F32
    }
}

fn with_grads(params: &[Parameter]) -> Result<Grads> {
    let mut out = Grads::default();
    for (i, p) in params.iter().enumerate() {
        let mismatch = |g: &TypedBuffer| NnError::Dtype {
            what: "parameter gradient",
            expected: p.dtype().name(),
            found: g.dtype().name(),
        };
        match (p.buffer(), p.grad_typed()) {
            (_, None) => {}
            (TypedBuffer::F32(w), Some(TypedBuffer::F32(g))) => out.f32.push((i, w.clone(), g)),
            (TypedBuffer::Bf16(w), Some(TypedBuffer::Bf16(g))) => out.bf16.push((i, w.clone(), g)),
            (TypedBuffer::F16(w), Some(TypedBuffer::F16(g))) => out.f16.push((i, w.clone(), g)),
            (_, Some(g)) => return Err(mismatch(&g)),
        }
    }
    Ok(out)
}

/// The launch tensors of the 16-bit parameters `grads`, with their momentum buffers (when
/// the optimizer keeps them).
fn pure_sgd_tensors<'a, T: Float>(
    grads: &'a [WithGrad<T>],
    bufs: &'a [Option<DeviceBuffer<f32>>],
) -> Vec<PureSgdTensor<'a, T>> {
    grads
        .iter()
        .map(|(i, w, g)| PureSgdTensor {
            w,
            g,
            buf: bufs[*i].as_ref(),
        })
        .collect()
}

/// The launch tensors of the 16-bit parameters `grads`, with their moments and step slots.
fn pure_adam_tensors<'a, T: Float>(
    grads: &'a [WithGrad<T>],
    m: &'a [DeviceBuffer<f32>],
    v: &'a [DeviceBuffer<f32>],
) -> Result<Vec<PureAdamTensor<'a, T>>> {
    grads
        .iter()
        .map(|(i, w, g)| {
            Ok(PureAdamTensor {
                w,
                g,
                m: &m[*i],
                v: &v[*i],
                slot: slot_of(*i)?,
            })
        })
        .collect()
}

fn slot_of(i: usize) -> Result<u32> {
    u32::try_from(i).map_err(|_| bad("more than 2^32 parameters"))
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

    /// Writes every slot and the step count (resuming from a checkpoint): the device values
    /// with stream-ordered writes on `s`, and the host's copy of the slots.
    pub fn restore(&mut self, s: &Stream, values: [f32; hp::LEN], steps: u32) -> Result<()> {
        s.copy_from_host(&values, &self.hp)?;
        s.fill32(&self.state, state::STEP, 1, steps)?;
        s.fill32(&self.state, state::TICKET, 1, 0u32)?;
        self.host = values;
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
        if !p.buffer().is_empty() && !seen.insert(p.buffer().addr()) {
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
    copies: Option<Vec<TypedBuffer>>,
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
        Self::with_options(s, params, cfg, OptimOptions::default())
    }

    /// SGD from a [`SgdConfig`] with [`OptimOptions`] (16-bit copies of the parameters).
    pub fn with_options(
        s: &Stream,
        params: Vec<Parameter>,
        cfg: SgdConfig,
        options: OptimOptions,
    ) -> Result<Self> {
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
            copies: make_copies(s, &params, options.copies)?,
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

impl Sgd {
    fn update(&mut self, q: &dyn Queue, amp: Option<&AmpArgs<'_>>) -> Result<()> {
        let k = OptimKernels::get(q.device())?;
        self.hyper.before_step(q, &k)?;
        let grads = with_grads(&self.params)?;
        let (hp, st, last) = (&self.hyper.hp, &self.hyper.state, grads.last());
        if grads.run_f32() {
            let tensors: Vec<SgdTensor<'_>> = grads
                .f32
                .iter()
                .map(|(i, w, g)| SgdTensor {
                    w,
                    g,
                    buf: self.bufs[*i].as_ref(),
                    copy: copy_ref(self.copies.as_ref(), *i),
                })
                .collect();
            k.sgd(q, &tensors, hp, st, amp, last == Dtype::F32)?;
        }
        if !grads.bf16.is_empty() {
            let tensors = pure_sgd_tensors(&grads.bf16, &self.bufs);
            k.sgd_pure(q, &tensors, hp, st, amp, last == Dtype::Bf16)?;
        }
        if !grads.f16.is_empty() {
            let tensors = pure_sgd_tensors(&grads.f16, &self.bufs);
            k.sgd_pure(q, &tensors, hp, st, amp, last == Dtype::F16)?;
        }
        Ok(())
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, q: &dyn Queue) -> Result<()> {
        self.update(q, None)
    }

    fn step_scaled(&mut self, q: &dyn Queue, scaling: &ScaledStep<'_>) -> Result<()> {
        self.update(q, Some(&scaling.amp))
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

    fn copies(&self) -> Option<Vec<(Parameter, TypedBuffer)>> {
        pair_copies(&self.params, self.copies.as_ref())
    }

    fn refresh_copies(&self, q: &dyn Queue) -> Result<()> {
        refresh(q, &self.params, self.copies.as_ref())
    }

    fn kind(&self) -> Option<&'static str> {
        Some("sgd")
    }

    fn state_buffers(&self) -> Vec<(String, StateBuffer<'_>)> {
        self.bufs
            .iter()
            .enumerate()
            .filter_map(|(i, b)| {
                b.as_ref()
                    .map(|b| (format!("momentum_buffer.{i}"), StateBuffer::F32(b)))
            })
            .collect()
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
    copies: Option<Vec<TypedBuffer>>,
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
        Self::with_options(s, params, cfg, OptimOptions::default())
    }

    /// Adam (AdamW when `cfg.decoupled`) from an [`AdamConfig`] with [`OptimOptions`]
    /// (16-bit copies of the parameters).
    pub fn with_options(
        s: &Stream,
        params: Vec<Parameter>,
        cfg: AdamConfig,
        options: OptimOptions,
    ) -> Result<Self> {
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
            copies: make_copies(s, &params, options.copies)?,
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

impl Adam {
    fn update(&mut self, q: &dyn Queue, amp: Option<&AmpArgs<'_>>) -> Result<()> {
        let k = OptimKernels::get(q.device())?;
        self.hyper.before_step(q, &k)?;
        let grads = with_grads(&self.params)?;
        let (hp, st, last) = (&self.hyper.hp, &self.hyper.state, grads.last());
        let (steps, dec) = (&self.steps, self.decoupled);
        if grads.run_f32() {
            let tensors = grads
                .f32
                .iter()
                .map(|(i, w, g)| {
                    Ok(AdamTensor {
                        w,
                        g,
                        m: &self.m[*i],
                        v: &self.v[*i],
                        slot: slot_of(*i)?,
                        copy: copy_ref(self.copies.as_ref(), *i),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            k.adam(q, &tensors, hp, st, steps, amp, dec, last == Dtype::F32)?;
        }
        if !grads.bf16.is_empty() {
            let tensors = pure_adam_tensors(&grads.bf16, &self.m, &self.v)?;
            k.adam_pure(q, &tensors, hp, st, steps, amp, dec, last == Dtype::Bf16)?;
        }
        if !grads.f16.is_empty() {
            let tensors = pure_adam_tensors(&grads.f16, &self.m, &self.v)?;
            k.adam_pure(q, &tensors, hp, st, steps, amp, dec, last == Dtype::F16)?;
        }
        Ok(())
    }
}

impl Optimizer for Adam {
    fn step(&mut self, q: &dyn Queue) -> Result<()> {
        self.update(q, None)
    }

    fn step_scaled(&mut self, q: &dyn Queue, scaling: &ScaledStep<'_>) -> Result<()> {
        self.update(q, Some(&scaling.amp))
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

    fn copies(&self) -> Option<Vec<(Parameter, TypedBuffer)>> {
        pair_copies(&self.params, self.copies.as_ref())
    }

    fn refresh_copies(&self, q: &dyn Queue) -> Result<()> {
        refresh(q, &self.params, self.copies.as_ref())
    }

    fn kind(&self) -> Option<&'static str> {
        Some(if self.decoupled { "adamw" } else { "adam" })
    }

    fn state_buffers(&self) -> Vec<(String, StateBuffer<'_>)> {
        let mut out = Vec::with_capacity(2 * self.params.len() + 1);
        for (i, m) in self.m.iter().enumerate() {
            out.push((format!("exp_avg.{i}"), StateBuffer::F32(m)));
        }
        for (i, v) in self.v.iter().enumerate() {
            out.push((format!("exp_avg_sq.{i}"), StateBuffer::F32(v)));
        }
        out.push(("steps".to_string(), StateBuffer::U32(&self.steps)));
        out
    }
}
