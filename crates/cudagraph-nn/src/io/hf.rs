//! Decoder-only language models from Hugging Face files: a model folder's `config.json` read
//! into a typed [`DecoderConfig`] (GPT-2, and Llama with its close relatives Mistral and
//! Qwen2), and its
//! safetensors weights (`model.safetensors`, or shards listed by
//! `model.safetensors.index.json`) checked tensor by tensor against the config into a host-side
//! [`DecoderWeights`], which [`DecoderWeights::upload_parameters`] and
//! [`DecoderWeights::upload_as`] put on a device. [`eos_token_ids`] reads the ids that end a
//! sequence by default (`generation_config.json`, else `config.json`), and
//! [`generation_defaults`] the sampling `generation_config.json` asks for.
//!
//! Everything but the uploads works and is tested without a GPU. With the `tokenizers` feature,
//! `HfTokenizer` turns text into token ids and back through the folder's `tokenizer.json`;
//! without it, token ids as `Vec<u32>` are the interface.
//!
//! # Names and layouts
//!
//! Tensors keep their Hugging Face names, less GPT-2's optional `transformer.` prefix:
//! `wte.weight`, `h.0.attn.c_attn.weight`, ..., `model.layers.0.self_attn.q_proj.weight`, ...
//! ([`DecoderConfig::tensors`] lists them with their shapes, biases included where the config
//! has them: Qwen2's `q_proj`, `k_proj` and `v_proj`, or Llama's with `attention_bias` and
//! `mlp_bias`). `lm_head.weight` is present only
//! when the config does not tie it to the token embedding; a tied file that still stores it has
//! it dropped, as Hugging Face does.
//!
//! GPT-2's projections (`c_attn`, `c_proj`, `c_fc`) are `Conv1D` modules, whose weight is
//! stored `[in, out]`, the transpose of `nn.Linear`'s `[out, in]`. The file's shape is checked
//! as stored, and the weight is then **transposed on the host** while loading, so every
//! projection in [`DecoderWeights`] — GPT-2's and Llama's alike — is `[out, in]` as
//! [`Linear`](crate::nn::layers::Linear) keeps it (`y = x Wᵀ + b`).
//!
//! Buffers that old files carry and Hugging Face ignores (`h.{i}.attn.bias`,
//! `h.{i}.attn.masked_bias`, `model.layers.{i}.self_attn.rotary_emb.inv_freq`) are skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use cudagraph::Stream;
use half::{bf16, f16};
use safetensors::tensor::SafeTensors;
use serde_json::{Map, Value};

use super::dtype::{narrow, widen, Dtype};
use super::{read_file, IoError};
use crate::autograd::tensor::Parameter;
/// Llama 3's rotary frequency scaling (`rope_scaling` with `rope_type: "llama3"`), as the
/// rotary embedding takes it.
pub use crate::autograd::transformer::Llama3RopeScaling;
use crate::dtype::{Float, TypedBuffer};
use crate::error::{HfError, Result};
use crate::nn::sampling::SamplingParams;

type IoResult<T> = std::result::Result<T, IoError>;

/// A decoder's configuration, by the `model_type` of its `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub enum DecoderConfig {
    /// `model_type: "gpt2"`.
    Gpt2(Gpt2Config),
    /// `model_type: "llama"`, `"mistral"` or `"qwen2"`.
    Llama(LlamaConfig),
}

/// A GPT-2 model: learned positions, pre-LayerNorm blocks with biases, tanh-GELU MLP.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2Config {
    /// `n_embd`: the model width.
    pub n_embd: usize,
    /// `n_layer`: blocks.
    pub n_layer: usize,
    /// `n_head`: attention heads (head size `n_embd / n_head`).
    pub n_head: usize,
    /// `n_inner` (default `4 * n_embd`): the MLP's hidden width.
    pub n_inner: usize,
    /// `n_positions`: the longest sequence (rows of `wpe`).
    pub n_positions: usize,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `layer_norm_epsilon` (default 1e-5).
    pub layer_norm_epsilon: f64,
    /// `tie_word_embeddings` (default true): the output head is `wte`.
    pub tie_word_embeddings: bool,
    /// `torch_dtype` / `dtype`, when given.
    pub dtype: Option<Dtype>,
}

/// A Llama-family model: rotary positions, RMSNorm, grouped-query attention, SiLU-gated MLP,
/// biases where the config asks for them (Qwen2 on q, k and v).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// `model_type`: `"llama"`, `"mistral"` or `"qwen2"`.
    pub model_type: String,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `intermediate_size`: the MLP's hidden width.
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`: query heads.
    pub num_attention_heads: usize,
    /// `num_key_value_heads` (default `num_attention_heads`): key/value heads, dividing the
    /// query heads.
    pub num_key_value_heads: usize,
    /// `head_dim` (default `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// `rms_norm_eps` (default 1e-6).
    pub rms_norm_eps: f64,
    /// `rope_theta` (default 10000).
    pub rope_theta: f64,
    /// `rope_scaling`, when Llama 3's.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `tie_word_embeddings` (default false).
    pub tie_word_embeddings: bool,
    /// Whether `q_proj`, `k_proj` and `v_proj` have biases: always for Qwen2, Llama's
    /// `attention_bias` (default false) otherwise.
    pub qkv_bias: bool,
    /// Whether `o_proj` has a bias: Llama's `attention_bias`; never for Qwen2.
    pub o_bias: bool,
    /// Whether `gate_proj`, `up_proj` and `down_proj` have biases: Llama's `mlp_bias`
    /// (default false); never for Qwen2.
    pub mlp_bias: bool,
    /// The attention window where one applies (Mistral's `sliding_window`; Qwen2's when
    /// `use_sliding_window` is true or `layer_types` has a `"sliding_attention"` layer): a
    /// position attends to the `sliding_window` positions up to its own. Sequences of at most
    /// that many positions attend to all of them, as full attention does, and that is as far
    /// as this build runs such a model ([`crate::Decoder::max_positions`]).
    pub sliding_window: Option<usize>,
    /// `torch_dtype` / `dtype`, when given.
    pub dtype: Option<Dtype>,
}

/// One tensor a decoder needs: its name and its shape as stored in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// The Hugging Face name (GPT-2's without `transformer.`).
    pub name: String,
    /// The shape in the file (GPT-2's `Conv1D` weights `[in, out]`).
    pub shape: Vec<usize>,
    /// Whether loading transposes it to `[out, in]` (GPT-2's `Conv1D` weights).
    pub transpose: bool,
}

fn config_err(field: &str, problem: impl Into<String>) -> IoError {
    HfError::Config {
        field: field.to_string(),
        problem: problem.into(),
    }
    .into()
}

fn unsupported(field: &str, value: &Value, supported: &str) -> IoError {
    HfError::Unsupported {
        field: field.to_string(),
        value: value.to_string(),
        supported: supported.to_string(),
    }
    .into()
}

/// Typed access to a JSON object's fields, naming the field in every error.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl Fields<'_> {
    fn name(&self, f: &str) -> String {
        format!("{}{f}", self.prefix)
    }

    /// The field, treating JSON `null` as absent.
    fn get(&self, f: &str) -> Option<&Value> {
        self.obj.get(f).filter(|v| !v.is_null())
    }

    fn usize_opt(&self, f: &str) -> IoResult<Option<usize>> {
        match self.get(f) {
            None => Ok(None),
            Some(v) => match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
                Some(n) if n > 0 => Ok(Some(n)),
                _ => Err(config_err(
                    &self.name(f),
                    format!("is {v}; expected a positive integer"),
                )),
            },
        }
    }

    fn usize(&self, f: &str) -> IoResult<usize> {
        self.usize_opt(f)?
            .ok_or_else(|| config_err(&self.name(f), "is missing"))
    }

    fn f64_or(&self, f: &str, default: f64) -> IoResult<f64> {
        match self.get(f) {
            None => Ok(default),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(x),
                _ => Err(config_err(
                    &self.name(f),
                    format!("is {v}; expected a positive number"),
                )),
            },
        }
    }

    fn bool_or(&self, f: &str, default: bool) -> IoResult<bool> {
        match self.get(f) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| {
                config_err(&self.name(f), format!("is {v}; expected true or false"))
            }),
        }
    }

    fn str_or<'s>(&'s self, f: &str, default: &'s str) -> IoResult<&'s str> {
        match self.get(f) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| config_err(&self.name(f), format!("is {v}; expected a string"))),
        }
    }

    /// Fails unless the field is absent, null or `ok`.
    fn require(&self, f: &str, ok: &Value, supported: &str) -> IoResult<()> {
        match self.get(f) {
            Some(v) if v != ok => Err(unsupported(&self.name(f), v, supported)),
            _ => Ok(()),
        }
    }

    fn dtype(&self) -> IoResult<Option<Dtype>> {
        for f in ["torch_dtype", "dtype"] {
            if let Some(v) = self.get(f) {
                let d = v.as_str().and_then(|s| s.parse::<Dtype>().ok());
                return match d {
                    Some(d) => Ok(Some(d)),
                    None => Err(unsupported(f, v, "\"float32\", \"bfloat16\", \"float16\"")),
                };
            }
        }
        Ok(None)
    }
}

impl DecoderConfig {
    /// Reads a model folder's `config.json` (or the file itself, when `path` is one).
    pub fn read(path: &Path) -> IoResult<Self> {
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let bytes = read_file(&file)?;
        let text = String::from_utf8(bytes).map_err(|e| config_err("", e.to_string()))?;
        Self::from_json(&text)
    }

    /// Parses the text of a `config.json`. Anything this build cannot run (another
    /// `model_type`, activation, rotary scaling, a sliding window without its size) is an
    /// [`HfError::Unsupported`] naming the field, its value and what is supported.
    pub fn from_json(text: &str) -> IoResult<Self> {
        let v: Value = serde_json::from_str(text).map_err(|e| config_err("", e.to_string()))?;
        let obj = v
            .as_object()
            .ok_or_else(|| config_err("", "is not a JSON object"))?;
        let f = Fields { obj, prefix: "" };
        let model_type = obj
            .get("model_type")
            .ok_or_else(|| config_err("model_type", "is missing"))?;
        match model_type.as_str() {
            Some("gpt2") => Self::gpt2(&f).map(DecoderConfig::Gpt2),
            Some(t @ ("llama" | "mistral" | "qwen2")) => {
                Self::llama(&f, t).map(DecoderConfig::Llama)
            }
            _ => Err(unsupported(
                "model_type",
                model_type,
                "\"gpt2\", \"llama\", \"mistral\", \"qwen2\"",
            )),
        }
    }

    fn gpt2(f: &Fields<'_>) -> IoResult<Gpt2Config> {
        let act = f.str_or("activation_function", "gelu_new")?;
        if !matches!(act, "gelu_new" | "gelu_pytorch_tanh") {
            return Err(unsupported(
                "activation_function",
                &Value::from(act),
                "\"gelu_new\" (tanh GELU), \"gelu_pytorch_tanh\"",
            ));
        }
        f.require("add_cross_attention", &Value::Bool(false), "false")?;
        f.require("scale_attn_weights", &Value::Bool(true), "true")?;
        f.require(
            "scale_attn_by_inverse_layer_idx",
            &Value::Bool(false),
            "false",
        )?;
        let n_embd = f.usize("n_embd")?;
        let n_head = f.usize("n_head")?;
        if n_embd % n_head != 0 {
            return Err(config_err(
                "n_head",
                format!("is {n_head}, which does not divide n_embd = {n_embd}"),
            ));
        }
        let n_inner = match f.usize_opt("n_inner")? {
            Some(n) => n,
            None => n_embd
                .checked_mul(4)
                .ok_or_else(|| config_err("n_embd", "is too large"))?,
        };
        Ok(Gpt2Config {
            n_embd,
            n_layer: f.usize("n_layer")?,
            n_head,
            n_inner,
            n_positions: f.usize("n_positions")?,
            vocab_size: f.usize("vocab_size")?,
            layer_norm_epsilon: f.f64_or("layer_norm_epsilon", 1e-5)?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", true)?,
            dtype: f.dtype()?,
        })
    }

    fn llama(f: &Fields<'_>, model_type: &str) -> IoResult<LlamaConfig> {
        let act = f.str_or("hidden_act", "silu")?;
        if act != "silu" {
            return Err(unsupported("hidden_act", &Value::from(act), "\"silu\""));
        }
        let qwen2 = model_type == "qwen2";
        let (qkv_bias, o_bias, mlp_bias) = if qwen2 {
            (true, false, false)
        } else {
            let attention = f.bool_or("attention_bias", false)?;
            (attention, attention, f.bool_or("mlp_bias", false)?)
        };
        // Qwen2 keeps a `sliding_window` size that only `use_sliding_window` switches on;
        // Mistral's applies whenever it is set; `layer_types` (transformers 5) names each
        // layer's kind. Any sliding layer makes the window a bound on the sequence.
        let mut sliding = if qwen2 {
            f.bool_or("use_sliding_window", false)?
        } else {
            f.get("sliding_window").is_some()
        };
        if let Some(types) = f.get("layer_types") {
            let kinds = types.as_array().filter(|a| {
                a.iter()
                    .all(|t| t == "full_attention" || t == "sliding_attention")
            });
            let Some(kinds) = kinds else {
                return Err(unsupported(
                    "layer_types",
                    types,
                    "\"full_attention\" or \"sliding_attention\" for each layer",
                ));
            };
            sliding |= kinds.iter().any(|t| t == "sliding_attention");
        }
        let sliding_window = match sliding {
            false => None,
            true => Some(f.usize_opt("sliding_window")?.ok_or_else(|| {
                config_err(
                    "sliding_window",
                    "is missing, but the config asks for sliding-window attention",
                )
            })?),
        };
        let hidden_size = f.usize("hidden_size")?;
        let heads = f.usize("num_attention_heads")?;
        let kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(heads);
        if heads % kv_heads != 0 {
            return Err(config_err(
                "num_key_value_heads",
                format!("is {kv_heads}, which does not divide num_attention_heads = {heads}"),
            ));
        }
        let head_dim = match f.usize_opt("head_dim")? {
            Some(d) => d,
            None if hidden_size % heads == 0 => hidden_size / heads,
            None => {
                return Err(config_err(
                    "num_attention_heads",
                    format!(
                        "is {heads}, which does not divide hidden_size = {hidden_size} (and head_dim is not given)"
                    ),
                ))
            }
        };
        if heads.checked_mul(head_dim).is_none() {
            return Err(config_err("head_dim", "is too large"));
        }
        // transformers 5 writes `rope_parameters` (theta and scaling in one object); older
        // files and the Hub's checkpoints have `rope_theta` and `rope_scaling`.
        let (rope_theta, rope_scaling) = match f.get("rope_parameters") {
            Some(p) => {
                let obj = p.as_object().ok_or_else(|| {
                    config_err("rope_parameters", format!("is {p}; expected an object"))
                })?;
                let inner = Fields {
                    obj,
                    prefix: "rope_parameters.",
                };
                let theta = match inner.get("rope_theta") {
                    Some(_) => inner.f64_or("rope_theta", 10000.0)?,
                    None => f.f64_or("rope_theta", 10000.0)?,
                };
                let scaling = if inner.get("rope_type").or(inner.get("type")).is_some() {
                    rope_scaling("rope_parameters", Some(p))?
                } else {
                    None
                };
                (theta, scaling)
            }
            None => (
                f.f64_or("rope_theta", 10000.0)?,
                rope_scaling("rope_scaling", f.get("rope_scaling"))?,
            ),
        };
        Ok(LlamaConfig {
            model_type: model_type.to_string(),
            hidden_size,
            intermediate_size: f.usize("intermediate_size")?,
            num_hidden_layers: f.usize("num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            max_position_embeddings: f.usize("max_position_embeddings")?,
            vocab_size: f.usize("vocab_size")?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            qkv_bias,
            o_bias,
            mlp_bias,
            sliding_window,
            dtype: f.dtype()?,
        })
    }

    /// The number of decoder blocks.
    pub fn layers(&self) -> usize {
        match self {
            DecoderConfig::Gpt2(c) => c.n_layer,
            DecoderConfig::Llama(c) => c.num_hidden_layers,
        }
    }

    /// Whether the output head is the token embedding.
    pub fn tied(&self) -> bool {
        match self {
            DecoderConfig::Gpt2(c) => c.tie_word_embeddings,
            DecoderConfig::Llama(c) => c.tie_word_embeddings,
        }
    }

    /// The config's `model_type`.
    pub fn model_type(&self) -> &str {
        match self {
            DecoderConfig::Gpt2(_) => "gpt2",
            DecoderConfig::Llama(c) => &c.model_type,
        }
    }

    /// Every tensor the model needs, in layer order, with its shape as stored in the file.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        let mut out = Vec::new();
        let mut add = |name: String, shape: &[usize], transpose: bool| {
            out.push(TensorSpec {
                name,
                shape: shape.to_vec(),
                transpose,
            })
        };
        match self {
            DecoderConfig::Gpt2(c) => {
                let (d, m) = (c.n_embd, c.n_inner);
                add("wte.weight".into(), &[c.vocab_size, d], false);
                add("wpe.weight".into(), &[c.n_positions, d], false);
                for i in 0..c.n_layer {
                    let p = format!("h.{i}.");
                    for ln in ["ln_1", "ln_2"] {
                        add(format!("{p}{ln}.weight"), &[d], false);
                        add(format!("{p}{ln}.bias"), &[d], false);
                    }
                    for (name, inp, outp) in [
                        ("attn.c_attn", d, 3 * d),
                        ("attn.c_proj", d, d),
                        ("mlp.c_fc", d, m),
                        ("mlp.c_proj", m, d),
                    ] {
                        add(format!("{p}{name}.weight"), &[inp, outp], true);
                        add(format!("{p}{name}.bias"), &[outp], false);
                    }
                }
                add("ln_f.weight".into(), &[d], false);
                add("ln_f.bias".into(), &[d], false);
                if !c.tie_word_embeddings {
                    add("lm_head.weight".into(), &[c.vocab_size, d], false);
                }
            }
            DecoderConfig::Llama(c) => {
                let d = c.hidden_size;
                let q = c.num_attention_heads * c.head_dim;
                let kv = c.num_key_value_heads * c.head_dim;
                let m = c.intermediate_size;
                add(
                    "model.embed_tokens.weight".into(),
                    &[c.vocab_size, d],
                    false,
                );
                for i in 0..c.num_hidden_layers {
                    let p = format!("model.layers.{i}.");
                    add(format!("{p}input_layernorm.weight"), &[d], false);
                    for (name, shape, bias) in [
                        ("self_attn.q_proj", [q, d], c.qkv_bias),
                        ("self_attn.k_proj", [kv, d], c.qkv_bias),
                        ("self_attn.v_proj", [kv, d], c.qkv_bias),
                        ("self_attn.o_proj", [d, q], c.o_bias),
                    ] {
                        add(format!("{p}{name}.weight"), &shape, false);
                        if bias {
                            add(format!("{p}{name}.bias"), &shape[..1], false);
                        }
                    }
                    add(format!("{p}post_attention_layernorm.weight"), &[d], false);
                    for (name, shape) in [
                        ("mlp.gate_proj", [m, d]),
                        ("mlp.up_proj", [m, d]),
                        ("mlp.down_proj", [d, m]),
                    ] {
                        add(format!("{p}{name}.weight"), &shape, false);
                        if c.mlp_bias {
                            add(format!("{p}{name}.bias"), &shape[..1], false);
                        }
                    }
                }
                add("model.norm.weight".into(), &[d], false);
                if !c.tie_word_embeddings {
                    add("lm_head.weight".into(), &[c.vocab_size, d], false);
                }
            }
        }
        out
    }

    /// The name a tensor of the file has in [`DecoderWeights`] (GPT-2's `transformer.`
    /// prefix dropped), or `None` for a buffer Hugging Face ignores.
    fn canonical(&self, name: &str) -> Option<String> {
        match self {
            DecoderConfig::Gpt2(_) => {
                let n = name.strip_prefix("transformer.").unwrap_or(name);
                let ignored = n.starts_with("h.")
                    && (n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias"));
                (!ignored).then(|| n.to_string())
            }
            DecoderConfig::Llama(_) => {
                let ignored =
                    name.starts_with("model.layers.") && name.ends_with(".rotary_emb.inv_freq");
                (!ignored).then(|| name.to_string())
            }
        }
    }
}

fn rope_scaling(field: &str, v: Option<&Value>) -> IoResult<Option<Llama3RopeScaling>> {
    let Some(v) = v else { return Ok(None) };
    let obj = v
        .as_object()
        .ok_or_else(|| config_err(field, format!("is {v}; expected an object or null")))?;
    let prefix = format!("{field}.");
    let f = Fields {
        obj,
        prefix: &prefix,
    };
    let (field, kind) = match (f.get("rope_type"), f.get("type")) {
        (Some(t), _) => (f.name("rope_type"), t),
        (None, Some(t)) => (f.name("type"), t),
        (None, None) => return Err(config_err(&f.name("rope_type"), "is missing")),
    };
    match kind.as_str() {
        Some("default") => Ok(None),
        Some("llama3") => {
            let s = Llama3RopeScaling {
                factor: f.f64_or("factor", f64::NAN)?,
                low_freq_factor: f.f64_or("low_freq_factor", f64::NAN)?,
                high_freq_factor: f.f64_or("high_freq_factor", f64::NAN)?,
                original_max_position_embeddings: f.usize("original_max_position_embeddings")?
                    as f64,
            };
            for (name, x) in [
                ("factor", s.factor),
                ("low_freq_factor", s.low_freq_factor),
                ("high_freq_factor", s.high_freq_factor),
            ] {
                if x.is_nan() {
                    return Err(config_err(&f.name(name), "is missing"));
                }
            }
            if s.high_freq_factor <= s.low_freq_factor {
                return Err(config_err(
                    &f.name("high_freq_factor"),
                    format!(
                        "is {}, which must exceed low_freq_factor = {}",
                        s.high_freq_factor, s.low_freq_factor
                    ),
                ));
            }
            Ok(Some(s))
        }
        _ => Err(unsupported(&field, kind, "null, \"default\", \"llama3\"")),
    }
}

/// One tensor of a decoder's weights in host memory, in its file's dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderTensor {
    /// The dtype in the file.
    pub dtype: Dtype,
    /// The dimensions, outermost first (projections `[out, in]`, see the module docs).
    pub shape: Vec<usize>,
    /// The values' little-endian bytes as `dtype`, row-major.
    pub bytes: Vec<u8>,
}

impl DecoderTensor {
    /// The values as f32 (exact).
    pub fn to_f32(&self) -> Vec<f32> {
        widen(self.dtype, &self.bytes)
    }

    /// The values as `T`: the file's own bits when `T` is its dtype, else widened to f32 and
    /// rounded to nearest even; a finite value `T` cannot hold is an [`IoError::Overflow`]
    /// naming the tensor `name`.
    pub fn to_vec<T: Float>(&self, name: &str) -> IoResult<Vec<T>> {
        let bytes = if T::DTYPE == self.dtype {
            self.bytes.clone()
        } else {
            narrow(name, T::DTYPE, &self.to_f32())?
        };
        Ok(match T::DTYPE {
            Dtype::F32 => widen(Dtype::F32, &bytes)
                .into_iter()
                .map(T::from_f32)
                .collect(),
            Dtype::Bf16 => u16s(&bytes)
                .map(|b| T::from_f32(bf16::from_bits(b).to_f32()))
                .collect(),
            Dtype::F16 => u16s(&bytes)
                .map(|b| T::from_f32(f16::from_bits(b).to_f32()))
                .collect(),
        })
    }
}

fn u16s(bytes: &[u8]) -> impl Iterator<Item = u16> + '_ {
    bytes
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
}

/// A weight on the device as [`DecoderWeights::upload_as`] puts it there.
#[derive(Clone, Debug)]
pub struct DeviceWeight {
    /// The dimensions, outermost first.
    pub shape: Vec<usize>,
    /// The values, in the dtype asked for.
    pub buffer: TypedBuffer,
}

/// A decoder's config and every weight it needs, checked, in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderWeights {
    /// The configuration the weights were checked against.
    pub config: DecoderConfig,
    /// The weights by name (see the module docs), each once.
    pub tensors: BTreeMap<String, DecoderTensor>,
}

impl DecoderWeights {
    /// Reads a Hugging Face model folder: `config.json`, and `model.safetensors` or the shards
    /// that `model.safetensors.index.json` lists.
    pub fn read(dir: &Path) -> IoResult<Self> {
        let config = DecoderConfig::read(dir)?;
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<(String, Vec<u8>)> = if single.is_file() {
            vec![("model.safetensors".to_string(), read_file(&single)?)]
        } else if index.is_file() {
            let shards = shard_names(&read_file(&index)?)?;
            let mut files = Vec::with_capacity(shards.len());
            for shard in shards.values().collect::<BTreeSet<_>>() {
                files.push((shard.clone(), read_file(&dir.join(shard))?));
            }
            let weights = Self::from_files(config, &files)?;
            // Every tensor must sit in the shard the index names.
            check_index(&shards, &files)?;
            return Ok(weights);
        } else {
            return Err(HfError::NoWeights {
                dir: dir.to_path_buf(),
            }
            .into());
        };
        Self::from_files(config, &files)
    }

    /// The weights `config` needs from safetensors files' bytes (`(name, bytes)`: one file, or
    /// every shard), each tensor's name, shape and dtype checked. Reports every missing tensor
    /// at once, and every extra one.
    pub fn from_files(config: DecoderConfig, files: &[(String, Vec<u8>)]) -> IoResult<Self> {
        let specs = config.tensors();
        let wanted: BTreeMap<&str, &TensorSpec> =
            specs.iter().map(|s| (s.name.as_str(), s)).collect();
        let mut found: BTreeMap<String, (&str, DecoderTensor)> = BTreeMap::new();
        let mut extra = Vec::new();
        for (file, bytes) in files {
            let st = SafeTensors::deserialize(bytes).map_err(|e| IoError::Format {
                what: file.clone(),
                detail: e.to_string(),
            })?;
            let mut names = st.names();
            names.sort_unstable();
            for raw in names {
                let Some(name) = config.canonical(raw) else {
                    continue;
                };
                if name == "lm_head.weight" && config.tied() {
                    continue; // Tied: Hugging Face uses the embedding.
                }
                let Some(spec) = wanted.get(name.as_str()) else {
                    extra.push(raw.to_string());
                    continue;
                };
                let t = st.tensor(raw).map_err(|e| IoError::Format {
                    what: file.clone(),
                    detail: e.to_string(),
                })?;
                let dtype = Dtype::from_file(t.dtype()).ok_or_else(|| HfError::Dtype {
                    name: raw.to_string(),
                    found: format!("{:?}", t.dtype()),
                })?;
                if t.shape() != spec.shape.as_slice() {
                    return Err(HfError::Shape {
                        name: raw.to_string(),
                        expected: spec.shape.clone(),
                        found: t.shape().to_vec(),
                    }
                    .into());
                }
                let tensor = if spec.transpose {
                    let (rows, cols) = (spec.shape[0], spec.shape[1]);
                    DecoderTensor {
                        dtype,
                        shape: vec![cols, rows],
                        bytes: transpose(t.data(), rows, cols, dtype.size()),
                    }
                } else {
                    DecoderTensor {
                        dtype,
                        shape: spec.shape.clone(),
                        bytes: t.data().to_vec(),
                    }
                };
                if let Some((first, _)) = found.get(&name) {
                    return Err(HfError::Duplicate {
                        name,
                        first: first.to_string(),
                        second: file.clone(),
                    }
                    .into());
                }
                found.insert(name, (file.as_str(), tensor));
            }
        }
        if !extra.is_empty() {
            extra.sort();
            return Err(HfError::ExtraTensors {
                model: config.model_type().to_string(),
                names: extra,
            }
            .into());
        }
        let missing: Vec<String> = specs
            .iter()
            .filter(|s| !found.contains_key(&s.name))
            .map(|s| s.name.clone())
            .collect();
        if !missing.is_empty() {
            return Err(HfError::MissingTensors { names: missing }.into());
        }
        let tensors = found.into_iter().map(|(n, (_, t))| (n, t)).collect();
        Ok(Self { config, tensors })
    }

    /// The weight `name` (as [`DecoderConfig::tensors`] names it). The output head of a tied
    /// model is `wte.weight` / `model.embed_tokens.weight`.
    pub fn get(&self, name: &str) -> Option<&DecoderTensor> {
        self.tensors.get(name)
    }

    /// Every weight as an f32 [`Parameter`] (the training masters), by name, widened exactly.
    pub fn upload_parameters(&self, s: &Stream) -> Result<BTreeMap<String, Parameter>> {
        self.tensors
            .iter()
            .map(|(name, t)| {
                let p = Parameter::from_host(s, name, &t.to_f32(), &t.shape)?;
                Ok((name.clone(), p))
            })
            .collect()
    }

    /// Every weight on the device in `dtype` (for inference): a tensor already in `dtype` is
    /// copied bit for bit; another is rounded to nearest even, and a finite value `dtype`
    /// cannot hold is an [`IoError::Overflow`].
    pub fn upload_as(&self, s: &Stream, dtype: Dtype) -> Result<BTreeMap<String, DeviceWeight>> {
        fn up<T: Float>(s: &Stream, name: &str, t: &DecoderTensor) -> Result<TypedBuffer> {
            let host = t.to_vec::<T>(name)?;
            Ok(TypedBuffer::new(Arc::new(s.alloc_from_host(&host)?)))
        }
        self.tensors
            .iter()
            .map(|(name, t)| {
                let buffer = match dtype {
                    Dtype::F32 => up::<f32>(s, name, t)?,
                    Dtype::Bf16 => up::<bf16>(s, name, t)?,
                    Dtype::F16 => up::<f16>(s, name, t)?,
                };
                let w = DeviceWeight {
                    shape: t.shape.clone(),
                    buffer,
                };
                Ok((name.clone(), w))
            })
            .collect()
    }
}

/// The `[cols, rows]` transpose of a row-major `[rows, cols]` matrix of `size`-byte elements.
fn transpose(bytes: &[u8], rows: usize, cols: usize, size: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        for c in 0..cols {
            let src = (r * cols + c) * size;
            let dst = (c * rows + r) * size;
            out[dst..dst + size].copy_from_slice(&bytes[src..src + size]);
        }
    }
    out
}

/// The index's `weight_map`: tensor name → shard file name.
fn shard_names(bytes: &[u8]) -> IoResult<BTreeMap<String, String>> {
    let bad = |m: String| IoError::from(HfError::Index(m));
    let v: Value = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut out = BTreeMap::new();
    for (name, shard) in map {
        let shard = shard
            .as_str()
            .ok_or_else(|| bad(format!("`{name}` maps to {shard}, not a file name")))?;
        if shard.contains('/') || shard.contains('\\') || shard.starts_with('.') {
            return Err(bad(format!(
                "`{name}` maps to `{shard}`, which is not a file in the folder"
            )));
        }
        out.insert(name.clone(), shard.to_string());
    }
    if out.is_empty() {
        return Err(bad("`weight_map` is empty".into()));
    }
    Ok(out)
}

/// Every tensor the index lists is in the shard it names, and every tensor of a shard is in the
/// index.
fn check_index(map: &BTreeMap<String, String>, files: &[(String, Vec<u8>)]) -> IoResult<()> {
    let mut seen = BTreeSet::new();
    for (file, bytes) in files {
        let st = SafeTensors::deserialize(bytes).map_err(|e| IoError::Format {
            what: file.clone(),
            detail: e.to_string(),
        })?;
        for name in st.names() {
            match map.get(name) {
                Some(f) if f == file => {
                    seen.insert(name.to_string());
                }
                Some(f) => {
                    return Err(HfError::Index(format!(
                        "`{name}` is listed in {f} but stored in {file}"
                    ))
                    .into())
                }
                None => {
                    return Err(HfError::Index(format!(
                        "{file} holds `{name}`, which the weight_map does not list"
                    ))
                    .into())
                }
            }
        }
    }
    if let Some(name) = map.keys().find(|n| !seen.contains(*n)) {
        return Err(HfError::Index(format!(
            "`{name}` is listed in {} but not stored there",
            map[name]
        ))
        .into());
    }
    Ok(())
}

/// The token ids that end a sequence by default, as Hugging Face's `generate` takes them: the
/// `eos_token_id` of the folder's `generation_config.json` where that file sets it, else that
/// of its `config.json`; one id or a list of ids (repeats dropped, order kept). Empty where
/// neither sets one (absent or `null`). A value other than a token id (an integer in
/// `0..=i32::MAX`) or a list of them is an [`HfError::Generation`] naming the file; a folder
/// without `config.json` is an [`IoError::File`].
pub fn eos_token_ids(dir: &Path) -> IoResult<Vec<i32>> {
    let generation = dir.join("generation_config.json");
    if generation.exists() {
        if let Some(ids) = eos_from_json("generation_config.json", &read_file(&generation)?)? {
            return Ok(ids);
        }
    }
    Ok(eos_from_json("config.json", &read_file(&dir.join("config.json"))?)?.unwrap_or_default())
}

/// An [`HfError::Generation`] about `field` of the file `file`.
fn generation_error(file: &str, field: &str, problem: String) -> IoError {
    HfError::Generation {
        file: file.to_string(),
        field: field.to_string(),
        problem,
    }
    .into()
}

/// The JSON object in `bytes` (the file `file`); anything else is an [`HfError::Generation`].
fn generation_object(file: &str, bytes: &[u8]) -> IoResult<Map<String, Value>> {
    match serde_json::from_slice(bytes) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(_) => Err(generation_error(file, "", "is not a JSON object".into())),
        Err(e) => Err(generation_error(file, "", e.to_string())),
    }
}

/// `eos_token_id` of the JSON object in `bytes` (the file `file`): `None` where it is absent or
/// `null`.
fn eos_from_json(file: &str, bytes: &[u8]) -> IoResult<Option<Vec<i32>>> {
    let err = |field: &str, problem: String| generation_error(file, field, problem);
    let obj = generation_object(file, bytes)?;
    let id = |x: &Value| -> IoResult<i32> {
        x.as_u64()
            .and_then(|n| i32::try_from(n).ok())
            .ok_or_else(|| {
                err(
                    "eos_token_id",
                    format!(
                        "holds {x}, not a token id (an integer from 0 to {})",
                        i32::MAX
                    ),
                )
            })
    };
    let ids = match obj.get("eos_token_id") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(list)) => list.iter().map(id).collect::<IoResult<Vec<_>>>()?,
        Some(x) => vec![id(x)?],
    };
    let mut seen = BTreeSet::new();
    Ok(Some(ids.into_iter().filter(|i| seen.insert(*i)).collect()))
}

/// What a folder's `generation_config.json` says about choosing tokens.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    /// `Some` where the file sets `do_sample` true: its `temperature`, `top_k` and `top_p`, as
    /// transformers' `generate` applies them (its defaults 1.0, 50 and 1.0 where the file leaves
    /// one out or sets it to `null`); `None` (greedy) where there is no such file or it leaves
    /// `do_sample` out, `null` or false.
    pub sampling: Option<SamplingParams>,
    /// Settings of the file that transformers' `generate` would apply and ours does not
    /// (`repetition_penalty`, `no_repeat_ngram_size`, beams, ...; with sampling also
    /// `typical_p`, `min_p`, ...), as (field, value) in the file's order of this list.
    pub unsupported: Vec<(String, String)>,
}

/// Fields transformers' `generate` applies in any mode, with the value that does nothing.
const GENERATION_ALWAYS: &[(&str, Option<f64>)] = &[
    ("repetition_penalty", Some(1.0)),
    ("no_repeat_ngram_size", Some(0.0)),
    ("num_beams", Some(1.0)),
    ("min_length", Some(0.0)),
    ("min_new_tokens", Some(0.0)),
    ("bad_words_ids", None),
    ("suppress_tokens", None),
    ("begin_suppress_tokens", None),
    ("sequence_bias", None),
    ("forced_bos_token_id", None),
    ("forced_eos_token_id", None),
    ("exponential_decay_length_penalty", None),
];

/// Fields transformers applies only when sampling, with the value that does nothing.
const GENERATION_SAMPLING: &[(&str, Option<f64>)] = &[
    ("typical_p", Some(1.0)),
    ("min_p", None),
    ("top_h", None),
    ("epsilon_cutoff", Some(0.0)),
    ("eta_cutoff", Some(0.0)),
];

/// Reads the folder's `generation_config.json` (a folder without one: greedy, nothing
/// unsupported). A field of the wrong type (`do_sample` not a boolean, `temperature` or
/// `top_p` not a number, `top_k` not a non-negative integer) is an [`HfError::Generation`]
/// naming the file and the field; the values themselves are checked where they are used
/// (`SamplingParams`).
pub fn generation_defaults(dir: &Path) -> IoResult<GenerationDefaults> {
    let path = dir.join("generation_config.json");
    if !path.exists() {
        return Ok(GenerationDefaults::default());
    }
    generation_from_json("generation_config.json", &read_file(&path)?)
}

fn generation_from_json(file: &str, bytes: &[u8]) -> IoResult<GenerationDefaults> {
    let err = |field: &str, problem: String| generation_error(file, field, problem);
    let obj = generation_object(file, bytes)?;
    // A field left out or `null` is unset.
    let get = |k: &str| obj.get(k).filter(|x| !x.is_null());
    let number = |k: &str, default: f64| -> IoResult<f64> {
        get(k).map_or(Ok(default), |x| {
            x.as_f64()
                .ok_or_else(|| err(k, format!("holds {x}, not a number")))
        })
    };
    let do_sample = match get("do_sample") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(x) => return Err(err("do_sample", format!("holds {x}, not true or false"))),
    };
    let sampling = if do_sample {
        let top_k = match get("top_k") {
            None => 50,
            Some(x) => x
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| err("top_k", format!("holds {x}, not a count of tokens")))?,
        };
        Some(SamplingParams {
            temperature: number("temperature", 1.0)? as f32,
            top_k,
            top_p: number("top_p", 1.0)? as f32,
        })
    } else {
        None
    };
    let in_effect = |(k, neutral): &(&str, Option<f64>)| {
        let x = get(k)?;
        let idle = match (x, neutral) {
            (Value::Array(a), _) => a.is_empty(),
            (Value::Object(o), _) => o.is_empty(),
            (x, Some(n)) => x.as_f64() == Some(*n),
            (_, None) => false,
        };
        (!idle).then(|| (k.to_string(), x.to_string()))
    };
    let mut unsupported: Vec<(String, String)> =
        GENERATION_ALWAYS.iter().filter_map(in_effect).collect();
    if do_sample {
        unsupported.extend(GENERATION_SAMPLING.iter().filter_map(in_effect));
    }
    Ok(GenerationDefaults {
        sampling,
        unsupported,
    })
}

/// A Hugging Face tokenizer (`tokenizer.json`): text to token ids and back. Needs the
/// `tokenizers` feature.
#[cfg(feature = "tokenizers")]
pub struct HfTokenizer(tokenizers::Tokenizer);

#[cfg(feature = "tokenizers")]
impl HfTokenizer {
    /// Reads a model folder's `tokenizer.json` (or the file itself, when `path` is one).
    pub fn read(path: &Path) -> IoResult<Self> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        Self::from_bytes(&read_file(&file)?)
    }

    /// Parses the bytes of a `tokenizer.json`.
    pub fn from_bytes(bytes: &[u8]) -> IoResult<Self> {
        tokenizers::Tokenizer::from_bytes(bytes)
            .map(Self)
            .map_err(|e| HfError::Tokenizer(e.to_string()).into())
    }

    /// The token ids of `text`, with the special tokens the tokenizer's post-processor adds
    /// (a BOS token for Llama) when `special` is true.
    pub fn encode(&self, text: &str, special: bool) -> IoResult<Vec<u32>> {
        self.0
            .encode(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| HfError::Tokenizer(e.to_string()).into())
    }

    /// The text of `ids`, leaving out special tokens when `skip_special` is true.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> IoResult<String> {
        self.0
            .decode(ids, skip_special)
            .map_err(|e| HfError::Tokenizer(e.to_string()).into())
    }

    /// The number of tokens, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.0.get_vocab_size(true)
    }
}

#[cfg(feature = "tokenizers")]
impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}
