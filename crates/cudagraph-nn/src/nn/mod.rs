//! Layers, optimizers, loss scaling, gradient clipping, learning-rate schedules, training
//! steps on the device, graphed modules and batched serving models.

pub mod autocast;
pub mod batched;
pub mod clip;
pub mod gpt;
pub mod graphed;
pub mod layers;
pub mod optim;
pub mod sampling;
pub mod scaler;
pub mod schedule;
pub mod steps;
