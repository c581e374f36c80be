//! Capture and replay, a shared pool, and static I/O with the copies inside the graph.
//! Run on a GPU machine: `cargo run --release -p cudagraph --example capture`.

use cudagraph::*;

fn main() -> Result<()> {
    let dev = Device::open(0)?;
    let mut stream = dev.new_stream()?;
    let add = dev
        .compile(
            "add",
            r#"extern "C" __global__ void add_one(float* x, int n) {
            int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += 1.0f; }"#,
        )?
        .function("add_one")?;
    let x = stream.alloc_from_host(&vec![0.0f32; 256])?;
    let pool = dev.graph_pool_handle(); // or dev.new_pool_with_limit(1 << 30)
    let (graph, ()) = Graph::capture(&mut stream, CaptureOptions::new().pool(&pool), |cs| {
        for _ in 0..10 {
            // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
            unsafe {
                cs.launch(
                    &add,
                    LaunchConfig::for_elements(256, 256),
                    args![&x, 256i32],
                )?
            };
        }
        Ok(())
    })?;
    graph.replay(&stream)?; // ten kernels, one launch
    assert_eq!(stream.to_vec(&x)?[0], 10.0);
    println!("pool: {}", pool.stats());

    // Static inputs and outputs with the copies inside the graph.
    let mut sg =
        StaticGraph::<f32, f32>::capture(&mut stream, CaptureOptions::new(), &[256], |cs, ins| {
            let out = cs.alloc::<f32>(256)?;
            cs.copy(&ins[0], &out)?;
            // SAFETY: the kernel touches only elements [0, n) of the buffers passed, and n is their length.
            unsafe {
                cs.launch(
                    &add,
                    LaunchConfig::for_elements(256, 256),
                    args![&out, 256i32],
                )?
            };
            Ok(vec![out])
        })?;
    let out = sg.run(&stream, &[&[1.0; 256]])?; // borrowed until the next run
    assert_eq!(out.get(0).expect("one output")[0], 2.0);
    Ok(())
}
