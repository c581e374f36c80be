//! Copies as a kernel. Device-to-device copies of whole 16-byte words between 16-byte aligned
//! addresses, up to [`MAX_KERNEL_COPY`] bytes, run as `cg_copy16` (`copy.cu`, compiled with
//! NVRTC on the first eager copy and cached) instead of the driver's copy, whose fixed cost is
//! several microseconds (a copy-engine operation) where a kernel launch costs about two. Copies
//! between the device and our page-locked staging (mapped into the device's address space), up
//! to [`MAX_MAPPED_COPY`] bytes of any length, run as `cg_copy_mapped` the same way: the
//! static inputs and outputs of a [`crate::StaticGraph`] and the transfers of a
//! [`crate::Stream::pinned_scope`]. Inside a graph the copy becomes a kernel node. Everything
//! else — unaligned or odd-sized device copies, large ones, a machine without NVRTC, a capture
//! before any eager use compiled the kernels ([`prepare`] compiles them ahead), or
//! `CUDAGRAPH_COPY_KERNEL=0` — uses the driver's copy. Both give the same bytes.

use std::sync::OnceLock;

use super::Device;
use crate::runtime::{Function, LaunchConfig};

/// The kernel's CUDA source.
pub const COPY_CUDA: &str = include_str!("copy.cu");

/// The largest copy that runs as a kernel (beyond it both move bytes at about the same rate).
pub const MAX_KERNEL_COPY: usize = 64 << 20;

/// Turns the copy kernel off (`0`, `false`, `off`, `no`); on by default. Measured on the H100
/// (2026-11-23): the seed MLP at batch 1, graphed with its copy in and out, 13.1 → 11.9 µs per
/// request; equal where the GPU work dominates.
pub const COPY_KERNEL_VAR: &str = "CUDAGRAPH_COPY_KERNEL";

/// The largest copy between the device and mapped page-locked memory that runs as a kernel.
/// Measured on the H100 (2026-11-24, `bench/probe/zero_copy.py`, the seed MLP graphed with its
/// input and output copies, one replay and one synchronisation per request, two runs): the
/// kernels save 3.9–12.2 µs per request from 4 KiB to 1 MiB of input (bs 1: 32.6 → 25.1 µs and
/// 28.6 → 23.2; bs 256: 115.6 → 104.7 and 115.5 → 105.3) and lose 6–10 µs at 8 MiB (264.3 →
/// 270.5, 267.7 → 277.4), where the copy engine's bandwidth wins.
pub const MAX_MAPPED_COPY: usize = 2 << 20;

/// The copy kernels of one device (a device extension); `None` when they could not be compiled.
struct CopyKernel(Option<(Function, Function)>);

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        !matches!(
            std::env::var(COPY_KERNEL_VAR)
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase()
                .as_str(),
            "0" | "false" | "off" | "no"
        )
    })
}

/// Whether a copy of `bytes` bytes between these addresses can run as the kernel: whole
/// 16-byte words, both ends aligned, at most [`MAX_KERNEL_COPY`] bytes.
pub fn kernel_copy_fits(dst: u64, src: u64, bytes: usize) -> bool {
    bytes > 0 && bytes <= MAX_KERNEL_COPY && bytes % 16 == 0 && dst % 16 == 0 && src % 16 == 0
}

/// The kernels (`cg_copy16`, `cg_copy_mapped`), compiled on the first eager use; inside a
/// capture only kernels compiled before are used.
fn kernels(device: &Device, capturing: bool) -> Option<(Function, Function)> {
    if !enabled() {
        return None;
    }
    let k = if capturing {
        device.extension_ready::<CopyKernel>()?
    } else {
        device
            .extension(|d| {
                let m = d.compile("cudagraph_copy", COPY_CUDA).ok();
                let f = |name| m.as_ref().and_then(|m| m.function(name).ok());
                Ok(CopyKernel(f("cg_copy16").zip(f("cg_copy_mapped"))))
            })
            .ok()?
    };
    k.0.clone()
}

/// Compiles the copy kernels now (eagerly), so that a capture about to begin can use them;
/// without NVRTC, or with `CUDAGRAPH_COPY_KERNEL=0`, it does nothing (the driver copies).
pub(crate) fn prepare(device: &Device) {
    let _ = kernels(device, false);
}

/// A grid for `words` 16-byte words: a block of 256 per 256 words, at most four per
/// multiprocessor (the loop strides over the rest).
fn grid(device: &Device, words: usize) -> LaunchConfig {
    let blocks = words
        .div_ceil(256)
        .clamp(1, 4 * device.info().multiprocessors.max(1) as usize);
    LaunchConfig::linear(blocks as u32, 256)
}

/// The kernel and launch shape for this device copy, or `None` for the driver's copy.
pub(crate) fn kernel_for(
    device: &Device,
    capturing: bool,
    dst: u64,
    src: u64,
    bytes: usize,
) -> Option<(Function, LaunchConfig)> {
    if !kernel_copy_fits(dst, src, bytes) {
        return None;
    }
    let (copy16, _) = kernels(device, capturing)?;
    Some((copy16, grid(device, bytes / 16)))
}

/// Whether a copy of `bytes` bytes between device memory and mapped page-locked memory can
/// run as the kernel: both addresses 16-byte aligned, 1 to [`MAX_MAPPED_COPY`] bytes.
pub fn mapped_copy_fits(dst: u64, src: u64, bytes: usize) -> bool {
    bytes > 0 && bytes <= MAX_MAPPED_COPY && dst % 16 == 0 && src % 16 == 0
}

/// A copy between device memory and mapped page-locked memory as a kernel: the function, its
/// launch shape, and the whole 16-byte words and trailing bytes it copies (its last two
/// arguments); `None` for the driver's copy. `dst` and `src` are device-side addresses.
pub(crate) fn mapped_kernel_for(
    device: &Device,
    capturing: bool,
    dst: u64,
    src: u64,
    bytes: usize,
) -> Option<(Function, LaunchConfig, u64, u32)> {
    if !mapped_copy_fits(dst, src, bytes) {
        return None;
    }
    let (_, mapped) = kernels(device, capturing)?;
    let words = bytes / 16;
    Some((
        mapped,
        grid(device, words),
        words as u64,
        (bytes % 16) as u32,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_aligned_words_up_to_the_limit_run_as_a_kernel() {
        assert!(kernel_copy_fits(256, 512, 16));
        assert!(kernel_copy_fits(16, 32, MAX_KERNEL_COPY));
        assert!(!kernel_copy_fits(256, 512, 0));
        assert!(!kernel_copy_fits(256, 512, 20));
        assert!(!kernel_copy_fits(256 + 4, 512, 16));
        assert!(!kernel_copy_fits(256, 512 + 8, 16));
        assert!(!kernel_copy_fits(256, 512, MAX_KERNEL_COPY + 16));
    }

    #[test]
    fn mapped_copies_of_any_length_up_to_the_limit_run_as_a_kernel() {
        assert!(mapped_copy_fits(4096, 256, 1));
        assert!(mapped_copy_fits(4096, 256, 40));
        assert!(mapped_copy_fits(4096, 256, MAX_MAPPED_COPY));
        assert!(!mapped_copy_fits(4096, 256, 0));
        assert!(!mapped_copy_fits(4096, 256, MAX_MAPPED_COPY + 1));
        assert!(!mapped_copy_fits(4096 + 4, 256, 64));
        assert!(!mapped_copy_fits(4096, 256 + 8, 64));
    }
}
