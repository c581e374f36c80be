//! Run-time kernel compilation with NVRTC, cached twice: in memory per context (see
//! [`super::Context::compile`]) and on disk as PTX keyed by source text, target architecture
//! and this crate's version, so a second process loads instead of recompiling.
//!
//! The cache directory is `$CUDAGRAPH_CACHE_DIR` ([`crate::env::CACHE_DIR`]), else
//! `$XDG_CACHE_HOME/cudagraph`, else `~/.cache/cudagraph`. Set `CUDAGRAPH_CACHE_DIR=off` to
//! disable the disk cache.

use std::path::PathBuf;

use crate::env;
use crate::error::{Error, Result};

/// FNV-1a over the inputs: stable across Rust versions, unlike `DefaultHasher`.
pub(crate) fn cache_key(source: &str, arch: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in [source, "\0", arch, "\0", env!("CARGO_PKG_VERSION")] {
        for b in part.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Where compiled PTX is cached, or `None` when the disk cache is off or has no home.
pub fn cache_dir() -> Option<PathBuf> {
    match env::value(env::CACHE_DIR) {
        Some(v) if v == "off" => None,
        Some(v) => Some(PathBuf::from(v)),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(|d| PathBuf::from(d).join("cudagraph"))
            .or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/cudagraph"))
            }),
    }
}

fn cache_file(name: &str, arch: &str, key: u64) -> Option<PathBuf> {
    let clean: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    cache_dir().map(|d| d.join(format!("{clean}-{arch}-{key:016x}.ptx")))
}

/// Whether NVRTC can be loaded on this machine.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen libnvrtc by its usual names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// PTX for `source`, from the disk cache or freshly compiled (and then stored).
pub(crate) fn compile_cached(name: &str, source: &str, arch: &str, key: u64) -> Result<String> {
    let file = cache_file(name, arch, key);
    if let Some(ptx) = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
        return Ok(ptx);
    }
    let ptx = compile(name, source, arch)?;
    if let Some(f) = file {
        // A cache that cannot be written only costs a recompile next time.
        if let Some(dir) = f.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = f.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &ptx).is_ok() {
            let _ = std::fs::rename(&tmp, &f);
        }
    }
    Ok(ptx)
}

/// Compiles CUDA C++ to PTX for `arch` (`sm_XY`) with NVRTC.
pub fn compile(name: &str, source: &str, arch: &str) -> Result<String> {
    if !nvrtc_present() {
        return Err(Error::Compile {
            module: name.to_string(),
            log: "libnvrtc could not be loaded; install the CUDA toolkit's NVRTC library".into(),
        });
    }
    let virtual_arch = arch.replacen("sm_", "compute_", 1);
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![
            format!("--gpu-architecture={virtual_arch}"),
            "--std=c++17".to_string(),
        ],
        name: Some(format!("{name}.cu")),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| Error::Compile {
        module: name.to_string(),
        log: e.to_string(),
    })?;
    Ok(ptx.to_src())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_depends_on_source_and_arch() {
        let a = cache_key("__global__ void k(){}", "sm_90");
        assert_eq!(a, cache_key("__global__ void k(){}", "sm_90"));
        assert_ne!(a, cache_key("__global__ void k(){ }", "sm_90"));
        assert_ne!(a, cache_key("__global__ void k(){}", "sm_80"));
    }

    #[test]
    fn cache_file_names_are_sanitised() {
        std::env::set_var(env::CACHE_DIR, "/tmp/cg-test-cache");
        let f = cache_file("my kernels/v1", "sm_90", 0xabc).unwrap();
        assert_eq!(
            f,
            PathBuf::from("/tmp/cg-test-cache/my_kernels_v1-sm_90-0000000000000abc.ptx")
        );
    }
}
