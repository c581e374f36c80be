//! GPU tests of side branches ([`Fork::fork`], [`SideStream`]): ordering eagerly and inside a
//! capture, a parallel branch in the graph, side allocations from the capture's pool kept by
//! the graph, and the side stream's state after a capture that succeeded or failed. A slow
//! kernel (it spins before writing) makes a missing fork or join edge visible as wrong values.

use cudagraph::*;

const SRC: &str = r#"
extern "C" __global__ void slow_scale(float* x, float a, long long cycles, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    if (i < n) x[i] = a * x[i];
}
extern "C" __global__ void add_const(float* x, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b;
}
"#;

struct K {
    slow_scale: Function,
    add_const: Function,
}

fn kernels(dev: &Device) -> K {
    let m = dev.compile("gpu_fork_tests", SRC).expect("compiles");
    K {
        slow_scale: m.function("slow_scale").unwrap(),
        add_const: m.function("add_const").unwrap(),
    }
}

const N: usize = 4096;
/// About a millisecond at H100/H200 clocks: far longer than the launches around it.
const SPIN: i64 = 2_000_000;

fn slow_scale(q: &dyn Queue, k: &K, x: &DeviceBuffer<f32>, a: f32) -> Result<()> {
    // SAFETY: the kernel touches x[0..n) with n = x.len().
    unsafe {
        q.launch(
            &k.slow_scale,
            LaunchConfig::for_elements(x.len(), 256),
            args![x, a, SPIN, x.len() as i32],
        )
    }
}

fn add_const(q: &dyn Queue, k: &K, x: &DeviceBuffer<f32>, b: f32) -> Result<()> {
    // SAFETY: the kernel touches x[0..n) with n = x.len().
    unsafe {
        q.launch(
            &k.add_const,
            LaunchConfig::for_elements(x.len(), 256),
            args![x, b, x.len() as i32],
        )
    }
}

/// fill 1 (main) -> x3, slowly (side) -> +1 (main): 4 only if both edges hold; a missing fork
/// edge gives 1 (the side read zeros), a missing join edge gives 4 only by luck after 2 or 6.
fn fork_join_step(
    q: &dyn Fork,
    side: &mut Stream,
    k: &K,
    x: &DeviceBuffer<f32>,
    y: &DeviceBuffer<f32>,
) -> Result<()> {
    q.fill32(x, 0, x.len(), 1.0f32)?;
    let branch = q.fork(side)?;
    slow_scale(&branch, k, x, 3.0)?;
    // Independent work on the main stream runs beside the branch.
    add_const(q.as_queue(), k, y, 1.0)?;
    branch.join()?;
    add_const(q.as_queue(), k, x, 1.0)
}

#[test]
fn eager_fork_orders_the_branch_between_fork_and_join() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let s = dev.new_stream().unwrap();
    let mut side = dev.new_stream().unwrap();
    let x = s.alloc_zeroed::<f32>(N).unwrap();
    let y = s.alloc_zeroed::<f32>(N).unwrap();
    for round in 1..=3 {
        fork_join_step(&s, &mut side, &k, &x, &y).unwrap();
        let got = s.to_vec(&x).unwrap();
        assert!(
            got.iter().all(|&v| v == 4.0),
            "round {round}: {:?}",
            &got[..4]
        );
        assert!(s.to_vec(&y).unwrap().iter().all(|&v| v == round as f32));
    }
}

#[test]
fn captured_fork_is_a_parallel_branch_that_replays_right() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let mut side = dev.new_stream().unwrap();
    let x = s.alloc_zeroed::<f32>(N).unwrap();
    let y = s.alloc_zeroed::<f32>(N).unwrap();
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        fork_join_step(cs, &mut side, &k, &x, &y)
    })
    .unwrap();
    // memset + 3 kernels (the event edges are dependencies, not nodes).
    assert_eq!(g.info().nodes.kernel, 3, "{g:?}");
    for round in 1..=5 {
        g.replay(&s).unwrap();
        let got = s.to_vec(&x).unwrap();
        assert!(
            got.iter().all(|&v| v == 4.0),
            "replay {round}: {:?}",
            &got[..4]
        );
        assert!(s.to_vec(&y).unwrap().iter().all(|&v| v == round as f32));
    }
    // The side stream left the capture with it and works eagerly again.
    assert!(!side.driver_is_capturing().unwrap());
    side.fill32(&y, 0, N, 7.0f32).unwrap();
    assert!(side.to_vec(&y).unwrap().iter().all(|&v| v == 7.0));
}

#[test]
fn side_allocations_come_from_the_capture_pool_and_stay_with_the_graph() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let mut side = dev.new_stream().unwrap();
    let out = s.alloc_zeroed::<f32>(N).unwrap();
    let (g, (tmp_addr, main_addr, tmp_pool)) =
        Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            let branch = cs.fork(&mut side)?;
            let tmp = branch.alloc::<f32>(N)?;
            branch.fill32(&tmp, 0, N, 5.0f32)?;
            let (tmp_addr, tmp_pool) = (tmp.addr(), tmp.pool());
            branch.join()?;
            cs.copy(&tmp, &out)?;
            drop(tmp);
            // The branch's block is not handed out again inside the capture.
            let later = cs.alloc::<f32>(N)?;
            cs.memset_zero(&later)?;
            Ok((tmp_addr, later.addr(), tmp_pool))
        })
        .unwrap();
    assert_ne!(tmp_addr, main_addr, "a block the branch used was reused");
    assert_eq!(Some(tmp_pool), g.pool().map(Pool::id));
    for _ in 0..3 {
        s.memset_zero(&out).unwrap();
        g.replay(&s).unwrap();
        assert!(s.to_vec(&out).unwrap().iter().all(|&v| v == 5.0));
    }
}

#[test]
fn a_failed_capture_releases_the_side_stream() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let mut side = dev.new_stream().unwrap();
    let x = s.alloc_zeroed::<f32>(N).unwrap();
    let y = s.alloc_zeroed::<f32>(N).unwrap();
    // The zeroing ran on s; the side stream writes x below without waiting for s (streams
    // are ordered by their user, not by the library): finish it first. (Under
    // compute-sanitizer the zeroing was seen landing after the side stream's fill.)
    s.synchronize().unwrap();
    let r = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        let branch = cs.fork(&mut side)?;
        slow_scale(&branch, &k, &x, 2.0)?;
        Err::<(), _>(Error::InvalidGraph {
            problem: "the closure gave up".into(),
        })
    });
    assert!(matches!(r, Err(Error::CaptureFailed { .. })), "{r:?}");
    assert!(!side.driver_is_capturing().unwrap());
    side.synchronize().unwrap();
    side.fill32(&x, 0, N, 2.0f32).unwrap();
    assert!(side.to_vec(&x).unwrap().iter().all(|&v| v == 2.0));
    // And the same pair of streams captures a fork again.
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        fork_join_step(cs, &mut side, &k, &x, &y)
    })
    .unwrap();
    g.replay(&s).unwrap();
    assert!(s.to_vec(&x).unwrap().iter().all(|&v| v == 4.0));
}

#[test]
fn an_unjoined_branch_is_joined_when_dropped() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let mut side = dev.new_stream().unwrap();
    let x = s.alloc_zeroed::<f32>(N).unwrap();
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        cs.fill32(&x, 0, N, 1.0f32)?;
        {
            let branch = cs.fork(&mut side)?;
            slow_scale(&branch, &k, &x, 3.0)?;
        } // dropped: joins
        add_const(cs, &k, &x, 1.0)
    })
    .unwrap();
    g.replay(&s).unwrap();
    assert!(s.to_vec(&x).unwrap().iter().all(|&v| v == 4.0));
}
