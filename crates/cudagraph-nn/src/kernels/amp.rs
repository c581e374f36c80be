//! Loss scaling and gradient clipping on the device (`scaler.cu`, `clip.cu`, compiled with
//! `mt_table.cu` as the `cudagraph_nn_amp` module) and their checked launchers: the scale of a
//! loss by a device scalar, the multi-tensor inf/NaN check (and in-place unscale) of a
//! GradScaler, its one-thread update, and the three launches of clipping by global norm.
//!
//! Multi-tensor launches use the optimizers' tables ([`super::optim_mt::build_tables`], depth
//! one: the gradient); as there, every length written into a table is checked against its
//! buffer, every buffer's device is checked, and every buffer is declared with
//! [`Queue::use_block`].

use std::sync::Arc;

use cudagraph::{Arg, Device, DeviceBuffer, Function, LaunchConfig, Queue, QueueExt};

use super::need;
use super::optim_mt::{amp_slots, build_tables, chunk_elems, grid_for, same_device};
use super::optim_mt::{Table, TableEntry, BLOCK, CAP_L, CAP_S, TABLE_SOURCE};
use crate::error::{NnError, Result};

/// The scaler's kernels.
pub const SCALER_SOURCE: &str = include_str!("scaler.cu");
/// The clipping kernels.
pub const CLIP_SOURCE: &str = include_str!("clip.cu");

/// The module's source as compiled: the table, the scaler's kernels, the clipping kernels.
pub fn module_source() -> String {
    format!("{TABLE_SOURCE}{SCALER_SOURCE}{CLIP_SOURCE}")
}

/// Most blocks of an elementwise scale; the kernel strides over the rest.
const MAX_BLOCKS: usize = 65_536;

/// The amp kernels of one device (a [`Device::extension`]).
pub struct AmpKernels {
    scale: Function,
    unscale: [Function; 2],
    update: Function,
    partials: [Function; 2],
    total: Function,
    clip: [Function; 2],
    sms: u32,
    large_params: bool,
}

/// A GradScaler's update rule (PyTorch's `growth_factor`, `backoff_factor`,
/// `growth_interval`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UpdateRule {
    pub growth: f64,
    pub backoff: f64,
    pub interval: u32,
}

/// The gradients of a multi-tensor pass as depth-one table entries (empty ones left out).
fn grad_entries(q: &dyn Queue, grads: &[&DeviceBuffer<f32>]) -> Result<Vec<TableEntry<1>>> {
    grads
        .iter()
        .map(|g| {
            same_device(q, g)?;
            Ok(TableEntry::<1> {
                addrs: [g.addr()],
                n: g.len() as u64,
                slot: 0,
            })
        })
        .collect()
}

/// [`plan_entries`] for tensors of the given lengths (made-up addresses).
#[cfg(test)]
fn plan(grads_len: &[usize], sms: u32, cap_large: usize) -> Result<(Vec<Table>, u32, Vec<u64>)> {
    let entries: Vec<TableEntry<1>> = grads_len
        .iter()
        .enumerate()
        .map(|(i, &n)| TableEntry::<1> {
            addrs: [i as u64],
            n: n as u64,
            slot: 0,
        })
        .collect();
    plan_entries(&entries, sms, cap_large)
}

/// The tables of a pass over `entries`, their chunk size, and the chunks before each table.
fn plan_entries(
    entries: &[TableEntry<1>],
    sms: u32,
    cap_large: usize,
) -> Result<(Vec<Table>, u32, Vec<u64>)> {
    let total: u64 = entries.iter().map(|e| e.n).sum();
    let chunk = chunk_elems(total, sms);
    let tables = build_tables(entries, chunk, cap_large)?;
    let mut before = Vec::with_capacity(tables.len());
    let mut acc = 0u64;
    for t in &tables {
        before.push(acc);
        acc += t.chunks as u64;
    }
    Ok((tables, chunk, before))
}

fn long(what: &str, v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|_| NnError::Shape(format!("{what}: {v} exceeds a 64-bit int")))
}

impl AmpKernels {
    /// The kernels of `device`, compiled on first use.
    pub fn get(device: &Device) -> Result<Arc<Self>> {
        Ok(device.extension(|d| {
            // Relaxed capture mode: the first use may be inside a capture (module loading).
            let m = cudagraph::runtime::with_relaxed_capture(|| {
                d.compile(
                    "cudagraph_nn_amp",
                    &super::module_source("cudagraph_nn_amp"),
                )
            })?;
            Ok(AmpKernels {
                scale: m.function("amp_scale")?,
                unscale: [m.function("amp_unscale_s")?, m.function("amp_unscale_l")?],
                update: m.function("amp_update")?,
                partials: [
                    m.function("clip_partials_s")?,
                    m.function("clip_partials_l")?,
                ],
                total: m.function("clip_total")?,
                clip: [m.function("clip_scale_s")?, m.function("clip_scale_l")?],
                sms: d.info().multiprocessors,
                large_params: d.info().driver_version >= 12010,
            })
        })?)
    }

    fn cap_large(&self) -> usize {
        if self.large_params {
            CAP_L
        } else {
            CAP_S
        }
    }

    /// `y[i] = x[i] · s[0]` for `i < y.len()` (`x` of the same length), or `y[i] = s[0]`
    /// without `x`.
    pub fn scale(
        &self,
        q: &dyn Queue,
        x: Option<&DeviceBuffer<f32>>,
        y: &DeviceBuffer<f32>,
        s: &DeviceBuffer<f32>,
    ) -> Result<()> {
        let n = y.len();
        if let Some(x) = x {
            if x.len() != n {
                return Err(NnError::Core(cudagraph::Error::SizeMismatch {
                    what: "scale by a device scalar",
                    expected: n,
                    got: x.len(),
                }));
            }
            same_device(q, x)?;
        }
        need("device scale", s, 1)?;
        same_device(q, y)?;
        same_device(q, s)?;
        if n == 0 {
            return Ok(());
        }
        let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS);
        let x_arg = Arg::opt(x);
        // SAFETY: the kernel writes y[i] and reads x[i] (when x is not null) for i < n, both of
        // n elements (checked), and reads s[0] (checked); all on this device.
        unsafe {
            super::launch(
                q,
                &self.scale,
                LaunchConfig::linear(blocks as u32, BLOCK),
                &[
                    x_arg,
                    y.into(),
                    s.into(),
                    Arg::I64(long("scale", n as u64)?),
                ],
            )
        }
    }

    /// PyTorch's `_amp_foreach_non_finite_check_and_unscale_` over `grads`: sets
    /// `amp[FOUND + found]` to 1 when any element is inf or NaN (the flag is not cleared
    /// here), and with `unscale` multiplies every element by 1/`amp[SCALE]` in place.
    pub fn unscale(
        &self,
        q: &dyn Queue,
        grads: &[&DeviceBuffer<f32>],
        amp: &DeviceBuffer<f32>,
        found: usize,
        unscale: bool,
    ) -> Result<()> {
        let flag = amp_slots::FOUND
            .checked_add(found)
            .ok_or_else(|| NnError::Shape(format!("found-inf flag {found}")))?;
        need("scaler state", amp, flag + 1)?;
        same_device(q, amp)?;
        let entries = grad_entries(q, grads)?;
        let (tables, chunk, _) = plan_entries(&entries, self.sms, self.cap_large())?;
        for g in grads {
            q.use_block(g.block());
        }
        let found =
            i32::try_from(found).map_err(|_| NnError::Shape(format!("found-inf flag {found}")))?;
        for t in &tables {
            let f = &self.unscale[(t.cap != CAP_S) as usize];
            // SAFETY: every tensor of the table has n = the length of its gradient buffer, on
            // this device and declared with use_block; the kernel touches p[0][i][0..n) only,
            // reads amp[0] and writes amp[1 + found] (checked above).
            unsafe {
                super::launch(
                    q,
                    f,
                    grid_for(t, self.sms),
                    &[
                        Arg::Bytes(&t.bytes),
                        amp.into(),
                        Arg::I32(found),
                        Arg::I32(unscale as i32),
                        Arg::I32(chunk as i32),
                    ],
                )?;
            }
        }
        Ok(())
    }

    /// PyTorch's `_amp_update_scale_` with the sum of flags `amp[FOUND..FOUND + slots]` as
    /// the found-inf value: one thread.
    pub fn update(
        &self,
        q: &dyn Queue,
        amp: &DeviceBuffer<f32>,
        tracker: &DeviceBuffer<u32>,
        slots: usize,
        rule: UpdateRule,
    ) -> Result<()> {
        need("scaler state", amp, amp_slots::FOUND + slots)?;
        need("growth tracker", tracker, 1)?;
        same_device(q, amp)?;
        same_device(q, tracker)?;
        let slots =
            i32::try_from(slots).map_err(|_| NnError::Shape(format!("{slots} found-inf flags")))?;
        // SAFETY: one thread reads amp[0..1 + slots) and writes amp[0] (checked) and
        // tracker[0] (checked).
        unsafe {
            super::launch(
                q,
                &self.update,
                LaunchConfig::linear(1, 32),
                &[
                    amp.into(),
                    tracker.into(),
                    Arg::I32(slots),
                    Arg::F64(rule.growth),
                    Arg::F64(rule.backoff),
                    Arg::U32(rule.interval),
                ],
            )
        }
    }

    /// PyTorch's `clip_grad_norm_(grads, max_norm)` (L2, eps 1e-6): writes the total norm to
    /// `norm[0]` and the factor `min(1, max_norm / (norm + 1e-6))` to `coef[0]`, and
    /// multiplies every gradient by the factor when it is not 1. A workspace of one f64 per
    /// chunk comes from `q`.
    pub fn clip(
        &self,
        q: &dyn Queue,
        grads: &[&DeviceBuffer<f32>],
        max_norm: f32,
        norm: &DeviceBuffer<f32>,
        coef: &DeviceBuffer<f32>,
    ) -> Result<()> {
        need("clip norm", norm, 1)?;
        need("clip factor", coef, 1)?;
        same_device(q, norm)?;
        same_device(q, coef)?;
        let entries = grad_entries(q, grads)?;
        let (tables, chunk, before) = plan_entries(&entries, self.sms, self.cap_large())?;
        let parts: u64 = tables.iter().map(|t| t.chunks as u64).sum();
        // At least one value, so the final kernel has an address to read past nothing.
        let partial = q.alloc::<f64>((parts as usize).max(1))?;
        for g in grads {
            q.use_block(g.block());
        }
        for (t, &base) in tables.iter().zip(&before) {
            if t.chunks == 0 {
                continue;
            }
            let f = &self.partials[(t.cap != CAP_S) as usize];
            // SAFETY: every tensor of the table has n = the length of its gradient (read
            // only); the kernel writes partial[base + c] for the table's chunks c, and
            // base + chunks ≤ parts = partial.len() (the prefix sums of the same tables).
            unsafe {
                super::launch(
                    q,
                    f,
                    grid_for(t, self.sms),
                    &[
                        Arg::Bytes(&t.bytes),
                        (&partial).into(),
                        Arg::I64(long("clip chunks", base)?),
                        Arg::I32(chunk as i32),
                    ],
                )?;
            }
        }
        // SAFETY: one block reads partial[0..parts) (parts ≤ its length) and writes norm[0]
        // and coef[0] (checked).
        unsafe {
            super::launch(
                q,
                &self.total,
                LaunchConfig::linear(1, BLOCK),
                &[
                    (&partial).into(),
                    Arg::I64(long("clip chunks", parts)?),
                    norm.into(),
                    coef.into(),
                    Arg::F32(max_norm),
                ],
            )?;
        }
        for t in &tables {
            if t.chunks == 0 {
                continue;
            }
            let f = &self.clip[(t.cap != CAP_S) as usize];
            // SAFETY: as for the partials, the kernel touches p[0][i][0..n) of each gradient
            // (checked lengths, use_block above) and reads coef[0] (checked).
            unsafe {
                super::launch(
                    q,
                    f,
                    grid_for(t, self.sms),
                    &[Arg::Bytes(&t.bytes), coef.into(), Arg::I32(chunk as i32)],
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_offsets_are_the_chunks_of_the_tables_before() {
        // 600 tensors of 3000 elements (chunks of 2048: two each): a 512-tensor table and an
        // 88-tensor one.
        let sizes = vec![3000usize; 600];
        let (tables, chunk, before) = plan(&sizes, 132, CAP_L).unwrap();
        assert_eq!(chunk, 2048);
        assert_eq!(tables.len(), 2);
        assert_eq!((tables[0].count, tables[1].count), (512, 88));
        assert_eq!((tables[0].chunks, tables[1].chunks), (1024, 176));
        assert_eq!(before, vec![0, 1024]);
        // Nothing to do still plans one empty table.
        let (tables, _, before) = plan(&[], 132, CAP_L).unwrap();
        assert_eq!((tables.len(), tables[0].chunks, before[0]), (1, 0, 0));
        // Empty gradients are left out.
        let (tables, _, _) = plan(&[0, 5, 0], 132, CAP_L).unwrap();
        assert_eq!((tables[0].count, tables[0].chunks), (1, 1));
    }

    #[test]
    fn the_module_holds_the_table_then_both_passes() {
        let m = module_source();
        assert!(m.starts_with(TABLE_SOURCE));
        for k in [
            "amp_scale(",
            "amp_unscale_s(",
            "amp_update(",
            "clip_partials_l(",
            "clip_total(",
            "clip_scale_s(",
        ] {
            assert!(m.contains(&format!("void {k}")) || m.contains(k), "{k}");
        }
        assert!(!m.contains("#include"), "NVRTC has no include path here");
    }
}
