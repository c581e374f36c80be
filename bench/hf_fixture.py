#!/usr/bin/env python3
"""Tiny random-init Hugging Face decoders for the GPU tests of `cudagraph_nn::io::hf`.

Writes, with `save_pretrained` (safetensors), under OUT (default
crates/cudagraph-nn/tests/data/hf):

  gpt2/           GPT-2, 2 layers, width 64, 4 heads, tied head, float32
  llama/          Llama, 2 layers, width 64, 8 query heads and 2 key/value heads (GQA),
                  Llama 3 rope_scaling, untied head, bfloat16
  llama-sharded/  the same Llama saved in shards (max_shard_size small enough for 3+ files)

and beside each folder `<name>.io.safetensors` holding fixed token ids (`input_ids`, int64
[2, 7]) and the model's logits for them in float32 (`logits`, [2, 7, vocab]), computed in
float32 on the CPU (the model cast to float32 first), so a test can compare our forward with
Hugging Face's.

Needs torch, transformers and safetensors. Run on a machine that has them:
    python3 bench/hf_fixture.py [OUT]
"""
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB = 97


def gpt2():
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=4,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(cfg), torch.float32


def llama():
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    return LlamaForCausalLM(cfg), torch.bfloat16


def save(model, dtype, out, name, **kwargs):
    model = model.eval()
    folder = os.path.join(out, name)
    model.to(dtype).save_pretrained(folder, safe_serialization=True, **kwargs)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model.float()(input_ids=ids).logits.contiguous()
    save_file(
        {"input_ids": ids.contiguous(), "logits": logits},
        os.path.join(out, f"{name}.io.safetensors"),
    )
    print(f"{folder}: {sorted(os.listdir(folder))}")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "crates/cudagraph-nn/tests/data/hf"
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model, dtype = gpt2()
    save(model, dtype, out, "gpt2")
    torch.manual_seed(0)
    model, dtype = llama()
    save(model, dtype, out, "llama")
    torch.manual_seed(0)
    model, dtype = llama()
    save(model, dtype, out, "llama-sharded", max_shard_size="20KB")


if __name__ == "__main__":
    main()
