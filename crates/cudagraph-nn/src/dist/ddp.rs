//! [`DistributedDataParallel`]: data-parallel training the way PyTorch's DDP does it — every
//! rank runs the same model on its share of the batch, and the gradients are averaged over
//! the ranks during the backward pass, so every rank takes the same optimizer step.
//!
//! Gradients are grouped into buckets (about 25 MiB, in reverse parameter order, because
//! that is roughly the order backward produces them). A parameter of a bucket's size or more
//! is a bucket of its own, reduced in place in its gradient buffer; smaller ones share a flat
//! buffer they are copied into and back out of. As soon as the last gradient of a bucket is
//! complete, the communication stream waits for the compute stream (an event), copies the
//! bucket in, all-reduces it (NCCL's average: each rank's gradient scaled by 1/world, then
//! summed — PyTorch's default), and copies it out, while the compute stream goes on with the
//! rest of the backward pass; at the end the compute stream waits for the communication
//! stream (an event), so the optimizer step sees averaged gradients. Buckets are reduced in
//! bucket order on every rank, so the collectives match.
//!
//! The same code runs eagerly on a [`Stream`] or inside [`cudagraph::Graph::capture`]: the
//! communication stream joins the capture through the event wait ([`cudagraph::Fork`]), and
//! the graph holds the all-reduces as a branch beside the backward kernels — the whole step,
//! collectives included, in one graph per rank. Gradients with `zero_grad(set_to_none)` are
//! buffers adopted during backward; the copies (and in-place reductions) are recorded on
//! whatever buffers backward produced, which a captured step reproduces at the same addresses
//! on every replay.

use std::collections::HashMap;
use std::sync::Arc;

use cudagraph::{DeviceBuffer, Fork, Queue, QueueExt, SideStream, Stream};

use super::communicator::{Communicator, ReduceOp};
use super::DistError;
use crate::autograd::tensor::{require_f32_params, Parameter, Tensor};
use crate::error::{NnError, Result};

/// Options of [`DistributedDataParallel`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DdpOptions {
    /// Bytes of gradients per bucket (PyTorch's `bucket_cap_mb`, default 25 MiB).
    pub bucket_cap_bytes: usize,
    /// Copy rank 0's parameters to every rank when the wrapper is made (default on), so all
    /// ranks start from the same weights whatever their initialisation.
    pub broadcast_parameters: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_bytes: 25 << 20,
            broadcast_parameters: true,
        }
    }
}

/// Groups parameters (their gradient sizes in bytes, in parameter order) into buckets, in
/// the order they are reduced: walking the parameters in reverse, one of `cap` bytes or more
/// gets a bucket of its own at once; smaller ones fill a shared bucket, closed when it
/// reaches `cap` bytes (and at the end).
pub fn plan_buckets(sizes: &[usize], cap: usize) -> Vec<Vec<usize>> {
    let mut buckets = Vec::new();
    let (mut open, mut open_bytes) = (Vec::new(), 0usize);
    for i in (0..sizes.len()).rev() {
        if sizes[i] >= cap {
            buckets.push(vec![i]);
            continue;
        }
        open.push(i);
        open_bytes = open_bytes.saturating_add(sizes[i]);
        if open_bytes >= cap {
            buckets.push(std::mem::take(&mut open));
            open_bytes = 0;
        }
    }
    if !open.is_empty() {
        buckets.push(open);
    }
    buckets
}

struct Bucket {
    /// Indices into the parameter list.
    members: Vec<usize>,
    /// Element offset of each member in `flat`.
    offsets: Vec<usize>,
    /// The shared buffer; `None` for a one-parameter bucket, reduced in place.
    flat: Option<DeviceBuffer<f32>>,
}

/// What one bucket holds (see [`DistributedDataParallel::buckets`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketInfo {
    /// Parameter indices (into the list given to [`DistributedDataParallel::new`]).
    pub params: Vec<usize>,
    /// Gradient elements.
    pub numel: usize,
    /// Reduced in place in the parameter's own gradient (no copies).
    pub in_place: bool,
}

/// Data-parallel training over a [`Communicator`] (PyTorch's `DistributedDataParallel`,
/// applied to a list of parameters): call [`Self::backward`] instead of `loss.backward` and
/// every rank ends up with the average of all ranks' gradients.
///
/// Every rank must make the same calls in the same order: `new`, then one `backward` per
/// step, each eager or captured alike (a captured backward's collectives run at each
/// replay). The sizes of the collectives come from the parameter layout, which `new`
/// verifies across the ranks before any collective that depends on it, so they always
/// match; a rank that skips a step leaves the others waiting, and the watchdog
/// ([`Self::synchronize`]) turns that into an error.
///
/// One backward per step (there is no `no_sync` gradient accumulation yet). A parameter that
/// gets no gradient on a rank (unused in its forward pass) contributes zeros there and
/// receives the average like the others — so a parameter unused on every rank ends with a
/// zero gradient, where PyTorch leaves it `None`.
///
/// ```no_run
/// use cudagraph::{CaptureOptions, Device, Graph};
/// use cudagraph_nn::*;
/// # fn main() -> Result<()> {
/// // One process per GPU: `cudagraph launch --nproc 2 -- ./train` sets RANK, WORLD_SIZE...
/// let env = dist::DistEnv::from_env()?.unwrap_or_else(dist::DistEnv::single);
/// let dev = Device::open(env.local_rank)?;
/// let comm = Communicator::from_env(&dev)?;
/// let mut s = dev.new_stream()?;
/// let mut rng = HostRng::new(0);
/// let model = Linear::new(&s, 1024, 1024, &mut rng)?;
/// let mut ddp = DistributedDataParallel::new(&s, &comm, model.parameters(), DdpOptions::default())?;
/// let mut opt = Sgd::new(&s, model.parameters(), 1e-3, 0.0, 0.0)?;
/// let x = Tensor::from_host(&s, &rng.vec_normal(64 * 1024), &[64, 1024])?; // this rank's shard
/// let y = Tensor::from_host(&s, &rng.vec_normal(64 * 1024), &[64, 1024])?;
/// // Warm up eagerly (the same code), then capture the whole step, all-reduces included.
/// let (step, _loss) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
///     opt.zero_grad(cs, true)?;
///     let loss = mse_loss(cs, &model.forward(cs, &x)?, &y, Reduction::Mean)?;
///     ddp.backward(cs, &loss)?;
///     opt.step(cs)?;
///     Ok(loss)
/// })
/// .map_err(NnError::from)?;
/// for _ in 0..100 {
///     step.replay(&s)?;
/// }
/// ddp.synchronize(&s)?; // fails instead of hanging if a peer died
/// # Ok(()) }
/// ```
pub struct DistributedDataParallel {
    comm: Communicator,
    params: Vec<Parameter>,
    buckets: Vec<Bucket>,
    /// Parameter key → index.
    index: HashMap<usize, usize>,
    /// Parameter index → bucket.
    bucket_of: Vec<usize>,
    comm_stream: Stream,
}

impl std::fmt::Debug for DistributedDataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DistributedDataParallel({} parameters in {} buckets, {:?})",
            self.params.len(),
            self.buckets.len(),
            self.comm
        )
    }
}

/// Everything the collectives of [`DistributedDataParallel`] depend on, as numbers every
/// rank must hold alike: the options (the bucket cap decides the buckets, and whether the
/// parameters are broadcast decides whether `new` issues collectives at all), the number of
/// parameters, and each parameter's shape (its length, then its dimensions). The encoding is
/// exact and can be decoded again, so two layouts give the same numbers only when they are
/// the same — equal numbers mean equal bucket plans, hence equal collective counts.
fn layout<'a>(shapes: impl ExactSizeIterator<Item = &'a [usize]>, opts: &DdpOptions) -> Vec<i64> {
    // Bit patterns: injective for every usize.
    let n = |v: usize| v as u64 as i64;
    let mut v = vec![
        n(opts.bucket_cap_bytes),
        i64::from(opts.broadcast_parameters),
        n(shapes.len()),
    ];
    for shape in shapes {
        v.push(n(shape.len()));
        v.extend(shape.iter().map(|&d| n(d)));
    }
    v
}

impl DistributedDataParallel {
    /// Wraps `params` (a model's parameters, the same list in the same order on every rank)
    /// for data-parallel training on `comm`. Allocates the bucket buffers on `s`, checks that
    /// every rank has the same parameter shapes and the same `opts` (every rank fails with
    /// [`DistError::Mismatch`] otherwise, before any collective whose size depends on them),
    /// and copies rank 0's parameters to all ranks (unless `opts` says not to), waiting for
    /// that with the communicator's watchdog.
    ///
    /// Why DDP is safe where [`Communicator::all_reduce`] is not: every count it passes to
    /// NCCL comes from this verified layout (a bucket's size, a parameter's size), in an
    /// order fixed by it (bucket order), so ranks that make the same DDP calls pass the
    /// same counts. A backward that fails after its first collective aborts the communicator
    /// (a retry would start over at the first bucket while the peers wait in a later one).
    pub fn new(
        s: &Stream,
        comm: &Communicator,
        params: Vec<Parameter>,
        opts: DdpOptions,
    ) -> Result<Self> {
        let ordinal = comm.device_ordinal();
        let wrong = |what, got| -> NnError {
            cudagraph::Error::WrongDevice {
                what,
                expected: ordinal,
                got,
            }
            .into()
        };
        if s.device().ordinal() != ordinal {
            return Err(wrong("stream", s.device().ordinal()));
        }
        if opts.bucket_cap_bytes == 0 {
            return Err(DistError::Usage("bucket_cap_bytes must be at least 1".into()).into());
        }
        require_f32_params(
            &params,
            "DistributedDataParallel",
            "reduce f32 gradients: keep the parameters f32 (with 16-bit optimizer copies for \
             the forward pass, OptimOptions { copies })",
        )?;
        let mut index = HashMap::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            if p.data()?.block().device_ordinal() != ordinal {
                return Err(wrong("parameter", p.data()?.block().device_ordinal()));
            }
            if index.insert(p.key(), i).is_some() {
                return Err(DistError::Usage(format!(
                    "parameter {i} ({}) is listed twice",
                    p.name()
                ))
                .into());
            }
        }
        let sizes: Vec<usize> = params.iter().map(|p| p.numel().saturating_mul(4)).collect();
        let mut bucket_of = vec![0; params.len()];
        let mut buckets = Vec::new();
        for (b, members) in plan_buckets(&sizes, opts.bucket_cap_bytes)
            .into_iter()
            .enumerate()
        {
            let mut offsets = Vec::with_capacity(members.len());
            let mut numel = 0usize;
            for &m in &members {
                bucket_of[m] = b;
                offsets.push(numel);
                numel = numel
                    .checked_add(params[m].numel())
                    .ok_or_else(|| DistError::Usage("a gradient bucket's size overflows".into()))?;
            }
            let flat = if members.len() > 1 {
                Some(s.alloc::<f32>(numel)?)
            } else {
                None
            };
            buckets.push(Bucket {
                members,
                offsets,
                flat,
            });
        }
        let ddp = DistributedDataParallel {
            comm: comm.clone(),
            comm_stream: s.device().new_stream()?,
            params,
            buckets,
            index,
            bucket_of,
        };
        if comm.world_size() > 1 {
            ddp.verify_layout(s, &opts)?;
            if opts.broadcast_parameters {
                for p in &ddp.params {
                    // SAFETY: `verify_layout` proved that every rank wraps parameters of the
                    // same shapes in the same order and broadcasts them too, so every rank
                    // issues these broadcasts one parameter at a time with the same count
                    // (`p.numel()`, the data's length), type (f32) and root, and nothing of
                    // DDP's comes between them.
                    unsafe { comm.broadcast(s, p.data()?, 0)? };
                }
                comm.synchronize(s)?;
            }
        }
        Ok(ddp)
    }

    /// Fails on every rank when the ranks' parameter lists or options differ (their
    /// collectives would not match): [`Communicator::all_agree`] over the exact layout.
    fn verify_layout(&self, s: &Stream, opts: &DdpOptions) -> Result<()> {
        let values = layout(self.params.iter().map(Parameter::shape), opts);
        if !self.comm.all_agree(s, &values)? {
            let total: usize = self.params.iter().map(Parameter::numel).sum();
            let e = DistError::Mismatch(format!(
                "rank {} has {} parameters ({total} elements, bucket_cap_bytes {}, broadcast_parameters {}) but another rank's list differs in count or shapes, or its DdpOptions differ; every rank must wrap the same model with the same DdpOptions",
                self.comm.rank(),
                self.params.len(),
                opts.bucket_cap_bytes,
                opts.broadcast_parameters
            ));
            self.comm.abort(&e.to_string());
            return Err(e.into());
        }
        Ok(())
    }

    /// Backward from the scalar `loss` with every gradient averaged over the ranks (see the
    /// module docs). `q` is the compute queue: an eager [`Stream`] or a capture stream.
    /// Everything enqueued on `q` afterwards (the optimizer step) sees averaged gradients.
    pub fn backward(&mut self, q: &dyn Fork, loss: &Tensor) -> Result<()> {
        if loss.numel() != 1 {
            return Err(NnError::NotScalar(loss.shape().to_vec()));
        }
        self.backward_seeded(q, loss, None)
    }

    /// [`Self::backward`] from `output` with upstream gradient `grad`.
    pub fn backward_with(&mut self, q: &dyn Fork, output: &Tensor, grad: Tensor) -> Result<()> {
        self.backward_seeded(q, output, Some(grad))
    }

    /// Backward from `output` with upstream gradient `grad`, or exactly one for a scalar
    /// (`None`: as [`Tensor::backward`], a loss hands on its saved gradient unscaled).
    fn backward_seeded(
        &mut self,
        q: &dyn Fork,
        output: &Tensor,
        grad: Option<Tensor>,
    ) -> Result<()> {
        let nq = q.as_queue();
        if self.comm.world_size() == 1 {
            return match grad {
                Some(grad) => output.backward_with(nq, grad),
                None => output.backward(nq),
            };
        }
        // Fail before enqueueing anything if a peer is already gone.
        self.comm.check()?;
        let DistributedDataParallel {
            comm,
            params,
            buckets,
            index,
            bucket_of,
            comm_stream,
        } = self;
        let side = q.fork(comm_stream)?;
        let mut ready = vec![0usize; buckets.len()];
        let mut seen = vec![false; params.len()];
        // Buckets whose reduction was started (in bucket order): a collective may be enqueued
        // from the first one on.
        let mut next = 0usize;
        let run = || -> Result<()> {
            let mut hook = |_: &dyn Queue, p: &Parameter| -> Result<()> {
                let Some(&i) = index.get(&p.key()) else {
                    return Ok(()); // not one of ours
                };
                if std::mem::replace(&mut seen[i], true) {
                    return Ok(());
                }
                ready[bucket_of[i]] += 1;
                while next < buckets.len() && ready[next] == buckets[next].members.len() {
                    next += 1;
                    reduce(&side, comm, params, &buckets[next - 1])?;
                }
                Ok(())
            };
            match grad {
                Some(grad) => output.backward_with_hook(nq, grad, &mut hook)?,
                None => output.backward_unit_with_hook(nq, &mut hook)?,
            }
            // Buckets with a parameter that got no gradient here (unused in this forward
            // pass) take part anyway, with zeros: every rank must issue the same collectives.
            while next < buckets.len() {
                next += 1;
                reduce(&side, comm, params, &buckets[next - 1])?;
            }
            side.join()?;
            Ok(())
        };
        let r = run();
        if let Err(e) = &r {
            if next > 0 {
                // Part of this step's collectives may be enqueued: the peers wait in a later
                // bucket than a retry would start with, and its first collective would meet
                // one of another size. Nothing may reach NCCL on this communicator again.
                comm.abort(&format!(
                    "rank {}: a data-parallel backward failed after its first collective: {e}",
                    comm.rank()
                ));
            }
        }
        r
    }

    /// Waits for everything queued on `s` with the communicator's watchdog (see
    /// [`Communicator::synchronize`]).
    pub fn synchronize(&self, s: &Stream) -> Result<()> {
        self.comm.synchronize(s)
    }

    /// The communicator.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// The wrapped parameters.
    pub fn parameters(&self) -> &[Parameter] {
        &self.params
    }

    /// The buckets, in reduction order.
    pub fn buckets(&self) -> Vec<BucketInfo> {
        self.buckets
            .iter()
            .map(|b| BucketInfo {
                params: b.members.clone(),
                numel: b.members.iter().map(|&m| self.params[m].numel()).sum(),
                in_place: b.flat.is_none(),
            })
            .collect()
    }
}

/// Enqueues one bucket's reduction on the communication branch, after the compute work so
/// far (which produced its gradients).
fn reduce(
    side: &SideStream<'_>,
    comm: &Communicator,
    params: &[Parameter],
    b: &Bucket,
) -> Result<()> {
    side.wait_main()?;
    let Some(flat) = &b.flat else {
        let p = &params[b.members[0]];
        let g = match p.grad()? {
            Some(g) => g,
            None => {
                let z = Arc::new(side.alloc_zeroed::<f32>(p.numel())?);
                p.set_grad(Some(z.clone()))?;
                z
            }
        };
        // The count must be the verified one: the parameter's size, not whatever buffer
        // holds its gradient.
        if g.len() != p.numel() {
            return Err(NnError::Shape(format!(
                "parameter {}: a gradient of {} values for {} elements",
                p.name(),
                g.len(),
                p.numel()
            )));
        }
        // SAFETY: the count is `p.numel()` (checked just above), and every rank reduces this
        // bucket — the same parameter of a layout `new` verified to be the same on every
        // rank — at the same place: buckets go in bucket order, every bucket once per
        // backward, and a backward that stops after its first collective aborts the
        // communicator. f32 and the average everywhere.
        return unsafe { comm.all_reduce(side, &g, ReduceOp::Avg) };
    };
    debug_assert_eq!(
        flat.len(),
        b.members.iter().map(|&m| params[m].numel()).sum::<usize>()
    );
    let grads = b
        .members
        .iter()
        .map(|&m| params[m].grad())
        .collect::<Result<Vec<_>>>()?;
    for ((&m, &off), g) in b.members.iter().zip(&b.offsets).zip(&grads) {
        let n = params[m].numel();
        match g {
            Some(g) => side.copy_range(g, 0, flat, off, n)?,
            None => side.memset_zero_range(flat, off, n)?,
        }
    }
    // SAFETY: `flat` holds exactly the bucket's elements (allocated so in `new`), a sum of
    // parameter sizes of the verified layout; every rank reduces the same bucket at the same
    // place (see the in-place case above). f32 and the average everywhere.
    unsafe { comm.all_reduce(side, flat, ReduceOp::Avg)? };
    for ((&m, &off), g) in b.members.iter().zip(&b.offsets).zip(grads) {
        let p = &params[m];
        let n = p.numel();
        let g = match g {
            Some(g) => g,
            None => {
                let buf = Arc::new(side.alloc::<f32>(n)?);
                p.set_grad(Some(buf.clone()))?;
                buf
            }
        };
        side.copy_range(flat, off, &g, 0, n)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{layout, plan_buckets, DdpOptions};

    fn of(shapes: &[&[usize]], opts: &DdpOptions) -> Vec<i64> {
        layout(shapes.iter().copied(), opts)
    }

    /// (issue 26, item 5) The layout every rank must agree on before DDP issues a collective
    /// whose size depends on it: any difference in the parameters' number or shapes, or in
    /// the options, gives other numbers.
    #[test]
    fn layouts_differ_whenever_the_collectives_could() {
        let d = DdpOptions::default();
        let no_bcast = DdpOptions {
            broadcast_parameters: false,
            ..d
        };
        let small = DdpOptions {
            bucket_cap_bytes: 1,
            ..d
        };
        let cases: Vec<Vec<i64>> = vec![
            of(&[&[8, 4], &[4]], &d),
            of(&[&[8, 4]], &d),             // a parameter fewer
            of(&[&[8, 4], &[4], &[1]], &d), // a parameter more
            of(&[&[9, 4], &[4]], &d),       // another width
            of(&[&[4, 8], &[4]], &d),       // same sizes, other shape
            of(&[&[32], &[4]], &d),         // same size, other rank
            of(&[&[8], &[4, 4]], &d),       // the dims regrouped
            of(&[&[8, 4, 4]], &d),          // ... over fewer parameters
            of(&[&[8, 4], &[4]], &no_bcast),
            of(&[&[8, 4], &[4]], &small),
            of(&[], &d),
            of(&[&[]], &d), // one scalar parameter
        ];
        for (i, a) in cases.iter().enumerate() {
            for (j, b) in cases.iter().enumerate() {
                assert_eq!(a == b, i == j, "cases {i} and {j}: {a:?} vs {b:?}");
            }
        }
        assert_eq!(of(&[&[8, 4], &[4]], &d), of(&[&[8, 4], &[4]], &d));
    }

    #[test]
    fn buckets_follow_reverse_parameter_order() {
        // Linear(1024, 1024): weight 4 MiB, bias 4 KiB -> one shared bucket, bias first.
        assert_eq!(
            plan_buckets(&[4 << 20, 4 << 10], 25 << 20),
            vec![vec![1, 0]]
        );
        // Small parameters fill buckets up to the cap, last parameter first.
        assert_eq!(
            plan_buckets(&[10, 10, 10, 10, 10], 20),
            vec![vec![4, 3], vec![2, 1], vec![0]]
        );
    }

    #[test]
    fn large_parameters_get_their_own_bucket() {
        // 8 x Linear(4096, 4096): 64 MiB weights reduced in place one by one, as backward
        // produces them; the 16 KiB biases share one bucket at the end.
        let mut sizes = Vec::new();
        for _ in 0..8 {
            sizes.extend([64 << 20, 16 << 10]);
        }
        let b = plan_buckets(&sizes, 25 << 20);
        assert_eq!(b.len(), 9);
        for (k, bucket) in b[..8].iter().enumerate() {
            assert_eq!(bucket, &vec![14 - 2 * k]);
        }
        assert_eq!(b[8], vec![15, 13, 11, 9, 7, 5, 3, 1]);
    }

    #[test]
    fn every_parameter_is_in_exactly_one_bucket() {
        for cap in [1usize, 7, 100, 1 << 30] {
            let sizes: Vec<usize> = (0..50).map(|i| (i * 37) % 101).collect();
            let mut all: Vec<usize> = plan_buckets(&sizes, cap).concat();
            all.sort_unstable();
            assert_eq!(all, (0..50).collect::<Vec<_>>(), "cap {cap}");
        }
        assert!(plan_buckets(&[], 10).is_empty());
    }
}
