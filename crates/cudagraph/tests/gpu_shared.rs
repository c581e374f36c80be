//! GPU tests of graphs that share memory and streams (issue 26, items 1–5): graphs of one pool
//! replayed on two streams never overlap (and graphs of separate pools still do), what a graph
//! writes stays the graph's after the caller drops it, device-side check reports go to the
//! stream that ran the failing work and none is lost, allocator entry points take a stream of
//! the allocator's device, and a graph whose last replay cannot be waited for keeps its memory.

use std::sync::{mpsc, Arc, Barrier};
use std::time::Duration;

use cudagraph::*;

const SRC: &str = r#"
// Writes v to t[0..n), spins for `cycles`, then copies t into out: a temporary that must stay
// untouched for the whole kernel.
extern "C" __global__ void write_wait_copy(float* t, float* out, long n, float v, long long cycles) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        t[i] = v;
    __threadfence();
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = t[i];
}
// Spins for `cycles`, then writes v to x[0..n).
extern "C" __global__ void slow_fill(float* x, long n, float v, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        x[i] = v;
}
// Waits (up to `cycles`) for *flag to become 1; writes 1 to *seen if it did.
extern "C" __global__ void wait_flag(volatile unsigned int* flag, unsigned int* seen, long long cycles) {
    long long t0 = clock64();
    unsigned int got = 0;
    while (clock64() - t0 < cycles) { if (*flag == 1u) { got = 1u; break; } }
    *seen = got;
}
extern "C" __global__ void set_flag(volatile unsigned int* flag) { *flag = 1u; __threadfence_system(); }
"#;

const CHECK_SRC: &str = r#"
// Reports idx >= bound through the device-side check record.
extern "C" __global__ void check_index(cg_check* chk, unsigned int id, long long idx, long long bound) {
    if (idx >= bound) cg_report(chk, id, idx, bound, (unsigned long long)threadIdx.x);
}
"#;

struct K {
    write_wait_copy: Function,
    slow_fill: Function,
    wait_flag: Function,
    set_flag: Function,
    check_index: Function,
}

fn kernels(dev: &Device) -> K {
    let m = dev.compile("gpu_shared", SRC).expect("test kernels");
    let c = dev
        .compile(
            "gpu_shared_check",
            &format!("{DEVICE_CHECK_CUDA}\n{CHECK_SRC}"),
        )
        .expect("check kernel");
    K {
        write_wait_copy: m.function("write_wait_copy").unwrap(),
        slow_fill: m.function("slow_fill").unwrap(),
        wait_flag: m.function("wait_flag").unwrap(),
        set_flag: m.function("set_flag").unwrap(),
        check_index: c.function("check_index").unwrap(),
    }
}

const N: usize = 1 << 16;
/// About 5 ms at H100/H200 clocks: long enough for two streams' kernels to overlap.
const SPIN: i64 = 10_000_000;
/// About 100 ms.
const LONG: i64 = 200_000_000;

fn write_wait_copy(
    q: &dyn Queue,
    k: &K,
    t: &DeviceBuffer<f32>,
    out: &DeviceBuffer<f32>,
    v: f32,
) -> Result<()> {
    assert_eq!(t.len(), out.len());
    // SAFETY: the kernel touches t[0..n) and out[0..n), n = both lengths (grid-stride).
    unsafe {
        q.launch(
            &k.write_wait_copy,
            LaunchConfig::linear(264, 256),
            args![t, out, t.len() as i64, v, SPIN],
        )
    }
}

fn slow_fill(q: &dyn Queue, k: &K, x: &DeviceBuffer<f32>, v: f32, cycles: i64) -> Result<()> {
    // SAFETY: slow_fill writes x[0..n) with n = x.len() (grid-stride).
    unsafe {
        q.launch(
            &k.slow_fill,
            LaunchConfig::linear(132, 256),
            args![x, x.len() as i64, v, cycles],
        )
    }
}

fn check_index(q: &dyn Queue, k: &K, id: u32, idx: i64, bound: i64) -> Result<()> {
    let chk = q.check_flag_arg()?;
    // SAFETY: the kernel only writes the check record `chk` (the queue's own).
    unsafe {
        q.launch(
            &k.check_index,
            LaunchConfig::linear(1, 32),
            &[chk, Arg::U32(id), Arg::I64(idx), Arg::I64(bound)],
        )
    }
}

/// A graph of `pool` whose temporary (freed inside the capture, so shared with the pool's
/// later captures) holds `v` for a few milliseconds before it is copied to `out`. Returns the
/// graph and the temporary's address.
fn temp_graph(s: &mut Stream, k: &K, pool: &Pool, out: &DeviceBuffer<f32>, v: f32) -> (Graph, u64) {
    Graph::capture(s, CaptureOptions::new().pool(pool), |cs| {
        let t = cs.alloc::<f32>(N)?;
        write_wait_copy(cs, k, &t, out, v)?;
        Ok(t.addr())
    })
    .unwrap()
}

// ---- Item 1: graphs of one pool never overlap ------------------------------------------------

#[test]
fn two_graphs_sharing_a_pool_replayed_on_two_streams_at_once_never_overlap() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let pool = dev.graph_pool_handle();
    let out_a = s.alloc_zeroed::<f32>(N).unwrap();
    let out_b = s.alloc_zeroed::<f32>(N).unwrap();
    let (a, ta) = temp_graph(&mut s, &k, &pool, &out_a, 1.0);
    let (b, tb) = temp_graph(&mut s, &k, &pool, &out_b, 2.0);
    assert_eq!(
        ta, tb,
        "the second capture reuses the first one's temporary"
    );
    s.synchronize().unwrap();
    for round in 0..30 {
        a.replay(&s1).unwrap();
        b.replay(&s2).unwrap();
        let (ga, gb) = (s1.to_vec(&out_a).unwrap(), s2.to_vec(&out_b).unwrap());
        assert!(
            ga.iter().all(|&v| v == 1.0),
            "round {round}: A read B's temporary"
        );
        assert!(
            gb.iter().all(|&v| v == 2.0),
            "round {round}: B read A's temporary"
        );
        // Alternate which stream goes first.
        b.replay(&s1).unwrap();
        a.replay(&s2).unwrap();
        let (ga, gb) = (s2.to_vec(&out_a).unwrap(), s1.to_vec(&out_b).unwrap());
        assert!(
            ga.iter().all(|&v| v == 1.0),
            "round {round}: A read B's temporary"
        );
        assert!(
            gb.iter().all(|&v| v == 2.0),
            "round {round}: B read A's temporary"
        );
    }
}

#[test]
fn graphs_of_separate_pools_still_replay_concurrently() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let flag = s.alloc_zeroed::<u32>(1).unwrap();
    let seen = s.alloc_zeroed::<u32>(1).unwrap();
    let (waiter, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        // SAFETY: wait_flag reads flag[0] and writes seen[0].
        unsafe {
            cs.launch(
                &k.wait_flag,
                LaunchConfig::linear(1, 1),
                args![&flag, &seen, LONG],
            )
        }
    })
    .unwrap();
    let (setter, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        // SAFETY: set_flag writes flag[0].
        unsafe { cs.launch(&k.set_flag, LaunchConfig::linear(1, 1), args![&flag]) }
    })
    .unwrap();
    assert_ne!(waiter.pool().unwrap().id(), setter.pool().unwrap().id());
    s.synchronize().unwrap();
    waiter.replay(&s1).unwrap();
    setter.replay(&s2).unwrap();
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    assert_eq!(
        s.to_vec(&seen).unwrap(),
        vec![1],
        "the second graph waited for the first although they share no memory"
    );
}

#[test]
fn a_replay_on_another_stream_is_ordered_after_the_pools_last_replay() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let pool = dev.graph_pool_handle();
    let x = s.alloc_zeroed::<f32>(N).unwrap();
    let (fill, ()) = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        slow_fill(cs, &k, &x, 3.0, SPIN)
    })
    .unwrap();
    let y = s.alloc_zeroed::<f32>(N).unwrap();
    let (copy, ()) = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        cs.copy(&x, &y)
    })
    .unwrap();
    s.synchronize().unwrap();
    // The copy graph replayed on another stream right after the slow fill sees its result:
    // the pool orders it after the fill's stream (the two graphs share nothing else).
    fill.replay(&s1).unwrap();
    copy.replay(&s2).unwrap();
    assert!(s2.to_vec(&y).unwrap().iter().all(|&v| v == 3.0));
}

// ---- Item 2: what a graph writes stays the graph's -------------------------------------------

#[test]
fn a_graphs_output_is_not_handed_to_a_later_capture_after_the_caller_drops_it() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let pool = dev.graph_pool_handle();
    let (a, out_a) = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        let out = cs.alloc::<f32>(N)?;
        slow_fill(cs, &k, &out, 1.0, 0)?;
        Ok(out)
    })
    .unwrap();
    let a_addr = out_a.addr();
    assert!(a.owned_bytes() >= N * 4, "{}", a.owned_bytes());
    drop(out_a);
    let (b, out_b) = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        let out = cs.alloc::<f32>(N)?;
        slow_fill(cs, &k, &out, 2.0, 0)?;
        Ok(out)
    })
    .unwrap();
    assert_ne!(out_b.addr(), a_addr, "B got the block A still writes");
    for order in 0..4 {
        if order % 2 == 0 {
            b.replay(&s).unwrap();
            a.replay(&s).unwrap();
        } else {
            a.replay(&s).unwrap();
            b.replay(&s).unwrap();
        }
        assert!(
            s.to_vec(&out_b).unwrap().iter().all(|&v| v == 2.0),
            "order {order}: A overwrote B's output"
        );
    }
    // Once A is gone, its block is free for the pool again.
    drop(a);
    let (_c, out_c) = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        let out = cs.alloc::<f32>(N)?;
        cs.memset_zero(&out)?;
        Ok(out)
    })
    .unwrap();
    assert_eq!(out_c.addr(), a_addr, "A's block returns to the pool with A");
}

// ---- Item 5: device-side checks per stream, none lost ----------------------------------------

#[test]
fn a_failed_check_is_reported_to_the_stream_that_ran_it_and_never_to_another() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let id = register_check("gpu_shared index");
    let (a, b) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    check_index(&a, &k, id, 7, 3).unwrap();
    check_index(&b, &k, id, 1, 3).unwrap();
    b.synchronize().expect("B ran no failing check");
    match a.synchronize() {
        Err(Error::DeviceCheck {
            check,
            value,
            bound,
            ..
        }) => {
            assert_eq!(check, "gpu_shared index");
            assert_eq!((value, bound), (7, 3));
        }
        other => panic!("A's failure was not reported to A: {other:?}"),
    }
    a.synchronize().expect("taken once");
    // The next failure right after is reported as well (nothing to re-arm).
    check_index(&a, &k, id, 9, 3).unwrap();
    assert!(matches!(
        a.synchronize(),
        Err(Error::DeviceCheck { value: 9, .. })
    ));
    // Device::synchronize sees every stream's.
    check_index(&b, &k, id, 11, 3).unwrap();
    assert!(matches!(
        dev.synchronize(),
        Err(Error::DeviceCheck { value: 11, .. })
    ));
    b.synchronize().expect("taken by the device-wide report");
}

#[test]
fn threads_each_get_exactly_their_own_check_reports() {
    let dev = gpu_test_device!();
    let k = Arc::new(kernels(&dev));
    let id = register_check("gpu_shared thread");
    let go = Arc::new(Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (dev, k, go) = (dev.clone(), k.clone(), go.clone());
            std::thread::spawn(move || {
                let s = dev.new_stream().unwrap();
                go.wait();
                for i in 0..200i64 {
                    let fail = (i + t) % 3 == 0;
                    let idx = if fail { 1000 + t } else { 0 };
                    check_index(&s, &k, id, idx, 10).unwrap();
                    match s.synchronize() {
                        Err(Error::DeviceCheck { value, .. }) => {
                            assert!(fail, "thread {t} step {i}: another thread's report");
                            assert_eq!(value, 1000 + t, "thread {t} step {i}");
                        }
                        Ok(()) => assert!(!fail, "thread {t} step {i}: report lost"),
                        Err(e) => panic!("{e}"),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn a_graphs_check_is_reported_by_the_stream_it_was_replayed_on() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let id = register_check("gpu_shared graph");
    let mut s = dev.new_stream().unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        check_index(cs, &k, id, 5, 2)
    })
    .unwrap();
    g.replay(&s1).unwrap();
    s2.synchronize().expect("s2 replayed nothing");
    assert!(matches!(
        s1.synchronize(),
        Err(Error::DeviceCheck { value: 5, .. })
    ));
    // Every replay reports again, on whichever stream it ran.
    assert!(matches!(
        g.replay_checked(&s2),
        Err(Error::DeviceCheck { value: 5, .. })
    ));
    s1.synchronize().expect("already taken");
}

// ---- Item 5: allocator entry points take a stream of the allocator's device --------------------

#[test]
fn allocator_entry_points_take_a_stream_and_refuse_graph_pools() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let alloc = dev.allocator().clone();
    let b = alloc.allocate_block(4096, s.stream_handle()).unwrap();
    let buf = DeviceBuffer::<f32>::from_block(b, 1024).unwrap();
    s.memset_zero(&buf).unwrap();
    assert!(s.to_vec(&buf).unwrap().iter().all(|&v| v == 0.0));
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        let t = cs.alloc::<f32>(16)?;
        cs.memset_zero(&t)
    })
    .unwrap();
    let pool = g.pool().unwrap().id();
    let r = alloc.allocate(64, pool, s.stream_handle());
    assert!(matches!(r, Err(Error::InvalidGraph { .. })), "{r:?}");
}

#[test]
#[ignore = "needs two GPUs"]
fn misuse_an_allocation_on_a_stream_of_another_device_is_refused() {
    let dev = gpu_test_device!();
    let other = Device::open(1).expect("a second GPU");
    let s = other.new_stream().unwrap();
    let r = dev.allocator().allocate_block(4096, s.stream_handle());
    assert!(matches!(r, Err(Error::WrongDevice { .. })), "{r:?}");
}

// ---- Item 5: a graph whose last replay cannot be waited for keeps its memory ----------------

#[test]
fn misuse_dropping_a_graph_while_another_thread_captures_globally_keeps_its_memory() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let s1 = dev.new_stream().unwrap();
    let x = s.alloc_zeroed::<f32>(N).unwrap();
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        slow_fill(cs, &k, &x, 7.0, LONG)
    })
    .unwrap();
    s.synchronize().unwrap();
    drop(x); // the graph holds it
             // Replayed on another stream than the one that allocated x: if x were freed now, the next
             // allocation on `s` would get it back at once, unordered with the running replay.
    g.replay(&s1).unwrap();
    // Another thread holds a global-mode capture open while this one drops the graph.
    let (ready_tx, ready_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let dev2 = dev.clone();
    let capturer = std::thread::spawn(move || {
        let mut c = dev2.new_stream().unwrap();
        let t = c.alloc_zeroed::<f32>(16).unwrap();
        c.synchronize().unwrap();
        Graph::capture(
            &mut c,
            CaptureOptions::new().mode(CaptureMode::Global),
            |cs| {
                cs.memset_zero(&t)?;
                ready_tx.send(()).unwrap();
                let _ = done_rx.recv_timeout(Duration::from_secs(10));
                Ok(())
            },
        )
        .map(drop)
    });
    ready_rx.recv().unwrap();
    drop(g);
    done_tx.send(()).unwrap();
    let _ = capturer.join().unwrap();
    let y = s.alloc_from_host(&vec![5.0f32; N]).unwrap();
    s1.synchronize().unwrap();
    let got = s.to_vec(&y).unwrap();
    assert!(
        got.iter().all(|&v| v == 5.0),
        "a buffer the dropped graph still wrote was handed out again"
    );
}
