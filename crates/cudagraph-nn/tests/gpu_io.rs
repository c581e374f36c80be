//! Models exported from PyTorch (`bench/export_pytorch.py`: an MLP and a CNN as
//! `nn.Sequential`, weights by `safetensors.torch.save_file`, fixed inputs and PyTorch's
//! outputs) load by PyTorch's parameter names and match PyTorch's outputs; saving our
//! parameters and loading them again gives the same model.
//!
//! Tolerance: relative L2 error at most 1e-5 against PyTorch's fp32 output on the GPU (TF32
//! off) and against its float64 CPU forward. Both sides compute in fp32 and differ only in
//! summation order (cuBLAS/cuDNN vs our kernels), which stays near 1e-7 at these sizes
//! (K <= 288). Graph replay against eager runs of our own kernels: bit-identical.
//!
//! The fixtures live in `tests/data/pytorch/`. Without them the GPU tests fail and say how to
//! generate them (on a machine with torch); the CPU test skips, or fails too under
//! `CUDAGRAPH_REQUIRE_GPU=1` (the GPU runner, where the fixtures travel with the binaries).

use std::path::{Path, PathBuf};

use cudagraph::testing::{assert_bits_eq, skip_or_fail};
use cudagraph::{gpu_test_device, BucketPolicy, CacheOptions, Device, GraphCache};
use cudagraph_nn::io::{
    read_state_dict, read_tensors, save_model_with, Dtype, HostTensor, SaveOptions,
};
use cudagraph_nn::*;

const TOLERANCE: f64 = 1e-5;

/// Outputs of the model whose weights were saved as BF16 against the f32 model: each weight
/// moves by at most 2^-8 relative (BF16's unit roundoff), independently, so the outputs move by
/// a few 2^-9 relative; 2e-2 leaves room for cancellation.
const BF16_TOLERANCE: f64 = 2e-2;

/// The fixtures: `$CUDAGRAPH_PYTORCH_FIXTURES`, else this crate's `tests/data/pytorch` where it
/// was built, else the same path below the current directory (test binaries carried to the GPU
/// machine run from the repository root).
fn dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CUDAGRAPH_PYTORCH_FIXTURES") {
        return PathBuf::from(d);
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/pytorch");
    let here = PathBuf::from("crates/cudagraph-nn/tests/data/pytorch");
    if !built.is_dir() && here.is_dir() {
        return here;
    }
    built
}

fn fixture_files(name: &str) -> (ModelFiles, PathBuf) {
    let base = dir().join(name);
    (
        ModelFiles::locate(&base),
        dir().join(format!("{name}.io.safetensors")),
    )
}

fn present(name: &str) -> bool {
    let (f, io) = fixture_files(name);
    f.description.exists() && f.weights.exists() && io.exists()
}

const HOW: &str = "generate them on a machine with PyTorch: `python3 bench/export_pytorch.py` \
                   (writes crates/cudagraph-nn/tests/data/pytorch/, < 1 MB) and commit the files";

fn io_tensors(name: &str) -> (HostTensor, HostTensor, HostTensor) {
    let (_, io) = fixture_files(name);
    let bytes = std::fs::read(&io).unwrap();
    let mut t = read_tensors(&bytes, &io.display().to_string()).unwrap();
    let mut take = |n: &str| {
        let i = t
            .iter()
            .position(|x| x.name == n)
            .unwrap_or_else(|| panic!("{}: no tensor `{n}`", io.display()));
        t.remove(i)
    };
    (take("input"), take("output"), take("reference"))
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - *w as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn forward(dev: &Device, model: &Sequential, desc: &ModelDescription, x: &HostTensor) -> Vec<f32> {
    let s = dev.new_stream().unwrap();
    let mut shape = vec![x.shape[0]];
    shape.extend(desc.input());
    no_grad(|| {
        let t = Tensor::from_host(&s, &x.data, &shape).unwrap();
        model.forward(&s, &t).unwrap().to_vec(&s).unwrap()
    })
}

fn check_pytorch_model(dev: &Device, name: &str) {
    assert!(
        present(name),
        "PyTorch fixtures for `{name}` are missing in {}: {HOW}",
        dir().display()
    );
    let s = dev.new_stream().unwrap();
    let (desc, model) = load_model(&s, &dir().join(name)).unwrap();
    let (x, want, reference) = io_tensors(name);
    assert_eq!(&x.shape[1..], desc.input(), "{name}: input rows");
    let rows = x.shape[0];

    let got = forward(dev, &model, &desc, &x);
    let (e_pt, e_ref) = (rel_err(&got, &want.data), rel_err(&got, &reference.data));
    println!("{name}: relative error vs PyTorch fp32 {e_pt:.2e}, vs float64 {e_ref:.2e}");
    assert!(e_pt <= TOLERANCE, "{name}: vs PyTorch {e_pt:.3e}");
    assert!(e_ref <= TOLERANCE, "{name}: vs float64 {e_ref:.3e}");

    // Served through graphs: the same kernels, so exactly the eager result.
    let mut gs = dev.new_stream().unwrap();
    let mut cache = GraphCache::new(
        &mut gs,
        Batched {
            module: model.clone(),
            row_shape: desc.input().to_vec(),
            output_row: desc.output_row(),
        },
        BucketPolicy::Sizes(vec![rows]),
        CacheOptions::default(),
    )
    .unwrap();
    let xb = gs.alloc_from_host(&x.data).unwrap();
    let (y, _) = cache.run(&mut gs, &xb, rows).unwrap();
    assert_bits_eq(
        &gs.to_vec(&y).unwrap(),
        &got,
        format_args!("{name}: graph vs eager"),
    );

    // Save ours, load it back: the same parameters and the same outputs.
    let tmp = std::env::temp_dir().join(format!("cudagraph-gpu-io-{}-{name}", std::process::id()));
    let files = save_model(&s, &model, desc.input().to_vec(), &tmp).unwrap();
    let (desc2, model2) = load_model(&s, &tmp).unwrap();
    assert_eq!(desc2.input(), desc.input());
    assert_bits_eq(
        &forward(dev, &model2, &desc2, &x),
        &got,
        format_args!("{name}: saved and reloaded"),
    );
    let original = read_state_dict(
        &std::fs::read(&fixture_files(name).0.weights).unwrap(),
        &desc,
        "original",
    )
    .unwrap();
    let saved = read_tensors(&std::fs::read(&files.weights).unwrap(), "saved").unwrap();
    for t in &original {
        let s = saved
            .iter()
            .find(|s| s.name == t.name)
            .expect("saved under PyTorch's name");
        assert_eq!(s, t, "{name}: {} round trip", t.name);
    }
    let _ = std::fs::remove_file(&files.weights);
    let _ = std::fs::remove_file(&files.description);

    // Saved as BF16: every parameter is the `half` crate's round-to-nearest-even of ours, and
    // the reloaded model stays within BF16_TOLERANCE of the f32 outputs.
    let bf16 = SaveOptions { dtype: Dtype::Bf16 };
    let files = save_model_with(&s, &model, desc.input().to_vec(), &tmp, bf16).unwrap();
    let (desc3, model3) = load_model(&s, &tmp).unwrap();
    let saved = read_tensors(&std::fs::read(&files.weights).unwrap(), "saved bf16").unwrap();
    for t in &original {
        let s = saved.iter().find(|s| s.name == t.name).unwrap();
        let rounded: Vec<f32> = t
            .data
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(s.data, rounded, "{name}: {} as bf16", t.name);
    }
    let e_bf16 = rel_err(&forward(dev, &model3, &desc3, &x), &got);
    println!("{name}: weights saved as bf16, relative error vs f32 {e_bf16:.2e}");
    assert!(
        e_bf16 <= BF16_TOLERANCE,
        "{name}: bf16 weights {e_bf16:.3e}"
    );
    let _ = std::fs::remove_file(&files.weights);
    let _ = std::fs::remove_file(&files.description);
}

#[test]
fn pytorch_mlp_matches_pytorch() {
    let dev = gpu_test_device!();
    check_pytorch_model(&dev, "mlp");
}

#[test]
fn pytorch_cnn_matches_pytorch() {
    let dev = gpu_test_device!();
    check_pytorch_model(&dev, "cnn");
}

/// The file-format side of the fixtures, on the CPU: descriptions and state_dicts as PyTorch
/// wrote them parse and match by name, shape and dtype.
#[test]
fn pytorch_fixture_files_parse_on_the_cpu() {
    for name in ["mlp", "cnn"] {
        if !present(name) {
            skip_or_fail(format_args!(
                "PyTorch fixtures for `{name}` are missing in {} ({HOW})",
                dir().display()
            ));
            continue;
        }
        let (files, _) = fixture_files(name);
        let desc = ModelDescription::read(&files.description).unwrap();
        let bytes = std::fs::read(&files.weights).unwrap();
        let params = read_state_dict(&bytes, &desc, name).unwrap();
        assert_eq!(params.len(), desc.parameters().len());
        let (x, y, r) = io_tensors(name);
        assert_eq!(&x.shape[1..], desc.input());
        assert_eq!(y.shape, vec![x.shape[0], desc.output_row()]);
        assert_eq!(r.shape, y.shape);
    }
}

/// The format `bench/export_pytorch.py` writes when the safetensors package is missing (header
/// padded with spaces to 8 bytes, tensors sorted by name) reads with the safetensors crate.
#[test]
fn the_scripts_fallback_format_reads() {
    let header = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[1,3],"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}}"#;
    let mut h = header.as_bytes().to_vec();
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(&h);
    for v in [0.1f32, 0.2, 0.3, 1.5, -2.0] {
        bytes.extend(v.to_le_bytes());
    }
    let t = read_tensors(&bytes, "fallback").unwrap();
    assert_eq!(t[0].name, "a");
    assert_eq!(t[0].data, vec![0.1, 0.2, 0.3]);
    assert_eq!(t[1].shape, vec![2]);
    assert_eq!(t[1].data, vec![1.5, -2.0]);
}
