//! Device-to-device copies as a kernel: copies of whole 16-byte words between 16-byte aligned
//! addresses, up to [`MAX_KERNEL_COPY`] bytes, run as `cg_copy16` (`copy.cu`, compiled with
//! NVRTC on the first eager copy and cached) instead of the driver's copy, whose fixed cost is
//! several microseconds (a copy-engine operation) where a kernel launch costs about two. Inside
//! a graph the copy becomes a kernel node. Everything else — unaligned or odd-sized copies,
//! large ones, a machine without NVRTC, a capture before any eager copy compiled the kernel,
//! or `CUDAGRAPH_COPY_KERNEL=0` — uses the driver's copy. Both give the same bytes.

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

/// The copy kernel of one device (a device extension); `None` when it could not be compiled.
struct CopyKernel(Option<Function>);

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

/// The kernel and launch shape for this copy, or `None` for the driver's copy. Compiles the
/// kernel on the first eager use; inside a capture only a kernel compiled before is used.
pub(crate) fn kernel_for(
    device: &Device,
    capturing: bool,
    dst: u64,
    src: u64,
    bytes: usize,
) -> Option<(Function, LaunchConfig)> {
    if !enabled() || !kernel_copy_fits(dst, src, bytes) {
        return None;
    }
    let k = if capturing {
        device.extension_ready::<CopyKernel>()?
    } else {
        device
            .extension(|d| {
                Ok(CopyKernel(
                    d.compile("cudagraph_copy", COPY_CUDA)
                        .and_then(|m| m.function("cg_copy16"))
                        .ok(),
                ))
            })
            .ok()?
    };
    let f = k.0.clone()?;
    let words = bytes / 16;
    let blocks = words
        .div_ceil(256)
        .clamp(1, 4 * device.info().multiprocessors.max(1) as usize);
    Some((f, LaunchConfig::linear(blocks as u32, 256)))
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
}
