//! GPU tests of the core: capture and replay against eager runs of the same kernels, shared
//! pools, memory statistics, failed captures, keep-alive, long replay loops, static I/O, the
//! explicit builder and typed errors. Each test starts with the GPU gate: without a device it
//! prints `skipped: no CUDA device`, or fails when `CUDAGRAPH_REQUIRE_GPU=1`.

use cudagraph::testing::assert_bits_eq;
use cudagraph::*;

const SRC: &str = r#"
extern "C" __global__ void axpb(float* x, float a, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = a * x[i] + b;
}
extern "C" __global__ void add(const float* x, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + y[i];
}
extern "C" __global__ void scale_into(const float* x, float* out, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * x[i];
}
"#;

struct K {
    axpb: Function,
    add: Function,
    scale_into: Function,
}

fn kernels(dev: &Device) -> K {
    let m = dev
        .compile("gpu_core_tests", SRC)
        .expect("test kernels compile");
    K {
        axpb: m.function("axpb").unwrap(),
        add: m.function("add").unwrap(),
        scale_into: m.function("scale_into").unwrap(),
    }
}

fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig::for_elements(n, 256)
}

fn input(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 1000) as f32 / 500.0
                - 1.0
        })
        .collect()
}

/// The chain every test uses: x <- a_k * x + b_k for k in 0..steps.
fn chain<Q: Queue>(q: &Q, k: &K, x: &DeviceBuffer<f32>, steps: usize) -> Result<()> {
    for s in 0..steps {
        let (a, b) = (1.0 + 0.01 * (s % 7) as f32, 0.001 * s as f32);
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { q.launch(&k.axpb, cfg(x.len()), args![x, a, b, x.len() as i32])? };
    }
    Ok(())
}

fn chain_ref(x: &[f32], steps: usize) -> Vec<f64> {
    x.iter()
        .map(|&v| {
            let mut v = v as f64;
            for s in 0..steps {
                let (a, b) = (1.0 + 0.01 * (s % 7) as f32, 0.001 * s as f32);
                v = a as f64 * v + b as f64;
            }
            v
        })
        .collect()
}

/// Largest relative error: f32 arithmetic over tens of steps lands far under 1e-5.
fn max_rel(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            assert!(g.is_finite(), "non-finite output");
            (g as f64 - w).abs() / w.abs().max(1.0)
        })
        .fold(0.0, f64::max)
}

#[test]
fn replay_equals_eager_for_a_kernel_chain() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let n = 10_000;
    let x0 = input(n, 1);
    // Eager.
    let xe = s.alloc_from_host(&x0).unwrap();
    chain(&s, &k, &xe, 50).unwrap();
    let eager = s.to_vec(&xe).unwrap();
    // Graph: same code on the capture stream.
    let xg = s.alloc_from_host(&x0).unwrap();
    let (g, ()) =
        Graph::capture(&mut s, CaptureOptions::new(), |cs| chain(cs, &k, &xg, 50)).unwrap();
    assert_eq!(g.info().nodes.kernel, 50);
    // Capturing ran nothing.
    assert_eq!(s.to_vec(&xg).unwrap(), x0);
    g.replay(&s).unwrap();
    let replayed = s.to_vec(&xg).unwrap();
    assert_bits_eq(&replayed, &eager, "graph replay vs eager");
    assert!(max_rel(&replayed, &chain_ref(&x0, 50)) < 1e-5);
    // A second replay applies the chain again.
    g.replay(&s).unwrap();
    let twice = s.to_vec(&xg).unwrap();
    let want: Vec<f64> = chain_ref(&replayed, 50);
    assert!(max_rel(&twice, &want) < 1e-5);
    assert_eq!(g.replays(), 2);
}

#[test]
fn two_graphs_sharing_a_pool_replay_correctly_in_order() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let pool = dev.graph_pool_handle();
    let n = 4096;
    let x = s.alloc_from_host(&input(n, 2)).unwrap();
    // Graph 1: tmp = 2x (temporary, freed inside the capture), y = tmp + x.
    let (g1, y) = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        let tmp = cs.alloc::<f32>(n)?;
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&k.scale_into, cfg(n), args![&x, &tmp, 2.0f32, n as i32])? };
        let y = cs.alloc::<f32>(n)?;
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&k.add, cfg(n), args![&tmp, &x, &y, n as i32])? };
        Ok(y)
    })
    .unwrap();
    // Graph 2, same pool: reuses graph 1's freed temporary; z = 0.5 y.
    let (g2, z) = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        let tmp = cs.alloc::<f32>(n)?;
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&k.scale_into, cfg(n), args![&y, &tmp, 0.5f32, n as i32])? };
        let z = cs.alloc::<f32>(n)?;
        cs.copy(&tmp, &z)?;
        Ok(z)
    })
    .unwrap();
    assert_eq!(g1.info().memory.pool, pool.id());
    assert_eq!(g2.info().memory.pool, pool.id());
    assert_eq!(
        g2.info().memory.reserved_growth,
        0,
        "graph 2 fits in memory graph 1 already reserved"
    );
    for round in 0..3 {
        let xi = input(n, 10 + round);
        s.copy_from_host(&xi, &x).unwrap();
        g1.replay(&s).unwrap();
        g2.replay(&s).unwrap();
        let (yv, zv) = (s.to_vec(&y).unwrap(), s.to_vec(&z).unwrap());
        let want_y: Vec<f64> = xi.iter().map(|&v| 3.0 * v as f64).collect();
        let want_z: Vec<f64> = want_y.iter().map(|v| 0.5 * v).collect();
        assert!(max_rel(&yv, &want_y) < 1e-6, "round {round}: y");
        assert!(max_rel(&zv, &want_z) < 1e-6, "round {round}: z");
    }
}

#[test]
fn memory_stats_add_up_after_capture_replay_and_drop() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let n = 1 << 16;
    let x = s.alloc_from_host(&input(n, 3)).unwrap();
    let base = dev.memory_stats();
    let (g, out) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        let tmp = cs.alloc::<f32>(n)?; // 256 KiB, freed at the end of the closure
                                       // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&k.scale_into, cfg(n), args![&x, &tmp, 3.0f32, n as i32])? };
        let out = cs.alloc::<f32>(n)?;
        // A kernel, not a copy node, reads the temporary: compute-sanitizer's initcheck checks
        // a copy node's source when the graph is launched, before the kernel that fills it has
        // run, and would report this valid graph (see bench/sanitize.sh).
        // SAFETY: as above, n elements of each buffer.
        unsafe { cs.launch(&k.scale_into, cfg(n), args![&tmp, &out, 1.0f32, n as i32])? };
        Ok(out)
    })
    .unwrap();
    let pool = g.pool().unwrap().clone();
    let m = g.info().memory;
    assert_eq!(
        m.peak_allocated,
        2 * n * 4,
        "temporary and output both live at the peak"
    );
    assert_eq!(m.live_at_end, n * 4, "only the output outlives the capture");
    assert_eq!(
        m.external_held,
        x.block().size(),
        "the graph holds the input"
    );
    assert_eq!(pool.stats().allocated, n * 4);
    let after = dev.memory_stats();
    assert_eq!(after.allocated, base.allocated + n * 4);
    let sum: usize = [PoolId::DEFAULT, pool.id()]
        .iter()
        .map(|p| dev.pool_stats(*p).allocated)
        .sum();
    assert!(sum <= after.allocated);
    for _ in 0..10 {
        g.replay(&s).unwrap();
    }
    s.synchronize().unwrap();
    assert_eq!(
        dev.memory_stats().allocated,
        after.allocated,
        "replay allocates nothing"
    );
    assert_eq!(dev.memory_stats().reserved, after.reserved);
    let pool_reserved = pool.stats().reserved;
    assert!(pool_reserved > 0);
    drop(out);
    drop(g);
    drop(pool);
    // The private pool closed with its last holder: its memory went back to the driver.
    let end = dev.memory_stats();
    assert_eq!(end.allocated, base.allocated);
    assert_eq!(end.reserved, after.reserved - pool_reserved);
    let line = cudagraph::memory::format_memory_line(&end);
    assert!(
        line.starts_with("memory allocated ") && line.contains(" MB, cached "),
        "{line}"
    );
}

#[test]
fn misuse_illegal_call_in_capture_is_a_typed_error_and_the_stream_recovers() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let n = 1024;
    let x = s.alloc_from_host(&input(n, 4)).unwrap();
    let pool = dev.graph_pool_handle();
    let before = pool.stats();
    let err = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        let tmp = cs.alloc::<f32>(n)?;
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&k.scale_into, cfg(n), args![&x, &tmp, 2.0f32, n as i32])? };
        // Synchronising the device while a global-mode capture is open is illegal.
        dev.synchronize()?;
        Ok(())
    })
    .unwrap_err();
    match &err {
        Error::CaptureFailed { at, source } => {
            assert!(
                at.file().ends_with("gpu_core.rs"),
                "names the capture call: {at}"
            );
            // Refused before the driver sees it (the capture gate: this thread's own capture is
            // open), so the capture is not invalidated behind the caller's back.
            match source.as_ref() {
                Error::NotSupported { what, detail } => {
                    assert_eq!(*what, "synchronising the device");
                    assert!(detail.contains("capturing"), "{detail}");
                }
                e => panic!("expected the capture gate's refusal inside, got {e}"),
            }
        }
        e => panic!("expected CaptureFailed, got {e}"),
    }
    assert!(!s.driver_is_capturing().unwrap(), "capture was ended");
    assert_eq!(
        pool.stats().allocated,
        before.allocated,
        "nothing leaked in the pool"
    );
    // The same call behind the library's back, straight to the driver: the driver invalidates
    // the capture, and that too is a typed error.
    let err = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        let tmp = cs.alloc::<f32>(n)?;
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&k.scale_into, cfg(n), args![&x, &tmp, 2.0f32, n as i32])? };
        // SAFETY: no arguments; the device's context is current on this thread. Illegal during
        // capture, which is the point: the driver reports it and invalidates the capture.
        let status = unsafe { cudarc::driver::sys::cuCtxSynchronize() };
        assert_ne!(status, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
        Ok(())
    })
    .unwrap_err();
    assert!(
        matches!(
            &err,
            Error::CaptureInvalidated { .. } | Error::CaptureFailed { .. }
        ),
        "{err}"
    );
    assert!(!s.driver_is_capturing().unwrap(), "capture was ended");
    assert_eq!(
        pool.stats().allocated,
        before.allocated,
        "nothing leaked in the pool"
    );
    // The failed captures ran nothing: the input is as it was.
    assert_bits_eq(
        &s.to_vec(&x).unwrap(),
        &input(n, 4),
        "input after the failed captures",
    );
    // The same stream and pool capture and replay fine afterwards: the eager run's bits.
    let (g, y) = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        let y = cs.alloc::<f32>(n)?;
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&k.scale_into, cfg(n), args![&x, &y, 2.0f32, n as i32])? };
        Ok(y)
    })
    .unwrap();
    g.replay(&s).unwrap();
    let eager = s.alloc::<f32>(n).unwrap();
    // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
    unsafe { s.launch(&k.scale_into, cfg(n), args![&x, &eager, 2.0f32, n as i32]) }.unwrap();
    let got = s.to_vec(&y).unwrap();
    assert_bits_eq(
        &got,
        &s.to_vec(&eager).unwrap(),
        "replay after recovery vs eager",
    );
    let want: Vec<f64> = input(n, 4).iter().map(|&v| 2.0 * v as f64).collect();
    assert!(max_rel(&got, &want) < 1e-6);
}

#[test]
fn failing_closure_or_panic_discards_the_capture() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let x = s.alloc_from_host(&input(256, 5)).unwrap();
    // An invalid launch inside the capture: typed error, capture discarded.
    let err = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe {
            cs.launch(
                &k.axpb,
                LaunchConfig::linear(1, 4096),
                args![&x, 1.0f32, 0.0f32, 256i32],
            )
        }
    })
    .unwrap_err();
    assert!(
        matches!(&err, Error::CaptureFailed { source, .. } if matches!(**source, Error::InvalidLaunch { .. })),
        "{err}"
    );
    assert!(!s.driver_is_capturing().unwrap());
    // A panic inside the closure: the capture is ended by the guard; the stream still works.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = Graph::capture(&mut s, CaptureOptions::new(), |cs| -> Result<()> {
            chain(cs, &k, &x, 3)?;
            panic!("user bug inside capture");
        });
    }));
    assert!(r.is_err());
    assert!(!s.driver_is_capturing().unwrap());
    // Neither discarded capture ran anything, and the stream works: one step of the chain
    // gives what the same step gives on a fresh copy of the input.
    assert_bits_eq(
        &s.to_vec(&x).unwrap(),
        &input(256, 5),
        "input after the failed captures",
    );
    chain(&s, &k, &x, 1).unwrap();
    let fresh = s.alloc_from_host(&input(256, 5)).unwrap();
    chain(&s, &k, &fresh, 1).unwrap();
    assert_bits_eq(
        &s.to_vec(&x).unwrap(),
        &s.to_vec(&fresh).unwrap(),
        "a chain step after the failed captures vs on a fresh copy",
    );
    assert!(max_rel(&s.to_vec(&x).unwrap(), &chain_ref(&input(256, 5), 1)) < 1e-6);
}

#[test]
fn graph_replays_after_every_user_handle_is_dropped() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let n = 2048;
    let x0 = input(n, 6);
    let x = s.alloc_from_host(&x0).unwrap();
    let sink = s.alloc_zeroed::<f32>(n).unwrap();
    let (g, y) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        let y = cs.alloc::<f32>(n)?;
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&k.scale_into, cfg(n), args![&x, &y, 4.0f32, n as i32])? };
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&k.axpb, cfg(n), args![&y, 1.0f32, 1.0f32, n as i32])? };
        cs.copy(&y, &sink)?;
        Ok(y)
    })
    .unwrap();
    let x_addr = x.addr();
    drop(x);
    drop(y);
    // Eager allocations of the same size on the same stream would reuse x's block had the
    // graph not kept it; fill them with garbage.
    let churn: Vec<DeviceBuffer<f32>> = (0..8)
        .map(|_| s.alloc_from_host(&vec![9.0f32; n]).unwrap())
        .collect();
    assert!(
        churn.iter().all(|b| b.addr() != x_addr),
        "the graph holds its input"
    );
    g.replay(&s).unwrap();
    let want: Vec<f64> = x0.iter().map(|&v| 4.0 * v as f64 + 1.0).collect();
    assert!(max_rel(&s.to_vec(&sink).unwrap(), &want) < 1e-6);
    for b in &churn {
        assert!(
            s.to_vec(b).unwrap().iter().all(|&v| v == 9.0),
            "replay wrote into eager memory"
        );
    }
    drop(sink);
    g.replay(&s).unwrap(); // the sink is held by the graph too
    s.synchronize().unwrap();
}

#[test]
fn graph_output_survives_dropping_inputs_and_reads_back_right() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let n = 2048;
    let x0 = input(n, 7);
    let x = s.alloc_from_host(&x0).unwrap();
    let w = s.alloc_from_host(&vec![0.5f32; n]).unwrap();
    let mut sg =
        StaticGraph::<f32, f32>::capture(&mut s, CaptureOptions::new(), &[n], |cs, ins| {
            // out = (in + x) * 1 + w : x and w are eager buffers the graph must keep alive.
            let t = cs.alloc::<f32>(n)?;
            // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
            unsafe { cs.launch(&k.add, cfg(n), args![&ins[0], &x, &t, n as i32])? };
            let out = cs.alloc::<f32>(n)?;
            // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
            unsafe { cs.launch(&k.add, cfg(n), args![&t, &w, &out, n as i32])? };
            Ok(vec![out])
        })
        .unwrap();
    drop(x);
    drop(w);
    let _churn: Vec<_> = (0..16)
        .map(|_| s.alloc_from_host(&vec![9.0f32; n]).unwrap())
        .collect();
    let inp = input(n, 8);
    let out = sg.run(&s, &[&inp]).unwrap();
    let want: Vec<f64> = inp
        .iter()
        .zip(&x0)
        .map(|(&a, &b)| a as f64 + b as f64 + 0.5)
        .collect();
    assert!(max_rel(out.get(0).unwrap(), &want) < 1e-6);
}

#[test]
fn hundred_thousand_replays_keep_memory_flat() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let n = 256;
    let x = s.alloc_from_host(&vec![0.0f32; n]).unwrap();
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new().upload(true), |cs| {
        let t = cs.alloc::<f32>(n)?;
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&k.scale_into, cfg(n), args![&x, &t, 1.0f32, n as i32])? };
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&k.axpb, cfg(n), args![&t, 1.0f32, 1.0f32, n as i32])? };
        cs.copy(&t, &x)?;
        Ok(())
    })
    .unwrap();
    s.synchronize().unwrap();
    let before = dev.memory_stats();
    let (free_before, _) = dev.context().mem_get_info().unwrap();
    for i in 0..100_000 {
        g.replay(&s).unwrap();
        if i % 10_000 == 0 {
            s.synchronize().unwrap();
        }
    }
    s.synchronize().unwrap();
    let after = dev.memory_stats();
    let (free_after, _) = dev.context().mem_get_info().unwrap();
    assert_eq!(after.allocated, before.allocated);
    assert_eq!(after.reserved, before.reserved);
    assert_eq!(after.peak_reserved, before.peak_reserved);
    assert!(
        free_before.abs_diff(free_after) < 4 << 20,
        "driver-level free memory moved by {} bytes",
        free_before.abs_diff(free_after)
    );
    // Each replay adds 1 to every element.
    assert!(s.to_vec(&x).unwrap().iter().all(|&v| v == 100_000.0));
}

/// A static graph's copies between its pinned staging and the device run as kernel nodes for
/// every length up to `MAX_MAPPED_COPY` bytes (whole 16-byte words and a tail of 4, 8 or 12
/// bytes), and as the driver's copy nodes beyond: the same values either way, replay after
/// replay, and eager pinned transfers (`pinned_scope`) agree.
#[test]
fn static_graph_copies_are_kernels_of_any_length_and_driver_copies_when_large() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let large = MAX_MAPPED_COPY / 4 + 3;
    for n in [1usize, 2, 3, 5, 1000, 3001, large] {
        let mut sg =
            StaticGraph::<f32, f32>::capture(&mut s, CaptureOptions::new(), &[n], |cs, ins| {
                let out = cs.alloc::<f32>(n)?;
                // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n
                // is their length.
                unsafe {
                    cs.launch(
                        &k.scale_into,
                        cfg(n),
                        args![&ins[0], &out, 2.0f32, n as i32],
                    )?
                };
                Ok(vec![out])
            })
            .unwrap();
        let nodes = sg.info().nodes;
        let (memcpy, kernel) = if n * 4 <= MAX_MAPPED_COPY {
            (0, 3)
        } else {
            (2, 1)
        };
        assert_eq!((nodes.memcpy, nodes.kernel), (memcpy, kernel), "n = {n}");
        for round in 0..3 {
            let x = input(n, 70 + round);
            let want: Vec<f32> = x.iter().map(|v| 2.0 * v).collect();
            let out = sg.run(&s, &[&x]).unwrap();
            assert_eq!(out.get(0), Some(&want[..]), "n = {n}, round {round}");
        }
        // Eager pinned transfers of the same length.
        let x = input(n, 90);
        let mut up = dev.alloc_pinned::<f32>(n).unwrap();
        up.as_mut_slice().copy_from_slice(&x);
        let mut down = dev.alloc_pinned::<f32>(n).unwrap();
        let d = s.alloc::<f32>(n).unwrap();
        s.pinned_scope(|sc| {
            sc.upload(&up, &d)?;
            sc.download(&d, &mut down)
        })
        .unwrap();
        assert_eq!(down.as_slice(), &x[..], "pinned_scope n = {n}");
    }
}

#[test]
fn static_graph_matches_eager_and_runs_many_inputs() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let n = 3000;
    let mut sg =
        StaticGraph::<f32, f32>::capture(&mut s, CaptureOptions::new(), &[n, n], |cs, ins| {
            let sum = cs.alloc::<f32>(n)?;
            // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
            unsafe { cs.launch(&k.add, cfg(n), args![&ins[0], &ins[1], &sum, n as i32])? };
            chain(cs, &k, &sum, 5)?;
            Ok(vec![sum])
        })
        .unwrap();
    assert_eq!(
        sg.info().nodes.memcpy,
        0,
        "two uploads and one download inside the graph, as copy kernels"
    );
    for round in 0..5 {
        let (a, b) = (input(n, 20 + round), input(n, 40 + round));
        // Eager run of the same code.
        let (da, db) = (
            s.alloc_from_host(&a).unwrap(),
            s.alloc_from_host(&b).unwrap(),
        );
        let sum = s.alloc::<f32>(n).unwrap();
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { s.launch(&k.add, cfg(n), args![&da, &db, &sum, n as i32]) }.unwrap();
        chain(&s, &k, &sum, 5).unwrap();
        let eager = s.to_vec(&sum).unwrap();
        let out = sg.run(&s, &[&a, &b]).unwrap();
        assert_eq!(out.get(0), Some(&eager[..]), "round {round}");
    }
    // The zero-copy path: write straight into the pinned staging.
    let (a, b) = (input(n, 60), input(n, 61));
    let want = sg.run_to_vecs(&s, &[&a, &b]).unwrap();
    sg.host_input_mut(0).unwrap().copy_from_slice(&a);
    sg.host_input_mut(1).unwrap().copy_from_slice(&b);
    assert!(matches!(
        sg.host_input_mut(2),
        Err(Error::OutOfRange { .. })
    ));
    assert_eq!(sg.run_staged(&s).unwrap().to_vecs(), want);
    let err = sg.run(&s, &[&[1.0]]).unwrap_err();
    assert!(matches!(err, Error::SizeMismatch { .. }), "{err}");
}

const SEED003: &str = r#"
extern "C" __global__ void kernel_forward(float* data) {
    int idx = threadIdx.x + blockIdx.x * blockDim.x;
    data[idx] = data[idx] * 2.0f + 1.0f;
}
extern "C" __global__ void kernel_backward(float* data) {
    int idx = threadIdx.x + blockIdx.x * blockDim.x;
    data[idx] = data[idx] / 2.0f - 3.0f;
}
"#;

#[test]
fn builder_graph_equals_captured_graph_equals_eager() {
    let dev = gpu_test_device!();
    let m = dev.compile("seed003", SEED003).unwrap();
    let (fwd, bwd) = (
        m.function("kernel_forward").unwrap(),
        m.function("kernel_backward").unwrap(),
    );
    let mut s = dev.new_stream().unwrap();
    let h = input(1024, 9);
    let one = LaunchConfig::linear(1, 1024);
    // Eager.
    let de = s.alloc_from_host(&h).unwrap();
    // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
    unsafe { s.launch(&fwd, one, args![&de]) }.unwrap();
    // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
    unsafe { s.launch(&bwd, one, args![&de]) }.unwrap();
    let eager = s.to_vec(&de).unwrap();
    // Stream capture.
    let dc = s.alloc_from_host(&h).unwrap();
    let (gc, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&fwd, one, args![&dc])? };
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&bwd, one, args![&dc]) }
    })
    .unwrap();
    gc.replay(&s).unwrap();
    // Explicit build: forward node, backward node depending on it.
    let db = s.alloc_from_host(&h).unwrap();
    let mut b = GraphBuilder::new(&dev);
    // SAFETY: kernel_forward/backward touch only element threadIdx.x < 1024 of the buffer.
    let f = unsafe { b.kernel(&fwd, one, args![&db], &[]) }.unwrap();
    // SAFETY: kernel_forward/backward touch only element threadIdx.x < 1024 of the buffer.
    unsafe { b.kernel(&bwd, one, args![&db], &[f]) }.unwrap();
    let gb = b.build().unwrap();
    assert_eq!(gb.info().nodes.kernel, 2);
    gb.replay(&s).unwrap();
    let (captured, built) = (s.to_vec(&dc).unwrap(), s.to_vec(&db).unwrap());
    assert_bits_eq(&captured, &eager, "captured graph vs eager");
    assert_bits_eq(&built, &eager, "built graph vs eager");
    let want: Vec<f64> = h
        .iter()
        .map(|&v| (v as f64 * 2.0 + 1.0) / 2.0 - 3.0)
        .collect();
    assert!(max_rel(&eager, &want) < 1e-6);
    // Validation: unknown dependency, oversized block.
    let mut bad = GraphBuilder::new(&dev);
    // SAFETY: kernel_forward/backward touch only element threadIdx.x < 1024 of the buffer.
    let first = unsafe { bad.kernel(&fwd, one, args![&db], &[]) }.unwrap();
    let mut other = GraphBuilder::new(&dev);
    // SAFETY: kernel_forward/backward touch only element threadIdx.x < 1024 of the buffer.
    unsafe { other.kernel(&fwd, one, args![&db], &[]) }.unwrap();
    // SAFETY: kernel_forward/backward touch only element threadIdx.x < 1024 of the buffer.
    let second = unsafe { other.kernel(&fwd, one, args![&db], &[]) }.unwrap();
    // SAFETY: kernel_forward/backward touch only element threadIdx.x < 1024 of the buffer.
    let err = unsafe { bad.kernel(&fwd, one, args![&db], &[first, second]) }.unwrap_err();
    assert!(matches!(err, Error::InvalidGraph { .. }), "{err}");
    // SAFETY: kernel_forward/backward touch only element threadIdx.x < 1024 of the buffer.
    let err =
        unsafe { bad.kernel(&fwd, LaunchConfig::linear(1, 2048), args![&db], &[]) }.unwrap_err();
    assert!(matches!(err, Error::InvalidLaunch { .. }), "{err}");
    assert!(matches!(
        GraphBuilder::new(&dev).build().unwrap_err(),
        Error::InvalidGraph { .. }
    ));
    // Fill, kernel and copy nodes in a chain: data = 1; forward (2·1 + 1 = 3); copy to out.
    let data = s.alloc_zeroed::<f32>(1024).unwrap();
    let out = s.alloc_zeroed::<f32>(1024).unwrap();
    let mut b = GraphBuilder::new(&dev);
    let fill = b.fill32(&data, 0, 1024, 1.0f32, &[]).unwrap();
    // SAFETY: kernel_forward/backward touch only element threadIdx.x < 1024 of the buffer.
    let f = unsafe { b.kernel(&fwd, one, args![&data], &[fill]) }.unwrap();
    b.copy(&data, &out, &[f]).unwrap();
    let g = b.build().unwrap();
    assert_eq!(
        (
            g.info().nodes.memset,
            g.info().nodes.kernel,
            g.info().nodes.memcpy
        ),
        (1, 1, 1)
    );
    g.replay(&s).unwrap();
    assert!(s.to_vec(&out).unwrap().iter().all(|&v| v == 3.0));
}

#[test]
fn bounded_pool_overflow_fails_the_capture_cleanly() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let pool = dev.new_pool_with_limit(4 << 20);
    let x = s.alloc_from_host(&input(1024, 11)).unwrap();
    let err = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        let big = cs.alloc::<f32>(2 << 20)?; // 8 MiB > 4 MiB limit
                                             // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&k.scale_into, cfg(1024), args![&x, &big, 1.0f32, 1024i32])? };
        Ok(big)
    })
    .unwrap_err();
    assert!(
        matches!(&err, Error::CaptureFailed { source, .. } if matches!(**source, Error::PoolLimitExceeded { limit, .. } if limit == 4 << 20)),
        "{err}"
    );
    assert!(!s.driver_is_capturing().unwrap());
    // Within the limit it works.
    let (g, y) = Graph::capture(&mut s, CaptureOptions::new().pool(&pool), |cs| {
        let y = cs.alloc::<f32>(1024)?;
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&k.scale_into, cfg(1024), args![&x, &y, 3.0f32, 1024i32])? };
        Ok(y)
    })
    .unwrap();
    g.replay(&s).unwrap();
    assert!(pool.stats().reserved <= 4 << 20);
    let want: Vec<f64> = input(1024, 11).iter().map(|&v| 3.0 * v as f64).collect();
    assert!(max_rel(&s.to_vec(&y).unwrap(), &want) < 1e-6);
}

#[test]
fn warmup_runs_on_the_side_stream_before_capture() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let main = dev.new_stream().unwrap();
    let mut side = dev.new_stream().unwrap();
    let x = main.alloc_from_host(&vec![1.0f32; 512]).unwrap();
    warmup(&main, &side, 3, |q| chain(q, &k, &x, 1)).unwrap();
    let (g, ()) =
        Graph::capture(&mut side, CaptureOptions::new(), |cs| chain(cs, &k, &x, 1)).unwrap();
    g.replay(&side).unwrap();
    main.wait_for(&side).unwrap();
    let got = main.to_vec(&x).unwrap();
    let want = chain_ref(&vec![1.0f32; 512], 1);
    let want = chain_ref(&want.iter().map(|&v| v as f32).collect::<Vec<_>>(), 1);
    let want = chain_ref(&want.iter().map(|&v| v as f32).collect::<Vec<_>>(), 1);
    let want = chain_ref(&want.iter().map(|&v| v as f32).collect::<Vec<_>>(), 1);
    assert!(max_rel(&got, &want) < 1e-6);
}

#[test]
fn typed_errors_for_bad_input() {
    let dev = gpu_test_device!();
    assert!(matches!(
        Device::open(999).unwrap_err(),
        Error::NoDevice { ordinal: 999, .. }
    ));
    let err = dev
        .compile("broken", "extern \"C\" __global__ void k( { }")
        .unwrap_err();
    assert!(
        matches!(&err, Error::Compile { module, .. } if module == "broken"),
        "{err}"
    );
    let m = dev.compile("gpu_core_tests", SRC).unwrap();
    assert!(matches!(
        m.function("nope").unwrap_err(),
        Error::MissingKernel { .. }
    ));
    let s = dev.new_stream().unwrap();
    let a = s.alloc::<f32>(10).unwrap();
    let b = s.alloc::<f32>(11).unwrap();
    assert!(matches!(
        s.copy(&a, &b).unwrap_err(),
        Error::SizeMismatch { .. }
    ));
    assert!(matches!(
        s.copy_range(&a, 5, &b, 0, 6).unwrap_err(),
        Error::OutOfRange { .. }
    ));
    assert!(matches!(
        s.copy_from_host(&[1.0f32; 3], &a).unwrap_err(),
        Error::SizeMismatch { .. }
    ));
}

#[test]
fn dot_dump_and_debug_summary() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let x = s.alloc_from_host(&input(100, 12)).unwrap();
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| chain(cs, &k, &x, 4)).unwrap();
    let path = std::env::temp_dir().join(format!("cudagraph-test-{}.dot", std::process::id()));
    g.write_dot(&path).unwrap();
    let dot = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(
        dot.contains("digraph"),
        "DOT output: {}",
        &dot[..dot.len().min(200)]
    );
    assert!(dot.matches("axpb").count() >= 4);
    let summary = format!("{g:?}");
    assert!(summary.starts_with("Graph(4 nodes: 4 kernel"), "{summary}");
}

#[test]
fn eager_allocations_are_reused_without_new_segments() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let first = s.alloc::<f32>(1000).unwrap();
    let addr = first.addr();
    drop(first);
    let reserved = dev.memory_reserved();
    for _ in 0..1000 {
        let b = s.alloc::<f32>(1000).unwrap();
        assert_eq!(
            b.addr(),
            addr,
            "same stream, same size: the cached block comes back"
        );
    }
    assert_eq!(dev.memory_reserved(), reserved);
    s.synchronize().unwrap();
    let released = dev.empty_cache().unwrap();
    assert!(released > 0);
}

#[test]
fn rebind_swaps_buffers_without_recapture() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let n = 1000;
    let (x0, y0) = (input(n, 70), input(n, 71));
    let x = s.alloc_from_host(&x0).unwrap();
    let out = s.alloc_zeroed::<f32>(n).unwrap();
    // A copy node reading x and a kernel node writing out. (Not the other way round: initcheck
    // checks a copy node's source when the graph is launched, so a copy of what a kernel of the
    // same graph writes is reported as uninitialised under compute-sanitizer.)
    let (mut g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        let t = cs.alloc::<f32>(n)?;
        cs.copy(&x, &t)?;
        // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
        unsafe { cs.launch(&k.scale_into, cfg(n), args![&t, &out, 3.0f32, n as i32]) }
    })
    .unwrap();
    let y = s.alloc_from_host(&y0).unwrap();
    let out2 = s.alloc_zeroed::<f32>(n).unwrap();
    let outcome = g.rebind_all(&[(&x, &y), (&out, &out2)]).unwrap();
    assert!(
        matches!(
            outcome,
            RebindOutcome::Updated { nodes: 2 } | RebindOutcome::Reinstantiated { nodes: 2 }
        ),
        "{outcome:?}"
    );
    g.replay(&s).unwrap();
    let want: Vec<f64> = y0.iter().map(|&v| 3.0 * v as f64).collect();
    assert!(
        max_rel(&s.to_vec(&out2).unwrap(), &want) < 1e-6,
        "graph now reads y and writes out2"
    );
    assert!(
        s.to_vec(&out).unwrap().iter().all(|&v| v == 0.0),
        "the old output is untouched"
    );
    assert_eq!(s.to_vec(&x).unwrap(), x0);
    assert_eq!(g.rebind_counts().0, 1);
    drop(y);
    drop(out2);
    g.replay(&s).unwrap(); // the graph holds the new buffers
    s.synchronize().unwrap();
    let short = s.alloc::<f32>(n - 1).unwrap();
    assert!(matches!(
        g.rebind(&x, &short),
        Err(Error::SizeMismatch { .. })
    ));
}

#[test]
fn builder_host_and_child_graph_nodes() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let n = 512;
    let x0 = input(n, 80);
    let x = s.alloc_from_host(&x0).unwrap();
    // A captured graph (x <- chain(x)) becomes a child node of a built graph.
    let (child, ()) =
        Graph::capture(&mut s, CaptureOptions::new(), |cs| chain(cs, &k, &x, 3)).unwrap();
    let out = s.alloc_zeroed::<f32>(n).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let mut b = GraphBuilder::new(&dev);
    let c = b.child(&child, &[]).unwrap();
    let h = b
        .host_fn(
            move || {
                seen.fetch_add(1, Ordering::SeqCst);
            },
            &[c],
        )
        .unwrap();
    b.copy(&x, &out, &[h]).unwrap();
    // A panicking host callback is caught, not an abort.
    b.host_fn(|| panic!("host node bug"), &[c]).unwrap();
    let g = b.build().unwrap();
    assert_eq!(
        (
            g.info().nodes.child_graph,
            g.info().nodes.host,
            g.info().nodes.memcpy
        ),
        (1, 2, 1)
    );
    drop(child); // the parent keeps what the child used
    g.replay(&s).unwrap();
    g.replay(&s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let once = chain_ref(&x0, 3);
    let twice = chain_ref(&once.iter().map(|&v| v as f32).collect::<Vec<_>>(), 3);
    assert!(max_rel(&s.to_vec(&out).unwrap(), &twice) < 1e-5);
}

#[test]
fn pinned_scope_transfers_round_trip_and_check_sizes() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let s = dev.new_stream().unwrap();
    let n = 4096;
    let x0 = input(n, 90);
    let mut host_in = dev.alloc_pinned::<f32>(n).unwrap();
    let mut host_out = dev.alloc_pinned::<f32>(n).unwrap();
    assert!(
        host_out.as_slice().iter().all(|&v| v == 0.0),
        "zeroed at allocation"
    );
    host_in.as_mut_slice().copy_from_slice(&x0);
    let x = s.alloc::<f32>(n).unwrap();
    let y = s.alloc::<f32>(n).unwrap();
    s.pinned_scope(|sc| {
        sc.upload(&host_in, &x)?;
        // SAFETY: scale_into writes y[0..n) from x[0..n); both hold n elements.
        unsafe {
            sc.stream()
                .launch(&k.scale_into, cfg(n), args![&x, &y, 2.0f32, n as i32])?
        };
        sc.download(&y, &mut host_out)
    })
    .unwrap();
    let want: Vec<f64> = x0.iter().map(|&v| 2.0 * v as f64).collect();
    assert!(max_rel(host_out.as_slice(), &want) < 1e-7);
    let short = dev.alloc_pinned::<f32>(n - 1).unwrap();
    let err = s.pinned_scope(|sc| sc.upload(&short, &x)).unwrap_err();
    assert!(matches!(err, Error::SizeMismatch { .. }), "{err}");
}

/// Device-to-device copies of every shape — aligned ones of whole 16-byte words and of any
/// length (the copy kernel's case), odd offsets, a copy above the kernel's limit — give
/// exactly the source bytes, eagerly and replayed from a graph (bytes around the copied range
/// untouched); captured, the aligned ones up to the limit are kernel nodes, the others driver
/// copies.
#[test]
fn device_copies_of_every_shape_move_exactly_their_bytes() {
    let dev = gpu_test_device!();
    let mut s = dev.new_stream().unwrap();
    let big = MAX_KERNEL_COPY / 4 + 8;
    let host: Vec<u32> = (0..big as u32)
        .map(|i| i.wrapping_mul(2654435761))
        .collect();
    let src = s.alloc_from_host(&host).unwrap();
    // (source offset, destination offset, length) in u32 elements.
    let cases = [
        (0, 0, 4),
        (0, 0, 1001),
        (4, 8, 3),
        (0, 0, 1 << 20),
        (4, 8, 4096),
        (1, 0, 4096),
        (0, 3, 1001),
        (5, 7, 1),
        (0, 0, MAX_KERNEL_COPY / 4),
        (0, 0, big),
    ];
    for &(so, d_off, len) in &cases {
        let total = d_off + len + 3;
        let dst = s.alloc_from_host(&vec![0xdead_beefu32; total]).unwrap();
        s.copy_range(&src, so, &dst, d_off, len).unwrap();
        let got = s.to_vec(&dst).unwrap();
        assert_eq!(
            &got[d_off..d_off + len],
            &host[so..so + len],
            "eager {so} {d_off} {len}"
        );
        assert!(got[..d_off].iter().all(|&v| v == 0xdead_beef));
        assert!(got[d_off + len..].iter().all(|&v| v == 0xdead_beef));
        // The same copy recorded into a graph.
        let dst2 = s.alloc_from_host(&vec![0xdead_beefu32; total]).unwrap();
        let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
            cs.copy_range(&src, so, &dst2, d_off, len)
        })
        .unwrap();
        g.replay(&s).unwrap();
        assert_eq!(s.to_vec(&dst2).unwrap(), got, "graph {so} {d_off} {len}");
        let kernel = so % 4 == 0 && d_off % 4 == 0 && len * 4 <= MAX_KERNEL_COPY;
        let nodes = g.info().nodes;
        assert_eq!(
            (nodes.kernel, nodes.memcpy),
            (kernel as usize, !kernel as usize),
            "graph nodes {so} {d_off} {len}"
        );
    }
}
