#!/usr/bin/env python3
"""Random-init Hugging Face decoder folders for `cudagraph bench decode` / `bench parity` and
the PyTorch scripts beside them (bench/decode_torch.py, bench/hf_reference.py).

Writes OUT/config.json + OUT/model.safetensors (or shards with an index when
--max-shard-size is given) for one named shape, weights drawn by transformers' own
initialisation under a fixed seed, then cast to --dtype. Both sides read the same folder, so
ours and PyTorch run the same weights.

Shapes:
  gpt2-small  GPT-2 124M: 12 layers, width 768, 12 heads, vocab 50257, tied head. n_positions
              is 2048, not GPT-2's 1024: the bench runs prompts of 1024 plus 64 decode steps,
              more than 1024 positions.
  llama-1b    Llama 3.2 1B's shape: 16 layers, hidden 2048, 32 query heads, 8 key/value heads
              (head_dim 64), intermediate 8192, vocab 128256, rope_theta 500000, llama3
              rope_scaling (factor 32, low 1, high 4, original 8192), tied embeddings.
  qwen2-0.5b  Qwen2.5 0.5B's shape: 24 layers, hidden 896, 14 query heads, 2 key/value heads
              (head_dim 64), intermediate 4864, vocab 151936, rope_theta 1e6, q/k/v biases,
              sliding window off, tied embeddings.
  gpt2-tiny   GPT-2, 3 layers, width 128, 4 heads, vocab 1000, n_positions 256, tied head.
  llama-tiny  Llama, 3 layers, hidden 128, 4 query heads and 2 key/value heads (head_dim 32),
              intermediate 256, vocab 1000, llama3 rope_scaling with original_max_position 64
              (so positions of the parity rows, up to 160, are in the scaled range), tied.
  qwen2-tiny  Qwen2, 3 layers, hidden 128, 4 query heads and 2 key/value heads (head_dim 32),
              intermediate 256, vocab 1000, rope_theta 1e6, q/k/v biases, sliding window
              off (use_sliding_window false, as Qwen2.5's checkpoints have it), tied.
  mistral-tiny  Mistral, the llama-tiny sizes with Mistral's rotary settings (rope_theta 1e6, no
              scaling), 2 key/value heads, a sliding window of 256 (longer than the parity
              rows, so its attention is full attention there), untied head.
  The tiny shapes' weights are drawn with initializer_range 0.1 (not 0.02: logits spread wider,
  so greedy tokens are decided by clear margins), and their biases and norm weights are random
  too (transformers starts them at 0 and 1): 0 or 1 plus 0.1 times a normal draw, so a parity
  check sees every term.

config.json is written in the form checkpoints on the Hub have (`rope_theta` and
`rope_scaling` at the top level, `torch_dtype`), not the form transformers 5.x's
save_pretrained writes (`rope_parameters`); transformers reads both, and the file is checked
by loading it back with AutoConfig (the rope settings must survive).

A folder already holding the same shape, dtype and seed (hf_models.stamp) is reused with
--reuse. Exits non-zero on any error.

usage: python3 bench/hf_models.py --shape llama-1b --dtype bf16 --out /tmp/cg-hf/llama-1b
           [--seed 0] [--max-shard-size 500MB] [--device cuda|cpu] [--reuse]
"""
import argparse
import json
import os
import sys
import time

SHAPES = {
    "gpt2-small": {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": 50257,
        "n_positions": 2048,
        "n_ctx": 2048,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "use_cache": True,
    },
    "llama-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "use_cache": True,
    },
    "qwen2-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 24,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "use_cache": True,
    },
    "gpt2-tiny": {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": 1000,
        "n_positions": 256,
        "n_ctx": 256,
        "n_embd": 128,
        "n_layer": 3,
        "n_head": 4,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.1,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": True,
    },
    "llama-tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.1,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": True,
    },
    "qwen2-tiny": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 1000,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": 512,
        "max_window_layers": 3,
        "initializer_range": 0.1,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": True,
    },
    "mistral-tiny": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": 1000,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "sliding_window": 256,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": True,
    },
}

DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def die(msg):
    print(f"hf_models.py: {msg}", file=sys.stderr)
    sys.exit(1)


def config_dict(shape, dtype):
    d = json.loads(json.dumps(SHAPES[shape]))  # a deep copy
    d["torch_dtype"] = DTYPES[dtype]
    return d


def write_config(folder, d):
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)
        f.write("\n")


def check_rope(cfg, want):
    """The rope settings transformers reads back from our config.json equal what we wrote
    (transformers 5.x keeps them in `rope_parameters`, 4.x in `rope_theta`/`rope_scaling`)."""
    if "rope_scaling" not in want:
        return
    params = getattr(cfg, "rope_parameters", None) or {}
    scaling = getattr(cfg, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    got = dict(scaling)
    got.update(params)
    if got.get("type") and not got.get("rope_type"):
        got["rope_type"] = got["type"]
    problems = []
    if theta is None or float(theta) != float(want["rope_theta"]):
        problems.append(f"rope_theta {theta!r}, wrote {want['rope_theta']}")
    for k, v in want["rope_scaling"].items():
        if k not in got or (got[k] != v and not (isinstance(v, float) and float(got[k]) == v)):
            problems.append(f"{k} {got.get(k)!r}, wrote {v!r}")
    if problems:
        die("transformers read the rope settings back differently: " + "; ".join(problems))
    print(f"rope as transformers reads it: theta {theta}, {got}", file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default=None, help="e.g. 500MB: shards + index")
    p.add_argument("--device", default=None, help="where to initialise (default cuda if present)")
    p.add_argument("--reuse", action="store_true", help="keep a folder of the same shape, dtype and seed")
    args = p.parse_args()

    stamp = json.dumps(
        {"recipe": 2, "shape": args.shape, "dtype": args.dtype, "seed": args.seed, "shards": args.max_shard_size,
         "config": config_dict(args.shape, args.dtype)},
        sort_keys=True,
    )
    stamp_path = os.path.join(args.out, "hf_models.stamp")
    if args.reuse and os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            if f.read() == stamp:
                print(f"{args.out}: reused ({args.shape}, {args.dtype}, seed {args.seed})")
                return

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no progress bars in the logs

    os.makedirs(args.out, exist_ok=True)
    for name in os.listdir(args.out):
        if name.endswith((".safetensors", ".json", ".stamp", ".bin")):
            os.remove(os.path.join(args.out, name))
    d = config_dict(args.shape, args.dtype)
    write_config(args.out, d)
    cfg = AutoConfig.from_pretrained(args.out)
    check_rope(cfg, d)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.time()
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg)
    if args.shape.endswith("-tiny"):
        # transformers initialises biases to 0 and norm weights to 1; give them random values
        # too, so that the parity check sees every term of the forward.
        with torch.no_grad():
            for name, t in model.named_parameters():
                if t.dim() == 1:
                    base = 1.0 if name.endswith(".weight") else 0.0
                    t.copy_(base + 0.1 * torch.randn(t.shape, device=t.device, dtype=t.dtype))
    model = model.to(getattr(torch, DTYPES[args.dtype])).eval()
    n_params = sum(t.numel() for t in model.parameters())
    for name, t in model.named_parameters():
        if not torch.isfinite(t).all():
            die(f"parameter {name} is not finite after initialisation")
    kwargs = {}
    if args.max_shard_size:
        kwargs["max_shard_size"] = args.max_shard_size
    model.save_pretrained(args.out, **kwargs)
    # save_pretrained wrote its own config.json (5.x: rope_parameters); put the Hub form back.
    write_config(args.out, d)
    files = sorted(os.listdir(args.out))
    if not any(f.endswith(".safetensors") for f in files):
        die(f"no .safetensors written in {args.out}: {files}")
    if any(f.endswith(".bin") for f in files):
        die(f"save_pretrained wrote a .bin in {args.out}: {files}")
    check_rope(AutoConfig.from_pretrained(args.out), d)
    with open(stamp_path, "w") as f:
        f.write(stamp)
    print(f"{args.out}: {args.shape}, {args.dtype}, {n_params / 1e6:.1f} M parameters, seed {args.seed}, "
          f"initialised on {device} in {time.time() - t0:.1f} s: {files}")


if __name__ == "__main__":
    main()
