//! [`Gpt`]: a GPT-2-shaped decoder for training (token and position embeddings, pre-norm
//! blocks of causal self-attention and a GELU MLP, a final LayerNorm and an lm_head tied to
//! the token embedding), its parameters f32 masters. Inference over a key/value cache and
//! Hugging Face weights are elsewhere (`io::hf`, [`KvCache`](crate::KvCache)).

use std::sync::Arc;

use cudagraph::{DeviceBuffer, Queue, Stream};

use crate::autograd::causal::causal_attention;
use crate::autograd::ops::{add, linear};
use crate::autograd::tensor::{Parameter, Tensor};
use crate::autograd::transformer::{embedding, gelu, layer_norm};
use crate::dtype::Dtype;
use crate::error::{NnError, Result};
use crate::random::HostRng;

/// The sizes of a [`Gpt`] (GPT-2's `vocab_size`, `n_positions`, `n_embd`, `n_head`,
/// `n_layer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptConfig {
    /// Tokens of the vocabulary.
    pub vocab: usize,
    /// Positions of the position embedding (the longest sequence).
    pub positions: usize,
    /// Hidden size (`n_embd`).
    pub hidden: usize,
    /// Attention heads (dividing `hidden`).
    pub heads: usize,
    /// Blocks.
    pub layers: usize,
}

/// GPT-2's LayerNorm epsilon.
const LN_EPS: f32 = 1e-5;

/// One pre-norm block's parameters.
#[derive(Clone, Debug)]
struct Block {
    ln_1: (Parameter, Parameter),
    c_attn: (Parameter, Parameter),
    attn_proj: (Parameter, Parameter),
    ln_2: (Parameter, Parameter),
    c_fc: (Parameter, Parameter),
    mlp_proj: (Parameter, Parameter),
}

impl Block {
    fn parameters(&self) -> Vec<Parameter> {
        [
            &self.ln_1,
            &self.c_attn,
            &self.attn_proj,
            &self.ln_2,
            &self.c_fc,
            &self.mlp_proj,
        ]
        .into_iter()
        .flat_map(|(w, b)| [w.clone(), b.clone()])
        .collect()
    }
}

/// A GPT-2-shaped model for training. `forward` gives f32 logits; inside
/// [`autocast`](crate::autocast) its products run in 16 bits, LayerNorm and the residual
/// stream in f32 (as PyTorch's autocast runs GPT-2).
#[derive(Clone, Debug)]
pub struct Gpt {
    cfg: GptConfig,
    wte: Parameter,
    wpe: Parameter,
    blocks: Vec<Block>,
    ln_f: (Parameter, Parameter),
}

impl Gpt {
    /// A model of `cfg` with GPT-2's initialisation drawn from `rng`: every linear weight and
    /// both embeddings normal with standard deviation 0.02, the two residual projections of
    /// each block 0.02 / √(2 · layers), biases zero, LayerNorms weight one and bias zero.
    /// Uploaded on `s` (eager). `NnError::Shape` for a zero size or heads not dividing
    /// `hidden`.
    pub fn new(s: &Stream, cfg: GptConfig, rng: &mut HostRng) -> Result<Self> {
        let GptConfig {
            vocab,
            positions,
            hidden: h,
            heads,
            layers,
        } = cfg;
        if [vocab, positions, h, heads, layers].contains(&0) || h % heads != 0 {
            return Err(NnError::Shape(format!(
                "gpt: {cfg:?} (every size positive, heads dividing hidden)"
            )));
        }
        let normal = |rng: &mut HostRng, n: usize, std: f32| -> Vec<f32> {
            (0..n).map(|_| rng.normal() * std).collect()
        };
        let resid_std = 0.02 / ((2 * layers) as f32).sqrt();
        let mut param = |name: String, shape: &[usize], std: Option<f32>, fill: f32| {
            let n: usize = shape.iter().product();
            let data = match std {
                Some(std) => normal(rng, n, std),
                None => vec![fill; n],
            };
            Parameter::from_host(s, &name, &data, shape)
        };
        let wte = param("wte.weight".into(), &[vocab, h], Some(0.02), 0.0)?;
        let wpe = param("wpe.weight".into(), &[positions, h], Some(0.02), 0.0)?;
        let mut blocks = Vec::with_capacity(layers);
        for i in 0..layers {
            let mut lin = |name: &str, out: usize, inp: usize, std: f32| -> Result<_> {
                Ok((
                    param(format!("h.{i}.{name}.weight"), &[out, inp], Some(std), 0.0)?,
                    param(format!("h.{i}.{name}.bias"), &[out], None, 0.0)?,
                ))
            };
            let c_attn = lin("attn.c_attn", 3 * h, h, 0.02)?;
            let attn_proj = lin("attn.c_proj", h, h, resid_std)?;
            let c_fc = lin("mlp.c_fc", 4 * h, h, 0.02)?;
            let mlp_proj = lin("mlp.c_proj", h, 4 * h, resid_std)?;
            let mut ln = |name: &str| -> Result<_> {
                Ok((
                    param(format!("h.{i}.{name}.weight"), &[h], None, 1.0)?,
                    param(format!("h.{i}.{name}.bias"), &[h], None, 0.0)?,
                ))
            };
            let (ln_1, ln_2) = (ln("ln_1")?, ln("ln_2")?);
            blocks.push(Block {
                ln_1,
                c_attn,
                attn_proj,
                ln_2,
                c_fc,
                mlp_proj,
            });
        }
        let ln_f = (
            param("ln_f.weight".into(), &[h], None, 1.0)?,
            param("ln_f.bias".into(), &[h], None, 0.0)?,
        );
        Ok(Gpt {
            cfg,
            wte,
            wpe,
            blocks,
            ln_f,
        })
    }

    /// The sizes.
    pub fn config(&self) -> GptConfig {
        self.cfg
    }

    /// Logits `[batch · tokens, vocab]` (f32) of `batch` sequences of token `ids` at
    /// `positions` (one i32 per token each, sequence after sequence; position ids index the
    /// position embedding): embeddings, then per block
    /// `x + proj(attn(qkv(ln_1(x))))` and `x + proj(gelu_tanh(fc(ln_2(x))))`, then `ln_f` and
    /// the product with the token embedding. Ids or positions out of range give zero
    /// embedding rows (see [`embedding`]). `NnError::Shape` when the two buffers differ in
    /// length or it is not a multiple of `batch`.
    pub fn forward(
        &self,
        q: &dyn Queue,
        ids: &Arc<DeviceBuffer<i32>>,
        positions: &Arc<DeviceBuffer<i32>>,
        batch: usize,
    ) -> Result<Tensor> {
        let n = ids.len();
        if positions.len() != n || batch == 0 || n % batch != 0 || n == 0 {
            return Err(NnError::Shape(format!(
                "gpt: {n} ids and {} positions for {batch} sequences",
                positions.len()
            )));
        }
        let t = |p: &Parameter| p.tensor();
        let mut x = add(
            q,
            &embedding(q, ids, &t(&self.wte))?,
            &embedding(q, positions, &t(&self.wpe))?,
        )?;
        let heads = self.cfg.heads;
        for b in &self.blocks {
            let a = layer_norm(q, &x, &t(&b.ln_1.0), Some(&t(&b.ln_1.1)), LN_EPS)?;
            let a = linear(q, &a, &t(&b.c_attn.0), Some(&t(&b.c_attn.1)), false)?;
            let a = causal_attention(q, &a, batch, heads)?;
            let a = linear(q, &a, &t(&b.attn_proj.0), Some(&t(&b.attn_proj.1)), false)?;
            x = add(q, &x, &a)?;
            let m = layer_norm(q, &x, &t(&b.ln_2.0), Some(&t(&b.ln_2.1)), LN_EPS)?;
            let m = linear(q, &m, &t(&b.c_fc.0), Some(&t(&b.c_fc.1)), false)?;
            let m = gelu(q, &m, true)?;
            let m = linear(q, &m, &t(&b.mlp_proj.0), Some(&t(&b.mlp_proj.1)), false)?;
            x = add(q, &x, &m)?;
        }
        let x = layer_norm(q, &x, &t(&self.ln_f.0), Some(&t(&self.ln_f.1)), LN_EPS)?;
        linear(q, &x, &t(&self.wte), None, false)?.to_dtype(q, Dtype::F32)
    }

    /// Every parameter, in a fixed order: `wte`, `wpe`, each block's (`ln_1`, `c_attn`,
    /// attention `c_proj`, `ln_2`, `c_fc`, MLP `c_proj`; weight before bias), `ln_f`. The
    /// token embedding is also the lm_head (tied), so it comes once.
    pub fn parameters(&self) -> Vec<Parameter> {
        let mut v = vec![self.wte.clone(), self.wpe.clone()];
        for b in &self.blocks {
            v.extend(b.parameters());
        }
        v.extend([self.ln_f.0.clone(), self.ln_f.1.clone()]);
        v
    }
}
