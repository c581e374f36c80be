//! Conditional graph nodes (CUDA 12.4+): [`CaptureStream::if_then`],
//! [`CaptureStream::while_loop`] and [`CaptureStream::repeat`] add an IF or WHILE node to the
//! graph being captured and record the body into the node's body graph, so a graph branches
//! or loops on the device without returning to the host.
//!
//! How (the pattern CuPy and PyTorch use): the capturing graph and its current dependencies
//! come from `cuStreamGetCaptureInfo`; a conditional handle is created on that graph; a
//! one-thread kernel copies the condition (a `u32` in device memory that any kernel may
//! write) into the handle; the node is added with `cuGraphAddNode` after those dependencies
//! and becomes the stream's only dependency (`cuStreamUpdateCaptureDependencies`); the body
//! is captured on a second stream with `cuStreamBeginCaptureToGraph`. A WHILE body ends with
//! the same copy, so the loop re-tests the condition after each iteration.
//!
//! The copy kernels are hand-written PTX that calls the device runtime's
//! `cudaGraphSetConditional` as an `.extern .func`, loaded with `cuModuleLoadData`: the
//! driver's JIT resolves that call itself (XLA's command buffers load their condition kernels
//! the same way, as PTX in memory), so neither NVRTC nor a `cudadevrt` link step is involved.
//!
//! What a body may hold is the driver's rule: kernels, memsets, device-to-device copies,
//! child graphs and nested conditionals — no host functions or events (instantiation fails
//! with the driver's error otherwise).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::capture::{BodyScope, CaptureStream};
use super::keep::Keep;
use crate::device::{check_device, Arg, Device, Queue, QueueExt, Stream};
use crate::error::{Error, Result};
use crate::memory::DeviceBuffer;
use crate::runtime::graph::{self as raw, CondRecord, ConditionalKind};
use crate::runtime::{Function, LaunchConfig, Module, StreamHandle};

/// The condition kernels, hand-written PTX (see the module docs). `cg_cond_set(handle, cond)`
/// sets the handle to `*cond != 0`; `cg_loop_begin(handle, cond, counter, limit)` zeroes the
/// counter and sets `0 < limit && (cond == null || *cond != 0)`; `cg_loop_next` increments the
/// counter and sets `counter < limit && (cond == null || *cond != 0)`.
const CONDITION_PTX: &str = r#"
.version 7.0
.target sm_50
.address_size 64

.extern .func cudaGraphSetConditional
(
	.param .b64 cudaGraphSetConditional_param_0,
	.param .b32 cudaGraphSetConditional_param_1
)
;

.visible .entry cg_cond_set(
	.param .u64 cg_cond_set_param_0,
	.param .u64 cg_cond_set_param_1
)
{
	.reg .pred 	%p<2>;
	.reg .b32 	%r<3>;
	.reg .b64 	%rd<4>;

	ld.param.u64 	%rd1, [cg_cond_set_param_0];
	ld.param.u64 	%rd2, [cg_cond_set_param_1];
	cvta.to.global.u64 	%rd3, %rd2;
	ld.global.u32 	%r1, [%rd3];
	setp.ne.s32 	%p1, %r1, 0;
	selp.u32 	%r2, 1, 0, %p1;
	{
	.param .b64 param0;
	st.param.b64 	[param0+0], %rd1;
	.param .b32 param1;
	st.param.b32 	[param1+0], %r2;
	call.uni cudaGraphSetConditional, (param0, param1);
	}
	ret;
}

.visible .entry cg_loop_begin(
	.param .u64 cg_loop_begin_param_0,
	.param .u64 cg_loop_begin_param_1,
	.param .u64 cg_loop_begin_param_2,
	.param .u32 cg_loop_begin_param_3
)
{
	.reg .pred 	%p<3>;
	.reg .b32 	%r<5>;
	.reg .b64 	%rd<6>;

	ld.param.u64 	%rd1, [cg_loop_begin_param_0];
	ld.param.u64 	%rd2, [cg_loop_begin_param_1];
	ld.param.u64 	%rd3, [cg_loop_begin_param_2];
	ld.param.u32 	%r1, [cg_loop_begin_param_3];
	cvta.to.global.u64 	%rd4, %rd3;
	mov.u32 	%r2, 0;
	st.global.u32 	[%rd4], %r2;
	setp.ne.s32 	%p1, %r1, 0;
	setp.eq.s64 	%p2, %rd2, 0;
	@%p2 bra 	$L_begin_set;
	cvta.to.global.u64 	%rd5, %rd2;
	ld.global.u32 	%r3, [%rd5];
	setp.ne.and.s32 	%p1, %r3, 0, %p1;
$L_begin_set:
	selp.u32 	%r4, 1, 0, %p1;
	{
	.param .b64 param0;
	st.param.b64 	[param0+0], %rd1;
	.param .b32 param1;
	st.param.b32 	[param1+0], %r4;
	call.uni cudaGraphSetConditional, (param0, param1);
	}
	ret;
}

.visible .entry cg_loop_next(
	.param .u64 cg_loop_next_param_0,
	.param .u64 cg_loop_next_param_1,
	.param .u64 cg_loop_next_param_2,
	.param .u32 cg_loop_next_param_3
)
{
	.reg .pred 	%p<3>;
	.reg .b32 	%r<5>;
	.reg .b64 	%rd<6>;

	ld.param.u64 	%rd1, [cg_loop_next_param_0];
	ld.param.u64 	%rd2, [cg_loop_next_param_1];
	ld.param.u64 	%rd3, [cg_loop_next_param_2];
	ld.param.u32 	%r1, [cg_loop_next_param_3];
	cvta.to.global.u64 	%rd4, %rd3;
	ld.global.u32 	%r2, [%rd4];
	add.s32 	%r2, %r2, 1;
	st.global.u32 	[%rd4], %r2;
	setp.lt.u32 	%p1, %r2, %r1;
	setp.eq.s64 	%p2, %rd2, 0;
	@%p2 bra 	$L_next_set;
	cvta.to.global.u64 	%rd5, %rd2;
	ld.global.u32 	%r3, [%rd5];
	setp.ne.and.s32 	%p1, %r3, 0, %p1;
$L_next_set:
	selp.u32 	%r4, 1, 0, %p1;
	{
	.param .b64 param0;
	st.param.b64 	[param0+0], %rd1;
	.param .b32 param1;
	st.param.b32 	[param1+0], %r4;
	call.uni cudaGraphSetConditional, (param0, param1);
	}
	ret;
}
"#;

/// The condition kernels of one device.
struct ConditionKernels {
    set: Function,
    loop_begin: Function,
    loop_next: Function,
}

impl ConditionKernels {
    fn get(device: &Device) -> Result<Arc<Self>> {
        device.extension(|d| {
            let not_supported = |e: Error| Error::NotSupported {
                what: "conditional graph nodes",
                detail: format!(
                    "the driver could not load the kernel that sets a condition (it calls cudaGraphSetConditional, CUDA 12.4+): {e}"
                ),
            };
            // Relaxed capture mode: the first conditional may be added inside a capture.
            let m = crate::runtime::with_relaxed_capture(|| {
                Module::load_ptx(d.context(), "cudagraph_conditions", CONDITION_PTX)
            })
            .map_err(not_supported)?;
            Ok(ConditionKernels {
                set: m.function("cg_cond_set")?,
                loop_begin: m.function("cg_loop_begin")?,
                loop_next: m.function("cg_loop_next")?,
            })
        })
    }
}

/// The streams conditional bodies are captured on, one per (stream a capture began on,
/// nesting depth): bodies of graphs captured on the same stream share them, so per-stream
/// library state (cuBLAS workspaces) is not created anew for every conditional.
#[derive(Default)]
struct BodyStreams(Mutex<HashMap<(u64, usize), StreamHandle>>);

fn body_stream(device: &Device, root: u64, depth: usize) -> Result<Stream> {
    let streams = device.extension(|_| Ok(BodyStreams::default()))?;
    let mut map = streams.0.lock().unwrap_or_else(|p| p.into_inner());
    let handle = match map.get(&(root, depth)) {
        Some(h) => h.clone(),
        None => {
            let h = StreamHandle::new(device.context())?;
            map.insert((root, depth), h.clone());
            h
        }
    };
    Ok(Stream::from_handle(device.clone(), handle))
}

/// The lowest driver version with IF and WHILE nodes whose bodies can be stream-captured.
const MIN_DRIVER: i32 = 12040;

/// `Ok` when this device's driver can build conditional nodes, else
/// [`Error::NotSupported`] naming the version needed.
pub(crate) fn require_support(device: &Device) -> Result<()> {
    let v = device.info().driver_version;
    if v < MIN_DRIVER || !raw::conditional_nodes_available() {
        return Err(Error::NotSupported {
            what: "conditional graph nodes (IF / WHILE)",
            detail: format!(
                "they need a driver for CUDA 12.4 or later; this driver supports CUDA {}",
                device.info().cuda_version_string()
            ),
        });
    }
    Ok(())
}

/// Ends a body capture that is still open (error or panic in the body closure).
struct OpenBody<'a> {
    stream: &'a Stream,
    open: bool,
}

impl OpenBody<'_> {
    fn end(&mut self) -> Result<()> {
        self.open = false;
        let ended = raw::end_capture_to_graph(self.stream.handle.raw());
        self.stream.handle.mark_body_capture(false);
        ended
    }
}

impl Drop for OpenBody<'_> {
    fn drop(&mut self) {
        if self.open {
            let _ = self.end();
        }
    }
}

impl CaptureStream<'_> {
    /// Adds an IF node: on every replay, `body` runs if `cond[0] != 0` at this point of the
    /// graph (the value written by earlier work in the graph, or before the replay).
    /// Returns what `body` returned; buffers it allocated have undefined contents on replays
    /// where the body was skipped.
    ///
    /// Needs a CUDA 12.4+ driver ([`Error::NotSupported`] otherwise). The body may hold
    /// kernels, copies, memsets and nested conditionals (not host functions or events).
    ///
    /// ```no_run
    /// # use cudagraph::*;
    /// # fn main() -> Result<()> {
    /// # let dev = Device::open(0)?;
    /// # let mut stream = dev.new_stream()?;
    /// # let k = dev.compile("k", "extern \"C\" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }")?.function("twice")?;
    /// let x = stream.alloc_from_host(&[1.0f32; 32])?;
    /// let flag = stream.alloc_from_host(&[1u32])?;
    /// let (graph, ()) = Graph::capture(&mut stream, CaptureOptions::new(), |cs| {
    ///     cs.if_then(&flag, |body| {
    ///         // SAFETY: `twice` touches x[threadIdx.x] for 32 threads; x holds 32.
    ///         unsafe { body.launch(&k, LaunchConfig::linear(1, 32), args![&x]) }
    ///     })
    /// })?;
    /// graph.replay(&stream)?; // x doubled
    /// stream.copy_from_host(&[0u32], &flag)?;
    /// graph.replay(&stream)?; // skipped
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn if_then<T>(
        &self,
        cond: &DeviceBuffer<u32>,
        body: impl FnOnce(&CaptureStream<'_>) -> Result<T>,
    ) -> Result<T> {
        self.conditional(ConditionalKind::If, Some(cond), u32::MAX, body)
    }

    /// Adds a WHILE node: on every replay, `body` runs as long as `cond[0] != 0`, tested
    /// before the first iteration and after each one (so work inside `body` updates `cond`).
    /// A loop whose condition never clears runs until the device is reset: prefer
    /// [`Self::while_loop_capped`] when the body might not converge.
    #[track_caller]
    pub fn while_loop<T>(
        &self,
        cond: &DeviceBuffer<u32>,
        body: impl FnOnce(&CaptureStream<'_>) -> Result<T>,
    ) -> Result<T> {
        self.conditional(ConditionalKind::While, Some(cond), u32::MAX, body)
    }

    /// [`Self::while_loop`] that also stops after `max_iterations` iterations.
    #[track_caller]
    pub fn while_loop_capped<T>(
        &self,
        cond: &DeviceBuffer<u32>,
        max_iterations: u32,
        body: impl FnOnce(&CaptureStream<'_>) -> Result<T>,
    ) -> Result<T> {
        self.conditional(ConditionalKind::While, Some(cond), max_iterations, body)
    }

    /// Adds a WHILE node that runs `body` exactly `times` times per replay (a counter on the
    /// device; `times == 0` skips it).
    #[track_caller]
    pub fn repeat<T>(
        &self,
        times: u32,
        body: impl FnOnce(&CaptureStream<'_>) -> Result<T>,
    ) -> Result<T> {
        self.conditional(ConditionalKind::While, None, times, body)
    }

    #[track_caller]
    fn conditional<T>(
        &self,
        kind: ConditionalKind,
        cond: Option<&DeviceBuffer<u32>>,
        limit: u32,
        body: impl FnOnce(&CaptureStream<'_>) -> Result<T>,
    ) -> Result<T> {
        let device = self.device().clone();
        require_support(&device)?;
        if let Some(c) = cond {
            if c.is_empty() {
                return Err(Error::SizeMismatch {
                    what: "condition buffer",
                    expected: 1,
                    got: 0,
                });
            }
            check_device(&device, c.block())?;
        }
        let k = ConditionKernels::get(&device)?;
        let parent = self.stream_handle().raw_handle();
        device.context().bind()?;
        let handle =
            raw::conditional_handle_create(raw::capture_info(parent)?.graph, device.context())?;
        let cond_arg = cond.map_or(Arg::NULL, Arg::from);
        let one = LaunchConfig::linear(1, 1);
        // The loop counter lives as long as the graph (it is rewritten by every replay).
        let counter = match kind {
            ConditionalKind::While => {
                let c = self.alloc::<u32>(1)?;
                let c = Arc::new(c);
                self.keep_alive(c.clone());
                Some(c)
            }
            ConditionalKind::If => None,
        };
        match (&counter, cond) {
            (Some(counter), _) => {
                // SAFETY: one thread writes counter[0] (1 element) and reads cond[0] when cond
                // is not null (checked non-empty above); the handle is a value.
                unsafe {
                    self.launch(
                        &k.loop_begin,
                        one,
                        &[
                            Arg::U64(handle),
                            cond_arg,
                            Arg::from(&**counter),
                            Arg::U32(limit),
                        ],
                    )?
                }
            }
            (None, Some(_)) => {
                // SAFETY: one thread reads cond[0] (checked non-empty above).
                unsafe { self.launch(&k.set, one, &[Arg::U64(handle), cond_arg])? }
            }
            (None, None) => {
                return Err(Error::InvalidGraph {
                    problem: "an IF node needs a condition buffer".into(),
                })
            }
        }
        device.context().bind()?;
        let info = raw::capture_info(parent)?;
        let (node, body_graph) = raw::add_conditional_node(&info, handle, kind, device.context())?;
        raw::set_capture_dependencies(parent, node)?;

        // Record the body on a stream of its own, sharing this capture's pool and id.
        let stream = body_stream(&device, self.root_stream, self.depth + 1)?;
        stream.handle.mark_body_capture(true);
        if let Err(e) = raw::begin_capture_to_graph(stream.handle.raw(), body_graph, self.mode) {
            stream.handle.mark_body_capture(false);
            return Err(e);
        }
        let mut open = OpenBody {
            stream: &stream,
            open: true,
        };
        let inner = CaptureStream {
            stream: &stream,
            pool: self.pool.clone(),
            id: self.id,
            keep: std::cell::RefCell::new(Keep::default()),
            mode: self.mode,
            root_stream: self.root_stream,
            depth: self.depth + 1,
            scope: Some(std::cell::RefCell::new(BodyScope::default())),
            conds: std::cell::RefCell::new(Vec::new()),
            sides: self.sides,
            shared: self.shared,
            at_end: Default::default(),
        };
        let value = body(&inner)?;
        // Work registered for the end of the body runs at the end of every iteration.
        inner.at_end.run(&inner)?;
        if let Some(counter) = &counter {
            // SAFETY: as for cg_loop_begin above: counter[0] and, when given, cond[0].
            unsafe {
                inner.launch(
                    &k.loop_next,
                    one,
                    &[
                        Arg::U64(handle),
                        cond_arg,
                        Arg::from(&**counter),
                        Arg::U32(limit),
                    ],
                )?
            }
        }
        device.context().bind()?;
        open.end()?;
        // The body is recorded: what it keeps belongs to the graph, and the blocks it held
        // move to the enclosing body (or are released here, at the top level).
        let CaptureStream {
            keep, scope, conds, ..
        } = inner;
        self.keep.borrow_mut().merge(keep.into_inner());
        let scope = scope.map(|s| s.into_inner()).unwrap_or_default();
        match &self.scope {
            Some(outer) => outer.borrow_mut().absorb(scope),
            None => drop(scope),
        }
        let mut mine = self.conds.borrow_mut();
        mine.push(CondRecord {
            kind,
            node,
            body: body_graph,
        });
        mine.extend(conds.into_inner());
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::module::{ptx_entry_params, ParamDecl, ParamKind};

    #[test]
    fn condition_kernels_declare_the_parameters_the_launches_pass() {
        let p = ptx_entry_params(CONDITION_PTX);
        let int = |size| ParamDecl {
            size,
            kind: ParamKind::Int,
        };
        assert_eq!(
            p.len(),
            3,
            "three entries, the extern declaration is not one"
        );
        assert_eq!(p["cg_cond_set"], vec![int(8), int(8)]);
        assert_eq!(p["cg_loop_begin"], vec![int(8), int(8), int(8), int(4)]);
        assert_eq!(p["cg_loop_next"], vec![int(8), int(8), int(8), int(4)]);
    }

    #[test]
    fn every_condition_kernel_calls_the_setter_once_and_returns() {
        for entry in CONDITION_PTX.split(".visible .entry").skip(1) {
            assert_eq!(entry.matches("call.uni cudaGraphSetConditional").count(), 1);
            assert_eq!(entry.matches("ret;").count(), 1);
        }
    }
}
