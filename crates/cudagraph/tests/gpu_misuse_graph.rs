//! GPU tests of the rebind and replay audit: each reproduces a call sequence of safe code that
//! used to corrupt memory, or could have, and asserts the typed error (or the right result)
//! and that the stream, the pool and the graph stay usable.
//!
//! 1. `rebind` moves whole blocks and refuses a replacement smaller than what the graph can
//!    reach through the old block (a prefix view as `old` used to turn a 4 MiB memset into a
//!    write past a one-element buffer); interior pointers move with their block; buffers of
//!    the graph's own pool cannot be rebound.
//! 2. `rebind` refuses graphs it cannot read completely (child graphs) and lets go only of the
//!    blocks it moved the graph away from (a block only a child node used, or one a library
//!    declared with `Queue::use_block`, used to be freed).
//! 3. A graph dropped or rebound right after a replay waits for it.
//! 4. A release deferred on a capturing thread waits for the replay that used it, even after a
//!    later replay on another stream records the completion event again.
//!
//! All are named `misuse_*`: `bench/sanitize.sh` skips them (several provoke typed errors on
//! purpose, and the in-flight ones race a slow kernel against the allocator).

use cudagraph::*;

const SRC: &str = r#"
// Spins for `cycles` clock cycles, then writes v to x[0..n): a kernel that finishes late.
extern "C" __global__ void slow_fill(float* x, long n, float v, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        x[i] = v;
}
extern "C" __global__ void add_one(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
extern "C" __global__ void fill(float* x, float v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}
"#;

struct K {
    slow_fill: Function,
    add_one: Function,
    fill: Function,
}

fn kernels(dev: &Device) -> K {
    let m = dev.compile("gpu_misuse_graph", SRC).expect("test kernels");
    let f = |n: &str| m.function(n).unwrap();
    K {
        slow_fill: f("slow_fill"),
        add_one: f("add_one"),
        fill: f("fill"),
    }
}

/// About 50 ms at the H100's clock.
const SLOW: i64 = 100_000_000;

fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig::for_elements(n, 256)
}

fn add_one<Q: Queue + ?Sized>(q: &Q, k: &K, x: &DeviceBuffer<f32>) -> Result<()> {
    // SAFETY: add_one touches x[0..n) with n = x.len().
    unsafe { q.launch(&k.add_one, cfg(x.len()), args![x, x.len() as i32]) }
}

/// Enqueues the slow writer over all of `x` on `q`.
fn slow_fill<Q: Queue + ?Sized>(q: &Q, k: &K, x: &DeviceBuffer<f32>, v: f32) -> Result<()> {
    // SAFETY: slow_fill writes x[0..n) with n = x.len() (grid-stride loop).
    unsafe {
        q.launch(
            &k.slow_fill,
            LaunchConfig::linear(264, 256),
            args![x, x.len() as i64, v, SLOW],
        )
    }
}

// ---- 1. Rebind moves whole blocks -----------------------------------------------------------

#[test]
fn misuse_rebind_onto_a_smaller_buffer_through_a_view_of_the_old_block_is_refused() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let n = 1 << 20; // 4 MiB
    let x = s.alloc_from_host(&vec![1.0f32; n]).unwrap();
    let (mut g, ()) =
        Graph::capture(&mut s, CaptureOptions::new(), |cs| cs.memset_zero(&x)).unwrap();
    let small = s.alloc_from_host(&[7.0f32]).unwrap();
    s.synchronize().unwrap();
    let (allocated, held) = (dev.memory_allocated(), g.held_buffers());
    // A one-element view of x's block, made two ways: same length as `small`, but the graph
    // clears all 4 MiB of the block. Rebinding used to move the memset onto `small` unchanged.
    let views = [
        x.prefix(1).unwrap(),
        DeviceBuffer::from_block(x.block().clone(), 1).unwrap(),
    ];
    for old in &views {
        let e = g.rebind(old, &small).unwrap_err();
        assert!(
            matches!(e, Error::SizeMismatch { expected, got, .. }
                if expected == x.block().size() && got == small.block().size()),
            "{e}"
        );
        assert!(e.to_string().contains("block"), "{e}");
    }
    // Listing the block twice is refused as well.
    let big = s.alloc_zeroed::<f32>(2 * n).unwrap();
    let e = g
        .rebind_all(&[(&x, &big), (&views[0], &big.prefix(1).unwrap())])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidGraph { .. }), "{e}");
    drop(big);
    s.synchronize().unwrap();
    // Nothing changed: same buffers held, same memory, the graph still clears x only.
    assert_eq!(g.held_buffers(), held);
    assert_eq!(dev.memory_allocated(), allocated);
    assert_eq!(g.rebind_counts(), (0, 0));
    g.replay(&s).unwrap();
    assert!(s.to_vec(&x).unwrap().iter().all(|&v| v == 0.0));
    assert_eq!(s.to_vec(&small).unwrap(), vec![7.0]);
    // A replacement as large as the whole block is accepted, through a view too: the graph
    // now clears y (all of it) and leaves x alone.
    let y = s.alloc_from_host(&vec![2.0f32; n]).unwrap();
    s.copy_from_host(&vec![3.0f32; n], &x).unwrap();
    g.rebind(&views[0], &y.prefix(1).unwrap()).unwrap();
    g.replay(&s).unwrap();
    assert!(s.to_vec(&y).unwrap().iter().all(|&v| v == 0.0));
    assert!(s.to_vec(&x).unwrap().iter().all(|&v| v == 3.0));
    assert_eq!(g.held_buffers(), held, "x was let go, y is held");
}

#[test]
fn misuse_rebind_moves_interior_pointers_with_their_block() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let (n, at, m) = (4096usize, 1000usize, 64usize);
    let x = s.alloc_zeroed::<f32>(n).unwrap();
    let (mut g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        let inner = Arg::Ptr {
            addr: x.addr_at(at)?,
            holder: Some(x.block()),
        };
        // SAFETY: fill writes m elements from x[at], and at + m <= x.len().
        unsafe { cs.launch(&k.fill, cfg(m), &[inner, 5.0f32.into(), (m as i32).into()]) }
    })
    .unwrap();
    let y = s.alloc_zeroed::<f32>(n).unwrap();
    // `old` is a one-element view: the pointer at element 1000 lies outside it but inside its
    // block, and moves with the block (it used to stay on x).
    g.rebind(&x.prefix(1).unwrap(), &y.prefix(1).unwrap())
        .unwrap();
    g.replay(&s).unwrap();
    let (xv, yv) = (s.to_vec(&x).unwrap(), s.to_vec(&y).unwrap());
    assert!(xv.iter().all(|&v| v == 0.0), "x is no longer written");
    for (i, &v) in yv.iter().enumerate() {
        let want = if (at..at + m).contains(&i) { 5.0 } else { 0.0 };
        assert_eq!(v, want, "y[{i}]");
    }
}

#[test]
fn misuse_rebinding_a_buffer_of_the_graphs_own_pool_is_refused() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    // A temporary of 128 Ki floats, freed inside the capture, and a one-element output that
    // the pool places at the same address: the graph clears 512 KiB at the output's address.
    let (mut g, out) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        let t = cs.alloc::<f32>(128 * 1024)?;
        cs.memset_zero(&t)?;
        drop(t);
        let out = cs.alloc::<f32>(1)?;
        cs.memset_zero(&out)?;
        Ok(out)
    })
    .unwrap();
    let fresh = s.alloc_from_host(&[9.0f32]).unwrap();
    s.synchronize().unwrap();
    let allocated = dev.memory_allocated();
    let e = g.rebind(&out, &fresh).unwrap_err();
    assert!(matches!(e, Error::NotSupported { .. }), "{e}");
    assert!(e.to_string().contains("own pool"), "{e}");
    assert_eq!(dev.memory_allocated(), allocated);
    s.copy_from_host(&[4.0f32], &out).unwrap();
    g.replay(&s).unwrap();
    assert_eq!(s.to_vec(&out).unwrap(), vec![0.0]);
    assert_eq!(s.to_vec(&fresh).unwrap(), vec![9.0], "fresh untouched");
}

// ---- 2. Rebind releases only what it proved unused ----------------------------------------

#[test]
fn misuse_rebind_refuses_a_graph_with_a_child_graph_node() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let n = 1024;
    let x = s.alloc_zeroed::<f32>(n).unwrap();
    let y = s.alloc_zeroed::<f32>(n).unwrap();
    let (child, ()) =
        Graph::capture(&mut s, CaptureOptions::new(), |cs| add_one(cs, &k, &x)).unwrap();
    let mut b = GraphBuilder::new(&dev);
    let c = b.child(&child, &[]).unwrap();
    b.fill32(&y, 0, n, 3.0f32, &[c]).unwrap();
    let mut g = b.build().unwrap();
    drop(child);
    g.replay(&s).unwrap();
    let y2 = s.alloc_zeroed::<f32>(n).unwrap();
    s.synchronize().unwrap();
    let (allocated, held) = (dev.memory_allocated(), g.held_buffers());
    // x is used only inside the child node: rebind used to let go of it.
    let e = g.rebind(&y, &y2).unwrap_err();
    assert!(matches!(e, Error::NotSupported { .. }), "{e}");
    assert!(e.to_string().contains("child-graph"), "{e}");
    assert_eq!(g.held_buffers(), held);
    assert_eq!(dev.memory_allocated(), allocated);
    assert_eq!(g.rebind_counts(), (0, 0));
    // The graph is unchanged and still runs: x incremented again, y filled, y2 untouched.
    s.copy_from_host(&vec![0.0f32; n], &y).unwrap();
    g.replay(&s).unwrap();
    assert!(s.to_vec(&x).unwrap().iter().all(|&v| v == 2.0));
    assert!(s.to_vec(&y).unwrap().iter().all(|&v| v == 3.0));
    assert!(s.to_vec(&y2).unwrap().iter().all(|&v| v == 0.0));
}

#[test]
fn misuse_rebind_keeps_blocks_declared_with_use_block() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let n = 16 * 1024;
    let x = s.alloc_zeroed::<f32>(n).unwrap();
    // z stands for a buffer a library reaches through device memory: declared, never an
    // argument the rewrite can see.
    let z = s.alloc_zeroed::<f32>(n).unwrap();
    let (mut g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        cs.use_block(z.block());
        add_one(cs, &k, &x)
    })
    .unwrap();
    assert_eq!(g.held_buffers(), 2);
    g.replay(&s).unwrap();
    let x2 = s.alloc_zeroed::<f32>(n).unwrap();
    g.rebind(&x, &x2).unwrap();
    assert_eq!(g.held_buffers(), 2, "x2 and z (x was let go)");
    // Rebinding z, which no node refers to directly, moves nothing and keeps it.
    let z2 = s.alloc_zeroed::<f32>(n).unwrap();
    assert_eq!(
        g.rebind(&z, &z2).unwrap(),
        RebindOutcome::Updated { nodes: 0 }
    );
    assert_eq!(g.held_buffers(), 2);
    drop(z2);
    g.replay(&s).unwrap();
    s.synchronize().unwrap();
    let before = dev.memory_allocated();
    drop(z);
    assert_eq!(dev.memory_allocated(), before, "the graph still holds z");
    drop(x);
    assert!(
        dev.memory_allocated() < before,
        "x was let go by the graph, so dropping it frees it"
    );
    // One replay before the rebind (on x), one after (on x2).
    assert!(s.to_vec(&x2).unwrap().iter().all(|&v| v == 1.0));
}

// ---- 3. Drop and rebind wait for the replay -----------------------------------------------

#[test]
fn misuse_rebind_and_drop_right_after_a_slow_replay_wait_for_it() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let other = dev.new_stream().unwrap();
    let n = 64 * 1024;
    let x = s.alloc_zeroed::<f32>(n).unwrap();
    let (mut g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        slow_fill(cs, &k, &x, 1.0)
    })
    .unwrap();
    let y = s.alloc_zeroed::<f32>(n).unwrap();
    s.synchronize().unwrap();
    let base = dev.memory_allocated();
    // The replay runs on another stream than x's own, so only the graph's completion event
    // orders x's reuse on `s` after it.
    g.replay(&other).unwrap();
    g.rebind(&x, &y).unwrap();
    drop(x); // the rebind let go of x after waiting for the replay: this frees it
    let fresh = s.alloc_zeroed::<f32>(n).unwrap(); // may be x's block again
    s.synchronize().unwrap();
    other.synchronize().unwrap();
    assert!(
        s.to_vec(&fresh).unwrap().iter().all(|&v| v == 0.0),
        "the slow replay wrote into a block handed out again"
    );
    g.replay(&other).unwrap();
    drop(g); // waits for the replay
    drop(y);
    let again = s.alloc_zeroed::<f32>(n).unwrap(); // may be y's block
    s.synchronize().unwrap();
    other.synchronize().unwrap();
    assert!(s.to_vec(&again).unwrap().iter().all(|&v| v == 0.0));
    drop((fresh, again));
    assert!(dev.memory_allocated() <= base);
}

// ---- 4. Deferred releases wait for the replays that used them -----------------------------

#[test]
fn misuse_a_release_deferred_on_a_capturing_thread_waits_for_the_replay_that_used_it() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let (a, b) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let mut c = dev.new_stream().unwrap();
    let n = 64 * 1024;
    let x = s.alloc_zeroed::<f32>(n).unwrap();
    let (mut g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        slow_fill(cs, &k, &x, 1.0)
    })
    .unwrap();
    let y = s.alloc_zeroed::<f32>(n).unwrap();
    let z = c.alloc_zeroed::<f32>(16).unwrap();
    s.synchronize().unwrap();
    c.synchronize().unwrap();
    let (full, x_block) = (dev.memory_allocated(), x.block().size());
    g.replay(&a).unwrap(); // R1: writes x late
                           // Rebind inside another capture on this thread: waiting is not allowed there, so the
                           // release of x is deferred behind the graph's completion event.
    let (other, ()) = Graph::capture(&mut c, CaptureOptions::new(), |cs| {
        g.rebind(&x, &y)?;
        drop(x);
        cs.memset_zero(&z)
    })
    .unwrap();
    // R2 on another stream records the completion event again; the deferred release must
    // still wait for R1, and the drains below (each replay drains) must not free x early.
    g.replay(&b).unwrap();
    other.replay(&c).unwrap();
    let fresh = s.alloc_zeroed::<f32>(n).unwrap(); // must not be x's block while R1 runs
    other.replay(&c).unwrap();
    let fresh2 = s.alloc_zeroed::<f32>(n).unwrap();
    s.synchronize().unwrap();
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    c.synchronize().unwrap();
    for f in [&fresh, &fresh2] {
        assert!(
            s.to_vec(f).unwrap().iter().all(|&v| v == 0.0),
            "R1 wrote into a block handed out again"
        );
    }
    assert!(
        s.to_vec(&y).unwrap().iter().all(|&v| v == 1.0),
        "R2 wrote y"
    );
    assert_eq!(g.held_buffers(), 1, "y only");
    // Everything settles: once the replays are done and a drain ran (every replay drains),
    // x is freed.
    drop((fresh, fresh2));
    other.replay(&c).unwrap();
    c.synchronize().unwrap();
    assert_eq!(dev.memory_allocated(), full - x_block);
}
