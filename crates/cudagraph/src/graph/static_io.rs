//! Static inputs and outputs (seed 002's pattern as an API): the graph owns device input and
//! output buffers plus page-locked host staging, and the host-to-device and device-to-host
//! copies are nodes of the graph itself, so one run is: write the host staging, one graph
//! launch, one stream synchronisation.

use std::sync::Arc;

use super::capture::{CaptureOptions, CaptureStream};
use super::exec::{Graph, GraphInfo};
use crate::device::{copy_mapped, Queue, QueueExt, Stream};
use crate::error::{Error, Result};
use crate::memory::pinned::{typed, typed_mut};
use crate::memory::{bytes_for, DeviceBuffer, Elem};
use crate::runtime::memory::{self as raw, PinnedAlloc};

/// A graph with static inputs and outputs and host staging captured into it.
///
/// [`StaticGraph::run`] returns the outputs as a borrow of the graph that ends at the next
/// run, so reading a stale or overwritten output is a compile error:
///
/// ```compile_fail
/// # use cudagraph::*;
/// # fn f(g: &mut StaticGraph<f32, f32>, s: &Stream) -> Result<()> {
/// let first = g.run(s, &[&[1.0]])?;
/// let second = g.run(s, &[&[2.0]])?; // error: `*g` is still borrowed by `first`
/// println!("{:?}", first.get(0));
/// # Ok(()) }
/// ```
pub struct StaticGraph<I: Elem, O: Elem> {
    graph: Graph,
    inputs: Vec<DeviceBuffer<I>>,
    outputs: Vec<DeviceBuffer<O>>,
    host_in: Vec<Arc<PinnedAlloc>>,
    host_out: Vec<Arc<PinnedAlloc>>,
}

impl<I: Elem, O: Elem> std::fmt::Debug for StaticGraph<I, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "StaticGraph(inputs {:?}, outputs {:?}, {:?})",
            self.input_lens(),
            self.output_lens(),
            self.graph
        )
    }
}

/// Outputs of one [`StaticGraph::run`], borrowed until the next run.
#[derive(Debug)]
pub struct Outputs<'a, O: Elem> {
    host: &'a [Arc<PinnedAlloc>],
    lens: Vec<usize>,
    _o: std::marker::PhantomData<O>,
}

impl<'a, O: Elem> Outputs<'a, O> {
    /// Output `i` as a host slice (`None` past the last output).
    pub fn get(&self, i: usize) -> Option<&'a [O]> {
        Some(typed(self.host.get(i)?, *self.lens.get(i)?))
    }

    /// How many outputs there are.
    pub fn len(&self) -> usize {
        self.lens.len()
    }

    /// Whether there are no outputs.
    pub fn is_empty(&self) -> bool {
        self.lens.is_empty()
    }

    /// Owned copies of every output.
    pub fn to_vecs(&self) -> Vec<Vec<O>> {
        self.host
            .iter()
            .zip(&self.lens)
            .map(|(h, &n)| typed(h, n).to_vec())
            .collect()
    }
}

impl<I: Elem, O: Elem> StaticGraph<I, O> {
    /// Allocates device inputs of `input_lens` elements (default pool, before the capture),
    /// then captures: host-to-device copies into them, `f(cs, inputs)`, and device-to-host
    /// copies of the output buffers `f` returns.
    #[track_caller]
    pub fn capture<F>(
        stream: &mut Stream,
        opts: CaptureOptions,
        input_lens: &[usize],
        f: F,
    ) -> Result<Self>
    where
        F: FnOnce(&CaptureStream<'_>, &[DeviceBuffer<I>]) -> Result<Vec<DeviceBuffer<O>>>,
    {
        let ctx = &stream.device().context().handle.clone();
        let inputs = input_lens
            .iter()
            .map(|&n| stream.alloc_zeroed::<I>(n))
            .collect::<Result<Vec<_>>>()?;
        stream.synchronize()?;
        let host_in = input_lens
            .iter()
            .map(|&n| PinnedAlloc::new(bytes_for::<I>("static input", n)?, ctx).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        // The copies in and out become kernel nodes where they can (compiled before the
        // capture, which cannot compile).
        crate::device::prepare_copy_kernels(stream.device());
        let (graph, (outputs, host_out)) = Graph::capture(stream, opts, |cs| {
            for (h, d) in host_in.iter().zip(&inputs) {
                upload_pinned(cs, h, d)?;
            }
            let outputs = f(cs, &inputs)?;
            let mut host_out = Vec::with_capacity(outputs.len());
            for o in &outputs {
                let h = Arc::new(PinnedAlloc::new(o.bytes(), ctx)?);
                download_pinned(cs, o, &h)?;
                host_out.push(h);
            }
            Ok((outputs, host_out))
        })?;
        Ok(Self {
            graph,
            inputs,
            outputs,
            host_in,
            host_out,
        })
    }

    /// Elements of each static input.
    pub fn input_lens(&self) -> Vec<usize> {
        self.inputs.iter().map(|b| b.len()).collect()
    }

    /// Elements of each static output.
    pub fn output_lens(&self) -> Vec<usize> {
        self.outputs.iter().map(|b| b.len()).collect()
    }

    /// The device input buffers (for device-side producers).
    pub fn inputs(&self) -> &[DeviceBuffer<I>] {
        &self.inputs
    }

    /// The device output buffers (valid after a run, until the next).
    pub fn outputs(&self) -> &[DeviceBuffer<O>] {
        &self.outputs
    }

    /// Facts about the captured graph.
    pub fn info(&self) -> &GraphInfo {
        self.graph.info()
    }

    /// The captured graph's `Debug` line (nodes, memory, times, replays).
    pub fn graph_debug(&self) -> String {
        format!("{:?}", self.graph)
    }

    /// Copies `inputs` in, replays once, waits, and returns the outputs (borrowed until the
    /// next run). Each input slice must have its static input's length.
    #[track_caller]
    pub fn run(&mut self, stream: &Stream, inputs: &[&[I]]) -> Result<Outputs<'_, O>> {
        if inputs.len() != self.inputs.len() {
            return Err(Error::SizeMismatch {
                what: "number of static inputs",
                expected: self.inputs.len(),
                got: inputs.len(),
            });
        }
        for (i, src) in inputs.iter().enumerate() {
            let want = self.inputs[i].len();
            if src.len() != want {
                return Err(Error::SizeMismatch {
                    what: "static input length",
                    expected: want,
                    got: src.len(),
                });
            }
            // SAFETY: `&mut self` rules out a concurrent run and any other slice of this
            // staging (input staging is only ever handed out by `host_input_mut`, which also
            // borrows `self` mutably); only `run*` launch the graph and they synchronise before
            // returning, so no copy from it is in flight. Lengths are equal (checked above).
            unsafe { typed_mut::<I>(&self.host_in[i], want).copy_from_slice(src) };
        }
        self.replay_and_wait(stream)
    }

    /// The page-locked host staging of input `i`. Write the next request here directly and
    /// call [`Self::run_staged`]: no extra host copy (the zero-copy path for serving).
    pub fn host_input_mut(&mut self, i: usize) -> Result<&mut [I]> {
        let Some(len) = self.inputs.get(i).map(|b| b.len()) else {
            return Err(Error::OutOfRange {
                what: "static input index",
                start: i,
                end: i + 1,
                len: self.inputs.len(),
            });
        };
        // SAFETY: `&mut self` excludes a concurrent run and any other slice of this staging
        // (input staging is only ever handed out here); only `run*` launch the graph and they
        // synchronise before returning, so no copy from it is in flight.
        Ok(unsafe { typed_mut::<I>(&self.host_in[i], len) })
    }

    /// Replays with the inputs already in the host staging ([`Self::host_input_mut`]), waits,
    /// and returns the outputs (borrowed until the next run).
    #[track_caller]
    pub fn run_staged(&mut self, stream: &Stream) -> Result<Outputs<'_, O>> {
        self.replay_and_wait(stream)
    }

    fn replay_and_wait(&mut self, stream: &Stream) -> Result<Outputs<'_, O>> {
        self.graph.replay(stream)?;
        stream.synchronize()?;
        Ok(Outputs {
            host: &self.host_out,
            lens: self.output_lens(),
            _o: std::marker::PhantomData,
        })
    }

    /// [`Self::run`] returning owned copies of the outputs.
    #[track_caller]
    pub fn run_to_vecs(&mut self, stream: &Stream, inputs: &[&[I]]) -> Result<Vec<Vec<O>>> {
        Ok(self.run(stream, inputs)?.to_vecs())
    }
}

/// Captures a copy from pinned host memory into `dst`; the graph keeps `src` alive.
#[track_caller]
fn upload_pinned<T: Elem>(
    cs: &CaptureStream<'_>,
    src: &Arc<PinnedAlloc>,
    dst: &DeviceBuffer<T>,
) -> Result<()> {
    cs.use_block(dst.block());
    cs.keep_alive(src.clone());
    cs.device().context().bind()?;
    // SAFETY: the graph keeps `src` alive (above) until its last replay has finished, and
    // `StaticGraph::run` only writes it between synchronised replays; `src` was sized from
    // the same length as `dst` (declared with use_block above).
    if unsafe { copy_mapped(cs, dst.addr(), src.device_addr(), dst.bytes()) }? {
        return Ok(());
    }
    // SAFETY: as above.
    unsafe {
        raw::memcpy_htod_pinned_async(
            dst.addr(),
            src,
            dst.bytes(),
            cs.stream_handle().raw_handle(),
        )
    }
}

/// Captures a copy of `src` into pinned host memory; the graph keeps `dst` alive.
#[track_caller]
fn download_pinned<T: Elem>(
    cs: &CaptureStream<'_>,
    src: &DeviceBuffer<T>,
    dst: &Arc<PinnedAlloc>,
) -> Result<()> {
    cs.use_block(src.block());
    cs.keep_alive(dst.clone());
    cs.device().context().bind()?;
    // SAFETY: as in `upload_pinned`; `Outputs` reads `dst` only after `run` synchronised;
    // `dst` was sized from `src.bytes()`.
    if unsafe { copy_mapped(cs, dst.device_addr(), src.addr(), src.bytes()) }? {
        return Ok(());
    }
    // SAFETY: as above.
    unsafe {
        raw::memcpy_dtoh_pinned_async(
            dst,
            src.addr(),
            src.bytes(),
            cs.stream_handle().raw_handle(),
        )
    }
}
