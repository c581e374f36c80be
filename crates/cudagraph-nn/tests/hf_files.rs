//! Hugging Face model folders (`io::hf`): synthetic GPT-2 and Llama configs and safetensors
//! files (two layers, tiny sizes; one file and shards; tied and untied heads; BF16 and F32),
//! written with the `safetensors` crate into a temporary folder and read back, value for value;
//! and every error the reader names. The last test uploads to a GPU (skipped without one): the
//! device copies equal the host values bit for bit.

use std::collections::BTreeMap;
use std::path::Path;

use cudagraph::gpu_test_device;
use cudagraph_nn::io::hf::{DecoderConfig, DecoderWeights, TensorSpec};
use cudagraph_nn::io::{Dtype, HfError, IoError};
use half::{bf16, f16};
use safetensors::tensor::{Dtype as FileDtype, TensorView};
use serde_json::{json, Value};

#[path = "common/temp.rs"]
mod temp;
use temp::temp_dir;

fn gpt2_config(tied: bool) -> Value {
    json!({
        "model_type": "gpt2", "n_embd": 8, "n_layer": 2, "n_head": 2, "n_positions": 16,
        "vocab_size": 11, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
        "tie_word_embeddings": tied, "torch_dtype": "float32", "n_inner": null,
    })
}

fn llama_config(tied: bool) -> Value {
    json!({
        "model_type": "llama", "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 64,
        "vocab_size": 13, "tie_word_embeddings": tied, "hidden_act": "silu",
        "attention_bias": false, "mlp_bias": false, "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    })
}

/// Qwen2 as the Hub's checkpoints write it: a `sliding_window` size that
/// `use_sliding_window: false` leaves off.
fn qwen2_config() -> Value {
    json!({
        "model_type": "qwen2", "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 64,
        "vocab_size": 13, "tie_word_embeddings": true, "hidden_act": "silu",
        "use_sliding_window": false, "sliding_window": 64, "max_window_layers": 2,
        "torch_dtype": "bfloat16",
    })
}

/// The bias tensors `cfg` lists for layer 0, by projection name.
fn layer0_biases(cfg: &DecoderConfig) -> Vec<(String, Vec<usize>)> {
    cfg.tensors()
        .into_iter()
        .filter(|s| s.name.starts_with("model.layers.0.") && s.name.ends_with(".bias"))
        .map(|s| (s.name["model.layers.0.".len()..].to_string(), s.shape))
        .collect()
}

fn parse(v: &Value) -> DecoderConfig {
    DecoderConfig::from_json(&v.to_string()).unwrap()
}

/// Distinct values per tensor (seeded by the name), exact in BF16: small integers over 8.
fn values(name: &str, n: usize) -> Vec<f32> {
    let seed = name
        .bytes()
        .fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
    (0..n)
        .map(|i| ((seed.wrapping_add(i as u32 * 13)) % 61) as f32 / 8.0 - 3.0)
        .collect()
}

fn encode(dtype: FileDtype, v: &[f32]) -> Vec<u8> {
    match dtype {
        FileDtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        FileDtype::BF16 => v
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
        FileDtype::F16 => v
            .iter()
            .flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
        FileDtype::F64 => v.iter().flat_map(|x| f64::from(*x).to_le_bytes()).collect(),
        other => panic!("{other:?}"),
    }
}

/// A file's tensors: name, dtype, shape, values.
type Entries = Vec<(String, FileDtype, Vec<usize>, Vec<f32>)>;

/// The tensors `cfg` needs, by their file names (`prefix` before GPT-2's), in `dtype`.
fn entries(cfg: &DecoderConfig, dtype: FileDtype, prefix: &str) -> Entries {
    cfg.tensors()
        .into_iter()
        .map(|TensorSpec { name, shape, .. }| {
            let n = shape.iter().product();
            let v = values(&name, n);
            (format!("{prefix}{name}"), dtype, shape, v)
        })
        .collect()
}

fn serialize(entries: &[(String, FileDtype, Vec<usize>, Vec<f32>)]) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = entries.iter().map(|e| encode(e.1, &e.3)).collect();
    let views: Vec<(String, TensorView<'_>)> = entries
        .iter()
        .zip(&bytes)
        .map(|(e, b)| (e.0.clone(), TensorView::new(e.1, e.2.clone(), b).unwrap()))
        .collect();
    safetensors::tensor::serialize(views, None).unwrap()
}

fn write_folder(dir: &Path, config: &Value, shards: &[Entries]) {
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    if shards.len() == 1 {
        std::fs::write(dir.join("model.safetensors"), serialize(&shards[0])).unwrap();
        return;
    }
    let mut map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards.len());
        for e in shard {
            map.insert(e.0.clone(), Value::from(file.clone()));
        }
        std::fs::write(dir.join(&file), serialize(shard)).unwrap();
    }
    let index = json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

fn hf_err(r: Result<impl std::fmt::Debug, IoError>) -> HfError {
    match r {
        Err(IoError::Hf(e)) => e,
        other => panic!("expected an HfError, got {other:?}"),
    }
}

fn config_err(v: &Value) -> HfError {
    hf_err(DecoderConfig::from_json(&v.to_string()))
}

#[test]
fn configs_parse_with_defaults() {
    let DecoderConfig::Gpt2(g) = parse(&gpt2_config(true)) else {
        panic!()
    };
    assert_eq!((g.n_embd, g.n_layer, g.n_head, g.n_inner), (8, 2, 2, 32));
    assert_eq!((g.n_positions, g.vocab_size), (16, 11));
    assert!(g.tie_word_embeddings);
    assert_eq!(g.dtype, Some(Dtype::F32));
    // GPT-2's defaults: tied head, epsilon 1e-5, gelu_new.
    let mut min = gpt2_config(true);
    for f in [
        "tie_word_embeddings",
        "layer_norm_epsilon",
        "activation_function",
        "torch_dtype",
    ] {
        min.as_object_mut().unwrap().remove(f);
    }
    let DecoderConfig::Gpt2(m) = parse(&min) else {
        panic!()
    };
    assert!(m.tie_word_embeddings && m.layer_norm_epsilon == 1e-5 && m.dtype.is_none());

    let c = parse(&llama_config(false));
    assert_eq!((c.model_type(), c.layers(), c.tied()), ("llama", 2, false));
    let DecoderConfig::Llama(l) = c else { panic!() };
    assert_eq!(
        (l.num_attention_heads, l.num_key_value_heads, l.head_dim),
        (4, 2, 4)
    );
    assert_eq!((l.rope_theta, l.dtype), (500000.0, Some(Dtype::Bf16)));
    let r = l.rope_scaling.unwrap();
    assert_eq!(
        (r.factor, r.low_freq_factor, r.high_freq_factor),
        (8.0, 1.0, 4.0)
    );
    assert_eq!(r.original_max_position_embeddings, 32.0);

    // Llama defaults: kv heads = heads, head_dim = hidden / heads, untied, no scaling; the old
    // `type` key and "default" scaling; `dtype` as newer files write it; an explicit head_dim.
    let mut v = llama_config(false);
    let o = v.as_object_mut().unwrap();
    for f in [
        "num_key_value_heads",
        "tie_word_embeddings",
        "rms_norm_eps",
        "torch_dtype",
    ] {
        o.remove(f);
    }
    o.insert("rope_scaling".into(), json!({"type": "default"}));
    o.insert("dtype".into(), json!("float16"));
    o.insert("head_dim".into(), json!(8));
    let DecoderConfig::Llama(l) = parse(&v) else {
        panic!()
    };
    assert_eq!(
        (l.num_key_value_heads, l.head_dim, l.rms_norm_eps),
        (4, 8, 1e-6)
    );
    assert!(!l.tie_word_embeddings && l.rope_scaling.is_none());
    assert_eq!(l.dtype, Some(Dtype::F16));
    let spec = parse(&v).tensors();
    let q = spec
        .iter()
        .find(|s| s.name.ends_with("0.self_attn.q_proj.weight"));
    assert_eq!(q.unwrap().shape, vec![32, 16]);
    let o = spec
        .iter()
        .find(|s| s.name.ends_with("0.self_attn.o_proj.weight"));
    assert_eq!(o.unwrap().shape, vec![16, 32]);

    // Mistral without a sliding window is a Llama.
    let mut v = llama_config(true);
    v["model_type"] = json!("mistral");
    v["sliding_window"] = Value::Null;
    assert_eq!(parse(&v).model_type(), "mistral");
    assert!(layer0_biases(&parse(&v)).is_empty());
}

#[test]
fn biases_follow_the_config() {
    // Qwen2: q, k and v have biases, o and the MLP none; its sliding window is off.
    let c = parse(&qwen2_config());
    assert_eq!((c.model_type(), c.tied()), ("qwen2", true));
    let DecoderConfig::Llama(l) = &c else {
        panic!()
    };
    assert_eq!((l.qkv_bias, l.o_bias, l.mlp_bias), (true, false, false));
    assert_eq!((l.head_dim, l.rope_theta), (4, 1e6));
    // Layer 0's biases in the file's order, with their lengths.
    let (qkv, o, mlp): (&[_], &[_], &[_]) = (
        &[
            ("self_attn.q_proj.bias", 16),
            ("self_attn.k_proj.bias", 8),
            ("self_attn.v_proj.bias", 8),
        ],
        &[("self_attn.o_proj.bias", 16)],
        &[
            ("mlp.gate_proj.bias", 24),
            ("mlp.up_proj.bias", 24),
            ("mlp.down_proj.bias", 16),
        ],
    );
    let want = |parts: &[&[(&str, usize)]]| -> Vec<(String, Vec<usize>)> {
        parts
            .iter()
            .flat_map(|p| p.iter())
            .map(|(n, d)| (n.to_string(), vec![*d]))
            .collect()
    };
    assert_eq!(layer0_biases(&c), want(&[qkv]));
    // transformers' own files list every layer's kind.
    let mut v = qwen2_config();
    v["layer_types"] = json!(["full_attention", "full_attention"]);
    assert_eq!(parse(&v), c);

    // Llama's `attention_bias` is q, k, v and o; `mlp_bias` gate, up and down.
    let mut v = llama_config(false);
    v["attention_bias"] = json!(true);
    v["mlp_bias"] = json!(true);
    assert_eq!(layer0_biases(&parse(&v)), want(&[qkv, o, mlp]));
    let mut v = llama_config(false);
    v["mlp_bias"] = json!(true);
    assert_eq!(layer0_biases(&parse(&v)), want(&[mlp]));
}

#[test]
fn sliding_windows_are_read_where_they_apply() {
    let window = |v: &Value| match parse(v) {
        DecoderConfig::Llama(l) => l.sliding_window,
        DecoderConfig::Gpt2(_) => panic!(),
    };
    // Qwen2: off unless `use_sliding_window`, or a layer of `layer_types` slides.
    assert_eq!(window(&qwen2_config()), None);
    let mut v = qwen2_config();
    v["use_sliding_window"] = json!(true);
    assert_eq!(window(&v), Some(64));
    let mut v = qwen2_config();
    v["layer_types"] = json!(["full_attention", "sliding_attention"]);
    assert_eq!(window(&v), Some(64));
    // Mistral: whenever its size is given (Mistral 7B v0.1's 4096), not when null.
    let mut v = llama_config(false);
    v["model_type"] = json!("mistral");
    v["sliding_window"] = json!(4096);
    assert_eq!(window(&v), Some(4096));
    v["sliding_window"] = Value::Null;
    assert_eq!(window(&v), None);
}

#[test]
fn unsupported_configs_name_field_value_and_alternatives() {
    let cases: Vec<(Value, &str, &str, &str)> = vec![
        (
            json!({"model_type": "falcon"}),
            "model_type",
            "\"falcon\"",
            "qwen2",
        ),
        (
            {
                let mut v = llama_config(false);
                v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
                v
            },
            "rope_scaling.rope_type",
            "\"yarn\"",
            "llama3",
        ),
        (
            {
                let mut v = qwen2_config();
                v["layer_types"] = json!(["full_attention", "chunked_attention"]);
                v
            },
            "layer_types",
            "[\"full_attention\",\"chunked_attention\"]",
            "sliding_attention",
        ),
        (
            {
                let mut v = llama_config(false);
                v["hidden_act"] = json!("gelu");
                v
            },
            "hidden_act",
            "\"gelu\"",
            "silu",
        ),
        (
            {
                let mut v = gpt2_config(true);
                v["activation_function"] = json!("relu");
                v
            },
            "activation_function",
            "\"relu\"",
            "gelu_new",
        ),
        (
            {
                let mut v = gpt2_config(true);
                v["torch_dtype"] = json!("float64");
                v
            },
            "torch_dtype",
            "\"float64\"",
            "bfloat16",
        ),
    ];
    for (v, field, value, supported) in cases {
        let e = config_err(&v);
        let msg = e.to_string();
        match &e {
            HfError::Unsupported {
                field: f, value: x, ..
            } => assert_eq!((f.as_str(), x.as_str()), (field, value), "{msg}"),
            other => panic!("{field}: {other:?}"),
        }
        assert!(msg.contains(supported), "{msg}");
    }

    // Malformed fields: missing, wrong type, inconsistent heads.
    let mut v = gpt2_config(true);
    v.as_object_mut().unwrap().remove("n_embd");
    let cases = vec![
        (v, "n_embd", "missing"),
        (
            {
                let mut v = llama_config(false);
                v["num_key_value_heads"] = json!(3);
                v
            },
            "num_key_value_heads",
            "does not divide",
        ),
        (
            {
                let mut v = gpt2_config(true);
                v["n_head"] = json!(3);
                v
            },
            "n_head",
            "does not divide",
        ),
        (
            {
                let mut v = llama_config(false);
                v["vocab_size"] = json!("13");
                v
            },
            "vocab_size",
            "positive integer",
        ),
        (
            {
                let mut v = qwen2_config();
                v["use_sliding_window"] = json!(true);
                v["sliding_window"] = Value::Null;
                v
            },
            "sliding_window",
            "is missing",
        ),
        (
            {
                let mut v = llama_config(false);
                v["attention_bias"] = json!("yes");
                v
            },
            "attention_bias",
            "true or false",
        ),
        (
            {
                let mut v = llama_config(false);
                v["rope_scaling"]
                    .as_object_mut()
                    .unwrap()
                    .remove("low_freq_factor");
                v
            },
            "rope_scaling.low_freq_factor",
            "missing",
        ),
        (json!({"n_embd": 8}), "model_type", "missing"),
    ];
    for (v, field, problem) in cases {
        match config_err(&v) {
            HfError::Config {
                field: f,
                problem: p,
            } => {
                assert_eq!(f, field);
                assert!(p.contains(problem), "{field}: {p}");
            }
            other => panic!("{field}: {other:?}"),
        }
    }
    assert!(matches!(
        hf_err(DecoderConfig::from_json("{not json")),
        HfError::Config { .. }
    ));
}

/// Reads `dir` and checks every tensor against `want` (by canonical name), transposing GPT-2's
/// `Conv1D` weights.
fn check_values(w: &DecoderWeights, want: &Entries, prefix: &str) {
    let specs: BTreeMap<String, TensorSpec> = w
        .config
        .tensors()
        .into_iter()
        .map(|s| (s.name.clone(), s))
        .collect();
    assert_eq!(w.tensors.len(), specs.len());
    for (name, dtype, shape, v) in want {
        let name = name.strip_prefix(prefix).unwrap();
        let t = w.get(name).unwrap_or_else(|| panic!("{name}"));
        assert_eq!(t.dtype, file_dtype(*dtype), "{name}");
        let got = t.to_f32();
        if specs[name].transpose {
            let (r, c) = (shape[0], shape[1]);
            assert_eq!(t.shape, vec![c, r], "{name}");
            for i in 0..r {
                for j in 0..c {
                    assert_eq!(got[j * r + i], v[i * c + j], "{name}[{i},{j}]");
                }
            }
        } else {
            assert_eq!(&t.shape, shape, "{name}");
            assert_eq!(&got, v, "{name}");
        }
    }
}

fn file_dtype(d: FileDtype) -> Dtype {
    match d {
        FileDtype::F32 => Dtype::F32,
        FileDtype::BF16 => Dtype::Bf16,
        FileDtype::F16 => Dtype::F16,
        other => panic!("{other:?}"),
    }
}

#[test]
fn gpt2_single_file_tied_and_untied() {
    // Tied, with the `transformer.` prefix and the old attention-mask buffers HF ignores.
    let cfg = parse(&gpt2_config(true));
    let dir = temp_dir("gpt2-tied");
    let mut e = entries(&cfg, FileDtype::F32, "transformer.");
    let want = e.clone();
    e.push((
        "transformer.h.0.attn.bias".into(),
        FileDtype::F32,
        vec![1, 1, 16, 16],
        vec![1.0; 256],
    ));
    e.push((
        "transformer.h.1.attn.masked_bias".into(),
        FileDtype::F32,
        vec![],
        vec![-1e4],
    ));
    // A tied file may still store the head; it is dropped as HF drops it.
    e.push((
        "lm_head.weight".into(),
        FileDtype::F32,
        vec![11, 8],
        values("wte.weight", 88),
    ));
    write_folder(&dir, &gpt2_config(true), &[e]);
    let w = DecoderWeights::read(&dir).unwrap();
    assert!(w.get("lm_head.weight").is_none());
    check_values(&w, &want, "transformer.");
    // c_attn: stored [8, 24] (Conv1D), loaded [24, 8] like nn.Linear.
    assert_eq!(w.get("h.0.attn.c_attn.weight").unwrap().shape, vec![24, 8]);
    assert_eq!(w.get("h.1.mlp.c_fc.weight").unwrap().shape, vec![32, 8]);
    assert_eq!(w.get("h.1.mlp.c_proj.weight").unwrap().shape, vec![8, 32]);

    // Untied, without the prefix, in BF16: the head is loaded.
    let cfg = parse(&gpt2_config(false));
    let dir = temp_dir("gpt2-untied");
    let e = entries(&cfg, FileDtype::BF16, "");
    write_folder(&dir, &gpt2_config(false), std::slice::from_ref(&e));
    let w = DecoderWeights::read(&dir).unwrap();
    assert_eq!(w.get("lm_head.weight").unwrap().shape, vec![11, 8]);
    check_values(&w, &e, "");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn llama_sharded_and_single_bf16_and_f32() {
    for (tied, dtype, shards) in [
        (false, FileDtype::BF16, 3),
        (true, FileDtype::F32, 2),
        (false, FileDtype::F32, 1),
        (true, FileDtype::BF16, 1),
    ] {
        let cfg_json = llama_config(tied);
        let cfg = parse(&cfg_json);
        let dir = temp_dir("llama");
        let mut e = entries(&cfg, dtype, "");
        // Old Llama files carry the rotary frequencies as a buffer: ignored.
        e.push((
            "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            FileDtype::F32,
            vec![2],
            vec![1.0, 0.5],
        ));
        let per = e.len().div_ceil(shards);
        let parts: Vec<Entries> = e.chunks(per).map(|c| c.to_vec()).collect();
        write_folder(&dir, &cfg_json, &parts);
        let w = DecoderWeights::read(&dir).unwrap();
        e.pop();
        check_values(&w, &e, "");
        assert_eq!(w.get("lm_head.weight").is_some(), !tied);
        assert_eq!(
            w.get("model.layers.1.self_attn.k_proj.weight")
                .unwrap()
                .shape,
            vec![8, 16]
        );
        // 16-bit host vectors: the file's own bits, or rounded from f32.
        let t = w.get("model.norm.weight").unwrap();
        let as_bf16 = t.to_vec::<bf16>("model.norm.weight").unwrap();
        let as_f16 = t.to_vec::<f16>("model.norm.weight").unwrap();
        let as_f32 = t.to_vec::<f32>("model.norm.weight").unwrap();
        for ((a, b), c) in as_bf16.iter().zip(&as_f16).zip(&as_f32) {
            assert_eq!(a.to_f32(), *c);
            assert_eq!(b.to_f32(), *c);
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// A Qwen2 folder and a Llama folder with every bias: the biases load like the weights.
#[test]
fn biased_folders_load_every_bias() {
    let mut llama = llama_config(true);
    llama["attention_bias"] = json!(true);
    llama["mlp_bias"] = json!(true);
    for (cfg_json, biases) in [(qwen2_config(), 3), (llama, 7)] {
        let cfg = parse(&cfg_json);
        let dir = temp_dir("biased");
        let e = entries(&cfg, FileDtype::BF16, "");
        assert_eq!(
            e.iter().filter(|x| x.0.ends_with(".bias")).count(),
            2 * biases
        );
        write_folder(&dir, &cfg_json, std::slice::from_ref(&e));
        let w = DecoderWeights::read(&dir).unwrap();
        check_values(&w, &e, "");
        // A file without one of them names it.
        let missing: Entries = e
            .iter()
            .filter(|x| x.0 != "model.layers.1.self_attn.k_proj.bias")
            .cloned()
            .collect();
        write_folder(&dir, &cfg_json, &[missing]);
        let msg = hf_err(DecoderWeights::read(&dir)).to_string();
        assert!(
            msg.contains("model.layers.1.self_attn.k_proj.bias"),
            "{msg}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn weight_errors_are_typed_and_list_every_name() {
    let cfg_json = llama_config(false);
    let cfg = parse(&cfg_json);
    let full = entries(&cfg, FileDtype::BF16, "");
    let from = |e: &Entries| {
        DecoderWeights::from_files(
            parse(&cfg_json),
            &[("model.safetensors".into(), serialize(e))],
        )
    };

    // Missing: every one listed.
    let e: Entries = full
        .iter()
        .filter(|x| !x.0.contains("layers.1.mlp") && x.0 != "lm_head.weight")
        .cloned()
        .collect();
    match hf_err(from(&e)) {
        HfError::MissingTensors { names } => assert_eq!(
            names,
            [
                "model.layers.1.mlp.gate_proj.weight",
                "model.layers.1.mlp.up_proj.weight",
                "model.layers.1.mlp.down_proj.weight",
                "lm_head.weight",
            ]
        ),
        other => panic!("{other:?}"),
    }

    // Extra: every one listed, sorted (a third layer, a bias).
    let mut e = full.clone();
    e.push((
        "model.layers.2.input_layernorm.weight".into(),
        FileDtype::BF16,
        vec![16],
        vec![0.0; 16],
    ));
    e.push((
        "model.layers.0.self_attn.q_proj.bias".into(),
        FileDtype::BF16,
        vec![16],
        vec![0.0; 16],
    ));
    match hf_err(from(&e)) {
        HfError::ExtraTensors { model, names } => {
            assert_eq!(model, "llama");
            assert_eq!(
                names,
                [
                    "model.layers.0.self_attn.q_proj.bias",
                    "model.layers.2.input_layernorm.weight"
                ]
            );
        }
        other => panic!("{other:?}"),
    }

    // Wrong shape (k_proj as if there were no GQA).
    let mut e = full.clone();
    let k = e
        .iter_mut()
        .find(|x| x.0 == "model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    k.2 = vec![16, 16];
    k.3 = vec![0.5; 256];
    match hf_err(from(&e)) {
        HfError::Shape {
            name,
            expected,
            found,
        } => {
            assert_eq!(name, "model.layers.0.self_attn.k_proj.weight");
            assert_eq!((expected, found), (vec![8, 16], vec![16, 16]));
        }
        other => panic!("{other:?}"),
    }

    // Unsupported dtype.
    let mut e = full.clone();
    e.iter_mut().find(|x| x.0 == "model.norm.weight").unwrap().1 = FileDtype::F64;
    match hf_err(from(&e)) {
        HfError::Dtype { name, found } => {
            assert_eq!(
                (name.as_str(), found.as_str()),
                ("model.norm.weight", "F64")
            )
        }
        other => panic!("{other:?}"),
    }

    // The same tensor in two shards.
    let norm: Entries = full
        .iter()
        .filter(|x| x.0 == "model.norm.weight")
        .cloned()
        .collect();
    let r = DecoderWeights::from_files(
        parse(&cfg_json),
        &[
            ("a.safetensors".into(), serialize(&full)),
            ("b.safetensors".into(), serialize(&norm)),
        ],
    );
    assert!(
        matches!(hf_err(r), HfError::Duplicate { ref name, .. } if name == "model.norm.weight")
    );

    // Not a safetensors file.
    let r = DecoderWeights::from_files(parse(&cfg_json), &[("x".into(), b"garbage".to_vec())]);
    assert!(matches!(r, Err(IoError::Format { .. })), "{r:?}");

    // GPT-2: a Conv1D weight stored as nn.Linear would store it is a shape error.
    let g = parse(&gpt2_config(true));
    let mut e = entries(&g, FileDtype::F32, "");
    let c = e
        .iter_mut()
        .find(|x| x.0 == "h.1.attn.c_attn.weight")
        .unwrap();
    c.2 = vec![24, 8];
    let r = DecoderWeights::from_files(g, &[("m".into(), serialize(&e))]);
    match hf_err(r) {
        HfError::Shape {
            expected, found, ..
        } => assert_eq!((expected, found), (vec![8, 24], vec![24, 8])),
        other => panic!("{other:?}"),
    }
}

#[test]
fn folder_and_index_errors() {
    let cfg_json = llama_config(true);
    let cfg = parse(&cfg_json);
    let e = entries(&cfg, FileDtype::F32, "");

    // No weights at all.
    let dir = temp_dir("empty");
    std::fs::write(dir.join("config.json"), cfg_json.to_string()).unwrap();
    assert!(matches!(
        hf_err(DecoderWeights::read(&dir)),
        HfError::NoWeights { .. }
    ));
    // No config.
    let none = temp_dir("none");
    assert!(matches!(
        DecoderWeights::read(&none),
        Err(IoError::File { .. })
    ));

    // An index that puts a tensor in the wrong shard.
    let dir = temp_dir("index");
    let half = e.len() / 2;
    write_folder(&dir, &cfg_json, &[e[..half].to_vec(), e[half..].to_vec()]);
    let index = dir.join("model.safetensors.index.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
    v["weight_map"]["model.norm.weight"] = json!("model-00001-of-00002.safetensors");
    std::fs::write(&index, v.to_string()).unwrap();
    match hf_err(DecoderWeights::read(&dir)) {
        HfError::Index(m) => assert!(m.contains("model.norm.weight"), "{m}"),
        other => panic!("{other:?}"),
    }
    // An index naming a file outside the folder.
    v["weight_map"]["model.norm.weight"] = json!("../elsewhere.safetensors");
    std::fs::write(&index, v.to_string()).unwrap();
    assert!(matches!(
        hf_err(DecoderWeights::read(&dir)),
        HfError::Index(_)
    ));
    // An index without a weight_map.
    std::fs::write(&index, "{}").unwrap();
    assert!(matches!(
        hf_err(DecoderWeights::read(&dir)),
        HfError::Index(_)
    ));
    // A missing shard file.
    v["weight_map"]["model.norm.weight"] = json!("model-00009-of-00009.safetensors");
    std::fs::write(&index, v.to_string()).unwrap();
    assert!(matches!(
        DecoderWeights::read(&dir),
        Err(IoError::File { .. })
    ));
    for d in [dir, none] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// On a GPU: f32 parameters equal the host values widened; typed uploads equal the host
/// vectors bit for bit, in each dtype (BF16 file → f16 rounds on the host, as `to_vec` does).
#[test]
fn gpu_uploads_equal_host_values() {
    let dev = gpu_test_device!();
    let s = dev.new_stream().unwrap();
    let cfg_json = llama_config(false);
    let cfg = parse(&cfg_json);
    let e = entries(&cfg, FileDtype::BF16, "");
    let w = DecoderWeights::from_files(cfg, &[("m".into(), serialize(&e))]).unwrap();
    let params = w.upload_parameters(&s).unwrap();
    assert_eq!(params.len(), w.tensors.len());
    for (name, t) in &w.tensors {
        let p = &params[name];
        assert_eq!(p.shape(), t.shape.as_slice(), "{name}");
        let got = s.to_vec(p.data().unwrap()).unwrap();
        let want = t.to_f32();
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}"
        );
    }
    for dtype in Dtype::ALL {
        let up = w.upload_as(&s, dtype).unwrap();
        for (name, t) in &w.tensors {
            let d = &up[name];
            assert_eq!(
                (d.shape.as_slice(), d.buffer.dtype()),
                (t.shape.as_slice(), dtype)
            );
            let bits: Vec<u32> = match dtype {
                Dtype::F32 => s
                    .to_vec(d.buffer.get::<f32>().unwrap())
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect(),
                Dtype::Bf16 => s
                    .to_vec(d.buffer.get::<bf16>().unwrap())
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits() as u32)
                    .collect(),
                Dtype::F16 => s
                    .to_vec(d.buffer.get::<f16>().unwrap())
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits() as u32)
                    .collect(),
            };
            let want: Vec<u32> = match dtype {
                Dtype::F32 => t
                    .to_vec::<f32>(name)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect(),
                Dtype::Bf16 => t
                    .to_vec::<bf16>(name)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits() as u32)
                    .collect(),
                Dtype::F16 => t
                    .to_vec::<f16>(name)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits() as u32)
                    .collect(),
            };
            assert_eq!(bits, want, "{name} {dtype}");
        }
    }
}

/// With the `tokenizers` feature: a hand-written word-level `tokenizer.json` encodes and
/// decodes, unknown words become the unknown token, and a malformed file is a typed error.
#[cfg(feature = "tokenizers")]
#[test]
fn tokenizer_json_round_trips() {
    use cudagraph_nn::io::hf::HfTokenizer;
    let json = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1, "[UNK]": 2},
                  "unk_token": "[UNK]"},
    });
    let dir = temp_dir("tok");
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    let t = HfTokenizer::read(&dir).unwrap();
    assert_eq!(t.vocab_size(), 3);
    assert_eq!(t.encode("hello world hello", false).unwrap(), [0, 1, 0]);
    assert_eq!(t.encode("world of", true).unwrap(), [1, 2]);
    assert_eq!(t.decode(&[0, 1], false).unwrap(), "hello world");
    assert!(matches!(
        HfTokenizer::from_bytes(b"{}"),
        Err(IoError::Hf(HfError::Tokenizer(_)))
    ));
    std::fs::remove_dir_all(dir).unwrap();
}

/// transformers 5 writes the rotary settings as one `rope_parameters` object (theta included):
/// the same model as the `rope_theta` + `rope_scaling` form, and a bad entry named by its path.
#[test]
fn rope_parameters_read_like_rope_theta_and_rope_scaling() {
    let old = parse(&llama_config(false));
    let mut v = llama_config(false);
    let o = v.as_object_mut().unwrap();
    let mut p = o.remove("rope_scaling").unwrap();
    p["rope_theta"] = o.remove("rope_theta").unwrap();
    o.insert("rope_parameters".into(), p);
    assert_eq!(parse(&v), old);

    // "default" with a theta: no scaling, that theta.
    v["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 1234.0});
    let DecoderConfig::Llama(l) = parse(&v) else {
        panic!()
    };
    assert_eq!((l.rope_theta, l.rope_scaling), (1234.0, None));

    v["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 10.0, "factor": 8.0,
        "low_freq_factor": 1.0, "original_max_position_embeddings": 32});
    let e = DecoderConfig::from_json(&v.to_string())
        .unwrap_err()
        .to_string();
    assert!(e.contains("rope_parameters.high_freq_factor"), "{e}");
}

#[test]
fn eos_ids_come_from_generation_config_then_config() {
    use cudagraph_nn::io::hf::eos_token_ids;
    let dir = temp_dir("eos");
    let write = |name: &str, v: &Value| {
        std::fs::write(dir.join(name), serde_json::to_vec(v).unwrap()).unwrap()
    };
    // No config.json: the file error, naming the path.
    match eos_token_ids(&dir) {
        Err(IoError::File { path, .. }) => assert!(path.ends_with("config.json"), "{path:?}"),
        other => panic!("expected a file error, got {other:?}"),
    }
    // config.json alone: its id, one or a list (repeats dropped, order kept); none or null: empty.
    let mut cfg = llama_config(true);
    cfg["eos_token_id"] = json!(7);
    write("config.json", &cfg);
    assert_eq!(eos_token_ids(&dir).unwrap(), vec![7]);
    cfg["eos_token_id"] = json!([9, 3, 9, 0]);
    write("config.json", &cfg);
    assert_eq!(eos_token_ids(&dir).unwrap(), vec![9, 3, 0]);
    cfg["eos_token_id"] = Value::Null;
    write("config.json", &cfg);
    assert_eq!(eos_token_ids(&dir).unwrap(), Vec::<i32>::new());
    cfg.as_object_mut().unwrap().remove("eos_token_id");
    write("config.json", &cfg);
    assert_eq!(eos_token_ids(&dir).unwrap(), Vec::<i32>::new());
    // generation_config.json wins where it sets one; where it does not, config.json counts.
    cfg["eos_token_id"] = json!(7);
    write("config.json", &cfg);
    write(
        "generation_config.json",
        &json!({"eos_token_id": [5, 6], "do_sample": true}),
    );
    assert_eq!(eos_token_ids(&dir).unwrap(), vec![5, 6]);
    write("generation_config.json", &json!({"eos_token_id": null}));
    assert_eq!(eos_token_ids(&dir).unwrap(), vec![7]);
    write("generation_config.json", &json!({"temperature": 0.6}));
    assert_eq!(eos_token_ids(&dir).unwrap(), vec![7]);
    // Malformed values are typed errors naming the file and the field.
    for (bad, says) in [
        (json!("2"), "\"2\""),
        (json!(-1), "-1"),
        (json!(1.5), "1.5"),
        (json!([1, 4294967296u64]), "4294967296"),
        (json!({"id": 1}), "{\"id\":1}"),
    ] {
        write("generation_config.json", &json!({ "eos_token_id": bad }));
        match hf_err(eos_token_ids(&dir)) {
            HfError::Generation {
                file,
                field,
                problem,
            } => {
                assert_eq!(
                    (file.as_str(), field.as_str()),
                    ("generation_config.json", "eos_token_id")
                );
                assert!(problem.contains(says), "{problem}");
            }
            e => panic!("expected a generation error, got {e:?}"),
        }
    }
    std::fs::write(dir.join("generation_config.json"), b"{not json").unwrap();
    let e = hf_err(eos_token_ids(&dir));
    assert!(e.to_string().starts_with("generation_config.json: "), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sampling_comes_from_generation_config_as_transformers_applies_it() {
    use cudagraph_nn::io::hf::{generation_defaults, GenerationDefaults};
    use cudagraph_nn::SamplingParams;
    let dir = temp_dir("sampling");
    let write = |v: &Value| {
        std::fs::write(
            dir.join("generation_config.json"),
            serde_json::to_vec(v).unwrap(),
        )
        .unwrap()
    };
    let read = || generation_defaults(&dir).unwrap();
    // No file, no do_sample, do_sample false or null: greedy; sampling fields are then unused.
    assert_eq!(read(), GenerationDefaults::default());
    for v in [
        json!({"eos_token_id": 2}),
        json!({"do_sample": false, "temperature": 0.6, "top_p": 0.9}),
        json!({"do_sample": null, "top_k": 20}),
    ] {
        write(&v);
        assert_eq!(read(), GenerationDefaults::default(), "{v}");
    }
    // do_sample true: the file's values, transformers' defaults (1.0, 50, 1.0) for the rest.
    write(&json!({"do_sample": true, "temperature": 0.6, "top_p": 0.9}));
    let want = SamplingParams {
        temperature: 0.6,
        top_k: 50,
        top_p: 0.9,
    };
    assert_eq!(read().sampling, Some(want));
    write(&json!({"do_sample": true, "temperature": null, "top_k": 0}));
    let want = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
    };
    assert_eq!(read().sampling, Some(want));
    // What transformers would apply and generate does not is listed; neutral values are not.
    write(&json!({
        "do_sample": false, "repetition_penalty": 1.1, "num_beams": 1, "typical_p": 0.9,
        "suppress_tokens": [], "forced_eos_token_id": 2, "no_repeat_ngram_size": 0
    }));
    let u = read().unsupported;
    assert_eq!(
        u,
        vec![
            ("repetition_penalty".to_string(), "1.1".to_string()),
            ("forced_eos_token_id".to_string(), "2".to_string()),
        ]
    );
    // typical_p (and min_p, ...) only count when sampling.
    write(&json!({"do_sample": true, "typical_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.0}));
    let u = read().unsupported;
    assert_eq!(
        u,
        vec![
            ("typical_p".to_string(), "0.9".to_string()),
            ("min_p".to_string(), "0.05".to_string()),
        ]
    );
    // Fields of the wrong type are typed errors naming the file and the field.
    for (v, field, says) in [
        (json!({"do_sample": "yes"}), "do_sample", "\"yes\""),
        (
            json!({"do_sample": true, "temperature": "hot"}),
            "temperature",
            "\"hot\"",
        ),
        (json!({"do_sample": true, "top_p": [0.9]}), "top_p", "[0.9]"),
        (json!({"do_sample": true, "top_k": -1}), "top_k", "-1"),
        (json!({"do_sample": true, "top_k": 2.5}), "top_k", "2.5"),
    ] {
        write(&v);
        match hf_err(generation_defaults(&dir)) {
            HfError::Generation {
                file,
                field: f,
                problem,
            } => {
                assert_eq!(
                    (file.as_str(), f.as_str()),
                    ("generation_config.json", field)
                );
                assert!(problem.contains(says), "{problem}");
            }
            e => panic!("expected a generation error, got {e:?}"),
        }
    }
    std::fs::write(dir.join("generation_config.json"), b"[1]").unwrap();
    let e = hf_err(generation_defaults(&dir));
    assert!(e.to_string().contains("not a JSON object"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
