//! Learning-rate schedules that also run inside a graph.
//!
//! A [`Schedule`] maps the number of optimizer steps taken so far, `t`, and a base learning
//! rate to the learning rate of the next step — PyTorch's `lr_scheduler` closed forms
//! (`StepLR`, `ExponentialLR`, `CosineAnnealingLR`, `LinearLR` for warm-up), composed in
//! sequence ([`Schedule::then`], PyTorch's `SequentialLR`) or applied one after another
//! ([`Schedule::chain`], like `ChainedScheduler`, as closed forms).
//!
//! Two ways to use one:
//! - from the host: `opt.set_lr(&stream, schedule.lr(base_lr, t))` before each step (a
//!   stream-ordered write of the device scalar; no re-capture);
//! - on the device: `opt.set_schedule(Some(schedule))`; every `step()` then first runs a
//!   one-thread kernel that computes the learning rate from the optimizer's device step
//!   counter, so a captured step replayed N times follows the schedule with no host work.
//!
//! Both evaluate the same operations in `f64` and round once to `f32` (the kernel is in
//! `kernels/optim_mt.cu`); they agree to the last bit except where the host's and the device's
//! `cos` differ by an ulp.
//!
//! ```
//! use cudagraph_nn::Schedule;
//! # fn main() -> cudagraph_nn::Result<()> {
//! // 100 steps of linear warm-up from 1% of the base rate, then cosine annealing to 0 over 900.
//! let s = Schedule::linear_warmup(100, 0.01)?.then(100, Schedule::cosine_annealing(900, 0.0)?)?;
//! assert!((s.lr(0.1, 0) - 0.001).abs() < 1e-9);
//! assert_eq!(s.lr(0.1, 100), 0.1);
//! assert!(s.lr(0.1, 999) < 1e-5);
//! # Ok(()) }
//! ```

use crate::error::{NnError, Result};

/// Most sequential phases a schedule can have on the device.
pub const MAX_PHASES: usize = 8;
/// Most terms active at once (see [`Schedule::chain`]).
pub const MAX_TERMS: usize = 4;

/// Bytes of the device program (the kernel's `SchedProgram`).
pub const PROGRAM_BYTES: usize = 8 + (8 + 32 * MAX_TERMS) * MAX_PHASES;

/// One basic schedule, as a transformation of the incoming learning rate at its local step `t`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Term {
    /// `lr · factor`.
    Factor(f64),
    /// `lr · gamma^⌊t / step_size⌋` (PyTorch's `StepLR`).
    Step {
        /// Steps between decays.
        step_size: u32,
        /// Multiplier applied at each decay.
        gamma: f64,
    },
    /// `lr · gamma^t` (`ExponentialLR`).
    Exponential {
        /// Multiplier applied every step.
        gamma: f64,
    },
    /// `eta_min + (lr − eta_min)·(1 + cos(π·t / t_max)) / 2` (`CosineAnnealingLR`'s closed form).
    Cosine {
        /// Steps of a half cosine period (from `lr` down to `eta_min`).
        t_max: u32,
        /// The smallest learning rate.
        eta_min: f64,
    },
    /// `lr · (start + (end − start)·min(t, total_iters) / total_iters)` (`LinearLR`).
    Linear {
        /// Multiplier at step 0.
        start_factor: f64,
        /// Multiplier from `total_iters` on.
        end_factor: f64,
        /// Steps over which the multiplier moves from start to end.
        total_iters: u32,
    },
}

impl Term {
    fn code(&self) -> (u32, f64, f64, f64) {
        match *self {
            Term::Factor(a) => (0, a, 0.0, 0.0),
            Term::Step { step_size, gamma } => (1, step_size as f64, gamma, 0.0),
            Term::Exponential { gamma } => (2, gamma, 0.0, 0.0),
            Term::Cosine { t_max, eta_min } => (3, t_max as f64, eta_min, 0.0),
            Term::Linear {
                start_factor,
                end_factor,
                total_iters,
            } => (4, start_factor, end_factor, total_iters as f64),
        }
    }

    /// The same operations as the kernel's `sched_apply`.
    fn apply(&self, lr: f64, t: u32) -> f64 {
        match *self {
            Term::Factor(a) => lr * a,
            Term::Step { step_size, gamma } => lr * ipow(gamma, t / step_size),
            Term::Exponential { gamma } => lr * ipow(gamma, t),
            Term::Cosine { t_max, eta_min } => {
                eta_min
                    + (lr - eta_min)
                        * (1.0 + (std::f64::consts::PI * t as f64 / t_max as f64).cos())
                        / 2.0
            }
            Term::Linear {
                start_factor,
                end_factor,
                total_iters,
            } => {
                let k = t.min(total_iters) as f64;
                lr * (start_factor + (end_factor - start_factor) * k / total_iters as f64)
            }
        }
    }
}

/// `base^k` by squaring (the kernel's `sched_ipow`, same operations).
fn ipow(mut base: f64, mut k: u32) -> f64 {
    let mut r = 1.0;
    while k != 0 {
        if k & 1 != 0 {
            r *= base;
        }
        base *= base;
        k >>= 1;
    }
    r
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Active {
    term: Term,
    /// The step at which this term's own `t` is 0.
    origin: u32,
}

#[derive(Clone, Debug, PartialEq)]
struct Phase {
    start: u32,
    terms: Vec<Active>,
}

/// A learning-rate schedule: see the [module documentation](self).
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    phases: Vec<Phase>,
}

fn invalid(what: &str) -> NnError {
    NnError::Shape(format!("learning-rate schedule: {what}"))
}

fn finite(name: &str, v: f64) -> Result<f64> {
    if v.is_finite() {
        Ok(v)
    } else {
        Err(invalid(&format!("{name} = {v} is not finite")))
    }
}

fn positive(name: &str, v: u32) -> Result<u32> {
    if v > 0 {
        Ok(v)
    } else {
        Err(invalid(&format!("{name} must be at least 1")))
    }
}

impl Schedule {
    fn single(term: Term) -> Self {
        Schedule {
            phases: vec![Phase {
                start: 0,
                terms: vec![Active { term, origin: 0 }],
            }],
        }
    }

    /// The base learning rate at every step.
    pub fn constant() -> Self {
        Schedule {
            phases: vec![Phase {
                start: 0,
                terms: Vec::new(),
            }],
        }
    }

    /// The base rate times a constant `factor`.
    pub fn factor(factor: f64) -> Result<Self> {
        Ok(Self::single(Term::Factor(finite("factor", factor)?)))
    }

    /// PyTorch's `StepLR(step_size, gamma)`: multiply by `gamma` every `step_size` steps.
    pub fn step_lr(step_size: u32, gamma: f64) -> Result<Self> {
        Ok(Self::single(Term::Step {
            step_size: positive("step_size", step_size)?,
            gamma: finite("gamma", gamma)?,
        }))
    }

    /// PyTorch's `ExponentialLR(gamma)`: multiply by `gamma` every step.
    pub fn exponential(gamma: f64) -> Result<Self> {
        Ok(Self::single(Term::Exponential {
            gamma: finite("gamma", gamma)?,
        }))
    }

    /// PyTorch's `CosineAnnealingLR(T_max, eta_min)` (closed form: periodic past `t_max`).
    /// `eta_min` is a learning rate, not a factor.
    pub fn cosine_annealing(t_max: u32, eta_min: f64) -> Result<Self> {
        Ok(Self::single(Term::Cosine {
            t_max: positive("t_max", t_max)?,
            eta_min: finite("eta_min", eta_min)?,
        }))
    }

    /// PyTorch's `LinearLR(start_factor, end_factor, total_iters)`.
    pub fn linear(start_factor: f64, end_factor: f64, total_iters: u32) -> Result<Self> {
        Ok(Self::single(Term::Linear {
            start_factor: finite("start_factor", start_factor)?,
            end_factor: finite("end_factor", end_factor)?,
            total_iters: positive("total_iters", total_iters)?,
        }))
    }

    /// Linear warm-up from `start_factor` of the base rate to the base rate over `steps` steps
    /// (`LinearLR(start_factor, 1.0, steps)`), the base rate after.
    pub fn linear_warmup(steps: u32, start_factor: f64) -> Result<Self> {
        Self::linear(start_factor, 1.0, steps)
    }

    /// This schedule until step `milestone`, then `next` started afresh (its step 0 is
    /// `milestone`): PyTorch's `SequentialLR([self, next], milestones=[milestone])`.
    pub fn then(self, milestone: u32, next: Schedule) -> Result<Self> {
        let mut phases: Vec<Phase> = self
            .phases
            .into_iter()
            .filter(|p| p.start < milestone)
            .collect();
        for p in next.phases {
            let shift = |v: u32| {
                v.checked_add(milestone)
                    .ok_or_else(|| invalid("milestone overflows the step counter"))
            };
            phases.push(Phase {
                start: shift(p.start)?,
                terms: p
                    .terms
                    .into_iter()
                    .map(|a| {
                        Ok(Active {
                            term: a.term,
                            origin: shift(a.origin)?,
                        })
                    })
                    .collect::<Result<_>>()?,
            });
        }
        Self::checked(phases)
    }

    /// Both schedules at once: this one's transformation, then `other`'s, each at its own
    /// step count (for factors: their product, like PyTorch's `ChainedScheduler`).
    pub fn chain(self, other: Schedule) -> Result<Self> {
        let mut starts: Vec<u32> = self
            .phases
            .iter()
            .chain(&other.phases)
            .map(|p| p.start)
            .collect();
        starts.sort_unstable();
        starts.dedup();
        let phases = starts
            .into_iter()
            .map(|s| {
                let mut terms = self.active(s).terms.clone();
                terms.extend(other.active(s).terms.iter().copied());
                Phase { start: s, terms }
            })
            .collect();
        Self::checked(phases)
    }

    fn checked(phases: Vec<Phase>) -> Result<Self> {
        if phases.len() > MAX_PHASES {
            return Err(invalid(&format!(
                "{} phases (at most {MAX_PHASES})",
                phases.len()
            )));
        }
        if let Some(p) = phases.iter().find(|p| p.terms.len() > MAX_TERMS) {
            return Err(invalid(&format!(
                "{} schedules active at step {} (at most {MAX_TERMS})",
                p.terms.len(),
                p.start
            )));
        }
        if phases.first().map(|p| p.start) != Some(0) {
            return Err(invalid("no phase starts at step 0"));
        }
        Ok(Schedule { phases })
    }

    fn active(&self, step: u32) -> &Phase {
        // Phases are sorted by start and the first starts at 0.
        let i = self.phases.partition_point(|p| p.start <= step);
        &self.phases[i.saturating_sub(1)]
    }

    /// The learning rate of the step after `t` steps were taken, for base rate `base_lr`:
    /// exactly what the device node computes (same `f64` operations, one rounding to `f32`).
    pub fn lr(&self, base_lr: f32, t: u32) -> f32 {
        let mut lr = base_lr as f64;
        for a in &self.active(t).terms {
            lr = a.term.apply(lr, t.saturating_sub(a.origin));
        }
        lr as f32
    }

    /// The device program (the kernel's `SchedProgram`, [`PROGRAM_BYTES`] bytes).
    pub fn program(&self) -> Vec<u8> {
        let mut b = vec![0u8; PROGRAM_BYTES];
        b[0..4].copy_from_slice(&(self.phases.len() as u32).to_le_bytes());
        for (i, p) in self.phases.iter().enumerate() {
            let at = 8 + i * (8 + 32 * MAX_TERMS);
            b[at..at + 4].copy_from_slice(&p.start.to_le_bytes());
            b[at + 4..at + 8].copy_from_slice(&(p.terms.len() as u32).to_le_bytes());
            for (k, a) in p.terms.iter().enumerate() {
                let t = at + 8 + 32 * k;
                let (kind, x, y, z) = a.term.code();
                b[t..t + 4].copy_from_slice(&kind.to_le_bytes());
                b[t + 4..t + 8].copy_from_slice(&a.origin.to_le_bytes());
                b[t + 8..t + 16].copy_from_slice(&x.to_le_bytes());
                b[t + 16..t + 24].copy_from_slice(&y.to_le_bytes());
                b[t + 24..t + 32].copy_from_slice(&z.to_le_bytes());
            }
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f64) -> bool {
        ((a as f64) - b).abs() <= 1e-6 * b.abs().max(1e-12)
    }

    #[test]
    fn step_lr_matches_pytorch_closed_form() {
        let s = Schedule::step_lr(3, 0.5).unwrap();
        for t in 0..12u32 {
            let want = 0.1 * 0.5f64.powi((t / 3) as i32);
            assert!(
                close(s.lr(0.1, t), want),
                "t {t}: {} vs {want}",
                s.lr(0.1, t)
            );
        }
    }

    #[test]
    fn exponential_cosine_and_linear_match_their_formulas() {
        let e = Schedule::exponential(0.9).unwrap();
        assert!(close(e.lr(1.0, 5), 0.9f64.powi(5)));
        let c = Schedule::cosine_annealing(10, 0.001).unwrap();
        assert_eq!(c.lr(0.1, 0), 0.1);
        assert!(close(c.lr(0.1, 5), 0.001 + 0.099 * 0.5));
        assert!(close(c.lr(0.1, 10), 0.001));
        // Periodic past t_max, like PyTorch's closed form.
        assert!(close(c.lr(0.1, 20), 0.1));
        let l = Schedule::linear(0.25, 1.0, 4).unwrap();
        let want = [0.25, 0.4375, 0.625, 0.8125, 1.0, 1.0];
        for (t, w) in want.iter().enumerate() {
            assert!(close(l.lr(1.0, t as u32), *w), "t {t}");
        }
        assert_eq!(Schedule::constant().lr(0.3, 1000), 0.3);
        assert!(close(Schedule::factor(0.5).unwrap().lr(0.3, 7), 0.15));
    }

    #[test]
    fn warmup_then_cosine_switches_at_the_milestone() {
        let s = Schedule::linear_warmup(4, 0.1)
            .unwrap()
            .then(4, Schedule::cosine_annealing(8, 0.0).unwrap())
            .unwrap();
        assert!(close(s.lr(1.0, 0), 0.1));
        assert!(close(s.lr(1.0, 2), 0.55));
        assert_eq!(s.lr(1.0, 4), 1.0); // cosine at its own step 0
        assert!(close(s.lr(1.0, 8), 0.5)); // cosine step 4 of 8
        assert!(close(s.lr(1.0, 12), 0.0) || s.lr(1.0, 12).abs() < 1e-7);
    }

    #[test]
    fn chain_applies_both_at_their_own_steps() {
        let s = Schedule::linear_warmup(2, 0.5)
            .unwrap()
            .chain(Schedule::step_lr(3, 0.1).unwrap())
            .unwrap();
        let want = [0.5, 0.75, 1.0, 0.1, 0.1, 0.1, 0.01];
        for (t, w) in want.iter().enumerate() {
            assert!(
                close(s.lr(1.0, t as u32), *w),
                "t {t}: {}",
                s.lr(1.0, t as u32)
            );
        }
        // A chain inside a sequence keeps each term's origin.
        let seq = Schedule::constant().then(10, s.clone()).unwrap();
        assert_eq!(seq.lr(1.0, 9), 1.0);
        for t in 0..7u32 {
            assert_eq!(seq.lr(1.0, 10 + t), s.lr(1.0, t));
        }
    }

    #[test]
    fn invalid_schedules_are_errors_not_panics() {
        assert!(Schedule::step_lr(0, 0.1).is_err());
        assert!(Schedule::cosine_annealing(0, 0.0).is_err());
        assert!(Schedule::linear(0.1, 1.0, 0).is_err());
        assert!(Schedule::exponential(f64::NAN).is_err());
        assert!(Schedule::factor(f64::INFINITY).is_err());
        assert!(Schedule::constant()
            .then(
                u32::MAX,
                Schedule::step_lr(1, 0.5)
                    .unwrap()
                    .then(5, Schedule::constant())
                    .unwrap()
            )
            .is_err());
        let mut s = Schedule::constant();
        for i in 1..MAX_PHASES as u32 {
            s = s.then(i * 10, Schedule::constant()).unwrap();
        }
        assert!(s.clone().then(1000, Schedule::constant()).is_err());
        let five = (0..4).try_fold(Schedule::factor(0.5).unwrap(), |a, _| {
            a.chain(Schedule::factor(0.5).unwrap())
        });
        assert!(five.is_err());
    }

    #[test]
    fn program_layout_matches_the_kernel_struct() {
        assert_eq!(PROGRAM_BYTES, 1096);
        let s = Schedule::linear_warmup(5, 0.2)
            .unwrap()
            .then(5, Schedule::step_lr(7, 0.5).unwrap())
            .unwrap();
        let b = s.program();
        assert_eq!(b.len(), PROGRAM_BYTES);
        let u = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        let f = |at: usize| f64::from_le_bytes(b[at..at + 8].try_into().unwrap());
        assert_eq!(u(0), 2);
        let p1 = 8 + 8 + 32 * MAX_TERMS;
        assert_eq!((u(8), u(12)), (0, 1));
        assert_eq!((u(16), u(20), f(24), f(32), f(40)), (4, 0, 0.2, 1.0, 5.0));
        assert_eq!((u(p1), u(p1 + 4)), (5, 1));
        assert_eq!(
            (u(p1 + 8), u(p1 + 12), f(p1 + 16), f(p1 + 24)),
            (1, 5, 7.0, 0.5)
        );
    }

    #[test]
    fn integer_powers_by_squaring_are_exact_for_small_cases() {
        assert_eq!(ipow(0.5, 0), 1.0);
        assert_eq!(ipow(0.5, 3), 0.125);
        assert_eq!(ipow(2.0, 31), 2147483648.0);
        assert_eq!(ipow(0.9, 1_000_000), 0.0);
    }
}
