//! Programmatic dependent launch (PDL, sm_90+) for the NN kernels: a kernel may begin while
//! the previous kernel on the stream drains, and inside a graph the dependency becomes a
//! programmatic edge — the launch gap between dependent kernels shrinks.
//!
//! The NN kernels are launched with PDL only in a second compilation of the same source in
//! which every kernel begins with `CG_PDL_ENTER()` (inserted here, by
//! `with_pdl_prologue`): it lets the next kernel launch, then waits until the previous
//! kernel has finished and its memory is visible, before the kernel touches any memory. So
//! each kernel computes exactly what it computes without PDL (results are bit-identical), and
//! no buffer is used before the work that freed or wrote it is done. Kernels of this crate's
//! other modules (random numbers, device-side steps, the decoder's kernels, the few-row
//! products) carry the prologue in their source.
//!
//! Switch: `CUDAGRAPH_PDL=1` launches every NN kernel with PDL, `CUDAGRAPH_PDL=0` none; unset,
//! only the decoder's kernels, the few-row products and a generation step's sampling and
//! bookkeeping launch with PDL, and only inside a capture (where a decode step measured 3–10 %
//! faster with it; eager launches are slower with PDL, and some NN models measured slower in
//! graphs). [`set_pdl`] overrides the variable in-process; devices before sm_90 always launch
//! plainly.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use cudagraph::{Arg, Device, Function, LaunchConfig, LaunchOptions, Queue};

use crate::error::Result;

static MODE: AtomicU8 = AtomicU8::new(0);

/// Overrides `CUDAGRAPH_PDL` for this process: `Some(on)` forces PDL on for every NN kernel
/// or off for all of them, `None` goes back to the variable.
pub fn set_pdl(on: Option<bool>) {
    MODE.store(
        match on {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        },
        Ordering::Relaxed,
    );
}

/// `CUDAGRAPH_PDL` (read once): `Some(on)` when set to a switch as
/// [`crate::env::parse_switch`] spells it, `None` when unset or empty (the default: PDL for
/// the decode kernels in graphs); a value that is not a switch turns PDL off with a one-line
/// notice.
fn env_pdl() -> Option<bool> {
    static E: OnceLock<Option<bool>> = OnceLock::new();
    *E.get_or_init(|| {
        let v = crate::env::var(crate::env::PDL_VAR)?;
        if v.trim().is_empty() {
            return None;
        }
        let meaning = "1 (every NN kernel with PDL), 0 (none) or unset (decode kernels in graphs)";
        Some(
            crate::env::parse_switch(crate::env::PDL_VAR, &v, false, meaning).unwrap_or_else(|e| {
                eprintln!("cudagraph: {e}; PDL stays off");
                false
            }),
        )
    })
}

/// The setting now: `Some(on)` forced (in process or by the variable), `None` the default.
fn setting() -> Option<bool> {
    match MODE.load(Ordering::Relaxed) {
        1 => Some(false),
        2 => Some(true),
        _ => env_pdl(),
    }
}

/// Whether every NN kernel on `device` is launched with PDL now (`CUDAGRAPH_PDL=1` or
/// [`set_pdl`]`(Some(true))`, on an sm_90+ device).
pub fn pdl_enabled(device: &Device) -> bool {
    setting() == Some(true) && device.supports_pdl()
}

/// Whether the decoder's kernels and the few-row products launch with PDL on `q` now: unless
/// PDL is forced off, inside a capture (and always when forced on), on sm_90+ devices.
fn decode_pdl(q: &dyn Queue) -> bool {
    let on = setting().unwrap_or_else(|| q.is_capturing());
    on && q.device().supports_pdl()
}

/// Launches a decode-path kernel (`decoder.cu`, `gemv.cu`, and a generation step's sampling and
/// bookkeeping in `sampling.cu`: every kernel lets the next one launch, then waits for the
/// previous kernel before touching memory — `CG_PDL_ENTER()` —
/// except `gemv.cu`'s with `early` set, which first loads weights, and the attention of
/// `decoder.cu` with `early` set, which first reads positions, slots, rotary frequencies and
/// cache rows), with PDL where [`decode_pdl`] says.
///
/// # Safety
/// The caller checked every buffer against the extent the kernel indexes with the scalars
/// given (see the kernel's comment in its `.cu` file), and where the kernel reads memory
/// before its wait (`early`), no work that can still run writes that memory.
pub(crate) unsafe fn launch_decode(
    q: &dyn Queue,
    f: &Function,
    cfg: LaunchConfig,
    args: &[Arg<'_>],
) -> Result<()> {
    // SAFETY: the caller's promise, passed on unchanged.
    launch_decode_in(q, f, cfg, None, args)
}

/// [`launch_decode`], as thread-block clusters of `cluster` blocks when given (the launch
/// refuses clusters a device cannot run).
///
/// # Safety
/// That of [`launch_decode`].
pub(crate) unsafe fn launch_decode_in(
    q: &dyn Queue,
    f: &Function,
    cfg: LaunchConfig,
    cluster: Option<(u32, u32, u32)>,
    args: &[Arg<'_>],
) -> Result<()> {
    let mut opts = LaunchOptions::new().pdl(decode_pdl(q));
    if let Some(c) = cluster {
        opts = opts.cluster(c);
    }
    // SAFETY: the caller's promise; the kernel waits for the previous kernel before any memory
    // access other than reads of memory nothing still running writes (the caller's promise).
    Ok(q.launch_with(f, cfg, args, opts)?)
}

/// The launch options for this crate's kernels that carry the PDL prologue in their source.
pub(crate) fn options(device: &Device) -> LaunchOptions {
    LaunchOptions::new().pdl(pdl_enabled(device))
}

/// `source` with `CG_PDL_ENTER();` as the first statement of every
/// `extern "C" __global__ void name(...) {` kernel (also with `__launch_bounds__(...)` before
/// the name), and the names of those kernels. A kernel written any other way is left alone
/// and not listed (it is then never launched with PDL).
pub(crate) fn with_pdl_prologue(source: &str) -> (String, Vec<String>) {
    const HEAD: &str = "extern \"C\" __global__ void ";
    let mut out = String::with_capacity(source.len() + 1024);
    let mut names = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find(HEAD) {
        let after = at + HEAD.len();
        out.push_str(&rest[..after]);
        rest = &rest[after..];
        // Launch bounds (integer arguments, no parentheses inside) pass through as they are.
        const BOUNDS: &str = "__launch_bounds__(";
        if rest.starts_with(BOUNDS) {
            let Some(end) = rest.find(')') else { continue };
            out.push_str(&rest[..=end]);
            rest = &rest[end + 1..];
        }
        let Some(open) = rest.find('(') else { continue };
        let name = rest[..open].trim();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        // The parameter list, then the body's opening brace.
        let mut depth = 0usize;
        let mut close = None;
        for (i, ch) in rest[open..].char_indices() {
            match ch {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        close = Some(open + i);
                        break;
                    }
                }
                _ => {}
            }
        }
        let Some(close) = close else { continue };
        let tail = &rest[close + 1..];
        let brace = tail.len() - tail.trim_start().len();
        if !tail[brace..].starts_with('{') {
            continue;
        }
        let body = close + 1 + brace + 1;
        out.push_str(&rest[..body]);
        out.push_str(" CG_PDL_ENTER();");
        rest = &rest[body..];
        names.push(name.to_string());
    }
    out.push_str(rest);
    (out, names)
}

/// The PDL compilation of the NN module: its kernels by name.
struct Twins(HashMap<String, Function>);

fn twins(device: &Device) -> Result<std::sync::Arc<Twins>> {
    Ok(device.extension(|d| {
        let (_, names) = with_pdl_prologue(super::SOURCE);
        let src = super::module_source("cudagraph_nn_pdl");
        // Relaxed capture mode: the first use may be inside a capture (module loading).
        let m = cudagraph::runtime::with_relaxed_capture(|| d.compile("cudagraph_nn_pdl", &src))?;
        let mut fns = HashMap::new();
        for n in names {
            let f = m.function(&n)?;
            fns.insert(n, f);
        }
        Ok(Twins(fns))
    })?)
}

/// Launches a kernel whose source begins with `CG_PDL_ENTER()` (the kernels of `philox.cu` and
/// `steps.cu`): with PDL when it is on for the device ([`options`]).
///
/// # Safety
/// The caller checked every buffer against the extent the kernel indexes with the scalars
/// given (see the kernel's comment in its `.cu` file).
pub(crate) unsafe fn launch_entered(
    q: &dyn Queue,
    f: &Function,
    cfg: LaunchConfig,
    args: &[Arg<'_>],
) -> Result<()> {
    // SAFETY: the caller's promise; the kernel begins with CG_PDL_ENTER(), which waits for the
    // previous kernel before any memory access.
    Ok(q.launch_with(f, cfg, args, options(q.device()))?)
}

/// Launches one of the NN module's kernels: with PDL through its twin when PDL is on and the
/// twin exists, else plainly.
///
/// # Safety
/// The contract of [`Queue::launch`] for `f` with these arguments (the twin runs the same
/// code after its prologue, which satisfies [`Queue::launch_with`]'s wait requirement).
pub(crate) unsafe fn launch_nn(
    q: &dyn Queue,
    f: &Function,
    cfg: LaunchConfig,
    args: &[Arg<'_>],
) -> Result<()> {
    if pdl_enabled(q.device()) {
        let t = twins(q.device())?;
        if let Some(twin) = t.0.get(f.name()) {
            // SAFETY: `twin` is `f`'s code behind CG_PDL_ENTER(), which waits for the previous
            // kernel before any memory access; the memory contract is the caller's.
            return Ok(q.launch_with(twin, cfg, args, LaunchOptions::new().pdl(true))?);
        }
    }
    // SAFETY: the caller's contract.
    Ok(q.launch(f, cfg, args)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_nn_kernel_gets_the_prologue_first() {
        let (src, names) = with_pdl_prologue(super::super::SOURCE);
        let kernels = super::super::SOURCE
            .matches("extern \"C\" __global__ void ")
            .count();
        assert!(kernels >= 14);
        assert_eq!(names.len(), kernels, "every kernel was rewritten");
        assert_eq!(src.matches("CG_PDL_ENTER();").count(), kernels);
        for n in [
            "sgemm_tiled",
            "splitk_reduce",
            "bias_act",
            "relu_fwd",
            "maxpool_bwd",
            "sgemm_reg",
            "sgemm_reg4",
        ] {
            assert!(names.iter().any(|x| x == n), "{n}");
        }
        // A kernel with launch bounds keeps them and gets the prologue.
        let (bounded, bounded_names) = with_pdl_prologue(
            "extern \"C\" __global__ void __launch_bounds__(512, 1) k(int a) { a++; }",
        );
        assert_eq!(bounded_names, ["k"]);
        assert_eq!(
            bounded,
            "extern \"C\" __global__ void __launch_bounds__(512, 1) k(int a) { CG_PDL_ENTER(); a++; }"
        );
        // The prologue is the first statement of the body.
        let i = src.find("void relu_fwd(").unwrap();
        let body = &src[i..];
        let brace = body.find('{').unwrap();
        assert!(body[brace + 1..]
            .trim_start()
            .starts_with("CG_PDL_ENTER();"));
    }

    #[test]
    fn prologue_insertion_handles_odd_layouts_and_skips_non_kernels() {
        let src = "extern \"C\" __global__ void a(int* x,\n  int n)\n{\n x[0] = n; }\n\
                   extern \"C\" __global__ void proto(int* x);\n\
                   __device__ int f(int v) { return v; }\n\
                   extern \"C\" __global__ void b() { }\n";
        let (out, names) = with_pdl_prologue(src);
        assert_eq!(names, vec!["a".to_string(), "b".to_string()]);
        assert!(out.contains("int n)\n{ CG_PDL_ENTER();\n x[0] = n; }"));
        assert!(out.contains("void proto(int* x);"));
        assert!(out.contains("void b() { CG_PDL_ENTER(); }"));
        assert!(out.contains("__device__ int f(int v) { return v; }"));
    }

    #[test]
    fn mode_override_round_trips() {
        set_pdl(Some(false));
        assert_eq!(MODE.load(Ordering::Relaxed), 1);
        set_pdl(Some(true));
        assert_eq!(MODE.load(Ordering::Relaxed), 2);
        set_pdl(None);
        assert_eq!(MODE.load(Ordering::Relaxed), 0);
    }
}
