//! GPU tests of conditional nodes (IF, WHILE, counted loops, nesting) and programmatic
//! dependent launch, each against the result the same work gives eagerly or on the host.
//! Every value checked here is exact (integer counts in f32, or the same kernels in the same
//! order), so the comparisons are bit-for-bit.

use cudagraph::*;

const SRC: &str = r#"
extern "C" __global__ void add_scalar(float* x, float v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += v;
}
extern "C" __global__ void add_vec(float* x, const float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}
extern "C" __global__ void twice(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= 2.0f;
}
// cond[0] = (x[0] < limit), one thread.
extern "C" __global__ void less_than(const float* x, float limit, unsigned int* cond) {
    cond[0] = x[0] < limit ? 1u : 0u;
}
// The chain step of `bench chain`, with the programmatic-launch prologue.
extern "C" __global__ void chain_step_pdl(float* x, int n) {
    CG_PDL_ENTER();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * 0.999f + 0.001f;
}
"#;

struct K {
    add_scalar: Function,
    add_vec: Function,
    twice: Function,
    less_than: Function,
    chain: Function,
}

fn kernels(dev: &Device) -> K {
    let m = dev
        .compile("gpu_graphfeat_tests", &format!("{PDL_CUDA}{SRC}"))
        .expect("test kernels compile");
    K {
        add_scalar: m.function("add_scalar").unwrap(),
        add_vec: m.function("add_vec").unwrap(),
        twice: m.function("twice").unwrap(),
        less_than: m.function("less_than").unwrap(),
        chain: m.function("chain_step_pdl").unwrap(),
    }
}

fn add<Q: Queue + ?Sized>(q: &Q, k: &K, x: &DeviceBuffer<f32>, v: f32) -> Result<()> {
    // SAFETY: add_scalar touches x[0..n) with n = x.len().
    unsafe {
        q.launch(
            &k.add_scalar,
            LaunchConfig::for_elements(x.len(), 128),
            args![x, v, x.len() as i32],
        )
    }
}

/// The GPU gate, then `None` (with the reason printed) when the driver has no conditional
/// nodes: those tests need CUDA 12.4+, and they say so instead of passing silently.
fn conditional_device() -> Option<Device> {
    let dev = cudagraph::testing::gpu_or_skip()?;
    let v = dev.info().driver_version;
    assert!(
        v >= 12040,
        "this GPU suite expects a CUDA 12.4+ driver for conditional nodes, found {v}"
    );
    Some(dev)
}

#[test]
fn if_node_runs_its_body_only_when_the_condition_is_set() {
    let Some(dev) = conditional_device() else {
        return;
    };
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let x = s.alloc_from_host(&[1.0f32; 300]).unwrap();
    let flag = s.alloc_from_host(&[1u32]).unwrap();
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        add(cs, &k, &x, 1.0)?;
        cs.if_then(&flag, |body| {
            // SAFETY: twice touches x[0..n), n = x.len().
            unsafe {
                body.launch(
                    &k.twice,
                    LaunchConfig::for_elements(300, 128),
                    args![&x, 300i32],
                )
            }
        })?;
        add(cs, &k, &x, 1.0)
    })
    .unwrap();
    assert_eq!(g.info().nodes.conditional, 1);
    assert_eq!(g.info().conditionals.if_nodes, 1);
    assert_eq!(g.info().conditionals.body_nodes.kernel, 1);
    g.replay(&s).unwrap(); // (1 + 1) * 2 + 1
    assert_eq!(s.to_vec(&x).unwrap(), vec![5.0; 300]);
    s.copy_from_host(&[0u32], &flag).unwrap();
    g.replay(&s).unwrap(); // 5 + 1 + 1
    assert_eq!(s.to_vec(&x).unwrap(), vec![7.0; 300]);
    s.copy_from_host(&[7u32], &flag).unwrap(); // any non-zero value
    g.replay(&s).unwrap(); // (7 + 1) * 2 + 1
    assert_eq!(s.to_vec(&x).unwrap(), vec![17.0; 300]);
}

#[test]
fn while_loop_runs_until_a_kernel_in_the_body_clears_the_condition() {
    let Some(dev) = conditional_device() else {
        return;
    };
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let x = s.alloc_from_host(&[0.0f32; 64]).unwrap();
    let cond = s.alloc_zeroed::<u32>(1).unwrap();
    let test = |q: &CaptureStream<'_>| {
        // SAFETY: less_than reads x[0] and writes cond[0]; both hold at least one element.
        unsafe {
            q.launch(
                &k.less_than,
                LaunchConfig::linear(1, 1),
                args![&x, 10.0f32, &cond],
            )
        }
    };
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        test(cs)?;
        cs.while_loop(&cond, |body| {
            add(body, &k, &x, 3.0)?;
            test(body)
        })
    })
    .unwrap();
    assert_eq!(g.info().conditionals.while_nodes, 1);
    g.replay(&s).unwrap();
    // The host loop it stands for: while x < 10 { x += 3 } from 0.
    let mut want = 0.0f32;
    while want < 10.0 {
        want += 3.0;
    }
    assert_eq!(s.to_vec(&x).unwrap(), vec![want; 64]);
    // Already past the limit: the body does not run at all.
    g.replay(&s).unwrap();
    assert_eq!(s.to_vec(&x).unwrap(), vec![want; 64]);
    // Capped loops stop at the cap even when the condition stays set.
    let y = s.alloc_from_host(&[0.0f32; 8]).unwrap();
    let always = s.alloc_from_host(&[1u32]).unwrap();
    let (capped, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        cs.while_loop_capped(&always, 5, |body| add(body, &k, &y, 1.0))
    })
    .unwrap();
    capped.replay(&s).unwrap();
    capped.replay(&s).unwrap();
    assert_eq!(s.to_vec(&y).unwrap(), vec![10.0; 8]);
}

#[test]
fn nested_counted_loops_run_exactly_and_restart_on_every_replay() {
    let Some(dev) = conditional_device() else {
        return;
    };
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let x = s.alloc_from_host(&[0.0f32; 1000]).unwrap();
    let y = s.alloc_from_host(&[0.0f32; 1000]).unwrap();
    let flag = s.alloc_from_host(&[1u32]).unwrap();
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        cs.repeat(3, |outer| {
            add(outer, &k, &y, 1.0)?;
            outer.repeat(4, |inner| inner.if_then(&flag, |b| add(b, &k, &x, 1.0)))
        })?;
        cs.repeat(0, |never| add(never, &k, &x, 1000.0))
    })
    .unwrap();
    let i = g.info();
    assert_eq!(i.conditionals.while_nodes, 3);
    assert_eq!(i.conditionals.if_nodes, 1);
    assert_eq!(i.nodes.conditional, 2, "two loops at the top level");
    for replay in 1..=2 {
        g.replay(&s).unwrap();
        assert_eq!(s.to_vec(&x).unwrap(), vec![12.0 * replay as f32; 1000]);
        assert_eq!(s.to_vec(&y).unwrap(), vec![3.0 * replay as f32; 1000]);
    }
    // Graphs with conditional nodes cannot be rebound (bodies are out of rebind's reach).
    let x2 = s.alloc_zeroed::<f32>(1000).unwrap();
    let mut g = g;
    assert!(matches!(g.rebind(&x, &x2), Err(Error::InvalidGraph { .. })));
    let dot = std::env::temp_dir().join(format!("cg-cond-{}.dot", std::process::id()));
    g.write_topology_dot(&dot).unwrap();
    let text = std::fs::read_to_string(&dot).unwrap();
    assert!(text.contains("WHILE") && text.contains("IF body"), "{text}");
    g.write_dot(&dot).unwrap();
    assert!(std::fs::metadata(&dot).unwrap().len() > 0);
    let _ = std::fs::remove_file(&dot);
}

#[test]
fn a_loop_body_never_reuses_blocks_it_reads_from_outside() {
    let Some(dev) = conditional_device() else {
        return;
    };
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let x = s.alloc_from_host(&[0.0f32; 256]).unwrap();
    let (xr, kr) = (&x, &k);
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        // A temporary of the capture, filled with ones, read by every iteration and dropped
        // inside the body; the body then allocates a buffer of the same size and fills it
        // with 100. Reusing the temporary's block for it would make later iterations add 100.
        let ones = cs.alloc::<f32>(256)?;
        cs.fill32(&ones, 0, 256, 1.0f32)?;
        cs.repeat(3, move |body| {
            // SAFETY: add_vec touches x[0..n) and ones[0..n), n = 256 = both lengths.
            unsafe {
                body.launch(
                    &kr.add_vec,
                    LaunchConfig::for_elements(256, 128),
                    args![xr, &ones, 256i32],
                )?
            };
            drop(ones);
            let other = body.alloc::<f32>(256)?;
            body.fill32(&other, 0, 256, 100.0f32)
        })
    })
    .unwrap();
    g.replay(&s).unwrap();
    assert_eq!(s.to_vec(&x).unwrap(), vec![3.0; 256]);
}

#[test]
fn programmatic_launch_gives_the_same_results_eagerly_and_graphed() {
    let dev = gpu_test_device!();
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let n: usize = 128;
    let steps = 100;
    let chain = |q: &dyn Queue, x: &DeviceBuffer<f32>, pdl: bool| -> Result<()> {
        for _ in 0..steps {
            // SAFETY: chain_step_pdl waits (CG_PDL_ENTER) before touching x[0..n), n = 128 =
            // x.len().
            unsafe {
                q.launch_with(
                    &k.chain,
                    LaunchConfig::linear(1, n as u32),
                    args![x, n as i32],
                    LaunchOptions::new().pdl(pdl),
                )?
            };
        }
        Ok(())
    };
    let x0: Vec<f32> = (0..n).map(|i| i as f32 / 7.0).collect();
    let plain = s.alloc_from_host(&x0).unwrap();
    chain(&s, &plain, false).unwrap();
    let want = s.to_vec(&plain).unwrap();
    let eager = s.alloc_from_host(&x0).unwrap();
    chain(&s, &eager, true).unwrap();
    testing::assert_bits_eq(&s.to_vec(&eager).unwrap(), &want, "eager PDL chain");
    let graphed = s.alloc_from_host(&x0).unwrap();
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        chain(cs, &graphed, true)
    })
    .unwrap();
    g.replay(&s).unwrap();
    testing::assert_bits_eq(&s.to_vec(&graphed).unwrap(), &want, "graphed PDL chain");
    let expected_edges = if dev.supports_pdl() { steps - 1 } else { 0 };
    assert_eq!(g.info().programmatic_edges, expected_edges);
    // A PDL kernel after a copy (not a kernel) still waits for it. The destination is zeroed
    // first, so a chain that started before the copy landed would start from zeros rather
    // than from what the copy brings (equal to what the destination held before).
    let (g2, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        cs.copy(&plain, &graphed)?;
        chain(cs, &graphed, true)
    })
    .unwrap();
    s.memset_zero(&graphed).unwrap();
    g2.replay(&s).unwrap();
    // The same chain of plain launches, eagerly, from the copy's source: the same bits.
    let again = s.alloc_from_host(&want).unwrap();
    chain(&s, &again, false).unwrap();
    let again = s.to_vec(&again).unwrap();
    assert_ne!(again, want, "the second chain changed the values");
    testing::assert_bits_eq(
        &s.to_vec(&graphed).unwrap(),
        &again,
        "graphed PDL chain after a copy vs eager",
    );
}

#[test]
fn programmatic_edges_inside_a_loop_body() {
    let Some(dev) = conditional_device() else {
        return;
    };
    let k = kernels(&dev);
    let mut s = dev.new_stream().unwrap();
    let x = s.alloc_from_host(&[0.5f32; 128]).unwrap();
    let y = s.alloc_from_host(&[0.5f32; 128]).unwrap();
    let step = |q: &dyn Queue, b: &DeviceBuffer<f32>, pdl: bool| -> Result<()> {
        for _ in 0..4 {
            // SAFETY: as in the test above; b holds 128 elements.
            unsafe {
                q.launch_with(
                    &k.chain,
                    LaunchConfig::linear(1, 128),
                    args![b, 128i32],
                    LaunchOptions::new().pdl(pdl),
                )?
            };
        }
        Ok(())
    };
    for _ in 0..5 {
        step(&s, &y, false).unwrap();
    }
    cudagraph::testing::settle(&dev);
    let (g, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        cs.repeat(5, |body| step(body, &x, true))
    })
    .unwrap();
    cudagraph::testing::settle(&dev);
    g.replay(&s).unwrap();
    assert_eq!(s.to_vec(&x).unwrap(), s.to_vec(&y).unwrap());
    if dev.supports_pdl() {
        assert_eq!(g.info().programmatic_edges, 3);
    }
}
