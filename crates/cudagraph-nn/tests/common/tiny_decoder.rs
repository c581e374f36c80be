//! Tiny random GPT-2, Llama and Qwen2 decoders built in memory (config JSON and safetensors bytes),
//! shared by the decoder and generation tests.

#![allow(dead_code)]

use cudagraph_nn::io::hf::{DecoderConfig, DecoderWeights};
use safetensors::tensor::{Dtype as FileDtype, TensorView};

pub const GPT2: &str = r#"{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
    "n_positions": 32, "vocab_size": 97, "layer_norm_epsilon": 1e-5}"#;

pub const LLAMA: &str = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
    "vocab_size": 97, "tie_word_embeddings": false,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;

/// Qwen2: q, k and v with biases, a sliding window left off, tied head.
pub const QWEN2: &str = r#"{"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 64,
    "vocab_size": 97, "tie_word_embeddings": true, "use_sliding_window": false,
    "sliding_window": 64}"#;

/// Llama with every bias: `attention_bias` (q, k, v, o) and `mlp_bias` (gate, up, down).
pub const LLAMA_BIASED: &str = r#"{"model_type": "llama", "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "max_position_embeddings": 64, "vocab_size": 97, "tie_word_embeddings": false,
    "attention_bias": true, "mlp_bias": true}"#;

/// A deterministic uniform generator in [-1, 1).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }
}

/// Random f32 weights for every tensor of `config`, as one safetensors file's bytes: norm
/// weights near 1, small biases, embeddings of ±0.5, projections scaled by 1/√fan-in.
pub fn safetensors_bytes(config: &DecoderConfig, seed: u64) -> Vec<u8> {
    let mut rng = Lcg(seed);
    let specs = config.tensors();
    let data: Vec<Vec<u8>> = specs
        .iter()
        .map(|spec| {
            let n: usize = spec.shape.iter().product();
            let name = &spec.name;
            let fan_in = if spec.transpose {
                spec.shape[0]
            } else {
                *spec.shape.last().unwrap()
            };
            let one_d = spec.shape.len() == 1;
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    let u = rng.next();
                    let x = if one_d && name.ends_with("weight") {
                        1.0 + 0.2 * u
                    } else if one_d {
                        0.1 * u
                    } else if name.contains("wte")
                        || name.contains("wpe")
                        || name.contains("embed_tokens")
                        || name.contains("lm_head")
                    {
                        0.5 * u
                    } else {
                        1.7 * u / (fan_in as f64).sqrt()
                    };
                    x as f32
                })
                .collect();
            v.iter().flat_map(|x| x.to_le_bytes()).collect()
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = specs
        .iter()
        .zip(&data)
        .map(|(s, b)| {
            (
                s.name.clone(),
                TensorView::new(FileDtype::F32, s.shape.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::tensor::serialize(views, None).unwrap()
}

pub fn weights(json: &str, seed: u64) -> DecoderWeights {
    let config = DecoderConfig::from_json(json).unwrap();
    let bytes = safetensors_bytes(&config, seed);
    DecoderWeights::from_files(config, &[("model.safetensors".into(), bytes)]).unwrap()
}
