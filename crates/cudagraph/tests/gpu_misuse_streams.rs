//! GPU tests of the stream and memory soundness fixes, each reproducing a misuse that safe code
//! could write and asserting the typed error, and that the stream and pool stay usable:
//!
//! - an eager stream that is part of a capture (a fork's side stream after the join, a cudarc
//!   stream cudarc is capturing) refuses eager work, and what libraries declare on it is kept
//!   alive instead of freed under the graph;
//! - a stream cannot be pulled into a capture by waiting on an event recorded inside it;
//! - buffers from an allocator that is not a device's, and eager blocks from a graph pool, are
//!   refused;
//! - a copy from page-locked host memory has finished reading the source when it returns;
//! - dropping an external buffer used on another stream does not spin on a capturing thread.
//!
//! Named `misuse_*` like every test that provokes a refusal on purpose (`bench/sanitize.sh`
//! skips them). The CPU side of these fixes is tested in `allocator.rs` and the unit tests.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use cudagraph::cudarc::driver::sys;
use cudagraph::memory::{Allocator, HostSource};
use cudagraph::*;

const SRC: &str = r#"
// Spins for `cycles` clock cycles, then writes v to x[0..n): a kernel that finishes late.
extern "C" __global__ void slow_fill(float* x, long n, float v, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        x[i] = v;
}
extern "C" __global__ void add_const(float* x, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b;
}
"#;

struct K {
    slow_fill: Function,
    add_const: Function,
}

fn kernels(dev: &Device) -> K {
    let m = dev
        .compile("gpu_misuse_streams", SRC)
        .expect("test kernels");
    K {
        slow_fill: m.function("slow_fill").unwrap(),
        add_const: m.function("add_const").unwrap(),
    }
}

const N: usize = 4096;
/// About 50 ms at H100/H200 clocks: long enough that work queued behind it runs late.
const SLOW: i64 = 100_000_000;

fn add_const(q: &dyn Queue, k: &K, x: &DeviceBuffer<f32>, b: f32) -> Result<()> {
    // SAFETY: add_const touches x[0..n) with n = x.len().
    unsafe {
        q.launch(
            &k.add_const,
            LaunchConfig::for_elements(x.len(), 256),
            args![x, b, x.len() as i32],
        )
    }
}

fn slow_fill(q: &dyn Queue, k: &K, x: &DeviceBuffer<f32>, v: f32) -> Result<()> {
    // SAFETY: slow_fill writes x[0..n) with n = x.len() (grid-stride loop).
    unsafe {
        q.launch(
            &k.slow_fill,
            LaunchConfig::linear(132, 256),
            args![x, x.len() as i64, v, SLOW],
        )
    }
}

/// The refusal of eager work on a stream that is part of a capture.
fn is_capture_refusal(r: &Option<Error>) -> bool {
    matches!(r, Some(Error::InvalidGraph { .. }))
}

#[test]
fn misuse_a_side_stream_used_eagerly_after_its_join_is_refused() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let mut comm = dev.new_stream().unwrap();
    let x = s.alloc_zeroed::<f32>(N).unwrap();
    let y = comm.alloc_zeroed::<f32>(N).unwrap();
    let kept = comm.alloc_zeroed::<f32>(N).unwrap();
    let ev = dev.new_event(false).unwrap();
    let pinned = dev.alloc_pinned::<f32>(N).unwrap();
    s.synchronize().unwrap();
    comm.synchronize().unwrap();
    let (g, refusals) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        let side = cs.fork(&mut comm)?;
        add_const(&side, &k, &x, 1.0)?;
        side.join()?;
        // The driver keeps `comm` in the capture until it ends: everything eager is refused
        // before it reaches the driver (recorded, it would write `y` on every replay while
        // the graph does not hold `y`).
        assert!(comm.driver_is_capturing()?);
        let refusals = vec![
            ("memset", comm.memset_zero(&y).err()),
            ("fill", comm.fill32(&y, 0, N, 1.0f32).err()),
            ("copy", comm.copy(&x, &y).err()),
            ("alloc", comm.alloc::<f32>(16).err()),
            ("launch", add_const(&comm, &k, &y, 1.0).err()),
            ("copy_from_host", comm.copy_from_host(&[0f32; N], &y).err()),
            ("to_vec", comm.to_vec(&y).err()),
            ("synchronize", comm.synchronize().err()),
            ("record", comm.record(&ev).err()),
            ("wait_event", comm.wait_event(&ev).err()),
            (
                "pinned upload",
                comm.pinned_scope(|sc| sc.upload(&pinned, &y)).err(),
            ),
        ];
        // A declaration cannot fail: the block is kept for the rest of the process instead.
        comm.use_block(kept.block());
        add_const(cs, &k, &x, 1.0)?;
        Ok(refusals)
    })
    .unwrap();
    for (what, r) in &refusals {
        assert!(is_capture_refusal(r), "{what}: {r:?}");
    }
    // After the capture the side stream is an ordinary stream again.
    assert!(!comm.driver_is_capturing().unwrap());
    comm.fill32(&y, 0, N, 3.0f32).unwrap();
    assert!(comm.to_vec(&y).unwrap().iter().all(|&v| v == 3.0));
    comm.synchronize().unwrap();
    // The block declared on the capturing stream is never freed (a graph may use it).
    let before = dev.memory_allocated();
    drop(kept);
    assert_eq!(
        dev.memory_allocated(),
        before,
        "the declared block was freed"
    );
    for _ in 0..2 {
        g.replay(&s).unwrap();
    }
    assert!(s.to_vec(&x).unwrap().iter().all(|&v| v == 4.0));
    // `y` was never part of the graph: untouched by the replays.
    assert!(comm.to_vec(&y).unwrap().iter().all(|&v| v == 3.0));
}

#[test]
fn misuse_waiting_on_a_capturing_stream_is_refused() {
    // The audit's trigger: another stream waits on the capturing stream, does work, and the
    // capture waits back — the work lands in the graph, which does not keep its buffer.
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let other = dev.new_stream().unwrap();
    let x = s.alloc_zeroed::<f32>(N).unwrap();
    let buf = other.alloc_zeroed::<f32>(N).unwrap();
    s.synchronize().unwrap();
    other.synchronize().unwrap();
    let h = s.handle().clone();
    let ev = dev.new_event(false).unwrap();
    let (g, refusals) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        add_const(cs, &k, &x, 1.0)?;
        cs.stream_handle().record(&ev)?;
        Ok(vec![
            ("handle wait_for", other.handle().wait_for(&h).err()),
            ("stream wait_event", other.wait_event(&ev).err()),
            ("handle wait_event", other.handle().wait_event(&ev).err()),
            (
                "library view wait_event",
                other.stream_handle().wait_event(&ev).err(),
            ),
        ])
    })
    .unwrap();
    for (what, r) in &refusals {
        assert!(is_capture_refusal(r), "{what}: {r:?}");
    }
    assert!(ev.is_captured());
    assert!(!other.driver_is_capturing().unwrap());
    // `other` stayed out of the graph: its buffer can go and its memory be reused eagerly.
    drop(buf);
    let again = other.alloc::<f32>(N).unwrap();
    other.fill32(&again, 0, N, 7.0f32).unwrap();
    g.replay(&s).unwrap();
    s.synchronize().unwrap();
    assert!(other.to_vec(&again).unwrap().iter().all(|&v| v == 7.0));
    assert!(s.to_vec(&x).unwrap().iter().all(|&v| v == 1.0));
    // Recorded eagerly again, the event can be waited on.
    s.record(&ev).unwrap();
    assert!(!ev.is_captured());
    other.wait_event(&ev).unwrap();
    other.synchronize().unwrap();
}

#[test]
fn misuse_eager_work_on_a_cudarc_stream_that_cudarc_captures_is_refused() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let ctx = dev.cudarc_context().unwrap();
    // SAFETY: the cudarc slice below is used on `cu` only.
    unsafe { ctx.disable_event_tracking() };
    let cu = ctx.new_stream().unwrap();
    let s2 = Stream::from_cudarc(&dev, &cu).unwrap();
    let mut marker = cu.alloc_zeros::<f32>(16).unwrap();
    let buf = s2.alloc_zeroed::<f32>(N).unwrap();
    s2.synchronize().unwrap();
    let allocated = dev.memory_allocated();
    // cudarc begins a capture on the stream we wrapped (relaxed: our calls on this thread do
    // not disturb it).
    cu.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    assert!(s2.stream_handle().in_capture().unwrap());
    let refusals = vec![
        ("memset", s2.memset_zero(&buf).err()),
        ("alloc", s2.alloc::<f32>(16).err()),
        ("launch", add_const(&s2, &k, &buf, 1.0).err()),
        ("copy_from_host", s2.copy_from_host(&[1f32; N], &buf).err()),
        ("synchronize", s2.synchronize().err()),
    ];
    // What a library declares on it is kept for good rather than freed under cudarc's graph.
    let q: &dyn Queue = &s2;
    q.use_block(buf.block());
    cu.memset_zeros(&mut marker).unwrap();
    let g = cu.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap();
    drop(g);
    for (what, r) in &refusals {
        assert!(is_capture_refusal(r), "{what}: {r:?}");
    }
    drop(buf);
    assert_eq!(
        dev.memory_allocated(),
        allocated,
        "the declared block was freed"
    );
    // The stream works eagerly again.
    assert!(!s2.stream_handle().in_capture().unwrap());
    let y = s2.alloc_from_host(&[2.0f32; 64]).unwrap();
    add_const(&s2, &k, &y, 1.0).unwrap();
    assert_eq!(s2.to_vec(&y).unwrap(), vec![3.0; 64]);
}

#[test]
fn misuse_buffers_that_are_not_the_devices_memory_are_refused() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    // SAFETY: host memory with the device's ordinal; its blocks are only given to this
    // crate's queues and captures, which check `is_device_memory` and refuse them.
    let host = unsafe { Allocator::new(Box::new(HostSource::new()), dev.ordinal()) };
    let fake = DeviceBuffer::<f32>::from_block(
        host.allocate_block(4 * N, s.handle().as_ref()).unwrap(),
        N,
    )
    .unwrap();
    assert_eq!(fake.block().device_ordinal(), dev.ordinal());
    let real = s.alloc_zeroed::<f32>(N).unwrap();
    let not_device = |r: Result<()>| matches!(r, Err(Error::NotSupported { .. }));
    assert!(not_device(s.memset_zero(&fake)));
    assert!(not_device(s.copy(&real, &fake)));
    assert!(not_device(s.copy_from_host(&[1f32; N], &fake)));
    assert!(not_device(s.to_vec(&fake).map(drop)));
    assert!(not_device(add_const(&s, &k, &fake, 1.0)));
    // A capture into a pool of that allocator gets blocks no queue accepts either.
    let pool = host.new_pool(None);
    let r = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        let t = cs.alloc::<f32>(N)?;
        cs.memset_zero(&t)
    });
    match r {
        Err(Error::CaptureFailed { source, .. }) => {
            assert!(matches!(*source, Error::NotSupported { .. }), "{source}")
        }
        other => panic!("expected a refused capture, got {:?}", other.map(|_| ())),
    }
    // The stream and the device's own buffers work as before.
    add_const(&s, &k, &real, 2.0).unwrap();
    assert!(s.to_vec(&real).unwrap().iter().all(|&v| v == 2.0));
}

#[test]
fn misuse_eager_blocks_from_a_graph_pool_are_refused() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let x = s.alloc_zeroed::<f32>(N).unwrap();
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        // A temporary of the graph's pool: free after the capture, written by every replay.
        let tmp = cs.alloc::<f32>(N)?;
        cs.fill32(&tmp, 0, N, 1.0f32)?;
        add_const(cs, &k, &tmp, 1.0)?;
        cs.copy(&tmp, &x)
    })
    .unwrap();
    let pool = g.pool().unwrap().id();
    let stats = dev.pool_stats(pool);
    let r = dev.allocator().allocate(4 * N, pool, s.handle().as_ref());
    assert!(matches!(r, Err(Error::InvalidGraph { .. })), "{r:?}");
    assert_eq!(
        dev.pool_stats(pool),
        stats,
        "nothing was taken from the pool"
    );
    g.replay(&s).unwrap();
    assert!(s.to_vec(&x).unwrap().iter().all(|&v| v == 2.0));
    // The default pool still hands out library blocks.
    let b = dev
        .allocator()
        .allocate_block(4 * N, s.handle().as_ref())
        .unwrap();
    assert!(b.is_device_memory());
}

#[test]
fn misuse_a_copy_from_page_locked_memory_has_read_it_when_it_returns() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let s = dev.new_stream().unwrap();
    let busy = s.alloc_zeroed::<f32>(N).unwrap();
    let dst = s.alloc_zeroed::<f32>(N).unwrap();
    s.synchronize().unwrap();

    // Our pinned buffer: the copy queued behind a slow kernel is a DMA that runs late, so the
    // host overwriting the source right after the call must not change what arrives.
    let mut pinned = dev.alloc_pinned::<f32>(N).unwrap();
    pinned.as_mut_slice().fill(3.0);
    slow_fill(&s, &k, &busy, 1.0).unwrap();
    s.copy_from_host(pinned.as_slice(), &dst).unwrap();
    pinned.as_mut_slice().fill(9.0);
    assert!(s.to_vec(&dst).unwrap().iter().all(|&v| v == 3.0));

    // cudarc's pinned memory (page-locked, write-combined), the same way.
    let ctx = dev.cudarc_context().unwrap();
    // SAFETY: written below before it is read.
    let mut cpin = unsafe { ctx.alloc_pinned::<f32>(N) }.unwrap();
    cpin.as_mut_slice().unwrap().fill(4.0);
    slow_fill(&s, &k, &busy, 1.0).unwrap();
    s.copy_from_host(cpin.as_slice().unwrap(), &dst).unwrap();
    cpin.as_mut_slice().unwrap().fill(9.0);
    assert!(s.to_vec(&dst).unwrap().iter().all(|&v| v == 4.0));

    // Pageable memory, which the driver stages before the call returns.
    let mut host = vec![5.0f32; N];
    slow_fill(&s, &k, &busy, 1.0).unwrap();
    s.copy_from_host(&host, &dst).unwrap();
    host.fill(9.0);
    assert!(s.to_vec(&dst).unwrap().iter().all(|&v| v == 5.0));

    // And back into page-locked memory: filled when the call returns.
    slow_fill(&s, &k, &busy, 6.0).unwrap();
    s.copy(&busy, &dst).unwrap();
    s.copy_to_host(&dst, pinned.as_mut_slice()).unwrap();
    assert!(pinned.as_slice().iter().all(|&v| v == 6.0));
}

/// External memory that says when it was released.
struct Released(Arc<AtomicBool>, #[allow(dead_code)] DeviceBuffer<f32>);

impl Drop for Released {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn misuse_dropping_an_external_buffer_on_a_capturing_thread_does_not_spin() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let other = dev.new_stream().unwrap();
    let base = s.alloc_zeroed::<f32>(N).unwrap();
    s.synchronize().unwrap();
    let released = Arc::new(AtomicBool::new(false));
    let addr = base.addr();
    // SAFETY: [addr, addr + 4N) is `base`'s memory; the keep-alive holds an alias of `base`,
    // so it stays allocated until the keep-alive is dropped; nothing else writes it here.
    let block = unsafe {
        BlockRef::external(
            addr,
            4 * N,
            dev.ordinal(),
            Box::new(Released(released.clone(), base.alias())),
        )
    };
    drop(base);
    let ext = DeviceBuffer::<f32>::from_block(block, N).unwrap();
    // Used on a stream: its release waits for that stream's work (a fence).
    slow_fill(&other, &k, &ext, 2.0).unwrap();
    let y = s.alloc_zeroed::<f32>(N).unwrap();
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let r = Graph::capture(&mut s, CaptureOptions::new(), move |cs| {
            cs.memset_zero(&y)?;
            // This thread is capturing: it may not wait for (or even ask about) the fence.
            drop(ext);
            Ok(())
        });
        let _ = tx.send(r.map(|(g, ())| g).map(|g| (g, s)));
    });
    let (g, s) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("dropping the buffer inside the capture hung")
        .unwrap();
    worker.join().unwrap();
    // Released once the other stream's work is done, by a later drop or allocation.
    other.synchronize().unwrap();
    let t = s.alloc::<f32>(1).unwrap();
    drop(t);
    assert!(
        released.load(Ordering::SeqCst),
        "the deferred release never ran"
    );
    g.replay(&s).unwrap();
    s.synchronize().unwrap();
}
