//! A decoder-only language model for inference (GPT-2 and the Llama family) on a key/value
//! cache, built for CUDA graphs: [`Decoder`] holds the weights on the device in one dtype,
//! [`DecoderCache`] one [`KvCache`] per layer with `slots` sequence slots, and
//! [`Decoder::forward`] runs `rows` rows of `tokens` tokens — a prefill of prompts or one
//! decode step — reading token ids, positions and cache slots from device buffers, so a step
//! captured once stays valid while the host (or a kernel) rewrites them between replays.
//!
//! # Semantics (Hugging Face transformers)
//!
//! Activations stay in the model's dtype between operations, as Hugging Face keeps them;
//! inside each fused operation values are f32 and rounded once (norms, the rotary embedding,
//! SwiGLU, products with f32 accumulation), so 16-bit results differ from Hugging Face's by a
//! few units of the last place, not more. GPT-2: token + learned position embedding,
//! pre-LayerNorm blocks (`layer_norm_epsilon`), fused `c_attn` with bias, `gelu_new` (tanh)
//! MLP, tied head. Llama / Mistral / Qwen2: RMSNorm (`rms_norm_eps`), biases where the
//! config has them (Qwen2's on q, k and v; Llama's `attention_bias` on q, k, v and o, its
//! `mlp_bias` on gate, up and down; each added inside its product, stacked like the weights),
//! rotary embedding "rotate half" with `rope_theta` and Llama 3's `rope_scaling`,
//! grouped-query attention, SwiGLU MLP, tied or untied head. Logits are f32.
//!
//! # One layer, launch by launch
//!
//! norm → one q|k|v product (Llama's three weights concatenated once at load; GPT-2's bias
//! fused) → attention over the cache, which for one token a row splits the product itself
//! (rotates q and k, writes k and v into the cache at (slot, position)); longer rows (a
//! prefill) first run one kernel that does that split and writes q out → the output product
//! (bias fused)
//! → norm, which first adds that product into the residual stream (in place) → MLP up (GPT-2:
//! bias and GELU fused; Llama: gate and up concatenated in one product, then one SwiGLU
//! kernel) → down product, added into the stream by the next layer's first norm (or the final
//! norm). A decode step: GPT-2 7 launches a layer, Llama 8 (a prefill one more); plus the
//! embedding (one kernel), the final norm and the head product. In 16-bit models at one to
//! four rows, a norm (with its residual add) or SwiGLU runs inside the product after it where
//! the registry chose the few-row lane kernel for that product and its grid fits the device
//! at once (`gemm_lowp_frozen_from`): one launch instead of two, the same bits; such a norm
//! writes the residual sums into a spare buffer, which becomes the stream. f32 models run the
//! products with `run_gemm` (GPT-2's GELU is then one more elementwise kernel). The residual
//! adds round as Hugging Face's do: the product is rounded to the model's type, then the sum
//! (adding in the product's epilogue instead rounds once, and measurably moves 16-bit logits
//! away from Hugging Face's).
//!
//! # Rows of different lengths
//!
//! The rows of one call share `tokens`. A caller batching prompts of different lengths pads
//! the shorter rows at their end: a padded token's position continues past its row's real end
//! (`len, len + 1, …`), so its key and value land at positions the real sequence has not
//! reached yet, and attention reads only positions `0..=own position`. No real token reads a
//! padded key; the next real tokens overwrite those positions before anything reads them. The
//! padded tokens' logits are meaningless (with [`LogitsFor::Last`] the caller must then take
//! a short row's logits from a call that ends at its real last token, or use
//! [`LogitsFor::All`] and read row `b`'s token `len_b - 1`). Padded positions must still be
//! below the cache's `max_len` (and GPT-2's `n_positions`), or they are reported as errors.
//! The rows of one call need distinct slots: rows sharing a slot write and read the same cache
//! positions in one kernel (in bounds, but their results are then unspecified).
//!
//! Misuse is reported before anything runs (lengths, shapes, dtypes, rows past the cache's
//! slots, tokens past its length); ids, positions and slots are device data, so an id outside
//! the vocabulary, a position outside the cache or the position table, or a slot outside the
//! cache is reported through the stream's check record at the next synchronisation, touching
//! no memory outside the buffers.

use std::any::Any;
use std::path::Path;

use cudagraph::memory::{bf16, f16};
use cudagraph::{DeviceBuffer, Queue, QueueExt, Stream};

use crate::autograd::attention::KvCache;
use crate::autograd::transformer::{llama3_frequency_scale, rope_inv_freq};
use crate::dtype::{Dtype, Float};
use crate::engine::gemm::{run_gemm, Epilogue, GemmFamily, GemmOp};
use crate::engine::gemm_lowp::{gemm_lowp_frozen, gemm_lowp_frozen_from};
use crate::error::{NnError, Result};
use crate::extent::{need, on_device};
use crate::io::hf::{DecoderConfig, DecoderWeights};
use crate::kernels::attention::AttentionShape;
use crate::kernels::decoder::{DecoderKernels, QkvDims};
use crate::kernels::gemv::{RowsFrom, GEMV_FUSED_MAX_M};
use crate::kernels::transformer::TransformerKernels;
use crate::kernels::Nn;

/// Which tokens [`Decoder::forward`] computes logits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsFor {
    /// Every token of every row: `[rows · tokens, vocab]`.
    All,
    /// The last token of every row: `[rows, vocab]`.
    Last,
}

/// A layer norm's f32 weight and optional bias.
struct Norm {
    w: DeviceBuffer<f32>,
    b: Option<DeviceBuffer<f32>>,
}

/// One decoder block's weights (projections `[out, in]`).
struct Block<T: Float> {
    norm1: Norm,
    qkv_w: DeviceBuffer<T>,
    qkv_b: Option<DeviceBuffer<T>>,
    o_w: DeviceBuffer<T>,
    o_b: Option<DeviceBuffer<T>>,
    norm2: Norm,
    /// GPT-2: `c_fc` `[m, d]`; Llama: gate and up stacked, `[2m, d]`.
    up_w: DeviceBuffer<T>,
    up_b: Option<DeviceBuffer<T>>,
    down_w: DeviceBuffer<T>,
    down_b: Option<DeviceBuffer<T>>,
}

struct Model<T: Float> {
    wte: DeviceBuffer<T>,
    wpe: Option<DeviceBuffer<T>>,
    blocks: Vec<Block<T>>,
    norm_f: Norm,
    /// `None`: tied to `wte`.
    lm_head: Option<DeviceBuffer<T>>,
}

enum Weights {
    F32(Model<f32>),
    Bf16(Model<bf16>),
    F16(Model<f16>),
}

/// The sizes every call needs.
#[derive(Clone, Copy, Debug)]
struct Dims {
    gpt2: bool,
    d: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    inter: usize,
    vocab: usize,
    eps: f32,
    /// The longest sequence: the model's positions, or its attention window when shorter.
    max_pos: usize,
    /// The attention window of a model with one (a bound on the sequence, see `max_pos`).
    window: Option<usize>,
    layers: usize,
}

impl Dims {
    fn of(c: &DecoderConfig) -> Dims {
        match c {
            DecoderConfig::Gpt2(g) => Dims {
                gpt2: true,
                d: g.n_embd,
                heads: g.n_head,
                kv_heads: g.n_head,
                head_dim: g.n_embd / g.n_head,
                inter: g.n_inner,
                vocab: g.vocab_size,
                eps: g.layer_norm_epsilon as f32,
                max_pos: g.n_positions,
                window: None,
                layers: g.n_layer,
            },
            DecoderConfig::Llama(l) => Dims {
                gpt2: false,
                d: l.hidden_size,
                heads: l.num_attention_heads,
                kv_heads: l.num_key_value_heads,
                head_dim: l.head_dim,
                inter: l.intermediate_size,
                vocab: l.vocab_size,
                eps: l.rms_norm_eps as f32,
                max_pos: l.sliding_window.map_or(l.max_position_embeddings, |w| {
                    w.min(l.max_position_embeddings)
                }),
                window: l.sliding_window,
                layers: l.num_hidden_layers,
            },
        }
    }

    /// Columns of the packed q|k|v product.
    fn qkv_cols(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Columns of the MLP's up product (Llama: gate and up).
    fn up_cols(&self) -> usize {
        if self.gpt2 {
            self.inter
        } else {
            2 * self.inter
        }
    }
}

/// A GPT-2 or Llama-family decoder on the device, its weights in one dtype (f32, bf16 or
/// f16), for inference over a [`DecoderCache`] (see the module docs).
pub struct Decoder {
    config: DecoderConfig,
    dtype: Dtype,
    dims: Dims,
    weights: Weights,
    /// Llama's rotary frequencies (`head_dim / 2`, f32, scaled as the config says).
    inv_freq: Option<DeviceBuffer<f32>>,
}

/// The key/value caches of a [`Decoder`]: one [`KvCache`] per layer, `slots` sequence slots of
/// `max_len` positions each, in the decoder's dtype (zeroed when made).
pub struct DecoderCache {
    layers: Vec<KvCache>,
    dtype: Dtype,
    slots: usize,
    max_len: usize,
}

impl DecoderCache {
    /// Sequence slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Positions each slot holds.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The cache of layer `i`.
    pub fn layer(&self, i: usize) -> Option<&KvCache> {
        self.layers.get(i)
    }
}

/// The weight `name` as `T` (rounded to nearest even from the file's dtype).
fn host<T: Float>(w: &DecoderWeights, name: &str) -> Result<Vec<T>> {
    let t = w
        .get(name)
        .ok_or_else(|| NnError::Config(format!("decoder: the weights have no `{name}`")))?;
    Ok(t.to_vec::<T>(name)?)
}

fn upload<T: Float>(s: &Stream, v: &[T]) -> Result<DeviceBuffer<T>> {
    Ok(s.alloc_from_host(v)?)
}

/// A norm weight (and bias) rounded to the model's dtype, as Hugging Face's `model.to(dtype)`
/// does, and kept in f32 for the norm kernel (exact).
fn norm<T: Float>(
    s: &Stream,
    w: &DecoderWeights,
    weight: &str,
    bias: Option<&str>,
) -> Result<Norm> {
    let f = |name: &str| -> Result<DeviceBuffer<f32>> {
        let v: Vec<f32> = host::<T>(w, name)?.into_iter().map(T::to_f32).collect();
        upload(s, &v)
    };
    Ok(Norm {
        w: f(weight)?,
        b: bias.map(f).transpose()?,
    })
}

fn model<T: Float>(s: &Stream, w: &DecoderWeights, dims: &Dims) -> Result<Model<T>> {
    let up = |name: &str| -> Result<DeviceBuffer<T>> { upload(s, &host::<T>(w, name)?) };
    let cat = |names: &[String]| -> Result<DeviceBuffer<T>> {
        let mut v = Vec::new();
        for n in names {
            v.extend(host::<T>(w, n)?);
        }
        upload(s, &v)
    };
    let mut blocks = Vec::with_capacity(dims.layers);
    if dims.gpt2 {
        for i in 0..dims.layers {
            let p = format!("h.{i}.");
            let n = |x: &str| format!("{p}{x}");
            blocks.push(Block {
                norm1: norm::<T>(s, w, &n("ln_1.weight"), Some(&n("ln_1.bias")))?,
                qkv_w: up(&n("attn.c_attn.weight"))?,
                qkv_b: Some(up(&n("attn.c_attn.bias"))?),
                o_w: up(&n("attn.c_proj.weight"))?,
                o_b: Some(up(&n("attn.c_proj.bias"))?),
                norm2: norm::<T>(s, w, &n("ln_2.weight"), Some(&n("ln_2.bias")))?,
                up_w: up(&n("mlp.c_fc.weight"))?,
                up_b: Some(up(&n("mlp.c_fc.bias"))?),
                down_w: up(&n("mlp.c_proj.weight"))?,
                down_b: Some(up(&n("mlp.c_proj.bias"))?),
            });
        }
        Ok(Model {
            wte: up("wte.weight")?,
            wpe: Some(up("wpe.weight")?),
            blocks,
            norm_f: norm::<T>(s, w, "ln_f.weight", Some("ln_f.bias"))?,
            lm_head: match w.config.tied() {
                true => None,
                false => Some(up("lm_head.weight")?),
            },
        })
    } else {
        let (qkv_bias, o_bias, mlp_bias) = match &w.config {
            DecoderConfig::Llama(c) => (c.qkv_bias, c.o_bias, c.mlp_bias),
            DecoderConfig::Gpt2(_) => (false, false, false),
        };
        // The tensors `names` stacked (q|k|v, gate|up) with `suffix` (`weight` or `bias`).
        let stacked = |names: &[String], suffix: &str| {
            cat(&names
                .iter()
                .map(|x| format!("{x}.{suffix}"))
                .collect::<Vec<_>>())
        };
        for i in 0..dims.layers {
            let p = format!("model.layers.{i}.");
            let n = |x: &str| format!("{p}{x}");
            let qkv = [
                n("self_attn.q_proj"),
                n("self_attn.k_proj"),
                n("self_attn.v_proj"),
            ];
            let gate_up = [n("mlp.gate_proj"), n("mlp.up_proj")];
            blocks.push(Block {
                norm1: norm::<T>(s, w, &n("input_layernorm.weight"), None)?,
                qkv_w: stacked(&qkv, "weight")?,
                qkv_b: qkv_bias.then(|| stacked(&qkv, "bias")).transpose()?,
                o_w: up(&n("self_attn.o_proj.weight"))?,
                o_b: o_bias
                    .then(|| up(&n("self_attn.o_proj.bias")))
                    .transpose()?,
                norm2: norm::<T>(s, w, &n("post_attention_layernorm.weight"), None)?,
                up_w: stacked(&gate_up, "weight")?,
                up_b: mlp_bias.then(|| stacked(&gate_up, "bias")).transpose()?,
                down_w: up(&n("mlp.down_proj.weight"))?,
                down_b: mlp_bias.then(|| up(&n("mlp.down_proj.bias"))).transpose()?,
            });
        }
        Ok(Model {
            wte: up("model.embed_tokens.weight")?,
            wpe: None,
            blocks,
            norm_f: norm::<T>(s, w, "model.norm.weight", None)?,
            lm_head: match w.config.tied() {
                true => None,
                false => Some(up("lm_head.weight")?),
            },
        })
    }
}

/// `buf` as an f32 buffer when `T` is f32.
fn as_f32<T: Float>(buf: &DeviceBuffer<T>) -> Result<&DeviceBuffer<f32>> {
    (buf as &dyn Any)
        .downcast_ref::<DeviceBuffer<f32>>()
        .ok_or(NnError::Dtype {
            what: "decoder f32 product",
            expected: "f32",
            found: T::DTYPE.name(),
        })
}

/// The product `y[m, n] = x[m, k] · w[n, k]ᵀ (+ b)`, GELU fused when `gelu`.
fn linear_op((m, n, k): (usize, usize, usize), bias: bool, gelu: bool) -> GemmOp {
    let epilogue = match (bias, gelu) {
        (false, _) => Epilogue::None,
        (true, false) => Epilogue::Bias,
        (true, true) => Epilogue::BiasGelu,
    };
    GemmOp {
        epilogue,
        ..GemmOp::linear(m, n, k)
    }
}

/// [`linear`] of the rows `from` describes, written into `x` first — or, for 16-bit models,
/// in one launch where the few-row kernel runs the product and computes the rows itself
/// ([`gemm_lowp_frozen_from`]; the same bits). Returns whether it took that launch (`x` is
/// then not written).
#[allow(clippy::too_many_arguments)]
fn linear_from<T: Float, O: Float>(
    q: &dyn Queue,
    (dk, nn): (&DecoderKernels, &Nn),
    from: &RowsFrom<'_, T>,
    x: &DeviceBuffer<T>,
    (w, b): (&DeviceBuffer<T>, Option<&DeviceBuffer<O>>),
    y: &DeviceBuffer<O>,
    (m, n, k): (usize, usize, usize),
    gelu: bool,
) -> Result<bool> {
    if T::DTYPE != Dtype::F32 {
        let op = linear_op((m, n, k), b.is_some(), gelu);
        // SAFETY: `w` is a decoder weight (see `linear`).
        if unsafe { gemm_lowp_frozen_from::<T, O>(q, &op, from, (x, w, y, b))? } {
            return Ok(true);
        }
    }
    match *from {
        RowsFrom::Norm {
            x: src,
            add,
            weight,
            bias,
            stride,
            off,
            eps,
            rms,
            ..
        } => dk.norm(
            q,
            src,
            add,
            (weight, bias),
            x,
            (m, k),
            (stride, off),
            (eps, rms),
        )?,
        RowsFrom::SwiGlu { gu } => dk.swiglu(q, gu, x, (m, k))?,
    }
    linear(q, nn, x, (w, b), y, (m, n, k), gelu)?;
    Ok(false)
}

/// The norm of rows `r·stride + off` of the residual stream `x`, with `add` added first (the
/// sums go to `spare` where the product computes the rows; without a spare the product does
/// not).
fn normed<'a, T: Float>(
    (x, spare): (&'a DeviceBuffer<T>, Option<&'a DeviceBuffer<T>>),
    add: Option<&'a DeviceBuffer<T>>,
    norm: &'a Norm,
    (stride, off): (usize, usize),
    (eps, rms): (f32, bool),
) -> RowsFrom<'a, T> {
    RowsFrom::Norm {
        x,
        add,
        sum: spare,
        weight: &norm.w,
        bias: norm.b.as_ref(),
        stride,
        off,
        eps,
        rms,
    }
}

/// After a product ran its norm with the residual add inside: the spare holds the stream.
fn swap<'a, T: Float>(x: &mut &'a DeviceBuffer<T>, spare: &mut Option<&'a DeviceBuffer<T>>) {
    if let Some(s) = spare.replace(*x) {
        *x = s;
    }
}

/// One product of the forward layout, `y[m, n] = x[m, k] · w[n, k]ᵀ (+ b)`, GELU fused when
/// `gelu`; `O` is `T`, or f32 for the head.
fn linear<T: Float, O: Float>(
    q: &dyn Queue,
    nn: &Nn,
    x: &DeviceBuffer<T>,
    (w, b): (&DeviceBuffer<T>, Option<&DeviceBuffer<O>>),
    y: &DeviceBuffer<O>,
    (m, n, k): (usize, usize, usize),
    gelu: bool,
) -> Result<()> {
    let mut op = linear_op((m, n, k), b.is_some(), gelu);
    if T::DTYPE != Dtype::F32 {
        // SAFETY: `w` is a decoder weight: written once, by `Decoder::from_weights`, which
        // waits for the upload before returning, and never again (the weights are private
        // and immutable), so no work before or beside this product writes it.
        unsafe { gemm_lowp_frozen::<T, O>(q, &op, x, w, y, b)? };
        return Ok(());
    }
    // f32: run_gemm has no fused GELU; the bias is fused, GELU runs after.
    if gelu {
        op.epilogue = Epilogue::Bias;
    }
    let y32 = as_f32(y)?;
    run_gemm(
        q,
        nn,
        GemmFamily::Auto,
        &op,
        as_f32(x)?,
        as_f32(w)?,
        y32,
        b.map(as_f32).transpose()?,
    )?;
    if gelu {
        TransformerKernels::get(q.device())?.gelu_fwd::<f32>(q, y32, y32, true)?;
    }
    Ok(())
}

impl Decoder {
    /// Reads a Hugging Face model folder (`config.json` and `model.safetensors` or its shards)
    /// and puts the weights on `s`'s device in `dtype`. File errors are [`NnError::Io`] naming
    /// the path; configs and tensors this build cannot run are [`NnError::Io`] with the
    /// Hugging Face error (see [`crate::io::hf`]).
    pub fn load(s: &Stream, dir: &Path, dtype: Dtype) -> Result<Decoder> {
        let w = DecoderWeights::read(dir)?;
        Self::from_weights(s, &w, dtype)
    }

    /// Puts checked host weights on `s`'s device in `dtype` (weights of another dtype rounded
    /// to nearest even; a finite value `dtype` cannot hold is an error). Llama's q/k/v and
    /// gate/up weights are concatenated here, once. Eager: copies from the host and waits for
    /// `s` before returning.
    pub fn from_weights(s: &Stream, weights: &DecoderWeights, dtype: Dtype) -> Result<Decoder> {
        let config = weights.config.clone();
        let dims = Dims::of(&config);
        if dims.head_dim % 2 != 0 || dims.head_dim > crate::kernels::attention::MAX_HEAD_DIM {
            return Err(NnError::Config(format!(
                "decoder: head dimension {} (even and at most {} needed)",
                dims.head_dim,
                crate::kernels::attention::MAX_HEAD_DIM
            )));
        }
        let inv_freq = match &config {
            DecoderConfig::Gpt2(_) => None,
            DecoderConfig::Llama(l) => {
                let base = rope_inv_freq(l.head_dim, l.rope_theta);
                let scale = match &l.rope_scaling {
                    Some(sc) => llama3_frequency_scale(l.head_dim, l.rope_theta, sc)?,
                    None => vec![1.0; base.len()],
                };
                let f: Vec<f32> = base
                    .iter()
                    .zip(&scale)
                    .map(|(f, s)| (f * s) as f32)
                    .collect();
                Some(upload(s, &f)?)
            }
        };
        let weights = match dtype {
            Dtype::F32 => Weights::F32(model::<f32>(s, weights, &dims)?),
            Dtype::Bf16 => Weights::Bf16(model::<bf16>(s, weights, &dims)?),
            Dtype::F16 => Weights::F16(model::<f16>(s, weights, &dims)?),
        };
        // Compile the kernels and open cuBLASLt now (eager), not inside a first captured step
        // (a capture cannot open a library; the 16-bit products with a fused bias need it).
        let dev = s.device();
        let _ = crate::engine::Engines::get(dev)?.cublaslt();
        DecoderKernels::get(dev)?;
        TransformerKernels::get(dev)?;
        Nn::get(dev)?;
        // The weights are final from here on: the few-row products read them early (before
        // the previous kernel finishes, see `linear`), so no upload may still be in flight.
        s.synchronize()?;
        Ok(Decoder {
            config,
            dtype,
            dims,
            weights,
            inv_freq,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// The weights' and activations' element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The vocabulary size (columns of the logits).
    pub fn vocab(&self) -> usize {
        self.dims.vocab
    }

    /// The longest sequence the model takes (`n_positions` / `max_position_embeddings`, or a
    /// sliding window when shorter: up to the window, attention over it is full attention,
    /// and longer sequences would need the window, which this build does not run).
    pub fn max_positions(&self) -> usize {
        self.dims.max_pos
    }

    /// What bounds [`Self::max_positions`], in words for an error message.
    pub(crate) fn positions_limit(&self) -> String {
        match self.dims.window {
            Some(w) if w == self.dims.max_pos => format!(
                "the model's sliding window of {w} positions (a longer sequence needs \
                 sliding-window attention, which this build does not run)"
            ),
            _ => format!("the model's {} positions", self.dims.max_pos),
        }
    }

    /// Zeroed caches for `slots` sequences of up to `max_len` positions, on `q`'s device, in
    /// the decoder's dtype. `max_len` past [`Decoder::max_positions`] is refused.
    pub fn new_cache(&self, q: &dyn Queue, slots: usize, max_len: usize) -> Result<DecoderCache> {
        if max_len > self.dims.max_pos {
            return Err(NnError::Shape(format!(
                "decoder cache: max_len {max_len} is past {}",
                self.positions_limit()
            )));
        }
        let layers = (0..self.dims.layers)
            .map(|_| {
                KvCache::new(
                    q,
                    self.dtype,
                    (slots, self.dims.kv_heads, max_len, self.dims.head_dim),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DecoderCache {
            layers,
            dtype: self.dtype,
            slots,
            max_len,
        })
    }

    /// Runs `rows` rows of `tokens` tokens each. Device buffers (so a captured step stays
    /// valid when the host or a kernel rewrites them between replays): `ids`
    /// `[rows · tokens]` i32 token ids, `positions` `[rows · tokens]` i32 absolute positions,
    /// `slots` `[rows]` i32 the cache slot of each row. Writes each token's keys and values
    /// into its row's slot at its position and attends causally to that slot's positions
    /// `0..=own position` (rows of different lengths: see the module docs). Writes f32 logits
    /// into `logits`: `[rows · tokens, vocab]` for [`LogitsFor::All`], `[rows, vocab]` for
    /// [`LogitsFor::Last`]. No host synchronisation, no host reads: capturable. Intermediates
    /// (the residual stream and the layer's activations, about
    /// `rows · tokens · (4·d + (H + 2·Hkv)·D + 2·H·D + 3·m)` elements, one `H·D` less with one
    /// token a row) are allocated from `q` on each call (from the graph's pool inside a
    /// capture).
    ///
    /// Before capturing a step, run one eager call of the same `(rows, tokens)` and
    /// `logits_for`: the matrix-product engines are measured and chosen on the first eager
    /// call of each shape, and a capture then records the same ones (without that, a capture
    /// runs the heuristic default, which eager calls may not match bit for bit).
    ///
    /// Errors before anything runs: buffers shorter than the call needs (`SizeMismatch`),
    /// `rows` or `tokens` zero, `rows` past the cache's slots, `tokens` past its `max_len`, a
    /// cache of another dtype or shape, buffers of another device.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        q: &dyn Queue,
        cache: &DecoderCache,
        ids: &DeviceBuffer<i32>,
        positions: &DeviceBuffer<i32>,
        slots: &DeviceBuffer<i32>,
        (rows, tokens): (usize, usize),
        logits_for: LogitsFor,
        logits: &DeviceBuffer<f32>,
    ) -> Result<()> {
        let d = &self.dims;
        if rows == 0 || tokens == 0 {
            return Err(NnError::Shape(format!(
                "decoder forward: {rows} rows of {tokens} tokens (both positive)"
            )));
        }
        if cache.dtype != self.dtype {
            return Err(NnError::Dtype {
                what: "decoder cache",
                expected: self.dtype.name(),
                found: cache.dtype.name(),
            });
        }
        let fits = cache.layers.len() == d.layers
            && cache
                .layers
                .iter()
                .all(|c| c.kv_heads() == d.kv_heads && c.head_dim() == d.head_dim);
        if !fits {
            return Err(NnError::Shape(format!(
                "decoder forward: a cache of {} layers for a model of {} layers of {} \
                 key/value heads of {}",
                cache.layers.len(),
                d.layers,
                d.kv_heads,
                d.head_dim
            )));
        }
        if rows > cache.slots {
            return Err(NnError::Shape(format!(
                "decoder forward: {rows} rows for a cache of {} slots",
                cache.slots
            )));
        }
        if tokens > cache.max_len {
            return Err(NnError::Shape(format!(
                "decoder forward: {tokens} tokens a row for a cache of {} positions",
                cache.max_len
            )));
        }
        let n = crate::extent::prod("decoder tokens", &[rows, tokens])?;
        need("decoder token ids", ids, n)?;
        need("decoder positions", positions, n)?;
        need("decoder cache slots", slots, rows)?;
        let out_rows = match logits_for {
            LogitsFor::All => n,
            LogitsFor::Last => rows,
        };
        need(
            "decoder logits",
            logits,
            crate::extent::prod("decoder logits", &[out_rows, d.vocab])?,
        )?;
        let io = Io {
            cache,
            ids,
            positions,
            slots,
            rows,
            tokens,
            logits_for,
            logits,
        };
        match &self.weights {
            Weights::F32(m) => self.run(q, m, &io),
            Weights::Bf16(m) => self.run(q, m, &io),
            Weights::F16(m) => self.run(q, m, &io),
        }
    }

    fn run<T: Float>(&self, q: &dyn Queue, m: &Model<T>, io: &Io<'_>) -> Result<()> {
        let d = &self.dims;
        let dev = q.device();
        let (dk, nn) = (DecoderKernels::get(dev)?, Nn::get(dev)?);
        let (rows, tokens) = (io.rows, io.tokens);
        // Every buffer of the call, the weights and the caches are memory of q's device.
        let mut blocks = vec![
            ("decoder token ids", io.ids.block()),
            ("decoder positions", io.positions.block()),
            ("decoder cache slots", io.slots.block()),
            ("decoder logits", io.logits.block()),
            ("decoder weights", m.wte.block()),
        ];
        for kv in &io.cache.layers {
            let (k, v) = kv.caches::<T>()?;
            blocks.extend([
                ("decoder key cache", k.block()),
                ("decoder value cache", v.block()),
            ]);
        }
        on_device(q, blocks)?;
        let n = rows * tokens;
        let qd = d.heads * d.head_dim;
        // The residual stream and, where a norm may run inside the product after it (16-bit
        // models, few rows), its spare: such a norm writes the stream plus the product before
        // into the spare (other blocks are still reading the stream), which becomes the
        // stream; the norm kernel adds in place.
        let x0 = q.alloc::<T>(n * d.d)?;
        let x1 = if T::DTYPE != Dtype::F32 && n <= GEMV_FUSED_MAX_M {
            Some(q.alloc::<T>(n * d.d)?)
        } else {
            None
        };
        let (mut x, mut spare) = (&x0, x1.as_ref());
        let h = q.alloc::<T>(n * d.d)?;
        // The output and down products, added into x by the norm after them.
        let proj = q.alloc::<T>(n * d.d)?;
        let qkv = q.alloc::<T>(n * d.qkv_cols())?;
        // Steps of one token a row split the q|k|v product inside attention; longer rows split
        // it into the caches and these queries first (the row's later tokens read its earlier
        // keys from the caches).
        let qh = if tokens > 1 {
            Some(q.alloc::<T>(n * qd)?)
        } else {
            None
        };
        let att = q.alloc::<T>(n * qd)?;
        let mid = q.alloc::<T>(n * d.up_cols())?;
        let act = if d.gpt2 {
            None
        } else {
            Some(q.alloc::<T>(n * d.inter)?)
        };
        let wpe = m.wpe.as_ref().map(|w| (w, io.positions, d.max_pos));
        dk.embed(q, io.ids, &m.wte, wpe, x, (n, d.d, d.vocab))?;
        let rms = !d.gpt2;
        let ln = (d.eps, rms);
        let qkv_dims = QkvDims {
            rows,
            tokens,
            heads: d.heads,
            kv_heads: d.kv_heads,
            head_dim: d.head_dim,
            slots: io.cache.slots,
            max_len: io.cache.max_len,
        };
        let att_shape = AttentionShape {
            batch: rows,
            slots: io.cache.slots,
            tokens,
            heads: d.heads,
            kv_heads: d.kv_heads,
            max_len: io.cache.max_len,
            head_dim: d.head_dim,
        };
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        let scratch = dk.attend_scratch::<T>(q, &att_shape)?;
        // The down product of the layer before, still to be added into x.
        let mut pending = None;
        for (blk, kv) in m.blocks.iter().zip(&io.cache.layers) {
            let caches = kv.caches::<T>()?;
            let rows1 = normed((x, spare), pending, &blk.norm1, (1, 0), ln);
            let w = (&blk.qkv_w, blk.qkv_b.as_ref());
            if linear_from(
                q,
                (&dk, &nn),
                &rows1,
                &h,
                w,
                &qkv,
                (n, d.qkv_cols(), d.d),
                false,
            )? && pending.is_some()
            {
                swap(&mut x, &mut spare);
            }
            let freq = self.inv_freq.as_ref();
            let at = (io.positions, io.slots);
            match &qh {
                Some(qh) => {
                    dk.qkv(q, &qkv_dims, &qkv, freq, at, qh, caches)?;
                    dk.attend(q, &att_shape, qh, caches, at, &att, scale, &scratch)?;
                }
                None => {
                    let sc = &scratch;
                    // SAFETY: early reads: the embedding above was launched without PDL, so
                    // everything before this forward on q is done when the kernels after it
                    // start, and no kernel of the forward before this one writes the
                    // positions, slots, rotary frequencies or cache rows below a row's
                    // position (this attention writes each row's own position only).
                    unsafe {
                        dk.attend_qkv_early(
                            q, &att_shape, &qkv, freq, caches, at, &att, scale, sc, true,
                        )?;
                    }
                }
            }
            let w = (&blk.o_w, blk.o_b.as_ref());
            linear(q, &nn, &att, w, &proj, (n, d.d, qd), false)?;
            let rows2 = normed((x, spare), Some(&proj), &blk.norm2, (1, 0), ln);
            let w = (&blk.up_w, blk.up_b.as_ref());
            if linear_from(
                q,
                (&dk, &nn),
                &rows2,
                &h,
                w,
                &mid,
                (n, d.up_cols(), d.d),
                d.gpt2,
            )? {
                swap(&mut x, &mut spare);
            }
            let w = (&blk.down_w, blk.down_b.as_ref());
            match &act {
                Some(a) => {
                    let gated = RowsFrom::SwiGlu { gu: &mid };
                    linear_from(q, (&dk, &nn), &gated, a, w, &proj, (n, d.d, d.inter), false)?;
                }
                None => linear(q, &nn, &mid, w, &proj, (n, d.d, d.inter), false)?,
            }
            pending = Some(&proj);
        }
        let (out_rows, stride, off) = match io.logits_for {
            LogitsFor::All => (n, 1, 0),
            LogitsFor::Last => (rows, tokens, tokens - 1),
        };
        let rows_f = normed((x, spare), pending, &m.norm_f, (stride, off), ln);
        let head = m.lm_head.as_ref().unwrap_or(&m.wte);
        let none: Option<&DeviceBuffer<f32>> = None;
        linear_from::<T, f32>(
            q,
            (&dk, &nn),
            &rows_f,
            &h,
            (head, none),
            io.logits,
            (out_rows, d.vocab, d.d),
            false,
        )?;
        Ok(())
    }
}

/// The buffers and sizes of one [`Decoder::forward`] call.
struct Io<'a> {
    cache: &'a DecoderCache,
    ids: &'a DeviceBuffer<i32>,
    positions: &'a DeviceBuffer<i32>,
    slots: &'a DeviceBuffer<i32>,
    rows: usize,
    tokens: usize,
    logits_for: LogitsFor,
    logits: &'a DeviceBuffer<f32>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::hf::{Gpt2Config, LlamaConfig};

    #[test]
    fn the_model_and_its_cache_move_between_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Decoder>();
        send_sync::<DecoderCache>();
    }

    #[test]
    fn dims_follow_the_config() {
        let g = DecoderConfig::Gpt2(Gpt2Config {
            n_embd: 64,
            n_layer: 2,
            n_head: 4,
            n_inner: 256,
            n_positions: 32,
            vocab_size: 97,
            layer_norm_epsilon: 1e-5,
            tie_word_embeddings: true,
            dtype: None,
        });
        let d = Dims::of(&g);
        assert!(d.gpt2);
        assert_eq!((d.head_dim, d.qkv_cols(), d.up_cols()), (16, 192, 256));
        let l = DecoderConfig::Llama(LlamaConfig {
            model_type: "llama".into(),
            hidden_size: 64,
            intermediate_size: 96,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: None,
            max_position_embeddings: 64,
            vocab_size: 97,
            tie_word_embeddings: false,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            sliding_window: None,
            dtype: None,
        });
        let d = Dims::of(&l);
        assert!(!d.gpt2);
        assert_eq!((d.qkv_cols(), d.up_cols(), d.max_pos), (128, 192, 64));
        assert_eq!(d.window, None);
        // A window bounds the sequence where it is the shorter.
        let DecoderConfig::Llama(mut c) = l else {
            unreachable!()
        };
        for (window, max_pos) in [(32, 32), (64, 64), (4096, 64)] {
            c.sliding_window = Some(window);
            let d = Dims::of(&DecoderConfig::Llama(c.clone()));
            assert_eq!((d.max_pos, d.window), (max_pos, Some(window)));
        }
    }
}
