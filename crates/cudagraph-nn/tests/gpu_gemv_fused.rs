//! GPU tests of the lane kernel on rows it computes itself (`GemvKernels::run_from`): the
//! decoder's norm (LayerNorm with bias, RMSNorm; with and without the residual add; rows
//! picked with a stride) or SwiGLU of a packed gate|up row, then the few-row product, in one
//! launch. The fused launch must give the bits of the two launches it replaces — the
//! decoder's norm (or SwiGLU) kernel writing the rows, then `GemvKernels::run` on them with the
//! same split — for the product's output and for the residual sums it writes; both of those
//! kernels are checked against f64 references in `gpu_decoder.rs` and `gpu_gemv.rs`. Every
//! split the lane kernel takes for the depth, rows 1 to 4, bf16 and f16, results of the
//! operands' type and f32, grids with fewer blocks than column groups (the 32003-wide head).
//! Then misuse: shapes and aliasing it refuses are typed errors that run nothing. And the
//! decoder: a 16-bit decode step of one row gives the same bits with its norms and SwiGLU
//! fused into the products as with their own kernels.
//!
//! Tolerance: 0 (bits compared).

use cudagraph::memory::{bf16, f16};
use cudagraph::testing::assert_bits_eq;
use cudagraph::{gpu_test_device, DeviceBuffer, Queue, QueueExt, Stream};
use cudagraph_nn::dtype::Float;
use cudagraph_nn::engine::gemm::Epilogue;
use cudagraph_nn::engine::Engines;
use cudagraph_nn::kernels::decoder::DecoderKernels;
use cudagraph_nn::kernels::gemv::{
    fused_ok, FewRow, GemvKernels, RowsFrom, GEMV_FUSED_MAX_M, GEMV_SPLITS,
};
use cudagraph_nn::{Decoder, DecoderCache, Dtype, HostRng, LogitsFor, NnError};
#[path = "common/tiny_decoder.rs"]
mod tiny_decoder;

use tiny_decoder::{weights, Lcg};

fn values<T: Float>(rng: &mut HostRng, n: usize, scale: f32) -> Vec<T> {
    rng.vec_normal(n)
        .into_iter()
        .map(|v| T::from_f32(v * scale))
        .collect()
}

fn bits<O: Float>(s: &Stream, b: &DeviceBuffer<O>) -> Vec<u8> {
    O::as_bytes(&s.to_vec(b).unwrap()).to_vec()
}

/// The device's (shared memory a block, multiprocessors), as `fused_ok` takes them.
fn limits(s: &Stream) -> (usize, usize) {
    let info = s.device().info();
    (
        info.max_shared_memory_per_block as usize,
        info.multiprocessors as usize,
    )
}

/// Whether a launch the fused kernels refuse was refused with a shape error (and so ran
/// nothing: the checks come before the launch).
fn refused(r: Result<(), NnError>, what: &str) {
    match r {
        Err(NnError::Shape(_)) => {}
        other => panic!("{what}: expected a shape error, got {other:?}"),
    }
}

/// The splits the lane kernel takes for depth k (as the registry offers them).
fn splits(k: usize) -> Vec<u8> {
    GEMV_SPLITS
        .into_iter()
        .filter(|&ks| ks == 1 || k >= 256 * ks as usize)
        .collect()
}

/// One norm case: m rows picked at r·stride + off of a stream of `rows` rows, k wide, n
/// outputs; `add`: the residual add; `rms`: RMSNorm (no bias) or LayerNorm with a bias.
struct NormCase {
    m: usize,
    n: usize,
    k: usize,
    stride: usize,
    off: usize,
    add: bool,
    rms: bool,
    epilogue: Epilogue,
}

fn norm_case<T: Float, O: Float>(s: &Stream, c: &NormCase, seed: u64) {
    let dev = s.device();
    let (dk, gemv) = (
        DecoderKernels::get(dev).unwrap(),
        GemvKernels::get(dev).unwrap(),
    );
    let mut rng = HostRng::new(seed);
    let rows = (c.m - 1) * c.stride + c.off + 1;
    let hx = values::<T>(&mut rng, rows * c.k, 1.0);
    let ha = values::<T>(&mut rng, rows * c.k, 0.5);
    let nw: Vec<f32> = rng.vec_normal(c.k).iter().map(|v| 1.0 + 0.1 * v).collect();
    let nb: Vec<f32> = rng.vec_normal(c.k).iter().map(|v| 0.1 * v).collect();
    let hw = values::<T>(&mut rng, c.n * c.k, 1.0 / (c.k as f32).sqrt());
    let hbias = values::<O>(&mut rng, c.n, 0.5);
    let x = s.alloc_from_host(&hx).unwrap();
    let a = s.alloc_from_host(&ha).unwrap();
    let nw = s.alloc_from_host(&nw).unwrap();
    let nb = s.alloc_from_host(&nb).unwrap();
    let w = s.alloc_from_host(&hw).unwrap();
    let bias = s.alloc_from_host(&hbias).unwrap();
    let vec = (c.epilogue != Epilogue::None).then_some(&bias);
    let norm_bias = (!c.rms).then_some(&nb);
    let add = c.add.then_some(&a);
    let mut fused = 0;
    for ks in splits(c.k) {
        let takes = fused_ok::<T>(true, (c.m, c.n, c.k), ks, c.epilogue, limits(s));
        // Two launches: the norm kernel (in place on a copy of x), then the product.
        let x2 = s.alloc_from_host(&hx).unwrap();
        let h = s.alloc::<T>(c.m * c.k).unwrap();
        let y2 = s.alloc::<O>(c.m * c.n).unwrap();
        dk.norm(
            s,
            &x2,
            add,
            (&nw, norm_bias),
            &h,
            (c.m, c.k),
            (c.stride, c.off),
            (1e-5, c.rms),
        )
        .unwrap();
        let dims = (c.m, c.n, c.k);
        gemv.run(
            s,
            dims,
            (1.0, 0.0),
            c.epilogue,
            &h,
            &w,
            &y2,
            vec,
            FewRow::Lanes(ks),
        )
        .unwrap();
        // One launch, the sums into their own buffer.
        let sum = s.alloc_from_host(&hx).unwrap();
        let y1 = s.alloc::<O>(c.m * c.n).unwrap();
        let from = RowsFrom::Norm {
            x: &x,
            add,
            sum: Some(&sum),
            weight: &nw,
            bias: norm_bias,
            stride: c.stride,
            off: c.off,
            eps: 1e-5,
            rms: c.rms,
        };
        let ran = gemv.run_from(s, dims, (1.0, 0.0), c.epilogue, &from, &w, (&y1, vec), ks);
        let what = format!(
            "norm m={} n={} k={} stride={} off={} add={} rms={} ks={ks} {}→{}",
            c.m,
            c.n,
            c.k,
            c.stride,
            c.off,
            c.add,
            c.rms,
            T::DTYPE,
            O::DTYPE
        );
        if !takes {
            // More blocks than the fused kernels take: refused, nothing written.
            refused(ran, &what);
            assert_eq!(bits(s, &sum), T::as_bytes(&hx).to_vec(), "refused {what}");
            continue;
        }
        ran.unwrap();
        fused += 1;
        assert_eq!(bits(s, &y1), bits(s, &y2), "product of {what}");
        // The sums: where the norm kernel wrote x in place (the picked rows, with the add),
        // and x's own rows elsewhere.
        assert_eq!(bits(s, &sum), bits(s, &x2), "residual sums of {what}");
        assert_eq!(
            bits(s, &x),
            T::as_bytes(&hx).to_vec(),
            "the input of {what} was written"
        );
    }
    assert!(
        fused > 0,
        "no split of m={} n={} k={} ran fused",
        c.m,
        c.n,
        c.k
    );
}

fn swiglu_case<T: Float>(s: &Stream, (m, n, k): (usize, usize, usize), seed: u64) {
    for epilogue in [Epilogue::None, Epilogue::Bias] {
        swiglu_epilogue_case::<T>(s, (m, n, k), epilogue, seed);
    }
}

/// SwiGLU rows into the product with `epilogue` (a bias: Llama's `mlp_bias`), fused and as
/// two launches, bit for bit.
fn swiglu_epilogue_case<T: Float>(
    s: &Stream,
    (m, n, k): (usize, usize, usize),
    epilogue: Epilogue,
    seed: u64,
) {
    let dev = s.device();
    let (dk, gemv) = (
        DecoderKernels::get(dev).unwrap(),
        GemvKernels::get(dev).unwrap(),
    );
    let mut rng = HostRng::new(seed);
    let gu = s
        .alloc_from_host(&values::<T>(&mut rng, m * 2 * k, 2.0))
        .unwrap();
    let w = s
        .alloc_from_host(&values::<T>(&mut rng, n * k, 1.0 / (k as f32).sqrt()))
        .unwrap();
    let bias = s.alloc_from_host(&values::<T>(&mut rng, n, 0.5)).unwrap();
    let bias = (epilogue != Epilogue::None).then_some(&bias);
    let mut fused = 0;
    for ks in splits(k) {
        let takes = fused_ok::<T>(false, (m, n, k), ks, epilogue, limits(s));
        let act = s.alloc::<T>(m * k).unwrap();
        let y2 = s.alloc::<T>(m * n).unwrap();
        dk.swiglu(s, &gu, &act, (m, k)).unwrap();
        gemv.run(
            s,
            (m, n, k),
            (1.0, 0.0),
            epilogue,
            &act,
            &w,
            &y2,
            bias,
            FewRow::Lanes(ks),
        )
        .unwrap();
        let y1 = s.alloc::<T>(m * n).unwrap();
        let from = RowsFrom::SwiGlu { gu: &gu };
        let ran = gemv.run_from(
            s,
            (m, n, k),
            (1.0, 0.0),
            epilogue,
            &from,
            &w,
            (&y1, bias),
            ks,
        );
        if !takes {
            refused(
                ran,
                &format!("SwiGLU rows m={m} n={n} k={k} ks={ks} {epilogue:?}"),
            );
            continue;
        }
        ran.unwrap();
        fused += 1;
        assert_eq!(
            bits(s, &y1),
            bits(s, &y2),
            "SwiGLU m={m} n={n} k={k} ks={ks} {epilogue:?} {}",
            T::DTYPE
        );
    }
    let fits = fused_ok::<T>(false, (m, n, k), 1, epilogue, limits(s));
    assert!(
        fused > 0 || !fits,
        "no split of SwiGLU m={m} n={n} k={k} {epilogue:?} ran fused"
    );
}

fn all_norms<T: Float, O: Float>(s: &Stream) {
    let mut seed = 100;
    for m in 1..=GEMV_FUSED_MAX_M {
        for (n, k, add, rms, epilogue) in [
            // GPT-2's q|k|v and MLP up (bias, GELU), the residual add.
            (2304, 768, true, false, Epilogue::Bias),
            (3072, 768, true, false, Epilogue::BiasGelu),
            // A Llama-shaped q|k|v: RMSNorm, no add (the first layer), no bias.
            (3072, 2048, false, true, Epilogue::None),
            // RMSNorm with the add, a depth of one vector a thread.
            (40, 2048, true, true, Epilogue::BiasRelu),
        ] {
            seed += 1;
            let c = NormCase {
                m,
                n,
                k,
                stride: 1,
                off: 0,
                add,
                rms,
                epilogue,
            };
            norm_case::<T, O>(s, &c, seed);
        }
    }
}

#[test]
fn fused_norm_products_give_the_bits_of_the_two_launches() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    all_norms::<bf16, bf16>(&s);
    all_norms::<f16, f16>(&s);
}

#[test]
fn fused_heads_with_strided_rows_give_the_bits_of_the_two_launches() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    // The last token of each of m rows of 3 tokens, into heads of f32 logits (n not a
    // multiple of 8 in the first).
    for m in [1, 2, 4] {
        for (n, k) in [(4003, 2048), (520, 768)] {
            let c = NormCase {
                m,
                n,
                k,
                stride: 3,
                off: 2,
                add: true,
                rms: k == 2048,
                epilogue: Epilogue::None,
            };
            norm_case::<bf16, f32>(&s, &c, 7 + m as u64);
            norm_case::<f16, f32>(&s, &c, 9 + m as u64);
        }
    }
}

#[test]
fn fused_swiglu_products_give_the_bits_of_the_two_launches() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    for m in 1..=GEMV_FUSED_MAX_M {
        // A Llama-shaped down product (8192 → 2048; three and four such rows are more than
        // 48 KiB of shared memory, and its splits past 2 more blocks than one wave: refused)
        // and a small one.
        swiglu_case::<bf16>(&s, (m, 2048, 8192), 300 + m as u64);
        swiglu_case::<f16>(&s, (m, 2048, 8192), 310 + m as u64);
        swiglu_case::<bf16>(&s, (m, 24, 256), 320 + m as u64);
    }
}

#[test]
fn shapes_and_aliasing_it_refuses_are_typed_errors_and_run_nothing() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let gemv = GemvKernels::get(&dev).unwrap();
    let (m, n, k) = (2, 64, 256);
    let mut rng = HostRng::new(5);
    let x = s
        .alloc_from_host(&values::<bf16>(&mut rng, 8 * k, 1.0))
        .unwrap();
    let a = s
        .alloc_from_host(&values::<bf16>(&mut rng, 8 * k, 1.0))
        .unwrap();
    let sum = s.alloc::<bf16>(8 * k).unwrap();
    let nw = s.alloc_from_host(&vec![1.0f32; k]).unwrap();
    let w = s
        .alloc_from_host(&values::<bf16>(&mut rng, n * k, 0.1))
        .unwrap();
    let sentinel = vec![bf16::from_f32(77.0); 8 * n];
    let y = s.alloc_from_host(&sentinel).unwrap();
    let none: Option<&DeviceBuffer<bf16>> = None;
    let norm = |x, add, sum, stride, off, rms, bias| RowsFrom::Norm {
        x,
        add,
        sum,
        weight: &nw,
        bias,
        stride,
        off,
        eps: 1e-5,
        rms,
    };
    let shape = |r: Result<(), NnError>, what: &str| match r {
        Err(NnError::Shape(_)) => {}
        other => panic!("{what}: expected a shape error, got {other:?}"),
    };
    let run = |from: &RowsFrom<'_, bf16>, (m, n, k), y: &DeviceBuffer<bf16>| {
        gemv.run_from(
            &s,
            (m, n, k),
            (1.0, 0.0),
            Epilogue::None,
            from,
            &w,
            (y, none),
            1,
        )
    };
    let ok = norm(&x, Some(&a), Some(&sum), 1, 0, true, None);
    shape(run(&ok, (GEMV_FUSED_MAX_M + 1, n, k), &y), "too many rows");
    shape(run(&ok, (m, n, 12), &y), "k not a multiple of 8");
    let same = norm(&x, Some(&a), Some(&x), 1, 0, true, None);
    shape(run(&same, (m, n, k), &y), "sums into the input");
    let onto_add = norm(&x, Some(&a), Some(&a), 1, 0, true, None);
    shape(run(&onto_add, (m, n, k), &y), "sums into the residual");
    shape(run(&ok, (m, n, k), &x), "output onto the input");
    shape(run(&ok, (m, n, k), &sum), "output onto the sums");
    shape(
        run(&norm(&x, None, None, 0, 0, true, None), (m, n, k), &y),
        "stride 0",
    );
    shape(
        run(&norm(&x, None, None, 4, 4, true, None), (m, n, k), &y),
        "offset past the stride",
    );
    shape(
        run(&norm(&x, None, None, 4, 1, true, Some(&nw)), (m, n, k), &y),
        "RMSNorm with a bias",
    );
    // Rows past the input: 2 rows of stride 8 need 9 rows of k.
    match run(&norm(&x, None, None, 8, 0, true, None), (m, n, k), &y) {
        Err(NnError::Core(cudagraph::Error::SizeMismatch { .. })) => {}
        other => panic!("rows past the input: expected a size error, got {other:?}"),
    }
    let gated = RowsFrom::SwiGlu { gu: &x };
    shape(run(&gated, (m, n, k), &x), "output onto the SwiGLU input");
    let logits = s.alloc::<f32>(m * n).unwrap();
    let none32: Option<&DeviceBuffer<f32>> = None;
    match gemv.run_from(
        &s,
        (m, n, k),
        (1.0, 0.0),
        Epilogue::None,
        &gated,
        &w,
        (&logits, none32),
        1,
    ) {
        Err(NnError::NotSupported { .. }) => {}
        other => panic!("SwiGLU rows into f32: expected not supported, got {other:?}"),
    }
    s.synchronize().unwrap();
    assert!(
        s.to_vec(&y).unwrap() == sentinel,
        "a refused launch wrote its output"
    );
    // The same launch it does take runs.
    run(&ok, (m, n, k), &y).unwrap();
}

const VOCAB: usize = 97;

fn ids_of(seed: u64, n: usize) -> Vec<i32> {
    let mut rng = Lcg(seed);
    (0..n)
        .map(|_| ((rng.next() + 1.0) * 0.5 * VOCAB as f64) as i32 % VOCAB as i32)
        .collect()
}

/// One eager call's last-token logits.
fn forward_last(
    s: &Stream,
    dec: &Decoder,
    cache: &DecoderCache,
    (ids, pos): (&[i32], &[i32]),
    tokens: usize,
) -> Vec<f32> {
    let logits = s.alloc::<f32>(VOCAB).unwrap();
    let (i, p, sl) = (
        s.alloc_from_host(ids).unwrap(),
        s.alloc_from_host(pos).unwrap(),
        s.alloc_from_host(&[0i32]).unwrap(),
    );
    dec.forward(s, cache, &i, &p, &sl, (1, tokens), LogitsFor::Last, &logits)
        .unwrap();
    let v = s.to_vec(&logits).unwrap();
    s.synchronize().unwrap();
    v
}

/// 16-bit models at one row: where the registry picked the lane kernel for a product, the norm
/// before it (with the residual add) or SwiGLU runs inside the product's launch. The first
/// decode step of a shape runs them as kernels of their own (its products are being
/// measured), the next one fused: both steps, from equal caches, give the same logits, bit for
/// bit, three steps in a row (each reads the keys and values the step before wrote). Shapes of GPT-2 small's and a Llama-shaped model's layers (where the lane kernel
/// wins at one row on the H100); the test fails if no product of one row chose it with a grid
/// the fused kernels take.
/// Tolerance: 0 (bits compared).
#[test]
fn fused_norms_and_swiglu_give_the_bits_of_their_own_kernels() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let gpt2 = r#"{"model_type": "gpt2", "n_embd": 768, "n_layer": 2, "n_head": 12,
        "n_positions": 32, "vocab_size": 97, "layer_norm_epsilon": 1e-5}"#;
    let llama = r#"{"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
        "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
        "vocab_size": 97, "tie_word_embeddings": false}"#;
    let eng = Engines::get(&dev).unwrap();
    // Every choice forgotten (in memory; no other test of this file uses the registry), so
    // the first step of each shape measures its products.
    eng.clear();
    for (name, json) in [("gpt2", gpt2), ("llama", llama)] {
        let dec = Decoder::from_weights(&s, &weights(json, 81), Dtype::Bf16).unwrap();
        let before = dec.new_cache(&s, 1, 16).unwrap();
        let after = dec.new_cache(&s, 1, 16).unwrap();
        let prompt = ids_of(82, 5);
        let ppos: Vec<i32> = (0..5).collect();
        for c in [&before, &after] {
            forward_last(&s, &dec, c, (&prompt, &ppos), 5);
        }
        let d = if name == "gpt2" { 768 } else { 1024 };
        let one_row = format!("gemm NT m=1 n={} k={d} ", 3 * d);
        let measured = |key: &str| eng.table().into_iter().find(|r| r.key.starts_with(key));
        assert!(
            measured(&one_row).is_none(),
            "{name}: the q|k|v product of one row was measured before the first step"
        );
        for step in 0..3 {
            let (id, p) = ([3 + step], [5 + step]);
            let a = forward_last(&s, &dec, &before, (&id, &p), 1);
            let b = forward_last(&s, &dec, &after, (&id, &p), 1);
            assert_bits_eq(&a, &b, format_args!("{name} step {step}: logits"));
        }
        // A product of one row that chose the lane kernel with a grid the fused kernels take
        // (its norm or SwiGLU then ran inside it).
        let field = |key: &str, name: &str| -> usize {
            let at = key.find(&format!(" {name}=")).unwrap() + name.len() + 2;
            key[at..].split(' ').next().unwrap().parse().unwrap()
        };
        let rows: Vec<_> = eng
            .table()
            .into_iter()
            .filter(|r| r.key.starts_with("gemm NT m=1 ") && r.key.contains("in=bf16"))
            .map(|r| (r.key, r.entry.engine))
            .collect();
        let fused = rows
            .iter()
            .filter(|(key, engine)| {
                let ks = engine
                    .strip_prefix("gemv:")
                    .and_then(|v| v.parse::<u8>().ok());
                let nk = (1, field(key, "n"), field(key, "k"));
                ks.is_some_and(|ks| fused_ok::<bf16>(true, nk, ks, Epilogue::None, limits(&s)))
            })
            .count();
        assert!(
            fused > 0,
            "{name}: no product of one row runs fused (lane kernel, one wave): {rows:?}"
        );
    }
}
