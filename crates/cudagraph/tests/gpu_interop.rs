//! GPU tests of cudarc interoperability: code written only against cudarc (its NVRTC, launch
//! builder, stream-ordered allocations and cuBLAS) is captured with `Graph::capture`, replayed
//! and served through a `GraphCache`, and compared with eager runs of the same code
//! (bit-identical: the same kernels run) and with an f64 CPU reference (1e-6 relative for the
//! element-wise kernels, 1e-5 for the SGEMM: fp32, K = 128, no TF32). Each test starts with the
//! GPU gate.

use std::sync::Arc;

use cudagraph::cudarc::cublas::{sys as cublas_sys, CudaBlas, Gemm, GemmConfig};
use cudagraph::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError,
    LaunchConfig as CuLaunch, PushKernelArg,
};
use cudagraph::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use cudagraph::*;

const SRC: &str = r#"
extern "C" __global__ void axpb(const float* x, float* y, float a, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}
extern "C" __global__ void accum_square(const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] += y[i] * y[i];
}
"#;

struct Kernels {
    axpb: CudaFunction,
    accum_square: CudaFunction,
}

/// The kernels, compiled and loaded by cudarc alone.
fn kernels(dev: &Device, ctx: &Arc<CudaContext>) -> Kernels {
    let (major, minor) = dev.info().compute_capability;
    let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
    let ptx = compile_ptx_with_opts(
        SRC,
        CompileOptions {
            arch: Some(arch),
            ..Default::default()
        },
    )
    .expect("cudarc NVRTC compiles the test kernels");
    let m = ctx.load_module(ptx).expect("cudarc loads the module");
    Kernels {
        axpb: m.load_function("axpb").unwrap(),
        accum_square: m.load_function("accum_square").unwrap(),
    }
}

fn input(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 % 1000) as f32) / 500.0 - 1.0)
        .collect()
}

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den.max(1e-30)).sqrt()
}

/// A cudarc context in multi-stream mode with event tracking off (what captures need, see
/// `cudagraph::interop`), a cudarc stream, and that stream as ours.
fn cudarc_stream_pair(dev: &Device) -> (Arc<CudaContext>, Arc<CudaStream>, Stream) {
    let ctx = dev.cudarc_context().unwrap();
    // SAFETY: every slice below is used on the one stream `cu` (or ordered by our queues).
    unsafe { ctx.disable_event_tracking() };
    let cu = ctx.new_stream().unwrap();
    let s = Stream::from_cudarc(dev, &cu).unwrap();
    (ctx, cu, s)
}

/// cudarc-only code: `y = 2x + 1` in a temporary cudarc allocation, then `out += y²`.
fn cudarc_step(
    cu: &Arc<CudaStream>,
    k: &Kernels,
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n: usize,
) -> std::result::Result<(), DriverError> {
    // SAFETY: fully written by `axpb` before it is read.
    let mut y = unsafe { cu.alloc::<f32>(n) }?;
    let cfg = CuLaunch::for_num_elems(n as u32);
    let (a, b, ni) = (2.0f32, 1.0f32, n as i32);
    // SAFETY: both kernels touch elements [0, n) of buffers of n elements.
    unsafe {
        cu.launch_builder(&k.axpb)
            .arg(x)
            .arg(&mut y)
            .arg(&a)
            .arg(&b)
            .arg(&ni)
            .launch(cfg)?;
        cu.launch_builder(&k.accum_square)
            .arg(&y)
            .arg(out)
            .arg(&ni)
            .launch(cfg)?;
    }
    drop(y); // stream-ordered free (a free node when captured)
    Ok(())
}

#[test]
fn device_and_cudarc_share_the_primary_context() {
    let dev = gpu_test_device!();
    let ctx = dev.cudarc_context().unwrap();
    assert_eq!(ctx.cu_ctx(), dev.context().raw_context());
    assert!(ctx.is_primary());
    let again = Device::from_cudarc(&ctx).unwrap();
    assert_eq!(again.context().raw_context(), ctx.cu_ctx());
    assert_eq!(again.ordinal(), dev.ordinal());
    // cudarc's default streams cannot be captured: refused with a typed error.
    assert!(matches!(
        Stream::from_cudarc(&dev, &ctx.default_stream()),
        Err(Error::NotSupported { .. })
    ));
    assert!(matches!(
        Stream::from_cudarc(&dev, &ctx.per_thread_stream()),
        Err(Error::NotSupported { .. })
    ));
    // Our own streams have no cudarc stream to hand out.
    let ours = dev.new_stream().unwrap();
    assert!(matches!(
        cudarc_stream(&ours),
        Err(Error::NotSupported { .. })
    ));
    // A wrapped cudarc stream survives our handle: dropping ours leaves cudarc's usable.
    let cu = ctx.new_stream().unwrap();
    drop(Stream::from_cudarc(&dev, &cu).unwrap());
    let back = cu
        .clone_dtoh(&cu.clone_htod(&[1.0f32, 2.0]).unwrap())
        .unwrap();
    assert_eq!(back, vec![1.0, 2.0]);
}

#[test]
fn cudarc_kernels_and_allocations_capture_and_replay_like_eager() {
    let dev = gpu_test_device!();
    let (ctx, cu, mut s) = cudarc_stream_pair(&dev);
    let k = kernels(&dev, &ctx);
    let n = 10_000;
    let xh = input(n);
    let x = cu.clone_htod(&xh).unwrap();

    // Eager: three steps.
    let mut out_e = cu.alloc_zeros::<f32>(n).unwrap();
    for _ in 0..3 {
        cudarc_step(&cu, &k, &x, &mut out_e, n).unwrap();
    }
    let eager = cu.clone_dtoh(&out_e).unwrap();
    let want: Vec<f64> = xh
        .iter()
        .map(|&v| 3.0 * (2.0 * v as f64 + 1.0).powi(2))
        .collect();
    assert!(rel_err(&eager, &want) < 1e-6, "{}", rel_err(&eager, &want));

    // Captured once (cudarc's allocation becomes graph memory), replayed three times.
    let mut out_g = cu.alloc_zeros::<f32>(n).unwrap();
    cu.synchronize().unwrap();
    let (graph, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        let cu2 = cudarc_stream(cs)?;
        assert!(Arc::ptr_eq(&cu2, &cu), "the same cudarc stream comes back");
        cudarc_step(&cu2, &k, &x, &mut out_g, n)?;
        Ok(())
    })
    .unwrap();
    let nodes = graph.info().nodes;
    assert_eq!(nodes.kernel, 2, "{nodes:?}");
    assert!(
        nodes.other >= 2,
        "cudarc's stream-ordered alloc and free became memory nodes: {nodes:?}"
    );
    for _ in 0..3 {
        graph.replay(&s).unwrap();
    }
    s.synchronize().unwrap();
    let replayed = cu.clone_dtoh(&out_g).unwrap();
    testing::assert_bits_eq(&replayed, &eager, "three replays vs three eager steps");
    // The graph frees its cudarc allocation in every replay (the driver refuses to relaunch a
    // graph whose allocation is still live), so replays go on in constant memory.
    for _ in 0..500 {
        graph.replay(&s).unwrap();
    }
    s.synchronize().unwrap();
    let after = cu.clone_dtoh(&out_g).unwrap();
    assert!(
        rel_err(
            &after,
            &want.iter().map(|w| w / 3.0 * 503.0).collect::<Vec<_>>()
        ) < 1e-5
    );
}

#[test]
fn cudarc_cublas_captures_and_replays_like_eager() {
    let dev = gpu_test_device!();
    let (_ctx, cu, mut s) = cudarc_stream_pair(&dev);
    let (m, kk, n) = (64usize, 128usize, 32usize);
    let (ah, bh) = (input(m * kk), input(kk * n + 3)[3..].to_vec());
    let a = cu.clone_htod(&ah).unwrap();
    let b = cu.clone_htod(&bh).unwrap();
    let mut c = cu.alloc_zeros::<f32>(m * n).unwrap();
    let blas = CudaBlas::new(cu.clone()).unwrap();
    // A workspace of our choosing, so cuBLAS never allocates (which a capture forbids).
    let ws = cu.alloc_zeros::<u8>(4 << 20).unwrap();
    {
        let (p, _rec) = ws.device_ptr(&cu);
        // SAFETY: `ws` is a live 4 MiB device allocation that outlives `blas` (declared
        // after it, so dropped first... see the explicit drop at the end).
        let st = unsafe {
            cublas_sys::cublasSetWorkspace_v2(*blas.handle(), p as *mut std::ffi::c_void, 4 << 20)
        };
        assert_eq!(st, cublas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS);
    }
    // Row-major C[m×n] = A[m×k]·B[k×n] as column-major Cᵀ = Bᵀ·Aᵀ.
    let cfg = GemmConfig {
        transa: cublas_sys::cublasOperation_t::CUBLAS_OP_N,
        transb: cublas_sys::cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: m as i32,
        k: kk as i32,
        alpha: 1.0f32,
        lda: n as i32,
        ldb: kk as i32,
        beta: 0.0f32,
        ldc: n as i32,
    };
    // SAFETY: the dimensions and leading dimensions describe the three buffers exactly.
    unsafe { blas.gemm(cfg, &b, &a, &mut c) }.unwrap();
    let eager = cu.clone_dtoh(&c).unwrap();
    let mut want = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            want[i * n + j] = (0..kk)
                .map(|p| ah[i * kk + p] as f64 * bh[p * n + j] as f64)
                .sum();
        }
    }
    assert!(rel_err(&eager, &want) < 1e-5, "{}", rel_err(&eager, &want));

    let (graph, ()) = Graph::capture(&mut s, CaptureOptions::new(), |_cs| {
        // SAFETY: as above; cuBLAS runs on `cu`, the capturing stream.
        unsafe { blas.gemm(cfg, &b, &a, &mut c) }.map_err(|e| Error::External(Box::new(e)))?;
        Ok(())
    })
    .unwrap();
    assert!(graph.info().nodes.kernel >= 1);
    cu.memset_zeros(&mut c).unwrap();
    graph.replay(&s).unwrap();
    s.synchronize().unwrap();
    let replayed = cu.clone_dtoh(&c).unwrap();
    testing::assert_bits_eq(&replayed, &eager, "cuBLAS replay vs eager");
    drop(graph);
    drop(blas);
    drop(ws);
}

/// A batch model written with cudarc: `y = 3x - 1` per element, output in our pool.
struct CudarcAffine {
    k: Arc<Kernels>,
    width: usize,
}

impl BatchModel for CudarcAffine {
    type In = f32;
    type Out = f32;
    fn input_row(&self) -> usize {
        self.width
    }
    fn output_row(&self) -> usize {
        self.width
    }
    fn forward(
        &self,
        q: &dyn Queue,
        input: &DeviceBuffer<f32>,
        rows: usize,
    ) -> Result<DeviceBuffer<f32>> {
        let cu = cudarc_stream(q)?;
        let n = rows * self.width;
        let out = q.alloc::<f32>(n)?;
        // SAFETY: both views are used only on `cu`, the queue's own stream, and the kernel
        // touches elements [0, n) of each (n <= both lengths).
        let (x, mut y) = unsafe { (input.as_cudarc(q, &cu)?, out.as_cudarc(q, &cu)?) };
        let mut yv = y.as_view_mut();
        let (a, b, ni) = (3.0f32, -1.0f32, n as i32);
        // SAFETY: as above.
        unsafe {
            cu.launch_builder(&self.k.axpb)
                .arg(&*x)
                .arg(&mut yv)
                .arg(&a)
                .arg(&b)
                .arg(&ni)
                .launch(CuLaunch::for_num_elems(n as u32))?;
        }
        Ok(out)
    }
}

#[test]
fn a_cudarc_model_is_served_by_a_graph_cache() {
    let dev = gpu_test_device!();
    let (ctx, _cu, mut s) = cudarc_stream_pair(&dev);
    let k = Arc::new(kernels(&dev, &ctx));
    let width = 5;
    let model = CudarcAffine {
        k: k.clone(),
        width,
    };
    let mut cache = GraphCache::new(
        &mut s,
        CudarcAffine { k, width },
        BucketPolicy::Sizes(vec![2, 8]),
        CacheOptions::default(),
    )
    .unwrap();
    for (rows, served) in [
        (2, Served::Exact { size: 2 }),
        (
            1,
            Served::Padded {
                size: 2,
                padded_rows: 1,
            },
        ),
        (
            5,
            Served::Padded {
                size: 8,
                padded_rows: 3,
            },
        ),
        (11, Served::Fallback),
    ] {
        // Data of its own per request (`input` alone gives every request the same prefix, so
        // a stale static input would give the same rows).
        let xh: Vec<f32> = input(rows * width)
            .into_iter()
            .map(|v| v + rows as f32)
            .collect();
        let x = s.alloc_from_host(&xh).unwrap();
        let (y, how) = cache.run(&mut s, &x, rows).unwrap();
        assert_eq!(how, served, "{rows} rows");
        let got = s.to_vec(&y).unwrap();
        let eager = s.to_vec(&model.forward(&s, &x, rows).unwrap()).unwrap();
        assert_eq!(got, eager, "{rows} rows: graph vs eager");
        let want: Vec<f64> = xh.iter().map(|&v| 3.0 * v as f64 - 1.0).collect();
        assert!(rel_err(&got, &want) < 1e-6);
    }
    assert_eq!(cache.stats().captures, 2);
}

#[test]
fn cudarc_event_tracking_is_refused_inside_a_capture() {
    let dev = gpu_test_device!();
    let ctx = dev.cudarc_context().unwrap();
    let cu = ctx.new_stream().unwrap(); // multi-stream mode, tracking on (cudarc's default)
    assert!(ctx.is_managing_stream_synchronization());
    let mut s = Stream::from_cudarc(&dev, &cu).unwrap();
    let err = Graph::capture(&mut s, CaptureOptions::new(), |cs| {
        cudarc_stream(cs)?;
        Ok(())
    })
    .unwrap_err();
    match err {
        Error::CaptureFailed { source, .. } => {
            assert!(matches!(*source, Error::NotSupported { .. }), "{source}")
        }
        other => panic!("expected a failed capture, got {other}"),
    }
    // Eagerly it is fine, and the stream is usable after the failed capture.
    assert!(cudarc_stream(&s).is_ok());
    let x = s.alloc_from_host(&[1.0f32, 2.0, 3.0]).unwrap();
    assert_eq!(s.to_vec(&x).unwrap(), vec![1.0, 2.0, 3.0]);
}

#[test]
fn cudarc_slices_become_buffers_that_graphs_keep_alive() {
    let dev = gpu_test_device!();
    let ctx = dev.cudarc_context().unwrap(); // single-stream mode: no event tracking
    let mut s = dev.new_stream().unwrap();
    let n = 4096;
    let xh = input(n);
    // Allocated and filled by cudarc on its default stream; ours waits for that work.
    let x = DeviceBuffer::from_cudarc(ctx.default_stream().clone_htod(&xh).unwrap(), &s).unwrap();
    assert_eq!(x.len(), n);
    assert_eq!(s.to_vec(&x).unwrap(), xh);
    let y = s.alloc_zeroed::<f32>(n).unwrap();
    let (graph, ()) = Graph::capture(&mut s, CaptureOptions::new(), |cs| cs.copy(&x, &y)).unwrap();
    drop(x); // the graph holds the cudarc slice now
    s.memset_zero(&y).unwrap();
    graph.replay(&s).unwrap();
    assert_eq!(s.to_vec(&y).unwrap(), xh);
    drop(graph); // frees the slice (cudarc, on its stream) after the replay finished
    s.synchronize().unwrap();

    // Our buffer as cudarc's, on a cudarc wrapper of our own stream.
    // SAFETY: `s` outlives `cu` and the view below.
    let cu = unsafe { ctx.wrap_borrowed_stream(s.handle().as_ref().raw()) };
    // SAFETY: cudarc only reads the view on `cu`, which is `s`.
    let view = unsafe { y.as_cudarc(&s, &cu) }.unwrap();
    assert_eq!(cu.clone_dtoh(&*view).unwrap(), xh);
    drop(view); // leaks back, does not free our memory
    assert_eq!(s.to_vec(&y).unwrap(), xh);
    // A view for another stream is refused.
    let other = dev.new_stream().unwrap();
    // SAFETY: not used (refused).
    assert!(unsafe { y.as_cudarc(&other, &cu) }.is_err());
}
