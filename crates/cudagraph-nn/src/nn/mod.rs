//! Layers, optimizers, learning-rate schedules, training steps on the device, graphed modules
//! and batched serving models.

pub mod batched;
pub mod graphed;
pub mod layers;
pub mod optim;
pub mod schedule;
pub mod steps;
