//! The user's view of a GPU: a [`Device`] (context, caching allocator, device-side error flag),
//! eager [`Stream`]s, and the [`Queue`] trait that eager streams and capture streams share, so
//! the same model code runs eagerly or inside a capture.
//!
//! Threads: `Device`, `Stream`, `DeviceBuffer`, `PinnedBuffer` and `Graph` are `Send + Sync`.
//! CUDA streams accept work from any thread, every driver call binds the device's context
//! first, the allocator is behind a mutex, and graphs serialise their own driver calls.
//! `CaptureStream` is neither (a capture belongs to the thread that runs its closure).
//!
//! Files by job: `gpu.rs` ([`Device`]), `stream.rs` ([`Stream`]), `queue.rs` ([`Queue`],
//! [`QueueExt`], [`Arg`], launches), `checks.rs` (device-side check records), `copy.rs` +
//! `copy.cu` (copies as a kernel), `pinned_scope.rs` ([`PinnedScope`]).

mod checks;
mod copy;
mod gpu;
mod pinned_scope;
mod queue;
mod stream;

pub(crate) use checks::CheckRecord;
pub use checks::{register_check, DEVICE_CHECK_CUDA};
pub(crate) use copy::prepare as prepare_copy_kernels;
pub use copy::{
    kernel_copy_fits, mapped_copy_fits, COPY_CUDA, COPY_KERNEL_VAR, MAX_KERNEL_COPY,
    MAX_MAPPED_COPY,
};
pub use gpu::Device;
pub use pinned_scope::PinnedScope;
pub(crate) use queue::copy_mapped;
pub(crate) use queue::sealed::Sealed;
pub(crate) use queue::{check_device, check_eager, check_range};
pub use queue::{Anchor, Arg, EndWork, LaunchOptions, Queue, QueueExt, PDL_CUDA};
pub use stream::Stream;
