//! The NN layer's own CUDA kernels (`*.cu` beside this file, compiled together with NVRTC once
//! per device and cached on disk by the core), and [`Nn`], the per-device context that holds
//! them. Library handles (cuBLAS and the others) are not here: their one owner is
//! [`crate::ffi::libraries::Libraries`].
//!
//! Every kernel is launched from one safe function of this room, after every buffer it indexes
//! was checked against the extent the kernel will touch, computed from the same integers that
//! go to the kernel (checked arithmetic; dimensions must fit the kernel's integer types). That
//! is the only place this crate makes the promise of [`Queue::launch`]'s `# Safety` section.
//! The launchers of the main module's kernels are methods of [`Nn`], by family: products
//! ([`gemm`]), elementwise and reductions ([`elementwise`]), direct convolution and pooling
//! ([`conv`]); the other modules have their own per-device holders (implicit-GEMM convolution
//! [`igemm`], losses, fused optimizers, loss scaling and clipping ([`amp`]), the generator's
//! kernels, training steps, PDL twins).

use std::sync::Arc;

use cudagraph::{Arg, Device, DeviceBuffer, Function, LaunchConfig, Queue};

use crate::error::{NnError, Result};
pub use crate::extent::GemmDims;
pub(crate) use crate::extent::{need, prod, ConvGeom};
use crate::ffi::libraries::Libraries;

pub mod amp;
pub mod attention;
pub mod cast;
pub mod causal;
pub mod conv;
pub mod conv_lowp;
pub mod decoder;
pub mod elementwise;
pub mod gemm;
pub mod gemv;
pub mod igemm;
pub mod losses;
pub mod lowp;
pub mod optim_mt;
pub mod pdl;
pub mod philox;
pub mod sampling;
pub mod steps;
pub mod transformer;

pub use gemm::{rows_groups, rows_most_splits, rows_ok, ClusterKernels, ColsShape, ROWS_PER_BLOCK};
// What only the tests use.
#[cfg(any(test, feature = "internals"))]
pub use elementwise::channel_sum_plan;
#[cfg(any(test, feature = "internals"))]
pub use gemm::{reg_vec_ok, rows_grid, rows_warps, COLS_COLS, COLS_ROWS, COLS_WARPS};

/// The CUDA source of every NN kernel (one NVRTC module).
pub const SOURCE: &str = concat!(
    include_str!("common.cu"),
    include_str!("gemm_tile.cu"),
    include_str!("gemm.cu"),
    include_str!("elementwise.cu"),
    include_str!("reduce.cu"),
    include_str!("conv.cu"),
    include_str!("pool.cu"),
);

/// Every NVRTC module this crate compiles: its name and its CUDA source exactly as compiled.
/// The loaders take their source from here, and `tests/kernels_compile.rs` compiles them all
/// (where NVRTC is installed) so a kernel that does not compile fails a test, not a user. The
/// decoder's attention is compiled per head dimension and element type
/// ([`decoder::attend_source`]); the modules of 64 and 128, the common head dimensions, in bf16
/// and f32 stand for the others here.
pub fn module_sources() -> Vec<(&'static str, String)> {
    let check = cudagraph::DEVICE_CHECK_CUDA;
    let pdl = cudagraph::PDL_CUDA;
    vec![
        ("cudagraph_nn", format!("{check}{SOURCE}")),
        (
            "cudagraph_nn_loss",
            format!(
                "{check}{}{}",
                include_str!("common.cu"),
                include_str!("loss_fused.cu")
            ),
        ),
        (
            "cudagraph_nn_cluster",
            format!(
                "{pdl}{check}{}{}{}{}",
                include_str!("common.cu"),
                include_str!("gemm_tile.cu"),
                include_str!("cluster.cu"),
                include_str!("gemm_cluster.cu")
            ),
        ),
        ("cudagraph_nn_optim", optim_mt::module_source()),
        ("cudagraph_nn_amp", amp::module_source()),
        ("cudagraph_nn_igemm", igemm::SOURCE.to_string()),
        ("cudagraph_nn_spin", igemm::SPIN_SOURCE.to_string()),
        ("cudagraph_nn_rng", format!("{pdl}{}", philox::SOURCE)),
        ("cudagraph_nn_steps", format!("{pdl}{}", steps::SOURCE)),
        (
            "cudagraph_nn_sampling",
            format!("{pdl}{check}{}{}", philox::DRAW, sampling::SOURCE),
        ),
        ("cudagraph_nn_cast", cast::SOURCE.to_string()),
        ("cudagraph_nn_lowp", lowp::source()),
        ("cudagraph_nn_attention", attention::source()),
        ("cudagraph_nn_conv_lowp", conv_lowp::source()),
        ("cudagraph_nn_transformer", transformer::source()),
        ("cudagraph_nn_causal", causal::source()),
        ("cudagraph_nn_decoder", decoder::source()),
        (
            "cudagraph_nn_decoder_attend_d64_bf16",
            decoder::attend_source(64, crate::dtype::Dtype::Bf16).1,
        ),
        (
            "cudagraph_nn_decoder_attend_d128_bf16",
            decoder::attend_source(128, crate::dtype::Dtype::Bf16).1,
        ),
        (
            "cudagraph_nn_decoder_attend_d64_f32",
            decoder::attend_source(64, crate::dtype::Dtype::F32).1,
        ),
        ("cudagraph_nn_gemv", gemv::source()),
        (
            "cudagraph_nn_pdl",
            format!("{pdl}{check}{}", pdl::with_pdl_prologue(SOURCE).0),
        ),
    ]
}

/// The source of module `name` (see [`module_sources`]); empty for an unknown name, which
/// then fails to load with a clear missing-kernel error.
pub(crate) fn module_source(name: &str) -> String {
    module_sources()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, s)| s)
        .unwrap_or_default()
}

macro_rules! kernels {
    ($($name:ident),* $(,)?) => {
        /// The NN kernels of one device, with their launchers (split by family: [`gemm`],
        /// [`elementwise`], [`conv`]).
        pub struct Kernels { $(pub(crate) $name: Function,)* }
        impl Kernels {
            fn load(device: &Device) -> Result<Self> {
                let m = device.compile("cudagraph_nn", &module_source("cudagraph_nn"))?;
                Ok(Self { $($name: m.function(stringify!($name))?,)* })
            }
        }
    };
}

kernels!(
    sgemm_tiled,
    sgemm_reg,
    sgemm_reg4,
    splitk_reduce,
    sgemm_nt_warpk,
    sgemm_nt_rows,
    sgemm_nt_rows8,
    sgemm_nt_rows4,
    sgemm_nt_cols_r1c1,
    sgemm_nt_cols_r1c2,
    sgemm_nt_cols_r2c1,
    sgemm_nt_cols_r2c2,
    sgemm_nt_cols_r4c1,
    sgemm_nt_cols_r4c2,
    sgemm_nt_cols_r8c1,
    sgemm_nt_cols_r8c2,
    sgemm_nt_cols_r16c1,
    sgemm_nt_cols_r16c2,
    bias_act,
    relu_fwd,
    relu_bwd,
    add_inplace,
    bias_planes,
    col_sum,
    channel_sum,
    sum_parts,
    conv2d_fwd,
    conv2d_fwd_small,
    conv2d_fwd_small_k1,
    conv2d_fwd_small_k3,
    conv2d_fwd_small_k5,
    conv2d_bwd_input,
    conv2d_bwd_weight,
    maxpool_fwd,
    maxpool_bwd,
);

/// Per-device NN context: the kernels of the main module. Lives as long as the device (a
/// [`Device::extension`]).
pub struct Nn {
    pub(crate) k: Kernels,
}

/// The crate's own tests call the launchers on `Nn` directly; for everyone else `Nn` is only a
/// handle to pass to the public operations.
#[cfg(feature = "internals")]
impl std::ops::Deref for Nn {
    type Target = Kernels;
    fn deref(&self) -> &Kernels {
        &self.k
    }
}

impl Nn {
    /// The context of `device`, created on first use. The device's cuBLAS handle
    /// (`Libraries::blas`) is made with it: a device without cuBLAS fails here, at first use
    /// of the NN layer.
    pub fn get(device: &Device) -> Result<Arc<Nn>> {
        device
            .extension(|d| {
                let k = Kernels::load(d).map_err(cudagraph::Error::from)?;
                Libraries::get(d)
                    .and_then(|l| l.blas().map(|_| ()))
                    .map_err(cudagraph::Error::from)?;
                Ok(Nn { k })
            })
            .map_err(NnError::from)
    }
}

type Buf = DeviceBuffer<f32>;

/// `v` as a kernel `int`.
pub(crate) fn int(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| NnError::Shape(format!("{what} = {v} exceeds a 32-bit int")))
}

/// `n` elements as a kernel `long long` count, `what` naming them in the error.
pub(crate) fn count(what: &str, n: usize) -> Result<Arg<'static>> {
    Ok(Arg::I64(i64::try_from(n).map_err(|_| {
        NnError::Shape(format!("{what}: {n} elements exceed i64"))
    })?))
}

/// Threads per block of a grid-stride launch ([`grid_stride`]).
pub(crate) const STRIDE_BLOCK: u32 = 256;
/// Most blocks of a grid-stride launch; the kernel's loop strides over the rest.
pub(crate) const STRIDE_MAX_BLOCKS: usize = 65_536;

/// A launch of [`STRIDE_BLOCK`] threads a block over `n` items for a kernel that strides over
/// the grid: one thread per item up to [`STRIDE_MAX_BLOCKS`] blocks, at least one block.
pub(crate) fn grid_stride(n: usize) -> LaunchConfig {
    let blocks = n
        .div_ceil(STRIDE_BLOCK as usize)
        .clamp(1, STRIDE_MAX_BLOCKS);
    LaunchConfig::linear(blocks as u32, STRIDE_BLOCK)
}

/// One kernel per element type, loaded by name plus its type suffix (`_f32`, `_bf16`,
/// `_f16`); modules of 16-bit kernels only have no f32 one.
pub(crate) struct ByType {
    f32: Option<Function>,
    bf16: Function,
    f16: Function,
}

impl ByType {
    /// `name_f32`, `name_bf16` and `name_f16` of `m`.
    pub(crate) fn load(m: &cudagraph::Module, name: &str) -> Result<Self> {
        let mut k = Self::load_half(m, name)?;
        k.f32 = Some(m.function(&format!("{name}_f32"))?);
        Ok(k)
    }

    /// `name_bf16` and `name_f16` of `m` (no f32 kernel).
    pub(crate) fn load_half(m: &cudagraph::Module, name: &str) -> Result<Self> {
        Ok(ByType {
            f32: None,
            bf16: m.function(&format!("{name}_bf16"))?,
            f16: m.function(&format!("{name}_f16"))?,
        })
    }

    /// The kernel for `T`; `NnError::Dtype` naming `what` when there is none for f32.
    pub(crate) fn of<T: crate::dtype::Float>(&self, what: &'static str) -> Result<&Function> {
        match T::DTYPE {
            crate::dtype::Dtype::Bf16 => Ok(&self.bf16),
            crate::dtype::Dtype::F16 => Ok(&self.f16),
            crate::dtype::Dtype::F32 => self.f32.as_ref().ok_or(NnError::Dtype {
                what,
                expected: "bf16 or f16",
                found: "f32",
            }),
        }
    }
}

/// `v` as the bound of a kernel loop `for (int i = start; i < v; i += step)` with
/// `start < step`: the index passes `v` by less than `step`, which must stay below `i32::MAX`.
pub(crate) fn int_loop(what: &'static str, v: usize, step: usize) -> Result<i32> {
    if v.saturating_add(step) > i32::MAX as usize {
        return Err(NnError::Shape(format!(
            "{what} = {v} exceeds {} (a 32-bit loop index)",
            i32::MAX as usize - step
        )));
    }
    Ok(v as i32)
}

/// `v` as a kernel `long`.
fn long(v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| NnError::Shape(format!("count {v} exceeds a 64-bit int")))
}

fn elems(n: usize) -> LaunchConfig {
    LaunchConfig::for_elements(n, 256)
}

/// Launches one of this module's kernels.
///
/// # Safety
/// The caller checked every buffer in `args` against the extent the kernel indexes with the
/// scalar arguments given (see each kernel's comment in its `.cu` file).
unsafe fn launch(q: &dyn Queue, f: &Function, cfg: LaunchConfig, args: &[Arg<'_>]) -> Result<()> {
    // SAFETY: the caller's promise; `launch_nn` adds PDL only through the kernel's twin that
    // waits for the previous kernel first.
    pdl::launch_nn(q, f, cfg, args)
}

#[cfg(test)]
mod loop_bound_tests {
    use super::int_loop;

    #[test]
    fn loop_bounds_leave_room_for_the_last_step() {
        assert_eq!(int_loop("rows", 0, 256).unwrap(), 0);
        assert_eq!(int_loop("rows", 1000, 256).unwrap(), 1000);
        let top = i32::MAX as usize - 256;
        assert_eq!(int_loop("rows", top, 256).unwrap(), top as i32);
        let e = int_loop("rows", top + 1, 256).unwrap_err().to_string();
        assert!(e.contains("rows") && e.contains("32-bit loop index"), "{e}");
        assert!(int_loop("rows", usize::MAX, 256).is_err());
    }
}
