//! Loss scaling with PyTorch's semantics (`torch.amp.GradScaler`) and every number on the
//! device: the scale, the growth tracker and the found-inf flags live in device memory, and
//! no method reads them back, so a whole training step — scaled loss, backward, unscale and
//! inf check, the optimizer step (skipped on the device after an overflow) and the scale
//! update — captures into one graph and replays without the host.
//!
//! ```no_run
//! # use cudagraph::{CaptureOptions, Device, Graph};
//! # use cudagraph_nn::*;
//! # fn main() -> Result<()> {
//! # let dev = Device::open(0)?;
//! # let mut s = dev.new_stream()?;
//! # let mut rng = HostRng::new(0);
//! # let model = Linear::new(&s, 64, 64, &mut rng)?;
//! # let x = Tensor::from_host(&s, &rng.vec_normal(8 * 64), &[8, 64])?;
//! # let y = Tensor::from_host(&s, &rng.vec_normal(8 * 64), &[8, 64])?;
//! let mut opt = Adam::with_config(&s, model.parameters(), AdamConfig::default())?;
//! let mut scaler = GradScaler::new(&s, GradScalerConfig::default())?;
//! let (step, _) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
//!     opt.zero_grad(cs, true)?;
//!     let loss = mse_loss(cs, &model.forward(cs, &x)?, &y, Reduction::Mean)?;
//!     scaler.scale(cs, &loss)?.backward(cs)?;
//!     scaler.unscale(cs, &opt)?; // only to clip the true gradients
//!     clip_grad_norm(cs, opt.params(), 1.0)?;
//!     scaler.step(cs, &mut opt)?;
//!     scaler.update(cs)?;
//!     Ok(())
//! }).map_err(NnError::from)?;
//! for _ in 0..100 { step.replay(&s)?; }
//! println!("scale {}", scaler.get_scale(&s)?);
//! # Ok(()) }
//! ```
//!
//! # How the step is fused
//!
//! [`GradScaler::step`] runs in two phases. First a read-only multi-tensor pass checks every
//! gradient for inf/NaN into the optimizer's found-inf flag (PyTorch's
//! `_amp_foreach_non_finite_check_and_unscale_`). Then the optimizer's own fused kernel reads
//! the flag before anything else — when it is set, every block returns at once and nothing
//! changes — and otherwise multiplies each gradient by 1/scale as it loads it, writing the
//! unscaled gradient back as PyTorch's fused optimizers do. The check cannot live inside the
//! update kernel: whether a step runs depends on every element of every gradient, and blocks
//! of one launch cannot wait for each other without a grid-wide barrier (a cooperative launch
//! whose grid must fit the device at once). A separate pass that only reads the gradients is
//! the cheapest split: one extra read of the gradients, no extra write (an in-place unscale
//! before the step would add a write), and the same split as PyTorch's fused path
//! (`_check_inf_per_device`, then `_fused_adam(grad_scale=…, found_inf=…)`).
//!
//! After [`GradScaler::unscale`] (to clip the true gradients, say), the gradients are unscaled
//! in place by that pass and the step only reads the flag. Both ways give the same bits: each
//! gradient is multiplied by the same `f32` reciprocal of the scale, once.
//!
//! # Differences from PyTorch
//!
//! - Optimizers are told apart by their parameters' addresses; up to [`MAX_OPTIMIZERS`] may
//!   be stepped between two updates, each with its own found-inf flag (as PyTorch keeps one per
//!   optimizer), and `update` backs off when any of them was set.
//! - A skipped step advances none of the optimizer's counters (its step count, which a
//!   device-side schedule reads, included), as PyTorch's fused optimizers leave their step
//!   tensors.
//! - Only this crate's optimizers can step under a scaler (they read the flag on the device);
//!   another is [`AmpError::NotScalable`] rather than a host read.

use std::sync::Arc;

use cudagraph::{DeviceBuffer, Queue, QueueExt, Stream};

use crate::autograd::scale::scale_by_device;
use crate::autograd::tensor::{require_f32_params, Tensor};
use crate::error::{AmpError, NnError, Result};
use crate::kernels::amp::{AmpKernels, UpdateRule};
use crate::kernels::optim_mt::{amp_slots, AmpArgs};
use crate::nn::optim::{Optimizer, ScaledStep};

/// The most optimizers one scaler steps between two [`GradScaler::update`] calls.
pub const MAX_OPTIMIZERS: usize = 16;

/// A [`GradScaler`]'s settings, with PyTorch's names and defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradScalerConfig {
    /// The scale to start from (PyTorch: 2^16). Finite and > 0.
    pub init_scale: f32,
    /// The factor the scale grows by after `growth_interval` good steps in a row (2.0).
    /// Finite and ≥ 1.
    pub growth_factor: f64,
    /// The factor the scale shrinks by after a step with an inf or NaN gradient (0.5). In
    /// (0, 1].
    pub backoff_factor: f64,
    /// Good steps in a row before the scale grows (2000). At least 1.
    pub growth_interval: u32,
    /// `false`: every method passes through ([`GradScaler::scale`] returns the loss,
    /// [`GradScaler::step`] is the optimizer's plain step, the rest do nothing), as with
    /// PyTorch's `enabled=False` — bf16 training needs no scaler.
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    /// PyTorch's defaults: init_scale 65536, growth ×2, backoff ×0.5, interval 2000, enabled.
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

impl GradScalerConfig {
    /// Checks every setting's range ([`AmpError::ScalerConfig`] naming the first bad one).
    pub fn validate(&self) -> Result<()> {
        let bad = |name, value: f64, rule| -> Result<()> {
            Err(AmpError::ScalerConfig { name, value, rule }.into())
        };
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return bad("init_scale", self.init_scale as f64, "finite and > 0");
        }
        if !(self.growth_factor.is_finite() && self.growth_factor >= 1.0) {
            return bad("growth_factor", self.growth_factor, "finite and ≥ 1");
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor <= 1.0) {
            return bad("backoff_factor", self.backoff_factor, "in (0, 1]");
        }
        if self.growth_interval == 0 {
            return bad("growth_interval", 0.0, "at least 1");
        }
        Ok(())
    }
}

/// A scaler's state for checkpoints (PyTorch's `GradScaler.state_dict()`): the device values
/// and the settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalerState {
    /// The current scale.
    pub scale: f32,
    /// Good steps in a row since the scale last changed.
    pub growth_tracker: u32,
    /// The settings (`init_scale` is the one the scaler was made with).
    pub config: GradScalerConfig,
}

/// Where one optimizer is in the current iteration (PyTorch's `OptState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Its gradients were checked and unscaled in place.
    Unscaled,
    /// It stepped.
    Stepped,
}

/// The host's side of a scaler: which optimizers were checked or stepped since the last
/// update, and the found-inf flag each one uses. It decides what to enqueue; it never reads
/// the device, so it is the same whether the calls run eagerly or are being captured.
#[derive(Clone, Debug, Default)]
struct Book {
    /// This iteration's optimizers (by their parameters' addresses), in the order seen: the
    /// index is the flag's slot.
    seen: Vec<(Vec<u64>, Stage)>,
    /// Flags the last update read.
    last_slots: usize,
}

/// What [`Book::step`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StepPlan {
    /// The optimizer's found-inf flag.
    slot: usize,
    /// Whether the gradients are still scaled (check them, then unscale in the kernel).
    check: bool,
}

impl Book {
    fn find(&self, key: &[u64]) -> Option<usize> {
        self.seen.iter().position(|(k, _)| k == key)
    }

    fn new_slot(&self) -> Result<usize> {
        if self.seen.len() >= MAX_OPTIMIZERS {
            return Err(AmpError::TooManyOptimizers {
                max: MAX_OPTIMIZERS,
            }
            .into());
        }
        Ok(self.seen.len())
    }

    /// `unscale` of the optimizer with `key`: its flag's slot.
    fn unscale(&mut self, key: &[u64]) -> Result<usize> {
        match self.find(key).map(|i| self.seen[i].1) {
            Some(Stage::Unscaled) => Err(NnError::OutOfOrder {
                call: "GradScaler::unscale",
                problem: "it was already called for this optimizer since the last update()",
                fix: "unscale each optimizer at most once per iteration, before its step",
            }),
            Some(Stage::Stepped) => Err(NnError::OutOfOrder {
                call: "GradScaler::unscale",
                problem: "this optimizer already stepped in this iteration",
                fix: "call unscale before step, and update() after both",
            }),
            None => {
                let slot = self.new_slot()?;
                self.seen.push((key.to_vec(), Stage::Unscaled));
                Ok(slot)
            }
        }
    }

    /// `step` of the optimizer with `key`.
    fn step(&mut self, key: &[u64]) -> Result<StepPlan> {
        match self.find(key) {
            Some(i) if self.seen[i].1 == Stage::Stepped => Err(NnError::OutOfOrder {
                call: "GradScaler::step",
                problem: "this optimizer already stepped since the last update()",
                fix: "call update() once per iteration, after every optimizer's step",
            }),
            Some(i) => {
                self.seen[i].1 = Stage::Stepped;
                Ok(StepPlan {
                    slot: i,
                    check: false,
                })
            }
            None => {
                let slot = self.new_slot()?;
                self.seen.push((key.to_vec(), Stage::Stepped));
                Ok(StepPlan { slot, check: true })
            }
        }
    }

    /// `update`: the number of flags to read; the next iteration starts.
    fn update(&mut self) -> Result<usize> {
        if self.seen.is_empty() {
            return Err(NnError::OutOfOrder {
                call: "GradScaler::update",
                problem: "no optimizer was unscaled or stepped through the scaler since the \
                          last update(), so there is no inf check to act on",
                fix: "call scaler.step(q, &mut optimizer) before scaler.update(q)",
            });
        }
        let n = self.seen.len();
        self.seen.clear();
        self.last_slots = n;
        Ok(n)
    }

    /// Flags that say whether the current (or, between iterations, the last) one found an
    /// inf or NaN.
    fn flags_in_use(&self) -> usize {
        if self.seen.is_empty() {
            self.last_slots
        } else {
            self.seen.len()
        }
    }
}

/// Loss scaling on the device (PyTorch's `torch.amp.GradScaler`; see the module
/// documentation).
pub struct GradScaler {
    cfg: GradScalerConfig,
    /// `[scale, found-inf flag × MAX_OPTIMIZERS]` (`amp_slots`).
    amp: Arc<DeviceBuffer<f32>>,
    /// `[growth tracker]`.
    tracker: DeviceBuffer<u32>,
    book: Book,
}

impl std::fmt::Debug for GradScaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradScaler")
            .field("config", &self.cfg)
            .field("book", &self.book)
            .finish()
    }
}

/// The identity of an optimizer within an iteration: its parameters' addresses.
fn key_of<O: Optimizer + ?Sized>(opt: &O) -> Vec<u64> {
    opt.params().iter().map(|p| p.buffer().addr()).collect()
}

/// The scaler checks and unscales f32 gradients only: 16-bit parameters (pure 16-bit
/// training) are [`AmpError::LowPrecisionParams`].
fn require_f32<O: Optimizer + ?Sized>(opt: &O) -> Result<()> {
    require_f32_params(opt.params(), "GradScaler", LOW_PRECISION_FIX)
}

const LOW_PRECISION_FIX: &str = "bf16 trains without loss scaling: step the optimizer directly; for f16, keep f32 parameters (the masters) and give the optimizer OptimOptions { copies: Some(Dtype::F16) }";

/// Every gradient the optimizer's parameters hold now (all f32: [`require_f32`]).
fn grads_of<O: Optimizer + ?Sized>(opt: &O) -> Result<Vec<Arc<DeviceBuffer<f32>>>> {
    let mut out = Vec::new();
    for p in opt.params() {
        out.extend(p.grad()?);
    }
    Ok(out)
}

impl GradScaler {
    /// A scaler with `cfg` (checked: [`GradScalerConfig::validate`]); its device state is
    /// the initial scale, a zero tracker and clear flags.
    pub fn new(s: &Stream, cfg: GradScalerConfig) -> Result<Self> {
        cfg.validate()?;
        let mut init = vec![0.0f32; amp_slots::FOUND + MAX_OPTIMIZERS];
        init[amp_slots::SCALE] = cfg.init_scale;
        Ok(Self {
            cfg,
            amp: Arc::new(s.alloc_from_host(&init)?),
            tracker: s.alloc_zeroed::<u32>(1)?,
            book: Book::default(),
        })
    }

    /// The settings.
    pub fn config(&self) -> GradScalerConfig {
        self.cfg
    }

    /// Whether the scaler is enabled.
    pub fn is_enabled(&self) -> bool {
        self.cfg.enabled
    }

    /// `loss × scale` (the scale as the device holds it when the kernel runs; autograd
    /// multiplies the gradients by it too). Disabled: `loss` itself.
    pub fn scale(&self, q: &dyn Queue, loss: &Tensor) -> Result<Tensor> {
        if !self.cfg.enabled {
            return Ok(loss.clone());
        }
        scale_by_device(q, loss, &self.amp)
    }

    /// PyTorch's `unscale_(optimizer)`: checks the optimizer's gradients for inf/NaN (into its
    /// found-inf flag) and divides them by the scale in place, so they can be inspected or
    /// clipped before [`Self::step`] (which then does not unscale again). At most once per
    /// optimizer between updates, and before its step ([`NnError::OutOfOrder`] otherwise).
    pub fn unscale<O: Optimizer + ?Sized>(&mut self, q: &dyn Queue, opt: &O) -> Result<()> {
        if !self.cfg.enabled {
            return Ok(());
        }
        require_f32(opt)?;
        let mut book = self.book.clone();
        let slot = book.unscale(&key_of(opt))?;
        self.check(q, opt, slot, true)?;
        self.book = book;
        Ok(())
    }

    /// Clears flag `slot` and runs the check (and in-place unscale) pass over `opt`'s
    /// gradients.
    fn check<O: Optimizer + ?Sized>(
        &self,
        q: &dyn Queue,
        opt: &O,
        slot: usize,
        unscale: bool,
    ) -> Result<()> {
        let k = AmpKernels::get(q.device())?;
        q.fill32(&self.amp, amp_slots::FOUND + slot, 1, 0.0f32)?;
        let grads = grads_of(opt)?;
        let refs: Vec<&DeviceBuffer<f32>> = grads.iter().map(|g| &**g).collect();
        k.unscale(q, &refs, &self.amp, slot, unscale)
    }

    /// PyTorch's `step(optimizer)`: the optimizer's update, unscaling its gradients in the
    /// fused kernel and skipped on the device when any gradient is inf or NaN (see the module
    /// documentation). Disabled: the optimizer's plain [`Optimizer::step`]. Once per
    /// optimizer between updates ([`NnError::OutOfOrder`] otherwise). An optimizer of 16-bit
    /// parameters (pure 16-bit training) is [`AmpError::LowPrecisionParams`], here and in
    /// [`Self::unscale`]: bf16 needs no scaler, f16 wants f32 masters with 16-bit copies.
    pub fn step<O: Optimizer + ?Sized>(&mut self, q: &dyn Queue, opt: &mut O) -> Result<()> {
        if !self.cfg.enabled {
            return opt.step(q);
        }
        require_f32(opt)?;
        let mut book = self.book.clone();
        let plan = book.step(&key_of(opt))?;
        if plan.check {
            self.check(q, opt, plan.slot, false)?;
        }
        let scaling = ScaledStep {
            amp: AmpArgs {
                buf: &self.amp,
                found: plan.slot,
                unscale: plan.check,
            },
        };
        opt.step_scaled(q, &scaling)?;
        self.book = book;
        Ok(())
    }

    /// PyTorch's `update()`: one thread on the device multiplies the scale by
    /// `backoff_factor` and restarts the growth tracker when any optimizer of this iteration
    /// found an inf or NaN; otherwise counts the good step and, every `growth_interval` good
    /// steps in a row, multiplies the scale by `growth_factor` (unless that overflows f32).
    /// Needs a [`Self::step`] or [`Self::unscale`] since the last update
    /// ([`NnError::OutOfOrder`]). Disabled: nothing.
    pub fn update(&mut self, q: &dyn Queue) -> Result<()> {
        if !self.cfg.enabled {
            return Ok(());
        }
        let mut book = self.book.clone();
        let slots = book.update()?;
        AmpKernels::get(q.device())?.update(
            q,
            &self.amp,
            &self.tracker,
            slots,
            UpdateRule {
                growth: self.cfg.growth_factor,
                backoff: self.cfg.backoff_factor,
                interval: self.cfg.growth_interval,
            },
        )?;
        self.book = book;
        Ok(())
    }

    /// PyTorch's `update(new_scale)` without the rest: sets the scale with a stream-ordered
    /// write on `q` (a memset node inside a capture). Finite and > 0.
    pub fn set_scale(&mut self, q: &dyn Queue, scale: f32) -> Result<()> {
        GradScalerConfig {
            init_scale: scale,
            ..self.cfg
        }
        .validate()?;
        q.fill32(&self.amp, amp_slots::SCALE, 1, scale)?;
        Ok(())
    }

    /// The current scale, read from the device (synchronises `s`; PyTorch's `get_scale()`).
    /// Disabled: 1.
    pub fn get_scale(&self, s: &Stream) -> Result<f32> {
        if !self.cfg.enabled {
            return Ok(1.0);
        }
        Ok(s.to_vec(&self.amp)?[amp_slots::SCALE])
    }

    /// The growth tracker, read from the device (synchronises `s`).
    pub fn growth_tracker(&self, s: &Stream) -> Result<u32> {
        Ok(s.to_vec(&self.tracker)?[0])
    }

    /// Whether an inf or NaN was found among the gradients of the current iteration (or,
    /// between iterations, of the last one), read from the device (synchronises `s`).
    pub fn found_inf(&self, s: &Stream) -> Result<bool> {
        let n = self.book.flags_in_use();
        let v = s.to_vec(&self.amp)?;
        Ok(v[amp_slots::FOUND..amp_slots::FOUND + n]
            .iter()
            .any(|&f| f != 0.0))
    }

    /// The state to checkpoint (synchronises `s`).
    pub fn state_dict(&self, s: &Stream) -> Result<ScalerState> {
        Ok(ScalerState {
            scale: s.to_vec(&self.amp)?[amp_slots::SCALE],
            growth_tracker: self.growth_tracker(s)?,
            config: self.cfg,
        })
    }

    /// Restores a checkpointed state: the scale, the tracker and the settings (`enabled`
    /// must match this scaler's: [`AmpError::ScalerConfig`] otherwise). Stream-ordered
    /// writes on `s`; an iteration in progress is forgotten.
    pub fn load_state_dict(&mut self, s: &Stream, state: &ScalerState) -> Result<()> {
        state.config.validate()?;
        // Any scale a scaler can reach: backing off every step of a run whose values overflow
        // whatever the scale takes it down to 0 (PyTorch restores such a scale as it is).
        if !(state.scale.is_finite() && state.scale >= 0.0) {
            return Err(AmpError::ScalerConfig {
                name: "scale",
                value: state.scale as f64,
                rule: "finite and >= 0",
            }
            .into());
        }
        if state.config.enabled != self.cfg.enabled {
            return Err(AmpError::ScalerConfig {
                name: "enabled",
                value: state.config.enabled as u8 as f64,
                rule: "the same as the scaler it is loaded into",
            }
            .into());
        }
        s.fill32(&self.amp, amp_slots::SCALE, 1, state.scale)?;
        s.fill32(&self.tracker, 0, 1, state.growth_tracker)?;
        self.cfg = state.config;
        self.book = Book::default();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out_of_order(r: Result<impl std::fmt::Debug>, call: &str) {
        match r {
            Err(NnError::OutOfOrder { call: c, .. }) => assert_eq!(c, call),
            other => panic!("expected OutOfOrder from {call}, got {other:?}"),
        }
    }

    #[test]
    fn each_optimizer_gets_its_own_flag_in_the_order_seen() {
        let mut b = Book::default();
        assert_eq!(
            b.step(&[1, 2]).unwrap(),
            StepPlan {
                slot: 0,
                check: true
            }
        );
        assert_eq!(b.unscale(&[3]).unwrap(), 1);
        assert_eq!(
            b.step(&[3]).unwrap(),
            StepPlan {
                slot: 1,
                check: false
            }
        );
        assert_eq!(b.flags_in_use(), 2);
        assert_eq!(b.update().unwrap(), 2);
        // Between iterations the last one's flags are the ones that say something.
        assert_eq!(b.flags_in_use(), 2);
        // The next iteration starts over at slot 0, whatever the order.
        assert_eq!(
            b.step(&[3]).unwrap(),
            StepPlan {
                slot: 0,
                check: true
            }
        );
        assert_eq!(b.flags_in_use(), 1);
        assert_eq!(b.update().unwrap(), 1);
    }

    #[test]
    fn calls_out_of_pytorch_order_are_typed_errors() {
        let mut b = Book::default();
        out_of_order(b.update(), "GradScaler::update");
        b.unscale(&[7]).unwrap();
        out_of_order(b.unscale(&[7]), "GradScaler::unscale");
        b.step(&[7]).unwrap();
        out_of_order(b.step(&[7]), "GradScaler::step");
        out_of_order(b.unscale(&[7]), "GradScaler::unscale");
        // Another optimizer is independent.
        b.step(&[8]).unwrap();
        b.update().unwrap();
        // After update everything may happen again.
        b.unscale(&[7]).unwrap();
        b.step(&[7]).unwrap();
    }

    #[test]
    fn a_scaler_keeps_a_bounded_number_of_flags() {
        let mut b = Book::default();
        for i in 0..MAX_OPTIMIZERS as u64 {
            b.step(&[i]).unwrap();
        }
        match b.step(&[999]) {
            Err(NnError::Amp(AmpError::TooManyOptimizers { max })) => {
                assert_eq!(max, MAX_OPTIMIZERS)
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(b.update().unwrap(), MAX_OPTIMIZERS);
    }

    #[test]
    fn settings_out_of_range_are_named() {
        assert!(GradScalerConfig::default().validate().is_ok());
        let d = GradScalerConfig::default();
        for (cfg, name) in [
            (
                GradScalerConfig {
                    init_scale: 0.0,
                    ..d
                },
                "init_scale",
            ),
            (
                GradScalerConfig {
                    init_scale: f32::INFINITY,
                    ..d
                },
                "init_scale",
            ),
            (
                GradScalerConfig {
                    init_scale: f32::NAN,
                    ..d
                },
                "init_scale",
            ),
            (
                GradScalerConfig {
                    growth_factor: 0.5,
                    ..d
                },
                "growth_factor",
            ),
            (
                GradScalerConfig {
                    growth_factor: f64::NAN,
                    ..d
                },
                "growth_factor",
            ),
            (
                GradScalerConfig {
                    backoff_factor: 0.0,
                    ..d
                },
                "backoff_factor",
            ),
            (
                GradScalerConfig {
                    backoff_factor: 1.5,
                    ..d
                },
                "backoff_factor",
            ),
            (
                GradScalerConfig {
                    growth_interval: 0,
                    ..d
                },
                "growth_interval",
            ),
        ] {
            match cfg.validate() {
                Err(NnError::Amp(AmpError::ScalerConfig { name: n, .. })) => assert_eq!(n, name),
                other => panic!("{name}: {other:?}"),
            }
        }
        // The edges that are allowed: no growth, no backoff, growth every step.
        GradScalerConfig {
            growth_factor: 1.0,
            backoff_factor: 1.0,
            growth_interval: 1,
            ..d
        }
        .validate()
        .unwrap();
    }

    /// PyTorch's `_amp_update_scale_` in f64/f32 as the kernel computes it: the reference
    /// for the GPU tests, checked here against PyTorch's own test numbers.
    fn update_ref(scale: f32, tracker: u32, found: bool, cfg: &GradScalerConfig) -> (f32, u32) {
        if found {
            ((scale as f64 * cfg.backoff_factor) as f32, 0)
        } else if tracker + 1 == cfg.growth_interval {
            let g = (scale as f64 * cfg.growth_factor) as f32;
            (if g.is_finite() { g } else { scale }, 0)
        } else {
            (scale, tracker + 1)
        }
    }

    #[test]
    fn the_update_rule_gives_pytorchs_numbers() {
        // test_grad_scaling_update_scale: growth 2, backoff 0.25, interval 2, scale 4.
        let cfg = GradScalerConfig {
            init_scale: 4.0,
            growth_factor: 2.0,
            backoff_factor: 0.25,
            growth_interval: 2,
            enabled: true,
        };
        let (s, t) = update_ref(4.0, 0, false, &cfg);
        assert_eq!((s, t), (4.0, 1));
        let (s, t) = update_ref(s, t, false, &cfg);
        assert_eq!((s, t), (8.0, 0));
        let (s, t) = update_ref(s, t, true, &cfg);
        assert_eq!((s, t), (2.0, 0));
        // Growth stops short of infinity.
        assert_eq!(update_ref(f32::MAX, 1, false, &cfg), (f32::MAX, 0));
    }
}
