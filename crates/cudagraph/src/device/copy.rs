//! Copies as a kernel. Copies between 16-byte aligned addresses run as `cg_copy` (`copy.cu`,
//! compiled with NVRTC on the first eager copy and cached: 16-byte words, then up to 15 trailing
//! bytes) instead of the driver's copy, whose fixed cost is several microseconds (a copy-engine
//! operation) where a kernel launch costs about two: device-to-device copies up to
//! [`MAX_KERNEL_COPY`] bytes, and copies between the device and our page-locked staging (mapped
//! into the device's address space) up to [`MAX_MAPPED_COPY`] bytes — the static inputs and
//! outputs of a [`crate::StaticGraph`] and the transfers of a
//! [`crate::Stream::pinned_scope`]. Inside a graph the copy becomes a kernel node. Everything
//! else — unaligned addresses, large copies, a machine without NVRTC, a capture before any eager
//! use compiled the kernel ([`prepare`] compiles it ahead), or `CUDAGRAPH_COPY_KERNEL=0`
//! ([`crate::env::COPY_KERNEL`]) — uses the driver's copy. Both give the same bytes.

use super::Device;
use crate::env::{self, CachedSwitch};
use crate::error::Result;
use crate::runtime::{Function, LaunchConfig};

/// The kernel's CUDA source.
pub const COPY_CUDA: &str = include_str!("copy.cu");

/// The largest copy that runs as a kernel (beyond it both move bytes at about the same rate).
pub const MAX_KERNEL_COPY: usize = 64 << 20;

/// The variable that turns the copy kernel off ([`env::COPY_KERNEL`]; on by default). Measured
/// on the H100: the seed MLP at batch 1, graphed with its copy in and out, 13.1 → 11.9 µs per
/// request; equal where the GPU work dominates.
pub use crate::env::COPY_KERNEL as COPY_KERNEL_VAR;

/// The largest copy between the device and mapped page-locked memory that runs as a kernel.
/// Measured on the H100 (docs/graphs.md; the seed MLP graphed with its
/// input and output copies, one replay and one synchronisation per request, two runs): the
/// kernels save 3.9–12.2 µs per request from 4 KiB to 1 MiB of input (bs 1: 32.6 → 25.1 µs and
/// 28.6 → 23.2; bs 256: 115.6 → 104.7 and 115.5 → 105.3) and lose 6–10 µs at 8 MiB (264.3 →
/// 270.5, 267.7 → 277.4), where the copy engine's bandwidth wins.
pub const MAX_MAPPED_COPY: usize = 2 << 20;

/// The copy kernel of one device (a device extension); `None` when it could not be compiled.
struct CopyKernel(Option<Function>);

/// Whether copies may run as the kernel ([`env::COPY_KERNEL`], read at the first copy); an
/// error when the variable is not a switch.
fn enabled() -> Result<bool> {
    static ON: CachedSwitch = CachedSwitch::new(env::COPY_KERNEL, true);
    ON.get()
}

/// Whether a device-to-device copy of `bytes` bytes between these addresses can run as the
/// kernel: both ends 16-byte aligned, 1 to [`MAX_KERNEL_COPY`] bytes.
pub fn kernel_copy_fits(dst: u64, src: u64, bytes: usize) -> bool {
    aligned(dst, src) && bytes > 0 && bytes <= MAX_KERNEL_COPY
}

fn aligned(dst: u64, src: u64) -> bool {
    dst % 16 == 0 && src % 16 == 0
}

/// The kernel, compiled on the first eager use; inside a capture only a kernel compiled before
/// is used.
fn kernel(device: &Device, capturing: bool) -> Result<Option<Function>> {
    if !enabled()? {
        return Ok(None);
    }
    let k = if capturing {
        device.extension_ready::<CopyKernel>()
    } else {
        device
            .extension(|d| {
                let m = d.compile("cudagraph_copy", COPY_CUDA).ok();
                Ok(CopyKernel(m.and_then(|m| m.function("cg_copy").ok())))
            })
            .ok()
    };
    Ok(k.and_then(|k| k.0.clone()))
}

/// Compiles the copy kernel now (eagerly), so that a capture about to begin can use it;
/// without NVRTC, or with `CUDAGRAPH_COPY_KERNEL=0`, it does nothing (the driver copies). A
/// variable that is not a switch is reported by the copies themselves.
pub(crate) fn prepare(device: &Device) {
    let _ = kernel(device, false);
}

/// A grid for `words` 16-byte words: a block of 256 per 256 words, at most four per
/// multiprocessor (the loop strides over the rest).
fn grid(device: &Device, words: usize) -> LaunchConfig {
    let blocks = words
        .div_ceil(256)
        .clamp(1, 4 * device.info().multiprocessors.max(1) as usize);
    LaunchConfig::linear(blocks as u32, 256)
}

/// A copy as the kernel: the function, its launch shape, and its last two arguments (whole
/// 16-byte words, then trailing bytes).
pub(crate) struct KernelCopy {
    pub f: Function,
    pub cfg: LaunchConfig,
    pub words: u64,
    pub tail: u32,
}

fn plan(device: &Device, capturing: bool, bytes: usize) -> Result<Option<KernelCopy>> {
    let Some(f) = kernel(device, capturing)? else {
        return Ok(None);
    };
    let words = bytes / 16;
    Ok(Some(KernelCopy {
        f,
        cfg: grid(device, words),
        words: words as u64,
        tail: (bytes % 16) as u32,
    }))
}

/// This device-to-device copy as the kernel, or `None` for the driver's copy; an error when
/// [`env::COPY_KERNEL`] is not a switch.
pub(crate) fn kernel_for(
    device: &Device,
    capturing: bool,
    dst: u64,
    src: u64,
    bytes: usize,
) -> Result<Option<KernelCopy>> {
    if !kernel_copy_fits(dst, src, bytes) {
        return Ok(None);
    }
    plan(device, capturing, bytes)
}

/// Whether a copy of `bytes` bytes between device memory and mapped page-locked memory can
/// run as the kernel: both addresses 16-byte aligned, 1 to [`MAX_MAPPED_COPY`] bytes.
pub fn mapped_copy_fits(dst: u64, src: u64, bytes: usize) -> bool {
    aligned(dst, src) && bytes > 0 && bytes <= MAX_MAPPED_COPY
}

/// This copy between device memory and mapped page-locked memory (`dst` and `src` device-side
/// addresses) as the kernel, or `None` for the driver's copy; an error when
/// [`env::COPY_KERNEL`] is not a switch.
pub(crate) fn mapped_kernel_for(
    device: &Device,
    capturing: bool,
    dst: u64,
    src: u64,
    bytes: usize,
) -> Result<Option<KernelCopy>> {
    if !mapped_copy_fits(dst, src, bytes) {
        return Ok(None);
    }
    plan(device, capturing, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_device_copies_of_any_length_up_to_the_limit_run_as_a_kernel() {
        assert!(kernel_copy_fits(256, 512, 16));
        assert!(kernel_copy_fits(256, 512, 1));
        assert!(kernel_copy_fits(256, 512, 20));
        assert!(kernel_copy_fits(16, 32, MAX_KERNEL_COPY));
        assert!(!kernel_copy_fits(256, 512, 0));
        assert!(!kernel_copy_fits(256 + 4, 512, 16));
        assert!(!kernel_copy_fits(256, 512 + 8, 16));
        assert!(!kernel_copy_fits(256, 512, MAX_KERNEL_COPY + 1));
        assert!(!kernel_copy_fits(256, 512, usize::MAX));
    }

    #[test]
    fn mapped_copies_of_any_length_up_to_the_limit_run_as_a_kernel() {
        assert!(mapped_copy_fits(4096, 256, 1));
        assert!(mapped_copy_fits(4096, 256, 40));
        assert!(mapped_copy_fits(4096, 256, MAX_MAPPED_COPY));
        assert!(!mapped_copy_fits(4096, 256, 0));
        assert!(!mapped_copy_fits(4096, 256, MAX_MAPPED_COPY + 1));
        assert!(!mapped_copy_fits(4096, 256, usize::MAX));
        assert!(!mapped_copy_fits(4096 + 4, 256, 64));
        assert!(!mapped_copy_fits(4096, 256 + 8, 64));
    }
}
